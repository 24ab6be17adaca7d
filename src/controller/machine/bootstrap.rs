//! Bootstrap data: the format check before anything is created, the seed ISO built, uploaded
//! and attached, and its removal once the guest read it.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Secret;
use kube::Api;
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;

use super::addresses::{Addresses, pool_metric};
use super::looks::Held;
use super::outcome::{Flow, Stop, waiting, waiting_for_addresses, waiting_longer};
use super::task::TaskKind;
use super::{
    During, MachineError, Reconcile, Scope, UNSUPPORTED_BOOTSTRAP_REQUEUE, VM_CONFIG_BACKOFF,
    claim_key,
};
use crate::controller::bootstrap_secrets::BootstrapData;
use crate::controller::failures;
use crate::placement::{self, Placement};
use crate::proxmox::{ConfigUpdate, ProxmoxClient, VmConfig};

impl Reconcile<'_> {
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
    ) -> Flow {
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
            return Ok(());
        };
        let Some((storage, _)) = volume.split_once(':') else {
            return Ok(());
        };
        let started = proxmox.delete_volume(node, storage, &volume).await;
        self.deletion_submitted(scope, proxmox, started, TaskKind::DeleteSeedIso, || {
            format!("deleting the seed ISO {volume} of VM {vmid}")
        })
    }

    /// Stops before creating anything when the bootstrap Secret holds data capmox cannot
    /// deliver (unknown formats, malformed Ignition). A missing Secret is reported where it is read.
    pub(super) async fn deliverable_bootstrap(&self, scope: &Scope) -> Flow {
        let Some(secret_name) = bootstrap_secret(scope) else {
            return Ok(());
        };
        let Some(data) = self.bootstrap_data(scope, secret_name).await? else {
            return Ok(());
        };
        let format = data
            .get("format")
            .map(|v| String::from_utf8_lossy(&v.0).into_owned());
        let value = data.get("value");
        let error = match crate::cloudinit::BootstrapFormat::parse(format.as_deref()) {
            Ok(crate::cloudinit::BootstrapFormat::CloudConfig) => return Ok(()),
            Ok(crate::cloudinit::BootstrapFormat::Ignition) => {
                match crate::cloudinit::ignition::check(value.map_or(&[][..], |v| &v.0)) {
                    Ok(()) => return Ok(()),
                    Err(error) => crate::cloudinit::CloudInitError::from(error),
                }
            }
            Err(error) => error,
        };
        let message = format!("bootstrap Secret {secret_name}: {error}");
        self.event(scope, EventType::Warning, error.reason(), &message)
            .await;
        Err(waiting(
            error.reason(),
            message,
            Action::requeue(UNSUPPORTED_BOOTSTRAP_REQUEUE),
        ))
    }

    /// The data of bootstrap Secret `name`: as its watch delivered it, or read. What is read is
    /// not held: without the watch, nothing would show a later change to it.
    async fn bootstrap_data(
        &self,
        scope: &Scope,
        name: &str,
    ) -> Result<Option<BootstrapData>, kube::Error> {
        if let Some(data) = self.context.bootstrap_secrets.get(&scope.namespace, name) {
            return Ok(Some(data));
        }
        let secret = Api::<Secret>::namespaced(self.context.client.clone(), &scope.namespace)
            .get_opt(name)
            .await?;
        Ok(secret.map(|secret| Arc::new(secret.data.unwrap_or_default())))
    }

    /// Builds and uploads (a task) the machine's seed ISO, and attaches it.
    pub(super) async fn bootstrap(
        &self,
        scope: &mut Scope,
        held: &Held,
        proxmox: &ProxmoxClient,
        node: &str,
        vmid: u32,
    ) -> Flow {
        // After the upload, the attachment needs nothing of the config.
        let attaching_only = VmConfig::default();
        let config = held.config.as_ref().unwrap_or(&attaching_only);
        let uploads = &self.context.vms.seed_isos_uploaded;
        let machine_key = claim_key(self.machine);
        if seed_iso_attached(config, vmid) {
            uploads.attached(&machine_key, vmid);
            return Ok(());
        }
        // The upload this pass, or one whose attachment failed, saw succeed: only the
        // attachment is left.
        if seed_iso_uploaded(scope, node) {
            uploads.uploaded(&machine_key, vmid, node);
        }
        let image = if uploads.awaits_attachment(&machine_key, vmid, node) {
            None
        } else {
            Some(self.seed_iso_image(scope, held, vmid, config).await?)
        };
        self.upload_and_attach(scope, proxmox, node, vmid, config, image)
            .await
    }

    /// The seed ISO's image, once the machine's addresses are bound.
    async fn seed_iso_image(
        &self,
        scope: &Scope,
        held: &Held,
        vmid: u32,
        config: &VmConfig,
    ) -> Flow<Vec<u8>> {
        let placement = held.placement()?;
        let read;
        let addresses = match &held.addresses {
            Some(addresses) => addresses,
            None => match self.addresses(scope, placement).await? {
                Some(addresses) => {
                    read = addresses;
                    &read
                }
                None => return Err(waiting_for_addresses()),
            },
        };
        self.seed_image(scope, placement, vmid, config, addresses)
            .await
    }

    /// Uploads `image` (when given) as the seed ISO on the node's ISO storage, and attaches it.
    async fn upload_and_attach(
        &self,
        scope: &mut Scope,
        proxmox: &ProxmoxClient,
        node: &str,
        vmid: u32,
        config: &VmConfig,
        image: Option<Vec<u8>>,
    ) -> Flow {
        let iso_name = crate::cloudinit::seed_iso_name(vmid);
        let storage = self
            .context
            .inventory
            .iso_storage(proxmox, node)
            .await
            .during(|| format!("listing the ISO storages of {node}"))?;
        let Some(storage) = storage else {
            return Err(waiting(
                "NoISOStorage",
                format!(
                    "node {node} has no storage with content type iso; enable iso content on one"
                ),
                Action::requeue(Duration::from_secs(60)),
            ));
        };
        let machine_key = claim_key(self.machine);
        if let Some(image) = image {
            let upload = proxmox.upload_iso(node, &storage, &iso_name, image).await;
            if let Err(stop) =
                self.submitted(scope, proxmox, upload, TaskKind::UploadSeedIso, || {
                    format!("uploading the seed ISO {iso_name} to {storage} on {node}")
                })
            {
                if matches!(stop, Stop::Wait(_)) {
                    // What the pass that attaches the seed ISO leaves is what its removal reads.
                    self.context
                        .vms
                        .written_configs
                        .remember(&machine_key, vmid, config.clone());
                }
                return Err(stop);
            }
        }
        let attach =
            ConfigUpdate::default().set("ide0", format!("{storage}:iso/{iso_name},media=cdrom"));
        let attached = proxmox
            .update_vm_config_sync(node, vmid, &attach)
            .await
            .during(|| format!("attaching the seed ISO {iso_name} to VM {vmid}"));
        if attached.is_err() {
            // Perhaps attached all the same (a lost answer): what this process wrote no longer
            // tells what the VM has.
            self.context.vms.written_configs.forget(&machine_key, vmid);
            self.context
                .vms
                .seed_isos_uploaded
                .attachment_failed(&machine_key, vmid);
        }
        attached?;
        self.context
            .vms
            .seed_isos_uploaded
            .attached(&machine_key, vmid);
        self.context
            .vms
            .written_configs
            .written(&machine_key, vmid, &attach);
        scope.status.bootstrap_data_provided = Some(true);
        if let Some(secret) = bootstrap_secret(scope) {
            // The machine has what it needs of it; a new seed ISO reads it again.
            self.context
                .bootstrap_secrets
                .forget(&scope.namespace, secret);
        }
        self.event(
            scope,
            EventType::Normal,
            "BootstrapDataProvided",
            &format!("attached {storage}:iso/{iso_name} to VM {vmid}"),
        )
        .await;
        Ok(())
    }

    /// The seed ISO for the machine's VM (bootstrap data, meta data and network config), or
    /// why it cannot be built yet.
    pub(super) async fn seed_image(
        &self,
        scope: &Scope,
        placement: &Placement,
        vmid: u32,
        config: &VmConfig,
        addresses: &Addresses,
    ) -> Flow<Vec<u8>> {
        let secret_name = bootstrap_secret(scope).unwrap_or_default();
        let Some(data) = self.bootstrap_data(scope, secret_name).await? else {
            return Err(waiting(
                "WaitingForBootstrapData",
                format!("bootstrap Secret {secret_name} not found"),
                Action::requeue(Duration::from_secs(10)),
            ));
        };
        let value = data.get("value").map(|v| v.0.clone()).unwrap_or_default();
        let format = data
            .get("format")
            .and_then(|v| String::from_utf8(v.0.clone()).ok())
            .unwrap_or_else(|| "cloud-config".into());
        let Some(uuid) = smbios_uuid(config) else {
            let retry =
                self.context
                    .retries
                    .failed(&failures::key(self.machine), &VM_CONFIG_BACKOFF, None);
            return Err(waiting_longer(
                "WaitingForVMConfig",
                format!("VM {vmid} has no SMBIOS UUID yet"),
                &retry,
            ));
        };
        let bootstrap = match crate::cloudinit::BootstrapFormat::parse(Some(&format)) {
            Ok(format) => crate::cloudinit::BootstrapData { value, format },
            Err(error) => {
                return Err(waiting(
                    "BootstrapDataInvalid",
                    error.to_string(),
                    Action::requeue(Duration::from_secs(60)),
                ));
            }
        };
        let meta = crate::cloudinit::MetaData {
            instance_id: uuid.clone(),
            hostname: scope.name.clone(),
            provider_id: self
                .machine
                .spec
                .metadata_settings
                .as_ref()
                .is_some_and(|m| m.provider_id_injection)
                .then(|| crate::cloudinit::provider_id(&uuid)),
            kubernetes_version: None,
        };
        let assigned = self
            .nic_addresses(scope, placement, config, addresses)
            .await;
        match crate::cloudinit::render_nocloud(placement, &meta, &assigned, &bootstrap) {
            Ok(files) => Ok(crate::cloudinit::build_nocloud_iso(&files)),
            Err(error) => Err(waiting(
                "BootstrapDataInvalid",
                error.to_string(),
                Action::requeue(Duration::from_secs(60)),
            )),
        }
    }

    /// Each NIC's MAC and bound addresses, for the seed ISO's network config.
    async fn nic_addresses(
        &self,
        scope: &Scope,
        placement: &Placement,
        config: &VmConfig,
        addresses: &Addresses,
    ) -> Vec<crate::cloudinit::NicAddresses> {
        let macs: BTreeMap<String, String> = placement
            .network_devices()
            .iter()
            .filter_map(|nic| {
                Some((
                    nic.name.clone(),
                    crate::cloudinit::mac_from_net_config(&config.get(&nic.name)?)?,
                ))
            })
            .collect();
        // Each pool's route metric, read once (only the seed ISO needs it).
        let mut metrics: BTreeMap<String, Option<u32>> = BTreeMap::new();
        let pool_key = |pool: &placement::PoolRef| format!("{}/{}", pool.kind, pool.name);
        for bound in &addresses.bound {
            if let std::collections::btree_map::Entry::Vacant(entry) =
                metrics.entry(pool_key(&bound.pool))
            {
                entry.insert(pool_metric(self.reads(), &scope.namespace, &bound.pool).await);
            }
        }
        placement
            .network_devices()
            .iter()
            .map(|nic| crate::cloudinit::NicAddresses {
                nic: nic.name.clone(),
                mac: macs.get(&nic.name).cloned().unwrap_or_default(),
                addresses: addresses
                    .bound
                    .iter()
                    .filter(|b| b.nic == nic.name)
                    .filter_map(|b| {
                        Some(crate::cloudinit::AssignedAddress {
                            address: b.address.parse().ok()?,
                            prefix: u8::try_from(b.prefix).ok()?,
                            gateway: b.gateway.as_deref().and_then(|g| g.parse().ok()),
                            default_route: b.default_gateway,
                            metric: metrics.get(&pool_key(&b.pool)).copied().flatten(),
                        })
                    })
                    .collect(),
            })
            .collect()
    }

    /// Deletes the cloud-init ISO (it holds the bootstrap token) once the guest read it, and
    /// only then detaches it: a failed deletion leaves it attached, so the next pass finds it
    /// and tries again. `Some`: the deletion task runs.
    pub(super) async fn remove_iso(
        &self,
        scope: &mut Scope,
        proxmox: &ProxmoxClient,
        node: &str,
        vmid: u32,
        config: &VmConfig,
    ) -> Flow {
        let Some(ide0) = config.get("ide0") else {
            return Ok(());
        };
        let iso_name = crate::cloudinit::seed_iso_name(vmid);
        let Some(volume) = ide0
            .split(',')
            .next()
            .filter(|v| v.contains(&iso_name))
            .map(str::to_owned)
        else {
            return Ok(());
        };
        // The deletion this pass saw succeed: only the detachment is left.
        if !seed_iso_deleted(scope, node) {
            self.delete_seed_iso(scope, proxmox, node, vmid, Some(volume))
                .await?;
        }
        detach_seed_iso(proxmox, node, vmid).await?;
        Ok(())
    }
}

