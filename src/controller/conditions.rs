//! `metav1.Condition` bookkeeping: a condition's transition time changes only when its status
//! does, and `Ready` summarises the others, so status writes stay no-ops when nothing changed.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;

use crate::api::conditions::READY;

/// A condition as a reconciler decides it, before timestamps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decided {
    /// Condition type.
    pub type_: &'static str,
    /// True, False or Unknown.
    pub status: Status,
    /// CamelCase reason a user can act on.
    pub reason: String,
    /// Human-readable details.
    pub message: String,
}

/// Condition status.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    /// The condition holds.
    True,
    /// The condition does not hold.
    False,
    /// Not known yet.
    Unknown,
}

impl Status {
    fn as_str(self) -> &'static str {
        match self {
            Self::True => "True",
            Self::False => "False",
            Self::Unknown => "Unknown",
        }
    }
}

impl Decided {
    /// A condition that holds.
    pub fn ok(type_: &'static str, reason: &str, message: impl Into<String>) -> Self {
        Self {
            type_,
            status: Status::True,
            reason: reason.to_owned(),
            message: message.into(),
        }
    }

    /// A condition that does not hold, with what to do about it.
    pub fn failed(type_: &'static str, reason: &str, message: impl Into<String>) -> Self {
        Self {
            type_,
            status: Status::False,
            reason: reason.to_owned(),
            message: message.into(),
        }
    }
}

/// Longest condition message the API server accepts (bytes); longer ones fail the whole status
/// write, so a long Proxmox or guest-supplied message must never reach it uncut.
pub const CONDITION_MESSAGE_MAX: usize = 32 * 1024;
/// Longest Event note the API server accepts (bytes).
pub const EVENT_NOTE_MAX: usize = 1024;

/// `message` cut to at most `max` bytes on a character boundary, ending in "…" when cut.
pub fn truncate_message(message: &str, max: usize) -> String {
    const ELLIPSIS: &str = "…";
    if message.len() <= max {
        return message.to_owned();
    }
    let mut end = max.saturating_sub(ELLIPSIS.len());
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}{ELLIPSIS}", &message[..end])
}

/// The conditions this controller owns, sorted by type: `decided` plus their `Ready` summary
/// (False with the first failing condition's reason and message, else True), or the `Ready`
/// in `decided` when there is one (a deletion says what it waits for). Each keeps its
/// `lastTransitionTime` from `existing` unless its status changed. Conditions other writers own
/// are not returned: status is written with server-side apply, which leaves them alone.
pub fn merge(
    existing: &[Condition],
    decided: &[Decided],
    generation: Option<i64>,
    now: Timestamp,
) -> Vec<Condition> {
    let mut all: Vec<Decided> = decided
        .iter()
        .filter(|d| d.type_ != READY)
        .cloned()
        .collect();
    all.push(
        decided
            .iter()
            .find(|d| d.type_ == READY)
            .cloned()
            .unwrap_or_else(|| summary(decided)),
    );
    let mut merged: Vec<Condition> = all
        .iter()
        .map(|d| {
            let previous = existing.iter().find(|c| c.type_ == d.type_);
            let since = match previous {
                Some(p) if p.status == d.status.as_str() => p.last_transition_time.clone(),
                _ => Time(now),
            };
            Condition {
                type_: d.type_.to_owned(),
                status: d.status.as_str().to_owned(),
                reason: d.reason.clone(),
                message: truncate_message(&d.message, CONDITION_MESSAGE_MAX),
                last_transition_time: since,
                observed_generation: generation,
            }
        })
        .collect();
    merged.sort_by(|a, b| a.type_.cmp(&b.type_));
    merged
}

fn summary(decided: &[Decided]) -> Decided {
    let failing = decided
        .iter()
        .filter(|d| d.type_ != READY && d.type_ != crate::api::conditions::PAUSED)
        .find(|d| d.status != Status::True);
    match failing {
        Some(d) => Decided {
            type_: READY,
            status: d.status,
            reason: d.reason.clone(),
            message: d.message.clone(),
        },
        None => Decided::ok(READY, "Ready", ""),
    }
}

