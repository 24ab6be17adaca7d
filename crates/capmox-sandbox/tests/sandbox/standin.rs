//! The CAPI stand-in (`capmox_sandbox::standin`) against the in-process API server, with the
//! test playing the infrastructure provider by hand: it publishes failure domains on the
//! ProxmoxCluster and marks ProxmoxMachines provisioned. capmox's controllers are not used.

use std::collections::BTreeMap;
use std::pin::pin;
use std::time::Duration;

use capmox::api::{FailureDomain, ProxmoxCluster, ProxmoxMachine, ProxmoxMachineTemplate, labels};
use capmox::capi::{Cluster, Machine};
use capmox_sandbox::standin::{
    self, BOOTSTRAP_SECRET_TYPE, CLUSTER_FINALIZER, CapiStandIn, ExampleCluster, MACHINE_FINALIZER,
    MachinePlacement, bootstrap_secret_name, control_plane_resource, deployment_resource,
    machine_for_scale_down,
};
use capmox_testkit::ApiServer;
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams};
use kube::runtime::reflector;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource, ResourceExt};
use serde_json::json;
use tokio_util::sync::CancellationToken;

const NS: &str = "default";
const WAIT: Duration = Duration::from_secs(30);
/// Finalizer the fake provider keeps on ProxmoxMachines, as capmox does for the VM.
const VM_FINALIZER: &str = "test.capmox/vm";
/// While present, the fake provider does not release a deleting ProxmoxMachine.
const HOLD: &str = "test.capmox/hold-deletion";

fn server() -> ApiServer {
    let server = ApiServer::new();
    server.register_builtin_kinds();
    server
        .register_crd_dir(crate::paths::root().join("crds"))
        .expect("capmox CRDs");
    server
        .register_crd_dir(crate::paths::data("external-crds"))
        .expect("upstream CRDs (tests/data/external-crds)");
    // capmox objects are checked against their schemas, so the stand-in's ProxmoxMachines
    // must be valid ones.
    for crd in capmox::api::crd::all().expect("CRDs render") {
        let schema = capmox::api::crd::schema_json(&crd).expect("schema");
        server
            .set_validator(&crd.spec.names.plural, move |object| {
                capmox_testkit::schema::validate_object(&schema, object, None)
                    .map(|_| ())
                    .map_err(|v| {
                        v.iter()
                            .map(ToString::to_string)
                            .collect::<Vec<_>>()
                            .join("; ")
                    })
            })
            .expect("kind registered");
    }
    server
}

/// Cancels the stand-in and the fake provider when the test ends.
struct Stop(CancellationToken);
impl Drop for Stop {
    fn drop(&mut self) {
        self.0.cancel();
    }
}

fn example(name: &str) -> ExampleCluster {
    let mut example = ExampleCluster::new(
        NS,
        name,
        json!({
            "controlPlaneEndpoint": {"host": "10.0.0.10", "port": 6443},
            "dnsServers": ["10.0.0.2"],
            "ipv4Config": {"addresses": ["10.0.0.100-10.0.0.150"], "prefix": 24, "gateway": "10.0.0.1"},
            "zoneConfig": [
                {"zone": "rack-a", "nodes": ["pve1"]},
                {"zone": "rack-b", "nodes": ["pve2"], "controlPlaneEligible": false},
                {"zone": "rack-c", "nodes": ["pve3"]}
            ]
        }),
        json!({"sourceNode": "pve1", "templateID": 9000,
               "network": {"networkDevices": [{"name": "net0", "bridge": "vmbr0"}]}}),
    );
    example.control_plane_replicas = 3;
    example.worker_replicas = 2;
    example.worker_failure_domain = Some("rack-b".into());
    example
        .machine_template_labels
        .insert("example.com/role".into(), "capmox".into());
    example
}

fn published_domains() -> Vec<FailureDomain> {
    ["rack-a", "rack-b", "rack-c"]
        .into_iter()
        .map(|name| FailureDomain {
            name: name.into(),
            control_plane: Some(name != "rack-b"),
            attributes: BTreeMap::new(),
        })
        .collect()
}

