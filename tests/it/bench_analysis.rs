//! Tests of the fleet benchmark's arithmetic (`benches/fleet/analysis.rs`); the bench target
//! runs without a test harness, so its pure parts are tested from here.

#[allow(dead_code)] // the bench uses all of it; these tests only part
#[path = "../../benches/fleet/analysis.rs"]
mod analysis;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use analysis::*;
use capmox_sim::{LoggedRequest, TaskRecord};
use serde_json::json;
use tokio::time::Instant;

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
    let mut tasks_of: HashMap<u32, Vec<&TaskRecord>> = HashMap::new();
    for t in &tasks {
        tasks_of
            .entry(t.vmid.unwrap_or_default())
            .or_default()
            .push(t);
    }
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
    let (bound, detail) = lower_bound(&machines, &tasks_of, 1);
    assert_eq!(bound, Duration::from_secs(8));
    assert_eq!(detail["per_node"]["pve1"]["waves"], 2);
    // Unlimited slots: one wave.
    assert_eq!(
        lower_bound(&machines, &tasks_of, 0).0,
        Duration::from_secs(6)
    );
    // As control-plane machines (created one after another) the two paths add up.
    let cp: BTreeMap<String, MachineTimes> = [
        ("c1".to_string(), machine(100, true)),
        ("c2".to_string(), machine(101, true)),
    ]
    .into();
    assert_eq!(lower_bound(&cp, &tasks_of, 0).0, Duration::from_secs(12));
    // Proxmox time on a path includes the queueing for a clone slot and the boot.
    let w2 = &tasks_of[&101];
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
    let calls = proxmox_calls(&log, 2, &templates, &upids);
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
    assert_eq!(iso_vmid("local:iso/user-data-101.iso"), Some(101));
    assert_eq!(iso_vmid("local:iso/ubuntu.iso"), None);
}
