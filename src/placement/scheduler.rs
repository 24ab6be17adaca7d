//! The node scheduler: memory accounting as the Go provider does it, then spreading by owner and role.

use std::cmp::Reverse;
use std::collections::BTreeMap;
use std::fmt;

use crate::capi::Machine;

use super::resolve::{
    MachineOwner, MachineRole, NodeCandidates, Placement, machine_owner, machine_role,
};

/// Kind of a Proxmox guest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GuestKind {
    /// A QEMU VM.
    Qemu,
    /// An LXC container.
    Lxc,
}

/// A guest on a node, as far as memory accounting cares.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GuestInfo {
    /// VMID.
    pub vmid: u32,
    /// VM or container.
    pub kind: GuestKind,
    /// Configured maximum memory (`maxmem`) in bytes, counted whether the guest runs or not.
    pub max_memory_bytes: u64,
    /// Templates never run, so they are not counted.
    pub template: bool,
}

/// A capmox machine already on a node, for spreading.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlacedMachine {
    /// ProxmoxMachine name.
    pub name: String,
    /// Its owner (KCP, MachineDeployment, ...).
    pub owner: Option<MachineOwner>,
    /// Control plane or worker.
    pub role: MachineRole,
}

impl PlacedMachine {
    /// A machine on a node, with owner and role derived from its CAPI Machine exactly as
    /// [`Placement::resolve`] derives them for the machine being scheduled.
    pub fn from_machine(name: impl Into<String>, capi_machine: &Machine) -> Self {
        Self {
            name: name.into(),
            owner: machine_owner(capi_machine),
            role: machine_role(capi_machine),
        }
    }
}

/// Devices of one PCI resource mapping on a node, and who holds them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PciOnNode {
    /// Devices the mapping lists for the node.
    pub devices: u32,
    /// Machines recorded on the node that hold one, once per device held.
    pub holders: Vec<String>,
}

/// What the scheduler needs to know about one Proxmox node.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeInfo {
    /// Node name.
    pub name: String,
    /// Total memory of the node in bytes (`/nodes/{node}/status` `memory.total`).
    pub total_memory_bytes: u64,
    /// Every VM and container on the node.
    pub guests: Vec<GuestInfo>,
    /// capmox machines of this cluster on the node.
    pub machines: Vec<PlacedMachine>,
    /// PCI devices by resource mapping, for the mappings the machine asks for.
    pub pci: BTreeMap<String, PciOnNode>,
    /// Free bytes of the node's own (not shared) storages: data disks on them take room here.
    pub local_storage_free: BTreeMap<String, u64>,
}

impl NodeInfo {
    /// Memory that may still be promised, before reservations: total × adjustment / 100 minus the
    /// `maxmem` of every non-template guest, saturating at 0; `None` when adjustment 0 disables accounting.
    pub fn reservable_bytes(&self, memory_adjustment: u64) -> Option<u64> {
        if memory_adjustment == 0 {
            return None;
        }
        let budget = u128::from(self.total_memory_bytes) * u128::from(memory_adjustment) / 100;
        let used: u128 = self
            .guests
            .iter()
            .filter(|g| !g.template)
            .map(|g| u128::from(g.max_memory_bytes))
            .sum();
        Some(u64::try_from(budget.saturating_sub(used)).unwrap_or(u64::MAX))
    }
}

/// The candidate nodes the controller could read, built from Proxmox responses.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeInventory {
    /// The nodes (unreachable nodes are simply left out).
    pub nodes: Vec<NodeInfo>,
}

impl NodeInventory {
    /// The node of that name, if known.
    pub fn node(&self, name: &str) -> Option<&NodeInfo> {
        self.nodes.iter().find(|n| n.name == name)
    }
}

/// Memory promised to a machine whose VM is still being created.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reservation {
    /// ProxmoxMachine name.
    pub machine: String,
    /// Node chosen for it.
    pub node: String,
    /// Memory promised.
    pub memory_bytes: u64,
    /// VMID once known: when the node lists that guest, its own `maxmem` counts instead.
    pub vmid: Option<u32>,
    /// Owner, for spreading.
    pub owner: Option<MachineOwner>,
    /// Role, for spreading.
    pub role: MachineRole,
    /// PCI devices promised, by resource mapping.
    pub pci: BTreeMap<String, u32>,
    /// Data disk bytes promised, by storage.
    pub disk_bytes: BTreeMap<String, u64>,
}

/// Memory promised to machines still being created, so machines scheduled in parallel cannot
/// both take the last slot. Keep one per controller behind a lock and call
/// [`Reservations::schedule_and_reserve`] under it; release once the VM is visible or gone.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Reservations {
    by_machine: BTreeMap<String, Reservation>,
}

impl Reservations {
    /// No reservations.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records the scheduler's choice (replacing an earlier reservation of the same machine).
    pub fn reserve(&mut self, choice: &NodeChoice) {
        self.by_machine.insert(
            choice.machine.clone(),
            Reservation {
                machine: choice.machine.clone(),
                node: choice.node.clone(),
                memory_bytes: choice.memory_bytes,
                vmid: None,
                owner: choice.owner.clone(),
                role: choice.role,
                pci: choice.pci.clone(),
                disk_bytes: choice.disk_bytes.clone(),
            },
        );
    }

