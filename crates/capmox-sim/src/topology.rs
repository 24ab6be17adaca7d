//! What the simulated cluster looks like at start (nodes, storages, templates, guests)
//! and how it behaves (task durations, boot delay, faults). Deserializes from YAML or JSON.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::profile::{Profile, ProfileName};

mod hardware;

pub use hardware::{DhcpSpec, PciDeviceSpec, PciMapEntrySpec, PciMappingSpec};
pub(crate) use hardware::{hex_id, is_config_id, is_pci_address, pci_filter_matches};

/// Errors loading a topology.
#[derive(Debug, thiserror::Error)]
pub enum TopologyError {
    /// The file could not be read.
    #[error("cannot read topology file {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file is not valid YAML/JSON for a topology.
    #[error("topology {path} is invalid: {message}")]
    Parse {
        /// The file.
        path: String,
        /// The parser's message.
        message: String,
    },
    /// The topology is inconsistent (unknown node, duplicate VMID, ...).
    #[error("topology is inconsistent: {0}")]
    Invalid(String),
}

/// A Proxmox node.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct NodeSpec {
    /// Node name.
    pub name: String,
    /// Physical memory in MiB.
    #[serde(default = "default_node_memory")]
    pub memory_mib: u64,
    /// CPU cores.
    #[serde(default = "default_node_cores")]
    pub cores: u32,
    /// Whether the node is online (offline nodes answer 595 to node-scoped calls).
    #[serde(default = "yes")]
    pub online: bool,
    /// The node's PCI devices (for passthrough, raw or through `pci_mappings`).
    #[serde(default)]
    pub pci_devices: Vec<PciDeviceSpec>,
}

/// A storage.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct StorageSpec {
    /// Storage id.
    pub name: String,
    /// Plugin type: `dir`, `lvmthin`, `lvm`, `zfspool`, `rbd`, `nfs`, ...
    #[serde(rename = "type", default = "default_storage_type")]
    pub kind: String,
    /// Shared between nodes (`shared: 1` in `/cluster/resources` and `/nodes/{node}/storage`):
    /// clones to another node need every volume of the source, and the `storage` asked for, on
    /// shared storage.
    #[serde(default)]
    pub shared: bool,
    /// Content types (`images`, `iso`, `rootdir`, `vztmpl`, `snippets`).
    #[serde(default = "default_content")]
    pub content: Vec<String>,
    /// Nodes where the storage exists; empty = all nodes.
    #[serde(default)]
    pub nodes: Vec<String>,
    /// Capacity in GiB.
    #[serde(default = "default_storage_size")]
    pub size_gib: u64,
}

/// A template or guest that exists at start.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct GuestSpec {
    /// VMID.
    pub vmid: u32,
    /// Name.
    pub name: String,
    /// Node.
    pub node: String,
    /// Tags.
    #[serde(default)]
    pub tags: Vec<String>,
    /// Memory (MiB).
    #[serde(default = "default_guest_memory")]
    pub memory_mib: u64,
    /// Cores.
    #[serde(default = "default_guest_cores")]
    pub cores: u32,
    /// Storage of the boot disk `scsi0`. A storage without `shared` puts the disk on this
    /// node's local storage: clones of it to another node are then refused as Proxmox does
    /// (`can't clone VM to node 'X' (VM uses local storage)`); one copy per node (same name
    /// and tags, other VMID) is how real clusters serve every node from local storage.
    pub storage: String,
    /// Size of `scsi0` in GiB.
    #[serde(default = "default_disk")]
    pub disk_gib: u64,
    /// Extra config options (`key: value` in Proxmox syntax).
    #[serde(default)]
    pub config: BTreeMap<String, String>,
    /// Running at start (guests only).
    #[serde(default)]
    pub running: bool,
}

