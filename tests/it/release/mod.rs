//! The clusterctl release files (`make release-manifests` writes them to `out/`), one module
//! per subject: the manifests follow clusterctl's rules and `IMG=` sets the manager's image
//! (`manifests`), the cluster templates produce objects the CRDs and capmox accept (`flavors`,
//! `go_flavors`), the ClusterClass builds what the topology flavor needs (`cluster_class`), and
//! the Dockerfile's build stage copies everything the build needs (`dockerfile`). This file
//! holds what they share.

use std::collections::BTreeSet;

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::common::{TEMPLATE_VALUES, cargo, run_ok, substitute, tool};

mod cluster_class;
mod dockerfile;
mod flavors;
mod go_flavors;
mod manifests;

fn read_out(file: &str) -> String {
    let path = Path::new("out").join(file);
    std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; run `make release-manifests` (make test does)",
            path.display()
        )
    })
}

fn documents(text: &str) -> Vec<Value> {
    serde_norway::Deserializer::from_str(text)
        .map(|doc| serde::Deserialize::deserialize(doc).expect("valid YAML"))
        .filter(|v: &Value| !v.is_null())
        .collect()
}

fn components() -> Vec<Value> {
    documents(&read_out("infrastructure-components.yaml"))
}

/// The one object of `kind` named `name` in `namespace`.
fn find<'a>(objects: &'a [Value], kind: &str, namespace: &str, name: &str) -> &'a Value {
    let found: Vec<&Value> = objects
        .iter()
        .filter(|o| {
            o["kind"] == kind
                && o["metadata"]["namespace"] == namespace
                && o["metadata"]["name"] == name
        })
        .collect();
    assert_eq!(
        found.len(),
        1,
        "expected one {kind} {namespace}/{name} in the components"
    );
    found[0]
}

/// The `capmox run` flags the manager container passes.
fn manager_run_args(manager: &Value) -> capmox::cli::RunArgs {
    let mut command = vec!["capmox".to_owned()];
    command.extend(
        manager["args"]
            .as_array()
            .expect("args")
            .iter()
            .filter_map(|a| a.as_str().map(str::to_owned)),
    );
    let cli = <capmox::cli::Cli as clap::Parser>::try_parse_from(&command)
        .unwrap_or_else(|e| panic!("capmox rejects the Deployment's args: {e}"));
    match cli.command {
        capmox::cli::Command::Run(args) => *args,
        other => panic!("the manager runs {other:?}, not `capmox run`"),
    }
}

/// Every `${VAR}` of a template, without defaults (`$${VAR}` is a literal, not a variable).
fn variables(text: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let mut rest = text;
    while let Some(start) = rest.find("${") {
        let end = rest[start..].find('}').expect("closing brace") + start;
        if start == 0 || rest.as_bytes()[start - 1] != b'$' {
            let expr = &rest[start + 2..end];
            let name = expr.split([':', '=']).next().unwrap_or(expr);
            found.insert(name.to_owned());
        }
        rest = &rest[end + 1..];
    }
    found
}

/// The cluster templates (`clusterctl generate cluster [--flavor <flavor>]`).
const TEMPLATES: &[&str] = &[
    "cluster-template.yaml",
    "cluster-template-failure-domains.yaml",
    "cluster-template-external-creds.yaml",
    "cluster-template-proxmox-labels.yaml",
    "cluster-template-dual-stack.yaml",
    "cluster-template-multiple-vlans.yaml",
    "cluster-template-flatcar.yaml",
    "cluster-template-auto-image.yaml",
    "cluster-template-topology.yaml",
];

/// The ClusterClasses, named `clusterclass-<class name>.yaml` as clusterctl looks them up.
const CLUSTER_CLASSES: &[&str] = &["clusterclass-capmox.yaml"];

/// Kubernetes' own kinds a template may hold; they have no CRD to validate against.
const BUILTIN_KINDS: &[&str] = &["Secret"];

/// A template's objects with the test values substituted.
fn rendered(template: &str) -> Vec<Value> {
    documents(&substitute(&read_out(template), TEMPLATE_VALUES))
}

/// The schema for an object's kind and version: capmox's CRDs or the upstream ones.
fn schema_for(object: &Value) -> Option<Value> {
    let kind = object["kind"].as_str()?;
    let version = object["apiVersion"].as_str()?.rsplit('/').next()?;
    schema_of(kind, version)
}

fn schema_of(kind: &str, version: &str) -> Option<Value> {
    let mut files: Vec<std::path::PathBuf> = std::fs::read_dir("crds")
        .ok()?
        .map(|e| e.ok().map(|e| e.path()))
        .collect::<Option<_>>()?;
    let upstream = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/external-crds");
    for dir in [upstream.to_owned(), format!("{upstream}/template-kinds")] {
        files.extend(
            std::fs::read_dir(&dir)
                .unwrap_or_else(|e| panic!("cannot read {dir}: {e}"))
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "yaml")),
        );
    }
    files.into_iter().find_map(|file| {
        let crd: Value = serde_norway::from_str(&std::fs::read_to_string(&file).ok()?).ok()?;
        if crd["spec"]["names"]["kind"] != kind {
            return None;
        }
        let found = crd["spec"]["versions"]
            .as_array()?
            .iter()
            .find(|v| v["name"] == version)?
            .clone();
        Some(found["schema"]["openAPIV3Schema"].clone())
    })
}

