//! Renderer tests: every document is compared with the YAML a user would expect (parsed, so key
//! order and quoting do not matter), one exactly as text, and every validation error by message.

use std::net::IpAddr;

use serde_norway::Value;

use super::*;
use crate::api::{RouteSpec, RoutingPolicySpec, VrfDevice};
use crate::placement::Placement;
use crate::placement::ResolvedNic;

fn nic(name: &str) -> ResolvedNic {
    crate::placement::fixtures::resolved_nic(name)
}

fn ip(s: &str) -> IpAddr {
    s.parse().expect("test IP")
}

/// An address from a pool with a gateway (a default route) and no metric.
fn addr(a: &str, prefix: u8, gw: Option<&str>) -> AssignedAddress {
    AssignedAddress {
        address: ip(a),
        prefix,
        gateway: gw.map(ip),
        default_route: false,
        metric: None,
    }
}

fn assigned(nic: &str, mac: &str, addresses: Vec<AssignedAddress>) -> NicAddresses {
    NicAddresses {
        nic: nic.to_owned(),
        mac: mac.to_owned(),
        addresses,
    }
}

fn route(to: &str, via: Option<&str>) -> RouteSpec {
    RouteSpec {
        to: Some(to.to_owned()),
        via: via.map(str::to_owned),
        ..Default::default()
    }
}

fn yaml(s: &str) -> Value {
    serde_norway::from_str(s).expect("valid YAML")
}

fn render(nics: &[ResolvedNic], vrfs: &[VrfDevice], a: &[NicAddresses]) -> Value {
    yaml(&render_network_config(nics, vrfs, a).expect("renders"))
}

fn render_err(nics: &[ResolvedNic], vrfs: &[VrfDevice], a: &[NicAddresses]) -> String {
    render_network_config(nics, vrfs, a)
        .expect_err("must be refused")
        .to_string()
}

const MAC0: &str = "BC:24:11:00:00:01";
const MAC1: &str = "BC:24:11:00:00:02";

fn v4_net0() -> Vec<NicAddresses> {
    vec![assigned(
        "net0",
        MAC0,
        vec![addr("10.0.0.5", 24, Some("10.0.0.1"))],
    )]
}

// ------------------------------------------------------------------------------ meta-data

fn meta() -> MetaData {
    MetaData {
        instance_id: "9b9f5a46-0c1d-4f7e-8b1a-1c2d3e4f5a6b".to_owned(),
        hostname: "cp-0".to_owned(),
        provider_id: None,
        kubernetes_version: None,
    }
}

#[test]
fn meta_data_has_instance_id_and_hostnames_in_the_go_order() {
    assert_eq!(
        render_meta_data(&meta()).expect("renders"),
        "instance-id: 9b9f5a46-0c1d-4f7e-8b1a-1c2d3e4f5a6b\n\
         local-hostname: cp-0\n\
         hostname: cp-0\n"
    );
}

#[test]
fn meta_data_with_provider_id_and_kubernetes_version() {
    let m = MetaData {
        provider_id: Some(provider_id("9b9f5a46-0c1d-4f7e-8b1a-1c2d3e4f5a6b")),
        kubernetes_version: Some("v1.33.1".to_owned()),
        ..meta()
    };
    assert_eq!(
        render_meta_data(&m).expect("renders"),
        "instance-id: 9b9f5a46-0c1d-4f7e-8b1a-1c2d3e4f5a6b\n\
         local-hostname: cp-0\n\
         hostname: cp-0\n\
         provider-id: proxmox://9b9f5a46-0c1d-4f7e-8b1a-1c2d3e4f5a6b\n\
         kubernetes-version: v1.33.1\n"
    );
}

#[test]
fn meta_data_needs_hostname_and_instance_id() {
    let no_host = MetaData {
        hostname: String::new(),
        ..meta()
    };
    assert_eq!(
        render_meta_data(&no_host).expect_err("refused").to_string(),
        "meta-data needs a hostname; the ProxmoxMachine has no name"
    );
    let no_id = MetaData {
        instance_id: " ".to_owned(),
        ..meta()
    };
    assert_eq!(
        render_meta_data(&no_id).expect_err("refused").to_string(),
        "meta-data needs an instance-id; the VM config has no smbios1 uuid"
    );
}

// ------------------------------------------------------------------------------ formats

#[test]
fn formats_are_read_and_unknown_ones_refused_with_a_reason() {
    assert_eq!(
        BootstrapFormat::parse(Some("ignition")),
        Ok(BootstrapFormat::Ignition)
    );
    assert_eq!(
        BootstrapFormat::parse(Some("cloud-config")),
        Ok(BootstrapFormat::CloudConfig)
    );
    let unknown = BootstrapFormat::parse(Some("yaml")).expect_err("unknown");
    assert_eq!(unknown.reason(), "BootstrapFormatUnsupported");
    assert_eq!(
        unknown.to_string(),
        "bootstrap data format \"yaml\" is unknown; the bootstrap Secret's format must be \
         cloud-config or ignition"
    );
}

// ------------------------------------------------------------------------------ network-config

#[test]
fn ipv4_single_nic_exact_text() {
    let mut n0 = nic("net0");
    n0.dns_servers = vec!["10.0.0.2".to_owned()];
    let text = render_network_config(&[n0], &[], &v4_net0()).expect("renders");
    assert_eq!(
        text,
        "network:
  version: 2
  renderer: networkd
  ethernets:
    eth0:
      match:
        macaddress: bc:24:11:00:00:01
      dhcp4: false
      dhcp6: false
      addresses:
      - 10.0.0.5/24
      routes:
      - to: 0.0.0.0/0
        via: 10.0.0.1
      nameservers:
        addresses:
        - 10.0.0.2
"
    );
}

