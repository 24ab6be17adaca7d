//! Tests of the fleet benchmark's arithmetic (`benches/fleet/analysis.rs`); the bench target
//! runs without a test harness, so its pure parts are tested from here.

#[allow(dead_code)] // the bench uses all of it; these tests only part
#[path = "../../benches/fleet/analysis.rs"]
mod analysis;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use analysis::*;
use capmox_sim::{LoggedRequest, RequestTiming, StorageLockHold, TaskRecord};
use serde_json::json;
use tokio::time::Instant;

/// The tasks by VM, all on the first site.
fn by_vm(tasks: &[TaskRecord]) -> HashMap<VmKey, Vec<&TaskRecord>> {
    let mut tasks_of: HashMap<VmKey, Vec<&TaskRecord>> = HashMap::new();
    for t in tasks {
        tasks_of
            .entry((0, t.vmid.unwrap_or_default()))
            .or_default()
            .push(t);
    }
    tasks_of
}

#[test]
fn kube_requests_are_the_difference_of_two_snapshots() {
    let counts = |entries: &[(&str, &str, u64)], ended: u64| {
        let mut c = capmox_testkit::RequestCounts::default();
        for (resource, verb, n) in entries {
            *c.by_verb.entry(verb.to_string()).or_default() += n;
            c.by_resource
                .insert((resource.to_string(), verb.to_string()), *n);
        }
        if ended > 0 {
            c.watches_ended.insert("timeout".into(), ended);
        }
        c
    };
    let before = counts(&[("", "discovery", 1), ("proxmoxmachines.x", "list", 1)], 0);
    let after = counts(
        &[
            ("", "discovery", 1),
            ("proxmoxmachines.x", "list", 1),
            ("proxmoxmachines.x", "get", 8),
            ("secrets", "get", 2),
            ("proxmoxmachines.x/status", "patch", 4),
            ("proxmoxmachines.x", "watch", 2),
        ],
        2,
    );
    let report = kube_requests(&before, &after, 2);
    assert_eq!(report["reads"], 10);
    assert_eq!(report["writes"], 4);
    assert_eq!(report["watch_requests"], 2);
    assert_eq!(report["watches_restarted_by_server"], 2);
    assert_eq!(report["per_machine"]["reads"], 5.0);
    assert_eq!(report["per_machine"]["writes"], 2.0);
    assert_eq!(
        report["by_request"],
        json!({"get proxmoxmachines.x": 8, "get secrets": 2,
               "patch proxmoxmachines.x/status": 4, "watch proxmoxmachines.x": 2})
    );
}

#[test]
fn reconcile_counts_are_read_from_the_metrics_text() {
    let text = "# HELP controller_runtime_reconcile Reconciliations\n\
        # TYPE controller_runtime_reconcile counter\n\
        controller_runtime_reconcile_total{controller=\"proxmoxmachine\",result=\"success\"} 410\n\
        controller_runtime_reconcile_total{controller=\"proxmoxmachine\",result=\"error\"} 3\n\
        controller_runtime_reconcile_total{controller=\"proxmoxcluster\",result=\"success\"} 7\n\
        controller_runtime_reconcile_errors_total{controller=\"proxmoxmachine\"} 3\n\
        # EOF\n";
    assert_eq!(
        reconcile_counts(text),
        BTreeMap::from([
            ("proxmoxcluster success".to_string(), 7),
            ("proxmoxmachine error".to_string(), 3),
            ("proxmoxmachine success".to_string(), 410),
        ])
    );
}

#[test]
fn covered_merges_overlaps_and_clips() {
    let t0 = Instant::now();
    let at = |ms: u64| t0 + Duration::from_millis(ms);
    let spans = vec![(at(0), at(100)), (at(50), at(150)), (at(300), at(400))];
    assert_eq!(
        covered(spans.clone(), at(0), at(1000)),
        Duration::from_millis(250)
    );
    assert_eq!(covered(spans, at(120), at(350)), Duration::from_millis(80));
}

#[test]
fn spread_uses_nearest_rank() {
    let v: Vec<f64> = (1..=20).map(f64::from).collect();
    assert_eq!(
        spread(&v),
        json!({"median": 10.0, "p95": 19.0, "max": 20.0})
    );
}

