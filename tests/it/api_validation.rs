//! Users' manifests against capmox's types and CRD schemas: examples round-trip unchanged, the
//! Go provider's templates still apply, and bad input is refused with a message that says why.

use std::path::Path;

use capmox::api::{
    ProxmoxCluster, ProxmoxClusterTemplate, ProxmoxMachine, ProxmoxMachineTemplate, crd,
};
use serde::{Serialize, de::DeserializeOwned};
use serde_json::{Value, json};

use crate::common::{TEMPLATE_VALUES, substitute};

fn schema_for(kind: &str) -> Value {
    static SCHEMAS: std::sync::OnceLock<Vec<(String, Value)>> = std::sync::OnceLock::new();
    let schemas = SCHEMAS.get_or_init(|| {
        crd::all()
            .expect("CRDs render")
            .iter()
            .map(|c| {
                (
                    c.spec.names.kind.clone(),
                    crd::schema_json(c).expect("schema"),
                )
            })
            .collect()
    });
    schemas
        .iter()
        .find(|(k, _)| k == kind)
        .map(|(_, schema)| schema.clone())
        .unwrap_or_else(|| panic!("no CRD for {kind}"))
}

fn documents(text: &str) -> Vec<Value> {
    serde_norway::Deserializer::from_str(text)
        .map(|doc| Value::deserialize_from(doc))
        .filter(|v| !v.is_null())
        .collect()
}

