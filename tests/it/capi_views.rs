//! The read-only CAPI/IPAM views only use field paths that exist, with the same types, in the
//! upstream CRDs (`tests/data/external-crds`), so a typo can never silently read nothing.

use std::path::Path;

use capmox::capi::{
    Cluster, GlobalInClusterIPPool, IPAddress, IPAddressClaim, InClusterIPPool, Machine,
};
use kube::CustomResourceExt;
use serde_json::Value;

fn upstream_schema(file: &str, version: &str) -> Option<Value> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/external-crds")
        .join(file);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    let crd: Value = serde_norway::from_str(&text).expect("upstream CRD parses");
    let versions = crd["spec"]["versions"].as_array()?.clone();
    let found = versions.into_iter().find(|v| v["name"] == version)?;
    Some(found["schema"]["openAPIV3Schema"].clone())
}

fn our_schema(
    crd: k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
) -> Value {
    let schema = crd.spec.versions[0]
        .schema
        .clone()
        .and_then(|s| s.open_api_v3_schema)
        .expect("schema");
    serde_json::to_value(schema).expect("json")
}

/// Every (path, type) of ours that upstream lacks or types differently.
fn mismatches(ours: &Value, upstream: &Value, path: &str, out: &mut Vec<String>) {
    let our_type = ours.get("type").and_then(Value::as_str);
    let upstream_type = upstream.get("type").and_then(Value::as_str);
    if our_type.is_some() && our_type != upstream_type {
        out.push(format!(
            "{path}: type {our_type:?} upstream {upstream_type:?}"
        ));
    }
    if let Some(properties) = ours.get("properties").and_then(Value::as_object) {
        for (name, child) in properties {
            let child_path = format!("{path}.{name}");
            if path.is_empty() && ["apiVersion", "kind", "metadata"].contains(&name.as_str()) {
                continue;
            }
            match upstream.get("properties").and_then(|p| p.get(name)) {
                Some(upstream_child) => mismatches(child, upstream_child, &child_path, out),
                None => out.push(format!("{child_path}: not in the upstream CRD")),
            }
        }
    }
    if let (Some(items), Some(upstream_items)) = (ours.get("items"), upstream.get("items")) {
        mismatches(items, upstream_items, &format!("{path}[]"), out);
    }
}

#[test]
fn every_view_field_exists_upstream() {
    let cases = [
        ("cluster.x-k8s.io_clusters.yaml", "v1beta2", Cluster::crd()),
        ("cluster.x-k8s.io_machines.yaml", "v1beta2", Machine::crd()),
        (
            "ipam.cluster.x-k8s.io_ipaddressclaims.yaml",
            "v1beta2",
            IPAddressClaim::crd(),
        ),
        (
            "ipam.cluster.x-k8s.io_ipaddresses.yaml",
            "v1beta2",
            IPAddress::crd(),
        ),
        (
            "ipam.cluster.x-k8s.io_inclusterippools.yaml",
            "v1alpha2",
            InClusterIPPool::crd(),
        ),
        (
            "ipam.cluster.x-k8s.io_globalinclusterippools.yaml",
            "v1alpha2",
            GlobalInClusterIPPool::crd(),
        ),
    ];
    let mut found = Vec::new();
    let mut paths = 0;
    for (file, version, crd) in cases {
        let name = crd.spec.names.kind.clone();
        let upstream =
            upstream_schema(file, version).unwrap_or_else(|| panic!("{file} has {version}"));
        let ours = our_schema(crd);
        paths += serde_json::to_string(&ours)
            .expect("json")
            .matches("\"type\"")
            .count();
        let mut here = Vec::new();
        mismatches(&ours, &upstream, "", &mut here);
        found.extend(here.into_iter().map(|m| format!("{name}: {m}")));
    }
    assert!(found.is_empty(), "{found:#?}");
    assert!(paths > 40, "the views cover only {paths} typed nodes");
}

#[test]
fn a_real_machine_decodes_into_the_view() {
    let machine: Machine = serde_json::from_value(serde_json::json!({
        "apiVersion": "cluster.x-k8s.io/v1beta2",
        "kind": "Machine",
        "metadata": {"name": "demo-cp-1", "namespace": "default"},
        "spec": {
            "clusterName": "demo",
            "version": "v1.33.0",
            "failureDomain": "rack-a",
            "bootstrap": {"dataSecretName": "demo-cp-1-bootstrap", "configRef": {"apiGroup": "bootstrap.cluster.x-k8s.io", "kind": "KubeadmConfig", "name": "x"}},
            "infrastructureRef": {"apiGroup": "infrastructure.cluster.x-k8s.io", "kind": "ProxmoxMachine", "name": "demo-cp-1"}
        },
        "status": {"nodeRef": {"name": "demo-cp-1"}, "phase": "Running"}
    }))
    .expect("decodes, ignoring fields capmox does not read");
    assert_eq!(machine.spec.failure_domain.as_deref(), Some("rack-a"));
    assert_eq!(
        machine
            .spec
            .bootstrap
            .and_then(|b| b.data_secret_name)
            .as_deref(),
        Some("demo-cp-1-bootstrap")
    );
    assert_eq!(
        machine
            .status
            .and_then(|s| s.node_ref)
            .map(|n| n.name)
            .as_deref(),
        Some("demo-cp-1")
    );
}
