//! The simulator's HTTP(S) front: token auth, routing of `/api2/json/...`, body
//! decoding (query, form, JSON, multipart), Proxmox-style envelopes and errors,
//! seeded fault injection, request log and per-endpoint counters.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use serde_json::{Value, json};
use tokio::time::Instant;

use super::profile::{ApiModel, RequestTiming};
use super::state::{Cluster, SimError, TaskQuery};
use super::topology::{FaultConfig, SimOptions};

/// Largest accepted request body (uploads included).
const MAX_BODY: usize = 64 << 20;

/// One handled request, for tests and benchmarks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoggedRequest {
    /// HTTP method.
    pub method: String,
    /// Path below `/api2/json`, percent-decoded.
    pub path: String,
    /// Endpoint template, e.g. `GET /nodes/{node}/qemu/{vmid}/config` (`?` if unknown).
    pub endpoint: String,
    /// Parameter names sent (query and body), sorted.
    pub params: Vec<String>,
    /// Response status (0 = connection dropped).
    pub status: u16,
    /// When it waited for and held an API worker (realistic profile only).
    pub timing: Option<RequestTiming>,
}

/// Per-endpoint counters.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SimCounters {
    /// Requests.
    pub calls: u64,
    /// Non-2xx answers and dropped connections.
    pub errors: u64,
    /// Time the requests waited for an API worker (realistic profile).
    pub queued: Duration,
    /// Time API workers spent on the requests (realistic profile).
    pub served: Duration,
}

/// Deterministic RNG (splitmix64) for fault injection; public so a test that plans its own
/// faults draws them the same way, with no extra dependency.
#[derive(Debug)]
pub struct Rng(u64);

impl Rng {
    /// The generator for `seed`: the same seed gives the same sequence.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }
    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// State shared by all connections.
pub(crate) struct Shared {
    pub cluster: Mutex<Cluster>,
    pub opts: SimOptions,
    pub faults: Mutex<FaultConfig>,
    pub rng: Mutex<Rng>,
    pub log: Mutex<VecDeque<LoggedRequest>>,
    pub counters: Mutex<BTreeMap<String, SimCounters>>,
    /// Set while the simulated cluster is unreachable: every request is dropped unanswered.
    pub offline: std::sync::atomic::AtomicBool,
    /// The nodes' API workers and request latency (realistic profile).
    pub api: Option<ApiModel>,
}

impl Shared {
    fn record(&self, entry: LoggedRequest) {
        {
            let mut c = self.counters.lock().unwrap_or_else(|p| p.into_inner());
            let e = c.entry(entry.endpoint.clone()).or_default();
            e.calls += 1;
            if !(200..300).contains(&entry.status) {
                e.errors += 1;
            }
            if let Some(timing) = &entry.timing {
                e.queued += timing.queued();
                e.served += timing.served();
            }
        }
        let mut log = self.log.lock().unwrap_or_else(|p| p.into_inner());
        if log.len() >= self.opts.request_log_capacity.max(1) {
            log.pop_front();
        }
        log.push_back(entry);
    }
}

/// A response before encoding.
enum Reply {
    Data(Value),
    DataWithTotal(Value, usize),
    Error(SimError),
    /// Authentication failures: empty body.
    Unauthorized(String),
}

/// The dropped-connection marker: returning an error from the service makes hyper close the socket.
#[derive(Debug)]
pub(crate) struct Dropped;

impl std::fmt::Display for Dropped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("connection dropped by fault injection")
    }
}

impl std::error::Error for Dropped {}

