//! How the simulated Proxmox behaves in time. `ideal` (the default) answers every request at
//! once, serves any number of them side by side and runs every task of a type for its configured
//! duration. `realistic` behaves as a real cluster does, seeded and deterministic:
//!
//! - **API workers.** A request runs on the node that executes it: `/nodes/{node}/...` on that
//!   node (pveproxy forwards it there, `proxyto => 'node'`, without holding its own worker), any
//!   other path on the entry node (the first node of the topology: the simulator serves one URL,
//!   as a ProxmoxCluster names one endpoint). Reads run in that node's pveproxy, writes and
//!   guest-agent calls (`protected => 1`) in its pvedaemon, each with `api_workers` workers;
//!   beyond them requests wait in arrival order. Default 3: pveproxy and pvedaemon both start
//!   `max_workers => 3` (`PVE::Service::pveproxy`, `PVE::Service::pvedaemon`), and a worker
//!   runs one API handler at a time (its handlers are synchronous Perl).
//! - **Request latency**, log-normal, by kind of request (median, σ):
//!
//!   | kind | median | σ | why |
//!   |---|---|---|---|
//!   | read (`GET` of one object or list) | 15 ms | 0.5 | parse, ACL check, read from pmxcfs |
//!   | `GET /cluster/resources` | 20 ms + 0.15 ms per guest | 0.4 | one entry per guest, node and storage, encoded as JSON |
//!   | guest-agent call | 30 ms | 0.6 | a QMP round trip to the guest agent |
//!   | write without a task (`PUT` config, pools, HA) | 50 ms | 0.5 | a pmxcfs write goes through corosync to every node |
//!   | write that starts a task | 80 ms | 0.5 | the handler forks its task worker (`fork_worker`) |
//!   | clone | 150 ms | 0.5 | locks the source, creates and locks the new config in pmxcfs, then forks |
//!
//!   The only timing in the recorded answers (`tests/data/pve-fixtures`) is the second-resolution
//!   `Date` of the fog-pve6.2 cassettes: interactions 166 to 488 of `servers.yml` (322
//!   sequential requests against a one-node PVE 6.2 with a handful of guests, task polls and
//!   the client's own time included) span 13:38:38 to 13:39:08, at most 95 ms a request. The
//!   medians are assumptions below that; the per-guest cost of `/cluster/resources` is an
//!   assumption that puts a 1000-guest cluster at 170 ms.
//! - **Task durations**, log-normal with the configured duration as median and σ 0.25 (clones
//!   0.35: they copy disks, which depends on storage and load); 2 % of tasks are slow and take
//!   3 to 6 times as long (uniform). The recorded task list (`GET_nodes_tasks.json` of
//!   fog-pve6.2) has second-resolution start and end times only (qmconfig 0 to 1 s, qmstart 0 to
//!   1 s, qmclone 1 s), too coarse for a spread: σ and the slow share are assumptions.
//! - **Storage locks.** Proxmox allocates, clones and frees volumes under the storage's lock
//!   (`cluster_lock_storage` in `PVE::Storage::Plugin`): a file lock on the node
//!   (`/var/lock/pve-manager/pve-storage-<id>`) for local storages, a cluster-wide pmxcfs lock
//!   (`cfs_lock_storage`) for shared ones. A clone holds it while it allocates each new volume
//!   (median 250 ms, σ 0.4, per volume; at most half the clone's drawn duration), then copies
//!   without it; clones of one storage (one storage on one node, if local) allocate one after
//!   another. The lock's timeouts and the lock around freeing volumes are not modelled.
//!
//! Draws are keyed by what they are for (a task by its type, target and occurrence; a request
//! by its endpoint and occurrence), so the same seed gives the same task the same duration
//! whatever order concurrent requests arrive in.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::Semaphore;
use tokio::time::Instant;

use crate::server::Rng;

/// The profiles by name, as `simulate-proxmox --profile` and `simulation.profile` take them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum ProfileName {
    /// Every request answered at once, any number in parallel, fixed task durations.
    #[default]
    Ideal,
    /// API workers, request latency, drawn task durations, storage locks, slow tasks.
    Realistic,
}

impl ProfileName {
    /// The name as given on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ideal => "ideal",
            Self::Realistic => "realistic",
        }
    }
}

