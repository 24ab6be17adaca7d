#![allow(dead_code)]
//! A management cluster on one machine: the in-process Kubernetes API with capmox's and the
//! upstream CRDs (objects validated against their schemas, as the API server would), and the
//! Proxmox VE simulator. Shared by capmox's tests and the sandbox crate's (included with
//! `#[path]`, beside `paths.rs`).

use std::sync::Arc;
use std::time::Duration;

use capmox::api::ProxmoxCluster;
use capmox::controller::{Context, GlobalCredentials, ManagerConfig};
use capmox_sim::{SimOptions, Simulator, Topology};
use capmox_testkit::ApiServer;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, PostParams};
use kube::runtime::wait::await_condition;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

/// Upper bound for anything a test waits on.
pub const ENV_WAIT: Duration = Duration::from_secs(30);

/// Five nodes: rack-a (pve1, pve2), rack-b (pve3, pve4) and a spare (pve5), as the sandbox has.
pub const TOPOLOGY: &str = capmox_sandbox::run::TOPOLOGY;

/// The running environment; dropping it stops the controllers.
pub struct Env {
    pub server: ApiServer,
    pub sim: Simulator,
    pub context: Arc<Context>,
    pub stop: CancellationToken,
}

impl Drop for Env {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl Env {
    /// API server with every CRD registered and schema validation on, plus the simulator.
    pub async fn start() -> Env {
        Self::start_with(SimOptions::default()).await
    }

    /// As [`Env::start`], with simulator options (task durations, faults).
    pub async fn start_with(options: SimOptions) -> Env {
        let topology = Topology::from_yaml(TOPOLOGY, "test topology").expect("topology");
        Self::start_with_topology(topology, options).await
    }

    /// As [`Env::start_with`], on another Proxmox cluster (storages, templates).
    pub async fn start_with_topology(topology: Topology, options: SimOptions) -> Env {
        let server = ApiServer::new();
        server.register_builtin_kinds();
        server
            .register_crd_dir(crate::paths::root().join("crds"))
            .expect("capmox CRDs register");
        server
            .register_crd_dir(crate::paths::data("external-crds"))
            .expect("upstream CRDs register (tests/data/external-crds)");
        for crd in capmox::api::crd::all().expect("CRDs render") {
            let schema = capmox::api::crd::schema_json(&crd).expect("schema");
            server
                .set_validator(&crd.spec.names.plural, move |object| {
                    capmox_testkit::schema::validate_object(&schema, object, None)
                        .map(|_| ())
                        .map_err(|violations| {
                            violations
                                .iter()
                                .map(ToString::to_string)
                                .collect::<Vec<_>>()
                                .join("; ")
                        })
                })
                .expect("kind registered");
        }
        let sim = Simulator::start(topology, options)
            .await
            .expect("simulator starts");
        let context = Arc::new(Context::new(
            server.client(),
            manager_config(),
            GlobalCredentials::default(),
        ));
        Env {
            server,
            sim,
            context,
            stop: CancellationToken::new(),
        }
    }

    /// Starts the reconcilers and the IPAM stand-in; they stop when the environment is dropped.
    pub fn run_controllers(&self) {
        tokio::spawn(capmox::controller::run_controllers(
            self.context.clone(),
            self.stop.clone(),
        ));
        tokio::spawn(capmox_sandbox::ipam::run(self.client(), self.stop.clone()));
    }

    /// Starts only capmox's reconcilers, with a fresh [`Context`] (no caches, reservations or
    /// Proxmox clients of an earlier run), as a restarted process would; see [`Controllers`].
    pub fn spawn_controllers(&self) -> Controllers {
        self.spawn_controllers_with(self.client())
    }

    /// As [`Env::spawn_controllers`], talking to the API server through `client`.
    pub fn spawn_controllers_with(&self, client: kube::Client) -> Controllers {
        self.spawn_controllers_with_credentials(client, GlobalCredentials::default())
    }

    /// As [`Env::spawn_controllers_with`], with capmox's global Proxmox credentials.
    pub fn spawn_controllers_with_credentials(
        &self,
        client: kube::Client,
        global: GlobalCredentials,
    ) -> Controllers {
        let context = Arc::new(Context::new(client, manager_config(), global));
        let stop = self.stop.child_token();
        let task = tokio::spawn(capmox::controller::run_controllers(context, stop.clone()));
        Controllers { task, stop }
    }

    /// Starts the IPAM stand-in alone (it stops when the environment is dropped).
    pub fn run_ipam(&self) {
        tokio::spawn(capmox_sandbox::ipam::run(self.client(), self.stop.clone()));
    }

