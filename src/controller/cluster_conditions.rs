//! What a ProxmoxCluster reports, decided from what its pass saw: a pure function, so every
//! condition and its message is table-tested apart from Proxmox and Kubernetes.

use std::collections::BTreeSet;
use std::time::Duration;

use super::conditions::Decided;
use super::zone_health::{self, ZoneHolds, ZoneSeen};
use crate::api;

/// How often a healthy cluster is looked at again (Proxmox reachability, node list).
pub const RESYNC: Duration = Duration::from_secs(300);
/// How soon a cluster without usable credentials looks again (Secrets are not watched).
const NO_CREDENTIALS_RECHECK: Duration = Duration::from_secs(30);
/// How soon a cluster without a control plane endpoint looks again.
const ENDPOINT_RECHECK: Duration = Duration::from_secs(10);
/// `ProxmoxAvailable` reason (and Warning event) when Proxmox answers over plain HTTP: it works,
/// but the API token crosses the network unencrypted.
pub const PLAIN_HTTP: &str = "AvailableOverPlainHTTP";

/// What one Proxmox (one set of the cluster's credentials) looked like.
#[derive(Clone, Debug, Default)]
pub struct EndpointSeen {
    /// The zones it serves, in spec order.
    pub zones: Vec<String>,
    /// The zones of its (zone, node) pairs.
    pub zone_nodes: Vec<(String, String)>,
    /// The URL its credentials name, once they resolved.
    pub url: Option<String>,
    /// Its URL, else the Secret that should name it, for messages.
    pub name: String,
    /// `None`: it answered; else why not.
    pub failure: Option<EndpointFailure>,
    /// The zone nodes it does not know (when it answered).
    pub unknown_nodes: Vec<(String, String)>,
    /// The zone nodes it knows but lists as not online (when it answered).
    pub offline_nodes: Vec<(String, String)>,
    /// The online zone nodes whose storages for VM disks are all inactive or full, with why.
    pub nodes_without_disk_room: Vec<(String, String, String)>,
}

/// Why a Proxmox could not be used.
#[derive(Clone, Debug)]
pub struct EndpointFailure {
    pub reason: &'static str,
    pub message: String,
    /// Proxmox's own failure (retried with back-off), not the configuration's.
    pub backs_off: bool,
    /// No usable credentials.
    pub no_credentials: bool,
    /// What the server asked to wait.
    pub retry_after: Duration,
}

/// What the pass saw of the cluster.
#[derive(Clone, Debug, Default)]
pub struct ClusterSeen {
    /// Why the zone configuration is unusable, if it is.
    pub zone_problem: Option<String>,
    pub endpoints: Vec<EndpointSeen>,
    /// `spec.controlPlaneEndpoint` has a host and port.
    pub endpoint_known: bool,
    /// `ProxmoxAvailable` already says the token travels in clear.
    pub plain_http_reported: bool,
    /// Proxmox HA is on for some zone.
    pub ha_enabled: bool,
    /// Each zone with nodes: its health and how long it has been so.
    pub zones: Vec<ZoneSeen>,
    /// How long a zone's health must last before it changes what is published.
    pub holds: ZoneHolds,
}