/// Validates an object against its CRD, as the API server would on create; returns it defaulted.
fn validated(file: &str, object: &Value) -> Value {
    let kind = object["kind"].as_str().unwrap_or_default();
    let schema = schema_for(object)
        .unwrap_or_else(|| panic!("{file}: no CRD serves {kind} {}", object["apiVersion"]));
    capmox_testkit::schema::validate_object(&schema, object, None).unwrap_or_else(|violations| {
        panic!(
            "{file}: {kind} {}: {violations:#?}",
            object["metadata"]["name"]
        )
    })
}

/// Reads a Proxmox object into capmox's own types, which must take every field the template sets.
fn read_as_capmox(file: &str, object: &Value) {
    /// Without empty lists, which capmox's types leave out.
    fn pruned(value: &Value) -> Value {
        match value {
            Value::Object(map) => Value::Object(
                map.iter()
                    .filter(|(_, v)| v.as_array().is_none_or(|a| !a.is_empty()))
                    .map(|(k, v)| (k.clone(), pruned(v)))
                    .collect(),
            ),
            Value::Array(items) => Value::Array(items.iter().map(pruned).collect()),
            other => other.clone(),
        }
    }
    fn same<T: serde::de::DeserializeOwned + serde::Serialize>(file: &str, object: &Value) {
        let typed: T = serde_json::from_value(object.clone())
            .unwrap_or_else(|e| panic!("{file}: {} does not read: {e}", object["kind"]));
        let back = serde_json::to_value(&typed).expect("serializes");
        assert_eq!(
            pruned(&back["spec"]),
            pruned(&object["spec"]),
            "{file}: {} {} loses fields in capmox's types",
            object["kind"],
            object["metadata"]["name"]
        );
    }
    match object["kind"].as_str() {
        Some("ProxmoxCluster") => same::<capmox::api::ProxmoxCluster>(file, object),
        Some("ProxmoxClusterTemplate") => same::<capmox::api::ProxmoxClusterTemplate>(file, object),
        Some("ProxmoxMachine") => same::<capmox::api::ProxmoxMachine>(file, object),
        Some("ProxmoxMachineTemplate") => same::<capmox::api::ProxmoxMachineTemplate>(file, object),
        _ => {}
    }
}

/// The objects of one kind in a rendered template.
fn of_kind<'a>(objects: &'a [Value], kind: &str) -> Vec<&'a Value> {
    objects.iter().filter(|o| o["kind"] == kind).collect()
}

/// The object of a kind and name in a rendered template.
fn named<'a>(objects: &'a [Value], kind: &str, name: &Value) -> &'a Value {
    objects
        .iter()
        .find(|o| o["kind"] == kind && &o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name} in the template"))
}

/// The single ProxmoxCluster of a rendered template, defaulted by its CRD.
fn proxmox_cluster(file: &str, objects: &[Value]) -> Value {
    let clusters = of_kind(objects, "ProxmoxCluster");
    assert_eq!(clusters.len(), 1, "{file}: one ProxmoxCluster");
    validated(file, clusters[0])
}

/// A group of machines a template asks for: the owner, its ProxmoxMachineTemplate and the
/// failure domains its machines may get.
struct MachineGroup {
    owner: String,
    template: Value,
    failure_domains: Vec<Option<String>>,
}

/// The machine groups of a template: the control plane (in each control-plane failure domain)
/// and every MachineDeployment (in its own).
fn machine_groups(file: &str, objects: &[Value], cluster: &Value) -> Vec<MachineGroup> {
    let typed = typed_cluster(file, cluster);
    let control_plane_domains: Vec<Option<String>> = {
        let domains: Vec<Option<String>> = typed
            .status
            .iter()
            .flat_map(|s| &s.failure_domains)
            .filter(|d| d.control_plane == Some(true))
            .map(|d| Some(d.name.clone()))
            .collect();
        if domains.is_empty() {
            vec![None]
        } else {
            domains
        }
    };
    let mut groups = Vec::new();
    for kcp in of_kind(objects, "KubeadmControlPlane") {
        let reference = &kcp["spec"]["machineTemplate"]["spec"]["infrastructureRef"];
        groups.push(MachineGroup {
            owner: format!("KubeadmControlPlane {}", kcp["metadata"]["name"]),
            template: named(objects, "ProxmoxMachineTemplate", &reference["name"]).clone(),
            failure_domains: control_plane_domains.clone(),
        });
    }
    for deployment in of_kind(objects, "MachineDeployment") {
        let spec = &deployment["spec"]["template"]["spec"];
        groups.push(MachineGroup {
            owner: format!("MachineDeployment {}", deployment["metadata"]["name"]),
            template: named(
                objects,
                "ProxmoxMachineTemplate",
                &spec["infrastructureRef"]["name"],
            )
            .clone(),
            failure_domains: vec![spec["failureDomain"].as_str().map(str::to_owned)],
        });
    }
    groups
}

