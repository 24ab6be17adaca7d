//! What a pass writes: the machine's status (guarded against stale copies) and its events.

use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams};
use kube::runtime::events::EventType;
use kube::{Api, Resource};
use serde_json::json;

use super::{FIELD_MANAGER, MachineError, PROVISIONED, Reconcile, Scope};
use crate::api::{self, ProxmoxMachine, ProxmoxMachineStatus};
use crate::controller::conditions::{self, Decided};
use crate::controller::failures;
use crate::controller::guarded::WriteError;

impl Reconcile<'_> {
    /// Writes the status a pass decided, unless the pass worked from a copy of the machine
    /// without a VMID in status while the stored machine has one: caches lag (after a watch
    /// expired, for one), and that copy's status would erase the VMID, node and task (with its
    /// back-off) a newer pass recorded before its clone request. Such a pass is stale instead
    /// and looked at again soon; the check costs one read, and only while no VMID is recorded.
    pub(super) async fn write_status(
        &self,
        api: &Api<ProxmoxMachine>,
        name: &str,
        current: &ProxmoxMachineStatus,
        desired: &ProxmoxMachineStatus,
    ) -> Result<(), MachineError> {
        let read_without_vmid = self
            .machine
            .status
            .as_ref()
            .is_none_or(|s| s.virtual_machine_id.is_none());
        if current != desired
            && read_without_vmid
            && desired.virtual_machine_id.is_none()
            && api
                .get_opt(name)
                .await?
                .and_then(|stored| stored.status)
                .is_some_and(|stored| stored.virtual_machine_id.is_some())
        {
            return Err(WriteError::Stale {
                kind: ProxmoxMachine::kind(&()).into_owned(),
                name: name.to_owned(),
            }
            .into());
        }
        apply_status(api, name, current, desired).await
    }

    /// Says the machine is paused (its other conditions stay as they are).
    pub(super) async fn report_paused(&self, scope: &mut Scope) -> Result<(), MachineError> {
        scope.status.conditions = paused_conditions(&scope.current, scope.generation);
        self.write_status(&scope.api, &scope.name, &scope.current, &scope.status)
            .await
    }

    /// A Warning event, unless the machine reports `reason` already (one per episode, not one
    /// per pass).
    pub(super) async fn warn_once(&self, scope: &Scope, reason: &str, message: &str) {
        let reported = scope
            .current
            .conditions
            .iter()
            .any(|c| c.type_ == PROVISIONED && c.reason == reason);
        if !reported {
            self.event(scope, EventType::Warning, reason, message).await;
        }
    }

    pub(super) async fn event(&self, scope: &Scope, type_: EventType, reason: &str, note: &str) {
        match type_ {
            EventType::Normal => tracing::info!(machine = %scope.name, reason, "{note}"),
            EventType::Warning => tracing::warn!(machine = %scope.name, reason, "{note}"),
        }
        failures::publish_event(
            &self.context.client,
            FIELD_MANAGER,
            &self.machine.object_ref(&()),
            type_,
            reason,
            note,
        )
        .await;
    }
}

pub(super) fn paused_conditions(
    current: &ProxmoxMachineStatus,
    generation: Option<i64>,
) -> Vec<k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition> {
    let mut kept: Vec<_> = current
        .conditions
        .iter()
        .filter(|c| c.type_ != api::conditions::PAUSED)
        .cloned()
        .collect();
    let merged = conditions::merge(
        &current.conditions,
        &[Decided::ok(
            api::conditions::PAUSED,
            "Paused",
            "reconciliation is paused by the Cluster or an annotation",
        )],
        generation,
        Timestamp::now(),
    );
    kept.extend(
        merged
            .into_iter()
            .filter(|c| c.type_ == api::conditions::PAUSED),
    );
    kept.sort_by(|a, b| a.type_.cmp(&b.type_));
    kept
}

/// Writes the whole status, refused with 409 Conflict unless the object still has
/// `resource_version` (when given): for writes that must not be based on a stale view.
pub(super) async fn apply_status_guarded(
    api: &Api<ProxmoxMachine>,
    name: &str,
    desired: &ProxmoxMachineStatus,
    resource_version: Option<&str>,
) -> Result<(), MachineError> {
    let mut body = json!({
        "apiVersion": ProxmoxMachine::api_version(&()),
        "kind": ProxmoxMachine::kind(&()),
        "status": desired,
    });
    if let Some(version) = resource_version {
        body["metadata"] = json!({"resourceVersion": version});
    }
    api.patch_status(
        name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(body),
    )
    .await?;
    Ok(())
}

pub(super) async fn apply_status(
    api: &Api<ProxmoxMachine>,
    name: &str,
    current: &ProxmoxMachineStatus,
    desired: &ProxmoxMachineStatus,
) -> Result<(), MachineError> {
    if current == desired {
        return Ok(());
    }
    apply_status_guarded(api, name, desired, None).await
}
