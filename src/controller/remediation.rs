//! The ProxmoxRemediation reconciler: Cluster API's external remediation, reboot first. A
//! MachineHealthCheck whose `spec.remediation.templateRef` names a ProxmoxRemediationTemplate
//! creates a ProxmoxRemediation named after each unhealthy Machine (owned by it) and deletes it
//! once the Machine is healthy again. Until then this controller reboots the Machine's VM
//! (`status/reboot`, whose shutdown may take `shutdownTimeoutSeconds`; a reboot that does not
//! finish in time is followed by a hard `status/reset`), gives the Node `timeoutSeconds` to come
//! back, reboots again up to `retryLimit`, has Proxmox HA move a VM it manages to another node
//! of the machine's zone (once, giving the Node its time again), and then hands the Machine
//! back to its owner by setting the Machine's `OwnerRemediated` condition to False, as the
//! MachineHealthCheck itself does without a template: the MachineSet or KubeadmControlPlane
//! then replaces it.
//!
//! Everything the remediation did is in its status (phase, reboots, the task in flight, when
//! the VM last restarted), so a restarted controller, or the replica that takes the Lease, goes
//! on where it was; a task in flight is looked at again, never submitted twice. A remediation
//! is rare and short, so a pass reads the objects it needs (Machine, ProxmoxMachine, Cluster,
//! ProxmoxCluster) rather than this controller keeping a copy of every machine in memory, and
//! only when it acts on Proxmox.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Patch, PatchParams};
use kube::runtime::controller::{Action, Config as ControllerConfig, Controller};
use kube::{Api, Resource, ResourceExt};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use super::Context;
use super::conditions::{self, Decided};
use super::credentials::client_config;
use super::failures::{self, Pass};
use super::guarded::WriteError;
use crate::api::{
    ProxmoxCluster, ProxmoxMachine, ProxmoxRemediation, ProxmoxRemediationStatus, RemediationPhase,
    RemediationStrategy,
};
use crate::capi;
use crate::placement;
use crate::proxmox::{ClusterResource, ProxmoxClient, ProxmoxError, ResourceType, Upid};

/// Field manager of everything this controller writes.
pub const FIELD_MANAGER: &str = "capmox-proxmoxremediation";
/// Controller name in metrics and logs.
pub const CONTROLLER: &str = "proxmoxremediation";
/// Remediations reconciled at once (each pass is a few reads and at most one Proxmox call).
pub const CONCURRENCY: u16 = 2;
/// How soon a reboot or reset task is looked at again.
const TASK_RECHECK: Duration = Duration::from_secs(5);
/// How soon a VM that Proxmox HA moves is looked at again.
const MOVE_RECHECK: Duration = Duration::from_secs(5);
/// How soon a remediation whose Proxmox cannot be reached tries again.
const UNREACHABLE_RECHECK: Duration = Duration::from_secs(30);
/// How soon a paused remediation looks again (Clusters are not watched here).
const PAUSED_RECHECK: Duration = Duration::from_secs(60);
/// The condition this controller reports (with its `Ready` summary).
pub const REMEDIATED: &str = "Remediated";
/// The Machine condition that hands a Machine to its owner for replacement.
const OWNER_REMEDIATED: &str = "OwnerRemediated";
/// The reason the MachineHealthCheck gives `OwnerRemediated` when it asks the owner to act.
const OWNER_WAITING: &str = "WaitingForRemediation";

/// Why a reconcile failed; it is retried with back-off.
#[derive(Debug, thiserror::Error)]
pub enum RemediationError {
    /// The reconcile panicked (a bug); the object is retried with back-off.
    #[error(transparent)]
    Panicked(#[from] super::metrics::Panicked),
    /// A Kubernetes API call failed.
    #[error("Kubernetes API error: {0}")]
    Kube(#[from] kube::Error),
    /// The credentials Secret could not be read.
    #[error(transparent)]
    Write(#[from] WriteError),
    /// Proxmox refused or failed a request.
    #[error("{doing}: {source}")]
    Proxmox {
        /// What the pass was doing.
        doing: String,
        /// Underlying error.
        source: ProxmoxError,
    },
    /// The object lacks a name or namespace (never true for objects read from the API).
    #[error("ProxmoxRemediation without name or namespace")]
    MissingIdentity,
}

/// The remediation's spec values, resolved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Reboots to try.
    pub retry_limit: u32,
    /// How long the Node has after each reboot.
    pub timeout: Duration,
    /// Seconds a clean reboot may take before the VM is reset.
    pub shutdown_timeout_seconds: u32,
    /// Whether an HA-managed VM is moved before the replacement.
    pub move_before_replace: bool,
}

impl Limits {
    fn of(strategy: &RemediationStrategy) -> Self {
        Self {
            retry_limit: strategy.retry_limit(),
            timeout: Duration::from_secs(u64::from(strategy.timeout_seconds())),
            shutdown_timeout_seconds: strategy.shutdown_timeout_seconds(),
            move_before_replace: strategy.move_before_replace(),
        }
    }
}

/// The Machine's VM, as far as the remediation can reach it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    /// The VM, where it runs now.
    Vm {
        /// VMID.
        vmid: u32,
        /// Node it runs on.
        node: String,
        /// For a VM Proxmox HA manages, the online node of its zone HA could move it to.
        move_to: Option<String>,
    },
    /// There is nothing to reboot: why (the Machine is handed back at once).
    Gone(String),
    /// Proxmox cannot be reached with the cluster's credentials: why.
    Unreachable(String),
    /// The Machine is being deleted or is gone: its owner replaces it already.
    Leaving,
    /// The Cluster or the Machine pauses reconciliation.
    Paused,
    /// No Machine of the request's name in its namespace: the request names nothing to repair.
    NoMachine,
}

/// How the task in `status.taskRef` stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TaskSeen {
    /// Still running.
    Running,
    /// Ended OK: the VM restarted.
    Succeeded,
    /// Ended with this error.
    Failed(String),
}

