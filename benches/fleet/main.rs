//! `make bench`: how quickly capmox makes a fleet of machines ready, and what it costs.
//!
//! One process runs capmox's real controllers (on their own tokio runtime, threads
//! `capmox-ctl`) against the in-process Kubernetes API, the Proxmox VE simulator with realistic
//! task durations and a per-node clone limit, and the CAPI core and IPAM stand-ins (on a second
//! runtime, threads `bench-env`). It provisions a fleet (3 control-plane machines spread over
//! the zones, the rest in one MachineDeployment per zone), waits with nothing to do, deletes the
//! cluster, and reports from measurements only: watch timestamps, the simulator's task records
//! and request log, request counters, and `/proc/self`. Output: a table on stdout and
//! `out/bench.json`. `cargo test --all-targets` runs this binary without `--bench`; it then
//! exits at once.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::Poll;
use std::time::Duration;

use clap::Parser;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, DeleteParams, DynamicObject, PostParams};
use kube::runtime::watcher;
use kube::{Client, ResourceExt};
use serde_json::{Value, json};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use capmox::api::{ProxmoxMachine, labels};
use capmox::capi;
use capmox::controller::{Context, GlobalCredentials, ManagerConfig};
use capmox_sandbox::run::capi_kinds;
use capmox_sandbox::standin::{
    CapiStandIn, ExampleCluster, create_example_cluster, deployment_resource,
};
use capmox_sim::{SimOptions, Simulator, TaskRecord, Topology};
use capmox_testkit::ApiServer;

mod analysis;
use analysis::{
    MachineTimes, classify, covered, lower_bound, proxmox_calls, proxmox_spans, round3,
    service_time, spread, stat_ticks, status_kib, task_vmid,
};

const NAMESPACE: &str = "default";
const CLUSTER: &str = "bench";
/// Thread-name prefixes, so `/proc/self/task/*/stat` splits CPU time between the controllers
/// and everything else in the process.
const CONTROLLER_THREADS: &str = "capmox-ctl";
const ENV_THREADS: &str = "bench-env";

/// Provision and delete a fleet with capmox's controllers against the Proxmox VE simulator.
#[derive(Parser, Debug, Clone)]
#[command(name = "fleet")]
struct Args {
    /// Machines in the fleet: 3 control-plane machines, the rest split over one
    /// MachineDeployment per zone.
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u32).range(3..=1000))]
    machines: u32,
    /// Zones (failure domains), each with its own nodes and IP pool.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=9))]
    zones: u32,
    /// Proxmox nodes per zone; every node holds a copy of the template on local storage.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=50))]
    nodes_per_zone: u32,
    /// Clone tasks that may run at once on a node (0 = unlimited); Proxmox serialises clones
    /// through its storage and config locks.
    #[arg(long, default_value_t = 1)]
    clone_slots: usize,
    /// Clone task duration (ms).
    #[arg(long, default_value_t = 2000)]
    clone_ms: u64,
    /// VM config update task duration (ms).
    #[arg(long, default_value_t = 200)]
    config_ms: u64,
    /// Disk resize task duration (ms).
    #[arg(long, default_value_t = 500)]
    resize_ms: u64,
    /// Cloud-init ISO upload task duration (ms).
    #[arg(long, default_value_t = 300)]
    upload_ms: u64,
    /// VM start task duration (ms).
    #[arg(long, default_value_t = 1000)]
    start_ms: u64,
    /// From the end of the start task until the guest agent answers (ms).
    #[arg(long, default_value_t = 3000)]
    boot_ms: u64,
    /// VM stop task duration (ms).
    #[arg(long, default_value_t = 500)]
    stop_ms: u64,
    /// VM destroy task duration (ms).
    #[arg(long, default_value_t = 500)]
    destroy_ms: u64,
    /// Any other task (volume deletion, shutdown, ...) (ms).
    #[arg(long, default_value_t = 100)]
    other_ms: u64,
    /// ProxmoxMachine reconciles at once (`capmox run --proxmoxmachine-concurrency`).
    #[arg(long, default_value_t = 10)]
    machine_concurrency: u16,
    /// How long to watch the idle process with every machine ready (s).
    #[arg(long, default_value_t = 30)]
    idle_seconds: u64,
    /// Give up on a phase after this long (s).
    #[arg(long, default_value_t = 3600)]
    timeout_seconds: u64,
    /// Where to write the JSON report.
    #[arg(long, default_value = "out/bench.json")]
    output: PathBuf,
    /// Passed by `cargo bench`; without it (as under `cargo test`) the benchmark does not run.
    #[arg(long, hide = true)]
    #[allow(dead_code)] // checked before parsing, in main
    bench: bool,
}

/// Why the benchmark could not finish.
#[derive(Debug, thiserror::Error)]
enum BenchError {
    #[error("cannot start a tokio runtime: {0}")]
    Runtime(std::io::Error),
    #[error("Proxmox simulator: {0}")]
    Simulator(#[from] capmox_sim::SimStartError),
    #[error("simulator topology: {0}")]
    Topology(#[from] capmox_sim::topology::TopologyError),
    #[error("in-process Kubernetes API: {0}")]
    Testkit(String),
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("creating the example cluster: {0}")]
    Example(#[from] capmox_sandbox::standin::StandInError),
    #[error("JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error(
        "{phase}: timed out after {waited:?} ({done} of {expected} machines); raise --timeout-seconds or look at RUST_LOG=info output"
    )]
    Timeout {
        phase: &'static str,
        waited: Duration,
        done: usize,
        expected: usize,
    },
    #[error("cannot read {path}: {source} (the benchmark needs Linux /proc)")]
    Proc {
        path: String,
        source: std::io::Error,
    },
    #[error(
        "the simulator's request log overflowed ({logged} of {counted} requests kept); per-machine attribution would be wrong"
    )]
    LogOverflow { logged: usize, counted: u64 },
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{0}")]
    Inconsistent(String),
}

