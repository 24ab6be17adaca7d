//! No Proxmox secret reaches the logs while the cluster controller works with right and wrong
//! credentials. The logs are captured per thread with `crate::common::logs`, which stays correct while
//! other tests log in the same process.

use crate::common::env::{Env, condition};
use crate::common::logs;
use serde_json::json;

#[tokio::test]
async fn secrets_never_reach_the_logs() {
    let captured = logs::capture();

    let env = Env::start().await;
    let wrong = "00000000-0000-4000-8000-00000000beef";
    let token = env.sim.token();
    let right = token.split_once('=').expect("id=secret").1.to_owned();
    env.create_credentials("good", None).await;
    env.create_credentials("bad", Some(wrong)).await;
    for (name, secret) in [("good-cluster", "good"), ("bad-cluster", "bad")] {
        let uid = env.create_capi_cluster(name).await;
        env.create_proxmox_cluster(
            name,
            &uid,
            json!({
                "controlPlaneEndpoint": {"host": "10.0.0.10", "port": 6443},
                "dnsServers": ["10.0.0.2"],
                "ipv4Config": {"addresses": ["10.0.0.100-10.0.0.150"], "prefix": 24, "gateway": "10.0.0.1"},
                "credentialsRef": {"name": secret}
            }),
        )
        .await;
    }
    env.run_controllers();
    env.wait_cluster("good-cluster", "Ready", |c| {
        condition(c, "Ready").is_some_and(|c| c.0 == "True")
    })
    .await;
    env.wait_cluster("bad-cluster", "Unauthorized", |c| {
        condition(c, "ProxmoxAvailable").is_some_and(|c| c.1 == "Unauthorized")
    })
    .await;
    drop(env);

    let logs = captured.text();
    assert!(
        logs.contains("proxmoxcluster") || logs.contains("reconcil"),
        "the controller logged nothing:\n{logs}"
    );
    assert!(!logs.contains(wrong), "the wrong secret was logged");
    assert!(!logs.contains(&right), "the right secret was logged");
}
