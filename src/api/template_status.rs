//! `ProxmoxMachineTemplate.status`: what a machine stamped from the template would have, for the
//! Cluster Autoscaler to scale a MachineDeployment up from zero (Cluster API's opt-in
//! "autoscaling from zero" contract: `status.capacity` as a `corev1.ResourceList` and
//! `status.nodeInfo` with `architecture` and `operatingSystem`).

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::common::conditions_schema;

/// `status.capacity` key of the machine's CPUs (`corev1.ResourceCPU`).
pub const CAPACITY_CPU: &str = "cpu";
/// `status.capacity` key of the machine's memory (`corev1.ResourceMemory`).
pub const CAPACITY_MEMORY: &str = "memory";
/// `status.capacity` key of the machine's boot disk (`corev1.ResourceEphemeralStorage`).
pub const CAPACITY_EPHEMERAL_STORAGE: &str = "ephemeral-storage";

/// What the machines a template describes would have, as the autoscaler reads it.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ProxmoxMachineTemplateStatus {
    /// Resources of one machine (`cpu`, `memory`, `ephemeral-storage`), as Kubernetes
    /// quantities; what the spec leaves to the Proxmox template is read from it.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(schema_with = "capacity_schema")]
    pub capacity: BTreeMap<String, Quantity>,
    /// Architecture and operating system of the machines' nodes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_info: Option<TemplateNodeInfo>,
    /// Conditions: `CapacityResolved` (whether everything above is known) and `Ready`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "conditions_schema")]
    pub conditions: Vec<Condition>,
}

/// Architecture and operating system of a node, as the autoscaler labels the node it simulates
/// (`kubernetes.io/arch`, `kubernetes.io/os`).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("minProperties" = 1))]
pub struct TemplateNodeInfo {
    /// CPU architecture of the node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub architecture: Option<NodeArchitecture>,
    /// Operating system of the node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub operating_system: Option<NodeOperatingSystem>,
}

/// CPU architecture, as Kubernetes names it (`GOARCH`).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum NodeArchitecture {
    /// x86-64 (Proxmox `arch: x86_64`, the default).
    Amd64,
    /// 64-bit ARM (Proxmox `arch: aarch64`).
    Arm64,
    /// IBM Z.
    S390x,
    /// 64-bit POWER, little-endian.
    Ppc64le,
}

/// Operating system, as Kubernetes names it (`GOOS`).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum NodeOperatingSystem {
    /// Linux.
    Linux,
    /// Windows.
    Windows,
}

/// A `resource.Quantity` as `corev1.ResourceList` values serialize it.
pub const QUANTITY_PATTERN: &str = r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$";

/// A map of quantities. Its values are strings only (not int-or-string as in a Pod's
/// resources): capmox always writes strings, and the autoscaler reads the map as strings.
fn capacity_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    let schema = serde_json::json!({
        "type": "object",
        "additionalProperties": {"type": "string", "pattern": QUANTITY_PATTERN},
    });
    // A JSON object is always a valid schema.
    schemars::Schema::try_from(schema).unwrap_or_default()
}