fn main() -> std::process::ExitCode {
    // `cargo test` runs bench targets without `--bench` (perhaps with libtest flags): skip
    // before parsing, so the test run neither fails nor takes minutes.
    if !std::env::args().any(|a| a == "--bench") {
        println!("fleet: not run without --bench; use `make bench` (cargo bench --bench fleet)");
        return std::process::ExitCode::SUCCESS;
    }
    let args = Args::parse();
    if std::env::var_os("RUST_LOG").is_some() {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .init();
    }
    match run(args) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("fleet: {error}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn runtime(name: &'static str, threads: usize) -> Result<tokio::runtime::Runtime, BenchError> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .thread_name(name)
        // Idle blocking threads would exit and take their CPU time out of /proc/self/task.
        .thread_keep_alive(Duration::from_secs(24 * 3600))
        .enable_all()
        .build()
        .map_err(BenchError::Runtime)
}

fn run(args: Args) -> Result<(), BenchError> {
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let env = runtime(ENV_THREADS, threads)?;
    let controllers = runtime(CONTROLLER_THREADS, threads)?;
    let report = env.block_on(bench(
        &args,
        env.handle().clone(),
        controllers.handle().clone(),
    ))?;
    if let Some(dir) = args.output.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|source| BenchError::Write {
            path: dir.to_path_buf(),
            source,
        })?;
    }
    let text = serde_json::to_string_pretty(&report)?;
    std::fs::write(&args.output, text + "\n").map_err(|source| BenchError::Write {
        path: args.output.clone(),
        source,
    })?;
    println!("{}", render(&report));
    println!("\nJSON report: {}", args.output.display());
    controllers.shutdown_timeout(Duration::from_secs(5));
    env.shutdown_timeout(Duration::from_secs(5));
    Ok(())
}

// ------------------------------------------------------------------ environment

fn sim_options(args: &Args, machines: u32) -> SimOptions {
    let ms = Duration::from_millis;
    SimOptions {
        clone_duration: ms(args.clone_ms),
        task_duration: ms(args.other_ms),
        task_durations: [
            ("qmconfig", args.config_ms),
            ("resize", args.resize_ms),
            ("imgcopy", args.upload_ms),
            ("qmstart", args.start_ms),
            ("qmstop", args.stop_ms),
            ("qmdestroy", args.destroy_ms),
        ]
        .into_iter()
        .map(|(kind, d)| (kind.to_string(), ms(d)))
        .collect(),
        clone_slots_per_node: args.clone_slots,
        boot_delay: ms(args.boot_ms),
        // Every request is kept for per-machine attribution (about 150 per machine).
        request_log_capacity: 100_000 + 1_000 * machines as usize,
        ..SimOptions::default()
    }
}

fn zone_name(zone: u32) -> String {
    format!("zone-{}", (b'a' + zone as u8) as char)
}

fn node_name(zone: u32, node: u32) -> String {
    format!("pve-{}{}", (b'a' + zone as u8) as char, node + 1)
}

/// Nodes with room for the whole fleet, local storage with a copy of the template on every node
/// (same name and tags: copies of one template).
fn topology(args: &Args) -> Result<Topology, BenchError> {
    let nodes = args.zones * args.nodes_per_zone;
    let per_node = args.machines.div_ceil(nodes) as u64 + 2;
    let memory_mib = (per_node * 2048 * 2).max(65536);
    let mut node_specs = Vec::new();
    let mut templates = Vec::new();
    for zone in 0..args.zones {
        for node in 0..args.nodes_per_zone {
            let name = node_name(zone, node);
            let index = zone * args.nodes_per_zone + node;
            node_specs.push(json!({"name": name, "memory_mib": memory_mib, "cores": 64}));
            templates.push(json!({
                "vmid": 9000 + index, "name": "ubuntu-2404-kube", "node": name,
                "tags": ["capmox", "bench"], "storage": "local-lvm", "disk_gib": 10,
                "config": {"agent": "1", "net0": format!("virtio=BC:24:11:00:{:02X}:{:02X},bridge=vmbr0", index / 256, index % 256)}
            }));
        }
    }
    let topology = json!({
        "cluster_name": "bench",
        "nodes": node_specs,
        "storages": [
            {"name": "local", "type": "dir", "content": ["iso", "vztmpl", "snippets"], "size_gib": 4096},
            {"name": "local-lvm", "type": "lvmthin", "content": ["images", "rootdir"], "size_gib": 65536}
        ],
        "templates": templates,
    });
    Ok(Topology::from_yaml(
        &serde_json::to_string(&topology)?,
        "generated bench topology",
    )?)
}

