//! `e2e-real`: the sandbox scenario against a real management cluster (the one in
//! `KUBECONFIG`). It installs the CRDs, applies the shipped RBAC from the release manifests,
//! runs capmox's manager as `capmox run` does without `--leader-elect`, impersonating the
//! shipped ServiceAccount so the API server enforces the shipped ClusterRole, plays CAPI core
//! and IPAM with the stand-ins (as the admin), provisions the example cluster, deletes it, checks
//! that nothing is left and removes what it installed.
//!
//! Proxmox is simulated unless `PROXMOX_URL`, `PROXMOX_TOKEN` and `PROXMOX_SECRET` name a real
//! one; then the zones' nodes and the template come from the options. A multi-site `--topology`
//! file ([`crate::sites`]) runs one simulator per site, as the sandbox does, and checks that
//! every VM is on its zone's site and that the sites' Secrets are held while the cluster lives.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Secret};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, Patch,
    PatchParams, PostParams,
};
use kube::runtime::{wait::await_condition, watcher};
use kube::{Client, Config, ResourceExt};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use super::conversion::LocalWebhook;
use super::run::{MachineRow, SandboxError, SiteSimulators, example_machine_spec, render};
use super::standin::{CapiStandIn, ExampleCluster, create_example_cluster};
use capmox::api::{ProxmoxCluster, ProxmoxMachine};
use capmox::capi::{IPAddressClaim, InClusterIPPool};
use capmox::controller::{GlobalCredentials, ManagerConfig};
use capmox_sim::SimOptions;

/// Field manager of everything this run applies.
const FIELD_MANAGER: &str = "capmox-e2e-real";

/// Why the run failed; every variant says what to check.
#[derive(Debug, thiserror::Error)]
pub enum RealError {
    /// No management cluster to run against.
    #[error(
        "no Kubernetes cluster: set KUBECONFIG to a cluster where you may install CRDs and RBAC ({0})"
    )]
    NoCluster(String),
    /// A Kubernetes call failed.
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    /// A manifest could not be read or parsed.
    #[error("{path}: {message}")]
    Manifest {
        /// Which file.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },
    /// The simulator(s) did not start, or the topology file does not fit the example.
    #[error("{0}")]
    Sandbox(#[from] SandboxError),
    /// The example cluster could not be created.
    #[error("example cluster: {0}")]
    Example(#[from] super::standin::StandInError),
    /// An option was unusable.
    #[error("invalid option: {0}")]
    Option(String),
    /// A step did not finish in time.
    #[error("timed out after {timeout:?} waiting for {what}")]
    Timeout {
        /// The step.
        what: String,
        /// How long it waited.
        timeout: Duration,
    },
    /// The run finished, but what it found is wrong.
    #[error("check failed: {0}")]
    Check(String),
    /// The manager stopped on its own.
    #[error("capmox's manager stopped: {0}")]
    Manager(String),
}

/// A real Proxmox VE endpoint instead of the simulator.
#[derive(Clone)]
pub struct RealProxmox {
    /// API URL, e.g. `https://pve.example:8006`.
    pub url: String,
    /// Token id, `user@realm!name`.
    pub token: String,
    /// Token secret.
    pub secret: String,
    /// Skip TLS verification (self-signed lab clusters).
    pub insecure: bool,
}

impl std::fmt::Debug for RealProxmox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RealProxmox")
            .field("url", &self.url)
            .field("token", &self.token)
            .field("secret", &"<redacted>")
            .field("insecure", &self.insecure)
            .finish()
    }
}

/// What `e2e-real` runs.
#[derive(Clone, Debug)]
pub struct RealOptions {
    /// Namespace the example cluster lives in (created, then deleted).
    pub namespace: String,
    /// Control-plane machines.
    pub control_plane: i32,
    /// Worker machines.
    pub workers: i32,
    /// Failure domain of the workers.
    pub worker_failure_domain: String,
    /// The release manifests whose RBAC is applied (`make release-manifests` writes them).
    pub manifests: PathBuf,
    /// Folder of the upstream CAPI / KCP / IPAM CRDs.
    pub upstream_crds: PathBuf,
    /// Upper bound of each step.
    pub timeout: Duration,
    /// Real Proxmox; the simulator when unset.
    pub proxmox: Option<RealProxmox>,
    /// Zones `name -> nodes` for a real Proxmox (the example's rack-a/rack-b otherwise).
    pub zones: BTreeMap<String, Vec<String>>,
    /// Template VMID for a real Proxmox.
    pub template_id: Option<u32>,
    /// Node of the template for a real Proxmox.
    pub source_node: Option<String>,
    /// Leave the CRDs, RBAC and namespace in place afterwards.
    pub keep: bool,
    /// Simulator topology, or a multi-site file ([`crate::sites`]); the sandbox's built-in
    /// one when unset. Only with the simulator.
    pub topology: Option<PathBuf>,
    /// Run with the real Cluster API controllers instead of capmox's stand-ins.
    pub real_capi: Option<super::real_capi::RealCapiOptions>,
}

/// The shipped ServiceAccount capmox runs as, found in the release manifests.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceAccountRef {
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
}

impl ServiceAccountRef {
    /// The user name the API server gives this ServiceAccount's tokens.
    pub fn user(&self) -> String {
        format!("system:serviceaccount:{}:{}", self.namespace, self.name)
    }

    /// The groups the API server gives this ServiceAccount's tokens.
    pub fn groups(&self) -> Vec<String> {
        vec![
            "system:serviceaccounts".into(),
            format!("system:serviceaccounts:{}", self.namespace),
            "system:authenticated".into(),
        ]
    }
}

/// The RBAC (and namespace) objects of the release manifests, in the order they must be applied,
/// and the ServiceAccount the manager Deployment runs as.
pub fn shipped_rbac(manifests: &str) -> Result<(Vec<Value>, ServiceAccountRef), String> {
    const KINDS: [&str; 6] = [
        "Namespace",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
    ];
    let mut objects = Vec::new();
    let mut deployment_account = None;
    for document in serde_norway::Deserializer::from_str(manifests) {
        let object: Value = serde::Deserialize::deserialize(document).map_err(|e| e.to_string())?;
        let kind = object["kind"].as_str().unwrap_or_default();
        if kind == "Deployment" {
            let spec = &object["spec"]["template"]["spec"];
            deployment_account = Some(ServiceAccountRef {
                namespace: object["metadata"]["namespace"]
                    .as_str()
                    .unwrap_or("default")
                    .to_owned(),
                name: spec["serviceAccountName"]
                    .as_str()
                    .unwrap_or("default")
                    .to_owned(),
            });
        }
        if KINDS.contains(&kind) {
            objects.push(object);
        }
    }
    objects.sort_by_key(|o| {
        KINDS
            .iter()
            .position(|k| o["kind"].as_str() == Some(*k))
            .unwrap_or(KINDS.len())
    });
    let account = deployment_account.ok_or("no Deployment (the manager) in the manifests")?;
    if !objects.iter().any(|o| {
        o["kind"] == "ServiceAccount"
            && o["metadata"]["name"] == account.name.as_str()
            && o["metadata"]["namespace"] == account.namespace.as_str()
    }) {
        return Err(format!(
            "the manager runs as ServiceAccount {}/{}, which the manifests do not define",
            account.namespace, account.name
        ));
    }
    if !objects.iter().any(|o| o["kind"] == "ClusterRole") {
        return Err("no ClusterRole in the manifests".into());
    }
    Ok((objects, account))
}

