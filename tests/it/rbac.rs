//! The manager's RBAC (`config/rbac`) grants exactly what capmox's controllers use, so it
//! never drifts from the code: the real manager (leader election, ProxmoxCluster and
//! ProxmoxMachine reconcilers) runs a whole cluster lifecycle against the in-process API and
//! the Proxmox simulator with its own named client, and every request it made is compared with
//! the ClusterRole and the leader-election Role in both directions.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use capmox::api::ProxmoxMachine;
use capmox::controller::{GlobalCredentials, LeaderElectionConfig, ManagerConfig};
use capmox_sandbox::run::{TOPOLOGY, example_cluster_spec, example_machine_spec};
use capmox_sandbox::standin::{CapiStandIn, ExampleCluster, create_example_cluster, scale_workers};
use capmox_sim::{SimOptions, Simulator, Topology};
use capmox_testkit::{ApiServer, ClientRequest};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Secret;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

/// The client name capmox's manager gets; nothing else uses it.
const CAPMOX: &str = "capmox";
/// Upper bound for each step of the lifecycle.
const STEP: Duration = Duration::from_secs(120);

/// Grants the roles give that a run of the tests may not use (no exercised path needs them, or
/// only some runs reach the path), each with the reason it must stay. Keep it short: an entry
/// here is a permission no test run is sure to prove necessary.
const ALLOWED_UNUSED: &[(&str, &str, &str, &str)] = &[
    // (group, resource[/subresource], verb, reason)
    (
        "infrastructure.cluster.x-k8s.io",
        "proxmoxmachines",
        "get",
        "read only when a pass works from a cached copy without a VMID while the stored machine \
         may have one (a lagging cache); whether a run has such a pass is up to timing",
    ),
];

/// Non-resource URLs every authenticated user may read (the `system:discovery` and
/// `system:public-info-viewer` ClusterRoles), so a manager needs no grant for them.
const DISCOVERY_URLS: &[&str] = &["/api", "/apis", "/version", "/healthz", "/livez", "/readyz"];

/// One `(group, resource[/subresource], verb)` a role grants.
type Grant = (String, String, String);

fn yaml(path: &str) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    serde_norway::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The grants of a Role or ClusterRole; wildcards and `resourceNames` are refused, since a
/// role that needs them is not "exactly the verbs used".
fn grants(role: &Value) -> BTreeSet<Grant> {
    let mut out = BTreeSet::new();
    let strings = |v: &Value| -> Vec<String> {
        v.as_array()
            .map(|a| {
                a.iter()
                    .map(|s| s.as_str().expect("a string").to_owned())
                    .collect()
            })
            .unwrap_or_default()
    };
    for rule in role["rules"].as_array().expect("rules") {
        assert!(
            rule.get("resourceNames").is_none() && rule.get("nonResourceURLs").is_none(),
            "unexpected rule shape in {}: {rule}",
            role["metadata"]["name"]
        );
        for group in strings(&rule["apiGroups"]) {
            for resource in strings(&rule["resources"]) {
                for verb in strings(&rule["verbs"]) {
                    assert!(
                        ![&group, &resource, &verb].iter().any(|s| s.contains('*')),
                        "wildcard in {}: {rule}",
                        role["metadata"]["name"]
                    );
                    out.insert((group.clone(), resource.clone(), verb));
                }
            }
        }
    }
    out
}

fn grant_of(request: &ClientRequest) -> Grant {
    let resource = match &request.subresource {
        Some(sub) => format!("{}/{sub}", request.resource),
        None => request.resource.clone(),
    };
    (request.group.clone(), resource, request.verb.clone())
}

