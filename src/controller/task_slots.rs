//! Slots for the clone and disk tasks capmox runs at once per Proxmox node and per storage, so
//! machines over a limit wait in capmox's queue, in the order they came, rather than in
//! Proxmox's lock queue, where a long wait ends in a lock timeout.
//!
//! A machine holds its slots while its recorded clone or resize task runs; its pass gives them
//! back once it sees no such task running, and a deletion also gives up its place in line.
//! After a restart the slots start empty: a task still running is counted again (on its
//! nodes, not its storages) when its machine's next pass sees it, so until every such pass has
//! run, up to a limit's worth of new clones may join those already running.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use kube::runtime::reflector::ObjectRef;
use tokio::sync::mpsc;

use crate::api::ProxmoxMachine;

/// How long a slot stays held when its machine's passes no longer say its task runs (the
/// machine was removed without a deletion pass): longer than any look at a running task.
const HOLDER_UNSEEN: Duration = Duration::from_secs(15 * 60);
/// How often a waiting machine looks again when nothing wakes it: a safety net only (a freed
/// slot wakes the machines next in line), so hundreds of waiting machines cost few passes.
pub const WAITER_RECHECK: Duration = Duration::from_secs(120);
/// How long a place in line is kept for a machine that stopped asking (it was deleted, or now
/// waits on something else).
const WAITER_UNSEEN: Duration = Duration::from_secs(3 * 120);

/// What a limit counts tasks on.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Slot {
    /// A node of the Proxmox cluster at `endpoint`.
    Node { endpoint: String, node: String },
    /// A storage: shared storages by name, node-local ones per node.
    Storage {
        endpoint: String,
        storage: String,
        node: Option<String>,
    },
}

impl std::fmt::Display for Slot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Node { node, .. } => write!(f, "node {node}"),
            Self::Storage {
                storage,
                node: None,
                ..
            } => write!(f, "shared storage {storage}"),
            Self::Storage {
                storage,
                node: Some(node),
                ..
            } => write!(f, "storage {storage} on {node}"),
        }
    }
}

/// A slot a task needs, and how many tasks may hold it at once for this machine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Want {
    pub slot: Slot,
    pub limit: u32,
}

/// Why a machine waits: the first slot it cannot have yet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Queued {
    pub slot: Slot,
    /// Tasks holding that slot.
    pub running: usize,
    pub limit: u32,
    /// Machines waiting for it before this one.
    pub ahead: usize,
}

/// Says where the machine waits and why, the same while it waits for the same slot (how many
/// run and wait changes all the time; a message that changed would be a status write each).
impl std::fmt::Display for Queued {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} runs as many clone or disk tasks as its limit allows ({}, taskLimits of the ProxmoxCluster or its zone); waiting in capmox's queue, in order, until a slot frees",
            self.slot, self.limit
        )
    }
}

type Who = ObjectRef<ProxmoxMachine>;

struct Holding {
    slots: Vec<Slot>,
    seen: Instant,
}

struct Waiter {
    who: Who,
    wants: Vec<Want>,
    since: Instant,
    seen: Instant,
}

/// Figures for the metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SlotStats {
    /// Machines waiting for a slot now.
    pub waiting: usize,
    /// Slots held now (a task holds one per node and storage it uses).
    pub held: usize,
    /// Machines that got their slots after waiting, since the start.
    pub waits: u64,
    /// Their time in line, summed.
    pub wait_time: Duration,
}

/// Who holds and who waits; pure, so every rule is tested with made-up instants.
#[derive(Default)]
struct Line {
    holders: HashMap<Who, Holding>,
    waiting: Vec<Waiter>,
    waits: u64,
    wait_time: Duration,
}

impl Line {
    fn prune(&mut self, now: Instant) {
        self.holders
            .retain(|_, h| now.saturating_duration_since(h.seen) < HOLDER_UNSEEN);
        self.waiting
            .retain(|w| now.saturating_duration_since(w.seen) < WAITER_UNSEEN);
    }

    fn running(&self, slot: &Slot) -> usize {
        self.holders
            .values()
            .filter(|h| h.slots.contains(slot))
            .count()
    }