    /// Plays CAPI core for a provisioned ProxmoxCluster: marks the Cluster's infrastructure
    /// provisioned and copies the failure domains.
    pub async fn mark_cluster_provisioned(&self, name: &str, cluster: &ProxmoxCluster) {
        let domains = cluster
            .status
            .as_ref()
            .map(|s| s.failure_domains.clone())
            .unwrap_or_default();
        Api::<capmox::capi::Cluster>::namespaced(self.client(), "default")
            .patch_status(
                name,
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Merge(json!({"status": {
                    "initialization": {"infrastructureProvisioned": true},
                    "failureDomains": domains
                }})),
            )
            .await
            .expect("cluster status patched");
    }

    /// A CAPI Machine with its bootstrap Secret and a ProxmoxMachine it owns.
    pub async fn create_machine(
        &self,
        cluster: &str,
        name: &str,
        failure_domain: Option<&str>,
        control_plane: bool,
        spec: Value,
    ) {
        let secret: Secret = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": format!("{name}-bootstrap"), "namespace": "default"},
            "type": "cluster.x-k8s.io/secret",
            "stringData": {"value": "#cloud-config\nruncmd: [echo hello]\n", "format": "cloud-config"}
        }))
        .expect("secret");
        Api::<Secret>::namespaced(self.client(), "default")
            .create(&PostParams::default(), &secret)
            .await
            .expect("bootstrap secret");
        let mut labels = json!({"cluster.x-k8s.io/cluster-name": cluster});
        if control_plane {
            labels["cluster.x-k8s.io/control-plane"] = json!("");
        }
        let mut machine_spec = json!({
            "clusterName": cluster,
            "bootstrap": {"dataSecretName": format!("{name}-bootstrap")},
            "infrastructureRef": {"apiGroup": "infrastructure.cluster.x-k8s.io", "kind": "ProxmoxMachine", "name": name}
        });
        if let Some(domain) = failure_domain {
            machine_spec["failureDomain"] = json!(domain);
        }
        let machine: capmox::capi::Machine = serde_json::from_value(json!({
            "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Machine",
            "metadata": {"name": name, "namespace": "default", "labels": labels},
            "spec": machine_spec
        }))
        .expect("machine");
        let created = Api::<capmox::capi::Machine>::namespaced(self.client(), "default")
            .create(&PostParams::default(), &machine)
            .await
            .expect("machine created");
        let proxmox_machine: capmox::api::ProxmoxMachine = serde_json::from_value(json!({
            "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha2", "kind": "ProxmoxMachine",
            "metadata": {
                "name": name, "namespace": "default", "labels": labels,
                "ownerReferences": [{"apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Machine", "name": name,
                    "uid": created.metadata.uid.expect("uid"), "controller": true}]
            },
            "spec": spec
        }))
        .expect("proxmox machine");
        Api::<capmox::api::ProxmoxMachine>::namespaced(self.client(), "default")
            .create(&PostParams::default(), &proxmox_machine)
            .await
            .expect("proxmox machine created");
    }

    /// Waits until the ProxmoxMachine satisfies `condition`, returning it.
    pub async fn wait_machine(
        &self,
        name: &str,
        what: &str,
        condition: impl Fn(&capmox::api::ProxmoxMachine) -> bool,
    ) -> capmox::api::ProxmoxMachine {
        let api = Api::<capmox::api::ProxmoxMachine>::namespaced(self.client(), "default");
        let found = tokio::time::timeout(
            ENV_WAIT,
            await_condition(
                api.clone(),
                name,
                move |m: Option<&capmox::api::ProxmoxMachine>| m.is_some_and(&condition),
            ),
        )
        .await;
        match found {
            Ok(Ok(Some(machine))) => machine,
            other => {
                let now = api.get_opt(name).await.ok().flatten();
                panic!(
                    "timed out waiting for {what}: {other:?}\nlast seen: {:#?}",
                    now.and_then(|m| m.status)
                );
            }
        }
    }

    /// Waits until the ProxmoxMachine has a condition with this reason, returning it and the
    /// condition's message.
    pub async fn wait_machine_reason(
        &self,
        name: &str,
        reason: &str,
    ) -> (capmox::api::ProxmoxMachine, String) {
        let message = |m: &capmox::api::ProxmoxMachine| {
            m.status
                .iter()
                .flat_map(|s| s.conditions.iter())
                .find(|c| c.reason == reason)
                .map(|c| c.message.clone())
        };
        let machine = self
            .wait_machine(name, reason, |m| message(m).is_some())
            .await;
        let text = message(&machine).unwrap_or_default();
        (machine, text)
    }

    /// A Proxmox client for the simulator.
    pub fn proxmox(&self) -> capmox::proxmox::ProxmoxClient {
        let config = capmox::proxmox::ClientConfig::new(
            self.sim.url(),
            capmox::proxmox::ApiToken::parse(&self.sim.token()).expect("token"),
        );
        capmox::proxmox::ProxmoxClient::new(&config).expect("client")
    }

    pub fn client(&self) -> kube::Client {
        self.server.client()
    }

    /// A credentials Secret for the simulator; `secret` overrides the token secret.
    pub async fn create_credentials(&self, name: &str, secret: Option<&str>) {
        let token = self.sim.token();
        let (id, real_secret) = token.split_once('=').expect("token id=secret");
        let secret_value = secret.unwrap_or(real_secret);
        let object: Secret = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": name, "namespace": "default"},
            "stringData": {"url": self.sim.url(), "token": id, "secret": secret_value}
        }))
        .expect("secret");
        Api::<Secret>::namespaced(self.client(), "default")
            .create(&PostParams::default(), &object)
            .await
            .expect("secret created");
    }

    /// A CAPI Cluster `name` whose infrastructure is the ProxmoxCluster `name`; returns its uid.
    pub async fn create_capi_cluster(&self, name: &str) -> String {
        let cluster: capmox::capi::Cluster = serde_json::from_value(json!({
            "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Cluster",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"infrastructureRef": {"apiGroup": "infrastructure.cluster.x-k8s.io", "kind": "ProxmoxCluster", "name": name}}
        }))
        .expect("cluster");
        let created = Api::<capmox::capi::Cluster>::namespaced(self.client(), "default")
            .create(&PostParams::default(), &cluster)
            .await
            .expect("cluster created");
        created.metadata.uid.expect("uid")
    }

    /// A ProxmoxCluster owned by the CAPI Cluster of the same name.
    pub async fn create_proxmox_cluster(
        &self,
        name: &str,
        owner_uid: &str,
        spec: Value,
    ) -> ProxmoxCluster {
        let object: ProxmoxCluster = serde_json::from_value(json!({
            "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha2", "kind": "ProxmoxCluster",
            "metadata": {
                "name": name, "namespace": "default",
                "labels": {"cluster.x-k8s.io/cluster-name": name},
                "ownerReferences": [{"apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Cluster", "name": name, "uid": owner_uid}]
            },
            "spec": spec
        }))
        .expect("proxmox cluster");
        Api::<ProxmoxCluster>::namespaced(self.client(), "default")
            .create(&PostParams::default(), &object)
            .await
            .expect("proxmox cluster created")
    }

    /// Waits until the ProxmoxCluster satisfies `condition`, returning it.
    pub async fn wait_cluster(
        &self,
        name: &str,
        what: &str,
        condition: impl Fn(&ProxmoxCluster) -> bool,
    ) -> ProxmoxCluster {
        let api = Api::<ProxmoxCluster>::namespaced(self.client(), "default");
        let found = tokio::time::timeout(
            ENV_WAIT,
            await_condition(api.clone(), name, move |c: Option<&ProxmoxCluster>| {
                c.is_some_and(&condition)
            }),
        )
        .await;
        match found {
            Ok(Ok(Some(cluster))) => cluster,
            other => {
                let now = api.get_opt(name).await.ok().flatten();
                panic!(
                    "timed out waiting for {what}: {other:?}\nlast seen: {:#?}",
                    now.and_then(|c| c.status)
                );
            }
        }
    }
}

