//! The NoCloud `network-config`: netplan v2 rendered from typed structs, validated first the way
//! the Go provider validates (`pkg/network/validate.go`), with messages that say what to fix.

use std::collections::BTreeMap;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use serde::Serialize;
use serde::ser::{SerializeMap, Serializer};

use crate::api::{RouteSpec, RoutingPolicySpec, VrfDevice};
use crate::placement::ResolvedNic;

/// The kernel's main routing table, used when a route names no table.
const MAIN_TABLE: u32 = 254;

/// One IP address the IPAM bound to a NIC, with what its pool says about routing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AssignedAddress {
    /// The address itself.
    pub address: IpAddr,
    /// Prefix length of the pool's subnet.
    pub prefix: u8,
    /// The pool's gateway: becomes a default route (`0.0.0.0/0` or `::/0`) via it.
    pub gateway: Option<IpAddr>,
    /// True when the address came from the zone/cluster default pool: its default route wins a
    /// tie with another pool's default route of the same family and metric.
    pub default_route: bool,
    /// Metric of the default route (the pool's metric annotation).
    pub metric: Option<u32>,
}

/// Everything the guest needs to know about one NIC that Proxmox and IPAM decided (not the spec).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NicAddresses {
    /// Proxmox NIC name (`net0`, ...), as in [`ResolvedNic::name`].
    pub nic: String,
    /// MAC address from the VM config (`virtio=BC:24:11:...`); matched case-insensitively.
    pub mac: String,
    /// Addresses in claim order (the Go provider sorts by IPAddress name).
    pub addresses: Vec<AssignedAddress>,
}

