//! The CRD conversion webhook: the API server sends `ConversionReview`s to `POST /convert` over
//! HTTPS whenever it must read or write capmox's objects in another version than stored. The
//! same server answers the validating admission webhook ([`admission`]) on the Go provider's
//! `/validate-...` paths. Every replica serves both, leader or not, since the Service may route a
//! request to any of them.

pub mod admission;
pub mod body;
pub mod tls;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use kube::core::Status;
use kube::core::conversion::{ConversionRequest, ConversionResponse, ConversionReview};
use serde_json::Value;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use crate::controller::http::{
    AcceptBackoff, ServerLimits, accept_next, bind_listener, serve_http1,
};

pub use tls::{CertError, Reload, ServingCertificate};

/// controller-runtime's default, so manifests written for Go providers mount the Secret where
/// capmox looks.
pub const DEFAULT_CERT_DIR: &str = "/tmp/k8s-webhook-server/serving-certs";

/// The path the CRDs' `spec.conversion.webhook.clientConfig.service.path` names.
pub const CONVERT_PATH: &str = "/convert";

/// Largest request body read: the API server sends one object of at most ~3 MiB (etcd's
/// limit is 1.5 MiB), and a list of 500 (kube's page size) ProxmoxMachines is about 2.5 MiB.
/// Larger bodies are refused with 413 before more than this is buffered.
pub const MAX_BODY_BYTES: usize = 4 * 1024 * 1024;

/// Most JSON values a body may hold (scalars and keys count 1, arrays and objects more: see
/// [`body::OBJECT_WEIGHT`]): a review of 500 ProxmoxMachines counts about half of it, while a
/// hostile body (`[0,0,0,…]`, `[{"a":0},…]`) would parse into many times its size. Counted
/// before parsing, without allocating, so one review parses into at most a few tens of MiB.
pub const MAX_JSON_VALUES: usize = MAX_BODY_BYTES / 16;

/// Reviews read and answered at once; the rest wait up to [`REVIEW_QUEUE_TIMEOUT`]. With
/// [`MAX_BODY_BYTES`] and [`MAX_JSON_VALUES`] this bounds the webhook's memory (the book: Security, "Listener limits").
pub const MAX_CONCURRENT_REVIEWS: usize = 4;

/// How long a review waits for one of the [`MAX_CONCURRENT_REVIEWS`] slots before it gets 503.
pub const REVIEW_QUEUE_TIMEOUT: Duration = Duration::from_secs(2);

/// How often the certificate files are checked for a rotation; cert-manager renews well before
/// expiry and kubelet takes up to a minute to update the volume, so seconds are plenty.
pub const CERT_POLL_INTERVAL: Duration = Duration::from_secs(2);

/// The webhook listener's timeouts and cap: the API server's webhook calls time out after at
/// most 30 s, so nothing needs longer.
pub const WEBHOOK_LIMITS: ServerLimits = ServerLimits {
    header_read_timeout: Duration::from_secs(10),
    request_timeout: Duration::from_secs(30),
    handshake_timeout: Duration::from_secs(10),
    max_connections: 64,
};

/// Where and with which certificate the webhook is served.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WebhookConfig {
    /// Address to listen on (port 0 lets the OS choose, for tests).
    pub bind_address: SocketAddr,
    /// Directory holding `tls.crt` and `tls.key` (the mounted cert-manager Secret).
    pub cert_dir: PathBuf,
}

/// Converts one object to the requested `apiVersion`, or says why it cannot; a function value
/// so tests can serve a fake while production serves [`capmox_converter`].
pub type Converter = Arc<dyn Fn(Value, &str) -> Result<Value, String> + Send + Sync>;

/// The converter `capmox run` serves: [`crate::api::conversion::convert`].
pub fn capmox_converter() -> Converter {
    Arc::new(|object, desired| {
        crate::api::conversion::convert(object, desired).map_err(|error| error.to_string())
    })
}

/// Why the webhook could not be served.
#[derive(Debug, thiserror::Error)]
pub enum WebhookError {
    /// The listen address is taken or not allowed.
    #[error(
        "cannot listen on {address} for the conversion webhook (is another process using it? \
         change --webhook-bind-address, or pass --disable-webhook): {source}"
    )]
    Bind {
        /// The address asked for.
        address: SocketAddr,
        /// Underlying error.
        source: std::io::Error,
    },
    /// rustls refused the server configuration.
    #[error("cannot configure TLS for the conversion webhook: {0}")]
    Tls(#[source] rustls::Error),
}

