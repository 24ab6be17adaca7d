//! The sandbox's hardware examples (`--example`): the workers get a GPU of the topology's `gpu`
//! PCI resource mapping, a DHCP address, or data disks with UEFI and a TPM, and the summary
//! shows what Proxmox (the simulator) made of it.

use serde_json::{Value, json};

use super::run::{MachineRow, SiteSimulators};

/// What the example workers are given.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Example {
    /// A GPU of the `gpu` mapping each: one device on each node of rack-b, so the scheduler
    /// puts one worker per node (a third waits with `PciDeviceUnavailable`).
    Gpu,
    /// `dhcp4` on net0 instead of the zone's pool: the lease comes from the simulated DHCP
    /// server of vmbr0, and no IPAddressClaim is made.
    Dhcp,
    /// Two data disks (one on node-local storage, counted by the scheduler) and UEFI with
    /// Secure Boot keys and a TPM.
    Disks,
}

impl Example {
    /// The workers' spec: `base` with the example's hardware.
    pub fn worker_spec(self, base: &Value) -> Value {
        let mut spec = base.clone();
        match self {
            Self::Gpu => spec["pciDevices"] = json!([{"mapping": "gpu", "pcie": true}]),
            Self::Dhcp => {
                spec["network"] =
                    json!({"networkDevices": [{"name": "net0", "bridge": "vmbr0", "dhcp4": true}]});
            }
            Self::Disks => {
                spec["full"] = json!(true);
                spec["disks"] = json!({"additionalVolumes": [
                    {"disk": "scsi1", "sizeGb": 20, "storage": "local"},
                    {"disk": "scsi2", "sizeGb": 50, "storage": "ceph", "discard": true}
                ]});
                spec["bios"] = json!("ovmf");
                spec["secureBoot"] = json!(true);
                spec["tpm"] = json!(true);
            }
        }
        spec
    }

    /// What Proxmox made of the example for the workers among `rows`, one line per worker.
    pub fn report(self, sims: &SiteSimulators, rows: &[MachineRow]) -> String {
        let sim = &sims.sim;
        let workers = rows.iter().filter(|r| r.machine.contains("-workers-"));
        let lines: Vec<String> = workers
            .map(|row| {
                let vmid: u32 = row.vmid.parse().unwrap_or_default();
                let detail = match self {
                    Self::Gpu => {
                        let held: Vec<String> = sim
                            .pci_in_use(&row.node)
                            .into_iter()
                            .filter(|(_, holder)| *holder == vmid)
                            .map(|(path, _)| path)
                            .collect();
                        format!("GPU {}", held.join(", "))
                    }
                    Self::Dhcp => {
                        let leases: Vec<String> = sim
                            .dhcp_leases()
                            .into_iter()
                            .filter(|l| l.vmid == vmid)
                            .filter_map(|l| Some(format!("{} on {}", l.ipv4?, l.bridge)))
                            .collect();
                        format!("DHCP lease {} (status: {})", leases.join(", "), row.ips)
                    }
                    Self::Disks => {
                        let volumes: Vec<String> = sim
                            .volumes_of(vmid)
                            .into_iter()
                            .map(|v| format!("{} ({})", v.volid, size(v.size)))
                            .collect();
                        volumes.join(", ")
                    }
                };
                format!("  {} on {} (VM {vmid}): {detail}", row.machine, row.node)
            })
            .collect();
        lines.join("\n")
    }
}

/// A volume size as people read it: GiB, or MiB for the small EFI and TPM volumes.
fn size(bytes: u64) -> String {
    if bytes >= 1 << 30 {
        format!("{} GiB", bytes >> 30)
    } else {
        format!("{} MiB", bytes >> 20)
    }
}
