//! `make bench`: how quickly capmox makes a fleet of machines ready, and what it costs.
//!
//! capmox runs as it is deployed: the real `capmox run` binary (built by `cargo bench` with the
//! bench, in release) in a child process, with global Proxmox credentials, no leader
//! election, and a kubeconfig pointing at the in-process Kubernetes API. The environment stays
//! in this process: the API server (served on 127.0.0.1), the Proxmox VE simulator with
//! realistic task durations and a per-node clone limit, and the CAPI core and IPAM stand-ins.
//! The bench provisions a fleet (3 control-plane machines spread over the zones, the rest in
//! one MachineDeployment per zone), waits with nothing to do, deletes the cluster, and reports
//! from measurements only: watch timestamps, the simulator's task records and request log, the
//! API server's request counters for capmox's client (named by its User-Agent), capmox's
//! `/metrics`, and `/proc/<pid>` of both processes. Output: a table on stdout and
//! `out/bench.json`. With `--sites N` the zones are split over N simulated Proxmox clusters
//! (the node names and template VMIDs of each repeat those of the others), the first reached
//! with capmox's global credentials, every other through `credentialsRef` Secrets on its zones;
//! Proxmox calls are then also reported per site (`proxmox_calls.by_site`). With `--profile
//! realistic` the simulators run capmox-sim's realistic profile (API workers per node and
//! daemon, request latency, drawn task durations, storage locks), and the report adds each
//! machine's time at the Proxmox API, its time-to-ready percentiles, the requests' queueing at
//! the API workers (`api`) and a lower bound that counts the workers and locks. With
//! `--provider go` the Go provider's manager (`--go-manager`) runs instead of capmox, against
//! an API server of its own, with the fleet it can be given ([`go_fleet`]), measured the same
//! way into `out/bench-go.json`. `cargo test --all-targets` runs this binary without
//! `--bench`; it then exits at once.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use clap::Parser;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, PostParams};
use kube::runtime::watcher;
use kube::{Client, ResourceExt};
use serde_json::{Value, json};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use capmox::api::{ProxmoxMachine, labels};
use capmox::capi;
use capmox::controller::machine::TaskTimingPolicy;
use capmox_sandbox::run::capi_kinds;
use capmox_sandbox::standin::{
    CapiStandIn, ExampleCluster, create_example_cluster, deployment_resource,
};
use capmox_sim::{Profile, ProfileName, SimOptions, Simulator, TaskRecord, Topology};
use capmox_testkit::{ApiServer, RequestCounts};

mod analysis;
mod go_fleet;
mod provider_process;
use analysis::{
    MachineTimes, SiteCalls, Sites, VmKey, api_pool_bound, api_queueing, controller_gaps, covered,
    kube_requests, lower_bound, machine_requests, percentiles, proxmox_calls, proxmox_spans,
    reconcile_counts, request_spans, round3, service_time, split_zones, spread, status_kib,
    task_vmid,
};
use go_fleet::{GoNode, GoZone, go_client_name, workers_per_node, zone_of_node};
use provider_process::{
    GoLaunch, Kubeconfig, Launch, ProcSample, ProviderProcess, reset_peak, sample,
};

const NAMESPACE: &str = "default";
const CLUSTER: &str = "bench";
/// The Secret a ProxmoxCluster names with `--credentials-ref`.
const CREDENTIALS_SECRET: &str = "bench-proxmox-credentials";
/// `/proc` name of the bench process itself.
const SELF: &str = "self";

/// Provision and delete a fleet with `capmox run` against the Proxmox VE simulator.
#[derive(Parser, Debug, Clone)]
#[command(name = "fleet")]
struct Args {
    /// Machines in the fleet: 3 control-plane machines, the rest split over one
    /// MachineDeployment per zone.
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u32).range(3..=10000))]
    machines: u32,
    /// Zones (failure domains), each with its own nodes and IP pool; default 3, or one per
    /// site with more sites.
    #[arg(long = "zones", value_parser = clap::value_parser!(u32).range(1..=26))]
    zones_arg: Option<u32>,
    /// The zones in use: `--zones`, else 3 or one per site (set after parsing).
    #[arg(skip)]
    zones: u32,
    /// Proxmox clusters (sites, one simulator each) the zones are split over, the first sites
    /// taking one zone more when they do not divide evenly; the first is reached with capmox's
    /// global credentials, the others through a credentialsRef Secret on each of their zones.
    /// Node names and template VMIDs repeat on every site.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=26))]
    sites: u32,
    /// Proxmox nodes per zone; every node holds a copy of the template on local storage.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=50))]
    nodes_per_zone: u32,
    /// Clone tasks that may run at once on a node (0 = unlimited); Proxmox serialises clones
    /// through its storage and config locks.
    #[arg(long, default_value_t = 1)]
    clone_slots: usize,
    /// Clone and disk tasks capmox lets run at once on a node (the ProxmoxCluster's
    /// `taskLimits.perNode`); unset: not set on the cluster, so capmox's default applies.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=64))]
    node_task_limit: Option<u32>,
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
    /// How capmox times its looks at Proxmox tasks and booting guests (`capmox run
    /// --task-timing`); unset: capmox's default, and the flag is not passed (so a `--capmox`
    /// build from before the flag still starts).
    #[arg(long, value_enum)]
    task_timing: Option<TaskTimingPolicy>,
    /// ProxmoxMachine reconciles at once (`capmox run --proxmoxmachine-concurrency`; its default).
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u16).range(1..))]
    machine_concurrency: u16,
    /// The `capmox` executable to measure (default: the one `cargo bench` built with this
    /// bench), e.g. another commit's build for a comparison.
    #[arg(long)]
    capmox: Option<PathBuf>,
    /// The ProxmoxCluster names a credentials Secret (`credentialsRef`) instead of relying on
    /// capmox's global credentials; every pass then reads the Secret, as in the figures
    /// measured before capmox ran in its own process.
    #[arg(long)]
    credentials_ref: bool,
    /// How long to watch the idle process with every machine ready (s).
    #[arg(long, default_value_t = 30)]
    idle_seconds: u64,
    /// Give up on a phase after this long (s).
    #[arg(long, default_value_t = 3600)]
    timeout_seconds: u64,
    /// How the simulated Proxmox behaves in time: `ideal` answers every request at once and
    /// runs every task for its configured duration; `realistic` serves a few requests at once
    /// per node and daemon with latency, draws task durations around the configured ones (a few
    /// slow), and allocates clones' volumes one at a time per storage (capmox-sim's `profile`).
    #[arg(long, value_enum, default_value_t = ProfileName::Ideal)]
    profile: ProfileName,
    /// Seed of the realistic profile's draws.
    #[arg(long, default_value_t = 1)]
    profile_seed: u64,
    /// Requests each node's pveproxy and pvedaemon serve at once under the realistic profile
    /// (Proxmox's default is 3).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=64))]
    api_workers: Option<u32>,
    /// The provider to measure: capmox (`capmox run`), or the Go provider's manager
    /// (`--go-manager`) on the same simulator, profile and stand-ins, with the fleet it can be
    /// given (one template and MachineDeployment per node; it has no failure domains).
    #[arg(long, value_enum, default_value_t = Provider::Capmox)]
    provider: Provider,
    /// The Go provider's manager executable, built from its v0.9 source (`--provider go`).
    #[arg(long, env = "CAPMOX_BENCH_GO_MANAGER")]
    go_manager: Option<PathBuf>,
    /// A directory of CRD files to serve for the Go provider instead of capmox's (e.g. its
    /// source tree's `config/crd/bases`); capmox's CRDs are a superset of its schemas.
    #[arg(long, env = "CAPMOX_BENCH_GO_CRDS")]
    go_crds: Option<PathBuf>,
    /// Where to write the JSON report (default `out/bench.json`, with `--provider go`
    /// `out/bench-go.json`).
    #[arg(long = "output")]
    output_arg: Option<PathBuf>,
    /// The report's path (set after parsing).
    #[arg(skip)]
    output: PathBuf,
    /// Passed by `cargo bench`; without it (as under `cargo test`) the benchmark does not run.
    #[arg(long, hide = true)]
    #[allow(dead_code)] // checked before parsing, in main
    bench: bool,
}

/// The provider a run measures.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
enum Provider {
    #[default]
    Capmox,
    Go,
}

impl Provider {
    /// How the table and the report name it.
    fn label(self) -> &'static str {
        match self {
            Provider::Capmox => "capmox",
            Provider::Go => "Go provider",
        }
    }
}

