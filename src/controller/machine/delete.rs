//! Deletion: the VM the machine recorded (or finds) is stopped and destroyed, its seed ISO
//! removed, and only then is the machine released.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::runtime::reflector::ObjectRef;

use super::looks::Held;
use super::outcome::{Flow, Stop, Wait, waiting};
use super::task::TaskKind;
use super::vm::Identity;
use super::{During, MachineError, Reconcile, Scope, claim_key};
use crate::api::ProxmoxMachine;
use crate::proxmox::{DeleteParams, PowerAction, ProxmoxClient, VmConfig};

/// How soon a deletion waiting for a VM's lock looks again.
const LOCK_RECHECK: Duration = Duration::from_secs(1);

/// What a deletion waiting for a task or a lock reports: `Deleting`, or `TaskFailed` during
/// the back-off of a failed task. The machine's back-off streak ends with the wait.
pub(super) fn deletion_wait(stop: Stop) -> Stop {
    match stop {
        Stop::Wait(wait) => {
            let reason = if wait.decided.reason == "TaskFailed" {
                "TaskFailed"
            } else {
                "Deleting"
            };
            Stop::Wait(Wait {
                decided: crate::controller::conditions::Decided::failed(
                    super::PROVISIONED,
                    reason,
                    wait.decided.message,
                ),
                action: wait.action,
                backoff: false,
            })
        }
        failed => failed,
    }
}

