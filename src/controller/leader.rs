//! Leader election on a `coordination.k8s.io/v1` Lease, with controller-runtime's semantics:
//! acquire a free or expired lease, renew it every retry period, and give up leadership when
//! renewing has failed for longer than the renew deadline. Every write carries the lease's
//! `resourceVersion`, so two replicas can never both win the same round. A follower judges a
//! lease expired by its own monotonic clock (how long the record has stayed unchanged since it
//! first saw it, as client-go does), never by comparing the holder's `renewTime` with its wall
//! clock: clocks of different nodes disagree.

use std::time::Duration;

use tokio::time::Instant;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// Why leader election stopped.
#[derive(Debug, thiserror::Error)]
pub enum LeaderElectionError {
    /// Renewing failed for longer than the renew deadline, or another replica took the lease.
    #[error("lost leadership of lease {namespace}/{name}: {reason}")]
    Lost {
        /// Lease namespace.
        namespace: String,
        /// Lease name.
        name: String,
        /// What happened.
        reason: String,
    },
    /// The timing flags contradict each other.
    #[error(
        "invalid leader election timing: need lease duration > renew deadline > retry period, got {lease_duration:?} / {renew_deadline:?} / {retry_period:?}"
    )]
    InvalidTiming {
        /// `--leader-elect-lease-duration`.
        lease_duration: Duration,
        /// `--leader-elect-renew-deadline`.
        renew_deadline: Duration,
        /// `--leader-elect-retry-period`.
        retry_period: Duration,
    },
}

/// Where the lease lives and how it is timed.
#[derive(Clone, Debug)]
pub struct LeaderElectionConfig {
    /// Lease name.
    pub name: String,
    /// Lease namespace.
    pub namespace: String,
    /// This replica's identity (pod name plus a random suffix in practice).
    pub identity: String,
    /// How long a lease stays valid without renewal; followers wait this long.
    pub lease_duration: Duration,
    /// How long the leader keeps trying to renew before it gives up.
    pub renew_deadline: Duration,
    /// How often to try to acquire or renew.
    pub retry_period: Duration,
}

impl LeaderElectionConfig {
    /// Checks lease duration > renew deadline > retry period, as controller-runtime requires.
    pub fn validate(&self) -> Result<(), LeaderElectionError> {
        if self.lease_duration > self.renew_deadline && self.renew_deadline > self.retry_period {
            Ok(())
        } else {
            Err(LeaderElectionError::InvalidTiming {
                lease_duration: self.lease_duration,
                renew_deadline: self.renew_deadline,
                retry_period: self.retry_period,
            })
        }
    }
}

/// What to do with the lease in one round.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Plan {
    /// No lease exists: create it, holding it.
    Create(LeaseSpec),
    /// The lease is ours or free/expired: write this spec (with the read resourceVersion).
    Write(LeaseSpec),
    /// Someone else holds a valid lease.
    Wait {
        /// The current holder.
        holder: String,
    },
}

/// The lease record as this replica last saw it, and when (on its own monotonic clock) it
/// first saw it so: another holder's lease expires when it stays unchanged for its duration.
#[derive(Debug, Default)]
pub(crate) struct Observed {
    record: Option<LeaseRecord>,
    since: Option<Instant>,
}

/// What identifies one renewal of a lease: holder, renew time, duration and resource version.
type LeaseRecord = (
    Option<String>,
    Option<MicroTime>,
    Option<i32>,
    Option<String>,
);

impl Observed {
    /// Records the lease as read at `now`; returns how long it has been unchanged.
    pub(crate) fn observe(&mut self, lease: Option<&Lease>, now: Instant) -> Duration {
        let record = lease.map(|lease| {
            let spec = lease.spec.as_ref();
            (
                spec.and_then(|s| s.holder_identity.clone()),
                spec.and_then(|s| s.renew_time.clone()),
                spec.and_then(|s| s.lease_duration_seconds),
                lease.metadata.resource_version.clone(),
            )
        });
        match self.since {
            Some(since) if self.record == record => now.saturating_duration_since(since),
            _ => {
                self.record = record;
                self.since = Some(now);
                Duration::ZERO
            }
        }
    }
}

/// Decides one round from the lease as read (pure, so the rules are table-tested): `now` is
/// only written into the lease; another holder's lease has expired once it has stayed
/// `unchanged_for` its duration on this replica's clock.
pub(crate) fn plan(
    existing: Option<&LeaseSpec>,
    identity: &str,
    now: Timestamp,
    lease_duration: Duration,
    unchanged_for: Duration,
) -> Plan {
    let duration_seconds = i32::try_from(lease_duration.as_secs())
        .unwrap_or(i32::MAX)
        .max(1);
    let Some(spec) = existing else {
        return Plan::Create(LeaseSpec {
            holder_identity: Some(identity.to_owned()),
            lease_duration_seconds: Some(duration_seconds),
            acquire_time: Some(MicroTime(now)),
            renew_time: Some(MicroTime(now)),
            lease_transitions: Some(0),
            ..LeaseSpec::default()
        });
    };
    let holder = spec.holder_identity.clone().unwrap_or_default();
    let ours = holder == identity;
    if !ours && !holder.is_empty() {
        let valid_for = Duration::from_secs(
            u64::try_from(spec.lease_duration_seconds.unwrap_or(0)).unwrap_or(0),
        );
        if unchanged_for < valid_for {
            return Plan::Wait { holder };
        }
    }
    let mut next = spec.clone();
    next.holder_identity = Some(identity.to_owned());
    next.lease_duration_seconds = Some(duration_seconds);
    next.renew_time = Some(MicroTime(now));
    if !ours {
        next.acquire_time = Some(MicroTime(now));
        next.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
    }
    Plan::Write(next)
}