/// Why the benchmark could not finish.
#[derive(Debug, thiserror::Error)]
enum BenchError {
    #[error("cannot start a tokio runtime: {0}")]
    Runtime(std::io::Error),
    #[error(
        "cannot start {path}: {source} (capmox: build it with `cargo build --release --bin capmox`, or name one with --capmox; the Go provider: name its manager with --go-manager)"
    )]
    Spawn {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{0}")]
    Provider(String),
    #[error("cannot read the CRDs in {path}: {source}")]
    Crds {
        path: PathBuf,
        source: std::io::Error,
    },
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
        "{phase}: timed out after {waited:?} ({done} of {expected} machines); raise --timeout-seconds or look at RUST_LOG=info output (capmox's log lines are prefixed `capmox:`)"
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
    #[error("{0}")]
    Usage(String),
}

fn main() -> std::process::ExitCode {
    // `cargo test` runs bench targets without `--bench` (perhaps with libtest flags): skip
    // before parsing, so the test run neither fails nor takes minutes.
    if !std::env::args().any(|a| a == "--bench") {
        println!("fleet: not run without --bench; use `make bench` (cargo bench --bench fleet)");
        return std::process::ExitCode::SUCCESS;
    }
    let mut args = Args::parse();
    args.zones = args.zones_arg.unwrap_or(args.sites.max(3));
    args.output = args.output_arg.clone().unwrap_or_else(|| {
        PathBuf::from(match args.provider {
            Provider::Capmox => "out/bench.json",
            Provider::Go => "out/bench-go.json",
        })
    });
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

fn run(args: Args) -> Result<(), BenchError> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(BenchError::Runtime)?;
    let report = runtime.block_on(bench(&args))?;
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
    runtime.shutdown_timeout(Duration::from_secs(5));
    Ok(())
}

// ------------------------------------------------------------------ environment

/// The simulator options of site `site`: every site but the first has a token secret of its
/// own, so a zone reached with another site's credentials fails instead of working by accident.
fn sim_options(args: &Args, machines: u32, site: u32) -> SimOptions {
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
        token_secret: if site == 0 {
            SimOptions::default().token_secret
        } else {
            format!("00000000-0000-4000-8000-{site:012x}")
        },
        profile: profile(args, site),
        ..SimOptions::default()
    }
}

/// Site `site`'s profile: every site draws from a seed of its own.
fn profile(args: &Args, site: u32) -> Profile {
    let mut profile = Profile::named(args.profile, args.profile_seed + u64::from(site));
    if let (Profile::Realistic(realistic), Some(workers)) = (&mut profile, args.api_workers) {
        realistic.api_workers = workers as usize;
    }
    profile
}

/// The API workers per daemon and node under the realistic profile, `None` under the ideal.
fn api_workers(args: &Args) -> Option<usize> {
    profile(args, 0)
        .realistic()
        .map(|realistic| realistic.api_workers)
}

/// The global zone indices of each site ([`split_zones`]).
fn site_zones(args: &Args) -> Vec<Vec<u32>> {
    split_zones(args.zones, args.sites)
}

/// The site of global zone `zone` and its index among the site's zones.
fn zone_place(args: &Args, zone: u32) -> (u32, u32) {
    for (site, zones) in (0..).zip(site_zones(args)) {
        if let Some(local) = zones.iter().position(|z| *z == zone) {
            return (site, local as u32);
        }
    }
    (0, zone)
}

/// The name of site `site` (`site-1`, ...), its key in `proxmox_calls.by_site`.
fn site_name(site: u32) -> String {
    format!("site-{}", site + 1)
}

/// The credentials Secret of site `site` (all but the first).
fn site_secret(site: u32) -> String {
    format!("{CLUSTER}-{}-proxmox-credentials", site_name(site))
}

/// The node names of global zone `zone`: named by the zone's place within its site, so
/// every site has a `pve-a1` (with one site, the names are as they always were).
fn zone_nodes(args: &Args, zone: u32) -> Vec<String> {
    let (_, local) = zone_place(args, zone);
    (0..args.nodes_per_zone)
        .map(|n| node_name(local, n))
        .collect()
}

fn zone_name(zone: u32) -> String {
    format!("zone-{}", (b'a' + zone as u8) as char)
}

fn node_name(zone: u32, node: u32) -> String {
    format!("pve-{}{}", (b'a' + zone as u8) as char, node + 1)
}

