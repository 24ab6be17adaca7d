//! systemd-networkd units for guests configured by Ignition (Flatcar), which has no netplan:
//! the same checked network plan as the netplan `network-config`, as `.network` and `.netdev`
//! files. Names follow the Go provider: `NN-ethN.network` per NIC (matched by MAC),
//! `NN-vrfN.netdev` per VRF and `NN-vrfN.network` for its routes and rules, numbered after the
//! NICs.

use std::fmt::Write as _;

use super::network::{Document, Route, Rule};

/// One networkd unit: its file name (under `/etc/systemd/network/`) and its contents.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NetworkdUnit {
    /// File name, e.g. `00-eth0.network`.
    pub name: String,
    /// The unit's text.
    pub contents: String,
}

/// The units for a checked network plan: NICs first, then each VRF's `.netdev` and `.network`.
pub(super) fn render_units(doc: &Document) -> Vec<NetworkdUnit> {
    let net = &doc.network;
    // Which VRF, if any, each NIC (by its ethN name) is enslaved to.
    let vrf_of = |eth: &str| {
        net.vrfs
            .0
            .iter()
            .find(|(_, vrf)| vrf.interfaces.iter().any(|i| i == eth))
            .map(|(name, _)| name.as_str())
    };
    let mut units = Vec::new();
    for (i, (eth, e)) in net.ethernets.0.iter().enumerate() {
        let mut text = String::new();
        section(&mut text, "Match");
        line(&mut text, "MACAddress", &e.matches.macaddress);
        if let Some(mtu) = e.mtu {
            section(&mut text, "Link");
            line(&mut text, "MTUBytes", mtu);
        }
        section(&mut text, "Network");
        if let Some(vrf) = vrf_of(eth) {
            line(&mut text, "VRF", vrf);
        }
        match (e.dhcp4, e.dhcp6) {
            (true, true) => line(&mut text, "DHCP", "yes"),
            (true, false) => line(&mut text, "DHCP", "ipv4"),
            (false, true) => line(&mut text, "DHCP", "ipv6"),
            (false, false) => {}
        }
        for dns in e.nameservers.iter().flat_map(|n| &n.addresses) {
            line(&mut text, "DNS", dns);
        }
        for address in &e.addresses {
            section(&mut text, "Address");
            line(&mut text, "Address", address);
        }
        for route in &e.routes {
            route_section(&mut text, route, None);
        }
        for rule in &e.routing_policy {
            rule_section(&mut text, rule, None);
        }
        units.push(NetworkdUnit {
            name: format!("{i:02}-eth{i}.network"),
            contents: text,
        });
    }
    let nics = net.ethernets.0.len();
    for (n, (name, vrf)) in net.vrfs.0.iter().enumerate() {
        let mut netdev = String::new();
        section(&mut netdev, "NetDev");
        line(&mut netdev, "Name", name);
        line(&mut netdev, "Kind", "vrf");
        section(&mut netdev, "VRF");
        line(&mut netdev, "Table", vrf.table);
        units.push(NetworkdUnit {
            name: format!("{n:02}-vrf{n}.netdev"),
            contents: netdev,
        });
        let mut network = String::new();
        section(&mut network, "Match");
        line(&mut network, "Name", name);
        for route in &vrf.routes {
            route_section(&mut network, route, Some(vrf.table));
        }
        for rule in &vrf.routing_policy {
            rule_section(&mut network, rule, Some(vrf.table));
        }
        let i = nics + n;
        units.push(NetworkdUnit {
            name: format!("{i:02}-vrf{i}.network"),
            contents: network,
        });
    }
    units
}

/// Starts `[name]`, with a blank line before every section but the first.
fn section(text: &mut String, name: &str) {
    if !text.is_empty() {
        text.push('\n');
    }
    let _ = writeln!(text, "[{name}]");
}

fn line(text: &mut String, key: &str, value: impl std::fmt::Display) {
    let _ = writeln!(text, "{key}={value}");
}

/// A `[Route]`; in a VRF, a route that names no table goes to the VRF's.
fn route_section(text: &mut String, route: &Route, vrf_table: Option<u32>) {
    section(text, "Route");
    line(text, "Destination", &route.to);
    if let Some(via) = &route.via {
        line(text, "Gateway", via);
    }
    if let Some(metric) = route.metric {
        line(text, "Metric", metric);
    }
    if let Some(table) = route.table.or(vrf_table) {
        line(text, "Table", table);
    }
}

/// A `[RoutingPolicyRule]`; in a VRF, a rule that names no table looks up the VRF's.
fn rule_section(text: &mut String, rule: &Rule, vrf_table: Option<u32>) {
    section(text, "RoutingPolicyRule");
    if let Some(to) = &rule.to {
        line(text, "To", to);
    }
    if let Some(from) = &rule.from {
        line(text, "From", from);
    }
    if let Some(priority) = rule.priority {
        line(text, "Priority", priority);
    }
    if let Some(table) = rule.table.or(vrf_table) {
        line(text, "Table", table);
    }
}
