//! Every JSON patch of every shipped ClusterClass passes the checks Cluster API v1.13's
//! ClusterClass webhook makes (`internal/webhooks/patch_validation.go` of
//! kubernetes-sigs/cluster-api), and names a place the schema of the template kind it selects
//! has. The real webhook refused `replace .../networkDevices/0/bridge` (issue 29).

use std::collections::BTreeSet;

use serde_json::Value;

use super::{CLUSTER_CLASSES, documents, read_out, schema_has_path, schema_of, template_actions};

/// The builtin variables Cluster API v1.13 offers patches (`builtin.` + one of these).
const BUILTIN_VARIABLES: &[&str] = &[
    "",
    "cluster",
    "cluster.name",
    "cluster.namespace",
    "cluster.uid",
    "cluster.metadata.labels",
    "cluster.metadata.annotations",
    "cluster.topology",
    "cluster.topology.classRef.name",
    "cluster.topology.classRef.namespace",
    "cluster.topology.class",
    "cluster.topology.classNamespace",
    "cluster.topology.version",
    "cluster.network",
    "cluster.network.serviceDomain",
    "cluster.network.services",
    "cluster.network.pods",
    "controlPlane",
    "controlPlane.name",
    "controlPlane.replicas",
    "controlPlane.version",
    "controlPlane.metadata.labels",
    "controlPlane.metadata.annotations",
    "controlPlane.machineTemplate.infrastructureRef.name",
    "machineDeployment",
    "machineDeployment.class",
    "machineDeployment.name",
    "machineDeployment.replicas",
    "machineDeployment.topologyName",
    "machineDeployment.version",
    "machineDeployment.metadata.labels",
    "machineDeployment.metadata.annotations",
    "machineDeployment.bootstrap.configRef.name",
    "machineDeployment.infrastructureRef.name",
];

/// A ClusterClass and the templates of its file.
struct Class {
    file: &'static str,
    class: Value,
    objects: Vec<Value>,
    declared: BTreeSet<String>,
}

impl Class {
    fn read(file: &'static str) -> Class {
        let objects = documents(&read_out(file));
        let class = objects
            .iter()
            .find(|o| o["kind"] == "ClusterClass")
            .unwrap_or_else(|| panic!("{file}: no ClusterClass"))
            .clone();
        let declared = class["spec"]["variables"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|v| v["name"].as_str().map(str::to_owned))
            .collect();
        Class {
            file,
            class,
            objects,
            declared,
        }
    }

    /// Whether a variable reference (`a.b`, `a[0].b`, `builtin.x`) names a declared or builtin
    /// variable, as the webhook checks it (only the name before the first `.` or `[`).
    fn knows(&self, reference: &str) -> bool {
        match reference.strip_prefix("builtin") {
            Some(rest) if rest.is_empty() || rest.starts_with('.') => {
                BUILTIN_VARIABLES.contains(&rest.trim_start_matches('.'))
            }
            _ => {
                let name = reference.split(['.', '[']).next().unwrap_or_default();
                self.declared.contains(name)
            }
        }
    }

