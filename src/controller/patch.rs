//! Writes that read back only the written object's generation and resourceVersion. The API
//! server answers each write with the whole object, managed fields and all; decoding that
//! into the full type on every status write was a sizeable share of a pass's CPU.

use std::fmt::Debug;

use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, Resource};
use serde::{Deserialize, Serialize};

/// What a write's answer is read for.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Written {
    pub generation: Option<i64>,
    pub resource_version: Option<String>,
}

/// The written object, of which only `metadata` is decoded (every other member is skipped).
#[derive(Deserialize)]
struct Answer {
    #[serde(default)]
    metadata: Written,
}

/// Patches the object `name`.
pub async fn patch<K: Resource + Clone, P: Serialize + Debug>(
    api: &Api<K>,
    name: &str,
    params: &PatchParams,
    patch: &Patch<P>,
) -> Result<Written, kube::Error> {
    let request = kube::core::Request::new(api.resource_url())
        .patch(name, params, patch)
        .map_err(kube::Error::BuildRequest)?;
    send(api, request, "patch").await
}

/// Patches the status of the object `name`.
pub async fn patch_status<K: Resource + Clone, P: Serialize + Debug>(
    api: &Api<K>,
    name: &str,
    params: &PatchParams,
    patch: &Patch<P>,
) -> Result<Written, kube::Error> {
    let request = kube::core::Request::new(api.resource_url())
        .patch_subresource("status", name, params, patch)
        .map_err(kube::Error::BuildRequest)?;
    send(api, request, "patch_status").await
}

/// Creates `object` in the collection `api` names.
pub async fn create<K: Resource + Clone + Serialize>(
    api: &Api<K>,
    params: &PostParams,
    object: &K,
) -> Result<Written, kube::Error> {
    let body = serde_json::to_vec(object).map_err(kube::Error::SerdeError)?;
    let request = kube::core::Request::new(api.resource_url())
        .create(params, body)
        .map_err(kube::Error::BuildRequest)?;
    send(api, request, "create").await
}

async fn send<K: Resource + Clone>(
    api: &Api<K>,
    mut request: ::http::Request<Vec<u8>>,
    verb: &'static str,
) -> Result<Written, kube::Error> {
    // Named as kube names its own requests, for its tracing.
    request.extensions_mut().insert(verb);
    let answer: Answer = api.clone().into_client().request(request).await?;
    Ok(answer.metadata)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_metadata_read_back_is_decoded() {
        let answer: Answer = serde_json::from_str(
            r#"{"apiVersion":"v1","kind":"X","metadata":{"name":"m","generation":3,"resourceVersion":"42","managedFields":[{"manager":"capmox","fieldsV1":{"f:status":{}}}]},"status":{"a":[1,2,{"b":null}]}}"#,
        )
        .unwrap();
        assert_eq!(answer.metadata.generation, Some(3));
        assert_eq!(answer.metadata.resource_version.as_deref(), Some("42"));
        let answer: Answer = serde_json::from_str(r#"{"kind":"X"}"#).unwrap();
        assert_eq!(answer.metadata.generation, None);
    }
}
