//! `ProxmoxCluster` and `ProxmoxClusterTemplate` (v1alpha2), with failure domains from zones.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::common::{
    ApiEndpoint, Initialization, IpConfigSpec, LocalObjectReference, SecretReference,
    TemplateObjectMeta, ZONE_PATTERN, conditions_schema,
};
use super::names::{NODE_MAX_LEN, NODE_PATTERN};

/// Desired state of the Proxmox side of a workload cluster: nodes, zones, networks, credentials.
// kube's `printcolumn(...)` repeats `type_` by design; clippy mistakes that for a duplicate.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "infrastructure.cluster.x-k8s.io",
    version = "v1alpha2",
    kind = "ProxmoxCluster",
    doc = "The Proxmox side of a CAPI cluster: nodes, zones (failure domains), IP pools, credentials.",
    namespaced,
    status = "ProxmoxClusterStatus",
    shortname = "moxc",
    category = "cluster-api",
    label("cluster.x-k8s.io/v1beta2", "v1alpha2"),
    printcolumn(
        name = "Cluster",
        type_ = "string",
        description = "Cluster to which this ProxmoxCluster belongs",
        json_path = ".metadata.labels['cluster\\.x-k8s\\.io/cluster-name']"
    ),
    printcolumn(
        name = "Ready",
        type_ = "string",
        description = "Infrastructure is provisioned",
        json_path = ".status.initialization.provisioned"
    ),
    printcolumn(
        name = "Endpoint",
        type_ = "string",
        description = "Control plane API endpoint",
        json_path = ".spec.controlPlaneEndpoint"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "has(self.ipv4Config) || has(self.ipv6Config)",
     "message": "at least one ip config must be set, either ipv4Config or ipv6Config"}
]))]
pub struct ProxmoxClusterSpec {
    /// Endpoint of the workload cluster's API server; usually a virtual IP in front of the control plane.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend(
        "minProperties" = 1,
        "x-kubernetes-validations" = [{"rule": "self.port > 0 && self.port < 65536", "message": "port must be within 1-65535"}]
    ))]
    pub control_plane_endpoint: Option<ApiEndpoint>,
    /// Set when an external control plane provider (not machines of this cluster) serves the API endpoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = false))]
    pub external_managed_control_plane: Option<bool>,
    /// Proxmox nodes machines of this cluster may run on; empty means the template's node.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(
        inner(length(max = NODE_MAX_LEN), pattern(NODE_PATTERN)),
        extend("x-kubernetes-list-type" = "set")
    )]
    pub allowed_nodes: Vec<String>,
    /// Tuning of the memory-aware node scheduler.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scheduler_hints: Option<SchedulerHints>,
    /// Cluster-wide IPv4 pool, used by NICs with `defaultIPv4` outside zones with their own pool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("x-kubernetes-validations" = [
        {"rule": "self.addresses.size() > 0", "message": "IPv4Config addresses must be provided"}
    ]))]
    pub ipv4_config: Option<IpConfigSpec>,
    /// Cluster-wide IPv6 pool, used by NICs with `defaultIPv6` outside zones with their own pool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("x-kubernetes-validations" = [
        {"rule": "self.addresses.size() > 0", "message": "IPv6Config addresses must be provided"}
    ]))]
    pub ipv6_config: Option<IpConfigSpec>,
    /// DNS servers for machines whose zone and NIC do not name their own.
    #[schemars(length(min = 1), extend("x-kubernetes-list-type" = "set"))]
    pub dns_servers: Vec<String>,
    /// Zones (racks, rooms, sites): a zone with nodes is published as a CAPI failure domain.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend(
        "x-kubernetes-list-type" = "map",
        "x-kubernetes-list-map-keys" = ["zone"]
    ))]
    pub zone_config: Vec<ZoneConfigSpec>,
    /// Secret with this cluster's Proxmox credentials; overrides the controller's global credentials.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credentials_ref: Option<SecretReference>,
    /// Proxmox HA for the cluster's VMs, the default for every zone (a zone's `ha` overrides
    /// it field by field); off when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ha: Option<HaSpec>,
    /// Clone and disk-resize tasks capmox runs at once, the default for every zone (a zone's
    /// `taskLimits` overrides it field by field); an unset field sets no limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_limits: Option<TaskLimits>,
}

