//! The simulator's Proxmox HA: resources, groups (PVE 8), rules (PVE 9) and node failure,
//! served as the official API schema of each version describes. Every HA request's
//! parameters must be declared in that version's schema subset, and every answer must
//! match the subset's documented `returns` (types, enums, and for fully documented
//! objects, no undocumented keys).

use std::time::Duration;

use capmox_sim::{
    Affinity, HaRuleKind, SIM_ROUTES, SIM_ROUTES_PVE9, SimOptions, Simulator, Topology,
};
use reqwest::Method as M;
use serde_json::Value;

/// The PVE API schema subsets under `tests/data/`.
pub(crate) const API91: &str = "pve-api/apidata.json";
pub(crate) const API84: &str = "pve-api/pve8/apidata.json";

/// Four nodes in two zones (n1, n2 | n3, n4) on shared storage, five running guests.
const TOPOLOGY: &str = "
cluster_name: ha
nodes: [{name: n1}, {name: n2}, {name: n3}, {name: n4}]
storages: [{name: ceph, type: rbd, shared: true}]
guests:
  - {vmid: 101, name: cp1, node: n1, storage: ceph, running: true}
  - {vmid: 102, name: cp2, node: n2, storage: ceph, running: true}
  - {vmid: 103, name: cp3, node: n3, storage: ceph, running: true}
  - {vmid: 104, name: w1, node: n1, storage: ceph, running: true}
  - {vmid: 105, name: w2, node: n3, storage: ceph, running: true}
";

async fn sim(version: &str) -> Simulator {
    let opts = SimOptions {
        version: version.into(),
        // tasks end at once: the next request sees them done, no waiting needed
        task_duration: Duration::ZERO,
        boot_delay: Duration::ZERO,
        ..SimOptions::default()
    };
    Simulator::start(Topology::from_yaml(TOPOLOGY, "ha").expect("topology"), opts)
        .await
        .expect("simulator")
}

pub(crate) struct Raw {
    pub(crate) status: u16,
    pub(crate) reason: String,
    pub(crate) body: Value,
}

impl Raw {
    pub(crate) fn data(&self) -> &Value {
        &self.body["data"]
    }
    pub(crate) fn ok(self, what: &str) -> Self {
        assert_eq!(self.status, 200, "{what}: {} {:?}", self.reason, self.body);
        self
    }
}

pub(crate) async fn call(sim: &Simulator, method: M, path: &str, form: &[(&str, &str)]) -> Raw {
    let http = reqwest::Client::builder()
        .tls_backend_preconfigured(
            rustls::ClientConfig::builder_with_provider(capmox::proxmox::tls::crypto_provider())
                .with_safe_default_protocol_versions()
                .expect("tls")
                .with_root_certificates(rustls::RootCertStore::empty())
                .with_no_client_auth(),
        )
        .build()
        .expect("http client");
    let mut req = http
        .request(method.clone(), format!("{}/api2/json{path}", sim.url()))
        .header("Authorization", format!("PVEAPIToken={}", sim.token()));
    if !form.is_empty() {
        req = if method == M::GET || method == M::DELETE {
            req.query(form)
        } else {
            req.form(form)
        };
    }
    let resp = req.send().await.expect("request");
    let status = resp.status().as_u16();
    let reason = resp
        .extensions()
        .get::<hyper::ext::ReasonPhrase>()
        .map(|r| String::from_utf8_lossy(r.as_bytes()).into_owned())
        .unwrap_or_default();
    let body = serde_json::from_slice(&resp.bytes().await.expect("body")).unwrap_or(Value::Null);
    Raw {
        status,
        reason,
        body,
    }
}

/// path → method → {parameters, returns} of a schema subset.
pub(crate) fn schema(file: &str) -> Value {
    let text = std::fs::read_to_string(crate::paths::data(file)).expect("schema subset");
    serde_json::from_str::<Value>(&text).expect("JSON")["endpoints"].clone()
}

fn kind_ok(declared: &str, v: &Value) -> bool {
    match declared {
        "string" => v.is_string(),
        "integer" => v.is_i64() || v.is_u64(),
        "number" => v.is_number(),
        // PVE sends booleans as 0/1
        "boolean" => v.is_boolean() || v.as_u64().is_some_and(|n| n <= 1),
        "array" => v.is_array(),
        "object" => v.is_object(),
        "null" => v.is_null(),
        _ => true,
    }
}

