//! The sandbox's `--topology FILE`: either one simulator [`Topology`] (one Proxmox cluster, as
//! always) or a multi-site file, one Proxmox cluster per site with the zones made of its nodes:
//!
//! ```yaml
//! sites:
//!   - name: site-a              # reached with the ProxmoxCluster's credentials
//!     zones:
//!       - {zone: rack-a, nodes: [pve1, pve2]}
//!     topology: {nodes: [{name: pve1}, {name: pve2}], ...}
//!   - name: site-b              # its zones name a credentials Secret of their own
//!     zones:
//!       - {zone: rack-c, nodes: [pve1], controlPlaneEligible: false}
//!     topology: {nodes: [{name: pve1}], ...}
//! ```
//!
//! Node names and VMIDs are only unique within one site; zone names are unique over all sites.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use capmox_sim::Topology;
use capmox_sim::topology::TopologyError;
use serde::Deserialize;

/// Why a sandbox topology file is unusable.
#[derive(Debug, thiserror::Error)]
pub enum SitesError {
    /// The file could not be read.
    #[error("cannot read topology file {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file is not valid YAML for a multi-site file.
    #[error("multi-site topology {path} is invalid: {message}")]
    Parse {
        /// The file.
        path: String,
        /// The parser's message.
        message: String,
    },
    /// A single-site file is not a valid simulator topology.
    #[error(transparent)]
    Topology(#[from] TopologyError),
    /// One site's simulator topology is inconsistent.
    #[error("{path}: site '{site}': {source}")]
    SiteTopology {
        /// The file.
        path: String,
        /// The site.
        site: String,
        /// What is wrong with its topology.
        source: TopologyError,
    },
    /// The sites and zones do not fit together.
    #[error("{path}: {message}")]
    Invalid {
        /// The file.
        path: String,
        /// What is wrong.
        message: String,
    },
}

/// A zone of a site: a CAPI failure domain made of some of the site's nodes.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct SiteZone {
    /// Zone (failure domain) name, unique over all sites.
    pub zone: String,
    /// Nodes of the site's topology that make up the zone.
    pub nodes: Vec<String>,
    /// Whether the control plane may be placed here (`zoneConfig[].controlPlaneEligible`);
    /// every zone is eligible unless this says `false`.
    #[serde(default)]
    pub control_plane_eligible: Option<bool>,
}

/// One Proxmox cluster of a multi-site sandbox, served by its own simulator.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Site {
    /// Site name, a DNS label: it names the site's credentials Secret.
    pub name: String,
    /// The zones of the example cluster that are on this site.
    pub zones: Vec<SiteZone>,
    /// The site's Proxmox cluster, as a single-site topology file describes one.
    pub topology: Topology,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SitesFile {
    sites: Vec<Site>,
}

/// What a `--topology` file describes.
#[derive(Clone, Debug, PartialEq)]
pub enum SandboxTopology {
    /// One Proxmox cluster; the example cluster's zones are the built-in rack-a and rack-b.
    Single(Box<Topology>),
    /// Several Proxmox clusters, the first reached with the ProxmoxCluster's credentials, every
    /// other through `credentialsRef` on its zones.
    Sites(Vec<Site>),
}

