//! A provisioning pass: its prerequisites (cluster infrastructure, bootstrap data, placement,
//! credentials), the task in flight, the address claims, finding or creating the VM, and then
//! the phases [`steps::plan`] orders from what the pass saw of the VM.

use super::steps::{self, GuestCheck, Phase, Seen};
use super::*;

impl Reconcile<'_> {
    /// One provisioning pass; the step says whether the machine is provisioned or what it waits
    /// for.
    pub(super) async fn provision(
        &self,
        scope: &mut Scope,
        cluster_found: bool,
        capi_cluster: &capi::Cluster,
    ) -> Result<Step, MachineError> {
        let provisioned = capi_cluster
            .status
            .as_ref()
            .and_then(|s| s.initialization.as_ref())
            .and_then(|i| i.infrastructure_provisioned)
            == Some(true);
        if !cluster_found || !provisioned {
            return Ok(waiting(
                "WaitingForClusterInfrastructure",
                "the ProxmoxCluster is not provisioned yet",
                Action::await_change(),
            ));
        }
        let Some(bootstrap_secret) = scope
            .capi_machine
            .spec
            .bootstrap
            .as_ref()
            .and_then(|b| b.data_secret_name.clone())
        else {
            return Ok(waiting(
                "WaitingForBootstrapData",
                "the Machine has no bootstrap data yet",
                Action::await_change(),
            ));
        };
        // Bootstrap data capmox cannot deliver: say so before anything is created.
        let already_provisioned =
            Initialization::provisioned(scope.current.initialization.as_ref());
        if !already_provisioned
            && scope.recorded_vmid.is_none()
            && let Some(step) = self.unsupported_bootstrap(scope, &bootstrap_secret).await?
        {
            return Ok(step);
        }
        // Fresh means this pass saw the latest object: either it already carried the finalizer
        // (and the checkpoint before a clone is guarded by its resourceVersion), or the guarded
        // finalizer patch below succeeded against it.
        let fresh_guard = self
            .machine
            .finalizers()
            .iter()
            .any(|f| f == finalizers::MACHINE)
            .then(|| self.machine.metadata.resource_version.clone())
            .flatten();
        scope.resource_version = fresh_guard;
        guarded::ensure_finalizer(&scope.api, self.machine, finalizers::MACHINE).await?;

        let placement =
            match Placement::resolve(&scope.proxmox_cluster, self.machine, &scope.capi_machine) {
                Ok(placement) => placement,
                Err(error) => {
                    // Retried when the ProxmoxCluster or the Machine changes (both are watched).
                    return Ok(waiting(
                        error.reason(),
                        error.to_string(),
                        Action::requeue(Duration::from_secs(60)),
                    ));
                }
            };
        let endpoint = match self
            .proxmox_client(scope, placement.credentials_ref())
            .await?
        {
            Ok(endpoint) => endpoint,
            Err(message) => {
                return Ok(waiting(
                    "ProxmoxUnavailable",
                    message,
                    Action::requeue(Duration::from_secs(30)),
                ));
            }
        };
        // Recorded on a Proxmox the cluster's credentials no longer reach, and not found on
        // the one they do: nothing happens, least of all a second VM.
        if let Some(message) = self.untrusted(scope, &endpoint).await? {
            return Ok(waiting(
                ENDPOINT_CHANGED,
                message,
                Action::requeue(Duration::from_secs(60)),
            ));
        }
        let proxmox = endpoint.proxmox;

        // A task in flight (recorded by an earlier pass, perhaps before a restart), or the
        // back-off after a failed one: nothing else happens until it is over.
        if let Some(step) = self.tracked_task(scope, &proxmox, false).await? {
            return Ok(if already_provisioned {
                step.still_provisioned()
            } else {
                step
            });
        }

        // Static addresses from the placement's pools: claimed before anything is created in
        // Proxmox, and bound by the IPAM provider while the clone runs; only the seed ISO
        // waits for them. Once bound and recorded, they stay: only the seed ISO reads them
        // again.
        let (addresses, addresses_pending) = if scope.current.ip_addresses.is_empty() {
            let bound = self.addresses(scope, &placement).await?;
            if let Some(addresses) = &bound {
                scope.status.ip_addresses = addresses.status.clone();
            }
            let pending = bound.is_none();
            (bound, pending)
        } else {
            (None, false)
        };

        // The VM: find it, or create it.
        let resources = self
            .context
            .inventory
            .resources(&proxmox, Some(&claim_key(self.machine)))
            .await
            .during(|| "listing Proxmox's VMs and nodes".to_owned())?;
        let Some(vm) = self.find_vm(scope, &resources, &proxmox).await? else {
            // A machine whose spec names its VM never gets a second one.
            if let Some(provider_id) = self.machine.spec.provider_id.as_deref() {
                return Ok(self.vm_not_found(scope, provider_id).await);
            }
            return self
                .create_vm(scope, &placement, &proxmox, &resources)
                .await;
        };
        let node = vm.node.clone().unwrap_or_default();
        let vmid = vm.vmid.unwrap_or_default();
        // Adopted (after a move or restore, or from the Go provider): the spec records the VMID,
        // so a later move finds it even before the VM carries this machine's tag.
        let adopted = scope.current.virtual_machine_id != Some(i64::from(vmid))
            && !Identity::of(self.machine, &scope.name).tagged(&vm.tags);
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
        scope.status.proxmox_node = Some(node.clone());
        scope.status.proxmox_endpoint = Some(proxmox.endpoint().to_owned());
        scope.status.virtual_machine_id = Some(i64::from(vmid));
        scope.status.failure_domain = placement.failure_domain().map(str::to_owned);
        if vm.lock.as_deref() == Some("clone") {
            return Ok(waiting(
                "Cloning",
                format!("VM {vmid} is being cloned on {node}"),
                Action::requeue(Duration::from_secs(1)),
            ));
        }

        let read_config = || format!("reading the config of VM {vmid} on {node}");
        let running = vm.status.as_deref() == Some("running");
        let checks = self.machine.spec.checks.clone().unwrap_or_default();
        let machine_key = claim_key(self.machine);
        let ha = placement.ha();
        let ha_managed = vm.hastate.is_some();
        let ha_pending =
            ha.is_some() && !(ha_managed && self.context.inventory.ha_registered(&proxmox, vmid));
        let seen = Seen {
            running,
            retag: running && self.retagged(&vm.tags).is_some(),
            seed_iso_uploaded: seed_iso_uploaded(scope, &node),
            // Started, or last looked at, too recently for the guest to be worth a look (the
            // pass was woken early, or the start was checked by a process that did not submit it).
            started: self.context.task_clock.boot_not_due(&machine_key).is_some(),
            // Up as this process saw, even if this pass works from a copy older than the
            // status that says so.
            provisioned: already_provisioned || self.context.task_clock.seen_up(&machine_key, vmid),
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
            seed_iso_removed: self.context.seed_isos_removed.contains(&machine_key, vmid),
            seed_iso_deleted: seed_iso_deleted(scope, &node),
            ha_pending,
        };
        // The config is read when a phase needs it, at most once per pass: a running VM waiting
        // for its guest needs none, nor does a VM whose seed ISO this pass saw uploaded.
        let mut config: Option<VmConfig> = None;
        for phase in steps::plan(seen) {
            match phase {
                Phase::Configure => {
                    match self
                        .configured(scope, &placement, &proxmox, &node, vmid)
                        .await?
                    {
                        Ok(current) => config = Some(current),
                        Err(step) => return Ok(step),
                    }
                }
                Phase::Retag => {
                    // A running VM adopted after a move or restore: only its tags change, so it
                    // is found by this machine's tag from now on.
                    let read = self
                        .configs
                        .read(&proxmox, &node, vmid)
                        .await
                        .during(read_config)?;
                    if let Some(tags) = self.retagged(&read.tags()) {
                        let update = ConfigUpdate::default()
                            .set("tags", tags)
                            .digest(read.digest());
                        proxmox
                            .update_vm_config_sync(&node, vmid, &update)
                            .await
                            .during(|| format!("tagging VM {vmid} on {node} for this machine"))?;
                    }
                    config = Some(read);
                }
                Phase::Bootstrap => {
                    // After the upload, the attachment needs nothing of the config.
                    let attaching_only = VmConfig::default();
                    if let Some(step) = self
                        .bootstrap(
                            scope,
                            &placement,
                            &proxmox,
                            &node,
                            vmid,
                            config.as_ref().unwrap_or(&attaching_only),
                            &bootstrap_secret,
                            addresses.as_ref(),
                        )
                        .await?
                    {
                        return Ok(step);
                    }
                }
                Phase::Start => {
                    let starting = proxmox.power(&node, vmid, PowerAction::Start).await;
                    if let Some(step) = self.submitted_looking_at_guest(
                        scope,
                        &proxmox,
                        starting,
                        TaskKind::Start,
                        || format!("starting VM {vmid} on {node}"),
                        seen.guest_checked(),
                    )? {
                        return Ok(step);
                    }
                }
                Phase::RegisterHa => {
                    if let Some(ha) = &ha
                        && !self
                            .register_ha(scope, &proxmox, vmid, ha, placement.role(), ha_managed)
                            .await?
                    {
                        // Another machine changed the HA rules meanwhile: soon again.
                        let step = waiting(
                            "WaitingForHA",
                            format!(
                                "VM {vmid} is HA-managed; its HA rules changed concurrently and are updated again"
                            ),
                            Action::requeue(Duration::from_secs(1)),
                        );
                        return Ok(if already_provisioned {
                            step.still_provisioned()
                        } else {
                            step
                        });
                    }
                }
                Phase::AwaitBoot => {
                    let wait = self.context.task_clock.boot_remaining(&machine_key, &node);
                    return Ok(waiting(
                        "WaitingForGuestAgent",
                        format!("VM {vmid} started; waiting for its guest to boot"),
                        Action::requeue(wait),
                    ));
                }
                Phase::CheckGuest(check) => {
                    if let Some(step) = self
                        .guest_ready(scope, &proxmox, &node, vmid, check)
                        .await?
                    {
                        return Ok(step);
                    }
                }
                Phase::Provisioned => {
                    self.context.task_clock.boot_answered(&machine_key);
                    if addresses_pending {
                        return Ok(waiting_for_addresses());
                    }
                    let known_up = self.context.task_clock.guest_up(&machine_key, vmid);
                    // The provider ID comes from the VM's SMBIOS UUID; once recorded (for this
                    // VM: it is how the VM was found), it is not read again.
                    let provider_id = match (&config, self.machine.spec.provider_id.as_deref()) {
                        (None, Some(recorded)) => recorded.to_owned(),
                        _ => {
                            let config = match &config {
                                Some(config) => config.clone(),
                                None => self
                                    .configs
                                    .read(&proxmox, &node, vmid)
                                    .await
                                    .during(read_config)?,
                            };
                            let uuid = smbios_uuid(&config)
                                .ok_or_else(|| ProxmoxError::Decode {
                                    endpoint: "GET /nodes/{node}/qemu/{vmid}/config".into(),
                                    message: format!("VM {vmid} has no smbios1 uuid"),
                                })
                                .during(read_config)?;
                            crate::cloudinit::provider_id(&uuid)
                        }
                    };
                    self.record_identity(scope, &placement, &provider_id)
                        .await?;
                    scope.status.addresses =
                        machine_addresses(&scope.name, &scope.status.ip_addresses);
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
                            &format!(
                                "VM {vmid} on {node} is running and bootstrapped ({provider_id})"
                            ),
                        )
                        .await;
                    }
                    scope.status.task_ref = None;
                    scope.status.retry_after = None;
                    scope.status.task_failures = None;
                }
                Phase::RemoveSeedIso | Phase::DetachSeedIso => {
                    let removed = match (phase, config.take()) {
                        // Deleted in the task this pass saw end: only the detachment is left,
                        // and it needs no look at the config (detaching what is gone is a
                        // no-op).
                        (Phase::DetachSeedIso, _) => {
                            detach_seed_iso(&proxmox, &node, vmid).await.map(|()| None)
                        }
                        (_, Some(config)) => {
                            self.remove_iso(scope, &proxmox, &node, vmid, &config).await
                        }
                        // The config as this process left it when it attached the seed ISO;
                        // only a read tells that there is no seed ISO to remove (an attachment
                        // whose answer was lost is not in what this process wrote).
                        (_, None) => {
                            let remembered = self
                                .context
                                .written_configs
                                .get(&machine_key, vmid)
                                .filter(|config| seed_iso_attached(config, vmid));
                            let config = match remembered {
                                Some(config) => Ok(config),
                                None => self
                                    .configs
                                    .read(&proxmox, &node, vmid)
                                    .await
                                    .during(read_config),
                            };
                            match config {
                                Ok(config) => {
                                    self.remove_iso(scope, &proxmox, &node, vmid, &config).await
                                }
                                Err(error) => Err(error),
                            }
                        }
                    };
                    let error = match removed {
                        Ok(None) => {
                            self.context.seed_isos_removed.insert(&machine_key, vmid);
                            self.context.written_configs.forget(&machine_key, vmid);
                            continue;
                        }
                        Ok(Some(step)) => return Ok(step.still_provisioned()),
                        Err(error) => error,
                    };
                    // The machine stays provisioned; the seed ISO left behind (it holds the
                    // bootstrap token) is reported by a Warning event, and its removal retried
                    // with back-off.
                    let Some((proxmox, step)) = error.proxmox() else {
                        return Err(error);
                    };
                    let (_, action) = self.proxmox_failure(scope, step, proxmox).await;
                    return Ok(Step::Backoff(
                        Decided::ok(PROVISIONED, "Provisioned", ""),
                        action,
                    ));
                }
            }
        }
        Ok(Step::Continue)
    }

    /// Registers the running VM `vmid` with Proxmox HA ([`crate::controller::ha`]): what
    /// Proxmox refuses is reported by a Warning event and does not stop provisioning;
    /// concurrent changes are retried on the next pass. Whether the registration is complete.
    async fn register_ha(
        &self,
        scope: &Scope,
        proxmox: &ProxmoxClient,
        vmid: u32,
        ha: &crate::placement::MachineHa,
        role: crate::placement::MachineRole,
        managed: bool,
    ) -> Result<bool, MachineError> {
        let names = scope.ha_names();
        let control_plane = role == crate::placement::MachineRole::ControlPlane;
        let major = self.pve_major(proxmox).await?;
        let registered = crate::controller::ha::register(
            proxmox,
            major,
            &names,
            &scope.name,
            control_plane,
            vmid,
            ha,
            managed,
        )
        .await
        .during(|| format!("registering VM {vmid} with Proxmox HA"))?;
        if !managed {
            self.context
                .inventory
                .changed(proxmox, &claim_key(self.machine));
        }
        for warning in &registered.warnings {
            self.event(
                scope,
                EventType::Warning,
                "HAConfigurationRefused",
                &format!("VM {vmid} is HA-managed, but {warning}; fix the HA configuration in Proxmox or the zone's nodes"),
            )
            .await;
        }
        if registered.complete {
            self.context
                .inventory
                .set_ha_registered(proxmox, vmid, true);
        }
        Ok(registered.complete)
    }
}
