//! Conformance with the official API schema: every (method, path) the client calls and
//! every route the simulator serves exists in `apidata.json` (PVE 9.1) with that method,
//! and every parameter the client sends is declared there with a compatible type.
//! The same check is reported against PVE 8.4 (`pve8/apidata.json`). Both files are the
//! subsets in `tests/data/pve-api/` that `subset.py` cuts for the endpoints in `endpoints.txt`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::Duration;

use capmox::proxmox::*;
use capmox_sim::{SIM_ROUTES, SIM_ROUTES_PVE9, SimOptions, Simulator, Topology};
use serde_json::Value;

const API91: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/data/pve-api/apidata.json"
);
const API84: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/data/pve-api/pve8/apidata.json"
);
const ENDPOINTS: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/data/pve-api/endpoints.txt"
);

/// path → method → properties
type Schema = BTreeMap<String, BTreeMap<String, serde_json::Map<String, Value>>>;

/// Reads a schema subset written by `tests/data/pve-api/subset.py`.
fn load(path: &str) -> Schema {
    let text = std::fs::read_to_string(Path::new(path))
        .unwrap_or_else(|e| panic!("cannot read {path} (part of the repository): {e}"));
    let subset: Value = serde_json::from_str(&text).expect("the schema subset is JSON");
    let endpoints = subset["endpoints"]
        .as_object()
        .unwrap_or_else(|| panic!("{path} has no `endpoints` object"));
    let mut out = Schema::new();
    for (path, methods) in endpoints {
        for (method, m) in methods.as_object().into_iter().flatten() {
            let props = m["parameters"].as_object().cloned().unwrap_or_default();
            out.entry(path.clone())
                .or_default()
                .insert(method.clone(), props);
        }
    }
    out
}

/// The `METHOD /path` lines of `endpoints.txt`, the list the subsets were cut for.
fn listed_endpoints() -> BTreeSet<(String, String)> {
    std::fs::read_to_string(ENDPOINTS)
        .unwrap_or_else(|e| panic!("cannot read {ENDPOINTS}: {e}"))
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| {
            let (method, path) = l.split_once(' ').expect("`METHOD /path`");
            (method.to_owned(), path.trim().to_owned())
        })
        .collect()
}

/// Looks a parameter up, mapping `net0` to the schema's `net[n]`.
fn param<'a>(props: &'a serde_json::Map<String, Value>, name: &str) -> Option<&'a Value> {
    props.get(name).or_else(|| {
        let base = name.trim_end_matches(|c: char| c.is_ascii_digit());
        (base.len() < name.len())
            .then(|| props.get(&format!("{base}[n]")))
            .flatten()
    })
}

/// Problems of the client's and simulator's endpoints against one schema.
fn check(
    schema: &Schema,
    extra_params: &BTreeMap<(String, String), Vec<String>>,
    pve9: bool,
) -> Vec<String> {
    let mut problems = Vec::new();
    let pve9_endpoints: &[(&str, &str, &[&str])] = if pve9 { CLIENT_ENDPOINTS_PVE9 } else { &[] };
    for (method, path, params) in CLIENT_ENDPOINTS.iter().chain(pve9_endpoints) {
        let Some(props) = schema.get(*path).and_then(|m| m.get(*method)) else {
            problems.push(format!(
                "client: {method} {path} is not in the schema (new endpoints go into \
                 tests/data/pve-api/endpoints.txt, then rerun subset.py)"
            ));
            continue;
        };
        for p in *params {
            let (name, ty) = p.split_once(':').expect("name:type");
            match param(props, name) {
                None => problems.push(format!(
                    "client: {method} {path}: parameter '{name}' not declared"
                )),
                Some(decl) => {
                    let declared = decl["type"].as_str().unwrap_or_default();
                    if declared != ty {
                        problems.push(format!(
                            "client: {method} {path}: '{name}' sent as {ty}, schema says {declared}"
                        ));
                    }
                }
            }
        }
    }
    for (method, path) in SIM_ROUTES {
        if schema.get(*path).and_then(|m| m.get(*method)).is_none() {
            problems.push(format!(
                "simulator: {method} {path} is not in the schema (new endpoints go into \
                 tests/data/pve-api/endpoints.txt, then rerun subset.py)"
            ));
        }
    }
    // parameters actually seen on the wire (from the simulator's request log)
    for ((method, path), names) in extra_params {
        let Some(props) = schema.get(path).and_then(|m| m.get(method)) else {
            problems.push(format!("wire: {method} {path} is not in the schema"));
            continue;
        };
        for n in names {
            if param(props, n).is_none() {
                problems.push(format!(
                    "wire: {method} {path}: parameter '{n}' not declared"
                ));
            }
        }
    }
    problems
}