/// Waits until the objects of `api` satisfy `condition`, driven by a watch; returns them.
async fn wait_list<K>(api: Api<K>, what: &str, condition: impl Fn(&[K]) -> bool) -> Vec<K>
where
    K: Resource<DynamicType = ()> + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
    K: Send + Sync + 'static,
{
    let (reader, writer) = reflector::store();
    let mut events = pin!(reflector::reflector(
        writer,
        watcher(api, watcher::Config::default())
    ));
    let mut ready = false;
    let found = tokio::time::timeout(WAIT, async {
        loop {
            if ready {
                let items: Vec<K> = reader.state().iter().map(|o| (**o).clone()).collect();
                if condition(&items) {
                    return items;
                }
            }
            match events.try_next().await {
                Ok(Some(watcher::Event::InitDone)) => ready = true,
                Ok(Some(_)) => {}
                Ok(None) => panic!("watch ended"),
                Err(error) => panic!("watch failed: {error}"),
            }
        }
    })
    .await;
    match found {
        Ok(items) => items,
        Err(_) => {
            let names: Vec<String> = reader.state().iter().map(|o| o.name_any()).collect();
            panic!("timed out waiting for {what}; objects: {names:?}")
        }
    }
}

async fn wait_one<K>(api: Api<K>, name: &str, what: &str, condition: impl Fn(&K) -> bool) -> K
where
    K: Resource<DynamicType = ()> + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
    K: Send + Sync + 'static,
{
    let items = wait_list(api, what, |items| {
        items.iter().any(|o| o.name_any() == name && condition(o))
    })
    .await;
    items
        .into_iter()
        .find(|o| o.name_any() == name)
        .expect("found")
}

async fn wait_gone<K>(api: Api<K>, name: &str, what: &str)
where
    K: Resource<DynamicType = ()> + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
    K: Send + Sync + 'static,
{
    wait_list(api, what, |items| {
        items.iter().all(|o| o.name_any() != name)
    })
    .await;
}

fn is_control_plane(m: &Machine) -> bool {
    m.labels().contains_key(labels::CONTROL_PLANE)
}

fn is_worker(m: &Machine) -> bool {
    m.labels().contains_key(labels::DEPLOYMENT_NAME)
}

fn has_node(m: &Machine) -> bool {
    m.status.as_ref().is_some_and(|s| s.node_ref.is_some())
}

/// `n` live machines of the kind, all with a node, and none being deleted anywhere.
fn settled(machines: &[Machine], kind: fn(&Machine) -> bool, n: usize) -> bool {
    let of_kind: Vec<&Machine> = machines.iter().filter(|m| kind(m)).collect();
    of_kind.len() == n
        && of_kind
            .iter()
            .all(|m| has_node(m) && m.meta().deletion_timestamp.is_none())
}

fn per_domain(machines: &[&Machine]) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for m in machines {
        *counts
            .entry(m.spec.failure_domain.clone().unwrap_or_default())
            .or_insert(0) += 1;
    }
    counts
}

/// Control-plane machines only in the two eligible domains, spread within one machine.
fn assert_control_plane_spread(machines: &[Machine], n: usize) {
    let cp: Vec<&Machine> = machines.iter().filter(|m| is_control_plane(m)).collect();
    assert_eq!(cp.len(), n);
    let counts = per_domain(&cp);
    assert!(
        counts.keys().all(|d| d == "rack-a" || d == "rack-c"),
        "control plane outside the eligible domains: {counts:?}"
    );
    let max = counts.values().max().copied().unwrap_or(0);
    let min = ["rack-a", "rack-c"]
        .iter()
        .map(|d| counts.get(*d).copied().unwrap_or(0))
        .min()
        .unwrap_or(0);
    assert!(max - min <= 1, "uneven spread {counts:?}");
}

