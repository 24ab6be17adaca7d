//! The machine tests' scenario: the environment with a ready cluster `demo` whose Proxmox
//! credentials point at a [`Tap`] in front of the simulator, restartable controllers, and what
//! the tests check afterwards (VMs, seed ISOs, claims, conditions, events).

use std::time::Duration;

use capmox::api::ProxmoxMachine;
use capmox::capi::IPAddressClaim;
use capmox_sim::SimOptions;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use serde_json::json;

use super::tap::{self, Tap};
use crate::common::env::{Controllers, ENV_WAIT, Env, condition};

/// Clones take a while, other tasks a little: a crash can land while a task runs.
pub fn sim_options() -> SimOptions {
    SimOptions {
        clone_duration: Duration::from_millis(200),
        task_duration: Duration::from_millis(20),
        boot_delay: Duration::from_millis(100),
        ..SimOptions::default()
    }
}

/// Quick tasks: a machine provisions in a second or two, a fleet within the tests' waits.
pub fn quick_sim() -> SimOptions {
    SimOptions {
        clone_duration: Duration::from_millis(100),
        task_duration: Duration::from_millis(10),
        boot_delay: Duration::from_millis(50),
        ..SimOptions::default()
    }
}

/// A ready cluster `demo` whose credentials point at the tap; the IPAM stand-in runs.
pub struct Scenario {
    pub env: Env,
    pub tap: Tap,
    controllers: Option<Controllers>,
}

impl Scenario {
    pub async fn start(options: SimOptions) -> Scenario {
        Self::started(Env::start_with(options).await).await
    }

    /// The scenario on a simulator of `topology` (nodes pve1-pve4 in racks a and b).
    pub async fn start_with_topology(
        topology: capmox_sim::Topology,
        options: SimOptions,
    ) -> Scenario {
        Self::started(Env::start_with_topology(topology, options).await).await
    }

