//! The plain task timing: a task is first checked after the duration last seen for its type on
//! its node, then ever less often; a booting guest is looked at likewise. No scouts and no
//! model of the clone queues: what those save is measured by the bench (the book's Performance
//! page).
//!
//! Its rules, each for one reason:
//! - The first check comes after the last seen duration of the task's type on its node: on
//!   one node, tasks of one type take about as long as the last one did.
//! - A node that saw none of that type yet takes the last one seen on any node, and before
//!   any was seen, a default (longer for a clone, which copies disks): a guess that is soon
//!   replaced.
//! - A duration seen is the middle of the last check that saw the task running and the one
//!   that saw it done (at most the latter when none saw it running), as the learned timing
//!   estimates: it follows the task, not the polling.
//! - A check that finds the task running waits twice as long as the one before, from a short
//!   recheck up to a cap: a task a little late is seen soon, a long one costs few checks.
//! - A guest is first looked at after the last seen boot on its node (any node's, a
//!   default), then backs off the same way.
//! - A task or boot this process did not see begin, and a start checked together with the
//!   boot, teach nothing: how long they took is unknown.

use super::Beside;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::guest::GuestBoot;
use super::ledger::Ledger;
use super::{
    DEFAULT_BOOT, DEFAULT_CLONE, DEFAULT_TASK, DUE_SLACK, MAX_IN_FLIGHT, MAX_RECHECK, MIN_RECHECK,
    NextInLine, TaskTiming, estimate,
};
use crate::controller::machine::TaskKind;
use crate::proxmox::Upid;

/// The task type that copies disks, whose default is a clone's.
const CLONE_TASK: &str = "qmclone";

/// Looks at a task or a guest when the last one like it was done, then backs off.
#[derive(Default)]
pub struct PlainClock {
    inner: Mutex<PlainState>,
}

#[derive(Default)]
struct PlainState {
    /// What the reconciler relies on, whatever the timing.
    ledger: Ledger,
    /// Tasks this process submitted or saw running, by UPID.
    tasks: HashMap<String, Polled>,
    /// The last duration seen per (task type, node).
    last_task: HashMap<(String, String), Duration>,
    /// The last duration seen per task type, on any node.
    last_task_anywhere: HashMap<String, Duration>,
    /// Guests looked at until they are up, by machine key.
    booting: HashMap<String, Boot>,
    /// The last boot seen per node (start request until cloud-init was done).
    last_boot: HashMap<String, Duration>,
    /// The last boot seen on any node.
    last_boot_anywhere: Option<Duration>,
}

/// A task being waited for.
struct Polled {
    task_type: String,
    node: String,
    submitted: Instant,
    /// When to check it next.
    due: Instant,
    /// The wait after the next check that finds it running.
    next_wait: Duration,
    /// How long after submission a check last saw it running (zero: none did).
    last_seen_running: Duration,
    /// Whether how long it took tells how long the next one like it takes.
    learns: bool,
}

/// A guest being waited for.
struct Boot {
    guest: GuestBoot,
    /// The wait after the next look that finds it not done.
    next_wait: Duration,
    /// Started by this process, so how long it took is known.
    learns: bool,
}

impl std::ops::Deref for Boot {
    type Target = GuestBoot;

    fn deref(&self) -> &GuestBoot {
        &self.guest
    }
}

impl std::ops::DerefMut for Boot {
    fn deref_mut(&mut self) -> &mut GuestBoot {
        &mut self.guest
    }
}

impl Boot {
    /// A guest this process did not see start (after a restart): counted as started `now`.
    fn unknown(node: &str, now: Instant, due: Instant) -> Self {
        Boot {
            guest: GuestBoot::new(node, now, due),
            next_wait: MIN_RECHECK,
            learns: false,
        }
    }
}

/// The wait before the next look after one that found nothing done, and the one after that.
fn back_off(next_wait: &mut Duration) -> Duration {
    let wait = *next_wait;
    *next_wait = (wait * 2).min(MAX_RECHECK);
    wait
}

/// How long until `due`, if that is worth a requeue.
fn until(due: Instant, now: Instant) -> Option<Duration> {
    (due > now + DUE_SLACK).then(|| due - now)
}

impl TaskTiming for PlainClock {
    fn submitted(&self, upid: &Upid, machine: &str, purpose: &str) -> Duration {
        let now = Instant::now();
        let mut state = self.lock();
        state.ledger.submitted(upid, machine, purpose);
        let expected = state.expected(upid);
        if state.tasks.len() >= MAX_IN_FLIGHT {
            // Only machines deleted mid-task by the thousands get here; a forgotten task is
            // checked once early.
            state.tasks.clear();
        }
        state.tasks.insert(
            upid.as_str().to_owned(),
            Polled {
                task_type: upid.task_type.clone(),
                node: upid.site_node().to_owned(),
                submitted: now,
                due: now + expected,
                next_wait: MIN_RECHECK,
                last_seen_running: Duration::ZERO,
                learns: true,
            },
        );
        expected
    }

