//! The benchmark's arithmetic, kept free of I/O so `tests/bench_analysis.rs` can test it
//! (the bench target itself runs without a test harness).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::time::Instant;

use capmox_sim::{LoggedRequest, RequestTiming, StorageLockHold, TaskRecord};
use capmox_testkit::RequestCounts;

/// Kubernetes requests of one client between two snapshots of its counters in the API
/// server: totals, per machine (reads: get, list; writes: create, update, patch, delete,
/// deletecollection; watch streams the server ended, each of which the client restarts) and
/// by `verb resource`.
pub fn kube_requests(before: &RequestCounts, after: &RequestCounts, machines: usize) -> Value {
    let delta = |now: u64, then: Option<&u64>| now.saturating_sub(then.copied().unwrap_or(0));
    let verb = |v: &str| delta(after.verb(v), before.by_verb.get(v));
    let reads = verb("get") + verb("list");
    let writes = ["create", "update", "patch", "delete", "deletecollection"]
        .iter()
        .map(|v| verb(v))
        .sum::<u64>();
    let watches = verb("watch");
    let restarted: u64 = after
        .watches_ended
        .iter()
        .map(|(reason, n)| delta(*n, before.watches_ended.get(reason)))
        .sum();
    let by_request: serde_json::Map<String, Value> = after
        .by_resource
        .iter()
        .filter_map(|(key, n)| {
            let d = delta(*n, before.by_resource.get(key));
            let (resource, verb) = key;
            let resource = if resource.is_empty() {
                "(discovery)"
            } else {
                resource
            };
            (d > 0).then(|| (format!("{verb} {resource}"), json!(d)))
        })
        .collect();
    let n = machines.max(1) as f64;
    json!({
        "reads": reads, "writes": writes, "watch_requests": watches,
        "watches_restarted_by_server": restarted,
        "per_machine": {"reads": round3(reads as f64 / n), "writes": round3(writes as f64 / n),
                        "watch_requests": round3(watches as f64 / n),
                        "watches_restarted": round3(restarted as f64 / n)},
        "by_request": by_request,
    })
}

