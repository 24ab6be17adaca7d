//! The task recorded for a machine: a pass that submits one records it in status and stops
//! until its expected end ([`super::timing`] says when, [`super::due`] wakes the machine then
//! unless its node's task list shows it still running); a later pass (or a restarted
//! controller) checks it once, and a failed one holds the machine off during its back-off.

use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::runtime::reflector::ObjectRef;

use super::outcome::{Flow, Stop, Wait, wait, waiting};
use super::task::{FinishedTask, TaskKind, TaskPurpose, task_backoff};
use super::{
    During, MachineError, PROVISIONED, Reconcile, Scope, TaskTimer, claim_key, has_claim_key,
};
use crate::api::ProxmoxMachine;
use crate::controller::conditions::Decided;
use crate::controller::failures::Backoff;
use crate::controller::node_tasks::TaskList;
use crate::proxmox::{ClusterResource, ProxmoxClient, ProxmoxError, TaskRef, TaskStatus, Upid};

/// Tasks of one kind a machine may see succeed in a row before its passes back off: a step
/// that repeats a write Proxmox reports done is a loop, not progress.
const REPEATS_ALLOWED: u32 = 3;
/// Back-off of a machine that repeats a task that succeeded, from its first repeat beyond
/// [`REPEATS_ALLOWED`].
const REPEAT_BACKOFF: Backoff = Backoff {
    initial: Duration::from_secs(10),
    max: Duration::from_secs(300),
};

/// Whether `listed` shows the VM of a start or stop task on the task's node, unlocked, in the
/// power state the task brings.
fn listed_as_done(listed: &[ClusterResource], upid: &Upid, kind: Option<TaskKind>) -> bool {
    let power_state = match kind {
        Some(TaskKind::Start) => "running",
        Some(TaskKind::Stop) => "stopped",
        _ => return false,
    };
    let Ok(vmid) = upid.id.parse::<u32>() else {
        return false;
    };
    listed.iter().any(|vm| {
        vm.vmid == Some(vmid)
            && vm.node.as_deref() == Some(upid.node.as_str())
            && vm.lock.is_none()
            && vm.status.as_deref() == Some(power_state)
    })
}

/// The condition and requeue while a task runs.
fn running_step(upid: &Upid, purpose: Option<&TaskPurpose>, wait: Duration) -> Stop {
    let doing = purpose.map(|p| format!("{}: ", p.text)).unwrap_or_default();
    waiting(
        if purpose.is_some_and(|p| p.kind == Some(TaskKind::Clone)) {
            "Cloning"
        } else {
            "WaitingForTask"
        },
        format!(
            "{doing}Proxmox task {} on {} is running ({upid})",
            upid.task_type, upid.node
        ),
        Action::requeue(wait),
    )
}

/// What a machine whose step repeats a successful task is told.
fn repeated_task_message(
    upid: &Upid,
    purpose: &TaskPurpose,
    times: u32,
    delay: Duration,
) -> String {
    format!(
        "{} succeeded {times} times in a row (Proxmox task {} on {} answered OK, last {upid}) \
         without the machine getting further; retrying in {}s. Proxmox may answer differently \
         from what capmox expects: check its version and the task's log",
        purpose.text,
        upid.task_type,
        upid.node,
        delay.as_secs()
    )
}

/// The condition and requeue while a failed task's back-off lasts.
pub(super) fn failed_task_step(
    upid: &Upid,
    purpose: Option<&TaskPurpose>,
    exitstatus: &str,
    until: Timestamp,
    failures: i32,
    now: Timestamp,
) -> Wait {
    let remaining = until
        .duration_since(now)
        .try_into()
        .unwrap_or(Duration::from_secs(1));
    let doing = purpose
        .map(|p| format!(" ({})", p.text))
        .unwrap_or_default();
    wait(
        "TaskFailed",
        format!(
            "Proxmox task {} on {}{doing} failed: {exitstatus}; retrying after {until} (failure {failures} in a row, task {upid})",
            upid.task_type, upid.node
        ),
        Action::requeue(remaining),
    )
}

