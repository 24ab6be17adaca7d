//! The ProxmoxCluster reconciler: the InfraCluster half of the CAPI v1beta2 contract.
//!
//! Each reconcile observes the ProxmoxCluster, its owner `Cluster`, the credentials and Proxmox,
//! then writes what it owns with server-side apply (field manager [`FIELD_MANAGER`]):
//! `status.conditions` (`Ready`, `Paused`, `ProxmoxAvailable`, `FailureDomainsReady`),
//! `status.initialization`, `status.failureDomains`, `status.inClusterIPPoolRef`,
//! `status.inClusterZoneRef`, and one `InClusterIPPool` per family for the cluster and for each
//! zone with its own IP config. `status.nodeLocations` is never written here.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, ObjectMeta, OwnerReference};
use k8s_openapi::jiff::Timestamp;
use kube::api::{ListParams, Patch, PatchParams};
use kube::runtime::controller::{Action, Config as ControllerConfig, Controller};
use kube::runtime::events::EventType;
use kube::runtime::reflector::{self, ObjectRef};
use kube::runtime::watcher;
use kube::{Api, Resource, ResourceExt};
use tokio_util::sync::CancellationToken;

use super::Context;
pub use super::cluster_conditions::PLAIN_HTTP;
use super::cluster_conditions::{self, ClusterSeen, EndpointFailure, EndpointSeen};
use super::conditions::{self, Decided};
use super::credentials::{client_config, release_secret};
use super::failures::{self, Pass};
use super::guarded::{STALE_RETRY, WriteError, cluster_owner_reference, ensure_finalizer, release};
use super::zone_health::{self, ZoneSeen};
use crate::api::{
    self, InClusterZoneRef, Initialization, LocalObjectReference, ProxmoxCluster,
    ProxmoxClusterStatus, ProxmoxMachine, annotations, finalizers, labels,
};
use crate::capi::{self, InClusterIPPool, PoolAddresses};
use crate::placement::{self, ClusterPool, IpFamily, ZonesByCredentials};
use crate::proxmox::{NodeState, ProxmoxClient, ResourceFilter};

/// Field manager of everything this controller writes.
pub const FIELD_MANAGER: &str = "capmox-proxmoxcluster";
/// Controller name in metrics and logs.
pub const CONTROLLER: &str = "proxmoxcluster";

/// How soon a cluster that waits on something not watched (machines going away) is retried.
const SHORT_RETRY: Duration = Duration::from_secs(2);

/// How soon a cluster whose zone rules a machine changed under its edit writes them again.
const HA_ZONES_RETRY: Duration = Duration::from_secs(1);