    fn check_with_boot(&self, upid: &Upid, machine: &str) -> Duration {
        let now = Instant::now();
        let mut state = self.lock();
        let boot_due = state.booting.get(machine).map(|boot| boot.due);
        let Some(task) = state.tasks.get_mut(upid.as_str()) else {
            return MIN_RECHECK;
        };
        if let Some(boot_due) = boot_due {
            task.due = task.due.max(boot_due);
            task.learns = false;
        }
        task.due.saturating_duration_since(now).max(MIN_RECHECK)
    }

    fn succeeded(&self, machine: &str, kind: Option<TaskKind>) -> u32 {
        self.lock().ledger.succeeded(machine, kind, Instant::now())
    }

    fn in_flight_for(&self, machine: &str) -> Option<(Arc<Upid>, String)> {
        self.lock().ledger.in_flight_for(machine)
    }

    fn not_due(&self, upid: &Upid) -> Option<Duration> {
        let state = self.lock();
        if state.ledger.seen_listed_ended(upid.as_str()) {
            return None;
        }
        until(state.tasks.get(upid.as_str())?.due, Instant::now())
    }

    fn still_running(&self, upid: &Upid) -> Duration {
        let now = Instant::now();
        let mut state = self.lock();
        let task = state
            .tasks
            .entry(upid.as_str().to_owned())
            .or_insert_with(|| Polled {
                task_type: upid.task_type.clone(),
                node: upid.site_node().to_owned(),
                submitted: now,
                due: now,
                next_wait: MIN_RECHECK,
                last_seen_running: Duration::ZERO,
                learns: false,
            });
        task.last_seen_running = now - task.submitted;
        let wait = back_off(&mut task.next_wait);
        task.due = now + wait;
        wait
    }

    fn finished(&self, upid: &Upid) -> Option<NextInLine> {
        let now = Instant::now();
        let mut state = self.lock();
        state.ledger.task_ended(upid);
        let task = state.tasks.remove(upid.as_str())?;
        if task.learns {
            let took = estimate(task.last_seen_running, now - task.submitted);
            state
                .last_task_anywhere
                .insert(task.task_type.clone(), took);
            state.last_task.insert((task.task_type, task.node), took);
        }
        // No queue model: each task's own back-off finds it done.
        None
    }

    fn listed_with(&self, upid: &Upid) -> Beside {
        self.lock().ledger.beside(upid)
    }

    fn listed_ended_beside(&self, checked: &Upid, ended: &dyn Fn(&Upid) -> bool) -> Vec<String> {
        self.lock().ledger.listed_ended_beside(checked, ended)
    }

    fn forget(&self, upid: &Upid) {
        let mut state = self.lock();
        state.tasks.remove(upid.as_str());
        state.ledger.task_ended(upid);
    }

    fn boot_started(&self, machine: &str, node: &str) {
        let now = Instant::now();
        let mut state = self.lock();
        state.ledger.vm_started(machine);
        if state.booting.len() >= MAX_IN_FLIGHT {
            state.booting.clear();
        }
        let expected = state.expected_boot(node);
        state.booting.insert(
            machine.to_owned(),
            Boot {
                learns: true,
                ..Boot::unknown(node, now, now + expected)
            },
        );
    }

    fn boot_not_due(&self, machine: &str) -> Option<Duration> {
        until(self.lock().booting.get(machine)?.due, Instant::now())
    }

    fn boot_remaining(&self, machine: &str, node: &str) -> Duration {
        let now = Instant::now();
        let mut state = self.lock();
        let due = now + state.expected_boot(node);
        let boot = state
            .booting
            .entry(machine.to_owned())
            .or_insert_with(|| Boot::unknown(node, now, due));
        boot.due.saturating_duration_since(now).max(MIN_RECHECK)
    }

    fn boot_silent(&self, machine: &str, node: &str) -> Duration {
        let now = Instant::now();
        let mut state = self.lock();
        let boot = state
            .booting
            .entry(machine.to_owned())
            .or_insert_with(|| Boot::unknown(node, now, now));
        boot.last_seen_silent = now - boot.started;
        let wait = back_off(&mut boot.next_wait);
        boot.due = now + wait;
        wait
    }

