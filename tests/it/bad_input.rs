//! Input that once panicked a reconcile, which stopped every controller for good: each is now
//! that object's error, and the other objects go on.

use crate::common::env::{Env, condition};
use capmox::api::ProxmoxCluster;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, PostParams};
use serde_json::{Value, json};

fn spec(credentials: &str) -> Value {
    json!({
        "controlPlaneEndpoint": {"host": "10.0.0.10", "port": 6443},
        "dnsServers": ["10.0.0.2"],
        "ipv4Config": {"addresses": ["10.0.0.100-10.0.0.150"], "prefix": 24, "gateway": "10.0.0.1"},
        "credentialsRef": {"name": credentials},
        "zoneConfig": [{"zone": "rack-a", "nodes": ["pve1", "pve2"]}]
    })
}

/// A credentials Secret whose pinned fingerprint starts with a multi-byte character (the parser
/// once sliced it by byte position) is reported on its cluster; a cluster created after it still
/// becomes Ready, so the controllers kept running.
#[tokio::test]
async fn a_fingerprint_with_a_multibyte_character_is_reported_and_other_clusters_go_on() {
    let env = Env::start().await;
    let token = env.sim.token();
    let (id, secret) = token.split_once('=').expect("token id=secret");
    let hostile: Secret = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": "pinned", "namespace": "default"},
        "stringData": {
            // https, so the pin is read; nothing needs to listen there.
            "url": "https://127.0.0.1:9", "token": id, "secret": secret,
            "fingerprint": format!("€{}", "A".repeat(61)),
        }
    }))
    .expect("secret");
    Api::<Secret>::namespaced(env.client(), "default")
        .create(&PostParams::default(), &hostile)
        .await
        .expect("secret created");
    let uid = env.create_capi_cluster("pinned").await;
    env.create_proxmox_cluster("pinned", &uid, spec("pinned"))
        .await;
    env.run_controllers();
    let reported = env
        .wait_cluster("pinned", "the fingerprint reported", |c| {
            condition(c, "ProxmoxAvailable").is_some_and(|(status, _, message)| {
                status == "False" && message.contains("fingerprint")
            })
        })
        .await;
    let (_, reason, message) = condition(&reported, "ProxmoxAvailable").expect("condition");
    assert!(message.contains("32 bytes of hex"), "{reason}: {message}");

    env.create_credentials("demo-credentials", None).await;
    let uid = env.create_capi_cluster("demo").await;
    env.create_proxmox_cluster("demo", &uid, spec("demo-credentials"))
        .await;
    env.wait_cluster("demo", "Ready=True", |c: &ProxmoxCluster| {
        condition(c, "Ready").is_some_and(|(status, _, _)| status == "True")
    })
    .await;
}
