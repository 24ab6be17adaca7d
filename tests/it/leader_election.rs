//! Two managers against one API server: only one leads; the other takes over when it stops.

use std::time::Duration;

use capmox::controller::{LeaderElectionConfig, leader};
use capmox_testkit::ApiServer;
use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(20);

fn config(identity: &str) -> LeaderElectionConfig {
    LeaderElectionConfig {
        name: "capmox-controller-leader".into(),
        namespace: "default".into(),
        identity: identity.into(),
        lease_duration: Duration::from_secs(3),
        renew_deadline: Duration::from_secs(2),
        retry_period: Duration::from_millis(100),
    }
}

struct Replica {
    leading: watch::Receiver<bool>,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<Result<(), capmox::controller::LeaderElectionError>>,
}

fn start(server: &ApiServer, identity: &str) -> Replica {
    let api: Api<Lease> = Api::namespaced(server.client(), "default");
    let (tx, leading) = watch::channel(false);
    let stop = CancellationToken::new();
    let task = tokio::spawn(leader::run(api, config(identity), tx, stop.clone()));
    Replica {
        leading,
        stop,
        task,
    }
}

async fn until(receiver: &mut watch::Receiver<bool>, value: bool) {
    tokio::time::timeout(WAIT, receiver.wait_for(|v| *v == value))
        .await
        .expect("state reached in time")
        .expect("election task alive");
}

// Paused time: the replicas' retry timers advance as soon as every task is idle, so the test
// observes many election rounds without waiting for them in real time.
#[tokio::test(start_paused = true)]
async fn one_leader_at_a_time_and_a_fast_takeover() {
    let server = ApiServer::new();
    server.register_builtin_kinds();
    let mut first = start(&server, "replica-a");
    until(&mut first.leading, true).await;
    let mut second = start(&server, "replica-b");
    // The follower keeps reading the lease: wait until it has done several rounds while the
    // first replica renews, then check it never led.
    let rounds_before = server.request_count();
    while server.request_count() < rounds_before + 20 {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(*first.leading.borrow());
    assert!(!*second.leading.borrow(), "two leaders at once");

    let lease: Lease = Api::namespaced(server.client(), "default")
        .get("capmox-controller-leader")
        .await
        .expect("lease exists");
    assert_eq!(
        lease.spec.and_then(|s| s.holder_identity).as_deref(),
        Some("replica-a")
    );

    first.stop.cancel();
    first
        .task
        .await
        .expect("joins")
        .expect("clean stop releases the lease");
    until(&mut second.leading, true).await;
    let lease: Lease = Api::namespaced(server.client(), "default")
        .get("capmox-controller-leader")
        .await
        .expect("lease exists");
    let spec = lease.spec.expect("spec");
    assert_eq!(spec.holder_identity.as_deref(), Some("replica-b"));
    assert_eq!(spec.lease_transitions, Some(1));
    second.stop.cancel();
    second.task.await.expect("joins").expect("clean stop");
}

#[tokio::test]
async fn a_leader_that_cannot_renew_steps_down() {
    let server = ApiServer::new();
    server.register_builtin_kinds();
    let mut replica = start(&server, "replica-a");
    until(&mut replica.leading, true).await;
    // Another writer takes the lease (as a replica whose clock says ours expired would).
    let api: Api<Lease> = Api::namespaced(server.client(), "default");
    let mut lease = api.get("capmox-controller-leader").await.expect("lease");
    if let Some(spec) = lease.spec.as_mut() {
        spec.holder_identity = Some("intruder".into());
        spec.lease_duration_seconds = Some(30);
        spec.renew_time = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime(
            k8s_openapi::jiff::Timestamp::now(),
        ));
    }
    api.replace("capmox-controller-leader", &Default::default(), &lease)
        .await
        .expect("intruder writes");
    until(&mut replica.leading, false).await;
    let result = tokio::time::timeout(WAIT, replica.task)
        .await
        .expect("ends")
        .expect("joins");
    let error = result.expect_err("losing the lease is an error");
    assert!(
        error
            .to_string()
            .contains("another replica holds the lease"),
        "{error}"
    );
}

// Paused time: the hung Lease calls and the deadline run on the virtual clock, so the test
// checks exactly when leadership ends without waiting for it.
#[tokio::test(start_paused = true)]
async fn a_leader_whose_lease_calls_hang_steps_down_within_the_renew_deadline() {
    use capmox_testkit::FaultKind;
    let server = ApiServer::new();
    server.register_builtin_kinds();
    let mut replica = start(&server, "replica-a");
    until(&mut replica.leading, true).await;
    // From now on every Lease request hangs for a minute (then succeeds): a stalled API server.
    let hung_at = tokio::time::Instant::now();
    server.set_fault_hook(|request| {
        (request.resource == "leases").then_some(FaultKind::Delay(Duration::from_secs(60)))
    });
    until(&mut replica.leading, false).await;
    let stepped_down_after = hung_at.elapsed();
    let renew_deadline = config("replica-a").renew_deadline;
    assert!(
        stepped_down_after <= renew_deadline,
        "leadership must end within the renew deadline ({renew_deadline:?}) of the last renewal, \
         ended {stepped_down_after:?} after the API server stalled"
    );
    let result = tokio::time::timeout(WAIT, replica.task)
        .await
        .expect("ends")
        .expect("joins");
    let error = result.expect_err("losing the lease is an error");
    assert!(error.to_string().contains("renew deadline"), "{error}");
}

