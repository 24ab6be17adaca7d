//! Registered resource kinds: what the server serves, parsed from CRD YAML or built in.

use std::collections::BTreeMap;

use serde_json::{Value, json};

/// Errors while registering kinds.
#[derive(Debug, thiserror::Error)]
pub enum KindError {
    /// The YAML did not parse.
    #[error("invalid CRD YAML: {0}")]
    Yaml(#[from] serde_norway::Error),
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

/// How a CRD's objects are converted between its versions (`spec.conversion.strategy`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum ConversionStrategy {
    /// `None` (or no `spec.conversion`): only `apiVersion` changes.
    #[default]
    None,
    /// `Webhook`: the server posts an `apiextensions.k8s.io/v1` `ConversionReview` to it.
    Webhook(WebhookClientConfig),
}

/// `spec.conversion.webhook.clientConfig` of a CRD.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WebhookClientConfig {
    /// `url`: an `https://` URL.
    pub url: Option<String>,
    /// `service`: resolved through [`crate::ApiServer::route_service`].
    pub service: Option<ServiceReference>,
    /// `caBundle`, base64-decoded (PEM certificates); empty: the platform's trusted roots.
    pub ca_bundle: Vec<u8>,
}

/// `clientConfig.service` of a conversion webhook.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceReference {
    /// Service namespace.
    pub namespace: String,
    /// Service name.
    pub name: String,
    /// URL path (`/` when unset).
    pub path: Option<String>,
    /// Service port (443 when unset).
    pub port: u16,
}

/// Everything the server needs to know about one kind to serve it.
#[derive(Debug, Clone)]
pub struct KindInfo {
    /// API group; empty for core.
    pub group: String,
    /// Served versions; the storage version first when it is served.
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
    /// The storage version (`storage: true`); empty: the first served version.
    pub storage: String,
    /// `additionalPrinterColumns` per served version, where they are given per version.
    pub version_printer_columns: BTreeMap<String, Vec<Value>>,
    /// Whether `/status` is a subresource, per served version (CRDs declare subresources per
    /// version); a version missing here follows [`KindInfo::status_subresource`].
    pub version_status: BTreeMap<String, bool>,
    /// How objects are converted between versions (`spec.conversion`).
    pub conversion: ConversionStrategy,
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

    /// The storage version: the one marked `storage: true` (else the first served one).
    pub fn storage_version(&self) -> &str {
        if !self.storage.is_empty() {
            return &self.storage;
        }
        self.versions.first().map(String::as_str).unwrap_or("v1")
    }

    /// The OpenAPI schema of the storage version, if any.
    pub fn schema(&self) -> Option<&Value> {
        self.schemas.get(self.storage_version())
    }

    /// The OpenAPI schema of one version, if any.
    pub fn schema_for(&self, version: &str) -> Option<&Value> {
        self.schemas.get(version)
    }

    /// The schema of the version an object's `apiVersion` names (the storage version's when
    /// it names none of this kind's).
    pub fn schema_of(&self, obj: &Value) -> Option<&Value> {
        let version = obj["apiVersion"]
            .as_str()
            .map(|av| av.rsplit('/').next().unwrap_or(av))
            .unwrap_or("");
        self.schemas.get(version).or_else(|| self.schema())
    }

    /// Whether serving `version` needs objects converted from the storage version.
    pub fn needs_conversion(&self, version: &str) -> bool {
        self.custom && version != self.storage_version()
    }