/// Runs leader election until `shutdown` is cancelled (then releases the lease if held) or
/// leadership is lost (then returns an error so the manager exits and restarts as a follower).
/// `leading` reports the current state to the manager.
pub async fn run(
    api: Api<Lease>,
    config: LeaderElectionConfig,
    leading: watch::Sender<bool>,
    shutdown: CancellationToken,
) -> Result<(), LeaderElectionError> {
    config.validate()?;
    let mut last_renewal: Option<Instant> = None;
    let mut observed = Observed::default();
    loop {
        let is_leader = *leading.borrow();
        // A call to the API server never outlasts the renew deadline: a leader whose renewal
        // hangs steps down in time instead of leading on while another replica takes over.
        let budget = match last_renewal {
            Some(at) if is_leader => config.renew_deadline.saturating_sub(at.elapsed()),
            _ => config.renew_deadline,
        };
        let round =
            match tokio::time::timeout(budget, try_acquire_or_renew(&api, &config, &mut observed))
                .await
            {
                Ok(round) => round.map_err(|error| error.to_string()),
                Err(_) => Err(format!("the Lease request took longer than {budget:?}")),
            };
        match round {
            Ok(true) => {
                last_renewal = Some(Instant::now());
                if !is_leader {
                    tracing::info!(lease = %config.name, identity = %config.identity, "became leader");
                    leading.send_replace(true);
                }
            }
            Ok(false) if is_leader => {
                leading.send_replace(false);
                return Err(lost(&config, "another replica holds the lease"));
            }
            Ok(false) => {}
            Err(error) => {
                let overdue = last_renewal.is_some_and(|at| at.elapsed() >= config.renew_deadline);
                if is_leader && overdue {
                    leading.send_replace(false);
                    return Err(lost(
                        &config,
                        &format!("renewing failed past the renew deadline: {error}"),
                    ));
                }
                tracing::warn!(lease = %config.name, %error, "leader election round failed; retrying");
            }
        }
        tokio::select! {
            () = shutdown.cancelled() => {
                if *leading.borrow() {
                    leading.send_replace(false);
                    if tokio::time::timeout(config.renew_deadline, release(&api, &config)).await.is_err() {
                        tracing::warn!(lease = %config.name, "releasing the lease timed out; followers wait for it to expire");
                    }
                }
                return Ok(());
            }
            () = tokio::time::sleep(config.retry_period) => {}
        }
    }
}

fn lost(config: &LeaderElectionConfig, reason: &str) -> LeaderElectionError {
    LeaderElectionError::Lost {
        namespace: config.namespace.clone(),
        name: config.name.clone(),
        reason: reason.to_owned(),
    }
}

/// One round: true when this replica holds the lease afterwards.
async fn try_acquire_or_renew(
    api: &Api<Lease>,
    config: &LeaderElectionConfig,
    observed: &mut Observed,
) -> Result<bool, kube::Error> {
    let existing = api.get_opt(&config.name).await?;
    let unchanged_for = observed.observe(existing.as_ref(), Instant::now());
    let spec = existing.as_ref().and_then(|lease| lease.spec.as_ref());
    match plan(
        spec,
        &config.identity,
        Timestamp::now(),
        config.lease_duration,
        unchanged_for,
    ) {
        Plan::Wait { .. } => Ok(false),
        Plan::Create(spec) => {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(config.name.clone()),
                    namespace: Some(config.namespace.clone()),
                    ..ObjectMeta::default()
                },
                spec: Some(spec),
            };
            match api.create(&PostParams::default(), &lease).await {
                Ok(_) => Ok(true),
                Err(kube::Error::Api(status)) if status.code == 409 => Ok(false),
                Err(error) => Err(error),
            }
        }
        Plan::Write(spec) => {
            let Some(mut lease) = existing else {
                return Ok(false);
            };
            lease.spec = Some(spec);
            // The resourceVersion read above makes this a compare-and-swap: a concurrent
            // writer turns it into 409 Conflict, and that replica does not lead this round.
            match api
                .replace(&config.name, &PostParams::default(), &lease)
                .await
            {
                Ok(_) => Ok(true),
                Err(kube::Error::Api(status)) if status.code == 409 => Ok(false),
                Err(error) => Err(error),
            }
        }
    }
}

