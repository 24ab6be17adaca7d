//! ProxmoxMachineTemplate `status.capacity` and `status.nodeInfo` for the Cluster Autoscaler's
//! scale from zero: the field names of the contract, the v1alpha1 round trip, how the capacity
//! is computed, and the template controller against the in-process API server and the Proxmox
//! simulator (from the spec, from the Proxmox template, after a spec edit, without a cluster).

use std::collections::BTreeMap;

use capmox::api::conversion::{CONVERSION_DATA, convert};
use capmox::api::{
    NodeArchitecture, NodeOperatingSystem, ProxmoxMachineSpec, ProxmoxMachineTemplate,
    ProxmoxMachineTemplateStatus, TemplateNodeInfo,
};
use capmox::controller::template::resolve_capacity;
use capmox::proxmox::VmConfig;
use capmox_sim::{SimOptions, Topology};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

use crate::common::env::{ENV_WAIT, Env};

const V1ALPHA1: &str = "infrastructure.cluster.x-k8s.io/v1alpha1";
const V1ALPHA2: &str = "infrastructure.cluster.x-k8s.io/v1alpha2";

/// The Cluster Autoscaler's clusterapi provider reads exactly these paths of an infrastructure
/// machine template (Cluster API proposal "Opt-in Autoscaling from Zero"): the resource names
/// of `corev1.ResourceList` under `status.capacity`, and `corev1.NodeSystemInfo`'s
/// `architecture` and `operatingSystem` under `status.nodeInfo`, with Go's GOARCH/GOOS values.
#[test]
fn status_field_names_follow_the_autoscaler_contract() {
    let status = ProxmoxMachineTemplateStatus {
        capacity: BTreeMap::from([
            ("cpu".to_owned(), Quantity("4".into())),
            ("memory".to_owned(), Quantity("8192Mi".into())),
            ("ephemeral-storage".to_owned(), Quantity("20Gi".into())),
        ]),
        node_info: Some(TemplateNodeInfo {
            architecture: Some(NodeArchitecture::Arm64),
            operating_system: Some(NodeOperatingSystem::Linux),
        }),
        conditions: Vec::new(),
    };
    assert_eq!(
        serde_json::to_value(&status).expect("serializes"),
        json!({
            "capacity": {"cpu": "4", "memory": "8192Mi", "ephemeral-storage": "20Gi"},
            "nodeInfo": {"architecture": "arm64", "operatingSystem": "linux"}
        })
    );
    assert_eq!(capmox::api::CAPACITY_CPU, "cpu");
    assert_eq!(capmox::api::CAPACITY_MEMORY, "memory");
    assert_eq!(capmox::api::CAPACITY_EPHEMERAL_STORAGE, "ephemeral-storage");

    let crd = capmox::api::crd::all()
        .expect("CRDs render")
        .into_iter()
        .find(|c| c.spec.names.kind == "ProxmoxMachineTemplate")
        .expect("template CRD");
    let served = crd
        .spec
        .versions
        .iter()
        .find(|v| v.name == "v1alpha2")
        .expect("v1alpha2");
    assert!(
        served
            .subresources
            .as_ref()
            .is_some_and(|s| s.status.is_some()),
        "the controller writes status through the status subresource"
    );
    let schema = capmox::api::crd::schema_json(&crd).expect("schema");
    let status = &schema["properties"]["status"]["properties"];
    // Values are strings: the autoscaler reads the map as strings.
    assert_eq!(
        status["capacity"]["additionalProperties"]["type"], "string",
        "{status:#}"
    );
    assert_eq!(
        status["nodeInfo"]["properties"]["architecture"]["enum"],
        json!(["amd64", "arm64", "s390x", "ppc64le"])
    );
    assert_eq!(
        status["nodeInfo"]["properties"]["operatingSystem"]["enum"],
        json!(["linux", "windows"])
    );
}

/// v1alpha1 templates have no status: it travels in the conversion annotation and comes back
/// whole, even after a v1alpha1 client dropped the field it does not know.
#[test]
fn the_status_survives_a_round_trip_through_v1alpha1() {
    let template = json!({
        "apiVersion": V1ALPHA2, "kind": "ProxmoxMachineTemplate",
        "metadata": {"name": "t", "namespace": "default"},
        "spec": {"template": {"spec": {"sourceNode": "pve1", "templateID": 9000,
            "network": {"networkDevices": [{"name": "net0", "bridge": "vmbr0"}]}}}},
        "status": {
            "capacity": {"cpu": "4", "memory": "8192Mi", "ephemeral-storage": "20Gi"},
            "nodeInfo": {"architecture": "amd64", "operatingSystem": "linux"}
        }
    });
    let mut old = convert(template.clone(), V1ALPHA1).expect("converts");
    assert!(
        old.get("status").is_none(),
        "v1alpha1 has no status: {old:#}"
    );
    assert!(old["metadata"]["annotations"][CONVERSION_DATA].is_string());
    old["metadata"]["labels"] = json!({"edited": "yes"});
    let back = convert(old, V1ALPHA2).expect("converts back");
    let mut expected = template.clone();
    expected["metadata"]["labels"] = json!({"edited": "yes"});
    assert_eq!(back, expected);
}

