//! Reboot-first remediation: what a MachineHealthCheck creates through Cluster API's external
//! remediation contract (`spec.remediation.templateRef` names a ProxmoxRemediationTemplate; the
//! MachineHealthCheck stamps a ProxmoxRemediation named after each unhealthy Machine).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::common::{TemplateObjectMeta, conditions_schema};

/// Reboots tried before the Machine is handed back for replacement, unless the spec says.
pub const DEFAULT_RETRY_LIMIT: i32 = 1;
/// Seconds a Node has after a reboot to be healthy again, unless the spec says.
pub const DEFAULT_TIMEOUT_SECONDS: i32 = 300;
/// Seconds a clean reboot may take before the VM is reset, unless the spec says.
pub const DEFAULT_SHUTDOWN_TIMEOUT_SECONDS: i32 = 120;

/// How to repair one unhealthy Machine before it is replaced.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "infrastructure.cluster.x-k8s.io",
    version = "v1alpha2",
    kind = "ProxmoxRemediation",
    doc = "A request to repair an unhealthy Machine's VM by reboot before Cluster API replaces the Machine.",
    namespaced,
    status = "ProxmoxRemediationStatus",
    shortname = "moxrem",
    category = "cluster-api",
    category = "proxmox",
    label("cluster.x-k8s.io/v1beta2", "v1alpha2"),
    printcolumn(
        name = "Phase",
        type_ = "string",
        description = "Where the remediation is",
        json_path = ".status.phase"
    ),
    printcolumn(
        name = "Reboots",
        type_ = "integer",
        description = "Reboots or resets done",
        json_path = ".status.retryCount"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct ProxmoxRemediationSpec {
    /// How the Machine is repaired.
    #[serde(default)]
    pub strategy: RemediationStrategy,
}

/// Reboot (hard reset when a clean reboot does not finish), wait for the Node, try again, then
/// hand the Machine back for replacement.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RemediationStrategy {
    /// The only strategy: `Reboot`.
    #[serde(rename = "type", default)]
    pub type_: RemediationType,
    /// Reboots to try before the Machine is handed back to its owner for replacement.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 10), extend("default" = DEFAULT_RETRY_LIMIT))]
    pub retry_limit: Option<i32>,
    /// Seconds the Node has after each reboot to be healthy again (the MachineHealthCheck
    /// deletes this request when it is) before the next reboot or the replacement.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 86400), extend("default" = DEFAULT_TIMEOUT_SECONDS))]
    pub timeout_seconds: Option<i32>,
    /// Seconds a clean reboot (ACPI or guest agent) may take before the VM is hard-reset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 3600), extend("default" = DEFAULT_SHUTDOWN_TIMEOUT_SECONDS))]
    pub shutdown_timeout_seconds: Option<i32>,
    /// For a VM Proxmox HA manages: after the last reboot, have HA move it to another online
    /// node of its zone and give the Node `timeoutSeconds` more before the replacement.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = true))]
    pub move_before_replace: Option<bool>,
}

impl RemediationStrategy {
    /// Reboots to try, the spec's or the default.
    pub fn retry_limit(&self) -> u32 {
        positive(self.retry_limit, DEFAULT_RETRY_LIMIT)
    }

    /// Seconds the Node has after each reboot.
    pub fn timeout_seconds(&self) -> u32 {
        positive(self.timeout_seconds, DEFAULT_TIMEOUT_SECONDS)
    }

    /// Whether an HA-managed VM is moved before the replacement (unset: yes).
    pub fn move_before_replace(&self) -> bool {
        self.move_before_replace != Some(false)
    }

    /// Seconds a clean reboot may take.
    pub fn shutdown_timeout_seconds(&self) -> u32 {
        positive(
            self.shutdown_timeout_seconds,
            DEFAULT_SHUTDOWN_TIMEOUT_SECONDS,
        )
    }
}

