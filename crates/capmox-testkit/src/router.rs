//! HTTP routing: parses Kubernetes API paths and query parameters, dispatches to the
//! [`Store`], renders objects, lists, tables, discovery documents and watch streams.

use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method, Request, Response, StatusCode, header};
use http_body::{Frame, SizeHint};
use serde_json::{Value, json};
use tokio::sync::{broadcast, mpsc};

use super::convert;
use super::error::ApiError;
use super::kinds::KindInfo;
use super::selector::{FieldSelector, LabelSelector, Selectors};
use super::store::{
    ClientRequest, DeleteOptions, EventType, FaultKind, PatchKind, RequestInfo, Staged, Store, Sub,
    Versioned, WatchRecord, WriteOptions,
};

/// Header naming the client an HTTP request is attributed to (in-process clients of
/// [`crate::ApiServer::client_named`] carry [`ClientName`] instead; without either, the
/// product token of the `User-Agent` names it).
pub const CLIENT_HEADER: &str = "x-testkit-client";

/// The client an in-process request is attributed to (a request extension).
#[derive(Clone, Debug)]
pub struct ClientName(pub Arc<str>);

fn client_name<'a>(extensions: &'a http::Extensions, headers: &'a HeaderMap) -> Option<&'a str> {
    extensions
        .get::<ClientName>()
        .map(|c| &*c.0)
        .or_else(|| headers.get(CLIENT_HEADER).and_then(|v| v.to_str().ok()))
        .filter(|s| !s.is_empty())
        .or_else(|| user_agent_product(headers))
}

/// The product token of the `User-Agent` (`kubectl` of `kubectl/v1.33.0 (linux/amd64) ...`),
/// which a real API server also takes as the default field manager.
fn user_agent_product(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(header::USER_AGENT)
        .and_then(|v| v.to_str().ok())
        .and_then(|ua| ua.split(['/', ' ']).next())
        .filter(|s| !s.is_empty())
}

/// Response body: a complete buffer, or a stream of newline-delimited watch events.
pub struct ResponseBody(BodyInner);

enum BodyInner {
    Full(Option<Bytes>),
    Stream(mpsc::Receiver<Bytes>),
}

impl ResponseBody {
    fn full(b: impl Into<Bytes>) -> Self {
        ResponseBody(BodyInner::Full(Some(b.into())))
    }

    /// A body holding the `Status` of an error.
    pub(crate) fn from_status(e: &ApiError) -> Self {
        Self::full(e.to_status().to_string())
    }
}

