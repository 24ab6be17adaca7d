//! The simulator's profiles over real HTTP: the realistic profile's API workers queue what
//! they cannot serve and tasks record their request and storage locks; the ideal profile
//! records none of it.

use std::time::Duration;

use capmox::proxmox::*;

use super::api::client_for;
use capmox_sim::{
    LogNormal, Profile, ProfileName, RealisticProfile, SimOptions, Simulator, TaskRecord, Topology,
};

fn waits() -> WaitOptions {
    WaitOptions {
        initial_interval: Duration::from_millis(20),
        factor: 1.5,
        max_interval: Duration::from_millis(200),
        deadline: Duration::from_secs(30),
    }
}

fn realistic(profile: RealisticProfile) -> SimOptions {
    SimOptions {
        profile: Profile::Realistic(Box::new(profile)),
        ..SimOptions::default()
    }
}

/// With one worker per daemon and reads that take 400 ms, the second of two reads sent at once
/// to the entry node waits for the worker (capmox's client sends at most two to a daemon at
/// once); a read on another node, sent with them, does not.
#[tokio::test]
async fn a_node_queues_the_requests_beyond_its_workers() {
    let hold = Duration::from_millis(400);
    let sim = Simulator::start(
        Topology::example(),
        realistic(RealisticProfile {
            api_workers: 1,
            read_latency: LogNormal {
                median: hold,
                sigma: 0.0,
            },
            ..RealisticProfile::default()
        }),
    )
    .await
    .expect("simulator");
    let client = client_for(&sim);
    let (a, b, other) = tokio::join!(
        client.version(),
        client.version(),
        client.node_status("pve2"),
    );
    for answer in [a.map(|_| ()), b.map(|_| ()), other.map(|_| ())] {
        answer.expect("served");
    }
    let log = sim.request_log();
    let mut waits: Vec<Duration> = log
        .iter()
        .filter(|r| r.endpoint == "GET /version")
        .map(|r| {
            let timing = r
                .timing
                .as_ref()
                .expect("timed under the realistic profile");
            assert_eq!(
                timing.pool, "pve1/pveproxy",
                "the entry node serves /version"
            );
            assert!(timing.served() >= hold);
            timing.queued()
        })
        .collect();
    waits.sort();
    assert_eq!(waits.len(), 2);
    assert!(
        waits[0] < hold / 2 && waits[1] >= hold / 2,
        "exactly one waits for the worker: {waits:?}"
    );
    let on_pve2 = log
        .iter()
        .find(|r| r.endpoint == "GET /nodes/{node}/status")
        .and_then(|r| r.timing.clone())
        .expect("timed");
    assert_eq!(on_pve2.pool, "pve2/pveproxy");
    assert!(on_pve2.queued() < hold / 2, "{on_pve2:?}");
    let counters = &sim.counters()["GET /version"];
    assert_eq!(counters.queued, waits.iter().sum::<Duration>());
    assert!(counters.served >= hold * 2);
}

/// Clones two VMs of the local-storage template at once and returns their task records,
/// oldest first.
async fn two_clones(sim: &Simulator) -> Vec<TaskRecord> {
    let client = client_for(sim);
    let clone = |newid: u32| {
        let client = client.clone();
        async move {
            let params = CloneParams {
                newid,
                ..Default::default()
            };
            let upid = client.clone_vm("pve1", 9000, &params).await.expect("clone");
            client.wait_task(&upid, &waits()).await.expect("clone task");
        }
    };
    tokio::join!(clone(100), clone(101));
    sim.task_records()
}

/// Under the realistic profile a task records the request that created it (served by the
/// node's pvedaemon) and its storage lock; the two clones' allocations on one node's local
/// storage happen one after the other, and the same seed draws the same clone durations on
/// another simulator.
#[tokio::test]
async fn realistic_tasks_record_their_request_and_storage_locks() {
    let opts = || {
        let mut opts = realistic(RealisticProfile {
            seed: 42,
            ..RealisticProfile::default()
        });
        opts.clone_duration = Duration::from_millis(600);
        opts
    };
    let sim = Simulator::start(Topology::example(), opts())
        .await
        .expect("simulator");
    let records = two_clones(&sim).await;
    assert_eq!(records.len(), 2);
    for r in &records {
        let request = r.request.as_ref().expect("created by a request");
        assert_eq!(request.pool, "pve1/pvedaemon");
        assert!(request.ended <= r.created);
        assert_eq!(r.storage_locks.len(), 1);
        assert_eq!(r.storage_locks[0].lock, "local-lvm@pve1");
    }
    let mut holds: Vec<_> = records.iter().map(|r| r.storage_locks[0].clone()).collect();
    holds.sort_by_key(|h| h.acquired);
    assert!(
        holds[1].acquired >= holds[0].released,
        "one allocation at a time: {holds:?}"
    );
    let drawn = |records: &[TaskRecord]| {
        let mut runs: Vec<(Option<u32>, Duration)> = records
            .iter()
            .map(|r| {
                let waited: Duration = r.storage_locks.iter().map(|h| h.wait()).sum();
                (
                    r.vmid,
                    r.ended.expect("ended") - r.started.expect("started") - waited,
                )
            })
            .collect();
        runs.sort();
        runs
    };
    let again = Simulator::start(Topology::example(), opts())
        .await
        .expect("simulator");
    assert_eq!(drawn(&records), drawn(&two_clones(&again).await));
}

/// The ideal profile, the default, times nothing: no request timings in the log or the
/// counters, no request or lock on the tasks, tasks run their configured duration.
#[tokio::test]
async fn the_ideal_profile_records_no_timing() {
    let opts = SimOptions {
        clone_duration: Duration::from_millis(100),
        ..SimOptions::default()
    };
    assert_eq!(opts.profile.name(), ProfileName::Ideal);
    let sim = Simulator::start(Topology::example(), opts)
        .await
        .expect("simulator");
    let records = two_clones(&sim).await;
    assert!(records.iter().all(|r| {
        r.request.is_none()
            && r.storage_locks.is_empty()
            && r.ended.zip(r.started).map(|(e, s)| e - s) == Some(Duration::from_millis(100))
    }));
    assert!(sim.request_log().iter().all(|r| r.timing.is_none()));
    assert!(
        sim.counters()
            .values()
            .all(|c| c.queued.is_zero() && c.served.is_zero())
    );
}