/// The tenancy settings the shipped manager Deployment passes (`--global-credentials-namespaces`,
/// `--secret-namespaces`, `--allowed-proxmox-urls`), without global credentials: this run's
/// clusters name theirs in `credentialsRef`.
pub fn shipped_credentials_policy(manifests: &str) -> Result<GlobalCredentials, String> {
    for document in serde_norway::Deserializer::from_str(manifests) {
        let object: Value = serde::Deserialize::deserialize(document).map_err(|e| e.to_string())?;
        if object["kind"] != "Deployment" {
            continue;
        }
        let containers = object["spec"]["template"]["spec"]["containers"]
            .as_array()
            .ok_or("the manager Deployment has no containers")?;
        let manager = containers
            .iter()
            .find(|c| c["name"] == "manager")
            .ok_or("the manager Deployment has no container named manager")?;
        let mut command = vec!["capmox".to_owned()];
        command.extend(
            manager["args"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|a| a.as_str().map(str::to_owned)),
        );
        let cli = <capmox::cli::Cli as clap::Parser>::try_parse_from(&command)
            .map_err(|e| format!("capmox rejects the manager's args: {e}"))?;
        let capmox::cli::Command::Run(args) = cli.command else {
            return Err("the manager does not run `capmox run`".into());
        };
        let shipped = args.global_credentials();
        return Ok(GlobalCredentials {
            namespaces: shipped.namespaces,
            secret_namespaces: shipped.secret_namespaces,
            allowed_urls: shipped.allowed_urls,
            ..GlobalCredentials::default()
        });
    }
    Err("no Deployment (the manager) in the manifests".into())
}

/// The Roles that let capmox read Secrets in the namespaces the manifests list
/// (`make release-manifests SECRET_NAMESPACES=...` writes them beside the manifests).
fn secret_namespace_roles(
    options: &RealOptions,
    policy: &GlobalCredentials,
) -> Result<Vec<Value>, RealError> {
    let Some(namespaces) = &policy.secret_namespaces else {
        return Ok(Vec::new());
    };
    let path = options
        .manifests
        .with_file_name("secret-namespaces-rbac.yaml");
    let manifest = |message: String| RealError::Manifest {
        path: path.clone(),
        message,
    };
    if !namespaces.contains(&options.namespace) {
        return Err(manifest(format!(
            "the manager reads Secrets only in {namespaces:?}, not in this run's namespace {}: \
             build the manifests with SECRET_NAMESPACES={}",
            options.namespace, options.namespace
        )));
    }
    let text = std::fs::read_to_string(&path).map_err(|e| {
        manifest(format!(
            "{e} (`make release-manifests SECRET_NAMESPACES=...` writes it)"
        ))
    })?;
    let mut roles = Vec::new();
    for document in serde_norway::Deserializer::from_str(&text) {
        let object: Value =
            serde::Deserialize::deserialize(document).map_err(|e| manifest(e.to_string()))?;
        if !object.is_null() {
            roles.push(object);
        }
    }
    Ok(roles)
}

/// The release manifests' ValidatingWebhookConfiguration.
fn shipped_validation(manifests: &str) -> Result<Value, String> {
    for document in serde_norway::Deserializer::from_str(manifests) {
        let object: Value = serde::Deserialize::deserialize(document).map_err(|e| e.to_string())?;
        if object["kind"] == "ValidatingWebhookConfiguration" {
            return Ok(object);
        }
    }
    Err("no ValidatingWebhookConfiguration in the manifests".into())
}

/// The API resource of one of the RBAC kinds [`shipped_rbac`] returns (or of the
/// ValidatingWebhookConfiguration).
fn rbac_resource(kind: &str) -> Option<(ApiResource, bool)> {
    let (group, namespaced) = match kind {
        "Namespace" => ("", false),
        "ServiceAccount" => ("", true),
        "ClusterRole" | "ClusterRoleBinding" => ("rbac.authorization.k8s.io", false),
        "Role" | "RoleBinding" => ("rbac.authorization.k8s.io", true),
        "ValidatingWebhookConfiguration" => ("admissionregistration.k8s.io", false),
        _ => return None,
    };
    let gvk = GroupVersionKind::gvk(group, "v1", kind);
    Some((ApiResource::from_gvk(&gvk), namespaced))
}

pub(crate) fn dynamic_api(client: &Client, object: &Value) -> Option<(Api<DynamicObject>, String)> {
    let (resource, namespaced) = rbac_resource(object["kind"].as_str()?)?;
    let name = object["metadata"]["name"].as_str()?.to_owned();
    let api = if namespaced {
        let namespace = object["metadata"]["namespace"]
            .as_str()
            .unwrap_or("default");
        Api::namespaced_with(client.clone(), namespace, &resource)
    } else {
        Api::all_with(client.clone(), &resource)
    };
    Some((api, name))
}

/// One object this run created, so cleaning up removes exactly those.
pub(crate) struct Created {
    pub(crate) api: Api<DynamicObject>,
    pub(crate) name: String,
}

/// Applies capmox's CRDs and the upstream ones and waits until each is established.
/// capmox's converting through `webhook`.
pub(crate) async fn install_crds(
    client: &Client,
    options: &RealOptions,
    webhook: &LocalWebhook,
) -> Result<(), RealError> {
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    let mut crds: Vec<CustomResourceDefinition> = capmox::api::crd::all()
        .map_err(|e| RealError::Option(format!("capmox CRDs do not render: {e}")))?;
    for crd in &mut crds {
        // Only kinds of two versions convert (the remediation kinds are v1alpha2 only).
        if crd.spec.versions.len() > 1 {
            webhook.convert_through(crd);
        }
        // As clusterctl init labels a provider's CRDs: `clusterctl move` discovers kinds by it.
        let labels = crd.metadata.labels.get_or_insert_with(Default::default);
        labels.insert("clusterctl.cluster.x-k8s.io".into(), String::new());
        labels.insert(
            "cluster.x-k8s.io/provider".into(),
            "infrastructure-proxmox".into(),
        );
    }
    let mut paths: Vec<PathBuf> = std::fs::read_dir(&options.upstream_crds)
        .map_err(|e| RealError::Manifest {
            path: options.upstream_crds.clone(),
            message: format!("{e} (the upstream CAPI, KCP and IPAM CRDs are read from here)"),
        })?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    paths.sort();
    // The stand-in's MachineDeployment names a KubeadmConfigTemplate for its workers' bootstrap
    // format; the template kinds live apart so the in-process API server does not load them all.
    paths.push(
        options
            .upstream_crds
            .join("template-kinds/bootstrap.cluster.x-k8s.io_kubeadmconfigtemplates.yaml"),
    );
    let upstream_count = paths.len();
    for path in paths {
        let text = std::fs::read_to_string(&path).map_err(|e| RealError::Manifest {
            path: path.clone(),
            message: e.to_string(),
        })?;
        let crd: CustomResourceDefinition =
            serde_norway::from_str(&text).map_err(|e| RealError::Manifest {
                path: path.clone(),
                message: e.to_string(),
            })?;
        crds.push(crd);
    }
    if options.real_capi.is_some() {
        // The real controllers installed theirs (with their conversion webhooks): only what
        // they lack (the in-cluster IPAM pools) comes from here.
        let capmox_count = crds.len() - upstream_count;
        let mut kept = crds.split_off(capmox_count);
        let mut missing = Vec::new();
        for crd in kept.drain(..) {
            if api.get_opt(&crd.name_any()).await?.is_none() {
                missing.push(crd);
            }
        }
        crds.extend(missing);
    }
    let params = PatchParams::apply(FIELD_MANAGER).force();
    for crd in &crds {
        let mut crd = crd.clone();
        crd.metadata.managed_fields = None;
        crd.metadata.resource_version = None;
        crd.status = None;
        api.patch(&crd.name_any(), &params, &Patch::Apply(&crd))
            .await?;
    }
    for crd in &crds {
        let name = crd.name_any();
        let established = await_condition(
            api.clone(),
            &name,
            |crd: Option<&CustomResourceDefinition>| {
                crd.and_then(|c| c.status.as_ref())
                    .and_then(|s| s.conditions.as_ref())
                    .is_some_and(|cs| {
                        cs.iter()
                            .any(|c| c.type_ == "Established" && c.status == "True")
                    })
            },
        );
        tokio::time::timeout(options.timeout, established)
            .await
            .map_err(|_| RealError::Timeout {
                what: format!("CRD {name} to be established"),
                timeout: options.timeout,
            })?
            .map_err(|e| RealError::Check(format!("watching CRD {name}: {e}")))?;
    }
    println!(
        "CRDs installed:          {} (capmox's and upstream)",
        crds.len()
    );
    Ok(())
}