impl http_body::Body for ResponseBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match &mut self.get_mut().0 {
            BodyInner::Full(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            BodyInner::Stream(rx) => rx.poll_recv(cx).map(|o| o.map(|b| Ok(Frame::data(b)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self.0, BodyInner::Full(None))
    }

    fn size_hint(&self) -> SizeHint {
        match &self.0 {
            BodyInner::Full(Some(b)) => SizeHint::with_exact(b.len() as u64),
            BodyInner::Full(None) => SizeHint::with_exact(0),
            BodyInner::Stream(_) => SizeHint::default(),
        }
    }
}

fn json_response(code: StatusCode, body: &impl serde::Serialize) -> Response<ResponseBody> {
    // Serializing JSON values and the list envelope below cannot fail (string keys only).
    let bytes = serde_json::to_vec(body).unwrap_or_default();
    let mut resp = Response::new(ResponseBody::full(bytes));
    *resp.status_mut() = code;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    resp
}

fn error_response(e: &ApiError) -> Response<ResponseBody> {
    let code = StatusCode::from_u16(e.code()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    json_response(code, &e.to_status())
}

/// Serve one request against the store.
pub async fn handle(store: Arc<Store>, req: Request<Bytes>) -> Response<ResponseBody> {
    let (parts, body) = req.into_parts();
    let query: HashMap<String, String> = parts
        .uri
        .query()
        .map(|q| form_urlencoded::parse(q.as_bytes()).into_owned().collect())
        .unwrap_or_default();
    let path = parts.uri.path().to_string();
    let segs: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    tracing::trace!(method = %parts.method, %path, "testkit request");
    let non_resource = matches!(
        segs.as_slice(),
        ["version" | "healthz" | "readyz" | "livez" | "api" | "apis"]
            | ["api", "v1"]
            | ["apis", _]
            | ["apis", _, _]
    );
    let client = client_name(&parts.extensions, &parts.headers).map(str::to_owned);
    if non_resource && let Some(client) = &client {
        store.count_client(
            client,
            ClientRequest {
                group: String::new(),
                resource: path.clone(),
                subresource: None,
                verb: parts.method.as_str().to_ascii_lowercase(),
                namespace: None,
            },
        );
    }
    let result = match segs.as_slice() {
        ["version"] => {
            store.count(client.as_deref(), "", "discovery");
            Ok(json_response(
                StatusCode::OK,
                &json!({"major": "1", "minor": "33", "gitVersion": "v1.33.0-capmox-testkit", "platform": "linux/amd64"}),
            ))
        }
        ["healthz" | "readyz" | "livez"] => {
            let mut resp = Response::new(ResponseBody::full("ok"));
            resp.headers_mut().insert(
                header::CONTENT_TYPE,
                header::HeaderValue::from_static("text/plain"),
            );
            Ok(resp)
        }
        ["api"] => {
            store.count(client.as_deref(), "", "discovery");
            Ok(json_response(
                StatusCode::OK,
                &json!({"kind": "APIVersions", "versions": ["v1"],
                    "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": "127.0.0.1"}]}),
            ))
        }
        ["apis"] => {
            store.count(client.as_deref(), "", "discovery");
            Ok(json_response(StatusCode::OK, &group_list(&store)))
        }
        ["api", "v1"] => {
            store.count(client.as_deref(), "", "discovery");
            Ok(json_response(
                StatusCode::OK,
                &resource_list(&store, "", "v1"),
            ))
        }
        ["apis", g] => {
            store.count(client.as_deref(), "", "discovery");
            group_list(&store)["groups"]
                .as_array()
                .and_then(|gs| gs.iter().find(|x| x["name"] == *g).cloned())
                .map(|mut x| {
                    x["kind"] = json!("APIGroup");
                    x["apiVersion"] = json!("v1");
                    json_response(StatusCode::OK, &x)
                })
                .ok_or(ApiError::NoRoute)
        }
        ["apis", g, v] => {
            store.count(client.as_deref(), "", "discovery");
            let l = resource_list(&store, g, v);
            if l["resources"].as_array().is_some_and(|r| r.is_empty()) {
                Err(ApiError::NoRoute)
            } else {
                Ok(json_response(StatusCode::OK, &l))
            }
        }
        ["api", "v1", rest @ ..] => {
            resource(
                &store,
                "",
                "v1",
                rest,
                &parts.method,
                &parts.headers,
                client.as_deref(),
                &query,
                body,
            )
            .await
        }
        ["apis", g, v, rest @ ..] => {
            resource(
                &store,
                g,
                v,
                rest,
                &parts.method,
                &parts.headers,
                client.as_deref(),
                &query,
                body,
            )
            .await
        }
        _ => Err(ApiError::NoRoute),
    };
    result.unwrap_or_else(|e| error_response(&e))
}

/// Kubernetes version priority: GA before beta before alpha, higher numbers first
/// (`v2 > v1 > v1beta2 > v1beta1 > v1alpha1`), as the API server orders group versions.
fn version_priority(v: &str) -> (u8, u64, u64) {
    let rest = v.strip_prefix('v').unwrap_or(v);
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    let major = digits.parse().unwrap_or(0);
    let tail = &rest[digits.len()..];
    let (tier, minor) = if tail.is_empty() {
        (3, 0)
    } else if let Some(n) = tail.strip_prefix("beta") {
        (2, n.parse().unwrap_or(0))
    } else if let Some(n) = tail.strip_prefix("alpha") {
        (1, n.parse().unwrap_or(0))
    } else {
        (0, 0)
    };
    (tier, major, minor)
}

fn group_list(store: &Store) -> Value {
    let mut groups: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for k in store.kinds() {
        if k.group.is_empty() {
            continue;
        }
        let entry = groups.entry(k.group.clone()).or_default();
        for v in &k.versions {
            if !entry.contains(v) {
                entry.push(v.clone());
            }
        }
    }
    let groups: Vec<Value> = groups
        .into_iter()
        .map(|(g, mut versions)| {
            versions.sort_by_key(|v| std::cmp::Reverse(version_priority(v)));
            let pref = versions.first().cloned().unwrap_or_default();
            json!({
                "name": g,
                "versions": versions.iter().map(|v| json!({"groupVersion": format!("{g}/{v}"), "version": v})).collect::<Vec<_>>(),
                "preferredVersion": {"groupVersion": format!("{g}/{pref}"), "version": pref},
            })
        })
        .collect();
    json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": groups})
}

fn resource_list(store: &Store, group: &str, version: &str) -> Value {
    let resources: Vec<Value> = store
        .kinds()
        .iter()
        .filter(|k| k.group == group && k.versions.iter().any(|v| v == version))
        .flat_map(|k| k.for_version(version).api_resources())
        .collect();
    let gv = if group.is_empty() {
        version.to_string()
    } else {
        format!("{group}/{version}")
    };
    json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": resources})
}

fn set_version(obj: &mut Value, kind: &KindInfo, version: &str) {
    if obj.is_object() {
        obj["apiVersion"] = json!(kind.api_version(version));
    }
}

/// [`set_version`] for a shared object, copied only when its version differs.
fn set_shared_version(obj: &mut Arc<Value>, kind: &KindInfo, version: &str) {
    let wanted = kind.api_version(version);
    if obj.is_object() && obj["apiVersion"].as_str() != Some(wanted.as_str()) {
        Arc::make_mut(obj)["apiVersion"] = json!(wanted);
    }
}

/// A list response.
#[derive(serde::Serialize)]
struct ListBody<'a> {
    #[serde(rename = "apiVersion")]
    api_version: String,
    kind: &'a str,
    metadata: Value,
    items: Vec<&'a Value>,
}

