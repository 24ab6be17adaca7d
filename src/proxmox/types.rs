//! Typed Proxmox VE responses and request parameters. Decoding is tolerant
//! (see `de`), unknown fields are kept in `extra` where callers may need them.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::de;
use super::upid::Upid;

/// Generates a string-backed enum with an `Other(String)` catch-all, since Proxmox adds values.
macro_rules! open_enum {
    ($(#[$m:meta])* $name:ident { $($variant:ident => $text:literal),* $(,)? }) => {
        $(#[$m])*
        #[derive(Clone, Debug, PartialEq, Eq, Hash, Default)]
        pub enum $name {
            $(#[doc = $text] $variant,)*
            /// A value this client does not know yet.
            Other(String),
            /// The field was absent.
            #[default]
            Missing,
        }
        impl $name {
            /// The wire text.
            pub fn as_str(&self) -> &str {
                match self { $(Self::$variant => $text,)* Self::Other(s) => s, Self::Missing => "" }
            }
        }
        impl From<&str> for $name {
            fn from(s: &str) -> Self {
                match s { $($text => Self::$variant,)* "" => Self::Missing, other => Self::Other(other.to_string()) }
            }
        }
        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                Ok(de::opt_string(d)?.map(|s| Self::from(s.as_str())).unwrap_or_default())
            }
        }
        impl Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(self.as_str())
            }
        }
    };
}

open_enum!(
    /// Node state in `/nodes` and `/cluster/resources`.
    NodeState { Online => "online", Offline => "offline", Unknown => "unknown" }
);
open_enum!(
    /// Guest power state (`status`).
    VmState { Running => "running", Stopped => "stopped", Unknown => "unknown" }
);
open_enum!(
    /// Resource type in `/cluster/resources`.
    ResourceType { Qemu => "qemu", Lxc => "lxc", Node => "node", Storage => "storage", Pool => "pool", Sdn => "sdn", Network => "network" }
);
open_enum!(
    /// Task run state.
    TaskState { Running => "running", Stopped => "stopped" }
);

/// `GET /version`.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
pub struct VersionInfo {
    /// `major.minor`, e.g. `9.1`; use for feature switches.
    #[serde(default)]
    pub release: String,
    /// pve-manager package version.
    #[serde(default)]
    pub version: String,
    /// Git revision.
    #[serde(default)]
    pub repoid: String,
}

impl VersionInfo {
    /// Major and minor release numbers, when `release` parses.
    pub fn major_minor(&self) -> Option<(u32, u32)> {
        let (a, b) = self.release.split_once('.')?;
        Some((a.parse().ok()?, b.parse().ok()?))
    }
}

/// A new HA resource (`POST /cluster/ha/resources`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NewHaResource {
    /// `vm:<vmid>`.
    pub sid: String,
    /// Requested state (`started`).
    pub state: String,
    /// Description.
    pub comment: Option<String>,
    /// Restarts on the same node before relocating.
    pub max_restart: Option<u32>,
    /// Relocations to other nodes.
    pub max_relocate: Option<u32>,
    /// HA group (PVE 8 only).
    pub group: Option<String>,
}

/// One HA resource (`GET /cluster/ha/resources`).
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
pub struct HaResourceEntry {
    /// `vm:<vmid>`.
    pub sid: String,
    /// Requested state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<String>,
    /// HA group (PVE 8).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    /// Description.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub comment: Option<String>,
}

/// One HA rule (`GET /cluster/ha/rules`, PVE 9).
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
pub struct HaRuleEntry {
    /// Rule id.
    pub rule: String,
    /// `node-affinity` or `resource-affinity`.
    #[serde(rename = "type")]
    pub kind: String,
    /// Comma-separated HA resource ids.
    #[serde(default)]
    pub resources: String,
    /// Node-affinity: `node[:priority]`, comma-separated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nodes: Option<String>,
    /// Node-affinity: only these nodes.
    #[serde(default, deserialize_with = "de::bool_lenient")]
    pub strict: bool,
    /// Resource-affinity: `positive` or `negative`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub affinity: Option<String>,
    /// Description.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub comment: Option<String>,
    /// Digest of the whole rules file, for updates.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
    /// Why Proxmox does not apply the rule (infeasible), when it says so.
    #[serde(default, skip_serializing)]
    pub errors: Option<serde_json::Value>,
}

impl HaRuleEntry {
    /// The resource ids.
    pub fn resource_ids(&self) -> std::collections::BTreeSet<String> {
        split_ids(&self.resources)
    }

    /// The node names (priorities dropped).
    pub fn node_names(&self) -> std::collections::BTreeSet<String> {
        split_nodes(self.nodes.as_deref().unwrap_or_default())
    }
}

/// One HA group (`GET /cluster/ha/groups`, PVE 8).
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
pub struct HaGroupEntry {
    /// Group id.
    pub group: String,
    /// `node[:priority]`, comma-separated.
    #[serde(default)]
    pub nodes: String,
    /// Resources may only run on the group's nodes.
    #[serde(default, deserialize_with = "de::bool_lenient")]
    pub restricted: bool,
    /// Description.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub comment: Option<String>,
    /// Digest of the whole groups file, for updates.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
}

impl HaGroupEntry {
    /// The node names (priorities dropped).
    pub fn node_names(&self) -> std::collections::BTreeSet<String> {
        split_nodes(&self.nodes)
    }
}

/// PVE 9's answer to an HA migration request (`POST /cluster/ha/resources/{sid}/migrate`);
/// PVE 8 answers `null`, read as the default (nothing moves along, nothing blocks).
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
pub struct HaMigration {
    /// The resource asked to move (`vm:101`); `None` from PVE 8.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sid: Option<String>,
    /// The node asked for; `None` from PVE 8.
    #[serde(
        default,
        rename = "requested-node",
        skip_serializing_if = "Option::is_none"
    )]
    pub requested_node: Option<String>,
    /// Resources in positive affinity with it, which the CRM migrates along.
    #[serde(
        default,
        rename = "comigrated-resources",
        deserialize_with = "de::or_default"
    )]
    pub comigrated_resources: Vec<String>,
    /// Resources in negative affinity with it on the requested node: the CRM drops the
    /// request while one is there.
    #[serde(
        default,
        rename = "blocking-resources",
        deserialize_with = "de::or_default"
    )]
    pub blocking_resources: Vec<HaBlockingResource>,
}

