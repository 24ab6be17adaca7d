//! A stand-in for CAPI core and KubeadmControlPlane (KCP) — **not CAPI; just enough of it for
//! the sandbox and tests**.
//!
//! It drives capmox's real controllers through the infrastructure-provider contract (v1beta2,
//! as Cluster API defines it for providers) in one namespace, on one machine, without CAPI
//! installed:
//!
//! - **Cluster**: adds the non-controller owner reference Cluster→ProxmoxCluster and the
//!   `cluster.x-k8s.io/cluster-name` label; once the ProxmoxCluster reports
//!   `status.initialization.provisioned`, latches `status.initialization.infrastructureProvisioned`
//!   and copies `status.failureDomains` (sorted by name, missing `controlPlane` → `false`) on every
//!   change. Sets `controlPlaneInitialized` once a control-plane Machine has a node.
//! - **KubeadmControlPlane**: keeps `spec.replicas` control-plane Machines, creating
//!   one at a time (the next once every existing one's ProxmoxMachine is provisioned) in the
//!   failure domain [`failure_domain_for_scale_up`] picks, and deleting one at a time the machine
//!   [`machine_for_scale_down`] picks.
//! - **MachineDeployment**: keeps `spec.replicas` worker Machines, all in the deployment's
//!   single failure domain, created in parallel; scale-down deletes the newest first.
//! - **Machine**: copies `providerID`, addresses and `status.failureDomain` from the
//!   ProxmoxMachine, latches `status.initialization.infrastructureProvisioned` and sets
//!   `status.nodeRef` once the ProxmoxMachine is provisioned (there is no real node).
//! - **Deletion**: a Machine deletes its ProxmoxMachine and waits for it to be gone before
//!   dropping its finalizer; a Cluster deletes its KCPs, MachineDeployments and Machines, then the
//!   ProxmoxCluster, then itself.
//!
//! # What the infrastructure provider must do for the stand-in to make progress
//!
//! - ProxmoxCluster: `status.initialization.provisioned: true` and `status.failureDomains`
//!   (with `controlPlane` written explicitly); nothing is created before provisioned.
//! - ProxmoxMachine: read the zone from the owning Machine's `spec.failureDomain` (found by the
//!   controller owner reference of kind `Machine`), the bootstrap data from the Secret named by
//!   `Machine.spec.bootstrap.dataSecretName` (key `value`, `format: cloud-config` or
//!   `ignition`); set
//!   `spec.providerID` no later than `status.initialization.provisioned: true` (the Machine is
//!   not provisioned without it, and KCP creates the next control-plane machine only after the
//!   previous ProxmoxMachine is provisioned); report `status.addresses` and
//!   `status.failureDomain`; on deletion remove the VM, then its finalizer (the Machine waits).
//!
//! # Simplifications (differences from real CAPI)
//!
//! - No MachineSets: a MachineDeployment owns its Machines directly; no rollouts — changing a
//!   template or version affects only new Machines, and no machine is ever "outdated".
//! - No KubeadmConfig: every Machine gets a fixed bootstrap Secret (`<machine>-bootstrap`) at
//!   creation, workers included (kubeadm would make them wait for the control plane): a
//!   `#cloud-config`, or a small Flatcar-shaped Ignition config (spec 2.3) when the format is
//!   `ignition` — the KCP's `spec.kubeadmConfigSpec.format`, or for a MachineDeployment the
//!   `spec.template.spec.format` of the KubeadmConfigTemplate its `spec.bootstrap.configRef`
//!   names (read if that kind is served; nothing else of either is used).
//! - No nodes, no health checks: `nodeRef` is `{name: <machine name>}` as soon as the
//!   ProxmoxMachine is provisioned with a provider ID.
//! - KCP finds its Cluster through the `cluster.x-k8s.io/cluster-name` label (no
//!   `Cluster.spec.controlPlaneRef`); it waits for the Cluster's infrastructure to be provisioned,
//!   as do MachineDeployments (real MachineSets do not wait).
//! - Failure-domain ties that real KCP breaks at random are broken by name, so tests are
//!   reproducible; ties between machines created in the same second are broken by name too.
//! - Pausing (`Cluster.spec.paused`, or the `cluster.x-k8s.io/paused` annotation on any of the
//!   objects) stops all work on the cluster's objects, deletion included, as in CAPI; there is no
//!   `Paused` condition.
//! - No status on KCP / MachineDeployment objects, no conditions, no events, no remediation, no
//!   ClusterClass, no `controlPlaneEndpoint` copy.
//! - Everything runs as one level-triggered loop: any watch event on the kinds involved
//!   triggers one pass that lists the namespace afresh (no cache, so no duplicate creations
//!   from stale reads) and takes the next step for every object.

use std::collections::{BTreeMap, BTreeSet};
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures::stream::{BoxStream, SelectAll};
use futures::{FutureExt, StreamExt, TryStreamExt};
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference, Time};
use kube::api::{
    ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, Patch, PatchParams,
    PostParams,
};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, Resource, ResourceExt};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use capmox::api::{
    FailureDomain, ProxmoxCluster, ProxmoxMachine, ProxmoxMachineTemplate, TemplateObjectMeta,
    labels,
};
use capmox::capi::{Cluster, ContractVersionedObjectReference, Machine};

/// Finalizer the stand-in keeps on every Machine until its ProxmoxMachine is gone (as CAPI).
pub const MACHINE_FINALIZER: &str = "cluster.x-k8s.io/machine";
/// Finalizer the stand-in keeps on every Cluster until its descendants are gone (as CAPI).
pub const CLUSTER_FINALIZER: &str = "cluster.cluster.x-k8s.io";
/// Annotation that marks a Machine to be deleted first on scale-down (as CAPI).
pub const DELETE_MACHINE_ANNOTATION: &str = "cluster.x-k8s.io/delete-machine";
/// Type of bootstrap Secrets, as CAPI bootstrap providers write them.
pub const BOOTSTRAP_SECRET_TYPE: &str = "cluster.x-k8s.io/secret";
/// Field manager of the stand-in's writes, so they are told apart from capmox's.
pub const FIELD_MANAGER: &str = "capi-standin";

const CLUSTER_API_VERSION: &str = "cluster.x-k8s.io/v1beta2";
const KCP_GROUP: &str = "controlplane.cluster.x-k8s.io";
const BOOTSTRAP_GROUP: &str = "bootstrap.cluster.x-k8s.io";
const KCP_API_VERSION: &str = "controlplane.cluster.x-k8s.io/v1beta2";
const INFRA_API_VERSION: &str = "infrastructure.cluster.x-k8s.io/v1alpha2";
const CLONED_FROM_NAME: &str = "cluster.x-k8s.io/cloned-from-name";
const CLONED_FROM_GROUP_KIND: &str = "cluster.x-k8s.io/cloned-from-groupkind";
/// Longest pause between retries of a failed pass.
const MAX_BACKOFF: Duration = Duration::from_secs(10);

/// What can go wrong while the stand-in reconciles.
#[derive(Debug, thiserror::Error)]
pub enum StandInError {
    /// A Kubernetes API call failed (retried on the next pass).
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    /// An object could not be (de)serialised.
    #[error("JSON: {0}")]
    Json(#[from] serde_json::Error),
    /// An object the stand-in needs is missing or malformed.
    #[error("{kind} {name}: {reason}")]
    Invalid {
        /// Kind of the offending object.
        kind: &'static str,
        /// Its name.
        name: String,
        /// What is wrong.
        reason: String,
    },
    /// A watch stream ended, which kube's watcher never does while the client lives.
    #[error("a watch stream ended")]
    WatchEnded,
}

type Result<T, E = StandInError> = std::result::Result<T, E>;

/// The CAPI core + KCP stand-in for one namespace.
#[derive(Clone)]
pub struct CapiStandIn {
    client: Client,
    namespace: String,
}

/// Everything of the namespace one pass looks at, listed fresh at the start of the pass.
struct Snapshot {
    clusters: Vec<Cluster>,
    proxmox_clusters: Vec<ProxmoxCluster>,
    control_planes: Vec<DynamicObject>,
    deployments: Vec<DynamicObject>,
    machines: Vec<Machine>,
    /// Sorted by name, so each Machine finds its ProxmoxMachine without a scan.
    proxmox_machines: Vec<ProxmoxMachine>,
}

impl Snapshot {
    fn cluster(&self, name: &str) -> Option<&Cluster> {
        self.clusters.iter().find(|c| c.name_any() == name)
    }