fn cluster_spec(args: &Args) -> Value {
    let all: Vec<String> = (0..args.zones)
        .flat_map(|z| (0..args.nodes_per_zone).map(move |n| node_name(z, n)))
        .collect();
    let zones: Vec<Value> = (0..args.zones)
        .map(|z| {
            let octet = z + 1;
            json!({
                "zone": zone_name(z),
                "nodes": (0..args.nodes_per_zone).map(|n| node_name(z, n)).collect::<Vec<_>>(),
                "dnsServers": [format!("10.{octet}.0.2")],
                "ipv4Config": {"addresses": [format!("10.{octet}.1.1-10.{octet}.15.250")], "prefix": 16, "gateway": format!("10.{octet}.0.1")}
            })
        })
        .collect();
    json!({
        "controlPlaneEndpoint": {"host": "10.0.0.10", "port": 6443},
        "allowedNodes": all,
        "dnsServers": ["10.0.0.2"],
        "ipv4Config": {"addresses": ["10.0.1.1-10.0.15.250"], "prefix": 16, "gateway": "10.0.0.1"},
        "credentialsRef": {"name": "bench-proxmox-credentials"},
        "zoneConfig": zones,
    })
}

fn machine_spec() -> Value {
    json!({
        "templateSelector": {"matchTags": ["capmox", "bench"]},
        "memoryMiB": 2048,
        "numCores": 2,
        "disks": {"bootVolume": {"disk": "scsi0", "sizeGb": 20}},
        "network": {"networkDevices": [{"name": "net0", "bridge": "vmbr0", "defaultIPv4": true}]}
    })
}

/// Workers per zone: as even as possible, the first zones take the remainder.
fn workers_per_zone(args: &Args) -> Vec<i32> {
    let workers = args.machines - 3;
    (0..args.zones)
        .map(|z| (workers / args.zones + u32::from(z < workers % args.zones)) as i32)
        .collect()
}

/// The first zone's MachineDeployment comes with the example cluster; this adds the others,
/// as `clusterctl generate cluster --flavor failure-domains` does.
async fn add_deployment(
    client: &Client,
    example: &ExampleCluster,
    zone: &str,
    replicas: i32,
) -> Result<(), BenchError> {
    let name = format!("{}-{zone}", example.workers_name());
    let object: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "MachineDeployment",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": {labels::CLUSTER_NAME: example.name}},
        "spec": {
            "clusterName": example.name,
            "replicas": replicas,
            "selector": {"matchLabels": {labels::DEPLOYMENT_NAME: name}},
            "template": {
                "metadata": {"labels": {labels::DEPLOYMENT_NAME: name}},
                "spec": {
                    "clusterName": example.name,
                    "version": example.version,
                    "failureDomain": zone,
                    "bootstrap": {"configRef": {"apiGroup": "bootstrap.cluster.x-k8s.io", "kind": "KubeadmConfigTemplate", "name": example.workers_name()}},
                    "infrastructureRef": {"apiGroup": capmox::api::GROUP, "kind": "ProxmoxMachineTemplate", "name": example.workers_name()},
                },
            },
        },
    }))?;
    Api::<DynamicObject>::namespaced_with(client.clone(), NAMESPACE, &deployment_resource())
        .create(&PostParams::default(), &object)
        .await?;
    Ok(())
}

// ------------------------------------------------------------------ Kubernetes request counting

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Requests of capmox's Kubernetes client by (verb, resource).
#[derive(Default)]
struct KubeCounts(Mutex<BTreeMap<(String, String), u64>>);

impl KubeCounts {
    fn record(&self, method: &http::Method, uri: &http::Uri) {
        let key = classify(method, uri);
        *self
            .0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(key)
            .or_default() += 1;
    }

    fn snapshot(&self) -> BTreeMap<(String, String), u64> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// capmox's Kubernetes transport: counts every request, and serves it on the environment
/// runtime so the API server's work is not charged to the controllers' threads.
#[derive(Clone)]
struct Counted<S> {
    inner: S,
    counts: Arc<KubeCounts>,
    env: tokio::runtime::Handle,
}

impl<S, B> tower::Service<http::Request<kube::client::Body>> for Counted<S>
where
    S: tower::Service<http::Request<kube::client::Body>, Response = http::Response<B>>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError> + Send + 'static,
    B: Send + 'static,
{
    type Response = http::Response<B>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut std::task::Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: http::Request<kube::client::Body>) -> Self::Future {
        self.counts.record(req.method(), req.uri());
        let served = self.env.spawn(self.inner.call(req));
        Box::pin(async move {
            match served.await {
                Ok(response) => response.map_err(Into::into),
                Err(join) => Err(Box::new(join) as BoxError),
            }
        })
    }
}

// ------------------------------------------------------------------ timeline

#[derive(Default)]
struct Timeline {
    machines: BTreeMap<String, MachineTimes>,
}

impl Timeline {
    fn ready(&self) -> usize {
        self.machines
            .values()
            .filter(|m| m.ready.is_some() && m.gone.is_none())
            .count()
    }

    fn gone(&self) -> usize {
        self.machines.values().filter(|m| m.gone.is_some()).count()
    }
}

type Shared = Arc<(Mutex<Timeline>, tokio::sync::watch::Sender<u64>)>;

fn note(shared: &Shared, f: impl FnOnce(&mut Timeline)) {
    f(&mut shared.0.lock().unwrap_or_else(|p| p.into_inner()));
    shared.1.send_modify(|n| *n += 1);
}

