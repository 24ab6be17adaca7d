//! The validating admission webhook: the API server sends `admission.k8s.io/v1` AdmissionReviews
//! to `POST /validate-infrastructure-cluster-x-k8s-io-v1alpha2-<kind>` (the Go provider's paths)
//! on creates and updates, and capmox answers with the checks of [`crate::api::validation`], the
//! part of the Go provider's webhooks that the CRDs' CEL rules cannot make.

use kube::core::admission::{AdmissionRequest, AdmissionResponse, AdmissionReview, Operation};
use kube::core::response::{StatusCause, StatusDetails};
use kube::core::{DynamicObject, Status};
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::api::validation::{self, FieldError, TOPOLOGY_DRY_RUN_ANNOTATION};
use crate::api::{GROUP, ProxmoxCluster, ProxmoxClusterTemplate, ProxmoxMachine, VERSION};

/// What every validation path starts with; the lower-case kind follows.
pub const VALIDATE_PATH_PREFIX: &str = "/validate-infrastructure-cluster-x-k8s-io-v1alpha2-";

/// The kinds the webhook validates, each on its own path.
pub const VALIDATED_KINDS: [&str; 4] = [
    "ProxmoxCluster",
    "ProxmoxClusterTemplate",
    "ProxmoxMachine",
    "ProxmoxMachineTemplate",
];

/// The path the ValidatingWebhookConfiguration names for `kind`.
pub fn validate_path(kind: &str) -> String {
    format!("{VALIDATE_PATH_PREFIX}{}", kind.to_ascii_lowercase())
}

/// The kind a request path validates, if it is one of the webhook's.
pub fn kind_of_path(path: &str) -> Option<&'static str> {
    let suffix = path.strip_prefix(VALIDATE_PATH_PREFIX)?;
    VALIDATED_KINDS
        .into_iter()
        .find(|kind| kind.eq_ignore_ascii_case(suffix))
}

/// Why a request body is not an admission request the webhook can answer (HTTP 400).
#[derive(Debug, thiserror::Error)]
pub enum AdmissionReviewError {
    /// The body is not JSON, or not shaped like an AdmissionReview.
    #[error(
        "the body is not an AdmissionReview (admission.k8s.io/v1 JSON with apiVersion, kind and \
         request): {0}"
    )]
    Malformed(#[source] serde_json::Error),
    /// The body is a review of another kind or version.
    #[error(
        "expected kind AdmissionReview of apiVersion admission.k8s.io/v1, got kind {kind:?} of \
         apiVersion {api_version:?}"
    )]
    WrongType {
        /// The body's `kind`.
        kind: String,
        /// The body's `apiVersion`.
        api_version: String,
    },
    /// The review has no `request` to answer.
    #[error("the AdmissionReview has no request (the webhook answers requests, not responses)")]
    NoRequest,
}

/// Answers one AdmissionReview body sent to the path of `kind`.
pub fn review(
    kind: &str,
    body: &[u8],
) -> Result<AdmissionReview<DynamicObject>, AdmissionReviewError> {
    let review: AdmissionReview<DynamicObject> =
        serde_json::from_slice(body).map_err(AdmissionReviewError::Malformed)?;
    let known_version = matches!(
        review.types.api_version.as_str(),
        "admission.k8s.io/v1" | "admission.k8s.io/v1beta1"
    );
    if review.types.kind != "AdmissionReview" || !known_version {
        return Err(AdmissionReviewError::WrongType {
            kind: review.types.kind,
            api_version: review.types.api_version,
        });
    }
    let request: AdmissionRequest<DynamicObject> = review
        .try_into()
        .map_err(|_| AdmissionReviewError::NoRequest)?;
    Ok(respond(kind, &request).into_review())
}

/// The answer to one request: allowed, or denied saying which fields to fix.
pub fn respond(kind: &str, request: &AdmissionRequest<DynamicObject>) -> AdmissionResponse {
    let response = AdmissionResponse::from(request);
    let ours = request.kind.group == GROUP
        && request.kind.version == VERSION
        && request.kind.kind == kind
        && request.sub_resource.is_none();
    // Deletes and connects change nothing the checks look at; other kinds are not ours to judge.
    if !ours || !matches!(request.operation, Operation::Create | Operation::Update) {
        return response;
    }
    let name = object_name(request);
    let outcome = match &request.object {
        None => Err(format!("the {:?} request has no object", request.operation)),
        Some(object) => check(kind, request, object),
    };
    match outcome {
        Ok(errors) if errors.is_empty() => {
            tracing::debug!(uid = %request.uid, kind, %name, "admitted");
            response
        }
        Ok(errors) => {
            let status = invalid(kind, &name, &errors);
            tracing::info!(uid = %request.uid, kind, %name, message = %status.message, "denied");
            denied(response, status)
        }
        Err(problem) => {
            let message = format!("cannot validate {kind} {name:?}: {problem}");
            tracing::warn!(uid = %request.uid, kind, %name, %message, "denied a request it cannot read");
            denied(
                response,
                Status::failure(&message, "BadRequest").with_code(400),
            )
        }
    }
}