#[test]
fn ipv6_only_nic_gets_an_ipv6_default_route() {
    let a = vec![assigned(
        "net0",
        MAC0,
        vec![AssignedAddress {
            metric: Some(100),
            ..addr("2001:db8::5", 64, Some("2001:db8::1"))
        }],
    )];
    assert_eq!(
        render(&[nic("net0")], &[], &a),
        yaml(
            "network:
  version: 2
  renderer: networkd
  ethernets:
    eth0:
      match: {macaddress: 'bc:24:11:00:00:01'}
      dhcp4: false
      dhcp6: false
      addresses: ['2001:db8::5/64']
      routes: [{to: '::/0', via: '2001:db8::1', metric: 100}]
"
        )
    );
}

#[test]
fn dual_stack_nic_has_both_addresses_and_both_default_routes() {
    let mut n0 = nic("net0");
    n0.dns_servers = vec!["10.0.0.2".to_owned(), "2001:db8::53".to_owned()];
    let a = vec![assigned(
        "net0",
        MAC0,
        vec![
            AssignedAddress {
                default_route: true,
                ..addr("10.0.0.5", 24, Some("10.0.0.1"))
            },
            AssignedAddress {
                default_route: true,
                ..addr("2001:db8::5", 64, Some("2001:db8::1"))
            },
        ],
    )];
    assert_eq!(
        render(&[n0], &[], &a),
        yaml(
            "network:
  version: 2
  renderer: networkd
  ethernets:
    eth0:
      match: {macaddress: 'bc:24:11:00:00:01'}
      dhcp4: false
      dhcp6: false
      addresses: [10.0.0.5/24, '2001:db8::5/64']
      routes:
      - {to: 0.0.0.0/0, via: 10.0.0.1}
      - {to: '::/0', via: '2001:db8::1'}
      nameservers: {addresses: [10.0.0.2, '2001:db8::53']}
"
        )
    );
}

#[test]
fn several_nics_are_eth_n_in_spec_order_with_their_own_settings() {
    let mut n1 = nic("net1");
    n1.dns_servers = vec!["192.168.1.2".to_owned()];
    let nics = [nic("net0"), n1, nic("net5")];
    let a = vec![
        // Given out of order on purpose: the NIC order of the placement decides.
        assigned(
            "net5",
            "bc:24:11:00:00:05",
            vec![addr("172.16.0.9", 16, None)],
        ),
        assigned("net0", MAC0, vec![addr("10.0.0.5", 24, Some("10.0.0.1"))]),
        assigned("net1", MAC1, vec![addr("192.168.1.5", 24, None)]),
    ];
    let text = render_network_config(&nics, &[], &a).expect("renders");
    assert_eq!(
        yaml(&text),
        yaml(
            "network:
  version: 2
  renderer: networkd
  ethernets:
    eth0:
      match: {macaddress: 'bc:24:11:00:00:01'}
      dhcp4: false
      dhcp6: false
      addresses: [10.0.0.5/24]
      routes: [{to: 0.0.0.0/0, via: 10.0.0.1}]
    eth1:
      match: {macaddress: 'bc:24:11:00:00:02'}
      dhcp4: false
      dhcp6: false
      addresses: [192.168.1.5/24]
      nameservers: {addresses: [192.168.1.2]}
    eth2:
      match: {macaddress: 'bc:24:11:00:00:05'}
      dhcp4: false
      dhcp6: false
      addresses: [172.16.0.9/16]
"
        )
    );
    let order: Vec<usize> = ["eth0:", "eth1:", "eth2:"]
        .iter()
        .map(|k| text.find(k).expect("key present"))
        .collect();
    assert!(order.is_sorted(), "ethernets in NIC order:\n{text}");
}

#[test]
fn eleven_nics_keep_numeric_order_eth2_before_eth10() {
    let nics: Vec<ResolvedNic> = (0..11).map(|i| nic(&format!("net{i}"))).collect();
    let a: Vec<NicAddresses> = (0..11u8)
        .map(|i| {
            assigned(
                &format!("net{i}"),
                &format!("bc:24:11:00:00:{i:02x}"),
                vec![addr(
                    &format!("10.0.{i}.5"),
                    24,
                    (i == 0).then_some("10.0.0.1"),
                )],
            )
        })
        .collect();
    let text = render_network_config(&nics, &[], &a).expect("renders");
    let eth2 = text.find("eth2:").expect("eth2");
    let eth10 = text.find("eth10:").expect("eth10");
    assert!(eth2 < eth10, "eth2 must come before eth10:\n{text}");
    let doc = yaml(&text);
    assert_eq!(
        doc["network"]["ethernets"]["eth10"]["addresses"][0],
        Value::from("10.0.10.5/24")
    );
}

#[test]
fn routes_resolve_placeholders_and_bare_ips() {
    let mut n0 = nic("net0");
    n0.routes = vec![
        RouteSpec {
            metric: Some(50),
            ..route("default", Some("10.0.0.254"))
        },
        RouteSpec {
            is6: Some(true),
            table: Some(100),
            ..route("all", None)
        },
        route("all", Some("2001:db8::fe")),
        route("192.168.7.1", Some("10.0.0.254")),
        route("2001:db8:1::7", None),
        route("172.16.0.0/12", Some("10.0.0.254")),
    ];
    let a = vec![assigned(
        "net0",
        MAC0,
        vec![
            addr("10.0.0.5", 24, Some("10.0.0.1")),
            addr("2001:db8::5", 64, None),
        ],
    )];
    assert_eq!(
        render(&[n0], &[], &a)["network"]["ethernets"]["eth0"]["routes"],
        yaml(
            "- {to: 0.0.0.0/0, via: 10.0.0.1}
- {to: 0.0.0.0/0, via: 10.0.0.254, metric: 50}
- {to: '::/0', table: 100}
- {to: '::/0', via: '2001:db8::fe'}
- {to: 192.168.7.1/32, via: 10.0.0.254}
- {to: '2001:db8:1::7/128'}
- {to: 172.16.0.0/12, via: 10.0.0.254}
"
        )
    );
}