/// Records when each Machine first appears (the start of its provisioning).
async fn follow_machines(client: Client, shared: Shared) {
    let api: Api<capi::Machine> = Api::namespaced(client, NAMESPACE);
    let mut events = watcher(api, watcher::Config::default()).boxed();
    while let Some(event) = events.next().await {
        if let Ok(watcher::Event::Apply(m) | watcher::Event::InitApply(m)) = event {
            let now = Instant::now();
            note(&shared, |t| {
                let entry = t.machines.entry(m.name_any()).or_default();
                entry.created.get_or_insert(now);
                entry.control_plane = m.labels().contains_key(labels::CONTROL_PLANE);
            });
        }
    }
}

/// Records when each ProxmoxMachine becomes ready, is asked to go, and is gone.
async fn follow_proxmox_machines(client: Client, shared: Shared) {
    let api: Api<ProxmoxMachine> = Api::namespaced(client, NAMESPACE);
    let mut events = watcher(api, watcher::Config::default()).boxed();
    while let Some(event) = events.next().await {
        let now = Instant::now();
        match event {
            Ok(watcher::Event::Apply(pm) | watcher::Event::InitApply(pm)) => note(&shared, |t| {
                let entry = t.machines.entry(pm.name_any()).or_default();
                let status = pm.status.clone().unwrap_or_default();
                if pm.is_provisioned() {
                    entry.ready.get_or_insert(now);
                }
                if let Some(vmid) = status.virtual_machine_id {
                    entry.vmid = u32::try_from(vmid).ok();
                }
                entry.node = status.proxmox_node.or(entry.node.take());
                entry.zone = status.failure_domain.or(entry.zone.take());
                if pm.metadata.deletion_timestamp.is_some() {
                    entry.delete_seen.get_or_insert(now);
                }
            }),
            Ok(watcher::Event::Delete(pm)) => note(&shared, |t| {
                t.machines
                    .entry(pm.name_any())
                    .or_default()
                    .gone
                    .get_or_insert(now);
            }),
            _ => {}
        }
    }
}

async fn wait_for(
    shared: &Shared,
    phase: &'static str,
    expected: usize,
    timeout: Duration,
    done: impl Fn(&Timeline) -> usize,
) -> Result<Instant, BenchError> {
    let mut changes = shared.1.subscribe();
    let started = Instant::now();
    let step = expected.div_ceil(10).max(1);
    let mut reported = 0;
    loop {
        let count = done(&shared.0.lock().unwrap_or_else(|p| p.into_inner()));
        if count >= expected {
            return Ok(Instant::now());
        }
        if count >= reported + step {
            reported = count - count % step;
            eprintln!(
                "fleet: {phase}: {count}/{expected} after {:.1}s",
                started.elapsed().as_secs_f64()
            );
        }
        match tokio::time::timeout_at(started + timeout, changes.changed()).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) | Err(_) => {
                return Err(BenchError::Timeout {
                    phase,
                    waited: started.elapsed(),
                    done: count,
                    expected,
                });
            }
        }
    }
}

// ------------------------------------------------------------------ /proc

#[derive(Clone, Debug, Default)]
struct ProcSample {
    /// utime + stime of the whole process (exited threads included), seconds.
    cpu: f64,
    /// CPU seconds by thread group (controllers, environment, harness).
    groups: BTreeMap<&'static str, f64>,
    rss_kib: u64,
    peak_kib: u64,
}

fn read(path: &str) -> Result<String, BenchError> {
    std::fs::read_to_string(path).map_err(|source| BenchError::Proc {
        path: path.into(),
        source,
    })
}

/// Clock ticks per second, from the kernel's auxiliary vector (`AT_CLKTCK`).
fn clock_ticks() -> Result<f64, BenchError> {
    let auxv = std::fs::read("/proc/self/auxv").map_err(|source| BenchError::Proc {
        path: "/proc/self/auxv".into(),
        source,
    })?;
    const AT_CLKTCK: u64 = 17;
    auxv.chunks_exact(16)
        .map(|pair| {
            let word = |b: &[u8]| u64::from_ne_bytes(b.try_into().unwrap_or([0; 8]));
            (word(&pair[..8]), word(&pair[8..]))
        })
        .find(|(key, _)| *key == AT_CLKTCK)
        .map(|(_, ticks)| ticks as f64)
        .ok_or_else(|| BenchError::Inconsistent("no AT_CLKTCK in /proc/self/auxv".into()))
}

fn sample(ticks: f64) -> Result<ProcSample, BenchError> {
    let (_, total) = stat_ticks(&read("/proc/self/stat")?)
        .ok_or_else(|| BenchError::Inconsistent("unreadable /proc/self/stat".into()))?;
    let mut groups: BTreeMap<&'static str, f64> = BTreeMap::new();
    let tasks = std::fs::read_dir("/proc/self/task").map_err(|source| BenchError::Proc {
        path: "/proc/self/task".into(),
        source,
    })?;
    for task in tasks.flatten() {
        // A thread may exit between listing and reading: skip it.
        let Ok(stat) = std::fs::read_to_string(task.path().join("stat")) else {
            continue;
        };
        if let Some((comm, t)) = stat_ticks(&stat) {
            let group = if comm.starts_with(CONTROLLER_THREADS) {
                "controllers"
            } else if comm.starts_with(ENV_THREADS) {
                "environment"
            } else {
                "harness"
            };
            *groups.entry(group).or_default() += t as f64 / ticks;
        }
    }
    let status = read("/proc/self/status")?;
    Ok(ProcSample {
        cpu: total as f64 / ticks,
        groups,
        rss_kib: status_kib(&status, "VmRSS:"),
        peak_kib: status_kib(&status, "VmHWM:"),
    })
}