/// Why a reconcile failed; it is retried with back-off.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// The reconcile panicked (a bug); the object is retried with back-off.
    #[error(transparent)]
    Panicked(#[from] super::metrics::Panicked),
    /// A Kubernetes API call failed.
    #[error("Kubernetes API error: {0}")]
    Kube(#[from] kube::Error),
    /// An object could not be converted to or from JSON.
    #[error("cannot encode object: {0}")]
    Json(#[from] serde_json::Error),
    /// The object lacks a name or namespace (never true for objects read from the API).
    #[error("ProxmoxCluster without name or namespace")]
    MissingIdentity,
    /// A guarded write failed, or found the object changed since it was read.
    #[error(transparent)]
    Write(#[from] WriteError),
}

impl ClusterError {
    /// Whether the pass only saw an outdated copy (no failure to report or back off from).
    pub fn is_stale(&self) -> bool {
        matches!(self, Self::Write(write) if write.is_stale())
    }

    /// Whether the pass failed because the ProxmoxCluster itself is gone (its deletion finished
    /// while the pass ran): nothing is left to retry.
    pub fn is_gone(&self, cluster: &ProxmoxCluster) -> bool {
        let Self::Kube(kube::Error::Api(status)) = self else {
            return false;
        };
        status.is_not_found()
            && status.details.as_ref().is_some_and(|details| {
                details.kind == "proxmoxclusters"
                    && Some(details.name.as_str()) == cluster.metadata.name.as_deref()
            })
    }
}

/// Runs the controller until `shutdown` is cancelled.
pub async fn run(context: Arc<Context>, shutdown: CancellationToken) {
    let client = context.client.clone();
    let (clusters, capi_clusters, pools): (
        Api<ProxmoxCluster>,
        Api<capi::Cluster>,
        Api<InClusterIPPool>,
    ) = match &context.config.watch_namespace {
        Some(ns) => (
            Api::namespaced(client.clone(), ns),
            Api::namespaced(client.clone(), ns),
            Api::namespaced(client.clone(), ns),
        ),
        None => (
            Api::all(client.clone()),
            Api::all(client.clone()),
            Api::all(client.clone()),
        ),
    };
    let config = ControllerConfig::default().concurrency(context.config.cluster_concurrency);
    let controller = Controller::new(clusters, context.config.shard_watch());
    // The owners' store is written before their change wakes a pass, so a pass never reads an
    // owner older than the change that woke it.
    let (owners, owners_writer) = reflector::store();
    let owners_watch = super::caches::reflected(
        capi_clusters,
        context.config.shard_watch(),
        owners_writer,
        || {},
    );
    let context = Arc::new(Context {
        capi_clusters: Some(owners),
        ..(*context).clone()
    });
    super::report_cache_sync(controller.store(), context.readiness.clone(), CONTROLLER);
    let queue = context.metrics.work_queue(CONTROLLER);
    queue.observe(controller.store());
    let (pool_queue, cluster_queue) = (queue.clone(), queue);
    controller
        // Owned pools wake their ProxmoxCluster (as `owns` would), noted on the work queue.
        .watches_stream(super::caches::trigger_watch(pools, watcher::Config::default()), move |pool| {
            pool_queue.wake(super::owners::<ProxmoxCluster>(&pool))
        })
        .watches_stream(owners_watch, move |cluster| {
            let reference = cluster.spec.infrastructure_ref.as_ref();
            cluster_queue.wake(reference.filter(|r| r.kind == "ProxmoxCluster" && r.api_group == api::GROUP).map(|reference| {
                ObjectRef::new(&reference.name).within(cluster.namespace().as_deref().unwrap_or_default())
            }))
        })
        .with_config(config)
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
    cluster: Arc<ProxmoxCluster>,
    error: &ClusterError,
    context: Arc<Context>,
) -> Action {
    if error.is_stale() {
        tracing::debug!(controller = CONTROLLER, %error, "pass saw a stale copy");
        return Action::requeue(STALE_RETRY);
    }
    if error.is_gone(&cluster) {
        tracing::debug!(controller = CONTROLLER, %error, "the ProxmoxCluster is gone");
        return Action::await_change();
    }
    failures::after_error(&context.retries, CONTROLLER, &*cluster, error)
}

/// One reconcile, with its duration and outcome recorded in the metrics.
pub async fn reconcile(
    cluster: Arc<ProxmoxCluster>,
    context: Arc<Context>,
) -> Result<Action, ClusterError> {
    let pass = context
        .metrics
        .measure(CONTROLLER, &*cluster, reconcile_inner(&cluster, &context))
        .await?;
    Ok(context.retries.settle(&failures::key(&*cluster), pass))
}

async fn reconcile_inner(
    cluster: &ProxmoxCluster,
    context: &Context,
) -> Result<Pass, ClusterError> {
    let namespace = cluster.namespace().ok_or(ClusterError::MissingIdentity)?;
    let name = cluster
        .metadata
        .name
        .clone()
        .ok_or(ClusterError::MissingIdentity)?;
    let api: Api<ProxmoxCluster> = Api::namespaced(context.client.clone(), &namespace);

    let Some(owner) = owner_cluster_name(cluster) else {
        tracing::info!(cluster = %name, "waiting for the CAPI Cluster controller to set the owner reference");
        return Ok(Pass::Done(Action::await_change()));
    };
    let Some(capi_cluster) = owner_cluster(context, &namespace, &owner).await? else {
        tracing::info!(cluster = %name, owner = %owner, "owner Cluster not found yet");
        return Ok(Pass::Done(Action::requeue(SHORT_RETRY)));
    };

    let current = cluster.status.clone().unwrap_or_default();
    if is_paused(cluster, &capi_cluster) {
        // Nothing but the Paused condition is written while paused, and only once.
        if conditions::is_true(&current.conditions, api::conditions::PAUSED) {
            return Ok(Pass::Done(Action::await_change()));
        }
        let mut status = owned_status(&current);
        status.conditions = with_paused(&current.conditions, true, cluster.metadata.generation);
        apply_status_if_changed(&api, &name, &current, status).await?;
        return Ok(Pass::Done(Action::await_change()));
    }

    if cluster.metadata.deletion_timestamp.is_some() {
        return reconcile_delete(cluster, context, &namespace, &name, &owner)
            .await
            .map(Pass::Done);
    }

    reconcile_live(cluster, context, &api, &namespace, &name, current).await
}

/// The CAPI Cluster `namespace/name` from the controller's store, or from the API server
/// outside the controller.
async fn owner_cluster(
    context: &Context,
    namespace: &str,
    name: &str,
) -> Result<Option<Arc<capi::Cluster>>, kube::Error> {
    match &context.capi_clusters {
        Some(store) => Ok(store.get(&ObjectRef::new(name).within(namespace))),
        None => Ok(
            Api::<capi::Cluster>::namespaced(context.client.clone(), namespace)
                .get_opt(name)
                .await?
                .map(Arc::new),
        ),
    }
}

/// A pass over a live, unpaused cluster: finalizer, failure domains, pools, the checks of every
/// Proxmox it uses, and the status they decide.
async fn reconcile_live(
    cluster: &ProxmoxCluster,
    context: &Context,
    api: &Api<ProxmoxCluster>,
    namespace: &str,
    name: &str,
    current: ProxmoxClusterStatus,
) -> Result<Pass, ClusterError> {
    ensure_finalizer(api, cluster, finalizers::CLUSTER).await?;

    let mut status = owned_status(&current);
    let zone_problem = domains_and_pools(context, cluster, namespace, &mut status).await?;

    // Credentials and reachability of every Proxmox the zones use (one unless zones name
    // credentials of their own), checked side by side: one that does not answer holds up no
    // other's report.
    let groups = placement::zones_by_credentials(cluster);
    let reports: Vec<EndpointReport> = futures::future::try_join_all(
        groups
            .iter()
            .map(|group| check_endpoint(context, cluster, namespace, group)),
    )
    .await?;
    let endpoints: Vec<EndpointSeen> = reports.iter().map(EndpointReport::seen).collect();
    let seen = ClusterSeen {
        zone_problem,
        zones: zones_seen(context, cluster, &current, &endpoints),
        holds: context.config.zone_holds,
        endpoints,
        endpoint_known: control_plane_endpoint_known(cluster),
        plain_http_reported: current
            .conditions
            .iter()
            .any(|c| c.type_ == api::conditions::PROXMOX_AVAILABLE && c.reason == PLAIN_HTTP),
        ha_enabled: crate::placement::ha_enabled_anywhere(&cluster.spec),
    };
    let plan = cluster_conditions::plan(&seen);
    let mut ha_zones_synced = true;
    for report in plan.sync_ha.iter().filter_map(|&i| reports.get(i)) {
        if let EndpointState::Available { proxmox, .. } = &report.state {
            ha_zones_synced &=
                sync_ha_zones(context, proxmox, cluster, report.group, namespace, name).await;
        }
    }
    let mut requeue = match &plan.backoff {
        Some((reason, message, retry_after)) => {
            back_off(context, cluster, name, reason, message, *retry_after).await
        }
        None => plan.requeue,
    };
    if !ha_zones_synced {
        requeue = requeue.min(HA_ZONES_RETRY);
    }
    if let Some(message) = &plan.plain_http_warning {
        tracing::warn!(cluster = %name, "Proxmox is reached over plain HTTP; the API token is sent unencrypted");
        failures::publish_event(
            &context.client,
            FIELD_MANAGER,
            &cluster.object_ref(&()),
            EventType::Warning,
            PLAIN_HTTP,
            message,
        )
        .await;
    }
    let status = planned_status(cluster, &current, status, &plan);
    apply_status_if_changed(api, name, &current, status).await?;
    Ok(if plan.proxmox_failed {
        Pass::BackingOff(Action::requeue(requeue))
    } else {
        Pass::Done(Action::requeue(requeue))
    })
}

/// The status `plan` decides over what the pass recorded (`status`: domains and pools).
fn planned_status(
    cluster: &ProxmoxCluster,
    current: &ProxmoxClusterStatus,
    mut status: ProxmoxClusterStatus,
    plan: &cluster_conditions::ClusterPlan,
) -> ProxmoxClusterStatus {
    for domain in &mut status.failure_domains {
        if plan.drained.contains(&domain.name) {
            domain.control_plane = Some(false);
        }
    }
    if plan.provisioned {
        status.initialization = Some(Initialization {
            provisioned: Some(true),
        });
    } else if !Initialization::provisioned(status.initialization.as_ref()) {
        status.initialization = None;
    }
    let mut decided = vec![Decided::failed(api::conditions::PAUSED, "NotPaused", "")];
    decided.extend(plan.decided.iter().cloned());
    status.conditions = conditions::merge(
        &current.conditions,
        &decided,
        cluster.metadata.generation,
        Timestamp::now(),
    );
    status
}

/// Each zone's health as the pass saw it, timed by the zone states the context keeps.
fn zones_seen(
    context: &Context,
    cluster: &ProxmoxCluster,
    current: &ProxmoxClusterStatus,
    endpoints: &[EndpointSeen],
) -> Vec<ZoneSeen> {
    let key = format!(
        "{}/{}",
        cluster.namespace().unwrap_or_default(),
        cluster.name_any()
    );
    zone_health::zone_problems(endpoints)
        .into_iter()
        .map(|(zone, problem)| {
            let eligible_by_spec = placement::offered_to_control_plane(cluster, &zone);
            let published_out = current
                .failure_domains
                .iter()
                .any(|d| d.name == zone && d.control_plane == Some(false));
            ZoneSeen {
                in_state_for: context.zone_states.observe(&key, &zone, problem.is_none()),
                drained: eligible_by_spec && published_out,
                eligible_by_spec,
                problem,
                zone,
            }
        })
        .collect()
}

/// The cluster's failure domains (a bad zone configuration keeps the last good list; why it is
/// bad is returned) and its IP pools, for the cluster and each zone with its own IP config.
async fn domains_and_pools(
    context: &Context,
    cluster: &ProxmoxCluster,
    namespace: &str,
    status: &mut ProxmoxClusterStatus,
) -> Result<Option<String>, ClusterError> {
    let zone_problem = match placement::failure_domains(cluster) {
        Ok(domains) => {
            status.failure_domains = domains;
            None
        }
        Err(error) => Some(error.to_string()),
    };
    let desired_pools = placement::cluster_pools(cluster);
    reconcile_pools(context, cluster, namespace, &desired_pools).await?;
    record_pools(status, &desired_pools);
    Ok(zone_problem)
}

/// Whether `spec.controlPlaneEndpoint` has a host and a port: CAPI may not proceed before.
fn control_plane_endpoint_known(cluster: &ProxmoxCluster) -> bool {
    cluster
        .spec
        .control_plane_endpoint
        .as_ref()
        .is_some_and(|endpoint| {
            endpoint.host.as_deref().is_some_and(|h| !h.is_empty()) && endpoint.port.is_some()
        })
}

/// One more failure in the cluster's streak for a Proxmox that failed on its own account: a
/// Warning event when the streak starts or its reason changes. When to look again.
async fn back_off(
    context: &Context,
    cluster: &ProxmoxCluster,
    name: &str,
    reason: &'static str,
    message: &str,
    retry_after: Duration,
) -> Duration {
    let retry = context.retries.failed(
        &failures::key(cluster),
        &failures::PROXMOX_BACKOFF,
        Some(reason),
    );
    let requeue = retry.delay.max(retry_after);
    if retry.news {
        tracing::warn!(cluster = %name, reason, "{message}");
        failures::publish_event(
            &context.client,
            FIELD_MANAGER,
            &cluster.object_ref(&()),
            EventType::Warning,
            reason,
            message,
        )
        .await;
    } else {
        tracing::warn!(cluster = %name, reason, failures = retry.failures, retry_in_ms = failures::millis(requeue), "Proxmox check failed again; backing off: {message}");
    }
    requeue
}

/// Name of the owning CAPI Cluster, from the owner references CAPI sets.
pub(super) fn owner_cluster_name(cluster: &ProxmoxCluster) -> Option<String> {
    cluster
        .owner_references()
        .iter()
        .find(|o| {
            o.kind == "Cluster"
                && o.api_version
                    .starts_with(&format!("{}/", capi::CLUSTER_API_GROUP))
        })
        .map(|o| o.name.clone())
}

/// Paused by the CAPI Cluster (`spec.paused`, used by `clusterctl move`) or by annotation.
pub fn is_paused(cluster: &ProxmoxCluster, capi_cluster: &capi::Cluster) -> bool {
    capi_cluster.spec.paused == Some(true)
        || cluster.annotations().contains_key(annotations::PAUSED)
        || capi_cluster.annotations().contains_key(annotations::PAUSED)
}

/// The status fields this controller owns, as currently recorded.
fn owned_status(current: &ProxmoxClusterStatus) -> ProxmoxClusterStatus {
    ProxmoxClusterStatus {
        conditions: current
            .conditions
            .iter()
            .filter(|c| OWNED_CONDITIONS.contains(&c.type_.as_str()))
            .cloned()
            .collect(),
        initialization: current.initialization.clone(),
        failure_domains: current.failure_domains.clone(),
        in_cluster_ip_pool_ref: current.in_cluster_ip_pool_ref.clone(),
        in_cluster_zone_ref: current.in_cluster_zone_ref.clone(),
        node_locations: None,
    }
}

const OWNED_CONDITIONS: &[&str] = &[
    api::conditions::READY,
    api::conditions::PAUSED,
    api::conditions::PROXMOX_AVAILABLE,
    api::conditions::FAILURE_DOMAINS_READY,
    zone_health::FAILURE_DOMAINS_AVAILABLE,
    "ControlPlaneEndpointAvailable",
];

/// The owned conditions with `Paused` set, keeping every other condition as it was.
fn with_paused(current: &[Condition], paused: bool, generation: Option<i64>) -> Vec<Condition> {
    let decided = if paused {
        Decided::ok(
            api::conditions::PAUSED,
            "Paused",
            "reconciliation is paused by the Cluster or an annotation",
        )
    } else {
        Decided::failed(api::conditions::PAUSED, "NotPaused", "")
    };
    with_condition(current, decided, generation)
}

/// The owned conditions with `decided` set, keeping every other condition as it was.
fn with_condition(
    current: &[Condition],
    decided: Decided,
    generation: Option<i64>,
) -> Vec<Condition> {
    let type_ = decided.type_;
    let mut conditions: Vec<Condition> = current
        .iter()
        .filter(|c| OWNED_CONDITIONS.contains(&c.type_.as_str()) && c.type_ != type_)
        .cloned()
        .collect();
    let previous: Vec<Condition> = current
        .iter()
        .filter(|c| c.type_ == type_)
        .cloned()
        .collect();
    // `merge` adds a Ready summary of what it is given; keep the recorded Ready instead.
    let merged = conditions::merge(&previous, &[decided], generation, Timestamp::now());
    conditions.extend(merged.into_iter().filter(|c| c.type_ == type_));
    conditions.sort_by(|a, b| a.type_.cmp(&b.type_));
    conditions
}

async fn apply_status_if_changed(
    api: &Api<ProxmoxCluster>,
    name: &str,
    current: &ProxmoxClusterStatus,
    desired: ProxmoxClusterStatus,
) -> Result<(), ClusterError> {
    if owned_status(current) == desired {
        return Ok(());
    }
    super::apply_status(api, name, FIELD_MANAGER, &desired).await?;
    Ok(())
}

async fn reconcile_delete(
    cluster: &ProxmoxCluster,
    context: &Context,
    namespace: &str,
    name: &str,
    capi_cluster: &str,
) -> Result<Action, ClusterError> {
    let api: Api<ProxmoxCluster> = Api::namespaced(context.client.clone(), namespace);
    let remaining = cluster_machines(context, namespace, capi_cluster).await?;
    if !remaining.is_empty() {
        // Their deletion needs this cluster's credentials: it goes last.
        const SHOWN: usize = 10;
        let mut message = format!(
            "waiting for the ProxmoxMachines {} to be deleted",
            remaining
                .iter()
                .take(SHOWN)
                .map(String::as_str)
                .collect::<Vec<_>>()
                .join(", ")
        );
        if remaining.len() > SHOWN {
            message.push_str(&format!(" and {} more", remaining.len() - SHOWN));
        }
        tracing::info!(cluster = %name, machines = remaining.len(), "{message}");
        let current = cluster.status.clone().unwrap_or_default();
        let mut status = owned_status(&current);
        status.conditions = with_condition(
            &current.conditions,
            Decided::failed(api::conditions::READY, "Deleting", message),
            cluster.metadata.generation,
        );
        apply_status_if_changed(&api, name, &current, status).await?;
        return Ok(Action::requeue(SHORT_RETRY));
    }
    // The cluster's credentials Secret and those of its zones.
    for reference in placement::credentials_secrets(cluster) {
        release_secret(context, cluster, namespace, reference).await?;
    }
    release(&api, cluster, Some(finalizers::CLUSTER), None).await?;
    context.zone_states.forget(&format!("{namespace}/{name}"));
    tracing::info!(cluster = %name, "released; IP pools go with owner garbage collection");
    Ok(Action::await_change())
}

/// The ProxmoxMachines of the CAPI cluster `capi_cluster`, by name: those labelled with its
/// name, and those without the label whose owner Machine names it in `spec.clusterName` (CAPI
/// sets the label from that field, so the two agree where both exist). A machine with neither
/// cannot be told to be this cluster's.
async fn cluster_machines(
    context: &Context,
    namespace: &str,
    capi_cluster: &str,
) -> Result<Vec<String>, ClusterError> {
    let machines = Api::<ProxmoxMachine>::namespaced(context.client.clone(), namespace)
        .list_metadata(&ListParams::default())
        .await?
        .items;
    let unlabelled = machines
        .iter()
        .any(|m| !m.labels().contains_key(labels::CLUSTER_NAME));
    let owners: BTreeSet<String> = if unlabelled {
        Api::<capi::Machine>::namespaced(context.client.clone(), namespace)
            .list(&ListParams::default())
            .await?
            .items
            .into_iter()
            .filter(|m| m.spec.cluster_name == capi_cluster)
            .filter_map(|m| m.metadata.name)
            .collect()
    } else {
        BTreeSet::new()
    };
    Ok(machines
        .iter()
        .filter(|m| belongs_to(&m.metadata, capi_cluster, &owners))
        .map(|m| m.name_any())
        .collect())
}

/// Whether the ProxmoxMachine with `meta` is the CAPI cluster `capi_cluster`'s: by its
/// cluster-name label, or (without one) by an owner Machine among `owners`, the Machines whose
/// `spec.clusterName` is that cluster.
fn belongs_to(meta: &ObjectMeta, capi_cluster: &str, owners: &BTreeSet<String>) -> bool {
    match meta
        .labels
        .as_ref()
        .and_then(|l| l.get(labels::CLUSTER_NAME))
    {
        Some(label) => label == capi_cluster,
        None => meta.owner_references.iter().flatten().any(|o| {
            o.kind == "Machine"
                && o.api_version
                    .starts_with(&format!("{}/", capi::CLUSTER_API_GROUP))
                && owners.contains(&o.name)
        }),
    }
}

/// Keeps the nodes of the cluster's HA zone rules (PVE 9) or groups (PVE 8) equal to its
/// zones' nodes after zone edits; failures and refusals are logged and retried next pass.
/// False when a machine changed the rules meanwhile, so the pass after it should come soon.
async fn sync_ha_zones(
    context: &Context,
    proxmox: &ProxmoxClient,
    cluster: &ProxmoxCluster,
    group: &ZonesByCredentials,
    namespace: &str,
    name: &str,
) -> bool {
    let names = crate::controller::ha::HaNames::new(namespace, name);
    // This Proxmox holds the rules of its own zones only.
    let spec = group.restrict(&cluster.spec);
    let synced = match context.inventory.pve_major(proxmox).await {
        Ok(major) => crate::controller::ha::sync_zone_nodes(proxmox, major, &names, &spec).await,
        Err(error) => Err(error),
    };
    match synced {
        Ok(registered) => {
            for warning in registered.warnings {
                tracing::warn!(cluster = %name, "Proxmox refused the zone's nodes for {warning}");
                failures::publish_event(
                    &context.client,
                    FIELD_MANAGER,
                    &cluster.object_ref(&()),
                    EventType::Warning,
                    "HAConfigurationRefused",
                    &format!("Proxmox refused the zone's nodes for {warning}; check the zone's nodes and the HA rules in Proxmox"),
                )
                .await;
            }
            registered.complete
        }
        Err(error) => {
            tracing::warn!(cluster = %name, %error, "updating the nodes of the zones' HA rules or groups failed; retrying on the next pass");
            true
        }
    }
}

/// What one Proxmox (one set of credentials of the cluster) looked like in this pass.
struct EndpointReport<'a> {
    group: &'a ZonesByCredentials,
    /// The URL the credentials name, once they resolved.
    url: Option<String>,
    state: EndpointState,
}

enum EndpointState {
    /// Reachable; the zone nodes it does not know.
    Available {
        proxmox: ProxmoxClient,
        nodes: ZoneNodes,
    },
    /// No usable credentials.
    NoCredentials(super::credentials::CredentialsError),
    /// No client could be built from the credentials.
    Unusable(crate::proxmox::ProxmoxError),
    /// Proxmox did not answer, or refused.
    Unreachable(failures::Described),
}

impl EndpointReport<'_> {
    /// What the cluster's conditions are decided from.
    fn seen(&self) -> EndpointSeen {
        EndpointSeen {
            zones: self.group.zones.clone(),
            zone_nodes: self.group.zone_nodes.clone(),
            url: self.url.clone(),
            name: self.endpoint_name(),
            failure: (!self.available()).then(|| EndpointFailure {
                reason: self.reason(),
                message: self.failure_message(),
                backs_off: self.backs_off(),
                no_credentials: matches!(self.state, EndpointState::NoCredentials(_)),
                retry_after: self.retry_after(),
            }),
            unknown_nodes: self.nodes().unknown.clone(),
            offline_nodes: self.nodes().offline.clone(),
            nodes_without_disk_room: self.nodes().without_disk_room.clone(),
        }
    }

    fn available(&self) -> bool {
        matches!(self.state, EndpointState::Available { .. })
    }

    /// Whether the failure is Proxmox's (retried with back-off) rather than the configuration's.
    fn backs_off(&self) -> bool {
        matches!(self.state, EndpointState::Unreachable(_))
    }

    fn nodes(&self) -> &ZoneNodes {
        const NONE: &ZoneNodes = &ZoneNodes {
            unknown: Vec::new(),
            offline: Vec::new(),
            without_disk_room: Vec::new(),
        };
        match &self.state {
            EndpointState::Available { nodes, .. } => nodes,
            _ => NONE,
        }
    }

    fn reason(&self) -> &'static str {
        match &self.state {
            EndpointState::Available { .. } => "Available",
            EndpointState::NoCredentials(error) => error.reason(),
            EndpointState::Unusable(error) => failures::reason(error),
            EndpointState::Unreachable(described) => described.reason,
        }
    }

    fn retry_after(&self) -> Duration {
        match &self.state {
            EndpointState::Unreachable(described) => described.retry_after.unwrap_or_default(),
            _ => Duration::ZERO,
        }
    }

    /// Which Proxmox this is, for messages: its URL, else the Secret that should name it.
    fn endpoint_name(&self) -> String {
        match (&self.url, &self.group.credentials_ref) {
            (Some(url), _) => url.clone(),
            (None, Some(reference)) => format!(
                "credentials Secret {}",
                reference.name.as_deref().unwrap_or_default()
            ),
            (None, None) => "the cluster's credentials".to_owned(),
        }
    }

    /// What failed.
    fn failure_message(&self) -> String {
        match &self.state {
            EndpointState::Available { .. } => String::new(),
            EndpointState::NoCredentials(error) => error.to_string(),
            EndpointState::Unusable(error) => error.to_string(),
            EndpointState::Unreachable(described) => described.message.clone(),
        }
    }
}