    async fn started(env: Env) -> Scenario {
        let tap = Tap::start(&env.sim.url()).await;
        let token = env.sim.token();
        let (id, secret) = token.split_once('=').expect("token id=secret");
        let credentials: Secret = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": "demo-credentials", "namespace": "default"},
            "stringData": {"url": tap.url(), "token": id, "secret": secret}
        }))
        .expect("secret");
        Api::<Secret>::namespaced(env.client(), "default")
            .create(&PostParams::default(), &credentials)
            .await
            .expect("credentials");
        let uid = env.create_capi_cluster("demo").await;
        env.create_proxmox_cluster(
            "demo",
            &uid,
            json!({
                "controlPlaneEndpoint": {"host": "10.0.0.10", "port": 6443},
                "dnsServers": ["10.0.0.2"],
                "ipv4Config": {"addresses": ["10.0.0.100-10.0.0.150"], "prefix": 24, "gateway": "10.0.0.1"},
                "credentialsRef": {"name": "demo-credentials"},
                "zoneConfig": [
                    {"zone": "rack-a", "nodes": ["pve1", "pve2"]},
                    {"zone": "rack-b", "nodes": ["pve3", "pve4"]}
                ]
            }),
        )
        .await;
        env.run_ipam();
        let controllers = env.spawn_controllers();
        let cluster = env
            .wait_cluster("demo", "Ready=True", |c| {
                condition(c, "Ready").is_some_and(|c| c.0 == "True")
            })
            .await;
        env.mark_cluster_provisioned("demo", &cluster).await;
        Scenario {
            env,
            tap,
            controllers: Some(controllers),
        }
    }

    /// Stops the controllers gracefully; [`Scenario::start_controllers`] brings fresh ones.
    pub async fn stop_controllers(&mut self) {
        if let Some(controllers) = self.controllers.take() {
            controllers.stop().await;
        }
    }

    /// Starts fresh controllers (after [`Scenario::stop_controllers`]).
    pub fn start_controllers(&mut self) {
        self.controllers = Some(self.env.spawn_controllers());
    }

    /// Starts fresh controllers that talk to the API server through `client`.
    pub fn start_controllers_with(&mut self, client: kube::Client) {
        self.controllers = Some(self.env.spawn_controllers_with(client));
    }

    /// Starts fresh controllers that hold global credentials for the tap.
    pub fn start_controllers_with_global_credentials(&mut self) {
        let token = self.env.sim.token();
        let (id, secret) = token.split_once('=').expect("token id=secret");
        let global = capmox::controller::GlobalCredentials {
            url: Some(self.tap.url().to_owned()),
            token_id: Some(id.to_owned()),
            secret: Some(capmox::proxmox::Secret::new(secret)),
            namespaces: vec!["*".to_owned()],
            ..Default::default()
        };
        self.controllers = Some(
            self.env
                .spawn_controllers_with_credentials(self.env.client(), global),
        );
    }

    /// Kills the controllers like a crashed process, without starting others.
    pub async fn kill_controllers(&mut self) {
        if let Some(controllers) = self.controllers.take() {
            controllers.crash().await;
        }
    }

    /// Kills the controllers like a crashed process and starts fresh ones.
    pub async fn restart(&mut self) {
        if let Some(controllers) = self.controllers.take() {
            controllers.crash().await;
        }
        self.controllers = Some(self.env.spawn_controllers());
    }

    pub async fn create(&self, name: &str) {
        self.create_with(name, machine_spec()).await;
    }

    /// A machine in rack-a with this spec.
    pub async fn create_with(&self, name: &str, spec: serde_json::Value) {
        self.env
            .create_machine("demo", name, Some("rack-a"), false, spec)
            .await;
    }

    /// Creates the machine and returns once its clone request has reached Proxmox, with the
    /// answer held (see [`Tap::trip_at`]), so a test can crash the controllers right after it.
    pub async fn create_until_clone(&self, name: &str) -> tap::Tripped {
        let armed = self.tap.trip_at(self.tap.mutating() + 1);
        self.create(name).await;
        let tripped = first(armed, self.wait_ready(name))
            .await
            .expect("the clone request is the first mutating request");
        assert!(tripped.request.is_clone(), "{:?}", tripped.request);
        tripped
    }

    /// The machine once provisioned, Ready and with no task recorded (the seed ISO's removal,
    /// which follows cloud-init's end, ended too).
    pub async fn wait_ready(&self, name: &str) -> ProxmoxMachine {
        self.env
            .wait_machine(name, "provisioned, Ready, no task running", |m| {
                m.is_provisioned()
                    && condition_status(m, "Ready").as_deref() == Some("True")
                    && m.status.as_ref().is_some_and(|s| s.task_ref.is_none())
            })
            .await
    }

    pub async fn delete(&self, name: &str) -> String {
        let machines = Api::<ProxmoxMachine>::namespaced(self.env.client(), "default");
        let uid = machines
            .get(name)
            .await
            .expect("machine")
            .metadata
            .uid
            .expect("uid");
        machines
            .delete(name, &DeleteParams::default())
            .await
            .expect("delete");
        uid
    }

    pub async fn wait_deleted(&self, name: &str, uid: &str) {
        let machines = Api::<ProxmoxMachine>::namespaced(self.env.client(), "default");
        tokio::time::timeout(
            ENV_WAIT,
            kube::runtime::wait::await_condition(
                machines.clone(),
                name,
                kube::runtime::wait::conditions::is_deleted(uid),
            ),
        )
        .await
        .unwrap_or_else(|_| panic!("{name} deleted in time"))
        .expect("watch");
    }

    /// Once the request armed with [`Tap::trip_at`] has been carried out by Proxmox (see
    /// [`first`]): kills the controllers, lets the held answer go to nobody and starts fresh
    /// controllers. Returns that request.
    pub async fn crash(&mut self, tripped: tap::Tripped) -> String {
        if let Some(controllers) = self.controllers.take() {
            controllers.crash().await;
        }
        let _ = tripped.resume.send(());
        self.controllers = Some(self.env.spawn_controllers());
        format!("{} {}", tripped.request.method, tripped.request.path)
    }

    /// Non-template VMs in the simulator.
    pub async fn vms(&self) -> Vec<(u32, Vec<String>)> {
        self.env
            .proxmox()
            .cluster_resources(None)
            .await
            .expect("resources")
            .into_iter()
            .filter(|r| r.kind == capmox::proxmox::ResourceType::Qemu && !r.template)
            .map(|r| (r.vmid.unwrap_or_default(), r.tags))
            .collect()
    }

    /// Seed ISOs (`user-data-<vmid>.iso`) left on any node.
    pub async fn seed_isos(&self) -> Vec<String> {
        let proxmox = self.env.proxmox();
        let mut found = Vec::new();
        for node in ["pve1", "pve2", "pve3", "pve4", "pve5"] {
            for storage in proxmox
                .list_storage(node, Some("iso"))
                .await
                .expect("storage")
            {
                for item in proxmox
                    .storage_content(node, &storage.storage, Some("iso"), None)
                    .await
                    .expect("content")
                {
                    if item.volid.contains("user-data-") && !found.contains(&item.volid) {
                        found.push(item.volid);
                    }
                }
            }
        }
        found
    }

    pub async fn claims(&self) -> usize {
        Api::<IPAddressClaim>::namespaced(self.env.client(), "default")
            .list(&ListParams::default())
            .await
            .expect("claims")
            .items
            .len()
    }

    /// Exactly one VM for the machine: the one in its status, tagged for it.
    pub async fn assert_one_vm(&self, machine: &ProxmoxMachine, context: &str) {
        let vms = self.vms().await;
        assert_eq!(vms.len(), 1, "{context}: VMs {vms:?}");
        self.assert_vm_of(machine, context).await;
        let status = machine.status.as_ref().expect("status");
        assert_eq!(status.task_ref, None, "{context}: task still recorded");
        assert_eq!(status.retry_after, None, "{context}");
    }

    /// The VM in the machine's status exists and carries the machine's tag; no other VM does.
    pub async fn assert_vm_of(&self, machine: &ProxmoxMachine, context: &str) {
        let vmid = machine
            .status
            .as_ref()
            .and_then(|s| s.virtual_machine_id)
            .expect("vmid in status");
        let tag = capmox::controller::machine::machine_tag(machine);
        let vms = self.vms().await;
        let tagged: Vec<i64> = vms
            .iter()
            .filter(|(_, tags)| tags.contains(&tag))
            .map(|(id, _)| i64::from(*id))
            .collect();
        assert_eq!(tagged, vec![vmid], "{context}: VMs tagged {tag} in {vms:?}");
    }

    pub async fn assert_nothing_left(&self, context: &str) {
        assert_eq!(self.vms().await, vec![], "{context}: VMs left");
        assert_eq!(self.seed_isos().await, Vec::<String>::new(), "{context}");
        assert_eq!(self.claims().await, 0, "{context}: IPAddressClaims left");
    }
}