#[test]
fn a_user_default_route_alone_satisfies_the_gateway_check() {
    let mut n0 = nic("net0");
    n0.routes = vec![route("default", Some("10.0.0.254"))];
    let a = vec![assigned("net0", MAC0, vec![addr("10.0.0.5", 24, None)])];
    assert_eq!(
        render(&[n0], &[], &a)["network"]["ethernets"]["eth0"]["routes"],
        yaml("[{to: 0.0.0.0/0, via: 10.0.0.254}]")
    );
}

#[test]
fn routing_policy_is_rendered_with_placeholders_resolved() {
    let mut n0 = nic("net0");
    n0.routing_policy = vec![
        RoutingPolicySpec {
            from: Some("10.0.0.0/24".to_owned()),
            table: Some(100),
            priority: Some(100),
            ..Default::default()
        },
        RoutingPolicySpec {
            to: Some("default".to_owned()),
            from: Some("2001:db8::/64".to_owned()),
            table: Some(200),
            ..Default::default()
        },
        RoutingPolicySpec {
            to: Some("all".to_owned()),
            is6: Some(true),
            table: Some(300),
            ..Default::default()
        },
        RoutingPolicySpec {
            to: Some("192.168.9.9".to_owned()),
            table: Some(300),
            ..Default::default()
        },
    ];
    assert_eq!(
        render(&[n0], &[], &v4_net0())["network"]["ethernets"]["eth0"]["routing-policy"],
        yaml(
            "- {from: 10.0.0.0/24, priority: 100, table: 100}
- {to: '::/0', from: '2001:db8::/64', table: 200}
- {to: '::/0', table: 300}
- {to: 192.168.9.9/32, table: 300}
"
        )
    );
}

#[test]
fn vrfs_get_their_table_enslaved_nics_routes_and_rules() {
    let vrfs = vec![VrfDevice {
        name: "vrf-storage".to_owned(),
        table: 500,
        interfaces: vec!["net1".to_owned()],
        routes: Some(vec![route("default", Some("192.168.1.1"))]),
        routing_policy: Some(vec![RoutingPolicySpec {
            from: Some("192.168.1.0/24".to_owned()),
            ..Default::default()
        }]),
    }];
    let a = vec![
        assigned("net0", MAC0, vec![addr("10.0.0.5", 24, Some("10.0.0.1"))]),
        assigned("net1", MAC1, vec![addr("192.168.1.5", 24, None)]),
    ];
    let doc = render(&[nic("net0"), nic("net1")], &vrfs, &a);
    assert_eq!(
        doc["network"]["vrfs"],
        yaml(
            "vrf-storage:
  table: 500
  routes: [{to: 0.0.0.0/0, via: 192.168.1.1}]
  routing-policy: [{from: 192.168.1.0/24}]
  interfaces: [eth1]
"
        )
    );
    // A default route in the VRF table does not collide with the main table's.
    assert_eq!(
        doc["network"]["ethernets"]["eth0"]["routes"],
        yaml("[{to: 0.0.0.0/0, via: 10.0.0.1}]")
    );
}

#[test]
fn link_mtu_is_the_guest_mtu_and_1_means_inherit() {
    let mut n0 = nic("net0");
    n0.link_mtu = Some(9000);
    n0.mtu = Some(1); // the Proxmox-side MTU never reaches the guest config
    let mut n1 = nic("net1");
    n1.link_mtu = Some(1);
    let a = vec![
        assigned("net0", MAC0, vec![addr("10.0.0.5", 24, Some("10.0.0.1"))]),
        assigned("net1", MAC1, vec![addr("192.168.1.5", 24, None)]),
    ];
    let doc = render(&[n0, n1], &[], &a);
    assert_eq!(
        doc["network"]["ethernets"]["eth0"]["mtu"],
        Value::from(9000)
    );
    assert!(doc["network"]["ethernets"]["eth1"].get("mtu").is_none());
}

#[test]
fn dns_servers_come_from_the_placement_nic() {
    let mut n0 = nic("net0");
    n0.dns_servers = vec!["1.1.1.1".to_owned(), " 2606:4700:4700::1111 ".to_owned()];
    assert_eq!(
        render(&[n0], &[], &v4_net0())["network"]["ethernets"]["eth0"]["nameservers"],
        yaml("{addresses: [1.1.1.1, '2606:4700:4700::1111']}")
    );
}

#[test]
fn two_gateways_with_one_metric_keep_the_default_pools_route_instead_of_failing() {
    // Go bug 13: this failed with ErrConflictingMetrics and a terminal VMProvisionFailed.
    let a = vec![
        assigned("net0", MAC0, vec![addr("10.0.0.5", 24, Some("10.0.0.1"))]),
        assigned(
            "net1",
            MAC1,
            vec![
                AssignedAddress {
                    default_route: true,
                    ..addr("192.168.1.5", 24, Some("192.168.1.1"))
                },
                AssignedAddress {
                    metric: Some(300),
                    ..addr("192.168.2.5", 24, Some("192.168.2.1"))
                },
            ],
        ),
    ];
    let doc = render(&[nic("net0"), nic("net1")], &[], &a);
    assert!(doc["network"]["ethernets"]["eth0"].get("routes").is_none());
    assert_eq!(
        doc["network"]["ethernets"]["eth1"]["routes"],
        yaml("[{to: 0.0.0.0/0, via: 192.168.1.1}, {to: 0.0.0.0/0, via: 192.168.2.1, metric: 300}]")
    );
}