/// Resolves one group's credentials (adopting their Secret) and checks its Proxmox answers and
/// knows the group's zone nodes.
async fn check_endpoint<'a>(
    context: &Context,
    cluster: &ProxmoxCluster,
    namespace: &str,
    group: &'a ZonesByCredentials,
) -> Result<EndpointReport<'a>, ClusterError> {
    let config = match client_config(
        context,
        cluster,
        namespace,
        group.credentials_ref.as_ref(),
        true,
    )
    .await?
    {
        Ok(config) => config,
        Err(error) => {
            return Ok(EndpointReport {
                group,
                url: None,
                state: EndpointState::NoCredentials(error),
            });
        }
    };
    let url = Some(config.url.clone());
    let proxmox = match context.proxmox.get(&config) {
        Ok(proxmox) => proxmox,
        Err(error) => {
            return Ok(EndpointReport {
                group,
                url,
                state: EndpointState::Unusable(error),
            });
        }
    };
    let state = match check_proxmox(&proxmox, &group.zone_nodes).await {
        Ok(nodes) => EndpointState::Available { proxmox, nodes },
        Err(error) => EndpointState::Unreachable(failures::describe(
            &format!("checking Proxmox at {}", config.url),
            &error,
        )),
    };
    Ok(EndpointReport { group, url, state })
}

