//! The object store: one global resourceVersion counter, objects as JSON, per-resource watch
//! history, and the write semantics controllers rely on (status subresource, generation,
//! optimistic concurrency, finalizers, owner-reference garbage collection).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use serde_json::{Map, Value, json};
use tokio::sync::broadcast;

use super::error::ApiError;
use super::kinds::{GroupResource, KindInfo};
use super::patch::{self, ManagedEntry};
use super::selector::Selectors;

/// What a validation hook sees for one create or update.
pub struct ValidationInput<'a> {
    /// The object about to be stored.
    pub object: &'a Value,
    /// The stored object it replaces (`None` on create), for transition rules (`oldSelf`).
    pub old_object: Option<&'a Value>,
    /// The CRD's OpenAPI v3 schema for the object's version (`None` for built-ins).
    pub schema: Option<&'a Value>,
    /// The kind being written.
    pub kind: &'a KindInfo,
}

/// Per-kind validation hook: `Err(message)` rejects the write with 422 Invalid.
pub type Validator = Arc<dyn Fn(&ValidationInput<'_>) -> Result<(), String> + Send + Sync>;

/// An injected failure for the next writes of a resource.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    /// 409 Conflict, as after a concurrent write.
    Conflict,
    /// 500 InternalError.
    InternalError,
    /// 504 Timeout, as a server-side timeout.
    Timeout,
    /// 429 TooManyRequests (throttling).
    TooManyRequests,
    /// 403 Forbidden, as RBAC answers a request it does not grant.
    Forbidden,
    /// Answer only after this delay, then perform the write normally: a slow server, or a
    /// client-side timeout when the delay exceeds the client's timeout.
    Delay(Duration),
}

impl FaultKind {
    /// The error this fault answers with (`None` for a delay, which is not an error).
    pub(crate) fn to_error(self, gr: &GroupResource) -> Option<ApiError> {
        Some(match self {
            FaultKind::Conflict => ApiError::Conflict {
                message: format!(
                    "Operation cannot be fulfilled on {}: injected conflict (testkit fault)",
                    gr.qualified()
                ),
            },
            FaultKind::InternalError => {
                ApiError::Internal("Internal error occurred: injected fault (testkit)".into())
            }
            FaultKind::Timeout => ApiError::Timeout(
                "Timeout: request did not complete within requested timeout (testkit fault)".into(),
            ),
            FaultKind::TooManyRequests => {
                ApiError::TooManyRequests("Too many requests (testkit fault)".into())
            }
            FaultKind::Forbidden => ApiError::Forbidden(format!(
                "{} is forbidden: injected fault (testkit)",
                gr.qualified()
            )),
            FaultKind::Delay(_) => return None,
        })
    }
}

/// What a fault hook sees of a request.
#[derive(Debug, Clone, Copy)]
pub struct RequestInfo<'a> {
    /// `get`, `list`, `watch`, `create`, `update`, `patch`, `delete` or `deletecollection`.
    pub verb: &'a str,
    /// API group (empty for core).
    pub group: &'a str,
    /// Plural resource name.
    pub resource: &'a str,
    /// `Some("status")` for the status subresource.
    pub subresource: Option<&'a str>,
    /// Namespace from the path, if any.
    pub namespace: Option<&'a str>,
    /// Object name from the path, if any.
    pub name: Option<&'a str>,
    /// The client's name (see [`super::ApiServer::client_named`]), so a fault can target one
    /// component and spare the others.
    pub client: Option<&'a str>,
}

/// Decides per request whether to inject a fault (`None`: serve normally).
pub type FaultHook = Arc<dyn Fn(&RequestInfo<'_>) -> Option<FaultKind> + Send + Sync>;

/// Kind of a watch event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventType {
    /// Object created.
    Added,
    /// Object changed.
    Modified,
    /// Object removed.
    Deleted,
}

impl EventType {
    /// Wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            EventType::Added => "ADDED",
            EventType::Modified => "MODIFIED",
            EventType::Deleted => "DELETED",
        }
    }
}

/// One change, kept in the watch history and broadcast to live watches.
#[derive(Debug)]
pub struct WatchRecord {
    /// Resource that changed.
    pub gr: GroupResource,
    /// resourceVersion of the change.
    pub rv: u64,
    /// Event type.
    pub event: EventType,
    /// Object after the change (before removal for DELETED), shared by every watch.
    pub object: Arc<Value>,
    /// Object before the change, for selector transitions.
    pub prev: Option<Arc<Value>>,
}

/// What a new watch must send first and where live delivery starts.
pub struct WatchStart {
    /// Events to send before live ones (history replay or synthetic ADDED).
    pub initial: Vec<Arc<WatchRecord>>,
    /// Live events; skip those with `rv <= start_rv`.
    pub rx: broadcast::Receiver<Arc<WatchRecord>>,
    /// The global resourceVersion at subscription time.
    pub start_rv: u64,
}

/// Options of a write request.
#[derive(Debug, Clone, Default)]
pub struct WriteOptions {
    /// `fieldManager` (or the user agent).
    pub manager: String,
    /// `force` for server-side apply.
    pub force: bool,
    /// `dryRun=All`: validate and answer but do not persist.
    pub dry_run: bool,
}

/// Options of a delete request (from the `DeleteOptions` body).
#[derive(Debug, Clone, Default)]
pub struct DeleteOptions {
    /// `Foreground`, `Background` or `Orphan`.
    pub propagation: Option<String>,
    /// `preconditions.uid`.
    pub uid: Option<String>,
    /// `preconditions.resourceVersion`.
    pub resource_version: Option<String>,
    /// `dryRun=All`.
    pub dry_run: bool,
}

/// A write in a version other than the storage version: the store computes the new object
/// in the request's version, from the stored object converted to it by the caller (conversion
/// may call a webhook, so it happens outside the store's lock), and hands it back for
/// conversion to the storage version ([`Staged::Convert`], then [`Store::commit_staged`]).
#[derive(Debug, Clone)]
pub struct Versioned {
    /// The request's version.
    pub version: String,
    /// The stored object converted to `version` (without `managedFields`), as read before
    /// the write; `None` when there was none.
    pub old: Option<Value>,
}

/// What a write given a [`Versioned`] context came to.
#[derive(Debug)]
pub enum Staged {
    /// Finished (a write that changed nothing, a dry run, or a direct write): the answer.
    Done(Value),
    /// The stored object changed since the caller read it: read, convert and try again.
    Retry,
    /// Validated in the request's version: convert `object` to the storage version and
    /// commit it with [`Store::commit_staged`].
    Convert(Pending),
}

impl Staged {
    fn into_value(self) -> Result<Value, ApiError> {
        match self {
            Staged::Done(v) => Ok(v),
            _ => Err(ApiError::Internal(
                "testkit: a direct write asked for conversion".into(),
            )),
        }
    }
}

/// A validated write waiting for its conversion to the storage version.
#[derive(Debug)]
pub struct Pending {
    key: Key,
    /// The new object, in the request's version.
    pub object: Value,
    managed: Vec<ManagedEntry>,
    /// The stored resourceVersion it was computed from (`None`: a create).
    base_rv: Option<Value>,
    /// A create by server-side apply (which retries instead of failing on a concurrent create).
    apply: bool,
}

/// Which part of the object a write addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sub {
    /// The main resource (status is ignored when a status subresource exists).
    Main,
    /// `/status` (only status changes).
    Status,
}

impl Sub {
    fn name(self) -> &'static str {
        match self {
            Sub::Main => "",
            Sub::Status => "status",
        }
    }
}

/// Patch flavours, by content type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PatchKind {
    /// `application/merge-patch+json`.
    Merge,
    /// `application/json-patch+json`.
    Json,
    /// `application/strategic-merge-patch+json` (treated as merge patch for built-ins).
    Strategic,
    /// `application/apply-patch+yaml` (server-side apply).
    Apply,
}

/// Per-verb request counters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestCounts {
    /// Requests by verb (`get`, `list`, `watch`, `create`, `update`, `patch`, `delete`, `discovery`).
    pub by_verb: BTreeMap<String, u64>,
    /// Requests by `(resource, verb)`, resource as `plural.group` (or `plural`, or `/status` suffixed).
    pub by_resource: BTreeMap<(String, String), u64>,
    /// Watch streams the server ended, by reason (`timeout`, `expired`, `lagged`, `gone`):
    /// each one makes a client's watcher start a new watch (or relist).
    pub watches_ended: BTreeMap<String, u64>,
}

impl RequestCounts {
    fn add(&mut self, resource: &str, verb: &str) {
        *self.by_verb.entry(verb.to_string()).or_default() += 1;
        *self
            .by_resource
            .entry((resource.to_string(), verb.to_string()))
            .or_default() += 1;
    }

    /// Total number of requests counted.
    pub fn total(&self) -> u64 {
        self.by_verb.values().sum()
    }

    /// Requests with this verb.
    pub fn verb(&self, verb: &str) -> u64 {
        self.by_verb.get(verb).copied().unwrap_or(0)
    }

    /// Requests with this verb on a resource: `plural` or `plural.group`, with a `/status`
    /// suffix for the status subresource.
    pub fn resource_verb(&self, resource: &str, verb: &str) -> u64 {
        let split = |r: &str| -> (String, String) {
            let (base, sub) = r.split_once('/').unwrap_or((r, ""));
            (base.to_string(), sub.to_string())
        };
        let (qb, qs) = split(resource);
        self.by_resource
            .iter()
            .filter(|((r, v), _)| {
                let (rb, rs) = split(r);
                v == verb
                    && rs == qs
                    && (rb == qb || rb.split_once('.').is_some_and(|(p, _)| p == qb))
            })
            .map(|(_, n)| n)
            .sum()
    }
}