    fn proxmox_machine(&self, machine: &Machine) -> Option<&ProxmoxMachine> {
        // Only ProxmoxMachines are this stand-in's business; other kinds are never found.
        let reference = machine
            .spec
            .infrastructure_ref
            .as_ref()
            .filter(|r| r.kind == "ProxmoxMachine" && r.api_group == capmox::api::GROUP)?;
        self.proxmox_machines
            .binary_search_by(|p| p.meta().name.as_deref().cmp(&Some(reference.name.as_str())))
            .ok()
            .map(|i| &self.proxmox_machines[i])
    }

    fn owned_machines(&self, owner_uid: &str) -> Vec<&Machine> {
        self.machines
            .iter()
            .filter(|m| controller_uid(m.meta()) == Some(owner_uid))
            .collect()
    }
}

impl CapiStandIn {
    /// A stand-in for `namespace`; call [`CapiStandIn::run_until`] (or [`CapiStandIn::run`]).
    pub fn new(client: Client, namespace: impl Into<String>) -> Self {
        Self {
            client,
            namespace: namespace.into(),
        }
    }

    /// Runs the stand-in for `namespace` until `shutdown` is cancelled.
    pub async fn run(client: Client, namespace: &str, shutdown: CancellationToken) -> Result<()> {
        Self::new(client, namespace).run_until(shutdown).await
    }

    /// Spawns [`CapiStandIn::run`] on the tokio runtime; errors are logged.
    pub fn spawn(
        client: Client,
        namespace: &str,
        shutdown: CancellationToken,
    ) -> tokio::task::JoinHandle<()> {
        let standin = Self::new(client, namespace);
        tokio::spawn(async move {
            if let Err(error) = standin.run_until(shutdown).await {
                tracing::error!(%error, "CAPI stand-in stopped");
            }
        })
    }

    /// The level-triggered loop: one pass at start, then one after every burst of watch events
    /// (and after a back-off when a pass failed), until `shutdown` is cancelled.
    pub async fn run_until(&self, shutdown: CancellationToken) -> Result<()> {
        let mut events = self.watch_streams();
        let mut dirty = true;
        let mut backoff: Option<Duration> = None;
        let mut last_pass = Duration::ZERO;
        loop {
            if dirty {
                dirty = false;
                // A pass lists every kind; under a steady stream of events (a large fleet) passes
                // would run back to back, so events are gathered for as long as the last pass
                // took (at most a second) and handled in one pass.
                let window = last_pass.min(Duration::from_secs(1));
                if !window.is_zero() {
                    tokio::select! {
                        _ = shutdown.cancelled() => return Ok(()),
                        () = tokio::time::sleep(window) => {}
                    }
                    while let Some(Some(_)) = events.next().now_or_never() {}
                }
                let started = tokio::time::Instant::now();
                let outcome = tokio::select! {
                    _ = shutdown.cancelled() => return Ok(()),
                    outcome = self.pass() => outcome,
                };
                last_pass = started.elapsed();
                backoff = match outcome {
                    Ok(()) => None,
                    Err(error) => {
                        let next =
                            backoff.map_or(Duration::from_millis(50), |b| (b * 2).min(MAX_BACKOFF));
                        if next >= Duration::from_secs(1) {
                            tracing::warn!(%error, retry_in = ?next, "CAPI stand-in keeps failing");
                        } else {
                            tracing::debug!(%error, retry_in = ?next, "CAPI stand-in pass failed");
                        }
                        Some(next)
                    }
                };
            }
            let retry = async {
                match backoff {
                    Some(delay) => tokio::time::sleep(delay).await,
                    None => futures::future::pending().await,
                }
            };
            tokio::select! {
                _ = shutdown.cancelled() => return Ok(()),
                () = retry => dirty = true,
                event = events.next() => match event {
                    Some(Ok(())) => dirty = true,
                    Some(Err(error)) => tracing::debug!(%error, "CAPI stand-in watch error"),
                    None => return Err(StandInError::WatchEnded),
                },
            }
            // Coalesce a burst of events into one pass.
            while let Some(Some(_)) = events.next().now_or_never() {}
        }
    }

    fn watch_streams(&self) -> SelectAll<BoxStream<'static, Result<(), watcher::Error>>> {
        fn typed<K>(api: Api<K>) -> BoxStream<'static, Result<(), watcher::Error>>
        where
            K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
        {
            watcher(api, watcher::Config::default())
                .default_backoff()
                .map_ok(|_| ())
                .boxed()
        }
        let ns = self.namespace.as_str();
        let c = &self.client;
        futures::stream::select_all([
            typed(Api::<Cluster>::namespaced(c.clone(), ns)),
            typed(Api::<ProxmoxCluster>::namespaced(c.clone(), ns)),
            typed(Api::<Machine>::namespaced(c.clone(), ns)),
            typed(Api::<ProxmoxMachine>::namespaced(c.clone(), ns)),
            // A KCP or MachineDeployment may be created before its template.
            typed(Api::<ProxmoxMachineTemplate>::namespaced(c.clone(), ns)),
            typed(self.dynamic(&control_plane_resource())),
            typed(self.dynamic(&deployment_resource())),
        ])
    }

    fn api<K>(&self) -> Api<K>
    where
        K: Resource<Scope = k8s_openapi::NamespaceResourceScope>,
        K::DynamicType: Default,
    {
        Api::namespaced(self.client.clone(), &self.namespace)
    }

    fn dynamic(&self, resource: &ApiResource) -> Api<DynamicObject> {
        Api::namespaced_with(self.client.clone(), &self.namespace, resource)
    }

    async fn snapshot(&self) -> Result<Snapshot> {
        let lp = ListParams::default();
        Ok(Snapshot {
            clusters: self.api::<Cluster>().list(&lp).await?.items,
            proxmox_clusters: self.api::<ProxmoxCluster>().list(&lp).await?.items,
            control_planes: self
                .dynamic(&control_plane_resource())
                .list(&lp)
                .await?
                .items,
            deployments: self.dynamic(&deployment_resource()).list(&lp).await?.items,
            machines: self.api::<Machine>().list(&lp).await?.items,
            proxmox_machines: {
                let mut items = self.api::<ProxmoxMachine>().list(&lp).await?.items;
                items.sort_by(|a, b| a.meta().name.cmp(&b.meta().name));
                items
            },
        })
    }

    /// One level-triggered pass over the namespace; every object is tried, the first error
    /// is returned so the loop retries.
    async fn pass(&self) -> Result<()> {
        let snap = self.snapshot().await?;
        let mut first_error = None;
        let mut note = |what: &str, name: String, result: Result<()>| {
            if let Err(error) = result {
                tracing::debug!(%error, what, name, "CAPI stand-in reconcile failed");
                first_error.get_or_insert(error);
            }
        };
        // As CAPI: nothing of a paused cluster, or an object annotated paused, is touched.
        let paused_clusters: BTreeSet<String> = snap
            .clusters
            .iter()
            .filter(|c| c.spec.paused == Some(true) || is_paused(c.meta()))
            .map(ResourceExt::name_any)
            .collect();
        let skip = |meta: &ObjectMeta, cluster: Option<&String>| {
            is_paused(meta) || cluster.is_some_and(|c| paused_clusters.contains(c))
        };
        for cluster in &snap.clusters {
            if skip(cluster.meta(), Some(&cluster.name_any())) {
                continue;
            }
            note(
                "Cluster",
                cluster.name_any(),
                self.reconcile_cluster(cluster, &snap).await,
            );
        }
        for kcp in &snap.control_planes {
            if skip(&kcp.metadata, kcp.labels().get(labels::CLUSTER_NAME)) {
                continue;
            }
            note(
                "KubeadmControlPlane",
                kcp.name_any(),
                self.reconcile_control_plane(kcp, &snap).await,
            );
        }
        for md in &snap.deployments {
            let cluster = md.data["spec"]["clusterName"].as_str().map(String::from);
            if skip(&md.metadata, cluster.as_ref()) {
                continue;
            }
            note(
                "MachineDeployment",
                md.name_any(),
                self.reconcile_deployment(md, &snap).await,
            );
        }
        for machine in &snap.machines {
            if skip(machine.meta(), Some(&machine.spec.cluster_name)) {
                continue;
            }
            note(
                "Machine",
                machine.name_any(),
                self.reconcile_machine(machine, &snap).await,
            );
        }
        first_error.map_or(Ok(()), Err)
    }

    // ---------------------------------------------------------------- Cluster

