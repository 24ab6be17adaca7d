//! What a user sees of the ProxmoxMachine reconciler besides status: Kubernetes events
//! (events.k8s.io/v1) for what it does in Proxmox and for what went wrong in the guest, and a
//! clear refusal of bootstrap data it cannot deliver (an unknown format) before any VM exists.

use crate::machine_support::{lag, scenario, tap};

use std::sync::Arc;
use std::time::Duration;

use capmox::api::ProxmoxMachine;
use capmox_sim::SimOptions;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::runtime::controller::Action;
use scenario::{Scenario, machine_condition, sim_options, wait_event};
use serde_json::{Value, json};

#[tokio::test]
async fn provisioning_publishes_normal_events_for_each_proxmox_action() {
    let mut scenario = Scenario::start(sim_options()).await;
    // Watch events arrive late, as from a busy kube-apiserver: a reconcile may start from a
    // copy of the machine older than the controller's own last status write.
    scenario.stop_controllers().await;
    scenario.start_controllers_with(lag::lagging_client(
        &scenario.env.server,
        Duration::from_millis(300),
    ));
    scenario.create("demo-md-1").await;
    let machine = scenario.wait_ready("demo-md-1").await;
    let vmid = machine
        .status
        .as_ref()
        .and_then(|s| s.virtual_machine_id)
        .expect("vmid");
    for reason in ["Cloned", "PoweredOn", "Provisioned"] {
        let event = wait_event(&scenario.env, "demo-md-1", reason).await;
        assert_eq!(event.type_.as_deref(), Some("Normal"), "{event:?}");
        assert_eq!(
            event.reporting_controller.as_deref(),
            Some(capmox::controller::machine::FIELD_MANAGER)
        );
        let regarding = event.regarding.as_ref().expect("regarding");
        assert_eq!(regarding.kind.as_deref(), Some("ProxmoxMachine"));
        assert_eq!(regarding.uid, machine.metadata.uid);
        assert!(
            event
                .note
                .as_deref()
                .is_some_and(|n| n.contains(&vmid.to_string())),
            "{reason} names VM {vmid}: {:?}",
            event.note
        );
    }
    // Each action is announced once: a pass that works from a stale cached copy of the machine
    // (its status still naming the finished clone task) must not announce the clone again.
    let announced = |reason: &str| {
        let reason = reason.to_owned();
        let uid = machine.metadata.uid.clone();
        let events = Api::<Event>::namespaced(scenario.env.client(), "default");
        async move {
            let list = events.list(&ListParams::default()).await.expect("events");
            list.items
                .iter()
                .filter(|e| e.reason.as_deref() == Some(reason.as_str()))
                .filter(|e| e.regarding.as_ref().and_then(|r| r.uid.clone()) == uid)
                .map(|e| e.series.as_ref().map_or(1, |s| s.count))
                .sum::<i32>()
        }
    };
    for reason in ["Cloned", "PoweredOn", "Provisioned"] {
        assert_eq!(announced(reason).await, 1, "{reason} events");
    }
}

#[tokio::test]
async fn a_failed_cloud_init_is_a_warning_event_and_the_condition_names_its_errors() {
    let scenario = Scenario::start(SimOptions {
        cloud_init_failure: Some("modules-final: runcmd failed".into()),
        ..sim_options()
    })
    .await;
    scenario.create("demo-md-2").await;
    let machine = scenario
        .env
        .wait_machine("demo-md-2", "CloudInitFailed", |m| {
            machine_condition(m, "VirtualMachineProvisioned")
                .is_some_and(|c| c.1 == "CloudInitFailed")
        })
        .await;
    let (status, _, message) =
        machine_condition(&machine, "VirtualMachineProvisioned").expect("condition");
    assert_eq!(status, "False");
    assert!(
        message.starts_with("cloud-init failed in VM ") && message.contains("runcmd failed"),
        "{message}"
    );
    let warning = wait_event(&scenario.env, "demo-md-2", "CloudInitFailed").await;
    assert_eq!(warning.type_.as_deref(), Some("Warning"));
    assert_eq!(warning.note.as_deref(), Some(message.as_str()));
    assert!(!machine.is_provisioned());
}

