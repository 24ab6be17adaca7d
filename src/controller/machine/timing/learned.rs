//! The learned task timing: expected durations are learned per task type and node from the
//! tasks this process has seen end. Proxmox reports no end time, so each finished task's
//! duration is estimated as the middle of the interval it is known to have ended in (after the
//! last check that saw it running, before the check that saw it stopped); the estimate is the
//! median of the recent ones, which follows the real duration instead of the polling interval.
//!
//! Clones queue on their node (Proxmox's storage I/O, the simulator's clone slots): a clone
//! submitted behind others is checked once at the usual duration of a clone, which tells
//! whether the node runs clones side by side. On a node that runs them one after another, only
//! the clone ahead of the others is checked (each check lists the node's tasks, which tells of
//! the clones behind too), and each end it sees times the queue behind it anew. A VM's start
//! is checked when guests on its node are usually up, so the pass that sees it end looks at the
//! guest. Until some guest was seen up, one guest (the scout, booting longest) is looked at often
//! and the others just after it: the time the scout was first seen up is what they then wait.

use super::Beside;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::guest::GuestBoot;
use super::ledger::Ledger;
use super::{
    DEFAULT_BOOT, DEFAULT_CLONE, DEFAULT_TASK, MAX_IN_FLIGHT, MAX_RECHECK, MIN_RECHECK, NextInLine,
    TaskTiming, estimate,
};
use crate::controller::machine::TaskKind;
use crate::controller::node_tasks::queues_on_node;
use crate::proxmox::Upid;

/// A booting guest whose look would come before this long after the scout's (the guest
/// booting longest, while no boot was seen end) waits for the scout's answer instead.
const AFTER_SCOUT: Duration = Duration::from_millis(100);
/// A scout whose look is this far overdue no longer holds the other guests back (its machine
/// was deleted, or its passes are stuck).
const SCOUT_STALE: Duration = Duration::from_secs(2);
/// A scout that has booted this long without answering no longer holds the other guests
/// back: they are looked at on their own schedules.
const SCOUT_HOLD: Duration = Duration::from_secs(60);
/// Shortest requeue while a scout task runs (the first of its type while none was seen end):
/// its end is what every task like it then waits.
const SCOUT_RECHECK: Duration = Duration::from_millis(100);
/// Finished tasks remembered per (task type, node) for the median.
const SAMPLES: usize = 15;
/// Samples from all nodes before they bound one node's queued task durations.
const POOLED_BOUND_SAMPLES: usize = 5;
/// A task in flight not checked for this long after it was due is left out of the queue on
/// its node (its machine was deleted, or the process lost track of it).
const STALE_IN_FLIGHT: Duration = Duration::from_secs(30);
/// How long a node seen running queued tasks one after another is taken to still do so: a
/// queued task submitted then skips the check at a lone task's duration.
const QUEUEING_REMEMBERED: Duration = Duration::from_secs(60);
/// Requeue of a pass whose task waits its turn behind a running one on its node: the turn
/// wakes it, so this only bounds the wait when that wake does not come (the machine ahead was
/// removed).
const TURN_RECHECK: Duration = Duration::from_secs(30);

/// When this process expects Proxmox tasks to end, so a machine is looked at again then and
/// not before, whatever wakes it meanwhile (its CAPI Machine changing, for one).
#[derive(Default)]
pub struct LearnedClock {
    inner: Mutex<ClockState>,
}

#[derive(Default)]
struct ClockState {
    /// What the reconciler relies on, whatever the timing.
    ledger: Ledger,
    /// Tasks this process submitted or saw running.
    in_flight: InFlightTasks,
    /// Recent estimated durations per (task type, node), oldest first.
    learned: HashMap<(String, String), VecDeque<Duration>>,
    /// Machines whose VM this process started and whose guest has not answered yet.
    booting: HashMap<String, Booting>,
    /// Recent estimated boot durations (start request to cloud-init done) per node.
    boots_learned: HashMap<String, VecDeque<Duration>>,
    /// Per (task type, node), when a queued task was last seen still running at its first
    /// check, which came when such a task usually ends: the node runs them one after another.
    /// Forgotten when a queued one is found done at that check.
    queueing_seen: HashMap<(String, String), Instant>,
}

struct Booting {
    guest: GuestBoot,
    /// Its look was held back until the scout's answer: when it answers says nothing about
    /// how long it took.
    held_for_scout: bool,
}

impl std::ops::Deref for Booting {
    type Target = GuestBoot;

    fn deref(&self) -> &GuestBoot {
        &self.guest
    }
}

impl std::ops::DerefMut for Booting {
    fn deref_mut(&mut self) -> &mut GuestBoot {
        &mut self.guest
    }
}

struct InFlight {
    /// The key of the machine that submitted it (empty for a task this process did not submit).
    machine: String,
    task_type: String,
    node: String,
    submitted: Instant,
    /// How long after submission a check last saw it running.
    last_seen_running: Duration,
    /// When to check it next.
    due: Instant,
    /// When it is expected to end: after the tasks of its kind queued ahead of it on its node.
    expected_end: Instant,
    /// Tasks of its kind that were in flight on its node when it was submitted.
    queued_behind: usize,
    /// Queued: when the task ahead of it was seen done, about when it began to run.
    queue_left: Option<Instant>,
    /// Its check waits for the guest's usual boot time (a start): how long it took says
    /// nothing about tasks like it.
    checked_with_boot: bool,
    /// Queued behind others on a node known to run such tasks one after another, it was first
    /// checked at its expected end, not when such a task usually ends.
    first_check_deferred: bool,
    /// Submitted while no task of its type was seen end: the scout is checked early and often,
    /// the others at the default, which says too little to learn from.
    scouting: Scouting,
}

/// A task's part in learning the duration of its type while none was seen end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Scouting {
    /// Its type's duration is known (or the type is not scouted).
    No,
    /// Checked early and often: when it is first seen done is what the others then wait.
    Scout,
    /// Submitted while another scouted: checked at the default, and teaches nothing.
    Held,
}

impl InFlight {
    fn new(upid: &Upid, now: Instant) -> Self {
        InFlight {
            machine: String::new(),
            task_type: upid.task_type.clone(),
            node: upid.site_node().to_owned(),
            submitted: now,
            last_seen_running: Duration::ZERO,
            due: now,
            expected_end: now,
            queued_behind: 0,
            queue_left: None,
            checked_with_boot: false,
            first_check_deferred: false,
            scouting: Scouting::No,
        }
    }

    /// Whether it counts in the queue of its kind on `upid`'s node at `now`.
    fn queues_with(&self, upid: &Upid, now: Instant) -> bool {
        self.task_type == upid.task_type
            && self.node == upid.site_node()
            && self.due + STALE_IN_FLIGHT > now
    }
}

/// The tasks in flight by UPID, kept by (task type, node): what a task waits for is its own
/// queue, and a fleet's queues together hold a task per machine.
#[derive(Default)]
struct InFlightTasks {
    queues: HashMap<(String, String), HashMap<String, InFlight>>,
    queue_of: HashMap<String, (String, String)>,
}

impl InFlightTasks {
    fn len(&self) -> usize {
        self.queue_of.len()
    }

    fn get(&self, upid: &str) -> Option<&InFlight> {
        self.queues.get(self.queue_of.get(upid)?)?.get(upid)
    }

    fn get_mut(&mut self, upid: &str) -> Option<&mut InFlight> {
        self.queues.get_mut(self.queue_of.get(upid)?)?.get_mut(upid)
    }

    fn insert(&mut self, upid: &str, task: InFlight) {
        self.remove(upid);
        let queue = (task.task_type.clone(), task.node.clone());
        self.queue_of.insert(upid.to_owned(), queue.clone());
        self.queues
            .entry(queue)
            .or_default()
            .insert(upid.to_owned(), task);
    }

    fn remove(&mut self, upid: &str) -> Option<InFlight> {
        let queue = self.queue_of.remove(upid)?;
        let tasks = self.queues.get_mut(&queue)?;
        let task = tasks.remove(upid);
        if tasks.is_empty() {
            self.queues.remove(&queue);
        }
        task
    }