trait FromYamlDoc {
    fn deserialize_from(doc: serde_norway::Deserializer<'_>) -> Self;
}

impl FromYamlDoc for Value {
    fn deserialize_from(doc: serde_norway::Deserializer<'_>) -> Self {
        serde::Deserialize::deserialize(doc).expect("valid YAML")
    }
}

fn example_objects() -> Vec<Value> {
    documents(&std::fs::read_to_string("examples/failure-domains.yaml").expect("example file"))
}

fn round_trip<T: DeserializeOwned + Serialize>(object: &Value) -> Value {
    let typed: T = serde_json::from_value(object.clone())
        .unwrap_or_else(|e| panic!("{} does not decode: {e}", object["metadata"]["name"]));
    serde_json::to_value(typed).expect("serializes")
}

fn round_trip_by_kind(object: &Value) -> Value {
    match object["kind"].as_str() {
        Some("ProxmoxCluster") => round_trip::<ProxmoxCluster>(object),
        Some("ProxmoxClusterTemplate") => round_trip::<ProxmoxClusterTemplate>(object),
        Some("ProxmoxMachine") => round_trip::<ProxmoxMachine>(object),
        Some("ProxmoxMachineTemplate") => round_trip::<ProxmoxMachineTemplate>(object),
        other => panic!("unexpected kind {other:?}"),
    }
}

fn violations(kind: &str, object: &Value) -> Vec<String> {
    match capmox_testkit::schema::validate_object(&schema_for(kind), object, None) {
        Ok(_) => Vec::new(),
        Err(found) => found.iter().map(ToString::to_string).collect(),
    }
}

#[test]
fn examples_round_trip_through_the_types_unchanged() {
    let objects = example_objects();
    assert_eq!(objects.len(), 5);
    for object in &objects {
        assert_eq!(
            &round_trip_by_kind(object),
            object,
            "{} changed on the way through",
            object["kind"]
        );
    }
}

#[test]
fn examples_are_valid_against_the_crds() {
    for object in example_objects() {
        let kind = object["kind"].as_str().expect("kind").to_owned();
        let found = violations(&kind, &object);
        assert!(
            found.is_empty(),
            "{kind} {}: {found:#?}",
            object["metadata"]["name"]
        );
    }
}

#[test]
fn defaults_are_applied_as_the_api_server_would() {
    let cluster = example_objects().remove(0);
    let defaulted =
        capmox_testkit::schema::validate_object(&schema_for("ProxmoxCluster"), &cluster, None)
            .expect("valid");
    assert_eq!(
        defaulted["spec"]["externalManagedControlPlane"],
        json!(false)
    );
    assert_eq!(
        defaulted["spec"]["zoneConfig"][0]["controlPlaneEligible"],
        json!(true)
    );
    assert_eq!(
        defaulted["spec"]["zoneConfig"][2]["controlPlaneEligible"],
        json!(false)
    );
    assert_eq!(
        defaulted["spec"]["zoneConfig"][0]["ipv4Config"]["metric"],
        json!(100)
    );
    let machine = example_objects().remove(3);
    let defaulted =
        capmox_testkit::schema::validate_object(&schema_for("ProxmoxMachine"), &machine, None)
            .expect("valid");
    assert_eq!(defaulted["spec"]["full"], json!(true));
    assert_eq!(
        defaulted["spec"]["network"]["networkDevices"][0]["model"],
        json!("virtio")
    );
}

/// A ProxmoxMachine spec that is valid, to break one field at a time.
fn machine(spec_changes: Value) -> Value {
    let mut object = json!({
        "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha2",
        "kind": "ProxmoxMachine",
        "metadata": {"name": "m", "namespace": "default"},
        "spec": {
            "sourceNode": "pve1",
            "templateID": 100,
            "network": {"networkDevices": [{"name": "net0", "bridge": "vmbr0"}]}
        }
    });
    merge(&mut object["spec"], spec_changes);
    object
}

fn cluster(spec_changes: Value) -> Value {
    let mut object = json!({
        "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha2",
        "kind": "ProxmoxCluster",
        "metadata": {"name": "c", "namespace": "default"},
        "spec": {
            "dnsServers": ["10.0.0.2"],
            "ipv4Config": {"addresses": ["10.0.0.10-10.0.0.20"], "prefix": 24, "gateway": "10.0.0.1"}
        }
    });
    merge(&mut object["spec"], spec_changes);
    object
}

/// JSON merge patch (RFC 7386): null removes a field.
fn merge(target: &mut Value, patch: Value) {
    match patch {
        Value::Object(fields) => {
            if !target.is_object() {
                *target = json!({});
            }
            for (key, value) in fields {
                if value.is_null() {
                    target.as_object_mut().map(|t| t.remove(&key));
                } else {
                    merge(&mut target[&key], value);
                }
            }
        }
        other => *target = other,
    }
}

fn assert_rejected(kind: &str, object: Value, expected: &str) {
    let found = violations(kind, &object);
    assert!(
        found.iter().any(|v| v.contains(expected)),
        "expected a violation containing {expected:?}, got {found:#?}"
    );
}

#[test]
fn the_valid_bases_are_accepted() {
    assert_eq!(
        violations("ProxmoxMachine", &machine(json!({}))),
        Vec::<String>::new()
    );
    assert_eq!(
        violations("ProxmoxCluster", &cluster(json!({}))),
        Vec::<String>::new()
    );
}

#[test]
fn memory_must_be_a_multiple_of_8() {
    assert_rejected(
        "ProxmoxMachine",
        machine(json!({"memoryMiB": 7})),
        ".spec.memoryMiB: must be a multiple of 8",
    );
    assert!(violations("ProxmoxMachine", &machine(json!({"memoryMiB": 2048}))).is_empty());
}

#[test]
fn zone_names_are_dns_label_like() {
    assert_rejected(
        "ProxmoxCluster",
        cluster(json!({"zoneConfig": [{"zone": "rack/a", "nodes": ["pve1"]}]})),
        ".spec.zoneConfig[0].zone: \"rack/a\" does not match",
    );
    assert_rejected(
        "ProxmoxMachine",
        machine(json!({"network": {"zone": "-bad"}})),
        ".spec.network.zone",
    );
    assert!(
        violations(
            "ProxmoxCluster",
            &cluster(json!({"zoneConfig": [{"zone": "rack_a.1", "nodes": ["pve1"]}]}))
        )
        .is_empty()
    );
}

fn machine_template(spec_changes: Value) -> Value {
    let machine = machine(spec_changes);
    json!({
        "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha2",
        "kind": "ProxmoxMachineTemplate",
        "metadata": {"name": "t", "namespace": "default"},
        "spec": {"template": {"spec": machine["spec"]}}
    })
}

/// Violations of an update from `old` to `new`, transition rules included.
fn update_violations(kind: &str, old: &Value, new: &Value) -> Vec<String> {
    match capmox_testkit::schema::validate_object(&schema_for(kind), new, Some(old)) {
        Ok(_) => Vec::new(),
        Err(found) => found.iter().map(ToString::to_string).collect(),
    }
}

fn nics(names: &[&str]) -> Value {
    let devices: Vec<Value> = names
        .iter()
        .map(|name| json!({"name": name, "bridge": "vmbr0"}))
        .collect();
    json!({"network": {"networkDevices": devices}})
}

#[test]
fn nic_names_are_consecutive_from_net0_compared_as_numbers() {
    let names: Vec<String> = (0..12).map(|i| format!("net{i}")).collect();
    let twelve: Vec<&str> = names.iter().map(String::as_str).collect();
    // Sorted as strings net10 comes before net2: the Go provider refused this.
    assert_eq!(
        violations("ProxmoxMachine", &machine(nics(&twelve))),
        Vec::<String>::new()
    );
    let unordered = ["net2", "net0", "net1"];
    assert!(violations("ProxmoxMachine", &machine(nics(&unordered))).is_empty());
    let all: Vec<String> = (0..32).map(|i| format!("net{i}")).collect();
    let all: Vec<&str> = all.iter().map(String::as_str).collect();
    assert!(violations("ProxmoxMachine", &machine(nics(&all))).is_empty());

    let message = "network device names must be net0, net1, ... without gaps";
    assert_rejected("ProxmoxMachine", machine(nics(&["net1"])), message);
    assert_rejected("ProxmoxMachine", machine(nics(&["net0", "net2"])), message);
    assert_rejected("ProxmoxMachine", machine(nics(&["net0", "net01"])), message);
    let mut gap = twelve.clone();
    gap.remove(5);
    assert_rejected("ProxmoxMachine", machine(nics(&gap)), message);
    // Proxmox has net0 to net31.
    let too_many: Vec<String> = (0..33).map(|i| format!("net{i}")).collect();
    let too_many: Vec<&str> = too_many.iter().map(String::as_str).collect();
    assert_rejected(
        "ProxmoxMachine",
        machine(nics(&too_many)),
        ".spec.network.networkDevices: must have at most 32 items",
    );
    assert_rejected(
        "ProxmoxMachine",
        machine(nics(&["net0", "net100"])),
        ".spec.network.networkDevices[1].name",
    );
    // Templates are checked as the Go provider checked them: not for this.
    assert!(violations("ProxmoxMachineTemplate", &machine_template(nics(&["net1"]))).is_empty());
}

#[test]
fn at_most_one_nic_takes_each_default_pool() {
    let devices = |v4: [Option<bool>; 2], v6: [Option<bool>; 2]| {
        let device = |i: usize| {
            let mut d = json!({"name": format!("net{i}"), "bridge": "vmbr0"});
            if let Some(v) = v4[i] {
                d["defaultIPv4"] = json!(v);
            }
            if let Some(v) = v6[i] {
                d["defaultIPv6"] = json!(v);
            }
            d
        };
        machine(json!({"network": {"networkDevices": [device(0), device(1)]}}))
    };
    assert!(
        violations(
            "ProxmoxMachine",
            &devices([Some(true), Some(false)], [None, Some(true)])
        )
        .is_empty()
    );
    assert!(
        violations(
            "ProxmoxMachine",
            &devices([Some(true), None], [Some(true), None])
        )
        .is_empty()
    );
    assert_rejected(
        "ProxmoxMachine",
        devices([Some(true), Some(true)], [None, None]),
        "at most one network device may set defaultIPv4: true",
    );
    assert_rejected(
        "ProxmoxMachine",
        devices([None, Some(true)], [Some(true), Some(true)]),
        "at most one network device may set defaultIPv6: true",
    );
}

#[test]
fn mtus_below_1280_are_refused_except_1_on_the_proxmox_side() {
    let with = |field: &str, mtu: i64| {
        let mut device = json!({"name": "net0", "bridge": "vmbr0"});
        device[field] = json!(mtu);
        machine(json!({"network": {"networkDevices": [device]}}))
    };
    for ok in [1, 1280, 1500, 9000] {
        assert!(
            violations("ProxmoxMachine", &with("mtu", ok)).is_empty(),
            "mtu {ok}"
        );
    }
    assert_rejected(
        "ProxmoxMachine",
        with("mtu", 1279),
        "mtu must be 1 (inherit the bridge's MTU) or at least 1280",
    );
    assert_rejected("ProxmoxMachine", with("mtu", 576), "at least 1280");
    for ok in [1280, 1500, 9000] {
        assert!(
            violations("ProxmoxMachine", &with("linkMtu", ok)).is_empty(),
            "linkMtu {ok}"
        );
    }
    for bad in [1, 576, 1279] {
        assert_rejected(
            "ProxmoxMachine",
            with("linkMtu", bad),
            "linkMtu must be at least 1280",
        );
    }
}

#[test]
fn tags_are_immutable() {
    let tagged = machine(json!({"tags": ["a", "b"]}));
    let untagged = machine(json!({}));
    let message = "tags are immutable";
    for (old, new) in [
        (&tagged, machine(json!({"tags": ["a", "c"]}))),
        (&tagged, machine(json!({"tags": ["a", "b", "c"]}))),
        (&tagged, untagged.clone()),
        (&untagged, tagged.clone()),
    ] {
        let found = update_violations("ProxmoxMachine", old, &new);
        assert!(
            found.iter().any(|v| v.contains(message)),
            "{old} -> {new}: {found:#?}"
        );
    }
    // Other changes leave them be; creating with tags is fine.
    let resized = machine(json!({"tags": ["a", "b"], "memoryMiB": 4096}));
    assert_eq!(
        update_violations("ProxmoxMachine", &tagged, &resized),
        Vec::<String>::new()
    );
    let resized = machine(json!({"memoryMiB": 4096}));
    assert_eq!(
        update_violations("ProxmoxMachine", &untagged, &resized),
        Vec::<String>::new()
    );
    assert!(violations("ProxmoxMachine", &tagged).is_empty());
}

#[test]
fn a_machine_template_names_no_provider_id() {
    let id = "proxmox://8a7c6f4e-0c1f-4a55-9f3a-2a4b1c3d5e6f";
    assert_rejected(
        "ProxmoxMachineTemplate",
        machine_template(json!({"providerID": id})),
        "providerID cannot be set in templates",
    );
    assert!(violations("ProxmoxMachineTemplate", &machine_template(json!({}))).is_empty());
    // A machine has one, written by the controller.
    assert!(violations("ProxmoxMachine", &machine(json!({"providerID": id}))).is_empty());
}

#[test]
fn mtu_must_be_1_or_576_to_65520() {
    let with_mtu = |mtu: i64| {
        machine(
            json!({"network": {"networkDevices": [{"name": "net0", "bridge": "vmbr0", "mtu": mtu}]}}),
        )
    };
    assert_rejected("ProxmoxMachine", with_mtu(100), "invalid MTU value");
    assert_rejected("ProxmoxMachine", with_mtu(65521), "invalid MTU value");
    assert!(violations("ProxmoxMachine", &with_mtu(1)).is_empty());
    assert!(violations("ProxmoxMachine", &with_mtu(9000)).is_empty());
}

#[test]
fn vmid_range_must_not_end_before_it_starts() {
    assert_rejected(
        "ProxmoxMachine",
        machine(json!({"vmIDRange": {"start": 2000, "end": 1999}})),
        "end should be greater than or equal to start",
    );
    assert_rejected(
        "ProxmoxMachine",
        machine(json!({"vmIDRange": {"start": 99, "end": 200}})),
        ".spec.vmIDRange.start",
    );
    assert!(
        violations(
            "ProxmoxMachine",
            &machine(json!({"vmIDRange": {"start": 2000, "end": 2000}}))
        )
        .is_empty()
    );
}

#[test]
fn the_template_source_is_either_an_id_or_a_selector() {
    assert_rejected(
        "ProxmoxMachine",
        machine(json!({"templateSelector": {"matchTags": ["ubuntu"]}})),
        "must define either a SourceNode with a TemplateID or a TemplateSelector",
    );
    assert_rejected(
        "ProxmoxMachine",
        machine(json!({"sourceNode": null, "templateID": null})),
        "Must specify either templateID or templateSelector",
    );
    assert_rejected(
        "ProxmoxMachine",
        machine(json!({"sourceNode": null})),
        "must define either a SourceNode",
    );
    let by_tags = machine(
        json!({"sourceNode": null, "templateID": null, "templateSelector": {"matchTags": ["ubuntu"]}}),
    );
    assert!(violations("ProxmoxMachine", &by_tags).is_empty());
}

#[test]
fn other_constraints_of_the_go_provider_hold() {
    assert_rejected(
        "ProxmoxMachine",
        machine(json!({"full": false, "format": "qcow2"})),
        "Must set full=true when specifying format",
    );
    assert_rejected(
        "ProxmoxMachine",
        machine(json!({"full": false, "storage": "local"})),
        "Must set full=true when specifying storage",
    );
    assert_rejected(
        "ProxmoxMachine",
        machine(json!({"format": "vdi"})),
        ".spec.format: unsupported value",
    );
    assert_rejected(
        "ProxmoxMachine",
        machine(json!({"numCores": 0})),
        ".spec.numCores",
    );
    assert_rejected(
        "ProxmoxMachine",
        machine(json!({"tags": ["bad tag"]})),
        ".spec.tags[0]",
    );
    assert_rejected(
        "ProxmoxMachine",
        machine(json!({"providerID": "proxmox://nope"})),
        ".spec.providerID",
    );
    assert_rejected(
        "ProxmoxMachine",
        machine(json!({"network": {"networkDevices": [{"name": "eth0"}]}})),
        ".spec.network.networkDevices[0].name",
    );
    assert_rejected(
        "ProxmoxMachine",
        machine(
            json!({"network": {"networkDevices": [{"name": "net0", "ipPoolRef": [{"apiGroup": "example.com", "kind": "InClusterIPPool", "name": "p"}]}]}}),
        ),
        "ipPoolRef allows only IPAM apiGroup",
    );
    assert_rejected(
        "ProxmoxMachine",
        machine(json!({"network": {"networkDevices": [{"name": "net0"}, {"name": "net0"}]}})),
        "duplicate entry with key [\"net0\"]",
    );
    assert_rejected(
        "ProxmoxCluster",
        cluster(json!({"ipv4Config": null})),
        "at least one ip config must be set",
    );
    let ipv6_only = cluster(
        json!({"ipv4Config": null, "ipv6Config": {"addresses": ["2001:db8::10"], "prefix": 64, "gateway": "2001:db8::1"}}),
    );
    assert!(violations("ProxmoxCluster", &ipv6_only).is_empty());
    assert_rejected(
        "ProxmoxCluster",
        cluster(json!({"dnsServers": []})),
        ".spec.dnsServers: must have at least 1 items",
    );
    assert_rejected(
        "ProxmoxCluster",
        cluster(json!({"controlPlaneEndpoint": {"host": "a", "port": 70000}})),
        ".spec.controlPlaneEndpoint.port",
    );
    assert_rejected(
        "ProxmoxCluster",
        cluster(json!({"schedulerHints": {"memoryAdjustment": -1}})),
        "memoryAdjustment",
    );
    assert_rejected(
        "ProxmoxCluster",
        cluster(json!({"unknownField": 1})),
        ".spec.unknownField: field not declared in schema",
    );
}

#[test]
fn the_boot_volume_is_immutable() {
    let schema = schema_for("ProxmoxMachine");
    let old = machine(json!({"disks": {"bootVolume": {"disk": "scsi0", "sizeGb": 20}}}));
    let new = machine(json!({"disks": {"bootVolume": {"disk": "scsi0", "sizeGb": 30}}}));
    let found =
        capmox_testkit::schema::validate_object(&schema, &new, Some(&old)).expect_err("immutable");
    assert!(
        found
            .iter()
            .any(|v| v.message.contains("Value is immutable")),
        "{found:?}"
    );
    assert!(capmox_testkit::schema::validate_object(&schema, &old, Some(&old)).is_ok());
}

#[test]
fn data_disks_have_their_own_slots_on_the_right_bus_and_do_not_change() {
    let disks = |volumes: Value| json!({"disks": {"bootVolume": {"disk": "scsi0", "sizeGb": 20}, "additionalVolumes": volumes}});
    assert_eq!(
        violations(
            "ProxmoxMachine",
            &machine(disks(json!([
                {"disk": "scsi1", "sizeGb": 50, "storage": "ceph", "format": "raw", "discard": true, "ioThread": true, "ssd": true},
                {"disk": "virtio0", "sizeGb": 1, "ioThread": true}
            ])))
        ),
        Vec::<String>::new()
    );
    for (volumes, expected) in [
        (
            json!([{"disk": "scsi0", "sizeGb": 5}]),
            "an additional volume cannot use the boot volume's disk slot",
        ),
        (
            json!([{"disk": "scsi1", "sizeGb": 5}, {"disk": "scsi1", "sizeGb": 6}]),
            ".spec.disks.additionalVolumes[1]",
        ),
        (
            json!([{"disk": "scsi31", "sizeGb": 5}]),
            ".spec.disks.additionalVolumes[0].disk",
        ),
        (
            json!([{"disk": "nvme0", "sizeGb": 5}]),
            ".spec.disks.additionalVolumes[0].disk",
        ),
        (
            json!([{"disk": "scsi1", "sizeGb": 0}]),
            ".spec.disks.additionalVolumes[0].sizeGb",
        ),
        (
            json!([{"disk": "scsi1", "sizeGb": 131073}]),
            ".spec.disks.additionalVolumes[0].sizeGb",
        ),
        (
            json!([{"disk": "sata1", "sizeGb": 5, "ioThread": true}]),
            "ioThread works on scsi and virtio disks only",
        ),
        (
            json!([{"disk": "virtio1", "sizeGb": 5, "ssd": true}]),
            "ssd emulation is not available on virtio disks",
        ),
        (
            json!([{"disk": "scsi1", "sizeGb": 5, "storage": "bad storage"}]),
            ".spec.disks.additionalVolumes[0].storage",
        ),
    ] {
        assert_rejected("ProxmoxMachine", machine(disks(volumes)), expected);
    }
    let schema = schema_for("ProxmoxMachine");
    let old = machine(disks(json!([{"disk": "scsi1", "sizeGb": 50}])));
    let new = machine(disks(json!([{"disk": "scsi1", "sizeGb": 60}])));
    let found =
        capmox_testkit::schema::validate_object(&schema, &new, Some(&old)).expect_err("immutable");
    assert!(
        found
            .iter()
            .any(|v| v.message.contains("additionalVolumes are immutable")),
        "{found:?}"
    );
}

#[test]
fn firmware_and_cpu_settings_are_checked() {
    assert_eq!(
        violations(
            "ProxmoxMachine",
            &machine(
                json!({"cpu": {"type": "x86-64-v2-AES", "flags": ["+aes", "-pcid"]},
                            "numa": true, "bios": "ovmf", "secureBoot": true, "tpm": true})
            )
        ),
        Vec::<String>::new()
    );
    for (spec, expected) in [
        (json!({"tpm": true}), "tpm needs bios: ovmf"),
        (
            json!({"bios": "seabios", "tpm": true}),
            "tpm needs bios: ovmf",
        ),
        (json!({"secureBoot": true}), "secureBoot needs bios: ovmf"),
        (json!({"bios": "uefi"}), ".spec.bios"),
        (json!({"cpu": {"flags": ["aes"]}}), ".spec.cpu.flags[0]"),
        (
            json!({"cpu": {"type": "host,flags=+aes"}}),
            ".spec.cpu.type",
        ),
    ] {
        assert_rejected("ProxmoxMachine", machine(spec), expected);
    }
}

#[test]
fn pci_devices_and_dhcp_are_checked() {
    let good = json!({
        "pciDevices": [{"mapping": "gpu-a100", "pcie": true, "primaryGPU": true},
                       {"mapping": "nic_sriov", "rombar": false}],
        "network": {"networkDevices": [
            {"name": "net0", "bridge": "vmbr0", "dhcp4": true, "dhcp6": true},
            {"name": "net1", "bridge": "vmbr1", "defaultIPv4": true}]}
    });
    assert_eq!(
        violations("ProxmoxMachine", &machine(good)),
        Vec::<String>::new()
    );
    let nic = |extra: Value| {
        let mut device = json!({"name": "net0", "bridge": "vmbr0"});
        merge(&mut device, extra);
        json!({"network": {"networkDevices": [device]}})
    };
    for (spec, expected) in [
        (json!({"pciDevices": [{}]}), ".spec.pciDevices[0].mapping"),
        (
            json!({"pciDevices": [{"mapping": "gpu", "hostAddress": "0000:01:00.0"}]}),
            "Proxmox lets only root@pam, not an API token, pass a raw host PCI address through",
        ),
        (
            json!({"pciDevices": [{"mapping": "1gpu"}]}),
            ".spec.pciDevices[0].mapping",
        ),
        (
            json!({"pciDevices": [{"mapping": "ga", "primaryGPU": true}, {"mapping": "gb", "primaryGPU": true}]}),
            "at most one PCI device may be the primary GPU",
        ),
        (
            json!({"pciDevices": vec![json!({"mapping": "gpu"}); 17]}),
            ".spec.pciDevices",
        ),
        (
            nic(json!({"dhcp4": true, "defaultIPv4": true})),
            "dhcp4 and defaultIPv4 exclude each other",
        ),
        (
            nic(json!({"dhcp6": true, "defaultIPv6": true})),
            "dhcp6 and defaultIPv6 exclude each other",
        ),
        (
            nic(
                json!({"dhcp4": true, "ipPoolRef": [{"apiGroup": "ipam.cluster.x-k8s.io", "kind": "InClusterIPPool", "name": "p"}]}),
            ),
            "a device with dhcp4 or dhcp6 claims no pool addresses",
        ),
    ] {
        assert_rejected("ProxmoxMachine", machine(spec), expected);
    }
    let mut no_agent = machine(nic(json!({"dhcp4": true})));
    no_agent["spec"]["checks"] = json!({"skipQemuGuestAgent": true});
    assert_rejected(
        "ProxmoxMachine",
        no_agent,
        "dhcp4/dhcp6 need the QEMU guest agent",
    );
    let schema = schema_for("ProxmoxMachine");
    let old = machine(json!({"pciDevices": [{"mapping": "gpu"}]}));
    let new = machine(json!({"pciDevices": [{"mapping": "gpu2"}]}));
    let found =
        capmox_testkit::schema::validate_object(&schema, &new, Some(&old)).expect_err("immutable");
    assert!(
        found
            .iter()
            .any(|v| v.message.contains("pciDevices are immutable")),
        "{found:?}"
    );
}

#[test]
fn the_go_provider_templates_apply_unchanged() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/go-provider/templates");
    let entries =
        std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("cannot read {}: {e}", dir.display()));
    let mut checked = 0;
    for entry in entries {
        let path = entry.expect("dir entry").path();
        let text = substitute(
            &std::fs::read_to_string(&path).expect("readable"),
            TEMPLATE_VALUES,
        );
        for object in documents(&text) {
            let kind = object["kind"].as_str().unwrap_or_default().to_owned();
            if !kind.starts_with("Proxmox") {
                continue;
            }
            let found = violations(&kind, &object);
            assert!(found.is_empty(), "{} {kind}: {found:#?}", path.display());
            round_trip_by_kind(&object);
            checked += 1;
        }
    }
    assert!(
        checked >= 10,
        "only {checked} Proxmox objects found in the Go templates"
    );
}

