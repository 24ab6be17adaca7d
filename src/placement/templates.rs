//! Choosing the template to clone by its Proxmox tags (`templateSelector`).

use std::collections::BTreeSet;
use std::fmt;

use crate::api::{TemplateMatchPolicy, TemplateSelector};

use super::failure_domains::quoted_list;

/// A normalised `templateSelector`: tags trimmed, lower-cased, deduplicated and sorted (a copy;
/// the user's list is never touched).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TagSelector {
    tags: Vec<String>,
    policy: TemplateMatchPolicy,
}

impl TagSelector {
    /// Normalises a selector from the machine spec.
    pub fn new(selector: &TemplateSelector) -> Self {
        Self {
            tags: normalize_tags(&selector.match_tags),
            policy: selector.match_policy.unwrap_or_default(),
        }
    }

    /// The wanted tags, normalised and sorted.
    pub fn tags(&self) -> &[String] {
        &self.tags
    }

    /// How template tags must relate to the wanted tags.
    pub fn policy(&self) -> TemplateMatchPolicy {
        self.policy
    }
}

/// Trims, lower-cases, drops empty entries, deduplicates and sorts tags.
pub fn normalize_tags<S: AsRef<str>>(tags: &[S]) -> Vec<String> {
    tags.iter()
        .map(|t| t.as_ref().trim().to_lowercase())
        .filter(|t| !t.is_empty())
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect()
}

/// Splits a Proxmox `tags` value (`a;b`, also accepting `,` and spaces) into tags.
pub fn split_proxmox_tags(tags: &str) -> Vec<String> {
    tags.split([';', ',', ' '])
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(str::to_owned)
        .collect()
}

/// A VM template found on Proxmox (the controller lists only guests with `template = 1`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TemplateInfo {
    /// Node the template lives on.
    pub node: String,
    /// VMID of the template.
    pub vmid: u32,
    /// Name of the template, for messages.
    pub name: String,
    /// Its tags, as Proxmox reports them (any case, any order).
    pub tags: Vec<String>,
}

impl fmt::Display for TemplateInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {:?} on {} (tags {:?})",
            self.vmid,
            self.name,
            self.node,
            normalize_tags(&self.tags).join(";")
        )
    }
}

/// The template to clone.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TemplateChoice {
    /// Node the template lives on (the clone's source node).
    pub node: String,
    /// VMID of the template.
    pub vmid: u32,
}

impl From<&TemplateInfo> for TemplateChoice {
    fn from(t: &TemplateInfo) -> Self {
        Self {
            node: t.node.clone(),
            vmid: t.vmid,
        }
    }
}

/// Why no template can be cloned for the machine; each lists what was found so the user can
/// fix tags, copies or nodes.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TemplateError {
    /// `matchTags` holds no usable tag after trimming.
    #[error("templateSelector.matchTags has no non-empty tag; name at least one Proxmox tag")]
    NoTags,
    /// No template matches.
    #[error(
        "no VM template matches tags {wanted:?} with matchPolicy {policy}; {}",
        describe_near_misses(.near_misses)
    )]
    NotFound {
        /// Wanted tags, `;`-joined.
        wanted: String,
        /// The match policy.
        policy: String,
        /// Templates carrying all wanted tags that the policy still rejected.
        near_misses: Vec<String>,
    },
    /// Different templates match equally well (or one node holds two copies).
    #[error(
        "{} VM templates match tags {wanted:?} with matchPolicy {policy}: {}; exactly one \
         template must match (copies of it on several nodes must carry the same name and tags, \
         one per node), or make the tags distinct",
        .candidates.len(),
        .candidates.join(", ")
    )]
    Ambiguous {
        /// Wanted tags, `;`-joined.
        wanted: String,
        /// The match policy.
        policy: String,
        /// The matching templates.
        candidates: Vec<String>,
    },
    /// The template has copies on several nodes, but the machine has no candidate nodes to
    /// choose among them.
    #[error(
        "VM template {template:?} has copies on several nodes ({}) and this machine has no zone \
         or allowed nodes to choose among them; set allowedNodes (or a failure domain with \
         nodes) so capmox schedules it, or keep one copy",
        .copies.join(", ")
    )]
    CopiesWithoutNodes {
        /// Name of the template.
        template: String,
        /// Its copies.
        copies: Vec<String>,
    },
    /// None of the nodes the machine may use can receive a clone of the template: its disks
    /// are on one node's local storage (or on storage those nodes lack). Waits for a copy.
    #[error(
        "VM template {template:?} cannot be cloned to any node this machine may use ({}): {}; \
         add a copy of the template (same name and tags) on one of these nodes, or keep its \
         disks on shared storage that these nodes have",
        nodes_text(.zone, .nodes),
        .copies.join("; ")
    )]
    Unreachable {
        /// Name of the template.
        template: String,
        /// Each copy with its node and why it cannot reach these nodes.
        copies: Vec<String>,
        /// The machine's zone, if any.
        zone: Option<String>,
        /// The nodes the machine may use.
        nodes: Vec<String>,
    },
}

