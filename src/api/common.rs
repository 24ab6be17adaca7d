//! Types shared by the cluster and machine kinds.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Pattern every zone name must match (the Go provider's `Zone` type): a DNS-label-like name.
pub const ZONE_PATTERN: &str = r"^[a-z0-9A-Z](?:[a-z0-9A-Z-_.]{0,61}[a-z0-9A-Z])?$";

/// Pattern of Proxmox tags as accepted by `tags` and `templateSelector.matchTags`.
pub const TAG_PATTERN: &str = r"^(?i)[a-z0-9_][a-z0-9_\-\+\.]*$";

/// Pattern of a network device name (`net0`, `net1`, ...), as Proxmox names NICs.
pub const NET_NAME_PATTERN: &str = r"^net[0-9]+$";

/// Zone name used when a pool or claim belongs to no zone.
pub const DEFAULT_ZONE: &str = "default";

/// Static address pool of one IP family, turned into an `InClusterIPPool` by the cluster controller.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct IpConfigSpec {
    /// Addresses to hand out: single IPs, `first-last` ranges or CIDRs (in-cluster IPAM syntax).
    #[schemars(extend("x-kubernetes-list-type" = "set"))]
    pub addresses: Vec<String>,
    /// Prefix length of the network the addresses live in.
    #[schemars(range(min = 1, max = 128))]
    pub prefix: i32,
    /// Default gateway for machines that get an address from this pool.
    #[schemars(length(min = 1))]
    pub gateway: String,
    /// Route metric of the default route through `gateway`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0), extend("default" = 100))]
    pub metric: Option<i32>,
}

/// Host and port of the workload cluster's Kubernetes API.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ApiEndpoint {
    /// DNS name or IP address of the API endpoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 512))]
    pub host: Option<String>,
    /// TCP port of the API endpoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 65535))]
    pub port: Option<i32>,
}

/// Reference to a Secret, optionally in another namespace.
#[derive(
    Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, JsonSchema,
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-map-type" = "atomic"))]
pub struct SecretReference {
    /// Name of the Secret.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Namespace of the Secret; the referring object's namespace when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
}

/// Reference to an object in the same namespace, by name.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-map-type" = "atomic"))]
pub struct LocalObjectReference {
    /// Name of the referenced object.
    #[serde(default)]
    #[schemars(extend("default" = ""))]
    pub name: String,
}

/// Typed reference to an IP pool in the same namespace (or a cluster-scoped global pool).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend(
    "x-kubernetes-map-type" = "atomic",
    "x-kubernetes-validations" = [
        {"rule": "self.apiGroup == 'ipam.cluster.x-k8s.io'", "message": "ipPoolRef allows only IPAM apiGroup ipam.cluster.x-k8s.io"},
        {"rule": "self.kind == 'InClusterIPPool' || self.kind == 'GlobalInClusterIPPool'", "message": "ipPoolRef allows either InClusterIPPool or GlobalInClusterIPPool"}
    ]
))]
pub struct TypedLocalObjectReference {
    /// API group of the pool kind (`ipam.cluster.x-k8s.io`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_group: Option<String>,
    /// Kind of the pool: `InClusterIPPool` or `GlobalInClusterIPPool`.
    pub kind: String,
    /// Name of the pool.
    pub name: String,
}

/// Labels and annotations to put on objects created from a template.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("minProperties" = 1))]
pub struct TemplateObjectMeta {
    /// Labels for the created object.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// Annotations for the created object.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}

/// The CAPI v1beta2 `initialization` status block that tells CAPI core the infrastructure is ready.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("minProperties" = 1))]
pub struct Initialization {
    /// True once the infrastructure is fully provisioned; CAPI core then proceeds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provisioned: Option<bool>,
}

impl Initialization {
    /// Whether a status's `initialization` tells CAPI core the infrastructure is provisioned
    /// (absent counts as not provisioned).
    pub fn provisioned(initialization: Option<&Initialization>) -> bool {
        initialization.and_then(|i| i.provisioned) == Some(true)
    }
}

impl crate::api::ProxmoxMachine {
    /// Whether CAPI core sees this machine's infrastructure as provisioned.
    pub fn is_provisioned(&self) -> bool {
        Initialization::provisioned(self.status.as_ref().and_then(|s| s.initialization.as_ref()))
    }
}

impl crate::api::ProxmoxCluster {
    /// Whether CAPI core sees this cluster's infrastructure as provisioned.
    pub fn is_provisioned(&self) -> bool {
        Initialization::provisioned(self.status.as_ref().and_then(|s| s.initialization.as_ref()))
    }
}

/// Schema of a `metav1.Condition` list, with the API server's own constraints on each field:
/// a list-map keyed by `type`, at most 32 entries.
pub(crate) fn conditions_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    let schema = serde_json::json!({
        "type": "array",
        "maxItems": 32,
        "x-kubernetes-list-type": "map",
        "x-kubernetes-list-map-keys": ["type"],
        "items": {
            "type": "object",
            "description": "A condition of the object, as metav1.Condition.",
            "required": ["lastTransitionTime", "message", "reason", "status", "type"],
            "properties": {
                "lastTransitionTime": {"type": "string", "format": "date-time",
                    "description": "When the condition last changed status."},
                "message": {"type": "string", "maxLength": 32768,
                    "description": "Human-readable details."},
                "observedGeneration": {"type": "integer", "format": "int64", "minimum": 0,
                    "description": "Generation the condition was computed from."},
                "reason": {"type": "string", "minLength": 1, "maxLength": 1024,
                    "pattern": "^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$",
                    "description": "Machine-readable reason in CamelCase."},
                "status": {"type": "string", "enum": ["True", "False", "Unknown"],
                    "description": "Status of the condition."},
                "type": {"type": "string", "maxLength": 316,
                    "pattern": "^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$",
                    "description": "Type of the condition in CamelCase."}
            }
        }
    });
    schemars::Schema::try_from(schema).unwrap_or_default()
}