/// Drives a representative set of client calls against the simulator and returns the
/// parameter names seen per (method, path template).
async fn wire_params() -> BTreeMap<(String, String), Vec<String>> {
    let sim = Simulator::start(Topology::example(), SimOptions::default())
        .await
        .expect("simulator");
    let client = ProxmoxClient::new(&ClientConfig::new(
        sim.url(),
        ApiToken::parse(&sim.token()).expect("token"),
    ))
    .expect("client");
    let wait = WaitOptions {
        initial_interval: Duration::from_millis(20),
        factor: 1.5,
        max_interval: Duration::from_millis(100),
        deadline: Duration::from_secs(10),
    };
    client
        .cluster_resources(Some(ResourceFilter::Vm))
        .await
        .expect("resources");
    client.next_id(Some(100)).await.expect("nextid");
    client.pci_mappings().await.expect("PCI mappings");
    client.node_pci_devices("pve1").await.expect("PCI devices");
    client
        .list_storage("pve1", Some("iso"))
        .await
        .expect("storage");
    client
        .storage_content("pve1", "local", Some("iso"), Some(100))
        .await
        .expect("content");
    let up = client
        .clone_vm(
            "pve1",
            9000,
            &CloneParams {
                newid: 100,
                name: Some("m1".into()),
                description: Some("d".into()),
                full: Some(true),
                storage: Some("local-lvm".into()),
                format: Some("raw".into()),
                pool: Some("capi".into()),
                ..Default::default()
            },
        )
        .await
        .expect("clone");
    client.wait_task(&up, &wait).await.expect("clone task");
    client.task_log(&up, 0, 10).await.expect("log");
    let cfg = client.vm_config("pve1", 100).await.expect("config");
    let t = client
        .update_vm_config(
            "pve1",
            100,
            &ConfigUpdate::default()
                .set("cores", 2)
                .set("memory", 2048)
                .set("ipconfig0", "ip=10.0.0.5/24,gw=10.0.0.1")
                .delete("description")
                .digest(cfg.digest()),
        )
        .await
        .expect("config");
    client.wait_task_ref(&t, &wait).await.expect("config task");
    let t = client
        .resize_disk("pve1", 100, "scsi0", "+1G", None)
        .await
        .expect("resize");
    client.wait_task_ref(&t, &wait).await.expect("resize task");
    let t = client
        .upload_iso(
            "pve1",
            "local",
            "seed.iso",
            capmox_sim::iso::build_iso("cidata", &[]),
        )
        .await
        .expect("upload");
    client.wait_task_ref(&t, &wait).await.expect("upload task");
    let t = client
        .power("pve1", 100, PowerAction::Start)
        .await
        .expect("start");
    client.wait_task_ref(&t, &wait).await.expect("start task");
    let _ = client
        .shutdown_vm("pve1", 100, Some(30), true)
        .await
        .expect("shutdown");
    let _ = client
        .agent_exec("pve1", 100, &["cloud-init", "status"], Some(""))
        .await;
    let _ = client.agent_exec_status("pve1", 100, 1).await;
    client
        .update_pool_vms("capi", &[100], true)
        .await
        .expect("pool");
    client
        .create_pool("other", Some("c"))
        .await
        .expect("pool create");
    let _ = client.get_pool("capi").await.expect("pool get");

    let mut out: BTreeMap<(String, String), Vec<String>> = BTreeMap::new();
    for r in sim.request_log() {
        let (method, path) = r.endpoint.split_once(' ').expect("METHOD path");
        let e = out
            .entry((method.to_string(), path.to_string()))
            .or_default();
        e.extend(r.params.iter().cloned());
        e.sort();
        e.dedup();
    }
    out
}