/// An HA resource that keeps another from the node its migration asked for (PVE 9).
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
pub struct HaBlockingResource {
    /// `vm:102`.
    pub sid: String,
    /// Why (`resource-affinity`).
    #[serde(default)]
    pub cause: String,
}

/// `a, b;c` → {a, b, c}.
fn split_ids(list: &str) -> std::collections::BTreeSet<String> {
    list.split([',', ';', ' '])
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect()
}

/// `a,b:1` → {a, b} (node names without their priority).
fn split_nodes(list: &str) -> std::collections::BTreeSet<String> {
    split_ids(list)
        .into_iter()
        .map(|n| n.split(':').next().unwrap_or_default().to_owned())
        .collect()
}

/// One entry of `GET /nodes`.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
pub struct NodeEntry {
    /// Node name.
    pub node: String,
    /// Online state.
    #[serde(default)]
    pub status: NodeState,
    /// CPU usage (0..1).
    #[serde(default, deserialize_with = "de::opt_f64")]
    pub cpu: Option<f64>,
    /// Number of CPUs.
    #[serde(default, deserialize_with = "de::opt_u64")]
    pub maxcpu: Option<u64>,
    /// Used memory (bytes).
    #[serde(default, deserialize_with = "de::opt_u64")]
    pub mem: Option<u64>,
    /// Total memory (bytes).
    #[serde(default, deserialize_with = "de::opt_u64")]
    pub maxmem: Option<u64>,
    /// Uptime (seconds).
    #[serde(default, deserialize_with = "de::opt_u64")]
    pub uptime: Option<u64>,
    /// SHA-256 fingerprint of the node's certificate.
    #[serde(default)]
    pub ssl_fingerprint: Option<String>,
}

/// `memory` block of `GET /nodes/{node}/status`.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
pub struct NodeMemory {
    /// Total bytes.
    #[serde(default, deserialize_with = "de::u64_or_zero")]
    pub total: u64,
    /// Used bytes.
    #[serde(default, deserialize_with = "de::u64_or_zero")]
    pub used: u64,
    /// Free bytes.
    #[serde(default, deserialize_with = "de::u64_or_zero")]
    pub free: u64,
    /// Available bytes (PVE 9).
    #[serde(default, deserialize_with = "de::opt_u64")]
    pub available: Option<u64>,
}

/// `cpuinfo` block of `GET /nodes/{node}/status`.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
pub struct NodeCpuInfo {
    /// Logical CPUs.
    #[serde(default, deserialize_with = "de::u64_or_zero")]
    pub cpus: u64,
    /// Cores per socket.
    #[serde(default, deserialize_with = "de::u64_or_zero")]
    pub cores: u64,
    /// Sockets.
    #[serde(default, deserialize_with = "de::u64_or_zero")]
    pub sockets: u64,
    /// CPU model.
    #[serde(default)]
    pub model: String,
    /// Clock (MHz), a string on real servers.
    #[serde(default, deserialize_with = "de::opt_f64")]
    pub mhz: Option<f64>,
}

/// `GET /nodes/{node}/status` (the fields a scheduler needs).
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
pub struct NodeStatus {
    /// CPU usage (0..1).
    #[serde(default, deserialize_with = "de::f64_or_zero")]
    pub cpu: f64,
    /// Memory usage.
    #[serde(default)]
    pub memory: NodeMemory,
    /// CPU description.
    #[serde(default)]
    pub cpuinfo: NodeCpuInfo,
    /// Load averages (strings on the wire).
    #[serde(default, deserialize_with = "de::f64_list")]
    pub loadavg: Vec<f64>,
    /// Uptime (seconds).
    #[serde(default, deserialize_with = "de::u64_or_zero")]
    pub uptime: u64,
    /// e.g. `pve-manager/9.1.4/...`.
    #[serde(default)]
    pub pveversion: String,
    /// Kernel version.
    #[serde(default)]
    pub kversion: String,
}

/// One entry of `GET /cluster/resources` (all types share one tolerant struct).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
pub struct ClusterResource {
    /// `qemu/100`, `node/pve`, `storage/pve/local`, `pool/x`.
    pub id: String,
    /// Resource type.
    #[serde(rename = "type", default)]
    pub kind: ResourceType,
    /// VMID for guests.
    #[serde(default, deserialize_with = "de::opt_vmid")]
    pub vmid: Option<u32>,
    /// Node name (guests, nodes, storages).
    #[serde(default)]
    pub node: Option<String>,
    /// Guest name (may lag right after a clone).
    #[serde(default)]
    pub name: Option<String>,
    /// Status text (`running`, `stopped`, `online`, `available`, `unknown`).
    #[serde(default)]
    pub status: Option<String>,
    /// Template flag.
    #[serde(default, deserialize_with = "de::bool_lenient")]
    pub template: bool,
    /// Tags, split and sorted.
    #[serde(default, deserialize_with = "de::tags")]
    pub tags: Vec<String>,
    /// Config lock, if any.
    #[serde(default)]
    pub lock: Option<String>,
    /// Pool membership.
    #[serde(default)]
    pub pool: Option<String>,
    /// Storage id (storage entries).
    #[serde(default)]
    pub storage: Option<String>,
    /// Content types (storage entries).
    #[serde(default)]
    pub content: Option<String>,
    /// Shared flag (storage entries).
    #[serde(default, deserialize_with = "de::bool_lenient")]
    pub shared: bool,
    /// Number of CPUs.
    #[serde(default, deserialize_with = "de::opt_f64")]
    pub maxcpu: Option<f64>,
    /// Memory in bytes (configured for guests, total for nodes).
    #[serde(default, deserialize_with = "de::opt_u64")]
    pub maxmem: Option<u64>,
    /// Used memory (bytes).
    #[serde(default, deserialize_with = "de::opt_u64")]
    pub mem: Option<u64>,
    /// Disk size / storage size (bytes).
    #[serde(default, deserialize_with = "de::opt_u64")]
    pub maxdisk: Option<u64>,
    /// Used disk (bytes).
    #[serde(default, deserialize_with = "de::opt_u64")]
    pub disk: Option<u64>,
    /// HA state.
    #[serde(default)]
    pub hastate: Option<String>,
}