/// The zone nodes (zone, node) Proxmox does not know, those it lists as not online, and those
/// online whose storages for VM disks are all inactive or full (with why).
#[derive(Debug, Default)]
struct ZoneNodes {
    unknown: Vec<(String, String)>,
    offline: Vec<(String, String)>,
    without_disk_room: Vec<(String, String, String)>,
}

/// Proxmox answers `/version`; returns which zone nodes it does not know, lists offline, or
/// lists online without room for a VM disk (its storages, listed only when a node is online).
async fn check_proxmox(
    proxmox: &ProxmoxClient,
    zone_nodes: &[(String, String)],
) -> Result<ZoneNodes, crate::proxmox::ProxmoxError> {
    proxmox.version().await?;
    if zone_nodes.is_empty() {
        return Ok(ZoneNodes::default());
    }
    let listed = proxmox.nodes().await?;
    let state = |node: &str| listed.iter().find(|n| n.node == node).map(|n| &n.status);
    let mut nodes = ZoneNodes::default();
    let mut online = Vec::new();
    for pair in zone_nodes {
        match state(&pair.1) {
            None => nodes.unknown.push(pair.clone()),
            Some(NodeState::Online) => online.push(pair),
            Some(_) => nodes.offline.push(pair.clone()),
        }
    }
    if online.is_empty() {
        return Ok(nodes);
    }
    let storages = proxmox
        .cluster_resources(Some(ResourceFilter::Storage))
        .await?;
    for (zone, node) in online {
        if let Some(why) = zone_health::no_disk_room(&storages, node) {
            nodes
                .without_disk_room
                .push((zone.clone(), node.clone(), why));
        }
    }
    Ok(nodes)
}

