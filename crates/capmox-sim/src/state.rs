//! In-memory cluster state with Proxmox semantics: VMID uniqueness, clone locks and
//! tasks, config digests, resize rules, power tasks (reboot and reset in `restart`), guest
//! agent after boot; HA (and HA migration) in `ha`; disks written into configs (new
//! volumes from `STORAGE:SIZE`, unused volumes) in `disks`; PCI passthrough (mappings,
//! `hostpciN`, devices held by running VMs) in `pci`; DHCP leases for guests in `dhcp`.
//! Time is passed in (`tokio::time::Instant`), tasks finish lazily when observed.

mod dhcp;
mod disks;
pub mod ha;
mod pci;
mod restart;

pub use dhcp::DhcpLease;
pub use disks::VolumeInfo;
pub use restart::{DEFAULT_SHUTDOWN_TIMEOUT, POWERDOWN_TIMEOUT};

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use serde_json::{Value, json};
use tokio::time::{Duration, Instant};

use super::guest::GuestOs;
use super::iso::IsoImage;
use super::profile::{RequestTiming, StorageLockHold, TaskModel, storage_lock_name};
use super::topology::{
    DhcpSpec, GuestSpec, PciDeviceSpec, PciMappingSpec, SimOptions, StorageSpec, Topology,
};
use capmox::proxmox::de::split_tags;
use capmox::proxmox::types::{NetDevice, parse_property_string};
use capmox::proxmox::upid::Upid;

/// Simulators made by this process so far, for their distinct UPIDs.
static SIMULATORS: AtomicU64 = AtomicU64::new(0);

/// An API error as Proxmox would send it: status, reason phrase, optional `errors` map.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimError {
    /// HTTP status.
    pub status: u16,
    /// Reason phrase (first line of the message).
    pub reason: String,
    /// Parameter errors (400).
    pub errors: BTreeMap<String, String>,
}

impl SimError {
    /// A 500 with the given text.
    pub fn e500(reason: impl Into<String>) -> Self {
        Self {
            status: 500,
            reason: reason.into(),
            errors: BTreeMap::new(),
        }
    }

    /// A 400 parameter error on one field.
    pub fn param(field: &str, text: impl Into<String>) -> Self {
        let mut errors = BTreeMap::new();
        errors.insert(field.to_string(), text.into());
        Self {
            status: 400,
            reason: "Parameter verification failed.".to_string(),
            errors,
        }
    }

    fn missing_vm(node: &str, vmid: u32) -> Self {
        Self::e500(format!(
            "Configuration file 'nodes/{node}/qemu-server/{vmid}.conf' does not exist"
        ))
    }
}

/// Result type of state operations.
pub type SimResult<T> = Result<T, SimError>;

#[derive(Debug, Clone)]
struct Node {
    memory: u64,
    cores: u32,
    online: bool,
}

#[derive(Debug, Clone)]
struct Vm {
    node: String,
    /// Options in Proxmox syntax, without `digest`.
    config: BTreeMap<String, String>,
    running: bool,
    started_at: Option<Instant>,
    pool: Option<String>,
    /// Last creation/power change, for the `/cluster/resources` statistics lag.
    changed_at: Option<Instant>,
    /// What the last start booted (from the seed attached then; the seed may go later).
    booted: Option<GuestOs>,
    /// How many times the guest booted (starts, reboots, resets), for the `boots` test hook.
    boots: u32,
    /// The guest ignores ACPI and its agent does not answer (`hang_guest`), until it boots again.
    hung: bool,
    /// The host PCI devices it holds on its node, from its start request until it stops.
    pci: Vec<pci::PciHolding>,
}

impl Vm {
    /// The guest boots at `at` (a start, reboot or reset): uptime and guest agent start over
    /// and a hang is gone.
    fn boot(&mut self, at: Instant, os: Option<GuestOs>) {
        self.booted = os;
        self.running = true;
        self.started_at = Some(at);
        self.hung = false;
        self.boots = self.boots.saturating_add(1);
    }

    fn lock(&self) -> Option<&str> {
        self.config.get("lock").map(String::as_str)
    }
    fn is_template(&self) -> bool {
        self.config.get("template").is_some_and(|t| t == "1")
    }
    fn memory_bytes(&self) -> u64 {
        self.config
            .get("memory")
            .and_then(|m| parse_property_string(m, "current").get("current").cloned())
            .and_then(|m| m.parse::<u64>().ok())
            .unwrap_or(512)
            * 1024
            * 1024
    }
    fn cpus(&self) -> u64 {
        let c: u64 = self
            .config
            .get("cores")
            .and_then(|c| c.parse().ok())
            .unwrap_or(1);
        let s: u64 = self
            .config
            .get("sockets")
            .and_then(|c| c.parse().ok())
            .unwrap_or(1);
        c * s
    }
    fn digest(&self) -> String {
        let text: String = self
            .config
            .iter()
            .map(|(k, v)| format!("{k}: {v}\n"))
            .collect();
        sha1_hex(&text)
    }
    /// Disk keys with their property strings (`scsi0` → `local-lvm:vm-100-disk-0,size=10G`).
    fn disks(&self) -> Vec<(String, String)> {
        self.config
            .iter()
            .filter(|(k, v)| is_disk_key(k) && !v.contains("media=cdrom"))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }
    /// Storages of every volume, CD-ROM images and cloud-init drives included (not empty or
    /// host drives): what Proxmox checks for sharing before it clones to another node.
    fn volume_storages(&self) -> BTreeSet<String> {
        self.config
            .iter()
            .filter(|(k, _)| is_disk_key(k))
            .filter_map(|(_, v)| {
                let file = parse_property_string(v, "file").remove("file")?;
                let (storage, _) = file.split_once(':')?;
                (!file.starts_with('/')).then(|| storage.to_owned())
            })
            .collect()
    }
    /// Size of the boot disk (`maxdisk`): the first disk of the boot order (`boot: order=`,
    /// else the legacy `bootdisk`) that the config holds, else its first disk.
    fn boot_disk_size(&self) -> u64 {
        let boot = self
            .config
            .get("boot")
            .map(|b| parse_property_string(b, "legacy"));
        let order: Vec<String> = match boot.as_ref().and_then(|b| b.get("order")) {
            Some(order) => order.split(';').map(|d| d.trim().to_owned()).collect(),
            None => self.config.get("bootdisk").cloned().into_iter().collect(),
        };
        let disks = self.disks();
        order
            .iter()
            .filter_map(|key| disks.iter().find(|(k, _)| k == key))
            .chain(disks.first())
            .find_map(|(_, v)| {
                let size = parse_property_string(v, "file").remove("size")?;
                parse_size(&size)
            })
            .unwrap_or(0)
    }
}

/// The SHA-1 of `text` in hex, as PVE's config digests are.
fn sha1_hex(text: &str) -> String {
    let d = ring::digest::digest(&ring::digest::SHA1_FOR_LEGACY_USE_ONLY, text.as_bytes());
    d.as_ref().iter().map(|b| format!("{b:02x}")).collect()
}

fn is_disk_key(k: &str) -> bool {
    ["scsi", "virtio", "sata", "ide", "efidisk", "tpmstate"]
        .iter()
        .any(|p| {
            k.strip_prefix(p)
                .is_some_and(|r| !r.is_empty() && r.chars().all(|c| c.is_ascii_digit()))
        })
}

/// Parses `10G`, `512M`, `1T`, `1024` (bytes) into bytes.
pub fn parse_size(s: &str) -> Option<u64> {
    let s = s.trim();
    let (num, mult) = match s.chars().last()? {
        'K' | 'k' => (&s[..s.len() - 1], 1u64 << 10),
        'M' | 'm' => (&s[..s.len() - 1], 1 << 20),
        'G' | 'g' => (&s[..s.len() - 1], 1 << 30),
        'T' | 't' => (&s[..s.len() - 1], 1 << 40),
        _ => (s, 1),
    };
    let v: f64 = num.parse().ok()?;
    (v >= 0.0).then_some((v * mult as f64) as u64)
}

/// Formats bytes the way Proxmox writes `size=` (largest exact unit).
pub fn format_size(bytes: u64) -> String {
    for (unit, m) in [
        ("T", 1u64 << 40),
        ("G", 1 << 30),
        ("M", 1 << 20),
        ("K", 1 << 10),
    ] {
        if bytes >= m && bytes.is_multiple_of(m) {
            return format!("{}{unit}", bytes / m);
        }
    }
    bytes.to_string()
}

#[derive(Debug, Clone)]
struct Volume {
    storage: String,
    /// Node for local storages, `None` for shared.
    node: Option<String>,
    volid: String,
    content: String,
    size: u64,
    ctime: u64,
    vmid: Option<u32>,
    data: Option<Arc<Vec<u8>>>,
    /// Format of a disk allocated through a config write; `None`: `iso` for ISOs, else `raw`.
    format: Option<String>,
}

#[derive(Debug, Clone)]
enum Effect {
    None,
    CloneDone {
        newid: u32,
        target: Option<String>,
        pool: Option<String>,
    },
    Start {
        vmid: u32,
    },
    Stop {
        vmid: u32,
    },
    /// A reboot or reset that took: the running guest boots again.
    Restart {
        vmid: u32,
    },
    /// An HA migration (`qmigrate`) of `vmid` from node `from` to `target`, started at `since`.
    Migrate {
        vmid: u32,
        from: String,
        target: String,
        since: Instant,
    },
    Resize {
        vmid: u32,
        disk: String,
        bytes: u64,
    },
    Delete {
        vmid: u32,
        /// `purge=1`: also drop the VM's HA resource (and its sid from HA rules).
        purge: bool,
    },
    AddVolume(Box<Volume>),
    RemoveVolume {
        volid: String,
        node: String,
    },
}

/// The filters of `GET /nodes/{node}/tasks` the simulator honours.
#[derive(Clone, Debug)]
pub struct TaskQuery {
    /// `archive` (ended tasks, Proxmox's default), `active` (running ones) or `all`.
    pub source: String,
    /// Only tasks started at or after this UNIX time.
    pub since: Option<u64>,
    /// Only tasks started at or before this UNIX time.
    pub until: Option<u64>,
    /// Only tasks of this guest.
    pub vmid: Option<String>,
    /// Only tasks of this type.
    pub typefilter: Option<String>,
    /// Only tasks that ended with an error.
    pub errors: bool,
    /// Tasks skipped from the newest.
    pub start: usize,
    /// Tasks listed at most.
    pub limit: usize,
}

impl Default for TaskQuery {
    fn default() -> Self {
        TaskQuery {
            source: "archive".to_owned(),
            since: None,
            until: None,
            vmid: None,
            typefilter: None,
            errors: false,
            start: 0,
            limit: 50,
        }
    }
}

impl TaskQuery {
    fn admits(&self, task: &Task) -> bool {
        let u = &task.upid;
        let source = match self.source.as_str() {
            "active" => !task.done,
            "all" => true,
            _ => task.done,
        };
        source
            && self.since.is_none_or(|since| u.starttime >= since)
            && self.until.is_none_or(|until| u.starttime <= until)
            && self.vmid.as_deref().is_none_or(|vmid| u.id == vmid)
            && self.typefilter.as_deref().is_none_or(|t| u.task_type == t)
            && (!self.errors || (task.done && task.outcome.is_err()))
    }
}

#[derive(Debug, Clone)]
struct Task {
    upid: Upid,
    /// The real Proxmox task type, which the simulator behaves by (the UPID may show another
    /// name: `SimOptions::task_type_names`).
    kind: String,
    /// When the request created the task.
    created: Instant,
    /// When it began to run (`None` while a clone waits for a slot).
    started: Option<Instant>,
    /// How long it runs once started.
    duration: Duration,
    /// `Ok` or the exit status text.
    outcome: Result<(), String>,
    effect: Effect,
    done: bool,
    log: Vec<String>,
    /// The guest the task works on (the new VM for clones).
    vmid: Option<u32>,
    /// The volume an upload or volume deletion works on.
    volume: Option<String>,
    /// Nodes whose clone slots the task holds while it runs.
    slots: Vec<String>,
    /// The request that created it (realistic profile only).
    request: Option<RequestTiming>,
    /// Storage locks it takes in turn when it starts, and for how long (realistic profile:
    /// a clone's allocations).
    allocations: Vec<(String, Duration)>,
    /// The holds of those locks once it started.
    lock_holds: Vec<StorageLockHold>,
}

impl Task {
    fn end(&self) -> Option<Instant> {
        self.started.map(|s| s + self.duration)
    }
}

/// What the simulator recorded about one task: when it was requested, ran and ended. Benchmarks
/// derive Proxmox's share of a machine's provisioning time from these, not from settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TaskRecord {
    /// The UPID.
    pub upid: String,
    /// Node the task runs on.
    pub node: String,
    /// Proxmox task type (`qmclone`, `qmconfig`, `resize`, `imgcopy`, `qmstart`, ...).
    pub kind: String,
    /// The guest it works on (for clones, the new VM).
    pub vmid: Option<u32>,
    /// The volume it works on (uploads and volume deletions).
    pub volume: Option<String>,
    /// When the request created it.
    pub created: Instant,
    /// When it began to run (later than `created` when it waited for a clone slot).
    pub started: Option<Instant>,
    /// When it ended (`None` while still queued or running).
    pub ended: Option<Instant>,
    /// Whether it ended with `OK`.
    pub ok: bool,
    /// For successful starts, reboots and resets: when the guest agent begins to answer
    /// (boot done).
    pub agent_ready: Option<Instant>,
    /// The request that created it, queueing for an API worker included (realistic profile).
    pub request: Option<RequestTiming>,
    /// The storage locks it held, in order (realistic profile: a clone's allocations); its run
    /// time includes the waits for them.
    pub storage_locks: Vec<StorageLockHold>,
}

/// Successful tasks of one kind on one target (a VM or a volume) in a row, with no other
/// successful task on that target between them: a client repeating a write that took effect.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RepeatedWrite {
    /// Proxmox task type (the real one).
    pub kind: String,
    /// `VM <vmid>` or the volume.
    pub target: String,
    /// How many in a row.
    pub times: usize,
}

/// The runs of more than `more_than` successful tasks of one kind on one target without
/// another successful task on it in between (failed tasks neither count nor break a run), from
/// `records` oldest first.
pub fn repeated_writes(records: &[TaskRecord], more_than: usize) -> Vec<RepeatedWrite> {
    let mut runs: BTreeMap<String, RepeatedWrite> = BTreeMap::new();
    let mut found: BTreeMap<(String, String), usize> = BTreeMap::new();
    for record in records.iter().filter(|r| r.ok) {
        let target = record.volume.clone().unwrap_or_else(|| {
            record
                .vmid
                .map_or_else(|| record.node.clone(), |vmid| format!("VM {vmid}"))
        });
        let run = runs.entry(target.clone()).or_insert(RepeatedWrite {
            kind: record.kind.clone(),
            target: target.clone(),
            times: 0,
        });
        if run.kind != record.kind {
            run.kind = record.kind.clone();
            run.times = 0;
        }
        run.times += 1;
        if run.times > more_than {
            let most = found.entry((run.kind.clone(), target)).or_default();
            *most = (*most).max(run.times);
        }
    }
    found
        .into_iter()
        .map(|((kind, target), times)| RepeatedWrite {
            kind,
            target,
            times,
        })
        .collect()
}

/// Where cloud-init records how the boot ended.
const CLOUD_INIT_RESULT: &str = "/run/cloud-init/result.json";

#[derive(Debug, Clone)]
struct Exec {
    /// When `exec-status` first reports the command exited.
    exits_at: Instant,
    exitcode: i64,
    out: String,
    err: String,
}

