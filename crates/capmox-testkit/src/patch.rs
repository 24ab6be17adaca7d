//! Patch engines: JSON merge patch (RFC 7386), JSON patch (RFC 6902) and a simplified
//! server-side apply with field ownership tracked per manager.

use std::collections::BTreeSet;
use std::sync::LazyLock;

use serde_json::{Map, Value, json};

use super::error::ApiError;

/// Apply an RFC 6902 JSON patch to `doc`, with the API server's leniency that a `test` of
/// `null` against a missing path succeeds (kube's finalizer helper relies on it).
pub fn apply_json_patch(doc: &mut Value, body: &[u8]) -> Result<(), ApiError> {
    let patch: json_patch::Patch = serde_json::from_slice(body)
        .map_err(|e| ApiError::BadRequest(format!("invalid JSON patch: {e}")))?;
    for op in &patch.0 {
        if let json_patch::PatchOperation::Test(t) = op
            && t.value.is_null()
            && doc.pointer(t.path.as_str()).is_none()
        {
            continue;
        }
        json_patch::patch(doc, std::slice::from_ref(op)).map_err(|e| ApiError::Invalid {
            message: format!("the server rejected our request due to an error in our request: {e}"),
        })?;
    }
    Ok(())
}

/// Apply an RFC 7386 JSON merge patch.
pub fn apply_merge_patch(doc: &mut Value, patch: &Value) {
    json_patch::merge(doc, patch);
}

/// One element of a field path, modelled on structured-merge-diff's `f:`/`k:`/`v:` keys.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PathEl {
    /// A map field.
    Field(String),
    /// A list-map item, identified by the JSON of its key fields.
    Key(String),
    /// A set item, identified by its JSON value.
    Value(String),
}

/// A path to a field owned by a manager.
pub type FieldPath = Vec<PathEl>;

/// Render a path the way conflict messages do (`.spec.x[type="Ready"].status`).
pub fn path_string(p: &FieldPath) -> String {
    let mut s = String::new();
    for el in p {
        match el {
            PathEl::Field(f) => {
                s.push('.');
                s.push_str(f);
            }
            PathEl::Key(k) | PathEl::Value(k) => {
                s.push('[');
                s.push_str(k);
                s.push(']');
            }
        }
    }
    s
}

/// Field ownership of one manager for one operation type and subresource.
#[derive(Debug, Clone, PartialEq)]
pub struct ManagedEntry {
    /// Field manager name.
    pub manager: String,
    /// `Apply` (true) or `Update` (false).
    pub apply: bool,
    /// `""` or `"status"`.
    pub subresource: String,
    /// Owned leaf and list-item paths.
    pub fields: BTreeSet<FieldPath>,
    /// `apiVersion` of the last write that changed this entry (empty until stamped).
    pub api_version: String,
    /// RFC 3339 time of the last write that changed this entry (empty until stamped).
    pub time: String,
}

impl ManagedEntry {
    /// The `metadata.managedFields` entry (fields rendered as a FieldsV1-like tree).
    pub fn to_json(&self) -> Value {
        let mut tree = Map::new();
        for path in &self.fields {
            let mut node = &mut tree;
            for el in path {
                let key = match el {
                    PathEl::Field(f) => format!("f:{f}"),
                    PathEl::Key(k) => format!("k:{k}"),
                    PathEl::Value(v) => format!("v:{v}"),
                };
                let entry = node.entry(key).or_insert_with(|| json!({}));
                if !entry.is_object() {
                    *entry = json!({});
                }
                node = match entry.as_object_mut() {
                    Some(m) => m,
                    None => unreachable!("entry was just made an object"),
                };
            }
        }
        let mut e = json!({
            "manager": self.manager,
            "operation": if self.apply { "Apply" } else { "Update" },
            "fieldsType": "FieldsV1",
            "fieldsV1": tree,
        });
        if !self.subresource.is_empty() {
            e["subresource"] = json!(self.subresource);
        }
        if !self.api_version.is_empty() {
            e["apiVersion"] = json!(self.api_version);
        }
        if !self.time.is_empty() {
            e["time"] = json!(self.time);
        }
        e
    }
}