impl TemplateError {
    /// Only a missing copy on the machine's nodes may resolve itself (a copy being added);
    /// the others need a change to tags, templates or the spec.
    pub fn is_retryable(&self) -> bool {
        matches!(self, Self::Unreachable { .. })
    }

    /// Condition reason for the machine's `VirtualMachineProvisioned` condition.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::NoTags => "InvalidSpec",
            Self::NotFound { .. } => "TemplateNotFound",
            Self::Ambiguous { .. } | Self::CopiesWithoutNodes { .. } => "AmbiguousTemplate",
            Self::Unreachable { .. } => "TemplateUnreachable",
        }
    }
}

fn describe_near_misses(items: &[String]) -> String {
    if items.is_empty() {
        "no template carries all of these tags".to_owned()
    } else {
        format!(
            "templates carrying all of them but rejected by the policy: {}",
            items.join(", ")
        )
    }
}

fn nodes_text(zone: &Option<String>, nodes: &[String]) -> String {
    let nodes = quoted_list(nodes);
    match zone {
        Some(zone) => format!("zone {zone:?}: {nodes}"),
        None => nodes,
    }
}

fn policy_name(policy: TemplateMatchPolicy) -> &'static str {
    match policy {
        TemplateMatchPolicy::Exact => "exact",
        TemplateMatchPolicy::UniqueSubset => "uniqueSubset",
        TemplateMatchPolicy::BestSubset => "bestSubset",
    }
}

/// What makes templates copies of one template: the same name and the same (normalised) tags.
/// Not the config digest: every copy has its own disk volumes, MAC addresses and SMBIOS UUID,
/// so digests of copies always differ.
fn identity(t: &TemplateInfo) -> (&str, Vec<String>) {
    (t.name.as_str(), normalize_tags(&t.tags))
}