fn v1alpha1_violations(kind: &str, object: &Value) -> Vec<String> {
    let crd = crd::all()
        .expect("CRDs render")
        .into_iter()
        .find(|c| c.spec.names.kind == kind)
        .unwrap_or_else(|| panic!("no CRD for {kind}"));
    let schema = crd::schema_json_of(&crd, "v1alpha1").expect("v1alpha1 schema");
    match capmox_testkit::schema::validate_object(&schema, object, None) {
        Ok(_) => Vec::new(),
        Err(found) => found.iter().map(ToString::to_string).collect(),
    }
}

/// Issue 35: strings pasted into Proxmox parameters, API paths, `netN` option lists or guest
/// network files have the formats Proxmox (or Linux) accepts, in both API versions.
#[test]
fn strings_that_reach_proxmox_or_guest_files_have_proxmox_formats() {
    let vrf = |name: &str| json!({"vrfs": [{"name": name, "table": 100, "interfaces": ["net0"]}]});
    let rejected = [
        (json!({"sourceNode": "../../access"}), ".spec.sourceNode"),
        (
            json!({"allowedNodes": ["pve1", "pve2/qemu"]}),
            ".spec.allowedNodes[1]",
        ),
        (
            json!({"full": true, "storage": "../local"}),
            ".spec.storage",
        ),
        (json!({"pool": "pool,comment=x"}), ".spec.pool"),
        (json!({"snapName": "x"}), ".spec.snapName"),
        (json!({"description": "a\u{7}b"}), ".spec.description"),
        (
            json!({"disks": {"bootVolume": {"disk": "scsi0,size=1T", "sizeGb": 20}}}),
            ".spec.disks.bootVolume.disk",
        ),
        (
            json!({"network": {"networkDevices": [{"name": "net0", "bridge": "vmbr0,firewall=0"}]}}),
            ".spec.network.networkDevices[0].bridge",
        ),
        (
            json!({"network": vrf("vrf-a\n[Network]\nDNS=203.0.113.9")}),
            ".spec.network.vrfs[0].name",
        ),
        (
            json!({"network": vrf("vrf-with-a-long-name")}),
            ".spec.network.vrfs[0].name",
        ),
    ];
    for (changes, field) in rejected {
        assert_rejected("ProxmoxMachine", machine(changes), field);
    }
    assert_rejected(
        "ProxmoxCluster",
        cluster(json!({"allowedNodes": ["../pve1"]})),
        ".spec.allowedNodes[0]",
    );
    assert_rejected(
        "ProxmoxCluster",
        cluster(json!({"zoneConfig": [{"zone": "a", "nodes": ["pve 1"]}]})),
        ".spec.zoneConfig[0].nodes[0]",
    );
    let accepted = machine(json!({
        "allowedNodes": ["pve1", "PVE-2"],
        "full": true,
        "storage": "ceph_pool.ssd-1",
        "pool": "team-a/k8s",
        "snapName": "base",
        "description": "Worker of demo\n\tmanaged by capmox",
        "disks": {"bootVolume": {"disk": "virtio15", "sizeGb": 20}},
        "network": {
            "networkDevices": [{"name": "net0", "bridge": "vnet_100.2"}],
            "vrfs": [{"name": "vrf-blue", "table": 100, "interfaces": ["net0"]}]
        }
    }));
    assert_eq!(
        violations("ProxmoxMachine", &accepted),
        Vec::<String>::new()
    );
}