/// Set `time` and `apiVersion` on the entries this write changed (those that differ from
/// `previous`); unchanged entries keep their stamps.
pub fn stamp(
    managed: &mut [ManagedEntry],
    previous: &[ManagedEntry],
    api_version: &str,
    now: &str,
) {
    for e in managed.iter_mut() {
        let before = previous.iter().find(|p| {
            p.manager == e.manager && p.apply == e.apply && p.subresource == e.subresource
        });
        match before {
            Some(p) if p.fields == e.fields => {
                e.time = p.time.clone();
                e.api_version = p.api_version.clone();
            }
            _ => {
                e.time = now.to_string();
                e.api_version = api_version.to_string();
            }
        }
    }
}

static METADATA_SCHEMA: LazyLock<Value> = LazyLock::new(|| {
    json!({
        "type": "object",
        "properties": {
            "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
            "finalizers": {"type": "array", "items": {"type": "string"}, "x-kubernetes-list-type": "set"},
            "ownerReferences": {
                "type": "array",
                "items": {"type": "object"},
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["uid"],
            },
        }
    })
});

/// Schema of a map field, with the standard ObjectMeta schema at the root's `metadata`.
fn child_schema<'a>(schema: Option<&'a Value>, field: &str, root: bool) -> Option<&'a Value> {
    if root && field == "metadata" {
        return Some(&METADATA_SCHEMA);
    }
    let s = schema?;
    s.get("properties")
        .and_then(|p| p.get(field))
        .or_else(|| s.get("additionalProperties").filter(|a| a.is_object()))
}

enum ListType {
    Atomic,
    Set,
    Map(Vec<String>),
}

fn list_type(schema: Option<&Value>) -> ListType {
    let Some(s) = schema else {
        return ListType::Atomic;
    };
    match s.get("x-kubernetes-list-type").and_then(Value::as_str) {
        Some("set") => ListType::Set,
        Some("map") => ListType::Map(
            s.get("x-kubernetes-list-map-keys")
                .and_then(Value::as_array)
                .map(|a| {
                    a.iter()
                        .filter_map(|k| k.as_str().map(String::from))
                        .collect()
                })
                .unwrap_or_default(),
        ),
        _ => ListType::Atomic,
    }
}

fn item_key(item: &Value, keys: &[String]) -> String {
    let mut m = Map::new();
    for k in keys {
        m.insert(k.clone(), item.get(k).cloned().unwrap_or(Value::Null));
    }
    Value::Object(m).to_string()
}

fn key_matches(item: &Value, key: &str) -> bool {
    match serde_json::from_str::<Value>(key) {
        Ok(Value::Object(k)) => k
            .iter()
            .all(|(f, v)| item.get(f).unwrap_or(&Value::Null) == v),
        _ => false,
    }
}

/// Whether a path is identity/system metadata that is never owned.
fn is_system_path(p: &FieldPath) -> bool {
    match p.as_slice() {
        [PathEl::Field(f), ..] if f == "apiVersion" || f == "kind" => true,
        [PathEl::Field(m), PathEl::Field(f), ..] if m == "metadata" => !matches!(
            f.as_str(),
            "labels" | "annotations" | "finalizers" | "ownerReferences"
        ),
        _ => false,
    }
}

/// Collect the owned paths of an applied configuration (leaves, list-map items, set items).
pub fn collect_paths(value: &Value, schema: Option<&Value>) -> BTreeSet<FieldPath> {
    let mut out = BTreeSet::new();
    collect_into(value, schema, &mut Vec::new(), &mut out);
    out.retain(|p| !is_system_path(p));
    out
}