    async fn reconcile_cluster(&self, cluster: &Cluster, snap: &Snapshot) -> Result<()> {
        let name = cluster.name_any();
        let api = self.api::<Cluster>();
        if cluster.meta().deletion_timestamp.is_some() {
            return self.delete_cluster(cluster, snap).await;
        }
        if !has_finalizer(cluster.meta(), CLUSTER_FINALIZER) {
            add_finalizer(&api, cluster.meta(), CLUSTER_FINALIZER).await?;
        }
        let status = cluster.status.clone().unwrap_or_default();
        let mut provisioned = status
            .initialization
            .as_ref()
            .and_then(|i| i.infrastructure_provisioned)
            == Some(true);
        let mut failure_domains = status.failure_domains.clone();
        match &cluster.spec.infrastructure_ref {
            // CAPI marks a cluster without infrastructure provisioned at once.
            None => provisioned = true,
            Some(reference) => {
                let Some(infra) = snap
                    .proxmox_clusters
                    .iter()
                    .find(|p| p.name_any() == reference.name)
                else {
                    return Ok(()); // woken when it appears
                };
                self.adopt_proxmox_cluster(cluster, infra).await?;
                if infra.is_provisioned() {
                    provisioned = true;
                }
                if provisioned {
                    let domains = infra.status.as_ref().map(|s| s.failure_domains.as_slice());
                    failure_domains = normalized_failure_domains(domains.unwrap_or_default());
                }
            }
        }
        if !provisioned {
            return Ok(());
        }
        let control_plane_initialized = status
            .initialization
            .as_ref()
            .and_then(|i| i.control_plane_initialized)
            == Some(true)
            || snap.machines.iter().any(|m| {
                m.spec.cluster_name == name
                    && m.labels().contains_key(labels::CONTROL_PLANE)
                    && m.status.as_ref().is_some_and(|s| s.node_ref.is_some())
            });
        let initialization = status.initialization.clone().unwrap_or_default();
        let unchanged = initialization.infrastructure_provisioned == Some(true)
            && (initialization.control_plane_initialized == Some(true))
                == control_plane_initialized
            && status.failure_domains == failure_domains;
        if unchanged {
            return Ok(());
        }
        let mut init = json!({"infrastructureProvisioned": true});
        if control_plane_initialized {
            init["controlPlaneInitialized"] = json!(true);
        }
        let domains = if failure_domains.is_empty() {
            Value::Null // the list has minItems 1: remove it rather than write []
        } else {
            serde_json::to_value(&failure_domains)?
        };
        let patch = json!({"status": {"initialization": init, "failureDomains": domains}});
        api.patch_status(&name, &patch_params(), &Patch::Merge(patch))
            .await?;
        Ok(())
    }

    /// CAPI core's `ensureOwnerRefAndLabel`: a plain (non-controller) owner reference and the
    /// cluster-name label on the InfraCluster.
    async fn adopt_proxmox_cluster(&self, cluster: &Cluster, infra: &ProxmoxCluster) -> Result<()> {
        let name = cluster.name_any();
        let uid = cluster.uid().unwrap_or_default();
        let owned = infra.owner_references().iter().any(|o| {
            o.kind == "Cluster" && o.api_version.starts_with("cluster.x-k8s.io/") && o.uid == uid
        });
        let labelled = infra.labels().get(labels::CLUSTER_NAME) == Some(&name);
        if owned && labelled {
            return Ok(());
        }
        let api = self.api::<ProxmoxCluster>();
        if !owned {
            let mut refs = infra.owner_references().to_vec();
            refs.retain(|o| {
                !(o.kind == "Cluster" && o.api_version.starts_with("cluster.x-k8s.io/"))
            });
            refs.push(OwnerReference {
                api_version: CLUSTER_API_VERSION.into(),
                kind: "Cluster".into(),
                name: name.clone(),
                uid,
                controller: None,
                block_owner_deletion: Some(true),
            });
            replace_owner_references(&api, infra.meta(), refs).await?;
        }
        if !labelled {
            let patch = json!({"metadata": {"labels": {labels::CLUSTER_NAME: name}}});
            api.patch(&infra.name_any(), &patch_params(), &Patch::Merge(patch))
                .await?;
        }
        Ok(())
    }

    async fn delete_cluster(&self, cluster: &Cluster, snap: &Snapshot) -> Result<()> {
        if !has_finalizer(cluster.meta(), CLUSTER_FINALIZER) {
            return Ok(());
        }
        let name = cluster.name_any();
        let mut waiting = false;
        let kcp_api = self.dynamic(&control_plane_resource());
        for kcp in &snap.control_planes {
            if kcp.labels().get(labels::CLUSTER_NAME) == Some(&name) {
                waiting = true;
                if kcp.metadata.deletion_timestamp.is_none() {
                    delete_ignoring_missing(&kcp_api, &kcp.name_any()).await?;
                }
            }
        }
        let md_api = self.dynamic(&deployment_resource());
        for md in &snap.deployments {
            if md.data["spec"]["clusterName"].as_str() == Some(name.as_str()) {
                waiting = true;
                if md.metadata.deletion_timestamp.is_none() {
                    delete_ignoring_missing(&md_api, &md.name_any()).await?;
                }
            }
        }
        let machine_api = self.api::<Machine>();
        for machine in &snap.machines {
            if machine.spec.cluster_name == name {
                waiting = true;
                if machine.meta().deletion_timestamp.is_none() {
                    delete_ignoring_missing(&machine_api, &machine.name_any()).await?;
                }
            }
        }
        if waiting {
            return Ok(()); // woken as they go
        }
        if let Some(reference) = &cluster.spec.infrastructure_ref
            && let Some(infra) = snap
                .proxmox_clusters
                .iter()
                .find(|p| p.name_any() == reference.name)
        {
            if infra.meta().deletion_timestamp.is_none() {
                delete_ignoring_missing(&self.api::<ProxmoxCluster>(), &infra.name_any()).await?;
            }
            return Ok(()); // capmox's finalizer cleans up; woken when it is gone
        }
        remove_finalizer(&self.api::<Cluster>(), cluster.meta(), CLUSTER_FINALIZER).await
    }

    // ---------------------------------------------------------------- KubeadmControlPlane

    async fn reconcile_control_plane(&self, kcp: &DynamicObject, snap: &Snapshot) -> Result<()> {
        if kcp.metadata.deletion_timestamp.is_some() {
            return Ok(()); // its Machines go with it (owner references)
        }
        let name = kcp.name_any();
        let Some(cluster_name) = kcp.labels().get(labels::CLUSTER_NAME).cloned() else {
            tracing::warn!(kcp = %name, "KubeadmControlPlane without the {} label is ignored", labels::CLUSTER_NAME);
            return Ok(());
        };
        let spec: KcpSpec = match serde_json::from_value(kcp.data["spec"].clone()) {
            Ok(spec) => spec,
            Err(error) => {
                tracing::warn!(kcp = %name, %error, "malformed KubeadmControlPlane is ignored");
                return Ok(());
            }
        };
        let Some(cluster) = snap.cluster(&cluster_name) else {
            return Ok(());
        };
        if cluster.meta().deletion_timestamp.is_some() || !infrastructure_provisioned(cluster) {
            return Ok(());
        }
        let uid = kcp.uid().unwrap_or_default();
        let owner = controller_ref(KCP_API_VERSION, "KubeadmControlPlane", &name, &uid);
        let mut machine_labels = template_labels(spec.machine_template.metadata.as_ref());
        machine_labels.insert(labels::CLUSTER_NAME.into(), cluster_name.clone());
        machine_labels.insert(labels::CONTROL_PLANE.into(), String::new());
        let blueprint = Blueprint {
            owner,
            cluster_name: cluster_name.clone(),
            labels: machine_labels,
            template: spec.machine_template.spec.infrastructure_ref.clone(),
            version: spec.version.clone(),
            bootstrap: BootstrapSource::Format(
                spec.kubeadm_config_spec
                    .and_then(|c| c.format)
                    .unwrap_or_default(),
            ),
        };
        let machines = snap.owned_machines(&uid);
        self.repair_machines(&blueprint, &machines, snap).await?;
        if machines
            .iter()
            .any(|m| m.meta().deletion_timestamp.is_some())
        {
            return Ok(()); // one change at a time, like KCP
        }
        let replicas = usize::try_from(spec.replicas.unwrap_or(1)).unwrap_or(0);
        let placements: Vec<MachinePlacement> =
            machines.iter().map(|m| MachinePlacement::of(m)).collect();
        let domains = &cluster
            .status
            .as_ref()
            .map(|s| s.failure_domains.clone())
            .unwrap_or_default();
        if machines.len() < replicas {
            let all_provisioned = machines.iter().all(|m| {
                snap.proxmox_machine(m)
                    .is_some_and(ProxmoxMachine::is_provisioned)
            });
            if all_provisioned {
                let domain = failure_domain_for_scale_up(domains, &placements);
                self.create_machine(&blueprint, &name, domain).await?;
            }
        } else if machines.len() > replicas
            && let Some(victim) = machine_for_scale_down(domains, &placements)
        {
            tracing::info!(kcp = %name, machine = %victim, "stand-in KCP scales down");
            delete_ignoring_missing(&self.api::<Machine>(), &victim).await?;
        }
        Ok(())
    }

