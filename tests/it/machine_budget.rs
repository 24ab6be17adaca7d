//! Deterministic budgets and races of the machine reconciler: Proxmox API calls per machine,
//! two machines scheduled at once onto nodes with room for one each, machines that all hear
//! the same free VMID from Proxmox, and VMIDs never recorded twice while clones fail.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::env::{Env, condition};
use capmox::api::ProxmoxMachine;
use capmox::controller::node_tasks::BLIND_FOR;
use capmox_sim::{FaultRule, SimOptions};
use futures::StreamExt;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams};
use kube::runtime::{WatchStreamExt, watcher};
use serde_json::json;

fn instant_sim() -> SimOptions {
    SimOptions {
        clone_duration: Duration::ZERO,
        task_duration: Duration::ZERO,
        boot_delay: Duration::ZERO,
        ..SimOptions::default()
    }
}

fn proxmox_calls(env: &Env) -> u64 {
    env.sim.counters().values().map(|c| c.calls).sum()
}

/// Proxmox calls per endpoint since `before` (from [`calls_by_endpoint`]), for the message
/// of a budget that was exceeded.
fn calls_since(env: &Env, before: &BTreeMap<String, u64>) -> BTreeMap<String, u64> {
    calls_by_endpoint(env)
        .into_iter()
        .map(|(endpoint, calls)| {
            let earlier = before.get(&endpoint).copied().unwrap_or(0);
            (endpoint, calls - earlier)
        })
        .filter(|(_, calls)| *calls > 0)
        .collect()
}

fn calls_by_endpoint(env: &Env) -> BTreeMap<String, u64> {
    env.sim
        .counters()
        .into_iter()
        .map(|(endpoint, c)| (endpoint, c.calls))
        .collect()
}

async fn cluster(env: &Env, spec: serde_json::Value) {
    cluster_started_by(env, spec, Env::run_controllers).await;
}

/// The `demo` cluster of `spec`, provisioned by the controllers `start` runs; returns what
/// `start` returned (a handle to restart them by).
async fn cluster_started_by<T>(
    env: &Env,
    spec: serde_json::Value,
    start: impl FnOnce(&Env) -> T,
) -> T {
    env.create_credentials("demo-credentials", None).await;
    let uid = env.create_capi_cluster("demo").await;
    env.create_proxmox_cluster("demo", &uid, spec).await;
    let started = start(env);
    let ready = env
        .wait_cluster("demo", "Ready=True", |c| {
            condition(c, "Ready").is_some_and(|c| c.0 == "True")
        })
        .await;
    env.mark_cluster_provisioned("demo", &ready).await;
    started
}

/// Clone requests answered after `latency_ms`, that share of them with Proxmox's lock timeout
/// (`can't lock file ... got timeout`) instead.
fn slow_clones(latency_ms: u64, lock_contention_rate: f64) -> SimOptions {
    let mut options = instant_sim();
    options.faults.rules.push(FaultRule {
        endpoint: "POST /nodes/{node}/qemu/{vmid}/clone".into(),
        error_rate: 0.0,
        error_status: 596,
        error_reason: String::new(),
        drop_rate: 0.0,
        lock_contention_rate,
        latency_ms,
    });
    options
}

/// A ProxmoxCluster with one zone, rack-a, of nodes pve1 and pve2.
fn rack_a_cluster() -> serde_json::Value {
    json!({
        "controlPlaneEndpoint": {"host": "10.0.0.10", "port": 6443},
        "dnsServers": ["10.0.0.2"],
        "ipv4Config": {"addresses": ["10.0.0.100-10.0.0.150"], "prefix": 24, "gateway": "10.0.0.1"},
        "credentialsRef": {"name": "demo-credentials"},
        "zoneConfig": [{"zone": "rack-a", "nodes": ["pve1", "pve2"]}]
    })
}

fn machine_spec(memory_mib: i64) -> serde_json::Value {
    json!({
        "sourceNode": "pve1", "templateID": 9000, "memoryMiB": memory_mib,
        "network": {"networkDevices": [{"name": "net0", "bridge": "vmbr0", "defaultIPv4": true}]}
    })
}

/// The client name capmox's controllers use in the budget test.
const CONTROLLERS: &str = "capmox";

