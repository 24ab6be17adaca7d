//! Bringing the cloned VM's hardware, NICs, tags and boot disk to what the spec asks, and
//! recording its identity (provider ID, zone label).

use super::*;

impl Reconcile<'_> {
    /// Writes `provider_id` to the machine's spec and its zone (`default` without one) to its
    /// `topology.kubernetes.io/proxmox-zone` label, as the Go provider labels its machines for
    /// users to select on, unless both are there already.
    pub(super) async fn record_identity(
        &self,
        scope: &mut Scope,
        placement: &Placement,
        provider_id: &str,
    ) -> Result<(), MachineError> {
        let zone = placement.zone_label();
        if self.machine.spec.provider_id.as_deref() == Some(provider_id)
            && self
                .machine
                .labels()
                .get(labels::PROXMOX_ZONE)
                .map(String::as_str)
                == Some(zone)
        {
            return Ok(());
        }
        let patched = scope
            .api
            .patch(
                &scope.name,
                &PatchParams::default(),
                &Patch::Merge(json!({
                    "metadata": {"labels": {labels::PROXMOX_ZONE: zone}},
                    "spec": {"providerID": provider_id},
                })),
            )
            .await?;
        scope.generation = patched.metadata.generation;
        Ok(())
    }

    /// Sockets, cores, memory, description, NICs and tags, and the boot disk size: each only if it differs.
    pub(super) async fn configure(
        &self,
        scope: &mut Scope,
        placement: &Placement,
        proxmox: &ProxmoxClient,
        node: &str,
        vmid: u32,
        config: &VmConfig,
    ) -> Result<Configured, MachineError> {
        let spec = &self.machine.spec;
        let mut update = ConfigUpdate::default();
        let mut changed = false;
        let mut set = |key: &str, value: String| {
            if config.get(key).as_deref() != Some(value.as_str()) {
                update = std::mem::take(&mut update).set(key, &value);
                changed = true;
            }
        };
        if let Some(sockets) = spec.num_sockets {
            set("sockets", sockets.to_string());
        }
        if let Some(cores) = spec.num_cores {
            set("cores", cores.to_string());
        }
        if let Some(memory) = spec.memory_mib {
            set("memory", memory.to_string());
        }
        if let Some(description) = &spec.description {
            set("description", description.clone());
        }
        for nic in placement.network_devices() {
            let existing = config.get(&nic.name).unwrap_or_default();
            set(&nic.name, nic_value(&existing, nic));
        }
        if let Some(tags) = self.retagged(&config.tags()) {
            update = std::mem::take(&mut update).set("tags", tags);
            changed = true;
        }
        let mut configured = Configured::Unchanged;
        if changed {
            let update = update.digest(config.digest());
            // Synchronous: these settings need neither hotplug nor new storage.
            proxmox
                .update_vm_config_sync(node, vmid, &update)
                .await
                .during(|| format!("configuring VM {vmid} on {node}"))?;
            let macs_known = update
                .set
                .iter()
                .filter(|(key, _)| key.starts_with("net"))
                .all(|(_, value)| crate::cloudinit::mac_from_net_config(value).is_some());
            configured = Configured::Changed(macs_known.then(|| config.updated(&update)));
            self.event(
                scope,
                EventType::Normal,
                "Configured",
                &format!("configured VM {vmid}"),
            )
            .await;
        }
        if let Some(boot) = spec.disks.as_ref().and_then(|d| d.boot_volume.as_ref()) {
            let current_gb = config
                .get(&boot.disk)
                .and_then(|v| disk_size_gb(&v))
                .unwrap_or(0);
            if current_gb < u64::try_from(boot.size_gb).unwrap_or(0) && !disk_resized(scope) {
                let started = proxmox
                    .resize_disk(node, vmid, &boot.disk, &format!("{}G", boot.size_gb), None)
                    .await;
                let step = self.submitted(scope, proxmox, started, TaskKind::Resize, || {
                    format!("resizing {} of VM {vmid} to {} GB", boot.disk, boot.size_gb)
                });
                // The pass that sees the resize end works from the config as written here.
                let written = &self.context.written_configs;
                let machine = claim_key(self.machine);
                let step = match step {
                    Ok(step) => step,
                    Err(error) => {
                        written.forget(&machine, vmid);
                        return Err(error);
                    }
                };
                match &configured {
                    Configured::Unchanged => written.remember(&machine, vmid, config.clone()),
                    Configured::Changed(Some(updated)) => {
                        written.remember(&machine, vmid, updated.clone());
                    }
                    _ => written.forget(&machine, vmid),
                }
                return Ok(step.map_or(Configured::Changed(None), Configured::Waiting));
            }
        }
        Ok(configured)
    }

    /// The VM's tags with this machine's tag (in place of the tag of the machine a move or
    /// restore replaced) and `spec.tags`, if that differs from what it has.
    pub(super) fn retagged(&self, current: &[String]) -> Option<String> {
        let ours = machine_tag(self.machine);
        let spec_tags = self.machine.spec.tags.clone().unwrap_or_default();
        let mut tags: Vec<String> = current
            .iter()
            .filter(|t| {
                !is_machine_tag(t)
                    || t.eq_ignore_ascii_case(&ours)
                    || spec_tags.iter().any(|s| s.eq_ignore_ascii_case(t))
            })
            .cloned()
            .collect();
        let kept = tags.len();
        let wanted = std::iter::once(ours).chain(spec_tags);
        for tag in wanted {
            if !tags.iter().any(|t| t.eq_ignore_ascii_case(&tag)) {
                tags.push(tag.to_ascii_lowercase());
            }
        }
        (tags.len() != kept || kept != current.len()).then(|| tags.join(";"))
    }
}