/// Why a network-config cannot be rendered; every message names the field to fix.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NetworkConfigError {
    /// The machine has no network devices.
    #[error("no network devices: spec.network.networkDevices must list at least one NIC")]
    NoDevices,
    /// A NIC has neither a pool address nor DHCP.
    #[error(
        "network device {nic} has no IP address; give it an IP pool (defaultIPv4/defaultIPv6 \
         or ipPoolRef) and wait for its IPAddressClaims to be bound, or set dhcp4/dhcp6"
    )]
    MissingAddresses {
        /// The NIC (`netN`).
        nic: String,
    },
    /// No MAC address is known for a NIC.
    #[error("network device {nic} has no MAC address; the VM config has no {nic} entry with a MAC")]
    MissingMac {
        /// The NIC (`netN`).
        nic: String,
    },
    /// A MAC address is not six hex octets.
    #[error(
        "network device {nic} has MAC address {mac:?}, which is not of the form aa:bb:cc:dd:ee:ff"
    )]
    InvalidMac {
        /// The NIC (`netN`).
        nic: String,
        /// The MAC as given.
        mac: String,
    },
    /// Addresses were given for a NIC the machine does not have (a caller bug).
    #[error(
        "addresses were assigned to network device {nic}, which is not in spec.network.networkDevices \
         (devices: {known})"
    )]
    UnknownNic {
        /// The NIC name given.
        nic: String,
        /// The machine's NICs, comma-separated.
        known: String,
    },
    /// Two address entries for one NIC (a caller bug: merge them).
    #[error("network device {nic} was given two address entries; pass one NicAddresses per NIC")]
    DuplicateNic {
        /// The NIC (`netN`).
        nic: String,
    },
    /// One NIC enslaved to two VRFs (or listed twice).
    #[error(
        "network device {nic} is an interface of VRF {first} and of VRF {second}; a NIC can be in one VRF only"
    )]
    VrfInterfaceTwice {
        /// The NIC (`netN`).
        nic: String,
        /// The first VRF listing it.
        first: String,
        /// The second VRF listing it.
        second: String,
    },
    /// A prefix length longer than the address family allows.
    #[error(
        "network device {nic} has address {address}/{prefix}: the prefix is longer than {max}; fix the IP pool's prefix"
    )]
    InvalidPrefix {
        /// The NIC (`netN`).
        nic: String,
        /// The address.
        address: IpAddr,
        /// The prefix given.
        prefix: u8,
        /// 32 or 128.
        max: u8,
    },
    /// An address and its pool's gateway are of different IP families.
    #[error(
        "network device {nic} has address {address} with gateway {gateway} of the other IP family; \
         fix the IP pool's gateway"
    )]
    GatewayFamily {
        /// The NIC (`netN`).
        nic: String,
        /// The address.
        address: IpAddr,
        /// The gateway.
        gateway: IpAddr,
    },
    /// A route without a destination.
    #[error("{at} has no 'to'; set it to a CIDR, an IP address, or default")]
    RouteWithoutTo {
        /// Where the route is (`network device net0 route 1`).
        at: String,
    },
    /// A destination or source that is neither a CIDR, an IP nor `default`/`all`.
    #[error("{at} has {field} {value:?}, which is not a CIDR, an IP address, default or all")]
    InvalidPrefixValue {
        /// Where the route or rule is.
        at: String,
        /// `to` or `from`.
        field: &'static str,
        /// The value as given.
        value: String,
    },
    /// A `via` that is not an IP address.
    #[error("{at} has via {value:?}, which is not an IP address")]
    InvalidVia {
        /// Where the route is.
        at: String,
        /// The value as given.
        value: String,
    },
    /// Both sides of a route or rule must be of one IP family.
    #[error("{at} mixes IPv4 and IPv6 ({first} and {second}); use one family")]
    FamilyMismatch {
        /// Where the route or rule is.
        at: String,
        /// One side.
        first: String,
        /// The other side.
        second: String,
    },
    /// A negative or out-of-range number.
    #[error("{at} has {field} {value}, which must be between 0 and 4294967295")]
    OutOfRange {
        /// Where the route or rule is.
        at: String,
        /// The field name.
        field: &'static str,
        /// The value as given.
        value: i64,
    },
    /// Two routes with the same destination, table and metric (ErrConflictingMetrics).
    #[error(
        "{first} and {second} both route {to} in table {table} with metric {metric}; \
         give one of them another metric (for a pool gateway: the pool's metric) or another table"
    )]
    ConflictingRoutes {
        /// The earlier route.
        first: String,
        /// The later route.
        second: String,
        /// Their destination.
        to: String,
        /// Their table (254 = main).
        table: u32,
        /// Their metric (0 when unset).
        metric: u32,
    },
    /// A routing-policy rule with neither `to` nor `from`.
    #[error("{at} has neither 'to' nor 'from'; set at least one")]
    RuleWithoutSelector {
        /// Where the rule is.
        at: String,
    },
    /// A routing-policy rule outside a VRF without a table.
    #[error("{at} has no 'table'; a rule outside a VRF must name the routing table to look up")]
    RuleWithoutTable {
        /// Where the rule is.
        at: String,
    },
    /// A VRF's name is not an interface name (it would be written into netplan and networkd).
    #[error("spec.network.vrfs: {error}")]
    InvalidVrfName {
        /// What is wrong with the name.
        error: crate::api::names::NameError,
    },
    /// A VRF enslaves a NIC the machine does not have.
    #[error(
        "VRF {vrf} lists interface {interface:?}, which is not a network device of this machine (devices: {known})"
    )]
    VrfUnknownInterface {
        /// The VRF name.
        vrf: String,
        /// The interface as given.
        interface: String,
        /// The machine's NICs, comma-separated.
        known: String,
    },
    /// A DNS server that is not an IP address.
    #[error(
        "network device {nic} has DNS server {value:?}, which is not an IP address; fix dnsServers"
    )]
    InvalidDnsServer {
        /// The NIC (`netN`).
        nic: String,
        /// The value as given.
        value: String,
    },
    /// Nothing gives the machine a default route (ErrMissingGateway).
    #[error(
        "no default route: no assigned address has a gateway and no route goes to default \
         (0.0.0.0/0 or ::/0); give an IP pool a gateway or add a route with to: default"
    )]
    MissingDefaultRoute,
    /// serde_norway refused the document (a bug in capmox).
    #[error("rendering network-config as YAML failed: {0}")]
    Yaml(String),
}

// ---------------------------------------------------------------------------------------------
// netplan v2 document, in the key order the Go provider writes.

#[derive(Serialize)]
pub(super) struct Document {
    pub(super) network: Network,
}

#[derive(Serialize)]
pub(super) struct Network {
    pub(super) version: u8,
    pub(super) renderer: &'static str,
    #[serde(skip_serializing_if = "Ordered::is_empty")]
    pub(super) ethernets: Ordered<Ethernet>,
    #[serde(skip_serializing_if = "Ordered::is_empty")]
    pub(super) vrfs: Ordered<Vrf>,
}

/// A YAML mapping that keeps insertion order (NIC order: `eth2` before `eth10`).
pub(super) struct Ordered<V>(pub(super) Vec<(String, V)>);

