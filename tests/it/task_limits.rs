//! Bounded pressure on Proxmox: clones over a node's or a shared storage's `taskLimits` wait
//! in capmox's queue, saying so, and run one after another in Proxmox instead of side by side.

use std::sync::Arc;
use std::time::Duration;

use capmox::api::ProxmoxMachine;
use capmox::controller::{Context, GlobalCredentials};
use capmox_sim::SimOptions;
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use serde_json::{Value, json};

use crate::common::env::{Env, condition, manager_config};

/// A cluster `demo` with one zone over `nodes` and `limits` as its `taskLimits`, ready, its
/// controllers running; clones take a second in the simulator, which runs any number at once.
async fn started(nodes: &[&str], limits: Value) -> (Env, Arc<Context>) {
    let env = Env::start_with(SimOptions {
        clone_duration: Duration::from_secs(1),
        clone_slots_per_node: 0,
        ..SimOptions::default()
    })
    .await;
    env.create_credentials("demo-credentials", None).await;
    let uid = env.create_capi_cluster("demo").await;
    let spec = json!({
        "controlPlaneEndpoint": {"host": "10.0.0.10", "port": 6443},
        "dnsServers": ["10.0.0.2"],
        "ipv4Config": {"addresses": ["10.0.0.100-10.0.0.150"], "prefix": 24, "gateway": "10.0.0.1"},
        "credentialsRef": {"name": "demo-credentials"},
        "schedulerHints": {"memoryAdjustment": 0},
        "taskLimits": limits,
        "zoneConfig": [{"zone": "rack-a", "nodes": nodes}]
    });
    env.create_proxmox_cluster("demo", &uid, spec).await;
    let context = Arc::new(Context::new(
        env.client(),
        manager_config(),
        GlobalCredentials::default(),
    ));
    tokio::spawn(capmox::controller::run_controllers(
        context.clone(),
        env.stop.clone(),
    ));
    env.run_ipam();
    let cluster = env
        .wait_cluster("demo", "Ready=True", |c| {
            condition(c, "Ready").is_some_and(|c| c.0 == "True")
        })
        .await;
    env.mark_cluster_provisioned("demo", &cluster).await;
    (env, context)
}

fn machine_spec() -> Value {
    json!({
        "sourceNode": "pve1", "templateID": 9000, "memoryMiB": 2048,
        "network": {"networkDevices": [{"name": "net0", "bridge": "vmbr0", "defaultIPv4": true}]}
    })
}

/// The most clone tasks the simulator ran at once, from when each began and ended.
fn most_clones_at_once(env: &Env) -> usize {
    let clones: Vec<_> = env
        .sim
        .task_records()
        .into_iter()
        .filter(|t| t.kind == "qmclone")
        .collect();
    clones
        .iter()
        .filter_map(|t| t.started)
        .map(|at| {
            clones
                .iter()
                .filter(|o| o.started.is_some_and(|s| s <= at) && o.ended.is_none_or(|e| e > at))
                .count()
        })
        .max()
        .unwrap_or(0)
}

async fn provision(env: &Env, names: &[&str]) {
    for name in names {
        env.create_machine("demo", name, Some("rack-a"), false, machine_spec())
            .await;
    }
}

#[tokio::test]
async fn clones_over_a_nodes_limit_wait_in_capmox_and_run_one_after_another() {
    let (env, context) = started(&["pve1"], json!({"perNode": 1})).await;
    provision(&env, &["worker-1", "worker-2", "worker-3"]).await;
    // Whichever clones first, the other two wait behind it (the metrics below count them).
    let mut waiting: FuturesUnordered<_> = ["worker-1", "worker-2", "worker-3"]
        .into_iter()
        .map(|name| env.wait_machine_reason(name, "WaitingForTaskSlot"))
        .collect();
    let mut messages = Vec::new();
    while messages.len() < 2 {
        let (_, message) = waiting.next().await.expect("two machines wait");
        messages.push(message);
    }
    drop(waiting);
    assert!(
        messages
            .iter()
            .all(|m| m
                .starts_with("node pve1 runs as many clone or disk tasks as its limit allows (1,")),
        "{messages:?}"
    );
    for name in ["worker-1", "worker-2", "worker-3"] {
        env.wait_machine(name, "provisioned", ProxmoxMachine::is_provisioned)
            .await;
    }
    assert_eq!(
        most_clones_at_once(&env),
        1,
        "Proxmox never ran two clones at once"
    );
    let metrics = context.metrics.render();
    assert!(
        metrics.contains("capmox_task_slot_waits_total 2\n")
            && metrics.contains("capmox_task_slot_waiting 0\n"),
        "{metrics}"
    );
}

#[tokio::test]
async fn a_shared_storages_limit_spans_its_nodes() {
    // The template lies on the shared Ceph pool, so clones to pve1 and pve2 both write there.
    let (env, _) = started(&["pve1", "pve2"], json!({"perNode": 4, "perStorage": 1})).await;
    provision(&env, &["worker-1", "worker-2"]).await;
    let mut nodes = Vec::new();
    for name in ["worker-1", "worker-2"] {
        let machine = env
            .wait_machine(name, "provisioned", ProxmoxMachine::is_provisioned)
            .await;
        nodes.extend(machine.status.and_then(|s| s.proxmox_node));
    }
    nodes.sort();
    assert_eq!(nodes, ["pve1", "pve2"], "spread over both nodes");
    assert_eq!(most_clones_at_once(&env), 1, "one clone at a time on ceph");
}