/// Resets the peak RSS (VmHWM) to the current RSS, so each phase reports its own peak.
fn reset_peak() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

fn cpu_json(from: &ProcSample, to: &ProcSample) -> Value {
    let mut groups = serde_json::Map::new();
    for (group, seconds) in &to.groups {
        let before = from.groups.get(group).copied().unwrap_or(0.0);
        groups.insert((*group).to_string(), json!(round3(seconds - before)));
    }
    json!({"process": round3(to.cpu - from.cpu), "by_threads": groups})
}

fn mib(kib: u64) -> f64 {
    round3(kib as f64 / 1024.0)
}

// ------------------------------------------------------------------ analysis

fn kube_json(
    before: &BTreeMap<(String, String), u64>,
    after: &BTreeMap<(String, String), u64>,
    machines: usize,
    watches_ended: u64,
) -> Value {
    let mut by_verb: BTreeMap<String, u64> = BTreeMap::new();
    let mut by_resource = serde_json::Map::new();
    for ((verb, resource), count) in after {
        let d = count - before.get(&(verb.clone(), resource.clone())).unwrap_or(&0);
        if d == 0 {
            continue;
        }
        *by_verb.entry(verb.clone()).or_default() += d;
        by_resource.insert(format!("{verb} {resource}"), json!(d));
    }
    let sum = |verbs: &[&str]| -> u64 { verbs.iter().map(|v| by_verb.get(*v).unwrap_or(&0)).sum() };
    let reads = sum(&["get", "list"]);
    let writes = sum(&["create", "update", "patch", "delete"]);
    let watches = sum(&["watch"]);
    let n = machines.max(1) as f64;
    json!({
        "reads": reads, "writes": writes, "watch_requests": watches,
        "watches_restarted_by_server": watches_ended,
        "per_machine": {"reads": round3(reads as f64 / n), "writes": round3(writes as f64 / n),
                        "watch_requests": round3(watches as f64 / n),
                        "watches_restarted": round3(watches_ended as f64 / n)},
        "by_request": by_resource,
    })
}

fn reconciles(context: &Context) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for line in context.metrics.render().lines() {
        let Some(rest) = line.strip_prefix("controller_runtime_reconcile_total{") else {
            continue;
        };
        let Some((labels, value)) = rest.split_once("} ") else {
            continue;
        };
        let label = |key: &str| {
            labels.split(',').find_map(|kv| {
                kv.strip_prefix(key)
                    .and_then(|v| v.strip_prefix("=\""))
                    .map(|v| v.trim_end_matches('"').to_string())
            })
        };
        if let (Some(controller), Some(result), Ok(value)) = (
            label("controller"),
            label("result"),
            value.trim().parse::<f64>(),
        ) {
            *out.entry(format!("{controller} {result}")).or_default() += value as u64;
        }
    }
    out
}

fn diff_counts(before: &BTreeMap<String, u64>, after: &BTreeMap<String, u64>) -> Value {
    after
        .iter()
        .map(|(k, v)| (k.clone(), json!(v - before.get(k).unwrap_or(&0))))
        .collect::<serde_json::Map<_, _>>()
        .into()
}

fn machine_host() -> Value {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find_map(|l| l.strip_prefix("model name"))
                .map(|v| v.trim_start_matches([' ', '\t', ':']).to_string())
        })
        .unwrap_or_default();
    let memory = std::fs::read_to_string("/proc/meminfo")
        .map(|m| status_kib(&m, "MemTotal:"))
        .unwrap_or(0);
    json!({
        "cores": std::thread::available_parallelism().map_or(0, |n| n.get()),
        "memory_mib": memory / 1024,
        "cpu": cpu,
        "kernel": std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default().trim(),
    })
}

// ------------------------------------------------------------------ the run

struct Phase {
    start: Instant,
    log_from: usize,
    kube: BTreeMap<(String, String), u64>,
    proc_: ProcSample,
    reconciles: BTreeMap<String, u64>,
    watches_ended: u64,
}

