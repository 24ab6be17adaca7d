//! PCI passthrough as qemu-server and pve-manager handle it, so machines can be given GPUs
//! through PVE's resource mappings (`hostpciN: mapping=gpu,pcie=1`) or raw host addresses.
//!
//! * `GET /cluster/mapping/pci[?check-node=]` lists the topology's `pci_mappings` as PVE
//!   does: `id`, `type` (`pci`), `description` (when set), `digest` and `map`, each entry a
//!   property string `node=pve1,path=0000:01:00.0,id=10de:2204[,iommugroup=14]
//!   [,subsystem-id=...]`; with `check-node`, `checks` holds the warning `No mapping for node
//!   pve2.` for a mapping without an entry there (the hardware always matches, so no error
//!   checks). `GET /cluster/mapping/pci/{id}` answers the mapping without `id` (500 `mapping
//!   'x' not found`). `GET /nodes/{node}/hardware/pci[?pci-class-blacklist=&verbose=]` lists
//!   the node's `pci_devices` as `lspci` does (IDs as `0x10de`, `iommugroup` -1 without
//!   IOMMU), without the classes `05;06;0b` by default.
//! * Config writes: the `pve-qm-hostpci` format is checked with the other options (400 on the
//!   key: unknown options, `host` not matching `[DOMAIN:]BB:DD[.F][;...]` in lower-case hex,
//!   a `mapping` that is no config ID, booleans, `driver`, the ID overrides); `hostpci16` and
//!   up are not in the schema. Then qemu-server's `check_hostpci_perm` runs on the new value
//!   and on the value it replaces or deletes: only `root@pam` may set, change or delete a raw
//!   device (`only root can set 'hostpci0' config for non-mapped devices`), and a value
//!   without `host` and `mapping` is refused (`either 'host' or 'mapping' must be set.`). The
//!   simulator authenticates API tokens only, and a token (even `root@pam!x`) is not
//!   `root@pam`, so every raw device write is refused: raw devices come from the topology's
//!   guests and templates (a clone copies them). Like the disk allocation, the refusal fails
//!   a `POST`'s `qmconfig` task and a `PUT` with 500, and the write does nothing. A mapping
//!   that does not exist, or `pcie=1` without a q35 machine, is accepted here: PVE looks
//!   neither up before the VM starts.
//! * Start (`qmstart`, also HA starts): as `config_to_command` and `vm_start_nolock` do, for
//!   `hostpci0`..`hostpci15` in order: a mapping without an entry on the VM's node (or that
//!   does not exist) fails with `PCI device mapping not found for 'gpu'`; `host` and
//!   `mapping` together with `Cannot set both 'host' and 'mapping'.`; an address no device of
//!   the node matches (the `lspci` prefix match: `01:00` is every function of `0000:01:00`)
//!   with `no PCI device found for '02:00.0'`; `pcie=1` without a q35 `machine` with `q35
//!   machine model is not enabled at /usr/share/perl5/PVE/QemuServer/PCI.pm line 514.` (a Perl
//!   `die` without newline: PVE 8.4's qemu-server names line 495). A mapping with several
//!   entries on the node takes the first whose devices no other VM holds (`could not find a
//!   free device for 'hostpci0'` when none is free); a raw device, or a mapping with one
//!   entry there, is reserved as it is, and fails when another VM holds it: `PCI device
//!   '0000:01:00.0' already in use by VMID '101'` (that VM runs) or `... is currently
//!   reserved for use by VMID '101'` (its start is under way). The same device twice in one
//!   VM fails with `device '0000:01:00.0' assigned more than once`. A VM holds its devices
//!   from the start request until it stops, its start fails, it is destroyed, or its node
//!   fails; [`Cluster::pci_in_use`] shows them.
//! * Migration (`qmigrate`, i.e. HA migrate, running or not; `QemuMigrate::prepare` and
//!   `check_local_resources`): the task aborts (`migration aborted`) with the cause in its
//!   log: a raw device with `can't migrate VM which uses local devices: hostpci0`, whether
//!   the VM runs or not (the LRM does not pass `force`); a mapped one with `can't migrate to
//!   'pve2': missing mapped devices hostpci0` when the mapping has no entry on the target,
//!   else, when the VM runs, `can't live migrate running VM which uses following mapped
//!   devices: hostpci0:gpu`. A stopped VM with mapped devices whose mappings have entries on
//!   the target migrates offline: PVE does not block mapped devices for offline migration,
//!   the target's entry is chosen at the next start. A running VM is judged by the devices
//!   it started with, as PVE judges it by its current (not pending) config.
//!
//! Simplifications (each says what real PVE does):
//! * a refused `hostpciN` leaves the whole write undone (PVE has written the options it
//!   handled before that one, as pending changes);
//! * a config change of `hostpciN` applies at once, also on a running VM (PVE keeps it
//!   pending until the next start, a reboot included); the devices a running VM holds are
//!   those it started with until it stops (a reboot keeps them, PVE takes the new ones);
//! * `mdev`, `legacy-igd`, `x-vga`, `rombar` and the ID overrides are kept in the config but
//!   change nothing at start (PVE checks legacy IGD rules and creates mediated devices);
//!   mappings with `live-migration-capable` are not simulated;
//! * the permission checks of a mapped device (`Mapping.Use` on `/mapping/pci/<id>`,
//!   `VM.Config.HWType`) always pass, as for a token without privilege separation.

