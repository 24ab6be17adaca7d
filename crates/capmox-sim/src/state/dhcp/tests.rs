use super::*;
use crate::iso::build_iso;
use crate::topology::{SimOptions, Topology};
use serde_json::{Value, json};
use tokio::time::Duration;

/// vmbr0 has a DHCP service with two IPv4 addresses and an IPv6 pool; vmbr1 has none.
/// Guests 101-103 have one NIC on vmbr0, 104 one on vmbr1, 105 one on each.
const TOPOLOGY: &str = "
nodes: [{name: pve1}, {name: pve2}]
storages:
  - {name: ceph, type: rbd, shared: true}
  - {name: local, type: dir, content: [iso]}
dhcp:
  - {bridge: vmbr0, range4: 10.0.9.100-10.0.9.101, prefix4: 24, gateway4: 10.0.9.1, range6: 'fd00::100-fd00::1ff'}
guests:
  - {vmid: 101, name: a, node: pve1, storage: ceph, config: {agent: '1', net0: 'virtio=BC:24:11:00:01:01,bridge=vmbr0'}}
  - {vmid: 102, name: b, node: pve1, storage: ceph, config: {agent: '1', net0: 'virtio=BC:24:11:00:01:02,bridge=vmbr0'}}
  - {vmid: 103, name: c, node: pve1, storage: ceph, config: {agent: '1', net0: 'virtio=BC:24:11:00:01:03,bridge=vmbr0'}}
  - {vmid: 104, name: d, node: pve1, storage: ceph, config: {agent: '1', net0: 'virtio=BC:24:11:00:01:04,bridge=vmbr1'}}
  - {vmid: 105, name: e, node: pve1, storage: ceph, config: {agent: '1', net0: 'virtio=BC:24:11:00:01:05,bridge=vmbr1', net1: 'virtio=BC:24:11:00:01:15,bridge=vmbr0'}}
";

fn cluster() -> (Cluster, Instant) {
    let opts = SimOptions {
        boot_delay: Duration::from_secs(5),
        ..SimOptions::default()
    };
    let topology = Topology::from_yaml(TOPOLOGY, "t").expect("topology");
    (
        Cluster::new(&topology, opts, Box::new(|_| false)),
        Instant::now(),
    )
}

