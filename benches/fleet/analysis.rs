//! The benchmark's arithmetic, kept free of I/O so `tests/bench_analysis.rs` can test it
//! (the bench target itself runs without a test harness).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::time::Instant;

use capmox_sim::{LoggedRequest, TaskRecord};
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

/// Proxmox's part of a machine's path: every task of its guest from request to end (queueing
/// for a clone slot included) and the boot until the guest agent answers.
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

/// Service time of a machine's path without queueing: task run times and boot.
pub fn service_time(tasks: &[&TaskRecord], include_clone: bool) -> Duration {
    tasks
        .iter()
        .filter(|t| include_clone || t.kind != "qmclone")
        .map(|t| {
            run_time(t).unwrap_or_default()
                + t.agent_ready
                    .zip(t.ended)
                    .map_or(Duration::ZERO, |(ready, end)| ready - end)
        })
        .sum()
}

/// The fleet's lower bound from what the simulator ran, and how it was derived.
///
/// Per node N with `s` clone slots and `n` clones holding a slot there, the last of them
/// cannot end before ceil(n / s) × (shortest clone there), and its machine then still needs
/// its remaining tasks and boot (the shortest such tail among those machines). KubeadmControl
/// Plane creates control-plane machines one after another, so their whole paths add up. The
/// bound is the largest of these. A node is one of a site (node names repeat over sites), and
/// each machine's tasks are those of its VM on its site (`MachineTimes::site`).
pub fn lower_bound(
    machines: &BTreeMap<String, MachineTimes>,
    tasks_of: &HashMap<VmKey, Vec<&TaskRecord>>,
    slots: usize,
    sites: &Sites,
) -> (Duration, Value) {
    let mut per_node: BTreeMap<(usize, String), (usize, Duration, Duration)> = BTreeMap::new();
    let mut control_plane = Duration::ZERO;
    for m in machines.values() {
        let Some(tasks) = m.vmid.and_then(|v| tasks_of.get(&(m.site, v))) else {
            continue;
        };
        let Some(clone) = tasks.iter().find(|t| t.kind == "qmclone") else {
            continue;
        };
        let clone_run = run_time(clone).unwrap_or_default();
        let tail = service_time(tasks, false);
        if m.control_plane {
            control_plane += clone_run + tail;
        }
        let mut slot_nodes = vec![clone.node.clone()];
        if let Some(node) = &m.node
            && *node != clone.node
        {
            slot_nodes.push(node.clone());
        }
        for node in slot_nodes {
            let entry = per_node
                .entry((m.site, node))
                .or_insert((0, Duration::MAX, Duration::MAX));
            entry.0 += 1;
            entry.1 = entry.1.min(clone_run);
            entry.2 = entry.2.min(tail);
        }
    }
    let mut nodes = serde_json::Map::new();
    let mut bound = control_plane;
    for ((site, node), (n, clone, tail)) in &per_node {
        let waves = if slots == 0 { 1 } else { n.div_ceil(slots) } as u32;
        let node_bound = *clone * waves + *tail;
        bound = bound.max(node_bound);
        nodes.insert(
            sites.node_label(*site, node),
            json!({"clones": n, "waves": waves, "shortest_clone_s": round3(clone.as_secs_f64()),
                   "shortest_tail_s": round3(tail.as_secs_f64()), "bound_s": round3(node_bound.as_secs_f64())}),
        );
    }
    (
        bound,
        json!({
            "formula": "max(sum of control-plane paths, max over nodes of ceil(clones/slots) * shortest clone + shortest remaining path)",
            "control_plane_chain_s": round3(control_plane.as_secs_f64()),
            "per_node": nodes,
        }),
    )
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
            let segs: Vec<&str> = entry.path.trim_matches('/').split('/').collect();
            let vmid = match segs.as_slice() {
                ["nodes", _, "qemu", id, ..] => {
                    id.parse().ok().filter(|v| !site.templates.contains(v))
                }
                ["nodes", _, "tasks", upid, ..] => site.upid_vmid.get(*upid).copied(),
                ["nodes", _, "storage", _, "content", volume @ ..] => iso_vmid(&volume.join("/")),
                _ => None,
            };
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
/// each task (by the task's type) until the next one was requested, and after the boot until the
/// machine was ready. The parts add up to the controller-added time when tasks do not overlap.
pub fn controller_gaps(
    tasks: &[&TaskRecord],
    from: Instant,
    to: Instant,
) -> Vec<(String, Duration)> {
    let mut path: Vec<&TaskRecord> = tasks
        .iter()
        .copied()
        .filter(|t| t.ended.is_some())
        .collect();
    path.sort_by_key(|t| t.created);
    let mut gaps = Vec::new();
    let mut since = from;
    let mut after = "before the first task".to_owned();
    for task in path {
        let start = task.created.clamp(from, to);
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
