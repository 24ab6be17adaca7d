//! The ProxmoxMachine reconciler: the InfraMachine half of the CAPI v1beta2 contract.
//!
//! Level-triggered: each reconcile observes the VM (by the machine's tag, the recorded VMID, or
//! `spec.providerID`) and takes the next needed step. The VMID is written to
//! `spec.virtualMachineID`, and with node and zone to status, before the clone request (each
//! write guarded by a resourceVersion, so a stale cache cannot clone twice), so a crash never
//! leaks a second VM, and neither does `clusterctl move` or a restore (they keep the spec but
//! not the status, and give a new UID, hence a new tag): the VM is found by the spec's VMID or
//! provider ID and adopted. A machine with a provider ID is never cloned again. The phase is
//! derived from what exists; no condition reason is used as state.
//!
//! Deletion deletes the VM the machine recorded (or finds by tag or provider ID). Without the
//! ProxmoxCluster it uses capmox's global credentials; without those, a machine that may have
//! a VM keeps its finalizer and says so (`ProxmoxClusterNotFound`).
//!
//! Tasks: no pass waits for a Proxmox task. A pass that starts one (clone, disk resize, seed ISO
//! upload, start, stop, deletion, seed ISO removal) records its UPID and purpose in
//! `status.taskRef` and `status.taskPurpose` and returns with a requeue at the task's expected
//! end, learned per task type and node (see [`task`]); a later pass (or a restarted controller)
//! checks the task once and, when it is done, takes the next step. Config changes use Proxmox's
//! synchronous endpoint, so they need no task. A task that fails sets
//! `VirtualMachineProvisioned=False/TaskFailed` with the task's exit status, a Warning event,
//! and `status.retryAfter` (10 s, doubling per consecutive failure in `status.taskFailures`, at
//! most 5 min); nothing is retried before it. All are cleared once a task succeeds or the
//! machine is provisioned. A failed clone leaves no VM behind (Proxmox destroys the
//! half-created one, and so does the simulator); should one be left anyway, it carries the
//! machine's name and recorded VMID and is adopted like any clone.
//!
//! Reads: the Kubernetes objects a pass works from (CAPI Machines and Clusters,
//! ProxmoxClusters, claims, addresses, pools, the other ProxmoxMachines) come from the
//! controller's watches ([`super::caches`]); only Secrets are read from the API server, and
//! credentials are reused for a short while ([`super::credentials::CREDENTIALS_REUSE`]). What
//! Proxmox lists comes from one snapshot per endpoint shared by all machines
//! ([`super::inventory`]); a pass reads each VM config at most once, and a running VM waiting
//! for its guest none.
//!
//! Any other failed Proxmox request stops the pass with `VirtualMachineProvisioned=False` and a
//! reason per kind of failure (see [`super::failures`]), its message naming the step, Proxmox's
//! answer and what to fix; a Warning event when a streak of failures starts or its reason
//! changes; and a per-machine back-off (1 s doubling to 5 minutes, jittered, at least the
//! server's `Retry-After`) that holds off every pass until it is over, reset by a pass that
//! succeeds. Kubernetes API errors are retried with their own per-machine back-off.
//!
//! Bootstrap data capmox cannot deliver (an unknown format, malformed Ignition) is refused
//! with `BootstrapFormatUnsupported` / `BootstrapDataInvalid` before anything is created in
//! Proxmox.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams, PostParams};
use kube::runtime::controller::{Action, Config as ControllerConfig, Controller};
use kube::runtime::events::EventType;
use kube::runtime::reflector::ObjectRef;
use kube::{Api, Resource, ResourceExt};
use serde_json::json;
use tokio_util::sync::CancellationToken;

mod addresses;
mod bootstrap;
mod configure;
mod delete;
mod provision;
mod readiness;
mod scope;
mod status;
mod steps;
mod task;
mod vm;