/// Whether the condition of `type_` is present and True.
pub fn is_true(conditions: &[Condition], type_: &str) -> bool {
    conditions
        .iter()
        .any(|c| c.type_ == type_ && c.status == "True")
}

#[cfg(test)]
mod tests {
    #[test]
    fn long_messages_are_cut_on_a_character_boundary() {
        assert_eq!(truncate_message("short", 10), "short");
        let cut = truncate_message(&"é".repeat(20), 10);
        assert!(cut.len() <= 10, "{cut}");
        assert!(cut.ends_with('…'), "{cut}");
        assert!(cut.starts_with("éé"), "{cut}");
        let huge = "x".repeat(CONDITION_MESSAGE_MAX * 2);
        let merged = merge(
            &[],
            &[Decided::failed(
                "VirtualMachineProvisioned",
                "CloudInitFailed",
                huge,
            )],
            None,
            Timestamp::now(),
        );
        assert!(
            merged
                .iter()
                .all(|c| c.message.len() <= CONDITION_MESSAGE_MAX),
            "every condition (Ready's summary too) fits the API's limit"
        );
    }

    use super::*;

    fn at(seconds: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + seconds).expect("valid")
    }

    #[test]
    fn a_decided_ready_replaces_the_summary() {
        let merged = merge(
            &[],
            &[
                Decided::ok("ProxmoxAvailable", "Available", ""),
                Decided::failed(READY, "Deleting", "waiting for ProxmoxMachines m-0"),
            ],
            None,
            at(0),
        );
        let ready = merged.iter().find(|c| c.type_ == READY).expect("Ready");
        assert_eq!(
            (ready.status.as_str(), ready.reason.as_str()),
            ("False", "Deleting")
        );
        assert_eq!(merged.len(), 2, "{merged:?}");
    }

    #[test]
    fn ready_summarises_the_first_failing_condition() {
        let merged = merge(
            &[],
            &[
                Decided::ok("ProxmoxAvailable", "Available", ""),
                Decided::failed(
                    "FailureDomainsReady",
                    "InvalidZoneConfig",
                    "node pve1 is in rack-a and rack-b",
                ),
            ],
            Some(3),
            at(0),
        );
        let ready = merged.iter().find(|c| c.type_ == "Ready").expect("Ready");
        assert_eq!(ready.status, "False");
        assert_eq!(ready.reason, "InvalidZoneConfig");
        assert_eq!(ready.message, "node pve1 is in rack-a and rack-b");
        assert_eq!(ready.observed_generation, Some(3));
        assert_eq!(merged.len(), 3);
    }

    #[test]
    fn transition_time_changes_only_with_the_status() {
        let first = merge(
            &[],
            &[Decided::ok("ProxmoxAvailable", "Available", "")],
            None,
            at(0),
        );
        let same = merge(
            &first,
            &[Decided::ok("ProxmoxAvailable", "Available", "still")],
            None,
            at(60),
        );
        assert_eq!(same, {
            let mut expected = first.clone();
            expected
                .iter_mut()
                .filter(|c| c.type_ == "ProxmoxAvailable")
                .for_each(|c| c.message = "still".into());
            expected
        });
        let flipped = merge(
            &same,
            &[Decided::failed(
                "ProxmoxAvailable",
                "Unauthorized",
                "bad token",
            )],
            None,
            at(120),
        );
        assert!(
            flipped
                .iter()
                .all(|c| c.last_transition_time == Time(at(120)))
        );
    }

    #[test]
    fn only_owned_conditions_are_returned() {
        let foreign = Condition {
            type_: "ExternalThing".into(),
            status: "True".into(),
            reason: "Fine".into(),
            message: String::new(),
            last_transition_time: Time(at(0)),
            observed_generation: None,
        };
        let merged = merge(
            &[foreign],
            &[Decided::ok("ProxmoxAvailable", "Available", "")],
            None,
            at(5),
        );
        let types: Vec<&str> = merged.iter().map(|c| c.type_.as_str()).collect();
        assert_eq!(types, ["ProxmoxAvailable", "Ready"]);
        assert!(is_true(&merged, "Ready"));
    }
}