/// Checks `v` against a `returns` schema; `strict` objects may only hold documented keys
/// (plus `allowed`).
pub(crate) fn check_returns(
    at: &str,
    schema: &Value,
    v: &Value,
    allowed: &[&str],
    problems: &mut Vec<String>,
) {
    if let Some(t) = schema["type"].as_str()
        && !kind_ok(t, v)
    {
        problems.push(format!("{at}: documented {t}, got {v}"));
        return;
    }
    if let (Some(values), Some(s)) = (schema["enum"].as_array(), v.as_str())
        && !values.iter().any(|e| e == s)
    {
        problems.push(format!("{at}: '{s}' not in {values:?}"));
    }
    if let Some(items) = schema.get("items")
        && let Some(arr) = v.as_array()
    {
        for (i, item) in arr.iter().enumerate() {
            check_returns(&format!("{at}[{i}]"), items, item, allowed, problems);
        }
    }
    if let (Some(props), Some(obj)) = (schema["properties"].as_object(), v.as_object()) {
        // only objects whose documentation lists more than an id are held to their keys
        let strict = props.len() > 2;
        for (k, val) in obj {
            match props.get(k) {
                Some(p) => check_returns(&format!("{at}.{k}"), p, val, allowed, problems),
                None if strict && !allowed.contains(&k.as_str()) => {
                    problems.push(format!("{at}.{k}: not documented"))
                }
                None => {}
            }
        }
        for (k, p) in props {
            if p["optional"].as_u64() != Some(1) && !obj.contains_key(k) {
                problems.push(format!("{at}.{k}: documented as always present, missing"));
            }
        }
    }
}

/// Every HA request the simulator logged used only parameters the schema declares, and
/// every answer in `answers` matches the documented `returns`.
fn conforms(sim: &Simulator, file: &str, answers: &[(&str, &str, &Value)]) {
    let api = schema(file);
    let mut problems = Vec::new();
    for r in sim.request_log() {
        let (method, path) = r.endpoint.split_once(' ').expect("METHOD path");
        if !path.starts_with("/cluster/ha") {
            continue;
        }
        let Some(decl) = api[path][method].as_object() else {
            // only the PVE 9 rules are missing from PVE 8, and they answer 501 there
            assert_eq!(r.status, 501, "{method} {path} not in {file}");
            continue;
        };
        for p in &r.params {
            if decl["parameters"].get(p).is_none() {
                problems.push(format!("{method} {path}: parameter '{p}' not declared"));
            }
        }
    }
    for (method, path, answer) in answers {
        let returns = &api[*path][*method]["returns"];
        assert!(returns.is_object(), "{method} {path} in {file}");
        // `errors` (feasibility) is documented only in the viewer's prose
        check_returns(
            &format!("{method} {path}"),
            returns,
            answer,
            &["errors"],
            &mut problems,
        );
    }
    assert!(problems.is_empty(), "{file}:\n{}", problems.join("\n"));
}

fn form<'a>(pairs: &'a [(&'a str, &'a str)]) -> &'a [(&'a str, &'a str)] {
    pairs
}

#[test]
fn every_ha_route_is_in_the_schema_of_the_versions_that_have_it() {
    let (api9, api8) = (schema(API91), schema(API84));
    for (method, path) in SIM_ROUTES
        .iter()
        .filter(|(_, p)| p.starts_with("/cluster/ha"))
    {
        assert!(api9[path][method].is_object(), "9.1: {method} {path}");
        assert!(api8[path][method].is_object(), "8.4: {method} {path}");
    }
    for (method, path) in SIM_ROUTES_PVE9 {
        assert!(api9[path][method].is_object(), "9.1: {method} {path}");
        assert!(api8[path].is_null(), "8.4 has no {path}");
    }
}

