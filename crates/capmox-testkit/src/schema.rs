//! Checks CRD schemas and objects the way the Kubernetes API server does, without one.
//!
//! Three checks, used by the tests and by the in-process API server:
//! - [`structural_violations`]: is a CRD schema structural (the API server refuses it otherwise)?
//! - [`validate_object`]: does an object pass the OpenAPI constraints and CEL rules, after
//!   defaulting, as the API server would decide on create (or update, with the old object)?
//! - [`cel_compile_errors`]: does every CEL rule parse?
//!
//! Unknown fields are reported as violations (kubectl's default strict field validation), so
//! a field the schema lacks is never silently pruned.

use std::collections::BTreeSet;
use std::fmt;

use serde_json::{Map, Value};

/// One reason a schema or object is refused, with where it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    /// JSON path of the offending node, e.g. `.spec.network.networkDevices[0].mtu`.
    pub path: String,
    /// What is wrong, in the API server's words where possible.
    pub message: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

fn violation(path: &str, message: impl Into<String>) -> Violation {
    Violation {
        path: if path.is_empty() {
            ".".into()
        } else {
            path.into()
        },
        message: message.into(),
    }
}

/// Formats the API server accepts on CRD schema nodes.
const SUPPORTED_FORMATS: &[&str] = &[
    "int32",
    "int64",
    "float",
    "double",
    "byte",
    "binary",
    "date",
    "date-time",
    "datetime",
    "duration",
    "password",
    "uri",
    "email",
    "hostname",
    "ipv4",
    "ipv6",
    "cidr",
    "mac",
    "uuid",
    "uuid3",
    "uuid4",
    "uuid5",
    "int-or-string",
];

/// Keywords that make a schema non-structural or that CRDs do not support.
const FORBIDDEN_KEYWORDS: &[&str] = &[
    "$ref",
    "$schema",
    "definitions",
    "$defs",
    "id",
    "patternProperties",
    "dependencies",
    "additionalItems",
    "allOf",
    "anyOf",
    "oneOf",
    "not",
    "const",
];

/// Lists every rule of structural schemas that `schema` (an `openAPIV3Schema`) breaks.
///
/// Stricter than the API server in one way: value validations under `allOf`/`anyOf`/`oneOf`/
/// `not` are legal there but are refused here, since capmox's schemas need none.
pub fn structural_violations(schema: &Value) -> Vec<Violation> {
    let mut out = Vec::new();
    if schema.get("type").and_then(Value::as_str) != Some("object") {
        out.push(violation("", "the root must have type: object"));
    }
    check_structural(schema, "", true, &mut out);
    out
}

fn check_structural(schema: &Value, path: &str, root: bool, out: &mut Vec<Violation>) {
    let Some(node) = schema.as_object() else {
        out.push(violation(path, "schema node must be an object"));
        return;
    };
    for keyword in FORBIDDEN_KEYWORDS {
        if node.contains_key(*keyword) {
            out.push(violation(
                path,
                format!("`{keyword}` is not allowed in a structural schema"),
            ));
        }
    }
    if node.get("uniqueItems") == Some(&Value::Bool(true)) {
        out.push(violation(
            path,
            "uniqueItems: true is not allowed (use x-kubernetes-list-type: set)",
        ));
    }
    let preserve = node.get("x-kubernetes-preserve-unknown-fields") == Some(&Value::Bool(true));
    let int_or_string = node.get("x-kubernetes-int-or-string") == Some(&Value::Bool(true));
    let ty = node.get("type").and_then(Value::as_str);
    match ty {
        None if !preserve && !int_or_string => {
            out.push(violation(path, "type must be set on every node"));
        }
        Some(t) if !["object", "array", "string", "integer", "number", "boolean"].contains(&t) => {
            out.push(violation(path, format!("unsupported type {t:?}")));
        }
        _ => {}
    }
    if let Some(format) = node.get("format").and_then(Value::as_str)
        && !SUPPORTED_FORMATS.contains(&format)
    {
        out.push(violation(
            path,
            format!("format {format:?} is not supported by Kubernetes"),
        ));
    }
    if node.contains_key("properties") && node.contains_key("additionalProperties") {
        out.push(violation(
            path,
            "properties and additionalProperties are mutually exclusive",
        ));
    }
    if let Some(properties) = node.get("properties") {
        match properties.as_object() {
            Some(properties) => {
                for (name, child) in properties {
                    let child_path = format!("{path}.{name}");
                    if root && name == "metadata" {
                        check_root_metadata(child, &child_path, out);
                    } else {
                        check_structural(child, &child_path, false, out);
                    }
                }
            }
            None => out.push(violation(path, "properties must be a map")),
        }
    }
    if let Some(additional) = node.get("additionalProperties")
        && additional.is_object()
    {
        check_structural(additional, &format!("{path}[*]"), false, out);
    }
    if ty == Some("array") {
        match node.get("items") {
            Some(items) if items.is_object() => {
                check_structural(items, &format!("{path}[]"), false, out);
                check_list_type(node, items, path, out);
            }
            Some(_) => out.push(violation(path, "items must be a single schema")),
            None => out.push(violation(path, "arrays must define items")),
        }
    }
    if let Some(rules) = node.get("x-kubernetes-validations") {
        match rules.as_array() {
            Some(rules) => {
                for rule in rules {
                    if rule
                        .get("rule")
                        .and_then(Value::as_str)
                        .is_none_or(str::is_empty)
                    {
                        out.push(violation(
                            path,
                            "every x-kubernetes-validations entry needs a rule",
                        ));
                    }
                }
            }
            None => out.push(violation(path, "x-kubernetes-validations must be a list")),
        }
    }
}

