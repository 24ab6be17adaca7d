//! Every write of a pass to its ProxmoxMachine (status guarded against stale copies, the VMID
//! and provider ID in its spec, its finalizer) and its events, in one place.

use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams};
use kube::runtime::events::EventType;
use kube::{Api, Resource, ResourceExt};
use serde_json::json;

use super::{FIELD_MANAGER, MachineError, PROVISIONED, Reconcile, Scope};
use crate::api::{self, ProxmoxMachine, ProxmoxMachineStatus, finalizers, labels};
use crate::controller::conditions::{self, Decided};
use crate::controller::failures;
use crate::controller::guarded::{self, WriteError};
use crate::controller::patch;
use crate::placement::Placement;

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

    /// Records `vmid` in `spec.virtualMachineID`, where it survives `clusterctl move` and
    /// restores (status does not), unless it is there already. Guarded by `guard` (a
    /// resourceVersion) when given. Returns the resourceVersion to guard the next write with.
    pub(super) async fn record_vmid(
        &self,
        scope: &mut Scope,
        vmid: u32,
        guard: Option<String>,
    ) -> Result<Option<String>, MachineError> {
        if self.machine.spec.virtual_machine_id == Some(i64::from(vmid)) {
            return Ok(guard);
        }
        let mut ops = Vec::new();
        if let Some(version) = &guard {
            ops.push(json!({"op": "test", "path": "/metadata/resourceVersion", "value": version}));
        }
        ops.push(json!({"op": "add", "path": "/spec/virtualMachineID", "value": vmid}));
        let patched = patch::patch(
            &scope.api,
            &scope.name,
            &PatchParams::default(),
            &Patch::Json::<()>(serde_json::from_value(serde_json::Value::Array(ops))?),
        )
        .await
        .map_err(|error| guarded::guarded_write_error(self.machine, error))?;
        self.context.own_writes.wrote(self.machine, &patched);
        scope.generation = patched.generation;
        Ok(patched.resource_version)
    }

    /// Writes `provider_id` to the machine's spec and its zone (`default` without one) to its
    /// `topology.kubernetes.io/proxmox-zone` label, as the Go provider labels its machines for
    /// users to select on, unless both are there already.
    pub(super) async fn record_identity(
        &self,
        scope: &mut Scope,
        placement: &Placement,
        provider_id: &str,
    ) -> Result<(), MachineError> {
        let zone = placement.zone_label();
        if self.machine.spec.provider_id.as_deref() == Some(provider_id)
            && self
                .machine
                .labels()
                .get(labels::PROXMOX_ZONE)
                .map(String::as_str)
                == Some(zone)
        {
            return Ok(());
        }
        let patched = patch::patch(
            &scope.api,
            &scope.name,
            &PatchParams::default(),
            &Patch::Merge(json!({
                "metadata": {"labels": {labels::PROXMOX_ZONE: zone}},
                "spec": {"providerID": provider_id},
            })),
        )
        .await?;
        self.context.own_writes.wrote(self.machine, &patched);
        scope.generation = patched.generation;
        Ok(())
    }

    /// Removes the finished task `upid` from the recorded status, if it is still there: a JSON
    /// patch that first tests `status.taskRef`, so only the first pass that sees the task
    /// finished gets `true`.
    pub(super) async fn forget_task(
        &self,
        scope: &mut Scope,
        upid: &str,
    ) -> Result<bool, MachineError> {
        let patch = json!([
            {"op": "test", "path": "/status/taskRef", "value": upid},
            {"op": "remove", "path": "/status/taskRef"}
        ]);
        let patched = patch::patch_status(
            &scope.api,
            &scope.name,
            &PatchParams::default(),
            &Patch::Json::<()>(serde_json::from_value(patch)?),
        )
        .await;
        match patched {
            Ok(_) => {
                scope.current.task_ref = None;
                Ok(true)
            }
            // The test failed: an earlier pass already forgot it.
            Err(kube::Error::Api(status)) if matches!(status.code, 409 | 422) => Ok(false),
            Err(error) => Err(error.into()),
        }
    }

    /// Adds the machine's finalizer, guarded by the resourceVersion this pass saw, so a stale
    /// copy of the machine never goes on to clone.
    pub(super) async fn ensure_finalizer(&self, scope: &Scope) -> Result<(), MachineError> {
        if let Some(written) =
            guarded::ensure_finalizer(&scope.api, self.machine, finalizers::MACHINE).await?
        {
            self.context.own_writes.wrote(self.machine, &written);
        }
        Ok(())
    }

    /// Removes the machine's finalizer: nothing of it is left in Proxmox.
    pub(super) async fn release_finalizer(&self, scope: &Scope) -> Result<(), MachineError> {
        guarded::release(&scope.api, self.machine, Some(finalizers::MACHINE), None).await?;
        Ok(())
    }

    /// Writes the intent before a clone: guarded by the observed resourceVersion (when this
    /// pass did not just prove it fresh with the finalizer patch), so a stale cached object can
    /// never start a second clone.
    pub(super) async fn write_checkpoint(
        &self,
        scope: &mut Scope,
        checkpoint: ProxmoxMachineStatus,
    ) -> Result<(), MachineError> {
        apply_status_guarded(
            &scope.api,
            &scope.name,
            &checkpoint,
            scope.resource_version.as_deref(),
        )
        .await?;
        scope.current = checkpoint;
        Ok(())
    }

    /// Records the clone's task right after the request, not at the end of the pass, so a
    /// failed write of the pass's status cannot lose it (a restarted controller checks the task
    /// instead of cloning again). With the conditions the pass ends with (`reporting`), which
    /// leaves the pass's own status write nothing to change.
    pub(super) async fn write_task_record(
        &self,
        scope: &mut Scope,
        reporting: Option<&Decided>,
    ) -> Result<(), MachineError> {
        let mut recorded = scope.status.clone();
        recorded.conditions = match reporting {
            Some(decided) => super::pass::reported_conditions(scope, decided.clone()),
            None => scope.current.conditions.clone(),
        };
        apply_status(&scope.api, &scope.name, &scope.current, &recorded).await?;
        scope.current = recorded;
        Ok(())
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
async fn apply_status_guarded(
    api: &Api<ProxmoxMachine>,
    name: &str,
    desired: &ProxmoxMachineStatus,
    resource_version: Option<&str>,
) -> Result<(), MachineError> {
    let body = StatusApply {
        api_version: &ProxmoxMachine::api_version(&()),
        kind: &ProxmoxMachine::kind(&()),
        metadata: resource_version.map(|resource_version| VersionGuard { resource_version }),
        status: desired,
    };
    patch::patch_status(
        api,
        name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(body),
    )
    .await?;
    Ok(())
}

/// The body of a status write, serialized straight from the status: a machine's status is
/// written several times as it provisions, and a JSON tree built first only to be written out
/// cost a copy of it each time.
#[derive(Debug, serde::Serialize)]
#[serde(rename_all = "camelCase")]
struct StatusApply<'a> {
    api_version: &'a str,
    kind: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    metadata: Option<VersionGuard<'a>>,
    status: &'a ProxmoxMachineStatus,
}

/// Refuses the write (409 Conflict) unless the object still has this resourceVersion.
#[derive(Debug, serde::Serialize)]
#[serde(rename_all = "camelCase")]
struct VersionGuard<'a> {
    resource_version: &'a str,
}

async fn apply_status(
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_status_write_says_what_the_json_tree_it_replaces_said() {
        let status = ProxmoxMachineStatus {
            virtual_machine_id: Some(101),
            proxmox_node: Some("pve1".into()),
            ..Default::default()
        };
        let (api_version, kind) = (ProxmoxMachine::api_version(&()), ProxmoxMachine::kind(&()));
        for guard in [None, Some("42")] {
            let body = StatusApply {
                api_version: &api_version,
                kind: &kind,
                metadata: guard.map(|resource_version| VersionGuard { resource_version }),
                status: &status,
            };
            let mut tree = json!({"apiVersion": api_version, "kind": kind, "status": status});
            if let Some(version) = guard {
                tree["metadata"] = json!({"resourceVersion": version});
            }
            assert_eq!(serde_json::to_value(&body).expect("serializes"), tree);
        }
    }
}
