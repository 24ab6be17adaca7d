//! Disks written into a VM's config as qemu-server handles them (`update_vm_api`,
//! `create_disks`, `vdisk_alloc`), so machines can be given data disks.
//!
//! * A disk slot (`scsi0`-`scsi30`, `virtio0`-`virtio15`, `sata0`-`sata5`, `ide0`-`ide3`)
//!   whose volume is `STORAGE:SIZE` (GiB, e.g. `scsi1: ceph:20,discard=on,ssd=1`) allocates
//!   a new volume: the config then holds `STORAGE:vm-<vmid>-disk-<n>` with the options given
//!   (sorted, as `print_drive` writes them) and `size=<SIZE>G`; `<n>` is the lowest number the
//!   VM has no volume with on that storage; `format=` is consumed (the volume's format).
//!   A slot naming an existing volume is an option change, as before.
//! * Checked before any task, as `check_storage_access` does: the storage exists (500
//!   `storage 'x' does not exist`) and holds VM images (400 on `storage`: `storage 'x' does
//!   not support vm images`); a slot without storage fails with `no storage ID specified (and
//!   no default storage)`. The drive schema refuses `ssd` on virtio, `iothread` on ide and
//!   sata, and unknown formats (400 on the slot).
//! * Checked by the allocation, so a `POST` answers its `qmconfig` task, which fails with
//!   the message, and a `PUT` fails with 500: `storage 'x' is not available on node 'n'`,
//!   `storage 'x' is not online` (made inactive), `unsupported format 'qcow2'` (a block
//!   storage other than RBD takes raw only), `not enough free space (<free> < <size>)` in
//!   bytes (volumes and `fill_storage` count as used), and a size of 0.
//! * `efidisk0: STORAGE:SIZE,efitype=4m,pre-enrolled-keys=0` and `tpmstate0:
//!   STORAGE:SIZE,version=v2.0` allocate too, through the same checks, but the size given is
//!   ignored as `create_efidisk` and the TPM state allocation do: the EFI vars volume is
//!   4 MiB for `efitype=4m` and 528 KiB otherwise (`2m`, the default), the TPM state 4 MiB
//!   and always raw (`ceph:vm-101-disk-1,efitype=4m,pre-enrolled-keys=0,size=4M`,
//!   `ceph:vm-101-disk-2,size=4M,version=v2.0`). The schema refuses an `efitype` other than
//!   `2m`/`4m`, a `version` other than `v1.2`/`v2.0`, a `pre-enrolled-keys` that is no
//!   boolean and options the format lacks (`format` on `tpmstate0`), 400 on the key.
//! * A disk replaced, or deleted without `force=1`, leaves its volume as the first free
//!   `unusedN` when the VM owns it (not CD-ROMs); deleting an `unusedN`, or a disk with
//!   `force=1`, frees the volume. Deleting the VM frees all its volumes.
//!
//! Simplifications (each says what real PVE does):
//! * the allocations of one write take all or none (PVE writes option by option: disks
//!   allocated before the failing one stay, as pending changes);
//! * volumes are named as the simulator names clones on every storage type (PVE names them
//!   `STORAGE:<vmid>/vm-<vmid>-disk-<n>.<fmt>` on file storages such as `dir`);
//! * space is the provisioned size on every storage (thin LVM, RBD and qcow2 files do not
//!   run out at allocation in PVE); only allocations check it, not clones or resizes;
//! * the config changes when the request is answered, not when the task ends (as for every
//!   option here), and an injected `qmconfig` failure does not undo them.

use std::collections::{BTreeMap, BTreeSet};

use super::{Cluster, Volume, format_size, is_disk_key, is_indexed};
use capmox::proxmox::types::parse_property_string;

/// Highest index of each bus a disk can sit on (qemu-server's `$MAX_*_DISKS` - 1).
const DISK_BUSES: [(&str, u32); 4] = [("ide", 3), ("sata", 5), ("scsi", 30), ("virtio", 15)];

/// The formats a drive's `format=` may name (qemu-server's drive schema).
const FORMATS: [&str; 6] = ["raw", "qcow", "qed", "qcow2", "vmdk", "cloop"];

/// Size of an EFI vars volume for `efitype=4m` (OVMF_VARS_4M.fd).
const EFI_VARS_4M: u64 = 4 << 20;

/// Size of an EFI vars volume for `efitype=2m`, the default (OVMF_VARS.fd: 540672 bytes).
const EFI_VARS_2M: u64 = 528 << 10;

/// Size of a TPM state volume (qemu-server's `TPMSTATE_DISK_SIZE`).
const TPMSTATE_SIZE: u64 = 4 << 20;

/// Most volumes one guest can have on a storage (pve-storage's `$MAX_VOLUMES_PER_GUEST`).
const MAX_VOLUMES_PER_GUEST: u32 = 1024;

/// Most `unusedN` entries a config can have (qemu-server's `MAX_UNUSED_DISKS`).
const MAX_UNUSED_DISKS: u32 = 256;

