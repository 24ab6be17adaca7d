//! When a machine's pass looks again at its Proxmox task or at the guest its VM boots: a policy
//! behind [`TaskTiming`], chosen per manager ([`TaskTimingPolicy`]), so the reconciler stays the
//! same whichever one runs. Each policy also keeps what the reconciler relies on between passes
//! whatever the timing (`ledger.rs`): the task a machine waits for, repeats of successful tasks,
//! guests seen up.

mod guest;
mod learned;
mod ledger;
mod plain;

use std::ops::Deref;
use std::sync::Arc;
use std::time::Duration;

use super::TaskKind;
use crate::proxmox::Upid;

pub use learned::LearnedClock;
pub use ledger::Beside;
pub use plain::PlainClock;

/// Expected duration of a clone before any was seen end: clones copy disks, and a check
/// that comes too early only costs one request.
const DEFAULT_CLONE: Duration = Duration::from_secs(2);
/// Expected duration of any other task before one of its type was seen end.
const DEFAULT_TASK: Duration = Duration::from_millis(500);
/// Expected time from a VM's start to its guest being done with cloud-init, before any was
/// seen on the node.
const DEFAULT_BOOT: Duration = Duration::from_secs(2);
/// Shortest requeue while a task runs, so a task past its expected end is not polled in a
/// tight loop.
const MIN_RECHECK: Duration = Duration::from_millis(200);
/// Longest requeue while a task runs: a long task is still noticed soon after it ends.
const MAX_RECHECK: Duration = Duration::from_secs(5);
/// Tasks in flight remembered at most (a machine deleted mid-task never checks its task
/// again); the oldest are forgotten first.
const MAX_IN_FLIGHT: usize = 10_000;
/// A look due this soon counts as due now: a requeue shorter than the pass it saves is no gain.
const DUE_SLACK: Duration = Duration::from_millis(20);

/// A machine whose queued task began when the one ahead of it ended, to be looked at when it
/// is due (not before: a pass then would only requeue).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NextInLine {
    /// The machine's key.
    pub machine: String,
    pub due_in: Duration,
}

/// How a machine's passes are timed around its Proxmox tasks and its booting guest. Every
/// method notes what a pass saw or did and answers when the next look is worth it; the
/// bookkeeping methods (`in_flight_for`, `succeeded`, `guest_up`, `seen_up`) answer the same
/// whatever the policy.
pub trait TaskTiming: Send + Sync {
    /// Notes a task just submitted for `machine`; returns the requeue until its first check.
    fn submitted(&self, upid: &Upid, machine: &str, purpose: &str) -> Duration;

    /// Notes that the task `upid`, which started `machine`'s VM on its node, is checked no
    /// earlier than when its guest is worth a look, so one pass sees the start end and looks
    /// at the guest; returns the requeue until then.
    fn check_with_boot(&self, upid: &Upid, machine: &str) -> Duration;

    /// Notes that a task of `kind` submitted for `machine` succeeded; returns how many of that
    /// kind it saw succeed in a row (0 for a task of unknown purpose, which counts as none).
    fn succeeded(&self, machine: &str, kind: Option<TaskKind>) -> u32;

    /// The task this process submitted for `machine` and has not seen end, with its purpose.
    fn in_flight_for(&self, machine: &str) -> Option<(Arc<Upid>, String)>;

    /// How long until the task is worth checking, if it is not yet: `None` means check now
    /// (also for a task this process did not submit, e.g. after a restart).
    fn not_due(&self, upid: &Upid) -> Option<Duration>;

    /// Notes that a check saw the task still running; returns the requeue until the next check.
    fn still_running(&self, upid: &Upid) -> Duration;

    /// Notes that a check saw the task stopped; returns the machine whose task, next in line
    /// behind it on its node, is now due sooner than that machine's requeue.
    fn finished(&self, upid: &Upid) -> Option<NextInLine>;

    /// Forgets a task nobody will check again.
    fn forget(&self, upid: &Upid);