/// `controller_runtime_reconcile_total` of a Prometheus exposition, by `controller result`.
pub fn reconcile_counts(metrics: &str) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for line in metrics.lines() {
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

/// What the watches saw of one machine (ProxmoxMachine and Machine share the name).
#[derive(Clone, Debug, Default)]
pub struct MachineTimes {
    pub control_plane: bool,
    pub created: Option<Instant>,
    pub ready: Option<Instant>,
    pub vmid: Option<u32>,
    pub node: Option<String>,
    pub zone: Option<String>,
    /// `status.proxmoxEndpoint`: the Proxmox API the VM was created on.
    pub endpoint: Option<String>,
    /// Index of the site the machine's VM is on, once [`Sites::of_machine`] has said.
    pub site: usize,
    pub delete_seen: Option<Instant>,
    pub gone: Option<Instant>,
}

/// Zones `0..zones` split over `sites` sites in order, as evenly as possible, the first sites
/// taking one more when they do not divide (3 zones on 2 sites: zones 0 and 1, then zone 2).
pub fn split_zones(zones: u32, sites: u32) -> Vec<Vec<u32>> {
    let sites = sites.max(1);
    let mut next = 0;
    (0..sites)
        .map(|site| {
            let count = zones / sites + u32::from(site < zones % sites);
            let these = (next..next + count).collect();
            next += count;
            these
        })
        .collect()
}

/// A VM by site index and VMID: VMIDs (and node names) are only unique within one Proxmox
/// cluster.
pub type VmKey = (usize, u32);

/// The Proxmox clusters of a run (`--sites`), by index: names, endpoints and which zones each
/// holds.
#[derive(Clone, Debug, Default)]
pub struct Sites {
    /// Site names (`site-1`, ...), the keys of `by_site` in the report.
    pub names: Vec<String>,
    /// Each site's Proxmox API (`scheme://host:port`).
    pub urls: Vec<String>,
    /// The site of each zone.
    pub zone_site: BTreeMap<String, usize>,
}

impl Sites {
    /// The site a machine's VM is on: where its recorded endpoint says, which must be its
    /// zone's site; its zone's site while it records none; the only site if there is one.
    pub fn of_machine(&self, name: &str, m: &MachineTimes) -> Result<usize, String> {
        let by_endpoint = match m.endpoint.as_deref() {
            Some(endpoint) => Some(
                self.urls
                    .iter()
                    .position(|u| u.trim_end_matches('/') == endpoint.trim_end_matches('/'))
                    .ok_or_else(|| {
                        format!("machine {name} records endpoint {endpoint}, none of the sites'")
                    })?,
            ),
            None => None,
        };
        let by_zone = m
            .zone
            .as_deref()
            .and_then(|z| self.zone_site.get(z).copied());
        match (by_endpoint, by_zone) {
            (Some(e), Some(z)) if e != z => Err(format!(
                "machine {name} is in zone {} of {} but its VM was created on {}'s endpoint {}",
                m.zone.as_deref().unwrap_or_default(),
                self.name(z),
                self.name(e),
                self.urls.get(e).map_or("?", String::as_str)
            )),
            (Some(site), _) | (None, Some(site)) => Ok(site),
            (None, None) if self.names.len() <= 1 => Ok(0),
            (None, None) => Err(format!(
                "machine {name} records neither an endpoint nor a zone of a site"
            )),
        }
    }

    /// The name of site `index`.
    pub fn name(&self, index: usize) -> &str {
        self.names.get(index).map_or("?", String::as_str)
    }

    /// How a node is named in the report: by itself with one site, as `site/node` with more
    /// (node names repeat over sites).
    pub fn node_label(&self, site: usize, node: &str) -> String {
        if self.names.len() <= 1 {
            node.to_string()
        } else {
            format!("{}/{node}", self.name(site))
        }
    }
}

/// (comm, utime + stime ticks) from a `stat` file; comm may contain spaces and parentheses.
pub fn stat_ticks(stat: &str) -> Option<(String, u64)> {
    let open = stat.find('(')?;
    let close = stat.rfind(')')?;
    let comm = stat.get(open + 1..close)?.to_string();
    let fields: Vec<&str> = stat.get(close + 2..)?.split_whitespace().collect();
    // After the comm: state is field 3, so utime (14) and stime (15) are at 11 and 12.
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some((comm, utime + stime))
}

pub fn status_kib(status: &str, key: &str) -> u64 {
    status
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

pub fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// Median, p95 (nearest rank) and max.
pub fn spread(values: &[f64]) -> Value {
    if values.is_empty() {
        return json!({"median": null, "p95": null, "max": null});
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = |q: f64| v[((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1];
    json!({"median": round3(rank(0.5)), "p95": round3(rank(0.95)), "max": round3(v[v.len() - 1])})
}

/// Total length of the union of intervals, clipped to `[from, to]`.
pub fn covered(mut spans: Vec<(Instant, Instant)>, from: Instant, to: Instant) -> Duration {
    spans.sort();
    let mut total = Duration::ZERO;
    let mut current: Option<(Instant, Instant)> = None;
    for (start, end) in spans {
        let (start, end) = (start.max(from), end.min(to));
        if end <= start {
            continue;
        }
        current = match current {
            Some((s, e)) if start <= e => Some((s, e.max(end))),
            Some((s, e)) => {
                total += e - s;
                Some((start, end))
            }
            None => Some((start, end)),
        };
    }
    if let Some((s, e)) = current {
        total += e - s;
    }
    total
}

/// The guest a task works on: its VMID, or the VMID in its cloud-init ISO's name.
pub fn task_vmid(task: &TaskRecord) -> Option<u32> {
    task.vmid.or_else(|| iso_vmid(task.volume.as_deref()?))
}

/// The VMID whose cloud-init seed ISO this volume is (`local:iso/user-data-<vmid>.iso`).
pub fn iso_vmid(volume: &str) -> Option<u32> {
    let file = volume.rsplit('/').next()?;
    let vmid: u32 = file
        .strip_prefix("user-data-")?
        .strip_suffix(".iso")?
        .parse()
        .ok()?;
    (capmox::cloudinit::seed_iso_name(vmid) == file).then_some(vmid)
}

/// Run time (start to end) of a finished task.
pub fn run_time(task: &TaskRecord) -> Option<Duration> {
    Some(task.ended? - task.started?)
}

/// A task's own run time: without the waits for storage locks other tasks held (the
/// realistic profile's clones; nothing to take away under the ideal profile).
pub fn own_run_time(task: &TaskRecord) -> Duration {
    let waited: Duration = task.storage_locks.iter().map(StorageLockHold::wait).sum();
    run_time(task).unwrap_or_default().saturating_sub(waited)
}

/// How long an API worker took for the request that created the task (zero under the ideal
/// profile, which answers at once).
pub fn request_service(task: &TaskRecord) -> Duration {
    task.request
        .as_ref()
        .map_or(Duration::ZERO, RequestTiming::served)
}

/// Proxmox's part of a machine's path: every task of its guest from its creation to its end
/// (queueing for a clone slot and waits for storage locks included) and the boot until the
/// guest agent answers.
pub fn proxmox_spans(tasks: &[&TaskRecord]) -> Vec<(Instant, Instant)> {
    let mut spans = Vec::new();
    for task in tasks {
        if let Some(end) = task.ended {
            spans.push((task.created, end));
            if let Some(ready) = task.agent_ready {
                spans.push((end, ready));
            }
        }
    }
    spans
}

/// The API's part of a machine's path (realistic profile): each request from its arrival at
/// the simulator (queueing for a worker included) to the worker's end.
pub fn request_spans<'a>(
    requests: impl IntoIterator<Item = &'a RequestTiming>,
) -> Vec<(Instant, Instant)> {
    requests.into_iter().map(|r| (r.arrived, r.ended)).collect()
}

/// Service time of a machine's path without queueing: task run times (without waits for
/// storage locks), the service of the requests that created them, and boot.
pub fn service_time(tasks: &[&TaskRecord], include_clone: bool) -> Duration {
    tasks
        .iter()
        .filter(|t| include_clone || t.kind != "qmclone")
        .map(|t| {
            own_run_time(t)
                + request_service(t)
                + t.agent_ready
                    .zip(t.ended)
                    .map_or(Duration::ZERO, |(ready, end)| ready - end)
        })
        .sum()
}

/// What one node's clones add up to in [`lower_bound`].
#[derive(Clone, Copy)]
struct NodeClones {
    count: usize,
    shortest: Duration,
    total: Duration,
    shortest_tail: Duration,
    shortest_request: Duration,
}

impl Default for NodeClones {
    fn default() -> Self {
        Self {
            count: 0,
            shortest: Duration::MAX,
            total: Duration::ZERO,
            shortest_tail: Duration::MAX,
            shortest_request: Duration::MAX,
        }
    }
}

/// What one storage lock's holds add up to in [`lower_bound`].
#[derive(Clone, Copy)]
struct LockHolds {
    count: usize,
    held: Duration,
    /// The shortest time a holder still needed after its allocations: its copy and its tail.
    shortest_after: Duration,
    shortest_request: Duration,
}

impl Default for LockHolds {
    fn default() -> Self {
        Self {
            count: 0,
            held: Duration::ZERO,
            shortest_after: Duration::MAX,
            shortest_request: Duration::MAX,
        }
    }
}

/// The work of each API worker pool that no run can do without: the requests that created the
/// tasks of `tasks` (one per task); a pool with `workers` workers needs at least their service
/// times over its workers. The largest of these, and the per-pool detail.
pub fn api_pool_bound<'a>(
    tasks: impl IntoIterator<Item = &'a TaskRecord>,
    workers: usize,
) -> (Duration, Value) {
    let mut pools: BTreeMap<&str, (usize, Duration)> = BTreeMap::new();
    for request in tasks.into_iter().filter_map(|t| t.request.as_ref()) {
        let pool = pools.entry(request.pool.as_str()).or_default();
        pool.0 += 1;
        pool.1 += request.served();
    }
    let workers = workers.max(1) as u32;
    let mut bound = Duration::ZERO;
    let detail: serde_json::Map<String, Value> = pools
        .into_iter()
        .map(|(pool, (requests, served))| {
            let pool_bound = served / workers;
            bound = bound.max(pool_bound);
            (
                pool.to_string(),
                json!({"task_requests": requests, "served_s": round3(served.as_secs_f64()),
                       "bound_s": round3(pool_bound.as_secs_f64())}),
            )
        })
        .collect();
    (bound, Value::Object(detail))
}

/// The fleet's lower bound from what the simulator ran, and how it was derived.
///
/// Per node N with `s` clone slots and `n` clones holding a slot there, the last of them
/// cannot end before ceil(n / s) × (shortest clone there), nor before (sum of the clones there)
/// / s, and its machine then still needs its remaining tasks and boot (the shortest such tail
/// among those machines). KubeadmControlPlane creates control-plane machines one after
/// another, so their whole paths add up. The bound is the largest of these. A node is one of a
/// site (node names repeat over sites), and each machine's tasks are those of its VM on its
/// site (`MachineTimes::site`).
///
/// With `api_workers` (the realistic profile's workers per API daemon), clone run times leave
/// out the waits for storage locks, every path starts with the service of the request that
/// created its first task, each request that created a task counts on its path, and two more
/// bounds join: per storage lock, its holds one after another, then the shortest copy and tail
/// of a holder; per API worker pool, [`api_pool_bound`]. Under the ideal profile these add
/// nothing, and the figures and the detail are as they were.
pub fn lower_bound(
    machines: &BTreeMap<String, MachineTimes>,
    tasks_of: &HashMap<VmKey, Vec<&TaskRecord>>,
    slots: usize,
    sites: &Sites,
    api_workers: Option<usize>,
) -> (Duration, Value) {
    let work = FleetWork::gather(machines, tasks_of);
    let (node_bound, nodes) = work.node_bound(slots, sites, api_workers.is_some());
    let bound = work.control_plane.max(node_bound);
    let Some(workers) = api_workers else {
        return (
            bound,
            json!({
                "formula": "max(sum of control-plane paths, max over nodes of ceil(clones/slots) * shortest clone + shortest remaining path)",
                "control_plane_chain_s": round3(work.control_plane.as_secs_f64()),
                "per_node": nodes,
            }),
        );
    };
    let (lock_bound, locks) = work.lock_bound(sites);
    let (pool_bound, pools) = api_pool_bound(work.path_tasks.iter().copied(), workers);
    (
        bound.max(lock_bound).max(pool_bound),
        json!({
            "formula": "max(sum of control-plane paths, max over nodes of shortest clone request + max(ceil(clones/slots) * shortest clone, sum of clones / slots) + shortest remaining path, max over storage locks of shortest clone request + sum of holds + shortest copy and remaining path, max over API worker pools of task-creating requests' service / workers); clone times without lock waits, paths with the service of their task-creating requests",
            "control_plane_chain_s": round3(work.control_plane.as_secs_f64()),
            "per_node": nodes,
            "storage_locks": locks,
            "api_pools": pools,
        }),
    )
}

/// What [`lower_bound`] adds up from the machines' paths.
struct FleetWork<'a> {
    per_node: BTreeMap<(usize, String), NodeClones>,
    per_lock: BTreeMap<(usize, String), LockHolds>,
    control_plane: Duration,
    path_tasks: Vec<&'a TaskRecord>,
}

impl<'a> FleetWork<'a> {
    fn gather(
        machines: &BTreeMap<String, MachineTimes>,
        tasks_of: &HashMap<VmKey, Vec<&'a TaskRecord>>,
    ) -> Self {
        let mut work = Self {
            per_node: BTreeMap::new(),
            per_lock: BTreeMap::new(),
            control_plane: Duration::ZERO,
            path_tasks: Vec::new(),
        };
        for m in machines.values() {
            let Some(tasks) = m.vmid.and_then(|v| tasks_of.get(&(m.site, v))) else {
                continue;
            };
            let Some(clone) = tasks.iter().find(|t| t.kind == "qmclone") else {
                continue;
            };
            work.path_tasks.extend(tasks.iter().copied());
            let clone_run = own_run_time(clone);
            let clone_request = request_service(clone);
            let tail = service_time(tasks, false);
            if m.control_plane {
                work.control_plane += clone_request + clone_run + tail;
            }
            let held: Duration = clone.storage_locks.iter().map(StorageLockHold::held).sum();
            for hold in &clone.storage_locks {
                let entry = work
                    .per_lock
                    .entry((m.site, hold.lock.clone()))
                    .or_default();
                entry.count += 1;
                entry.held += hold.held();
                entry.shortest_after = entry
                    .shortest_after
                    .min(clone_run.saturating_sub(held) + tail);
                entry.shortest_request = entry.shortest_request.min(clone_request);
            }
            let mut slot_nodes = vec![clone.node.clone()];
            if let Some(node) = &m.node
                && *node != clone.node
            {
                slot_nodes.push(node.clone());
            }
            for node in slot_nodes {
                let entry = work.per_node.entry((m.site, node)).or_default();
                entry.count += 1;
                entry.shortest = entry.shortest.min(clone_run);
                entry.total += clone_run;
                entry.shortest_tail = entry.shortest_tail.min(tail);
                entry.shortest_request = entry.shortest_request.min(clone_request);
            }
        }
        work
    }

    /// The largest of the nodes' bounds, and each node's detail (`timed`: the realistic
    /// profile's, with the first request and the clones' sum).
    fn node_bound(&self, slots: usize, sites: &Sites, timed: bool) -> (Duration, Value) {
        let mut nodes = serde_json::Map::new();
        let mut bound = Duration::ZERO;
        for ((site, node), clones) in &self.per_node {
            let waves = if slots == 0 {
                1
            } else {
                clones.count.div_ceil(slots)
            } as u32;
            let mut clone_work = clones.shortest * waves;
            if slots > 0 {
                clone_work = clone_work.max(clones.total / slots as u32);
            }
            let first_request = if timed {
                clones.shortest_request
            } else {
                Duration::ZERO
            };
            let node_bound = first_request + clone_work + clones.shortest_tail;
            bound = bound.max(node_bound);
            let mut detail = json!({"clones": clones.count, "waves": waves,
                   "shortest_clone_s": round3(clones.shortest.as_secs_f64()),
                   "shortest_tail_s": round3(clones.shortest_tail.as_secs_f64()),
                   "bound_s": round3(node_bound.as_secs_f64())});
            if timed {
                detail["clones_total_s"] = json!(round3(clones.total.as_secs_f64()));
                detail["shortest_clone_request_s"] = json!(round3(first_request.as_secs_f64()));
            }
            nodes.insert(sites.node_label(*site, node), detail);
        }
        (bound, Value::Object(nodes))
    }

    /// The largest of the storage locks' bounds, and each lock's detail.
    fn lock_bound(&self, sites: &Sites) -> (Duration, Value) {
        let mut locks = serde_json::Map::new();
        let mut bound = Duration::ZERO;
        for ((site, lock), holds) in &self.per_lock {
            let lock_bound = holds.shortest_request + holds.held + holds.shortest_after;
            bound = bound.max(lock_bound);
            locks.insert(
                sites.node_label(*site, lock),
                json!({"holds": holds.count, "held_s": round3(holds.held.as_secs_f64()),
                       "shortest_after_s": round3(holds.shortest_after.as_secs_f64()),
                       "bound_s": round3(lock_bound.as_secs_f64())}),
            );
        }
        (bound, Value::Object(locks))
    }
}

/// One site's part of a phase's Proxmox requests.
pub struct SiteCalls<'a> {
    /// The site's name (its key in `by_site`).
    pub name: &'a str,
    /// The site simulator's requests of the phase.
    pub log: &'a [LoggedRequest],
    /// Machines whose VM is on this site.
    pub machines: usize,
    /// The site's templates (requests naming them are no machine's).
    pub templates: &'a BTreeSet<u32>,
    /// The VMID of each of the site's tasks, by UPID.
    pub upid_vmid: &'a HashMap<String, u32>,
}

/// The machine's VM a request names: its VMID in the path (not a template's), one of its
/// tasks' UPIDs, its cloud-init ISO.
pub fn request_vmid(
    entry: &LoggedRequest,
    templates: &BTreeSet<u32>,
    upid_vmid: &HashMap<String, u32>,
) -> Option<u32> {
    let segs: Vec<&str> = entry.path.trim_matches('/').split('/').collect();
    match segs.as_slice() {
        ["nodes", _, "qemu", id, ..] => id.parse().ok().filter(|v| !templates.contains(v)),
        ["nodes", _, "tasks", upid, ..] => upid_vmid.get(*upid).copied(),
        ["nodes", _, "storage", _, "content", volume @ ..] => iso_vmid(&volume.join("/")),
        _ => None,
    }
}

/// The timed requests (realistic profile) of each machine's VM in the phase's logs, one per
/// site: those naming its VM, its tasks' UPIDs or its ISO ([`request_vmid`]).
pub fn machine_requests<'a>(
    logs: &[&'a [LoggedRequest]],
    templates: &[BTreeSet<u32>],
    upid_vmid: &[HashMap<String, u32>],
) -> HashMap<VmKey, Vec<&'a RequestTiming>> {
    let mut requests: HashMap<VmKey, Vec<&RequestTiming>> = HashMap::new();
    for (site, log) in logs.iter().enumerate() {
        let (Some(templates), Some(upids)) = (templates.get(site), upid_vmid.get(site)) else {
            continue;
        };
        for entry in log.iter() {
            if let (Some(timing), Some(vmid)) =
                (&entry.timing, request_vmid(entry, templates, upids))
            {
                requests.entry((site, vmid)).or_default().push(timing);
            }
        }
    }
    requests
}

