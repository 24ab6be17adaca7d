//! The ProxmoxMachine reconciler: the InfraMachine half of the CAPI v1beta2 contract.
//!
//! How a pass is built: `pass` reads what the caches hold into an `decide::Observed`, then
//! asks `decide::decide` (pure, table-tested) for the next step until the pass ends: a look
//! (`looks`: the bootstrap data, the Proxmox to use and whether to trust it, the task in
//! flight, the addresses, the VM), an effect (`act`: record, create, a phase, delete,
//! release), or the end with what the machine reports, which the status writer (`status`,
//! where every write of the ProxmoxMachine lives) applies once. A step either goes on or
//! stops (`outcome::Flow`): waiting with a report, or failing. What outlives a pass lives in
//! services on the [`super::Context`] ([`Vms`], the inventory, the task timing, back-offs),
//! each saying what a restart without it means.
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
//! controller's watches ([`super::caches`]); bootstrap data Secrets from a watch of their own
//! ([`super::bootstrap_secrets`]), or read when it does not hold them; credentials Secrets are
//! read and reused for a short while ([`super::credentials::CREDENTIALS_REUSE`]). What
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

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use kube::runtime::controller::{Action, Config as ControllerConfig, Controller};
use kube::runtime::events::EventType;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::{PredicateConfig, WatchStreamExt};
use kube::{Api, Resource, ResourceExt};
use tokio_util::sync::CancellationToken;

mod act;
mod addresses;
mod bootstrap;
mod configure;
mod decide;
mod delete;
mod devices;
mod dhcp;
mod due;
mod endpoint;
mod guest;
mod ha;
mod looks;
mod outcome;
mod pass;
mod passes;
mod slots;
mod status;
mod task;
mod timing;
mod tracking;
mod vm;
mod vms;
mod wakes;

pub use addresses::BoundAddress;
use addresses::machine_addresses;
pub use bootstrap::{SeedIsosRemoved, WrittenConfigs, smbios_uuid};
pub use due::DueWakes;
pub use passes::Passes;
use vm::PassConfigs;
pub use vms::Vms;

pub use task::{TASK_BACKOFF_INITIAL, TASK_BACKOFF_MAX, TaskKind, TaskPurpose, task_backoff};
pub use timing::{TaskTimer, TaskTiming, TaskTimingPolicy};

use super::Context;
use super::caches::{Caches, Reads, slot};
use super::failures::{self, Backoff};
use super::guarded::{self, WriteError};
use crate::api::{self, ProxmoxCluster, ProxmoxMachine, ProxmoxMachineStatus, labels};
use crate::capi::{self};
use crate::proxmox::ProxmoxError;

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
    /// A step ran before the look that provides what it needs (a bug in the pass's order).
    #[error("capmox bug: a step ran without {0}; please report it")]
    OutOfOrder(String),
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

/// Whether `key` is the machine's [`claim_key`], without building the key (it is compared
/// against every machine of the store).
fn has_claim_key(machine: &ProxmoxMachine, key: &str) -> bool {
    match machine.metadata.uid.as_deref() {
        Some(uid) if !uid.is_empty() => uid == key,
        _ => claim_key(machine) == key,
    }
}

/// The API of kind `K` in the namespace the manager watches (all namespaces: `None`).
fn scoped_api<K>(client: &kube::Client, namespace: Option<&str>) -> Api<K>
where
    K: Resource<Scope = k8s_openapi::NamespaceResourceScope>,
    K::DynamicType: Default,
{
    match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    }
}

