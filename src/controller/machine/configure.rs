//! Bringing the cloned VM's hardware, NICs, tags and boot disk to what the spec asks, giving a
//! clone without an SMBIOS UUID one, and recording its identity (provider ID, zone label).

use kube::runtime::events::EventType;

use super::bootstrap::smbios_uuid;
use super::outcome::{Flow, Stop};
use super::task::TaskKind;
use super::vm::is_machine_tag;
use super::{During, MachineError, PROVIDER_ID_PREFIX, Reconcile, Scope, claim_key, machine_tag};
use crate::api::{
    AdditionalVolume, Bios, CpuSpec, PciDevice, ProxmoxMachineSpec, TargetFileStorageFormat,
};
use crate::placement::{self, Placement};
use crate::proxmox::{ConfigUpdate, ProxmoxClient, VmConfig};

impl Reconcile<'_> {
    /// The Configure phase: reads the config (or takes the one this process wrote before its
    /// resize), records the provider ID once the config shows the SMBIOS UUID, and brings the
    /// config to the spec. The config as it is now, or the step the machine waits at.
    pub(super) async fn configured(
        &self,
        scope: &mut Scope,
        placement: &Placement,
        proxmox: &ProxmoxClient,
        node: &str,
        vmid: u32,
    ) -> Flow<VmConfig> {
        let read_config = || format!("reading the config of VM {vmid} on {node}");
        // After the resize this process asked for, the config is as it left it (but the disk's
        // size, which the resize step does not look at again).
        let remembered = disk_resized(scope)
            .then(|| {
                self.context
                    .vms
                    .written_configs
                    .get(&claim_key(self.machine), vmid)
            })
            .flatten();
        let read = match remembered {
            Some(config) => config,
            None => self
                .configs
                .read(proxmox, node, vmid)
                .await
                .during(read_config)?,
        };
        // The provider ID (the VM's SMBIOS UUID) is recorded as soon as the config shows it:
        // CAPI reads it only once the machine is provisioned, and no later pass needs to read
        // the config for it.
        self.record_provider_id(scope, placement, &read).await?;
        let had_uuid = smbios_uuid(&read).is_some();
        let current = match self
            .configure(scope, placement, proxmox, node, vmid, &read)
            .await?
        {
            Configured::Unchanged => read,
            // The bootstrap step works from the config as it is now: as written, or read again
            // when Proxmox filled in values.
            Configured::Changed(Some(updated)) => {
                self.configs.changed(node, vmid);
                updated
            }
            Configured::Changed(None) => {
                self.configs.changed(node, vmid);
                self.configs
                    .read(proxmox, node, vmid)
                    .await
                    .during(read_config)?
            }
        };
        // A UUID this pass gave the VM (its clone had none) is its provider ID from now on.
        if !had_uuid {
            self.record_provider_id(scope, placement, &current).await?;
        }
        Ok(current)
    }

    /// Records the provider ID of the VM's SMBIOS UUID, unless the spec has one or the config
    /// shows no UUID.
    async fn record_provider_id(
        &self,
        scope: &mut Scope,
        placement: &Placement,
        config: &VmConfig,
    ) -> Result<(), MachineError> {
        match smbios_uuid(config) {
            Some(uuid) if self.machine.spec.provider_id.is_none() => {
                let provider_id = crate::cloudinit::provider_id(&uuid);
                self.record_identity(scope, placement, &provider_id).await
            }
            _ => Ok(()),
        }
    }

    /// Sockets, cores, memory, description, NICs and tags, the SMBIOS UUID of a clone without
    /// one, and the boot disk size: each only if it differs.
    pub(super) async fn configure(
        &self,
        scope: &mut Scope,
        placement: &Placement,
        proxmox: &ProxmoxClient,
        node: &str,
        vmid: u32,
        config: &VmConfig,
    ) -> Flow<Configured> {
        let spec = &self.machine.spec;
        let mut configured = Configured::Unchanged;
        let (update, given_uuid) = self.config_update(placement, config)?;
        if let Some(update) = update {
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
            let note = match given_uuid {
                Some(uuid) => format!(
                    "configured VM {vmid}, and gave it the SMBIOS UUID {uuid}: its clone had none"
                ),
                None => format!("configured VM {vmid}"),
            };
            self.event(scope, EventType::Normal, "Configured", &note)
                .await;
        }
        if let Some(missing) = missing_volumes(spec, config)
            .map_err(|problem| Stop::Wait(super::decide::misconfigured("InvalidSpec", problem)))?
        {
            return self.add_volumes(scope, proxmox, node, vmid, missing).await;
        }
        if let Some((disk, size_gb)) = first_to_grow(spec, config) {
            let current = match &configured {
                Configured::Changed(Some(updated)) => Some(updated),
                Configured::Unchanged => Some(config),
                Configured::Changed(None) => None,
            };
            return self
                .grow_disk(scope, proxmox, node, vmid, (&disk, size_gb), current)
                .await;
        }
        Ok(configured)
    }

    /// Allocates the data disks the config lacks, in one config write (a task).
    async fn add_volumes(
        &self,
        scope: &mut Scope,
        proxmox: &ProxmoxClient,
        node: &str,
        vmid: u32,
        missing: ConfigUpdate,
    ) -> Flow<Configured> {
        let slots: Vec<String> = missing.set.keys().cloned().collect();
        let started = proxmox.update_vm_config(node, vmid, &missing).await;
        self.configs.changed(node, vmid);
        self.context
            .vms
            .written_configs
            .forget(&claim_key(self.machine), vmid);
        self.submitted(scope, proxmox, started, TaskKind::AddDisks, || {
            format!("adding disks {} to VM {vmid}", slots.join(", "))
        })?;
        Ok(Configured::Changed(None))
    }

    /// Grows `disk` to `size_gb` (a task). The pass that sees the resize end works from
    /// `current` (the config as written here) with the disk at its new size, so it goes on to
    /// the next disk without reading the config again.
    async fn grow_disk(
        &self,
        scope: &mut Scope,
        proxmox: &ProxmoxClient,
        node: &str,
        vmid: u32,
        (disk, size_gb): (&str, u64),
        current: Option<&VmConfig>,
    ) -> Flow<Configured> {
        let started = proxmox
            .resize_disk(node, vmid, disk, &format!("{size_gb}G"), None)
            .await;
        let step = self.submitted(scope, proxmox, started, TaskKind::Resize, || {
            format!("resizing {disk} of VM {vmid} to {size_gb} GB")
        });
        let written = &self.context.vms.written_configs;
        let machine = claim_key(self.machine);
        match (&step, current) {
            (Err(Stop::Failed(_)), _) | (_, None) => written.forget(&machine, vmid),
            (_, Some(config)) => {
                written.remember(&machine, vmid, with_disk_size(config, disk, size_gb))
            }
        }
        // Waiting for the resize (a task), or done (Proxmox resized synchronously).
        step?;
        Ok(Configured::Changed(None))
    }

    /// What [`Reconcile::configure`] writes in one config update (`None`: nothing differs),
    /// and the SMBIOS UUID it gives the VM when the config has none.
    fn config_update(
        &self,
        placement: &Placement,
        config: &VmConfig,
    ) -> Result<(Option<ConfigUpdate>, Option<String>), MachineError> {
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
        if let Some(cpu) = spec.cpu.as_ref().and_then(cpu_value) {
            set("cpu", cpu);
        }
        if let Some(numa) = spec.numa {
            set("numa", u8::from(numa).to_string());
        }
        if let Some(bios) = spec.bios {
            set("bios", bios_value(bios).to_owned());
        }
        for nic in placement.network_devices() {
            let existing = config.get(&nic.name).unwrap_or_default();
            set(&nic.name, nic_value(&existing, nic)?);
        }
        for (slot, device) in spec.pci_devices.iter().enumerate() {
            set(&format!("hostpci{slot}"), pci_value(device));
        }
        // Proxmox puts a device on a PCI Express port only on the q35 machine type.
        let wants_pcie = spec.pci_devices.iter().any(|d| d.pcie == Some(true));
        if wants_pcie && !config.get("machine").is_some_and(|m| m.contains("q35")) {
            set("machine", "q35".to_owned());
        }
        // Proxmox gives a clone a new SMBIOS UUID only when its template has smbios1; the VM
        // keeps the one written here, so a later pass (or process) reads it back.
        let given_uuid = match smbios_uuid(config) {
            Some(_) => None,
            None => Some(self.uuid_for_clone()?),
        };
        if let Some(uuid) = &given_uuid {
            let current = config.get("smbios1");
            set(
                "smbios1",
                crate::cloudinit::smbios_with_uuid(current.as_deref(), uuid),
            );
        }
        if let Some(tags) = self.retagged(&config.tags()) {
            update = update.set("tags", tags);
            changed = true;
        }
        Ok((changed.then_some(update), given_uuid))
    }

    /// The SMBIOS UUID for a VM whose config has none: the one `spec.providerID` records (the
    /// machine's Node carries it), else a new random one.
    fn uuid_for_clone(&self) -> Result<String, MachineError> {
        let recorded = self
            .machine
            .spec
            .provider_id
            .as_deref()
            .and_then(|id| id.strip_prefix(PROVIDER_ID_PREFIX))
            .and_then(|uuid| crate::cloudinit::instance_id_from_smbios(&format!("uuid={uuid}")));
        if let Some(uuid) = recorded {
            return Ok(uuid);
        }
        let mut bytes = [0u8; 16];
        ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut bytes)
            .map_err(|_| MachineError::Random)?;
        Ok(crate::cloudinit::uuid_v4(bytes))
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
}