    /// The task `upid` names, first noted as `upid` describes it (submitted `now`).
    fn get_or_insert(&mut self, upid: &Upid, now: Instant) -> &mut InFlight {
        let queue = self
            .queue_of
            .entry(upid.as_str().to_owned())
            .or_insert_with(|| (upid.task_type.clone(), upid.site_node().to_owned()))
            .clone();
        self.queues
            .entry(queue)
            .or_default()
            .entry(upid.as_str().to_owned())
            .or_insert_with(|| InFlight::new(upid, now))
    }

    fn iter(&self) -> impl Iterator<Item = (&String, &InFlight)> {
        self.queues.values().flatten()
    }

    fn values(&self) -> impl Iterator<Item = &InFlight> {
        self.iter().map(|(_, task)| task)
    }

    /// The tasks of `upid`'s type on its node (`upid`'s own included).
    fn queue(&self, upid: &Upid) -> impl Iterator<Item = (&String, &InFlight)> + Clone {
        self.queues
            .get(&(upid.task_type.clone(), upid.site_node().to_owned()))
            .into_iter()
            .flatten()
    }

    fn queue_mut(&mut self, upid: &Upid) -> impl Iterator<Item = (&String, &mut InFlight)> {
        self.queues
            .get_mut(&(upid.task_type.clone(), upid.site_node().to_owned()))
            .into_iter()
            .flatten()
    }
}

impl TaskTiming for LearnedClock {
    fn submitted(&self, upid: &Upid, machine: &str, purpose: &str) -> Duration {
        let now = Instant::now();
        let mut state = self.lock();
        state.ledger.submitted(upid, machine, purpose);
        let scouting = state.scouting(upid, now);
        let expected = match scouting {
            Scouting::Scout => SCOUT_RECHECK,
            Scouting::No | Scouting::Held => state.expected(upid),
        };
        let (queued_behind, queue_end) = if queues_on_node(&upid.task_type) {
            let ahead = state
                .in_flight
                .queue(upid)
                .filter(|(_, task)| task.queues_with(upid, now))
                .map(|(_, task)| task.expected_end);
            (ahead.clone().count(), ahead.max())
        } else {
            (0, None)
        };
        if state.in_flight.len() >= MAX_IN_FLIGHT
            && let Some(oldest) = state
                .in_flight
                .iter()
                .min_by_key(|(_, t)| t.submitted)
                .map(|(k, _)| k.clone())
        {
            state.in_flight.remove(&oldest);
        }
        state.in_flight.insert(
            upid.as_str(),
            InFlight {
                machine: machine.to_owned(),
                due: now + expected,
                expected_end: queue_end.map_or(now, |end| end.max(now)) + expected,
                queued_behind,
                scouting,
                ..InFlight::new(upid, now)
            },
        );
        // Behind others on a node that runs them one after another: no pass until its turn.
        state.waiting_turn(upid, now).unwrap_or(expected)
    }

    /// Notes that the task `upid`, which started `machine`'s VM on its node, is checked no
    /// earlier than when guests there usually are done booting, so one pass sees the start
    /// end and looks at the guest; returns the requeue until then.
    fn check_with_boot(&self, upid: &Upid, machine: &str) -> Duration {
        let now = Instant::now();
        let mut state = self.lock();
        let boot_due = state.booting.get(machine).map(|boot| boot.due);
        let Some(task) = state.in_flight.get_mut(upid.as_str()) else {
            return MIN_RECHECK;
        };
        if let Some(boot_due) = boot_due {
            task.due = task.due.max(boot_due);
            task.checked_with_boot = true;
        }
        task.due.saturating_duration_since(now).max(MIN_RECHECK)
    }

    /// Notes that a task of `kind` submitted for `machine` succeeded; returns how many of that
    /// kind it saw succeed in a row (0 for a task of unknown purpose, which counts as none).
    fn succeeded(&self, machine: &str, kind: Option<TaskKind>) -> u32 {
        self.lock().ledger.succeeded(machine, kind, Instant::now())
    }

    /// The task this process submitted for `machine` and has not seen end, with its purpose.
    fn in_flight_for(&self, machine: &str) -> Option<(Arc<Upid>, String)> {
        self.lock().ledger.in_flight_for(machine)
    }

    /// How long until the task is worth checking, if it is not yet: `None` means check now
    /// (also for a task this process did not submit, e.g. after a restart).
    fn not_due(&self, upid: &Upid) -> Option<Duration> {
        let now = Instant::now();
        let mut state = self.lock();
        if state.ledger.seen_listed_ended(upid.as_str()) {
            return None;
        }
        if let Some(turn) = state.waiting_turn(upid, now) {
            return Some(turn);
        }
        let task = state.in_flight.get(upid.as_str())?;
        let (mut due, with_boot) = (
            task.due,
            task.checked_with_boot.then(|| task.machine.clone()),
        );
        // A start checked with its guest follows the guest's look as it moves (what was learned
        // since, a scout's answer awaited): a pass before it would only wait for the guest.
        if let Some(boot_due) = with_boot.and_then(|machine| state.boot_due(&machine, now)) {
            due = due.max(boot_due);
        }
        (due > now + Duration::from_millis(20)).then(|| pass_requeue(&upid.task_type, due - now))
    }

    /// Notes that a check saw the task still running; returns the requeue until the next
    /// check: its expected end when that is still ahead (a clone queued behind others; the pass
    /// then comes back at least every few seconds without checking), else a quarter of the time
    /// it has run so far, within bounds.
    fn still_running(&self, upid: &Upid) -> Duration {
        let now = Instant::now();
        let mut state = self.lock();
        let expected = state.expected(upid);
        let entry = state.in_flight.get_or_insert(upid, now);
        let ran = now - entry.submitted;
        let first_check = entry.last_seen_running.is_zero() && !entry.first_check_deferred;
        let queued = entry.queued_behind > 0;
        entry.last_seen_running = ran;
        let shortest = if entry.scouting == Scouting::Scout {
            SCOUT_RECHECK
        } else {
            MIN_RECHECK
        };
        // The task next in line has run only since the one ahead of it ended, not since its
        // submission; the others still wait behind it and are rechecked as rarely as before.
        let running_for = if queued && entry.queue_left.is_some() {
            expected
        } else {
            ran
        };
        let wait = match entry.expected_end.checked_duration_since(now) {
            Some(remaining) if remaining >= shortest => remaining,
            _ => (running_for / 4).clamp(shortest, MAX_RECHECK),
        };
        entry.due = now + wait;
        if queued && first_check {
            state
                .queueing_seen
                .insert((upid.task_type.clone(), upid.site_node().to_owned()), now);
        }
        pass_requeue(&upid.task_type, wait)
    }

    /// Notes that a check saw the task stopped, and learns its duration if this process saw
    /// it start.
    fn finished(&self, upid: &Upid) -> Option<NextInLine> {
        let now = Instant::now();
        let mut state = self.lock();
        state.ledger.task_ended(upid);
        let task = state.in_flight.remove(upid.as_str())?;
        let next = if queues_on_node(&upid.task_type) {
            state.queue_moved_on(upid, task.submitted, now)
        } else {
            None
        };
        // A queued task seen running ran for the tasks ahead of it too; one found done at its
        // first check took at most the time since it was submitted, and shows that its node
        // runs such tasks side by side.
        let queued = task.queued_behind > 0;
        if queued && task.last_seen_running.is_zero() && !task.first_check_deferred {
            state
                .queueing_seen
                .remove(&(upid.task_type.clone(), upid.site_node().to_owned()));
        }
        let waited_in_queue =
            queued && (!task.last_seen_running.is_zero() || task.first_check_deferred);
        if task.checked_with_boot || task.scouting == Scouting::Held {
            return next;
        }
        // A queued task seen running after the one ahead of it was seen done teaches how long
        // it ran from then; found done at once, it may have run long before that was seen.
        let seen_running_at = task.submitted + task.last_seen_running;
        let (since, last_seen_running) = match task.queue_left {
            Some(left) if queued && !task.last_seen_running.is_zero() && seen_running_at > left => {
                (left, seen_running_at - left)
            }
            _ if waited_in_queue => return next,
            _ => (task.submitted, task.last_seen_running),
        };
        let samples = state
            .learned
            .entry((upid.task_type.clone(), upid.site_node().to_owned()))
            .or_default();
        // A scout is checked so often that when it was seen done is close to its end, and
        // a task like it checked then is done.
        let last_seen_running = match task.scouting {
            Scouting::Scout => Duration::ZERO,
            Scouting::No | Scouting::Held => last_seen_running,
        };
        learn(
            samples,
            last_seen_running,
            now.saturating_duration_since(since),
        );
        next
    }

