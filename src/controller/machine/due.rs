//! The machines that wait for their Proxmox task or their guest's boot, each woken once the
//! task timing says it is due. The timing is asked again at each wake-up, so an expected end
//! that moved later (a queue retimed, a boot learned slower) costs no pass; and a due task is
//! first looked up in its node's task list, so one still running costs no pass either (the
//! pass that follows its end reads that list, without a request). A pass's own requeue is then
//! only a safety net. After a restart: nothing waits here, and the passes after the restart
//! look at every machine.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use kube::runtime::reflector::ObjectRef;

use super::tracking::key_not_due;
use super::{TaskKind, TaskPurpose, TaskTimer};
use crate::api::ProxmoxMachine;
use crate::controller::node_tasks::NodeTaskLists;
use crate::controller::task_slots::TaskSlots;
use crate::proxmox::ProxmoxClient;

/// Requeue of a pass whose machine waits here: only if its wake-up is lost.
pub const DUE_SAFETY_RECHECK: Duration = Duration::from_secs(120);

/// The waiting machines by claim key, each with the turn of the pass that left it waiting
/// (a later pass's wait replaces an earlier one's), and the Proxmox client each machine's tasks
/// are checked with.
#[derive(Clone, Default)]
pub struct DueWakes {
    waiting: Arc<Mutex<HashMap<String, Waiting>>>,
    clients: Arc<Mutex<HashMap<String, ProxmoxClient>>>,
    turns: Arc<AtomicU64>,
}

struct Waiting {
    turn: u64,
    machine: ObjectRef<ProxmoxMachine>,
}

/// What a wait reads and wakes through.
#[derive(Clone)]
pub struct Watch {
    pub timer: TaskTimer,
    pub node_tasks: NodeTaskLists,
    pub slots: TaskSlots,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // Never held across a panic-prone call: a poisoned map is still consistent.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl DueWakes {
    /// Notes the client the machine with claim key `key` submits and checks its tasks with.
    pub fn checks_with(&self, key: &str, proxmox: &ProxmoxClient) {
        lock(&self.clients).insert(key.to_owned(), proxmox.clone());
    }