/// A VM disk volume as the simulator holds it, for tests ([`Cluster::volumes_of`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VolumeInfo {
    /// Storage id.
    pub storage: String,
    /// Volume id (`ceph:vm-101-disk-1`).
    pub volid: String,
    /// Node of a volume on local storage, `None` on shared storage.
    pub node: Option<String>,
    /// Image format (`raw`, `qcow2`, `vmdk`).
    pub format: String,
    /// Size in bytes.
    pub size: u64,
}

/// A disk a config write asks to allocate (`scsi1: ceph:20,discard=on`).
#[derive(Debug)]
pub(super) struct NewDisk {
    key: String,
    storage: String,
    /// Asked size in bytes (GiB in the request, rounded up to KiB as PVE does).
    bytes: u64,
    /// `format=`, which the allocation consumes.
    format: Option<String>,
    /// The other options, kept in the value.
    options: BTreeMap<String, String>,
}

/// A disk allocated for a config write: the slot, the value to write and the new volume.
pub(super) type Allocated = (String, String, Volume);

/// The bus of `key` when it is a disk slot in range (`scsi0`-`scsi30`, ...), so out-of-range
/// slots are refused as the schema does.
pub(super) fn disk_bus(key: &str) -> Option<&'static str> {
    DISK_BUSES.iter().find_map(|(bus, max)| {
        let index = key.strip_prefix(bus)?;
        let canonical = index == "0" || !index.starts_with('0');
        let n: u32 = index
            .parse()
            .ok()
            .filter(|_| canonical && is_indexed(key, bus))?;
        (n <= *max).then_some(*bus)
    })
}

/// Whether `key` is a disk a config write can allocate: a bus slot, `efidisk0` or `tpmstate0`.
fn allocatable(key: &str) -> bool {
    disk_bus(key).is_some() || key == "efidisk0" || key == "tpmstate0"
}

/// Enumeration error as the schema words it (`efidisk0.efitype: value '8m' does not ...`).
fn enum_error(key: &str, option: &str, value: &str, allowed: &[&str]) -> String {
    format!(
        "invalid format - format error\n{key}.{option}: value '{value}' does not have a value in the enumeration '{}'",
        allowed.join(", ")
    )
}

/// What the `efidisk0`/`tpmstate0` formats say against `value`: an unknown option, an
/// `efitype`, `version` or format outside its enumeration, a `pre-enrolled-keys` no boolean.
fn special_drive_error(key: &str, value: &str) -> Option<String> {
    let props = parse_property_string(value, "file");
    let (known, enums): (&[&str], &[(&str, &[&str])]) = match key {
        "efidisk0" => (
            &[
                "file",
                "efitype",
                "pre-enrolled-keys",
                "format",
                "size",
                "import-from",
                "ms-cert",
            ],
            &[("efitype", &["2m", "4m"]), ("format", &FORMATS)],
        ),
        "tpmstate0" => (
            &["file", "version", "size", "import-from"],
            &[("version", &["v1.2", "v2.0"])],
        ),
        _ => return None,
    };
    if let Some(option) = props.keys().find(|k| !known.contains(&k.as_str())) {
        return Some(format!(
            "invalid format - invalid key in comma-separated list property: {option}"
        ));
    }
    for (option, allowed) in enums {
        if let Some(v) = props.get(*option)
            && !allowed.contains(&v.as_str())
        {
            return Some(enum_error(key, option, v, allowed));
        }
    }
    let booleans = ["0", "1", "on", "off", "yes", "no", "true", "false"];
    props
        .get("pre-enrolled-keys")
        .filter(|v| !booleans.contains(&v.to_ascii_lowercase().as_str()))
        .map(|v| {
            format!(
                "invalid format - format error\n{key}.pre-enrolled-keys: type check ('boolean') failed - got '{v}'"
            )
        })
}

/// What the drive schema says against `value` in slot `key` (an option its bus lacks, an
/// unknown format; the `efidisk0`/`tpmstate0` formats), so a client's wrong option fails
/// as on PVE.
pub(super) fn drive_format_error(key: &str, value: &str) -> Option<String> {
    if key == "efidisk0" || key == "tpmstate0" {
        return special_drive_error(key, value);
    }
    let bus = disk_bus(key)?;
    let props = parse_property_string(value, "file");
    let lacking: &[&str] = match bus {
        "virtio" => &["ssd"],
        "ide" | "sata" => &["iothread"],
        _ => &[],
    };
    if let Some(option) = lacking.iter().find(|o| props.contains_key(**o)) {
        return Some(format!(
            "invalid format - invalid key in comma-separated list property: {option}"
        ));
    }
    let format = props.get("format")?;
    (!FORMATS.contains(&format.as_str())).then(|| enum_error(key, "format", format, &FORMATS))
}

