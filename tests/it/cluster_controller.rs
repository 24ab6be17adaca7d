//! The ProxmoxCluster reconciler against the in-process Kubernetes API and the Proxmox simulator.

use crate::common::env::{Env, condition};
use capmox::api::{FailureDomain, ProxmoxCluster, ProxmoxMachine};
use capmox::capi::InClusterIPPool;
use k8s_openapi::api::core::v1::Secret;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

fn zoned_spec() -> Value {
    json!({
        "controlPlaneEndpoint": {"host": "10.0.0.10", "port": 6443},
        "dnsServers": ["10.0.0.2"],
        "ipv4Config": {"addresses": ["10.0.0.100-10.0.0.150"], "prefix": 24, "gateway": "10.0.0.1"},
        "credentialsRef": {"name": "demo-credentials"},
        "zoneConfig": [
            {"zone": "rack-a", "nodes": ["pve1", "pve2"],
             "ipv4Config": {"addresses": ["10.0.1.10-10.0.1.50"], "prefix": 24, "gateway": "10.0.1.1"}},
            {"zone": "rack-b", "nodes": ["pve3", "pve4"], "controlPlaneEligible": false},
            {"zone": "storage", "ipv4Config": {"addresses": ["10.0.9.0/28"], "prefix": 24, "gateway": "10.0.9.1", "metric": 200}}
        ]
    })
}

fn domain(name: &str, control_plane: bool) -> FailureDomain {
    FailureDomain {
        name: name.into(),
        control_plane: Some(control_plane),
        attributes: Default::default(),
    }
}

fn is_true(cluster: &ProxmoxCluster, type_: &str) -> bool {
    condition(cluster, type_).is_some_and(|(status, _, _)| status == "True")
}

async fn provisioned_env() -> Env {
    let env = Env::start().await;
    env.create_credentials("demo-credentials", None).await;
    let uid = env.create_capi_cluster("demo").await;
    env.create_proxmox_cluster("demo", &uid, zoned_spec()).await;
    env.run_controllers();
    env
}