    /// Notes the VMID of a reserved machine, so its guest is not counted twice once it appears.
    pub fn set_vmid(&mut self, machine: &str, vmid: u32) {
        if let Some(r) = self.by_machine.get_mut(machine) {
            r.vmid = Some(vmid);
        }
    }

    /// Drops a machine's reservation (its VM is running, or it was deleted); returns it.
    pub fn release(&mut self, machine: &str) -> Option<Reservation> {
        self.by_machine.remove(machine)
    }

    /// Drops the reservations whose VM the inventory now lists (by VMID on the reserved node),
    /// since the guest's own `maxmem` counts from then on; returns the machines released.
    pub fn release_visible(&mut self, inventory: &NodeInventory) -> Vec<String> {
        let visible: Vec<String> = self
            .by_machine
            .values()
            .filter(|r| {
                r.vmid.is_some_and(|id| {
                    inventory
                        .node(&r.node)
                        .is_some_and(|n| n.guests.iter().any(|g| g.vmid == id))
                })
            })
            .map(|r| r.machine.clone())
            .collect();
        for machine in &visible {
            self.by_machine.remove(machine);
        }
        visible
    }

    /// Every reservation, by machine name.
    pub fn iter(&self) -> impl Iterator<Item = &Reservation> {
        self.by_machine.values()
    }

    /// The reservation of a machine.
    pub fn get(&self, machine: &str) -> Option<&Reservation> {
        self.by_machine.get(machine)
    }

    /// Number of reservations.
    pub fn len(&self) -> usize {
        self.by_machine.len()
    }

    /// Whether nothing is reserved.
    pub fn is_empty(&self) -> bool {
        self.by_machine.is_empty()
    }

    /// Schedules and, on success, reserves in one step (atomic under the caller's lock).
    pub fn schedule_and_reserve(
        &mut self,
        placement: &Placement,
        inventory: &NodeInventory,
        request: &ScheduleRequest,
    ) -> Result<NodeChoice, ScheduleError> {
        let choice = schedule(placement, inventory, self, request)?;
        self.reserve(&choice);
        Ok(choice)
    }

    fn on_node<'a>(&'a self, node: &'a str) -> impl Iterator<Item = &'a Reservation> + 'a {
        self.by_machine.values().filter(move |r| r.node == node)
    }
}

/// What is being scheduled: the machine and the memory, devices and disk room it needs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ScheduleRequest {
    /// ProxmoxMachine name.
    pub machine: String,
    /// Memory the VM will get, in bytes.
    pub memory_bytes: u64,
    /// PCI devices it takes, by resource mapping.
    pub pci: BTreeMap<String, u32>,
    /// Bytes of data disks by storage (where the storage is known before the clone).
    pub disk_bytes: BTreeMap<String, u64>,
}

impl ScheduleRequest {
    /// The request for a placement: `memoryMiB`, else the template's memory (the Go provider
    /// used 0 there, which always fits), else 0.
    pub fn new(placement: &Placement, template_memory_bytes: Option<u64>) -> Self {
        Self {
            machine: placement.machine_name().to_owned(),
            memory_bytes: placement
                .requested_memory_bytes()
                .or(template_memory_bytes)
                .unwrap_or(0),
            pci: placement.pci_counts(),
            disk_bytes: placement.data_disk_bytes(),
        }
    }
}

/// The node chosen for a machine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeChoice {
    /// ProxmoxMachine name.
    pub machine: String,
    /// The node.
    pub node: String,
    /// Memory reserved for the machine.
    pub memory_bytes: u64,
    /// Reservable memory the node had before this machine; `None` when accounting is off.
    pub reservable_bytes: Option<u64>,
    /// Owner of the machine.
    pub owner: Option<MachineOwner>,
    /// Role of the machine.
    pub role: MachineRole,
    /// PCI devices reserved, by resource mapping.
    pub pci: BTreeMap<String, u32>,
    /// Data disk bytes reserved, by storage.
    pub disk_bytes: BTreeMap<String, u64>,
}

