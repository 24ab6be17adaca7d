//! The manager's HTTP endpoints: `/healthz` (alive), `/readyz` (caches synced and, with leader
//! election, leading) and `/metrics` (Prometheus text format).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
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

/// Readiness as the probes see it; flipped by the manager as caches sync and leadership changes.
#[derive(Clone, Debug, Default)]
pub struct Readiness(Arc<AtomicBool>);

impl Readiness {
    /// Marks the manager ready or not ready.
    pub fn set(&self, ready: bool) {
        self.0.store(ready, Ordering::SeqCst);
    }

    /// Whether `/readyz` answers 200.
    pub fn is_ready(&self) -> bool {
        self.0.load(Ordering::SeqCst)
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
        "/readyz" if readiness.is_ready() => text(StatusCode::OK, "ok\n".into()),
        "/readyz" => text(
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: caches are syncing or this replica is not the leader\n".into(),
        ),
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