/// The `netN` value for a NIC: the template's value with the model (keeping the MAC Proxmox
/// assigned) and the bridge, MTU, queues and VLAN tag the spec sets replaced, the template's
/// other options kept. A bridge that is not a bridge name is refused, never written (it would
/// add options of its own).
pub(super) fn nic_value(
    existing: &str,
    nic: &placement::ResolvedNic,
) -> Result<String, crate::proxmox::ProxmoxError> {
    let model = serde_json::to_value(nic.model)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_else(|| "virtio".into());
    let mac = crate::proxmox::NetDevice::parse(0, existing).mac;
    let mut value = match mac {
        Some(mac) => format!("{model}={mac}"),
        None => model,
    };
    let bridge = match &nic.bridge {
        Some(bridge) => Some(
            crate::proxmox::path::checked("bridge", crate::api::names::NameRule::Bridge, bridge)?
                .to_owned(),
        ),
        None => None,
    };
    // Sorted by key after the model, as Proxmox prints a NIC, so an unchanged NIC compares equal.
    let mut options: std::collections::BTreeMap<String, Option<String>> = nic_options(existing)
        .into_iter()
        .filter(|(key, _)| key != "model" && key != "macaddr")
        .collect();
    let owned = [
        ("bridge", bridge),
        ("mtu", nic.mtu.map(|m| m.to_string())),
        ("queues", nic.queues.map(|q| q.to_string())),
        ("tag", nic.vlan.map(|v| v.to_string())),
    ];
    for (key, wanted) in owned {
        if let Some(wanted) = wanted {
            options.insert(key.to_owned(), Some(wanted));
        }
    }
    for (key, option) in options {
        match option {
            Some(option) => value.push_str(&format!(",{key}={option}")),
            None => value.push_str(&format!(",{key}")),
        }
    }
    Ok(value)
}