/// What provisioning one machine cost, up to the seed ISO's removal after its node joined.
struct Provisioned {
    machine: ProxmoxMachine,
    /// Proxmox calls for this machine: without the cluster controller's checks of the
    /// endpoint and without the shared listing.
    proxmox: u64,
    /// Fetches of the listing (`/cluster/resources`) while it provisioned: one snapshot per
    /// endpoint shared by every machine, refreshed after clones and starts and when older than
    /// 2 s, so how many fall to one machine alone depends on time, not on the machine.
    listings: u64,
    proxmox_by_endpoint: BTreeMap<String, u64>,
    proxmox_sequence: Vec<String>,
    /// The controllers' Kubernetes GETs and LISTs (the watches behind their caches go on).
    kubernetes_reads: u64,
    kubernetes_reads_by_resource: BTreeMap<String, u64>,
    /// The controllers' writes to ProxmoxMachine statuses.
    status_writes: u64,
}

/// The cluster controller's checks of the endpoint (its nodes and version) are the cluster's,
/// not the machine's: a fleet pays for them once.
fn cluster_checks(calls: &BTreeMap<String, u64>) -> u64 {
    ["GET /nodes", "GET /version"]
        .iter()
        .filter_map(|endpoint| calls.get(*endpoint))
        .sum()
}

fn listings(calls: &BTreeMap<String, u64>) -> u64 {
    calls.get("GET /cluster/resources").copied().unwrap_or(0)
}

/// The controllers' patches of ProxmoxMachine statuses so far.
fn status_writes(env: &Env) -> u64 {
    env.server
        .request_counts_of(CONTROLLERS)
        .by_resource
        .into_iter()
        .filter(|((resource, verb), _)| {
            verb == "patch"
                && resource.starts_with("proxmoxmachines")
                && resource.ends_with("/status")
        })
        .map(|(_, n)| n)
        .sum()
}

fn kubernetes_reads(env: &Env) -> BTreeMap<(String, String), u64> {
    env.server
        .request_counts_of(CONTROLLERS)
        .by_resource
        .into_iter()
        .filter(|((_, verb), _)| verb == "get" || verb == "list")
        .collect()
}

/// Provisions `name` until its node joined and its seed ISO is gone, counting the calls.
async fn provision_counted(env: &Env, name: &str) -> Provisioned {
    let reads_before = kubernetes_reads(env);
    let status_writes_before = status_writes(env);
    let log_before = env.sim.request_log().len();
    let before = proxmox_calls(env);
    let by_endpoint = calls_by_endpoint(env);
    env.create_machine("demo", name, Some("rack-a"), true, machine_spec(2048))
        .await;
    let machine = env
        .wait_machine(name, "provisioned", ProxmoxMachine::is_provisioned)
        .await;
    // The node joins: the seed ISO (it holds the bootstrap token) is deleted and detached,
    // which ends the provisioning.
    let placed = machine.status.clone().unwrap_or_default();
    let (node, vmid) = (
        placed.proxmox_node.expect("node"),
        u32::try_from(placed.virtual_machine_id.expect("vmid")).expect("vmid"),
    );
    Api::<capmox::capi::Machine>::namespaced(env.client(), "default")
        .patch_status(
            name,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({"status": {"nodeRef": {"name": name}}})),
        )
        .await
        .expect("nodeRef set");
    let deadline = tokio::time::Instant::now() + crate::common::env::ENV_WAIT;
    while env.sim.with_cluster(|c| {
        c.vm_config(&node, vmid)
            .map(|config| config.get("ide0").is_some())
            .unwrap_or(true)
    }) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for the seed ISO to be detached"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let proxmox_by_endpoint = calls_since(env, &by_endpoint);
    let kubernetes_reads_by_resource: BTreeMap<String, u64> = kubernetes_reads(env)
        .into_iter()
        .map(|(key, n)| {
            let earlier = reads_before.get(&key).copied().unwrap_or(0);
            (format!("{} {}", key.1, key.0), n - earlier)
        })
        .filter(|(_, n)| *n > 0)
        .collect();
    Provisioned {
        machine,
        proxmox: proxmox_calls(env)
            - before
            - cluster_checks(&proxmox_by_endpoint)
            - listings(&proxmox_by_endpoint),
        listings: listings(&proxmox_by_endpoint),
        proxmox_sequence: env.sim.request_log()[log_before..]
            .iter()
            .map(|r| format!("{} {} {:?}", r.method, r.path, r.params))
            .collect(),
        proxmox_by_endpoint,
        kubernetes_reads: kubernetes_reads_by_resource.values().sum(),
        kubernetes_reads_by_resource,
        status_writes: status_writes(env) - status_writes_before,
    }
}