/// Proxmox requests of a phase over every site: by endpoint (total, mean and max per
/// machine, a machine being a VM of one site) and per machine over all sites, and `by_site`:
/// each site's calls, the machines placed there and its calls per machine, split into those
/// that name one of its machines' VMs and the rest (its inventory: cluster and node reads).
pub fn proxmox_calls(sites: &[SiteCalls], machines: usize) -> Value {
    let mut by_endpoint: BTreeMap<&str, (u64, u64, BTreeMap<VmKey, u64>)> = BTreeMap::new();
    let mut errors: BTreeMap<&str, u64> = BTreeMap::new();
    let mut per_machine: BTreeMap<VmKey, u64> = BTreeMap::new();
    let mut by_site = serde_json::Map::new();
    for (index, site) in sites.iter().enumerate() {
        let mut site_attributed = 0u64;
        for entry in site.log {
            let vmid = request_vmid(entry, site.templates, site.upid_vmid);
            if !(200..300).contains(&entry.status) {
                *errors.entry(entry.endpoint.as_str()).or_default() += 1;
            }
            let e = by_endpoint.entry(entry.endpoint.as_str()).or_default();
            e.0 += 1;
            match vmid {
                Some(v) => {
                    *e.2.entry((index, v)).or_default() += 1;
                    *per_machine.entry((index, v)).or_default() += 1;
                    site_attributed += 1;
                }
                None => e.1 += 1,
            }
        }
        let total = site.log.len() as u64;
        let n = site.machines.max(1) as f64;
        by_site.insert(
            site.name.to_string(),
            json!({
                "machines": site.machines,
                "total": total,
                "per_machine_mean": round3(total as f64 / n),
                "attributed_per_machine_mean": round3(site_attributed as f64 / n),
                "not_attributable": total - site_attributed,
            }),
        );
    }
    let n = machines.max(1) as f64;
    let endpoints: serde_json::Map<String, Value> = by_endpoint
        .into_iter()
        .map(|(endpoint, (total, unattributed, per))| {
            let max = (unattributed == 0).then(|| per.values().copied().max().unwrap_or(0));
            (
                endpoint.to_string(),
                json!({"total": total, "mean": round3(total as f64 / n), "max": max,
                       "errors": errors.get(endpoint).copied().unwrap_or(0)}),
            )
        })
        .collect();
    let total: u64 = sites.iter().map(|s| s.log.len() as u64).sum();
    let attributed: u64 = per_machine.values().sum();
    json!({
        "total": total,
        "per_machine_mean": round3(total as f64 / n),
        "per_machine_max_attributed": per_machine.values().copied().max().unwrap_or(0),
        "not_attributable": total - attributed,
        "by_endpoint": endpoints,
        "by_site": by_site,
    })
}