    // ---------------------------------------------------------------- MachineDeployment

    async fn reconcile_deployment(&self, md: &DynamicObject, snap: &Snapshot) -> Result<()> {
        if md.metadata.deletion_timestamp.is_some() {
            return Ok(());
        }
        let name = md.name_any();
        let spec: MdSpec = match serde_json::from_value(md.data["spec"].clone()) {
            Ok(spec) => spec,
            Err(error) => {
                tracing::warn!(md = %name, %error, "malformed MachineDeployment is ignored");
                return Ok(());
            }
        };
        let Some(cluster) = snap.cluster(&spec.cluster_name) else {
            return Ok(());
        };
        if cluster.meta().deletion_timestamp.is_some() || !infrastructure_provisioned(cluster) {
            return Ok(());
        }
        let uid = md.uid().unwrap_or_default();
        let mut machine_labels = template_labels(spec.template.metadata.as_ref());
        machine_labels.insert(labels::CLUSTER_NAME.into(), spec.cluster_name.clone());
        machine_labels.insert(labels::DEPLOYMENT_NAME.into(), name.clone());
        let blueprint = Blueprint {
            owner: controller_ref(CLUSTER_API_VERSION, "MachineDeployment", &name, &uid),
            cluster_name: spec.cluster_name.clone(),
            labels: machine_labels,
            template: spec.template.spec.infrastructure_ref.clone(),
            version: spec.template.spec.version.clone(),
            bootstrap: BootstrapSource::Template(
                spec.template
                    .spec
                    .bootstrap
                    .and_then(|b| b.config_ref)
                    .filter(|r| r.kind == "KubeadmConfigTemplate")
                    .map(|r| r.name),
            ),
        };
        let machines = snap.owned_machines(&uid);
        self.repair_machines(&blueprint, &machines, snap).await?;
        let active: Vec<MachinePlacement> = machines
            .iter()
            .map(|m| MachinePlacement::of(m))
            .filter(|m| !m.deleting)
            .collect();
        let replicas = usize::try_from(spec.replicas.unwrap_or(1)).unwrap_or(0);
        let domain = spec.template.spec.failure_domain.filter(|d| !d.is_empty());
        if active.len() < replicas {
            let creations = (active.len()..replicas)
                .map(|_| self.create_machine(&blueprint, &name, domain.clone()));
            for result in futures::future::join_all(creations).await {
                result?;
            }
        } else if active.len() > replicas {
            let api = self.api::<Machine>();
            for victim in machines_for_deployment_scale_down(&active, active.len() - replicas) {
                tracing::info!(md = %name, machine = %victim, "stand-in MachineDeployment scales down");
                delete_ignoring_missing(&api, &victim).await?;
            }
        }
        Ok(())
    }

    // ---------------------------------------------------------------- Machine creation

    /// Creates the Machine, then its bootstrap Secret and ProxmoxMachine.
    async fn create_machine(
        &self,
        blueprint: &Blueprint,
        prefix: &str,
        failure_domain: Option<String>,
    ) -> Result<()> {
        let template = self.template(&blueprint.template).await?;
        let name = format!("{prefix}-{}", random_suffix());
        let mut spec = json!({
            "clusterName": blueprint.cluster_name,
            "bootstrap": {"dataSecretName": bootstrap_secret_name(&name)},
            "infrastructureRef": {
                "apiGroup": capmox::api::GROUP,
                "kind": "ProxmoxMachine",
                "name": name,
            },
        });
        if let Some(domain) = &failure_domain {
            spec["failureDomain"] = json!(domain);
        }
        if let Some(version) = &blueprint.version {
            spec["version"] = json!(version);
        }
        let object = json!({
            "apiVersion": CLUSTER_API_VERSION,
            "kind": "Machine",
            "metadata": {
                "name": name,
                "namespace": self.namespace,
                "labels": blueprint.labels,
                "finalizers": [MACHINE_FINALIZER],
                "ownerReferences": [blueprint.owner],
            },
            "spec": spec,
        });
        let object: DynamicObject = serde_json::from_value(object)?;
        let created = self
            .dynamic(&ApiResource::erase::<Machine>(&()))
            .create(&post_params(), &object)
            .await?;
        tracing::info!(machine = %name, failure_domain = ?failure_domain, "stand-in created a Machine");
        let uid = created.uid().unwrap_or_default();
        self.create_machine_parts(blueprint, &name, &uid, &template)
            .await
    }

    /// Re-creates the bootstrap Secret and ProxmoxMachine of a Machine whose creation was
    /// interrupted (never for a deleting or provisioned Machine).
    async fn repair_machines(
        &self,
        blueprint: &Blueprint,
        machines: &[&Machine],
        snap: &Snapshot,
    ) -> Result<()> {
        for machine in machines {
            let provisioned = machine.spec.provider_id.is_some()
                || machine
                    .status
                    .as_ref()
                    .and_then(|s| s.initialization.as_ref())
                    .and_then(|i| i.infrastructure_provisioned)
                    == Some(true);
            if machine.meta().deletion_timestamp.is_some()
                || provisioned
                || snap.proxmox_machine(machine).is_some()
            {
                continue;
            }
            let template = self.template(&blueprint.template).await?;
            let uid = machine.uid().unwrap_or_default();
            self.create_machine_parts(blueprint, &machine.name_any(), &uid, &template)
                .await?;
        }
        Ok(())
    }

    /// The bootstrap format for a Blueprint's new Machine (`cloud-config` unless it says otherwise).
    async fn bootstrap_format(&self, source: &BootstrapSource) -> Result<String> {
        let name = match source {
            BootstrapSource::Format(format) => return Ok(format.clone()),
            BootstrapSource::Template(None) => return Ok(String::new()),
            BootstrapSource::Template(Some(name)) => name,
        };
        let template = self
            .dynamic(&kubeadm_config_template_resource())
            .get_opt(name)
            .await?;
        Ok(template
            .and_then(|t| {
                t.data["spec"]["template"]["spec"]["format"]
                    .as_str()
                    .map(str::to_owned)
            })
            .unwrap_or_default())
    }

    async fn template(
        &self,
        reference: &ContractVersionedObjectReference,
    ) -> Result<DynamicObject> {
        if reference.kind != "ProxmoxMachineTemplate" {
            return Err(StandInError::Invalid {
                kind: "template reference",
                name: reference.name.clone(),
                reason: format!("kind {} is not ProxmoxMachineTemplate", reference.kind),
            });
        }
        let api = self.dynamic(&ApiResource::erase::<ProxmoxMachineTemplate>(&()));
        api.get_opt(&reference.name)
            .await?
            .ok_or_else(|| StandInError::Invalid {
                kind: "ProxmoxMachineTemplate",
                name: reference.name.clone(),
                reason: "not found".into(),
            })
    }

    async fn create_machine_parts(
        &self,
        blueprint: &Blueprint,
        name: &str,
        machine_uid: &str,
        template: &DynamicObject,
    ) -> Result<()> {
        let owner = controller_ref(CLUSTER_API_VERSION, "Machine", name, machine_uid);
        let (value, format) = if self.bootstrap_format(&blueprint.bootstrap).await? == "ignition" {
            (bootstrap_ignition(name), "ignition")
        } else {
            (bootstrap_cloud_config(name), "cloud-config")
        };
        let secret = Secret {
            metadata: ObjectMeta {
                name: Some(bootstrap_secret_name(name)),
                namespace: Some(self.namespace.clone()),
                labels: Some(BTreeMap::from([(
                    labels::CLUSTER_NAME.to_string(),
                    blueprint.cluster_name.clone(),
                )])),
                owner_references: Some(vec![owner.clone()]),
                ..Default::default()
            },
            type_: Some(BOOTSTRAP_SECRET_TYPE.into()),
            data: Some(BTreeMap::from([
                ("value".to_string(), ByteString(value.into_bytes())),
                ("format".to_string(), ByteString(format.as_bytes().to_vec())),
            ])),
            ..Default::default()
        };
        create_ignoring_existing(&self.api::<Secret>(), &secret).await?;

        let template_meta = template.data["spec"]["template"]["metadata"].clone();
        let meta: TemplateObjectMeta = serde_json::from_value(template_meta).unwrap_or_default();
        let mut infra_labels = meta.labels;
        infra_labels.extend(blueprint.labels.clone());
        let mut annotations = meta.annotations;
        annotations.insert(CLONED_FROM_NAME.into(), template.name_any());
        annotations.insert(
            CLONED_FROM_GROUP_KIND.into(),
            format!("ProxmoxMachineTemplate.{}", capmox::api::GROUP),
        );
        let object = json!({
            "apiVersion": INFRA_API_VERSION,
            "kind": "ProxmoxMachine",
            "metadata": {
                "name": name,
                "namespace": self.namespace,
                "labels": infra_labels,
                "annotations": annotations,
                "ownerReferences": [owner],
            },
            "spec": template.data["spec"]["template"]["spec"].clone(),
        });
        let object: DynamicObject = serde_json::from_value(object)?;
        let api = self.dynamic(&ApiResource::erase::<ProxmoxMachine>(&()));
        create_ignoring_existing(&api, &object).await
    }