/// Creates or updates the desired pools and deletes the ones this cluster no longer asks for.
async fn reconcile_pools(
    context: &Context,
    cluster: &ProxmoxCluster,
    namespace: &str,
    desired: &[ClusterPool],
) -> Result<(), ClusterError> {
    let api: Api<InClusterIPPool> = Api::namespaced(context.client.clone(), namespace);
    let owner = cluster_owner_reference(cluster, true);
    // One list serves the comparison with every desired pool and the search for pools no
    // longer desired.
    let live_pools = api.list(&ListParams::default()).await?.items;
    for pool in desired {
        let object = pool_object(pool, namespace, &owner);
        let live = live_pools.iter().find(|live| live.name_any() == pool.name);
        let unchanged = live.is_some_and(|live| {
            live.spec == object.spec
                && live.labels().get(labels::PROXMOX_ZONE)
                    == object.labels().get(labels::PROXMOX_ZONE)
                && object
                    .annotations()
                    .iter()
                    .all(|(k, v)| live.annotations().get(k) == Some(v))
                && live.owner_references().iter().any(|o| o.uid == owner.uid)
        });
        if !unchanged {
            api.patch(
                &pool.name,
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&object),
            )
            .await?;
        }
    }
    // Pools of zones that were removed or lost their IP config.
    let uid = cluster.metadata.uid.clone().unwrap_or_default();
    for live in &live_pools {
        let ours = live
            .owner_references()
            .iter()
            .any(|o| o.uid == uid && o.controller == Some(true));
        let name = live.name_any();
        if ours && !desired.iter().any(|p| p.name == name) {
            tracing::info!(pool = %name, "deleting an IP pool the cluster no longer configures");
            api.delete(&name, &Default::default()).await?;
        }
    }
    Ok(())
}

