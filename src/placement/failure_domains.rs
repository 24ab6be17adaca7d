//! Failure domains published by a `ProxmoxCluster`: one per zone that has Proxmox nodes.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use crate::api::{FailureDomain, ProxmoxCluster};

/// CAPI accepts at most this many failure domains on a cluster.
pub const MAX_FAILURE_DOMAINS: usize = 100;

/// One thing wrong with `spec.zoneConfig`, naming the offending zones and nodes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ZoneProblem {
    /// Two `zoneConfig` entries use the same zone name.
    DuplicateZone {
        /// The repeated zone name.
        zone: String,
    },
    /// A Proxmox node belongs to more than one zone, so its failure domain is ambiguous.
    NodeInSeveralZones {
        /// The node.
        node: String,
        /// Every zone that lists it, sorted.
        zones: Vec<String>,
    },
    /// A zone lists a node that the cluster's non-empty `allowedNodes` does not allow.
    NodeNotAllowed {
        /// The zone.
        zone: String,
        /// The node outside `allowedNodes`.
        node: String,
    },
    /// More zones with nodes than CAPI accepts as failure domains.
    TooManyFailureDomains {
        /// Number of zones with nodes.
        count: usize,
    },
}

impl fmt::Display for ZoneProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::DuplicateZone { zone } => write!(
                f,
                "zone {zone:?} is listed more than once in spec.zoneConfig; merge the entries"
            ),
            Self::NodeInSeveralZones { node, zones } => write!(
                f,
                "node {node:?} is listed in zones {}; a node may belong to one zone only",
                quoted_list(zones)
            ),
            Self::NodeNotAllowed { zone, node } => write!(
                f,
                "zone {zone:?} lists node {node:?} which is not in spec.allowedNodes; \
                 add it to allowedNodes or remove it from the zone"
            ),
            Self::TooManyFailureDomains { count } => write!(
                f,
                "{count} zones have nodes but CAPI accepts at most {MAX_FAILURE_DOMAINS} failure domains; \
                 group nodes into fewer zones"
            ),
        }
    }
}

/// Everything wrong with a cluster's zone configuration, reported at once so the user fixes it in one go.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid zone configuration: {}", join_problems(.problems))]
pub struct ZoneConfigError {
    /// The problems, in a stable order (duplicate zones, shared nodes, disallowed nodes, count).
    pub problems: Vec<ZoneProblem>,
}

