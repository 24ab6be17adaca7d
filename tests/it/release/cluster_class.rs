//! The ClusterClass `capmox`: its patches and variables build the topology flavor's objects.

mod rules;

use super::*;

/// The ClusterClass the topology flavor uses, and the objects of its file by kind and name.
fn cluster_class() -> (Value, Vec<Value>) {
    let objects = documents(&read_out("clusterclass-capmox.yaml"));
    let class = of_kind(&objects, "ClusterClass")[0].clone();
    (class, objects)
}

/// The template a ClusterClass `templateRef` names, from the class's file.
fn referenced(objects: &[Value], reference: &Value) -> Value {
    let found = named(
        objects,
        reference["kind"].as_str().expect("kind"),
        &reference["name"],
    );
    assert_eq!(found["apiVersion"], reference["apiVersion"], "{reference}");
    found.clone()
}

/// The class's variables with a Cluster's values (and `overrides` over them), defaulted and
/// validated by their schemas as Cluster API does; panics on an undeclared or missing one.
fn class_variables(
    class: &Value,
    values: &Value,
    overrides: &Value,
) -> serde_json::Map<String, Value> {
    let given: Vec<&Value> = values
        .as_array()
        .into_iter()
        .flatten()
        .chain(overrides.as_array().into_iter().flatten())
        .collect();
    let declared = class["spec"]["variables"].as_array().expect("variables");
    for value in &given {
        assert!(
            declared.iter().any(|d| d["name"] == value["name"]),
            "the Cluster sets {}, which the class does not declare",
            value["name"]
        );
    }
    let mut out = serde_json::Map::new();
    for variable in declared {
        let name = variable["name"].as_str().expect("named");
        let schema = &variable["schema"]["openAPIV3Schema"];
        let value = given
            .iter()
            .rev()
            .find(|v| v["name"] == name)
            .map(|v| v["value"].clone())
            .or_else(|| schema.get("default").cloned());
        let Some(value) = value else {
            assert_ne!(
                variable["required"], true,
                "the Cluster does not set the required variable {name}"
            );
            continue;
        };
        let value = capmox_testkit::schema::validate_object(schema, &value, None)
            .unwrap_or_else(|v| panic!("variable {name}: {v:#?}"));
        out.insert(name.to_owned(), value);
    }
    out
}

/// A variable by dotted path (`vmTemplate.sourceNode`), as `valueFrom.variable` names it.
fn variable<'a>(variables: &'a serde_json::Map<String, Value>, path: &str) -> Option<&'a Value> {
    let mut parts = path.split('.');
    let mut value = variables.get(parts.next()?)?;
    for part in parts {
        value = value.get(part)?;
    }
    Some(value)
}

/// Evaluates the two `enabledIf` forms the class uses, `{{ if .x }}true{{ end }}` and
/// `{{ if not .x }}true{{ end }}`, with Go template truth (empty and zero values are false).
fn enabled(enabled_if: &Value, variables: &serde_json::Map<String, Value>) -> bool {
    let Some(text) = enabled_if.as_str() else {
        return true;
    };
    let condition = text
        .strip_prefix("{{ if ")
        .and_then(|t| t.strip_suffix(" }}true{{ end }}"))
        .unwrap_or_else(|| panic!("enabledIf {text:?} is not a form this test evaluates"));
    let (negated, path) = match condition.strip_prefix("not ") {
        Some(path) => (true, path),
        None => (false, condition),
    };
    let path = path.strip_prefix('.').expect("a variable");
    let truthy = match variable(variables, path) {
        None | Some(Value::Null) | Some(Value::Bool(false)) => false,
        Some(Value::String(s)) => !s.is_empty(),
        Some(Value::Array(a)) => !a.is_empty(),
        Some(Value::Object(o)) => !o.is_empty(),
        Some(Value::Number(n)) => n.as_f64() != Some(0.0),
        Some(Value::Bool(true)) => true,
    };
    truthy != negated
}

/// Which of the class's templates a patch selector's `matchResources` picks.
#[derive(Clone, Copy, PartialEq)]
enum Holder<'a> {
    InfrastructureCluster,
    ControlPlane,
    ControlPlaneMachine,
    Worker(&'a str),
}