use std::collections::BTreeMap;

use serde_json::{Value, json};

use super::{Cluster, SimError, SimResult};
use crate::topology::{
    PciDeviceSpec, PciMappingSpec, hex_id, is_config_id, is_pci_address, pci_filter_matches,
};
use capmox::proxmox::types::parse_property_string;

/// How many `hostpciN` slots a VM has (qemu-server's `$MAX_HOSTPCI_DEVICES`).
const MAX_HOSTPCI: u32 = 16;

/// The PCI classes `GET /nodes/{node}/hardware/pci` leaves out unless told otherwise:
/// memory controllers, bridges, processors.
const DEFAULT_CLASS_BLACKLIST: &str = "05;06;0b";

/// The options of the `pve-qm-hostpci` format.
const HOSTPCI_OPTIONS: &[&str] = &[
    "host",
    "mapping",
    "rombar",
    "romfile",
    "pcie",
    "x-vga",
    "legacy-igd",
    "mdev",
    "vendor-id",
    "device-id",
    "sub-vendor-id",
    "sub-device-id",
    "driver",
];

const HOSTPCI_BOOLEANS: &[&str] = &["rombar", "pcie", "x-vga", "legacy-igd"];

const HOSTPCI_ID_OVERRIDES: &[&str] = &["vendor-id", "device-id", "sub-vendor-id", "sub-device-id"];

/// Devices one `hostpciN` of a VM holds on its node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct PciHolding {
    /// `hostpci0`.
    key: String,
    /// The mapping it came from, `None` for a raw device.
    mapping: Option<String>,
    /// Full addresses (`0000:01:00.0`).
    ids: Vec<String>,
}

/// A `hostpciN` value as the simulator acts on it.
#[derive(Debug, Default)]
struct HostPci {
    host: Option<String>,
    mapping: Option<String>,
    pcie: bool,
}

/// PVE's `parse_boolean`.
fn parse_boolean(v: &str) -> Option<bool> {
    match v.to_ascii_lowercase().as_str() {
        "1" | "on" | "yes" | "true" => Some(true),
        "0" | "off" | "no" | "false" => Some(false),
        _ => None,
    }
}

/// N of `hostpciN` when it is a slot the schema has (`hostpci0`..`hostpci15`).
pub(super) fn hostpci_index(key: &str) -> Option<u32> {
    let index = key.strip_prefix("hostpci")?;
    let canonical = index == "0" || (!index.is_empty() && !index.starts_with('0'));
    let n: u32 = index
        .parse()
        .ok()
        .filter(|_| canonical && index.chars().all(|c| c.is_ascii_digit()))?;
    (n < MAX_HOSTPCI).then_some(n)
}