/// Serves one request.
pub(crate) async fn handle(
    shared: Arc<Shared>,
    req: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Dropped> {
    if shared.offline.load(std::sync::atomic::Ordering::SeqCst) {
        return Err(Dropped);
    }
    let arrived = Instant::now();
    let method = req.method().clone();
    let raw_path = req.uri().path().to_string();
    let query = req.uri().query().unwrap_or_default().to_string();
    let headers = req.headers().clone();
    let body = match Limited::new(req.into_body(), MAX_BODY).collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => {
            return Ok(encode(
                &shared.opts,
                Reply::Error(SimError {
                    status: 501,
                    reason: "for data too large".into(),
                    errors: BTreeMap::new(),
                }),
            ));
        }
    };
    let decoded = percent_encoding::percent_decode_str(&raw_path)
        .decode_utf8_lossy()
        .into_owned();
    let Some(path) = decoded.strip_prefix("/api2/json") else {
        return Ok(encode(
            &shared.opts,
            Reply::Error(SimError {
                status: 501,
                reason: format!("Unknown format in '{decoded}'"),
                errors: BTreeMap::new(),
            }),
        ));
    };
    let path = if path.is_empty() { "/" } else { path }.to_string();
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let endpoint = endpoint_template(&method, &segs);
    // Held until the answer is ready: the worker is busy for the whole request.
    let (timing, _worker) = match &shared.api {
        Some(api) => {
            let (timing, worker) =
                take_worker(&shared, api, &method, &segs, &endpoint, arrived).await;
            (Some(timing), worker)
        }
        None => (None, None),
    };
    let timing = timing.as_ref();

    // Parameters: body (form, JSON or multipart handled per route), query overrides body.
    let content_type = headers
        .get(hyper::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    let mut params: Vec<(String, String)> = Vec::new();
    if !body.is_empty() && method == Method::GET {
        let reply = Reply::Error(SimError {
            status: 501,
            reason: "Unexpected content for method 'GET'".into(),
            errors: BTreeMap::new(),
        });
        return Ok(finish(
            &shared, &method, &path, &endpoint, &params, reply, timing,
        ));
    }
    if content_type.starts_with("application/x-www-form-urlencoded") {
        params.extend(form_urlencoded::parse(&body).map(|(k, v)| (k.into_owned(), v.into_owned())));
    } else if content_type.starts_with("application/json")
        && !body.is_empty()
        && let Ok(Value::Object(map)) = serde_json::from_slice::<Value>(&body)
    {
        {
            for (k, v) in map {
                match v {
                    Value::Array(items) => {
                        params.extend(items.into_iter().map(|i| (k.clone(), scalar(i))))
                    }
                    other => params.push((k, scalar(other))),
                }
            }
        }
    }
    let query_params: Vec<(String, String)> = form_urlencoded::parse(query.as_bytes())
        .map(|(k, v)| (k.into_owned(), v.into_owned()))
        .collect();
    for (k, v) in query_params {
        params.retain(|(pk, _)| *pk != k);
        params.push((k, v));
    }

    // Auth first, like pveproxy.
    if let Some(reason) = check_auth(&shared.opts, &headers) {
        return Ok(finish(
            &shared,
            &method,
            &path,
            &endpoint,
            &params,
            Reply::Unauthorized(reason),
            timing,
        ));
    }

    // Permissions: a denied privilege gives 403 with the ACL path, like pvedaemon.
    if let Some(rule) = shared
        .opts
        .denied
        .iter()
        .find(|r| r.endpoint == "*" || r.endpoint == endpoint)
    {
        let acl = match segs.as_slice() {
            ["nodes", _, "qemu", id, ..] => format!("/vms/{id}"),
            ["nodes", _, "storage", st, ..] => format!("/storage/{st}"),
            ["nodes", _, "hardware", ..] => "/".to_string(),
            ["cluster", "mapping", "pci", id] => format!("/mapping/pci/{id}"),
            ["nodes", n, ..] => format!("/nodes/{n}"),
            ["pools", ..] => "/pool".to_string(),
            _ => "/".to_string(),
        };
        let reply = Reply::Error(SimError {
            status: 403,
            reason: format!("Permission check failed ({acl}, {})", rule.privilege),
            errors: BTreeMap::new(),
        });
        return Ok(finish(
            &shared, &method, &path, &endpoint, &params, reply, timing,
        ));
    }

    // Fault injection (seeded): latency, dropped connections, injected errors, lock contention.
    let rule = shared
        .faults
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .rules
        .iter()
        .find(|r| r.endpoint == "*" || r.endpoint == endpoint)
        .cloned();
    if let Some(rule) = rule {
        let (drop, error, lock) = {
            let mut rng = shared.rng.lock().unwrap_or_else(|p| p.into_inner());
            (
                rng.next_f64() < rule.drop_rate,
                rng.next_f64() < rule.error_rate,
                rng.next_f64() < rule.lock_contention_rate,
            )
        };
        if rule.latency_ms > 0 {
            tokio::time::sleep(Duration::from_millis(rule.latency_ms)).await;
        }
        if drop {
            shared.record(LoggedRequest {
                method: method.to_string(),
                path: path.clone(),
                endpoint: endpoint.clone(),
                params: param_names(&params),
                status: 0,
                timing: timing.cloned(),
            });
            return Err(Dropped);
        }
        if error {
            let reply = Reply::Error(SimError {
                status: rule.error_status,
                reason: rule.error_reason.clone(),
                errors: BTreeMap::new(),
            });
            return Ok(finish(
                &shared, &method, &path, &endpoint, &params, reply, timing,
            ));
        }
        if lock {
            let id = segs.get(3).copied().unwrap_or("0");
            let reply = Reply::Error(SimError::e500(format!(
                "can't lock file '/var/lock/qemu-server/lock-{id}.conf' - got timeout"
            )));
            return Ok(finish(
                &shared, &method, &path, &endpoint, &params, reply, timing,
            ));
        }
    }

    let reply = if content_type.starts_with("multipart/form-data") {
        let upload = Upload {
            headers: &headers,
            content_type: &content_type,
            body: &body,
        };
        route_upload(&shared, &method, &segs, upload, timing)
    } else {
        route(&shared, &method, &segs, &params, timing)
    };
    Ok(finish(
        &shared, &method, &path, &endpoint, &params, reply, timing,
    ))
}

/// Waits for a worker of the pool that serves the request and holds it for the request's
/// drawn latency; the worker is free again when the returned permit is dropped (`None` only if
/// the pool was closed, which never happens).
async fn take_worker(
    shared: &Shared,
    api: &ApiModel,
    method: &Method,
    segs: &[&str],
    endpoint: &str,
    arrived: Instant,
) -> (RequestTiming, Option<tokio::sync::OwnedSemaphorePermit>) {
    let (pool, workers) = api.pool_of(method.as_str(), segs);
    let worker = workers.acquire_owned().await.ok();
    let started = Instant::now();
    let guests = if endpoint == "GET /cluster/resources" {
        shared
            .cluster
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .vm_count()
    } else {
        0
    };
    tokio::time::sleep(api.latency(method.as_str(), segs, endpoint, guests)).await;
    let timing = RequestTiming {
        pool,
        arrived,
        started,
        ended: Instant::now(),
    };
    (timing, worker)
}

fn scalar(v: Value) -> String {
    match v {
        Value::String(s) => s,
        Value::Bool(b) => if b { "1" } else { "0" }.to_string(),
        other => other.to_string(),
    }
}

fn param_names(params: &[(String, String)]) -> Vec<String> {
    let mut names: Vec<String> = params.iter().map(|(k, _)| k.clone()).collect();
    names.sort();
    names.dedup();
    names
}

fn finish(
    shared: &Shared,
    method: &Method,
    path: &str,
    endpoint: &str,
    params: &[(String, String)],
    reply: Reply,
    timing: Option<&RequestTiming>,
) -> Response<Full<Bytes>> {
    let resp = encode(&shared.opts, reply);
    shared.record(LoggedRequest {
        method: method.to_string(),
        path: path.to_string(),
        endpoint: endpoint.to_string(),
        params: param_names(params),
        status: resp.status().as_u16(),
        timing: timing.cloned(),
    });
    resp
}

fn check_auth(opts: &SimOptions, headers: &hyper::HeaderMap) -> Option<String> {
    let Some(value) = headers
        .get(hyper::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
    else {
        return Some("No ticket".to_string());
    };
    let Some(rest) = value
        .strip_prefix("PVEAPIToken=")
        .or_else(|| value.strip_prefix("PVEAPIToken "))
    else {
        return Some("No ticket".to_string());
    };
    let rest = rest.split(';').next().unwrap_or_default();
    let rest = percent_encoding::percent_decode_str(rest).decode_utf8_lossy();
    let Some((id, secret)) = rest.rsplit_once('=') else {
        return Some("invalid token value!".to_string());
    };
    if id != opts.token_id {
        let user = id.split('!').next().unwrap_or_default();
        return Some(format!(
            "no such token '{}' for user '{user}'",
            id.split('!').nth(1).unwrap_or_default()
        ));
    }
    // compare without early exit
    let a = secret.as_bytes();
    let b = opts.token_secret.as_bytes();
    let same = a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0;
    (!same).then(|| "invalid token value!".to_string())
}

fn encode(opts: &SimOptions, reply: Reply) -> Response<Full<Bytes>> {
    let (status, reason, body) = match reply {
        Reply::Data(v) => (200, None, json!({"data": v}).to_string()),
        Reply::DataWithTotal(v, total) => {
            (200, None, json!({"data": v, "total": total}).to_string())
        }
        Reply::Unauthorized(reason) => (401, Some(reason), String::new()),
        Reply::Error(e) => {
            let mut body = json!({"data": null});
            if !e.errors.is_empty() {
                body["errors"] = json!(
                    e.errors
                        .iter()
                        .map(|(k, v)| (k.clone(), Value::String(format!("{v}\n"))))
                        .collect::<serde_json::Map<_, _>>()
                );
            }
            // the reason phrase is the message's first line; the body keeps all of it
            let (first, _) = e.reason.split_once('\n').unwrap_or((e.reason.as_str(), ""));
            let first = first.to_string();
            if opts.error_message_field {
                let msg = if e.errors.is_empty() {
                    format!("{}\n", e.reason)
                } else {
                    let details: Vec<String> =
                        e.errors.iter().map(|(k, v)| format!("{k}: {v}")).collect();
                    format!("{}\n{}\n", e.reason, details.join("\n"))
                };
                body["message"] = json!(msg);
            }
            (e.status, Some(first), body.to_string())
        }
    };
    let mut resp = Response::new(Full::new(Bytes::from(body)));
    *resp.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    if let Some(reason) = reason {
        // The reason phrase carries the error text, exactly like pveproxy.
        let clean: String = reason
            .chars()
            .filter(|c| *c != '\r' && *c != '\n')
            .collect();
        if let Ok(p) = hyper::ext::ReasonPhrase::try_from(clean.into_bytes()) {
            resp.extensions_mut().insert(p);
        }
    }
    resp.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json;charset=UTF-8"),
    );
    resp
}

/// The endpoint template for counters, matching the client's templates.
pub(crate) fn endpoint_template(method: &Method, segs: &[&str]) -> String {
    let t = match segs {
        ["version"] => "/version".to_string(),
        ["nodes"] => "/nodes".to_string(),
        ["nodes", _, "status"] => "/nodes/{node}/status".to_string(),
        ["cluster", "ha", kind @ ("resources" | "groups" | "rules")] => {
            format!("/cluster/ha/{kind}")
        }
        ["cluster", "ha", "resources", _] => "/cluster/ha/resources/{sid}".to_string(),
        ["cluster", "ha", "resources", _, "migrate"] => {
            "/cluster/ha/resources/{sid}/migrate".to_string()
        }
        ["cluster", "ha", "groups", _] => "/cluster/ha/groups/{group}".to_string(),
        ["cluster", "ha", "rules", _] => "/cluster/ha/rules/{rule}".to_string(),
        ["cluster", "ha", "status", "current"] => "/cluster/ha/status/current".to_string(),
        ["cluster", "mapping", "pci"] => "/cluster/mapping/pci".to_string(),
        ["cluster", "mapping", "pci", _] => "/cluster/mapping/pci/{id}".to_string(),
        ["nodes", _, "hardware", "pci"] => "/nodes/{node}/hardware/pci".to_string(),
        ["cluster", x] => format!("/cluster/{x}"),
        ["pools"] => "/pools".to_string(),
        ["nodes", _, "qemu"] => "/nodes/{node}/qemu".to_string(),
        ["nodes", _, "lxc"] => "/nodes/{node}/lxc".to_string(),
        ["nodes", _, "qemu", _] => "/nodes/{node}/qemu/{vmid}".to_string(),
        ["nodes", _, "qemu", _, rest @ ..] => {
            format!("/nodes/{{node}}/qemu/{{vmid}}/{}", rest.join("/"))
        }
        ["nodes", _, "storage"] => "/nodes/{node}/storage".to_string(),
        ["nodes", _, "storage", _, "content"] => {
            "/nodes/{node}/storage/{storage}/content".to_string()
        }
        ["nodes", _, "storage", _, "content", ..] => {
            "/nodes/{node}/storage/{storage}/content/{volume}".to_string()
        }
        ["nodes", _, "storage", _, "upload"] => {
            "/nodes/{node}/storage/{storage}/upload".to_string()
        }
        ["nodes", _, "tasks"] => "/nodes/{node}/tasks".to_string(),
        ["nodes", _, "tasks", _, x] => format!("/nodes/{{node}}/tasks/{{upid}}/{x}"),
        _ => "?".to_string(),
    };
    format!("{method} {t}")
}

/// Every (method, path template) the simulator serves, for the conformance test.
pub const SIM_ROUTES: &[(&str, &str)] = &[
    ("GET", "/version"),
    ("GET", "/nodes"),
    ("GET", "/nodes/{node}/status"),
    ("GET", "/cluster/resources"),
    ("GET", "/cluster/nextid"),
    ("GET", "/cluster/status"),
    ("GET", "/nodes/{node}/qemu"),
    ("GET", "/nodes/{node}/lxc"),
    ("GET", "/nodes/{node}/qemu/{vmid}/config"),
    ("POST", "/nodes/{node}/qemu/{vmid}/config"),
    ("PUT", "/nodes/{node}/qemu/{vmid}/config"),
    ("POST", "/nodes/{node}/qemu/{vmid}/clone"),
    ("PUT", "/nodes/{node}/qemu/{vmid}/resize"),
    ("GET", "/nodes/{node}/qemu/{vmid}/status/current"),
    ("POST", "/nodes/{node}/qemu/{vmid}/status/start"),
    ("POST", "/nodes/{node}/qemu/{vmid}/status/stop"),
    ("POST", "/nodes/{node}/qemu/{vmid}/status/shutdown"),
    ("POST", "/nodes/{node}/qemu/{vmid}/status/resume"),
    ("POST", "/nodes/{node}/qemu/{vmid}/status/reboot"),
    ("POST", "/nodes/{node}/qemu/{vmid}/status/reset"),
    ("DELETE", "/nodes/{node}/qemu/{vmid}"),
    ("GET", "/nodes/{node}/storage"),
    ("GET", "/nodes/{node}/storage/{storage}/content"),
    ("POST", "/nodes/{node}/storage/{storage}/upload"),
    ("GET", "/nodes/{node}/storage/{storage}/content/{volume}"),
    ("DELETE", "/nodes/{node}/storage/{storage}/content/{volume}"),
    ("POST", "/nodes/{node}/qemu/{vmid}/agent/ping"),
    ("GET", "/nodes/{node}/qemu/{vmid}/agent/get-osinfo"),
    (
        "GET",
        "/nodes/{node}/qemu/{vmid}/agent/network-get-interfaces",
    ),
    ("POST", "/nodes/{node}/qemu/{vmid}/agent/exec"),
    ("GET", "/nodes/{node}/qemu/{vmid}/agent/exec-status"),
    ("GET", "/nodes/{node}/qemu/{vmid}/agent/file-read"),
    ("GET", "/nodes/{node}/tasks"),
    ("GET", "/nodes/{node}/tasks/{upid}/status"),
    ("GET", "/nodes/{node}/tasks/{upid}/log"),
    ("GET", "/pools"),
    ("POST", "/pools"),
    ("PUT", "/pools"),
    ("GET", "/cluster/ha/resources"),
    ("POST", "/cluster/ha/resources"),
    ("GET", "/cluster/ha/resources/{sid}"),
    ("PUT", "/cluster/ha/resources/{sid}"),
    ("DELETE", "/cluster/ha/resources/{sid}"),
    ("POST", "/cluster/ha/resources/{sid}/migrate"),
    ("GET", "/cluster/ha/groups"),
    ("POST", "/cluster/ha/groups"),
    ("GET", "/cluster/ha/groups/{group}"),
    ("PUT", "/cluster/ha/groups/{group}"),
    ("DELETE", "/cluster/ha/groups/{group}"),
    ("GET", "/cluster/ha/status/current"),
    ("GET", "/cluster/mapping/pci"),
    ("GET", "/cluster/mapping/pci/{id}"),
    ("GET", "/nodes/{node}/hardware/pci"),
];

/// The routes the simulator serves only when it reports PVE 9 or later (HA rules); as
/// PVE 8 it answers them `501 Method '... /cluster/ha/rules...' not implemented`, like a
/// real PVE 8 does.
pub const SIM_ROUTES_PVE9: &[(&str, &str)] = &[
    ("GET", "/cluster/ha/rules"),
    ("POST", "/cluster/ha/rules"),
    ("GET", "/cluster/ha/rules/{rule}"),
    ("PUT", "/cluster/ha/rules/{rule}"),
    ("DELETE", "/cluster/ha/rules/{rule}"),
];

fn not_implemented(method: &Method, segs: &[&str]) -> Reply {
    Reply::Error(SimError {
        status: 501,
        reason: format!("Method '{method} /{}' not implemented", segs.join("/")),
        errors: BTreeMap::new(),
    })
}

/// The parameters of `GET /nodes/{node}/tasks`, checked as Proxmox checks them.
fn task_query<'a>(get: &impl Fn(&str) -> Option<&'a str>) -> Result<TaskQuery, SimError> {
    let number = |key: &str| -> Result<Option<u64>, SimError> {
        get(key)
            .map(|v| {
                v.parse::<u64>()
                    .map_err(|_| SimError::param(key, "value does not look like a valid integer"))
            })
            .transpose()
    };
    let mut query = TaskQuery::default();
    if let Some(source) = get("source") {
        if !["archive", "active", "all"].contains(&source) {
            return Err(SimError::param(
                "source",
                format!(
                    "value '{source}' does not have a value in the enumeration 'archive, active, all'"
                ),
            ));
        }
        query.source = source.to_owned();
    }
    query.since = number("since")?;
    query.until = number("until")?;
    query.vmid = get("vmid")
        .map(|v| vmid_of(v).map(|v| v.to_string()))
        .transpose()?;
    query.typefilter = get("typefilter").map(str::to_owned);
    query.errors = matches!(get("errors"), Some("1" | "true"));
    query.start = number("start")?.map_or(0, |v| v as usize);
    query.limit = number("limit")?.map_or(query.limit, |v| v as usize);
    Ok(query)
}