impl SandboxTopology {
    /// Reads a YAML or JSON file: a multi-site file when it has a top-level `sites`, else a
    /// simulator topology.
    pub fn load(path: &Path) -> Result<Self, SitesError> {
        let text = std::fs::read_to_string(path).map_err(|source| SitesError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_yaml(&text, &path.display().to_string())
    }

    /// Parses and validates `text`; `origin` names it in errors.
    pub fn from_yaml(text: &str, origin: &str) -> Result<Self, SitesError> {
        let value: serde_norway::Value =
            serde_norway::from_str(text).map_err(|e| SitesError::Parse {
                path: origin.to_owned(),
                message: e.to_string(),
            })?;
        let multi_site = value
            .as_mapping()
            .is_some_and(|m| m.contains_key(serde_norway::Value::from("sites")));
        if !multi_site {
            return Ok(Self::Single(Box::new(Topology::from_yaml(text, origin)?)));
        }
        let file: SitesFile = serde_norway::from_value(value).map_err(|e| SitesError::Parse {
            path: origin.to_owned(),
            message: e.to_string(),
        })?;
        validate(&file.sites, origin)?;
        Ok(Self::Sites(file.sites))
    }
}

/// Whether `name` is an RFC 1123 label (what a Secret name part may be).
fn is_dns_label(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-')
}

/// Checks the sites against each other and against their topologies.
fn validate(sites: &[Site], origin: &str) -> Result<(), SitesError> {
    let invalid = |message: String| SitesError::Invalid {
        path: origin.to_owned(),
        message,
    };
    if sites.is_empty() {
        return Err(invalid(
            "`sites` is empty; at least one site is required".into(),
        ));
    }
    let mut site_names = BTreeSet::new();
    let mut zone_sites: BTreeMap<&str, &str> = BTreeMap::new();
    for site in sites {
        if !is_dns_label(&site.name) {
            return Err(invalid(format!(
                "site name '{}' must be a DNS label (lowercase letters, digits and '-'), as it names the site's credentials Secret",
                site.name
            )));
        }
        if !site_names.insert(site.name.as_str()) {
            return Err(invalid(format!("site '{}' is named twice", site.name)));
        }
        site.topology
            .validate()
            .map_err(|source| SitesError::SiteTopology {
                path: origin.to_owned(),
                site: site.name.clone(),
                source,
            })?;
        if site.zones.is_empty() {
            return Err(invalid(format!(
                "site '{}' has no zones; the example cluster could place no machine there",
                site.name
            )));
        }
        let nodes: BTreeSet<&str> = site
            .topology
            .nodes
            .iter()
            .map(|n| n.name.as_str())
            .collect();
        let mut zone_of_node: BTreeMap<&str, &str> = BTreeMap::new();
        for zone in &site.zones {
            if !is_zone_name(&zone.zone) {
                return Err(invalid(format!(
                    "zone name '{}' (site '{}') is not a valid zone name ({})",
                    zone.zone,
                    site.name,
                    capmox::api::ZONE_PATTERN
                )));
            }
            if let Some(other) = zone_sites.insert(&zone.zone, &site.name) {
                return Err(invalid(if other == site.name {
                    format!("zone '{}' appears twice in site '{}'", zone.zone, site.name)
                } else {
                    format!(
                        "zone '{}' is in both site '{other}' and site '{}'; zone names must be unique over all sites",
                        zone.zone, site.name
                    )
                }));
            }
            if zone.nodes.is_empty() {
                return Err(invalid(format!(
                    "zone '{}' (site '{}') has no nodes",
                    zone.zone, site.name
                )));
            }
            for node in &zone.nodes {
                if !nodes.contains(node.as_str()) {
                    return Err(invalid(format!(
                        "zone '{}' names node '{node}', which site '{}' does not have (its nodes: {})",
                        zone.zone,
                        site.name,
                        nodes.iter().copied().collect::<Vec<_>>().join(", ")
                    )));
                }
                if let Some(other) = zone_of_node.insert(node, &zone.zone)
                    && other != zone.zone
                {
                    return Err(invalid(format!(
                        "node '{node}' of site '{}' is in zones '{other}' and '{}'; a node belongs to one zone",
                        site.name, zone.zone
                    )));
                }
            }
        }
    }
    Ok(())
}

/// `ZONE_PATTERN` without a regex engine: 1-63 characters of `[A-Za-z0-9._-]`, starting and
/// ending with a letter or digit.
fn is_zone_name(name: &str) -> bool {
    let alnum = |c: u8| c.is_ascii_alphanumeric();
    let bytes = name.as_bytes();
    match (bytes.first(), bytes.last()) {
        (Some(first), Some(last)) => {
            bytes.len() <= 63
                && alnum(*first)
                && alnum(*last)
                && bytes
                    .iter()
                    .all(|b| alnum(*b) || matches!(b, b'-' | b'_' | b'.'))
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOPO: &str = "{nodes: [{name: pve1}, {name: pve2}]}";

    fn sites(body: &str) -> Result<SandboxTopology, SitesError> {
        SandboxTopology::from_yaml(body, "t.yaml")
    }

    #[test]
    fn a_single_topology_stays_a_single_topology() {
        let t = sites("cluster_name: x\nnodes: [{name: a}]\n").expect("valid");
        assert!(matches!(t, SandboxTopology::Single(t) if t.nodes.len() == 1));
        let err = sites("nodes: [{name: a, ram: 1}]").expect_err("unknown field");
        assert!(err.to_string().contains("ram"), "{err}");
    }

    #[test]
    fn two_sites_may_share_node_names() {
        let t = sites(&format!(
            "sites:\n- name: a\n  zones: [{{zone: z1, nodes: [pve1]}}, {{zone: z2, nodes: [pve2], controlPlaneEligible: false}}]\n  topology: {TOPO}\n\
             - name: b\n  zones: [{{zone: z3, nodes: [pve1, pve2]}}]\n  topology: {TOPO}\n"
        ))
        .expect("valid");
        let SandboxTopology::Sites(s) = t else {
            panic!("multi-site")
        };
        assert_eq!(s.len(), 2);
        assert_eq!(s[0].zones[1].control_plane_eligible, Some(false));
        assert_eq!(s[1].zones[0].nodes, ["pve1", "pve2"]);
    }

    #[test]
    fn invalid_sites_say_what_is_wrong() {
        let cases = [
            ("sites: []", "at least one site"),
            (
                &format!(
                    "sites:\n- name: a\n  zones: [{{zone: z1, nodes: [pve9]}}]\n  topology: {TOPO}\n"
                ),
                "zone 'z1' names node 'pve9', which site 'a' does not have (its nodes: pve1, pve2)",
            ),
            (
                &format!(
                    "sites:\n- name: a\n  zones: [{{zone: z1, nodes: [pve1]}}]\n  topology: {TOPO}\n- name: b\n  zones: [{{zone: z1, nodes: [pve1]}}]\n  topology: {TOPO}\n"
                ),
                "zone 'z1' is in both site 'a' and site 'b'",
            ),
            (
                &format!(
                    "sites:\n- name: a\n  zones: [{{zone: z1, nodes: [pve1]}}, {{zone: z1, nodes: [pve2]}}]\n  topology: {TOPO}\n"
                ),
                "zone 'z1' appears twice in site 'a'",
            ),
            (
                &format!(
                    "sites:\n- name: a\n  zones: [{{zone: z1, nodes: [pve1]}}, {{zone: z2, nodes: [pve1]}}]\n  topology: {TOPO}\n"
                ),
                "node 'pve1' of site 'a' is in zones 'z1' and 'z2'",
            ),
            (
                &format!(
                    "sites:\n- name: a\n  zones: [{{zone: z1, nodes: [pve1]}}]\n  topology: {TOPO}\n- name: a\n  zones: [{{zone: z2, nodes: [pve1]}}]\n  topology: {TOPO}\n"
                ),
                "site 'a' is named twice",
            ),
            (
                &format!(
                    "sites:\n- name: Site_A\n  zones: [{{zone: z1, nodes: [pve1]}}]\n  topology: {TOPO}\n"
                ),
                "must be a DNS label",
            ),
            (
                &format!("sites:\n- name: a\n  zones: []\n  topology: {TOPO}\n"),
                "site 'a' has no zones",
            ),
            (
                &format!(
                    "sites:\n- name: a\n  zones: [{{zone: z1, nodes: []}}]\n  topology: {TOPO}\n"
                ),
                "zone 'z1' (site 'a') has no nodes",
            ),
            (
                "sites:\n- name: a\n  zones: [{zone: z1, nodes: [pve1]}]\n  topology: {nodes: []}\n",
                "site 'a': topology is inconsistent: at least one node",
            ),
            (
                &format!(
                    "sites:\n- name: a\n  zones: [{{zone: z1, nodes: [pve1]}}]\n  topology: {TOPO}\n  extra: 1\n"
                ),
                "unknown field `extra`",
            ),
            (
                &format!(
                    "sites:\n- name: a\n  zones: [{{zone: -z, nodes: [pve1]}}]\n  topology: {TOPO}\n"
                ),
                "zone name '-z' (site 'a') is not a valid zone name",
            ),
        ];
        for (text, expected) in cases {
            let err = sites(text).expect_err(expected);
            assert!(
                err.to_string().contains(expected),
                "{expected:?} not in {err}"
            );
            assert!(
                err.to_string().starts_with("t.yaml") || err.to_string().contains("t.yaml"),
                "{err}"
            );
        }
    }

    #[test]
    fn zone_names_follow_the_api_pattern() {
        for name in ["a", "rack-a", "A.b_c", "z9", &"x".repeat(63)] {
            assert!(is_zone_name(name), "{name:?}");
        }
        for name in ["-a", "a-", "", "a b", "_a", &"x".repeat(64)] {
            assert!(!is_zone_name(name), "{name:?}");
        }
    }
}