/// Parses `value` as `parse_property_string` does with the `pve-qm-hostpci` format: the
/// option map, or the error text after `invalid format - `.
fn parse_options(value: &str) -> Result<BTreeMap<String, String>, String> {
    let mut out = BTreeMap::new();
    for part in value.split(',').filter(|p| !p.trim().is_empty()) {
        let (key, v) = match part.split_once('=') {
            Some((k, v)) if !k.is_empty() && !v.is_empty() => (k.to_owned(), v.to_owned()),
            Some(_) => return Err("missing key in comma-separated list property".into()),
            None => ("host".to_owned(), part.to_owned()),
        };
        if !HOSTPCI_OPTIONS.contains(&key.as_str()) {
            return Err(format!(
                "invalid key in comma-separated list property: {key}"
            ));
        }
        if out.insert(key.clone(), v).is_some() {
            return Err(format!(
                "duplicate key in comma-separated list property: {key}"
            ));
        }
    }
    Ok(out)
}

/// What the `pve-qm-hostpci` format says against one option's value, if anything.
fn option_error(option: &str, value: &str) -> Option<String> {
    let valid = match option {
        "host" => value.split(';').all(|id| is_pci_address(id, false)),
        "mapping" => {
            return (!is_config_id(value))
                .then(|| format!("invalid format - invalid configuration ID '{value}'"));
        }
        "driver" => {
            return (!["vfio", "keep"].contains(&value)).then(|| {
                format!("value '{value}' does not have a value in the enumeration 'vfio, keep'")
            });
        }
        o if HOSTPCI_BOOLEANS.contains(&o) => {
            return parse_boolean(value)
                .is_none()
                .then(|| format!("type check ('boolean') failed - got '{value}'"));
        }
        o if HOSTPCI_ID_OVERRIDES.contains(&o) => value
            .strip_prefix("0x")
            .is_some_and(|hex| hex.len() == 4 && hex.chars().all(|c| c.is_ascii_hexdigit())),
        "romfile" => !value.contains(';'),
        "mdev" => !value.contains(['/', '.', ':']),
        _ => true,
    };
    (!valid).then(|| "value does not match the regex pattern".to_owned())
}

/// What the config schema says against `value` for `key` (`hostpciN`), as a parameter error.
pub(super) fn hostpci_format_error(key: &str, value: &str) -> Option<String> {
    hostpci_index(key)?;
    let options = match parse_options(value) {
        Ok(options) => options,
        Err(e) => return Some(format!("invalid format - {e}")),
    };
    options.iter().find_map(|(option, v)| {
        option_error(option, v)
            .map(|e| format!("invalid format - format error\n{key}.{option}: {e}"))
    })
}

/// The value as the simulator acts on it; `None` when it does not parse (PVE drops such a
/// value with a warning when it reads the config).
fn parse_hostpci(value: &str) -> Option<HostPci> {
    let options = parse_options(value).ok()?;
    Some(HostPci {
        host: options.get("host").cloned(),
        mapping: options.get("mapping").cloned(),
        pcie: options
            .get("pcie")
            .and_then(|p| parse_boolean(p))
            .unwrap_or(false),
    })
}

/// `check_hostpci_perm` for a caller that is not `root@pam`.
fn write_refusal(key: &str, value: &str) -> Option<String> {
    let device = parse_hostpci(value)?;
    if device.host.is_some() {
        Some(format!(
            "only root can set '{key}' config for non-mapped devices"
        ))
    } else if device.mapping.is_none() {
        Some("either 'host' or 'mapping' must be set.".to_owned())
    } else {
        None
    }
}

/// Whether `config`'s `machine` is a q35 one (`machine_type_is_q35`).
fn is_q35(config: &BTreeMap<String, String>) -> bool {
    config.get("machine").is_some_and(|m| {
        parse_property_string(m, "type")
            .get("type")
            .is_some_and(|t| t == "q35" || t.starts_with("pc-q35-"))
    })
}

/// The `hostpciN` options of a config in slot order.
fn hostpci_slots(config: &BTreeMap<String, String>) -> Vec<(u32, &String, &String)> {
    let mut slots: Vec<(u32, &String, &String)> = config
        .iter()
        .filter_map(|(k, v)| Some((hostpci_index(k)?, k, v)))
        .collect();
    slots.sort_by_key(|(n, _, _)| *n);
    slots
}

