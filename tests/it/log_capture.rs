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

/// A whole lifecycle (credentials with a root CA, two machines with bootstrap data, deletion)
/// leaves no credential value and no bootstrap data in anything a user or a log pipeline can
/// read: logs (every level), events, conditions and messages of every object, metric labels.
#[tokio::test]
async fn no_secret_or_bootstrap_data_reaches_logs_events_conditions_or_metrics() {
    use capmox_sandbox::standin::{CapiStandIn, ExampleCluster, create_example_cluster};
    use k8s_openapi::api::core::v1::Secret as KubeSecret;
    use kube::api::{Api, DeleteParams, PostParams};
    use serde_json::json;

    let captured = logs::capture();
    let env = crate::common::env::Env::start().await;
    let token = env.sim.token();
    let (id, secret) = token.split_once('=').expect("token id=secret");
    let root_ca = std::fs::read_to_string(crate::common::data("tls/ca.pem")).expect("CA");
    let ca_line = root_ca
        .lines()
        .find(|l| !l.starts_with("-----") && l.len() > 40)
        .expect("a base64 line")
        .to_owned();
    let credentials: KubeSecret = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": "demo-proxmox-credentials", "namespace": "default"},
        "stringData": {"url": env.sim.url(), "token": id, "secret": secret, "root_ca": root_ca}
    }))
    .expect("secret");
    Api::<KubeSecret>::namespaced(env.client(), "default")
        .create(&PostParams::default(), &credentials)
        .await
        .expect("credentials");
    env.run_controllers();
    let stop = tokio_util::sync::CancellationToken::new();
    let _stop = stop.clone().drop_guard();
    CapiStandIn::spawn(env.client(), "default", stop.clone());
    let mut example = ExampleCluster::new(
        "default",
        "demo",
        capmox_sandbox::run::example_cluster_spec(),
        capmox_sandbox::run::example_machine_spec(),
    );
    example.control_plane_replicas = 1;
    example.worker_replicas = 1;
    example.worker_failure_domain = Some("rack-b".into());
    create_example_cluster(&env.client(), &example)
        .await
        .expect("example cluster");
    let machines: Api<capmox::api::ProxmoxMachine> = Api::namespaced(env.client(), "default");
    let wait = |done: fn(&[capmox::api::ProxmoxMachine]) -> bool| {
        let machines = machines.clone();
        async move {
            tokio::time::timeout(Duration::from_secs(60), async {
                loop {
                    let list = machines
                        .list(&Default::default())
                        .await
                        .expect("list")
                        .items;
                    if done(&list) {
                        return list;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            })
            .await
            .expect("in time")
        }
    };
    let ready = wait(|ms| ms.len() == 2 && ms.iter().all(|m| m.is_provisioned())).await;
    // A second cluster whose Secret has the whole `id=secret` pasted into `token`.
    let pasted: KubeSecret = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": "pasted", "namespace": "default"},
        "stringData": {"url": env.sim.url(), "token": token, "secret": secret}
    }))
    .expect("secret");
    Api::<KubeSecret>::namespaced(env.client(), "default")
        .create(&PostParams::default(), &pasted)
        .await
        .expect("pasted credentials");
    let uid = env.create_capi_cluster("pasted").await;
    let mut spec = capmox_sandbox::run::example_cluster_spec();
    spec["credentialsRef"] = json!({"name": "pasted"});
    env.create_proxmox_cluster("pasted", &uid, spec).await;
    env.wait_cluster("pasted", "CredentialsInvalid", |c| {
        crate::common::env::condition(c, "ProxmoxAvailable")
            .is_some_and(|(_, reason, _)| reason == "CredentialsInvalid")
    })
    .await;
    // What the machines were given to boot with.
    let bootstrap_line = "capi stand-in bootstrap for";
    let kinds = [
        "events.events.k8s.io",
        "proxmoxclusters",
        "clusters",
        "machines",
        "proxmoxmachines",
    ];
    let snapshot = |readable: &mut Vec<String>| {
        for kind in kinds {
            let objects = env.server.objects(kind).expect("a registered kind");
            readable.push(serde_json::to_string(&objects).expect("json"));
        }
    };
    let mut readable = vec![serde_json::to_string(&ready).expect("json")];
    snapshot(&mut readable);
    Api::<capmox::capi::Cluster>::namespaced(env.client(), "default")
        .delete("demo", &DeleteParams::default())
        .await
        .expect("deletion accepted");
    wait(|ms| ms.is_empty()).await;

    readable.push(captured.text());
    snapshot(&mut readable);
    readable.push(env.context.metrics.render());
    let everything = readable.join("\n");
    assert!(
        everything.contains("Provisioned"),
        "the scan saw the lifecycle"
    );
    for (what, value) in [
        ("token secret", secret),
        ("token as id=secret", token.as_str()),
        ("root CA", ca_line.as_str()),
        ("bootstrap data", bootstrap_line),
    ] {
        assert!(!everything.contains(value), "the {what} leaked");
    }
}
