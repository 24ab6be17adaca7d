//! The admission checks of the Go provider's validating webhooks that CEL cannot make within the
//! API server's cost budget, or at all: pure functions of the objects, served by
//! [`crate::webhook`] on the Go provider's `/validate-...` paths. The rest of those checks are
//! CEL rules in the CRDs (see `super::machine`).
//!
//! - ProxmoxCluster / ProxmoxClusterTemplate: the control-plane endpoint is an IP or a DNS name,
//!   and no pool (cluster-wide or zone) hands out the endpoint's IP ([`cluster_spec`]).
//! - ProxmoxMachine: routing policies name a table (a VRF's, the VRF's own), and a `default`/`all`
//!   destination says its IP family when nothing else does ([`machine_spec`]).
//! - ProxmoxMachineTemplate: the spec is immutable, except for Cluster API's topology dry-runs
//!   ([`machine_template_update`]); CEL sees neither the request's dry-run flag nor annotations.

use std::fmt;
use std::net::IpAddr;
use std::sync::LazyLock;

use regex::Regex;
use serde_json::Value;

use super::{IpConfigSpec, NetworkSpec, ProxmoxClusterSpec, ProxmoxMachineSpec, RouteSpec};
use super::{RoutingPolicySpec, VrfDevice};

/// Annotation Cluster API's topology controller sets on the objects of its dry-run server-side
/// applies; immutability checks let those through (as the Go provider and CAPI's own do).
pub const TOPOLOGY_DRY_RUN_ANNOTATION: &str = "topology.cluster.x-k8s.io/dry-run";

/// What is wrong with one field, in the API server's words (`field.Error`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldError {
    /// Path of the field, e.g. `spec.ipv4Config.addresses[2]`.
    pub field: String,
    /// How it is wrong.
    pub kind: FieldErrorKind,
    /// The offending value, for [`FieldErrorKind::Invalid`].
    pub value: Option<String>,
    /// What is wrong and how to fix it.
    pub detail: String,
}

/// The `field.ErrorType`s capmox reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FieldErrorKind {
    /// `FieldValueInvalid`.
    Invalid,
    /// `FieldValueRequired`.
    Required,
    /// `FieldValueForbidden`.
    Forbidden,
}

impl FieldErrorKind {
    /// The `reason` of a `StatusCause`.
    pub fn reason(self) -> &'static str {
        match self {
            Self::Invalid => "FieldValueInvalid",
            Self::Required => "FieldValueRequired",
            Self::Forbidden => "FieldValueForbidden",
        }
    }
}

impl FieldError {
    fn invalid(field: String, value: &str, detail: impl Into<String>) -> Self {
        Self {
            field,
            kind: FieldErrorKind::Invalid,
            value: Some(value.to_owned()),
            detail: detail.into(),
        }
    }

    fn required(field: String, detail: impl Into<String>) -> Self {
        Self {
            field,
            kind: FieldErrorKind::Required,
            value: None,
            detail: detail.into(),
        }
    }

    fn forbidden(field: String, detail: impl Into<String>) -> Self {
        Self {
            field,
            kind: FieldErrorKind::Forbidden,
            value: None,
            detail: detail.into(),
        }
    }

    /// The message without the field path, as in a `StatusCause`.
    pub fn message(&self) -> String {
        match (self.kind, &self.value) {
            (FieldErrorKind::Invalid, Some(value)) => {
                format!("Invalid value: {value:?}: {}", self.detail)
            }
            (FieldErrorKind::Invalid, None) => format!("Invalid value: {}", self.detail),
            (FieldErrorKind::Required, _) => format!("Required value: {}", self.detail),
            (FieldErrorKind::Forbidden, _) => format!("Forbidden: {}", self.detail),
        }
    }
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.message())
    }
}

/// One entry of a pool's `addresses` as in-cluster IPAM (and the Go provider's webhook) reads
/// it: `first-last`, a CIDR, or one address; an inclusive range of addresses of one family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AddressRange {
    first: IpAddr,
    last: IpAddr,
}