#[tokio::test]
async fn pve9_resources_and_rules_follow_the_9_1_schema() {
    let sim = sim("9.1.4").await;
    // resources: VMID shortcut and sid, duplicates, unknown VMs, bad ids, groups refused
    call(&sim, M::POST, "/cluster/ha/resources", &[("sid", "101")])
        .await
        .ok("101");
    for (sid, comment) in [
        ("vm:102", "cp"),
        ("vm:103", "cp"),
        ("104", "w"),
        ("105", "w"),
    ] {
        call(
            &sim,
            M::POST,
            "/cluster/ha/resources",
            form(&[("sid", sid), ("comment", comment), ("max_restart", "2")]),
        )
        .await
        .ok(sid);
    }
    let dup = call(&sim, M::POST, "/cluster/ha/resources", &[("sid", "vm:101")]).await;
    assert_eq!(
        (dup.status, dup.reason.as_str()),
        (
            500,
            "create resource failed: error with cfs lock 'domain-ha': resource ID 'vm:101' already defined"
        )
    );
    let none = call(&sim, M::POST, "/cluster/ha/resources", &[("sid", "999")]).await;
    assert_eq!(
        none.reason,
        "unable to detect SID from VMID - VM/CT 999 does not exist"
    );
    let bad = call(&sim, M::POST, "/cluster/ha/resources", &[("sid", "x y")]).await;
    assert_eq!(bad.status, 400);
    assert_eq!(
        bad.body["errors"]["sid"],
        "invalid format - value does not look like a valid ha resource id\n"
    );
    let group = call(
        &sim,
        M::POST,
        "/cluster/ha/resources",
        &[("sid", "vm:101"), ("group", "zone-a")],
    )
    .await;
    assert_eq!(
        group.reason,
        "invalid parameter 'group': ha groups have been migrated to rules"
    );
    // rules: a zone rule each, anti-affinity for the control plane
    call(
        &sim,
        M::POST,
        "/cluster/ha/rules",
        &[
            ("rule", "zone-a"),
            ("type", "node-affinity"),
            ("resources", "vm:101,vm:102,vm:104"),
            ("nodes", "n1,n2"),
            ("strict", "1"),
        ],
    )
    .await
    .ok("zone-a");
    call(
        &sim,
        M::POST,
        "/cluster/ha/rules",
        &[
            ("rule", "zone-b"),
            ("type", "node-affinity"),
            ("resources", "vm:103,vm:105"),
            ("nodes", "n3,n4"),
            ("strict", "1"),
        ],
    )
    .await
    .ok("zone-b");
    call(
        &sim,
        M::POST,
        "/cluster/ha/rules",
        &[
            ("rule", "cp"),
            ("type", "resource-affinity"),
            ("resources", "vm:101,vm:102,vm:103"),
            ("affinity", "negative"),
        ],
    )
    .await
    .ok("cp");
    // infeasible: vm:104 is already in zone-a
    let twice = call(
        &sim,
        M::POST,
        "/cluster/ha/rules",
        &[
            ("rule", "again"),
            ("type", "node-affinity"),
            ("resources", "vm:104"),
            ("nodes", "n3"),
        ],
    )
    .await;
    assert_eq!(twice.status, 500);
    assert_eq!(
        twice.reason,
        "create ha rule failed: 400 Rule 'again' is invalid."
    );
    assert!(
        twice.body["message"].as_str().is_some_and(|m| m.contains(
            "resources: resource 'vm:104' is already used in another node affinity rule"
        )),
        "{:?}",
        twice.body
    );
    let unmanaged = call(
        &sim,
        M::POST,
        "/cluster/ha/rules",
        &[
            ("rule", "xy"),
            ("type", "resource-affinity"),
            ("resources", "vm:101,vm:999"),
            ("affinity", "positive"),
        ],
    )
    .await;
    assert_eq!(
        unmanaged.reason,
        "create ha rule failed: error with cfs lock 'domain-ha': cannot use unmanaged resource(s) vm:999."
    );
    let missing = call(
        &sim,
        M::POST,
        "/cluster/ha/rules",
        &[
            ("rule", "yy"),
            ("type", "node-affinity"),
            ("resources", "vm:101"),
        ],
    )
    .await;
    assert_eq!(missing.reason, "missing value for required option 'nodes'");
    let groups = call(&sim, M::GET, "/cluster/ha/groups", &[]).await;
    assert_eq!(
        (groups.status, groups.reason.as_str()),
        (
            500,
            "cannot index groups: ha groups have been migrated to rules"
        )
    );
    let create_group = call(
        &sim,
        M::POST,
        "/cluster/ha/groups",
        &[("group", "gg"), ("nodes", "n1")],
    )
    .await;
    assert_eq!(
        create_group.reason,
        "cannot create group: ha groups have been migrated to rules"
    );

    // reads, and optimistic concurrency through `digest`
    let rules = call(&sim, M::GET, "/cluster/ha/rules", &[])
        .await
        .ok("rules");
    let ids: Vec<&str> = rules
        .data()
        .as_array()
        .expect("array")
        .iter()
        .filter_map(|r| r["rule"].as_str())
        .collect();
    assert_eq!(ids, ["zone-a", "zone-b", "cp"], "file order");
    let by_res = call(&sim, M::GET, "/cluster/ha/rules", &[("resource", "vm:105")])
        .await
        .ok("filter");
    assert_eq!(by_res.data().as_array().map(Vec::len), Some(1));
    let rule = call(&sim, M::GET, "/cluster/ha/rules/zone-a", &[])
        .await
        .ok("rule");
    assert_eq!(rule.data()["nodes"], "n1,n2");
    assert_eq!(rule.data()["resources"], "vm:101,vm:102,vm:104");
    assert_eq!(rule.data()["strict"], 1);
    let digest = rule.data()["digest"].as_str().expect("digest").to_string();
    call(
        &sim,
        M::PUT,
        "/cluster/ha/rules/zone-a",
        &[
            ("type", "node-affinity"),
            ("comment", "zone a"),
            ("digest", &digest),
        ],
    )
    .await
    .ok("put rule");
    let stale = call(
        &sim,
        M::PUT,
        "/cluster/ha/rules/zone-a",
        &[
            ("type", "node-affinity"),
            ("comment", "again"),
            ("digest", &digest),
        ],
    )
    .await;
    assert_eq!(
        stale.reason,
        "update HA rules failed: error with cfs lock 'domain-ha': detected modified configuration - file changed by other user? Try again."
    );
    let no_rule = call(&sim, M::GET, "/cluster/ha/rules/nope", &[]).await;
    assert_eq!(no_rule.reason, "no such ha rule 'nope'");
    let resources = call(&sim, M::GET, "/cluster/ha/resources", &[])
        .await
        .ok("list");
    let one = call(&sim, M::GET, "/cluster/ha/resources/101", &[])
        .await
        .ok("one");
    assert_eq!(one.data()["sid"], "vm:101");
    let no_res = call(&sim, M::GET, "/cluster/ha/resources/vm:100", &[]).await;
    assert_eq!(no_res.reason, "no such resource 'vm:100'");
    let status = call(&sim, M::GET, "/cluster/ha/status/current", &[])
        .await
        .ok("status");
    let vm = call(&sim, M::GET, "/nodes/n1/qemu/101/status/current", &[])
        .await
        .ok("vm status");
    assert_eq!(vm.data()["ha"]["managed"], 1);
    assert_eq!(vm.data()["ha"]["state"], "started");
    let cluster = call(&sim, M::GET, "/cluster/resources", &[("type", "vm")])
        .await
        .ok("resources");
    let hastate = |vmid: u64| {
        cluster
            .data()
            .as_array()
            .expect("array")
            .iter()
            .find(|r| r["vmid"] == vmid)
            .map(|r| r["hastate"].clone())
    };
    assert_eq!(hastate(101), Some(Value::from("started")));

    // the typed view
    let typed = sim.ha_rules();
    assert!(matches!(
        &typed[2].kind,
        HaRuleKind::ResourceAffinity {
            affinity: Affinity::Negative
        }
    ));
    assert_eq!(sim.ha_resources().len(), 5);
    assert_eq!(sim.ha_resources()[1].comment.as_deref(), Some("cp"));

    conforms(
        &sim,
        API91,
        &[
            ("GET", "/cluster/ha/rules", rules.data()),
            ("GET", "/cluster/ha/rules/{rule}", rule.data()),
            ("GET", "/cluster/ha/resources", resources.data()),
            ("GET", "/cluster/ha/resources/{sid}", one.data()),
            ("GET", "/cluster/ha/status/current", status.data()),
        ],
    );
}