#[tokio::test]
async fn provisioning_and_deleting_a_machine_stay_within_the_api_call_budget() {
    let env = Env::start_with(instant_sim()).await;
    let _controllers = cluster_started_by(&env, rack_a_cluster(), |env| {
        env.run_ipam();
        env.spawn_controllers_with(env.server.client_named(CONTROLLERS))
    })
    .await;
    // The first machine of a process also looks up what a fleet shares for a minute (the
    // template's volumes, the node's ISO storage); the second shows what each further
    // machine costs.
    let first = provision_counted(&env, "demo-cp-1").await;
    let second = provision_counted(&env, "demo-cp-2").await;

    let before = proxmox_calls(&env);
    let by_endpoint = calls_by_endpoint(&env);
    let machines = Api::<ProxmoxMachine>::namespaced(env.client(), "default");
    machines
        .delete("demo-cp-2", &DeleteParams::default())
        .await
        .expect("delete");
    tokio::time::timeout(
        crate::common::env::ENV_WAIT,
        kube::runtime::wait::await_condition(
            machines.clone(),
            "demo-cp-2",
            kube::runtime::wait::conditions::is_deleted(
                second.machine.metadata.uid.as_deref().expect("uid"),
            ),
        ),
    )
    .await
    .expect("deleted in time")
    .expect("watch");
    let deletion_calls = calls_since(&env, &by_endpoint);
    let deletion = proxmox_calls(&env) - before - cluster_checks(&deletion_calls);
    println!(
        "Proxmox API calls: provisioning {} and {} listings (first machine {} and {}), deletion \
         {deletion}; Kubernetes reads while provisioning: {} (first machine {}), status writes {} \
         (first machine {})",
        second.proxmox,
        second.listings,
        first.proxmox,
        first.listings,
        second.kubernetes_reads,
        first.kubernetes_reads,
        second.status_writes,
        first.status_writes
    );
    // The bootstrap data comes from the watch of bootstrap Secrets (its Secret was created
    // long after that watch started), the credentials are read at most once. The cluster
    // controller looks at its pools when the IPAM provider allocates from them (one list of
    // pools). Everything else, the CAPI Cluster included, comes from the watches.
    for (which, machine) in [("first", &first), ("second", &second)] {
        let secret_reads = machine
            .kubernetes_reads_by_resource
            .get("get secrets")
            .copied()
            .unwrap_or(0);
        assert!(
            secret_reads <= 1,
            "the {which} machine's provisioning read {secret_reads} Secrets (its bootstrap data \
             should come from the watch): {:#?}",
            machine.kubernetes_reads_by_resource
        );
        let cluster_reads = machine
            .kubernetes_reads_by_resource
            .get("get clusters.cluster.x-k8s.io")
            .copied()
            .unwrap_or(0);
        assert_eq!(
            cluster_reads, 0,
            "the {which} machine's provisioning read the CAPI Cluster from the API server: {:#?}",
            machine.kubernetes_reads_by_resource
        );
        assert!(
            machine.kubernetes_reads <= 5,
            "provisioning the {which} machine made {} Kubernetes reads (budget 5): {:#?}",
            machine.kubernetes_reads,
            machine.kubernetes_reads_by_resource
        );
    }
    // Status writes: the clone's intent and its task record (with the conditions its pass
    // ends with, so that pass writes nothing more), the announced ends of the clone and the
    // start, and the records of the later steps.
    for (which, machine) in [("first", &first), ("second", &second)] {
        assert!(
            machine.status_writes <= 9,
            "provisioning the {which} machine wrote its status {} times (budget 9)",
            machine.status_writes
        );
    }
    // Provisioning counts everything up to the seed ISO's removal after the node joined
    // (cloud-init checks included). The listing is shared by all machines of a fleet and
    // refreshed by time as well, so it has a budget of its own: after the clone, after the
    // start, and a few refreshes while one machine alone waits.
    for (which, machine) in [("first", &first), ("second", &second)] {
        assert!(
            machine.listings <= 5,
            "provisioning the {which} machine fetched the listing {} times (budget 5)",
            machine.listings
        );
    }
    for (which, machine, budget) in [("first", &first, 15), ("second", &second, 13)] {
        assert!(
            machine.proxmox <= budget,
            "provisioning the {which} machine made {} Proxmox API calls (budget {budget}): \
             {:#?}\nin this order: {:#?}",
            machine.proxmox,
            machine.proxmox_by_endpoint,
            machine.proxmox_sequence
        );
    }
    assert!(
        deletion <= 6,
        "deletion made {deletion} Proxmox API calls (budget 6): {deletion_calls:#?}"
    );
}