#[test]
fn stat_parsing_handles_odd_thread_names() {
    let stat = "42 (a b) c) S 1 2 3 4 5 6 7 8 9 10 120 30 0 0";
    assert_eq!(stat_ticks(stat), Some(("a b) c".to_string(), 150)));
}

fn task(kind: &str, node: &str, vmid: u32, t0: Instant, ms: [u64; 3]) -> TaskRecord {
    let at = |m: u64| t0 + Duration::from_millis(m);
    TaskRecord {
        upid: format!("UPID:{node}:{kind}:{vmid}"),
        node: node.into(),
        kind: kind.into(),
        vmid: Some(vmid),
        volume: None,
        created: at(ms[0]),
        started: Some(at(ms[1])),
        ended: Some(at(ms[2])),
        ok: true,
        agent_ready: (kind == "qmstart").then(|| at(ms[2] + 3000)),
        request: None,
        storage_locks: Vec::new(),
    }
}

#[test]
fn lower_bound_counts_clone_waves_per_node_and_the_control_plane_chain() {
    let t0 = Instant::now();
    // Two workers on one node with one clone slot: the second clone waits for the first.
    let tasks = [
        task("qmclone", "pve1", 100, t0, [0, 0, 2000]),
        task("qmstart", "pve1", 100, t0, [2000, 2000, 3000]),
        task("qmclone", "pve1", 101, t0, [0, 2000, 4000]),
        task("qmstart", "pve1", 101, t0, [4000, 4000, 5000]),
    ];
    let tasks_of = by_vm(&tasks);
    let one_site = Sites::default();
    let machine = |vmid: u32, control_plane: bool| MachineTimes {
        control_plane,
        vmid: Some(vmid),
        node: Some("pve1".into()),
        ..MachineTimes::default()
    };
    let machines: BTreeMap<String, MachineTimes> = [
        ("w1".to_string(), machine(100, false)),
        ("w2".to_string(), machine(101, false)),
    ]
    .into();
    // 2 waves of 2 s clones, then 1 s start and 3 s boot.
    let (bound, detail) = lower_bound(&machines, &tasks_of, 1, &one_site, None);
    assert_eq!(bound, Duration::from_secs(8));
    assert_eq!(detail["per_node"]["pve1"]["waves"], 2);
    // Unlimited slots: one wave.
    assert_eq!(
        lower_bound(&machines, &tasks_of, 0, &one_site, None).0,
        Duration::from_secs(6)
    );
    // As control-plane machines (created one after another) the two paths add up.
    let cp: BTreeMap<String, MachineTimes> = [
        ("c1".to_string(), machine(100, true)),
        ("c2".to_string(), machine(101, true)),
    ]
    .into();
    assert_eq!(
        lower_bound(&cp, &tasks_of, 0, &one_site, None).0,
        Duration::from_secs(12)
    );
    // Proxmox time on a path includes the queueing for a clone slot and the boot.
    let w2 = &tasks_of[&(0, 101)];
    assert_eq!(
        covered(proxmox_spans(w2), t0, t0 + Duration::from_secs(60)),
        Duration::from_secs(8)
    );
    assert_eq!(service_time(w2, true), Duration::from_secs(6));
}