/// Plays capmox: every new ProxmoxMachine gets a finalizer, a provider ID, addresses, its
/// Machine's failure domain and `provisioned: true`; a deleting one loses its finalizer unless
/// it carries [`HOLD`].
async fn fake_provider(client: Client, stop: CancellationToken) {
    let api = Api::<ProxmoxMachine>::namespaced(client.clone(), NS);
    let machines = Api::<Machine>::namespaced(client, NS);
    let mut events = pin!(watcher(api.clone(), watcher::Config::default()).default_backoff());
    let mut serial = 0u64;
    loop {
        let event = tokio::select! {
            _ = stop.cancelled() => return,
            event = events.next() => event,
        };
        let objects = match event {
            Some(Ok(watcher::Event::Apply(pm) | watcher::Event::InitApply(pm))) => vec![pm],
            Some(_) => continue,
            None => return,
        };
        for pm in objects {
            let name = pm.name_any();
            let pp = PatchParams::default();
            if pm.meta().deletion_timestamp.is_some() {
                if !pm.annotations().contains_key(HOLD) {
                    let _ = api
                        .patch(
                            &name,
                            &pp,
                            &Patch::Merge(json!({"metadata": {"finalizers": null}})),
                        )
                        .await;
                }
                continue;
            }
            if pm
                .status
                .as_ref()
                .and_then(|s| s.initialization.as_ref())
                .is_some()
            {
                continue;
            }
            let Some(owner) = pm.owner_references().iter().find(|o| o.kind == "Machine") else {
                continue;
            };
            let Ok(machine) = machines.get(&owner.name).await else {
                continue;
            };
            if pm.spec.provider_id.is_none() {
                // Provider ID first; the status follows on the event this patch causes.
                serial += 1;
                let provider_id = format!("proxmox://{serial:08x}-0000-4000-8000-{serial:012x}");
                let spec = json!({"metadata": {"finalizers": [VM_FINALIZER]}, "spec": {"providerID": provider_id}});
                let _ = api.patch(&name, &pp, &Patch::Merge(spec)).await;
                continue;
            }
            let mut status = json!({
                "initialization": {"provisioned": true},
                "addresses": [{"type": "InternalIP", "address": format!("10.0.0.{}", serial % 250 + 1)}],
            });
            if let Some(domain) = machine.spec.failure_domain {
                status["failureDomain"] = json!(domain);
            }
            let _ = api
                .patch_status(&name, &pp, &Patch::Merge(json!({"status": status})))
                .await;
        }
    }
}

