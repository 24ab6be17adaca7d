//! `Placement::resolve`: every overridable placement input resolved once, in one place.

use std::collections::BTreeSet;

use crate::api::{
    DEFAULT_ZONE, NetworkModel, ProxmoxCluster, ProxmoxMachine, RouteSpec, RoutingPolicySpec,
    VrfDevice, ZoneConfigSpec, labels,
};
use crate::capi::{IPAM_GROUP, Machine};

use super::failure_domains::quoted_list;
use super::pools::{IpFamily, PoolRef, claim_name, cluster_pools, default_pool};
use super::templates::TagSelector;

const MIB: u64 = 1024 * 1024;

/// Whether a machine is part of the control plane, for spreading by role.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum MachineRole {
    /// The Machine carries the `cluster.x-k8s.io/control-plane` label.
    ControlPlane,
    /// Any other Machine.
    Worker,
}

/// The object whose machines should be spread over nodes (a KubeadmControlPlane, a MachineDeployment, ...).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct MachineOwner {
    /// Kind of the owner.
    pub kind: String,
    /// Name of the owner.
    pub name: String,
}

/// Owner of a CAPI Machine for spreading: its MachineDeployment (from the
/// `cluster.x-k8s.io/deployment-name` label, stable across MachineSet rollouts), else its
/// controller owner reference.
pub fn machine_owner(machine: &Machine) -> Option<MachineOwner> {
    let deployment = machine
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(labels::DEPLOYMENT_NAME))
        .filter(|n| !n.is_empty());
    if let Some(name) = deployment {
        return Some(MachineOwner {
            kind: "MachineDeployment".to_owned(),
            name: name.clone(),
        });
    }
    machine
        .metadata
        .owner_references
        .as_ref()?
        .iter()
        .find(|r| r.controller == Some(true))
        .map(|r| MachineOwner {
            kind: r.kind.clone(),
            name: r.name.clone(),
        })
}

/// Role of a CAPI Machine: control plane when it carries the control-plane label.
pub fn machine_role(machine: &Machine) -> MachineRole {
    let is_cp = machine
        .metadata
        .labels
        .as_ref()
        .is_some_and(|l| l.contains_key(labels::CONTROL_PLANE));
    if is_cp {
        MachineRole::ControlPlane
    } else {
        MachineRole::Worker
    }
}

/// Where the VM may be created.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NodeCandidates {
    /// Schedule onto one of these nodes (non-empty, in configuration order, no duplicates).
    Nodes(Vec<String>),
    /// Nothing constrains the node: clone on the template's node without scheduling (as the Go provider does).
    TemplateNode,
}

/// Where the template to clone comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TemplateSource {
    /// A template by VMID on a known node.
    Id {
        /// VMID of the template.
        vmid: i32,
        /// Node holding the template.
        node: String,
    },
    /// A template chosen by tags (see [`super::select_template`]).
    Tags(TagSelector),
}

/// One pool a NIC claims an address from, in claim order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolClaim {
    /// The pool to claim from.
    pub pool: PoolRef,
    /// Position among the NIC's pools (the `pool-ref-counter` annotation).
    pub index: usize,
    /// Name of the `IPAddressClaim`: `<machine>-<netN>-<NN>-inet`.
    pub claim_name: String,
    /// True for the zone/cluster default pool: its gateway becomes the default route.
    pub default_gateway: bool,
    /// IP family when known (the cluster's own pools); `None` for other pools until read.
    pub family: Option<IpFamily>,
    /// Zone label of the pool when it is one of the cluster's own (`default` for cluster-wide).
    pub zone_label: Option<String>,
}

/// A NIC with every inherited value resolved.
#[derive(Clone, Debug, PartialEq)]
pub struct ResolvedNic {
    /// Proxmox NIC name (`net0`, ...).
    pub name: String,
    /// Proxmox bridge.
    pub bridge: Option<String>,
    /// NIC model (virtio when unset).
    pub model: NetworkModel,
    /// Proxmox-side MTU.
    pub mtu: Option<i32>,
    /// VLAN tag.
    pub vlan: Option<i32>,
    /// Multiqueue count.
    pub queues: Option<i32>,
    /// Guest-side MTU.
    pub link_mtu: Option<i32>,
    /// Static routes.
    pub routes: Vec<RouteSpec>,
    /// Policy routing rules.
    pub routing_policy: Vec<RoutingPolicySpec>,
    /// Pools to claim from, in order: default IPv4, default IPv6, then explicit `ipPoolRef`s.
    pub pools: Vec<PoolClaim>,
    /// DNS servers: the NIC's, else the zone's, else the cluster's.
    pub dns_servers: Vec<String>,
}

