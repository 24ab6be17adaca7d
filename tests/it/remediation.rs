//! Reboot-first remediation: a ProxmoxRemediation, as a MachineHealthCheck creates it for an
//! unhealthy Machine, reboots the Machine's VM (resetting it when the guest does not shut down in
//! time), gives the Node its time, and only then hands the Machine back to its owner.

use std::time::Duration;

use capmox::api::ProxmoxMachine;
use capmox_sim::SimOptions;
use kube::api::{Api, PostParams};
use serde_json::{Value, json};

use crate::common::env::{Env, condition, eventually};

const WAIT: Duration = Duration::from_secs(60);

/// A cluster `demo` with one zone on pve1 and a provisioned worker `worker-1`; its VMID.
async fn provisioned_worker() -> (Env, u32) {
    provisioned_worker_in(json!([{"zone": "rack-a", "nodes": ["pve1"]}]), None).await
}

/// A cluster `demo` with `zones` (and `ha`, when given) and a provisioned rack-a worker
/// `worker-1`; its VMID.
async fn provisioned_worker_in(zones: Value, ha: Option<Value>) -> (Env, u32) {
    let env = Env::start_with(SimOptions::default()).await;
    env.create_credentials("demo-credentials", None).await;
    let uid = env.create_capi_cluster("demo").await;
    let spec = json!({
        "controlPlaneEndpoint": {"host": "10.0.0.10", "port": 6443},
        "dnsServers": ["10.0.0.2"],
        "ipv4Config": {"addresses": ["10.0.0.100-10.0.0.150"], "prefix": 24, "gateway": "10.0.0.1"},
        "credentialsRef": {"name": "demo-credentials"},
        "schedulerHints": {"memoryAdjustment": 0},
        "zoneConfig": zones
    });
    let mut spec = spec;
    if let Some(ha) = ha {
        spec["ha"] = ha;
    }
    env.create_proxmox_cluster("demo", &uid, spec).await;
    env.run_controllers();
    env.run_ipam();
    let cluster = env
        .wait_cluster("demo", "Ready=True", |c| {
            condition(c, "Ready").is_some_and(|c| c.0 == "True")
        })
        .await;
    env.mark_cluster_provisioned("demo", &cluster).await;
    let machine_spec = json!({
        "sourceNode": "pve1", "templateID": 9000, "memoryMiB": 2048,
        "network": {"networkDevices": [{"name": "net0", "bridge": "vmbr0", "defaultIPv4": true}]}
    });
    env.create_machine("demo", "worker-1", Some("rack-a"), false, machine_spec)
        .await;
    let machine = env
        .wait_machine("worker-1", "provisioned", ProxmoxMachine::is_provisioned)
        .await;
    let vmid = machine
        .status
        .and_then(|s| s.virtual_machine_id)
        .and_then(|id| u32::try_from(id).ok())
        .expect("the VMID is recorded");
    (env, vmid)
}

/// Creates the ProxmoxRemediation a MachineHealthCheck would: named after the Machine, owned by
/// it, in `namespace`.
async fn request_remediation(env: &Env, namespace: &str, machine: &str, strategy: Value) {
    let mut metadata = json!({
        "name": machine, "namespace": namespace,
        "labels": {"cluster.x-k8s.io/cluster-name": "demo"},
    });
    if let Some(owner) = Api::<capmox::capi::Machine>::namespaced(env.client(), namespace)
        .get_opt(machine)
        .await
        .expect("a read")
    {
        metadata["ownerReferences"] = json!([{"apiVersion": "cluster.x-k8s.io/v1beta2",
            "kind": "Machine", "name": machine, "uid": owner.metadata.uid.expect("uid")}]);
    }
    let remediation: capmox::api::ProxmoxRemediation = serde_json::from_value(json!({
        "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha2", "kind": "ProxmoxRemediation",
        "metadata": metadata,
        "spec": {"strategy": strategy}
    }))
    .expect("a remediation");
    Api::<capmox::api::ProxmoxRemediation>::namespaced(env.client(), namespace)
        .create(&PostParams::default(), &remediation)
        .await
        .expect("remediation created");
}

/// Waits until the remediation's status satisfies `done`; its status.
async fn wait_status(
    env: &Env,
    namespace: &str,
    name: &str,
    done: impl Fn(&Value) -> bool,
) -> Value {
    let object = env
        .server
        .wait_for("proxmoxremediations", namespace, name, WAIT, |o| {
            o.is_some_and(|o| done(&o["status"]))
        })
        .await
        .unwrap_or_else(|e| {
            let now = env.server.object("proxmoxremediations", namespace, name);
            panic!("remediation {namespace}/{name}: {e}; now {now:?}")
        })
        .expect("the remediation exists");
    object["status"].clone()
}

fn remediated(status: &Value) -> (String, String) {
    let condition = status["conditions"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["type"] == "Remediated"))
        .cloned()
        .unwrap_or_default();
    (
        condition["reason"].as_str().unwrap_or_default().to_owned(),
        condition["message"].as_str().unwrap_or_default().to_owned(),
    )
}

fn owner_remediated(env: &Env, machine: &str) -> Option<Value> {
    let object = env
        .server
        .object("machines", "default", machine)
        .expect("the kind")
        .expect("the Machine");
    object["status"]["conditions"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["type"] == "OwnerRemediated"))
        .cloned()
}

fn tasks_of(env: &Env, vmid: u32) -> Vec<(String, bool)> {
    env.sim
        .task_records()
        .into_iter()
        .filter(|t| t.vmid == Some(vmid) && matches!(t.kind.as_str(), "qmreboot" | "qmreset"))
        .map(|t| (t.kind, t.ok))
        .collect()
}