/// Why a pool address entry does not parse.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{entry:?} is not an IP address, a first-last range or a CIDR: {reason}")]
pub struct AddressEntryError {
    /// The entry.
    pub entry: String,
    /// What is wrong with it.
    pub reason: &'static str,
}

impl AddressRange {
    /// Parses `10.0.0.10-10.0.0.20`, `10.0.0.0/24` (host bits allowed, as Go's `netip` does) or
    /// `10.0.0.5`; both families. No spaces, as in Go.
    pub fn parse(entry: &str) -> Result<Self, AddressEntryError> {
        let error = |reason| AddressEntryError {
            entry: entry.to_owned(),
            reason,
        };
        let address = |text: &str| {
            text.parse::<IpAddr>()
                .map_err(|_| error("not an IP address"))
        };
        if let Some((first, last)) = entry.split_once('-') {
            let (first, last) = (address(first)?, address(last)?);
            if first.is_ipv4() != last.is_ipv4() {
                return Err(error("the range mixes IPv4 and IPv6"));
            }
            if to_u128(first) > to_u128(last) {
                return Err(error("the range ends before it starts"));
            }
            return Ok(Self { first, last });
        }
        if let Some((base, bits)) = entry.split_once('/') {
            let base = address(base)?;
            let max = if base.is_ipv4() { 32 } else { 128 };
            // Digits only, without leading zeros, as Go's netip reads it (Rust's parsing also
            // takes `+24` and `024`).
            let canonical = bits.bytes().all(|b| b.is_ascii_digit())
                && (bits.len() == 1 || !bits.starts_with('0'));
            let bits: u32 = match bits.parse() {
                Ok(bits) if canonical && bits <= max => bits,
                _ => return Err(error("the prefix length is not a number within the family")),
            };
            let host_bits = max - bits;
            let mask = if host_bits >= 128 {
                u128::MAX
            } else {
                (1u128 << host_bits) - 1
            };
            let network = to_u128(base) & !mask;
            return Ok(Self {
                first: from_u128(network, base.is_ipv4()),
                last: from_u128(network | mask, base.is_ipv4()),
            });
        }
        let single = address(entry)?;
        Ok(Self {
            first: single,
            last: single,
        })
    }

    /// Whether `ip` is one of the addresses (never across families).
    pub fn contains(&self, ip: IpAddr) -> bool {
        ip.is_ipv4() == self.first.is_ipv4()
            && (to_u128(self.first)..=to_u128(self.last)).contains(&to_u128(ip))
    }
}

fn to_u128(address: IpAddr) -> u128 {
    match address {
        IpAddr::V4(v4) => u128::from(u32::from(v4)),
        IpAddr::V6(v6) => u128::from(v6),
    }
}

fn from_u128(value: u128, v4: bool) -> IpAddr {
    if v4 {
        // The value came from an IPv4 address and a mask within 32 bits.
        IpAddr::V4(std::net::Ipv4Addr::from(
            u32::try_from(value).unwrap_or(u32::MAX),
        ))
    } else {
        IpAddr::V6(std::net::Ipv6Addr::from(value))
    }
}

/// The Go provider's hostname check, verbatim: a short name of up to 253 characters, or an
/// optional host label and a domain whose last label is 2 to 63 letters; case-insensitive.
static HOSTNAME: LazyLock<Regex> = LazyLock::new(|| {
    let shortname = r"([a-z0-9]{1,253}|[a-z0-9][a-z0-9-]{1,251}[a-z0-9])";
    let hostname = r"([a-z0-9]{1,63}|[a-z0-9][a-z0-9-]{1,61}[a-z0-9]\.)?";
    let domain = r"((([a-z0-9]{1,63}|[a-z0-9][a-z0-9-]{1,61}[a-z0-9])\.)+?[a-z]{2,63})";
    Regex::new(&format!("(?i)^({shortname}|{hostname}{domain})$"))
        .expect("the hostname pattern compiles (a test uses it)")
});