#[test]
fn qemu_macs_are_quoted_so_yaml_1_1_reads_a_string() {
    let a = vec![assigned(
        "net0",
        "52:54:00:12:34:56",
        vec![addr("10.0.0.5", 24, Some("10.0.0.1"))],
    )];
    let text = render_network_config(&[nic("net0")], &[], &a).expect("renders");
    assert!(
        text.contains("macaddress: '52:54:00:12:34:56'\n"),
        "PyYAML would read an unquoted 52:54:00:12:34:56 as an integer:\n{text}"
    );
}

// ------------------------------------------------------------------------------ validation

fn with_route(r: RouteSpec) -> ResolvedNic {
    let mut n = nic("net0");
    n.routes = vec![r];
    n
}

fn with_rule(r: RoutingPolicySpec) -> ResolvedNic {
    let mut n = nic("net0");
    n.routing_policy = vec![r];
    n
}

#[test]
fn every_validation_error_says_what_to_fix() {
    let v4 = v4_net0();
    let cases: Vec<(&str, String, &str)> = vec![
        (
            "no devices",
            render_err(&[], &[], &[]),
            "no network devices: spec.network.networkDevices must list at least one NIC",
        ),
        (
            "no addresses",
            render_err(&[nic("net0")], &[], &[]),
            "network device net0 has no IP address; give it an IP pool (defaultIPv4/defaultIPv6 \
             or ipPoolRef) and wait for its IPAddressClaims to be bound, or set dhcp4/dhcp6",
        ),
        (
            "no mac",
            render_err(
                &[nic("net0")],
                &[],
                &[assigned("net0", " ", v4[0].addresses.clone())],
            ),
            "network device net0 has no MAC address; the VM config has no net0 entry with a MAC",
        ),
        (
            "bad mac",
            render_err(
                &[nic("net0")],
                &[],
                &[assigned("net0", "bc:24:11", v4[0].addresses.clone())],
            ),
            "network device net0 has MAC address \"bc:24:11\", which is not of the form aa:bb:cc:dd:ee:ff",
        ),
        (
            "unknown nic",
            render_err(
                &[nic("net0")],
                &[],
                &[v4[0].clone(), assigned("net3", MAC1, vec![])],
            ),
            "addresses were assigned to network device net3, which is not in \
             spec.network.networkDevices (devices: net0)",
        ),
        (
            "duplicate nic",
            render_err(&[nic("net0")], &[], &[v4[0].clone(), v4[0].clone()]),
            "network device net0 was given two address entries; pass one NicAddresses per NIC",
        ),
        (
            "nic in two vrfs",
            render_err(
                &[nic("net0")],
                &[
                    VrfDevice {
                        name: "vrf-a".into(),
                        table: 10,
                        interfaces: vec!["net0".into()],
                        ..Default::default()
                    },
                    VrfDevice {
                        name: "vrf-b".into(),
                        table: 11,
                        interfaces: vec!["net0".into()],
                        ..Default::default()
                    },
                ],
                &v4,
            ),
            "network device net0 is an interface of VRF vrf-a and of VRF vrf-b; a NIC can be in one VRF only",
        ),
        (
            "prefix",
            render_err(
                &[nic("net0")],
                &[],
                &[assigned(
                    "net0",
                    MAC0,
                    vec![addr("10.0.0.5", 33, Some("10.0.0.1"))],
                )],
            ),
            "network device net0 has address 10.0.0.5/33: the prefix is longer than 32; fix the IP pool's prefix",
        ),
        (
            "gateway family",
            render_err(
                &[nic("net0")],
                &[],
                &[assigned(
                    "net0",
                    MAC0,
                    vec![addr("10.0.0.5", 24, Some("2001:db8::1"))],
                )],
            ),
            "network device net0 has address 10.0.0.5 with gateway 2001:db8::1 of the other IP \
             family; fix the IP pool's gateway",
        ),
        (
            "route without to",
            render_err(
                &[with_route(RouteSpec {
                    via: Some("10.0.0.9".into()),
                    ..Default::default()
                })],
                &[],
                &v4,
            ),
            "network device net0 route 1 has no 'to'; set it to a CIDR, an IP address, or default",
        ),
        (
            "bad to",
            render_err(&[with_route(route("10.0.0.0/40", None))], &[], &v4),
            "network device net0 route 1 has to \"10.0.0.0/40\", which is not a CIDR, an IP \
             address, default or all",
        ),
        (
            "bad via",
            render_err(
                &[with_route(route("10.1.0.0/16", Some("gateway")))],
                &[],
                &v4,
            ),
            "network device net0 route 1 has via \"gateway\", which is not an IP address",
        ),
        (
            "route family",
            render_err(
                &[with_route(route("10.1.0.0/16", Some("2001:db8::1")))],
                &[],
                &v4,
            ),
            "network device net0 route 1 mixes IPv4 and IPv6 (10.1.0.0/16 and 2001:db8::1); use one family",
        ),
        (
            "negative metric",
            render_err(
                &[with_route(RouteSpec {
                    metric: Some(-1),
                    ..route("10.1.0.0/16", None)
                })],
                &[],
                &v4,
            ),
            "network device net0 route 1 has metric -1, which must be between 0 and 4294967295",
        ),
        (
            "conflicting with the pool gateway",
            render_err(
                &[with_route(route("default", Some("10.0.0.254")))],
                &[],
                &v4,
            ),
            "the default route via gateway 10.0.0.1 of net0 address 10.0.0.5 and network device \
             net0 route 1 both route 0.0.0.0/0 in table 254 with metric 0; give one of them \
             another metric (for a pool gateway: the pool's metric) or another table",
        ),
        (
            "rule without to/from",
            render_err(
                &[with_rule(RoutingPolicySpec {
                    table: Some(100),
                    ..Default::default()
                })],
                &[],
                &v4,
            ),
            "network device net0 routing policy rule 1 has neither 'to' nor 'from'; set at least one",
        ),
        (
            "rule without table",
            render_err(
                &[with_rule(RoutingPolicySpec {
                    from: Some("10.0.0.0/24".into()),
                    ..Default::default()
                })],
                &[],
                &v4,
            ),
            "network device net0 routing policy rule 1 has no 'table'; a rule outside a VRF must \
             name the routing table to look up",
        ),
        (
            "rule family",
            render_err(
                &[with_rule(RoutingPolicySpec {
                    to: Some("10.0.0.0/24".into()),
                    from: Some("2001:db8::/64".into()),
                    table: Some(100),
                    ..Default::default()
                })],
                &[],
                &v4,
            ),
            "network device net0 routing policy rule 1 mixes IPv4 and IPv6 (10.0.0.0/24 and \
             2001:db8::/64); use one family",
        ),
        (
            "vrf interface",
            render_err(
                &[nic("net0")],
                &[VrfDevice {
                    name: "vrf-a".into(),
                    table: 10,
                    interfaces: vec!["net7".into()],
                    ..Default::default()
                }],
                &v4,
            ),
            "VRF vrf-a lists interface \"net7\", which is not a network device of this machine (devices: net0)",
        ),
        (
            "dns",
            render_err(
                &[ResolvedNic {
                    dns_servers: vec!["dns.example.com".into()],
                    ..nic("net0")
                }],
                &[],
                &v4,
            ),
            "network device net0 has DNS server \"dns.example.com\", which is not an IP address; fix dnsServers",
        ),
        (
            "no default route",
            render_err(
                &[nic("net0")],
                &[],
                &[assigned("net0", MAC0, vec![addr("10.0.0.5", 24, None)])],
            ),
            "no default route: no assigned address has a gateway and no route goes to default \
             (0.0.0.0/0 or ::/0); give an IP pool a gateway or add a route with to: default",
        ),
    ];
    for (what, got, want) in cases {
        assert_eq!(got, want, "{what}");
    }
}