#[tokio::test]
async fn zones_become_failure_domains_and_pools() {
    let env = provisioned_env().await;
    let cluster = env
        .wait_cluster("demo", "Ready=True", |c| is_true(c, "Ready"))
        .await;
    let status = cluster.status.clone().expect("status");
    assert_eq!(
        status.failure_domains,
        [domain("rack-a", true), domain("rack-b", false)]
    );
    assert_eq!(
        status.initialization.and_then(|i| i.provisioned),
        Some(true)
    );
    assert!(is_true(&cluster, "ProxmoxAvailable"));
    assert!(is_true(&cluster, "FailureDomainsReady"));
    assert_eq!(
        condition(&cluster, "Paused").map(|c| c.0).as_deref(),
        Some("False")
    );
    assert!(
        cluster
            .finalizers()
            .contains(&"proxmoxcluster.infrastructure.cluster.x-k8s.io".to_owned())
    );

    // One pool per family for the cluster and for each zone with its own IP config.
    let pool_names: Vec<String> = status
        .in_cluster_ip_pool_ref
        .iter()
        .map(|p| p.name.clone())
        .collect();
    assert_eq!(
        pool_names,
        [
            "demo-v4-icip",
            "demo-rack-a-v4-icip",
            "demo-storage-v4-icip"
        ]
    );
    let zones: Vec<(String, Option<String>)> = status
        .in_cluster_zone_ref
        .iter()
        .map(|z| {
            (
                z.zone.clone(),
                z.in_cluster_ip_pool_ref_v4.as_ref().map(|p| p.name.clone()),
            )
        })
        .collect();
    assert_eq!(
        zones,
        [
            ("default".to_owned(), Some("demo-v4-icip".to_owned())),
            ("rack-a".to_owned(), Some("demo-rack-a-v4-icip".to_owned())),
            (
                "storage".to_owned(),
                Some("demo-storage-v4-icip".to_owned())
            ),
        ]
    );
    let pools = Api::<InClusterIPPool>::namespaced(env.client(), "default");
    let storage = pools
        .get("demo-storage-v4-icip")
        .await
        .expect("zone pool exists");
    assert_eq!(storage.spec.pool.addresses, ["10.0.9.0/28"]);
    assert_eq!(
        storage
            .labels()
            .get("topology.kubernetes.io/proxmox-zone")
            .map(String::as_str),
        Some("storage")
    );
    assert_eq!(
        storage
            .annotations()
            .get("ipam.capmox.cluster.x-k8s.io/ip-family")
            .map(String::as_str),
        Some("ipv4")
    );
    assert_eq!(
        storage
            .annotations()
            .get("ipam.capmox.cluster.x-k8s.io/gateway-metric")
            .map(String::as_str),
        Some("200")
    );
    let owner = &storage.owner_references()[0];
    assert_eq!(
        (owner.kind.as_str(), owner.controller),
        ("ProxmoxCluster", Some(true))
    );

    // Proxmox calls and reconciles are exposed as metrics.
    let metrics = env.context.metrics.render();
    assert!(
        metrics.contains("capmox_proxmox_api_requests_total{endpoint=\"GET /version\"}"),
        "{metrics}"
    );
    assert!(
        metrics.contains(
            "controller_runtime_reconcile_total{controller=\"proxmoxcluster\",result=\"success\"}"
        ),
        "{metrics}"
    );
    assert!(metrics.trim_end().ends_with("# EOF"), "{metrics}");

    // The credentials Secret is held by the cluster.
    let secret = Api::<Secret>::namespaced(env.client(), "default")
        .get("demo-credentials")
        .await
        .expect("secret");
    assert!(
        secret
            .finalizers()
            .contains(&"proxmoxcluster.infrastructure.cluster.x-k8s.io/secret".to_owned())
    );
    assert!(
        secret
            .owner_references()
            .iter()
            .any(|o| o.kind == "ProxmoxCluster" && o.name == "demo")
    );
}

async fn patch_spec(env: &Env, spec: Value) {
    Api::<ProxmoxCluster>::namespaced(env.client(), "default")
        .patch(
            "demo",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": spec})),
        )
        .await
        .expect("spec patched");
}

#[tokio::test]
async fn zone_edits_update_failure_domains_and_bad_edits_keep_the_last_good_ones() {
    let env = provisioned_env().await;
    env.wait_cluster("demo", "Ready=True", |c| is_true(c, "Ready"))
        .await;

    let mut spec = zoned_spec();
    spec["zoneConfig"][2]["nodes"] = json!(["pve5"]);
    spec["zoneConfig"].as_array_mut().expect("zones").remove(0);
    patch_spec(&env, json!({"zoneConfig": spec["zoneConfig"]})).await;
    let cluster = env
        .wait_cluster("demo", "rack-a removed, storage published", |c| {
            c.status.as_ref().is_some_and(|s| {
                s.failure_domains == [domain("rack-b", false), domain("storage", true)]
            })
        })
        .await;
    // The removed zone's pool goes away.
    let pools = Api::<InClusterIPPool>::namespaced(env.client(), "default");
    assert!(
        pools
            .get_opt("demo-rack-a-v4-icip")
            .await
            .expect("get")
            .is_none()
    );
    assert!(is_true(&cluster, "Ready"));

    // pve3 in two zones: reported, and the last good failure domains stay.
    spec["zoneConfig"][1]["nodes"] = json!(["pve5", "pve3"]);
    patch_spec(&env, json!({"zoneConfig": spec["zoneConfig"]})).await;
    let cluster = env
        .wait_cluster("demo", "FailureDomainsReady=False", |c| {
            condition(c, "FailureDomainsReady").is_some_and(|(status, _, _)| status == "False")
        })
        .await;
    let (_, reason, message) = condition(&cluster, "FailureDomainsReady").expect("condition");
    assert_eq!(reason, "InvalidZoneConfig");
    assert!(
        message.contains("\"pve3\"") && message.contains("rack-b") && message.contains("storage"),
        "{message}"
    );
    assert_eq!(
        condition(&cluster, "Ready").map(|c| c.1).as_deref(),
        Some("InvalidZoneConfig")
    );
    assert_eq!(
        cluster.status.expect("status").failure_domains,
        [domain("rack-b", false), domain("storage", true)]
    );

    // A node Proxmox does not know is named.
    spec["zoneConfig"][1]["nodes"] = json!(["pve5", "pve9"]);
    patch_spec(&env, json!({"zoneConfig": spec["zoneConfig"]})).await;
    let cluster = env
        .wait_cluster("demo", "UnknownNode", |c| {
            condition(c, "FailureDomainsReady")
                .is_some_and(|(_, reason, _)| reason == "UnknownNode")
        })
        .await;
    let (_, _, message) = condition(&cluster, "FailureDomainsReady").expect("condition");
    assert!(message.contains("\"pve9\""), "{message}");
}

