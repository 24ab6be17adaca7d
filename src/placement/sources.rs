//! Which nodes can receive a clone of the chosen template, and which copy each clones from.
//!
//! Proxmox clones a VM to another node (`target`) only when every volume of the source (disks,
//! cloud-init drive, ISO images; not empty drives) lies on shared storage: otherwise it refuses
//! with `can't clone VM to node 'X' (VM uses local storage)`. This holds for full and linked
//! clones alike (a linked clone's disks stay on the template's storage). A full clone onto
//! `spec.storage` may leave its node only when that storage is shared too (`can't clone to
//! non-shared storage`). So a node can receive a clone of a copy when the copy lives on that
//! node, or when all of the copy's storages (and `spec.storage`, if set) are shared and present
//! on that node. A copy on the node itself is always preferred: it needs no cross-node copy.

use std::collections::{BTreeMap, BTreeSet};

use super::failure_domains::quoted_list;
use super::resolve::{NodeCandidates, Placement};
use super::templates::{TemplateChoice, TemplateError, TemplateInfo};

/// One storage on one node, as `/cluster/resources` lists it (`type: storage`), so placement
/// knows which storages are shared and where they are available.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StorageInfo {
    /// Node the entry is for.
    pub node: String,
    /// Storage id.
    pub storage: String,
    /// `shared: 1`: the same contents on every node that lists it.
    pub shared: bool,
}

/// A copy of the chosen template with the storages its volumes live on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TemplateCopy {
    /// The template copy.
    pub template: TemplateInfo,
    /// Storages of its volumes, from its config; `None` when not read (then the copy is
    /// assumed to serve its own node only).
    pub storages: Option<Vec<String>>,
}

/// Where one copy's clones can go.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Reach {
    /// Every node (a template without volumes).
    Anywhere,
    /// Its own node and these.
    Nodes(BTreeSet<String>),
    /// Its own node only, for this reason.
    OwnNode(String),
}

/// The copies of one template and, for each node, the copy that node can clone from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CloneSources {
    name: String,
    copies: Vec<(TemplateInfo, Reach)>,
}

impl CloneSources {
    /// Works out where each copy can be cloned to, from the storages listed per node and the
    /// machine's `spec.storage` (the full clone's target storage), if set.
    pub fn new(
        copies: Vec<TemplateCopy>,
        storages: &[StorageInfo],
        clone_storage: Option<&str>,
    ) -> Self {
        let mut nodes_of: BTreeMap<&str, BTreeSet<String>> = BTreeMap::new();
        let mut shared: BTreeSet<&str> = BTreeSet::new();
        for s in storages {
            nodes_of
                .entry(s.storage.as_str())
                .or_default()
                .insert(s.node.clone());
            if s.shared {
                shared.insert(s.storage.as_str());
            }
        }
        // Why a storage keeps clones on the copy's node, if it does.
        let problem = |storage: &str, disks: bool| -> Option<String> {
            let what = if disks {
                format!("its disks are on storage {storage:?}")
            } else {
                format!("spec.storage {storage:?}")
            };
            if !nodes_of.contains_key(storage) {
                Some(format!(
                    "{what}, which /cluster/resources does not list (capmox cannot tell whether \
                     it is shared; the token needs Datastore.Audit on it)"
                ))
            } else if shared.contains(storage) {
                None
            } else if disks {
                Some(format!("its disks are on node-local storage {storage:?}"))
            } else {
                Some(format!("{what} is node-local"))
            }
        };
        let name = copies
            .first()
            .map(|c| c.template.name.clone())
            .unwrap_or_default();
        let copies = copies
            .into_iter()
            .map(|copy| {
                let reach = match &copy.storages {
                    None => Reach::OwnNode("its storages were not read".to_owned()),
                    Some(storages) => {
                        let required: Vec<(&str, bool)> = storages
                            .iter()
                            .map(|s| (s.as_str(), true))
                            .chain(clone_storage.map(|s| (s, false)))
                            .collect();
                        let problems: Vec<String> = required
                            .iter()
                            .filter_map(|(storage, disks)| problem(storage, *disks))
                            .collect();
                        if problems.is_empty() {
                            // Every storage shared: the nodes that have all of them.
                            required
                                .iter()
                                .map(|(storage, _)| {
                                    nodes_of.get(storage).cloned().unwrap_or_default()
                                })
                                .reduce(|a, b| a.intersection(&b).cloned().collect())
                                .map_or(Reach::Anywhere, Reach::Nodes)
                        } else {
                            Reach::OwnNode(problems.join(", and "))
                        }
                    }
                };
                (copy.template, reach)
            })
            .collect();
        Self { name, copies }
    }

