//! `ProxmoxCluster` and `ProxmoxClusterTemplate` in v1alpha1: no zones, a `cloneSpec`, and a
//! Cluster API v1beta1 status.

use std::collections::BTreeMap;

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{ApiEndpoint, Condition, ObjectMeta, ProxmoxMachineSpec};
use crate::api::{LocalObjectReference, SecretReference};

/// The Proxmox side of a workload cluster, as v1alpha1 described it.
// kube's `printcolumn(...)` repeats `type_` by design; clippy mistakes that for a duplicate.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "infrastructure.cluster.x-k8s.io",
    version = "v1alpha1",
    kind = "ProxmoxCluster",
    doc = "The Proxmox side of a CAPI cluster (deprecated version; stored as v1alpha2).",
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
        description = "Infrastructure is ready",
        json_path = ".status.ready"
    ),
    printcolumn(
        name = "Endpoint",
        type_ = "string",
        description = "Control plane API endpoint",
        json_path = ".spec.controlPlaneEndpoint"
    )
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "has(self.ipv4Config) || has(self.ipv6Config)",
     "message": "at least one ip config must be set, either ipv4Config or ipv6Config"}
]))]
pub struct ProxmoxClusterSpec {
    /// Endpoint of the workload cluster's API server.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("x-kubernetes-validations" = [
        {"rule": "self.port > 0 && self.port < 65536", "message": "port must be within 1-65535"}
    ]))]
    pub control_plane_endpoint: Option<ApiEndpoint>,
    /// Set when an external control plane provider serves the API endpoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub external_managed_control_plane: Option<bool>,
    /// Proxmox nodes machines of this cluster may run on.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(inner(length(max = crate::api::names::NODE_MAX_LEN), pattern(crate::api::names::NODE_PATTERN)))]
    pub allowed_nodes: Vec<String>,
    /// Tuning of the memory-aware node scheduler.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scheduler_hints: Option<SchedulerHints>,
    /// Cluster-wide IPv4 pool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("x-kubernetes-validations" = [
        {"rule": "self.addresses.size() > 0", "message": "IPv4Config addresses must be provided"}
    ]))]
    pub ipv4_config: Option<IpConfigSpec>,
    /// Cluster-wide IPv6 pool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("x-kubernetes-validations" = [
        {"rule": "self.addresses.size() > 0", "message": "IPv6Config addresses must be provided"}
    ]))]
    pub ipv6_config: Option<IpConfigSpec>,
    /// DNS servers of the machines.
    #[schemars(length(min = 1))]
    pub dns_servers: Vec<String>,
    /// Machine specs and SSH keys that v1alpha1 ClusterClasses patched; not used by capmox.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clone_spec: Option<ProxmoxClusterCloneSpec>,
    /// Secret with this cluster's Proxmox credentials.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credentials_ref: Option<SecretReference>,
}

/// Knobs of the node scheduler.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SchedulerHints {
    /// Percentage of a node's memory that may be promised to guests.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_adjustment: Option<i64>,
}

/// Static address pool of one IP family; the gateway was optional in v1alpha1.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct IpConfigSpec {
    /// Addresses to hand out: single IPs, ranges or CIDRs.
    pub addresses: Vec<String>,
    /// Prefix length of the network.
    #[schemars(range(max = 128))]
    pub prefix: i32,
    /// Default gateway.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway: Option<String>,
    /// Route metric of the default route.
    #[serde(default = "default_metric")]
    #[schemars(extend("default" = 100))]
    pub metric: i32,
}

fn default_metric() -> i32 {
    100
}

/// What v1alpha1 ClusterClasses kept on the cluster: machine specs per role, SSH keys, the VIP NIC.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ProxmoxClusterCloneSpec {
    /// Machine specs by role (e.g. `controlPlane`, `workerNode`).
    pub machine_spec: BTreeMap<String, ProxmoxMachineSpec>,
    /// SSH keys for the machines.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ssh_authorized_keys: Option<Vec<String>>,
    /// NIC that carries the control plane's virtual IP.
    #[serde(
        default,
        rename = "virtualIPNetworkInterface",
        skip_serializing_if = "Option::is_none"
    )]
    pub virtual_ip_network_interface: Option<String>,
}

/// Observed state of the cluster, v1alpha1 shape.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ProxmoxClusterStatus {
    /// Whether the infrastructure is ready.
    #[serde(default)]
    #[schemars(extend("default" = false))]
    pub ready: bool,
    /// IP pools created for the cluster.
    #[serde(
        default,
        rename = "inClusterIpPoolRef",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub in_cluster_ip_pool_ref: Vec<LocalObjectReference>,
    /// Where machines of the cluster run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_locations: Option<NodeLocations>,
    /// Terminal problem, machine-readable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_reason: Option<String>,
    /// Terminal problem, human-readable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_message: Option<String>,
    /// Cluster API v1beta1 conditions.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

/// Machines of the cluster and the nodes they run on.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeLocations {
    /// Control-plane machines.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub control_plane: Vec<NodeLocation>,
    /// Worker machines.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub workers: Vec<NodeLocation>,
}

/// Where one machine runs.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeLocation {
    /// The ProxmoxMachine.
    pub machine: LocalObjectReference,
    /// The Proxmox node.
    pub node: String,
}

/// Blueprint of a ProxmoxCluster, v1alpha1.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "infrastructure.cluster.x-k8s.io",
    version = "v1alpha1",
    kind = "ProxmoxClusterTemplate",
    doc = "Blueprint of ProxmoxClusters (deprecated version; stored as v1alpha2).",
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
    pub metadata: Option<ObjectMeta>,
    /// Spec of the created ProxmoxCluster.
    pub spec: ProxmoxClusterSpec,
}