/// No reconcile waits for a Proxmox task: with one worker and clones that take 30 s, every
/// machine's clone is submitted before the first clone ends (the simulator's task records
/// tell, not a clock in the test).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_one_worker_every_clone_is_submitted_before_the_first_one_ends() {
    const MACHINES: usize = 10;
    let env = Env::start_with(SimOptions {
        clone_duration: Duration::from_secs(30),
        ..instant_sim()
    })
    .await;
    // Limits that hold back no clone: what is measured is the reconciles, not capmox's queue.
    let mut cluster = rack_a_cluster();
    cluster["taskLimits"] = json!({"perNode": MACHINES, "perStorage": MACHINES});
    cluster_started_by(&env, cluster, |env| {
        let config = capmox::controller::ManagerConfig {
            machine_concurrency: 1,
            task_timing: Default::default(),
            zone_holds: Default::default(),
            proxmox_requests_in_flight: capmox::proxmox::DEFAULT_REQUESTS_IN_FLIGHT,
            ..crate::common::env::manager_config()
        };
        let context = Arc::new(capmox::controller::Context::new(
            env.client(),
            config,
            capmox::controller::GlobalCredentials::default(),
        ));
        tokio::spawn(capmox::controller::run_controllers(
            context,
            env.stop.clone(),
        ));
        env.run_ipam();
    })
    .await;
    for n in 0..MACHINES {
        env.create_machine(
            "demo",
            &format!("demo-md-{n}"),
            Some("rack-a"),
            false,
            machine_spec(1024),
        )
        .await;
    }
    let clones = || {
        env.sim
            .task_records()
            .into_iter()
            .filter(|t| t.kind == "qmclone")
            .collect::<Vec<_>>()
    };
    let deadline = tokio::time::Instant::now() + crate::common::env::ENV_WAIT;
    while clones().len() < MACHINES && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let clones = clones();
    assert_eq!(
        clones.len(),
        MACHINES,
        "every machine's clone was requested"
    );
    if let Some(first_end) = clones.iter().filter_map(|t| t.ended).min() {
        let late = clones.iter().filter(|t| t.created >= first_end).count();
        assert_eq!(
            late, 0,
            "{late} clones were requested only after the first clone ended"
        );
    }
}

#[tokio::test]
async fn two_machines_scheduled_at_once_never_share_the_last_slot() {
    let env = Env::start_with(instant_sim()).await;
    // Nodes have 64 GiB; with memoryAdjustment 5 each can promise about 3.2 GiB: one 2 GiB VM.
    let mut spec = rack_a_cluster();
    spec["schedulerHints"] = json!({"memoryAdjustment": 5});
    cluster(&env, spec).await;
    let (a, b) = tokio::join!(
        env.create_machine(
            "demo",
            "demo-md-1",
            Some("rack-a"),
            false,
            machine_spec(2048)
        ),
        env.create_machine(
            "demo",
            "demo-md-2",
            Some("rack-a"),
            false,
            machine_spec(2048)
        ),
    );
    let _ = (a, b);
    let first = env
        .wait_machine("demo-md-1", "provisioned", ProxmoxMachine::is_provisioned)
        .await;
    let second = env
        .wait_machine("demo-md-2", "provisioned", ProxmoxMachine::is_provisioned)
        .await;
    let node = |m: &ProxmoxMachine| {
        m.status
            .as_ref()
            .and_then(|s| s.proxmox_node.clone())
            .expect("node")
    };
    assert_ne!(
        node(&first),
        node(&second),
        "both machines took the same node's last slot"
    );
    // A third does not fit anywhere: it waits with a clear reason instead of over-committing.
    env.create_machine(
        "demo",
        "demo-md-3",
        Some("rack-a"),
        false,
        machine_spec(2048),
    )
    .await;
    let waiting = env
        .wait_machine("demo-md-3", "InsufficientMemory", |m| {
            m.status.as_ref().is_some_and(|s| {
                s.conditions
                    .iter()
                    .any(|c| c.reason == "InsufficientMemory")
            })
        })
        .await;
    let message = waiting
        .status
        .and_then(|s| {
            s.conditions
                .into_iter()
                .find(|c| c.reason == "InsufficientMemory")
        })
        .map(|c| c.message)
        .unwrap_or_default();
    assert!(
        message.contains("2147483648") || message.contains("2048"),
        "{message}"
    );
    assert_eq!(
        env.sim.with_cluster(|c| c.vm_count()),
        3,
        "template + two VMs"
    );
}