    // ---------------------------------------------------------------- Machine

    async fn reconcile_machine(&self, machine: &Machine, snap: &Snapshot) -> Result<()> {
        let api = self.api::<Machine>();
        let name = machine.name_any();
        let infra = snap.proxmox_machine(machine);
        if machine.meta().deletion_timestamp.is_some() {
            if !has_finalizer(machine.meta(), MACHINE_FINALIZER) {
                return Ok(());
            }
            if let Some(infra) = infra {
                if infra.meta().deletion_timestamp.is_none() {
                    let pm_api = self.api::<ProxmoxMachine>();
                    delete_ignoring_missing(&pm_api, &infra.name_any()).await?;
                }
                return Ok(()); // capmox's finalizer removes the VM; woken when it is gone
            }
            return remove_finalizer(&api, machine.meta(), MACHINE_FINALIZER).await;
        }
        if !has_finalizer(machine.meta(), MACHINE_FINALIZER) {
            add_finalizer(&api, machine.meta(), MACHINE_FINALIZER).await?;
        }
        let Some(infra) = infra else {
            return Ok(());
        };
        self.adopt_proxmox_machine(machine, infra).await?;

        let provider_id = infra.spec.provider_id.clone().filter(|p| !p.is_empty());
        if provider_id.is_some() && machine.spec.provider_id != provider_id {
            let patch = json!({"spec": {"providerID": provider_id}});
            api.patch(&name, &patch_params(), &Patch::Merge(patch))
                .await?;
        }
        let current = machine.status.clone().unwrap_or_default();
        let infra_status = infra.status.clone().unwrap_or_default();
        // CAPI waits for the provider ID even when the InfraMachine says provisioned.
        let provisioned = current
            .initialization
            .as_ref()
            .and_then(|i| i.infrastructure_provisioned)
            == Some(true)
            || (ProxmoxMachine::is_provisioned(infra) && provider_id.is_some());
        let mut patch = serde_json::Map::new();
        if !infra_status.addresses.is_empty() && infra_status.addresses != current.addresses {
            patch.insert(
                "addresses".into(),
                serde_json::to_value(&infra_status.addresses)?,
            );
        }
        if infra_status.failure_domain.is_some()
            && infra_status.failure_domain != current.failure_domain
        {
            patch.insert("failureDomain".into(), json!(infra_status.failure_domain));
        }
        if provisioned {
            if current
                .initialization
                .as_ref()
                .and_then(|i| i.infrastructure_provisioned)
                != Some(true)
            {
                patch.insert(
                    "initialization".into(),
                    json!({"infrastructureProvisioned": true}),
                );
            }
            if current.node_ref.is_none() {
                patch.insert("nodeRef".into(), json!({"name": name}));
            }
        }
        if !patch.is_empty() {
            api.patch_status(
                &name,
                &patch_params(),
                &Patch::Merge(json!({"status": patch})),
            )
            .await?;
        }
        Ok(())
    }

    /// CAPI's `ensureExternalOwnershipAndWatch`: the InfraMachine is controlled by its Machine
    /// and carries the cluster-name label.
    async fn adopt_proxmox_machine(&self, machine: &Machine, infra: &ProxmoxMachine) -> Result<()> {
        let uid = machine.uid().unwrap_or_default();
        let api = self.api::<ProxmoxMachine>();
        if controller_uid(infra.meta()) != Some(uid.as_str()) {
            let mut refs: Vec<OwnerReference> = infra
                .owner_references()
                .iter()
                .filter(|o| o.controller != Some(true))
                .cloned()
                .collect();
            refs.push(controller_ref(
                CLUSTER_API_VERSION,
                "Machine",
                &machine.name_any(),
                &uid,
            ));
            replace_owner_references(&api, infra.meta(), refs).await?;
        }
        let cluster_name = &machine.spec.cluster_name;
        if !cluster_name.is_empty()
            && infra.labels().get(labels::CLUSTER_NAME) != Some(cluster_name)
        {
            let patch = json!({"metadata": {"labels": {labels::CLUSTER_NAME: cluster_name}}});
            api.patch(&infra.name_any(), &patch_params(), &Patch::Merge(patch))
                .await?;
        }
        Ok(())
    }
}

// -------------------------------------------------------------------- failure-domain choices

/// A machine as the scale decisions see it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MachinePlacement {
    /// Machine name.
    pub name: String,
    /// `spec.failureDomain` (`None` for none or empty).
    pub failure_domain: Option<String>,
    /// `metadata.creationTimestamp`.
    pub created: Option<Time>,
    /// Being deleted.
    pub deleting: bool,
    /// Carries the `cluster.x-k8s.io/delete-machine` annotation.
    pub delete_requested: bool,
}

impl MachinePlacement {
    /// The placement facts of a Machine.
    pub fn of(machine: &Machine) -> Self {
        Self {
            name: machine.name_any(),
            failure_domain: machine
                .spec
                .failure_domain
                .clone()
                .filter(|d| !d.is_empty()),
            created: machine.meta().creation_timestamp.clone(),
            deleting: machine.meta().deletion_timestamp.is_some(),
            delete_requested: machine
                .annotations()
                .contains_key(DELETE_MACHINE_ANNOTATION),
        }
    }

    fn age_key(&self) -> (Option<Time>, String) {
        (self.created.clone(), self.name.clone())
    }
}

/// KCP's choice of failure domain for a new control-plane machine: among the
/// domains with `controlPlane: true`, the one with the fewest non-deleting machines, then the
/// fewest machines overall, then — where KCP is random — the first by name. `None` when no
/// domain is control-plane eligible.
pub fn failure_domain_for_scale_up(
    domains: &[FailureDomain],
    machines: &[MachinePlacement],
) -> Option<String> {
    control_plane_domains(domains)
        .into_iter()
        .min_by_key(|domain| {
            let in_domain = machines
                .iter()
                .filter(|m| m.failure_domain.as_deref() == Some(domain.as_str()));
            let all = in_domain.clone().count();
            let priority = in_domain.filter(|m| !m.deleting).count();
            (priority, all, domain.clone())
        })
}

/// KCP's choice of the control-plane machine to delete on scale-down, by name.
///
/// Eligible: machines marked with the delete-machine annotation if any, else all (none is ever
/// outdated here), deleting ones excluded. If an eligible machine sits outside the current
/// control-plane domains, the domain of the oldest such one is used; otherwise the domain with
/// the most eligible machines, then the most machines overall, then the first by name. Within
/// it the oldest eligible machine (creation time, then name) goes.
pub fn machine_for_scale_down(
    domains: &[FailureDomain],
    machines: &[MachinePlacement],
) -> Option<String> {
    let active: Vec<&MachinePlacement> = machines.iter().filter(|m| !m.deleting).collect();
    let marked: Vec<&MachinePlacement> = active
        .iter()
        .copied()
        .filter(|m| m.delete_requested)
        .collect();
    let eligible = if marked.is_empty() { active } else { marked };
    let candidates = control_plane_domains(domains);
    let in_candidates = |m: &MachinePlacement| {
        m.failure_domain
            .as_ref()
            .is_some_and(|d| candidates.contains(d))
    };
    let domain: Option<String> = match eligible
        .iter()
        .filter(|m| !in_candidates(m))
        .min_by_key(|m| m.age_key())
    {
        Some(orphan) => orphan.failure_domain.clone(),
        None => {
            let best = candidates
                .iter()
                .map(|domain| {
                    let count = |set: &mut dyn Iterator<Item = &MachinePlacement>| {
                        set.filter(|m| m.failure_domain.as_deref() == Some(domain.as_str()))
                            .count()
                    };
                    let priority = count(&mut eligible.iter().copied());
                    let all = count(&mut machines.iter());
                    (priority, all, domain)
                })
                .filter(|(priority, _, _)| *priority > 0)
                // Most first; among equals the first by name (max_by_key keeps the last max).
                .max_by_key(|(priority, all, domain)| {
                    (*priority, *all, std::cmp::Reverse((*domain).clone()))
                })?;
            Some(best.2.clone())
        }
    };
    eligible
        .into_iter()
        .filter(|m| m.failure_domain == domain)
        .min_by_key(|m| m.age_key())
        .map(|m| m.name.clone())
}