/// The whole simulated cluster.
pub struct Cluster {
    cluster_name: Option<String>,
    nodes: BTreeMap<String, Node>,
    storages: BTreeMap<String, StorageSpec>,
    vms: BTreeMap<u32, Vm>,
    volumes: Vec<Volume>,
    tasks: HashMap<String, Task>,
    /// Running tasks by end time, so `advance` touches only what is due.
    running: BTreeSet<(Instant, String)>,
    /// Clone tasks waiting for a slot, in request order.
    clone_queue: VecDeque<String>,
    /// Clone tasks running per node.
    clone_slots_used: BTreeMap<String, usize>,
    /// (storage, node) pairs a test made inactive: listed with status `unknown`, `active: 0`.
    inactive_storages: std::collections::BTreeSet<(String, String)>,
    /// (storage, node) pairs a test filled: bytes of other data beside the volumes.
    filled_storages: BTreeMap<(String, String), u64>,
    pools: BTreeMap<String, Option<String>>,
    execs: HashMap<(u32, u64), Exec>,
    counter: u64,
    epoch: u64,
    /// The task processes' start times (a UPID's `pstart`) begin here: each simulator of a
    /// process has its own (within 32 bits, for the first 240), as each Proxmox node has, so
    /// two simulated clusters with the same node names do not hand out one UPID twice.
    pstart_base: u64,
    opts: SimOptions,
    task_fail: Box<dyn FnMut(&str) -> bool + Send>,
    /// HA resources, groups, rules and the CRM's view of them.
    ha: ha::HaState,
    /// Each node's PCI devices.
    pci_devices: BTreeMap<String, Vec<PciDeviceSpec>>,
    /// PCI resource mappings by ID.
    pci_mappings: BTreeMap<String, PciMappingSpec>,
    /// DHCP services by bridge.
    dhcp: BTreeMap<String, DhcpSpec>,
    /// DHCP leases by (bridge, MAC).
    leases: BTreeMap<(String, String), dhcp::Lease>,
    /// Guests whose DHCP clients ask when their boot is done: (boot done, VMID).
    dhcp_due: BTreeSet<(Instant, u32)>,
    /// Drawn task durations and storage locks (realistic profile).
    task_model: Option<TaskModel>,
    /// The request being served, which the tasks it creates record.
    serving: Option<RequestTiming>,
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster")
            .field("nodes", &self.nodes.len())
            .field("vms", &self.vms.len())
            .field("tasks", &self.tasks.len())
            .finish_non_exhaustive()
    }
}

impl Cluster {
    /// Builds the initial state. `task_fail(type)` decides injected task failures.
    pub fn new(
        topology: &Topology,
        opts: SimOptions,
        task_fail: Box<dyn FnMut(&str) -> bool + Send>,
    ) -> Self {
        let mut c = Self {
            cluster_name: topology.cluster_name.clone(),
            nodes: topology
                .nodes
                .iter()
                .map(|n| {
                    (
                        n.name.clone(),
                        Node {
                            memory: n.memory_mib * 1024 * 1024,
                            cores: n.cores,
                            online: n.online,
                        },
                    )
                })
                .collect(),
            storages: topology
                .storages
                .iter()
                .map(|s| (s.name.clone(), s.clone()))
                .collect(),
            vms: BTreeMap::new(),
            volumes: Vec::new(),
            tasks: HashMap::new(),
            running: BTreeSet::new(),
            clone_queue: VecDeque::new(),
            clone_slots_used: BTreeMap::new(),
            inactive_storages: Default::default(),
            filled_storages: BTreeMap::new(),
            pools: topology.pools.iter().map(|p| (p.clone(), None)).collect(),
            execs: HashMap::new(),
            counter: 0,
            epoch: 1_767_225_600, // 2026-01-01, for UPID start times
            pstart_base: 0x1000 + ((SIMULATORS.fetch_add(1, Ordering::Relaxed) % 0xF0) << 24),
            task_model: opts.profile.realistic().map(TaskModel::new),
            serving: None,
            opts,
            task_fail,
            ha: ha::HaState::default(),
            pci_devices: topology
                .nodes
                .iter()
                .map(|n| (n.name.clone(), n.pci_devices.clone()))
                .collect(),
            pci_mappings: topology
                .pci_mappings
                .iter()
                .map(|m| (m.name.clone(), m.clone()))
                .collect(),
            dhcp: dhcp::services(topology),
            leases: BTreeMap::new(),
            dhcp_due: BTreeSet::new(),
        };
        for t in &topology.templates {
            c.add_guest(t, true);
        }
        for g in &topology.guests {
            c.add_guest(g, false);
        }
        c.claim_initial_pci();
        c
    }

    /// Guests the topology lists as running hold their PCI devices and had their DHCP
    /// leases; one whose devices cannot be had (taken by a guest before it, in VMID order)
    /// is stopped instead.
    fn claim_initial_pci(&mut self) {
        let running: Vec<u32> = self
            .vms
            .iter()
            .filter(|(_, vm)| vm.running)
            .map(|(vmid, _)| *vmid)
            .collect();
        for vmid in running {
            let claim = self.claim_pci(vmid);
            let Some(vm) = self.vms.get_mut(&vmid) else {
                continue;
            };
            match claim {
                Ok(held) => {
                    vm.pci = held;
                    if let Some(at) = vm.started_at {
                        self.dhcp_after_boot(vmid, at);
                    }
                }
                Err(reason) => {
                    tracing::warn!(vmid, %reason, "topology guest cannot start: stopped");
                    vm.running = false;
                    vm.started_at = None;
                    vm.boots = 0;
                }
            }
        }
    }

    fn add_guest(&mut self, g: &GuestSpec, template: bool) {
        let prefix = if template { "base" } else { "vm" };
        let volname = format!("{prefix}-{}-disk-0", g.vmid);
        let mut config = BTreeMap::new();
        config.insert("name".into(), g.name.clone());
        config.insert("memory".into(), g.memory_mib.to_string());
        config.insert("cores".into(), g.cores.to_string());
        config.insert("sockets".into(), "1".into());
        config.insert("scsihw".into(), "virtio-scsi-pci".into());
        config.insert(
            "scsi0".into(),
            format!("{}:{volname},size={}G", g.storage, g.disk_gib),
        );
        config.insert("boot".into(), "order=scsi0".into());
        config.insert("smbios1".into(), format!("uuid={}", self.uuid()));
        config.insert("meta".into(), "creation-qemu=9.0.2,ctime=1767225600".into());
        if !g.tags.is_empty() {
            config.insert("tags".into(), canonical_tags(&g.tags.join(";")));
        }
        if template {
            config.insert("template".into(), "1".into());
        }
        for (k, v) in &g.config {
            config.insert(k.clone(), v.clone());
        }
        let shared = self.storages.get(&g.storage).is_some_and(|s| s.shared);
        self.volumes.push(Volume {
            storage: g.storage.clone(),
            node: (!shared).then(|| g.node.clone()),
            volid: format!("{}:{volname}", g.storage),
            content: "images".into(),
            size: g.disk_gib << 30,
            ctime: self.epoch,
            vmid: Some(g.vmid),
            data: None,
            format: None,
        });
        self.vms.insert(
            g.vmid,
            Vm {
                node: g.node.clone(),
                config,
                running: g.running && !template,
                started_at: (g.running && !template).then(|| {
                    let now = Instant::now();
                    now.checked_sub(Duration::from_secs(3600)).unwrap_or(now)
                }),
                pool: None,
                changed_at: None,
                booted: None,
                // a guest listed as running booted once before the simulation began
                boots: u32::from(g.running && !template),
                hung: false,
                pci: Vec::new(),
            },
        );
    }

    fn next_counter(&mut self) -> u64 {
        self.counter += 1;
        self.counter
    }

    fn uuid(&mut self) -> String {
        let n = self.next_counter();
        format!("5c0e{n:04x}-1d2b-4c3a-9e8f-{n:012x}")
    }

    fn mac(&mut self) -> String {
        let n = self.next_counter();
        format!(
            "BC:24:11:{:02X}:{:02X}:{:02X}",
            (n >> 16) & 0xff,
            (n >> 8) & 0xff,
            n & 0xff
        )
    }

    /// The options the simulator runs with.
    pub fn options(&self) -> &SimOptions {
        &self.opts
    }

    /// Replaces the injected task failures (`task_fail(type)` true = the task fails), so a
    /// test can let tasks fail and later recover, as a repaired storage or node would.
    pub fn set_task_failure(&mut self, task_fail: Box<dyn FnMut(&str) -> bool + Send>) {
        self.task_fail = task_fail;
    }

    /// Applies the effects of every task that has ended by `now` and lets every guest whose
    /// boot is done by then take its DHCP leases, in time order (a task first at the same
    /// instant); a clone that ends frees its slots, and queued clones start at that instant.
    pub fn advance(&mut self, now: Instant) {
        loop {
            let task = self
                .running
                .first()
                .map(|(end, _)| *end)
                .filter(|e| *e <= now);
            let dhcp = self.next_dhcp_due().filter(|d| *d <= now);
            match (task, dhcp) {
                (Some(end), Some(due)) if due < end => self.run_next_dhcp(),
                (Some(_), _) => self.end_next_task(),
                (None, Some(_)) => self.run_next_dhcp(),
                (None, None) => break,
            }
        }
    }

    /// Ends the running task that ends first and applies its effect.
    fn end_next_task(&mut self) {
        let Some((end, key)) = self.running.pop_first() else {
            return;
        };
        let Some(task) = self.tasks.get_mut(&key) else {
            return;
        };
        task.done = true;
        let effect = std::mem::replace(&mut task.effect, Effect::None);
        let ok = task.outcome.is_ok();
        let slots = std::mem::take(&mut task.slots);
        let mut log = Vec::new();
        let late = self.apply(effect, ok, end, &mut log);
        if let Some(task) = self.tasks.get_mut(&key) {
            if let Err(e) = late {
                task.outcome = Err(e);
            }
            task.log.extend(log);
            match &task.outcome {
                Ok(()) => task.log.push("TASK OK".into()),
                Err(e) => task.log.push(format!("TASK ERROR: {e}")),
            }
        }
        if !slots.is_empty() {
            for node in &slots {
                if let Some(used) = self.clone_slots_used.get_mut(node) {
                    *used = used.saturating_sub(1);
                }
            }
            self.start_queued_clones(end);
        }
    }

    /// Whether a clone holding slots on `nodes` may start now.
    fn clone_slots_free(&self, nodes: &[String]) -> bool {
        let limit = self.opts.clone_slots_per_node;
        limit == 0
            || nodes
                .iter()
                .all(|n| self.clone_slots_used.get(n).copied().unwrap_or(0) < limit)
    }

    /// Starts the queued clones that fit, oldest first; one that does not fit does not hold
    /// back later clones on other nodes.
    fn start_queued_clones(&mut self, at: Instant) {
        let queued: Vec<String> = self.clone_queue.iter().cloned().collect();
        for key in queued {
            let Some(nodes) = self.tasks.get(&key).map(|t| t.slots.clone()) else {
                continue;
            };
            if self.clone_slots_free(&nodes) {
                self.clone_queue.retain(|k| *k != key);
                self.run_task(&key, at);
            }
        }
    }

    /// Sets the request being served (`None` once it is done), for the tasks it creates to
    /// record.
    pub(crate) fn set_serving(&mut self, request: Option<RequestTiming>) {
        self.serving = request;
    }

    /// Marks a task as running from `at` and takes its clone slots and, one after another,
    /// its storage locks (waiting for each as long as earlier tasks hold it).
    fn run_task(&mut self, key: &str, at: Instant) {
        let Some(task) = self.tasks.get_mut(key) else {
            return;
        };
        task.started = Some(at);
        if let Some(model) = &mut self.task_model
            && !task.allocations.is_empty()
        {
            let mut since = at;
            for (lock, hold) in &task.allocations {
                let held = model.reserve(lock, since, *hold);
                since = held.released;
                task.lock_holds.push(held);
            }
            let allocating: Duration = task.allocations.iter().map(|(_, hold)| *hold).sum();
            task.duration = since + task.duration.saturating_sub(allocating) - at;
        }
        let end = at + task.duration;
        if task.created < at {
            task.log.push(format!(
                "waited {} ms for a clone slot",
                (at - task.created).as_millis()
            ));
        }
        for node in task.slots.clone() {
            *self.clone_slots_used.entry(node).or_default() += 1;
        }
        self.running.insert((end, key.to_string()));
    }

    /// Every task so far with its timing, oldest first.
    pub fn task_records(&self) -> Vec<TaskRecord> {
        let mut records: Vec<TaskRecord> = self
            .tasks
            .values()
            .map(|t| {
                let ended = t.done.then(|| t.end()).flatten();
                let ok = t.done && t.outcome.is_ok();
                TaskRecord {
                    upid: t.upid.as_str().to_string(),
                    node: t.upid.node.clone(),
                    kind: t.kind.clone(),
                    vmid: t.vmid,
                    volume: t.volume.clone(),
                    created: t.created,
                    started: t.started,
                    ended,
                    ok,
                    agent_ready: ended
                        .filter(|_| {
                            ok && matches!(t.kind.as_str(), "qmstart" | "qmreboot" | "qmreset")
                        })
                        .map(|e| e + self.opts.boot_delay),
                    request: t.request.clone(),
                    storage_locks: t.lock_holds.clone(),
                }
            })
            .collect();
        records.sort_by(|a, b| (a.created, &a.upid).cmp(&(b.created, &b.upid)));
        records
    }

    /// Applies a finished task's effect; an `Err` is a failure only the end reveals (an HA
    /// migration whose target went away), which becomes the task's exit status.
    fn apply(
        &mut self,
        effect: Effect,
        ok: bool,
        end: Instant,
        log: &mut Vec<String>,
    ) -> Result<(), String> {
        match effect {
            Effect::None => {}
            Effect::CloneDone {
                newid,
                target,
                pool,
            } => {
                if !ok {
                    self.remove_vm(newid);
                    return Ok(());
                }
                if let Some(vm) = self.vms.get_mut(&newid) {
                    vm.config.remove("lock");
                    vm.changed_at = Some(end);
                    if let Some(t) = target {
                        vm.node = t;
                    }
                    if let Some(p) = pool {
                        vm.pool = Some(p);
                    }
                }
                log.push(format!("clone to VM {newid} finished"));
            }
            Effect::Start { vmid } if ok => {
                let booted = self.vms.get(&vmid).map(|vm| self.seed_os(vm));
                if let Some(vm) = self.vms.get_mut(&vmid) {
                    vm.boot(end, booted);
                    vm.changed_at = Some(end);
                }
                self.dhcp_after_boot(vmid, end);
            }
            // a start that failed frees the devices it reserved (a VM that was already
            // running keeps those it started with)
            Effect::Start { vmid } => {
                if let Some(vm) = self.vms.get_mut(&vmid).filter(|vm| !vm.running) {
                    vm.pci.clear();
                }
            }
            Effect::Restart { vmid } if ok => self.restart_guest(vmid, end),
            Effect::Migrate {
                vmid,
                from,
                target,
                since,
            } => return self.finish_migration(vmid, &from, &target, ok, (since, end), log),
            Effect::Stop { vmid } if ok => {
                if let Some(vm) = self.vms.get_mut(&vmid) {
                    vm.running = false;
                    vm.started_at = None;
                    vm.changed_at = Some(end);
                    vm.pci.clear();
                }
            }
            Effect::Resize { vmid, disk, bytes } if ok => {
                if let Some(vm) = self.vms.get_mut(&vmid)
                    && let Some(v) = vm.config.get(&disk).cloned()
                {
                    let mut props = parse_property_string(&v, "file");
                    let file = props.remove("file").unwrap_or_default();
                    props.insert("size".into(), format_size(bytes));
                    let rest: Vec<String> = props.iter().map(|(k, v)| format!("{k}={v}")).collect();
                    vm.config.insert(disk, format!("{file},{}", rest.join(",")));
                    log.push(format!("Image resized to {bytes} bytes"));
                    let on = |x: &Volume| {
                        x.volid == file && x.node.as_deref().is_none_or(|n| n == vm.node)
                    };
                    if let Some(volume) = self.volumes.iter_mut().find(|x| on(x)) {
                        volume.size = bytes;
                    }
                }
            }
            Effect::Delete { vmid, purge } => {
                if ok {
                    self.remove_vm(vmid);
                    if purge {
                        self.ha_forget(vmid);
                    }
                } else if let Some(vm) = self.vms.get_mut(&vmid) {
                    vm.config.remove("lock");
                }
            }
            Effect::AddVolume(v) if ok => {
                self.volumes
                    .retain(|x| !(x.volid == v.volid && x.node == v.node));
                self.volumes.push(*v);
            }
            Effect::RemoveVolume { volid, node } if ok => {
                self.volumes
                    .retain(|x| !(x.volid == volid && x.node.as_deref().is_none_or(|n| n == node)));
            }
            _ => {}
        }
        Ok(())
    }