/// The options of a `netN` value after its leading `model[=mac]`, in order.
fn nic_options(existing: &str) -> Vec<(String, Option<String>)> {
    existing
        .split(',')
        .map(str::trim)
        .filter(|part| !part.is_empty())
        .enumerate()
        .filter_map(|(i, part)| {
            let (key, value) = match part.split_once('=') {
                Some((k, v)) => (k.trim(), Some(v.trim().to_owned())),
                None => (part, None),
            };
            // The first option without a known key is the model (`virtio=<mac>`).
            let leading_model = i == 0 && !NIC_KEYS.contains(&key);
            (!leading_model).then(|| (key.to_owned(), value))
        })
        .collect()
}

/// The keys of Proxmox's `netN` property string (qemu-server's `$net_fmt`) other than the
/// model names, so a leading `virtio=<mac>` is told from an option.
const NIC_KEYS: &[&str] = &[
    "model",
    "macaddr",
    "bridge",
    "tag",
    "trunks",
    "firewall",
    "link_down",
    "mtu",
    "queues",
    "rate",
];

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

/// The data disks (and the EFI disk and TPM state the firmware wants) of `spec` that `config`
/// lacks, as one config update allocating them (`None`: none is missing), or why a disk's
/// storage is unknown.
fn missing_volumes(
    spec: &ProxmoxMachineSpec,
    config: &VmConfig,
) -> Result<Option<ConfigUpdate>, String> {
    let volumes = spec.disks.iter().flat_map(|d| &d.additional_volumes);
    let mut update = firmware_volumes(spec, config)?;
    for volume in volumes.filter(|v| config.get(&v.disk).is_none()) {
        let storage = volume
            .storage
            .clone()
            .or_else(|| spec.storage.clone())
            .or_else(|| boot_storage(spec, config))
            .ok_or_else(|| {
                format!(
                    "no storage for the additional volume {}: set its storage or spec.storage (the boot disk's storage is not known)",
                    volume.disk
                )
            })?;
        update = update.set(&volume.disk, volume_value(volume, &storage));
    }
    Ok((!update.set.is_empty()).then_some(update))
}