/// How the simulator behaves in time (see the module documentation).
#[derive(Clone, Debug, Default, PartialEq)]
pub enum Profile {
    /// Today's behaviour, bit for bit.
    #[default]
    Ideal,
    /// A real cluster's timing, with these figures (boxed: they outweigh `Ideal` by far).
    Realistic(Box<RealisticProfile>),
}

impl Profile {
    /// The profile `name` with its default figures, seeded with `seed`.
    pub fn named(name: ProfileName, seed: u64) -> Self {
        match name {
            ProfileName::Ideal => Self::Ideal,
            ProfileName::Realistic => Self::Realistic(Box::new(RealisticProfile {
                seed,
                ..RealisticProfile::default()
            })),
        }
    }

    /// The profile's name.
    pub fn name(&self) -> ProfileName {
        match self {
            Self::Ideal => ProfileName::Ideal,
            Self::Realistic(_) => ProfileName::Realistic,
        }
    }

    /// The realistic figures, `None` for `ideal`.
    pub fn realistic(&self) -> Option<&RealisticProfile> {
        match self {
            Self::Ideal => None,
            Self::Realistic(r) => Some(r.as_ref()),
        }
    }
}

/// A log-normal distribution of durations, given by its median and the σ of its logarithm, as
/// service times of servers and disks are commonly modelled (long right tail, never negative).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LogNormal {
    /// Half the draws are shorter.
    pub median: Duration,
    /// Spread: σ of the natural logarithm (0 = always the median).
    pub sigma: f64,
}

impl LogNormal {
    /// A distribution with this median (ms) and σ.
    pub const fn ms(median_ms: u64, sigma: f64) -> Self {
        Self {
            median: Duration::from_millis(median_ms),
            sigma,
        }
    }

    /// One draw.
    pub fn sample(&self, rng: &mut Rng) -> Duration {
        self.median
            .mul_f64((self.sigma * standard_normal(rng)).exp())
    }
}

/// A standard normal variate (Box–Muller), from two uniform draws.
fn standard_normal(rng: &mut Rng) -> f64 {
    // 1 - u is in (0, 1], so the logarithm is finite.
    let radius = (-2.0 * (1.0 - rng.next_f64()).ln()).sqrt();
    radius * (std::f64::consts::TAU * rng.next_f64()).cos()
}

/// The figures of the realistic profile; the defaults and their sources are in the module
/// documentation.
#[derive(Clone, Debug, PartialEq)]
pub struct RealisticProfile {
    /// Seed of every draw.
    pub seed: u64,
    /// Requests one daemon (pveproxy or pvedaemon) of a node serves at once.
    pub api_workers: usize,
    /// `GET` of one object or list.
    pub read_latency: LogNormal,
    /// `GET /cluster/resources` in a cluster without guests.
    pub resources_latency: LogNormal,
    /// What each guest in the cluster adds to the median of `GET /cluster/resources`.
    pub resources_per_guest: Duration,
    /// Guest-agent calls.
    pub agent_latency: LogNormal,
    /// Writes that start no task.
    pub write_latency: LogNormal,
    /// Writes that start a task (other than a clone).
    pub task_request_latency: LogNormal,
    /// Clone requests.
    pub clone_request_latency: LogNormal,
    /// σ of task durations around their configured duration (the median).
    pub task_sigma: f64,
    /// σ of clone durations around the configured clone duration.
    pub clone_sigma: f64,
    /// Share of tasks that are slow.
    pub slow_task_rate: f64,
    /// A slow task takes between these many times its drawn duration (uniform).
    pub slow_task_factor: (f64, f64),
    /// How long a clone holds the storage lock to allocate one volume.
    pub storage_allocation: LogNormal,
}

impl Default for RealisticProfile {
    fn default() -> Self {
        Self {
            seed: 0,
            api_workers: 3,
            read_latency: LogNormal::ms(15, 0.5),
            resources_latency: LogNormal::ms(20, 0.4),
            resources_per_guest: Duration::from_micros(150),
            agent_latency: LogNormal::ms(30, 0.6),
            write_latency: LogNormal::ms(50, 0.5),
            task_request_latency: LogNormal::ms(80, 0.5),
            clone_request_latency: LogNormal::ms(150, 0.5),
            task_sigma: 0.25,
            clone_sigma: 0.35,
            slow_task_rate: 0.02,
            slow_task_factor: (3.0, 6.0),
            storage_allocation: LogNormal::ms(250, 0.4),
        }
    }
}

