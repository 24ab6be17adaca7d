//! The `infrastructure.cluster.x-k8s.io/v1alpha2` API that users write: types, CRDs, well-known names.

mod cluster;
mod common;
pub mod conversion;
pub mod crd;
mod machine;
pub mod names;
pub mod reasons;
mod remediation;
mod template_status;
pub mod v1alpha1;
pub mod validation;

pub use cluster::*;
pub use common::*;
pub use machine::*;
pub use remediation::*;
pub use template_status::*;

/// API group of every capmox kind.
pub const GROUP: &str = "infrastructure.cluster.x-k8s.io";
/// The one served and stored version.
pub const VERSION: &str = "v1alpha2";

/// Well-known label keys, as the Go provider writes them, so existing tooling keeps working.
pub mod labels {
    /// Names the CAPI cluster an object belongs to.
    pub const CLUSTER_NAME: &str = "cluster.x-k8s.io/cluster-name";
    /// Marks control-plane Machines.
    pub const CONTROL_PLANE: &str = "cluster.x-k8s.io/control-plane";
    /// Names the MachineDeployment of a worker Machine.
    pub const DEPLOYMENT_NAME: &str = "cluster.x-k8s.io/deployment-name";
    /// Zone of an IP pool, claim or machine (`default` when none).
    pub const PROXMOX_ZONE: &str = "topology.kubernetes.io/proxmox-zone";
    /// CAPI contract version label on CRDs.
    pub const CONTRACT_V1BETA2: &str = "cluster.x-k8s.io/v1beta2";
    /// clusterctl provider label.
    pub const PROVIDER: &str = "cluster.x-k8s.io/provider";
    /// Assigns an object to the manager started with `--watch-filter` of the same value, as
    /// Cluster API providers shard.
    pub const WATCH_FILTER: &str = "cluster.x-k8s.io/watch-filter";
}

/// Well-known annotation keys, as the Go provider writes them.
pub mod annotations {
    /// On a credentials Secret: the namespaces (comma-separated, or `*`) whose ProxmoxClusters
    /// may use it through a `credentialsRef` from another namespace. Without it a Secret serves
    /// only its own namespace, so a ProxmoxCluster cannot borrow (or lock) another tenant's.
    pub const ALLOWED_NAMESPACES: &str =
        "proxmox.infrastructure.cluster.x-k8s.io/allowed-namespaces";
    /// Pauses reconciliation of an object.
    pub const PAUSED: &str = "cluster.x-k8s.io/paused";
    /// IP family of an `InClusterIPPool` (`ipv4`/`ipv6`).
    pub const IP_FAMILY: &str = "ipam.capmox.cluster.x-k8s.io/ip-family";
    /// Route metric of a pool's gateway.
    pub const GATEWAY_METRIC: &str = "ipam.capmox.cluster.x-k8s.io/gateway-metric";
    /// Ordinal of the pool for a NIC, in claim names and address order.
    pub const POOL_REF_COUNTER: &str = "ipam.capmox.cluster.x-k8s.io/pool-ref-counter";
    /// Marks a claim that comes from a default pool (carries the default route).
    pub const DEFAULT_GATEWAY: &str = "ipam.capmox.cluster.x-k8s.io/default-gateway";
}

/// Finalizer names, as the Go provider uses them, so objects it created are released correctly.
pub mod finalizers {
    /// On ProxmoxClusters.
    pub const CLUSTER: &str = "proxmoxcluster.infrastructure.cluster.x-k8s.io";
    /// On the credentials Secret of a ProxmoxCluster.
    pub const CLUSTER_SECRET: &str = "proxmoxcluster.infrastructure.cluster.x-k8s.io/secret";
    /// On ProxmoxMachines.
    pub const MACHINE: &str = "proxmoxmachine.infrastructure.cluster.x-k8s.io";
}

/// Condition types capmox reports.
pub mod conditions {
    /// Summary of the other conditions.
    pub const READY: &str = "Ready";
    /// The object or its cluster is paused.
    pub const PAUSED: &str = "Paused";
    /// Proxmox answers with the cluster's credentials.
    pub const PROXMOX_AVAILABLE: &str = "ProxmoxAvailable";
    /// The zone configuration yields valid failure domains.
    pub const FAILURE_DOMAINS_READY: &str = "FailureDomainsReady";
    /// Every zone with nodes can take machines (a node online, its Proxmox answering).
    pub const FAILURE_DOMAINS_AVAILABLE: &str = "FailureDomainsAvailable";
    /// The machine's VM exists, is configured and running.
    pub const VIRTUAL_MACHINE_PROVISIONED: &str = "VirtualMachineProvisioned";
    /// A ProxmoxMachineTemplate's `status.capacity` and `status.nodeInfo` are complete: nothing
    /// the spec leaves to the Proxmox template is missing.
    pub const CAPACITY_RESOLVED: &str = "CapacityResolved";
}