pub use addresses::BoundAddress;
use addresses::{Addresses, machine_addresses, pool_metric};
pub use bootstrap::{SeedIsosRemoved, WrittenConfigs, smbios_uuid};
use bootstrap::{detach_seed_iso, seed_iso_attached, seed_iso_deleted, seed_iso_uploaded};
use status::{apply_status, apply_status_guarded, owned_status, paused_conditions};
use vm::{Identity, PassConfigs, is_machine_tag};

pub use task::{
    TASK_BACKOFF_INITIAL, TASK_BACKOFF_MAX, TaskClock, TaskKind, TaskPurpose, task_backoff,
};

use super::caches::{Caches, Reads, slot};
use super::conditions::{self, Decided, Status};
use super::failures::{self, Backoff, Pass};
use super::guarded::{self, WriteError};
use super::{Context, inventory};
use crate::api::{
    self, Initialization, IpAddressesSpec, MachineAddress, MachineAddressType, ProxmoxCluster,
    ProxmoxMachine, ProxmoxMachineStatus, VirtualMachineState, annotations, finalizers, labels,
};
use crate::capi::{self, IPAddress, IPAddressClaim, IpPoolReference};
use crate::placement::{
    self, CloneSources, GuestInfo, GuestKind, NodeCandidates, NodeInfo, NodeInventory,
    PlacedMachine, Placement, ScheduleRequest, StorageInfo, TemplateChoice, TemplateCopy,
    TemplateError, TemplateInfo, TemplateSource,
};
use crate::proxmox::{
    CloneParams, ClusterResource, ConfigUpdate, DeleteParams, PowerAction, ProxmoxClient,
    ProxmoxError, ResourceType, VmConfig,
};

/// Field manager of everything this controller writes.
pub const FIELD_MANAGER: &str = "capmox-proxmoxmachine";
/// Controller name in metrics and logs.
pub const CONTROLLER: &str = "proxmoxmachine";
/// Condition that tracks the VM.
const PROVISIONED: &str = api::conditions::VIRTUAL_MACHINE_PROVISIONED;
/// How soon a machine woken before the caches filled is looked at again.
const CACHE_SYNC_RECHECK: Duration = Duration::from_millis(200);
/// The highest VMID Proxmox accepts.
const MAX_VMID: u32 = 999_999_999;

/// Prefix of the tag that ties a VM to its ProxmoxMachine.
const MACHINE_TAG_PREFIX: &str = "capmox-";
/// What precedes the SMBIOS UUID in a provider ID (see [`crate::cloudinit::provider_id`]).
const PROVIDER_ID_PREFIX: &str = "proxmox://";
/// Requeue of a machine whose bootstrap data capmox cannot deliver: only a change helps (the
/// Machine is watched); the long requeue only catches an edited Secret.
const UNSUPPORTED_BOOTSTRAP_REQUEUE: Duration = Duration::from_secs(600);
/// How often a VM whose config, read again after capmox wrote its SMBIOS UUID, still lacks one
/// is looked at again: something else is wrong, and polling will not fix it.
const VM_CONFIG_BACKOFF: Backoff = Backoff {
    initial: Duration::from_secs(1),
    max: Duration::from_secs(30),
};
/// What a Proxmox failure is reported as having happened in when its step is not known.
const UNNAMED_STEP: &str = "talking to Proxmox";