    /// The tasks this process submitted on `upid`'s node (of `upid`'s Proxmox, once known) and
    /// has not seen end that the node's list for `upid` shows too
    /// ([`crate::controller::node_tasks::listed_together`]): how many, and since when.
    fn listed_with(&self, upid: &Upid) -> Beside;

    /// Notes the tasks of [`TaskTiming::listed_with`] other than `checked` that the node's list
    /// shows ended (`ended`): each is worth checking at once, unless it starts or stops a VM
    /// (its check looks at the listing first). Returns the machines (by key) of those that are.
    fn listed_ended_beside(&self, checked: &Upid, ended: &dyn Fn(&Upid) -> bool) -> Vec<String>;

    /// Notes that `machine`'s VM on `node` was just asked to start: its guest is looked at
    /// when it is expected up, and what was seen of an earlier guest of the machine no longer
    /// counts.
    fn boot_started(&self, machine: &str, node: &str);

    /// How long until `machine`'s booting guest is worth looking at, if it is not yet.
    fn boot_not_due(&self, machine: &str) -> Option<Duration>;

    /// How long until `machine`'s guest, started on `node`, is worth a first look (not less
    /// than a short recheck), without a look now. A guest this process did not start (after a
    /// restart) counts as started now.
    fn boot_remaining(&self, machine: &str, node: &str) -> Duration;

    /// Notes that `machine`'s guest on `node` is not done booting; returns the requeue until
    /// the next look.
    fn boot_silent(&self, machine: &str, node: &str) -> Duration;

    /// Notes that `machine`'s guest is done booting (or failed for good): nothing more to
    /// wait for. Returns the machines (by key) whose guests waited for this answer, to look at
    /// now.
    fn boot_answered(&self, machine: &str) -> Vec<String>;

    /// Notes that `machine`'s guest in VM `vmid` is up and the machine provisioned; returns
    /// whether this process already knew.
    fn guest_up(&self, machine: &str, vmid: u32) -> bool;

    /// Whether this process saw `machine`'s guest in VM `vmid` up since it last started or
    /// cloned it.
    fn seen_up(&self, machine: &str, vmid: u32) -> bool;
}

/// Which [`TaskTiming`] a manager runs (`capmox run --task-timing`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum TaskTimingPolicy {
    /// Learns each task type's duration per node (median of recent ones), scouts the first
    /// task and guest while nothing was learned, and models the clone queue on each node.
    #[default]
    Learned,
    /// The last seen duration per task type and node, then checks twice as far apart each
    /// time; no scouts, no queue model.
    Plain,
}

impl TaskTimingPolicy {
    /// Every policy, for tests and comparisons.
    pub const ALL: [TaskTimingPolicy; 2] = [TaskTimingPolicy::Learned, TaskTimingPolicy::Plain];

    /// The flag value that selects it.
    pub fn as_str(self) -> &'static str {
        match self {
            TaskTimingPolicy::Learned => "learned",
            TaskTimingPolicy::Plain => "plain",
        }
    }
}

impl std::fmt::Display for TaskTimingPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The manager's task timing, shared by every machine reconcile: clones share one policy and
/// its state. Dereferences to the policy, so callers use the [`TaskTiming`] methods directly.
#[derive(Clone)]
pub struct TaskTimer {
    policy: TaskTimingPolicy,
    timing: Arc<dyn TaskTiming>,
}

impl TaskTimer {
    /// A fresh timing state for `policy`.
    pub fn new(policy: TaskTimingPolicy) -> Self {
        let timing: Arc<dyn TaskTiming> = match policy {
            TaskTimingPolicy::Learned => Arc::new(LearnedClock::default()),
            TaskTimingPolicy::Plain => Arc::new(PlainClock::default()),
        };
        TaskTimer { policy, timing }
    }

    /// The policy it runs.
    pub fn policy(&self) -> TaskTimingPolicy {
        self.policy
    }
}

impl Default for TaskTimer {
    fn default() -> Self {
        TaskTimer::new(TaskTimingPolicy::default())
    }
}

impl Deref for TaskTimer {
    type Target = dyn TaskTiming;

    fn deref(&self) -> &Self::Target {
        &*self.timing
    }
}