/// One kind of request a named client made, in the terms RBAC authorizes
/// (see [`crate::ApiServer::client_named`]).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ClientRequest {
    /// API group (empty for core and for non-resource requests).
    pub group: String,
    /// Plural resource name; for a non-resource request (discovery, `/version`) the URL path,
    /// starting with `/`, as RBAC's `nonResourceURLs` names it.
    pub resource: String,
    /// `Some("status")` for the status subresource.
    pub subresource: Option<String>,
    /// RBAC verb: `get`, `list`, `watch`, `create`, `update`, `patch` (server-side apply
    /// included), `delete` or `deletecollection`.
    pub verb: String,
    /// Namespace from the path (`None` for cluster-scoped and all-namespace requests), which
    /// decides whether a namespaced Role can grant it.
    pub namespace: Option<String>,
}

struct Stored {
    obj: Value,
    managed: Vec<ManagedEntry>,
    /// The object as clients see it, rendered once per write: lists and watches of a large
    /// fleet share it instead of rendering every object on every read.
    view: Arc<Value>,
}

impl Stored {
    fn new(obj: Value, managed: Vec<ManagedEntry>) -> Self {
        let view = Arc::new(render_view(&obj, &managed));
        Stored { obj, managed, view }
    }

    /// Replace the object (and its field managers, when given).
    fn set(&mut self, obj: Value, managed: Option<Vec<ManagedEntry>>) {
        self.obj = obj;
        if let Some(m) = managed {
            self.managed = m;
        }
        self.view = Arc::new(render_view(&self.obj, &self.managed));
    }

    /// Replace the field managers only (a write that changed nothing else).
    fn set_managed(&mut self, managed: Vec<ManagedEntry>) {
        self.managed = managed;
        self.view = Arc::new(render_view(&self.obj, &self.managed));
    }

    /// The object as clients see it, with `metadata.managedFields` rendered.
    fn view(&self) -> Arc<Value> {
        self.view.clone()
    }

    /// An owned copy of [`Stored::view`], for callers that change or hand it out.
    fn view_owned(&self) -> Value {
        (*self.view).clone()
    }
}

fn render_view(obj: &Value, managed: &[ManagedEntry]) -> Value {
    let mut v = obj.clone();
    if !managed.is_empty() {
        v["metadata"]["managedFields"] =
            Value::Array(managed.iter().map(ManagedEntry::to_json).collect());
    }
    v
}

#[derive(Default)]
struct History {
    events: VecDeque<Arc<WatchRecord>>,
    compacted: u64,
}

type Key = (String, String);

/// One page of a list: the objects (shared with the store), the list's resourceVersion and
/// the continue token when more remain.
pub type ListPage = (Vec<Arc<Value>>, u64, Option<String>);

struct Inner {
    rv: u64,
    kinds: BTreeMap<GroupResource, Arc<KindInfo>>,
    objects: HashMap<GroupResource, BTreeMap<Key, Stored>>,
    history: HashMap<GroupResource, History>,
    history_limit: usize,
    faults: HashMap<GroupResource, VecDeque<FaultKind>>,
    validators: HashMap<GroupResource, Validator>,
    rng: u64,
    removed_uids: Vec<String>,
    /// Deleting objects the collector must revisit (foreground/orphan finalizers,
    /// terminating namespaces), so that ordinary writes skip the collector in O(1).
    gc_waiting: BTreeSet<(GroupResource, Key)>,
    fault_hook: Option<FaultHook>,
    /// Every uid ever removed: a dependent written later with only such owners is garbage.
    deleted_uids: HashSet<String>,
    /// Stored objects by the uid of each owner they name, so the collector goes from a removed
    /// owner to its dependents without scanning every object.
    dependents: HashMap<String, BTreeSet<(GroupResource, Key)>>,
    /// The uids of the stored objects.
    live_uids: HashSet<String>,
    bookmark_interval: Duration,
    require_namespaces: bool,
}

/// The base URL (`https://host:port`) each `(namespace, name)` service stands for.
pub type ServiceRoutes = HashMap<(String, String), String>;

/// The shared state behind every client, service and HTTP connection of one fake server.
pub struct Store {
    inner: Mutex<Inner>,
    tx: broadcast::Sender<Arc<WatchRecord>>,
    counts: Mutex<RequestCounts>,
    /// The same counters per named client.
    counts_by_client: Mutex<BTreeMap<String, RequestCounts>>,
    by_client: Mutex<BTreeMap<String, BTreeMap<ClientRequest, u64>>>,
    expire: tokio::sync::watch::Sender<u64>,
    services: Mutex<ServiceRoutes>,
}

/// Current time as RFC 3339 with second precision, like `metav1.Time`.
pub fn now_rfc3339() -> String {
    k8s_openapi::jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string()
}

fn meta(obj: &Value) -> &Value {
    &obj["metadata"]
}

fn meta_mut(obj: &mut Value) -> &mut Map<String, Value> {
    if !obj["metadata"].is_object() {
        obj["metadata"] = json!({});
    }
    match obj["metadata"].as_object_mut() {
        Some(m) => m,
        None => unreachable!("metadata was just made an object"),
    }
}