/// A leader whose API server stalls steps down within its renew deadline, and the reconcile it
/// has in flight (waiting for a slow Proxmox task after the clone) sends Proxmox no further
/// write: the replica that leads next may already be acting on the same VM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_losing_the_lease_no_proxmox_write_follows() {
    use crate::machine_support::scenario::{Scenario, sim_options};
    use capmox::controller::{GlobalCredentials, ManagerConfig};
    use capmox_testkit::FaultKind;

    let mut scenario = Scenario::start(capmox_sim::SimOptions {
        task_duration: Duration::from_secs(3),
        ..sim_options()
    })
    .await;
    // The manager itself (with leader election) instead of bare reconcilers.
    scenario.stop_controllers().await;
    let config = ManagerConfig {
        metrics_address: ([127, 0, 0, 1], 0).into(),
        health_address: ([127, 0, 0, 1], 0).into(),
        leader_election: Some(LeaderElectionConfig {
            name: "capmox-controller-leader".into(),
            namespace: "default".into(),
            identity: "stalled-leader".into(),
            lease_duration: Duration::from_secs(2),
            renew_deadline: Duration::from_secs(1),
            retry_period: Duration::from_millis(100),
        }),
        watch_namespace: None,
        watch_filter: None,
        cluster_concurrency: 1,
        machine_concurrency: 2,
        task_timing: Default::default(),
        zone_holds: Default::default(),
        proxmox_requests_in_flight: capmox::proxmox::DEFAULT_REQUESTS_IN_FLIGHT,
        webhook: None,
    };
    let stop = CancellationToken::new();
    let manager = tokio::spawn(capmox::controller::run(
        scenario.env.client(),
        config,
        GlobalCredentials::default(),
        stop.clone(),
    ));
    scenario.create("fenced").await;
    // Past the clone and the config, the machine waits for its disk resize, a task that runs
    // for seconds.
    scenario
        .env
        .wait_machine("fenced", "a resize in flight", |m| {
            m.status
                .as_ref()
                .and_then(|s| s.task_ref.as_deref())
                .is_some_and(|upid| upid.contains(":resize:"))
        })
        .await;
    // The API server now stalls every Lease request.
    let writes_before = scenario.tap.mutating();
    scenario.env.server.set_fault_hook(|request| {
        (request.resource == "leases").then_some(FaultKind::Delay(Duration::from_secs(60)))
    });
    let ended = tokio::time::timeout(WAIT, manager)
        .await
        .expect("the manager ends once leadership is lost")
        .expect("no panic");
    let error = ended.expect_err("losing the lease is an error");
    assert!(error.to_string().contains("renew deadline"), "{error}");
    let writes: Vec<_> = scenario
        .tap
        .log()
        .into_iter()
        .filter(|seen| seen.method != "GET")
        .map(|seen| format!("{} {}", seen.method, seen.path))
        .collect();
    assert_eq!(
        scenario.tap.mutating(),
        writes_before,
        "Proxmox writes after leadership was lost: {writes:?}"
    );
    stop.cancel();
}

/// Creates the lease held by `holder`, whose wall clock runs `skew` behind the follower's, and
/// returns the task that renews it every `period` until `stop`.
async fn hold_with_a_late_clock(
    server: &ApiServer,
    holder: &str,
    skew: Duration,
    period: Duration,
    stop: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    use k8s_openapi::api::coordination::v1::LeaseSpec;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
    use k8s_openapi::jiff::{SignedDuration, Timestamp};
    let api: Api<Lease> = Api::namespaced(server.client(), "default");
    let late_now = move || {
        let skew = SignedDuration::try_from(skew).expect("small skew");
        MicroTime(Timestamp::now().checked_sub(skew).expect("in range"))
    };
    let mut lease = Lease {
        metadata: kube::api::ObjectMeta {
            name: Some("capmox-controller-leader".into()),
            ..Default::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some(holder.into()),
            lease_duration_seconds: Some(3),
            acquire_time: Some(late_now()),
            renew_time: Some(late_now()),
            lease_transitions: Some(0),
            ..LeaseSpec::default()
        }),
    };
    lease = api
        .create(&Default::default(), &lease)
        .await
        .expect("creates");
    tokio::spawn(async move {
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(period) => {}
            }
            if let Some(spec) = lease.spec.as_mut() {
                spec.renew_time = Some(late_now());
            }
            lease = api
                .replace("capmox-controller-leader", &Default::default(), &lease)
                .await
                .expect("the holder renews");
        }
    })
}

// Paused time: the follower's rounds and the holder's renewals run on the virtual clock, while
// the renewTime written is the (real) wall clock minus the skew.
#[tokio::test(start_paused = true)]
async fn a_follower_does_not_take_over_a_renewed_lease_whose_holder_clock_is_late() {
    let server = ApiServer::new();
    server.register_builtin_kinds();
    let holder_stop = CancellationToken::new();
    let holder = hold_with_a_late_clock(
        &server,
        "late-holder",
        Duration::from_secs(13),
        Duration::from_millis(500),
        holder_stop.clone(),
    )
    .await;
    let mut follower = start(&server, "replica-b");
    // The holder's renewTime is always 13 s old by the follower's clock (more than the 3 s
    // lease), yet it keeps renewing: over 60 virtual seconds the follower never leads.
    let took_over =
        tokio::time::timeout(Duration::from_secs(60), follower.leading.wait_for(|v| *v))
            .await
            .is_ok();
    assert!(
        !took_over,
        "the follower took over a lease its holder kept renewing"
    );
    // Once the holder stops, the follower waits one lease duration on its own clock.
    holder_stop.cancel();
    holder.await.expect("holder joins");
    let stopped_at = tokio::time::Instant::now();
    until(&mut follower.leading, true).await;
    let waited = stopped_at.elapsed();
    assert!(
        waited >= Duration::from_millis(2500) && waited <= Duration::from_secs(4),
        "took over {waited:?} after the last renewal; the lease lasts 3 s"
    );
    follower.stop.cancel();
    follower.task.await.expect("joins").expect("clean stop");
}