    fn remove_vm(&mut self, vmid: u32) {
        self.vms.remove(&vmid);
        self.release_leases(vmid);
        self.volumes
            .retain(|v| v.vmid != Some(vmid) || v.content != "images");
    }

    #[allow(clippy::too_many_arguments)] // one call per task type; a struct would only rename them
    fn new_task(
        &mut self,
        now: Instant,
        node: &str,
        kind: &str,
        id: &str,
        mut outcome: Result<(), String>,
        effect: Effect,
        volume: Option<String>,
    ) -> Upid {
        if outcome.is_ok() && (self.task_fail)(kind) {
            outcome = Err("injected failure".to_string());
        }
        let vmid = match &effect {
            Effect::CloneDone { newid, .. } => Some(*newid),
            _ => id.parse().ok(),
        };
        let target = vmid.map_or_else(
            || volume.clone().unwrap_or_else(|| id.to_string()),
            |v| v.to_string(),
        );
        let (duration, allocations) = self.drawn_duration(kind, &target, &effect);
        let slots = match &effect {
            Effect::CloneDone { target, .. } => {
                let mut nodes = vec![node.to_string()];
                nodes.extend(target.iter().filter(|t| *t != node).cloned());
                nodes
            }
            _ => Vec::new(),
        };
        let user = self.opts.token_id.clone();
        let n = self.next_counter();
        let upid = Upid::new(
            node,
            (1000 + n) as u32,
            self.pstart_base + n,
            self.epoch + n,
            self.opts.shown_task_type(kind),
            id,
            &user,
        );
        let key = upid.as_str().to_string();
        let queued = !slots.is_empty() && !self.clone_slots_free(&slots);
        self.tasks.insert(
            key.clone(),
            Task {
                upid: upid.clone(),
                kind: kind.to_string(),
                created: now,
                started: None,
                duration,
                outcome,
                effect,
                done: false,
                log: vec![format!("starting task {kind}")],
                vmid,
                volume,
                slots,
                request: self.serving.clone(),
                allocations,
                lock_holds: Vec::new(),
            },
        );
        if queued {
            self.clone_queue.push_back(key);
        } else {
            self.run_task(&key, now);
        }
        upid
    }

    /// How long a task of type `kind` on `target` runs: as configured, or drawn around that
    /// under the realistic profile, where a clone also allocates each new volume under its
    /// storage's lock.
    fn drawn_duration(
        &mut self,
        kind: &str,
        target: &str,
        effect: &Effect,
    ) -> (Duration, Vec<(String, Duration)>) {
        let configured = self.opts.duration_of(kind);
        let Some(model) = &mut self.task_model else {
            return (configured, Vec::new());
        };
        let duration = model.draw_task(kind, target, configured).duration;
        let Effect::CloneDone { newid, .. } = effect else {
            return (duration, Vec::new());
        };
        let locks = self
            .volumes
            .iter()
            .filter(|v| v.vmid == Some(*newid) && v.content == "images")
            .map(|v| storage_lock_name(&v.storage, v.node.as_deref()))
            .collect();
        (duration, model.draw_allocations(target, locks, duration))
    }

    /// Whether an unfinished clone task reads from `vmid` (it holds the source's flock).
    fn clone_running_from(&self, vmid: u32) -> bool {
        let id = vmid.to_string();
        self.tasks
            .values()
            .any(|t| !t.done && t.kind == "qmclone" && t.upid.id == id)
    }

    /// Whether an unfinished task holds `vmid`'s flock: a clone from it, or a reboot, reset or
    /// migration of it (other requests that need the flock wait for it and time out).
    fn flock_held(&self, vmid: u32) -> bool {
        self.clone_running_from(vmid)
            || self.restart_running(vmid)
            || self.migration_target(vmid).is_some()
    }

    fn flock_timeout(vmid: u32) -> SimError {
        SimError::e500(format!(
            "can't lock file '/var/lock/qemu-server/lock-{vmid}.conf' - got timeout"
        ))
    }

    fn node_checked(&self, node: &str) -> SimResult<&Node> {
        let n = self.nodes.get(node).ok_or_else(|| {
            SimError::e500(format!(
                "hostname lookup '{node}' failed - failed to get address info for: {node}: Name or service not known"
            ))
        })?;
        if !n.online {
            return Err(SimError {
                status: 595,
                reason: "Errors during connection establishment, proxy handshake: No route to host"
                    .into(),
                errors: BTreeMap::new(),
            });
        }
        Ok(n)
    }

    fn vm_on(&self, node: &str, vmid: u32) -> SimResult<&Vm> {
        self.node_checked(node)?;
        self.vms
            .get(&vmid)
            .filter(|v| v.node == node)
            .ok_or_else(|| SimError::missing_vm(node, vmid))
    }

    fn storage_on(&self, node: &str, storage: &str) -> SimResult<&StorageSpec> {
        self.storages
            .get(storage)
            .filter(|s| s.nodes.is_empty() || s.nodes.iter().any(|n| n == node))
            .ok_or_else(|| {
                SimError::e500(format!(
                    "storage '{storage}' does not exist on node '{node}'"
                ))
            })
    }

    // ---------------------------------------------------------------- cluster

    /// `GET /version`.
    pub fn version(&self) -> Value {
        let release: String = self
            .opts
            .version
            .split('.')
            .take(2)
            .collect::<Vec<_>>()
            .join(".");
        json!({"release": release, "version": self.opts.version, "repoid": "5ab3c1d2"})
    }

    /// `GET /nodes`.
    pub fn nodes(&self) -> Value {
        Value::Array(
            self.nodes
                .iter()
                .map(|(name, n)| {
                    if n.online {
                        json!({"node": name, "status": "online", "id": format!("node/{name}"), "type": "node",
                           "level": "", "cpu": 0.02, "maxcpu": n.cores, "mem": self.used_memory(name),
                           "maxmem": n.memory, "disk": 3_u64 << 30, "maxdisk": 100_u64 << 30, "uptime": 86400,
                           "ssl_fingerprint": "00:11:22:33:44:55:66:77:88:99:AA:BB:CC:DD:EE:FF:00:11:22:33:44:55:66:77:88:99:AA:BB:CC:DD:EE:FF"})
                    } else {
                        json!({"node": name, "status": "offline", "id": format!("node/{name}"), "type": "node", "level": ""})
                    }
                })
                .collect(),
        )
    }

    fn used_memory(&self, node: &str) -> u64 {
        self.vms
            .values()
            .filter(|v| v.node == node && v.running)
            .map(Vm::memory_bytes)
            .sum::<u64>()
            + (2 << 30)
    }

    /// `GET /nodes/{node}/status`.
    pub fn node_status(&self, node: &str) -> SimResult<Value> {
        let n = self.node_checked(node)?;
        let used = self.used_memory(node);
        Ok(json!({
            "cpu": 0.02, "uptime": 86400, "idle": 0, "wait": 0.0,
            "loadavg": ["0.10", "0.20", "0.30"],
            "kversion": "Linux 6.14.8-2-pve #1 SMP PREEMPT_DYNAMIC PMX 6.14.8-2",
            "pveversion": format!("pve-manager/{}/5ab3c1d2", self.opts.version),
            "memory": {"total": n.memory, "used": used, "free": n.memory.saturating_sub(used), "available": n.memory.saturating_sub(used)},
            "swap": {"total": 0, "used": 0, "free": 0},
            "rootfs": {"total": 100_u64 << 30, "used": 3_u64 << 30, "free": 97_u64 << 30, "avail": 97_u64 << 30},
            "ksm": {"shared": 0},
            "cpuinfo": {"cpus": n.cores, "cores": n.cores, "sockets": 1, "model": "Simulated CPU", "mhz": "2400.000", "hvm": "1", "flags": "", "user_hz": 100},
            "current-kernel": {"sysname": "Linux", "release": "6.14.8-2-pve", "version": "#1 SMP", "machine": "x86_64"},
            "boot-info": {"mode": "efi", "secureboot": 0}
        }))
    }

    /// `GET /cluster/status`.
    pub fn cluster_status(&self) -> Value {
        let mut out = Vec::new();
        if let Some(name) = &self.cluster_name {
            out.push(
                json!({"type": "cluster", "id": "cluster", "name": name, "nodes": self.nodes.len(),
                            "quorate": 1, "version": self.nodes.len() + 2}),
            );
        }
        for (i, (name, n)) in self.nodes.iter().enumerate() {
            out.push(json!({"type": "node", "id": format!("node/{name}"), "name": name, "nodeid": i + 1,
                            "ip": format!("192.0.2.{}", i + 11), "online": u8::from(n.online), "local": u8::from(i == 0), "level": ""}));
        }
        Value::Array(out)
    }

    fn vm_resource(&self, now: Instant, vmid: u32, vm: &Vm) -> Value {
        // name/status/template come from pvestatd's RRD broadcast and lag behind changes
        let lagging = vm
            .changed_at
            .is_some_and(|c| now < c + self.opts.resources_lag);
        let mut r = json!({
            "id": format!("qemu/{vmid}"), "type": "qemu", "vmid": vmid, "node": vm.node,
            "status": if vm.running { "running" } else { "stopped" },
            "template": u8::from(vm.is_template()),
            "maxcpu": vm.cpus(), "maxmem": vm.memory_bytes(), "maxdisk": vm.boot_disk_size(),
            "cpu": 0, "mem": if vm.running { vm.memory_bytes() / 2 } else { 0 }, "disk": 0,
            "uptime": 0, "netin": 0, "netout": 0, "diskread": 0, "diskwrite": 0,
        });
        if let Some(name) = vm.config.get("name") {
            r["name"] = json!(name);
        }
        if let Some(tags) = vm.config.get("tags") {
            r["tags"] = json!(tags);
        }
        if let Some(lock) = vm.lock() {
            r["lock"] = json!(lock);
        }
        if let Some(pool) = &vm.pool {
            r["pool"] = json!(pool);
        }
        if let Some(state) = self.ha_state(vmid) {
            r["hastate"] = json!(state);
        }
        // a guest on an offline node: pvestatd has no current statistics for it
        if !self.nodes.get(&vm.node).is_some_and(|n| n.online) {
            r["status"] = json!("unknown");
        }
        if lagging {
            if let Some(o) = r.as_object_mut() {
                o.remove("name");
                o.remove("template");
            }
            r["status"] = json!("unknown");
        }
        r
    }

    /// `GET /cluster/resources[?type=]`.
    pub fn cluster_resources(&self, now: Instant, kind: Option<&str>) -> SimResult<Value> {
        let mut out = Vec::new();
        let want = |k: &str| kind.is_none() || kind == Some(k);
        if let Some(k) = kind
            && !["vm", "storage", "node", "sdn"].contains(&k)
        {
            return Err(SimError::param(
                "type",
                format!(
                    "value '{k}' does not have a value in the enumeration 'vm, storage, node, sdn'"
                ),
            ));
        }
        if want("node") {
            for (name, n) in &self.nodes {
                if n.online {
                    out.push(json!({"id": format!("node/{name}"), "type": "node", "node": name, "status": "online",
                        "cpu": 0.02, "maxcpu": n.cores, "mem": self.used_memory(name), "maxmem": n.memory,
                        "disk": 3_u64 << 30, "maxdisk": 100_u64 << 30, "uptime": 86400, "level": "", "cgroup-mode": 2}));
                } else {
                    out.push(json!({"id": format!("node/{name}"), "type": "node", "node": name, "status": "offline"}));
                }
            }
        }
        if want("storage") {
            for node in self.nodes.keys() {
                for s in self.storages.values() {
                    if !s.nodes.is_empty() && !s.nodes.contains(node) {
                        continue;
                    }
                    let status = if self.storage_active(&s.name, node) {
                        "available"
                    } else {
                        "unknown"
                    };
                    out.push(json!({"id": format!("storage/{node}/{}", s.name), "type": "storage", "storage": s.name,
                        "node": node, "status": status, "plugintype": s.kind, "shared": u8::from(s.shared),
                        "content": s.content.join(","), "disk": self.storage_used(&s.name, node), "maxdisk": s.size_gib << 30}));
                }
            }
        }
        if want("vm") {
            for (vmid, vm) in &self.vms {
                out.push(self.vm_resource(now, *vmid, vm));
            }
        }
        if kind.is_none() {
            for p in self.pools.keys() {
                out.push(json!({"id": format!("pool/{p}"), "type": "pool", "pool": p}));
            }
        }
        Ok(Value::Array(out))
    }

    /// Bytes used on `storage` as `node` sees it: its volumes and what a test filled it with.
    fn storage_used(&self, storage: &str, node: &str) -> u64 {
        let filled = self
            .filled_storages
            .get(&(storage.to_owned(), node.to_owned()))
            .copied()
            .unwrap_or(0);
        self.volume_bytes(storage, node).saturating_add(filled)
    }

    /// Bytes the volumes on `storage` take as `node` sees it.
    fn volume_bytes(&self, storage: &str, node: &str) -> u64 {
        self.volumes
            .iter()
            .filter(|v| v.storage == storage && v.node.as_deref().is_none_or(|n| n == node))
            .map(|v| v.size)
            .sum()
    }

    fn storage_active(&self, storage: &str, node: &str) -> bool {
        !self
            .inactive_storages
            .contains(&(storage.to_owned(), node.to_owned()))
    }

    /// `GET /cluster/nextid[?vmid=]` (returned as a string, like real servers).
    pub fn next_id(&self, vmid: Option<&str>) -> SimResult<Value> {
        if let Some(v) = vmid {
            let id: u32 = v
                .parse()
                .ok()
                .filter(|i| (100..=999_999_999).contains(i))
                .ok_or_else(|| {
                    SimError::param(
                        "vmid",
                        "invalid format - value does not look like a valid VM ID",
                    )
                })?;
            if self.vms.contains_key(&id) {
                return Err(SimError::param("vmid", format!("VM {id} already exists")));
            }
            return Ok(json!(id.to_string()));
        }
        let id = (100..1_000_000u32)
            .find(|i| !self.vms.contains_key(i))
            .ok_or_else(|| SimError::e500("unable to get any free VMID in range [100, 1000000)"))?;
        Ok(json!(id.to_string()))
    }