#[tokio::test]
async fn a_wrong_token_is_reported_without_revealing_it() {
    let env = Env::start().await;
    let wrong = "00000000-0000-4000-8000-00000000dead";
    env.create_credentials("demo-credentials", Some(wrong))
        .await;
    let uid = env.create_capi_cluster("demo").await;
    env.create_proxmox_cluster("demo", &uid, zoned_spec()).await;
    env.run_controllers();
    let cluster = env
        .wait_cluster("demo", "ProxmoxAvailable=False", |c| {
            condition(c, "ProxmoxAvailable").is_some_and(|(status, _, _)| status == "False")
        })
        .await;
    let (_, reason, message) = condition(&cluster, "ProxmoxAvailable").expect("condition");
    assert_eq!(reason, "Unauthorized");
    assert!(message.contains("check the API token"), "{message}");
    let status = serde_json::to_string(&cluster.status).expect("json");
    assert!(
        !status.contains(wrong),
        "the token secret leaked into the status"
    );
    assert_eq!(
        cluster.status.and_then(|s| s.initialization),
        None,
        "not provisioned without Proxmox"
    );
}

#[tokio::test]
async fn missing_credentials_are_reported() {
    let env = Env::start().await;
    let uid = env.create_capi_cluster("demo").await;
    env.create_proxmox_cluster("demo", &uid, zoned_spec()).await;
    env.run_controllers();
    let cluster = env
        .wait_cluster("demo", "CredentialsNotFound", |c| {
            condition(c, "ProxmoxAvailable")
                .is_some_and(|(_, reason, _)| reason == "CredentialsNotFound")
        })
        .await;
    let (_, _, message) = condition(&cluster, "ProxmoxAvailable").expect("condition");
    assert!(message.contains("default/demo-credentials"), "{message}");
}