/// Waits until namespace `name` is gone, if it is being deleted (an earlier run's clean-up).
pub(crate) async fn wait_namespace_gone(
    client: &Client,
    name: &str,
    timeout: Duration,
    only_if_terminating: bool,
) -> Result<(), RealError> {
    let api: Api<Namespace> = Api::all(client.clone());
    match api.get_opt(name).await? {
        None => return Ok(()),
        Some(namespace)
            if only_if_terminating && namespace.metadata.deletion_timestamp.is_none() =>
        {
            return Ok(());
        }
        Some(_) => {}
    }
    println!("Waiting for namespace {name} to finish terminating");
    let gone = await_condition(api, name, |n: Option<&Namespace>| n.is_none());
    tokio::time::timeout(timeout, gone)
        .await
        .map_err(|_| RealError::Timeout {
            what: format!("namespace {name} to be deleted"),
            timeout,
        })?
        .map_err(|e| RealError::Check(format!("watching namespace {name}: {e}")))?;
    Ok(())
}

/// Applies the shipped RBAC, recording in `created` what did not exist before (and is removed
/// afterwards).
pub(crate) async fn install_rbac(
    client: &Client,
    objects: &[Value],
    timeout: Duration,
    created: &mut Vec<Created>,
) -> Result<(), RealError> {
    let params = PatchParams::apply(FIELD_MANAGER).force();
    for object in objects {
        let Some((api, name)) = dynamic_api(client, object) else {
            continue;
        };
        if object["kind"] == "Namespace" {
            wait_namespace_gone(client, &name, timeout, true).await?;
        }
        let existed = api.get_opt(&name).await?.is_some();
        api.patch(&name, &params, &Patch::Apply(object)).await?;
        if !existed {
            created.push(Created { api, name });
        }
    }
    Ok(())
}

/// A client that acts as `account`: the API server authorizes it with that account's RBAC.
pub(crate) async fn impersonating(account: &ServiceAccountRef) -> Result<Client, RealError> {
    let mut config = Config::infer()
        .await
        .map_err(|e| RealError::NoCluster(e.to_string()))?;
    config.auth_info.impersonate = Some(account.user());
    config.auth_info.impersonate_groups = Some(account.groups());
    Client::try_from(config).map_err(RealError::Kube)
}

/// capmox as `capmox run` runs it by default (no leader election, all namespaces), its
/// endpoints on ports the OS picks.
pub(crate) fn manager_config() -> ManagerConfig {
    ManagerConfig {
        metrics_address: ([127, 0, 0, 1], 0).into(),
        health_address: ([127, 0, 0, 1], 0).into(),
        leader_election: None,
        watch_namespace: None,
        watch_filter: None,
        cluster_concurrency: 4,
        machine_concurrency: 10,
        task_timing: Default::default(),
        zone_holds: Default::default(),
        proxmox_requests_in_flight: capmox::proxmox::DEFAULT_REQUESTS_IN_FLIGHT,
        webhook: None,
    }
}

/// As [`manager_config`], acting on a zone's health within seconds (`--zone-drain-after` and
/// `--zone-restore-after` of 5s), so a run sees a zone leave the control plane and come back.
pub(crate) fn manager_config_with_quick_zone_holds() -> ManagerConfig {
    ManagerConfig {
        zone_holds: capmox::controller::zone_health::ZoneHolds {
            drain_after: std::time::Duration::from_secs(5),
            restore_after: std::time::Duration::from_secs(5),
        },
        ..manager_config()
    }
}

/// The ProxmoxCluster and machine specs for this run: the simulators' example (`sims`), or the
/// example on the real Proxmox's zones.
fn specs(
    options: &RealOptions,
    sims: Option<&SiteSimulators>,
) -> Result<(Value, Value), RealError> {
    let machine = example_machine_spec();
    if let Some(sims) = sims {
        return Ok((sims.cluster_spec("demo"), machine));
    }
    real_specs(options, machine)
}