#[tokio::test]
async fn cloud_init_recoverable_errors_are_a_warning_but_the_machine_provisions() {
    let scenario = Scenario::start(sim_options()).await;
    // A guest with cloud-init ≥ 23.4 that finished with recoverable errors (its
    // `cloud-init status` exits 2): they are in the result file's `recoverable_errors`.
    scenario.tap.set_rewrite(Box::new(|method, path, body| {
        if method != "GET" || !path.contains("/agent/file-read") {
            return None;
        }
        let mut answer: Value = serde_json::from_slice(body).ok()?;
        let mut result: Value = serde_json::from_str(answer["data"]["content"].as_str()?).ok()?;
        result["v1"]["recoverable_errors"] =
            json!({"DEPRECATED": ["Deprecated cloud-config provided: chpasswd.list"]});
        answer["data"]["content"] = json!(result.to_string());
        serde_json::to_vec(&answer).ok()
    }));
    scenario.create("demo-md-3").await;
    let machine = scenario.wait_ready("demo-md-3").await;
    assert!(machine.is_provisioned());
    let warning = wait_event(&scenario.env, "demo-md-3", "CloudInitDegraded").await;
    assert_eq!(warning.type_.as_deref(), Some("Warning"));
    assert!(
        warning
            .note
            .as_deref()
            .is_some_and(|n| n.contains("recoverable errors") && n.contains("chpasswd.list")),
        "{warning:?}"
    );
}

#[tokio::test]
async fn an_unknown_bootstrap_format_is_refused_before_any_vm_is_created() {
    let mut scenario = Scenario::start(sim_options()).await;
    let vms_before = scenario.vms().await;
    // The machine appears with bootstrap data in a format no provider delivers (Butane YAML
    // that was never transpiled to Ignition).
    scenario.stop_controllers().await;
    scenario.create("demo-md-4").await;
    Api::<Secret>::namespaced(scenario.env.client(), "default")
        .patch(
            "demo-md-4-bootstrap",
            &PatchParams::default(),
            // `data` (base64), as the API server stores it: "butane" and a Butane config.
            &Patch::Merge(json!({"data": {
                "format": "YnV0YW5l",
                "value": "dmFyaWFudDogZmxhdGNhcgp2ZXJzaW9uOiAxLjEuMAo="
            }})),
        )
        .await
        .expect("secret patched");
    scenario.start_controllers();
    let machine = scenario
        .env
        .wait_machine("demo-md-4", "BootstrapFormatUnsupported", |m| {
            machine_condition(m, "VirtualMachineProvisioned")
                .is_some_and(|c| c.1 == "BootstrapFormatUnsupported")
        })
        .await;
    let (status, _, message) =
        machine_condition(&machine, "VirtualMachineProvisioned").expect("condition");
    assert_eq!(status, "False");
    assert_eq!(
        message,
        "bootstrap Secret demo-md-4-bootstrap: bootstrap data format \"butane\" is unknown; \
         the bootstrap Secret's format must be cloud-config or ignition"
    );
    let ready = machine_condition(&machine, "Ready").expect("Ready");
    assert_eq!(
        (ready.0.as_str(), ready.1.as_str()),
        ("False", "BootstrapFormatUnsupported")
    );
    let warning = wait_event(&scenario.env, "demo-md-4", "BootstrapFormatUnsupported").await;
    assert_eq!(warning.type_.as_deref(), Some("Warning"));

    // Nothing was created or changed in Proxmox, and the status records no VM.
    assert_eq!(scenario.vms().await, vms_before);
    assert!(
        scenario.tap.log().iter().all(|s| s.method == "GET"),
        "no mutating Proxmox request: {:?}",
        scenario.tap.log()
    );
    assert_eq!(
        machine.status.as_ref().and_then(|s| s.virtual_machine_id),
        None
    );
    // No busy requeue: the reconcile waits for a change (with only a long safety requeue).
    // (The cluster controller's own polls of /version, /nodes and the storages do not count.)
    let machine_requests = |tap: &tap::Tap| {
        tap.log()
            .iter()
            .filter(|s| s.path != "/version" && s.path != "/nodes" && s.query != "type=storage")
            .count()
    };
    let proxmox_requests = machine_requests(&scenario.tap);
    let action = capmox::controller::machine::reconcile(
        Arc::new(
            Api::<ProxmoxMachine>::namespaced(scenario.env.client(), "default")
                .get("demo-md-4")
                .await
                .expect("machine"),
        ),
        scenario.env.context.clone(),
    )
    .await
    .expect("reconcile");
    assert_eq!(action, Action::requeue(Duration::from_secs(600)));
    assert_eq!(
        machine_requests(&scenario.tap),
        proxmox_requests,
        "the refusal costs no Proxmox request"
    );
}
