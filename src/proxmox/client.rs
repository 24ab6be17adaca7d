//! The HTTP core of the Proxmox VE client: auth header, envelope decoding, error
//! classification, timeouts, retries with jitter, per-endpoint concurrency and counters.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use reqwest::header::{ACCEPT, AUTHORIZATION, HeaderValue};
use reqwest::{Method, StatusCode};
use serde::de::DeserializeOwned;
use serde_json::Value;

use super::config::{ClientConfig, RetryPolicy, endpoint_of};
use super::error::{ProxmoxError, Result};
use super::gate::RequestGate;
use super::tls;

/// Counters for one endpoint template (e.g. `GET /nodes/{node}/qemu/{vmid}/config`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EndpointStats {
    /// HTTP requests sent (each retry counts).
    pub calls: u64,
    /// Requests that ended in an error.
    pub errors: u64,
    /// Sum of latencies.
    pub total_latency: Duration,
    /// Largest latency.
    pub max_latency: Duration,
}

/// Per-endpoint counters, shared by all clones of a client.
#[derive(Debug, Default)]
pub struct Metrics {
    stats: Mutex<BTreeMap<String, EndpointStats>>,
}

impl Metrics {
    fn record(&self, endpoint: &str, latency: Duration, error: bool) {
        let mut stats = self.stats.lock().unwrap_or_else(|p| p.into_inner());
        let entry = stats.entry(endpoint.to_string()).or_default();
        entry.calls += 1;
        if error {
            entry.errors += 1;
        }
        entry.total_latency += latency;
        entry.max_latency = entry.max_latency.max(latency);
    }

