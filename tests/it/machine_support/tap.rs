//! A pass-through HTTP proxy in front of the Proxmox simulator, for the machine tests: it logs
//! every request, counts the mutating ones (anything but GET and guest-agent commands), can hold the answer to the k-th
//! mutating request until the test has done something (killed the controllers), can
//! rewrite answers to play a guest the simulator does not model, can answer requests
//! itself with an error, as a failing Proxmox or a proxy in front of it would, and can lose
//! answers (the request was carried out, the connection closes before the answer). A
//! connection the simulator drops is dropped here too.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::sync::oneshot;

/// One request that went through the tap.
#[derive(Clone, Debug)]
pub struct Seen {
    /// HTTP method.
    pub method: String,
    /// Path below `/api2/json` (query excluded).
    pub path: String,
    /// The query, without `?` (empty when none).
    pub query: String,
    /// When Proxmox (or the tap, for an injected error) answered it.
    pub at: SystemTime,
    /// The answer's HTTP status.
    pub status: u16,
}

impl Seen {
    /// Whether this is a clone request.
    pub fn is_clone(&self) -> bool {
        self.method == "POST" && self.path.ends_with("/clone")
    }
}

/// Rewrites the answer body of a request (method, path, body) or leaves it (`None`).
pub type Rewrite = Box<dyn Fn(&str, &str, &[u8]) -> Option<Vec<u8>> + Send + Sync>;

/// Answers a request (method, path) with an error instead of passing it on (`None`: pass it on).
/// Called with the method and the path below `/api2/json` with its query (`?…`), if any.
pub type Fault = Box<dyn Fn(&str, &str) -> Option<Injected> + Send + Sync>;

/// Decides, once Proxmox has answered a request, whether the answer is lost (`true`).
pub type LoseAnswer = Box<dyn Fn(&Seen) -> bool + Send + Sync>;

/// Closes the client's connection without an answer (hyper does so when a service fails).
#[derive(Debug)]
pub struct Dropped(&'static str);

impl std::fmt::Display for Dropped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0)
    }
}

impl std::error::Error for Dropped {}

/// An error answer the tap gives in Proxmox's place.
#[derive(Clone, Debug)]
pub struct Injected {
    /// HTTP status.
    pub status: u16,
    /// Reason phrase, also the body's `message` (as PVE ≥ 8.3 sends it).
    pub reason: String,
    /// The body's parameter `errors`, if any.
    pub errors: serde_json::Value,
    /// Extra headers (e.g. `Retry-After`).
    pub headers: Vec<(String, String)>,
}

impl Injected {
    /// An error with `status` and `reason`, nothing else.
    pub fn new(status: u16, reason: &str) -> Injected {
        Injected {
            status,
            reason: reason.to_owned(),
            errors: serde_json::Value::Null,
            headers: Vec::new(),
        }
    }
}

/// The moment the k-th mutating request was answered by Proxmox; the answer is held back
/// until `resume` is sent (or dropped).
pub struct Tripped {
    /// The request.
    pub request: Seen,
    /// Lets the held answer go (to whoever still waits for it).
    pub resume: oneshot::Sender<()>,
}

struct State {
    upstream: String,
    http: reqwest::Client,
    log: Mutex<Vec<Seen>>,
    mutating: AtomicUsize,
    trip: Mutex<Option<(usize, oneshot::Sender<Tripped>)>>,
    rewrite: Mutex<Option<Rewrite>>,
    fault: Mutex<Option<Fault>>,
    lose: Mutex<Option<LoseAnswer>>,
}