/// The example on the zones, nodes and template of a real Proxmox.
fn real_specs(options: &RealOptions, mut machine: Value) -> Result<(Value, Value), RealError> {
    let mut cluster = super::run::example_cluster_spec();
    if options.zones.is_empty() || options.template_id.is_none() || options.source_node.is_none() {
        return Err(RealError::Option(
            "with PROXMOX_URL set, give the zones' nodes (--zone rack-a=pve1,pve2 --zone \
             rack-b=pve3), --template-id and --source-node of your Proxmox"
                .into(),
        ));
    }
    let examples = cluster["zoneConfig"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let mut zones = Vec::new();
    let mut allowed = BTreeSet::new();
    for (index, (zone, nodes)) in options.zones.iter().enumerate() {
        // Each zone keeps an example zone's pools and DNS (the first two), or the cluster's.
        let mut config = examples.get(index).cloned().unwrap_or_else(|| json!({}));
        config["zone"] = json!(zone);
        config["nodes"] = json!(nodes);
        allowed.extend(nodes.iter().cloned());
        zones.push(config);
    }
    cluster["zoneConfig"] = Value::Array(zones);
    cluster["allowedNodes"] = json!(allowed);
    machine["templateID"] = json!(options.template_id);
    machine["sourceNode"] = json!(options.source_node);
    Ok((cluster, machine))
}

/// The simulators the run uses (one per site of a multi-site `--topology`), or none for a
/// real Proxmox.
async fn simulators_for(options: &RealOptions) -> Result<Option<SiteSimulators>, RealError> {
    match (&options.proxmox, &options.topology) {
        (Some(_), Some(_)) => Err(RealError::Option(
            "--topology describes simulated Proxmox clusters; with PROXMOX_URL set, give the \
             zones with --zone"
                .into(),
        )),
        (Some(_), None) => Ok(None),
        (None, topology) => Ok(Some(
            SiteSimulators::start(topology.as_deref(), &SimOptions::default()).await?,
        )),
    }
}

/// Creates the credentials Secret(s) of cluster `demo` in `namespace`: one per simulator
/// ([`SiteSimulators::create_credentials`]), or the real Proxmox's; returns their names.
async fn create_credentials(
    admin: &Client,
    namespace: &str,
    sims: Option<&SiteSimulators>,
    real: Option<&RealProxmox>,
) -> Result<Vec<String>, RealError> {
    if let Some(sims) = sims {
        return Ok(sims.create_credentials(admin, namespace, "demo").await?);
    }
    let real =
        real.ok_or_else(|| RealError::Option("neither a simulator nor PROXMOX_URL".into()))?;
    let name = "demo-proxmox-credentials";
    let secret: Secret = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": name, "namespace": namespace},
        "stringData": {"url": real.url, "token": real.token, "secret": real.secret,
                       "insecure": if real.insecure { "true" } else { "false" }},
    }))
    .map_err(|e| RealError::Option(e.to_string()))?;
    Api::<Secret>::namespaced(admin.clone(), namespace)
        .create(&PostParams::default(), &secret)
        .await?;
    Ok(vec![name.to_owned()])
}

/// Waits until `expected` ProxmoxMachines of `namespace` are ready, printing changes as `table`
/// renders them.
async fn wait_ready(
    client: &Client,
    namespace: &str,
    expected: usize,
    timeout: Duration,
    table: &dyn Fn(&[MachineRow]) -> String,
) -> Result<Vec<MachineRow>, RealError> {
    let api: Api<ProxmoxMachine> = Api::namespaced(client.clone(), namespace);
    let mut events = watcher(api.clone(), watcher::Config::default()).boxed();
    let deadline = tokio::time::Instant::now() + timeout;
    let mut last = String::new();
    loop {
        let rows = super::run::rows(&api.list(&ListParams::default()).await?.items);
        let table = table(&rows);
        if table != last {
            println!("{table}\n");
            last = table;
        }
        if rows.len() == expected && rows.iter().all(|r| r.phase == "Ready") {
            return Ok(rows);
        }
        match tokio::time::timeout_at(deadline, events.next()).await {
            Ok(Some(_)) => {}
            Ok(None) => return Err(RealError::Check("the ProxmoxMachine watch ended".into())),
            Err(_) => {
                return Err(RealError::Timeout {
                    what: format!("{expected} ready machines"),
                    timeout,
                });
            }
        }
    }
}

/// Waits until the list `what` of `namespace` is empty.
async fn wait_empty<K>(
    client: &Client,
    namespace: &str,
    what: &str,
    timeout: Duration,
) -> Result<(), RealError>
where
    K: kube::Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug
        + Send
        + Sync
        + 'static,
{
    let api: Api<K> = Api::namespaced(client.clone(), namespace);
    let mut events = watcher(api.clone(), watcher::Config::default()).boxed();
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let left = api.list(&ListParams::default()).await?.items;
        if left.is_empty() {
            return Ok(());
        }
        if tokio::time::timeout_at(deadline, events.next())
            .await
            .is_err()
        {
            let names: Vec<String> = left.iter().map(ResourceExt::name_any).collect();
            return Err(RealError::Timeout {
                what: format!("{what} to be gone (left: {})", names.join(", ")),
                timeout,
            });
        }
    }
}

/// The spread the example asks for: control-plane machines over more than one domain when the
/// cluster has several, workers only in their domain.
fn check_spread(
    rows: &[MachineRow],
    worker_domain: &str,
    control_plane: i32,
) -> Result<(), RealError> {
    let mut control_plane_domains = BTreeSet::new();
    for row in rows {
        if row.machine.contains("-workers-") {
            if row.failure_domain != worker_domain {
                return Err(RealError::Check(format!(
                    "worker {} landed in {} instead of {worker_domain}",
                    row.machine, row.failure_domain
                )));
            }
        } else {
            control_plane_domains.insert(row.failure_domain.clone());
        }
    }
    if control_plane > 1 && control_plane_domains.len() < 2 {
        return Err(RealError::Check(format!(
            "{control_plane} control-plane machines all in {control_plane_domains:?}"
        )));
    }
    Ok(())
}

/// Runs the scenario; prints a summary and fails with what went wrong.
pub async fn run(options: RealOptions) -> Result<(), RealError> {
    let started = Instant::now();
    let admin = Client::try_default()
        .await
        .map_err(|e| RealError::NoCluster(e.to_string()))?;
    let version = admin
        .apiserver_version()
        .await
        .map_err(|e| RealError::NoCluster(e.to_string()))?;
    println!("Kubernetes API server:   {}", version.git_version);
    let manifests =
        std::fs::read_to_string(&options.manifests).map_err(|e| RealError::Manifest {
            path: options.manifests.clone(),
            message: format!("{e} (run `make release-manifests` first)"),
        })?;
    let (rbac, account) = shipped_rbac(&manifests).map_err(|message| RealError::Manifest {
        path: options.manifests.clone(),
        message,
    })?;
    let policy = shipped_credentials_policy(&manifests).map_err(|message| RealError::Manifest {
        path: options.manifests.clone(),
        message,
    })?;
    let secret_roles = secret_namespace_roles(&options, &policy)?;
    // The conversion webhook serves the whole run, clean-up included.
    let webhook_stop = CancellationToken::new();
    let _stop_webhook = webhook_stop.clone().drop_guard();
    let webhook = LocalWebhook::start(webhook_stop)
        .await
        .map_err(|e| RealError::Option(e.to_string()))?;
    if options.real_capi.is_some() {
        super::real_capi::check_real_capi(&admin).await?;
    }
    install_crds(&admin, &options, &webhook).await?;
    // Everything this run creates is recorded as it goes, so a failure at any step still
    // removes exactly that (and nothing that was there before).
    let mut created = Vec::new();
    let outcome = async {
        install_rbac(&admin, &rbac, options.timeout, &mut created).await?;
        // The shipped validating webhook, served by the same local webhook server.
        let mut validation =
            shipped_validation(&manifests).map_err(|message| RealError::Manifest {
                path: options.manifests.clone(),
                message,
            })?;
        webhook.validate_through(&mut validation);
        install_rbac(
            &admin,
            std::slice::from_ref(&validation),
            options.timeout,
            &mut created,
        )
        .await?;
        println!(
            "capmox runs as:          {} (shipped RBAC applied)",
            account.user()
        );
        wait_namespace_gone(&admin, &options.namespace, options.timeout, true).await?;
        let namespace = json!({
            "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": options.namespace}
        });
        let (api, name) = dynamic_api(&admin, &namespace)
            .ok_or_else(|| RealError::Option("Namespace is an RBAC-set kind".into()))?;
        let object: DynamicObject =
            serde_json::from_value(namespace).map_err(|e| RealError::Option(e.to_string()))?;
        api.create(&PostParams::default(), &object).await?;
        created.push(Created { api, name });
        install_rbac(&admin, &secret_roles, options.timeout, &mut created).await?;
        println!(
            "Secrets read in:         {}",
            policy.secret_namespaces.as_ref().map_or_else(
                || "any namespace (ClusterRole)".to_owned(),
                |n| format!("{} (Roles)", n.join(", "))
            )
        );
        println!(
            "Global credentials for:  {}",
            if policy.namespaces.is_empty() {
                "no namespace".to_owned()
            } else {
                policy.namespaces.join(", ")
            }
        );
        match &options.real_capi {
            Some(capi) => {
                let client = impersonating(&account).await?;
                let shipped = super::real_capi::Shipped {
                    account: &account,
                    rbac: &rbac,
                    webhook: &webhook,
                };
                super::real_capi::scenario(&admin, client, &shipped, &options, capi, policy).await
            }
            None => scenario(&admin, &account, &options, policy).await,
        }
    }
    .await;
    if options.keep {
        println!(
            "--keep: the namespace {}, the CRDs and the RBAC stay",
            options.namespace
        );
    } else {
        cleanup(&admin, &options, created).await;
        // The CRDs stay; their webhook goes with this process, so they stop converting.
        unhook_crds(&admin).await;
    }
    let summary = outcome?;
    println!("{summary}\nPASS in {:.1}s", started.elapsed().as_secs_f64());
    Ok(())
}