fn p(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// netplan asking DHCP on the NIC with MAC `mac` for the given families.
fn netplan(mac: &str, dhcp4: bool, dhcp6: bool) -> String {
    format!(
        "network:\n  version: 2\n  ethernets:\n    eth0:\n      match:\n        macaddress: {mac}\n      dhcp4: {dhcp4}\n      dhcp6: {dhcp6}\n"
    )
}

/// Attaches a NoCloud seed with `user_data` and `network_config` to VM `vmid`.
fn attach_seed(
    c: &mut Cluster,
    now: &mut Instant,
    vmid: u32,
    user_data: &str,
    network_config: &str,
) {
    let iso = build_iso(
        "cidata",
        &[
            ("user-data", user_data.as_bytes()),
            ("meta-data", b"instance-id: x\n"),
            ("network-config", network_config.as_bytes()),
        ],
    );
    let name = format!("seed-{vmid}.iso");
    c.upload(*now, "pve1", "local", "iso", &name, iso)
        .expect("upload");
    *now += c.options().task_duration;
    c.advance(*now);
    let drive = format!("local:iso/{name},media=cdrom");
    c.update_config(*now, "pve1", vmid, &p(&[("ide2", &drive)]), false)
        .expect("attached");
}

/// Runs `action` and waits until the task ended; returns its exit status.
fn power(c: &mut Cluster, now: &mut Instant, vmid: u32, action: &str) -> String {
    let upid = match action {
        "reboot" => c.reboot(*now, "pve1", vmid, &BTreeMap::new()),
        _ => c.power(*now, "pve1", vmid, action),
    }
    .expect("a task");
    *now += c.options().task_duration;
    c.advance(*now);
    let status = c.task_status("pve1", upid.as_str()).expect("task");
    status["exitstatus"].as_str().expect("ended").to_owned()
}

/// Waits out the boot.
fn booted(c: &mut Cluster, now: &mut Instant) {
    *now += c.options().boot_delay;
    c.advance(*now);
}

/// The addresses the agent reports for `ifname`, as `address/prefix`.
fn reported(c: &Cluster, now: Instant, vmid: u32, ifname: &str) -> Vec<String> {
    let answer = c.agent_interfaces(now, "pve1", vmid).expect("agent");
    let nic = answer["result"]
        .as_array()
        .and_then(|nics| nics.iter().find(|n| n["name"] == ifname))
        .cloned()
        .unwrap_or(Value::Null);
    nic["ip-addresses"]
        .as_array()
        .map(|addrs| {
            addrs
                .iter()
                .map(|a| format!("{}/{}", a["ip-address"].as_str().unwrap_or(""), a["prefix"]))
                .collect()
        })
        .unwrap_or_default()
}

fn lease(vmid: u32, mac: &str, ipv4: Option<&str>, ipv6: Option<&str>) -> DhcpLease {
    DhcpLease {
        bridge: "vmbr0".into(),
        mac: mac.into(),
        vmid,
        ipv4: ipv4.map(str::to_owned),
        ipv6: ipv6.map(str::to_owned),
    }
}

#[tokio::test(start_paused = true)]
async fn a_lease_comes_after_boot_stays_over_reboots_and_goes_with_the_vm() {
    let (mut c, mut now) = cluster();
    attach_seed(
        &mut c,
        &mut now,
        101,
        "#cloud-config\n",
        &netplan("BC:24:11:00:01:01", true, true),
    );
    assert_eq!(power(&mut c, &mut now, 101, "start"), "OK");
    assert!(c.dhcp_leases().is_empty(), "not before the boot is done");
    assert!(
        c.agent_interfaces(now, "pve1", 101).is_err(),
        "agent not up yet"
    );
    booted(&mut c, &mut now);
    let first = lease(
        101,
        "bc:24:11:00:01:01",
        Some("10.0.9.100/24"),
        Some("fd00::100/64"),
    );
    assert_eq!(c.dhcp_leases(), std::slice::from_ref(&first));
    assert_eq!(
        reported(&c, now, 101, "eth0"),
        ["10.0.9.100/24", "fd00::100/64", "fe80::1000/64"]
    );
    // another guest gets the next addresses; after a reboot and a stop/start the first
    // keeps its own
    attach_seed(
        &mut c,
        &mut now,
        102,
        "#cloud-config\n",
        &netplan("bc:24:11:00:01:02", true, false),
    );
    assert_eq!(power(&mut c, &mut now, 102, "start"), "OK");
    booted(&mut c, &mut now);
    assert_eq!(
        reported(&c, now, 102, "eth0"),
        ["10.0.9.101/24", "fe80::1000/64"]
    );
    assert_eq!(power(&mut c, &mut now, 101, "reboot"), "OK");
    booted(&mut c, &mut now);
    assert_eq!(power(&mut c, &mut now, 101, "stop"), "OK");
    assert_eq!(power(&mut c, &mut now, 101, "start"), "OK");
    booted(&mut c, &mut now);
    assert_eq!(
        c.dhcp_leases(),
        [
            first,
            lease(102, "bc:24:11:00:01:02", Some("10.0.9.101/24"), None)
        ]
    );
    assert_eq!(
        reported(&c, now, 101, "eth0"),
        ["10.0.9.100/24", "fd00::100/64", "fe80::1000/64"]
    );
    // destroying the VM frees its lease
    assert_eq!(power(&mut c, &mut now, 101, "stop"), "OK");
    let upid = c.delete_vm(now, "pve1", 101, false).expect("destroy");
    now += c.options().task_duration;
    c.advance(now);
    assert_eq!(
        c.task_status("pve1", upid.as_str()).expect("task")["exitstatus"],
        "OK"
    );
    assert_eq!(
        c.dhcp_leases(),
        [lease(102, "bc:24:11:00:01:02", Some("10.0.9.101/24"), None)]
    );
}

#[tokio::test(start_paused = true)]
async fn an_exhausted_pool_or_a_bridge_without_dhcp_gives_no_address() {
    let (mut c, mut now) = cluster();
    for vmid in [101, 102, 103] {
        let mac = format!("BC:24:11:00:01:0{}", vmid - 100);
        attach_seed(
            &mut c,
            &mut now,
            vmid,
            "#cloud-config\n",
            &netplan(&mac, true, false),
        );
        assert_eq!(power(&mut c, &mut now, vmid, "start"), "OK");
        booted(&mut c, &mut now);
    }
    assert_eq!(
        reported(&c, now, 103, "eth0"),
        ["fe80::1000/64"],
        "pool exhausted"
    );
    assert_eq!(c.dhcp_leases().len(), 2);
    // on vmbr1 nothing answers; 105's second NIC is on vmbr0 but the pool is empty
    attach_seed(
        &mut c,
        &mut now,
        104,
        "#cloud-config\n",
        &netplan("bc:24:11:00:01:04", true, true),
    );
    let both = "network:\n  version: 2\n  ethernets:\n    eth0: {dhcp4: true}\n    eth1: {dhcp4: true, dhcp6: true}\n";
    attach_seed(&mut c, &mut now, 105, "#cloud-config\n", both);
    for vmid in [104, 105] {
        assert_eq!(power(&mut c, &mut now, vmid, "start"), "OK");
    }
    booted(&mut c, &mut now);
    assert_eq!(reported(&c, now, 104, "eth0"), ["fe80::1000/64"]);
    assert_eq!(reported(&c, now, 105, "eth0"), ["fe80::1000/64"]);
    assert_eq!(
        reported(&c, now, 105, "eth1"),
        ["fd00::100/64", "fe80::1001/64"],
        "IPv6 still comes"
    );
    // a freed address goes to the next guest that boots and asks
    assert_eq!(power(&mut c, &mut now, 101, "stop"), "OK");
    let upid = c.delete_vm(now, "pve1", 101, false).expect("destroy");
    now += c.options().task_duration;
    c.advance(now);
    assert_eq!(
        c.task_status("pve1", upid.as_str()).expect("task")["exitstatus"],
        "OK"
    );
    assert_eq!(power(&mut c, &mut now, 103, "reboot"), "OK");
    booted(&mut c, &mut now);
    assert_eq!(
        reported(&c, now, 103, "eth0"),
        ["10.0.9.100/24", "fe80::1000/64"]
    );
}

#[tokio::test(start_paused = true)]
async fn flatcar_asks_by_networkd_and_seedless_guests_by_ipconfig() {
    let (mut c, mut now) = cluster();
    let ignition = json!({
        "ignition": {"version": "3.4.0"},
        "storage": {"files": [{"path": "/etc/systemd/network/00-eth0.network", "contents": {"source":
            "data:,%5BMatch%5D%0AMACAddress=bc:24:11:00:01:01%0A%5BNetwork%5D%0ADHCP=ipv4%0AAddress=192.168.5.5/24%0A"}}]}
    });
    attach_seed(&mut c, &mut now, 101, &ignition.to_string(), "version: 2\n");
    assert_eq!(power(&mut c, &mut now, 101, "start"), "OK");
    booted(&mut c, &mut now);
    assert_eq!(c.booted_os(101), Some(crate::guest::GuestOs::Flatcar));
    assert_eq!(
        reported(&c, now, 101, "eth0"),
        ["192.168.5.5/24", "10.0.9.100/24", "fe80::1000/64"],
        "static first, then the lease; no DHCPv6 asked for"
    );
    // without a seed, PVE's cloud-init drive asks as ipconfig0 says
    c.update_config(
        now,
        "pve1",
        102,
        &p(&[("ipconfig0", "ip=dhcp,ip6=dhcp")]),
        false,
    )
    .expect("ipconfig");
    assert_eq!(power(&mut c, &mut now, 102, "start"), "OK");
    booted(&mut c, &mut now);
    assert_eq!(
        reported(&c, now, 102, "eth0"),
        ["10.0.9.101/24", "fd00::100/64", "fe80::1000/64"]
    );
}

#[tokio::test(start_paused = true)]
async fn a_guest_that_stops_before_its_boot_is_done_asks_for_nothing() {
    let (mut c, mut now) = cluster();
    attach_seed(
        &mut c,
        &mut now,
        101,
        "#cloud-config\n",
        &netplan("bc:24:11:00:01:01", true, false),
    );
    assert_eq!(power(&mut c, &mut now, 101, "start"), "OK");
    assert_eq!(power(&mut c, &mut now, 101, "stop"), "OK");
    booted(&mut c, &mut now);
    assert!(c.dhcp_leases().is_empty());
}