/// The worker machines a MachineDeployment deletes to shed `count` replicas: those marked
/// with the delete-machine annotation first, then the newest (creation time, then name).
pub fn machines_for_deployment_scale_down(
    machines: &[MachinePlacement],
    count: usize,
) -> Vec<String> {
    let mut active: Vec<&MachinePlacement> = machines.iter().filter(|m| !m.deleting).collect();
    active.sort_by_key(|m| (!m.delete_requested, std::cmp::Reverse(m.age_key())));
    active
        .into_iter()
        .take(count)
        .map(|m| m.name.clone())
        .collect()
}

/// Names of the control-plane-eligible domains (missing `controlPlane` counts as false), sorted.
fn control_plane_domains(domains: &[FailureDomain]) -> BTreeSet<String> {
    domains
        .iter()
        .filter(|d| d.control_plane == Some(true))
        .map(|d| d.name.clone())
        .collect()
}

/// The InfraCluster's domains as CAPI core copies them: sorted by name, `controlPlane` explicit.
fn normalized_failure_domains(domains: &[FailureDomain]) -> Vec<FailureDomain> {
    let mut out: Vec<FailureDomain> = domains
        .iter()
        .map(|d| FailureDomain {
            control_plane: Some(d.control_plane == Some(true)),
            ..d.clone()
        })
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

// -------------------------------------------------------------------- test and sandbox helpers

/// What [`create_example_cluster`] builds: a cluster, its infrastructure, templates, a KCP and a
/// MachineDeployment, with names derived from `name`.
#[derive(Clone, Debug)]
pub struct ExampleCluster {
    /// Namespace of every object.
    pub namespace: String,
    /// Name of the Cluster and of the ProxmoxCluster.
    pub name: String,
    /// `ProxmoxCluster.spec`.
    pub proxmox_cluster_spec: Value,
    /// `spec.template.spec` of both ProxmoxMachineTemplates.
    pub machine_spec: Value,
    /// `spec.template.spec` of the workers' template, when it differs from `machine_spec`.
    pub worker_machine_spec: Option<Value>,
    /// Control-plane replicas.
    pub control_plane_replicas: i32,
    /// Worker replicas.
    pub worker_replicas: i32,
    /// The MachineDeployment's failure domain.
    pub worker_failure_domain: Option<String>,
    /// Kubernetes version written to the KCP and the MachineDeployment.
    pub version: String,
    /// `spec.template.metadata.labels` of both ProxmoxMachineTemplates.
    pub machine_template_labels: BTreeMap<String, String>,
    /// Labels of every object of the cluster and of every machine made for it (e.g.
    /// `cluster.x-k8s.io/watch-filter`, which must reach them all).
    pub labels: BTreeMap<String, String>,
    /// Bootstrap data format (`ignition` for Flatcar): the KCP's `kubeadmConfigSpec.format` and
    /// that of a KubeadmConfigTemplate for the workers. `None`: cloud-config, and no template.
    pub bootstrap_format: Option<String>,
}

impl ExampleCluster {
    /// Defaults: 1 control-plane machine, 0 workers, no worker failure domain, v1.33.0, no
    /// template labels, cloud-config bootstrap data.
    pub fn new(
        namespace: impl Into<String>,
        name: impl Into<String>,
        proxmox_cluster_spec: Value,
        machine_spec: Value,
    ) -> Self {
        Self {
            namespace: namespace.into(),
            name: name.into(),
            proxmox_cluster_spec,
            machine_spec,
            worker_machine_spec: None,
            control_plane_replicas: 1,
            worker_replicas: 0,
            worker_failure_domain: None,
            version: "v1.33.0".into(),
            machine_template_labels: BTreeMap::new(),
            labels: BTreeMap::new(),
            bootstrap_format: None,
        }
    }

    /// Name of the KubeadmControlPlane (and of the control-plane template).
    pub fn control_plane_name(&self) -> String {
        format!("{}-control-plane", self.name)
    }

    /// Name of the MachineDeployment (and of the worker template).
    pub fn workers_name(&self) -> String {
        format!("{}-workers", self.name)
    }
}

/// Creates the objects of an example cluster, as `clusterctl generate cluster` would.
pub async fn create_example_cluster(client: &Client, example: &ExampleCluster) -> Result<()> {
    let ns = example.namespace.as_str();
    let name = example.name.as_str();
    let infra_ref = |kind: &str, name: &str| json!({"apiGroup": capmox::api::GROUP, "kind": kind, "name": name});
    let cluster = json!({
        "apiVersion": CLUSTER_API_VERSION, "kind": "Cluster",
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "infrastructureRef": infra_ref("ProxmoxCluster", name),
            "controlPlaneRef": {"apiGroup": KCP_GROUP, "kind": "KubeadmControlPlane", "name": example.control_plane_name()},
        },
    });
    let proxmox_cluster = json!({
        "apiVersion": INFRA_API_VERSION, "kind": "ProxmoxCluster",
        "metadata": {"name": name, "namespace": ns},
        "spec": example.proxmox_cluster_spec,
    });
    let template = |template_name: String, spec: &Value| {
        let mut template = json!({"spec": spec});
        if !example.machine_template_labels.is_empty() {
            template["metadata"] = json!({"labels": example.machine_template_labels});
        }
        json!({
            "apiVersion": INFRA_API_VERSION, "kind": "ProxmoxMachineTemplate",
            // As capmox's cluster templates label them, so their capacity is published.
            "metadata": {"name": template_name, "namespace": ns,
                         "labels": {labels::CLUSTER_NAME: name}},
            "spec": {"template": template},
        })
    };
    let mut kcp = json!({
        "apiVersion": KCP_API_VERSION, "kind": "KubeadmControlPlane",
        "metadata": {"name": example.control_plane_name(), "namespace": ns,
                     "labels": {labels::CLUSTER_NAME: name}},
        "spec": {
            "replicas": example.control_plane_replicas,
            "version": example.version,
            "machineTemplate": {"spec": {"infrastructureRef": infra_ref("ProxmoxMachineTemplate", &example.control_plane_name())}},
        },
    });
    if let Some(format) = &example.bootstrap_format {
        kcp["spec"]["kubeadmConfigSpec"] = json!({"format": format});
    }
    let mut md_template_spec = json!({
        "clusterName": name,
        "version": example.version,
        "bootstrap": {"configRef": {"apiGroup": "bootstrap.cluster.x-k8s.io", "kind": "KubeadmConfigTemplate", "name": example.workers_name()}},
        "infrastructureRef": infra_ref("ProxmoxMachineTemplate", &example.workers_name()),
    });
    if let Some(domain) = &example.worker_failure_domain {
        md_template_spec["failureDomain"] = json!(domain);
    }
    let md = json!({
        "apiVersion": CLUSTER_API_VERSION, "kind": "MachineDeployment",
        "metadata": {"name": example.workers_name(), "namespace": ns,
                     "labels": {labels::CLUSTER_NAME: name}},
        "spec": {
            "clusterName": name,
            "replicas": example.worker_replicas,
            "selector": {"matchLabels": {labels::DEPLOYMENT_NAME: example.workers_name()}},
            "template": {
                "metadata": {"labels": {labels::DEPLOYMENT_NAME: example.workers_name()}},
                "spec": md_template_spec,
            },
        },
    });
    let mut objects = vec![
        (ApiResource::erase::<Cluster>(&()), cluster),
        (ApiResource::erase::<ProxmoxCluster>(&()), proxmox_cluster),
        (
            ApiResource::erase::<ProxmoxMachineTemplate>(&()),
            template(example.control_plane_name(), &example.machine_spec),
        ),
        (
            ApiResource::erase::<ProxmoxMachineTemplate>(&()),
            template(
                example.workers_name(),
                example
                    .worker_machine_spec
                    .as_ref()
                    .unwrap_or(&example.machine_spec),
            ),
        ),
        (control_plane_resource(), kcp),
        (deployment_resource(), md),
    ];
    if let Some(format) = &example.bootstrap_format {
        let template = json!({
            "apiVersion": format!("{BOOTSTRAP_GROUP}/v1beta2"), "kind": "KubeadmConfigTemplate",
            "metadata": {"name": example.workers_name(), "namespace": ns},
            "spec": {"template": {"spec": {"format": format}}},
        });
        objects.insert(0, (kubeadm_config_template_resource(), template));
    }
    for (resource, mut object) in objects {
        // The cluster's labels go on each object and on the templates machines are made from.
        for holder in ["", "/spec/template", "/spec/machineTemplate"] {
            if example.labels.is_empty() {
                break;
            }
            let Some(holder) = object.pointer_mut(holder).and_then(Value::as_object_mut) else {
                continue;
            };
            let metadata = holder.entry("metadata").or_insert_with(|| json!({}));
            if let Some(metadata) = metadata.as_object_mut()
                && let Value::Object(labels) = metadata.entry("labels").or_insert_with(|| json!({}))
            {
                for (key, value) in &example.labels {
                    labels.insert(key.clone(), json!(value));
                }
            }
        }
        let object: DynamicObject = serde_json::from_value(object)?;
        Api::<DynamicObject>::namespaced_with(client.clone(), ns, &resource)
            .create(&post_params(), &object)
            .await?;
    }
    Ok(())
}