#[tokio::test]
async fn machines_reconciled_side_by_side_clone_to_different_vmids_at_the_first_try() {
    // A slow clone request: for a second and a half after a reconcile has chosen its VMID,
    // Proxmox still calls it free, as it does while a real clone request is under way.
    let env = Env::start_with(slow_clones(1500, 0.0)).await;
    cluster(&env, rack_a_cluster()).await;
    let names = ["demo-md-1", "demo-md-2", "demo-md-3", "demo-md-4"];
    futures::future::join_all(
        names.iter().map(|name| {
            env.create_machine("demo", name, Some("rack-a"), false, machine_spec(2048))
        }),
    )
    .await;
    let mut vmids = std::collections::BTreeSet::new();
    for name in names {
        let machine = env
            .wait_machine(name, "provisioned", ProxmoxMachine::is_provisioned)
            .await;
        vmids.insert(machine.status.and_then(|s| s.virtual_machine_id));
    }
    assert_eq!(vmids.len(), names.len(), "VMIDs {vmids:?}");
    let clones: Vec<u16> = env
        .sim
        .request_log()
        .iter()
        .filter(|r| r.endpoint == "POST /nodes/{node}/qemu/{vmid}/clone")
        .map(|r| r.status)
        .collect();
    assert_eq!(
        clones,
        vec![200; names.len()],
        "one successful clone request per machine"
    );
    let nextid_calls = env
        .sim
        .request_log()
        .iter()
        .filter(|r| r.endpoint == "GET /cluster/nextid")
        .count();
    // The first free VMID, then one more question per machine already holding one.
    assert!(
        nextid_calls <= names.len() * (names.len() + 1) / 2,
        "{nextid_calls} nextid calls"
    );
}