/// The simulated cluster's initial state.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Topology {
    /// Cluster name (`None` = a stand-alone node without a cluster entry).
    #[serde(default)]
    pub cluster_name: Option<String>,
    /// Nodes.
    pub nodes: Vec<NodeSpec>,
    /// Storages.
    #[serde(default)]
    pub storages: Vec<StorageSpec>,
    /// Templates (converted VMs, `template: 1`).
    #[serde(default)]
    pub templates: Vec<GuestSpec>,
    /// Other guests.
    #[serde(default)]
    pub guests: Vec<GuestSpec>,
    /// Resource pools.
    #[serde(default)]
    pub pools: Vec<String>,
    /// PCI resource mappings (`/cluster/mapping/pci`, PVE 8+).
    #[serde(default)]
    pub pci_mappings: Vec<PciMappingSpec>,
    /// DHCP services, one per bridge, the same on every node.
    #[serde(default)]
    pub dhcp: Vec<DhcpSpec>,
    /// Behaviour overrides (token, durations, faults), so one file describes a whole scenario.
    #[serde(default)]
    pub simulation: Option<SimSettings>,
}

/// Optional behaviour settings in a topology file; unset fields keep the defaults.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SimSettings {
    /// Accepted token id.
    #[serde(default)]
    pub token_id: Option<String>,
    /// Accepted token secret.
    #[serde(default)]
    pub token_secret: Option<String>,
    /// Clone task duration (ms).
    #[serde(default)]
    pub clone_ms: Option<u64>,
    /// Other task durations (ms).
    #[serde(default)]
    pub task_ms: Option<u64>,
    /// Durations (ms) by Proxmox task type (`qmconfig`, `resize`, `imgcopy`, `qmstart`, ...),
    /// overriding `task_ms` for those types.
    #[serde(default)]
    pub task_type_ms: BTreeMap<String, u64>,
    /// Other names for Proxmox task types in UPIDs and task status (e.g. `imgcopy: download`),
    /// to try clients against a Proxmox that names its tasks differently.
    #[serde(default)]
    pub task_type_names: BTreeMap<String, String>,
    /// Clone tasks that may run at once on one node (0 = unlimited); more wait queued.
    #[serde(default)]
    pub clone_slots_per_node: Option<usize>,
    /// Boot delay until the guest agent answers (ms).
    #[serde(default)]
    pub boot_ms: Option<u64>,
    /// `/cluster/resources` lag after changes (ms).
    #[serde(default)]
    pub resources_lag_ms: Option<u64>,
    /// Make `cloud-init status` report this error.
    #[serde(default)]
    pub cloud_init_failure: Option<String>,
    /// Include `message` in error bodies (PVE ≥ 8.3).
    #[serde(default)]
    pub error_message_field: Option<bool>,
    /// Reported pve-manager version.
    #[serde(default)]
    pub version: Option<String>,
    /// Fault injection.
    #[serde(default)]
    pub faults: Option<FaultConfig>,
    /// Privileges the token lacks.
    #[serde(default)]
    pub denied: Vec<DenyRule>,
    /// `false`: clones carry no SMBIOS UUID (see [`SimOptions::clone_smbios_uuid`]).
    #[serde(default)]
    pub clone_smbios_uuid: Option<bool>,
    /// `realistic`: API workers, request latency, drawn task durations, storage locks (see
    /// [`crate::profile`]).
    #[serde(default)]
    pub profile: Option<ProfileName>,
    /// Seed of the realistic profile's draws.
    #[serde(default)]
    pub profile_seed: Option<u64>,
    /// Requests each API daemon of a node serves at once under the realistic profile.
    #[serde(default)]
    pub api_workers: Option<usize>,
}

fn yes() -> bool {
    true
}
fn default_node_memory() -> u64 {
    65536
}
fn default_node_cores() -> u32 {
    16
}
fn default_storage_type() -> String {
    "dir".to_string()
}
fn default_content() -> Vec<String> {
    vec!["images".to_string()]
}
fn default_storage_size() -> u64 {
    1024
}
fn default_guest_memory() -> u64 {
    2048
}
fn default_guest_cores() -> u32 {
    2
}
fn default_disk() -> u64 {
    10
}