/// The VMs (by machine and VMID) whose seed ISO this process saw removed, so later passes of a
/// provisioned machine need not read its config to look for it. A restarted process looks once
/// per machine.
#[derive(Clone, Default)]
pub struct SeedIsosRemoved(Arc<std::sync::Mutex<std::collections::HashSet<(String, u32)>>>);

impl SeedIsosRemoved {
    /// Most VMs remembered; past it, the memory starts over (each machine looks once more).
    const MAX: usize = 100_000;

    pub(super) fn contains(&self, machine: &str, vmid: u32) -> bool {
        self.lock().contains(&(machine.to_owned(), vmid))
    }

    pub(super) fn insert(&self, machine: &str, vmid: u32) {
        let mut removed = self.lock();
        if removed.len() >= Self::MAX {
            removed.clear();
        }
        removed.insert((machine.to_owned(), vmid));
    }

    pub(super) fn lock(
        &self,
    ) -> std::sync::MutexGuard<'_, std::collections::HashSet<(String, u32)>> {
        // Every update is a single insert or clear: a poisoned lock holds a usable set.
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// The seed ISOs (by machine and VMID, with their node) this process saw uploaded and not yet
/// attached, with the attachments that failed since, so a failed attachment is tried again
/// without uploading again. After a restart, or after [`SeedIsosUploaded::ATTACH_TRIES`]
/// failed attachments (the ISO may be gone), the seed ISO is uploaded again.
#[derive(Clone, Default)]
pub struct SeedIsosUploaded(Arc<std::sync::Mutex<UploadsByVm>>);

/// By machine and VMID: the node the seed ISO went to, and the attachments failed since.
type UploadsByVm = HashMap<(String, u32), (String, u32)>;

impl SeedIsosUploaded {
    /// Failed attachments before the upload is made again.
    const ATTACH_TRIES: u32 = 3;
    /// Most uploads remembered; past it, the memory starts over (each uploads once more).
    const MAX: usize = 10_000;