#[tokio::test]
async fn pause_stops_all_writes() {
    let env = provisioned_env().await;
    env.wait_cluster("demo", "Ready=True", |c| is_true(c, "Ready"))
        .await;
    let api = Api::<ProxmoxCluster>::namespaced(env.client(), "default");
    api.patch(
        "demo",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"annotations": {"cluster.x-k8s.io/paused": ""}}})),
    )
    .await
    .expect("paused");
    let paused = env
        .wait_cluster("demo", "Paused=True", |c| is_true(c, "Paused"))
        .await;
    let status_before = paused.status.clone();

    // Edit the zones while paused and wait until the controller has looked at the edit.
    let reconciles = || {
        let text = env.context.metrics.render();
        text.lines()
            .filter(|l| {
                l.starts_with("controller_runtime_reconcile_total{controller=\"proxmoxcluster\"")
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .sum::<u64>()
    };
    let before = reconciles();
    patch_spec(
        &env,
        json!({"zoneConfig": [{"zone": "rack-z", "nodes": ["pve5"]}]}),
    )
    .await;
    let writes_before = env.server.request_counts();
    tokio::time::timeout(crate::common::env::ENV_WAIT, async {
        while reconciles() <= before {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the edit was reconciled");
    let pools = Api::<InClusterIPPool>::namespaced(env.client(), "default");
    assert!(
        pools
            .get_opt("demo-rack-a-v4-icip")
            .await
            .expect("get")
            .is_some(),
        "pools untouched while paused"
    );
    let after = api.get("demo").await.expect("get");
    assert_eq!(after.status, status_before, "status unchanged while paused");
    let writes_after = env.server.request_counts();
    let writes = |counts: &capmox_testkit::RequestCounts| -> u64 {
        ["create", "update", "patch", "delete"]
            .iter()
            .map(|v| counts.by_verb.get(*v).copied().unwrap_or(0))
            .sum()
    };
    assert_eq!(
        writes(&writes_before),
        writes(&writes_after),
        "no writes while paused"
    );
}

#[tokio::test]
async fn deletion_waits_for_the_machines_and_releases_the_secret() {
    let env = provisioned_env().await;
    env.wait_cluster("demo", "Ready=True", |c| is_true(c, "Ready"))
        .await;
    let machines = Api::<ProxmoxMachine>::namespaced(env.client(), "default");
    let machine: ProxmoxMachine = serde_json::from_value(json!({
        "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha2", "kind": "ProxmoxMachine",
        "metadata": {"name": "demo-cp-1", "namespace": "default", "labels": {"cluster.x-k8s.io/cluster-name": "demo"}},
        "spec": {"sourceNode": "pve1", "templateID": 9000, "network": {"networkDevices": [{"name": "net0", "bridge": "vmbr0"}]}}
    }))
    .expect("machine");
    machines
        .create(&PostParams::default(), &machine)
        .await
        .expect("machine created");

    let api = Api::<ProxmoxCluster>::namespaced(env.client(), "default");
    api.delete("demo", &DeleteParams::default())
        .await
        .expect("delete accepted");
    let deleting = env
        .wait_cluster("demo", "deletionTimestamp", |c| {
            c.metadata.deletion_timestamp.is_some()
        })
        .await;
    assert!(
        !deleting.finalizers().is_empty(),
        "kept while a machine remains"
    );

    machines
        .delete("demo-cp-1", &DeleteParams::default())
        .await
        .expect("machine deleted");
    tokio::time::timeout(
        crate::common::env::ENV_WAIT,
        kube::runtime::wait::await_condition(
            api.clone(),
            "demo",
            kube::runtime::wait::conditions::is_deleted(&deleting.uid().expect("uid")),
        ),
    )
    .await
    .expect("cluster deleted in time")
    .expect("watch");
    let secret = Api::<Secret>::namespaced(env.client(), "default")
        .get("demo-credentials")
        .await
        .expect("secret stays");
    assert!(secret.finalizers().is_empty(), "secret finalizer released");
    assert!(
        secret.owner_references().is_empty(),
        "owner reference released"
    );
}

#[tokio::test]
async fn readiness_follows_cache_sync_with_objects_already_present() {
    let env = Env::start().await;
    env.create_credentials("demo-credentials", None).await;
    let uid = env.create_capi_cluster("demo").await;
    env.create_proxmox_cluster("demo", &uid, zoned_spec()).await;
    let readiness = env.context.readiness.clone();
    readiness.set_leading(true);
    assert!(
        !readiness.is_ready(),
        "no controller has started, so nothing has synced"
    );
    env.run_controllers();
    if tokio::time::timeout(crate::common::env::ENV_WAIT, readiness.wait_ready())
        .await
        .is_err()
    {
        panic!("caches never synced: {:?}", readiness.state());
    }
    let state = readiness.state();
    assert_eq!(
        state.synced.iter().map(String::as_str).collect::<Vec<_>>(),
        [
            "proxmoxcluster",
            "proxmoxmachine",
            "proxmoxmachinetemplate",
            "proxmoxremediation"
        ]
    );
    readiness.set_leading(false);
    assert!(
        !readiness.is_ready(),
        "a replica that lost the lead is not ready"
    );
}

/// A Secret a ProxmoxCluster of the given namespace may use (the simulator's token).
async fn credentials_in(env: &Env, namespace: &str, name: &str, annotations: Value) -> Secret {
    let token = env.sim.token();
    let (id, secret) = token.split_once('=').expect("token id=secret");
    let object: Secret = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": name, "namespace": namespace, "annotations": annotations},
        "stringData": {"url": env.sim.url(), "token": id, "secret": secret}
    }))
    .expect("secret");
    Api::<Secret>::namespaced(env.client(), namespace)
        .create(&PostParams::default(), &object)
        .await
        .expect("secret created")
}

/// A `credentialsRef` into another namespace is refused (and the Secret left untouched) until
/// that Secret lists the cluster's namespace; then it gets the finalizer but never an owner
/// reference, which garbage collection would read as a missing owner and delete the Secret.
#[tokio::test]
async fn a_secret_in_another_namespace_serves_only_namespaces_it_allows() {
    let env = Env::start().await;
    credentials_in(&env, "tenant-b", "borrowed", json!({})).await;
    let mut spec = zoned_spec();
    spec["credentialsRef"] = json!({"name": "borrowed", "namespace": "tenant-b"});
    let uid = env.create_capi_cluster("demo").await;
    env.create_proxmox_cluster("demo", &uid, spec).await;
    env.run_controllers();
    let cluster = env
        .wait_cluster("demo", "CredentialsNotFound", |c| {
            condition(c, "ProxmoxAvailable")
                .is_some_and(|(_, reason, _)| reason == "CredentialsNotFound")
        })
        .await;
    let (_, _, message) = condition(&cluster, "ProxmoxAvailable").expect("condition");
    assert_eq!(
        message,
        "credentials Secret tenant-b/borrowed does not exist or does not allow namespace default: create it in default with keys url, token and secret, or annotate it with proxmox.infrastructure.cluster.x-k8s.io/allowed-namespaces: \"default\""
    );
    let secrets: Api<Secret> = Api::namespaced(env.client(), "tenant-b");
    let untouched = secrets.get("borrowed").await.expect("secret");
    assert!(
        untouched.finalizers().is_empty() && untouched.owner_references().is_empty(),
        "a Secret the cluster may not use is never adopted: {:?}",
        untouched.metadata
    );

    secrets
        .patch(
            "borrowed",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {
                "proxmox.infrastructure.cluster.x-k8s.io/allowed-namespaces": "other, default"}}})),
        )
        .await
        .expect("annotated");
    // Secrets are not watched: the cluster's retry (30 s) would pick the change up; touching
    // the ProxmoxCluster makes it look again now.
    Api::<ProxmoxCluster>::namespaced(env.client(), "default")
        .patch(
            "demo",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {"example.com/nudge": "1"}}})),
        )
        .await
        .expect("nudged");
    env.wait_cluster("demo", "Ready=True", |c| is_true(c, "Ready"))
        .await;
    let adopted = secrets.get("borrowed").await.expect("secret");
    assert_eq!(
        adopted.finalizers(),
        ["proxmoxcluster.infrastructure.cluster.x-k8s.io/secret"]
    );
    assert!(
        adopted.owner_references().is_empty(),
        "no owner reference across namespaces: {:?}",
        adopted.metadata.owner_references
    );
}