/// What a pass knows; `None` for what it has not looked at.
#[derive(Clone, Debug)]
pub struct Observed {
    /// The spec, resolved.
    pub limits: Limits,
    /// The status as written.
    pub status: ProxmoxRemediationStatus,
    /// The time of the pass.
    pub now: Timestamp,
    /// The Machine's VM.
    pub target: Option<Target>,
    /// The task in `status.taskRef`.
    pub task: Option<TaskSeen>,
}

/// Something to look at before deciding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Look {
    /// The Machine's VM.
    Target,
    /// The task in `status.taskRef`.
    Task,
}

/// Something to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Effect {
    /// A clean reboot of the VM.
    Reboot,
    /// A hard reset of the VM.
    Reset,
    /// Have Proxmox HA move the VM to this node.
    Move(String),
    /// Set the Machine's `OwnerRemediated` to False, saying why.
    HandOff(String),
}

/// The next step of a pass.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Next {
    /// Look at something first.
    Look(Look),
    /// Act, then write `status`.
    Do(Effect, Report),
    /// Write `status` (when it changed) and look again after the action.
    End(Report, Action),
}

/// What the remediation reports after the step: its phase and the condition's reason and
/// message. Fields the executor fills in (task, reboots) are added by it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Report {
    /// The phase.
    pub phase: Option<RemediationPhase>,
    /// The condition's reason.
    pub reason: &'static str,
    /// The condition's message.
    pub message: String,
    /// When the VM finished restarting (set when this pass saw it).
    pub restarted: Option<Timestamp>,
}

/// The next step from what the pass observed. Pure.
pub fn decide(o: &Observed) -> Next {
    let phase = o.status.phase;
    let reboots = o.status.reboots();
    if phase == Some(RemediationPhase::Replacing) {
        return Next::End(
            report(phase, "ReplacementRequested", current_message(o)),
            Action::await_change(),
        );
    }
    // Waiting for the Node costs nothing until its time is up.
    if phase == Some(RemediationPhase::WaitingForNode)
        && let Some(left) = node_time_left(o)
    {
        let message = format!(
            "the VM restarted (reboot {reboots} of {}); waiting up to {}s for the Node to be healthy again",
            o.limits.retry_limit,
            o.limits.timeout.as_secs()
        );
        return Next::End(
            report(phase, "WaitingForNode", message),
            Action::requeue(left),
        );
    }
    let Some(target) = &o.target else {
        return Next::Look(Look::Target);
    };
    match target {
        Target::Leaving => {
            return Next::End(
                report(
                    phase,
                    "MachineDeleting",
                    "the Machine is being deleted".to_owned(),
                ),
                Action::await_change(),
            );
        }
        Target::NoMachine => {
            return Next::End(
                report(
                    phase,
                    "MachineNotFound",
                    "no Machine of this name in this namespace; a MachineHealthCheck names its request after the Machine".to_owned(),
                ),
                Action::await_change(),
            );
        }
        Target::Paused => {
            return Next::End(
                report(
                    phase,
                    "Paused",
                    "the Cluster or the Machine is paused".to_owned(),
                ),
                Action::requeue(PAUSED_RECHECK),
            );
        }
        Target::Gone(why) => return hand_off(why.clone()),
        Target::Unreachable(why) => {
            return Next::End(
                report(phase, "ProxmoxUnavailable", format!("{why}; retrying")),
                Action::requeue(UNREACHABLE_RECHECK),
            );
        }
        Target::Vm { .. } => {}
    }
    match phase {
        None => reboot_or_hand_off(o),
        Some(RemediationPhase::WaitingForNode) => reboot_or_hand_off(o),
        Some(RemediationPhase::Rebooting) => after_task(o, RemediationPhase::Rebooting),
        Some(RemediationPhase::Resetting) => after_task(o, RemediationPhase::Resetting),
        Some(RemediationPhase::Moving) => after_move(o),
        Some(RemediationPhase::Replacing) => hand_off(current_message(o)),
    }
}

/// What comes after the reboot or reset in flight.
fn after_task(o: &Observed, phase: RemediationPhase) -> Next {
    let vm = vm_name(o);
    if o.status.task_ref.is_none() {
        // The submission's status write was lost: do it again (Proxmox queues a second one
        // behind the VM's lock at worst).
        return match phase {
            RemediationPhase::Resetting => do_reset(o),
            _ => do_reboot(o),
        };
    }
    let Some(task) = &o.task else {
        return Next::Look(Look::Task);
    };
    match (task, phase) {
        (TaskSeen::Running, RemediationPhase::Resetting) => Next::End(
            report(Some(phase), "Resetting", format!("{vm} is being reset")),
            Action::requeue(TASK_RECHECK),
        ),
        (TaskSeen::Running, _) => Next::End(
            report(
                Some(phase),
                "Rebooting",
                format!("{vm} is rebooting (reboot {})", o.status.reboots()),
            ),
            Action::requeue(TASK_RECHECK),
        ),
        (TaskSeen::Succeeded, _) => {
            let mut done = report(
                Some(RemediationPhase::WaitingForNode),
                "WaitingForNode",
                format!(
                    "{vm} restarted; waiting up to {}s for the Node to be healthy again",
                    o.limits.timeout.as_secs()
                ),
            );
            done.restarted = Some(o.now);
            Next::End(done, Action::requeue(o.limits.timeout))
        }
        (TaskSeen::Failed(_), RemediationPhase::Rebooting) => do_reset(o),
        (TaskSeen::Failed(error), _) => hand_off(format!("resetting {vm} failed: {error}")),
    }
}

