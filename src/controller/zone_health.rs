//! Whether each zone can take machines, and when one that cannot stops being offered to the
//! control plane: a zone without an online node, or whose Proxmox does not answer, is published
//! with `controlPlane: false` once it has been unhealthy for a while, and offered again once it
//! has been healthy for a while, so a flapping node does not make KCP's choices churn.
//!
//! The zone stays in `status.failureDomains` rather than leaving it: KCP treats both alike (it
//! places no new control-plane machine there and removes the machines there first when it scales
//! down), while MachineDeployments pinned to the zone, and people reading the Cluster, still see
//! it. The decision is pure ([`verdict`]); only how long each zone has been in its state is
//! memory ([`ZoneStates`]).

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::cluster_conditions::EndpointSeen;
use super::conditions::Decided;
use crate::proxmox::{ClusterResource, ResourceType};

pub use crate::api::conditions::FAILURE_DOMAINS_AVAILABLE;
/// How soon a cluster with an unhealthy or recovering zone is looked at again: Proxmox sends no
/// events, so only a pass notices a node come back.
pub const UNHEALTHY_RECHECK: Duration = Duration::from_secs(30);

/// How long a zone must stay unhealthy before it is no longer offered to the control plane, and
/// healthy before it is offered again (`capmox run --zone-drain-after`, `--zone-restore-after`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ZoneHolds {
    /// Unhealthy this long: not offered to the control plane.
    pub drain_after: Duration,
    /// Healthy again this long: offered again.
    pub restore_after: Duration,
}

impl Default for ZoneHolds {
    fn default() -> Self {
        Self {
            drain_after: Duration::from_secs(120),
            restore_after: Duration::from_secs(300),
        }
    }
}

/// What a pass saw of one zone with nodes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ZoneSeen {
    pub zone: String,
    /// Why it cannot take machines; `None`: it can (or nothing says otherwise).
    pub problem: Option<String>,
    /// `spec.zoneConfig[].controlPlaneEligible` is not false.
    pub eligible_by_spec: bool,
    /// Published as not eligible for the control plane although the spec says it is: drained
    /// for its health by an earlier pass.
    pub drained: bool,
    /// How long it has been healthy or unhealthy, as it is now.
    pub in_state_for: Duration,
}

/// What the cluster does about its zones' health.
#[derive(Clone, Debug, PartialEq)]
pub struct ZoneVerdict {
    /// Zones published with `controlPlane: false` for their health.
    pub drained: BTreeSet<String>,
    /// `FailureDomainsAvailable`.
    pub condition: Decided,
    /// When to look again, if sooner than the cluster's resync.
    pub recheck: Option<Duration>,
}

/// Each zone's problem, from what its Proxmox answered: no answer, or no zone node online.
/// Zones whose Proxmox could not be asked for lack of credentials have no known problem: that
/// is a configuration error, reported in `ProxmoxAvailable`, not the zone's health.
pub fn zone_problems(endpoints: &[EndpointSeen]) -> Vec<(String, Option<String>)> {
    let mut problems = Vec::new();
    for endpoint in endpoints {
        let mut zones: Vec<&str> = Vec::new();
        for (zone, _) in &endpoint.zone_nodes {
            if !zones.contains(&zone.as_str()) {
                zones.push(zone);
            }
        }
        for zone in zones {
            let problem = match &endpoint.failure {
                Some(failure) if failure.backs_off => Some(format!(
                    "its Proxmox {} does not answer ({})",
                    endpoint.name, failure.reason
                )),
                Some(_) => None,
                None => no_node_online(endpoint, zone),
            };
            problems.push((zone.to_owned(), problem));
        }
    }
    problems
}

