//! Label and field selectors as accepted in `labelSelector` / `fieldSelector` query parameters.

use serde_json::Value;

use super::error::ApiError;

/// One requirement of a label selector.
#[derive(Debug, Clone, PartialEq)]
enum LabelReq {
    Eq(String, String),
    NotEq(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    NotExists(String),
}

/// A parsed label selector (all requirements must hold).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LabelSelector(Vec<LabelReq>);

/// Split on commas that are not inside parentheses.
fn split_top_level(s: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let (mut depth, mut start) = (0i32, 0usize);
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                out.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&s[start..]);
    out.into_iter()
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .collect()
}

fn parse_set(rest: &str, whole: &str) -> Result<Vec<String>, ApiError> {
    let inner = rest
        .trim()
        .strip_prefix('(')
        .and_then(|r| r.strip_suffix(')'))
        .ok_or_else(|| ApiError::BadRequest(format!("unable to parse requirement: {whole}")))?;
    Ok(inner
        .split(',')
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
        .collect())
}

impl LabelSelector {
    /// Parse the Kubernetes label selector syntax (`a=b,c!=d,e in (f,g),h,!i`).
    pub fn parse(s: &str) -> Result<Self, ApiError> {
        let mut reqs = Vec::new();
        for part in split_top_level(s) {
            let req = if let Some(key) = part.strip_prefix('!') {
                LabelReq::NotExists(key.trim().to_string())
            } else if let Some((k, v)) = part.split_once("!=") {
                LabelReq::NotEq(k.trim().into(), v.trim().into())
            } else if let Some((k, v)) = part.split_once("==") {
                LabelReq::Eq(k.trim().into(), v.trim().into())
            } else if let Some((k, v)) = part.split_once('=') {
                LabelReq::Eq(k.trim().into(), v.trim().into())
            } else if let Some((k, rest)) = part.split_once(" notin ") {
                LabelReq::NotIn(k.trim().into(), parse_set(rest, part)?)
            } else if let Some((k, rest)) = part.split_once(" in ") {
                LabelReq::In(k.trim().into(), parse_set(rest, part)?)
            } else if part.contains(['(', ')', ' ']) {
                return Err(ApiError::BadRequest(format!(
                    "unable to parse requirement: {part}"
                )));
            } else {
                LabelReq::Exists(part.to_string())
            };
            reqs.push(req);
        }
        Ok(LabelSelector(reqs))
    }

    /// Whether an object's `metadata.labels` satisfy every requirement.
    pub fn matches(&self, obj: &Value) -> bool {
        let labels = &obj["metadata"]["labels"];
        let get = |k: &str| labels.get(k).and_then(Value::as_str);
        self.0.iter().all(|r| match r {
            LabelReq::Eq(k, v) => get(k) == Some(v.as_str()),
            LabelReq::NotEq(k, v) => get(k) != Some(v.as_str()),
            LabelReq::In(k, vs) => get(k).is_some_and(|l| vs.iter().any(|v| v == l)),
            LabelReq::NotIn(k, vs) => get(k).is_none_or(|l| vs.iter().all(|v| v != l)),
            LabelReq::Exists(k) => get(k).is_some(),
            LabelReq::NotExists(k) => get(k).is_none(),
        })
    }
}

/// A parsed field selector: `metadata.name` and `metadata.namespace` for every kind (as for
/// custom resources on a real server), any dotted path when parsed with
/// [`FieldSelector::parse_any_field`] (built-ins such as Events' `involvedObject.name`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FieldSelector(Vec<(String, bool, String)>);

impl FieldSelector {
    /// Parse `metadata.name=x,metadata.namespace!=y`.
    pub fn parse(s: &str) -> Result<Self, ApiError> {
        Self::parse_with(s, false)
    }

    /// Parse a selector over any dotted field path (`involvedObject.uid=...`).
    pub fn parse_any_field(s: &str) -> Result<Self, ApiError> {
        Self::parse_with(s, true)
    }

