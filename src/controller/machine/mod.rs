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
use kube::runtime::watcher;
use kube::{Api, Resource, ResourceExt};
use serde_json::json;
use tokio_util::sync::CancellationToken;

mod task;

pub use task::{TASK_BACKOFF_INITIAL, TASK_BACKOFF_MAX, TaskClock, task_backoff};

use super::caches::{Caches, Reads, slot};
use super::cluster::{self, ClusterError};
use super::conditions::{self, Decided, Status};
use super::failures::{self, Backoff, Pass};
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
    ProxmoxError, ResourceType, Upid, VmConfig,
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

/// Whether Proxmox calls `vmid` free (`/cluster/nextid?vmid=`): a used or invalid one is not.
async fn vmid_free(proxmox: &ProxmoxClient, vmid: u32) -> Result<bool, MachineError> {
    match proxmox.next_id(Some(vmid)).await {
        Ok(_) => Ok(true),
        Err(ProxmoxError::InvalidParameters { .. }) | Err(ProxmoxError::AlreadyExists { .. }) => {
            Ok(false)
        }
        Err(error) => Err(error.into()),
    }
}
/// Prefix of the tag that ties a VM to its ProxmoxMachine.
const MACHINE_TAG_PREFIX: &str = "capmox-";
/// What precedes the SMBIOS UUID in a provider ID (see [`crate::cloudinit::provider_id`]).
const PROVIDER_ID_PREFIX: &str = "proxmox://";
/// Requeue of a machine whose bootstrap data capmox cannot deliver: only a change helps (the
/// Machine is watched); the long requeue only catches an edited Secret.
const UNSUPPORTED_BOOTSTRAP_REQUEUE: Duration = Duration::from_secs(600);
/// How often a VM whose config lacks its SMBIOS UUID is looked at again: Proxmox writes it
/// with the clone, so a long wait means something else is wrong and polling will not fix it.
const VM_CONFIG_BACKOFF: Backoff = Backoff {
    initial: Duration::from_secs(1),
    max: Duration::from_secs(30),
};
/// What a Proxmox failure is reported as having happened in when its step is not known.
const UNNAMED_STEP: &str = "talking to Proxmox";

/// Why a reconcile failed; it is retried with back-off.
#[derive(Debug, thiserror::Error)]
pub enum MachineError {
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
    /// Shared cluster plumbing failed.
    #[error(transparent)]
    Cluster(#[from] ClusterError),
    /// The object lacks a name or namespace (never true for objects read from the API).
    #[error("ProxmoxMachine without name or namespace")]
    MissingIdentity,
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

/// Whether `tag` has the shape of a [`machine_tag`] (a user's `capmox-prod` does not): such a
/// tag says the VM is some machine's.
fn is_machine_tag(tag: &str) -> bool {
    tag.to_ascii_lowercase()
        .strip_prefix(MACHINE_TAG_PREFIX)
        .is_some_and(|id| id.len() == 16 && id.chars().all(|c| c.is_ascii_alphanumeric()))
}

/// The VMs (not templates) Proxmox lists.
fn vms(resources: &[ClusterResource]) -> impl Iterator<Item = &ClusterResource> + Clone {
    resources
        .iter()
        .filter(|r| r.kind == ResourceType::Qemu && !r.template)
}

/// What ties a VM to a machine. The tag (from the UID) is lost when `clusterctl move` or a
/// restore re-creates the machine; its name, `spec.virtualMachineID` and `spec.providerID` (the
/// VM's SMBIOS UUID) are not, so a VM named after the machine is also its machine's when its
/// SMBIOS UUID is the one `spec.providerID` names, or (without a provider ID) when it carries
/// no machine tag (a clone in flight, a Go provider VM) or its VMID is the one in the spec.
struct Identity<'a> {
    tag: String,
    name: &'a str,
    spec_vmid: Option<u32>,
    uuid: Option<&'a str>,
}

impl<'a> Identity<'a> {
    fn of(machine: &'a ProxmoxMachine, name: &'a str) -> Self {
        Identity {
            tag: machine_tag(machine),
            name,
            spec_vmid: machine
                .spec
                .virtual_machine_id
                .and_then(|id| u32::try_from(id).ok()),
            uuid: machine
                .spec
                .provider_id
                .as_deref()
                .and_then(|id| id.strip_prefix(PROVIDER_ID_PREFIX)),
        }
    }

    /// Whether `tags` hold this machine's tag.
    fn tagged(&self, tags: &[String]) -> bool {
        tags.iter().any(|t| t.eq_ignore_ascii_case(&self.tag))
    }

    /// Whether the VM `vmid` with this config is the machine's.
    fn owns(&self, config: &VmConfig, vmid: u32) -> bool {
        let tags = config.tags();
        if self.tagged(&tags) {
            return true;
        }
        if config.name().as_deref() != Some(self.name) {
            return false;
        }
        if let Some(uuid) = self.uuid {
            return smbios_uuid(config).is_some_and(|u| u.eq_ignore_ascii_case(uuid));
        }
        let tagged_for_another = tags.iter().any(|t| is_machine_tag(t));
        !tagged_for_another || self.spec_vmid == Some(vmid)
    }

    /// Whether the listing alone shows the VM to be the one this controller recorded in the
    /// machine's status (VMID and node), as its config would: named after the machine and
    /// without another machine's tag (the listing may predate this machine's tag). A status
    /// does not survive a move or restore, so an adopted VM is still checked by its config.
    fn listed_as_recorded(&self, vm: &ClusterResource, status: &ProxmoxMachineStatus) -> bool {
        status
            .virtual_machine_id
            .is_some_and(|id| Some(id) == vm.vmid.map(i64::from))
            && status.proxmox_node.is_some()
            && vm.node == status.proxmox_node
            && vm.name.as_deref() == Some(self.name)
            && (!vm.tags.iter().any(|t| is_machine_tag(t)) || self.spec_vmid == vm.vmid)
    }

    /// The listed VM `vm` as it is now, if it is the machine's (its config is read unless its
    /// tag says so). A VM gone from the node it was listed on has moved since the listing (a
    /// clone to another node ends by moving the VM to its target): it is looked up again, not
    /// taken for someone else's.
    async fn owned_listed(
        &self,
        proxmox: &ProxmoxClient,
        configs: &PassConfigs,
        vm: &ClusterResource,
    ) -> Result<Option<ClusterResource>, MachineError> {
        if self.tagged(&vm.tags) {
            return Ok(Some(vm.clone()));
        }
        let (Some(node), Some(vmid)) = (vm.node.as_deref(), vm.vmid) else {
            return Ok(None);
        };
        let read = |node: String| async move {
            match configs.read(proxmox, &node, vmid).await {
                Ok(config) => Ok(Some(config)),
                Err(error) if error.is_not_found() => Ok(None),
                Err(error) => {
                    Err(error).during(|| format!("reading the config of VM {vmid} on {node}"))
                }
            }
        };
        let (vm, config) = match read(node.to_owned()).await? {
            Some(config) => (vm.clone(), config),
            None => {
                let moved = proxmox
                    .find_vm(vmid)
                    .await
                    .during(|| format!("looking for VM {vmid}, gone from {node}"))?
                    .filter(|r| r.node.as_deref().is_some_and(|n| n != node));
                let Some(moved) = moved else {
                    return Ok(None);
                };
                match read(moved.node.clone().unwrap_or_default()).await? {
                    Some(config) => (moved, config),
                    None => return Ok(None),
                }
            }
        };
        Ok(self.owns(&config, vmid).then_some(vm))
    }

    /// The machine's VM when the recorded VMID (`skip`) does not name it: the listed VM with
    /// this machine's tag, else the one named after the machine whose SMBIOS UUID
    /// `spec.providerID` names.
    async fn search(
        &self,
        proxmox: &ProxmoxClient,
        configs: &PassConfigs,
        resources: &[ClusterResource],
        skip: Option<u32>,
    ) -> Result<Option<ClusterResource>, MachineError> {
        let candidates = vms(resources).filter(|r| r.vmid.is_some() && r.vmid != skip);
        if let Some(vm) = candidates.clone().find(|r| self.tagged(&r.tags)) {
            return Ok(Some(vm.clone()));
        }
        if self.uuid.is_none() {
            return Ok(None);
        }
        for vm in candidates.filter(|r| r.name.as_deref() == Some(self.name)) {
            if let Some(vm) = self.owned_listed(proxmox, configs, vm).await? {
                return Ok(Some(vm));
            }
        }
        Ok(None)
    }
}

/// VM configs read in one pass, so a pass reads each at most once (and again only after it
/// changed it).
#[derive(Default)]
struct PassConfigs(std::sync::Mutex<BTreeMap<(String, u32), VmConfig>>);

impl PassConfigs {
    async fn read(
        &self,
        proxmox: &ProxmoxClient,
        node: &str,
        vmid: u32,
    ) -> Result<VmConfig, ProxmoxError> {
        let key = (node.to_owned(), vmid);
        if let Some(config) = self.lock().get(&key) {
            return Ok(config.clone());
        }
        let config = proxmox.vm_config(node, vmid).await?;
        self.lock().insert(key, config.clone());
        Ok(config)
    }