    // ---------------------------------------------------------------- guests

    /// `GET /nodes/{node}/qemu`.
    pub fn list_vms(&self, node: &str) -> SimResult<Value> {
        self.node_checked(node)?;
        Ok(Value::Array(
            self.vms
                .iter()
                .filter(|(_, v)| v.node == node)
                .map(|(id, vm)| {
                    let mut r = json!({"vmid": id, "status": if vm.running {"running"} else {"stopped"},
                        "cpus": vm.cpus(), "maxmem": vm.memory_bytes(), "maxdisk": vm.boot_disk_size(),
                        "mem": if vm.running { vm.memory_bytes() / 2 } else { 0 }, "cpu": 0, "uptime": 0,
                        "netin": 0, "netout": 0, "diskread": 0, "diskwrite": 0, "disk": 0});
                    if let Some(n) = vm.config.get("name") {
                        r["name"] = json!(n);
                    }
                    if let Some(t) = vm.config.get("tags") {
                        r["tags"] = json!(t);
                    }
                    if let Some(l) = vm.lock() {
                        r["lock"] = json!(l);
                    }
                    if vm.is_template() {
                        r["template"] = json!(1);
                    }
                    if vm.running {
                        r["pid"] = json!(10_000 + id);
                    }
                    r
                })
                .collect(),
        ))
    }

    /// `GET /nodes/{node}/lxc`: the simulator runs no containers, so every node's list is
    /// empty (clients summing guests' memory, such as schedulers, read it with the VMs').
    pub fn list_containers(&self, node: &str) -> SimResult<Value> {
        self.node_checked(node)?;
        Ok(Value::Array(Vec::new()))
    }

    /// `GET .../config`.
    pub fn vm_config(&self, node: &str, vmid: u32) -> SimResult<Value> {
        let vm = self.vm_on(node, vmid)?;
        let mut map = serde_json::Map::new();
        for (k, v) in &vm.config {
            // numeric options come back as numbers, like Proxmox (memory is a string since 8.1)
            let numeric = matches!(
                k.as_str(),
                "cores"
                    | "sockets"
                    | "template"
                    | "onboot"
                    | "protection"
                    | "balloon"
                    | "ciupgrade"
                    | "vcpus"
                    | "numa"
            );
            let value = match (numeric, v.parse::<i64>()) {
                (true, Ok(n)) => json!(n),
                _ => json!(v),
            };
            map.insert(k.clone(), value);
        }
        map.insert("digest".into(), json!(vm.digest()));
        Ok(Value::Object(map))
    }

    /// `POST`/`PUT .../config`: early checks, then applies at once. POST returns a `qmconfig`
    /// task. Disks written as `STORAGE:SIZE` are allocated (module `disks`): an allocation
    /// that fails, or a raw PCI device an API token may not write (module `pci`), leaves the
    /// config as it was and fails the task (POST) or the request (PUT, 500).
    pub fn update_config(
        &mut self,
        now: Instant,
        node: &str,
        vmid: u32,
        params: &BTreeMap<String, String>,
        asynchronous: bool,
    ) -> SimResult<Option<Upid>> {
        self.check_config_write(node, vmid, params)?;
        let new_disks = self.new_disks(params)?;
        let old_config = self.vm_on(node, vmid)?.config.clone();
        let mut new_config = self.config_with(node, &old_config, params)?;
        let id = vmid.to_string();
        let allocated = match self
            .hostpci_write_refusal(&old_config, params)
            .map_or_else(|| self.allocate(node, vmid, new_disks), Err)
        {
            Ok(allocated) => allocated,
            Err(e) if asynchronous => {
                let upid = self.new_task(now, node, "qmconfig", &id, Err(e), Effect::None, None);
                return Ok(Some(upid));
            }
            Err(e) => return Err(SimError::e500(e)),
        };
        let log = self.write_disks(vmid, &old_config, &mut new_config, params, allocated);
        self.apply_deletes(vmid, &mut new_config, params);
        if let Some(vm) = self.vms.get_mut(&vmid) {
            vm.config = new_config;
        }
        if !asynchronous {
            return Ok(None);
        }
        let upid = self.new_task(now, node, "qmconfig", &id, Ok(()), Effect::None, None);
        if let Some(task) = self.tasks.get_mut(upid.as_str()) {
            task.log.extend(log);
        }
        Ok(Some(upid))
    }

    /// The checks of a config write before anything changes: lock, flock, digest, and the
    /// schema (unknown options, names, SMBIOS, drive options).
    fn check_config_write(
        &self,
        node: &str,
        vmid: u32,
        params: &BTreeMap<String, String>,
    ) -> SimResult<()> {
        let vm = self.vm_on(node, vmid)?;
        let skiplock = params.get("skiplock").is_some_and(|v| v == "1");
        if let Some(lock) = vm.lock()
            && !skiplock
        {
            return Err(SimError::e500(format!("VM is locked ({lock})")));
        }
        if self.flock_held(vmid) {
            return Err(Self::flock_timeout(vmid));
        }
        if let Some(d) = params.get("digest")
            && *d != vm.digest()
        {
            return Err(SimError::e500(
                "checksum mismatch (file change by other user?)",
            ));
        }
        let errors = config_schema_errors(params);
        if errors.is_empty() {
            Ok(())
        } else {
            Err(SimError {
                status: 400,
                reason: "Parameter verification failed.".into(),
                errors,
            })
        }
    }

    /// `config` with the options of `params` set (canonical tags, NICs with MACs); a CD-ROM
    /// must name an existing volume.
    fn config_with(
        &mut self,
        node: &str,
        config: &BTreeMap<String, String>,
        params: &BTreeMap<String, String>,
    ) -> SimResult<BTreeMap<String, String>> {
        let mut new_config = config.clone();
        for (k, v) in params {
            if !is_config_option(k) {
                continue;
            }
            let value = match k.as_str() {
                "tags" => canonical_tags(v),
                k if is_indexed(k, "net") => self.net_value(v),
                _ => v.clone(),
            };
            if (k.starts_with("ide") || k.starts_with("sata") || k.starts_with("scsi"))
                && value.contains("media=cdrom")
            {
                let file = value.split(',').next().unwrap_or_default();
                if file != "none"
                    && file != "cdrom"
                    && !file.ends_with(":cloudinit")
                    && !self
                        .volumes
                        .iter()
                        .any(|x| x.volid == file && x.node.as_deref().is_none_or(|n| n == node))
                {
                    return Err(SimError::e500(format!("volume '{file}' does not exist")));
                }
            }
            new_config.insert(k.clone(), value);
        }
        Ok(new_config)
    }

    /// A NIC value as Proxmox writes it: `model=MAC` first (a new MAC when none is given),
    /// then the other options.
    fn net_value(&mut self, v: &str) -> String {
        let dev = NetDevice::parse(0, v);
        let mac = dev
            .mac
            .clone()
            .map(|m| m.to_ascii_uppercase())
            .unwrap_or_else(|| self.mac());
        let model = if dev.model.is_empty() {
            "virtio".to_string()
        } else {
            dev.model.clone()
        };
        let mut out = format!("{model}={mac}");
        for part in v.split(',') {
            if let Some((pk, _)) = part.split_once('=')
                && !["model", "macaddr"].contains(&pk)
                && pk != dev.model
            {
                out.push(',');
                out.push_str(part);
            }
        }
        out
    }

    /// `POST .../clone`.
    pub fn clone_vm(
        &mut self,
        now: Instant,
        node: &str,
        vmid: u32,
        params: &BTreeMap<String, String>,
    ) -> SimResult<Upid> {
        let src = self.vm_on(node, vmid)?.clone();
        let newid: u32 = match params.get("newid") {
            None => {
                return Err(SimError::param(
                    "newid",
                    "property is missing and it is not optional",
                ));
            }
            Some(v) => v
                .parse()
                .ok()
                .filter(|i| (100..=999_999_999).contains(i))
                .ok_or_else(|| {
                    SimError::param(
                        "newid",
                        "invalid format - value does not look like a valid VM ID",
                    )
                })?,
        };
        if let Some(name) = params.get("name")
            && !is_dns_name(name)
        {
            return Err(SimError::param(
                "name",
                "invalid format - value does not look like a valid DNS name",
            ));
        }
        if let Some(lock) = src.lock() {
            return Err(SimError::e500(format!("VM is locked ({lock})")));
        }
        // a running (non-template) source is locked exclusively while it is cloned
        if src.running && self.flock_held(vmid) {
            return Err(Self::flock_timeout(vmid));
        }
        if let Some(existing) = self.vms.get(&newid) {
            return Err(if existing.node == node {
                SimError::e500(format!(
                    "unable to create VM {newid}: config file already exists"
                ))
            } else {
                SimError::e500(format!(
                    "unable to create VM {newid} - VM {newid} already exists on node '{}'",
                    existing.node
                ))
            });
        }
        let is_template = src.is_template();
        let full = match params.get("full").map(String::as_str) {
            Some("1") => true,
            Some("0") | None => !is_template,
            Some(other) => {
                return Err(SimError::param(
                    "full",
                    format!("type check ('boolean') failed - got '{other}'"),
                ));
            }
        };
        if !full && !is_template {
            return Err(SimError::e500(
                "Linked clone feature for VM is only available for templates",
            ));
        }
        if !full {
            for f in ["storage", "format"] {
                if params.contains_key(f) {
                    return Err(SimError::param(
                        f,
                        format!("parameter '{f}' not allowed for linked clones"),
                    ));
                }
            }
        }
        let target = params.get("target").filter(|t| *t != node).cloned();
        if let Some(t) = &target {
            self.node_checked(t)?;
            let local = src
                .volume_storages()
                .iter()
                .any(|st| !self.storages.get(st).is_some_and(|s| s.shared));
            if local {
                return Err(SimError::e500(format!(
                    "can't clone VM to node '{t}' (VM uses local storage)"
                )));
            }
        }
        let dest_node = target.clone().unwrap_or_else(|| node.to_string());
        if let Some(st) = params.get("storage") {
            let s = self.storage_on(&dest_node, st)?;
            if !s.content.iter().any(|c| c == "images") {
                return Err(SimError::e500(format!(
                    "storage '{st}' does not support vm images"
                )));
            }
            if target.is_some() && !s.shared {
                return Err(SimError::e500(format!(
                    "can't clone to non-shared storage '{st}'"
                )));
            }
        }
        if let Some(p) = params.get("pool")
            && !self.pools.contains_key(p)
        {
            return Err(SimError::e500(format!("pool '{p}' does not exist")));
        }
        // Build the clone's config: drop template/unused/lock, new MACs and SMBIOS UUID, new disks.
        let mut config: BTreeMap<String, String> = src
            .config
            .iter()
            .filter(|(k, _)| {
                !matches!(k.as_str(), "template" | "lock" | "meta") && !k.starts_with("unused")
            })
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        config.insert(
            "name".into(),
            params.get("name").cloned().unwrap_or_else(|| {
                format!(
                    "Copy-of-VM-{}",
                    src.config
                        .get("name")
                        .cloned()
                        .unwrap_or_else(|| vmid.to_string())
                )
            }),
        );
        if let Some(d) = params.get("description") {
            config.insert("description".into(), d.clone());
        }
        let nets: Vec<(String, String)> = config
            .iter()
            .filter(|(k, _)| is_indexed(k, "net"))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        for (k, v) in nets {
            let dev = NetDevice::parse(0, &v);
            let mac = self.mac();
            let rest: Vec<&str> = v
                .split(',')
                .skip(1)
                .filter(|p| !p.starts_with("macaddr="))
                .collect();
            let mut s = format!(
                "{}={mac}",
                if dev.model.is_empty() {
                    "virtio"
                } else {
                    &dev.model
                }
            );
            for r in rest {
                s.push(',');
                s.push_str(r);
            }
            config.insert(k, s);
        }
        if self.opts.clone_smbios_uuid {
            let uuid = self.uuid();
            config.insert("smbios1".into(), format!("uuid={uuid}"));
        } else if let Some(smbios1) = config.remove("smbios1") {
            let kept: Vec<&str> = smbios1
                .split(',')
                .filter(|part| !part.trim().starts_with("uuid="))
                .collect();
            if !kept.is_empty() {
                config.insert("smbios1".into(), kept.join(","));
            }
        }
        config.insert("meta".into(), "creation-qemu=9.0.2,ctime=1767225600".into());
        let mut new_volumes = Vec::new();
        for (i, (key, value)) in src.disks().into_iter().enumerate() {
            let props = parse_property_string(&value, "file");
            let file = props.get("file").cloned().unwrap_or_default();
            let src_storage = file.split(':').next().unwrap_or_default().to_string();
            let dst_storage = params
                .get("storage")
                .cloned()
                .unwrap_or(src_storage.clone());
            let volname = format!("vm-{newid}-disk-{i}");
            let volid = if full {
                format!("{dst_storage}:{volname}")
            } else {
                format!(
                    "{src_storage}:{}/{volname}",
                    file.split(':').nth(1).unwrap_or_default()
                )
            };
            let size = props.get("size").cloned().unwrap_or_else(|| "0".into());
            config.insert(key, format!("{volid},size={size}"));
            let shared = self.storages.get(&dst_storage).is_some_and(|s| s.shared);
            new_volumes.push(Volume {
                storage: if full {
                    dst_storage.clone()
                } else {
                    src_storage.clone()
                },
                node: (!shared).then(|| dest_node.clone()),
                volid,
                content: "images".into(),
                size: parse_size(&size).unwrap_or(0),
                ctime: self.epoch,
                vmid: Some(newid),
                data: None,
                format: None,
            });
        }
        config.insert("lock".into(), "clone".into());
        self.vms.insert(
            newid,
            Vm {
                node: node.to_string(),
                config,
                running: false,
                started_at: None,
                pool: None,
                changed_at: Some(now),
                booted: None,
                boots: 0,
                hung: false,
                pci: Vec::new(),
            },
        );
        self.volumes.extend(new_volumes);
        Ok(self.new_task(
            now,
            node,
            "qmclone",
            &vmid.to_string(),
            Ok(()),
            Effect::CloneDone {
                newid,
                target,
                pool: params.get("pool").cloned(),
            },
            None,
        ))
    }

    /// `PUT .../resize`: all checks happen inside the task (like PVE ≥ 8).
    pub fn resize(
        &mut self,
        now: Instant,
        node: &str,
        vmid: u32,
        params: &BTreeMap<String, String>,
    ) -> SimResult<Upid> {
        self.node_checked(node)?;
        let disk = params
            .get("disk")
            .cloned()
            .ok_or_else(|| SimError::param("disk", "property is missing and it is not optional"))?;
        let size = params
            .get("size")
            .cloned()
            .ok_or_else(|| SimError::param("size", "property is missing and it is not optional"))?;
        let (relative, amount) = match size.strip_prefix('+') {
            Some(rest) => (true, rest.to_string()),
            None => (false, size.clone()),
        };
        let amount = parse_size(&amount)
            .ok_or_else(|| SimError::param("size", "value does not match the regex pattern"))?;
        let mut bytes = 0;
        let outcome: Result<(), String> =
            (|| {
                let vm = self.vms.get(&vmid).filter(|v| v.node == node).ok_or_else(|| {
                format!("Configuration file 'nodes/{node}/qemu-server/{vmid}.conf' does not exist")
            })?;
                if let Some(lock) = vm.lock() {
                    return Err(format!("VM is locked ({lock})"));
                }
                if let Some(d) = params.get("digest")
                    && *d != vm.digest()
                {
                    return Err("checksum mismatch (file change by other user?)".to_string());
                }
                let value = vm
                    .config
                    .get(&disk)
                    .ok_or_else(|| format!("disk '{disk}' does not exist"))?;
                if value.contains("media=cdrom") {
                    return Err("you can't resize a cdrom".to_string());
                }
                let current = parse_property_string(value, "file")
                    .get("size")
                    .and_then(|s| parse_size(s))
                    .unwrap_or(0);
                bytes = if relative { current + amount } else { amount };
                if bytes < current {
                    return Err("shrinking disks is not supported".to_string());
                }
                Ok(())
            })();
        Ok(self.new_task(
            now,
            node,
            "resize",
            &vmid.to_string(),
            outcome,
            Effect::Resize { vmid, disk, bytes },
            None,
        ))
    }

