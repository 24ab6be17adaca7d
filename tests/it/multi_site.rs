//! Failure domains across several Proxmox clusters: a three-zone cluster whose zones live in
//! two simulated Proxmox clusters (site A: the cluster's credentials, site B: a zone's own
//! `credentialsRef`) that both have nodes `pve1`/`pve2`, template 9000 and overlapping VMIDs.
//! Machines land in their zone's Proxmox and record it; losing site B keeps site A working,
//! marks B's failure domain and never deletes or re-creates a VM; a zone whose credentials
//! change to another Proxmox makes its machines wait instead of cloning there; deletion cleans
//! both sites and touches nothing else.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::common::env::{ENV_WAIT, Env, TOPOLOGY, condition};
use capmox::api::ProxmoxMachine;
use capmox::proxmox::{ApiToken, ClientConfig, ClusterResource, ProxmoxClient, ResourceType};
use capmox_sim::{SimOptions, Simulator, Topology};
use k8s_openapi::api::core::v1::Secret;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use serde_json::json;

fn sim() -> SimOptions {
    SimOptions {
        clone_duration: Duration::ZERO,
        task_duration: Duration::ZERO,
        boot_delay: Duration::ZERO,
        ..SimOptions::default()
    }
}

/// Site B: its own `pve1` and `pve2`, template 9000 as site A has, and three unrelated VMs
/// holding the VMIDs site A hands out first.
const SITE_B: &str = r#"
cluster_name: site-b
nodes:
  - {name: pve1, memory_mib: 65536, cores: 16}
  - {name: pve2, memory_mib: 65536, cores: 16}
storages:
  - {name: local, type: dir, content: [iso, vztmpl, snippets, images]}
  - {name: ceph, type: rbd, shared: true, content: [images], size_gib: 4096}
templates:
  - {vmid: 9000, name: ubuntu-2404-kube, node: pve1, tags: [capmox, ubuntu], storage: ceph, disk_gib: 10, config: {agent: "1", net0: "virtio=BC:24:11:00:90:00,bridge=vmbr0"}}
guests:
  - {vmid: 100, name: site-b-db-1, node: pve1, storage: ceph, running: true}
  - {vmid: 101, name: site-b-db-2, node: pve2, storage: ceph, running: true}
  - {vmid: 102, name: site-b-db-3, node: pve2, storage: ceph}
"#;

/// The unrelated VMs of site B, which nothing may touch.
const SITE_B_GUESTS: [(u32, &str); 3] = [
    (100, "site-b-db-1"),
    (101, "site-b-db-2"),
    (102, "site-b-db-3"),
];

fn cluster_spec() -> serde_json::Value {
    json!({
        "controlPlaneEndpoint": {"host": "10.0.0.10", "port": 6443},
        "dnsServers": ["10.0.0.2"],
        "ipv4Config": {"addresses": ["10.0.0.100-10.0.0.150"], "prefix": 24, "gateway": "10.0.0.1"},
        "credentialsRef": {"name": "site-a-credentials"},
        "zoneConfig": [
            {"zone": "rack-a", "nodes": ["pve1", "pve2"]},
            {"zone": "rack-b", "nodes": ["pve3", "pve4"]},
            {"zone": "site-b", "nodes": ["pve1", "pve2"], "credentialsRef": {"name": "site-b-credentials"}}
        ]
    })
}

fn machine_spec() -> serde_json::Value {
    json!({
        "sourceNode": "pve1", "templateID": 9000, "memoryMiB": 2048,
        "network": {"networkDevices": [{"name": "net0", "bridge": "vmbr0", "defaultIPv4": true}]}
    })
}

/// (name, zone, control plane)
const MACHINES: [(&str, &str, bool); 5] = [
    ("demo-cp-1", "rack-a", true),
    ("demo-cp-2", "rack-b", true),
    ("demo-cp-3", "site-b", true),
    ("demo-w-1", "site-b", false),
    ("demo-w-2", "rack-a", false),
];

struct Sites {
    env: Env,
    site_b: Simulator,
}

fn client(sim: &Simulator) -> ProxmoxClient {
    let config = ClientConfig::new(sim.url(), ApiToken::parse(&sim.token()).expect("token"));
    ProxmoxClient::new(&config).expect("client")
}

fn endpoint(sim: &Simulator) -> String {
    capmox::proxmox::endpoint_of(&sim.url()).expect("simulator URL")
}

