//! A Kubernetes client whose watch events arrive late, as they do from a busy kube-apiserver:
//! the controllers' caches then lag behind their own writes, and a reconcile may start from a
//! stale copy of its object.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use http::{Request, Response};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;

type Frames = Pin<Box<dyn futures::Stream<Item = Result<Frame<Bytes>, BoxError>> + Send>>;
type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A client of `server` whose watch responses deliver every event `lag` after the server sent it.
pub fn lagging_client(server: &capmox_testkit::ApiServer, lag: Duration) -> kube::Client {
    kube::Client::new(
        Lagging {
            inner: server.service(),
            lag,
        },
        "default",
    )
}

#[derive(Clone)]
struct Lagging {
    inner: capmox_testkit::ApiService,
    lag: Duration,
}

impl tower::Service<Request<kube::client::Body>> for Lagging {
    type Response = Response<StreamBody<Frames>>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<kube::client::Body>) -> Self::Future {
        let watch = req
            .uri()
            .query()
            .is_some_and(|q| q.split('&').any(|p| p == "watch=true" || p == "watch=1"));
        let lag = if watch { self.lag } else { Duration::ZERO };
        let response = self.inner.call(req);
        Box::pin(async move {
            let (parts, mut body) = response.await?.into_parts();
            // Frames are read as the server sends them and each is released `lag` later.
            let (tx, rx) = futures::channel::mpsc::unbounded();
            tokio::spawn(async move {
                while let Some(frame) = body.frame().await {
                    let due = tokio::time::Instant::now() + lag;
                    if tx.unbounded_send((due, frame.map_err(Into::into))).is_err() {
                        return;
                    }
                }
            });
            let frames: Frames = Box::pin(rx.then(|(due, frame)| async move {
                tokio::time::sleep_until(due).await;
                frame
            }));
            Ok(Response::from_parts(parts, StreamBody::new(frames)))
        })
    }
}