/// Label and field selectors of a request; built-in kinds accept field selectors on any
/// path (real built-ins support a per-kind list, e.g. Events' `involvedObject.*` that
/// `kubectl describe` uses), custom resources only `metadata.name`/`metadata.namespace`.
fn selectors(query: &HashMap<String, String>, kind: &KindInfo) -> Result<Selectors, ApiError> {
    let fields = query.get("fieldSelector").map(String::as_str).unwrap_or("");
    Ok(Selectors {
        labels: LabelSelector::parse(query.get("labelSelector").map(String::as_str).unwrap_or(""))?,
        fields: if kind.custom {
            FieldSelector::parse(fields)?
        } else {
            FieldSelector::parse_any_field(fields)?
        },
    })
}

fn parse_body(body: &Bytes) -> Result<Value, ApiError> {
    if body.starts_with(b"k8s\0") {
        return Err(ApiError::UnsupportedMediaType(
            "application/json, application/yaml (the capmox testkit does not decode protobuf)"
                .into(),
        ));
    }
    serde_json::from_slice(body).or_else(|_| {
        serde_norway::from_slice(body)
            .map_err(|e| ApiError::BadRequest(format!("invalid request body: {e}")))
    })
}

/// A create or update body in the request's version: `apiVersion` defaults to it and must
/// not name another version, as on a real server.
fn request_body(body: &Bytes, kind: &KindInfo, version: &str) -> Result<Value, ApiError> {
    let mut obj = parse_body(body)?;
    if obj.is_object() {
        let expected = kind.api_version(version);
        match obj["apiVersion"].as_str() {
            None | Some("") => obj["apiVersion"] = json!(expected),
            Some(av) if av == expected => {}
            Some(av) => {
                return Err(ApiError::BadRequest(format!(
                    "the API version in the data ({av}) does not match the expected API version ({expected})"
                )));
            }
        }
    }
    Ok(obj)
}

/// A server-side apply must be written in the request's version, as on a real server.
fn check_apply_version(body: &Bytes, kind: &KindInfo, version: &str) -> Result<(), ApiError> {
    let Ok(applied) = parse_body(body) else {
        return Ok(()); // the store reports the syntax error
    };
    let expected = kind.api_version(version);
    match applied["apiVersion"].as_str() {
        Some(av) if av != expected && av.rsplit_once('/').map_or("", |(g, _)| g) == kind.group => {
            Err(ApiError::BadRequest(format!(
                "Incorrect version specified in apply patch. Specified patch version: {av}, expected: {expected}"
            )))
        }
        _ => Ok(()),
    }
}

/// Convert stored objects to the request's version when it is not the storage version.
async fn to_version(
    store: &Store,
    kind: &KindInfo,
    version: &str,
    objects: Vec<Arc<Value>>,
) -> Result<Vec<Arc<Value>>, ApiError> {
    if !kind.needs_conversion(version) {
        return Ok(objects);
    }
    convert::convert(store, kind, objects, version).await
}

/// [`to_version`] for one owned object.
async fn one_to_version(
    store: &Store,
    kind: &KindInfo,
    version: &str,
    obj: Value,
) -> Result<Value, ApiError> {
    if !kind.needs_conversion(version) {
        return Ok(obj);
    }
    convert::convert_one(store, kind, obj, version).await
}

/// A write in a version other than the storage version, as the real server's
/// `GuaranteedUpdate`: read the stored object and convert it to the request's version, let
/// the store compute and validate the new object from it, convert that to the storage version
/// and commit it if nothing changed meanwhile (else start over). No lock is held while a
/// webhook converts.
async fn versioned_write(
    store: &Store,
    kind: &KindInfo,
    version: &str,
    target: Option<(&str, &str)>,
    stage: impl Fn(&Versioned) -> Result<Staged, ApiError>,
) -> Result<Value, ApiError> {
    for _ in 0..64 {
        let old = match target {
            Some((ns, name)) => match store.get(kind, ns, name) {
                Ok(o) => Some(o),
                Err(ApiError::NotFound { .. }) => None,
                Err(e) => return Err(e),
            },
            None => None,
        };
        let old = match old {
            Some(o) => {
                let mut o = convert::convert_one(store, kind, o, version).await?;
                if let Some(m) = o["metadata"].as_object_mut() {
                    m.remove("managedFields");
                }
                Some(o)
            }
            None => None,
        };
        let ver = Versioned {
            version: version.to_string(),
            old,
        };
        match stage(&ver)? {
            Staged::Done(v) => return Ok(v),
            Staged::Retry => continue,
            Staged::Convert(pending) => {
                let converted = convert::convert_one(
                    store,
                    kind,
                    pending.object.clone(),
                    kind.storage_version(),
                )
                .await?;
                if let Some(view) = store.commit_staged(kind, pending, converted)? {
                    return convert::convert_one(store, kind, view, version).await;
                }
            }
        }
    }
    Err(ApiError::Conflict {
        message: format!(
            "Operation cannot be fulfilled on {}: the object kept changing during conversion; please try again",
            kind.group_resource().qualified()
        ),
    })
}