/// The VMs (not templates) a simulated Proxmox lists, by VMID.
async fn vms(sim: &Simulator) -> BTreeMap<u32, ClusterResource> {
    client(sim)
        .cluster_resources(None)
        .await
        .expect("listing")
        .into_iter()
        .filter(|r| r.kind == ResourceType::Qemu && !r.template)
        .filter_map(|r| Some((r.vmid?, r)))
        .collect()
}

/// How many VMs carry `name` in each site: (site A, site B).
async fn copies(sites: &Sites, name: &str) -> (usize, usize) {
    let count = |vms: BTreeMap<u32, ClusterResource>| {
        vms.values()
            .filter(|vm| vm.name.as_deref() == Some(name))
            .count()
    };
    (
        count(vms(&sites.env.sim).await),
        count(vms(&sites.site_b).await),
    )
}

async fn create_secret(env: &Env, name: &str, sim: &Simulator) {
    let token = sim.token();
    let (id, secret) = token.split_once('=').expect("token id=secret");
    let object: Secret = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": name, "namespace": "default"},
        "stringData": {"url": sim.url(), "token": id, "secret": secret}
    }))
    .expect("secret");
    Api::<Secret>::namespaced(env.client(), "default")
        .create(&PostParams::default(), &object)
        .await
        .expect("secret created");
}

/// Site A (the environment's simulator) and site B, each with its credentials Secret.
async fn two_sites() -> (Env, Simulator) {
    let topology = Topology::from_yaml(TOPOLOGY, "site A").expect("topology");
    let env = Env::start_with_topology(topology, sim()).await;
    let site_b = Simulator::start(
        Topology::from_yaml(SITE_B, "site B").expect("site B topology"),
        sim(),
    )
    .await
    .expect("site B starts");
    create_secret(&env, "site-a-credentials", &env.sim).await;
    create_secret(&env, "site-b-credentials", &site_b).await;
    (env, site_b)
}

/// Both sites up, the cluster ready and [`MACHINES`] provisioned.
async fn provisioned() -> Sites {
    let (env, site_b) = two_sites().await;
    let uid = env.create_capi_cluster("demo").await;
    env.create_proxmox_cluster("demo", &uid, cluster_spec())
        .await;
    env.run_controllers();
    let ready = env
        .wait_cluster("demo", "Ready=True", |c| {
            condition(c, "Ready").is_some_and(|c| c.0 == "True")
        })
        .await;
    let domains: Vec<&str> = ready
        .status
        .as_ref()
        .map(|s| s.failure_domains.iter().map(|d| d.name.as_str()).collect())
        .unwrap_or_default();
    assert_eq!(domains, ["rack-a", "rack-b", "site-b"]);
    env.mark_cluster_provisioned("demo", &ready).await;
    for (name, zone, cp) in MACHINES {
        env.create_machine("demo", name, Some(zone), cp, machine_spec())
            .await;
    }
    for (name, ..) in MACHINES {
        env.wait_machine(name, "provisioned", ProxmoxMachine::is_provisioned)
            .await;
    }
    Sites { env, site_b }
}

fn recorded(machine: &ProxmoxMachine) -> (String, String, u32) {
    let status = machine.status.clone().expect("status");
    (
        status.proxmox_endpoint.expect("endpoint recorded"),
        status.proxmox_node.expect("node recorded"),
        u32::try_from(status.virtual_machine_id.expect("VMID recorded")).expect("VMID"),
    )
}

async fn machine(env: &Env, name: &str) -> ProxmoxMachine {
    Api::<ProxmoxMachine>::namespaced(env.client(), "default")
        .get(name)
        .await
        .expect("machine")
}

async fn site_b_guests_untouched(sites: &Sites) {
    let listed = vms(&sites.site_b).await;
    for (vmid, name) in SITE_B_GUESTS {
        assert_eq!(
            listed.get(&vmid).and_then(|vm| vm.name.as_deref()),
            Some(name),
            "site B's own VM {vmid} is still there"
        );
    }
}

/// Asks for the deletion of the `K` named `name`; returns its UID, to wait for it with.
async fn delete<K>(env: &Env, name: &str) -> String
where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
{
    let api = Api::<K>::namespaced(env.client(), "default");
    let uid = api.get(name).await.expect("object").uid().expect("uid");
    api.delete(name, &DeleteParams::default())
        .await
        .expect("delete");
    uid
}

