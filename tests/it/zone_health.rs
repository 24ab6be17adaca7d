//! Zones that fail: a zone without an online node is taken from the control plane (and given
//! back when healthy), and no machine is scheduled on an offline node.

use std::sync::Arc;
use std::time::Duration;

use capmox::api::{FailureDomain, ProxmoxCluster, ProxmoxMachine};
use capmox::controller::zone_health::ZoneHolds;
use capmox::controller::{Context, GlobalCredentials, ManagerConfig};
use kube::api::{Api, Patch, PatchParams};
use serde_json::{Value, json};

use crate::common::env::{Env, condition, manager_config};
use crate::machine_support::scenario::condition_status;

fn spec(memory_adjustment: Option<i64>) -> Value {
    let mut spec = json!({
        "controlPlaneEndpoint": {"host": "10.0.0.10", "port": 6443},
        "dnsServers": ["10.0.0.2"],
        "ipv4Config": {"addresses": ["10.0.0.100-10.0.0.150"], "prefix": 24, "gateway": "10.0.0.1"},
        "credentialsRef": {"name": "demo-credentials"},
        "zoneConfig": [
            {"zone": "rack-a", "nodes": ["pve1", "pve2"]},
            {"zone": "rack-b", "nodes": ["pve3", "pve4"]}
        ]
    });
    if let Some(adjustment) = memory_adjustment {
        spec["schedulerHints"] = json!({"memoryAdjustment": adjustment});
    }
    spec
}

/// A cluster `demo` whose controllers act on a zone's health at once (holds of zero), ready.
async fn started(memory_adjustment: Option<i64>) -> (Env, ProxmoxCluster) {
    let env = Env::start().await;
    env.create_credentials("demo-credentials", None).await;
    let uid = env.create_capi_cluster("demo").await;
    env.create_proxmox_cluster("demo", &uid, spec(memory_adjustment))
        .await;
    let config = ManagerConfig {
        zone_holds: ZoneHolds {
            drain_after: Duration::ZERO,
            restore_after: Duration::ZERO,
        },
        proxmox_requests_in_flight: capmox::proxmox::DEFAULT_REQUESTS_IN_FLIGHT,
        ..manager_config()
    };
    let context = Arc::new(Context::new(
        env.client(),
        config,
        GlobalCredentials::default(),
    ));
    tokio::spawn(capmox::controller::run_controllers(
        context,
        env.stop.clone(),
    ));
    env.run_ipam();
    let cluster = env
        .wait_cluster("demo", "Ready=True", |c| {
            condition(c, "Ready").is_some_and(|c| c.0 == "True")
        })
        .await;
    env.mark_cluster_provisioned("demo", &cluster).await;
    (env, cluster)
}

fn domain(name: &str, control_plane: bool) -> FailureDomain {
    FailureDomain {
        name: name.into(),
        control_plane: Some(control_plane),
        attributes: Default::default(),
    }
}

fn domains(cluster: &ProxmoxCluster) -> Vec<FailureDomain> {
    cluster
        .status
        .as_ref()
        .map(|s| s.failure_domains.clone())
        .unwrap_or_default()
}

fn set_online(env: &Env, nodes: &[&str], online: bool) {
    for node in nodes {
        assert!(
            env.sim.with_cluster(|c| c.set_node_online(node, online)),
            "{node} exists"
        );
    }
}

/// Proxmox sends no events: a touch of the ProxmoxCluster makes its controller look now.
async fn touch(env: &Env, value: &str) {
    Api::<ProxmoxCluster>::namespaced(env.client(), "default")
        .patch(
            "demo",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {"test/touched": value}}})),
        )
        .await
        .expect("annotated");
}

#[tokio::test]
async fn a_zone_without_an_online_node_leaves_the_control_plane_until_it_is_back() {
    let (env, cluster) = started(None).await;
    assert_eq!(
        domains(&cluster),
        [domain("rack-a", true), domain("rack-b", true)]
    );
    assert_eq!(
        condition(&cluster, "FailureDomainsAvailable").map(|c| (c.0, c.1)),
        Some(("True".to_owned(), "Available".to_owned()))
    );

    set_online(&env, &["pve1", "pve2"], false);
    touch(&env, "down").await;
    let drained = env
        .wait_cluster("demo", "rack-a taken from the control plane", |c| {
            domains(c) == [domain("rack-a", false), domain("rack-b", true)]
        })
        .await;
    let (status, reason, message) =
        condition(&drained, "FailureDomainsAvailable").expect("condition");
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("False", "ZoneUnhealthy")
    );
    assert!(
        message.contains("zone rack-a: no node online (pve1, pve2)")
            && message.contains("not offered to the control plane"),
        "{message}"
    );
    assert!(
        drained
            .status
            .as_ref()
            .and_then(|s| s.initialization.as_ref())
            .and_then(|i| i.provisioned)
            == Some(true),
        "a zone's health does not unprovision the cluster"
    );

    // One node back is enough.
    set_online(&env, &["pve2"], true);
    touch(&env, "up").await;
    let back = env
        .wait_cluster("demo", "rack-a offered again", |c| {
            domains(c) == [domain("rack-a", true), domain("rack-b", true)]
        })
        .await;
    assert_eq!(
        condition(&back, "FailureDomainsAvailable").map(|c| (c.0, c.1)),
        Some(("True".to_owned(), "Available".to_owned()))
    );
}