/// The spec of the scenario's machines: template 9000, one NIC with a rack-a address.
pub fn machine_spec() -> serde_json::Value {
    json!({
        "sourceNode": "pve1", "templateID": 9000, "memoryMiB": 2048, "numCores": 2,
        "disks": {"bootVolume": {"disk": "scsi0", "sizeGb": 20}},
        "network": {"networkDevices": [{"name": "net0", "bridge": "vmbr0", "defaultIPv4": true}]}
    })
}

/// As [`machine_spec`], for a machine whose seed ISO stays until its node joins (which no
/// scenario does on its own): cloud-init is not checked, so its end does not say the guest is
/// done with the ISO.
pub fn machine_spec_keeping_seed_iso() -> serde_json::Value {
    let mut spec = machine_spec();
    spec["checks"] = json!({"skipCloudInitStatus": true});
    spec
}

pub fn condition_status(machine: &ProxmoxMachine, type_: &str) -> Option<String> {
    machine_condition(machine, type_).map(|c| c.0)
}

/// (status, reason, message) of a ProxmoxMachine condition.
pub fn machine_condition(
    machine: &ProxmoxMachine,
    type_: &str,
) -> Option<(String, String, String)> {
    machine
        .status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
}

/// Waits for an event with `reason` about the ProxmoxMachine `name`.
pub async fn wait_event(env: &Env, name: &str, reason: &str) -> Event {
    use futures::StreamExt;
    let events = Api::<Event>::namespaced(env.client(), "default");
    let stream = kube::runtime::watcher(events, kube::runtime::watcher::Config::default());
    let found = tokio::time::timeout(
        ENV_WAIT,
        kube::runtime::WatchStreamExt::applied_objects(stream)
            .filter_map(|e| async move { e.ok() })
            .filter(|e: &Event| {
                let hit = e.reason.as_deref() == Some(reason)
                    && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name);
                async move { hit }
            })
            .boxed()
            .next(),
    )
    .await;
    match found {
        Ok(Some(event)) => event,
        other => panic!("no {reason} event for {name}: {other:?}"),
    }
}

/// The armed request, or `None` when `goal` (the end of the run) comes first, so the run made
/// fewer requests than armed for.
pub async fn first<T>(
    armed: tokio::sync::oneshot::Receiver<tap::Tripped>,
    goal: impl std::future::Future<Output = T>,
) -> Option<tap::Tripped> {
    tokio::select! {
        tripped = armed => Some(tripped.expect("tap alive")),
        _ = goal => None,
    }
}