/// The provisioning and deletion, with capmox and the stand-ins running.
async fn scenario(
    admin: &Client,
    account: &ServiceAccountRef,
    options: &RealOptions,
    policy: GlobalCredentials,
) -> Result<String, RealError> {
    let sims = simulators_for(options).await?;
    let (cluster_spec, machine_spec) = specs(options, sims.as_ref())?;
    // The sites of a multi-site topology, checked machine by machine; `None` for one Proxmox.
    let multi = sims.as_ref().filter(|s| s.sites.is_some());
    if let Some(sims) = &sims {
        sims.check_example(&options.worker_failure_domain)?;
    }
    if let Some(multi) = multi {
        for (site, sim) in multi.simulators() {
            println!(
                "{:<25}{}",
                format!("Proxmox VE {}:", site.unwrap_or_default()),
                sim.url()
            );
        }
    }
    let table = |rows: &[MachineRow]| {
        sims.as_ref()
            .map_or_else(|| render(rows), |s| s.table(rows))
    };
    let stop = CancellationToken::new();
    let _stop_all = stop.clone().drop_guard();

    let config = manager_config();
    let mut manager = tokio::spawn(capmox::controller::run(
        impersonating(account).await?,
        config,
        policy,
        stop.clone(),
    ));
    tokio::spawn(super::ipam::run(admin.clone(), stop.clone()));
    CapiStandIn::spawn(admin.clone(), &options.namespace, stop.clone());

    let secrets = create_credentials(
        admin,
        &options.namespace,
        sims.as_ref(),
        options.proxmox.as_ref(),
    )
    .await?;
    let mut example = ExampleCluster::new(&options.namespace, "demo", cluster_spec, machine_spec);
    example.control_plane_replicas = options.control_plane;
    example.worker_replicas = options.workers;
    example.worker_failure_domain = Some(options.worker_failure_domain.clone());
    create_example_cluster(admin, &example).await?;
    let expected = usize::try_from(options.control_plane + options.workers).unwrap_or(0);
    let provisioning = Instant::now();
    let provisioned = async {
        let rows = tokio::select! {
            rows = wait_ready(admin, &options.namespace, expected, options.timeout, &table) => rows?,
            ended = &mut manager => return Err(RealError::Manager(format!("{ended:?}"))),
        };
        check_spread(&rows, &options.worker_failure_domain, options.control_plane)?;
        // VMIDs are unique within one Proxmox cluster; sites may repeat them.
        let vmids: Vec<&String> = rows.iter().map(|r| &r.vmid).collect();
        let unique: BTreeSet<(&String, &String)> =
            rows.iter().map(|r| (&r.endpoint, &r.vmid)).collect();
        if unique.len() != vmids.len() {
            return Err(RealError::Check(format!(
                "two machines recorded one VMID: {vmids:?}"
            )));
        }
        // What was checked: the sites (several), then v1alpha1 and validation.
        let mut checks = String::new();
        if let Some(multi) = multi {
            checks.push_str(&check_sites(&rows, multi, options.control_plane)?);
            checks.push_str("; ");
            checks.push_str(&check_secrets_held(admin, &options.namespace, &secrets).await?);
            checks.push_str("; ");
        }
        checks.push_str(&check_v1alpha1(admin, &options.namespace).await?);
        checks.push_str("; ");
        checks.push_str(&check_validation(admin, &options.namespace).await?);
        let sites = multi.and_then(|m| m.site_summary(&rows));
        Ok((rows, checks, sites))
    }
    .await;
    let (rows, checks, sites) = match provisioned {
        Ok(found) => found,
        Err(error) => {
            // Delete what was made while capmox and the stand-ins still run, so the
            // namespace can go (the Cluster's finalizer is the stand-in's).
            eprintln!("{error}; deleting the example cluster");
            let _ = Api::<capmox::capi::Cluster>::namespaced(admin.clone(), &options.namespace)
                .delete("demo", &DeleteParams::default())
                .await;
            if let Err(cleanup) = wait_empty::<capmox::capi::Cluster>(
                admin,
                &options.namespace,
                "the Cluster",
                options.timeout,
            )
            .await
            {
                eprintln!("cleanup: {cleanup}");
            }
            return Err(error);
        }
    };
    let ready_after = provisioning.elapsed();
    let mut per_domain: BTreeMap<&str, usize> = BTreeMap::new();
    for row in &rows {
        *per_domain.entry(row.failure_domain.as_str()).or_default() += 1;
    }

    // Deletion: the Cluster goes, and with it everything capmox made.
    let deleting = Instant::now();
    Api::<capmox::capi::Cluster>::namespaced(admin.clone(), &options.namespace)
        .delete("demo", &DeleteParams::default())
        .await?;
    tokio::select! {
        gone = async {
            wait_empty::<ProxmoxMachine>(admin, &options.namespace, "ProxmoxMachines", options.timeout).await?;
            wait_empty::<ProxmoxCluster>(admin, &options.namespace, "the ProxmoxCluster", options.timeout).await?;
            wait_empty::<IPAddressClaim>(admin, &options.namespace, "IPAddressClaims", options.timeout).await?;
            wait_empty::<InClusterIPPool>(admin, &options.namespace, "InClusterIPPools", options.timeout).await?;
            // The stand-in releases the Cluster last; stopping it earlier would strand the
            // Cluster's finalizer and with it the namespace.
            wait_empty::<capmox::capi::Cluster>(admin, &options.namespace, "the Cluster", options.timeout).await
        } => gone?,
        ended = &mut manager => return Err(RealError::Manager(format!("{ended:?}"))),
    }
    let deleted_after = deleting.elapsed();
    let left = match &sims {
        Some(sims) if sims.sites.is_some() => {
            // On every site only what it started with (its templates) stays, and no seed ISO.
            for (site, vms, isos) in sims.leftovers() {
                if vms != 0 || isos != 0 {
                    return Err(RealError::Check(format!(
                        "after deletion site {} holds {vms} VMs besides its templates and \
                         {isos} seed ISOs",
                        site.unwrap_or_default()
                    )));
                }
            }
            let released = check_secrets_released(admin, &options.namespace, &secrets).await?;
            format!("simulators: only their templates left on every site, no seed ISO; {released}")
        }
        Some(sims) => {
            // Only the template stays, and no seed ISO.
            let (vms, isos) = sims.sim.with_cluster(|c| (c.vm_count(), c.iso_count()));
            if vms != 1 || isos != 0 {
                return Err(RealError::Check(format!(
                    "after deletion the simulator holds {vms} VMs (1 expected: the template) \
                     and {isos} seed ISOs"
                )));
            }
            "simulator: only the template left, no seed ISO".to_owned()
        }
        None => "real Proxmox: check that no VM tagged capmox- is left".to_owned(),
    };
    stop.cancel();
    tokio::time::timeout(options.timeout, manager)
        .await
        .map_err(|_| RealError::Timeout {
            what: "capmox's manager to stop".into(),
            timeout: options.timeout,
        })?
        .map_err(|e| RealError::Manager(e.to_string()))?
        .map_err(|e| RealError::Manager(e.to_string()))?;
    Ok(format!(
        "\n{}\n\n{}{} machines ready after {:.1}s ({}); VMIDs unique{}; {checks}; deleted \
         after {:.1}s; {left}; nothing left in namespace {}",
        table(&rows),
        sites.map(|s| format!("{s}\n\n")).unwrap_or_default(),
        rows.len(),
        ready_after.as_secs_f64(),
        per_domain
            .iter()
            .map(|(d, n)| format!("{d}: {n}"))
            .collect::<Vec<_>>()
            .join(", "),
        if multi.is_some() { " per site" } else { "" },
        deleted_after.as_secs_f64(),
        options.namespace,
    ))
}