/// Why a request body is not a conversion request the webhook can answer (HTTP 400).
#[derive(Debug, thiserror::Error)]
pub enum ReviewError {
    /// The body is not JSON, or not shaped like a ConversionReview.
    #[error(
        "the body is not a ConversionReview (apiextensions.k8s.io/v1 JSON with apiVersion, kind \
         and request): {0}"
    )]
    Malformed(#[source] serde_json::Error),
    /// The body is a ConversionReview of another kind or version.
    #[error(
        "expected kind ConversionReview of apiVersion apiextensions.k8s.io/v1, got kind \
         {kind:?} of apiVersion {api_version:?}"
    )]
    WrongType {
        /// The body's `kind`.
        kind: String,
        /// The body's `apiVersion`.
        api_version: String,
    },
    /// The review has no `request` to answer.
    #[error("the ConversionReview has no request (the webhook answers requests, not responses)")]
    NoRequest,
}

/// Answers one ConversionReview body: the response review, or why the body is unusable.
pub fn review(
    body: &[u8],
    convert: &dyn Fn(Value, &str) -> Result<Value, String>,
) -> Result<ConversionReview, ReviewError> {
    let review: ConversionReview = serde_json::from_slice(body).map_err(ReviewError::Malformed)?;
    // v1beta1 reviews have the same shape; the CRDs ask for v1 only, but answering both costs
    // nothing.
    let known_version = matches!(
        review.types.api_version.as_str(),
        "apiextensions.k8s.io/v1" | "apiextensions.k8s.io/v1beta1"
    );
    if review.types.kind != "ConversionReview" || !known_version {
        return Err(ReviewError::WrongType {
            kind: review.types.kind,
            api_version: review.types.api_version,
        });
    }
    let request = ConversionRequest::from_review(review).map_err(|_| ReviewError::NoRequest)?;
    Ok(respond(request, convert).into_review())
}

/// Converts every object of `request`, in order; the first object that fails fails the whole
/// response (the API server accepts all objects or none), naming it and why.
pub fn respond(
    mut request: ConversionRequest,
    convert: &dyn Fn(Value, &str) -> Result<Value, String>,
) -> ConversionResponse {
    let desired = request.desired_api_version.clone();
    let objects = std::mem::take(&mut request.objects);
    let total = objects.len();
    let uid = request.uid.clone();
    let response = ConversionResponse::for_request(request);
    let mut converted = Vec::with_capacity(total);
    for (index, object) in objects.into_iter().enumerate() {
        let described = describe(&object);
        let outcome =
            convert(object, &desired).and_then(|result| match result["apiVersion"].as_str() {
                Some(version) if version == desired => Ok(result),
                other => Err(format!(
                    "the converter returned apiVersion {other:?} instead of {desired:?}"
                )),
            });
        match outcome {
            Ok(object) => converted.push(object),
            Err(error) => {
                let message = format!(
                    "cannot convert {described} (object {} of {total}) to {desired}: {error}",
                    index + 1
                );
                tracing::warn!(%uid, object = %described, desired_api_version = %desired, %error, "conversion failed");
                return response.failure(Status::failure(&message, "ConversionFailed"));
            }
        }
    }
    tracing::debug!(%uid, objects = total, desired_api_version = %desired, "converted");
    response.success(converted)
}

/// `Kind namespace/name` of an object, as far as it says.
fn describe(object: &Value) -> String {
    let field = |value: &Value| value.as_str().unwrap_or("<unnamed>").to_owned();
    let kind = object["kind"].as_str().unwrap_or("<no kind>");
    let name = field(&object["metadata"]["name"]);
    match object["metadata"]["namespace"].as_str() {
        Some(namespace) => format!("{kind} {namespace}/{name}"),
        None => format!("{kind} {name}"),
    }
}

/// A bound conversion webhook; `serve` answers until the token is cancelled.
pub struct WebhookServer {
    listener: TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
    certificate: ServingCertificate,
    converter: Converter,
    cert_poll_interval: Duration,
    limits: ServerLimits,
}