    /// This kind as served in `version`: its `/status` subresource and printer columns are
    /// that version's (the same `Arc` when they do not differ from the storage version's).
    pub fn for_version(self: &std::sync::Arc<Self>, version: &str) -> std::sync::Arc<KindInfo> {
        let status = self
            .version_status
            .get(version)
            .copied()
            .unwrap_or(self.status_subresource);
        let columns = self.version_printer_columns.get(version);
        if status == self.status_subresource && columns.is_none_or(|c| *c == self.printer_columns) {
            return self.clone();
        }
        let mut k = (**self).clone();
        k.status_subresource = status;
        if let Some(c) = columns {
            k.printer_columns = c.clone();
        }
        std::sync::Arc::new(k)
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
            storage: version.into(),
            version_printer_columns: BTreeMap::new(),
            version_status: BTreeMap::new(),
            conversion: ConversionStrategy::None,
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
        for doc in serde_norway::Deserializer::from_str(yaml) {
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
        let mut storage_version = String::new();
        let mut version_status = BTreeMap::new();
        let mut version_printer_columns = BTreeMap::new();
        for v in versions_v {
            let name = text(&v["name"], "spec.versions[].name")?;
            let storage = v["storage"] == true;
            if storage {
                if !storage_version.is_empty() {
                    return Err(KindError::Invalid(format!(
                        "{kind}: spec.versions: Invalid value: must have exactly one version marked as storage version"
                    )));
                }
                storage_version = name.clone();
            }
            if v["served"] == false {
                continue;
            }
            version_status.insert(name.clone(), v["subresources"]["status"].is_object());
            version_printer_columns.insert(
                name.clone(),
                v["additionalPrinterColumns"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default(),
            );
            if let Some(schema) = v["schema"].get("openAPIV3Schema") {
                schemas.insert(name.clone(), schema.clone());
            }
            if storage {
                versions.insert(0, name);
            } else {
                versions.push(name);
            }
        }
        if versions.is_empty() {
            return Err(KindError::Invalid(format!("{kind}: no served version")));
        }
        if storage_version.is_empty() {
            storage_version = versions[0].clone();
        }
        // The storage version's settings are the kind's; other versions override them.
        let status_subresource = version_status
            .get(&storage_version)
            .copied()
            .unwrap_or_else(|| version_status.values().any(|s| *s));
        let printer_columns = version_printer_columns
            .get(&storage_version)
            .cloned()
            .unwrap_or_default();
        let conversion = parse_conversion(&kind, &spec["conversion"])?;
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
            storage: storage_version,
            version_printer_columns,
            version_status,
            conversion,
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

/// `spec.conversion` of a CRD, checked as the real API server validates it.
fn parse_conversion(kind: &str, conv: &Value) -> Result<ConversionStrategy, KindError> {
    let invalid = |m: String| KindError::Invalid(format!("{kind}: spec.conversion.{m}"));
    match conv["strategy"].as_str() {
        None | Some("None") => Ok(ConversionStrategy::None),
        Some("Webhook") => {
            let webhook = &conv["webhook"];
            let cc = &webhook["clientConfig"];
            if !cc.is_object() {
                return Err(invalid(
                    "webhook.clientConfig: Required value: required when strategy is set to Webhook"
                        .into(),
                ));
            }
            let review_versions: Vec<&str> = webhook["conversionReviewVersions"]
                .as_array()
                .map(|a| a.iter().filter_map(Value::as_str).collect())
                .unwrap_or_default();
            if !review_versions.contains(&"v1") {
                return Err(invalid(format!(
                    "webhook.conversionReviewVersions: Invalid value: {review_versions:?}: the capmox testkit only speaks ConversionReview v1"
                )));
            }
            let url = cc["url"].as_str().map(String::from);
            let service = if cc["service"].is_object() {
                let s = &cc["service"];
                let field = |f: &str| {
                    s[f].as_str().map(String::from).ok_or_else(|| {
                        invalid(format!("webhook.clientConfig.service.{f}: Required value"))
                    })
                };
                Some(ServiceReference {
                    namespace: field("namespace")?,
                    name: field("name")?,
                    path: s["path"].as_str().map(String::from),
                    port: match &s["port"] {
                        Value::Null => 443,
                        p => p
                            .as_u64()
                            .and_then(|p| u16::try_from(p).ok())
                            .filter(|p| *p > 0)
                            .ok_or_else(|| {
                                invalid(format!(
                                    "webhook.clientConfig.service.port: Invalid value: {p}: port is not valid"
                                ))
                            })?,
                    },
                })
            } else {
                None
            };
            match (&url, &service) {
                (Some(_), Some(_)) | (None, None) => {
                    return Err(invalid(
                        "webhook.clientConfig: Required value: exactly one of url or service is required"
                            .into(),
                    ));
                }
                (Some(u), None) if !u.starts_with("https://") => {
                    return Err(invalid(format!(
                        "webhook.clientConfig.url: Invalid value: {u:?}: 'https' is the only allowed URL scheme"
                    )));
                }
                _ => {}
            }
            let ca_bundle = match &cc["caBundle"] {
                Value::Null => Vec::new(),
                b => {
                    serde_json::from_value::<k8s_openapi::ByteString>(b.clone())
                        .map_err(|e| {
                            invalid(format!(
                                "webhook.clientConfig.caBundle: Invalid value: not base64: {e}"
                            ))
                        })?
                        .0
                }
            };
            Ok(ConversionStrategy::Webhook(WebhookClientConfig {
                url,
                service,
                ca_bundle,
            }))
        }
        Some(other) => Err(invalid(format!(
            "strategy: Unsupported value: {other:?}: supported values: \"None\", \"Webhook\""
        ))),
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
    fn storage_version_is_the_one_marked_storage_and_settings_are_per_version() {
        let yaml = r#"
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata: {name: gadgets.example.com}
spec:
  group: example.com
  names: {kind: Gadget, plural: gadgets}
  scope: Namespaced
  conversion:
    strategy: Webhook
    webhook:
      conversionReviewVersions: [v1, v1beta1]
      clientConfig:
        service: {namespace: sys, name: hook, path: /convert}
        caBundle: aGVsbG8=
  versions:
  - name: v1alpha1
    served: true
    storage: false
    additionalPrinterColumns: [{name: Old, type: string, jsonPath: .spec.old}]
    schema: {openAPIV3Schema: {type: object, properties: {spec: {type: object, properties: {old: {type: string}}}}}}
  - name: v1alpha2
    served: true
    storage: true
    subresources: {status: {}}
    schema: {openAPIV3Schema: {type: object, properties: {spec: {type: object, properties: {new: {type: string}}}}}}
  - name: v1alpha0
    served: false
    storage: false
"#;
        let k = std::sync::Arc::new(KindInfo::from_crd_yaml(yaml).unwrap().remove(0));
        assert_eq!(k.storage_version(), "v1alpha2");
        assert_eq!(k.versions, vec!["v1alpha2", "v1alpha1"]);
        assert!(k.status_subresource && k.printer_columns.is_empty());
        assert!(k.needs_conversion("v1alpha1") && !k.needs_conversion("v1alpha2"));
        let old = k.for_version("v1alpha1");
        assert!(!old.status_subresource);
        assert_eq!(old.printer_columns.len(), 1);
        assert!(std::sync::Arc::ptr_eq(&k, &k.for_version("v1alpha2")));
        let obj = json!({"apiVersion": "example.com/v1alpha1"});
        assert!(k.schema_of(&obj).unwrap()["properties"]["spec"]["properties"]["old"].is_object());
        assert_eq!(
            k.conversion,
            ConversionStrategy::Webhook(WebhookClientConfig {
                url: None,
                service: Some(ServiceReference {
                    namespace: "sys".into(),
                    name: "hook".into(),
                    path: Some("/convert".into()),
                    port: 443,
                }),
                ca_bundle: b"hello".to_vec(),
            })
        );
    }

    #[test]
    fn invalid_conversion_settings_are_refused() {
        let crd = |conversion: &str| {
            format!(
                "apiVersion: apiextensions.k8s.io/v1\nkind: CustomResourceDefinition\nspec:\n  group: g.io\n  names: {{kind: K, plural: ks}}\n  conversion: {conversion}\n  versions: [{{name: v1, served: true, storage: true}}]\n"
            )
        };
        for bad in [
            "{strategy: Webhook}",
            "{strategy: Webhook, webhook: {conversionReviewVersions: [v1], clientConfig: {url: 'http://x/convert'}}}",
            "{strategy: Webhook, webhook: {conversionReviewVersions: [v1beta1], clientConfig: {url: 'https://x/convert'}}}",
            "{strategy: Webhook, webhook: {conversionReviewVersions: [v1], clientConfig: {}}}",
            "{strategy: Magic}",
        ] {
            let err = KindInfo::from_crd_yaml(&crd(bad)).unwrap_err();
            assert!(matches!(err, KindError::Invalid(_)), "{bad}: {err}");
        }
        let ok = KindInfo::from_crd_yaml(&crd(
            "{strategy: Webhook, webhook: {conversionReviewVersions: [v1], clientConfig: {url: 'https://x/convert'}}}",
        ))
        .unwrap();
        assert!(matches!(ok[0].conversion, ConversionStrategy::Webhook(_)));
    }

    #[test]
    fn rejects_non_crd_documents() {
        let err = KindInfo::from_crd_yaml("kind: ConfigMap\n").unwrap_err();
        assert!(matches!(err, KindError::Invalid(_)));
    }
}