/// One entry of `GET /cluster/status`.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
pub struct ClusterStatusEntry {
    /// `cluster` or `node`.
    #[serde(rename = "type")]
    pub kind: String,
    /// `cluster` or `node/<name>`.
    #[serde(default)]
    pub id: String,
    /// Cluster or node name.
    #[serde(default)]
    pub name: String,
    /// Cluster: node count.
    #[serde(default, deserialize_with = "de::opt_u64")]
    pub nodes: Option<u64>,
    /// Cluster: quorate.
    #[serde(default, deserialize_with = "de::bool_lenient")]
    pub quorate: bool,
    /// Node: online.
    #[serde(default, deserialize_with = "de::bool_lenient")]
    pub online: bool,
    /// Node: the node answering this request.
    #[serde(default, deserialize_with = "de::bool_lenient")]
    pub local: bool,
    /// Node: corosync id.
    #[serde(default, deserialize_with = "de::opt_u64")]
    pub nodeid: Option<u64>,
    /// Node: IP address.
    #[serde(default)]
    pub ip: Option<String>,
}

/// One entry of `GET /nodes/{node}/qemu`.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
pub struct VmEntry {
    /// VMID (int or string).
    #[serde(deserialize_with = "de::vmid")]
    pub vmid: u32,
    /// Name.
    #[serde(default)]
    pub name: Option<String>,
    /// Power state.
    #[serde(default)]
    pub status: VmState,
    /// Number of vCPUs.
    #[serde(default, deserialize_with = "de::opt_f64")]
    pub cpus: Option<f64>,
    /// Configured memory (bytes).
    #[serde(default, deserialize_with = "de::u64_or_zero")]
    pub maxmem: u64,
    /// Boot disk size (bytes).
    #[serde(default, deserialize_with = "de::u64_or_zero")]
    pub maxdisk: u64,
    /// Used memory (bytes).
    #[serde(default, deserialize_with = "de::u64_or_zero")]
    pub mem: u64,
    /// Uptime (seconds).
    #[serde(default, deserialize_with = "de::u64_or_zero")]
    pub uptime: u64,
    /// QEMU pid, when running.
    #[serde(default, deserialize_with = "de::opt_u64")]
    pub pid: Option<u64>,
    /// Lock.
    #[serde(default)]
    pub lock: Option<String>,
    /// Tags.
    #[serde(default, deserialize_with = "de::tags")]
    pub tags: Vec<String>,
    /// Template flag.
    #[serde(default, deserialize_with = "de::bool_lenient")]
    pub template: bool,
}

/// HA block of `status/current`.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
pub struct HaStatus {
    /// Whether HA manages the guest.
    #[serde(default, deserialize_with = "de::bool_lenient")]
    pub managed: bool,
    /// HA state.
    #[serde(default)]
    pub state: Option<String>,
}

/// `GET /nodes/{node}/qemu/{vmid}/status/current`.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
pub struct VmStatus {
    /// VMID (int or string).
    #[serde(deserialize_with = "de::vmid")]
    pub vmid: u32,
    /// Power state.
    #[serde(default)]
    pub status: VmState,
    /// QEMU state (`running`, `paused`, `prelaunch`, ...).
    #[serde(default)]
    pub qmpstatus: Option<String>,
    /// Name.
    #[serde(default)]
    pub name: Option<String>,
    /// Lock.
    #[serde(default)]
    pub lock: Option<String>,
    /// Tags.
    #[serde(default, deserialize_with = "de::tags")]
    pub tags: Vec<String>,
    /// Template flag (`""` on PVE 6).
    #[serde(default, deserialize_with = "de::bool_lenient")]
    pub template: bool,
    /// Agent enabled in config (not: agent running).
    #[serde(default, deserialize_with = "de::bool_lenient")]
    pub agent: bool,
    /// QEMU pid (string or null on PVE 6).
    #[serde(default, deserialize_with = "de::opt_u64")]
    pub pid: Option<u64>,
    /// Uptime (seconds).
    #[serde(default, deserialize_with = "de::u64_or_zero")]
    pub uptime: u64,
    /// vCPUs.
    #[serde(default, deserialize_with = "de::opt_f64")]
    pub cpus: Option<f64>,
    /// Configured memory (bytes).
    #[serde(default, deserialize_with = "de::u64_or_zero")]
    pub maxmem: u64,
    /// Boot disk size (bytes).
    #[serde(default, deserialize_with = "de::u64_or_zero")]
    pub maxdisk: u64,
    /// HA info.
    #[serde(default)]
    pub ha: HaStatus,
}

impl VmStatus {
    /// Running and not paused.
    pub fn is_running(&self) -> bool {
        self.status == VmState::Running
    }
}

/// `GET /nodes/{node}/qemu/{vmid}/config`: a flat map, because keys are indexed
/// (`net0`, `scsi1`, ...) and values are property strings. Accessors interpret it.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
pub struct VmConfig(pub BTreeMap<String, Value>);

impl VmConfig {
    /// A value as text (numbers converted), for keys like `memory` that changed type across versions.
    pub fn get(&self, key: &str) -> Option<String> {
        match self.0.get(key)? {
            Value::String(s) => Some(s.clone()),
            Value::Number(n) => Some(n.to_string()),
            Value::Bool(b) => Some(if *b { "1" } else { "0" }.to_string()),
            _ => None,
        }
    }

    /// SHA-1 digest for read-modify-write.
    pub fn digest(&self) -> Option<String> {
        self.get("digest")
    }

    /// The config as it is after `update` succeeded, when Proxmox takes every value as sent
    /// (no digest: Proxmox computes a new one, so a write guarded by this copy needs a fresh
    /// read).
    pub fn updated(&self, update: &ConfigUpdate) -> VmConfig {
        let mut next = self.0.clone();
        next.remove("digest");
        for key in &update.delete {
            next.remove(key);
        }
        for (key, value) in &update.set {
            next.insert(key.clone(), Value::String(value.clone()));
        }
        VmConfig(next)
    }

