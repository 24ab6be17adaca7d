//! Tests of the fleet benchmark's Go provider fleet (`benches/fleet/go_fleet.rs`); the bench
//! target runs without a test harness, so its pure parts are tested from here.

#[allow(dead_code)] // the bench uses all of it; these tests only part
#[path = "../../benches/fleet/go_fleet.rs"]
mod go_fleet;

use std::path::Path;

use go_fleet::*;
use serde_json::json;

fn node(name: &str, zone: &str, vmid: u32) -> GoNode {
    GoNode {
        name: name.into(),
        zone: zone.into(),
        template_vmid: vmid,
    }
}

#[test]
fn workers_fill_the_emptiest_node_first_around_the_control_plane() {
    // 60 machines on 12 nodes: 5 on each, the first holding 3 control-plane machines.
    assert_eq!(
        workers_per_node(57, 12, 3),
        [2, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5]
    );
    // 1000 on 12: 83 or 84 each, the first nodes taking the remainder.
    let counts = workers_per_node(997, 12, 3);
    assert_eq!(counts.iter().sum::<u32>(), 997);
    assert_eq!(counts[0] + 3, 84);
    assert_eq!(&counts[1..4], [84, 84, 84]);
    assert!(counts[4..].iter().all(|c| *c == 83), "{counts:?}");
    // Fewer workers than nodes: the first node, which holds the control plane, gets none.
    assert_eq!(workers_per_node(2, 4, 3), [0, 1, 1, 0]);
    assert_eq!(workers_per_node(5, 0, 3), Vec::<u32>::new());
}

#[test]
fn a_machine_is_pinned_to_its_node_and_template_with_its_zone_pool() {
    let spec = machine_spec(&node("pve-b3", "zone-b", 9006));
    assert_eq!(spec["sourceNode"], "pve-b3");
    assert_eq!(spec["templateID"], 9006);
    assert_eq!(spec["allowedNodes"], json!(["pve-b3"]));
    assert_eq!(spec["network"]["zone"], "zone-b");
    assert_eq!(spec["full"], true);
    let device = &spec["network"]["networkDevices"][0];
    assert_eq!(device["name"], "net0");
    assert_eq!(device["defaultIPv4"], true);
    // The machines differ from the template copies, so the Go provider configures them.
    assert_ne!(spec["memoryMiB"], json!(TEMPLATE_MEMORY_MIB));
    assert_ne!(spec["numCores"], json!(TEMPLATE_CORES));
}

#[test]
fn the_cluster_allows_every_node_and_has_a_pool_per_zone() {
    let nodes = [
        node("pve-a1", "zone-a", 9000),
        node("pve-b1", "zone-b", 9001),
    ];
    let zones = [GoZone {
        name: "zone-a".into(),
        addresses: "10.1.1.1-10.1.15.250".into(),
        prefix: 16,
        gateway: "10.1.0.1".into(),
        dns: "10.1.0.2".into(),
    }];
    let spec = cluster_spec(&nodes, &zones);
    assert_eq!(spec["allowedNodes"], json!(["pve-a1", "pve-b1"]));
    assert_eq!(
        spec["ipv4Config"]["addresses"],
        json!(["10.0.1.1-10.0.15.250"])
    );
    assert_eq!(
        spec["zoneConfig"],
        json!([{"zone": "zone-a", "dnsServers": ["10.1.0.2"],
                "ipv4Config": {"addresses": ["10.1.1.1-10.1.15.250"], "prefix": 16,
                               "gateway": "10.1.0.1", "metric": 100}}])
    );
    assert_eq!(zone_of_node(&nodes, "pve-b1"), Some("zone-b"));
    assert_eq!(zone_of_node(&nodes, "pve-z9"), None);
}

#[test]
fn klog_levels_come_from_the_line_header_only() {
    assert_eq!(
        klog_level("E1206 04:50:00.123456   12345 controller.go:474] \"Reconciler error\""),
        Some('E')
    );
    assert_eq!(klog_level("W0101 00:00:00.000000 1 x.go:1] w"), Some('W'));
    assert_eq!(
        klog_level("I1206 04:50:00.1 1 main.go:98] \"starting capmox\""),
        Some('I')
    );
    // A continuation line or free text has no level.
    assert_eq!(klog_level("\tgoroutine 1 [running]:"), None);
    assert_eq!(klog_level("Error: unknown flag"), None);
    assert_eq!(klog_level("E12 short"), None);
    assert_eq!(klog_level(""), None);
}

#[test]
fn a_go_client_is_named_by_its_executable() {
    assert_eq!(
        go_client_name(Path::new("/opt/go/bin/capmox-go-manager")),
        "capmox-go-manager"
    );
    assert_eq!(go_client_name(Path::new("manager")), "manager");
}
