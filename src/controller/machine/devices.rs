//! What the scheduler needs beyond memory: the PCI devices a machine asks for on each node
//! (from Proxmox's resource mappings and the machines recorded there) and the room on each
//! node's own storages for its data disks.

use std::collections::BTreeMap;
use std::sync::Arc;

use kube::ResourceExt;

use super::outcome::Flow;
use super::{During, Reconcile};
use crate::api::ProxmoxMachine;
use crate::controller::inventory::PciMappingDevices;
use crate::placement::{PciOnNode, Placement};
use crate::proxmox::{ClusterResource, ProxmoxClient, ResourceType};

/// The devices of the mappings a machine asks for, per node: how many each mapping lists there
/// and the machines recorded there holding one.
#[derive(Default)]
pub(super) struct PciDevicesByNode {
    wanted: Vec<String>,
    mapped: Arc<PciMappingDevices>,
    /// (node, machine, mappings it holds a device of), for machines recorded on a node.
    holders: Vec<(String, String, Vec<String>)>,
}

impl PciDevicesByNode {
    /// The mappings' devices on `node`.
    pub(super) fn on(&self, node: &str) -> BTreeMap<String, PciOnNode> {
        self.wanted
            .iter()
            .map(|mapping| {
                let devices = self
                    .mapped
                    .get(mapping)
                    .and_then(|nodes| nodes.get(node))
                    .copied()
                    .unwrap_or(0);
                let holders = self
                    .holders
                    .iter()
                    .filter(|(on, _, _)| on == node)
                    .flat_map(|(_, name, held)| {
                        held.iter().filter(|h| *h == mapping).map(|_| name.clone())
                    })
                    .collect();
                (mapping.clone(), PciOnNode { devices, holders })
            })
            .collect()
    }
}

impl Reconcile<'_> {
    /// The devices of the mappings `placement` takes devices of, from Proxmox's mappings and
    /// the machines (of any cluster this process serves) recorded on its nodes; nothing is
    /// read for a machine without PCI devices.
    pub(super) async fn pci_devices(
        &self,
        proxmox: &ProxmoxClient,
        placement: &Placement,
    ) -> Flow<PciDevicesByNode> {
        let wanted: Vec<String> = placement.pci_counts().into_keys().collect();
        if wanted.is_empty() {
            return Ok(PciDevicesByNode::default());
        }
        let mapped = self
            .context
            .inventory
            .pci_mapping_devices(proxmox)
            .await
            .during(|| "reading Proxmox's PCI resource mappings".to_owned())?;
        let machines = self
            .reads()
            .all_where(
                self.context.config.watch_namespace.as_deref(),
                |m: &ProxmoxMachine| !m.spec.pci_devices.is_empty(),
            )
            .await?;
        let endpoint = proxmox.endpoint();
        let holders = machines
            .iter()
            .filter_map(|m| {
                let status = m.status.as_ref()?;
                let on_this_endpoint = status
                    .proxmox_endpoint
                    .as_deref()
                    .is_none_or(|e| e == endpoint);
                let node = status.proxmox_node.clone().filter(|_| on_this_endpoint)?;
                let mappings = m.spec.pci_devices.iter().map(|d| d.mapping.clone());
                Some((node, m.name_any(), mappings.collect()))
            })
            .collect();
        Ok(PciDevicesByNode {
            wanted,
            mapped,
            holders,
        })
    }
}

/// Free bytes of the node's own storages as Proxmox lists them (shared ones hold no node's
/// data disks alone, so they are not counted against a node).
pub(super) fn local_storage_free(
    resources: &[ClusterResource],
    node: &str,
) -> BTreeMap<String, u64> {
    resources
        .iter()
        .filter(|r| r.kind == ResourceType::Storage && !r.shared)
        .filter(|r| r.node.as_deref() == Some(node))
        .filter_map(|r| {
            let free = r.maxdisk?.saturating_sub(r.disk.unwrap_or(0));
            Some((r.storage.clone()?, free))
        })
        .collect()
}