/// The running proxy; dropping it stops listening.
pub struct Tap {
    url: String,
    state: Arc<State>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Tap {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Tap {
    /// Listens on 127.0.0.1 and forwards to `upstream` (the simulator's URL).
    pub async fn start(upstream: &str) -> Tap {
        // reqwest is built without a default TLS provider; plain HTTP still needs one installed.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("tap binds");
        let url = format!("http://{}", listener.local_addr().expect("tap address"));
        let state = Arc::new(State {
            upstream: upstream.trim_end_matches('/').to_owned(),
            http: reqwest::Client::builder().build().expect("tap HTTP client"),
            log: Mutex::new(Vec::new()),
            mutating: AtomicUsize::new(0),
            trip: Mutex::new(None),
            rewrite: Mutex::new(None),
            fault: Mutex::new(None),
            lose: Mutex::new(None),
        });
        let shared = state.clone();
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let shared = shared.clone();
                tokio::spawn(async move {
                    let service = service_fn(move |req| forward(shared.clone(), req));
                    let _ = http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Tap { url, state, task }
    }

    /// The URL to give capmox instead of the simulator's.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Every request so far, oldest first.
    pub fn log(&self) -> Vec<Seen> {
        self.state.log.lock().expect("tap log").clone()
    }

    /// A view of the log the testkit's fault hook can hold (it must be `'static`).
    pub fn clone_requested(&self) -> impl Fn() -> bool + Send + Sync + 'static {
        let state = self.state.clone();
        move || {
            state
                .log
                .lock()
                .expect("tap log")
                .iter()
                .any(Seen::is_clone)
        }
    }

    /// Mutating requests (not GET, not guest-agent commands) answered so far.
    pub fn mutating(&self) -> usize {
        self.state.mutating.load(Ordering::SeqCst)
    }

    /// Holds the answer to the `n`-th mutating request (counted from the tap's start) and
    /// reports it through the returned channel.
    pub fn trip_at(&self, n: usize) -> oneshot::Receiver<Tripped> {
        let (tx, rx) = oneshot::channel();
        *self.state.trip.lock().expect("tap trip") = Some((n, tx));
        rx
    }

    /// Rewrites answers from now on.
    pub fn set_rewrite(&self, rewrite: Rewrite) {
        *self.state.rewrite.lock().expect("tap rewrite") = Some(rewrite);
    }

    /// Answers the requests `fault` picks with its error from now on, without passing them on.
    pub fn set_fault(&self, fault: Fault) {
        *self.state.fault.lock().expect("tap fault") = Some(fault);
    }

    /// Passes every request on again.
    pub fn clear_fault(&self) {
        *self.state.fault.lock().expect("tap fault") = None;
    }

    /// Loses the answers `lose` picks from now on (`None`: answers every request again).
    pub fn set_lose_answer(&self, lose: Option<LoseAnswer>) {
        *self.state.lose.lock().expect("tap lose") = lose;
    }
}

/// The answer of an injected error, logged like any other.
fn inject(
    state: &State,
    method: &str,
    path: String,
    query: String,
    injected: Injected,
) -> Response<Full<Bytes>> {
    let body = serde_json::json!({
        "data": null, "message": format!("{}\n", injected.reason), "errors": injected.errors
    });
    let mut response = Response::builder().status(injected.status);
    for (name, value) in &injected.headers {
        response = response.header(name.as_str(), value.as_str());
    }
    let mut response = response
        .header(
            hyper::header::CONTENT_TYPE,
            "application/json;charset=UTF-8",
        )
        .body(Full::new(Bytes::from(body.to_string())))
        .expect("response");
    if let Ok(phrase) = hyper::ext::ReasonPhrase::try_from(injected.reason.into_bytes()) {
        response.extensions_mut().insert(phrase);
    }
    state.log.lock().expect("tap log").push(Seen {
        method: method.to_owned(),
        path,
        query,
        at: SystemTime::now(),
        status: injected.status,
    });
    response
}

async fn forward(
    state: Arc<State>,
    req: Request<hyper::body::Incoming>,
) -> Result<Response<Full<Bytes>>, Dropped> {
    let method = req.method().clone();
    let path_and_query = req
        .uri()
        .path_and_query()
        .map(|p| p.as_str().to_owned())
        .unwrap_or_default();
    let path = req.uri().path().to_owned();
    let api_path = path.strip_prefix("/api2/json").unwrap_or(&path).to_owned();
    let query = req.uri().query().unwrap_or_default().to_owned();
    // The fault sees the query too, so it can tell `/cluster/resources?type=storage` (the
    // cluster controller's) from the machines' listing.
    let asked = if query.is_empty() {
        api_path.clone()
    } else {
        format!("{api_path}?{query}")
    };
    let injected = state
        .fault
        .lock()
        .expect("tap fault")
        .as_ref()
        .and_then(|fault| fault(method.as_str(), &asked));
    if let Some(injected) = injected {
        return Ok(inject(&state, method.as_str(), api_path, query, injected));
    }
    let headers = req.headers().clone();
    let body = req
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let mut upstream = state.http.request(
        reqwest::Method::from_bytes(method.as_str().as_bytes()).expect("method"),
        format!("{}{path_and_query}", state.upstream),
    );
    for (name, value) in &headers {
        if name != hyper::header::HOST && name != hyper::header::CONTENT_LENGTH {
            upstream = upstream.header(name.as_str(), value.as_bytes());
        }
    }
    let Ok(answer) = upstream.body(body).send().await else {
        return Err(Dropped("the simulator dropped the connection"));
    };
    let status = answer.status().as_u16();
    let phrase = answer
        .extensions()
        .get::<hyper::ext::ReasonPhrase>()
        .cloned();
    let answer_headers = answer.headers().clone();
    let mut bytes = answer.bytes().await.unwrap_or_default().to_vec();
    if let Some(rewrite) = state.rewrite.lock().expect("tap rewrite").as_ref()
        && let Some(new) = rewrite(method.as_str(), &api_path, &bytes)
    {
        bytes = new;
    }
    let seen = Seen {
        method: method.to_string(),
        path: api_path,
        query,
        at: SystemTime::now(),
        status,
    };
    state.log.lock().expect("tap log").push(seen.clone());
    let lost = state
        .lose
        .lock()
        .expect("tap lose")
        .as_ref()
        .is_some_and(|lose| lose(&seen));
    // Guest-agent commands (`cloud-init status`) change nothing in Proxmox; their number
    // depends on how fast the guest boots.
    if method != hyper::Method::GET && !seen.path.contains("/agent/") {
        let count = state.mutating.fetch_add(1, Ordering::SeqCst) + 1;
        let tripped = {
            let mut trip = state.trip.lock().expect("tap trip");
            match trip.take() {
                Some((n, tx)) if n == count => Some(tx),
                other => {
                    *trip = other;
                    None
                }
            }
        };
        if let Some(tx) = tripped {
            let (resume, resumed) = oneshot::channel();
            if tx
                .send(Tripped {
                    request: seen,
                    resume,
                })
                .is_ok()
            {
                let _ = resumed.await;
            }
        }
    }
    if lost {
        return Err(Dropped("answer lost by the tap"));
    }
    let mut response = Response::builder().status(status);
    for (name, value) in &answer_headers {
        if name != hyper::header::CONTENT_LENGTH && name != hyper::header::TRANSFER_ENCODING {
            response = response.header(name.as_str(), value.as_bytes());
        }
    }
    let mut response = response
        .body(Full::new(Bytes::from(bytes)))
        .expect("response");
    if let Some(phrase) = phrase {
        response.extensions_mut().insert(phrase);
    }
    Ok(response)
}