#[test]
fn v1alpha1_strings_have_the_same_formats() {
    let mut object = json!({
        "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1",
        "kind": "ProxmoxMachine",
        "metadata": {"name": "m", "namespace": "default"},
        "spec": {"sourceNode": "pve1", "templateID": 100}
    });
    assert_eq!(
        v1alpha1_violations("ProxmoxMachine", &object),
        Vec::<String>::new()
    );
    merge(
        &mut object["spec"],
        json!({
            "target": "../../access",
            "network": {
                "default": {"bridge": "vmbr0,firewall=0"},
                "vrfs": [{"name": "vrf a", "table": 100}]
            }
        }),
    );
    let found = v1alpha1_violations("ProxmoxMachine", &object);
    for field in [
        ".spec.target",
        ".spec.network.default.bridge",
        ".spec.network.vrfs[0].name",
    ] {
        assert!(
            found.iter().any(|v| v.contains(field)),
            "{field}: {found:#?}"
        );
    }
}

#[test]
fn task_limits_are_between_one_and_sixty_four() {
    assert_rejected(
        "ProxmoxCluster",
        cluster(json!({"taskLimits": {"perNode": 0}})),
        ".spec.taskLimits.perNode",
    );
    assert_rejected(
        "ProxmoxCluster",
        cluster(
            json!({"zoneConfig": [{"zone": "rack-a", "nodes": ["pve1"], "taskLimits": {"perStorage": 65}}]}),
        ),
        ".spec.zoneConfig[0].taskLimits.perStorage",
    );
    assert!(
        violations(
            "ProxmoxCluster",
            &cluster(json!({"taskLimits": {"perNode": 1, "perStorage": 64}}))
        )
        .is_empty()
    );
}