/// Whether `host` passes the Go provider's hostname check (and is accepted without more checks).
pub fn is_hostname(host: &str) -> bool {
    HOSTNAME.is_match(host)
}

/// Whether a route or rule destination is the family-less placeholder `default` or `all`, as
/// capmox's network configuration reads it (trimmed, any case).
pub fn is_route_placeholder(value: &str) -> bool {
    let value = value.trim();
    value.eq_ignore_ascii_case("default") || value.eq_ignore_ascii_case("all")
}

/// A destination that gives an IP family: set, not blank and not a placeholder.
fn is_concrete(value: Option<&str>) -> bool {
    value.is_some_and(|v| !v.trim().is_empty() && !is_route_placeholder(v))
}

/// The Go provider's `validateControlPlaneEndpoint` on a ProxmoxCluster spec at `at` (`spec`, or
/// `spec.template.spec` for a template), over the zones' pools too (they hand out addresses
/// as well). Skipped when an external control plane provides the endpoint, and while no host is
/// set (the cluster controller waits for one).
pub fn cluster_spec(spec: &ProxmoxClusterSpec, at: &str) -> Vec<FieldError> {
    if spec.external_managed_control_plane == Some(true) {
        return Vec::new();
    }
    let Some(host) = spec
        .control_plane_endpoint
        .as_ref()
        .and_then(|e| e.host.as_deref())
        .filter(|h| !h.is_empty())
    else {
        return Vec::new();
    };
    // As in Go: a DNS name is taken as it is; resolving it would check one moment's answer.
    if is_hostname(host) {
        return Vec::new();
    }
    let host_field = format!("{at}.controlPlaneEndpoint.host");
    let Ok(ip) = host.parse::<IpAddr>() else {
        return vec![FieldError::invalid(
            host_field,
            host,
            "provided endpoint address is not a valid IP or FQDN: give the IP address or DNS \
             name of the workload cluster's API server",
        )];
    };
    let mut pools: Vec<(String, &Option<IpConfigSpec>)> = vec![
        (format!("{at}.ipv4Config"), &spec.ipv4_config),
        (format!("{at}.ipv6Config"), &spec.ipv6_config),
    ];
    for (index, zone) in spec.zone_config.iter().enumerate() {
        pools.push((
            format!("{at}.zoneConfig[{index}].ipv4Config"),
            &zone.ipv4_config,
        ));
        pools.push((
            format!("{at}.zoneConfig[{index}].ipv6Config"),
            &zone.ipv6_config,
        ));
    }
    let mut errors = Vec::new();
    for (path, config) in pools {
        let Some(config) = config else {
            continue;
        };
        for (index, entry) in config.addresses.iter().enumerate() {
            let field = format!("{path}.addresses[{index}]");
            match AddressRange::parse(entry) {
                Err(error) => errors.push(FieldError::invalid(
                    field,
                    entry,
                    format!(
                        "provided addresses are not valid IP addresses, ranges or CIDRs: {}; \
                         write 10.0.0.10, 10.0.0.10-10.0.0.20 or 10.0.0.0/24",
                        error.reason
                    ),
                )),
                Ok(range) if range.contains(ip) => errors.push(FieldError::invalid(
                    field,
                    entry,
                    format!(
                        "addresses may not contain the endpoint IP {ip} ({host_field}): a \
                         machine would get the API server's address; leave it out of the pool \
                         or use another endpoint"
                    ),
                )),
                Ok(_) => {}
            }
        }
    }
    errors
}