fn selects(selector: &Value, template: &Value, holder: Holder) -> bool {
    if selector["apiVersion"] != template["apiVersion"] || selector["kind"] != template["kind"] {
        return false;
    }
    let resources = &selector["matchResources"];
    match holder {
        Holder::InfrastructureCluster => resources["infrastructureCluster"] == true,
        Holder::ControlPlane | Holder::ControlPlaneMachine => resources["controlPlane"] == true,
        Holder::Worker(class) => resources["machineDeploymentClass"]["names"]
            .as_array()
            .is_some_and(|n| n.contains(&Value::from(class))),
    }
}

/// Applies one RFC 6902 operation (`add`, `replace`, `remove`) at a JSON pointer.
fn apply_json_patch(target: &mut Value, op: &str, path: &str, value: Option<Value>) {
    let (parent_path, last) = path.rsplit_once('/').expect("a JSON pointer");
    let parent = target
        .pointer_mut(parent_path)
        .unwrap_or_else(|| panic!("{op} {path}: {parent_path} does not exist in the template"));
    match (parent, op) {
        (Value::Object(map), "add") => {
            map.insert(last.to_owned(), value.expect("a value"));
        }
        (Value::Object(map), "replace") => {
            let slot = map
                .get_mut(last)
                .unwrap_or_else(|| panic!("replace {path}: nothing there to replace"));
            *slot = value.expect("a value");
        }
        (Value::Object(map), "remove") => {
            map.remove(last)
                .unwrap_or_else(|| panic!("remove {path}: nothing there to remove"));
        }
        (Value::Array(items), op) => {
            let index = if last == "-" {
                items.len()
            } else {
                last.parse().expect("an index")
            };
            match op {
                "add" => items.insert(index, value.expect("a value")),
                "replace" => items[index] = value.expect("a value"),
                _ => {
                    items.remove(index);
                }
            }
        }
        (other, _) => panic!("{op} {path}: {parent_path} is {other}, not an object or array"),
    }
}

/// The variable paths of a patch's `valueFrom.template` actions; the class uses only the form
/// `{{ .a.b }}` (a Go template printing a variable), which this test evaluates.
fn template_actions(text: &str) -> Vec<(std::ops::Range<usize>, &str)> {
    let mut actions = Vec::new();
    let mut from = 0;
    while let Some(start) = text[from..].find("{{").map(|s| s + from) {
        let end = text[start..].find("}}").expect("closing braces") + start + 2;
        let action = text[start + 2..end - 2].trim();
        let path = action
            .strip_prefix('.')
            .filter(|p| !p.is_empty() && !p.contains([' ', '|', '(']))
            .unwrap_or_else(|| {
                panic!("template action {action:?} is not a form this test evaluates")
            });
        actions.push((start..end, path));
        from = end;
    }
    actions
}

/// A patch's `valueFrom.template` rendered with the variables and read as YAML, as the
/// topology controller does.
fn rendered_patch_template(text: &str, variables: &serde_json::Map<String, Value>) -> Value {
    let mut out = String::new();
    let mut last = 0;
    for (range, path) in template_actions(text) {
        out.push_str(&text[last..range.start]);
        match variable(variables, path) {
            Some(Value::String(s)) => out.push_str(s),
            Some(scalar @ (Value::Number(_) | Value::Bool(_))) => out.push_str(&scalar.to_string()),
            other => panic!("template: .{path} is {other:?}, not a scalar"),
        }
        last = range.end;
    }
    out.push_str(&text[last..]);
    serde_norway::from_str(&out)
        .unwrap_or_else(|e| panic!("the rendered template is no YAML: {e}\n{out}"))
}

/// A template of the class with the class's patches for `holder` applied, as the topology
/// controller generates it for a Cluster.
fn patched(
    class: &Value,
    mut template: Value,
    holder: Holder,
    variables: &serde_json::Map<String, Value>,
) -> Value {
    for patch in class["spec"]["patches"].as_array().into_iter().flatten() {
        if !enabled(&patch["enabledIf"], variables) {
            continue;
        }
        for definition in patch["definitions"].as_array().expect("definitions") {
            if !selects(&definition["selector"], &template, holder) {
                continue;
            }
            for json_patch in definition["jsonPatches"].as_array().expect("jsonPatches") {
                let op = json_patch["op"].as_str().expect("op");
                let path = json_patch["path"].as_str().expect("path");
                let value_from = &json_patch["valueFrom"];
                let value = if let Some(name) = value_from["variable"].as_str() {
                    Some(
                        variable(variables, name)
                            .unwrap_or_else(|| panic!("{path}: variable {name} is not set"))
                            .clone(),
                    )
                } else if let Some(text) = value_from["template"].as_str() {
                    Some(rendered_patch_template(text, variables))
                } else {
                    json_patch.get("value").cloned()
                };
                apply_json_patch(&mut template, op, path, value);
            }
        }
    }
    template
}

