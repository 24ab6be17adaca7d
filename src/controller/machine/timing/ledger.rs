//! What the reconciler relies on between passes whatever the timing policy: the task each
//! machine waits for, the successful tasks it repeats, and the guests seen up. A pass may work
//! from a cached copy of the machine older than the status that records these, so this
//! process remembers them itself.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::MAX_IN_FLIGHT;
use crate::controller::machine::{TaskKind, TaskPurpose};
use crate::controller::node_tasks::listed_together;
use crate::proxmox::Upid;

/// Successes further apart than this do not count as a row (a VM stopped by someone once a
/// day is started again each time).
const REPEAT_WINDOW: Duration = Duration::from_secs(900);

/// The tasks in flight that a node's task list shows beside one: how many, and the earliest
/// start among them (where that list starts).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Beside {
    pub tasks: usize,
    pub since: Option<u64>,
}

#[derive(Default)]
pub(super) struct Ledger {
    /// The task each machine waits for (by machine key), with its purpose: a pass working
    /// from a cached copy older than the status that records it still sees it.
    /// The UPID is kept parsed: a check of a node's task list goes through the node's tasks.
    by_machine: HashMap<String, (Arc<Upid>, String)>,
    /// The machine waiting for each task of `by_machine`, by UPID.
    by_task: HashMap<String, String>,
    /// The machines of `by_machine`, by the node of their task: a check of a node's task list
    /// finds the tasks it answers for without a look at every node's.
    by_node: HashMap<String, HashSet<String>>,
    /// The VM (by machine key) whose guest this process saw up, so a pass working from a copy
    /// older than the status that says so does not look at the guest again.
    guests_up: HashMap<String, u32>,
    /// Per machine, the kind of task it last saw succeed, how many times in a row, and when.
    succeeded: HashMap<String, (TaskKind, u32, Instant)>,
    /// Tasks in flight that a node's task list showed ended: worth checking at once.
    listed_ended: HashSet<String>,
}

impl Ledger {
    /// Notes the task just submitted for `machine` for `purpose` (as recorded in status).
    pub(super) fn submitted(&mut self, upid: &Upid, machine: &str, purpose: &str) {
        if self.by_machine.len() >= MAX_IN_FLIGHT {
            self.by_machine.clear();
            self.by_task.clear();
            self.by_node.clear();
            self.listed_ended.clear();
        }
        // The task it waited for before is no longer its; whether a list showed that one
        // ended is kept (a clock may still count it in a queue until it sees it end).
        if let Some((earlier, _)) = self.by_machine.get(machine).cloned() {
            self.unindex(&earlier);
        }
        self.by_machine.insert(
            machine.to_owned(),
            (Arc::new(upid.clone()), purpose.to_owned()),
        );
        self.by_task
            .insert(upid.as_str().to_owned(), machine.to_owned());
        self.by_node
            .entry(upid.site_node().to_owned())
            .or_default()
            .insert(machine.to_owned());
        if TaskPurpose::parse(purpose).kind == Some(TaskKind::Clone) {
            // A new VM (perhaps with the VMID of one the machine had): its guest is not up.
            self.guests_up.remove(machine);
        }
    }

    /// Notes that `upid` ended or was forgotten: no machine waits for it any more.
    pub(super) fn task_ended(&mut self, upid: &Upid) {
        self.listed_ended.remove(upid.as_str());
        if let Some(machine) = self.unindex(upid) {
            self.by_machine.remove(&machine);
        }
    }

    /// Drops `upid` from the indexes of the tasks in flight; returns the machine that waited
    /// for it.
    fn unindex(&mut self, upid: &Upid) -> Option<String> {
        let machine = self.by_task.remove(upid.as_str())?;
        if let Some(machines) = self.by_node.get_mut(upid.site_node()) {
            machines.remove(&machine);
            if machines.is_empty() {
                self.by_node.remove(upid.site_node());
            }
        }
        Some(machine)
    }

