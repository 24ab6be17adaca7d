//! `Placement::resolve`: every overridable placement input resolved once, in one place.

use std::collections::{BTreeMap, BTreeSet};

use crate::api::{
    DEFAULT_ZONE, NetworkModel, ProxmoxCluster, ProxmoxMachine, RouteSpec, RoutingPolicySpec,
    SecretReference, VrfDevice, ZoneConfigSpec, labels,
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
    /// A template by VMID on a known node (cloned only while Proxmox lists it as a template).
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
    /// The guest takes its IPv4 address by DHCP.
    pub dhcp4: bool,
    /// The guest takes its IPv6 address by DHCPv6 or router advertisement.
    pub dhcp6: bool,
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
        "network device {device:?} sets default{}: true but {} {family} pool; \
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
        Some(z) => format!("neither zone {z:?} nor the cluster has an"),
        None => "the cluster has no".to_owned(),
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
    ha: Option<super::MachineHa>,
    task_limits: super::MachineTaskLimits,
    credentials: Option<SecretReference>,
    pci_mappings: Vec<String>,
    data_disk_bytes: BTreeMap<String, u64>,
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

        let zone_for_ha = zone.clone();
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
            ha: super::ha::ha_for_machine(&cluster.spec, zone_for_ha.as_deref()),
            task_limits: super::task_limits_for_machine(&cluster.spec, zone_for_ha.as_deref()),
            credentials: zone_config
                .and_then(|z| super::failure_domains::own_credentials(&cluster.spec, z))
                .cloned(),
            pci_mappings: machine
                .spec
                .pci_devices
                .iter()
                .map(|d| d.mapping.clone())
                .collect(),
            data_disk_bytes: data_disk_bytes(machine),
        })
    }

    /// The PCI resource mappings of the devices passed through, in `hostpciN` order.
    pub fn pci_mappings(&self) -> &[String] {
        &self.pci_mappings
    }

    /// Devices the machine takes, by mapping.
    pub fn pci_counts(&self) -> BTreeMap<String, u32> {
        let mut counts = BTreeMap::new();
        for mapping in &self.pci_mappings {
            *counts.entry(mapping.clone()).or_insert(0) += 1;
        }
        counts
    }

    /// Bytes of data disks by storage, for the storages the spec names (the boot disk's
    /// storage is only known once the clone exists).
    pub fn data_disk_bytes(&self) -> BTreeMap<String, u64> {
        self.data_disk_bytes.clone()
    }

    /// The credentials of the Proxmox cluster the machine's zone lives in, when the zone names
    /// its own (`zoneConfig[].credentialsRef`); `None`: the cluster's credentials reach it.
    pub fn credentials_ref(&self) -> Option<&SecretReference> {
        self.credentials.as_ref()
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

    /// Whether the effective zone is a failure domain the cluster publishes.
    pub fn is_failure_domain(&self) -> bool {
        self.failure_domain
    }

    /// Value of the `topology.kubernetes.io/proxmox-zone` label: the zone, or `default`.
    pub fn zone_label(&self) -> &str {
        self.zone.as_deref().unwrap_or(DEFAULT_ZONE)
    }

    /// Nodes the VM may be created on, or "the template's node".
    pub fn candidates(&self) -> &NodeCandidates {
        &self.candidates
    }

    /// The same placement with other candidate nodes (those that can receive a clone of the
    /// template, see [`super::CloneSources::narrow`]).
    pub(super) fn with_candidates(&self, nodes: Vec<String>) -> Self {
        Self {
            candidates: NodeCandidates::Nodes(nodes),
            ..self.clone()
        }
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

    /// The Proxmox HA the machine's VM gets (its zone's settings over the cluster's), `None`
    /// when HA is off for it.
    pub fn ha(&self) -> Option<&super::MachineHa> {
        self.ha.as_ref()
    }

    /// How many clone and disk tasks may run at once where the machine's VM is made.
    pub fn task_limits(&self) -> super::MachineTaskLimits {
        self.task_limits
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
    // The cluster's `allowedNodes` names nodes of the Proxmox cluster its own credentials
    // reach; a zone with credentials of its own is another Proxmox cluster.
    let own_endpoint =
        zone.is_some_and(|z| super::failure_domains::own_credentials(&cluster.spec, z).is_some());
    let (allowed, allowed_from) = if machine.spec.allowed_nodes.is_empty() {
        if own_endpoint {
            (Vec::new(), "ProxmoxCluster")
        } else {
            (dedup(&cluster.spec.allowed_nodes), "ProxmoxCluster")
        }
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

fn data_disk_bytes(machine: &ProxmoxMachine) -> BTreeMap<String, u64> {
    const GIB: u64 = 1 << 30;
    let mut bytes = BTreeMap::new();
    let volumes = machine
        .spec
        .disks
        .iter()
        .flat_map(|d| &d.additional_volumes);
    for volume in volumes {
        let Some(storage) = volume.storage.as_ref().or(machine.spec.storage.as_ref()) else {
            continue;
        };
        let size = u64::from(volume.size_gb.max(0).unsigned_abs()) * GIB;
        let total: &mut u64 = bytes.entry(storage.clone()).or_insert(0);
        *total = total.saturating_add(size);
    }
    bytes
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

    // As the Go provider's defaulting webhook did: when no device says `defaultIPvN` at all, the
    // first device takes the default pool of that family, if the cluster (or zone) has one.
    let devices = &machine.spec.network.network_devices;
    let implicit_v4 = devices.iter().all(|d| d.default_ipv4.is_none());
    let implicit_v6 = devices.iter().all(|d| d.default_ipv6.is_none());
    let mut nics = Vec::with_capacity(devices.len());
    let mut unavailable = None;
    for (position, device) in devices.iter().enumerate() {
        let mut refs: Vec<(PoolRef, bool, Option<IpFamily>, Option<String>)> = Vec::new();
        for (wanted, implicit, family) in [
            (device.default_ipv4, implicit_v4, IpFamily::V4),
            (device.default_ipv6, implicit_v6, IpFamily::V6),
        ] {
            let by_dhcp = match family {
                IpFamily::V4 => device.dhcp4,
                IpFamily::V6 => device.dhcp6,
            };
            // A device that takes the family's address by DHCP claims no pool of it.
            let implied = implicit && position == 0 && by_dhcp != Some(true);
            if wanted != Some(true) && !implied {
                continue;
            }
            let Some(pool) = default_pool(&pools, zone_name, family) else {
                // An explicit `true` without a pool of that family claims nothing, as in the
                // Go provider, whose defaulting webhook set both families on every machine it
                // stored; only a machine left without any address is refused (below).
                if !implied && unavailable.is_none() {
                    unavailable = Some(PlacementError::NoDefaultPool {
                        device: device.name.clone(),
                        family,
                        zone: zone_name.map(str::to_owned),
                    });
                }
                continue;
            };
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
            dhcp4: device.dhcp4 == Some(true),
            dhcp6: device.dhcp6 == Some(true),
        });
    }
    let unaddressed = |nic: &ResolvedNic| nic.pools.is_empty() && !nic.dhcp4 && !nic.dhcp6;
    match unavailable {
        Some(error) if nics.iter().all(unaddressed) => Err(error),
        _ => Ok(nics),
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{NetworkDevice, SchedulerHints, TemplateSelector, TypedLocalObjectReference};
    use crate::placement::fixtures::{capi_machine, cluster, ip, machine, publish, strings, zone};

    /// Cluster with rack-a (pve1, pve2; own IPv4 pool and DNS), rack-b (pve3, pve4) and a
    /// network-only zone `lan`; allowed nodes pve1..pve4.
    fn racks() -> ProxmoxCluster {
        let mut a = zone("rack-a", &["pve1", "pve2"]);
        a.ipv4_config = ip("10.1.0.10-10.1.0.90", "10.1.0.1");
        a.dns_servers = Some(strings(&["10.1.0.2"]));
        let mut lan = zone("lan", &[]);
        lan.ipv6_config = ip("2001:db8::/64", "2001:db8::1");
        cluster(
            &["pve1", "pve2", "pve3", "pve4"],
            vec![a, zone("rack-b", &["pve3", "pve4"]), lan],
        )
    }

    fn nodes(items: &[&str]) -> NodeCandidates {
        NodeCandidates::Nodes(strings(items))
    }

    #[test]
    fn effective_zone_table() {
        let c = racks();
        // (case, Machine.failureDomain, network.zone, zone, failure domain)
        type Case = (
            &'static str,
            Option<&'static str>,
            Option<&'static str>,
            Option<&'static str>,
            Option<&'static str>,
        );
        let cases: [Case; 6] = [
            ("nothing set", None, None, None, None),
            (
                "failure domain",
                Some("rack-a"),
                None,
                Some("rack-a"),
                Some("rack-a"),
            ),
            (
                "both equal",
                Some("rack-b"),
                Some("rack-b"),
                Some("rack-b"),
                Some("rack-b"),
            ),
            ("empty failure domain is none", Some(""), None, None, None),
            (
                "network zone with nodes",
                None,
                Some("rack-a"),
                Some("rack-a"),
                Some("rack-a"),
            ),
            ("network-only zone", None, Some("lan"), Some("lan"), None),
        ];
        for (name, fd, nz, want_zone, want_fd) in cases {
            let p = Placement::resolve(
                &c,
                &machine("m1", &[], nz),
                &capi_machine("m1", fd, false, None),
            )
            .unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(p.zone(), want_zone, "{name}");
            assert_eq!(p.failure_domain(), want_fd, "{name}");
            assert_eq!(p.is_failure_domain(), want_fd.is_some(), "{name}");
            assert_eq!(p.zone_label(), want_zone.unwrap_or("default"), "{name}");
        }
    }

    #[test]
    fn failure_domain_and_network_zone_must_agree() {
        let err = Placement::resolve(
            &racks(),
            &machine("m1", &[], Some("rack-b")),
            &capi_machine("m1", Some("rack-a"), false, None),
        )
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "Machine.spec.failureDomain is \"rack-a\" but ProxmoxMachine spec.network.zone is \
             \"rack-b\"; remove spec.network.zone or set it to \"rack-a\""
        );
        assert_eq!(err.reason(), "ZoneConflict");
        assert!(!err.is_retryable());
    }

    #[test]
    fn unpublished_failure_domain_is_retryable() {
        let cases = [
            // A zone the cluster never had.
            (racks(), "rack-z", "it is not in status.failureDomains"),
            // A network-only zone is never published.
            (racks(), "lan", "it is not in status.failureDomains"),
            // Added to the spec, but the cluster controller has not published it yet.
            (
                {
                    let mut c = racks();
                    c.spec.zone_config.push(zone("rack-z", &["pve4"]));
                    c
                },
                "rack-z",
                "it is not in status.failureDomains",
            ),
            // Still published, but its nodes were just removed from the spec.
            (
                {
                    let mut c = racks();
                    c.spec.zone_config[1].nodes.clear();
                    c
                },
                "rack-b",
                "its zone in spec.zoneConfig has no nodes",
            ),
        ];
        for (c, fd, detail) in cases {
            let err = Placement::resolve(
                &c,
                &machine("m1", &[], None),
                &capi_machine("m1", Some(fd), true, None),
            )
            .unwrap_err();
            assert!(err.is_retryable(), "{fd}");
            assert_eq!(err.reason(), "FailureDomainNotReady");
            assert_eq!(
                err.to_string(),
                format!(
                    "failure domain {fd:?} is not ready on ProxmoxCluster \"c1\": {detail} \
                     (published failure domains: \"rack-a\", \"rack-b\"); waiting for the cluster to publish it"
                )
            );
        }
    }

    #[test]
    fn unknown_network_zone_names_the_known_zones() {
        let err = Placement::resolve(
            &racks(),
            &machine("m1", &[], Some("dmz")),
            &capi_machine("m1", None, false, None),
        )
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "spec.network.zone \"dmz\" is not a zone of ProxmoxCluster \"c1\" (zones: \"rack-a\", \
             \"rack-b\", \"lan\"); add it to the cluster's spec.zoneConfig or fix the name"
        );
        assert!(!err.is_retryable());
    }

    #[test]
    fn candidate_nodes_table() {
        let open = cluster(&[], vec![zone("rack-a", &["pve1", "pve2"])]);
        let mut restricted = cluster(
            &["pve2", "pve3", "pve9"],
            vec![zone("rack-a", &["pve1", "pve2", "pve3"])],
        );
        // The zone lists a node the cluster does not allow: failure domains are invalid, so
        // publish what the last good spec had.
        restricted.status = racks().status;
        let none = cluster(&[], vec![]);
        // (case, cluster, machine allowedNodes, failure domain, want)
        type Case<'a> = (
            &'a str,
            &'a ProxmoxCluster,
            &'a [&'a str],
            Option<&'a str>,
            NodeCandidates,
        );
        let cases: Vec<Case> = vec![
            (
                "zone nodes, nothing allowed: zone nodes",
                &open,
                &[],
                Some("rack-a"),
                nodes(&["pve1", "pve2"]),
            ),
            (
                "zone ∩ cluster allowed",
                &restricted,
                &[],
                Some("rack-a"),
                nodes(&["pve2", "pve3"]),
            ),
            (
                "zone ∩ machine allowed over cluster's",
                &restricted,
                &["pve1", "pve9"],
                Some("rack-a"),
                nodes(&["pve1"]),
            ),
            (
                "no zone: cluster allowed",
                &restricted,
                &[],
                None,
                nodes(&["pve2", "pve3", "pve9"]),
            ),
            (
                "no zone: machine allowed",
                &restricted,
                &["pve9", "pve9", "pve1"],
                None,
                nodes(&["pve9", "pve1"]),
            ),
            (
                "nothing configured: template node",
                &none,
                &[],
                None,
                NodeCandidates::TemplateNode,
            ),
            (
                "zone without zone nodes: nothing configured",
                &open,
                &[],
                None,
                NodeCandidates::TemplateNode,
            ),
        ];
        for (name, c, allowed, fd, want) in cases {
            let p = Placement::resolve(
                c,
                &machine("m1", allowed, None),
                &capi_machine("m1", fd, false, None),
            )
            .unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(
                p.needs_scheduling(),
                want != NodeCandidates::TemplateNode,
                "{name}"
            );
            assert_eq!(p.candidates(), &want, "{name}");
        }
    }

    #[test]
    fn a_zone_with_its_own_credentials_resolves_them_and_ignores_the_clusters_allowed_nodes() {
        let mut c = racks();
        c.spec.allowed_nodes = strings(&["pve1", "pve2", "pve3", "pve4"]);
        let site_b = crate::api::SecretReference {
            name: Some("site-b".into()),
            namespace: None,
        };
        let mut remote = zone("site-b", &["pve1", "pve9"]);
        remote.credentials_ref = Some(site_b.clone());
        c.spec.zone_config.push(remote);
        publish(&mut c);
        let p = Placement::resolve(
            &c,
            &machine("m1", &[], None),
            &capi_machine("m1", Some("site-b"), false, None),
        )
        .expect("site-b is a failure domain");
        assert_eq!(p.credentials_ref(), Some(&site_b));
        assert_eq!(p.candidates(), &nodes(&["pve1", "pve9"]));

        let p = Placement::resolve(
            &c,
            &machine("m1", &[], None),
            &capi_machine("m1", Some("rack-a"), false, None),
        )
        .expect("rack-a is a failure domain");
        assert_eq!(p.credentials_ref(), None, "the cluster's own credentials");
    }

    #[test]
    fn network_zone_without_nodes_uses_allowed_nodes() {
        let p = Placement::resolve(
            &racks(),
            &machine("m1", &[], Some("lan")),
            &capi_machine("m1", None, false, None),
        )
        .unwrap();
        assert_eq!(p.candidates(), &nodes(&["pve1", "pve2", "pve3", "pve4"]));
        assert!(p.allows_node("pve3"));
        assert!(!p.allows_node("pve7"));
    }

    #[test]
    fn empty_intersection_names_zone_nodes_and_allowed_nodes() {
        let err = Placement::resolve(
            &racks(),
            &machine("m1", &["pve3"], None),
            &capi_machine("m1", Some("rack-a"), false, None),
        )
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "no Proxmox node may host this machine: zone \"rack-a\" has nodes \"pve1\", \"pve2\" \
             but the allowed nodes (from the ProxmoxMachine's spec.allowedNodes) are \"pve3\"; add a \
             zone node to allowedNodes or pick another failure domain"
        );
        assert_eq!(err.reason(), "NoCandidateNodes");
        let mut c = racks();
        c.spec.allowed_nodes = strings(&["pve3", "pve4"]);
        publish(&mut c);
        // rack-a nodes outside allowedNodes make the config invalid; keep the last good domains.
        c.status = racks().status;
        let err = Placement::resolve(
            &c,
            &machine("m1", &[], None),
            &capi_machine("m1", Some("rack-a"), false, None),
        )
        .unwrap_err();
        assert!(
            err.to_string()
                .contains("(from the ProxmoxCluster's spec.allowedNodes) are \"pve3\", \"pve4\""),
            "{err}"
        );
    }

    fn pool_summary(nic: &ResolvedNic) -> Vec<(String, String, bool, Option<IpFamily>, String)> {
        nic.pools
            .iter()
            .map(|p| {
                (
                    p.pool.kind.clone(),
                    p.pool.name.clone(),
                    p.default_gateway,
                    p.family,
                    p.claim_name.clone(),
                )
            })
            .collect()
    }

    #[test]
    fn pools_zone_defaults_over_cluster_defaults_then_explicit_refs() {
        let mut c = racks();
        c.spec.ipv6_config = ip("fd00::10-fd00::90", "fd00::1");
        let mut m = machine("m1", &[], None);
        let nic = &mut m.spec.network.network_devices[0];
        nic.default_ipv6 = Some(true);
        nic.ip_pool_ref = vec![
            TypedLocalObjectReference {
                api_group: None,
                kind: "GlobalInClusterIPPool".into(),
                name: "shared".into(),
            },
            TypedLocalObjectReference {
                api_group: Some("ipam.cluster.x-k8s.io".into()),
                kind: "InClusterIPPool".into(),
                name: "c1-lan-v6-icip".into(),
            },
        ];
        let v4 = Some(IpFamily::V4);
        let v6 = Some(IpFamily::V6);
        let icip = "InClusterIPPool".to_owned();
        // In rack-a: its own IPv4 pool, the cluster's IPv6 pool (rack-a has none), then the refs.
        let p =
            Placement::resolve(&c, &m, &capi_machine("m1", Some("rack-a"), false, None)).unwrap();
        assert_eq!(
            pool_summary(&p.network_devices()[0]),
            vec![
                (
                    icip.clone(),
                    "c1-rack-a-v4-icip".into(),
                    true,
                    v4,
                    "m1-net0-00-inet".into()
                ),
                (
                    icip.clone(),
                    "c1-v6-icip".into(),
                    true,
                    v6,
                    "m1-net0-01-inet".into()
                ),
                (
                    "GlobalInClusterIPPool".into(),
                    "shared".into(),
                    false,
                    None,
                    "m1-net0-02-inet".into()
                ),
                (
                    icip.clone(),
                    "c1-lan-v6-icip".into(),
                    false,
                    v6,
                    "m1-net0-03-inet".into()
                ),
            ]
        );
        let claims = &p.network_devices()[0].pools;
        assert_eq!(claims[2].pool.api_group, "ipam.cluster.x-k8s.io");
        assert_eq!(claims[0].zone_label.as_deref(), Some("rack-a"));
        assert_eq!(claims[1].zone_label.as_deref(), Some("default"));
        assert_eq!(claims[3].index, 3);
        // Without a zone: the cluster's pools.
        let p = Placement::resolve(&c, &m, &capi_machine("m1", None, false, None)).unwrap();
        assert_eq!(claims.len(), p.network_devices()[0].pools.len());
        assert_eq!(p.network_devices()[0].pools[0].pool.name, "c1-v4-icip");
        // In the lan zone: the cluster's IPv4 pool, lan's own IPv6 pool.
        let mut m_lan = m.clone();
        m_lan.spec.network.zone = Some("lan".into());
        let p = Placement::resolve(&c, &m_lan, &capi_machine("m1", None, false, None)).unwrap();
        let names: Vec<&str> = p.network_devices()[0]
            .pools
            .iter()
            .map(|p| p.pool.name.as_str())
            .collect();
        assert_eq!(
            names,
            ["c1-v4-icip", "c1-lan-v6-icip", "shared", "c1-lan-v6-icip"]
        );
    }

    #[test]
    fn a_default_family_without_a_pool_claims_nothing_when_others_give_addresses() {
        // What the Go provider's defaulting webhook stored on every machine of an IPv4 cluster.
        let mut m = machine("m1", &[], None);
        m.spec.network.network_devices[0].default_ipv4 = Some(true);
        m.spec.network.network_devices[0].default_ipv6 = Some(true);
        let placement = Placement::resolve(
            &racks(),
            &m,
            &capi_machine("m1", Some("rack-b"), false, None),
        )
        .expect("the IPv4 pool is enough");
        let families: Vec<Option<IpFamily>> = placement.network_devices()[0]
            .pools
            .iter()
            .map(|p| p.family)
            .collect();
        assert_eq!(families, [Some(IpFamily::V4)]);
    }

    #[test]
    fn a_machine_left_without_any_pool_is_an_error() {
        let mut m = machine("m1", &[], None);
        m.spec.network.network_devices[0].default_ipv4 = Some(false);
        m.spec.network.network_devices[0].default_ipv6 = Some(true);
        let err = Placement::resolve(
            &racks(),
            &m,
            &capi_machine("m1", Some("rack-b"), false, None),
        )
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "network device \"net0\" sets defaultIPv6: true but neither zone \"rack-b\" nor the \
             cluster has an IPv6 pool; set ipv6Config on the ProxmoxCluster (or its zone) or unset defaultIPv6"
        );
        let err =
            Placement::resolve(&racks(), &m, &capi_machine("m1", None, false, None)).unwrap_err();
        assert!(
            err.to_string().contains("but the cluster has no IPv6 pool"),
            "{err}"
        );
    }

    #[test]
    fn first_device_takes_the_default_pools_when_no_device_says() {
        let families = |m: &ProxmoxMachine, c: &ProxmoxCluster| -> Vec<Vec<Option<IpFamily>>> {
            Placement::resolve(c, m, &capi_machine("m1", None, false, None))
                .unwrap()
                .network_devices()
                .iter()
                .map(|nic| nic.pools.iter().map(|p| p.family).collect())
                .collect()
        };
        let mut m = machine("m1", &[], None);
        m.spec.network.network_devices[0].default_ipv4 = None;
        m.spec.network.network_devices.push(NetworkDevice {
            name: "net1".into(),
            ..Default::default()
        });
        let v4 = Some(IpFamily::V4);
        let v6 = Some(IpFamily::V6);
        // The cluster has no IPv6 pool: only the IPv4 default is implied, and no error.
        assert_eq!(families(&m, &racks()), [vec![v4], vec![]]);
        let mut dual = racks();
        dual.spec.ipv6_config = ip("fd00::10-fd00::90", "fd00::1");
        assert_eq!(families(&m, &dual), [vec![v4, v6], vec![]]);
        // An explicit choice on any device turns the implied default of that family off.
        m.spec.network.network_devices[0].default_ipv4 = Some(false);
        assert_eq!(families(&m, &dual), [vec![v6], vec![]]);
        m.spec.network.network_devices[1].default_ipv6 = Some(true);
        assert_eq!(families(&m, &dual), [vec![], vec![v6]]);
    }

    #[test]
    fn a_dhcp_device_takes_no_pool_of_its_family_and_counts_as_addressed() {
        let resolve = |m: &ProxmoxMachine, c: &ProxmoxCluster| {
            Placement::resolve(c, m, &capi_machine("m1", None, false, None))
        };
        let mut dual = racks();
        dual.spec.ipv6_config = ip("fd00::10-fd00::90", "fd00::1");
        let mut m = machine("m1", &[], None);
        m.spec.network.network_devices[0].default_ipv4 = None;
        m.spec.network.network_devices[0].dhcp4 = Some(true);
        let p = resolve(&m, &dual).unwrap();
        let nic = &p.network_devices()[0];
        assert!(nic.dhcp4 && !nic.dhcp6);
        let families: Vec<_> = nic.pools.iter().map(|p| p.family).collect();
        assert_eq!(
            families,
            [Some(IpFamily::V6)],
            "the IPv6 default stays implied"
        );
        m.spec.network.network_devices[0].dhcp6 = Some(true);
        let p = resolve(&m, &dual).unwrap();
        assert!(p.network_devices()[0].pools.is_empty());
        // An explicit default without a pool is no error when DHCP gives the address.
        m.spec.network.network_devices[0].default_ipv6 = Some(true);
        m.spec.network.network_devices[0].dhcp6 = None;
        let no_v6 = racks();
        assert!(resolve(&m, &no_v6).is_ok());
    }

    #[test]
    fn dns_servers_nic_over_zone_over_cluster() {
        let mut m = machine("m1", &[], None);
        m.spec.network.network_devices.push(NetworkDevice {
            name: "net1".into(),
            dns_servers: Some(strings(&["9.9.9.9"])),
            ..Default::default()
        });
        let dns = |fd: Option<&str>| -> Vec<Vec<String>> {
            Placement::resolve(&racks(), &m, &capi_machine("m1", fd, false, None))
                .unwrap()
                .network_devices()
                .iter()
                .map(|n| n.dns_servers.clone())
                .collect()
        };
        assert_eq!(
            dns(Some("rack-a")),
            vec![strings(&["10.1.0.2"]), strings(&["9.9.9.9"])]
        );
        assert_eq!(
            dns(Some("rack-b")),
            vec![strings(&["10.0.0.2"]), strings(&["9.9.9.9"])]
        );
        assert_eq!(
            dns(None),
            vec![strings(&["10.0.0.2"]), strings(&["9.9.9.9"])]
        );
    }

    #[test]
    fn nic_fields_are_carried_with_defaults() {
        let mut m = machine("m1", &[], None);
        m.spec.network.network_devices.push(NetworkDevice {
            name: "net1".into(),
            bridge: Some("vmbr1".into()),
            model: Some(NetworkModel::E1000),
            mtu: Some(1),
            vlan: Some(42),
            queues: Some(4),
            link_mtu: Some(9000),
            routes: Some(vec![RouteSpec {
                to: Some("10.9.0.0/16".into()),
                via: Some("10.0.0.254".into()),
                ..Default::default()
            }]),
            ..Default::default()
        });
        m.spec.network.vrfs = vec![VrfDevice {
            name: "vrf-a".into(),
            table: 500,
            interfaces: strings(&["net1"]),
            ..Default::default()
        }];
        let p = Placement::resolve(&racks(), &m, &capi_machine("m1", None, false, None)).unwrap();
        let [net0, net1] = p.network_devices() else {
            panic!("two NICs")
        };
        assert_eq!(
            (net0.name.as_str(), net0.model, net0.bridge.as_deref()),
            ("net0", NetworkModel::Virtio, Some("vmbr0"))
        );
        assert_eq!(net1.model, NetworkModel::E1000);
        assert_eq!(
            (net1.mtu, net1.vlan, net1.queues, net1.link_mtu),
            (Some(1), Some(42), Some(4), Some(9000))
        );
        assert_eq!(net1.routes.len(), 1);
        assert!(net1.routing_policy.is_empty());
        assert!(
            net1.pools.is_empty(),
            "no defaultIPv4/6 and no refs: no claims"
        );
        assert_eq!(p.vrfs()[0].name, "vrf-a");
    }

    #[test]
    fn template_source_table() {
        let c = racks();
        let cm = capi_machine("m1", None, false, None);
        let by_id = machine("m1", &[], None);
        assert_eq!(
            Placement::resolve(&c, &by_id, &cm).unwrap().template(),
            &TemplateSource::Id {
                vmid: 100,
                node: "pve1".into()
            }
        );
        let mut by_tags = by_id.clone();
        by_tags.spec.template_id = None;
        by_tags.spec.source_node = None;
        by_tags.spec.template_selector = Some(TemplateSelector {
            match_tags: strings(&["Ubuntu", "k8s"]),
            match_policy: None,
        });
        let TemplateSource::Tags(sel) = Placement::resolve(&c, &by_tags, &cm)
            .unwrap()
            .template()
            .clone()
        else {
            panic!("tags")
        };
        assert_eq!(sel.tags(), ["k8s", "ubuntu"]);
        let mut both = by_tags.clone();
        both.spec.template_id = Some(100);
        let mut neither = by_tags.clone();
        neither.spec.template_selector = None;
        for m in [both, neither] {
            let err = Placement::resolve(&c, &m, &cm).unwrap_err();
            assert_eq!(err, PlacementError::InvalidTemplateSource);
            assert_eq!(
                err.to_string(),
                "the template must be given either as templateID with sourceNode, or as templateSelector"
            );
            assert_eq!(err.reason(), "InvalidSpec");
        }
    }

    #[test]
    fn scheduler_inputs_table() {
        let mut c = racks();
        let m = machine("m1", &[], None);
        let p = Placement::resolve(
            &c,
            &m,
            &capi_machine("m1", None, true, Some(("KubeadmControlPlane", "kcp"))),
        )
        .unwrap();
        assert_eq!(p.machine_name(), "m1");
        assert_eq!(p.memory_adjustment(), 100, "unset means 100");
        assert_eq!(p.requested_memory_bytes(), Some(2048 * 1024 * 1024));
        assert_eq!(p.role(), MachineRole::ControlPlane);
        assert_eq!(
            p.owner(),
            Some(&MachineOwner {
                kind: "KubeadmControlPlane".into(),
                name: "kcp".into()
            })
        );

        c.spec.scheduler_hints = Some(SchedulerHints {
            memory_adjustment: Some(0),
        });
        let mut m2 = m.clone();
        m2.spec.memory_mib = None;
        let mut worker = capi_machine("m2", None, false, Some(("MachineSet", "md-0-abcde")));
        worker
            .metadata
            .labels
            .as_mut()
            .unwrap()
            .insert(labels::DEPLOYMENT_NAME.into(), "md-0".into());
        let p = Placement::resolve(&c, &m2, &worker).unwrap();
        assert_eq!(p.memory_adjustment(), 0);
        assert_eq!(p.requested_memory_bytes(), None);
        assert_eq!(p.role(), MachineRole::Worker);
        assert_eq!(
            p.owner(),
            Some(&MachineOwner {
                kind: "MachineDeployment".into(),
                name: "md-0".into()
            }),
            "the deployment label wins over the MachineSet that changes on rollout"
        );
        let orphan = capi_machine("m3", None, false, None);
        assert_eq!(machine_owner(&orphan), None);
    }

    #[test]
    fn machine_without_name_is_refused() {
        let mut m = machine("m1", &[], None);
        m.metadata.name = None;
        let err =
            Placement::resolve(&racks(), &m, &capi_machine("m1", None, false, None)).unwrap_err();
        assert_eq!(err, PlacementError::MissingName);
        assert_eq!(err.to_string(), "the ProxmoxMachine has no metadata.name");
    }
}