fn spec(value: Value) -> ProxmoxMachineSpec {
    let mut value = value;
    value["network"] = json!({"networkDevices": [{"name": "net0", "bridge": "vmbr0"}]});
    serde_json::from_value(value).expect("machine spec")
}

fn config(value: Value) -> VmConfig {
    serde_json::from_value(value).expect("VM config")
}

fn quantities(pairs: &[(&str, &str)]) -> BTreeMap<String, Quantity> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), Quantity((*v).to_owned())))
        .collect()
}

#[test]
fn capacity_takes_the_spec_first_then_the_proxmox_template() {
    // Everything in the spec; the template's bigger disk wins (disks only grow).
    let explicit = spec(
        json!({"sourceNode": "pve1", "templateID": 9000, "numSockets": 2,
        "numCores": 2, "memoryMiB": 8192, "disks": {"bootVolume": {"disk": "scsi0", "sizeGb": 20}}}),
    );
    let small = config(
        json!({"sockets": 1, "cores": 1, "memory": "2048", "scsi0": "ceph:base-9000-disk-0,size=10G"}),
    );
    let resolved = resolve_capacity(&explicit, Some(&small));
    assert_eq!(
        resolved.capacity,
        quantities(&[
            ("cpu", "4"),
            ("memory", "8192Mi"),
            ("ephemeral-storage", "20Gi")
        ])
    );
    assert!(resolved.missing.is_empty());
    let big = config(json!({"scsi0": "ceph:base-9000-disk-0,size=1T"}));
    assert_eq!(
        resolve_capacity(&explicit, Some(&big)).capacity["ephemeral-storage"],
        Quantity("1Ti".into())
    );

    // Nothing in the spec: the template's config, its boot disk past a CD-ROM, arm64 Windows.
    let bare = spec(json!({"templateSelector": {"matchTags": ["arm"]}}));
    let arm = config(json!({
        "sockets": "2", "cores": 3, "memory": "current=6144,shares=1000",
        "ide2": "none,media=cdrom", "scsi0": "local:base-9001-disk-0,size=1536M",
        "boot": "order=ide2;scsi0;net0", "arch": "aarch64", "ostype": "win11"
    }));
    let resolved = resolve_capacity(&bare, Some(&arm));
    assert_eq!(
        resolved.capacity,
        quantities(&[
            ("cpu", "6"),
            ("memory", "6144Mi"),
            ("ephemeral-storage", "1536Mi")
        ])
    );
    assert_eq!(
        resolved.node_info,
        TemplateNodeInfo {
            architecture: Some(NodeArchitecture::Arm64),
            operating_system: Some(NodeOperatingSystem::Windows)
        }
    );

    // Proxmox's defaults for what a config leaves out: 1 socket, 1 core, 512 MiB, x86_64, Linux.
    let resolved = resolve_capacity(&bare, Some(&config(json!({"virtio0": "local:x,size=8G"}))));
    assert_eq!(
        resolved.capacity,
        quantities(&[
            ("cpu", "1"),
            ("memory", "512Mi"),
            ("ephemeral-storage", "8Gi")
        ])
    );
    assert_eq!(
        resolved.node_info.architecture,
        Some(NodeArchitecture::Amd64)
    );

    // Without the template: only what the spec gives.
    let partial = spec(
        json!({"sourceNode": "pve1", "templateID": 9000, "numCores": 2,
        "memoryMiB": 2048}),
    );
    let resolved = resolve_capacity(&partial, None);
    assert_eq!(resolved.capacity, quantities(&[("memory", "2048Mi")]));
    assert_eq!(
        resolved.missing,
        ["cpu", "ephemeral-storage", "nodeInfo"],
        "sockets are the template's"
    );
}

/// Two Proxmox templates: an x86 Linux one by VMID and an arm64 Windows one found by tags.
const TOPOLOGY: &str = r#"
cluster_name: sandbox
nodes:
  - {name: pve1, memory_mib: 65536, cores: 16}
  - {name: pve2, memory_mib: 65536, cores: 16}
