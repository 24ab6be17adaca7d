use super::*;
use crate::state::TaskRecord;
use crate::topology::{SimOptions, Topology};
use tokio::time::Instant;

/// pve1 has two GPUs (`01:00.0` with its audio function `01:00.1`, and `02:00.0`), pve2 one,
/// pve3 none. `gpu` maps both of pve1's GPUs and pve2's; `solo` only pve1's first. Guests
/// 101-104 on pve1 and 201 on pve2 are stopped, on shared storage, q35 machines.
const TOPOLOGY: &str = "
nodes:
  - name: pve1
    pci_devices:
      - {id: '0000:00:02.0', vendor: '8086', device: '3e92', class: '060400', iommugroup: 1}
      - {id: '0000:01:00.0', vendor: '10de', device: '2204', iommugroup: 14, subsystem_vendor: '1458', subsystem_device: '4032', vendor_name: NVIDIA Corporation}
      - {id: '0000:01:00.1', vendor: '10de', device: '1aef', class: '040300', iommugroup: 14}
      - {id: '0000:02:00.0', vendor: '10de', device: '2204', iommugroup: 15}
  - name: pve2
    pci_devices: [{id: '0000:41:00.0', vendor: '10de', device: '2204', iommugroup: 30}]
  - name: pve3
storages: [{name: ceph, type: rbd, shared: true}]
pci_mappings:
  - name: gpu
    description: RTX 3090
    map:
      - {node: pve1, path: '0000:01:00.0', id: '10de:2204', iommugroup: 14}
      - {node: pve1, path: '0000:02:00.0', id: '10de:2204', iommugroup: 15}
      - {node: pve2, path: '0000:41:00.0', id: '10de:2204', iommugroup: 30}
  - name: solo
    map: [{node: pve1, path: '0000:01:00.0', id: '10de:2204'}]
guests:
  - {vmid: 101, name: a, node: pve1, storage: ceph, config: {machine: q35}}
  - {vmid: 102, name: b, node: pve1, storage: ceph, config: {machine: q35}}
  - {vmid: 103, name: c, node: pve1, storage: ceph, config: {machine: q35}}
  - {vmid: 104, name: d, node: pve1, storage: ceph, config: {machine: 'type=pc-q35-9.2+pve1'}}
  - {vmid: 201, name: e, node: pve2, storage: ceph, config: {machine: q35}}
";