    fn boot_answered(&self, machine: &str) -> Vec<String> {
        let now = Instant::now();
        let mut state = self.lock();
        if let Some(boot) = state.booting.remove(machine)
            && boot.learns
        {
            let took = estimate(boot.last_seen_silent, now - boot.started);
            state.last_boot_anywhere = Some(took);
            state.last_boot.insert(boot.guest.node, took);
        }
        // No guest waits for another's answer.
        Vec::new()
    }

    fn guest_up(&self, machine: &str, vmid: u32) -> bool {
        self.lock().ledger.guest_up(machine, vmid)
    }

    fn seen_up(&self, machine: &str, vmid: u32) -> bool {
        self.lock().ledger.seen_up(machine, vmid)
    }
}

impl PlainClock {
    fn lock(&self) -> std::sync::MutexGuard<'_, PlainState> {
        // Every update leaves the state consistent between statements (an insert, a remove, a
        // field write), so a lock poisoned by a panic elsewhere is used as it is.
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl PlainState {
    /// What a task like `upid` is expected to take: the last such task on its node, else on
    /// any node, else the default; never less than a short recheck, so a task seen done at
    /// once is not checked in a tight loop.
    fn expected(&self, upid: &Upid) -> Duration {
        let key = (upid.task_type.clone(), upid.site_node().to_owned());
        let default = if upid.task_type == CLONE_TASK {
            DEFAULT_CLONE
        } else {
            DEFAULT_TASK
        };
        self.last_task
            .get(&key)
            .or_else(|| self.last_task_anywhere.get(&upid.task_type))
            .copied()
            .unwrap_or(default)
            .max(MIN_RECHECK)
    }

    /// What a guest started on `node` is expected to take: the last boot seen there, else on
    /// any node, else the default.
    fn expected_boot(&self, node: &str) -> Duration {
        self.last_boot
            .get(node)
            .copied()
            .or(self.last_boot_anywhere)
            .unwrap_or(DEFAULT_BOOT)
            .max(MIN_RECHECK)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn upid(kind: &str, node: &str, n: u32) -> Upid {
        Upid::new(node, n, 1, 1_700_000_000, kind, "101", "root@pam")
    }

    fn expected(clock: &PlainClock, kind: &str, node: &str) -> Duration {
        clock.lock().expected(&upid(kind, node, 99))
    }

    /// Makes `upid` look submitted `ago`, last seen running `running` after that.
    fn backdate(clock: &PlainClock, upid: &Upid, ago: Duration, running: Duration) {
        let mut state = clock.lock();
        let task = state.tasks.get_mut(upid.as_str()).expect("in flight");
        task.submitted = Instant::now() - ago;
        task.last_seen_running = running;
    }

    fn millis(waits: &[Duration]) -> Vec<u128> {
        waits.iter().map(Duration::as_millis).collect()
    }

    #[test]
    fn a_task_is_first_checked_after_the_default_then_twice_as_far_apart_up_to_a_cap() {
        let clock = PlainClock::default();
        let clone = upid("qmclone", "pve1", 1);
        assert_eq!(clock.submitted(&clone, "m1", "clone: x"), DEFAULT_CLONE);
        let resize = upid("qmresize", "pve1", 2);
        assert_eq!(clock.submitted(&resize, "m2", "resize: x"), DEFAULT_TASK);
        let remaining = clock.not_due(&clone).expect("not due before the default");
        assert!(remaining > DEFAULT_CLONE / 2, "{remaining:?}");
        let waits: Vec<Duration> = (0..7).map(|_| clock.still_running(&clone)).collect();
        assert_eq!(millis(&waits), [200, 400, 800, 1600, 3200, 5000, 5000]);
        let next = clock.not_due(&clone).expect("the last wait still runs");
        assert!(next > MAX_RECHECK / 2 && next <= MAX_RECHECK, "{next:?}");
        // Each task backs off on its own.
        assert_eq!(clock.still_running(&resize), MIN_RECHECK);
    }

    #[test]
    fn the_next_task_of_a_type_waits_what_the_last_one_took_on_its_node_or_anywhere() {
        let clock = PlainClock::default();
        let second = Duration::from_secs(1);
        // Found done at its first check, 3 s after it was submitted: it took at most that.
        let slow = upid("qmresize", "pve1", 1);
        clock.submitted(&slow, "m1", "resize: x");
        backdate(&clock, &slow, second * 3, Duration::ZERO);
        clock.finished(&slow);
        let on_pve1 = expected(&clock, "qmresize", "pve1");
        assert!(on_pve1 >= second * 3 && on_pve1 < second * 4, "{on_pve1:?}");
        assert_eq!(
            expected(&clock, "qmresize", "pve2"),
            on_pve1,
            "a node that saw none takes the last one anywhere"
        );
        assert_eq!(expected(&clock, "qmconfig", "pve1"), DEFAULT_TASK);
        assert_eq!(expected(&clock, "qmclone", "pve1"), DEFAULT_CLONE);
        // Seen running after 1 s and done after 2 s: the middle.
        let quick = upid("qmresize", "pve2", 2);
        clock.submitted(&quick, "m2", "resize: x");
        backdate(&clock, &quick, second * 2, second);
        clock.finished(&quick);
        let on_pve2 = expected(&clock, "qmresize", "pve2");
        assert!(
            on_pve2 >= second * 3 / 2 && on_pve2 < second * 2,
            "{on_pve2:?}"
        );
        assert_eq!(expected(&clock, "qmresize", "pve1"), on_pve1, "its own");
        assert_eq!(expected(&clock, "qmresize", "pve3"), on_pve2, "the last");
        // The next submission waits that.
        let next = clock.submitted(&upid("qmresize", "pve1", 3), "m3", "resize: x");
        assert_eq!(next, on_pve1);
        // A task seen done at once is not expected at (almost) nothing.
        let instant = upid("qmconfig", "pve1", 4);
        clock.submitted(&instant, "m4", "x");
        clock.finished(&instant);
        assert_eq!(expected(&clock, "qmconfig", "pve1"), MIN_RECHECK);
    }

    #[test]
    fn a_task_not_seen_submitted_or_checked_with_the_boot_teaches_nothing() {
        let clock = PlainClock::default();
        let unknown = upid("qmresize", "pve1", 1);
        assert_eq!(clock.still_running(&unknown), MIN_RECHECK);
        backdate(&clock, &unknown, Duration::from_secs(9), Duration::ZERO);
        clock.finished(&unknown);
        assert_eq!(expected(&clock, "qmresize", "pve1"), DEFAULT_TASK);

        let start = upid("qmstart", "pve1", 2);
        clock.submitted(&start, "m1", "start: x");
        clock.boot_started("m1", "pve1");
        let wait = clock.check_with_boot(&start, "m1");
        assert!(
            wait > DEFAULT_BOOT / 2 && wait <= DEFAULT_BOOT,
            "checked with the boot, not after a start's duration: {wait:?}"
        );
        backdate(&clock, &start, Duration::from_secs(9), Duration::ZERO);
        clock.finished(&start);
        assert_eq!(expected(&clock, "qmstart", "pve1"), DEFAULT_TASK);
    }

    #[test]
    fn a_guest_is_first_looked_at_after_the_last_boot_seen_then_twice_as_far_apart() {
        let clock = PlainClock::default();
        let second = Duration::from_secs(1);
        clock.boot_started("m1", "pve1");
        let first = clock.boot_not_due("m1").expect("not due at once");
        assert!(
            first > DEFAULT_BOOT / 2 && first <= DEFAULT_BOOT,
            "{first:?}"
        );
        let waits: Vec<Duration> = (0..7).map(|_| clock.boot_silent("m1", "pve1")).collect();
        assert_eq!(millis(&waits), [200, 400, 800, 1600, 3200, 5000, 5000]);
        // Started 4 s ago, never seen silent, and seen done now.
        clock.boot_started("m2", "pve1");
        clock.lock().booting.get_mut("m2").expect("booting").started = Instant::now() - second * 4;
        clock.boot_answered("m2");
        let on_pve1 = clock.lock().expected_boot("pve1");
        assert!(on_pve1 >= second * 4 && on_pve1 < second * 5, "{on_pve1:?}");
        clock.boot_started("m3", "pve1");
        assert!(
            clock
                .boot_not_due("m3")
                .is_some_and(|d| d > second * 3 && d <= on_pve1)
        );
        assert_eq!(clock.lock().expected_boot("pve2"), on_pve1, "anywhere");
        // Seen silent after 2 s and up after 4 s: the middle.
        clock.boot_started("m4", "pve2");
        {
            let mut state = clock.lock();
            let boot = state.booting.get_mut("m4").expect("booting");
            boot.started = Instant::now() - second * 4;
            boot.last_seen_silent = second * 2;
        }
        clock.boot_answered("m4");
        let on_pve2 = clock.lock().expected_boot("pve2");
        assert!(on_pve2 >= second * 3 && on_pve2 < second * 4, "{on_pve2:?}");
        assert_eq!(clock.lock().expected_boot("pve1"), on_pve1, "its own");
        // A guest this process did not start (after a restart) teaches nothing.
        assert!(clock.boot_remaining("m5", "pve3") > second * 2);
        clock.lock().booting.get_mut("m5").expect("booting").started = Instant::now() - second * 60;
        clock.boot_answered("m5");
        assert_eq!(clock.lock().expected_boot("pve3"), on_pve2);
    }
}