/// What Cluster API makes of the topology flavor's Cluster with the class: the ProxmoxCluster,
/// the KubeadmControlPlane and MachineDeployments with their (patched) templates, named as a
/// rendered classic template would name them.
pub(super) fn topology_objects() -> Vec<Value> {
    let file = "cluster-template-topology.yaml";
    let (class, class_objects) = cluster_class();
    let clusters = rendered(file);
    assert_eq!(clusters.len(), 1, "{file}: only the Cluster");
    let cluster = &clusters[0];
    let topology = &cluster["spec"]["topology"];
    let cluster_name = cluster["metadata"]["name"].as_str().expect("named");
    let spec = &class["spec"];
    let mut out = vec![cluster.clone()];

    let variables = class_variables(&class, &topology["variables"], &Value::Null);
    let infrastructure = patched(
        &class,
        referenced(&class_objects, &spec["infrastructure"]["templateRef"]),
        Holder::InfrastructureCluster,
        &variables,
    );
    out.push(serde_json::json!({
        "apiVersion": infrastructure["apiVersion"],
        "kind": "ProxmoxCluster",
        "metadata": {"name": cluster_name},
        "spec": infrastructure["spec"]["template"]["spec"],
    }));

    let control_plane_variables = class_variables(
        &class,
        &topology["variables"],
        &topology["controlPlane"]["variables"]["overrides"],
    );
    let control_plane = patched(
        &class,
        referenced(&class_objects, &spec["controlPlane"]["templateRef"]),
        Holder::ControlPlane,
        &control_plane_variables,
    );
    validated(file, &control_plane);
    let mut machine = patched(
        &class,
        referenced(
            &class_objects,
            &spec["controlPlane"]["machineInfrastructure"]["templateRef"],
        ),
        Holder::ControlPlaneMachine,
        &control_plane_variables,
    );
    let machine_name = format!("{cluster_name}-control-plane");
    machine["metadata"]["name"] = Value::from(machine_name.as_str());
    out.push(machine);
    out.push(serde_json::json!({
        "apiVersion": "controlplane.cluster.x-k8s.io/v1beta2",
        "kind": "KubeadmControlPlane",
        "metadata": {"name": machine_name},
        "spec": {
            "version": topology["version"],
            "replicas": topology["controlPlane"]["replicas"],
            "machineTemplate": {"spec": {"infrastructureRef": {
                "apiGroup": "infrastructure.cluster.x-k8s.io",
                "kind": "ProxmoxMachineTemplate",
                "name": machine_name,
            }}},
            "kubeadmConfigSpec": control_plane["spec"]["template"]["spec"]["kubeadmConfigSpec"],
        },
    }));

    let classes = spec["workers"]["machineDeployments"]
        .as_array()
        .expect("MachineDeployment classes");
    for deployment in topology["workers"]["machineDeployments"]
        .as_array()
        .expect("MachineDeployments")
    {
        let class_name = deployment["class"].as_str().expect("a class");
        let md_class = classes
            .iter()
            .find(|c| c["class"] == class_name)
            .unwrap_or_else(|| panic!("the class has no MachineDeployment class {class_name}"));
        let md_variables = class_variables(
            &class,
            &topology["variables"],
            &deployment["variables"]["overrides"],
        );
        let name = format!(
            "{cluster_name}-{}",
            deployment["name"].as_str().expect("named")
        );
        let bootstrap = patched(
            &class,
            referenced(&class_objects, &md_class["bootstrap"]["templateRef"]),
            Holder::Worker(class_name),
            &md_variables,
        );
        validated(file, &bootstrap);
        let mut machine = patched(
            &class,
            referenced(&class_objects, &md_class["infrastructure"]["templateRef"]),
            Holder::Worker(class_name),
            &md_variables,
        );
        machine["metadata"]["name"] = Value::from(name.as_str());
        out.push(machine);
        let mut bootstrap = bootstrap;
        bootstrap["metadata"]["name"] = Value::from(name.as_str());
        out.push(bootstrap);
        out.push(serde_json::json!({
            "apiVersion": "cluster.x-k8s.io/v1beta2",
            "kind": "MachineDeployment",
            "metadata": {"name": name},
            "spec": {
                "clusterName": cluster_name,
                "replicas": deployment["replicas"],
                "template": {"spec": {
                    "clusterName": cluster_name,
                    "failureDomain": deployment.get("failureDomain")
                        .or(md_class.get("failureDomain")),
                    "bootstrap": {"configRef": {
                        "apiGroup": "bootstrap.cluster.x-k8s.io",
                        "kind": "KubeadmConfigTemplate",
                        "name": name,
                    }},
                    "infrastructureRef": {
                        "apiGroup": "infrastructure.cluster.x-k8s.io",
                        "kind": "ProxmoxMachineTemplate",
                        "name": name,
                    },
                }},
            },
        }));
    }
    for object in &out[1..] {
        if object["kind"] != "MachineDeployment" && object["kind"] != "KubeadmControlPlane" {
            validated(file, object);
            read_as_capmox(file, object);
        }
    }
    out
}