#[tokio::test]
async fn pve9_node_failure_moves_vms_only_within_their_zone_and_apart() {
    let sim = sim("9.1.4").await;
    for sid in ["101", "102", "103", "104", "105"] {
        call(&sim, M::POST, "/cluster/ha/resources", &[("sid", sid)])
            .await
            .ok(sid);
    }
    for (rule, res, nodes) in [
        ("zone-a", "vm:101,vm:102,vm:104", "n1,n2"),
        ("zone-b", "vm:103,vm:105", "n3,n4"),
    ] {
        call(
            &sim,
            M::POST,
            "/cluster/ha/rules",
            &[
                ("rule", rule),
                ("type", "node-affinity"),
                ("resources", res),
                ("nodes", nodes),
                ("strict", "1"),
            ],
        )
        .await
        .ok(rule);
    }
    call(
        &sim,
        M::POST,
        "/cluster/ha/rules",
        &[
            ("rule", "cp"),
            ("type", "resource-affinity"),
            ("resources", "vm:101,vm:102,vm:103"),
            ("affinity", "negative"),
        ],
    )
    .await
    .ok("cp");
    let zone_a = ["n1", "n2"];
    let moves = sim.fail_node("n1");
    // the worker stays in zone a; cp1 has no node there that does not run a control plane
    let w1 = moves.iter().find(|m| m.vmid == 104).expect("w1 moved");
    assert_eq!(w1.to.as_deref(), Some("n2"));
    let cp1 = moves.iter().find(|m| m.vmid == 101).expect("cp1 reported");
    assert_eq!((cp1.to.as_deref(), cp1.state.as_str()), (None, "recovery"));
    for m in &moves {
        assert!(m.to.as_deref().is_none_or(|n| zone_a.contains(&n)), "{m:?}");
    }
    // the API sees it: w1 runs on n2, cp1 is unknown on the dead node
    let cluster = call(&sim, M::GET, "/cluster/resources", &[("type", "vm")])
        .await
        .ok("resources");
    let entry = |vmid: u64| {
        cluster
            .data()
            .as_array()
            .expect("array")
            .iter()
            .find(|r| r["vmid"] == vmid)
            .cloned()
            .expect("listed")
    };
    assert_eq!(entry(104)["node"], "n2");
    assert_eq!(entry(104)["status"], "running");
    assert_eq!(entry(101)["node"], "n1");
    assert_eq!(entry(101)["status"], "unknown");
    assert_eq!(entry(101)["hastate"], "recovery");
    let dead = call(&sim, M::GET, "/nodes/n1/qemu/101/status/current", &[]).await;
    assert_eq!(dead.status, 595);
    call(&sim, M::GET, "/nodes/n2/qemu/104/status/current", &[])
        .await
        .ok("w1 on n2");
    // n1 returns: cp1 is recovered there
    let back = sim.revive_node("n1");
    assert!(
        back.iter()
            .any(|m| m.vmid == 101 && m.to.as_deref() == Some("n1")),
        "{back:?}"
    );
    assert_eq!(sim.ha_state(101).as_deref(), Some("started"));
    conforms(&sim, API91, &[]);
}