fn check(
    kind: &str,
    request: &AdmissionRequest<DynamicObject>,
    object: &DynamicObject,
) -> Result<Vec<FieldError>, String> {
    let json = serde_json::to_value(object).map_err(|e| e.to_string())?;
    Ok(match kind {
        "ProxmoxCluster" => {
            validation::cluster_spec(&typed::<ProxmoxCluster>(kind, json)?.spec, "spec")
        }
        "ProxmoxClusterTemplate" => validation::cluster_spec(
            &typed::<ProxmoxClusterTemplate>(kind, json)?
                .spec
                .template
                .spec,
            "spec.template.spec",
        ),
        "ProxmoxMachine" => {
            validation::machine_spec(&typed::<ProxmoxMachine>(kind, json)?.spec, "spec")
        }
        "ProxmoxMachineTemplate" => match (&request.operation, &request.old_object) {
            (Operation::Update, Some(old)) => {
                let old = serde_json::to_value(old).map_err(|e| e.to_string())?;
                let topology_dry_run = request.dry_run
                    && object
                        .metadata
                        .annotations
                        .as_ref()
                        .is_some_and(|a| a.contains_key(TOPOLOGY_DRY_RUN_ANNOTATION));
                validation::machine_template_update(&old["spec"], &json["spec"], topology_dry_run)
            }
            (Operation::Update, None) => return Err("the update has no oldObject".to_owned()),
            // Everything a template's create needs checking is in the CRD's CEL rules.
            _ => Vec::new(),
        },
        _ => Vec::new(),
    })
}

fn typed<T: DeserializeOwned>(kind: &str, object: Value) -> Result<T, String> {
    serde_json::from_value(object).map_err(|e| format!("it is not a {kind}: {e}"))
}

fn object_name(request: &AdmissionRequest<DynamicObject>) -> String {
    request
        .object
        .as_ref()
        .and_then(|o| o.metadata.name.clone())
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| request.name.clone())
}

/// An `Invalid` status as the API server words its own (`apierrors.NewInvalid`): 422, each
/// field error as a cause.
fn invalid(kind: &str, name: &str, errors: &[FieldError]) -> Status {
    let list = if let [only] = errors {
        only.to_string()
    } else {
        format!(
            "[{}]",
            errors
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        )
    };
    let message = format!("{kind}.{GROUP} {name:?} is invalid: {list}");
    Status::failure(&message, "Invalid")
        .with_code(422)
        .with_details(StatusDetails {
            name: name.to_owned(),
            group: GROUP.to_owned(),
            kind: kind.to_owned(),
            uid: String::new(),
            causes: errors
                .iter()
                .map(|error| StatusCause {
                    reason: error.kind.reason().to_owned(),
                    message: error.message(),
                    field: error.field.clone(),
                })
                .collect(),
            retry_after_seconds: 0,
        })
}

