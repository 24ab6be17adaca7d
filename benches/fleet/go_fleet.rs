//! The fleet as the Go provider (`--provider go`) can be given it, kept free of I/O so
//! `tests/it/bench_go_fleet.rs` can test it.
//!
//! The Go provider (v0.9) has no failure domains and clones a template by node and VMID
//! (`sourceNode`, `templateID`; a tag selector must match exactly one template, and the
//! bench's nodes each hold a copy). A template on local storage can only be cloned on its own
//! node, so each node gets its own ProxmoxMachineTemplate and MachineDeployment, pinned there
//! with `allowedNodes`, and the control plane one template on the first node. Its zones
//! survive as `zoneConfig` IP pools, which a machine selects with `network.zone`.

use std::path::Path;

use serde_json::{Value, json};

/// The Go provider's fields that a real API server would default from its CRDs (the
/// in-process server applies no defaults): `full`, a device's `name` and `model`.
const FULL_CLONE: bool = true;
const DEVICE_MODEL: &str = "virtio";

/// The template copies' sizes in a Go provider run: below the machines' (2 cores, 2048 MiB).
/// The Go provider's provisioning steps each start from the reason the step before left on
/// its condition; when the machine's sizes, NICs and description equal the template's, its
/// configuration step writes nothing, leaves the reason at `Cloning`, and every later step
/// (disk, addresses, cloud-init ISO, power-on, guest checks) is skipped: the machine is
/// reported provisioned with its clone stopped and unconfigured.
pub const TEMPLATE_MEMORY_MIB: u64 = 1024;
pub const TEMPLATE_CORES: u32 = 1;

/// One Proxmox node the fleet may use: its name, its zone and the VMID of its template copy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GoNode {
    pub name: String,
    pub zone: String,
    pub template_vmid: u32,
}

/// One zone's IP pool: its name, the address range, the prefix, the gateway and DNS server.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GoZone {
    pub name: String,
    pub addresses: String,
    pub prefix: u32,
    pub gateway: String,
    pub dns: String,
}

/// The ProxmoxCluster spec (v1alpha2 of the Go provider): every node allowed, the default
/// pool and one pool per zone, with the addresses capmox's bench cluster has.
pub fn cluster_spec(nodes: &[GoNode], zones: &[GoZone]) -> Value {
    json!({
        "controlPlaneEndpoint": {"host": "10.0.0.10", "port": 6443},
        "allowedNodes": nodes.iter().map(|n| n.name.as_str()).collect::<Vec<_>>(),
        "dnsServers": ["10.0.0.2"],
        "ipv4Config": {"addresses": ["10.0.1.1-10.0.15.250"], "prefix": 16, "gateway": "10.0.0.1", "metric": 100},
        "zoneConfig": zones
            .iter()
            .map(|z| json!({
                "zone": z.name,
                "dnsServers": [z.dns],
                "ipv4Config": {"addresses": [z.addresses], "prefix": z.prefix, "gateway": z.gateway, "metric": 100},
            }))
            .collect::<Vec<_>>(),
    })
}

/// A machine spec pinned to `node`: cloned from the node's own template copy, with the sizes
/// of capmox's bench machines and an address from the node's zone pool.
pub fn machine_spec(node: &GoNode) -> Value {
    json!({
        "sourceNode": node.name,
        "templateID": node.template_vmid,
        "full": FULL_CLONE,
        "allowedNodes": [node.name],
        "memoryMiB": 2048,
        "numCores": 2,
        "disks": {"bootVolume": {"disk": "scsi0", "sizeGb": 20}},
        "network": {
            "zone": node.zone,
            "networkDevices": [{"name": "net0", "bridge": "vmbr0", "model": DEVICE_MODEL, "defaultIPv4": true}],
        },
    })
}

/// Workers per node when the first node also holds `control_plane` machines: each worker
/// goes to the node with the fewest machines (the first of them on ties), so the totals
/// differ by at most one wherever the control plane allows.
pub fn workers_per_node(workers: u32, nodes: usize, control_plane: u32) -> Vec<u32> {
    if nodes == 0 {
        return Vec::new();
    }
    let mut totals = vec![0u32; nodes];
    totals[0] = control_plane;
    for _ in 0..workers {
        if let Some(emptiest) = (0..nodes).min_by_key(|i| (totals[*i], *i)) {
            totals[emptiest] += 1;
        }
    }
    totals[0] -= control_plane;
    totals
}

/// The zone of a node in the report's placement (the Go provider records none on a machine):
/// the zone of the node the machine's VM is on.
pub fn zone_of_node<'a>(nodes: &'a [GoNode], node: &str) -> Option<&'a str> {
    nodes
        .iter()
        .find(|n| n.name == node)
        .map(|n| n.zone.as_str())
}

/// The severity letter of a klog text line (`I`, `W`, `E` or `F` followed by the month and
/// day, as in `E1206 04:50:00.123456 ...`); `None` for a line without a klog header.
pub fn klog_level(line: &str) -> Option<char> {
    let mut chars = line.chars();
    let level = chars
        .next()
        .filter(|c| matches!(c, 'I' | 'W' | 'E' | 'F'))?;
    let date: String = chars.by_ref().take(4).collect();
    (date.len() == 4 && date.chars().all(|c| c.is_ascii_digit()) && chars.next() == Some(' '))
        .then_some(level)
}

/// The name the API server counts a Go client's requests under: client-go's default
/// User-Agent starts with the executable's file name.
pub fn go_client_name(binary: &Path) -> String {
    binary
        .file_name()
        .map(|name| name.to_string_lossy().into_owned())
        .unwrap_or_default()
}