#[tokio::test]
async fn stand_in_follows_the_contract_from_creation_to_deletion() {
    let server = server();
    let client = server.client();
    let stop = Stop(CancellationToken::new());
    CapiStandIn::spawn(client.clone(), NS, stop.0.clone());
    let example = example("demo");
    standin::create_example_cluster(&client, &example)
        .await
        .expect("example created");

    let clusters = Api::<Cluster>::namespaced(client.clone(), NS);
    let proxmox_clusters = Api::<ProxmoxCluster>::namespaced(client.clone(), NS);
    let machines = Api::<Machine>::namespaced(client.clone(), NS);
    let proxmox_machines = Api::<ProxmoxMachine>::namespaced(client.clone(), NS);
    let secrets = Api::<Secret>::namespaced(client.clone(), NS);

    // CAPI core adopts the InfraCluster and protects the Cluster.
    let cluster = wait_one(clusters.clone(), "demo", "cluster finalizer", |c| {
        c.finalizers().iter().any(|f| f == CLUSTER_FINALIZER)
    })
    .await;
    let uid = cluster.uid().expect("uid");
    let infra = wait_one(proxmox_clusters.clone(), "demo", "owner reference", |p| {
        p.owner_references()
            .iter()
            .any(|o| o.kind == "Cluster" && o.uid == uid)
    })
    .await;
    assert_eq!(infra.labels()[labels::CLUSTER_NAME], "demo");
    let owner = &infra.owner_references()[0];
    assert_eq!(
        owner.controller, None,
        "CAPI's owner reference is not a controller"
    );

    // Nothing is created before the infrastructure is provisioned.
    assert!(
        machines
            .list(&ListParams::default())
            .await
            .expect("list")
            .items
            .is_empty()
    );

    // The provider publishes its failure domains (unsorted) and reports provisioned.
    let mut domains = published_domains();
    domains.reverse();
    proxmox_clusters
        .patch_status(
            "demo",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {
                "initialization": {"provisioned": true},
                "failureDomains": domains,
            }})),
        )
        .await
        .expect("status patched");
    let cluster = wait_one(
        clusters.clone(),
        "demo",
        "infrastructure provisioned",
        |c| {
            c.status.as_ref().is_some_and(|s| {
                s.initialization
                    .as_ref()
                    .and_then(|i| i.infrastructure_provisioned)
                    == Some(true)
            })
        },
    )
    .await;
    assert_eq!(
        cluster.status.expect("status").failure_domains,
        published_domains(),
        "copied sorted by name"
    );

    // KCP creates the first control-plane machine and waits for it to be provisioned.
    let first = wait_list(machines.clone(), "first control-plane machine", |ms| {
        ms.iter().filter(|m| is_control_plane(m)).count() == 1
    })
    .await;
    let first = first
        .into_iter()
        .find(is_control_plane)
        .expect("control plane machine");
    wait_one(
        proxmox_machines.clone(),
        &first.name_any(),
        "first ProxmoxMachine",
        |_| true,
    )
    .await;
    assert_eq!(
        machines
            .list(&ListParams::default())
            .await
            .expect("list")
            .items
            .iter()
            .filter(|m| is_control_plane(m))
            .count(),
        1,
        "the next control-plane machine waits for the first to be provisioned"
    );

    // From here on the fake provider provisions everything.
    tokio::spawn(fake_provider(client.clone(), stop.0.clone()));
    let all = wait_list(machines.clone(), "3 control plane + 2 workers", |ms| {
        settled(ms, is_control_plane, 3) && settled(ms, is_worker, 2)
    })
    .await;
    assert_control_plane_spread(&all, 3);
    let kcp_uid =
        Api::<DynamicObject>::namespaced_with(client.clone(), NS, &control_plane_resource())
            .get(&example.control_plane_name())
            .await
            .expect("kcp")
            .uid()
            .expect("uid");
    for m in &all {
        let name = m.name_any();
        assert_eq!(m.spec.cluster_name, "demo");
        assert_eq!(m.labels()[labels::CLUSTER_NAME], "demo");
        assert!(m.finalizers().iter().any(|f| f == MACHINE_FINALIZER));
        let controller = m
            .owner_references()
            .iter()
            .find(|o| o.controller == Some(true))
            .expect("controller");
        if is_control_plane(m) {
            assert_eq!(m.labels()[labels::CONTROL_PLANE], "");
            assert!(
                name.starts_with("demo-control-plane-")
                    && name.len() == "demo-control-plane-".len() + 5,
                "{name}"
            );
            assert_eq!(
                (controller.kind.as_str(), controller.uid.as_str()),
                ("KubeadmControlPlane", kcp_uid.as_str())
            );
            assert!(!m.labels().contains_key(labels::DEPLOYMENT_NAME));
        } else {
            assert_eq!(m.labels()[labels::DEPLOYMENT_NAME], "demo-workers");
            assert_eq!(m.spec.failure_domain.as_deref(), Some("rack-b"));
            assert_eq!(controller.kind, "MachineDeployment");
        }
        assert_eq!(m.spec.version.as_deref(), Some("v1.33.0"));
        // Bootstrap data.
        let secret_name = bootstrap_secret_name(&name);
        assert_eq!(
            m.spec
                .bootstrap
                .as_ref()
                .and_then(|b| b.data_secret_name.clone()),
            Some(secret_name.clone())
        );
        let secret = secrets.get(&secret_name).await.expect("bootstrap secret");
        assert_eq!(secret.type_.as_deref(), Some(BOOTSTRAP_SECRET_TYPE));
        let data = secret.data.expect("data");
        assert_eq!(data["format"].0, b"cloud-config");
        assert!(data["value"].0.starts_with(b"#cloud-config\n"));
        // The ProxmoxMachine: from the template, controlled by the Machine.
        let pm = proxmox_machines.get(&name).await.expect("ProxmoxMachine");
        assert_eq!(pm.spec.template_id, Some(9000));
        assert_eq!(pm.labels()[labels::CLUSTER_NAME], "demo");
        let template = if is_control_plane(m) {
            example.control_plane_name()
        } else {
            example.workers_name()
        };
        assert_eq!(
            pm.annotations()["cluster.x-k8s.io/cloned-from-name"],
            template
        );
        assert_eq!(pm.labels()["example.com/role"], "capmox");
        let pm_owner = pm
            .owner_references()
            .iter()
            .find(|o| o.controller == Some(true))
            .expect("controller");
        assert_eq!(
            (pm_owner.kind.as_str(), Some(pm_owner.uid.clone())),
            ("Machine", m.uid())
        );
        assert_eq!(
            m.spec
                .infrastructure_ref
                .as_ref()
                .map(|r| (r.kind.as_str(), r.name.as_str())),
            Some(("ProxmoxMachine", name.as_str()))
        );
        // What CAPI copies back.
        assert_eq!(m.spec.provider_id, pm.spec.provider_id);
        let status = m.status.clone().expect("status");
        let pm_status = pm.status.clone().expect("status");
        assert_eq!(status.addresses, pm_status.addresses);
        assert_eq!(status.failure_domain, m.spec.failure_domain);
        assert_eq!(
            status
                .initialization
                .and_then(|i| i.infrastructure_provisioned),
            Some(true)
        );
        assert_eq!(status.node_ref.map(|n| n.name), Some(name.clone()));
    }
    wait_one(clusters.clone(), "demo", "control plane initialized", |c| {
        c.status
            .as_ref()
            .and_then(|s| s.initialization.as_ref())
            .and_then(|i| i.control_plane_initialized)
            == Some(true)
    })
    .await;

    // Deleting a Machine deletes its ProxmoxMachine first and waits for it to be gone.
    let worker = all
        .iter()
        .find(|m| is_worker(m))
        .expect("worker")
        .name_any();
    proxmox_machines
        .patch(
            &worker,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {HOLD: ""}}})),
        )
        .await
        .expect("hold");
    machines
        .delete(&worker, &DeleteParams::default())
        .await
        .expect("machine deleted");
    wait_one(
        proxmox_machines.clone(),
        &worker,
        "ProxmoxMachine deleting",
        |p| p.meta().deletion_timestamp.is_some(),
    )
    .await;
    let held = machines
        .get(&worker)
        .await
        .expect("machine waits for its ProxmoxMachine");
    assert!(held.meta().deletion_timestamp.is_some());
    proxmox_machines
        .patch(
            &worker,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {HOLD: null}}})),
        )
        .await
        .expect("release");
    wait_gone(proxmox_machines.clone(), &worker, "ProxmoxMachine gone").await;
    wait_gone(machines.clone(), &worker, "Machine gone").await;
    // The MachineDeployment replaces it.
    wait_list(machines.clone(), "worker replaced", |ms| {
        settled(ms, is_worker, 2)
    })
    .await;

    // KCP 3 → 5: spread kept, never in rack-b.
    standin::scale_control_plane(&client, NS, &example.control_plane_name(), 5)
        .await
        .expect("scaled");
    let five = wait_list(machines.clone(), "5 control plane machines", |ms| {
        settled(ms, is_control_plane, 5)
    })
    .await;
    assert_control_plane_spread(&five, 5);

    // KCP 5 → 3: one at a time, the oldest machine of the fullest domain (§4.3).
    let mut expected: Vec<MachinePlacement> = five
        .iter()
        .filter(|m| is_control_plane(m))
        .map(MachinePlacement::of)
        .collect();
    for _ in 0..2 {
        let victim = machine_for_scale_down(&published_domains(), &expected).expect("victim");
        expected.retain(|m| m.name != victim);
    }
    standin::scale_control_plane(&client, NS, &example.control_plane_name(), 3)
        .await
        .expect("scaled");
    let three = wait_list(machines.clone(), "3 control plane machines", |ms| {
        settled(ms, is_control_plane, 3)
    })
    .await;
    assert_control_plane_spread(&three, 3);
    let mut remaining: Vec<String> = three
        .iter()
        .filter(|m| is_control_plane(m))
        .map(ResourceExt::name_any)
        .collect();
    remaining.sort();
    let mut expected: Vec<String> = expected.into_iter().map(|m| m.name).collect();
    expected.sort();
    assert_eq!(remaining, expected);

    // MachineDeployment 2 → 4 → 0: all in its domain, then all gone with their parts.
    standin::scale_workers(&client, NS, &example.workers_name(), 4)
        .await
        .expect("scaled");
    let workers = wait_list(machines.clone(), "4 workers", |ms| {
        settled(ms, is_worker, 4)
    })
    .await;
    assert!(
        workers
            .iter()
            .filter(|m| is_worker(m))
            .all(|m| m.spec.failure_domain.as_deref() == Some("rack-b"))
    );
    standin::scale_workers(&client, NS, &example.workers_name(), 0)
        .await
        .expect("scaled");
    wait_list(machines.clone(), "no workers", |ms| {
        !ms.iter().any(is_worker)
    })
    .await;
    wait_list(
        proxmox_machines.clone(),
        "no worker ProxmoxMachines",
        |pms| {
            !pms.iter()
                .any(|p| p.labels().contains_key(labels::DEPLOYMENT_NAME))
        },
    )
    .await;
    let secret_names: Vec<String> = secrets
        .list(&ListParams::default())
        .await
        .expect("list")
        .items
        .iter()
        .map(ResourceExt::name_any)
        .collect();
    assert!(
        workers
            .iter()
            .filter(|m| is_worker(m))
            .all(|m| !secret_names.contains(&bootstrap_secret_name(&m.name_any()))),
        "bootstrap secrets go with their machines: {secret_names:?}"
    );
    assert_control_plane_spread(
        &machines
            .list(&ListParams::default())
            .await
            .expect("list")
            .items,
        3,
    );

    // Deleting the Cluster removes everything, the Cluster last.
    clusters
        .delete("demo", &DeleteParams::default())
        .await
        .expect("cluster deleted");
    wait_gone(clusters.clone(), "demo", "cluster gone").await;
    assert!(
        machines
            .list(&ListParams::default())
            .await
            .expect("list")
            .items
            .is_empty()
    );
    assert!(
        proxmox_machines
            .list(&ListParams::default())
            .await
            .expect("list")
            .items
            .is_empty()
    );
    assert!(
        proxmox_clusters
            .get_opt("demo")
            .await
            .expect("get")
            .is_none()
    );
    for resource in [control_plane_resource(), deployment_resource()] {
        let api = Api::<DynamicObject>::namespaced_with(client.clone(), NS, &resource);
        assert!(
            api.list(&ListParams::default())
                .await
                .expect("list")
                .items
                .is_empty()
        );
    }
    let left: Vec<String> = secrets
        .list(&ListParams::default())
        .await
        .expect("list")
        .items
        .iter()
        .map(ResourceExt::name_any)
        .filter(|n| n.ends_with("-bootstrap"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

#[tokio::test]
async fn without_control_plane_domains_machines_get_no_failure_domain() {
    let server = server();
    let client = server.client();
    let stop = Stop(CancellationToken::new());
    CapiStandIn::spawn(client.clone(), NS, stop.0.clone());
    let mut example = example("plain");
    example.control_plane_replicas = 2;
    example.worker_replicas = 0;
    standin::create_example_cluster(&client, &example)
        .await
        .expect("example created");
    tokio::spawn(fake_provider(client.clone(), stop.0.clone()));
    Api::<ProxmoxCluster>::namespaced(client.clone(), NS)
        .patch_status(
            "plain",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {
                "initialization": {"provisioned": true},
                "failureDomains": [{"name": "rack-b", "controlPlane": false}],
            }})),
        )
        .await
        .expect("status patched");
    let machines = Api::<Machine>::namespaced(client.clone(), NS);
    let all = wait_list(machines, "2 control plane machines", |ms| {
        settled(ms, is_control_plane, 2)
    })
    .await;
    assert!(all.iter().all(|m| m.spec.failure_domain.is_none()));

    // Failure domains keep being copied after provisioning.
    Api::<ProxmoxCluster>::namespaced(client.clone(), NS)
        .patch_status(
            "plain",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"failureDomains": [{"name": "rack-z"}]}})),
        )
        .await
        .expect("status patched");
    let cluster = wait_one(
        Api::<Cluster>::namespaced(client.clone(), NS),
        "plain",
        "new domains",
        |c| {
            c.status
                .as_ref()
                .is_some_and(|s| s.failure_domains.iter().any(|d| d.name == "rack-z"))
        },
    )
    .await;
    assert_eq!(
        cluster.status.expect("status").failure_domains,
        [FailureDomain {
            name: "rack-z".into(),
            control_plane: Some(false),
            attributes: BTreeMap::new()
        }]
    );
}

