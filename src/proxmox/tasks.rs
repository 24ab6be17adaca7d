//! Waiting for Proxmox tasks: short, growing poll intervals and a caller deadline,
//! so controllers see progress quickly without hammering pvedaemon.

use std::time::Duration;

use super::client::ProxmoxClient;
use super::error::{ProxmoxError, Result};
use super::types::{TaskRef, TaskStatus};
use super::upid::Upid;

/// How to poll a task.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WaitOptions {
    /// First poll interval.
    pub initial_interval: Duration,
    /// Growth factor per poll.
    pub factor: f64,
    /// Longest interval.
    pub max_interval: Duration,
    /// Give up after this long (the task may still be running).
    pub deadline: Duration,
}

impl Default for WaitOptions {
    fn default() -> Self {
        Self {
            initial_interval: Duration::from_millis(250),
            factor: 1.5,
            max_interval: Duration::from_secs(5),
            deadline: Duration::from_secs(600),
        }
    }
}

impl WaitOptions {
    /// Default intervals with the given deadline.
    pub fn with_deadline(deadline: Duration) -> Self {
        Self {
            deadline,
            ..Self::default()
        }
    }

    /// The poll intervals this policy produces, in order (for tests and docs).
    pub fn intervals(&self) -> impl Iterator<Item = Duration> + '_ {
        let mut next = self.initial_interval;
        std::iter::from_fn(move || {
            let cur = next;
            next = next.mul_f64(self.factor.max(1.0)).min(self.max_interval);
            Some(cur)
        })
    }
}

impl ProxmoxClient {
    /// Polls the task until it stops. `Ok` for `OK`/`WARNINGS: n`, `TaskFailed` otherwise,
    /// `TaskTimeout` when the deadline passes. Transient poll errors are retried until the deadline.
    pub async fn wait_task(&self, upid: &Upid, opts: &WaitOptions) -> Result<TaskStatus> {
        let start = tokio::time::Instant::now();
        let mut intervals = opts.intervals();
        loop {
            match self.task_status(upid).await {
                Ok(status) if status.is_finished() => {
                    if status.is_success() {
                        return Ok(status);
                    }
                    return Err(ProxmoxError::TaskFailed {
                        upid: upid.to_string(),
                        exitstatus: status
                            .exitstatus
                            .clone()
                            .unwrap_or_else(|| "unexpected status".to_string()),
                    });
                }
                Ok(_) => {}
                Err(e) if e.is_retryable() => {
                    tracing::debug!(%upid, error = %e, "task poll failed, will retry");
                }
                Err(e) => return Err(e),
            }
            let waited = start.elapsed();
            if waited >= opts.deadline {
                return Err(ProxmoxError::TaskTimeout {
                    upid: upid.to_string(),
                    waited_ms: waited.as_millis() as u64,
                });
            }
            let interval = intervals.next().unwrap_or(opts.max_interval);
            tokio::time::sleep(interval.min(opts.deadline - waited)).await;
        }
    }

    /// Waits for a task if there is one (`None` means Proxmox finished synchronously).
    pub async fn wait_task_ref(&self, task: &TaskRef, opts: &WaitOptions) -> Result<()> {
        if let Some(upid) = task {
            self.wait_task(upid, opts).await?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn intervals_grow_and_cap() {
        let opts = WaitOptions {
            initial_interval: Duration::from_millis(100),
            factor: 2.0,
            max_interval: Duration::from_millis(500),
            deadline: Duration::from_secs(1),
        };
        let v: Vec<u64> = opts
            .intervals()
            .take(5)
            .map(|d| d.as_millis() as u64)
            .collect();
        assert_eq!(v, vec![100, 200, 400, 500, 500]);
    }
}