/// "no node online (…)" when every node of `zone` is offline or unknown to its Proxmox; "no
/// node can take a VM disk (…)" when the online ones have every storage for VM disks inactive
/// or full.
fn no_node_online(endpoint: &EndpointSeen, zone: &str) -> Option<String> {
    let nodes: Vec<&str> = endpoint
        .zone_nodes
        .iter()
        .filter(|(z, _)| z == zone)
        .map(|(_, node)| node.as_str())
        .collect();
    let down = |node: &&str| {
        let named = |list: &[(String, String)]| list.iter().any(|(z, n)| z == zone && n == node);
        named(&endpoint.offline_nodes) || named(&endpoint.unknown_nodes)
    };
    let no_room = |node: &str| {
        endpoint
            .nodes_without_disk_room
            .iter()
            .find(|(z, n, _)| z == zone && n == node)
            .map(|(_, _, why)| why.as_str())
    };
    if nodes.iter().all(down) {
        return Some(format!("no node online ({})", nodes.join(", ")));
    }
    if !nodes.iter().all(|n| down(n) || no_room(n).is_some()) {
        return None;
    }
    let each: Vec<String> = nodes
        .iter()
        .map(|node| match no_room(node) {
            Some(why) => format!("{node}: {why}"),
            None => format!("{node}: offline"),
        })
        .collect();
    Some(format!("no node can take a VM disk ({})", each.join("; ")))
}

/// Used share of a storage from which it counts as full: clones of usual disks no longer fit.
const FULL_AT_PERCENT: u64 = 98;

/// Why `node` cannot take a VM disk: every storage it lists for VM disks (content `images`) is
/// inactive or full. `None` when one can, or when it lists none (the token may not see them).
pub fn no_disk_room(resources: &[ClusterResource], node: &str) -> Option<String> {
    let storages: Vec<&ClusterResource> = resources
        .iter()
        .filter(|r| r.kind == ResourceType::Storage && r.node.as_deref() == Some(node))
        .filter(|r| {
            r.content
                .as_deref()
                .is_some_and(|c| c.split(',').any(|c| c.trim() == "images"))
        })
        .collect();
    let why = |storage: &ClusterResource| {
        let name = storage.storage.as_deref().unwrap_or("?");
        if storage.status.as_deref() != Some("available") {
            return Some(format!("{name} inactive"));
        }
        let (used, size) = (storage.disk?, storage.maxdisk.filter(|s| *s > 0)?);
        let percent = used.saturating_mul(100) / size;
        (percent >= FULL_AT_PERCENT).then(|| format!("{name} full ({percent}% used)"))
    };
    let reasons: Vec<String> = storages.iter().map(|s| why(s)).collect::<Option<_>>()?;
    (!reasons.is_empty()).then(|| reasons.join(", "))
}

/// Which zones are drained, and what `FailureDomainsAvailable` says. A zone is drained once
/// unhealthy for `drain_after` and stays so until healthy for `restore_after`; no zone is
/// drained when that would leave the control plane no zone at all.
pub fn verdict(zones: &[ZoneSeen], holds: &ZoneHolds) -> ZoneVerdict {
    let mut drained = BTreeSet::new();
    let mut recheck: Option<Duration> = None;
    let mut soonest = |wait: Duration| {
        recheck = Some(
            recheck
                .map_or(wait, |r| r.min(wait))
                .max(Duration::from_secs(1)),
        );
    };
    let mut notes = Vec::new();
    for zone in zones.iter().filter(|z| z.eligible_by_spec) {
        let (hold, stays_drained) = match (&zone.problem, zone.drained) {
            (Some(_), true) => (None, true),
            (Some(_), false) => (
                Some(holds.drain_after),
                zone.in_state_for >= holds.drain_after,
            ),
            (None, true) => (
                Some(holds.restore_after),
                zone.in_state_for < holds.restore_after,
            ),
            (None, false) => (None, false),
        };
        if stays_drained {
            drained.insert(zone.zone.clone());
        }
        let left = hold.map(|h| h.saturating_sub(zone.in_state_for));
        if let Some(left) = left.filter(|l| !l.is_zero()) {
            soonest(left);
        }
        if zone.problem.is_some() || stays_drained {
            soonest(UNHEALTHY_RECHECK);
            notes.push(note(zone, stays_drained, left));
        }
    }
    let eligible = zones.iter().filter(|z| z.eligible_by_spec).count();
    let nowhere_else = !drained.is_empty() && drained.len() == eligible;
    if nowhere_else {
        drained.clear();
        notes.push("no zone is left for the control plane, so every zone stays offered".into());
    }
    let unhealthy = zones.iter().any(|z| z.problem.is_some());
    let condition = match (unhealthy, notes.is_empty()) {
        (false, true) => Decided::ok(FAILURE_DOMAINS_AVAILABLE, "Available", ""),
        (true, _) => Decided::failed(FAILURE_DOMAINS_AVAILABLE, "ZoneUnhealthy", notes.join("; ")),
        (false, false) => Decided::failed(
            FAILURE_DOMAINS_AVAILABLE,
            "ZoneRecovering",
            notes.join("; "),
        ),
    };
    ZoneVerdict {
        drained,
        condition,
        recheck,
    }
}