/// Where bootstrap Secrets are watched: the namespace the manager watches, narrowed to those
/// it may read Secrets in (`--secret-namespaces`).
fn bootstrap_secret_apis(context: &Context) -> Vec<Api<k8s_openapi::api::core::v1::Secret>> {
    let readable = context.global_credentials.secret_namespaces.as_deref();
    match (context.config.watch_namespace.as_deref(), readable) {
        (None, None) => vec![Api::all(context.client.clone())],
        (Some(namespace), _) if context.global_credentials.reads_secrets_in(namespace) => {
            vec![Api::namespaced(context.client.clone(), namespace)]
        }
        (Some(_), _) => Vec::new(),
        (None, Some(namespaces)) if namespaces.iter().any(|n| n == "*") => {
            vec![Api::all(context.client.clone())]
        }
        (None, Some(namespaces)) => namespaces
            .iter()
            .map(|namespace| Api::namespaced(context.client.clone(), namespace))
            .collect(),
    }
}

/// The machines of cluster `name` in `namespace`, as the store holds them.
fn machines_of(
    store: &Store<ProxmoxMachine>,
    namespace: Option<String>,
    name: &str,
) -> Vec<ObjectRef<ProxmoxMachine>> {
    store
        .state()
        .into_iter()
        .filter(|m| {
            m.metadata.namespace == namespace
                && m.labels().get(labels::CLUSTER_NAME).map(String::as_str) == Some(name)
        })
        .map(|m| ObjectRef::from_obj(&*m))
        .collect()
}

/// The ProxmoxMachine a CAPI Machine's infrastructure reference names.
fn infrastructure_of(machine: &capi::Machine) -> Option<ObjectRef<ProxmoxMachine>> {
    let reference = machine.spec.infrastructure_ref.as_ref()?;
    (reference.kind == "ProxmoxMachine").then(|| {
        ObjectRef::new(&reference.name).within(machine.namespace().as_deref().unwrap_or_default())
    })
}

/// Where wakes (related objects' changes, tasks' ends, guests' boots) reach machines, noted on
/// the work queue: not a machine waiting for a Proxmox task this process submitted, whose
/// requeue at the task's expected end reads whatever changed meanwhile from the caches (its pass
/// before then would only find the task running), nor one whose pass runs, as that pass's end
/// decides ([`Passes`]), nor one the machines' cache does not hold (gone, or not listed yet: its
/// arrival wakes it), nor one this process let go (its IP claims' deletion follows).
#[derive(Clone)]
struct Wakes {
    queue: crate::controller::queue_depth::WorkQueue,
    timer: TaskTimer,
    passes: Passes,
    machines: Store<ProxmoxMachine>,
    released: delete::ReleasedMachines,
}

impl Wakes {
    fn new(context: &Context, machines: Store<ProxmoxMachine>) -> Self {
        let queue = context.metrics.work_queue(CONTROLLER);
        queue.observe(machines.clone());
        Wakes {
            queue,
            timer: context.task_timing.clone(),
            passes: context.passes.clone(),
            machines,
            released: context.vms.released.clone(),
        }
    }

    fn wake(
        &self,
        refs: impl IntoIterator<Item = ObjectRef<ProxmoxMachine>>,
    ) -> Vec<ObjectRef<ProxmoxMachine>> {
        let due = refs.into_iter().filter(|machine| {
            self.machines.get(machine).is_some_and(|machine| {
                worth_a_pass(&self.timer, &machine) && !self.released.contains(&machine)
            }) && !self.passes.changed_during(machine)
        });
        self.queue.wake(due)
    }
}

/// Whether a change to `machine` (or what it depends on) is worth a pass now: it is being
/// deleted, or it waits for no Proxmox task this process submitted.
fn worth_a_pass(timer: &TaskTimer, machine: &ProxmoxMachine) -> bool {
    machine.metadata.deletion_timestamp.is_some()
        || tracking::task_not_due(timer, machine).is_none()
}

/// A watch of kind `K` feeding the caches: of this manager's shard (`sharded`), or whole.
fn watch<K>(
    caches: &Caches,
    slot: usize,
    context: &Context,
    sharded: bool,
    writer: kube::runtime::reflector::store::Writer<K>,
) -> impl futures::Stream<Item = Result<K, kube::runtime::watcher::Error>> + Send + 'static
where
    K: Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>,
    K: Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + Sync + 'static,
{
    let config = if sharded {
        context.config.shard_watch()
    } else {
        kube::runtime::watcher::Config::default()
    };
    let api = scoped_api(&context.client, context.config.watch_namespace.as_deref());
    caches.watch(slot, api, config, writer)
}