impl WebhookServer {
    /// Binds the address now (a taken port fails at start-up) and reads the certificate once;
    /// missing or broken files are logged, and handshakes fail until valid files appear.
    pub async fn bind(config: &WebhookConfig, converter: Converter) -> Result<Self, WebhookError> {
        let certificate = ServingCertificate::new(&config.cert_dir);
        certificate.reload();
        let tls = certificate.server_config().map_err(WebhookError::Tls)?;
        let listener =
            bind_listener(config.bind_address)
                .await
                .map_err(|source| WebhookError::Bind {
                    address: config.bind_address,
                    source,
                })?;
        Ok(Self {
            listener,
            acceptor: tokio_rustls::TlsAcceptor::from(Arc::new(tls)),
            certificate,
            converter,
            cert_poll_interval: CERT_POLL_INTERVAL,
            limits: WEBHOOK_LIMITS,
        })
    }

    /// Serves with these limits instead of [`WEBHOOK_LIMITS`] (tests shorten the timeouts).
    #[must_use]
    pub fn with_limits(mut self, limits: ServerLimits) -> Self {
        self.limits = limits;
        self
    }

    /// Checks the certificate files this often instead of every [`CERT_POLL_INTERVAL`] (tests
    /// that rotate through [`ServingCertificate::reload`] alone pass a long one).
    #[must_use]
    pub fn with_cert_poll_interval(mut self, interval: Duration) -> Self {
        self.cert_poll_interval = interval;
        self
    }

    /// The address actually bound (useful with port 0).
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.listener.local_addr().ok()
    }

    /// The certificate being served, to reload it or watch for rotations.
    pub fn certificate(&self) -> &ServingCertificate {
        &self.certificate
    }

    /// Answers requests until `shutdown` is cancelled, re-reading the certificate every
    /// [`CERT_POLL_INTERVAL`]; open connections finish their request in flight, then close.
    pub async fn serve(self, shutdown: CancellationToken) {
        tokio::spawn(
            self.certificate
                .clone()
                .watch(self.cert_poll_interval, shutdown.clone()),
        );
        let connections = Arc::new(Semaphore::new(self.limits.max_connections));
        let reviews = Arc::new(Semaphore::new(MAX_CONCURRENT_REVIEWS));
        let mut backoff = AcceptBackoff::default();
        while let Some((stream, peer, permit)) = accept_next(
            &self.listener,
            &connections,
            &mut backoff,
            "webhook",
            &shutdown,
        )
        .await
        {
            let acceptor = self.acceptor.clone();
            let converter = self.converter.clone();
            let reviews = reviews.clone();
            let (limits, shutdown) = (self.limits, shutdown.clone());
            tokio::spawn(async move {
                let handshake = acceptor.accept(stream);
                let stream = match tokio::time::timeout(limits.handshake_timeout, handshake).await {
                    Ok(Ok(stream)) => stream,
                    Ok(Err(error)) => {
                        tracing::debug!(%peer, %error, "webhook TLS handshake failed");
                        return;
                    }
                    Err(_) => {
                        tracing::debug!(%peer, "webhook TLS handshake timed out");
                        return;
                    }
                };
                let handler = move |request| {
                    let (converter, reviews) = (converter.clone(), reviews.clone());
                    async move { handle(request, &*converter, &reviews).await }
                };
                if let Err(error) = serve_http1(stream, limits, handler, shutdown).await {
                    tracing::debug!(%peer, %error, "webhook connection ended with an error");
                }
                drop(permit);
            });
        }
    }
}

async fn handle(
    request: Request<Incoming>,
    convert: &(dyn Fn(Value, &str) -> Result<Value, String> + Send + Sync),
    reviews: &Semaphore,
) -> Response<Full<Bytes>> {
    let path = request.uri().path().to_owned();
    if path != CONVERT_PATH && admission::kind_of_path(&path).is_none() {
        return not_found();
    }
    if request.method() != Method::POST {
        let mut response = text(
            StatusCode::METHOD_NOT_ALLOWED,
            format!("only POST is supported on {path}\n"),
        );
        response
            .headers_mut()
            .insert(hyper::header::ALLOW, http::HeaderValue::from_static("POST"));
        return response;
    }
    // A slot is taken before the body is read, so at most MAX_CONCURRENT_REVIEWS bodies are
    // buffered and parsed at once.
    let Ok(Ok(_slot)) = tokio::time::timeout(REVIEW_QUEUE_TIMEOUT, reviews.acquire()).await else {
        let mut response = text(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("{MAX_CONCURRENT_REVIEWS} reviews are being answered; retry shortly\n"),
        );
        response.headers_mut().insert(
            hyper::header::RETRY_AFTER,
            http::HeaderValue::from_static("1"),
        );
        return response;
    };
    let (parts, incoming) = request.into_parts();
    match body::read(&parts.headers, incoming, MAX_BODY_BYTES).await {
        Ok(body) => answer(&path, &body, convert),
        Err(error) => {
            tracing::debug!(%error, path, "refused a webhook request body");
            text(error.status(), format!("{error}\n"))
        }
    }
}