/// Site `site`'s nodes (those of its zones) with room for the whole fleet, local storage with
/// a copy of the template on every node (same name and tags: copies of one template; VMIDs
/// from 9000 on every site).
fn topology(args: &Args, site: u32) -> Result<Topology, BenchError> {
    let nodes = args.zones * args.nodes_per_zone;
    let per_node = args.machines.div_ceil(nodes) as u64 + 2;
    let memory_mib = (per_node * 2048 * 2).max(65536);
    let mut node_specs = Vec::new();
    let mut templates = Vec::new();
    let zones = site_zones(args)
        .into_iter()
        .nth(site as usize)
        .unwrap_or_default();
    for local in 0..zones.len() as u32 {
        for node in 0..args.nodes_per_zone {
            let name = node_name(local, node);
            let index = local * args.nodes_per_zone + node;
            node_specs.push(json!({"name": name, "memory_mib": memory_mib, "cores": 64}));
            let mut template = json!({
                "vmid": 9000 + index, "name": "ubuntu-2404-kube", "node": name,
                "tags": ["capmox", "bench"], "storage": "local-lvm", "disk_gib": 10,
                "config": {"agent": "1", "net0": format!("virtio=BC:24:11:00:{:02X}:{:02X},bridge=vmbr0", index / 256, index % 256)}
            });
            if args.provider == Provider::Go {
                // Smaller than the machines, so the Go provider has a configuration to write:
                // with none (a template of the machines' sizes) it marks a machine provisioned
                // right after the clone, its VM never configured, given its ISO or started.
                template["memory_mib"] = json!(go_fleet::TEMPLATE_MEMORY_MIB);
                template["cores"] = json!(go_fleet::TEMPLATE_CORES);
            }
            templates.push(template);
        }
    }
    let topology = json!({
        "cluster_name": if args.sites == 1 { "bench".to_string() } else { format!("bench-{}", site_name(site)) },
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
    // Node names repeat over sites; each is allowed once.
    let mut all: Vec<String> = Vec::new();
    for node in (0..args.zones).flat_map(|z| zone_nodes(args, z)) {
        if !all.contains(&node) {
            all.push(node);
        }
    }
    let zones: Vec<Value> = (0..args.zones)
        .map(|z| {
            let octet = z + 1;
            let mut zone = json!({
                "zone": zone_name(z),
                "nodes": zone_nodes(args, z),
                "dnsServers": [format!("10.{octet}.0.2")],
                "ipv4Config": {"addresses": [format!("10.{octet}.1.1-10.{octet}.15.250")], "prefix": 16, "gateway": format!("10.{octet}.0.1")}
            });
            let (site, _) = zone_place(args, z);
            if site > 0 {
                zone["credentialsRef"] = json!({"name": site_secret(site)});
            }
            zone
        })
        .collect();
    let mut spec = json!({
        "controlPlaneEndpoint": {"host": "10.0.0.10", "port": 6443},
        "allowedNodes": all,
        "dnsServers": ["10.0.0.2"],
        "ipv4Config": {"addresses": ["10.0.1.1-10.0.15.250"], "prefix": 16, "gateway": "10.0.0.1"},
        "zoneConfig": zones,
    });
    if args.credentials_ref {
        spec["credentialsRef"] = json!({"name": CREDENTIALS_SECRET});
    }
    if let Some(limit) = args.node_task_limit {
        spec["taskLimits"] = json!({"perNode": limit});
    }
    spec
}

/// Clones that can run at once on a node: the simulator's slots and capmox's node limit
/// (`--node-task-limit`), whichever is lower; 0: any number.
fn effective_clone_slots(args: &Args) -> usize {
    match (args.clone_slots, args.node_task_limit.map(|l| l as usize)) {
        (sim, None) => sim,
        (0, Some(capmox)) => capmox,
        (sim, Some(capmox)) => sim.min(capmox),
    }
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
/// as `clusterctl generate cluster --flavor failure-domains` does (with the Go provider: one
/// per node, from the node's template, without a failure domain).
async fn add_deployment(
    client: &Client,
    example: &ExampleCluster,
    name: &str,
    template: &str,
    zone: Option<&str>,
    replicas: i32,
) -> Result<(), BenchError> {
    let mut object = json!({
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
                    "bootstrap": {"configRef": {"apiGroup": "bootstrap.cluster.x-k8s.io", "kind": "KubeadmConfigTemplate", "name": example.workers_name()}},
                    "infrastructureRef": {"apiGroup": capmox::api::GROUP, "kind": "ProxmoxMachineTemplate", "name": template},
                },
            },
        },
    });
    if let Some(zone) = zone {
        object["spec"]["template"]["spec"]["failureDomain"] = json!(zone);
    }
    let object: DynamicObject = serde_json::from_value(object)?;
    Api::<DynamicObject>::namespaced_with(client.clone(), NAMESPACE, &deployment_resource())
        .create(&PostParams::default(), &object)
        .await?;
    Ok(())
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

/// Records when each ProxmoxMachine becomes ready, is asked to go, and is gone. The Go
/// provider keeps the VMID in the spec and records no zone: its machine's zone is its node's,
/// from `go_nodes`.
async fn follow_proxmox_machines(client: Client, shared: Shared, go_nodes: Vec<GoNode>) {
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
                if let Some(vmid) = status.virtual_machine_id.or(pm.spec.virtual_machine_id) {
                    entry.vmid = u32::try_from(vmid).ok();
                }
                let node_zone = status
                    .proxmox_node
                    .as_deref()
                    .and_then(|node| zone_of_node(&go_nodes, node))
                    .map(str::to_owned);
                entry.node = status.proxmox_node.or(entry.node.take());
                entry.zone = status.failure_domain.or(node_zone).or(entry.zone.take());
                entry.endpoint = status.proxmox_endpoint.or(entry.endpoint.take());
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

/// How far the simulators got: each task type's ended and created tasks, by type.
fn task_progress(sims: &[Simulator]) -> String {
    let mut by_kind: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    for record in sims.iter().flat_map(Simulator::task_records) {
        let (ended, created) = by_kind.entry(record.kind.clone()).or_default();
        *created += 1;
        *ended += usize::from(record.ended.is_some());
    }
    by_kind
        .iter()
        .map(|(kind, (ended, created))| format!("{kind} {ended} of {created}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The machines reported provisioned whose VM is not running (a provider that skipped its
/// power-on), by name.
fn vms_not_running(shared: &Shared, sims: &[Simulator], sites: &Sites) -> Vec<String> {
    let timeline = shared.0.lock().unwrap_or_else(|p| p.into_inner());
    timeline
        .machines
        .iter()
        .filter(|(_, m)| m.ready.is_some())
        .filter(|(name, m)| {
            let site = sites.of_machine(name, m).unwrap_or_default();
            let running = m.vmid.and_then(|vmid| {
                sims.get(site)
                    .and_then(|sim| sim.with_cluster(|c| c.vm_running(vmid)))
            });
            running != Some(true)
        })
        .map(|(name, _)| name.clone())
        .collect()
}

/// Waits until `done` counts `expected` machines; fails at the timeout or as soon as capmox
/// exits.
async fn wait_for(
    shared: &Shared,
    provider: &mut ProviderProcess,
    phase: &'static str,
    expected: usize,
    timeout: Duration,
    done: impl Fn(&Timeline) -> usize,
) -> Result<Instant, BenchError> {
    let stopped = provider.stopped();
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
        let changed = tokio::select! {
            () = stopped.cancelled() => {
                return Err(provider.failed(&format!("it stopped during {phase} ({count}/{expected} machines)")));
            }
            changed = tokio::time::timeout_at(started + timeout, changes.changed()) => changed,
        };
        match changed {
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

fn mib(kib: u64) -> f64 {
    round3(kib as f64 / 1024.0)
}

/// CPU and memory of a process over a phase: CPU seconds, the peak RSS (since the phase
/// started when `peak_reset`, else since the process started) and the RSS at the end.
fn process_json(from: &ProcSample, to: &ProcSample, peak_reset: bool, machines: usize) -> Value {
    let cpu = to.cpu - from.cpu;
    json!({
        "cpu_s": round3(cpu),
        "cpu_ms_per_machine": round3(cpu * 1000.0 / machines.max(1) as f64),
        "peak_rss_mib": mib(to.peak_kib),
        "peak_since": if peak_reset { "phase start" } else { "process start" },
        "rss_at_end_mib": mib(to.rss_kib),
    })
}

// ------------------------------------------------------------------ analysis

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

/// What the phases measure with, besides the capmox process.
struct Rig<'a> {
    args: &'a Args,
    /// One simulator per site, first site first.
    sims: &'a [Simulator],
    /// The sites' names, endpoints and zones.
    sites: &'a Sites,
    server: &'a ApiServer,
    /// Each site's template VMIDs.
    templates: &'a [BTreeSet<u32>],
    shared: &'a Shared,
    ticks: f64,
    /// The name capmox's requests are counted under in the API server.
    client: &'a str,
}

/// The counters at the start of a phase.
struct Phase {
    start: Instant,
    /// Each site's request log length at the start.
    log_from: Vec<usize>,
    kube: RequestCounts,
    capmox: ProcSample,
    capmox_peak_reset: bool,
    environment: ProcSample,
    environment_peak_reset: bool,
    reconciles: BTreeMap<String, u64>,
}

impl Rig<'_> {
    /// Starts a phase: resets both processes' peak RSS and takes every counter.
    async fn begin(&self, provider: &mut ProviderProcess) -> Result<Phase, BenchError> {
        let pid = provider.pid();
        let start = Instant::now();
        let capmox_peak_reset = reset_peak(&pid);
        let environment_peak_reset = reset_peak(SELF);
        if !capmox_peak_reset || !environment_peak_reset {
            eprintln!(
                "fleet: cannot reset the peak RSS through /proc/<pid>/clear_refs; peaks are since process start"
            );
        }
        Ok(Phase {
            start,
            log_from: self.sims.iter().map(|s| s.request_log().len()).collect(),
            kube: self.server.request_counts_of(self.client),
            reconciles: reconcile_counts(&provider.metrics().await?),
            capmox: sample(&pid, self.ticks)?,
            capmox_peak_reset,
            environment: sample(SELF, self.ticks)?,
            environment_peak_reset,
        })
    }

    /// Both processes' CPU and memory, capmox's Kubernetes requests and reconciles since
    /// `phase` began.
    async fn costs(
        &self,
        provider: &mut ProviderProcess,
        phase: &Phase,
        machines: usize,
    ) -> Result<Value, BenchError> {
        let capmox_now = sample(&provider.pid(), self.ticks)?;
        let environment_now = sample(SELF, self.ticks)?;
        let reconciles = reconcile_counts(&provider.metrics().await?);
        let kube = self.server.request_counts_of(self.client);
        let mut per_controller: BTreeMap<String, u64> = BTreeMap::new();
        for (key, count) in &reconciles {
            let before = phase.reconciles.get(key).copied().unwrap_or(0);
            let controller = key.split(' ').next().unwrap_or_default();
            *per_controller.entry(controller.to_string()).or_default() +=
                count.saturating_sub(before);
        }
        let n = machines.max(1) as f64;
        Ok(json!({
            "kubernetes": kube_requests(&phase.kube, &kube, machines),
            "reconciles": diff_counts(&phase.reconciles, &reconciles),
            "reconciles_per_machine": per_controller
                .iter()
                .map(|(c, total)| (c.clone(), json!(round3(*total as f64 / n))))
                .collect::<serde_json::Map<_, _>>(),
            "capmox_process": process_json(&phase.capmox, &capmox_now, phase.capmox_peak_reset, machines),
            "environment_process": process_json(&phase.environment, &environment_now, phase.environment_peak_reset, machines),
        }))
    }
}

/// Creates the credentials Secret `name` for `sim`.
async fn create_credentials(
    client: &Client,
    name: &str,
    sim: &Simulator,
) -> Result<(), BenchError> {
    let token = sim.token();
    let (token_id, secret) = token.split_once('=').unwrap_or((token.as_str(), ""));
    let credentials: Secret = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "stringData": {"url": sim.url(), "token": token_id, "secret": secret}
    }))?;
    Api::<Secret>::namespaced(client.clone(), NAMESPACE)
        .create(&PostParams::default(), &credentials)
        .await?;
    Ok(())
}

/// The CRDs to serve: capmox's, or for the Go provider those of `--go-crds` when given.
fn crd_documents(args: &Args) -> Result<Vec<String>, BenchError> {
    match (&args.provider, &args.go_crds) {
        (Provider::Go, Some(dir)) => {
            let read_error = |source| BenchError::Crds {
                path: dir.clone(),
                source,
            };
            let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
                .map_err(read_error)?
                .map(|entry| entry.map(|e| e.path()))
                .collect::<Result<_, _>>()
                .map_err(read_error)?;
            files.retain(|f| f.extension().is_some_and(|e| e == "yaml" || e == "yml"));
            files.sort();
            if files.is_empty() {
                return Err(BenchError::Usage(format!(
                    "--go-crds {}: no .yaml files there (the Go provider's CRDs are in its source tree's config/crd/bases)",
                    dir.display()
                )));
            }
            files
                .iter()
                .map(|f| {
                    std::fs::read_to_string(f).map_err(|source| BenchError::Crds {
                        path: f.clone(),
                        source,
                    })
                })
                .collect()
        }
        _ => capmox::api::crd::all()
            .map_err(|e| BenchError::Testkit(e.to_string()))?
            .iter()
            .map(|crd| {
                capmox::api::crd::to_yaml(crd).map_err(|e| BenchError::Testkit(e.to_string()))
            })
            .collect(),
    }
}

/// What only capmox has, refused with `--provider go` rather than silently not measured.
fn check_go_args(args: &Args) -> Result<(), BenchError> {
    let refused = [
        (
            args.sites > 1,
            "--sites (it reaches one Proxmox endpoint with global credentials)",
        ),
        (args.credentials_ref, "--credentials-ref"),
        (args.node_task_limit.is_some(), "--node-task-limit"),
        (args.task_timing.is_some(), "--task-timing"),
        (args.capmox.is_some(), "--capmox"),
    ];
    let named: Vec<&str> = refused
        .iter()
        .filter(|(set, _)| *set)
        .map(|(_, flag)| *flag)
        .collect();
    if !named.is_empty() {
        return Err(BenchError::Usage(format!(
            "--provider go does not take {}",
            named.join(", ")
        )));
    }
    if args.go_manager.is_none() {
        return Err(BenchError::Usage(
            "--provider go needs the Go provider's manager: --go-manager PATH (or CAPMOX_BENCH_GO_MANAGER)".into(),
        ));
    }
    Ok(())
}

/// Starts the provider the run measures: (its process, its executable, the name the API
/// server counts its requests under).
async fn start_provider(
    args: &Args,
    kubeconfig: &std::path::Path,
    sim: &Simulator,
) -> Result<(ProviderProcess, PathBuf, String), BenchError> {
    let token = sim.token();
    let (token_id, secret) = token.split_once('=').unwrap_or((token.as_str(), ""));
    let verbose = std::env::var_os("RUST_LOG").is_some();
    match args.provider {
        Provider::Capmox => {
            let binary = args
                .capmox
                .clone()
                .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_capmox")));
            eprintln!("fleet: starting {} run", binary.display());
            let process = ProviderProcess::start(
                Launch {
                    binary: &binary,
                    kubeconfig,
                    proxmox_url: sim.url(),
                    token_id: token_id.to_string(),
                    secret: secret.to_string(),
                    machine_concurrency: args.machine_concurrency,
                    task_timing: args.task_timing,
                    verbose,
                },
                Duration::from_secs(60),
            )
            .await?;
            // Requests are counted under the product token of capmox's User-Agent.
            let client = capmox::cli::USER_AGENT
                .split('/')
                .next()
                .unwrap_or(capmox::cli::USER_AGENT);
            Ok((process, binary, client.to_string()))
        }
        Provider::Go => {
            let binary = args
                .go_manager
                .clone()
                .ok_or_else(|| BenchError::Usage("--provider go needs --go-manager PATH".into()))?;
            eprintln!(
                "fleet: starting the Go provider's manager {}",
                binary.display()
            );
            let process = ProviderProcess::start_go(
                GoLaunch {
                    binary: &binary,
                    kubeconfig,
                    proxmox_url: sim.url(),
                    token_id: token_id.to_string(),
                    secret: secret.to_string(),
                    verbose,
                },
                Duration::from_secs(60),
            )
            .await?;
            let client = go_client_name(&binary);
            Ok((process, binary, client))
        }
    }
}

/// The nodes of the Go provider's fleet, zone by zone, each with its template copy's VMID
/// (as [`topology`] numbers them).
fn go_nodes(args: &Args) -> Vec<GoNode> {
    (0..args.zones)
        .flat_map(|zone| {
            (0..args.nodes_per_zone).map(move |node| GoNode {
                name: node_name(zone, node),
                zone: zone_name(zone),
                template_vmid: 9000 + zone * args.nodes_per_zone + node,
            })
        })
        .collect()
}

/// The zones' IP pools, as capmox's bench cluster has them ([`cluster_spec`]).
fn go_zones(args: &Args) -> Vec<GoZone> {
    (0..args.zones)
        .map(|zone| {
            let octet = zone + 1;
            GoZone {
                name: zone_name(zone),
                addresses: format!("10.{octet}.1.1-10.{octet}.15.250"),
                prefix: 16,
                gateway: format!("10.{octet}.0.1"),
                dns: format!("10.{octet}.0.2"),
            }
        })
        .collect()
}

/// The Go provider's fleet ([`go_fleet`]): the control plane from the first node's template,
/// the workers from one template and MachineDeployment per node.
async fn create_go_fleet(client: &Client, args: &Args, nodes: &[GoNode]) -> Result<(), BenchError> {
    let control_plane = 3;
    let workers = workers_per_node(args.machines - control_plane, nodes.len(), control_plane);
    let first = nodes
        .first()
        .ok_or_else(|| BenchError::Usage("the fleet needs at least one node".into()))?;
    let mut example = ExampleCluster::new(
        NAMESPACE,
        CLUSTER,
        go_fleet::cluster_spec(nodes, &go_zones(args)),
        go_fleet::machine_spec(first),
    );
    example.control_plane_replicas = control_plane as i32;
    example.worker_replicas = workers[0] as i32;
    create_example_cluster(client, &example).await?;
    let templates = Api::<DynamicObject>::namespaced_with(
        client.clone(),
        NAMESPACE,
        &ApiResource::erase::<capmox::api::ProxmoxMachineTemplate>(&()),
    );
    for (node, count) in nodes.iter().zip(&workers).skip(1) {
        if *count == 0 {
            continue;
        }
        let name = format!("{}-{}", example.workers_name(), node.name);
        let template: DynamicObject = serde_json::from_value(json!({
            "apiVersion": format!("{}/{}", capmox::api::GROUP, capmox::api::VERSION),
            "kind": "ProxmoxMachineTemplate",
            "metadata": {"name": name, "namespace": NAMESPACE, "labels": {labels::CLUSTER_NAME: CLUSTER}},
            "spec": {"template": {"spec": go_fleet::machine_spec(node)}},
        }))?;
        templates.create(&PostParams::default(), &template).await?;
        add_deployment(client, &example, &name, &name, None, *count as i32).await?;
    }
    Ok(())
}

async fn bench(args: &Args) -> Result<Value, BenchError> {
    if args.sites > args.zones {
        return Err(BenchError::Usage(format!(
            "--sites {} needs at least as many zones (--zones {}): every site holds a zone",
            args.sites, args.zones
        )));
    }
    if args.provider == Provider::Go {
        check_go_args(args)?;
    }
    let ticks = clock_ticks()?;
    let machines = args.machines as usize;
    let timeout = Duration::from_secs(args.timeout_seconds);

    // The in-process API server, as the sandbox sets it up, served on 127.0.0.1 for capmox.
    // Only one provider runs per bench process, each against an API server of its own.
    let server = ApiServer::new();
    server.register_builtin_kinds();
    for yaml in crd_documents(args)? {
        server
            .register_crd_yaml(&yaml)
            .map_err(|e| BenchError::Testkit(e.to_string()))?;
    }
    for kind in capi_kinds() {
        server.register_kind(kind);
    }
    let http = server
        .serve_http()
        .await
        .map_err(|e| BenchError::Testkit(e.to_string()))?;
    let kubeconfig = Kubeconfig::write(&http.kubeconfig())?;
    let mut sims = Vec::new();
    let mut templates = Vec::new();
    for site in 0..args.sites {
        let topology = topology(args, site)?;
        templates.push(
            topology
                .templates
                .iter()
                .map(|t| t.vmid)
                .collect::<BTreeSet<u32>>(),
        );
        sims.push(Simulator::start(topology, sim_options(args, args.machines, site)).await?);
    }
    let sites = Sites {
        names: (0..args.sites).map(site_name).collect(),
        urls: sims.iter().map(Simulator::url).collect(),
        zone_site: (0..args.zones)
            .map(|z| (zone_name(z), zone_place(args, z).0 as usize))
            .collect(),
    };
    let sim = &sims[0];
    let (mut provider, binary, client) = start_provider(args, kubeconfig.path(), sim).await?;
    let client = client.as_str();
    let go_nodes = match args.provider {
        Provider::Capmox => Vec::new(),
        Provider::Go => go_nodes(args),
    };

    let stop = CancellationToken::new();
    tokio::spawn(capmox_sandbox::ipam::run(server.client(), stop.clone()));
    CapiStandIn::spawn(server.client(), NAMESPACE, stop.clone());
    let shared: Shared = Arc::new((Mutex::default(), tokio::sync::watch::channel(0).0));
    tokio::spawn(follow_machines(server.client(), shared.clone()));
    tokio::spawn(follow_proxmox_machines(
        server.client(),
        shared.clone(),
        go_nodes.clone(),
    ));

    if args.credentials_ref {
        create_credentials(&server.client(), CREDENTIALS_SECRET, sim).await?;
    }
    for (site, other) in (1..).zip(&sims[1..]) {
        create_credentials(&server.client(), &site_secret(site), other).await?;
    }
    let rig = Rig {
        args,
        sims: &sims,
        sites: &sites,
        server: &server,
        templates: &templates,
        shared: &shared,
        ticks,
        client,
    };

    // ---- provisioning
    let zones: Vec<String> = (0..args.zones).map(zone_name).collect();
    let per_zone = workers_per_zone(args);
    let workers = match args.provider {
        Provider::Capmox => format!("workers per zone {per_zone:?}"),
        Provider::Go => format!(
            "control plane on {}, workers per node {:?}",
            go_nodes.first().map_or("-", |n| n.name.as_str()),
            workers_per_node(args.machines - 3, go_nodes.len(), 3)
        ),
    };
    eprintln!(
        "fleet: provisioning {machines} machines (3 control plane, {workers}) on {} nodes of {} site(s)",
        args.zones * args.nodes_per_zone,
        args.sites
    );
    let provision = rig.begin(&mut provider).await?;
    match args.provider {
        Provider::Capmox => {
            let mut example =
                ExampleCluster::new(NAMESPACE, CLUSTER, cluster_spec(args), machine_spec());
            example.control_plane_replicas = 3;
            example.worker_replicas = per_zone[0];
            example.worker_failure_domain = Some(zones[0].clone());
            create_example_cluster(&server.client(), &example).await?;
            for (zone, replicas) in zones.iter().zip(&per_zone).skip(1) {
                let name = format!("{}-{zone}", example.workers_name());
                add_deployment(
                    &server.client(),
                    &example,
                    &name,
                    &example.workers_name(),
                    Some(zone),
                    *replicas,
                )
                .await?;
            }
        }
        Provider::Go => create_go_fleet(&server.client(), args, &go_nodes).await?,
    }
    let ready_at = wait_for(
        &shared,
        &mut provider,
        "provisioning",
        machines,
        timeout,
        Timeline::ready,
    )
    .await
    .inspect_err(|error| {
        if let BenchError::Timeout { .. } = error {
            eprintln!(
                "fleet: by the timeout the simulator had run these tasks (ended of created): {}",
                task_progress(&sims)
            );
        }
    })?;
    let not_running = vms_not_running(&shared, &sims, &sites);
    let mut provisioned = rig
        .end_phase(&mut provider, &provision, ready_at, machines, false)
        .await?;
    provisioned["ready_with_vm_not_running"] = json!(not_running);
    eprintln!(
        "fleet: {machines} machines ready in {:.1}s",
        (ready_at - provision.start).as_secs_f64()
    );

    // ---- steady state: everything ready, nothing to do
    let idle = rig.begin(&mut provider).await?;
    // The idle window is what is measured, not a wait for something to happen.
    tokio::time::sleep(Duration::from_secs(args.idle_seconds)).await;
    let idle_costs = rig.costs(&mut provider, &idle, machines).await?;
    let idle_calls: Vec<usize> = sims
        .iter()
        .zip(&idle.log_from)
        .map(|(s, from)| s.request_log().len().saturating_sub(*from))
        .collect();
    let steady = json!({
        "idle_seconds": args.idle_seconds,
        "capmox_process": idle_costs["capmox_process"],
        "environment_process": idle_costs["environment_process"],
        "proxmox_calls": idle_calls.iter().sum::<usize>(),
        "proxmox_calls_by_site": sites.names.iter().zip(&idle_calls)
            .map(|(name, n)| (name.clone(), json!(n)))
            .collect::<serde_json::Map<_, _>>(),
        "kubernetes_requests": idle_costs["kubernetes"]["by_request"],
        "reconciles": idle_costs["reconciles"],
    });

    // ---- deletion
    eprintln!("fleet: deleting the cluster");
    let deletion = rig.begin(&mut provider).await?;
    Api::<capi::Cluster>::namespaced(server.client(), NAMESPACE)
        .delete(CLUSTER, &DeleteParams::default())
        .await?;
    let gone_at = wait_for(
        &shared,
        &mut provider,
        "deletion",
        machines,
        timeout,
        Timeline::gone,
    )
    .await?;
    let deleted = rig
        .end_phase(&mut provider, &deletion, gone_at, machines, true)
        .await?;
    for ((site, sim), templates) in (0..).zip(&sims).zip(&templates) {
        let leaked = sim.with_cluster(|c| c.vm_count()) - templates.len();
        if leaked != 0 {
            return Err(BenchError::Inconsistent(format!(
                "{leaked} VMs are left on {} after every ProxmoxMachine is gone",
                site_name(site)
            )));
        }
    }
    eprintln!(
        "fleet: {machines} machines deleted in {:.1}s",
        (gone_at - deletion.start).as_secs_f64()
    );
    stop.cancel();
    drop(provider);

    let mut report = json!({
        "command": bench_command(args),
        "host": machine_host(),
        "provider": provider_json(args, &binary),
        "processes": {
            "capmox_process": match args.provider {
                Provider::Capmox => format!("`{} run` in a child process (global Proxmox credentials, no leader election, --proxmoxmachine-concurrency {}), measured through /proc/<pid> (utime + stime; VmRSS; VmHWM, reset at each phase's start through clear_refs) and its /metrics; its Kubernetes requests are counted by the API server under the User-Agent product token {client:?}", binary.display(), args.machine_concurrency),
                Provider::Go => format!("the Go provider's manager {} in a child process (global Proxmox credentials from PROXMOX_URL/PROXMOX_TOKEN/PROXMOX_SECRET, no leader election, no webhooks, one reconcile at a time per controller as it is built), measured through /proc/<pid> (utime + stime; VmRSS; VmHWM, reset at each phase's start through clear_refs) and its /metrics (diagnostics address, plain HTTP); its Kubernetes requests are counted by the API server under the User-Agent product token {client:?}; the key keeps capmox's name so reports compare field by field", binary.display()),
            },
            "environment_process": "the bench process: the in-process Kubernetes API server (served over HTTP on 127.0.0.1), the Proxmox VE simulator, the CAPI/IPAM stand-ins and the bench's watches, measured through /proc/self",
        },
        "settings": {
            "machines": args.machines, "zones": args.zones, "nodes_per_zone": args.nodes_per_zone,
            "clone_slots_per_node": args.clone_slots,
            "machine_concurrency": match args.provider {
                Provider::Capmox => args.machine_concurrency,
                // controller-runtime's default; the Go provider sets no other.
                Provider::Go => 1,
            },
            "node_task_limit": args.node_task_limit,
            "clones_at_once_per_node": effective_clone_slots(args),
            "task_timing": match args.provider {
                Provider::Capmox => args.task_timing.unwrap_or_default().as_str(),
                // Requeues every 10 s and in-call waits, fixed in its code.
                Provider::Go => "the Go provider's own",
            },
            "credentials": match (args.provider, args.credentials_ref) {
                (Provider::Go, _) => "global (PROXMOX_URL, PROXMOX_TOKEN, PROXMOX_SECRET)",
                (Provider::Capmox, true) => "credentialsRef Secret",
                (Provider::Capmox, false) => "global (capmox run --proxmox-url/--proxmox-token, PROXMOX_SECRET)",
            },
            "sites": args.sites,
            "site_zones": sites.names.iter().zip(site_zones(args))
                .map(|(name, zones)| (name.clone(), json!(zones.into_iter().map(zone_name).collect::<Vec<_>>())))
                .collect::<serde_json::Map<_, _>>(),
            "task_ms": {"qmclone": args.clone_ms, "qmconfig": args.config_ms, "resize": args.resize_ms,
                        "imgcopy": args.upload_ms, "qmstart": args.start_ms, "boot": args.boot_ms,
                        "qmstop": args.stop_ms, "qmdestroy": args.destroy_ms, "other": args.other_ms},
        },
        "provisioning": provisioned,
        "steady_state": steady,
        "deletion": deleted,
    });
    if let Profile::Realistic(realistic) = profile(args, 0) {
        report["settings"]["profile"] = json!({
            "name": args.profile.as_str(), "seed_of_site_1": realistic.seed,
            "api_workers_per_daemon": realistic.api_workers,
        });
    }
    Ok(report)
}

impl Rig<'_> {
    /// The report of a phase that began with `phase` and ended (every machine ready or gone)
    /// at `end`.
    async fn end_phase(
        &self,
        provider: &mut ProviderProcess,
        phase: &Phase,
        end: Instant,
        machines: usize,
        deleting: bool,
    ) -> Result<Value, BenchError> {
        let costs = self.costs(provider, phase, machines).await?;
        // The Go provider reads through its informers' caches: a phase may hold none of its
        // gets or lists, but never no request at all.
        let requests = ["reads", "writes", "watch_requests"]
            .iter()
            .map(|key| costs["kubernetes"][key].as_u64().unwrap_or(0))
            .sum::<u64>();
        if requests == 0 {
            return Err(BenchError::Inconsistent(format!(
                "the API server counted no request of client {:?} in this phase: does the provider's User-Agent start with {:?} (capmox sends {:?}; client-go sends its executable's file name)?",
                self.client,
                self.client,
                capmox::cli::USER_AGENT
            )));
        }
        let (args, shared, sites) = (self.args, self.shared, self.sites);
        let capacity = sim_options(args, args.machines, 0).request_log_capacity;
        let mut logs = Vec::new();
        let mut records = Vec::new();
        for sim in self.sims {
            let log = sim.request_log();
            // A full log has dropped its oldest entries (the counters may run a request ahead of
            // the log while one is being recorded, so they are no test).
            if log.len() >= capacity {
                return Err(BenchError::LogOverflow {
                    logged: log.len(),
                    counted: sim.counters().values().map(|c| c.calls).sum(),
                });
            }
            logs.push(log);
            records.push(sim.task_records());
        }
        let mut phase_tasks: Vec<&TaskRecord> = Vec::new();
        let mut tasks_of: HashMap<VmKey, Vec<&TaskRecord>> = HashMap::new();
        let mut upid_vmid: Vec<HashMap<String, u32>> = vec![HashMap::new(); self.sims.len()];
        for (site, site_records) in records.iter().enumerate() {
            for task in site_records {
                if let Some(vmid) = task_vmid(task) {
                    upid_vmid[site].insert(task.upid.clone(), vmid);
                }
                if task.created >= phase.start && task.created <= end {
                    phase_tasks.push(task);
                    if let Some(vmid) = task_vmid(task) {
                        tasks_of.entry((site, vmid)).or_default().push(task);
                    }
                }
            }
        }
        // Each machine's site: its recorded endpoint, which must be its zone's site.
        let mut timeline_machines = shared
            .0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .machines
            .clone();
        for (name, m) in &mut timeline_machines {
            m.site = sites
                .of_machine(name, m)
                .map_err(BenchError::Inconsistent)?;
        }
        let workers = api_workers(args);
        let phase_logs: Vec<&[capmox_sim::LoggedRequest]> = logs
            .iter()
            .enumerate()
            .map(|(site, log)| {
                let from = phase.log_from.get(site).copied().unwrap_or(0);
                &log[from.min(log.len())..]
            })
            .collect();
        let requests_of = machine_requests(&phase_logs, self.templates, &upid_vmid);
        let mut total = Vec::new();
        let mut proxmox = Vec::new();
        let mut controller = Vec::new();
        let mut api = Vec::new();
        let mut gaps: BTreeMap<String, Vec<f64>> = BTreeMap::new();
        let mut each: Vec<MachineSpent> = Vec::new();
        let mut path_tasks: HashMap<VmKey, Vec<&TaskRecord>> = HashMap::new();
        for (name, m) in &timeline_machines {
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
                .get(&(m.site, vmid))
                .into_iter()
                .flatten()
                .filter(|t| t.created >= from && t.ended.is_some_and(|e| e <= to))
                .copied()
                .collect();
            if !deleting && !tasks.iter().any(|t| t.kind == "qmclone") {
                return Err(BenchError::Inconsistent(format!(
                    "machine {name} (zone {}) is ready, but {} ran no clone of its VM {vmid}: was it created through another site's endpoint?",
                    m.zone.as_deref().unwrap_or("-"),
                    sites.name(m.site)
                )));
            }
            let task_spans = proxmox_spans(&tasks);
            let on_path = covered(task_spans.clone(), from, to);
            // The realistic profile's requests join Proxmox's part: those naming the machine's
            // VM and those that created its tasks (the clone's names the template).
            let with_api = if workers.is_some() {
                let mut spans = task_spans;
                spans.extend(request_spans(
                    requests_of
                        .get(&(m.site, vmid))
                        .into_iter()
                        .flatten()
                        .copied(),
                ));
                spans.extend(request_spans(
                    tasks.iter().filter_map(|t| t.request.as_ref()),
                ));
                covered(spans, from, to)
            } else {
                on_path
            };
            let elapsed = to - from;
            if !deleting {
                let machine_gaps = controller_gaps(&tasks, from, to);
                for (label, gap) in &machine_gaps {
                    gaps.entry(label.clone())
                        .or_default()
                        .push(gap.as_secs_f64());
                }
                each.push(MachineSpent {
                    elapsed,
                    on_path,
                    place: sites.node_label(m.site, m.node.as_deref().unwrap_or_default()),
                    gaps: machine_gaps,
                });
            }
            path_tasks.insert((m.site, vmid), tasks);
            total.push(elapsed.as_secs_f64());
            proxmox.push(on_path.as_secs_f64());
            api.push((with_api - on_path).as_secs_f64());
            controller.push((elapsed.saturating_sub(with_api)).as_secs_f64());
        }
        if total.len() != machines {
            return Err(BenchError::Inconsistent(format!(
                "timings for {} of {machines} machines",
                total.len()
            )));
        }
        let wall = end - phase.start;
        let (bound, bound_detail) = if deleting {
            let longest = timeline_machines
                .values()
                .filter_map(|m| path_tasks.get(&(m.site, m.vmid?)))
                .map(|tasks| service_time(tasks, true))
                .max()
                .unwrap_or_default();
            match workers {
                None => (
                    longest,
                    json!({"formula": "longest deletion path (run times of its stop, destroy and ISO removal tasks) of any machine; deletions do not queue"}),
                ),
                Some(workers) => {
                    let (pool_bound, pools) =
                        api_pool_bound(path_tasks.values().flatten().copied(), workers);
                    (
                        longest.max(pool_bound),
                        json!({"formula": "max(longest deletion path (run times of its stop, destroy and ISO removal tasks and the service of the requests that created them) of any machine, max over API worker pools of task-creating requests' service / workers)",
                               "longest_path_s": round3(longest.as_secs_f64()), "api_pools": pools}),
                    )
                }
            }
        } else {
            lower_bound(
                &timeline_machines,
                &path_tasks,
                effective_clone_slots(args),
                sites,
                workers,
            )
        };
        let mut per_zone: BTreeMap<String, usize> = BTreeMap::new();
        let mut per_node: BTreeMap<String, usize> = BTreeMap::new();
        let mut per_site: Vec<usize> = vec![0; self.sims.len()];
        for m in timeline_machines.values() {
            *per_zone
                .entry(m.zone.clone().unwrap_or_default())
                .or_default() += 1;
            *per_node
                .entry(sites.node_label(m.site, m.node.as_deref().unwrap_or_default()))
                .or_default() += 1;
            if let Some(count) = per_site.get_mut(m.site) {
                *count += 1;
            }
        }
        let mut task_kinds: BTreeMap<String, u64> = BTreeMap::new();
        for task in &phase_tasks {
            *task_kinds.entry(task.kind.clone()).or_default() += 1;
        }
        let site_calls: Vec<SiteCalls> = phase_logs
            .iter()
            .enumerate()
            .map(|(site, log)| SiteCalls {
                name: sites.name(site),
                log,
                machines: per_site[site],
                templates: &self.templates[site],
                upid_vmid: &upid_vmid[site],
            })
            .collect();
        let mut report = json!({
            "machines": machines,
            "wall_s": round3(wall.as_secs_f64()),
            "lower_bound_s": round3(bound.as_secs_f64()),
            "wall_over_lower_bound": round3(wall.as_secs_f64() / bound.as_secs_f64().max(1e-9)),
            "lower_bound": bound_detail,
            "per_machine_s": {
                "elapsed": spread(&total),
                "proxmox_on_path": spread(&proxmox),
                "controller_added": spread(&controller),
                "controller_added_by_gap": gaps
                    .iter()
                    .map(|(label, values)| {
                        let mut v = values.clone();
                        v.resize(total.len().max(v.len()), 0.0);
                        (label.clone(), json!({
                            "mean": round3(v.iter().sum::<f64>() / v.len().max(1) as f64),
                            "median": spread(&v)["median"],
                        }))
                    })
                    .collect::<BTreeMap<_, _>>(),
            },
            "placement": {
                "zones": per_zone,
                "nodes": per_node,
                "sites": sites.names.iter().cloned().zip(per_site.iter().copied()).collect::<BTreeMap<_, _>>(),
            },
            "proxmox_tasks": task_kinds,
            "proxmox_calls": proxmox_calls(&site_calls, machines),
            "kubernetes": costs["kubernetes"],
            "reconciles": costs["reconciles"],
            "reconciles_per_machine": costs["reconciles_per_machine"],
            "capmox_process": costs["capmox_process"],
            "environment_process": costs["environment_process"],
        });
        if !deleting {
            report["per_machine_s"]["slowest_tenth"] = slowest_tenth(each);
        }
        if let Some(workers) = workers {
            report["per_machine_s"]["api_on_path"] = spread(&api);
            report["per_machine_s"]["elapsed_percentiles"] = percentiles(&total);
            let named: Vec<(&str, &[capmox_sim::LoggedRequest])> = phase_logs
                .iter()
                .enumerate()
                .map(|(site, log)| (sites.name(site), *log))
                .collect();
            report["api"] = api_queueing(&named, workers, wall);
        }
        Ok(report)
    }
}

/// One ready machine's time, for [`slowest_tenth`].
struct MachineSpent {
    elapsed: Duration,
    on_path: Duration,
    place: String,
    gaps: Vec<(String, Duration)>,
}

/// Where the slowest tenth of machines spent their time, so a tail can be told from the bulk:
/// Proxmox's part, capmox's gaps by what they followed, and the nodes they landed on.
fn slowest_tenth(mut each: Vec<MachineSpent>) -> Value {
    each.sort_by_key(|m| std::cmp::Reverse(m.elapsed));
    each.truncate(each.len().div_ceil(10));
    let n = each.len().max(1) as f64;
    let mean = |d: Duration| round3(d.as_secs_f64() / n);
    let mut gaps: BTreeMap<String, Duration> = BTreeMap::new();
    let mut nodes: BTreeMap<String, usize> = BTreeMap::new();
    for machine in &each {
        for (label, gap) in &machine.gaps {
            *gaps.entry(label.clone()).or_default() += *gap;
        }
        *nodes.entry(machine.place.clone()).or_default() += 1;
    }
    let mut busiest: Vec<(String, usize)> = nodes.into_iter().collect();
    busiest.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    busiest.truncate(10);
    json!({
        "machines": each.len(),
        "fastest_of_them_s": each.last().map(|m| round3(m.elapsed.as_secs_f64())),
        "mean_elapsed_s": mean(each.iter().map(|m| m.elapsed).sum()),
        "mean_proxmox_on_path_s": mean(each.iter().map(|m| m.on_path).sum()),
        "mean_controller_gap_s": gaps.into_iter().map(|(label, sum)| (label, mean(sum))).collect::<BTreeMap<_, _>>(),
        "most_on_one_node": busiest.into_iter().collect::<BTreeMap<_, _>>(),
    })
}

// ------------------------------------------------------------------ the table

fn render(report: &Value) -> String {
    let p = &report["provisioning"];
    let d = &report["deletion"];
    let s = &report["steady_state"];
    let h = &report["host"];
    // The provider measured: "capmox", or the Go provider.
    let who = report["provider"]["label"].as_str().unwrap_or("capmox");
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
    let tail = &p["per_machine_s"]["slowest_tenth"];
    let widest_gap = tail["mean_controller_gap_s"]
        .as_object()
        .and_then(|gaps| {
            gaps.iter().max_by(|a, b| {
                a.1.as_f64()
                    .unwrap_or(0.0)
                    .total_cmp(&b.1.as_f64().unwrap_or(0.0))
            })
        })
        .map_or_else(
            || "-".to_owned(),
            |(label, s)| format!("{} {label}", num(s)),
        );
    row(
        "slowest tenth: elapsed / Proxmox on path / widest gap (s, means)",
        format!(
            "{} / {} / {widest_gap}",
            num(&tail["mean_elapsed_s"]),
            num(&tail["mean_proxmox_on_path_s"])
        ),
        "-".to_string(),
    );
    let realistic = report["settings"]["profile"]["name"] == "realistic";
    if realistic {
        realistic_rows(&mut row, p, d, &num);
    }
    row(
        "machines ready with their VM not running",
        p["ready_with_vm_not_running"]
            .as_array()
            .map_or_else(|| "-".to_string(), |names| names.len().to_string()),
        "-".to_string(),
    );
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
    // Per site (with more than one): the calls naming its machines' VMs per machine, and the
    // rest (its inventory: cluster and node reads), which a second endpoint adds once.
    if let Some(by_site) = p["proxmox_calls"]["by_site"]
        .as_object()
        .filter(|sites| sites.len() > 1)
    {
        let site = |v: &Value| {
            format!(
                "{} / {} / {} ({} machines)",
                num(&v["per_machine_mean"]),
                num(&v["attributed_per_machine_mean"]),
                num(&v["not_attributable"]),
                num(&v["machines"])
            )
        };
        for (name, v) in by_site {
            row(
                &format!("  {name}: Proxmox calls per machine / on its VMs / inventory total"),
                site(v),
                site(&d["proxmox_calls"]["by_site"][name]),
            );
        }
    }
    let k = |v: &Value| {
        format!(
            "{} / {} / {}",
            num(&v["per_machine"]["reads"]),
            num(&v["per_machine"]["writes"]),
            num(&v["per_machine"]["watches_restarted"])
        )
    };
    row(
        &format!("{who} Kubernetes requests per machine: reads / writes / watch restarts"),
        k(&p["kubernetes"]),
        k(&d["kubernetes"]),
    );
    row(
        &format!("{who} reconciles per machine (ProxmoxMachine)"),
        num(&p["reconciles_per_machine"]["proxmoxmachine"]),
        num(&d["reconciles_per_machine"]["proxmoxmachine"]),
    );
    let cpu = |v: &Value| {
        format!(
            "{} ({} ms/machine)",
            num(&v["cpu_s"]),
            num(&v["cpu_ms_per_machine"])
        )
    };
    row(
        &format!("{who} process: CPU time (s)"),
        cpu(&p["capmox_process"]),
        cpu(&d["capmox_process"]),
    );
    row(
        &format!("{who} process: peak RSS (MiB)"),
        num(&p["capmox_process"]["peak_rss_mib"]),
        num(&d["capmox_process"]["peak_rss_mib"]),
    );
    row(
        &format!("{who} process: RSS at end (MiB)"),
        num(&p["capmox_process"]["rss_at_end_mib"]),
        num(&d["capmox_process"]["rss_at_end_mib"]),
    );
    row(
        "environment process: CPU (s) / peak RSS (MiB)",
        format!(
            "{} / {}",
            num(&p["environment_process"]["cpu_s"]),
            num(&p["environment_process"]["peak_rss_mib"])
        ),
        format!(
            "{} / {}",
            num(&d["environment_process"]["cpu_s"]),
            num(&d["environment_process"]["peak_rss_mib"])
        ),
    );
    let width = rows.iter().map(|r| r.0.len()).max().unwrap_or(0);
    let pw = rows.iter().map(|r| r.1.len()).max().unwrap_or(0).max(12);
    let mut out = format!(
        "\n{who} fleet benchmark — {} cores, {} MiB, {}; task timing: {}{}\n\n{:<width$}  {:<pw$}  {}\n",
        num(&h["cores"]),
        num(&h["memory_mib"]),
        h["cpu"].as_str().unwrap_or(""),
        report["settings"]["task_timing"].as_str().unwrap_or("-"),
        if realistic {
            format!(
                "; profile: realistic (seed {}, {} API workers per daemon)",
                num(&report["settings"]["profile"]["seed_of_site_1"]),
                num(&report["settings"]["profile"]["api_workers_per_daemon"])
            )
        } else {
            String::new()
        },
        "",
        "provisioning",
        "deletion"
    );
    for (name, prov, del) in rows {
        out.push_str(&format!("{name:<width$}  {prov:<pw$}  {del}\n"));
    }
    out.push_str(&format!(
        "\nsteady state (all ready): {who} RSS {} MiB; idle {} s: {who} CPU {} s (environment {} s), {} Proxmox calls, reconciles {}\n",
        num(&s["capmox_process"]["rss_at_end_mib"]),
        num(&s["idle_seconds"]),
        num(&s["capmox_process"]["cpu_s"]),
        num(&s["environment_process"]["cpu_s"]),
        num(&s["proxmox_calls"]),
        s["reconciles"]
    ));
    for (phase, v) in [("provisioning", p), ("deletion", d)] {
        if realistic {
            out.push_str(&format!(
                "{}Proxmox calls per {} by endpoint (mean, max; API worker: mean served ms, mean queued ms):\n",
                if phase == "provisioning" { "\n" } else { "" },
                if phase == "provisioning" { "provisioning" } else { "deletion" }
            ));
        } else {
            out.push_str(&format!(
                "{}Proxmox calls per {} by endpoint (mean, max):\n",
                if phase == "provisioning" { "\n" } else { "" },
                if phase == "provisioning" {
                    "provisioning"
                } else {
                    "deletion"
                }
            ));
        }
        if let Some(endpoints) = v["proxmox_calls"]["by_endpoint"].as_object() {
            for (endpoint, calls) in endpoints {
                out.push_str(&format!(
                    "  {endpoint:<58} {:>7} {:>4}",
                    num(&calls["mean"]),
                    num(&calls["max"])
                ));
                if realistic {
                    let timing = &v["api"]["by_endpoint"][endpoint];
                    out.push_str(&format!(
                        " {:>8} {:>8}",
                        num(&timing["served_ms_mean"]),
                        num(&timing["queued_ms_mean"])
                    ));
                }
                out.push('\n');
            }
        }
    }
    if realistic {
        out.push_str(&busiest_pools(p, "provisioning", &num));
        out.push_str(&busiest_pools(d, "deletion", &num));
    }
    out
}

/// The realistic profile's rows: API time on each machine's path, time to ready (or gone)
/// percentiles, and the requests' queueing at the simulated API workers.
fn realistic_rows(
    row: &mut impl FnMut(&str, String, String),
    p: &Value,
    d: &Value,
    num: &impl Fn(&Value) -> String,
) {
    let three = |v: &Value, keys: [&str; 3]| {
        format!(
            "{} / {} / {}",
            num(&v[keys[0]]),
            num(&v[keys[1]]),
            num(&v[keys[2]])
        )
    };
    let spread = ["median", "p95", "max"];
    row(
        "per machine: Proxmox API on path (s) median/p95/max",
        three(&p["per_machine_s"]["api_on_path"], spread),
        three(&d["per_machine_s"]["api_on_path"], spread),
    );
    row(
        "per machine: time to ready / gone (s) p50/p95/p99",
        three(
            &p["per_machine_s"]["elapsed_percentiles"],
            ["p50", "p95", "p99"],
        ),
        three(
            &d["per_machine_s"]["elapsed_percentiles"],
            ["p50", "p95", "p99"],
        ),
    );
    let waited = |v: &Value| {
        format!(
            "{} of {} ({} s in all)",
            num(&v["api"]["requests_that_waited"]),
            num(&v["api"]["requests"]),
            num(&v["api"]["queued_s"])
        )
    };
    row(
        "API requests that waited for a worker",
        waited(p),
        waited(d),
    );
    row(
        "API wait per request (ms) median/p95/max",
        three(&p["api"]["wait_ms_per_request"], spread),
        three(&d["api"]["wait_ms_per_request"], spread),
    );
    let busiest = |v: &Value| {
        format!(
            "{} ({})",
            num(&v["api"]["busiest_pool"]["utilisation"]),
            v["api"]["busiest_pool"]["pool"].as_str().unwrap_or("-")
        )
    };
    row(
        "busiest API worker pool: utilisation",
        busiest(p),
        busiest(d),
    );
}

/// The phase's API worker pools by work done, the busiest first (at most five).
fn busiest_pools(phase: &Value, name: &str, num: &impl Fn(&Value) -> String) -> String {
    let Some(pools) = phase["api"]["pools"].as_object() else {
        return String::new();
    };
    let mut by_load: Vec<(&String, &Value)> = pools.iter().collect();
    by_load.sort_by(|a, b| {
        b.1["served_s"]
            .as_f64()
            .unwrap_or(0.0)
            .total_cmp(&a.1["served_s"].as_f64().unwrap_or(0.0))
    });
    let mut out = format!(
        "Busiest API worker pools during {name} (requests, busy s, utilisation, queued s, longest wait ms):\n"
    );
    for (pool, v) in by_load.into_iter().take(5) {
        out.push_str(&format!(
            "  {pool:<40} {:>7} {:>8} {:>6} {:>8} {:>8}\n",
            num(&v["requests"]),
            num(&v["served_s"]),
            num(&v["utilisation"]),
            num(&v["queued_s"]),
            num(&v["longest_wait_ms"])
        ));
    }
    out
}

/// Which provider the report measures, and with what fleet.
fn provider_json(args: &Args, binary: &std::path::Path) -> Value {
    match args.provider {
        Provider::Capmox => {
            json!({"name": "capmox", "label": Provider::Capmox.label(), "binary": binary.display().to_string()})
        }
        Provider::Go => json!({
            "name": "go", "label": Provider::Go.label(), "binary": binary.display().to_string(),
            "crds": args.go_crds.as_ref().map_or_else(
                || "capmox's crds/ (a superset of the Go provider's schemas)".to_string(),
                |dir| dir.display().to_string(),
            ),
            "fleet": "one ProxmoxMachineTemplate (sourceNode, templateID of the node's template copy, allowedNodes: [node], network.zone: the node's zone) and one MachineDeployment per node; the 3 control-plane machines from the first node's template; no failure domains (the Go provider v0.9 has none)",
        }),
    }
}

/// The command that repeats this run.
fn bench_command(args: &Args) -> String {
    let sites = if args.sites == 1 {
        String::new()
    } else {
        format!(" --sites {}", args.sites)
    };
    let timing = args
        .task_timing
        .map(|timing| format!(" --task-timing {timing}"))
        .unwrap_or_default();
    let limits = match (args.clone_slots, args.node_task_limit) {
        (1, None) => String::new(),
        (slots, limit) => format!(
            " --clone-slots {slots}{}",
            limit
                .map(|l| format!(" --node-task-limit {l}"))
                .unwrap_or_default()
        ),
    };
    let profile = match args.profile {
        ProfileName::Ideal => String::new(),
        ProfileName::Realistic => format!(
            " --profile realistic{}{}",
            if args.profile_seed == 1 {
                String::new()
            } else {
                format!(" --profile-seed {}", args.profile_seed)
            },
            args.api_workers
                .map(|w| format!(" --api-workers {w}"))
                .unwrap_or_default()
        ),
    };
    let mut zones = args
        .zones_arg
        .map(|zones| format!(" --zones {zones}"))
        .unwrap_or_default();
    if args.nodes_per_zone != 4 {
        zones.push_str(&format!(" --nodes-per-zone {}", args.nodes_per_zone));
    }
    let provider = match args.provider {
        Provider::Capmox => String::new(),
        Provider::Go => format!(
            " --provider go --go-manager {}{}",
            args.go_manager
                .as_ref()
                .map_or_else(|| "PATH".to_string(), |p| p.display().to_string()),
            args.go_crds
                .as_ref()
                .map(|dir| format!(" --go-crds {}", dir.display()))
                .unwrap_or_default()
        ),
    };
    format!(
        "make bench BENCH_ARGS=\"--machines {}{zones}{sites}{timing}{limits}{profile}{provider}\"",
        args.machines
    )
}