    /// `GET .../status/current`.
    pub fn vm_status(&self, now: Instant, node: &str, vmid: u32) -> SimResult<Value> {
        let vm = self.vm_on(node, vmid)?;
        let uptime = vm
            .started_at
            .map(|s| now.saturating_duration_since(s).as_secs())
            .unwrap_or(0);
        let mut r = json!({
            "vmid": vmid, "status": if vm.running {"running"} else {"stopped"},
            "qmpstatus": if vm.running {"running"} else {"stopped"},
            "cpus": vm.cpus(), "maxmem": vm.memory_bytes(), "maxdisk": vm.boot_disk_size(),
            "mem": if vm.running { vm.memory_bytes() / 2 } else { 0 }, "cpu": 0, "disk": 0,
            "uptime": uptime, "netin": 0, "netout": 0, "diskread": 0, "diskwrite": 0,
            "ha": self.ha_status_of(vmid),
        });
        for key in ["name", "lock", "tags"] {
            if let Some(v) = vm.config.get(key) {
                r[key] = json!(v);
            }
        }
        if vm.is_template() {
            r["template"] = json!(1);
        }
        if agent_enabled(vm) {
            r["agent"] = json!(1);
        }
        if vm.running {
            r["pid"] = json!(10_000 + vmid);
            r["running-machine"] = json!("pc-i440fx-9.0+pve0");
            r["running-qemu"] = json!("9.0.2");
        }
        Ok(r)
    }

    /// `POST .../status/{start|stop|shutdown|resume}`.
    pub fn power(&mut self, now: Instant, node: &str, vmid: u32, action: &str) -> SimResult<Upid> {
        let vm = self.vm_on(node, vmid)?;
        let outcome = match action {
            "start" => {
                if vm.is_template() {
                    Err("you can't start a vm if it's a template".to_string())
                } else if let Some(l) = vm.lock() {
                    Err(format!("VM is locked ({l})"))
                } else if vm.running {
                    Err(format!("VM {vmid} already running"))
                } else {
                    Ok(())
                }
            }
            // a stop or shutdown waits for the flock a reboot or reset holds, and times out
            "stop" | "shutdown" if self.restart_running(vmid) => {
                Err(Self::flock_timeout(vmid).reason)
            }
            "stop" => vm
                .lock()
                .filter(|l| *l != "suspended")
                .map_or(Ok(()), |l| Err(format!("VM is locked ({l})"))),
            "shutdown" => {
                if let Some(l) = vm.lock() {
                    Err(format!("VM is locked ({l})"))
                } else if !vm.running {
                    Err(format!("VM {vmid} not running"))
                } else {
                    Ok(())
                }
            }
            "resume" => {
                if vm.running {
                    Ok(())
                } else {
                    Err(format!("VM {vmid} not running"))
                }
            }
            other => {
                return Err(SimError {
                    status: 501,
                    reason: format!(
                        "Method 'POST /nodes/{node}/qemu/{vmid}/status/{other}' not implemented"
                    ),
                    errors: BTreeMap::new(),
                });
            }
        };
        let outcome = match outcome {
            Ok(()) if action == "start" => self.reserve_pci(vmid),
            other => other,
        };
        self.ha_power_request(vmid, action);
        let (kind, effect) = match action {
            "start" => ("qmstart", Effect::Start { vmid }),
            "stop" => ("qmstop", Effect::Stop { vmid }),
            "shutdown" => ("qmshutdown", Effect::Stop { vmid }),
            _ => ("qmresume", Effect::None),
        };
        Ok(self.new_task(now, node, kind, &vmid.to_string(), outcome, effect, None))
    }

    /// `DELETE /nodes/{node}/qemu/{vmid}[?purge=1]`: an HA-managed VM needs `purge`, which
    /// also removes its HA resource when the task ends.
    pub fn delete_vm(
        &mut self,
        now: Instant,
        node: &str,
        vmid: u32,
        purge: bool,
    ) -> SimResult<Upid> {
        let vm = self.vm_on(node, vmid)?;
        if let Some(l) = vm.lock() {
            return Err(SimError::e500(format!("VM is locked ({l})")));
        }
        if vm.config.get("protection").is_some_and(|p| p == "1") {
            return Err(SimError::e500(format!(
                "can't remove VM {vmid} - protection mode enabled"
            )));
        }
        if !purge && self.ha_managed(vmid) {
            return Err(SimError::e500(format!(
                "unable to remove VM {vmid} - used in HA resources and purge parameter not set."
            )));
        }
        if vm.running {
            return Err(SimError::e500(format!(
                "VM {vmid} is running - destroy failed"
            )));
        }
        if let Some(vm) = self.vms.get_mut(&vmid) {
            vm.config.insert("lock".into(), "destroyed".into());
        }
        Ok(self.new_task(
            now,
            node,
            "qmdestroy",
            &vmid.to_string(),
            Ok(()),
            Effect::Delete { vmid, purge },
            None,
        ))
    }

    // ---------------------------------------------------------------- storage

    /// `GET /nodes/{node}/storage[?content=]`.
    pub fn list_storage(&self, node: &str, content: Option<&str>) -> SimResult<Value> {
        self.node_checked(node)?;
        Ok(Value::Array(
            self.storages
                .values()
                .filter(|s| s.nodes.is_empty() || s.nodes.iter().any(|n| n == node))
                .filter(|s| content.is_none_or(|c| c.split(',').all(|c| s.content.iter().any(|x| x == c))))
                .map(|s| {
                    let total = s.size_gib << 30;
                    let used = self.storage_used(&s.name, node);
                    let active = u8::from(self.storage_active(&s.name, node));
                    json!({"storage": s.name, "type": s.kind, "content": s.content.join(","), "active": active, "enabled": 1,
                           "shared": u8::from(s.shared), "total": total, "used": used, "avail": total.saturating_sub(used),
                           "used_fraction": used as f64 / total.max(1) as f64})
                })
                .collect(),
        ))
    }

    /// `GET .../storage/{storage}/content[?content=&vmid=]`.
    pub fn storage_content(
        &self,
        node: &str,
        storage: &str,
        content: Option<&str>,
        vmid: Option<&str>,
    ) -> SimResult<Value> {
        self.node_checked(node)?;
        self.storage_on(node, storage)?;
        Ok(Value::Array(
            self.volumes
                .iter()
                .filter(|v| v.storage == storage && v.node.as_deref().is_none_or(|n| n == node))
                .filter(|v| content.is_none_or(|c| v.content == c))
                .filter(|v| vmid.is_none_or(|id| v.vmid.map(|x| x.to_string()).as_deref() == Some(id)))
                .map(|v| {
                    let format = v.format.as_deref().unwrap_or(if v.content == "iso" { "iso" } else { "raw" });
                    let mut r = json!({"volid": v.volid, "content": v.content, "format": format, "size": v.size, "ctime": v.ctime});
                    if let Some(id) = v.vmid {
                        r["vmid"] = json!(id);
                    }
                    r
                })
                .collect(),
        ))
    }

    /// `GET .../storage/{storage}/content/{volume}`: a volume's attributes, as clients read
    /// before deleting an ISO they uploaded (`volume` is a volid or a name on `storage`).
    pub fn volume_attributes(&self, node: &str, storage: &str, volume: &str) -> SimResult<Value> {
        self.node_checked(node)?;
        let spec = self.storage_on(node, storage)?;
        let volid = if volume.contains(':') {
            volume.to_string()
        } else {
            format!("{storage}:{volume}")
        };
        let v = self
            .volumes
            .iter()
            .find(|v| v.volid == volid && v.node.as_deref().is_none_or(|n| n == node))
            .ok_or_else(|| SimError::e500(format!("volume '{volid}' does not exist")))?;
        let name = volid.split_once(':').map_or(volid.as_str(), |(_, n)| n);
        let path = match spec.kind.as_str() {
            "dir" | "nfs" | "cifs" => {
                let file = name.rsplit('/').next().unwrap_or(name);
                let sub = match (v.content.as_str(), v.vmid) {
                    ("iso", _) => "template/iso".to_string(),
                    ("vztmpl", _) => "template/cache".to_string(),
                    ("snippets", _) => "snippets".to_string(),
                    (_, Some(id)) => format!("images/{id}"),
                    _ => "images".to_string(),
                };
                let root = if storage == "local" {
                    "/var/lib/vz".to_string()
                } else {
                    format!("/mnt/pve/{storage}")
                };
                format!("{root}/{sub}/{file}")
            }
            "lvmthin" | "lvm" => format!("/dev/pve/{name}"),
            "zfspool" => format!("/dev/zvol/rpool/data/{name}"),
            _ => format!("{storage}:{name}"),
        };
        let format = v
            .format
            .as_deref()
            .unwrap_or(if v.content == "iso" { "iso" } else { "raw" });
        Ok(json!({"path": path, "size": v.size, "used": v.size, "format": format}))
    }

    /// `POST .../storage/{storage}/upload` after the multipart body was parsed.
    pub fn upload(
        &mut self,
        now: Instant,
        node: &str,
        storage: &str,
        content: &str,
        filename: &str,
        data: Vec<u8>,
    ) -> SimResult<Upid> {
        self.node_checked(node)?;
        let s = self.storage_on(node, storage)?.clone();
        if content != "iso" && content != "vztmpl" && content != "import" {
            return Err(SimError::param(
                "content",
                format!(
                    "value '{content}' does not have a value in the enumeration 'iso, vztmpl, import'"
                ),
            ));
        }
        if !s.content.iter().any(|c| c == content) {
            return Err(SimError::e500(format!(
                "storage '{storage}' does not support content type '{content}'"
            )));
        }
        let base = filename.rsplit(['/', '\\']).next().unwrap_or(filename);
        let name: String = base
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || "_.-".contains(c) {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        if content == "iso" && !(name.ends_with(".iso") || name.ends_with(".img")) {
            return Err(SimError::param("filename", "wrong file extension"));
        }
        let volid = format!("{storage}:{content}/{name}");
        let vol = Volume {
            storage: storage.to_string(),
            node: (!s.shared).then(|| node.to_string()),
            volid: volid.clone(),
            content: content.to_string(),
            size: data.len() as u64,
            ctime: self.epoch,
            vmid: None,
            data: Some(Arc::new(data)),
            format: None,
        };
        Ok(self.new_task(
            now,
            node,
            "imgcopy",
            "",
            Ok(()),
            Effect::AddVolume(Box::new(vol)),
            Some(volid),
        ))
    }

    /// `DELETE .../storage/{storage}/content/{volume}`.
    pub fn delete_volume(
        &mut self,
        now: Instant,
        node: &str,
        storage: &str,
        volume: &str,
    ) -> SimResult<Upid> {
        self.node_checked(node)?;
        self.storage_on(node, storage)?;
        let volid = if volume.contains(':') {
            volume.to_string()
        } else {
            format!("{storage}:{volume}")
        };
        if !self
            .volumes
            .iter()
            .any(|v| v.volid == volid && v.node.as_deref().is_none_or(|n| n == node))
        {
            return Err(SimError::e500(format!("volume '{volid}' does not exist")));
        }
        Ok(self.new_task(
            now,
            node,
            "imgdel",
            "",
            Ok(()),
            Effect::RemoveVolume {
                volid: volid.clone(),
                node: node.to_string(),
            },
            Some(volid),
        ))
    }

    // ---------------------------------------------------------------- tasks

    /// `GET /nodes/{node}/tasks/{upid}/status`.
    pub fn task_status(&self, node: &str, upid: &str) -> SimResult<Value> {
        let t = self.task(node, upid)?;
        let u = &t.upid;
        let mut r = json!({"upid": u.as_str(), "node": u.node, "pid": u.pid, "pstart": u.pstart, "starttime": u.starttime,
                           "type": u.task_type, "id": u.id, "user": u.user.split('!').next().unwrap_or_default(),
                           "status": if t.done {"stopped"} else {"running"}});
        if let Some((_, tok)) = u.user.split_once('!') {
            r["tokenid"] = json!(tok);
        }
        if t.done {
            r["exitstatus"] = json!(match &t.outcome {
                Ok(()) => "OK".to_string(),
                Err(e) => e.clone(),
            });
        }
        Ok(r)
    }

    /// `GET /nodes/{node}/tasks`: the node's tasks, newest first, as Proxmox lists them
    /// (`source` `archive`: ended ones, `active`: running ones, `all`: both; `since` and
    /// `until` bound the start time; `vmid`, `typefilter` and `errors` filter; `start` and
    /// `limit` page) → (tasks, total before paging).
    pub fn node_tasks(&self, node: &str, query: &TaskQuery) -> SimResult<(Value, usize)> {
        self.node_checked(node)?;
        let mut listed: Vec<&Task> = self
            .tasks
            .values()
            .filter(|t| t.upid.node == node && query.admits(t))
            .collect();
        listed.sort_by(|a, b| {
            (b.upid.starttime, b.created, b.upid.as_str()).cmp(&(
                a.upid.starttime,
                a.created,
                a.upid.as_str(),
            ))
        });
        let total = listed.len();
        let entries = listed
            .into_iter()
            .skip(query.start)
            .take(query.limit)
            .map(|t| {
                let u = &t.upid;
                // Unlike a task's status, the list names a token's tasks by the whole token id.
                let mut entry = json!({"upid": u.as_str(), "node": u.node, "pid": u.pid,
                    "pstart": u.pstart, "starttime": u.starttime, "type": u.task_type,
                    "id": u.id, "user": u.user});
                if let (true, Some(end)) = (t.done, t.end()) {
                    let ran = end.saturating_duration_since(t.created).as_secs();
                    entry["endtime"] = json!(u.starttime + ran);
                    entry["status"] = json!(match &t.outcome {
                        Ok(()) => "OK",
                        Err(e) => e.as_str(),
                    });
                }
                entry
            })
            .collect();
        Ok((Value::Array(entries), total))
    }

    /// `GET /nodes/{node}/tasks/{upid}/log` → (lines, total).
    pub fn task_log(
        &self,
        node: &str,
        upid: &str,
        start: usize,
        limit: usize,
    ) -> SimResult<(Value, usize)> {
        let t = self.task(node, upid)?;
        let lines: Vec<Value> = t
            .log
            .iter()
            .enumerate()
            .skip(start)
            .take(limit)
            .map(|(i, l)| json!({"n": i + 1, "t": l}))
            .collect();
        Ok((Value::Array(lines), t.log.len()))
    }

    fn task(&self, node: &str, upid: &str) -> SimResult<&Task> {
        if upid.parse::<Upid>().is_err() {
            return Err(SimError::param("upid", "unable to parse worker upid"));
        }
        self.node_checked(node)?;
        self.tasks
            .get(upid)
            .filter(|t| t.upid.node == node)
            .ok_or_else(|| SimError::param("upid", "no such task"))
    }

    // ---------------------------------------------------------------- agent

    fn agent_vm(&self, now: Instant, node: &str, vmid: u32) -> SimResult<&Vm> {
        let vm = self.vm_on(node, vmid)?;
        if !agent_enabled(vm) {
            return Err(SimError::e500("No QEMU guest agent configured"));
        }
        if !vm.running {
            return Err(SimError::e500(format!("VM {vmid} is not running")));
        }
        let booted = vm
            .started_at
            .is_some_and(|s| now >= s + self.opts.boot_delay);
        // a hung guest's agent does not answer PVE's guest-ping either
        if !booted || vm.hung {
            return Err(SimError::e500("QEMU guest agent is not running"));
        }
        Ok(vm)
    }

    /// `POST .../agent/ping`.
    pub fn agent_ping(&self, now: Instant, node: &str, vmid: u32) -> SimResult<Value> {
        self.agent_vm(now, node, vmid)?;
        Ok(json!({"result": {}}))
    }

    /// `GET .../agent/get-osinfo`.
    pub fn agent_osinfo(&self, now: Instant, node: &str, vmid: u32) -> SimResult<Value> {
        let vm = self.agent_vm(now, node, vmid)?;
        if self.guest_os(vm) == GuestOs::Flatcar {
            return Ok(
                json!({"result": {"id": "flatcar", "name": "Flatcar Container Linux by Kinvolk", "pretty-name": "Flatcar Container Linux by Kinvolk 4230.2.1 (Oklo)",
                                 "version": "4230.2.1", "version-id": "4230.2.1", "kernel-release": "6.6.95-flatcar", "kernel-version": "#1 SMP", "machine": "x86_64"}}),
            );
        }
        Ok(
            json!({"result": {"id": "ubuntu", "name": "Ubuntu", "pretty-name": "Ubuntu 24.04.2 LTS", "version": "24.04.2 LTS (Noble Numbat)",
                             "version-id": "24.04", "kernel-release": "6.8.0-60-generic", "kernel-version": "#63-Ubuntu SMP", "machine": "x86_64"}}),
        )
    }

    /// The NoCloud seed attached as a CD-ROM, if any.
    fn seed_iso(&self, vm: &Vm) -> Option<IsoImage> {
        self.seed_bytes(vm)
            .filter_map(|data| IsoImage::parse(data).ok())
            .next()
    }

    /// The bytes of every ISO image attached to `vm` as a CD-ROM.
    fn seed_bytes<'a>(&'a self, vm: &'a Vm) -> impl Iterator<Item = &'a [u8]> + 'a {
        vm.config
            .iter()
            .filter(|(k, v)| is_disk_key(k) && v.contains("media=cdrom"))
            .filter_map(|(_, v)| {
                let file = v.split(',').next()?;
                self.volumes
                    .iter()
                    .find(|x| x.volid == file && x.node.as_deref().is_none_or(|n| n == vm.node))
            })
            .filter_map(|vol| vol.data.as_deref().map(Vec::as_slice))
    }