fn vmid_of(s: &str) -> Result<u32, SimError> {
    s.parse::<u32>()
        .ok()
        .filter(|v| (100..=999_999_999).contains(v))
        .ok_or_else(|| {
            SimError::param(
                "vmid",
                "invalid format - value does not look like a valid VM ID",
            )
        })
}

fn route(
    shared: &Shared,
    method: &Method,
    segs: &[&str],
    params: &[(String, String)],
    timing: Option<&RequestTiming>,
) -> Reply {
    let now = Instant::now();
    let mut c = shared.cluster.lock().unwrap_or_else(|p| p.into_inner());
    c.advance(now);
    c.set_serving(timing.cloned());
    let map: BTreeMap<String, String> = params.iter().cloned().collect();
    let get = |k: &str| map.get(k).map(String::as_str);
    let result: Result<Reply, SimError> = (|| {
        let m = method.as_str();
        Ok(match (m, segs) {
            ("GET", ["version"]) => Reply::Data(c.version()),
            ("GET", ["nodes"]) => Reply::Data(c.nodes()),
            ("GET", ["nodes", n, "status"]) => Reply::Data(c.node_status(n)?),
            ("GET", ["cluster", "resources"]) => {
                Reply::Data(c.cluster_resources(now, get("type"))?)
            }
            ("GET", ["cluster", "nextid"]) => Reply::Data(c.next_id(get("vmid"))?),
            ("GET", ["cluster", "status"]) => Reply::Data(c.cluster_status()),
            ("GET", ["cluster", "mapping", "pci"]) => {
                Reply::Data(c.pci_mappings(get("check-node"))?)
            }
            ("GET", ["cluster", "mapping", "pci", id]) => Reply::Data(c.pci_mapping(id)?),
            ("GET", ["nodes", n, "hardware", "pci"]) => {
                Reply::Data(c.node_pci(n, get("pci-class-blacklist"), get("verbose"))?)
            }
            ("GET", ["nodes", n, "qemu"]) => Reply::Data(c.list_vms(n)?),
            ("GET", ["nodes", n, "lxc"]) => Reply::Data(c.list_containers(n)?),
            ("GET", ["nodes", n, "qemu", id, "config"]) => {
                Reply::Data(c.vm_config(n, vmid_of(id)?)?)
            }
            ("POST" | "PUT", ["nodes", n, "qemu", id, "config"]) => {
                let upid = c.update_config(now, n, vmid_of(id)?, &map, m == "POST")?;
                Reply::Data(upid.map(|u| json!(u.as_str())).unwrap_or(Value::Null))
            }
            ("POST", ["nodes", n, "qemu", id, "clone"]) => {
                Reply::Data(json!(c.clone_vm(now, n, vmid_of(id)?, &map)?.as_str()))
            }
            ("PUT", ["nodes", n, "qemu", id, "resize"]) => {
                Reply::Data(json!(c.resize(now, n, vmid_of(id)?, &map)?.as_str()))
            }
            ("GET", ["nodes", n, "qemu", id, "status", "current"]) => {
                Reply::Data(c.vm_status(now, n, vmid_of(id)?)?)
            }
            (
                "POST",
                [
                    "nodes",
                    n,
                    "qemu",
                    id,
                    "status",
                    action @ ("start" | "stop" | "shutdown" | "resume"),
                ],
            ) => Reply::Data(json!(c.power(now, n, vmid_of(id)?, action)?.as_str())),
            ("POST", ["nodes", n, "qemu", id, "status", "reboot"]) => {
                Reply::Data(json!(c.reboot(now, n, vmid_of(id)?, &map)?.as_str()))
            }
            ("POST", ["nodes", n, "qemu", id, "status", "reset"]) => {
                Reply::Data(json!(c.reset(now, n, vmid_of(id)?, &map)?.as_str()))
            }
            ("DELETE", ["nodes", n, "qemu", id]) => {
                let purge = match get("purge") {
                    None | Some("0") => false,
                    Some("1") => true,
                    Some(other) => {
                        return Err(SimError::param(
                            "purge",
                            format!("type check ('boolean') failed - got '{other}'"),
                        ));
                    }
                };
                Reply::Data(json!(c.delete_vm(now, n, vmid_of(id)?, purge)?.as_str()))
            }
            ("GET" | "POST" | "PUT" | "DELETE", ["cluster", "ha", rest @ ..]) => {
                return route_ha(&mut c, now, method, segs, rest, &map);
            }
            ("GET", ["nodes", n, "storage"]) => Reply::Data(c.list_storage(n, get("content"))?),
            ("GET", ["nodes", n, "storage", s, "content"]) => {
                Reply::Data(c.storage_content(n, s, get("content"), get("vmid"))?)
            }
            ("GET", ["nodes", n, "storage", s, "content", rest @ ..]) if !rest.is_empty() => {
                Reply::Data(c.volume_attributes(n, s, &rest.join("/"))?)
            }
            ("DELETE", ["nodes", n, "storage", s, "content", rest @ ..]) if !rest.is_empty() => {
                Reply::Data(json!(c.delete_volume(now, n, s, &rest.join("/"))?.as_str()))
            }
            ("POST", ["nodes", _, "storage", _, "upload"]) => Reply::Error(SimError {
                status: 506,
                reason: "upload 'Content-Type 'application/x-www-form-urlencoded'' not implemented"
                    .into(),
                errors: BTreeMap::new(),
            }),
            ("POST", ["nodes", n, "qemu", id, "agent", "ping"]) => {
                Reply::Data(c.agent_ping(now, n, vmid_of(id)?)?)
            }
            ("GET", ["nodes", n, "qemu", id, "agent", "get-osinfo"]) => {
                Reply::Data(c.agent_osinfo(now, n, vmid_of(id)?)?)
            }
            ("GET", ["nodes", n, "qemu", id, "agent", "network-get-interfaces"]) => {
                Reply::Data(c.agent_interfaces(now, n, vmid_of(id)?)?)
            }
            ("POST", ["nodes", n, "qemu", id, "agent", "exec"]) => {
                let cmd: Vec<String> = params
                    .iter()
                    .filter(|(k, _)| k == "command")
                    .map(|(_, v)| v.clone())
                    .collect();
                Reply::Data(c.agent_exec(now, n, vmid_of(id)?, &cmd)?)
            }
            ("GET", ["nodes", n, "qemu", id, "agent", "exec-status"]) => {
                Reply::Data(c.agent_exec_status(now, n, vmid_of(id)?, get("pid"))?)
            }
            ("GET", ["nodes", n, "qemu", id, "agent", "file-read"]) => {
                Reply::Data(c.agent_file_read(now, n, vmid_of(id)?, get("file"))?)
            }
            ("GET", ["nodes", n, "tasks"]) => {
                let (tasks, total) = c.node_tasks(n, &task_query(&get)?)?;
                Reply::DataWithTotal(tasks, total)
            }
            ("GET", ["nodes", n, "tasks", upid, "status"]) => Reply::Data(c.task_status(n, upid)?),
            ("GET", ["nodes", n, "tasks", upid, "log"]) => {
                let start = get("start").and_then(|s| s.parse().ok()).unwrap_or(0);
                let limit = get("limit").and_then(|s| s.parse().ok()).unwrap_or(50);
                let (lines, total) = c.task_log(n, upid, start, limit)?;
                Reply::DataWithTotal(lines, total)
            }
            ("GET", ["pools"]) => Reply::Data(c.pools(now, get("poolid"))?),
            ("POST", ["pools"]) => {
                let id = get("poolid").ok_or_else(|| {
                    SimError::param("poolid", "property is missing and it is not optional")
                })?;
                c.create_pool(id, get("comment"))?;
                Reply::Data(Value::Null)
            }
            ("PUT", ["pools"]) => {
                let id = get("poolid").ok_or_else(|| {
                    SimError::param("poolid", "property is missing and it is not optional")
                })?;
                c.update_pool(id, get("vms"), get("delete") == Some("1"))?;
                Reply::Data(Value::Null)
            }
            _ => not_implemented(method, segs),
        })
    })();
    c.set_serving(None);
    result.unwrap_or_else(Reply::Error)
}