#[test]
fn proxmox_calls_are_attributed_to_machines_where_the_request_names_them() {
    let t0 = Instant::now();
    let clone = task("qmclone", "pve1", 100, t0, [0, 0, 10]);
    let upids: HashMap<String, u32> = [(clone.upid.clone(), 100)].into();
    let req = |method: &str, path: &str, endpoint: &str| LoggedRequest {
        method: method.into(),
        path: path.into(),
        endpoint: endpoint.into(),
        params: Vec::new(),
        status: 200,
        timing: None,
    };
    let log = vec![
        req("GET", "/cluster/resources", "GET /cluster/resources"),
        req(
            "POST",
            "/nodes/pve1/qemu/9000/clone",
            "POST /nodes/{node}/qemu/{vmid}/clone",
        ),
        req(
            "GET",
            &format!("/nodes/pve1/tasks/{}/status", clone.upid),
            "GET /nodes/{node}/tasks/{upid}/status",
        ),
        req(
            "GET",
            "/nodes/pve1/qemu/100/config",
            "GET /nodes/{node}/qemu/{vmid}/config",
        ),
        req(
            "GET",
            "/nodes/pve1/qemu/101/config",
            "GET /nodes/{node}/qemu/{vmid}/config",
        ),
        req(
            "DELETE",
            "/nodes/pve1/storage/local/content/local:iso/user-data-101.iso",
            "DELETE /nodes/{node}/storage/{storage}/content/{volume}",
        ),
    ];
    let templates: BTreeSet<u32> = [9000].into();
    let site = SiteCalls {
        name: "site-1",
        log: &log,
        machines: 2,
        templates: &templates,
        upid_vmid: &upids,
    };
    let calls = proxmox_calls(&[site], 2);
    assert_eq!(calls["total"], 6);
    assert_eq!(calls["per_machine_mean"], 3.0);
    assert_eq!(
        calls["not_attributable"], 2,
        "cluster-wide reads and the template's clone"
    );
    assert_eq!(calls["per_machine_max_attributed"], 2);
    let by = &calls["by_endpoint"];
    assert_eq!(
        by["GET /nodes/{node}/qemu/{vmid}/config"],
        json!({"total": 2, "mean": 1.0, "max": 1, "errors": 0})
    );
    assert_eq!(by["GET /cluster/resources"]["max"], json!(null));
    assert_eq!(
        calls["by_site"],
        json!({"site-1": {"machines": 2, "total": 6, "per_machine_mean": 3.0,
                          "attributed_per_machine_mean": 2.0, "not_attributable": 2}})
    );
    assert_eq!(iso_vmid("local:iso/user-data-101.iso"), Some(101));
    assert_eq!(iso_vmid("local:iso/ubuntu.iso"), None);
}

fn two_sites() -> Sites {
    Sites {
        names: vec!["site-1".into(), "site-2".into()],
        urls: vec![
            "http://127.0.0.1:1000".into(),
            "http://127.0.0.1:2000".into(),
        ],
        zone_site: [("zone-a".to_string(), 0), ("zone-c".to_string(), 1)].into(),
    }
}

#[test]
fn a_machine_is_on_the_site_its_endpoint_names_which_must_be_its_zones() {
    let sites = two_sites();
    let machine = |zone: Option<&str>, endpoint: Option<&str>| MachineTimes {
        zone: zone.map(Into::into),
        endpoint: endpoint.map(Into::into),
        ..MachineTimes::default()
    };
    assert_eq!(
        sites.of_machine(
            "m",
            &machine(Some("zone-c"), Some("http://127.0.0.1:2000/"))
        ),
        Ok(1)
    );
    assert_eq!(sites.of_machine("m", &machine(Some("zone-c"), None)), Ok(1));
    assert_eq!(
        sites.of_machine("m", &machine(None, Some("http://127.0.0.1:1000"))),
        Ok(0)
    );
    let wrong = sites
        .of_machine("m", &machine(Some("zone-c"), Some("http://127.0.0.1:1000")))
        .expect_err("zone-c is on site-2");
    assert_eq!(
        wrong,
        "machine m is in zone zone-c of site-2 but its VM was created on site-1's endpoint http://127.0.0.1:1000"
    );
    assert!(
        sites
            .of_machine("m", &machine(Some("zone-a"), Some("http://10.0.0.1:8006")))
            .expect_err("unknown endpoint")
            .contains("none of the sites'")
    );
    assert!(sites.of_machine("m", &machine(None, None)).is_err());
    assert_eq!(
        Sites::default().of_machine("m", &machine(None, None)),
        Ok(0),
        "with one site, every machine is on it"
    );
    assert_eq!(sites.node_label(1, "pve-a1"), "site-2/pve-a1");
    assert_eq!(Sites::default().node_label(0, "pve-a1"), "pve-a1");
}