    /// The tasks in flight that the task list of `upid`'s node shows beside it, with the
    /// machine (by key) waiting for each.
    fn listed_with<'a>(
        &'a self,
        upid: &'a Upid,
    ) -> impl Iterator<Item = (&'a String, &'a Arc<Upid>)> + 'a {
        let node = upid.site_node();
        self.by_node
            .get(node)
            .into_iter()
            .flatten()
            .filter_map(move |machine| {
                let (task, _) = self.by_machine.get(machine)?;
                (task.site_node() == node && listed_together(task, upid)).then_some((machine, task))
            })
    }

    /// How many tasks in flight the task list of `upid`'s node shows beside it, and the
    /// earliest start among them.
    pub(super) fn beside(&self, upid: &Upid) -> Beside {
        self.listed_with(upid)
            .fold(Beside::default(), |beside, (_, task)| Beside {
                tasks: beside.tasks + 1,
                since: Some(
                    beside
                        .since
                        .map_or(task.starttime, |s| s.min(task.starttime)),
                ),
            })
    }

    /// Notes, of the tasks in flight beside `checked` (not itself), those `ended` says ended,
    /// as [`Ledger::listed_ended`] notes each; returns the machines (by key) worth waking.
    pub(super) fn listed_ended_beside(
        &mut self,
        checked: &Upid,
        ended: &dyn Fn(&Upid) -> bool,
    ) -> Vec<String> {
        let seen_ended: Vec<(String, Arc<Upid>)> = self
            .listed_with(checked)
            .filter(|(_, task)| ***task != *checked && ended(task))
            .map(|(machine, task)| (machine.clone(), task.clone()))
            .collect();
        seen_ended
            .into_iter()
            .filter(|(_, task)| self.listed_ended(task))
            .map(|(machine, _)| machine)
            .collect()
    }

    /// Notes that a node's task list showed `upid` ended, if a machine waits for it; returns
    /// whether that makes it worth checking at once. A start or stop is not: its check looks
    /// at the listing first, so the pass that settles it decides from a listing that shows the
    /// VM's new power state, not from one fetched before the task ended.
    pub(super) fn listed_ended(&mut self, upid: &Upid) -> bool {
        let power = |purpose: &str| {
            matches!(
                TaskPurpose::parse(purpose).kind,
                Some(TaskKind::Start | TaskKind::Stop)
            )
        };
        let worth = self
            .by_task
            .get(upid.as_str())
            .and_then(|machine| self.by_machine.get(machine))
            .is_some_and(|(_, purpose)| !power(purpose));
        if worth {
            self.listed_ended.insert(upid.as_str().to_owned());
        }
        worth
    }

    /// Whether a node's task list showed `upid` ended since it was submitted.
    pub(super) fn seen_listed_ended(&self, upid: &str) -> bool {
        self.listed_ended.contains(upid)
    }

    /// The task this process submitted for `machine` and has not seen end, with its purpose.
    pub(super) fn in_flight_for(&self, machine: &str) -> Option<(Arc<Upid>, String)> {
        self.by_machine.get(machine).cloned()
    }

    /// Notes that a task of `kind` submitted for `machine` succeeded at `now`; returns how
    /// many of that kind it saw succeed in a row (0 for a task of unknown purpose).
    pub(super) fn succeeded(&mut self, machine: &str, kind: Option<TaskKind>, now: Instant) -> u32 {
        let Some(kind) = kind else {
            self.succeeded.remove(machine);
            return 0;
        };
        if self.succeeded.len() >= MAX_IN_FLIGHT {
            self.succeeded.clear();
        }
        let streak = self
            .succeeded
            .entry(machine.to_owned())
            .or_insert((kind, 0, now));
        if streak.0 != kind || now.duration_since(streak.2) > REPEAT_WINDOW {
            *streak = (kind, 0, now);
        }
        streak.1 = streak.1.saturating_add(1);
        streak.2 = now;
        streak.1
    }

    /// Notes that `machine`'s VM was asked to start: its guest is looked at anew.
    pub(super) fn vm_started(&mut self, machine: &str) {
        self.guests_up.remove(machine);
    }

    /// Notes that `machine`'s guest in VM `vmid` is up; returns whether this was known.
    pub(super) fn guest_up(&mut self, machine: &str, vmid: u32) -> bool {
        if self.guests_up.len() >= MAX_IN_FLIGHT {
            self.guests_up.clear();
        }
        self.guests_up.insert(machine.to_owned(), vmid) == Some(vmid)
    }

    /// Whether `machine`'s guest in VM `vmid` was seen up since its VM was last started.
    pub(super) fn seen_up(&self, machine: &str, vmid: u32) -> bool {
        self.guests_up.get(machine) == Some(&vmid)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn successes_far_apart_are_no_row() {
        let mut ledger = Ledger::default();
        let upload = Some(TaskKind::UploadSeedIso);
        let start = Instant::now();
        assert_eq!(ledger.succeeded("m1", upload, start), 1);
        assert_eq!(ledger.succeeded("m1", upload, start + REPEAT_WINDOW), 2);
        let later = start + REPEAT_WINDOW * 2 + Duration::from_secs(1);
        assert_eq!(ledger.succeeded("m1", upload, later), 1);
    }

    /// The machines (by key) whose tasks in flight the list of `upid`'s node shows.
    fn machines_beside(ledger: &Ledger, upid: &Upid) -> Vec<String> {
        let mut machines: Vec<String> = ledger
            .listed_with(upid)
            .map(|(machine, _)| machine.clone())
            .collect();
        machines.sort();
        machines
    }

    /// The tasks in flight on `node` (of no Proxmox in particular).
    fn in_flight_on(ledger: &Ledger, node: &str) -> Vec<String> {
        machines_beside(ledger, &Upid::new(node, 0, 0, 0, "any", "", "root@pam"))
    }

    #[test]
    fn tasks_on_nodes_of_one_name_in_two_proxmox_clusters_are_kept_apart() {
        let mut ledger = Ledger::default();
        let purpose = TaskPurpose::new(TaskKind::Resize, "x".to_owned()).recorded();
        let on = |site: &str, n: u32| {
            Upid::new("pve1", n, 1, 1_700_000_000, "resize", "101", "root@pam").at_site(site)
        };
        let (east, west) = (on("https://east:8006", 1), on("https://west:8006", 2));
        ledger.submitted(&east, "m1", &purpose);
        ledger.submitted(&west, "m2", &purpose);
        let machines = machines_beside;
        assert_eq!(machines(&ledger, &on("https://east:8006", 3)), ["m1"]);
        assert_eq!(machines(&ledger, &on("https://west:8006", 4)), ["m2"]);
        assert!(
            in_flight_on(&ledger, "pve1").is_empty(),
            "a task of a known Proxmox is not taken for one of a node of that name elsewhere"
        );
        ledger.task_ended(&east);
        assert!(machines(&ledger, &on("https://east:8006", 3)).is_empty());
        assert_eq!(machines(&ledger, &west), ["m2"]);
    }

    #[test]
    fn the_tasks_a_list_shows_ended_beside_the_checked_one_are_noted_and_their_machines_named() {
        let mut ledger = Ledger::default();
        let task = |kind: &str, n: u32, start: u64| {
            Upid::new("pve1", n, 1, start, kind, "101", "root@pam")
        };
        let purpose = |kind: TaskKind| TaskPurpose::new(kind, "x".to_owned()).recorded();
        let c1 = task("qmclone", 1, 1_700_000_010);
        let c2 = task("qmclone", 2, 1_700_000_005);
        let c3 = task("qmclone", 3, 1_700_000_020);
        let start = task("qmstart", 4, 1_700_000_001);
        for (upid, machine) in [(&c1, "m1"), (&c2, "m2"), (&c3, "m3")] {
            ledger.submitted(upid, machine, &purpose(TaskKind::Clone));
        }
        ledger.submitted(&start, "m4", &purpose(TaskKind::Start));
        assert_eq!(
            ledger.beside(&c1),
            Beside {
                tasks: 3,
                since: Some(1_700_000_005)
            },
            "the clones, listed apart from the start"
        );
        assert_eq!(
            ledger.beside(&task("resize", 9, 1_700_000_030)),
            Beside {
                tasks: 1,
                since: Some(1_700_000_001)
            }
        );
        assert_eq!(
            ledger.beside(&task("qmclone", 9, 0).at_site("https://other:8006")),
            Beside::default()
        );
        // The list checked for c1 shows c1 and c2 ended, c3 running.
        let woken = ledger.listed_ended_beside(&c1, &|t: &Upid| *t == c1 || *t == c2);
        assert_eq!(woken, ["m2"]);
        assert!(ledger.seen_listed_ended(c2.as_str()));
        assert!(
            !ledger.seen_listed_ended(c1.as_str()),
            "the checked task is settled by its own check"
        );
        assert!(!ledger.seen_listed_ended(c3.as_str()));
        // A start the list shows ended is noted by the pass that looks at the listing.
        let woken = ledger.listed_ended_beside(&task("resize", 9, 1_700_000_030), &|_| true);
        assert!(woken.is_empty(), "{woken:?}");
    }

    #[test]
    fn clones_are_listed_with_the_clones_of_their_node_and_other_tasks_with_the_rest() {
        let mut ledger = Ledger::default();
        let task =
            |kind: &str, n: u32| Upid::new("pve1", n, 1, 1_700_000_000, kind, "101", "root@pam");
        let purpose = |kind: TaskKind| TaskPurpose::new(kind, "x".to_owned()).recorded();
        ledger.submitted(&task("qmclone", 1), "m1", &purpose(TaskKind::Clone));
        ledger.submitted(&task("qmclone", 2), "m2", &purpose(TaskKind::Clone));
        ledger.submitted(&task("resize", 3), "m3", &purpose(TaskKind::Resize));
        ledger.submitted(&task("qmstart", 4), "m4", &purpose(TaskKind::Start));
        let beside = |upid: &Upid| machines_beside(&ledger, upid);
        assert_eq!(beside(&task("qmclone", 5)), ["m1", "m2"]);
        assert_eq!(beside(&task("resize", 6)), ["m3", "m4"]);
    }

    #[test]
    fn a_task_a_list_showed_ended_is_due_unless_it_starts_or_stops_a_vm_or_nobody_waits() {
        let mut ledger = Ledger::default();
        let task =
            |kind: &str, n: u32| Upid::new("pve1", n, 1, 1_700_000_000, kind, "101", "root@pam");
        let (resize, stop, other) = (task("resize", 1), task("qmstop", 2), task("resize", 3));
        let purpose = |kind: TaskKind| TaskPurpose::new(kind, "x".to_owned()).recorded();
        ledger.submitted(&resize, "m1", &purpose(TaskKind::Resize));
        ledger.submitted(&stop, "m2", &purpose(TaskKind::Stop));
        assert!(ledger.listed_ended(&resize));
        assert!(ledger.seen_listed_ended(resize.as_str()));
        assert!(
            !ledger.listed_ended(&stop),
            "its check looks at the listing first"
        );
        assert!(!ledger.seen_listed_ended(stop.as_str()));
        assert!(!ledger.listed_ended(&other), "no machine waits for it");
        assert_eq!(in_flight_on(&ledger, "pve1").len(), 2);
        assert!(in_flight_on(&ledger, "pve2").is_empty());
        ledger.task_ended(&resize);
        assert!(!ledger.seen_listed_ended(resize.as_str()));
        assert_eq!(ledger.in_flight_for("m1"), None);
        assert_eq!(in_flight_on(&ledger, "pve1").len(), 1);
    }

    #[test]
    fn a_machine_waits_for_its_latest_task_only_on_that_task_node() {
        let mut ledger = Ledger::default();
        let on =
            |node: &str, n: u32| Upid::new(node, n, 1, 1_700_000_000, "resize", "101", "root@pam");
        let purpose = TaskPurpose::new(TaskKind::Resize, "x".to_owned()).recorded();
        let (first, second) = (on("pve1", 1), on("pve2", 2));
        ledger.submitted(&first, "m1", &purpose);
        assert!(ledger.listed_ended(&first));
        ledger.submitted(&second, "m1", &purpose);
        assert!(in_flight_on(&ledger, "pve1").is_empty(), "replaced");
        let on_pve2: Vec<(String, Upid)> = ledger
            .listed_with(&on("pve2", 9))
            .map(|(machine, task)| (machine.clone(), (**task).clone()))
            .collect();
        assert_eq!(on_pve2, [("m1".to_owned(), second.clone())]);
        assert!(
            !ledger.listed_ended(&first),
            "nobody waits for the first any more"
        );
        assert!(
            ledger.seen_listed_ended(first.as_str()),
            "what a list showed of a replaced task is kept until it is seen end"
        );
        // The end of a task nobody waits for changes only that.
        ledger.task_ended(&first);
        assert!(!ledger.seen_listed_ended(first.as_str()));
        assert_eq!(
            ledger
                .in_flight_for("m1")
                .map(|(task, _)| task.as_str().to_owned()),
            Some(second.as_str().to_owned())
        );
        ledger.task_ended(&second);
        assert!(in_flight_on(&ledger, "pve2").is_empty());
        assert!(ledger.by_node.is_empty() && ledger.by_task.is_empty());
    }

    #[test]
    fn a_full_ledger_forgets_rather_than_grows() {
        let mut ledger = Ledger::default();
        let now = Instant::now();
        for n in 0..MAX_IN_FLIGHT {
            ledger.guest_up(&format!("m{n}"), 101);
            ledger.succeeded(&format!("m{n}"), Some(TaskKind::Start), now);
        }
        assert!(ledger.seen_up("m0", 101));
        ledger.guest_up("new", 101);
        ledger.succeeded("new", Some(TaskKind::Start), now);
        assert!(!ledger.seen_up("m0", 101), "forgotten, so looked at again");
        assert!(ledger.seen_up("new", 101));
        assert_eq!(ledger.guests_up.len(), 1);
        assert_eq!(ledger.succeeded.len(), 1);
    }
}
