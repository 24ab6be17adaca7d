//! An in-process Kubernetes API server for tests and the sandbox, plus [`schema`]: the API
//! server's CRD schema and CEL checks, without one.
//!
//! No kube-apiserver binary can run on our CI machines and `kube-fake-client` has no watch
//! and breaks kube's finalizer flow, so this module implements the parts of the API server
//! that controllers observe, faithfully enough that kube-runtime's `Controller`, `watcher`,
//! `reflector` and `finalizer` helper run unchanged:
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use capmox_testkit::ApiServer;
//! let server = ApiServer::new();
//! server.register_builtin_kinds();
//! server.register_crd_dir("tests/data/external-crds")?;
//! let client = server.client(); // a real kube::Client over an in-process tower::Service
//! let http = server.serve_http().await?; // the same server on 127.0.0.1:<port>
//! std::fs::write("/tmp/kubeconfig", http.kubeconfig())?;
//! # Ok(()) }
//! ```
//!
//! # What is implemented
//!
//! - Any registered kind (from CRD YAML with [`ApiServer::register_crd_yaml`] /
//!   [`ApiServer::register_crd_dir`], or the built-ins of [`ApiServer::register_builtin_kinds`]:
//!   Secret, ConfigMap, ServiceAccount, Event in `v1` and `events.k8s.io/v1`, Namespace,
//!   `coordination.k8s.io/v1` Lease), namespaced or cluster-scoped, at `/api/v1/...` and
//!   `/apis/{group}/{version}/...`, for every served version. Creating a
//!   `CustomResourceDefinition` through the API (e.g. `kubectl apply -f crds/`) registers its
//!   kind and reports it `Established`; deleting it removes its objects and the kind.
//! - **Versions and conversion**: objects are stored in the storage version (the one marked
//!   `storage: true`; the CRD's `status.storedVersions` accumulates every storage version it
//!   had). A request in another served version is served as kube-apiserver does it: reads,
//!   lists (one review per page) and watch events are converted from the storage version;
//!   create/update/patch/apply work on the object converted to the request's version, are
//!   validated there (a [`ApiServer::set_schema_validator`] hook gets that version's schema
//!   and the old object in that version) and are converted to the storage version to be
//!   stored. Conversion strategy `None` rewrites `apiVersion` only; `Webhook` posts an
//!   `apiextensions.k8s.io/v1` `ConversionReview` to `clientConfig.url` (HTTPS, trusting the
//!   `caBundle`, or the platform's roots without one) or to a `clientConfig.service` routed
//!   with [`ApiServer::route_service`], with a [`WEBHOOK_TIMEOUT`], never under the store's
//!   lock; the answer is checked like the real server (uid, `Success`, count, apiVersion,
//!   kind, unchanged name/namespace/uid; only label and annotation changes are kept), and a
//!   failure answers 500 `InternalError` with the real message (`conversion webhook for
//!   <group>/<version>, Kind=<Kind> failed: ...`). Printer columns and the `/status`
//!   subresource are those of the request's version. A body whose `apiVersion` names
//!   another version than the URL's is refused with 400, as on a real server.
//! - create (`generateName`, `uid`, `creationTimestamp`, `resourceVersion`, `generation: 1`),
//!   get, list (label selectors, `metadata.name`/`metadata.namespace` field selectors,
//!   `limit`/`continue`, the list's `resourceVersion`), replace with optimistic concurrency
//!   (409 on a stale `resourceVersion` or a different `uid`; a create that carries a
//!   `resourceVersion` fails with 500 like the real storage layer), delete (preconditions,
//!   propagation policies),
//!   deletecollection. A write that changes nothing keeps the resourceVersion and emits no
//!   event, as on a real server (controllers rely on it to avoid hot loops).
//! - JSON merge patch, JSON patch (RFC 6902 incl. `test`; a `test` of `null` on a missing
//!   path succeeds, which kube's finalizer helper needs), server-side apply with field
//!   managers (conflicts, `force`, list-map merge by `x-kubernetes-list-map-keys`, sets by
//!   `x-kubernetes-list-type: set`, removal of fields a manager stops applying), `dryRun`.
//! - `/status` subresource: writes to it change only status, writes to the main resource
//!   ignore status; `generation` bumps only on non-metadata, non-status changes.
//! - Finalizers and `deletionTimestamp`; no new finalizers on a deleting object; empty
//!   `finalizers`/`ownerReferences`/`labels`/`annotations` are dropped.
//! - Owner references: background, foreground (`foregroundDeletion`, `blockOwnerDeletion`)
//!   and orphan propagation; namespace deletion removes the namespace's content.
//! - Watch from a resourceVersion with ADDED/MODIFIED/DELETED, BOOKMARK, streaming lists
//!   (`sendInitialEvents` + the `k8s.io/initial-events-end` bookmark), `410 Gone` (as an
//!   ERROR event) for a compacted resourceVersion, `timeoutSeconds`, watch of one object by
//!   path; label-selector transitions appear as ADDED/DELETED like the real server. Watches
//!   stream newline-delimited JSON, in process and over HTTP.
//! - `PartialObjectMetadata` answers for kube's `get_metadata`/`list_metadata`/metadata
//!   watchers, and `Table` answers for kubectl (CRD printer columns, ages).
//! - `Status` error bodies with the real `reason` and `code`.
//! - Validation hooks per kind ([`ApiServer::set_validator`],
//!   [`ApiServer::set_schema_validator`]), fault injection ([`ApiServer::fail_next_writes`]
//!   with 409/500/504/429 or a delay, [`ApiServer::set_fault_hook`] for any single request,
//!   [`ApiServer::expire_watches`], [`ApiServer::compact`]), per-verb request counters
//!   ([`ApiServer::request_counts`], per client [`ApiServer::request_counts_of`]) and
//!   per-client request records in RBAC terms ([`ApiServer::client_named`],
//!   [`ApiServer::requests_by_client`]; over HTTP a client is named by the [`CLIENT_HEADER`]
//!   header or its `User-Agent`), direct reads for assertions ([`ApiServer::object`]),
//!   event-driven waiting ([`ApiServer::wait_for`]) and fixtures ([`ApiServer::create_yaml`]).
//! - Discovery (`/api`, `/apis`, `/api/v1`, `/apis/{g}`, `/apis/{g}/{v}`, `/version`, with
//!   preferred versions by Kubernetes version priority), so kube's `Discovery` and
//!   `kubectl get`/`apply --server-side` work against [`ApiServer::serve_http`].
//!
//! # Known differences from a real API server
//!
//! - **Conversion**: a service-routed webhook's certificate is checked against the host of
//!   the [`ApiServer::route_service`] URL, not `<name>.<namespace>.svc`, and the service port
//!   is not used; only `ConversionReview` v1 is spoken (a CRD must list `v1` in
//!   `conversionReviewVersions`). Server-side apply in a non-storage version records field
//!   ownership in the paths of the version each manager wrote (stamped with that
//!   `apiVersion`) without converting other managers' fields between versions, so ownership
//!   and conflicts are exact only among managers using the same version. A write in another
//!   version costs up to three reviews (the old object, the new one, the answer); the real
//!   server's watch cache makes fewer. [`ApiServer::object`], [`ApiServer::objects`] and
//!   [`ApiServer::wait_for`] show objects as stored (storage version);
//!   [`ApiServer::create_yaml`] cannot call a webhook (write such fixtures in the storage
//!   version). Conversion errors in watches end the watch with an ERROR event.
//! - **No defaulting, pruning or OpenAPI/CEL validation** by itself: plug a validator in
//!   with [`ApiServer::set_validator`] or [`ApiServer::set_schema_validator`] (which gets the
//!   CRD schema and the old object; the conformance suite plugs `kube-cel` in this way).
//!   Unknown fields are kept, and defaults a validator computes are not stored.
//! - **Strategic merge patch** is treated as a JSON merge patch for built-in kinds
//!   (lists are replaced, not merged by patch-merge-key); CRDs get 415 as on a real server.
//! - **Server-side apply is simplified**: ownership is tracked per leaf path, list-map item
//!   and set item; conflicts are only detected on exactly equal paths (not between a parent
//!   owned atomically and a child); `managedFields` are rendered in the FieldsV1 form (`apiVersion` is
//!   the stored object's), and `managedFields` sent by clients are ignored. Without a schema
//!   every list is atomic (ObjectMeta's `finalizers` is a set and `ownerReferences` a map by
//!   `uid` for every kind). A `null` in an applied configuration removes the field. The
//!   default manager of non-apply writes is the user agent's product token (e.g. `kubectl`),
//!   or `unknown` when there is none (kube's client sends none unless told to; `capmox run`
//!   sends `capmox/<version>`).
//! - **Reads always see the latest state**: `resourceVersion`/`resourceVersionMatch` on get
//!   and list are ignored, and `continue` pages see the current state, not a snapshot.
//! - **Watch history** is bounded per resource (10 000 events by default,
//!   [`ApiServer::set_history_limit`]); [`ApiServer::compact`] simulates an etcd compaction
//!   and [`ApiServer::expire_watches`] a watch-cache expiry. A watch whose live buffer
//!   overflows ends with a 410 ERROR event. BOOKMARKs are sent every
//!   [`ApiServer::set_bookmark_interval`] (5 s default; real: about a minute). A watch
//!   without `timeoutSeconds` lives until the client disconnects (real: 30–60 min).
//! - **Garbage collection is synchronous**: dependents are handled in the same request as
//!   the owner's removal (the real GC is asynchronous, so tests see the end state at once).
//!   An object written with only owners that were deleted before is collected at once (the
//!   real GC would find them missing); owner uids that never existed are left alone, so
//!   hand-written fixtures keep working (envtest has no GC at all).
//!   Foreground deletion deletes dependents with foreground propagation too.
//! - **Namespaces** need not exist for namespaced objects to be created unless
//!   [`ApiServer::require_namespaces`] is on; deleting a namespace marks it `Terminating`,
//!   refuses new content, deletes its content and removes it once empty. `default`,
//!   `kube-system` and `kube-public` are created by [`ApiServer::register_builtin_kinds`].
//! - **Generation** is tracked for CRDs only (built-ins keep what clients send).
//! - **Unconditional updates** (PUT without `resourceVersion`) are refused for CRDs (as on a
//!   real server) and accepted for built-ins.
//! - **Delete answers**: an object kept by finalizers is returned; an object removed at once
//!   answers with a `Success` Status for every kind (real ServiceAccounts and Pods return
//!   the object instead).
//! - **dryRun=All** is honoured for create, update, patch and delete (nothing stored), but
//!   the answer does not carry a resourceVersion bump.
//! - **Transport**: [`ApiServer::client`] must be called inside a tokio runtime (kube's
//!   client spawns its buffer worker). HTTP/1.1 only, plain HTTP on 127.0.0.1, no TLS.
//! - **Not implemented**: authentication/authorization (everything is allowed),
//!   admission webhooks, `gracePeriodSeconds` (deletion is immediate once finalizers are
//!   gone), subresources other than `status` (`scale`, `eviction`, ...), field selectors
//!   on custom resources other than `metadata.name`/`metadata.namespace` (built-in kinds
//!   accept any dotted path, more than a real server), `selfLink`, protobuf (typed kubectl
//!   commands for built-in kinds such as `kubectl create secret` send protobuf and get 415;
//!   `kubectl apply` sends JSON/YAML and works), Table watch events (`kubectl get -w` falls
//!   back to its own columns), aggregated discovery (kubectl falls back to the legacy
//!   documents), OpenAPI documents (`/openapi/v2`, `/openapi/v3` return 404; kubectl only
//!   needs them for `explain` and client-side validation, so use `--validate=false` with
//!   `kubectl apply`). Deleting a CustomResourceDefinition removes its custom resources at
//!   once, ignoring their finalizers (a real server deletes them one by one, honouring
//!   finalizers); CRD validation is limited to what registering needs (group, names,
//!   versions).