/// Why no node was chosen.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ScheduleError {
    /// The placement clones on the template's node; there is nothing to schedule.
    #[error(
        "machine {machine} has no allowed nodes or zone nodes: it is cloned on its template's node without scheduling"
    )]
    NotScheduled {
        /// ProxmoxMachine name.
        machine: String,
    },
    /// None of the candidate nodes is online in the inventory; retried.
    #[error(
        "none of the candidate nodes {candidates:?} of machine {machine} is online in Proxmox: \
         the machine waits until one is (see the ProxmoxCluster's FailureDomainsAvailable)"
    )]
    NoNodesAvailable {
        /// ProxmoxMachine name.
        machine: String,
        /// The candidate nodes.
        candidates: Vec<String>,
    },
    /// No candidate node has enough reservable memory; retried.
    #[error(
        "cannot reserve {} of memory for machine {machine} on any of {candidates:?}: the best node \
         {best_node} has {} reservable left (memoryAdjustment {memory_adjustment}%); free memory, \
         add nodes or raise schedulerHints.memoryAdjustment",
        Bytes(*.requested_bytes),
        Bytes(*.best_available_bytes)
    )]
    InsufficientMemory {
        /// ProxmoxMachine name.
        machine: String,
        /// Memory asked for.
        requested_bytes: u64,
        /// Candidate nodes that were considered.
        candidates: Vec<String>,
        /// The node with the most reservable memory.
        best_node: String,
        /// What that node has left.
        best_available_bytes: u64,
        /// The memory adjustment in effect.
        memory_adjustment: u64,
    },
    /// No candidate node has enough free devices of a PCI mapping; retried.
    #[error(
        "machine {machine} needs {wanted} device(s) of PCI mapping {mapping:?} but no candidate node has that \
         many free ({}); add the nodes' devices to the mapping in Proxmox (Datacenter → Resource \
         Mappings), free a device, or allow nodes that have one",
        free_list(free)
    )]
    NoPciDevice {
        /// ProxmoxMachine name.
        machine: String,
        /// The PCI resource mapping.
        mapping: String,
        /// Devices the machine takes.
        wanted: u32,
        /// Free devices on each candidate node.
        free: Vec<(String, u32)>,
    },
    /// No candidate node's own storage has room for the machine's data disks; retried.
    #[error(
        "machine {machine} needs {} on storage {storage:?} for its data disks, but the most any \
         candidate node's local {storage:?} has free is {} (on {best_node}); free space there, \
         or put the disks on shared storage",
        Bytes(*.requested_bytes),
        Bytes(*.best_free_bytes)
    )]
    InsufficientStorage {
        /// ProxmoxMachine name.
        machine: String,
        /// The node-local storage.
        storage: String,
        /// Bytes the data disks need there.
        requested_bytes: u64,
        /// The node with the most room.
        best_node: String,
        /// Its free bytes after reservations.
        best_free_bytes: u64,
    },
}

fn free_list(free: &[(String, u32)]) -> String {
    free.iter()
        .map(|(node, n)| format!("{node}: {n} free"))
        .collect::<Vec<_>>()
        .join(", ")
}

impl ScheduleError {
    /// Capacity and availability change on their own, so those errors are retried.
    pub fn is_retryable(&self) -> bool {
        !matches!(self, Self::NotScheduled { .. })
    }

    /// Condition reason for the machine's `VirtualMachineProvisioned` condition.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::NotScheduled { .. } => "NotScheduled",
            Self::NoNodesAvailable { .. } => "NodesUnavailable",
            Self::InsufficientMemory { .. } => "InsufficientMemory",
            Self::NoPciDevice { .. } => "PciDeviceUnavailable",
            Self::InsufficientStorage { .. } => "InsufficientStorage",
        }
    }
}

/// Bytes in a human form with the exact value, for messages.
struct Bytes(u64);

impl fmt::Display for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const MIB: u64 = 1 << 20;
        if self.0 >= MIB && self.0.is_multiple_of(MIB) {
            write!(f, "{} MiB", self.0 / MIB)
        } else {
            write!(f, "{} B", self.0)
        }
    }
}

/// One candidate node with its figures.
struct Candidate<'a> {
    name: &'a str,
    reservable: Option<u64>,
    same_owner: usize,
    same_role: usize,
    /// Free devices of each PCI resource mapping the machine asks for.
    pci_free: BTreeMap<&'a str, u32>,
    /// Free bytes of each node-local storage the machine's data disks go to.
    disk_free: BTreeMap<&'a str, u64>,
}

impl Candidate<'_> {
    fn has_devices(&self, request: &ScheduleRequest) -> bool {
        request
            .pci
            .iter()
            .all(|(key, wanted)| self.pci_free.get(key.as_str()).is_some_and(|f| f >= wanted))
    }

    fn has_room(&self, request: &ScheduleRequest) -> bool {
        request.disk_bytes.iter().all(|(storage, bytes)| {
            self.disk_free
                .get(storage.as_str())
                .is_none_or(|free| free >= bytes)
        })
    }

    fn has_memory(&self, request: &ScheduleRequest) -> bool {
        self.reservable.is_none_or(|r| request.memory_bytes <= r)
    }
}

/// Chooses a node for `request` among the placement's candidate nodes.
///
/// A node fits when it has the PCI devices asked for free, room on its own storages for the
/// data disks, and, when accounting is on, reservable memory (after other machines'
/// reservations) for the request. Among fitting nodes the one with the fewest machines of the
/// same owner wins, then the fewest of the same role, then the most reservable memory, then the
/// name. A machine that already holds a reservation on a candidate node keeps it.
pub fn schedule(
    placement: &Placement,
    inventory: &NodeInventory,
    reservations: &Reservations,
    request: &ScheduleRequest,
) -> Result<NodeChoice, ScheduleError> {
    let NodeCandidates::Nodes(candidates) = placement.candidates() else {
        return Err(ScheduleError::NotScheduled {
            machine: request.machine.clone(),
        });
    };
    let choice = |node: &str, reservable: Option<u64>| NodeChoice {
        machine: request.machine.clone(),
        node: node.to_owned(),
        memory_bytes: request.memory_bytes,
        reservable_bytes: reservable,
        owner: placement.owner().cloned(),
        role: placement.role(),
        pci: request.pci.clone(),
        disk_bytes: request.disk_bytes.clone(),
    };

    let mut nodes = Vec::new();
    for name in candidates {
        let Some(info) = inventory.node(name) else {
            continue;
        };
        let candidate = candidate(placement, info, reservations, request);
        if reservations
            .get(&request.machine)
            .is_some_and(|r| r.node == *name)
        {
            return Ok(choice(name, candidate.reservable));
        }
        nodes.push(candidate);
    }

    if nodes.is_empty() {
        return Err(ScheduleError::NoNodesAvailable {
            machine: request.machine.clone(),
            candidates: candidates.clone(),
        });
    }

    let best = nodes
        .iter()
        .filter(|c| c.has_devices(request) && c.has_room(request) && c.has_memory(request))
        .min_by_key(|c| {
            (
                c.same_owner,
                c.same_role,
                Reverse(c.reservable.unwrap_or(u64::MAX)),
                c.name,
            )
        });
    match best {
        Some(best) => Ok(choice(best.name, best.reservable)),
        None => Err(nothing_fits(placement, &nodes, request, candidates)),
    }
}