    /// The image attached to VM `vmid` as a CD-ROM (its seed), for tests to read back.
    pub fn attached_seed_image(&self, vmid: u32) -> Option<Vec<u8>> {
        let vm = self.vms.get(&vmid)?;
        self.seed_bytes(vm).next().map(<[u8]>::to_vec)
    }

    /// What runs in VM `vmid` (what its last start booted), if it was started.
    pub fn booted_os(&self, vmid: u32) -> Option<GuestOs> {
        self.vms.get(&vmid)?.booted
    }

    /// Whether VM `vmid` runs; `None` when there is no such VM.
    pub fn vm_running(&self, vmid: u32) -> Option<bool> {
        Some(self.vms.get(&vmid)?.running)
    }

    /// What runs in `vm`: what its last start booted, else what its seed would boot.
    fn guest_os(&self, vm: &Vm) -> GuestOs {
        vm.booted.unwrap_or_else(|| self.seed_os(vm))
    }

    /// What `vm`'s seed boots: Flatcar when it carries an Ignition config, else Ubuntu.
    fn seed_os(&self, vm: &Vm) -> GuestOs {
        self.seed_iso(vm)
            .map_or(GuestOs::Ubuntu, |seed| GuestOs::of(&seed))
    }

    /// `GET .../agent/network-get-interfaces`: NICs with the VM's MACs (lower-case) and the
    /// static addresses the guest read from its seed ISO (see [`crate::guest::nic_setups`]), or
    /// `ipconfigN` as a fallback, then its DHCP leases (module `dhcp`) and a link-local one.
    pub fn agent_interfaces(&self, now: Instant, node: &str, vmid: u32) -> SimResult<Value> {
        let vm = self.agent_vm(now, node, vmid)?;
        let mut result = vec![
            json!({"name": "lo", "hardware-address": "00:00:00:00:00:00",
            "ip-addresses": [{"ip-address": "127.0.0.1", "ip-address-type": "ipv4", "prefix": 8},
                             {"ip-address": "::1", "ip-address-type": "ipv6", "prefix": 128}],
            "statistics": stats()}),
        ];
        for (ifname, nic) in self.guest_nics(vm) {
            let mut addrs: Vec<Value> = nic
                .setup
                .addresses
                .iter()
                .chain(&self.dhcp_addresses(vmid, &nic))
                .filter_map(|a| addr_json(a))
                .collect();
            addrs.push(json!({"ip-address": format!("fe80::{:x}", 0x1000 + nic.index), "ip-address-type": "ipv6", "prefix": 64}));
            result.push(json!({"name": ifname, "hardware-address": nic.mac, "ip-addresses": addrs, "statistics": stats()}));
        }
        Ok(json!({"result": result}))
    }

    /// `POST .../agent/exec`.
    pub fn agent_exec(
        &mut self,
        now: Instant,
        node: &str,
        vmid: u32,
        command: &[String],
    ) -> SimResult<Value> {
        let vm = self.agent_vm(now, node, vmid)?;
        // Flatcar has no cloud-init: the command is not found there.
        let flatcar = self.guest_os(vm) == GuestOs::Flatcar;
        if command.is_empty() {
            return Err(SimError::param(
                "command",
                "property is missing and it is not optional",
            ));
        }
        let pid = 2000 + self.next_counter();
        let exits_at = now + self.opts.guest_command_duration;
        let is_ci_status = !flatcar
            && command.first().is_some_and(|c| c.ends_with("cloud-init"))
            && command.get(1).is_some_and(|c| c == "status");
        let exec = if is_ci_status {
            match &self.opts.cloud_init_failure {
                None => Exec {
                    exits_at,
                    exitcode: 0,
                    out: "status: done\n".into(),
                    err: String::new(),
                },
                Some(e) => Exec {
                    exits_at,
                    exitcode: 1,
                    out: "status: error\n".into(),
                    err: format!("{e}\n"),
                },
            }
        } else {
            Exec {
                exits_at,
                exitcode: 127,
                out: String::new(),
                err: format!("{}: command not found\n", command[0]),
            }
        };
        self.execs.insert((vmid, pid), exec);
        Ok(json!({"pid": pid}))
    }

    /// `GET .../agent/exec-status?pid=`: still running until the command's duration
    /// (`SimOptions::guest_command_duration`) is over, then the result.
    pub fn agent_exec_status(
        &mut self,
        now: Instant,
        node: &str,
        vmid: u32,
        pid: Option<&str>,
    ) -> SimResult<Value> {
        self.agent_vm(now, node, vmid)?;
        let pid: u64 = pid
            .and_then(|p| p.parse().ok())
            .ok_or_else(|| SimError::param("pid", "property is missing and it is not optional"))?;
        let exec = self
            .execs
            .get(&(vmid, pid))
            .ok_or_else(|| SimError::e500("Agent error: Invalid parameter 'pid'"))?;
        if now < exec.exits_at {
            return Ok(json!({"exited": 0}));
        }
        let mut r = json!({"exited": 1, "exitcode": exec.exitcode});
        if !exec.out.is_empty() {
            r["out-data"] = json!(exec.out);
        }
        if !exec.err.is_empty() {
            r["err-data"] = json!(exec.err);
        }
        Ok(r)
    }

    /// `GET .../agent/file-read?file=`: of the guest's files, only cloud-init's result file
    /// exists (once the agent answers, cloud-init is done), and not in a Flatcar guest.
    pub fn agent_file_read(
        &self,
        now: Instant,
        node: &str,
        vmid: u32,
        file: Option<&str>,
    ) -> SimResult<Value> {
        let vm = self.agent_vm(now, node, vmid)?;
        let file = file
            .ok_or_else(|| SimError::param("file", "property is missing and it is not optional"))?;
        let missing = || {
            SimError::e500(format!(
                "VM {vmid} qga command 'guest-file-open' failed - failed to open file '{file}' (mode: 'r'): No such file or directory"
            ))
        };
        if file != CLOUD_INIT_RESULT || self.guest_os(vm) == GuestOs::Flatcar {
            return Err(missing());
        }
        let errors: Vec<&str> = self
            .opts
            .cloud_init_failure
            .iter()
            .map(String::as_str)
            .collect();
        let result = json!({"v1": {
            "datasource": "DataSourceNoCloud [seed=/dev/sr0]",
            "errors": errors,
            "recoverable_errors": {},
        }});
        Ok(json!({"content": format!("{result:#}\n")}))
    }

    // ---------------------------------------------------------------- pools

    /// `GET /pools[?poolid=]`.
    pub fn pools(&self, now: Instant, poolid: Option<&str>) -> SimResult<Value> {
        match poolid {
            None => Ok(Value::Array(
                self.pools
                    .iter()
                    .map(|(p, c)| {
                        let mut r = json!({"poolid": p});
                        if let Some(c) = c {
                            r["comment"] = json!(c);
                        }
                        r
                    })
                    .collect(),
            )),
            Some(id) => {
                let comment = self
                    .pools
                    .get(id)
                    .ok_or_else(|| SimError::e500(format!("pool '{id}' does not exist")))?;
                let members: Vec<Value> = self
                    .vms
                    .iter()
                    .filter(|(_, v)| v.pool.as_deref() == Some(id))
                    .map(|(vmid, vm)| self.vm_resource(now, *vmid, vm))
                    .collect();
                let mut r = json!({"poolid": id, "members": members});
                if let Some(c) = comment {
                    r["comment"] = json!(c);
                }
                Ok(json!([r]))
            }
        }
    }

    /// `POST /pools`.
    pub fn create_pool(&mut self, poolid: &str, comment: Option<&str>) -> SimResult<()> {
        if self.pools.contains_key(poolid) {
            return Err(SimError::e500(format!(
                "create pool failed: error during cfs-locked 'file-user_cfg' operation: pool '{poolid}' already exists"
            )));
        }
        self.pools
            .insert(poolid.to_string(), comment.map(str::to_string));
        Ok(())
    }

    /// `PUT /pools`: add or remove VMs.
    pub fn update_pool(&mut self, poolid: &str, vms: Option<&str>, remove: bool) -> SimResult<()> {
        if !self.pools.contains_key(poolid) {
            return Err(SimError::e500(format!("pool '{poolid}' does not exist")));
        }
        for id in vms
            .unwrap_or_default()
            .split([',', ';', ' '])
            .filter(|s| !s.is_empty())
        {
            let vmid: u32 = id.parse().map_err(|_| {
                SimError::param(
                    "vms",
                    format!("invalid format - value '{id}' does not look like a valid VM ID"),
                )
            })?;
            let vm = self
                .vms
                .get_mut(&vmid)
                .ok_or_else(|| SimError::e500(format!("no such VMID '{vmid}'")))?;
            if remove {
                if vm.pool.as_deref() == Some(poolid) {
                    vm.pool = None;
                }
            } else if vm.pool.as_deref().is_some_and(|p| p != poolid) {
                return Err(SimError::e500(format!(
                    "VM {vmid} belongs already to pool '{}' and allow-move is not set",
                    vm.pool.clone().unwrap_or_default()
                )));
            } else {
                vm.pool = Some(poolid.to_string());
            }
        }
        Ok(())
    }

    /// Number of VMs (for tests and benchmarks).
    pub fn vm_count(&self) -> usize {
        self.vms.len()
    }

    /// Number of ISO images on any storage (seed images left behind show up here).
    pub fn iso_count(&self) -> usize {
        self.volumes.iter().filter(|v| v.content == "iso").count()
    }

    /// Node of a VM, if it exists.
    pub fn vm_node(&self, vmid: u32) -> Option<String> {
        self.vms.get(&vmid).map(|v| v.node.clone())
    }

    /// Node capacity (for the scheduler tests): (memory bytes, cores).
    pub fn node_capacity(&self, node: &str) -> Option<(u64, u32)> {
        self.nodes.get(node).map(|n| (n.memory, n.cores))
    }

    /// Sets a lock on a VM (to simulate a backup or a crashed task).
    pub fn set_lock(&mut self, vmid: u32, lock: Option<&str>) -> bool {
        match self.vms.get_mut(&vmid) {
            Some(vm) => {
                match lock {
                    Some(l) => vm.config.insert("lock".into(), l.into()),
                    None => vm.config.remove("lock"),
                };
                true
            }
            None => false,
        }
    }

    /// Marks a node online or offline.
    pub fn set_node_online(&mut self, node: &str, online: bool) -> bool {
        self.nodes
            .get_mut(node)
            .map(|n| n.online = online)
            .is_some()
    }

    /// Marks a storage active or not as `node` sees it (a lost NFS mount, a Ceph pool down).
    pub fn set_storage_active(&mut self, storage: &str, node: &str, active: bool) -> bool {
        if !self.storages.contains_key(storage) || !self.nodes.contains_key(node) {
            return false;
        }
        let key = (storage.to_owned(), node.to_owned());
        if active {
            self.inactive_storages.remove(&key);
        } else {
            self.inactive_storages.insert(key);
        }
        true
    }

    /// Lists `storage` on `node` as `percent` used now (at least: what its volumes take
    /// counts too), by putting other data beside its volumes: volumes allocated or freed
    /// later add to that or take from it.
    pub fn fill_storage(&mut self, storage: &str, node: &str, percent: u64) -> bool {
        let Some(size) = self.storages.get(storage).map(|s| s.size_gib << 30) else {
            return false;
        };
        if !self.nodes.contains_key(node) {
            return false;
        }
        let wanted = size.saturating_mul(percent.min(100)).div_ceil(100);
        let other = wanted.saturating_sub(self.volume_bytes(storage, node));
        self.filled_storages
            .insert((storage.to_owned(), node.to_owned()), other);
        true
    }
}

fn stats() -> Value {
    json!({"rx-bytes": 0, "rx-packets": 0, "rx-errs": 0, "rx-dropped": 0, "tx-bytes": 0, "tx-packets": 0, "tx-errs": 0, "tx-dropped": 0})
}

fn addr_json(cidr: &str) -> Option<Value> {
    let (ip, prefix) = cidr.split_once('/')?;
    let prefix: u32 = prefix.parse().ok()?;
    let kind = if ip.parse::<std::net::Ipv4Addr>().is_ok() {
        "ipv4"
    } else if ip.parse::<std::net::Ipv6Addr>().is_ok() {
        "ipv6"
    } else {
        return None;
    };
    Some(json!({"ip-address": ip, "ip-address-type": kind, "prefix": prefix}))
}

/// Reads netplan v2 (`ethernets.<name>.match.macaddress` + `addresses`), with or without a
/// top-level `network:` key. Keys: lower-case MAC and interface name.
fn agent_enabled(vm: &Vm) -> bool {
    vm.config
        .get("agent")
        .map(|a| {
            let p = parse_property_string(a, "enabled");
            p.get("enabled").is_some_and(|e| e == "1")
        })
        .unwrap_or(false)
}