/// The checks of the Go provider's `validateNetworks` that need more than CEL's budget (nested
/// lists of free-form strings), on a ProxmoxMachine spec at `at`: every routing policy of a NIC
/// names a table (not 0, which capmox's network configuration reads as none), a VRF's policies
/// use the VRF's table, and a `default`/`all` destination comes with `is6` when nothing else
/// gives the family.
pub fn machine_spec(spec: &ProxmoxMachineSpec, at: &str) -> Vec<FieldError> {
    network(&spec.network, &format!("{at}.network"))
}

fn network(network: &NetworkSpec, at: &str) -> Vec<FieldError> {
    let mut errors = Vec::new();
    for (index, device) in network.network_devices.iter().enumerate() {
        let at = format!("{at}.networkDevices[{index}]");
        for (index, policy) in device.routing_policy.iter().flatten().enumerate() {
            let at = format!("{at}.routingPolicy[{index}]");
            if policy.table.is_none_or(|t| t == 0) {
                errors.push(FieldError::required(
                    format!("{at}.table"),
                    "a routing policy of a network device needs a table: set table to the \
                     routing table the rule selects (0 is none)",
                ));
            }
            policy_placeholder(policy, &at, &mut errors);
        }
        routes(device.routes.as_deref(), &at, &mut errors);
    }
    for (index, vrf) in network.vrfs.iter().enumerate() {
        errors.extend(vrf_device(vrf, &format!("{at}.vrfs[{index}]")));
    }
    errors
}

fn vrf_device(vrf: &VrfDevice, at: &str) -> Vec<FieldError> {
    let mut errors = Vec::new();
    for (index, policy) in vrf.routing_policy.iter().flatten().enumerate() {
        let at = format!("{at}.routingPolicy[{index}]");
        if let Some(table) = policy.table
            && i64::from(table) != vrf.table
        {
            errors.push(FieldError::invalid(
                format!("{at}.table"),
                &table.to_string(),
                format!(
                    "VRF {:?} uses routing table {}, and netplan refuses rules of a VRF that \
                     select another: set table to {} or leave it unset",
                    vrf.name, vrf.table, vrf.table
                ),
            ));
        }
        policy_placeholder(policy, &at, &mut errors);
    }
    routes(vrf.routes.as_deref(), at, &mut errors);
    errors
}

fn policy_placeholder(policy: &RoutingPolicySpec, at: &str, errors: &mut Vec<FieldError>) {
    let (to, from) = (policy.to.as_deref(), policy.from.as_deref());
    let placeholder =
        to.is_some_and(is_route_placeholder) || from.is_some_and(is_route_placeholder);
    let concrete = is_concrete(to) || is_concrete(from);
    if placeholder && !concrete && policy.is6.is_none() {
        errors.push(FieldError::required(
            format!("{at}.is6"),
            "is6 must be set when 'to'/'from' is a placeholder (default or all) and neither \
             provides an address family: set is6 to true for IPv6 or false for IPv4",
        ));
    }
}

fn routes(routes: Option<&[RouteSpec]>, at: &str, errors: &mut Vec<FieldError>) {
    for (index, route) in routes.unwrap_or_default().iter().enumerate() {
        if route.to.as_deref().is_some_and(is_route_placeholder)
            && !is_concrete(route.via.as_deref())
            && route.is6.is_none()
        {
            errors.push(FieldError::required(
                format!("{at}.routes[{index}].is6"),
                "is6 must be set when 'to' is a placeholder (default or all) and 'via' is unset: \
                 set is6 to true for IPv6 or false for IPv4, or set via",
            ));
        }
    }
}