impl Topology {
    /// Parses YAML (a superset of JSON).
    pub fn from_yaml(text: &str, origin: &str) -> Result<Self, TopologyError> {
        let t: Topology = serde_norway::from_str(text).map_err(|e| TopologyError::Parse {
            path: origin.to_string(),
            message: e.to_string(),
        })?;
        t.validate()?;
        Ok(t)
    }

    /// Reads a YAML or JSON file.
    pub fn load(path: &Path) -> Result<Self, TopologyError> {
        let text = std::fs::read_to_string(path).map_err(|source| TopologyError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_yaml(&text, &path.display().to_string())
    }

    /// Checks references and uniqueness.
    pub fn validate(&self) -> Result<(), TopologyError> {
        if self.nodes.is_empty() {
            return Err(TopologyError::Invalid(
                "at least one node is required".into(),
            ));
        }
        let nodes: Vec<&str> = self.nodes.iter().map(|n| n.name.as_str()).collect();
        let mut seen = std::collections::BTreeSet::new();
        for g in self.templates.iter().chain(&self.guests) {
            if !seen.insert(g.vmid) {
                return Err(TopologyError::Invalid(format!(
                    "VMID {} is used twice",
                    g.vmid
                )));
            }
            if g.vmid < 100 {
                return Err(TopologyError::Invalid(format!(
                    "VMID {} is below 100 (reserved)",
                    g.vmid
                )));
            }
            if !nodes.contains(&g.node.as_str()) {
                return Err(TopologyError::Invalid(format!(
                    "guest {} is on unknown node '{}'",
                    g.vmid, g.node
                )));
            }
            let storage_ok = self.storages.iter().any(|s| {
                s.name == g.storage
                    && (s.nodes.is_empty() || s.nodes.contains(&g.node))
                    && s.content.iter().any(|c| c == "images")
            });
            if !storage_ok {
                return Err(TopologyError::Invalid(format!(
                    "guest {} uses storage '{}' which has no 'images' content on node '{}'",
                    g.vmid, g.storage, g.node
                )));
            }
        }
        for s in &self.storages {
            for n in &s.nodes {
                if !nodes.contains(&n.as_str()) {
                    return Err(TopologyError::Invalid(format!(
                        "storage '{}' names unknown node '{n}'",
                        s.name
                    )));
                }
            }
        }
        for n in &self.nodes {
            hardware::check_devices(&n.name, &n.pci_devices)?;
        }
        hardware::check_mappings(&self.pci_mappings, |node| {
            self.nodes
                .iter()
                .find(|n| n.name == node)
                .map(|n| n.pci_devices.as_slice())
        })?;
        hardware::check_dhcp(&self.dhcp)
    }

    /// A small ready-made cluster: 3 nodes, local-lvm + local (iso) + shared ceph, two templates.
    pub fn example() -> Self {
        let yaml = r#"
cluster_name: sim
nodes:
  - {name: pve1, memory_mib: 65536, cores: 16}
  - {name: pve2, memory_mib: 65536, cores: 16}
  - {name: pve3, memory_mib: 32768, cores: 8}
storages:
  - {name: local, type: dir, content: [iso, vztmpl, snippets, images]}
  - {name: local-lvm, type: lvmthin, content: [images, rootdir]}
  - {name: ceph, type: rbd, shared: true, content: [images], size_gib: 4096}
templates:
  - {vmid: 9000, name: ubuntu-2404-kube, node: pve1, tags: [capmox, ubuntu], storage: local-lvm, disk_gib: 10, config: {agent: "1", net0: "virtio=BC:24:11:00:90:00,bridge=vmbr0"}}
  - {vmid: 9001, name: ubuntu-2404-shared, node: pve1, tags: [capmox, shared], storage: ceph, disk_gib: 10, config: {agent: "1", net0: "virtio=BC:24:11:00:90:01,bridge=vmbr0"}}
pools: [capi]
"#;
        Self::from_yaml(yaml, "built-in example").expect("the built-in example topology is valid")
    }
}

/// Fault injection for one endpoint template (or `*` for all).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct FaultRule {
    /// Endpoint template like `POST /nodes/{node}/qemu/{vmid}/clone`, or `*`.
    pub endpoint: String,
    /// Probability (0..1) of answering with `error_status`/`error_reason` instead.
    #[serde(default)]
    pub error_rate: f64,
    /// Status for injected errors (default 596, a transient proxy error).
    #[serde(default = "default_fault_status")]
    pub error_status: u16,
    /// Reason phrase for injected errors.
    #[serde(default = "default_fault_reason")]
    pub error_reason: String,
    /// Probability of closing the connection without an answer.
    #[serde(default)]
    pub drop_rate: f64,
    /// Probability of a lock-file timeout (`can't lock file ... got timeout`).
    #[serde(default)]
    pub lock_contention_rate: f64,
    /// Added latency in milliseconds.
    #[serde(default)]
    pub latency_ms: u64,
}