impl Reconcile<'_> {
    /// Notes that `upid` ended; the machine whose task waits next behind it on its node is
    /// looked at when that task is due, sooner than its earlier requeue.
    fn task_ended(&self, upid: &Upid) {
        if let Some(next) = self.context.task_timing.finished(upid) {
            let woken = self.machine_refs(&[next.machine]);
            self.context.task_slots.wake_after(woken, next.due_in);
        }
    }

    /// Looks at the machines with these claim keys now (through the task-slot channel).
    pub(super) fn wake_machines(&self, keys: &[String]) {
        let woken = self.machine_refs(keys);
        self.context.task_slots.wake(woken);
    }

    /// The machines with these claim keys, as far as the caches know them.
    fn machine_refs(&self, keys: &[String]) -> Vec<ObjectRef<ProxmoxMachine>> {
        let Some(caches) = self.context.caches.as_ref().filter(|_| !keys.is_empty()) else {
            return Vec::new();
        };
        // A key the index does not know (a machine without a UID, or one its watch has not
        // delivered to the index yet) is searched for in the store.
        keys.iter()
            .filter_map(|key| {
                caches
                    .machines_by_uid
                    .get(key, &caches.machines)
                    .or_else(|| {
                        caches
                            .machines
                            .find(|machine| has_claim_key(machine, key))
                            .map(|machine| ObjectRef::from_obj(&*machine))
                    })
            })
            .collect()
    }

    /// The state of the task `upid`: from its node's task list while this process waits for
    /// other tasks on that node too (one request answers for all of them, and the machines whose
    /// tasks it shows ended are woken), otherwise from the task's own status.
    async fn task_state(
        &self,
        proxmox: &ProxmoxClient,
        upid: &Upid,
    ) -> Result<TaskStatus, ProxmoxError> {
        let beside = self.context.task_timing.listed_with(upid);
        if beside.tasks > 1
            && let Some(since) = beside.since
            && let Some(list) = self
                .context
                .node_tasks
                .list_with(proxmox, upid, since)
                .await
            && let Some(status) = list.status_of(upid)
        {
            self.wake_listed_ended(&list, upid);
            tracing::debug!(%upid, task_type = %upid.task_type, ended = status.is_finished(), from = "node task list", "checked a Proxmox task");
            return Ok(status);
        }
        let status = proxmox.task_status(upid).await;
        if let Ok(status) = &status {
            tracing::debug!(%upid, task_type = %upid.task_type, ended = status.is_finished(), from = "task status", "checked a Proxmox task");
        }
        status
    }

    /// Wakes the machines (other than this one, which checked `checked`) whose tasks `list`
    /// shows ended, unless they wait for their guest's boot anyway: their passes settle them
    /// from the list, without a request.
    fn wake_listed_ended(&self, list: &TaskList, checked: &Upid) {
        let ended = self
            .context
            .task_timing
            .listed_ended_beside(checked, &|task| list.ended(task));
        self.wake_machines(&ended);
    }

    /// Records the task a Proxmox request started (`started`, its answer) and stops the pass
    /// until the task's expected end. `None`: Proxmox finished synchronously, go on. A failed
    /// request is reported as having happened in `purpose`.
    pub(super) fn submitted(
        &self,
        scope: &mut Scope,
        proxmox: &ProxmoxClient,
        started: Result<TaskRef, ProxmoxError>,
        kind: TaskKind,
        purpose: impl Fn() -> String,
    ) -> Flow {
        self.submitted_looking_at_guest(scope, proxmox, started, kind, purpose, false)
    }

    /// As [`Reconcile::submitted`]; with `look_at_guest`, a VM's start is checked when its guest
    /// is usually up, and the pass that sees it end looks at the guest.
    pub(super) fn submitted_looking_at_guest(
        &self,
        scope: &mut Scope,
        proxmox: &ProxmoxClient,
        started: Result<TaskRef, ProxmoxError>,
        kind: TaskKind,
        purpose: impl Fn() -> String,
        look_at_guest: bool,
    ) -> Flow {
        let Some(upid) = started.during(&purpose)? else {
            return Ok(());
        };
        let upid = upid.at_site(proxmox.endpoint());
        if kind.changes_listing() {
            self.context
                .inventory
                .changed(proxmox, &claim_key(self.machine));
        }
        let purpose = TaskPurpose::new(kind, purpose());
        let recorded = purpose.recorded();
        let machine = claim_key(self.machine);
        self.context.due_wakes.checks_with(&machine, proxmox);
        let clock = &self.context.task_timing;
        let mut wait = clock.submitted(&upid, &machine, &recorded);
        if kind == TaskKind::Start && look_at_guest {
            clock.boot_started(&machine, &upid.node);
            wait = clock.check_with_boot(&upid, &machine);
        }
        scope.status.task_ref = Some(upid.to_string());
        scope.status.task_purpose = Some(recorded);
        tracing::debug!(machine = %scope.name, %upid, purpose = purpose.text, kind = kind.as_str(), expected_ms = wait.as_millis() as u64, "submitted a Proxmox task");
        Err(running_step(&upid, Some(&purpose), wait))
    }

    /// As [`Reconcile::submitted`] for a deletion: what Proxmox no longer has is deleted.
    pub(super) fn deletion_submitted(
        &self,
        scope: &mut Scope,
        proxmox: &ProxmoxClient,
        started: Result<TaskRef, ProxmoxError>,
        kind: TaskKind,
        purpose: impl Fn() -> String,
    ) -> Flow {
        match started {
            Err(error) if error.is_not_found() => Ok(()),
            started => self.submitted(scope, proxmox, started, kind, purpose),
        }
    }

    /// The task recorded in `status.taskRef`, checked at most once per pass (and not before
    /// its expected end when this process submitted it): while it runs, nothing else happens;
    /// once it succeeded it is forgotten and remembered in `scope.finished` for this pass; a
    /// failed one holds off every other step during its back-off. `deleting`: a failed
    /// provisioning task is forgotten instead, since the deletion replaces what it did.
    /// `None`: go on with the next step.
    pub(super) async fn tracked_task(
        &self,
        scope: &mut Scope,
        proxmox: &ProxmoxClient,
        deleting: bool,
    ) -> Flow {
        if scope.status.task_ref.is_none()
            && let Some((upid, purpose)) = self
                .context
                .task_timing
                .in_flight_for(&claim_key(self.machine))
        {
            // This pass works from a copy older than the status that records the task.
            scope.status.task_ref = Some(upid.as_str().to_owned());
            scope.status.task_purpose = Some(purpose);
        }
        let Some(raw) = scope.status.task_ref.clone() else {
            return Ok(());
        };
        let upid: Upid = match raw.parse::<Upid>() {
            Ok(upid) => upid.at_site(proxmox.endpoint()),
            Err(error) => {
                tracing::warn!(machine = %scope.name, %error, "forgetting an unreadable status.taskRef");
                clear_task(scope);
                return Ok(());
            }
        };
        let purpose = scope.status.task_purpose.as_deref().map(TaskPurpose::parse);
        let backing_off = scope.status.retry_after.is_some();
        if !backing_off && let Some(wait) = self.context.task_timing.not_due(&upid) {
            return Err(running_step(&upid, purpose.as_ref(), wait));
        }
        // Before the task list: a start or stop settled by the listing leaves nothing to fetch
        // again for the machine's next look at its VM.
        if !backing_off
            && self
                .listing_shows_done(proxmox, &upid, purpose.as_ref())
                .await
        {
            self.task_ended(&upid);
            return self
                .task_succeeded(scope, upid, purpose.as_ref(), &raw)
                .await;
        }
        let checked = match self.context.node_tasks.listed_ended(proxmox, &upid) {
            Some(status) => Ok(status),
            None => self.task_state(proxmox, &upid).await,
        };
        let status = match checked {
            Ok(status) => status,
            Err(error) if error.is_not_found() => {
                // Proxmox no longer knows the task (rotated away, node reinstalled): what
                // exists in Proxmox tells the next step.
                tracing::info!(machine = %scope.name, %upid, "Proxmox no longer knows the recorded task; forgetting it");
                self.context.task_timing.forget(&upid);
                clear_task(scope);
                return Ok(());
            }
            Err(error) => {
                return Err(MachineError::ProxmoxStep {
                    step: format!(
                        "checking Proxmox task {} on {} ({upid})",
                        upid.task_type, upid.node
                    ),
                    source: error,
                }
                .into());
            }
        };
        if !status.is_finished() {
            self.context
                .due_wakes
                .checks_with(&claim_key(self.machine), proxmox);
            let wait = self.context.task_timing.still_running(&upid);
            return Err(running_step(&upid, purpose.as_ref(), wait));
        }
        self.task_ended(&upid);
        // A clone's success changes only its VM's lock, which the inventory then knows is
        // gone; every other end (a failed clone removes its VM) is fetched again.
        let cloned = scope.recorded_vmid.filter(|_| {
            status.is_success() && purpose.as_ref().and_then(|p| p.kind) == Some(TaskKind::Clone)
        });
        if let Some(vmid) = cloned {
            self.context.inventory.clone_ended(proxmox, vmid);
        } else if purpose.as_ref().is_none_or(TaskPurpose::changes_listing) {
            self.context
                .inventory
                .changed(proxmox, &claim_key(self.machine));
        }
        if status.is_success() {
            return self
                .task_succeeded(scope, upid, purpose.as_ref(), &raw)
                .await;
        }
        let exitstatus = status
            .exitstatus
            .unwrap_or_else(|| "unexpected status".to_owned());
        self.task_failed(scope, &upid, purpose.as_ref(), &exitstatus, deleting)
            .await
    }

    /// Whether the listing (fetched after the task was submitted) already shows what a start
    /// or a stop does, which settles the task without asking Proxmox about it: the VM on the
    /// task's node, unlocked, in the power state the task brings. A listing that lags behind
    /// Proxmox only costs the check it would have saved.
    async fn listing_shows_done(
        &self,
        proxmox: &ProxmoxClient,
        upid: &Upid,
        purpose: Option<&TaskPurpose>,
    ) -> bool {
        let kind = purpose.and_then(|p| p.kind);
        if !matches!(kind, Some(TaskKind::Start | TaskKind::Stop)) {
            return false;
        }
        let Ok(listed) = self
            .context
            .inventory
            .resources(proxmox, Some(&claim_key(self.machine)))
            .await
        else {
            return false;
        };
        listed_as_done(&listed, upid, kind)
    }

    /// A task that succeeded: forgotten, announced once, and remembered for this pass so the
    /// step it did is not repeated (unless it repeats too often, which backs the machine off).
    async fn task_succeeded(
        &self,
        scope: &mut Scope,
        upid: Upid,
        purpose: Option<&TaskPurpose>,
        raw: &str,
    ) -> Flow {
        scope.status.task_failures = None;
        clear_task(scope);
        let kind = purpose.and_then(|p| p.kind);
        self.announce(scope, &upid, kind, raw).await?;
        let machine = claim_key(self.machine);
        let times = self.context.task_timing.succeeded(&machine, kind);
        if times > REPEATS_ALLOWED
            && let Some(purpose) = purpose
        {
            return Err(self.repeated_task(scope, &upid, purpose, times).await);
        }
        scope.finished = Some(FinishedTask { upid, kind });
        Ok(())
    }

    /// A task that failed holds the machine off during its back-off (recorded in status);
    /// a deletion forgets a failed provisioning task, since it replaces what the task did.
    async fn task_failed(
        &self,
        scope: &mut Scope,
        upid: &Upid,
        purpose: Option<&TaskPurpose>,
        exitstatus: &str,
        deleting: bool,
    ) -> Flow {
        if deleting && !purpose.is_some_and(TaskPurpose::deletes) {
            tracing::info!(machine = %scope.name, %upid, exitstatus, "forgetting a failed provisioning task; the machine is being deleted");
            clear_task(scope);
            return Ok(());
        }
        let now = Timestamp::now();
        match scope.status.retry_after.clone() {
            None => Err(Stop::Wait(
                self.record_task_failure(scope, upid.as_str(), exitstatus)
                    .await,
            )),
            Some(Time(until)) if until > now => {
                let failures = scope.status.task_failures.unwrap_or(1);
                Err(Stop::Wait(failed_task_step(
                    upid, purpose, exitstatus, until, failures, now,
                )))
            }
            Some(_) => {
                // Back-off over: forget the failed task; the step runs again.
                clear_task(scope);
                Ok(())
            }
        }
    }

    /// Backs off a machine whose step repeats a task Proxmox reports done, saying what repeats
    /// and what Proxmox answered, instead of looping silently.
    async fn repeated_task(
        &self,
        scope: &Scope,
        upid: &Upid,
        purpose: &TaskPurpose,
        times: u32,
    ) -> Stop {
        let delay = REPEAT_BACKOFF.nominal(times - REPEATS_ALLOWED);
        let message = repeated_task_message(upid, purpose, times, delay);
        tracing::warn!(machine = %scope.name, %upid, times, "a Proxmox task repeats without progress");
        self.event(scope, EventType::Warning, "TaskRepeated", &message)
            .await;
        Stop::Wait(Wait {
            decided: Decided::failed(PROVISIONED, "TaskRepeated", message),
            action: Action::requeue(delay),
            backoff: true,
        })
    }

    /// Events for a task that succeeded, once: of all passes that see it finished (one may
    /// work from a stale cached copy of the machine), only the one that removes it from the
    /// stored status announces it.
    async fn announce(
        &self,
        scope: &mut Scope,
        upid: &Upid,
        kind: Option<TaskKind>,
        raw: &str,
    ) -> Result<(), MachineError> {
        let (reason, note) = match kind {
            Some(TaskKind::Clone) => (
                "Cloned",
                format!(
                    "created VM {} (task {upid})",
                    scope.status.virtual_machine_id.unwrap_or_default()
                ),
            ),
            Some(TaskKind::Start) => (
                "PoweredOn",
                format!(
                    "started VM {} on {}",
                    scope.status.virtual_machine_id.unwrap_or_default(),
                    upid.node
                ),
            ),
            _ => return Ok(()),
        };
        if self.forget_task(scope, raw).await? {
            self.event(scope, EventType::Normal, reason, &note).await;
        }
        Ok(())
    }

    /// Records a failed task: its UPID, one more consecutive failure, and the time before
    /// which nothing is retried; warns with the task's exit status.
    pub(super) async fn record_task_failure(
        &self,
        scope: &mut Scope,
        upid: &str,
        exitstatus: &str,
    ) -> Wait {
        let parsed: Option<Upid> = upid.parse().ok();
        let failures = scope.status.task_failures.unwrap_or(0).saturating_add(1);
        let delay = task_backoff(u32::try_from(failures).unwrap_or(u32::MAX));
        let now = Timestamp::now();
        // Whole seconds: Kubernetes stores times with second precision, and the stored value
        // must compare equal to what this pass decided.
        let until = Timestamp::from_second(
            now.as_second()
                .saturating_add(i64::try_from(delay.as_secs()).unwrap_or(i64::MAX)),
        )
        .unwrap_or(now);
        scope.status.task_ref = Some(upid.to_owned());
        scope.status.retry_after = Some(Time(until));
        scope.status.task_failures = Some(failures);
        let purpose = scope.status.task_purpose.as_deref().map(TaskPurpose::parse);
        let step = match &parsed {
            Some(parsed) => {
                failed_task_step(parsed, purpose.as_ref(), exitstatus, until, failures, now)
            }
            None => wait(
                "TaskFailed",
                format!("Proxmox task {upid} failed: {exitstatus}; retrying after {until}"),
                Action::requeue(delay),
            ),
        };
        self.event(
            scope,
            EventType::Warning,
            "TaskFailed",
            &step.decided.message,
        )
        .await;
        step
    }
}