/// Gives the lease up so a follower takes over at once instead of after the lease duration.
async fn release(api: &Api<Lease>, config: &LeaderElectionConfig) {
    let Ok(Some(mut lease)) = api.get_opt(&config.name).await else {
        return;
    };
    let Some(spec) = lease.spec.as_mut() else {
        return;
    };
    if spec.holder_identity.as_deref() != Some(config.identity.as_str()) {
        return;
    }
    spec.holder_identity = None;
    spec.lease_duration_seconds = Some(1);
    spec.renew_time = Some(MicroTime(Timestamp::now()));
    if let Err(error) = api
        .replace(&config.name, &PostParams::default(), &lease)
        .await
    {
        tracing::warn!(lease = %config.name, %error, "could not release the lease; followers wait for it to expire");
    } else {
        tracing::info!(lease = %config.name, "released leadership");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(seconds: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + seconds).expect("valid timestamp")
    }

    fn held_by(holder: &str, renewed: i64, transitions: i32) -> LeaseSpec {
        LeaseSpec {
            holder_identity: Some(holder.to_owned()),
            lease_duration_seconds: Some(15),
            acquire_time: Some(MicroTime(at(0))),
            renew_time: Some(MicroTime(at(renewed))),
            lease_transitions: Some(transitions),
            ..LeaseSpec::default()
        }
    }

    const FIFTEEN: Duration = Duration::from_secs(15);

    #[test]
    fn a_missing_lease_is_created_and_held() {
        let Plan::Create(spec) = plan(None, "a", at(5), FIFTEEN, Duration::ZERO) else {
            panic!("expected Create");
        };
        assert_eq!(spec.holder_identity.as_deref(), Some("a"));
        assert_eq!(spec.lease_duration_seconds, Some(15));
        assert_eq!(spec.lease_transitions, Some(0));
    }

    #[test]
    fn a_valid_lease_of_another_replica_is_respected() {
        assert_eq!(
            plan(
                Some(&held_by("b", 10, 2)),
                "a",
                at(24),
                FIFTEEN,
                Duration::from_secs(14)
            ),
            Plan::Wait { holder: "b".into() }
        );
    }

    #[test]
    fn the_holders_renew_time_is_not_compared_with_this_clock() {
        // The holder's clock is 13 s behind ours: by our wall clock its lease ran out at 25,
        // but it has renewed (the record changed) 1 s ago on our own clock.
        assert_eq!(
            plan(
                Some(&held_by("b", -3, 2)),
                "a",
                at(25),
                FIFTEEN,
                Duration::from_secs(1)
            ),
            Plan::Wait { holder: "b".into() }
        );
    }

    #[test]
    fn a_record_is_timed_from_when_this_replica_saw_it_change() {
        let start = Instant::now();
        let mut lease = Lease {
            spec: Some(held_by("b", 10, 2)),
            ..Lease::default()
        };
        let mut observed = Observed::default();
        assert_eq!(observed.observe(Some(&lease), start), Duration::ZERO);
        let later = start + Duration::from_secs(9);
        assert_eq!(
            observed.observe(Some(&lease), later),
            Duration::from_secs(9)
        );
        lease.metadata.resource_version = Some("7".into());
        assert_eq!(observed.observe(Some(&lease), later), Duration::ZERO);
        assert_eq!(
            observed.observe(Some(&lease), later + Duration::from_secs(2)),
            Duration::from_secs(2)
        );
        assert_eq!(
            observed.observe(None, later + Duration::from_secs(3)),
            Duration::ZERO
        );
    }

    #[test]
    fn an_expired_lease_is_taken_over_with_a_transition() {
        let Plan::Write(spec) = plan(Some(&held_by("b", 10, 2)), "a", at(25), FIFTEEN, FIFTEEN)
        else {
            panic!("expected Write");
        };
        assert_eq!(spec.holder_identity.as_deref(), Some("a"));
        assert_eq!(spec.lease_transitions, Some(3));
        assert_eq!(spec.acquire_time, Some(MicroTime(at(25))));
    }

    #[test]
    fn the_holder_renews_without_a_transition() {
        let Plan::Write(spec) = plan(
            Some(&held_by("a", 10, 2)),
            "a",
            at(12),
            FIFTEEN,
            Duration::ZERO,
        ) else {
            panic!("expected Write");
        };
        assert_eq!(spec.renew_time, Some(MicroTime(at(12))));
        assert_eq!(spec.acquire_time, Some(MicroTime(at(0))));
        assert_eq!(spec.lease_transitions, Some(2));
    }

    #[test]
    fn a_released_lease_is_free_at_once() {
        let mut released = held_by("b", 10, 2);
        released.holder_identity = None;
        assert!(matches!(
            plan(Some(&released), "a", at(11), FIFTEEN, Duration::ZERO),
            Plan::Write(_)
        ));
    }

    #[test]
    fn timing_must_be_ordered() {
        let config = |lease, renew, retry| LeaderElectionConfig {
            name: "capmox".into(),
            namespace: "capmox-system".into(),
            identity: "a".into(),
            lease_duration: Duration::from_secs(lease),
            renew_deadline: Duration::from_secs(renew),
            retry_period: Duration::from_secs(retry),
        };
        assert!(config(15, 10, 2).validate().is_ok());
        assert!(config(10, 10, 2).validate().is_err());
        assert!(config(15, 2, 2).validate().is_err());
    }
}