impl<V> Ordered<V> {
    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl<V: Serialize> Serialize for Ordered<V> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(self.0.len()))?;
        for (k, v) in &self.0 {
            map.serialize_entry(k, v)?;
        }
        map.end()
    }
}

#[derive(Serialize)]
pub(super) struct Ethernet {
    #[serde(rename = "match")]
    pub(super) matches: Match,
    pub(super) dhcp4: bool,
    pub(super) dhcp6: bool,
    pub(super) addresses: Vec<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(super) routes: Vec<Route>,
    #[serde(rename = "routing-policy", skip_serializing_if = "Vec::is_empty")]
    pub(super) routing_policy: Vec<Rule>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) nameservers: Option<Nameservers>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) mtu: Option<u32>,
}

#[derive(Serialize)]
pub(super) struct Match {
    pub(super) macaddress: String,
}

#[derive(Serialize)]
pub(super) struct Nameservers {
    pub(super) addresses: Vec<String>,
}

#[derive(Serialize)]
pub(super) struct Route {
    pub(super) to: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) via: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) metric: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) table: Option<u32>,
}

#[derive(Serialize)]
pub(super) struct Rule {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) to: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) from: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) priority: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) table: Option<u32>,
}

#[derive(Serialize)]
pub(super) struct Vrf {
    pub(super) table: u32,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(super) routes: Vec<Route>,
    #[serde(rename = "routing-policy", skip_serializing_if = "Vec::is_empty")]
    pub(super) routing_policy: Vec<Rule>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(super) interfaces: Vec<String>,
}

// ---------------------------------------------------------------------------------------------
// Prefix parsing.

/// An IP prefix as written (`10.0.0.5/24` keeps its host bits, as netplan accepts).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Prefix {
    addr: IpAddr,
    len: u8,
}

impl fmt::Display for Prefix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.len)
    }
}

impl Prefix {
    fn default_route(v6: bool) -> Self {
        if v6 {
            Self {
                addr: IpAddr::V6(Ipv6Addr::UNSPECIFIED),
                len: 0,
            }
        } else {
            Self {
                addr: IpAddr::V4(Ipv4Addr::UNSPECIFIED),
                len: 0,
            }
        }
    }

    fn is_default(&self) -> bool {
        self.len == 0 && self.addr.is_unspecified()
    }
}

/// A parsed `to`/`from`: a placeholder whose family is decided by the other side, or a prefix.
enum Dest {
    Placeholder,
    Prefix(Prefix),
}

fn max_len(addr: IpAddr) -> u8 {
    if addr.is_ipv4() { 32 } else { 128 }
}

fn parse_dest(at: &str, field: &'static str, value: &str) -> Result<Dest, NetworkConfigError> {
    let invalid = || NetworkConfigError::InvalidPrefixValue {
        at: at.to_owned(),
        field,
        value: value.to_owned(),
    };
    let v = value.trim();
    if crate::api::validation::is_route_placeholder(v) {
        return Ok(Dest::Placeholder);
    }
    let (addr, len) = match v.split_once('/') {
        Some((a, l)) => {
            let addr: IpAddr = a.parse().map_err(|_| invalid())?;
            let len: u8 = l.parse().map_err(|_| invalid())?;
            (addr, len)
        }
        None => {
            let addr: IpAddr = v.parse().map_err(|_| invalid())?;
            (addr, max_len(addr))
        }
    };
    if len > max_len(addr) {
        return Err(invalid());
    }
    Ok(Dest::Prefix(Prefix { addr, len }))
}

fn non_negative(
    at: &str,
    field: &'static str,
    v: Option<i64>,
) -> Result<Option<u32>, NetworkConfigError> {
    v.map(|n| {
        u32::try_from(n).map_err(|_| NetworkConfigError::OutOfRange {
            at: at.to_owned(),
            field,
            value: n,
        })
    })
    .transpose()
}

fn family_mismatch(at: &str, a: impl fmt::Display, b: impl fmt::Display) -> NetworkConfigError {
    NetworkConfigError::FamilyMismatch {
        at: at.to_owned(),
        first: a.to_string(),
        second: b.to_string(),
    }
}

/// A route checked and resolved, with where it came from for error messages.
struct CheckedRoute {
    at: String,
    to: Prefix,
    via: Option<IpAddr>,
    metric: Option<u32>,
    table: Option<u32>,
}