/// A candidate node's figures once other machines' reservations are taken off.
fn candidate<'a>(
    placement: &Placement,
    info: &'a NodeInfo,
    reservations: &'a Reservations,
    request: &'a ScheduleRequest,
) -> Candidate<'a> {
    let name = info.name.as_str();
    let others = || {
        reservations
            .on_node(name)
            .filter(|r| r.machine != request.machine)
    };
    // Reserved for a VM the node does not list yet: once listed, the VM counts by itself.
    let unlisted = || {
        others().filter(|r| {
            r.vmid
                .is_none_or(|id| !info.guests.iter().any(|g| g.vmid == id))
        })
    };
    let reserved: u64 = unlisted()
        .map(|r| r.memory_bytes)
        .fold(0, u64::saturating_add);
    let reservable = info
        .reservable_bytes(placement.memory_adjustment())
        .map(|r| r.saturating_sub(reserved));
    // Machines on the node: those Proxmox shows plus those reserved but not yet listed.
    let mut members: Vec<(Option<&MachineOwner>, MachineRole)> = info
        .machines
        .iter()
        .filter(|m| m.name != request.machine)
        .map(|m| (m.owner.as_ref(), m.role))
        .collect();
    members.extend(
        others()
            .filter(|r| !info.machines.iter().any(|m| m.name == r.machine))
            .map(|r| (r.owner.as_ref(), r.role)),
    );
    let pci_free = request
        .pci
        .keys()
        .map(|key| {
            let on_node = info.pci.get(key).cloned().unwrap_or_default();
            let held = on_node
                .holders
                .iter()
                .filter(|h| **h != request.machine)
                .count();
            // A reservation whose machine is recorded on the node is among the holders.
            let promised: u32 = others()
                .filter(|r| !on_node.holders.contains(&r.machine))
                .filter_map(|r| r.pci.get(key))
                .sum();
            let used = u32::try_from(held)
                .unwrap_or(u32::MAX)
                .saturating_add(promised);
            (key.as_str(), on_node.devices.saturating_sub(used))
        })
        .collect();
    let disk_free = request
        .disk_bytes
        .keys()
        .filter_map(|storage| {
            let free = *info.local_storage_free.get(storage)?;
            let promised: u64 = unlisted()
                .filter_map(|r| r.disk_bytes.get(storage))
                .fold(0, |a, b| a.saturating_add(*b));
            Some((storage.as_str(), free.saturating_sub(promised)))
        })
        .collect();
    let owner = placement.owner();
    let role = placement.role();
    Candidate {
        name,
        reservable,
        same_owner: owner.map_or(0, |o| {
            members.iter().filter(|(mo, _)| *mo == Some(o)).count()
        }),
        same_role: members.iter().filter(|(_, r)| *r == role).count(),
        pci_free,
        disk_free,
    }
}