#[test]
fn lower_bound_keys_nodes_by_site_as_node_names_repeat() {
    let t0 = Instant::now();
    // VM 100 on node pve-a1 of each site: one clone per node with one slot each, not two
    // waves on one node.
    let tasks = [
        task("qmclone", "pve-a1", 100, t0, [0, 0, 2000]),
        task("qmstart", "pve-a1", 100, t0, [2000, 2000, 3000]),
        task("qmclone", "pve-a1", 100, t0, [0, 0, 2000]),
        task("qmstart", "pve-a1", 100, t0, [2000, 2000, 3000]),
    ];
    let mut tasks_of: HashMap<VmKey, Vec<&TaskRecord>> = HashMap::new();
    for (i, t) in tasks.iter().enumerate() {
        tasks_of.entry((i / 2, 100)).or_default().push(t);
    }
    let machine = |site: usize| MachineTimes {
        vmid: Some(100),
        node: Some("pve-a1".into()),
        site,
        ..MachineTimes::default()
    };
    let machines: BTreeMap<String, MachineTimes> = [
        ("w1".to_string(), machine(0)),
        ("w2".to_string(), machine(1)),
    ]
    .into();
    let (bound, detail) = lower_bound(&machines, &tasks_of, 1, &two_sites(), None);
    assert_eq!(bound, Duration::from_secs(6), "{detail}");
    for node in ["site-1/pve-a1", "site-2/pve-a1"] {
        assert_eq!(detail["per_node"][node]["clones"], 1, "{detail}");
        assert_eq!(detail["per_node"][node]["waves"], 1, "{detail}");
    }
}

#[test]
fn proxmox_calls_are_reported_per_site_with_clashing_vmids_kept_apart() {
    let req = |path: &str, endpoint: &str| LoggedRequest {
        method: "GET".into(),
        path: path.into(),
        endpoint: endpoint.into(),
        params: Vec::new(),
        status: 200,
        timing: None,
    };
    let config = "GET /nodes/{node}/qemu/{vmid}/config";
    let resources = || req("/cluster/resources", "GET /cluster/resources");
    // Site 1: two machines (VMs 100, 101), 2 calls each, 2 inventory reads. Site 2: one
    // machine, VM 100 as well, 2 calls and 1 inventory read.
    let first = vec![
        resources(),
        resources(),
        req("/nodes/pve-a1/qemu/100/config", config),
        req("/nodes/pve-a1/qemu/100/config", config),
        req("/nodes/pve-a2/qemu/101/config", config),
        req("/nodes/pve-a2/qemu/101/config", config),
    ];
    let second = vec![
        resources(),
        req("/nodes/pve-a1/qemu/100/config", config),
        req("/nodes/pve-a1/qemu/100/config", config),
    ];
    let templates: BTreeSet<u32> = [9000].into();
    let upids = HashMap::new();
    let site = |name, log, machines| SiteCalls {
        name,
        log,
        machines,
        templates: &templates,
        upid_vmid: &upids,
    };
    let calls = proxmox_calls(&[site("site-1", &first, 2), site("site-2", &second, 1)], 3);
    assert_eq!(calls["total"], 9);
    assert_eq!(calls["per_machine_mean"], 3.0);
    assert_eq!(calls["not_attributable"], 3);
    assert_eq!(
        calls["per_machine_max_attributed"], 2,
        "VM 100 of site-1 and VM 100 of site-2 are two machines"
    );
    assert_eq!(
        calls["by_endpoint"][config],
        json!({"total": 6, "mean": 2.0, "max": 2, "errors": 0})
    );
    assert_eq!(
        calls["by_site"],
        json!({
            "site-1": {"machines": 2, "total": 6, "per_machine_mean": 3.0,
                       "attributed_per_machine_mean": 2.0, "not_attributable": 2},
            "site-2": {"machines": 1, "total": 3, "per_machine_mean": 3.0,
                       "attributed_per_machine_mean": 2.0, "not_attributable": 1},
        })
    );
}

#[test]
fn zones_are_split_over_sites_in_order_the_first_taking_the_remainder() {
    assert_eq!(split_zones(3, 1), [vec![0, 1, 2]]);
    assert_eq!(split_zones(3, 2), [vec![0, 1], vec![2]]);
    assert_eq!(split_zones(5, 3), [vec![0, 1], vec![2, 3], vec![4]]);
    assert_eq!(split_zones(2, 2), [vec![0], vec![1]]);
}

