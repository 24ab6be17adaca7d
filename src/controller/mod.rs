//! The controller manager: probes and metrics, leader election, graceful shutdown, and the
//! reconcilers it runs while leading.

pub mod bootstrap_secrets;
pub mod caches;
pub mod cluster;
pub mod cluster_conditions;
pub mod conditions;
pub mod credentials;
pub mod failures;
pub mod guarded;
pub mod ha;
pub mod http;
pub mod inventory;
pub mod leader;
pub mod lean;
pub mod machine;
pub mod metrics;
pub mod node_tasks;
pub mod own_writes;
pub mod patch;
pub mod queue_depth;
pub mod remediation;
pub mod task_slots;
pub mod template;
pub mod vmid;
pub mod zone_health;

use std::net::SocketAddr;
use std::sync::Arc;

use k8s_openapi::api::coordination::v1::Lease;
use kube::{Api, Client};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::proxmox::ClientRegistry;

pub use credentials::GlobalCredentials;
pub use http::{EndpointServer, HttpError, Readiness};
pub use leader::{LeaderElectionConfig, LeaderElectionError};
pub use metrics::Metrics;

/// Why the manager stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ManagerError {
    /// The probe or metrics endpoint could not be served.
    #[error(transparent)]
    Http(#[from] HttpError),
    /// Leadership was lost or misconfigured; the process exits so it restarts as a follower.
    #[error(transparent)]
    LeaderElection(#[from] LeaderElectionError),
    /// The conversion webhook could not be served.
    #[error(transparent)]
    Webhook(#[from] crate::webhook::WebhookError),
    /// The reconcilers ended while this replica led; the process exits so it is restarted.
    #[error("the reconcilers stopped unexpectedly ({0}); capmox exits so it is restarted")]
    ControllersStopped(String),
}

/// How the manager runs.
#[derive(Clone, Debug)]
pub struct ManagerConfig {
    /// Where `/metrics` is served.
    pub metrics_address: SocketAddr,
    /// Where `/healthz` and `/readyz` are served (may equal `metrics_address`).
    pub health_address: SocketAddr,
    /// Leader election, or `None` to reconcile right away (single replica, local runs).
    pub leader_election: Option<LeaderElectionConfig>,
    /// Namespace to watch, or `None` for all namespaces.
    pub watch_namespace: Option<String>,
    /// Only watch and reconcile objects whose `cluster.x-k8s.io/watch-filter` label has this
    /// value (`None`: all of them); see [`ManagerConfig::shard_watch`].
    pub watch_filter: Option<String>,
    /// Reconciles of ProxmoxClusters that may run at once.
    pub cluster_concurrency: u16,
    /// Reconciles of ProxmoxMachines that may run at once.
    pub machine_concurrency: u16,
    /// When machines' Proxmox tasks and booting guests are looked at again.
    pub task_timing: machine::TaskTimingPolicy,
    /// How long a zone's health must last before its failure domain is no longer offered to
    /// the control plane, or offered again.
    pub zone_holds: zone_health::ZoneHolds,
    /// Requests capmox sends to one Proxmox API at once, over all its clusters and tokens.
    pub proxmox_requests_in_flight: usize,
    /// The conversion webhook, served by every replica (leader or not) since the API server
    /// needs it whichever pod the Service picks; `None` for local runs and tests.
    pub webhook: Option<crate::webhook::WebhookConfig>,
}

impl ManagerConfig {
    /// How the controllers watch this manager's shard when a watch filter is set: the kinds
    /// they reconcile and the Cluster API Clusters and Machines they map from, as
    /// controller-runtime providers filter them. (IP claims, addresses and pools, which capmox
    /// and the IPAM provider create without the label, are watched whole.)
    pub fn shard_watch(&self) -> kube::runtime::watcher::Config {
        let config = kube::runtime::watcher::Config::default();
        match &self.watch_filter {
            Some(value) => config.labels(&format!("{}={value}", crate::api::labels::WATCH_FILTER)),
            None => config,
        }
    }
}

/// State shared by every reconciler of one manager.
#[derive(Clone)]
pub struct Context {
    /// Kubernetes client.
    pub client: Client,
    /// Metrics registry.
    pub metrics: Metrics,
    /// Manager settings.
    pub config: ManagerConfig,
    /// One Proxmox client per (URL, token, TLS settings), shared by all reconciles.
    pub proxmox: Arc<ClientRegistry>,
    /// Credentials for clusters without a `credentialsRef`.
    pub global_credentials: GlobalCredentials,
    /// Credentials machine reconciles resolved from clusters' Secrets, reused for a short while
    /// so a pass costs no Secret read. After a restart: the Secrets are read again.
    pub credentials: credentials::CredentialsMemo,
    /// What the machine reconciler remembers of the VMs it creates ([`machine::Vms`]).
    pub vms: machine::Vms,
    /// Each failing object's back-off, so retries slow down per object. After a restart: the
    /// back-offs start over (a failed task's is kept in the machine's `status.retryAfter`).
    pub retries: failures::Retries,
    /// When the Proxmox tasks machines wait for are expected to end, so a pass checks a task
    /// once rather than polling. After a restart: the tasks recorded in status are checked at
    /// once and durations are learned again.
    pub task_timing: machine::TaskTimer,
    /// The machines a pass runs for now, so a change meanwhile is left to the pass's end
    /// ([`machine::Passes`]). After a restart: no pass runs.
    pub passes: machine::Passes,
    /// The machines waiting for their Proxmox task or guest, each woken when it is due
    /// ([`machine::DueWakes`]). After a restart: nothing waits; every machine gets a pass.
    pub due_wakes: machine::DueWakes,
    /// What each Proxmox endpoint lists, shared by all machine reconciles, so a pass costs no
    /// listing of its own. After a restart: each endpoint is listed again on first use.
    pub inventory: inventory::Inventory,
    /// Each node's task list, so one request answers for every task this process waits for on
    /// the node. After a restart: each node is listed again when a check falls due.
    pub node_tasks: node_tasks::NodeTaskLists,
    /// The versions this process's own spec and metadata writes of machines produced, so their
    /// echoes do not wake the machines again ([`own_writes`]).
    pub own_writes: own_writes::OwnWrites,
    /// Bootstrap data Secrets, kept by a watch from their creation until their machine took
    /// them ([`bootstrap_secrets`]). After a restart: recent ones are listed again; a machine
    /// whose Secret is not held reads it.
    pub bootstrap_secrets: bootstrap_secrets::BootstrapSecrets,
    /// Since when each cluster's zones have been healthy or not, so a zone's failure domain
    /// changes only after its state lasted. After a restart: timed from the first pass again.
    pub zone_states: zone_health::ZoneStates,
    /// The clone and disk tasks running per node and storage, and the machines waiting for
    /// one ([`task_slots`]). After a restart: a running task counts again once its machine's
    /// next pass sees it.
    pub task_slots: task_slots::TaskSlots,
    /// What `/readyz` reports; the controllers mark their caches synced here.
    pub readiness: Readiness,
    /// The objects machine reconciles read, kept by the machine controller's watches; `None`
    /// outside a running controller, where reconciles read from the API server. After a
    /// restart: listed again, and no pass runs until every watch has listed once.
    pub caches: Option<caches::Caches>,
    /// The CAPI Clusters the ProxmoxCluster controller's watch keeps, so its pass costs no
    /// read; `None` outside that controller, where the pass reads from the API server. After a
    /// restart: listed again, and a cluster whose owner is not listed yet is looked at shortly.
    pub capi_clusters: Option<kube::runtime::reflector::Store<crate::capi::Cluster>>,
}

impl Context {
    /// A context for reconcilers outside a manager (tests, benchmarks, the sandbox).
    pub fn new(
        client: Client,
        config: ManagerConfig,
        global_credentials: GlobalCredentials,
    ) -> Self {
        let proxmox = Arc::new(ClientRegistry::with_requests_in_flight(
            config.proxmox_requests_in_flight,
        ));
        let task_timing = machine::TaskTimer::new(config.task_timing);
        let metrics = Metrics::new().with_proxmox(proxmox.clone());
        Self {
            client,
            task_slots: metrics.observe_task_slots(task_slots::TaskSlots::default()),
            metrics,
            config,
            proxmox,
            global_credentials,
            credentials: credentials::CredentialsMemo::default(),
            vms: machine::Vms::default(),
            retries: failures::Retries::default(),
            task_timing,
            passes: machine::Passes::default(),
            due_wakes: machine::DueWakes::default(),
            inventory: inventory::Inventory::default(),
            node_tasks: node_tasks::NodeTaskLists::default(),
            own_writes: own_writes::OwnWrites::default(),
            bootstrap_secrets: bootstrap_secrets::BootstrapSecrets::default(),
            zone_states: zone_health::ZoneStates::default(),
            readiness: Readiness::default(),
            caches: None,
            capi_clusters: None,
        }
    }
}

/// Serves the probes, the metrics and (when configured) the conversion webhook until `stop`.
async fn serve(
    config: &ManagerConfig,
    metrics: &Metrics,
    readiness: &Readiness,
    stop: &CancellationToken,
) -> Result<(), ManagerError> {
    for server in bind_endpoints(config, metrics, readiness).await? {
        if let Some(address) = server.local_addr() {
            tracing::info!(%address, "serving /healthz, /readyz and /metrics");
        }
        tokio::spawn(server.serve(stop.clone()));
    }
    if let Some(webhook) = &config.webhook {
        let server =
            crate::webhook::WebhookServer::bind(webhook, crate::webhook::capmox_converter())
                .await?;
        if let Some(address) = server.local_addr() {
            tracing::info!(%address, cert_dir = %webhook.cert_dir.display(), "serving the conversion webhook");
        }
        tokio::spawn(server.serve(stop.clone()));
    }
    Ok(())
}

/// Runs the reconcilers while this replica leads: until shutdown or the loss of leadership
/// (the reconciles in flight finish, fenced from Proxmox), or an error when they stop on
/// their own.
async fn lead(
    context: Context,
    registry: Arc<ClientRegistry>,
    readiness: &Readiness,
    leading: &mut watch::Receiver<bool>,
    shutdown: &CancellationToken,
) -> Result<(), ManagerError> {
    readiness.set_standby(false);
    readiness.set_leading(true);
    // A shutdown signal reaches the reconcilers through the child token; so does the loss of
    // leadership. Either way the reconciles in flight finish before the manager returns.
    let controllers_stop = shutdown.child_token();
    let mut controllers =
        tokio::spawn(run_controllers(Arc::new(context), controllers_stop.clone()));
    tokio::select! {
        ended = &mut controllers => {
            if !shutdown.is_cancelled() {
                // Nothing reconciles any more: exit, so the pod restarts (or another
                // replica takes the Lease) instead of renewing a Lease it does not use.
                registry.fence();
                readiness.set_leading(false);
                let cause = match ended {
                    Ok(()) => "they stopped on their own".to_owned(),
                    Err(join_error) => join_error.to_string(),
                };
                tracing::error!(%cause, "the reconcilers stopped while leading; exiting");
                return Err(ManagerError::ControllersStopped(cause));
            }
        }
        _ = async { leading.wait_for(|leading| !*leading).await.is_ok() } => {
            if shutdown.is_cancelled() {
                tracing::info!("lease released for shutdown; stopping all reconcilers");
            } else {
                tracing::error!("leadership lost; stopping all reconcilers");
            }
            // Reconciles in flight finish without another Proxmox write: the new leader may
            // already act on the same VMs.
            registry.fence();
            controllers_stop.cancel();
            let _ = controllers.await;
        }
    }
    Ok(())
}

/// Runs the manager until `shutdown` is cancelled or leadership is lost.
pub async fn run(
    client: Client,
    config: ManagerConfig,
    global_credentials: GlobalCredentials,
    shutdown: CancellationToken,
) -> Result<(), ManagerError> {
    let proxmox = Arc::new(ClientRegistry::with_requests_in_flight(
        config.proxmox_requests_in_flight,
    ));
    let metrics = Metrics::new().with_proxmox(proxmox.clone());
    let readiness = Readiness::default();
    let server_stop = CancellationToken::new();
    serve(&config, &metrics, &readiness, &server_stop).await?;
    let _stop_servers = server_stop.drop_guard();

    let (leading_tx, mut leading) = watch::channel(config.leader_election.is_none());
    // Without leader election the sender is only kept alive: a closed channel would read as lost
    // leadership.
    let (election, _leading_without_election) = match config.leader_election.clone() {
        Some(election) => {
            let api: Api<Lease> = Api::namespaced(client.clone(), &election.namespace);
            let task = leader::run(api, election, leading_tx, shutdown.clone());
            (Some(tokio::spawn(task)), None)
        }
        None => (None, Some(leading_tx)),
    };

    // Followers wait here, ready to take over (and ready for the probes, so a rolling update
    // can start the new replica while the old one still holds the Lease).
    readiness.set_standby(election.is_some());
    let became_leader = tokio::select! {
        () = shutdown.cancelled() => false,
        // The borrow `wait_for` returns is not `Send`; drop it inside the branch future so the
        // manager future can be spawned.
        changed = async { leading.wait_for(|leading| *leading).await.is_ok() } => changed,
    };
    if became_leader {
        let registry = proxmox.clone();
        let task_timing = machine::TaskTimer::new(config.task_timing);
        let context = Context {
            client,
            task_slots: metrics.observe_task_slots(task_slots::TaskSlots::default()),
            metrics,
            config,
            proxmox,
            global_credentials,
            credentials: credentials::CredentialsMemo::default(),
            vms: machine::Vms::default(),
            retries: failures::Retries::default(),
            task_timing,
            passes: machine::Passes::default(),
            due_wakes: machine::DueWakes::default(),
            inventory: inventory::Inventory::default(),
            node_tasks: node_tasks::NodeTaskLists::default(),
            own_writes: own_writes::OwnWrites::default(),
            bootstrap_secrets: bootstrap_secrets::BootstrapSecrets::default(),
            zone_states: zone_health::ZoneStates::default(),
            readiness: readiness.clone(),
            caches: None,
            capi_clusters: None,
        };
        lead(context, registry, &readiness, &mut leading, &shutdown).await?;
        readiness.set_leading(false);
    }
    match election {
        Some(task) => match task.await {
            Ok(result) => result.map_err(ManagerError::from),
            Err(join_error) => {
                tracing::error!(%join_error, "leader election task ended abnormally");
                Ok(())
            }
        },
        None => Ok(()),
    }
}

async fn bind_endpoints(
    config: &ManagerConfig,
    metrics: &Metrics,
    readiness: &Readiness,
) -> Result<Vec<EndpointServer>, HttpError> {
    let mut servers = vec![
        EndpointServer::bind(config.health_address, metrics.clone(), readiness.clone()).await?,
    ];
    if config.metrics_address != config.health_address {
        servers.push(
            EndpointServer::bind(config.metrics_address, metrics.clone(), readiness.clone())
                .await?,
        );
    }
    Ok(servers)
}

/// The reconcilers of this manager; they run until `shutdown` is cancelled, then finish the
/// reconciles in flight. Each marks its cache synced in `context.readiness` after its first list.
pub async fn run_controllers(context: Arc<Context>, shutdown: CancellationToken) {
    let readiness = context.readiness.clone();
    readiness.expect(cluster::CONTROLLER);
    readiness.expect(machine::CONTROLLER);
    readiness.expect(template::CONTROLLER);
    readiness.expect(remediation::CONTROLLER);
    tracing::info!(
        cluster_concurrency = context.config.cluster_concurrency,
        machine_concurrency = context.config.machine_concurrency,
        template_concurrency = template::CONCURRENCY,
        "starting reconcilers"
    );
    tokio::join!(
        stop_in_time(
            cluster::CONTROLLER,
            cluster::run(context.clone(), shutdown.clone()),
            &readiness,
            &shutdown,
        ),
        stop_in_time(
            machine::CONTROLLER,
            machine::run(context.clone(), shutdown.clone()),
            &readiness,
            &shutdown,
        ),
        stop_in_time(
            template::CONTROLLER,
            template::run(context.clone(), shutdown.clone()),
            &readiness,
            &shutdown,
        ),
        stop_in_time(
            remediation::CONTROLLER,
            remediation::run(context.clone(), shutdown.clone()),
            &readiness,
            &shutdown,
        )
    );
    readiness.reset_controllers();
}

/// How long reconciles in flight may take to finish after a shutdown signal; below the 30 s a
/// Pod gets between SIGTERM and SIGKILL.
pub const SHUTDOWN_GRACE: std::time::Duration = std::time::Duration::from_secs(20);

/// Runs one controller until it stops on its own or `shutdown` fires. After the signal, a
/// controller whose cache never filled is dropped at once (it has reconciled nothing, and
/// kube-runtime would otherwise wait for a first list that may never come, e.g. when RBAC
/// forbids it); one that did gets [`SHUTDOWN_GRACE`] to finish the reconciles in flight.
async fn stop_in_time(
    controller: &'static str,
    running: impl std::future::Future<Output = ()>,
    readiness: &Readiness,
    shutdown: &CancellationToken,
) {
    let mut running = std::pin::pin!(running);
    tokio::select! {
        () = &mut running => return,
        () = shutdown.cancelled() => {}
    }
    if !readiness.state().synced.contains(controller) {
        tracing::info!(
            controller,
            "stopping before the cache filled; nothing was reconciled"
        );
        return;
    }
    if tokio::time::timeout(SHUTDOWN_GRACE, running).await.is_err() {
        tracing::warn!(controller, grace = ?SHUTDOWN_GRACE, "reconciles did not finish within the shutdown grace period; abandoning them");
    }
}

/// The objects of kind `K` that own `object` (controller or not), as `Controller::owns` finds
/// them: same namespace, matching kind and API group.
fn owners<K>(object: &impl kube::Resource) -> Vec<kube::runtime::reflector::ObjectRef<K>>
where
    K: kube::Resource<DynamicType = ()>,
{
    let namespace = object.meta().namespace.clone().unwrap_or_default();
    let group = K::group(&());
    object
        .meta()
        .owner_references
        .iter()
        .flatten()
        .filter(|owner| {
            owner.kind == K::kind(&())
                && owner.api_version.split_once('/').map_or("", |(g, _)| g) == group
        })
        .map(|owner| kube::runtime::reflector::ObjectRef::new(&owner.name).within(&namespace))
        .collect()
}

/// Marks `controller` synced in `readiness` once its cache has been filled by the first list.
fn report_cache_sync<K>(
    store: kube::runtime::reflector::Store<K>,
    readiness: Readiness,
    controller: &'static str,
) where
    K: kube::Resource + Clone + Send + Sync + 'static,
    K::DynamicType: Eq + std::hash::Hash + Clone + Send + Sync,
{
    // kube-runtime's ready signal wakes only the waiter that polled it last, and the controller
    // itself waits on it too; so this waiter polls again every interval until the signal is set
    // (a few cheap polls at start-up, none afterwards).
    const RECHECK: std::time::Duration = std::time::Duration::from_millis(200);
    tokio::spawn(async move {
        loop {
            match tokio::time::timeout(RECHECK, store.wait_until_ready()).await {
                Ok(Ok(())) => {
                    tracing::info!(controller, "cache synced");
                    readiness.mark_synced(controller);
                    return;
                }
                // The controller stopped before its first list completed.
                Ok(Err(_)) => return,
                Err(_) => continue,
            }
        }
    });
}

/// Writes `status` of the object `name` by server-side apply as `field_manager`, forcing
/// ownership of its fields: each status has one writer.
pub(crate) async fn apply_status<K>(
    api: &Api<K>,
    name: &str,
    field_manager: &str,
    status: &impl serde::Serialize,
) -> Result<(), kube::Error>
where
    K: kube::Resource<DynamicType = ()> + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let body = serde_json::json!({
        "apiVersion": K::api_version(&()),
        "kind": K::kind(&()),
        "status": status,
    });
    api.patch_status(
        name,
        &kube::api::PatchParams::apply(field_manager).force(),
        &kube::api::Patch::Apply(body),
    )
    .await?;
    Ok(())
}