/// Sets `spec.replicas` of a KubeadmControlPlane.
pub async fn scale_control_plane(
    client: &Client,
    namespace: &str,
    kcp: &str,
    replicas: i32,
) -> Result<()> {
    scale(client, namespace, &control_plane_resource(), kcp, replicas).await
}

/// Sets `spec.replicas` of a MachineDeployment.
pub async fn scale_workers(
    client: &Client,
    namespace: &str,
    machine_deployment: &str,
    replicas: i32,
) -> Result<()> {
    scale(
        client,
        namespace,
        &deployment_resource(),
        machine_deployment,
        replicas,
    )
    .await
}

async fn scale(
    client: &Client,
    namespace: &str,
    resource: &ApiResource,
    name: &str,
    replicas: i32,
) -> Result<()> {
    Api::<DynamicObject>::namespaced_with(client.clone(), namespace, resource)
        .patch(
            name,
            &patch_params(),
            &Patch::Merge(json!({"spec": {"replicas": replicas}})),
        )
        .await?;
    Ok(())
}

/// The `KubeadmControlPlane` kind (v1beta2), for `DynamicObject` APIs.
pub fn control_plane_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk(KCP_GROUP, "v1beta2", "KubeadmControlPlane"),
        "kubeadmcontrolplanes",
    )
}

/// The `KubeadmConfigTemplate` kind (v1beta2), for `DynamicObject` APIs.
pub fn kubeadm_config_template_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk(BOOTSTRAP_GROUP, "v1beta2", "KubeadmConfigTemplate"),
        "kubeadmconfigtemplates",
    )
}

/// The `MachineDeployment` kind (v1beta2), for `DynamicObject` APIs.
pub fn deployment_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("cluster.x-k8s.io", "v1beta2", "MachineDeployment"),
        "machinedeployments",
    )
}

/// Name of a Machine's bootstrap Secret.
pub fn bootstrap_secret_name(machine: &str) -> String {
    format!("{machine}-bootstrap")
}

// -------------------------------------------------------------------- small pieces

/// What a KCP or MachineDeployment stamps on each of its Machines.
struct Blueprint {
    owner: OwnerReference,
    cluster_name: String,
    labels: BTreeMap<String, String>,
    template: ContractVersionedObjectReference,
    version: Option<String>,
    bootstrap: BootstrapSource,
}

/// Where the bootstrap format of a Blueprint's Machines comes from.
enum BootstrapSource {
    /// The KCP's `spec.kubeadmConfigSpec.format` (empty: cloud-config).
    Format(String),
    /// The KubeadmConfigTemplate a MachineDeployment names, if any.
    Template(Option<String>),
}

#[derive(Default, Deserialize)]
struct KubeadmConfigSpecView {
    #[serde(default)]
    format: Option<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct MdBootstrap {
    #[serde(default)]
    config_ref: Option<ContractVersionedObjectReference>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct KcpSpec {
    #[serde(default)]
    replicas: Option<i32>,
    #[serde(default)]
    version: Option<String>,
    #[serde(default)]
    kubeadm_config_spec: Option<KubeadmConfigSpecView>,
    machine_template: KcpMachineTemplate,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct KcpMachineTemplate {
    #[serde(default)]
    metadata: Option<TemplateObjectMeta>,
    spec: KcpMachineTemplateSpec,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct KcpMachineTemplateSpec {
    infrastructure_ref: ContractVersionedObjectReference,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct MdSpec {
    cluster_name: String,
    #[serde(default)]
    replicas: Option<i32>,
    template: MdTemplate,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct MdTemplate {
    #[serde(default)]
    metadata: Option<TemplateObjectMeta>,
    spec: MdTemplateSpec,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct MdTemplateSpec {
    #[serde(default)]
    version: Option<String>,
    #[serde(default)]
    failure_domain: Option<String>,
    #[serde(default)]
    bootstrap: Option<MdBootstrap>,
    infrastructure_ref: ContractVersionedObjectReference,
}

fn template_labels(meta: Option<&TemplateObjectMeta>) -> BTreeMap<String, String> {
    meta.map(|m| m.labels.clone()).unwrap_or_default()
}

fn infrastructure_provisioned(cluster: &Cluster) -> bool {
    cluster
        .status
        .as_ref()
        .and_then(|s| s.initialization.as_ref())
        .and_then(|i| i.infrastructure_provisioned)
        == Some(true)
}

fn controller_uid(meta: &ObjectMeta) -> Option<&str> {
    meta.owner_references
        .iter()
        .flatten()
        .find(|o| o.controller == Some(true))
        .map(|o| o.uid.as_str())
}

fn controller_ref(api_version: &str, kind: &str, name: &str, uid: &str) -> OwnerReference {
    OwnerReference {
        api_version: api_version.into(),
        kind: kind.into(),
        name: name.into(),
        uid: uid.into(),
        controller: Some(true),
        block_owner_deletion: Some(true),
    }
}

fn is_paused(meta: &ObjectMeta) -> bool {
    meta.annotations
        .as_ref()
        .is_some_and(|a| a.contains_key(capmox::api::annotations::PAUSED))
}

fn has_finalizer(meta: &ObjectMeta, finalizer: &str) -> bool {
    meta.finalizers.iter().flatten().any(|f| f == finalizer)
}

fn patch_params() -> PatchParams {
    PatchParams {
        field_manager: Some(FIELD_MANAGER.into()),
        ..Default::default()
    }
}

fn post_params() -> PostParams {
    PostParams {
        field_manager: Some(FIELD_MANAGER.into()),
        ..Default::default()
    }
}

/// A JSON patch that fails (409/422) if `path` changed since `current` was read.
fn guarded_replace(path: &str, current: Option<Value>, new: Value) -> Result<json_patch::Patch> {
    let ops = match current {
        Some(current) => json!([
            {"op": "test", "path": path, "value": current},
            {"op": "replace", "path": path, "value": new},
        ]),
        None => json!([{"op": "add", "path": path, "value": new}]),
    };
    Ok(serde_json::from_value(ops)?)
}

async fn add_finalizer<K>(api: &Api<K>, meta: &ObjectMeta, finalizer: &str) -> Result<()>
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let current = meta.finalizers.clone().filter(|f| !f.is_empty());
    let mut new = current.clone().unwrap_or_default();
    new.push(finalizer.to_string());
    let patch = guarded_replace(
        "/metadata/finalizers",
        current.map(|c| json!(c)),
        json!(new),
    )?;
    let name = meta.name.clone().unwrap_or_default();
    api.patch(&name, &patch_params(), &Patch::<()>::Json(patch))
        .await?;
    Ok(())
}

async fn remove_finalizer<K>(api: &Api<K>, meta: &ObjectMeta, finalizer: &str) -> Result<()>
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let current = meta.finalizers.clone().unwrap_or_default();
    let new: Vec<&String> = current.iter().filter(|f| *f != finalizer).collect();
    let patch = guarded_replace("/metadata/finalizers", Some(json!(current)), json!(new))?;
    let name = meta.name.clone().unwrap_or_default();
    match api
        .patch(&name, &patch_params(), &Patch::<()>::Json(patch))
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(status)) if status.is_not_found() => Ok(()),
        Err(error) => Err(error.into()),
    }
}

async fn replace_owner_references<K>(
    api: &Api<K>,
    meta: &ObjectMeta,
    refs: Vec<OwnerReference>,
) -> Result<()>
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let current = meta
        .owner_references
        .clone()
        .filter(|r| !r.is_empty())
        .map(serde_json::to_value)
        .transpose()?;
    let patch = guarded_replace(
        "/metadata/ownerReferences",
        current,
        serde_json::to_value(refs)?,
    )?;
    let name = meta.name.clone().unwrap_or_default();
    api.patch(&name, &patch_params(), &Patch::<()>::Json(patch))
        .await?;
    Ok(())
}

async fn delete_ignoring_missing<K>(api: &Api<K>, name: &str) -> Result<()>
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    match api.delete(name, &DeleteParams::background()).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(status)) if status.is_not_found() => Ok(()),
        Err(error) => Err(error.into()),
    }
}