/// Another reboot while the limit allows, then a move by HA where it can, else the hand-off.
fn reboot_or_hand_off(o: &Observed) -> Next {
    let reboots = o.status.reboots();
    if reboots < o.limits.retry_limit {
        return do_reboot(o);
    }
    if o.limits.move_before_replace
        && o.status.moved_to.is_none()
        && let Some(Target::Vm {
            move_to: Some(to), ..
        }) = &o.target
    {
        return Next::Do(
            Effect::Move(to.clone()),
            report(
                Some(RemediationPhase::Moving),
                "Moving",
                format!(
                    "{} did not recover from {reboots} reboot(s); Proxmox HA moves it to {to}",
                    vm_name(o)
                ),
            ),
        );
    }
    let moved = o
        .status
        .moved_to
        .as_ref()
        .map(|to| format!(" and a move to {to}"))
        .unwrap_or_default();
    hand_off(format!(
        "the Node did not become healthy within {}s of {reboots} reboot(s){moved} of {}",
        o.limits.timeout.as_secs(),
        vm_name(o)
    ))
}

/// The VM on its new node starts the Node's time; a move that does not finish in the Node's
/// time hands the Machine back.
fn after_move(o: &Observed) -> Next {
    let to = o.status.moved_to.clone().unwrap_or_default();
    if let Some(Target::Vm { node, .. }) = &o.target
        && *node == to
    {
        let mut moved = report(
            Some(RemediationPhase::WaitingForNode),
            "WaitingForNode",
            format!(
                "{} moved; waiting up to {}s for the Node to be healthy again",
                vm_name(o),
                o.limits.timeout.as_secs()
            ),
        );
        moved.restarted = Some(o.now);
        return Next::End(moved, Action::requeue(o.limits.timeout));
    }
    let requested = o.status.move_requested.as_ref().map(|t| t.0);
    if requested.is_some_and(|at| time_left(at, o.limits.timeout, o.now).is_none()) {
        return hand_off(format!(
            "Proxmox HA did not move {} to {to} within {}s",
            vm_name(o),
            o.limits.timeout.as_secs()
        ));
    }
    Next::End(
        report(
            Some(RemediationPhase::Moving),
            "Moving",
            format!("Proxmox HA moves {} to {to}", vm_name(o)),
        ),
        Action::requeue(MOVE_RECHECK),
    )
}

fn do_reboot(o: &Observed) -> Next {
    Next::Do(
        Effect::Reboot,
        report(
            Some(RemediationPhase::Rebooting),
            "Rebooting",
            format!(
                "{} is rebooting (reboot {} of {})",
                vm_name(o),
                o.status.reboots() + 1,
                o.limits.retry_limit
            ),
        ),
    )
}

fn do_reset(o: &Observed) -> Next {
    Next::Do(
        Effect::Reset,
        report(
            Some(RemediationPhase::Resetting),
            "Resetting",
            format!("{} did not reboot in time; it is being reset", vm_name(o)),
        ),
    )
}

fn hand_off(why: String) -> Next {
    let message = format!("{why}; the Machine is handed back to its owner to be replaced");
    Next::Do(
        Effect::HandOff(message.clone()),
        report(
            Some(RemediationPhase::Replacing),
            "ReplacementRequested",
            message,
        ),
    )
}

/// How long the Node still has, while it has time.
fn node_time_left(o: &Observed) -> Option<Duration> {
    let restarted = o.status.last_remediated.as_ref()?.0;
    time_left(restarted, o.limits.timeout, o.now)
}

/// What is left of `span` from `since` at `now`, while something is.
fn time_left(since: Timestamp, span: Duration, now: Timestamp) -> Option<Duration> {
    let deadline = since
        .checked_add(SignedDuration::try_from(span).ok()?)
        .ok()?;
    Duration::try_from(deadline.duration_since(now))
        .ok()
        .filter(|d| !d.is_zero())
}

fn vm_name(o: &Observed) -> String {
    match (&o.target, o.status.virtual_machine_id) {
        (Some(Target::Vm { vmid, node, .. }), _) => format!("VM {vmid} on {node}"),
        (_, Some(vmid)) => format!("VM {vmid}"),
        _ => "the Machine's VM".to_owned(),
    }
}

fn current_message(o: &Observed) -> String {
    o.status
        .conditions
        .iter()
        .find(|c| c.type_ == REMEDIATED)
        .map(|c| c.message.clone())
        .unwrap_or_default()
}

fn report(phase: Option<RemediationPhase>, reason: &'static str, message: String) -> Report {
    Report {
        phase,
        reason,
        message,
        restarted: None,
    }
}

/// Runs the controller until `shutdown` is cancelled.
pub async fn run(context: Arc<Context>, shutdown: CancellationToken) {
    let remediations: Api<ProxmoxRemediation> = match &context.config.watch_namespace {
        Some(namespace) => Api::namespaced(context.client.clone(), namespace),
        None => Api::all(context.client.clone()),
    };
    let controller = Controller::new(remediations, context.config.shard_watch());
    let store = controller.store();
    super::report_cache_sync(store.clone(), context.readiness.clone(), CONTROLLER);
    context.metrics.work_queue(CONTROLLER).observe(store);
    controller
        .with_config(ControllerConfig::default().concurrency(CONCURRENCY))
        .graceful_shutdown_on(shutdown.cancelled_owned())
        .run(reconcile, error_policy, context)
        .for_each(|result| async move {
            if let Err(error) = result {
                tracing::debug!(controller = CONTROLLER, %error, "reconcile finished with an error");
            }
        })
        .await;
}

/// The requeue after a failed pass: the remediation's back-off.
pub fn error_policy(
    remediation: Arc<ProxmoxRemediation>,
    error: &RemediationError,
    context: Arc<Context>,
) -> Action {
    failures::after_error(&context.retries, CONTROLLER, &*remediation, error)
}

/// One pass over a remediation.
pub async fn reconcile(
    remediation: Arc<ProxmoxRemediation>,
    context: Arc<Context>,
) -> Result<Action, RemediationError> {
    let pass = context
        .metrics
        .measure(
            CONTROLLER,
            &*remediation,
            reconcile_inner(&remediation, &context),
        )
        .await?;
    Ok(context.retries.settle(&failures::key(&*remediation), pass))
}