    /// The first of `wants` that is full for a machine with `before` in line ahead of it:
    /// every machine ahead counts as holding what it waits for.
    fn blocked(&self, wants: &[Want], before: &[Waiter]) -> Option<Queued> {
        wants.iter().find_map(|want| {
            let running = self.running(&want.slot);
            let ahead = before
                .iter()
                .filter(|w| w.wants.iter().any(|o| o.slot == want.slot))
                .count();
            (running + ahead >= want.limit as usize).then(|| Queued {
                slot: want.slot.clone(),
                running,
                limit: want.limit,
                ahead,
            })
        })
    }

    fn acquire(&mut self, who: &Who, wants: Vec<Want>, now: Instant) -> Result<(), Queued> {
        self.prune(now);
        if let Some(holding) = self.holders.get_mut(who) {
            holding.seen = now;
            return Ok(());
        }
        let position = self.waiting.iter().position(|w| w.who == *who);
        let before = &self.waiting[..position.unwrap_or(self.waiting.len())];
        if let Some(queued) = self.blocked(&wants, before) {
            match position {
                Some(at) => {
                    let waiter = &mut self.waiting[at];
                    waiter.wants = wants;
                    waiter.seen = now;
                }
                None => self.waiting.push(Waiter {
                    who: who.clone(),
                    wants,
                    since: now,
                    seen: now,
                }),
            }
            return Err(queued);
        }
        if let Some(at) = position {
            let waiter = self.waiting.remove(at);
            self.waits += 1;
            self.wait_time += now.saturating_duration_since(waiter.since);
        }
        let slots = wants.into_iter().map(|w| w.slot).collect();
        self.holders
            .insert(who.clone(), Holding { slots, seen: now });
        Ok(())
    }

    fn hold(&mut self, who: &Who, slots: Vec<Slot>, now: Instant) {
        match self.holders.get_mut(who) {
            Some(holding) => holding.seen = now,
            None => {
                self.waiting.retain(|w| w.who != *who);
                self.holders
                    .insert(who.clone(), Holding { slots, seen: now });
            }
        }
    }

    /// How long `who`, waiting in line and not its turn yet, may skip its passes: until its
    /// next recheck. `None`: not waiting, or its turn (it asks again now).
    fn holds_back(&self, who: &Who, now: Instant) -> Option<Duration> {
        let at = self.waiting.iter().position(|w| w.who == *who)?;
        let waiter = &self.waiting[at];
        self.blocked(&waiter.wants, &self.waiting[..at])?;
        WAITER_RECHECK
            .checked_sub(now.saturating_duration_since(waiter.seen))
            .filter(|left| !left.is_zero())
    }

    /// The waiters that would get their slots if they asked now, in line order.
    fn next_up(&self) -> Vec<Who> {
        self.waiting
            .iter()
            .enumerate()
            .filter(|(at, w)| self.blocked(&w.wants, &self.waiting[..*at]).is_none())
            .map(|(_, w)| w.who.clone())
            .collect()
    }

    fn release(&mut self, who: &Who) -> Vec<Who> {
        if self.holders.remove(who).is_none() {
            return Vec::new();
        }
        self.next_up()
    }

    fn forget(&mut self, who: &Who) -> Vec<Who> {
        let held = self.holders.remove(who).is_some();
        let before = self.waiting.len();
        self.waiting.retain(|w| w.who != *who);
        if held || self.waiting.len() != before {
            self.next_up()
        } else {
            Vec::new()
        }
    }

    fn stats(&self) -> SlotStats {
        SlotStats {
            waiting: self.waiting.len(),
            held: self.holders.values().map(|h| h.slots.len()).sum(),
            waits: self.waits,
            wait_time: self.wait_time,
        }
    }
}

/// The manager's slots, shared by every machine reconcile; wakes the machines next in line
/// when a slot frees.
#[derive(Clone)]
pub struct TaskSlots {
    line: Arc<Mutex<Line>>,
    wake: mpsc::UnboundedSender<Who>,
    woken: Arc<Mutex<Option<mpsc::UnboundedReceiver<Who>>>>,
}

impl Default for TaskSlots {
    fn default() -> Self {
        let (wake, woken) = mpsc::unbounded_channel();
        Self {
            line: Arc::default(),
            wake,
            woken: Arc::new(Mutex::new(Some(woken))),
        }
    }
}

impl TaskSlots {
    fn line(&self) -> MutexGuard<'_, Line> {
        self.line.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn wake_all(&self, machines: Vec<Who>) {
        for machine in machines {
            // Nobody listens outside a running controller: the waiter's recheck still comes.
            let _ = self.wake.send(machine);
        }
    }