    /// Whether the guest is a template.
    pub fn is_template(&self) -> bool {
        self.get("template").is_some_and(|t| t == "1")
    }

    /// Current lock.
    pub fn lock(&self) -> Option<String> {
        self.get("lock")
    }

    /// Name.
    pub fn name(&self) -> Option<String> {
        self.get("name")
    }

    /// Tags, split and sorted.
    pub fn tags(&self) -> Vec<String> {
        self.get("tags")
            .map(|t| de::split_tags(&t))
            .unwrap_or_default()
    }

    /// Memory in MiB (`memory` is an int before PVE 8.1, a property string after).
    pub fn memory_mib(&self) -> Option<u64> {
        let text = self.get("memory")?;
        let props = parse_property_string(&text, "current");
        props.get("current")?.parse().ok()
    }

    /// All keys `<prefix><N>` with their index, e.g. `indexed("net")` → `[(0, "virtio=..,bridge=vmbr0")]`.
    /// Keys like `numa` vs `numa0` or `scsihw` are not confused because the suffix must be all digits.
    pub fn indexed(&self, prefix: &str) -> Vec<(u32, String)> {
        let mut out: Vec<(u32, String)> = self
            .0
            .keys()
            .filter_map(|k| {
                let rest = k.strip_prefix(prefix)?;
                if rest.is_empty() || !rest.chars().all(|c| c.is_ascii_digit()) {
                    return None;
                }
                Some((rest.parse().ok()?, self.get(k)?))
            })
            .collect();
        out.sort_by_key(|(i, _)| *i);
        out
    }

    /// NICs with their MAC addresses (uppercase as stored), `(index, mac, bridge)`.
    pub fn nics(&self) -> Vec<NetDevice> {
        self.indexed("net")
            .into_iter()
            .map(|(index, value)| NetDevice::parse(index, &value))
            .collect()
    }

    /// Storages of the VM's volumes (disks, cloud-init drive, ISO images; not empty or host
    /// drives), sorted: what Proxmox checks for sharing before it clones to another node.
    pub fn volume_storages(&self) -> Vec<String> {
        let storages: std::collections::BTreeSet<String> = DRIVE_PREFIXES
            .iter()
            .flat_map(|prefix| self.indexed(prefix))
            .filter_map(|(_, value)| {
                let file = parse_property_string(&value, "file").remove("file")?;
                let (storage, _) = file.split_once(':')?;
                (!file.starts_with('/')).then(|| storage.to_owned())
            })
            .collect();
        storages.into_iter().collect()
    }
}

/// Config keys (followed by an index) of a QEMU VM's drives.
const DRIVE_PREFIXES: [&str; 6] = ["ide", "sata", "scsi", "virtio", "efidisk", "tpmstate"];

/// A parsed `netN` value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NetDevice {
    /// N in `netN`.
    pub index: u32,
    /// NIC model (`virtio`, `e1000`, ...).
    pub model: String,
    /// MAC address, if assigned.
    pub mac: Option<String>,
    /// Bridge.
    pub bridge: Option<String>,
    /// VLAN tag.
    pub tag: Option<u32>,
}

const NIC_MODELS: &[&str] = &[
    "virtio",
    "e1000",
    "e1000e",
    "rtl8139",
    "vmxnet3",
    "i82551",
    "i82557b",
    "i82559er",
    "ne2k_isa",
    "ne2k_pci",
    "pcnet",
    "e1000-82540em",
    "e1000-82544gc",
    "e1000-82545em",
];

impl NetDevice {
    /// Parses `virtio=BC:24:11:2E:C5:4A,bridge=vmbr0,tag=20` or `model=virtio,macaddr=..`.
    pub fn parse(index: u32, value: &str) -> Self {
        let mut dev = NetDevice {
            index,
            model: String::new(),
            mac: None,
            bridge: None,
            tag: None,
        };
        for (i, part) in value.split(',').enumerate() {
            let (k, v) = match part.split_once('=') {
                Some((k, v)) => (k.trim(), Some(v.trim())),
                None => (part.trim(), None),
            };
            match (k, v) {
                ("model", Some(m)) => dev.model = m.to_string(),
                ("macaddr", Some(m)) => dev.mac = Some(m.to_string()),
                ("bridge", Some(b)) => dev.bridge = Some(b.to_string()),
                ("tag", Some(t)) => dev.tag = t.parse().ok(),
                (m, mac) if i == 0 && NIC_MODELS.contains(&m) => {
                    dev.model = m.to_string();
                    if let Some(mac) = mac {
                        dev.mac = Some(mac.to_string());
                    }
                }
                (m, None) if i == 0 => dev.model = m.to_string(),
                _ => {}
            }
        }
        dev
    }
}

/// Parses a property string (`a=1,b=2`, with an optional leading default-key value).
pub fn parse_property_string(value: &str, default_key: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for part in value.split(',').filter(|p| !p.is_empty()) {
        match part.split_once('=') {
            Some((k, v)) => {
                out.insert(k.trim().to_string(), v.trim().to_string());
            }
            None => {
                out.insert(default_key.to_string(), part.trim().to_string());
            }
        }
    }
    out
}

/// A PCI resource mapping (`GET /cluster/mapping/pci`, PVE 8+): the logical device a
/// `hostpciN: mapping=<id>` names, with the host device that stands for it on each node.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
pub struct PciMapping {
    /// Mapping ID.
    pub id: String,
    /// Description of the logical device.
    #[serde(default, deserialize_with = "de::opt_string")]
    pub description: Option<String>,
    /// The node entries; several on one node are alternatives, the first free one is used
    /// when a VM starts. A malformed entry fails the decoding.
    #[serde(default, deserialize_with = "pci_map_entries")]
    pub map: Vec<PciMapEntry>,
}

impl PciMapping {
    /// The entries for `node` (none: a VM using the mapping cannot start there).
    pub fn entries_on<'a>(&'a self, node: &'a str) -> impl Iterator<Item = &'a PciMapEntry> + 'a {
        self.map.iter().filter(move |e| e.node == node)
    }
}

