//! Read-only views of the CAPI core and IPAM objects capmox consumes.
//!
//! Each view holds only the fields capmox reads (or sets when it creates the object), so decoding
//! ignores everything else. That is why capmox never replaces (PUT) these objects: a view would
//! drop the fields it does not know. Writes go through patches of the fields capmox owns.
//! The schemas derived from these views are used by a test to prove every field path exists in
//! the upstream CRDs; they are never published.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// API group of CAPI core kinds.
pub const CLUSTER_API_GROUP: &str = "cluster.x-k8s.io";
/// API group of CAPI IPAM kinds.
pub const IPAM_GROUP: &str = "ipam.cluster.x-k8s.io";

/// Contract-versioned reference (`apiGroup`, `kind`, `name`) as CAPI v1beta2 writes them.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ContractVersionedObjectReference {
    /// API group of the referenced object.
    pub api_group: String,
    /// Kind of the referenced object.
    pub kind: String,
    /// Name of the referenced object (same namespace).
    pub name: String,
}

/// What capmox reads of a CAPI `Cluster`: pause, endpoint and its infrastructure reference.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "cluster.x-k8s.io",
    version = "v1beta2",
    kind = "Cluster",
    namespaced,
    status = "ClusterStatus"
)]
#[serde(rename_all = "camelCase")]
pub struct ClusterSpec {
    /// Stops all reconciliation of the cluster's objects when true.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub paused: Option<bool>,
    /// The workload cluster's API endpoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub control_plane_endpoint: Option<ClusterApiEndpoint>,
    /// The InfraCluster (a ProxmoxCluster) of this cluster.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub infrastructure_ref: Option<ContractVersionedObjectReference>,
}

/// API endpoint as CAPI stores it.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ClusterApiEndpoint {
    /// Host name or IP.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    /// TCP port.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<i32>,
}

/// What capmox reads of a Cluster's status.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ClusterStatus {
    /// Provisioning progress of the cluster.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initialization: Option<ClusterInitialization>,
    /// Failure domains CAPI copied from the InfraCluster.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub failure_domains: Vec<crate::api::FailureDomain>,
}

/// Cluster provisioning flags.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ClusterInitialization {
    /// The InfraCluster reported itself provisioned.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub infrastructure_provisioned: Option<bool>,
    /// The control plane has been initialised.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub control_plane_initialized: Option<bool>,
}

/// What capmox reads of a CAPI `Machine`: its cluster, bootstrap data, failure domain and node.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "cluster.x-k8s.io",
    version = "v1beta2",
    kind = "Machine",
    namespaced,
    status = "MachineStatus"
)]
#[serde(rename_all = "camelCase")]
pub struct MachineSpec {
    /// Name of the CAPI cluster.
    #[serde(default)]
    pub cluster_name: String,
    /// Bootstrap configuration and its rendered Secret.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bootstrap: Option<MachineBootstrap>,
    /// Failure domain chosen by KCP or the MachineDeployment; the machine's zone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_domain: Option<String>,
    /// The InfraMachine (a ProxmoxMachine) of this Machine.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub infrastructure_ref: Option<ContractVersionedObjectReference>,
    /// Provider ID, copied by CAPI from the InfraMachine.
    #[serde(
        default,
        rename = "providerID",
        skip_serializing_if = "Option::is_none"
    )]
    pub provider_id: Option<String>,
    /// Kubernetes version of the machine (set by KCP / the MachineDeployment).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
}

/// Bootstrap part of a Machine.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MachineBootstrap {
    /// Name of the Secret holding the bootstrap data, set once it is rendered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_secret_name: Option<String>,
}

/// What capmox reads of a Machine's status.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MachineStatus {
    /// The Kubernetes node that joined for this Machine.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_ref: Option<MachineNodeReference>,
    /// Provisioning progress, set by CAPI (or the sandbox stand-in) from the InfraMachine.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initialization: Option<MachineInitialization>,
    /// Addresses copied by CAPI from the InfraMachine.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub addresses: Vec<crate::api::MachineAddress>,
    /// Failure domain the InfraMachine reports it landed in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_domain: Option<String>,
}

/// Machine provisioning flags.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MachineInitialization {
    /// The InfraMachine reported itself provisioned (latched by CAPI).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub infrastructure_provisioned: Option<bool>,
}

/// Reference to a workload-cluster Node.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MachineNodeReference {
    /// Node name.
    pub name: String,
}

/// Reference to an IP pool in a claim or address.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct IpPoolReference {
    /// API group of the pool kind.
    pub api_group: String,
    /// Pool kind.
    pub kind: String,
    /// Pool name.
    pub name: String,
}

/// A request for one address from a pool, created by capmox per (NIC, pool).
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "ipam.cluster.x-k8s.io",
    version = "v1beta2",
    kind = "IPAddressClaim",
    namespaced,
    status = "IpAddressClaimStatus"
)]
#[serde(rename_all = "camelCase")]
pub struct IpAddressClaimSpec {
    /// Pool to allocate from.
    pub pool_ref: IpPoolReference,
    /// CAPI cluster the claim belongs to (pauses with it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster_name: Option<String>,
}

/// What capmox reads of a claim's status.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct IpAddressClaimStatus {
    /// The allocated `IPAddress`, once bound.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address_ref: Option<crate::api::LocalObjectReference>,
    /// Allocation progress and errors reported by the IPAM provider.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

/// An allocated address.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "ipam.cluster.x-k8s.io",
    version = "v1beta2",
    kind = "IPAddress",
    namespaced
)]
#[serde(rename_all = "camelCase")]
pub struct IpAddressSpec {
    /// The address, without prefix.
    pub address: String,
    /// Prefix length of its network.
    pub prefix: i32,
    /// Gateway of its network.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway: Option<String>,
    /// Claim the address was allocated for.
    pub claim_ref: crate::api::LocalObjectReference,
    /// Pool the address came from.
    pub pool_ref: IpPoolReference,
}

/// Addresses of an in-cluster pool, namespaced or global.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PoolAddresses {
    /// Addresses, ranges and CIDRs to allocate from.
    pub addresses: Vec<String>,
    /// Prefix length of the network.
    pub prefix: i32,
    /// Gateway of the network.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway: Option<String>,
}

/// A namespaced in-cluster pool; capmox creates one per cluster/zone and IP family.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "ipam.cluster.x-k8s.io",
    version = "v1alpha2",
    kind = "InClusterIPPool",
    namespaced,
    status = "InClusterIpPoolStatus"
)]
#[serde(rename_all = "camelCase")]
pub struct InClusterIpPoolSpec {
    /// The pool's addresses.
    #[serde(flatten)]
    pub pool: PoolAddresses,
}

/// Usage figures of a pool.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct InClusterIpPoolStatus {
    /// Address counts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ip_addresses: Option<PoolAddressCounts>,
}

/// Address counts of a pool.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PoolAddressCounts {
    /// Addresses in the pool.
    pub total: i64,
    /// Addresses still free.
    pub free: i64,
    /// Addresses allocated.
    pub used: i64,
    /// Allocated addresses no longer inside the pool's ranges.
    pub out_of_range: i64,
}

/// A cluster-scoped pool that machines may reference explicitly.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "ipam.cluster.x-k8s.io",
    version = "v1alpha2",
    kind = "GlobalInClusterIPPool"
)]
#[serde(rename_all = "camelCase")]
pub struct GlobalInClusterIpPoolSpec {
    /// The pool's addresses.
    #[serde(flatten)]
    pub pool: PoolAddresses,
}