/// `/cluster/ha/...`: the path parameter joins the others, as in the API schema.
fn route_ha(
    c: &mut Cluster,
    now: Instant,
    method: &Method,
    segs: &[&str],
    rest: &[&str],
    map: &BTreeMap<String, String>,
) -> Result<Reply, SimError> {
    let mut p = map.clone();
    let with = |p: &mut BTreeMap<String, String>, k: &str, v: &str| {
        p.insert(k.to_string(), v.to_string());
    };
    let v = match (method.as_str(), rest) {
        ("GET", ["resources"]) => c.ha_list_resources(&p)?,
        ("POST", ["resources"]) => c.ha_create_resource(now, &p)?,
        ("POST", ["resources", sid, "migrate"]) => {
            with(&mut p, "sid", sid);
            c.ha_migrate(now, &p)?
        }
        (m, ["resources", sid]) => {
            with(&mut p, "sid", sid);
            match m {
                "GET" => c.ha_get_resource(&p)?,
                "PUT" => c.ha_update_resource(now, &p)?,
                "DELETE" => c.ha_delete_resource(&p)?,
                _ => return Ok(not_implemented(method, segs)),
            }
        }
        ("GET", ["groups"]) => c.ha_list_groups(&p)?,
        ("POST", ["groups"]) => c.ha_create_group(&p)?,
        (m, ["groups", g]) => {
            with(&mut p, "group", g);
            match m {
                "GET" => c.ha_get_group(&p)?,
                "PUT" => c.ha_update_group(&p)?,
                "DELETE" => c.ha_delete_group(&p)?,
                _ => return Ok(not_implemented(method, segs)),
            }
        }
        (_, ["rules", ..]) if c.pve_major() < 9 => return Ok(not_implemented(method, segs)),
        ("GET", ["rules"]) => c.ha_list_rules(&p)?,
        ("POST", ["rules"]) => c.ha_create_rule(&p)?,
        (m, ["rules", r]) => {
            with(&mut p, "rule", r);
            match m {
                "GET" => c.ha_get_rule(&p)?,
                "PUT" => c.ha_update_rule(&p)?,
                "DELETE" => c.ha_delete_rule(&p)?,
                _ => return Ok(not_implemented(method, segs)),
            }
        }
        ("GET", ["status", "current"]) => c.ha_status_current(&p)?,
        _ => return Ok(not_implemented(method, segs)),
    };
    Ok(Reply::Data(v))
}

