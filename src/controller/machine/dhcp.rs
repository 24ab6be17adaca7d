//! Addresses a DHCP server gave the guest: no IPAddressClaim exists for such a device, so the
//! guest agent's report is the only source, read until the first DHCP device has an address.

use std::net::IpAddr;
use std::time::Duration;

use kube::runtime::controller::Action;

use super::outcome::{Flow, waiting};
use super::{During, Reconcile, Scope};
use crate::api::IpAddressesSpec;
use crate::placement::{Placement, ResolvedNic};
use crate::proxmox::{AgentInterface, ProxmoxClient, VmConfig};

/// How soon a guest without its DHCP address is asked again: a lease usually comes within
/// seconds of the boot that cloud-init already waited for.
const DHCP_RECHECK: Duration = Duration::from_secs(5);

impl Reconcile<'_> {
    /// Records the DHCP devices' addresses in `status.ipAddresses`; waits (naming the device)
    /// while the first DHCP device has none.
    pub(super) async fn dhcp_addresses(
        &self,
        scope: &mut Scope,
        placement: &Placement,
        config: Option<&VmConfig>,
        proxmox: &ProxmoxClient,
        node: &str,
        vmid: u32,
    ) -> Flow {
        let dhcp: Vec<&ResolvedNic> = placement
            .network_devices()
            .iter()
            .filter(|nic| nic.dhcp4 || nic.dhcp6)
            .collect();
        let Some(first) = dhcp.first() else {
            return Ok(());
        };
        if has_addresses(&scope.status.ip_addresses, &first.name) {
            return Ok(());
        }
        let config = self.config_or_read(config, proxmox, node, vmid).await?;
        let mac_of = |nic: &ResolvedNic| {
            config
                .get(&nic.name)
                .and_then(|value| crate::cloudinit::mac_from_net_config(&value))
        };
        let interfaces = match proxmox.agent_network_interfaces(node, vmid).await {
            Ok(interfaces) => interfaces,
            Err(error) if error.is_agent_unavailable() || error.is_retryable() => {
                return Err(waiting(
                    "WaitingForDHCPAddress",
                    format!(
                        "{} takes its address by DHCP; the QEMU guest agent of VM {vmid} does not report addresses yet",
                        first.name
                    ),
                    Action::requeue(DHCP_RECHECK),
                ));
            }
            Err(error) => {
                return Err(error)
                    .during(|| format!("reading the addresses of VM {vmid}'s guest"))
                    .map_err(Into::into);
            }
        };
        let learned: Vec<IpAddressesSpec> = dhcp
            .iter()
            .filter_map(|nic| {
                let mac = mac_of(nic)?;
                let entry = leased(nic, &mac, &interfaces);
                (!entry.ipv4.is_empty() || !entry.ipv6.is_empty()).then_some(entry)
            })
            .collect();
        let Some(primary) = learned.iter().find(|e| e.net == first.name).cloned() else {
            let mac = mac_of(first).unwrap_or_else(|| "unknown".to_owned());
            return Err(waiting(
                "WaitingForDHCPAddress",
                format!(
                    "{} (MAC {mac}) has no DHCP address yet: the guest agent of VM {vmid} reports none on it; check that a DHCP server answers on bridge {}",
                    first.name,
                    first.bridge.as_deref().unwrap_or("(the template's)")
                ),
                Action::requeue(DHCP_RECHECK),
            ));
        };
        record(&mut scope.status.ip_addresses, learned, primary);
        Ok(())
    }
}

fn has_addresses(recorded: &[IpAddressesSpec], nic: &str) -> bool {
    recorded
        .iter()
        .any(|e| e.net == nic && (!e.ipv4.is_empty() || !e.ipv6.is_empty()))
}

/// The addresses of the guest interface with `mac`, of the families `nic` takes by DHCP
/// (global ones: a link-local or loopback address is no lease).
fn leased(nic: &ResolvedNic, mac: &str, interfaces: &[AgentInterface]) -> IpAddressesSpec {
    let mut entry = IpAddressesSpec {
        net: nic.name.clone(),
        ..IpAddressesSpec::default()
    };
    let same_mac = |i: &&AgentInterface| {
        i.hardware_address
            .as_deref()
            .is_some_and(|m| m.eq_ignore_ascii_case(mac))
    };
    for address in interfaces
        .iter()
        .filter(same_mac)
        .flat_map(|i| &i.ip_addresses)
    {
        match address.ip_address.parse::<IpAddr>() {
            Ok(IpAddr::V4(v4)) if nic.dhcp4 && !v4.is_loopback() && !v4.is_link_local() => {
                entry.ipv4.push(v4.to_string());
            }
            Ok(IpAddr::V6(v6)) if nic.dhcp6 && !v6.is_loopback() && !v6.is_unicast_link_local() => {
                entry.ipv6.push(v6.to_string());
            }
            _ => {}
        }
    }
    entry
}