/// Where each machine of a multi-site run is: its zone's site recorded as its
/// `status.proxmoxEndpoint`, its VM on that site's simulator at the node and VMID it reports
/// and on no other site; the control plane on every site when it has a machine for every
/// eligible zone.
fn check_sites(
    rows: &[MachineRow],
    sims: &SiteSimulators,
    control_plane: i32,
) -> Result<String, RealError> {
    let Some(sites) = &sims.sites else {
        return Ok(String::new());
    };
    let check = |message: String| Err(RealError::Check(message));
    let vm_name = |sim: &capmox_sim::Simulator, node: &str, vmid: u32| {
        sim.with_cluster(|c| c.vm_config(node, vmid).ok())
            .and_then(|config| config["name"].as_str().map(str::to_owned))
    };
    let mut per_site: BTreeMap<&str, usize> = BTreeMap::new();
    let mut control_plane_sites = BTreeSet::new();
    for row in rows {
        let Some(site) = sims.site_of_zone(&row.failure_domain) else {
            return check(format!(
                "{} is in failure domain {}, a zone of no site",
                row.machine, row.failure_domain
            ));
        };
        let Some(sim) = sims.site_simulator(site) else {
            return check(format!("site {site} has no simulator"));
        };
        if sims.site_of_endpoint(&row.endpoint) != Some(site) {
            return check(format!(
                "{} (zone {}, site {site}) records status.proxmoxEndpoint {}, not {site}'s {}",
                row.machine,
                row.failure_domain,
                row.endpoint,
                sim.url()
            ));
        }
        let Ok(vmid) = row.vmid.parse::<u32>() else {
            return check(format!("{} records VMID {}", row.machine, row.vmid));
        };
        let found = vm_name(sim, &row.node, vmid);
        if found.as_deref() != Some(row.machine.as_str()) {
            return check(format!(
                "{}'s VM {vmid} is not on node {} of site {site} (there: {found:?})",
                row.machine, row.node
            ));
        }
        for other in sites.sites.iter().filter(|s| s.name != site) {
            let Some(other_sim) = sims.site_simulator(&other.name) else {
                return check(format!("site {} has no simulator", other.name));
            };
            let elsewhere: Vec<&str> = other
                .topology
                .nodes
                .iter()
                .filter(|node| {
                    other_sim
                        .with_cluster(|c| c.list_vms(&node.name).ok())
                        .and_then(|vms| vms.as_array().cloned())
                        .unwrap_or_default()
                        .iter()
                        .any(|vm| vm["name"] == row.machine.as_str())
                })
                .map(|node| node.name.as_str())
                .collect();
            if !elsewhere.is_empty() {
                return check(format!(
                    "{} (site {site}) has a VM on site {} too (node {})",
                    row.machine,
                    other.name,
                    elsewhere.join(", ")
                ));
            }
        }
        *per_site.entry(site).or_default() += 1;
        if !row.machine.contains("-workers-") {
            control_plane_sites.insert(site);
        }
    }
    let eligible: Vec<(&str, &str)> = sites
        .sites
        .iter()
        .flat_map(|s| {
            s.zones
                .iter()
                .filter(|z| z.control_plane_eligible != Some(false))
                .map(move |z| (s.name.as_str(), z.zone.as_str()))
        })
        .collect();
    let eligible_sites: BTreeSet<&str> = eligible.iter().map(|(site, _)| *site).collect();
    if usize::try_from(control_plane).unwrap_or(0) >= eligible.len()
        && control_plane_sites != eligible_sites
    {
        return check(format!(
            "{control_plane} control-plane machines for {} eligible zones, but only on sites \
             {control_plane_sites:?} of {eligible_sites:?}",
            eligible.len()
        ));
    }
    Ok(format!(
        "every VM on its zone's site at its node and VMID, on no other ({}); control plane on {}",
        per_site
            .iter()
            .map(|(site, n)| format!("{site}: {n}"))
            .collect::<Vec<_>>()
            .join(", "),
        control_plane_sites
            .iter()
            .copied()
            .collect::<Vec<_>>()
            .join(" and ")
    ))
}

/// The sites' credentials Secrets while the cluster exists: each carries capmox's finalizer
/// and an owner reference to the ProxmoxCluster, so none goes while a zone still needs it.
async fn check_secrets_held(
    admin: &Client,
    namespace: &str,
    secrets: &[String],
) -> Result<String, RealError> {
    let cluster = Api::<ProxmoxCluster>::namespaced(admin.clone(), namespace)
        .get("demo")
        .await?;
    let uid = cluster.metadata.uid.unwrap_or_default();
    let api = Api::<Secret>::namespaced(admin.clone(), namespace);
    for name in secrets {
        let secret = api.get(name).await?;
        let held = secret
            .finalizers()
            .iter()
            .any(|f| f == capmox::api::finalizers::CLUSTER_SECRET);
        let owned = secret
            .owner_references()
            .iter()
            .any(|o| o.uid == uid && o.kind == "ProxmoxCluster");
        if !held || !owned {
            return Err(RealError::Check(format!(
                "Secret {name} is not adopted by ProxmoxCluster demo (finalizers {:?}, owners {:?})",
                secret.finalizers(),
                secret
                    .owner_references()
                    .iter()
                    .map(|o| format!("{}/{}", o.kind, o.name))
                    .collect::<Vec<_>>()
            )));
        }
    }
    Ok(format!(
        "Secrets {} held ({} and owner ProxmoxCluster demo)",
        secrets.join(", "),
        capmox::api::finalizers::CLUSTER_SECRET
    ))
}

