//! What every listener of the manager does with slow, idle, numerous or failing clients: the
//! probe/metrics server and the webhook share the timeouts, the connection cap, the `accept`
//! back-off and dual-stack binding.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use capmox::controller::http::{Accept, AcceptBackoff, ServerLimits, accept_next, bind_listener};
use capmox::controller::{EndpointServer, Metrics, Readiness};
use futures::FutureExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

/// Short enough for a test, far apart enough that none fires by accident.
const SHORT: ServerLimits = ServerLimits {
    header_read_timeout: Duration::from_millis(300),
    request_timeout: Duration::from_secs(20),
    handshake_timeout: Duration::from_secs(5),
    max_connections: 4,
};

/// An endpoint server on `address` with `limits`, serving until the token is cancelled.
async fn endpoints(address: &str, limits: ServerLimits) -> (SocketAddr, CancellationToken) {
    let server = EndpointServer::bind(
        address.parse().expect("addr"),
        Metrics::new(),
        Readiness::default(),
    )
    .await
    .expect("binds")
    .with_limits(limits);
    let bound = server.local_addr().expect("bound");
    let stop = CancellationToken::new();
    tokio::spawn(server.serve(stop.clone()));
    (bound, stop)
}

/// Everything the server sends until it closes the connection (bounded by a generous guard, so
/// a server that never closes fails the test instead of hanging it).
async fn read_until_closed(stream: &mut TcpStream) -> String {
    let mut received = Vec::new();
    tokio::time::timeout(Duration::from_secs(15), stream.read_to_end(&mut received))
        .await
        .expect("the server closes the connection")
        .expect("reads");
    String::from_utf8_lossy(&received).into_owned()
}

#[tokio::test]
async fn a_client_that_never_finishes_its_headers_is_disconnected() {
    let (address, _stop) = endpoints("127.0.0.1:0", SHORT).await;
    let mut slow = TcpStream::connect(address).await.expect("connects");
    slow.write_all(b"GET /healthz HTTP/1.1\r\nHost: capmox\r\n")
        .await
        .expect("sends half the headers");
    let answer = read_until_closed(&mut slow).await;
    assert!(
        answer.is_empty() || answer.starts_with("HTTP/1.1 408"),
        "{answer}"
    );
}

#[tokio::test]
async fn an_idle_keep_alive_connection_is_closed() {
    let (address, _stop) = endpoints("127.0.0.1:0", SHORT).await;
    let mut idle = TcpStream::connect(address).await.expect("connects");
    idle.write_all(b"GET /healthz HTTP/1.1\r\nHost: capmox\r\n\r\n")
        .await
        .expect("sends");
    // The answer arrives, then the connection stays open only for the header timeout.
    let answer = read_until_closed(&mut idle).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
}

#[tokio::test]
async fn the_connection_cap_frees_a_slot_when_a_connection_closes() {
    let limits = ServerLimits {
        header_read_timeout: Duration::from_secs(60),
        max_connections: 1,
        ..SHORT
    };
    let (address, _stop) = endpoints("127.0.0.1:0", limits).await;
    let mut first = TcpStream::connect(address).await.expect("connects");
    first
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: capmox\r\n\r\n")
        .await
        .expect("sends");
    let mut buffer = [0u8; 12];
    first.read_exact(&mut buffer).await.expect("answered");
    assert_eq!(&buffer, b"HTTP/1.1 200");
    // The second connection waits in the kernel's queue until the first one is closed.
    let mut second = TcpStream::connect(address).await.expect("connects");
    second
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: capmox\r\nConnection: close\r\n\r\n")
        .await
        .expect("sends");
    drop(first);
    let answer = read_until_closed(&mut second).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
}

/// Accepts from a script of outcomes, counting the calls.
struct Scripted {
    outcomes: Mutex<VecDeque<std::io::Result<()>>>,
    calls: Mutex<usize>,
}

impl Scripted {
    fn new(outcomes: impl IntoIterator<Item = std::io::Result<()>>) -> Self {
        Self {
            outcomes: Mutex::new(outcomes.into_iter().collect()),
            calls: Mutex::new(0),
        }
    }