fn is_indexed(k: &str, prefix: &str) -> bool {
    k.strip_prefix(prefix)
        .is_some_and(|r| !r.is_empty() && r.chars().all(|c| c.is_ascii_digit()))
}

/// Options the simulator accepts in config updates (a subset of the real schema).
fn is_config_option(k: &str) -> bool {
    const PLAIN: &[&str] = &[
        "name",
        "description",
        "cores",
        "sockets",
        "vcpus",
        "memory",
        "balloon",
        "cpu",
        "boot",
        "agent",
        "tags",
        "onboot",
        "protection",
        "ciuser",
        "cipassword",
        "sshkeys",
        "nameserver",
        "searchdomain",
        "citype",
        "cicustom",
        "ciupgrade",
        "scsihw",
        "ostype",
        "machine",
        "bios",
        "numa",
        "cdrom",
        "smbios1",
        "vga",
        "serial0",
        "hotplug",
        "kvm",
        "efidisk0",
        "tpmstate0",
    ];
    const INDEXED: &[&str] = &["net", "ipconfig", "unused", "serial", "numa", "usb"];
    PLAIN.contains(&k)
        || disks::disk_bus(k).is_some()
        || pci::hostpci_index(k).is_some()
        || INDEXED.iter().any(|p| is_indexed(k, p))
}

/// The parameter errors (400) of a config write: options outside the schema, a name that is
/// no DNS name, a malformed `smbios1`, drive options the bus lacks or an unknown format.
fn config_schema_errors(params: &BTreeMap<String, String>) -> BTreeMap<String, String> {
    const CONTROL: &[&str] = &[
        "digest",
        "delete",
        "skiplock",
        "background_delay",
        "revert",
        "force",
    ];
    let mut errors = BTreeMap::new();
    for (k, v) in params {
        if !is_config_option(k) && !CONTROL.contains(&k.as_str()) {
            errors.insert(
                k.clone(),
                "property is not defined in schema and the schema does not allow additional properties".to_string(),
            );
        } else if let Some(e) =
            disks::drive_format_error(k, v).or_else(|| pci::hostpci_format_error(k, v))
        {
            errors.insert(k.clone(), e);
        }
    }
    if let Some(name) = params.get("name")
        && !is_dns_name(name)
    {
        errors.insert(
            "name".into(),
            "invalid format - value does not look like a valid DNS name".into(),
        );
    }
    if let Some(smbios1) = params.get("smbios1")
        && !is_smbios1(smbios1)
    {
        errors.insert(
            "smbios1".into(),
            "invalid format - value does not match the regex pattern".into(),
        );
    }
    errors
}

/// Whether an `smbios1` value has Proxmox's form: known keys, and a `uuid` that is a UUID.
fn is_smbios1(value: &str) -> bool {
    const KEYS: &[&str] = &[
        "uuid",
        "base64",
        "family",
        "manufacturer",
        "product",
        "serial",
        "sku",
        "version",
    ];
    value.len() <= 512
        && value.split(',').all(|part| {
            let (key, val) = part.split_once('=').unwrap_or((part, ""));
            KEYS.contains(&key) && (key != "uuid" || is_uuid(val))
        })
}

/// Whether `text` is a UUID in its 8-4-4-4-12 hex form (any case), as qemu-server checks it.
fn is_uuid(text: &str) -> bool {
    let groups: Vec<&str> = text.split('-').collect();
    groups.len() == 5
        && groups
            .iter()
            .zip([8, 4, 4, 4, 12])
            .all(|(g, len)| g.len() == len && g.chars().all(|c| c.is_ascii_hexdigit()))
}

fn is_dns_name(name: &str) -> bool {
    !name.is_empty()
        && name.split('.').all(|label| {
            !label.is_empty()
                && label.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        })
}