fn collect_into(
    v: &Value,
    schema: Option<&Value>,
    prefix: &mut FieldPath,
    out: &mut BTreeSet<FieldPath>,
) {
    match v {
        Value::Object(m) if !m.is_empty() => {
            let root = prefix.is_empty();
            for (k, c) in m {
                prefix.push(PathEl::Field(k.clone()));
                collect_into(c, child_schema(schema, k, root), prefix, out);
                prefix.pop();
            }
        }
        Value::Array(items) => match list_type(schema) {
            ListType::Map(keys) => {
                let item_schema = schema.and_then(|s| s.get("items"));
                for item in items {
                    prefix.push(PathEl::Key(item_key(item, &keys)));
                    out.insert(prefix.clone());
                    if let Value::Object(m) = item {
                        for (k, c) in m {
                            prefix.push(PathEl::Field(k.clone()));
                            collect_into(c, child_schema(item_schema, k, false), prefix, out);
                            prefix.pop();
                        }
                    }
                    prefix.pop();
                }
            }
            ListType::Set => {
                for item in items {
                    prefix.push(PathEl::Value(item.to_string()));
                    out.insert(prefix.clone());
                    prefix.pop();
                }
            }
            ListType::Atomic => {
                out.insert(prefix.clone());
            }
        },
        _ => {
            if !prefix.is_empty() {
                out.insert(prefix.clone());
            }
        }
    }
}

/// The value at a path, if present.
pub fn value_at<'a>(v: &'a Value, path: &[PathEl]) -> Option<&'a Value> {
    let mut cur = v;
    for el in path {
        cur = match el {
            PathEl::Field(f) => cur.get(f)?,
            PathEl::Key(k) => cur.as_array()?.iter().find(|i| key_matches(i, k))?,
            PathEl::Value(s) => {
                let want: Value = serde_json::from_str(s).ok()?;
                cur.as_array()?.iter().find(|i| **i == want)?
            }
        };
    }
    Some(cur)
}

fn remove_path(v: &mut Value, path: &[PathEl]) {
    let Some((last, parent_path)) = path.split_last() else {
        return;
    };
    let mut cur = v;
    for el in parent_path {
        let next = match el {
            PathEl::Field(f) => cur.get_mut(f),
            PathEl::Key(k) => cur
                .as_array_mut()
                .and_then(|a| a.iter_mut().find(|i| key_matches(i, k))),
            PathEl::Value(s) => {
                let want: Option<Value> = serde_json::from_str(s).ok();
                cur.as_array_mut()
                    .and_then(|a| a.iter_mut().find(|i| Some(&**i) == want.as_ref()))
            }
        };
        match next {
            Some(n) => cur = n,
            None => return,
        }
    }
    match last {
        PathEl::Field(f) => {
            if let Some(m) = cur.as_object_mut() {
                m.remove(f);
            }
        }
        PathEl::Key(k) => {
            if let Some(a) = cur.as_array_mut() {
                a.retain(|i| !key_matches(i, k));
            }
        }
        PathEl::Value(s) => {
            if let (Some(a), Ok(want)) = (cur.as_array_mut(), serde_json::from_str::<Value>(s)) {
                a.retain(|i| *i != want);
            }
        }
    }
}

/// Merge an applied configuration into the live object: maps recursively, list-maps by key,
/// sets by union, everything else (atomic lists, scalars) replaced. `null` removes a field.
pub fn merge_applied(live: &mut Value, applied: &Value, schema: Option<&Value>, root: bool) {
    match (live, applied) {
        (Value::Object(lm), Value::Object(am)) => {
            for (k, av) in am {
                let cs = child_schema(schema, k, root);
                if av.is_null() {
                    lm.remove(k);
                    continue;
                }
                match lm.get_mut(k) {
                    Some(lv)
                        if (lv.is_object() && av.is_object())
                            || (lv.is_array() && av.is_array()) =>
                    {
                        merge_applied(lv, av, cs, false)
                    }
                    _ => {
                        lm.insert(k.clone(), av.clone());
                    }
                }
            }
        }
        (Value::Array(la), Value::Array(aa)) => match list_type(schema) {
            ListType::Map(keys) => {
                let item_schema = schema.and_then(|s| s.get("items"));
                for ai in aa {
                    let key = item_key(ai, &keys);
                    match la.iter_mut().find(|li| key_matches(li, &key)) {
                        Some(li) => merge_applied(li, ai, item_schema, false),
                        None => la.push(ai.clone()),
                    }
                }
            }
            ListType::Set => {
                for ai in aa {
                    if !la.contains(ai) {
                        la.push(ai.clone());
                    }
                }
            }
            ListType::Atomic => *la = aa.clone(),
        },
        (live, applied) => *live = applied.clone(),
    }
}