/// A machine's controller-added time split by where it falls: before its first task, after
/// each task (by the task's type) until the next one was requested (under the realistic
/// profile: until its request reached the simulator), and after the boot until the machine was
/// ready. The parts add up to the controller-added time when tasks do not overlap.
pub fn controller_gaps(
    tasks: &[&TaskRecord],
    from: Instant,
    to: Instant,
) -> Vec<(String, Duration)> {
    let requested = |t: &TaskRecord| t.request.as_ref().map_or(t.created, |r| r.arrived);
    let mut path: Vec<&TaskRecord> = tasks
        .iter()
        .copied()
        .filter(|t| t.ended.is_some())
        .collect();
    path.sort_by_key(|t| requested(t));
    let mut gaps = Vec::new();
    let mut since = from;
    let mut after = "before the first task".to_owned();
    for task in path {
        let start = requested(task).clamp(from, to);
        if start > since {
            gaps.push((after.clone(), start - since));
        }
        let end = task
            .agent_ready
            .or(task.ended)
            .unwrap_or(start)
            .clamp(from, to);
        if end > since {
            since = end;
            after = if task.agent_ready.is_some() {
                "after the boot".to_owned()
            } else {
                format!("after {}", task.kind)
            };
        }
    }
    if to > since {
        gaps.push((after, to - since));
    }
    gaps
}

