//! Log capture tests: nothing secret is logged, and insecure TLS is. The logs are captured per
//! thread with `crate::common::logs`, which stays correct while other tests log in the same process.

use std::time::Duration;

use capmox::proxmox::*;
use capmox_sim::{SimOptions, Simulator, Topology};

use crate::common::logs;

fn client_for(sim: &Simulator) -> ProxmoxClient {
    let mut cfg = ClientConfig::new(sim.url(), ApiToken::parse(&sim.token()).expect("token"));
    cfg.retry.base_delay = Duration::from_millis(10);
    ProxmoxClient::new(&cfg).expect("client")
}

#[tokio::test]
async fn secret_never_logged() {
    let captured = logs::capture();

    let sim = Simulator::start(Topology::example(), SimOptions::default())
        .await
        .expect("sim");
    let secret = sim.token().rsplit_once('=').expect("token").1.to_string();
    let client = client_for(&sim);
    client.version().await.expect("ok");
    let _ = client.vm_config("pve1", 4242).await.expect_err("missing");
    let mut bad_cfg = ClientConfig::new(
        sim.url(),
        ApiToken::new("root@pam!capmox", Secret::new(format!("{secret}-x"))).expect("token"),
    );
    bad_cfg.retry.max_attempts = 1;
    let bad = ProxmoxClient::new(&bad_cfg).expect("client");
    let err = bad.version().await.expect_err("401");
    tracing::info!(error = %err, error_debug = ?err, client = ?client, config = ?bad_cfg, "after calls");
    let logs = captured.text();
    assert!(logs.contains("after calls"), "logs captured");
    assert!(
        logs.contains("Proxmox request failed"),
        "client debug logs captured"
    );
    assert!(!logs.contains(&secret), "secret leaked into logs");
}

#[test]
fn insecure_tls_logs_a_warning() {
    let captured = logs::capture();
    let mut cfg = ClientConfig::new(
        "https://127.0.0.1:8006",
        ApiToken::parse("root@pam!capi=s3cr3t-value").expect("token"),
    );
    cfg.tls.insecure = true;
    ProxmoxClient::new(&cfg).expect("client");
    let logs = captured.text();
    assert!(
        logs.contains("WARN") && logs.contains("verification for Proxmox VE is DISABLED"),
        "insecure mode must log a warning: {logs}"
    );
    assert!(!logs.contains("s3cr3t-value"));
}