async fn bench(
    args: &Args,
    env: tokio::runtime::Handle,
    controllers: tokio::runtime::Handle,
) -> Result<Value, BenchError> {
    let ticks = clock_ticks()?;
    let machines = args.machines as usize;
    let timeout = Duration::from_secs(args.timeout_seconds);

    // The in-process API server, as the sandbox sets it up.
    let server = ApiServer::new();
    server.register_builtin_kinds();
    for crd in capmox::api::crd::all().map_err(|e| BenchError::Testkit(e.to_string()))? {
        let yaml =
            capmox::api::crd::to_yaml(&crd).map_err(|e| BenchError::Testkit(e.to_string()))?;
        server
            .register_crd_yaml(&yaml)
            .map_err(|e| BenchError::Testkit(e.to_string()))?;
    }
    for kind in capi_kinds() {
        server.register_kind(kind);
    }
    let topology = topology(args)?;
    let templates: BTreeSet<u32> = topology.templates.iter().map(|t| t.vmid).collect();
    let sim = Simulator::start(topology, sim_options(args, args.machines)).await?;

    // capmox on its own runtime, with a counted transport.
    let counts = Arc::new(KubeCounts::default());
    let capmox_client = Client::new(
        Counted {
            inner: server.service(),
            counts: counts.clone(),
            env: env.clone(),
        },
        NAMESPACE,
    );
    let config = ManagerConfig {
        metrics_address: ([127, 0, 0, 1], 0).into(),
        health_address: ([127, 0, 0, 1], 0).into(),
        leader_election: None,
        watch_namespace: None,
        cluster_concurrency: 4,
        machine_concurrency: args.machine_concurrency,
    };
    let context = Arc::new(Context::new(
        capmox_client,
        config,
        GlobalCredentials::default(),
    ));
    let stop = CancellationToken::new();
    controllers.spawn(capmox::controller::run_controllers(
        context.clone(),
        stop.clone(),
    ));
    tokio::spawn(capmox_sandbox::ipam::run(server.client(), stop.clone()));
    CapiStandIn::spawn(server.client(), NAMESPACE, stop.clone());
    let shared: Shared = Arc::new((Mutex::default(), tokio::sync::watch::channel(0).0));
    tokio::spawn(follow_machines(server.client(), shared.clone()));
    tokio::spawn(follow_proxmox_machines(server.client(), shared.clone()));

    let token = sim.token();
    let (id, secret) = token.split_once('=').unwrap_or((token.as_str(), ""));
    let credentials: Secret = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": "bench-proxmox-credentials", "namespace": NAMESPACE},
        "stringData": {"url": sim.url(), "token": id, "secret": secret}
    }))?;
    Api::<Secret>::namespaced(server.client(), NAMESPACE)
        .create(&PostParams::default(), &credentials)
        .await?;

    let begin = |sim: &Simulator| -> Result<Phase, BenchError> {
        let peak_reset = reset_peak();
        if !peak_reset {
            eprintln!("fleet: cannot reset the peak RSS; peaks are since process start");
        }
        Ok(Phase {
            start: Instant::now(),
            log_from: sim.request_log().len(),
            kube: counts.snapshot(),
            proc_: sample(ticks)?,
            reconciles: reconciles(&context),
            watches_ended: server.request_counts().watches_ended.values().sum(),
        })
    };

    // ---- provisioning
    let zones: Vec<String> = (0..args.zones).map(zone_name).collect();
    let per_zone = workers_per_zone(args);
    eprintln!(
        "fleet: provisioning {machines} machines (3 control plane, workers per zone {per_zone:?}) on {} nodes",
        args.zones * args.nodes_per_zone
    );
    let provision = begin(&sim)?;
    let mut example = ExampleCluster::new(NAMESPACE, CLUSTER, cluster_spec(args), machine_spec());
    example.control_plane_replicas = 3;
    example.worker_replicas = per_zone[0];
    example.worker_failure_domain = Some(zones[0].clone());
    create_example_cluster(&server.client(), &example).await?;
    for (zone, replicas) in zones.iter().zip(&per_zone).skip(1) {
        add_deployment(&server.client(), &example, zone, *replicas).await?;
    }
    let ready_at = wait_for(&shared, "provisioning", machines, timeout, Timeline::ready).await?;
    let provisioned = end_phase(
        &sim, &provision, ready_at, machines, &templates, &shared, &counts, &context, &server,
        ticks, args, false,
    )?;
    eprintln!(
        "fleet: {machines} machines ready in {:.1}s",
        (ready_at - provision.start).as_secs_f64()
    );

    // ---- steady state: everything ready, nothing to do
    let idle = begin(&sim)?;
    tokio::time::sleep(Duration::from_secs(args.idle_seconds)).await;
    let idle_end = sample(ticks)?;
    let idle_log = sim.request_log().len() - idle.log_from;
    let steady = json!({
        "idle_seconds": args.idle_seconds,
        "rss_mib": mib(idle_end.rss_kib),
        "cpu_s": cpu_json(&idle.proc_, &idle_end),
        "proxmox_calls": idle_log,
        "kubernetes_requests": kube_json(&idle.kube, &counts.snapshot(), machines, server.request_counts().watches_ended.values().sum::<u64>() - idle.watches_ended)["by_request"].clone(),
        "reconciles": diff_counts(&idle.reconciles, &reconciles(&context)),
    });

    // ---- deletion
    eprintln!("fleet: deleting the cluster");
    let deletion = begin(&sim)?;
    Api::<capi::Cluster>::namespaced(server.client(), NAMESPACE)
        .delete(CLUSTER, &DeleteParams::default())
        .await?;
    let gone_at = wait_for(&shared, "deletion", machines, timeout, Timeline::gone).await?;
    let deleted = end_phase(
        &sim, &deletion, gone_at, machines, &templates, &shared, &counts, &context, &server, ticks,
        args, true,
    )?;
    let leaked = sim.with_cluster(|c| c.vm_count()) - templates.len();
    if leaked != 0 {
        return Err(BenchError::Inconsistent(format!(
            "{leaked} VMs are left after every ProxmoxMachine is gone"
        )));
    }
    eprintln!(
        "fleet: {machines} machines deleted in {:.1}s",
        (gone_at - deletion.start).as_secs_f64()
    );
    stop.cancel();

    Ok(json!({
        "command": format!("make bench BENCH_ARGS=\"--machines {}\"", args.machines),
        "host": machine_host(),
        "process": "one process: capmox's controllers, the in-process Kubernetes API, the Proxmox VE simulator and the CAPI/IPAM stand-ins; by_threads splits CPU between capmox's runtime (controllers: reconcile logic, Proxmox and Kubernetes clients) and the rest (environment: API server, simulator, stand-ins, the bench's watches)",
        "settings": {
            "machines": args.machines, "zones": args.zones, "nodes_per_zone": args.nodes_per_zone,
            "clone_slots_per_node": args.clone_slots, "machine_concurrency": args.machine_concurrency,
            "task_ms": {"qmclone": args.clone_ms, "qmconfig": args.config_ms, "resize": args.resize_ms,
                        "imgcopy": args.upload_ms, "qmstart": args.start_ms, "boot": args.boot_ms,
                        "qmstop": args.stop_ms, "qmdestroy": args.destroy_ms, "other": args.other_ms},
        },
        "provisioning": provisioned,
        "steady_state": steady,
        "deletion": deleted,
    }))
}

