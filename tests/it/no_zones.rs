//! End to end: a cluster without zones behaves as before failure domains existed — none are
//! published, machines land on the cluster's `allowedNodes`, take addresses from the cluster's
//! default pool, report no failure domain, and deleting the cluster leaves nothing behind.

use std::collections::{BTreeMap, BTreeSet};
use std::net::Ipv4Addr;
use std::time::Duration;

use capmox::api::{ProxmoxCluster, ProxmoxMachine};
use capmox::capi::{IPAddressClaim, InClusterIPPool};
use capmox_sandbox::run::{Sandbox, SandboxOptions, example_machine_spec};
use capmox_sandbox::standin::{ExampleCluster, create_example_cluster};
use capmox_sim::SimOptions;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::json;

/// The cluster's nodes: a subset of the simulator's five, so "anywhere" would be caught.
const ALLOWED: [&str; 3] = ["pve2", "pve3", "pve5"];

fn options() -> SandboxOptions {
    SandboxOptions {
        sim: SimOptions {
            clone_duration: Duration::from_millis(20),
            task_duration: Duration::ZERO,
            boot_delay: Duration::from_millis(20),
            ..SimOptions::default()
        },
        timeout: Duration::from_secs(120),
        verbose: false,
        ..SandboxOptions::default()
    }
}

