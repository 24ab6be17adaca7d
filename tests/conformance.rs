//! Conformance with the official API schema: every (method, path) the client calls and
//! every route the simulator serves exists in `apidata.json` (PVE 9.1) with that method,
//! and every parameter the client sends is declared there with a compatible type.
//! The same check is reported against PVE 8.4 (`pve8/apidata.json`).

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use capmox::proxmox::*;
use capmox::sim::{SIM_ROUTES, SimOptions, Simulator, Topology};
use serde_json::Value;

const API91: &str = "../shared/pve-api/apidata.json";
const API84: &str = "../shared/pve-api/pve8/apidata.json";

/// path → method → properties
type Schema = BTreeMap<String, BTreeMap<String, serde_json::Map<String, Value>>>;

fn load(path: &str) -> Option<Schema> {
    let text = std::fs::read_to_string(Path::new(path)).ok()?;
    let tree: Value = serde_json::from_str(&text).expect("apidata.json is JSON");
    let mut out = Schema::new();
    fn walk(nodes: &Value, out: &mut Schema) {
        for n in nodes.as_array().into_iter().flatten() {
            let path = n["path"].as_str().unwrap_or_default().to_string();
            if let Some(info) = n["info"].as_object() {
                for (method, m) in info {
                    let props = m["parameters"]["properties"]
                        .as_object()
                        .cloned()
                        .unwrap_or_default();
                    out.entry(path.clone())
                        .or_default()
                        .insert(method.clone(), props);
                }
            }
            walk(&n["children"], out);
        }
    }
    walk(&tree, &mut out);
    Some(out)
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
fn check(schema: &Schema, extra_params: &BTreeMap<(String, String), Vec<String>>) -> Vec<String> {
    let mut problems = Vec::new();
    for (method, path, params) in CLIENT_ENDPOINTS {
        let Some(props) = schema.get(*path).and_then(|m| m.get(*method)) else {
            problems.push(format!("client: {method} {path} is not in the schema"));
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
            problems.push(format!("simulator: {method} {path} is not in the schema"));
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
            capmox::sim::iso::build_iso("cidata", &[]),
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
    let Some(schema) = load(API91) else {
        println!("SKIP: {API91} not found; conformance test not run");
        return;
    };
    let wire = wire_params().await;
    assert!(
        wire.len() >= 15,
        "representative calls made: {}",
        wire.len()
    );
    let problems = check(&schema, &wire);
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
    let Some(schema) = load(API84) else {
        println!("SKIP: {API84} not found; PVE 8.4 report not produced");
        return;
    };
    let wire = wire_params().await;
    let problems = check(&schema, &wire);
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
    let Some(schema) = load(API91) else {
        println!("SKIP: {API91} not found");
        return;
    };
    let props = &schema["/nodes/{node}/qemu/{vmid}/config"]["POST"];
    assert!(param(props, "net0").is_some());
    assert!(param(props, "scsi12").is_some());
    assert!(param(props, "bogus0").is_none());
    assert!(!schema.contains_key("/nodes/{node}/qemu/{vmid}/nonsense"));
}
