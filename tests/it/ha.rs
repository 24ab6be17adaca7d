//! Proxmox HA inside the zone: with `ha` on, every VM becomes an HA resource kept on its
//! zone's nodes (PVE 9: a strict node-affinity rule per zone, PVE 8: a restricted group per
//! zone), the control plane is kept apart (PVE 9: a negative resource-affinity rule); a
//! failed node's VMs are recovered within their zone; deletion leaves nothing behind; with
//! `ha` off capmox makes no HA call at all.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use crate::common::env::{ENV_WAIT, Env, condition};
use capmox::api::ProxmoxMachine;
use capmox_sim::{Affinity, HaRuleKind};
use capmox_sim::{FaultConfig, FaultRule, SimOptions};
use kube::ResourceExt;
use kube::api::{Api, DeleteParams};
use serde_json::json;

fn sim(version: &str) -> SimOptions {
    SimOptions {
        clone_duration: Duration::ZERO,
        task_duration: Duration::ZERO,
        boot_delay: Duration::ZERO,
        version: version.into(),
        ..SimOptions::default()
    }
}

const RACK_A: [&str; 2] = ["pve1", "pve2"];
const RACK_B: [&str; 2] = ["pve3", "pve4"];

fn cluster_spec(ha: bool) -> serde_json::Value {
    let mut spec = json!({
        "controlPlaneEndpoint": {"host": "10.0.0.10", "port": 6443},
        "dnsServers": ["10.0.0.2"],
        "ipv4Config": {"addresses": ["10.0.0.100-10.0.0.150"], "prefix": 24, "gateway": "10.0.0.1"},
        "credentialsRef": {"name": "demo-credentials"},
        "zoneConfig": [
            {"zone": "rack-a", "nodes": RACK_A},
            {"zone": "rack-b", "nodes": RACK_B}
        ]
    });
    if ha {
        spec["ha"] = json!({"enabled": true, "maxRestart": 2});
    }
    spec
}

fn machine_spec() -> serde_json::Value {
    json!({
        "sourceNode": "pve1", "templateID": 9000, "memoryMiB": 2048,
        "network": {"networkDevices": [{"name": "net0", "bridge": "vmbr0", "defaultIPv4": true}]}
    })
}

/// (name, zone, control plane)
const MACHINES: [(&str, &str, bool); 5] = [
    ("demo-cp-1", "rack-a", true),
    ("demo-cp-2", "rack-b", true),
    ("demo-w-1", "rack-a", false),
    ("demo-w-2", "rack-a", false),
    ("demo-w-3", "rack-b", false),
];

/// Starts the controllers on a ready `demo` cluster and provisions [`MACHINES`]; returns the
/// VMID and node of each machine.
async fn provisioned(env: &Env, ha: bool) -> BTreeMap<String, (u32, String)> {
    env.create_credentials("demo-credentials", None).await;
    let uid = env.create_capi_cluster("demo").await;
    env.create_proxmox_cluster("demo", &uid, cluster_spec(ha))
        .await;
    env.run_controllers();
    let ready = env
        .wait_cluster("demo", "Ready=True", |c| {
            condition(c, "Ready").is_some_and(|c| c.0 == "True")
        })
        .await;
    env.mark_cluster_provisioned("demo", &ready).await;
    for (name, zone, cp) in MACHINES {
        env.create_machine("demo", name, Some(zone), cp, machine_spec())
            .await;
    }
    let mut out = BTreeMap::new();
    for (name, ..) in MACHINES {
        let machine = env
            .wait_machine(name, "provisioned", ProxmoxMachine::is_provisioned)
            .await;
        let status = machine.status.expect("status");
        out.insert(
            name.to_owned(),
            (
                u32::try_from(status.virtual_machine_id.expect("vmid")).expect("vmid"),
                status.proxmox_node.expect("node"),
            ),
        );
    }
    out
}

