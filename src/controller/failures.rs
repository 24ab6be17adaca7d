//! How failures reach the user, and when a failing object is tried again.
//!
//! Every [`ProxmoxError`] maps to one stable condition reason ([`reason`]) and a message that
//! says what capmox was doing, what Proxmox answered and what to fix ([`describe`]); messages
//! carry no secret (Proxmox never echoes the token secret, and the client keeps it out of its
//! errors). [`Retries`] keeps each object's streak of failed reconciles in memory: every failure
//! in a row waits longer (exponential, jittered, capped), a pass that succeeds forgets the
//! streak, and a restarted controller starts over, which only shortens one wait.

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use k8s_openapi::api::core::v1::ObjectReference;
use kube::api::DynamicObject;
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::ObjectRef;
use tokio::time::Instant;

use crate::proxmox::ProxmoxError;
use crate::proxmox::client::{jitter_fraction, jitter_seed};
use crate::proxmox::error::format_errors;

/// Back-off after failed Proxmox requests: 1 s doubling to 5 minutes (a Proxmox outage, a
/// missing privilege or a storage problem is not fixed by asking more often).
pub const PROXMOX_BACKOFF: Backoff = Backoff {
    initial: Duration::from_secs(1),
    max: Duration::from_secs(300),
};

/// Back-off after failed Kubernetes API calls: 1 s doubling to a minute (conflicts and a busy
/// API server clear up quickly).
pub const API_BACKOFF: Backoff = Backoff {
    initial: Duration::from_secs(1),
    max: Duration::from_secs(60),
};

/// The longest hold [`Retries::hold`] places when asked for one the clock cannot represent.
const MAX_HOLD: Duration = Duration::from_secs(24 * 60 * 60);

/// The most a jittered delay is shortened: a quarter, so retries of many objects spread out
/// and a delay never exceeds its back-off's `max`.
pub const JITTER: f64 = 0.25;

/// An exponential back-off: `initial` after the first failure, doubling with each further
/// failure in a row, never more than `max`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backoff {
    /// The delay after the first failure.
    pub initial: Duration,
    /// The longest delay.
    pub max: Duration,
}

impl Backoff {
    /// The delay after the `failures`-th failure in a row (0 counts as the first), before jitter.
    pub fn nominal(&self, failures: u32) -> Duration {
        let doublings = failures.saturating_sub(1).min(20);
        self.initial.saturating_mul(1 << doublings).min(self.max)
    }

    /// The nominal delay shortened by up to [`JITTER`] of it: `fraction` in [0, 1) says how much.
    pub fn jittered(&self, failures: u32, fraction: f64) -> Duration {
        self.nominal(failures)
            .mul_f64(1.0 - JITTER * fraction.clamp(0.0, 1.0))
    }
}

/// What one more failure of an object means for its next try.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Retry {
    /// Failures in a row, this one included.
    pub failures: u32,
    /// How long to wait before the next try.
    pub delay: Duration,
    /// This failure starts a streak or changes its reason: worth a Warning event. Repeats of
    /// the same failure are not, so a fleet retrying an outage does not flood the events.
    pub news: bool,
}

/// The failure streaks of every object of both controllers; cheap to clone, shared.
#[derive(Clone)]
pub struct Retries {
    streaks: Arc<Mutex<HashMap<ObjectRef<DynamicObject>, Streak>>>,
    jitter: Arc<AtomicU64>,
}

impl Default for Retries {
    fn default() -> Self {
        Self {
            streaks: Arc::default(),
            jitter: Arc::new(AtomicU64::new(jitter_seed())),
        }
    }
}

#[derive(Debug, Default)]
struct Streak {
    failures: u32,
    reason: Option<String>,
    hold: Option<Hold>,
}

/// No pass before `until`, unless the object's spec changed or its deletion began since.
#[derive(Debug)]
struct Hold {
    until: Instant,
    generation: Option<i64>,
    deleting: bool,
}

/// How a reconcile pass ended, for the object's back-off.
#[derive(Debug)]
pub enum Pass {
    /// It did what it could: any streak of failures is over.
    Done(Action),
    /// It failed, or waits longer each time: the streak goes on.
    BackingOff(Action),
}

/// The key of `object` in [`Retries`].
pub fn key<K: kube::Resource<DynamicType = ()>>(object: &K) -> ObjectRef<DynamicObject> {
    ObjectRef::from_obj(object).erase()
}