    /// Wakes `machines` through the same channel, for capacity freed otherwise (a deleted
    /// machine's memory, devices or disk room).
    pub fn wake(&self, machines: Vec<Who>) {
        self.wake_all(machines);
    }

    /// Wakes `machines` after `delay`, when what they wait for is due: a pass before then
    /// would only requeue. A restart drops the wake; the machines' own requeues still come.
    pub fn wake_after(&self, machines: Vec<Who>, delay: Duration) {
        if machines.is_empty() {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return self.wake_all(machines);
        };
        let slots = self.clone();
        runtime.spawn(async move {
            tokio::time::sleep(delay).await;
            slots.wake_all(machines);
        });
    }

    /// Takes every slot `wants` names for `who`, or puts it in line (keeping its place).
    pub fn acquire(&self, who: &Who, wants: Vec<Want>) -> Result<(), Queued> {
        self.line().acquire(who, wants, Instant::now())
    }

    /// Says that `who`'s task still runs on `slots` (counted again after a restart).
    pub fn hold(&self, who: &Who, slots: Vec<Slot>) {
        self.line().hold(who, slots, Instant::now());
    }

    /// `who` runs no clone or disk task: its slots go to the machines next in line.
    pub fn release(&self, who: &Who) {
        let woken = self.line().release(who);
        self.wake_all(woken);
    }

    /// `who` is being deleted: its slots and its place in line go.
    pub fn forget(&self, who: &Who) {
        let woken = self.line().forget(who);
        self.wake_all(woken);
    }

    /// Whether `who` waits in line (an earlier pass of it passed every check before a clone).
    pub fn is_waiting(&self, who: &Who) -> bool {
        self.line().waiting.iter().any(|w| w.who == *who)
    }

    /// How long `who`'s passes may end at once because it waits in line and it is not its
    /// turn (a change of its own, such as its status write, wakes it all the same); `None`:
    /// the pass goes on.
    pub fn holds_back(&self, who: &Who) -> Option<Duration> {
        self.line().holds_back(who, Instant::now())
    }

    /// The machines to reconcile when a slot frees; `None` once taken (one controller).
    pub fn take_wakeups(&self) -> Option<mpsc::UnboundedReceiver<Who>> {
        self.woken
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }

    pub fn stats(&self) -> SlotStats {
        self.line().stats()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn who(name: &str) -> Who {
        ObjectRef::new(name).within("ns")
    }

    fn node(name: &str) -> Slot {
        Slot::Node {
            endpoint: "https://pve:8006".into(),
            node: name.into(),
        }
    }

    fn shared(name: &str) -> Slot {
        Slot::Storage {
            endpoint: "https://pve:8006".into(),
            storage: name.into(),
            node: None,
        }
    }

    fn want(slot: Slot, limit: u32) -> Want {
        Want { slot, limit }
    }

    #[test]
    fn machines_over_a_nodes_limit_wait_in_the_order_they_came() {
        let mut line = Line::default();
        let t = Instant::now();
        let on = |n: &str| vec![want(node(n), 2)];
        assert_eq!(line.acquire(&who("a"), on("pve1"), t), Ok(()));
        assert_eq!(line.acquire(&who("b"), on("pve1"), t), Ok(()));
        let c = line.acquire(&who("c"), on("pve1"), t).expect_err("full");
        assert_eq!((c.running, c.limit, c.ahead), (2, 2, 0));
        let d = line.acquire(&who("d"), on("pve1"), t).expect_err("full");
        assert_eq!(d.ahead, 1, "d came after c");
        // Another node is not held up by pve1's line.
        assert_eq!(line.acquire(&who("e"), on("pve2"), t), Ok(()));
        // A holder asking again keeps its slot.
        assert_eq!(line.acquire(&who("a"), on("pve1"), t), Ok(()));

        assert_eq!(line.release(&who("a")), vec![who("c")], "c is next, not d");
        // d asks before c's pass: it stays behind c.
        let d = line.acquire(&who("d"), on("pve1"), t).expect_err("c first");
        assert_eq!((d.running, d.ahead), (1, 1));
        assert_eq!(line.acquire(&who("c"), on("pve1"), t), Ok(()));
        assert!(
            line.acquire(&who("d"), on("pve1"), t).is_err(),
            "full again"
        );
        assert_eq!(line.release(&who("b")), vec![who("d")]);
        assert_eq!(line.release(&who("nobody")), Vec::<Who>::new());
        let stats = line.stats();
        assert_eq!((stats.waiting, stats.held, stats.waits), (1, 2, 1));
    }

    #[test]
    fn a_task_needs_every_slot_it_names_and_a_shared_storage_spans_nodes() {
        let mut line = Line::default();
        let t = Instant::now();
        let clone = |n: &str| vec![want(node(n), 2), want(shared("ceph"), 1)];
        assert_eq!(line.acquire(&who("a"), clone("pve1"), t), Ok(()));
        let b = line
            .acquire(&who("b"), clone("pve2"), t)
            .expect_err("ceph busy");
        assert_eq!(b.slot, shared("ceph"));
        assert!(
            b.to_string().starts_with(
                "shared storage ceph runs as many clone or disk tasks as its limit allows (1,"
            ),
            "{b}"
        );
        assert_eq!(line.forget(&who("a")), vec![who("b")]);
    }

    #[test]
    fn a_waiter_skips_its_passes_until_its_turn_or_its_recheck() {
        let mut line = Line::default();
        let t = Instant::now();
        let on = || vec![want(node("pve1"), 1)];
        line.acquire(&who("a"), on(), t).expect("free");
        line.acquire(&who("b"), on(), t).expect_err("full");
        assert_eq!(line.holds_back(&who("a"), t), None, "a holder goes on");
        assert_eq!(line.holds_back(&who("c"), t), None, "not in line");
        let soon = t + Duration::from_secs(10);
        assert_eq!(
            line.holds_back(&who("b"), soon),
            Some(WAITER_RECHECK - Duration::from_secs(10))
        );
        assert_eq!(
            line.holds_back(&who("b"), t + WAITER_RECHECK),
            None,
            "recheck"
        );
        line.release(&who("a"));
        assert_eq!(line.holds_back(&who("b"), soon), None, "its turn");
    }

    #[test]
    fn a_deleted_waiter_gives_up_its_place_and_a_silent_one_loses_it() {
        let mut line = Line::default();
        let t = Instant::now();
        let on = || vec![want(node("pve1"), 1)];
        line.acquire(&who("a"), on(), t).expect("free");
        line.acquire(&who("b"), on(), t).expect_err("full");
        line.acquire(&who("c"), on(), t).expect_err("full");
        assert_eq!(
            line.forget(&who("b")),
            Vec::<Who>::new(),
            "a still holds it"
        );
        assert_eq!(line.release(&who("a")), vec![who("c")]);
        // c stops asking; d arrives once c's place has lapsed.
        let later = t + WAITER_UNSEEN + Duration::from_secs(1);
        assert_eq!(line.acquire(&who("d"), on(), later), Ok(()));
    }

    #[test]
    fn a_running_task_seen_after_a_restart_counts_and_a_vanished_holder_lapses() {
        let mut line = Line::default();
        let t = Instant::now();
        line.hold(&who("a"), vec![node("pve1")], t);
        let b = line
            .acquire(&who("b"), vec![want(node("pve1"), 1)], t)
            .expect_err("a's clone still runs");
        assert_eq!(b.running, 1);
        let later = t + HOLDER_UNSEEN;
        assert_eq!(
            line.acquire(&who("b"), vec![want(node("pve1"), 1)], later),
            Ok(()),
            "a's passes stopped saying its task runs"
        );
    }

    #[tokio::test]
    async fn a_freed_slot_wakes_the_machine_next_in_line() {
        let slots = TaskSlots::default();
        let mut woken = slots.take_wakeups().expect("first taker");
        assert!(slots.take_wakeups().is_none(), "one controller listens");
        slots
            .acquire(&who("a"), vec![want(node("pve1"), 1)])
            .expect("free");
        slots
            .acquire(&who("b"), vec![want(node("pve1"), 1)])
            .expect_err("full");
        slots.release(&who("a"));
        assert_eq!(woken.recv().await, Some(who("b")));
    }

    #[tokio::test(start_paused = true)]
    async fn a_wake_after_a_delay_comes_when_it_is_due_and_not_before() {
        let slots = TaskSlots::default();
        let mut woken = slots.take_wakeups().expect("first taker");
        let asked = tokio::time::Instant::now();
        slots.wake_after(vec![who("a")], Duration::from_secs(3));
        assert!(woken.try_recv().is_err(), "not at once");
        assert_eq!(woken.recv().await, Some(who("a")));
        assert!(asked.elapsed() >= Duration::from_secs(3));
    }
}
