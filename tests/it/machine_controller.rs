//! The ProxmoxMachine reconciler against the in-process Kubernetes API, an IPAM stand-in and the
//! Proxmox simulator: from Machine to a running, zone-placed, addressed VM, and back.

use crate::common::env::{Env, condition};
use capmox::api::ProxmoxMachine;
use kube::api::{Api, DeleteParams};
use serde_json::{Value, json};

fn cluster_spec() -> Value {
    json!({
        "controlPlaneEndpoint": {"host": "10.0.0.10", "port": 6443},
        "dnsServers": ["10.0.0.2"],
        "ipv4Config": {"addresses": ["10.0.0.100-10.0.0.150"], "prefix": 24, "gateway": "10.0.0.1"},
        "credentialsRef": {"name": "demo-credentials"},
        "zoneConfig": [
            {"zone": "rack-a", "nodes": ["pve1", "pve2"], "dnsServers": ["10.0.1.2"],
             "ipv4Config": {"addresses": ["10.0.1.10-10.0.1.50"], "prefix": 24, "gateway": "10.0.1.1"}},
            {"zone": "rack-b", "nodes": ["pve3", "pve4"]}
        ]
    })
}

fn machine_spec() -> Value {
    json!({
        "sourceNode": "pve1",
        "templateID": 9000,
        "memoryMiB": 2048,
        "numCores": 2,
        "disks": {"bootVolume": {"disk": "scsi0", "sizeGb": 20}},
        "network": {"networkDevices": [{"name": "net0", "bridge": "vmbr0", "defaultIPv4": true}]}
    })
}

async fn ready_cluster() -> Env {
    let env = Env::start().await;
    env.create_credentials("demo-credentials", None).await;
    let uid = env.create_capi_cluster("demo").await;
    env.create_proxmox_cluster("demo", &uid, cluster_spec())
        .await;
    env.run_controllers();
    let cluster = env
        .wait_cluster("demo", "Ready=True", |c| {
            condition(c, "Ready").is_some_and(|c| c.0 == "True")
        })
        .await;
    env.mark_cluster_provisioned("demo", &cluster).await;
    env
}

#[tokio::test]
async fn a_machine_in_rack_a_provisions_on_a_rack_a_node_with_rack_a_addresses() {
    let env = ready_cluster().await;
    env.create_machine("demo", "demo-cp-1", Some("rack-a"), true, machine_spec())
        .await;
    let machine = env
        .wait_machine("demo-cp-1", "provisioned", ProxmoxMachine::is_provisioned)
        .await;
    let status = machine.status.clone().expect("status");
    assert_eq!(status.failure_domain.as_deref(), Some("rack-a"));
    let node = status.proxmox_node.clone().expect("node");
    assert!(
        ["pve1", "pve2"].contains(&node.as_str()),
        "placed on {node}"
    );
    let vmid = u32::try_from(status.virtual_machine_id.expect("vmid")).expect("vmid fits");
    let default = status
        .ip_addresses
        .iter()
        .find(|a| a.net == "default")
        .expect("default addresses");
    let ip = default.ipv4.first().expect("an IPv4 address").clone();
    assert!(
        ip.starts_with("10.0.1."),
        "address {ip} is not from the rack-a pool"
    );
    assert!(status.addresses.iter().any(|a| a.address == ip));

    // The provider ID is the VM's SMBIOS UUID, and the guest reports the address we rendered.
    let proxmox = env.proxmox();
    let config = proxmox.vm_config(&node, vmid).await.expect("VM exists");
    let uuid = capmox::controller::machine::smbios_uuid(&config).expect("uuid");
    assert_eq!(
        machine.spec.provider_id.as_deref(),
        Some(format!("proxmox://{uuid}").as_str())
    );
    assert_eq!(config.get("memory").as_deref(), Some("2048"));
    assert!(
        config.tags().iter().any(|t| t.starts_with("capmox-")),
        "VM tagged for its machine"
    );
    let interfaces = proxmox
        .agent_network_interfaces(&node, vmid)
        .await
        .expect("guest agent answers");
    let reported: Vec<String> = interfaces
        .iter()
        .flat_map(|i| i.ip_addresses.iter().map(|a| a.ip_address.clone()))
        .collect();
    assert!(
        reported.contains(&ip),
        "guest reports {reported:?}, expected {ip}"
    );
    assert_eq!(condition_of(&machine, "Ready"), Some("True".to_owned()));

    // Deletion removes the VM and releases the finalizer; claims go with owner GC.
    let machines = Api::<ProxmoxMachine>::namespaced(env.client(), "default");
    machines
        .delete("demo-cp-1", &DeleteParams::default())
        .await
        .expect("delete");
    tokio::time::timeout(
        crate::common::env::ENV_WAIT,
        kube::runtime::wait::await_condition(
            machines.clone(),
            "demo-cp-1",
            kube::runtime::wait::conditions::is_deleted(
                machine.metadata.uid.as_deref().expect("uid"),
            ),
        ),
    )
    .await
    .expect("deleted in time")
    .expect("watch");
    assert!(
        proxmox.find_vm(vmid).await.expect("resources").is_none(),
        "VM {vmid} still exists"
    );
}