/// A multipart request as it came.
struct Upload<'a> {
    headers: &'a hyper::HeaderMap,
    content_type: &'a str,
    body: &'a [u8],
}

/// Upload: strict like pve-http-server's streaming parser (Content-Length required,
/// `content` part first, optional checksum parts, then the `filename` file part).
fn route_upload(
    shared: &Shared,
    method: &Method,
    segs: &[&str],
    upload: Upload,
    timing: Option<&RequestTiming>,
) -> Reply {
    let Upload {
        headers,
        content_type,
        body,
    } = upload;
    let (node, storage) = match (method.as_str(), segs) {
        ("POST", ["nodes", n, "storage", s, "upload"]) => (n.to_string(), s.to_string()),
        _ => {
            return Reply::Error(SimError {
                status: 506,
                reason: format!("upload 'Content-Type '{content_type}'' not implemented"),
                errors: BTreeMap::new(),
            });
        }
    };
    if headers.get(hyper::header::CONTENT_LENGTH).is_none() {
        return Reply::Error(SimError {
            status: 501,
            reason: "upload without content length is not supported".into(),
            errors: BTreeMap::new(),
        });
    }
    let parts = match parse_multipart(content_type, body) {
        Ok(p) => p,
        Err(e) => {
            return Reply::Error(SimError {
                status: 400,
                reason: format!("invalid multipart body: {e}"),
                errors: BTreeMap::new(),
            });
        }
    };
    let names: Vec<&str> = parts.iter().map(|p| p.name.as_str()).collect();
    let order_ok = matches!(
        names.as_slice(),
        ["content", "filename"] | ["content", "checksum-algorithm", "checksum", "filename"]
    );
    if !order_ok {
        return Reply::Error(SimError::param(
            "filename",
            format!(
                "unexpected multipart fields {names:?}; expected content, [checksum-algorithm, checksum,] filename"
            ),
        ));
    }
    let content = String::from_utf8_lossy(&parts[0].data).trim().to_string();
    let Some(file) = parts.last() else {
        return Reply::Error(SimError::param("filename", "missing file part"));
    };
    let Some(filename) = file.filename.clone() else {
        return Reply::Error(SimError::param(
            "filename",
            "file part has no filename attribute",
        ));
    };
    let now = Instant::now();
    let mut c = shared.cluster.lock().unwrap_or_else(|p| p.into_inner());
    c.advance(now);
    c.set_serving(timing.cloned());
    let uploaded = c.upload(now, &node, &storage, &content, &filename, file.data.clone());
    c.set_serving(None);
    match uploaded {
        Ok(upid) => Reply::Data(json!(upid.as_str())),
        Err(e) => Reply::Error(e),
    }
}

