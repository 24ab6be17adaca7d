//! A booting guest as every policy tracks it: since when it boots, when it is looked at next,
//! and the `cloud-init status` command started in it, whose result a later pass reads.

use std::time::{Duration, Instant};

use super::{COMMAND_FIRST_LOOK, MIN_RECHECK};

pub(super) struct GuestBoot {
    pub node: String,
    pub started: Instant,
    /// How long after the start a look last found it not done (zero: none did).
    pub last_seen_silent: Duration,
    /// When to look next.
    pub due: Instant,
    /// The `cloud-init status` started in the guest, as (VMID, pid), until its result is read.
    pub command: Option<(u32, u64)>,
    /// How long after the start the latest command was started: when its result says done,
    /// the guest was done by then.
    pub command_issued: Option<Duration>,
}

impl GuestBoot {
    /// A guest on `node` counted as started `now`, looked at first at `due`.
    pub fn new(node: &str, now: Instant, due: Instant) -> Self {
        GuestBoot {
            node: node.to_owned(),
            started: now,
            last_seen_silent: Duration::ZERO,
            due,
            command: None,
            command_issued: None,
        }
    }

    /// Notes `cloud-init status` started as `pid` in VM `vmid`: read once it has had its time.
    pub fn command_started(&mut self, vmid: u32, pid: u64, now: Instant) {
        self.command = Some((vmid, pid));
        self.command_issued = Some(now - self.started);
        self.due = now + COMMAND_FIRST_LOOK;
    }

    /// The pid of the command started in VM `vmid` and not read yet.
    pub fn command_pending(&self, vmid: u32) -> Option<u64> {
        let (command_vmid, pid) = self.command?;
        (command_vmid == vmid).then_some(pid)
    }

    /// The command still runs: looked at again shortly.
    pub fn command_running(&mut self, now: Instant) {
        self.due = now + MIN_RECHECK;
    }

    /// How long until the command's result is worth reading.
    pub fn command_wait(&self, now: Instant) -> Duration {
        self.due.saturating_duration_since(now).max(MIN_RECHECK)
    }
}