fn write_options(query: &HashMap<String, String>, headers: &HeaderMap) -> WriteOptions {
    let manager = query
        .get("fieldManager")
        .cloned()
        .unwrap_or_else(|| user_agent_product(headers).unwrap_or("unknown").to_string());
    WriteOptions {
        manager,
        force: query.get("force").is_some_and(|f| f == "true"),
        dry_run: query.get("dryRun").is_some_and(|d| d == "All"),
    }
}

#[allow(clippy::too_many_arguments)]
async fn resource(
    store: &Arc<Store>,
    group: &str,
    version: &str,
    rest: &[&str],
    method: &Method,
    headers: &HeaderMap,
    client: Option<&str>,
    query: &HashMap<String, String>,
    body: Bytes,
) -> Result<Response<ResponseBody>, ApiError> {
    let namespaced_form = rest.len() >= 3
        && rest[0] == "namespaces"
        && store.kind_for_path(group, version, rest[2]).is_some();
    let (ns, plural, tail) = if namespaced_form {
        (Some(rest[1].to_string()), rest[2], &rest[3..])
    } else {
        let Some((plural, tail)) = rest.split_first() else {
            return Err(ApiError::NoRoute);
        };
        (None, *plural, tail)
    };
    let kind = store
        .kind_for_path(group, version, plural)
        .ok_or(ApiError::NoRoute)?
        .for_version(version);
    let converting = kind.needs_conversion(version);
    let (name, sub) = match tail {
        [] => (None, None),
        [n] => (Some(*n), None),
        [n, s] => (Some(*n), Some(*s)),
        _ => return Err(ApiError::NoRoute),
    };
    if ns.is_some() && !kind.namespaced {
        return Err(ApiError::NoRoute);
    }
    if name.is_some() && kind.namespaced && ns.is_none() {
        return Err(ApiError::NoRoute);
    }
    let sub = match sub {
        None => Sub::Main,
        Some("status") if kind.status_subresource => Sub::Status,
        Some(_) => return Err(ApiError::NoRoute),
    };
    let ns_key = if kind.namespaced {
        ns.clone().unwrap_or_default()
    } else {
        String::new()
    };
    let counted = format!(
        "{}{}",
        kind.group_resource().qualified(),
        if sub == Sub::Status { "/status" } else { "" }
    );
    let watching = query.get("watch").is_some_and(|w| w == "true" || w == "1");
    let verb = match (method, name) {
        (&Method::GET, _) if watching => "watch",
        (&Method::GET, Some(_)) => "get",
        (&Method::GET, None) => "list",
        (&Method::POST, None) => "create",
        (&Method::PUT, Some(_)) => "update",
        (&Method::PATCH, Some(_)) => "patch",
        (&Method::DELETE, Some(_)) => "delete",
        (&Method::DELETE, None) => "deletecollection",
        _ => return Err(ApiError::MethodNotAllowed),
    };
    store.count(client, &counted, verb);
    // A server-side apply that creates its object is authorized by the real API server twice:
    // as `patch` for the request and as `create` for the new object (other patches of a
    // missing object are answered 404 before that check).
    let is_apply = headers
        .get(header::CONTENT_TYPE)
        .and_then(|c| c.to_str().ok())
        .is_some_and(|c| c.starts_with("application/apply-patch"));
    let creates = verb == "patch"
        && is_apply
        && sub == Sub::Main
        && name.is_some_and(|name| store.get(&kind, &ns_key, name).is_err());
    if let Some(client) = client {
        let verbs: &[&str] = if creates { &[verb, "create"] } else { &[verb] };
        for verb in verbs {
            store.count_client(
                client,
                ClientRequest {
                    group: kind.group.clone(),
                    resource: kind.plural.clone(),
                    subresource: (sub == Sub::Status).then(|| "status".to_string()),
                    verb: (*verb).to_string(),
                    namespace: ns.clone(),
                },
            );
        }
    }
    let opts = write_options(query, headers);
    let is_write = matches!(
        *method,
        Method::POST | Method::PUT | Method::PATCH | Method::DELETE
    );
    if is_write && let Some(d) = store.take_delay(&kind.group_resource()) {
        tracing::debug!(resource = %counted, delay = ?d, "testkit: delaying write (fault)");
        tokio::time::sleep(d).await;
    }
    if let Some(hook) = store.fault_hook() {
        let info = RequestInfo {
            verb,
            group: &kind.group,
            resource: &kind.plural,
            subresource: (sub == Sub::Status).then_some("status"),
            namespace: ns.as_deref(),
            name,
            client,
        };
        match hook(&info) {
            Some(FaultKind::Delay(d)) => tokio::time::sleep(d).await,
            Some(fault) => {
                if let Some(e) = fault.to_error(&kind.group_resource()) {
                    tracing::debug!(resource = %counted, verb, error = %e, "testkit: fault hook");
                    return Err(e);
                }
            }
            None => {}
        }
    }
    let respond = |code: StatusCode, mut obj: Value| {
        set_version(&mut obj, &kind, version);
        json_response(code, &obj)
    };
    match (method, name) {
        (&Method::GET, Some(name))
            if query.get("watch").is_some_and(|w| w == "true" || w == "1") =>
        {
            // Watch of one object by path (deprecated upstream, still served).
            let mut sel = selectors(query, &kind)?;
            sel.fields = FieldSelector::parse(&format!("metadata.name={name}"))?;
            watch(
                store,
                kind,
                version,
                ns,
                sel,
                query,
                wants_metadata(headers),
                client,
            )
        }
        (&Method::GET, Some(name)) => {
            let obj = store.get(&kind, &ns_key, name)?;
            let obj = one_to_version(store, &kind, version, obj).await?;
            if wants_metadata(headers) {
                return Ok(json_response(StatusCode::OK, &partial(&obj)));
            }
            if wants_table(headers) {
                return Ok(json_response(
                    StatusCode::OK,
                    &table(&kind, &[&obj], store.resource_version()),
                ));
            }
            Ok(respond(StatusCode::OK, obj))
        }
        (&Method::GET, None) => {
            let sel = selectors(query, &kind)?;
            if query.get("watch").is_some_and(|w| w == "true" || w == "1") {
                return watch(
                    store,
                    kind,
                    version,
                    ns,
                    sel,
                    query,
                    wants_metadata(headers),
                    client,
                );
            }
            let limit = query.get("limit").and_then(|l| l.parse().ok());
            let (items, rv, cont) = store.list(
                &kind,
                ns.as_deref(),
                &sel,
                limit,
                query.get("continue").map(String::as_str),
            )?;
            // One review for the whole page, as the real server batches.
            let mut items = to_version(store, &kind, version, items).await?;
            if wants_table(headers) {
                let items: Vec<&Value> = items.iter().map(AsRef::as_ref).collect();
                return Ok(json_response(StatusCode::OK, &table(&kind, &items, rv)));
            }
            let mut meta = json!({"resourceVersion": rv.to_string()});
            if let Some(c) = cont {
                meta["continue"] = json!(c);
            }
            if wants_metadata(headers) {
                let items: Vec<Value> = items.iter().map(|i| partial(i)).collect();
                return Ok(json_response(
                    StatusCode::OK,
                    &json!({"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadataList", "metadata": meta, "items": items}),
                ));
            }
            for i in &mut items {
                set_shared_version(i, &kind, version);
            }
            // The stored objects are serialized where they are, not copied into one value.
            let items: Vec<&Value> = items.iter().map(AsRef::as_ref).collect();
            Ok(json_response(
                StatusCode::OK,
                &ListBody {
                    api_version: kind.api_version(version),
                    kind: &kind.list_kind,
                    metadata: meta,
                    items,
                },
            ))
        }
        (&Method::POST, None) => {
            let obj = request_body(&body, &kind, version)?;
            let obj = if converting {
                versioned_write(store, &kind, version, None, |ver| {
                    store.create_staged(&kind, &ns_key, obj.clone(), &opts, Some(ver))
                })
                .await?
            } else {
                store.create(&kind, &ns_key, obj, &opts)?
            };
            Ok(respond(StatusCode::CREATED, obj))
        }
        (&Method::PUT, Some(name)) => {
            let obj = request_body(&body, &kind, version)?;
            let obj = if converting {
                versioned_write(store, &kind, version, Some((&ns_key, name)), |ver| {
                    store.update_staged(&kind, &ns_key, name, obj.clone(), sub, &opts, Some(ver))
                })
                .await?
            } else {
                store.update(&kind, &ns_key, name, obj, sub, &opts)?
            };
            Ok(respond(StatusCode::OK, obj))
        }
        (&Method::PATCH, Some(name)) => {
            let ct = headers
                .get(header::CONTENT_TYPE)
                .and_then(|c| c.to_str().ok())
                .unwrap_or("");
            let pk = match ct.split(';').next().unwrap_or("").trim() {
                "application/merge-patch+json" => PatchKind::Merge,
                "application/json-patch+json" => PatchKind::Json,
                "application/strategic-merge-patch+json" => PatchKind::Strategic,
                "application/apply-patch+yaml" | "application/apply-patch+json" => PatchKind::Apply,
                other => {
                    return Err(ApiError::UnsupportedMediaType(format!(
                        "{other} is not a patch type; use application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml"
                    )));
                }
            };
            if pk == PatchKind::Apply {
                check_apply_version(&body, &kind, version)?;
            }
            let existed = store.get(&kind, &ns_key, name).is_ok();
            let obj = if converting {
                versioned_write(store, &kind, version, Some((&ns_key, name)), |ver| {
                    store.patch_staged(&kind, &ns_key, name, pk, &body, sub, &opts, Some(ver))
                })
                .await?
            } else {
                store.patch(&kind, &ns_key, name, pk, &body, sub, &opts)?
            };
            let code = if existed {
                StatusCode::OK
            } else {
                StatusCode::CREATED
            };
            Ok(respond(code, obj))
        }
        (&Method::DELETE, Some(name)) => {
            let dopts = delete_options(&body, query)?;
            let obj = store.delete(&kind, &ns_key, name, &dopts)?;
            if dopts.dry_run || store.get(&kind, &ns_key, name).is_ok() {
                // Still there (finalizers): the object, with its deletionTimestamp.
                let obj = one_to_version(store, &kind, version, obj).await?;
                return Ok(respond(StatusCode::OK, obj));
            }
            // Gone: a Success Status, as for the real CRD and most built-in stores.
            Ok(json_response(
                StatusCode::OK,
                &json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                    "details": {"name": name, "group": kind.group, "kind": kind.plural, "uid": obj["metadata"]["uid"]}}),
            ))
        }
        (&Method::DELETE, None) => {
            let dopts = delete_options(&body, query)?;
            let sel = selectors(query, &kind)?;
            let (items, rv, _) = store.list(&kind, ns.as_deref(), &sel, None, None)?;
            let mut out = Vec::new();
            for i in items {
                let i = i.as_ref();
                let ins = i["metadata"]["namespace"]
                    .as_str()
                    .unwrap_or("")
                    .to_string();
                let iname = i["metadata"]["name"].as_str().unwrap_or("").to_string();
                out.push(Arc::new(store.delete(&kind, &ins, &iname, &dopts)?));
            }
            let out = to_version(store, &kind, version, out).await?;
            let out: Vec<Value> = out
                .into_iter()
                .map(|mut o| {
                    set_shared_version(&mut o, &kind, version);
                    Arc::unwrap_or_clone(o)
                })
                .collect();
            Ok(json_response(
                StatusCode::OK,
                &json!({"apiVersion": kind.api_version(version), "kind": kind.list_kind, "metadata": {"resourceVersion": rv.to_string()}, "items": out}),
            ))
        }
        _ => Err(ApiError::MethodNotAllowed),
    }
}