/// `controller` woken by the objects a machine depends on, each watched into the caches its
/// reconciles read.
fn woken_by_related(
    controller: Controller<ProxmoxMachine>,
    caches: &Caches,
    writers: super::caches::Writers,
    context: &Context,
    store: Store<ProxmoxMachine>,
) -> Controller<ProxmoxMachine> {
    let queue = Wakes::new(context, store.clone());
    let controller = woken_by_ipam(
        controller,
        caches,
        (writers.claims, writers.addresses),
        context,
        &queue,
    );
    // This manager's shard: the CAPI objects it maps from carry the label too.
    let capi_machines = watch(
        caches,
        slot::CAPI_MACHINES,
        context,
        true,
        writers.capi_machines,
    )
    .predicate_filter(wakes::read_of_capi_machine, PredicateConfig::default());
    let clusters = watch(caches, slot::CLUSTERS, context, true, writers.clusters)
        .predicate_filter(wakes::read_of_cluster, PredicateConfig::default());
    let capi_clusters = watch(
        caches,
        slot::CAPI_CLUSTERS,
        context,
        true,
        writers.capi_clusters,
    )
    .predicate_filter(wakes::read_of_capi_cluster, PredicateConfig::default());
    let pools = watch(caches, slot::POOLS, context, false, writers.pools);
    let [machine_queue, cluster_queue, capi_cluster_queue] = std::array::from_fn(|_| queue.clone());
    let capi_cluster_store = store.clone();
    controller
        .watches_stream(capi_machines, move |machine| {
            machine_queue.wake(infrastructure_of(&machine))
        })
        // A cluster change (failure domains, pools, readiness) wakes the machines waiting on it.
        .watches_stream(clusters, move |cluster| {
            let name = cluster.labels().get(labels::CLUSTER_NAME).cloned();
            let name = name.unwrap_or_else(|| cluster.name_any());
            cluster_queue.wake(machines_of(&store, cluster.namespace(), &name))
        })
        // A CAPI Cluster change (un-pausing it, its infrastructure becoming provisioned) wakes
        // its machines.
        .watches_stream(capi_clusters, move |cluster| {
            let machines = machines_of(
                &capi_cluster_store,
                cluster.namespace(),
                &cluster.name_any(),
            );
            capi_cluster_queue.wake(machines)
        })
        // Pools are only read (for their gateway metric): nothing to wake.
        .watches_stream(pools, |_| None::<ObjectRef<ProxmoxMachine>>)
}

/// `controller` woken by its machines' IP address claims and the addresses bound to them,
/// watched whole (capmox and the IPAM provider make them, without the shard's label).
fn woken_by_ipam(
    controller: Controller<ProxmoxMachine>,
    caches: &Caches,
    (claims, addresses): (
        kube::runtime::reflector::store::Writer<capi::IPAddressClaim>,
        kube::runtime::reflector::store::Writer<capi::IPAddress>,
    ),
    context: &Context,
    queue: &Wakes,
) -> Controller<ProxmoxMachine> {
    let claims = watch(caches, slot::CLAIMS, context, false, claims);
    let addresses = watch(caches, slot::ADDRESSES, context, false, addresses);
    let claim_store = caches.claims.clone();
    let [claim_queue, address_queue] = std::array::from_fn(|_| queue.clone());
    let own_writes = context.own_writes.clone();
    controller
        // Owned claims wake their ProxmoxMachine (as `owns` would), noted on the work queue;
        // not the echo of the claim's creation: the pass that created it waits for its binding.
        .watches_stream(claims, move |claim| {
            let owners = if own_writes.is_echo(&claim) {
                Vec::new()
            } else {
                super::owners::<ProxmoxMachine>(&claim)
            };
            claim_queue.wake(owners)
        })
        // A bound address wakes the machine that owns its claim.
        .watches_stream(addresses, move |address| {
            let namespace = address.namespace().unwrap_or_default();
            let claim =
                claim_store.get(&ObjectRef::new(&address.spec.claim_ref.name).within(&namespace));
            address_queue.wake(
                claim
                    .map(|c| super::owners::<ProxmoxMachine>(&*c))
                    .unwrap_or_default(),
            )
        })
}