#[test]
fn vrf_routes_collide_within_the_vrf_table() {
    let vrf = VrfDevice {
        name: "vrf-a".into(),
        table: 10,
        interfaces: vec!["net0".into()],
        routes: Some(vec![
            route("10.9.0.0/16", Some("10.0.0.7")),
            route("10.9.0.0/16", Some("10.0.0.8")),
        ]),
        ..Default::default()
    };
    assert_eq!(
        render_err(&[nic("net0")], &[vrf], &v4_net0()),
        "VRF vrf-a route 1 and VRF vrf-a route 2 both route 10.9.0.0/16 in table 10 with metric \
         0; give one of them another metric (for a pool gateway: the pool's metric) or another table"
    );
}

#[test]
fn a_route_naming_table_254_collides_with_one_naming_none() {
    let mut n = nic("net0");
    n.routes = vec![
        route("10.9.0.0/16", Some("10.0.0.7")),
        RouteSpec {
            table: Some(254),
            ..route("10.9.0.0/16", Some("10.0.0.8"))
        },
    ];
    let err = render_network_config(&[n], &[], &v4_net0()).expect_err("conflict");
    assert!(
        matches!(
            err,
            NetworkConfigError::ConflictingRoutes {
                table: 254,
                metric: 0,
                ..
            }
        ),
        "{err}"
    );
}

// ------------------------------------------------------------------------------ all files

/// A resolved placement: net0 on the cluster's default IPv4 pool and DNS; net1 with its own DNS,
/// a link MTU, a route and a VRF.
fn placement() -> Placement {
    use crate::api::{
        IpConfigSpec, NetworkDevice, NetworkSpec, ProxmoxCluster, ProxmoxClusterSpec,
        ProxmoxMachine, ProxmoxMachineSpec,
    };
    use crate::capi::{Machine, MachineSpec};
    let cluster = ProxmoxCluster::new(
        "c1",
        ProxmoxClusterSpec {
            ipv4_config: Some(IpConfigSpec {
                addresses: vec!["10.0.0.10-10.0.0.90".to_owned()],
                prefix: 24,
                gateway: "10.0.0.1".to_owned(),
                metric: None,
            }),
            dns_servers: vec!["10.0.0.2".to_owned()],
            ..Default::default()
        },
    );
    let machine = ProxmoxMachine::new(
        "m1",
        ProxmoxMachineSpec {
            source_node: Some("pve1".to_owned()),
            template_id: Some(100),
            network: NetworkSpec {
                zone: None,
                network_devices: vec![
                    NetworkDevice {
                        name: "net0".to_owned(),
                        bridge: Some("vmbr0".to_owned()),
                        default_ipv4: Some(true),
                        ..Default::default()
                    },
                    NetworkDevice {
                        name: "net1".to_owned(),
                        bridge: Some("vmbr1".to_owned()),
                        dns_servers: Some(vec!["192.168.1.2".to_owned()]),
                        routes: Some(vec![route("192.168.100.0/24", Some("192.168.1.254"))]),
                        link_mtu: Some(9000),
                        ..Default::default()
                    },
                ],
                vrfs: vec![VrfDevice {
                    name: "vrf-storage".to_owned(),
                    table: 500,
                    interfaces: vec!["net1".to_owned()],
                    ..Default::default()
                }],
            },
            ..Default::default()
        },
    );
    let capi = Machine::new(
        "m1",
        MachineSpec {
            cluster_name: "c1".to_owned(),
            ..Default::default()
        },
    );
    Placement::resolve(&cluster, &machine, &capi).expect("placement resolves")
}

