//! The ProxmoxMachine reconciler against a Proxmox that fails, or a proxy in front of it (errors
//! injected by the tap in front of the simulator): a machine whose VM Proxmox answers 404 for
//! (where PVE answers 500 "does not exist") is deleted.

mod common;
#[allow(dead_code)]
#[path = "machine_support/scenario.rs"]
mod scenario;
#[allow(dead_code)]
#[path = "machine_support/tap.rs"]
mod tap;

use std::time::Duration;

use capmox::api::ProxmoxMachine;
use capmox::sim::SimOptions;
use scenario::Scenario;
use tap::Injected;

/// Quick tasks: a machine provisions in a second or two, a fleet within the tests' waits.
fn quick_sim() -> SimOptions {
    SimOptions {
        clone_duration: Duration::from_millis(50),
        task_duration: Duration::from_millis(10),
        boot_delay: Duration::from_millis(50),
        ..SimOptions::default()
    }
}

/// The machine's VMID and node from its status.
fn placed(machine: &ProxmoxMachine) -> (u32, String) {
    let status = machine.status.as_ref().expect("status");
    (
        status
            .virtual_machine_id
            .and_then(|id| u32::try_from(id).ok())
            .expect("vmid"),
        status.proxmox_node.clone().expect("node"),
    )
}

#[tokio::test]
async fn a_machine_whose_vm_proxmox_answers_404_for_is_deleted() {
    let mut scenario = Scenario::start(quick_sim()).await;
    scenario.create("demo-md-4").await;
    let machine = scenario.wait_ready("demo-md-4").await;
    let (vmid, node) = placed(&machine);
    // The VM goes away behind capmox's back, and the proxy in front of Proxmox answers 404
    // for it, where PVE itself answers 500 "does not exist".
    scenario.stop_controllers().await;
    let proxmox = scenario.env.proxmox();
    let wait = capmox::proxmox::WaitOptions::default();
    let task = proxmox
        .power(&node, vmid, capmox::proxmox::PowerAction::Stop)
        .await
        .expect("stop");
    proxmox.wait_task_ref(&task, &wait).await.expect("stopped");
    let task = proxmox
        .delete_vm(&node, vmid, capmox::proxmox::DeleteParams::default())
        .await
        .expect("delete");
    proxmox.wait_task_ref(&task, &wait).await.expect("deleted");
    let vm_path = format!("/qemu/{vmid}");
    scenario.tap.set_fault(Box::new(move |_, path| {
        (path.contains(&vm_path) && !path.contains("/tasks/"))
            .then(|| Injected::new(404, "Not Found"))
    }));
    scenario.start_controllers();
    let uid = scenario.delete("demo-md-4").await;
    scenario.wait_deleted("demo-md-4", &uid).await;
    assert!(
        scenario
            .tap
            .log()
            .iter()
            .any(|s| s.status == 404 && s.path.contains(&format!("/qemu/{vmid}"))),
        "Proxmox was asked about the VM and answered 404"
    );
    scenario.assert_nothing_left("after a 404").await;
}