/// Why a machine cannot be placed (yet).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PlacementError {
    /// The ProxmoxMachine has no name.
    #[error("the ProxmoxMachine has no metadata.name")]
    MissingName,
    /// The Machine's failure domain and the machine's network zone disagree.
    #[error(
        "Machine.spec.failureDomain is {failure_domain:?} but ProxmoxMachine spec.network.zone is \
         {network_zone:?}; remove spec.network.zone or set it to {failure_domain:?}"
    )]
    ZoneConflict {
        /// `Machine.spec.failureDomain`.
        failure_domain: String,
        /// `ProxmoxMachine.spec.network.zone`.
        network_zone: String,
    },
    /// The Machine names a failure domain the cluster does not publish (yet); retried.
    #[error(
        "failure domain {name:?} is not ready on ProxmoxCluster {cluster:?}: {detail} \
         (published failure domains: {}); waiting for the cluster to publish it",
        quoted_list(.published)
    )]
    FailureDomainNotReady {
        /// ProxmoxCluster name.
        cluster: String,
        /// The failure domain asked for.
        name: String,
        /// What is missing.
        detail: String,
        /// The failure domains the cluster publishes.
        published: Vec<String>,
    },
    /// `spec.network.zone` names a zone the cluster does not configure.
    #[error(
        "spec.network.zone {zone:?} is not a zone of ProxmoxCluster {cluster:?} (zones: {}); \
         add it to the cluster's spec.zoneConfig or fix the name",
        quoted_list(.known)
    )]
    UnknownZone {
        /// ProxmoxCluster name.
        cluster: String,
        /// The zone asked for.
        zone: String,
        /// Zones the cluster configures.
        known: Vec<String>,
    },
    /// The zone's nodes and the allowed nodes have nothing in common.
    #[error(
        "no Proxmox node may host this machine: zone {zone:?} has nodes {} but the allowed nodes \
         (from the {allowed_from}'s spec.allowedNodes) are {}; add a zone node to allowedNodes \
         or pick another failure domain",
        quoted_list(.zone_nodes),
        quoted_list(.allowed_nodes)
    )]
    NoCandidateNodes {
        /// The effective zone.
        zone: String,
        /// Nodes of the zone.
        zone_nodes: Vec<String>,
        /// The allowed nodes in effect.
        allowed_nodes: Vec<String>,
        /// `ProxmoxMachine` or `ProxmoxCluster`: where the allowed nodes came from.
        allowed_from: &'static str,
    },
    /// A NIC asks for a default pool of a family that neither its zone nor the cluster has.
    #[error(
        "network device {device:?} sets default{}: true but {} has no {family} pool; \
         set ipv{}Config on the ProxmoxCluster (or its zone) or unset default{}",
        family_field(*.family),
        zone_text(.zone),
        family_digit(*.family),
        family_field(*.family)
    )]
    NoDefaultPool {
        /// The NIC name.
        device: String,
        /// The family asked for.
        family: IpFamily,
        /// The effective zone.
        zone: Option<String>,
    },
    /// Neither (or both) of templateID+sourceNode and templateSelector is set.
    #[error(
        "the template must be given either as templateID with sourceNode, or as templateSelector"
    )]
    InvalidTemplateSource,
}

fn family_field(f: IpFamily) -> &'static str {
    match f {
        IpFamily::V4 => "IPv4",
        IpFamily::V6 => "IPv6",
    }
}

fn family_digit(f: IpFamily) -> &'static str {
    match f {
        IpFamily::V4 => "4",
        IpFamily::V6 => "6",
    }
}

fn zone_text(zone: &Option<String>) -> String {
    match zone {
        Some(z) => format!("neither zone {z:?} nor the cluster"),
        None => "the cluster".to_owned(),
    }
}

impl PlacementError {
    /// True when waiting (for the cluster to catch up) can fix it without a user change.
    pub fn is_retryable(&self) -> bool {
        matches!(self, Self::FailureDomainNotReady { .. })
    }