    /// The `templateRef`s a selector may pick, with whether its `matchResources` picks them.
    fn selected(&self, selector: &Value) -> Vec<(&Value, bool)> {
        let spec = &self.class["spec"];
        let resources = &selector["matchResources"];
        let mut refs = vec![
            (
                &spec["infrastructure"]["templateRef"],
                resources["infrastructureCluster"] == true,
            ),
            (
                &spec["controlPlane"]["templateRef"],
                resources["controlPlane"] == true,
            ),
            (
                &spec["controlPlane"]["machineInfrastructure"]["templateRef"],
                resources["controlPlane"] == true,
            ),
        ];
        let names: Vec<&str> = resources["machineDeploymentClass"]["names"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .collect();
        for md in spec["workers"]["machineDeployments"]
            .as_array()
            .into_iter()
            .flatten()
        {
            let class = md["class"].as_str().unwrap_or_default();
            let picked = names.iter().any(|n| class_matches(n, class));
            refs.push((&md["bootstrap"]["templateRef"], picked));
            refs.push((&md["infrastructure"]["templateRef"], picked));
        }
        refs.into_iter()
            .filter(|(r, _)| {
                r["kind"] == selector["kind"] && r["apiVersion"] == selector["apiVersion"]
            })
            .collect()
    }

    /// The template object of the class's file a `templateRef` names.
    fn template(&self, reference: &Value) -> Option<&Value> {
        self.objects.iter().find(|o| {
            o["kind"] == reference["kind"]
                && o["apiVersion"] == reference["apiVersion"]
                && o["metadata"]["name"] == reference["name"]
        })
    }
}

/// A `machineDeploymentClass` selector name against a class: exact, `*`, `prefix*`, `*suffix`.
fn class_matches(name: &str, class: &str) -> bool {
    name == class
        || name == "*"
        || name
            .strip_suffix('*')
            .is_some_and(|prefix| class.starts_with(prefix))
        || name
            .strip_prefix('*')
            .is_some_and(|suffix| class.ends_with(suffix))
}

/// What the webhook finds wrong with one JSON patch (its op, path, value and valueFrom).
fn json_patch_findings(class: &Class, patch: &Value) -> Vec<String> {
    let mut found = Vec::new();
    let op = patch["op"].as_str().unwrap_or_default();
    let path = patch["path"].as_str().unwrap_or_default();
    if !["add", "replace", "remove"].contains(&op) {
        found.push(format!("op {op:?} is not add, replace or remove"));
    }
    if !path.starts_with("/spec/") {
        found.push(format!("{path}: the path must start with /spec/"));
    }
    for segment in path.split('/') {
        let Ok(index) = segment.parse::<i64>() else {
            continue;
        };
        if op == "add" && index != 0 {
            found.push(format!("{path}: add may index arrays only by 0 or -"));
        }
        if op == "replace" || op == "remove" {
            found.push(format!(
                "{path}: elements in arrays can not be accessed in a {op} operation"
            ));
        }
    }
    let dashes = path.split('/').filter(|s| *s == "-").count();
    if dashes > usize::from(op == "add" && path.ends_with("/-")) {
        found.push(format!("{path}: - only ends the path of an add"));
    }
    if op == "remove" {
        return found;
    }
    let value_from = patch.get("valueFrom");
    match (patch.get("value"), value_from) {
        (None, None) => found.push(format!("{path}: neither value nor valueFrom")),
        (Some(_), Some(_)) => found.push(format!("{path}: both value and valueFrom")),
        _ => {}
    }
    let Some(value_from) = value_from else {
        return found;
    };
    let variable = value_from.get("variable").and_then(Value::as_str);
    let template = value_from.get("template").and_then(Value::as_str);
    match (variable, template) {
        (None, None) => found.push(format!(
            "{path}: valueFrom sets neither template nor variable"
        )),
        (Some(_), Some(_)) => found.push(format!("{path}: valueFrom sets template and variable")),
        _ => {}
    }
    if let Some(variable) = variable
        && !class.knows(variable)
    {
        found.push(format!("{path}: variable {variable} cannot be found"));
    }
    if let Some(template) = template {
        if template.matches("{{").count() != template.matches("}}").count() {
            found.push(format!("{path}: the template does not parse"));
        }
        for (_, read) in template_actions(template) {
            if !class.knows(read) {
                found.push(format!("{path}: the template reads {read}, not declared"));
            }
        }
    }
    found
}

/// What the webhook finds wrong with a selector: it must pick something, and what it enables
/// must be a template of the class of its kind.
fn selector_findings(class: &Class, selector: &Value) -> Vec<String> {
    let resources = &selector["matchResources"];
    let names = resources["machineDeploymentClass"]["names"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let mut found = Vec::new();
    if resources["infrastructureCluster"] != true
        && resources["controlPlane"] != true
        && names.is_empty()
    {
        found.push("the selector enables nothing".to_owned());
    }
    let spec = &class.class["spec"];
    let is = |reference: &Value| {
        reference["kind"] == selector["kind"] && reference["apiVersion"] == selector["apiVersion"]
    };
    if resources["infrastructureCluster"] == true && !is(&spec["infrastructure"]["templateRef"]) {
        found.push("infrastructureCluster, but not the infrastructure template's kind".into());
    }
    if resources["controlPlane"] == true
        && !is(&spec["controlPlane"]["templateRef"])
        && !is(&spec["controlPlane"]["machineInfrastructure"]["templateRef"])
    {
        found.push("controlPlane, but neither control-plane template's kind".into());
    }
    for name in names.iter().filter_map(Value::as_str) {
        let md_classes = spec["workers"]["machineDeployments"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let matched = md_classes.iter().any(|md| {
            class_matches(name, md["class"].as_str().unwrap_or_default())
                && ["bootstrap", "infrastructure"]
                    .iter()
                    .any(|part| is(&md[part]["templateRef"]))
        });
        if !matched {
            found.push(format!(
                "machineDeploymentClass {name}: no class of the selector's kind"
            ));
        }
    }
    found
}

/// Where a patch's path is not in the schema of the kind it selects, or (replace and remove)
/// not in a template the selector picks, or (add) its parent is not.
fn target_findings(class: &Class, selector: &Value, patch: &Value) -> Vec<String> {
    let kind = selector["kind"].as_str().unwrap_or_default();
    let version = selector["apiVersion"].as_str().unwrap_or_default();
    let op = patch["op"].as_str().unwrap_or_default();
    let path = patch["path"].as_str().unwrap_or_default();
    let Some(schema) = schema_of(kind, version.rsplit('/').next().unwrap_or(version)) else {
        return vec![format!("no CRD serves {kind} {version}")];
    };
    let mut found = Vec::new();
    if !schema_has_path(&schema, path) {
        found.push(format!("{kind} has no {path} in its schema"));
    }
    let parent = path.rsplit_once('/').map_or("", |(parent, _)| parent);
    for (reference, picked) in class.selected(selector) {
        let Some(template) = class.template(reference).filter(|_| picked) else {
            continue;
        };
        let name = &template["metadata"]["name"];
        let there = match op {
            "add" => template
                .pointer(parent)
                .is_some_and(|p| p.is_object() || p.is_array()),
            _ => template.pointer(path).is_some(),
        };
        if !there {
            found.push(format!("{op} {path}: not in {kind} {name}"));
        }
    }
    found
}

/// Every finding for a ClusterClass, each naming the patch as the webhook does.
fn findings(class: &Class) -> (Vec<String>, usize) {
    let mut found = Vec::new();
    let mut names = BTreeSet::new();
    let mut checked = 0;
    let patches = class.class["spec"]["patches"].as_array().cloned();
    for (i, patch) in patches.unwrap_or_default().iter().enumerate() {
        let at = format!("{}: spec.patches[{i}] ({})", class.file, patch["name"]);
        let name = patch["name"].as_str().unwrap_or_default();
        if name.is_empty() || !names.insert(name.to_owned()) {
            found.push(format!("{at}: the name is empty or not unique"));
        }
        let enabled_if = patch["enabledIf"].as_str().unwrap_or_default();
        for read in condition_reads(enabled_if) {
            if !class.knows(&read) {
                found.push(format!("{at}: enabledIf reads {read}, not declared"));
            }
        }
        let definitions = patch["definitions"].as_array().cloned();
        if definitions.is_some() == patch.get("external").is_some() {
            found.push(format!("{at}: one of definitions or external"));
        }
        for (d, definition) in definitions.unwrap_or_default().iter().enumerate() {
            let at = format!("{at}.definitions[{d}]");
            let selector = &definition["selector"];
            for problem in selector_findings(class, selector) {
                found.push(format!("{at}.selector: {problem}"));
            }
            let json_patches = definition["jsonPatches"].as_array().cloned();
            for (j, json_patch) in json_patches.unwrap_or_default().iter().enumerate() {
                let problems = json_patch_findings(class, json_patch)
                    .into_iter()
                    .chain(target_findings(class, selector, json_patch));
                for problem in problems {
                    found.push(format!("{at}.jsonPatches[{j}]: {problem}"));
                }
                checked += 1;
            }
        }
    }
    (found, checked)
}

/// The variables an `enabledIf` reads (`.a.b` operands of its actions).
fn condition_reads(text: &str) -> Vec<String> {
    let mut reads = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find("{{") {
        let Some(end) = rest[start..].find("}}") else {
            break;
        };
        for word in rest[start + 2..start + end].split_whitespace() {
            if let Some(read) = word.strip_prefix('.').filter(|w| !w.is_empty()) {
                reads.push(read.to_owned());
            }
        }
        rest = &rest[start + end + 2..];
    }
    reads
}

#[test]
fn every_cluster_class_patch_passes_the_capi_webhook_and_targets_its_templates() {
    let mut problems = Vec::new();
    let mut checked = 0;
    for file in CLUSTER_CLASSES {
        let (found, count) = findings(&Class::read(file));
        problems.extend(found);
        checked += count;
    }
    assert!(checked >= 10, "only {checked} JSON patches checked");
    assert!(
        problems.is_empty(),
        "the Cluster API webhook or the templates refuse: {problems:#?}"
    );
}

/// The rules themselves, on patches the real webhook refuses or takes.
#[test]
fn the_webhook_rules_refuse_what_cluster_api_refuses() {
    let class = Class {
        file: "inline",
        class: Value::Null,
        objects: Vec::new(),
        declared: ["bridge".to_owned()].into(),
    };
    let check = |patch: Value| json_patch_findings(&class, &patch);
    let refused = [
        serde_json::json!({"op": "replace", "path": "/spec/template/spec/a/0/b", "valueFrom": {"variable": "bridge"}}),
        serde_json::json!({"op": "remove", "path": "/spec/template/spec/a/0"}),
        serde_json::json!({"op": "add", "path": "/spec/template/spec/a/1", "value": 1}),
        serde_json::json!({"op": "move", "path": "/spec/template/spec/a"}),
        serde_json::json!({"op": "add", "path": "/metadata/labels", "value": {}}),
        serde_json::json!({"op": "add", "path": "/spec/a", "value": 1, "valueFrom": {"variable": "bridge"}}),
        serde_json::json!({"op": "add", "path": "/spec/a"}),
        serde_json::json!({"op": "add", "path": "/spec/a", "valueFrom": {"variable": "bridge", "template": "x"}}),
        serde_json::json!({"op": "add", "path": "/spec/a", "valueFrom": {"variable": "other.x"}}),
        serde_json::json!({"op": "add", "path": "/spec/a", "valueFrom": {"variable": "builtin.nothing"}}),
    ];
    for patch in refused {
        assert!(!check(patch.clone()).is_empty(), "{patch} passed");
    }
    let taken = [
        serde_json::json!({"op": "add", "path": "/spec/template/spec/a/0/b", "valueFrom": {"variable": "bridge"}}),
        serde_json::json!({"op": "add", "path": "/spec/template/spec/a/-", "value": 1}),
        serde_json::json!({"op": "replace", "path": "/spec/template/spec/a", "valueFrom": {"template": "- {{ .bridge }}"}}),
        serde_json::json!({"op": "add", "path": "/spec/a", "valueFrom": {"variable": "builtin.cluster.name"}}),
        serde_json::json!({"op": "add", "path": "/spec/a", "valueFrom": {"variable": "bridge[0].x"}}),
    ];
    for patch in taken {
        assert_eq!(check(patch.clone()), Vec::<String>::new(), "{patch}");
    }
}
