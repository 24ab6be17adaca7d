//! The manager's probe and metrics endpoints, as a kubelet and Prometheus see them.

use std::net::SocketAddr;

use capmox::controller::{
    EndpointServer, GlobalCredentials, ManagerConfig, Metrics, Readiness, run,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

async fn get(address: SocketAddr, path: &str) -> (u16, String) {
    let mut stream = tokio::net::TcpStream::connect(address)
        .await
        .expect("connects");
    let request = format!("GET {path} HTTP/1.1\r\nHost: capmox\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.expect("sends");
    let mut response = String::new();
    stream.read_to_string(&mut response).await.expect("reads");
    let status = response
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .expect("status line");
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}

#[tokio::test]
async fn probes_and_metrics_answer() {
    let metrics = Metrics::new();
    let readiness = Readiness::default();
    let server = EndpointServer::bind(
        "127.0.0.1:0".parse().expect("addr"),
        metrics.clone(),
        readiness.clone(),
    )
    .await
    .expect("binds");
    let address = server.local_addr().expect("bound");
    let stop = CancellationToken::new();
    let serving = tokio::spawn(server.serve(stop.clone()));

    assert_eq!(get(address, "/healthz").await.0, 200);
    let (status, body) = get(address, "/readyz").await;
    assert_eq!(status, 503);
    assert!(body.contains("the manager is starting"), "{body}");
    readiness.set_standby(true);
    let (status, body) = get(address, "/readyz").await;
    assert_eq!(status, 200, "a follower waiting for the Lease is ready");
    assert!(body.contains("standing by"), "{body}");
    readiness.set_standby(false);
    readiness.set_leading(true);
    let (status, body) = get(address, "/readyz").await;
    assert_eq!(status, 503, "leading, but no controller has started");
    assert!(body.contains("controllers are starting"), "{body}");
    readiness.expect("proxmoxcluster");
    readiness.expect("proxmoxmachine");
    readiness.mark_synced("proxmoxmachine");
    let (status, body) = get(address, "/readyz").await;
    assert_eq!(status, 503);
    assert!(
        body.contains("caches are syncing for proxmoxcluster"),
        "{body}"
    );
    readiness.mark_synced("proxmoxcluster");
    assert_eq!(get(address, "/readyz").await.0, 200);

    metrics.reconciled("proxmoxcluster", std::time::Duration::from_millis(5), false);
    let (status, body) = get(address, "/metrics").await;
    assert_eq!(status, 200);
    assert!(
        body.contains(
            r#"controller_runtime_reconcile_total{controller="proxmoxcluster",result="success"} 1"#
        ),
        "{body}"
    );
    assert_eq!(get(address, "/nope").await.0, 404);

    stop.cancel();
    serving.await.expect("server stops when cancelled");
}

#[tokio::test]
async fn a_taken_port_fails_with_a_clear_error() {
    let taken = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("binds");
    let address = taken.local_addr().expect("bound");
    let error = EndpointServer::bind(address, Metrics::new(), Readiness::default())
        .await
        .err()
        .expect("second bind fails");
    assert!(
        error
            .to_string()
            .contains(&format!("cannot listen on {address}")),
        "{error}"
    );
}

fn assert_send<T: Send>(_: &T) {}

#[tokio::test]
async fn the_manager_future_can_be_spawned() {
    let config = ManagerConfig {
        metrics_address: "127.0.0.1:0".parse().expect("address"),
        health_address: "127.0.0.1:0".parse().expect("address"),
        leader_election: None,
        watch_namespace: None,
        watch_filter: None,
        cluster_concurrency: 1,
        machine_concurrency: 1,
        task_timing: Default::default(),
        zone_holds: Default::default(),
        proxmox_requests_in_flight: capmox::proxmox::DEFAULT_REQUESTS_IN_FLIGHT,
        webhook: Some(capmox::webhook::WebhookConfig {
            bind_address: "127.0.0.1:0".parse().expect("address"),
            cert_dir: "/nonexistent".into(),
        }),
    };
    let manager = run(
        capmox_testkit::ApiServer::new().client(),
        config,
        GlobalCredentials::default(),
        CancellationToken::new(),
    );
    assert_send(&manager);
}

/// A shutdown signal that arrives while the caches cannot fill (here RBAC forbids every list of
/// capmox's kinds) stops the manager promptly instead of leaving it waiting for a first list.
#[tokio::test]
async fn a_shutdown_before_the_caches_sync_stops_the_manager() {
    use capmox_testkit::{ApiServer, FaultKind};
    use std::time::Duration;

    let server = ApiServer::new();
    server.register_builtin_kinds();
    server.register_crd_dir("crds").expect("capmox CRDs");
    server
        .register_crd_dir(crate::common::data("external-crds"))
        .expect("upstream CRDs (tests/data/external-crds)");
    server.set_fault_hook(|request| {
        (request.group == "infrastructure.cluster.x-k8s.io" && request.verb == "list")
            .then_some(FaultKind::Forbidden)
    });
    let config = ManagerConfig {
        metrics_address: ([127, 0, 0, 1], 0).into(),
        health_address: ([127, 0, 0, 1], 0).into(),
        leader_election: None,
        watch_namespace: None,
        watch_filter: None,
        cluster_concurrency: 1,
        machine_concurrency: 1,
        task_timing: Default::default(),
        zone_holds: Default::default(),
        proxmox_requests_in_flight: capmox::proxmox::DEFAULT_REQUESTS_IN_FLIGHT,
        webhook: None,
    };
    let stop = CancellationToken::new();
    let manager = tokio::spawn(capmox::controller::run(
        server.client_named("capmox"),
        config,
        GlobalCredentials::default(),
        stop.clone(),
    ));
    // Wait until both reconcilers have been refused their first list.
    let refused = |plural: &str| {
        server
            .requests_by_client("capmox")
            .keys()
            .any(|r| r.resource == plural && r.verb == "list")
    };
    tokio::time::timeout(Duration::from_secs(30), async {
        while !(refused("proxmoxclusters") && refused("proxmoxmachines")) {
            tokio::task::yield_now().await;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the reconcilers tried to list");
    stop.cancel();
    tokio::time::timeout(Duration::from_secs(5), manager)
        .await
        .expect("the manager stops within 5 s of the signal")
        .expect("the manager task does not panic")
        .expect("the manager stops cleanly");
}
