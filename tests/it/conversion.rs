//! v1alpha1 <-> v1alpha2 conversion: round trips over generated objects in both directions,
//! edits made through one version keep what only the other has, and the Go provider's own
//! conversion test template converts as documented.

use capmox::api::conversion::{CONVERSION_DATA, convert};
use capmox::api::crd;
use serde_json::{Value, json};

use crate::common::{TEMPLATE_VALUES, data, substitute};

pub(crate) const V1ALPHA1: &str = "infrastructure.cluster.x-k8s.io/v1alpha1";
pub(crate) const V1ALPHA2: &str = "infrastructure.cluster.x-k8s.io/v1alpha2";
pub(crate) const KINDS: [&str; 4] = [
    "ProxmoxCluster",
    "ProxmoxClusterTemplate",
    "ProxmoxMachine",
    "ProxmoxMachineTemplate",
];

fn schema(kind: &str, version: &str) -> Value {
    static CRDS: std::sync::OnceLock<
        Vec<k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition>,
    > = std::sync::OnceLock::new();
    let crd = CRDS
        .get_or_init(|| crd::all().expect("CRDs render"))
        .iter()
        .find(|c| c.spec.names.kind == kind)
        .expect("capmox has this kind");
    crd::schema_json_of(crd, version).expect("the version is served")
}

/// A small deterministic generator (xorshift), so a failing seed can be replayed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
    fn pick<'a>(&mut self, options: &'a [&'a str]) -> &'a str {
        options[self.below(options.len() as u64) as usize]
    }
}