/// Nearest-rank percentiles p50, p95 and p99.
pub fn percentiles(values: &[f64]) -> Value {
    if values.is_empty() {
        return json!({"p50": null, "p95": null, "p99": null});
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = |q: f64| v[((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1];
    json!({"p50": round3(rank(0.5)), "p95": round3(rank(0.95)), "p99": round3(rank(0.99))})
}

/// One API worker pool's requests in [`api_queueing`].
#[derive(Default)]
struct PoolLoad {
    requests: u64,
    served: Duration,
    queued: Duration,
    longest_wait: Duration,
}

/// What a phase's requests waited for and took at the simulators' API workers (realistic
/// profile), from the request logs of each site: totals, each request's wait, each worker
/// pool's load (`utilisation`: its workers' busy share of `wall`) and each endpoint's.
pub fn api_queueing(sites: &[(&str, &[LoggedRequest])], workers: usize, wall: Duration) -> Value {
    let mut pools: BTreeMap<String, PoolLoad> = BTreeMap::new();
    let mut endpoints: BTreeMap<&str, PoolLoad> = BTreeMap::new();
    let mut waits_ms = Vec::new();
    let several = sites.len() > 1;
    for (site, log) in sites {
        for entry in log.iter() {
            let Some(timing) = &entry.timing else {
                continue;
            };
            let name = if several {
                format!("{site}/{}", timing.pool)
            } else {
                timing.pool.clone()
            };
            for load in [
                pools.entry(name).or_default(),
                endpoints.entry(entry.endpoint.as_str()).or_default(),
            ] {
                load.requests += 1;
                load.served += timing.served();
                load.queued += timing.queued();
                load.longest_wait = load.longest_wait.max(timing.queued());
            }
            waits_ms.push(timing.queued().as_secs_f64() * 1000.0);
        }
    }
    let capacity = wall.as_secs_f64() * workers.max(1) as f64;
    let ms = |d: Duration| round3(d.as_secs_f64() * 1000.0);
    let pool_json: serde_json::Map<String, Value> = pools
        .iter()
        .map(|(name, load)| {
            (
                name.clone(),
                json!({"requests": load.requests, "served_s": round3(load.served.as_secs_f64()),
                       "utilisation": round3(load.served.as_secs_f64() / capacity.max(1e-9)),
                       "queued_s": round3(load.queued.as_secs_f64()),
                       "longest_wait_ms": ms(load.longest_wait)}),
            )
        })
        .collect();
    let busiest = pools
        .iter()
        .max_by_key(|(_, load)| load.served)
        .map(|(name, load)| {
            json!({"pool": name, "utilisation": round3(load.served.as_secs_f64() / capacity.max(1e-9))})
        });
    let endpoint_json: serde_json::Map<String, Value> = endpoints
        .iter()
        .map(|(endpoint, load)| {
            let n = load.requests.max(1) as u32;
            (
                endpoint.to_string(),
                json!({"requests": load.requests, "served_ms_mean": ms(load.served / n),
                       "queued_ms_mean": ms(load.queued / n),
                       "queued_s": round3(load.queued.as_secs_f64())}),
            )
        })
        .collect();
    let queued: Duration = pools.values().map(|l| l.queued).sum();
    let served: Duration = pools.values().map(|l| l.served).sum();
    let waited: Vec<f64> = waits_ms.iter().copied().filter(|w| *w >= 1.0).collect();
    json!({
        "workers_per_daemon": workers,
        "requests": waits_ms.len(),
        "requests_that_waited": waited.len(),
        "queued_s": round3(queued.as_secs_f64()),
        "served_s": round3(served.as_secs_f64()),
        "wait_ms_per_request": spread(&waits_ms),
        "wait_ms_of_those_that_waited": spread(&waited),
        "busiest_pool": busiest,
        "pools": pool_json,
        "by_endpoint": endpoint_json,
    })
}