/// One zone's line in the condition's message.
fn note(zone: &ZoneSeen, drained: bool, left: Option<Duration>) -> String {
    let name = &zone.zone;
    let left = left.map(|l| l.as_secs()).unwrap_or_default();
    match (&zone.problem, drained) {
        (Some(problem), true) => format!(
            "zone {name}: {problem}; not offered to the control plane until it is healthy again"
        ),
        (Some(problem), false) => format!(
            "zone {name}: {problem}; still offered to the control plane for {left}s unless it recovers"
        ),
        (None, _) => format!(
            "zone {name} is healthy again and is offered to the control plane in {left}s if it stays so"
        ),
    }
}

/// Since when each zone of each cluster has been healthy or unhealthy, so holds outlast a pass.
/// After a restart: every zone's state is timed from the first pass, so a pending drain or
/// restore waits up to one hold more; which zones are drained is read from the cluster's status.
#[derive(Clone, Default)]
pub struct ZoneStates {
    since: Arc<Mutex<HashMap<ClusterZone, (bool, Instant)>>>,
}

/// A zone of a cluster: (`namespace/name`, zone).
type ClusterZone = (String, String);

impl ZoneStates {
    /// Notes that `zone` of `cluster` is `healthy` now; returns how long it has been so.
    pub fn observe(&self, cluster: &str, zone: &str, healthy: bool) -> Duration {
        let now = Instant::now();
        let mut since = self
            .since
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let entry = since
            .entry((cluster.to_owned(), zone.to_owned()))
            .or_insert((healthy, now));
        if entry.0 != healthy {
            *entry = (healthy, now);
        }
        now.duration_since(entry.1)
    }

    /// Forgets a cluster's zones (the cluster is gone).
    pub fn forget(&self, cluster: &str) {
        self.since
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .retain(|(c, _), _| c != cluster);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controller::cluster_conditions::EndpointFailure;
    use crate::controller::conditions::Status;

    const HOLDS: ZoneHolds = ZoneHolds {
        drain_after: Duration::from_secs(120),
        restore_after: Duration::from_secs(300),
    };

    fn zone(name: &str, problem: Option<&str>, drained: bool, secs: u64) -> ZoneSeen {
        ZoneSeen {
            zone: name.into(),
            problem: problem.map(Into::into),
            eligible_by_spec: true,
            drained,
            in_state_for: Duration::from_secs(secs),
        }
    }

    /// Zones seen → zones drained, the condition's reason, the recheck in seconds.
    type Row = (
        Vec<ZoneSeen>,
        &'static [&'static str],
        &'static str,
        Option<u64>,
    );