impl Cluster {
    /// The node's PCI devices.
    fn node_devices(&self, node: &str) -> &[PciDeviceSpec] {
        self.pci_devices.get(node).map_or(&[], Vec::as_slice)
    }

    /// The VM that holds device `id` on `node`, other than `vmid`.
    fn pci_holder(&self, node: &str, id: &str, vmid: u32) -> Option<(u32, bool)> {
        self.vms
            .iter()
            .filter(|(other, vm)| **other != vmid && vm.node == node)
            .find(|(_, vm)| vm.pci.iter().any(|h| h.ids.iter().any(|i| i == id)))
            .map(|(other, vm)| (*other, vm.running))
    }

    /// The devices `filter` names on `node` (`lspci`), or PVE's error.
    fn lspci(&self, node: &str, filter: &str) -> Result<Vec<String>, String> {
        let ids: Vec<String> = self
            .node_devices(node)
            .iter()
            .filter(|d| pci_filter_matches(filter, &d.id))
            .map(|d| d.id.clone())
            .collect();
        if ids.is_empty() {
            return Err(format!("no PCI device found for '{filter}'"));
        }
        Ok(ids)
    }

    /// The alternatives of one `hostpciN` on `node`, each the device IDs used together
    /// (`parse_hostpci`).
    fn alternatives(&self, node: &str, device: &HostPci) -> Result<Vec<Vec<String>>, String> {
        let paths: Vec<String> = match (&device.host, &device.mapping) {
            (Some(_), Some(_)) => return Err("Cannot set both 'host' and 'mapping'.".into()),
            (Some(host), None) => vec![host.clone()],
            (None, Some(name)) => {
                let entries: Vec<String> = self
                    .pci_mappings
                    .get(name)
                    .map(|m| {
                        m.map
                            .iter()
                            .filter(|e| e.node == node)
                            .map(|e| e.path.clone())
                            .collect()
                    })
                    .unwrap_or_default();
                if entries.is_empty() {
                    return Err(format!("PCI device mapping not found for '{name}'"));
                }
                entries
            }
            (None, None) => return Err("Either 'host' or 'mapping' must be set.".into()),
        };
        paths
            .iter()
            .map(|path| {
                let mut ids = Vec::new();
                for filter in path.split(';') {
                    ids.extend(self.lspci(node, filter)?);
                }
                Ok(ids)
            })
            .collect()
    }

    /// The devices VM `vmid` takes when it starts on its node now, or the start task's exit
    /// status; changes nothing. See the module documentation.
    pub(super) fn claim_pci(&self, vmid: u32) -> Result<Vec<PciHolding>, String> {
        let Some(vm) = self.vms.get(&vmid) else {
            return Ok(Vec::new());
        };
        let node = vm.node.as_str();
        let mut parsed = Vec::new();
        for (_, key, value) in hostpci_slots(&vm.config) {
            let Some(device) = parse_hostpci(value) else {
                continue;
            };
            let alternatives = self.alternatives(node, &device)?;
            if device.pcie && !is_q35(&vm.config) {
                let line = if self.pve_major() >= 9 { 514 } else { 495 };
                return Err(format!(
                    "q35 machine model is not enabled at /usr/share/perl5/PVE/QemuServer/PCI.pm line {line}."
                ));
            }
            parsed.push((key.clone(), device.mapping, alternatives));
        }
        let mut used: Vec<String> = Vec::new();
        let mut chosen = Vec::new();
        for (key, mapping, alternatives) in parsed {
            let ids = if let [only] = alternatives.as_slice() {
                if let Some(twice) = only.iter().find(|id| used.contains(id)) {
                    return Err(format!("device '{twice}' assigned more than once"));
                }
                only.clone()
            } else {
                alternatives
                    .into_iter()
                    .find(|ids| {
                        ids.iter().all(|id| {
                            !used.contains(id) && self.pci_holder(node, id, vmid).is_none()
                        })
                    })
                    .ok_or_else(|| format!("could not find a free device for '{key}'"))?
            };
            used.extend(ids.iter().cloned());
            chosen.push(PciHolding { key, mapping, ids });
        }
        // reserve_pci_usage of every chosen device, before QEMU starts
        for id in &used {
            if let Some((holder, running)) = self.pci_holder(node, id, vmid) {
                return Err(if running {
                    format!("PCI device '{id}' already in use by VMID '{holder}'")
                } else {
                    format!("PCI device '{id}' is currently reserved for use by VMID '{holder}'")
                });
            }
        }
        Ok(chosen)
    }