/// Seeded draws keyed by what they are for: the n-th draw for one key is the same in every run
/// with the seed, however draws for other keys interleave.
#[derive(Debug)]
pub(crate) struct Draws {
    seed: u64,
    occurrences: HashMap<String, u64>,
}

impl Draws {
    pub(crate) fn new(seed: u64) -> Self {
        Self {
            seed,
            occurrences: HashMap::new(),
        }
    }

    /// The generator for the next draw of `key` in `stream`.
    pub(crate) fn rng(&mut self, stream: &str, key: &str) -> Rng {
        let full = format!("{stream}\u{1f}{key}");
        let n = self.occurrences.entry(full.clone()).or_insert(0);
        *n += 1;
        // splitmix64's output function mixes the state, so neighbouring keys and seeds give
        // unrelated sequences.
        Rng::new(
            fnv1a(full.as_bytes())
                ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15)
                ^ self.seed.rotate_left(17),
        )
    }
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// A task's drawn duration.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct DrawnTask {
    pub duration: Duration,
    pub slow: bool,
}

/// One hold of a storage lock by a task, as the bench reads it from the task records.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StorageLockHold {
    /// The lock: `storage` for a shared storage (cluster-wide), `storage@node` for a local one.
    pub lock: String,
    /// When the task asked for it.
    pub requested: Instant,
    /// When it got it (later than `requested` while another task held it).
    pub acquired: Instant,
    /// When it let it go.
    pub released: Instant,
}

impl StorageLockHold {
    /// Time spent waiting for the lock.
    pub fn wait(&self) -> Duration {
        self.acquired - self.requested
    }

    /// Time the lock was held.
    pub fn held(&self) -> Duration {
        self.released - self.acquired
    }
}

/// The task side of the realistic profile: drawn durations and the storage locks' queues.
#[derive(Debug)]
pub(crate) struct TaskModel {
    profile: RealisticProfile,
    draws: Draws,
    /// When each storage lock is free again, after the holds handed out so far.
    lock_free_at: HashMap<String, Instant>,
}

impl TaskModel {
    pub(crate) fn new(profile: &RealisticProfile) -> Self {
        Self {
            profile: profile.clone(),
            draws: Draws::new(profile.seed),
            lock_free_at: HashMap::new(),
        }
    }

    /// The duration of a task of type `kind` on `target` (a VM or volume) configured to take
    /// `configured`.
    pub(crate) fn draw_task(
        &mut self,
        kind: &str,
        target: &str,
        configured: Duration,
    ) -> DrawnTask {
        let p = &self.profile;
        let sigma = if kind == "qmclone" {
            p.clone_sigma
        } else {
            p.task_sigma
        };
        let (rate, (low, high)) = (p.slow_task_rate, p.slow_task_factor);
        let mut rng = self.draws.rng(kind, target);
        let mut duration = LogNormal {
            median: configured,
            sigma,
        }
        .sample(&mut rng);
        let slow = rng.next_f64() < rate;
        if slow {
            duration = duration.mul_f64(low + (high - low) * rng.next_f64());
        }
        DrawnTask { duration, slow }
    }

    /// How long a clone that runs `run` holds each lock in `locks` to allocate its volumes:
    /// drawn per volume, scaled down to half of `run` at most so that the copy keeps the rest.
    pub(crate) fn draw_allocations(
        &mut self,
        target: &str,
        locks: Vec<String>,
        run: Duration,
    ) -> Vec<(String, Duration)> {
        let allocation = self.profile.storage_allocation;
        let mut holds: Vec<(String, Duration)> = locks
            .into_iter()
            .map(|lock| {
                let hold = allocation.sample(&mut self.draws.rng("allocate", target));
                (lock, hold)
            })
            .collect();
        let total: Duration = holds.iter().map(|(_, h)| *h).sum();
        let cap = run / 2;
        if total > cap && !total.is_zero() {
            let scale = cap.as_secs_f64() / total.as_secs_f64();
            for (_, hold) in &mut holds {
                *hold = hold.mul_f64(scale);
            }
        }
        holds
    }