#[test]
fn controller_added_time_is_split_by_what_came_before_it_and_adds_up() {
    let t0 = Instant::now();
    let ms = |m: u64| Duration::from_millis(m);
    // Created at 0; clone requested at 100, ended 2100; resize requested 2150, ended 2650;
    // start requested 2700, ended 3700, guest up 6700; the machine ready at 7200.
    let tasks = [
        task("qmclone", "pve1", 100, t0, [100, 100, 2100]),
        task("resize", "pve1", 100, t0, [2150, 2150, 2650]),
        task("qmstart", "pve1", 100, t0, [2700, 2700, 3700]),
    ];
    let path: Vec<&TaskRecord> = tasks.iter().collect();
    let (from, to) = (t0, t0 + ms(7200));
    let gaps = controller_gaps(&path, from, to);
    assert_eq!(
        gaps,
        [
            ("before the first task".to_string(), ms(100)),
            ("after qmclone".to_string(), ms(50)),
            ("after resize".to_string(), ms(50)),
            ("after the boot".to_string(), ms(500)),
        ]
    );
    let total: Duration = gaps.iter().map(|(_, gap)| *gap).sum();
    assert_eq!(total, (to - from) - covered(proxmox_spans(&path), from, to));
}

/// A request served by `pool` that arrived at `arrived`, waited until `started` and took until
/// `ended` (ms after `t0`).
fn timing(pool: &str, t0: Instant, [arrived, started, ended]: [u64; 3]) -> RequestTiming {
    let at = |m: u64| t0 + Duration::from_millis(m);
    RequestTiming {
        pool: pool.into(),
        arrived: at(arrived),
        started: at(started),
        ended: at(ended),
    }
}

/// Under the realistic profile, drawn clone durations make the sum of a node's clones over its
/// slots the bound where the shortest clone times the waves is less; the request that created
/// each task counts on its path, lock waits do not.
#[test]
fn lower_bound_takes_drawn_clones_requests_and_lock_waits_into_account() {
    let t0 = Instant::now();
    let created_by = |mut t: TaskRecord, served_ms: u64| {
        let created = (t.created - t0).as_millis() as u64;
        t.request = Some(timing(
            "pve1/pvedaemon",
            t0,
            [created - served_ms, created - served_ms, created],
        ));
        t
    };
    // One slot: clones of 1, 2 and 3 s run one after another (each requested in 100 ms), then a
    // 500 ms start (requested in 100 ms) and 3 s of boot. The second clone also waited 400 ms
    // for a storage lock while it held the slot, which is not its own work.
    let mut second = created_by(task("qmclone", "pve1", 101, t0, [100, 1100, 3500]), 100);
    second.storage_locks = vec![StorageLockHold {
        lock: "local-lvm@pve1".into(),
        requested: t0 + Duration::from_millis(1100),
        acquired: t0 + Duration::from_millis(1500),
        released: t0 + Duration::from_millis(1700),
    }];
    let tasks = [
        created_by(task("qmclone", "pve1", 100, t0, [100, 100, 1100]), 100),
        second,
        created_by(task("qmclone", "pve1", 102, t0, [100, 3500, 6500]), 100),
        created_by(task("qmstart", "pve1", 100, t0, [1200, 1200, 1700]), 100),
        created_by(task("qmstart", "pve1", 101, t0, [3600, 3600, 4100]), 100),
        created_by(task("qmstart", "pve1", 102, t0, [6600, 6600, 7100]), 100),
    ];
    let tasks_of = by_vm(&tasks);
    let machines: BTreeMap<String, MachineTimes> = (100..103)
        .map(|vmid| {
            let m = MachineTimes {
                vmid: Some(vmid),
                node: Some("pve1".into()),
                ..MachineTimes::default()
            };
            (format!("w{vmid}"), m)
        })
        .collect();
    let one_site = Sites::default();
    let (bound, detail) = lower_bound(&machines, &tasks_of, 1, &one_site, Some(3));
    // 0.1 s first clone request + (1 + 2 + 3) s of clones + 0.1 s start request + 0.5 s start + 3 s boot.
    assert_eq!(bound, Duration::from_millis(9700), "{detail}");
    let node = &detail["per_node"]["pve1"];
    assert_eq!(node["clones_total_s"], 6.0);
    assert_eq!(node["shortest_clone_s"], 1.0);
    assert_eq!(detail["storage_locks"]["local-lvm@pve1"]["holds"], 1);
    assert_eq!(detail["api_pools"]["pve1/pvedaemon"]["task_requests"], 6);
    // Without API workers (the ideal profile, whose records have no requests, so this only
    // happens here) the first clone's request is not added, and the detail is the ideal one.
    let (ideal, ideal_detail) = lower_bound(&machines, &tasks_of, 1, &one_site, None);
    assert_eq!(ideal, Duration::from_millis(9600));
    assert!(ideal_detail.get("storage_locks").is_none());
    assert!(
        ideal_detail["per_node"]["pve1"]
            .get("clones_total_s")
            .is_none()
    );
}