/// A Secret that is not usable credentials is reported and never locked with a finalizer.
#[tokio::test]
async fn an_invalid_secret_is_not_adopted() {
    let env = Env::start().await;
    let object: Secret = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": "demo-credentials", "namespace": "default"},
        "stringData": {"url": env.sim.url()}
    }))
    .expect("secret");
    Api::<Secret>::namespaced(env.client(), "default")
        .create(&PostParams::default(), &object)
        .await
        .expect("secret created");
    let uid = env.create_capi_cluster("demo").await;
    env.create_proxmox_cluster("demo", &uid, zoned_spec()).await;
    env.run_controllers();
    env.wait_cluster("demo", "CredentialsInvalid", |c| {
        condition(c, "ProxmoxAvailable")
            .is_some_and(|(_, reason, _)| reason == "CredentialsInvalid")
    })
    .await;
    let secret = Api::<Secret>::namespaced(env.client(), "default")
        .get("demo-credentials")
        .await
        .expect("secret");
    assert!(
        secret.finalizers().is_empty() && secret.owner_references().is_empty(),
        "{:?}",
        secret.metadata
    );
}

/// A pass that works from a stale copy (its guarded finalizer patch is refused with 422, as the
/// real API server answers a failed JSON-patch `test`) is not a failure: no back-off, no
/// warning, a prompt second look.
#[tokio::test]
async fn a_pass_on_a_stale_copy_looks_again_without_backing_off() {
    let env = Env::start().await;
    env.create_credentials("demo-credentials", None).await;
    let uid = env.create_capi_cluster("demo").await;
    env.create_proxmox_cluster("demo", &uid, zoned_spec()).await;
    let api: Api<ProxmoxCluster> = Api::namespaced(env.client(), "default");
    let stale = std::sync::Arc::new(api.get("demo").await.expect("cluster"));
    api.patch(
        "demo",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"annotations": {"example.com/edited": "1"}}})),
    )
    .await
    .expect("a newer version");
    let error = capmox::controller::cluster::reconcile(stale.clone(), env.context.clone())
        .await
        .expect_err("the guarded write is refused");
    assert!(error.is_stale(), "{error}");
    let action = capmox::controller::cluster::error_policy(stale, &error, env.context.clone());
    assert_eq!(
        action,
        kube::runtime::controller::Action::requeue(capmox::controller::guarded::STALE_RETRY)
    );
    let fresh = api.get("demo").await.expect("cluster");
    assert!(
        fresh.finalizers().is_empty(),
        "nothing was written from the stale copy"
    );
}