/// One node's entry of a PCI mapping, parsed from its property string
/// (`node=pve1,path=0000:01:00.0,id=10de:2204,iommugroup=14`).
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct PciMapEntry {
    /// Node.
    pub node: String,
    /// Host device address (`0000:01:00.0`); without function the whole device, `;` joins
    /// devices passed through together.
    pub path: String,
    /// Expected `vendor:device` (`10de:2204`).
    pub id: String,
    /// Expected IOMMU group.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub iommugroup: Option<i64>,
    /// Expected `subsystem-vendor:subsystem-device`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub subsystem_id: Option<String>,
    /// Description of this node's device.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// Keys this client does not know (a newer PVE's), kept as sent.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub extra: BTreeMap<String, String>,
}

impl PciMapEntry {
    /// Parses an entry as PVE's mapping format has it: `key=value` pairs only, each key
    /// once, `node`, `path` and `id` present, `iommugroup` an integer.
    pub fn parse(text: &str) -> std::result::Result<Self, String> {
        let mut fields: BTreeMap<String, String> = BTreeMap::new();
        for part in text.split(',').filter(|p| !p.trim().is_empty()) {
            let (key, value) = part
                .split_once('=')
                .filter(|(k, v)| !k.trim().is_empty() && !v.trim().is_empty())
                .ok_or_else(|| format!("PCI mapping entry '{text}': '{part}' is not key=value"))?;
            if fields
                .insert(key.trim().to_owned(), value.trim().to_owned())
                .is_some()
            {
                return Err(format!(
                    "PCI mapping entry '{text}': key '{}' appears twice",
                    key.trim()
                ));
            }
        }
        let mut take = |key: &str| fields.remove(key);
        let mut required = |key: &str| {
            take(key).ok_or_else(|| format!("PCI mapping entry '{text}' has no '{key}'"))
        };
        let node = required("node")?;
        let path = required("path")?;
        let id = required("id")?;
        let iommugroup = take("iommugroup")
            .map(|g| {
                g.parse::<i64>().map_err(|_| {
                    format!("PCI mapping entry '{text}': iommugroup '{g}' is not an integer")
                })
            })
            .transpose()?;
        Ok(Self {
            node,
            path,
            id,
            iommugroup,
            subsystem_id: take("subsystem-id"),
            description: take("description"),
            extra: fields,
        })
    }
}

/// A mapping's `map`: a list of entry property strings (`null` or absent: none).
fn pci_map_entries<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> std::result::Result<Vec<PciMapEntry>, D::Error> {
    use serde::de::Error as _;
    let texts = Option::<Vec<String>>::deserialize(d)?.unwrap_or_default();
    texts
        .iter()
        .map(|t| PciMapEntry::parse(t).map_err(D::Error::custom))
        .collect()
}

/// A host PCI device (`GET /nodes/{node}/hardware/pci`), IDs as sysfs writes them (`0x10de`).
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
pub struct PciDevice {
    /// Address (`0000:01:00.0`).
    pub id: String,
    /// PCI class (`0x030000`).
    #[serde(default)]
    pub class: String,
    /// Vendor ID.
    #[serde(default)]
    pub vendor: String,
    /// Device ID.
    #[serde(default)]
    pub device: String,
    /// IOMMU group (-1: no IOMMU).
    #[serde(default, deserialize_with = "de::opt_i64")]
    pub iommugroup: Option<i64>,
    /// Subsystem vendor ID.
    #[serde(default)]
    pub subsystem_vendor: Option<String>,
    /// Subsystem device ID.
    #[serde(default)]
    pub subsystem_device: Option<String>,
    /// Vendor name.
    #[serde(default)]
    pub vendor_name: Option<String>,
    /// Device name.
    #[serde(default)]
    pub device_name: Option<String>,
    /// The device can create mediated devices.
    #[serde(default, deserialize_with = "de::bool_lenient")]
    pub mdev: bool,
}

/// One entry of `GET /nodes/{node}/storage`.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
pub struct StorageEntry {
    /// Storage id.
    pub storage: String,
    /// Plugin type (`dir`, `lvmthin`, `rbd`, ...).
    #[serde(rename = "type", default)]
    pub kind: String,
    /// Content types, comma separated.
    #[serde(default)]
    pub content: String,
    /// Active on this node.
    #[serde(default, deserialize_with = "de::bool_lenient")]
    pub active: bool,
    /// Enabled.
    #[serde(default, deserialize_with = "de::bool_lenient")]
    pub enabled: bool,
    /// Shared between nodes.
    #[serde(default, deserialize_with = "de::bool_lenient")]
    pub shared: bool,
    /// Total bytes.
    #[serde(default, deserialize_with = "de::u64_or_zero")]
    pub total: u64,
    /// Used bytes.
    #[serde(default, deserialize_with = "de::u64_or_zero")]
    pub used: u64,
    /// Available bytes.
    #[serde(default, deserialize_with = "de::u64_or_zero")]
    pub avail: u64,
}

impl StorageEntry {
    /// Whether the storage holds the given content type (`iso`, `images`, ...).
    pub fn has_content(&self, kind: &str) -> bool {
        self.content.split(',').any(|c| c.trim() == kind)
    }
}

/// One entry of `GET /nodes/{node}/storage/{storage}/content`.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
pub struct StorageContent {
    /// Volume id, e.g. `local:iso/seed.iso`.
    pub volid: String,
    /// Content type.
    #[serde(default)]
    pub content: String,
    /// Format (`iso`, `raw`, `qcow2`, ...).
    #[serde(default)]
    pub format: String,
    /// Size in bytes.
    #[serde(default, deserialize_with = "de::u64_or_zero")]
    pub size: u64,
    /// Creation time (a string on PVE 6).
    #[serde(default, deserialize_with = "de::opt_u64")]
    pub ctime: Option<u64>,
    /// Owning VMID.
    #[serde(default, deserialize_with = "de::opt_vmid")]
    pub vmid: Option<u32>,
}