storages:
  - {name: local, type: dir, content: [iso, vztmpl, snippets, images]}
  - {name: ceph, type: rbd, shared: true, content: [images], size_gib: 4096}
templates:
  - {vmid: 9000, name: ubuntu, node: pve1, tags: [capmox, ubuntu], storage: ceph, disk_gib: 10, memory_mib: 2048, cores: 2}
  - {vmid: 9001, name: arm-windows, node: pve2, tags: [capmox, arm], storage: ceph, disk_gib: 40, memory_mib: 6144, cores: 3, config: {sockets: "2", arch: aarch64, ostype: win11, ide2: "none,media=cdrom", boot: "order=ide2;scsi0"}}
"#;

fn cluster_spec() -> Value {
    json!({
        "controlPlaneEndpoint": {"host": "10.0.0.10", "port": 6443},
        "dnsServers": ["10.0.0.2"],
        "ipv4Config": {"addresses": ["10.0.0.100-10.0.0.150"], "prefix": 24, "gateway": "10.0.0.1"},
        "credentialsRef": {"name": "demo-credentials"}
    })
}

async fn create_template(env: &Env, name: &str, cluster: Option<&str>, machine: Value) {
    let mut machine = machine;
    machine["network"] = json!({"networkDevices": [{"name": "net0", "bridge": "vmbr0"}]});
    let mut metadata = json!({"name": name, "namespace": "default"});
    if let Some(cluster) = cluster {
        metadata["labels"] = json!({"cluster.x-k8s.io/cluster-name": cluster});
    }
    let template: ProxmoxMachineTemplate = serde_json::from_value(json!({
        "apiVersion": V1ALPHA2, "kind": "ProxmoxMachineTemplate",
        "metadata": metadata,
        "spec": {"template": {"spec": machine}}
    }))
    .expect("template");
    Api::<ProxmoxMachineTemplate>::namespaced(env.client(), "default")
        .create(&PostParams::default(), &template)
        .await
        .expect("template created");
}

/// Waits (driven by the API server's events) until the template's status satisfies `done`.
async fn wait_status(env: &Env, name: &str, what: &str, done: impl Fn(&Value) -> bool) -> Value {
    match env
        .server
        .wait_for("proxmoxmachinetemplates", "default", name, ENV_WAIT, |t| {
            t.is_some_and(|t| done(&t["status"]))
        })
        .await
    {
        Ok(Some(template)) => template["status"].clone(),
        other => panic!(
            "{name}: timed out waiting for {what}: {other:?}; last seen: {:#?}",
            env.server
                .object("proxmoxmachinetemplates", "default", name)
        ),
    }
}