impl Reconcile<'_> {
    /// Deletes the machine's VM `vmid` (see [`Reconcile::delete_vm`]); what it waits for is
    /// reported as the deletion's wait.
    pub(super) async fn deleting_vm(&self, scope: &mut Scope, held: &Held, vmid: u32) -> Flow {
        let proxmox = held.proxmox()?.clone();
        self.delete_vm(scope, &proxmox, vmid)
            .await
            .map_err(deletion_wait)
    }

    /// Deletes the machine's VM `vmid` and its seed ISO; `Some` while that has to wait.
    pub(super) async fn delete_vm(
        &self,
        scope: &mut Scope,
        proxmox: &ProxmoxClient,
        vmid: u32,
    ) -> Flow {
        let finished = scope.finished.as_ref().and_then(|t| t.kind);
        if finished == Some(TaskKind::Destroy) {
            // Deleted by this deletion (its seed ISO first).
            return Ok(());
        }
        let machine_key = claim_key(self.machine);
        // After the stop this process submitted, the VM is as the pass that stopped it read it.
        let kept = scope.finished.as_ref().and_then(|task| {
            self.context
                .vms
                .configs_before_stop
                .take(&machine_key, vmid, task.upid.as_str())
        });
        let located = match kept {
            Some(kept) => Some(kept),
            None => locate(scope, proxmox, vmid).await?,
        };
        let Some((node, config)) = located else {
            // Gone already (deleted by someone else, or by an earlier pass whose record was
            // lost): its seed ISO may be left, since it is a separate volume.
            if let Some(node) = scope.current.proxmox_node.clone() {
                return self
                    .delete_seed_iso(scope, proxmox, &node, vmid, None)
                    .await;
            }
            return Ok(());
        };
        if !Identity::of(self.machine, &scope.name).owns(&config, vmid) {
            tracing::warn!(machine = %scope.name, vmid, "VM belongs to someone else; not deleting it");
            return Ok(());
        }
        if let Some(lock) = config.lock() {
            // A clone, a deletion of an earlier pass, a backup: Proxmox refuses to delete a
            // locked VM, so wait for the lock to go.
            return Err(waiting(
                "Deleting",
                format!(
                    "VM {vmid} on {node} is locked ({lock}); deleting it once the lock is released"
                ),
                Action::requeue(LOCK_RECHECK),
            ));
        }
        // After this deletion's stop, the VM is known to be stopped (and no longer HA-managed).
        if finished != Some(TaskKind::Stop) {
            let stopping = self.stop_for_deletion(scope, proxmox, &node, vmid).await;
            if let (Err(Stop::Wait(_)), Some(upid)) = (&stopping, &scope.status.task_ref) {
                self.context.vms.configs_before_stop.keep(
                    &machine_key,
                    vmid,
                    upid,
                    (node.clone(), config.clone()),
                );
            }
            stopping?;
        }
        // The seed ISO (it holds the bootstrap token) is a separate volume: the attached one,
        // while the config still names it; else, if the bootstrap data may have been uploaded
        // but never attached, the seed ISO's name on the node's ISO storage.
        if finished != Some(TaskKind::DeleteSeedIso) {
            let attached = config
                .get("ide0")
                .and_then(|v| v.split(',').next().map(str::to_owned))
                .filter(|v| v.contains(&crate::cloudinit::seed_iso_name(vmid)));
            let maybe_unattached = scope.current.bootstrap_data_provided != Some(true);
            if attached.is_some() || maybe_unattached {
                self.delete_seed_iso(scope, proxmox, &node, vmid, attached)
                    .await?;
            }
        }
        let params = DeleteParams {
            purge: true,
            destroy_unreferenced_disks: true,
        };
        self.event(
            scope,
            EventType::Normal,
            "Deleting",
            &format!("deleting VM {vmid} on {node}"),
        )
        .await;
        let started = proxmox.delete_vm(&node, vmid, params).await;
        self.deletion_submitted(scope, proxmox, started, TaskKind::Destroy, || {
            format!("deleting VM {vmid} on {node}")
        })
    }

    /// Stops the VM before its deletion; its HA resource goes first, or HA would start it
    /// again.
    async fn stop_for_deletion(
        &self,
        scope: &mut Scope,
        proxmox: &ProxmoxClient,
        node: &str,
        vmid: u32,
    ) -> Flow {
        let stopping = || format!("stopping VM {vmid} on {node}");
        // A VM listed as running and not HA-managed is stopped without a closer look: the
        // listing shows what this process changed, and a stop of a stopped VM does nothing.
        let listed = self
            .context
            .inventory
            .resources(proxmox, Some(&claim_key(self.machine)))
            .await
            .during(|| "listing Proxmox's VMs".to_owned())?;
        let plainly_running = listed.iter().any(|vm| {
            vm.vmid == Some(vmid)
                && vm.node.as_deref() == Some(node)
                && vm.status.as_deref() == Some("running")
                && vm.hastate.is_none()
        });
        if plainly_running {
            let started = proxmox.power(node, vmid, PowerAction::Stop).await;
            return self.submitted(scope, proxmox, started, TaskKind::Stop, stopping);
        }
        let status = proxmox.vm_status(node, vmid).await.during(stopping)?;
        if status.ha.managed {
            self.unregister_ha(scope, proxmox, vmid).await?;
        }
        if status.is_running() {
            let started = proxmox.power(node, vmid, PowerAction::Stop).await;
            self.submitted(scope, proxmox, started, TaskKind::Stop, stopping)?;
        }
        Ok(())
    }

    /// Nothing is left in Proxmox: lets the object go.
    pub(super) async fn released(&self, scope: &Scope) -> Result<(), MachineError> {
        self.context.vms.release_reservation(&scope.name).await;
        self.release_finalizer(scope).await?;
        self.context
            .vms
            .vmid_claims
            .release(&claim_key(self.machine));
        if let Some(vmid) = scope.recorded_vmid {
            self.context
                .vms
                .written_configs
                .forget(&claim_key(self.machine), vmid);
        }
        self.context.vms.released.insert(self.machine);
        self.wake_waiting_for_capacity().await?;
        Ok(())
    }

    /// The machines waiting for memory, a PCI device or disk room are looked at now rather
    /// than at their recheck: this machine's VM gave some back.
    async fn wake_waiting_for_capacity(&self) -> Result<(), MachineError> {
        const CAPACITY: [&str; 3] = [
            "InsufficientMemory",
            "PciDeviceUnavailable",
            "InsufficientStorage",
        ];
        let waiting = self
            .reads()
            .all_where(
                self.context.config.watch_namespace.as_deref(),
                |m: &ProxmoxMachine| {
                    m.status.iter().flat_map(|s| &s.conditions).any(|c| {
                        c.type_ == crate::api::conditions::VIRTUAL_MACHINE_PROVISIONED
                            && CAPACITY.contains(&c.reason.as_str())
                    })
                },
            )
            .await?
            .iter()
            .map(|m| ObjectRef::from_obj(&**m))
            .collect();
        self.context.task_slots.wake(waiting);
        Ok(())
    }
}

/// The machines (by UID: one re-created under the same name is another) this process let go.
#[derive(Clone, Default)]
pub struct ReleasedMachines(Arc<Mutex<std::collections::HashSet<String>>>);

impl ReleasedMachines {
    /// Most machines remembered; past it, the memory starts over (a late wake of one forgotten
    /// runs a pass that finds it gone).
    const MAX: usize = 100_000;

    pub(super) fn insert(&self, machine: &ProxmoxMachine) {
        let Some(uid) = machine.metadata.uid.clone() else {
            return;
        };
        let mut released = self.lock();
        if released.len() >= Self::MAX {
            released.clear();
        }
        released.insert(uid);
    }

    pub(super) fn contains(&self, machine: &ProxmoxMachine) -> bool {
        machine
            .metadata
            .uid
            .as_ref()
            .is_some_and(|uid| self.lock().contains(uid))
    }