/// Holds of one storage lock add up, even when the clones hold slots on different nodes; the
/// task-creating requests of an API pool add up over its workers.
#[test]
fn storage_locks_and_api_pools_bound_the_fleet() {
    let t0 = Instant::now();
    let hold = |from: u64| StorageLockHold {
        lock: "ceph".into(),
        requested: t0,
        acquired: t0 + Duration::from_millis(from),
        released: t0 + Duration::from_millis(from + 1000),
    };
    let mut tasks = Vec::new();
    for (i, node) in ["pve1", "pve2", "pve3"].into_iter().enumerate() {
        let vmid = 100 + i as u32;
        let from = 1000 * i as u64;
        // Each clone waits for the lock, holds it 1 s, then copies 0.5 s.
        let mut clone = task("qmclone", node, vmid, t0, [0, 0, from + 1500]);
        clone.storage_locks = vec![hold(from)];
        clone.request = Some(timing("pve1/pvedaemon", t0, [0, 0, 0]));
        tasks.push(clone);
        let mut start = task(
            "qmstart",
            node,
            vmid,
            t0,
            [from + 1500, from + 1500, from + 2000],
        );
        start.request = Some(timing("pve1/pvedaemon", t0, [0, 0, 0]));
        tasks.push(start);
    }
    let tasks_of = by_vm(&tasks);
    let machines: BTreeMap<String, MachineTimes> = tasks
        .iter()
        .filter(|t| t.kind == "qmclone")
        .map(|t| {
            let m = MachineTimes {
                vmid: t.vmid,
                node: Some(t.node.clone()),
                ..MachineTimes::default()
            };
            (format!("w{}", t.vmid.unwrap_or_default()), m)
        })
        .collect();
    let (bound, detail) = lower_bound(&machines, &tasks_of, 1, &Sites::default(), Some(3));
    // 3 s of holds, then 0.5 s of copy, 0.5 s start and 3 s boot.
    assert_eq!(bound, Duration::from_millis(7000), "{detail}");
    assert_eq!(detail["storage_locks"]["ceph"]["held_s"], 3.0);
    assert_eq!(
        detail["per_node"]["pve3"]["bound_s"], 5.0,
        "1.5 s clone and the rest"
    );

    // Seven task-creating requests of 300 ms on one pool with 3 workers need 0.7 s.
    let served: Vec<TaskRecord> = (0..7)
        .map(|i| {
            let mut t = task("qmconfig", "pve1", 100 + i, t0, [300, 300, 400]);
            t.request = Some(timing("pve1/pvedaemon", t0, [0, 0, 300]));
            t
        })
        .collect();
    let (pool_bound, pools) = api_pool_bound(&served, 3);
    assert_eq!(pool_bound, Duration::from_millis(700));
    assert_eq!(pools["pve1/pvedaemon"]["task_requests"], 7);
}

