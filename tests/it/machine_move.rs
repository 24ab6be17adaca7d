//! `clusterctl move` and backup/restore: the ProxmoxMachine comes back under a new UID, with its
//! spec (`spec.providerID`, `spec.virtualMachineID`) but no status. Its VM is found again and
//! adopted, never cloned a second time, also when the move lands while the clone runs; and
//! deleting the moved machine deletes that VM.

use capmox::api::ProxmoxMachine;
use capmox::capi::IPAddressClaim;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams, PropagationPolicy};
use serde_json::{Value, json};

use crate::machine_support::scenario::{self, Scenario, machine_condition, sim_options};

/// Does to the ProxmoxMachine `name` what `clusterctl move` (or a backup and restore) does: it
/// is re-created with its labels, annotations, owner references, finalizers and spec (after
/// `edit`), under a new UID and without status, and the IPAddressClaims it owned are owned by
/// the new object. The old one goes without its controller acting on it (clusterctl removes
/// its finalizers first).
async fn move_machine(scenario: &Scenario, name: &str, edit: impl FnOnce(&mut Value)) {
    let machines = Api::<ProxmoxMachine>::namespaced(scenario.env.client(), "default");
    let old = machines.get(name).await.expect("machine to move");
    let old_uid = old.metadata.uid.clone().expect("uid");
    machines
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"finalizers": null}})),
        )
        .await
        .expect("finalizers removed");
    machines
        .delete(
            name,
            &DeleteParams {
                propagation_policy: Some(PropagationPolicy::Orphan),
                ..DeleteParams::default()
            },
        )
        .await
        .expect("old copy deleted");
    scenario.wait_deleted(name, &old_uid).await;

    let metadata = &old.metadata;
    let mut spec = serde_json::to_value(&old.spec).expect("spec");
    edit(&mut spec);
    let copy: ProxmoxMachine = serde_json::from_value(json!({
        "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha2", "kind": "ProxmoxMachine",
        "metadata": {
            "name": name, "namespace": "default",
            "labels": metadata.labels, "annotations": metadata.annotations,
            "ownerReferences": metadata.owner_references, "finalizers": metadata.finalizers
        },
        "spec": spec
    }))
    .expect("copy");
    let created = machines
        .create(&PostParams::default(), &copy)
        .await
        .expect("moved copy created");
    let new_uid = created.metadata.uid.clone().expect("uid");
    assert_ne!(new_uid, old_uid);

    let claims = Api::<IPAddressClaim>::namespaced(scenario.env.client(), "default");
    for claim in claims.list(&ListParams::default()).await.expect("claims") {
        let claim_name = claim.metadata.name.clone().expect("name");
        let orphaned = claim
            .metadata
            .owner_references
            .as_ref()
            .is_none_or(Vec::is_empty);
        if orphaned && claim_name.starts_with(&format!("{name}-")) {
            claims
                .patch(
                    &claim_name,
                    &PatchParams::default(),
                    &Patch::Merge(json!({"metadata": {"ownerReferences": [{
                        "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha2",
                        "kind": "ProxmoxMachine", "name": name, "uid": new_uid,
                        "controller": true, "blockOwnerDeletion": true
                    }]}})),
                )
                .await
                .expect("claim follows its machine");
        }
    }
}

/// The spec as capmox wrote it before it recorded the VMID there: provider ID only.
fn without_vmid(spec: &mut Value) {
    spec.as_object_mut()
        .expect("spec object")
        .remove("virtualMachineID");
}

fn clones(scenario: &Scenario) -> usize {
    scenario.tap.log().iter().filter(|s| s.is_clone()).count()
}

async fn machine(scenario: &Scenario, name: &str) -> ProxmoxMachine {
    Api::<ProxmoxMachine>::namespaced(scenario.env.client(), "default")
        .get(name)
        .await
        .expect("machine")
}