    fn calls(&self) -> usize {
        *self.calls.lock().expect("lock")
    }
}

impl Accept for Scripted {
    type Stream = ();
    fn accept(
        &self,
    ) -> impl std::future::Future<Output = std::io::Result<((), SocketAddr)>> + Send {
        *self.calls.lock().expect("lock") += 1;
        let next = self.outcomes.lock().expect("lock").pop_front();
        async move {
            match next {
                Some(outcome) => outcome.map(|()| ((), ([127, 0, 0, 1], 1).into())),
                None => std::future::pending().await,
            }
        }
    }
}

fn out_of_files() -> std::io::Error {
    std::io::Error::from_raw_os_error(24)
}

#[tokio::test(start_paused = true)]
async fn accept_errors_back_off_instead_of_spinning() {
    let listener = Scripted::new((0..6).map(|_| Err(out_of_files())).chain([Ok(())]));
    let limit = Arc::new(Semaphore::new(1));
    let mut backoff = AcceptBackoff::default();
    let started = tokio::time::Instant::now();
    let accepted = accept_next(
        &listener,
        &limit,
        &mut backoff,
        "test",
        &CancellationToken::new(),
    )
    .await;
    assert!(accepted.is_some());
    assert_eq!(listener.calls(), 7, "six failures, then the connection");
    // 5 + 10 + 20 + 40 + 80 + 160 ms of (paused, so exact) waiting between the attempts.
    assert_eq!(started.elapsed(), Duration::from_millis(315));
    // The waits stop growing at a second.
    let mut long = AcceptBackoff::default();
    let waits: Vec<Duration> = (0..40)
        .map(|_| long.failed(&out_of_files(), "test"))
        .collect();
    assert_eq!(waits.last(), Some(&Duration::from_secs(1)));
    assert!(waits.windows(2).all(|pair| pair[0] <= pair[1]));
    // A success ends the streak.
    long.succeeded("test");
    assert_eq!(
        long.failed(&out_of_files(), "test"),
        Duration::from_millis(5)
    );
}

#[tokio::test]
async fn no_connection_is_accepted_while_the_cap_is_taken() {
    let listener = Scripted::new([Ok(()), Ok(())]);
    let limit = Arc::new(Semaphore::new(1));
    let mut backoff = AcceptBackoff::default();
    let stop = CancellationToken::new();
    let (_, _, permit) = accept_next(&listener, &limit, &mut backoff, "test", &stop)
        .await
        .expect("the first connection");
    let mut second = Box::pin(accept_next(&listener, &limit, &mut backoff, "test", &stop));
    assert!(second.as_mut().now_or_never().is_none());
    assert_eq!(
        listener.calls(),
        1,
        "accept is not called while no slot is free"
    );
    drop(permit);
    assert!(second.await.is_some());
    assert_eq!(listener.calls(), 2);
}

async fn healthz_over(address: SocketAddr) -> String {
    let mut stream = TcpStream::connect(address).await.expect("connects");
    stream
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: capmox\r\nConnection: close\r\n\r\n")
        .await
        .expect("sends");
    read_until_closed(&mut stream).await
}

#[tokio::test]
async fn an_unspecified_address_listens_on_both_families() {
    let (address, _stop) = endpoints("[::]:0", SHORT).await;
    let port = address.port();
    let ipv4 = healthz_over(([127, 0, 0, 1], port).into()).await;
    assert!(ipv4.starts_with("HTTP/1.1 200"), "{ipv4}");
    // A host without IPv6 falls back to IPv4 only.
    if address.is_ipv6() {
        let ipv6 = healthz_over((std::net::Ipv6Addr::LOCALHOST, port).into()).await;
        assert!(ipv6.starts_with("HTTP/1.1 200"), "{ipv6}");
    }
    // A specific address binds only that address.
    let listener = bind_listener("127.0.0.1:0".parse().expect("addr"))
        .await
        .expect("binds");
    assert!(listener.local_addr().expect("bound").is_ipv4());
}
