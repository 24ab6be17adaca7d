//! The manager's HTTP endpoints: `/healthz` (alive), `/readyz` (caches synced and, with leader
//! election, leading) and `/metrics` (Prometheus text format).

use std::collections::BTreeSet;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::metrics::Metrics;

/// Why the HTTP endpoints could not be served.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    /// The listen address is taken or not allowed.
    #[error(
        "cannot listen on {address} (is another process using it? change the bind address flag): {source}"
    )]
    Bind {
        /// The address asked for.
        address: SocketAddr,
        /// Underlying error.
        source: std::io::Error,
    },
}

/// Readiness as the probes see it: a leader (or a manager without election) is ready once
/// every controller's cache holds its first full list, so it never reports ready while it would
/// still act on an empty view of the cluster; a follower waiting for the Lease is ready, so a
/// rolling update can bring it up while the old replica still leads.
#[derive(Clone, Debug)]
pub struct Readiness(Arc<watch::Sender<ReadinessState>>);

/// What `/readyz` is waiting for.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReadinessState {
    /// This replica leads (always true without leader election once the manager starts).
    pub leading: bool,
    /// This replica waits for the Lease, ready to take over.
    pub standby: bool,
    /// Controllers whose caches must be synced before the manager is ready.
    pub expected: BTreeSet<String>,
    /// Controllers whose caches have synced.
    pub synced: BTreeSet<String>,
}

impl ReadinessState {
    /// Ready once leading and at least one controller is expected and all expected have synced.
    pub fn is_ready(&self) -> bool {
        self.leading && !self.expected.is_empty() && self.expected.is_subset(&self.synced)
    }

    /// Controllers still listing their objects.
    pub fn syncing(&self) -> Vec<&str> {
        self.expected
            .difference(&self.synced)
            .map(String::as_str)
            .collect()
    }
}

impl Default for Readiness {
    fn default() -> Self {
        Self(Arc::new(watch::Sender::new(ReadinessState::default())))
    }
}

impl Readiness {
    /// Records whether this replica leads; losing the lead makes the manager not ready.
    pub fn set_leading(&self, leading: bool) {
        self.0.send_modify(|state| state.leading = leading);
    }

    /// Records whether this replica stands by for the Lease (ready for the probes).
    pub fn set_standby(&self, standby: bool) {
        self.0.send_modify(|state| state.standby = standby);
    }

    /// Declares a controller whose cache must sync before the manager is ready.
    pub fn expect(&self, controller: &str) {
        self.0.send_modify(|state| {
            state.expected.insert(controller.to_owned());
            state.synced.remove(controller);
        });
    }

    /// Records that a controller's cache holds the result of its first full list.
    pub fn mark_synced(&self, controller: &str) {
        self.0.send_modify(|state| {
            state.synced.insert(controller.to_owned());
        });
    }

    /// Forgets every controller (they stopped); the manager is not ready until they start again.
    pub fn reset_controllers(&self) {
        self.0.send_modify(|state| {
            state.expected.clear();
            state.synced.clear();
        });
    }

    /// Whether `/readyz` answers 200.
    pub fn is_ready(&self) -> bool {
        self.0.borrow().is_ready()
    }

    /// A snapshot of what readiness waits for.
    pub fn state(&self) -> ReadinessState {
        self.0.borrow().clone()
    }

    /// Resolves once the manager is ready (for callers that must not act earlier, and tests).
    pub async fn wait_ready(&self) {
        let mut receiver = self.0.subscribe();
        // The sender lives in `self`, so the channel cannot close while we wait.
        let _ = receiver.wait_for(ReadinessState::is_ready).await;
    }
}

/// A bound HTTP endpoint server; `serve` answers until the token is cancelled.
pub struct EndpointServer {
    listener: TcpListener,
    metrics: Metrics,
    readiness: Readiness,
}

impl EndpointServer {
    /// Binds the address now, so a taken port fails at start-up with a clear error.
    pub async fn bind(
        address: SocketAddr,
        metrics: Metrics,
        readiness: Readiness,
    ) -> Result<Self, HttpError> {
        let listener = TcpListener::bind(address)
            .await
            .map_err(|source| HttpError::Bind { address, source })?;
        Ok(Self {
            listener,
            metrics,
            readiness,
        })
    }

    /// The address actually bound (useful with port 0).
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.listener.local_addr().ok()
    }

    /// Answers requests until `shutdown` is cancelled.
    pub async fn serve(self, shutdown: CancellationToken) {
        loop {
            let accepted = tokio::select! {
                () = shutdown.cancelled() => return,
                accepted = self.listener.accept() => accepted,
            };
            let Ok((stream, _)) = accepted else {
                continue;
            };
            let metrics = self.metrics.clone();
            let readiness = self.readiness.clone();
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |request| {
                    let response = respond(&request, &metrics, &readiness);
                    async move { Ok::<_, Infallible>(response) }
                });
                let connection = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service);
                if let Err(error) = connection.await {
                    tracing::debug!(%error, "probe connection ended with an error");
                }
            });
        }
    }
}

fn respond(
    request: &Request<Incoming>,
    metrics: &Metrics,
    readiness: &Readiness,
) -> Response<Full<Bytes>> {
    if request.method() != Method::GET {
        return text(
            StatusCode::METHOD_NOT_ALLOWED,
            "only GET is supported\n".into(),
        );
    }
    match request.uri().path() {
        "/healthz" | "/livez" => text(StatusCode::OK, "ok\n".into()),
        "/readyz" => {
            let state = readiness.state();
            if state.is_ready() {
                text(StatusCode::OK, "ok\n".into())
            } else if state.standby && !state.leading {
                text(
                    StatusCode::OK,
                    "ok: standing by for the leader election Lease\n".into(),
                )
            } else if !state.leading {
                text(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "not ready: the manager is starting\n".into(),
                )
            } else if state.expected.is_empty() {
                text(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "not ready: controllers are starting\n".into(),
                )
            } else {
                text(
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!(
                        "not ready: caches are syncing for {}\n",
                        state.syncing().join(", ")
                    ),
                )
            }
        }
        "/metrics" => {
            let mut response = text(StatusCode::OK, metrics.render());
            if let Ok(value) = "application/openmetrics-text; version=1.0.0; charset=utf-8".parse()
            {
                response
                    .headers_mut()
                    .insert(hyper::header::CONTENT_TYPE, value);
            }
            response
        }
        _ => text(
            StatusCode::NOT_FOUND,
            "not found: try /healthz, /readyz or /metrics\n".into(),
        ),
    }
}

fn text(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response
}