/// The EFI disk (`bios: ovmf`) and TPM state (`tpm`) the config lacks, to allocate on
/// `spec.storage`, else the boot disk's storage (Proxmox sizes both itself).
fn firmware_volumes(spec: &ProxmoxMachineSpec, config: &VmConfig) -> Result<ConfigUpdate, String> {
    let uefi = spec.bios == Some(Bios::Ovmf);
    let wanted = [
        (
            uefi,
            "efidisk0",
            format!(
                "efitype=4m,pre-enrolled-keys={}",
                u8::from(spec.secure_boot == Some(true))
            ),
        ),
        (
            uefi && spec.tpm == Some(true),
            "tpmstate0",
            "version=v2.0".to_owned(),
        ),
    ];
    let mut update = ConfigUpdate::default();
    for (_, key, options) in wanted
        .iter()
        .filter(|(on, key, _)| *on && config.get(key).is_none())
    {
        let storage = spec
            .storage
            .clone()
            .or_else(|| boot_storage(spec, config))
            .ok_or_else(|| {
                format!(
                    "no storage for {key}: set spec.storage (the boot disk's storage is not known)"
                )
            })?;
        update = update.set(key, format!("{storage}:1,{options}"));
    }
    Ok(update)
}

/// The `cpu` option of `cpu`: the model, then its flags (`host,flags=+aes;-pcid`).
/// A `hostpciN` value as Proxmox prints it: the mapping, then its options.
fn pci_value(device: &PciDevice) -> String {
    let mut value = format!("mapping={}", device.mapping);
    if device.pcie == Some(true) {
        value.push_str(",pcie=1");
    }
    if let Some(rombar) = device.rombar {
        value.push_str(if rombar { ",rombar=1" } else { ",rombar=0" });
    }
    if device.primary_gpu == Some(true) {
        value.push_str(",x-vga=1");
    }
    value
}

fn cpu_value(cpu: &CpuSpec) -> Option<String> {
    let flags = (!cpu.flags.is_empty()).then(|| format!("flags={}", cpu.flags.join(";")));
    let parts: Vec<String> = cpu.type_.iter().cloned().chain(flags).collect();
    (!parts.is_empty()).then(|| parts.join(","))
}

/// The `bios` option of `bios`.
fn bios_value(bios: Bios) -> &'static str {
    match bios {
        Bios::Seabios => "seabios",
        Bios::Ovmf => "ovmf",
    }
}