    /// Forgets what was read of a config this pass changed.
    fn changed(&self, node: &str, vmid: u32) {
        self.lock().remove(&(node.to_owned(), vmid));
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<(String, u32), VmConfig>> {
        // Every update is a single insert or remove: a poisoned lock holds a usable map.
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
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
    let controller = Controller::new(machines, watcher::Config::default());
    let store = controller.store();
    super::report_cache_sync(store.clone(), context.readiness.clone(), CONTROLLER);
    let (caches, writers) = Caches::new(store.clone());
    let claims = caches.watch(slot::CLAIMS, api(&client, namespace), writers.claims);
    let addresses = caches.watch(slot::ADDRESSES, api(&client, namespace), writers.addresses);
    let capi_machines = caches.watch(
        slot::CAPI_MACHINES,
        api(&client, namespace),
        writers.capi_machines,
    );
    let clusters = caches.watch(slot::CLUSTERS, api(&client, namespace), writers.clusters);
    let capi_clusters = caches.watch(
        slot::CAPI_CLUSTERS,
        api(&client, namespace),
        writers.capi_clusters,
    );
    let pools = caches.watch(slot::POOLS, api(&client, namespace), writers.pools);
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
    if let MachineError::Cluster(stale) = error
        && stale.is_stale()
    {
        tracing::debug!(controller = CONTROLLER, error = %stale, "pass saw a stale copy");
        return Action::requeue(cluster::STALE_RETRY);
    }
    failures::after_error(&context.retries, CONTROLLER, &*machine, error)
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
    finished: Option<Upid>,
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

    async fn pass(&self) -> Result<Pass, MachineError> {
        let namespace = self
            .machine
            .namespace()
            .ok_or(MachineError::MissingIdentity)?;
        let name = self
            .machine
            .metadata
            .name
            .clone()
            .ok_or(MachineError::MissingIdentity)?;
        let api: Api<ProxmoxMachine> = Api::namespaced(self.context.client.clone(), &namespace);
        let current = self.machine.status.clone().unwrap_or_default();

        // A machine being deleted goes on without its CAPI Machine or Cluster (they may be gone
        // first): what it recorded finds its VM, and nothing is released while one may exist.
        let deleting = self.machine.metadata.deletion_timestamp.is_some();
        let owner = self
            .machine
            .owner_references()
            .iter()
            .find(|o| {
                o.kind == "Machine"
                    && o.api_version
                        .starts_with(&format!("{}/", capi::CLUSTER_API_GROUP))
            })
            .map(|o| o.name.clone());
        if owner.is_none() && !deleting {
            tracing::debug!(machine = %name, "waiting for the CAPI Machine to set the owner reference");
            return Ok(Pass::Done(Action::await_change()));
        }
        let reads = self.reads();
        let capi_machine = match &owner {
            Some(owner) => reads
                .get::<capi::Machine>(&namespace, owner)
                .await?
                .map(Arc::unwrap_or_clone),
            None => None,
        };
        if capi_machine.is_none() && !deleting {
            return Ok(Pass::Done(Action::requeue(Duration::from_secs(2))));
        }
        let cluster_name = match capi_machine.as_ref() {
            Some(capi_machine) if !capi_machine.spec.cluster_name.is_empty() => {
                capi_machine.spec.cluster_name.clone()
            }
            _ => self
                .machine
                .labels()
                .get(labels::CLUSTER_NAME)
                .cloned()
                .unwrap_or_default(),
        };
        let capi_cluster = if cluster_name.is_empty() {
            None
        } else {
            reads
                .get::<capi::Cluster>(&namespace, &cluster_name)
                .await?
                .map(Arc::unwrap_or_clone)
        };
        if capi_cluster.is_none() && !deleting {
            return Ok(Pass::Done(Action::requeue(Duration::from_secs(2))));
        }
        let infra_name = capi_cluster
            .as_ref()
            .and_then(|c| c.spec.infrastructure_ref.as_ref())
            .map(|r| r.name.clone())
            .unwrap_or_else(|| cluster_name.clone());
        let proxmox_cluster = if infra_name.is_empty() {
            None
        } else {
            reads
                .get::<ProxmoxCluster>(&namespace, &infra_name)
                .await?
                .map(Arc::unwrap_or_clone)
        };

        let paused = capi_cluster.as_ref().is_some_and(|c| {
            c.spec.paused == Some(true) || c.annotations().contains_key(annotations::PAUSED)
        }) || self.machine.annotations().contains_key(annotations::PAUSED);
        if paused {
            if !conditions::is_true(&current.conditions, api::conditions::PAUSED) {
                let mut status = owned_status(&current);
                status.conditions = paused_conditions(&current, self.machine.metadata.generation);
                self.write_status(&api, &name, &current, &status).await?;
            }
            return Ok(Pass::Done(Action::await_change()));
        }

        let recorded_vmid = current
            .virtual_machine_id
            .or(self.machine.spec.virtual_machine_id)
            .and_then(|id| u32::try_from(id).ok());
        let mut scope = Scope {
            // Only a machine being deleted goes on without its CAPI Machine (checked above).
            capi_machine: capi_machine.unwrap_or_else(|| {
                capi::Machine::new(owner.as_deref().unwrap_or(&name), Default::default())
            }),
            namespace,
            name,
            api,
            cluster_name,
            proxmox_cluster: proxmox_cluster
                .clone()
                .unwrap_or_else(|| ProxmoxCluster::new(&infra_name, Default::default())),
            status: owned_status(&current),
            current,
            resource_version: None,
            recorded_vmid,
            generation: self.machine.metadata.generation,
            finished: None,
        };

        if deleting {
            return match self.delete(&mut scope, proxmox_cluster.is_some()).await {
                Ok(action) => Ok(Pass::Done(action)),
                Err(error) => {
                    let Some((proxmox, step)) = error.proxmox() else {
                        return Err(error);
                    };
                    let (described, action) = self.proxmox_failure(&scope, step, proxmox).await;
                    self.deleting_status(&mut scope, described.reason, described.message)
                        .await?;
                    Ok(Pass::BackingOff(action))
                }
            };
        }
        let Some(capi_cluster) = capi_cluster else {
            // Only a machine being deleted goes on without its CAPI Cluster (checked above).
            return Ok(Pass::Done(Action::requeue(Duration::from_secs(2))));
        };
        let step = match self
            .provision(&mut scope, proxmox_cluster.is_some(), &capi_cluster)
            .await
        {
            Ok(step) => step,
            Err(error) => match error.proxmox() {
                // Any awaited task that failed (clone, config, resize, upload, start): its own
                // back-off, recorded in status.
                Some((ProxmoxError::TaskFailed { upid, exitstatus }, _)) => {
                    self.record_task_failure(&mut scope, upid, exitstatus).await
                }
                // Any other Proxmox failure (locks included): reported, and backed off.
                Some((proxmox, step)) => {
                    let (described, action) = self.proxmox_failure(&scope, step, proxmox).await;
                    Step::Backoff(
                        Decided::failed(PROVISIONED, described.reason, described.message),
                        action,
                    )
                }
                None => return Err(error),
            },
        };
        let (decided, action, backing_off) = match step {
            Step::Continue => (
                Decided::ok(PROVISIONED, "Provisioned", ""),
                Action::requeue(Duration::from_secs(600)),
                false,
            ),
            Step::Stop(decided, action) => (decided, action, false),
            Step::Backoff(decided, action) => (decided, action, true),
        };
        let decided = [
            Decided::failed(api::conditions::PAUSED, "NotPaused", ""),
            decided,
        ];
        scope.status.conditions = conditions::merge(
            &scope.current.conditions,
            &decided,
            scope.generation,
            Timestamp::now(),
        );
        self.write_status(&scope.api, &scope.name, &scope.current, &scope.status)
            .await?;
        Ok(if backing_off {
            Pass::BackingOff(action)
        } else {
            Pass::Done(action)
        })
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

    async fn provision(
        &self,
        scope: &mut Scope,
        cluster_found: bool,
        capi_cluster: &capi::Cluster,
    ) -> Result<Step, MachineError> {
        let provisioned = capi_cluster
            .status
            .as_ref()
            .and_then(|s| s.initialization.as_ref())
            .and_then(|i| i.infrastructure_provisioned)
            == Some(true);
        if !cluster_found || !provisioned {
            return Ok(waiting(
                "WaitingForClusterInfrastructure",
                "the ProxmoxCluster is not provisioned yet",
                Action::await_change(),
            ));
        }
        let Some(bootstrap_secret) = scope
            .capi_machine
            .spec
            .bootstrap
            .as_ref()
            .and_then(|b| b.data_secret_name.clone())
        else {
            return Ok(waiting(
                "WaitingForBootstrapData",
                "the Machine has no bootstrap data yet",
                Action::await_change(),
            ));
        };
        // Bootstrap data capmox cannot deliver: say so before anything is created.
        let already_provisioned =
            Initialization::provisioned(scope.current.initialization.as_ref());
        if !already_provisioned
            && scope.recorded_vmid.is_none()
            && let Some(step) = self.unsupported_bootstrap(scope, &bootstrap_secret).await?
        {
            return Ok(step);
        }
        // Fresh means this pass saw the latest object: either it already carried the finalizer
        // (and the checkpoint before a clone is guarded by its resourceVersion), or the guarded
        // finalizer patch below succeeded against it.
        let fresh_guard = self
            .machine
            .finalizers()
            .iter()
            .any(|f| f == finalizers::MACHINE)
            .then(|| self.machine.metadata.resource_version.clone())
            .flatten();
        scope.resource_version = fresh_guard;
        cluster::ensure_finalizer(&scope.api, self.machine, finalizers::MACHINE).await?;

        let placement =
            match Placement::resolve(&scope.proxmox_cluster, self.machine, &scope.capi_machine) {
                Ok(placement) => placement,
                Err(error) => {
                    // Retried when the ProxmoxCluster or the Machine changes (both are watched).
                    return Ok(waiting(
                        error.reason(),
                        error.to_string(),
                        Action::requeue(Duration::from_secs(60)),
                    ));
                }
            };
        let proxmox = match self.proxmox_client(scope).await? {
            Ok(client) => client,
            Err(message) => {
                return Ok(waiting(
                    "ProxmoxUnavailable",
                    message,
                    Action::requeue(Duration::from_secs(30)),
                ));
            }
        };

        // A task in flight (recorded by an earlier pass, perhaps before a restart), or the
        // back-off after a failed one: nothing else happens until it is over.
        if let Some(step) = self.tracked_task(scope, &proxmox, false).await? {
            return Ok(if already_provisioned {
                step.still_provisioned()
            } else {
                step
            });
        }

        // Static addresses from the placement's pools: claimed before anything is created in
        // Proxmox, and bound by the IPAM provider while the clone runs; only the seed ISO
        // waits for them. Once bound and recorded, they stay: only the seed ISO reads them
        // again.
        let (addresses, addresses_pending) = if scope.current.ip_addresses.is_empty() {
            let bound = self.addresses(scope, &placement).await?;
            if let Some(addresses) = &bound {
                scope.status.ip_addresses = addresses.status.clone();
            }
            let pending = bound.is_none();
            (bound, pending)
        } else {
            (None, false)
        };

        // The VM: find it, or create it.
        let resources = self
            .context
            .inventory
            .resources(&proxmox)
            .await
            .during(|| "listing Proxmox's VMs and nodes".to_owned())?;
        let Some(vm) = self.find_vm(scope, &resources, &proxmox).await? else {
            // A machine whose spec names its VM never gets a second one.
            if let Some(provider_id) = self.machine.spec.provider_id.as_deref() {
                return Ok(self.vm_not_found(scope, provider_id).await);
            }
            return self
                .create_vm(scope, &placement, &proxmox, &resources)
                .await;
        };
        let node = vm.node.clone().unwrap_or_default();
        let vmid = vm.vmid.unwrap_or_default();
        // Adopted (after a move or restore, or from the Go provider): the spec records the VMID,
        // so a later move finds it even before the VM carries this machine's tag.
        let adopted = scope.current.virtual_machine_id != Some(i64::from(vmid))
            && !Identity::of(self.machine, &scope.name).tagged(&vm.tags);
        let guard = scope.resource_version.clone();
        self.record_vmid(scope, vmid, guard).await?;
        if adopted {
            self.event(
                scope,
                EventType::Normal,
                "Adopted",
                &format!(
                    "adopted VM {vmid} on {node}: it carries this machine's name and the VMID or SMBIOS UUID its spec records"
                ),
            )
            .await;
        }
        scope.status.proxmox_node = Some(node.clone());
        scope.status.virtual_machine_id = Some(i64::from(vmid));
        scope.status.failure_domain = placement.failure_domain().map(str::to_owned);
        if vm.lock.as_deref() == Some("clone") {
            return Ok(waiting(
                "Cloning",
                format!("VM {vmid} is being cloned on {node}"),
                Action::requeue(Duration::from_secs(1)),
            ));
        }

        let read_config = || format!("reading the config of VM {vmid} on {node}");
        let running = vm.status.as_deref() == Some("running");
        // Read when a step needs it: a running VM waiting for its guest needs none, nor does a
        // VM whose seed ISO this pass saw uploaded (the pass that uploaded it configured it;
        // only the attachment and the start are left).
        let uploaded = seed_iso_uploaded(scope, &node);
        let mut config = None;
        if !running && !uploaded {
            let read = self
                .configs
                .read(&proxmox, &node, vmid)
                .await
                .during(read_config)?;
            // The provider ID (the VM's SMBIOS UUID) is recorded as soon as the config shows
            // it: CAPI reads it only once the machine is provisioned, and no later pass needs to
            // read the config for it.
            if self.machine.spec.provider_id.is_none()
                && let Some(uuid) = smbios_uuid(&read)
            {
                self.record_identity(scope, &placement, &crate::cloudinit::provider_id(&uuid))
                    .await?;
            }
            match self
                .configure(scope, &placement, &proxmox, &node, vmid, &read)
                .await?
            {
                Configured::Unchanged => config = Some(read),
                // The bootstrap step works from the config as it is now: as written, or read
                // again when Proxmox filled in values.
                Configured::Changed(Some(updated)) => {
                    self.configs.changed(&node, vmid);
                    config = Some(updated);
                }
                Configured::Changed(None) => {
                    self.configs.changed(&node, vmid);
                    config = Some(
                        self.configs
                            .read(&proxmox, &node, vmid)
                            .await
                            .during(read_config)?,
                    );
                }
                Configured::Waiting(step) => return Ok(step),
            }
        } else if running && self.retagged(&vm.tags).is_some() {
            // A running VM adopted after a move or restore: only its tags change, so it is
            // found by this machine's tag from now on.
            let read = self
                .configs
                .read(&proxmox, &node, vmid)
                .await
                .during(read_config)?;
            if let Some(tags) = self.retagged(&read.tags()) {
                let update = ConfigUpdate::default()
                    .set("tags", tags)
                    .digest(read.digest());
                proxmox
                    .update_vm_config_sync(&node, vmid, &update)
                    .await
                    .during(|| format!("tagging VM {vmid} on {node} for this machine"))?;
            }
            config = Some(read);
        }

        // After the upload, the attachment needs nothing of the config.
        let attaching_only = VmConfig::default();
        let bootstrap_config = match &config {
            Some(config) => Some(config),
            None if uploaded => Some(&attaching_only),
            None => None,
        };
        if let Some(bootstrap_config) = bootstrap_config.filter(|_| !running) {
            if let Some(step) = self
                .bootstrap(
                    scope,
                    &placement,
                    &proxmox,
                    &node,
                    vmid,
                    bootstrap_config,
                    &bootstrap_secret,
                    addresses.as_ref(),
                )
                .await?
            {
                return Ok(step);
            }
            let starting = proxmox.power(&node, vmid, PowerAction::Start).await;
            if let Some(step) = self.submitted(scope, &proxmox, starting, || {
                format!("starting VM {vmid} on {node}")
            })? {
                return Ok(step);
            }
        }

        let checks = self.machine.spec.checks.clone().unwrap_or_default();
        // Once provisioned, the boot checks are history: later passes only observe the VM.
        let check_cloud_init = checks.skip_qemu_guest_agent != Some(true)
            && checks.skip_cloud_init_status != Some(true);
        let check_agent = checks.skip_qemu_guest_agent != Some(true);
        // While the guest boots, it is looked at when guests on its node usually are done.
        let machine_key = claim_key(self.machine);
        let boot_clock = &self.context.task_clock;
        let booting = || Action::requeue(boot_clock.boot_silent(&machine_key, &node));
        if already_provisioned {
            // Nothing to wait for.
        } else if check_cloud_init {
            match proxmox
                .cloud_init_status(&node, vmid, Duration::from_secs(5))
                .await
            {
                Ok(crate::proxmox::CloudInitStatus::Done) => {}
                Ok(crate::proxmox::CloudInitStatus::Degraded(text)) => {
                    self.event(
                        scope,
                        EventType::Warning,
                        "CloudInitDegraded",
                        &format!("cloud-init finished with recoverable errors: {text}"),
                    )
                    .await;
                }
                Ok(crate::proxmox::CloudInitStatus::Running) => {
                    return Ok(waiting(
                        "WaitingForCloudInit",
                        "cloud-init is still running",
                        booting(),
                    ));
                }
                Ok(crate::proxmox::CloudInitStatus::Error { exitcode, output }) => {
                    let exit = exitcode.map_or_else(|| "unknown".to_owned(), |c| c.to_string());
                    let message = format!(
                        "cloud-init failed in VM {vmid} (exit code {exit}): {output}; check the bootstrap data and the guest's /var/log/cloud-init.log"
                    );
                    boot_clock.boot_answered(&machine_key);
                    self.event(scope, EventType::Warning, "CloudInitFailed", &message)
                        .await;
                    return Ok(waiting(
                        "CloudInitFailed",
                        message,
                        Action::requeue(Duration::from_secs(60)),
                    ));
                }
                Err(error) if error.is_agent_unavailable() || error.is_retryable() => {
                    return Ok(waiting(
                        "WaitingForGuestAgent",
                        "the QEMU guest agent does not answer yet",
                        booting(),
                    ));
                }
                Err(error) => {
                    return Err(error).during(|| format!("checking cloud-init in VM {vmid}"));
                }
            }
        } else if check_agent && proxmox.agent_ping(&node, vmid).await.is_err() {
            return Ok(waiting(
                "WaitingForGuestAgent",
                "the QEMU guest agent does not answer yet",
                booting(),
            ));
        }
        boot_clock.boot_answered(&machine_key);

        // Provisioned: provider ID, addresses, placement, readiness.
        if addresses_pending {
            return Ok(waiting_for_addresses());
        }
        // The provider ID comes from the VM's SMBIOS UUID; once recorded (for this VM: it is
        // how the VM was found), it is not read again.
        let provider_id = match (&config, self.machine.spec.provider_id.as_deref()) {
            (None, Some(recorded)) => recorded.to_owned(),
            _ => {
                let config = match &config {
                    Some(config) => config.clone(),
                    None => self
                        .configs
                        .read(&proxmox, &node, vmid)
                        .await
                        .during(read_config)?,
                };
                let uuid = smbios_uuid(&config)
                    .ok_or_else(|| ProxmoxError::Decode {
                        endpoint: "GET /nodes/{node}/qemu/{vmid}/config".into(),
                        message: format!("VM {vmid} has no smbios1 uuid"),
                    })
                    .during(read_config)?;
                crate::cloudinit::provider_id(&uuid)
            }
        };
        self.record_identity(scope, &placement, &provider_id)
            .await?;
        scope.status.addresses = machine_addresses(&scope.name, &scope.status.ip_addresses);
        scope.status.vm_status = Some(VirtualMachineState::Ready);
        scope.status.bootstrap_data_provided = Some(true);
        scope.status.initialization = Some(Initialization {
            provisioned: Some(true),
        });
        if !already_provisioned {
            self.event(
                scope,
                EventType::Normal,
                "Provisioned",
                &format!("VM {vmid} on {node} is running and bootstrapped ({provider_id})"),
            )
            .await;
        }
        scope.status.task_ref = None;
        scope.status.retry_after = None;
        scope.status.task_failures = None;
        if scope
            .capi_machine
            .status
            .as_ref()
            .and_then(|s| s.node_ref.as_ref())
            .is_some()
            && !self.context.seed_isos_removed.contains(&machine_key, vmid)
        {
            let removed = match config {
                // Deleted in the task this pass saw end: only the detachment is left, and it
                // needs no look at the config (detaching what is gone is a no-op).
                None if seed_iso_deleted(scope, &node) => {
                    detach_seed_iso(&proxmox, &node, vmid).await.map(|()| None)
                }
                Some(config) => self.remove_iso(scope, &proxmox, &node, vmid, &config).await,
                None => match self
                    .configs
                    .read(&proxmox, &node, vmid)
                    .await
                    .during(read_config)
                {
                    Ok(config) => self.remove_iso(scope, &proxmox, &node, vmid, &config).await,
                    Err(error) => Err(error),
                },
            };
            let error = match removed {
                Ok(None) => {
                    self.context.seed_isos_removed.insert(&machine_key, vmid);
                    return Ok(Step::Continue);
                }
                Ok(Some(step)) => return Ok(step.still_provisioned()),
                Err(error) => error,
            };
            // The machine stays provisioned; the seed ISO left behind (it holds the bootstrap
            // token) is reported by a Warning event, and its removal retried with back-off.
            let Some((proxmox, step)) = error.proxmox() else {
                return Err(error);
            };
            let (_, action) = self.proxmox_failure(scope, step, proxmox).await;
            return Ok(Step::Backoff(
                Decided::ok(PROVISIONED, "Provisioned", ""),
                action,
            ));
        }
        Ok(Step::Continue)
    }

    /// The Proxmox client for the machine's cluster (credentials resolved as the cluster controller does).
    async fn proxmox_client(
        &self,
        scope: &Scope,
    ) -> Result<Result<ProxmoxClient, String>, MachineError> {
        let config =
            cluster::client_config_for(self.context, &scope.proxmox_cluster, &scope.namespace)
                .await?;
        Ok(match config {
            Ok(config) => self.context.proxmox.get(&config).map_err(|e| e.to_string()),
            Err(error) => Err(error.to_string()),
        })
    }

    /// Stops before creating anything when the bootstrap Secret holds data capmox cannot
    /// deliver (unknown formats, malformed Ignition). A missing Secret is reported where it is read.
    async fn unsupported_bootstrap(
        &self,
        scope: &Scope,
        secret_name: &str,
    ) -> Result<Option<Step>, MachineError> {
        let Some(secret) = Api::<Secret>::namespaced(self.context.client.clone(), &scope.namespace)
            .get_opt(secret_name)
            .await?
        else {
            return Ok(None);
        };
        let format = secret
            .data
            .as_ref()
            .and_then(|d| d.get("format"))
            .map(|v| String::from_utf8_lossy(&v.0).into_owned());
        let value = secret.data.as_ref().and_then(|d| d.get("value"));
        let error = match crate::cloudinit::BootstrapFormat::parse(format.as_deref()) {
            Ok(crate::cloudinit::BootstrapFormat::CloudConfig) => return Ok(None),
            Ok(crate::cloudinit::BootstrapFormat::Ignition) => {
                match crate::cloudinit::ignition::check(value.map_or(&[][..], |v| &v.0)) {
                    Ok(()) => return Ok(None),
                    Err(error) => crate::cloudinit::CloudInitError::from(error),
                }
            }
            Err(error) => error,
        };
        let message = format!("bootstrap Secret {secret_name}: {error}");
        self.event(scope, EventType::Warning, error.reason(), &message)
            .await;
        Ok(Some(waiting(
            error.reason(),
            message,
            Action::requeue(UNSUPPORTED_BOOTSTRAP_REQUEUE),
        )))
    }

    /// The machine's VM: by its tag, by the recorded VMID (if that VM is still the machine's),
    /// by `spec.providerID` (a machine moved or restored under a new UID), or as a clone in
    /// flight that Proxmox does not list yet.
    async fn find_vm(
        &self,
        scope: &mut Scope,
        resources: &[ClusterResource],
        proxmox: &ProxmoxClient,
    ) -> Result<Option<ClusterResource>, MachineError> {
        let identity = Identity::of(self.machine, &scope.name);
        if let Some(vm) = vms(resources).find(|r| identity.tagged(&r.tags)) {
            return Ok(Some(vm.clone()));
        }
        if let Some(vmid) = scope.recorded_vmid
            && let Some(vm) = vms(resources).find(|r| r.vmid == Some(vmid))
        {
            if identity.listed_as_recorded(vm, &scope.current) {
                return Ok(Some(vm.clone()));
            }
            if let Some(vm) = identity.owned_listed(proxmox, &self.configs, vm).await? {
                return Ok(Some(vm));
            }
            // The VMID belongs to someone else now: forget it and create ours elsewhere.
            tracing::warn!(machine = %scope.name, vmid, "the recorded VMID belongs to another VM; choosing a new one");
            self.context
                .vmid_claims
                .unclaim(vmid, &claim_key(self.machine));
            scope.recorded_vmid = None;
            scope.status.virtual_machine_id = None;
            scope.current.virtual_machine_id = None;
        }
        if let Some(vm) = identity
            .search(proxmox, &self.configs, resources, scope.recorded_vmid)
            .await?
        {
            return Ok(Some(vm));
        }
        // A clone in flight is not listed yet: it is ours if it carries our VMID and name.
        if let Some(vmid) = scope.recorded_vmid
            && let Some(node) = scope.current.proxmox_node.clone()
            && let Ok(config) = self.configs.read(proxmox, &node, vmid).await
            && identity.owns(&config, vmid)
        {
            if let Some(found) = resources.iter().find(|r| r.vmid == Some(vmid)) {
                return Ok(Some(found.clone()));
            }
            // Not in /cluster/resources yet (its statistics lag): describe it from its config.
            let described: ClusterResource = serde_json::from_value(json!({
                "id": format!("qemu/{vmid}"), "type": "qemu", "vmid": vmid, "node": node,
                "name": scope.name, "lock": config.lock(), "status": "stopped"
            }))?;
            return Ok(Some(described));
        }
        Ok(None)
    }

    /// Records `vmid` in `spec.virtualMachineID`, where it survives `clusterctl move` and
    /// restores (status does not), unless it is there already. Guarded by `guard` (a
    /// resourceVersion) when given. Returns the resourceVersion to guard the next write with.
    async fn record_vmid(
        &self,
        scope: &mut Scope,
        vmid: u32,
        guard: Option<String>,
    ) -> Result<Option<String>, MachineError> {
        if self.machine.spec.virtual_machine_id == Some(i64::from(vmid)) {
            return Ok(guard);
        }
        let mut ops = Vec::new();
        if let Some(version) = &guard {
            ops.push(json!({"op": "test", "path": "/metadata/resourceVersion", "value": version}));
        }
        ops.push(json!({"op": "add", "path": "/spec/virtualMachineID", "value": vmid}));
        let patched = scope
            .api
            .patch(
                &scope.name,
                &PatchParams::default(),
                &Patch::Json::<()>(serde_json::from_value(serde_json::Value::Array(ops))?),
            )
            .await
            .map_err(|error| cluster::guarded_write_error(self.machine, error))?;
        scope.generation = patched.metadata.generation;
        Ok(patched.metadata.resource_version)
    }

    async fn create_vm(
        &self,
        scope: &mut Scope,
        placement: &Placement,
        proxmox: &ProxmoxClient,
        resources: &[ClusterResource],
    ) -> Result<Step, MachineError> {
        let (source, target) = match self
            .clone_source(scope, placement, proxmox, resources)
            .await?
        {
            Ok(chosen) => chosen,
            Err(step) => return Ok(step),
        };
        let (source_node, template_vmid) = (source.node, source.vmid);

        // The VMID: the recorded one if it is still free, else from the range or Proxmox.
        // Claimed for this machine until it is deleted, so no other machine ever records it,
        // even while a clone that did not happen leaves it free in Proxmox.
        let vmid = match self.pick_vmid(scope, proxmox, resources).await? {
            Picked::Vmid(claim) => claim,
            Picked::Unlisted(vmid) => {
                // Proxmox has a VM with the recorded VMID that it does not list yet (a clone
                // requested before a move): the next look tells whether it is ours.
                self.context.reservations.lock().await.release(&scope.name);
                return Ok(waiting(
                    "Cloning",
                    format!("VMID {vmid} is in use in Proxmox but not listed yet; looking again"),
                    Action::requeue(Duration::from_secs(1)),
                ));
            }
            Picked::Exhausted => {
                self.context.reservations.lock().await.release(&scope.name);
                let message = if self.machine.spec.vm_id_range.is_some() {
                    "no free VMID in spec.vmIDRange; widen the range or free VMIDs"
                } else {
                    "Proxmox has no free VMID; free VMIDs"
                };
                return Ok(waiting(
                    "VMIDRangeExhausted",
                    message,
                    Action::requeue(Duration::from_secs(60)),
                ));
            }
        };
        self.context
            .reservations
            .lock()
            .await
            .set_vmid(&scope.name, vmid);

        // Intent first: a crash after the clone request finds the VM by this VMID. The spec
        // holds it too, since a move or restore keeps the spec but not the status; that write
        // is guarded by the resourceVersion this pass saw, and the status checkpoint by the one
        // it produced.
        let guard = scope.resource_version.clone();
        scope.resource_version = self.record_vmid(scope, vmid, guard).await?;
        scope.recorded_vmid = Some(vmid);
        scope.status.virtual_machine_id = Some(i64::from(vmid));
        scope.status.proxmox_node = Some(target.clone());
        scope.status.failure_domain = placement.failure_domain().map(str::to_owned);
        scope.status.vm_status = Some(VirtualMachineState::Pending);
        let mut checkpoint = scope.status.clone();
        checkpoint.conditions = conditions::merge(
            &scope.current.conditions,
            &[
                Decided::failed(api::conditions::PAUSED, "NotPaused", ""),
                Decided::failed(
                    PROVISIONED,
                    "Cloning",
                    format!("cloning template {template_vmid} to VM {vmid} on {target}"),
                ),
            ],
            scope.generation,
            Timestamp::now(),
        );
        // Guarded by the observed resourceVersion (when this pass did not just prove it fresh
        // with the finalizer patch): a stale cached object can never start a second clone.
        apply_status_guarded(
            &scope.api,
            &scope.name,
            &checkpoint,
            scope.resource_version.as_deref(),
        )
        .await?;
        scope.current = checkpoint;

        let spec = &self.machine.spec;
        let params = CloneParams {
            newid: vmid,
            name: Some(scope.name.clone()),
            description: spec.description.clone(),
            target: (target != source_node).then(|| target.clone()),
            full: Some(spec.full.unwrap_or(true)),
            storage: spec.storage.clone(),
            format: spec.format.map(|f| {
                serde_json::to_value(f)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_owned))
                    .unwrap_or_default()
            }),
            pool: spec.pool.clone(),
            snapname: spec.snap_name.clone(),
        };
        let cloning = || {
            format!("cloning template {template_vmid} on {source_node} to VM {vmid} on {target}")
        };
        match proxmox.clone_vm(&source_node, template_vmid, &params).await {
            Ok(upid) => {
                // The task in flight: a restarted controller checks it instead of cloning
                // again (and the VMID recorded above finds the VM either way). Recorded now,
                // not at the end of the pass, so a failed write of the pass's status cannot
                // lose it.
                let step = self.submitted(scope, proxmox, Ok(Some(upid.clone())), cloning)?;
                let mut recorded = scope.status.clone();
                recorded.conditions = scope.current.conditions.clone();
                apply_status(&scope.api, &scope.name, &scope.current, &recorded).await?;
                scope.current = recorded;
                self.event(
                    scope,
                    EventType::Normal,
                    "Cloning",
                    &format!("{} (task {upid})", cloning()),
                )
                .await;
                Ok(step.unwrap_or_else(|| {
                    waiting(
                        "Cloning",
                        cloning(),
                        Action::requeue(Duration::from_millis(100)),
                    )
                }))
            }
            Err(ProxmoxError::AlreadyExists { .. }) => {
                // Taken meanwhile by someone else: forget it and pick another next time.
                scope.status.virtual_machine_id = None;
                scope.recorded_vmid = None;
                self.context
                    .vmid_claims
                    .unclaim(vmid, &claim_key(self.machine));
                Ok(waiting(
                    "VMIDTaken",
                    format!("VMID {vmid} was taken meanwhile; choosing another"),
                    Action::requeue(Duration::from_millis(200)),
                ))
            }
            Err(error) => Err(error).during(cloning),
        }
    }

    /// The template copy to clone and the node to clone to. The template's copies (one, or
    /// one per node for node-local storage) decide which candidate nodes can receive a clone;
    /// the scheduler chooses among those only, and the chosen node clones its own copy, else a
    /// copy on shared storage. `Err`: the machine waits (no template, ambiguous, no node).
    async fn clone_source(
        &self,
        scope: &Scope,
        placement: &Placement,
        proxmox: &ProxmoxClient,
        resources: &[ClusterResource],
    ) -> Result<Result<(TemplateChoice, String), Step>, MachineError> {
        let templates: Vec<TemplateInfo> = resources
            .iter()
            .filter(|r| r.kind == ResourceType::Qemu && r.template)
            .filter_map(|r| {
                Some(TemplateInfo {
                    node: r.node.clone()?,
                    vmid: r.vmid?,
                    name: r.name.clone().unwrap_or_default(),
                    tags: r.tags.clone(),
                })
            })
            .collect();
        let copies = match placement.template() {
            TemplateSource::Id { vmid, node } => {
                let vmid = u32::try_from(*vmid).unwrap_or_default();
                let listed = templates.iter().find(|t| t.vmid == vmid);
                vec![TemplateInfo {
                    node: node.clone(),
                    vmid,
                    name: listed
                        .as_ref()
                        .map(|t| t.name.clone())
                        .filter(|n| !n.is_empty())
                        .unwrap_or_else(|| vmid.to_string()),
                    tags: listed.map(|t| t.tags.clone()).unwrap_or_default(),
                }]
            }
            TemplateSource::Tags(selector) => {
                match placement::select_template(selector, &templates) {
                    Ok(copies) => copies,
                    Err(error) => return Ok(Err(self.template_waiting(scope, &error).await)),
                }
            }
        };
        // Where the copies' volumes live matters only for a candidate node without a copy.
        let elsewhere = match placement.candidates() {
            NodeCandidates::Nodes(nodes) => {
                nodes.iter().any(|n| !copies.iter().any(|c| c.node == *n))
            }
            NodeCandidates::TemplateNode => false,
        };
        let mut with_storages = Vec::with_capacity(copies.len());
        for template in copies {
            let storages = if elsewhere {
                Some(
                    self.context
                        .inventory
                        .template_config(proxmox, &template.node, template.vmid)
                        .await?
                        .volume_storages(),
                )
            } else {
                None
            };
            with_storages.push(TemplateCopy { template, storages });
        }
        let template_memory = with_storages.first().and_then(|c| {
            resources
                .iter()
                .find(|r| r.vmid == Some(c.template.vmid))
                .and_then(|r| r.maxmem)
        });
        let storages: Vec<StorageInfo> = resources
            .iter()
            .filter(|r| r.kind == ResourceType::Storage)
            .filter_map(|r| {
                Some(StorageInfo {
                    node: r.node.clone()?,
                    storage: r.storage.clone()?,
                    shared: r.shared,
                })
            })
            .collect();
        let sources = CloneSources::new(
            with_storages,
            &storages,
            self.machine.spec.storage.as_deref(),
        );

        let node = if placement.needs_scheduling() {
            let narrowed = match sources.narrow(placement) {
                Ok(narrowed) => narrowed,
                Err(error) => return Ok(Err(self.template_waiting(scope, &error).await)),
            };
            let inventory = self.inventory(scope, resources).await?;
            let request = ScheduleRequest::new(&narrowed, template_memory);
            let mut reservations = self.context.reservations.lock().await;
            reservations.release_visible(&inventory);
            match reservations.schedule_and_reserve(&narrowed, &inventory, &request) {
                Ok(choice) => Some(choice.node),
                Err(error) => {
                    return Ok(Err(waiting(
                        error.reason(),
                        error.to_string(),
                        Action::requeue(Duration::from_secs(30)),
                    )));
                }
            }
        } else {
            None
        };
        match sources.choose(node.as_deref()) {
            Ok(source) => {
                let target = node.unwrap_or_else(|| source.node.clone());
                Ok(Ok((source, target)))
            }
            Err(error) => Ok(Err(self.template_waiting(scope, &error).await)),
        }
    }

    /// Waits on a template problem (checked again in a minute: templates are not watched),
    /// giving back any memory reserved for the machine.
    async fn template_waiting(&self, scope: &Scope, error: &TemplateError) -> Step {
        self.context.reservations.lock().await.release(&scope.name);
        waiting(
            error.reason(),
            error.to_string(),
            Action::requeue(Duration::from_secs(60)),
        )
    }

    /// A VMID for the machine, claimed for it: the recorded one while no VM uses it, else the
    /// first free one of `spec.vmIDRange` or from Proxmox's `nextid` that no other machine holds.
    async fn pick_vmid(
        &self,
        scope: &Scope,
        proxmox: &ProxmoxClient,
        resources: &[ClusterResource],
    ) -> Result<Picked, MachineError> {
        let claims = &self.context.vmid_claims;
        claims.seed(|| self.recorded_vmids()).await?;
        let key = claim_key(self.machine);
        let used = |vmid: u32| resources.iter().any(|r| r.vmid == Some(vmid));
        if let Some(recorded) = scope.recorded_vmid
            && !used(recorded)
            && claims.claim(recorded, &key)
        {
            // Not listed, but perhaps created: a clone requested just before a move or restore.
            return Ok(if vmid_free(proxmox, recorded).await? {
                Picked::Vmid(recorded)
            } else {
                Picked::Unlisted(recorded)
            });
        }
        // Proxmox names the lowest VMID without a VM (asked once a minute per endpoint); from
        // there, the first one neither listed nor held by another machine is confirmed with
        // Proxmox, so one call usually settles it.
        let candidates = match &self.machine.spec.vm_id_range {
            Some(range) => (range.start, range.end),
            None => {
                let (lowest, freshness) = self.context.inventory.lowest_free_vmid(proxmox).await?;
                if freshness == inventory::Freshness::JustAsked && claims.claim(lowest, &key) {
                    return Ok(Picked::Vmid(lowest));
                }
                (i64::from(lowest), i64::from(MAX_VMID))
            }
        };
        for candidate in candidates.0..=candidates.1 {
            let Ok(vmid) = u32::try_from(candidate) else {
                continue;
            };
            if used(vmid) || !claims.claim(vmid, &key) {
                continue;
            }
            if vmid_free(proxmox, vmid).await? {
                return Ok(Picked::Vmid(vmid));
            }
            claims.unclaim(vmid, &key);
        }
        Ok(Picked::Exhausted)
    }

    /// The VMIDs the ProxmoxMachines this controller watches have recorded, by machine, to
    /// seed the claims of a freshly started process.
    async fn recorded_vmids(&self) -> Result<Vec<(String, u32)>, MachineError> {
        let machines = self
            .reads()
            .all::<ProxmoxMachine>(self.context.config.watch_namespace.as_deref())
            .await?;
        Ok(machines
            .iter()
            .flat_map(|m| {
                let status = m.status.as_ref().and_then(|s| s.virtual_machine_id);
                [status, m.spec.virtual_machine_id]
                    .into_iter()
                    .flatten()
                    .filter_map(|id| u32::try_from(id).ok())
                    .map(|vmid| (claim_key(m), vmid))
            })
            .collect())
    }

    /// Nodes with their memory, guests and this cluster's machines, for the scheduler.
    async fn inventory(
        &self,
        scope: &Scope,
        resources: &[ClusterResource],
    ) -> Result<NodeInventory, MachineError> {
        let reads = self.reads();
        let machines = reads
            .labelled::<ProxmoxMachine>(&scope.namespace, labels::CLUSTER_NAME, &scope.cluster_name)
            .await?;
        let capi_machines = reads
            .labelled::<capi::Machine>(&scope.namespace, labels::CLUSTER_NAME, &scope.cluster_name)
            .await?;
        // By name: a fleet of thousands is matched in one pass, not one scan per machine.
        let capi_machines: BTreeMap<&str, &capi::Machine> = capi_machines
            .iter()
            .filter_map(|c| Some((c.metadata.name.as_deref()?, &**c)))
            .collect();
        let placed = |node: &str| -> Vec<PlacedMachine> {
            machines
                .iter()
                .filter(|m| m.metadata.name.as_deref() != Some(scope.name.as_str()))
                .filter(|m| m.status.as_ref().and_then(|s| s.proxmox_node.as_deref()) == Some(node))
                .filter_map(|m| {
                    let owner = m.owner_references().iter().find(|o| o.kind == "Machine")?;
                    let capi_machine = capi_machines.get(owner.name.as_str())?;
                    Some(PlacedMachine::from_machine(m.name_any(), capi_machine))
                })
                .collect()
        };
        let nodes = resources
            .iter()
            .filter(|r| r.kind == ResourceType::Node)
            .filter_map(|r| {
                let name = r.node.clone()?;
                let guests = resources
                    .iter()
                    .filter(|g| {
                        matches!(g.kind, ResourceType::Qemu | ResourceType::Lxc)
                            && g.node.as_deref() == Some(name.as_str())
                    })
                    .map(|g| GuestInfo {
                        vmid: g.vmid.unwrap_or_default(),
                        kind: if g.kind == ResourceType::Lxc {
                            GuestKind::Lxc
                        } else {
                            GuestKind::Qemu
                        },
                        max_memory_bytes: g.maxmem.unwrap_or(0),
                        template: g.template,
                    })
                    .collect();
                Some(NodeInfo {
                    machines: placed(&name),
                    name,
                    total_memory_bytes: r.maxmem.unwrap_or(0),
                    guests,
                })
            })
            .collect();
        Ok(NodeInventory { nodes })
    }

    /// Writes `provider_id` to the machine's spec and its zone (`default` without one) to its
    /// `topology.kubernetes.io/proxmox-zone` label, as the Go provider labels its machines for
    /// users to select on, unless both are there already.
    async fn record_identity(
        &self,
        scope: &mut Scope,
        placement: &Placement,
        provider_id: &str,
    ) -> Result<(), MachineError> {
        let zone = placement.zone_label();
        if self.machine.spec.provider_id.as_deref() == Some(provider_id)
            && self
                .machine
                .labels()
                .get(labels::PROXMOX_ZONE)
                .map(String::as_str)
                == Some(zone)
        {
            return Ok(());
        }
        let patched = scope
            .api
            .patch(
                &scope.name,
                &PatchParams::default(),
                &Patch::Merge(json!({
                    "metadata": {"labels": {labels::PROXMOX_ZONE: zone}},
                    "spec": {"providerID": provider_id},
                })),
            )
            .await?;
        scope.generation = patched.metadata.generation;
        Ok(())
    }

    /// Sockets, cores, memory, description, NICs and tags, and the boot disk size: each only if it differs.
    async fn configure(
        &self,
        scope: &mut Scope,
        placement: &Placement,
        proxmox: &ProxmoxClient,
        node: &str,
        vmid: u32,
        config: &VmConfig,
    ) -> Result<Configured, MachineError> {
        let spec = &self.machine.spec;
        let mut update = ConfigUpdate::default();
        let mut changed = false;
        let mut set = |key: &str, value: String| {
            if config.get(key).as_deref() != Some(value.as_str()) {
                update = std::mem::take(&mut update).set(key, &value);
                changed = true;
            }
        };
        if let Some(sockets) = spec.num_sockets {
            set("sockets", sockets.to_string());
        }
        if let Some(cores) = spec.num_cores {
            set("cores", cores.to_string());
        }
        if let Some(memory) = spec.memory_mib {
            set("memory", memory.to_string());
        }
        if let Some(description) = &spec.description {
            set("description", description.clone());
        }
        for nic in placement.network_devices() {
            let existing = config.get(&nic.name).unwrap_or_default();
            set(&nic.name, nic_value(&existing, nic));
        }
        if let Some(tags) = self.retagged(&config.tags()) {
            update = std::mem::take(&mut update).set("tags", tags);
            changed = true;
        }
        let mut configured = Configured::Unchanged;
        if changed {
            let update = update.digest(config.digest());
            // Synchronous: these settings need neither hotplug nor new storage.
            proxmox
                .update_vm_config_sync(node, vmid, &update)
                .await
                .during(|| format!("configuring VM {vmid} on {node}"))?;
            let macs_known = update
                .set
                .iter()
                .filter(|(key, _)| key.starts_with("net"))
                .all(|(_, value)| crate::cloudinit::mac_from_net_config(value).is_some());
            configured = Configured::Changed(macs_known.then(|| config.updated(&update)));
            self.event(
                scope,
                EventType::Normal,
                "Configured",
                &format!("configured VM {vmid}"),
            )
            .await;
        }
        if let Some(boot) = spec.disks.as_ref().and_then(|d| d.boot_volume.as_ref()) {
            let current_gb = config
                .get(&boot.disk)
                .and_then(|v| disk_size_gb(&v))
                .unwrap_or(0);
            let resized = scope
                .finished
                .as_ref()
                .is_some_and(|task| matches!(task.task_type.as_str(), "resize" | "qmresize"));
            if current_gb < u64::try_from(boot.size_gb).unwrap_or(0) && !resized {
                let started = proxmox
                    .resize_disk(node, vmid, &boot.disk, &format!("{}G", boot.size_gb), None)
                    .await;
                let step = self.submitted(scope, proxmox, started, || {
                    format!("resizing {} of VM {vmid} to {} GB", boot.disk, boot.size_gb)
                })?;
                return Ok(step.map_or(Configured::Changed(None), Configured::Waiting));
            }
        }
        Ok(configured)
    }

    /// The VM's tags with this machine's tag (in place of the tag of the machine a move or
    /// restore replaced) and `spec.tags`, if that differs from what it has.
    fn retagged(&self, current: &[String]) -> Option<String> {
        let ours = machine_tag(self.machine);
        let spec_tags = self.machine.spec.tags.clone().unwrap_or_default();
        let mut tags: Vec<String> = current
            .iter()
            .filter(|t| {
                !is_machine_tag(t)
                    || t.eq_ignore_ascii_case(&ours)
                    || spec_tags.iter().any(|s| s.eq_ignore_ascii_case(t))
            })
            .cloned()
            .collect();
        let kept = tags.len();
        let wanted = std::iter::once(ours).chain(spec_tags);
        for tag in wanted {
            if !tags.iter().any(|t| t.eq_ignore_ascii_case(&tag)) {
                tags.push(tag.to_ascii_lowercase());
            }
        }
        (tags.len() != kept || kept != current.len()).then(|| tags.join(";"))
    }

    /// Ensures one claim per (NIC, pool) and returns the bound addresses, or `None` while any is pending.
    async fn addresses(
        &self,
        scope: &Scope,
        placement: &Placement,
    ) -> Result<Option<Addresses>, MachineError> {
        let claims: Api<IPAddressClaim> =
            Api::namespaced(self.context.client.clone(), &scope.namespace);
        let reads = self.reads();
        let owner = OwnerReference {
            api_version: ProxmoxMachine::api_version(&()).into_owned(),
            kind: ProxmoxMachine::kind(&()).into_owned(),
            name: scope.name.clone(),
            uid: self.machine.metadata.uid.clone().unwrap_or_default(),
            controller: Some(true),
            block_owner_deletion: Some(true),
        };
        let mut result = Addresses::default();
        let mut pending = false;
        let mut default_entry = IpAddressesSpec {
            net: "default".into(),
            ..IpAddressesSpec::default()
        };
        for nic in placement.network_devices() {
            let mut entry = IpAddressesSpec {
                net: nic.name.clone(),
                ..IpAddressesSpec::default()
            };
            for pool in &nic.pools {
                let claim = match reads
                    .get::<IPAddressClaim>(&scope.namespace, &pool.claim_name)
                    .await?
                {
                    Some(claim) => claim,
                    None => {
                        let mut claim = IPAddressClaim::new(
                            &pool.claim_name,
                            capi::IpAddressClaimSpec {
                                pool_ref: IpPoolReference {
                                    api_group: pool.pool.api_group.clone(),
                                    kind: pool.pool.kind.clone(),
                                    name: pool.pool.name.clone(),
                                },
                                cluster_name: Some(scope.cluster_name.clone()),
                            },
                        );
                        claim.metadata.namespace = Some(scope.namespace.clone());
                        let mut claim_labels = BTreeMap::from([(
                            labels::CLUSTER_NAME.to_owned(),
                            scope.cluster_name.clone(),
                        )]);
                        if let Some(zone) = &pool.zone_label {
                            claim_labels.insert(labels::PROXMOX_ZONE.to_owned(), zone.clone());
                        }
                        claim.metadata.labels = Some(claim_labels);
                        let mut claim_annotations = BTreeMap::from([(
                            annotations::POOL_REF_COUNTER.to_owned(),
                            pool.index.to_string(),
                        )]);
                        if pool.default_gateway {
                            claim_annotations
                                .insert(annotations::DEFAULT_GATEWAY.to_owned(), "true".into());
                        }
                        claim.metadata.annotations = Some(claim_annotations);
                        claim.metadata.owner_references = Some(vec![owner.clone()]);
                        match claims.create(&PostParams::default(), &claim).await {
                            Ok(created) => Arc::new(created),
                            Err(kube::Error::Api(status)) if status.code == 409 => {
                                pending = true;
                                continue;
                            }
                            Err(error) => return Err(error.into()),
                        }
                    }
                };
                let Some(address_name) = claim
                    .status
                    .as_ref()
                    .and_then(|s| s.address_ref.as_ref())
                    .map(|r| r.name.clone())
                else {
                    pending = true;
                    continue;
                };
                let Some(address) = reads
                    .get::<IPAddress>(&scope.namespace, &address_name)
                    .await?
                else {
                    pending = true;
                    continue;
                };
                let parsed: Option<std::net::IpAddr> = address.spec.address.parse().ok();
                let is_v6 = parsed.is_some_and(|a| a.is_ipv6());
                let list = if is_v6 {
                    &mut entry.ipv6
                } else {
                    &mut entry.ipv4
                };
                list.push(address.spec.address.clone());
                if pool.default_gateway {
                    let list = if is_v6 {
                        &mut default_entry.ipv6
                    } else {
                        &mut default_entry.ipv4
                    };
                    list.push(address.spec.address.clone());
                }
                result.bound.push(BoundAddress {
                    nic: nic.name.clone(),
                    address: address.spec.address.clone(),
                    prefix: address.spec.prefix,
                    gateway: address.spec.gateway.clone(),
                    default_gateway: pool.default_gateway,
                    pool: pool.pool.clone(),
                });
            }
            result.status.push(entry);
        }
        if pending {
            return Ok(None);
        }
        if !default_entry.ipv4.is_empty() || !default_entry.ipv6.is_empty() {
            result.status.insert(0, default_entry);
        }
        Ok(Some(result))
    }

    #[allow(clippy::too_many_arguments)]
    async fn bootstrap(
        &self,
        scope: &mut Scope,
        placement: &Placement,
        proxmox: &ProxmoxClient,
        node: &str,
        vmid: u32,
        config: &VmConfig,
        secret_name: &str,
        addresses: Option<&Addresses>,
    ) -> Result<Option<Step>, MachineError> {
        let iso_name = crate::cloudinit::seed_iso_name(vmid);
        if config.get("ide0").is_some_and(|v| v.contains(&iso_name)) {
            return Ok(None);
        }
        // The upload this pass saw succeed: only the attachment is left.
        let image = if seed_iso_uploaded(scope, node) {
            None
        } else {
            let read;
            let addresses = match addresses {
                Some(addresses) => addresses,
                None => match self.addresses(scope, placement).await? {
                    Some(addresses) => {
                        read = addresses;
                        &read
                    }
                    None => return Ok(Some(waiting_for_addresses())),
                },
            };
            match self
                .seed_image(scope, placement, vmid, config, secret_name, addresses)
                .await?
            {
                Ok(image) => Some(image),
                Err(step) => return Ok(Some(step)),
            }
        };
        let storage = self
            .context
            .inventory
            .iso_storage(proxmox, node)
            .await
            .during(|| format!("listing the ISO storages of {node}"))?;
        let Some(storage) = storage else {
            return Ok(Some(waiting(
                "NoISOStorage",
                format!(
                    "node {node} has no storage with content type iso; enable iso content on one"
                ),
                Action::requeue(Duration::from_secs(60)),
            )));
        };
        if let Some(image) = image {
            let upload = proxmox.upload_iso(node, &storage, &iso_name, image).await;
            if let Some(step) = self.submitted(scope, proxmox, upload, || {
                format!("uploading the seed ISO {iso_name} to {storage} on {node}")
            })? {
                return Ok(Some(step));
            }
        }
        let attach =
            ConfigUpdate::default().set("ide0", format!("{storage}:iso/{iso_name},media=cdrom"));
        proxmox
            .update_vm_config_sync(node, vmid, &attach)
            .await
            .during(|| format!("attaching the seed ISO {iso_name} to VM {vmid}"))?;
        scope.status.bootstrap_data_provided = Some(true);
        self.event(
            scope,
            EventType::Normal,
            "BootstrapDataProvided",
            &format!("attached {storage}:iso/{iso_name} to VM {vmid}"),
        )
        .await;
        Ok(None)
    }

    /// The seed ISO for the machine's VM (bootstrap data, meta data and network config), or
    /// why it cannot be built yet.
    async fn seed_image(
        &self,
        scope: &Scope,
        placement: &Placement,
        vmid: u32,
        config: &VmConfig,
        secret_name: &str,
        addresses: &Addresses,
    ) -> Result<Result<Vec<u8>, Step>, MachineError> {
        let secret = Api::<Secret>::namespaced(self.context.client.clone(), &scope.namespace)
            .get_opt(secret_name)
            .await?;
        let Some(secret) = secret else {
            return Ok(Err(waiting(
                "WaitingForBootstrapData",
                format!("bootstrap Secret {secret_name} not found"),
                Action::requeue(Duration::from_secs(10)),
            )));
        };
        let data = secret.data.unwrap_or_default();
        let value = data.get("value").map(|v| v.0.clone()).unwrap_or_default();
        let format = data
            .get("format")
            .and_then(|v| String::from_utf8(v.0.clone()).ok())
            .unwrap_or_else(|| "cloud-config".into());
        let Some(uuid) = smbios_uuid(config) else {
            let retry =
                self.context
                    .retries
                    .failed(&failures::key(self.machine), &VM_CONFIG_BACKOFF, None);
            return Ok(Err(waiting_longer(
                "WaitingForVMConfig",
                format!("VM {vmid} has no SMBIOS UUID yet"),
                &retry,
            )));
        };
        let macs: BTreeMap<String, String> = placement
            .network_devices()
            .iter()
            .filter_map(|nic| {
                Some((
                    nic.name.clone(),
                    crate::cloudinit::mac_from_net_config(&config.get(&nic.name)?)?,
                ))
            })
            .collect();
        let bootstrap = match crate::cloudinit::BootstrapFormat::parse(Some(&format)) {
            Ok(format) => crate::cloudinit::BootstrapData { value, format },
            Err(error) => {
                return Ok(Err(waiting(
                    "BootstrapDataInvalid",
                    error.to_string(),
                    Action::requeue(Duration::from_secs(60)),
                )));
            }
        };
        let meta = crate::cloudinit::MetaData {
            instance_id: uuid.clone(),
            hostname: scope.name.clone(),
            provider_id: self
                .machine
                .spec
                .metadata_settings
                .as_ref()
                .is_some_and(|m| m.provider_id_injection)
                .then(|| crate::cloudinit::provider_id(&uuid)),
            kubernetes_version: None,
        };
        // Each pool's route metric, read once (only the seed ISO needs it).
        let mut metrics: BTreeMap<String, Option<u32>> = BTreeMap::new();
        let pool_key = |pool: &placement::PoolRef| format!("{}/{}", pool.kind, pool.name);
        for bound in &addresses.bound {
            if let std::collections::btree_map::Entry::Vacant(entry) =
                metrics.entry(pool_key(&bound.pool))
            {
                entry.insert(pool_metric(self.reads(), &scope.namespace, &bound.pool).await);
            }
        }
        let assigned: Vec<crate::cloudinit::NicAddresses> = placement
            .network_devices()
            .iter()
            .map(|nic| crate::cloudinit::NicAddresses {
                nic: nic.name.clone(),
                mac: macs.get(&nic.name).cloned().unwrap_or_default(),
                addresses: addresses
                    .bound
                    .iter()
                    .filter(|b| b.nic == nic.name)
                    .filter_map(|b| {
                        Some(crate::cloudinit::AssignedAddress {
                            address: b.address.parse().ok()?,
                            prefix: u8::try_from(b.prefix).ok()?,
                            gateway: b.gateway.as_deref().and_then(|g| g.parse().ok()),
                            default_route: b.default_gateway,
                            metric: metrics.get(&pool_key(&b.pool)).copied().flatten(),
                        })
                    })
                    .collect(),
            })
            .collect();
        Ok(
            match crate::cloudinit::render_nocloud(placement, &meta, &assigned, &bootstrap) {
                Ok(files) => Ok(crate::cloudinit::build_nocloud_iso(&files)),
                Err(error) => Err(waiting(
                    "BootstrapDataInvalid",
                    error.to_string(),
                    Action::requeue(Duration::from_secs(60)),
                )),
            },
        )
    }

    /// Deletes the cloud-init ISO (it holds the bootstrap token) once the node has joined, and
    /// only then detaches it: a failed deletion leaves it attached, so the next pass finds it
    /// and tries again. `Some`: the deletion task runs.
    async fn remove_iso(
        &self,
        scope: &mut Scope,
        proxmox: &ProxmoxClient,
        node: &str,
        vmid: u32,
        config: &VmConfig,
    ) -> Result<Option<Step>, MachineError> {
        let Some(ide0) = config.get("ide0") else {
            return Ok(None);
        };
        let iso_name = crate::cloudinit::seed_iso_name(vmid);
        let Some(volume) = ide0
            .split(',')
            .next()
            .filter(|v| v.contains(&iso_name))
            .map(str::to_owned)
        else {
            return Ok(None);
        };
        // The deletion this pass saw succeed: only the detachment is left.
        if !seed_iso_deleted(scope, node)
            && let Some(step) = self
                .delete_seed_iso(scope, proxmox, node, vmid, Some(volume))
                .await?
        {
            return Ok(Some(step));
        }
        detach_seed_iso(proxmox, node, vmid).await?;
        Ok(None)
    }

    /// Deletes the machine's VM (by the recorded VMID, else by its tag or `spec.providerID`)
    /// and releases the machine. Without its ProxmoxCluster, capmox's global credentials reach
    /// Proxmox; without those (or while Proxmox is out of reach) a machine that may have a VM
    /// keeps its finalizer and says why.
    async fn delete(&self, scope: &mut Scope, cluster_found: bool) -> Result<Action, MachineError> {
        // Nothing recorded means no clone was ever requested: the VMID is recorded first.
        let may_have_vm = scope.recorded_vmid.is_some() || self.machine.spec.provider_id.is_some();
        let proxmox = match self.deletion_client(scope, cluster_found).await? {
            Ok(client) => client,
            Err(blocked) if may_have_vm => {
                tracing::warn!(machine = %scope.name, reason = blocked.reason, "{}", blocked.message);
                self.warn_once(scope, blocked.reason, &blocked.message)
                    .await;
                self.deleting_status(scope, blocked.reason, blocked.message)
                    .await?;
                return Ok(Action::requeue(blocked.requeue));
            }
            Err(_) => return self.released(scope).await,
        };
        // A task in flight (this deletion's, or a provisioning task it waits out) first.
        if let Some(step) = self.tracked_task(scope, &proxmox, true).await? {
            return self.deletion_waits(scope, step).await;
        }
        // The Go provider recorded the VMID in the spec only: machines it created are deleted
        // by that VMID too (still only when the VM shows it is theirs).
        if let Some(vmid) = scope.recorded_vmid {
            if let Some(step) = self.delete_vm(scope, &proxmox, vmid).await? {
                return self.deletion_waits(scope, step).await;
            }
            if scope
                .finished
                .as_ref()
                .is_some_and(|t| t.task_type == "qmdestroy")
            {
                // The recorded VM was the machine's, and this deletion deleted it.
                return self.released(scope).await;
            }
        }
        // A VM the recorded VMID does not name: a status lost before the VMID was recorded, or
        // a machine re-created by a move or restore (found by its tag or provider ID).
        let resources = proxmox
            .cluster_resources(None)
            .await
            .during(|| "looking for the machine's VM in Proxmox".to_owned())?;
        let found = Identity::of(self.machine, &scope.name)
            .search(&proxmox, &self.configs, &resources, scope.recorded_vmid)
            .await?
            .and_then(|vm| vm.vmid);
        if let Some(vmid) = found
            && let Some(step) = self.delete_vm(scope, &proxmox, vmid).await?
        {
            return self.deletion_waits(scope, step).await;
        }
        self.released(scope).await
    }

    /// Reports what the deletion waits for (a task, a lock) and when it looks again.
    async fn deletion_waits(&self, scope: &mut Scope, step: Step) -> Result<Action, MachineError> {
        let (decided, action) = match step {
            Step::Stop(decided, action) | Step::Backoff(decided, action) => (decided, action),
            Step::Continue => return Ok(Action::requeue(Duration::from_millis(100))),
        };
        let reason = if decided.reason == "TaskFailed" {
            "TaskFailed"
        } else {
            "Deleting"
        };
        self.deleting_status(scope, reason, decided.message).await?;
        Ok(action)
    }

    /// The Proxmox client that deletes the machine's VM: with the ProxmoxCluster's credentials,
    /// or with capmox's global ones when the ProxmoxCluster is gone. `Err`: why there is none.
    async fn deletion_client(
        &self,
        scope: &Scope,
        cluster_found: bool,
    ) -> Result<Result<ProxmoxClient, Blocked>, MachineError> {
        let unavailable = |message: String| Blocked {
            reason: "ProxmoxUnavailable",
            message: format!(
                "cannot reach Proxmox to delete {}: {message}; retrying",
                self.recorded_vm(scope)
            ),
            requeue: Duration::from_secs(30),
        };
        if cluster_found {
            return Ok(self.proxmox_client(scope).await?.map_err(unavailable));
        }
        let cluster = format!("{}/{}", scope.namespace, scope.proxmox_cluster.name_any());
        Ok(match self.context.global_credentials.client_config() {
            Some(Ok(config)) => self
                .context
                .proxmox
                .get(&config)
                .map_err(|error| unavailable(error.to_string())),
            Some(Err(problem)) => Err(unavailable(format!(
                "the ProxmoxCluster {cluster} is gone and capmox's global credentials are unusable ({problem})"
            ))),
            None => Err(Blocked {
                reason: "ProxmoxClusterNotFound",
                message: format!(
                    "the ProxmoxCluster {cluster} is gone and capmox has no global credentials, so {} is kept; restore the ProxmoxCluster (and its credentials) to delete it, or delete the VM yourself and remove the finalizer {} from this ProxmoxMachine",
                    self.recorded_vm(scope),
                    finalizers::MACHINE
                ),
                requeue: Duration::from_secs(60),
            }),
        })
    }

    /// The machine's VM as its spec and status record it, for messages.
    fn recorded_vm(&self, scope: &Scope) -> String {
        let mut parts = Vec::new();
        if let Some(vmid) = scope.recorded_vmid {
            parts.push(format!("VM {vmid}"));
        }
        if let Some(node) = &scope.current.proxmox_node {
            parts.push(format!("on {node}"));
        }
        if let Some(provider_id) = &self.machine.spec.provider_id {
            parts.push(format!("({provider_id})"));
        }
        if parts.is_empty() {
            "its VM".to_owned()
        } else {
            format!("its {}", parts.join(" "))
        }
    }

    /// A Warning event, unless the machine reports `reason` already (one per episode, not one
    /// per pass).
    async fn warn_once(&self, scope: &Scope, reason: &str, message: &str) {
        let reported = scope
            .current
            .conditions
            .iter()
            .any(|c| c.type_ == PROVISIONED && c.reason == reason);
        if !reported {
            self.event(scope, EventType::Warning, reason, message).await;
        }
    }

    /// The machine's spec names a VM (`spec.providerID`) that Proxmox does not have: it waits
    /// and says so, instead of creating a second VM that would take the first one's place and
    /// addresses.
    async fn vm_not_found(&self, scope: &Scope, provider_id: &str) -> Step {
        const REASON: &str = "VirtualMachineNotFound";
        let message = format!(
            "spec.providerID is {provider_id}, but Proxmox has no VM named {} with that SMBIOS UUID{}; capmox never creates a second VM for a machine that has one. Bring the VM back (a restore must keep its name and SMBIOS UUID), or delete this machine",
            scope.name,
            self.machine
                .spec
                .virtual_machine_id
                .map(|vmid| format!(" (spec.virtualMachineID is {vmid})"))
                .unwrap_or_default()
        );
        self.warn_once(scope, REASON, &message).await;
        waiting(REASON, message, Action::requeue(Duration::from_secs(60)))
    }

    /// Deletes the machine's VM `vmid` and its seed ISO; `Some` while that has to wait.
    async fn delete_vm(
        &self,
        scope: &mut Scope,
        proxmox: &ProxmoxClient,
        vmid: u32,
    ) -> Result<Option<Step>, MachineError> {
        let finished = scope.finished.as_ref().map(|t| t.task_type.clone());
        if finished.as_deref() == Some("qmdestroy") {
            // Deleted by this deletion (its seed ISO first).
            return Ok(None);
        }
        // Where the VM is: the node in status, else wherever Proxmox says it moved.
        let mut located = None;
        if let Some(node) = scope.current.proxmox_node.clone() {
            match proxmox.vm_config(&node, vmid).await {
                Ok(config) => located = Some((node, config)),
                Err(error) if error.is_not_found() => {}
                Err(error) => {
                    return Err(error)
                        .during(|| format!("reading the config of VM {vmid} on {node}"));
                }
            }
        }
        if located.is_none()
            && let Some(node) = proxmox
                .find_vm(vmid)
                .await
                .during(|| format!("looking for VM {vmid} in Proxmox"))?
                .and_then(|vm| vm.node)
        {
            match proxmox.vm_config(&node, vmid).await {
                Ok(config) => located = Some((node, config)),
                Err(error) if error.is_not_found() => {}
                Err(error) => {
                    return Err(error)
                        .during(|| format!("reading the config of VM {vmid} on {node}"));
                }
            }
        }
        let Some((node, config)) = located else {
            // Gone already (deleted by someone else, or by an earlier pass whose record was
            // lost): its seed ISO may be left, since it is a separate volume.
            if let Some(node) = scope.current.proxmox_node.clone() {
                return self
                    .delete_seed_iso(scope, proxmox, &node, vmid, None)
                    .await;
            }
            return Ok(None);
        };
        if !Identity::of(self.machine, &scope.name).owns(&config, vmid) {
            tracing::warn!(machine = %scope.name, vmid, "VM belongs to someone else; not deleting it");
            return Ok(None);
        }
        if let Some(lock) = config.lock() {
            // A clone, a deletion of an earlier pass, a backup: Proxmox refuses to delete a
            // locked VM, so wait for the lock to go.
            return Ok(Some(waiting(
                "Deleting",
                format!(
                    "VM {vmid} on {node} is locked ({lock}); deleting it once the lock is released"
                ),
                Action::requeue(Duration::from_secs(1)),
            )));
        }
        let stopping = || format!("stopping VM {vmid} on {node}");
        // After this deletion's stop, the VM is known to be stopped.
        if finished.as_deref() != Some("qmstop")
            && proxmox
                .vm_status(&node, vmid)
                .await
                .during(stopping)?
                .is_running()
        {
            let started = proxmox.power(&node, vmid, PowerAction::Stop).await;
            if let Some(step) = self.submitted(scope, proxmox, started, stopping)? {
                return Ok(Some(step));
            }
        }
        // The seed ISO (it holds the bootstrap token) is a separate volume: the attached one,
        // while the config still names it; else, if the bootstrap data may have been uploaded
        // but never attached, the seed ISO's name on the node's ISO storage.
        if finished.as_deref() != Some("imgdel") {
            let attached = config
                .get("ide0")
                .and_then(|v| v.split(',').next().map(str::to_owned))
                .filter(|v| v.contains(&crate::cloudinit::seed_iso_name(vmid)));
            let maybe_unattached = scope.current.bootstrap_data_provided != Some(true);
            if (attached.is_some() || maybe_unattached)
                && let Some(step) = self
                    .delete_seed_iso(scope, proxmox, &node, vmid, attached)
                    .await?
            {
                return Ok(Some(step));
            }
        }
        let params = DeleteParams {
            purge: true,
            destroy_unreferenced_disks: true,
        };
        self.event(
            scope,
            EventType::Normal,
            "Deleting",
            &format!("deleting VM {vmid} on {node}"),
        )
        .await;
        let started = proxmox.delete_vm(&node, vmid, params).await;
        self.deletion_submitted(scope, proxmox, started, || {
            format!("deleting VM {vmid} on {node}")
        })
    }

    /// Deletes the seed ISO of `vmid`: the attached volume, or (when unknown) the seed name on
    /// the node's ISO storage. A missing ISO is fine; a failure fails the pass, so the machine
    /// is not released (and the ISO with its bootstrap token forgotten) before it is gone.
    async fn delete_seed_iso(
        &self,
        scope: &mut Scope,
        proxmox: &ProxmoxClient,
        node: &str,
        vmid: u32,
        attached: Option<String>,
    ) -> Result<Option<Step>, MachineError> {
        let seed = crate::cloudinit::seed_iso_name(vmid);
        let volume = match attached {
            Some(volume) => Some(volume).filter(|v| v.contains(&seed)),
            None => self
                .context
                .inventory
                .iso_storage(proxmox, node)
                .await
                .during(|| format!("listing the ISO storages of {node}"))?
                .map(|s| format!("{s}:iso/{seed}")),
        };
        let Some(volume) = volume else {
            return Ok(None);
        };
        let Some((storage, _)) = volume.split_once(':') else {
            return Ok(None);
        };
        let started = proxmox.delete_volume(node, storage, &volume).await;
        self.deletion_submitted(scope, proxmox, started, || {
            format!("deleting the seed ISO {volume} of VM {vmid}")
        })
    }

    /// `VirtualMachineProvisioned=False` with what the deletion waits for (`Deleting`) or what
    /// stopped it.
    async fn deleting_status(
        &self,
        scope: &mut Scope,
        reason: &str,
        message: String,
    ) -> Result<(), MachineError> {
        scope.status.conditions = conditions::merge(
            &scope.current.conditions,
            &[
                Decided::failed(api::conditions::PAUSED, "NotPaused", ""),
                Decided::failed(PROVISIONED, reason, message),
            ],
            scope.generation,
            Timestamp::now(),
        );
        self.write_status(&scope.api, &scope.name, &scope.current, &scope.status)
            .await
    }

    /// Writes the status a pass decided, unless the pass worked from a copy of the machine
    /// without a VMID in status while the stored machine has one: caches lag (after a watch
    /// expired, for one), and that copy's status would erase the VMID, node and task (with its
    /// back-off) a newer pass recorded before its clone request. Such a pass is stale instead
    /// and looked at again soon; the check costs one read, and only while no VMID is recorded.
    async fn write_status(
        &self,
        api: &Api<ProxmoxMachine>,
        name: &str,
        current: &ProxmoxMachineStatus,
        desired: &ProxmoxMachineStatus,
    ) -> Result<(), MachineError> {
        let read_without_vmid = self
            .machine
            .status
            .as_ref()
            .is_none_or(|s| s.virtual_machine_id.is_none());
        if current != desired
            && read_without_vmid
            && desired.virtual_machine_id.is_none()
            && api
                .get_opt(name)
                .await?
                .and_then(|stored| stored.status)
                .is_some_and(|stored| stored.virtual_machine_id.is_some())
        {
            return Err(ClusterError::Stale {
                kind: ProxmoxMachine::kind(&()).into_owned(),
                name: name.to_owned(),
            }
            .into());
        }
        apply_status(api, name, current, desired).await
    }

    /// Nothing is left in Proxmox: lets the object go.
    async fn released(&self, scope: &Scope) -> Result<Action, MachineError> {
        self.context.reservations.lock().await.release(&scope.name);
        cluster::release(&scope.api, self.machine, finalizers::MACHINE, None).await?;
        self.context.vmid_claims.release(&claim_key(self.machine));
        Ok(Action::await_change())
    }

    async fn event(&self, scope: &Scope, type_: EventType, reason: &str, note: &str) {
        match type_ {
            EventType::Normal => tracing::info!(machine = %scope.name, reason, "{note}"),
            EventType::Warning => tracing::warn!(machine = %scope.name, reason, "{note}"),
        }
        failures::publish_event(
            &self.context.client,
            FIELD_MANAGER,
            &self.machine.object_ref(&()),
            type_,
            reason,
            note,
        )
        .await;
    }
}

/// What [`Reconcile::configure`] did to the VM's config.
enum Configured {
    /// Nothing: the config is as the spec wants it.
    Unchanged,
    /// Changed it; what was read before is out of date. With the config as it is now, when
    /// Proxmox took every value as sent (a NIC without a MAC gets one from Proxmox, so its
    /// config must be read again).
    Changed(Option<VmConfig>),
    /// Started a task (a disk resize) that the machine waits for.
    Waiting(Step),
}

/// Why a deletion cannot reach Proxmox, reported on the machine.
struct Blocked {
    reason: &'static str,
    message: String,
    requeue: Duration,
}

/// The VMID [`Reconcile::pick_vmid`] chose.
enum Picked {
    /// Free, and claimed for the machine.
    Vmid(u32),
    /// The recorded VMID, in use in Proxmox but not listed yet.
    Unlisted(u32),
    /// None is free.
    Exhausted,
}

/// Addresses bound to the machine's claims.
#[derive(Default)]
struct Addresses {
    /// `status.ipAddresses`: `default` first, then one entry per NIC.
    status: Vec<IpAddressesSpec>,
    /// Every bound address with its NIC, for cloud-init.
    bound: Vec<BoundAddress>,
}

/// One bound address of a NIC.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BoundAddress {
    /// `netN`.
    pub nic: String,
    /// The address.
    pub address: String,
    /// Prefix length.
    pub prefix: i32,
    /// Gateway of its pool.
    pub gateway: Option<String>,
    /// From a default pool: its gateway carries the default route.
    pub default_gateway: bool,
    /// The pool it came from (whose annotation may carry the default route's metric).
    pub pool: placement::PoolRef,
}

/// The gateway metric a pool carries in its annotation (the cluster's pools have one).
async fn pool_metric(reads: Reads<'_>, namespace: &str, pool: &placement::PoolRef) -> Option<u32> {
    if pool.kind != placement::IN_CLUSTER_IP_POOL_KIND {
        return None;
    }
    let found = reads
        .get::<capi::InClusterIPPool>(namespace, &pool.name)
        .await
        .ok()??;
    found
        .annotations()
        .get(annotations::GATEWAY_METRIC)?
        .parse()
        .ok()
}

fn machine_addresses(name: &str, addresses: &[IpAddressesSpec]) -> Vec<MachineAddress> {
    let mut out = vec![MachineAddress {
        type_: MachineAddressType::Hostname,
        address: name.to_owned(),
    }];
    if let Some(default) = addresses.iter().find(|a| a.net == "default") {
        for address in default.ipv4.iter().chain(&default.ipv6) {
            out.push(MachineAddress {
                type_: MachineAddressType::InternalIp,
                address: address.clone(),
            });
        }
    }
    out
}

/// The `netN` value for a NIC, keeping the MAC Proxmox assigned.
fn nic_value(existing: &str, nic: &placement::ResolvedNic) -> String {
    let model = serde_json::to_value(nic.model)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_else(|| "virtio".into());
    let mac = crate::proxmox::NetDevice::parse(0, existing).mac;
    let mut value = match mac {
        Some(mac) => format!("{model}={mac}"),
        None => model,
    };
    if let Some(bridge) = &nic.bridge {
        value.push_str(&format!(",bridge={bridge}"));
    }
    if let Some(mtu) = nic.mtu {
        value.push_str(&format!(",mtu={mtu}"));
    }
    if let Some(queues) = nic.queues {
        value.push_str(&format!(",queues={queues}"));
    }
    if let Some(vlan) = nic.vlan {
        value.push_str(&format!(",tag={vlan}"));
    }
    value
}

/// Size in GB of a disk value like `ceph:vm-100-disk-0,size=10G`.
fn disk_size_gb(value: &str) -> Option<u64> {
    let size = value
        .split(',')
        .find_map(|part| part.strip_prefix("size="))?;
    let (number, unit) = size.split_at(
        size.find(|c: char| !c.is_ascii_digit())
            .unwrap_or(size.len()),
    );
    let number: u64 = number.parse().ok()?;
    Some(match unit {
        "T" => number * 1024,
        "G" | "" => number,
        "M" => number / 1024,
        "K" => number / (1024 * 1024),
        _ => return None,
    })
}

/// The SMBIOS UUID of a VM (`smbios1: uuid=...`): its instance ID and provider ID.
pub fn smbios_uuid(config: &VmConfig) -> Option<String> {
    crate::cloudinit::instance_id_from_smbios(&config.get("smbios1")?)
}

/// The VMs (by machine and VMID) whose seed ISO this process saw removed, so later passes of a
/// provisioned machine need not read its config to look for it. A restarted process looks once
/// per machine.
#[derive(Clone, Default)]
pub struct SeedIsosRemoved(Arc<std::sync::Mutex<std::collections::HashSet<(String, u32)>>>);

impl SeedIsosRemoved {
    /// Most VMs remembered; past it, the memory starts over (each machine looks once more).
    const MAX: usize = 100_000;