/// Server-side apply of `applied` by `manager` onto `live`, updating `managed`.
///
/// Conflicts: a path owned by another manager whose live value differs from the applied one
/// is a 409 unless `force`, which transfers ownership. Paths this manager applied before but
/// no longer applies are removed unless another manager owns them.
pub fn server_side_apply(
    live: &Value,
    applied: &Value,
    schema: Option<&Value>,
    managed: &mut Vec<ManagedEntry>,
    manager: &str,
    subresource: &str,
    force: bool,
) -> Result<Value, ApiError> {
    let new_paths = collect_paths(applied, schema);
    let is_me = |e: &ManagedEntry| e.manager == manager && e.apply && e.subresource == subresource;
    let mut conflicts = Vec::new();
    for e in managed.iter().filter(|e| !is_me(e)) {
        for p in new_paths.intersection(&e.fields) {
            if value_at(live, p) != value_at(applied, p)
                && !matches!(p.last(), Some(PathEl::Key(_)))
            {
                conflicts.push((e.manager.clone(), p.clone()));
            }
        }
    }
    if !conflicts.is_empty() {
        if !force {
            let n = conflicts.len();
            let list: Vec<String> = conflicts
                .iter()
                .map(|(m, p)| format!("conflict with \"{m}\": {}", path_string(p)))
                .collect();
            return Err(ApiError::ApplyConflict {
                message: format!(
                    "Apply failed with {n} conflict{}: {}",
                    if n == 1 { "" } else { "s" },
                    list.join("; ")
                ),
                causes: conflicts
                    .iter()
                    .map(|(m, p)| (format!("conflict with \"{m}\""), path_string(p)))
                    .collect(),
            });
        }
        for e in managed.iter_mut().filter(|e| !is_me(e)) {
            for (_, p) in &conflicts {
                e.fields.remove(p);
            }
        }
    }
    let old_paths = managed
        .iter()
        .find(|e| is_me(e))
        .map(|e| e.fields.clone())
        .unwrap_or_default();
    let mut result = live.clone();
    let mut removed: Vec<&FieldPath> = old_paths.difference(&new_paths).collect();
    // Shallow first: removing a list-map item takes its fields with it (its key fields
    // must still be present to find it).
    removed.sort_by_key(|p| p.len());
    for p in removed {
        let owned_elsewhere = managed
            .iter()
            .filter(|e| !is_me(e))
            .any(|e| e.fields.iter().any(|f| f.starts_with(p)));
        if !owned_elsewhere {
            remove_path(&mut result, p);
        }
    }
    merge_applied(&mut result, applied, schema, true);
    match managed.iter_mut().find(|e| is_me(e)) {
        Some(e) => e.fields = new_paths,
        None => managed.push(ManagedEntry {
            manager: manager.to_string(),
            apply: true,
            subresource: subresource.to_string(),
            fields: new_paths,
            api_version: String::new(),
            time: String::new(),
        }),
    }
    managed.retain(|e| !e.fields.is_empty());
    Ok(result)
}