/// What [`Reconcile::configure`] did to the VM's config.
pub(super) enum Configured {
    /// Nothing: the config is as the spec wants it.
    Unchanged,
    /// Changed it; what was read before is out of date. With the config as it is now, when
    /// Proxmox took every value as sent (a NIC without a MAC gets one from Proxmox, so its
    /// config must be read again).
    Changed(Option<VmConfig>),
    /// Started a task (a disk resize) that the machine waits for.
    Waiting(Step),
}

/// The `netN` value for a NIC, keeping the MAC Proxmox assigned.
pub(super) fn nic_value(existing: &str, nic: &placement::ResolvedNic) -> String {
    let model = serde_json::to_value(nic.model)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_else(|| "virtio".into());
    let mac = crate::proxmox::NetDevice::parse(0, existing).mac;
    let mut value = match mac {
        Some(mac) => format!("{model}={mac}"),
        None => model,
    };
    if let Some(bridge) = &nic.bridge {
        value.push_str(&format!(",bridge={bridge}"));
    }
    if let Some(mtu) = nic.mtu {
        value.push_str(&format!(",mtu={mtu}"));
    }
    if let Some(queues) = nic.queues {
        value.push_str(&format!(",queues={queues}"));
    }
    if let Some(vlan) = nic.vlan {
        value.push_str(&format!(",tag={vlan}"));
    }
    value
}

/// Size in GB of a disk value like `ceph:vm-100-disk-0,size=10G`.
pub(super) fn disk_size_gb(value: &str) -> Option<u64> {
    let size = value
        .split(',')
        .find_map(|part| part.strip_prefix("size="))?;
    let (number, unit) = size.split_at(
        size.find(|c: char| !c.is_ascii_digit())
            .unwrap_or(size.len()),
    );
    let number: u64 = number.parse().ok()?;
    Some(match unit {
        "T" => number.checked_mul(1024)?,
        "G" | "" => number,
        "M" => number / 1024,
        "K" => number / (1024 * 1024),
        _ => return None,
    })
}

/// Whether this pass saw the boot disk's resize end.
pub(super) fn disk_resized(scope: &Scope) -> bool {
    scope.finished_as(TaskKind::Resize).is_some()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn disk_sizes_parse_in_gb() {
        assert_eq!(disk_size_gb("ceph:vm-100-disk-0,size=10G"), Some(10));
        assert_eq!(
            disk_size_gb("local:100/vm-100-disk-0.qcow2,discard=on,size=1T"),
            Some(1024)
        );
        assert_eq!(disk_size_gb("ceph:vm-100-disk-0"), None);
        assert_eq!(
            disk_size_gb("ceph:vm-100-disk-0,size=18446744073709551615T"),
            None,
            "a size beyond u64 is unreadable, not a panic"
        );
    }
}