    fn parse_with(s: &str, any_field: bool) -> Result<Self, ApiError> {
        let mut reqs = Vec::new();
        for part in split_top_level(s) {
            let (field, eq, value) = if let Some((k, v)) = part.split_once("!=") {
                (k, false, v)
            } else if let Some((k, v)) = part.split_once("==") {
                (k, true, v)
            } else if let Some((k, v)) = part.split_once('=') {
                (k, true, v)
            } else {
                return Err(ApiError::BadRequest(format!(
                    "invalid selector: '{part}'; can't understand '{part}'"
                )));
            };
            let field = field.trim();
            if !any_field && field != "metadata.name" && field != "metadata.namespace" {
                return Err(ApiError::BadRequest(format!(
                    "field label not supported: {field}"
                )));
            }
            reqs.push((field.to_string(), eq, value.trim().to_string()));
        }
        Ok(FieldSelector(reqs))
    }

    /// Whether the object satisfies every requirement.
    pub fn matches(&self, obj: &Value) -> bool {
        self.0.iter().all(|(field, eq, value)| {
            let actual = field
                .split('.')
                .try_fold(obj, |cur, seg| cur.get(seg))
                .map(|v| match v {
                    Value::String(s) => s.clone(),
                    Value::Null => String::new(),
                    other => other.to_string(),
                })
                .unwrap_or_default();
            (actual == *value) == *eq
        })
    }
}

/// Label and field selector together.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Selectors {
    /// Label selector.
    pub labels: LabelSelector,
    /// Field selector.
    pub fields: FieldSelector,
}

impl Selectors {
    /// Whether an object matches both selectors.
    pub fn matches(&self, obj: &Value) -> bool {
        self.labels.matches(obj) && self.fields.matches(obj)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj(labels: Value) -> Value {
        json!({"metadata": {"name": "a", "namespace": "ns1", "labels": labels}})
    }

    #[test]
    fn label_selector_operators() {
        let o = obj(json!({"app": "web", "tier": "fe"}));
        let cases = [
            ("app=web", true),
            ("app==web", true),
            ("app!=web", false),
            ("app in (web, db)", true),
            ("app notin (web)", false),
            ("app", true),
            ("!app", false),
            ("!missing", true),
            ("app=web,tier=be", false),
            ("app in (web,db),tier", true),
            ("missing!=x", true),
            ("missing notin (x)", true),
            ("", true),
        ];
        for (sel, want) in cases {
            assert_eq!(
                LabelSelector::parse(sel).unwrap().matches(&o),
                want,
                "{sel}"
            );
        }
    }

    #[test]
    fn field_selector_name_and_namespace_only() {
        let o = obj(json!({}));
        assert!(FieldSelector::parse("metadata.name=a").unwrap().matches(&o));
        assert!(
            !FieldSelector::parse("metadata.namespace!=ns1")
                .unwrap()
                .matches(&o)
        );
        assert!(matches!(
            FieldSelector::parse("spec.x=1"),
            Err(ApiError::BadRequest(_))
        ));
        let ev = json!({"metadata": {"name": "e"}, "involvedObject": {"kind": "ProxmoxMachine", "name": "m1"}, "count": 2});
        let sel = FieldSelector::parse_any_field(
            "involvedObject.name=m1,involvedObject.kind=ProxmoxMachine",
        )
        .unwrap();
        assert!(sel.matches(&ev));
        assert!(
            FieldSelector::parse_any_field("count=2")
                .unwrap()
                .matches(&ev)
        );
        assert!(
            FieldSelector::parse_any_field("involvedObject.uid=")
                .unwrap()
                .matches(&ev),
            "missing is empty"
        );
        assert!(
            !FieldSelector::parse_any_field("involvedObject.name!=m1")
                .unwrap()
                .matches(&ev)
        );
    }
}