/// `GET /nodes/{node}/tasks/{upid}/status`.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
pub struct TaskStatus {
    /// The UPID.
    pub upid: String,
    /// Node.
    #[serde(default)]
    pub node: String,
    /// Running or stopped.
    pub status: TaskState,
    /// Exit status when stopped: `OK`, `WARNINGS: n`, or the error text.
    #[serde(default)]
    pub exitstatus: Option<String>,
    /// Task type.
    #[serde(rename = "type", default)]
    pub task_type: String,
    /// Object id.
    #[serde(default, deserialize_with = "de::opt_string")]
    pub id: Option<String>,
    /// User.
    #[serde(default)]
    pub user: String,
    /// Worker pid.
    #[serde(default, deserialize_with = "de::opt_u64")]
    pub pid: Option<u64>,
    /// Start time (unix seconds).
    #[serde(default, deserialize_with = "de::opt_u64")]
    pub starttime: Option<u64>,
}

impl TaskStatus {
    /// Whether the task has finished.
    pub fn is_finished(&self) -> bool {
        self.status == TaskState::Stopped
    }

    /// Whether the task finished successfully (`OK` or `WARNINGS: n`).
    pub fn is_success(&self) -> bool {
        self.is_finished()
            && self
                .exitstatus
                .as_deref()
                .is_some_and(|e| e == "OK" || e.starts_with("WARNINGS"))
    }
}

/// One task of `GET /nodes/{node}/tasks`: an ended one carries its end and exit status.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
pub struct NodeTask {
    /// The UPID.
    pub upid: String,
    /// Start time (unix seconds).
    #[serde(default, deserialize_with = "de::opt_u64")]
    pub starttime: Option<u64>,
    /// End time (unix seconds), once ended.
    #[serde(default, deserialize_with = "de::opt_u64")]
    pub endtime: Option<u64>,
    /// Exit status once ended: `OK`, `WARNINGS: n`, or the error text.
    #[serde(default)]
    pub status: Option<String>,
}

impl NodeTask {
    /// Whether the task ended (it has an end time or an exit status).
    pub fn ended(&self) -> bool {
        self.endtime.is_some() || self.status.is_some()
    }

    /// What `GET /nodes/{node}/tasks/{upid}/status` would answer about the task's state.
    pub fn as_status(&self) -> TaskStatus {
        let ended = self.ended();
        TaskStatus {
            upid: self.upid.clone(),
            node: String::new(),
            status: if ended {
                TaskState::Stopped
            } else {
                TaskState::Running
            },
            exitstatus: self.status.clone().filter(|_| ended),
            task_type: String::new(),
            id: None,
            user: String::new(),
            pid: None,
            starttime: self.starttime,
        }
    }
}

/// One line of a task log.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
pub struct TaskLogLine {
    /// Line number (1-based).
    #[serde(deserialize_with = "de::u64_or_zero")]
    pub n: u64,
    /// Text.
    #[serde(default)]
    pub t: String,
}

/// An IP address reported by the guest agent.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
pub struct AgentIpAddress {
    /// The address.
    #[serde(rename = "ip-address")]
    pub ip_address: String,
    /// `ipv4` or `ipv6`.
    #[serde(rename = "ip-address-type", default)]
    pub ip_address_type: String,
    /// Prefix length.
    #[serde(default, deserialize_with = "de::u64_or_zero")]
    pub prefix: u64,
}

/// A guest network interface reported by the guest agent.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
pub struct AgentInterface {
    /// Interface name (`eth0`).
    pub name: String,
    /// MAC (lowercase in real guests).
    #[serde(rename = "hardware-address", default)]
    pub hardware_address: Option<String>,
    /// Addresses (absent for some interfaces).
    #[serde(rename = "ip-addresses", default)]
    pub ip_addresses: Vec<AgentIpAddress>,
}

/// `GET .../agent/exec-status`.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
pub struct AgentExecStatus {
    /// Whether the process has exited.
    #[serde(default, deserialize_with = "de::bool_lenient")]
    pub exited: bool,
    /// Exit code, once exited.
    #[serde(default, deserialize_with = "de::opt_i64")]
    pub exitcode: Option<i64>,
    /// Standard output (already base64-decoded by Proxmox).
    #[serde(rename = "out-data", default)]
    pub out_data: Option<String>,
    /// Standard error.
    #[serde(rename = "err-data", default)]
    pub err_data: Option<String>,
    /// Signal that killed the process.
    #[serde(default, deserialize_with = "de::opt_i64")]
    pub signal: Option<i64>,
    /// Output was truncated.
    #[serde(
        rename = "out-truncated",
        default,
        deserialize_with = "de::bool_lenient"
    )]
    pub out_truncated: bool,
}

/// `POST .../agent/exec` result.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
pub struct AgentExecStarted {
    /// Guest pid to poll with exec-status.
    #[serde(deserialize_with = "de::u64_or_zero")]
    pub pid: u64,
}

/// `GET .../agent/get-osinfo` result (`result` object of the agent).
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
pub struct AgentOsInfo {
    /// OS id (`ubuntu`).
    #[serde(default)]
    pub id: Option<String>,
    /// Pretty name.
    #[serde(rename = "pretty-name", default)]
    pub pretty_name: Option<String>,
    /// Version.
    #[serde(default)]
    pub version: Option<String>,
    /// Kernel release.
    #[serde(rename = "kernel-release", default)]
    pub kernel_release: Option<String>,
}

/// A pool from `GET /pools`.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
pub struct Pool {
    /// Pool id.
    pub poolid: String,
    /// Comment.
    #[serde(default)]
    pub comment: Option<String>,
    /// Members (only with `?poolid=`).
    #[serde(default)]
    pub members: Vec<ClusterResource>,
}

/// Result of a call that starts a task: a UPID, or `None` when Proxmox finished synchronously.
pub type TaskRef = Option<Upid>;

/// Parameters of `POST /nodes/{node}/qemu/{vmid}/clone`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CloneParams {
    /// New VMID (required).
    pub newid: u32,
    /// Name (dns-name format).
    pub name: Option<String>,
    /// Description.
    pub description: Option<String>,
    /// Target node (only from shared storage).
    pub target: Option<String>,
    /// Full clone (default for non-templates).
    pub full: Option<bool>,
    /// Target storage (full clones only).
    pub storage: Option<String>,
    /// Disk format (full clones only).
    pub format: Option<String>,
    /// Pool to add the clone to.
    pub pool: Option<String>,
    /// Snapshot to clone from.
    pub snapname: Option<String>,
}