/// What the cluster reports and does after its checks.
#[derive(Debug, PartialEq)]
pub struct ClusterPlan {
    /// The conditions it reports (besides `Paused`).
    pub decided: Vec<Decided>,
    /// Whether its infrastructure is provisioned.
    pub provisioned: bool,
    /// The first failure that is Proxmox's: reason, message and the server's `Retry-After`;
    /// the cluster backs off for it.
    pub backoff: Option<(&'static str, String, Duration)>,
    /// When to look again unless it backs off.
    pub requeue: Duration,
    /// Some Proxmox failed on its own account: the cluster's back-off streak goes on.
    pub proxmox_failed: bool,
    /// A Warning event saying a token travels over plain HTTP (once).
    pub plain_http_warning: Option<String>,
    /// The endpoints (indices) whose zones' HA rules are brought to the zones' nodes.
    pub sync_ha: Vec<usize>,
    /// The zones published with `controlPlane: false` for their health.
    pub drained: BTreeSet<String>,
}

/// What the cluster reports from what its pass saw.
pub fn plan(seen: &ClusterSeen) -> ClusterPlan {
    let several = seen.endpoints.len() > 1;
    let failed: Vec<&EndpointSeen> = seen
        .endpoints
        .iter()
        .filter(|e| e.failure.is_some())
        .collect();
    let (proxmox, backoff, plain_http_warning) = proxmox_available(seen, &failed, several);
    let mut requeue = RESYNC;
    if backoff.is_none()
        && failed
            .iter()
            .any(|e| e.failure.as_ref().is_some_and(|f| f.no_credentials))
    {
        requeue = NO_CREDENTIALS_RECHECK;
    }
    let proxmox_failed = failed
        .iter()
        .any(|e| e.failure.as_ref().is_some_and(|f| f.backs_off));
    let zones = zone_health::verdict(&seen.zones, &seen.holds);
    if let Some(recheck) = zones.recheck {
        requeue = requeue.min(recheck);
    }
    let mut decided = vec![
        proxmox,
        failure_domains_ready(seen, &failed, several),
        zones.condition,
    ];
    if !seen.endpoint_known {
        decided.push(Decided::failed(
            "ControlPlaneEndpointAvailable",
            "MissingControlPlaneEndpoint",
            "spec.controlPlaneEndpoint is not set yet; set it, or let the external control plane provider set it",
        ));
        if !proxmox_failed {
            // Not sooner than the back-off of a failing Proxmox.
            requeue = requeue.min(ENDPOINT_RECHECK);
        }
    }
    let provisioned = failed.is_empty() && seen.endpoint_known;
    let sync_ha = seen
        .endpoints
        .iter()
        .enumerate()
        .filter(|(_, e)| {
            e.failure.is_none()
                && seen.zone_problem.is_none()
                && e.unknown_nodes.is_empty()
                && seen.ha_enabled
        })
        .map(|(i, _)| i)
        .collect();
    ClusterPlan {
        decided,
        provisioned,
        backoff,
        requeue,
        proxmox_failed,
        plain_http_warning,
        sync_ha,
        drained: zones.drained,
    }
}

type BackOff = Option<(&'static str, String, Duration)>;

/// `ProxmoxAvailable`: every Proxmox answers (saying so when one is reached over plain HTTP),
/// or what failed, with the zones that keep working.
fn proxmox_available(
    seen: &ClusterSeen,
    failed: &[&EndpointSeen],
    several: bool,
) -> (Decided, BackOff, Option<String>) {
    let Some(first) = failed.first().and_then(|e| e.failure.as_ref()) else {
        return reachable(seen);
    };
    let mut message = failed
        .iter()
        .map(|e| failure_message(e, several))
        .collect::<Vec<_>>()
        .join("; ");
    let reachable: Vec<&str> = seen
        .endpoints
        .iter()
        .filter(|e| e.failure.is_none())
        .flat_map(|e| e.zones.iter().map(String::as_str))
        .collect();
    if several && !reachable.is_empty() {
        message.push_str(&format!(
            "; zones {} are reachable and keep working",
            reachable.join(", ")
        ));
    }
    let backoff = first
        .backs_off
        .then(|| (first.reason, message.clone(), first.retry_after));
    (
        Decided::failed(api::conditions::PROXMOX_AVAILABLE, first.reason, message),
        backoff,
        None,
    )
}

/// `ProxmoxAvailable=True`, saying so (and warning once) when a token travels in clear.
fn reachable(seen: &ClusterSeen) -> (Decided, BackOff, Option<String>) {
    let plain: Vec<&str> = seen
        .endpoints
        .iter()
        .filter_map(|e| e.url.as_deref())
        .filter(|url| url.starts_with("http://"))
        .collect();
    if plain.is_empty() {
        return (
            Decided::ok(api::conditions::PROXMOX_AVAILABLE, "Available", ""),
            None,
            None,
        );
    }
    let message = plain
        .iter()
        .map(|url| format!("Proxmox at {url} is reached over plain HTTP, so the API token is sent unencrypted; use an https:// URL"))
        .collect::<Vec<_>>()
        .join("; ");
    let warning = (!seen.plain_http_reported).then(|| message.clone());
    (
        Decided::ok(api::conditions::PROXMOX_AVAILABLE, PLAIN_HTTP, message),
        None,
        warning,
    )
}

/// What failed at one Proxmox; with several, prefixed with the zones it serves.
fn failure_message(endpoint: &EndpointSeen, several: bool) -> String {
    let message = endpoint
        .failure
        .as_ref()
        .map(|f| f.message.clone())
        .unwrap_or_default();
    if !several {
        return message;
    }
    let zones = if endpoint.zones.is_empty() {
        "machines outside the zones".to_owned()
    } else {
        format!("zones {}", endpoint.zones.join(", "))
    };
    format!("{zones}: {message}")
}

/// `FailureDomainsReady`: the zone configuration is usable and Proxmox knows its nodes. The
/// failure domains of a Proxmox that does not answer while others do stay published (their
/// machines are not orphans; whether they stay offered to the control plane is
/// `FailureDomainsAvailable`'s), but are named here.
fn failure_domains_ready(seen: &ClusterSeen, failed: &[&EndpointSeen], several: bool) -> Decided {
    const TYPE: &str = api::conditions::FAILURE_DOMAINS_READY;
    if let Some(problem) = &seen.zone_problem {
        return Decided::failed(TYPE, "InvalidZoneConfig", problem.clone());
    }
    let unknown: Vec<String> = seen
        .endpoints
        .iter()
        .flat_map(|e| e.unknown_nodes.iter())
        .map(|(zone, node)| format!("node {node:?} of zone {zone:?}"))
        .collect();
    if !unknown.is_empty() {
        return Decided::failed(
            TYPE,
            "UnknownNode",
            format!(
                "Proxmox does not know {}; fix spec.zoneConfig or add the nodes",
                unknown.join(", ")
            ),
        );
    }
    let lost: Vec<String> = failed
        .iter()
        .filter(|e| e.failure.as_ref().is_some_and(|f| f.backs_off))
        .flat_map(|e| {
            let zones: BTreeSet<&String> = e.zone_nodes.iter().map(|(zone, _)| zone).collect();
            zones
                .into_iter()
                .map(|zone| format!("{zone} ({})", e.name))
                .collect::<Vec<_>>()
        })
        .collect();
    let partial = several && failed.len() < seen.endpoints.len();
    if partial && !lost.is_empty() {
        return Decided::failed(
            TYPE,
            "ProxmoxUnavailable",
            format!(
                "the Proxmox of failure domains {} does not answer: their machines wait until it does, and the other failure domains keep working; FailureDomainsAvailable says when they stop being offered to the control plane",
                lost.join(", ")
            ),
        );
    }
    Decided::ok(TYPE, "Ready", "")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controller::conditions::Status;

    fn answering(zones: &[&str], url: &str) -> EndpointSeen {
        EndpointSeen {
            zones: zones.iter().map(|z| (*z).to_owned()).collect(),
            zone_nodes: zones
                .iter()
                .map(|z| ((*z).to_owned(), format!("{z}-n1")))
                .collect(),
            url: Some(url.to_owned()),
            name: url.to_owned(),
            ..EndpointSeen::default()
        }
    }

    fn down(zones: &[&str], url: &str) -> EndpointSeen {
        EndpointSeen {
            failure: Some(EndpointFailure {
                reason: "ProxmoxUnreachable",
                message: format!("checking Proxmox at {url}: connection refused"),
                backs_off: true,
                no_credentials: false,
                retry_after: Duration::from_secs(7),
            }),
            ..answering(zones, url)
        }
    }

    fn without_credentials() -> EndpointSeen {
        EndpointSeen {
            url: None,
            name: "the cluster's credentials".into(),
            failure: Some(EndpointFailure {
                reason: "CredentialsNotFound",
                message: "Secret capmox not found".into(),
                backs_off: false,
                no_credentials: true,
                retry_after: Duration::ZERO,
            }),
            ..EndpointSeen::default()
        }
    }

    fn healthy() -> ClusterSeen {
        ClusterSeen {
            endpoints: vec![answering(&["rack-a", "rack-b"], "https://pve:8006")],
            endpoint_known: true,
            ..ClusterSeen::default()
        }
    }

    fn unhealthy_zone(zone: &str, secs: u64) -> ZoneSeen {
        ZoneSeen {
            zone: zone.into(),
            problem: Some("no node online (pve1)".into()),
            eligible_by_spec: true,
            drained: false,
            in_state_for: Duration::from_secs(secs),
        }
    }

    fn healthy_zone(zone: &str) -> ZoneSeen {
        ZoneSeen {
            problem: None,
            ..unhealthy_zone(zone, 0)
        }
    }

    #[test]
    fn an_unhealthy_zone_is_drained_after_its_hold_and_looked_at_again_soon() {
        let seen = |secs| ClusterSeen {
            zones: vec![unhealthy_zone("rack-a", secs), healthy_zone("rack-b")],
            ..healthy()
        };
        let early = plan(&seen(30));
        assert!(early.drained.is_empty());
        assert_eq!(early.requeue, zone_health::UNHEALTHY_RECHECK);
        let late = plan(&seen(500));
        assert_eq!(late.drained, BTreeSet::from(["rack-a".to_owned()]));
        assert!(
            late.provisioned,
            "a zone's health is no reason to unprovision"
        );
        assert_eq!(plan(&healthy()).drained, BTreeSet::new());
    }

    /// Each condition as `Type=Status/Reason`, as `kubectl describe` shows it.
    fn said(plan: &ClusterPlan) -> Vec<String> {
        plan.decided
            .iter()
            .map(|d| {
                let status = if d.status == Status::True {
                    "True"
                } else {
                    "False"
                };
                format!("{}={status}/{}", d.type_, d.reason)
            })
            .collect()
    }

    #[test]
    fn every_condition_the_cluster_reports_from_what_it_saw() {
        let rows: Vec<(&str, ClusterSeen, &[&str], bool)> = vec![
            (
                "all well",
                healthy(),
                &[
                    "ProxmoxAvailable=True/Available",
                    "FailureDomainsReady=True/Ready",
                    "FailureDomainsAvailable=True/Available",
                ],
                true,
            ),
            (
                "plain HTTP",
                ClusterSeen {
                    endpoints: vec![answering(&["rack-a"], "http://pve:8006")],
                    ..healthy()
                },
                &[
                    "ProxmoxAvailable=True/AvailableOverPlainHTTP",
                    "FailureDomainsReady=True/Ready",
                    "FailureDomainsAvailable=True/Available",
                ],
                true,
            ),
            (
                "no credentials",
                ClusterSeen {
                    endpoints: vec![without_credentials()],
                    ..healthy()
                },
                &[
                    "ProxmoxAvailable=False/CredentialsNotFound",
                    "FailureDomainsReady=True/Ready",
                    "FailureDomainsAvailable=True/Available",
                ],
                false,
            ),
            (
                "Proxmox down",
                ClusterSeen {
                    endpoints: vec![down(&["rack-a"], "https://pve:8006")],
                    ..healthy()
                },
                &[
                    "ProxmoxAvailable=False/ProxmoxUnreachable",
                    "FailureDomainsReady=True/Ready",
                    "FailureDomainsAvailable=True/Available",
                ],
                false,
            ),
            (
                "one site of two down",
                ClusterSeen {
                    endpoints: vec![
                        answering(&["rack-a"], "https://a:8006"),
                        down(&["rack-b"], "https://b:8006"),
                    ],
                    ..healthy()
                },
                &[
                    "ProxmoxAvailable=False/ProxmoxUnreachable",
                    "FailureDomainsReady=False/ProxmoxUnavailable",
                    "FailureDomainsAvailable=True/Available",
                ],
                false,
            ),
            (
                "bad zone configuration",
                ClusterSeen {
                    zone_problem: Some("zone rack-a names no nodes".into()),
                    ..healthy()
                },
                &[
                    "ProxmoxAvailable=True/Available",
                    "FailureDomainsReady=False/InvalidZoneConfig",
                    "FailureDomainsAvailable=True/Available",
                ],
                true,
            ),
            (
                "a zone node Proxmox does not know",
                ClusterSeen {
                    endpoints: vec![EndpointSeen {
                        unknown_nodes: vec![("rack-a".into(), "pve9".into())],
                        ..answering(&["rack-a"], "https://pve:8006")
                    }],
                    ..healthy()
                },
                &[
                    "ProxmoxAvailable=True/Available",
                    "FailureDomainsReady=False/UnknownNode",
                    "FailureDomainsAvailable=True/Available",
                ],
                true,
            ),
            (
                "no control plane endpoint",
                ClusterSeen {
                    endpoint_known: false,
                    ..healthy()
                },
                &[
                    "ProxmoxAvailable=True/Available",
                    "FailureDomainsReady=True/Ready",
                    "FailureDomainsAvailable=True/Available",
                    "ControlPlaneEndpointAvailable=False/MissingControlPlaneEndpoint",
                ],
                false,
            ),
            (
                "a zone without an online node, for less than its hold",
                ClusterSeen {
                    zones: vec![unhealthy_zone("rack-a", 30), healthy_zone("rack-b")],
                    ..healthy()
                },
                &[
                    "ProxmoxAvailable=True/Available",
                    "FailureDomainsReady=True/Ready",
                    "FailureDomainsAvailable=False/ZoneUnhealthy",
                ],
                true,
            ),
        ];
        for (name, seen, expected, provisioned) in rows {
            let plan = plan(&seen);
            assert_eq!(said(&plan), expected, "{name}");
            assert_eq!(plan.provisioned, provisioned, "{name}: provisioned");
        }
    }

    #[test]
    fn a_failing_proxmox_backs_off_and_a_configuration_problem_is_looked_at_again_soon() {
        let down = plan(&ClusterSeen {
            endpoints: vec![down(&["rack-a"], "https://pve:8006")],
            endpoint_known: false,
            ..healthy()
        });
        let (reason, _, retry_after) = down.backoff.clone().expect("Proxmox's failure backs off");
        assert_eq!(
            (reason, retry_after),
            ("ProxmoxUnreachable", Duration::from_secs(7))
        );
        assert_eq!(
            down.requeue, RESYNC,
            "the back-off, not the endpoint's recheck, sets the pace"
        );
        let no_credentials = plan(&ClusterSeen {
            endpoints: vec![without_credentials()],
            ..healthy()
        });
        assert!(no_credentials.backoff.is_none());
        assert_eq!(no_credentials.requeue, NO_CREDENTIALS_RECHECK);
        let no_endpoint = plan(&ClusterSeen {
            endpoint_known: false,
            ..healthy()
        });
        assert_eq!(no_endpoint.requeue, ENDPOINT_RECHECK);
        assert_eq!(plan(&healthy()).requeue, RESYNC);
    }

    #[test]
    fn with_several_proxmox_the_messages_name_the_zones_and_what_keeps_working() {
        let plan = plan(&ClusterSeen {
            endpoints: vec![
                answering(&["rack-a"], "https://a:8006"),
                down(&["rack-b"], "https://b:8006"),
            ],
            ..healthy()
        });
        let proxmox = &plan.decided[0].message;
        assert!(
            proxmox.starts_with("zones rack-b: checking Proxmox at https://b:8006"),
            "{proxmox}"
        );
        assert!(
            proxmox.ends_with("; zones rack-a are reachable and keep working"),
            "{proxmox}"
        );
        let domains = &plan.decided[1].message;
        assert!(
            domains.contains("failure domains rack-b (https://b:8006) does not answer"),
            "{domains}"
        );
    }

    #[test]
    fn plain_http_is_warned_about_once_and_ha_zones_are_synced_only_where_all_is_known() {
        let seen = ClusterSeen {
            endpoints: vec![answering(&["rack-a"], "http://pve:8006")],
            ha_enabled: true,
            ..healthy()
        };
        assert!(plan(&seen).plain_http_warning.is_some());
        let said_before = ClusterSeen {
            plain_http_reported: true,
            ..seen.clone()
        };
        assert!(plan(&said_before).plain_http_warning.is_none());
        assert_eq!(plan(&seen).sync_ha, [0]);
        let unknown = ClusterSeen {
            endpoints: vec![EndpointSeen {
                unknown_nodes: vec![("rack-a".into(), "x".into())],
                ..answering(&["rack-a"], "https://p")
            }],
            ha_enabled: true,
            ..healthy()
        };
        assert!(plan(&unknown).sync_ha.is_empty());
        assert!(
            plan(&ClusterSeen {
                ha_enabled: false,
                ..seen
            })
            .sync_ha
            .is_empty()
        );
    }
}