    /// A start of VM `vmid` was accepted: it reserves the devices it takes, or the start
    /// task fails with PVE's message.
    pub(super) fn reserve_pci(&mut self, vmid: u32) -> Result<(), String> {
        let held = self.claim_pci(vmid)?;
        if let Some(vm) = self.vms.get_mut(&vmid) {
            vm.pci = held;
        }
        Ok(())
    }

    /// Why a config write by an API token may not touch the raw devices it names (or the
    /// ones it replaces or deletes); `None` when it may.
    pub(super) fn hostpci_write_refusal(
        &self,
        config: &BTreeMap<String, String>,
        params: &BTreeMap<String, String>,
    ) -> Option<String> {
        let deleted = params
            .get("delete")
            .into_iter()
            .flat_map(|d| d.split([',', ';', ' ']))
            .filter(|k| hostpci_index(k).is_some())
            .filter_map(|k| Some((k, config.get(k)?)));
        let replaced = params
            .keys()
            .filter(|k| hostpci_index(k).is_some())
            .filter_map(|k| Some((k.as_str(), config.get(k)?)));
        let set = params
            .iter()
            .filter(|(k, _)| hostpci_index(k).is_some())
            .map(|(k, v)| (k.as_str(), v));
        deleted
            .chain(replaced)
            .chain(set)
            .find_map(|(key, value)| write_refusal(key, value))
    }

    /// Why migrating VM `vmid` to `target` aborts for its PCI devices; `None` when they do
    /// not keep it. A running VM is judged by the devices it holds.
    pub(super) fn pci_migration_blocker(&self, vmid: u32, target: &str) -> Option<String> {
        let vm = self.vms.get(&vmid)?;
        let devices: Vec<(String, Option<String>)> = if vm.running {
            vm.pci
                .iter()
                .map(|h| (h.key.clone(), h.mapping.clone()))
                .collect()
        } else {
            hostpci_slots(&vm.config)
                .into_iter()
                .filter_map(|(_, k, v)| Some((k.clone(), parse_hostpci(v)?.mapping)))
                .collect()
        };
        let local: Vec<&str> = devices
            .iter()
            .filter(|(_, mapping)| mapping.is_none())
            .map(|(k, _)| k.as_str())
            .collect();
        if !local.is_empty() {
            return Some(format!(
                "can't migrate VM which uses local devices: {}",
                local.join(", ")
            ));
        }
        let mapped: Vec<(&str, &str)> = devices
            .iter()
            .filter_map(|(k, m)| Some((k.as_str(), m.as_deref()?)))
            .collect();
        let missing: Vec<&str> = mapped
            .iter()
            .filter(|(_, name)| {
                !self
                    .pci_mappings
                    .get(*name)
                    .is_some_and(|m| m.map.iter().any(|e| e.node == target))
            })
            .map(|(k, _)| *k)
            .collect();
        if !missing.is_empty() {
            return Some(format!(
                "can't migrate to '{target}': missing mapped devices {}",
                missing.join(", ")
            ));
        }
        if vm.running && !mapped.is_empty() {
            let named: Vec<String> = mapped.iter().map(|(k, n)| format!("{k}:{n}")).collect();
            return Some(format!(
                "can't live migrate running VM which uses following mapped devices: {}",
                named.join(", ")
            ));
        }
        None
    }

    /// Test hook: the PCI devices VMs hold on `node` (running, or with a start under way),
    /// as (address, VMID), by address.
    pub fn pci_in_use(&self, node: &str) -> Vec<(String, u32)> {
        let mut out: Vec<(String, u32)> = self
            .vms
            .iter()
            .filter(|(_, vm)| vm.node == node)
            .flat_map(|(vmid, vm)| {
                vm.pci
                    .iter()
                    .flat_map(|h| h.ids.iter().map(|id| (id.clone(), *vmid)))
            })
            .collect();
        out.sort();
        out
    }