impl Retries {
    fn streaks(&self) -> MutexGuard<'_, HashMap<ObjectRef<DynamicObject>, Streak>> {
        // Never held across a panic-prone call: a poisoned map is still consistent.
        self.streaks
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Records one more failure of `object`; `reason` is the condition reason it was reported
    /// with (`None` for failures that are not reported, such as Kubernetes API errors).
    pub fn failed(
        &self,
        object: &ObjectRef<DynamicObject>,
        backoff: &Backoff,
        reason: Option<&str>,
    ) -> Retry {
        let fraction = jitter_fraction(&self.jitter);
        let mut streaks = self.streaks();
        let streak = streaks.entry(object.clone()).or_default();
        streak.failures = streak.failures.saturating_add(1);
        let changed = reason.is_some_and(|r| streak.reason.as_deref() != Some(r));
        if let Some(reason) = reason {
            streak.reason = Some(reason.to_owned());
        }
        Retry {
            failures: streak.failures,
            delay: backoff.jittered(streak.failures, fraction),
            news: streak.failures == 1 || changed,
        }
    }

    /// Holds off every pass of `object` for `delay`: wake-ups by watched objects (or by its own
    /// status write) do not retry a failing Proxmox request early. A new generation or the
    /// start of its deletion lifts the hold.
    pub fn hold(
        &self,
        object: &ObjectRef<DynamicObject>,
        delay: Duration,
        generation: Option<i64>,
        deleting: bool,
    ) {
        let mut streaks = self.streaks();
        streaks.entry(object.clone()).or_default().hold = Some(Hold {
            // A hold beyond the clock's range lasts as long as the clock can say.
            until: Instant::now()
                .checked_add(delay)
                .unwrap_or_else(|| Instant::now() + MAX_HOLD),
            generation,
            deleting,
        });
    }

    /// The rest of the hold on `object`, if one still applies to this generation and deletion
    /// state.
    pub fn held(
        &self,
        object: &ObjectRef<DynamicObject>,
        generation: Option<i64>,
        deleting: bool,
    ) -> Option<Duration> {
        let streaks = self.streaks();
        let hold = streaks.get(object)?.hold.as_ref()?;
        let remaining = hold.until.checked_duration_since(Instant::now())?;
        (hold.generation == generation && hold.deleting == deleting && !remaining.is_zero())
            .then_some(remaining)
    }

    /// Forgets the streak of `object` after a pass that succeeded.
    pub fn succeeded(&self, object: &ObjectRef<DynamicObject>) {
        self.streaks().remove(object);
    }

    /// The requeue of a pass of `object` that ended as `pass`, forgetting its streak if the
    /// pass succeeded.
    pub fn settle(&self, object: &ObjectRef<DynamicObject>, pass: Pass) -> Action {
        match pass {
            Pass::Done(action) => {
                self.succeeded(object);
                action
            }
            Pass::BackingOff(action) => action,
        }
    }
}

/// The requeue after a reconcile of `object` by `controller` failed with `error` (a Kubernetes
/// API error: Proxmox failures are reported in conditions instead): the object's back-off.
pub fn after_error<K: kube::Resource<DynamicType = ()>>(
    retries: &Retries,
    controller: &str,
    object: &K,
    error: &dyn std::fmt::Display,
) -> Action {
    let retry = retries.failed(&key(object), &API_BACKOFF, None);
    tracing::warn!(
        controller,
        namespace = object.meta().namespace.as_deref().unwrap_or_default(),
        name = object.meta().name.as_deref().unwrap_or_default(),
        %error,
        failures = retry.failures,
        retry_in_ms = millis(retry.delay),
        "reconcile failed; retrying"
    );
    Action::requeue(retry.delay)
}

/// Whole milliseconds of `delay`, for log fields.
pub fn millis(delay: Duration) -> u64 {
    u64::try_from(delay.as_millis()).unwrap_or(u64::MAX)
}

