//! What the machine reconciler remembers of the VMs it creates, across passes and machines.
//! Each memory makes passes cheaper or keeps parallel passes apart; none is needed for
//! correctness after a restart, and each says what a restart without it means.

use std::sync::Arc;

use super::bootstrap::{SeedIsosRemoved, SeedIsosUploaded, WrittenConfigs};
use super::delete::{ConfigsBeforeStop, ReleasedMachines};
use crate::controller::inventory::EndpointReservations;
use crate::controller::vmid::VmidClaims;

/// The VMs machines are creating and have created, as this process saw them.
#[derive(Clone, Default)]
pub struct Vms {
    /// Memory promised to machines whose VMs are still being created, so parallel reconciles
    /// never both take the last slot on a node. After a restart: empty; the clones then in
    /// flight are listed by Proxmox with their memory, so nothing is promised twice.
    pub reservations: Arc<tokio::sync::Mutex<EndpointReservations>>,
    /// VMIDs held by the machines that chose them (until those are deleted), so parallel
    /// reconciles never pick the same one and a VMID freed by a failed clone is not handed on.
    /// After a restart: seeded from the VMIDs the machines recorded before any is chosen.
    pub vmid_claims: VmidClaims,
    /// VM configs as this process last wrote them, until their seed ISO is removed, so a pass
    /// after a resize or an upload need not read them. After a restart: the config is read.
    pub written_configs: WrittenConfigs,
    /// The VMs whose seed ISO is known to be gone, so provisioned machines are not read again
    /// for it. After a restart: each provisioned machine reads its config once more.
    pub seed_isos_removed: SeedIsosRemoved,
    /// The configs deletions read before the stops they submitted, so the pass after a stop
    /// need not read again. After a restart: the config is read again.
    pub configs_before_stop: ConfigsBeforeStop,
    /// The seed ISOs uploaded and not yet attached, so a failed attachment does not upload
    /// again. After a restart: the seed ISO is uploaded again.
    pub seed_isos_uploaded: SeedIsosUploaded,
    /// The machines this process let go, so the wakes that follow (their IP claims deleted
    /// with them, seen before the machine's own deletion) run no pass that finds them gone.
    /// After a restart: empty; such a pass finds the machine gone and ends quietly.
    pub released: ReleasedMachines,
}

impl Vms {
    /// Gives back the memory promised to `machine` (its VM is listed now, or will not be made).
    pub(super) async fn release_reservation(&self, machine: &str) {
        self.reservations.lock().await.release(machine);
    }
}
