//! A Proxmox that names its tasks differently (another version, a reimplementation): capmox
//! judges a finished task by what it submitted it for, so every step is done once and machines
//! provision, shed their seed ISO and are deleted as against real Proxmox.

use std::collections::BTreeMap;
use std::time::Duration;

use capmox::api::ProxmoxMachine;
use capmox_sim::SimOptions;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;

use crate::common::env::ENV_WAIT;
use crate::machine_support::scenario::{Scenario, sim_options};

/// Every task type capmox causes, under another name.
fn renamed() -> SimOptions {
    SimOptions {
        task_type_names: SimOptions::renamed_task_types(),
        ..sim_options()
    }
}

/// How many tasks of this (real) type the simulator ran, per volume or VM.
fn tasks_per_target(scenario: &Scenario, kind: &str) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for task in scenario.env.sim.task_records() {
        if task.kind == kind {
            let target = task
                .volume
                .clone()
                .unwrap_or_else(|| format!("VM {}", task.vmid.unwrap_or_default()));
            *counts.entry(target).or_default() += 1;
        }
    }
    counts
}

/// The seed ISO of each machine's VM, by its name on the node.
fn seed_volumes(machines: &[ProxmoxMachine]) -> Vec<String> {
    machines
        .iter()
        .map(|m| {
            let vmid = m.status.as_ref().and_then(|s| s.virtual_machine_id);
            let vmid = u32::try_from(vmid.expect("VMID in status")).expect("VMID");
            format!("local:iso/{}", capmox::cloudinit::seed_iso_name(vmid))
        })
        .collect()
}

#[tokio::test]
async fn with_renamed_task_types_each_seed_iso_is_uploaded_and_deleted_once_and_machines_get_ready()
{
    let scenario = Scenario::start(renamed()).await;
    let names = ["demo-md-1", "demo-md-2", "demo-md-3"];
    for name in names {
        scenario.create(name).await;
    }
    let mut machines = Vec::new();
    for name in names {
        machines.push(scenario.wait_ready(name).await);
    }
    let seeds = seed_volumes(&machines);
    let once: BTreeMap<String, usize> = seeds.iter().map(|v| (v.clone(), 1)).collect();
    assert_eq!(
        tasks_per_target(&scenario, "imgcopy"),
        once,
        "one upload per machine"
    );
    let clones = tasks_per_target(&scenario, "qmclone");
    assert_eq!(clones.len(), names.len(), "{clones:?}");
    assert!(clones.values().all(|n| *n == 1), "{clones:?}");

    // The nodes join: each seed ISO (it holds the bootstrap token) is deleted once.
    for name in names {
        Api::<capmox::capi::Machine>::namespaced(scenario.env.client(), "default")
            .patch_status(
                name,
                &PatchParams::default(),
                &Patch::Merge(json!({"status": {"nodeRef": {"name": name}}})),
            )
            .await
            .expect("nodeRef set");
    }
    let deadline = tokio::time::Instant::now() + ENV_WAIT;
    while !scenario.seed_isos().await.is_empty() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "seed ISOs left: {:?}",
            scenario.seed_isos().await
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        tasks_per_target(&scenario, "imgdel"),
        once,
        "one deletion per seed ISO"
    );
    assert_eq!(
        tasks_per_target(&scenario, "imgcopy"),
        once,
        "no upload since"
    );

    // Deleted: each VM is stopped and destroyed once, and nothing is left.
    let mut uids = Vec::new();
    for name in names {
        uids.push(scenario.delete(name).await);
    }
    for (name, uid) in names.iter().zip(&uids) {
        scenario.wait_deleted(name, uid).await;
    }
    scenario.assert_nothing_left("after deletion").await;
    let destroyed = tasks_per_target(&scenario, "qmdestroy");
    assert_eq!(destroyed.len(), names.len(), "{destroyed:?}");
    assert!(destroyed.values().all(|n| *n == 1), "{destroyed:?}");
    assert_eq!(
        capmox_sim::repeated_writes(&scenario.env.sim.task_records(), 1),
        [],
        "no task of one kind succeeded twice in a row on a VM or volume"
    );
}