fn canonical_tags(t: &str) -> String {
    let tags: BTreeSet<String> = split_tags(&t.to_ascii_lowercase()).into_iter().collect();
    tags.into_iter().collect::<Vec<_>>().join(";")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cluster() -> Cluster {
        Cluster::new(
            &Topology::example(),
            SimOptions::default(),
            Box::new(|_| false),
        )
    }

    fn p(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("10G"), Some(10 << 30));
        assert_eq!(parse_size("1.5K"), Some(1536));
        assert_eq!(format_size(10 << 30), "10G");
        assert_eq!(format_size(1536), "1536");
    }

    /// The simulator runs no containers: a node's list is empty, an unknown node's an error.
    #[test]
    fn container_lists_are_empty_on_known_nodes_only() {
        let c = cluster();
        assert_eq!(c.list_containers("pve1").expect("list"), json!([]));
        let e = c.list_containers("pve9").expect_err("unknown node");
        assert_eq!(e.status, 500);
        assert!(
            e.reason.contains("hostname lookup 'pve9' failed"),
            "{}",
            e.reason
        );
    }

    /// An uploaded ISO's attributes answer by volid or by name, with its path on the `dir`
    /// storage, its size and format; once deleted (or never there) the read fails as PVE does.
    #[tokio::test(start_paused = true)]
    async fn volume_attributes_follow_upload_and_deletion() {
        let mut c = cluster();
        let now = Instant::now();
        let data = vec![7u8; 4096];
        c.upload(now, "pve1", "local", "iso", "user-data-100.iso", data)
            .expect("upload");
        let later = now + Duration::from_secs(5);
        c.advance(later);
        let by_volid = c
            .volume_attributes("pve1", "local", "local:iso/user-data-100.iso")
            .expect("attributes");
        assert_eq!(
            by_volid,
            json!({"path": "/var/lib/vz/template/iso/user-data-100.iso", "size": 4096,
                   "used": 4096, "format": "iso"})
        );
        let by_name = c
            .volume_attributes("pve1", "local", "iso/user-data-100.iso")
            .expect("attributes by name");
        assert_eq!(by_name, by_volid);
        // Local storage: the volume is on pve1 only.
        let e = c
            .volume_attributes("pve2", "local", "local:iso/user-data-100.iso")
            .expect_err("other node");
        assert_eq!(
            e.reason,
            "volume 'local:iso/user-data-100.iso' does not exist"
        );
        c.delete_volume(later, "pve1", "local", "local:iso/user-data-100.iso")
            .expect("delete");
        c.advance(later + Duration::from_secs(5));
        let e = c
            .volume_attributes("pve1", "local", "local:iso/user-data-100.iso")
            .expect_err("deleted");
        assert_eq!(e.status, 500);
        let e = c
            .volume_attributes("pve1", "nowhere", "nowhere:iso/x.iso")
            .expect_err("unknown storage");
        assert_eq!(e.reason, "storage 'nowhere' does not exist on node 'pve1'");
    }

    #[tokio::test(start_paused = true)]
    async fn clone_locks_until_task_ends() {
        let mut c = cluster();
        let now = Instant::now();
        let upid = c
            .clone_vm(now, "pve1", 9000, &p(&[("newid", "100"), ("name", "m1")]))
            .expect("clone");
        assert_eq!(upid.id, "9000");
        let err = c
            .update_config(now, "pve1", 100, &p(&[("cores", "4")]), true)
            .expect_err("locked");
        assert_eq!(err.reason, "VM is locked (clone)");
        assert_eq!(
            c.next_id(Some("100")).expect_err("taken").errors["vmid"],
            "VM 100 already exists"
        );
        let later = now + c.options().clone_duration;
        c.advance(later);
        c.update_config(later, "pve1", 100, &p(&[("cores", "4")]), true)
            .expect("unlocked");
        let st = c.task_status("pve1", upid.as_str()).expect("task");
        assert_eq!(st["exitstatus"], "OK");
    }

    #[tokio::test(start_paused = true)]
    async fn a_nodes_task_list_shows_running_and_ended_tasks_newest_first_as_asked() {
        let mut c = cluster();
        let t0 = Instant::now();
        let first = c
            .clone_vm(t0, "pve1", 9000, &p(&[("newid", "100")]))
            .expect("clone");
        c.advance(t0 + c.options().clone_duration);
        let t1 = t0 + c.options().clone_duration + Duration::from_secs(1);
        c.advance(t1);
        let second = c
            .update_config(t1, "pve1", 100, &p(&[("cores", "4")]), true)
            .expect("config")
            .expect("a task");
        let list = |query: TaskQuery| {
            let (tasks, total) = c.node_tasks("pve1", &query).expect("list");
            let upids: Vec<String> = tasks
                .as_array()
                .expect("array")
                .iter()
                .map(|t| t["upid"].as_str().expect("upid").to_owned())
                .collect();
            (tasks, upids, total)
        };
        let all = TaskQuery {
            source: "all".into(),
            ..TaskQuery::default()
        };
        let (tasks, upids, total) = list(all.clone());
        assert_eq!(upids, [second.as_str(), first.as_str()], "newest first");
        assert_eq!(total, 2);
        assert_eq!(tasks[1]["status"], "OK");
        assert!(tasks[1]["endtime"].as_u64() >= tasks[1]["starttime"].as_u64());
        assert!(tasks[0].get("status").is_none(), "running: {}", tasks[0]);
        assert!(tasks[0].get("endtime").is_none());
        let (_, upids, _) = list(TaskQuery::default());
        assert_eq!(upids, [first.as_str()], "the archive holds ended tasks");
        let (_, upids, _) = list(TaskQuery {
            source: "active".into(),
            ..TaskQuery::default()
        });
        assert_eq!(upids, [second.as_str()]);
        let (_, upids, total) = list(TaskQuery {
            limit: 1,
            ..all.clone()
        });
        assert_eq!((upids.len(), total), (1, 2), "paged, with the total");
        let (_, upids, _) = list(TaskQuery {
            since: Some(second.starttime + 1),
            ..all.clone()
        });
        assert!(upids.is_empty(), "started before `since`");
        let (_, upids, _) = list(TaskQuery {
            typefilter: Some("qmclone".into()),
            ..all
        });
        assert_eq!(upids, [first.as_str()]);
        assert!(c.node_tasks("pve1", &TaskQuery::default()).is_ok());
        assert!(c.node_tasks("nowhere", &TaskQuery::default()).is_err());
    }

    /// Off, `clone_smbios_uuid` gives clones no SMBIOS UUID (keeping the template's other
    /// SMBIOS fields); a UUID written with the config is kept, a malformed one refused.
    #[tokio::test(start_paused = true)]
    async fn clones_without_an_smbios_uuid_take_one_with_their_config() {
        let mut topology = Topology::example();
        topology.templates[1].config.insert(
            "smbios1".into(),
            "uuid=5c0e0001-1d2b-4c3a-9e8f-000000000001,manufacturer=SGFuZA==,base64=1".into(),
        );
        let options = SimOptions {
            clone_smbios_uuid: false,
            ..SimOptions::default()
        };
        let mut c = Cluster::new(&topology, options, Box::new(|_| false));
        let now = Instant::now();
        c.clone_vm(now, "pve1", 9000, &p(&[("newid", "100")]))
            .expect("clone");
        c.clone_vm(now, "pve1", 9001, &p(&[("newid", "101")]))
            .expect("clone");
        let later = now + c.options().clone_duration;
        c.advance(later);
        let plain = c.vm_config("pve1", 100).expect("config");
        assert!(plain.get("smbios1").is_none(), "{plain}");
        let kept = c.vm_config("pve1", 101).expect("config");
        assert_eq!(kept["smbios1"], "manufacturer=SGFuZA==,base64=1");
        let e = c
            .update_config(
                later,
                "pve1",
                100,
                &p(&[("smbios1", "uuid=not-a-uuid")]),
                false,
            )
            .expect_err("malformed");
        assert_eq!(e.status, 400);
        let uuid = "uuid=0b6e3c1a-4f2d-4e8b-9a7c-5d1e2f3a4b5c";
        c.update_config(later, "pve1", 100, &p(&[("smbios1", uuid)]), false)
            .expect("a UUID");
        assert_eq!(c.vm_config("pve1", 100).expect("config")["smbios1"], uuid);
    }

    #[tokio::test(start_paused = true)]
    async fn a_local_iso_keeps_a_shared_template_on_its_node_as_proxmox_does() {
        let mut topology = Topology::example();
        topology.templates[1]
            .config
            .insert("ide2".into(), "local:iso/ubuntu.iso,media=cdrom".into());
        topology.templates[1]
            .config
            .insert("ide0".into(), "none,media=cdrom".into());
        let mut c = Cluster::new(&topology, SimOptions::default(), Box::new(|_| false));
        let now = Instant::now();
        let e = c
            .clone_vm(
                now,
                "pve1",
                9001,
                &p(&[("newid", "100"), ("target", "pve2")]),
            )
            .expect_err("local ISO");
        assert_eq!(
            (e.status, e.reason.as_str()),
            (500, "can't clone VM to node 'pve2' (VM uses local storage)")
        );
        // An empty drive is no volume: without the ISO the clone may cross nodes.
        topology.templates[1].config.remove("ide2");
        let mut c = Cluster::new(&topology, SimOptions::default(), Box::new(|_| false));
        c.clone_vm(
            now,
            "pve1",
            9001,
            &p(&[("newid", "100"), ("target", "pve2")]),
        )
        .expect("shared disks only");
    }

    #[tokio::test(start_paused = true)]
    async fn clone_rules() {
        let mut c = cluster();
        let now = Instant::now();
        let e = c
            .clone_vm(
                now,
                "pve1",
                9000,
                &p(&[("newid", "100"), ("target", "pve2")]),
            )
            .expect_err("local storage");
        assert_eq!(
            (e.status, e.reason.as_str()),
            (500, "can't clone VM to node 'pve2' (VM uses local storage)")
        );
        let e = c
            .clone_vm(
                now,
                "pve1",
                9000,
                &p(&[("newid", "100"), ("storage", "ceph")]),
            )
            .expect_err("linked");
        assert_eq!(e.status, 400);
        // A full clone to another node needs a shared target storage too.
        let e = c
            .clone_vm(
                now,
                "pve1",
                9001,
                &p(&[
                    ("newid", "100"),
                    ("target", "pve2"),
                    ("full", "1"),
                    ("storage", "local-lvm"),
                ]),
            )
            .expect_err("non-shared target storage");
        assert_eq!(
            (e.status, e.reason.as_str()),
            (500, "can't clone to non-shared storage 'local-lvm'")
        );
        c.clone_vm(
            now,
            "pve1",
            9001,
            &p(&[("newid", "101"), ("target", "pve2")]),
        )
        .expect("shared storage");
        c.advance(now + Duration::from_secs(5));
        assert_eq!(c.vm_node(101).as_deref(), Some("pve2"));
        let e = c
            .clone_vm(now, "pve1", 9000, &p(&[("newid", "101")]))
            .expect_err("exists elsewhere");
        assert!(
            e.reason.contains("already exists on node 'pve2'"),
            "{}",
            e.reason
        );
        let e = c
            .clone_vm(now, "pve2", 9000, &p(&[("newid", "102")]))
            .expect_err("wrong node");
        assert!(e.reason.contains("does not exist"));
    }

    #[tokio::test(start_paused = true)]
    async fn digest_resize_delete() {
        let mut c = cluster();
        let now = Instant::now();
        c.clone_vm(now, "pve1", 9000, &p(&[("newid", "100")]))
            .expect("clone");
        let now = now + Duration::from_secs(1);
        c.advance(now);
        let cfg = c.vm_config("pve1", 100).expect("config");
        assert_eq!(cfg["name"], "Copy-of-VM-ubuntu-2404-kube");
        let digest = cfg["digest"].as_str().expect("digest").to_string();
        c.update_config(
            now,
            "pve1",
            100,
            &p(&[("tags", "B,a a"), ("digest", &digest)]),
            false,
        )
        .expect("digest ok");
        let e = c
            .update_config(
                now,
                "pve1",
                100,
                &p(&[("cores", "2"), ("digest", &digest)]),
                false,
            )
            .expect_err("stale");
        assert!(e.reason.starts_with("checksum mismatch"));
        assert_eq!(c.vm_config("pve1", 100).expect("cfg")["tags"], "a;b");
        let up = c
            .resize(now, "pve1", 100, &p(&[("disk", "scsi0"), ("size", "5G")]))
            .expect("task");
        let now = now + Duration::from_secs(1);
        c.advance(now);
        assert_eq!(
            c.task_status("pve1", up.as_str()).expect("t")["exitstatus"],
            "shrinking disks is not supported"
        );
        c.resize(now, "pve1", 100, &p(&[("disk", "scsi0"), ("size", "+10G")]))
            .expect("task");
        let now = now + Duration::from_secs(1);
        c.advance(now);
        assert!(
            c.vm_config("pve1", 100).expect("cfg")["scsi0"]
                .as_str()
                .expect("s")
                .ends_with("size=20G")
        );
        c.power(now, "pve1", 100, "start").expect("start");
        let now = now + Duration::from_secs(1);
        c.advance(now);
        let e = c.delete_vm(now, "pve1", 100, false).expect_err("running");
        assert_eq!(e.reason, "VM 100 is running - destroy failed");
    }

    #[tokio::test(start_paused = true)]
    async fn resources_lag_and_flock_contention() {
        let opts = SimOptions {
            resources_lag: Duration::from_secs(10),
            ..SimOptions::default()
        };
        let mut c = Cluster::new(&Topology::example(), opts, Box::new(|_| false));
        let now = Instant::now();
        c.clone_vm(now, "pve1", 9000, &p(&[("newid", "100"), ("name", "m1")]))
            .expect("clone");
        // while the clone runs, editing the template waits for its flock and times out
        let e = c
            .update_config(now, "pve1", 9000, &p(&[("description", "x")]), false)
            .expect_err("flock");
        assert_eq!(
            e.reason,
            "can't lock file '/var/lock/qemu-server/lock-9000.conf' - got timeout"
        );
        // a second clone of the (stopped) template is fine: shared lock
        c.clone_vm(now, "pve1", 9000, &p(&[("newid", "101")]))
            .expect("parallel clone");
        let find = |c: &Cluster, t: Instant| {
            let all = c.cluster_resources(t, Some("vm")).expect("resources");
            all.as_array()
                .expect("array")
                .iter()
                .find(|r| r["vmid"] == 100)
                .cloned()
                .expect("vm 100")
        };
        let r = find(&c, now);
        assert_eq!(r["status"], "unknown");
        assert!(r.get("name").is_none() && r.get("template").is_none());
        assert_eq!(
            r["lock"], "clone",
            "lock comes from the config, not the RRD"
        );
        let later = now + Duration::from_secs(20);
        c.advance(later);
        let r = find(&c, later);
        assert_eq!(r["status"], "stopped");
        assert_eq!(r["name"], "m1");
        c.update_config(later, "pve1", 9000, &p(&[("description", "x")]), false)
            .expect("template editable again");
    }

    #[tokio::test(start_paused = true)]
    async fn clone_slots_queue_clones_per_node() {
        let opts = SimOptions {
            clone_duration: Duration::from_secs(2),
            clone_slots_per_node: 1,
            ..SimOptions::default()
        };
        let mut c = Cluster::new(&Topology::example(), opts, Box::new(|_| false));
        let t0 = Instant::now();
        let first = c
            .clone_vm(t0, "pve1", 9000, &p(&[("newid", "100")]))
            .expect("clone");
        let second = c
            .clone_vm(t0, "pve1", 9000, &p(&[("newid", "101")]))
            .expect("queued clone is accepted");
        // shared-storage template to another node: needs a slot on pve1 (source) and pve2
        let third = c
            .clone_vm(
                t0,
                "pve1",
                9001,
                &p(&[("newid", "102"), ("target", "pve2")]),
            )
            .expect("queued clone is accepted");
        assert_eq!(
            c.task_status("pve1", second.as_str()).expect("t")["status"],
            "running"
        );
        c.advance(t0 + Duration::from_secs(2));
        assert_eq!(
            c.task_status("pve1", first.as_str()).expect("t")["status"],
            "stopped"
        );
        assert_eq!(
            c.task_status("pve1", second.as_str()).expect("t")["status"],
            "running",
            "the queued clone runs its full duration after the first"
        );
        assert_eq!(c.vm_config("pve1", 101).expect("cfg")["lock"], "clone");
        c.advance(t0 + Duration::from_secs(4));
        assert_eq!(
            c.task_status("pve1", second.as_str()).expect("t")["exitstatus"],
            "OK"
        );
        c.advance(t0 + Duration::from_secs(6));
        assert_eq!(
            c.task_status("pve1", third.as_str()).expect("t")["exitstatus"],
            "OK"
        );
        assert_eq!(c.vm_node(102).as_deref(), Some("pve2"));
        let records = c.task_records();
        let starts: Vec<(Option<u32>, Duration, Duration)> = records
            .iter()
            .map(|r| {
                (
                    r.vmid,
                    r.started.expect("started") - t0,
                    r.ended.expect("ended") - t0,
                )
            })
            .collect();
        assert_eq!(
            starts,
            vec![
                (Some(100), Duration::ZERO, Duration::from_secs(2)),
                (Some(101), Duration::from_secs(2), Duration::from_secs(4)),
                (Some(102), Duration::from_secs(4), Duration::from_secs(6)),
            ]
        );
        assert!(records.iter().all(|r| r.created == t0 && r.ok));
        let log = c.task_log("pve1", second.as_str(), 0, 10).expect("log").0;
        assert!(
            log.to_string().contains("waited 2000 ms for a clone slot"),
            "{log}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn unlimited_clone_slots_run_clones_side_by_side() {
        let mut c = cluster();
        let t0 = Instant::now();
        for id in ["100", "101", "102"] {
            c.clone_vm(t0, "pve1", 9000, &p(&[("newid", id)]))
                .expect("clone");
        }
        c.advance(t0 + c.options().clone_duration);
        assert!(
            c.task_records()
                .iter()
                .all(|r| r.ok && r.started == Some(t0))
        );
    }

    fn realistic(seed: u64) -> SimOptions {
        SimOptions {
            profile: crate::profile::Profile::named(crate::profile::ProfileName::Realistic, seed),
            ..SimOptions::default()
        }
    }

    /// The drawn part of a clone's run: its run time without the waits for storage locks.
    fn drawn_run(r: &TaskRecord) -> Duration {
        let waited: Duration = r.storage_locks.iter().map(StorageLockHold::wait).sum();
        r.ended.expect("ended") - r.started.expect("started") - waited
    }

    /// Clones allocate their volumes one after another per storage lock: a local storage's on
    /// its node, a shared storage's cluster-wide; the copies then run side by side.
    #[tokio::test(start_paused = true)]
    async fn realistic_clones_allocate_one_after_another_per_storage_lock() {
        let mut c = Cluster::new(&Topology::example(), realistic(5), Box::new(|_| false));
        let t0 = Instant::now();
        for (template, newid, target) in [
            (9000, "100", None),
            (9000, "101", None),
            (9001, "102", Some("pve2")),
            (9001, "103", None),
        ] {
            let mut params = p(&[("newid", newid)]);
            if let Some(t) = target {
                params.insert("target".into(), t.into());
            }
            c.clone_vm(t0, "pve1", template, &params).expect("clone");
        }
        c.advance(t0 + Duration::from_secs(600));
        let records = c.task_records();
        let hold = |vmid: u32| {
            let r = records
                .iter()
                .find(|r| r.vmid == Some(vmid))
                .expect("clone");
            assert!(
                r.ok && r.started == Some(t0),
                "no clone slots: every clone starts"
            );
            assert_eq!(r.storage_locks.len(), 1, "one volume");
            r.storage_locks[0].clone()
        };
        let (first, second) = (hold(100), hold(101));
        assert_eq!(first.lock, "local-lvm@pve1");
        assert_eq!(first.wait(), Duration::ZERO);
        assert_eq!(
            second.acquired, first.released,
            "waits for the first allocation"
        );
        let (shared, other) = (hold(102), hold(103));
        assert_eq!(
            shared.lock, "ceph",
            "a shared storage's lock is cluster-wide"
        );
        assert_eq!(other.acquired, shared.released);
        for r in records.iter().filter(|r| r.kind == "qmclone") {
            let held: Duration = r.storage_locks.iter().map(StorageLockHold::held).sum();
            assert!(
                held <= drawn_run(r) / 2,
                "the copy keeps the rest of the clone"
            );
        }
    }

    /// The same seed draws the same durations for the same tasks, in any request order; the
    /// ideal profile keeps the configured durations and records no request or lock.
    #[tokio::test(start_paused = true)]
    async fn realistic_draws_follow_the_seed_and_ideal_draws_nothing() {
        let run = |opts: SimOptions, order: [&str; 3]| {
            let mut c = Cluster::new(&Topology::example(), opts, Box::new(|_| false));
            let t0 = Instant::now();
            for id in order {
                c.clone_vm(t0, "pve1", 9000, &p(&[("newid", id)]))
                    .expect("clone");
            }
            c.advance(t0 + Duration::from_secs(600));
            let mut runs: Vec<(Option<u32>, Duration)> = c
                .task_records()
                .iter()
                .map(|r| (r.vmid, drawn_run(r)))
                .collect();
            runs.sort();
            (runs, c.task_records())
        };
        let (a, _) = run(realistic(11), ["100", "101", "102"]);
        let (b, _) = run(realistic(11), ["102", "100", "101"]);
        assert_eq!(a, b);
        let (other_seed, _) = run(realistic(12), ["100", "101", "102"]);
        assert_ne!(a, other_seed);
        assert!(
            a.iter()
                .any(|(_, d)| *d != SimOptions::default().clone_duration),
            "drawn, not configured"
        );
        let (ideal, records) = run(SimOptions::default(), ["100", "101", "102"]);
        assert!(
            ideal
                .iter()
                .all(|(_, d)| *d == SimOptions::default().clone_duration)
        );
        assert!(
            records
                .iter()
                .all(|r| r.request.is_none() && r.storage_locks.is_empty())
        );
    }

    #[tokio::test(start_paused = true)]
    async fn task_types_take_their_own_durations_and_starts_record_the_boot() {
        let opts = SimOptions {
            task_duration: Duration::from_millis(10),
            task_durations: [
                ("resize".to_string(), Duration::from_millis(500)),
                ("qmstart".to_string(), Duration::from_secs(1)),
            ]
            .into(),
            boot_delay: Duration::from_secs(3),
            ..SimOptions::default()
        };
        let mut c = Cluster::new(&Topology::example(), opts, Box::new(|_| false));
        let t0 = Instant::now();
        c.clone_vm(t0, "pve1", 9000, &p(&[("newid", "100")]))
            .expect("clone");
        let t1 = t0 + Duration::from_secs(1);
        c.advance(t1);
        c.update_config(t1, "pve1", 100, &p(&[("cores", "4")]), true)
            .expect("config");
        c.resize(t1, "pve1", 100, &p(&[("disk", "scsi0"), ("size", "+1G")]))
            .expect("resize");
        c.advance(t1 + Duration::from_secs(1));
        let t2 = t1 + Duration::from_secs(1);
        c.power(t2, "pve1", 100, "start").expect("start");
        c.advance(t2 + Duration::from_secs(1));
        let by_kind = |kind: &str| {
            c.task_records()
                .into_iter()
                .find(|r| r.kind == kind)
                .expect("recorded")
        };
        let run = |r: &TaskRecord| r.ended.expect("ended") - r.started.expect("started");
        assert_eq!(run(&by_kind("qmconfig")), Duration::from_millis(10));
        assert_eq!(run(&by_kind("resize")), Duration::from_millis(500));
        let start = by_kind("qmstart");
        assert_eq!(run(&start), Duration::from_secs(1));
        assert_eq!(start.vmid, Some(100));
        assert_eq!(
            start.agent_ready,
            Some(t2 + Duration::from_secs(4)),
            "agent answers boot_delay after the start ends"
        );
        assert!(
            c.agent_ping(t2 + Duration::from_millis(3999), "pve1", 100)
                .is_err()
        );
        c.agent_ping(t2 + Duration::from_secs(4), "pve1", 100)
            .expect("booted");
    }

    #[tokio::test(start_paused = true)]
    async fn renamed_task_types_show_in_upids_and_status_while_the_tasks_behave_as_before() {
        let opts = SimOptions {
            task_type_names: [
                ("qmclone".to_string(), "copyvm".to_string()),
                ("qmstart".to_string(), "boot".to_string()),
            ]
            .into(),
            ..SimOptions::default()
        };
        let mut c = Cluster::new(&Topology::example(), opts, Box::new(|_| false));
        let t0 = Instant::now();
        let clone = c
            .clone_vm(t0, "pve1", 9000, &p(&[("newid", "100")]))
            .expect("clone");
        assert_eq!(clone.task_type, "copyvm");
        let status = c.task_status("pve1", clone.as_str()).expect("status");
        assert_eq!(status["type"], "copyvm");
        // Still a clone: it takes a clone's time and makes the VM.
        let t1 = t0 + c.options().clone_duration;
        c.advance(t1);
        let start = c.power(t1, "pve1", 100, "start").expect("start");
        assert_eq!(start.task_type, "boot");
        c.advance(t1 + Duration::from_secs(1));
        let kinds: Vec<String> = c.task_records().into_iter().map(|r| r.kind).collect();
        assert_eq!(kinds, ["qmclone", "qmstart"], "records keep the real types");
        assert!(
            c.task_records()[1].agent_ready.is_some(),
            "a renamed start still boots the guest"
        );
    }

    #[test]
    fn only_successful_tasks_of_one_kind_on_one_target_in_a_row_count_as_repeated_writes() {
        let now = Instant::now();
        let record = |kind: &str, vmid: Option<u32>, volume: Option<&str>, ok: bool| TaskRecord {
            upid: String::new(),
            node: "pve1".into(),
            kind: kind.into(),
            vmid,
            volume: volume.map(str::to_owned),
            created: now,
            started: Some(now),
            ended: Some(now),
            ok,
            agent_ready: None,
            request: None,
            storage_locks: Vec::new(),
        };
        let iso = Some("local:iso/user-data-100.iso");
        let mut records = vec![
            record("imgcopy", Some(100), iso, true),
            record("imgcopy", Some(100), iso, false),
            record("imgcopy", Some(100), iso, true),
            record("qmstart", Some(100), None, true),
            record("imgcopy", Some(100), iso, true),
        ];
        assert_eq!(repeated_writes(&records, 3), [], "a failure does not count");
        // The start is on the VM, not on the ISO: it does not break the ISO's run.
        records.push(record("imgcopy", Some(100), iso, true));
        let four = RepeatedWrite {
            kind: "imgcopy".into(),
            target: "local:iso/user-data-100.iso".into(),
            times: 4,
        };
        assert_eq!(repeated_writes(&records, 3), [four]);
        // Its deletion in between is progress: uploading it again starts a new run.
        records.insert(4, record("imgdel", Some(100), iso, true));
        assert_eq!(repeated_writes(&records, 2), []);
        assert_eq!(
            repeated_writes(&records, 1).len(),
            1,
            "the two before the deletion"
        );
    }
}