impl CheckedRoute {
    fn netplan(&self) -> Route {
        Route {
            to: self.to.to_string(),
            via: self.via.map(|v| v.to_string()),
            metric: self.metric,
            table: self.table,
        }
    }
}

fn check_route(at: String, spec: &RouteSpec) -> Result<CheckedRoute, NetworkConfigError> {
    let to = spec
        .to
        .as_deref()
        .filter(|t| !t.trim().is_empty())
        .ok_or_else(|| NetworkConfigError::RouteWithoutTo { at: at.clone() })?;
    let via = spec
        .via
        .as_deref()
        .map(|v| {
            v.trim()
                .parse::<IpAddr>()
                .map_err(|_| NetworkConfigError::InvalidVia {
                    at: at.clone(),
                    value: v.to_owned(),
                })
        })
        .transpose()?;
    let to = match parse_dest(&at, "to", to)? {
        Dest::Placeholder => {
            let v6 = via.map_or(spec.is6.unwrap_or(false), |v| v.is_ipv6());
            Prefix::default_route(v6)
        }
        Dest::Prefix(p) => p,
    };
    if let Some(v) = via
        && v.is_ipv6() != to.addr.is_ipv6()
    {
        return Err(family_mismatch(&at, to, v));
    }
    let metric = non_negative(&at, "metric", spec.metric.map(i64::from))?;
    let table = non_negative(&at, "table", spec.table.map(i64::from))?;
    Ok(CheckedRoute {
        at,
        to,
        via,
        metric,
        table,
    })
}

fn check_rule(
    at: String,
    spec: &RoutingPolicySpec,
    in_vrf: bool,
) -> Result<Rule, NetworkConfigError> {
    let side = |field: &'static str, v: &Option<String>| {
        v.as_deref()
            .filter(|s| !s.trim().is_empty())
            .map(|s| parse_dest(&at, field, s))
            .transpose()
    };
    let to = side("to", &spec.to)?;
    let from = side("from", &spec.from)?;
    if to.is_none() && from.is_none() {
        return Err(NetworkConfigError::RuleWithoutSelector { at });
    }
    let table = non_negative(&at, "table", spec.table.map(i64::from))?.filter(|t| *t != 0);
    if table.is_none() && !in_vrf {
        return Err(NetworkConfigError::RuleWithoutTable { at });
    }
    let priority = non_negative(&at, "priority", spec.priority)?;
    let concrete = |d: &Option<Dest>| match d {
        Some(Dest::Prefix(p)) => Some(*p),
        _ => None,
    };
    let (cto, cfrom) = (concrete(&to), concrete(&from));
    if let (Some(t), Some(f)) = (cto, cfrom)
        && t.addr.is_ipv6() != f.addr.is_ipv6()
    {
        return Err(family_mismatch(&at, t, f));
    }
    let v6 = cto
        .or(cfrom)
        .map_or(spec.is6.unwrap_or(false), |p| p.addr.is_ipv6());
    let resolve = |d: Option<Dest>| {
        d.map(|d| match d {
            Dest::Placeholder => Prefix::default_route(v6).to_string(),
            Dest::Prefix(p) => p.to_string(),
        })
    };
    Ok(Rule {
        to: resolve(to),
        from: resolve(from),
        priority,
        table,
    })
}

/// Lower-case `aa:bb:cc:dd:ee:ff`, or `None` when `mac` is not six hex octets.
fn normalise_mac(mac: &str) -> Option<String> {
    let parts: Vec<&str> = mac.trim().split([':', '-']).collect();
    let ok = parts.len() == 6
        && parts
            .iter()
            .all(|p| p.len() == 2 && p.chars().all(|c| c.is_ascii_hexdigit()));
    ok.then(|| parts.join(":").to_ascii_lowercase())
}

/// Tracks `(table, to, metric)` so a second route with the same key is reported with the first.
#[derive(Default)]
struct Collisions(BTreeMap<(u32, Prefix, u32), String>);

impl Collisions {
    fn add(&mut self, r: &CheckedRoute, vrf_table: Option<u32>) -> Result<(), NetworkConfigError> {
        let table = r.table.or(vrf_table).unwrap_or(MAIN_TABLE);
        let metric = r.metric.unwrap_or(0);
        if let Some(first) = self.0.get(&(table, r.to, metric)) {
            return Err(NetworkConfigError::ConflictingRoutes {
                first: first.clone(),
                second: r.at.clone(),
                to: r.to.to_string(),
                table,
                metric,
            });
        }
        self.0.insert((table, r.to, metric), r.at.clone());
        Ok(())
    }
}