fn resolved(status: &Value) -> Option<(&str, &str, &str)> {
    status["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == "CapacityResolved")
        .map(|c| {
            (
                c["status"].as_str().unwrap_or_default(),
                c["reason"].as_str().unwrap_or_default(),
                c["message"].as_str().unwrap_or_default(),
            )
        })
}

#[tokio::test]
async fn templates_publish_capacity_from_the_spec_and_the_proxmox_template() {
    let topology = Topology::from_yaml(TOPOLOGY, "template capacity").expect("topology");
    let env = Env::start_with_topology(topology, SimOptions::default()).await;
    env.create_credentials("demo-credentials", None).await;
    let uid = env.create_capi_cluster("demo").await;
    env.create_proxmox_cluster("demo", &uid, cluster_spec())
        .await;
    create_template(
        &env,
        "explicit",
        Some("demo"),
        json!({"sourceNode": "pve1", "templateID": 9000, "numSockets": 2, "numCores": 2,
               "memoryMiB": 8192, "disks": {"bootVolume": {"disk": "scsi0", "sizeGb": 20}}}),
    )
    .await;
    create_template(
        &env,
        "by-id",
        Some("demo"),
        json!({"sourceNode": "pve1", "templateID": 9000}),
    )
    .await;
    create_template(
        &env,
        "by-tags",
        Some("demo"),
        json!({"templateSelector": {"matchTags": ["capmox", "arm"]}}),
    )
    .await;
    create_template(
        &env,
        "gone",
        Some("demo"),
        json!({"sourceNode": "pve1", "templateID": 9999, "numSockets": 1, "numCores": 2}),
    )
    .await;
    env.run_controllers();

    // A template Proxmox does not have: its failure in the condition, the spec's part published.
    let gone = wait_status(&env, "gone", "a condition", |s| resolved(s).is_some()).await;
    let (status, reason, message) = resolved(&gone).expect("condition");
    assert_eq!(status, "False", "{message}");
    assert!(
        message.contains("reading template 9999 on pve1"),
        "{reason}: {message}"
    );
    assert_eq!(gone["capacity"], json!({"cpu": "2"}));

    let explicit = wait_status(&env, "explicit", "capacity", |s| {
        resolved(s).is_some_and(|c| c.0 == "True")
    })
    .await;
    assert_eq!(
        explicit["capacity"],
        json!({"cpu": "4", "memory": "8192Mi", "ephemeral-storage": "20Gi"})
    );
    assert_eq!(
        explicit["nodeInfo"],
        json!({"architecture": "amd64", "operatingSystem": "linux"})
    );
    assert_eq!(
        explicit["conditions"]
            .as_array()
            .expect("conditions")
            .iter()
            .find(|c| c["type"] == "Ready")
            .map(|c| c["status"].clone()),
        Some(json!("True"))
    );

    // Unset fields are the Proxmox template's.
    let by_id = wait_status(&env, "by-id", "capacity", |s| {
        resolved(s).is_some_and(|c| c.0 == "True")
    })
    .await;
    assert_eq!(
        by_id["capacity"],
        json!({"cpu": "2", "memory": "2048Mi", "ephemeral-storage": "10Gi"})
    );
    let by_tags = wait_status(&env, "by-tags", "capacity", |s| {
        resolved(s).is_some_and(|c| c.0 == "True")
    })
    .await;
    assert_eq!(
        by_tags["capacity"],
        json!({"cpu": "6", "memory": "6144Mi", "ephemeral-storage": "40Gi"})
    );
    assert_eq!(
        by_tags["nodeInfo"],
        json!({"architecture": "arm64", "operatingSystem": "windows"})
    );

    // A spec edit is followed.
    Api::<ProxmoxMachineTemplate>::namespaced(env.client(), "default")
        .patch(
            "explicit",
            &PatchParams::default(),
            &Patch::Merge(
                json!({"spec": {"template": {"spec": {"numCores": 4, "memoryMiB": 16384}}}}),
            ),
        )
        .await
        .expect("spec edited");
    let edited = wait_status(&env, "explicit", "the edit", |s| {
        s["capacity"]["cpu"] == "8"
    })
    .await;
    assert_eq!(
        edited["capacity"],
        json!({"cpu": "8", "memory": "16384Mi", "ephemeral-storage": "20Gi"})
    );
}

#[tokio::test]
async fn a_template_without_its_cluster_publishes_the_spec_and_says_what_is_missing() {
    let env = Env::start().await;
    env.create_credentials("demo-credentials", None).await;
    create_template(
        &env,
        "orphan",
        Some("ghost"),
        json!({"sourceNode": "pve1", "templateID": 9000, "numCores": 2, "memoryMiB": 4096,
               "disks": {"bootVolume": {"disk": "scsi0", "sizeGb": 30}}}),
    )
    .await;
    create_template(
        &env,
        "unlabelled",
        None,
        json!({"sourceNode": "pve1", "templateID": 9000, "numSockets": 1, "numCores": 2}),
    )
    .await;
    env.run_controllers();

    let orphan = wait_status(&env, "orphan", "a condition", |s| resolved(s).is_some()).await;
    let (status, reason, message) = resolved(&orphan).expect("condition");
    assert_eq!((status, reason), ("False", "ProxmoxClusterNotFound"));
    assert!(message.contains("\"ghost\""), "{message}");
    assert!(message.contains("unknown: cpu"), "{message}");
    // Sockets are left to the template, so the CPU count is not known.
    assert_eq!(
        orphan["capacity"],
        json!({"memory": "4096Mi", "ephemeral-storage": "30Gi"})
    );

    let unlabelled =
        wait_status(&env, "unlabelled", "a condition", |s| resolved(s).is_some()).await;
    let (status, reason, _) = resolved(&unlabelled).expect("condition");
    assert_eq!((status, reason), ("False", "ClusterNameLabelMissing"));
    assert_eq!(unlabelled["capacity"], json!({"cpu": "2"}));

    // The cluster turns up: the template is woken by the watch and resolved from Proxmox.
    let uid = env.create_capi_cluster("ghost").await;
    let mut spec = cluster_spec();
    spec["credentialsRef"] = json!({"name": "demo-credentials"});
    env.create_proxmox_cluster("ghost", &uid, spec).await;
    let found = wait_status(&env, "orphan", "resolution", |s| {
        resolved(s).is_some_and(|c| c.0 == "True")
    })
    .await;
    // The sandbox template 9000 has one socket and a 10 GiB disk (grown to 30 GiB).
    assert_eq!(
        found["capacity"],
        json!({"cpu": "2", "memory": "4096Mi", "ephemeral-storage": "30Gi"})
    );
}