/// Adds the learned entries to what the pools gave; the first DHCP device's addresses are the
/// machine's `default` ones when no pool gave any.
fn record(
    recorded: &mut Vec<IpAddressesSpec>,
    learned: Vec<IpAddressesSpec>,
    primary: IpAddressesSpec,
) {
    for entry in learned {
        match recorded.iter_mut().find(|e| e.net == entry.net) {
            Some(existing) => {
                existing.ipv4.extend(entry.ipv4);
                existing.ipv6.extend(entry.ipv6);
            }
            None => recorded.push(entry),
        }
    }
    match recorded.iter_mut().find(|e| e.net == "default") {
        Some(default) if !default.ipv4.is_empty() || !default.ipv6.is_empty() => {}
        Some(default) => {
            default.ipv4 = primary.ipv4;
            default.ipv6 = primary.ipv6;
        }
        None => recorded.insert(
            0,
            IpAddressesSpec {
                net: "default".to_owned(),
                ipv4: primary.ipv4,
                ipv6: primary.ipv6,
            },
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nic(name: &str, dhcp4: bool, dhcp6: bool) -> ResolvedNic {
        ResolvedNic {
            dhcp4,
            dhcp6,
            ..crate::placement::fixtures::resolved_nic(name)
        }
    }

    fn interfaces() -> Vec<AgentInterface> {
        serde_json::from_value(serde_json::json!([
            {"name": "lo", "hardware-address": "00:00:00:00:00:00", "ip-addresses": [
                {"ip-address": "127.0.0.1", "ip-address-type": "ipv4", "prefix": 8}]},
            {"name": "eth0", "hardware-address": "bc:24:11:00:00:01", "ip-addresses": [
                {"ip-address": "10.0.9.100", "ip-address-type": "ipv4", "prefix": 24},
                {"ip-address": "fe80::be24:11ff:fe00:1", "ip-address-type": "ipv6", "prefix": 64},
                {"ip-address": "fd00::100", "ip-address-type": "ipv6", "prefix": 64}]},
            {"name": "eth1", "hardware-address": "bc:24:11:00:00:02", "ip-addresses": [
                {"ip-address": "169.254.3.4", "ip-address-type": "ipv4", "prefix": 16}]}
        ]))
        .expect("agent interfaces")
    }

    #[test]
    fn a_lease_is_the_global_address_of_the_asked_families_on_the_nics_mac() {
        let v4 = leased(
            &nic("net0", true, false),
            "BC:24:11:00:00:01",
            &interfaces(),
        );
        assert_eq!(v4.ipv4, ["10.0.9.100"]);
        assert!(v4.ipv6.is_empty(), "{v4:?}");
        let both = leased(&nic("net0", true, true), "bc:24:11:00:00:01", &interfaces());
        assert_eq!(both.ipv6, ["fd00::100"], "link-local is no lease");
        let none = leased(
            &nic("net1", true, false),
            "bc:24:11:00:00:02",
            &interfaces(),
        );
        assert!(
            none.ipv4.is_empty(),
            "a link-local v4 is no lease: {none:?}"
        );
        let other = leased(&nic("net0", true, true), "bc:24:11:00:00:09", &interfaces());
        assert!(other.ipv4.is_empty() && other.ipv6.is_empty());
    }

    #[test]
    fn learned_addresses_join_the_pools_and_become_default_only_without_pool_ones() {
        let lease = IpAddressesSpec {
            net: "net0".to_owned(),
            ipv4: vec!["10.0.9.100".to_owned()],
            ..IpAddressesSpec::default()
        };
        let mut only_dhcp = Vec::new();
        record(&mut only_dhcp, vec![lease.clone()], lease.clone());
        assert_eq!(only_dhcp[0].net, "default");
        assert_eq!(only_dhcp[0].ipv4, ["10.0.9.100"]);
        assert_eq!(only_dhcp[1], lease);
        assert!(has_addresses(&only_dhcp, "net0"));

        let static_default = IpAddressesSpec {
            net: "default".to_owned(),
            ipv4: vec!["10.0.0.5".to_owned()],
            ..IpAddressesSpec::default()
        };
        let mut mixed = vec![static_default.clone()];
        let lease1 = IpAddressesSpec {
            net: "net1".to_owned(),
            ..lease.clone()
        };
        record(&mut mixed, vec![lease1.clone()], lease1.clone());
        assert_eq!(mixed, vec![static_default, lease1]);
        assert!(!has_addresses(&mixed, "net0"));
    }
}
