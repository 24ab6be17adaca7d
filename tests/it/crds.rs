//! The published CRDs: in sync with `crds/`, structural, valid CEL, and wire-compatible with the
//! Go provider's v1alpha2 schemas (`tests/data/go-provider/crds`).

use std::collections::BTreeSet;
use std::path::Path;

use capmox::api::{NET_NAME_PATTERN, crd, names};
use capmox_testkit::schema::{cel_compile_errors, structural_violations};
use serde_json::Value;

fn generated()
-> Vec<k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition>
{
    crd::all().expect("CRDs render")
}

/// The kinds capmox added to the Go provider's (remediation): v1alpha2 only, nothing to convert
/// and no Go schema to stay compatible with.
const CAPMOX_ONLY: &[&str] = &["ProxmoxRemediation", "ProxmoxRemediationTemplate"];

/// The CRDs of the kinds the Go provider has too.
fn shared_with_go()
-> Vec<k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition>
{
    generated()
        .into_iter()
        .filter(|crd| !CAPMOX_ONLY.contains(&crd.spec.names.kind.as_str()))
        .collect()
}

#[test]
fn committed_crds_match_the_generated_ones() {
    let mut expected_files = BTreeSet::new();
    for crd in generated() {
        let name = crd::file_name(&crd);
        let path = Path::new("crds").join(&name);
        let committed = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("{}: {e}; run `make crds`", path.display()));
        assert!(
            committed == crd::to_yaml(&crd).expect("yaml"),
            "{} differs from the generated CRD; run `make crds` and commit the result",
            path.display()
        );
        expected_files.insert(name);
    }
    let present: BTreeSet<String> = std::fs::read_dir("crds")
        .expect("crds/ exists")
        .map(|e| {
            e.expect("dir entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    assert_eq!(
        present, expected_files,
        "crds/ holds exactly the generated CRDs"
    );
}

#[test]
fn crds_carry_the_capi_contract_label_and_names() {
    for crd in generated() {
        let labels = crd.metadata.labels.clone().unwrap_or_default();
        assert_eq!(
            labels.get("cluster.x-k8s.io/v1beta2").map(String::as_str),
            Some("v1alpha2")
        );
        assert_eq!(
            crd.metadata.name.as_deref(),
            Some(format!("{}.{}", crd.spec.names.plural, crd.spec.group).as_str())
        );
        assert!(
            crd.spec
                .names
                .categories
                .clone()
                .unwrap_or_default()
                .contains(&"cluster-api".to_owned())
        );
        let versions: Vec<(&str, bool, bool, bool)> = crd
            .spec
            .versions
            .iter()
            .map(|v| {
                (
                    v.name.as_str(),
                    v.served,
                    v.storage,
                    v.deprecated == Some(true),
                )
            })
            .collect();
        if CAPMOX_ONLY.contains(&crd.spec.names.kind.as_str()) {
            assert_eq!(
                versions,
                [("v1alpha2", true, true, false)],
                "capmox's own kinds"
            );
            assert!(crd.spec.conversion.is_none(), "nothing to convert");
            continue;
        }
        assert_eq!(
            versions,
            [
                ("v1alpha2", true, true, false),
                ("v1alpha1", true, false, true)
            ],
            "v1alpha2 is stored, v1alpha1 is still served (deprecated)"
        );
    }
}

#[test]
fn every_schema_is_structural_and_every_cel_rule_compiles() {
    for (crd, version) in generated().into_iter().flat_map(|crd| {
        let versions: Vec<String> = crd.spec.versions.iter().map(|v| v.name.clone()).collect();
        versions.into_iter().map(move |v| (crd.clone(), v))
    }) {
        let version = version.as_str();
        let schema = crd::schema_json_of(&crd, version).expect("schema");
        let name = format!(
            "{} {version}",
            crd.metadata.name.clone().unwrap_or_default()
        );
        let violations = structural_violations(&schema);
        assert!(
            violations.is_empty(),
            "{name} is not structural: {violations:#?}"
        );
        let errors = cel_compile_errors(&schema);
        assert!(
            errors.is_empty(),
            "{name} has CEL rules that do not compile: {errors:#?}"
        );
        let rules = serde_json::to_string(&schema)
            .expect("json")
            .matches("\"rule\"")
            .count();
        assert!(
            rules > 0 || !name.starts_with("proxmoxmachine"),
            "{name} lost its CEL rules"
        );
    }
}

/// Keys whose values must agree between the Go provider's schema and ours.
const CONSTRAINTS: &[&str] = &[
    "type",
    "format",
    "enum",
    "default",
    "minimum",
    "maximum",
    "multipleOf",
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "minProperties",
    "pattern",
    "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys",
    "x-kubernetes-map-type",
    "x-kubernetes-validations",
];

/// Differences we make on purpose (DESIGN.md §2 and the issue): (kind, path, key).
const INTENDED: &[(&str, &str, &str)] = &[
    // Zone DNS servers are optional: they fall back to the cluster's.
    ("ProxmoxCluster", ".spec.zoneConfig[]", "required"),
    (
        "ProxmoxClusterTemplate",
        ".spec.template.spec.zoneConfig[]",
        "required",
    ),
    // The Go rule `self.ipv4Config != null || ...` fails with "no such key" when both are absent;
    // `has(...)` accepts and rejects exactly the same objects with the rule's own message.
    ("ProxmoxCluster", ".spec", "x-kubernetes-validations"),
    // capmox only ever writes these three values.
    ("ProxmoxMachine", ".status.vmStatus", "enum"),
    // The Go provider's ProxmoxMachine webhook checks, as CEL: tags are immutable (a transition
    // rule on the spec, so adding or removing them counts too) ...
    ("ProxmoxMachine", ".spec", "x-kubernetes-validations"),
    // ... NIC names net0, net1, ... without gaps, and at most one defaultIPv4/defaultIPv6 NIC;
    // Proxmox has net0 to net31, which bounds the list and the names (and the rules' CEL cost).
    (
        "ProxmoxMachine",
        ".spec.network.networkDevices",
        "x-kubernetes-validations",
    ),
    ("ProxmoxMachine", ".spec.network.networkDevices", "maxItems"),
    (
        "ProxmoxMachine",
        ".spec.network.networkDevices[].name",
        "maxLength",
    ),
    (
        "ProxmoxMachineTemplate",
        ".spec.template.spec.network.networkDevices",
        "maxItems",
    ),
    (
        "ProxmoxMachineTemplate",
        ".spec.template.spec.network.networkDevices[].name",
        "maxLength",
    ),
    // ... and MTUs of at least 1280 (1 still inherits the bridge's on the Proxmox side).
    (
        "ProxmoxMachine",
        ".spec.network.networkDevices[].mtu",
        "x-kubernetes-validations",
    ),
    (
        "ProxmoxMachine",
        ".spec.network.networkDevices[].linkMtu",
        "x-kubernetes-validations",
    ),
    // The Go provider's ProxmoxMachineTemplate webhook: a template names no providerID.
    (
        "ProxmoxMachineTemplate",
        ".spec.template.spec",
        "x-kubernetes-validations",
    ),
    // DHCP (capmox only) excludes a pool on the same NIC; without dhcp4/dhcp6 the rules hold.
    (
        "ProxmoxMachine",
        ".spec.network.networkDevices[]",
        "x-kubernetes-validations",
    ),
    (
        "ProxmoxMachineTemplate",
        ".spec.template.spec.network.networkDevices[]",
        "x-kubernetes-validations",
    ),
    // Data disks (capmox only) keep off the boot volume's slot; without them the rule holds.
    ("ProxmoxMachine", ".spec.disks", "x-kubernetes-validations"),
    (
        "ProxmoxMachineTemplate",
        ".spec.template.spec.disks",
        "x-kubernetes-validations",
    ),
];

/// Differences in the v1alpha1 schemas that accept and reject the same objects, or that only
/// word a message differently: (path suffix, key).
const INTENDED_V1ALPHA1: &[(&str, &str)] = &[
    // kube-rs requires `spec`; an object without one is of no use to anyone.
    ("", "required"),
    // `has(...)` where the Go rules compare with null (see above).
    (".spec", "x-kubernetes-validations"),
    ("additionalDevices[]", "x-kubernetes-validations"),
    // The pool rules are the same; capmox's messages say `ipPoolRef` for both families.
    ("ipv4PoolRef", "x-kubernetes-validations"),
    ("ipv6PoolRef", "x-kubernetes-validations"),
    // `metric` defaults to 100 before validation runs, so requiring it rejects nothing.
    ("ipv4Config", "required"),
    ("ipv6Config", "required"),
];

fn intended(kind: &str, path: &str, key: &str, go: &Value, ours: &Value) -> bool {
    if INTENDED.contains(&(kind, path, key)) {
        return true;
    }
    // Issue 35: free-form strings that reach Proxmox or a guest file have the formats Proxmox
    // (or Linux) accepts; the Go provider left them open.
    if go.get("pattern").is_none() && matches!(key, "pattern" | "maxLength") {
        let ours_pattern = ours["pattern"].as_str();
        if names::RULES
            .iter()
            .any(|rule| ours_pattern == Some(rule.pattern()))
            || ours_pattern == Some(NET_NAME_PATTERN)
        {
            return true;
        }
    }
    if !kind.ends_with("/v1alpha1") {
        return false;
    }
    // The API server does not check integer formats; Go's unsigned fields carry none.
    if key == "format" && go.get(key).is_none() && ours["type"] == "integer" {
        return true;
    }
    INTENDED_V1ALPHA1.iter().any(|(suffix, k)| {
        *k == key && path.ends_with(suffix) && (!suffix.is_empty() || path.is_empty())
    })
}

fn go_schema(file: &str, version: &str) -> Option<Value> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/go-provider/crds")
        .join(file);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    let crd: Value = serde_norway::from_str(&text).expect("Go CRD parses");
    let versions = crd["spec"]["versions"].as_array()?.clone();
    let found = versions.into_iter().find(|v| v["name"] == version)?;
    Some(found["schema"]["openAPIV3Schema"].clone())
}

