//! A loopback HTTP server that answers every request with one canned response
//! (status, reason phrase, body) and records the requests it saw.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;

/// The canned response.
#[derive(Clone, Debug, Default)]
pub struct Canned {
    pub status: u16,
    pub reason: Option<String>,
    pub body: Vec<u8>,
}

/// A request as received.
#[derive(Clone, Debug)]
pub struct Seen {
    pub method: String,
    pub path: String,
    pub query: Option<String>,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

#[derive(Default)]
pub struct Shared {
    pub response: Mutex<Canned>,
    pub seen: Mutex<Vec<Seen>>,
}

pub struct FixtureServer {
    pub addr: SocketAddr,
    pub shared: Arc<Shared>,
}

impl FixtureServer {
    pub async fn start() -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind loopback");
        let addr = listener.local_addr().expect("local addr");
        let shared = Arc::new(Shared::default());
        let s = shared.clone();
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let s = s.clone();
                tokio::spawn(async move {
                    let svc = service_fn(move |req: Request<Incoming>| {
                        let s = s.clone();
                        async move { Ok::<_, Infallible>(answer(&s, req).await) }
                    });
                    let _ = http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        Self { addr, shared }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn set(&self, canned: Canned) {
        *self.shared.response.lock().expect("lock") = canned;
    }

    pub fn take_seen(&self) -> Vec<Seen> {
        std::mem::take(&mut *self.shared.seen.lock().expect("lock"))
    }
}

async fn answer(shared: &Shared, req: Request<Incoming>) -> Response<Full<Bytes>> {
    let (parts, body) = req.into_parts();
    let body = body
        .collect()
        .await
        .map(|b| b.to_bytes().to_vec())
        .unwrap_or_default();
    shared.seen.lock().expect("lock").push(Seen {
        method: parts.method.to_string(),
        path: parts.uri.path().to_string(),
        query: parts.uri.query().map(str::to_string),
        headers: parts
            .headers
            .iter()
            .map(|(k, v)| {
                (
                    k.to_string(),
                    String::from_utf8_lossy(v.as_bytes()).into_owned(),
                )
            })
            .collect(),
        body,
    });
    let canned = shared.response.lock().expect("lock").clone();
    let mut resp = Response::new(Full::new(Bytes::from(canned.body)));
    *resp.status_mut() = hyper::StatusCode::from_u16(canned.status).expect("valid status");
    if let Some(reason) = canned.reason {
        resp.extensions_mut().insert(
            hyper::ext::ReasonPhrase::try_from(reason.into_bytes()).expect("valid reason phrase"),
        );
    }
    resp.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json;charset=UTF-8"),
    );
    resp
}