/// Parameters of `DELETE /nodes/{node}/qemu/{vmid}`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeleteParams {
    /// Remove from backup jobs, replication and HA too.
    pub purge: bool,
    /// Also delete disks with the VMID that the config does not reference.
    pub destroy_unreferenced_disks: bool,
}

/// A config change for `POST`/`PUT .../config`: values to set, keys to delete, optional digest.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ConfigUpdate {
    /// Options to set (`cores`, `net0`, `ide2`, `tags`, ...), already in Proxmox syntax.
    pub set: BTreeMap<String, String>,
    /// Options to remove.
    pub delete: Vec<String>,
    /// Digest from a previous GET; the write fails if the config changed since.
    pub digest: Option<String>,
}

impl ConfigUpdate {
    /// Adds an option to set.
    pub fn set(mut self, key: &str, value: impl ToString) -> Self {
        self.set.insert(key.to_string(), value.to_string());
        self
    }

    /// Adds an option to delete.
    pub fn delete(mut self, key: &str) -> Self {
        self.delete.push(key.to_string());
        self
    }

    /// Sets the digest.
    pub fn digest(mut self, digest: Option<String>) -> Self {
        self.digest = digest;
        self
    }

    pub(crate) fn to_form(&self) -> Vec<(String, String)> {
        let mut form: Vec<(String, String)> = self
            .set
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        if !self.delete.is_empty() {
            form.push(("delete".to_string(), self.delete.join(",")));
        }
        if let Some(d) = &self.digest {
            form.push(("digest".to_string(), d.clone()));
        }
        form
    }
}

/// Power actions on `POST .../status/{action}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PowerAction {
    /// Start.
    Start,
    /// Hard stop.
    Stop,
    /// ACPI shutdown.
    Shutdown,
    /// Resume a paused guest.
    Resume,
}

impl PowerAction {
    /// Path segment.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Start => "start",
            Self::Stop => "stop",
            Self::Shutdown => "shutdown",
            Self::Resume => "resume",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_config_after_an_update_has_what_was_set_and_deleted_and_no_digest() {
        let read: VmConfig = serde_json::from_value(serde_json::json!({
            "digest": "abc", "memory": 2048, "ide0": "local:iso/seed.iso,media=cdrom",
            "net0": "virtio=BC:24:11:00:00:01,bridge=vmbr0"
        }))
        .expect("config");
        let update = ConfigUpdate::default()
            .set("memory", 4096)
            .set("tags", "capmox")
            .delete("ide0")
            .digest(read.digest());
        let updated = read.updated(&update);
        assert_eq!(updated.get("memory").as_deref(), Some("4096"));
        assert_eq!(updated.get("tags").as_deref(), Some("capmox"));
        assert_eq!(updated.get("ide0"), None);
        assert_eq!(updated.get("net0"), read.get("net0"));
        assert_eq!(updated.digest(), None, "a guarded write needs a fresh read");
    }

    #[test]
    fn volume_storages_are_those_of_disks_and_images_not_empty_drives() {
        // The drives of go-proxmox's many-devices config fixture, plus empty and host drives.
        let cfg: VmConfig = serde_json::from_value(serde_json::json!({
            "ide0": "local:100/vm-101-disk-0.qcow2",
            "ide1": "none,media=cdrom",
            "ide2": "local:iso/debian-12.iso,media=cdrom",
            "ide3": "cdrom,media=cdrom",
            "sata0": "local-lvm:vm-101-disk-1,size=32G",
            "sata1": "/dev/disk/by-id/ata-X,size=1T",
            "scsi0": "file=ceph:vm-101-disk-0,size=32G",
            "scsihw": "virtio-scsi-pci",
            "unused0": "nfs:vm-101-unused",
            "virtio0": "local-lvm:vm-101-disk-2,size=64G",
            "efidisk0": "local-zfs:vm-101-disk-3,efitype=4m"
        }))
        .expect("decodes");
        assert_eq!(
            cfg.volume_storages(),
            ["ceph", "local", "local-lvm", "local-zfs"]
        );
        assert!(VmConfig::default().volume_storages().is_empty());
    }