/// The wait for an API worker counts as the request's, so the gap before a task ends when its
/// request reached the simulator.
#[test]
fn controller_gaps_end_when_the_request_arrives() {
    let t0 = Instant::now();
    let ms = |m: u64| Duration::from_millis(m);
    let mut clone = task("qmclone", "pve1", 100, t0, [300, 300, 2300]);
    clone.request = Some(timing("pve1/pvedaemon", t0, [100, 200, 300]));
    let path = [&clone];
    let gaps = controller_gaps(&path, t0, t0 + ms(2500));
    assert_eq!(
        gaps,
        [
            ("before the first task".to_string(), ms(100)),
            ("after qmclone".to_string(), ms(200)),
        ]
    );
    assert_eq!(
        covered(request_spans(clone.request.iter()), t0, t0 + ms(2500)),
        ms(200)
    );
}

#[test]
fn api_queueing_reports_waits_pools_and_endpoints() {
    let t0 = Instant::now();
    let req = |endpoint: &str, pool: &str, ms: [u64; 3]| LoggedRequest {
        method: "GET".into(),
        path: "/cluster/resources".into(),
        endpoint: endpoint.into(),
        params: Vec::new(),
        status: 200,
        timing: Some(timing(pool, t0, ms)),
    };
    let resources = "GET /cluster/resources";
    let log = vec![
        req(resources, "pve1/pveproxy", [0, 0, 100]),
        req(resources, "pve1/pveproxy", [0, 100, 200]),
        req("GET /version", "pve2/pveproxy", [0, 0, 50]),
        LoggedRequest {
            timing: None,
            ..req(resources, "pve1/pveproxy", [0, 0, 0])
        },
    ];
    let report = api_queueing(&[("site-1", &log)], 1, Duration::from_secs(1));
    assert_eq!(report["requests"], 3, "untimed requests are not counted");
    assert_eq!(report["requests_that_waited"], 1);
    assert_eq!(report["queued_s"], 0.1);
    assert_eq!(report["pools"]["pve1/pveproxy"]["utilisation"], 0.2);
    assert_eq!(report["pools"]["pve1/pveproxy"]["longest_wait_ms"], 100.0);
    assert_eq!(report["busiest_pool"]["pool"], "pve1/pveproxy");
    assert_eq!(report["by_endpoint"][resources]["served_ms_mean"], 100.0);
    assert_eq!(report["by_endpoint"][resources]["queued_ms_mean"], 50.0);
    let two = api_queueing(
        &[("site-1", &log), ("site-2", &log)],
        1,
        Duration::from_secs(1),
    );
    assert!(two["pools"].get("site-2/pve2/pveproxy").is_some());
}

#[test]
fn percentiles_use_nearest_rank() {
    let v: Vec<f64> = (1..=200).map(f64::from).collect();
    assert_eq!(
        percentiles(&v),
        json!({"p50": 100.0, "p95": 190.0, "p99": 198.0})
    );
    assert_eq!(
        percentiles(&[]),
        json!({"p50": null, "p95": null, "p99": null})
    );
}

#[test]
fn a_machines_timed_requests_are_those_naming_its_vm_on_its_site() {
    let t0 = Instant::now();
    let req = |path: &str, timed: bool| LoggedRequest {
        method: "GET".into(),
        path: path.into(),
        endpoint: String::new(),
        params: Vec::new(),
        status: 200,
        timing: timed.then(|| timing("pve1/pveproxy", t0, [0, 0, 10])),
    };
    let first = vec![
        req("/nodes/pve1/qemu/100/config", true),
        req("/nodes/pve1/qemu/9000/config", true),
        req("/cluster/resources", true),
        req("/nodes/pve1/qemu/100/status/current", false),
    ];
    let second = vec![req("/nodes/pve1/qemu/100/config", true)];
    let templates: Vec<BTreeSet<u32>> = vec![[9000].into(), [9000].into()];
    let upids = vec![HashMap::new(), HashMap::new()];
    let requests = machine_requests(&[&first, &second], &templates, &upids);
    assert_eq!(requests.len(), 2, "VM 100 on each site; not the template");
    assert_eq!(
        requests[&(0, 100)].len(),
        1,
        "untimed requests are left out"
    );
    assert_eq!(requests[&(1, 100)].len(), 1);
}
