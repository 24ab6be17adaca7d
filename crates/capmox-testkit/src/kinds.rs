//! Registered resource kinds: what the server serves, parsed from CRD YAML or built in.

use std::collections::BTreeMap;

use serde_json::{Value, json};

/// Errors while registering kinds.
#[derive(Debug, thiserror::Error)]
pub enum KindError {
    /// The YAML did not parse.
    #[error("invalid CRD YAML: {0}")]
    Yaml(#[from] serde_yaml::Error),
    /// The document is not a CustomResourceDefinition or lacks a required field.
    #[error("invalid CRD document: {0}")]
    Invalid(String),
    /// Reading a CRD file or folder failed.
    #[error("cannot read {path}: {source}")]
    Io {
        /// File or folder path.
        path: String,
        /// Underlying error.
        source: std::io::Error,
    },
}

/// Identifies a resource type independent of version (`plural` + `group`), like `schema.GroupResource`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GroupResource {
    /// API group; empty for the core group.
    pub group: String,
    /// Plural lower-case resource name.
    pub resource: String,
}

impl GroupResource {
    /// `plural.group` as the API server spells it in messages (just `plural` for core).
    pub fn qualified(&self) -> String {
        if self.group.is_empty() {
            self.resource.clone()
        } else {
            format!("{}.{}", self.resource, self.group)
        }
    }
}

/// Everything the server needs to know about one kind to serve it.
#[derive(Debug, Clone)]
pub struct KindInfo {
    /// API group; empty for core.
    pub group: String,
    /// Served versions; the first one is the storage version.
    pub versions: Vec<String>,
    /// `Kind`.
    pub kind: String,
    /// `KindList`.
    pub list_kind: String,
    /// Plural resource name used in paths.
    pub plural: String,
    /// Singular name (for kubectl).
    pub singular: String,
    /// Short names (for kubectl).
    pub short_names: Vec<String>,
    /// Categories (for kubectl).
    pub categories: Vec<String>,
    /// Namespaced or cluster-scoped.
    pub namespaced: bool,
    /// Whether `/status` is a separate subresource.
    pub status_subresource: bool,
    /// CRD semantics: generation tracking, resourceVersion required on update, no strategic merge.
    pub custom: bool,
    /// OpenAPI v3 schema per version (CRDs only).
    pub schemas: BTreeMap<String, Value>,
    /// `additionalPrinterColumns` of the storage version (for kubectl tables).
    pub printer_columns: Vec<Value>,
}

impl KindInfo {
    /// The version-independent resource key.
    pub fn group_resource(&self) -> GroupResource {
        GroupResource {
            group: self.group.clone(),
            resource: self.plural.clone(),
        }
    }

    /// `apiVersion` string for a version of this kind.
    pub fn api_version(&self, version: &str) -> String {
        if self.group.is_empty() {
            version.to_string()
        } else {
            format!("{}/{}", self.group, version)
        }
    }

    /// Storage version (the first served version).
    pub fn storage_version(&self) -> &str {
        self.versions.first().map(String::as_str).unwrap_or("v1")
    }

    /// The OpenAPI schema of the storage version, if any.
    pub fn schema(&self) -> Option<&Value> {
        self.schemas.get(self.storage_version())
    }

    /// Whether this kind answers to `name` (plural, singular, kind, short name, optionally `.group`).
    pub fn matches_name(&self, name: &str) -> bool {
        let (base, group) = match name.split_once('.') {
            Some((b, g)) => (b, Some(g)),
            None => (name, None),
        };
        if let Some(g) = group
            && g != self.group
        {
            return false;
        }
        base == self.plural
            || base == self.singular
            || base.eq_ignore_ascii_case(&self.kind)
            || self.short_names.iter().any(|s| s == base)
    }

    /// A kind without a schema, registered by hand (built-ins, or CRDs a test does not need validated).
    pub fn builtin(group: &str, version: &str, kind: &str, plural: &str, namespaced: bool) -> Self {
        KindInfo {
            group: group.into(),
            versions: vec![version.into()],
            kind: kind.into(),
            list_kind: format!("{kind}List"),
            plural: plural.into(),
            singular: kind.to_ascii_lowercase(),
            short_names: Vec::new(),
            categories: Vec::new(),
            namespaced,
            status_subresource: false,
            custom: false,
            schemas: BTreeMap::new(),
            printer_columns: Vec::new(),
        }
    }

    /// The built-in kinds capmox uses: Secret, ConfigMap, Event (core and events.k8s.io),
    /// Namespace, Lease, ServiceAccount, and CustomResourceDefinition (creating one registers
    /// its kind).
    pub fn builtins() -> Vec<KindInfo> {
        let mut ns = KindInfo::builtin("", "v1", "Namespace", "namespaces", false);
        ns.status_subresource = true;
        ns.short_names = vec!["ns".into()];
        let mut cm = KindInfo::builtin("", "v1", "ConfigMap", "configmaps", true);
        cm.short_names = vec!["cm".into()];
        let mut ev = KindInfo::builtin("", "v1", "Event", "events", true);
        ev.short_names = vec!["ev".into()];
        let mut ev2 = KindInfo::builtin("events.k8s.io", "v1", "Event", "events", true);
        ev2.short_names = vec!["ev".into()];
        let mut crd = KindInfo::builtin(
            "apiextensions.k8s.io",
            "v1",
            "CustomResourceDefinition",
            "customresourcedefinitions",
            false,
        );
        crd.status_subresource = true;
        crd.short_names = vec!["crd".into(), "crds".into()];
        let mut sa = KindInfo::builtin("", "v1", "ServiceAccount", "serviceaccounts", true);
        sa.short_names = vec!["sa".into()];
        vec![
            ns,
            KindInfo::builtin("", "v1", "Secret", "secrets", true),
            cm,
            ev,
            sa,
            ev2,
            KindInfo::builtin("coordination.k8s.io", "v1", "Lease", "leases", true),
            crd,
        ]
    }