fn delete_options(
    body: &Bytes,
    query: &HashMap<String, String>,
) -> Result<DeleteOptions, ApiError> {
    let v: Value = if body.is_empty() {
        json!({})
    } else {
        parse_body(body)?
    };
    Ok(DeleteOptions {
        propagation: v["propagationPolicy"]
            .as_str()
            .map(String::from)
            .or_else(|| query.get("propagationPolicy").cloned()),
        uid: v["preconditions"]["uid"].as_str().map(String::from),
        resource_version: v["preconditions"]["resourceVersion"]
            .as_str()
            .map(String::from),
        dry_run: v["dryRun"]
            .as_array()
            .is_some_and(|d| d.iter().any(|x| x == "All"))
            || query.get("dryRun").is_some_and(|d| d == "All"),
    })
}

/// Whether the client asked for `PartialObjectMetadata` (kube's `*_metadata` calls).
fn wants_metadata(headers: &HeaderMap) -> bool {
    headers
        .get(header::ACCEPT)
        .and_then(|a| a.to_str().ok())
        .is_some_and(|a| a.contains("as=PartialObjectMetadata"))
}

/// The `meta.k8s.io/v1 PartialObjectMetadata` view of an object.
fn partial(obj: &Value) -> Value {
    json!({"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata", "metadata": obj["metadata"]})
}