async fn reconcile_inner(
    remediation: &ProxmoxRemediation,
    context: &Context,
) -> Result<Pass, RemediationError> {
    let namespace = remediation
        .namespace()
        .ok_or(RemediationError::MissingIdentity)?;
    let name = remediation
        .metadata
        .name
        .clone()
        .ok_or(RemediationError::MissingIdentity)?;
    let current = remediation.status.clone().unwrap_or_default();
    let mut observed = Observed {
        limits: Limits::of(&remediation.spec.strategy),
        status: current.clone(),
        now: Timestamp::now(),
        target: None,
        task: None,
    };
    let mut reach = None;
    let (report, action, effects) = loop {
        match decide(&observed) {
            Next::Look(Look::Target) => {
                let found = find_target(context, &namespace, &name).await?;
                observed.target = Some(found.target);
                reach = found.proxmox;
            }
            Next::Look(Look::Task) => {
                observed.task = Some(look_at_task(reach.as_ref(), &current).await?);
            }
            Next::Do(effect, report) => {
                let done = act(
                    context,
                    &namespace,
                    &name,
                    &observed,
                    reach.as_ref(),
                    &effect,
                )
                .await?;
                let action = match effect {
                    Effect::HandOff(_) => Action::await_change(),
                    _ => Action::requeue(TASK_RECHECK),
                };
                break (report, action, Some(done));
            }
            Next::End(report, action) => break (report, action, None),
        }
    };
    let desired = next_status(remediation, &observed, &report, effects);
    if desired != current {
        write_status(context, &namespace, &name, &desired).await?;
    }
    Ok(Pass::Done(action))
}

/// What an effect changed that the status records.
#[derive(Clone, Debug, Default)]
struct Done {
    /// The task submitted (reboot or reset).
    task: Option<Upid>,
    /// A reboot was started (a reset continues the same reboot).
    rebooted: bool,
    /// Proxmox HA was asked to move the VM to this node.
    moved_to: Option<String>,
}

/// The status after the pass.
fn next_status(
    remediation: &ProxmoxRemediation,
    observed: &Observed,
    report: &Report,
    done: Option<Done>,
) -> ProxmoxRemediationStatus {
    let mut status = observed.status.clone();
    status.phase = report.phase;
    if let Some(restarted) = report.restarted {
        status.last_remediated = Some(Time(restarted));
        status.task_ref = None;
    }
    if let Some(done) = done {
        status.task_ref = done.task.map(|upid| upid.as_str().to_owned());
        if done.rebooted {
            status.retry_count =
                Some(i32::try_from(observed.status.reboots() + 1).unwrap_or(i32::MAX));
        }
        if let Some(to) = done.moved_to {
            status.moved_to = Some(to);
            status.move_requested = Some(Time(observed.now));
        }
    }
    if report.phase == Some(RemediationPhase::Replacing) {
        status.task_ref = None;
    }
    if let Some(Target::Vm { vmid, node, .. }) = &observed.target {
        status.virtual_machine_id = Some(i64::from(*vmid));
        status.proxmox_node = Some(node.clone());
    }
    let decided = Decided::failed(REMEDIATED, report.reason, report.message.clone());
    status.conditions = conditions::merge(
        &observed.status.conditions,
        &[decided],
        remediation.metadata.generation,
        observed.now,
    );
    status
}

async fn write_status(
    context: &Context,
    namespace: &str,
    name: &str,
    status: &ProxmoxRemediationStatus,
) -> Result<(), RemediationError> {
    let api: Api<ProxmoxRemediation> = Api::namespaced(context.client.clone(), namespace);
    super::apply_status(&api, name, FIELD_MANAGER, status).await?;
    Ok(())
}

/// Reboots, resets or moves the VM, or hands the Machine back.
async fn act(
    context: &Context,
    namespace: &str,
    name: &str,
    observed: &Observed,
    proxmox: Option<&ProxmoxClient>,
    effect: &Effect,
) -> Result<Done, RemediationError> {
    let key = &inventory_key(namespace, name);
    let vm = match &observed.target {
        Some(Target::Vm { vmid, node, .. }) => Some((*vmid, node.as_str())),
        _ => None,
    };
    match (effect, vm, proxmox) {
        (Effect::HandOff(message), _, _) => {
            hand_machine_back(context, namespace, name, message).await?;
            tracing::info!(remediation = %key, %message, "handed the Machine back to its owner for replacement");
            Ok(Done::default())
        }
        (Effect::Move(to), Some((vmid, node)), Some(proxmox)) => {
            proxmox
                .ha_migrate(&format!("vm:{vmid}"), to)
                .await
                .map_err(|source| RemediationError::Proxmox {
                    doing: format!("asking Proxmox HA to move VM {vmid} from {node} to {to}"),
                    source,
                })?;
            // The next look lists the VMs afresh, to see where it is.
            context.inventory.changed(proxmox, key);
            tracing::info!(remediation = %key, vmid, from = node, to = %to, "reboots did not help; Proxmox HA moves the VM within its zone");
            Ok(Done {
                moved_to: Some(to.clone()),
                ..Done::default()
            })
        }
        (Effect::Reboot | Effect::Reset, Some((vmid, node)), Some(proxmox)) => {
            restart(proxmox, key, observed, vmid, node, effect).await
        }
        // Proxmox is acted on only with a VM and its Proxmox at hand.
        (_, _, _) => Ok(Done::default()),
    }
}