#[tokio::test]
async fn client_and_simulator_conform_to_pve_9_1_schema() {
    let schema = load(API91);
    let wire = wire_params().await;
    assert!(
        wire.len() >= 15,
        "representative calls made: {}",
        wire.len()
    );
    let problems = check(&schema, &wire, true);
    assert!(
        problems.is_empty(),
        "PVE 9.1 schema mismatches:\n{}",
        problems.join("\n")
    );
    println!(
        "PVE 9.1: {} client endpoints, {} simulator routes, {} wire endpoints conform",
        CLIENT_ENDPOINTS.len(),
        SIM_ROUTES.len(),
        wire.len()
    );
}

#[tokio::test]
async fn report_against_pve_8_4_schema() {
    let schema = load(API84);
    let wire = wire_params().await;
    let problems = check(&schema, &wire, false);
    if problems.is_empty() {
        println!("PVE 8.4: client and simulator conform as well");
    } else {
        println!("PVE 8.4 differences:\n{}", problems.join("\n"));
    }
    // Everything capmox calls must exist on 8.4 too (it supports PVE 8 and 9).
    assert!(
        problems.is_empty(),
        "PVE 8.4 schema mismatches:\n{}",
        problems.join("\n")
    );
}

#[test]
fn schema_loader_finds_known_entries() {
    let schema = load(API91);
    let props = &schema["/nodes/{node}/qemu/{vmid}/config"]["POST"];
    assert!(param(props, "net0").is_some());
    assert!(param(props, "scsi12").is_some());
    assert!(param(props, "bogus0").is_none());
    assert!(!schema.contains_key("/nodes/{node}/qemu/{vmid}/nonsense"));
}

#[test]
fn the_schema_subsets_hold_exactly_the_endpoints_capmox_uses() {
    let used: BTreeSet<(String, String)> = CLIENT_ENDPOINTS
        .iter()
        .chain(CLIENT_ENDPOINTS_PVE9)
        .map(|(method, path, _)| (*method, *path))
        .chain(SIM_ROUTES.iter().copied())
        .chain(SIM_ROUTES_PVE9.iter().copied())
        .map(|(method, path)| (method.to_owned(), path.to_owned()))
        .collect();
    let listed = listed_endpoints();
    // PVE 8.4 has no HA rules: its subset holds the other endpoints.
    let pve9_only: BTreeSet<(String, String)> = SIM_ROUTES_PVE9
        .iter()
        .map(|(method, path)| ((*method).to_owned(), (*path).to_owned()))
        .collect();
    assert_eq!(
        listed, used,
        "tests/data/pve-api/endpoints.txt must list exactly the client's and simulator's \
         endpoints; fix it and rerun subset.py for both schema versions"
    );
    for file in [API91, API84] {
        let cut: BTreeSet<(String, String)> = load(file)
            .into_iter()
            .flat_map(|(path, methods)| methods.into_keys().map(move |m| (m, path.clone())))
            .collect();
        let expected: BTreeSet<(String, String)> = if file == API84 {
            listed.difference(&pve9_only).cloned().collect()
        } else {
            listed.clone()
        };
        assert_eq!(
            cut, expected,
            "{file} was not cut for endpoints.txt: rerun subset.py"
        );
    }
}