fn default_fault_status() -> u16 {
    596
}
fn default_fault_reason() -> String {
    "Connection timed out".to_string()
}

/// Seeded, deterministic fault injection.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct FaultConfig {
    /// RNG seed; the same seed and request sequence give the same faults.
    #[serde(default)]
    pub seed: u64,
    /// Per-endpoint rules (the first matching rule applies).
    #[serde(default)]
    pub rules: Vec<FaultRule>,
    /// Probability that a task fails (exit status `injected failure`), per task type or `*`.
    #[serde(default)]
    pub task_failure_rate: BTreeMap<String, f64>,
}

/// Behaviour knobs.
#[derive(Clone, PartialEq)]
pub struct SimOptions {
    /// Accepted token id (`user@realm!name`).
    pub token_id: String,
    /// Accepted token secret.
    pub token_secret: String,
    /// How long a clone task runs.
    pub clone_duration: Duration,
    /// How long other tasks (start, stop, reboot, reset, HA migration, resize, config, delete,
    /// upload) run, unless `task_durations` names their type.
    pub task_duration: Duration,
    /// Durations by Proxmox task type (`qmconfig`, `resize`, `imgcopy`, `qmstart`, `qmstop`,
    /// `qmreboot`, `qmreset`, `qmigrate`, `qmdestroy`, `imgdel`, ...), so benchmarks can model
    /// each step's real cost.
    pub task_durations: BTreeMap<String, Duration>,
    /// Names shown for Proxmox task types (real type → shown name) in UPIDs and task status;
    /// the simulator still behaves by the real type.
    pub task_type_names: BTreeMap<String, String>,
    /// How many clone tasks may run at once on a node (0 = unlimited). Proxmox serialises
    /// clones through storage and config locks; a clone holds a slot on its source node and,
    /// when it targets another node, on that node too. Clones beyond the limit wait queued
    /// (task status `running`, VM locked `clone`) and start in request order as slots free.
    pub clone_slots_per_node: usize,
    /// Time from start until the guest agent answers.
    pub boot_delay: Duration,
    /// How long a command run through the guest agent (`agent/exec`) takes before
    /// `exec-status` reports it exited (`cloud-init status` starts a Python interpreter).
    pub guest_command_duration: Duration,
    /// How long `/cluster/resources` shows a changed guest as `unknown` without name/template.
    pub resources_lag: Duration,
    /// `cloud-init status` result: `None` = done, `Some(text)` = error with that text.
    pub cloud_init_failure: Option<String>,
    /// Include `message` in error bodies (PVE ≥ 8.3 behaviour).
    pub error_message_field: bool,
    /// Reported version (`/version`).
    pub version: String,
    /// Fault injection.
    pub faults: FaultConfig,
    /// Maximum request log entries kept.
    pub request_log_capacity: usize,
    /// Privileges the token lacks: matching requests get 403 `Permission check failed (...)`.
    pub denied: Vec<DenyRule>,
    /// Whether a clone gets a new SMBIOS UUID, as Proxmox gives clones of templates that have
    /// `smbios1`. Off, a clone keeps its source's `smbios1` without `uuid=` (and has none when
    /// nothing else is left), as clones of hand-made templates come, so clients must give it one.
    pub clone_smbios_uuid: bool,
    /// How the simulator behaves in time: `ideal` or a real cluster's timing.
    pub profile: Profile,
}