fn check_root_metadata(schema: &Value, path: &str, out: &mut Vec<Violation>) {
    let allowed: BTreeSet<&str> = ["type", "description"].into();
    match schema.as_object() {
        Some(node) => {
            if node.get("type").and_then(Value::as_str) != Some("object") {
                out.push(violation(path, "metadata must have type: object"));
            }
            for key in node.keys() {
                if !allowed.contains(key.as_str()) {
                    out.push(violation(
                        path,
                        format!("metadata may only set type, found `{key}`"),
                    ));
                }
            }
        }
        None => out.push(violation(path, "schema node must be an object")),
    }
}

fn check_list_type(node: &Map<String, Value>, items: &Value, path: &str, out: &mut Vec<Violation>) {
    let item_type = items.get("type").and_then(Value::as_str);
    match node.get("x-kubernetes-list-type").and_then(Value::as_str) {
        Some("set") if item_type == Some("object") || item_type == Some("array") => {
            out.push(violation(
                path,
                "x-kubernetes-list-type: set requires scalar items",
            ));
        }
        Some("map") => {
            if item_type != Some("object") {
                out.push(violation(
                    path,
                    "x-kubernetes-list-type: map requires object items",
                ));
            }
            let keys = node
                .get("x-kubernetes-list-map-keys")
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default();
            if keys.is_empty() {
                out.push(violation(
                    path,
                    "x-kubernetes-list-type: map requires x-kubernetes-list-map-keys",
                ));
            }
            let required: BTreeSet<&str> = items
                .get("required")
                .and_then(Value::as_array)
                .map(|r| r.iter().filter_map(Value::as_str).collect())
                .unwrap_or_default();
            for key in keys.iter().filter_map(Value::as_str) {
                let key_schema = items.get("properties").and_then(|p| p.get(key));
                let Some(key_schema) = key_schema else {
                    out.push(violation(
                        path,
                        format!("list-map key `{key}` is not a property of the items"),
                    ));
                    continue;
                };
                if !required.contains(key) && key_schema.get("default").is_none() {
                    out.push(violation(
                        path,
                        format!("list-map key `{key}` must be required or have a default"),
                    ));
                }
            }
        }
        Some("atomic") | Some("set") | None => {}
        Some(other) => out.push(violation(
            path,
            format!("unknown x-kubernetes-list-type {other:?}"),
        )),
    }
}

/// Lists the CEL rules of `schema` that do not compile, with where they are.
pub fn cel_compile_errors(schema: &Value) -> Vec<Violation> {
    let mut out = Vec::new();
    collect_cel_errors(&kube_cel::compile_schema(schema), "", &mut out);
    out
}

