//! The machine's part in [`crate::controller::task_slots`]: a clone waits for its node's and
//! storages' slots and holds them while it runs. A resize of a machine's new VM does not wait
//! (it would queue a half-made machine behind clones that have not begun) but holds its node's
//! slot while it runs, so clones wait for it.

use kube::runtime::controller::Action;
use kube::runtime::reflector::ObjectRef;

use super::outcome::{Flow, waiting};
use super::task::{TaskKind, TaskPurpose};
use super::{Reconcile, Scope};
use crate::controller::task_slots::{Slot, WAITER_RECHECK, Want};
use crate::placement::{MachineTaskLimits, StorageInfo};
use crate::proxmox::{ProxmoxClient, Upid};

/// The reason of a machine waiting for a clone or disk task slot.
pub(super) const WAITING_FOR_TASK_SLOT: &str = "WaitingForTaskSlot";

/// What a clone needs: the slots of its nodes (source and target) and of the storages it
/// writes to, each with the machine's limit.
pub(super) fn clone_wants(
    endpoint: &str,
    source_node: &str,
    target: &str,
    storages: &[String],
    known: &[StorageInfo],
    limits: MachineTaskLimits,
) -> Vec<Want> {
    let mut wants = Vec::new();
    if let Some(limit) = limits.per_node {
        let node = |node: &str| Want {
            slot: Slot::Node {
                endpoint: endpoint.to_owned(),
                node: node.to_owned(),
            },
            limit,
        };
        wants.push(node(target));
        if source_node != target {
            wants.push(node(source_node));
        }
    }
    let Some(limit) = limits.per_storage else {
        return wants;
    };
    for storage in storages {
        let shared = known
            .iter()
            .any(|s| s.storage == *storage && s.shared && s.node == target);
        wants.push(Want {
            slot: Slot::Storage {
                endpoint: endpoint.to_owned(),
                storage: storage.clone(),
                node: (!shared).then(|| target.to_owned()),
            },
            limit,
        });
    }
    wants
}

impl Reconcile<'_> {
    fn slot_holder(&self) -> ObjectRef<crate::api::ProxmoxMachine> {
        ObjectRef::from_obj(self.machine)
    }

    /// Takes the slots `wants` names for the machine's clone, or says where it waits in line.
    pub(super) fn take_task_slots(&self, wants: Vec<Want>) -> Flow {
        match self.context.task_slots.acquire(&self.slot_holder(), wants) {
            Ok(()) => Ok(()),
            Err(queued) => Err(waiting(
                WAITING_FOR_TASK_SLOT,
                queued.to_string(),
                Action::requeue(WAITER_RECHECK),
            )),
        }
    }

    /// After the look at the machine's task: a running clone or resize keeps (or, after a
    /// restart or for a resize, takes) its node slots; once none runs they go to the next in
    /// line, and a deletion also gives up its place in line.
    pub(super) fn task_slots_after_look(
        &self,
        scope: &Scope,
        proxmox: &ProxmoxClient,
        deleting: bool,
    ) {
        let slots = &self.context.task_slots;
        let running = scope.status.task_ref.as_deref().and_then(|raw| {
            let kind = scope
                .status
                .task_purpose
                .as_deref()
                .map(TaskPurpose::parse)
                .and_then(|p| p.kind)?;
            let upid: Upid = raw.parse().ok()?;
            matches!(
                kind,
                TaskKind::Clone | TaskKind::Resize | TaskKind::AddDisks
            )
            .then_some(upid)
        });
        match running {
            Some(upid) => {
                let node = |node: &str| Slot::Node {
                    endpoint: proxmox.endpoint().to_owned(),
                    node: node.to_owned(),
                };
                let mut held = vec![node(&upid.node)];
                if let Some(target) = scope.status.proxmox_node.as_deref()
                    && target != upid.node
                {
                    held.push(node(target));
                }
                slots.hold(&self.slot_holder(), held);
            }
            None if deleting => slots.forget(&self.slot_holder()),
            None => slots.release(&self.slot_holder()),
        }
    }

    /// The machine is past its disk work (or let go): its slots go to the next in line (its
    /// next look at its task would give them up too; a pass that ends before that look, as a
    /// paused one does, must not keep them).
    pub(super) fn task_slots_done(&self, released: bool) {
        let slots = &self.context.task_slots;
        if released {
            slots.forget(&self.slot_holder());
        } else {
            slots.release(&self.slot_holder());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_clone_wants_its_nodes_and_storages_shared_ones_by_name_local_ones_per_node() {
        let known = vec![
            StorageInfo {
                node: "pve2".into(),
                storage: "ceph".into(),
                shared: true,
            },
            StorageInfo {
                node: "pve2".into(),
                storage: "local-lvm".into(),
                shared: false,
            },
        ];
        let limits = MachineTaskLimits {
            per_node: Some(2),
            per_storage: Some(3),
        };
        let storages = ["ceph".to_owned(), "local-lvm".to_owned()];
        let wants = clone_wants(
            "https://pve:8006",
            "pve1",
            "pve2",
            &storages,
            &known,
            limits,
        );
        let shown: Vec<(String, u32)> = wants
            .iter()
            .map(|w| (w.slot.to_string(), w.limit))
            .collect();
        assert_eq!(
            shown,
            [
                ("node pve2".to_owned(), 2),
                ("node pve1".to_owned(), 2),
                ("shared storage ceph".to_owned(), 3),
                ("storage local-lvm on pve2".to_owned(), 3),
            ]
        );
        let same_node = clone_wants("https://pve:8006", "pve2", "pve2", &[], &known, limits);
        assert_eq!(same_node.len(), 1, "one node, no storage named");
        let unlimited = clone_wants(
            "https://pve:8006",
            "pve1",
            "pve2",
            &storages,
            &known,
            MachineTaskLimits::default(),
        );
        assert!(unlimited.is_empty(), "no limit set: nothing to wait for");
    }
}