/// The Go provider's ProxmoxMachineTemplate update check: `spec` (as the API server stores it,
/// defaults applied) must not change, unless the request is one of Cluster API's topology
/// dry-runs (`topology_dry_run`: the request is a dry-run and the object carries
/// [`TOPOLOGY_DRY_RUN_ANNOTATION`]), which compare what a change would do.
pub fn machine_template_update(
    old_spec: &Value,
    new_spec: &Value,
    topology_dry_run: bool,
) -> Vec<FieldError> {
    if topology_dry_run || old_spec == new_spec {
        return Vec::new();
    }
    vec![FieldError::forbidden(
        "spec".to_owned(),
        "ProxmoxMachineTemplate is immutable: create a new ProxmoxMachineTemplate and point the \
         MachineDeployment or KubeadmControlPlane at it (Cluster API then replaces the machines)",
    )]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{ApiEndpoint, NetworkDevice, ZoneConfigSpec};

    fn pool(addresses: &[&str]) -> Option<IpConfigSpec> {
        Some(IpConfigSpec {
            addresses: addresses.iter().map(|a| (*a).to_owned()).collect(),
            prefix: 24,
            gateway: "10.0.0.1".to_owned(),
            metric: None,
        })
    }

    fn cluster(host: &str, v4: &[&str]) -> ProxmoxClusterSpec {
        ProxmoxClusterSpec {
            control_plane_endpoint: Some(ApiEndpoint {
                host: Some(host.to_owned()),
                port: Some(6443),
            }),
            ipv4_config: pool(v4),
            dns_servers: vec!["10.0.0.2".to_owned()],
            ..ProxmoxClusterSpec::default()
        }
    }

    fn messages(errors: &[FieldError]) -> Vec<String> {
        errors.iter().map(ToString::to_string).collect()
    }

    fn assert_one(errors: &[FieldError], field: &str, needle: &str) {
        assert_eq!(errors.len(), 1, "{:#?}", messages(errors));
        assert_eq!(errors[0].field, field, "{:#?}", messages(errors));
        assert!(
            errors[0].to_string().contains(needle),
            "{needle:?} not in {}",
            errors[0]
        );
    }

    #[test]
    fn address_entries_parse_as_in_cluster_ipam_reads_them() {
        let range = AddressRange::parse("10.0.0.10-10.0.0.20").expect("a range");
        assert!(range.contains("10.0.0.10".parse().expect("ip")));
        assert!(range.contains("10.0.0.20".parse().expect("ip")));
        assert!(!range.contains("10.0.0.21".parse().expect("ip")));
        let cidr = AddressRange::parse("10.0.1.5/24").expect("a CIDR with host bits");
        assert!(cidr.contains("10.0.1.0".parse().expect("ip")));
        assert!(cidr.contains("10.0.1.255".parse().expect("ip")));
        assert!(!cidr.contains("10.0.2.0".parse().expect("ip")));
        let all = AddressRange::parse("0.0.0.0/0").expect("everything");
        assert!(all.contains("255.255.255.255".parse().expect("ip")));
        let v6 = AddressRange::parse("2001:db8::/64").expect("an IPv6 CIDR");
        assert!(v6.contains("2001:db8::ffff".parse().expect("ip")));
        assert!(!v6.contains("10.0.0.1".parse().expect("ip")));
        let single = AddressRange::parse("2001:db8::5").expect("one address");
        assert!(single.contains("2001:db8::5".parse().expect("ip")));
        assert!(AddressRange::parse("::/0").is_ok());
        for bad in [
            "10.0.0.20-10.0.0.10",
            "10.0.0.1-2001:db8::1",
            "10.0.0.0/33",
            "10.0.0.0/+8",
            "10.0.0.0/08",
            "10.0.0.0/",
            "10.0.0",
            " 10.0.0.1",
            "010.0.0.1",
            "foo-bar",
            "",
        ] {
            assert!(AddressRange::parse(bad).is_err(), "{bad:?} parsed");
        }
    }

    #[test]
    fn the_hostname_check_is_the_go_providers() {
        for ok in [
            "api",
            "API.example.com",
            "cp.k8s.example.org",
            "my-cluster.internal.example",
            "example.com",
            "1234",
        ] {
            assert!(is_hostname(ok), "{ok}");
        }
        for bad in [
            "10.0.0.1",
            "2001:db8::1",
            "-api.example.com",
            "api.example.c0m",
            "api_1.example.com",
            "a b",
            "",
        ] {
            assert!(!is_hostname(bad), "{bad}");
        }
        assert!(is_hostname(&"a".repeat(253)));
        assert!(!is_hostname(&"a".repeat(254)));
    }

    #[test]
    fn a_dns_name_endpoint_is_accepted_without_more_checks() {
        let spec = cluster("api.example.com", &["not-an-address"]);
        assert_eq!(cluster_spec(&spec, "spec"), []);
    }

    #[test]
    fn garbage_is_neither_an_ip_nor_a_dns_name() {
        for host in [
            "10.0.0.256",
            "api..example.com",
            "http://10.0.0.5",
            "10.0.0.5:6443",
        ] {
            let errors = cluster_spec(&cluster(host, &["10.0.0.10-10.0.0.20"]), "spec");
            assert_one(
                &errors,
                "spec.controlPlaneEndpoint.host",
                "provided endpoint address is not a valid IP or FQDN",
            );
        }
    }

    #[test]
    fn an_endpoint_outside_the_pools_is_accepted() {
        let spec = cluster(
            "10.0.0.5",
            &["10.0.0.10-10.0.0.20", "10.0.1.0/24", "10.0.0.30"],
        );
        assert_eq!(cluster_spec(&spec, "spec"), []);
    }

    #[test]
    fn an_endpoint_inside_a_range_is_refused() {
        let spec = cluster("10.0.0.15", &["10.0.0.30", "10.0.0.10-10.0.0.20"]);
        let errors = cluster_spec(&spec, "spec");
        assert_one(
            &errors,
            "spec.ipv4Config.addresses[1]",
            "addresses may not contain the endpoint IP 10.0.0.15",
        );
        assert!(errors[0].to_string().contains("\"10.0.0.10-10.0.0.20\""));
        let spec = cluster("10.0.0.30", &["10.0.0.30"]);
        assert_one(
            &cluster_spec(&spec, "spec"),
            "spec.ipv4Config.addresses[0]",
            "may not contain the endpoint IP",
        );
    }

    #[test]
    fn an_ipv6_endpoint_inside_an_ipv6_cidr_is_refused() {
        let mut spec = cluster("2001:db8::10", &["10.0.0.10-10.0.0.20"]);
        spec.ipv6_config = pool(&["2001:db8::/64"]);
        assert_one(
            &cluster_spec(&spec, "spec"),
            "spec.ipv6Config.addresses[0]",
            "may not contain the endpoint IP 2001:db8::10",
        );
        spec.ipv6_config = pool(&["2001:db8:1::/64"]);
        assert_eq!(cluster_spec(&spec, "spec"), []);
    }

    #[test]
    fn zone_pools_may_not_hold_the_endpoint_either() {
        let mut spec = cluster("10.0.5.7", &["10.0.0.10-10.0.0.20"]);
        spec.zone_config = vec![
            ZoneConfigSpec {
                zone: "a".to_owned(),
                ipv4_config: pool(&["10.0.4.0/24"]),
                ..ZoneConfigSpec::default()
            },
            ZoneConfigSpec {
                zone: "b".to_owned(),
                ipv4_config: pool(&["10.0.5.0/24"]),
                ..ZoneConfigSpec::default()
            },
        ];
        assert_one(
            &cluster_spec(&spec, "spec.template.spec"),
            "spec.template.spec.zoneConfig[1].ipv4Config.addresses[0]",
            "may not contain the endpoint IP",
        );
    }

    #[test]
    fn invalid_pool_addresses_are_refused_when_the_endpoint_is_an_ip() {
        let spec = cluster("10.0.0.5", &["10.0.0.10-10.0.0.20", "10.0.0.300"]);
        assert_one(
            &cluster_spec(&spec, "spec"),
            "spec.ipv4Config.addresses[1]",
            "provided addresses are not valid IP addresses, ranges or CIDRs",
        );
    }

    #[test]
    fn an_external_control_plane_or_no_host_skips_the_endpoint_check() {
        let mut spec = cluster("10.0.0.15", &["10.0.0.10-10.0.0.20"]);
        spec.external_managed_control_plane = Some(true);
        assert_eq!(cluster_spec(&spec, "spec"), []);
        spec.external_managed_control_plane = Some(false);
        assert_eq!(cluster_spec(&spec, "spec").len(), 1);
        spec.control_plane_endpoint = None;
        assert_eq!(cluster_spec(&spec, "spec"), []);
        spec.control_plane_endpoint = Some(ApiEndpoint {
            host: None,
            port: Some(6443),
        });
        assert_eq!(cluster_spec(&spec, "spec"), []);
    }

    fn machine(devices: Vec<NetworkDevice>, vrfs: Vec<VrfDevice>) -> ProxmoxMachineSpec {
        ProxmoxMachineSpec {
            network: NetworkSpec {
                network_devices: devices,
                vrfs,
                ..NetworkSpec::default()
            },
            ..ProxmoxMachineSpec::default()
        }
    }

    fn nic(name: &str) -> NetworkDevice {
        NetworkDevice {
            name: name.to_owned(),
            ..NetworkDevice::default()
        }
    }

    fn policy(to: Option<&str>, from: Option<&str>, table: Option<i32>) -> RoutingPolicySpec {
        RoutingPolicySpec {
            to: to.map(str::to_owned),
            from: from.map(str::to_owned),
            table,
            ..RoutingPolicySpec::default()
        }
    }

    fn route(to: &str, via: Option<&str>, is6: Option<bool>) -> RouteSpec {
        RouteSpec {
            to: Some(to.to_owned()),
            via: via.map(str::to_owned),
            is6,
            ..RouteSpec::default()
        }
    }

    #[test]
    fn many_nics_with_complete_routing_are_accepted() {
        let devices: Vec<NetworkDevice> = (0..12)
            .map(|i| NetworkDevice {
                routing_policy: Some(vec![policy(Some("10.1.0.0/16"), None, Some(100))]),
                routes: Some(vec![route("default", Some("10.0.0.1"), None)]),
                ..nic(&format!("net{i}"))
            })
            .collect();
        assert_eq!(machine_spec(&machine(devices, Vec::new()), "spec"), []);
    }

    #[test]
    fn a_nic_routing_policy_needs_a_table() {
        for table in [None, Some(0)] {
            let device = NetworkDevice {
                routing_policy: Some(vec![
                    policy(Some("10.1.0.0/16"), None, Some(100)),
                    policy(Some("10.2.0.0/16"), None, table),
                ]),
                ..nic("net0")
            };
            assert_one(
                &machine_spec(&machine(vec![nic("net1"), device], Vec::new()), "spec"),
                "spec.network.networkDevices[1].routingPolicy[1].table",
                "needs a table",
            );
        }
    }

    #[test]
    fn a_placeholder_policy_says_its_family() {
        let with = |p: RoutingPolicySpec| {
            let device = NetworkDevice {
                routing_policy: Some(vec![p]),
                ..nic("net0")
            };
            machine_spec(&machine(vec![device], Vec::new()), "spec")
        };
        for (to, from) in [
            (Some("default"), None),
            (None, Some("all")),
            (Some("all"), Some("default")),
            (Some("DEFAULT"), Some("")),
        ] {
            assert_one(
                &with(policy(to, from, Some(100))),
                "spec.network.networkDevices[0].routingPolicy[0].is6",
                "is6 must be set",
            );
            let mut told = policy(to, from, Some(100));
            told.is6 = Some(false);
            assert_eq!(with(told), []);
        }
        assert_eq!(
            with(policy(Some("default"), Some("10.0.0.0/8"), Some(100))),
            []
        );
        assert_eq!(
            with(policy(Some("2001:db8::/64"), Some("all"), Some(100))),
            []
        );
    }

    #[test]
    fn a_placeholder_route_says_its_family_or_has_a_via() {
        let with = |r: RouteSpec| {
            let device = NetworkDevice {
                routes: Some(vec![route("10.9.0.0/16", None, None), r]),
                ..nic("net0")
            };
            machine_spec(&machine(vec![device], Vec::new()), "spec")
        };
        assert_one(
            &with(route("default", None, None)),
            "spec.network.networkDevices[0].routes[1].is6",
            "is6 must be set when 'to' is a placeholder",
        );
        assert_eq!(with(route("all", None, None)).len(), 1);
        assert_eq!(with(route("default", None, Some(true))), []);
        assert_eq!(with(route("default", Some("10.0.0.1"), None)), []);
        assert_eq!(with(route("0.0.0.0/0", None, None)), []);
    }

    #[test]
    fn a_vrf_policy_uses_the_vrf_table_and_says_its_family() {
        let vrf = |policies: Vec<RoutingPolicySpec>, routes: Vec<RouteSpec>| VrfDevice {
            name: "blue".to_owned(),
            table: 500,
            interfaces: vec!["net1".to_owned()],
            routes: Some(routes).filter(|r| !r.is_empty()),
            routing_policy: Some(policies).filter(|p| !p.is_empty()),
        };
        let check = |vrf: VrfDevice| {
            machine_spec(&machine(vec![nic("net0"), nic("net1")], vec![vrf]), "spec")
        };
        assert_eq!(
            check(vrf(
                vec![
                    policy(Some("10.5.0.0/16"), None, Some(500)),
                    policy(Some("10.6.0.0/16"), None, None)
                ],
                vec![route("default", Some("10.5.0.1"), None)]
            )),
            []
        );
        assert_one(
            &check(vrf(
                vec![policy(Some("10.5.0.0/16"), None, Some(100))],
                Vec::new(),
            )),
            "spec.network.vrfs[0].routingPolicy[0].table",
            "VRF \"blue\" uses routing table 500",
        );
        assert_one(
            &check(vrf(vec![policy(None, Some("all"), None)], Vec::new())),
            "spec.network.vrfs[0].routingPolicy[0].is6",
            "is6 must be set",
        );
        assert_one(
            &check(vrf(Vec::new(), vec![route("default", None, None)])),
            "spec.network.vrfs[0].routes[0].is6",
            "is6 must be set",
        );
    }

    #[test]
    fn every_problem_is_reported_not_just_the_first() {
        let device = NetworkDevice {
            routing_policy: Some(vec![policy(Some("all"), None, None)]),
            routes: Some(vec![route("default", None, None)]),
            ..nic("net0")
        };
        let errors = machine_spec(&machine(vec![device], Vec::new()), "spec");
        assert_eq!(errors.len(), 3, "{:#?}", messages(&errors));
    }

    #[test]
    fn a_template_spec_may_only_change_in_a_topology_dry_run() {
        let old = serde_json::json!({"template": {"spec": {"memoryMiB": 2048}}});
        let new = serde_json::json!({"template": {"spec": {"memoryMiB": 4096}}});
        assert_one(
            &machine_template_update(&old, &new, false),
            "spec",
            "ProxmoxMachineTemplate is immutable",
        );
        assert_eq!(machine_template_update(&old, &new, true), []);
        assert_eq!(machine_template_update(&old, &old.clone(), false), []);
    }

    #[test]
    fn field_errors_read_like_the_api_servers() {
        let error = FieldError::invalid("spec.x".to_owned(), "v", "bad");
        assert_eq!(error.to_string(), "spec.x: Invalid value: \"v\": bad");
        assert_eq!(
            FieldError::required("spec.y".to_owned(), "set it").to_string(),
            "spec.y: Required value: set it"
        );
        assert_eq!(
            FieldError::forbidden("spec".to_owned(), "no").to_string(),
            "spec: Forbidden: no"
        );
    }
}