async fn create_ignoring_existing<K>(api: &Api<K>, object: &K) -> Result<()>
where
    K: Resource + Clone + serde::Serialize + serde::de::DeserializeOwned + std::fmt::Debug,
{
    match api.create(&post_params(), object).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(status)) if status.is_already_exists() => Ok(()),
        Err(error) => Err(error.into()),
    }
}

/// A small Ignition config (spec 2.3, the shape Flatcar's kubeadm bootstrap writes) with a
/// unit that reads what capmox merges into `/etc/proxmox-env`.
fn bootstrap_ignition(machine: &str) -> String {
    json!({
        "ignition": {"version": "2.3.0"},
        "storage": {"files": [{
            "filesystem": "root",
            "path": "/etc/capi-standin",
            "mode": 420,
            "contents": {"source": format!("data:,capi-stand-in-bootstrap-for-{machine}")},
        }]},
        "systemd": {"units": [{
            "name": "capi-standin.service",
            "enabled": true,
            "contents": "[Unit]\nDescription=Rendered by the capmox sandbox CAPI stand-in, not by a bootstrap provider\n\
                         [Service]\nType=oneshot\nEnvironmentFile=/etc/proxmox-env\n\
                         ExecStart=/usr/bin/echo capi stand-in bootstrap for ${COREOS_CUSTOM_HOSTNAME}\n\
                         [Install]\nWantedBy=multi-user.target\n",
        }]},
    })
    .to_string()
}

/// A small valid cloud-config; capmox only hands it to the VM.
fn bootstrap_cloud_config(machine: &str) -> String {
    format!(
        "#cloud-config\n\
         # Rendered by the capmox sandbox CAPI stand-in, not by a bootstrap provider.\n\
         hostname: {machine}\n\
         runcmd:\n  - [echo, \"capi stand-in bootstrap for {machine}\"]\n"
    )
}

/// Five characters from the Kubernetes name alphabet; random per process (std's randomly
/// keyed hasher) and per call (a counter), so no `rand` dependency is needed.
fn random_suffix() -> String {
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    let mut value = hasher.finish();
    let base = ALPHABET.len() as u64;
    (0..5)
        .map(|_| {
            // The remainder is below ALPHABET.len(), so the index is always in range.
            let c = ALPHABET[(value % base) as usize];
            value /= base;
            char::from(c)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn domain(name: &str, control_plane: Option<bool>) -> FailureDomain {
        FailureDomain {
            name: name.into(),
            control_plane,
            attributes: BTreeMap::new(),
        }
    }

    fn at(seconds: i64) -> Option<Time> {
        Some(Time(
            k8s_openapi::jiff::Timestamp::from_second(seconds).expect("timestamp"),
        ))
    }

    fn machine(name: &str, fd: Option<&str>, created: i64) -> MachinePlacement {
        MachinePlacement {
            name: name.into(),
            failure_domain: fd.map(String::from),
            created: at(created),
            ..Default::default()
        }
    }

    fn domains() -> Vec<FailureDomain> {
        vec![
            domain("a", Some(true)),
            domain("b", Some(true)),
            domain("c", Some(false)),
            domain("d", None),
        ]
    }

    #[test]
    fn scale_up_fills_the_emptiest_control_plane_domain_first_by_name_on_ties() {
        let d = domains();
        assert_eq!(failure_domain_for_scale_up(&d, &[]).as_deref(), Some("a"));
        let ms = [machine("m1", Some("a"), 1)];
        assert_eq!(failure_domain_for_scale_up(&d, &ms).as_deref(), Some("b"));
        let ms = [
            machine("m1", Some("a"), 1),
            machine("m2", Some("b"), 2),
            machine("m3", Some("c"), 3),
        ];
        assert_eq!(failure_domain_for_scale_up(&d, &ms).as_deref(), Some("a"));
    }

    #[test]
    fn scale_up_counts_deleting_machines_only_as_a_tie_break() {
        let d = domains();
        let mut deleting = machine("m1", Some("a"), 1);
        deleting.deleting = true;
        // a: priority 0, all 1; b: priority 0, all 0 → b.
        assert_eq!(
            failure_domain_for_scale_up(&d, &[deleting.clone()]).as_deref(),
            Some("b")
        );
        // a: priority 0, all 1; b: priority 1 → a.
        let ms = [deleting, machine("m2", Some("b"), 2)];
        assert_eq!(failure_domain_for_scale_up(&d, &ms).as_deref(), Some("a"));
    }

    #[test]
    fn scale_up_without_control_plane_domains_picks_none() {
        let d = [domain("c", Some(false)), domain("d", None)];
        assert_eq!(failure_domain_for_scale_up(&d, &[]), None);
        assert_eq!(failure_domain_for_scale_up(&[], &[]), None);
    }

    #[test]
    fn scale_down_takes_the_oldest_in_the_fullest_domain() {
        let d = domains();
        let ms = [
            machine("m1", Some("a"), 1),
            machine("m2", Some("b"), 2),
            machine("m3", Some("a"), 3),
            machine("m4", Some("b"), 4),
            machine("m5", Some("a"), 5),
        ];
        assert_eq!(machine_for_scale_down(&d, &ms).as_deref(), Some("m1"));
        // Tie (2/2): first domain by name, oldest there.
        assert_eq!(machine_for_scale_down(&d, &ms[1..]).as_deref(), Some("m3"));
    }

    #[test]
    fn scale_down_prefers_machines_outside_current_control_plane_domains() {
        let d = domains();
        let ms = [
            machine("m1", Some("a"), 1),
            machine("m2", Some("a"), 2),
            machine("m3", Some("c"), 5),
            machine("m4", None, 4),
        ];
        // Oldest orphan is m4 (no domain).
        assert_eq!(machine_for_scale_down(&d, &ms).as_deref(), Some("m4"));
        assert_eq!(machine_for_scale_down(&d, &ms[..3]).as_deref(), Some("m3"));
    }

    #[test]
    fn scale_down_honours_the_delete_machine_annotation_and_skips_deleting_ones() {
        let d = domains();
        let mut marked = machine("m3", Some("b"), 3);
        marked.delete_requested = true;
        let mut deleting = machine("m0", Some("a"), 0);
        deleting.deleting = true;
        let ms = [
            deleting,
            machine("m1", Some("a"), 1),
            machine("m2", Some("a"), 2),
            marked,
        ];
        assert_eq!(machine_for_scale_down(&d, &ms).as_deref(), Some("m3"));
        assert_eq!(machine_for_scale_down(&d, &ms[..3]).as_deref(), Some("m1"));
        assert_eq!(machine_for_scale_down(&d, &[]), None);
    }

    #[test]
    fn deployment_scale_down_takes_the_newest_marked_first() {
        let mut marked = machine("w1", Some("a"), 1);
        marked.delete_requested = true;
        let ms = [
            marked,
            machine("w2", Some("a"), 2),
            machine("w3", Some("a"), 3),
            machine("w4", Some("a"), 3),
        ];
        assert_eq!(machines_for_deployment_scale_down(&ms, 2), ["w1", "w4"]);
        assert_eq!(
            machines_for_deployment_scale_down(&ms, 9),
            ["w1", "w4", "w3", "w2"]
        );
    }

    #[test]
    fn failure_domains_are_copied_sorted_with_explicit_control_plane() {
        let copied = normalized_failure_domains(&[domain("z", None), domain("a", Some(true))]);
        assert_eq!(copied, [domain("a", Some(true)), domain("z", Some(false))]);
    }

    #[test]
    fn suffixes_are_valid_names_and_differ() {
        let a = random_suffix();
        let b = random_suffix();
        assert_eq!(a.len(), 5);
        assert!(
            a.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
        );
        assert_ne!(a, b);
    }

    #[test]
    fn bootstrap_data_is_cloud_config_yaml() {
        let text = bootstrap_cloud_config("m1");
        assert!(text.starts_with("#cloud-config\n"));
        let parsed: serde_norway::Value = serde_norway::from_str(&text).expect("yaml");
        assert_eq!(parsed["hostname"], serde_norway::Value::from("m1"));
    }
}