/// How long something took that was last seen unfinished `last_seen_busy` after it began
/// (zero: never) and seen done `seen_done` after: the middle of the two. Something never seen
/// unfinished (looked at only when expected to be done) took at most `seen_done`; halving that
/// would expect the next one too early, and look at it twice.
fn estimate(last_seen_busy: Duration, seen_done: Duration) -> Duration {
    if last_seen_busy.is_zero() {
        seen_done
    } else {
        (last_seen_busy + seen_done) / 2
    }
}

/// What every policy must answer alike: the reconciler's correctness, not its speed, depends
/// on these.
#[cfg(test)]
mod tests {
    use super::*;
    use crate::controller::machine::TaskPurpose;

    fn upid(kind: &str, node: &str, n: u32) -> Upid {
        Upid::new(node, n, 1, 1_700_000_000, kind, "101", "root@pam")
    }

    fn every_policy() -> impl Iterator<Item = (TaskTimingPolicy, TaskTimer)> {
        TaskTimingPolicy::ALL
            .into_iter()
            .map(|policy| (policy, TaskTimer::new(policy)))
    }

    #[test]
    fn a_timer_runs_the_policy_it_was_made_with_and_its_clones_share_its_state() {
        for (policy, timer) in every_policy() {
            assert_eq!(timer.policy(), policy);
            let clone = timer.clone();
            timer.submitted(&upid("qmclone", "pve1", 1), "m1", "clone: x");
            assert!(clone.in_flight_for("m1").is_some(), "{policy}");
        }
        assert_eq!(TaskTimer::default().policy(), TaskTimingPolicy::Learned);
        let parsed: Vec<TaskTimingPolicy> = ["learned", "plain"]
            .iter()
            .map(|value| <TaskTimingPolicy as clap::ValueEnum>::from_str(value, false))
            .collect::<Result<_, _>>()
            .expect("flag values");
        assert_eq!(parsed, TaskTimingPolicy::ALL);
        for policy in TaskTimingPolicy::ALL {
            assert_eq!(policy.to_string(), policy.as_str());
        }
    }

    #[test]
    fn the_task_a_machine_waits_for_is_known_until_it_is_seen_end_or_forgotten() {
        for (policy, timer) in every_policy() {
            let clone = upid("qmclone", "pve1", 1);
            let wait = timer.submitted(&clone, "m1", "clone: cloning");
            assert!(wait >= MIN_RECHECK, "{policy}: {wait:?}");
            assert_eq!(
                timer.in_flight_for("m1"),
                Some((Arc::new(clone.clone()), "clone: cloning".to_owned())),
                "{policy}"
            );
            assert!(
                timer.not_due(&clone).is_some(),
                "{policy}: just submitted, not worth a check"
            );
            assert_eq!(
                timer.not_due(&upid("qmclone", "pve1", 2)),
                None,
                "{policy}: a task this process did not submit is checked at once"
            );
            let running = timer.still_running(&clone);
            assert!(
                (MIN_RECHECK / 2..=MAX_RECHECK).contains(&running),
                "{policy}: {running:?}"
            );
            assert!(timer.not_due(&clone).is_some(), "{policy}");
            timer.finished(&clone);
            assert_eq!(timer.in_flight_for("m1"), None, "{policy}");
            assert_eq!(timer.not_due(&clone), None, "{policy}");

            let start = upid("qmstart", "pve1", 3);
            timer.submitted(&start, "m2", "start: starting");
            timer.forget(&start);
            assert_eq!(timer.in_flight_for("m2"), None, "{policy}");
            assert_eq!(timer.not_due(&start), None, "{policy}");
        }
    }

    #[test]
    fn a_start_checked_with_the_boot_is_not_checked_before_the_guest_is_worth_a_look() {
        for (policy, timer) in every_policy() {
            let start = upid("qmstart", "pve1", 1);
            timer.submitted(&start, "m1", "start: starting");
            timer.boot_started("m1", "pve1");
            let wait = timer.check_with_boot(&start, "m1");
            let boot = timer
                .boot_not_due("m1")
                .expect("the guest is not due at once");
            assert!(wait + DUE_SLACK >= boot, "{policy}: {wait:?} < {boot:?}");
            assert!(
                timer.not_due(&start).is_some_and(|d| d + DUE_SLACK >= boot),
                "{policy}"
            );
        }
    }

