//! Conversion of custom resources between versions, as apiextensions-apiserver does it:
//! strategy `None` rewrites `apiVersion` only; strategy `Webhook` posts one
//! `apiextensions.k8s.io/v1` `ConversionReview` per batch to the CRD's webhook and checks the
//! answer as the real server does (uid, result, count, apiVersion, kind, metadata).
//!
//! Conversion never runs under the store's lock: a webhook served by the same runtime (even
//! one that calls this server back) cannot deadlock it.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use serde_json::{Value, json};

use super::error::ApiError;
use super::kinds::{ConversionStrategy, KindInfo, WebhookClientConfig};
use super::store::Store;

/// How long a webhook call may take (the real server allows 30 s).
pub const WEBHOOK_TIMEOUT: Duration = Duration::from_secs(10);

/// Largest webhook answer read (bytes).
const MAX_RESPONSE: usize = 64 << 20;

fn version_of(obj: &Value) -> &str {
    obj["apiVersion"]
        .as_str()
        .map(|av| av.rsplit('/').next().unwrap_or(av))
        .unwrap_or("")
}

/// Convert one object to `version`.
pub async fn convert_one(
    store: &Store,
    kind: &KindInfo,
    obj: Value,
    version: &str,
) -> Result<Value, ApiError> {
    let mut out = convert(store, kind, vec![Arc::new(obj)], version).await?;
    Ok(out.pop().map(Arc::unwrap_or_clone).unwrap_or(Value::Null))
}

/// Convert objects to `version` in one review; objects already in it are not sent, and only
/// the converted ones are copied.
pub async fn convert(
    store: &Store,
    kind: &KindInfo,
    mut objects: Vec<Arc<Value>>,
    version: &str,
) -> Result<Vec<Arc<Value>>, ApiError> {
    let desired = kind.api_version(version);
    let todo: Vec<usize> = objects
        .iter()
        .enumerate()
        .filter(|(_, o)| o.is_object() && o["apiVersion"].as_str() != Some(desired.as_str()))
        .map(|(i, _)| i)
        .collect();
    if todo.is_empty() {
        return Ok(objects);
    }
    let cfg = match &kind.conversion {
        ConversionStrategy::None => {
            for i in todo {
                Arc::make_mut(&mut objects[i])["apiVersion"] = json!(desired);
            }
            return Ok(objects);
        }
        ConversionStrategy::Webhook(cfg) => cfg,
    };
    // As the real server names it: the group/version/kind of what is converted.
    let first = &objects[todo[0]];
    let gvk = format!(
        "{}, Kind={}",
        kind.api_version(version_of(first)),
        first["kind"].as_str().unwrap_or(&kind.kind)
    );
    let originals: Vec<&Value> = todo.iter().map(|i| &*objects[*i]).collect();
    let uid = store.new_uid();
    let review = json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "ConversionReview",
        "request": {"uid": uid, "desiredAPIVersion": desired, "objects": originals},
    });
    tracing::debug!(%gvk, %desired, objects = todo.len(), "testkit: calling conversion webhook");
    let failed =
        |e: String| ApiError::Internal(format!("conversion webhook for {gvk} failed: {e}"));
    let answer = call(store, cfg, review.to_string()).await.map_err(failed)?;
    let converted = converted_objects(&uid, &answer).map_err(failed)?;
    if converted.len() != todo.len() {
        return Err(ApiError::Internal(format!(
            "conversion webhook for {gvk} returned {} objects, expected {}",
            converted.len(),
            todo.len()
        )));
    }
    let mut results = Vec::with_capacity(todo.len());
    for (n, (i, mut out)) in todo.iter().zip(converted).enumerate() {
        // The real server reports the index after counting the object (1-based here).
        let invalid = |e: String| {
            ApiError::Internal(format!(
                "conversion webhook for {gvk} returned invalid converted object at index {}: {e}",
                n + 1
            ))
        };
        let original = &objects[*i];
        if out["apiVersion"].as_str() != Some(desired.as_str()) {
            return Err(invalid(format!(
                "invalid groupVersion (expected {desired}, received {})",
                out["apiVersion"].as_str().unwrap_or("")
            )));
        }
        if out["kind"] != original["kind"] {
            return Err(invalid(format!(
                "invalid kind (expected {}, received {})",
                original["kind"].as_str().unwrap_or(""),
                out["kind"].as_str().unwrap_or("")
            )));
        }
        for (field, what) in [("name", "name"), ("namespace", "namespace"), ("uid", "UID")] {
            let (e, a) = (
                original["metadata"][field].as_str().unwrap_or(""),
                out["metadata"][field].as_str().unwrap_or(""),
            );
            if e != a {
                return Err(invalid(format!("must have the same {what}: {e} != {a}")));
            }
        }
        restore_metadata(original, &mut out).map_err(|e| {
            ApiError::Internal(format!(
                "conversion webhook for {gvk} returned invalid metadata in object at index {}: {e}",
                n + 1
            ))
        })?;
        results.push(out);
    }
    for (i, out) in todo.into_iter().zip(results) {
        objects[i] = Arc::new(out);
    }
    Ok(objects)
}

