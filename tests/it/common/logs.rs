//! Capturing one test's logs while the other tests run in the same process.
//!
//! A scoped subscriber (`tracing::subscriber::set_default`) sees only its own thread, but
//! tracing caches per callsite, process-wide, whether *any* subscriber is interested: a
//! callsite first hit while no interested subscriber exists could stay silent for a capturing
//! test. [`capture`] therefore first installs, once, a global subscriber that records nothing
//! and answers "ask me each time" for every callsite, so no callsite's interest is cached and
//! each event is offered to the subscriber of the thread it happens on.

use std::io::Write;
use std::sync::{Arc, Mutex, Once};

use tracing::level_filters::LevelFilter;
use tracing::subscriber::{DefaultGuard, Interest};
use tracing::{Event, Metadata, Subscriber, span};

/// The process-wide subscriber: drops everything, decides nothing in advance.
struct Undecided;

impl Subscriber for Undecided {
    fn register_callsite(&self, _: &'static Metadata<'static>) -> Interest {
        Interest::sometimes()
    }
    fn max_level_hint(&self) -> Option<LevelFilter> {
        Some(LevelFilter::TRACE)
    }
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        false
    }
    fn new_span(&self, _: &span::Attributes<'_>) -> span::Id {
        span::Id::from_u64(1)
    }
    fn record(&self, _: &span::Id, _: &span::Record<'_>) {}
    fn record_follows_from(&self, _: &span::Id, _: &span::Id) {}
    fn event(&self, _: &Event<'_>) {}
    fn enter(&self, _: &span::Id) {}
    fn exit(&self, _: &span::Id) {}
}

/// Where a captured test's log lines go.
#[derive(Clone, Default)]
struct Buf(Arc<Mutex<Vec<u8>>>);

impl Write for Buf {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend_from_slice(bytes);
        Ok(bytes.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The logs of the current thread from [`capture`] on, until this is dropped.
pub struct Captured {
    buf: Buf,
    _guard: DefaultGuard,
}

impl Captured {
    /// Everything logged so far, as text.
    pub fn text(&self) -> String {
        let bytes = self.buf.0.lock().unwrap_or_else(|p| p.into_inner()).clone();
        String::from_utf8(bytes).expect("log output is UTF-8")
    }
}

/// Captures every event (all levels) logged on the current thread; a `#[tokio::test]`'s
/// default current-thread runtime runs all its tasks there.
pub fn capture() -> Captured {
    static GLOBAL: Once = Once::new();
    GLOBAL.call_once(|| {
        tracing::subscriber::set_global_default(Undecided)
            .expect("no other global subscriber in the test binary");
    });
    let buf = Buf::default();
    let writer = buf.clone();
    let guard = tracing::subscriber::set_default(
        tracing_subscriber::fmt()
            .with_max_level(tracing::Level::TRACE)
            .with_writer(move || writer.clone())
            .finish(),
    );
    Captured { buf, _guard: guard }
}