#[allow(clippy::too_many_arguments)] // the phase's inputs, all needed
fn end_phase(
    sim: &Simulator,
    phase: &Phase,
    end: Instant,
    machines: usize,
    templates: &BTreeSet<u32>,
    shared: &Shared,
    counts: &KubeCounts,
    context: &Context,
    server: &ApiServer,
    ticks: f64,
    args: &Args,
    deleting: bool,
) -> Result<Value, BenchError> {
    let proc_end = sample(ticks)?;
    let log = sim.request_log();
    // A full log has dropped its oldest entries (the counters may run a request ahead of the
    // log while one is being recorded, so they are no test).
    if log.len() >= sim_options(args, args.machines).request_log_capacity {
        return Err(BenchError::LogOverflow {
            logged: log.len(),
            counted: sim.counters().values().map(|c| c.calls).sum(),
        });
    }
    let records = sim.task_records();
    let phase_tasks: Vec<&TaskRecord> = records
        .iter()
        .filter(|t| t.created >= phase.start && t.created <= end)
        .collect();
    let mut tasks_of: HashMap<u32, Vec<&TaskRecord>> = HashMap::new();
    let mut upid_vmid = HashMap::new();
    for task in &records {
        if let Some(vmid) = task_vmid(task) {
            upid_vmid.insert(task.upid.clone(), vmid);
        }
    }
    for task in &phase_tasks {
        if let Some(vmid) = task_vmid(task) {
            tasks_of.entry(vmid).or_default().push(task);
        }
    }
    let timeline = shared.0.lock().unwrap_or_else(|p| p.into_inner());
    let mut total = Vec::new();
    let mut proxmox = Vec::new();
    let mut controller = Vec::new();
    let mut path_tasks: HashMap<u32, Vec<&TaskRecord>> = HashMap::new();
    for m in timeline.machines.values() {
        let (from, to) = if deleting {
            (m.delete_seen, m.gone)
        } else {
            (m.created, m.ready)
        };
        let (Some(from), Some(to), Some(vmid)) = (from, to, m.vmid) else {
            continue;
        };
        // The tasks on this machine's path: requested and ended within its window (the ISO
        // removal after the Machine has a node, for one, is not).
        let tasks: Vec<&TaskRecord> = tasks_of
            .get(&vmid)
            .into_iter()
            .flatten()
            .filter(|t| t.created >= from && t.ended.is_some_and(|e| e <= to))
            .copied()
            .collect();
        let on_path = covered(proxmox_spans(&tasks), from, to);
        path_tasks.insert(vmid, tasks);
        let elapsed = to - from;
        total.push(elapsed.as_secs_f64());
        proxmox.push(on_path.as_secs_f64());
        controller.push((elapsed.saturating_sub(on_path)).as_secs_f64());
    }
    if total.len() != machines {
        return Err(BenchError::Inconsistent(format!(
            "timings for {} of {machines} machines",
            total.len()
        )));
    }
    let wall = end - phase.start;
    let (bound, bound_detail) = if deleting {
        let longest = timeline
            .machines
            .values()
            .filter_map(|m| path_tasks.get(&m.vmid?))
            .map(|tasks| service_time(tasks, true))
            .max()
            .unwrap_or_default();
        (
            longest,
            json!({"formula": "longest deletion path (run times of its stop, destroy and ISO removal tasks) of any machine; deletions do not queue"}),
        )
    } else {
        lower_bound(&timeline.machines, &path_tasks, args.clone_slots)
    };
    let mut per_zone: BTreeMap<String, usize> = BTreeMap::new();
    let mut per_node: BTreeMap<String, usize> = BTreeMap::new();
    for m in timeline.machines.values() {
        *per_zone
            .entry(m.zone.clone().unwrap_or_default())
            .or_default() += 1;
        *per_node
            .entry(m.node.clone().unwrap_or_default())
            .or_default() += 1;
    }
    drop(timeline);
    let mut task_kinds: BTreeMap<String, u64> = BTreeMap::new();
    for task in &phase_tasks {
        *task_kinds.entry(task.kind.clone()).or_default() += 1;
    }
    let watches_ended: u64 = server.request_counts().watches_ended.values().sum();
    let slice = &log[phase.log_from.min(log.len())..];
    Ok(json!({
        "machines": machines,
        "wall_s": round3(wall.as_secs_f64()),
        "lower_bound_s": round3(bound.as_secs_f64()),
        "wall_over_lower_bound": round3(wall.as_secs_f64() / bound.as_secs_f64().max(1e-9)),
        "lower_bound": bound_detail,
        "per_machine_s": {
            "elapsed": spread(&total),
            "proxmox_on_path": spread(&proxmox),
            "controller_added": spread(&controller),
        },
        "placement": {"zones": per_zone, "nodes": per_node},
        "proxmox_tasks": task_kinds,
        "proxmox_calls": proxmox_calls(slice, machines, templates, &upid_vmid),
        "kubernetes": kube_json(&phase.kube, &counts.snapshot(), machines, watches_ended - phase.watches_ended),
        "reconciles": diff_counts(&phase.reconciles, &reconciles(context)),
        "cpu_s": cpu_json(&phase.proc_, &proc_end),
        "peak_rss_mib": mib(proc_end.peak_kib),
        "rss_at_end_mib": mib(proc_end.rss_kib),
    }))
}

