//! The requests capmox sends to one Proxmox API at once. pveproxy and pvedaemon serve only a
//! few requests at a time each; more wait in their queues, where a slow call holds up every
//! other client of the cluster. Past the gate's limit, requests wait in capmox instead, and
//! the wait is counted for the metrics.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::{OwnedSemaphorePermit, Semaphore, TryAcquireError};

/// Requests in flight to one Proxmox API when nothing says otherwise: pveproxy multiplexes
/// connections over its few workers, so a few per worker keep it busy without a backlog.
pub const DEFAULT_REQUESTS_IN_FLIGHT: usize = 16;

/// The gate of one Proxmox API, shared by every client that reaches it.
#[derive(Debug)]
pub struct RequestGate {
    permits: Arc<Semaphore>,
    waiting: AtomicUsize,
    waits: AtomicU64,
    wait_nanos: AtomicU64,
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

impl RequestGate {
    /// A gate letting `limit` requests through at once (at least one).
    pub fn new(limit: usize) -> Arc<Self> {
        Arc::new(Self {
            permits: Arc::new(Semaphore::new(limit.max(1))),
            waiting: AtomicUsize::new(0),
            waits: AtomicU64::new(0),
            wait_nanos: AtomicU64::new(0),
        })
    }

    /// Waits for the request's turn; the permit lets the next one through when dropped.
    /// `None`: the gate is closed (never, as no caller closes it).
    pub async fn enter(&self) -> Option<OwnedSemaphorePermit> {
        match self.permits.clone().try_acquire_owned() {
            Ok(permit) => return Some(permit),
            Err(TryAcquireError::Closed) => return None,
            Err(TryAcquireError::NoPermits) => {}
        }
        self.waiting.fetch_add(1, Ordering::Relaxed);
        let _waiting = Waiting(&self.waiting);
        let started = Instant::now();
        let permit = self.permits.clone().acquire_owned().await.ok();
        let waited = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.waits.fetch_add(1, Ordering::Relaxed);
        self.wait_nanos.fetch_add(waited, Ordering::Relaxed);
        permit
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

    #[tokio::test]
    async fn requests_past_the_limit_wait_their_turn_and_the_wait_is_counted() {
        let gate = RequestGate::new(2);
        let first = gate.enter().await.expect("open");
        let _second = gate.enter().await.expect("open");
        assert_eq!(
            gate.stats(),
            GateStats::default(),
            "no wait within the limit"
        );
        let third = {
            let gate = gate.clone();
            tokio::spawn(async move { gate.enter().await.is_some() })
        };
        while gate.stats().waiting == 0 {
            tokio::task::yield_now().await;
        }
        assert_eq!(gate.stats().waiting, 1);
        drop(first);
        assert!(third.await.expect("joins"), "let through once one ended");
        let stats = gate.stats();
        assert_eq!((stats.waiting, stats.waits), (0, 1));
    }
}