/// A spec value the schema keeps positive; the default where it is unset (or, written before
/// validation, out of range).
fn positive(value: Option<i32>, default: i32) -> u32 {
    value
        .and_then(|v| u32::try_from(v).ok())
        .filter(|v| *v > 0)
        .or_else(|| u32::try_from(default).ok())
        .unwrap_or(1)
}

/// Remediation strategies.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum RemediationType {
    /// Reboot the VM, hard-reset it when the reboot does not finish in time.
    #[default]
    Reboot,
}

/// Where a remediation is.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum RemediationPhase {
    /// A clean reboot of the VM runs.
    Rebooting,
    /// The VM is being hard-reset (the clean reboot did not finish in time).
    Resetting,
    /// The VM restarted (or moved); the Node has until `status.lastRemediated` plus the timeout.
    WaitingForNode,
    /// Proxmox HA moves the VM to another node of its zone (`status.movedTo`).
    Moving,
    /// Reboots did not help (or there is no VM to reboot): the Machine is handed back to its
    /// owner (MachineSet or KubeadmControlPlane), which replaces it.
    Replacing,
}

/// What the remediation did so far; kept so a restarted controller goes on where it was.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ProxmoxRemediationStatus {
    /// Where the remediation is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<RemediationPhase>,
    /// Reboots (clean or by reset) started for this Machine.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_count: Option<i32>,
    /// When the VM last finished restarting.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_remediated: Option<Time>,
    /// UPID of the reboot or reset task in flight.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_ref: Option<String>,
    /// VMID of the VM being remediated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub virtual_machine_id: Option<i64>,
    /// Proxmox node the VM ran on when it was last looked at.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proxmox_node: Option<String>,
    /// The node Proxmox HA was asked to move the VM to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moved_to: Option<String>,
    /// When that move was asked for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub move_requested: Option<Time>,
    /// Conditions: `Remediated` (False while the remediation runs, with what it does) and
    /// `Ready`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "conditions_schema")]
    pub conditions: Vec<Condition>,
}

impl ProxmoxRemediationStatus {
    /// Reboots started so far.
    pub fn reboots(&self) -> u32 {
        self.retry_count
            .and_then(|n| u32::try_from(n).ok())
            .unwrap_or(0)
    }
}

/// What a MachineHealthCheck's `spec.remediation.templateRef` names.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "infrastructure.cluster.x-k8s.io",
    version = "v1alpha2",
    kind = "ProxmoxRemediationTemplate",
    doc = "The ProxmoxRemediation a MachineHealthCheck creates for each unhealthy Machine.",
    namespaced,
    shortname = "moxremt",
    category = "cluster-api",
    category = "proxmox",
    label("cluster.x-k8s.io/v1beta2", "v1alpha2")
)]
#[serde(rename_all = "camelCase")]
pub struct ProxmoxRemediationTemplateSpec {
    /// The ProxmoxRemediation to stamp out.
    pub template: ProxmoxRemediationTemplateResource,
}

/// Metadata and spec of the ProxmoxRemediations a template describes.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ProxmoxRemediationTemplateResource {
    /// Labels and annotations of the created objects.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<TemplateObjectMeta>,
    /// Spec of the created ProxmoxRemediations.
    pub spec: ProxmoxRemediationSpec,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unset_or_out_of_range_values_take_the_defaults() {
        let unset = RemediationStrategy::default();
        assert_eq!(
            (
                unset.retry_limit(),
                unset.timeout_seconds(),
                unset.shutdown_timeout_seconds()
            ),
            (1, 300, 120)
        );
        let set = RemediationStrategy {
            type_: RemediationType::Reboot,
            retry_limit: Some(3),
            timeout_seconds: Some(0),
            shutdown_timeout_seconds: Some(-5),
            move_before_replace: Some(false),
        };
        assert!(unset.move_before_replace());
        assert!(!set.move_before_replace());
        assert_eq!(set.retry_limit(), 3);
        assert_eq!(set.timeout_seconds(), 300);
        assert_eq!(set.shutdown_timeout_seconds(), 120);
    }
}
