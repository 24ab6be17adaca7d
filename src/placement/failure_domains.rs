//! Failure domains published by a `ProxmoxCluster`: one per zone that has Proxmox nodes.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use crate::api::{
    FailureDomain, ProxmoxCluster, ProxmoxClusterSpec, SecretReference, ZoneConfigSpec,
};

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

/// Whether the spec offers `zone` to the control plane (`controlPlaneEligible` unset or true), so
/// the cluster controller tells a zone it took out for its health from one the user keeps out.
pub fn offered_to_control_plane(cluster: &ProxmoxCluster, zone: &str) -> bool {
    cluster
        .spec
        .zone_config
        .iter()
        .find(|z| z.zone == zone)
        .is_none_or(|z| z.control_plane_eligible != Some(false))
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

/// The zones reached with one set of credentials: one Proxmox cluster as far as capmox can tell.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ZonesByCredentials {
    /// The zones' own `credentialsRef`; `None` for the cluster's own credentials, which also
    /// reach the nodes of `allowedNodes` and the machines outside any zone.
    pub credentials_ref: Option<SecretReference>,
    /// The zones, in spec order.
    pub zones: Vec<String>,
    /// Every (zone, node) pair of those zones, in spec order, to check against that Proxmox.
    pub zone_nodes: Vec<(String, String)>,
}

/// The credentials `zone` names of its own: `None` when it names none, or names the cluster's
/// own Secret (then it is on the cluster's Proxmox, like a zone that names none).
pub fn own_credentials<'a>(
    spec: &ProxmoxClusterSpec,
    zone: &'a ZoneConfigSpec,
) -> Option<&'a SecretReference> {
    zone.credentials_ref
        .as_ref()
        .filter(|reference| spec.credentials_ref.as_ref() != Some(*reference))
}

/// The cluster's zones grouped by the credentials that reach them: the cluster's own first,
/// then one group per Secret zones name, in spec order. Each group is checked, reported and
/// synchronised (HA) against its own Proxmox. The cluster's own group is left out when nothing
/// uses it: every zone names its own credentials and the cluster names no Secret (machines
/// outside zones cannot exist then, and templates are read through the first group).
pub fn zones_by_credentials(cluster: &ProxmoxCluster) -> Vec<ZonesByCredentials> {
    let mut groups = vec![ZonesByCredentials {
        credentials_ref: None,
        zones: Vec::new(),
        zone_nodes: Vec::new(),
    }];
    for zone in &cluster.spec.zone_config {
        let credentials = own_credentials(&cluster.spec, zone);
        let index = match groups
            .iter()
            .position(|g| g.credentials_ref.as_ref() == credentials)
        {
            Some(index) => index,
            None => {
                groups.push(ZonesByCredentials {
                    credentials_ref: credentials.cloned(),
                    zones: Vec::new(),
                    zone_nodes: Vec::new(),
                });
                groups.len() - 1
            }
        };
        let group = &mut groups[index];
        if !group.zones.contains(&zone.zone) {
            group.zones.push(zone.zone.clone());
        }
        group.zone_nodes.extend(
            zone.nodes
                .iter()
                .map(|node| (zone.zone.clone(), node.clone())),
        );
    }
    if groups.len() > 1 && cluster.spec.credentials_ref.is_none() && groups[0].zones.is_empty() {
        groups.remove(0);
    }
    groups
}

impl ZonesByCredentials {
    /// `spec` with this group's zones only: what the Proxmox these credentials reach holds of
    /// the cluster (its zones' HA rules, for instance).
    pub fn restrict(&self, spec: &ProxmoxClusterSpec) -> ProxmoxClusterSpec {
        let mut restricted = spec.clone();
        restricted
            .zone_config
            .retain(|zone| own_credentials(spec, zone) == self.credentials_ref.as_ref());
        restricted
    }
}

