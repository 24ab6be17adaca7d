//! The CustomResourceDefinitions of capmox's kinds, as committed under `crds/`.

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
    CustomResourceDefinition, JSONSchemaProps,
};
use kube::CustomResourceExt;
use serde_json::Value;

use super::{
    ProxmoxCluster, ProxmoxClusterTemplate, ProxmoxMachine, ProxmoxMachineTemplate,
    ProxmoxRemediation, ProxmoxRemediationTemplate, v1alpha1,
};

/// Why the CRDs could not be produced.
#[derive(Debug, thiserror::Error)]
pub enum CrdError {
    /// A schema could not be converted between its JSON and typed forms.
    #[error("CRD {name}: cannot convert the schema: {source}")]
    Schema {
        /// CRD name.
        name: String,
        /// Underlying error.
        source: serde_json::Error,
    },
    /// The versions of a kind could not be merged into one CRD.
    #[error("CRD {name}: cannot merge its versions: {source}")]
    Merge {
        /// CRD name.
        name: String,
        /// Underlying error.
        source: kube::core::crd::MergeError,
    },
    /// A CRD could not be written as YAML.
    #[error("CRD {name}: cannot render YAML: {source}")]
    Yaml {
        /// CRD name.
        name: String,
        /// Underlying error.
        source: serde_norway::Error,
    },
}

/// All capmox CRDs, in a stable order, with their schemas finalised for the API server: the
/// kinds the Go provider had serve v1alpha2 (stored) and the deprecated v1alpha1; the
/// remediation kinds, new with capmox, v1alpha2 only.
pub fn all() -> Result<Vec<CustomResourceDefinition>, CrdError> {
    let versioned = [
        (ProxmoxCluster::crd(), v1alpha1::ProxmoxCluster::crd()),
        (
            ProxmoxClusterTemplate::crd(),
            v1alpha1::ProxmoxClusterTemplate::crd(),
        ),
        (ProxmoxMachine::crd(), v1alpha1::ProxmoxMachine::crd()),
        (
            ProxmoxMachineTemplate::crd(),
            v1alpha1::ProxmoxMachineTemplate::crd(),
        ),
    ]
    .into_iter()
    .map(|(hub, spoke)| finalize(merge(hub, spoke)?));
    let single = [ProxmoxRemediation::crd(), ProxmoxRemediationTemplate::crd()]
        .into_iter()
        .map(finalize);
    versioned.chain(single).collect()
}

/// One CRD serving both versions, v1alpha2 as the storage version and v1alpha1 marked deprecated
/// so that clients using it are warned.
fn merge(
    hub: CustomResourceDefinition,
    mut spoke: CustomResourceDefinition,
) -> Result<CustomResourceDefinition, CrdError> {
    let name = hub.metadata.name.clone().unwrap_or_default();
    let kind = hub.spec.names.kind.clone();
    for version in &mut spoke.spec.versions {
        version.deprecated = Some(true);
        version.deprecation_warning = Some(format!(
            "{}/{} {kind} is deprecated; use {}/{}",
            super::GROUP,
            v1alpha1::VERSION,
            super::GROUP,
            super::VERSION
        ));
    }
    kube::core::crd::merge_crds(vec![hub, spoke], super::VERSION)
        .map_err(|source| CrdError::Merge { name, source })
}

/// File name of a CRD under `crds/`: `<group>_<plural>.yaml`, as controller-gen names them.
pub fn file_name(crd: &CustomResourceDefinition) -> String {
    format!("{}_{}.yaml", crd.spec.group, crd.spec.names.plural)
}

/// One CRD as a YAML document.
pub fn to_yaml(crd: &CustomResourceDefinition) -> Result<String, CrdError> {
    let name = crd.metadata.name.clone().unwrap_or_default();
    let mut json = serde_json::to_value(crd).map_err(|source| CrdError::Schema {
        name: name.clone(),
        source,
    })?;
    // The typed schema stores bounds as floats; publish whole numbers as integers.
    tidy_schema(&mut json);
    serde_norway::to_string(&json).map_err(|source| CrdError::Yaml { name, source })
}

/// All CRDs as one multi-document YAML stream, as `capmox crds` prints it.
pub fn render_all() -> Result<String, CrdError> {
    let mut out = String::new();
    for crd in all()? {
        out.push_str("---\n");
        out.push_str(&to_yaml(&crd)?);
    }
    Ok(out)
}

/// The `openAPIV3Schema` of a CRD's storage version as plain JSON, for validation and tests.
pub fn schema_json(crd: &CustomResourceDefinition) -> Option<Value> {
    schema_json_of(crd, super::VERSION)
}

/// The `openAPIV3Schema` of one version of a CRD as plain JSON.
pub fn schema_json_of(crd: &CustomResourceDefinition, version: &str) -> Option<Value> {
    let schema = crd
        .spec
        .versions
        .iter()
        .find(|v| v.name == version)?
        .schema
        .as_ref()?
        .open_api_v3_schema
        .as_ref()?;
    let mut json = serde_json::to_value(schema).ok()?;
    tidy_schema(&mut json);
    Some(json)
}