    #[test]
    fn config_accessors() {
        let cfg: VmConfig = serde_json::from_str(
            r#"{"memory":"4096","numa":0,"net0":"virtio=BC:24:11:2E:C5:4A,bridge=vmbr0,tag=20","net1":"model=e1000,macaddr=AA:BB:CC:DD:EE:FF","scsihw":"virtio-scsi-pci","scsi0":"local:1","tags":"b;a","template":1,"digest":"abc"}"#,
        )
        .expect("decodes");
        assert_eq!(cfg.memory_mib(), Some(4096));
        assert!(cfg.is_template());
        assert_eq!(cfg.tags(), vec!["a", "b"]);
        assert_eq!(cfg.indexed("scsi").len(), 1);
        assert_eq!(cfg.indexed("numa").len(), 0);
        let nics = cfg.nics();
        assert_eq!(nics[0].mac.as_deref(), Some("BC:24:11:2E:C5:4A"));
        assert_eq!(nics[0].tag, Some(20));
        assert_eq!(nics[1].model, "e1000");
        assert_eq!(nics[1].mac.as_deref(), Some("AA:BB:CC:DD:EE:FF"));
        let cfg: VmConfig = serde_json::from_str(r#"{"memory":2048}"#).expect("decodes");
        assert_eq!(cfg.memory_mib(), Some(2048));
    }

    #[test]
    fn open_enums_keep_unknown_values() {
        let r: ClusterResource =
            serde_json::from_str(r#"{"id":"sdn/x","type":"network"}"#).expect("decodes");
        assert_eq!(r.kind, ResourceType::Network);
        let r: ClusterResource =
            serde_json::from_str(r#"{"id":"x/y","type":"fancy"}"#).expect("decodes");
        assert_eq!(r.kind, ResourceType::Other("fancy".into()));
    }

    #[test]
    fn task_outcomes() {
        let t = |status: &str, exit: Option<&str>| TaskStatus {
            upid: String::new(),
            node: String::new(),
            status: TaskState::from(status),
            exitstatus: exit.map(str::to_string),
            task_type: String::new(),
            id: None,
            user: String::new(),
            pid: None,
            starttime: None,
        };
        assert!(t("stopped", Some("OK")).is_success());
        assert!(t("stopped", Some("WARNINGS: 2")).is_success());
        assert!(!t("stopped", Some("unexpected status")).is_success());
        assert!(!t("stopped", None).is_success());
        assert!(!t("running", None).is_finished());
    }

    #[test]
    fn ha_migration_answers_of_both_versions_decode() {
        let nine: HaMigration = serde_json::from_value(serde_json::json!({
            "sid": "vm:101", "requested-node": "pve2",
            "comigrated-resources": ["vm:104"],
            "blocking-resources": [{"sid": "vm:102", "cause": "resource-affinity"}]
        }))
        .expect("PVE 9");
        assert_eq!(nine.requested_node.as_deref(), Some("pve2"));
        assert_eq!(nine.comigrated_resources, ["vm:104"]);
        assert_eq!(nine.blocking_resources[0].sid, "vm:102");
        let bare: HaMigration =
            serde_json::from_value(serde_json::json!({"sid": "vm:101", "requested-node": "pve2"}))
                .expect("nothing affine");
        assert!(bare.comigrated_resources.is_empty() && bare.blocking_resources.is_empty());
        let eight: Option<HaMigration> =
            serde_json::from_value(serde_json::Value::Null).expect("PVE 8");
        assert_eq!(eight.unwrap_or_default(), HaMigration::default());
    }

    #[test]
    fn pci_mappings_decode_with_their_entries_parsed() {
        // the shape of PVE's answer (dclone of the pci.cfg section, plus id and digest)
        let list: Vec<PciMapping> = serde_json::from_value(serde_json::json!([
            {"id": "gpu", "type": "pci", "description": "RTX 3090", "digest": "0123abcd",
             "map": ["node=pve1,path=0000:01:00.0,id=10de:2204,iommugroup=14,subsystem-id=1458:4032",
                     "id=10de:2204,iommugroup=30,node=pve2,path=0000:41:00.0;0000:41:00.1,description=second slot",
                     "node=pve3,path=0000:81:00,id=10de:2204,newer-key=1"]},
            {"id": "empty", "type": "pci", "map": null}
        ]))
        .expect("decodes");
        let gpu = &list[0];
        assert_eq!(gpu.description.as_deref(), Some("RTX 3090"));
        assert_eq!(
            gpu.map[0],
            PciMapEntry {
                node: "pve1".into(),
                path: "0000:01:00.0".into(),
                id: "10de:2204".into(),
                iommugroup: Some(14),
                subsystem_id: Some("1458:4032".into()),
                description: None,
                extra: BTreeMap::new(),
            }
        );
        assert_eq!(gpu.map[1].path, "0000:41:00.0;0000:41:00.1");
        assert_eq!(gpu.map[1].description.as_deref(), Some("second slot"));
        assert_eq!(gpu.map[2].iommugroup, None);
        assert_eq!(gpu.map[2].extra["newer-key"], "1");
        assert_eq!(gpu.entries_on("pve2").count(), 1);
        assert_eq!(gpu.entries_on("pve9").count(), 0);
        assert!(list[1].map.is_empty() && list[1].description.is_none());
    }

    #[test]
    fn malformed_pci_mapping_entries_are_errors() {
        for (entry, error) in [
            ("path=0000:01:00.0,id=10de:2204", "has no 'node'"),
            ("node=pve1,id=10de:2204", "has no 'path'"),
            ("node=pve1,path=0000:01:00.0", "has no 'id'"),
            (
                "node=pve1,path=0000:01:00.0,id=10de:2204,iommugroup=x",
                "iommugroup 'x' is not an integer",
            ),
            (
                "node=pve1,node=pve2,path=0000:01:00.0,id=10de:2204",
                "key 'node' appears twice",
            ),
            (
                "pve1,path=0000:01:00.0,id=10de:2204",
                "'pve1' is not key=value",
            ),
            (
                "node=,path=0000:01:00.0,id=10de:2204",
                "'node=' is not key=value",
            ),
        ] {
            let e = PciMapEntry::parse(entry).expect_err(entry);
            assert!(e.contains(error), "{entry}: {e}");
            let decoded = serde_json::from_value::<PciMapping>(
                serde_json::json!({"id": "gpu", "map": [entry]}),
            );
            assert!(decoded.is_err(), "{entry}");
        }
        let e = serde_json::from_value::<PciMapping>(serde_json::json!({"id": "gpu", "map": "x"}))
            .expect_err("map is a list");
        assert!(e.to_string().contains("expected a sequence"), "{e}");
    }

    #[test]
    fn host_pci_devices_decode() {
        let devices: Vec<PciDevice> = serde_json::from_value(serde_json::json!([
            {"id": "0000:01:00.0", "class": "0x030000", "vendor": "0x10de", "device": "0x2204",
             "iommugroup": 14, "subsystem_vendor": "0x1458", "subsystem_device": "0x4032",
             "vendor_name": "NVIDIA Corporation", "device_name": "GA102 [GeForce RTX 3090]", "mdev": 1},
            {"id": "0000:00:1f.3", "class": "0x040300", "vendor": "0x8086", "device": "0xa348", "iommugroup": -1}
        ]))
        .expect("decodes");
        assert_eq!(devices[0].iommugroup, Some(14));
        assert!(devices[0].mdev && !devices[1].mdev);
        assert_eq!(devices[1].iommugroup, Some(-1));
        assert_eq!(devices[1].subsystem_vendor, None);
    }

    #[test]
    fn config_update_form() {
        let u = ConfigUpdate::default()
            .set("cores", 2)
            .delete("ide2")
            .delete("net1")
            .digest(Some("d".into()));
        let form = u.to_form();
        assert!(form.contains(&("cores".into(), "2".into())));
        assert!(form.contains(&("delete".into(), "ide2,net1".into())));
        assert!(form.contains(&("digest".into(), "d".into())));
    }
}