/// Every Secret a cluster's credentials come from (its own `credentialsRef`, then its zones'),
/// each once: what the cluster holds on to and lets go of on deletion.
pub fn credentials_secrets(cluster: &ProxmoxCluster) -> Vec<&SecretReference> {
    let mut secrets: Vec<&SecretReference> = cluster.spec.credentials_ref.iter().collect();
    for reference in zone_credentials(cluster) {
        if !secrets.contains(&reference) {
            secrets.push(reference);
        }
    }
    secrets
}

/// The credentials zones name of their own (`zoneConfig[].credentialsRef`), each once, in spec
/// order.
pub fn zone_credentials(cluster: &ProxmoxCluster) -> Vec<&SecretReference> {
    let mut secrets: Vec<&SecretReference> = Vec::new();
    for reference in cluster
        .spec
        .zone_config
        .iter()
        .filter_map(|z| own_credentials(&cluster.spec, z))
    {
        if !secrets.contains(&reference) {
            secrets.push(reference);
        }
    }
    secrets
}

/// The credentials of the zone named `zone`: its own, or `None` for the cluster's (also for a
/// zone the cluster no longer has).
pub fn credentials_of_zone<'a>(
    cluster: &'a ProxmoxCluster,
    zone: &str,
) -> Option<&'a SecretReference> {
    cluster
        .spec
        .zone_config
        .iter()
        .find(|z| z.zone == zone)
        .and_then(|z| own_credentials(&cluster.spec, z))
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

    // Node -> zones listing it (a zone listing the same node twice counts once). Node names are
    // unique within one Proxmox cluster only: zones reached with other credentials (another
    // site) may name the same node.
    let mut zones_of_node: BTreeMap<(Option<&SecretReference>, &str), BTreeSet<&str>> =
        BTreeMap::new();
    for zone in &spec.zone_config {
        for node in &zone.nodes {
            zones_of_node
                .entry((own_credentials(spec, zone), node.as_str()))
                .or_default()
                .insert(zone.zone.as_str());
        }
    }
    for ((_, node), zones) in &zones_of_node {
        if zones.len() > 1 {
            problems.push(ZoneProblem::NodeInSeveralZones {
                node: (*node).to_owned(),
                zones: zones.iter().map(|z| (*z).to_owned()).collect(),
            });
        }
    }

    // `allowedNodes` names nodes of the Proxmox cluster the cluster's own credentials reach.
    if !spec.allowed_nodes.is_empty() {
        let mut reported = BTreeSet::new();
        for zone in spec
            .zone_config
            .iter()
            .filter(|z| own_credentials(spec, z).is_none())
        {
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

#[cfg(test)]
mod site_tests {
    use super::*;
    use crate::api::{ProxmoxClusterSpec, ZoneConfigSpec};

    fn secret(name: &str) -> Option<SecretReference> {
        Some(SecretReference {
            name: Some(name.to_owned()),
            namespace: None,
        })
    }

    fn zone(name: &str, nodes: &[&str], credentials: Option<SecretReference>) -> ZoneConfigSpec {
        ZoneConfigSpec {
            zone: name.to_owned(),
            nodes: nodes.iter().map(|n| (*n).to_owned()).collect(),
            credentials_ref: credentials,
            ..Default::default()
        }
    }

    fn two_sites(allowed: &[&str]) -> ProxmoxCluster {
        ProxmoxCluster::new(
            "c1",
            ProxmoxClusterSpec {
                allowed_nodes: allowed.iter().map(|n| (*n).to_owned()).collect(),
                zone_config: vec![
                    zone("site-a-1", &["pve1"], None),
                    zone("site-a-2", &["pve2"], None),
                    zone("site-b", &["pve1", "pve2"], secret("site-b")),
                ],
                dns_servers: vec!["8.8.8.8".to_owned()],
                ..Default::default()
            },
        )
    }

    #[test]
    fn zones_on_another_proxmox_may_reuse_node_names() {
        let domains = failure_domains(&two_sites(&[])).expect("pve1 of two sites is two nodes");
        let names: Vec<&str> = domains.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names, ["site-a-1", "site-a-2", "site-b"]);

        // Within one Proxmox (same credentials) a node still belongs to one zone only.
        let mut cluster = two_sites(&[]);
        cluster
            .spec
            .zone_config
            .push(zone("site-b-2", &["pve2"], secret("site-b")));
        let error = failure_domains(&cluster).expect_err("pve2 twice in site b");
        assert_eq!(
            error.problems,
            [ZoneProblem::NodeInSeveralZones {
                node: "pve2".into(),
                zones: vec!["site-b".into(), "site-b-2".into()],
            }]
        );
    }

    #[test]
    fn allowed_nodes_name_nodes_of_the_clusters_own_proxmox() {
        // pve1 and pve2 of site b are not checked against the cluster's allowedNodes.
        assert!(failure_domains(&two_sites(&["pve1", "pve2"])).is_ok());
        let error = failure_domains(&two_sites(&["pve1"])).expect_err("pve2 of site a");
        assert_eq!(
            error.problems,
            [ZoneProblem::NodeNotAllowed {
                zone: "site-a-2".into(),
                node: "pve2".into(),
            }]
        );
    }

    #[test]
    fn a_zone_naming_the_clusters_own_secret_is_on_the_clusters_proxmox() {
        let mut cluster = two_sites(&[]);
        cluster.spec.credentials_ref = secret("site-a");
        cluster.spec.zone_config[1].credentials_ref = secret("site-a");
        let groups = zones_by_credentials(&cluster);
        assert_eq!(groups.len(), 2);
        assert_eq!(groups[0].zones, ["site-a-1", "site-a-2"]);
        assert_eq!(
            zone_credentials(&cluster),
            [&secret("site-b").expect("set")]
        );
        assert_eq!(credentials_of_zone(&cluster, "site-a-2"), None);
        // So its nodes are the cluster's nodes: pve1 twice there is refused.
        cluster.spec.zone_config[1].nodes = vec!["pve1".into()];
        let error = failure_domains(&cluster).expect_err("pve1 of site a twice");
        assert!(matches!(
            &error.problems[..],
            [ZoneProblem::NodeInSeveralZones { node, .. }] if node == "pve1"
        ));
    }

    #[test]
    fn zones_are_grouped_by_the_credentials_that_reach_them() {
        let groups = zones_by_credentials(&two_sites(&[]));
        assert_eq!(groups.len(), 2);
        assert_eq!(groups[0].credentials_ref, None);
        assert_eq!(groups[0].zones, ["site-a-1", "site-a-2"]);
        assert_eq!(
            groups[0].zone_nodes,
            [
                ("site-a-1".to_owned(), "pve1".to_owned()),
                ("site-a-2".to_owned(), "pve2".to_owned())
            ]
        );
        assert_eq!(groups[1].credentials_ref, secret("site-b"));
        assert_eq!(groups[1].zones, ["site-b"]);
        assert_eq!(groups[1].zone_nodes.len(), 2);

        // Every zone with credentials of its own and none for the cluster: nothing uses the
        // cluster's own, so it is no group.
        let mut remote = two_sites(&[]);
        for zone in &mut remote.spec.zone_config[..2] {
            zone.credentials_ref = secret("site-a");
        }
        let groups = zones_by_credentials(&remote);
        assert_eq!(groups.len(), 2);
        assert_eq!(groups[0].credentials_ref, secret("site-a"));
        assert_eq!(groups[0].zones, ["site-a-1", "site-a-2"]);
        remote.spec.credentials_ref = secret("cluster");
        assert_eq!(
            zones_by_credentials(&remote)[0].credentials_ref,
            None,
            "a Secret the cluster names is checked"
        );

        // Without zones of their own credentials, one group: the cluster's.
        let mut single = two_sites(&[]);
        single.spec.zone_config.truncate(2);
        assert_eq!(zones_by_credentials(&single).len(), 1);
        single.spec.zone_config.clear();
        let groups = zones_by_credentials(&single);
        assert_eq!(groups.len(), 1);
        assert!(groups[0].zones.is_empty());
    }
}