#[tokio::test]
async fn pve9_destroy_needs_purge_and_purge_drops_rule_references() {
    let sim = sim("9.1.4").await;
    for sid in ["101", "102", "103"] {
        call(&sim, M::POST, "/cluster/ha/resources", &[("sid", sid)])
            .await
            .ok(sid);
    }
    call(
        &sim,
        M::POST,
        "/cluster/ha/rules",
        &[
            ("rule", "cp"),
            ("type", "resource-affinity"),
            ("resources", "vm:101,vm:102,vm:103"),
            ("affinity", "negative"),
        ],
    )
    .await
    .ok("cp");
    // a stop becomes the HA request "stopped"
    call(&sim, M::POST, "/nodes/n1/qemu/101/status/stop", &[])
        .await
        .ok("stop");
    assert_eq!(sim.ha_resources()[0].requested_state(), "stopped");
    assert_eq!(sim.ha_state(101).as_deref(), Some("stopped"));
    let refused = call(&sim, M::DELETE, "/nodes/n1/qemu/101", &[]).await;
    assert_eq!(
        (refused.status, refused.reason.as_str()),
        (
            500,
            "unable to remove VM 101 - used in HA resources and purge parameter not set."
        )
    );
    call(&sim, M::DELETE, "/nodes/n1/qemu/101", &[("purge", "1")])
        .await
        .ok("destroy with purge");
    // the next request sees the finished task
    let rules = call(&sim, M::GET, "/cluster/ha/rules", &[])
        .await
        .ok("rules");
    assert_eq!(rules.data()[0]["resources"], "vm:102,vm:103");
    assert!(sim.ha_state(101).is_none());
    // purge=0 keeps the references (and the rule now has an unmanaged member)
    call(
        &sim,
        M::DELETE,
        "/cluster/ha/resources/vm:102",
        &[("purge", "0")],
    )
    .await
    .ok("delete without purge");
    assert_eq!(
        sim.ha_rules()[0]
            .resources
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
        ["vm:102", "vm:103"]
    );
    // the default purges: the last member leaves and so does the rule
    call(&sim, M::DELETE, "/cluster/ha/resources/103", &[])
        .await
        .ok("delete");
    assert_eq!(
        sim.ha_rules()[0]
            .resources
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
        ["vm:102"]
    );
    let gone = call(&sim, M::DELETE, "/cluster/ha/resources/vm:103", &[]).await;
    assert_eq!(
        gone.reason,
        "cannot delete service 'vm:103', not HA managed!"
    );
    conforms(&sim, API91, &[("GET", "/cluster/ha/rules", rules.data())]);
}

