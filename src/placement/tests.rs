//! Cross-cutting placement tests: properties over random inputs, a KCP-driven spread across
//! failure domains, and the guards that keep placement pure and the only reader of its inputs.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use proptest::prelude::*;

use crate::api::{
    FailureDomain, ProxmoxCluster, ProxmoxClusterStatus, SchedulerHints, TemplateSelector,
};

use super::fixtures::{capi_machine, cluster, machine, strings, zone};
use super::*;

const GIB: u64 = 1 << 30;

fn node_name(i: usize) -> String {
    format!("pve{i}")
}

fn names(mask: u8) -> Vec<String> {
    (0..8)
        .filter(|i| mask & (1 << i) != 0)
        .map(node_name)
        .collect()
}

fn empty_node(name: &str, total: u64) -> NodeInfo {
    NodeInfo {
        name: name.to_owned(),
        total_memory_bytes: total,
        ..NodeInfo::default()
    }
}

/// Random zones (node bitmasks over pve0..pve7, possibly overlapping or empty), cluster and
/// machine allowed nodes, and the zone choices of the Machine and of the network.
#[derive(Debug, Clone)]
struct World {
    zone_masks: Vec<u8>,
    cluster_allowed: u8,
    machine_allowed: u8,
    failure_domain: Option<usize>,
    network_zone: Option<usize>,
    memory_gib: u64,
    node_gib: Vec<u64>,
}

fn world() -> impl Strategy<Value = World> {
    (
        prop::collection::vec(prop_oneof![Just(0u8), any::<u8>()], 0..4),
        prop_oneof![Just(0u8), any::<u8>()],
        prop_oneof![Just(0u8), any::<u8>()],
        prop::option::of(0usize..5),
        prop::option::of(0usize..5),
        1u64..16,
        prop::collection::vec(0u64..64, 8),
    )
        .prop_map(|(zone_masks, ca, ma, fd, nz, mem, node_gib)| World {
            zone_masks,
            cluster_allowed: ca,
            machine_allowed: ma,
            failure_domain: fd,
            network_zone: nz,
            memory_gib: mem,
            node_gib,
        })
}