    /// A copy of all counters, keyed by endpoint template.
    pub fn snapshot(&self) -> BTreeMap<String, EndpointStats> {
        self.stats.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// A request body.
pub(crate) enum Body {
    None,
    Form(Vec<(String, String)>),
    Multipart(reqwest::multipart::Form),
}

/// A request to send: endpoint template (for counters and limits) plus the concrete path.
pub(crate) struct Request {
    pub method: Method,
    pub endpoint: &'static str,
    pub path: String,
    pub query: Vec<(String, String)>,
    pub body: Body,
    pub idempotent: bool,
    pub timeout: Option<Duration>,
}

impl Request {
    pub fn get(endpoint: &'static str, path: String) -> Self {
        Self {
            method: Method::GET,
            endpoint,
            path,
            query: Vec::new(),
            body: Body::None,
            idempotent: true,
            timeout: None,
        }
    }

    pub fn new(method: Method, endpoint: &'static str, path: String) -> Self {
        let idempotent = method == Method::GET;
        Self {
            method,
            endpoint,
            path,
            query: Vec::new(),
            body: Body::None,
            idempotent,
            timeout: None,
        }
    }

    pub fn query(mut self, key: &str, value: impl ToString) -> Self {
        self.query.push((key.to_string(), value.to_string()));
        self
    }

    pub fn form(mut self, form: Vec<(String, String)>) -> Self {
        self.body = Body::Form(form);
        self
    }
}

struct Inner {
    http: reqwest::Client,
    base: String,
    /// `scheme://host:port` of the API (see [`endpoint_of`]).
    endpoint: String,
    token_id: String,
    auth: HeaderValue,
    retry: RetryPolicy,
    upload_timeout: Duration,
    gate: Arc<RequestGate>,
    metrics: Metrics,
    jitter: AtomicU64,
    fence: Fence,
}

/// Stops every write of the clients that share it once raised (reads go on), so a replica that
/// lost leadership cannot act in Proxmox beside the new leader.
#[derive(Clone, Debug, Default)]
pub struct Fence(Arc<std::sync::atomic::AtomicBool>);

impl Fence {
    /// Refuses all further writes.
    pub fn raise(&self) {
        self.0.store(true, Ordering::SeqCst);
    }

    /// Whether writes are refused.
    pub fn is_raised(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

/// Largest response body capmox reads from Proxmox; a larger one is an error, never an
/// allocation the size of whatever a broken or hostile endpoint sends.
pub const MAX_RESPONSE_BODY: usize = 16 * 1024 * 1024;

/// A Proxmox VE API client. Cheap to clone; clones share connections, limits and counters.
#[derive(Clone)]
pub struct ProxmoxClient {
    inner: Arc<Inner>,
}

impl fmt::Debug for ProxmoxClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProxmoxClient")
            .field("base", &self.inner.base)
            .field("token_id", &self.inner.token_id)
            .finish_non_exhaustive()
    }
}

impl ProxmoxClient {
    /// Builds a client. Prefer `ClientRegistry::get` so equal configs share one client.
    pub fn new(config: &ClientConfig) -> Result<Self> {
        Self::with_fence(config, Fence::default())
    }

    /// Builds a client whose writes stop once `fence` is raised.
    pub fn with_fence(config: &ClientConfig, fence: Fence) -> Result<Self> {
        Self::with_gate(config, fence, RequestGate::new(config.max_in_flight))
    }

    /// Builds a client whose requests pass `gate`, shared with every client of the same API.
    pub fn with_gate(config: &ClientConfig, fence: Fence, gate: Arc<RequestGate>) -> Result<Self> {
        let url = config.url.trim_end_matches('/');
        let parsed = reqwest::Url::parse(url).map_err(|e| {
            ProxmoxError::Config(format!(
                "URL '{url}' is invalid ({e}); use e.g. https://pve.example.com:8006"
            ))
        })?;
        if !matches!(parsed.scheme(), "https" | "http") {
            return Err(ProxmoxError::Config(format!(
                "URL '{url}' must start with https:// (or http:// for the simulator)"
            )));
        }
        let base = if url.ends_with("/api2/json") {
            url.to_string()
        } else {
            format!("{url}/api2/json")
        };
        // Plain http is only for the local simulator; the TLS config is then never used.
        let tls_config = if parsed.scheme() == "http" {
            tls::unverified_config()?
        } else {
            tls::build_client_config(&config.tls)?
        };
        let http = reqwest::Client::builder()
            .tls_backend_preconfigured(tls_config)
            .timeout(config.request_timeout)
            .connect_timeout(config.connect_timeout)
            .pool_idle_timeout(Duration::from_secs(30))
            .http1_only()
            .no_proxy()
            .build()
            .map_err(|e| ProxmoxError::Config(format!("cannot build HTTP client: {e}")))?;
        let mut auth = HeaderValue::from_str(&config.token.header_value()).map_err(|_| {
            ProxmoxError::Config(format!(
                "API token '{}' contains characters not allowed in an HTTP header",
                config.token.token_id
            ))
        })?;
        auth.set_sensitive(true);
        let seed = jitter_seed();
        Ok(Self {
            inner: Arc::new(Inner {
                http,
                endpoint: endpoint_of(url).unwrap_or_else(|| url.to_owned()),
                base,
                token_id: config.token.token_id.clone(),
                auth,
                retry: config.retry.clone(),
                upload_timeout: config.upload_timeout,
                gate,
                metrics: Metrics::default(),
                jitter: AtomicU64::new(seed | 1),
                fence,
            }),
        })
    }

    /// The Proxmox API this client talks to, as `scheme://host:port` (see [`endpoint_of`]).
    pub fn endpoint(&self) -> &str {
        &self.inner.endpoint
    }

    /// The API base URL (`.../api2/json`).
    pub fn base_url(&self) -> &str {
        &self.inner.base
    }

    /// The API token's id (`user@realm!name`, never the secret): with the URL, it tells
    /// endpoints apart, since tokens may see different parts of one cluster.
    pub fn token_id(&self) -> &str {
        &self.inner.token_id
    }

    /// Per-endpoint counters (calls, errors, latency) for metrics and benchmarks.
    pub fn metrics(&self) -> BTreeMap<String, EndpointStats> {
        self.inner.metrics.snapshot()
    }

    pub(crate) fn upload_timeout(&self) -> Duration {
        self.inner.upload_timeout
    }

    /// Next jittered back-off delay for `attempt` (1-based), ±50 % around the exponential value.
    fn backoff(&self, attempt: u32) -> Duration {
        let retry = &self.inner.retry;
        let exp = retry
            .base_delay
            .saturating_mul(1u32 << attempt.saturating_sub(1).min(16));
        let capped = exp.min(retry.max_delay);
        capped.mul_f64(0.5 + jitter_fraction(&self.inner.jitter))
    }

    /// Sends a request and decodes `data` into `T`, retrying idempotent requests on transient errors.
    pub(crate) async fn send<T: DeserializeOwned>(&self, mut req: Request) -> Result<T> {
        let attempts = if req.idempotent {
            self.inner.retry.max_attempts.max(1)
        } else {
            1
        };
        let mut attempt = 0;
        loop {
            attempt += 1;
            // Multipart bodies cannot be cloned; uploads are never retried.
            let body = match &req.body {
                Body::None => Body::None,
                Body::Form(f) => Body::Form(f.clone()),
                Body::Multipart(_) => std::mem::replace(&mut req.body, Body::None),
            };
            let result = self.send_once(&req, body).await;
            match result {
                Err(e) if e.is_retryable() && attempt < attempts => {
                    let delay = self.backoff(attempt);
                    tracing::debug!(endpoint = req.endpoint, attempt, ?delay, error = %e, "retrying Proxmox request");
                    tokio::time::sleep(delay).await;
                }
                Err(e) => return Err(e),
                Ok(body) => return decode_data(&body, req.endpoint),
            }
        }
    }

    /// One attempt: the body of a successful answer, undecoded.
    async fn send_once(&self, req: &Request, body: Body) -> Result<Vec<u8>> {
        if req.method != Method::GET && self.inner.fence.is_raised() {
            return Err(ProxmoxError::Fenced);
        }
        let permit = self
            .inner
            .gate
            .enter(&req.method, &req.path)
            .await
            .ok_or_else(|| ProxmoxError::Transient {
                status: None,
                reason: "client is shutting down".to_string(),
            })?;
        let url = format!("{}{}", self.inner.base, req.path);
        let mut builder = self
            .inner
            .http
            .request(req.method.clone(), &url)
            .header(AUTHORIZATION, self.inner.auth.clone())
            .header(ACCEPT, "application/json");
        if !req.query.is_empty() {
            builder = builder.query(&req.query);
        }
        if let Some(t) = req.timeout {
            builder = builder.timeout(t);
        }
        builder = match body {
            Body::None => builder,
            Body::Form(form) => builder.form(&form),
            Body::Multipart(form) => builder.multipart(form),
        };
        let started = Instant::now();
        let result = self.exchange(builder, req.endpoint).await;
        drop(permit);
        let latency = started.elapsed();
        self.inner
            .metrics
            .record(req.endpoint, latency, result.is_err());
        if let Err(e) = &result {
            tracing::debug!(endpoint = req.endpoint, path = %req.path, error = %e, "Proxmox request failed");
        }
        result
    }

    async fn exchange(&self, builder: reqwest::RequestBuilder, endpoint: &str) -> Result<Vec<u8>> {
        let resp = builder.send().await.map_err(transport_error)?;
        let status = resp.status();
        let retry_after = retry_after(resp.headers());
        let phrase = resp
            .extensions()
            .get::<hyper::ext::ReasonPhrase>()
            .map(|p| String::from_utf8_lossy(p.as_bytes()).into_owned());
        let bytes = read_bounded(resp, endpoint).await?;
        if status.is_success() {
            return Ok(bytes);
        }
        Err(error_from_parts(status, phrase.as_deref(), &bytes).with_retry_after(retry_after))
    }
}

/// The response body, refused once it exceeds [`MAX_RESPONSE_BODY`] (by its announced length or
/// while it streams in).
async fn read_bounded(mut resp: reqwest::Response, endpoint: &str) -> Result<Vec<u8>> {
    let too_large = || ProxmoxError::Decode {
        endpoint: endpoint.to_string(),
        message: format!(
            "response body larger than {} MiB; is the URL a Proxmox VE API?",
            MAX_RESPONSE_BODY / (1024 * 1024)
        ),
    };
    if resp
        .content_length()
        .is_some_and(|length| length > MAX_RESPONSE_BODY as u64)
    {
        return Err(too_large());
    }
    let mut body = Vec::new();
    while let Some(chunk) = resp.chunk().await.map_err(transport_error)? {
        if body.len() + chunk.len() > MAX_RESPONSE_BODY {
            return Err(too_large());
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

/// A non-zero seed for [`jitter_fraction`], from the clock.
pub(crate) fn jitter_seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0x9E37_79B9_7F4A_7C15)
        | 1
}

/// The next pseudo-random fraction in [0, 1) from `state` (xorshift64*): it only spreads
/// retries of many callers apart, so its quality is irrelevant.
pub(crate) fn jitter_fraction(state: &AtomicU64) -> f64 {
    let mut x = state.load(Ordering::Relaxed);
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    state.store(x, Ordering::Relaxed);
    let r = x.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11;
    (r as f64) / ((1u64 << 53) as f64)
}

/// The longest `Retry-After` honoured: a server asking for more (or for centuries) is waited
/// on this long, so a proxy's odd header cannot park a machine for good or overflow a clock.
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(15 * 60);

/// The `Retry-After` of a response: delay-seconds or an HTTP date (RFC 9110 §10.2.3), at most
/// [`MAX_RETRY_AFTER`].
pub(crate) fn retry_after(headers: &reqwest::header::HeaderMap) -> Option<Duration> {
    let value = headers
        .get(reqwest::header::RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim();
    let wait = if let Ok(seconds) = value.parse::<u64>() {
        Duration::from_secs(seconds)
    } else {
        let at = k8s_openapi::jiff::fmt::rfc2822::parse(value).ok()?;
        let wait = at
            .timestamp()
            .duration_since(k8s_openapi::jiff::Timestamp::now());
        // A date in the past means "now".
        Duration::try_from(wait).unwrap_or(Duration::ZERO)
    };
    Some(wait.min(MAX_RETRY_AFTER))
}

/// The `data` of a Proxmox answer decoded straight into `T` (no JSON tree in between: a
/// listing of thousands of VMs is decoded on every refresh); an answer without `data` decodes
/// as `null`.
fn decode_data<T: DeserializeOwned>(body: &[u8], endpoint: &str) -> Result<T> {
    let decode_error = |message: String| ProxmoxError::Decode {
        endpoint: endpoint.to_string(),
        message,
    };
    let envelope: Envelope<T> = serde_json::from_slice(body).map_err(|e| match e.classify() {
        serde_json::error::Category::Syntax | serde_json::error::Category::Eof => {
            decode_error(format!("body is not JSON: {e}"))
        }
        _ => decode_error(e.to_string()),
    })?;
    match envelope.0 {
        Some(data) => Ok(data),
        None => T::deserialize(Value::Null).map_err(|e| decode_error(e.to_string())),
    }
}

/// A Proxmox answer's envelope: `{"data": ...}`, other members ignored.
struct Envelope<T>(Option<T>);

impl<'de, T: DeserializeOwned> serde::Deserialize<'de> for Envelope<T> {
    fn deserialize<D: serde::Deserializer<'de>>(
        deserializer: D,
    ) -> std::result::Result<Self, D::Error> {
        struct EnvelopeVisitor<T>(std::marker::PhantomData<T>);
        impl<'de, T: DeserializeOwned> serde::de::Visitor<'de> for EnvelopeVisitor<T> {
            type Value = Envelope<T>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an object with 'data'")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> std::result::Result<Self::Value, A::Error> {
                let mut data = None;
                while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
                    if key == "data" {
                        data = Some(map.next_value::<T>()?);
                    } else {
                        map.next_value::<serde::de::IgnoredAny>()?;
                    }
                }
                Ok(Envelope(data))
            }
        }
        deserializer.deserialize_map(EnvelopeVisitor(std::marker::PhantomData))
    }
}

fn transport_error(e: reqwest::Error) -> ProxmoxError {
    // reqwest errors carry the URL, which never contains the secret (it is only in a header).
    let what = if e.is_timeout() {
        "request timed out"
    } else if e.is_connect() {
        "cannot connect"
    } else {
        "connection error"
    };
    let mut reason = format!("{what}: {e}");
    let mut source = std::error::Error::source(&e);
    while let Some(s) = source {
        reason.push_str(&format!(": {s}"));
        source = s.source();
    }
    // A certificate the trust settings reject will not get better by retrying.
    if reason.contains("invalid peer certificate") || reason.contains("InvalidCertificate") {
        return ProxmoxError::Config(format!(
            "TLS verification of the Proxmox VE server failed ({reason}); trust its CA (CA bundle) or pin its SHA-256 fingerprint"
        ));
    }
    ProxmoxError::Transient {
        status: None,
        reason,
    }
}

/// Classifies an error response from its status, reason phrase and body (JSON or not).
pub fn error_from_parts(status: StatusCode, phrase: Option<&str>, body: &[u8]) -> ProxmoxError {
    let json: Option<Value> = serde_json::from_slice(body).ok();
    let message = json
        .as_ref()
        .and_then(|v| v.get("message"))
        .and_then(Value::as_str)
        .map(|m| m.trim().to_string())
        .filter(|m| !m.is_empty());
    let mut errors = BTreeMap::new();
    if let Some(Value::Object(map)) = json.as_ref().and_then(|v| v.get("errors")) {
        for (k, v) in map {
            let text = match v {
                Value::String(s) => s.trim().to_string(),
                other => other.to_string(),
            };
            errors.insert(k.clone(), text);
        }
    }
    let plain_body = json
        .is_none()
        .then(|| super::error::body_excerpt(status.as_u16(), body))
        .flatten();
    let phrase = phrase.map(str::trim).filter(|p| !p.is_empty());
    let reason = phrase
        .map(str::to_string)
        .or(message)
        .or(plain_body)
        .or_else(|| status.canonical_reason().map(str::to_string))
        .unwrap_or_default();
    ProxmoxError::from_response(status.as_u16(), &reason, errors)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_decode_their_data_and_say_what_is_wrong_with_the_rest() {
        #[derive(serde::Deserialize, Debug, PartialEq)]
        struct Vm {
            vmid: u32,
        }
        let endpoint = "GET /cluster/resources";
        let vms: Vec<Vm> = decode_data(
            br#"{"total":2,"data":[{"vmid":100},{"vmid":101,"extra":[1,{"a":null}]}]}"#,
            endpoint,
        )
        .unwrap();
        assert_eq!(vms, [Vm { vmid: 100 }, Vm { vmid: 101 }]);
        // Without `data` (or with a null one) the answer reads as null.
        assert_eq!(
            decode_data::<Option<Vm>>(br#"{"success":1}"#, endpoint).unwrap(),
            None
        );
        assert_eq!(
            decode_data::<Option<Vm>>(br#"{"data":null}"#, endpoint).unwrap(),
            None
        );
        let message = |body: &[u8]| match decode_data::<Vec<Vm>>(body, endpoint) {
            Err(ProxmoxError::Decode {
                endpoint: e,
                message,
            }) => {
                assert_eq!(e, endpoint);
                message
            }
            other => panic!("expected a decode error, got {other:?}"),
        };
        assert!(message(b"<html>login</html>").starts_with("body is not JSON"));
        assert!(message(br#"{"data":[{"vmid":1}"#).starts_with("body is not JSON"));
        assert!(message(br#"[{"vmid":1}]"#).contains("an object with 'data'"));
        assert!(message(br#"{"data":[{"vmid":"x"}]}"#).contains("invalid type"));
        assert!(message(br#"{"total":0}"#).contains("invalid type: null"));
    }

    #[test]
    fn error_body_variants() {
        let e = error_from_parts(
            StatusCode::INTERNAL_SERVER_ERROR,
            None,
            br#"{"data":null,"message":"Configuration file 'nodes/pve/qemu-server/100.conf' does not exist\n"}"#,
        );
        assert!(e.is_not_found());
        assert!(e.reason().is_some_and(|r| r.ends_with("does not exist")));
        let e = error_from_parts(StatusCode::UNAUTHORIZED, Some("No ticket"), b"");
        assert_eq!(e.reason(), Some("No ticket"));
        let e = error_from_parts(StatusCode::NOT_IMPLEMENTED, None, b"Method not implemented");
        assert!(matches!(e, ProxmoxError::Api { status: 501, .. }));
        assert_eq!(e.reason(), Some("Method not implemented"));
    }

    #[test]
    fn retry_after_is_read_as_seconds_or_a_date() {
        let mut headers = reqwest::header::HeaderMap::new();
        assert_eq!(retry_after(&headers), None);
        headers.insert(
            reqwest::header::RETRY_AFTER,
            HeaderValue::from_static("120"),
        );
        assert_eq!(retry_after(&headers), Some(Duration::from_secs(120)));
        for huge in ["18446744073709551615", "100000000"] {
            headers.insert(reqwest::header::RETRY_AFTER, HeaderValue::from_static(huge));
            assert_eq!(retry_after(&headers), Some(MAX_RETRY_AFTER), "{huge}");
        }
        headers.insert(
            reqwest::header::RETRY_AFTER,
            HeaderValue::from_static("Fri, 31 Dec 2100 23:59:59 GMT"),
        );
        assert_eq!(retry_after(&headers), Some(MAX_RETRY_AFTER), "a far date");
        let soon =
            k8s_openapi::jiff::Timestamp::now() + k8s_openapi::jiff::SignedDuration::from_secs(30);
        let date = k8s_openapi::jiff::fmt::rfc2822::to_string(
            &soon.to_zoned(k8s_openapi::jiff::tz::TimeZone::UTC),
        )
        .expect("date")
        .replace("+0000", "GMT");
        headers.insert(
            reqwest::header::RETRY_AFTER,
            HeaderValue::from_str(&date).expect("header"),
        );
        let wait = retry_after(&headers).expect(&date);
        assert!(
            wait > Duration::from_secs(27) && wait <= Duration::from_secs(30),
            "{date}: {wait:?}"
        );
        headers.insert(
            reqwest::header::RETRY_AFTER,
            HeaderValue::from_static("Wed, 21 Oct 2015 07:28:00 GMT"),
        );
        assert_eq!(retry_after(&headers), Some(Duration::ZERO), "a past date");
        headers.insert(
            reqwest::header::RETRY_AFTER,
            HeaderValue::from_static("soon"),
        );
        assert_eq!(retry_after(&headers), None);
    }

    #[tokio::test]
    async fn backoff_is_jittered_and_capped() {
        let token = super::super::config::ApiToken::parse("root@pam!ab=s").expect("token");
        let mut cfg = ClientConfig::new("http://127.0.0.1:1", token);
        cfg.retry.base_delay = Duration::from_millis(100);
        cfg.retry.max_delay = Duration::from_millis(400);
        let client = ProxmoxClient::new(&cfg).expect("client");
        let mut seen = std::collections::BTreeSet::new();
        for attempt in 1..10 {
            let d = client.backoff(attempt);
            assert!(
                d >= Duration::from_millis(50) && d <= Duration::from_millis(600),
                "{d:?}"
            );
            seen.insert(d);
        }
        assert!(seen.len() > 1, "no jitter");
    }
}