#[test]
fn render_nocloud_takes_nic_settings_from_the_placement() {
    let p = placement();
    let a = vec![
        assigned(
            "net0",
            MAC0,
            vec![AssignedAddress {
                default_route: true,
                ..addr("10.0.0.10", 24, Some("10.0.0.1"))
            }],
        ),
        assigned("net1", MAC1, vec![addr("192.168.1.10", 24, None)]),
    ];
    let m = MetaData {
        hostname: "m1".to_owned(),
        provider_id: Some(provider_id("9b9f5a46-0c1d-4f7e-8b1a-1c2d3e4f5a6b")),
        ..meta()
    };
    let bootstrap = BootstrapData {
        value: b"#cloud-config\n".to_vec(),
        format: BootstrapFormat::CloudConfig,
    };
    let files = render_nocloud(&p, &m, &a, &bootstrap).expect("renders");
    assert_eq!(files.user_data, b"#cloud-config\n");
    assert_eq!(
        yaml(std::str::from_utf8(&files.meta_data).expect("UTF-8")),
        yaml(
            "instance-id: 9b9f5a46-0c1d-4f7e-8b1a-1c2d3e4f5a6b
local-hostname: m1
hostname: m1
provider-id: proxmox://9b9f5a46-0c1d-4f7e-8b1a-1c2d3e4f5a6b
"
        )
    );
    assert_eq!(
        yaml(std::str::from_utf8(&files.network_config).expect("UTF-8")),
        yaml(
            "network:
  version: 2
  renderer: networkd
  ethernets:
    eth0:
      match: {macaddress: 'bc:24:11:00:00:01'}
      dhcp4: false
      dhcp6: false
      addresses: [10.0.0.10/24]
      routes: [{to: 0.0.0.0/0, via: 10.0.0.1}]
      nameservers: {addresses: [10.0.0.2]}
    eth1:
      match: {macaddress: 'bc:24:11:00:00:02'}
      dhcp4: false
      dhcp6: false
      addresses: [192.168.1.10/24]
      routes: [{to: 192.168.100.0/24, via: 192.168.1.254}]
      nameservers: {addresses: [192.168.1.2]}
      mtu: 9000
  vrfs:
    vrf-storage:
      table: 500
      interfaces: [eth1]
"
        )
    );
    assert_eq!(files.vendor_data, None);
}

#[test]
fn network_errors_surface_through_render_nocloud() {
    let bootstrap = BootstrapData {
        value: Vec::new(),
        format: BootstrapFormat::CloudConfig,
    };
    let err = render_nocloud(&placement(), &meta(), &v4_net0(), &bootstrap)
        .expect_err("net1 has no address");
    assert_eq!(
        err,
        CloudInitError::Network(NetworkConfigError::MissingAddresses {
            nic: "net1".to_owned()
        })
    );
}

#[test]
fn an_unset_pool_metric_and_metric_0_are_the_same_default_route() {
    let a = vec![
        assigned("net0", MAC0, vec![addr("10.0.0.5", 24, Some("10.0.0.1"))]),
        assigned(
            "net1",
            MAC1,
            vec![AssignedAddress {
                metric: Some(0),
                ..addr("192.168.1.5", 24, Some("192.168.1.1"))
            }],
        ),
    ];
    let doc = render(&[nic("net0"), nic("net1")], &[], &a);
    assert_eq!(
        doc["network"]["ethernets"]["eth0"]["routes"],
        yaml("[{to: 0.0.0.0/0, via: 10.0.0.1}]")
    );
    assert!(doc["network"]["ethernets"]["eth1"].get("routes").is_none());
}

#[test]
fn errors_tell_the_reconciler_whether_to_wait_or_report() {
    let waiting = CloudInitError::Network(NetworkConfigError::MissingAddresses {
        nic: "net1".to_owned(),
    });
    assert!(waiting.is_retryable());
    assert_eq!(waiting.reason(), "WaitingForNetwork");
    assert!(CloudInitError::MissingInstanceId.is_retryable());
    let user = CloudInitError::Network(NetworkConfigError::MissingDefaultRoute);
    assert!(!user.is_retryable());
    assert_eq!(user.reason(), "InvalidNetworkConfig");
    let ignition = CloudInitError::Ignition(IgnitionError::MissingVersion);
    assert!(!ignition.is_retryable());
    assert_eq!(ignition.reason(), "BootstrapDataInvalid");
}

#[test]
fn the_seed_image_keeps_the_go_provider_file_name() {
    assert_eq!(seed_iso_name(1234), "user-data-1234.iso");
}