/// Polls the simulator until `done` holds (the controllers act on their own schedule).
async fn until(env: &Env, what: &str, done: impl Fn(&Env) -> bool) {
    let deadline = tokio::time::Instant::now() + ENV_WAIT;
    while !done(env) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting until {what}; HA resources {:#?}, rules {:#?}",
            env.sim.ha_resources(),
            env.sim.ha_rules()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn sids(vmids: impl IntoIterator<Item = u32>) -> BTreeSet<String> {
    vmids.into_iter().map(|v| format!("vm:{v}")).collect()
}

fn zone_sids(vms: &BTreeMap<String, (u32, String)>, zone: &str) -> BTreeSet<String> {
    sids(
        MACHINES
            .iter()
            .filter(|(_, z, _)| *z == zone)
            .map(|(name, ..)| vms[*name].0),
    )
}

fn cp_sids(vms: &BTreeMap<String, (u32, String)>) -> BTreeSet<String> {
    sids(
        MACHINES
            .iter()
            .filter(|(.., cp)| *cp)
            .map(|(name, ..)| vms[*name].0),
    )
}

/// What the simulator's PVE 9 rules say: per zone rule id its nodes and resources, and the
/// resources of negative resource-affinity rules.
type ZoneRules = BTreeMap<String, (BTreeSet<String>, BTreeSet<String>, bool)>;

fn rules(env: &Env) -> (ZoneRules, Vec<BTreeSet<String>>) {
    let mut zones = ZoneRules::new();
    let mut negative = Vec::new();
    for rule in env.sim.ha_rules() {
        match rule.kind {
            HaRuleKind::NodeAffinity { nodes, strict } => {
                zones.insert(
                    rule.rule.clone(),
                    (nodes.into_keys().collect(), rule.resources.clone(), strict),
                );
            }
            HaRuleKind::ResourceAffinity {
                affinity: Affinity::Negative,
            } => negative.push(rule.resources.clone()),
            HaRuleKind::ResourceAffinity { .. } => {}
        }
    }
    (zones, negative)
}

fn set(items: &[&str]) -> BTreeSet<String> {
    items.iter().map(|s| (*s).to_owned()).collect()
}

async fn delete_all(env: &Env) {
    let machines = Api::<ProxmoxMachine>::namespaced(env.client(), "default");
    let mut uids = Vec::new();
    for (name, ..) in MACHINES {
        let machine = machines.get(name).await.expect("machine");
        uids.push((name, machine.uid().expect("uid")));
        machines
            .delete(name, &DeleteParams::default())
            .await
            .expect("delete");
    }
    for (name, uid) in uids {
        tokio::time::timeout(
            ENV_WAIT,
            kube::runtime::wait::await_condition(
                machines.clone(),
                name,
                kube::runtime::wait::conditions::is_deleted(&uid),
            ),
        )
        .await
        .expect("deleted in time")
        .expect("watch");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pve9_zone_rules_keep_vms_in_their_zone_and_deletion_leaves_nothing() {
    let env = Env::start_with(sim("9.1.4")).await;
    let vms = provisioned(&env, true).await;
    let all = sids(vms.values().map(|(vmid, _)| *vmid));
    let want_a = zone_sids(&vms, "rack-a");
    let want_b = zone_sids(&vms, "rack-b");
    let want_cp = cp_sids(&vms);
    until(&env, "the HA rules hold every VM", |env| {
        let (zones, negative) = rules(env);
        let held: BTreeSet<String> = zones.values().flat_map(|(_, r, _)| r.clone()).collect();
        held == all && negative == [want_cp.clone()]
    })
    .await;

    let resources = env.sim.ha_resources();
    assert_eq!(
        resources
            .iter()
            .map(|r| r.sid.clone())
            .collect::<BTreeSet<_>>(),
        all,
        "one HA resource per VM"
    );
    for r in &resources {
        assert_eq!(r.requested_state(), "started", "{}", r.sid);
        assert_eq!(r.max_restart, Some(2), "{}", r.sid);
        let comment = r.comment.as_deref().unwrap_or_default();
        assert!(
            comment.starts_with("managed by capmox: default/demo machine "),
            "{comment}"
        );
    }
    let (zones, _) = rules(&env);
    assert_eq!(zones.len(), 2, "one node-affinity rule per zone: {zones:?}");
    for (rule, (nodes, resources, strict)) in &zones {
        assert!(rule.starts_with("capmox-"), "{rule}");
        assert!(strict, "{rule} is strict");
        if rule.ends_with("-zone-rack-a") {
            assert_eq!(*nodes, set(&RACK_A));
            assert_eq!(*resources, want_a);
        } else {
            assert!(rule.ends_with("-zone-rack-b"), "{rule}");
            assert_eq!(*nodes, set(&RACK_B));
            assert_eq!(*resources, want_b);
        }
    }
    for rule in env.sim.ha_rules() {
        assert!(
            rule.comment
                .as_deref()
                .unwrap_or_default()
                .starts_with("managed by capmox: default/demo "),
            "{rule:?}"
        );
    }
    for vmid in vms.values().map(|(vmid, _)| *vmid) {
        assert_eq!(env.sim.ha_state(vmid).as_deref(), Some("started"));
    }

    // A rack-a node fails: its VMs are recovered on the other rack-a node only.
    let (_, node) = &vms["demo-w-1"];
    let relocations = env.sim.fail_node(node);
    assert!(!relocations.is_empty(), "{node} ran demo-w-1");
    for r in &relocations {
        let to = r.to.as_deref().expect("recovered");
        assert!(RACK_A.contains(&to) && to != node, "{r:?}");
    }
    env.sim.revive_node(node);

    let before = env.sim.request_log().len();
    delete_all(&env).await;
    assert_eq!(env.sim.ha_resources(), [], "no HA resource left");
    assert_eq!(env.sim.ha_rules(), [], "no HA rule left");
    // The deletion budget grows only by the HA calls: each VM's resource once, at most one look
    // at the rules per machine, and each of the cluster's three rules deleted at most once
    // (the simulator's purge already drops a rule left without resources; capmox deletes the
    // ones that remain and no longer hold what they need).
    let ha_calls: Vec<String> = env.sim.request_log()[before..]
        .iter()
        .filter(|r| r.endpoint.contains("/cluster/ha/"))
        .map(|r| r.endpoint.clone())
        .collect();
    let count = |endpoint: &str| ha_calls.iter().filter(|e| *e == endpoint).count();
    assert_eq!(
        count("DELETE /cluster/ha/resources/{sid}"),
        vms.len(),
        "{ha_calls:#?}"
    );
    assert!(count("GET /cluster/ha/rules") <= vms.len(), "{ha_calls:#?}");
    assert!(
        count("DELETE /cluster/ha/rules/{rule}") <= 3,
        "{ha_calls:#?}"
    );
    assert_eq!(
        ha_calls.len(),
        count("DELETE /cluster/ha/resources/{sid}")
            + count("GET /cluster/ha/rules")
            + count("DELETE /cluster/ha/rules/{rule}"),
        "no other HA call while deleting: {ha_calls:#?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pve8_zone_groups_carry_the_resources() {
    let env = Env::start_with(sim("8.4.14")).await;
    let vms = provisioned(&env, true).await;
    let all = sids(vms.values().map(|(vmid, _)| *vmid));
    until(&env, "every VM is an HA resource", |env| {
        env.sim
            .ha_resources()
            .iter()
            .map(|r| r.sid.clone())
            .collect::<BTreeSet<_>>()
            == all
    })
    .await;
    let groups = env.sim.ha_groups();
    assert_eq!(groups.len(), 2, "one group per zone: {groups:?}");
    let mut group_of_zone = BTreeMap::new();
    for g in &groups {
        assert!(g.restricted, "{g:?}");
        let nodes: BTreeSet<String> = g.nodes.keys().cloned().collect();
        let zone = if g.group.ends_with("-zone-rack-a") {
            assert_eq!(nodes, set(&RACK_A));
            "rack-a"
        } else {
            assert!(g.group.ends_with("-zone-rack-b"), "{g:?}");
            assert_eq!(nodes, set(&RACK_B));
            "rack-b"
        };
        group_of_zone.insert(zone, g.group.clone());
    }
    for (name, zone, _) in MACHINES {
        let sid = format!("vm:{}", vms[name].0);
        let resource = env
            .sim
            .ha_resources()
            .into_iter()
            .find(|r| r.sid == sid)
            .expect("resource");
        assert_eq!(
            resource.group.as_ref(),
            Some(&group_of_zone[zone]),
            "{name}"
        );
    }
    let (_, node) = &vms["demo-w-1"];
    for r in env.sim.fail_node(node) {
        let to = r.to.as_deref().expect("recovered");
        assert!(RACK_A.contains(&to) && to != node, "{r:?}");
    }
    env.sim.revive_node(node);

    delete_all(&env).await;
    assert_eq!(env.sim.ha_resources(), [], "no HA resource left");
    assert_eq!(env.sim.ha_groups(), [], "no HA group left");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_ha_capmox_makes_no_ha_call() {
    let env = Env::start_with(sim("9.1.4")).await;
    provisioned(&env, false).await;
    delete_all(&env).await;
    let ha_calls: Vec<String> = env
        .sim
        .request_log()
        .into_iter()
        .filter(|r| r.path.starts_with("/cluster/ha"))
        .map(|r| format!("{} {}", r.method, r.path))
        .collect();
    assert_eq!(ha_calls, Vec::<String>::new());
    assert_eq!(env.sim.ha_resources(), []);
}

/// Refuses every write of an HA rule as Proxmox refuses one whose file changed since it was
/// read: what the cluster meets when a machine joins a zone rule during a zone edit.
fn rule_writes_refused_as_changed_meanwhile() -> FaultConfig {
    FaultConfig {
        rules: vec![FaultRule {
            endpoint: "PUT /cluster/ha/rules/{rule}".into(),
            error_rate: 1.0,
            error_status: 500,
            error_reason:
                "detected modified configuration - file changed by other user? Try again.".into(),
            drop_rate: 0.0,
            lock_contention_rate: 0.0,
            latency_ms: 0,
        }],
        ..FaultConfig::default()
    }
}

fn rack_b_rule_nodes(env: &Env) -> Option<BTreeSet<String>> {
    let (zones, _) = rules(env);
    zones
        .into_iter()
        .find(|(rule, _)| rule.ends_with("-zone-rack-b"))
        .map(|(_, (nodes, ..))| nodes)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zone_edit_reaches_the_zone_rule_though_a_machine_wrote_it_meanwhile() {
    let env = Env::start_with(sim("9.1.4")).await;
    let vms = provisioned(&env, true).await;
    let all = sids(vms.values().map(|(vmid, _)| *vmid));
    until(&env, "the HA rules hold every VM", |env| {
        let (zones, _) = rules(env);
        zones
            .values()
            .flat_map(|(_, r, _)| r.clone())
            .collect::<BTreeSet<_>>()
            == all
    })
    .await;
    // rack-b gains pve5, and the cluster's first write of it is refused as changed meanwhile
    env.sim
        .set_faults(rule_writes_refused_as_changed_meanwhile());
    let clusters = Api::<capmox::api::ProxmoxCluster>::namespaced(env.client(), "default");
    let mut spec = cluster_spec(true);
    spec["zoneConfig"][1]["nodes"] = json!(["pve3", "pve4", "pve5"]);
    clusters
        .patch(
            "demo",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({"spec": spec})),
        )
        .await
        .expect("zone edited");
    until(
        &env,
        "the cluster's write of rack-b's rule was refused",
        |env| {
            env.sim
                .request_log()
                .iter()
                .any(|r| r.method == "PUT" && r.path.ends_with("-zone-rack-b") && r.status == 500)
        },
    )
    .await;
    env.sim.set_faults(FaultConfig::default());
    // Well before the cluster's periodic pass.
    until(&env, "rack-b's rule has pve5", |env| {
        rack_b_rule_nodes(env) == Some(set(&["pve3", "pve4", "pve5"]))
    })
    .await;

    // A machine pass that read the zone before the edit joins the rule, and leaves its nodes.
    let (w3, _) = vms["demo-w-3"];
    let before_the_edit = capmox::placement::MachineHa {
        settings: capmox::api::HaSpec {
            enabled: Some(true),
            ..Default::default()
        },
        zone: Some(("rack-b".into(), RACK_B.map(str::to_owned).to_vec())),
    };
    let names = capmox::controller::ha::HaNames::new("default", "demo");
    let registered = capmox::controller::ha::register(
        &env.proxmox(),
        9,
        &names,
        "demo-w-3",
        false,
        w3,
        &before_the_edit,
        true,
    )
    .await
    .expect("registered");
    assert!(registered.warnings.is_empty(), "{:?}", registered.warnings);
    assert_eq!(
        rack_b_rule_nodes(&env),
        Some(set(&["pve3", "pve4", "pve5"])),
        "a machine's older view of the zone does not undo the edit"
    );
}