    /// Condition reason for the machine's `VirtualMachineProvisioned` condition.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::FailureDomainNotReady { .. } => "FailureDomainNotReady",
            Self::ZoneConflict { .. } => "ZoneConflict",
            Self::UnknownZone { .. } => "UnknownZone",
            Self::NoCandidateNodes { .. } => "NoCandidateNodes",
            Self::NoDefaultPool { .. } => "NoDefaultPool",
            Self::MissingName | Self::InvalidTemplateSource => "InvalidSpec",
        }
    }
}

/// Everything about where and how a machine's VM is created, resolved once from the cluster, the
/// ProxmoxMachine and its CAPI Machine. Scheduler, IPAM, VM creation and cloud-init take only this;
/// the raw `allowedNodes`, `network.zone` and zone configs are not reachable through it.
#[derive(Clone, Debug, PartialEq)]
pub struct Placement {
    machine: String,
    zone: Option<String>,
    failure_domain: bool,
    candidates: NodeCandidates,
    networks: Vec<ResolvedNic>,
    vrfs: Vec<VrfDevice>,
    template: TemplateSource,
    memory_adjustment: u64,
    requested_memory_bytes: Option<u64>,
    owner: Option<MachineOwner>,
    role: MachineRole,
}

/// Keeps the first occurrence of each name.
fn dedup(names: &[String]) -> Vec<String> {
    let mut seen = BTreeSet::new();
    names
        .iter()
        .filter(|n| seen.insert(n.as_str()))
        .cloned()
        .collect()
}

impl Placement {
    /// Resolves the placement of `machine` (owned by `capi_machine`) in `cluster`.
    pub fn resolve(
        cluster: &ProxmoxCluster,
        machine: &ProxmoxMachine,
        capi_machine: &Machine,
    ) -> Result<Self, PlacementError> {
        let name = machine
            .metadata
            .name
            .clone()
            .filter(|n| !n.is_empty())
            .ok_or(PlacementError::MissingName)?;
        let cluster_name = cluster.metadata.name.clone().unwrap_or_default();

        let (zone, zone_config, failure_domain) =
            resolve_zone(cluster, &cluster_name, machine, capi_machine)?;
        let candidates = resolve_candidates(cluster, machine, zone_config)?;
        let networks = resolve_networks(cluster, machine, &name, zone_config)?;
        let template = resolve_template(machine)?;

        let memory_adjustment = cluster
            .spec
            .scheduler_hints
            .as_ref()
            .and_then(|h| h.memory_adjustment)
            .unwrap_or(100)
            .max(0)
            .unsigned_abs();
        let requested_memory_bytes = machine
            .spec
            .memory_mib
            .map(|m| u64::from(m.max(0).unsigned_abs()) * MIB);

        Ok(Self {
            machine: name,
            zone,
            failure_domain,
            candidates,
            networks,
            vrfs: machine.spec.network.vrfs.clone(),
            template,
            memory_adjustment,
            requested_memory_bytes,
            owner: machine_owner(capi_machine),
            role: machine_role(capi_machine),
        })
    }

    /// Name of the ProxmoxMachine this placement is for.
    pub fn machine_name(&self) -> &str {
        &self.machine
    }

    /// The effective zone: the Machine's failure domain, else the network zone, else none.
    pub fn zone(&self) -> Option<&str> {
        self.zone.as_deref()
    }

    /// The zone when it is a published failure domain: what goes into `status.failureDomain`.
    pub fn failure_domain(&self) -> Option<&str> {
        self.zone.as_deref().filter(|_| self.failure_domain)
    }

    /// Value of the `topology.kubernetes.io/proxmox-zone` label: the zone, or `default`.
    pub fn zone_label(&self) -> &str {
        self.zone.as_deref().unwrap_or(DEFAULT_ZONE)
    }

    /// Nodes the VM may be created on, or "the template's node".
    pub fn candidates(&self) -> &NodeCandidates {
        &self.candidates
    }

    /// Whether the scheduler must choose a node (false: clone on the template's node).
    pub fn needs_scheduling(&self) -> bool {
        matches!(self.candidates, NodeCandidates::Nodes(_))
    }

    /// Whether `node` is one the VM may run on (any node when the template's node is used).
    pub fn allows_node(&self, node: &str) -> bool {
        match &self.candidates {
            NodeCandidates::Nodes(nodes) => nodes.iter().any(|n| n == node),
            NodeCandidates::TemplateNode => true,
        }
    }