/// `(storage, GiB)` when `file` is PVE's allocation syntax `[STORAGE:]SIZE`
/// (`$NEW_DISK_RE`: `^(([^/:\s]+):)?(\d+(\.\d+)?)$`).
fn new_disk_syntax(file: &str) -> Option<(Option<&str>, f64)> {
    let (storage, size) = match file.split_once(':') {
        Some((storage, size)) => (Some(storage), size),
        None => (None, file),
    };
    let bad_storage = |s: &str| s.is_empty() || s.contains('/') || s.contains(char::is_whitespace);
    if storage.is_some_and(bad_storage) {
        return None;
    }
    let (whole, fraction) = size.split_once('.').unwrap_or((size, "0"));
    let digits = |t: &str| !t.is_empty() && t.chars().all(|c| c.is_ascii_digit());
    if !digits(whole) || !digits(fraction) {
        return None;
    }
    Some((storage, size.parse().ok()?))
}

/// Bytes of `gib` GiB, rounded up to whole KiB as `convert_size` does for `vdisk_alloc`.
fn gib_to_bytes(gib: f64) -> u64 {
    // a GiB count from digits: finite and not negative, so the cast only rounds
    ((gib * f64::from(1u32 << 20)).ceil() as u64).saturating_mul(1024)
}

/// The format a new volume gets on a storage of plugin `kind`, or why it cannot: file
/// storages take raw, qcow2 or vmdk; RBD ignores the ask (raw); other block storages take raw.
fn volume_format(kind: &str, asked: Option<&str>) -> Result<String, String> {
    let asked = asked.unwrap_or("raw");
    let file_storage = ["dir", "nfs", "cifs", "glusterfs"].contains(&kind);
    if kind == "rbd" || asked == "raw" {
        Ok("raw".to_owned())
    } else if file_storage && ["qcow2", "vmdk"].contains(&asked) {
        Ok(asked.to_owned())
    } else {
        Err(format!("unsupported format '{asked}'"))
    }
}