fn denied(response: AdmissionResponse, status: Status) -> AdmissionResponse {
    let message = status.message.clone();
    let mut response = response.deny(message);
    response.result = status;
    response
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::{AdmissionReviewError, kind_of_path, review, validate_path};

    const V1ALPHA2: &str = "infrastructure.cluster.x-k8s.io/v1alpha2";

    fn body(kind: &str, operation: &str, object: Value, old: Option<Value>) -> Vec<u8> {
        let name = old.as_ref().unwrap_or(&object)["metadata"]["name"].clone();
        serde_json::to_vec(&json!({
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
                "kind": {"group": "infrastructure.cluster.x-k8s.io", "version": "v1alpha2", "kind": kind},
                "resource": {"group": "infrastructure.cluster.x-k8s.io", "version": "v1alpha2",
                             "resource": format!("{}s", kind.to_ascii_lowercase())},
                "name": name,
                "namespace": "default",
                "operation": operation,
                "userInfo": {"username": "admin"},
                "object": object,
                "oldObject": old,
                "dryRun": false
            }
        }))
        .expect("JSON")
    }

    fn cluster(host: &str) -> Value {
        json!({"apiVersion": V1ALPHA2, "kind": "ProxmoxCluster",
               "metadata": {"name": "c", "namespace": "default"},
               "spec": {"controlPlaneEndpoint": {"host": host, "port": 6443},
                        "dnsServers": ["10.0.0.2"],
                        "ipv4Config": {"addresses": ["10.0.0.10-10.0.0.20"], "prefix": 24, "gateway": "10.0.0.1"}}})
    }

    fn answer(kind: &str, body: &[u8]) -> Value {
        serde_json::to_value(review(kind, body).expect("a review")).expect("JSON")
    }

    #[test]
    fn paths_name_the_kinds_as_the_go_provider_did() {
        assert_eq!(
            validate_path("ProxmoxMachineTemplate"),
            "/validate-infrastructure-cluster-x-k8s-io-v1alpha2-proxmoxmachinetemplate"
        );
        for kind in super::VALIDATED_KINDS {
            assert_eq!(kind_of_path(&validate_path(kind)), Some(kind));
        }
        assert_eq!(
            kind_of_path("/validate-infrastructure-cluster-x-k8s-io-v1alpha2-pod"),
            None
        );
        assert_eq!(kind_of_path("/convert"), None);
    }

    #[test]
    fn a_valid_object_is_allowed_and_the_uid_echoed() {
        let answer = answer(
            "ProxmoxCluster",
            &body("ProxmoxCluster", "CREATE", cluster("10.0.0.5"), None),
        );
        assert_eq!(answer["apiVersion"], "admission.k8s.io/v1");
        assert_eq!(answer["kind"], "AdmissionReview");
        assert_eq!(
            answer["response"]["uid"],
            "705ab4f5-6393-11e8-b7cc-42010a800002"
        );
        assert_eq!(answer["response"]["allowed"], true);
    }

    #[test]
    fn an_invalid_object_is_denied_with_422_and_the_field() {
        let answer = answer(
            "ProxmoxCluster",
            &body(
                "ProxmoxCluster",
                "UPDATE",
                cluster("10.0.0.15"),
                Some(cluster("10.0.0.5")),
            ),
        );
        let response = &answer["response"];
        assert_eq!(response["allowed"], false);
        let status = &response["status"];
        assert_eq!(status["code"], 422);
        assert_eq!(status["reason"], "Invalid");
        assert_eq!(status["status"], "Failure");
        let message = status["message"].as_str().expect("a message");
        assert!(
            message.starts_with(
                "ProxmoxCluster.infrastructure.cluster.x-k8s.io \"c\" is invalid: \
                 spec.ipv4Config.addresses[0]: Invalid value: \"10.0.0.10-10.0.0.20\": \
                 addresses may not contain the endpoint IP 10.0.0.15"
            ),
            "{message}"
        );
        assert_eq!(
            status["details"]["causes"][0]["field"],
            "spec.ipv4Config.addresses[0]"
        );
        assert_eq!(
            status["details"]["causes"][0]["reason"],
            "FieldValueInvalid"
        );
        assert_eq!(status["details"]["kind"], "ProxmoxCluster");
    }

    #[test]
    fn deletes_and_other_kinds_are_allowed() {
        let bad = cluster("10.0.0.15");
        let delete = body("ProxmoxCluster", "DELETE", Value::Null, Some(bad.clone()));
        assert_eq!(
            answer("ProxmoxCluster", &delete)["response"]["allowed"],
            true
        );
        let other = body("ProxmoxMachine", "CREATE", bad, None);
        assert_eq!(
            answer("ProxmoxCluster", &other)["response"]["allowed"],
            true
        );
    }

    #[test]
    fn an_unreadable_object_is_a_bad_request() {
        let mut object = cluster("10.0.0.5");
        object["spec"]["dnsServers"] = json!("not a list");
        let answer = answer(
            "ProxmoxCluster",
            &body("ProxmoxCluster", "CREATE", object, None),
        );
        assert_eq!(answer["response"]["allowed"], false);
        assert_eq!(answer["response"]["status"]["code"], 400);
        assert_eq!(answer["response"]["status"]["reason"], "BadRequest");
    }

    #[test]
    fn malformed_bodies_are_refused_with_a_reason() {
        assert!(matches!(
            review("ProxmoxCluster", b"{nope"),
            Err(AdmissionReviewError::Malformed(_))
        ));
        let no_request = json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"});
        assert!(matches!(
            review(
                "ProxmoxCluster",
                &serde_json::to_vec(&no_request).expect("JSON")
            ),
            Err(AdmissionReviewError::NoRequest)
        ));
        let conversion =
            json!({"apiVersion": "apiextensions.k8s.io/v1", "kind": "ConversionReview"});
        let error = review(
            "ProxmoxCluster",
            &serde_json::to_vec(&conversion).expect("JSON"),
        )
        .expect_err("not an AdmissionReview");
        assert!(error.to_string().contains("ConversionReview"), "{error}");
    }
}