    /// The copy `node` clones from: its own copy first, else the first copy (by node) whose
    /// storages reach it; `None` when none can.
    pub fn source_for(&self, node: &str) -> Option<TemplateChoice> {
        let own = self.copies.iter().find(|(t, _)| t.node == node);
        let remote = || {
            self.copies.iter().find(|(_, reach)| match reach {
                Reach::Anywhere => true,
                Reach::Nodes(nodes) => nodes.contains(node),
                Reach::OwnNode(_) => false,
            })
        };
        own.or_else(remote).map(|(t, _)| TemplateChoice::from(t))
    }

    /// The placement with its candidate nodes narrowed to those that can receive a clone, so
    /// the scheduler only chooses among them. A placement that clones on the template's node
    /// is returned as it is.
    pub fn narrow(&self, placement: &Placement) -> Result<Placement, TemplateError> {
        let NodeCandidates::Nodes(candidates) = placement.candidates() else {
            return Ok(placement.clone());
        };
        let reachable: Vec<String> = candidates
            .iter()
            .filter(|n| self.source_for(n).is_some())
            .cloned()
            .collect();
        if reachable.is_empty() {
            return Err(self.unreachable(placement.zone(), candidates));
        }
        Ok(placement.with_candidates(reachable))
    }

    /// The copy to clone: on `node` (the scheduler's choice), or, without scheduling, the
    /// template's only copy.
    pub fn choose(&self, node: Option<&str>) -> Result<TemplateChoice, TemplateError> {
        match node {
            Some(node) => self
                .source_for(node)
                .ok_or_else(|| self.unreachable(None, &[node.to_owned()])),
            None => match self.copies.as_slice() {
                [(only, _)] => Ok(TemplateChoice::from(only)),
                copies => Err(TemplateError::CopiesWithoutNodes {
                    template: self.name.clone(),
                    copies: copies.iter().map(|(t, _)| t.to_string()).collect(),
                }),
            },
        }
    }