// ------------------------------------------------------------------ the table

fn render(report: &Value) -> String {
    let p = &report["provisioning"];
    let d = &report["deletion"];
    let s = &report["steady_state"];
    let h = &report["host"];
    let num = |v: &Value| match v {
        Value::Number(n) => {
            let f = n.as_f64().unwrap_or(0.0);
            if f.fract() == 0.0 {
                format!("{f:.0}")
            } else {
                format!("{f:.2}")
            }
        }
        Value::Null => "-".into(),
        other => other.to_string(),
    };
    let mut rows: Vec<(String, String, String)> = Vec::new();
    let mut row = |name: &str, prov: String, del: String| rows.push((name.into(), prov, del));
    row("machines", num(&p["machines"]), num(&d["machines"]));
    row("wall time (s)", num(&p["wall_s"]), num(&d["wall_s"]));
    row(
        "lower bound from simulated tasks (s)",
        num(&p["lower_bound_s"]),
        num(&d["lower_bound_s"]),
    );
    row(
        "wall / lower bound",
        num(&p["wall_over_lower_bound"]),
        num(&d["wall_over_lower_bound"]),
    );
    for (key, label) in [
        ("elapsed", "per machine: elapsed (s)"),
        ("proxmox_on_path", "per machine: Proxmox on path (s)"),
        ("controller_added", "per machine: controller-added (s)"),
    ] {
        let f = |v: &Value| {
            format!(
                "{} / {} / {}",
                num(&v["median"]),
                num(&v["p95"]),
                num(&v["max"])
            )
        };
        row(
            &format!("{label} median/p95/max"),
            f(&p["per_machine_s"][key]),
            f(&d["per_machine_s"][key]),
        );
    }
    row(
        "Proxmox calls per machine: mean / max",
        format!(
            "{} / {}",
            num(&p["proxmox_calls"]["per_machine_mean"]),
            num(&p["proxmox_calls"]["per_machine_max_attributed"])
        ),
        format!(
            "{} / {}",
            num(&d["proxmox_calls"]["per_machine_mean"]),
            num(&d["proxmox_calls"]["per_machine_max_attributed"])
        ),
    );
    let k = |v: &Value| {
        format!(
            "{} / {} / {}",
            num(&v["per_machine"]["reads"]),
            num(&v["per_machine"]["writes"]),
            num(&v["per_machine"]["watches_restarted"])
        )
    };
    row(
        "Kubernetes per machine: reads / writes / watch restarts",
        k(&p["kubernetes"]),
        k(&d["kubernetes"]),
    );
    let cpu = |v: &Value| {
        format!(
            "{} (controllers {})",
            num(&v["process"]),
            num(&v["by_threads"]["controllers"])
        )
    };
    row("CPU time (s)", cpu(&p["cpu_s"]), cpu(&d["cpu_s"]));
    row(
        "peak RSS (MiB)",
        num(&p["peak_rss_mib"]),
        num(&d["peak_rss_mib"]),
    );
    let width = rows.iter().map(|r| r.0.len()).max().unwrap_or(0);
    let pw = rows.iter().map(|r| r.1.len()).max().unwrap_or(0).max(12);
    let mut out = format!(
        "\ncapmox fleet benchmark — {} cores, {} MiB, {}\n\n{:<width$}  {:<pw$}  {}\n",
        num(&h["cores"]),
        num(&h["memory_mib"]),
        h["cpu"].as_str().unwrap_or(""),
        "",
        "provisioning",
        "deletion"
    );
    for (name, prov, del) in rows {
        out.push_str(&format!("{name:<width$}  {prov:<pw$}  {del}\n"));
    }
    out.push_str(&format!(
        "\nsteady state (all ready): RSS {} MiB; idle {} s: CPU {} s (controllers {} s), {} Proxmox calls, reconciles {}\n",
        num(&s["rss_mib"]),
        num(&s["idle_seconds"]),
        num(&s["cpu_s"]["process"]),
        num(&s["cpu_s"]["by_threads"]["controllers"]),
        num(&s["proxmox_calls"]),
        s["reconciles"]
    ));
    out.push_str("\nProxmox calls per provisioning by endpoint (mean, max):\n");
    if let Some(endpoints) = p["proxmox_calls"]["by_endpoint"].as_object() {
        for (endpoint, v) in endpoints {
            out.push_str(&format!(
                "  {endpoint:<58} {:>7} {:>4}\n",
                num(&v["mean"]),
                num(&v["max"])
            ));
        }
    }
    out.push_str("Proxmox calls per deletion by endpoint (mean, max):\n");
    if let Some(endpoints) = d["proxmox_calls"]["by_endpoint"].as_object() {
        for (endpoint, v) in endpoints {
            out.push_str(&format!(
                "  {endpoint:<58} {:>7} {:>4}\n",
                num(&v["mean"]),
                num(&v["max"])
            ));
        }
    }
    out
}