/// Why no candidate fits: the devices first, then the disks' room, then memory (each among the
/// nodes that passed the checks before it).
fn nothing_fits(
    placement: &Placement,
    nodes: &[Candidate<'_>],
    request: &ScheduleRequest,
    candidates: &[String],
) -> ScheduleError {
    let machine = request.machine.clone();
    if let Some((key, wanted)) = request.pci.iter().find(|(key, wanted)| {
        !nodes
            .iter()
            .any(|c| c.pci_free.get(key.as_str()).is_some_and(|f| f >= *wanted))
    }) {
        return ScheduleError::NoPciDevice {
            machine,
            mapping: key.clone(),
            wanted: *wanted,
            free: nodes
                .iter()
                .map(|c| {
                    let free = c.pci_free.get(key.as_str()).copied().unwrap_or(0);
                    (c.name.to_owned(), free)
                })
                .collect(),
        };
    }
    let with_devices: Vec<&Candidate<'_>> =
        nodes.iter().filter(|c| c.has_devices(request)).collect();
    for (storage, bytes) in &request.disk_bytes {
        let room = |c: &Candidate<'_>| c.disk_free.get(storage.as_str()).copied();
        if with_devices
            .iter()
            .all(|c| room(c).is_some_and(|free| free < *bytes))
        {
            let best = with_devices
                .iter()
                .copied()
                .max_by_key(|c| (room(c), Reverse(c.name)));
            return ScheduleError::InsufficientStorage {
                machine,
                storage: storage.clone(),
                requested_bytes: *bytes,
                best_node: best.map(|c| c.name.to_owned()).unwrap_or_default(),
                best_free_bytes: best.and_then(room).unwrap_or(0),
            };
        }
    }
    // Accounting is on here, or everything would fit: name the node closest to fitting.
    let closest = with_devices
        .iter()
        .filter(|c| c.has_room(request))
        .min_by_key(|c| (Reverse(c.reservable.unwrap_or(0)), c.name));
    let (best_node, best_available_bytes) = closest
        .map(|c| (c.name.to_owned(), c.reservable.unwrap_or(0)))
        .unwrap_or_default();
    ScheduleError::InsufficientMemory {
        machine,
        requested_bytes: request.memory_bytes,
        candidates: candidates.to_vec(),
        best_node,
        best_available_bytes,
        memory_adjustment: placement.memory_adjustment(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{ProxmoxCluster, SchedulerHints};
    use crate::placement::fixtures::{capi_machine, cluster, machine};

    const GIB: u64 = 1 << 30;

    fn vm(vmid: u32, gib: u64) -> GuestInfo {
        GuestInfo {
            vmid,
            kind: GuestKind::Qemu,
            max_memory_bytes: gib * GIB,
            template: false,
        }
    }

    fn node(name: &str, total_gib: u64, guests: Vec<GuestInfo>) -> NodeInfo {
        NodeInfo {
            name: name.to_owned(),
            total_memory_bytes: total_gib * GIB,
            guests,
            ..NodeInfo::default()
        }
    }

    fn placed(name: &str, owner: &str, role: MachineRole) -> PlacedMachine {
        PlacedMachine {
            name: name.to_owned(),
            owner: Some(MachineOwner {
                kind: "KubeadmControlPlane".to_owned(),
                name: owner.to_owned(),
            }),
            role,
        }
    }

    fn with_adjustment(adj: Option<i64>, allowed: &[&str]) -> ProxmoxCluster {
        let mut c = cluster(allowed, vec![]);
        c.spec.scheduler_hints = adj.map(|a| SchedulerHints {
            memory_adjustment: Some(a),
        });
        c
    }

    /// A control-plane machine of KCP `kcp` asking for `gib` GiB on the given allowed nodes.
    fn placement(c: &ProxmoxCluster, name: &str, gib: i32) -> Placement {
        let mut m = machine(name, &[], None);
        m.spec.memory_mib = Some(gib * 1024);
        Placement::resolve(
            c,
            &m,
            &capi_machine(name, None, true, Some(("KubeadmControlPlane", "kcp"))),
        )
        .unwrap()
    }

    fn request(p: &Placement) -> ScheduleRequest {
        ScheduleRequest::new(p, None)
    }

    #[test]
    fn reservable_memory_table() {
        let template = GuestInfo {
            template: true,
            ..vm(900, 64)
        };
        let container = GuestInfo {
            kind: GuestKind::Lxc,
            ..vm(300, 2)
        };
        // (case, total GiB, guests, adjustment, want GiB or None)
        type Case = (&'static str, u64, Vec<GuestInfo>, u64, Option<u64>);
        let cases: Vec<Case> = vec![
            ("empty node, 100%", 64, vec![], 100, Some(64)),
            (
                "VMs and containers count, templates do not",
                64,
                vec![vm(100, 8), container.clone(), template],
                100,
                Some(54),
            ),
            ("overcommit 300%", 64, vec![vm(100, 8)], 300, Some(184)),
            ("headroom 50%", 64, vec![vm(100, 8)], 50, Some(24)),
            (
                "saturates at zero",
                16,
                vec![vm(100, 12), vm(101, 12)],
                100,
                Some(0),
            ),
            ("0 disables accounting", 16, vec![vm(100, 64)], 0, None),
        ];
        for (name, total, guests, adj, want) in cases {
            let got = node("n", total, guests).reservable_bytes(adj);
            assert_eq!(got, want.map(|g| g * GIB), "{name}");
        }
        // total × adjustment / 100 is computed without overflow or early rounding.
        let big = NodeInfo {
            total_memory_bytes: u64::MAX,
            ..node("n", 0, vec![])
        };
        assert_eq!(big.reservable_bytes(200), Some(u64::MAX));
        let odd = NodeInfo {
            total_memory_bytes: 999,
            ..node("n", 0, vec![])
        };
        assert_eq!(odd.reservable_bytes(50), Some(499));
    }

    #[test]
    fn unset_memory_adjustment_means_100_percent() {
        let c = with_adjustment(None, &["pve1"]);
        let p = placement(&c, "m1", 8);
        let inv = NodeInventory {
            nodes: vec![node("pve1", 16, vec![vm(100, 8)])],
        };
        let choice = schedule(&p, &inv, &Reservations::new(), &request(&p)).unwrap();
        assert_eq!(choice.reservable_bytes, Some(8 * GIB));
        let p = placement(&c, "m1", 9);
        assert!(schedule(&p, &inv, &Reservations::new(), &request(&p)).is_err());
    }

    #[test]
    fn spread_order_owner_then_role_then_memory_then_name() {
        let c = with_adjustment(None, &["a", "b", "c"]);
        let p = placement(&c, "m1", 1);
        let cp = MachineRole::ControlPlane;
        let w = MachineRole::Worker;
        let mut worker_of_other = placed("x", "other", w);
        worker_of_other.owner = None;
        // (case, nodes, want)
        let cases: Vec<(&str, Vec<NodeInfo>, &str)> = vec![
            (
                "fewest machines of the same owner beats memory",
                vec![
                    NodeInfo {
                        machines: vec![placed("k1", "kcp", cp)],
                        ..node("a", 256, vec![])
                    },
                    node("b", 16, vec![]),
                    NodeInfo {
                        machines: vec![placed("k2", "kcp", cp)],
                        ..node("c", 256, vec![])
                    },
                ],
                "b",
            ),
            (
                "then fewest of the same role",
                vec![
                    NodeInfo {
                        machines: vec![placed("o1", "other", cp)],
                        ..node("a", 256, vec![])
                    },
                    NodeInfo {
                        machines: vec![worker_of_other.clone()],
                        ..node("b", 16, vec![])
                    },
                    NodeInfo {
                        machines: vec![placed("o2", "other", cp)],
                        ..node("c", 256, vec![])
                    },
                ],
                "b",
            ),
            (
                "then most reservable memory",
                vec![
                    node("a", 16, vec![]),
                    node("b", 32, vec![vm(1, 8)]),
                    node("c", 32, vec![]),
                ],
                "c",
            ),
            (
                "then name",
                vec![
                    node("c", 32, vec![]),
                    node("b", 32, vec![]),
                    node("a", 32, vec![vm(1, 1)]),
                ],
                "b",
            ),
            (
                "nodes that do not fit are skipped even when they spread better",
                vec![
                    NodeInfo {
                        machines: vec![placed("k1", "kcp", cp)],
                        ..node("a", 16, vec![])
                    },
                    node("b", 16, vec![vm(1, 16)]),
                ],
                "a",
            ),
            (
                "nodes outside the placement are ignored",
                vec![node("z", 512, vec![]), node("a", 8, vec![])],
                "a",
            ),
        ];
        for (name, nodes, want) in cases {
            let inv = NodeInventory { nodes };
            let got = schedule(&p, &inv, &Reservations::new(), &request(&p))
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(got.node, want, "{name}");
        }
    }

    #[test]
    fn a_request_equal_to_what_is_left_fits() {
        let c = with_adjustment(None, &["a"]);
        let p = placement(&c, "m1", 8);
        let inv = NodeInventory {
            nodes: vec![node("a", 16, vec![vm(1, 8)])],
        };
        assert_eq!(
            schedule(&p, &inv, &Reservations::new(), &request(&p))
                .unwrap()
                .node,
            "a"
        );
    }

    #[test]
    fn reservations_stop_parallel_machines_taking_the_last_slot() {
        let c = with_adjustment(None, &["a", "b"]);
        let inv = NodeInventory {
            nodes: vec![
                node("a", 16, vec![vm(1, 8)]),
                node("b", 16, vec![vm(2, 12)]),
            ],
        };
        let mut res = Reservations::new();
        let p1 = placement(&c, "m1", 8);
        let p2 = placement(&c, "m2", 8);
        let first = res.schedule_and_reserve(&p1, &inv, &request(&p1)).unwrap();
        assert_eq!(first.node, "a");
        let err = res
            .schedule_and_reserve(&p2, &inv, &request(&p2))
            .unwrap_err();
        assert!(err.is_retryable());
        assert_eq!(err.reason(), "InsufficientMemory");
        assert_eq!(
            err.to_string(),
            "cannot reserve 8192 MiB of memory for machine m2 on any of [\"a\", \"b\"]: the best node \
             b has 4096 MiB reservable left (memoryAdjustment 100%); free memory, add nodes or raise \
             schedulerHints.memoryAdjustment"
        );
        // Once m1's VM shows up on the node with its VMID, its guest counts instead of the reservation.
        res.set_vmid("m1", 101);
        let inv2 = NodeInventory {
            nodes: vec![
                node("a", 16, vec![vm(1, 8), vm(101, 8)]),
                inv.nodes[1].clone(),
            ],
        };
        assert_eq!(
            schedule(&p2, &inv2, &res, &request(&p2))
                .unwrap_err()
                .to_string(),
            err.to_string()
        );
        // Releasing m1 (deleted before its VM existed) frees the slot.
        assert_eq!(res.release("m1").map(|r| r.node), Some("a".to_owned()));
        assert_eq!(
            res.schedule_and_reserve(&p2, &inv, &request(&p2))
                .unwrap()
                .node,
            "a"
        );
        assert_eq!(res.len(), 1);
    }

    #[test]
    fn visible_vms_release_their_reservation() {
        let c = with_adjustment(None, &["a"]);
        let p = placement(&c, "m1", 4);
        let inv = NodeInventory {
            nodes: vec![node("a", 16, vec![])],
        };
        let mut res = Reservations::new();
        res.schedule_and_reserve(&p, &inv, &request(&p)).unwrap();
        assert!(res.release_visible(&inv).is_empty(), "no VMID yet");
        res.set_vmid("m1", 150);
        assert!(res.release_visible(&inv).is_empty(), "VM not listed yet");
        let listed = NodeInventory {
            nodes: vec![node("a", 16, vec![vm(150, 4)])],
        };
        assert_eq!(res.release_visible(&listed), ["m1"]);
        assert!(res.is_empty());
        assert_eq!(res.iter().count(), 0);
    }

    #[test]
    fn placed_machines_get_owner_and_role_like_the_placement() {
        let kcp = capi_machine("cp-0", None, true, Some(("KubeadmControlPlane", "kcp")));
        let placed = PlacedMachine::from_machine("cp-0", &kcp);
        assert_eq!(placed.role, MachineRole::ControlPlane);
        assert_eq!(placed.owner.map(|o| o.name), Some("kcp".to_owned()));
    }

    #[test]
    fn reserved_machines_count_for_spreading() {
        let c = with_adjustment(Some(0), &["a", "b"]);
        let inv = NodeInventory {
            nodes: vec![node("a", 16, vec![]), node("b", 16, vec![])],
        };
        let mut res = Reservations::new();
        let nodes: Vec<String> = ["m1", "m2", "m3", "m4"]
            .iter()
            .map(|m| {
                let p = placement(&c, m, 64);
                res.schedule_and_reserve(&p, &inv, &request(&p))
                    .unwrap()
                    .node
            })
            .collect();
        assert_eq!(
            nodes,
            ["a", "b", "a", "b"],
            "accounting off: everything fits, still spread"
        );
    }

    #[test]
    fn scheduling_again_keeps_an_existing_reservation() {
        let c = with_adjustment(None, &["a", "b"]);
        let inv = NodeInventory {
            nodes: vec![node("a", 16, vec![]), node("b", 32, vec![])],
        };
        let mut res = Reservations::new();
        let p = placement(&c, "m1", 8);
        assert_eq!(
            res.schedule_and_reserve(&p, &inv, &request(&p))
                .unwrap()
                .node,
            "b"
        );
        // Even though b now looks fuller (its own reservation is not counted against it), m1 stays.
        let again = res.schedule_and_reserve(&p, &inv, &request(&p)).unwrap();
        assert_eq!(
            (again.node.as_str(), again.reservable_bytes),
            ("b", Some(32 * GIB))
        );
        assert_eq!(res.len(), 1);
    }

    #[test]
    fn template_node_placements_are_not_scheduled() {
        let c = cluster(&[], vec![]);
        let p = placement(&c, "m1", 1);
        let err = schedule(
            &p,
            &NodeInventory::default(),
            &Reservations::new(),
            &request(&p),
        )
        .unwrap_err();
        assert!(!err.is_retryable());
        assert_eq!(
            err.to_string(),
            "machine m1 has no allowed nodes or zone nodes: it is cloned on its template's node \
             without scheduling"
        );
    }

    #[test]
    fn unreadable_nodes_are_reported() {
        let c = with_adjustment(None, &["a", "b"]);
        let p = placement(&c, "m1", 1);
        let err = schedule(
            &p,
            &NodeInventory::default(),
            &Reservations::new(),
            &request(&p),
        )
        .unwrap_err();
        assert!(err.is_retryable());
        assert_eq!(err.reason(), "NodesUnavailable");
        assert_eq!(
            err.to_string(),
            "none of the candidate nodes [\"a\", \"b\"] of machine m1 is online in Proxmox: \
             the machine waits until one is (see the ProxmoxCluster's FailureDomainsAvailable)"
        );
    }

    #[test]
    fn request_memory_falls_back_to_the_template() {
        let c = with_adjustment(None, &["a"]);
        let mut m = machine("m1", &[], None);
        m.spec.memory_mib = None;
        let p = Placement::resolve(&c, &m, &capi_machine("m1", None, false, None)).unwrap();
        assert_eq!(
            ScheduleRequest::new(&p, Some(4 * GIB)).memory_bytes,
            4 * GIB
        );
        assert_eq!(ScheduleRequest::new(&p, None).memory_bytes, 0);
        let p = placement(&c, "m1", 2);
        assert_eq!(
            ScheduleRequest::new(&p, Some(4 * GIB)).memory_bytes,
            2 * GIB
        );
    }

    #[test]
    fn byte_amounts_read_well() {
        assert_eq!(Bytes(3 * GIB).to_string(), "3072 MiB");
        assert_eq!(Bytes(1000).to_string(), "1000 B");
        assert_eq!(Bytes(0).to_string(), "0 B");
    }

    /// A worker asking for `devices` devices of mapping `gpu` (and `disk_gib` GiB of data disks
    /// on `local-lvm`) on nodes pve1-pve3.
    fn device_placement(name: &str, devices: usize, disk_gib: i32) -> Placement {
        let c = with_adjustment(Some(0), &["pve1", "pve2", "pve3"]);
        let mut m = machine(name, &[], None);
        m.spec.pci_devices = vec![
            crate::api::PciDevice {
                mapping: "gpu".to_owned(),
                ..Default::default()
            };
            devices
        ];
        if disk_gib > 0 {
            m.spec.disks = Some(crate::api::Storage {
                boot_volume: None,
                additional_volumes: vec![crate::api::AdditionalVolume {
                    disk: "scsi1".to_owned(),
                    size_gb: disk_gib,
                    storage: Some("local-lvm".to_owned()),
                    ..Default::default()
                }],
            });
        }
        Placement::resolve(&c, &m, &capi_machine(name, None, false, None)).unwrap()
    }

    /// Nodes pve1-pve3 with `gpu` devices (devices, holders) each.
    fn gpu_nodes(per_node: [(u32, &[&str]); 3]) -> NodeInventory {
        NodeInventory {
            nodes: ["pve1", "pve2", "pve3"]
                .iter()
                .zip(per_node)
                .map(|(name, (devices, holders))| NodeInfo {
                    pci: BTreeMap::from([(
                        "gpu".to_owned(),
                        PciOnNode {
                            devices,
                            holders: holders.iter().map(|h| (*h).to_owned()).collect(),
                        },
                    )]),
                    ..node(name, 64, vec![])
                })
                .collect(),
        }
    }

    #[test]
    fn pci_mapping_table() {
        // (case, devices and holders per node, devices asked for, want node or error text)
        type Case = (
            &'static str,
            [(u32, &'static [&'static str]); 3],
            usize,
            &'static str,
        );
        let cases: Vec<Case> = vec![
            (
                "only the node with the mapping",
                [(0, &[]), (1, &[]), (0, &[])],
                1,
                "pve2",
            ),
            (
                "a used device is not free",
                [(1, &["m0"]), (0, &[]), (1, &[])],
                1,
                "pve3",
            ),
            (
                "two devices on one node",
                [(1, &[]), (2, &["m0"]), (3, &["m0"])],
                2,
                "pve3",
            ),
            (
                "all used up",
                [(1, &["m0"]), (1, &["m1"]), (0, &[])],
                1,
                "needs 1 device(s) of PCI mapping \"gpu\" but no candidate node has that many free (pve1: 0 free, pve2: 0 free, pve3: 0 free)",
            ),
            (
                "no node of the zone has the mapping",
                [(0, &[]), (0, &[]), (0, &[])],
                1,
                "Resource Mappings",
            ),
            (
                "its own device is free for it",
                [(1, &["w"]), (0, &[]), (0, &[])],
                1,
                "pve1",
            ),
        ];
        for (case, per_node, devices, want) in cases {
            let p = device_placement("w", devices, 0);
            let got = schedule(&p, &gpu_nodes(per_node), &Reservations::new(), &request(&p));
            match got {
                Ok(choice) => assert_eq!(choice.node, want, "{case}"),
                Err(error) => {
                    assert_eq!(error.reason(), "PciDeviceUnavailable", "{case}");
                    assert!(error.is_retryable(), "{case}");
                    assert!(error.to_string().contains(want), "{case}: {error}");
                }
            }
        }
    }

    #[test]
    fn reserved_devices_are_not_handed_out_twice() {
        let mut reservations = Reservations::new();
        let inventory = gpu_nodes([(1, &[]), (1, &[]), (0, &[])]);
        let mut chosen = Vec::new();
        for name in ["a", "b", "c"] {
            let p = device_placement(name, 1, 0);
            chosen.push(reservations.schedule_and_reserve(&p, &inventory, &request(&p)));
        }
        assert_eq!(chosen[0].as_ref().map(|c| c.node.as_str()), Ok("pve1"));
        assert_eq!(chosen[1].as_ref().map(|c| c.node.as_str()), Ok("pve2"));
        assert!(
            matches!(chosen[2], Err(ScheduleError::NoPciDevice { .. })),
            "{:?}",
            chosen[2]
        );
        // Once a machine is recorded on its node, it counts as a holder, not twice.
        let recorded = gpu_nodes([(1, &["a"]), (1, &[]), (0, &[])]);
        let p = device_placement("c", 1, 0);
        assert!(
            reservations
                .schedule_and_reserve(&p, &recorded, &request(&p))
                .is_err()
        );
        reservations.release("b");
        let choice = reservations.schedule_and_reserve(&p, &recorded, &request(&p));
        assert_eq!(choice.map(|c| c.node), Ok("pve2".to_owned()));
    }

    #[test]
    fn data_disks_take_room_on_node_local_storage_only() {
        let with_local = |free: [Option<u64>; 3]| NodeInventory {
            nodes: ["pve1", "pve2", "pve3"]
                .iter()
                .zip(free)
                .map(|(name, free)| NodeInfo {
                    local_storage_free: free
                        .map(|gib| BTreeMap::from([("local-lvm".to_owned(), gib * GIB)]))
                        .unwrap_or_default(),
                    ..node(name, 64, vec![])
                })
                .collect(),
        };
        let p = device_placement("w", 0, 100);
        assert_eq!(p.data_disk_bytes().get("local-lvm"), Some(&(100 * GIB)));
        let pick = |inventory: &NodeInventory| {
            schedule(&p, inventory, &Reservations::new(), &request(&p)).map(|c| c.node)
        };
        assert_eq!(
            pick(&with_local([Some(50), Some(150), Some(99)])),
            Ok("pve2".into())
        );
        // Not listed as a local storage of the node (shared, or not known): not counted.
        assert_eq!(
            pick(&with_local([Some(50), None, Some(99)])),
            Ok("pve2".into())
        );
        let full = pick(&with_local([Some(50), Some(20), Some(99)])).unwrap_err();
        assert_eq!(full.reason(), "InsufficientStorage");
        assert!(
            full.to_string().contains(
                "needs 102400 MiB on storage \"local-lvm\" for its data disks, but the most any candidate node's local \"local-lvm\" has free is 101376 MiB (on pve3)"
            ),
            "{full}"
        );
        // Reserved disks of a machine whose VM is not listed yet take room too.
        let mut reservations = Reservations::new();
        let room = with_local([Some(150), Some(10), Some(10)]);
        let first = reservations.schedule_and_reserve(&p, &room, &request(&p));
        assert_eq!(first.map(|c| c.node), Ok("pve1".to_owned()));
        let q = device_placement("v", 0, 100);
        let second = reservations.schedule_and_reserve(&q, &room, &request(&q));
        assert!(
            matches!(second, Err(ScheduleError::InsufficientStorage { .. })),
            "{second:?}"
        );
    }
}