/// Why a reconcile failed; it is retried with back-off.
#[derive(Debug, thiserror::Error)]
pub enum MachineError {
    /// The reconcile panicked (a bug); the object is retried with back-off.
    #[error(transparent)]
    Panicked(#[from] crate::controller::metrics::Panicked),
    /// A Kubernetes API call failed.
    #[error("Kubernetes API error: {0}")]
    Kube(#[from] kube::Error),
    /// A Proxmox call failed.
    #[error("Proxmox: {0}")]
    Proxmox(#[from] ProxmoxError),
    /// A Proxmox call failed in a known step, named for the condition that reports it.
    #[error("{step}: {source}")]
    ProxmoxStep {
        /// What capmox was doing, e.g. "cloning template 9000 on pve1 to VM 101 on pve3".
        step: String,
        /// What Proxmox answered.
        source: ProxmoxError,
    },
    /// An object could not be encoded.
    #[error("cannot encode object: {0}")]
    Json(#[from] serde_json::Error),
    /// A write guarded by the machine's resourceVersion failed.
    #[error(transparent)]
    Write(#[from] WriteError),
    /// The object lacks a name or namespace (never true for objects read from the API).
    #[error("ProxmoxMachine without name or namespace")]
    MissingIdentity,
    /// The system's random number generator failed, so a clone without an SMBIOS UUID cannot
    /// be given one.
    #[error("the system's random number generator failed; no SMBIOS UUID for the VM")]
    Random,
}

impl MachineError {
    /// The Proxmox failure behind this error, with the step it happened in when known.
    fn proxmox(&self) -> Option<(&ProxmoxError, &str)> {
        match self {
            Self::Proxmox(error) => Some((error, UNNAMED_STEP)),
            Self::ProxmoxStep { step, source } => Some((source, step)),
            _ => None,
        }
    }
}

/// Names the step a Proxmox call belongs to, so the condition reporting its failure says what
/// capmox was doing.
trait During<T> {
    fn during(self, step: impl FnOnce() -> String) -> Result<T, MachineError>;
}

impl<T> During<T> for Result<T, ProxmoxError> {
    fn during(self, step: impl FnOnce() -> String) -> Result<T, MachineError> {
        self.map_err(|source| MachineError::ProxmoxStep {
            step: step(),
            source,
        })
    }
}

impl<T> During<T> for Result<T, MachineError> {
    fn during(self, step: impl FnOnce() -> String) -> Result<T, MachineError> {
        self.map_err(|error| match error {
            MachineError::Proxmox(source) => MachineError::ProxmoxStep {
                step: step(),
                source,
            },
            other => other,
        })
    }
}

/// The tag that marks a VM as this machine's: derived from the ProxmoxMachine's UID, so a VM
/// can be traced to its machine (and adopted after a crash) and never mistaken for another's.
pub fn machine_tag(machine: &ProxmoxMachine) -> String {
    let uid = machine.metadata.uid.as_deref().unwrap_or_default();
    let short: String = uid
        .chars()
        .filter(char::is_ascii_alphanumeric)
        .take(16)
        .collect();
    format!("{MACHINE_TAG_PREFIX}{}", short.to_ascii_lowercase())
}

/// Whom a VMID claim belongs to: the machine's UID (a machine re-created under the same name
/// is another machine), else its namespace and name.
fn claim_key(machine: &ProxmoxMachine) -> String {
    match machine.metadata.uid.as_deref() {
        Some(uid) if !uid.is_empty() => uid.to_owned(),
        _ => format!(
            "{}/{}",
            machine.metadata.namespace.as_deref().unwrap_or_default(),
            machine.name_any()
        ),
    }
}

/// Runs the controller until `shutdown` is cancelled.
pub async fn run(context: Arc<Context>, shutdown: CancellationToken) {
    let client = context.client.clone();
    let namespace = context.config.watch_namespace.clone();
    fn api<K>(client: &kube::Client, namespace: Option<&str>) -> Api<K>
    where
        K: Resource<Scope = k8s_openapi::NamespaceResourceScope>,
        K::DynamicType: Default,
    {
        match namespace {
            Some(ns) => Api::namespaced(client.clone(), ns),
            None => Api::all(client.clone()),
        }
    }
    let namespace = namespace.as_deref();
    let machines: Api<ProxmoxMachine> = api(&client, namespace);
    let controller = Controller::new(machines, context.config.shard_watch());
    let store = controller.store();
    super::report_cache_sync(store.clone(), context.readiness.clone(), CONTROLLER);
    let (caches, writers) = Caches::new(store.clone());
    // This manager's shard: the CAPI objects it maps from carry the label too; the IPAM
    // objects (made by capmox and the IPAM provider) are watched whole.
    let whole = kube::runtime::watcher::Config::default;
    let shard = || context.config.shard_watch();
    let claims = caches.watch(
        slot::CLAIMS,
        api(&client, namespace),
        whole(),
        writers.claims,
    );
    let addresses = caches.watch(
        slot::ADDRESSES,
        api(&client, namespace),
        whole(),
        writers.addresses,
    );
    let capi_machines = caches.watch(
        slot::CAPI_MACHINES,
        api(&client, namespace),
        shard(),
        writers.capi_machines,
    );
    let clusters = caches.watch(
        slot::CLUSTERS,
        api(&client, namespace),
        shard(),
        writers.clusters,
    );
    let capi_clusters = caches.watch(
        slot::CAPI_CLUSTERS,
        api(&client, namespace),
        shard(),
        writers.capi_clusters,
    );
    let pools = caches.watch(slot::POOLS, api(&client, namespace), whole(), writers.pools);
    let claim_store = caches.claims.clone();
    let context = Arc::new(Context {
        caches: Some(caches),
        ..(*context).clone()
    });
    let queue = context.metrics.work_queue(CONTROLLER);
    queue.observe(store.clone());
    let (claim_queue, address_queue, machine_queue, cluster_queue, capi_cluster_queue) = (
        queue.clone(),
        queue.clone(),
        queue.clone(),
        queue.clone(),
        queue,
    );
    let capi_cluster_store = store.clone();
    controller
        // Owned claims wake their ProxmoxMachine (as `owns` would), noted on the work queue.
        .watches_stream(claims, move |claim| {
            claim_queue.wake(super::owners::<ProxmoxMachine>(&claim))
        })
        // A bound address wakes the machine that owns its claim.
        .watches_stream(addresses, move |address| {
            let namespace = address.namespace().unwrap_or_default();
            let claim = claim_store.get(&ObjectRef::new(&address.spec.claim_ref.name).within(&namespace));
            address_queue.wake(claim.map(|claim| super::owners::<ProxmoxMachine>(&*claim)).unwrap_or_default())
        })
        .watches_stream(capi_machines, move |machine| {
            let reference = machine.spec.infrastructure_ref.as_ref();
            machine_queue.wake(reference.filter(|r| r.kind == "ProxmoxMachine").map(|reference| {
                ObjectRef::new(&reference.name).within(machine.namespace().as_deref().unwrap_or_default())
            }))
        })
        // A cluster change (failure domains, pools, readiness) wakes the machines waiting on it.
        .watches_stream(clusters, move |cluster| {
            let name = cluster.labels().get(labels::CLUSTER_NAME).cloned().unwrap_or_else(|| cluster.name_any());
            let namespace = cluster.namespace();
            cluster_queue.wake(
                store
                    .state()
                    .into_iter()
                    .filter(|m| m.namespace() == namespace && m.labels().get(labels::CLUSTER_NAME) == Some(&name))
                    .map(|m| ObjectRef::from_obj(&*m)),
            )
        })
        // A CAPI Cluster change (un-pausing it, its infrastructure becoming provisioned) wakes
        // its machines.
        .watches_stream(capi_clusters, move |cluster| {
            let name = cluster.name_any();
            let namespace = cluster.namespace();
            capi_cluster_queue.wake(
                capi_cluster_store
                    .state()
                    .into_iter()
                    .filter(|m| m.namespace() == namespace && m.labels().get(labels::CLUSTER_NAME) == Some(&name))
                    .map(|m| ObjectRef::from_obj(&*m)),
            )
        })
        // Pools are only read (for their gateway metric): nothing to wake.
        .watches_stream(pools, |_| None::<ObjectRef<ProxmoxMachine>>)
        .with_config(ControllerConfig::default().concurrency(context.config.machine_concurrency))
        .graceful_shutdown_on(shutdown.cancelled_owned())
        .run(reconcile, error_policy, context)
        .for_each(|result| async move {
            if let Err(error) = result {
                tracing::debug!(controller = CONTROLLER, %error, "reconcile finished with an error");
            }
        })
        .await;
}

/// The requeue after a failed pass: a stale copy is looked at again soon and quietly, anything
/// else backs off.
pub fn error_policy(
    machine: Arc<ProxmoxMachine>,
    error: &MachineError,
    context: Arc<Context>,
) -> Action {
    if let MachineError::Write(stale) = error
        && stale.is_stale()
    {
        tracing::debug!(controller = CONTROLLER, error = %stale, "pass saw a stale copy");
        return Action::requeue(guarded::STALE_RETRY);
    }
    // The machine itself is gone (its deletion finished while a late pass ran): nothing to
    // retry, nothing to warn about.
    if machine_gone(&machine, error) {
        tracing::debug!(controller = CONTROLLER, name = %machine.name_any(), "the machine is gone");
        return Action::await_change();
    }
    failures::after_error(&context.retries, CONTROLLER, &*machine, error)
}

/// Whether `error` says the API server no longer has `machine` itself.
fn machine_gone(machine: &ProxmoxMachine, error: &MachineError) -> bool {
    matches!(error, MachineError::Kube(kube::Error::Api(status))
        | MachineError::Write(WriteError::Kube(kube::Error::Api(status)))
    if status.is_not_found()
        && status.details.as_ref().is_some_and(|details| {
            details.kind == "proxmoxmachines"
                && Some(details.name.as_str()) == machine.metadata.name.as_deref()
        }))
}

/// One reconcile, with its duration and outcome recorded in the metrics.
pub async fn reconcile(
    machine: Arc<ProxmoxMachine>,
    context: Arc<Context>,
) -> Result<Action, MachineError> {
    context
        .metrics
        .measure(
            CONTROLLER,
            &*machine,
            Reconcile::new(&machine, &context).and_then_run(),
        )
        .await
}

/// What a step decided: go on, or stop this reconcile with a condition and a requeue.
enum Step {
    Continue,
    Stop(Decided, Action),
    /// Stop, and keep the machine's back-off streak going (a pass that stops with
    /// [`Step::Stop`] ends it).
    Backoff(Decided, Action),
}

impl Step {
    /// The same requeue for a machine that is provisioned: what it waits for now (a task that
    /// tidies up, such as the seed ISO's removal) does not make it less so.
    fn still_provisioned(self) -> Step {
        match self {
            Step::Continue => Step::Continue,
            Step::Stop(_, action) => {
                Step::Stop(Decided::ok(PROVISIONED, "Provisioned", ""), action)
            }
            Step::Backoff(_, action) => {
                Step::Backoff(Decided::ok(PROVISIONED, "Provisioned", ""), action)
            }
        }
    }
}

/// Waiting for something that polling more often does not bring sooner: the machine's back-off
/// streak goes on, and the next look comes after `retry.delay`.
fn waiting_longer(reason: &str, message: impl Into<String>, retry: &failures::Retry) -> Step {
    Step::Backoff(
        Decided::failed(PROVISIONED, reason, message),
        Action::requeue(retry.delay),
    )
}

/// Waiting for the IPAM provider to bind the machine's claims (the claims and addresses are
/// watched; the requeue is a fallback).
fn waiting_for_addresses() -> Step {
    waiting(
        "WaitingForStaticIPAllocation",
        "waiting for the IP address claims to be bound",
        Action::requeue(Duration::from_secs(30)),
    )
}

fn waiting(reason: &str, message: impl Into<String>, action: Action) -> Step {
    Step::Stop(
        Decided {
            type_: PROVISIONED,
            status: Status::False,
            reason: reason.to_owned(),
            message: message.into(),
        },
        action,
    )
}

struct Reconcile<'a> {
    machine: &'a ProxmoxMachine,
    context: &'a Context,
    configs: PassConfigs,
}

/// Everything a provisioning pass works with once the prerequisites are met.
struct Scope {
    namespace: String,
    name: String,
    api: Api<ProxmoxMachine>,
    capi_machine: capi::Machine,
    cluster_name: String,
    proxmox_cluster: ProxmoxCluster,
    current: ProxmoxMachineStatus,
    status: ProxmoxMachineStatus,
    /// The observed resourceVersion, when the checkpoint before a clone must be guarded by it.
    resource_version: Option<String>,
    /// The VMID recorded for the machine (status, else `spec.virtualMachineID`), until it
    /// turns out to be another VM's.
    recorded_vmid: Option<u32>,
    /// The machine's generation as of this pass's last spec write, for conditions and holds.
    generation: Option<i64>,
    /// The task this pass saw succeed, so the step it did is not repeated.
    finished: Option<task::FinishedTask>,
}

impl<'a> Reconcile<'a> {
    fn new(machine: &'a ProxmoxMachine, context: &'a Context) -> Self {
        Self {
            machine,
            context,
            configs: PassConfigs::default(),
        }
    }

    /// One pass, unless the machine's back-off after a failed Proxmox request still runs; a
    /// pass that ends without a failure resets the back-off.
    async fn and_then_run(self) -> Result<Action, MachineError> {
        let key = failures::key(self.machine);
        let deleting = self.machine.metadata.deletion_timestamp.is_some();
        if let Some(remaining) =
            self.context
                .retries
                .held(&key, self.machine.metadata.generation, deleting)
        {
            tracing::debug!(machine = %self.machine.name_any(), ?remaining, "backing off after a failed Proxmox request");
            return Ok(Action::requeue(remaining));
        }
        // A task this process submitted for the machine and expects to run a while longer:
        // nothing to look at before then, whatever woke the machine (its own status write).
        if !deleting && let Some(remaining) = self.task_not_due() {
            tracing::trace!(machine = %self.machine.name_any(), ?remaining, "waiting for a Proxmox task");
            return Ok(Action::requeue(remaining));
        }
        // Until every watch has listed once, a missing object may only not be listed yet.
        if self.context.caches.as_ref().is_some_and(|c| !c.synced()) {
            return Ok(Action::requeue(CACHE_SYNC_RECHECK));
        }
        let pass = self.pass().await?;
        Ok(self.context.retries.settle(&key, pass))
    }

    /// Where this pass reads the objects it works from.
    fn reads(&self) -> Reads<'a> {
        Reads::new(&self.context.client, self.context.caches.as_ref())
    }

    /// Reports a failed Proxmox request in `step`: one more failure in the machine's streak,
    /// a hold for its back-off (at least the server's `Retry-After`), and a Warning event when
    /// the streak starts or its reason changes. Returns what to report and the requeue.
    async fn proxmox_failure(
        &self,
        scope: &Scope,
        step: &str,
        error: &ProxmoxError,
    ) -> (failures::Described, Action) {
        let described = failures::describe(step, error);
        if matches!(error, ProxmoxError::Unauthorized { .. }) {
            self.context
                .credentials
                .forget(&scope.proxmox_cluster, &scope.namespace);
        }
        let key = failures::key(self.machine);
        let retry =
            self.context
                .retries
                .failed(&key, &failures::PROXMOX_BACKOFF, Some(described.reason));
        let delay = retry.delay.max(described.retry_after.unwrap_or_default());
        self.context.retries.hold(
            &key,
            delay,
            scope.generation,
            self.machine.metadata.deletion_timestamp.is_some(),
        );
        if retry.news {
            self.event(
                scope,
                EventType::Warning,
                described.reason,
                &described.message,
            )
            .await;
        } else {
            tracing::warn!(machine = %scope.name, reason = described.reason, failures = retry.failures, retry_in_ms = failures::millis(delay), %error, step, "Proxmox request failed again; backing off");
        }
        (described, Action::requeue(delay))
    }

    /// The Proxmox the machine works with: the one its VM was recorded on while some
    /// credentials of its cluster still reach it, else its zone's (`zone_credentials`: the
    /// zone's own `credentialsRef`, `None` for the cluster's credentials). `Err`: why there is
    /// none.
    async fn proxmox_client(
        &self,
        scope: &Scope,
        zone_credentials: Option<&api::SecretReference>,
    ) -> Result<Result<MachineProxmox, String>, MachineError> {
        let zone = self.client_for(scope, zone_credentials).await?;
        let Some(recorded) = self.recorded_endpoint(scope) else {
            return Ok(zone.map(MachineProxmox::as_resolved));
        };
        if let Ok(proxmox) = &zone
            && proxmox.endpoint() == recorded
        {
            return Ok(Ok(MachineProxmox::as_resolved(proxmox.clone())));
        }
        // The zone's credentials changed since: another of the cluster's may still reach the
        // Proxmox the VM lives on.
        let mut others: Vec<Option<&api::SecretReference>> = vec![None];
        others.extend(
            placement::zone_credentials(&scope.proxmox_cluster)
                .into_iter()
                .map(Some),
        );
        for reference in others.into_iter().filter(|r| *r != zone_credentials) {
            if let Ok(proxmox) = self.client_for(scope, reference).await?
                && proxmox.endpoint() == recorded
            {
                return Ok(Ok(MachineProxmox::as_resolved(proxmox)));
            }
        }
        Ok(zone.map(|proxmox| MachineProxmox {
            proxmox,
            moved_from: Some(recorded.to_owned()),
        }))
    }

    /// Whether the machine may have a VM: nothing recorded means no clone was ever requested
    /// (the VMID is recorded first).
    fn may_have_vm(&self, scope: &Scope) -> bool {
        scope.recorded_vmid.is_some() || self.machine.spec.provider_id.is_some()
    }

    /// The Proxmox endpoint the machine's VM was created on, while it may have one.
    fn recorded_endpoint<'s>(&self, scope: &'s Scope) -> Option<&'s str> {
        scope
            .current
            .proxmox_endpoint
            .as_deref()
            .filter(|_| self.may_have_vm(scope))
    }

    /// `None` when `proxmox` may be trusted with the machine: it is the Proxmox its VM was
    /// recorded on, or it has the VM (the same Proxmox cluster under another URL). Otherwise
    /// what the machine reports (with a Warning event once) while it waits.
    async fn untrusted(
        &self,
        scope: &Scope,
        endpoint: &MachineProxmox,
    ) -> Result<Option<String>, MachineError> {
        let (Some(recorded), proxmox) = (&endpoint.moved_from, &endpoint.proxmox) else {
            return Ok(None);
        };
        let resources = self
            .context
            .inventory
            .resources(proxmox, Some(&claim_key(self.machine)))
            .await
            .during(|| "listing Proxmox's VMs and nodes".to_owned())?;
        if self.vm_is_on(scope, proxmox, &resources).await? {
            tracing::info!(machine = %scope.name, from = %recorded, to = %proxmox.endpoint(), "the machine's VM is reached through another URL of its Proxmox now");
            return Ok(None);
        }
        let message = format!(
            "{} was created on the Proxmox at {recorded}, but no credentials of ProxmoxCluster {} reach it now (its zone's reach {}, which does not have the VM); give the zone credentials for {recorded} again. capmox neither creates a second VM nor releases this machine meanwhile",
            self.recorded_vm(scope),
            scope.proxmox_cluster.name_any(),
            proxmox.endpoint()
        );
        tracing::warn!(machine = %scope.name, reason = ENDPOINT_CHANGED, "{message}");
        self.warn_once(scope, ENDPOINT_CHANGED, &message).await;
        Ok(Some(message))
    }

    /// The client for the cluster's credentials `reference` names (`None`: its own).
    async fn client_for(
        &self,
        scope: &Scope,
        reference: Option<&api::SecretReference>,
    ) -> Result<Result<ProxmoxClient, String>, MachineError> {
        let config = super::credentials::client_config(
            self.context,
            &scope.proxmox_cluster,
            &scope.namespace,
            reference,
            false,
        )
        .await?;
        Ok(match config {
            Ok(config) => self.context.proxmox.get(&config).map_err(|e| e.to_string()),
            Err(error) => Err(error.to_string()),
        })
    }

    /// Whether the machine's VM is on `proxmox`: its tag is listed there, or the VM with its
    /// recorded VMID (or spec's SMBIOS UUID) is shown to be its own by its config. Decides
    /// whether a Proxmox other than the recorded one may be trusted with the machine.
    async fn vm_is_on(
        &self,
        scope: &Scope,
        proxmox: &ProxmoxClient,
        resources: &[ClusterResource],
    ) -> Result<bool, MachineError> {
        let identity = Identity::of(self.machine, &scope.name);
        if let Some(vmid) = scope.recorded_vmid
            && let Some(vm) = vm::vms(resources).find(|r| r.vmid == Some(vmid))
            && identity
                .owned_listed(proxmox, &self.configs, vm)
                .await?
                .is_some()
        {
            return Ok(true);
        }
        Ok(identity
            .search(proxmox, &self.configs, resources, scope.recorded_vmid)
            .await?
            .is_some())
    }
}

/// The Proxmox a pass works with.
struct MachineProxmox {
    proxmox: ProxmoxClient,
    /// Set when the VM was recorded on another Proxmox (this URL) that none of the cluster's
    /// credentials reach any more: the pass may go on only once it finds the VM here.
    moved_from: Option<String>,
}

impl MachineProxmox {
    fn as_resolved(proxmox: ProxmoxClient) -> Self {
        Self {
            proxmox,
            moved_from: None,
        }
    }
}

/// Reason of `VirtualMachineProvisioned` (and of the deletion's wait) while the machine's VM
/// is on a Proxmox its cluster's credentials no longer reach.
const ENDPOINT_CHANGED: &str = "ProxmoxEndpointChanged";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_not_found_answer_about_the_machine_itself_means_it_is_gone() {
        let machine = ProxmoxMachine::new("m1", Default::default());
        let not_found = |kind: &str, name: &str| {
            MachineError::Kube(kube::Error::Api(Box::new(kube::core::Status {
                code: 404,
                reason: "NotFound".into(),
                details: Some(kube::core::response::StatusDetails {
                    name: name.into(),
                    group: String::new(),
                    kind: kind.into(),
                    uid: String::new(),
                    causes: Vec::new(),
                    retry_after_seconds: 0,
                }),
                ..Default::default()
            })))
        };
        assert!(machine_gone(&machine, &not_found("proxmoxmachines", "m1")));
        let MachineError::Kube(gone) = not_found("proxmoxmachines", "m1") else {
            unreachable!("built as a Kubernetes error");
        };
        assert!(
            machine_gone(&machine, &MachineError::Write(WriteError::Kube(gone))),
            "a guarded write (the finalizer's release) that finds the machine gone"
        );
        assert!(!machine_gone(&machine, &not_found("proxmoxmachines", "m2")));
        assert!(!machine_gone(&machine, &not_found("secrets", "m1")));
        assert!(!machine_gone(&machine, &MachineError::MissingIdentity));
    }

    #[test]
    fn the_machine_tag_is_stable_and_proxmox_safe() {
        let mut machine = ProxmoxMachine::new("m", Default::default());
        machine.metadata.uid = Some("3F2C9C8E-1b2a-4d6e-9f00-0123456789ab".into());
        assert_eq!(machine_tag(&machine), "capmox-3f2c9c8e1b2a4d6e");
        assert!(crate::api::TAG_PATTERN.len() > 1);
        let pattern = regex::Regex::new(crate::api::TAG_PATTERN).expect("tag pattern compiles");
        assert!(pattern.is_match(&machine_tag(&machine)));
        assert!(is_machine_tag(&machine_tag(&machine)));
        assert!(is_machine_tag("CAPMOX-3F2C9C8E1B2A4D6E"));
        assert!(!is_machine_tag("capmox-prod"), "a user's tag");
        assert!(!is_machine_tag("capmox"));
    }
}