    /// The NICs in spec order, with pools and DNS resolved.
    pub fn network_devices(&self) -> &[ResolvedNic] {
        &self.networks
    }

    /// VRF devices of the guest.
    pub fn vrfs(&self) -> &[VrfDevice] {
        &self.vrfs
    }

    /// Where the template comes from.
    pub fn template(&self) -> &TemplateSource {
        &self.template
    }

    /// Percentage of node memory that may be promised to guests; 0 disables memory accounting.
    pub fn memory_adjustment(&self) -> u64 {
        self.memory_adjustment
    }

    /// Memory the machine asks for (`memoryMiB` in bytes); `None` means "the template's".
    pub fn requested_memory_bytes(&self) -> Option<u64> {
        self.requested_memory_bytes
    }

    /// The owner to spread the machine's siblings over nodes by.
    pub fn owner(&self) -> Option<&MachineOwner> {
        self.owner.as_ref()
    }

    /// Control plane or worker.
    pub fn role(&self) -> MachineRole {
        self.role
    }
}

type ZoneResolution<'a> = (Option<String>, Option<&'a ZoneConfigSpec>, bool);

fn resolve_zone<'a>(
    cluster: &'a ProxmoxCluster,
    cluster_name: &str,
    machine: &ProxmoxMachine,
    capi_machine: &Machine,
) -> Result<ZoneResolution<'a>, PlacementError> {
    // KCP writes "" when no domain is eligible: that means "no failure domain".
    let fd = capi_machine
        .spec
        .failure_domain
        .as_deref()
        .filter(|z| !z.is_empty());
    let network_zone = machine
        .spec
        .network
        .zone
        .as_deref()
        .filter(|z| !z.is_empty());
    let published: Vec<String> = cluster
        .status
        .as_ref()
        .map(|s| s.failure_domains.iter().map(|d| d.name.clone()).collect())
        .unwrap_or_default();
    let find = |zone: &str| cluster.spec.zone_config.iter().find(|z| z.zone == zone);

    match (fd, network_zone) {
        (Some(fd), Some(nz)) if fd != nz => Err(PlacementError::ZoneConflict {
            failure_domain: fd.to_owned(),
            network_zone: nz.to_owned(),
        }),
        (Some(fd), _) => {
            let not_ready = |detail: &str| PlacementError::FailureDomainNotReady {
                cluster: cluster_name.to_owned(),
                name: fd.to_owned(),
                detail: detail.to_owned(),
                published: published.clone(),
            };
            if !published.iter().any(|p| p == fd) {
                return Err(not_ready("it is not in status.failureDomains"));
            }
            match find(fd) {
                Some(z) if !z.nodes.is_empty() => Ok((Some(fd.to_owned()), Some(z), true)),
                Some(_) => Err(not_ready("its zone in spec.zoneConfig has no nodes")),
                None => Err(not_ready("spec.zoneConfig has no zone of that name")),
            }
        }
        (None, Some(nz)) => match find(nz) {
            Some(z) => {
                let is_fd = !z.nodes.is_empty() && published.iter().any(|p| p == nz);
                Ok((Some(nz.to_owned()), Some(z), is_fd))
            }
            None => Err(PlacementError::UnknownZone {
                cluster: cluster_name.to_owned(),
                zone: nz.to_owned(),
                known: cluster
                    .spec
                    .zone_config
                    .iter()
                    .map(|z| z.zone.clone())
                    .collect(),
            }),
        },
        (None, None) => Ok((None, None, false)),
    }
}

fn resolve_candidates(
    cluster: &ProxmoxCluster,
    machine: &ProxmoxMachine,
    zone: Option<&ZoneConfigSpec>,
) -> Result<NodeCandidates, PlacementError> {
    let (allowed, allowed_from) = if machine.spec.allowed_nodes.is_empty() {
        (dedup(&cluster.spec.allowed_nodes), "ProxmoxCluster")
    } else {
        (dedup(&machine.spec.allowed_nodes), "ProxmoxMachine")
    };
    let zone_nodes = zone.map(|z| dedup(&z.nodes)).unwrap_or_default();
    match (zone, zone_nodes.is_empty(), allowed.is_empty()) {
        (Some(zone), false, _) => {
            let nodes: Vec<String> = if allowed.is_empty() {
                zone_nodes.clone()
            } else {
                zone_nodes
                    .iter()
                    .filter(|n| allowed.contains(n))
                    .cloned()
                    .collect()
            };
            if nodes.is_empty() {
                Err(PlacementError::NoCandidateNodes {
                    zone: zone.zone.clone(),
                    zone_nodes,
                    allowed_nodes: allowed,
                    allowed_from,
                })
            } else {
                Ok(NodeCandidates::Nodes(nodes))
            }
        }
        (_, _, false) => Ok(NodeCandidates::Nodes(allowed)),
        (_, _, true) => Ok(NodeCandidates::TemplateNode),
    }
}

