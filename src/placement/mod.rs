//! Where a machine goes: failure domains, the one resolved [`Placement`], the node scheduler and
//! template choice. Pure code (no Kubernetes or Proxmox I/O), so controllers only ask it questions.
//!
//! Flow for a machine: [`Placement::resolve`] from the ProxmoxCluster, ProxmoxMachine and CAPI
//! Machine; if [`Placement::needs_scheduling`], [`Reservations::schedule_and_reserve`] with a
//! [`NodeInventory`] read from Proxmox; for a [`TemplateSource::Tags`] source,
//! [`select_template`] on the chosen node; then IPAM and cloud-init read the
//! [`Placement::network_devices`]. Nothing downstream reads `allowedNodes`, `network.zone` or
//! `zoneConfig` itself: those are only reachable through this module (a test enforces it).

mod failure_domains;
mod pools;
mod resolve;
mod scheduler;
mod templates;

#[cfg(test)]
mod fixtures;
#[cfg(test)]
mod tests;

pub use failure_domains::{MAX_FAILURE_DOMAINS, ZoneConfigError, ZoneProblem, failure_domains};
pub use pools::{
    ClusterPool, IN_CLUSTER_IP_POOL_KIND, IpFamily, PoolRef, address_family, claim_name,
    cluster_pools, pool_name,
};
pub use resolve::{
    MachineOwner, MachineRole, NodeCandidates, Placement, PlacementError, PoolClaim, ResolvedNic,
    TemplateSource, machine_owner, machine_role,
};
pub use scheduler::{
    GuestInfo, GuestKind, NodeChoice, NodeInfo, NodeInventory, PlacedMachine, Reservation,
    Reservations, ScheduleError, ScheduleRequest, schedule,
};
pub use templates::{
    TagSelector, TemplateChoice, TemplateError, TemplateInfo, normalize_tags, select_template,
    split_proxmox_tags,
};
