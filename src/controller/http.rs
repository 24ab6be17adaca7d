//! The manager's HTTP endpoints: `/healthz` (alive), `/readyz` (caches synced and, with leader
//! election, leading) and `/metrics` (Prometheus text format); and what every listener of the
//! manager shares (the webhook's too): dual-stack binding, timeouts, a connection cap and a
//! back-off on `accept` errors.

use std::collections::BTreeSet;
use std::convert::Infallible;
use std::future::Future;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
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

/// Timeouts and caps of one HTTP listener, so a slow or hostile client holds neither a task
/// nor memory for long.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServerLimits {
    /// Time to receive a request's headers, counted from the connection's start or the end of
    /// the previous response: it is also the idle keep-alive timeout.
    pub header_read_timeout: Duration,
    /// Time for a whole request, from its headers to the response (reading the body included).
    pub request_timeout: Duration,
    /// Time for a TLS handshake (listeners that serve TLS).
    pub handshake_timeout: Duration,
    /// Connections served at once; more wait in the kernel's accept queue until one closes.
    pub max_connections: usize,
}

impl ServerLimits {
    /// The probe and metrics listener: kubelet and Prometheus open a few short connections.
    pub const ENDPOINTS: Self = Self {
        header_read_timeout: Duration::from_secs(10),
        request_timeout: Duration::from_secs(30),
        handshake_timeout: Duration::from_secs(10),
        max_connections: 32,
    };
}

/// Binds `address`; the unspecified IPv6 address (`[::]`, what the flags' `:PORT` means)
/// listens on both families, falling back to `0.0.0.0` where the host has no IPv6.
pub async fn bind_listener(address: SocketAddr) -> std::io::Result<TcpListener> {
    if address.ip() != Ipv6Addr::UNSPECIFIED {
        return TcpListener::bind(address).await;
    }
    match bind_dual_stack(address) {
        Ok(listener) => Ok(listener),
        Err(error) if no_ipv6(&error) => {
            let fallback = SocketAddr::from((Ipv4Addr::UNSPECIFIED, address.port()));
            tracing::info!(%address, %fallback, %error, "IPv6 is unavailable; listening on IPv4 only");
            TcpListener::bind(fallback).await
        }
        Err(error) => Err(error),
    }
}

/// An IPv6 socket that also accepts IPv4 (mapped addresses), whatever the host's
/// `net.ipv6.bindv6only` says.
fn bind_dual_stack(address: SocketAddr) -> std::io::Result<TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(Domain::IPV6, Type::STREAM, Some(Protocol::TCP))?;
    socket.set_only_v6(false)?;
    socket.set_reuse_address(true)?;
    socket.set_nonblocking(true)?;
    socket.bind(&address.into())?;
    socket.listen(1024)?;
    TcpListener::from_std(socket.into())
}

/// Whether binding failed because the host (or the pod) has IPv6 disabled.
fn no_ipv6(error: &std::io::Error) -> bool {
    // EAFNOSUPPORT (97) when the kernel has no IPv6; EADDRNOTAVAIL when `[::]` is not assigned.
    error.raw_os_error() == Some(97) || error.kind() == std::io::ErrorKind::AddrNotAvailable
}

/// Where an accept loop stands after errors: each failed `accept` (e.g. EMFILE, out of file
/// descriptors) waits twice as long as the one before, up to a second, instead of spinning.
#[derive(Debug, Default)]
pub struct AcceptBackoff {
    failures: u32,
}

impl AcceptBackoff {
    const FIRST: Duration = Duration::from_millis(5);
    const MAX: Duration = Duration::from_secs(1);

    /// Records a failed accept; returns how long to wait before the next one. The first error
    /// of a streak is logged, the rest only counted.
    pub fn failed(&mut self, error: &std::io::Error, listener: &str) -> Duration {
        if self.failures == 0 {
            tracing::warn!(listener, %error, "accepting a connection failed; backing off until accepting works again");
        }
        self.failures = self.failures.saturating_add(1);
        let doublings = (self.failures - 1).min(16);
        Self::FIRST.saturating_mul(1 << doublings).min(Self::MAX)
    }

    /// Records a successful accept, ending a streak of errors (logged with its length).
    pub fn succeeded(&mut self, listener: &str) {
        if self.failures > 0 {
            tracing::info!(
                listener,
                failures = self.failures,
                "accepting connections again"
            );
            self.failures = 0;
        }
    }
}

/// Something connections are accepted from (a [`TcpListener`]; a fake in tests).
pub trait Accept {
    /// The accepted connection.
    type Stream;
    /// Waits for the next connection.
    fn accept(&self) -> impl Future<Output = std::io::Result<(Self::Stream, SocketAddr)>> + Send;
}

