//! The deprecated `infrastructure.cluster.x-k8s.io/v1alpha1` API, as the Go provider served it.
//!
//! capmox still serves it so manifests, ClusterClasses and GitOps repositories written for it
//! keep applying; objects are stored as `v1alpha2` and converted by the conversion webhook
//! ([`crate::api::conversion`]). Controllers never read these types.

mod cluster;
mod machine;

pub use cluster::*;
pub use machine::*;

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The version these types are served as.
pub const VERSION: &str = "v1alpha1";

/// A Cluster API v1beta1 condition, the shape v1alpha1 statuses carry (with a severity, and
/// without `observedGeneration`).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Condition {
    /// Type of the condition in CamelCase.
    #[schemars(length(min = 1, max = 256))]
    #[serde(rename = "type")]
    pub type_: String,
    /// `True`, `False` or `Unknown`.
    pub status: String,
    /// How bad a `False` condition is: `Error`, `Warning` or `Info`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 32))]
    pub severity: Option<String>,
    /// When the condition last changed status.
    pub last_transition_time: Time,
    /// Machine-readable reason in CamelCase.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 256))]
    pub reason: Option<String>,
    /// Human-readable details.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 10240))]
    pub message: Option<String>,
}

/// Labels and annotations for objects made from a template (may be empty in v1alpha1).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ObjectMeta {
    /// Labels for the created object.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// Annotations for the created object.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}

/// Host and port of the workload cluster's API, as Cluster API v1beta1 wrote them.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ApiEndpoint {
    /// DNS name or IP address of the API endpoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 512))]
    pub host: Option<String>,
    /// TCP port of the API endpoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<i32>,
}