/// Submits the clean reboot or the hard reset of the VM.
async fn restart(
    proxmox: &ProxmoxClient,
    key: &str,
    observed: &Observed,
    vmid: u32,
    node: &str,
    effect: &Effect,
) -> Result<Done, RemediationError> {
    let rebooted = *effect == Effect::Reboot;
    let (doing, submitted) = if rebooted {
        let timeout = observed.limits.shutdown_timeout_seconds;
        (
            "rebooting",
            proxmox.reboot_vm(node, vmid, Some(timeout)).await,
        )
    } else {
        ("resetting", proxmox.reset_vm(node, vmid).await)
    };
    let task = submitted.map_err(|source| RemediationError::Proxmox {
        doing: format!("{doing} VM {vmid} on {node}"),
        source,
    })?;
    tracing::info!(remediation = %key, vmid, node, "{doing} the unhealthy machine's VM");
    Ok(Done {
        task,
        rebooted,
        moved_to: None,
    })
}

/// Whom the remediation's reads of the inventory are for, so one after its own move of a VM
/// waits for a fresh listing.
fn inventory_key(namespace: &str, name: &str) -> String {
    format!("remediation/{namespace}/{name}")
}

/// The Machine's VM and the client that reaches it.
struct Found {
    target: Target,
    proxmox: Option<ProxmoxClient>,
}

impl Found {
    fn without_vm(target: Target) -> Self {
        Self {
            target,
            proxmox: None,
        }
    }
}

/// Finds the VM of the Machine `name` (the remediation's own name, as the MachineHealthCheck
/// gives it) through its ProxmoxMachine, with its cluster's credentials only.
async fn find_target(
    context: &Context,
    namespace: &str,
    name: &str,
) -> Result<Found, RemediationError> {
    let client = &context.client;
    let machine = Api::<capi::Machine>::namespaced(client.clone(), namespace)
        .get_opt(name)
        .await?;
    let Some(machine) = machine else {
        return Ok(Found::without_vm(Target::NoMachine));
    };
    if machine.metadata.deletion_timestamp.is_some() {
        return Ok(Found::without_vm(Target::Leaving));
    }
    let Some(infrastructure) = machine
        .spec
        .infrastructure_ref
        .as_ref()
        .filter(|r| r.kind == ProxmoxMachine::kind(&()))
    else {
        return Ok(Found::without_vm(Target::Gone(
            "the Machine names no ProxmoxMachine".to_owned(),
        )));
    };
    let Some(proxmox_machine) = Api::<ProxmoxMachine>::namespaced(client.clone(), namespace)
        .get_opt(&infrastructure.name)
        .await?
    else {
        return Ok(Found::without_vm(Target::Gone(format!(
            "ProxmoxMachine {} does not exist",
            infrastructure.name
        ))));
    };
    let capi_cluster = Api::<capi::Cluster>::namespaced(client.clone(), namespace)
        .get_opt(&machine.spec.cluster_name)
        .await?;
    if paused(capi_cluster.as_ref(), &machine, &proxmox_machine) {
        return Ok(Found::without_vm(Target::Paused));
    }
    let cluster_name = capi_cluster
        .as_ref()
        .and_then(|c| c.spec.infrastructure_ref.as_ref())
        .map(|r| r.name.clone());
    let cluster = match cluster_name {
        Some(cluster_name) => {
            Api::<ProxmoxCluster>::namespaced(client.clone(), namespace)
                .get_opt(&cluster_name)
                .await?
        }
        None => None,
    };
    let Some(cluster) = cluster else {
        return Ok(Found::without_vm(Target::Unreachable(format!(
            "the ProxmoxCluster of Cluster {} is not found",
            machine.spec.cluster_name
        ))));
    };
    let proxmox = match reach(context, &cluster, namespace, &proxmox_machine).await? {
        Ok(proxmox) => proxmox,
        Err(why) => return Ok(Found::without_vm(Target::Unreachable(why))),
    };
    let key = inventory_key(namespace, name);
    let target = locate(context, &proxmox, &cluster, &proxmox_machine, &key).await?;
    Ok(Found {
        target,
        proxmox: Some(proxmox),
    })
}

/// Whether the Cluster, the Machine or the ProxmoxMachine pauses reconciliation.
fn paused(
    cluster: Option<&capi::Cluster>,
    machine: &capi::Machine,
    proxmox_machine: &ProxmoxMachine,
) -> bool {
    let annotated = |meta: &kube::core::ObjectMeta| {
        meta.annotations
            .as_ref()
            .is_some_and(|a| a.contains_key(crate::api::annotations::PAUSED))
    };
    cluster.is_some_and(|c| c.spec.paused == Some(true) || annotated(&c.metadata))
        || annotated(&machine.metadata)
        || annotated(&proxmox_machine.metadata)
}

/// A client for the Proxmox the machine's VM was created on, with the credentials of its zone,
/// its cluster, or another zone of its cluster; or why there is none.
async fn reach(
    context: &Context,
    cluster: &ProxmoxCluster,
    namespace: &str,
    machine: &ProxmoxMachine,
) -> Result<Result<ProxmoxClient, String>, RemediationError> {
    let status = machine.status.as_ref();
    let recorded = status.and_then(|s| s.proxmox_endpoint.as_deref());
    let zone = status
        .and_then(|s| s.failure_domain.as_deref())
        .and_then(|zone| placement::credentials_of_zone(cluster, zone));
    let mut references = vec![zone, None];
    references.extend(placement::zone_credentials(cluster).into_iter().map(Some));
    let mut last_error = String::from("no credentials");
    for reference in references {
        match client_config(context, cluster, namespace, reference, false).await? {
            Ok(config) => match context.proxmox.get(&config) {
                Ok(proxmox) if recorded.is_none_or(|r| r == proxmox.endpoint()) => {
                    return Ok(Ok(proxmox));
                }
                Ok(proxmox) => last_error = format!("they reach {}", proxmox.endpoint()),
                Err(error) => last_error = error.to_string(),
            },
            Err(error) => last_error = error.to_string(),
        }
    }
    Ok(Err(format!(
        "no credentials of ProxmoxCluster {} reach the Proxmox {} was created on ({})",
        cluster.name_any(),
        recorded.unwrap_or("the machine's VM"),
        last_error
    )))
}