/// The response to a body read from `path` (`/convert` or a validation path): what the server
/// does once the body is in memory, public so its memory use can be measured.
pub fn answer(
    path: &str,
    body: &[u8],
    convert: &dyn Fn(Value, &str) -> Result<Value, String>,
) -> Response<Full<Bytes>> {
    if let Err(error) = body::check_value_count(body, MAX_JSON_VALUES) {
        tracing::debug!(%error, path, "refused a webhook request body");
        return text(error.status(), format!("{error}\n"));
    }
    let encoded = if path == CONVERT_PATH {
        match review(body, convert) {
            Ok(answer) => serde_json::to_vec(&answer),
            Err(error) => {
                tracing::debug!(%error, "refused a malformed conversion request");
                return text(StatusCode::BAD_REQUEST, format!("{error}\n"));
            }
        }
    } else if let Some(kind) = admission::kind_of_path(path) {
        match admission::review(kind, body) {
            Ok(answer) => serde_json::to_vec(&answer),
            Err(error) => {
                tracing::debug!(%error, kind, "refused a malformed admission request");
                return text(StatusCode::BAD_REQUEST, format!("{error}\n"));
            }
        }
    } else {
        return not_found();
    };
    match encoded {
        Ok(json) => {
            let mut response = Response::new(Full::new(Bytes::from(json)));
            response.headers_mut().insert(
                hyper::header::CONTENT_TYPE,
                http::HeaderValue::from_static("application/json"),
            );
            response
        }
        Err(error) => text(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("cannot encode the review: {error}\n"),
        ),
    }
}

fn not_found() -> Response<Full<Bytes>> {
    text(
        StatusCode::NOT_FOUND,
        format!(
            "not found: the webhook answers POST {CONVERT_PATH} (conversion) and POST \
             {}<kind> (validation of {})\n",
            admission::VALIDATE_PATH_PREFIX,
            admission::VALIDATED_KINDS
                .map(str::to_ascii_lowercase)
                .join(", ")
        ),
    )
}