/// The sites' credentials Secrets once the cluster is gone: capmox's finalizer is off each
/// (the Secrets themselves stay, they are the user's).
async fn check_secrets_released(
    admin: &Client,
    namespace: &str,
    secrets: &[String],
) -> Result<String, RealError> {
    let api = Api::<Secret>::namespaced(admin.clone(), namespace);
    for name in secrets {
        if let Some(secret) = api.get_opt(name).await?
            && secret
                .finalizers()
                .iter()
                .any(|f| f == capmox::api::finalizers::CLUSTER_SECRET)
        {
            return Err(RealError::Check(format!(
                "Secret {name} still carries {} after the cluster is gone",
                capmox::api::finalizers::CLUSTER_SECRET
            )));
        }
    }
    Ok(format!(
        "Secrets {} released (finalizer gone)",
        secrets.join(", ")
    ))
}

/// Sets capmox's CRDs back to no conversion (only the v1alpha2 version is then readable as
/// v1alpha1 without a webhook, which is all another run or tool needs until it installs its own).
async fn unhook_crds(admin: &Client) {
    let api: Api<CustomResourceDefinition> = Api::all(admin.clone());
    let Ok(crds) = capmox::api::crd::all() else {
        return;
    };
    let patch = json!({"spec": {"conversion": {"strategy": "None", "webhook": null}}});
    for crd in crds {
        if let Err(error) = api
            .patch(
                &crd.name_any(),
                &PatchParams::default(),
                &Patch::Merge(&patch),
            )
            .await
        {
            eprintln!("cleanup: CRD {}: {error}", crd.name_any());
        }
    }
}

/// What a user of v1alpha1 manifests does, against the real API server and capmox's webhook:
/// reads the example cluster as v1alpha1, labels it through v1alpha1 (its zones must survive),
/// and applies a v1alpha1 ProxmoxMachineTemplate that is then read as v1alpha2.
async fn check_v1alpha1(admin: &Client, namespace: &str) -> Result<String, RealError> {
    let resource = |kind: &str, plural: &str| {
        ApiResource::from_gvk_with_plural(
            &GroupVersionKind::gvk(capmox::api::GROUP, capmox::api::v1alpha1::VERSION, kind),
            plural,
        )
    };
    let clusters_v1: Api<DynamicObject> = Api::namespaced_with(
        admin.clone(),
        namespace,
        &resource("ProxmoxCluster", "proxmoxclusters"),
    );
    let clusters: Api<ProxmoxCluster> = Api::namespaced(admin.clone(), namespace);
    let before = clusters.get("demo").await?;
    let old = clusters_v1.get("demo").await?;
    let old = serde_json::to_value(&old).map_err(|e| RealError::Check(e.to_string()))?;
    if old["spec"]["dnsServers"] != json!(before.spec.dns_servers)
        || old["spec"].get("zoneConfig").is_some()
        || !old["metadata"]["annotations"][capmox::api::conversion::CONVERSION_DATA]
            .as_str()
            .is_some_and(|data| data.contains("zoneConfig"))
    {
        return Err(RealError::Check(format!(
            "the ProxmoxCluster read as v1alpha1 is not the converted one: {old:#}"
        )));
    }
    let label = json!({"metadata": {"labels": {"edited-through": "v1alpha1"}}});
    clusters_v1
        .patch("demo", &PatchParams::default(), &Patch::Merge(&label))
        .await?;
    let after = clusters.get("demo").await?;
    if after.labels().get("edited-through").map(String::as_str) != Some("v1alpha1")
        || after.spec.zone_config != before.spec.zone_config
        || after
            .metadata
            .annotations
            .as_ref()
            .is_some_and(|a| a.contains_key(capmox::api::conversion::CONVERSION_DATA))
    {
        return Err(RealError::Check(format!(
            "labelling through v1alpha1 changed more than the label: {:#?}",
            after.spec
        )));
    }
    let templates_v1: Api<DynamicObject> = Api::namespaced_with(
        admin.clone(),
        namespace,
        &resource("ProxmoxMachineTemplate", "proxmoxmachinetemplates"),
    );
    let legacy: DynamicObject = serde_json::from_value(json!({
        "apiVersion": format!("{}/v1alpha1", capmox::api::GROUP),
        "kind": "ProxmoxMachineTemplate",
        "metadata": {"name": "legacy-workers", "namespace": namespace},
        "spec": {"template": {"spec": {
            "sourceNode": "pve1", "templateID": 100, "target": "pve2",
            "numCores": 2, "memoryMiB": 2048,
            "network": {"default": {"bridge": "vmbr0", "model": "virtio"}}
        }}}
    }))
    .map_err(|e| RealError::Check(e.to_string()))?;
    templates_v1
        .patch(
            "legacy-workers",
            &PatchParams::apply(FIELD_MANAGER),
            &Patch::Apply(&legacy),
        )
        .await?;
    let stored = Api::<capmox::api::ProxmoxMachineTemplate>::namespaced(admin.clone(), namespace)
        .get("legacy-workers")
        .await?;
    let spec = &stored.spec.template.spec;
    let nics: Vec<(&str, Option<&str>)> = spec
        .network
        .network_devices
        .iter()
        .map(|d| (d.name.as_str(), d.bridge.as_deref()))
        .collect();
    if spec.allowed_nodes != ["pve2"] || nics != [("net0", Some("vmbr0"))] {
        return Err(RealError::Check(format!(
            "the v1alpha1 template read as v1alpha2 is not the converted one: {spec:#?}"
        )));
    }
    Ok(
        "v1alpha1: read, labelled (zones kept) and applied through capmox's conversion webhook"
            .to_owned(),
    )
}