#[tokio::test]
async fn pve8_groups_restrict_recovery_and_rules_do_not_exist() {
    let sim = sim("8.4.14").await;
    let rules = call(&sim, M::GET, "/cluster/ha/rules", &[]).await;
    assert_eq!(
        (rules.status, rules.reason.as_str()),
        (501, "Method 'GET /cluster/ha/rules' not implemented")
    );
    for (group, nodes) in [("zone-a", "n1:2,n2"), ("zone-b", "n3,n4")] {
        call(
            &sim,
            M::POST,
            "/cluster/ha/groups",
            &[("group", group), ("nodes", nodes), ("restricted", "1")],
        )
        .await
        .ok(group);
    }
    let dup = call(
        &sim,
        M::POST,
        "/cluster/ha/groups",
        &[("group", "zone-a"), ("nodes", "n1")],
    )
    .await;
    assert_eq!(
        dup.reason,
        "create ha group failed: error with cfs lock 'domain-ha': ha group ID 'zone-a' already defined"
    );
    let bad = call(
        &sim,
        M::POST,
        "/cluster/ha/groups",
        &[("group", "g"), ("nodes", "-n1")],
    )
    .await;
    assert_eq!(bad.status, 400, "{:?}", bad.body);
    for (sid, group) in [("101", "zone-a"), ("104", "zone-a"), ("103", "zone-b")] {
        call(
            &sim,
            M::POST,
            "/cluster/ha/resources",
            &[("sid", sid), ("group", group)],
        )
        .await
        .ok(sid);
    }
    let failback = call(
        &sim,
        M::POST,
        "/cluster/ha/resources",
        &[("sid", "105"), ("failback", "1")],
    )
    .await;
    assert_eq!(failback.status, 400, "PVE 8 has no failback");
    let used = call(&sim, M::DELETE, "/cluster/ha/groups/zone-b", &[]).await;
    assert_eq!(
        used.reason,
        "delete ha group failed: error with cfs lock 'domain-ha': ha group is used by service 'vm:103'"
    );
    let groups = call(&sim, M::GET, "/cluster/ha/groups", &[])
        .await
        .ok("groups");
    let group = call(&sim, M::GET, "/cluster/ha/groups/zone-a", &[])
        .await
        .ok("group");
    assert_eq!(group.data()["nodes"], "n1:2,n2");
    assert_eq!(group.data()["restricted"], 1);
    let digest = group.data()["digest"].as_str().expect("digest").to_string();
    call(
        &sim,
        M::PUT,
        "/cluster/ha/groups/zone-a",
        &[("comment", "zone a"), ("digest", &digest)],
    )
    .await
    .ok("put group");
    let one = call(&sim, M::GET, "/cluster/ha/resources/vm:101", &[])
        .await
        .ok("one");
    assert_eq!(one.data()["group"], "zone-a");
    let resources = call(&sim, M::GET, "/cluster/ha/resources", &[])
        .await
        .ok("list");
    // n1 (priority 2) dies: both zone-a VMs go to n2, never to zone b
    let moves = sim.fail_node("n1");
    assert_eq!(moves.len(), 2, "{moves:?}");
    assert!(
        moves.iter().all(|m| m.to.as_deref() == Some("n2")),
        "{moves:?}"
    );
    // n2 dies too: restricted, so they wait
    let moves = sim.fail_node("n2");
    assert!(
        moves
            .iter()
            .all(|m| m.to.is_none() && m.state == "recovery"),
        "{moves:?}"
    );
    // n1 is back: recovered there
    let moves = sim.revive_node("n1");
    assert!(
        moves.iter().all(|m| m.to.as_deref() == Some("n1")),
        "{moves:?}"
    );
    assert_eq!(sim.ha_groups().len(), 2);
    let status = call(&sim, M::GET, "/cluster/ha/status/current", &[])
        .await
        .ok("status");
    let purge = call(
        &sim,
        M::DELETE,
        "/cluster/ha/resources/101",
        &[("purge", "1")],
    )
    .await;
    assert_eq!(purge.status, 400, "PVE 8 has no purge on HA resources");
    call(&sim, M::DELETE, "/cluster/ha/resources/101", &[])
        .await
        .ok("delete");
    // drop the 400s' undeclared parameters from the wire check: they were refused
    let log_ok = |p: &str| p != "failback" && p != "purge";
    assert!(
        sim.request_log()
            .iter()
            .filter(|r| r.status == 200)
            .all(|r| r.params.iter().all(|p| log_ok(p))),
    );
    conforms_ok_only(
        &sim,
        API84,
        &[
            ("GET", "/cluster/ha/groups", groups.data()),
            ("GET", "/cluster/ha/groups/{group}", group.data()),
            ("GET", "/cluster/ha/resources", resources.data()),
            ("GET", "/cluster/ha/resources/{sid}", one.data()),
            ("GET", "/cluster/ha/status/current", status.data()),
        ],
    );
}