    #[test]
    fn a_zone_is_drained_after_its_unhealthy_hold_and_offered_again_after_its_healthy_hold() {
        let down = Some("no node online (pve1, pve2)");
        // (zones seen, drained, condition reason, recheck in s)
        let rows: Vec<Row> = vec![
            (
                vec![zone("a", None, false, 0), zone("b", None, false, 0)],
                &[],
                "Available",
                None,
            ),
            // Unhealthy, not yet for its hold: still offered, looked at when the hold ends.
            (
                vec![zone("a", down, false, 30), zone("b", None, false, 0)],
                &[],
                "ZoneUnhealthy",
                Some(30),
            ),
            (
                vec![zone("a", down, false, 100), zone("b", None, false, 0)],
                &[],
                "ZoneUnhealthy",
                Some(20),
            ),
            // Its hold is over: drained.
            (
                vec![zone("a", down, false, 120), zone("b", None, false, 0)],
                &["a"],
                "ZoneUnhealthy",
                Some(30),
            ),
            (
                vec![zone("a", down, true, 5000), zone("b", None, false, 0)],
                &["a"],
                "ZoneUnhealthy",
                Some(30),
            ),
            // Healthy again, not yet for its hold: stays drained.
            (
                vec![zone("a", None, true, 10), zone("b", None, false, 0)],
                &["a"],
                "ZoneRecovering",
                Some(30),
            ),
            (
                vec![zone("a", None, true, 290), zone("b", None, false, 0)],
                &["a"],
                "ZoneRecovering",
                Some(10),
            ),
            // Healthy for its hold: offered again.
            (
                vec![zone("a", None, true, 300), zone("b", None, false, 0)],
                &[],
                "Available",
                None,
            ),
            // Never every zone: the control plane would have nowhere to go.
            (
                vec![zone("a", down, false, 500), zone("b", down, false, 500)],
                &[],
                "ZoneUnhealthy",
                Some(30),
            ),
            (
                vec![zone("a", down, true, 500), zone("b", down, false, 500)],
                &[],
                "ZoneUnhealthy",
                Some(30),
            ),
        ];
        for (i, (zones, drained, reason, recheck)) in rows.into_iter().enumerate() {
            let verdict = verdict(&zones, &HOLDS);
            let expected: BTreeSet<String> = drained.iter().map(|z| (*z).to_owned()).collect();
            assert_eq!(verdict.drained, expected, "row {i}");
            assert_eq!(verdict.condition.reason, reason, "row {i}");
            assert_eq!(
                verdict.condition.status == Status::True,
                reason == "Available",
                "row {i}"
            );
            assert_eq!(verdict.recheck, recheck.map(Duration::from_secs), "row {i}");
        }
    }

    #[test]
    fn a_zone_the_spec_keeps_from_the_control_plane_is_not_counted_or_drained() {
        let mut kept_out = zone("a", Some("no node online (pve1)"), false, 1000);
        kept_out.eligible_by_spec = false;
        let verdict = verdict(&[kept_out, zone("b", None, false, 0)], &HOLDS);
        assert!(verdict.drained.is_empty());
        // Its health is still reported.
        assert_eq!(verdict.condition.reason, "ZoneUnhealthy");
    }

    #[test]
    fn the_message_names_each_zone_its_problem_and_what_follows() {
        let verdict = verdict(
            &[
                zone("rack-a", Some("no node online (pve1, pve2)"), true, 900),
                zone(
                    "rack-b",
                    Some("its Proxmox https://b:8006 does not answer (ProxmoxUnreachable)"),
                    false,
                    60,
                ),
                zone("rack-c", None, true, 100),
                zone("rack-d", None, false, 100),
            ],
            &HOLDS,
        );
        let message = &verdict.condition.message;
        for part in [
            "zone rack-a: no node online (pve1, pve2); not offered to the control plane until it is healthy again",
            "zone rack-b: its Proxmox https://b:8006 does not answer (ProxmoxUnreachable); still offered to the control plane for 60s unless it recovers",
            "zone rack-c is healthy again and is offered to the control plane in 200s if it stays so",
        ] {
            assert!(message.contains(part), "{part:?} in {message}");
        }
        assert!(!message.contains("rack-d"), "{message}");
    }