#[tokio::test]
async fn a_reboot_restarts_the_vm_and_gives_the_node_its_time() {
    let (env, vmid) = provisioned_worker().await;
    let boots = env.sim.boots(vmid).expect("the VM");
    request_remediation(&env, "default", "worker-1", json!({"retryLimit": 2})).await;
    let status = wait_status(&env, "default", "worker-1", |s| {
        s["phase"] == "WaitingForNode"
    })
    .await;
    assert_eq!(status["retryCount"], 1);
    assert_eq!(status["virtualMachineId"], vmid);
    assert_eq!(status["proxmoxNode"], "pve1");
    assert!(status["lastRemediated"].is_string(), "{status}");
    let (reason, message) = remediated(&status);
    assert_eq!(reason, "WaitingForNode");
    assert!(
        message.contains("waiting up to 300s for the Node"),
        "{message}"
    );
    assert_eq!(
        env.sim.boots(vmid),
        Some(boots + 1),
        "the VM restarted once"
    );
    assert_eq!(tasks_of(&env, vmid), [("qmreboot".to_owned(), true)]);
    assert_eq!(
        owner_remediated(&env, "worker-1"),
        None,
        "the Machine is not handed back while the Node has time"
    );
}

#[tokio::test]
async fn a_hung_guest_is_reset_and_after_the_last_reboot_its_owner_replaces_the_machine() {
    let (env, vmid) = provisioned_worker().await;
    let boots = env.sim.boots(vmid).expect("the VM");
    env.sim.hang_guest(vmid);
    request_remediation(
        &env,
        "default",
        "worker-1",
        json!({"retryLimit": 1, "timeoutSeconds": 1, "shutdownTimeoutSeconds": 1}),
    )
    .await;
    let status = wait_status(&env, "default", "worker-1", |s| s["phase"] == "Replacing").await;
    let (reason, message) = remediated(&status);
    assert_eq!(reason, "ReplacementRequested");
    assert!(
        message.starts_with(&format!(
            "the Node did not become healthy within 1s of 1 reboot(s) of VM {vmid} on pve1"
        )),
        "{message}"
    );
    assert_eq!(
        tasks_of(&env, vmid),
        [("qmreboot".to_owned(), false), ("qmreset".to_owned(), true)],
        "the clean reboot timed out, the reset restarted the VM"
    );
    assert_eq!(env.sim.boots(vmid), Some(boots + 1));
    let handed = owner_remediated(&env, "worker-1").expect("OwnerRemediated is set");
    assert_eq!(handed["status"], "False");
    assert_eq!(handed["reason"], "WaitingForRemediation");
    assert!(
        handed["message"]
            .as_str()
            .is_some_and(|m| m.contains("handed back to its owner")),
        "{handed}"
    );
}

#[tokio::test]
async fn a_request_for_a_machine_of_another_namespace_reboots_nothing() {
    let (env, vmid) = provisioned_worker().await;
    let boots = env.sim.boots(vmid).expect("the VM");
    // Same name as the tenant's Machine, in another namespace: it names no Machine there.
    request_remediation(&env, "tenant-b", "worker-1", json!({})).await;
    let status = wait_status(&env, "tenant-b", "worker-1", |s| s["conditions"].is_array()).await;
    assert_eq!(remediated(&status).0, "MachineNotFound", "{status}");
    assert_eq!(env.sim.boots(vmid), Some(boots));
    assert!(tasks_of(&env, vmid).is_empty());
    assert_eq!(owner_remediated(&env, "worker-1"), None);
}

#[tokio::test]
async fn an_ha_managed_vm_is_moved_within_its_zone_before_its_machine_is_replaced() {
    let (env, vmid) = provisioned_worker_in(
        json!([{"zone": "rack-a", "nodes": ["pve1", "pve2"]}, {"zone": "rack-b", "nodes": ["pve3"]}]),
        Some(json!({"enabled": true})),
    )
    .await;
    let node_of = |env: &Env| env.sim.vm_node(vmid).expect("the VM");
    let from = node_of(&env);
    // Its node joined: the seed ISO (on node-local storage, which would keep HA from moving
    // the VM) is deleted and detached, as with every machine that has a Node.
    Api::<capmox::capi::Machine>::namespaced(env.client(), "default")
        .patch_status(
            "worker-1",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({"status": {"nodeRef": {"name": "worker-1"}}})),
        )
        .await
        .expect("nodeRef set");
    let proxmox = env.proxmox();
    eventually("the seed ISO detached", || async {
        proxmox
            .vm_config(&from, vmid)
            .await
            .expect("config")
            .get("ide0")
            .is_none()
    })
    .await;
    let to = if from == "pve1" { "pve2" } else { "pve1" };
    env.sim.hang_guest(vmid);
    request_remediation(
        &env,
        "default",
        "worker-1",
        json!({"retryLimit": 1, "timeoutSeconds": 2, "shutdownTimeoutSeconds": 1}),
    )
    .await;
    let moving = wait_status(&env, "default", "worker-1", |s| s["phase"] == "Moving").await;
    assert_eq!(moving["movedTo"], to, "{moving}");
    let status = wait_status(&env, "default", "worker-1", |s| s["phase"] == "Replacing").await;
    assert_eq!(node_of(&env), to, "HA moved the VM within rack-a");
    let (reason, message) = remediated(&status);
    assert_eq!(reason, "ReplacementRequested");
    assert!(
        message.contains(&format!(
            "of 1 reboot(s) and a move to {to} of VM {vmid} on {to}"
        )),
        "{message}"
    );
    assert!(owner_remediated(&env, "worker-1").is_some());
}