fn condition_of(machine: &ProxmoxMachine, type_: &str) -> Option<String> {
    machine
        .status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| c.status.clone())
}

#[tokio::test]
async fn an_unpublished_failure_domain_waits_until_the_zone_appears() {
    let env = ready_cluster().await;
    env.create_machine("demo", "demo-md-1", Some("rack-c"), false, machine_spec())
        .await;
    let waiting = env
        .wait_machine("demo-md-1", "FailureDomainNotReady", |m| {
            m.status.as_ref().is_some_and(|s| {
                s.conditions
                    .iter()
                    .any(|c| c.reason == "FailureDomainNotReady")
            })
        })
        .await;
    assert!(!waiting.is_provisioned());
    // Add the zone; the machine provisions without further edits.
    let mut spec = cluster_spec();
    spec["zoneConfig"]
        .as_array_mut()
        .expect("zones")
        .push(json!({"zone": "rack-c", "nodes": ["pve5"]}));
    Api::<capmox::api::ProxmoxCluster>::namespaced(env.client(), "default")
        .patch(
            "demo",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({"spec": {"zoneConfig": spec["zoneConfig"]}})),
        )
        .await
        .expect("zone added");
    let machine = env
        .wait_machine(
            "demo-md-1",
            "provisioned in rack-c",
            ProxmoxMachine::is_provisioned,
        )
        .await;
    let status = machine.status.expect("status");
    assert_eq!(status.failure_domain.as_deref(), Some("rack-c"));
    assert_eq!(status.proxmox_node.as_deref(), Some("pve5"));
}

/// A ProxmoxMachine the Go provider created (VMID in `spec.virtualMachineID` only, VM named
/// after the machine, no capmox tag) and that was already being deleted when capmox took over:
/// its VM is deleted, not leaked.
#[tokio::test]
async fn a_go_provider_machine_deleted_at_takeover_takes_its_vm_with_it() {
    let env = Env::start().await;
    env.create_credentials("demo-credentials", None).await;
    let uid = env.create_capi_cluster("demo").await;
    env.create_proxmox_cluster("demo", &uid, cluster_spec())
        .await;
    let proxmox = env.proxmox();
    let task = proxmox
        .clone_vm(
            "pve1",
            9000,
            &capmox::proxmox::CloneParams {
                newid: 150,
                name: Some("legacy-0".into()),
                full: Some(true),
                ..Default::default()
            },
        )
        .await
        .expect("the Go provider's clone starts");
    proxmox
        .wait_task(&task, &Default::default())
        .await
        .expect("the Go provider's clone finishes");
    let mut spec = machine_spec();
    spec["virtualMachineID"] = json!(150);
    env.create_machine("demo", "legacy-0", None, false, spec)
        .await;
    let machines = Api::<ProxmoxMachine>::namespaced(env.client(), "default");
    let uid = machines
        .patch(
            "legacy-0",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(
                json!({"metadata": {"finalizers": [capmox::api::finalizers::MACHINE]}}),
            ),
        )
        .await
        .expect("finalizer set, as the Go provider had it")
        .metadata
        .uid
        .expect("uid");
    machines
        .delete("legacy-0", &DeleteParams::default())
        .await
        .expect("deletion requested");

    env.run_controllers();
    let gone = tokio::time::timeout(
        crate::common::env::ENV_WAIT,
        kube::runtime::wait::await_condition(
            machines.clone(),
            "legacy-0",
            kube::runtime::wait::conditions::is_deleted(&uid),
        ),
    )
    .await;
    assert!(gone.is_ok(), "the machine's finalizer is released");
    assert!(
        matches!(proxmox.find_vm(150).await, Ok(None)),
        "VM 150 was deleted with its machine"
    );
}
