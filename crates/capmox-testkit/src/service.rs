//! Transports: a `tower::Service` for `kube::Client::new` and a hyper HTTP/1 server on
//! 127.0.0.1 for out-of-process clients (`capmox run`, `kubectl`).

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::BodyExt;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use super::error::ApiError;
use super::router::{self, ResponseBody};
use super::store::Store;

/// Errors while starting the HTTP server.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// Binding 127.0.0.1:0 failed.
    #[error("cannot bind 127.0.0.1: {0}")]
    Bind(#[source] std::io::Error),
}

/// The in-process transport: hand it to `kube::Client::new`.
#[derive(Clone)]
pub struct ApiService {
    store: Arc<Store>,
    client: Option<router::ClientName>,
}

impl ApiService {
    pub(super) fn new(store: Arc<Store>) -> Self {
        ApiService {
            store,
            client: None,
        }
    }

    /// The same transport, with every request attributed to `client` (see
    /// [`super::ApiServer::requests_by_client`]).
    pub(super) fn named(store: Arc<Store>, client: &str) -> Self {
        ApiService {
            store,
            client: Some(router::ClientName(client.into())),
        }
    }
}
fn bad_body(e: impl std::fmt::Display) -> Response<ResponseBody> {
    let err = ApiError::BadRequest(format!("cannot read request body: {e}"));
    let mut resp = Response::new(ResponseBody::from_status(&err));
    *resp.status_mut() = http::StatusCode::BAD_REQUEST;
    resp
}

impl tower::Service<Request<kube::client::Body>> for ApiService {
    type Response = Response<ResponseBody>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<kube::client::Body>) -> Self::Future {
        let store = self.store.clone();
        let client = self.client.clone();
        Box::pin(async move {
            let (mut parts, body) = req.into_parts();
            if let Some(client) = client {
                parts.extensions.insert(client);
            }
            let bytes = match body.collect().await {
                Ok(c) => c.to_bytes(),
                Err(e) => return Ok(bad_body(e)),
            };
            Ok(router::handle(store, Request::from_parts(parts, bytes)).await)
        })
    }
}

/// A running HTTP form of the server; stops when dropped.
pub struct HttpServer {
    addr: SocketAddr,
    task: JoinHandle<()>,
}

impl HttpServer {
    pub(super) async fn start(store: Arc<Store>) -> Result<Self, ServeError> {
        let listener = TcpListener::bind(("127.0.0.1", 0))
            .await
            .map_err(ServeError::Bind)?;
        let addr = listener.local_addr().map_err(ServeError::Bind)?;
        let task = tokio::spawn(async move {
            let mut conns = tokio::task::JoinSet::new();
            loop {
                let (stream, _) = match listener.accept().await {
                    Ok(s) => s,
                    Err(e) => {
                        tracing::warn!(error = %e, "testkit: accept failed");
                        continue;
                    }
                };
                let store = store.clone();
                conns.spawn(async move {
                    let svc =
                        hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                            let store = store.clone();
                            async move {
                                let (parts, body) = req.into_parts();
                                let bytes: Bytes = match body.collect().await {
                                    Ok(c) => c.to_bytes(),
                                    Err(e) => return Ok::<_, Infallible>(bad_body(e)),
                                };
                                Ok(router::handle(store, Request::from_parts(parts, bytes)).await)
                            }
                        });
                    if let Err(e) = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await
                    {
                        tracing::debug!(error = %e, "testkit: connection ended with error");
                    }
                });
                // Reap finished connections so the set does not grow without bound.
                while conns.try_join_next().is_some() {}
            }
        });
        tracing::info!(%addr, "testkit: API server listening");
        Ok(HttpServer { addr, task })
    }

    /// The bound address (127.0.0.1 and an OS-chosen port).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Base URL, e.g. `http://127.0.0.1:40123`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// A kubeconfig (YAML) pointing at this server, for `kubectl` or a `capmox run` process.
    pub fn kubeconfig(&self) -> String {
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: testkit\n  cluster:\n    server: {}\ncontexts:\n- name: testkit\n  context:\n    cluster: testkit\n    user: testkit\n    namespace: default\ncurrent-context: testkit\nusers:\n- name: testkit\n  user: {{}}\npreferences: {{}}\n",
            self.url()
        )
    }

    /// Write the kubeconfig to a file.
    pub fn write_kubeconfig(&self, path: impl AsRef<std::path::Path>) -> std::io::Result<()> {
        std::fs::write(path, self.kubeconfig())
    }
}

impl Drop for HttpServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}