/// Like the real server: the converted object keeps the original's metadata, except labels
/// and annotations, which the webhook may change.
fn restore_metadata(original: &Value, out: &mut Value) -> Result<(), String> {
    let converted = match out.get("metadata") {
        None | Some(Value::Null) => {
            if original.get("metadata").is_some() {
                return Err("missing metadata in converted object".into());
            }
            return Ok(());
        }
        Some(Value::Object(m)) => m.clone(),
        Some(other) => {
            return Err(format!(
                "invalid metadata of type {other} in converted object"
            ));
        }
    };
    let mut meta = original["metadata"]
        .as_object()
        .cloned()
        .unwrap_or_default();
    for field in ["labels", "annotations"] {
        match converted.get(field) {
            None | Some(Value::Null) => {
                meta.remove(field);
            }
            Some(Value::Object(m)) => {
                if let Some((k, _)) = m.iter().find(|(_, v)| !v.is_string()) {
                    return Err(format!(
                        "metadata.{field}[{k}] must be a string in converted object"
                    ));
                }
                meta.insert(field.into(), Value::Object(m.clone()));
            }
            Some(_) => return Err(format!("invalid metadata.{field} in converted object")),
        }
    }
    out["metadata"] = Value::Object(meta);
    Ok(())
}

/// The `response.convertedObjects` of a webhook's answer, checked as the real server does.
fn converted_objects(uid: &str, answer: &[u8]) -> Result<Vec<Value>, String> {
    let review: Value = serde_json::from_slice(answer)
        .map_err(|e| format!("cannot decode the webhook's answer as JSON: {e}"))?;
    let (av, k) = (
        review["apiVersion"].as_str().unwrap_or(""),
        review["kind"].as_str().unwrap_or(""),
    );
    if (av, k) != ("apiextensions.k8s.io/v1", "ConversionReview") {
        return Err(format!(
            "expected webhook response of apiextensions.k8s.io/v1, Kind=ConversionReview, got {av}, Kind={k}"
        ));
    }
    let response = &review["response"];
    if !response.is_object() {
        return Err("no response provided".into());
    }
    let got = response["uid"].as_str().unwrap_or("");
    if got != uid {
        return Err(format!("expected response.uid={uid:?}, got {got:?}"));
    }
    let result = &response["result"];
    let status = result["status"].as_str().unwrap_or("");
    if status != "Success" {
        return Err(match result["message"].as_str() {
            Some(m) if !m.is_empty() => m.to_string(),
            _ => format!("response.result.status was '{status}', not 'Success'"),
        });
    }
    Ok(response["convertedObjects"]
        .as_array()
        .cloned()
        .unwrap_or_default())
}

/// Post a review to the webhook; the error reads like Go's `Post "<url>": <cause>`.
async fn call(store: &Store, cfg: &WebhookClientConfig, body: String) -> Result<Vec<u8>, String> {
    let (url, shown) = match (&cfg.url, &cfg.service) {
        (Some(url), _) => (url.clone(), url.clone()),
        (None, Some(svc)) => {
            let path = svc.path.as_deref().unwrap_or("/");
            let shown = format!(
                "https://{}.{}.svc:{}{path}",
                svc.name, svc.namespace, svc.port
            );
            let Some(base) = store.service_route(&svc.namespace, &svc.name) else {
                return Err(format!(
                    "Post {shown:?}: service {:?} not found (the capmox testkit routes services with ApiServer::route_service)",
                    svc.name
                ));
            };
            (format!("{}{path}", base.trim_end_matches('/')), shown)
        }
        (None, None) => return Err("no webhook clientConfig".into()),
    };
    match tokio::time::timeout(WEBHOOK_TIMEOUT, post(&url, &cfg.ca_bundle, body)).await {
        Ok(Ok(answer)) => Ok(answer),
        Ok(Err(e)) => Err(format!("Post {shown:?}: {e}")),
        Err(_) => Err(format!(
            "Post {shown:?}: context deadline exceeded (no answer within {WEBHOOK_TIMEOUT:?})"
        )),
    }
}