/// Waits until the `K` named `name` with `uid` is gone (its finalizers released).
async fn wait_deleted<K>(env: &Env, name: &str, uid: &str)
where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug
        + Send
        + 'static,
{
    let api = Api::<K>::namespaced(env.client(), "default");
    tokio::time::timeout(
        ENV_WAIT,
        kube::runtime::wait::await_condition(
            api,
            name,
            kube::runtime::wait::conditions::is_deleted(uid),
        ),
    )
    .await
    .expect("deleted in time")
    .expect("watch");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn machines_land_in_their_zones_proxmox_and_deletion_cleans_both_sites() {
    let sites = provisioned().await;
    let env = &sites.env;
    let (site_a, site_b) = (endpoint(&env.sim), endpoint(&sites.site_b));
    let (in_a, in_b) = (vms(&env.sim).await, vms(&sites.site_b).await);
    for (name, zone, _) in MACHINES {
        let (recorded_endpoint, node, vmid) = recorded(&machine(env, name).await);
        let (want, listed, other) = if zone == "site-b" {
            (&site_b, &in_b, &in_a)
        } else {
            (&site_a, &in_a, &in_b)
        };
        assert_eq!(
            &recorded_endpoint, want,
            "{name} records its zone's Proxmox"
        );
        let vm = listed
            .get(&vmid)
            .unwrap_or_else(|| panic!("{name}'s VM {vmid} is in its zone's Proxmox"));
        assert_eq!(vm.name.as_deref(), Some(name));
        assert_eq!(vm.node.as_deref(), Some(node.as_str()));
        assert!(
            other
                .get(&vmid)
                .is_none_or(|vm| vm.name.as_deref() != Some(name)),
            "{name} has no VM in the other site"
        );
        if zone == "site-b" {
            assert!(
                ["pve1", "pve2"].contains(&node.as_str()),
                "site B's pve1/pve2"
            );
            assert!(
                !SITE_B_GUESTS.iter().any(|(id, _)| *id == vmid),
                "{name} did not take a VMID site B uses"
            );
        }
    }
    // VMIDs clash across the sites: site A's first machine has the VMID of a site B guest.
    assert!(
        in_a.keys()
            .any(|vmid| SITE_B_GUESTS.iter().any(|(id, _)| id == vmid)),
        "site A hands out VMIDs site B's own VMs hold: {:?}",
        in_a.keys().collect::<Vec<_>>()
    );
    site_b_guests_untouched(&sites).await;

    let mut deleted = Vec::new();
    for (name, ..) in MACHINES {
        deleted.push((name, delete::<ProxmoxMachine>(env, name).await));
    }
    for (name, uid) in deleted {
        wait_deleted::<ProxmoxMachine>(env, name, &uid).await;
    }
    for (name, ..) in MACHINES {
        assert_eq!(copies(&sites, name).await, (0, 0), "{name}'s VM is gone");
    }
    site_b_guests_untouched(&sites).await;

    // The cluster held on to both sites' credentials until it was gone.
    let secrets = Api::<Secret>::namespaced(env.client(), "default");
    let held = |secret: &Secret| {
        secret
            .finalizers()
            .iter()
            .any(|f| f == capmox::api::finalizers::CLUSTER_SECRET)
    };
    for name in ["site-a-credentials", "site-b-credentials"] {
        assert!(
            held(&secrets.get(name).await.expect("secret")),
            "{name} is held"
        );
    }
    let uid = delete::<capmox::api::ProxmoxCluster>(env, "demo").await;
    wait_deleted::<capmox::api::ProxmoxCluster>(env, "demo", &uid).await;
    for name in ["site-a-credentials", "site-b-credentials"] {
        assert!(
            !held(&secrets.get(name).await.expect("secret")),
            "{name} is let go"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_one_site_keeps_the_others_working_and_marks_its_failure_domain() {
    let sites = provisioned().await;
    let env = &sites.env;
    let before: Vec<_> = {
        let mut out = Vec::new();
        for (name, ..) in MACHINES {
            out.push((name, recorded(&machine(env, name).await)));
        }
        out
    };

    sites.site_b.set_offline(true);
    // A resync of the cluster sees it (a label edit wakes it now rather than in minutes).
    let clusters = Api::<capmox::api::ProxmoxCluster>::namespaced(env.client(), "default");
    clusters
        .patch(
            "demo",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"poke": "1"}}})),
        )
        .await
        .expect("label");
    let lost = env
        .wait_cluster("demo", "site B reported lost", |c| {
            condition(c, "FailureDomainsReady").is_some_and(|c| c.1 == "ProxmoxUnavailable")
        })
        .await;
    let (status, reason, message) = condition(&lost, "FailureDomainsReady").expect("condition");
    assert_eq!(status, "False");
    assert!(message.contains("site-b"), "{reason}: {message}");
    assert!(!message.contains("rack-a"), "{message}");
    let (status, _, message) = condition(&lost, "ProxmoxAvailable").expect("condition");
    assert_eq!(status, "False");
    assert!(
        message.contains("zones site-b") && message.contains("rack-a, rack-b are reachable"),
        "{message}"
    );
    let domains: Vec<&str> = lost
        .status
        .as_ref()
        .map(|s| s.failure_domains.iter().map(|d| d.name.as_str()).collect())
        .unwrap_or_default();
    assert_eq!(
        domains,
        ["rack-a", "rack-b", "site-b"],
        "the lost site's failure domain stays published"
    );
    // Within --zone-drain-after it stays offered to the control plane, and says so.
    let offered = lost.status.as_ref().is_some_and(|s| {
        s.failure_domains
            .iter()
            .all(|d| d.control_plane == Some(true))
    });
    assert!(
        offered,
        "{:?}",
        lost.status.as_ref().map(|s| &s.failure_domains)
    );
    let (status, reason, message) = condition(&lost, "FailureDomainsAvailable").expect("condition");
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("False", "ZoneUnhealthy")
    );
    assert!(
        message.contains("zone site-b: its Proxmox")
            && message.contains("still offered to the control plane")
            && !message.contains("rack-a"),
        "{message}"
    );

    // Site A keeps provisioning; a new site B machine waits without a VM anywhere.
    env.create_machine("demo", "demo-w-3", Some("rack-b"), false, machine_spec())
        .await;
    env.create_machine("demo", "demo-w-4", Some("site-b"), false, machine_spec())
        .await;
    let w3 = env
        .wait_machine(
            "demo-w-3",
            "provisioned in site A",
            ProxmoxMachine::is_provisioned,
        )
        .await;
    assert_eq!(recorded(&w3).0, endpoint(&env.sim));
    let (waiting, _) = env
        .wait_machine_reason("demo-w-4", "ProxmoxUnreachable")
        .await;
    assert!(!waiting.is_provisioned());
    assert_eq!(
        vms(&env.sim)
            .await
            .values()
            .filter(|vm| vm.name.as_deref() == Some("demo-w-4"))
            .count(),
        0
    );

    // Nothing of site B was re-created in site A, and every machine kept its VM.
    for (name, was) in &before {
        assert_eq!(&recorded(&machine(env, name).await), was, "{name}");
        assert_eq!(
            vms(&env.sim)
                .await
                .values()
                .filter(|vm| vm.name.as_deref() == Some(*name))
                .count(),
            usize::from(!was.0.eq(&endpoint(&sites.site_b))),
            "{name} has exactly its own VM in site A"
        );
    }

    sites.site_b.set_offline(false);
    let w4 = env
        .wait_machine(
            "demo-w-4",
            "provisioned in site B",
            ProxmoxMachine::is_provisioned,
        )
        .await;
    assert_eq!(recorded(&w4).0, endpoint(&sites.site_b));
    env.wait_cluster("demo", "site B back", |c| {
        condition(c, "FailureDomainsReady").is_some_and(|c| c.0 == "True")
            && condition(c, "ProxmoxAvailable").is_some_and(|c| c.0 == "True")
    })
    .await;
    for (name, ..) in MACHINES {
        let (a, b) = copies(&sites, name).await;
        assert_eq!(a + b, 1, "{name} has one VM");
    }
    site_b_guests_untouched(&sites).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zone_whose_credentials_now_reach_another_proxmox_neither_clones_nor_releases() {
    let sites = provisioned().await;
    let env = &sites.env;
    let (_, _, w1_vmid) = recorded(&machine(env, "demo-w-1").await);

    // The zone's credentials now name site A (an operator's mistake): pve1 and pve2 exist
    // there too, so only the recorded endpoint tells them apart.
    create_secret(env, "site-b-moved", &env.sim).await;
    let mut spec = cluster_spec();
    spec["zoneConfig"][2]["credentialsRef"] = json!({"name": "site-b-moved"});
    Api::<capmox::api::ProxmoxCluster>::namespaced(env.client(), "default")
        .patch(
            "demo",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"zoneConfig": spec["zoneConfig"]}})),
        )
        .await
        .expect("zone credentials changed");

    let (_, message) = env
        .wait_machine_reason("demo-w-1", "ProxmoxEndpointChanged")
        .await;
    assert!(
        message.contains(&endpoint(&sites.site_b)),
        "names where the VM is: {message}"
    );
    assert_eq!(
        copies(&sites, "demo-w-1").await,
        (0, 1),
        "no VM cloned in site A"
    );

    // Deleting it meanwhile keeps the machine (and its VM in site B).
    let uid = delete::<ProxmoxMachine>(env, "demo-w-1").await;
    env.wait_machine("demo-w-1", "deletion blocked", |m| {
        m.metadata.deletion_timestamp.is_some()
            && m.status.as_ref().is_some_and(|s| {
                s.conditions
                    .iter()
                    .any(|c| c.reason == "ProxmoxEndpointChanged" && c.type_ != "Paused")
            })
    })
    .await;
    assert_eq!(copies(&sites, "demo-w-1").await, (0, 1));
    assert!(
        vms(&sites.site_b).await.contains_key(&w1_vmid),
        "the VM stays where it is"
    );

    // With the credentials back, the deletion completes where the VM is.
    Api::<capmox::api::ProxmoxCluster>::namespaced(env.client(), "default")
        .patch(
            "demo",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"zoneConfig": cluster_spec()["zoneConfig"]}})),
        )
        .await
        .expect("zone credentials restored");
    wait_deleted::<ProxmoxMachine>(env, "demo-w-1", &uid).await;
    assert_eq!(copies(&sites, "demo-w-1").await, (0, 0));
    site_b_guests_untouched(&sites).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zones_that_all_name_their_credentials_need_none_of_the_clusters() {
    let (env, site_b) = two_sites().await;
    // Neither spec.credentialsRef nor global credentials: every zone brings its own.
    let mut spec = cluster_spec();
    spec.as_object_mut()
        .expect("spec object")
        .remove("credentialsRef");
    for zone in [0, 1] {
        spec["zoneConfig"][zone]["credentialsRef"] = json!({"name": "site-a-credentials"});
    }
    let uid = env.create_capi_cluster("demo").await;
    env.create_proxmox_cluster("demo", &uid, spec).await;
    env.run_controllers();
    let ready = env
        .wait_cluster("demo", "Ready=True", |c| {
            condition(c, "Ready").is_some_and(|c| c.0 == "True")
        })
        .await;
    env.mark_cluster_provisioned("demo", &ready).await;
    env.create_machine("demo", "demo-cp-1", Some("site-b"), true, machine_spec())
        .await;
    let machine = env
        .wait_machine("demo-cp-1", "provisioned", ProxmoxMachine::is_provisioned)
        .await;
    assert_eq!(recorded(&machine).0, endpoint(&site_b));
    assert_eq!(
        vms(&site_b)
            .await
            .values()
            .filter(|vm| vm.name.as_deref() == Some("demo-cp-1"))
            .count(),
        1
    );

    // A machine template's capacity is read through a zone's credentials.
    let template: capmox::api::ProxmoxMachineTemplate = serde_json::from_value(json!({
        "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha2", "kind": "ProxmoxMachineTemplate",
        "metadata": {"name": "workers", "namespace": "default",
                     "labels": {"cluster.x-k8s.io/cluster-name": "demo"}},
        "spec": {"template": {"spec": machine_spec()}}
    }))
    .expect("template");
    Api::<capmox::api::ProxmoxMachineTemplate>::namespaced(env.client(), "default")
        .create(&PostParams::default(), &template)
        .await
        .expect("template created");
    let resolved = |t: &serde_json::Value| {
        t["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|c| c["type"] == "CapacityResolved" && c["status"] == "True")
    };
    let found = env
        .server
        .wait_for(
            "proxmoxmachinetemplates",
            "default",
            "workers",
            ENV_WAIT,
            |t| t.is_some_and(resolved),
        )
        .await;
    assert!(
        matches!(found, Ok(Some(_))),
        "capacity resolved: {:#?}",
        env.server
            .object("proxmoxmachinetemplates", "default", "workers")
    );
}
