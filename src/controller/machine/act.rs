//! The executor: performs the effect [`super::decide`] chose, through Proxmox and the
//! Kubernetes API, and records what it did for the next decision.

use kube::runtime::controller::Action;
use kube::runtime::events::EventType;

use super::bootstrap::{detach_seed_iso, seed_iso_attached, smbios_uuid};
use super::decide::{Deleted, Effect, Observed, Phase, VmSeen};
use super::looks::Held;
use super::outcome::{Flow, Stop, waiting, waiting_for_addresses};
use super::task::TaskKind;
use super::vm::Identity;
use super::{During, Reconcile, Scope, claim_key, machine_addresses};
use crate::api::{Initialization, VirtualMachineState};
use crate::proxmox::{ConfigUpdate, PowerAction, ProxmoxClient, ProxmoxError, VmConfig};

impl Reconcile<'_> {
    /// Performs `effect`, recording in `observed` that it is done.
    pub(super) async fn act(
        &self,
        effect: Effect,
        scope: &mut Scope,
        observed: &mut Observed,
        held: &mut Held,
    ) -> Flow {
        match effect {
            Effect::EnsureFinalizer => {
                self.ensure_finalizer(scope).await?;
                observed.finalizer = true;
            }
            Effect::RecordVm => {
                self.record_vm(scope, held).await?;
                observed.vm_recorded = true;
            }
            Effect::Create => match self.create_vm(scope, held).await? {},
            Effect::ReportVmNotFound => return Err(self.vm_not_found(scope).await),
            Effect::Phase(phase) => {
                let provisioned = observed.provisioned;
                let seen = match &observed.vm {
                    Some(VmSeen::Present(seen)) => *seen,
                    _ => return Err(super::looks::missing("the VM as seen")),
                };
                if phase != Phase::Configure {
                    self.task_slots_done(false);
                }
                self.phase(phase, seen, provisioned, scope, held).await?;
                observed.done.push(phase);
            }
            Effect::DeleteRecorded => {
                if let Some(vmid) = scope.recorded_vmid {
                    self.deleting_vm(scope, held, vmid).await?;
                }
                observed.recorded_deleted = Some(match scope.finished_as(TaskKind::Destroy) {
                    Some(_) => Deleted::Destroyed,
                    None => Deleted::Nothing,
                });
            }
            Effect::DeleteFound(vmid) => {
                self.deleting_vm(scope, held, vmid).await?;
                observed.found_deleted = true;
            }
            Effect::Release => {
                self.released(scope).await?;
                self.task_slots_done(true);
                observed.released = true;
            }
        }
        Ok(())
    }

    /// Records the VM found as the machine's. Adopted (after a move or restore, or from the Go
    /// provider): the spec records the VMID, so a later move finds it even before the VM
    /// carries this machine's tag.
    async fn record_vm(&self, scope: &mut Scope, held: &Held) -> Flow {
        let (node, vmid) = held.vm()?;
        let proxmox = held.proxmox()?;
        let placement = held.placement()?;
        let tags = held
            .vm
            .as_ref()
            .map(|vm| vm.tags.clone())
            .unwrap_or_default();
        let adopted = scope.current.virtual_machine_id != Some(i64::from(vmid))
            && !Identity::of(self.machine, &scope.name).tagged(&tags);
        let guard = scope.resource_version.clone();
        self.record_vmid(scope, vmid, guard).await?;
        if adopted {
            self.event(
                scope,
                EventType::Normal,
                "Adopted",
                &format!(
                    "adopted VM {vmid} on {node}: it carries this machine's name and the VMID or SMBIOS UUID its spec records"
                ),
            )
            .await;
        }
        scope.status.proxmox_node = Some(node);
        scope.status.proxmox_endpoint = Some(proxmox.endpoint().to_owned());
        scope.status.virtual_machine_id = Some(i64::from(vmid));
        scope.status.failure_domain = placement.failure_domain().map(str::to_owned);
        Ok(())
    }

    /// One provisioning phase of the VM the pass found.
    async fn phase(
        &self,
        phase: Phase,
        seen: super::decide::Seen,
        provisioned: bool,
        scope: &mut Scope,
        held: &mut Held,
    ) -> Flow {
        let proxmox = held.proxmox()?.clone();
        let (node, vmid) = held.vm()?;
        match phase {
            Phase::Configure => {
                let configured = self
                    .configured(scope, held.placement()?, &proxmox, &node, vmid)
                    .await?;
                held.config = Some(configured);
            }
            Phase::Retag => held.config = Some(self.retag(&proxmox, &node, vmid).await?),
            Phase::Bootstrap => self.bootstrap(scope, held, &proxmox, &node, vmid).await?,
            Phase::Start => {
                let starting = proxmox.power(&node, vmid, PowerAction::Start).await;
                let start = || format!("starting VM {vmid} on {node}");
                let look_at_guest = seen.guest_checked();
                self.submitted_looking_at_guest(
                    scope,
                    &proxmox,
                    starting,
                    TaskKind::Start,
                    start,
                    look_at_guest,
                )?;
            }
            Phase::RegisterHa => {
                self.register_ha_phase(scope, held, &proxmox, vmid)
                    .await
                    .map_err(|stop| {
                        if provisioned {
                            stop.still_provisioned()
                        } else {
                            stop
                        }
                    })?;
            }
            Phase::AwaitBoot => {
                let wait = self
                    .context
                    .task_timing
                    .boot_remaining(&claim_key(self.machine), &node);
                return Err(waiting(
                    "WaitingForGuestAgent",
                    format!("VM {vmid} started; waiting for its guest to boot"),
                    Action::requeue(wait),
                ));
            }
            Phase::CheckGuest(check) => {
                self.guest_ready(scope, &proxmox, &node, vmid, check)
                    .await?
            }
            Phase::Provisioned => {
                self.provisioned(scope, held, &proxmox, &node, vmid, provisioned)
                    .await?
            }
            Phase::RemoveSeedIso | Phase::DetachSeedIso => {
                self.seed_iso_gone(phase, scope, held, &proxmox, &node, vmid)
                    .await
                    .map_err(Stop::still_provisioned)?;
            }
        }
        Ok(())
    }

    /// A running VM adopted after a move or restore: only its tags change, so it is found by
    /// this machine's tag from now on.
    async fn retag(&self, proxmox: &ProxmoxClient, node: &str, vmid: u32) -> Flow<VmConfig> {
        let read = self
            .configs
            .read(proxmox, node, vmid)
            .await
            .during(|| format!("reading the config of VM {vmid} on {node}"))?;
        if let Some(tags) = self.retagged(&read.tags()) {
            let update = ConfigUpdate::default()
                .set("tags", tags)
                .digest(read.digest());
            proxmox
                .update_vm_config_sync(node, vmid, &update)
                .await
                .during(|| format!("tagging VM {vmid} on {node} for this machine"))?;
        }
        Ok(read)
    }

    /// Records the machine provisioned: provider ID, addresses, readiness. The provider ID
    /// comes from the VM's SMBIOS UUID; once recorded (for this VM: it is how the VM was
    /// found), it is not read again.
    async fn provisioned(
        &self,
        scope: &mut Scope,
        held: &Held,
        proxmox: &ProxmoxClient,
        node: &str,
        vmid: u32,
        already_provisioned: bool,
    ) -> Flow {
        let machine_key = claim_key(self.machine);
        let waited = self.context.task_timing.boot_answered(&machine_key);
        self.wake_machines(&waited);
        if held.addresses_pending {
            return Err(waiting_for_addresses());
        }
        if !already_provisioned {
            self.dhcp_addresses(
                scope,
                held.placement()?,
                held.config.as_ref(),
                proxmox,
                node,
                vmid,
            )
            .await?;
        }
        let known_up = self.context.task_timing.guest_up(&machine_key, vmid);
        let provider_id = match (&held.config, self.machine.spec.provider_id.as_deref()) {
            (None, Some(recorded)) => recorded.to_owned(),
            (config, _) => {
                self.provider_id(config.as_ref(), proxmox, node, vmid)
                    .await?
            }
        };
        self.record_identity(scope, held.placement()?, &provider_id)
            .await?;
        scope.status.addresses = machine_addresses(&scope.name, &scope.status.ip_addresses);
        scope.status.vm_status = Some(VirtualMachineState::Ready);
        scope.status.bootstrap_data_provided = Some(true);
        scope.status.initialization = Some(Initialization {
            provisioned: Some(true),
        });
        if !already_provisioned && !known_up {
            self.event(
                scope,
                EventType::Normal,
                "Provisioned",
                &format!("VM {vmid} on {node} is running and bootstrapped ({provider_id})"),
            )
            .await;
        }
        scope.status.task_ref = None;
        scope.status.retry_after = None;
        scope.status.task_failures = None;
        Ok(())
    }

    /// The VM's config this pass holds, else a read of it.
    pub(super) async fn config_or_read(
        &self,
        config: Option<&VmConfig>,
        proxmox: &ProxmoxClient,
        node: &str,
        vmid: u32,
    ) -> Flow<VmConfig> {
        match config {
            Some(config) => Ok(config.clone()),
            None => Ok(self
                .configs
                .read(proxmox, node, vmid)
                .await
                .during(|| format!("reading the config of VM {vmid} on {node}"))?),
        }
    }

    /// The provider ID of the VM's SMBIOS UUID, from `config` or a read of it.
    async fn provider_id(
        &self,
        config: Option<&VmConfig>,
        proxmox: &ProxmoxClient,
        node: &str,
        vmid: u32,
    ) -> Flow<String> {
        let read_config = || format!("reading the config of VM {vmid} on {node}");
        let config = self.config_or_read(config, proxmox, node, vmid).await?;
        let uuid = smbios_uuid(&config)
            .ok_or_else(|| ProxmoxError::Decode {
                endpoint: "GET /nodes/{node}/qemu/{vmid}/config".into(),
                message: format!("VM {vmid} has no smbios1 uuid"),
            })
            .during(read_config)?;
        Ok(crate::cloudinit::provider_id(&uuid))
    }

    /// Removes the seed ISO (it holds the bootstrap token) once the guest read it, then
    /// remembers it gone so later passes need not read the config for it.
    async fn seed_iso_gone(
        &self,
        phase: Phase,
        scope: &mut Scope,
        held: &mut Held,
        proxmox: &ProxmoxClient,
        node: &str,
        vmid: u32,
    ) -> Flow {
        let machine_key = claim_key(self.machine);
        match (phase, held.config.take()) {
            // Deleted in the task this pass saw end: only the detachment is left, and it needs
            // no look at the config (detaching what is gone is a no-op).
            (Phase::DetachSeedIso, _) => detach_seed_iso(proxmox, node, vmid).await?,
            (_, Some(config)) => self.remove_iso(scope, proxmox, node, vmid, &config).await?,
            // The config as this process left it when it attached the seed ISO; only a read
            // tells that there is no seed ISO to remove (an attachment whose answer was lost
            // is not in what this process wrote).
            (_, None) => {
                let remembered = self
                    .context
                    .vms
                    .written_configs
                    .get(&machine_key, vmid)
                    .filter(|config| seed_iso_attached(config, vmid));
                let config = match remembered {
                    Some(config) => config,
                    None => self
                        .configs
                        .read(proxmox, node, vmid)
                        .await
                        .during(|| format!("reading the config of VM {vmid} on {node}"))?,
                };
                self.remove_iso(scope, proxmox, node, vmid, &config).await?;
            }
        }
        self.context
            .vms
            .seed_isos_removed
            .insert(&machine_key, vmid);
        self.context.vms.written_configs.forget(&machine_key, vmid);
        Ok(())
    }
}