/// Waits, driven by a watch, until the ProxmoxMachines satisfy `done`.
async fn wait_machines(
    client: &kube::Client,
    what: &str,
    done: impl Fn(&[ProxmoxMachine]) -> bool,
) -> Vec<ProxmoxMachine> {
    let api: Api<ProxmoxMachine> = Api::namespaced(client.clone(), "default");
    let mut events = watcher(api.clone(), watcher::Config::default()).boxed();
    let deadline = tokio::time::Instant::now() + STEP;
    loop {
        let machines = api.list(&Default::default()).await.expect("list").items;
        if done(&machines) {
            return machines;
        }
        match tokio::time::timeout_at(deadline, events.next()).await {
            Ok(Some(_)) => {}
            Ok(None) => panic!("the ProxmoxMachine watch ended while waiting for {what}"),
            Err(_) => panic!(
                "timed out waiting for {what}; machines: {:#?}",
                machines
                    .iter()
                    .map(|m| (m.metadata.name.clone(), m.status.clone()))
                    .collect::<Vec<_>>()
            ),
        }
    }
}

fn condition_is(object: Option<&Value>, type_: &str, status: &str) -> bool {
    object
        .and_then(|o| o["status"]["conditions"].as_array())
        .is_some_and(|cs| {
            cs.iter()
                .any(|c| c["type"] == type_ && c["status"] == status)
        })
}

/// Runs the lifecycle and returns what capmox's client asked for; with a lease namespace the
/// manager elects a leader there first, without one it reconciles at once (`capmox run`'s
/// default). `settings`: the manager's credentials and tenancy settings.
async fn record_a_lifecycle(
    lease_namespace: Option<&str>,
    settings: GlobalCredentials,
) -> BTreeMap<ClientRequest, u64> {
    let server = ApiServer::new();
    server.register_builtin_kinds();
    server.register_crd_dir("crds").expect("capmox CRDs");
    server
        .register_crd_dir(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/data/external-crds"
        ))
        .expect("upstream CRDs (tests/data/external-crds)");
    let sim = Simulator::start(
        Topology::from_yaml(TOPOLOGY, "sandbox topology").expect("topology"),
        SimOptions {
            clone_duration: Duration::from_millis(20),
            task_duration: Duration::ZERO,
            boot_delay: Duration::from_millis(20),
            ..SimOptions::default()
        },
    )
    .await
    .expect("simulator");
    let stop = CancellationToken::new();
    let config = ManagerConfig {
        metrics_address: ([127, 0, 0, 1], 0).into(),
        health_address: ([127, 0, 0, 1], 0).into(),
        leader_election: lease_namespace.map(|namespace| LeaderElectionConfig {
            name: "capmox-controller-leader".into(),
            namespace: namespace.into(),
            identity: "rbac-test".into(),
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(2),
        }),
        watch_namespace: None,
        watch_filter: None,
        cluster_concurrency: 2,
        machine_concurrency: 4,
        task_timing: Default::default(),
        zone_holds: Default::default(),
        proxmox_requests_in_flight: capmox::proxmox::DEFAULT_REQUESTS_IN_FLIGHT,
        webhook: None,
    };
    let manager = tokio::spawn(capmox::controller::run(
        server.client_named(CAPMOX),
        config,
        settings,
        stop.clone(),
    ));
    lifecycle(&server, &sim, &stop).await;
    manager
        .await
        .expect("the manager task ends without panicking")
        .expect("the manager stops cleanly");
    server.requests_by_client(CAPMOX)
}