/// Two provisioned machines moved: one as this capmox records it (VMID and provider ID in the
/// spec), one as earlier versions did (provider ID only). Both adopt their VMs (now tagged for
/// the new UID) with their addresses, no VM is cloned again, and deleting them deletes the VMs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_moved_machine_adopts_its_vm_instead_of_cloning_another() {
    let mut scenario = Scenario::start(sim_options()).await;
    let names = ["demo-md-0", "demo-md-1"];
    let mut before = Vec::new();
    for name in names {
        scenario.create(name).await;
    }
    for name in names {
        let ready = scenario.wait_ready(name).await;
        let status = ready.status.clone().expect("status");
        assert_eq!(
            ready.spec.virtual_machine_id, status.virtual_machine_id,
            "{name}: the spec records the VMID"
        );
        assert!(ready.spec.provider_id.is_some(), "{name}: provider ID set");
        let tag = capmox::controller::machine::machine_tag(&ready);
        before.push((status.virtual_machine_id, status.ip_addresses, tag));
    }
    assert_eq!(clones(&scenario), 2);

    scenario.stop_controllers().await;
    move_machine(&scenario, names[0], |_| {}).await;
    move_machine(&scenario, names[1], without_vmid).await;
    scenario.start_controllers();

    for (name, (vmid, addresses, old_tag)) in names.into_iter().zip(before) {
        let adopted = scenario.wait_ready(name).await;
        let status = adopted.status.clone().expect("status");
        assert_eq!(status.virtual_machine_id, vmid, "{name}: same VM");
        assert_eq!(
            adopted.spec.virtual_machine_id, vmid,
            "{name}: the spec records the VMID again"
        );
        assert_eq!(status.ip_addresses, addresses, "{name}: same addresses");
        scenario.assert_vm_of(&adopted, name).await;
        assert!(
            !scenario
                .vms()
                .await
                .iter()
                .any(|(_, tags)| tags.contains(&old_tag)),
            "{name}: the old machine's tag {old_tag} was replaced"
        );
        scenario::wait_event(&scenario.env, name, "Adopted").await;
    }
    assert_eq!(clones(&scenario), 2, "no VM cloned again");
    assert_eq!(scenario.vms().await.len(), 2);

    for name in names {
        let uid = scenario.delete(name).await;
        scenario.wait_deleted(name, &uid).await;
    }
    scenario.assert_nothing_left("moved machines deleted").await;
}

/// A move that lands after the clone request reached Proxmox and before anything after it was
/// recorded: the moved machine knows the VMID from its spec, waits for that clone and adopts it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_machine_moved_while_its_clone_runs_adopts_that_clone() {
    let mut scenario = Scenario::start(sim_options()).await;
    let tripped = scenario.create_until_clone("demo-md-2").await;
    scenario.kill_controllers().await;
    move_machine(&scenario, "demo-md-2", |_| {}).await;
    let _ = tripped.resume.send(());
    scenario.start_controllers();

    let machine = scenario.wait_ready("demo-md-2").await;
    scenario
        .assert_one_vm(&machine, "moved during the clone")
        .await;
    assert_eq!(clones(&scenario), 1, "cloned once");
    let uid = scenario.delete("demo-md-2").await;
    scenario.wait_deleted("demo-md-2", &uid).await;
    scenario
        .assert_nothing_left("moved during the clone, deleted")
        .await;
}

/// A moved machine deleted before capmox reconciled it again (no status, a new UID, its VM
/// still tagged for the old one): its VM is found by the spec and deleted, not leaked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_moved_machine_deleted_before_any_reconcile_deletes_its_vm() {
    let mut scenario = Scenario::start(sim_options()).await;
    let names = ["demo-md-3", "demo-md-4"];
    for name in names {
        scenario.create(name).await;
    }
    for name in names {
        scenario.wait_ready(name).await;
    }
    scenario.stop_controllers().await;
    move_machine(&scenario, names[0], |_| {}).await;
    move_machine(&scenario, names[1], without_vmid).await;
    let mut uids = Vec::new();
    for name in names {
        assert_eq!(machine(&scenario, name).await.status, None, "{name}");
        uids.push(scenario.delete(name).await);
    }
    scenario.start_controllers();
    for (name, uid) in names.into_iter().zip(uids) {
        scenario.wait_deleted(name, &uid).await;
    }
    scenario
        .assert_nothing_left("moved machines deleted at once")
        .await;
}

/// A machine whose `spec.providerID` names a VM Proxmox does not have (deleted, or not
/// restored) is never given a new VM: it says which VM it misses and waits.
#[tokio::test]
async fn a_machine_whose_provider_id_names_a_missing_vm_never_clones() {
    let scenario = Scenario::start(sim_options()).await;
    let provider_id = "proxmox://0b5e1c3a-7d2f-4e8a-9c61-2f4d5e6a7b8c";
    let mut spec = scenario::machine_spec();
    spec["providerID"] = json!(provider_id);
    scenario.create_with("demo-md-5", spec).await;
    let (waiting, message) = scenario
        .env
        .wait_machine_reason("demo-md-5", "VirtualMachineNotFound")
        .await;
    assert!(
        message.contains(provider_id) && message.contains("demo-md-5"),
        "{message}"
    );
    let (status, _, _) =
        machine_condition(&waiting, "VirtualMachineProvisioned").expect("condition");
    assert_eq!(status, "False");
    assert_eq!(
        clones(&scenario),
        0,
        "no clone for a machine with a provider ID"
    );
    assert_eq!(scenario.vms().await, vec![]);
    let warning = scenario::wait_event(&scenario.env, "demo-md-5", "VirtualMachineNotFound").await;
    assert_eq!(warning.type_.as_deref(), Some("Warning"));

    // Deleting it releases it: there is nothing in Proxmox to delete.
    let uid = scenario.delete("demo-md-5").await;
    scenario.wait_deleted("demo-md-5", &uid).await;
}
