//! Writes both controllers guard with the object's resourceVersion (finalizers added and
//! removed by JSON patch), and what a refused guard means: the pass worked from a stale copy,
//! and the newer version's watch event brings the next pass.

use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{Patch, PatchParams};
use kube::{Api, Resource, ResourceExt};
use serde_json::{Value, json};

use crate::api::ProxmoxCluster;

/// Why a guarded write failed.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    /// A Kubernetes API call failed.
    #[error("Kubernetes API error: {0}")]
    Kube(#[from] kube::Error),
    /// A patch could not be encoded.
    #[error("cannot encode patch: {0}")]
    Json(#[from] serde_json::Error),
    /// The object lacks a name (never true for objects read from the API).
    #[error("{kind} without a name")]
    MissingIdentity {
        /// The object's kind.
        kind: String,
    },
    /// A write guarded by the object's resourceVersion found a newer version (the API server
    /// answers the failed `test` with 422, or 409): the pass worked from a stale copy, and the
    /// newer version's watch event brings the next one.
    #[error("{kind} {name} changed since it was read; looking again")]
    Stale {
        /// The object's kind.
        kind: String,
        /// The object's name.
        name: String,
    },
}

impl WriteError {
    /// Whether the pass only saw an outdated copy (no failure to report or back off from).
    pub fn is_stale(&self) -> bool {
        matches!(self, Self::Stale { .. })
    }

    /// The refusal of a write to `object` because it changed since it was read.
    pub fn stale<K: Resource<DynamicType = ()>>(object: &K) -> Self {
        Self::Stale {
            kind: K::kind(&()).into_owned(),
            name: object.meta().name.clone().unwrap_or_default(),
        }
    }
}

/// Requeue after a pass that worked from a stale copy: the newer version's watch event
/// normally comes first; this only covers a missed one.
pub const STALE_RETRY: Duration = Duration::from_secs(1);

/// The error of a write guarded by `object`'s resourceVersion: a refused guard means the object
/// changed since it was read.
pub(crate) fn guarded_write_error<K: Resource<DynamicType = ()>>(
    object: &K,
    error: kube::Error,
) -> WriteError {
    match &error {
        kube::Error::Api(status) if status.code == 409 || status.code == 422 => {
            WriteError::stale(object)
        }
        _ => WriteError::Kube(error),
    }
}

/// Adds `finalizer` with a JSON patch guarded by the resourceVersion (a concurrent change makes it
/// fail and the reconcile retry, instead of overwriting someone else's finalizers). Returns
/// what the write read back, or `None` when the finalizer was there already.
pub(crate) async fn ensure_finalizer<K>(
    api: &Api<K>,
    object: &K,
    finalizer: &str,
) -> Result<Option<super::patch::Written>, WriteError>
where
    K: Resource<DynamicType = ()> + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    if object.finalizers().iter().any(|f| f == finalizer) {
        return Ok(None);
    }
    let name = name_of(object)?;
    let patch = if object.meta().finalizers.is_none() {
        json!([
            {"op": "test", "path": "/metadata/resourceVersion", "value": object.meta().resource_version},
            {"op": "add", "path": "/metadata/finalizers", "value": [finalizer]}
        ])
    } else {
        json!([
            {"op": "test", "path": "/metadata/resourceVersion", "value": object.meta().resource_version},
            {"op": "add", "path": "/metadata/finalizers/-", "value": finalizer}
        ])
    };
    let written = super::patch::patch(
        api,
        &name,
        &PatchParams::default(),
        &Patch::Json::<()>(serde_json::from_value(patch)?),
    )
    .await
    .map_err(|error| guarded_write_error(object, error))?;
    Ok(Some(written))
}

/// Removes `finalizer` when given (and, for Secrets, our owner reference) with a guarded JSON
/// patch.
pub(crate) async fn release<K>(
    api: &Api<K>,
    object: &K,
    finalizer: Option<&str>,
    owner_uid: Option<&str>,
) -> Result<(), WriteError>
where
    K: Resource<DynamicType = ()> + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let name = name_of(object)?;
    let mut ops = vec![
        json!({"op": "test", "path": "/metadata/resourceVersion", "value": object.meta().resource_version}),
    ];
    if let Some(uid) = owner_uid
        && let Some(index) = object.owner_references().iter().position(|o| o.uid == uid)
    {
        ops.push(json!({"op": "remove", "path": format!("/metadata/ownerReferences/{index}")}));
    }
    if let Some(finalizer) = finalizer
        && let Some(index) = object.finalizers().iter().position(|f| f == finalizer)
    {
        ops.push(json!({"op": "remove", "path": format!("/metadata/finalizers/{index}")}));
    }
    if ops.len() == 1 {
        return Ok(());
    }
    super::patch::patch(
        api,
        &name,
        &PatchParams::default(),
        &Patch::Json::<()>(serde_json::from_value(Value::Array(ops))?),
    )
    .await
    .map_err(|error| guarded_write_error(object, error))?;
    Ok(())
}

/// The object's name, which every object read from the API has.
fn name_of<K: Resource<DynamicType = ()>>(object: &K) -> Result<String, WriteError> {
    object
        .meta()
        .name
        .clone()
        .ok_or_else(|| WriteError::MissingIdentity {
            kind: K::kind(&()).into_owned(),
        })
}

/// An owner reference to `cluster` (as controller or not).
pub(crate) fn cluster_owner_reference(
    cluster: &ProxmoxCluster,
    controller: bool,
) -> OwnerReference {
    OwnerReference {
        api_version: ProxmoxCluster::api_version(&()).into_owned(),
        kind: ProxmoxCluster::kind(&()).into_owned(),
        name: cluster.metadata.name.clone().unwrap_or_default(),
        uid: cluster.metadata.uid.clone().unwrap_or_default(),
        controller: controller.then_some(true),
        block_owner_deletion: controller.then_some(true),
    }
}