/// The steps of the lifecycle; cancels `stop` at the end, which makes the manager release the
/// lease (an update of it) and return.
async fn lifecycle(server: &ApiServer, sim: &Simulator, stop: &CancellationToken) {
    // CAPI core, KCP, MachineDeployment and the IPAM provider: other clients, not recorded.
    let client = server.client();
    tokio::spawn(capmox_sandbox::ipam::run(client.clone(), stop.clone()));
    CapiStandIn::spawn(client.clone(), "default", stop.clone());

    // A cluster with zones and a credentials Secret; 2 control-plane machines, 2 workers.
    let token = sim.token();
    let (id, secret) = token.split_once('=').expect("token id=secret");
    let credentials: Secret = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": "demo-proxmox-credentials", "namespace": "default"},
        "stringData": {"url": sim.url(), "token": id, "secret": secret}
    }))
    .expect("secret");
    Api::<Secret>::namespaced(client.clone(), "default")
        .create(&PostParams::default(), &credentials)
        .await
        .expect("credentials");
    let mut example = ExampleCluster::new(
        "default",
        "demo",
        example_cluster_spec(),
        example_machine_spec(),
    );
    example.control_plane_replicas = 2;
    example.worker_replicas = 2;
    example.worker_failure_domain = Some("rack-b".into());
    create_example_cluster(&client, &example)
        .await
        .expect("example cluster");
    let machines = wait_machines(&client, "4 machines provisioned", |ms| {
        ms.len() == 4 && ms.iter().all(ProxmoxMachine::is_provisioned)
    })
    .await;

    // A MachineHealthCheck's remediation request for a worker whose guest hangs: reboot, reset,
    // then the Machine is handed back to its owner.
    remediate_a_worker(server, sim, &machines).await;

    // A network-only zone added and removed again: its IP pool is created, then deleted.
    let clusters: Api<capmox::api::ProxmoxCluster> = Api::namespaced(client.clone(), "default");
    let mut with_storage = example_cluster_spec()["zoneConfig"].clone();
    with_storage.as_array_mut().expect("zones").push(json!({"zone": "storage",
        "ipv4Config": {"addresses": ["10.0.9.10-10.0.9.20"], "prefix": 24, "gateway": "10.0.9.1"}}));
    clusters
        .patch(
            "demo",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"zoneConfig": with_storage}})),
        )
        .await
        .expect("zone added");
    server
        .wait_for(
            "inclusterippools",
            "default",
            "demo-storage-v4-icip",
            STEP,
            |p| p.is_some(),
        )
        .await
        .expect("the storage zone's pool is created");
    clusters
        .patch(
            "demo",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"zoneConfig": example_cluster_spec()["zoneConfig"]}})),
        )
        .await
        .expect("zone removed");
    server
        .wait_for(
            "inclusterippools",
            "default",
            "demo-storage-v4-icip",
            STEP,
            |p| p.is_none(),
        )
        .await
        .expect("the storage zone's pool is deleted");

    // Paused and resumed through the Cluster.
    let capi_clusters: Api<capmox::capi::Cluster> = Api::namespaced(client.clone(), "default");
    let pause = |paused: bool| {
        let capi_clusters = capi_clusters.clone();
        async move {
            capi_clusters
                .patch(
                    "demo",
                    &PatchParams::default(),
                    &Patch::Merge(json!({"spec": {"paused": paused}})),
                )
                .await
                .expect("pause toggled");
        }
    };
    pause(true).await;
    let any_machine = wait_machines(&client, "machines listed", |ms| !ms.is_empty()).await[0]
        .metadata
        .name
        .clone()
        .expect("name");
    for (kind, name) in [
        ("proxmoxclusters", "demo".to_owned()),
        ("proxmoxmachines", any_machine.clone()),
    ] {
        server
            .wait_for(kind, "default", &name, STEP, |o| {
                condition_is(o, "Paused", "True")
            })
            .await
            .expect("paused condition");
    }
    pause(false).await;
    for (kind, name) in [
        ("proxmoxclusters", "demo".to_owned()),
        ("proxmoxmachines", any_machine),
    ] {
        server
            .wait_for(kind, "default", &name, STEP, |o| {
                condition_is(o, "Paused", "False")
            })
            .await
            .expect("resumed");
    }

    // A worker scaled away, then the whole cluster deleted.
    scale_workers(&client, "default", &example.workers_name(), 1)
        .await
        .expect("scale down");
    wait_machines(&client, "3 machines left", |ms| {
        ms.len() == 3 && ms.iter().all(ProxmoxMachine::is_provisioned)
    })
    .await;
    capi_clusters
        .delete("demo", &DeleteParams::default())
        .await
        .expect("cluster deletion accepted");
    server
        .wait_for("proxmoxclusters", "default", "demo", STEP, |c| c.is_none())
        .await
        .expect("ProxmoxCluster released");
    assert_eq!(
        sim.with_cluster(|c| c.vm_count()),
        1,
        "only the template is left"
    );
    let secret = server
        .object("secrets", "default", "demo-proxmox-credentials")
        .expect("kind")
        .expect("the credentials Secret outlives the cluster");
    assert!(
        secret["metadata"]["finalizers"].is_null(),
        "capmox released the Secret: {}",
        secret["metadata"]
    );

    stop.cancel();
}