    fn contains(&self, machine: &str, vmid: u32) -> bool {
        self.lock().contains(&(machine.to_owned(), vmid))
    }

    fn insert(&self, machine: &str, vmid: u32) {
        let mut removed = self.lock();
        if removed.len() >= Self::MAX {
            removed.clear();
        }
        removed.insert((machine.to_owned(), vmid));
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, std::collections::HashSet<(String, u32)>> {
        // Every update is a single insert or clear: a poisoned lock holds a usable set.
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Whether this pass saw the seed ISO's upload to `node` end.
fn seed_iso_uploaded(scope: &Scope, node: &str) -> bool {
    scope
        .finished
        .as_ref()
        .is_some_and(|task| task.task_type == "imgcopy" && task.node == node)
}

/// Whether this pass saw the seed ISO's deletion on `node` end.
fn seed_iso_deleted(scope: &Scope, node: &str) -> bool {
    scope
        .finished
        .as_ref()
        .is_some_and(|task| task.task_type == "imgdel" && task.node == node)
}

/// Takes the seed ISO's drive off the VM (Proxmox ignores the removal of a drive it does not
/// have).
async fn detach_seed_iso(
    proxmox: &ProxmoxClient,
    node: &str,
    vmid: u32,
) -> Result<(), MachineError> {
    proxmox
        .update_vm_config_sync(node, vmid, &ConfigUpdate::default().delete("ide0"))
        .await
        .during(|| format!("detaching the seed ISO from VM {vmid}"))?;
    Ok(())
}

/// The status fields this controller owns, as currently recorded.
fn owned_status(current: &ProxmoxMachineStatus) -> ProxmoxMachineStatus {
    current.clone()
}

fn paused_conditions(
    current: &ProxmoxMachineStatus,
    generation: Option<i64>,
) -> Vec<k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition> {
    let mut kept: Vec<_> = current
        .conditions
        .iter()
        .filter(|c| c.type_ != api::conditions::PAUSED)
        .cloned()
        .collect();
    let merged = conditions::merge(
        &current.conditions,
        &[Decided::ok(
            api::conditions::PAUSED,
            "Paused",
            "reconciliation is paused by the Cluster or an annotation",
        )],
        generation,
        Timestamp::now(),
    );
    kept.extend(
        merged
            .into_iter()
            .filter(|c| c.type_ == api::conditions::PAUSED),
    );
    kept.sort_by(|a, b| a.type_.cmp(&b.type_));
    kept
}

/// Writes the whole status, refused with 409 Conflict unless the object still has
/// `resource_version` (when given): for writes that must not be based on a stale view.
async fn apply_status_guarded(
    api: &Api<ProxmoxMachine>,
    name: &str,
    desired: &ProxmoxMachineStatus,
    resource_version: Option<&str>,
) -> Result<(), MachineError> {
    let mut body = json!({
        "apiVersion": ProxmoxMachine::api_version(&()),
        "kind": ProxmoxMachine::kind(&()),
        "status": desired,
    });
    if let Some(version) = resource_version {
        body["metadata"] = json!({"resourceVersion": version});
    }
    api.patch_status(
        name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(body),
    )
    .await?;
    Ok(())
}

async fn apply_status(
    api: &Api<ProxmoxMachine>,
    name: &str,
    current: &ProxmoxMachineStatus,
    desired: &ProxmoxMachineStatus,
) -> Result<(), MachineError> {
    if current == desired {
        return Ok(());
    }
    apply_status_guarded(api, name, desired, None).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn disk_sizes_parse_in_gb() {
        assert_eq!(disk_size_gb("ceph:vm-100-disk-0,size=10G"), Some(10));
        assert_eq!(
            disk_size_gb("local:100/vm-100-disk-0.qcow2,discard=on,size=1T"),
            Some(1024)
        );
        assert_eq!(disk_size_gb("ceph:vm-100-disk-0"), None);
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