/// A privilege the simulated token does not have on an endpoint.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DenyRule {
    /// Endpoint template, e.g. `DELETE /nodes/{node}/qemu/{vmid}`, or `*`.
    pub endpoint: String,
    /// Privilege named in the error, e.g. `VM.Allocate`.
    pub privilege: String,
}

impl std::fmt::Debug for SimOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimOptions")
            .field("token_id", &self.token_id)
            .field("token_secret", &"<redacted>")
            .field("clone_duration", &self.clone_duration)
            .field("task_duration", &self.task_duration)
            .field("task_durations", &self.task_durations)
            .field("task_type_names", &self.task_type_names)
            .field("clone_slots_per_node", &self.clone_slots_per_node)
            .field("boot_delay", &self.boot_delay)
            .field("version", &self.version)
            .field("faults", &self.faults)
            .field("clone_smbios_uuid", &self.clone_smbios_uuid)
            .field("profile", &self.profile)
            .finish_non_exhaustive()
    }
}

impl Default for SimOptions {
    fn default() -> Self {
        Self {
            token_id: "root@pam!capmox".to_string(),
            token_secret: "00000000-0000-4000-8000-000000000000".to_string(),
            clone_duration: Duration::from_millis(300),
            task_duration: Duration::from_millis(50),
            task_durations: BTreeMap::new(),
            task_type_names: BTreeMap::new(),
            clone_slots_per_node: 0,
            boot_delay: Duration::from_millis(300),
            guest_command_duration: Duration::from_millis(200),
            cloud_init_failure: None,
            error_message_field: true,
            version: "9.1.4".to_string(),
            faults: FaultConfig::default(),
            request_log_capacity: 10_000,
            resources_lag: Duration::ZERO,
            denied: Vec::new(),
            clone_smbios_uuid: true,
            profile: Profile::Ideal,
        }
    }
}

impl SimOptions {
    /// How long a task of this Proxmox type runs (`qmclone` uses `clone_duration`).
    pub fn duration_of(&self, task_type: &str) -> Duration {
        if task_type == "qmclone" {
            return self.clone_duration;
        }
        self.task_durations
            .get(task_type)
            .copied()
            .unwrap_or(self.task_duration)
    }

    /// Other names for every task type capmox causes, as a Proxmox that answers differently
    /// might give them (`download` for `imgcopy`, ...), for [`SimOptions::task_type_names`].
    pub fn renamed_task_types() -> BTreeMap<String, String> {
        [
            ("qmclone", "copyvm"),
            ("qmconfig", "vmconf"),
            ("resize", "growdisk"),
            ("imgcopy", "download"),
            ("qmstart", "boot"),
            ("qmstop", "halt"),
            ("qmreboot", "restart"),
            ("qmreset", "hardreset"),
            ("qmigrate", "vmmigrate"),
            ("qmdestroy", "remove"),
            ("imgdel", "voldel"),
        ]
        .into_iter()
        .map(|(real, shown)| (real.to_owned(), shown.to_owned()))
        .collect()
    }

    /// The name UPIDs and task status give a task of this Proxmox type.
    pub fn shown_task_type<'a>(&'a self, task_type: &'a str) -> &'a str {
        self.task_type_names
            .get(task_type)
            .map_or(task_type, String::as_str)
    }