/// [`conforms`] for the answers, and for the parameters of the requests that succeeded
/// (a PVE 8 test sends PVE 9 parameters on purpose to see them refused).
fn conforms_ok_only(sim: &Simulator, file: &str, answers: &[(&str, &str, &Value)]) {
    let api = schema(file);
    let mut problems = Vec::new();
    for r in sim.request_log().iter().filter(|r| r.status == 200) {
        let (method, path) = r.endpoint.split_once(' ').expect("METHOD path");
        if !path.starts_with("/cluster/ha") {
            continue;
        }
        let decl = &api[path][method];
        assert!(decl.is_object(), "{method} {path} not in {file}");
        for p in &r.params {
            if decl["parameters"].get(p).is_none() {
                problems.push(format!("{method} {path}: parameter '{p}' not declared"));
            }
        }
    }
    for (method, path, answer) in answers {
        check_returns(
            &format!("{method} {path}"),
            &api[*path][*method]["returns"],
            answer,
            &["errors"],
            &mut problems,
        );
    }
    assert!(problems.is_empty(), "{file}:\n{}", problems.join("\n"));
}

#[test]
fn check_returns_finds_type_enum_and_key_problems() {
    let schema = serde_json::json!({"type": "array", "items": {"type": "object", "properties": {
        "id": {"type": "string"}, "type": {"enum": ["a", "b"]}, "n": {"type": "integer", "optional": 1}}}});
    let mut p = Vec::new();
    check_returns(
        "t",
        &schema,
        &serde_json::json!([{"id": "x", "type": "a", "n": 1}]),
        &[],
        &mut p,
    );
    assert!(p.is_empty(), "{p:?}");
    check_returns(
        "t",
        &schema,
        &serde_json::json!([{"type": "c", "n": "1", "extra": 0}]),
        &[],
        &mut p,
    );
    assert_eq!(p.len(), 4, "{p:?}");
}

/// capmox's client for `sim`.
fn client_for(sim: &Simulator) -> capmox::proxmox::ProxmoxClient {
    use capmox::proxmox::{ApiToken, ClientConfig, ProxmoxClient};
    let cfg = ClientConfig::new(sim.url(), ApiToken::parse(&sim.token()).expect("token"));
    ProxmoxClient::new(&cfg).expect("client")
}

/// The UPIDs of the `qmigrate` tasks so far, oldest first.
fn migrations(sim: &Simulator) -> Vec<capmox::proxmox::Upid> {
    sim.task_records()
        .into_iter()
        .filter(|r| r.kind == "qmigrate")
        .map(|r| r.upid.parse().expect("UPID"))
        .collect()
}