/// The condition reason for a failed Proxmox request: a stable name per kind of failure, the
/// same in `ProxmoxAvailable` (ProxmoxCluster) and `VirtualMachineProvisioned` (ProxmoxMachine).
pub fn reason(error: &ProxmoxError) -> &'static str {
    match error {
        ProxmoxError::Unauthorized { .. } => "Unauthorized",
        ProxmoxError::Forbidden { .. } => "ProxmoxForbidden",
        ProxmoxError::RateLimited { .. } => "ProxmoxRateLimited",
        ProxmoxError::Locked { .. } => "ProxmoxLocked",
        ProxmoxError::NotFound { .. } => "ProxmoxNotFound",
        ProxmoxError::TaskFailed { .. } => "TaskFailed",
        ProxmoxError::TaskTimeout { .. } => "WaitingForTask",
        ProxmoxError::Decode { .. } => "ProxmoxResponseInvalid",
        ProxmoxError::AlreadyExists { .. } | ProxmoxError::InvalidParameters { .. } => {
            "ProxmoxRequestRejected"
        }
        _ if tls_problem(error) => "TLSVerificationFailed",
        ProxmoxError::Config(_) => "CredentialsInvalid",
        ProxmoxError::Fenced => "LeadershipLost",
        ProxmoxError::Transient {
            status: Some(500), ..
        } => "ProxmoxServerError",
        ProxmoxError::Transient { .. } => "ProxmoxUnreachable",
        ProxmoxError::Api { status, .. } if *status < 500 => "ProxmoxRequestRejected",
        ProxmoxError::Api { .. } => "ProxmoxServerError",
    }
}

fn tls_problem(error: &ProxmoxError) -> bool {
    let text = error.to_string().to_ascii_lowercase();
    matches!(
        error,
        ProxmoxError::Config(_) | ProxmoxError::Transient { status: None, .. }
    ) && [
        "certificate",
        "tls verification",
        "unknownissuer",
        "fingerprint",
    ]
    .iter()
    .any(|k| text.contains(k))
}

/// A failed Proxmox request as a user sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Described {
    /// The condition (and event) reason, from [`reason`].
    pub reason: &'static str,
    /// What failed, what Proxmox answered, what to fix. Stable while the failure repeats, so
    /// rewriting the condition is a no-op.
    pub message: String,
    /// How long the server asked to wait (429 `Retry-After`).
    pub retry_after: Option<Duration>,
}

/// `step` (what capmox was doing, e.g. "cloning template 9000 on pve1 to VM 101 on pve3")
/// failed with `error`: its reason, and a message with Proxmox's answer and what to fix.
pub fn describe(step: &str, error: &ProxmoxError) -> Described {
    Described {
        reason: reason(error),
        message: format!("{step}: {}", what_to_fix(error)),
        retry_after: match error {
            ProxmoxError::RateLimited { retry_after, .. } => *retry_after,
            _ => None,
        },
    }
}

/// What Proxmox answered, and what to fix for it.
fn what_to_fix(error: &ProxmoxError) -> String {
    match error {
        ProxmoxError::Unauthorized { reason } => format!(
            "Proxmox rejected the API token (HTTP 401: {reason}); check the API token id and secret in the credentials"
        ),
        ProxmoxError::Fenced => "this replica lost the leader election Lease and stopped writing to Proxmox; the replica that leads now continues".to_owned(),
        ProxmoxError::Forbidden { reason } => match permission(reason) {
            Some((path, privilege)) => format!(
                "the API token lacks {privilege} on {path} (HTTP 403: {reason}); grant it on {path} to the token (with privilege separation, to the token itself)"
            ),
            None => format!(
                "Proxmox denied the request (HTTP 403: {reason}); grant the API token the privileges capmox needs"
            ),
        },
        ProxmoxError::RateLimited { reason, .. } => format!(
            "Proxmox or a proxy in front of it limits the request rate (HTTP 429: {reason}); capmox waits at least as long as the server asks, lower --proxmoxmachine-concurrency if this persists"
        ),
        ProxmoxError::Locked { lock, reason, .. } => format!(
            "the VM is locked ({lock}) by another Proxmox operation ({reason}); retried until the lock is released"
        ),
        ProxmoxError::NotFound { status, reason } => format!(
            "Proxmox does not know it (HTTP {status}: {reason}); check that the template, node and storage the spec names exist"
        ),
        ProxmoxError::AlreadyExists { status, reason } => format!(
            "Proxmox says it already exists (HTTP {status}: {reason}); remove the conflicting object or use another VMID range"
        ),
        ProxmoxError::InvalidParameters {
            status,
            reason,
            errors,
        } => format!(
            "Proxmox rejected the request (HTTP {status}: {reason} {}); fix the values it names in the spec",
            format_errors(errors)
        ),
        ProxmoxError::Api { status, reason } if *status < 500 => format!(
            "Proxmox rejected the request (HTTP {status}: {reason}); fix what it names in the spec, and check that the URL points at a supported Proxmox VE"
        ),
        ProxmoxError::Api { status, reason } => format!(
            "Proxmox failed (HTTP {status}: {reason}); fix what Proxmox names (storage, node, template) or check the node's health"
        ),
        ProxmoxError::Transient { .. } => transient_detail(error),
        ProxmoxError::TaskFailed { upid, exitstatus } => {
            format!("Proxmox task {upid} failed: {exitstatus}; fix what the task log names")
        }
        ProxmoxError::TaskTimeout { upid, waited_ms } => format!(
            "Proxmox task {upid} still runs after {waited_ms} ms; it is checked again (see its log on the node if it hangs)"
        ),
        ProxmoxError::Decode { endpoint, message } => format!(
            "cannot read Proxmox's answer to {endpoint} ({message}); check that the URL points at the Proxmox VE API (https://host:8006), not at another service or a login page"
        ),
        ProxmoxError::Config(text) => text.clone(),
    }
}