/// Eight machines reconciled side by side by four workers while every clone request is slow
/// and some hit Proxmox's lock timeout (`can't lock file ... got timeout`, as heavy parallel
/// cloning does): a machine whose clone did not happen keeps the VMID it recorded, so no two
/// ProxmoxMachines ever record the same VMID (watched over the whole run, not only at the
/// end), and Proxmox ends with exactly one VM per machine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_two_machines_ever_record_the_same_vmid_while_clones_fail() {
    let mut options = slow_clones(300, 0.4);
    options.faults.seed = 14;
    let env = Env::start_with(options).await;
    cluster(&env, rack_a_cluster()).await;

    // Every VMID each machine records, as the API server hands out the changes.
    let api = Api::<ProxmoxMachine>::namespaced(env.client(), "default");
    let shared = Arc::new(Mutex::new((
        BTreeMap::<String, i64>::new(),
        Vec::<String>::new(),
    )));
    let seen = shared.clone();
    let watch = tokio::spawn(
        watcher::watcher(api.clone(), watcher::Config::default())
            .applied_objects()
            .for_each(move |machine| {
                let seen = seen.clone();
                async move {
                    let Ok(machine) = machine else { return };
                    let mut seen = seen.lock().expect("not poisoned");
                    let (recorded, clashes) = &mut *seen;
                    let name = machine.name_any();
                    match machine.status.and_then(|s| s.virtual_machine_id) {
                        Some(vmid) => {
                            recorded.insert(name.clone(), vmid);
                        }
                        None => {
                            recorded.remove(&name);
                        }
                    }
                    for (other, vmid) in recorded.iter() {
                        if other != &name && recorded.get(&name) == Some(vmid) {
                            clashes.push(format!("{name} and {other} both record VMID {vmid}"));
                        }
                    }
                }
            }),
    );

    let names: Vec<String> = (1..=8).map(|i| format!("demo-md-{i}")).collect();
    futures::future::join_all(
        names.iter().map(|name| {
            env.create_machine("demo", name, Some("rack-a"), false, machine_spec(2048))
        }),
    )
    .await;
    let mut machines = Vec::new();
    for name in &names {
        machines.push(
            env.wait_machine(name, "provisioned", ProxmoxMachine::is_provisioned)
                .await,
        );
    }
    watch.abort();
    let clashes = shared.lock().expect("not poisoned").1.clone();
    assert!(clashes.is_empty(), "{clashes:#?}");

    let lock_timeouts = env
        .sim
        .request_log()
        .iter()
        .filter(|r| r.endpoint == "POST /nodes/{node}/qemu/{vmid}/clone" && r.status == 500)
        .count();
    assert!(lock_timeouts > 0, "no clone request hit a lock timeout");
    let proxmox = env.proxmox();
    let mut vmids = BTreeSet::new();
    for machine in &machines {
        let status = machine.status.clone().expect("status");
        let vmid = u32::try_from(status.virtual_machine_id.expect("vmid")).expect("fits");
        let node = status.proxmox_node.expect("node");
        let config = proxmox.vm_config(&node, vmid).await.expect("VM exists");
        assert_eq!(config.name(), machine.metadata.name, "VM {vmid}");
        vmids.insert(vmid);
    }
    assert_eq!(vmids.len(), names.len(), "VMIDs {vmids:?}");
    assert_eq!(
        env.sim.with_cluster(|c| c.vm_count()),
        1 + names.len(),
        "the template and one VM per machine"
    );
}

/// A machine whose clone task failed keeps its VMID recorded through its back-off; after a
/// controller restart (a fresh process, no claims in memory) a new machine still gets another
/// VMID, because the new process first claims what the machines have recorded.
#[tokio::test]
async fn a_vmid_recorded_before_a_restart_is_not_handed_to_another_machine() {
    let env = Env::start_with(instant_sim()).await;
    env.run_ipam();
    let first = cluster_started_by(&env, rack_a_cluster(), Env::spawn_controllers).await;

    env.sim
        .with_cluster(|c| c.set_task_failure(Box::new(|kind| kind == "qmclone")));
    env.create_machine(
        "demo",
        "demo-md-1",
        Some("rack-a"),
        false,
        machine_spec(2048),
    )
    .await;
    let (failed, _) = env.wait_machine_reason("demo-md-1", "TaskFailed").await;
    let recorded = failed.status.and_then(|s| s.virtual_machine_id);
    assert!(recorded.is_some(), "the failed clone's VMID stays recorded");
    first.crash().await;
    env.sim.with_cluster(|c| {
        assert_eq!(c.vm_count(), 1, "the failed clone left no VM");
        c.set_task_failure(Box::new(|_| false));
    });

    let _second = env.spawn_controllers();
    env.create_machine(
        "demo",
        "demo-md-2",
        Some("rack-a"),
        false,
        machine_spec(2048),
    )
    .await;
    let other = env
        .wait_machine("demo-md-2", "provisioned", ProxmoxMachine::is_provisioned)
        .await;
    assert_ne!(
        other.status.and_then(|s| s.virtual_machine_id),
        recorded,
        "demo-md-2 got the VMID demo-md-1 recorded"
    );
    let first_machine = Api::<ProxmoxMachine>::namespaced(env.client(), "default")
        .get("demo-md-1")
        .await
        .expect("demo-md-1");
    assert_eq!(
        first_machine.status.and_then(|s| s.virtual_machine_id),
        recorded,
        "demo-md-1 still records it"
    );
}

/// A ProxmoxCluster whose one zone holds pve1 alone, with room for `machines` clones at once.
fn one_node_cluster(machines: usize) -> serde_json::Value {
    let mut cluster = rack_a_cluster();
    cluster["zoneConfig"] = json!([{"zone": "rack-a", "nodes": ["pve1"]}]);
    cluster["taskLimits"] = json!({"perNode": machines, "perStorage": machines});
    cluster
}