/// How Proxmox is asked to allocate `volume` on `storage`: `STORAGE:SIZE` and its options.
fn volume_value(volume: &AdditionalVolume, storage: &str) -> String {
    let mut value = format!("{storage}:{}", volume.size_gb);
    if let Some(format) = volume.format {
        let format = match format {
            TargetFileStorageFormat::Raw => "raw",
            TargetFileStorageFormat::Qcow2 => "qcow2",
            TargetFileStorageFormat::Vmdk => "vmdk",
        };
        value.push_str(&format!(",format={format}"));
    }
    for (on, option) in [
        (volume.discard, "discard=on"),
        (volume.io_thread, "iothread=1"),
        (volume.ssd, "ssd=1"),
    ] {
        if on == Some(true) {
            value.push(',');
            value.push_str(option);
        }
    }
    value
}

/// The storage of the VM's boot disk: the spec's boot volume, else the first disk slot in
/// Proxmox's boot order of buses that holds a volume.
fn boot_storage(spec: &ProxmoxMachineSpec, config: &VmConfig) -> Option<String> {
    let named = spec
        .disks
        .as_ref()
        .and_then(|d| d.boot_volume.as_ref())
        .map(|b| b.disk.clone());
    named
        .into_iter()
        .chain(["scsi0", "virtio0", "sata0", "ide0"].map(str::to_owned))
        .filter_map(|slot| config.get(&slot))
        .find(|value| !value.contains("media=cdrom"))
        .and_then(|value| {
            value
                .split(',')
                .next()
                .and_then(|volume| volume.split_once(':'))
                .map(|(storage, _)| storage.to_owned())
        })
}

/// The first disk of the spec (boot volume, then data disks) smaller in `config` than asked.
fn first_to_grow(spec: &ProxmoxMachineSpec, config: &VmConfig) -> Option<(String, u64)> {
    let disks = spec.disks.as_ref()?;
    let boot = disks.boot_volume.iter().map(|b| (&b.disk, b.size_gb));
    let data = disks
        .additional_volumes
        .iter()
        .map(|v| (&v.disk, v.size_gb));
    boot.chain(data).find_map(|(disk, size_gb)| {
        let wanted = u64::try_from(size_gb).ok()?;
        let current = config.get(disk).and_then(|v| disk_size_gb(&v)).unwrap_or(0);
        (current < wanted).then(|| (disk.clone(), wanted))
    })
}

/// `config` with `disk` at `size_gb`, as it is once a resize to that size ended.
fn with_disk_size(config: &VmConfig, disk: &str, size_gb: u64) -> VmConfig {
    let Some(value) = config.get(disk) else {
        return config.clone();
    };
    let mut parts: Vec<String> = value
        .split(',')
        .filter(|part| !part.starts_with("size="))
        .map(str::to_owned)
        .collect();
    parts.push(format!("size={size_gb}G"));
    config.updated(&ConfigUpdate::default().set(disk, parts.join(",")))
}