/// A random value of the given schema: every property may appear, arrays hold up to three
/// items, list-map keys and set items are unique, strings match the patterns capmox uses.
fn generate(schema: &Value, rng: &mut Rng, name: &str, depth: usize) -> Value {
    if let Some(options) = schema["enum"].as_array() {
        return options[rng.below(options.len() as u64) as usize].clone();
    }
    match schema["type"].as_str() {
        Some("object") => {
            let mut out = serde_json::Map::new();
            let required: Vec<&str> = schema["required"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
                .collect();
            if let Some(properties) = schema["properties"].as_object() {
                for (key, child) in properties {
                    let wanted = required.contains(&key.as_str()) || (depth < 7 && rng.chance(55));
                    if wanted {
                        out.insert(key.clone(), generate(child, rng, key, depth + 1));
                    }
                }
            } else if schema["additionalProperties"].is_object() {
                for i in 0..rng.below(3) {
                    let key = if name == "ipAddresses" {
                        if i == 0 {
                            "default".to_owned()
                        } else {
                            format!("net{i}")
                        }
                    } else {
                        format!("key{i}")
                    };
                    out.insert(
                        key,
                        generate(&schema["additionalProperties"], rng, name, depth + 1),
                    );
                }
            }
            Value::Object(out)
        }
        Some("array") => {
            let min = schema["minItems"].as_u64().unwrap_or(0);
            let max = schema["maxItems"].as_u64().unwrap_or(3).min(3).max(min);
            let count = min + rng.below(max - min + 1);
            let keys: Vec<&str> = schema["x-kubernetes-list-map-keys"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
                .collect();
            let set = schema["x-kubernetes-list-type"] == "set";
            let mut items: Vec<Value> = Vec::new();
            for _ in 0..count {
                let item = generate(&schema["items"], rng, name, depth + 1);
                let clash = items.iter().any(|other| {
                    if keys.is_empty() {
                        set && *other == item
                    } else {
                        keys.iter().all(|k| other[k] == item[k])
                    }
                });
                if !clash {
                    items.push(item);
                }
            }
            Value::Array(items)
        }
        Some("string") => Value::String(string_for(schema, rng, name)),
        Some("integer") => {
            let low = schema["minimum"].as_i64().unwrap_or(0);
            let high = schema["maximum"]
                .as_i64()
                .unwrap_or(low + 5000)
                .min(low + 5000);
            json!(low + rng.below((high - low + 1) as u64) as i64)
        }
        Some("boolean") => json!(rng.chance(50)),
        _ => json!({}),
    }
}

fn string_for(schema: &Value, rng: &mut Rng, name: &str) -> String {
    if schema["format"] == "date-time" {
        return format!("2026-12-0{}T10:00:00Z", 1 + rng.below(9));
    }
    let pattern = schema["pattern"].as_str().unwrap_or_default();
    if pattern.contains("proxmox://") {
        return format!(
            "proxmox://0000000{}-aaaa-bbbb-cccc-dddddddddddd",
            rng.below(10)
        );
    }
    if pattern.contains("net[0-9]+|default") {
        return rng.pick(&["default", "net0", "net1"]).to_owned();
    }
    if pattern.contains("net[0-9]") || name == "name" && rng.chance(30) {
        return format!("net{}", rng.below(3));
    }
    if pattern.contains("[0-9A-Fa-f]{2}") {
        return format!("aa:bb:cc:dd:ee:0{}", rng.below(10));
    }
    match name {
        "zone" => return rng.pick(&["rack-a", "rack-b", "default"]).to_owned(),
        "status" => return rng.pick(&["True", "False", "Unknown"]).to_owned(),
        "reason" => {
            return rng
                .pick(&["Ready", "Cloning", "WaitingForBootstrapData"])
                .to_owned();
        }
        "severity" => return rng.pick(&["Error", "Warning", "Info"]).to_owned(),
        "vmStatus" => {
            return rng
                .pick(&["pending", "ready", "notfound", "odd"])
                .to_owned();
        }
        "ipv4" => return format!("10.0.0.{}", rng.below(250)),
        "ipv6" => return format!("2001:db8::{}", rng.below(250)),
        _ => {}
    }
    let words = [
        "pve1",
        "pve2",
        "vmbr0",
        "local-lvm",
        "pool-inet",
        "pool-inet6",
        "k8s",
        "Web",
        "a_b",
    ];
    let word = rng.pick(&words);
    let min = schema["minLength"].as_u64().unwrap_or(0) as usize;
    let mut text = word.to_owned();
    while text.len() < min {
        text.push('x');
    }
    text
}

/// A generated object of `kind` in `api_version`, in the canonical form capmox's types give it.
pub(crate) fn generated(kind: &str, api_version: &str, seed: u64) -> Value {
    let version = api_version.rsplit('/').next().expect("group/version");
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let schema = schema(kind, version);
    let mut object = json!({
        "apiVersion": api_version,
        "kind": kind,
        "metadata": {"name": format!("gen-{seed}"), "namespace": "default", "labels": {"seed": seed.to_string()}},
        "spec": generate(&schema["properties"]["spec"], &mut rng, "spec", 1),
    });
    if schema["properties"]["status"].is_object() && rng.chance(70) {
        object["status"] = generate(&schema["properties"]["status"], &mut rng, "status", 1);
    }
    canonical(object)
}

/// Reads an object through capmox's types and back, so generated extras (empty lists, nulls)
/// look as capmox writes them.
pub(crate) fn canonical(object: Value) -> Value {
    fn through<K: serde::de::DeserializeOwned + serde::Serialize>(object: &Value) -> Value {
        let typed: K = serde_json::from_value(object.clone())
            .unwrap_or_else(|e| panic!("capmox's types take {object}: {e}"));
        serde_json::to_value(typed).expect("serializes")
    }
    use capmox::api::{self, v1alpha1};
    let v1 = object["apiVersion"] == V1ALPHA1;
    match (object["kind"].as_str().unwrap_or_default(), v1) {
        ("ProxmoxCluster", true) => through::<v1alpha1::ProxmoxCluster>(&object),
        ("ProxmoxCluster", false) => through::<api::ProxmoxCluster>(&object),
        ("ProxmoxClusterTemplate", true) => through::<v1alpha1::ProxmoxClusterTemplate>(&object),
        ("ProxmoxClusterTemplate", false) => through::<api::ProxmoxClusterTemplate>(&object),
        ("ProxmoxMachine", true) => through::<v1alpha1::ProxmoxMachine>(&object),
        ("ProxmoxMachine", false) => through::<api::ProxmoxMachine>(&object),
        ("ProxmoxMachineTemplate", true) => through::<v1alpha1::ProxmoxMachineTemplate>(&object),
        ("ProxmoxMachineTemplate", false) => through::<api::ProxmoxMachineTemplate>(&object),
        (kind, _) => panic!("not a capmox kind: {kind}"),
    }
}

fn other(api_version: &str) -> &'static str {
    if api_version == V1ALPHA1 {
        V1ALPHA2
    } else {
        V1ALPHA1
    }
}

const SEEDS: u64 = 300;

#[test]
fn every_object_survives_a_round_trip_through_the_other_version() {
    for kind in KINDS {
        for start in [V1ALPHA1, V1ALPHA2] {
            for seed in 0..SEEDS {
                let object = generated(kind, start, seed);
                let there = convert(object.clone(), other(start))
                    .unwrap_or_else(|e| panic!("{kind} {start} seed {seed}: {e}"));
                assert_eq!(there["apiVersion"], other(start));
                // What a client of the other version sees is a valid object of that version's types.
                let there = canonical(there);
                let back = convert(there.clone(), start)
                    .unwrap_or_else(|e| panic!("{kind} {start} seed {seed} back: {e}"));
                assert_eq!(
                    back, object,
                    "{kind} from {start}, seed {seed}, lost something; the other version read:\n{there:#}"
                );
            }
        }
    }
}

#[test]
fn a_label_change_made_through_the_other_version_keeps_everything_else() {
    for kind in KINDS {
        for start in [V1ALPHA1, V1ALPHA2] {
            for seed in 0..SEEDS / 3 {
                let object = generated(kind, start, seed);
                let mut there = convert(object.clone(), other(start)).expect("converts");
                there["metadata"]["labels"]["edited"] = json!("yes");
                let back = convert(there, start).expect("converts back");
                let mut expected = object.clone();
                expected["metadata"]["labels"]["edited"] = json!("yes");
                assert_eq!(back, expected, "{kind} from {start}, seed {seed}");
            }
        }
    }
}

#[test]
fn a_v1alpha1_spec_edit_keeps_zones_failure_domains_and_v1alpha2_nic_settings() {
    let cluster = json!({
        "apiVersion": V1ALPHA2, "kind": "ProxmoxCluster",
        "metadata": {"name": "c", "namespace": "default"},
        "spec": {
            "dnsServers": ["10.0.0.2"],
            "ipv4Config": {"addresses": ["10.0.0.100-10.0.0.150"], "prefix": 24, "gateway": "10.0.0.1"},
            "zoneConfig": [{"zone": "rack-a", "nodes": ["pve1"], "taskLimits": {"perStorage": 1}}, {"zone": "rack-b", "nodes": ["pve2"], "controlPlaneEligible": false}],
            "taskLimits": {"perNode": 1}
        },
        "status": {
            "initialization": {"provisioned": true},
            "failureDomains": [{"name": "rack-a", "controlPlane": true}, {"name": "rack-b", "controlPlane": false}],
            "inClusterZoneRef": [{"zone": "rack-a", "inClusterIPPoolRefV4": {"name": "c-rack-a-v4-icip"}}]
        }
    });
    let mut old = convert(cluster.clone(), V1ALPHA1).expect("converts");
    assert_eq!(old["status"]["ready"], true);
    assert!(old["spec"].get("zoneConfig").is_none());
    assert!(
        old["metadata"]["annotations"][CONVERSION_DATA].is_string(),
        "zones travel in the annotation: {old:#}"
    );
    old["spec"]["dnsServers"] = json!(["10.0.0.3"]);
    let new = convert(old, V1ALPHA2).expect("converts back");
    assert_eq!(new["spec"]["dnsServers"], json!(["10.0.0.3"]));
    assert_eq!(new["spec"]["zoneConfig"], cluster["spec"]["zoneConfig"]);
    assert_eq!(new["spec"]["taskLimits"], cluster["spec"]["taskLimits"]);
    assert_eq!(new["status"], cluster["status"]);
    assert!(new["metadata"].get("annotations").is_none(), "{new:#}");

    let machine = json!({
        "apiVersion": V1ALPHA2, "kind": "ProxmoxMachine",
        "metadata": {"name": "m", "namespace": "default"},
        "spec": {
            "sourceNode": "pve1", "templateID": 9000, "numCores": 2,
            "cpu": {"type": "host", "flags": ["+aes"]}, "numa": true, "bios": "ovmf", "secureBoot": true, "tpm": true,
            "pciDevices": [{"mapping": "gpu-a100", "pcie": true, "primaryGPU": true},
                           {"mapping": "nic", "rombar": false}],
            "disks": {"bootVolume": {"disk": "scsi0", "sizeGb": 20},
                      "additionalVolumes": [{"disk": "scsi1", "sizeGb": 50, "storage": "ceph", "discard": true}]},
            "network": {"zone": "rack-a", "networkDevices": [
                {"name": "net0", "bridge": "vmbr0", "defaultIPv4": true, "queues": 4},
                {"name": "net1", "bridge": "vmbr1", "dhcp4": true, "dhcp6": true},
                {"name": "net2", "bridge": "vmbr1", "ipPoolRef": [{"apiGroup": "ipam.cluster.x-k8s.io", "kind": "InClusterIPPool", "name": "extra"}],
                 "routes": [{"to": "default", "is6": true}]}
            ]}
        },
        "status": {"failureDomain": "rack-a", "virtualMachineID": 101, "taskFailures": 2}
    });
    let mut old = convert(machine.clone(), V1ALPHA1).expect("converts");
    assert_eq!(old["spec"]["network"]["default"]["bridge"], "vmbr0");
    assert_eq!(
        old["spec"]["network"]["additionalDevices"][1]["ipv4PoolRef"]["name"],
        "extra"
    );
    assert_eq!(
        old["spec"]["disks"],
        json!({"bootVolume": {"disk": "scsi0", "sizeGb": 20}}),
        "data disks travel in the annotation"
    );
    old["spec"]["numCores"] = json!(8);
    let new = convert(old, V1ALPHA2).expect("converts back");
    let mut expected = machine.clone();
    expected["spec"]["numCores"] = json!(8);
    assert_eq!(new, expected);
}

#[test]
fn v1alpha1_only_fields_are_kept_while_stored_as_v1alpha2() {
    let old = json!({
        "apiVersion": V1ALPHA1, "kind": "ProxmoxMachine",
        "metadata": {"name": "m", "namespace": "default"},
        "spec": {"sourceNode": "pve1", "templateID": 9000, "target": "pve3",
                 "network": {"default": {"bridge": "vmbr0"}}},
        "status": {"ready": false, "failureReason": "CreateError", "failureMessage": "clone failed",
                   "conditions": [{"type": "VMProvisioned", "status": "False", "severity": "Error",
                                    "lastTransitionTime": "2026-12-03T10:00:00Z", "reason": "CloningFailed"}]}
    });
    let stored = convert(old.clone(), V1ALPHA2).expect("converts");
    // v1alpha2 places the VM on one of `allowedNodes`; v1alpha1's clone target is that one node.
    assert_eq!(stored["spec"]["allowedNodes"], json!(["pve3"]));
    // Without defaultIPv4/defaultIPv6 anywhere, net0 takes the cluster's default pools.
    assert_eq!(
        stored["spec"]["network"]["networkDevices"],
        json!([{"name": "net0", "bridge": "vmbr0"}])
    );
    assert_eq!(stored["status"]["conditions"][0]["reason"], "CloningFailed");
    assert!(stored["metadata"]["annotations"][CONVERSION_DATA].is_string());
    // The controller then updates the stored object (a v1alpha2 status write).
    let mut updated = stored.clone();
    updated["status"]["proxmoxNode"] = json!("pve3");
    let read = convert(updated, V1ALPHA1).expect("converts");
    assert_eq!(read["spec"]["target"], "pve3");
    assert_eq!(read["status"]["proxmoxNode"], "pve3");
    assert_eq!(read["status"]["failureReason"], "CreateError");
    assert_eq!(read["status"]["conditions"][0]["severity"], "Error");
}

#[test]
fn a_template_without_clone_spec_gets_the_skeleton_old_cluster_class_patches_need() {
    let template = json!({
        "apiVersion": V1ALPHA2, "kind": "ProxmoxClusterTemplate",
        "metadata": {"name": "t", "namespace": "default"},
        "spec": {"template": {"spec": {"dnsServers": ["10.0.0.2"]}}}
    });
    let old = convert(template, V1ALPHA1).expect("converts");
    let clone_spec = &old["spec"]["template"]["spec"]["cloneSpec"];
    assert_eq!(
        clone_spec["machineSpec"]["controlPlane"]["sourceNode"],
        "pve1"
    );
    assert_eq!(clone_spec["sshAuthorizedKeys"], json!([]));
    assert_eq!(clone_spec["virtualIPNetworkInterface"], "");
}

#[test]
fn pools_split_by_family_when_read_as_v1alpha1() {
    let machine = json!({
        "apiVersion": V1ALPHA2, "kind": "ProxmoxMachine",
        "metadata": {"name": "m", "namespace": "default"},
        "spec": {"sourceNode": "pve1", "templateID": 9000, "network": {"networkDevices": [
            {"name": "net0", "bridge": "vmbr0"},
            {"name": "net1", "bridge": "vmbr1", "ipPoolRef": [
                {"apiGroup": "ipam.cluster.x-k8s.io", "kind": "InClusterIPPool", "name": "extra-inet6"},
                {"apiGroup": "ipam.cluster.x-k8s.io", "kind": "InClusterIPPool", "name": "extra-inet"}
            ]}
        ]}}
    });
    let old = convert(machine, V1ALPHA1).expect("converts");
    let nic = &old["spec"]["network"]["additionalDevices"][0];
    assert_eq!(nic["ipv4PoolRef"]["name"], "extra-inet");
    assert_eq!(nic["ipv6PoolRef"]["name"], "extra-inet6");
}

#[test]
fn unknown_versions_and_kinds_and_malformed_objects_are_refused_with_a_reason() {
    let machine = json!({"apiVersion": V1ALPHA1, "kind": "ProxmoxMachine",
        "metadata": {"name": "m"}, "spec": {"numCores": "many"}});
    let error = convert(machine, V1ALPHA2)
        .expect_err("numCores is a number")
        .to_string();
    assert!(
        error.contains("ProxmoxMachine m") && error.contains("v1alpha1"),
        "{error}"
    );
    let error = convert(
        json!({"apiVersion": V1ALPHA1, "kind": "ProxmoxMachine"}),
        "infrastructure.cluster.x-k8s.io/v1beta1",
    )
    .expect_err("no such version")
    .to_string();
    assert!(error.contains("v1beta1"), "{error}");
    let error = convert(json!({"apiVersion": V1ALPHA1, "kind": "Widget"}), V1ALPHA2)
        .expect_err("not a capmox kind")
        .to_string();
    assert!(error.contains("Widget"), "{error}");
}

fn documents(path: &str) -> Vec<Value> {
    let text = std::fs::read_to_string(data(path)).expect("test data");
    let text = substitute(&text, TEMPLATE_VALUES);
    serde_norway::Deserializer::from_str(&text)
        .filter_map(|d| <Value as serde::Deserialize>::deserialize(d).ok())
        .filter(|v| v.is_object())
        .collect()
}

#[test]
fn the_go_providers_conversion_test_template_converts_as_documented() {
    let old = documents("conversion/v1alpha1-cluster-template.yaml");
    let new =
        documents("go-provider/templates/pkg_convert_testdata_v1alpha2-cluster-template.yaml");
    assert_eq!(old.len(), 3);
    for object in old {
        let kind = object["kind"].as_str().expect("kind");
        // Valid v1alpha1 for the Go provider's schema and for capmox's.
        capmox_testkit::schema::validate_object(&schema(kind, "v1alpha1"), &object, None)
            .unwrap_or_else(|v| panic!("{kind}: {v:#?}"));
        let converted = convert(object.clone(), V1ALPHA2).expect("converts");
        // Both sides as the API server stores them: validated and defaulted by the v1alpha2 schema.
        let defaulted = |object: &Value| {
            capmox_testkit::schema::validate_object(&schema(kind, "v1alpha2"), object, None)
                .unwrap_or_else(|v| panic!("{kind} is not valid v1alpha2: {v:#?}\n{object:#}"))
        };
        let mut expected = new
            .iter()
            .find(|n| n["kind"] == kind && n["metadata"]["name"] == object["metadata"]["name"])
            .cloned()
            .unwrap_or_else(|| panic!("the Go template has {kind} {}", object["metadata"]["name"]));
        // The Go converter marks net0 `defaultIPv4: true, defaultIPv6: true`; capmox leaves both
        // unset, which gives net0 the default pool of each family the cluster has (the same
        // addresses) and keeps the object as it was written.
        if let Some(devices) = expected
            .pointer_mut("/spec/template/spec/network/networkDevices")
            .and_then(Value::as_array_mut)
        {
            for device in devices {
                let device = device.as_object_mut().expect("device");
                device.remove("defaultIPv4");
                device.remove("defaultIPv6");
            }
        }
        let mut converted = canonical(defaulted(&converted));
        // What v1alpha2 cannot hold (the cluster's cloneSpec) travels in the annotation.
        if kind == "ProxmoxCluster" {
            let data = converted["metadata"]["annotations"][CONVERSION_DATA]
                .as_str()
                .expect("cloneSpec kept");
            let data: Value = serde_json::from_str(data).expect("json");
            assert_eq!(
                data["spec"]["cloneSpec"]["sshAuthorizedKeys"],
                json!(["ssh-ed25519 AAAA"])
            );
            converted["metadata"]
                .as_object_mut()
                .expect("metadata")
                .remove("annotations");
        }
        assert_eq!(converted, canonical(defaulted(&expected)), "{kind}");
    }
}