#[tokio::test]
async fn pve9_ha_migrate_moves_a_running_vm_through_the_client() {
    use capmox::proxmox::{HaMigration, WaitOptions};
    let sim = sim("9.1.4").await;
    for sid in ["101", "102", "103", "104"] {
        call(&sim, M::POST, "/cluster/ha/resources", &[("sid", sid)])
            .await
            .ok(sid);
    }
    let client = client_for(&sim);
    let answer = client.ha_migrate("vm:101", "n2").await.expect("queued");
    assert_eq!(
        answer,
        HaMigration {
            sid: Some("vm:101".into()),
            requested_node: Some("n2".into()),
            ..HaMigration::default()
        }
    );
    // the request queues a migration; its qmigrate task on the source node tells the end
    let upid = migrations(&sim).pop().expect("a qmigrate task");
    assert_eq!((upid.node.as_str(), upid.id.as_str()), ("n1", "101"));
    let waits = WaitOptions {
        initial_interval: Duration::from_millis(10),
        factor: 1.5,
        max_interval: Duration::from_millis(100),
        deadline: Duration::from_secs(10),
    };
    client.wait_task(&upid, &waits).await.expect("qmigrate");
    let vm = client
        .find_vm(101)
        .await
        .expect("resources")
        .expect("VM 101");
    assert_eq!(vm.node.as_deref(), Some("n2"));
    assert_eq!(sim.vm_node(101).as_deref(), Some("n2"));
    assert!(
        client
            .list_vms("n2")
            .await
            .expect("n2")
            .iter()
            .any(|v| v.vmid == 101)
    );
    assert!(
        client
            .vm_status("n2", 101)
            .await
            .expect("status")
            .is_running()
    );
    assert_eq!(sim.boots(101), Some(1), "live: no boot");
    assert_eq!(sim.ha_state(101).as_deref(), Some("started"));

    // a VM that is not HA-managed: refused at once
    let err = client.ha_migrate("vm:105", "n4").await.expect_err("not HA");
    assert_eq!(
        err.reason(),
        Some("resource 'vm:105' is not HA managed"),
        "{err:?}"
    );
    // an offline target: accepted, then dropped by the CRM; the VM stays
    sim.with_cluster(|c| c.set_node_online("n4", false));
    client.ha_migrate("104", "n4").await.expect("accepted");
    assert_eq!(migrations(&sim).len(), 1, "no new task");
    assert_eq!(sim.vm_node(104).as_deref(), Some("n1"));
    assert!(
        sim.ha_crm_log()
            .contains(&"crm command error - node not online: migrate vm:104 n4".to_string())
    );
    // the raw answer as the 9.1 schema documents it
    let raw = call(
        &sim,
        M::POST,
        "/cluster/ha/resources/vm:102/migrate",
        &[("node", "n3")],
    )
    .await
    .ok("migrate 102");
    conforms(
        &sim,
        API91,
        &[("POST", "/cluster/ha/resources/{sid}/migrate", raw.data())],
    );
}

#[tokio::test]
async fn pve8_ha_migrate_answers_null_and_moves_a_stopped_vm() {
    use capmox::proxmox::HaMigration;
    let sim = sim("8.4.14").await;
    call(
        &sim,
        M::POST,
        "/cluster/ha/resources",
        &[("sid", "105"), ("state", "stopped")],
    )
    .await
    .ok("105");
    let client = client_for(&sim);
    // the CRM shuts VM 105 down first (a task that ends at once here)
    let status = client.vm_status("n3", 105).await.expect("status");
    assert!(!status.is_running());
    let answer = client.ha_migrate("105", "n4").await.expect("queued");
    assert_eq!(answer, HaMigration::default());
    let raw = call(
        &sim,
        M::POST,
        "/cluster/ha/resources/105/migrate",
        &[("node", "n4")],
    )
    .await
    .ok("again");
    assert_eq!(*raw.data(), Value::Null);
    assert_eq!(sim.vm_node(105).as_deref(), Some("n4"));
    let status = client.vm_status("n4", 105).await.expect("status on n4");
    assert!(!status.is_running());
    conforms(
        &sim,
        API84,
        &[("POST", "/cluster/ha/resources/{sid}/migrate", raw.data())],
    );
}
