//! DHCP for simulated guests, so machines whose NICs take their addresses by DHCP can be
//! tested: the topology's `dhcp` services hand out leases on bridges.
//!
//! * A guest asks for DHCP per NIC as its seed says (see [`guest::nic_setups`]: netplan
//!   `dhcp4: true`/`dhcp6: true`, networkd `DHCP=yes|ipv4|ipv6`); a guest without a seed
//!   image asks as PVE's own cloud-init drive would, for `ipconfigN: ip=dhcp` / `ip6=dhcp`.
//! * The request goes to the service of the NIC's bridge (`netN: ...,bridge=vmbr0`) when the
//!   guest has booted, `SimOptions::boot_delay` after the start (or reboot, reset, HA
//!   restart) took, the instant its agent begins to answer. A bridge without a service, or a
//!   pool with no free address, gives no address in that family (the other may still come).
//! * A lease belongs to a MAC on a bridge: the same NIC gets the same addresses at every
//!   boot; a NIC that got none tries again at its next boot. Addresses are handed out
//!   lowest free first. Leases outlive stops and go when the VM is destroyed.
//! * `agent/network-get-interfaces` reports the lease's addresses (with the service's prefix
//!   length) for the families the guest asked for, after the static ones.
//!
//! Simplifications (each says what real DHCP does): leases never expire (a real server
//! frees them after their lease time, and a stopped guest's address can go to another);
//! the services are cluster-wide per bridge name (a real bridge is per node, a DHCP server
//! per network); no DHCP traffic, options or DNS are simulated.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{Ipv4Addr, Ipv6Addr};

use tokio::time::Instant;

use super::{Cluster, Vm, is_indexed};
use crate::guest::{self, NicSetup};
use capmox::proxmox::types::{NetDevice, parse_property_string};

/// A lease the simulated DHCP services handed out, for tests ([`Cluster::dhcp_leases`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DhcpLease {
    /// Bridge of the service.
    pub bridge: String,
    /// MAC of the NIC, lower-case.
    pub mac: String,
    /// The VM the NIC belongs to.
    pub vmid: u32,
    /// IPv4 address with prefix length (`10.0.9.100/24`).
    pub ipv4: Option<String>,
    /// IPv6 address with prefix length (`fd00::100/64`).
    pub ipv6: Option<String>,
}

/// A lease as the services hold it, by (bridge, MAC).
#[derive(Clone, Debug, Default)]
pub(super) struct Lease {
    vmid: u32,
    v4: Option<Ipv4Addr>,
    v6: Option<Ipv6Addr>,
}

/// One NIC of a guest and how the guest sets it up.
pub(super) struct GuestNic {
    /// N of `netN`.
    pub(super) index: u32,
    pub(super) bridge: String,
    /// Lower-case.
    pub(super) mac: String,
    pub(super) setup: NicSetup,
}

/// The NIC's setup without a seed image: PVE's cloud-init drive from `ipconfigN`.
fn ipconfig_setup(vm: &Vm, index: u32) -> NicSetup {
    let Some(ipconfig) = vm.config.get(&format!("ipconfig{index}")) else {
        return NicSetup::default();
    };
    let p = parse_property_string(ipconfig, "ip");
    let mut setup = NicSetup::default();
    for (key, dhcp) in [("ip", &mut setup.dhcp4), ("ip6", &mut setup.dhcp6)] {
        match p.get(key).map(String::as_str) {
            Some("dhcp") => *dhcp = true,
            Some(cidr) if cidr.contains('/') => setup.addresses.push(cidr.to_owned()),
            _ => {}
        }
    }
    setup
}

impl Cluster {
    /// The NICs of `vm` in `netN` order with how its guest sets each up: from the seed image
    /// (by MAC, else by `ethN` name) or, without one, from `ipconfigN`.
    pub(super) fn guest_nics(&self, vm: &Vm) -> Vec<(String, GuestNic)> {
        let seed = self.seed_iso(vm).map(|s| guest::nic_setups(&s));
        let mut nets: Vec<(u32, &String)> = vm
            .config
            .iter()
            .filter(|(k, _)| is_indexed(k, "net"))
            .filter_map(|(k, v)| Some((k[3..].parse().ok()?, v)))
            .collect();
        nets.sort_by_key(|(index, _)| *index);
        nets.into_iter()
            .enumerate()
            .map(|(pos, (index, value))| {
                let dev = NetDevice::parse(index, value);
                let mac = dev.mac.unwrap_or_default().to_ascii_lowercase();
                let ifname = format!("eth{pos}");
                let setup = match &seed {
                    Some(setups) => setups
                        .get(&mac)
                        .or_else(|| setups.get(&ifname))
                        .cloned()
                        .unwrap_or_default(),
                    None => ipconfig_setup(vm, index),
                };
                let bridge = dev.bridge.unwrap_or_default();
                let nic = GuestNic {
                    index,
                    bridge,
                    mac,
                    setup,
                };
                (ifname, nic)
            })
            .collect()
    }