/// Turns a derived CRD into the one we publish: absent fields (not nulls) express optional
/// values, as in the Go provider's CRDs, and integer bounds are written as integers.
fn finalize(mut crd: CustomResourceDefinition) -> Result<CustomResourceDefinition, CrdError> {
    let name = crd.metadata.name.clone().unwrap_or_default();
    for version in &mut crd.spec.versions {
        let Some(validation) = version.schema.as_mut() else {
            continue;
        };
        let Some(schema) = validation.open_api_v3_schema.take() else {
            continue;
        };
        let mut json = serde_json::to_value(&schema).map_err(|source| CrdError::Schema {
            name: name.clone(),
            source,
        })?;
        tidy_schema(&mut json);
        add_type_meta(&mut json);
        relax_template_rules(&crd.spec.names.kind, &mut json);
        if version.name == super::VERSION {
            add_template_rules(&crd.spec.names.kind, &mut json);
        }
        relax_clone_spec_rules(&mut json);
        let schema: JSONSchemaProps =
            serde_json::from_value(json).map_err(|source| CrdError::Schema {
                name: name.clone(),
                source,
            })?;
        validation.open_api_v3_schema = Some(schema);
    }
    Ok(crd)
}

/// Keeps a template's spec exactly as permissive as the Go provider's: it checks "at least one
/// ip config" on ProxmoxClusters only, and the `exists_one` template-source rules on
/// ProxmoxMachines only, so existing ClusterClasses and templates keep applying. Likewise the
/// checks capmox took over from the Go provider's ProxmoxMachine webhook
/// ([`super::machine::MACHINE_ONLY_RULES`]), which never ran on templates.
fn relax_template_rules(kind: &str, schema: &mut Value) {
    let Some(spec) = schema.pointer_mut("/properties/spec/properties/template/properties/spec")
    else {
        return;
    };
    match kind {
        "ProxmoxClusterTemplate" => retain_rules(spec, &|_| false),
        "ProxmoxMachineTemplate" => {
            retain_rules(spec, &|rule| !rule.contains("exists_one"));
            drop_rules_everywhere(spec, &|rule| {
                super::machine::MACHINE_ONLY_RULES.contains(&rule)
            });
        }
        _ => {}
    }
}

/// The template-only rules of the stored version: a ProxmoxMachineTemplate names no
/// `providerID`.
fn add_template_rules(kind: &str, schema: &mut Value) {
    if kind != "ProxmoxMachineTemplate" {
        return;
    }
    let Some(spec) = schema
        .pointer_mut("/properties/spec/properties/template/properties/spec")
        .and_then(Value::as_object_mut)
    else {
        return;
    };
    let rules = spec
        .entry("x-kubernetes-validations")
        .or_insert_with(|| Value::Array(Vec::new()));
    if let Some(rules) = rules.as_array_mut() {
        rules.push(serde_json::json!({
            "rule": super::machine::TEMPLATE_WITHOUT_PROVIDER_ID_RULE,
            "message": super::machine::TEMPLATE_WITHOUT_PROVIDER_ID_MESSAGE,
        }));
    }
}

/// Keeps the rules of one schema node that `keep` accepts, dropping an emptied list.
fn retain_rules(node: &mut Value, keep: &dyn Fn(&str) -> bool) {
    let Some(object) = node.as_object_mut() else {
        return;
    };
    let Some(rules) = object
        .get_mut("x-kubernetes-validations")
        .and_then(Value::as_array_mut)
    else {
        return;
    };
    rules.retain(|rule| rule.get("rule").and_then(Value::as_str).is_none_or(keep));
    if rules.is_empty() {
        object.remove("x-kubernetes-validations");
    }
}

/// Drops the rules `drop` names from a schema node and everything below it.
fn drop_rules_everywhere(node: &mut Value, drop: &dyn Fn(&str) -> bool) {
    retain_rules(node, &|rule| !drop(rule));
    match node {
        Value::Object(map) => map
            .values_mut()
            .for_each(|child| drop_rules_everywhere(child, drop)),
        Value::Array(items) => items
            .iter_mut()
            .for_each(|child| drop_rules_everywhere(child, drop)),
        _ => {}
    }
}

/// v1alpha1's `cloneSpec.machineSpec` is a map of machine specs that capmox never reads; like
/// the Go provider it checks only `full` there. The template-source rules would also exceed
/// the API server's CEL cost budget on a map of unbounded size, and it refuses such a CRD.
fn relax_clone_spec_rules(schema: &mut Value) {
    for path in [
        "/properties/spec/properties/cloneSpec/properties/machineSpec/additionalProperties",
        "/properties/spec/properties/template/properties/spec/properties/cloneSpec/properties/machineSpec/additionalProperties",
    ] {
        if let Some(rules) = schema
            .pointer_mut(&format!("{path}/x-kubernetes-validations"))
            .and_then(Value::as_array_mut)
        {
            rules.retain(|rule| {
                !rule
                    .get("rule")
                    .and_then(Value::as_str)
                    .is_some_and(|r| r.contains("exists_one"))
            });
        }
    }
}

/// Declares `apiVersion`, `kind` and `metadata` at the root, as controller-gen does.
fn add_type_meta(schema: &mut Value) {
    let Some(properties) = schema.get_mut("properties").and_then(Value::as_object_mut) else {
        return;
    };
    for (name, ty) in [
        ("apiVersion", "string"),
        ("kind", "string"),
        ("metadata", "object"),
    ] {
        properties
            .entry(name)
            .or_insert_with(|| serde_json::json!({ "type": ty }));
    }
}

/// Removes `nullable` markers and writes whole-number bounds as integers (schemars emits floats).
fn tidy_schema(value: &mut Value) {
    match value {
        Value::Object(map) => {
            map.remove("nullable");
            for key in ["minimum", "maximum", "multipleOf"] {
                if let Some(bound) = map.get_mut(key)
                    && let Some(float) = bound.as_f64()
                    && float.fract() == 0.0
                    && float.abs() < 2f64.powi(53)
                {
                    // Exact: a whole number below 2^53 converts to i64 without loss.
                    *bound = Value::from(float as i64);
                }
            }
            map.values_mut().for_each(tidy_schema);
        }
        Value::Array(items) => items.iter_mut().for_each(tidy_schema),
        _ => {}
    }
}