fn in_default_pool(ip: &str) -> bool {
    let Ok(ip) = ip.parse::<Ipv4Addr>() else {
        return false;
    };
    (Ipv4Addr::new(10, 0, 0, 100)..=Ipv4Addr::new(10, 0, 0, 150)).contains(&ip)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_without_zones_uses_allowed_nodes_and_the_default_pool() {
    let options = options();
    let sandbox = Sandbox::start(&options, false)
        .await
        .expect("sandbox starts");
    let client = sandbox.client();
    let token = sandbox.proxmox.sim.token();
    let (id, secret) = token.split_once('=').expect("token id=secret");
    let credentials: Secret = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": "plain-proxmox-credentials", "namespace": "default"},
        "stringData": {"url": sandbox.proxmox.sim.url(), "token": id, "secret": secret}
    }))
    .expect("secret");
    Api::<Secret>::namespaced(client.clone(), "default")
        .create(&PostParams::default(), &credentials)
        .await
        .expect("credentials");
    let mut example = ExampleCluster::new(
        "default",
        "plain",
        json!({
            "controlPlaneEndpoint": {"host": "10.0.0.10", "port": 6443},
            "allowedNodes": ALLOWED,
            "dnsServers": ["10.0.0.2"],
            "ipv4Config": {"addresses": ["10.0.0.100-10.0.0.150"], "prefix": 24, "gateway": "10.0.0.1"},
            "credentialsRef": {"name": "plain-proxmox-credentials"}
        }),
        example_machine_spec(),
    );
    example.control_plane_replicas = 3;
    example.worker_replicas = 2;
    create_example_cluster(&client, &example)
        .await
        .expect("cluster applied");
    let rows = sandbox
        .wait_ready(5, options.timeout, false)
        .await
        .expect("5 machines ready");

    // No failure domains, on the ProxmoxCluster nor (copied by CAPI) on the Cluster.
    let cluster = Api::<ProxmoxCluster>::namespaced(client.clone(), "default")
        .get("plain")
        .await
        .expect("ProxmoxCluster");
    let status = cluster.status.expect("status");
    assert!(
        status.failure_domains.is_empty(),
        "published {:?}",
        status.failure_domains
    );
    assert_eq!(
        status.initialization.and_then(|i| i.provisioned),
        Some(true)
    );
    let capi_cluster = sandbox
        .server
        .object("clusters", "default", "plain")
        .expect("kind")
        .expect("Cluster");
    assert_eq!(
        capi_cluster["status"]["initialization"]["infrastructureProvisioned"], true,
        "CAPI saw the infrastructure: {}",
        capi_cluster["status"]
    );
    assert!(
        capi_cluster["status"]["failureDomains"]
            .as_array()
            .is_none_or(Vec::is_empty),
        "the Cluster has failure domains: {}",
        capi_cluster["status"]["failureDomains"]
    );

    // Every machine: ready, no failure domain, its VM really on an allowed node, addresses from
    // the cluster's default pool.
    let machines = Api::<ProxmoxMachine>::namespaced(client.clone(), "default")
        .list(&Default::default())
        .await
        .expect("list")
        .items;
    assert_eq!(machines.len(), 5);
    let mut control_plane_nodes = BTreeSet::new();
    for machine in &machines {
        let name = machine.metadata.name.clone().expect("name");
        let status = machine.status.clone().expect("status");
        assert_eq!(
            status.failure_domain, None,
            "{name} reports a failure domain"
        );
        assert_eq!(
            crate::common::zone_label(machine),
            Some("default"),
            "{name}'s zone label"
        );
        let vmid = status.virtual_machine_id.expect("VMID");
        let node = sandbox
            .proxmox
            .sim
            .with_cluster(|c| c.vm_node(u32::try_from(vmid).expect("VMID fits")))
            .unwrap_or_else(|| panic!("{name}'s VM {vmid} does not exist"));
        assert!(
            ALLOWED.contains(&node.as_str()),
            "{name} is on {node}, outside {ALLOWED:?}"
        );
        assert_eq!(status.proxmox_node.as_deref(), Some(node.as_str()));
        let default = status
            .ip_addresses
            .iter()
            .find(|a| a.net == "default")
            .unwrap_or_else(|| panic!("{name} has no default addresses"));
        assert!(
            !default.ipv4.is_empty() && default.ipv4.iter().all(|ip| in_default_pool(ip)),
            "{name} has {:?}",
            default.ipv4
        );
        if name.starts_with("plain-control-plane") {
            control_plane_nodes.insert(node);
        }
    }
    // The control plane still spreads over nodes (fewest machines of one owner first).
    assert_eq!(control_plane_nodes.len(), 3, "{rows:?}");
    for row in &rows {
        assert_eq!(row.failure_domain, "-", "{row:?}");
    }
    // The CAPI Machines carry no failure domain either.
    for machine in sandbox.server.objects("machines").expect("kind") {
        assert!(
            machine["spec"]["failureDomain"].is_null()
                && machine["status"]["failureDomain"].is_null(),
            "{}",
            machine["metadata"]["name"]
        );
    }
    // One pool (the cluster's default), every claim on it.
    let pools: Vec<String> = Api::<InClusterIPPool>::namespaced(client.clone(), "default")
        .list(&Default::default())
        .await
        .expect("list")
        .items
        .into_iter()
        .filter_map(|p| p.metadata.name)
        .collect();
    assert_eq!(pools, ["plain-v4-icip"]);
    let claims = Api::<IPAddressClaim>::namespaced(client.clone(), "default")
        .list(&Default::default())
        .await
        .expect("list")
        .items;
    assert_eq!(claims.len(), 5, "one claim per machine");
    let mut by_pool: BTreeMap<String, usize> = BTreeMap::new();
    for claim in &claims {
        *by_pool.entry(claim.spec.pool_ref.name.clone()).or_default() += 1;
    }
    assert_eq!(by_pool, BTreeMap::from([("plain-v4-icip".to_owned(), 5)]));

    // Deleting the cluster leaves no VM, seed ISO, claim or pool.
    Api::<capmox::capi::Cluster>::namespaced(client.clone(), "default")
        .delete("plain", &DeleteParams::default())
        .await
        .expect("cluster delete accepted");
    sandbox
        .server
        .wait_for(
            "proxmoxclusters",
            "default",
            "plain",
            options.timeout,
            |c| c.is_none(),
        )
        .await
        .expect("ProxmoxCluster released in time");
    assert_eq!(
        sandbox.proxmox.sim.with_cluster(|c| c.vm_count()),
        1,
        "only the template is left"
    );
    let config = capmox::proxmox::ClientConfig::new(
        sandbox.proxmox.sim.url(),
        capmox::proxmox::ApiToken::parse(&sandbox.proxmox.sim.token()).expect("token"),
    );
    let proxmox = capmox::proxmox::ProxmoxClient::new(&config).expect("client");
    for node in ["pve1", "pve2", "pve3", "pve4", "pve5"] {
        let isos = proxmox
            .storage_content(node, "local", Some("iso"), None)
            .await
            .expect("content");
        assert!(isos.is_empty(), "seed ISOs left on {node}: {isos:?}");
    }
    assert!(
        sandbox
            .server
            .objects("ipaddressclaims")
            .expect("kind")
            .is_empty()
    );
    assert!(
        sandbox
            .server
            .objects("inclusterippools")
            .expect("kind")
            .is_empty()
    );
}