fn compare(kind: &str, go: &Value, ours: &Value, path: &str, out: &mut Vec<String>) {
    for key in CONSTRAINTS {
        if go.get(*key) != ours.get(*key) && !intended(kind, path, key, go, ours) {
            out.push(format!(
                "{path}: {key}: go={:?} ours={:?}",
                go.get(*key),
                ours.get(*key)
            ));
        }
    }
    let go_required: BTreeSet<&str> = go["required"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    let our_required: BTreeSet<&str> = ours["required"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    // Requiring more than the Go provider would reject manifests it accepts.
    let extra: Vec<_> = our_required.difference(&go_required).collect();
    let fewer: Vec<_> = go_required.difference(&our_required).collect();
    if (!extra.is_empty() || !fewer.is_empty()) && !intended(kind, path, "required", go, ours) {
        out.push(format!(
            "{path}: required differs: ours adds {extra:?}, drops {fewer:?}"
        ));
    }
    if let Some(props) = go["properties"].as_object() {
        for (name, child) in props {
            let child_path = format!("{path}.{name}");
            match ours["properties"].get(name) {
                Some(our_child) if path.is_empty() && name == "metadata" => {
                    let _ = our_child;
                }
                Some(our_child) => compare(kind, child, our_child, &child_path, out),
                None => out.push(format!("{child_path}: missing in capmox")),
            }
        }
    }
    if go["additionalProperties"].is_object() {
        compare(
            kind,
            &go["additionalProperties"],
            &ours["additionalProperties"],
            &format!("{path}{{}}"),
            out,
        );
    }
    if go.get("items").is_some() {
        compare(
            kind,
            &go["items"],
            &ours["items"],
            &format!("{path}[]"),
            out,
        );
    }
}

#[test]
fn schemas_are_wire_compatible_with_the_go_provider() {
    let mut differences = Vec::new();
    for crd in shared_with_go() {
        for version in ["v1alpha2", "v1alpha1"] {
            let ours = crd::schema_json_of(&crd, version).expect("schema");
            let go = go_schema(&crd::file_name(&crd), version)
                .expect("the Go provider has this CRD and version");
            let mut found = Vec::new();
            let kind = crd.spec.names.kind.as_str();
            let compared = if version == "v1alpha1" {
                format!("{kind}/v1alpha1")
            } else {
                kind.to_owned()
            };
            compare(&compared, &go, &ours, "", &mut found);
            differences.extend(found.into_iter().map(|d| format!("{compared}: {d}")));
        }
    }
    assert!(
        differences.is_empty(),
        "{} differences:\n{}",
        differences.len(),
        differences.join("\n")
    );
}