    #[test]
    fn a_guest_seen_up_is_remembered_for_its_vm_until_the_vm_is_started_again() {
        for (policy, clock) in every_policy() {
            assert!(!clock.seen_up("m1", 101), "{policy}");
            assert!(!clock.guest_up("m1", 101), "{policy}: not known before");
            assert!(clock.seen_up("m1", 101), "{policy}");
            assert!(
                !clock.seen_up("m1", 102),
                "{policy}: another VM of the machine"
            );
            assert!(clock.guest_up("m1", 101), "{policy}: known the second time");
            clock.boot_started("m1", "pve1");
            assert!(
                !clock.seen_up("m1", 101),
                "{policy}: started again: its guest is looked at anew"
            );
            clock.guest_up("m1", 101);
            // Whatever Proxmox calls the task: what capmox submitted it for counts.
            let cloning = TaskPurpose::new(TaskKind::Clone, "cloning template 9000".to_owned());
            clock.submitted(&upid("copyvm", "pve1", 7), "m1", &cloning.recorded());
            assert!(
                !clock.seen_up("m1", 101),
                "{policy}: cloned anew: the new VM may have the same VMID"
            );
            // Any other task leaves what was seen.
            clock.guest_up("m1", 101);
            let resizing = TaskPurpose::new(TaskKind::Resize, "resizing".to_owned());
            clock.submitted(&upid("qmresize", "pve1", 8), "m1", &resizing.recorded());
            assert!(clock.seen_up("m1", 101), "{policy}");
        }
    }

    #[test]
    fn tasks_of_one_kind_succeeding_in_a_row_are_counted_until_another_kind_succeeds() {
        for (policy, clock) in every_policy() {
            let upload = Some(TaskKind::UploadSeedIso);
            let counts: Vec<u32> = (0..5).map(|_| clock.succeeded("m1", upload)).collect();
            assert_eq!(counts, [1, 2, 3, 4, 5], "{policy}");
            assert_eq!(clock.succeeded("m2", upload), 1, "{policy}: per machine");
            assert_eq!(
                clock.succeeded("m1", Some(TaskKind::Start)),
                1,
                "{policy}: progress"
            );
            assert_eq!(clock.succeeded("m1", upload), 1, "{policy}");
            assert_eq!(
                clock.succeeded("m1", None),
                0,
                "{policy}: an unknown purpose counts as none"
            );
            assert_eq!(clock.succeeded("m1", upload), 1, "{policy}");
        }
    }

    #[test]
    fn a_booting_guest_is_not_due_at_once_and_nothing_is_awaited_once_it_answered() {
        for (policy, clock) in every_policy() {
            clock.boot_started("m1", "pve1");
            assert!(clock.boot_not_due("m1").is_some(), "{policy}");
            let silent = clock.boot_silent("m1", "pve1");
            assert!(
                (MIN_RECHECK..=MAX_RECHECK).contains(&silent),
                "{policy}: {silent:?}"
            );
            clock.boot_answered("m1");
            assert_eq!(clock.boot_not_due("m1"), None, "{policy}");
            // A guest this process did not start (after a restart) is looked at now.
            assert_eq!(clock.boot_not_due("m2"), None, "{policy}");
            let remaining = clock.boot_remaining("m3", "pve1");
            assert!(remaining >= MIN_RECHECK, "{policy}: {remaining:?}");
            assert!(clock.boot_not_due("m3").is_some(), "{policy}");
        }
    }

    #[test]
    fn a_duration_is_the_middle_of_the_last_busy_look_and_the_done_one_or_at_most_the_done_one() {
        let second = Duration::from_secs(1);
        assert_eq!(estimate(second * 2, second * 4), second * 3);
        assert_eq!(estimate(Duration::ZERO, second * 4), second * 4);
    }
}