fn resolve_networks(
    cluster: &ProxmoxCluster,
    machine: &ProxmoxMachine,
    machine_name: &str,
    zone: Option<&ZoneConfigSpec>,
) -> Result<Vec<ResolvedNic>, PlacementError> {
    let pools = cluster_pools(cluster);
    let zone_name = zone.map(|z| z.zone.as_str());
    let non_empty = |v: Option<&Vec<String>>| v.filter(|v| !v.is_empty()).cloned();
    let inherited_dns = non_empty(zone.and_then(|z| z.dns_servers.as_ref()))
        .unwrap_or_else(|| cluster.spec.dns_servers.clone());

    let mut nics = Vec::with_capacity(machine.spec.network.network_devices.len());
    for device in &machine.spec.network.network_devices {
        let mut refs: Vec<(PoolRef, bool, Option<IpFamily>, Option<String>)> = Vec::new();
        for (wanted, family) in [
            (device.default_ipv4, IpFamily::V4),
            (device.default_ipv6, IpFamily::V6),
        ] {
            if wanted != Some(true) {
                continue;
            }
            let pool = default_pool(&pools, zone_name, family).ok_or_else(|| {
                PlacementError::NoDefaultPool {
                    device: device.name.clone(),
                    family,
                    zone: zone_name.map(str::to_owned),
                }
            })?;
            refs.push((
                PoolRef::in_cluster(pool.name.clone()),
                true,
                Some(family),
                Some(pool.zone_label().to_owned()),
            ));
        }
        for r in &device.ip_pool_ref {
            let pool = PoolRef {
                api_group: r
                    .api_group
                    .clone()
                    .filter(|g| !g.is_empty())
                    .unwrap_or_else(|| IPAM_GROUP.to_owned()),
                kind: r.kind.clone(),
                name: r.name.clone(),
            };
            // One of the cluster's own pools named explicitly: its family and zone are known.
            let own = pools
                .iter()
                .find(|p| pool == PoolRef::in_cluster(p.name.clone()));
            refs.push((
                pool,
                false,
                own.map(|p| p.family),
                own.map(|p| p.zone_label().to_owned()),
            ));
        }
        let pools = refs
            .into_iter()
            .enumerate()
            .map(
                |(index, (pool, default_gateway, family, zone_label))| PoolClaim {
                    pool,
                    index,
                    claim_name: claim_name(machine_name, &device.name, index),
                    default_gateway,
                    family,
                    zone_label,
                },
            )
            .collect();
        nics.push(ResolvedNic {
            name: device.name.clone(),
            bridge: device.bridge.clone(),
            model: device.model.unwrap_or_default(),
            mtu: device.mtu,
            vlan: device.vlan,
            queues: device.queues,
            link_mtu: device.link_mtu,
            routes: device.routes.clone().unwrap_or_default(),
            routing_policy: device.routing_policy.clone().unwrap_or_default(),
            pools,
            dns_servers: non_empty(device.dns_servers.as_ref())
                .unwrap_or_else(|| inherited_dns.clone()),
        });
    }
    Ok(nics)
}

fn resolve_template(machine: &ProxmoxMachine) -> Result<TemplateSource, PlacementError> {
    let spec = &machine.spec;
    match (&spec.template_selector, spec.template_id, &spec.source_node) {
        (Some(selector), None, None) => Ok(TemplateSource::Tags(TagSelector::new(selector))),
        (None, Some(vmid), Some(node)) if !node.is_empty() => Ok(TemplateSource::Id {
            vmid,
            node: node.clone(),
        }),
        _ => Err(PlacementError::InvalidTemplateSource),
    }
}