/// The manager settings every test environment uses.
pub fn manager_config() -> ManagerConfig {
    ManagerConfig {
        metrics_address: "127.0.0.1:0".parse().expect("addr"),
        health_address: "127.0.0.1:0".parse().expect("addr"),
        leader_election: None,
        watch_namespace: None,
        watch_filter: None,
        cluster_concurrency: 2,
        machine_concurrency: 4,
        task_timing: Default::default(),
        zone_holds: Default::default(),
        proxmox_requests_in_flight: capmox::proxmox::DEFAULT_REQUESTS_IN_FLIGHT,
        webhook: None,
    }
}

/// capmox's reconcilers started by [`Env::spawn_controllers`].
pub struct Controllers {
    task: tokio::task::JoinHandle<()>,
    stop: CancellationToken,
}

impl Controllers {
    /// Kills the reconcilers like a crashed process: every reconcile in flight is dropped at
    /// its current await point, nothing runs to completion. Returns once they are gone.
    pub async fn crash(self) {
        self.task.abort();
        let _ = self.task.await;
    }

    /// Stops the reconcilers gracefully (the reconciles in flight finish first).
    pub async fn stop(self) {
        self.stop.cancel();
        let _ = self.task.await;
    }
}

/// The condition of `type_` on a ProxmoxCluster, as (status, reason, message).
pub fn condition(cluster: &ProxmoxCluster, type_: &str) -> Option<(String, String, String)> {
    cluster
        .status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
}

/// Polls `check` (bounded by the environment's wait) until it holds.
pub async fn eventually<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + ENV_WAIT;
    while !check().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