/// What the API server refuses through capmox's validation: a CEL rule of the CRD (a machine's
/// tags are immutable), and the validating webhook (an endpoint inside the node addresses; a
/// template edit).
async fn check_validation(admin: &Client, namespace: &str) -> Result<String, RealError> {
    async fn refused<T: std::fmt::Debug>(
        what: &str,
        outcome: Result<T, kube::Error>,
        expected: &str,
    ) -> Result<(), RealError> {
        match outcome {
            Err(kube::Error::Api(status)) if status.message.contains(expected) => Ok(()),
            other => Err(RealError::Check(format!(
                "{what}: expected a refusal saying {expected:?}, got {other:?}"
            ))),
        }
    }
    let machines = Api::<ProxmoxMachine>::namespaced(admin.clone(), namespace);
    let machine = machines
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .next()
        .ok_or_else(|| RealError::Check("no ProxmoxMachine to edit".into()))?;
    let retag = json!({"spec": {"tags": ["edited"]}});
    refused(
        "changing a machine's tags",
        machines
            .patch(
                &machine.name_any(),
                &PatchParams::default(),
                &Patch::Merge(&retag),
            )
            .await,
        "tags are immutable",
    )
    .await?;
    let mut spec = serde_json::to_value(
        Api::<ProxmoxCluster>::namespaced(admin.clone(), namespace)
            .get("demo")
            .await?
            .spec,
    )
    .map_err(|e| RealError::Check(e.to_string()))?;
    spec["controlPlaneEndpoint"] = json!({"host": "10.0.0.120", "port": 6443});
    let inside: ProxmoxCluster = serde_json::from_value(json!({
        "apiVersion": format!("{}/{}", capmox::api::GROUP, capmox::api::VERSION),
        "kind": "ProxmoxCluster",
        "metadata": {"name": "endpoint-in-range", "namespace": namespace},
        "spec": spec,
    }))
    .map_err(|e| RealError::Check(e.to_string()))?;
    refused(
        "a cluster whose endpoint is one of its node addresses",
        Api::<ProxmoxCluster>::namespaced(admin.clone(), namespace)
            .create(&PostParams::default(), &inside)
            .await,
        "may not contain the endpoint IP",
    )
    .await?;
    let resize = json!({"spec": {"template": {"spec": {"numCores": 4}}}});
    refused(
        "editing a ProxmoxMachineTemplate",
        Api::<capmox::api::ProxmoxMachineTemplate>::namespaced(admin.clone(), namespace)
            .patch(
                "legacy-workers",
                &PatchParams::default(),
                &Patch::Merge(&resize),
            )
            .await,
        "ProxmoxMachineTemplate is immutable",
    )
    .await?;
    Ok("validation: tags edit (CEL), endpoint in the node range and template edit (webhook) refused".to_owned())
}

/// Removes what this run created: the namespaces (waiting until they are gone, so the next
/// run starts clean) and the RBAC objects; never the CRDs, which other objects may use.
pub(crate) async fn cleanup(admin: &Client, options: &RealOptions, created: Vec<Created>) {
    let mut namespaces = Vec::new();
    for object in created.into_iter().rev() {
        if object.api.resource_url().ends_with("/namespaces") {
            namespaces.push(object.name.clone());
        }
        if let Err(error) = object
            .api
            .delete(&object.name, &DeleteParams::default())
            .await
        {
            eprintln!("cleanup: {}: {error}", object.name);
        }
    }
    for namespace in &namespaces {
        if let Err(error) = wait_namespace_gone(admin, namespace, options.timeout, false).await {
            eprintln!("cleanup: {error}");
        }
    }
    println!(
        "Cleaned up:              namespaces {} and the RBAC this run created",
        namespaces.join(", ")
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    const MANIFESTS: &str = r#"
apiVersion: v1
kind: Namespace
metadata: {name: capmox-system}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: capmox-manager-role}
rules: []
---
apiVersion: v1
kind: ServiceAccount
metadata: {name: capmox-controller-manager, namespace: capmox-system}
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: capmox-controller-manager, namespace: capmox-system}
spec:
  template:
    spec: {serviceAccountName: capmox-controller-manager}
"#;

    #[test]
    fn the_manager_runs_as_the_shipped_service_account() {
        let (objects, account) = shipped_rbac(MANIFESTS).expect("valid");
        let kinds: Vec<&str> = objects.iter().filter_map(|o| o["kind"].as_str()).collect();
        assert_eq!(kinds, ["Namespace", "ServiceAccount", "ClusterRole"]);
        assert_eq!(
            account.user(),
            "system:serviceaccount:capmox-system:capmox-controller-manager"
        );
        assert!(
            account
                .groups()
                .contains(&"system:serviceaccounts:capmox-system".to_owned())
        );
    }

    #[test]
    fn a_deployment_without_its_service_account_is_refused() {
        let manifests = MANIFESTS.replace("kind: ServiceAccount", "kind: ConfigMap");
        let error = shipped_rbac(&manifests).expect_err("refused");
        assert!(error.contains("capmox-controller-manager"), "{error}");
    }

    /// Options for a real Proxmox without zones or a template, with `topology`.
    fn real_proxmox_options(topology: Option<PathBuf>) -> RealOptions {
        RealOptions {
            namespace: "e2e".into(),
            control_plane: 3,
            workers: 2,
            worker_failure_domain: "rack-b".into(),
            manifests: PathBuf::new(),
            upstream_crds: PathBuf::new(),
            timeout: Duration::from_secs(1),
            proxmox: Some(RealProxmox {
                url: "https://pve.example:8006".into(),
                token: "capmox@pve!e2e".into(),
                secret: "s3cr3t".into(),
                insecure: false,
            }),
            zones: BTreeMap::new(),
            template_id: None,
            source_node: None,
            keep: false,
            topology,
            real_capi: None,
        }
    }

    #[test]
    fn a_real_proxmox_needs_zones_and_a_template() {
        let options = real_proxmox_options(None);
        assert!(matches!(specs(&options, None), Err(RealError::Option(_))));
        assert!(!format!("{:?}", options.proxmox).contains("s3cr3t"));
        let options = RealOptions {
            zones: BTreeMap::from([
                ("a".to_owned(), vec!["n1".to_owned()]),
                ("b".to_owned(), vec!["n2".to_owned(), "n3".to_owned()]),
            ]),
            template_id: Some(100),
            source_node: Some("n1".into()),
            ..options
        };
        let (cluster, machine) = specs(&options, None).expect("complete");
        assert_eq!(cluster["zoneConfig"][1]["nodes"], json!(["n2", "n3"]));
        assert_eq!(cluster["allowedNodes"], json!(["n1", "n2", "n3"]));
        assert_eq!(machine["templateID"], json!(100));
    }

    /// A machine whose endpoint or VM is not its zone's site's fails the two-site check; a
    /// topology file with a real Proxmox is refused.
    #[tokio::test]
    async fn a_machine_off_its_zones_site_fails_the_site_check() {
        let file =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/sandbox-two-sites.yaml");
        let sims = SiteSimulators::start(Some(&file), &SimOptions::default())
            .await
            .expect("two simulators");
        let simulators = sims.simulators();
        let (site_a, site_b) = (simulators[0].1.url(), simulators[1].1.url());
        let row = |zone: &str, endpoint: &str, vmid: &str| MachineRow {
            machine: "demo-control-plane-x".into(),
            failure_domain: zone.into(),
            node: "pve1".into(),
            endpoint: endpoint.into(),
            vmid: vmid.into(),
            ips: "-".into(),
            phase: "Ready".into(),
        };
        let error =
            check_sites(&[row("rack-c", &site_a, "100")], &sims, 1).expect_err("wrong site");
        assert!(
            error
                .to_string()
                .contains(&format!("not site-b's {site_b}")),
            "{error}"
        );
        // VMID 9000 on pve1 is the template, not the machine's VM.
        let error = check_sites(&[row("rack-a", &site_a, "9000")], &sims, 1).expect_err("no VM");
        assert!(
            error
                .to_string()
                .contains("VM 9000 is not on node pve1 of site site-a"),
            "{error}"
        );
        let options = real_proxmox_options(Some(file));
        assert!(matches!(
            simulators_for(&options).await,
            Err(RealError::Option(_))
        ));
    }
}