    fn listed_with(&self, upid: &Upid) -> Beside {
        self.lock().ledger.beside(upid)
    }

    fn listed_ended_beside(&self, checked: &Upid, ended: &dyn Fn(&Upid) -> bool) -> Vec<String> {
        self.lock().ledger.listed_ended_beside(checked, ended)
    }

    /// Forgets a task nobody will check again.
    fn forget(&self, upid: &Upid) {
        let mut state = self.lock();
        state.in_flight.remove(upid.as_str());
        state.ledger.task_ended(upid);
    }

    /// Notes that `machine`'s VM on `node` was just asked to start: its guest is looked at
    /// when guests on that node usually are done booting.
    fn boot_started(&self, machine: &str, node: &str) {
        let now = Instant::now();
        let mut state = self.lock();
        if state.booting.len() >= MAX_IN_FLIGHT {
            state.booting.clear();
        }
        let expected = state.expected_boot(node);
        state.ledger.vm_started(machine);
        state.booting.insert(
            machine.to_owned(),
            Booting {
                guest: GuestBoot::new(node, now, now + expected),
                held_for_scout: false,
            },
        );
    }

    /// How long until `machine`'s booting guest is worth looking at, if it is not yet. What was
    /// learned since the guest's look was planned counts: it is not looked at before guests on
    /// its node are now known to be up. While no boot was seen end, only the guest booting
    /// longest (the scout) is looked at on its own schedule; the others wait for its answer,
    /// which wakes them, or until it would no longer hold them (its look long overdue).
    fn boot_not_due(&self, machine: &str) -> Option<Duration> {
        let now = Instant::now();
        let due = self.lock().boot_due(machine, now)?;
        (due > now + Duration::from_millis(20)).then(|| due - now)
    }

    /// How long until `machine`'s guest, started on `node`, is usually done booting (not
    /// less than a short recheck): when a guest is first looked at, without a look now. A guest
    /// this process did not start (after a restart) counts as started now.
    fn boot_remaining(&self, machine: &str, node: &str) -> Duration {
        let now = Instant::now();
        let mut state = self.lock();
        let expected = state.expected_boot(node);
        let entry = state.booting_entry(machine, node, now, now + expected);
        entry.due.saturating_duration_since(now).max(MIN_RECHECK)
    }

    /// Notes that `machine`'s guest is not done booting; returns the requeue until the next
    /// look: the usual boot time on its node if that is still ahead, else a quarter of the time
    /// it has booted so far, within bounds; for the scout, a sixteenth: the time it is first
    /// seen up is what every other guest then waits.
    fn boot_silent(&self, machine: &str, node: &str) -> Duration {
        let now = Instant::now();
        let mut state = self.lock();
        let expected = state.expected_boot(node);
        let scouting = state.scout(now).is_some_and(|(scout, _)| scout == machine);
        let entry = state.booting_entry(machine, node, now, now);
        let booted_for = now - entry.started;
        entry.last_seen_silent = booted_for;
        let step = if scouting {
            booted_for / 16
        } else {
            booted_for / 4
        };
        let wait = expected
            .checked_sub(booted_for)
            .filter(|remaining| *remaining >= MIN_RECHECK)
            .unwrap_or(step.clamp(MIN_RECHECK, MAX_RECHECK));
        entry.due = now + wait;
        wait
    }

    /// Notes that `machine`'s guest is done booting, and learns how long that took if this
    /// process started it and looked at it on its own schedule. What is learned is when the
    /// guest was first seen up: a guest like it looked at then is up, where the middle of the
    /// last silent and the first answered look can be too early, and a look found silent costs
    /// a request and a wait.
    fn boot_answered(&self, machine: &str) -> Vec<String> {
        let now = Instant::now();
        let mut state = self.lock();
        let Some(boot) = state.booting.remove(machine) else {
            return Vec::new();
        };
        if boot.held_for_scout {
            return Vec::new();
        }
        let up = now - boot.started;
        let samples = state.boots_learned.entry(boot.guest.node).or_default();
        learn(samples, Duration::ZERO, up);
        // The guests that waited for this answer are looked at when it says they are up.
        let mut held = Vec::new();
        for (key, boot) in &mut state.booting {
            if boot.held_for_scout && boot.due > now {
                boot.due = now;
                held.push(key.clone());
            }
        }
        held
    }

    /// Notes that `machine`'s guest in VM `vmid` is up and the machine provisioned; returns
    /// whether this process already knew.
    fn guest_up(&self, machine: &str, vmid: u32) -> bool {
        self.lock().ledger.guest_up(machine, vmid)
    }

    /// Whether this process saw `machine`'s guest in VM `vmid` up since it last started it.
    fn seen_up(&self, machine: &str, vmid: u32) -> bool {
        self.lock().ledger.seen_up(machine, vmid)
    }
}

