//! Machines as users build them, against the simulator's topology (a `gpu` PCI resource
//! mapping with one device on pve2 of rack-a, a DHCP server on vmbr0, node-local `local`
//! storage): GPUs through the mapping, scheduled where one is free and freed with the VM;
//! addresses by DHCP, learned from the guest agent without an IPAddressClaim; data disks that
//! no node's own storage has room for, refused before any VM exists.

use capmox::api::{MachineAddressType, ProxmoxMachine};
use serde_json::json;

use crate::machine_support::scenario::{self, Scenario, machine_condition, quick_sim};

fn vmid_of(machine: &ProxmoxMachine) -> u32 {
    machine
        .status
        .as_ref()
        .and_then(|s| s.virtual_machine_id)
        .and_then(|v| u32::try_from(v).ok())
        .expect("a VMID")
}

fn with_gpu() -> serde_json::Value {
    let mut spec = scenario::machine_spec();
    spec["pciDevices"] = json!([{"mapping": "gpu", "pcie": true}]);
    spec
}

fn waits_with(machine: &ProxmoxMachine, reason: &str) -> bool {
    machine_condition(machine, "VirtualMachineProvisioned")
        .is_some_and(|(status, found, _)| status == "False" && found == reason)
}

#[tokio::test]
async fn a_gpu_goes_to_the_node_that_has_one_free_and_is_freed_with_the_vm() {
    let scenario = Scenario::start(quick_sim()).await;
    scenario.create_with("gpu-0", with_gpu()).await;
    let first = scenario.wait_ready("gpu-0").await;
    let vmid = vmid_of(&first);
    let status = first.status.as_ref().expect("status");
    assert_eq!(
        status.proxmox_node.as_deref(),
        Some("pve2"),
        "rack-a's only device of the mapping is on pve2"
    );
    let config = scenario
        .env
        .proxmox()
        .vm_config("pve2", vmid)
        .await
        .expect("config");
    assert_eq!(
        config.get("hostpci0").as_deref(),
        Some("mapping=gpu,pcie=1")
    );
    assert_eq!(
        scenario.env.sim.pci_in_use("pve2"),
        vec![("0000:41:00.0".to_owned(), vmid)]
    );

    // The mapping's one device in the zone is taken: the next machine waits, without a VM.
    scenario.create_with("gpu-1", with_gpu()).await;
    let waiting = scenario
        .env
        .wait_machine("gpu-1", "no free GPU", |m| {
            waits_with(m, "PciDeviceUnavailable")
        })
        .await;
    let (_, _, message) =
        machine_condition(&waiting, "VirtualMachineProvisioned").expect("condition");
    assert!(
        message.contains("PCI mapping \"gpu\"") && message.contains("pve2: 0 free"),
        "{message}"
    );
    assert_eq!(
        scenario.vms().await.len(),
        1,
        "no VM for the waiting machine"
    );

    let uid = scenario.delete("gpu-0").await;
    scenario.wait_deleted("gpu-0", &uid).await;
    let second = scenario.wait_ready("gpu-1").await;
    assert_eq!(
        second
            .status
            .as_ref()
            .and_then(|s| s.proxmox_node.as_deref()),
        Some("pve2")
    );
    assert_eq!(
        scenario.env.sim.pci_in_use("pve2"),
        vec![("0000:41:00.0".to_owned(), vmid_of(&second))]
    );
}

#[tokio::test]
async fn a_dhcp_machine_gets_its_lease_as_its_address_without_a_claim() {
    let scenario = Scenario::start(quick_sim()).await;
    let mut spec = scenario::machine_spec();
    spec["network"] =
        json!({"networkDevices": [{"name": "net0", "bridge": "vmbr0", "dhcp4": true}]});
    scenario.create_with("dhcp-0", spec).await;
    let machine = scenario.wait_ready("dhcp-0").await;
    let vmid = vmid_of(&machine);
    let leases = scenario.env.sim.dhcp_leases();
    let lease = leases
        .iter()
        .find(|l| l.vmid == vmid)
        .and_then(|l| l.ipv4.clone())
        .expect("a lease for the VM");
    let address = lease.split('/').next().unwrap_or_default().to_owned();
    assert!(address.starts_with("10.0.9."), "{lease}");
    let status = machine.status.as_ref().expect("status");
    let internal: Vec<&str> = status
        .addresses
        .iter()
        .filter(|a| a.type_ == MachineAddressType::InternalIp)
        .map(|a| a.address.as_str())
        .collect();
    assert_eq!(internal, [address.as_str()]);
    assert!(
        status
            .ip_addresses
            .iter()
            .any(|e| e.net == "net0" && e.ipv4 == [address.clone()]),
        "{:?}",
        status.ip_addresses
    );
    assert_eq!(
        scenario.claims().await,
        0,
        "no IPAddressClaim for a DHCP NIC"
    );

    let uid = scenario.delete("dhcp-0").await;
    scenario.wait_deleted("dhcp-0", &uid).await;
    assert!(
        scenario
            .env
            .sim
            .dhcp_leases()
            .iter()
            .all(|l| l.vmid != vmid),
        "the lease went with the VM"
    );
}

#[tokio::test]
async fn data_disks_no_nodes_own_storage_has_room_for_wait_before_any_vm_exists() {
    let scenario = Scenario::start(quick_sim()).await;
    let mut spec = scenario::machine_spec();
    spec["disks"] = json!({"additionalVolumes": [
        {"disk": "scsi1", "sizeGb": 100_000, "storage": "local"}
    ]});
    scenario.create_with("big-0", spec).await;
    let machine = scenario
        .env
        .wait_machine("big-0", "no room for the disk", |m| {
            waits_with(m, "InsufficientStorage")
        })
        .await;
    let (_, _, message) =
        machine_condition(&machine, "VirtualMachineProvisioned").expect("condition");
    assert!(
        message.contains("on storage \"local\" for its data disks"),
        "{message}"
    );
    assert_eq!(scenario.vms().await, vec![], "nothing was cloned");
}