    fn unreachable(&self, zone: Option<&str>, nodes: &[String]) -> TemplateError {
        let copies = self
            .copies
            .iter()
            .map(|(t, reach)| {
                let why = match reach {
                    Reach::OwnNode(why) => {
                        format!("{why}, so Proxmox clones it only on its own node")
                    }
                    Reach::Nodes(reached) => format!(
                        "its shared storages are only on {}",
                        quoted_list(&reached.iter().cloned().collect::<Vec<_>>())
                    ),
                    Reach::Anywhere => "it has no volumes".to_owned(),
                };
                format!("{t}: {why}")
            })
            .collect();
        TemplateError::Unreachable {
            template: self.name.clone(),
            copies,
            zone: zone.map(str::to_owned),
            nodes: nodes.to_vec(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement::fixtures::{capi_machine, cluster, machine, zone};

    /// Five nodes, each with its own `local-lvm`, and `ceph` shared by pve1..pve3 only.
    fn storages() -> Vec<StorageInfo> {
        let mut out = Vec::new();
        for i in 1..=5 {
            let node = format!("pve{i}");
            out.push(StorageInfo {
                node: node.clone(),
                storage: "local-lvm".into(),
                shared: false,
            });
            if i <= 3 {
                out.push(StorageInfo {
                    node,
                    storage: "ceph".into(),
                    shared: true,
                });
            }
        }
        out
    }

    fn copy(node: &str, vmid: u32, storages: &[&str]) -> TemplateCopy {
        TemplateCopy {
            template: TemplateInfo {
                node: node.into(),
                vmid,
                name: "ubuntu-2404".into(),
                tags: vec!["ubuntu".into()],
            },
            storages: Some(storages.iter().map(|s| (*s).to_owned()).collect()),
        }
    }

    fn sources(copies: Vec<TemplateCopy>, clone_storage: Option<&str>) -> CloneSources {
        CloneSources::new(copies, &storages(), clone_storage)
    }

    /// A placement in zone rack-a (pve1, pve2), rack-b (pve3, pve4) or rack-c (pve5).
    fn placement(zone_name: &str) -> Placement {
        let c = cluster(
            &[],
            vec![
                zone("rack-a", &["pve1", "pve2"]),
                zone("rack-b", &["pve3", "pve4"]),
                zone("rack-c", &["pve5"]),
            ],
        );
        Placement::resolve(
            &c,
            &machine("m1", &[], None),
            &capi_machine("m1", Some(zone_name), false, None),
        )
        .unwrap()
    }

    fn narrowed(s: &CloneSources, zone_name: &str) -> Result<Vec<String>, TemplateError> {
        let p = s.narrow(&placement(zone_name))?;
        match p.candidates() {
            NodeCandidates::Nodes(nodes) => Ok(nodes.clone()),
            NodeCandidates::TemplateNode => panic!("a zone placement schedules"),
        }
    }

    fn at(node: &str, vmid: u32) -> TemplateChoice {
        TemplateChoice {
            node: node.into(),
            vmid,
        }
    }

    #[test]
    fn a_template_on_node_local_storage_keeps_its_clones_on_its_node() {
        let s = sources(vec![copy("pve1", 9000, &["local-lvm"])], None);
        assert_eq!(narrowed(&s, "rack-a").unwrap(), ["pve1"]);
        assert_eq!(s.choose(Some("pve1")).unwrap(), at("pve1", 9000));
        assert_eq!(s.source_for("pve2"), None);
        // A local ISO or cloud-init drive is a local volume too, as Proxmox counts it.
        let s = sources(vec![copy("pve1", 9000, &["ceph", "local-lvm"])], None);
        assert_eq!(narrowed(&s, "rack-a").unwrap(), ["pve1"]);
    }

    #[test]
    fn a_template_on_shared_storage_reaches_the_nodes_that_have_that_storage() {
        let s = sources(vec![copy("pve1", 9000, &["ceph"])], None);
        assert_eq!(narrowed(&s, "rack-a").unwrap(), ["pve1", "pve2"]);
        // rack-b: pve3 has ceph, pve4 does not.
        assert_eq!(narrowed(&s, "rack-b").unwrap(), ["pve3"]);
        assert_eq!(s.choose(Some("pve3")).unwrap(), at("pve1", 9000));
        // A full clone onto spec.storage crosses nodes only if that storage is shared too.
        let s = sources(vec![copy("pve1", 9000, &["ceph"])], Some("ceph"));
        assert_eq!(narrowed(&s, "rack-b").unwrap(), ["pve3"]);
        let s = sources(vec![copy("pve1", 9000, &["ceph"])], Some("local-lvm"));
        assert_eq!(narrowed(&s, "rack-a").unwrap(), ["pve1"]);
        // A template without volumes can go anywhere (unless spec.storage holds it back).
        let s = sources(vec![copy("pve1", 9000, &[])], None);
        assert_eq!(narrowed(&s, "rack-b").unwrap(), ["pve3", "pve4"]);
    }

    #[test]
    fn each_node_clones_its_own_copy_first_then_a_shared_one() {
        let s = sources(
            vec![
                copy("pve1", 9001, &["local-lvm"]),
                copy("pve2", 9002, &["local-lvm"]),
                copy("pve3", 9003, &["ceph"]),
            ],
            None,
        );
        assert_eq!(narrowed(&s, "rack-a").unwrap(), ["pve1", "pve2"]);
        assert_eq!(s.choose(Some("pve1")).unwrap(), at("pve1", 9001));
        assert_eq!(s.choose(Some("pve2")).unwrap(), at("pve2", 9002));
        // pve4 has no copy and no ceph; pve3's copy is its own.
        assert_eq!(narrowed(&s, "rack-b").unwrap(), ["pve3"]);
        assert_eq!(s.choose(Some("pve3")).unwrap(), at("pve3", 9003));
        // Copies whose storages were not read serve their own node only.
        let unread = CloneSources::new(
            vec![TemplateCopy {
                storages: None,
                ..copy("pve1", 9001, &[])
            }],
            &storages(),
            None,
        );
        assert_eq!(narrowed(&unread, "rack-a").unwrap(), ["pve1"]);
    }

    #[test]
    fn a_zone_without_a_node_that_can_receive_a_clone_names_template_storage_and_nodes() {
        let s = sources(vec![copy("pve1", 9000, &["local-lvm"])], None);
        let err = narrowed(&s, "rack-b").unwrap_err();
        assert_eq!(
            err.to_string(),
            "VM template \"ubuntu-2404\" cannot be cloned to any node this machine may use \
             (zone \"rack-b\": \"pve3\", \"pve4\"): 9000 \"ubuntu-2404\" on pve1 (tags \"ubuntu\"): \
             its disks are on node-local storage \"local-lvm\", so Proxmox clones it only on its \
             own node; add a copy of the template (same name and tags) on one of these nodes, or \
             keep its disks on shared storage that these nodes have"
        );
        assert_eq!(err.reason(), "TemplateUnreachable");
        assert!(err.is_retryable(), "it waits for a copy");
        // Shared storage the zone lacks, and a storage capmox cannot see.
        let s = sources(vec![copy("pve1", 9000, &["ceph"])], None);
        let err = narrowed(&s, "rack-c").unwrap_err();
        assert!(
            err.to_string()
                .contains("its shared storages are only on \"pve1\", \"pve2\", \"pve3\""),
            "{err}"
        );
        let s = sources(vec![copy("pve1", 9000, &["nfs"])], None);
        let err = narrowed(&s, "rack-a").map(|_| ());
        assert_eq!(err, Ok(()), "pve1 still clones its own copy");
        let err = narrowed(&s, "rack-c").unwrap_err();
        assert!(
            err.to_string().contains(
                "its disks are on storage \"nfs\", which /cluster/resources does not list"
            ),
            "{err}"
        );
    }

    #[test]
    fn without_scheduling_only_a_single_copy_can_be_chosen() {
        let c = cluster(&[], vec![]);
        let p = Placement::resolve(
            &c,
            &machine("m1", &[], None),
            &capi_machine("m1", None, false, None),
        )
        .unwrap();
        assert!(!p.needs_scheduling());
        let one = sources(vec![copy("pve1", 9000, &["local-lvm"])], None);
        assert_eq!(one.narrow(&p).unwrap(), p);
        assert_eq!(one.choose(None).unwrap(), at("pve1", 9000));
        let two = sources(
            vec![
                copy("pve1", 9001, &["local-lvm"]),
                copy("pve2", 9002, &["local-lvm"]),
            ],
            None,
        );
        let err = two.choose(None).unwrap_err();
        assert_eq!(err.reason(), "AmbiguousTemplate");
        assert!(
            err.to_string().starts_with(
                "VM template \"ubuntu-2404\" has copies on several nodes (9001 \"ubuntu-2404\" on pve1"
            ),
            "{err}"
        );
    }
}