fn finalizers(obj: &Value) -> Vec<String> {
    meta(obj)["finalizers"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|f| f.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default()
}

fn set_finalizers(obj: &mut Value, fins: &[String]) {
    let m = meta_mut(obj);
    if fins.is_empty() {
        m.remove("finalizers");
    } else {
        m.insert("finalizers".into(), json!(fins));
    }
}

fn is_deleting(obj: &Value) -> bool {
    meta(obj)
        .get("deletionTimestamp")
        .is_some_and(|t| !t.is_null())
}

fn uid_of(obj: &Value) -> String {
    meta(obj)["uid"].as_str().unwrap_or("").to_string()
}

/// The owners' uids, borrowed (the collector asks this of every object after a removal).
fn owner_uid_refs(obj: &Value) -> impl Iterator<Item = &str> {
    meta(obj)["ownerReferences"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|r| r["uid"].as_str())
}

fn owner_uids(obj: &Value) -> Vec<String> {
    meta(obj)["ownerReferences"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|r| r["uid"].as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default()
}

/// Drop empty metadata collections, as the real server's omitempty serialisation does.
fn normalize_meta(obj: &mut Value) {
    let m = meta_mut(obj);
    for field in [
        "finalizers",
        "ownerReferences",
        "labels",
        "annotations",
        "managedFields",
    ] {
        let empty = match m.get(field) {
            Some(Value::Array(a)) => a.is_empty(),
            Some(Value::Object(o)) => o.is_empty(),
            Some(Value::Null) => true,
            _ => false,
        };
        if empty || field == "managedFields" {
            m.remove(field);
        }
    }
}

/// The object without metadata (and without status when it is a subresource): what bumps generation.
fn spec_part(obj: &Value, status_subresource: bool) -> Value {
    let mut v = obj.clone();
    if let Some(m) = v.as_object_mut() {
        m.remove("metadata");
        if status_subresource {
            m.remove("status");
        }
    }
    v
}

/// Secrets: `stringData` is write-only; the API server merges it into `data` (base64), where
/// it wins over `data` for the same key, and never stores it.
fn fold_secret_string_data(kind: &KindInfo, obj: &mut Value) -> Result<(), ApiError> {
    if !(kind.group.is_empty() && kind.plural == "secrets") {
        return Ok(());
    }
    let Some(object) = obj.as_object_mut() else {
        return Ok(());
    };
    let strings = match object.remove("stringData") {
        None | Some(Value::Null) => return Ok(()),
        Some(Value::Object(strings)) => strings,
        Some(_) => {
            return Err(ApiError::BadRequest(
                "Secret in version \"v1\" cannot be handled as a Secret: stringData must be a map of strings".into(),
            ));
        }
    };
    let data = object.entry("data").or_insert_with(|| json!({}));
    if !data.is_object() {
        *data = json!({});
    }
    for (key, value) in strings {
        let Some(text) = value.as_str() else {
            return Err(ApiError::BadRequest(format!(
                "Secret in version \"v1\" cannot be handled as a Secret: stringData.{key} must be a string"
            )));
        };
        let encoded = k8s_openapi::ByteString(text.as_bytes().to_vec());
        data[key] = serde_json::to_value(encoded)
            .map_err(|e| ApiError::BadRequest(format!("stringData.{key}: {e}")))?;
    }
    Ok(())
}

fn is_namespace_kind(kind: &KindInfo) -> bool {
    kind.group.is_empty() && kind.plural == "namespaces"
}

fn is_crd_kind(kind: &KindInfo) -> bool {
    kind.group == "apiextensions.k8s.io" && kind.plural == "customresourcedefinitions"
}

/// For a CustomResourceDefinition being written: the kind it defines, with the status the
/// real apiextensions controller would report (names accepted, established).
fn crd_accept(kind: &KindInfo, obj: &mut Value) -> Result<Option<KindInfo>, ApiError> {
    if !is_crd_kind(kind) {
        return Ok(None);
    }
    let defined = KindInfo::from_crd(obj).map_err(|e| ApiError::Invalid {
        message: format!(
            "CustomResourceDefinition.apiextensions.k8s.io \"{}\" is invalid: {e}",
            meta(obj)["name"].as_str().unwrap_or("")
        ),
    })?;
    let established = obj["status"]["conditions"]
        .as_array()
        .is_some_and(|c| c.iter().any(|c| c["type"] == "Established"));
    let conditions = if established {
        obj["status"]["conditions"].clone()
    } else {
        let cond = |t: &str| json!({"type": t, "status": "True", "reason": t, "message": "", "lastTransitionTime": now_rfc3339()});
        json!([cond("NamesAccepted"), cond("Established")])
    };
    // Like the CRD strategy: the storage version joins the versions objects were stored in
    // (only the storage version migrator removes them, through /status).
    let mut stored = obj["status"]["storedVersions"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    if !stored.iter().any(|v| v == defined.storage_version()) {
        stored.push(json!(defined.storage_version()));
    }
    obj["status"] = json!({
        "acceptedNames": obj["spec"]["names"],
        "conditions": conditions,
        "storedVersions": stored,
    });
    Ok(Some(defined))
}

impl Inner {
    fn next_rand(&mut self) -> u64 {
        // splitmix64: enough randomness for names and uids, no dependency.
        self.rng = self.rng.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn new_uid(&mut self) -> String {
        let (a, b) = (self.next_rand(), self.next_rand());
        format!(
            "{:08x}-{:04x}-4{:03x}-{:04x}-{:012x}",
            a >> 32,
            (a >> 16) & 0xffff,
            a & 0xfff,
            (b >> 48) & 0x3fff | 0x8000,
            b & 0xffff_ffff_ffff
        )
    }

    fn name_suffix(&mut self) -> String {
        const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
        let mut r = self.next_rand();
        (0..5)
            .map(|_| {
                let c = ALPHABET[(r % ALPHABET.len() as u64) as usize] as char;
                r /= ALPHABET.len() as u64;
                c
            })
            .collect()
    }

    fn take_fault(&mut self, gr: &GroupResource) -> Result<(), ApiError> {
        let Some(q) = self.faults.get_mut(gr) else {
            return Ok(());
        };
        if let Some(e) = q.front().and_then(|f| f.to_error(gr)) {
            tracing::debug!(resource = %gr.qualified(), error = %e, "testkit: injecting fault");
            q.pop_front();
            return Err(e);
        }
        Ok(())
    }

    fn emit(
        &mut self,
        gr: &GroupResource,
        event: EventType,
        object: Arc<Value>,
        prev: Option<Arc<Value>>,
        tx: &broadcast::Sender<Arc<WatchRecord>>,
    ) {
        let rec = Arc::new(WatchRecord {
            gr: gr.clone(),
            rv: self.rv,
            event,
            object,
            prev,
        });
        let limit = self.history_limit;
        let h = self.history.entry(gr.clone()).or_default();
        h.events.push_back(rec.clone());
        while h.events.len() > limit {
            if let Some(old) = h.events.pop_front() {
                h.compacted = old.rv;
            }
        }
        // No receivers is fine: nobody is watching.
        let _ = tx.send(rec);
    }

    fn validate(&self, kind: &KindInfo, obj: &Value, old: Option<&Value>) -> Result<(), ApiError> {
        let Some(v) = self.validators.get(&kind.group_resource()) else {
            return Ok(());
        };
        let input = ValidationInput {
            object: obj,
            old_object: old,
            schema: kind.schema_of(obj),
            kind,
        };
        if let Err(msg) = v(&input) {
            return Err(ApiError::Invalid {
                message: format!(
                    "{}.{} \"{}\" is invalid: {msg}",
                    kind.kind,
                    kind.group,
                    meta(obj)["name"].as_str().unwrap_or("")
                ),
            });
        }
        Ok(())
    }

    fn namespace_object(&self, ns: &str) -> Option<&Value> {
        let gr = GroupResource {
            group: String::new(),
            resource: "namespaces".into(),
        };
        self.objects
            .get(&gr)
            .and_then(|m| m.get(&(String::new(), ns.to_string())))
            .map(|s| &s.obj)
    }

    fn namespace_terminating(&self, ns: &str) -> bool {
        self.namespace_object(ns).is_some_and(is_deleting)
    }

    /// Store `new` as the next version of `key`; removes it instead when it is deleting
    /// and has no finalizers left. Returns the client view.
    fn write(
        &mut self,
        kind: &KindInfo,
        key: &Key,
        mut new: Value,
        managed: Option<Vec<ManagedEntry>>,
        tx: &broadcast::Sender<Arc<WatchRecord>>,
    ) -> Arc<Value> {
        let gr = kind.group_resource();
        self.rv += 1;
        let rv = self.rv;
        meta_mut(&mut new).insert("resourceVersion".into(), json!(rv.to_string()));
        let finalize = is_deleting(&new) && finalizers(&new).is_empty() && !is_namespace_kind(kind);
        let waiting = !finalize
            && is_deleting(&new)
            && (is_namespace_kind(kind)
                || finalizers(&new)
                    .iter()
                    .any(|f| f == "foregroundDeletion" || f == "orphan"));
        if waiting {
            self.gc_waiting.insert((gr.clone(), key.clone()));
        } else {
            self.gc_waiting.remove(&(gr.clone(), key.clone()));
        }
        let objects = self.objects.entry(gr.clone()).or_default();
        let prev = objects.get(key).map(Stored::view);
        let old_owners = prev.as_deref().map(owner_uids).unwrap_or_default();
        if finalize {
            let view = match objects.remove(key) {
                Some(mut s) => {
                    s.set(new, None);
                    s.view()
                }
                None => Arc::new(new),
            };
            self.reindex(&gr, key, &old_owners, &[], &uid_of(&view), false);
            self.forget(kind, &view, tx);
            self.emit(&gr, EventType::Deleted, view.clone(), prev, tx);
            return view;
        }
        let stored = match objects.get_mut(key) {
            Some(s) => {
                s.set(new, managed);
                s
            }
            None => objects
                .entry(key.clone())
                .or_insert(Stored::new(new, managed.unwrap_or_default())),
        };
        let view = stored.view();
        self.reindex(
            &gr,
            key,
            &old_owners,
            &owner_uids(&view),
            &uid_of(&view),
            true,
        );
        let event = if prev.is_some() {
            EventType::Modified
        } else {
            EventType::Added
        };
        // Owners that are already gone (e.g. a controller re-created a dependent just after
        // its owner was deleted): let the collector look at this object, as the real GC does.
        let gone: Vec<String> = owner_uids(&view)
            .into_iter()
            .filter(|u| self.deleted_uids.contains(u))
            .collect();
        self.removed_uids.extend(gone);
        self.emit(&gr, event, view.clone(), prev, tx);
        view
    }

    /// Bookkeeping for a removed object: garbage-collect its dependents, and stop serving the
    /// kind a removed CustomResourceDefinition defined.
    fn forget(&mut self, kind: &KindInfo, view: &Value, tx: &broadcast::Sender<Arc<WatchRecord>>) {
        self.removed_uids.push(uid_of(view));
        self.deleted_uids.insert(uid_of(view));
        if is_crd_kind(kind)
            && let Ok(defined) = KindInfo::from_crd(view)
        {
            // Like the apiextensions cleanup finalizer: the custom resources go with the CRD
            // (removed at once, their own finalizers notwithstanding).
            let keys: Vec<Key> = self
                .objects
                .get(&defined.group_resource())
                .map(|m| m.keys().cloned().collect())
                .unwrap_or_default();
            for key in keys {
                self.remove(&defined, &key, tx);
            }
            self.kinds.remove(&defined.group_resource());
        }
    }

    /// Remove `key` now (no finalizers left), emitting DELETED.
    fn remove(
        &mut self,
        kind: &KindInfo,
        key: &Key,
        tx: &broadcast::Sender<Arc<WatchRecord>>,
    ) -> Option<Arc<Value>> {
        let gr = kind.group_resource();
        let mut stored = self.objects.get_mut(&gr)?.remove(key)?;
        self.reindex(
            &gr,
            key,
            &owner_uids(&stored.obj),
            &[],
            &uid_of(&stored.obj),
            false,
        );
        self.gc_waiting.remove(&(gr.clone(), key.clone()));
        self.rv += 1;
        let mut obj = std::mem::take(&mut stored.obj);
        meta_mut(&mut obj).insert("resourceVersion".into(), json!(self.rv.to_string()));
        stored.set(obj, None);
        let view = stored.view();
        self.forget(kind, &view, tx);
        self.emit(&gr, EventType::Deleted, view.clone(), None, tx);
        Some(view)
    }

    /// Start deletion of `key` with a propagation policy; returns the resulting view.
    fn delete_internal(
        &mut self,
        kind: &KindInfo,
        key: &Key,
        policy: Option<&str>,
        tx: &broadcast::Sender<Arc<WatchRecord>>,
    ) -> Option<Arc<Value>> {
        let gr = kind.group_resource();
        let stored = self.objects.get(&gr)?.get(key)?;
        if is_deleting(&stored.obj) {
            return Some(stored.view());
        }
        let mut obj = stored.obj.clone();
        let mut fins = finalizers(&obj);
        let extra = match policy {
            Some("Foreground") => Some("foregroundDeletion"),
            Some("Orphan") => Some("orphan"),
            _ => None,
        };
        if let Some(f) = extra
            && !fins.iter().any(|x| x == f)
        {
            fins.push(f.to_string());
        }
        if fins.is_empty() && !is_namespace_kind(kind) {
            return self.remove(kind, key, tx);
        }
        set_finalizers(&mut obj, &fins);
        let m = meta_mut(&mut obj);
        m.insert("deletionTimestamp".into(), json!(now_rfc3339()));
        m.insert("deletionGracePeriodSeconds".into(), json!(0));
        if kind.custom {
            let g = m.get("generation").and_then(Value::as_u64).unwrap_or(1);
            m.insert("generation".into(), json!(g + 1));
        }
        if is_namespace_kind(kind) {
            obj["status"]["phase"] = json!("Terminating");
        }
        Some(self.write(kind, key, obj, None, tx))
    }

    fn kind_of(&self, gr: &GroupResource) -> Option<Arc<KindInfo>> {
        self.kinds.get(gr).cloned()
    }

    /// All objects as (kind, key, obj) snapshots (for the garbage collector's scans).
    /// Copies of the stored objects that `keep` selects (only those are cloned, so the
    /// collector stays cheap with thousands of objects).
    fn objects_where(
        &self,
        keep: impl Fn(&KindInfo, &Key, &Value) -> bool,
    ) -> Vec<(Arc<KindInfo>, Key, Value)> {
        let mut out = Vec::new();
        for (gr, objs) in &self.objects {
            if let Some(k) = self.kind_of(gr) {
                for (key, s) in objs {
                    if keep(&k, key, &s.obj) {
                        out.push((k.clone(), key.clone(), s.obj.clone()));
                    }
                }
            }
        }
        out
    }

    /// Keeps the owner index and the live uids in step with a stored object's change: its
    /// owners before and after, and whether it is still stored.
    fn reindex(
        &mut self,
        gr: &GroupResource,
        key: &Key,
        old_owners: &[String],
        new_owners: &[String],
        uid: &str,
        stored: bool,
    ) {
        for owner in old_owners.iter().filter(|o| !new_owners.contains(o)) {
            if let Some(set) = self.dependents.get_mut(owner) {
                set.remove(&(gr.clone(), key.clone()));
                if set.is_empty() {
                    self.dependents.remove(owner);
                }
            }
        }
        for owner in new_owners.iter().filter(|o| !old_owners.contains(o)) {
            self.dependents
                .entry(owner.clone())
                .or_default()
                .insert((gr.clone(), key.clone()));
        }
        if stored {
            if !self.live_uids.contains(uid) {
                self.live_uids.insert(uid.to_owned());
            }
        } else {
            self.live_uids.remove(uid);
        }
    }

    /// Copies of the stored objects that name any of `owners` as an owner.
    fn dependents_of<'a>(
        &self,
        owners: impl IntoIterator<Item = &'a String>,
    ) -> Vec<(Arc<KindInfo>, Key, Value)> {
        let targets: BTreeSet<&(GroupResource, Key)> = owners
            .into_iter()
            .filter_map(|uid| self.dependents.get(uid))
            .flatten()
            .collect();
        targets
            .into_iter()
            .filter_map(|(gr, key)| {
                let kind = self.kind_of(gr)?;
                let obj = self.objects.get(gr)?.get(key)?.obj.clone();
                Some((kind, key.clone(), obj))
            })
            .collect()
    }

    /// Owner-reference garbage collection, foreground/orphan finalizers and namespace
    /// termination, run synchronously to a fixed point after every write.
    fn run_gc(&mut self, tx: &broadcast::Sender<Arc<WatchRecord>>) {
        // Fast path without cloning anything: nothing was removed and nothing is waiting for
        // the collector (foreground/orphan finalizers, terminating namespaces).
        if self.removed_uids.is_empty() && self.gc_waiting.is_empty() {
            return;
        }
        for _round in 0..10_000 {
            let mut progressed = false;
            // 1. Dependents of removed owners.
            let removed: BTreeSet<String> =
                std::mem::take(&mut self.removed_uids).into_iter().collect();
            if !removed.is_empty() {
                let orphans = self.dependents_of(&removed);
                // Decide for every orphan first: does another owner still exist?
                let keeps_an_owner: Vec<bool> = orphans
                    .iter()
                    .map(|(_, _, o)| {
                        owner_uid_refs(o)
                            .any(|u| self.live_uids.contains(u) && !removed.contains(u))
                    })
                    .collect();
                for ((kind, key, obj), keep) in orphans.into_iter().zip(keeps_an_owner) {
                    progressed = true;
                    if keep {
                        let mut o = obj;
                        if let Some(refs) = o["metadata"]["ownerReferences"].as_array_mut() {
                            refs.retain(|r| {
                                !r["uid"].as_str().is_some_and(|u| removed.contains(u))
                            });
                        }
                        normalize_meta(&mut o);
                        self.write(&kind, &key, o, None, tx);
                    } else {
                        self.delete_internal(&kind, &key, Some("Background"), tx);
                    }
                }
            }
            // 2. Foreground, orphan and namespace finalization of the deleting objects that
            // wait for the collector (every other deleting object waits for its own finalizers).
            let deleting: Vec<(Arc<KindInfo>, Key, Value)> = self
                .gc_waiting
                .iter()
                .filter_map(|(gr, key)| {
                    let kind = self.kind_of(gr)?;
                    let obj = self.objects.get(gr)?.get(key)?.obj.clone();
                    Some((kind, key.clone(), obj))
                })
                .collect();
            for (kind, key, obj) in &deleting {
                let uid = uid_of(obj);
                let fins = finalizers(obj);
                let dependents = |inner: &Inner| -> Vec<(Arc<KindInfo>, Key, Value)> {
                    inner.dependents_of([&uid])
                };
                if fins.iter().any(|f| f == "foregroundDeletion") {
                    for (dk, dkey, dobj) in dependents(self) {
                        if !is_deleting(&dobj) {
                            self.delete_internal(&dk, &dkey, Some("Foreground"), tx);
                            progressed = true;
                        }
                    }
                    let blocked = dependents(self).iter().any(|(_, _, o)| {
                        o["metadata"]["ownerReferences"]
                            .as_array()
                            .is_some_and(|refs| {
                                refs.iter().any(|r| {
                                    r["uid"] == uid.as_str() && r["blockOwnerDeletion"] == true
                                })
                            })
                    });
                    if !blocked {
                        self.drop_finalizer(kind, key, "foregroundDeletion", tx);
                        progressed = true;
                    }
                } else if fins.iter().any(|f| f == "orphan") {
                    for (dk, dkey, mut dobj) in dependents(self) {
                        if let Some(refs) = dobj["metadata"]["ownerReferences"].as_array_mut() {
                            refs.retain(|r| r["uid"] != uid.as_str());
                        }
                        normalize_meta(&mut dobj);
                        self.write(&dk, &dkey, dobj, None, tx);
                    }
                    self.drop_finalizer(kind, key, "orphan", tx);
                    progressed = true;
                } else if is_namespace_kind(kind) {
                    let ns = &key.1;
                    let contents = self.objects_where(|k, key, _| k.namespaced && &key.0 == ns);
                    for (ck, ckey, cobj) in &contents {
                        if !is_deleting(cobj) {
                            self.delete_internal(ck, ckey, None, tx);
                            progressed = true;
                        }
                    }
                    let empty = self
                        .objects
                        .iter()
                        .filter(|(gr, _)| self.kind_of(gr).is_some_and(|k| k.namespaced))
                        .all(|(_, objs)| objs.keys().all(|key| &key.0 != ns));
                    if empty && fins.is_empty() {
                        self.remove(kind, key, tx);
                        progressed = true;
                    }
                }
            }
            if !progressed && self.removed_uids.is_empty() {
                return;
            }
        }
        tracing::warn!("testkit: garbage collection did not converge");
    }

    fn drop_finalizer(
        &mut self,
        kind: &KindInfo,
        key: &Key,
        finalizer: &str,
        tx: &broadcast::Sender<Arc<WatchRecord>>,
    ) {
        let Some(obj) = self
            .objects
            .get(&kind.group_resource())
            .and_then(|m| m.get(key))
            .map(|s| s.obj.clone())
        else {
            return;
        };
        let mut fins = finalizers(&obj);
        fins.retain(|f| f != finalizer);
        let mut o = obj;
        set_finalizers(&mut o, &fins);
        self.write(kind, key, o, None, tx);
    }
}

impl Default for Store {
    fn default() -> Self {
        Self::new()
    }
}

impl Store {
    /// An empty store with no kinds registered.
    pub fn new() -> Self {
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(42);
        let (tx, _) = broadcast::channel(16 * 1024);
        Store {
            inner: Mutex::new(Inner {
                rv: 1,
                kinds: BTreeMap::new(),
                objects: HashMap::new(),
                history: HashMap::new(),
                history_limit: 10_000,
                faults: HashMap::new(),
                validators: HashMap::new(),
                rng: seed,
                removed_uids: Vec::new(),
                gc_waiting: BTreeSet::new(),
                fault_hook: None,
                deleted_uids: Default::default(),
                dependents: HashMap::new(),
                live_uids: HashSet::new(),
                bookmark_interval: Duration::from_secs(5),
                require_namespaces: false,
            }),
            tx,
            counts: Mutex::new(RequestCounts::default()),
            counts_by_client: Mutex::default(),
            by_client: Mutex::default(),
            expire: tokio::sync::watch::channel(0).0,
            services: Mutex::default(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock only happens in a failing test; keep serving.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Register (or replace) a kind.
    pub fn register(&self, kind: KindInfo) {
        let mut g = self.lock();
        g.kinds.insert(kind.group_resource(), Arc::new(kind));
    }

    /// All registered kinds.
    pub fn kinds(&self) -> Vec<Arc<KindInfo>> {
        self.lock().kinds.values().cloned().collect()
    }

    /// Find a kind by the name forms kubectl accepts (plural, singular, kind, short name, `.group`).
    pub fn find_kind(&self, name: &str) -> Option<Arc<KindInfo>> {
        let g = self.lock();
        let mut found = g.kinds.values().filter(|k| k.matches_name(name));
        // Prefer the core group on ambiguity (like `events`).
        let first = found.next()?.clone();
        Some(
            std::iter::once(first.clone())
                .chain(found.cloned())
                .find(|k| k.group.is_empty())
                .unwrap_or(first),
        )
    }

    /// The kind served at `group/version/plural`, if any.
    pub fn kind_for_path(&self, group: &str, version: &str, plural: &str) -> Option<Arc<KindInfo>> {
        let g = self.lock();
        g.kinds
            .get(&GroupResource {
                group: group.into(),
                resource: plural.into(),
            })
            .filter(|k| k.versions.iter().any(|v| v == version))
            .cloned()
    }

    /// Set the validation hook of a kind.
    pub fn set_validator(&self, gr: GroupResource, v: Validator) {
        self.lock().validators.insert(gr, v);
    }

    /// Route a service's conversion-webhook calls to `base_url` (`None`: remove the route).
    pub fn route_service(&self, namespace: &str, name: &str, base_url: Option<String>) {
        let mut routes = self.services.lock().unwrap_or_else(|p| p.into_inner());
        let key = (namespace.to_string(), name.to_string());
        match base_url {
            Some(url) => {
                routes.insert(key, url);
            }
            None => {
                routes.remove(&key);
            }
        }
    }

    /// The base URL a service is routed to, if any.
    pub fn service_route(&self, namespace: &str, name: &str) -> Option<String> {
        self.services
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&(namespace.to_string(), name.to_string()))
            .cloned()
    }

    /// A fresh uid (for conversion reviews).
    pub fn new_uid(&self) -> String {
        self.lock().new_uid()
    }

    /// Queue `n` failures of kind `fault` for the next writes of `gr`.
    pub fn fail_next_writes(&self, gr: GroupResource, n: usize, fault: FaultKind) {
        let mut g = self.lock();
        g.faults
            .entry(gr)
            .or_default()
            .extend(std::iter::repeat_n(fault, n));
    }

    /// Install (or with `None` remove) the per-request fault hook.
    pub fn set_fault_hook(&self, hook: Option<FaultHook>) {
        self.lock().fault_hook = hook;
    }

    /// The per-request fault hook, if any.
    pub fn fault_hook(&self) -> Option<FaultHook> {
        self.lock().fault_hook.clone()
    }

    /// If the next queued fault of `gr` is a delay, take it.
    pub fn take_delay(&self, gr: &GroupResource) -> Option<Duration> {
        let mut g = self.lock();
        let q = g.faults.get_mut(gr)?;
        match q.front() {
            Some(FaultKind::Delay(d)) => {
                let d = *d;
                q.pop_front();
                Some(d)
            }
            _ => None,
        }
    }

    /// Current global resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.lock().rv
    }

    /// Interval between BOOKMARK events on watches that asked for them.
    pub fn bookmark_interval(&self) -> Duration {
        self.lock().bookmark_interval
    }

    /// Change the bookmark interval for watches started afterwards.
    pub fn set_bookmark_interval(&self, d: Duration) {
        self.lock().bookmark_interval = d;
    }

    /// Refuse to create namespaced objects in a namespace that does not exist (404), as a
    /// real server does.
    pub fn set_require_namespaces(&self, on: bool) {
        self.lock().require_namespaces = on;
    }

    /// Bound the watch history per resource (older resourceVersions get 410 Gone).
    pub fn set_history_limit(&self, n: usize) {
        self.lock().history_limit = n.max(1);
    }

    /// Forget all watch history, as an etcd compaction: watches from older versions get 410.
    pub fn compact(&self) {
        let mut g = self.lock();
        let rv = g.rv;
        let grs: Vec<_> = g.kinds.keys().cloned().collect();
        for gr in grs {
            let h = g.history.entry(gr).or_default();
            h.events.clear();
            h.compacted = rv;
        }
    }

    /// End every open watch with a 410 Expired ERROR event (clients must relist).
    pub fn expire_watches(&self) {
        self.expire.send_modify(|n| *n += 1);
    }

    /// Notified by [`Store::expire_watches`].
    pub fn expiry(&self) -> tokio::sync::watch::Receiver<u64> {
        self.expire.subscribe()
    }

    /// Applies `f` to the server's counters and, for a named client, to that client's.
    fn count_with(&self, client: Option<&str>, f: impl Fn(&mut RequestCounts)) {
        f(&mut self.counts.lock().unwrap_or_else(|p| p.into_inner()));
        if let Some(client) = client {
            let mut by_client = self
                .counts_by_client
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            f(by_client.entry(client.to_string()).or_default());
        }
    }

    /// Count one request (of `client`, when it is named).
    pub fn count(&self, client: Option<&str>, resource: &str, verb: &str) {
        self.count_with(client, |c| c.add(resource, verb));
    }

    /// Count one watch stream the server ended (see [`RequestCounts::watches_ended`]).
    pub fn count_watch_end(&self, client: Option<&str>, reason: &str) {
        self.count_with(client, |c| {
            *c.watches_ended.entry(reason.to_string()).or_default() += 1;
        });
    }

    /// Snapshot of the request counters.
    pub fn counts(&self) -> RequestCounts {
        self.counts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Snapshot of one named client's request counters (empty for a client never seen).
    pub fn counts_of(&self, client: &str) -> RequestCounts {
        self.counts_by_client
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(client)
            .cloned()
            .unwrap_or_default()
    }

    /// Reset the request counters, the per-client ones included.
    pub fn reset_counts(&self) {
        *self.counts.lock().unwrap_or_else(|p| p.into_inner()) = RequestCounts::default();
        self.counts_by_client
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
        self.by_client
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
    }

    /// Count one request of a named client.
    pub fn count_client(&self, client: &str, request: ClientRequest) {
        let mut c = self.by_client.lock().unwrap_or_else(|p| p.into_inner());
        *c.entry(client.to_string())
            .or_default()
            .entry(request)
            .or_default() += 1;
    }

    /// The requests a named client made, with how often each was made.
    pub fn client_counts(&self, client: &str) -> BTreeMap<ClientRequest, u64> {
        self.by_client
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(client)
            .cloned()
            .unwrap_or_default()
    }

    fn not_found(kind: &KindInfo, name: &str) -> ApiError {
        ApiError::NotFound {
            qualified: kind.group_resource().qualified(),
            name: name.to_string(),
        }
    }

    /// GET one object.
    pub fn get(&self, kind: &KindInfo, ns: &str, name: &str) -> Result<Value, ApiError> {
        let g = self.lock();
        g.objects
            .get(&kind.group_resource())
            .and_then(|m| m.get(&(ns.to_string(), name.to_string())))
            .map(Stored::view_owned)
            .ok_or_else(|| Self::not_found(kind, name))
    }

    /// LIST: items in (namespace, name) order, the list resourceVersion and a continue token.
    pub fn list(
        &self,
        kind: &KindInfo,
        ns: Option<&str>,
        sel: &Selectors,
        limit: Option<usize>,
        cont: Option<&str>,
    ) -> Result<ListPage, ApiError> {
        let after: Option<Key> = match cont {
            Some(c) if !c.is_empty() => Some(
                serde_json::from_str(c)
                    .map_err(|_| ApiError::BadRequest(format!("invalid continue token: {c}")))?,
            ),
            _ => None,
        };
        let g = self.lock();
        let mut items = Vec::new();
        let mut next = None;
        if let Some(objs) = g.objects.get(&kind.group_resource()) {
            for (key, s) in objs {
                if after.as_ref().is_some_and(|a| key <= a) {
                    continue;
                }
                if ns.is_some_and(|n| n != key.0) || !sel.matches(&s.obj) {
                    continue;
                }
                if limit.is_some_and(|l| l > 0 && items.len() >= l) {
                    next = serde_json::to_string(&items_last_key(&items)).ok();
                    break;
                }
                items.push(s.view());
            }
        }
        Ok((items, g.rv, next))
    }

    /// POST: create an object.
    pub fn create(
        &self,
        kind: &KindInfo,
        ns: &str,
        obj: Value,
        opts: &WriteOptions,
    ) -> Result<Value, ApiError> {
        self.create_staged(kind, ns, obj, opts, None)?.into_value()
    }

    /// [`Store::create`] in a version other than the storage version when `ver` is given.
    pub fn create_staged(
        &self,
        kind: &KindInfo,
        ns: &str,
        obj: Value,
        opts: &WriteOptions,
        ver: Option<&Versioned>,
    ) -> Result<Staged, ApiError> {
        let mut g = self.lock();
        g.take_fault(&kind.group_resource())?;
        self.create_locked(&mut g, kind, ns, obj, opts, None, ver)
    }

    #[allow(clippy::too_many_arguments)]
    fn create_locked(
        &self,
        g: &mut Inner,
        kind: &KindInfo,
        ns: &str,
        mut obj: Value,
        opts: &WriteOptions,
        managed: Option<Vec<ManagedEntry>>,
        ver: Option<&Versioned>,
    ) -> Result<Staged, ApiError> {
        if !obj.is_object() {
            return Err(ApiError::BadRequest(
                "the request body must be a JSON object".into(),
            ));
        }
        if let Some(k) = obj["kind"].as_str()
            && k != kind.kind
        {
            return Err(ApiError::BadRequest(format!(
                "the kind in the data ({k}) does not match the expected kind ({})",
                kind.kind
            )));
        }
        obj["kind"] = json!(kind.kind);
        if obj["apiVersion"].as_str().is_none() {
            let version = ver.map_or(kind.storage_version(), |v| v.version.as_str());
            obj["apiVersion"] = json!(kind.api_version(version));
        }
        let m = meta_mut(&mut obj);
        if kind.namespaced {
            match m.get("namespace").and_then(Value::as_str) {
                Some(n) if !n.is_empty() && n != ns => {
                    return Err(ApiError::BadRequest(
                        "the namespace of the provided object does not match the namespace sent on the request".into(),
                    ));
                }
                _ => {
                    m.insert("namespace".into(), json!(ns));
                }
            }
        } else {
            m.remove("namespace");
        }
        if m.get("resourceVersion")
            .and_then(Value::as_str)
            .is_some_and(|rv| !rv.is_empty())
        {
            // The real server's storage layer refuses this with a 500 as well.
            return Err(ApiError::Internal(
                "resourceVersion should not be set on objects to be created".into(),
            ));
        }
        for f in [
            "uid",
            "resourceVersion",
            "creationTimestamp",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
            "generation",
            "managedFields",
            "selfLink",
        ] {
            m.remove(f);
        }
        let mut name = m
            .get("name")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        if name.is_empty() {
            let prefix = m
                .get("generateName")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string();
            if prefix.is_empty() {
                return Err(ApiError::Invalid {
                    message: format!(
                        "{}.{} \"\" is invalid: metadata.name: Required value: name or generateName is required",
                        kind.kind, kind.group
                    ),
                });
            }
            name = format!("{prefix}{}", g.name_suffix());
        }
        if kind.namespaced && g.require_namespaces && g.namespace_object(ns).is_none() {
            return Err(ApiError::NotFound {
                qualified: "namespaces".into(),
                name: ns.to_string(),
            });
        }
        if kind.namespaced && g.namespace_terminating(ns) {
            return Err(ApiError::Forbidden(format!(
                "{} \"{name}\" is forbidden: unable to create new content in namespace {ns} because it is being terminated",
                kind.group_resource().qualified()
            )));
        }
        let key = (
            if kind.namespaced {
                ns.to_string()
            } else {
                String::new()
            },
            name.clone(),
        );
        if g.objects
            .get(&kind.group_resource())
            .is_some_and(|o| o.contains_key(&key))
        {
            return Err(ApiError::AlreadyExists {
                qualified: kind.group_resource().qualified(),
                name,
            });
        }
        let uid = g.new_uid();
        let m = meta_mut(&mut obj);
        m.insert("name".into(), json!(name));
        m.insert("uid".into(), json!(uid));
        m.insert("creationTimestamp".into(), json!(now_rfc3339()));
        if kind.custom {
            m.insert("generation".into(), json!(1));
            if kind.status_subresource
                && let Some(o) = obj.as_object_mut()
            {
                o.remove("status");
            }
        }
        if is_namespace_kind(kind) {
            obj["status"] = json!({"phase": "Active"});
        }
        normalize_meta(&mut obj);
        fold_secret_string_data(kind, &mut obj)?;
        let defined = crd_accept(kind, &mut obj)?;
        g.validate(kind, &obj, None)?;
        let mut managed = managed.unwrap_or_else(|| {
            let mut mf = Vec::new();
            patch::record_update(
                &json!({}),
                &obj,
                kind.schema_of(&obj),
                &mut mf,
                &opts.manager,
                "",
            );
            mf
        });
        let api_version = obj["apiVersion"].as_str().unwrap_or("").to_string();
        patch::stamp(&mut managed, &[], &api_version, &now_rfc3339());
        if opts.dry_run {
            return Ok(Staged::Done(obj));
        }
        if ver.is_some() {
            return Ok(Staged::Convert(Pending {
                key,
                object: obj,
                managed,
                base_rv: None,
                apply: false,
            }));
        }
        let view = g.write(kind, &key, obj, Some(managed), &self.tx);
        if let Some(k) = defined {
            g.kinds.insert(k.group_resource(), Arc::new(k));
        }
        g.run_gc(&self.tx);
        Ok(Staged::Done(Arc::unwrap_or_clone(view)))
    }

    /// Store a [`Pending`] write once converted to the storage version; `None` when the
    /// stored object changed in between (convert again and retry).
    pub fn commit_staged(
        &self,
        kind: &KindInfo,
        pending: Pending,
        converted: Value,
    ) -> Result<Option<Value>, ApiError> {
        let mut g = self.lock();
        let current = g
            .objects
            .get(&kind.group_resource())
            .and_then(|m| m.get(&pending.key))
            .map(|s| meta(&s.obj)["resourceVersion"].clone());
        match (&pending.base_rv, current) {
            (None, None) => {}
            (None, Some(_)) if !pending.apply => {
                return Err(ApiError::AlreadyExists {
                    qualified: kind.group_resource().qualified(),
                    name: pending.key.1,
                });
            }
            (Some(base), Some(now)) if *base == now => {}
            _ => return Ok(None),
        }
        let view = g.write(
            kind,
            &pending.key,
            converted,
            Some(pending.managed),
            &self.tx,
        );
        g.run_gc(&self.tx);
        Ok(Some(Arc::unwrap_or_clone(view)))
    }

    /// The object after a write to `sub` of `old`, with system fields, status handling,
    /// finalizer rules and generation applied.
    fn prepare(kind: &KindInfo, old: &Value, mut new: Value, sub: Sub) -> Result<Value, ApiError> {
        match sub {
            Sub::Main => {
                new["kind"] = old["kind"].clone();
                new["apiVersion"] = old["apiVersion"].clone();
                let old_meta = meta(old).clone();
                let m = meta_mut(&mut new);
                for f in [
                    "name",
                    "namespace",
                    "uid",
                    "creationTimestamp",
                    "deletionTimestamp",
                    "deletionGracePeriodSeconds",
                    "generation",
                    "resourceVersion",
                ] {
                    match old_meta.get(f) {
                        Some(v) => {
                            m.insert(f.into(), v.clone());
                        }
                        None => {
                            m.remove(f);
                        }
                    }
                }
                if kind.status_subresource
                    && let Some(o) = new.as_object_mut()
                {
                    match old.get("status") {
                        Some(s) => {
                            o.insert("status".into(), s.clone());
                        }
                        None => {
                            o.remove("status");
                        }
                    }
                }
            }
            Sub::Status => {
                let status = new.get("status").cloned();
                new = old.clone();
                if let Some(o) = new.as_object_mut() {
                    match status {
                        Some(s) if !s.is_null() => {
                            o.insert("status".into(), s);
                        }
                        _ => {
                            o.remove("status");
                        }
                    }
                }
            }
        }
        normalize_meta(&mut new);
        if is_deleting(old) {
            let old_f = finalizers(old);
            let added: Vec<String> = finalizers(&new)
                .into_iter()
                .filter(|f| !old_f.contains(f))
                .collect();
            if !added.is_empty() {
                return Err(ApiError::Invalid {
                    message: format!(
                        "{}.{} \"{}\" is invalid: metadata.finalizers: Forbidden: no new finalizers can be added if the object is being deleted, found new finalizers {added:?}",
                        kind.kind,
                        kind.group,
                        meta(old)["name"].as_str().unwrap_or("")
                    ),
                });
            }
        }
        if kind.custom
            && spec_part(old, kind.status_subresource) != spec_part(&new, kind.status_subresource)
        {
            let generation = meta(old)["generation"].as_u64().unwrap_or(1);
            meta_mut(&mut new).insert("generation".into(), json!(generation + 1));
        }
        Ok(new)
    }

    fn conflict(kind: &KindInfo, name: &str) -> ApiError {
        ApiError::Conflict {
            message: format!(
                "Operation cannot be fulfilled on {} \"{name}\": the object has been modified; please apply your changes to the latest version and try again",
                kind.group_resource().qualified()
            ),
        }
    }

    /// Commit an already prepared update; a no-op write keeps the resourceVersion.
    #[allow(clippy::too_many_arguments)]
    fn commit(
        &self,
        g: &mut Inner,
        kind: &KindInfo,
        key: &Key,
        mut new: Value,
        sub: Sub,
        opts: &WriteOptions,
        managed: Option<Vec<ManagedEntry>>,
        ver: Option<&Versioned>,
    ) -> Result<Staged, ApiError> {
        fold_secret_string_data(kind, &mut new)?;
        let defined = crd_accept(kind, &mut new)?;
        let gr = kind.group_resource();
        let Some(stored) = g.objects.get(&gr).and_then(|m| m.get(key)) else {
            return Err(Self::not_found(kind, &key.1));
        };
        // A versioned write starts from the caller's conversion of the stored object (the
        // callers checked it is current, under this lock).
        let old_obj = match ver.and_then(|v| v.old.as_ref()) {
            Some(old) => old.clone(),
            None => stored.obj.clone(),
        };
        let base_rv = meta(&stored.obj)["resourceVersion"].clone();
        let previous = stored.managed.clone();
        let mut managed = managed.unwrap_or_else(|| {
            let mut mf = stored.managed.clone();
            patch::record_update(
                &old_obj,
                &new,
                kind.schema_of(&new),
                &mut mf,
                &opts.manager,
                sub.name(),
            );
            mf
        });
        let api_version = new["apiVersion"].as_str().unwrap_or("").to_string();
        patch::stamp(&mut managed, &previous, &api_version, &now_rfc3339());
        if new == old_obj
            && let Some(s) = g.objects.get_mut(&gr).and_then(|m| m.get_mut(key))
        {
            s.set_managed(managed);
            if ver.is_some() {
                return Ok(Staged::Done(render_view(&old_obj, &s.managed)));
            }
            return Ok(Staged::Done(s.view_owned()));
        }
        g.validate(kind, &new, Some(&old_obj))?;
        if opts.dry_run {
            return Ok(Staged::Done(new));
        }
        if ver.is_some() {
            return Ok(Staged::Convert(Pending {
                key: key.clone(),
                object: new,
                managed,
                base_rv: Some(base_rv),
                apply: false,
            }));
        }
        let view = g.write(kind, key, new, Some(managed), &self.tx);
        if let Some(k) = defined
            && meta(&view).get("deletionTimestamp").is_none()
        {
            g.kinds.insert(k.group_resource(), Arc::new(k));
        }
        g.run_gc(&self.tx);
        Ok(Staged::Done(Arc::unwrap_or_clone(view)))
    }

    /// The object a write starts from: the stored one, or for a versioned write the caller's
    /// conversion of it (`None` when the stored object changed since: retry).
    fn base(
        g: &Inner,
        kind: &KindInfo,
        key: &Key,
        ver: Option<&Versioned>,
    ) -> Result<Option<Value>, ApiError> {
        let (stored, _) = Self::stored_obj(g, kind, key)?;
        let Some(ver) = ver else {
            return Ok(Some(stored));
        };
        Ok(ver
            .old
            .as_ref()
            .filter(|old| meta(old)["resourceVersion"] == meta(&stored)["resourceVersion"])
            .cloned())
    }

    fn stored_obj(
        g: &Inner,
        kind: &KindInfo,
        key: &Key,
    ) -> Result<(Value, Vec<ManagedEntry>), ApiError> {
        g.objects
            .get(&kind.group_resource())
            .and_then(|m| m.get(key))
            .map(|s| (s.obj.clone(), s.managed.clone()))
            .ok_or_else(|| Self::not_found(kind, &key.1))
    }

    /// PUT: replace an object (or its status) with optimistic concurrency.
    pub fn update(
        &self,
        kind: &KindInfo,
        ns: &str,
        name: &str,
        body: Value,
        sub: Sub,
        opts: &WriteOptions,
    ) -> Result<Value, ApiError> {
        self.update_staged(kind, ns, name, body, sub, opts, None)?
            .into_value()
    }

    /// [`Store::update`] in a version other than the storage version when `ver` is given.
    #[allow(clippy::too_many_arguments)]
    pub fn update_staged(
        &self,
        kind: &KindInfo,
        ns: &str,
        name: &str,
        mut body: Value,
        sub: Sub,
        opts: &WriteOptions,
        ver: Option<&Versioned>,
    ) -> Result<Staged, ApiError> {
        let mut g = self.lock();
        g.take_fault(&kind.group_resource())?;
        if !body.is_object() {
            return Err(ApiError::BadRequest(
                "the request body must be a JSON object".into(),
            ));
        }
        let key = (ns.to_string(), name.to_string());
        let body_name = meta(&body)["name"].as_str().unwrap_or("");
        if body_name != name {
            return Err(ApiError::BadRequest(format!(
                "the name of the object ({body_name}) does not match the name on the URL ({name})"
            )));
        }
        if kind.namespaced
            && let Some(body_ns) = meta(&body)["namespace"].as_str()
            && !body_ns.is_empty()
            && body_ns != ns
        {
            return Err(ApiError::BadRequest(
                "the namespace of the provided object does not match the namespace sent on the request".into(),
            ));
        }
        let Some(old) = Self::base(&g, kind, &key, ver)? else {
            return Ok(Staged::Retry);
        };
        if let Some(uid) = meta(&body)["uid"].as_str()
            && !uid.is_empty()
            && Some(uid) != meta(&old)["uid"].as_str()
        {
            return Err(ApiError::Conflict {
                message: format!(
                    "Operation cannot be fulfilled on {} \"{name}\": Precondition failed: UID in precondition: {uid}, UID in object meta: {}",
                    kind.group_resource().qualified(),
                    uid_of(&old)
                ),
            });
        }
        match meta(&body)["resourceVersion"].as_str() {
            Some(rv) if !rv.is_empty() && Some(rv) != meta(&old)["resourceVersion"].as_str() => {
                return Err(Self::conflict(kind, name));
            }
            Some(rv) if !rv.is_empty() => {}
            _ if kind.custom => {
                return Err(ApiError::Invalid {
                    message: format!(
                        "{}.{} \"{name}\" is invalid: metadata.resourceVersion: Invalid value: 0x0: must be specified for an update",
                        kind.kind, kind.group
                    ),
                });
            }
            _ => {}
        }
        meta_mut(&mut body).remove("managedFields");
        let new = Self::prepare(kind, &old, body, sub)?;
        self.commit(&mut g, kind, &key, new, sub, opts, None, ver)
    }

    /// PATCH: merge, JSON or strategic-merge patch, or server-side apply.
    #[allow(clippy::too_many_arguments)]
    pub fn patch(
        &self,
        kind: &KindInfo,
        ns: &str,
        name: &str,
        pk: PatchKind,
        body: &[u8],
        sub: Sub,
        opts: &WriteOptions,
    ) -> Result<Value, ApiError> {
        self.patch_staged(kind, ns, name, pk, body, sub, opts, None)?
            .into_value()
    }

    /// [`Store::patch`] in a version other than the storage version when `ver` is given.
    #[allow(clippy::too_many_arguments)]
    pub fn patch_staged(
        &self,
        kind: &KindInfo,
        ns: &str,
        name: &str,
        pk: PatchKind,
        body: &[u8],
        sub: Sub,
        opts: &WriteOptions,
        ver: Option<&Versioned>,
    ) -> Result<Staged, ApiError> {
        let mut g = self.lock();
        g.take_fault(&kind.group_resource())?;
        let key = (ns.to_string(), name.to_string());
        if pk == PatchKind::Apply {
            return self.apply(&mut g, kind, &key, body, sub, opts, ver);
        }
        let Some(old) = Self::base(&g, kind, &key, ver)? else {
            return Ok(Staged::Retry);
        };
        let mut doc = old.clone();
        match pk {
            PatchKind::Json => patch::apply_json_patch(&mut doc, body)?,
            PatchKind::Strategic if kind.custom => {
                return Err(ApiError::UnsupportedMediaType(
                    "application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml".into(),
                ));
            }
            _ => {
                let p: Value = serde_json::from_slice(body)
                    .map_err(|e| ApiError::BadRequest(format!("invalid merge patch: {e}")))?;
                if !p.is_object() {
                    return Err(ApiError::BadRequest(
                        "a merge patch must be a JSON object".into(),
                    ));
                }
                patch::apply_merge_patch(&mut doc, &p);
            }
        }
        if meta(&doc)["resourceVersion"] != meta(&old)["resourceVersion"] {
            return Err(Self::conflict(kind, name));
        }
        if meta(&doc)["name"] != meta(&old)["name"] {
            return Err(ApiError::BadRequest(
                "metadata.name cannot be changed by a patch".into(),
            ));
        }
        meta_mut(&mut doc).remove("managedFields");
        let new = Self::prepare(kind, &old, doc, sub)?;
        self.commit(&mut g, kind, &key, new, sub, opts, None, ver)
    }

    #[allow(clippy::too_many_arguments)]
    fn apply(
        &self,
        g: &mut Inner,
        kind: &KindInfo,
        key: &Key,
        body: &[u8],
        sub: Sub,
        opts: &WriteOptions,
        ver: Option<&Versioned>,
    ) -> Result<Staged, ApiError> {
        if opts.manager.is_empty() {
            return Err(ApiError::BadRequest(
                "PatchOptions.meta.k8s.io \"\" is invalid: fieldManager: Required value: is required for apply patch".into(),
            ));
        }
        let mut applied: Value = match serde_json::from_slice(body) {
            Ok(v) => v,
            Err(_) => serde_norway::from_slice(body)
                .map_err(|e| ApiError::BadRequest(format!("invalid apply patch: {e}")))?,
        };
        if !applied.is_object() {
            return Err(ApiError::BadRequest(
                "an apply patch must be an object".into(),
            ));
        }
        // Unlike create and update, apply needs the type in the body, as on a real server.
        let Some(k) = applied["kind"].as_str().filter(|k| !k.is_empty()) else {
            return Err(ApiError::BadRequest(
                "Object 'Kind' is missing in the apply patch".into(),
            ));
        };
        if k != kind.kind {
            return Err(ApiError::BadRequest(format!(
                "the kind in the data ({k}) does not match the expected kind ({})",
                kind.kind
            )));
        }
        let group_ok = applied["apiVersion"].as_str().is_some_and(|av| {
            let group = av.rsplit_once('/').map(|(g, _)| g).unwrap_or("");
            group == kind.group
        });
        if !group_ok {
            return Err(ApiError::BadRequest(format!(
                "apiVersion {} does not match the group {:?} of the URL",
                applied["apiVersion"], kind.group
            )));
        }
        let (ns, name) = key;
        match meta(&applied)["name"].as_str() {
            Some(n) if n == name => {}
            // Like the real server, a missing name is taken from the URL.
            None | Some("") => {
                meta_mut(&mut applied).insert("name".into(), json!(name));
            }
            other => {
                return Err(ApiError::BadRequest(format!(
                    "the name of the object ({}) does not match the name on the URL ({name})",
                    other.unwrap_or("")
                )));
            }
        }
        let m = meta_mut(&mut applied);
        m.remove("managedFields");
        let rv_pre = m.remove("resourceVersion");
        match sub {
            Sub::Main if kind.status_subresource => {
                if let Some(o) = applied.as_object_mut() {
                    o.remove("status");
                }
            }
            Sub::Status => {
                applied = json!({
                    "apiVersion": applied["apiVersion"],
                    "kind": applied["kind"],
                    "metadata": {"name": name},
                    "status": applied.get("status").cloned().unwrap_or(Value::Null),
                });
            }
            Sub::Main => {}
        }
        let version = ver.map_or(kind.storage_version(), |v| v.version.as_str());
        let schema = kind.schema_for(version).or_else(|| kind.schema());
        let existing = g
            .objects
            .get(&kind.group_resource())
            .and_then(|o| o.get(key))
            .map(|s| (s.obj.clone(), s.managed.clone()));
        // A versioned apply starts from the caller's conversion, if it is still current.
        let existing = match (ver, existing) {
            (None, e) => e,
            (Some(v), e) => {
                let rv_of = |o: &Value| meta(o)["resourceVersion"].clone();
                match (&v.old, e) {
                    (None, None) => None,
                    (Some(old), Some((stored, managed))) if rv_of(old) == rv_of(&stored) => {
                        Some((old.clone(), managed))
                    }
                    _ => return Ok(Staged::Retry),
                }
            }
        };
        match existing {
            None => {
                if sub == Sub::Status {
                    return Err(Self::not_found(kind, name));
                }
                let mut base = json!({"apiVersion": kind.api_version(version), "kind": kind.kind, "metadata": {"name": name}});
                if kind.namespaced {
                    base["metadata"]["namespace"] = json!(ns);
                }
                let mut managed = Vec::new();
                let obj = patch::server_side_apply(
                    &base,
                    &applied,
                    schema,
                    &mut managed,
                    &opts.manager,
                    "",
                    opts.force,
                )?;
                match self.create_locked(g, kind, ns, obj, opts, Some(managed), ver)? {
                    Staged::Convert(mut p) => {
                        p.apply = true;
                        Ok(Staged::Convert(p))
                    }
                    other => Ok(other),
                }
            }
            Some((old, mut managed)) => {
                if let Some(rv) = rv_pre.as_ref().and_then(Value::as_str)
                    && Some(rv) != meta(&old)["resourceVersion"].as_str()
                {
                    return Err(Self::conflict(kind, name));
                }
                let merged = patch::server_side_apply(
                    &old,
                    &applied,
                    schema,
                    &mut managed,
                    &opts.manager,
                    sub.name(),
                    opts.force,
                )?;
                let new = Self::prepare(kind, &old, merged, sub)?;
                self.commit(g, kind, key, new, sub, opts, Some(managed), ver)
            }
        }
    }

    /// DELETE: finalizer-aware deletion with propagation and preconditions.
    pub fn delete(
        &self,
        kind: &KindInfo,
        ns: &str,
        name: &str,
        opts: &DeleteOptions,
    ) -> Result<Value, ApiError> {
        let mut g = self.lock();
        g.take_fault(&kind.group_resource())?;
        let key = (ns.to_string(), name.to_string());
        let (old, _) = Self::stored_obj(&g, kind, &key)?;
        if let Some(uid) = &opts.uid
            && Some(uid.as_str()) != meta(&old)["uid"].as_str()
        {
            return Err(ApiError::Conflict {
                message: format!(
                    "Precondition failed: UID in precondition: {uid}, UID in object meta: {}",
                    uid_of(&old)
                ),
            });
        }
        if let Some(rv) = &opts.resource_version
            && Some(rv.as_str()) != meta(&old)["resourceVersion"].as_str()
        {
            return Err(Self::conflict(kind, name));
        }
        if opts.dry_run {
            return Ok(old);
        }
        let view = g
            .delete_internal(kind, &key, opts.propagation.as_deref(), &self.tx)
            .ok_or_else(|| Self::not_found(kind, name))?;
        g.run_gc(&self.tx);
        Ok(Arc::unwrap_or_clone(view))
    }

    /// Subscribe to changes of `kind`, replaying history after `rv`, or (when `rv` is unset,
    /// `0`, or `send_initial`) synthetic ADDED events for the current objects.
    pub fn watch(
        &self,
        kind: &KindInfo,
        rv: Option<u64>,
        send_initial: bool,
    ) -> Result<WatchStart, ApiError> {
        let g = self.lock();
        let rx = self.tx.subscribe();
        let gr = kind.group_resource();
        let initial = match rv {
            Some(r) if r > 0 && !send_initial => {
                let h = g.history.get(&gr);
                let compacted = h.map(|h| h.compacted).unwrap_or(0);
                if r < compacted {
                    return Err(ApiError::Gone {
                        requested: r,
                        oldest: compacted,
                    });
                }
                h.map(|h| h.events.iter().filter(|e| e.rv > r).cloned().collect())
                    .unwrap_or_default()
            }
            _ => g
                .objects
                .get(&gr)
                .map(|objs| {
                    objs.values()
                        .map(|s| {
                            let view = s.view();
                            Arc::new(WatchRecord {
                                gr: gr.clone(),
                                rv: meta(&view)["resourceVersion"]
                                    .as_str()
                                    .and_then(|r| r.parse().ok())
                                    .unwrap_or(0),
                                event: EventType::Added,
                                object: view,
                                prev: None,
                            })
                        })
                        .collect()
                })
                .unwrap_or_default(),
        };
        Ok(WatchStart {
            initial,
            rx,
            start_rv: g.rv,
        })
    }

    /// Read one object directly (for test assertions).
    pub fn peek(&self, gr: &GroupResource, ns: &str, name: &str) -> Option<Value> {
        self.lock()
            .objects
            .get(gr)
            .and_then(|m| m.get(&(ns.to_string(), name.to_string())))
            .map(Stored::view_owned)
    }

    /// The current state of one object and a subscription to later changes, taken
    /// atomically (for waiting on a condition without missing an event).
    pub fn observe(
        &self,
        gr: &GroupResource,
        ns: &str,
        name: &str,
    ) -> (Option<Value>, broadcast::Receiver<Arc<WatchRecord>>) {
        let g = self.lock();
        let rx = self.tx.subscribe();
        let current = g
            .objects
            .get(gr)
            .and_then(|m| m.get(&(ns.to_string(), name.to_string())))
            .map(Stored::view_owned);
        (current, rx)
    }

    /// All objects of a resource (for test assertions).
    pub fn peek_all(&self, gr: &GroupResource) -> Vec<Value> {
        self.lock()
            .objects
            .get(gr)
            .map(|m| m.values().map(Stored::view_owned).collect())
            .unwrap_or_default()
    }
}

fn items_last_key(items: &[Arc<Value>]) -> Key {
    items
        .last()
        .map(|o| {
            (
                meta(o)["namespace"].as_str().unwrap_or("").to_string(),
                meta(o)["name"].as_str().unwrap_or("").to_string(),
            )
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kind() -> KindInfo {
        let yaml = r#"
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata: {name: things.example.com}
spec:
  group: example.com
  names: {kind: Thing, plural: things}
  scope: Namespaced
  versions: [{name: v1, served: true, storage: true, subresources: {status: {}}}]
"#;
        KindInfo::from_crd_yaml(yaml).unwrap().remove(0)
    }

    fn opts() -> WriteOptions {
        WriteOptions {
            manager: "test".into(),
            ..Default::default()
        }
    }

    fn thing(name: &str) -> Value {
        json!({"apiVersion": "example.com/v1", "kind": "Thing", "metadata": {"name": name}, "spec": {"a": 1}})
    }

    #[test]
    fn uids_and_generated_names_look_like_kubernetes() {
        let store = Store::new();
        let mut g = store.lock();
        let uid = g.new_uid();
        assert_eq!(uid.len(), 36);
        assert_eq!(uid.matches('-').count(), 4);
        assert_ne!(uid, g.new_uid());
        let suffix = g.name_suffix();
        assert_eq!(suffix.len(), 5);
        assert!(
            suffix
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
        );
    }

    #[test]
    fn normalize_drops_empty_metadata_collections() {
        let mut o = json!({"metadata": {"name": "x", "finalizers": [], "labels": {}, "annotations": null,
            "ownerReferences": [], "managedFields": [{"manager": "m"}]}});
        normalize_meta(&mut o);
        assert_eq!(o, json!({"metadata": {"name": "x"}}));
    }

    #[test]
    fn bounded_history_makes_old_resource_versions_gone() {
        let store = Store::new();
        let k = kind();
        store.register(k.clone());
        store.set_history_limit(2);
        let start = store.resource_version();
        for i in 0..4 {
            store
                .create(&k, "ns", thing(&format!("t{i}")), &opts())
                .unwrap();
        }
        assert!(matches!(
            store.watch(&k, Some(start), false),
            Err(ApiError::Gone { .. })
        ));
        let recent = store.resource_version() - 1;
        let w = store.watch(&k, Some(recent), false).unwrap();
        assert_eq!(
            w.initial.len(),
            1,
            "only the newest event is after {recent}"
        );
    }

    #[test]
    fn no_op_update_keeps_resource_version_and_emits_nothing() {
        let store = Store::new();
        let k = kind();
        store.register(k.clone());
        let created = store.create(&k, "ns", thing("t"), &opts()).unwrap();
        let mut rx = store
            .watch(&k, Some(store.resource_version()), false)
            .unwrap()
            .rx;
        let same = store
            .update(&k, "ns", "t", created.clone(), Sub::Main, &opts())
            .unwrap();
        assert_eq!(
            same["metadata"]["resourceVersion"],
            created["metadata"]["resourceVersion"]
        );
        assert!(matches!(
            rx.try_recv(),
            Err(broadcast::error::TryRecvError::Empty)
        ));
    }
}