    /// The text of `/etc/pve/mapping/pci.cfg`, for the digest.
    fn mapping_config_text(&self) -> String {
        let mut text = String::new();
        for m in self.pci_mappings.values() {
            text.push_str(&m.name);
            text.push('\n');
            if let Some(d) = &m.description {
                text.push_str(&format!("\tdescription {d}\n"));
            }
            for e in &m.map {
                text.push_str(&format!("\tmap {}\n", e.property_string()));
            }
            text.push('\n');
        }
        text
    }

    fn mapping_json(&self, m: &PciMappingSpec, digest: &str) -> Value {
        let map: Vec<String> = m.map.iter().map(|e| e.property_string()).collect();
        let mut v = json!({"type": "pci", "map": map, "digest": digest});
        if let Some(d) = &m.description {
            v["description"] = json!(d);
        }
        v
    }

    /// `GET /cluster/mapping/pci[?check-node=]`.
    pub fn pci_mappings(&self, check_node: Option<&str>) -> SimResult<Value> {
        if let Some(node) = check_node {
            self.node_checked(node)?;
        }
        let digest = super::sha1_hex(&self.mapping_config_text());
        let list = self
            .pci_mappings
            .values()
            .map(|m| {
                let mut v = self.mapping_json(m, &digest);
                v["id"] = json!(m.name);
                if let Some(node) = check_node {
                    let checks: Vec<Value> = if m.map.iter().any(|e| e.node == node) {
                        Vec::new()
                    } else {
                        vec![json!({"severity": "warning", "message": format!("No mapping for node {node}.")})]
                    };
                    v["checks"] = json!(checks);
                }
                v
            })
            .collect();
        Ok(Value::Array(list))
    }

    /// `GET /cluster/mapping/pci/{id}`.
    pub fn pci_mapping(&self, id: &str) -> SimResult<Value> {
        if !is_config_id(id) {
            return Err(SimError::param(
                "id",
                format!("invalid format - invalid configuration ID '{id}'"),
            ));
        }
        let m = self
            .pci_mappings
            .get(id)
            .ok_or_else(|| SimError::e500(format!("mapping '{id}' not found")))?;
        Ok(self.mapping_json(m, &super::sha1_hex(&self.mapping_config_text())))
    }

    /// `GET /nodes/{node}/hardware/pci[?pci-class-blacklist=&verbose=]`.
    pub fn node_pci(
        &self,
        node: &str,
        class_blacklist: Option<&str>,
        verbose: Option<&str>,
    ) -> SimResult<Value> {
        self.node_checked(node)?;
        let verbose = match verbose {
            None => true,
            Some(v) => parse_boolean(v).ok_or_else(|| {
                SimError::param(
                    "verbose",
                    format!("type check ('boolean') failed - got '{v}'"),
                )
            })?,
        };
        let blacklist: Vec<String> = class_blacklist
            .unwrap_or(DEFAULT_CLASS_BLACKLIST)
            .split([',', ';', ' '])
            .filter(|c| !c.is_empty())
            .map(|c| format!("0x{c}"))
            .collect();
        let list = self
            .node_devices(node)
            .iter()
            .filter(|d| {
                !blacklist
                    .iter()
                    .any(|c| d.class_id().starts_with(c.as_str()))
            })
            .map(|d| {
                let mut v = json!({"id": d.id, "class": d.class_id(), "vendor": hex_id(&d.vendor),
                    "device": hex_id(&d.device), "iommugroup": d.iommugroup.unwrap_or(-1)});
                if verbose {
                    let names = [
                        (
                            "subsystem_vendor",
                            d.subsystem_vendor.as_deref().map(hex_id),
                        ),
                        (
                            "subsystem_device",
                            d.subsystem_device.as_deref().map(hex_id),
                        ),
                        ("vendor_name", d.vendor_name.clone()),
                        ("device_name", d.device_name.clone()),
                    ];
                    for (k, val) in names {
                        if let Some(val) = val {
                            v[k] = json!(val);
                        }
                    }
                }
                v
            })
            .collect();
        Ok(Value::Array(list))
    }
}

#[cfg(test)]
mod tests;
