//! The looks [`super::decide`] asks for: each observes one thing (through the caches,
//! Proxmox's shared inventory, or one request) and records what it saw for the next decision,
//! keeping the handles later steps act through.

use std::sync::Arc;

use super::addresses::Addresses;
use super::decide::GuestCheck;
use super::decide::{Look, Observed, Seen, Verdict, VmSeen};
use super::endpoint::MachineProxmox;
use super::outcome::{Flow, Stop};
use super::vm::Identity;
use super::{During, Reconcile, Scope, claim_key};
use crate::controller::inventory::Listing;
use crate::placement::Placement;
use crate::proxmox::{ClusterResource, ProxmoxClient, VmConfig};

/// What a pass got hold of for the steps after the look that found it.
#[derive(Default)]
pub(super) struct Held {
    /// Where the machine is placed.
    pub placement: Option<Placement>,
    /// The Proxmox found for the machine, until it is trusted.
    pub endpoint: Option<MachineProxmox>,
    /// The trusted Proxmox the pass works with.
    pub proxmox: Option<ProxmoxClient>,
    /// The machine's addresses, when this pass read them bound.
    pub addresses: Option<Addresses>,
    /// Some of the machine's claims are not bound yet.
    pub addresses_pending: bool,
    /// What Proxmox lists.
    pub resources: Option<Arc<Listing>>,
    /// The machine's VM as listed.
    pub vm: Option<ClusterResource>,
    /// The VM's config, once a phase read or wrote it.
    pub config: Option<VmConfig>,
}

impl Held {
    /// The trusted Proxmox; decide asks for no step that needs it before the trust look.
    pub(super) fn proxmox(&self) -> Flow<&ProxmoxClient> {
        self.proxmox
            .as_ref()
            .ok_or_else(|| missing("a trusted Proxmox"))
    }

    /// The placement; decide ends the pass of a machine that cannot be placed first.
    pub(super) fn placement(&self) -> Flow<&Placement> {
        self.placement
            .as_ref()
            .ok_or_else(|| missing("a placement"))
    }

    /// The VM's node and VMID; only asked for once the VM was found.
    pub(super) fn vm(&self) -> Flow<(String, u32)> {
        let vm = self
            .vm
            .as_ref()
            .ok_or_else(|| missing("the machine's VM"))?;
        Ok((
            vm.node.clone().unwrap_or_default(),
            vm.vmid.unwrap_or_default(),
        ))
    }
}

/// A step that needs what an earlier look provides ran before it: a bug in the order, reported
/// on the machine rather than a panic.
pub(super) fn missing(what: &str) -> Stop {
    Stop::Failed(super::MachineError::OutOfOrder(what.to_owned()))
}

/// The verdict of a look that passes or refuses.
fn verdict(looked: Flow) -> Flow<Verdict> {
    match looked {
        Ok(()) => Ok(Verdict::Pass),
        Err(stop) => Verdict::of(stop),
    }
}