/// The ProxmoxCluster in capmox's types, with the failure domains capmox would publish.
fn typed_cluster(file: &str, cluster: &Value) -> capmox::api::ProxmoxCluster {
    let mut typed: capmox::api::ProxmoxCluster =
        serde_json::from_value(cluster.clone()).expect("a ProxmoxCluster");
    let domains = capmox::placement::failure_domains(&typed)
        .unwrap_or_else(|e| panic!("{file}: capmox refuses the zones: {e}"));
    typed
        .status
        .get_or_insert_with(Default::default)
        .failure_domains = domains;
    typed
}

/// Where capmox places each machine of each group (one per failure domain), as the machine
/// controller resolves it.
fn placements(
    file: &str,
    cluster: &Value,
    groups: &[MachineGroup],
) -> Vec<(String, capmox::placement::Placement)> {
    let typed = typed_cluster(file, cluster);
    let cluster_name = cluster["metadata"]["name"].as_str().expect("named");
    let mut out = Vec::new();
    for group in groups {
        let template = validated(file, &group.template);
        for (index, failure_domain) in group.failure_domains.iter().enumerate() {
            let name = format!("{cluster_name}-machine-{index}");
            let machine: capmox::api::ProxmoxMachine = serde_json::from_value(serde_json::json!({
                "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha2",
                "kind": "ProxmoxMachine",
                "metadata": {"name": name, "namespace": "default"},
                "spec": template["spec"]["template"]["spec"],
            }))
            .expect("a ProxmoxMachine");
            let capi_machine: capmox::capi::Machine = serde_json::from_value(serde_json::json!({
                "apiVersion": "cluster.x-k8s.io/v1beta2",
                "kind": "Machine",
                "metadata": {"name": name, "namespace": "default"},
                "spec": {"clusterName": cluster_name, "failureDomain": failure_domain},
            }))
            .expect("a Machine");
            let placement = capmox::placement::Placement::resolve(&typed, &machine, &capi_machine)
                .unwrap_or_else(|e| {
                    panic!(
                        "{file}: capmox cannot place a machine of {} in {failure_domain:?}: {e}",
                        group.owner
                    )
                });
            out.push((group.owner.clone(), placement));
        }
    }
    out
}

/// The pools a NIC of a placement claims from, by name.
fn pools_of(placement: &capmox::placement::Placement, nic: &str) -> Vec<String> {
    placement
        .network_devices()
        .iter()
        .find(|n| n.name == nic)
        .unwrap_or_else(|| panic!("no {nic} on {}", placement.machine_name()))
        .pools
        .iter()
        .map(|p| p.pool.name.clone())
        .collect()
}

/// The objects a flavor gives the management cluster: the rendered template, or for the topology
/// flavor what Cluster API makes of its Cluster with the ClusterClass.
fn flavor_objects(template: &str) -> Vec<Value> {
    if template == "cluster-template-topology.yaml" {
        cluster_class::topology_objects()
    } else {
        rendered(template)
    }
}

/// A temporary directory removed on drop.
pub(crate) struct TempDir(pub(crate) PathBuf);

impl TempDir {
    /// `capmox-<tag>-<process id>` in the system's temporary directory.
    pub(crate) fn new(tag: &str) -> Self {
        Self::at(std::env::temp_dir().join(format!("capmox-{tag}-{}", std::process::id())))
    }

    fn at(path: PathBuf) -> Self {
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).expect("create a temporary directory");
        Self(path)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The release files of `make release-manifests SECRET_NAMESPACES=...` (in a directory of
/// their own, `tag` telling it apart): infrastructure-components.yaml and the namespaces' Roles.
pub(crate) fn namespaced_secrets_release(tag: &str, namespaces: &str) -> (Vec<Value>, Vec<Value>) {
    let out = TempDir::new(tag);
    run_ok(
        tool("make")
            .args(["--no-print-directory", "release-manifests"])
            .arg(format!("SECRET_NAMESPACES={namespaces}"))
            .arg(format!("OUT={}", out.0.display())),
        &format!("make release-manifests SECRET_NAMESPACES={namespaces:?}"),
    );
    let read = |file: &str| {
        let path = out.0.join(file);
        documents(
            &std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())),
        )
    };
    (
        read("infrastructure-components.yaml"),
        read("secret-namespaces-rbac.yaml"),
    )
}

const KUBE_VIP_MANIFEST: &str = "/etc/kubernetes/manifests/kube-vip.yaml";

const KUBE_VIP_PREPARE: &str = "/etc/kube-vip-prepare.sh";

/// The content of the one file at `path` of a kubeadm configuration.
fn kubeadm_file<'a>(file: &str, config: &'a Value, path: &str) -> &'a Value {
    let found: Vec<&Value> = config["files"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|f| f["path"] == path)
        .collect();
    assert_eq!(found.len(), 1, "{file}: one {path} among the files");
    found[0]
}
