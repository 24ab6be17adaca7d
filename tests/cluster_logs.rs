//! No Proxmox secret reaches the logs while the cluster controller works with right and wrong
//! credentials. Alone in its own test binary: tracing caches callsite interest process-wide.

mod common;

use std::io::Write;
use std::sync::{Arc, Mutex};

use common::env::{Env, condition};
use serde_json::json;

#[derive(Clone, Default)]
struct Buf(Arc<Mutex<Vec<u8>>>);

impl Write for Buf {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("lock").extend_from_slice(bytes);
        Ok(bytes.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test]
async fn secrets_never_reach_the_logs() {
    let buf = Buf::default();
    let writer = buf.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_writer(move || writer.clone())
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);

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

    let logs = String::from_utf8(buf.0.lock().expect("lock").clone()).expect("utf-8 logs");
    assert!(
        logs.contains("proxmoxcluster") || logs.contains("reconcil"),
        "the controller logged nothing:\n{logs}"
    );
    assert!(!logs.contains(wrong), "the wrong secret was logged");
    assert!(!logs.contains(&right), "the right secret was logged");
}