/// Whether a JSON pointer names a place the schema has (a property, an array item or `-`).
fn schema_has_path(schema: &Value, path: &str) -> bool {
    let mut node = schema;
    for segment in path.split('/').skip(1) {
        node = if node["type"] == "array" {
            if segment != "-" && segment.parse::<usize>().is_err() {
                return false;
            }
            &node["items"]
        } else {
            match node["properties"].get(segment) {
                Some(child) => child,
                None => return false,
            }
        };
    }
    true
}

#[test]
fn the_topology_flavor_uses_the_cluster_class_and_its_zones() {
    let (class, _) = cluster_class();
    let cluster = rendered("cluster-template-topology.yaml").remove(0);
    let topology = &cluster["spec"]["topology"];
    assert_eq!(topology["classRef"]["name"], class["metadata"]["name"]);
    assert!(
        topology["classRef"].get("namespace").is_none(),
        "the class is looked up in the Cluster's namespace, where clusterctl puts it"
    );
    let objects = topology_objects();
    let proxmox = proxmox_cluster("topology", &objects);
    let zones: Vec<&str> = proxmox["spec"]["zoneConfig"]
        .as_array()
        .expect("zones from the variable")
        .iter()
        .filter_map(|z| z["zone"].as_str())
        .collect();
    assert_eq!(zones, ["zone-a", "zone-b", "zone-c"]);
    assert_eq!(proxmox["spec"]["controlPlaneEndpoint"]["host"], "10.0.0.10");
    let pinned: Vec<&str> = of_kind(&objects, "MachineDeployment")
        .iter()
        .filter_map(|d| d["spec"]["template"]["spec"]["failureDomain"].as_str())
        .collect();
    assert_eq!(pinned, zones, "one MachineDeployment per zone");
    let groups = machine_groups("topology", &objects, &proxmox);
    let control_plane = &groups[0];
    assert_eq!(
        control_plane.failure_domains,
        [Some("zone-a".to_owned()), Some("zone-b".to_owned())],
        "the control plane spreads over the eligible zones"
    );
    for (owner, placement) in placements("topology", &proxmox, &groups) {
        assert_eq!(
            placement.template(),
            &capmox::placement::TemplateSource::Id {
                vmid: 9000,
                node: "pve1".into()
            },
            "{owner}"
        );
        assert_eq!(pools_of(&placement, "net0"), ["demo-v4-icip"], "{owner}");
    }
}