#[test]
fn debug_output_never_shows_bootstrap_secrets() {
    const TOKEN: &str = "abcdef.0123456789abcdef";
    let user_data = format!("#cloud-config\nruncmd: [kubeadm join --token {TOKEN}]\n").into_bytes();
    let data = BootstrapData {
        value: user_data.clone(),
        format: BootstrapFormat::CloudConfig,
    };
    let files = NoCloudFiles {
        user_data,
        meta_data: b"instance-id: 4f3c\n".to_vec(),
        network_config: b"version: 2\n".to_vec(),
        vendor_data: Some(format!("token: {TOKEN}").into_bytes()),
    };
    for shown in [
        format!("{data:?}"),
        format!("{files:?}"),
        format!("{files:#?}"),
    ] {
        assert!(!shown.contains(TOKEN), "{shown}");
        assert!(shown.contains("redacted"), "{shown}");
    }
    assert!(format!("{files:?}").contains("instance-id: 4f3c"));
}

// ------------------------------------------------------------------------------ Ignition

fn networkd(nics: &[ResolvedNic], vrfs: &[VrfDevice], a: &[NicAddresses]) -> Vec<(String, String)> {
    let plan = super::network::plan_network(nics, vrfs, a).expect("plans");
    super::networkd::render_units(&plan)
        .into_iter()
        .map(|u| (u.name, u.contents))
        .collect()
}

fn unit(name: &str, contents: &str) -> (String, String) {
    (name.to_owned(), contents.to_owned())
}

#[test]
fn networkd_units_say_what_the_netplan_document_says() {
    let mut n0 = nic("net0");
    n0.dns_servers = vec!["10.0.0.2".to_owned(), "2001:db8::53".to_owned()];
    n0.routes = vec![RouteSpec {
        metric: Some(200),
        table: Some(100),
        ..route("172.16.0.0/12", Some("10.0.0.254"))
    }];
    n0.routing_policy = vec![RoutingPolicySpec {
        to: Some("172.16.0.0/12".to_owned()),
        priority: Some(10),
        table: Some(100),
        ..Default::default()
    }];
    let mut n1 = nic("net1");
    n1.link_mtu = Some(9000);
    let vrfs = vec![VrfDevice {
        name: "vrf-storage".to_owned(),
        table: 500,
        interfaces: vec!["net1".to_owned()],
        routes: Some(vec![route("default", Some("192.168.1.1"))]),
        routing_policy: Some(vec![RoutingPolicySpec {
            from: Some("192.168.1.0/24".to_owned()),
            ..Default::default()
        }]),
    }];
    let a = vec![
        assigned(
            "net0",
            MAC0,
            vec![
                AssignedAddress {
                    metric: Some(100),
                    ..addr("10.0.0.5", 24, Some("10.0.0.1"))
                },
                addr("2001:db8::5", 64, Some("2001:db8::1")),
            ],
        ),
        assigned("net1", MAC1, vec![addr("192.168.1.5", 24, None)]),
    ];
    assert_eq!(
        networkd(&[n0, n1], &vrfs, &a),
        [
            unit(
                "00-eth0.network",
                "[Match]\nMACAddress=bc:24:11:00:00:01\n\n\
                 [Network]\nDNS=10.0.0.2\nDNS=2001:db8::53\n\n\
                 [Address]\nAddress=10.0.0.5/24\n\n\
                 [Address]\nAddress=2001:db8::5/64\n\n\
                 [Route]\nDestination=0.0.0.0/0\nGateway=10.0.0.1\nMetric=100\n\n\
                 [Route]\nDestination=::/0\nGateway=2001:db8::1\n\n\
                 [Route]\nDestination=172.16.0.0/12\nGateway=10.0.0.254\nMetric=200\nTable=100\n\n\
                 [RoutingPolicyRule]\nTo=172.16.0.0/12\nPriority=10\nTable=100\n"
            ),
            unit(
                "01-eth1.network",
                "[Match]\nMACAddress=bc:24:11:00:00:02\n\n\
                 [Link]\nMTUBytes=9000\n\n\
                 [Network]\nVRF=vrf-storage\n\n\
                 [Address]\nAddress=192.168.1.5/24\n"
            ),
            unit(
                "00-vrf0.netdev",
                "[NetDev]\nName=vrf-storage\nKind=vrf\n\n[VRF]\nTable=500\n"
            ),
            // Named after the NICs, as the Go provider numbers it; the VRF's table by default.
            unit(
                "02-vrf2.network",
                "[Match]\nName=vrf-storage\n\n\
                 [Route]\nDestination=0.0.0.0/0\nGateway=192.168.1.1\nTable=500\n\n\
                 [RoutingPolicyRule]\nFrom=192.168.1.0/24\nTable=500\n"
            ),
        ]
    );
}

#[test]
fn networkd_units_are_checked_like_the_netplan_document() {
    let err = super::network::plan_network(
        &[nic("net0")],
        &[],
        &[assigned("net0", MAC0, vec![addr("10.0.0.5", 24, None)])],
    )
    .err()
    .map(|e| e.to_string());
    assert_eq!(
        err,
        Some(NetworkConfigError::MissingDefaultRoute.to_string())
    );
}

#[test]
fn a_vrf_name_that_is_no_interface_name_is_never_written() {
    for name in [
        "vrf-a\n[Network]\nDNS=203.0.113.9",
        "vrf*",
        "vrf a",
        "../vrf",
    ] {
        let vrf = VrfDevice {
            name: name.into(),
            table: 10,
            interfaces: vec!["net0".into()],
            ..Default::default()
        };
        let error =
            super::network::plan_network(&[nic("net0")], std::slice::from_ref(&vrf), &v4_net0())
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
        assert!(
            error.starts_with(&format!(
                "spec.network.vrfs: {name:?} is not a valid interface name"
            )),
            "{name:?}: {error}"
        );
        assert!(render_network_config(&[nic("net0")], &[vrf], &v4_net0()).is_err());
    }
}

