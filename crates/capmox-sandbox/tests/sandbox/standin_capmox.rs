//! The CAPI stand-in with capmox's real ProxmoxCluster reconciler and the Proxmox simulator:
//! the failure domains capmox publishes reach the Cluster and steer KCP, and deleting the
//! Cluster tears everything down through capmox's finalizer.

use std::time::Duration;

use crate::env::Env;
use capmox::api::{FailureDomain, ProxmoxCluster, labels};
use capmox::capi::{Cluster, Machine};
use capmox_sandbox::standin::{self, CapiStandIn, ExampleCluster};
use futures::TryStreamExt;
use kube::api::{Api, DeleteParams};
use kube::runtime::WatchStreamExt;
use kube::runtime::wait::{await_condition, conditions};
use kube::{Resource, ResourceExt};
use serde_json::json;
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(30);

fn domain(name: &str, control_plane: bool) -> FailureDomain {
    FailureDomain {
        name: name.into(),
        control_plane: Some(control_plane),
        attributes: Default::default(),
    }
}

#[tokio::test]
async fn capmox_failure_domains_steer_the_stand_in_control_plane() {
    let env = Env::start().await;
    env.create_credentials("demo-credentials", None).await;
    env.run_controllers();
    let stop = CancellationToken::new();
    let _guard = stop.clone().drop_guard();
    CapiStandIn::spawn(env.client(), "default", stop.clone());

    let mut example = ExampleCluster::new(
        "default",
        "demo",
        json!({
            "controlPlaneEndpoint": {"host": "10.0.0.10", "port": 6443},
            "dnsServers": ["10.0.0.2"],
            "ipv4Config": {"addresses": ["10.0.0.100-10.0.0.150"], "prefix": 24, "gateway": "10.0.0.1"},
            "credentialsRef": {"name": "demo-credentials"},
            "zoneConfig": [
                {"zone": "rack-a", "nodes": ["pve1", "pve2"]},
                {"zone": "rack-b", "nodes": ["pve3", "pve4"], "controlPlaneEligible": false}
            ]
        }),
        json!({"sourceNode": "pve1", "templateID": 9000,
               "network": {"networkDevices": [{"name": "net0", "bridge": "vmbr0"}]}}),
    );
    example.control_plane_replicas = 2;
    standin::create_example_cluster(&env.client(), &example)
        .await
        .expect("example created");

    let clusters = Api::<Cluster>::namespaced(env.client(), "default");
    let with_domains = tokio::time::timeout(
        WAIT,
        await_condition(clusters.clone(), "demo", |c: Option<&Cluster>| {
            c.and_then(|c| c.status.as_ref())
                .is_some_and(|s| !s.failure_domains.is_empty())
        }),
    )
    .await
    .expect("failure domains reach the Cluster in time")
    .expect("watch")
    .expect("cluster");
    assert_eq!(
        with_domains.status.expect("status").failure_domains,
        [domain("rack-a", true), domain("rack-b", false)]
    );

    // Nothing provisions ProxmoxMachines here, so KCP stops at its first machine, in the only
    // control-plane domain.
    let machines = Api::<Machine>::namespaced(env.client(), "default");
    let mut applied = std::pin::pin!(
        kube::runtime::watcher(machines.clone(), Default::default()).applied_objects()
    );
    let first = tokio::time::timeout(WAIT, async {
        while let Some(m) = applied.try_next().await.expect("watch") {
            if m.labels().contains_key(labels::CONTROL_PLANE) {
                return m;
            }
        }
        panic!("watch ended")
    })
    .await
    .expect("first control-plane machine");
    assert_eq!(first.spec.failure_domain.as_deref(), Some("rack-a"));

    // Deleting the Cluster goes through capmox's ProxmoxCluster finalizer.
    let uid = clusters
        .get("demo")
        .await
        .expect("cluster")
        .uid()
        .expect("uid");
    clusters
        .delete("demo", &DeleteParams::default())
        .await
        .expect("deleted");
    tokio::time::timeout(
        WAIT,
        await_condition(clusters, "demo", conditions::is_deleted(&uid)),
    )
    .await
    .expect("cluster gone in time")
    .expect("watch");
    let infra = Api::<ProxmoxCluster>::namespaced(env.client(), "default");
    assert!(infra.get_opt("demo").await.expect("get").is_none());
    let left = machines
        .list(&Default::default())
        .await
        .expect("list")
        .items;
    assert!(
        left.is_empty(),
        "{:?}",
        left.iter()
            .map(|m| m.meta().name.clone())
            .collect::<Vec<_>>()
    );
}