fn collect_cel_errors(compiled: &kube_cel::CompiledSchema, path: &str, out: &mut Vec<Violation>) {
    for error in compiled.compilation_errors() {
        out.push(violation(path, error.to_string()));
    }
    for (name, child) in &compiled.properties {
        collect_cel_errors(child, &format!("{path}.{name}"), out);
    }
    if let Some(items) = &compiled.items {
        collect_cel_errors(items, &format!("{path}[]"), out);
    }
    if let Some(additional) = &compiled.additional_properties {
        collect_cel_errors(additional, &format!("{path}[*]"), out);
    }
}

/// Validates `object` against `schema` as the API server would on create (or update, given
/// `old`): defaults first, then OpenAPI constraints, then CEL rules. Returns the defaulted object.
pub fn validate_object(
    schema: &Value,
    object: &Value,
    old: Option<&Value>,
) -> Result<Value, Vec<Violation>> {
    let defaulted = kube_cel::apply_defaults(schema, object);
    let mut out = Vec::new();
    check_value(schema, &defaulted, "", true, &mut out);
    if out.is_empty() {
        let old_defaulted = old.map(|old| kube_cel::apply_defaults(schema, old));
        if let Err(errors) =
            kube_cel::Validator::new().validate(schema, &defaulted, old_defaulted.as_ref())
        {
            out.extend(
                errors
                    .into_vec()
                    .into_iter()
                    .map(|e| violation(&e.field_path, format!("{} (rule: {})", e.message, e.rule))),
            );
        }
    }
    if out.is_empty() {
        Ok(defaulted)
    } else {
        Err(out)
    }
}

fn check_value(schema: &Value, value: &Value, path: &str, root: bool, out: &mut Vec<Violation>) {
    let Some(node) = schema.as_object() else {
        return;
    };
    if node.get("x-kubernetes-int-or-string") == Some(&Value::Bool(true)) {
        if !(value.is_string() || value.is_i64() || value.is_u64()) {
            out.push(violation(path, "must be an integer or a string"));
        }
        return;
    }
    let ty = node.get("type").and_then(Value::as_str);
    let type_ok = match ty {
        Some("object") => value.is_object(),
        Some("array") => value.is_array(),
        Some("string") => value.is_string(),
        Some("integer") => value.is_i64() || value.is_u64(),
        Some("number") => value.is_number(),
        Some("boolean") => value.is_boolean(),
        _ => true,
    };
    if !type_ok {
        out.push(violation(
            path,
            format!("must be of type {}", ty.unwrap_or("?")),
        ));
        return;
    }
    if let Some(allowed) = node.get("enum").and_then(Value::as_array)
        && !allowed.contains(value)
    {
        out.push(violation(
            path,
            format!(
                "unsupported value {value}: must be one of {}",
                Value::Array(allowed.clone())
            ),
        ));
    }
    match value {
        Value::Object(map) => check_object(node, map, path, root, out),
        Value::Array(items) => check_array(node, items, path, out),
        Value::String(text) => check_string(node, text, path, out),
        Value::Number(number) => check_number(node, number, path, out),
        _ => {}
    }
}

fn check_object(
    node: &Map<String, Value>,
    map: &Map<String, Value>,
    path: &str,
    root: bool,
    out: &mut Vec<Violation>,
) {
    for key in node
        .get("required")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        if let Some(key) = key.as_str()
            && !map.contains_key(key)
        {
            out.push(violation(&format!("{path}.{key}"), "required value"));
        }
    }
    if let Some(min) = node.get("minProperties").and_then(Value::as_u64)
        && (map.len() as u64) < min
    {
        out.push(violation(
            path,
            format!("must have at least {min} properties"),
        ));
    }
    if let Some(max) = node.get("maxProperties").and_then(Value::as_u64)
        && (map.len() as u64) > max
    {
        out.push(violation(
            path,
            format!("must have at most {max} properties"),
        ));
    }
    let properties = node.get("properties").and_then(Value::as_object);
    let additional = node.get("additionalProperties");
    let preserve = node.get("x-kubernetes-preserve-unknown-fields") == Some(&Value::Bool(true));
    for (key, child) in map {
        let child_path = format!("{path}.{key}");
        if root && ["apiVersion", "kind", "metadata"].contains(&key.as_str()) {
            continue;
        }
        if let Some(child_schema) = properties.and_then(|p| p.get(key)) {
            check_value(child_schema, child, &child_path, false, out);
        } else if let Some(additional) = additional.filter(|a| a.is_object()) {
            check_value(additional, child, &child_path, false, out);
        } else if !preserve && additional != Some(&Value::Bool(true)) {
            out.push(violation(&child_path, "field not declared in schema"));
        }
    }
}