fn ignition_bootstrap(value: &str) -> BootstrapData {
    BootstrapData {
        value: value.as_bytes().to_vec(),
        format: BootstrapFormat::Ignition,
    }
}

fn placement_addresses() -> Vec<NicAddresses> {
    vec![
        assigned(
            "net0",
            MAC0,
            vec![AssignedAddress {
                default_route: true,
                ..addr("10.0.0.10", 24, Some("10.0.0.1"))
            }],
        ),
        assigned("net1", MAC1, vec![addr("192.168.1.10", 24, None)]),
    ]
}

#[test]
fn an_ignition_seed_carries_the_merged_config_the_meta_data_and_an_empty_network_config() {
    let m = MetaData {
        hostname: "m1".to_owned(),
        ..meta()
    };
    let bootstrap = ignition_bootstrap(include_str!(
        "../../tests/data/ignition/kubeadm-flatcar-v2.3.json"
    ));
    let files =
        render_nocloud(&placement(), &m, &placement_addresses(), &bootstrap).expect("renders");
    assert_eq!(
        files.meta_data,
        render_meta_data(&m).expect("meta").into_bytes()
    );
    assert_eq!(files.network_config, b"version: 1\nconfig: []\n");
    assert_eq!(files.vendor_data, None);
    let doc: serde_json::Value = serde_json::from_slice(&files.user_data).expect("JSON");
    assert_eq!(doc["ignition"]["version"], "2.3.0");
    let names: Vec<&str> = doc["networkd"]["units"]
        .as_array()
        .expect("units")
        .iter()
        .filter_map(|u| u["name"].as_str())
        .collect();
    assert_eq!(
        names,
        [
            "00-eth0.network",
            "01-eth1.network",
            "00-vrf0.netdev",
            "02-vrf2.network"
        ]
    );
    assert_eq!(
        doc["networkd"]["units"][0]["contents"],
        "[Match]\nMACAddress=bc:24:11:00:00:01\n\n[Network]\nDNS=10.0.0.2\n\n\
         [Address]\nAddress=10.0.0.10/24\n\n[Route]\nDestination=0.0.0.0/0\nGateway=10.0.0.1\n"
    );
    let env = doc["storage"]["files"]
        .as_array()
        .expect("files")
        .iter()
        .find(|f| f["path"] == "/etc/proxmox-env")
        .expect("/etc/proxmox-env")["contents"]["source"]
        .clone();
    assert_eq!(
        env,
        "data:,COREOS_CUSTOM_HOSTNAME=m1%0ACOREOS_CUSTOM_INSTANCE_ID=\
         9b9f5a46-0c1d-4f7e-8b1a-1c2d3e4f5a6b%0ACOREOS_CUSTOM_PROVIDER_ID=\
         proxmox://9b9f5a46-0c1d-4f7e-8b1a-1c2d3e4f5a6b%0A\
         COREOS_CUSTOM_PRIVATE_IPV4=10.0.0.10/24%0A"
    );
    // The same config without a secret in `Debug`.
    assert!(!format!("{files:?}").contains("abcdef"));
}

#[test]
fn malformed_ignition_is_reported_before_anything_else() {
    // No addresses at all: the Ignition error still comes first.
    let err = render_nocloud(
        &placement(),
        &meta(),
        &[],
        &ignition_bootstrap("#cloud-config\n"),
    )
    .expect_err("refused");
    assert!(
        matches!(err, CloudInitError::Ignition(IgnitionError::NotJson(_))),
        "{err:?}"
    );
    assert_eq!(err.reason(), "BootstrapDataInvalid");
    assert!(!err.is_retryable());
    // Valid Ignition waits for the network like cloud-config does.
    let err = render_nocloud(
        &placement(),
        &meta(),
        &v4_net0(),
        &ignition_bootstrap(r#"{"ignition": {"version": "3.4.0"}}"#),
    )
    .expect_err("net1 has no address");
    assert!(err.is_retryable(), "{err:?}");
}

#[test]
fn a_dhcp_device_asks_for_a_lease_and_gives_the_default_route() {
    let mut n0 = nic("net0");
    n0.dhcp4 = true;
    let mut n1 = nic("net1");
    n1.dhcp6 = true;
    let mut n2 = nic("net2");
    n2.dhcp4 = true;
    n2.dhcp6 = true;
    let a = [
        assigned("net0", MAC0, vec![]),
        assigned("net1", "bc:24:11:00:00:02", vec![]),
        assigned("net2", "bc:24:11:00:00:03", vec![]),
    ];
    let nics = [n0, n1, n2];
    let doc = render(&nics, &[], &a);
    let eth = &doc["network"]["ethernets"];
    assert_eq!(eth["eth0"]["dhcp4"], Value::Bool(true));
    assert_eq!(eth["eth0"]["dhcp6"], Value::Bool(false));
    assert_eq!(eth["eth1"]["dhcp6"], Value::Bool(true));
    assert!(
        eth["eth0"]["routes"].is_null(),
        "the lease brings the route: {doc:?}"
    );
    let units = networkd(&nics, &[], &a);
    let dhcp: Vec<&str> = units
        .iter()
        .map(|(_, text)| text.lines().find(|l| l.starts_with("DHCP=")).unwrap_or(""))
        .collect();
    assert_eq!(dhcp, ["DHCP=ipv4", "DHCP=ipv6", "DHCP=yes"]);
    // Without DHCP, a NIC without addresses is still refused, naming the way out.
    let error = render_err(&[nic("net0")], &[], &[assigned("net0", MAC0, vec![])]);
    assert!(error.contains("or set dhcp4/dhcp6"), "{error}");
}