#[tokio::test]
async fn the_last_zone_is_never_taken_from_the_control_plane() {
    let (env, _) = started(None).await;
    set_online(&env, &["pve1", "pve2", "pve3", "pve4"], false);
    touch(&env, "all down").await;
    let cluster = env
        .wait_cluster("demo", "both zones unhealthy", |c| {
            condition(c, "FailureDomainsAvailable").is_some_and(|c| {
                c.1 == "ZoneUnhealthy" && c.2.contains("rack-a") && c.2.contains("rack-b")
            })
        })
        .await;
    assert_eq!(
        domains(&cluster),
        [domain("rack-a", true), domain("rack-b", true)]
    );
    let message = condition(&cluster, "FailureDomainsAvailable")
        .map(|c| c.2)
        .unwrap_or_default();
    assert!(
        message.contains("no zone is left for the control plane"),
        "{message}"
    );
}

#[tokio::test]
async fn a_zone_whose_storages_are_full_or_inactive_leaves_the_control_plane_until_they_recover() {
    let (env, _) = started(None).await;
    env.sim.with_cluster(|c| {
        for node in ["pve3", "pve4"] {
            assert!(c.fill_storage("local", node, 99), "{node}");
            assert!(c.set_storage_active("ceph", node, false), "{node}");
        }
    });
    touch(&env, "storage-down").await;
    let drained = env
        .wait_cluster("demo", "rack-b taken from the control plane", |c| {
            domains(c) == [domain("rack-a", true), domain("rack-b", false)]
        })
        .await;
    let (status, reason, message) =
        condition(&drained, "FailureDomainsAvailable").expect("condition");
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("False", "ZoneUnhealthy")
    );
    assert!(
        message.contains(
            "zone rack-b: no node can take a VM disk (pve3: ceph inactive, local full (99% used); pve4: ceph inactive, local full (99% used))"
        ),
        "{message}"
    );

    // One node with an active storage for VM disks is enough.
    env.sim
        .with_cluster(|c| c.set_storage_active("ceph", "pve4", true));
    touch(&env, "storage-back").await;
    let restored = env
        .wait_cluster("demo", "rack-b offered again", |c| {
            domains(c) == [domain("rack-a", true), domain("rack-b", true)]
        })
        .await;
    assert_eq!(
        condition(&restored, "FailureDomainsAvailable").map(|c| (c.0, c.1)),
        Some(("True".to_owned(), "Available".to_owned()))
    );
}

fn machine_spec() -> Value {
    json!({
        "sourceNode": "pve1", "templateID": 9000, "memoryMiB": 2048,
        "network": {"networkDevices": [{"name": "net0", "bridge": "vmbr0", "defaultIPv4": true}]}
    })
}

#[tokio::test]
async fn a_machine_is_never_scheduled_on_an_offline_node_and_waits_when_its_zone_has_none() {
    // Without a memory budget every node looks alike, offline ones included.
    let (env, _) = started(Some(0)).await;
    set_online(&env, &["pve3"], false);
    env.create_machine("demo", "worker-b", Some("rack-b"), false, machine_spec())
        .await;
    let machine = env
        .wait_machine("worker-b", "provisioned", ProxmoxMachine::is_provisioned)
        .await;
    assert_eq!(
        machine.status.and_then(|s| s.proxmox_node).as_deref(),
        Some("pve4")
    );

    set_online(&env, &["pve4"], false);
    env.create_machine("demo", "worker-b2", Some("rack-b"), false, machine_spec())
        .await;
    let (machine, message) = env
        .wait_machine_reason("worker-b2", "NodesUnavailable")
        .await;
    assert!(
        message.contains("pve3") && message.contains("pve4") && message.contains("online"),
        "{message}"
    );
    let vms: Vec<u32> = env
        .proxmox()
        .cluster_resources(None)
        .await
        .expect("listing")
        .into_iter()
        .filter(|r| r.kind == capmox::proxmox::ResourceType::Qemu && !r.template)
        .filter_map(|r| r.vmid)
        .collect();
    assert_eq!(vms.len(), 1, "only worker-b's VM exists: {vms:?}");
    assert_eq!(
        condition_status(&machine, "VirtualMachineProvisioned"),
        Some("False".to_owned())
    );
}