/// What a failure that may pass on its own tells, and what to check meanwhile.
fn transient_detail(error: &ProxmoxError) -> String {
    match error {
        ProxmoxError::Transient {
            status: Some(500),
            reason,
        } => format!(
            "Proxmox cannot serve it now (HTTP 500: {reason}); check the Proxmox cluster's quorum and the node's health"
        ),
        ProxmoxError::Transient {
            status: Some(status @ 595..=599),
            reason,
        } => format!(
            "Proxmox could not reach the node (HTTP {status}: {reason}); check that the node is online and reachable from the other nodes"
        ),
        ProxmoxError::Transient {
            status: Some(status),
            reason,
        } => format!(
            "the proxy in front of Proxmox failed (HTTP {status}: {reason}); check the proxy and pveproxy"
        ),
        ProxmoxError::Transient { status: None, .. } if tls_problem(error) => {
            format!("{error}; trust Proxmox's CA (root_ca) or pin its certificate fingerprint")
        }
        ProxmoxError::Transient {
            status: None,
            reason,
        } => format!(
            "cannot reach Proxmox ({reason}); check the URL, DNS and firewall, and that pveproxy runs"
        ),
        other => other.to_string(),
    }
}

/// Path and privilege of `Permission check failed (/vms/100, VM.Allocate)`.
fn permission(reason: &str) -> Option<(&str, &str)> {
    let inner = reason.split_once('(')?.1.rsplit_once(')')?.0;
    let (path, privilege) = inner.split_once(", ")?;
    (path.starts_with('/') && !privilege.contains(' ')).then_some((path, privilege))
}