#[tokio::test]
async fn a_template_created_late_is_picked_up() {
    let server = server();
    let client = server.client();
    let stop = Stop(CancellationToken::new());
    CapiStandIn::spawn(client.clone(), NS, stop.0.clone());
    let mut example = example("late");
    example.control_plane_replicas = 1;
    example.worker_replicas = 0;
    standin::create_example_cluster(&client, &example)
        .await
        .expect("example created");
    let templates = Api::<ProxmoxMachineTemplate>::namespaced(client.clone(), NS);
    let template = templates
        .get(&example.control_plane_name())
        .await
        .expect("template");
    templates
        .delete(&example.control_plane_name(), &DeleteParams::default())
        .await
        .expect("template deleted");
    Api::<ProxmoxCluster>::namespaced(client.clone(), NS)
        .patch_status(
            "late",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {
                "initialization": {"provisioned": true},
                "failureDomains": published_domains(),
            }})),
        )
        .await
        .expect("status patched");
    wait_one(
        Api::<Cluster>::namespaced(client.clone(), NS),
        "late",
        "infrastructure provisioned",
        |c| {
            c.status
                .as_ref()
                .and_then(|s| s.initialization.as_ref())
                .is_some()
        },
    )
    .await;
    let mut again = template.clone();
    again.metadata = kube::api::ObjectMeta {
        name: template.metadata.name.clone(),
        namespace: template.metadata.namespace.clone(),
        ..Default::default()
    };
    templates
        .create(&Default::default(), &again)
        .await
        .expect("template recreated");
    let machines = wait_list(
        Api::<Machine>::namespaced(client.clone(), NS),
        "control plane machine",
        |ms| ms.iter().any(is_control_plane),
    )
    .await;
    let machine = machines
        .iter()
        .find(|m| is_control_plane(m))
        .expect("machine");
    wait_one(
        Api::<ProxmoxMachine>::namespaced(client.clone(), NS),
        &machine.name_any(),
        "its ProxmoxMachine",
        |_| true,
    )
    .await;
}