impl LearnedClock {
    /// The expected duration of a task like `upid` (same type, same node).
    #[cfg(test)]
    fn expected(&self, upid: &Upid) -> Duration {
        self.lock().expected(upid)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ClockState> {
        // A panic while holding this lock cannot leave the state inconsistent (every update
        // is a single insert or remove), so a poisoned lock is used as it is.
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl ClockState {
    /// When `machine`'s booting guest is worth looking at (see [`TaskTiming::boot_not_due`]),
    /// if it boots.
    fn boot_due(&mut self, machine: &str, now: Instant) -> Option<Instant> {
        let node = self.booting.get(machine)?.node.clone();
        let expected = self.expected_boot(&node);
        let scout_due = self.scout_due(machine, now);
        let boot = self.booting.get_mut(machine)?;
        boot.due = boot.due.max(boot.started + expected);
        if let Some(scout_due) = scout_due
            && scout_due.max(now) + AFTER_SCOUT > boot.due
        {
            boot.due = scout_due.max(now) + SCOUT_STALE;
            boot.held_for_scout = true;
        }
        Some(boot.due)
    }

    /// `machine`'s boot, counted as started `now` (due at `due`) when this process did not
    /// start it.
    fn booting_entry(
        &mut self,
        machine: &str,
        node: &str,
        now: Instant,
        due: Instant,
    ) -> &mut Booting {
        self.booting
            .entry(machine.to_owned())
            .or_insert_with(|| Booting {
                guest: GuestBoot::new(node, now, due),
                held_for_scout: false,
            })
    }

    /// A task like `upid` was seen done on its node at `now`: the tasks queued there after it
    /// began by then, so each ends at most a task's duration after the one ahead of it. Their
    /// expected ends (and checks) move forward to that where it is sooner: an estimate that was
    /// too long does not add up along the queue. Returns the machine of the task next in line
    /// when its check moved sooner: its requeue, set before, would come late.
    fn queue_moved_on(
        &mut self,
        upid: &Upid,
        submitted: Instant,
        now: Instant,
    ) -> Option<NextInLine> {
        // Durations are counted from when this process saw the request answered, a little
        // after Proxmox began the task: a twentieth more keeps the checks from coming early.
        let expected = self.expected(upid) * 21 / 20;
        if let Some((_, next_in_line)) = self
            .in_flight
            .queue_mut(upid)
            .filter(|(_, task)| task.queues_with(upid, now))
            .min_by_key(|(_, task)| task.submitted)
        {
            next_in_line.queue_left.get_or_insert(now);
        }
        if self.queueing(upid, now) {
            return self.queue_timed_anew(upid, submitted, now, expected);
        }
        let mut behind: Vec<&mut InFlight> = self
            .in_flight
            .queue_mut(upid)
            .map(|(_, task)| task)
            .filter(|task| task.queues_with(upid, now) && task.expected_end > now)
            .collect();
        behind.sort_by_key(|task| task.expected_end);
        let mut end = now;
        let mut next = None;
        for (place, task) in behind.into_iter().enumerate() {
            end += expected;
            if end < task.expected_end {
                task.expected_end = end;
                let due = task.due.min(end.max(now));
                if place == 0 && due < task.due && !task.machine.is_empty() {
                    next = Some(NextInLine {
                        machine: task.machine.clone(),
                        due_in: due - now,
                    });
                }
                task.due = due;
            }
        }
        next
    }

    /// On a node that runs tasks like `upid` one after another, the one seen done at `now` lets
    /// the next begin: each task submitted after it (at `submitted`) ends a task's duration (`expected`) after the one
    /// ahead of it, later as well as sooner than first thought (an estimate that was too short
    /// would have its checks find it waiting). Returns the machine next in line, woken to be
    /// checked when its turn should end.
    fn queue_timed_anew(
        &mut self,
        upid: &Upid,
        submitted: Instant,
        now: Instant,
        expected: Duration,
    ) -> Option<NextInLine> {
        let listed_ended = &self.ledger;
        let mut behind: Vec<&mut InFlight> = self
            .in_flight
            .queue_mut(upid)
            .filter(|(key, task)| {
                task.queues_with(upid, now)
                    && task.submitted > submitted
                    && !listed_ended.seen_listed_ended(key)
            })
            .map(|(_, task)| task)
            .collect();
        behind.sort_by_key(|task| task.submitted);
        let mut end = now;
        for task in &mut behind {
            end += expected;
            task.expected_end = end;
            task.due = end;
        }
        behind
            .first()
            .filter(|task| !task.machine.is_empty())
            .map(|task| NextInLine {
                machine: task.machine.clone(),
                due_in: task.due - now,
            })
    }

    /// On a node known to run tasks like `upid` one after another, its first check is put off
    /// to its expected end (the check at a lone task's duration would only find it running);
    /// while one ahead of it runs, the pass waits for that one's end, which wakes it
    /// (`queue_moved_on`; the checks of that one list the node and tell of this one too).
    /// Returns the requeue while it waits its turn.
    fn waiting_turn(&mut self, upid: &Upid, now: Instant) -> Option<Duration> {
        let queueing = self.queueing(upid, now);
        let waits_its_turn = queueing && self.unfinished_ahead(upid, now);
        if waits_its_turn {
            // A queue still waits behind a running task: the node is taken to still run them
            // one after another (a queue on a node that runs them side by side only waits
            // longer to be noticed: the lists of the task ahead show the ends behind it).
            self.queueing_seen
                .insert((upid.task_type.clone(), upid.site_node().to_owned()), now);
        }
        let task = self.in_flight.get_mut(upid.as_str())?;
        if queueing && task.queued_behind > 0 && task.last_seen_running.is_zero() {
            task.first_check_deferred = true;
            task.due = task.due.max(task.expected_end);
        }
        if waits_its_turn {
            task.due = task.due.max(now);
            return Some(TURN_RECHECK);
        }
        None
    }

    /// Whether the node of `upid` was seen running tasks like it one after another, lately.
    fn queueing(&self, upid: &Upid, now: Instant) -> bool {
        self.queueing_seen
            .get(&(upid.task_type.clone(), upid.site_node().to_owned()))
            .is_some_and(|seen| now.duration_since(*seen) < QUEUEING_REMEMBERED)
    }

    /// Whether a task like `upid`, submitted before it on its node, is in flight and not seen
    /// end (by its check or a node's task list).
    fn unfinished_ahead(&self, upid: &Upid, now: Instant) -> bool {
        let Some(submitted) = self.in_flight.get(upid.as_str()).map(|task| task.submitted) else {
            return false;
        };
        self.in_flight.queue(upid).any(|(other, task)| {
            task.queues_with(upid, now)
                && task.submitted < submitted
                && !self.ledger.seen_listed_ended(other)
        })
    }

    /// While no boot was seen end, the guest booting longest (ties by machine) whose look is
    /// not long overdue: the scout.
    fn scout(&self, now: Instant) -> Option<(&str, &Booting)> {
        if self
            .boots_learned
            .values()
            .any(|samples| !samples.is_empty())
        {
            return None;
        }
        self.booting
            .iter()
            .filter(|(_, boot)| boot.due + SCOUT_STALE > now)
            .min_by_key(|(key, boot)| (boot.started, key.as_str()))
            .map(|(key, boot)| (key.as_str(), boot))
    }

    /// When the scout is looked at next, if `machine` waits for it: not the scout itself, and
    /// only while the scout has booted for less than [`SCOUT_HOLD`] (a guest that never answers
    /// holds no one back for long).
    fn scout_due(&self, machine: &str, now: Instant) -> Option<Instant> {
        let (scout, boot) = self.scout(now)?;
        (scout != machine && boot.started + SCOUT_HOLD > now).then_some(boot.due)
    }

    /// The usual boot time on `node`; before any was seen there, that of the other nodes'
    /// guests (how long a guest takes depends on its image more than on its node); before any
    /// was seen at all, at least as long as a guest booting now was seen not done.
    fn expected_boot(&self, node: &str) -> Duration {
        if let Some(samples) = self.boots_learned.get(node).filter(|s| !s.is_empty()) {
            return median(samples).max(MIN_RECHECK);
        }
        let pooled: VecDeque<Duration> = self.boots_learned.values().flatten().copied().collect();
        if !pooled.is_empty() {
            return median(&pooled).max(MIN_RECHECK);
        }
        self.booting
            .values()
            .map(|boot| boot.last_seen_silent)
            .max()
            .map_or(DEFAULT_BOOT, |silent| silent.max(DEFAULT_BOOT))
    }

    /// The usual duration of tasks like `upid` on its node; before one was seen end there,
    /// that of such tasks on the other nodes (clones excepted: how long they take depends on
    /// the node's storage and queue).
    fn expected(&self, upid: &Upid) -> Duration {
        let key = (upid.task_type.clone(), upid.site_node().to_owned());
        // Gathered only where used: every node's samples, on each pass that times a task.
        let pooled = || -> VecDeque<Duration> {
            self.learned
                .iter()
                .filter(|((task_type, _), _)| *task_type == upid.task_type)
                .flat_map(|(_, samples)| samples.iter().copied())
                .collect()
        };
        if let Some(samples) = self.learned.get(&key).filter(|s| !s.is_empty()) {
            let on_node = median(samples);
            // A node's queue is timed by its own clones; an outlier among its few samples (a
            // slow first clone) would time the whole queue, so the other nodes' bound it.
            let bound = match queues_on_node(&upid.task_type).then(pooled) {
                Some(pooled) if pooled.len() >= POOLED_BOUND_SAMPLES => median(&pooled) * 3 / 2,
                _ => on_node,
            };
            return on_node.min(bound).max(MIN_RECHECK);
        }
        if queues_on_node(&upid.task_type) {
            return DEFAULT_CLONE;
        }
        let pooled = pooled();
        if pooled.is_empty() {
            DEFAULT_TASK
        } else {
            median(&pooled).max(MIN_RECHECK)
        }
    }

    /// The part a task like `upid`, submitted `now`, takes in learning its type's duration:
    /// while no task of its type was seen end anywhere, the first one in flight scouts and the
    /// others are held. Clones are not scouted (they queue on their node, which the clock
    /// learns otherwise).
    fn scouting(&self, upid: &Upid, now: Instant) -> Scouting {
        let seen_end = self
            .learned
            .iter()
            .any(|((task_type, _), samples)| *task_type == upid.task_type && !samples.is_empty());
        if seen_end || queues_on_node(&upid.task_type) {
            return Scouting::No;
        }
        let scout_in_flight = self.in_flight.values().any(|task| {
            task.scouting == Scouting::Scout
                && task.task_type == upid.task_type
                && task.due + STALE_IN_FLIGHT > now
        });
        if scout_in_flight {
            Scouting::Held
        } else {
            Scouting::Scout
        }
    }
}

/// Adds to `samples` (the most recent [`SAMPLES`]) how long something took that was last seen
/// unfinished `last_seen_busy` after it began (zero: never) and seen done `seen_done` after
/// (see [`estimate`]).
fn learn(samples: &mut VecDeque<Duration>, last_seen_busy: Duration, seen_done: Duration) {
    if samples.len() == SAMPLES {
        samples.pop_front();
    }
    samples.push_back(estimate(last_seen_busy, seen_done));
}

/// The middle of `samples` (not empty).
fn median(samples: &VecDeque<Duration>) -> Duration {
    let mut sorted: Vec<Duration> = samples.iter().copied().collect();
    sorted.sort();
    sorted.get(sorted.len() / 2).copied().unwrap_or_default()
}

/// The requeue of a pass whose task's check is `until_check` away: a task queued on its node
/// comes back within [`MAX_RECHECK`] (without a check), since a task ahead of it seen done may
/// bring its check forward.
fn pass_requeue(task_type: &str, until_check: Duration) -> Duration {
    if queues_on_node(task_type) {
        until_check.min(MAX_RECHECK)
    } else {
        until_check
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    impl LearnedClock {
        /// Guests on `node` were seen up `boot` after their start, recently and only so.
        fn boots_learned_on(&self, node: &str, boot: Duration) {
            self.lock().boots_learned.insert(node.into(), [boot].into());
        }
    }

    fn upid(kind: &str, node: &str, n: u32) -> Upid {
        Upid::new(node, n, 1, 1_700_000_000, kind, "101", "root@pam")
    }

    #[test]
    fn a_tasks_queue_holds_the_tasks_of_its_type_on_its_node_and_no_others() {
        let now = Instant::now();
        let mut tasks = InFlightTasks::default();
        let clone1 = upid("qmclone", "pve1", 1);
        let clone2 = upid("qmclone", "pve1", 2);
        let elsewhere = upid("qmclone", "pve1", 3).at_site("https://b:8006");
        let start = upid("qmstart", "pve1", 4);
        for task in [&clone1, &clone2, &elsewhere, &start] {
            tasks.insert(task.as_str(), InFlight::new(task, now));
        }
        let queue = |tasks: &InFlightTasks, of: &Upid| {
            let mut upids: Vec<String> = tasks.queue(of).map(|(key, _)| key.clone()).collect();
            upids.sort();
            upids
        };
        assert_eq!(queue(&tasks, &clone2), [clone1.as_str(), clone2.as_str()]);
        assert_eq!(queue(&tasks, &elsewhere), [elsewhere.as_str()]);
        assert_eq!(tasks.len(), 4);
        assert!(tasks.remove(clone1.as_str()).is_some());
        assert!(tasks.remove(clone1.as_str()).is_none(), "removed once");
        assert_eq!(queue(&tasks, &clone2), [clone2.as_str()]);
        tasks.get_or_insert(&clone1, now).due = now + DEFAULT_CLONE;
        assert_eq!(queue(&tasks, &clone1), [clone1.as_str(), clone2.as_str()]);
        assert_eq!(
            tasks.get(clone1.as_str()).map(|task| task.due),
            Some(now + DEFAULT_CLONE)
        );
        for task in [&clone1, &clone2, &elsewhere, &start] {
            tasks.remove(task.as_str());
        }
        assert!(
            tasks.queues.is_empty() && tasks.queue_of.is_empty(),
            "nothing kept of a queue once its tasks are gone"
        );
    }

    #[test]
    fn while_no_boot_was_learned_only_the_scout_is_looked_at_and_the_others_wait_for_its_answer() {
        let clock = LearnedClock::default();
        clock.boot_started("scout", "pve1");
        clock.boot_started("other", "pve2");
        let scout_first = clock.boot_not_due("scout").expect("not due at once");
        let other_first = clock.boot_not_due("other").expect("not due at once");
        assert!(
            other_first >= scout_first + SCOUT_STALE - Duration::from_millis(50)
                && other_first <= scout_first + SCOUT_STALE,
            "the other guest waits for the scout's answer, or until the scout no longer holds it: {scout_first:?}, {other_first:?}"
        );
        // The scout, seen not done after 4 s, is looked at again after a sixteenth of that; the
        // other guest only after that look.
        let four_seconds_ago = Instant::now() - DEFAULT_BOOT * 2;
        clock
            .lock()
            .booting
            .get_mut("scout")
            .expect("booting")
            .started = four_seconds_ago;
        let scout_wait = clock.boot_silent("scout", "pve1");
        assert!(
            scout_wait >= MIN_RECHECK && scout_wait <= DEFAULT_BOOT / 4,
            "{scout_wait:?}"
        );
        let other_wait = clock.boot_not_due("other").expect("held");
        assert!(other_wait > scout_wait, "{other_wait:?}");
        // The scout's boot is learned as the time it was first seen up (not the middle of its
        // last silent look and that one); the held guest's teaches nothing.
        assert_eq!(
            clock.boot_answered("scout"),
            ["other"],
            "the scout's answer wakes the guest that waited for it"
        );
        let learned = clock.lock().boots_learned["pve1"].clone();
        assert!(
            clock.boot_not_due("other").is_some_and(|d| d <= learned[0]),
            "then looked at when guests are known to be up"
        );
        assert!(
            learned.len() == 1 && learned[0] >= DEFAULT_BOOT * 2,
            "{learned:?}"
        );
        clock.boot_answered("other");
        assert!(
            clock
                .lock()
                .boots_learned
                .get("pve2")
                .is_none_or(VecDeque::is_empty)
        );
        // Once a boot was learned, no guest waits for another.
        clock.boot_started("late", "pve2");
        assert!(clock.boot_not_due("late").is_some_and(|d| d <= learned[0]));
        assert!(clock.lock().scout_due("late", Instant::now()).is_none());
    }

    #[test]
    fn a_scout_whose_look_is_long_overdue_holds_no_one_back() {
        let clock = LearnedClock::default();
        clock.boot_started("gone", "pve1");
        clock.boot_started("other", "pve1");
        assert!(clock.lock().scout_due("other", Instant::now()).is_some());
        let overdue = Instant::now() - SCOUT_STALE * 2;
        clock.lock().booting.get_mut("gone").expect("booting").due = overdue;
        assert!(
            clock.lock().scout_due("other", Instant::now()).is_none(),
            "its machine was deleted mid-boot, or its passes are stuck"
        );
        // A scout that does not answer for long holds no one back either.
        clock.boot_started("slow", "pve1");
        clock.boot_started("waiting", "pve1");
        let mut state = clock.lock();
        state.booting.remove("gone");
        state.booting.remove("other");
        let long_ago = Instant::now() - SCOUT_HOLD * 2;
        state.booting.get_mut("slow").expect("booting").started = long_ago;
        assert_eq!(
            state.scout(Instant::now()).map(|(key, _)| key),
            Some("slow")
        );
        assert!(state.scout_due("waiting", Instant::now()).is_none());
    }

    #[test]
    fn a_booting_guest_is_looked_at_when_guests_on_its_node_usually_are_done() {
        let clock = LearnedClock::default();
        clock.boot_started("m1", "pve1");
        let first = clock
            .boot_not_due("m1")
            .expect("not due right after the start");
        assert!(
            first <= DEFAULT_BOOT && first > DEFAULT_BOOT / 2,
            "{first:?}"
        );
        // Seen not done: the next look comes at the usual boot time, or soon after it.
        let wait = clock.boot_silent("m1", "pve1");
        assert!((MIN_RECHECK..=DEFAULT_BOOT).contains(&wait), "{wait:?}");
        assert!(clock.boot_not_due("m1").is_some());
        clock.boot_answered("m1");
        assert!(
            clock.boot_not_due("m1").is_none(),
            "answered: nothing to wait for"
        );
        // Learned: this node's guests answered almost at once; a node that has seen no boot
        // yet expects what the other nodes saw.
        clock.boot_started("m2", "pve1");
        assert!(clock.boot_not_due("m2").is_none_or(|d| d <= MIN_RECHECK));
        clock.boot_started("m3", "pve2");
        assert!(clock.boot_not_due("m3").is_none_or(|d| d <= MIN_RECHECK));
        // Once a node has boots of its own, they count, not the others'.
        let slow = Duration::from_secs(8);
        clock
            .lock()
            .boots_learned
            .insert("pve3".into(), [slow].into());
        assert_eq!(clock.lock().expected_boot("pve3"), slow);
        assert!(clock.lock().expected_boot("pve1") < slow);
        // A guest this process did not start (after a restart) is looked at now, then backs off.
        assert!(clock.boot_not_due("m4").is_none());
        assert_eq!(clock.boot_silent("m4", "pve1"), MIN_RECHECK);
    }

    #[test]
    fn a_duration_is_learned_between_the_last_busy_look_and_the_done_one_and_only_recent_ones_count()
     {
        let mut samples = VecDeque::new();
        learn(&mut samples, Duration::from_secs(2), Duration::from_secs(4));
        assert_eq!(samples, [Duration::from_secs(3)]);
        // Never seen busy: at most the time it was seen done after, not half of it.
        learn(&mut samples, Duration::ZERO, Duration::from_secs(4));
        assert_eq!(samples.back(), Some(&Duration::from_secs(4)));
        for _ in 0..SAMPLES {
            learn(&mut samples, Duration::ZERO, Duration::from_secs(1));
        }
        assert_eq!(samples.len(), SAMPLES);
        assert_eq!(median(&samples), Duration::from_secs(1));
    }

    #[test]
    fn before_any_task_ended_clones_are_expected_to_take_longer_than_other_tasks() {
        let clock = LearnedClock::default();
        assert_eq!(clock.expected(&upid("qmclone", "pve1", 1)), DEFAULT_CLONE);
        assert_eq!(clock.expected(&upid("qmstart", "pve1", 2)), DEFAULT_TASK);
    }

    #[test]
    fn a_submitted_task_is_not_due_before_its_expected_end_and_unknown_tasks_are_due_at_once() {
        let clock = LearnedClock::default();
        let clone = upid("qmclone", "pve1", 1);
        let wait = clock.submitted(&clone, "m1", "cloning");
        assert_eq!(
            clock.in_flight_for("m1"),
            Some((Arc::new(clone.clone()), "cloning".to_owned()))
        );
        assert_eq!(wait, DEFAULT_CLONE);
        let remaining = clock.not_due(&clone).expect("not due yet");
        assert!(remaining <= DEFAULT_CLONE && remaining > DEFAULT_CLONE / 2);
        assert_eq!(clock.not_due(&upid("qmclone", "pve1", 2)), None);
    }

    #[test]
    fn learned_durations_are_per_type_and_node_and_replace_the_default() {
        let clock = LearnedClock::default();
        let start = upid("qmstart", "pve1", 1);
        clock.submitted(&start, "m1", "starting");
        clock.finished(&start);
        assert_eq!(
            clock.in_flight_for("m1"),
            None,
            "ended, so no longer awaited"
        );
        // Seen stopped at once: estimated at (almost) nothing, but never below the floor; a
        // node that saw none expects what the others saw.
        assert_eq!(clock.expected(&upid("qmstart", "pve1", 2)), MIN_RECHECK);
        assert_eq!(clock.expected(&upid("qmstart", "pve2", 3)), MIN_RECHECK);
        assert_eq!(clock.expected(&upid("qmconfig", "pve2", 3)), DEFAULT_TASK);
        assert_eq!(clock.expected(&upid("qmclone", "pve1", 4)), DEFAULT_CLONE);
        // Once a node has its own, they count.
        let slow = Duration::from_secs(3);
        clock
            .lock()
            .learned
            .insert(("qmstart".into(), "pve3".into()), [slow].into());
        assert_eq!(clock.expected(&upid("qmstart", "pve3", 5)), slow);
    }

    #[test]
    fn while_no_task_of_a_type_was_seen_end_the_first_scouts_and_the_others_teach_nothing() {
        let clock = LearnedClock::default();
        let scout = upid("imgcopy", "pve1", 1);
        let held = upid("imgcopy", "pve2", 2);
        assert_eq!(clock.submitted(&scout, "m1", "uploading"), SCOUT_RECHECK);
        assert_eq!(
            clock.submitted(&held, "m2", "uploading"),
            DEFAULT_TASK,
            "another one scouts already"
        );
        // The scout is checked often while it runs, the held one at the default.
        let scout_wait = clock.still_running(&scout);
        assert!(
            scout_wait >= SCOUT_RECHECK && scout_wait < MIN_RECHECK,
            "{scout_wait:?}"
        );
        let held_wait = clock.still_running(&held);
        assert!(held_wait > DEFAULT_TASK / 2, "{held_wait:?}");
        // The scout is learned as when it was seen done (a look then finds such a task done),
        // not the middle since its last look; the held one teaches nothing.
        let ran = Duration::from_millis(300);
        clock
            .lock()
            .in_flight
            .get_mut(scout.as_str())
            .expect("in flight")
            .submitted = Instant::now() - ran;
        clock.finished(&scout);
        clock.finished(&held);
        let learned = clock.lock().learned.clone();
        assert!(!learned.contains_key(&("imgcopy".into(), "pve2".into())));
        let pve1 = &learned[&("imgcopy".into(), "pve1".into())];
        assert!(pve1.len() == 1 && pve1[0] >= ran, "{pve1:?}");
        // Known now: nothing scouts; the node that saw none expects the scout's duration.
        let later = upid("imgcopy", "pve2", 3);
        let wait = clock.submitted(&later, "m3", "uploading");
        assert!(wait >= ran && wait < DEFAULT_TASK, "{wait:?}");
        // Clones are never scouted: they queue, and the queue is learned otherwise.
        assert_eq!(
            clock.submitted(&upid("qmclone", "pve1", 4), "m4", "cloning"),
            DEFAULT_CLONE
        );
    }

    #[test]
    fn before_any_boot_was_learned_a_guest_is_not_looked_at_before_others_were_seen_not_done() {
        let clock = LearnedClock::default();
        clock.boot_started("m1", "pve1");
        let slow = DEFAULT_BOOT * 2;
        clock
            .lock()
            .booting
            .get_mut("m1")
            .expect("booting")
            .last_seen_silent = slow;
        clock.boot_started("m2", "pve2");
        let first_look = clock.boot_not_due("m2").expect("not due at once");
        assert!(
            first_look > DEFAULT_BOOT && first_look <= slow,
            "m1 was not up after {slow:?}: m2 is not looked at before that ({first_look:?})"
        );
        // Once a boot was learned, it counts instead.
        clock.boot_answered("m1");
        clock.boot_started("m3", "pve2");
        assert!(clock.boot_not_due("m3").is_some_and(|d| d <= slow));
    }

    #[test]
    fn a_clone_queued_on_its_node_is_checked_at_a_clones_duration_then_after_the_queue_ahead() {
        let clock = LearnedClock::default();
        let first = upid("qmclone", "pve1", 1);
        let second = upid("qmclone", "pve1", 2);
        assert_eq!(clock.submitted(&first, "m1", "cloning"), DEFAULT_CLONE);
        assert_eq!(
            clock.submitted(&second, "m2", "cloning"),
            DEFAULT_CLONE,
            "the first check of a queued clone comes when a clone usually ends: a node that \
             clones side by side is noticed"
        );
        // Seen running then: next when the clone ahead and this one are expected done.
        let wait = clock.still_running(&second);
        assert!(
            wait > DEFAULT_CLONE * 3 / 2 && wait <= DEFAULT_CLONE * 2,
            "{wait:?}"
        );
        // The first clone has nothing ahead: it is expected a clone's duration after it began.
        let first_wait = clock.still_running(&first);
        assert!(first_wait <= DEFAULT_CLONE, "{first_wait:?}");
        assert!(wait - first_wait > DEFAULT_CLONE / 2, "{first_wait:?}");
        // Other nodes and other task types do not queue behind these clones.
        let elsewhere = upid("qmclone", "pve2", 3);
        clock.submitted(&elsewhere, "m3", "cloning");
        assert!(clock.still_running(&elsewhere) <= DEFAULT_CLONE);
        let start = upid("qmstart", "pve1", 4);
        clock.submitted(&start, "m4", "starting");
        assert!(clock.still_running(&start) <= DEFAULT_TASK);
        // Only a clone that ran on its own teaches how long a clone takes.
        clock.finished(&second);
        assert_eq!(clock.expected(&first), DEFAULT_CLONE, "waited in the queue");
        clock.finished(&elsewhere);
        assert_eq!(clock.expected(&elsewhere), MIN_RECHECK, "ran alone");
    }

    #[test]
    fn a_clone_does_not_queue_behind_one_on_a_node_of_its_name_in_another_proxmox() {
        let clock = LearnedClock::default();
        let east = upid("qmclone", "pve1", 1).at_site("https://east:8006");
        let west = upid("qmclone", "pve1", 2).at_site("https://west:8006");
        clock.submitted(&east, "m1", "cloning");
        clock.submitted(&west, "m2", "cloning");
        assert!(
            clock.still_running(&west) <= DEFAULT_CLONE,
            "expected as a clone with nothing ahead"
        );
        let behind = upid("qmclone", "pve1", 3).at_site("https://west:8006");
        clock.submitted(&behind, "m3", "cloning");
        assert!(
            clock.still_running(&behind) > DEFAULT_CLONE * 3 / 2,
            "behind the clone of its own Proxmox"
        );
    }

    /// Clones numbered `numbers` submitted on `node`, one machine each, in that order.
    fn submit_clones(
        clock: &LearnedClock,
        node: &str,
        numbers: std::ops::RangeInclusive<u32>,
    ) -> Vec<Upid> {
        numbers
            .map(|n| {
                let clone = upid("qmclone", node, n);
                clock.submitted(&clone, &format!("{node}-m{n}"), "cloning");
                clone
            })
            .collect()
    }

    /// How long until `upid`'s check is due.
    fn due_in(clock: &LearnedClock, upid: &Upid) -> Duration {
        clock
            .lock()
            .in_flight
            .get(upid.as_str())
            .expect("in flight")
            .due
            .saturating_duration_since(Instant::now())
    }

    #[test]
    fn a_clone_seen_done_brings_the_checks_of_the_clones_queued_behind_it_forward() {
        let clock = LearnedClock::default();
        let clones = submit_clones(&clock, "pve1", 1..=4);
        // pve1 queues them: the last is checked when the three ahead and it are expected done,
        // and its pass waits for its turn meanwhile, without a check.
        clock.still_running(&clones[1]);
        clock.not_due(&clones[2]).expect("not due");
        let pass = clock.not_due(&clones[3]).expect("not due");
        assert_eq!(pass, TURN_RECHECK);
        assert!(due_in(&clock, &clones[3]) > DEFAULT_CLONE * 7 / 2);
        // The first is seen done at once, far sooner than expected: each clone behind it ends
        // at most a clone's duration after the one ahead of it, counted from now.
        let next = clock.finished(&clones[0]).expect("a machine next in line");
        assert_eq!(
            next.machine, "pve1-m2",
            "the machine next in line is woken: its pass was told to come back later"
        );
        assert!(
            next.due_in <= DEFAULT_CLONE * 21 / 20 && next.due_in > DEFAULT_CLONE,
            "woken when its check is due, not at once: {next:?}"
        );
        let dues: Vec<Duration> = clones[1..].iter().map(|c| due_in(&clock, c)).collect();
        for (rank, due) in dues.iter().enumerate() {
            let at_most = DEFAULT_CLONE * 21 / 20 * (rank as u32 + 1);
            assert!(
                *due <= at_most && *due > at_most - DEFAULT_CLONE / 2,
                "clone {rank} behind: {dues:?}"
            );
        }
        // Clones on other nodes do not move.
        let elsewhere = upid("qmclone", "pve2", 9);
        clock.submitted(&elsewhere, "p1", "cloning");
        clock.submitted(&upid("qmclone", "pve2", 10), "p2", "cloning");
        let before = due_in(&clock, &upid("qmclone", "pve2", 10));
        clock.finished(&clones[1]);
        assert!(due_in(&clock, &upid("qmclone", "pve2", 10)) + MIN_RECHECK > before);
        // A clone whose check does not move sooner wakes nobody.
        assert_eq!(clock.finished(&clones[3]), None, "nothing behind it");
    }

    #[test]
    fn a_queued_clone_teaches_how_long_it_ran_after_the_one_ahead_of_it_was_seen_done() {
        let clock = LearnedClock::default();
        let clones = submit_clones(&clock, "pve1", 1..=3);
        clock.finished(&clones[0]);
        let ran_alone = clock.expected(&clones[0]);
        {
            let mut state = clock.lock();
            let second = state
                .in_flight
                .get_mut(clones[1].as_str())
                .expect("submitted");
            assert!(
                second.queue_left.is_some(),
                "next in line when the first ended"
            );
            let now = Instant::now();
            second.queue_left = Some(now - DEFAULT_CLONE * 3);
            second.submitted = now - DEFAULT_CLONE * 10;
            // Seen running two clones' durations after the one ahead was seen done.
            second.last_seen_running = DEFAULT_CLONE * 9;
        }
        clock.finished(&clones[1]);
        let learned = clock.expected(&clones[0]);
        assert!(
            learned >= DEFAULT_CLONE * 5 / 2 && learned < DEFAULT_CLONE * 3,
            "between when it was seen running and done after the queue, not its time since \
             submission: {learned:?} (alone: {ran_alone:?})"
        );
        // Found done at its first check after the queue moved on, it may have run long before.
        {
            let mut state = clock.lock();
            let third = state
                .in_flight
                .get_mut(clones[2].as_str())
                .expect("submitted");
            assert!(third.queue_left.is_some());
            third.submitted -= DEFAULT_CLONE * 10;
        }
        clock.finished(&clones[2]);
        assert_eq!(clock.expected(&clones[0]), learned, "taught nothing");
    }

    #[test]
    fn a_slow_first_clone_on_a_node_does_not_time_its_whole_queue() {
        let clock = LearnedClock::default();
        {
            let mut state = clock.lock();
            let clone = |secs| Duration::from_secs(secs);
            state.learned.insert(
                ("qmclone".into(), "pve1".into()),
                VecDeque::from([clone(20)]),
            );
            for node in ["pve2", "pve3", "pve4", "pve5", "pve6"] {
                state
                    .learned
                    .insert(("qmclone".into(), node.into()), VecDeque::from([clone(2)]));
            }
        }
        assert_eq!(
            clock.expected(&upid("qmclone", "pve1", 1)),
            Duration::from_secs(3)
        );
        assert_eq!(
            clock.expected(&upid("qmclone", "pve2", 2)),
            Duration::from_secs(2)
        );
    }

    #[test]
    fn a_queued_clone_past_its_expected_end_is_checked_again_at_a_fraction_of_a_clone() {
        let clock = LearnedClock::default();
        let clones = submit_clones(&clock, "pve1", 1..=2);
        {
            let mut state = clock.lock();
            let queued = state
                .in_flight
                .get_mut(clones[1].as_str())
                .expect("submitted");
            // A minute in the queue, and the estimate of its end already passed.
            queued.submitted -= Duration::from_secs(60);
            queued.expected_end = Instant::now();
        }
        let waiting = clock.still_running(&clones[1]);
        assert_eq!(
            waiting, MAX_RECHECK,
            "still behind the first: checked rarely"
        );
        clock.finished(&clones[0]);
        clock
            .lock()
            .in_flight
            .get_mut(clones[1].as_str())
            .expect("submitted")
            .expected_end = Instant::now();
        let wait = clock.still_running(&clones[1]);
        assert!(
            wait <= DEFAULT_CLONE / 4 && wait >= MIN_RECHECK,
            "next in line, its time in the queue says nothing of how long it still runs: {wait:?}"
        );
    }

    #[test]
    fn on_a_node_seen_queueing_only_the_clone_ahead_is_checked_and_its_end_retimes_the_rest() {
        let clock = LearnedClock::default();
        let clones = submit_clones(&clock, "pve1", 1..=3);
        clock.still_running(&clones[1]);
        // Due by its own estimate, which came too soon: behind a clone no check saw end, it
        // has not begun, so its pass comes back without a check.
        for behind in &clones[1..] {
            clock
                .lock()
                .in_flight
                .get_mut(behind.as_str())
                .expect("submitted")
                .expected_end = Instant::now() - DEFAULT_CLONE;
            clock
                .lock()
                .in_flight
                .get_mut(behind.as_str())
                .expect("submitted")
                .due = Instant::now() - DEFAULT_CLONE;
            assert_eq!(clock.not_due(behind), Some(TURN_RECHECK), "{behind}");
        }
        clock
            .lock()
            .in_flight
            .get_mut(clones[0].as_str())
            .expect("submitted")
            .due = Instant::now();
        assert_eq!(
            clock.not_due(&clones[0]),
            None,
            "the clone ahead is checked"
        );
        // Its end retimes the queue behind it from now, later than first thought, and wakes
        // the machine next in line, whose pass was told to come back later.
        let next = clock.finished(&clones[0]).expect("a machine next in line");
        let expected = DEFAULT_CLONE * 21 / 20;
        assert_eq!(next.machine, "pve1-m2");
        assert!(next.due_in <= expected && next.due_in + MIN_RECHECK > expected);
        for (rank, behind) in clones[1..].iter().enumerate() {
            let due = due_in(&clock, behind);
            let at = expected * (rank as u32 + 1);
            assert!(due <= at && due + MIN_RECHECK > at, "{rank}: {due:?}");
        }
        assert!(clock.not_due(&clones[1]).is_some_and(|d| d <= expected));
        assert_eq!(
            clock.not_due(&clones[2]),
            Some(TURN_RECHECK),
            "still behind one"
        );
        // A node's task list that shows the clone ahead ended: the one behind is no longer held
        // back (checked on its own estimate), and is checked a clone's duration after that end.
        assert!(clock.lock().ledger.listed_ended(&clones[1]));
        assert!(clock.not_due(&clones[2]).is_some_and(|d| d <= MAX_RECHECK));
        let next = clock.finished(&clones[1]).expect("a machine next in line");
        assert_eq!(next.machine, "pve1-m3");
        // (The first clone, seen done at once, taught a short duration.)
        let expected = clock.expected(&clones[0]) * 21 / 20;
        let due = due_in(&clock, &clones[2]);
        assert!(due <= expected && due + expected / 4 > expected, "{due:?}");
    }

    #[test]
    fn a_clone_submitted_behind_others_on_a_node_seen_queueing_waits_its_turn_from_the_start() {
        let clock = LearnedClock::default();
        let clones = submit_clones(&clock, "pve1", 1..=2);
        clock.still_running(&clones[1]);
        // pve1 is now known to run clones one after another: the next one submitted there
        // has no pass until the ones ahead end, and is checked at its expected end.
        let third = upid("qmclone", "pve1", 3);
        let wait = clock.submitted(&third, "pve1-m3", "cloning");
        assert_eq!(wait, TURN_RECHECK);
        assert!(
            due_in(&clock, &third) > DEFAULT_CLONE * 5 / 2,
            "after the two ahead"
        );
        // Alone on a node, or first on one not seen queueing, it is checked as before.
        let lone = upid("qmclone", "pve2", 4);
        assert_eq!(clock.submitted(&lone, "pve2-m4", "cloning"), DEFAULT_CLONE);
        let behind_lone = upid("qmclone", "pve2", 5);
        assert_eq!(
            clock.submitted(&behind_lone, "pve2-m5", "cloning"),
            DEFAULT_CLONE,
            "pve2 was not seen queueing"
        );
    }

    #[test]
    fn a_clone_waiting_its_turn_keeps_its_node_known_for_queueing() {
        let clock = LearnedClock::default();
        let clones = submit_clones(&clock, "pve1", 1..=2);
        let key = ("qmclone".to_owned(), "pve1".to_owned());
        let almost_forgotten = Instant::now() - QUEUEING_REMEMBERED + MIN_RECHECK;
        clock
            .lock()
            .queueing_seen
            .insert(key.clone(), almost_forgotten);
        assert_eq!(clock.not_due(&clones[1]), Some(TURN_RECHECK));
        assert!(
            clock.lock().queueing_seen[&key] > almost_forgotten,
            "seen queueing again"
        );
        // Nothing waits behind a lone clone: the node is forgotten as before.
        let lone = submit_clones(&clock, "pve2", 3..=3);
        let key = ("qmclone".to_owned(), "pve2".to_owned());
        clock
            .lock()
            .queueing_seen
            .insert(key.clone(), almost_forgotten);
        clock.not_due(&lone[0]);
        assert_eq!(clock.lock().queueing_seen[&key], almost_forgotten);
    }

    #[test]
    fn on_a_node_seen_queueing_a_queued_clone_is_first_checked_at_its_expected_end() {
        let clock = LearnedClock::default();
        let clones = submit_clones(&clock, "pve1", 1..=3);
        // The second clone, checked when a clone usually ends, still runs: pve1 queues them.
        clock.still_running(&clones[1]);
        clock.not_due(&clones[2]).expect("not due");
        let third = due_in(&clock, &clones[2]);
        assert!(third > DEFAULT_CLONE * 5 / 2, "{third:?}");
        // Found done at its expected end: it waited in the queue, which teaches nothing.
        clock.finished(&clones[2]);
        assert_eq!(clock.expected(&clones[0]), DEFAULT_CLONE);

        // A node whose queued clone is found done at that first check runs clones side by
        // side: the next queued one is checked when a clone usually ends.
        let side_by_side = submit_clones(&clock, "pve2", 4..=7);
        clock.still_running(&side_by_side[1]);
        assert!(
            clock
                .not_due(&side_by_side[2])
                .is_some_and(|d| d > DEFAULT_CLONE * 2)
        );
        clock.finished(&side_by_side[3]);
        let next = upid("qmclone", "pve2", 8);
        clock.submitted(&next, "p9", "cloning");
        assert!(
            clock.not_due(&next).is_some_and(|d| d <= DEFAULT_CLONE),
            "checked at a clone's duration again"
        );
    }

    #[test]
    fn a_guest_is_not_looked_at_before_what_was_learned_since_its_start_says() {
        let clock = LearnedClock::default();
        clock.boot_started("m1", "pve1");
        let slow = DEFAULT_BOOT * 4;
        clock
            .lock()
            .boots_learned
            .insert("pve1".into(), [slow].into());
        let wait = clock.boot_not_due("m1").expect("not due");
        assert!(wait > DEFAULT_BOOT * 3 && wait <= slow, "{wait:?}");
    }

    #[test]
    fn a_start_checked_with_the_boot_is_due_when_guests_are_up_and_teaches_nothing() {
        let clock = LearnedClock::default();
        let start = upid("qmstart", "pve1", 1);
        clock.submitted(&start, "m1", "starting");
        clock.boot_started("m1", "pve1");
        let wait = clock.check_with_boot(&start, "m1");
        assert!(
            wait > DEFAULT_BOOT / 2 && wait <= DEFAULT_BOOT,
            "checked with the boot, not after a start's usual duration: {wait:?}"
        );
        assert!(clock.not_due(&start).is_some_and(|d| d > DEFAULT_TASK));
        clock.finished(&start);
        assert_eq!(clock.expected(&upid("qmstart", "pve1", 2)), DEFAULT_TASK);
    }

    #[test]
    fn a_start_checked_with_the_boot_follows_the_guests_look_when_it_moves_later() {
        let clock = LearnedClock::default();
        clock.boots_learned_on("pve1", DEFAULT_BOOT);
        let start = upid("qmstart", "pve1", 1);
        clock.submitted(&start, "m1", "starting");
        clock.boot_started("m1", "pve1");
        let planned = clock.check_with_boot(&start, "m1");
        assert!(planned <= DEFAULT_BOOT, "{planned:?}");
        // Guests on the node turned out to boot longer: the start's check waits for the look at
        // the guest, so the pass that sees the start end looks at the guest too.
        clock.boots_learned_on("pve1", DEFAULT_BOOT * 4);
        let boot = clock.boot_not_due("m1").expect("the guest's look moved");
        let check = clock
            .not_due(&start)
            .expect("not due before the guest's look");
        assert!(
            check + Duration::from_millis(50) >= boot && check > DEFAULT_BOOT * 2,
            "start checked in {check:?}, guest looked at in {boot:?}"
        );
        // A start not checked with its guest keeps its own due time.
        let other = upid("qmstart", "pve1", 2);
        clock.submitted(&other, "m2", "starting");
        clock.boot_started("m2", "pve1");
        assert!(clock.not_due(&other).is_some_and(|d| d <= DEFAULT_TASK));
    }

    #[test]
    fn a_task_seen_running_is_checked_again_soon_and_no_longer_counts_as_not_due() {
        let clock = LearnedClock::default();
        let task = upid("qmresize", "pve1", 1);
        let wait = clock.still_running(&task);
        assert_eq!(wait, MIN_RECHECK, "just started: the shortest recheck");
        clock.forget(&task);
        assert_eq!(clock.not_due(&task), None);
    }
}