/// Has a worker's VM rebooted, reset and its Machine handed back, as a MachineHealthCheck's
/// remediation request makes capmox do.
async fn remediate_a_worker(server: &ApiServer, sim: &Simulator, machines: &[ProxmoxMachine]) {
    let client = server.client();
    let worker = machines
        .iter()
        .find(|m| !m.labels().contains_key("cluster.x-k8s.io/control-plane"))
        .expect("a worker");
    let vmid = worker
        .status
        .as_ref()
        .and_then(|s| s.virtual_machine_id)
        .and_then(|v| u32::try_from(v).ok())
        .expect("a VMID");
    let owner = worker
        .owner_references()
        .iter()
        .find(|o| o.kind == "Machine")
        .expect("the Machine")
        .clone();
    assert!(sim.hang_guest(vmid), "the worker's VM runs");
    let request: capmox::api::ProxmoxRemediation = serde_json::from_value(json!({
        "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha2", "kind": "ProxmoxRemediation",
        "metadata": {"name": owner.name, "namespace": "default", "ownerReferences": [{
            "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Machine",
            "name": owner.name, "uid": owner.uid}]},
        "spec": {"strategy": {"retryLimit": 1, "timeoutSeconds": 1, "shutdownTimeoutSeconds": 1}}
    }))
    .expect("a remediation");
    Api::<capmox::api::ProxmoxRemediation>::namespaced(client, "default")
        .create(&PostParams::default(), &request)
        .await
        .expect("remediation created");
    server
        .wait_for("proxmoxremediations", "default", &owner.name, STEP, |r| {
            r.is_some_and(|r| r["status"]["phase"] == "Replacing")
        })
        .await
        .expect("the Machine is handed back");
}

/// The requests no role allows, and the grants the allowed ones used; `roles` are the grants
/// of Roles, each with the namespace it is in.
fn check_requests(
    recorded: &BTreeMap<ClientRequest, u64>,
    cluster_grants: &BTreeSet<Grant>,
    roles: &[(&BTreeSet<Grant>, &str)],
) -> (Vec<String>, BTreeSet<Grant>) {
    assert!(!recorded.is_empty(), "nothing was recorded for {CAPMOX}");
    let summary = recorded
        .iter()
        .map(|(r, n)| {
            let (g, res, v) = grant_of(r);
            format!("{g}/{res} {v} ns={:?} x{n}", r.namespace)
        })
        .collect::<Vec<_>>()
        .join("\n");
    println!("capmox's requests:\n{summary}");

    let mut denied = Vec::new();
    let mut used = BTreeSet::new();
    for request in recorded.keys() {
        if request.resource.starts_with('/') {
            if !DISCOVERY_URLS
                .iter()
                .any(|u| request.resource == *u || request.resource.starts_with(&format!("{u}/")))
            {
                denied.push(format!(
                    "non-resource {} {}",
                    request.verb, request.resource
                ));
            }
            continue;
        }
        let grant = grant_of(request);
        let by_cluster_role = cluster_grants.contains(&grant);
        let by_role = roles.iter().any(|(grants, namespace)| {
            grants.contains(&grant) && request.namespace.as_deref() == Some(*namespace)
        });
        if !by_cluster_role && !by_role {
            denied.push(format!(
                "{}/{} {} in {:?}",
                grant.0, grant.1, grant.2, request.namespace
            ));
        }
        used.insert(grant);
    }
    (denied, used)
}