impl Accept for TcpListener {
    type Stream = TcpStream;
    fn accept(&self) -> impl Future<Output = std::io::Result<(TcpStream, SocketAddr)>> + Send {
        TcpListener::accept(self)
    }
}

/// Accepts the next connection once fewer than `limit`'s permits are taken, backing off on
/// errors; `None` once `shutdown` is cancelled. The permit lives as long as the connection.
pub async fn accept_next<A: Accept + Sync>(
    listener: &A,
    limit: &Arc<Semaphore>,
    backoff: &mut AcceptBackoff,
    name: &str,
    shutdown: &CancellationToken,
) -> Option<(A::Stream, SocketAddr, OwnedSemaphorePermit)> {
    loop {
        let permit = tokio::select! {
            () = shutdown.cancelled() => return None,
            permit = limit.clone().acquire_owned() => permit.ok()?,
        };
        let accepted = tokio::select! {
            () = shutdown.cancelled() => return None,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((stream, peer)) => {
                backoff.succeeded(name);
                return Some((stream, peer, permit));
            }
            Err(error) => {
                drop(permit);
                let wait = backoff.failed(&error, name);
                tokio::select! {
                    () = shutdown.cancelled() => return None,
                    () = tokio::time::sleep(wait) => {}
                }
            }
        }
    }
}

/// Serves HTTP/1 on one connection with `limits`' header, idle and request timeouts; on
/// `shutdown` the request in flight finishes, then the connection closes.
pub async fn serve_http1<I, F, Fut>(
    io: I,
    limits: ServerLimits,
    handler: F,
    shutdown: CancellationToken,
) -> Result<(), hyper::Error>
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    F: Fn(Request<Incoming>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Response<Full<Bytes>>> + Send + 'static,
{
    let handler = Arc::new(handler);
    let service = hyper::service::service_fn(move |request| {
        let handler = handler.clone();
        async move {
            let response = tokio::time::timeout(limits.request_timeout, handler(request))
                .await
                .unwrap_or_else(|_| {
                    text(
                        StatusCode::REQUEST_TIMEOUT,
                        format!(
                            "the request took longer than {:?}\n",
                            limits.request_timeout
                        ),
                    )
                });
            Ok::<_, Infallible>(response)
        }
    });
    let connection = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .serve_connection(TokioIo::new(io), service);
    let mut connection = std::pin::pin!(connection);
    tokio::select! {
        ended = connection.as_mut() => ended,
        () = shutdown.cancelled() => {
            connection.as_mut().graceful_shutdown();
            connection.await
        }
    }
}

/// A bound HTTP endpoint server; `serve` answers until the token is cancelled.
pub struct EndpointServer {
    listener: TcpListener,
    metrics: Metrics,
    readiness: Readiness,
    limits: ServerLimits,
}

impl EndpointServer {
    /// Binds the address now, so a taken port fails at start-up with a clear error.
    pub async fn bind(
        address: SocketAddr,
        metrics: Metrics,
        readiness: Readiness,
    ) -> Result<Self, HttpError> {
        let listener = bind_listener(address)
            .await
            .map_err(|source| HttpError::Bind { address, source })?;
        Ok(Self {
            listener,
            metrics,
            readiness,
            limits: ServerLimits::ENDPOINTS,
        })
    }

    /// Serves with these limits instead of [`ServerLimits::ENDPOINTS`] (tests shorten them).
    #[must_use]
    pub fn with_limits(mut self, limits: ServerLimits) -> Self {
        self.limits = limits;
        self
    }

    /// The address actually bound (useful with port 0).
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.listener.local_addr().ok()
    }

    /// Answers requests until `shutdown` is cancelled.
    pub async fn serve(self, shutdown: CancellationToken) {
        let limit = Arc::new(Semaphore::new(self.limits.max_connections));
        let mut backoff = AcceptBackoff::default();
        while let Some((stream, peer, permit)) = accept_next(
            &self.listener,
            &limit,
            &mut backoff,
            "health/metrics",
            &shutdown,
        )
        .await
        {
            let metrics = self.metrics.clone();
            let readiness = self.readiness.clone();
            let handler = move |request: Request<Incoming>| {
                let response = respond(&request, &metrics, &readiness);
                async move { response }
            };
            let (limits, shutdown) = (self.limits, shutdown.clone());
            tokio::spawn(async move {
                if let Err(error) = serve_http1(stream, limits, handler, shutdown).await {
                    tracing::debug!(%peer, %error, "probe connection ended with an error");
                }
                drop(permit);
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