fn known_nics(nics: &[ResolvedNic]) -> String {
    nics.iter()
        .map(|n| n.name.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Renders the netplan v2 `network-config` for the machine's NICs (in spec order, as `eth0`,
/// `eth1`, ...) and VRFs, after validating it as the Go provider does.
///
/// Unlike the Go provider (its bug 13), two pool gateways of one IP family with the same metric
/// do not fail the machine: the default pool's gateway (else the first NIC's) keeps the default
/// route and the other is left out. Conflicts among user routes are still errors.
pub fn render_network_config(
    nics: &[ResolvedNic],
    vrfs: &[VrfDevice],
    assigned: &[NicAddresses],
) -> Result<String, NetworkConfigError> {
    let doc = plan_network(nics, vrfs, assigned)?;
    super::yaml::to_string(&doc).map_err(NetworkConfigError::Yaml)
}

/// The machine's network checked and resolved, as the netplan document; the systemd-networkd
/// units for Ignition are rendered from the same plan, so both say the same.
pub(super) fn plan_network(
    nics: &[ResolvedNic],
    vrfs: &[VrfDevice],
    assigned: &[NicAddresses],
) -> Result<Document, NetworkConfigError> {
    if nics.is_empty() {
        return Err(NetworkConfigError::NoDevices);
    }
    if let Some(extra) = assigned
        .iter()
        .find(|a| !nics.iter().any(|n| n.name == a.nic))
    {
        return Err(NetworkConfigError::UnknownNic {
            nic: extra.nic.clone(),
            known: known_nics(nics),
        });
    }
    // The entry of each NIC, in NIC order.
    let mut per_nic: Vec<Option<&NicAddresses>> = Vec::with_capacity(nics.len());
    for nic in nics {
        let mut mine = assigned.iter().filter(|a| a.nic == nic.name);
        let first = mine.next();
        if mine.next().is_some() {
            return Err(NetworkConfigError::DuplicateNic {
                nic: nic.name.clone(),
            });
        }
        per_nic.push(first);
    }

    // Default routes from pool gateways: one per (family, metric), default pool first.
    let mut gateways: Vec<(usize, usize, &AssignedAddress)> = Vec::new();
    for (i, entry) in per_nic.iter().enumerate() {
        for (j, addr) in entry.iter().flat_map(|a| &a.addresses).enumerate() {
            if addr.gateway.is_some() {
                gateways.push((i, j, addr));
            }
        }
    }
    gateways.sort_by_key(|(i, j, a)| (!a.default_route, *i, *j));
    let mut taken = BTreeMap::new();
    let mut keep = Vec::new();
    for (i, j, a) in gateways {
        let key = (a.address.is_ipv6(), a.metric.unwrap_or(0));
        if taken.insert(key, ()).is_none() {
            keep.push((i, j));
        }
    }

    let mut collisions = Collisions::default();
    let mut has_default = false;
    let mut ethernets = Vec::new();
    for (i, (nic, entry)) in nics.iter().zip(&per_nic).enumerate() {
        let eth = format!("eth{i}");
        let addresses: Vec<&AssignedAddress> = entry.iter().flat_map(|a| &a.addresses).collect();
        if addresses.is_empty() && !nic.dhcp4 && !nic.dhcp6 {
            return Err(NetworkConfigError::MissingAddresses {
                nic: nic.name.clone(),
            });
        }
        let raw_mac = entry
            .map(|a| a.mac.trim())
            .filter(|m| !m.is_empty())
            .ok_or_else(|| NetworkConfigError::MissingMac {
                nic: nic.name.clone(),
            })?;
        let mac = normalise_mac(raw_mac).ok_or_else(|| NetworkConfigError::InvalidMac {
            nic: nic.name.clone(),
            mac: raw_mac.to_owned(),
        })?;

        let mut cidrs = Vec::new();
        let mut routes = Vec::new();
        for (j, a) in addresses.iter().enumerate() {
            let max = max_len(a.address);
            if a.prefix > max {
                return Err(NetworkConfigError::InvalidPrefix {
                    nic: nic.name.clone(),
                    address: a.address,
                    prefix: a.prefix,
                    max,
                });
            }
            cidrs.push(format!("{}/{}", a.address, a.prefix));
            if let Some(gw) = a.gateway {
                if gw.is_ipv6() != a.address.is_ipv6() {
                    return Err(NetworkConfigError::GatewayFamily {
                        nic: nic.name.clone(),
                        address: a.address,
                        gateway: gw,
                    });
                }
                if keep.contains(&(i, j)) {
                    routes.push(CheckedRoute {
                        at: format!(
                            "the default route via gateway {gw} of {} address {}",
                            nic.name, a.address
                        ),
                        to: Prefix::default_route(gw.is_ipv6()),
                        via: Some(gw),
                        metric: a.metric,
                        table: None,
                    });
                }
            }
        }
        for (k, spec) in nic.routes.iter().enumerate() {
            routes.push(check_route(
                format!("network device {} route {}", nic.name, k + 1),
                spec,
            )?);
        }
        for r in &routes {
            collisions.add(r, None)?;
            has_default |= r.to.is_default();
        }
        // A DHCP server hands out the default route with the lease.
        has_default |= nic.dhcp4 || nic.dhcp6;
        let routing_policy = nic
            .routing_policy
            .iter()
            .enumerate()
            .map(|(k, spec)| {
                check_rule(
                    format!("network device {} routing policy rule {}", nic.name, k + 1),
                    spec,
                    false,
                )
            })
            .collect::<Result<Vec<_>, _>>()?;
        let mut dns = Vec::new();
        for s in &nic.dns_servers {
            let ip: IpAddr =
                s.trim()
                    .parse()
                    .map_err(|_| NetworkConfigError::InvalidDnsServer {
                        nic: nic.name.clone(),
                        value: s.clone(),
                    })?;
            dns.push(ip.to_string());
        }
        // linkMtu 1 means "inherit", as for the Proxmox-side mtu: leave the guest's MTU alone.
        let mtu = nic
            .link_mtu
            .filter(|m| *m > 1)
            .and_then(|m| u32::try_from(m).ok());
        ethernets.push((
            eth,
            Ethernet {
                matches: Match { macaddress: mac },
                dhcp4: nic.dhcp4,
                dhcp6: nic.dhcp6,
                addresses: cidrs,
                routes: routes.iter().map(CheckedRoute::netplan).collect(),
                routing_policy,
                nameservers: (!dns.is_empty()).then_some(Nameservers { addresses: dns }),
                mtu,
            },
        ));
    }

    let mut vrf_out = Vec::new();
    let mut enslaved: BTreeMap<&str, &str> = BTreeMap::new();
    for vrf in vrfs {
        crate::api::names::NameRule::Interface
            .check(&vrf.name)
            .map_err(|error| NetworkConfigError::InvalidVrfName { error })?;
        let at = |what: &str, k: usize| format!("VRF {} {what} {}", vrf.name, k + 1);
        let table = non_negative(&format!("VRF {}", vrf.name), "table", Some(vrf.table))?
            .unwrap_or(MAIN_TABLE);
        let mut interfaces = Vec::new();
        for iface in &vrf.interfaces {
            let idx = nics.iter().position(|n| &n.name == iface).ok_or_else(|| {
                NetworkConfigError::VrfUnknownInterface {
                    vrf: vrf.name.clone(),
                    interface: iface.clone(),
                    known: known_nics(nics),
                }
            })?;
            if let Some(first) = enslaved.insert(iface, &vrf.name) {
                return Err(NetworkConfigError::VrfInterfaceTwice {
                    nic: iface.clone(),
                    first: first.to_owned(),
                    second: vrf.name.clone(),
                });
            }
            interfaces.push(format!("eth{idx}"));
        }
        let mut routes = Vec::new();
        for (k, spec) in vrf.routes.iter().flatten().enumerate() {
            let r = check_route(at("route", k), spec)?;
            collisions.add(&r, Some(table))?;
            has_default |= r.to.is_default();
            routes.push(r.netplan());
        }
        let routing_policy = vrf
            .routing_policy
            .iter()
            .flatten()
            .enumerate()
            .map(|(k, spec)| check_rule(at("routing policy rule", k), spec, true))
            .collect::<Result<Vec<_>, _>>()?;
        vrf_out.push((
            vrf.name.clone(),
            Vrf {
                table,
                routes,
                routing_policy,
                interfaces,
            },
        ));
    }

    if !has_default {
        return Err(NetworkConfigError::MissingDefaultRoute);
    }
    Ok(Document {
        network: Network {
            version: 2,
            renderer: "networkd",
            ethernets: Ordered(ethernets),
            vrfs: Ordered(vrf_out),
        },
    })
}
