//! When a failing object is tried again. [`Retries`] keeps each object's streak of failed
//! reconciles in memory: every failure in a row waits longer (exponential, jittered, capped), a
//! pass that succeeds forgets the streak, and a restarted controller starts over, which only
//! shortens one wait.

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use kube::api::DynamicObject;
use kube::runtime::controller::Action;
use kube::runtime::reflector::ObjectRef;
use tokio::time::Instant;

use crate::proxmox::client::{jitter_fraction, jitter_seed};

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

#[cfg(test)]
mod tests {
    use super::*;

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
