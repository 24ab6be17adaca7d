//! The requests capmox sends to one Proxmox API at once. pveproxy and pvedaemon serve only a
//! few requests at a time each; more wait in their queues, where a slow call holds up every
//! other client of the cluster. Past the gate's limits, requests wait in capmox instead, and
//! the wait is counted for the metrics.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use reqwest::Method;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, TryAcquireError};

/// Requests in flight to one Proxmox API when nothing says otherwise: pveproxy multiplexes
/// connections over its few workers, so a few per worker keep it busy without a backlog.
pub const DEFAULT_REQUESTS_IN_FLIGHT: usize = 16;

/// Requests in flight to one daemon of one node (its pveproxy for reads, its pvedaemon for
/// writes and guest-agent calls): each daemon runs three workers, one API call at a time
/// each, and one stays free for the web interface and other clients.
pub const REQUESTS_PER_DAEMON: usize = 2;

/// The gate of one Proxmox API, shared by every client that reaches it.
#[derive(Debug)]
pub struct RequestGate {
    permits: Arc<Semaphore>,
    /// Each daemon's permits, by [`daemon_of`].
    daemons: Mutex<HashMap<String, Arc<Semaphore>>>,
    waiting: AtomicUsize,
    waits: AtomicU64,
    wait_nanos: AtomicU64,
}

/// A request's turn: its daemon's permit and the API's.
#[derive(Debug)]
pub struct Turn {
    _daemon: OwnedSemaphorePermit,
    _api: OwnedSemaphorePermit,
}

/// What a gate saw, for the metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GateStats {
    /// Requests waiting for their turn now.
    pub waiting: usize,
    /// Requests that had to wait, since the start.
    pub waits: u64,
    /// Their waits, summed.
    pub wait_time: Duration,
}

/// Counts a request as waiting until it is dropped (also when the request is cancelled).
struct Waiting<'a>(&'a AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The daemon that serves `method` on `path`: a `/nodes/{node}/...` call runs on that node
/// (pveproxy forwards it there), any other on the node the API's URL reaches (`""`); reads in
/// pveproxy, writes and guest-agent calls (protected ones) in pvedaemon.
pub fn daemon_of(method: &Method, path: &str) -> String {
    let mut segments = path.trim_start_matches('/').split('/');
    let node = match (segments.next(), segments.next(), segments.next()) {
        (Some("nodes"), Some(node), Some(_)) => node,
        _ => "",
    };
    let agent = path.split('/').any(|segment| segment == "agent");
    let daemon = if method != Method::GET || agent {
        "pvedaemon"
    } else {
        "pveproxy"
    };
    format!("{node}/{daemon}")
}

/// Takes a permit of `permits` now if one is free.
fn try_take(permits: &Arc<Semaphore>) -> Result<Option<OwnedSemaphorePermit>, ()> {
    match permits.clone().try_acquire_owned() {
        Ok(permit) => Ok(Some(permit)),
        Err(TryAcquireError::Closed) => Err(()),
        Err(TryAcquireError::NoPermits) => Ok(None),
    }
}

impl RequestGate {
    /// A gate letting `limit` requests through at once (at least one), and at most
    /// [`REQUESTS_PER_DAEMON`] to each daemon of a node.
    pub fn new(limit: usize) -> Arc<Self> {
        Arc::new(Self {
            permits: Arc::new(Semaphore::new(limit.max(1))),
            daemons: Mutex::default(),
            waiting: AtomicUsize::new(0),
            waits: AtomicU64::new(0),
            wait_nanos: AtomicU64::new(0),
        })
    }

    fn daemon(&self, method: &Method, path: &str) -> Arc<Semaphore> {
        // Never held across a panic-prone call: a poisoned map is still consistent.
        let mut daemons = self
            .daemons
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        daemons
            .entry(daemon_of(method, path))
            .or_insert_with(|| Arc::new(Semaphore::new(REQUESTS_PER_DAEMON)))
            .clone()
    }