/// Proxmox reached over plain HTTP (the simulator speaks nothing else) works, but the condition
/// says the token travels unencrypted, and one Warning event says it too (not one per pass).
#[tokio::test]
async fn plain_http_is_reported_in_the_condition_and_one_warning() {
    let env = provisioned_env().await;
    let cluster = env
        .wait_cluster("demo", "Ready=True", |c| is_true(c, "Ready"))
        .await;
    let (status, reason, message) = condition(&cluster, "ProxmoxAvailable").expect("condition");
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("True", "AvailableOverPlainHTTP")
    );
    assert!(
        message.contains("unencrypted") && message.contains("https://"),
        "{message}"
    );
    // A second pass (a spec edit) must not repeat the event.
    patch_spec(&env, zoned_spec()).await;
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(env.client(), "default");
    let warned = |events: &[k8s_openapi::api::events::v1::Event]| {
        events
            .iter()
            .filter(|e| e.reason.as_deref() == Some("AvailableOverPlainHTTP"))
            .count()
    };
    let found = tokio::time::timeout(crate::common::env::ENV_WAIT, async {
        loop {
            let list = events
                .list(&Default::default())
                .await
                .expect("events")
                .items;
            if warned(&list) > 0 {
                return list;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("a Warning event");
    assert_eq!(warned(&found), 1, "one warning, not one per pass");
    assert_eq!(
        found
            .iter()
            .find(|e| e.reason.as_deref() == Some("AvailableOverPlainHTTP"))
            .and_then(|e| e.type_.as_deref()),
        Some("Warning")
    );
}