impl Reconcile<'_> {
    /// Takes `look`, recording what it saw in `observed` and what it got hold of in `held`.
    pub(super) async fn look(
        &self,
        look: Look,
        scope: &mut Scope,
        observed: &mut Observed,
        held: &mut Held,
    ) -> Flow {
        match look {
            Look::Bootstrap => {
                observed.bootstrap = Some(verdict(self.deliverable_bootstrap(scope).await)?);
            }
            Look::Endpoint => {
                let found = if observed.deleting {
                    self.deletion_client(scope, observed.cluster_found).await
                } else {
                    let zone = held.placement()?.credentials_ref().cloned();
                    self.proxmox_client(scope, zone.as_ref()).await
                };
                observed.endpoint = Some(verdict(found.map(|e| held.endpoint = Some(e)))?);
            }
            Look::Trust => {
                let trusted = self.trusted(scope, held).await;
                observed.trusted = Some(verdict(trusted)?);
            }
            Look::Task => {
                let proxmox = held.proxmox()?.clone();
                let tracked = self.tracked_task(scope, &proxmox, observed.deleting).await;
                self.task_slots_after_look(scope, &proxmox, observed.deleting);
                observed.task = Some(verdict(tracked.map_err(|stop| {
                    if observed.deleting {
                        super::delete::deletion_wait(stop)
                    } else {
                        stop
                    }
                }))?);
            }
            Look::Addresses => {
                self.look_at_addresses(scope, held).await?;
                observed.addresses = true;
            }
            Look::Vm => observed.vm = Some(self.look_at_vm(scope, observed, held).await?),
            Look::VmToDelete => {
                observed.found_for_deletion = Some(self.vm_to_delete(scope, held).await?);
            }
        }
        Ok(())
    }

    /// Whether the Proxmox found may be trusted with the machine's VM; held as the pass's
    /// Proxmox when it may.
    async fn trusted(&self, scope: &Scope, held: &mut Held) -> Flow {
        let endpoint = held
            .endpoint
            .take()
            .ok_or_else(|| missing("a Proxmox for the machine"))?;
        self.untrusted(scope, &endpoint).await?;
        held.proxmox = Some(endpoint.proxmox);
        Ok(())
    }

    /// Static addresses from the placement's pools: claimed before anything is created in
    /// Proxmox, and bound by the IPAM provider while the clone runs; only the seed ISO waits
    /// for them. Once bound and recorded, they stay: only the seed ISO reads them again.
    async fn look_at_addresses(&self, scope: &mut Scope, held: &mut Held) -> Flow {
        if !scope.current.ip_addresses.is_empty() {
            return Ok(());
        }
        let bound = self.addresses(scope, held.placement()?).await?;
        if let Some(addresses) = &bound {
            scope.status.ip_addresses = addresses.status.clone();
        }
        held.addresses_pending = bound.is_none();
        held.addresses = bound;
        Ok(())
    }

    /// The machine's VM: found (and what the pass sees of it), being cloned, or absent.
    async fn look_at_vm(
        &self,
        scope: &mut Scope,
        observed: &Observed,
        held: &mut Held,
    ) -> Flow<VmSeen> {
        let proxmox = held.proxmox()?.clone();
        let inventory = &self.context.inventory;
        let reader = claim_key(self.machine);
        let resources = if observed.provisioned && !observed.deleting {
            inventory.settled_resources(&proxmox, &reader).await
        } else {
            inventory.resources(&proxmox, Some(&reader)).await
        }
        .during(|| "listing Proxmox's VMs and nodes".to_owned())?;
        let found = self.find_vm(scope, &resources, &proxmox).await?;
        held.resources = Some(resources);
        let Some(mut vm) = found else {
            return Ok(VmSeen::Absent);
        };
        // A clone this process saw succeed is over, though a listing fetched before its end
        // (not fetched again for it) still shows its lock.
        if vm.lock.as_deref() == Some("clone")
            && vm
                .vmid
                .is_some_and(|vmid| self.context.inventory.clone_seen_ended(&proxmox, vmid))
        {
            vm.lock = None;
        }
        let node = vm.node.clone().unwrap_or_default();
        let vmid = vm.vmid.unwrap_or_default();
        let cloning = vm.lock.as_deref() == Some("clone");
        let seen = self.seen(scope, observed, held, &vm, &proxmox);
        held.vm = Some(vm);
        Ok(if cloning {
            VmSeen::Cloning { vmid, node }
        } else {
            VmSeen::Present(seen?)
        })
    }

    /// What the pass sees of the machine's VM `vm`, for the phases it goes through.
    fn seen(
        &self,
        scope: &Scope,
        observed: &Observed,
        held: &Held,
        vm: &ClusterResource,
        proxmox: &ProxmoxClient,
    ) -> Flow<Seen> {
        let node = vm.node.clone().unwrap_or_default();
        let vmid = vm.vmid.unwrap_or_default();
        let machine_key = claim_key(self.machine);
        let running = vm.status.as_deref() == Some("running");
        let checks = self.machine.spec.checks.clone().unwrap_or_default();
        let clock = &self.context.task_timing;
        let ha_pending = held.placement()?.ha().is_some()
            && !(vm.hastate.is_some() && self.context.inventory.ha_registered(proxmox, vmid));
        Ok(Seen {
            running,
            retag: running && self.retagged(&vm.tags).is_some(),
            seed_iso_uploaded: super::bootstrap::seed_iso_uploaded(scope, &node),
            // Started, or last looked at, too recently for the guest to be worth a look (the
            // pass was woken early, or the start was checked by a process that did not submit it).
            started: clock.boot_not_due(&machine_key).is_some(),
            // Up as this process saw, even if this pass works from a copy older than the
            // status that says so.
            provisioned: observed.provisioned || clock.seen_up(&machine_key, vmid),
            guest_check: if checks.skip_qemu_guest_agent == Some(true) {
                GuestCheck::None
            } else if checks.skip_cloud_init_status == Some(true) {
                GuestCheck::Agent
            } else {
                GuestCheck::CloudInit
            },
            node_joined: scope
                .capi_machine
                .status
                .as_ref()
                .and_then(|s| s.node_ref.as_ref())
                .is_some(),
            seed_iso_removed: self
                .context
                .vms
                .seed_isos_removed
                .contains(&machine_key, vmid),
            seed_iso_deleted: super::bootstrap::seed_iso_deleted(scope, &node),
            ha_pending,
        })
    }

    /// For a deletion, the VM of the machine's that the recorded VMID does not name: a status
    /// lost before the VMID was recorded, or a machine re-created by a move or restore (found
    /// by its tag or provider ID).
    async fn vm_to_delete(&self, scope: &Scope, held: &Held) -> Flow<Option<u32>> {
        let proxmox = held.proxmox()?;
        let resources = proxmox
            .cluster_resources(None)
            .await
            .during(|| "looking for the machine's VM in Proxmox".to_owned())?;
        Ok(Identity::of(self.machine, &scope.name)
            .search(proxmox, &self.configs, &resources, scope.recorded_vmid)
            .await?
            .and_then(|vm| vm.vmid))
    }
}