#[tokio::test]
async fn a_paused_cluster_is_left_alone_until_unpaused() {
    let server = server();
    let client = server.client();
    let stop = Stop(CancellationToken::new());
    CapiStandIn::spawn(client.clone(), NS, stop.0.clone());
    for name in ["held", "other"] {
        let mut example = example(name);
        example.control_plane_replicas = 0;
        example.worker_replicas = 0;
        standin::create_example_cluster(&client, &example)
            .await
            .expect("example created");
    }
    let clusters = Api::<Cluster>::namespaced(client.clone(), NS);
    let proxmox_clusters = Api::<ProxmoxCluster>::namespaced(client.clone(), NS);
    let provision = |name: &'static str| {
        let api = proxmox_clusters.clone();
        async move {
            api.patch_status(
                name,
                &PatchParams::default(),
                &Patch::Merge(json!({"status": {
                    "initialization": {"provisioned": true},
                    "failureDomains": published_domains(),
                }})),
            )
            .await
            .expect("status patched");
        }
    };
    let provisioned = |c: &Cluster| {
        c.status
            .as_ref()
            .and_then(|s| s.initialization.as_ref())
            .and_then(|i| i.infrastructure_provisioned)
            == Some(true)
    };
    provision("held").await;
    wait_one(clusters.clone(), "held", "held provisioned", provisioned).await;

    clusters
        .patch(
            "held",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"paused": true}})),
        )
        .await
        .expect("paused");
    standin::scale_workers(&client, NS, "held-workers", 1)
        .await
        .expect("scaled");
    // The pass that provisions the other cluster has seen the pause and the scale-up.
    provision("other").await;
    wait_one(clusters.clone(), "other", "other provisioned", provisioned).await;
    let machines = Api::<Machine>::namespaced(client.clone(), NS);
    assert!(
        machines
            .list(&ListParams::default())
            .await
            .expect("list")
            .items
            .is_empty(),
        "nothing is created for a paused cluster"
    );

    clusters
        .patch(
            "held",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"paused": false}})),
        )
        .await
        .expect("unpaused");
    wait_list(machines, "the held worker", |ms| {
        ms.iter().any(|m| {
            m.labels().get(labels::DEPLOYMENT_NAME).map(String::as_str) == Some("held-workers")
        })
    })
    .await;
}