/// `capmox run` without `--leader-elect` (its default): the reconcilers start at once, the
/// lifecycle completes within the ClusterRole alone, and no Lease is touched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_leader_election_the_manager_reconciles_within_the_cluster_role() {
    let cluster_grants = grants(&yaml("config/rbac/role.yaml"));
    let recorded = record_a_lifecycle(None, GlobalCredentials::default()).await;
    let (denied, _) = check_requests(&recorded, &cluster_grants, &[]);
    assert!(
        denied.is_empty(),
        "capmox made requests its ClusterRole does not allow (add them to config/rbac):\n{}",
        denied.join("\n")
    );
    assert!(
        !recorded.keys().any(|r| r.resource == "leases"),
        "no Lease without leader election: {recorded:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_roles_grant_exactly_what_the_controllers_use() {
    let cluster_role = yaml("config/rbac/role.yaml");
    let leader_role = yaml("config/rbac/leader_election_role.yaml");
    assert_eq!(cluster_role["kind"], "ClusterRole");
    assert_eq!(leader_role["kind"], "Role");
    // The Role lands in the manager's namespace (kustomize's `namespace`), where the Deployment's
    // POD_NAMESPACE, and so the lease, is.
    let namespace = yaml("config/default/kustomization.yaml")["namespace"]
        .as_str()
        .expect("config/default sets the namespace")
        .to_owned();
    let cluster_grants = grants(&cluster_role);
    let leader_grants = grants(&leader_role);

    let recorded = record_a_lifecycle(Some(&namespace), GlobalCredentials::default()).await;
    let (denied, used) =
        check_requests(&recorded, &cluster_grants, &[(&leader_grants, &namespace)]);
    assert!(
        denied.is_empty(),
        "capmox made requests its roles do not allow (add them to config/rbac):\n{}",
        denied.join("\n")
    );

    let allowlisted: BTreeSet<Grant> = ALLOWED_UNUSED
        .iter()
        .map(|(g, r, v, _)| ((*g).to_owned(), (*r).to_owned(), (*v).to_owned()))
        .collect();
    let granted: BTreeSet<Grant> = cluster_grants.union(&leader_grants).cloned().collect();
    let unused: Vec<_> = granted
        .difference(&used)
        .filter(|g| !allowlisted.contains(*g))
        .map(|(g, r, v)| format!("{g}/{r} {v}"))
        .collect();
    assert!(
        unused.is_empty(),
        "the roles grant what the controllers never used (remove it from config/rbac, or \
         allowlist it with a reason):\n{}",
        unused.join("\n")
    );
    // An allowlisted grant may be used in one run and not in another (timing decides), so
    // only a grant that is gone from the roles makes an entry stale.
    for grant in &allowlisted {
        assert!(
            granted.contains(grant),
            "stale ALLOWED_UNUSED entry {grant:?}: not granted"
        );
    }
}

/// An install made with `make release-manifests SECRET_NAMESPACES=default` (capmox run with
/// `--secret-namespaces=default`): the lifecycle completes with the ClusterRole that names no
/// Secrets and the Role of namespace `default`, and that Role's grants are all used.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_namespaced_secrets_install_reads_secrets_only_through_its_roles() {
    let (components, rbac) =
        crate::release::namespaced_secrets_release("rbac-secret-ns", "default");
    let cluster_role = components
        .iter()
        .find(|o| o["kind"] == "ClusterRole" && o["metadata"]["name"] == "capmox-manager-role")
        .expect("the manager's ClusterRole");
    let role = rbac
        .iter()
        .find(|o| o["kind"] == "Role" && o["metadata"]["namespace"] == "default")
        .expect("the Role of namespace default");
    let cluster_grants = grants(cluster_role);
    let role_grants = grants(role);
    let settings = GlobalCredentials {
        secret_namespaces: Some(vec!["default".to_owned()]),
        ..GlobalCredentials::default()
    };
    let recorded = record_a_lifecycle(None, settings).await;
    let (denied, used) = check_requests(&recorded, &cluster_grants, &[(&role_grants, "default")]);
    assert!(
        denied.is_empty(),
        "capmox made requests a namespaced-Secrets install does not allow:\n{}",
        denied.join("\n")
    );
    let unused: Vec<_> = role_grants.difference(&used).collect();
    assert!(
        unused.is_empty(),
        "the Role grants what capmox never used: {unused:?}"
    );
}