struct Part {
    name: String,
    filename: Option<String>,
    data: Vec<u8>,
}

fn find(hay: &[u8], needle: &[u8], from: usize) -> Option<usize> {
    if needle.is_empty() || hay.len() < needle.len() {
        return None;
    }
    (from..=hay.len() - needle.len()).find(|&i| &hay[i..i + needle.len()] == needle)
}

fn parse_multipart(content_type: &str, body: &[u8]) -> Result<Vec<Part>, &'static str> {
    let boundary = content_type
        .split(';')
        .filter_map(|p| p.trim().strip_prefix("boundary="))
        .next()
        .ok_or("no boundary")?
        .trim_matches('"');
    let delim = format!("--{boundary}");
    let mut parts = Vec::new();
    let mut pos = find(body, delim.as_bytes(), 0).ok_or("no first boundary")? + delim.len();
    loop {
        if body.get(pos..pos + 2) == Some(b"--") {
            break;
        }
        pos += 2; // CRLF after boundary
        let head_end = find(body, b"\r\n\r\n", pos).ok_or("part headers not terminated")?;
        let head = String::from_utf8_lossy(&body[pos..head_end]).into_owned();
        let data_start = head_end + 4;
        let next = find(body, format!("\r\n{delim}").as_bytes(), data_start)
            .ok_or("part not terminated")?;
        let mut name = None;
        let mut filename = None;
        for line in head.lines() {
            if line
                .to_ascii_lowercase()
                .starts_with("content-disposition:")
            {
                for attr in line.split(';').skip(1) {
                    let attr = attr.trim();
                    if let Some(v) = attr.strip_prefix("name=") {
                        name = Some(v.trim_matches('"').to_string());
                    } else if let Some(v) = attr.strip_prefix("filename=") {
                        filename = Some(v.trim_matches('"').to_string());
                    }
                }
            }
        }
        parts.push(Part {
            name: name.ok_or("part without name")?,
            filename,
            data: body[data_start..next].to_vec(),
        });
        pos = next + 2 + delim.len();
    }
    Ok(parts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rng_is_deterministic() {
        let mut a = Rng::new(7);
        let mut b = Rng::new(7);
        let xs: Vec<f64> = (0..5).map(|_| a.next_f64()).collect();
        let ys: Vec<f64> = (0..5).map(|_| b.next_f64()).collect();
        assert_eq!(xs, ys);
        assert!(xs.iter().all(|x| (0.0..1.0).contains(x)));
        let mut c = Rng::new(8);
        assert_ne!(xs[0], c.next_f64());
    }

    #[test]
    fn multipart_parser() {
        let body = b"--XX\r\nContent-Disposition: form-data; name=\"content\"\r\n\r\niso\r\n--XX\r\nContent-Disposition: form-data; name=\"filename\"; filename=\"a.iso\"\r\nContent-Type: application/octet-stream\r\n\r\nDATA\r\n--XX--\r\n";
        let parts = parse_multipart("multipart/form-data; boundary=XX", body).expect("parses");
        assert_eq!(parts.len(), 2);
        assert_eq!(parts[0].name, "content");
        assert_eq!(parts[0].data, b"iso");
        assert_eq!(parts[1].filename.as_deref(), Some("a.iso"));
        assert_eq!(parts[1].data, b"DATA");
    }

    #[test]
    fn templates() {
        assert_eq!(
            endpoint_template(
                &Method::GET,
                &["nodes", "pve", "qemu", "100", "status", "current"]
            ),
            "GET /nodes/{node}/qemu/{vmid}/status/current"
        );
        assert_eq!(
            endpoint_template(
                &Method::DELETE,
                &[
                    "nodes",
                    "pve",
                    "storage",
                    "local",
                    "content",
                    "local:iso",
                    "a.iso"
                ]
            ),
            "DELETE /nodes/{node}/storage/{storage}/content/{volume}"
        );
    }
}