fn join_problems(problems: &[ZoneProblem]) -> String {
    problems
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

/// Renders `["a", "b"]` as `"a", "b"` for messages.
pub(crate) fn quoted_list(items: &[String]) -> String {
    if items.is_empty() {
        return "(none)".to_owned();
    }
    items
        .iter()
        .map(|i| format!("{i:?}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Every (zone, node) pair the zones name, in spec order, so the cluster controller can check the
/// nodes exist in Proxmox without reading the zone configuration itself.
pub fn zone_nodes(cluster: &ProxmoxCluster) -> Vec<(String, String)> {
    cluster
        .spec
        .zone_config
        .iter()
        .flat_map(|zone| {
            zone.nodes
                .iter()
                .map(|node| (zone.zone.clone(), node.clone()))
        })
        .collect()
}

/// Computes the CAPI failure domains of a cluster: one per zone with nodes, sorted by name, with
/// `controlPlane` always explicit, or every configuration problem found.
pub fn failure_domains(cluster: &ProxmoxCluster) -> Result<Vec<FailureDomain>, ZoneConfigError> {
    let spec = &cluster.spec;
    let mut problems = Vec::new();

    let mut seen_zones = BTreeSet::new();
    let mut reported_duplicates = BTreeSet::new();
    for zone in &spec.zone_config {
        if !seen_zones.insert(zone.zone.as_str()) && reported_duplicates.insert(zone.zone.as_str())
        {
            problems.push(ZoneProblem::DuplicateZone {
                zone: zone.zone.clone(),
            });
        }
    }

    // Node -> zones listing it (a zone listing the same node twice counts once).
    let mut zones_of_node: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for zone in &spec.zone_config {
        for node in &zone.nodes {
            zones_of_node
                .entry(node.as_str())
                .or_default()
                .insert(zone.zone.as_str());
        }
    }
    for (node, zones) in &zones_of_node {
        if zones.len() > 1 {
            problems.push(ZoneProblem::NodeInSeveralZones {
                node: (*node).to_owned(),
                zones: zones.iter().map(|z| (*z).to_owned()).collect(),
            });
        }
    }

    if !spec.allowed_nodes.is_empty() {
        let mut reported = BTreeSet::new();
        for zone in &spec.zone_config {
            for node in &zone.nodes {
                if !spec.allowed_nodes.contains(node)
                    && reported.insert((zone.zone.as_str(), node.as_str()))
                {
                    problems.push(ZoneProblem::NodeNotAllowed {
                        zone: zone.zone.clone(),
                        node: node.clone(),
                    });
                }
            }
        }
    }

    let mut domains: Vec<FailureDomain> = Vec::new();
    let mut published = BTreeSet::new();
    for zone in spec.zone_config.iter().filter(|z| !z.nodes.is_empty()) {
        if published.insert(zone.zone.as_str()) {
            domains.push(FailureDomain {
                name: zone.zone.clone(),
                control_plane: Some(zone.control_plane_eligible.unwrap_or(true)),
                attributes: BTreeMap::new(),
            });
        }
    }
    if domains.len() > MAX_FAILURE_DOMAINS {
        problems.push(ZoneProblem::TooManyFailureDomains {
            count: domains.len(),
        });
    }

    if problems.is_empty() {
        domains.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(domains)
    } else {
        Err(ZoneConfigError { problems })
    }
}

#[cfg(test)]
mod zone_node_tests {
    use super::*;
    use crate::api::{ProxmoxClusterSpec, ZoneConfigSpec};

    #[test]
    fn zone_nodes_lists_every_pair_in_spec_order() {
        let zone = |name: &str, nodes: &[&str]| ZoneConfigSpec {
            zone: name.into(),
            nodes: nodes.iter().map(|n| (*n).to_owned()).collect(),
            ..ZoneConfigSpec::default()
        };
        let cluster = ProxmoxCluster::new(
            "c",
            ProxmoxClusterSpec {
                zone_config: vec![
                    zone("rack-a", &["pve1", "pve2"]),
                    zone("net-only", &[]),
                    zone("rack-b", &["pve3"]),
                ],
                ..ProxmoxClusterSpec::default()
            },
        );
        let pairs = zone_nodes(&cluster);
        let pairs: Vec<(&str, &str)> = pairs
            .iter()
            .map(|(z, n)| (z.as_str(), n.as_str()))
            .collect();
        assert_eq!(
            pairs,
            [("rack-a", "pve1"), ("rack-a", "pve2"), ("rack-b", "pve3")]
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{ProxmoxClusterSpec, ZoneConfigSpec};

    fn zone(name: &str, nodes: &[&str], cp: Option<bool>) -> ZoneConfigSpec {
        ZoneConfigSpec {
            zone: name.to_owned(),
            nodes: nodes.iter().map(|n| (*n).to_owned()).collect(),
            control_plane_eligible: cp,
            ..Default::default()
        }
    }

    fn cluster(allowed: &[&str], zones: Vec<ZoneConfigSpec>) -> ProxmoxCluster {
        ProxmoxCluster::new(
            "c1",
            ProxmoxClusterSpec {
                allowed_nodes: allowed.iter().map(|n| (*n).to_owned()).collect(),
                zone_config: zones,
                dns_servers: vec!["8.8.8.8".to_owned()],
                ..Default::default()
            },
        )
    }

    fn fd(name: &str, cp: bool) -> FailureDomain {
        FailureDomain {
            name: name.to_owned(),
            control_plane: Some(cp),
            attributes: BTreeMap::new(),
        }
    }

    #[test]
    fn valid_configurations_publish_one_domain_per_zone_with_nodes() {
        let cases: Vec<(&str, ProxmoxCluster, Vec<FailureDomain>)> = vec![
            ("no zones", cluster(&[], vec![]), vec![]),
            (
                "zones without nodes are network zones only",
                cluster(
                    &[],
                    vec![zone("net-a", &[], None), zone("net-b", &[], Some(false))],
                ),
                vec![],
            ),
            (
                "sorted by name, controlPlane defaults to true and is explicit",
                cluster(
                    &["pve1", "pve2", "pve3", "pve4", "pve5"],
                    vec![
                        zone("rack-c", &["pve5"], Some(false)),
                        zone("rack-a", &["pve1", "pve2"], None),
                        zone("net-only", &[], None),
                        zone("rack-b", &["pve3", "pve4"], Some(true)),
                    ],
                ),
                vec![fd("rack-a", true), fd("rack-b", true), fd("rack-c", false)],
            ),
            (
                "empty allowedNodes allows any zone node",
                cluster(&[], vec![zone("z1", &["pve9"], None)]),
                vec![fd("z1", true)],
            ),
        ];
        for (name, cluster, want) in cases {
            assert_eq!(failure_domains(&cluster), Ok(want), "case {name}");
        }
    }

    #[test]
    fn node_in_two_zones_is_reported_with_both_zones() {
        let c = cluster(
            &[],
            vec![
                zone("rack-b", &["pve1", "pve2"], None),
                zone("rack-a", &["pve2"], None),
            ],
        );
        let err = failure_domains(&c).unwrap_err();
        assert_eq!(
            err.problems,
            vec![ZoneProblem::NodeInSeveralZones {
                node: "pve2".to_owned(),
                zones: vec!["rack-a".to_owned(), "rack-b".to_owned()],
            }]
        );
        assert_eq!(
            err.to_string(),
            "invalid zone configuration: node \"pve2\" is listed in zones \"rack-a\", \"rack-b\"; \
             a node may belong to one zone only"
        );
    }

    #[test]
    fn zone_node_outside_allowed_nodes_is_reported() {
        let c = cluster(&["pve1"], vec![zone("rack-a", &["pve1", "pve7"], None)]);
        let err = failure_domains(&c).unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid zone configuration: zone \"rack-a\" lists node \"pve7\" which is not in \
             spec.allowedNodes; add it to allowedNodes or remove it from the zone"
        );
    }

    #[test]
    fn duplicate_zone_names_are_reported_once() {
        let c = cluster(
            &[],
            vec![
                zone("rack-a", &["pve1"], None),
                zone("rack-a", &["pve2"], None),
                zone("rack-a", &[], None),
            ],
        );
        let err = failure_domains(&c).unwrap_err();
        assert_eq!(
            err.problems,
            vec![ZoneProblem::DuplicateZone {
                zone: "rack-a".to_owned()
            }]
        );
        assert!(
            err.to_string()
                .contains("zone \"rack-a\" is listed more than once")
        );
    }

    #[test]
    fn more_than_one_hundred_domains_is_an_error() {
        let zones: Vec<ZoneConfigSpec> = (0..=MAX_FAILURE_DOMAINS)
            .map(|i| ZoneConfigSpec {
                zone: format!("z{i:03}"),
                nodes: vec![format!("pve{i}")],
                ..Default::default()
            })
            .collect();
        let err = failure_domains(&cluster(&[], zones.clone())).unwrap_err();
        assert_eq!(
            err.problems,
            vec![ZoneProblem::TooManyFailureDomains { count: 101 }]
        );
        assert!(err.to_string().contains("at most 100 failure domains"));
        // Exactly 100 is fine.
        let ok = failure_domains(&cluster(&[], zones[..100].to_vec())).unwrap();
        assert_eq!(ok.len(), 100);
    }

    #[test]
    fn all_problems_are_reported_together() {
        let c = cluster(
            &["pve1", "pve2"],
            vec![
                zone("a", &["pve1"], None),
                zone("a", &["pve2"], None),
                zone("b", &["pve1", "pve9"], None),
            ],
        );
        let err = failure_domains(&c).unwrap_err();
        assert_eq!(
            err.problems,
            vec![
                ZoneProblem::DuplicateZone { zone: "a".into() },
                ZoneProblem::NodeInSeveralZones {
                    node: "pve1".into(),
                    zones: vec!["a".into(), "b".into()]
                },
                ZoneProblem::NodeNotAllowed {
                    zone: "b".into(),
                    node: "pve9".into()
                },
            ]
        );
    }
}