    /// Wakes `machine` (claim key `key`) through the slots' channel once its task or guest is
    /// worth a look and its task is not listed running, asking first after `first`. Replaces
    /// the machine's earlier wait.
    pub fn wake_when_due(
        &self,
        machine: ObjectRef<ProxmoxMachine>,
        key: String,
        first: Duration,
        watch: Watch,
    ) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let turn = self.turns.fetch_add(1, Ordering::Relaxed);
        lock(&self.waiting).insert(key.clone(), Waiting { turn, machine });
        let due = self.clone();
        runtime.spawn(async move {
            let mut wait = first;
            loop {
                tokio::time::sleep(wait).await;
                if !due.is_turn(&key, turn) {
                    return;
                }
                wait = match key_not_due(&watch.timer, &key) {
                    Some(remaining) => remaining,
                    None => match due.listed_running(&key, &watch).await {
                        Some(next_check) => next_check,
                        None => break,
                    },
                };
            }
            due.wake_if_turn(&key, Some(turn), &watch.slots);
        });
    }

    /// `machine`'s pass ended without waiting here: an earlier wait of it wakes nothing.
    pub fn forget(&self, key: &str) {
        lock(&self.waiting).remove(key);
        lock(&self.clients).remove(key);
    }

    /// Whether the wait of `key` that took `turn` is still its latest.
    fn is_turn(&self, key: &str, turn: u64) -> bool {
        lock(&self.waiting).get(key).is_some_and(|w| w.turn == turn)
    }

    /// Ends the wait of `key` (that took `turn`, if given) and wakes its machine, if that wait
    /// is still its latest; a machine that no longer waits keeps no client here.
    fn wake_if_turn(&self, key: &str, turn: Option<u64>, slots: &TaskSlots) {
        let mut waiting = lock(&self.waiting);
        if waiting
            .get(key)
            .is_some_and(|w| turn.is_none_or(|turn| w.turn == turn))
            && let Some(ended) = waiting.remove(key)
        {
            drop(waiting);
            // Its pass notes the client again if the machine still waits for a task.
            lock(&self.clients).remove(key);
            slots.wake(vec![ended.machine]);
        }
    }

    /// The next check of the due task of `key` when its node's task list shows it still
    /// running; `None`: its pass is worth running (the task ended, or is a start, checked when
    /// its guest is worth a look, which the pass settles from the VM listing; or the list cannot
    /// tell). Machines waiting here whose tasks the list shows ended are woken too.
    async fn listed_running(&self, key: &str, watch: &Watch) -> Option<Duration> {
        let (upid, purpose) = watch.timer.in_flight_for(key)?;
        if TaskPurpose::parse(&purpose).kind == Some(TaskKind::Start) {
            return None;
        }
        let proxmox = lock(&self.clients).get(key)?.clone();
        let since = watch.timer.listed_with(&upid).since?;
        let list = watch.node_tasks.list_with(&proxmox, &upid, since).await?;
        for other in watch
            .timer
            .listed_ended_beside(&upid, &|task| list.ended(task))
        {
            self.wake_if_turn(&other, None, &watch.slots);
        }
        let status = list.status_of(&upid)?;
        (!status.is_finished()).then(|| watch.timer.still_running(&upid))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controller::machine::TaskTimingPolicy;

    fn machine(name: &str) -> ObjectRef<ProxmoxMachine> {
        ObjectRef::new(name).within("default")
    }

    /// Waits of machines the timing knows nothing of (so each is due at its first look).
    fn wait(due: &DueWakes, slots: &TaskSlots, name: &str, first: Duration) {
        let watch = Watch {
            timer: TaskTimer::new(TaskTimingPolicy::Learned),
            node_tasks: NodeTaskLists::default(),
            slots: slots.clone(),
        };
        due.wake_when_due(machine(name), name.into(), first, watch);
    }

    #[tokio::test(start_paused = true)]
    async fn a_machine_is_woken_once_by_its_latest_wait_and_not_after_its_pass_forgot_it() {
        let due = DueWakes::default();
        let slots = TaskSlots::default();
        let mut woken = slots.take_wakeups().expect("first taker");
        let start = tokio::time::Instant::now();
        wait(&due, &slots, "m1", Duration::from_secs(1));
        // A later pass of m1 waits longer: its first wait wakes nothing.
        wait(&due, &slots, "m1", Duration::from_secs(3));
        assert_eq!(woken.recv().await, Some(machine("m1")));
        assert!(start.elapsed() >= Duration::from_secs(3));
        // m2's pass ended without waiting; m3's wait, later, comes next in the channel.
        wait(&due, &slots, "m2", Duration::from_secs(1));
        due.forget("m2");
        wait(&due, &slots, "m3", Duration::from_secs(2));
        assert_eq!(woken.recv().await, Some(machine("m3")));
        assert!(woken.try_recv().is_err(), "nothing else woke");
    }

    #[tokio::test]
    async fn a_clone_still_running_is_looked_up_in_its_nodes_list_and_wakes_its_machine_once_ended()
    {
        use crate::proxmox::{ApiToken, ClientConfig, CloneParams};
        use capmox_sim::{SimOptions, Simulator, Topology};
        let sim = Simulator::start(
            Topology::example(),
            SimOptions {
                // Longer than the clone duration expected while none was seen end.
                clone_duration: Duration::from_millis(2_400),
                ..SimOptions::default()
            },
        )
        .await
        .expect("simulator");
        let token = ApiToken::parse(&sim.token()).expect("token");
        let proxmox = ProxmoxClient::new(&ClientConfig::new(sim.url(), token)).expect("client");
        let params = CloneParams {
            newid: 100,
            ..CloneParams::default()
        };
        let clone = proxmox
            .clone_vm("pve1", 9000, &params)
            .await
            .expect("clone");
        // Checked when a clone is expected to end, it is found running, then ended.
        let watch = Watch {
            timer: TaskTimer::new(TaskTimingPolicy::Learned),
            node_tasks: NodeTaskLists::default(),
            slots: TaskSlots::default(),
        };
        let mut woken = watch.slots.take_wakeups().expect("first taker");
        let first = watch.timer.submitted(&clone, "m1", "cloning: cloning");
        let due = DueWakes::default();
        due.checks_with("m1", &proxmox);
        due.wake_when_due(machine("m1"), "m1".into(), first, watch.clone());
        assert_eq!(woken.recv().await, Some(machine("m1")));
        let woken_at = tokio::time::Instant::now();
        let record = sim
            .task_records()
            .into_iter()
            .find(|task| task.upid == clone.as_str())
            .expect("the clone's record");
        assert!(
            record.ended.is_some_and(|ended| ended <= woken_at),
            "woken only once the clone ended"
        );
        let lists = sim
            .request_log()
            .iter()
            .filter(|request| request.path == "/nodes/pve1/tasks")
            .count();
        assert!(lists >= 2, "looked up while running, then ended: {lists}");
        // Its pass reads that end from the list, without a request.
        assert!(watch.node_tasks.listed_ended(&proxmox, &clone).is_some());
        assert!(woken.try_recv().is_err(), "woken once");
    }
}