proptest! {
    /// A resolved placement offers exactly zone nodes ∩ allowed nodes, and the scheduler only
    /// ever picks one of them.
    #[test]
    fn placement_nodes_are_zone_nodes_within_allowed_nodes(w in world()) {
        let zones: Vec<_> = w.zone_masks.iter().enumerate()
            .map(|(i, m)| { let mut z = zone(&format!("z{i}"), &[]); z.nodes = names(*m); z })
            .collect();
        let mut c = ProxmoxCluster::new("c1", cluster(&[], vec![]).spec);
        c.spec.allowed_nodes = names(w.cluster_allowed);
        c.spec.zone_config = zones.clone();
        // Publish every zone with nodes, valid or not, to reach every resolve path.
        c.status = Some(ProxmoxClusterStatus {
            failure_domains: zones.iter().filter(|z| !z.nodes.is_empty())
                .map(|z| FailureDomain { name: z.zone.clone(), control_plane: Some(true), ..Default::default() })
                .collect(),
            ..Default::default()
        });
        let zone_name = |i: Option<usize>| i.map(|i| format!("z{i}"));
        let fd = zone_name(w.failure_domain);
        let nz = zone_name(w.network_zone);
        let mut m = machine("m1", &[], nz.as_deref());
        m.spec.allowed_nodes = names(w.machine_allowed);
        m.spec.memory_mib = Some(i32::try_from(w.memory_gib * 1024).unwrap());
        let result = Placement::resolve(&c, &m, &capi_machine("m1", fd.as_deref(), false, None));

        let allowed: BTreeSet<String> = if m.spec.allowed_nodes.is_empty() {
            c.spec.allowed_nodes.iter().cloned().collect()
        } else {
            m.spec.allowed_nodes.iter().cloned().collect()
        };
        let effective = fd.clone().or(nz.clone());
        let zone_nodes: BTreeSet<String> = effective.as_ref()
            .and_then(|z| zones.iter().find(|c| &c.zone == z))
            .map(|z| z.nodes.iter().cloned().collect())
            .unwrap_or_default();
        match result {
            Ok(p) => {
                prop_assert_eq!(p.zone(), effective.as_deref());
                let expected: BTreeSet<String> = match (zone_nodes.is_empty(), allowed.is_empty()) {
                    (false, false) => zone_nodes.intersection(&allowed).cloned().collect(),
                    (false, true) => zone_nodes.clone(),
                    (true, _) => allowed.clone(),
                };
                match p.candidates() {
                    NodeCandidates::Nodes(nodes) => {
                        let got: BTreeSet<String> = nodes.iter().cloned().collect();
                        prop_assert!(!got.is_empty());
                        prop_assert_eq!(&got, &expected);
                        let inventory = NodeInventory {
                            nodes: (0..8).map(|i| empty_node(&node_name(i), w.node_gib[i] * GIB)).collect(),
                        };
                        let request = ScheduleRequest::new(&p, None);
                        if let Ok(choice) = schedule(&p, &inventory, &Reservations::new(), &request) {
                            prop_assert!(expected.contains(&choice.node));
                            prop_assert!(zone_nodes.is_empty() || zone_nodes.contains(&choice.node));
                            prop_assert!(allowed.is_empty() || allowed.contains(&choice.node));
                        }
                    }
                    NodeCandidates::TemplateNode => prop_assert!(expected.is_empty()),
                }
            }
            Err(PlacementError::NoCandidateNodes { .. }) => {
                prop_assert!(!zone_nodes.is_empty() && zone_nodes.is_disjoint(&allowed));
            }
            Err(PlacementError::ZoneConflict { .. }) => prop_assert!(fd.is_some() && nz.is_some() && fd != nz),
            Err(PlacementError::FailureDomainNotReady { .. }) => prop_assert!(zone_nodes.is_empty()),
            Err(PlacementError::UnknownZone { .. }) => prop_assert!(fd.is_none()),
            Err(e) => prop_assert!(false, "unexpected error {e}"),
        }
    }

    /// Published failure domains are exactly the zones with nodes, sorted, with `controlPlane`
    /// set; every reported problem is real.
    #[test]
    fn failure_domains_match_the_zones_with_nodes(
        zones in prop::collection::vec((0usize..6, prop_oneof![Just(0u8), any::<u8>()], prop::option::of(any::<bool>())), 0..6),
        allowed in prop_oneof![Just(0u8), any::<u8>()],
    ) {
        let specs: Vec<_> = zones.iter().map(|(name, mask, cp)| {
            let mut z = zone(&format!("z{name}"), &[]);
            z.nodes = names(*mask);
            z.control_plane_eligible = *cp;
            z
        }).collect();
        let mut c = cluster(&[], specs.clone());
        c.spec.allowed_nodes = names(allowed);
        match failure_domains(&c) {
            Ok(domains) => {
                let mut want: Vec<(String, bool)> = specs.iter().filter(|z| !z.nodes.is_empty())
                    .map(|z| (z.zone.clone(), z.control_plane_eligible.unwrap_or(true)))
                    .collect();
                want.sort();
                let got: Vec<(String, bool)> = domains.iter()
                    .map(|d| (d.name.clone(), d.control_plane.unwrap_or(false)))
                    .collect();
                prop_assert!(domains.iter().all(|d| d.control_plane.is_some()));
                prop_assert_eq!(got, want);
            }
            Err(err) => {
                prop_assert!(!err.problems.is_empty());
                for problem in &err.problems {
                    match problem {
                        ZoneProblem::DuplicateZone { zone } => prop_assert!(specs.iter().filter(|z| &z.zone == zone).count() > 1),
                        ZoneProblem::NodeInSeveralZones { node, zones } => {
                            prop_assert!(zones.len() > 1);
                            for z in zones {
                                prop_assert!(specs.iter().any(|s| &s.zone == z && s.nodes.contains(node)));
                            }
                        }
                        ZoneProblem::NodeNotAllowed { zone, node } => {
                            prop_assert!(!c.spec.allowed_nodes.is_empty() && !c.spec.allowed_nodes.contains(node));
                            prop_assert!(specs.iter().any(|s| &s.zone == zone && s.nodes.contains(node)));
                        }
                        ZoneProblem::TooManyFailureDomains { .. } => prop_assert!(false, "at most 6 zones"),
                    }
                }
            }
        }
    }

    /// Scheduling machines one by one, with reservations, never promises a node more memory
    /// than it can reserve.
    #[test]
    fn scheduling_never_overcommits(
        nodes in prop::collection::vec((1u64..64, prop::collection::vec(0u64..16, 0..4)), 1..5),
        adjustment in prop_oneof![Just(50i64), Just(95), Just(100), Just(300)],
        requests in prop::collection::vec((1i32..16, 0usize..3), 1..25),
    ) {
        let names: Vec<String> = (0..nodes.len()).map(node_name).collect();
        let mut c = cluster(&[], vec![]);
        c.spec.allowed_nodes = names.clone();
        c.spec.scheduler_hints = Some(SchedulerHints { memory_adjustment: Some(adjustment) });
        let inventory = NodeInventory {
            nodes: nodes.iter().enumerate().map(|(i, (total, guests))| NodeInfo {
                guests: guests.iter().enumerate().map(|(j, g)| GuestInfo {
                    vmid: u32::try_from(100 * i + j).unwrap(),
                    kind: if j % 2 == 0 { GuestKind::Qemu } else { GuestKind::Lxc },
                    max_memory_bytes: g * GIB,
                    template: false,
                }).collect(),
                ..empty_node(&names[i], total * GIB)
            }).collect(),
        };
        let adjustment = u64::try_from(adjustment).unwrap();
        let mut reservations = Reservations::new();
        for (i, (gib, owner)) in requests.iter().enumerate() {
            let name = format!("m{i}");
            let mut m = machine(&name, &[], None);
            m.spec.memory_mib = Some(gib * 1024);
            let owner_name = format!("md-{owner}");
            let p = Placement::resolve(&c, &m, &capi_machine(&name, None, false, Some(("MachineDeployment", &owner_name)))).unwrap();
            match reservations.schedule_and_reserve(&p, &inventory, &ScheduleRequest::new(&p, None)) {
                Ok(choice) => prop_assert!(names.contains(&choice.node)),
                Err(e) => {
                    let capacity = matches!(e, ScheduleError::InsufficientMemory { .. });
                    prop_assert!(capacity && e.is_retryable(), "unexpected error {}", e);
                }
            }
        }
        for node in &inventory.nodes {
            let promised: u64 = (0..requests.len())
                .filter_map(|i| reservations.get(&format!("m{i}")))
                .filter(|r| r.node == node.name)
                .map(|r| r.memory_bytes)
                .sum();
            let reservable = node.reservable_bytes(adjustment).unwrap();
            prop_assert!(promised <= reservable, "{}: promised {} > reservable {}", node.name, promised, reservable);
        }
    }

    /// With equal nodes, one owner's machines spread evenly, whatever else runs there.
    #[test]
    fn one_owner_spreads_evenly_over_equal_nodes(
        node_count in 2usize..6,
        machines in 1usize..30,
        strangers in prop::collection::vec((0usize..6, any::<bool>()), 0..10),
        adjustment in prop_oneof![Just(0i64), Just(100)],
    ) {
        let names: Vec<String> = (0..node_count).map(node_name).collect();
        let mut c = cluster(&[], vec![]);
        c.spec.allowed_nodes = names.clone();
        c.spec.scheduler_hints = Some(SchedulerHints { memory_adjustment: Some(adjustment) });
        let mut inventory = NodeInventory {
            nodes: names.iter().map(|n| empty_node(n, 1024 * GIB)).collect(),
        };
        // Machines of other owners already on some nodes.
        for (i, (n, cp)) in strangers.iter().enumerate() {
            inventory.nodes[n % node_count].machines.push(PlacedMachine {
                name: format!("other-{i}"),
                owner: Some(MachineOwner { kind: "MachineDeployment".into(), name: "other".into() }),
                role: if *cp { MachineRole::ControlPlane } else { MachineRole::Worker },
            });
        }
        let mut reservations = Reservations::new();
        let mut per_node: BTreeMap<String, usize> = names.iter().map(|n| (n.clone(), 0)).collect();
        for i in 0..machines {
            let name = format!("m{i}");
            let p = Placement::resolve(&c, &machine(&name, &[], None),
                &capi_machine(&name, None, false, Some(("MachineDeployment", "md-0")))).unwrap();
            let choice = reservations.schedule_and_reserve(&p, &inventory, &ScheduleRequest::new(&p, None)).unwrap();
            *per_node.entry(choice.node).or_default() += 1;
        }
        let max = per_node.values().max().copied().unwrap_or(0);
        let min = per_node.values().min().copied().unwrap_or(0);
        prop_assert!(max - min <= 1, "uneven spread {:?}", per_node);
    }
}