fn cluster(version: &str) -> (Cluster, Instant) {
    let opts = SimOptions {
        version: version.into(),
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

/// Sets `hostpciN` options as an administrator would (`root@pam`, which no token is).
fn admin_sets(c: &mut Cluster, vmid: u32, options: &[(&str, &str)]) {
    let vm = c.vms.get_mut(&vmid).expect("VM");
    for (k, v) in options {
        vm.config.insert((*k).to_owned(), (*v).to_owned());
    }
}

/// Sets options through the API (`PUT .../config`).
fn put(c: &mut Cluster, now: Instant, vmid: u32, options: &[(&str, &str)]) {
    let node = c.vm_node(vmid).expect("VM");
    c.update_config(now, &node, vmid, &p(options), false)
        .expect("written");
}

/// Runs `action` on VM `vmid` and returns the task's exit status once it ended.
fn power(c: &mut Cluster, now: &mut Instant, vmid: u32, action: &str) -> String {
    let node = c.vm_node(vmid).expect("VM");
    let upid = c.power(*now, &node, vmid, action).expect("a task");
    *now += c.options().task_duration;
    c.advance(*now);
    exit_status(c, &node, upid.as_str())
}

fn exit_status(c: &Cluster, node: &str, upid: &str) -> String {
    let status = c.task_status(node, upid).expect("task");
    status["exitstatus"].as_str().expect("ended").to_owned()
}

fn held(c: &Cluster, node: &str) -> Vec<(String, u32)> {
    c.pci_in_use(node)
}

fn pair(id: &str, vmid: u32) -> (String, u32) {
    (id.to_owned(), vmid)
}

#[tokio::test(start_paused = true)]
async fn a_start_takes_the_first_free_entry_and_stop_and_delete_free_it() {
    let (mut c, mut now) = cluster("9.1.4");
    for vmid in [101, 102, 103] {
        put(
            &mut c,
            now,
            vmid,
            &[("hostpci0", "mapping=gpu,pcie=1,x-vga=1")],
        );
    }
    assert_eq!(power(&mut c, &mut now, 101, "start"), "OK");
    assert_eq!(held(&c, "pve1"), [pair("0000:01:00.0", 101)]);
    assert_eq!(power(&mut c, &mut now, 102, "start"), "OK");
    assert_eq!(
        held(&c, "pve1"),
        [pair("0000:01:00.0", 101), pair("0000:02:00.0", 102)]
    );
    assert_eq!(
        power(&mut c, &mut now, 103, "start"),
        "could not find a free device for 'hostpci0'"
    );
    assert_eq!(c.vm_running(103), Some(false));
    assert_eq!(held(&c, "pve1").len(), 2, "a failed start holds nothing");
    assert_eq!(power(&mut c, &mut now, 101, "stop"), "OK");
    assert_eq!(held(&c, "pve1"), [pair("0000:02:00.0", 102)]);
    assert_eq!(power(&mut c, &mut now, 103, "start"), "OK");
    assert_eq!(
        held(&c, "pve1"),
        [pair("0000:01:00.0", 103), pair("0000:02:00.0", 102)]
    );
    // a shutdown frees too; the destroyed VM leaves nothing behind
    assert_eq!(power(&mut c, &mut now, 103, "shutdown"), "OK");
    let upid = c.delete_vm(now, "pve1", 103, false).expect("destroy");
    now += c.options().task_duration;
    c.advance(now);
    assert_eq!(exit_status(&c, "pve1", upid.as_str()), "OK");
    assert_eq!(held(&c, "pve1"), [pair("0000:02:00.0", 102)]);
    // pve2 has its own device for the same mapping
    put(&mut c, now, 201, &[("hostpci0", "mapping=gpu")]);
    assert_eq!(power(&mut c, &mut now, 201, "start"), "OK");
    assert_eq!(held(&c, "pve2"), [pair("0000:41:00.0", 201)]);
}

#[tokio::test(start_paused = true)]
async fn one_device_is_reserved_while_a_start_runs_and_in_use_once_it_runs() {
    let (mut c, mut now) = cluster("9.1.4");
    put(&mut c, now, 101, &[("hostpci0", "mapping=solo")]);
    put(&mut c, now, 102, &[("hostpci0", "mapping=solo")]);
    let first = c.power(now, "pve1", 101, "start").expect("a task");
    let second = c.power(now, "pve1", 102, "start").expect("a task");
    now += c.options().task_duration;
    c.advance(now);
    assert_eq!(exit_status(&c, "pve1", first.as_str()), "OK");
    assert_eq!(
        exit_status(&c, "pve1", second.as_str()),
        "PCI device '0000:01:00.0' is currently reserved for use by VMID '101'"
    );
    assert_eq!(
        power(&mut c, &mut now, 102, "start"),
        "PCI device '0000:01:00.0' already in use by VMID '101'"
    );
    // a mapping with several entries skips the one in use
    put(&mut c, now, 103, &[("hostpci0", "mapping=gpu")]);
    assert_eq!(power(&mut c, &mut now, 103, "start"), "OK");
    assert_eq!(
        held(&c, "pve1"),
        [pair("0000:01:00.0", 101), pair("0000:02:00.0", 103)]
    );
    // a raw device (set by root@pam) is reserved as it is
    admin_sets(&mut c, 104, &[("hostpci0", "02:00.0")]);
    assert_eq!(
        power(&mut c, &mut now, 104, "start"),
        "PCI device '0000:02:00.0' already in use by VMID '103'"
    );
    // an injected start failure frees what the start reserved
    c.set_task_failure(Box::new(|kind| kind == "qmstart"));
    assert_eq!(power(&mut c, &mut now, 101, "stop"), "OK");
    assert_eq!(power(&mut c, &mut now, 102, "start"), "injected failure");
    assert_eq!(held(&c, "pve1"), [pair("0000:02:00.0", 103)]);
}

#[tokio::test(start_paused = true)]
async fn starts_fail_with_pve_messages() {
    for (version, vmid, options, error) in [
        (
            "9.1.4",
            101,
            &[("hostpci0", "mapping=nope")][..],
            "PCI device mapping not found for 'nope'",
        ),
        (
            "9.1.4",
            201,
            &[("hostpci0", "mapping=solo")],
            "PCI device mapping not found for 'solo'",
        ),
        (
            "9.1.4",
            101,
            &[("hostpci0", "0000:07:00.0,pcie=1")],
            "no PCI device found for '0000:07:00.0'",
        ),
        (
            "9.1.4",
            101,
            &[("hostpci0", "host=01:00.0,mapping=gpu")],
            "Cannot set both 'host' and 'mapping'.",
        ),
        (
            "9.1.4",
            101,
            &[("hostpci0", "01:00.0"), ("hostpci3", "0000:01:00.0")],
            "device '0000:01:00.0' assigned more than once",
        ),
        (
            "9.1.4",
            101,
            &[("hostpci0", "mapping=gpu,pcie=1"), ("machine", "pc")],
            "q35 machine model is not enabled at /usr/share/perl5/PVE/QemuServer/PCI.pm line 514.",
        ),
        (
            "8.4.14",
            101,
            &[
                ("hostpci0", "mapping=gpu,pcie=on"),
                ("machine", "type=pc-i440fx-9.0"),
            ],
            "q35 machine model is not enabled at /usr/share/perl5/PVE/QemuServer/PCI.pm line 495.",
        ),
    ] {
        let (mut c, mut now) = cluster(version);
        admin_sets(&mut c, vmid, options);
        assert_eq!(power(&mut c, &mut now, vmid, "start"), error, "{options:?}");
        assert_eq!(c.vm_running(vmid), Some(false));
        assert!(held(&c, "pve1").is_empty() && held(&c, "pve2").is_empty());
    }
    // a raw device without function is all of its functions; pcie=1 on a pc-q35 machine
    let (mut c, mut now) = cluster("9.1.4");
    admin_sets(&mut c, 104, &[("hostpci1", "01:00,pcie=1")]);
    assert_eq!(power(&mut c, &mut now, 104, "start"), "OK");
    assert_eq!(
        held(&c, "pve1"),
        [pair("0000:01:00.0", 104), pair("0000:01:00.1", 104)]
    );
}

#[tokio::test(start_paused = true)]
async fn a_token_may_write_mapped_devices_only() {
    let (mut c, now) = cluster("9.1.4");
    // what PVE checks only at start is accepted
    put(&mut c, now, 101, &[("hostpci0", "mapping=nope,pcie=1")]);
    put(
        &mut c,
        now,
        102,
        &[("hostpci15", "mapping=gpu,rombar=0,driver=keep")],
    );
    let raw = "only root can set 'hostpci0' config for non-mapped devices";
    for (options, error) in [
        (&[("hostpci0", "0000:01:00.0")][..], raw),
        (&[("hostpci0", "host=01:00.0,mapping=gpu")], raw),
        (
            &[("hostpci0", "pcie=1")],
            "either 'host' or 'mapping' must be set.",
        ),
    ] {
        let before = c.vms[&103].config.clone();
        let e = c
            .update_config(now, "pve1", 103, &p(options), false)
            .expect_err("PUT refused");
        assert_eq!((e.status, e.reason.as_str()), (500, error), "{options:?}");
        let upid = c
            .update_config(now, "pve1", 103, &p(options), true)
            .expect("a task")
            .expect("POST");
        let later = now + c.options().task_duration;
        c.advance(later);
        assert_eq!(exit_status(&c, "pve1", upid.as_str()), error);
        assert_eq!(c.vms[&103].config, before, "nothing written");
    }
    // a raw device set by root@pam can neither be replaced nor deleted by a token
    admin_sets(&mut c, 104, &[("hostpci2", "0000:02:00.0")]);
    let raw2 = "only root can set 'hostpci2' config for non-mapped devices";
    for options in [
        &[("hostpci2", "mapping=gpu")][..],
        &[("delete", "hostpci2")],
    ] {
        let e = c
            .update_config(now, "pve1", 104, &p(options), false)
            .expect_err("refused");
        assert_eq!(e.reason, raw2, "{options:?}");
    }
    // a mapped device may be deleted
    put(&mut c, now, 101, &[("delete", "hostpci0")]);
    assert!(!c.vms[&101].config.contains_key("hostpci0"));
}

#[tokio::test(start_paused = true)]
async fn the_hostpci_schema_refuses_bad_values() {
    let (mut c, now) = cluster("9.1.4");
    let format_error = |option: &str, text: &str| {
        format!("invalid format - format error\nhostpci0.{option}: {text}")
    };
    for (key, value, error) in [
        (
            "hostpci16",
            "mapping=gpu",
            "property is not defined in schema and the schema does not allow additional properties"
                .to_owned(),
        ),
        (
            "hostpci0",
            "mapping=1gpu",
            format_error(
                "mapping",
                "invalid format - invalid configuration ID '1gpu'",
            ),
        ),
        (
            "hostpci0",
            "0000:0A:00.0",
            format_error("host", "value does not match the regex pattern"),
        ),
        (
            "hostpci0",
            "mapping=gpu,pcie=2",
            format_error("pcie", "type check ('boolean') failed - got '2'"),
        ),
        (
            "hostpci0",
            "mapping=gpu,driver=nouveau",
            format_error(
                "driver",
                "value 'nouveau' does not have a value in the enumeration 'vfio, keep'",
            ),
        ),
        (
            "hostpci0",
            "mapping=gpu,vendor-id=10de",
            format_error("vendor-id", "value does not match the regex pattern"),
        ),
        (
            "hostpci0",
            "mapping=gpu,bogus=1",
            "invalid format - invalid key in comma-separated list property: bogus".to_owned(),
        ),
        (
            "hostpci0",
            "mapping=gpu,mapping=solo",
            "invalid format - duplicate key in comma-separated list property: mapping".to_owned(),
        ),
    ] {
        let e = c
            .update_config(now, "pve1", 101, &p(&[(key, value)]), true)
            .expect_err(value);
        assert_eq!(e.status, 400, "{value}");
        assert_eq!(e.errors[key], error, "{value}");
    }
}

fn migrations(c: &Cluster) -> Vec<TaskRecord> {
    c.task_records()
        .into_iter()
        .filter(|r| r.kind == "qmigrate")
        .collect()
}

/// Migrates HA resource `vm:<vmid>` to `target` and returns whether it moved and the last
/// line before the task's end.
fn ha_migrate(c: &mut Cluster, now: &mut Instant, vmid: u32, target: &str) -> (bool, String) {
    let sid = format!("vm:{vmid}");
    if c.ha_state(vmid).is_none() {
        let state = if c.vm_running(vmid) == Some(true) {
            "started"
        } else {
            "stopped"
        };
        c.ha_create_resource(*now, &p(&[("sid", &sid), ("state", state)]))
            .expect("resource");
    }
    c.ha_migrate(*now, &p(&[("sid", &sid), ("node", target)]))
        .expect("queued");
    *now += c.options().duration_of("qmigrate");
    c.advance(*now);
    let task = migrations(c).pop().expect("qmigrate task");
    let log = c.task_log(&task.node, &task.upid, 0, 50).expect("log").0;
    let lines: Vec<String> = log
        .as_array()
        .expect("lines")
        .iter()
        .filter_map(|l| l["t"].as_str().map(str::to_owned))
        .collect();
    let before_end = lines.iter().rev().nth(1).cloned().unwrap_or_default();
    (task.ok, before_end)
}

#[tokio::test(start_paused = true)]
async fn migrations_with_pci_devices_are_refused_as_pve_does() {
    let (mut c, mut now) = cluster("9.1.4");
    put(&mut c, now, 101, &[("hostpci0", "mapping=gpu,pcie=1")]);
    put(&mut c, now, 102, &[("hostpci1", "mapping=solo")]);
    admin_sets(
        &mut c,
        103,
        &[("hostpci0", "0000:02:00.0"), ("hostpci4", "mapping=gpu")],
    );
    assert_eq!(power(&mut c, &mut now, 101, "start"), "OK");
    for (vmid, cause) in [
        (
            101,
            "can't live migrate running VM which uses following mapped devices: hostpci0:gpu",
        ),
        (
            102,
            "can't migrate to 'pve2': missing mapped devices hostpci1",
        ),
        (103, "can't migrate VM which uses local devices: hostpci0"),
    ] {
        let (ok, line) = ha_migrate(&mut c, &mut now, vmid, "pve2");
        assert!(!ok, "{vmid}");
        assert_eq!(
            line,
            format!("ERROR: migration aborted (duration 00:00:00): {cause}")
        );
        assert_eq!(c.vm_node(vmid).as_deref(), Some("pve1"));
    }
    assert_eq!(held(&c, "pve1"), [pair("0000:01:00.0", 101)]);
    // stopped, with an entry of its mapping on the target: an offline migration, and the
    // next start takes the target's device
    assert_eq!(power(&mut c, &mut now, 101, "stop"), "OK");
    let (ok, _) = ha_migrate(&mut c, &mut now, 101, "pve2");
    assert!(ok);
    assert_eq!(c.vm_node(101).as_deref(), Some("pve2"));
    assert!(held(&c, "pve1").is_empty());
    assert_eq!(power(&mut c, &mut now, 101, "start"), "OK");
    assert_eq!(held(&c, "pve2"), [pair("0000:41:00.0", 101)]);
    // pve3 has no entry
    assert_eq!(power(&mut c, &mut now, 101, "stop"), "OK");
    let (ok, line) = ha_migrate(&mut c, &mut now, 101, "pve3");
    assert!(!ok);
    assert!(line.ends_with("can't migrate to 'pve3': missing mapped devices hostpci0"));
}

#[tokio::test(start_paused = true)]
async fn a_running_vm_is_judged_by_the_devices_it_started_with() {
    let (mut c, mut now) = cluster("9.1.4");
    put(&mut c, now, 102, &[("hostpci0", "mapping=gpu")]);
    assert_eq!(power(&mut c, &mut now, 102, "start"), "OK");
    // PVE keeps the delete pending while the VM runs; the device stays attached
    put(&mut c, now, 102, &[("delete", "hostpci0")]);
    let (ok, line) = ha_migrate(&mut c, &mut now, 102, "pve2");
    assert!(!ok);
    assert!(
        line.ends_with("following mapped devices: hostpci0:gpu"),
        "{line}"
    );
    assert_eq!(held(&c, "pve1"), [pair("0000:01:00.0", 102)]);
}

#[tokio::test(start_paused = true)]
async fn ha_recovery_takes_devices_on_the_new_node_or_ends_in_error() {
    let (mut c, mut now) = cluster("9.1.4");
    for vmid in [101, 102] {
        put(&mut c, now, vmid, &[("hostpci0", "mapping=gpu")]);
        assert_eq!(power(&mut c, &mut now, vmid, "start"), "OK");
        let sid = format!("vm:{vmid}");
        c.ha_create_resource(now, &p(&[("sid", &sid), ("state", "started")]))
            .expect("resource");
    }
    // only pve2 is left, with one device for both
    c.set_node_online("pve3", false);
    let moved = c.fail_node(now, "pve1");
    assert_eq!(moved.len(), 2, "{moved:?}");
    assert!(
        held(&c, "pve1").is_empty(),
        "a failed node's VMs hold nothing"
    );
    assert_eq!(c.vm_node(101).as_deref(), Some("pve2"));
    assert_eq!(c.vm_running(101), Some(true));
    assert_eq!(held(&c, "pve2"), [pair("0000:41:00.0", 101)]);
    assert_eq!(c.vm_node(102).as_deref(), Some("pve2"));
    assert_eq!(c.vm_running(102), Some(false));
    assert_eq!(c.ha_state(102).as_deref(), Some("error"));
    let start = c
        .task_records()
        .into_iter()
        .rfind(|r| r.kind == "qmstart" && r.vmid == Some(102))
        .expect("the LRM's start");
    assert_eq!(start.node, "pve2");
    now += c.options().task_duration;
    c.advance(now);
    assert_eq!(
        exit_status(&c, "pve2", &start.upid),
        "PCI device '0000:41:00.0' already in use by VMID '101'"
    );
    assert_eq!(held(&c, "pve2"), [pair("0000:41:00.0", 101)]);
}

#[tokio::test(start_paused = true)]
async fn mappings_and_host_devices_are_listed_as_pve_lists_them() {
    let (c, _) = cluster("9.1.4");
    let list = c.pci_mappings(None).expect("list");
    let digest = list[0]["digest"].as_str().expect("digest").to_owned();
    assert_eq!(digest.len(), 40);
    assert_eq!(
        list,
        json!([
            {"id": "gpu", "type": "pci", "description": "RTX 3090", "digest": digest, "map": [
                "node=pve1,path=0000:01:00.0,id=10de:2204,iommugroup=14",
                "node=pve1,path=0000:02:00.0,id=10de:2204,iommugroup=15",
                "node=pve2,path=0000:41:00.0,id=10de:2204,iommugroup=30"]},
            {"id": "solo", "type": "pci", "digest": digest,
             "map": ["node=pve1,path=0000:01:00.0,id=10de:2204"]}
        ])
    );
    let checked = c.pci_mappings(Some("pve2")).expect("checked");
    assert_eq!(checked[0]["checks"], json!([]));
    assert_eq!(
        checked[1]["checks"],
        json!([{"severity": "warning", "message": "No mapping for node pve2."}])
    );
    let e = c.pci_mappings(Some("pve9")).expect_err("unknown node");
    assert!(
        e.reason.starts_with("hostname lookup 'pve9' failed"),
        "{}",
        e.reason
    );
    let one = c.pci_mapping("solo").expect("get");
    assert_eq!(one.get("id"), None, "PVE answers the config entry");
    assert_eq!(one["map"], list[1]["map"]);
    let e = c.pci_mapping("nope").expect_err("unknown");
    assert_eq!(
        (e.status, e.reason.as_str()),
        (500, "mapping 'nope' not found")
    );
    assert_eq!(c.pci_mapping("1x").expect_err("bad id").status, 400);
    // bridges (class 06) are left out by default; verbose adds the subsystem and names
    let devices = c.node_pci("pve1", None, None).expect("devices");
    let ids: Vec<&str> = devices
        .as_array()
        .expect("list")
        .iter()
        .filter_map(|d| d["id"].as_str())
        .collect();
    assert_eq!(ids, ["0000:01:00.0", "0000:01:00.1", "0000:02:00.0"]);
    assert_eq!(
        devices[0],
        json!({"id": "0000:01:00.0", "class": "0x030000", "vendor": "0x10de", "device": "0x2204",
               "iommugroup": 14, "subsystem_vendor": "0x1458", "subsystem_device": "0x4032",
               "vendor_name": "NVIDIA Corporation"})
    );
    let terse = c.node_pci("pve1", Some(""), Some("0")).expect("all, terse");
    assert_eq!(terse.as_array().map(Vec::len), Some(4));
    assert_eq!(terse[1].get("subsystem_vendor"), None);
    let no_audio = c.node_pci("pve1", Some("04;06"), None).expect("filtered");
    assert_eq!(no_audio.as_array().map(Vec::len), Some(2));
    assert_eq!(c.node_pci("pve3", None, None).expect("none"), json!([]));
}

#[tokio::test(start_paused = true)]
async fn running_topology_guests_hold_their_devices() {
    let yaml = TOPOLOGY
        .replace(
            "{vmid: 101, name: a, node: pve1, storage: ceph, config: {machine: q35}}",
            "{vmid: 101, name: a, node: pve1, storage: ceph, running: true, config: {hostpci0: 'mapping=solo'}}",
        )
        .replace(
            "{vmid: 102, name: b, node: pve1, storage: ceph, config: {machine: q35}}",
            "{vmid: 102, name: b, node: pve1, storage: ceph, running: true, config: {hostpci0: '01:00.0'}}",
        );
    let topology = Topology::from_yaml(&yaml, "t").expect("topology");
    let c = Cluster::new(&topology, SimOptions::default(), Box::new(|_| false));
    assert_eq!(c.pci_in_use("pve1"), [pair("0000:01:00.0", 101)]);
    assert_eq!(c.vm_running(102), Some(false), "its device was taken");
    assert_eq!(c.boots(102), Some(0));
}