    #[test]
    fn a_zone_is_unhealthy_when_its_proxmox_fails_or_none_of_its_nodes_is_online() {
        let pair = |z: &str, n: &str| (z.to_owned(), n.to_owned());
        let answering = EndpointSeen {
            name: "https://a:8006".into(),
            zone_nodes: vec![
                pair("a", "pve1"),
                pair("a", "pve2"),
                pair("b", "pve3"),
                pair("c", "pve4"),
            ],
            offline_nodes: vec![pair("a", "pve1"), pair("b", "pve3")],
            unknown_nodes: vec![pair("a", "pve2")],
            ..EndpointSeen::default()
        };
        let failure = |backs_off| EndpointFailure {
            reason: if backs_off {
                "ProxmoxUnreachable"
            } else {
                "CredentialsNotFound"
            },
            message: String::new(),
            backs_off,
            no_credentials: !backs_off,
            retry_after: Duration::ZERO,
        };
        let down = EndpointSeen {
            name: "https://d:8006".into(),
            zone_nodes: vec![pair("d", "pve1")],
            failure: Some(failure(true)),
            ..EndpointSeen::default()
        };
        let unconfigured = EndpointSeen {
            name: "credentials Secret e".into(),
            zone_nodes: vec![pair("e", "pve1")],
            failure: Some(failure(false)),
            ..EndpointSeen::default()
        };
        assert_eq!(
            zone_problems(&[answering, down, unconfigured]),
            vec![
                (
                    "a".to_owned(),
                    Some("no node online (pve1, pve2)".to_owned())
                ),
                ("b".to_owned(), Some("no node online (pve3)".to_owned())),
                ("c".to_owned(), None),
                (
                    "d".to_owned(),
                    Some(
                        "its Proxmox https://d:8006 does not answer (ProxmoxUnreachable)"
                            .to_owned()
                    )
                ),
                ("e".to_owned(), None),
            ]
        );
    }

    fn storage(node: &str, name: &str, content: &str, status: &str, used: u64) -> ClusterResource {
        serde_json::from_value(serde_json::json!({
            "id": format!("storage/{node}/{name}"), "type": "storage", "node": node,
            "storage": name, "content": content, "status": status, "disk": used, "maxdisk": 100
        }))
        .expect("a storage entry")
    }

    #[test]
    fn a_node_takes_no_vm_disk_when_every_storage_for_them_is_inactive_or_full() {
        let listed = vec![
            storage("pve1", "local", "iso,vztmpl", "available", 100),
            storage("pve1", "local-lvm", "images,rootdir", "available", 99),
            storage("pve1", "ceph", "images", "unknown", 0),
            storage("pve2", "local-lvm", "images", "available", 99),
            storage("pve2", "ceph", "images", "available", 50),
            storage("pve3", "local", "iso", "unknown", 0),
        ];
        assert_eq!(
            no_disk_room(&listed, "pve1").as_deref(),
            Some("local-lvm full (99% used), ceph inactive"),
            "an ISO-only storage does not count"
        );
        assert_eq!(no_disk_room(&listed, "pve2"), None, "ceph has room");
        assert_eq!(
            no_disk_room(&listed, "pve3"),
            None,
            "no storage for disks listed"
        );
        assert_eq!(no_disk_room(&listed, "pve4"), None);
    }

    #[test]
    fn a_zone_whose_online_nodes_have_no_disk_room_is_unhealthy() {
        let pair = |z: &str, n: &str| (z.to_owned(), n.to_owned());
        let full = |z: &str, n: &str| {
            (
                z.to_owned(),
                n.to_owned(),
                "ceph full (99% used)".to_owned(),
            )
        };
        let seen = EndpointSeen {
            name: "https://a:8006".into(),
            zone_nodes: vec![
                pair("a", "pve1"),
                pair("a", "pve2"),
                pair("b", "pve3"),
                pair("b", "pve4"),
            ],
            offline_nodes: vec![pair("a", "pve2")],
            nodes_without_disk_room: vec![full("a", "pve1"), full("b", "pve3")],
            ..EndpointSeen::default()
        };
        assert_eq!(
            zone_problems(&[seen]),
            vec![
                (
                    "a".to_owned(),
                    Some(
                        "no node can take a VM disk (pve1: ceph full (99% used); pve2: offline)"
                            .to_owned()
                    )
                ),
                ("b".to_owned(), None),
            ]
        );
    }

    #[test]
    fn a_zones_state_is_timed_from_its_last_change_per_cluster() {
        let states = ZoneStates::default();
        assert_eq!(states.observe("ns/c", "a", false), Duration::ZERO);
        // A change starts the clock again; another cluster's zone of the same name is its own.
        assert_eq!(states.observe("ns/c", "a", true), Duration::ZERO);
        assert_eq!(states.observe("ns/d", "a", false), Duration::ZERO);
        states.forget("ns/c");
        assert_eq!(states.observe("ns/c", "a", false), Duration::ZERO);
    }
}