fn check_array(node: &Map<String, Value>, items: &[Value], path: &str, out: &mut Vec<Violation>) {
    if let Some(min) = node.get("minItems").and_then(Value::as_u64)
        && (items.len() as u64) < min
    {
        out.push(violation(path, format!("must have at least {min} items")));
    }
    if let Some(max) = node.get("maxItems").and_then(Value::as_u64)
        && (items.len() as u64) > max
    {
        out.push(violation(path, format!("must have at most {max} items")));
    }
    match node.get("x-kubernetes-list-type").and_then(Value::as_str) {
        Some("set") => {
            for (index, item) in items.iter().enumerate() {
                if items[..index].contains(item) {
                    out.push(violation(
                        &format!("{path}[{index}]"),
                        format!("duplicate value: {item}"),
                    ));
                }
            }
        }
        Some("map") => {
            let keys: Vec<&str> = node
                .get("x-kubernetes-list-map-keys")
                .and_then(Value::as_array)
                .map(|k| k.iter().filter_map(Value::as_str).collect())
                .unwrap_or_default();
            let key_of = |item: &Value| -> Vec<Value> {
                keys.iter()
                    .map(|k| item.get(*k).cloned().unwrap_or(Value::Null))
                    .collect()
            };
            for (index, item) in items.iter().enumerate() {
                let key = key_of(item);
                if items[..index].iter().any(|earlier| key_of(earlier) == key) {
                    out.push(violation(
                        &format!("{path}[{index}]"),
                        format!("duplicate entry with key {}", Value::Array(key)),
                    ));
                }
            }
        }
        _ => {}
    }
    if let Some(item_schema) = node.get("items") {
        for (index, item) in items.iter().enumerate() {
            check_value(item_schema, item, &format!("{path}[{index}]"), false, out);
        }
    }
}

fn check_string(node: &Map<String, Value>, text: &str, path: &str, out: &mut Vec<Violation>) {
    let length = text.chars().count() as u64;
    if let Some(min) = node.get("minLength").and_then(Value::as_u64)
        && length < min
    {
        out.push(violation(
            path,
            format!("must be at least {min} characters long"),
        ));
    }
    if let Some(max) = node.get("maxLength").and_then(Value::as_u64)
        && length > max
    {
        out.push(violation(
            path,
            format!("may not be more than {max} characters long"),
        ));
    }
    if let Some(pattern) = node.get("pattern").and_then(Value::as_str) {
        match regex::Regex::new(pattern) {
            Ok(re) if !re.is_match(text) => {
                out.push(violation(
                    path,
                    format!("{text:?} does not match {pattern:?}"),
                ));
            }
            Ok(_) => {}
            Err(error) => out.push(violation(
                path,
                format!("pattern {pattern:?} does not compile: {error}"),
            )),
        }
    }
}