    /// Waits for the turn of `method` on `path` (its daemon's first, then the API's); the turn
    /// lets the next one through when dropped. `None`: the gate is closed (never, as no caller
    /// closes it).
    pub async fn enter(&self, method: &Method, path: &str) -> Option<Turn> {
        let daemon = self.daemon(method, path);
        if let (Some(daemon), Some(api)) = (try_take(&daemon).ok()?, try_take(&self.permits).ok()?)
        {
            return Some(Turn {
                _daemon: daemon,
                _api: api,
            });
        }
        self.waiting.fetch_add(1, Ordering::Relaxed);
        let _waiting = Waiting(&self.waiting);
        let started = Instant::now();
        let daemon = daemon.acquire_owned().await.ok()?;
        let api = self.permits.clone().acquire_owned().await.ok()?;
        let waited = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.waits.fetch_add(1, Ordering::Relaxed);
        self.wait_nanos.fetch_add(waited, Ordering::Relaxed);
        Some(Turn {
            _daemon: daemon,
            _api: api,
        })
    }

    /// What the gate saw so far.
    pub fn stats(&self) -> GateStats {
        GateStats {
            waiting: self.waiting.load(Ordering::Relaxed),
            waits: self.waits.load(Ordering::Relaxed),
            wait_time: Duration::from_nanos(self.wait_nanos.load(Ordering::Relaxed)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Waits until `gate` counts `n` requests waiting.
    async fn until_waiting(gate: &RequestGate, n: usize) {
        while gate.stats().waiting < n {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test]
    async fn requests_past_the_limit_wait_their_turn_and_the_wait_is_counted() {
        let gate = RequestGate::new(2);
        let first = gate.enter(&Method::GET, "/version").await.expect("open");
        let _second = gate
            .enter(&Method::GET, "/nodes/pve1/tasks")
            .await
            .expect("open");
        assert_eq!(
            gate.stats(),
            GateStats::default(),
            "no wait within the limit"
        );
        let third = {
            let gate = gate.clone();
            tokio::spawn(async move {
                gate.enter(&Method::GET, "/nodes/pve2/tasks")
                    .await
                    .is_some()
            })
        };
        until_waiting(&gate, 1).await;
        assert_eq!(gate.stats().waiting, 1);
        drop(first);
        assert!(third.await.expect("joins"), "let through once one ended");
        let stats = gate.stats();
        assert_eq!((stats.waiting, stats.waits), (0, 1));
    }

    #[tokio::test]
    async fn a_node_daemon_gets_no_more_requests_than_leave_one_of_its_workers_free() {
        let gate = RequestGate::new(DEFAULT_REQUESTS_IN_FLIGHT);
        let mut writes = Vec::new();
        for _ in 0..REQUESTS_PER_DAEMON {
            writes.push(
                gate.enter(&Method::POST, "/nodes/pve1/qemu/100/status/start")
                    .await
                    .expect("open"),
            );
        }
        // Reads on that node, and writes on another, go on.
        let _read = gate
            .enter(&Method::GET, "/nodes/pve1/qemu/100/config")
            .await
            .expect("open");
        let _elsewhere = gate
            .enter(&Method::PUT, "/nodes/pve2/qemu/101/config")
            .await
            .expect("open");
        assert_eq!(gate.stats(), GateStats::default());
        let next = {
            let gate = gate.clone();
            tokio::spawn(async move {
                gate.enter(&Method::DELETE, "/nodes/pve1/qemu/102")
                    .await
                    .is_some()
            })
        };
        until_waiting(&gate, 1).await;
        writes.pop();
        assert!(next.await.expect("joins"), "let through once one ended");
        assert_eq!(gate.stats().waits, 1);
    }

    #[test]
    fn calls_are_served_by_the_daemon_proxmox_runs_them_in() {
        let cases = [
            (Method::GET, "/cluster/resources", "/pveproxy"),
            (Method::GET, "/nodes/pve1/qemu/100/config", "pve1/pveproxy"),
            (Method::POST, "/nodes/pve1/qemu/100/clone", "pve1/pvedaemon"),
            (
                Method::GET,
                "/nodes/pve2/qemu/100/agent/get-osinfo",
                "pve2/pvedaemon",
            ),
            (Method::GET, "/nodes", "/pveproxy"),
            (Method::POST, "/cluster/ha/resources", "/pvedaemon"),
        ];
        for (method, path, daemon) in cases {
            assert_eq!(daemon_of(&method, path), daemon, "{method} {path}");
        }
    }
}
