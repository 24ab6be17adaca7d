//! Data disks (`disks.additionalVolumes`) and the firmware's volumes (EFI disk, TPM state):
//! allocated in one config write after the clone and before the first boot, on the storage each
//! names (else the boot disk's), and deleted with the VM; a disk Proxmox cannot allocate stops
//! the machine before its VM starts.

use capmox::api::ProxmoxMachine;
use serde_json::{Value, json};

use crate::machine_support::scenario::{self, Scenario, quick_sim};

fn with_disks(disks: Value) -> Value {
    let mut spec = scenario::machine_spec();
    spec["disks"] = disks;
    spec
}

fn recorded_vm(machine: &ProxmoxMachine) -> (u32, String) {
    let status = machine.status.as_ref().expect("status");
    (
        status
            .virtual_machine_id
            .and_then(|v| u32::try_from(v).ok())
            .expect("a VMID"),
        status.proxmox_node.clone().expect("a node"),
    )
}

#[tokio::test]
async fn data_disks_are_made_in_one_write_before_the_first_boot_and_go_with_the_vm() {
    let scenario = Scenario::start(quick_sim()).await;
    scenario
        .create_with(
            "demo-dd",
            with_disks(json!({"additionalVolumes": [
                {"disk": "scsi1", "sizeGb": 20, "storage": "ceph", "discard": true, "ioThread": true},
                {"disk": "scsi2", "sizeGb": 8}
            ]})),
        )
        .await;
    let machine = scenario.wait_ready("demo-dd").await;
    let (vmid, node) = recorded_vm(&machine);
    let config = scenario
        .env
        .proxmox()
        .vm_config(&node, vmid)
        .await
        .expect("config");
    let disk = |slot: &str| config.get(slot).unwrap_or_default();
    assert!(
        disk("scsi1").starts_with(&format!("ceph:vm-{vmid}-disk-"))
            && disk("scsi1").contains("discard=on")
            && disk("scsi1").contains("iothread=1")
            && disk("scsi1").contains("size=20G"),
        "{}",
        disk("scsi1")
    );
    let boot_storage = disk("scsi0")
        .split(':')
        .next()
        .unwrap_or_default()
        .to_owned();
    assert!(
        disk("scsi2").starts_with(&format!("{boot_storage}:vm-{vmid}-disk-"))
            && disk("scsi2").contains("size=8G"),
        "on the boot disk's storage {boot_storage}: {}",
        disk("scsi2")
    );
    // One config write allocated both, and it ended before the VM first started.
    let tasks: Vec<_> = scenario
        .env
        .sim
        .task_records()
        .into_iter()
        .filter(|t| t.vmid == Some(vmid))
        .collect();
    let writes: Vec<_> = tasks.iter().filter(|t| t.kind == "qmconfig").collect();
    assert_eq!(writes.len(), 1, "{tasks:#?}");
    let start = tasks
        .iter()
        .find(|t| t.kind == "qmstart")
        .and_then(|t| t.started)
        .expect("started");
    assert!(
        writes[0].ended.is_some_and(|ended| ended <= start),
        "the disks were there at the first boot"
    );
    assert_eq!(
        scenario.env.sim.volumes_of(vmid).len(),
        3,
        "boot disk and two data disks"
    );

    let uid = scenario.delete("demo-dd").await;
    scenario.wait_deleted("demo-dd", &uid).await;
    assert_eq!(
        scenario.env.sim.volumes_of(vmid),
        Vec::new(),
        "the data disks went with the VM"
    );
}

#[tokio::test]
async fn a_disk_the_storage_has_no_room_for_is_reported_and_the_vm_never_starts() {
    let scenario = Scenario::start(quick_sim()).await;
    scenario
        .create_with(
            "demo-dd",
            with_disks(json!({"additionalVolumes": [
                {"disk": "scsi1", "sizeGb": 100_000, "storage": "ceph"}
            ]})),
        )
        .await;
    let machine = scenario
        .env
        .wait_machine("demo-dd", "the disk refused", |m| {
            m.status.iter().flat_map(|s| &s.conditions).any(|c| {
                c.type_ == "VirtualMachineProvisioned"
                    && c.message.contains("not enough free space")
            })
        })
        .await;
    let (vmid, _) = recorded_vm(&machine);
    assert!(
        !scenario
            .env
            .sim
            .task_records()
            .iter()
            .any(|t| t.vmid == Some(vmid) && t.kind == "qmstart"),
        "a VM without its disks is not started"
    );
}

#[tokio::test]
async fn uefi_with_a_tpm_gets_its_efi_disk_and_tpm_state_before_the_first_boot() {
    let scenario = Scenario::start(quick_sim()).await;
    let mut spec = scenario::machine_spec();
    spec["cpu"] = json!({"type": "x86-64-v2-AES", "flags": ["+aes"]});
    spec["numa"] = json!(true);
    spec["bios"] = json!("ovmf");
    spec["secureBoot"] = json!(true);
    spec["tpm"] = json!(true);
    scenario.create_with("demo-uefi", spec).await;
    let machine = scenario.wait_ready("demo-uefi").await;
    let (vmid, node) = recorded_vm(&machine);
    let config = scenario
        .env
        .proxmox()
        .vm_config(&node, vmid)
        .await
        .expect("config");
    let get = |key: &str| config.get(key).unwrap_or_default();
    assert_eq!(get("cpu"), "x86-64-v2-AES,flags=+aes");
    assert_eq!(get("numa"), "1");
    assert_eq!(get("bios"), "ovmf");
    assert!(
        get("efidisk0").contains("efitype=4m") && get("efidisk0").contains("pre-enrolled-keys=1"),
        "{}",
        get("efidisk0")
    );
    assert!(
        get("tpmstate0").contains("version=v2.0"),
        "{}",
        get("tpmstate0")
    );
    let start = scenario
        .env
        .sim
        .task_records()
        .into_iter()
        .filter(|t| t.vmid == Some(vmid))
        .find(|t| t.kind == "qmstart")
        .and_then(|t| t.started)
        .expect("started");
    assert!(
        scenario
            .env
            .sim
            .task_records()
            .iter()
            .filter(|t| t.vmid == Some(vmid) && t.kind == "qmconfig")
            .all(|t| t.ended.is_some_and(|ended| ended <= start)),
        "the firmware's volumes were there at the first boot"
    );
    assert_eq!(
        scenario.env.sim.volumes_of(vmid).len(),
        3,
        "boot disk, EFI disk, TPM state"
    );
    let uid = scenario.delete("demo-uefi").await;
    scenario.wait_deleted("demo-uefi", &uid).await;
    assert_eq!(scenario.env.sim.volumes_of(vmid), Vec::new());
}