    /// Parse every CustomResourceDefinition in a (multi-document) YAML string.
    pub fn from_crd_yaml(yaml: &str) -> Result<Vec<KindInfo>, KindError> {
        let mut out = Vec::new();
        for doc in serde_yaml::Deserializer::from_str(yaml) {
            let value = <Value as serde::Deserialize>::deserialize(doc)?;
            if value.is_null() {
                continue;
            }
            out.push(KindInfo::from_crd(&value)?);
        }
        Ok(out)
    }

    /// Parse one CustomResourceDefinition object (apiextensions.k8s.io/v1).
    pub fn from_crd(crd: &Value) -> Result<KindInfo, KindError> {
        if crd["kind"] != "CustomResourceDefinition" {
            return Err(KindError::Invalid(format!(
                "expected kind CustomResourceDefinition, found {}",
                crd["kind"]
            )));
        }
        let spec = &crd["spec"];
        let names = &spec["names"];
        let text = |v: &Value, what: &str| {
            v.as_str()
                .map(str::to_string)
                .ok_or_else(|| KindError::Invalid(format!("missing {what}")))
        };
        let strings = |v: &Value| -> Vec<String> {
            v.as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(|s| s.as_str().map(String::from))
                        .collect()
                })
                .unwrap_or_default()
        };
        let kind = text(&names["kind"], "spec.names.kind")?;
        let plural = text(&names["plural"], "spec.names.plural")?;
        let versions_v = spec["versions"]
            .as_array()
            .ok_or_else(|| KindError::Invalid("missing spec.versions".into()))?;
        let mut versions = Vec::new();
        let mut schemas = BTreeMap::new();
        let mut status_subresource = false;
        let mut printer_columns = Vec::new();
        for v in versions_v {
            if v["served"] == false {
                continue;
            }
            let name = text(&v["name"], "spec.versions[].name")?;
            let storage = v["storage"] == true;
            if v["subresources"]["status"].is_object() {
                status_subresource = true;
            }
            if let Some(schema) = v["schema"].get("openAPIV3Schema") {
                schemas.insert(name.clone(), schema.clone());
            }
            if storage {
                printer_columns = v["additionalPrinterColumns"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default();
                versions.insert(0, name);
            } else {
                versions.push(name);
            }
        }
        if versions.is_empty() {
            return Err(KindError::Invalid(format!("{kind}: no served version")));
        }
        Ok(KindInfo {
            group: text(&spec["group"], "spec.group")?,
            versions,
            list_kind: names["listKind"]
                .as_str()
                .map(String::from)
                .unwrap_or_else(|| format!("{kind}List")),
            singular: names["singular"]
                .as_str()
                .map(String::from)
                .unwrap_or_else(|| kind.to_ascii_lowercase()),
            kind,
            plural,
            short_names: strings(&names["shortNames"]),
            categories: strings(&names["categories"]),
            namespaced: spec["scope"] != "Cluster",
            status_subresource,
            custom: true,
            schemas,
            printer_columns,
        })
    }

    /// The `APIResource` discovery entries for this kind (resource and `/status`).
    pub fn api_resources(&self) -> Vec<Value> {
        let mut main = json!({
            "name": self.plural,
            "singularName": self.singular,
            "namespaced": self.namespaced,
            "kind": self.kind,
            "verbs": ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"],
        });
        if !self.short_names.is_empty() {
            main["shortNames"] = json!(self.short_names);
        }
        if !self.categories.is_empty() {
            main["categories"] = json!(self.categories);
        }
        let mut out = vec![main];
        if self.status_subresource {
            out.push(json!({
                "name": format!("{}/status", self.plural),
                "singularName": "",
                "namespaced": self.namespaced,
                "kind": self.kind,
                "verbs": ["get", "patch", "update"],
            }));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CRD: &str = r#"
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata: {name: widgets.example.com}
spec:
  group: example.com
  names: {kind: Widget, listKind: WidgetList, plural: widgets, singular: widget, shortNames: [wd]}
  scope: Namespaced
  versions:
  - name: v1alpha1
    served: true
    storage: false
    schema: {openAPIV3Schema: {type: object}}
  - name: v1
    served: true
    storage: true
    subresources: {status: {}}
    schema: {openAPIV3Schema: {type: object, properties: {spec: {type: object}}}}
"#;

    #[test]
    fn parses_crd_with_storage_version_first() {
        let kinds = KindInfo::from_crd_yaml(CRD).unwrap();
        assert_eq!(kinds.len(), 1);
        let k = &kinds[0];
        assert_eq!(k.versions, vec!["v1", "v1alpha1"]);
        assert!(k.status_subresource && k.namespaced && k.custom);
        assert!(k.schema().unwrap()["properties"]["spec"].is_object());
        assert!(k.matches_name("wd"));
        assert!(k.matches_name("widgets.example.com"));
        assert!(k.matches_name("Widget"));
        assert!(!k.matches_name("widgets.other.io"));
    }

    #[test]
    fn rejects_non_crd_documents() {
        let err = KindInfo::from_crd_yaml("kind: ConfigMap\n").unwrap_err();
        assert!(matches!(err, KindError::Invalid(_)));
    }
}