    /// Takes `lock` for `hold` from `at` on, after the holds already handed out. Tasks start in
    /// time order, so handing out holds in call order is first come, first served.
    pub(crate) fn reserve(&mut self, lock: &str, at: Instant, hold: Duration) -> StorageLockHold {
        let free = self.lock_free_at.entry(lock.to_string()).or_insert(at);
        let acquired = (*free).max(at);
        let released = acquired + hold;
        *free = released;
        StorageLockHold {
            lock: lock.to_string(),
            requested: at,
            acquired,
            released,
        }
    }
}

/// The name of the lock guarding allocations on `storage` for `node` (`None`: shared).
pub(crate) fn storage_lock_name(storage: &str, node: Option<&str>) -> String {
    match node {
        Some(node) => format!("{storage}@{node}"),
        None => storage.to_string(),
    }
}

/// When a request waited for and held an API worker, as the request log and the task records
/// keep it under the realistic profile.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestTiming {
    /// The worker pool that served it: `node/pveproxy` or `node/pvedaemon`.
    pub pool: String,
    /// When it reached the simulator.
    pub arrived: Instant,
    /// When a worker took it (later than `arrived` while every worker was busy).
    pub started: Instant,
    /// When the worker was done with it (the state change happens here).
    pub ended: Instant,
}

impl RequestTiming {
    /// Time spent waiting for a worker.
    pub fn queued(&self) -> Duration {
        self.started - self.arrived
    }

    /// Time a worker spent on it.
    pub fn served(&self) -> Duration {
        self.ended - self.started
    }
}

/// What kind of work a request is for its latency.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RequestKind {
    Read,
    ClusterResources,
    Agent,
    Write,
    TaskWrite,
    Clone,
}

/// The kind of request `method` on `segs` (the path below `/api2/json`, split).
pub(crate) fn request_kind(method: &str, segs: &[&str]) -> RequestKind {
    match (method, segs) {
        ("GET", ["cluster", "resources"]) => RequestKind::ClusterResources,
        (_, ["nodes", _, "qemu", _, "agent", ..]) => RequestKind::Agent,
        ("GET", _) => RequestKind::Read,
        ("POST", ["nodes", _, "qemu", _, "clone"]) => RequestKind::Clone,
        ("POST", ["nodes", _, "qemu", _, "config" | "status", ..])
        | ("PUT", ["nodes", _, "qemu", _, "resize"])
        | ("DELETE", ["nodes", _, "qemu", _])
        | ("DELETE", ["nodes", _, "storage", _, "content", ..])
        | ("POST", ["nodes", _, "storage", _, "upload"]) => RequestKind::TaskWrite,
        _ => RequestKind::Write,
    }
}

/// The API side of the realistic profile: each node's worker pools and the latency draws.
pub(crate) struct ApiModel {
    profile: RealisticProfile,
    entry: String,
    pools: HashMap<String, Arc<Semaphore>>,
    draws: Mutex<Draws>,
}

impl std::fmt::Debug for ApiModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiModel")
            .field("entry", &self.entry)
            .field("pools", &self.pools.len())
            .finish_non_exhaustive()
    }
}

impl ApiModel {
    /// Pools for every node of `nodes`, the first being the entry node.
    pub(crate) fn new(profile: &RealisticProfile, nodes: &[String]) -> Self {
        let workers = profile.api_workers.max(1);
        let pools = nodes
            .iter()
            .flat_map(|n| [format!("{n}/pveproxy"), format!("{n}/pvedaemon")])
            .map(|name| (name, Arc::new(Semaphore::new(workers))))
            .collect();
        Self {
            profile: profile.clone(),
            entry: nodes.first().cloned().unwrap_or_default(),
            // Seeded apart from the task draws, which share the seed.
            draws: Mutex::new(Draws::new(profile.seed ^ 0xA9_1A7E)),
            pools,
        }
    }

    /// The pool that serves `method` on `segs`, by name: the executing node's pvedaemon for
    /// writes and guest-agent calls, its pveproxy for reads.
    pub(crate) fn pool_of(&self, method: &str, segs: &[&str]) -> (String, Arc<Semaphore>) {
        let node = match segs {
            ["nodes", node, _, ..] if self.pools.contains_key(&format!("{node}/pveproxy")) => node,
            _ => self.entry.as_str(),
        };
        let protected = method != "GET" || request_kind(method, segs) == RequestKind::Agent;
        let name = format!(
            "{node}/{}",
            if protected { "pvedaemon" } else { "pveproxy" }
        );
        let pool = self.pools.get(&name).cloned().unwrap_or_else(|| {
            // Only with a topology without nodes, which validation refuses.
            Arc::new(Semaphore::new(self.profile.api_workers.max(1)))
        });
        (name, pool)
    }

