//! Choosing the template to clone by its Proxmox tags (`templateSelector`).

use std::collections::BTreeSet;
use std::fmt;

use crate::api::{TemplateMatchPolicy, TemplateSelector};

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

/// Why no single template could be chosen; both list what was found so the user can fix tags.
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
    /// Several templates match equally well.
    #[error(
        "{} VM templates match tags {wanted:?} with matchPolicy {policy}{}: {}; \
         exactly one must match (tag one template per node, or make the tags distinct)",
        .candidates.len(),
        on_node(.node),
        .candidates.join(", ")
    )]
    Ambiguous {
        /// Wanted tags, `;`-joined.
        wanted: String,
        /// The match policy.
        policy: String,
        /// Node the choice was restricted to, if any.
        node: Option<String>,
        /// The matching templates.
        candidates: Vec<String>,
    },
}

impl TemplateError {
    /// Template errors need a change to tags or templates, so retrying alone does not help.
    pub fn is_retryable(&self) -> bool {
        false
    }

    /// Condition reason for the machine's `VirtualMachineProvisioned` condition.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::NoTags => "InvalidSpec",
            Self::NotFound { .. } => "TemplateNotFound",
            Self::Ambiguous { .. } => "AmbiguousTemplate",
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

fn on_node(node: &Option<String>) -> String {
    node.as_ref()
        .map(|n| format!(" on node {n}"))
        .unwrap_or_default()
}

fn policy_name(policy: TemplateMatchPolicy) -> &'static str {
    match policy {
        TemplateMatchPolicy::Exact => "exact",
        TemplateMatchPolicy::UniqueSubset => "uniqueSubset",
        TemplateMatchPolicy::BestSubset => "bestSubset",
    }
}

/// Picks the one template matching `selector`.
///
/// With `node` set (the scheduler's choice) a match on that node wins, so per-node templates
/// (the same tags on every node, for local storage) resolve to the local copy; if that node has
/// none, the single match elsewhere is used (a cross-node clone, as the Go provider does).
/// `bestSubset` keeps only the matches with the fewest extra tags, whatever the listing order.
pub fn select_template(
    selector: &TagSelector,
    templates: &[TemplateInfo],
    node: Option<&str>,
) -> Result<TemplateChoice, TemplateError> {
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

    let matches_in = |scope: &[(&TemplateInfo, usize)]| -> Vec<TemplateInfo> {
        let best = scope.iter().map(|(_, d)| *d).min();
        scope
            .iter()
            .filter(|(_, extra)| match selector.policy {
                TemplateMatchPolicy::Exact => *extra == 0,
                TemplateMatchPolicy::UniqueSubset => true,
                TemplateMatchPolicy::BestSubset => Some(*extra) == best,
            })
            .map(|(t, _)| (*t).clone())
            .collect()
    };

    let wanted_text = selector.tags.join(";");
    let policy = policy_name(selector.policy).to_owned();
    let ambiguous = |node: Option<&str>, found: &[TemplateInfo]| TemplateError::Ambiguous {
        wanted: wanted_text.clone(),
        policy: policy.clone(),
        node: node.map(str::to_owned),
        candidates: found.iter().map(ToString::to_string).collect(),
    };

    if let Some(node) = node {
        let local: Vec<_> = supersets
            .iter()
            .filter(|(t, _)| t.node == node)
            .copied()
            .collect();
        let found = matches_in(&local);
        match found.as_slice() {
            [one] => return Ok(choice(one)),
            [] => {}
            many => return Err(ambiguous(Some(node), many)),
        }
    }
    let found = matches_in(&supersets);
    match found.as_slice() {
        [one] => Ok(choice(one)),
        [] => Err(TemplateError::NotFound {
            wanted: wanted_text,
            policy,
            near_misses: supersets.iter().map(|(t, _)| t.to_string()).collect(),
        }),
        many => Err(ambiguous(None, many)),
    }
}

/// Nodes that hold their own matching template (the ones [`select_template`] resolves locally).
/// With per-node templates on local storage, the controller keeps only these nodes in the
/// inventory before scheduling, so the chosen node always has a copy to clone.
pub fn template_nodes(selector: &TagSelector, templates: &[TemplateInfo]) -> Vec<String> {
    let nodes: BTreeSet<&str> = templates.iter().map(|t| t.node.as_str()).collect();
    nodes
        .into_iter()
        .filter(|node| {
            select_template(selector, templates, Some(node)).is_ok_and(|c| c.node == *node)
        })
        .map(str::to_owned)
        .collect()
}