/// Whether this pass saw a disk's resize end.
pub(super) fn disk_resized(scope: &Scope) -> bool {
    scope.finished_as(TaskKind::Resize).is_some()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nic(bridge: &str) -> placement::ResolvedNic {
        placement::ResolvedNic {
            bridge: Some(bridge.into()),
            ..placement::fixtures::resolved_nic("net0")
        }
    }

    #[test]
    fn the_template_nics_other_options_are_kept() {
        let template = "virtio=AA:BB:CC:DD:EE:FF,bridge=vmbr0,firewall=1,rate=50";
        assert_eq!(
            nic_value(template, &nic("vmbr1")).unwrap(),
            "virtio=AA:BB:CC:DD:EE:FF,bridge=vmbr1,firewall=1,rate=50"
        );
        let tagged = placement::ResolvedNic {
            vlan: Some(20),
            mtu: Some(1),
            queues: Some(4),
            ..nic("vmbr0")
        };
        assert_eq!(
            nic_value(
                "model=e1000,macaddr=AA:BB:CC:DD:EE:FF,bridge=vmbr9,link_down=1,queues=2,tag=5",
                &tagged
            )
            .unwrap(),
            "virtio=AA:BB:CC:DD:EE:FF,bridge=vmbr0,link_down=1,mtu=1,queues=4,tag=20"
        );
    }

    #[test]
    fn an_unchanged_nic_is_written_as_proxmox_prints_it() {
        let current = "virtio=AA:BB:CC:DD:EE:FF,bridge=vmbr0,firewall=1,tag=20";
        assert_eq!(nic_value(current, &nic("vmbr0")).unwrap(), current);
    }

    #[test]
    fn a_bridge_that_adds_options_is_refused() {
        let error = nic_value(
            "virtio=AA:BB:CC:DD:EE:FF,bridge=vmbr0,firewall=1",
            &nic("vmbr0,firewall=0"),
        )
        .expect_err("not a bridge name");
        assert!(
            error
                .to_string()
                .contains("is not a valid Proxmox bridge name"),
            "{error}"
        );
    }

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

    fn config(value: serde_json::Value) -> VmConfig {
        serde_json::from_value(value).expect("a config")
    }

    fn spec(disks: serde_json::Value) -> ProxmoxMachineSpec {
        serde_json::from_value(serde_json::json!({
            "sourceNode": "pve1", "templateID": 100,
            "network": {"networkDevices": [{"name": "net0", "bridge": "vmbr0"}]},
            "disks": disks
        }))
        .expect("a spec")
    }

    #[test]
    fn missing_data_disks_are_allocated_in_one_write_on_the_storage_they_name_or_the_boot_disks() {
        let cloned = config(serde_json::json!({
            "scsi0": "ceph:vm-101-disk-0,size=10G", "ide2": "local:iso/seed.iso,media=cdrom",
            "scsi2": "ceph:vm-101-disk-1,size=8G"
        }));
        let wanted = spec(serde_json::json!({"additionalVolumes": [
            {"disk": "scsi1", "sizeGb": 20, "discard": true, "ioThread": true, "ssd": true},
            {"disk": "virtio1", "sizeGb": 50, "storage": "local-lvm", "format": "raw"},
            {"disk": "scsi2", "sizeGb": 8}
        ]}));
        let update = missing_volumes(&wanted, &cloned)
            .expect("storages known")
            .expect("two disks missing");
        assert_eq!(
            update.set.into_iter().collect::<Vec<_>>(),
            [
                (
                    "scsi1".to_owned(),
                    "ceph:20,discard=on,iothread=1,ssd=1".to_owned()
                ),
                ("virtio1".to_owned(), "local-lvm:50,format=raw".to_owned()),
            ],
            "scsi2 is the template's and stays"
        );
        // spec.storage comes before the boot disk's.
        let mut on_spec_storage = wanted.clone();
        on_spec_storage.storage = Some("nfs".to_owned());
        let update = missing_volumes(&on_spec_storage, &cloned)
            .expect("known")
            .expect("missing");
        assert_eq!(update.set["scsi1"], "nfs:20,discard=on,iothread=1,ssd=1");
        // Nothing missing: nothing written. No storage at all: said, not guessed.
        assert_eq!(
            missing_volumes(&spec(serde_json::json!({})), &cloned),
            Ok(None)
        );
        let no_disk = config(serde_json::json!({"ide2": "local:iso/seed.iso,media=cdrom"}));
        let problem = missing_volumes(&wanted, &no_disk).expect_err("no storage");
        assert!(
            problem.starts_with("no storage for the additional volume scsi1"),
            "{problem}"
        );
    }

    #[test]
    fn disks_grow_one_after_another_boot_disk_first() {
        let wanted = spec(serde_json::json!({
            "bootVolume": {"disk": "scsi0", "sizeGb": 30},
            "additionalVolumes": [{"disk": "scsi1", "sizeGb": 20}]
        }));
        let small = config(serde_json::json!({
            "scsi0": "ceph:vm-101-disk-0,size=10G", "scsi1": "ceph:vm-101-disk-1,discard=on,size=8G"
        }));
        assert_eq!(
            first_to_grow(&wanted, &small),
            Some(("scsi0".to_owned(), 30))
        );
        // The config as it is once that resize ended: the next disk comes next.
        let boot_grown = with_disk_size(&small, "scsi0", 30);
        assert_eq!(
            boot_grown.get("scsi0").as_deref(),
            Some("ceph:vm-101-disk-0,size=30G")
        );
        assert_eq!(
            first_to_grow(&wanted, &boot_grown),
            Some(("scsi1".to_owned(), 20))
        );
        let all_grown = with_disk_size(&boot_grown, "scsi1", 20);
        assert_eq!(
            all_grown.get("scsi1").as_deref(),
            Some("ceph:vm-101-disk-1,discard=on,size=20G"),
            "the disk's options stay"
        );
        assert_eq!(first_to_grow(&wanted, &all_grown), None);
    }

    #[test]
    fn uefi_gets_an_efi_disk_and_a_tpm_on_the_boot_disks_storage_once() {
        let mut uefi = spec(serde_json::json!({}));
        uefi.bios = Some(Bios::Ovmf);
        uefi.secure_boot = Some(true);
        uefi.tpm = Some(true);
        let cloned = config(serde_json::json!({"scsi0": "local-lvm:vm-101-disk-0,size=10G"}));
        let update = missing_volumes(&uefi, &cloned)
            .expect("storage known")
            .expect("both missing");
        assert_eq!(
            update.set.into_iter().collect::<Vec<_>>(),
            [
                (
                    "efidisk0".to_owned(),
                    "local-lvm:1,efitype=4m,pre-enrolled-keys=1".to_owned()
                ),
                (
                    "tpmstate0".to_owned(),
                    "local-lvm:1,version=v2.0".to_owned()
                ),
            ]
        );
        // A template that has them keeps its own; no TPM without asking; nothing for seabios.
        let with_efi = config(serde_json::json!({
            "scsi0": "local-lvm:vm-101-disk-0,size=10G",
            "efidisk0": "local-lvm:vm-101-disk-1,efitype=4m,size=4M"
        }));
        uefi.tpm = None;
        assert_eq!(missing_volumes(&uefi, &with_efi), Ok(None));
        uefi.bios = Some(Bios::Seabios);
        assert_eq!(missing_volumes(&uefi, &cloned), Ok(None));
    }

    #[test]
    fn the_cpu_option_names_the_model_then_its_flags() {
        let cpu = |type_: Option<&str>, flags: &[&str]| CpuSpec {
            type_: type_.map(str::to_owned),
            flags: flags.iter().map(|f| (*f).to_owned()).collect(),
        };
        assert_eq!(cpu_value(&cpu(Some("host"), &[])).as_deref(), Some("host"));
        assert_eq!(
            cpu_value(&cpu(Some("x86-64-v2-AES"), &["+aes", "-pcid"])).as_deref(),
            Some("x86-64-v2-AES,flags=+aes;-pcid")
        );
        assert_eq!(
            cpu_value(&cpu(None, &["+aes"])).as_deref(),
            Some("flags=+aes")
        );
        assert_eq!(cpu_value(&cpu(None, &[])), None);
    }

    #[test]
    fn pci_devices_are_written_as_proxmox_prints_them() {
        let device = |v: serde_json::Value| -> PciDevice { serde_json::from_value(v).unwrap() };
        let cases = [
            (serde_json::json!({"mapping": "gpu"}), "mapping=gpu"),
            (
                serde_json::json!({"mapping": "gpu", "pcie": true, "rombar": false, "primaryGPU": true}),
                "mapping=gpu,pcie=1,rombar=0,x-vga=1",
            ),
            (
                serde_json::json!({"mapping": "nic", "rombar": true}),
                "mapping=nic,rombar=1",
            ),
        ];
        for (spec, want) in cases {
            assert_eq!(pci_value(&device(spec)), want);
        }
    }
}