/// `n` of a volume named `...(vm|base)-<vmid>-disk-<n>...` (pve-storage's
/// `$get_vm_disk_number`), linked clones' `base-X-disk-0/vm-<vmid>-disk-<n>` included.
fn disk_number(volid: &str, vmid: u32) -> Option<u32> {
    let name = volid.rsplit(['/', ':']).next()?;
    let rest = name
        .strip_prefix(&format!("vm-{vmid}-disk-"))
        .or_else(|| name.strip_prefix(&format!("base-{vmid}-disk-")))?;
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

/// The volume id of a disk value (its `file`), unless it is a CD-ROM.
fn disk_volume(value: &str) -> Option<String> {
    let mut props = parse_property_string(value, "file");
    if props.get("media").is_some_and(|m| m == "cdrom") {
        return None;
    }
    props.remove("file")
}

impl Cluster {
    /// The disks `params` asks to allocate, checked as PVE does before it forks the task:
    /// each names a storage that exists and holds VM images.
    pub(super) fn new_disks(
        &self,
        params: &BTreeMap<String, String>,
    ) -> super::SimResult<Vec<NewDisk>> {
        let mut out = Vec::new();
        for (key, value) in params.iter().filter(|(k, _)| allocatable(k)) {
            let mut options = parse_property_string(value, "file");
            let Some(file) = options.remove("file") else {
                continue;
            };
            let cdrom = options.get("media").is_some_and(|m| m == "cdrom");
            let Some((storage, gib)) = new_disk_syntax(&file).filter(|_| !cdrom) else {
                continue;
            };
            let storage = storage.ok_or_else(|| {
                super::SimError::e500("no storage ID specified (and no default storage)")
            })?;
            let spec = self.storages.get(storage).ok_or_else(|| {
                super::SimError::e500(format!("storage '{storage}' does not exist"))
            })?;
            if !spec.content.iter().any(|c| c == "images") {
                return Err(super::SimError::param(
                    "storage",
                    format!("storage '{storage}' does not support vm images"),
                ));
            }
            let format = options.remove("format");
            options.remove("size");
            let bytes = match key.as_str() {
                "efidisk0" if options.get("efitype").is_some_and(|t| t == "4m") => EFI_VARS_4M,
                "efidisk0" => EFI_VARS_2M,
                "tpmstate0" => TPMSTATE_SIZE,
                _ => gib_to_bytes(gib),
            };
            out.push(NewDisk {
                key: key.clone(),
                storage: storage.to_owned(),
                bytes,
                format,
                options,
            });
        }
        Ok(out)
    }

    /// Allocates `disks` for VM `vmid` on `node` as `vdisk_alloc` would, all or none: each
    /// slot's value to write with its new volume, or why one failed. Changes nothing.
    pub(super) fn allocate(
        &self,
        node: &str,
        vmid: u32,
        disks: Vec<NewDisk>,
    ) -> Result<Vec<Allocated>, String> {
        let mut made: Vec<Allocated> = Vec::new();
        for disk in disks {
            let pending: Vec<&Volume> = made.iter().map(|(_, _, v)| v).collect();
            let volume = self.new_volume(node, vmid, &disk, &pending)?;
            let mut options = disk.options;
            options.insert("size".into(), format_size(disk.bytes));
            let rest: Vec<String> = options.iter().map(|(k, v)| format!("{k}={v}")).collect();
            let value = format!("{},{}", volume.volid, rest.join(","));
            made.push((disk.key, value, volume));
        }
        Ok(made)
    }

    /// The volume `disk` gets on `node` beside the `pending` ones of the same write, or why
    /// the storage refuses it (not on the node, offline, format, name, space).
    fn new_volume(
        &self,
        node: &str,
        vmid: u32,
        disk: &NewDisk,
        pending: &[&Volume],
    ) -> Result<Volume, String> {
        let storage = &disk.storage;
        let spec = self
            .storages
            .get(storage)
            .ok_or_else(|| format!("storage '{storage}' does not exist"))?;
        if !spec.nodes.is_empty() && !spec.nodes.iter().any(|n| n == node) {
            return Err(format!(
                "storage '{storage}' is not available on node '{node}'"
            ));
        }
        if !self.storage_active(storage, node) {
            return Err(format!("storage '{storage}' is not online"));
        }
        let format = volume_format(&spec.kind, disk.format.as_deref())?;
        if disk.bytes == 0 {
            return Err(format!(
                "unable to allocate a volume of size 0 on storage '{storage}'"
            ));
        }
        let number = self
            .free_disk_number(storage, node, vmid, pending)
            .ok_or_else(|| {
                format!("unable to allocate an image name for VM {vmid} in storage '{storage}'")
            })?;
        let pending_bytes: u64 = pending
            .iter()
            .filter(|v| v.storage == *storage)
            .map(|v| v.size)
            .sum();
        let used = self
            .storage_used(storage, node)
            .saturating_add(pending_bytes);
        let free = (spec.size_gib << 30).saturating_sub(used);
        if free < disk.bytes {
            return Err(format!("not enough free space ({free} < {})", disk.bytes));
        }
        Ok(Volume {
            storage: storage.clone(),
            node: (!spec.shared).then(|| node.to_owned()),
            volid: format!("{storage}:vm-{vmid}-disk-{number}"),
            content: "images".into(),
            size: disk.bytes,
            ctime: self.epoch,
            vmid: Some(vmid),
            data: None,
            format: Some(format),
        })
    }

    /// The lowest disk number VM `vmid` has no volume with on `storage` as `node` sees it,
    /// counting the `pending` ones (`find_free_diskname`).
    fn free_disk_number(
        &self,
        storage: &str,
        node: &str,
        vmid: u32,
        pending: &[&Volume],
    ) -> Option<u32> {
        let taken: BTreeSet<u32> = self
            .volumes
            .iter()
            .chain(pending.iter().copied())
            .filter(|v| v.storage == storage && v.node.as_deref().is_none_or(|n| n == node))
            .filter_map(|v| disk_number(&v.volid, vmid))
            .collect();
        (0..MAX_VOLUMES_PER_GUEST).find(|n| !taken.contains(n))
    }

    /// Writes the `allocated` disks into `config` and their volumes onto the storages; a
    /// disk `params` replaces leaves its own volume as `unusedN`. Returns task log lines.
    pub(super) fn write_disks(
        &mut self,
        vmid: u32,
        old: &BTreeMap<String, String>,
        config: &mut BTreeMap<String, String>,
        params: &BTreeMap<String, String>,
        allocated: Vec<Allocated>,
    ) -> Vec<String> {
        let mut log = Vec::new();
        for (key, value, volume) in allocated {
            log.push(format!("{key}: successfully created disk '{value}'"));
            config.insert(key, value);
            self.volumes.push(volume);
        }
        for key in params.keys().filter(|k| is_disk_key(k)) {
            let Some(previous) = old.get(key) else {
                continue;
            };
            let now = config.get(key).and_then(|v| disk_volume(v));
            if disk_volume(previous).is_some() && disk_volume(previous) != now {
                self.register_unused(vmid, config, previous);
            }
        }
        log
    }

    /// Removes the options `params` deletes from `config`: a disk's own volume becomes
    /// `unusedN` (or is freed with `force=1`), a deleted `unusedN` frees its volume
    /// (`vmconfig_delete_or_detach_drive`, `try_deallocate_drive`).
    pub(super) fn apply_deletes(
        &mut self,
        vmid: u32,
        config: &mut BTreeMap<String, String>,
        params: &BTreeMap<String, String>,
    ) {
        let Some(delete) = params.get("delete") else {
            return;
        };
        let force = params.get("force").is_some_and(|f| f == "1");
        for key in delete.split([',', ';', ' ']).filter(|s| !s.is_empty()) {
            let key = if key == "cdrom" { "ide2" } else { key };
            let Some(value) = config.remove(key) else {
                continue;
            };
            if is_indexed(key, "unused") || (force && is_disk_key(key)) {
                self.free_owned_volume(vmid, config, &value);
            } else if is_disk_key(key) {
                self.register_unused(vmid, config, &value);
            }
        }
    }

    /// Adds the volume of disk `value` to `config` as the first free `unusedN` when VM `vmid`
    /// owns it and it is not listed yet (`vmconfig_register_unused_drive`).
    fn register_unused(&self, vmid: u32, config: &mut BTreeMap<String, String>, value: &str) {
        let Some(volid) = disk_volume(value) else {
            return;
        };
        let owned = self
            .volumes
            .iter()
            .any(|v| v.volid == volid && v.vmid == Some(vmid));
        let listed = config
            .iter()
            .any(|(k, v)| is_indexed(k, "unused") && *v == volid);
        if !owned || listed {
            return;
        }
        if let Some(key) = (0..MAX_UNUSED_DISKS)
            .map(|i| format!("unused{i}"))
            .find(|k| !config.contains_key(k))
        {
            config.insert(key, volid);
        }
    }

    /// Frees the volume of disk `value` when VM `vmid` owns it and `config` no longer uses it.
    fn free_owned_volume(&mut self, vmid: u32, config: &BTreeMap<String, String>, value: &str) {
        let Some(volid) = disk_volume(value) else {
            return;
        };
        let in_use = config
            .iter()
            .filter(|(k, _)| is_disk_key(k) || is_indexed(k, "unused"))
            .any(|(_, v)| disk_volume(v).as_deref() == Some(volid.as_str()));
        if !in_use {
            self.volumes
                .retain(|v| !(v.volid == volid && v.vmid == Some(vmid) && v.content == "images"));
        }
    }

    /// The disk volumes VM `vmid` owns (boot disk, allocated disks, unused ones), by volume
    /// id, so tests can see what an allocation made and that deleting the VM frees it.
    pub fn volumes_of(&self, vmid: u32) -> Vec<VolumeInfo> {
        let mut out: Vec<VolumeInfo> = self
            .volumes
            .iter()
            .filter(|v| v.vmid == Some(vmid) && v.content == "images")
            .map(|v| VolumeInfo {
                storage: v.storage.clone(),
                volid: v.volid.clone(),
                node: v.node.clone(),
                format: v.format.clone().unwrap_or_else(|| "raw".to_owned()),
                size: v.size,
            })
            .collect();
        out.sort_by(|a, b| (&a.volid, &a.node).cmp(&(&b.volid, &b.node)));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::topology::{SimOptions, StorageSpec, Topology};
    use tokio::time::Instant;

    fn p(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn storage(name: &str, kind: &str, content: &[&str], nodes: &[&str]) -> StorageSpec {
        StorageSpec {
            name: name.into(),
            kind: kind.into(),
            shared: false,
            content: content.iter().map(|c| c.to_string()).collect(),
            nodes: nodes.iter().map(|n| n.to_string()).collect(),
            size_gib: 100,
        }
    }

    /// The example cluster plus a storage only pve2 has and one without VM images, with VM
    /// 100 linked-cloned from template 9000 (boot disk `local-lvm:base-9000-disk-0/
    /// vm-100-disk-0`) on pve1.
    fn with_vm() -> (Cluster, Instant) {
        let mut topology = Topology::example();
        topology
            .storages
            .push(storage("pve2-data", "lvmthin", &["images"], &["pve2"]));
        topology
            .storages
            .push(storage("isos", "dir", &["iso"], &[]));
        let mut c = Cluster::new(&topology, SimOptions::default(), Box::new(|_| false));
        let t0 = Instant::now();
        c.clone_vm(t0, "pve1", 9000, &p(&[("newid", "100")]))
            .expect("clone");
        let now = t0 + c.options().clone_duration;
        c.advance(now);
        (c, now)
    }

    fn config(c: &Cluster, key: &str) -> Option<String> {
        c.vms.get(&100)?.config.get(key).cloned()
    }

    /// Ends the task `upid` and returns its exit status.
    fn finish(c: &mut Cluster, now: Instant, upid: &str) -> String {
        c.advance(now + c.options().task_duration);
        let status = c.task_status("pve1", upid).expect("task");
        status["exitstatus"].as_str().expect("ended").to_owned()
    }

    #[tokio::test(start_paused = true)]
    async fn one_post_allocates_disks_on_shared_local_and_file_storages_in_one_task() {
        let (mut c, now) = with_vm();
        let (ceph0, lvm0) = (
            c.storage_used("ceph", "pve1"),
            c.storage_used("local-lvm", "pve1"),
        );
        let upid = c
            .update_config(
                now,
                "pve1",
                100,
                &p(&[
                    ("scsi1", "ceph:20,ssd=1,discard=on,iothread=1"),
                    ("virtio2", "local-lvm:8,format=raw"),
                    ("sata1", "local:1.5,format=qcow2,size=99G"),
                ]),
                true,
            )
            .expect("accepted")
            .expect("a task");
        assert_eq!(upid.task_type, "qmconfig");
        assert_eq!(finish(&mut c, now, upid.as_str()), "OK");
        assert_eq!(
            config(&c, "scsi1").as_deref(),
            Some("ceph:vm-100-disk-0,discard=on,iothread=1,size=20G,ssd=1")
        );
        assert_eq!(
            config(&c, "virtio2").as_deref(),
            Some("local-lvm:vm-100-disk-1,size=8G"),
            "the boot disk (a linked clone) is vm-100-disk-0 on local-lvm"
        );
        assert_eq!(
            config(&c, "sata1").as_deref(),
            Some("local:vm-100-disk-0,size=1536M")
        );
        let volumes: Vec<(String, Option<String>, String, u64)> = c
            .volumes_of(100)
            .into_iter()
            .map(|v| (v.volid, v.node, v.format, v.size))
            .collect();
        let pve1 = Some("pve1".to_owned());
        assert_eq!(
            volumes,
            [
                ("ceph:vm-100-disk-0".into(), None, "raw".into(), 20 << 30),
                (
                    "local-lvm:base-9000-disk-0/vm-100-disk-0".into(),
                    pve1.clone(),
                    "raw".into(),
                    10 << 30
                ),
                (
                    "local-lvm:vm-100-disk-1".into(),
                    pve1.clone(),
                    "raw".into(),
                    8 << 30
                ),
                (
                    "local:vm-100-disk-0".into(),
                    pve1,
                    "qcow2".into(),
                    1536 << 20
                ),
            ]
        );
        assert_eq!(c.storage_used("ceph", "pve2"), ceph0 + (20 << 30), "shared");
        assert_eq!(c.storage_used("local-lvm", "pve1"), lvm0 + (8 << 30));
        assert_eq!(c.storage_used("local-lvm", "pve2"), 0, "local to pve1");
        let log = c.task_log("pve1", upid.as_str(), 0, 10).expect("log").0;
        assert!(
            log.to_string().contains(
                "scsi1: successfully created disk 'ceph:vm-100-disk-0,discard=on,iothread=1,size=20G,ssd=1'"
            ),
            "{log}"
        );
        let listed = c
            .storage_content("pve1", "local", None, Some("100"))
            .expect("content");
        assert_eq!(listed[0]["volid"], "local:vm-100-disk-0");
        assert_eq!(listed[0]["format"], "qcow2");
        assert_eq!(listed[0]["size"], 1536_u64 << 20);
        // the boot disk stays the VM's maxdisk, though sata1 sorts before scsi0
        let resources = c.cluster_resources(now, Some("vm")).expect("resources");
        let vm = resources
            .as_array()
            .and_then(|a| a.iter().find(|r| r["vmid"] == 100))
            .expect("VM 100");
        assert_eq!(vm["maxdisk"], 10_u64 << 30);
    }

    #[tokio::test(start_paused = true)]
    async fn storages_that_cannot_take_the_disk_fail_like_pve() {
        let (mut c, now) = with_vm();
        let before = c.vms[&100].config.clone();
        let sync = |c: &mut Cluster, value: &str| {
            c.update_config(now, "pve1", 100, &p(&[("scsi1", value)]), true)
                .expect_err("refused before a task")
        };
        let e = sync(&mut c, "nope:5");
        assert_eq!(
            (e.status, e.reason.as_str()),
            (500, "storage 'nope' does not exist")
        );
        let e = sync(&mut c, "isos:5");
        assert_eq!(e.status, 400);
        assert_eq!(
            e.errors["storage"],
            "storage 'isos' does not support vm images"
        );
        let e = sync(&mut c, "5");
        assert_eq!(e.reason, "no storage ID specified (and no default storage)");
        c.set_storage_active("ceph", "pve1", false);
        c.fill_storage("local-lvm", "pve1", 99);
        let free = (1024_u64 << 30) - c.storage_used("local-lvm", "pve1");
        let no_space = format!("not enough free space ({free} < {})", 20_u64 << 30);
        for (value, error) in [
            (
                "pve2-data:5",
                "storage 'pve2-data' is not available on node 'pve1'",
            ),
            ("ceph:5", "storage 'ceph' is not online"),
            ("local-lvm:20", no_space.as_str()),
            (
                "local:0",
                "unable to allocate a volume of size 0 on storage 'local'",
            ),
            ("local-lvm:5,format=qcow2", "unsupported format 'qcow2'"),
        ] {
            let upid = c
                .update_config(now, "pve1", 100, &p(&[("scsi1", value)]), true)
                .expect("a task")
                .expect("POST");
            assert_eq!(finish(&mut c, now, upid.as_str()), error, "{value}");
            let e = c
                .update_config(now, "pve1", 100, &p(&[("scsi1", value)]), false)
                .expect_err("PUT fails");
            assert_eq!((e.status, e.reason.as_str()), (500, error), "{value}");
        }
        // all or nothing: a disk that fits is not allocated beside one that does not
        let upid = c
            .update_config(
                now,
                "pve1",
                100,
                &p(&[
                    ("scsi1", "local:5"),
                    ("scsi2", "local-lvm:20"),
                    ("cores", "8"),
                ]),
                true,
            )
            .expect("a task")
            .expect("POST");
        assert!(finish(&mut c, now, upid.as_str()).starts_with("not enough free space"));
        assert_eq!(c.vms[&100].config, before, "config unchanged");
        assert_eq!(c.volumes_of(100).len(), 1, "only the boot disk");
    }

    #[tokio::test(start_paused = true)]
    async fn the_drive_schema_refuses_slots_and_options_the_bus_lacks() {
        let (mut c, now) = with_vm();
        for (key, value, error) in [
            ("scsi31", "ceph:1", "property is not defined in schema"),
            (
                "virtio1",
                "ceph:1,ssd=1",
                "invalid key in comma-separated list property: ssd",
            ),
            (
                "sata1",
                "ceph:1,iothread=1",
                "invalid key in comma-separated list property: iothread",
            ),
            (
                "scsi1",
                "ceph:1,format=zip",
                "scsi1.format: value 'zip' does not have a value",
            ),
        ] {
            let e = c
                .update_config(now, "pve1", 100, &p(&[(key, value)]), true)
                .expect_err(key);
            assert_eq!(e.status, 400, "{key}");
            assert!(e.errors[key].contains(error), "{key}: {:?}", e.errors);
        }
        assert_eq!(c.volumes_of(100).len(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn allocated_disks_resize_change_options_go_unused_and_leave_with_the_vm() {
        let (mut c, now) = with_vm();
        let ceph_before = c.storage_used("ceph", "pve1");
        c.update_config(
            now,
            "pve1",
            100,
            &p(&[("scsi1", "ceph:20,discard=on")]),
            false,
        )
        .expect("PUT allocates");
        let used = c.storage_used("ceph", "pve1");
        let upid = c
            .resize(now, "pve1", 100, &p(&[("disk", "scsi1"), ("size", "+5G")]))
            .expect("resize");
        assert_eq!(finish(&mut c, now, upid.as_str()), "OK");
        assert_eq!(
            config(&c, "scsi1").as_deref(),
            Some("ceph:vm-100-disk-0,discard=on,size=25G")
        );
        assert_eq!(c.storage_used("ceph", "pve1"), used + (5 << 30));
        // naming the existing volume changes options only
        c.update_config(
            now,
            "pve1",
            100,
            &p(&[("scsi1", "ceph:vm-100-disk-0,size=25G,ssd=1")]),
            false,
        )
        .expect("option change");
        assert_eq!(c.volumes_of(100).len(), 2);
        // a new disk in the slot leaves the old volume unused; the next takes number 1
        c.update_config(now, "pve1", 100, &p(&[("scsi1", "ceph:2")]), false)
            .expect("replace");
        assert_eq!(
            config(&c, "scsi1").as_deref(),
            Some("ceph:vm-100-disk-1,size=2G")
        );
        assert_eq!(config(&c, "unused0").as_deref(), Some("ceph:vm-100-disk-0"));
        // deleting a disk keeps its volume as unused, deleting the unused entry frees it
        c.update_config(now, "pve1", 100, &p(&[("delete", "scsi1")]), false)
            .expect("detach");
        assert_eq!(config(&c, "unused1").as_deref(), Some("ceph:vm-100-disk-1"));
        c.update_config(now, "pve1", 100, &p(&[("delete", "unused0")]), false)
            .expect("free");
        let volids: Vec<String> = c.volumes_of(100).into_iter().map(|v| v.volid).collect();
        assert_eq!(
            volids,
            [
                "ceph:vm-100-disk-1",
                "local-lvm:base-9000-disk-0/vm-100-disk-0"
            ]
        );
        c.update_config(now, "pve1", 100, &p(&[("virtio3", "ceph:1")]), false)
            .expect("reuses the freed number");
        assert_eq!(
            config(&c, "virtio3").as_deref(),
            Some("ceph:vm-100-disk-0,size=1G")
        );
        c.update_config(
            now,
            "pve1",
            100,
            &p(&[("delete", "virtio3"), ("force", "1")]),
            false,
        )
        .expect("force frees");
        assert!(config(&c, "unused0").is_none());
        let upid = c.delete_vm(now, "pve1", 100, false).expect("destroy");
        assert_eq!(finish(&mut c, now, upid.as_str()), "OK");
        assert_eq!(c.volumes_of(100), []);
        assert_eq!(c.storage_used("ceph", "pve1"), ceph_before, "space freed");
    }

    #[tokio::test(start_paused = true)]
    async fn efi_and_tpm_state_disks_are_allocated_at_their_fixed_sizes_in_one_task() {
        let (mut c, now) = with_vm();
        let ceph_before = c.storage_used("ceph", "pve1");
        let upid = c
            .update_config(
                now,
                "pve1",
                100,
                &p(&[
                    ("efidisk0", "ceph:1,efitype=4m,pre-enrolled-keys=0"),
                    ("tpmstate0", "ceph:1,version=v2.0"),
                    ("bios", "ovmf"),
                    ("cpu", "host,flags=+aes;-pcid"),
                    ("numa", "1"),
                ]),
                true,
            )
            .expect("accepted")
            .expect("a task");
        assert_eq!(upid.task_type, "qmconfig");
        assert_eq!(finish(&mut c, now, upid.as_str()), "OK");
        let tasks = c.tasks.values().filter(|t| t.kind == "qmconfig").count();
        assert_eq!(tasks, 1, "one task for the whole write");
        assert_eq!(
            config(&c, "efidisk0").as_deref(),
            Some("ceph:vm-100-disk-0,efitype=4m,pre-enrolled-keys=0,size=4M")
        );
        assert_eq!(
            config(&c, "tpmstate0").as_deref(),
            Some("ceph:vm-100-disk-1,size=4M,version=v2.0")
        );
        assert_eq!(config(&c, "bios").as_deref(), Some("ovmf"));
        assert_eq!(config(&c, "cpu").as_deref(), Some("host,flags=+aes;-pcid"));
        assert_eq!(config(&c, "numa").as_deref(), Some("1"));
        let ceph: Vec<(String, u64)> = c
            .volumes_of(100)
            .into_iter()
            .filter(|v| v.storage == "ceph")
            .map(|v| (v.volid, v.size))
            .collect();
        assert_eq!(
            ceph,
            [
                ("ceph:vm-100-disk-0".to_owned(), 4 << 20),
                ("ceph:vm-100-disk-1".to_owned(), 4 << 20),
            ]
        );
        assert_eq!(c.storage_used("ceph", "pve1"), ceph_before + (8 << 20));
        // the 2m default is 528 KiB; a PUT allocates too, after a separate plain write
        c.update_config(now, "pve1", 100, &p(&[("bios", "seabios")]), false)
            .expect("PUT");
        assert_eq!(config(&c, "bios").as_deref(), Some("seabios"));
        c.update_config(now, "pve1", 100, &p(&[("efidisk0", "local-lvm:0")]), false)
            .expect("replace");
        assert_eq!(
            config(&c, "efidisk0").as_deref(),
            Some("local-lvm:vm-100-disk-1,size=528K")
        );
        assert_eq!(config(&c, "unused0").as_deref(), Some("ceph:vm-100-disk-0"));
        // the storage checks of disks apply
        let e = c
            .update_config(now, "pve1", 100, &p(&[("tpmstate0", "nope:1")]), false)
            .expect_err("no storage");
        assert_eq!(e.reason, "storage 'nope' does not exist");
        let e = c
            .update_config(now, "pve1", 100, &p(&[("tpmstate0", "pve2-data:1")]), false)
            .expect_err("other node");
        assert_eq!(
            e.reason,
            "storage 'pve2-data' is not available on node 'pve1'"
        );
        let upid = c.delete_vm(now, "pve1", 100, false).expect("destroy");
        assert_eq!(finish(&mut c, now, upid.as_str()), "OK");
        assert_eq!(c.volumes_of(100), []);
        assert_eq!(c.storage_used("ceph", "pve1"), ceph_before, "space freed");
    }

    #[tokio::test(start_paused = true)]
    async fn the_efidisk_and_tpmstate_formats_refuse_bad_values() {
        let (mut c, now) = with_vm();
        for (key, value, error) in [
            (
                "efidisk0",
                "ceph:1,efitype=8m",
                "invalid format - format error\nefidisk0.efitype: value '8m' does not have a value in the enumeration '2m, 4m'",
            ),
            (
                "efidisk0",
                "ceph:1,pre-enrolled-keys=2",
                "invalid format - format error\nefidisk0.pre-enrolled-keys: type check ('boolean') failed - got '2'",
            ),
            (
                "tpmstate0",
                "ceph:1,version=v3.0",
                "invalid format - format error\ntpmstate0.version: value 'v3.0' does not have a value in the enumeration 'v1.2, v2.0'",
            ),
            (
                "tpmstate0",
                "ceph:1,format=qcow2",
                "invalid format - invalid key in comma-separated list property: format",
            ),
            (
                "efidisk1",
                "ceph:1",
                "property is not defined in schema and the schema does not allow additional properties",
            ),
        ] {
            let e = c
                .update_config(now, "pve1", 100, &p(&[(key, value)]), true)
                .expect_err(value);
            assert_eq!(e.status, 400, "{value}");
            assert_eq!(e.errors[key], error, "{value}");
        }
        assert_eq!(c.volumes_of(100).len(), 1, "only the boot disk");
    }

    #[test]
    fn allocation_syntax_and_disk_numbers_follow_pve() {
        assert_eq!(new_disk_syntax("ceph:20"), Some((Some("ceph"), 20.0)));
        assert_eq!(new_disk_syntax("8"), Some((None, 8.0)));
        assert_eq!(new_disk_syntax("local:0.5"), Some((Some("local"), 0.5)));
        for not_new in [
            "ceph:vm-100-disk-0",
            "ceph:20G",
            "ceph:-1",
            "ceph:1.",
            "a/b:1",
            ":1",
        ] {
            assert_eq!(new_disk_syntax(not_new), None, "{not_new}");
        }
        assert_eq!(gib_to_bytes(0.5), 512 << 20);
        assert_eq!(disk_number("local-lvm:vm-100-disk-3", 100), Some(3));
        assert_eq!(disk_number("local:100/vm-100-disk-2.qcow2", 100), Some(2));
        assert_eq!(
            disk_number("ceph:base-9000-disk-0/vm-100-disk-1", 100),
            Some(1)
        );
        assert_eq!(disk_number("ceph:vm-1000-disk-1", 100), None);
        assert_eq!(disk_bus("scsi30"), Some("scsi"));
        assert_eq!(disk_bus("virtio16"), None);
        assert_eq!(disk_bus("scsi01"), None);
        assert_eq!(disk_bus("scsihw"), None);
    }
}