/// CAPI's KCP choice for a new control-plane machine (capi-contract §4.2): among domains with
/// `controlPlane: true`, the one with the fewest KCP machines; ties broken by `tie_seed`, standing
/// in for KCP's random tie-break.
fn kcp_pick(domains: &[FailureDomain], existing: &[String], tie_seed: usize) -> Option<String> {
    let mut candidates: Vec<(usize, &str)> = domains
        .iter()
        .filter(|d| d.control_plane == Some(true))
        .map(|d| {
            (
                existing.iter().filter(|e| **e == d.name).count(),
                d.name.as_str(),
            )
        })
        .collect();
    if candidates.is_empty() {
        return None;
    }
    let n = candidates.len();
    candidates.rotate_left(tie_seed % n);
    // Stable sort keeps the rotated order among equal counts.
    candidates.sort_by_key(|(count, _)| *count);
    candidates.first().map(|(_, name)| (*name).to_owned())
}

#[test]
fn kcp_spreads_control_planes_over_eligible_failure_domains() {
    let mut rack_c = zone("rack-c", &["pve5"]);
    rack_c.control_plane_eligible = Some(false);
    let c = cluster(
        &["pve1", "pve2", "pve3", "pve4", "pve5"],
        vec![
            zone("rack-a", &["pve1", "pve2"]),
            zone("rack-b", &["pve3", "pve4"]),
            rack_c,
        ],
    );
    let published = failure_domains(&c).unwrap();
    assert_eq!(
        published
            .iter()
            .map(|d| (d.name.as_str(), d.control_plane))
            .collect::<Vec<_>>(),
        [
            ("rack-a", Some(true)),
            ("rack-b", Some(true)),
            ("rack-c", Some(false))
        ]
    );
    let zone_nodes = |z: &str| -> Vec<String> {
        match z {
            "rack-a" => strings(&["pve1", "pve2"]),
            "rack-b" => strings(&["pve3", "pve4"]),
            _ => strings(&["pve5"]),
        }
    };
    let inventory = NodeInventory {
        nodes: (1..=5)
            .map(|i| empty_node(&node_name(i), 64 * GIB))
            .collect(),
    };
    for seed in 0..6 {
        let mut chosen_domains = Vec::new();
        let mut reservations = Reservations::new();
        for i in 0..3 {
            let name = format!("cp-{i}");
            let fd = kcp_pick(&published, &chosen_domains, seed + i).unwrap();
            let capi = capi_machine(&name, Some(&fd), true, Some(("KubeadmControlPlane", "kcp")));
            let p = Placement::resolve(&c, &machine(&name, &[], None), &capi).unwrap();
            assert_eq!(p.failure_domain(), Some(fd.as_str()));
            let choice = reservations
                .schedule_and_reserve(&p, &inventory, &ScheduleRequest::new(&p, None))
                .unwrap();
            assert!(
                zone_nodes(&fd).contains(&choice.node),
                "seed {seed}: {name} in {fd} landed on {}",
                choice.node
            );
            chosen_domains.push(fd);
        }
        let count = |z: &str| chosen_domains.iter().filter(|d| *d == z).count();
        assert_eq!(
            count("rack-a") + count("rack-b"),
            3,
            "seed {seed}: {chosen_domains:?}"
        );
        assert!(
            count("rack-a") >= 1 && count("rack-b") >= 1,
            "seed {seed}: {chosen_domains:?}"
        );
        assert_eq!(count("rack-c"), 0);
        // The two machines sharing a rack are on different nodes of it.
        let nodes: BTreeSet<String> = (0..3)
            .filter_map(|i| reservations.get(&format!("cp-{i}")).map(|r| r.node.clone()))
            .collect();
        assert_eq!(nodes.len(), 3, "seed {seed}: {nodes:?}");
    }
}