    /// How long a worker takes for `method` on `segs` (`endpoint` is its template), with
    /// `guests` guests in the cluster.
    pub(crate) fn latency(
        &self,
        method: &str,
        segs: &[&str],
        endpoint: &str,
        guests: usize,
    ) -> Duration {
        let p = &self.profile;
        let distribution = match request_kind(method, segs) {
            RequestKind::Read => p.read_latency,
            RequestKind::ClusterResources => LogNormal {
                median: p.resources_latency.median + p.resources_per_guest * guests as u32,
                sigma: p.resources_latency.sigma,
            },
            RequestKind::Agent => p.agent_latency,
            RequestKind::Write => p.write_latency,
            RequestKind::TaskWrite => p.task_request_latency,
            RequestKind::Clone => p.clone_request_latency,
        };
        let mut rng = self
            .draws
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .rng("request", endpoint);
        distribution.sample(&mut rng)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn realistic(seed: u64) -> RealisticProfile {
        RealisticProfile {
            seed,
            ..RealisticProfile::default()
        }
    }

    #[test]
    fn the_same_seed_gives_the_same_draws_in_any_order() {
        let configured = Duration::from_secs(2);
        let mut a = TaskModel::new(&realistic(7));
        let mut b = TaskModel::new(&realistic(7));
        let first: Vec<DrawnTask> = (100..110)
            .map(|vmid| a.draw_task("qmclone", &vmid.to_string(), configured))
            .collect();
        // The other model draws the same keys backwards, with other keys in between.
        let mut second: Vec<DrawnTask> = (100..110)
            .rev()
            .map(|vmid| {
                b.draw_task("qmstart", &vmid.to_string(), configured);
                b.draw_task("qmclone", &vmid.to_string(), configured)
            })
            .collect();
        second.reverse();
        assert_eq!(first, second);
        // A second clone of one VM draws anew.
        assert_ne!(
            a.draw_task("qmclone", "100", configured),
            first[0],
            "the second occurrence of a key is another draw"
        );
        let mut other = TaskModel::new(&realistic(8));
        assert_ne!(other.draw_task("qmclone", "100", configured), first[0]);
    }

    #[test]
    fn task_durations_center_on_the_configured_one_with_a_few_slow_ones() {
        let configured = Duration::from_millis(1000);
        let mut model = TaskModel::new(&realistic(1));
        let draws: Vec<DrawnTask> = (0..4000)
            .map(|i| model.draw_task("qmstart", &i.to_string(), configured))
            .collect();
        let mut normal: Vec<f64> = draws
            .iter()
            .filter(|d| !d.slow)
            .map(|d| d.duration.as_secs_f64())
            .collect();
        normal.sort_by(f64::total_cmp);
        let median = normal[normal.len() / 2];
        assert!((0.95..1.05).contains(&median), "median {median}");
        let slow = draws.iter().filter(|d| d.slow).count() as f64 / draws.len() as f64;
        assert!((0.01..0.03).contains(&slow), "slow share {slow}");
        assert!(
            draws
                .iter()
                .filter(|d| d.slow)
                .all(|d| d.duration > Duration::from_millis(1500)),
            "slow tasks take several times as long"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_storage_lock_serialises_allocations_first_come_first_served() {
        let mut model = TaskModel::new(&realistic(1));
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let first = model.reserve("local-lvm@pve1", t0, ms(300));
        let second = model.reserve("local-lvm@pve1", t0 + ms(100), ms(200));
        let elsewhere = model.reserve("local-lvm@pve2", t0 + ms(100), ms(200));
        let later = model.reserve("local-lvm@pve1", t0 + ms(900), ms(100));
        assert_eq!((first.acquired, first.released), (t0, t0 + ms(300)));
        assert_eq!(second.wait(), ms(200), "waits for the first hold");
        assert_eq!(second.released, t0 + ms(500));
        assert_eq!(elsewhere.wait(), Duration::ZERO, "another node's lock");
        assert_eq!(later.wait(), Duration::ZERO, "the lock was free again");
        assert_eq!(later.held(), ms(100));
    }

    #[test]
    fn allocations_keep_at_most_half_of_the_clone() {
        let mut model = TaskModel::new(&RealisticProfile {
            storage_allocation: LogNormal::ms(2000, 0.0),
            ..realistic(1)
        });
        let locks = vec!["a".to_string(), "b".to_string()];
        let holds = model.draw_allocations("100", locks, Duration::from_secs(2));
        let total: Duration = holds.iter().map(|(_, h)| *h).sum();
        assert!(
            total <= Duration::from_secs(1) && total >= Duration::from_millis(999),
            "{total:?}"
        );
        assert_eq!(holds[0].0, "a");
    }

    #[tokio::test(start_paused = true)]
    async fn a_node_serves_as_many_requests_at_once_as_it_has_workers() {
        let profile = RealisticProfile {
            api_workers: 2,
            ..realistic(1)
        };
        let nodes = ["pve1".to_string(), "pve2".to_string()];
        let model = ApiModel::new(&profile, &nodes);
        let (name, pool) = model.pool_of("GET", &["nodes", "pve2", "qemu", "100", "config"]);
        assert_eq!(name, "pve2/pveproxy");
        let hold = Duration::from_millis(100);
        let t0 = Instant::now();
        let mut served = tokio::task::JoinSet::new();
        for _ in 0..3 {
            let pool = pool.clone();
            served.spawn(async move {
                let arrived = Instant::now();
                let _worker = pool
                    .acquire_owned()
                    .await
                    .expect("the pool is never closed");
                let started = Instant::now();
                tokio::time::sleep(hold).await;
                started - arrived
            });
        }
        let mut waits: Vec<Duration> = served.join_all().await;
        waits.sort();
        assert_eq!(waits, vec![Duration::ZERO, Duration::ZERO, hold]);
        assert_eq!(Instant::now() - t0, hold * 2);
        // Other pools are not affected: writes, the entry node, unknown nodes.
        assert_eq!(
            model
                .pool_of("POST", &["nodes", "pve2", "qemu", "100", "config"])
                .0,
            "pve2/pvedaemon"
        );
        assert_eq!(
            model
                .pool_of(
                    "GET",
                    &["nodes", "pve2", "qemu", "100", "agent", "exec-status"]
                )
                .0,
            "pve2/pvedaemon",
            "guest-agent calls are protected"
        );
        assert_eq!(
            model.pool_of("GET", &["cluster", "resources"]).0,
            "pve1/pveproxy"
        );
        assert_eq!(
            model.pool_of("GET", &["nodes", "nope", "status"]).0,
            "pve1/pveproxy"
        );
    }

    #[test]
    fn cluster_resources_cost_grows_with_the_guests() {
        let profile = RealisticProfile {
            resources_latency: LogNormal::ms(20, 0.0),
            ..realistic(1)
        };
        let model = ApiModel::new(&profile, &["pve1".to_string()]);
        let segs = ["cluster", "resources"];
        let endpoint = "GET /cluster/resources";
        assert_eq!(
            model.latency("GET", &segs, endpoint, 0),
            Duration::from_millis(20)
        );
        assert_eq!(
            model.latency("GET", &segs, endpoint, 1000),
            Duration::from_millis(170)
        );
    }

    #[test]
    fn requests_are_classified_by_the_work_they_cause() {
        let kind = |m: &str, p: &str| {
            let segs: Vec<&str> = p.split('/').collect();
            request_kind(m, &segs)
        };
        assert_eq!(kind("POST", "nodes/a/qemu/9000/clone"), RequestKind::Clone);
        assert_eq!(
            kind("POST", "nodes/a/qemu/100/config"),
            RequestKind::TaskWrite
        );
        assert_eq!(kind("PUT", "nodes/a/qemu/100/config"), RequestKind::Write);
        assert_eq!(
            kind("POST", "nodes/a/qemu/100/status/start"),
            RequestKind::TaskWrite
        );
        assert_eq!(kind("DELETE", "nodes/a/qemu/100"), RequestKind::TaskWrite);
        assert_eq!(
            kind("POST", "nodes/a/qemu/100/agent/exec"),
            RequestKind::Agent
        );
        assert_eq!(kind("GET", "nodes/a/tasks/UPID/status"), RequestKind::Read);
        assert_eq!(kind("PUT", "pools"), RequestKind::Write);
    }
}