/// Forgets the recorded task and its back-off time (the failure count stays until a task
/// succeeds).
fn clear_task(scope: &mut Scope) {
    scope.status.task_ref = None;
    scope.status.task_purpose = None;
    scope.status.retry_after = None;
}

/// How long until the task this process submitted for `machine` is expected to end, if it has
/// one and that is still ahead: the pass before then would only find it running.
pub(super) fn task_not_due(clock: &TaskTimer, machine: &ProxmoxMachine) -> Option<Duration> {
    key_not_due(clock, &claim_key(machine))
}

/// As [`task_not_due`], for the machine with claim key `machine`.
pub(super) fn key_not_due(clock: &TaskTimer, machine: &str) -> Option<Duration> {
    match clock.in_flight_for(machine) {
        Some((upid, _)) => clock.not_due(&upid),
        // Nor is a guest this process started looked at before it usually is done booting.
        None => clock.boot_not_due(machine),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn listed(status: &str, lock: Option<&str>) -> Vec<ClusterResource> {
        let mut vm = serde_json::json!({
            "id": "qemu/101", "type": "qemu", "vmid": 101, "node": "pve1", "status": status,
        });
        if let Some(lock) = lock {
            vm["lock"] = lock.into();
        }
        vec![serde_json::from_value(vm).expect("resource")]
    }

    #[test]
    fn only_a_listing_in_the_power_state_a_start_or_stop_brings_settles_it() {
        let start: Upid = "UPID:pve1:00001234:00005678:6553F000:qmstart:101:root@pam!capmox:"
            .parse()
            .expect("upid");
        let elsewhere: Upid = "UPID:pve2:00001234:00005678:6553F000:qmstart:101:root@pam!capmox:"
            .parse()
            .expect("upid");
        let start_kind = Some(TaskKind::Start);
        assert!(listed_as_done(&listed("running", None), &start, start_kind));
        // Lagging behind, locked, on another node, or a task the power state does not tell.
        assert!(!listed_as_done(
            &listed("stopped", None),
            &start,
            start_kind
        ));
        assert!(!listed_as_done(
            &listed("running", Some("backup")),
            &start,
            start_kind
        ));
        assert!(!listed_as_done(
            &listed("running", None),
            &elsewhere,
            start_kind
        ));
        assert!(!listed_as_done(
            &listed("running", None),
            &start,
            Some(TaskKind::Resize)
        ));
        assert!(!listed_as_done(&listed("running", None), &start, None));
        assert!(listed_as_done(
            &listed("stopped", None),
            &start,
            Some(TaskKind::Stop)
        ));
        assert!(!listed_as_done(&[], &start, start_kind));
    }

    #[test]
    fn a_repeated_task_says_what_repeats_what_proxmox_answered_and_when_it_is_tried_again() {
        let upid: Upid = "UPID:pve1:00001234:00005678:6553F000:download:local:root@pam!capmox:"
            .parse()
            .expect("upid");
        let purpose = TaskPurpose::new(
            TaskKind::UploadSeedIso,
            "uploading the seed ISO user-data-101.iso to local on pve1".to_owned(),
        );
        let delay = REPEAT_BACKOFF.nominal(4 - REPEATS_ALLOWED);
        assert_eq!(delay, Duration::from_secs(10));
        let message = repeated_task_message(&upid, &purpose, 4, delay);
        for part in [
            "uploading the seed ISO user-data-101.iso to local on pve1 succeeded 4 times in a row",
            "Proxmox task download on pve1 answered OK",
            "retrying in 10s",
        ] {
            assert!(message.contains(part), "{part:?} in {message}");
        }
        assert_eq!(
            REPEAT_BACKOFF.nominal(20),
            Duration::from_secs(300),
            "at most five minutes"
        );
    }

    #[test]
    fn a_failed_task_step_names_the_task_its_purpose_exit_status_and_the_retry_time() {
        let upid: Upid = "UPID:pve1:00001234:00005678:6553F000:qmclone:9000:root@pam!capmox:"
            .parse()
            .expect("upid");
        let now = Timestamp::from_second(1_767_225_600).expect("time");
        let until = Timestamp::from_second(1_767_225_620).expect("time");
        let purpose = TaskPurpose::new(
            TaskKind::Clone,
            "cloning template 9000 to VM 101 on pve1".to_owned(),
        );
        let Wait {
            decided, action, ..
        } = failed_task_step(&upid, Some(&purpose), "storage full", until, 2, now);
        assert_eq!(decided.reason, "TaskFailed");
        assert!(
            decided.message.contains(
                "qmclone on pve1 (cloning template 9000 to VM 101 on pve1) failed: storage full"
            ),
            "{}",
            decided.message
        );
        assert!(
            decided.message.contains("failure 2 in a row"),
            "{}",
            decided.message
        );
        assert_eq!(action, Action::requeue(Duration::from_secs(20)));
    }
}