/// The `InClusterIPPool` the cluster wants for `pool`, owned by it (`owner`).
fn pool_object(pool: &ClusterPool, namespace: &str, owner: &OwnerReference) -> InClusterIPPool {
    let mut annotations_map = BTreeMap::from([
        (
            annotations::IP_FAMILY.to_owned(),
            pool.family.annotation_value().to_owned(),
        ),
        (
            annotations::GATEWAY_METRIC.to_owned(),
            pool.config
                .metric
                .map(|m| m.to_string())
                .unwrap_or_default(),
        ),
    ]);
    if let Some(metric) = pool.config.metric {
        // The legacy annotation the Go provider also writes.
        annotations_map.insert("metric".to_owned(), metric.to_string());
    }
    let mut object = InClusterIPPool::new(
        &pool.name,
        capi::InClusterIpPoolSpec {
            pool: PoolAddresses {
                addresses: pool.config.addresses.clone(),
                prefix: pool.config.prefix,
                gateway: Some(pool.config.gateway.clone()),
            },
        },
    );
    object.metadata.namespace = Some(namespace.to_owned());
    object.metadata.labels = Some(BTreeMap::from([(
        labels::PROXMOX_ZONE.to_owned(),
        pool.zone_label().to_owned(),
    )]));
    object.metadata.annotations = Some(annotations_map);
    object.metadata.owner_references = Some(vec![owner.clone()]);
    object
}