/// Where the machine's VM is now (HA may have moved it): the VM carrying the machine's tag.
async fn locate(
    context: &Context,
    proxmox: &ProxmoxClient,
    cluster: &ProxmoxCluster,
    machine: &ProxmoxMachine,
    key: &str,
) -> Result<Target, RemediationError> {
    let resources = context
        .inventory
        .resources(proxmox, Some(key))
        .await
        .map_err(|source| RemediationError::Proxmox {
            doing: "listing Proxmox's VMs".to_owned(),
            source,
        })?;
    let status = machine.status.as_ref();
    let zone = status.and_then(|s| s.failure_domain.as_deref());
    // Proxmox migrates no VM with a passed-through PCI device: such a machine is not moved.
    let movable = machine.spec.pci_devices.is_empty();
    let zone_nodes: Vec<String> = placement::zone_nodes(cluster)
        .into_iter()
        .filter(|(z, _)| movable && Some(z.as_str()) == zone)
        .map(|(_, node)| node)
        .collect();
    let recorded = status
        .and_then(|s| s.virtual_machine_id)
        .and_then(|id| u32::try_from(id).ok());
    Ok(find_vm(
        &resources,
        &super::machine::machine_tag(machine),
        recorded,
        &zone_nodes,
    )
    .unwrap_or_else(|| {
        Target::Gone(format!(
            "Proxmox lists no VM of ProxmoxMachine {}",
            machine.name_any()
        ))
    }))
}

/// The VM carrying the machine's `tag` (the `recorded` VMID first), with the node of
/// `zone_nodes` Proxmox HA could move it to when HA manages it: online, not its own, the most
/// free memory first. Pure.
fn find_vm(
    resources: &[ClusterResource],
    tag: &str,
    recorded: Option<u32>,
    zone_nodes: &[String],
) -> Option<Target> {
    let mut tagged = resources.iter().filter(|r| {
        r.kind == ResourceType::Qemu
            && !r.template
            && r.tags.iter().any(|t| t.eq_ignore_ascii_case(tag))
    });
    let vm = tagged
        .clone()
        .find(|r| r.vmid.is_some() && r.vmid == recorded)
        .or_else(|| tagged.next())?;
    let (vmid, node) = (vm.vmid?, vm.node.clone()?);
    let managed = vm
        .hastate
        .as_deref()
        .is_some_and(|state| !state.is_empty() && state != "ignored");
    let move_to = resources
        .iter()
        .filter(|r| r.kind == ResourceType::Node && r.status.as_deref() == Some("online"))
        .filter_map(|r| Some((r.node.as_deref()?, r)))
        .filter(|(name, _)| *name != node && zone_nodes.iter().any(|z| z == name))
        .max_by_key(|(name, r)| {
            let free = r.maxmem.unwrap_or(0).saturating_sub(r.mem.unwrap_or(0));
            (free, std::cmp::Reverse(*name))
        })
        .map(|(name, _)| name.to_owned())
        .filter(|_| managed);
    Some(Target::Vm {
        vmid,
        node,
        move_to,
    })
}

/// How the task recorded in `status.taskRef` stands.
async fn look_at_task(
    proxmox: Option<&ProxmoxClient>,
    status: &ProxmoxRemediationStatus,
) -> Result<TaskSeen, RemediationError> {
    let Some(recorded) = status.task_ref.as_deref() else {
        return Ok(TaskSeen::Succeeded);
    };
    let upid: Upid = match recorded.parse() {
        Ok(upid) => upid,
        Err(error) => {
            return Ok(TaskSeen::Failed(format!(
                "unreadable task {recorded}: {error}"
            )));
        }
    };
    let Some(proxmox) = proxmox else {
        return Ok(TaskSeen::Running);
    };
    match proxmox.task_status(&upid).await {
        Ok(task) if !task.is_finished() => Ok(TaskSeen::Running),
        Ok(task) if task.is_success() => Ok(TaskSeen::Succeeded),
        Ok(task) => Ok(TaskSeen::Failed(
            task.exitstatus
                .unwrap_or_else(|| "no exit status".to_owned()),
        )),
        Err(error) if error.is_not_found() => Ok(TaskSeen::Failed(format!(
            "Proxmox no longer knows task {recorded}"
        ))),
        Err(source) => Err(RemediationError::Proxmox {
            doing: format!("looking at task {recorded}"),
            source,
        }),
    }
}