    /// Defaults overridden by the topology's `simulation` section.
    pub fn from_topology(topology: &Topology) -> Self {
        let mut o = Self::default();
        let Some(s) = &topology.simulation else {
            return o;
        };
        if let Some(v) = &s.token_id {
            o.token_id = v.clone();
        }
        if let Some(v) = &s.token_secret {
            o.token_secret = v.clone();
        }
        if let Some(v) = s.clone_ms {
            o.clone_duration = Duration::from_millis(v);
        }
        if let Some(v) = s.task_ms {
            o.task_duration = Duration::from_millis(v);
        }
        for (kind, ms) in &s.task_type_ms {
            o.task_durations
                .insert(kind.clone(), Duration::from_millis(*ms));
        }
        o.task_type_names = s.task_type_names.clone();
        if let Some(v) = s.clone_slots_per_node {
            o.clone_slots_per_node = v;
        }
        if let Some(v) = s.boot_ms {
            o.boot_delay = Duration::from_millis(v);
        }
        if let Some(v) = s.resources_lag_ms {
            o.resources_lag = Duration::from_millis(v);
        }
        if s.cloud_init_failure.is_some() {
            o.cloud_init_failure = s.cloud_init_failure.clone();
        }
        if let Some(v) = s.error_message_field {
            o.error_message_field = v;
        }
        if let Some(v) = &s.version {
            o.version = v.clone();
        }
        if let Some(v) = &s.faults {
            o.faults = v.clone();
        }
        o.denied = s.denied.clone();
        if let Some(v) = s.clone_smbios_uuid {
            o.clone_smbios_uuid = v;
        }
        o.profile = Profile::named(s.profile.unwrap_or_default(), s.profile_seed.unwrap_or(0));
        if let (Profile::Realistic(r), Some(workers)) = (&mut o.profile, s.api_workers) {
            r.api_workers = workers;
        }
        o
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn simulation_section_overrides_defaults() {
        let t = Topology::from_yaml(
            "nodes: [{name: a}]\nsimulation:\n  clone_ms: 5000\n  token_id: 'capi@pve!sim'\n  faults: {seed: 3, rules: [{endpoint: '*', error_rate: 0.1}]}\n",
            "t",
        )
        .expect("valid");
        let o = SimOptions::from_topology(&t);
        assert_eq!(o.clone_duration, Duration::from_secs(5));
        assert_eq!(o.token_id, "capi@pve!sim");
        assert_eq!(o.faults.rules[0].error_status, 596);
        assert_eq!(o.task_duration, SimOptions::default().task_duration);
        assert_eq!(o.clone_slots_per_node, 0, "unlimited unless set");
    }

    #[test]
    fn per_type_durations_and_clone_slots_from_the_simulation_section() {
        let t = Topology::from_yaml(
            "nodes: [{name: a}]\nsimulation:\n  clone_ms: 2000\n  task_ms: 70\n  task_type_ms: {qmstart: 1000, resize: 500}\n  clone_slots_per_node: 2\n  task_type_names: {imgcopy: download}\n",
            "t",
        )
        .expect("valid");
        let o = SimOptions::from_topology(&t);
        assert_eq!(o.duration_of("qmclone"), Duration::from_secs(2));
        assert_eq!(o.duration_of("qmstart"), Duration::from_secs(1));
        assert_eq!(o.duration_of("resize"), Duration::from_millis(500));
        assert_eq!(o.duration_of("qmconfig"), Duration::from_millis(70));
        assert_eq!(o.clone_slots_per_node, 2);
        assert_eq!(o.shown_task_type("imgcopy"), "download");
        assert_eq!(
            o.shown_task_type("qmstart"),
            "qmstart",
            "unnamed types keep theirs"
        );
    }

    #[test]
    fn the_simulation_section_picks_the_profile() {
        let ideal = SimOptions::from_topology(&Topology::example());
        assert_eq!(ideal.profile, Profile::Ideal, "ideal unless named");
        let t = Topology::from_yaml(
            "nodes: [{name: a}]\nsimulation:\n  profile: realistic\n  profile_seed: 9\n  api_workers: 5\n",
            "t",
        )
        .expect("valid");
        let o = SimOptions::from_topology(&t);
        let realistic = o.profile.realistic().expect("realistic");
        assert_eq!((realistic.seed, realistic.api_workers), (9, 5));
        assert_eq!(
            realistic.read_latency,
            crate::profile::RealisticProfile::default().read_latency
        );
        let err = Topology::from_yaml("nodes: [{name: a}]\nsimulation: {profile: fast}\n", "t")
            .expect_err("unknown profile");
        assert!(err.to_string().contains("fast"), "{err}");
    }

    #[test]
    fn example_is_valid_and_round_trips() {
        let t = Topology::example();
        assert_eq!(t.nodes.len(), 3);
        let json = serde_json::to_string(&t).expect("serializes");
        let back = Topology::from_yaml(&json, "json").expect("JSON is YAML");
        assert_eq!(t, back);
    }

    /// Two nodes with one GPU each (pve2's in another IOMMU group) and a mapping over both.
    const GPUS: &str = "
nodes:
  - name: pve1
    pci_devices: [{id: '0000:01:00.0', vendor: '10de', device: '2204', iommugroup: 14, subsystem_vendor: '1458', subsystem_device: '4032'}]
  - name: pve2
    pci_devices: [{id: '0000:41:00.0', vendor: '0x10de', device: '0x2204', iommugroup: 30}]
pci_mappings:
  - name: gpu
    description: RTX 3090
    map:
      - {node: pve1, path: '0000:01:00.0', id: '10de:2204', iommugroup: 14, subsystem_id: '1458:4032'}
      - {node: pve2, path: '0000:41:00', id: '10de:2204'}
dhcp:
  - {bridge: vmbr0, range4: 10.0.9.100-10.0.9.200, prefix4: 24, gateway4: 10.0.9.1}
";

    #[test]
    fn pci_mappings_and_dhcp_load() {
        let t = Topology::from_yaml(GPUS, "t").expect("valid");
        assert_eq!(t.pci_mappings[0].map.len(), 2);
        assert_eq!(
            t.pci_mappings[0].map[0].property_string(),
            "node=pve1,path=0000:01:00.0,id=10de:2204,iommugroup=14,subsystem-id=1458:4032"
        );
        assert_eq!(t.nodes[1].pci_devices[0].vendor_device(), "10de:2204");
        assert_eq!(t.dhcp[0].pool4().map(|p| p.2), Some(24));
    }

    #[test]
    fn pci_mappings_must_describe_the_nodes_devices() {
        for (from, to, error) in [
            (
                "path: '0000:41:00'",
                "path: '0000:42:00.0'",
                "path '0000:42:00.0' names no device of the node",
            ),
            (
                "path: '0000:41:00'",
                "path: '41:00.0'",
                "is not an address like 0000:01:00.0",
            ),
            ("{node: pve2,", "{node: pve9,", "unknown node 'pve9'"),
            (
                "iommugroup: 14, subsystem_id",
                "iommugroup: 15, subsystem_id",
                "iommugroup is 15, but device 0000:01:00.0 has 14",
            ),
            (
                "id: '10de:2204', iommugroup: 14",
                "id: '10de:2208', iommugroup: 14",
                "id is 10de:2208, but device 0000:01:00.0 has 10de:2204",
            ),
            (
                "subsystem_id: '1458:4032'",
                "subsystem_id: '1458:4033'",
                "subsystem_id is 1458:4033",
            ),
            ("name: gpu", "name: 1gpu", "is not a PVE config ID"),
            (
                "id: '0000:41:00.0'",
                "id: '0000:41:00'",
                "is not a full address",
            ),
            (
                "device: '0x2204', iommugroup: 30",
                "device: 'x', iommugroup: 30",
                "has ID 'x'",
            ),
            ("prefix4: 24", "prefix4: 33", "needs prefix4"),
        ] {
            assert!(GPUS.contains(from), "{from}");
            let err = Topology::from_yaml(&GPUS.replacen(from, to, 1), "t").expect_err(error);
            assert!(err.to_string().contains(error), "{err}");
        }
    }

    #[test]
    fn invalid_topologies_say_what_is_wrong() {
        let err = Topology::from_yaml(
            "nodes: [{name: a}]\nstorages: [{name: s}]\nguests: [{vmid: 100, name: x, node: b, storage: s}]",
            "t",
        )
        .expect_err("unknown node");
        assert!(err.to_string().contains("unknown node 'b'"), "{err}");
        let err = Topology::from_yaml("nodes: []", "t").expect_err("no nodes");
        assert!(err.to_string().contains("at least one node"));
        let err =
            Topology::from_yaml("nodes: [{name: a, ram: 1}]", "t").expect_err("unknown field");
        assert!(err.to_string().contains("ram"), "{err}");
    }
}