/// How many tasks that take Proxmox's storage and config locks (clones, disk resizes) capmox
/// lets run at once. Machines over a limit wait in capmox's queue, in the order they came, with
/// a `WaitingForTaskSlot` condition, instead of in Proxmox's lock queue, where a long wait
/// fails with a lock timeout.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TaskLimits {
    /// On one Proxmox node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 64))]
    pub per_node: Option<i32>,
    /// On one shared storage (Ceph RBD, NFS, ...), over every node that clones to it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 64))]
    pub per_storage: Option<i32>,
}

/// Proxmox High Availability for machines: each VM becomes an HA resource once capmox has
/// started it, kept on its zone's nodes (PVE 9: a strict `node-affinity` rule per zone,
/// PVE 8: a restricted HA group per zone); on PVE 9 the control-plane VMs of a cluster are
/// also kept on different nodes by a negative `resource-affinity` rule. Machines without a
/// zone, or in a zone without nodes, get the HA resource only (HA may then move them to any
/// node). capmox names its rules and groups `capmox-<hash of namespace/cluster>-<zone>` and
/// only changes or removes those whose comment names the cluster.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct HaSpec {
    /// Register the VMs as HA resources; unset inherits (the cluster's setting for a zone, off
    /// for the cluster).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enabled: Option<bool>,
    /// How often HA restarts a failed VM on its node (Proxmox `max_restart`, default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 10))]
    pub max_restart: Option<i32>,
    /// How often HA relocates a failed VM to another node (Proxmox `max_relocate`, default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 10))]
    pub max_relocate: Option<i32>,
}

impl HaSpec {
    /// `zone` over `cluster`, field by field.
    pub fn merged(cluster: Option<&HaSpec>, zone: Option<&HaSpec>) -> HaSpec {
        let pick = |f: fn(&HaSpec) -> Option<i32>| zone.and_then(f).or_else(|| cluster.and_then(f));
        HaSpec {
            enabled: zone
                .and_then(|z| z.enabled)
                .or_else(|| cluster.and_then(|c| c.enabled)),
            max_restart: pick(|h| h.max_restart),
            max_relocate: pick(|h| h.max_relocate),
        }
    }

    /// Whether HA is on.
    pub fn is_enabled(&self) -> bool {
        self.enabled == Some(true)
    }
}

/// Knobs of the node scheduler.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SchedulerHints {
    /// Percentage of a node's memory that may be promised to guests: 300 allows 3x overcommit,
    /// 95 keeps 5% headroom, 0 turns memory accounting off; unset means 100.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub memory_adjustment: Option<i64>,
}

/// A zone: a group of Proxmox nodes and/or a network with its own address pools.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ZoneConfigSpec {
    /// Name of the zone; the failure domain's name when the zone has nodes.
    #[schemars(pattern(ZONE_PATTERN))]
    pub zone: String,
    /// Proxmox nodes that make up this zone; without nodes the zone is a network zone only.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(
        inner(length(max = NODE_MAX_LEN), pattern(NODE_PATTERN)),
        extend("x-kubernetes-list-type" = "set")
    )]
    pub nodes: Vec<String>,
    /// Whether the control plane (KCP) may place machines in this zone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = true))]
    pub control_plane_eligible: Option<bool>,
    /// IPv4 pool of this zone; the cluster's `ipv4Config` when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("x-kubernetes-validations" = [
        {"rule": "self.addresses.size() > 0", "message": "IPv4Config addresses must be provided"}
    ]))]
    pub ipv4_config: Option<IpConfigSpec>,
    /// IPv6 pool of this zone; the cluster's `ipv6Config` when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("x-kubernetes-validations" = [
        {"rule": "self.addresses.size() > 0", "message": "IPv6Config addresses must be provided"}
    ]))]
    pub ipv6_config: Option<IpConfigSpec>,
    /// DNS servers of this zone; the cluster's `dnsServers` when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1), extend("x-kubernetes-list-type" = "set"))]
    pub dns_servers: Option<Vec<String>>,
    /// Proxmox HA of this zone's machines, over the cluster's `ha`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ha: Option<HaSpec>,
    /// Secret with the credentials of the Proxmox cluster this zone's nodes belong to, when it
    /// is not the one the ProxmoxCluster's credentials reach (a second site); same keys and
    /// namespace rules as `spec.credentialsRef`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credentials_ref: Option<SecretReference>,
    /// Tasks capmox runs at once on this zone's nodes and storages, over the cluster's
    /// `taskLimits`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_limits: Option<TaskLimits>,
}