fn wants_table(headers: &HeaderMap) -> bool {
    headers
        .get(header::ACCEPT)
        .and_then(|a| a.to_str().ok())
        .is_some_and(|a| a.contains("as=Table"))
}

/// Evaluate a simple JSONPath (`.a.b.c`) of a printer column.
/// A backslash escapes a dot inside a key (`cluster\.x-k8s\.io/cluster-name`).
fn simple_json_path<'a>(obj: &'a Value, path: &str) -> Option<&'a Value> {
    let mut segs = vec![String::new()];
    let mut chars = path.trim_start_matches('.').chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => {
                if let Some(n) = chars.next()
                    && let Some(last) = segs.last_mut()
                {
                    last.push(n);
                }
            }
            '.' => segs.push(String::new()),
            c => {
                if let Some(last) = segs.last_mut() {
                    last.push(c);
                }
            }
        }
    }
    segs.iter()
        .filter(|s| !s.is_empty())
        .try_fold(obj, |cur, seg| cur.get(seg.as_str()))
}

/// kubectl's `HumanDuration` rendering of the age of an RFC 3339 timestamp (`42s`, `5m3s`, `2d`).
fn human_age(ts: &str) -> Option<String> {
    let then: k8s_openapi::jiff::Timestamp = ts.parse().ok()?;
    let secs = (k8s_openapi::jiff::Timestamp::now().as_second() - then.as_second()).max(0);
    let (m, h, d) = (secs / 60, secs / 3600, secs / 86_400);
    Some(match secs {
        s if s < 120 => format!("{s}s"),
        s if s < 600 => format!("{m}m{}s", s % 60),
        s if s < 3 * 3600 => format!("{m}m"),
        s if s < 8 * 3600 => format!("{h}h{}m", (s % 3600) / 60),
        s if s < 48 * 3600 => format!("{h}h"),
        s if s < 8 * 86_400 => format!("{d}d{}h", (s % 86_400) / 3600),
        _ => format!("{d}d"),
    })
}