/// Record a non-apply write: the changed paths move to `(manager, Update, subresource)`.
pub fn record_update(
    old: &Value,
    new: &Value,
    schema: Option<&Value>,
    managed: &mut Vec<ManagedEntry>,
    manager: &str,
    subresource: &str,
) {
    let old_paths = collect_paths(old, schema);
    let new_paths = collect_paths(new, schema);
    let changed: BTreeSet<FieldPath> = new_paths
        .iter()
        .filter(|p| value_at(old, p) != value_at(new, p))
        .cloned()
        .collect();
    let gone: BTreeSet<FieldPath> = old_paths.difference(&new_paths).cloned().collect();
    if changed.is_empty() && gone.is_empty() {
        return;
    }
    for e in managed.iter_mut() {
        e.fields
            .retain(|p| !changed.contains(p) && !gone.contains(p));
    }
    let is_me = |e: &ManagedEntry| e.manager == manager && !e.apply && e.subresource == subresource;
    match managed.iter_mut().find(|e| is_me(e)) {
        Some(e) => e.fields.extend(changed),
        None => managed.push(ManagedEntry {
            manager: manager.to_string(),
            apply: false,
            subresource: subresource.to_string(),
            fields: changed,
            api_version: String::new(),
            time: String::new(),
        }),
    }
    managed.retain(|e| !e.fields.is_empty());
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cond_schema() -> Value {
        json!({"type": "object", "properties": {
            "status": {"type": "object", "properties": {
                "conditions": {"type": "array", "x-kubernetes-list-type": "map",
                    "x-kubernetes-list-map-keys": ["type"],
                    "items": {"type": "object"}},
                "tags": {"type": "array", "items": {"type": "string"}}
            }}
        }})
    }

    #[test]
    fn json_patch_test_null_on_missing_path_succeeds() {
        let mut doc = json!({"metadata": {"name": "a"}});
        let body = br#"[{"op":"test","path":"/metadata/finalizers","value":null},
                        {"op":"add","path":"/metadata/finalizers","value":["f"]}]"#;
        apply_json_patch(&mut doc, body).unwrap();
        assert_eq!(doc["metadata"]["finalizers"], json!(["f"]));
        let failing = br#"[{"op":"test","path":"/metadata/finalizers","value":null}]"#;
        assert!(matches!(
            apply_json_patch(&mut doc, failing),
            Err(ApiError::Invalid { .. })
        ));
    }

    #[test]
    fn apply_merges_list_maps_by_key_and_replaces_atomic_lists() {
        let schema = cond_schema();
        let live = json!({"status": {
            "conditions": [{"type": "A", "status": "True"}, {"type": "B", "status": "False"}],
            "tags": ["x", "y"]}});
        let applied =
            json!({"status": {"conditions": [{"type": "B", "status": "True"}], "tags": ["z"]}});
        let mut managed = Vec::new();
        let out = server_side_apply(
            &live,
            &applied,
            Some(&schema),
            &mut managed,
            "m",
            "status",
            false,
        )
        .unwrap();
        assert_eq!(
            out["status"]["conditions"],
            json!([{"type": "A", "status": "True"}, {"type": "B", "status": "True"}])
        );
        assert_eq!(out["status"]["tags"], json!(["z"]));
    }

    #[test]
    fn apply_conflicts_with_other_manager_unless_forced_and_removes_dropped_fields() {
        let mut managed = Vec::new();
        let live = json!({});
        let a = json!({"spec": {"x": 1, "y": 2}});
        let live = server_side_apply(&live, &a, None, &mut managed, "one", "", false).unwrap();
        let b = json!({"spec": {"x": 5}});
        let err = server_side_apply(&live, &b, None, &mut managed, "two", "", false).unwrap_err();
        assert!(
            err.to_string().contains("conflict with \"one\": .spec.x"),
            "{err}"
        );
        let same = json!({"spec": {"x": 1}});
        server_side_apply(&live, &same, None, &mut managed.clone(), "two", "", false)
            .expect("same value is shared ownership, not a conflict");
        let live = server_side_apply(&live, &b, None, &mut managed, "two", "", true).unwrap();
        assert_eq!(live["spec"]["x"], 5);
        // "one" re-applies without y: y is dropped, x now belongs to "two" and stays.
        let live = server_side_apply(
            &live,
            &json!({"spec": {}}),
            None,
            &mut managed,
            "one",
            "",
            false,
        )
        .unwrap();
        assert_eq!(live, json!({"spec": {"x": 5}}));
    }

    #[test]
    fn update_takes_ownership_from_appliers() {
        let mut managed = Vec::new();
        let live = server_side_apply(
            &json!({}),
            &json!({"spec": {"x": 1}}),
            None,
            &mut managed,
            "a",
            "",
            false,
        )
        .unwrap();
        let updated = json!({"spec": {"x": 2}});
        record_update(&live, &updated, None, &mut managed, "kubectl", "");
        assert_eq!(managed.len(), 1);
        assert_eq!(managed[0].manager, "kubectl");
        let err = server_side_apply(
            &updated,
            &json!({"spec": {"x": 1}}),
            None,
            &mut managed,
            "a",
            "",
            false,
        )
        .unwrap_err();
        assert_eq!(err.code(), 409);
    }

    #[test]
    fn managed_entry_renders_fields_v1() {
        let e = ManagedEntry {
            manager: "m".into(),
            apply: true,
            subresource: "status".into(),
            fields: collect_paths(&json!({"spec": {"a": 1}}), None),
            api_version: String::new(),
            time: String::new(),
        };
        assert_eq!(e.to_json()["fieldsV1"], json!({"f:spec": {"f:a": {}}}));
        assert_eq!(e.to_json()["operation"], "Apply");
        let mut stamped = vec![e.clone()];
        stamp(&mut stamped, &[], "example.com/v1", "2026-01-01T00:00:00Z");
        assert_eq!(stamped[0].to_json()["time"], "2026-01-01T00:00:00Z");
        let mut again = vec![e];
        stamp(
            &mut again,
            &stamped,
            "example.com/v2",
            "2027-01-01T00:00:00Z",
        );
        assert_eq!(
            again[0].api_version, "example.com/v1",
            "unchanged entries keep their stamp"
        );
    }

    #[test]
    fn finalizers_are_a_set_per_manager() {
        let mut managed = Vec::new();
        let cfg = |fins: Value| json!({"metadata": {"name": "x", "finalizers": fins}});
        let live = server_side_apply(
            &json!({}),
            &cfg(json!(["a/x"])),
            None,
            &mut managed,
            "a",
            "",
            false,
        )
        .unwrap();
        let live = server_side_apply(
            &live,
            &cfg(json!(["b/y"])),
            None,
            &mut managed,
            "b",
            "",
            false,
        )
        .unwrap();
        assert_eq!(live["metadata"]["finalizers"], json!(["a/x", "b/y"]));
        // "a" stops applying its finalizer: only that set item goes.
        let live =
            server_side_apply(&live, &cfg(json!([])), None, &mut managed, "a", "", false).unwrap();
        assert_eq!(live["metadata"]["finalizers"], json!(["b/y"]));
    }

    #[test]
    fn nested_list_maps_merge_by_key_at_every_level() {
        let schema = json!({"type": "object", "properties": {"spec": {"type": "object", "properties": {
            "zones": {"type": "array", "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["zone"],
                "items": {"type": "object", "properties": {
                    "nodes": {"type": "array", "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"],
                        "items": {"type": "object"}}}}}}}}});
        let mut managed = Vec::new();
        let a = json!({"spec": {"zones": [{"zone": "z1", "nodes": [{"name": "n1", "w": 1}]}]}});
        let b = json!({"spec": {"zones": [{"zone": "z1", "nodes": [{"name": "n2", "w": 2}]}, {"zone": "z2"}]}});
        let live =
            server_side_apply(&json!({}), &a, Some(&schema), &mut managed, "a", "", false).unwrap();
        let live =
            server_side_apply(&live, &b, Some(&schema), &mut managed, "b", "", false).unwrap();
        assert_eq!(
            live["spec"]["zones"],
            json!([{"zone": "z1", "nodes": [{"name": "n1", "w": 1}, {"name": "n2", "w": 2}]}, {"zone": "z2"}])
        );
    }

    #[test]
    fn atomic_lists_conflict_as_a_whole() {
        let mut managed = Vec::new();
        let live = server_side_apply(
            &json!({}),
            &json!({"spec": {"l": [1, 2]}}),
            None,
            &mut managed,
            "a",
            "",
            false,
        )
        .unwrap();
        let err = server_side_apply(
            &live,
            &json!({"spec": {"l": [1, 2, 3]}}),
            None,
            &mut managed,
            "b",
            "",
            false,
        )
        .unwrap_err();
        assert!(err.to_string().contains(".spec.l"), "{err}");
    }
}