/// Observed state of the cluster: readiness, pools, failure domains.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ProxmoxClusterStatus {
    /// Conditions: `Ready`, `Paused`, `ProxmoxAvailable`, `FailureDomainsReady`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "conditions_schema")]
    pub conditions: Vec<Condition>,
    /// CAPI v1beta2 provisioning signal.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initialization: Option<Initialization>,
    /// Failure domains published to CAPI, one per zone with nodes, sorted by name.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend(
        "maxItems" = 100,
        "x-kubernetes-list-type" = "map",
        "x-kubernetes-list-map-keys" = ["name"]
    ))]
    pub failure_domains: Vec<FailureDomain>,
    /// Every `InClusterIPPool` the controller created for this cluster.
    #[serde(
        default,
        rename = "inClusterIPPoolRef",
        skip_serializing_if = "Vec::is_empty"
    )]
    #[schemars(extend("x-kubernetes-list-type" = "atomic"))]
    pub in_cluster_ip_pool_ref: Vec<LocalObjectReference>,
    /// The pools of each zone (`default` for the cluster-wide pools), per IP family.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend(
        "x-kubernetes-list-type" = "map",
        "x-kubernetes-list-map-keys" = ["zone"]
    ))]
    pub in_cluster_zone_ref: Vec<InClusterZoneRef>,
    /// Where machines of the cluster run (kept for compatibility with the Go provider).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_locations: Option<NodeLocations>,
}

/// One CAPI v1beta2 failure domain.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FailureDomain {
    /// Name of the failure domain (the zone name).
    #[schemars(length(min = 1, max = 256))]
    pub name: String,
    /// Whether control-plane machines may be placed here; always written explicitly.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub control_plane: Option<bool>,
    /// Free-form attributes of the failure domain.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub attributes: std::collections::BTreeMap<String, String>,
}

/// The IP pools of one zone.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct InClusterZoneRef {
    /// Zone name, `default` for the cluster-wide pools.
    #[serde(default = "default_zone")]
    #[schemars(
        pattern(ZONE_PATTERN),
        extend("default" = "default")
    )]
    pub zone: String,
    /// IPv4 pool of the zone.
    #[serde(
        default,
        rename = "inClusterIPPoolRefV4",
        skip_serializing_if = "Option::is_none"
    )]
    pub in_cluster_ip_pool_ref_v4: Option<LocalObjectReference>,
    /// IPv6 pool of the zone.
    #[serde(
        default,
        rename = "inClusterIPPoolRefV6",
        skip_serializing_if = "Option::is_none"
    )]
    pub in_cluster_ip_pool_ref_v6: Option<LocalObjectReference>,
}

fn default_zone() -> String {
    super::common::DEFAULT_ZONE.to_owned()
}

/// Machines of the cluster and the nodes they run on.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeLocations {
    /// Control-plane machines.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "atomic"))]
    pub control_plane: Vec<NodeLocation>,
    /// Worker machines.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "atomic"))]
    pub workers: Vec<NodeLocation>,
}

/// Where one machine runs.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeLocation {
    /// The ProxmoxMachine.
    pub machine: LocalObjectReference,
    /// The Proxmox node.
    #[schemars(length(min = 1))]
    pub node: String,
    /// The zone of the machine, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(pattern(ZONE_PATTERN))]
    pub zone: Option<String>,
}

/// Blueprint of a ProxmoxCluster, used by ClusterClass.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "infrastructure.cluster.x-k8s.io",
    version = "v1alpha2",
    kind = "ProxmoxClusterTemplate",
    doc = "Blueprint of ProxmoxClusters, used by ClusterClass.",
    namespaced,
    shortname = "pct",
    category = "cluster-api",
    label("cluster.x-k8s.io/v1beta2", "v1alpha2")
)]
#[serde(rename_all = "camelCase")]
pub struct ProxmoxClusterTemplateSpec {
    /// The ProxmoxCluster to stamp out.
    pub template: ProxmoxClusterTemplateResource,
}

/// Metadata and spec of the ProxmoxCluster a template describes.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ProxmoxClusterTemplateResource {
    /// Labels and annotations of the created object.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<TemplateObjectMeta>,
    /// Spec of the created ProxmoxCluster.
    pub spec: ProxmoxClusterSpec,
}
