//! A template whose clones carry no SMBIOS UUID (made by hand, or an independent simulator):
//! capmox gives the clone one with the config it writes, and uses it for the provider ID and
//! the NoCloud instance-id, instead of waiting for one forever (issue 29). The UUID lives in
//! the VM's config, so a controller restarted after writing it reads it back.

use crate::machine_support::scenario::{Scenario, machine_spec_keeping_seed_iso, sim_options};

use capmox_sim::SimOptions;
use serde_json::Value;

/// Clones of this Proxmox carry no SMBIOS UUID.
fn no_uuid_on_clones() -> SimOptions {
    SimOptions {
        clone_smbios_uuid: false,
        ..sim_options()
    }
}

/// The `smbios1` of a VM in the simulator (`None` without one).
fn smbios1(scenario: &Scenario, vmid: u32) -> Option<String> {
    scenario.env.sim.with_cluster(|c| {
        let node = c.vm_node(vmid).expect("the VM exists");
        let config = c.vm_config(&node, vmid).expect("its config");
        config
            .get("smbios1")
            .and_then(Value::as_str)
            .map(str::to_owned)
    })
}

/// The UUID of an `smbios1` value.
fn uuid_of(smbios1: &str) -> &str {
    smbios1
        .split(',')
        .find_map(|part| part.strip_prefix("uuid="))
        .unwrap_or_else(|| panic!("no uuid in smbios1 {smbios1:?}"))
}

/// The `instance-id` of the seed image attached to the VM (`tag` names the temporary file).
fn instance_id(scenario: &Scenario, vmid: u32, tag: &str) -> String {
    let image = scenario
        .env
        .sim
        .with_cluster(|c| c.attached_seed_image(vmid))
        .expect("a seed image attached to the VM");
    let read = crate::cloudinit_iso::read_back(tag, &image);
    let meta_data = String::from_utf8_lossy(&read.rock_ridge_files["meta-data"]).into_owned();
    meta_data
        .lines()
        .find_map(|line| line.strip_prefix("instance-id: "))
        .unwrap_or_else(|| panic!("no instance-id in {meta_data:?}"))
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clone_without_an_smbios_uuid_gets_one_that_survives_a_restart() {
    let mut scenario = Scenario::start(no_uuid_on_clones()).await;
    // The clone, then the config write that gives the VM its UUID: the controllers die right
    // after Proxmox carried it out, before they hear the answer.
    let armed = scenario.tap.trip_at(scenario.tap.mutating() + 2);
    // Its seed ISO stays, so the instance ID the guest read can be read back after.
    scenario
        .create_with("demo-md-1", machine_spec_keeping_seed_iso())
        .await;
    let tripped = armed.await.expect("the tap is alive");
    let request = &tripped.request;
    assert!(
        matches!(request.method.as_str(), "PUT" | "POST") && request.path.ends_with("/config"),
        "the second mutating request writes the config: {request:?}"
    );
    let vmid: u32 = request
        .path
        .split('/')
        .nth_back(1)
        .and_then(|id| id.parse().ok())
        .expect("a VMID in the path");
    let written = smbios1(&scenario, vmid).expect("the config write gave the VM smbios1");
    let uuid = uuid_of(&written).to_owned();
    assert_eq!(
        capmox::cloudinit::instance_id_from_smbios(&written).as_deref(),
        Some(uuid.as_str()),
        "a UUID in canonical form"
    );
    scenario.crash(tripped).await;

    let machine = scenario.wait_ready("demo-md-1").await;
    scenario.assert_one_vm(&machine, "after the restart").await;
    assert_eq!(
        smbios1(&scenario, vmid).as_deref(),
        Some(written.as_str()),
        "the restarted controller read the UUID back instead of making another"
    );
    assert_eq!(
        machine.spec.provider_id.as_deref(),
        Some(format!("proxmox://{uuid}").as_str())
    );
    assert_eq!(instance_id(&scenario, vmid, "smbios-restart"), uuid);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clone_whose_smbios1_lacks_a_uuid_keeps_its_other_fields() {
    let scenario = Scenario::start(no_uuid_on_clones()).await;
    // A template made by hand, with SMBIOS fields but no UUID.
    let fields = "manufacturer=SGFuZG1hZGU=,base64=1";
    scenario.env.sim.with_cluster(|c| {
        let params = [("smbios1".to_owned(), fields.to_owned())].into();
        c.update_config(tokio::time::Instant::now(), "pve1", 9000, &params, false)
            .expect("the template takes smbios1");
    });
    scenario
        .create_with("demo-md-2", machine_spec_keeping_seed_iso())
        .await;
    let machine = scenario.wait_ready("demo-md-2").await;
    let vmid = machine
        .status
        .as_ref()
        .and_then(|s| s.virtual_machine_id)
        .and_then(|id| u32::try_from(id).ok())
        .expect("a VMID");
    let smbios1 = smbios1(&scenario, vmid).expect("smbios1");
    let uuid = uuid_of(&smbios1);
    assert!(
        smbios1.contains(fields),
        "the template's SMBIOS fields stay: {smbios1}"
    );
    assert_eq!(
        machine.spec.provider_id.as_deref(),
        Some(format!("proxmox://{uuid}").as_str())
    );
    assert_eq!(instance_id(&scenario, vmid, "smbios-fields"), uuid);
}