/// Provisions `machines` machines on pve1, deletes them all at once and returns the Proxmox
/// calls of the deletion by endpoint, with how many tasks it ran.
async fn delete_side_by_side(env: &Env, machines: usize) -> (BTreeMap<String, u64>, usize) {
    cluster(env, one_node_cluster(machines)).await;
    let templates = env.sim.with_cluster(|c| c.vm_count());
    let names: Vec<String> = (0..machines).map(|n| format!("demo-md-{n}")).collect();
    for name in &names {
        env.create_machine("demo", name, Some("rack-a"), false, machine_spec(1024))
            .await;
    }
    for name in &names {
        env.wait_machine(name, "provisioned", ProxmoxMachine::is_provisioned)
            .await;
    }
    let before = calls_by_endpoint(env);
    let tasks_before = env.sim.task_records().len();
    let api = Api::<ProxmoxMachine>::namespaced(env.client(), "default");
    for name in &names {
        api.delete(name, &DeleteParams::default())
            .await
            .expect("delete");
    }
    let deadline = tokio::time::Instant::now() + crate::common::env::ENV_WAIT;
    while env.sim.with_cluster(|c| c.vm_count()) > templates
        || !api
            .list(&Default::default())
            .await
            .expect("list")
            .items
            .is_empty()
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for the machines and their VMs to be gone"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    (
        calls_since(env, &before),
        env.sim.task_records().len() - tasks_before,
    )
}

fn task_checks(calls: &BTreeMap<String, u64>) -> (u64, u64) {
    let count = |endpoint: &str| calls.get(endpoint).copied().unwrap_or(0);
    (
        count("GET /nodes/{node}/tasks/{upid}/status"),
        count("GET /nodes/{node}/tasks"),
    )
}

/// Machines deleted together on one node have their tasks checked together: one list of the
/// node's tasks answers for every task that ended, so the deletion checks fewer times than it
/// runs tasks.
#[tokio::test]
async fn tasks_of_machines_on_one_node_are_checked_together_from_its_task_list() {
    const MACHINES: usize = 4;
    let env = Env::start_with(instant_sim()).await;
    let (calls, tasks) = delete_side_by_side(&env, MACHINES).await;
    let (one_by_one, lists) = task_checks(&calls);
    assert!(
        lists > 0,
        "the node's task list was never asked for: {calls:#?}"
    );
    assert!(
        tasks >= 2 * MACHINES,
        "a stop and a destroy per machine, {tasks} tasks in all"
    );
    assert!(
        ((one_by_one + lists) as usize) < tasks,
        "{tasks} tasks were checked {one_by_one} times one by one and {lists} times by list: \
         {calls:#?}"
    );
}

/// A Proxmox that refuses the node's task list (a token without the right to list there) costs
/// one refused list per blind period: then tasks are checked one by one, and nothing else changes.
#[tokio::test]
async fn a_refused_task_list_is_asked_for_once_and_tasks_are_checked_one_by_one() {
    const MACHINES: usize = 3;
    let mut options = instant_sim();
    options.faults.rules.push(FaultRule {
        endpoint: "GET /nodes/{node}/tasks".into(),
        error_rate: 1.0,
        error_status: 403,
        error_reason: "Permission check failed (/nodes/pve1, Sys.Audit)".into(),
        drop_rate: 0.0,
        lock_contention_rate: 0.0,
        latency_ms: 0,
    });
    let started = std::time::Instant::now();
    let env = Env::start_with(options).await;
    let (calls, tasks) = delete_side_by_side(&env, MACHINES).await;
    let (one_by_one, _) = task_checks(&calls);
    let lists_in_all = calls_by_endpoint(&env)
        .get("GET /nodes/{node}/tasks")
        .copied()
        .unwrap_or(0);
    // A loaded machine may stretch the test past one blind period: one more list is then due.
    let blind_periods = started.elapsed().as_secs() / BLIND_FOR.as_secs() + 1;
    assert!(
        (1..=blind_periods).contains(&lists_in_all),
        "the refused list was asked for {lists_in_all} times in {blind_periods} blind period(s)"
    );
    assert!(one_by_one > 0, "{tasks} tasks, none checked: {calls:#?}");
}
