//! Deletion: the VM the machine recorded (or finds) is stopped and destroyed, its seed ISO
//! removed, and only then is the machine released.

use super::*;

impl Reconcile<'_> {
    /// Deletes the machine's VM (by the recorded VMID, else by its tag or `spec.providerID`)
    /// and releases the machine. Without its ProxmoxCluster, capmox's global credentials reach
    /// Proxmox; without those (or while Proxmox is out of reach) a machine that may have a VM
    /// keeps its finalizer and says why.
    pub(super) async fn delete(
        &self,
        scope: &mut Scope,
        cluster_found: bool,
    ) -> Result<Action, MachineError> {
        let may_have_vm = self.may_have_vm(scope);
        let proxmox = match self.deletion_client(scope, cluster_found).await? {
            // Deleted only where the VM is: a Proxmox that does not have it is not trusted to
            // say it is gone.
            Ok(endpoint) => match self.untrusted(scope, &endpoint).await? {
                Some(message) => {
                    self.deleting_status(scope, ENDPOINT_CHANGED, message)
                        .await?;
                    return Ok(Action::requeue(Duration::from_secs(60)));
                }
                None => endpoint.proxmox,
            },
            Err(blocked) if may_have_vm => {
                tracing::warn!(machine = %scope.name, reason = blocked.reason, "{}", blocked.message);
                self.warn_once(scope, blocked.reason, &blocked.message)
                    .await;
                self.deleting_status(scope, blocked.reason, blocked.message)
                    .await?;
                return Ok(Action::requeue(blocked.requeue));
            }
            Err(_) => return self.released(scope).await,
        };
        // A task in flight (this deletion's, or a provisioning task it waits out) first.
        if let Some(step) = self.tracked_task(scope, &proxmox, true).await? {
            return self.deletion_waits(scope, step).await;
        }
        // The Go provider recorded the VMID in the spec only: machines it created are deleted
        // by that VMID too (still only when the VM shows it is theirs).
        if let Some(vmid) = scope.recorded_vmid {
            if let Some(step) = self.delete_vm(scope, &proxmox, vmid).await? {
                return self.deletion_waits(scope, step).await;
            }
            if scope.finished_as(TaskKind::Destroy).is_some() {
                // The recorded VM was the machine's, and this deletion deleted it.
                return self.released(scope).await;
            }
        }
        // A VM the recorded VMID does not name: a status lost before the VMID was recorded, or
        // a machine re-created by a move or restore (found by its tag or provider ID).
        let resources = proxmox
            .cluster_resources(None)
            .await
            .during(|| "looking for the machine's VM in Proxmox".to_owned())?;
        let found = Identity::of(self.machine, &scope.name)
            .search(&proxmox, &self.configs, &resources, scope.recorded_vmid)
            .await?
            .and_then(|vm| vm.vmid);
        if let Some(vmid) = found
            && let Some(step) = self.delete_vm(scope, &proxmox, vmid).await?
        {
            return self.deletion_waits(scope, step).await;
        }
        self.released(scope).await
    }

    /// Reports what the deletion waits for (a task, a lock) and when it looks again.
    pub(super) async fn deletion_waits(
        &self,
        scope: &mut Scope,
        step: Step,
    ) -> Result<Action, MachineError> {
        let (decided, action) = match step {
            Step::Stop(decided, action) | Step::Backoff(decided, action) => (decided, action),
            Step::Continue => return Ok(Action::requeue(Duration::from_millis(100))),
        };
        let reason = if decided.reason == "TaskFailed" {
            "TaskFailed"
        } else {
            "Deleting"
        };
        self.deleting_status(scope, reason, decided.message).await?;
        Ok(action)
    }

    /// The Proxmox client that deletes the machine's VM: with the ProxmoxCluster's credentials,
    /// or with capmox's global ones when the ProxmoxCluster is gone. `Err`: why there is none.
    pub(super) async fn deletion_client(
        &self,
        scope: &Scope,
        cluster_found: bool,
    ) -> Result<Result<MachineProxmox, Blocked>, MachineError> {
        let unavailable = |message: String| Blocked {
            reason: "ProxmoxUnavailable",
            message: format!(
                "cannot reach Proxmox to delete {}: {message}; retrying",
                self.recorded_vm(scope)
            ),
            requeue: Duration::from_secs(30),
        };
        if cluster_found {
            // The zone the machine was placed in, for a machine that has not recorded where
            // its VM is.
            let zone_credentials = scope
                .current
                .failure_domain
                .as_deref()
                .and_then(|zone| placement::credentials_of_zone(&scope.proxmox_cluster, zone));
            return Ok(self
                .proxmox_client(scope, zone_credentials)
                .await?
                .map_err(unavailable));
        }
        let cluster = format!("{}/{}", scope.namespace, scope.proxmox_cluster.name_any());
        let global = self
            .context
            .global_credentials
            .for_namespace(&scope.namespace);
        Ok(match global {
            Ok(config) => self
                .context
                .proxmox
                .get(&config)
                .map(|proxmox| {
                    let moved_from = self
                        .recorded_endpoint(scope)
                        .filter(|recorded| *recorded != proxmox.endpoint())
                        .map(str::to_owned);
                    MachineProxmox {
                        proxmox,
                        moved_from,
                    }
                })
                .map_err(|error| unavailable(error.to_string())),
            Err(problem @ crate::controller::credentials::CredentialsError::Invalid { .. }) => {
                Err(unavailable(format!(
                    "the ProxmoxCluster {cluster} is gone and capmox's global credentials are unusable ({problem})"
                )))
            }
            Err(_) => Err(Blocked {
                reason: "ProxmoxClusterNotFound",
                message: format!(
                    "the ProxmoxCluster {cluster} is gone and capmox has no global credentials for this namespace, so {} is kept; restore the ProxmoxCluster (and its credentials) to delete it, or delete the VM yourself and remove the finalizer {} from this ProxmoxMachine",
                    self.recorded_vm(scope),
                    finalizers::MACHINE
                ),
                requeue: Duration::from_secs(60),
            }),
        })
    }

    /// The machine's VM as its spec and status record it, for messages.
    pub(super) fn recorded_vm(&self, scope: &Scope) -> String {
        let mut parts = Vec::new();
        if let Some(vmid) = scope.recorded_vmid {
            parts.push(format!("VM {vmid}"));
        }
        if let Some(node) = &scope.current.proxmox_node {
            parts.push(format!("on {node}"));
        }
        if let Some(provider_id) = &self.machine.spec.provider_id {
            parts.push(format!("({provider_id})"));
        }
        if parts.is_empty() {
            "its VM".to_owned()
        } else {
            format!("its {}", parts.join(" "))
        }
    }

    /// A Warning event, unless the machine reports `reason` already (one per episode, not one
    /// per pass).
    pub(super) async fn warn_once(&self, scope: &Scope, reason: &str, message: &str) {
        let reported = scope
            .current
            .conditions
            .iter()
            .any(|c| c.type_ == PROVISIONED && c.reason == reason);
        if !reported {
            self.event(scope, EventType::Warning, reason, message).await;
        }
    }

    /// The machine's spec names a VM (`spec.providerID`) that Proxmox does not have: it waits
    /// and says so, instead of creating a second VM that would take the first one's place and
    /// addresses.
    pub(super) async fn vm_not_found(&self, scope: &Scope, provider_id: &str) -> Step {
        const REASON: &str = "VirtualMachineNotFound";
        let message = format!(
            "spec.providerID is {provider_id}, but Proxmox has no VM named {} with that SMBIOS UUID{}; capmox never creates a second VM for a machine that has one. Bring the VM back (a restore must keep its name and SMBIOS UUID), or delete this machine",
            scope.name,
            self.machine
                .spec
                .virtual_machine_id
                .map(|vmid| format!(" (spec.virtualMachineID is {vmid})"))
                .unwrap_or_default()
        );
        self.warn_once(scope, REASON, &message).await;
        waiting(REASON, message, Action::requeue(Duration::from_secs(60)))
    }

    /// Deletes the machine's VM `vmid` and its seed ISO; `Some` while that has to wait.
    pub(super) async fn delete_vm(
        &self,
        scope: &mut Scope,
        proxmox: &ProxmoxClient,
        vmid: u32,
    ) -> Result<Option<Step>, MachineError> {
        let finished = scope.finished.as_ref().and_then(|t| t.kind);
        if finished == Some(TaskKind::Destroy) {
            // Deleted by this deletion (its seed ISO first).
            return Ok(None);
        }
        // Where the VM is: the node in status, else wherever Proxmox says it moved.
        let mut located = None;
        if let Some(node) = scope.current.proxmox_node.clone() {
            located = config_if_present(proxmox, &node, vmid)
                .await?
                .map(|config| (node, config));
        }
        if located.is_none()
            && let Some(node) = proxmox
                .find_vm(vmid)
                .await
                .during(|| format!("looking for VM {vmid} in Proxmox"))?
                .and_then(|vm| vm.node)
        {
            located = config_if_present(proxmox, &node, vmid)
                .await?
                .map(|config| (node, config));
        }
        let Some((node, config)) = located else {
            // Gone already (deleted by someone else, or by an earlier pass whose record was
            // lost): its seed ISO may be left, since it is a separate volume.
            if let Some(node) = scope.current.proxmox_node.clone() {
                return self
                    .delete_seed_iso(scope, proxmox, &node, vmid, None)
                    .await;
            }
            return Ok(None);
        };
        if !Identity::of(self.machine, &scope.name).owns(&config, vmid) {
            tracing::warn!(machine = %scope.name, vmid, "VM belongs to someone else; not deleting it");
            return Ok(None);
        }
        if let Some(lock) = config.lock() {
            // A clone, a deletion of an earlier pass, a backup: Proxmox refuses to delete a
            // locked VM, so wait for the lock to go.
            return Ok(Some(waiting(
                "Deleting",
                format!(
                    "VM {vmid} on {node} is locked ({lock}); deleting it once the lock is released"
                ),
                Action::requeue(Duration::from_secs(1)),
            )));
        }
        let stopping = || format!("stopping VM {vmid} on {node}");
        // After this deletion's stop, the VM is known to be stopped (and no longer HA-managed:
        // its HA resource goes first, or HA would start it again).
        if finished != Some(TaskKind::Stop) {
            let status = proxmox.vm_status(&node, vmid).await.during(stopping)?;
            if status.ha.managed {
                self.unregister_ha(scope, proxmox, vmid).await?;
            }
            if status.is_running() {
                let started = proxmox.power(&node, vmid, PowerAction::Stop).await;
                if let Some(step) =
                    self.submitted(scope, proxmox, started, TaskKind::Stop, stopping)?
                {
                    return Ok(Some(step));
                }
            }
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
            if (attached.is_some() || maybe_unattached)
                && let Some(step) = self
                    .delete_seed_iso(scope, proxmox, &node, vmid, attached)
                    .await?
            {
                return Ok(Some(step));
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

    /// Removes VM `vmid`'s HA resource, and the cluster's HA rules or the zone's group it
    /// leaves without purpose ([`crate::controller::ha::unregister`]).
    async fn unregister_ha(
        &self,
        scope: &Scope,
        proxmox: &ProxmoxClient,
        vmid: u32,
    ) -> Result<(), MachineError> {
        let names = scope.ha_names();
        let major = self.pve_major(proxmox).await?;
        let zone = scope.current.failure_domain.as_deref();
        crate::controller::ha::unregister(proxmox, major, &names, vmid, zone)
            .await
            .during(|| format!("removing VM {vmid} from Proxmox HA"))?;
        self.context
            .inventory
            .set_ha_registered(proxmox, vmid, false);
        self.context
            .inventory
            .changed(proxmox, &claim_key(self.machine));
        Ok(())
    }

    /// Deletes the seed ISO of `vmid`: the attached volume, or (when unknown) the seed name on
    /// the node's ISO storage. A missing ISO is fine; a failure fails the pass, so the machine
    /// is not released (and the ISO with its bootstrap token forgotten) before it is gone.
    pub(super) async fn delete_seed_iso(
        &self,
        scope: &mut Scope,
        proxmox: &ProxmoxClient,
        node: &str,
        vmid: u32,
        attached: Option<String>,
    ) -> Result<Option<Step>, MachineError> {
        let seed = crate::cloudinit::seed_iso_name(vmid);
        let volume = match attached {
            Some(volume) => Some(volume).filter(|v| v.contains(&seed)),
            None => self
                .context
                .inventory
                .iso_storage(proxmox, node)
                .await
                .during(|| format!("listing the ISO storages of {node}"))?
                .map(|s| format!("{s}:iso/{seed}")),
        };
        let Some(volume) = volume else {
            return Ok(None);
        };
        let Some((storage, _)) = volume.split_once(':') else {
            return Ok(None);
        };
        let started = proxmox.delete_volume(node, storage, &volume).await;
        self.deletion_submitted(scope, proxmox, started, TaskKind::DeleteSeedIso, || {
            format!("deleting the seed ISO {volume} of VM {vmid}")
        })
    }

    /// `VirtualMachineProvisioned=False` with what the deletion waits for (`Deleting`) or what
    /// stopped it.
    pub(super) async fn deleting_status(
        &self,
        scope: &mut Scope,
        reason: &str,
        message: String,
    ) -> Result<(), MachineError> {
        scope.status.conditions = conditions::merge(
            &scope.current.conditions,
            &[
                Decided::failed(api::conditions::PAUSED, "NotPaused", ""),
                Decided::failed(PROVISIONED, reason, message),
            ],
            scope.generation,
            Timestamp::now(),
        );
        self.write_status(&scope.api, &scope.name, &scope.current, &scope.status)
            .await
    }

    /// Nothing is left in Proxmox: lets the object go.
    pub(super) async fn released(&self, scope: &Scope) -> Result<Action, MachineError> {
        self.context.reservations.lock().await.release(&scope.name);
        guarded::release(&scope.api, self.machine, Some(finalizers::MACHINE), None).await?;
        self.context.vmid_claims.release(&claim_key(self.machine));
        if let Some(vmid) = scope.recorded_vmid {
            self.context
                .written_configs
                .forget(&claim_key(self.machine), vmid);
        }
        Ok(Action::await_change())
    }
}

/// Why a deletion cannot reach Proxmox, reported on the machine.
pub(super) struct Blocked {
    reason: &'static str,
    message: String,
    requeue: Duration,
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

impl Scope {
    /// The ids and comments of this machine's cluster's HA objects in Proxmox.
    pub(super) fn ha_names(&self) -> crate::controller::ha::HaNames {
        crate::controller::ha::HaNames::new(&self.namespace, &self.proxmox_cluster.name_any())
    }
}

impl Reconcile<'_> {
    /// The Proxmox VE major version behind `proxmox` (which HA objects it offers).
    pub(super) async fn pve_major(&self, proxmox: &ProxmoxClient) -> Result<u32, MachineError> {
        self.context
            .inventory
            .pve_major(proxmox)
            .await
            .during(|| "reading the Proxmox VE version".to_owned())
    }
}
