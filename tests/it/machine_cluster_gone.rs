//! Deletion never fails open: a machine whose ProxmoxCluster is gone deletes its VM with
//! capmox's global credentials, or keeps its finalizer and says why until the ProxmoxCluster is
//! back; and a ProxmoxCluster being deleted waits for every machine of its cluster, also one
//! without the cluster-name label.

use capmox::api::ProxmoxCluster;
use capmox::api::ProxmoxMachine;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use serde_json::json;

use crate::common::env::{ENV_WAIT, condition};
use crate::machine_support::scenario::{Scenario, machine_condition, sim_options, wait_event};

fn clusters(scenario: &Scenario) -> Api<ProxmoxCluster> {
    Api::namespaced(scenario.env.client(), "default")
}

async fn wait_cluster_gone(scenario: &Scenario, uid: &str) {
    tokio::time::timeout(
        ENV_WAIT,
        kube::runtime::wait::await_condition(
            clusters(scenario),
            "demo",
            kube::runtime::wait::conditions::is_deleted(uid),
        ),
    )
    .await
    .expect("ProxmoxCluster gone in time")
    .expect("watch");
}

/// Deletes the ProxmoxCluster `demo` and removes its finalizer, as a user forcing it out
/// would; returns it as it was.
async fn force_delete_cluster(scenario: &Scenario) -> ProxmoxCluster {
    let clusters = clusters(scenario);
    let old = clusters.get("demo").await.expect("cluster");
    clusters
        .delete("demo", &DeleteParams::default())
        .await
        .expect("deletion requested");
    clusters
        .patch(
            "demo",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"finalizers": null}})),
        )
        .await
        .expect("finalizer removed");
    wait_cluster_gone(scenario, old.metadata.uid.as_deref().expect("uid")).await;
    old
}

/// Without the ProxmoxCluster and without global credentials the deleted machine keeps its
/// finalizer, and its VM, with a condition and a Warning saying why and what to do; once the
/// ProxmoxCluster is back the VM is deleted and the machine released.
#[tokio::test]
async fn without_its_cluster_or_global_credentials_a_deleted_machine_keeps_its_vm() {
    let scenario = Scenario::start(sim_options()).await;
    scenario.create("demo-md-0").await;
    let ready = scenario.wait_ready("demo-md-0").await;
    let vmid = ready
        .status
        .as_ref()
        .and_then(|s| s.virtual_machine_id)
        .expect("vmid");
    let old = force_delete_cluster(&scenario).await;
    let uid = scenario.delete("demo-md-0").await;

    let (kept, message) = scenario
        .env
        .wait_machine_reason("demo-md-0", "ProxmoxClusterNotFound")
        .await;
    for part in [
        "ProxmoxCluster default/demo is gone",
        "no global credentials",
        &format!("VM {vmid}"),
        "restore the ProxmoxCluster",
        capmox::api::finalizers::MACHINE,
    ] {
        assert!(message.contains(part), "{part:?} missing in {message}");
    }
    assert_eq!(
        machine_condition(&kept, "Ready").map(|c| c.0).as_deref(),
        Some("False")
    );
    assert!(
        kept.metadata
            .finalizers
            .iter()
            .flatten()
            .any(|f| f == capmox::api::finalizers::MACHINE),
        "finalizer kept"
    );
    assert_eq!(scenario.vms().await.len(), 1, "VM kept");
    let warning = wait_event(&scenario.env, "demo-md-0", "ProxmoxClusterNotFound").await;
    assert_eq!(warning.type_.as_deref(), Some("Warning"));

    // The ProxmoxCluster comes back: the deletion finishes.
    let capi_uid = Api::<capmox::capi::Cluster>::namespaced(scenario.env.client(), "default")
        .get("demo")
        .await
        .expect("CAPI cluster")
        .metadata
        .uid
        .expect("uid");
    scenario
        .env
        .create_proxmox_cluster(
            "demo",
            &capi_uid,
            serde_json::to_value(&old.spec).expect("spec"),
        )
        .await;
    scenario.wait_deleted("demo-md-0", &uid).await;
    scenario
        .assert_nothing_left("deleted once the cluster was back")
        .await;
}

/// Without the ProxmoxCluster, and without its CAPI Machine, a deleted machine deletes its VM
/// with capmox's global credentials.
#[tokio::test]
async fn without_its_cluster_a_deleted_machine_deletes_its_vm_with_the_global_credentials() {
    let mut scenario = Scenario::start(sim_options()).await;
    scenario.create("demo-md-1").await;
    scenario.wait_ready("demo-md-1").await;
    scenario.stop_controllers().await;
    force_delete_cluster(&scenario).await;
    Api::<capmox::capi::Machine>::namespaced(scenario.env.client(), "default")
        .delete("demo-md-1", &DeleteParams::default())
        .await
        .expect("CAPI Machine deleted");
    let uid = scenario.delete("demo-md-1").await;
    scenario.start_controllers_with_global_credentials();
    scenario.wait_deleted("demo-md-1", &uid).await;
    scenario
        .assert_nothing_left("deleted with the global credentials")
        .await;
}

/// A ProxmoxCluster being deleted waits for a machine of its cluster that lacks the
/// cluster-name label (its owner Machine names the cluster), and says so; that machine's VM is
/// then deleted with the cluster's credentials, and the ProxmoxCluster goes last.
#[tokio::test]
async fn a_cluster_being_deleted_waits_for_a_machine_without_the_cluster_label() {
    let scenario = Scenario::start(sim_options()).await;
    scenario.create("demo-md-2").await;
    scenario.wait_ready("demo-md-2").await;
    Api::<ProxmoxMachine>::namespaced(scenario.env.client(), "default")
        .patch(
            "demo-md-2",
            &PatchParams::default(),
            &Patch::Json::<()>(
                serde_json::from_value(json!([{
                    "op": "remove", "path": "/metadata/labels/cluster.x-k8s.io~1cluster-name"
                }]))
                .expect("patch"),
            ),
        )
        .await
        .expect("label removed");
    let cluster_uid = clusters(&scenario)
        .get("demo")
        .await
        .expect("cluster")
        .metadata
        .uid
        .expect("uid");
    clusters(&scenario)
        .delete("demo", &DeleteParams::default())
        .await
        .expect("deletion requested");

    let waiting = scenario
        .env
        .wait_cluster("demo", "Ready=False/Deleting", |c| {
            condition(c, "Ready").is_some_and(|c| c.1 == "Deleting")
        })
        .await;
    let (status, _, message) = condition(&waiting, "Ready").expect("Ready");
    assert_eq!(status, "False");
    assert!(message.contains("demo-md-2"), "{message}");
    assert_eq!(
        scenario.vms().await.len(),
        1,
        "the machine's VM is still there"
    );

    let uid = scenario.delete("demo-md-2").await;
    scenario.wait_deleted("demo-md-2", &uid).await;
    wait_cluster_gone(&scenario, &cluster_uid).await;
    scenario
        .assert_nothing_left("machine deleted before its cluster")
        .await;
}