/// Picks the one template matching `selector`, as its copies (one per node, sorted by node).
///
/// Like the Go provider, exactly one template must match, across the whole Proxmox cluster
/// (so identical machines get the same template whatever their zone), except that copies of
/// it on several nodes (same name and tags, for node-local storage) count as one. Matches that
/// differ in name or tags, or two copies on one node, are ambiguous. `bestSubset` keeps only
/// the matches with the fewest extra tags, whatever the listing order.
pub fn select_template(
    selector: &TagSelector,
    templates: &[TemplateInfo],
) -> Result<Vec<TemplateInfo>, TemplateError> {
    if selector.tags.is_empty() {
        return Err(TemplateError::NoTags);
    }
    let wanted: BTreeSet<&str> = selector.tags.iter().map(String::as_str).collect();
    // Templates carrying every wanted tag, with their number of extra tags.
    let supersets: Vec<(&TemplateInfo, usize)> = templates
        .iter()
        .filter_map(|t| {
            let tags = normalize_tags(&t.tags);
            let have: BTreeSet<&str> = tags.iter().map(String::as_str).collect();
            wanted
                .is_subset(&have)
                .then(|| (t, have.len() - wanted.len()))
        })
        .collect();
    let best = supersets.iter().map(|(_, d)| *d).min();
    let mut found: Vec<TemplateInfo> = supersets
        .iter()
        .filter(|(_, extra)| match selector.policy {
            TemplateMatchPolicy::Exact => *extra == 0,
            TemplateMatchPolicy::UniqueSubset => true,
            TemplateMatchPolicy::BestSubset => Some(*extra) == best,
        })
        .map(|(t, _)| (*t).clone())
        .collect();
    found.sort_by(|a, b| (&a.node, a.vmid).cmp(&(&b.node, b.vmid)));

    let wanted = selector.tags.join(";");
    let policy = policy_name(selector.policy).to_owned();
    let Some(first) = found.first() else {
        return Err(TemplateError::NotFound {
            wanted,
            policy,
            near_misses: supersets.iter().map(|(t, _)| t.to_string()).collect(),
        });
    };
    let one_template = found.iter().all(|t| identity(t) == identity(first));
    let one_per_node = found.windows(2).all(|pair| pair[0].node != pair[1].node);
    if one_template && one_per_node {
        Ok(found)
    } else {
        Err(TemplateError::Ambiguous {
            wanted,
            policy,
            candidates: found.iter().map(ToString::to_string).collect(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(node: &str, vmid: u32, tags: &str) -> TemplateInfo {
        TemplateInfo {
            node: node.to_owned(),
            vmid,
            name: format!("tpl-{vmid}"),
            tags: split_proxmox_tags(tags),
        }
    }

    fn copy(node: &str, vmid: u32, name: &str, tags: &str) -> TemplateInfo {
        TemplateInfo {
            name: name.to_owned(),
            ..t(node, vmid, tags)
        }
    }

    fn sel(tags: &[&str], policy: TemplateMatchPolicy) -> TagSelector {
        TagSelector::new(&TemplateSelector {
            match_tags: tags.iter().map(|t| (*t).to_owned()).collect(),
            match_policy: Some(policy),
        })
    }

    use TemplateMatchPolicy::{BestSubset, Exact, UniqueSubset};

    #[test]
    fn tags_are_normalised_without_touching_the_users_list() {
        let spec = TemplateSelector {
            match_tags: vec![
                " Ubuntu ".into(),
                "k8s-1.33".into(),
                "UBUNTU".into(),
                "".into(),
            ],
            match_policy: None,
        };
        let before = spec.clone();
        let s = TagSelector::new(&spec);
        assert_eq!(s.tags(), ["k8s-1.33", "ubuntu"]);
        assert_eq!(s.policy(), Exact, "exact is the default policy");
        assert_eq!(spec, before);
        assert_eq!(split_proxmox_tags("a; B ,c d;;"), ["a", "B", "c", "d"]);
    }

    #[test]
    fn policies_choose_as_documented() {
        let templates = vec![
            t("pve1", 100, "ubuntu;k8s"),
            t("pve1", 101, "ubuntu;k8s;gpu"),
            t("pve1", 102, "debian;k8s"),
            t("pve2", 103, "Ubuntu;K8S;gpu;big"),
        ];
        type Case = (
            &'static str,
            &'static [&'static str],
            TemplateMatchPolicy,
            Result<u32, &'static str>,
        );
        let cases: Vec<Case> = vec![
            ("exact match", &["K8s", "ubuntu"], Exact, Ok(100)),
            (
                "exact ignores supersets",
                &["ubuntu", "k8s", "gpu"],
                Exact,
                Ok(101),
            ),
            (
                "exact finds nothing",
                &["ubuntu"],
                Exact,
                Err("no VM template matches"),
            ),
            ("uniqueSubset unique", &["debian"], UniqueSubset, Ok(102)),
            (
                "uniqueSubset ambiguous",
                &["gpu"],
                UniqueSubset,
                Err("2 VM templates match"),
            ),
            ("bestSubset fewest extras", &["gpu"], BestSubset, Ok(101)),
            (
                "bestSubset exact beats supersets",
                &["ubuntu", "k8s"],
                BestSubset,
                Ok(100),
            ),
            (
                "bestSubset tie",
                &["k8s"],
                BestSubset,
                Err("2 VM templates match"),
            ),
            (
                "nothing carries the tag",
                &["windows"],
                BestSubset,
                Err("no template carries"),
            ),
        ];
        for (name, tags, policy, want) in cases {
            let got = select_template(&sel(tags, policy), &templates);
            match (want, got) {
                (Ok(vmid), Ok(copies)) => assert_eq!(vmids(&copies), [vmid], "{name}"),
                (Err(msg), Err(e)) => assert!(e.to_string().contains(msg), "{name}: {e}"),
                (want, got) => panic!("{name}: want {want:?}, got {got:?}"),
            }
        }
    }

    fn vmids(copies: &[TemplateInfo]) -> Vec<u32> {
        copies.iter().map(|c| c.vmid).collect()
    }

    #[test]
    fn best_subset_does_not_depend_on_listing_order() {
        // Go bug §10.15: a worse match listed first made the lookup fail.
        let a = t("pve1", 200, "base;extra1;extra2");
        let b = t("pve1", 201, "base;extra1");
        for templates in [vec![a.clone(), b.clone()], vec![b, a]] {
            let copies = select_template(&sel(&["base"], BestSubset), &templates).unwrap();
            assert_eq!(vmids(&copies), [201]);
        }
    }

    #[test]
    fn copies_of_one_template_on_several_nodes_are_one_match() {
        // Per-node copies for node-local storage: same name and tags, listed in any order.
        let templates = vec![
            copy("pve3", 300, "ubuntu-2404", "Ubuntu;k8s"),
            copy("pve1", 100, "ubuntu-2404", "k8s;ubuntu"),
            copy("pve2", 200, "ubuntu-2404", "ubuntu;K8S"),
            copy("pve1", 101, "debian-12", "k8s;debian"),
        ];
        let copies = select_template(&sel(&["ubuntu"], UniqueSubset), &templates).unwrap();
        assert_eq!(vmids(&copies), [100, 200, 300], "sorted by node");
    }

    #[test]
    fn different_templates_on_different_nodes_are_ambiguous_whatever_the_node() {
        // Two identical machines must not get different templates because they were scheduled
        // to different nodes: templates differing in name (or tags) are two templates.
        let templates = vec![
            copy("pve1", 100, "ubuntu-2404", "ubuntu"),
            copy("pve2", 200, "ubuntu-2404-hwe", "ubuntu"),
        ];
        let err = select_template(&sel(&["ubuntu"], Exact), &templates).unwrap_err();
        assert_eq!(
            err.to_string(),
            "2 VM templates match tags \"ubuntu\" with matchPolicy exact: \
             100 \"ubuntu-2404\" on pve1 (tags \"ubuntu\"), \
             200 \"ubuntu-2404-hwe\" on pve2 (tags \"ubuntu\"); exactly one template must \
             match (copies of it on several nodes must carry the same name and tags, one per \
             node), or make the tags distinct"
        );
        assert_eq!(err.reason(), "AmbiguousTemplate");
        assert!(!err.is_retryable());
        // Same name, different tags under uniqueSubset: still two templates.
        let templates = vec![
            copy("pve1", 100, "ubuntu-2404", "ubuntu;gpu"),
            copy("pve2", 200, "ubuntu-2404", "ubuntu"),
        ];
        let err = select_template(&sel(&["ubuntu"], UniqueSubset), &templates).unwrap_err();
        assert!(matches!(err, TemplateError::Ambiguous { .. }), "{err}");
    }

    #[test]
    fn two_copies_on_one_node_are_ambiguous() {
        let templates = vec![
            copy("pve1", 100, "ubuntu-2404", "ubuntu"),
            copy("pve1", 101, "ubuntu-2404", "ubuntu"),
            copy("pve2", 200, "ubuntu-2404", "ubuntu"),
        ];
        let err = select_template(&sel(&["ubuntu"], Exact), &templates).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("3 VM templates match tags \"ubuntu\" with matchPolicy exact: 100"),
            "{err}"
        );
    }

    #[test]
    fn absence_lists_templates_the_policy_rejected() {
        let templates = vec![t("pve1", 100, "ubuntu;gpu")];
        let err = select_template(&sel(&["ubuntu"], Exact), &templates).unwrap_err();
        assert_eq!(
            err.to_string(),
            "no VM template matches tags \"ubuntu\" with matchPolicy exact; templates carrying \
             all of them but rejected by the policy: 100 \"tpl-100\" on pve1 (tags \"gpu;ubuntu\")"
        );
        assert_eq!(err.reason(), "TemplateNotFound");
        let err = select_template(&sel(&["  "], Exact), &templates).unwrap_err();
        assert_eq!(err, TemplateError::NoTags);
    }
}
