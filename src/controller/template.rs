//! The ProxmoxMachineTemplate reconciler: publishes what a machine stamped from the template
//! would have, so the Cluster Autoscaler can scale a MachineDeployment up from zero (Cluster
//! API's opt-in "autoscaling from zero" contract).
//!
//! `status.capacity` holds `cpu` (sockets × cores), `memory` (`memoryMiB` as `<n>Mi`) and
//! `ephemeral-storage` (the boot disk), `status.nodeInfo` the `architecture` and
//! `operatingSystem`. What the spec leaves unset is the Proxmox template's, so it is read from
//! the template's config (`sockets`, `cores`, `memory`, the boot disk, `arch`, `ostype`) with the
//! credentials of the template's ProxmoxCluster. A template belongs to no cluster directly: its
//! `cluster.x-k8s.io/cluster-name` label (set by ClusterClass topologies) names the CAPI Cluster,
//! whose `infrastructureRef` names the ProxmoxCluster (else the ProxmoxCluster with the same
//! label). When that cannot be found or Proxmox cannot be asked, what the spec gives is still
//! published, and `CapacityResolved=False` says what is missing and why.
//!
//! Reads come from the controller's watches (templates, ProxmoxClusters, CAPI Clusters); the
//! credentials Secret is read as the machine controller reads it, and the template's config is
//! kept per endpoint for a minute ([`super::inventory`]). Status is written with server-side
//! apply (field manager [`FIELD_MANAGER`]) only when it changes; a template is looked at again
//! every [`RESYNC`] to follow changes made in Proxmox.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures::{Stream, StreamExt};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::jiff::Timestamp;
use kube::runtime::controller::{Action, Config as ControllerConfig, Controller};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::watcher;
use kube::{Api, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use tokio_util::sync::CancellationToken;

use super::Context;
use super::conditions::{self, Decided};
use super::credentials::{CredentialsError, client_config};
use super::failures::{self, Pass};
use super::guarded::WriteError;
use crate::api::{
    self, CAPACITY_CPU, CAPACITY_EPHEMERAL_STORAGE, CAPACITY_MEMORY, NodeArchitecture,
    NodeOperatingSystem, ProxmoxCluster, ProxmoxMachineSpec, ProxmoxMachineTemplate,
    ProxmoxMachineTemplateStatus, TemplateNodeInfo, labels,
};
use crate::capi;
use crate::placement::{self, TagSelector};
use crate::proxmox::{ProxmoxClient, ProxmoxError, VmConfig, types::parse_property_string};

/// Field manager of everything this controller writes.
pub const FIELD_MANAGER: &str = "capmox-proxmoxmachinetemplate";
/// Controller name in metrics and logs.
pub const CONTROLLER: &str = "proxmoxmachinetemplate";
/// Reconciles of templates that may run at once (each is a cached read or two).
pub const CONCURRENCY: u16 = 2;
/// How often a template is looked at again, to follow changes of its Proxmox template.
pub const RESYNC: Duration = Duration::from_secs(600);
/// How soon a template is looked at again when its cluster's credentials are unusable (the
/// Secret is not watched).
const CREDENTIALS_RETRY: Duration = Duration::from_secs(30);
/// How soon a template woken before the watches listed their kinds is looked at again.
const CACHE_SYNC_RECHECK: Duration = Duration::from_millis(200);
/// Condition this controller reports (with its `Ready` summary).
const RESOLVED: &str = api::conditions::CAPACITY_RESOLVED;

/// Why a reconcile failed; it is retried with back-off.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    /// The reconcile panicked (a bug); the object is retried with back-off.
    #[error(transparent)]
    Panicked(#[from] super::metrics::Panicked),
    /// A Kubernetes API call failed.
    #[error("Kubernetes API error: {0}")]
    Kube(#[from] kube::Error),
    /// The credentials Secret could not be read.
    #[error(transparent)]
    Write(#[from] WriteError),
    /// The object lacks a name or namespace (never true for objects read from the API).
    #[error("ProxmoxMachineTemplate without name or namespace")]
    MissingIdentity,
}

/// The stores of the kinds a pass reads besides templates, and whether their watches have
/// listed them once.
#[derive(Clone)]
struct Reads {
    clusters: Store<ProxmoxCluster>,
    capi_clusters: Store<capi::Cluster>,
    synced: Arc<[AtomicBool; 2]>,
}

impl Reads {
    fn synced(&self) -> bool {
        self.synced.iter().all(|s| s.load(Ordering::Acquire))
    }
}

/// Runs the controller until `shutdown` is cancelled.
pub async fn run(context: Arc<Context>, shutdown: CancellationToken) {
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
    let client = context.client.clone();
    let namespace = context.config.watch_namespace.clone();
    let namespace = namespace.as_deref();
    let templates: Api<ProxmoxMachineTemplate> = api(&client, namespace);
    let controller = Controller::new(templates, context.config.shard_watch());
    let store = controller.store();
    super::report_cache_sync(store.clone(), context.readiness.clone(), CONTROLLER);
    let (clusters, clusters_writer) = reflector::store();
    let (capi_clusters, capi_clusters_writer) = reflector::store();
    let reads = Reads {
        clusters,
        capi_clusters,
        synced: Arc::new([AtomicBool::new(false), AtomicBool::new(false)]),
    };
    let cluster_events = cached_watch(
        api::<ProxmoxCluster>(&client, namespace),
        context.config.shard_watch(),
        clusters_writer,
        reads.synced.clone(),
        0,
    );
    let capi_cluster_events = cached_watch(
        api::<capi::Cluster>(&client, namespace),
        context.config.shard_watch(),
        capi_clusters_writer,
        reads.synced.clone(),
        1,
    );
    let queue = context.metrics.work_queue(CONTROLLER);
    queue.observe(store.clone());
    let (cluster_queue, capi_cluster_queue) = (queue.clone(), queue);
    let (cluster_store, capi_cluster_store) = (store.clone(), store);
    controller
        // A ProxmoxCluster appearing or changing (credentials) wakes its cluster's templates.
        .watches_stream(cluster_events, move |cluster| {
            let names = [
                cluster.labels().get(labels::CLUSTER_NAME).cloned(),
                super::cluster::owner_cluster_name(&cluster),
            ];
            cluster_queue.wake(templates_of(&cluster_store, cluster.namespace(), &names))
        })
        // A CAPI Cluster appearing or naming another ProxmoxCluster wakes its templates.
        .watches_stream(capi_cluster_events, move |cluster| {
            let names = [Some(cluster.name_any()), None];
            capi_cluster_queue.wake(templates_of(&capi_cluster_store, cluster.namespace(), &names))
        })
        .with_config(ControllerConfig::default().concurrency(CONCURRENCY))
        .graceful_shutdown_on(shutdown.cancelled_owned())
        .run(
            move |template, context| reconcile(template, context, reads.clone()),
            error_policy,
            context,
        )
        .for_each(|result| async move {
            if let Err(error) = result {
                tracing::debug!(controller = CONTROLLER, %error, "reconcile finished with an error");
            }
        })
        .await;
}

fn cached_watch<K>(
    api: Api<K>,
    config: watcher::Config,
    writer: reflector::store::Writer<K>,
    synced: Arc<[AtomicBool; 2]>,
    slot: usize,
) -> impl Stream<Item = Result<K, watcher::Error>> + Send + 'static
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + std::fmt::Debug + Send + Sync,
    K: 'static,
{
    super::caches::reflected(api, config, writer, move || {
        if let Some(flag) = synced.get(slot) {
            flag.store(true, Ordering::Release);
        }
    })
}

/// The templates in `namespace` labelled with one of `names`.
fn templates_of(
    store: &Store<ProxmoxMachineTemplate>,
    namespace: Option<String>,
    names: &[Option<String>],
) -> Vec<ObjectRef<ProxmoxMachineTemplate>> {
    store
        .state()
        .into_iter()
        .filter(|t| {
            t.namespace() == namespace
                && t.labels()
                    .get(labels::CLUSTER_NAME)
                    .is_some_and(|label| names.iter().flatten().any(|n| n == label))
        })
        .map(|t| ObjectRef::from_obj(&*t))
        .collect()
}

/// The requeue after a failed pass: the template's back-off.
pub fn error_policy(
    template: Arc<ProxmoxMachineTemplate>,
    error: &TemplateError,
    context: Arc<Context>,
) -> Action {
    failures::after_error(&context.retries, CONTROLLER, &*template, error)
}

async fn reconcile(
    template: Arc<ProxmoxMachineTemplate>,
    context: Arc<Context>,
    reads: Reads,
) -> Result<Action, TemplateError> {
    if !reads.synced() {
        return Ok(Action::requeue(CACHE_SYNC_RECHECK));
    }
    let pass = context
        .metrics
        .measure(
            CONTROLLER,
            &*template,
            reconcile_inner(&template, &context, &reads),
        )
        .await?;
    Ok(context.retries.settle(&failures::key(&*template), pass))
}

/// Why the Proxmox template could not be read: the condition's reason and message.
struct Unread {
    reason: String,
    message: String,
}

/// How soon a template whose tags or templates in Proxmox need fixing is looked at again.
const TEMPLATE_RETRY: Duration = Duration::from_secs(60);

/// Where a template's Proxmox config is read: the first credentials the cluster uses (its
/// own, unless every zone names its own Proxmox).
async fn template_credentials(
    context: &Context,
    cluster: &ProxmoxCluster,
    namespace: &str,
) -> Result<Result<crate::proxmox::ClientConfig, CredentialsError>, WriteError> {
    let first = crate::placement::zones_by_credentials(cluster)
        .into_iter()
        .next()
        .and_then(|group| group.credentials_ref);
    client_config(context, cluster, namespace, first.as_ref(), false).await
}

async fn reconcile_inner(
    template: &ProxmoxMachineTemplate,
    context: &Context,
    reads: &Reads,
) -> Result<Pass, TemplateError> {
    let namespace = template.namespace().ok_or(TemplateError::MissingIdentity)?;
    let name = template
        .metadata
        .name
        .clone()
        .ok_or(TemplateError::MissingIdentity)?;
    let spec = &template.spec.template.spec;
    let read = read_template(template, context, reads, &namespace, &name).await?;
    let resolved = resolve_capacity(spec, read.config.as_ref().ok());
    let decided = resolved_condition(&read.config, &resolved);
    let current = template.status.clone().unwrap_or_default();
    let desired = ProxmoxMachineTemplateStatus {
        capacity: resolved.capacity,
        node_info: Some(resolved.node_info),
        conditions: conditions::merge(
            &current.conditions,
            &[decided],
            template.metadata.generation,
            Timestamp::now(),
        ),
    };
    if owned_status(&current) != desired {
        let api: Api<ProxmoxMachineTemplate> = Api::namespaced(context.client.clone(), &namespace);
        super::apply_status(&api, &name, FIELD_MANAGER, &desired).await?;
        tracing::info!(template = %name, namespace = %namespace, capacity = ?desired.capacity, "published the template's capacity");
    }
    Ok(if read.backing_off {
        Pass::BackingOff(Action::requeue(read.requeue))
    } else {
        Pass::Done(Action::requeue(read.requeue))
    })
}

/// The template's Proxmox config as a pass read it, or why it could not, and when to look again.
struct TemplateRead {
    config: Result<VmConfig, Unread>,
    requeue: Duration,
    /// Proxmox failed on its own account: the template's back-off streak goes on.
    backing_off: bool,
}

/// Reads the template's config from the Proxmox of its cluster's first credentials.
async fn read_template(
    template: &ProxmoxMachineTemplate,
    context: &Context,
    reads: &Reads,
    namespace: &str,
    name: &str,
) -> Result<TemplateRead, TemplateError> {
    let unread = |requeue, reason: &str, message: String| TemplateRead {
        config: Err(Unread {
            reason: reason.to_owned(),
            message,
        }),
        requeue,
        backing_off: false,
    };
    let cluster = match find_cluster(template, namespace, reads) {
        Ok(cluster) => cluster,
        Err(error) => {
            return Ok(TemplateRead {
                config: Err(error),
                requeue: RESYNC,
                backing_off: false,
            });
        }
    };
    let config = match template_credentials(context, &cluster, namespace).await? {
        Ok(config) => config,
        Err(error) => {
            let message = format!("ProxmoxCluster {}: {error}", cluster.name_any());
            return Ok(unread(CREDENTIALS_RETRY, error.reason(), message));
        }
    };
    let proxmox = match context.proxmox.get(&config) {
        Ok(proxmox) => proxmox,
        Err(error) => return Ok(unread(RESYNC, failures::reason(&error), error.to_string())),
    };
    Ok(
        match template_config(context, &proxmox, &template.spec.template.spec).await {
            Ok(Ok(config)) => TemplateRead {
                config: Ok(config),
                requeue: RESYNC,
                backing_off: false,
            },
            // Waiting for someone to fix the tags or templates in Proxmox.
            Ok(Err(error)) => unread(TEMPLATE_RETRY, error.reason(), error.to_string()),
            Err((step, error)) => {
                let described = failures::describe(&step, &error);
                let retry = context.retries.failed(
                    &failures::key(template),
                    &failures::PROXMOX_BACKOFF,
                    Some(described.reason),
                );
                let requeue = retry.delay.max(described.retry_after.unwrap_or_default());
                tracing::warn!(template = %name, namespace = %namespace, reason = described.reason, failures = retry.failures, retry_in_ms = failures::millis(requeue), "{}", described.message);
                TemplateRead {
                    backing_off: true,
                    ..unread(requeue, described.reason, described.message)
                }
            }
        },
    )
}

/// `Resolved`: the template's config was read and has what the capacity needs, or what is
/// missing, or why it could not be read (with what the spec alone tells).
fn resolved_condition(config: &Result<VmConfig, Unread>, resolved: &ResolvedCapacity) -> Decided {
    match (config, resolved.missing.is_empty()) {
        (Ok(_), true) => Decided::ok(RESOLVED, "Resolved", ""),
        (Ok(_), false) => Decided::failed(
            RESOLVED,
            "TemplateIncomplete",
            format!(
                "the Proxmox template's config lacks {}",
                resolved.missing.join(", ")
            ),
        ),
        (Err(unread), _) => Decided::failed(
            RESOLVED,
            &unread.reason,
            format!(
                "cannot read the Proxmox template: {}; {}",
                unread.message,
                resolved.spec_only_summary()
            ),
        ),
    }
}

/// The status fields this controller owns, as currently recorded.
fn owned_status(current: &ProxmoxMachineTemplateStatus) -> ProxmoxMachineTemplateStatus {
    ProxmoxMachineTemplateStatus {
        capacity: current.capacity.clone(),
        node_info: current.node_info.clone(),
        conditions: current
            .conditions
            .iter()
            .filter(|c| [RESOLVED, api::conditions::READY].contains(&c.type_.as_str()))
            .cloned()
            .collect(),
    }
}

/// The ProxmoxCluster of the template's cluster: the one the CAPI Cluster named by the
/// template's cluster-name label points at, else the one carrying the same label.
fn find_cluster(
    template: &ProxmoxMachineTemplate,
    namespace: &str,
    reads: &Reads,
) -> Result<Arc<ProxmoxCluster>, Unread> {
    let Some(cluster_name) = template.labels().get(labels::CLUSTER_NAME) else {
        return Err(Unread {
            reason: "ClusterNameLabelMissing".into(),
            message: format!(
                "the template has no {} label naming its cluster, so capmox does not know whose Proxmox credentials to use (ClusterClass topologies set it; add it to templates you create yourself)",
                labels::CLUSTER_NAME
            ),
        });
    };
    let capi_cluster = reads
        .capi_clusters
        .get(&ObjectRef::new(cluster_name).within(namespace));
    let referenced = capi_cluster
        .as_ref()
        .and_then(|c| c.spec.infrastructure_ref.as_ref())
        .filter(|r| r.kind == "ProxmoxCluster" && r.api_group == api::GROUP)
        .and_then(|r| {
            reads
                .clusters
                .get(&ObjectRef::new(&r.name).within(namespace))
        });
    if let Some(cluster) = referenced {
        return Ok(cluster);
    }
    let mut labelled = reads.clusters.state_filter(|c| {
        c.namespace().as_deref() == Some(namespace)
            && c.labels().get(labels::CLUSTER_NAME) == Some(cluster_name)
    });
    labelled.sort_by_key(|c| c.name_any());
    labelled.into_iter().next().ok_or_else(|| Unread {
        reason: "ProxmoxClusterNotFound".into(),
        message: format!(
            "no ProxmoxCluster of cluster {cluster_name:?} in namespace {namespace:?} (neither the Cluster's infrastructureRef nor the {} label finds one)",
            labels::CLUSTER_NAME
        ),
    })
}

/// The config of the Proxmox template the spec clones: by `sourceNode` and `templateID`, or
/// the first copy `templateSelector` chooses. `Ok(Err)`: no (unique) template matches;
/// `Err`: Proxmox failed, with the step it failed in.
async fn template_config(
    context: &Context,
    proxmox: &ProxmoxClient,
    spec: &ProxmoxMachineSpec,
) -> Result<Result<VmConfig, placement::TemplateError>, (String, ProxmoxError)> {
    let (node, vmid) = match (&spec.template_selector, &spec.source_node, spec.template_id) {
        (Some(selector), _, _) => {
            let resources = context
                .inventory
                .resources(proxmox, None)
                .await
                .map_err(|e| ("listing the Proxmox templates".to_owned(), e))?;
            let templates = super::inventory::templates(&resources);
            match placement::select_template(&TagSelector::new(selector), &templates) {
                // Copies on several nodes carry the same name and tags: any one will do.
                Ok(copies) => match copies.into_iter().next() {
                    Some(copy) => (copy.node, copy.vmid),
                    None => return Ok(Err(placement::TemplateError::NoTags)),
                },
                Err(error) => return Ok(Err(error)),
            }
        }
        (None, Some(node), Some(vmid)) => (node.clone(), u32::try_from(vmid).unwrap_or_default()),
        // The API refuses such a spec; nothing can be read.
        _ => return Ok(Err(placement::TemplateError::NoTags)),
    };
    context
        .inventory
        .template_config(proxmox, &node, vmid)
        .await
        .map(Ok)
        .map_err(|e| (format!("reading template {vmid} on {node}"), e))
}

/// A machine's capacity as far as it is known.
#[derive(Clone, Debug, PartialEq)]
pub struct ResolvedCapacity {
    /// `status.capacity`: the resources that are known.
    pub capacity: BTreeMap<String, Quantity>,
    /// `status.nodeInfo` (amd64/linux, Proxmox's and Kubernetes' defaults, when unknown).
    pub node_info: TemplateNodeInfo,
    /// What is not known (a capacity key, or `nodeInfo`).
    pub missing: Vec<&'static str>,
}

impl ResolvedCapacity {
    fn spec_only_summary(&self) -> String {
        let published: Vec<&str> = self.capacity.keys().map(String::as_str).collect();
        let published = if published.is_empty() {
            "nothing".to_owned()
        } else {
            published.join(", ")
        };
        format!(
            "published what the spec gives ({published}); unknown: {} (nodeInfo assumes amd64/linux)",
            self.missing.join(", ")
        )
    }
}

/// Proxmox's defaults for what a VM config may leave out.
const DEFAULT_SOCKETS: u64 = 1;
const DEFAULT_CORES: u64 = 1;
const DEFAULT_MEMORY_MIB: u64 = 512;
const GIB: u64 = 1 << 30;

/// The capacity of a machine cloned with `spec` from the template with `config` (`None`:
/// the template could not be read, so only the spec counts).
///
/// Disk sizes: capmox grows the boot disk by asking Proxmox for `<sizeGb>G`, and Proxmox's `G`
/// is a GiB (2^30 bytes), as is the `G` in a disk's `size=` in its config. So `sizeGb: 20`
/// gives a 20 GiB disk, published as `20Gi` (Kubernetes' `20G` would be 10^9-byte GB, 7 % less).
/// Disks only grow, so the template's disk counts when it is larger than `sizeGb`.
pub fn resolve_capacity(spec: &ProxmoxMachineSpec, config: Option<&VmConfig>) -> ResolvedCapacity {
    let mut capacity = BTreeMap::new();
    let mut missing = Vec::new();
    let resources = [
        (CAPACITY_CPU, cpu_quantity(spec, config)),
        (CAPACITY_MEMORY, memory_quantity(spec, config)),
        (CAPACITY_EPHEMERAL_STORAGE, disk_quantity(spec, config)),
    ];
    for (resource, quantity) in resources {
        match quantity {
            Some(quantity) => {
                capacity.insert(resource.to_owned(), quantity);
            }
            None => missing.push(resource),
        }
    }
    let node_info = match config {
        Some(config) => template_node_info(config),
        None => {
            missing.push("nodeInfo");
            TemplateNodeInfo {
                architecture: Some(NodeArchitecture::Amd64),
                operating_system: Some(NodeOperatingSystem::Linux),
            }
        }
    };
    ResolvedCapacity {
        capacity,
        node_info,
        missing,
    }
}

/// The number `key` of the template's config (Proxmox's `default` when unset); `None` without
/// a config or for a value that is no number.
fn config_number(config: Option<&VmConfig>, key: &str, default: u64) -> Option<u64> {
    let config = config?;
    Some(match config.get(key) {
        Some(value) => value.trim().parse().ok()?,
        None => default,
    })
}

fn from_spec(value: Option<i32>) -> Option<u64> {
    value.and_then(|v| u64::try_from(v).ok())
}

/// Sockets × cores, each from the spec or else the template.
fn cpu_quantity(spec: &ProxmoxMachineSpec, config: Option<&VmConfig>) -> Option<Quantity> {
    let sockets =
        from_spec(spec.num_sockets).or_else(|| config_number(config, "sockets", DEFAULT_SOCKETS));
    let cores = from_spec(spec.num_cores).or_else(|| config_number(config, "cores", DEFAULT_CORES));
    Some(Quantity((sockets? * cores?).to_string()))
}

fn memory_quantity(spec: &ProxmoxMachineSpec, config: Option<&VmConfig>) -> Option<Quantity> {
    let memory = from_spec(spec.memory_mib).or_else(|| match config {
        Some(config) if config.get("memory").is_some() => config.memory_mib(),
        Some(_) => Some(DEFAULT_MEMORY_MIB),
        None => None,
    });
    memory.map(|mib| Quantity(format!("{mib}Mi")))
}

/// The boot disk's size: the larger of the spec's and the template's (a clone never shrinks).
fn disk_quantity(spec: &ProxmoxMachineSpec, config: Option<&VmConfig>) -> Option<Quantity> {
    let boot = spec.disks.as_ref().and_then(|d| d.boot_volume.as_ref());
    let template_disk = config.and_then(|config| {
        let disk = match boot {
            Some(boot) => boot.disk.clone(),
            None => boot_disk(config)?,
        };
        disk_size_bytes(&config.get(&disk)?)
    });
    let wanted = boot
        .and_then(|b| u64::try_from(b.size_gb).ok())
        .map(|gb| gb * GIB);
    wanted
        .into_iter()
        .chain(template_disk)
        .max()
        .map(bytes_quantity)
}

fn template_node_info(config: &VmConfig) -> TemplateNodeInfo {
    TemplateNodeInfo {
        architecture: Some(match config.get("arch").as_deref() {
            Some("aarch64") => NodeArchitecture::Arm64,
            _ => NodeArchitecture::Amd64,
        }),
        operating_system: Some(
            if config.get("ostype").is_some_and(|os| os.starts_with('w')) {
                NodeOperatingSystem::Windows
            } else {
                NodeOperatingSystem::Linux
            },
        ),
    }
}

/// The disk a VM boots from: the first disk of `boot: order=...` (skipping CD-ROMs and NICs),
/// else the legacy `bootdisk`, else the first disk with a size.
fn boot_disk(config: &VmConfig) -> Option<String> {
    let is_disk = |key: &str| {
        config.get(key).is_some_and(|value| {
            let props = parse_property_string(&value, "file");
            props.contains_key("size") && props.get("media").map(String::as_str) != Some("cdrom")
        })
    };
    if let Some(order) = config
        .get("boot")
        .and_then(|boot| parse_property_string(&boot, "legacy").remove("order"))
        && let Some(disk) = order.split(';').map(str::trim).find(|d| is_disk(d))
    {
        return Some(disk.to_owned());
    }
    if let Some(disk) = config.get("bootdisk").filter(|d| is_disk(d)) {
        return Some(disk);
    }
    ["scsi", "virtio", "sata", "ide"].iter().find_map(|prefix| {
        config
            .indexed(prefix)
            .into_iter()
            .map(|(index, _)| format!("{prefix}{index}"))
            .find(|key| is_disk(key))
    })
}

/// Bytes of a disk value's `size=` (`10G`, `512M`, `1T`, `4096K`, or bytes), binary units as
/// Proxmox writes them.
fn disk_size_bytes(value: &str) -> Option<u64> {
    let size = parse_property_string(value, "file").remove("size")?;
    let split = size
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(size.len());
    let (number, unit) = size.split_at(split);
    let factor: u64 = match unit {
        "" => 1,
        "K" => 1 << 10,
        "M" => 1 << 20,
        "G" => 1 << 30,
        "T" => 1 << 40,
        _ => return None,
    };
    match number.parse::<u64>() {
        Ok(whole) => whole.checked_mul(factor),
        // Proxmox may write fractions (`size=1.5G`); whole bytes are enough here.
        Err(_) => {
            let fraction: f64 = number.parse().ok()?;
            let bytes = fraction * factor as f64;
            (bytes.is_finite() && bytes >= 0.0 && bytes < u64::MAX as f64).then_some(bytes as u64)
        }
    }
}

/// `bytes` as a quantity in the largest binary unit that divides it.
fn bytes_quantity(bytes: u64) -> Quantity {
    for (unit, factor) in [
        ("Ti", 1u64 << 40),
        ("Gi", 1 << 30),
        ("Mi", 1 << 20),
        ("Ki", 1 << 10),
    ] {
        if bytes >= factor && bytes.is_multiple_of(factor) {
            return Quantity(format!("{}{unit}", bytes / factor));
        }
    }
    Quantity(bytes.to_string())
}