/// Runs the controller until `shutdown` is cancelled.
pub async fn run(context: Arc<Context>, shutdown: CancellationToken) {
    let namespace = context.config.watch_namespace.as_deref();
    let machines: Api<ProxmoxMachine> = scoped_api(&context.client, namespace);
    let (store, writer) = kube::runtime::reflector::store();
    let (caches, writers) = Caches::new(store.clone());
    let own_writes = context.own_writes.clone();
    let (timer, passes) = (context.task_timing.clone(), context.passes.clone());
    let (by_uid, by_place) = (
        caches.machines_by_uid.clone(),
        caches.machines_by_place.clone(),
    );
    let indexed = store.clone();
    let own_changes =
        super::caches::reflected(machines, context.config.shard_watch(), writer, || {})
            .inspect(move |machine| {
                if let Ok(machine) = machine {
                    by_uid.saw(machine, &indexed);
                    by_place.saw(machine, &indexed);
                }
            })
            .predicate_filter(wakes::beyond_status, PredicateConfig::default())
            // After the predicate, so its memory of each machine includes the echo (and the
            // change a machine waiting for its task reads at the task's expected end).
            .filter(move |machine| {
                let wake = machine.as_ref().map_or(true, |m| {
                    // Its deletion is read at once, whatever runs.
                    m.metadata.deletion_timestamp.is_some()
                        || (!own_writes.is_echo(m)
                            && worth_a_pass(&timer, m)
                            && !passes.changed_during(&ObjectRef::from_obj(m)))
                });
                std::future::ready(wake)
            });
    tokio::spawn(super::bootstrap_secrets::follow(
        context.bootstrap_secrets.clone(),
        bootstrap_secret_apis(&context),
        shutdown.clone(),
    ));
    let controller = Controller::for_stream(own_changes, store.clone());
    super::report_cache_sync(store.clone(), context.readiness.clone(), CONTROLLER);
    let controller = woken_by_related(controller, &caches, writers, &context, store.clone());
    // A freed clone or disk task slot, a task's end or a guest's boot wakes machines: as any
    // wake, not one whose task is not due yet or whose pass runs (two wakes for one task's end
    // would run a second pass that finds the next task just submitted).
    let controller = match context.task_slots.take_wakeups() {
        Some(woken) => {
            let queue = Wakes::new(&context, store.clone());
            let woken = futures::stream::unfold(woken, |mut woken| async move {
                woken.recv().await.map(|machine| (machine, woken))
            })
            .flat_map(move |machine| futures::stream::iter(queue.wake([machine])));
            controller.reconcile_on(woken)
        }
        None => controller,
    };
    let context = Arc::new(Context {
        caches: Some(caches),
        ..(*context).clone()
    });
    controller
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

/// One reconcile, with its duration and outcome recorded in the metrics. A change that came
/// in while it ran is read by another pass at once, unless the machine now waits for a Proxmox
/// task (the pass at its expected end reads it).
pub async fn reconcile(
    machine: Arc<ProxmoxMachine>,
    context: Arc<Context>,
) -> Result<Action, MachineError> {
    let machine_ref = ObjectRef::from_obj(&*machine);
    let running = context.passes.start(machine_ref.clone());
    let action = context
        .metrics
        .measure(
            CONTROLLER,
            &*machine,
            Reconcile::new(&machine, &context).and_then_run(),
        )
        .await?;
    let key = claim_key(&machine);
    if running.changed() && worth_a_pass(&context.task_timing, &machine) {
        context.due_wakes.forget(&key);
        return Ok(Action::requeue(Duration::ZERO));
    }
    // Waiting for its task or its guest: woken when that is due, however the expected end
    // moves meanwhile (only a running controller listens to the wakes).
    match tracking::task_not_due(&context.task_timing, &machine)
        .filter(|_| context.caches.is_some())
    {
        Some(remaining) => {
            let watch = due::Watch {
                timer: context.task_timing.clone(),
                node_tasks: context.node_tasks.clone(),
                slots: context.task_slots.clone(),
            };
            context
                .due_wakes
                .wake_when_due(machine_ref, key, remaining, watch);
            Ok(Action::requeue(due::DUE_SAFETY_RECHECK))
        }
        None => {
            context.due_wakes.forget(&key);
            Ok(action)
        }
    }
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
    capi_machine: Arc<capi::Machine>,
    cluster_name: String,
    proxmox_cluster: Arc<ProxmoxCluster>,
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
        // Let go by this process (a requeue set before its release comes late): nothing to do.
        if self.context.vms.released.contains(self.machine) {
            return Ok(Action::await_change());
        }
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
        // nothing to look at before then, whatever woke the machine (a related object's change).
        if !deleting
            && let Some(remaining) = tracking::task_not_due(&self.context.task_timing, self.machine)
        {
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
}

#[cfg(test)]
mod tests {
    use super::vm::is_machine_tag;
    use super::wakes::beyond_status;
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
    fn only_changes_beyond_the_status_wake_a_machine() {
        let machine = ProxmoxMachine::new("m1", Default::default());
        let seen = beyond_status(&machine);
        let mut written = machine.clone();
        written.status = Some(api::ProxmoxMachineStatus {
            bootstrap_data_provided: Some(true),
            ..Default::default()
        });
        written.metadata.resource_version = Some("42".into());
        assert_eq!(beyond_status(&written), seen, "a pass's own status write");
        let changes: [fn(&mut ProxmoxMachine); 6] = [
            |m| m.metadata.generation = Some(2),
            |m| {
                m.annotations_mut()
                    .insert("cluster.x-k8s.io/paused".into(), String::new());
            },
            |m| {
                m.labels_mut().insert("a".into(), "b".into());
            },
            |m| m.finalizers_mut().push("f".into()),
            |m| {
                m.metadata.deletion_timestamp =
                    Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                        k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
                    ));
            },
            |m| {
                m.owner_references_mut().push(Default::default());
            },
        ];
        for (index, change) in changes.iter().enumerate() {
            let mut changed = written.clone();
            change(&mut changed);
            assert_ne!(
                beyond_status(&changed),
                seen,
                "change {index} wakes the machine"
            );
        }
    }

    #[test]
    fn a_machine_waiting_for_its_task_is_woken_only_when_the_task_is_due_or_it_is_deleted() {
        let timer = TaskTimer::new(TaskTimingPolicy::Learned);
        let mut machine = ProxmoxMachine::new("m1", Default::default());
        machine.metadata.namespace = Some("default".into());
        machine.metadata.uid = Some("5c0e001a-1d2b-4c3a-9e8f-000000000001".into());
        assert!(
            worth_a_pass(&timer, &machine),
            "no task: a change is read at once"
        );
        let upid: crate::proxmox::Upid =
            "UPID:pve1:00000403:0000101B:6955B91B:qmclone:9001:root@pam!capmox:"
                .parse()
                .expect("a UPID");
        let first_check = timer.submitted(&upid, &claim_key(&machine), "cloning");
        assert!(!first_check.is_zero());
        assert!(
            !worth_a_pass(&timer, &machine),
            "its clone runs: the pass at its expected end reads the change"
        );
        let mut deleting = machine.clone();
        deleting.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
            ));
        assert!(
            worth_a_pass(&timer, &deleting),
            "deleted while its clone runs"
        );
        timer.finished(&upid);
        timer.forget(&upid);
        assert!(worth_a_pass(&timer, &machine), "its clone ended");
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