/// Publishes an event about `regarding` as `controller`; a failure to publish is only logged
/// (an event is a courtesy, never a reason to fail a reconcile).
pub async fn publish_event(
    client: &kube::Client,
    controller: &str,
    regarding: &ObjectReference,
    type_: EventType,
    reason: &str,
    note: &str,
) {
    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: controller.into(),
            instance: None,
        },
    );
    let event = Event {
        type_,
        reason: reason.into(),
        // The API server refuses a longer note, and with it the whole event.
        note: Some(super::conditions::truncate_message(
            note,
            super::conditions::EVENT_NOTE_MAX,
        )),
        action: reason.into(),
        secondary: None,
    };
    if let Err(error) = recorder.publish(&event, regarding).await {
        tracing::debug!(%error, reason, "could not record an event");
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn error(status: u16, reason: &str) -> ProxmoxError {
        ProxmoxError::from_response(status, reason, BTreeMap::new())
    }

    #[test]
    fn every_kind_of_proxmox_failure_has_a_reason_and_says_what_to_fix() {
        let step = "cloning template 9000 on pve1 to VM 101 on pve3";
        let mut parameters = BTreeMap::new();
        parameters.insert(
            "storage".to_owned(),
            "storage 'fast' does not exist".to_owned(),
        );
        let cases: Vec<(ProxmoxError, &str, &[&str])> = vec![
            (
                error(401, "invalid token value!"),
                "Unauthorized",
                &["HTTP 401: invalid token value!", "check the API token id and secret"],
            ),
            (
                error(403, "Permission check failed (/vms/101, VM.Allocate)"),
                "ProxmoxForbidden",
                &["lacks VM.Allocate on /vms/101", "grant it on /vms/101 to the token"],
            ),
            (
                error(403, "Permission check failed (URI '/access/ticket' not available with API token, need proper ticket.)"),
                "ProxmoxForbidden",
                &["HTTP 403", "grant the API token the privileges"],
            ),
            (
                error(500, "can't clone VM to node 'pve3' (VM uses local storage)"),
                "ProxmoxServerError",
                &["HTTP 500: can't clone VM to node 'pve3' (VM uses local storage)", "fix what Proxmox names"],
            ),
            (
                error(500, "cluster not ready - no quorum?"),
                "ProxmoxServerError",
                &["no quorum", "quorum"],
            ),
            (
                error(596, "Connection timed out"),
                "ProxmoxUnreachable",
                &["HTTP 596", "node is online"],
            ),
            (
                error(502, "Bad Gateway"),
                "ProxmoxUnreachable",
                &["HTTP 502", "proxy"],
            ),
            (
                ProxmoxError::Transient { status: None, reason: "cannot connect: connection refused".into() },
                "ProxmoxUnreachable",
                &["connection refused", "check the URL"],
            ),
            (
                ProxmoxError::Transient { status: None, reason: "invalid peer certificate: UnknownIssuer".into() },
                "TLSVerificationFailed",
                &["UnknownIssuer", "root_ca"],
            ),
            (
                ProxmoxError::Config("TLS verification of the Proxmox VE server failed (invalid peer certificate: UnknownIssuer); trust its CA".into()),
                "TLSVerificationFailed",
                &["trust its CA"],
            ),
            (
                ProxmoxError::Config("API token 'x' contains characters not allowed".into()),
                "CredentialsInvalid",
                &["characters not allowed"],
            ),
            (
                ProxmoxError::from_response(400, "Parameter verification failed.", parameters),
                "ProxmoxRequestRejected",
                &["HTTP 400", "storage: storage 'fast' does not exist", "fix the values"],
            ),
            (
                error(400, "upload failed: wrong content type"),
                "ProxmoxRequestRejected",
                &["HTTP 400", "wrong content type"],
            ),
            (
                error(501, "Method 'POST /nodes/pve1/qemu/9000/clone' not implemented"),
                "ProxmoxServerError",
                &["HTTP 501", "not implemented"],
            ),
            (
                error(429, "Too Many Requests"),
                "ProxmoxRateLimited",
                &["HTTP 429", "as long as the server asks"],
            ),
            (
                error(500, "VM is locked (backup)"),
                "ProxmoxLocked",
                &["locked (backup)"],
            ),
            (
                error(404, "Not Found"),
                "ProxmoxNotFound",
                &["HTTP 404", "exist"],
            ),
            (
                error(500, "unable to create VM 101 - VM 101 already exists on node 'pve2'"),
                "ProxmoxRequestRejected",
                &["already exists", "another VMID range"],
            ),
            (
                ProxmoxError::Decode { endpoint: "GET /cluster/resources".into(), message: "body is not JSON: expected value at line 1".into() },
                "ProxmoxResponseInvalid",
                &["GET /cluster/resources", "not JSON", "points at the Proxmox VE API"],
            ),
            (
                ProxmoxError::TaskFailed { upid: "UPID:pve3:1:2:3:qmclone:9000:capi@pve!capmox:".into(), exitstatus: "storage full".into() },
                "TaskFailed",
                &["storage full", "task log"],
            ),
            (
                ProxmoxError::TaskTimeout { upid: "UPID:pve3:1:2:3:qmclone:9000:capi@pve!capmox:".into(), waited_ms: 120_000 },
                "WaitingForTask",
                &["120000 ms"],
            ),
        ];
        for (error, expected, parts) in cases {
            let described = describe(step, &error);
            assert_eq!(described.reason, expected, "{error:?}");
            assert!(described.message.starts_with(step), "{}", described.message);
            for part in parts {
                assert!(
                    described.message.contains(part),
                    "{part:?} in {}",
                    described.message
                );
            }
        }
    }

    #[test]
    fn a_rate_limit_carries_the_servers_retry_after() {
        let error = error(429, "Too Many Requests").with_retry_after(Some(Duration::from_secs(9)));
        assert_eq!(
            describe("listing VMs", &error).retry_after,
            Some(Duration::from_secs(9))
        );
        assert_eq!(
            describe("listing VMs", &super::tests::error(500, "x")).retry_after,
            None
        );
    }

    #[test]
    fn the_back_off_doubles_to_its_cap_and_jitter_only_shortens_it() {
        let backoff = PROXMOX_BACKOFF;
        let nominal: Vec<u64> = (1..=11).map(|n| backoff.nominal(n).as_secs()).collect();
        assert_eq!(nominal, [1, 2, 4, 8, 16, 32, 64, 128, 256, 300, 300]);
        assert_eq!(backoff.nominal(0), backoff.initial);
        assert_eq!(backoff.nominal(u32::MAX), backoff.max);
        for failures in [1, 4, 30] {
            let nominal = backoff.nominal(failures);
            assert_eq!(backoff.jittered(failures, 0.0), nominal);
            let shortest = backoff.jittered(failures, 0.999_999);
            assert!(shortest >= nominal.mul_f64(1.0 - JITTER), "{shortest:?}");
            assert!(shortest < nominal);
        }
    }

    #[test]
    fn a_streak_grows_spreads_its_retries_and_ends_with_a_success() {
        let retries = Retries::default();
        let machine: ObjectRef<DynamicObject> =
            key(&crate::api::ProxmoxMachine::new("m", Default::default()));
        let other: ObjectRef<DynamicObject> =
            key(&crate::api::ProxmoxCluster::new("m", Default::default()));
        let mut delays = Vec::new();
        for n in 1..=12 {
            let reason = if n < 6 {
                "ProxmoxServerError"
            } else {
                "ProxmoxUnreachable"
            };
            let retry = retries.failed(&machine, &PROXMOX_BACKOFF, Some(reason));
            assert_eq!(retry.failures, n);
            assert_eq!(retry.news, n == 1 || n == 6, "news at failure {n}");
            let nominal = PROXMOX_BACKOFF.nominal(n);
            assert!(
                retry.delay <= nominal && retry.delay >= nominal.mul_f64(1.0 - JITTER),
                "failure {n}: {:?}",
                retry.delay
            );
            delays.push(retry.delay);
        }
        assert!(delays.iter().all(|d| *d <= PROXMOX_BACKOFF.max));
        let spread: std::collections::BTreeSet<_> = (0..20)
            .map(|_| {
                let fresh = Retries::default();
                fresh.failed(&machine, &PROXMOX_BACKOFF, None);
                fresh.failed(&machine, &PROXMOX_BACKOFF, None).delay
            })
            .collect();
        assert!(spread.len() > 1, "jittered: {spread:?}");
        // Another object (same name, other kind) has its own streak.
        assert_eq!(retries.failed(&other, &API_BACKOFF, None).failures, 1);
        retries.succeeded(&machine);
        let retry = retries.failed(&machine, &PROXMOX_BACKOFF, Some("ProxmoxUnreachable"));
        assert_eq!(
            (retry.failures, retry.news),
            (1, true),
            "reset by the success"
        );
        assert!(retry.delay <= PROXMOX_BACKOFF.initial);
        assert_eq!(retries.failed(&other, &API_BACKOFF, None).failures, 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_hold_lasts_its_delay_unless_the_spec_changes_or_deletion_begins() {
        let retries = Retries::default();
        let machine = key(&crate::api::ProxmoxMachine::new("m", Default::default()));
        assert_eq!(retries.held(&machine, Some(1), false), None);
        retries.hold(&machine, Duration::from_secs(4), Some(1), false);
        assert_eq!(
            retries.held(&machine, Some(1), false),
            Some(Duration::from_secs(4))
        );
        assert_eq!(
            retries.held(&machine, Some(2), false),
            None,
            "a new generation"
        );
        assert_eq!(
            retries.held(&machine, Some(1), true),
            None,
            "deletion began"
        );
        tokio::time::advance(Duration::from_secs(3)).await;
        assert_eq!(
            retries.held(&machine, Some(1), false),
            Some(Duration::from_secs(1))
        );
        tokio::time::advance(Duration::from_secs(1)).await;
        assert_eq!(retries.held(&machine, Some(1), false), None, "over");
        retries.hold(&machine, Duration::MAX, Some(1), false);
        assert_eq!(
            retries.held(&machine, Some(1), false),
            Some(MAX_HOLD),
            "a hold the clock cannot represent is capped, not a panic"
        );
        retries.hold(&machine, Duration::from_secs(4), Some(1), false);
        retries.succeeded(&machine);
        assert_eq!(
            retries.held(&machine, Some(1), false),
            None,
            "a success ends it"
        );
    }
}