fn choice(t: &TemplateInfo) -> TemplateChoice {
    TemplateChoice {
        node: t.node.clone(),
        vmid: t.vmid,
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
            let got = select_template(&sel(tags, policy), &templates, None);
            match (want, got) {
                (Ok(vmid), Ok(c)) => assert_eq!(c.vmid, vmid, "{name}"),
                (Err(msg), Err(e)) => assert!(e.to_string().contains(msg), "{name}: {e}"),
                (want, got) => panic!("{name}: want {want:?}, got {got:?}"),
            }
        }
    }

    #[test]
    fn best_subset_does_not_depend_on_listing_order() {
        // Go bug §10.15: a worse match listed first made the lookup fail.
        let a = t("pve1", 200, "base;extra1;extra2");
        let b = t("pve1", 201, "base;extra1");
        for templates in [vec![a.clone(), b.clone()], vec![b, a]] {
            let c = select_template(&sel(&["base"], BestSubset), &templates, None).unwrap();
            assert_eq!(c.vmid, 201);
        }
    }

    #[test]
    fn per_node_templates_pick_the_one_on_the_chosen_node() {
        let templates = vec![
            t("pve1", 100, "ubuntu"),
            t("pve2", 200, "ubuntu"),
            t("pve3", 300, "ubuntu"),
        ];
        let s = sel(&["ubuntu"], Exact);
        assert_eq!(
            select_template(&s, &templates, Some("pve2")).unwrap(),
            TemplateChoice {
                node: "pve2".into(),
                vmid: 200
            }
        );
        // Without a node (no scheduling) three templates are ambiguous.
        let err = select_template(&s, &templates, None).unwrap_err();
        assert_eq!(
            err.to_string(),
            "3 VM templates match tags \"ubuntu\" with matchPolicy exact: \
             100 \"tpl-100\" on pve1 (tags \"ubuntu\"), 200 \"tpl-200\" on pve2 (tags \"ubuntu\"), \
             300 \"tpl-300\" on pve3 (tags \"ubuntu\"); exactly one must match \
             (tag one template per node, or make the tags distinct)"
        );
        // A node without its own copy cannot choose among the others.
        let err = select_template(&s, &templates, Some("pve9")).unwrap_err();
        assert!(matches!(err, TemplateError::Ambiguous { node: None, .. }));
    }

    #[test]
    fn template_nodes_are_those_with_their_own_unique_match() {
        let templates = vec![
            t("pve1", 100, "ubuntu"),
            t("pve2", 200, "ubuntu"),
            t("pve3", 300, "ubuntu;gpu"),
            t("pve4", 400, "ubuntu;a"),
            t("pve4", 401, "ubuntu;b"),
        ];
        assert_eq!(
            template_nodes(&sel(&["ubuntu"], Exact), &templates),
            ["pve1", "pve2"]
        );
        assert_eq!(
            template_nodes(&sel(&["ubuntu"], UniqueSubset), &templates),
            ["pve1", "pve2", "pve3"],
            "pve4 has two candidates"
        );
        assert!(template_nodes(&sel(&["windows"], Exact), &templates).is_empty());
    }

    #[test]
    fn a_single_template_elsewhere_is_used_for_a_node_without_one() {
        let templates = vec![t("pve1", 100, "ubuntu")];
        let c = select_template(&sel(&["ubuntu"], Exact), &templates, Some("pve2")).unwrap();
        assert_eq!(c.node, "pve1");
    }

    #[test]
    fn two_matches_on_the_chosen_node_are_ambiguous() {
        let templates = vec![
            t("pve1", 100, "ubuntu;a"),
            t("pve1", 101, "ubuntu;b"),
            t("pve2", 200, "ubuntu"),
        ];
        let err =
            select_template(&sel(&["ubuntu"], UniqueSubset), &templates, Some("pve1")).unwrap_err();
        assert_eq!(
            err.to_string(),
            "2 VM templates match tags \"ubuntu\" with matchPolicy uniqueSubset on node pve1: \
             100 \"tpl-100\" on pve1 (tags \"a;ubuntu\"), 101 \"tpl-101\" on pve1 (tags \"b;ubuntu\"); \
             exactly one must match (tag one template per node, or make the tags distinct)"
        );
        assert!(!err.is_retryable());
        assert_eq!(err.reason(), "AmbiguousTemplate");
    }

    #[test]
    fn absence_lists_templates_the_policy_rejected() {
        let templates = vec![t("pve1", 100, "ubuntu;gpu")];
        let err = select_template(&sel(&["ubuntu"], Exact), &templates, None).unwrap_err();
        assert_eq!(
            err.to_string(),
            "no VM template matches tags \"ubuntu\" with matchPolicy exact; templates carrying \
             all of them but rejected by the policy: 100 \"tpl-100\" on pve1 (tags \"gpu;ubuntu\")"
        );
        let err = select_template(&sel(&["  "], Exact), &templates, None).unwrap_err();
        assert_eq!(err, TemplateError::NoTags);
    }
}