/// Records the pools in `status.inClusterIPPoolRef` and `status.inClusterZoneRef`.
fn record_pools(status: &mut ProxmoxClusterStatus, pools: &[ClusterPool]) {
    status.in_cluster_ip_pool_ref = pools
        .iter()
        .map(|p| LocalObjectReference {
            name: p.name.clone(),
        })
        .collect();
    let mut zones: Vec<InClusterZoneRef> = Vec::new();
    for pool in pools {
        let zone = pool.zone_label().to_owned();
        let index = match zones.iter().position(|z| z.zone == zone) {
            Some(index) => index,
            None => {
                zones.push(InClusterZoneRef {
                    zone,
                    ..InClusterZoneRef::default()
                });
                zones.len() - 1
            }
        };
        let reference = Some(LocalObjectReference {
            name: pool.name.clone(),
        });
        match pool.family {
            IpFamily::V4 => zones[index].in_cluster_ip_pool_ref_v4 = reference,
            IpFamily::V6 => zones[index].in_cluster_ip_pool_ref_v6 = reference,
        }
    }
    status.in_cluster_zone_ref = zones;
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;

    #[test]
    fn only_its_own_deletion_ends_a_clusters_retries() {
        let not_found = |kind: &str, name: &str| {
            ClusterError::Kube(kube::Error::Api(
                serde_json::from_value::<kube::core::Status>(serde_json::json!({
                    "status": "Failure", "code": 404, "reason": "NotFound",
                    "message": format!("{kind} \"{name}\" not found"),
                    "details": {"kind": kind, "name": name}
                }))
                .expect("a Status")
                .boxed(),
            ))
        };
        let mut cluster = ProxmoxCluster::new(
            "demo",
            serde_json::from_value(serde_json::json!({
                "dnsServers": ["10.0.0.2"]
            }))
            .expect("a spec"),
        );
        cluster.metadata.namespace = Some("default".into());
        assert!(not_found("proxmoxclusters", "demo").is_gone(&cluster));
        assert!(!not_found("proxmoxclusters", "other").is_gone(&cluster));
        assert!(!not_found("clusters", "demo").is_gone(&cluster));
        assert!(!ClusterError::MissingIdentity.is_gone(&cluster));
    }

    fn meta(label: Option<&str>, owner: Option<(&str, &str)>) -> ObjectMeta {
        ObjectMeta {
            labels: label.map(|l| BTreeMap::from([(labels::CLUSTER_NAME.to_owned(), l.into())])),
            owner_references: owner.map(|(api_version, name)| {
                vec![OwnerReference {
                    api_version: api_version.into(),
                    kind: "Machine".into(),
                    name: name.into(),
                    ..OwnerReference::default()
                }]
            }),
            ..ObjectMeta::default()
        }
    }

    #[test]
    fn a_machine_is_the_clusters_by_its_label_else_by_its_owner_machine() {
        let owners = BTreeSet::from(["demo-md-0".to_owned()]);
        let capi = "cluster.x-k8s.io/v1beta2";
        assert!(belongs_to(&meta(Some("demo"), None), "demo", &owners));
        assert!(!belongs_to(&meta(Some("other"), None), "demo", &owners));
        assert!(
            !belongs_to(
                &meta(Some("other"), Some((capi, "demo-md-0"))),
                "demo",
                &owners
            ),
            "the label, which CAPI sets from the Machine, wins"
        );
        assert!(belongs_to(
            &meta(None, Some((capi, "demo-md-0"))),
            "demo",
            &owners
        ));
        assert!(!belongs_to(
            &meta(None, Some((capi, "demo-md-1"))),
            "demo",
            &owners
        ));
        assert!(
            !belongs_to(
                &meta(None, Some(("example.com/v1", "demo-md-0"))),
                "demo",
                &owners
            ),
            "only a CAPI Machine owner counts"
        );
        assert!(!belongs_to(&meta(None, None), "demo", &owners));
    }
}