    pub(super) fn uploaded(&self, machine: &str, vmid: u32, node: &str) {
        let mut uploaded = self.lock();
        if uploaded.len() >= Self::MAX {
            uploaded.clear();
        }
        uploaded.insert((machine.to_owned(), vmid), (node.to_owned(), 0));
    }

    /// Whether the machine's seed ISO is on `node`, waiting to be attached.
    pub(super) fn awaits_attachment(&self, machine: &str, vmid: u32, node: &str) -> bool {
        self.lock()
            .get(&(machine.to_owned(), vmid))
            .is_some_and(|(on, _)| on == node)
    }

    pub(super) fn attachment_failed(&self, machine: &str, vmid: u32) {
        let mut uploaded = self.lock();
        let key = (machine.to_owned(), vmid);
        if let Some((_, failed)) = uploaded.get_mut(&key) {
            *failed += 1;
            if *failed >= Self::ATTACH_TRIES {
                uploaded.remove(&key);
            }
        }
    }

    pub(super) fn attached(&self, machine: &str, vmid: u32) {
        self.lock().remove(&(machine.to_owned(), vmid));
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, UploadsByVm> {
        // Every update is a single insert, change, removal or clear: a poisoned lock holds a
        // usable map.
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// The configs of VMs (by machine and VMID) as this process last left them, from the pass
/// that configured them until their seed ISO is removed: the passes after the disk resize
/// and before the seed ISO's removal need not read them again. A restarted process reads once.
#[derive(Clone, Default)]
pub struct WrittenConfigs(Arc<std::sync::Mutex<BTreeMap<(String, u32), VmConfig>>>);

impl WrittenConfigs {
    /// Most VMs remembered; past it, the memory starts over (each machine reads once more).
    const MAX: usize = 10_000;

    /// Remembers `config` as what the VM has after this process's writes.
    pub(super) fn remember(&self, machine: &str, vmid: u32, config: VmConfig) {
        let mut configs = self.lock();
        if configs.len() >= Self::MAX {
            configs.clear();
        }
        configs.insert((machine.to_owned(), vmid), config);
    }

    /// The VM's config as this process last left it, if it remembers.
    pub(super) fn get(&self, machine: &str, vmid: u32) -> Option<VmConfig> {
        self.lock().get(&(machine.to_owned(), vmid)).cloned()
    }

    /// Applies a write whose values Proxmox takes as sent to a remembered config.
    pub(super) fn written(&self, machine: &str, vmid: u32, update: &ConfigUpdate) {
        if let Some(config) = self.lock().get_mut(&(machine.to_owned(), vmid)) {
            *config = config.updated(update);
        }
    }

    pub(super) fn forget(&self, machine: &str, vmid: u32) {
        self.lock().remove(&(machine.to_owned(), vmid));
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<(String, u32), VmConfig>> {
        // Every update is a single insert, change or removal: a poisoned lock holds a usable map.
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// The bootstrap data Secret the CAPI Machine names.
pub(super) fn bootstrap_secret(scope: &Scope) -> Option<&str> {
    scope
        .capi_machine
        .spec
        .bootstrap
        .as_ref()
        .and_then(|b| b.data_secret_name.as_deref())
}

/// Whether `config` (of VM `vmid`) has the VM's seed ISO attached.
pub(super) fn seed_iso_attached(config: &VmConfig, vmid: u32) -> bool {
    let iso_name = crate::cloudinit::seed_iso_name(vmid);
    config.get("ide0").is_some_and(|v| v.contains(&iso_name))
}

/// Whether this pass saw the seed ISO's upload to `node` end.
pub(super) fn seed_iso_uploaded(scope: &Scope, node: &str) -> bool {
    scope
        .finished_as(TaskKind::UploadSeedIso)
        .is_some_and(|task| task.node == node)
}

/// Whether this pass saw the seed ISO's deletion on `node` end.
pub(super) fn seed_iso_deleted(scope: &Scope, node: &str) -> bool {
    scope
        .finished_as(TaskKind::DeleteSeedIso)
        .is_some_and(|task| task.node == node)
}

/// Takes the seed ISO's drive off the VM (Proxmox ignores the removal of a drive it does not
/// have).
pub(super) async fn detach_seed_iso(
    proxmox: &ProxmoxClient,
    node: &str,
    vmid: u32,
) -> Result<(), MachineError> {
    proxmox
        .update_vm_config_sync(node, vmid, &ConfigUpdate::default().delete("ide0"))
        .await
        .during(|| format!("detaching the seed ISO from VM {vmid}"))?;
    Ok(())
}

/// The SMBIOS UUID of a VM (`smbios1: uuid=...`): its instance ID and provider ID.
pub fn smbios_uuid(config: &VmConfig) -> Option<String> {
    crate::cloudinit::instance_id_from_smbios(&config.get("smbios1")?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_uploaded_seed_iso_is_attached_again_without_another_upload_a_few_times() {
        let uploads = SeedIsosUploaded::default();
        assert!(!uploads.awaits_attachment("m1", 101, "pve1"));
        uploads.uploaded("m1", 101, "pve1");
        assert!(uploads.awaits_attachment("m1", 101, "pve1"));
        assert!(
            !uploads.awaits_attachment("m1", 101, "pve2"),
            "another node"
        );
        assert!(
            !uploads.awaits_attachment("m2", 101, "pve1"),
            "another machine"
        );
        for _ in 1..SeedIsosUploaded::ATTACH_TRIES {
            uploads.attachment_failed("m1", 101);
            assert!(uploads.awaits_attachment("m1", 101, "pve1"));
        }
        uploads.attachment_failed("m1", 101);
        assert!(
            !uploads.awaits_attachment("m1", 101, "pve1"),
            "after repeated failures the ISO may be gone: uploaded again"
        );
        uploads.uploaded("m1", 101, "pve1");
        uploads.attached("m1", 101);
        assert!(!uploads.awaits_attachment("m1", 101, "pve1"));
    }
}