fn check_number(
    node: &Map<String, Value>,
    number: &serde_json::Number,
    path: &str,
    out: &mut Vec<Violation>,
) {
    let Some(x) = number.as_f64() else {
        return;
    };
    let exclusive_min = node.get("exclusiveMinimum") == Some(&Value::Bool(true));
    let exclusive_max = node.get("exclusiveMaximum") == Some(&Value::Bool(true));
    if let Some(min) = node.get("minimum").and_then(Value::as_f64)
        && (x < min || (exclusive_min && x == min))
    {
        out.push(violation(
            path,
            format!("should be greater than or equal to {min}"),
        ));
    }
    if let Some(max) = node.get("maximum").and_then(Value::as_f64)
        && (x > max || (exclusive_max && x == max))
    {
        out.push(violation(
            path,
            format!("should be less than or equal to {max}"),
        ));
    }
    if let Some(step) = node.get("multipleOf").and_then(Value::as_f64)
        && step != 0.0
        && (x / step).fract() != 0.0
    {
        out.push(violation(path, format!("must be a multiple of {step}")));
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn schema() -> Value {
        json!({
            "type": "object",
            "properties": {
                "spec": {
                    "type": "object",
                    "required": ["name"],
                    "properties": {
                        "name": {"type": "string", "pattern": "^net[0-9]+$", "minLength": 4},
                        "size": {"type": "integer", "minimum": 0, "multipleOf": 8},
                        "mode": {"type": "string", "enum": ["a", "b"], "default": "a"},
                        "tags": {"type": "array", "items": {"type": "string"}, "x-kubernetes-list-type": "set"},
                        "range": {
                            "type": "object",
                            "properties": {"start": {"type": "integer"}, "end": {"type": "integer"}},
                            "x-kubernetes-validations": [{"rule": "self.end >= self.start", "message": "end before start"}]
                        }
                    }
                }
            }
        })
    }

    fn messages(object: Value) -> Vec<String> {
        validate_object(&schema(), &object, None)
            .err()
            .unwrap_or_default()
            .into_iter()
            .map(|v| v.to_string())
            .collect()
    }

    #[test]
    fn accepts_a_valid_object_and_applies_defaults() {
        let defaulted = validate_object(
            &schema(),
            &json!({"spec": {"name": "net0", "size": 16}}),
            None,
        );
        assert_eq!(
            defaulted.ok(),
            Some(json!({"spec": {"name": "net0", "size": 16, "mode": "a"}}))
        );
    }

    #[test]
    fn reports_each_openapi_constraint() {
        assert_eq!(
            messages(json!({"spec": {}})),
            [".spec.name: required value"]
        );
        assert_eq!(
            messages(json!({"spec": {"name": "eth0"}})),
            [r#".spec.name: "eth0" does not match "^net[0-9]+$""#]
        );
        assert_eq!(
            messages(json!({"spec": {"name": "net0", "size": 7}})),
            [".spec.size: must be a multiple of 8"]
        );
        assert_eq!(
            messages(json!({"spec": {"name": "net0", "size": -8}})),
            [".spec.size: should be greater than or equal to 0"]
        );
        assert_eq!(
            messages(json!({"spec": {"name": "net0", "mode": "c"}})),
            [r#".spec.mode: unsupported value "c": must be one of ["a","b"]"#]
        );
        assert_eq!(
            messages(json!({"spec": {"name": "net0", "tags": ["x", "x"]}})),
            [r#".spec.tags[1]: duplicate value: "x""#]
        );
        assert_eq!(
            messages(json!({"spec": {"name": "net0", "extra": 1}})),
            [".spec.extra: field not declared in schema"]
        );
        assert_eq!(
            messages(json!({"spec": {"name": 5}})),
            [".spec.name: must be of type string"]
        );
    }

    #[test]
    fn evaluates_cel_rules() {
        let errors = messages(json!({"spec": {"name": "net0", "range": {"start": 5, "end": 4}}}));
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(errors[0].contains("end before start"), "{errors:?}");
        assert!(
            messages(json!({"spec": {"name": "net0", "range": {"start": 4, "end": 4}}})).is_empty()
        );
    }

    #[test]
    fn structural_check_names_each_problem() {
        let bad = json!({
            "type": "object",
            "properties": {
                "a": {"properties": {}},
                "b": {"type": "integer", "format": "uint32"},
                "c": {"type": "object", "properties": {}, "additionalProperties": {"type": "string"}},
                "d": {"type": "array", "items": {"type": "object"}, "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
                "e": {"anyOf": [{"type": "string"}], "type": "string"}
            }
        });
        let found: Vec<String> = structural_violations(&bad)
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(
            found,
            [
                ".a: type must be set on every node",
                r#".b: format "uint32" is not supported by Kubernetes"#,
                ".c: properties and additionalProperties are mutually exclusive",
                ".d: list-map key `name` is not a property of the items",
                ".e: `anyOf` is not allowed in a structural schema",
            ]
        );
        assert!(structural_violations(&schema()).is_empty());
    }

    #[test]
    fn cel_syntax_errors_are_found() {
        let bad = json!({"type": "object", "properties": {"x": {"type": "integer", "x-kubernetes-validations": [{"rule": "self >"}]}}});
        let errors = cel_compile_errors(&bad);
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert_eq!(errors[0].path, ".x");
        assert!(cel_compile_errors(&schema()).is_empty());
    }
}
