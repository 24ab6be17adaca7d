//! `--watch-filter`: two managers on one API server, each started from its own command line
//! with its own filter value, reconcile only the clusters labelled with it and elect their
//! leaders through separate Leases.

use capmox::api::labels::WATCH_FILTER;
use capmox::api::{ProxmoxCluster, ProxmoxMachine};
use capmox::cli::{Cli, Command};
use capmox::controller::GlobalCredentials;
use capmox_sandbox::run::{example_cluster_spec, example_machine_spec};
use capmox_sandbox::standin::{CapiStandIn, ExampleCluster, create_example_cluster};
use clap::Parser;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Secret;
use kube::ResourceExt;
use kube::api::{Api, PostParams};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::common::env::{ENV_WAIT, Env};
use crate::machine_support::scenario::sim_options;

/// The manager `capmox run --leader-elect --watch-filter <shard>` starts, as a task.
fn start_manager(env: &Env, shard: &str, stop: &CancellationToken) {
    let cli = Cli::try_parse_from([
        "capmox",
        "run",
        "--leader-elect",
        "--leader-election-namespace",
        "default",
        "--leader-elect-lease-duration",
        "3s",
        "--leader-elect-renew-deadline",
        "2s",
        "--leader-elect-retry-period",
        "200ms",
        "--watch-filter",
        shard,
        "--metrics-bind-address",
        "127.0.0.1:0",
        "--health-probe-bind-address",
        "127.0.0.1:0",
        "--disable-webhook",
    ])
    .expect("valid command line");
    let Command::Run(args) = cli.command else {
        panic!("parsed as run");
    };
    let config = args.manager_config(format!("{shard}-replica"));
    tokio::spawn(capmox::controller::run(
        env.server.client_named(shard),
        config,
        GlobalCredentials::default(),
        stop.child_token(),
    ));
}

/// Machines of `cluster` that are provisioned, in `machines`.
fn provisioned(machines: &[std::sync::Arc<ProxmoxMachine>], cluster: &str) -> usize {
    machines
        .iter()
        .filter(|m| {
            m.labels()
                .get(capmox::api::labels::CLUSTER_NAME)
                .map(String::as_str)
                == Some(cluster)
                && m.is_provisioned()
        })
        .count()
}

/// Waits, on a watch, until `expected` machines of `cluster` are provisioned.
async fn wait_provisioned(env: &Env, cluster: &str, expected: usize) {
    use futures::StreamExt;
    use kube::runtime::{WatchStreamExt, reflector, watcher};
    let api = Api::<ProxmoxMachine>::namespaced(env.client(), "default");
    let (reader, writer) = reflector::store();
    let mut events = reflector(writer, watcher(api, watcher::Config::default()))
        .touched_objects()
        .boxed();
    let wait = async {
        loop {
            if provisioned(&reader.state(), cluster) == expected {
                return;
            }
            events
                .next()
                .await
                .expect("the watch goes on")
                .expect("watch");
        }
    };
    tokio::time::timeout(ENV_WAIT * 2, wait)
        .await
        .unwrap_or_else(|_| panic!("{cluster}: {expected} machines not provisioned in time"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_managers_with_different_watch_filters_each_reconcile_only_their_share() {
    let env = Env::start_with(sim_options()).await;
    env.run_ipam();
    CapiStandIn::spawn(env.client(), "default", env.stop.clone());
    let token = env.sim.token();
    let (id, secret) = token.split_once('=').expect("token id=secret");
    let credentials: Secret = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": "demo-proxmox-credentials", "namespace": "default"},
        "stringData": {"url": env.sim.url(), "token": id, "secret": secret}
    }))
    .expect("secret");
    Api::<Secret>::namespaced(env.client(), "default")
        .create(&PostParams::default(), &credentials)
        .await
        .expect("credentials");
    for (cluster, shard) in [("alpha", "shard-a"), ("beta", "shard-b")] {
        let mut example = ExampleCluster::new(
            "default",
            cluster,
            example_cluster_spec(),
            example_machine_spec(),
        );
        example.worker_replicas = 1;
        example.worker_failure_domain = Some("rack-b".into());
        // As a user shards a cluster: the label on every object of the cluster and in the
        // machine templates of its control plane and deployment, so it reaches every machine.
        example.labels.insert(WATCH_FILTER.into(), shard.into());
        create_example_cluster(&env.client(), &example)
            .await
            .expect("example cluster");
    }

    // Shard A alone: alpha is provisioned, beta is not even looked at.
    let stop = env.stop.child_token();
    start_manager(&env, "shard-a", &stop);
    wait_provisioned(&env, "alpha", 2).await;
    let beta = Api::<ProxmoxCluster>::namespaced(env.client(), "default")
        .get("beta")
        .await
        .expect("beta");
    assert!(
        beta.finalizers().is_empty() && beta.status.is_none(),
        "shard-a touched beta's ProxmoxCluster: {beta:#?}"
    );
    let untouched = Api::<ProxmoxMachine>::namespaced(env.client(), "default")
        .list(&Default::default())
        .await
        .expect("list")
        .items
        .into_iter()
        .filter(|m| m.labels().get(WATCH_FILTER).map(String::as_str) == Some("shard-b"))
        .collect::<Vec<_>>();
    // (The CAPI stand-in, like KCP, makes beta's machines only once beta's infrastructure is
    // provisioned, which needs shard B.)
    for machine in &untouched {
        assert!(
            machine.finalizers().is_empty() && machine.status.is_none(),
            "shard-a touched {}",
            machine.name_any()
        );
    }

    // Shard B: beta too, while shard A keeps leading its own Lease.
    start_manager(&env, "shard-b", &stop);
    wait_provisioned(&env, "beta", 2).await;
    let leases = Api::<Lease>::namespaced(env.client(), "default");
    for (lease, holder) in [
        ("capmox-controller-leader-shard-a", "shard-a-replica"),
        ("capmox-controller-leader-shard-b", "shard-b-replica"),
    ] {
        let lease = leases.get(lease).await.expect("one Lease per shard");
        assert_eq!(
            lease.spec.and_then(|s| s.holder_identity).as_deref(),
            Some(holder)
        );
    }
    let machines = Api::<ProxmoxMachine>::namespaced(env.client(), "default")
        .list(&Default::default())
        .await
        .expect("list")
        .items
        .into_iter()
        .map(std::sync::Arc::new)
        .collect::<Vec<_>>();
    assert_eq!(provisioned(&machines, "alpha"), 2);
    stop.cancel();
}