fn tls_config(ca_bundle: &[u8]) -> Result<rustls::ClientConfig, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS setup: {e}"))?;
    if ca_bundle.is_empty() {
        let verifier = rustls_platform_verifier::Verifier::new(provider).map_err(|e| {
            format!("caBundle is empty and the platform's trusted roots cannot be loaded: {e}")
        })?;
        return Ok(builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(verifier))
            .with_no_client_auth());
    }
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca_bundle) {
        let cert = cert.map_err(|e| format!("invalid caBundle: {e}"))?;
        roots
            .add(cert)
            .map_err(|e| format!("invalid caBundle certificate: {e}"))?;
    }
    if roots.is_empty() {
        return Err("invalid caBundle: no PEM certificate in it".into());
    }
    Ok(builder.with_root_certificates(roots).with_no_client_auth())
}

/// One HTTP/1.1 POST of a JSON body (HTTPS, or plain HTTP for a service routed to an
/// `http://` URL); the answer's body when the status is 2xx.
async fn post(url: &str, ca_bundle: &[u8], body: String) -> Result<Vec<u8>, String> {
    let uri: http::Uri = url.parse().map_err(|e| format!("invalid URL: {e}"))?;
    let https = match uri.scheme_str() {
        Some("https") => true,
        Some("http") => false,
        other => return Err(format!("unsupported URL scheme {other:?}")),
    };
    let host = uri.host().ok_or("the URL has no host")?;
    let host = host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_string();
    let port = uri.port_u16().unwrap_or(if https { 443 } else { 80 });
    let tcp = tokio::net::TcpStream::connect((host.as_str(), port))
        .await
        .map_err(|e| format!("dial tcp {host}:{port}: {e}"))?;
    let request = http::Request::post(
        uri.path_and_query()
            .map(|p| p.as_str())
            .unwrap_or("/")
            .to_string(),
    )
    .header(
        http::header::HOST,
        uri.authority().map(|a| a.as_str()).unwrap_or(&host),
    )
    .header(http::header::CONTENT_TYPE, "application/json")
    .header(http::header::ACCEPT, "application/json")
    .header(http::header::USER_AGENT, "capmox-testkit/conversion")
    .body(Full::new(Bytes::from(body)))
    .map_err(|e| e.to_string())?;
    if https {
        let name = ServerName::try_from(host.clone()).map_err(|e| format!("bad host: {e}"))?;
        let connector = tokio_rustls::TlsConnector::from(Arc::new(tls_config(ca_bundle)?));
        let tls = connector
            .connect(name, tcp)
            .await
            .map_err(|e| format!("tls: {e}"))?;
        send(TokioIo::new(tls), request).await
    } else {
        send(TokioIo::new(tcp), request).await
    }
}

async fn send<IO>(io: IO, request: http::Request<Full<Bytes>>) -> Result<Vec<u8>, String>
where
    IO: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let (mut sender, conn) = hyper::client::conn::http1::handshake(io)
        .await
        .map_err(|e| e.to_string())?;
    let driver = tokio::spawn(async move {
        // The connection ends with the request; its error, if any, is the request's.
        let _ = conn.await;
    });
    let result = async {
        let resp = sender
            .send_request(request)
            .await
            .map_err(|e| e.to_string())?;
        let status = resp.status();
        let body = http_body_util::Limited::new(resp.into_body(), MAX_RESPONSE)
            .collect()
            .await
            .map_err(|e| format!("reading the answer: {e}"))?
            .to_bytes();
        if !status.is_success() {
            return Err(format!(
                "the server responded with {status}: {}",
                String::from_utf8_lossy(&body[..body.len().min(1024)])
            ));
        }
        Ok(body.to_vec())
    }
    .await;
    driver.abort();
    result
}
