//! Where a machine goes: failure domains, the one resolved [`Placement`], the node scheduler and
//! template choice. Pure code (no Kubernetes or Proxmox I/O), so controllers only ask it questions.
//!
//! # Flow
//!
//! - Cluster controller: [`failure_domains`] for `status.failureDomains` (on error keep the last
//!   good list and report the [`ZoneConfigError`]); [`cluster_pools`] for the `InClusterIPPool`s.
//! - Machine controller: [`Placement::resolve`] from the ProxmoxCluster, ProxmoxMachine and CAPI
//!   Machine; the template's copies ([`select_template`] for a [`TemplateSource::Tags`] source)
//!   with the storages of their volumes become [`CloneSources`]; if
//!   [`Placement::needs_scheduling`], [`CloneSources::narrow`] keeps the candidate nodes that can
//!   receive a clone (a copy on the node, or a copy on shared storage) and
//!   [`Reservations::schedule_and_reserve`] chooses among them with a [`NodeInventory`] read from
//!   Proxmox; [`CloneSources::choose`] gives the copy to clone for the chosen node; IPAM claims
//!   the [`PoolClaim`]s of [`Placement::network_devices`]; cloud-init reads the same NICs.
//!
//! Nothing downstream reads `allowedNodes`, `network.zone`, `zoneConfig`, `schedulerHints` or the
//! NIC pool fields itself: they are only reachable through this module, and a test
//! (`only_placement_reads_zone_and_allowed_node_fields`) fails `cargo test` for production code
//! that does.
//!
//! # Where capmox differs from the Go provider (on purpose)
//!
//! - Zone DNS servers are used (NIC over zone over cluster); the Go provider ignored them.
//! - A failure domain restricts nodes to zone nodes ∩ allowed nodes (PR #720 replaced them), and
//!   zones without nodes are not published as failure domains.
//! - `memoryAdjustment: 0` turns accounting off (the Go provider compared against total memory);
//!   a request equal to what is left fits; memory promised to machines still being created counts;
//!   an unset `memoryMiB` uses the template's memory instead of 0; "nothing fits" is retried, not terminal.
//! - Spreading counts machines of the same owner first (KCP or MachineDeployment), then role.
//! - `bestSubset` picks the template with the fewest extra tags whatever the listing order, and
//!   the user's `matchTags` are never rewritten. Exactly one template must match, as in Go, but
//!   its copies on several nodes (same name and tags) count as one: the chosen node clones its
//!   own copy. Different templates matching are ambiguous, on whatever node.
//! - A machine is only scheduled to nodes that can receive a clone of its template (Go let a
//!   clone of a template on node-local storage fail on the other nodes forever).
//! - Claims reference pools with the bare API group `ipam.cluster.x-k8s.io`, never a group/version.

mod failure_domains;
mod ha;
mod pools;
mod resolve;
mod scheduler;
mod sources;
mod task_limits;
mod templates;

#[cfg(test)]
pub(crate) mod fixtures;
#[cfg(test)]
mod tests;

pub use failure_domains::{
    MAX_FAILURE_DOMAINS, ZoneConfigError, ZoneProblem, ZonesByCredentials, credentials_of_zone,
    credentials_secrets, failure_domains, offered_to_control_plane, zone_credentials, zone_nodes,
    zones_by_credentials,
};
pub use ha::{MachineHa, ha_enabled_anywhere, ha_zones};
pub use pools::{
    ClusterPool, IN_CLUSTER_IP_POOL_KIND, IpFamily, PoolRef, address_family, claim_name,
    cluster_pools, pool_name,
};
pub use resolve::{
    MachineOwner, MachineRole, NodeCandidates, Placement, PlacementError, PoolClaim, ResolvedNic,
    TemplateSource, machine_owner, machine_role,
};
pub use scheduler::{
    GuestInfo, GuestKind, NodeChoice, NodeInfo, NodeInventory, PciOnNode, PlacedMachine,
    Reservation, Reservations, ScheduleError, ScheduleRequest, schedule,
};
pub use sources::{CloneSources, StorageInfo, TemplateCopy};
pub use task_limits::{MachineTaskLimits, task_limits_for_machine};
pub use templates::{
    TagSelector, TemplateChoice, TemplateError, TemplateInfo, normalize_tags, select_template,
    split_proxmox_tags,
};
