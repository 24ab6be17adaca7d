//! The ProxmoxMachine reconciler against the in-process Kubernetes API, an IPAM stand-in and the
//! Proxmox simulator: from Machine to a running, zone-placed, addressed VM, and back.

use crate::common::env::{Env, condition};
use capmox::api::ProxmoxMachine;
use capmox_sim::{SimOptions, StorageSpec, Topology};
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
    ready(Env::start().await, cluster_spec()).await
}

/// Runs the controllers on `env` with a provisioned cluster `demo` of this spec.
async fn ready(env: Env, spec: Value) -> Env {
    env.create_credentials("demo-credentials", None).await;
    let uid = env.create_capi_cluster("demo").await;
    env.create_proxmox_cluster("demo", &uid, spec).await;
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
    // Labelled with its zone, as the Go provider labels machines for users to select on.
    assert_eq!(crate::common::zone_label(&machine), Some("rack-a"));
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

/// The test cluster with `local-lvm` on every node and template 9000 on pve1's `local-lvm`,
/// plus copies of it (same name and tags, on their node's `local-lvm`) at these nodes and VMIDs.
fn local_template_topology(copies: &[(&str, u32)]) -> Topology {
    let mut topology =
        Topology::from_yaml(crate::common::env::TOPOLOGY, "test topology").expect("topology");
    topology.storages.push(StorageSpec {
        name: "local-lvm".into(),
        kind: "lvmthin".into(),
        shared: false,
        content: vec!["images".into(), "rootdir".into()],
        nodes: vec![],
        size_gib: 1024,
    });
    topology.templates[0].storage = "local-lvm".into();
    for (node, vmid) in copies {
        let mut copy = topology.templates[0].clone();
        copy.node = (*node).into();
        copy.vmid = *vmid;
        topology.templates.push(copy);
    }
    topology
}

/// The clone requests Proxmox answered: (path, status, whether a target node was sent).
fn clone_requests(env: &Env) -> Vec<(String, u16, bool)> {
    env.sim
        .request_log()
        .into_iter()
        .filter(|r| r.endpoint == "POST /nodes/{node}/qemu/{vmid}/clone")
        .map(|r| (r.path, r.status, r.params.iter().any(|p| p == "target")))
        .collect()
}

fn node_of(machine: &ProxmoxMachine) -> String {
    machine
        .status
        .as_ref()
        .and_then(|s| s.proxmox_node.clone())
        .unwrap_or_default()
}

/// Control-plane machines created one after another, each once the one before is running,
/// spread over the zone's nodes even when one node has far more memory free: a clone counts
/// the machines its cluster already has on each node (no reservation is left to count once a
/// VM is listed), as the watch of the machines keeps them.
#[tokio::test]
async fn control_plane_machines_made_one_after_another_spread_over_the_zones_nodes() {
    let mut topology =
        Topology::from_yaml(crate::common::env::TOPOLOGY, "test topology").expect("topology");
    let pve1 = topology
        .nodes
        .iter_mut()
        .find(|n| n.name == "pve1")
        .expect("pve1 in the test topology");
    pve1.memory_mib *= 4;
    let env = ready(
        Env::start_with_topology(topology, SimOptions::default()).await,
        cluster_spec(),
    )
    .await;
    let mut nodes = Vec::new();
    for name in ["demo-cp-1", "demo-cp-2"] {
        env.create_machine("demo", name, Some("rack-a"), true, machine_spec())
            .await;
        let machine = env
            .wait_machine(name, "provisioned", ProxmoxMachine::is_provisioned)
            .await;
        nodes.push(node_of(&machine));
    }
    assert_eq!(
        nodes,
        ["pve1", "pve2"],
        "the roomier node first, then the other"
    );
}

/// A template on pve1's local storage: rack-a (pve1, pve2) machines are all cloned on pve1
/// (Proxmox refuses to clone local disks to another node) and no clone fails; rack-b (pve3,
/// pve4) has no node that can receive a clone, so its machine waits and says why.
#[tokio::test]
async fn a_template_on_node_local_storage_keeps_its_zones_machines_on_its_node() {
    let topology = local_template_topology(&[]);
    let env = ready(
        Env::start_with_topology(topology, SimOptions::default()).await,
        cluster_spec(),
    )
    .await;
    let names = ["demo-md-1", "demo-md-2", "demo-md-3"];
    for name in names {
        env.create_machine("demo", name, Some("rack-a"), false, machine_spec())
            .await;
    }
    for name in names {
        let machine = env
            .wait_machine(name, "provisioned", ProxmoxMachine::is_provisioned)
            .await;
        assert_eq!(node_of(&machine), "pve1", "{name}");
    }
    assert_eq!(
        clone_requests(&env),
        vec![("/nodes/pve1/qemu/9000/clone".to_owned(), 200, false); names.len()],
        "one clone per machine, on the template's node"
    );
    assert!(
        env.sim
            .task_records()
            .iter()
            .filter(|t| t.kind == "qmclone")
            .all(|t| t.ok),
        "a clone task failed"
    );
    assert_eq!(
        env.sim.with_cluster(|c| c.vm_count()),
        1 + names.len(),
        "the template and one VM per machine"
    );

    env.create_machine("demo", "demo-md-b", Some("rack-b"), false, machine_spec())
        .await;
    let (_, message) = env
        .wait_machine_reason("demo-md-b", "TemplateUnreachable")
        .await;
    for part in [
        "VM template \"ubuntu-2404-kube\"",
        "9000 \"ubuntu-2404-kube\" on pve1",
        "node-local storage \"local-lvm\"",
        "zone \"rack-b\": \"pve3\", \"pve4\"",
    ] {
        assert!(message.contains(part), "{part:?} missing in {message}");
    }
    assert_eq!(
        clone_requests(&env).len(),
        names.len(),
        "no clone was tried for rack-b"
    );
}

/// Copies of one template (same name and tags) on pve1's and pve2's local storage, in a zone
/// of pve1, pve2 and pve5: machines land on pve1 and pve2 only, each cloned from its own
/// node's copy without a cross-node clone.
#[tokio::test]
async fn per_node_template_copies_each_serve_their_own_node() {
    let topology = local_template_topology(&[("pve2", 9001)]);
    let mut spec = cluster_spec();
    spec["zoneConfig"][0]["nodes"] = json!(["pve1", "pve2", "pve5"]);
    let env = ready(
        Env::start_with_topology(topology, SimOptions::default()).await,
        spec,
    )
    .await;
    let mut by_tags = machine_spec();
    let fields = by_tags.as_object_mut().expect("spec object");
    fields.remove("sourceNode");
    fields.remove("templateID");
    fields.insert(
        "templateSelector".into(),
        json!({"matchTags": ["capmox", "ubuntu"]}),
    );
    let names = ["demo-md-1", "demo-md-2", "demo-md-3", "demo-md-4"];
    for name in names {
        env.create_machine("demo", name, Some("rack-a"), false, by_tags.clone())
            .await;
    }
    let mut nodes = std::collections::BTreeSet::new();
    for name in names {
        let machine = env
            .wait_machine(name, "provisioned", ProxmoxMachine::is_provisioned)
            .await;
        nodes.insert(node_of(&machine));
    }
    assert_eq!(
        nodes,
        ["pve1", "pve2"].map(str::to_owned).into(),
        "spread over the nodes with a copy, never pve5"
    );
    let clones = clone_requests(&env);
    assert_eq!(clones.len(), names.len(), "{clones:?}");
    for (path, status, target) in clones {
        assert!(
            ["/nodes/pve1/qemu/9000/clone", "/nodes/pve2/qemu/9001/clone"].contains(&path.as_str())
                && status == 200
                && !target,
            "{path} answered {status}, target sent: {target}"
        );
    }
}

/// Un-pausing the CAPI Cluster wakes its machines by itself (the machine controller watches
/// Clusters): here the ProxmoxCluster controller, whose status write used to wake them, does
/// not run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unpausing_the_cluster_alone_resumes_its_machines() {
    let env = Env::start().await;
    env.create_credentials("demo-credentials", None).await;
    let uid = env.create_capi_cluster("demo").await;
    env.create_proxmox_cluster("demo", &uid, cluster_spec())
        .await;
    env.run_ipam();
    let both = env.spawn_controllers();
    let cluster = env
        .wait_cluster("demo", "Ready=True", |c| {
            condition(c, "Ready").is_some_and(|c| c.0 == "True")
        })
        .await;
    env.mark_cluster_provisioned("demo", &cluster).await;
    let clusters = Api::<capmox::capi::Cluster>::namespaced(env.client(), "default");
    let pause = |paused: bool| json!({"spec": {"paused": paused}});
    clusters
        .patch(
            "demo",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(pause(true)),
        )
        .await
        .expect("paused");
    env.create_machine("demo", "demo-md-1", Some("rack-a"), false, machine_spec())
        .await;
    env.wait_machine("demo-md-1", "Paused=True", |m| {
        condition_of(m, "Paused").as_deref() == Some("True")
    })
    .await;
    both.stop().await;
    // The machine controller alone, once it has looked at the (paused) machine.
    let context = std::sync::Arc::new(capmox::controller::Context::new(
        env.client(),
        crate::common::env::manager_config(),
        capmox::controller::GlobalCredentials::default(),
    ));
    tokio::spawn(capmox::controller::machine::run(
        context.clone(),
        env.stop.clone(),
    ));
    let reconciled =
        r#"controller_runtime_reconcile_total{controller="proxmoxmachine",result="success"}"#;
    let deadline = tokio::time::Instant::now() + crate::common::env::ENV_WAIT;
    while !context.metrics.render().contains(reconciled) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the machine controller never reconciled"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    clusters
        .patch(
            "demo",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(pause(false)),
        )
        .await
        .expect("unpaused");
    let machine = env
        .wait_machine("demo-md-1", "provisioned", ProxmoxMachine::is_provisioned)
        .await;
    assert_eq!(condition_of(&machine, "Paused").as_deref(), Some("False"));
}