/// The whole machine flow on per-node templates on node-local storage: resolve in rack-b, keep
/// the nodes with a copy, schedule onto one of them, then clone the copy on that node.
#[test]
fn per_node_template_follows_the_scheduled_node() {
    let c = cluster(
        &[],
        vec![
            zone("rack-a", &["pve1", "pve2"]),
            zone("rack-b", &["pve3", "pve4", "pve5"]),
        ],
    );
    let mut m = machine("w-0", &[], None);
    m.spec.template_id = None;
    m.spec.source_node = None;
    m.spec.template_selector = Some(TemplateSelector {
        match_tags: strings(&["Ubuntu-24.04", "k8s"]),
        match_policy: None,
    });
    let p = Placement::resolve(
        &c,
        &m,
        &capi_machine("w-0", Some("rack-b"), false, Some(("MachineSet", "md-b-1"))),
    )
    .unwrap();
    // Copies on pve1..pve4 (not pve5), each on its node's local-lvm.
    let templates: Vec<TemplateInfo> = (1..=4)
        .map(|i| TemplateInfo {
            node: node_name(i),
            vmid: u32::try_from(9000 + i).unwrap(),
            name: "ubuntu".into(),
            tags: split_proxmox_tags("k8s;ubuntu-24.04"),
        })
        .collect();
    let TemplateSource::Tags(selector) = p.template() else {
        panic!("selector expected");
    };
    let copies = select_template(selector, &templates)
        .unwrap()
        .into_iter()
        .map(|template| TemplateCopy {
            template,
            storages: Some(strings(&["local-lvm"])),
        })
        .collect();
    let storages: Vec<StorageInfo> = (1..=5)
        .map(|i| StorageInfo {
            node: node_name(i),
            storage: "local-lvm".into(),
            shared: false,
        })
        .collect();
    let sources = CloneSources::new(copies, &storages, None);
    let narrowed = sources.narrow(&p).unwrap();
    assert_eq!(
        narrowed.candidates(),
        &NodeCandidates::Nodes(strings(&["pve3", "pve4"]))
    );
    // pve3 is fuller and pve5 (emptiest) has no copy, so pve4 is chosen.
    let inventory = NodeInventory {
        nodes: (1..=5)
            .map(|i| empty_node(&node_name(i), if i == 3 { 16 } else { 64 * i as u64 } * GIB))
            .collect(),
    };
    let choice = Reservations::new()
        .schedule_and_reserve(&narrowed, &inventory, &ScheduleRequest::new(&p, None))
        .unwrap();
    assert_eq!(choice.node, "pve4");
    assert_eq!(
        sources.choose(Some(&choice.node)).unwrap(),
        TemplateChoice {
            node: "pve4".into(),
            vmid: 9004
        }
    );
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Production code of a source file: everything before its first `#[cfg(test)]`.
fn production_code(text: &str) -> &str {
    text.split("#[cfg(test)]").next().unwrap_or(text)
}

/// Code lines (not comments) of `text` that use `needle` as a whole token; with
/// `allow_assignment`, plain assignments (`x.field = ...`, building an object) are not counted.
fn uses(text: &str, needle: &str, allow_assignment: bool) -> Vec<String> {
    text.lines()
        .map(str::trim)
        .filter(|code| {
            !code.starts_with("//")
                && code.match_indices(needle).any(|(at, _)| {
                    let rest = &code[at + needle.len()..];
                    let whole_token =
                        !rest.starts_with(|c: char| c.is_ascii_alphanumeric() || c == '_');
                    let after = rest.trim_start();
                    let assignment = after.starts_with('=') && !after.starts_with("==");
                    whole_token && !(allow_assignment && assignment)
                })
        })
        .map(str::to_owned)
        .collect()
}

fn offenders(files: &[PathBuf], needles: &[String], production_only: bool) -> Vec<String> {
    files
        .iter()
        .flat_map(|f| {
            let text = std::fs::read_to_string(f).unwrap_or_default();
            let code = if production_only {
                production_code(&text)
            } else {
                &text
            };
            needles
                .iter()
                .flat_map(|n| uses(code, n, production_only))
                .map(|line| format!("{}: {line}", f.display()))
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Deny by construction: outside `api` (the types) and `placement` (the one resolver), no
/// production code reads the overridable placement inputs; it takes a `Placement` instead.
/// (Building objects by assignment and test code are fine.)
#[test]
fn only_placement_reads_zone_and_allowed_node_fields() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    // Production code only: tests build specs and name these fields in expectations.
    rust_files(&root.join("src"), &mut files);
    let exempt = [root.join("src/api"), root.join("src/placement")];
    files.retain(|f| !exempt.iter().any(|e| f.starts_with(e)));
    let forbidden = [
        ".allowed_nodes",
        ".zone_config",
        "network.zone",
        ".scheduler_hints",
        ".default_ipv4",
        ".default_ipv6",
        ".ip_pool_ref",
    ]
    .map(str::to_owned);
    let found = offenders(&files, &forbidden, true);
    assert!(
        found.is_empty(),
        "read these through capmox::placement::Placement (or failure_domains / cluster_pools) \
         instead of the spec:\n{}",
        found.join("\n")
    );
}

/// Placement is pure: no Kubernetes client, HTTP or async I/O.
#[test]
fn placement_does_no_io() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/placement");
    let mut files = Vec::new();
    rust_files(&dir, &mut files);
    assert!(files.len() >= 6, "found the placement sources: {files:?}");
    // Test-only files are exempt (this one reads the sources); built from parts so it does not match itself.
    files.retain(|f| !f.ends_with("tests.rs") && !f.ends_with("fixtures.rs"));
    let forbidden = [
        ["kube::", "Client"].concat(),
        ["kube::", "Api"].concat(),
        ["req", "west"].concat(),
        ["tok", "io"].concat(),
        ["std::", "net::Tcp"].concat(),
        ["std::", "fs"].concat(),
    ];
    let found = offenders(&files, &forbidden, false);
    assert!(found.is_empty(), "I/O in placement:\n{}", found.join("\n"));
}

#[test]
fn the_guards_see_what_they_look_for() {
    let src = "let n = &m.spec.allowed_nodes;\n\
               // m.spec.allowed_nodes in a comment\n\
               m.spec.allowed_nodes = vec![];\n\
               if m.spec.allowed_nodes == x {}\n\
               let z = spec.network.zone_label();\n\
               let y = spec.network.zone;\n\
               #[cfg(test)]\n\
               let t = m.spec.allowed_nodes;\n";
    assert_eq!(uses(production_code(src), ".allowed_nodes", true).len(), 2);
    assert_eq!(uses(src, ".allowed_nodes", false).len(), 4);
    assert_eq!(
        uses(src, "network.zone", true),
        ["let y = spec.network.zone;"]
    );
}