    /// The addresses `nic` of VM `vmid` holds by DHCP, for the families it asks for, as
    /// `address/prefix`.
    pub(super) fn dhcp_addresses(&self, vmid: u32, nic: &GuestNic) -> Vec<String> {
        let Some(service) = self.dhcp.get(&nic.bridge) else {
            return Vec::new();
        };
        let Some(lease) = self
            .leases
            .get(&(nic.bridge.clone(), nic.mac.clone()))
            .filter(|l| l.vmid == vmid)
        else {
            return Vec::new();
        };
        let mut out = Vec::new();
        if let (true, Some(a), Some((_, _, prefix))) = (nic.setup.dhcp4, lease.v4, service.pool4())
        {
            out.push(format!("{a}/{prefix}"));
        }
        if let (true, Some(a), Some((_, _, prefix))) = (nic.setup.dhcp6, lease.v6, service.pool6())
        {
            out.push(format!("{a}/{prefix}"));
        }
        out
    }

    /// VM `vmid` booted at `at`: its DHCP clients ask once the boot is done.
    pub(super) fn dhcp_after_boot(&mut self, vmid: u32, at: Instant) {
        self.dhcp_due.insert((at + self.opts.boot_delay, vmid));
    }

    /// When the next guest's boot is done, if it asks for leases.
    pub(super) fn next_dhcp_due(&self) -> Option<Instant> {
        self.dhcp_due.first().map(|(at, _)| *at)
    }

    /// The guest whose boot is done first asks for its leases, if it still runs that boot.
    pub(super) fn run_next_dhcp(&mut self) {
        let Some((due, vmid)) = self.dhcp_due.pop_first() else {
            return;
        };
        let Some(vm) = self.vms.get(&vmid) else {
            return;
        };
        let this_boot = vm
            .started_at
            .is_some_and(|s| s + self.opts.boot_delay == due);
        if !vm.running || !this_boot {
            return;
        }
        for (_, nic) in self.guest_nics(vm) {
            if nic.setup.dhcp4 || nic.setup.dhcp6 {
                self.lease(vmid, &nic);
            }
        }
    }

    /// Gives `nic` of VM `vmid` the lease it asks for: its MAC's lease on the bridge, with
    /// the lowest free address of each family it lacks.
    fn lease(&mut self, vmid: u32, nic: &GuestNic) {
        let Some(service) = self.dhcp.get(&nic.bridge) else {
            return;
        };
        let key = (nic.bridge.clone(), nic.mac.clone());
        let mut lease = self.leases.get(&key).cloned().unwrap_or_default();
        lease.vmid = vmid;
        let others = self
            .leases
            .iter()
            .filter(|((bridge, mac), _)| *bridge == nic.bridge && *mac != nic.mac);
        let (used4, used6): (BTreeSet<Ipv4Addr>, BTreeSet<Ipv6Addr>) = (
            others.clone().filter_map(|(_, l)| l.v4).collect(),
            others.filter_map(|(_, l)| l.v6).collect(),
        );
        if nic.setup.dhcp4 && lease.v4.is_none() {
            lease.v4 = service.pool4().and_then(|(first, last, _)| {
                lowest_free(u32::from(first), u32::from(last), |a| {
                    used4.contains(&Ipv4Addr::from(a))
                })
                .map(Ipv4Addr::from)
            });
        }
        if nic.setup.dhcp6 && lease.v6.is_none() {
            lease.v6 = service.pool6().and_then(|(first, last, _)| {
                lowest_free(u128::from(first), u128::from(last), |a| {
                    used6.contains(&Ipv6Addr::from(a))
                })
                .map(Ipv6Addr::from)
            });
        }
        if lease.v4.is_some() || lease.v6.is_some() {
            self.leases.insert(key, lease);
        }
    }

    /// VM `vmid` is gone: its leases are free.
    pub(super) fn release_leases(&mut self, vmid: u32) {
        self.leases.retain(|_, l| l.vmid != vmid);
    }

    /// Test hook: every lease, by bridge and MAC.
    pub fn dhcp_leases(&self) -> Vec<DhcpLease> {
        self.leases
            .iter()
            .map(|((bridge, mac), l)| {
                let service = self.dhcp.get(bridge);
                let prefix4 = service.and_then(|s| s.pool4()).map(|p| p.2);
                let prefix6 = service.and_then(|s| s.pool6()).map(|p| p.2);
                DhcpLease {
                    bridge: bridge.clone(),
                    mac: mac.clone(),
                    vmid: l.vmid,
                    ipv4: l.v4.zip(prefix4).map(|(a, p)| format!("{a}/{p}")),
                    ipv6: l.v6.zip(prefix6).map(|(a, p)| format!("{a}/{p}")),
                }
            })
            .collect()
    }
}

/// The lowest address from `first` to `last` that is not `taken`; looks at one more than
/// the taken addresses at most.
fn lowest_free<A>(first: A, last: A, taken: impl Fn(A) -> bool) -> Option<A>
where
    A: Copy + PartialOrd + std::ops::Add<Output = A> + From<u8>,
{
    let mut a = first;
    while a <= last {
        if !taken(a) {
            return Some(a);
        }
        if a == last {
            break;
        }
        a = a + A::from(1);
    }
    None
}

/// The DHCP services of a topology by bridge.
pub(super) fn services(
    topology: &crate::topology::Topology,
) -> BTreeMap<String, crate::topology::DhcpSpec> {
    topology
        .dhcp
        .iter()
        .map(|s| (s.bridge.clone(), s.clone()))
        .collect()
}

#[cfg(test)]
mod tests;