/// Sets the Machine's `OwnerRemediated` condition to False, as the MachineHealthCheck does
/// without a remediation template: its MachineSet or KubeadmControlPlane then replaces it.
async fn hand_machine_back(
    context: &Context,
    namespace: &str,
    name: &str,
    message: &str,
) -> Result<(), RemediationError> {
    let api: Api<capi::Machine> = Api::namespaced(context.client.clone(), namespace);
    let body = json!({
        "apiVersion": capi::Machine::api_version(&()),
        "kind": capi::Machine::kind(&()),
        "metadata": {"name": name},
        "status": {"conditions": [{
            "type": OWNER_REMEDIATED,
            "status": "False",
            "reason": OWNER_WAITING,
            "message": conditions::truncate_message(message, conditions::CONDITION_MESSAGE_MAX),
            "lastTransitionTime": Timestamp::now(),
        }]}
    });
    api.patch_status(
        name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(body),
    )
    .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits {
        retry_limit: 2,
        timeout: Duration::from_secs(300),
        shutdown_timeout_seconds: 120,
        move_before_replace: true,
    };

    fn at(seconds: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + seconds).expect("a valid instant")
    }

    fn observed(phase: Option<RemediationPhase>, reboots: i32) -> Observed {
        Observed {
            limits: LIMITS,
            status: ProxmoxRemediationStatus {
                phase,
                retry_count: Some(reboots),
                task_ref: phase
                    .filter(|p| {
                        matches!(p, RemediationPhase::Rebooting | RemediationPhase::Resetting)
                    })
                    .map(|_| {
                        "UPID:pve1:00001234:00005678:6553F000:qmreboot:101:root@pam!capmox:"
                            .to_owned()
                    }),
                last_remediated: Some(Time(at(0))),
                ..Default::default()
            },
            now: at(10),
            target: None,
            task: None,
        }
    }

    fn vm() -> Option<Target> {
        Some(Target::Vm {
            vmid: 101,
            node: "pve1".to_owned(),
            move_to: None,
        })
    }

    fn ha_vm(node: &str) -> Option<Target> {
        Some(Target::Vm {
            vmid: 101,
            node: node.to_owned(),
            move_to: Some("pve2".to_owned()).filter(|to| to != node),
        })
    }

    /// The step, the phase reported and the requeue in seconds (`None`: until a change).
    fn step(o: &Observed) -> String {
        match decide(o) {
            Next::Look(look) => format!("look {look:?}"),
            Next::Do(effect, report) => {
                let effect = match effect {
                    Effect::HandOff(_) => "HandOff".to_owned(),
                    other => format!("{other:?}"),
                };
                format!("do {effect} -> {:?}", report.phase)
            }
            Next::End(report, action) => {
                let requeue = format!("{action:?}");
                format!("end {:?} {} {requeue}", report.phase, report.reason)
            }
        }
    }

    #[test]
    fn a_new_request_reboots_the_vm_it_finds() {
        let mut o = observed(None, 0);
        assert_eq!(step(&o), "look Target");
        o.target = vm();
        assert_eq!(step(&o), "do Reboot -> Some(Rebooting)");
    }

    #[test]
    fn a_reboot_in_flight_is_looked_at_and_a_late_one_is_followed_by_a_reset() {
        let mut o = observed(Some(RemediationPhase::Rebooting), 1);
        o.target = vm();
        assert_eq!(step(&o), "look Task");
        o.task = Some(TaskSeen::Running);
        assert!(
            step(&o).starts_with("end Some(Rebooting) Rebooting"),
            "{}",
            step(&o)
        );
        o.task = Some(TaskSeen::Failed(
            "VM quit/powerdown failed - got timeout".to_owned(),
        ));
        assert_eq!(step(&o), "do Reset -> Some(Resetting)");
        o.task = Some(TaskSeen::Succeeded);
        let Next::End(report, _) = decide(&o) else {
            panic!("the reboot ended: {}", step(&o));
        };
        assert_eq!(report.phase, Some(RemediationPhase::WaitingForNode));
        assert_eq!(report.restarted, Some(o.now), "the restart is timed");
    }

    #[test]
    fn a_failed_reset_hands_the_machine_back() {
        let mut o = observed(Some(RemediationPhase::Resetting), 1);
        o.target = vm();
        o.task = Some(TaskSeen::Failed("VM 101 not running".to_owned()));
        let Next::Do(Effect::HandOff(message), report) = decide(&o) else {
            panic!("{}", step(&o));
        };
        assert_eq!(report.phase, Some(RemediationPhase::Replacing));
        assert!(message.contains("VM 101 not running"), "{message}");
        assert!(message.contains("handed back to its owner"), "{message}");
    }

    #[test]
    fn the_node_gets_its_timeout_then_another_reboot_then_the_owner_replaces_it() {
        // Within the timeout: nothing is read, the pass looks again when the time is up.
        let mut o = observed(Some(RemediationPhase::WaitingForNode), 1);
        assert_eq!(
            step(&o),
            format!(
                "end Some(WaitingForNode) WaitingForNode {:?}",
                Action::requeue(Duration::from_secs(290))
            )
        );
        // Time is up with a reboot left: reboot again.
        o.now = at(300);
        assert_eq!(step(&o), "look Target");
        o.target = vm();
        assert_eq!(step(&o), "do Reboot -> Some(Rebooting)");
        // Time is up after the last reboot: the owner replaces the Machine.
        let mut last = observed(Some(RemediationPhase::WaitingForNode), 2);
        last.now = at(301);
        last.target = vm();
        let Next::Do(Effect::HandOff(message), _) = decide(&last) else {
            panic!("{}", step(&last));
        };
        assert!(
            message.starts_with(
                "the Node did not become healthy within 300s of 2 reboot(s) of VM 101 on pve1"
            ),
            "{message}"
        );
    }

    #[test]
    fn an_ha_vm_is_moved_after_its_last_reboot_and_its_node_gets_its_time_there() {
        let mut o = observed(Some(RemediationPhase::WaitingForNode), 2);
        o.now = at(301);
        o.target = ha_vm("pve1");
        assert_eq!(step(&o), "do Move(\"pve2\") -> Some(Moving)");
        // Not where HA was asked to put it yet: looked at again soon.
        o.status.phase = Some(RemediationPhase::Moving);
        o.status.moved_to = Some("pve2".to_owned());
        o.status.move_requested = Some(Time(at(301)));
        o.now = at(310);
        assert_eq!(
            step(&o),
            format!(
                "end Some(Moving) Moving {:?}",
                Action::requeue(MOVE_RECHECK)
            )
        );
        // There: the Node's time starts.
        o.target = ha_vm("pve2");
        let Next::End(report, _) = decide(&o) else {
            panic!("{}", step(&o));
        };
        assert_eq!(report.phase, Some(RemediationPhase::WaitingForNode));
        assert_eq!(report.restarted, Some(o.now));
        // Its time up, no second move: the owner replaces the Machine.
        o.status.phase = Some(RemediationPhase::WaitingForNode);
        o.status.last_remediated = Some(Time(at(310)));
        o.now = at(700);
        let Next::Do(Effect::HandOff(message), _) = decide(&o) else {
            panic!("{}", step(&o));
        };
        assert!(
            message.contains("of 2 reboot(s) and a move to pve2 of VM 101 on pve2"),
            "{message}"
        );
    }

    #[test]
    fn a_move_that_does_not_finish_or_is_turned_off_hands_the_machine_back() {
        let mut o = observed(Some(RemediationPhase::Moving), 2);
        o.status.moved_to = Some("pve2".to_owned());
        o.status.move_requested = Some(Time(at(0)));
        o.now = at(300);
        o.target = ha_vm("pve1");
        let Next::Do(Effect::HandOff(message), _) = decide(&o) else {
            panic!("{}", step(&o));
        };
        assert!(
            message.starts_with("Proxmox HA did not move VM 101 on pve1 to pve2 within 300s"),
            "{message}"
        );
        let mut off = observed(Some(RemediationPhase::WaitingForNode), 2);
        off.limits.move_before_replace = false;
        off.now = at(301);
        off.target = ha_vm("pve1");
        assert_eq!(step(&off), "do HandOff -> Some(Replacing)");
    }

    fn resource(value: serde_json::Value) -> ClusterResource {
        serde_json::from_value(value).expect("a resource")
    }

    #[test]
    fn the_vm_is_found_by_its_tag_and_moved_only_by_ha_to_an_online_node_of_its_zone() {
        let node = |name: &str, status: &str, free_gib: u64| {
            resource(
                serde_json::json!({"id": format!("node/{name}"), "type": "node",
                "node": name, "status": status, "maxmem": 64u64 << 30,
                "mem": (64 - free_gib) << 30}),
            )
        };
        let vm = |vmid: u32, tags: &str, hastate: Option<&str>| {
            resource(
                serde_json::json!({"id": format!("qemu/{vmid}"), "type": "qemu",
                "vmid": vmid, "node": "pve1", "status": "running", "tags": tags,
                "hastate": hastate}),
            )
        };
        let zone = ["pve1", "pve2", "pve3", "pve4"].map(str::to_owned);
        let nodes = [
            node("pve1", "online", 40),
            node("pve2", "online", 10),
            node("pve3", "online", 30),
            node("pve4", "offline", 60),
            node("pve9", "online", 60),
        ];
        let tag = "capmox-m-abc";
        let found =
            |resources: Vec<ClusterResource>, recorded| find_vm(&resources, tag, recorded, &zone);
        let with = |vms: Vec<ClusterResource>| nodes.iter().cloned().chain(vms).collect::<Vec<_>>();
        // HA-managed: the online zone node with the most free memory (pve4 is offline, pve9
        // is in another zone).
        assert_eq!(
            found(with(vec![vm(101, tag, Some("started"))]), Some(101)),
            Some(Target::Vm {
                vmid: 101,
                node: "pve1".to_owned(),
                move_to: Some("pve3".to_owned())
            })
        );
        // Not HA-managed (or ignored by HA): no move.
        for hastate in [None, Some("ignored")] {
            assert_eq!(
                found(with(vec![vm(101, tag, hastate)]), Some(101)),
                Some(Target::Vm {
                    vmid: 101,
                    node: "pve1".to_owned(),
                    move_to: None
                })
            );
        }
        // Another VMID with the tag (a re-created status) is still the machine's; a VM
        // without the tag never is.
        assert!(matches!(
            found(with(vec![vm(105, tag, None)]), Some(101)),
            Some(Target::Vm { vmid: 105, .. })
        ));
        assert_eq!(found(with(vec![vm(101, "other", None)]), Some(101)), None);
    }

    #[test]
    fn without_a_vm_the_machine_is_handed_back_and_a_handed_back_one_is_left_alone() {
        let mut o = observed(None, 0);
        o.target = Some(Target::Gone("ProxmoxMachine m1 does not exist".to_owned()));
        assert_eq!(step(&o), "do HandOff -> Some(Replacing)");
        let done = observed(Some(RemediationPhase::Replacing), 1);
        assert_eq!(
            step(&done),
            format!(
                "end Some(Replacing) ReplacementRequested {:?}",
                Action::await_change()
            )
        );
    }

    #[test]
    fn nothing_happens_while_proxmox_is_unreachable_paused_or_the_machine_leaves() {
        for (target, reason) in [
            (Target::Unreachable("down".to_owned()), "ProxmoxUnavailable"),
            (Target::Paused, "Paused"),
            (Target::Leaving, "MachineDeleting"),
        ] {
            let mut o = observed(Some(RemediationPhase::WaitingForNode), 1);
            o.now = at(400);
            o.target = Some(target);
            assert!(
                step(&o).starts_with(&format!("end Some(WaitingForNode) {reason}")),
                "{}",
                step(&o)
            );
        }
    }

    #[test]
    fn a_submission_whose_task_was_not_recorded_is_submitted_again() {
        let mut o = observed(Some(RemediationPhase::Resetting), 1);
        o.status.task_ref = None;
        o.target = vm();
        assert_eq!(step(&o), "do Reset -> Some(Resetting)");
    }

    #[test]
    fn the_status_counts_reboots_records_the_task_and_the_vm() {
        let mut o = observed(None, 0);
        o.target = vm();
        let Next::Do(_, report) = decide(&o) else {
            panic!("{}", step(&o));
        };
        let upid: Upid = "UPID:pve1:00001234:00005678:6553F000:qmreboot:101:root@pam!capmox:"
            .parse()
            .expect("a UPID");
        let status = next_status(
            &ProxmoxRemediation::new("m1", Default::default()),
            &o,
            &report,
            Some(Done {
                task: Some(upid.clone()),
                rebooted: true,
                moved_to: None,
            }),
        );
        assert_eq!(status.retry_count, Some(1));
        assert_eq!(status.task_ref.as_deref(), Some(upid.as_str()));
        assert_eq!(status.virtual_machine_id, Some(101));
        assert_eq!(status.proxmox_node.as_deref(), Some("pve1"));
        let remediated = status
            .conditions
            .iter()
            .find(|c| c.type_ == REMEDIATED)
            .expect("the condition");
        assert_eq!(
            (remediated.status.as_str(), remediated.reason.as_str()),
            ("False", "Rebooting")
        );
    }
}