fn text(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::{ReviewError, review};

    const V1ALPHA1: &str = "infrastructure.cluster.x-k8s.io/v1alpha1";
    const V1ALPHA2: &str = "infrastructure.cluster.x-k8s.io/v1alpha2";

    fn machine(name: &str, version: &str) -> Value {
        json!({"apiVersion": version, "kind": "ProxmoxMachine",
               "metadata": {"name": name, "namespace": "default"}, "spec": {}})
    }

    fn body(objects: &[Value]) -> Vec<u8> {
        serde_json::to_vec(&json!({
            "apiVersion": "apiextensions.k8s.io/v1",
            "kind": "ConversionReview",
            "request": {"uid": "1234-abcd", "desiredAPIVersion": V1ALPHA1, "objects": objects}
        }))
        .expect("JSON")
    }

    /// Converts by rewriting `apiVersion` only.
    fn relabel(object: Value, desired: &str) -> Result<Value, String> {
        let mut object = object;
        object["apiVersion"] = json!(desired);
        Ok(object)
    }

    fn answer(body: &[u8], convert: &dyn Fn(Value, &str) -> Result<Value, String>) -> Value {
        serde_json::to_value(review(body, convert).expect("a review")).expect("JSON")
    }

    #[test]
    fn every_object_is_converted_in_order_and_the_uid_is_echoed() {
        let objects = [
            machine("a", V1ALPHA2),
            machine("b", V1ALPHA2),
            machine("c", V1ALPHA1),
        ];
        let answer = answer(&body(&objects), &relabel);
        assert_eq!(answer["apiVersion"], "apiextensions.k8s.io/v1");
        assert_eq!(answer["kind"], "ConversionReview");
        assert!(answer.get("request").is_none(), "{answer}");
        let response = &answer["response"];
        assert_eq!(response["uid"], "1234-abcd");
        assert_eq!(response["result"], json!({"status": "Success"}));
        let converted = response["convertedObjects"].as_array().expect("a list");
        let names: Vec<&str> = converted
            .iter()
            .filter_map(|o| o["metadata"]["name"].as_str())
            .collect();
        assert_eq!(names, ["a", "b", "c"]);
        assert!(converted.iter().all(|o| o["apiVersion"] == V1ALPHA1));
    }

    #[test]
    fn an_empty_request_succeeds_with_no_objects() {
        let answer = answer(&body(&[]), &relabel);
        assert_eq!(answer["response"]["result"]["status"], "Success");
        assert_eq!(answer["response"]["convertedObjects"], json!([]));
    }

    #[test]
    fn one_failing_object_fails_the_review_and_is_named() {
        let objects = [machine("good", V1ALPHA2), machine("bad", V1ALPHA2)];
        let convert = |object: Value, desired: &str| {
            if object["metadata"]["name"] == "bad" {
                Err("spec.zone has no v1alpha1 equivalent".to_owned())
            } else {
                relabel(object, desired)
            }
        };
        let answer = answer(&body(&objects), &convert);
        let response = &answer["response"];
        assert_eq!(response["uid"], "1234-abcd");
        assert_eq!(response["result"]["status"], "Failure");
        let message = response["result"]["message"].as_str().expect("a message");
        for expected in [
            "ProxmoxMachine default/bad",
            "object 2 of 2",
            V1ALPHA1,
            "spec.zone has no v1alpha1 equivalent",
        ] {
            assert!(
                message.contains(expected),
                "{expected:?} not in {message:?}"
            );
        }
        assert_eq!(response["convertedObjects"], json!([]));
    }

    #[test]
    fn a_converter_that_returns_the_wrong_version_fails_the_review() {
        let answer = answer(&body(&[machine("a", V1ALPHA2)]), &|object, _| Ok(object));
        let message = answer["response"]["result"]["message"]
            .as_str()
            .expect("a message");
        assert!(message.contains("returned apiVersion"), "{message}");
    }

    #[test]
    fn capmox_converter_passes_same_version_objects_through() {
        let converter = super::capmox_converter();
        let objects = [machine("a", V1ALPHA1)];
        let answer = answer(&body(&objects), &*converter);
        assert_eq!(answer["response"]["result"]["status"], "Success");
        assert_eq!(answer["response"]["convertedObjects"], json!(objects));
    }

    #[test]
    fn malformed_bodies_are_refused_with_a_reason() {
        assert!(matches!(
            review(b"{not json", &relabel),
            Err(ReviewError::Malformed(_))
        ));
        let no_request =
            json!({"apiVersion": "apiextensions.k8s.io/v1", "kind": "ConversionReview"});
        assert!(matches!(
            review(&serde_json::to_vec(&no_request).expect("JSON"), &relabel),
            Err(ReviewError::NoRequest)
        ));
        let admission = json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                               "request": {"uid": "1", "desiredAPIVersion": V1ALPHA1, "objects": []}});
        let error = review(&serde_json::to_vec(&admission).expect("JSON"), &relabel)
            .expect_err("not a ConversionReview");
        assert!(error.to_string().contains("AdmissionReview"), "{error}");
        let no_uid = json!({"apiVersion": "apiextensions.k8s.io/v1", "kind": "ConversionReview",
                            "request": {"desiredAPIVersion": V1ALPHA1, "objects": []}});
        let error = review(&serde_json::to_vec(&no_uid).expect("JSON"), &relabel)
            .expect_err("uid is required");
        assert!(error.to_string().contains("uid"), "{error}");
    }

    #[test]
    fn objects_are_described_by_kind_namespace_and_name() {
        assert_eq!(
            super::describe(&machine("m", V1ALPHA1)),
            "ProxmoxMachine default/m"
        );
        assert_eq!(super::describe(&json!({})), "<no kind> <unnamed>");
    }
}
