//! OpenAPI schemas as table rows, one per field: the API page walks the CRDs with it, the
//! flavors page the ClusterClass variables.

use serde_json::Value;

/// One field of a schema.
pub(super) struct Field {
    /// Dotted path from the schema's root, `[]` for the items of a list.
    pub path: String,
    /// The type, e.g. `string`, `[]object`, `map[string]string`, `int32`.
    pub type_: String,
    /// The default, as JSON.
    pub default: Option<String>,
    /// Checks the API server makes: required, enum, bounds, patterns, CEL messages.
    pub validation: Vec<String>,
    /// The field's description.
    pub description: String,
}

/// The type of `schema` as one word (arrays and maps by their items).
fn type_of(schema: &Value) -> String {
    if schema.get("x-kubernetes-int-or-string") == Some(&Value::Bool(true)) {
        return "int-or-string".to_owned();
    }
    if schema.get("x-kubernetes-preserve-unknown-fields") == Some(&Value::Bool(true))
        && schema.get("properties").is_none()
    {
        return "any".to_owned();
    }
    match schema["type"].as_str() {
        Some("array") => format!("[]{}", type_of(&schema["items"])),
        Some("object") => match schema.get("additionalProperties") {
            Some(values) if values.is_object() => format!("map[string]{}", type_of(values)),
            _ => "object".to_owned(),
        },
        Some(other) => schema["format"]
            .as_str()
            .map_or_else(|| other.to_owned(), str::to_owned),
        None => "any".to_owned(),
    }
}

fn validation(schema: &Value, required: bool) -> Vec<String> {
    let mut checks = Vec::new();
    if required {
        checks.push("required".to_owned());
    }
    if let Some(values) = schema["enum"].as_array() {
        let values: Vec<String> = values.iter().map(|v| super::code(&v.to_string())).collect();
        checks.push(format!("one of {}", values.join(", ")));
    }
    for (key, word) in [
        ("minimum", "≥"),
        ("maximum", "≤"),
        ("minLength", "length ≥"),
        ("maxLength", "length ≤"),
        ("minItems", "items ≥"),
        ("maxItems", "items ≤"),
        ("minProperties", "properties ≥"),
        ("maxProperties", "properties ≤"),
    ] {
        if let Some(bound) = schema.get(key) {
            checks.push(format!("{word} {bound}"));
        }
    }
    if let Some(pattern) = schema["pattern"].as_str() {
        checks.push(format!("pattern {}", super::code(pattern)));
    }
    if let Some(list_type) = schema["x-kubernetes-list-type"].as_str() {
        checks.push(format!("list type {list_type}"));
    }
    for rule in schema["x-kubernetes-validations"]
        .as_array()
        .into_iter()
        .flatten()
    {
        let says = match (rule["message"].as_str(), rule["rule"].as_str()) {
            (Some(message), _) => super::cell(message),
            (None, Some(rule)) => super::code(rule),
            (None, None) => continue,
        };
        checks.push(format!("rule: {says}"));
    }
    checks
}

/// The fields under `schema` (not the root itself), depth first in name order, each path
/// starting with `prefix`.
pub(super) fn fields(schema: &Value, prefix: &str) -> Vec<Field> {
    let mut out = Vec::new();
    walk(schema, prefix, &mut out);
    out
}

fn walk(schema: &Value, prefix: &str, out: &mut Vec<Field>) {
    let required: Vec<&str> = schema["required"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    if let Some(properties) = schema["properties"].as_object() {
        let mut names: Vec<&String> = properties.keys().collect();
        names.sort();
        for name in names {
            let child = &properties[name.as_str()];
            let path = if prefix.is_empty() {
                name.clone()
            } else {
                format!("{prefix}.{name}")
            };
            out.push(Field {
                path: path.clone(),
                type_: type_of(child),
                default: child.get("default").map(Value::to_string),
                validation: validation(child, required.contains(&name.as_str())),
                description: child["description"].as_str().unwrap_or_default().to_owned(),
            });
            walk(child, &path, out);
        }
    }
    match schema["type"].as_str() {
        Some("array") => {
            let items = &schema["items"];
            let item_checks = validation(items, false);
            if !item_checks.is_empty() && items["properties"].is_null() {
                out.push(Field {
                    path: format!("{prefix}[]"),
                    type_: type_of(items),
                    default: None,
                    validation: item_checks,
                    description: items["description"].as_str().unwrap_or_default().to_owned(),
                });
            }
            walk(items, &format!("{prefix}[]"), out);
        }
        Some("object") => {
            if let Some(values) = schema.get("additionalProperties").filter(|v| v.is_object()) {
                walk(values, &format!("{prefix}.<key>"), out);
            }
        }
        _ => {}
    }
}

/// The fields as a Markdown table.
pub(super) fn table(fields: &[Field]) -> String {
    let mut out = String::from(
        "| field | type | default | validation | description |\n|---|---|---|---|---|\n",
    );
    for field in fields {
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} |\n",
            super::code(&field.path),
            super::code(&field.type_),
            field
                .default
                .as_deref()
                .map(super::code)
                .unwrap_or_default(),
            field.validation.join("; "),
            super::cell(&field.description),
        ));
    }
    out
}