mod convert;
mod error;
mod kinds;
mod patch;
mod router;
pub mod schema;
mod selector;
mod service;
mod store;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;

pub use convert::WEBHOOK_TIMEOUT;
pub use error::ApiError;
pub use kinds::{
    ConversionStrategy, GroupResource, KindError, KindInfo, ServiceReference, WebhookClientConfig,
};
pub use router::{CLIENT_HEADER, ResponseBody};
pub use service::{ApiService, HttpServer, ServeError};
pub use store::{
    ClientRequest, FaultHook, FaultKind, RequestCounts, RequestInfo, ValidationInput, Validator,
};

use store::Store;

/// Errors of the testkit's public API.
#[derive(Debug, thiserror::Error)]
pub enum TestkitError {
    /// A CRD could not be read or parsed.
    #[error(transparent)]
    Kind(#[from] KindError),
    /// The HTTP server could not start.
    #[error(transparent)]
    Serve(#[from] ServeError),
    /// A name given to a helper does not match any registered kind.
    #[error("no registered kind matches {0:?}")]
    UnknownKind(String),
    /// [`ApiServer::wait_for`] ran out of time; carries the last state seen.
    #[error("timed out after {timeout:?} waiting for {what}; last state: {last}")]
    Timeout {
        /// What was awaited (`kind namespace/name`).
        what: String,
        /// The timeout.
        timeout: Duration,
        /// The last state seen (`null` when absent).
        last: Value,
    },
    /// A manifest given to [`ApiServer::create_yaml`] did not parse.
    #[error("invalid manifest YAML: {0}")]
    Yaml(#[from] serde_norway::Error),
    /// The server refused an object given to [`ApiServer::create_yaml`].
    #[error("{0}")]
    Api(#[from] ApiError),
}

/// A fake Kubernetes API server; clones share the same state.
#[derive(Clone, Default)]
pub struct ApiServer {
    store: Arc<Store>,
}

/// Longest `events.k8s.io/v1` Event note the real API server accepts (bytes).
pub const EVENT_NOTE_LIMIT: usize = 1024;

impl ApiServer {
    /// An empty server with no kinds registered.
    pub fn new() -> Self {
        Self::default()
    }

    /// Register the built-in kinds and create the `default`, `kube-system` and `kube-public`
    /// namespaces.
    pub fn register_builtin_kinds(&self) -> &Self {
        for k in KindInfo::builtins() {
            self.store.register(k);
        }
        if let Some(ns_kind) = self.store.find_kind("namespaces") {
            for ns in ["default", "kube-system", "kube-public"] {
                let obj = serde_json::json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}});
                let opts = store::WriteOptions {
                    manager: "testkit".into(),
                    ..Default::default()
                };
                // AlreadyExists on a second call is fine.
                let _ = self.store.create(&ns_kind, "", obj, &opts);
            }
        }
        // As the real API server: an Event's note is at most 1 kB.
        let _ = self.set_validator("events.events.k8s.io", |event| {
            let note = event["note"].as_str().unwrap_or_default();
            if note.len() > EVENT_NOTE_LIMIT {
                return Err(format!(
                    "note: Too long: may not be more than {EVENT_NOTE_LIMIT} bytes"
                ));
            }
            Ok(())
        });
        self
    }

    /// Register a kind described by hand.
    pub fn register_kind(&self, kind: KindInfo) -> &Self {
        self.store.register(kind);
        self
    }

    /// Register every CustomResourceDefinition in a (multi-document) YAML string.
    /// When the built-in kinds are registered, the CRD objects are stored too (so
    /// `kubectl get crds` lists them).
    pub fn register_crd_yaml(&self, yaml: &str) -> Result<Vec<KindInfo>, TestkitError> {
        let crd_kind = self
            .store
            .find_kind("customresourcedefinitions.apiextensions.k8s.io");
        let opts = store::WriteOptions {
            manager: "testkit".into(),
            ..Default::default()
        };
        let mut kinds = Vec::new();
        for doc in serde_norway::Deserializer::from_str(yaml) {
            let crd = <Value as serde::Deserialize>::deserialize(doc).map_err(KindError::from)?;
            if crd.is_null() {
                continue;
            }
            let k = KindInfo::from_crd(&crd)?;
            tracing::debug!(kind = %k.kind, group = %k.group, "testkit: registered CRD");
            self.store.register(k.clone());
            if let Some(ck) = &crd_kind {
                match self.store.create(ck, "", crd, &opts) {
                    Ok(_) | Err(ApiError::AlreadyExists { .. }) => {}
                    Err(e) => return Err(e.into()),
                }
            }
            kinds.push(k);
        }
        Ok(kinds)
    }

    /// Register the CRDs of one YAML file.
    pub fn register_crd_file(&self, path: impl AsRef<Path>) -> Result<Vec<KindInfo>, TestkitError> {
        let path = path.as_ref();
        let yaml = std::fs::read_to_string(path).map_err(|source| KindError::Io {
            path: path.display().to_string(),
            source,
        })?;
        self.register_crd_yaml(&yaml)
    }

    /// Register the CRDs of every `*.yaml`/`*.yml` file in a folder (not recursive).
    pub fn register_crd_dir(&self, dir: impl AsRef<Path>) -> Result<Vec<KindInfo>, TestkitError> {
        let dir = dir.as_ref();
        let io = |source| KindError::Io {
            path: dir.display().to_string(),
            source,
        };
        let mut paths: Vec<_> = std::fs::read_dir(dir)
            .map_err(io)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "yaml" || x == "yml"))
            .collect();
        paths.sort();
        let mut out = Vec::new();
        for p in paths {
            out.extend(self.register_crd_file(p)?);
        }
        Ok(out)
    }

    /// The registered kinds.
    pub fn kinds(&self) -> Vec<KindInfo> {
        self.store.kinds().iter().map(|k| (**k).clone()).collect()
    }

    fn kind(&self, name: &str) -> Result<Arc<KindInfo>, TestkitError> {
        self.store
            .find_kind(name)
            .ok_or_else(|| TestkitError::UnknownKind(name.to_string()))
    }

    /// The `tower::Service` that serves this server in process.
    pub fn service(&self) -> ApiService {
        ApiService::new(self.store.clone())
    }

    /// A `kube::Client` talking to this server in process (default namespace `default`).
    pub fn client(&self) -> kube::Client {
        kube::Client::new(self.service(), "default")
    }

    /// A `kube::Client` whose requests are attributed to `name`, so a test can tell what one
    /// component asked for among everything else the server served (e.g. the API calls an
    /// RBAC role must allow); see [`ApiServer::requests_by_client`].
    pub fn client_named(&self, name: &str) -> kube::Client {
        kube::Client::new(ApiService::named(self.store.clone(), name), "default")
    }

    /// Every distinct request made by the clients named `name` (through
    /// [`ApiServer::client_named`], or over HTTP with the [`CLIENT_HEADER`] header or else
    /// the product token of the `User-Agent`, e.g. `capmox` for `capmox/0.1.0`), in RBAC
    /// terms, with how often it was made; requests that matched no route are not recorded.
    /// [`ApiServer::reset_request_counts`] clears it.
    pub fn requests_by_client(&self, name: &str) -> std::collections::BTreeMap<ClientRequest, u64> {
        self.store.client_counts(name)
    }

    /// Serve over HTTP on 127.0.0.1 with an OS-chosen port, until the handle is dropped.
    pub async fn serve_http(&self) -> Result<HttpServer, TestkitError> {
        Ok(HttpServer::start(self.store.clone()).await?)
    }

    /// Make the next `n` writes (create/update/patch/delete) of a kind fail with `fault`.
    /// `kind` is a plural, singular, kind or short name, optionally `.group`-qualified.
    pub fn fail_next_writes(
        &self,
        kind: &str,
        n: usize,
        fault: FaultKind,
    ) -> Result<(), TestkitError> {
        let k = self.kind(kind)?;
        self.store.fail_next_writes(k.group_resource(), n, fault);
        Ok(())
    }

    /// Decide per request (any verb, any kind) whether to inject a fault, e.g. fail only
    /// status patches of one object; replaces any previous hook. Runs after the queued
    /// faults of [`ApiServer::fail_next_writes`]; requests are counted either way.
    pub fn set_fault_hook(
        &self,
        hook: impl Fn(&RequestInfo<'_>) -> Option<FaultKind> + Send + Sync + 'static,
    ) {
        self.store.set_fault_hook(Some(Arc::new(hook)));
    }

    /// Remove the per-request fault hook.
    pub fn clear_fault_hook(&self) {
        self.store.set_fault_hook(None);
    }

    /// Validate every create/update of a kind; `Err(msg)` becomes a 422 Invalid.
    pub fn set_validator(
        &self,
        kind: &str,
        validator: impl Fn(&Value) -> Result<(), String> + Send + Sync + 'static,
    ) -> Result<(), TestkitError> {
        self.set_schema_validator(kind, move |input: &ValidationInput<'_>| {
            validator(input.object)
        })
    }

    /// Validate every create/update of a kind with access to the CRD schema of the object's
    /// version and the old object (for CEL transition rules); replaces any previous hook.
    /// Validators run while the store is locked: they must not call back into the server.
    pub fn set_schema_validator(
        &self,
        kind: &str,
        validator: impl Fn(&ValidationInput<'_>) -> Result<(), String> + Send + Sync + 'static,
    ) -> Result<(), TestkitError> {
        let k = self.kind(kind)?;
        self.store
            .set_validator(k.group_resource(), Arc::new(validator));
        Ok(())
    }

    /// Send the conversion-webhook calls of CRDs whose `clientConfig.service` is
    /// `namespace/name` to `base_url` (`https://127.0.0.1:<port>`, or `http://...` for a webhook
    /// without TLS), with the service's `path` appended; the certificate is checked against
    /// the host of `base_url` (a real server checks `<name>.<namespace>.svc`) with the CRD's
    /// `caBundle`. A service without a route fails conversions like an unreachable webhook.
    pub fn route_service(&self, namespace: &str, name: &str, base_url: &str) {
        self.store
            .route_service(namespace, name, Some(base_url.to_string()));
    }

    /// Remove the route of [`ApiServer::route_service`].
    pub fn unroute_service(&self, namespace: &str, name: &str) {
        self.store.route_service(namespace, name, None);
    }

    /// Snapshot of the per-verb request counters.
    pub fn request_counts(&self) -> RequestCounts {
        self.store.counts()
    }

    /// Snapshot of the per-verb request counters of the clients named `name` (as
    /// [`ApiServer::requests_by_client`] names them), watch streams the server ended included,
    /// so a benchmark can tell one component's load from the rest; every request counts once.
    pub fn request_counts_of(&self, name: &str) -> RequestCounts {
        self.store.counts_of(name)
    }

    /// Total number of API requests served (discovery included).
    pub fn request_count(&self) -> u64 {
        self.store.counts().total()
    }

    /// Reset the request counters (e.g. after test setup).
    pub fn reset_request_counts(&self) {
        self.store.reset_counts();
    }

    /// The current global resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.store.resource_version()
    }

    /// Forget the watch history: watches from an older resourceVersion get 410 Gone.
    pub fn compact(&self) {
        self.store.compact();
    }

    /// End every open watch with a 410 Expired ERROR event, as a real server does when its
    /// watch cache falls behind; kube's watcher must then relist.
    pub fn expire_watches(&self) {
        self.store.expire_watches();
    }

    /// Make creating a namespaced object in a missing namespace fail with 404 NotFound, as on
    /// a real server (off by default so tests need not create namespaces).
    pub fn require_namespaces(&self, on: bool) -> &Self {
        self.store.set_require_namespaces(on);
        self
    }

    /// Bound the watch history kept per resource.
    pub fn set_history_limit(&self, events: usize) {
        self.store.set_history_limit(events);
    }

    /// How often watches that allow bookmarks receive a BOOKMARK (for new watches).
    pub fn set_bookmark_interval(&self, interval: Duration) {
        self.store.set_bookmark_interval(interval);
    }

    /// Read one object as stored, in the storage version (for assertions); `namespace` is
    /// `""` for cluster scope.
    pub fn object(
        &self,
        kind: &str,
        namespace: &str,
        name: &str,
    ) -> Result<Option<Value>, TestkitError> {
        let k = self.kind(kind)?;
        Ok(self.store.peek(&k.group_resource(), namespace, name))
    }

    /// All objects of a kind (for assertions).
    pub fn objects(&self, kind: &str) -> Result<Vec<Value>, TestkitError> {
        let k = self.kind(kind)?;
        Ok(self.store.peek_all(&k.group_resource()))
    }

    /// Wait until one object satisfies `pred` (called with `None` while it does not exist),
    /// driven by the server's change feed rather than polling or sleeps; returns the
    /// matching state. `namespace` is `""` for cluster-scoped kinds.
    pub async fn wait_for(
        &self,
        kind: &str,
        namespace: &str,
        name: &str,
        timeout: Duration,
        pred: impl Fn(Option<&Value>) -> bool,
    ) -> Result<Option<Value>, TestkitError> {
        let k = self.kind(kind)?;
        let gr = k.group_resource();
        let (mut current, mut rx) = self.store.observe(&gr, namespace, name);
        let wait = async {
            loop {
                if pred(current.as_ref()) {
                    return Ok(current.clone());
                }
                match rx.recv().await {
                    Ok(rec) => {
                        let m = &rec.object["metadata"];
                        if rec.gr == gr
                            && m["name"] == name
                            && m["namespace"].as_str().unwrap_or("") == namespace
                        {
                            current = match rec.event {
                                store::EventType::Deleted => None,
                                _ => Some((*rec.object).clone()),
                            };
                        }
                    }
                    // Missed events: re-read the state and keep waiting.
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {
                        let (now, fresh) = self.store.observe(&gr, namespace, name);
                        current = now;
                        rx = fresh;
                    }
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => {
                        return Err(current.clone());
                    }
                }
            }
        };
        let last = match tokio::time::timeout(timeout, wait).await {
            Ok(Ok(found)) => return Ok(found),
            Ok(Err(last)) => last,
            Err(_) => self.store.peek(&gr, namespace, name),
        };
        Err(TestkitError::Timeout {
            what: format!("{} {namespace}/{name}", k.kind),
            timeout,
            last: last.unwrap_or(Value::Null),
        })
    }

    /// Create every object of a (multi-document) YAML manifest, synchronously, as field
    /// manager `testkit`; namespaced objects without a namespace go to `default`. A `status`
    /// in the manifest is written through `/status` after the create, so fixtures can seed
    /// what other controllers would have reported. Returns the stored objects.
    ///
    /// An object in a version other than the storage version is stored in the storage
    /// version: with conversion strategy `None` only its `apiVersion` changes (validators see
    /// the storage version); a kind converted by a webhook must be written in its storage
    /// version here (this helper is synchronous and cannot call the webhook) or created
    /// through a client.
    pub fn create_yaml(&self, yaml: &str) -> Result<Vec<Value>, TestkitError> {
        let opts = store::WriteOptions {
            manager: "testkit".into(),
            ..Default::default()
        };
        let mut out = Vec::new();
        for doc in serde_norway::Deserializer::from_str(yaml) {
            let mut obj = <Value as serde::Deserialize>::deserialize(doc)?;
            if obj.is_null() {
                continue;
            }
            let api_version = obj["apiVersion"].as_str().unwrap_or("").to_string();
            let (group, version) = api_version.rsplit_once('/').unwrap_or(("", &api_version));
            let kind_name = obj["kind"].as_str().unwrap_or("");
            let kind = self
                .store
                .kinds()
                .into_iter()
                .find(|k| {
                    k.group == group
                        && k.kind == kind_name
                        && k.versions.iter().any(|v| v == version)
                })
                .ok_or_else(|| TestkitError::UnknownKind(format!("{api_version} {kind_name}")))?;
            if kind.needs_conversion(version) {
                if let ConversionStrategy::Webhook(_) = kind.conversion {
                    return Err(ApiError::BadRequest(format!(
                        "create_yaml cannot convert {api_version} {kind_name} through its conversion webhook: write it in {} or create it through a client",
                        kind.api_version(kind.storage_version())
                    ))
                    .into());
                }
                obj["apiVersion"] = serde_json::json!(kind.api_version(kind.storage_version()));
            }
            let ns = if kind.namespaced {
                obj["metadata"]["namespace"]
                    .as_str()
                    .unwrap_or("default")
                    .to_string()
            } else {
                String::new()
            };
            let status = obj.get("status").cloned();
            let mut created = self.store.create(&kind, &ns, obj, &opts)?;
            if kind.status_subresource
                && let Some(status) = status
            {
                let name = created["metadata"]["name"]
                    .as_str()
                    .unwrap_or("")
                    .to_string();
                let mut with_status = created.clone();
                with_status["status"] = status;
                created =
                    self.store
                        .update(&kind, &ns, &name, with_status, store::Sub::Status, &opts)?;
            }
            out.push(created);
        }
        Ok(out)
    }
}