/// A `meta.k8s.io/v1 Table` for kubectl (Name, printer columns, or Name + Age).
fn table(kind: &KindInfo, items: &[&Value], rv: u64) -> Value {
    let mut cols =
        vec![json!({"name": "Name", "type": "string", "format": "name", "description": "Name"})];
    let mut paths = Vec::new();
    if kind.printer_columns.is_empty() {
        cols.push(json!({"name": "Age", "type": "string", "format": "", "description": "Age"}));
        paths.push((".metadata.creationTimestamp".to_string(), true));
    } else {
        for c in &kind.printer_columns {
            // Dates are rendered as ages by the server, like the real table convertor.
            let date = c["type"] == "date";
            let ty = if date {
                json!("string")
            } else {
                c["type"].clone()
            };
            cols.push(json!({"name": c["name"], "type": ty, "format": c.get("format").cloned().unwrap_or(json!("")), "description": c.get("description").cloned().unwrap_or(json!(""))}));
            paths.push((c["jsonPath"].as_str().unwrap_or("").to_string(), date));
        }
    }
    let rows: Vec<Value> = items
        .iter()
        .map(|o| {
            let mut cells = vec![o["metadata"]["name"].clone()];
            for (p, date) in &paths {
                let v = simple_json_path(o, p).cloned().unwrap_or(Value::Null);
                cells.push(match v.as_str().filter(|_| *date).and_then(human_age) {
                    Some(age) => json!(age),
                    None => v,
                });
            }
            json!({"cells": cells, "object": {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": o["metadata"]}})
        })
        .collect();
    json!({"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": {"resourceVersion": rv.to_string()}, "columnDefinitions": cols, "rows": rows})
}

fn event_line(kind_type: &str, object: &Value) -> Bytes {
    #[derive(serde::Serialize)]
    struct Event<'a> {
        #[serde(rename = "type")]
        kind_type: &'a str,
        object: &'a Value,
    }
    // Serializing a JSON value cannot fail (string keys only).
    let mut line = serde_json::to_vec(&Event { kind_type, object }).unwrap_or_default();
    line.push(b'\n');
    Bytes::from(line)
}

fn bookmark(kind: &KindInfo, version: &str, rv: u64, initial_end: bool) -> Bytes {
    let mut obj = json!({"kind": kind.kind, "apiVersion": kind.api_version(version), "metadata": {"resourceVersion": rv.to_string()}});
    if initial_end {
        obj["metadata"]["annotations"] = json!({"k8s.io/initial-events-end": "true"});
    }
    event_line("BOOKMARK", &obj)
}

/// Which event (if any) a watcher with this filter sees for a change.
fn visible(rec: &WatchRecord, matches: &dyn Fn(&Value) -> bool) -> Option<&'static str> {
    let now = matches(&rec.object);
    match rec.event {
        EventType::Added | EventType::Deleted => now.then_some(rec.event.as_str()),
        EventType::Modified => match (rec.prev.as_deref().is_some_and(matches), now) {
            (true, true) => Some("MODIFIED"),
            (false, true) => Some("ADDED"),
            (true, false) => Some("DELETED"),
            (false, false) => None,
        },
    }
}

#[allow(clippy::too_many_arguments)] // the request's parts, all needed
fn watch(
    store: &Arc<Store>,
    kind: Arc<KindInfo>,
    version: &str,
    ns: Option<String>,
    sel: Selectors,
    query: &HashMap<String, String>,
    metadata_only: bool,
    client: Option<&str>,
) -> Result<Response<ResponseBody>, ApiError> {
    let rv = match query.get("resourceVersion").map(String::as_str) {
        None | Some("") => None,
        Some(r) => Some(
            r.parse::<u64>()
                .map_err(|_| ApiError::BadRequest(format!("invalid resourceVersion: {r}")))?,
        ),
    };
    let send_initial = query.get("sendInitialEvents").is_some_and(|s| s == "true");
    let bookmarks = query
        .get("allowWatchBookmarks")
        .is_some_and(|s| s == "true");
    let timeout = query
        .get("timeoutSeconds")
        .and_then(|t| t.parse::<u64>().ok())
        .map(Duration::from_secs);
    let (tx, rx) = mpsc::channel::<Bytes>(256);
    let mut resp = Response::new(ResponseBody(BodyInner::Stream(rx)));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    let version = version.to_string();
    let start = match store.watch(&kind, rv, send_initial) {
        Ok(s) => s,
        Err(e) => {
            store.count_watch_end(client, "gone");
            // Like the real server: a 200 stream carrying one ERROR event, then EOF.
            let line = event_line("ERROR", &e.to_status());
            tokio::spawn(async move {
                let _ = tx.send(line).await;
            });
            return Ok(resp);
        }
    };
    let interval = store.bookmark_interval();
    let mut expiry = store.expiry();
    let counter = store.clone();
    let client = client.map(str::to_owned);
    tokio::spawn(async move {
        let matches = |o: &Value| {
            ns.as_deref()
                .is_none_or(|n| o["metadata"]["namespace"].as_str() == Some(n))
                && sel.matches(o)
        };
        // The events a record gives this watch, converted to its version (one review for all
        // of them); a conversion failure ends the watch with an ERROR event.
        let render = async |recs: &[Arc<WatchRecord>]| -> Result<Vec<Bytes>, Bytes> {
            let (types, objects): (Vec<&'static str>, Vec<Arc<Value>>) = recs
                .iter()
                .filter_map(|rec| visible(rec, &matches).map(|t| (t, rec.object.clone())))
                .unzip();
            if objects.is_empty() {
                return Ok(Vec::new());
            }
            let objects = to_version(&counter, &kind, &version, objects)
                .await
                .map_err(|e| event_line("ERROR", &e.to_status()))?;
            Ok(types
                .into_iter()
                .zip(objects)
                .map(|(t, mut obj)| {
                    if metadata_only {
                        return event_line(t, &partial(&obj));
                    }
                    set_shared_version(&mut obj, &kind, &version);
                    event_line(t, &obj)
                })
                .collect())
        };
        let initial = match render(&start.initial).await {
            Ok(lines) => lines,
            Err(error) => {
                let _ = tx.send(error).await;
                return;
            }
        };
        for line in initial {
            if tx.send(line).await.is_err() {
                return;
            }
        }
        let mut last_rv = start.start_rv;
        if send_initial
            && tx
                .send(bookmark(&kind, &version, last_rv, true))
                .await
                .is_err()
        {
            return;
        }
        let mut rx = start.rx;
        let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
        let deadline =
            tokio::time::sleep(timeout.unwrap_or(Duration::from_secs(100 * 365 * 86_400)));
        tokio::pin!(deadline);
        loop {
            let event = tokio::select! {
                _ = &mut deadline => {
                    counter.count_watch_end(client.as_deref(), "timeout");
                    break;
                }
                _ = tx.closed() => break,
                _ = expiry.changed() => {
                    counter.count_watch_end(client.as_deref(), "expired");
                    let e = ApiError::Gone { requested: last_rv, oldest: last_rv + 1 };
                    let _ = tx.send(event_line("ERROR", &e.to_status())).await;
                    break;
                }
                _ = ticker.tick(), if bookmarks => {
                    if tx.send(bookmark(&kind, &version, last_rv, false)).await.is_err() {
                        break;
                    }
                    continue;
                }
                r = rx.recv() => match r {
                    Ok(rec) => {
                        if rec.rv <= start.start_rv {
                            continue;
                        }
                        last_rv = rec.rv;
                        if rec.gr == kind.group_resource() { Some(rec) } else { None }
                    }
                    Err(broadcast::error::RecvError::Lagged(_)) => {
                        counter.count_watch_end(client.as_deref(), "lagged");
                        let e = ApiError::Gone { requested: last_rv, oldest: last_rv + 1 };
                        let _ = tx.send(event_line("ERROR", &e.to_status())).await;
                        break;
                    }
                    Err(broadcast::error::RecvError::Closed) => break,
                },
            };
            let Some(rec) = event else { continue };
            match render(std::slice::from_ref(&rec)).await {
                Ok(lines) => {
                    for line in lines {
                        if tx.send(line).await.is_err() {
                            return;
                        }
                    }
                }
                Err(error) => {
                    counter.count_watch_end(client.as_deref(), "conversion");
                    let _ = tx.send(error).await;
                    break;
                }
            }
        }
        tracing::trace!(kind = %kind.kind, "testkit watch ended");
    });
    Ok(resp)
}

#[cfg(test)]
mod tests {
    use super::version_priority;

    #[test]
    fn printer_column_paths_honour_escaped_dots() {
        let o =
            serde_json::json!({"metadata": {"labels": {"cluster.x-k8s.io/cluster-name": "c1"}}});
        let p = r".metadata.labels.cluster\.x-k8s\.io/cluster-name";
        assert_eq!(
            super::simple_json_path(&o, p),
            Some(&serde_json::json!("c1"))
        );
    }

    #[test]
    fn ages_render_like_kubectl() {
        let ago = |s: i64| {
            let t = k8s_openapi::jiff::Timestamp::now()
                - k8s_openapi::jiff::SignedDuration::from_secs(s);
            super::human_age(&t.strftime("%Y-%m-%dT%H:%M:%SZ").to_string()).unwrap()
        };
        assert_eq!(ago(5), "5s");
        assert_eq!(ago(3 * 60 + 7), "3m7s");
        assert_eq!(ago(3 * 86_400 + 2 * 3600 + 5), "3d2h");
        assert_eq!(super::human_age("not a time"), None);
    }

    #[test]
    fn versions_sort_like_the_api_server() {
        let mut v = vec!["v1alpha1", "v1beta1", "v1", "v2", "v1beta2", "v1alpha2"];
        v.sort_by_key(|v| std::cmp::Reverse(version_priority(v)));
        assert_eq!(
            v,
            ["v2", "v1", "v1beta2", "v1beta1", "v1alpha2", "v1alpha1"]
        );
    }
}