/// The class's other arm: a template chosen by tags, a dual-stack cluster, no zones, and a bigger
/// control plane through an override.
#[test]
fn the_cluster_class_takes_a_template_selector_ipv6_and_overrides() {
    let (class, class_objects) = cluster_class();
    let values = serde_json::json!([
        {"name": "controlPlaneEndpoint", "value": {"host": "10.0.0.10"}},
        {"name": "dnsServers", "value": ["10.0.0.2"]},
        {"name": "ipv4Config", "value": {"addresses": ["10.0.0.100-10.0.0.150"], "prefix": 24, "gateway": "10.0.0.1"}},
        {"name": "ipv6Config", "value": {"addresses": ["2001:db8::100-2001:db8::150"], "prefix": 64, "gateway": "2001:db8::1"}},
        {"name": "vmTemplate", "value": {"templateSelector": {"matchTags": ["ubuntu-24.04"]}}},
        {"name": "bridge", "value": "vmbr0"},
    ]);
    let overrides = serde_json::json!([{"name": "machine", "value": {"memoryMiB": 32768}}]);
    let variables = class_variables(&class, &values, &overrides);
    assert_eq!(variables["controlPlaneEndpoint"]["port"], 6443, "defaulted");
    let spec = &class["spec"];
    let machine = patched(
        &class,
        referenced(
            &class_objects,
            &spec["controlPlane"]["machineInfrastructure"]["templateRef"],
        ),
        Holder::ControlPlaneMachine,
        &variables,
    );
    let machine_spec = &validated("class", &machine)["spec"]["template"]["spec"];
    assert!(machine_spec.get("sourceNode").is_none() && machine_spec.get("templateID").is_none());
    assert_eq!(
        machine_spec["templateSelector"]["matchTags"],
        serde_json::json!(["ubuntu-24.04"])
    );
    assert_eq!(machine_spec["memoryMiB"], 32768);
    assert_eq!(
        machine_spec["numCores"], 4,
        "the rest of the variable is defaulted"
    );
    assert_eq!(machine_spec["disks"]["bootVolume"]["sizeGb"], 100);
    let infrastructure = patched(
        &class,
        referenced(&class_objects, &spec["infrastructure"]["templateRef"]),
        Holder::InfrastructureCluster,
        &variables,
    );
    let cluster = validated(
        "class",
        &serde_json::json!({
            "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha2",
            "kind": "ProxmoxCluster",
            "metadata": {"name": "demo"},
            "spec": infrastructure["spec"]["template"]["spec"],
        }),
    );
    assert!(cluster["spec"].get("zoneConfig").is_none());
    let control_plane = patched(
        &class,
        referenced(&class_objects, &spec["controlPlane"]["templateRef"]),
        Holder::ControlPlane,
        &variables,
    );
    let control_plane = validated("class", &control_plane);
    let config = &control_plane["spec"]["template"]["spec"]["kubeadmConfigSpec"];
    let pod: Value = serde_norway::from_str(
        kubeadm_file("class", config, KUBE_VIP_MANIFEST)["content"]
            .as_str()
            .expect("content"),
    )
    .expect("a Pod");
    let default_pod: Value = {
        let objects = rendered("cluster-template.yaml");
        let kcp = of_kind(&objects, "KubeadmControlPlane")[0];
        let file = kubeadm_file(
            "default",
            &kcp["spec"]["kubeadmConfigSpec"],
            KUBE_VIP_MANIFEST,
        );
        serde_norway::from_str(file["content"].as_str().expect("content")).expect("a Pod")
    };
    assert_eq!(
        pod["spec"]["containers"][0]["image"], default_pod["spec"]["containers"][0]["image"],
        "kubeVip defaults to the image the cluster templates default to"
    );
    assert_eq!(
        pod["spec"]["containers"][0]["env"], default_pod["spec"]["containers"][0]["env"],
        "the same kube-vip settings, the VIP from controlPlaneEndpoint"
    );
    let group = MachineGroup {
        owner: "control plane".into(),
        template: machine,
        failure_domains: vec![None],
    };
    for (_, placement) in placements("class", &cluster, &[group]) {
        assert_eq!(
            pools_of(&placement, "net0"),
            ["demo-v4-icip", "demo-v6-icip"]
        );
    }
    let vm_template = spec["variables"]
        .as_array()
        .expect("variables")
        .iter()
        .find(|v| v["name"] == "vmTemplate")
        .expect("vmTemplate");
    for half in [
        serde_json::json!({"sourceNode": "pve1"}),
        serde_json::json!({"sourceNode": "pve1", "templateID": 9000, "templateSelector": {"matchTags": ["a"]}}),
    ] {
        assert!(
            capmox_testkit::schema::validate_object(
                &vm_template["schema"]["openAPIV3Schema"],
                &half,
                None
            )
            .is_err(),
            "vmTemplate {half} is refused"
        );
    }
}