    fn lock(&self) -> MutexGuard<'_, std::collections::HashSet<String>> {
        // Every update is a single insert or clear: a poisoned lock holds a usable set.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The config a deletion read before the stop it submitted (by machine, VMID and the stop's
/// UPID), so the pass that sees the stop end deletes without reading it again. After a
/// restart: the config is read again.
#[derive(Clone, Default)]
pub struct ConfigsBeforeStop(Arc<Mutex<KeptByVm>>);

/// Where a VM is and its config.
type Located = (String, VmConfig);

/// By machine and VMID: the stop's UPID and what the deletion read before it.
type KeptByVm = HashMap<(String, u32), (String, Located)>;

impl ConfigsBeforeStop {
    /// Most deletions remembered; past it, the memory starts over (each reads once more).
    const MAX: usize = 10_000;

    fn keep(&self, machine: &str, vmid: u32, stop: &str, located: Located) {
        let mut kept = self.lock();
        if kept.len() >= Self::MAX {
            kept.clear();
        }
        kept.insert((machine.to_owned(), vmid), (stop.to_owned(), located));
    }

    /// What was kept for the stop `stop` of the machine's VM, forgotten as it is taken.
    fn take(&self, machine: &str, vmid: u32, stop: &str) -> Option<Located> {
        let mut kept = self.lock();
        let key = (machine.to_owned(), vmid);
        match kept.remove(&key) {
            Some((upid, located)) if upid == stop => Some(located),
            _ => None,
        }
    }

    fn lock(&self) -> MutexGuard<'_, KeptByVm> {
        // Every update is a single insert, removal or clear: a poisoned lock holds a usable map.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Where VM `vmid` is, with its config: the node in status, else wherever Proxmox says it
/// moved; `None` when Proxmox has no such VM.
async fn locate(
    scope: &Scope,
    proxmox: &ProxmoxClient,
    vmid: u32,
) -> Result<Option<(String, VmConfig)>, MachineError> {
    if let Some(node) = scope.current.proxmox_node.clone()
        && let Some(config) = config_if_present(proxmox, &node, vmid).await?
    {
        return Ok(Some((node, config)));
    }
    let Some(node) = proxmox
        .find_vm(vmid)
        .await
        .during(|| format!("looking for VM {vmid} in Proxmox"))?
        .and_then(|vm| vm.node)
    else {
        return Ok(None);
    };
    Ok(config_if_present(proxmox, &node, vmid)
        .await?
        .map(|config| (node, config)))
}

/// The config of VM `vmid` on `node`, or `None` when Proxmox has no such VM there.
async fn config_if_present(
    proxmox: &ProxmoxClient,
    node: &str,
    vmid: u32,
) -> Result<Option<VmConfig>, MachineError> {
    match proxmox.vm_config(node, vmid).await {
        Ok(config) => Ok(Some(config)),
        Err(error) if error.is_not_found() => Ok(None),
        Err(error) => Err(error).during(|| format!("reading the config of VM {vmid} on {node}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kept_config_serves_only_the_pass_that_sees_its_own_stop_end_and_only_once() {
        let kept = ConfigsBeforeStop::default();
        let located = || ("pve1".to_owned(), VmConfig::default());
        kept.keep("default/m1", 101, "UPID:stop-1", located());
        assert_eq!(kept.take("default/m1", 101, "UPID:stop-1"), Some(located()));
        assert_eq!(
            kept.take("default/m1", 101, "UPID:stop-1"),
            None,
            "taken once"
        );
        // Another stop (a restarted deletion's) reads the config again.
        kept.keep("default/m1", 101, "UPID:stop-1", located());
        assert_eq!(kept.take("default/m1", 101, "UPID:stop-2"), None);
        assert_eq!(kept.take("default/m1", 101, "UPID:stop-1"), None);
        assert_eq!(kept.take("default/m2", 101, "UPID:stop-1"), None);
    }

    #[test]
    fn a_machine_let_go_is_remembered_by_uid_and_one_recreated_under_its_name_is_not() {
        let with_uid = |uid: &str| {
            let mut machine = ProxmoxMachine::new("m1", Default::default());
            machine.metadata.uid = Some(uid.to_owned());
            machine
        };
        let released = ReleasedMachines::default();
        released.insert(&with_uid("uid-1"));
        assert!(released.contains(&with_uid("uid-1")));
        assert!(
            !released.contains(&with_uid("uid-2")),
            "re-created (a move, a restore, a new machine of that name)"
        );
        assert!(!released.contains(&ProxmoxMachine::new("m1", Default::default())));
    }
}
