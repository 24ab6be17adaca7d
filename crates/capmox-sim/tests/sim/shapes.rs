//! The simulator answers the fixtures' requests with the same JSON shape: for every key
//! both have, the value type matches; keys the simulator adds must be documented fields;
//! error responses use the same status, reason phrase and body keys.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use capmox::proxmox::*;
use capmox_sim::{SimOptions, Simulator, Topology};
use serde_json::Value;

/// The recorded Proxmox answers under `tests/data/`.
fn fixtures() -> std::path::PathBuf {
    crate::paths::data("pve-fixtures")
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "bool",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// Known, documented differences: (key, why).
const TYPE_EXCEPTIONS: &[(&str, &str)] = &[
    // qemu-server ≥ 8.0.8 (PVE 8.1+): memory is a property string, GET returns a string
    (
        "memory",
        "string since PVE 8.1; the fixture is older/hand-written",
    ),
    // the hand-written go-proxmox mock uses a JSON bool; PVE turns agent booleans into 0/1
    ("out-truncated", "PVE sends 0/1"),
];

/// Compares shapes; returns problems. `allowed_extra` lists keys the simulator may add.
fn compare(
    path: &str,
    fixture: &Value,
    sim: &Value,
    allowed_extra: &[&str],
    problems: &mut Vec<String>,
) {
    match (fixture, sim) {
        (Value::Object(f), Value::Object(s)) => {
            for (k, sv) in s {
                match f.get(k) {
                    Some(fv) => {
                        let exception = TYPE_EXCEPTIONS.iter().any(|(key, _)| key == k);
                        if kind(fv) != kind(sv) && !exception && !fv.is_null() && !sv.is_null() {
                            problems.push(format!(
                                "{path}.{k}: fixture {} vs simulator {}",
                                kind(fv),
                                kind(sv)
                            ));
                        } else if kind(fv) == kind(sv) {
                            compare(&format!("{path}.{k}"), fv, sv, allowed_extra, problems);
                        }
                    }
                    None if allowed_extra.contains(&k.as_str()) => {}
                    None => problems.push(format!("{path}.{k}: key not in the fixture")),
                }
            }
        }
        (Value::Array(f), Value::Array(s)) => {
            // group objects by their `type` discriminator when present
            let group = |items: &Vec<Value>| {
                let mut g: BTreeMap<String, Vec<Value>> = BTreeMap::new();
                for i in items {
                    let t = i
                        .get("type")
                        .and_then(Value::as_str)
                        .unwrap_or("")
                        .to_string();
                    g.entry(t).or_default().push(i.clone());
                }
                g
            };
            let (fg, sg) = (group(f), group(s));
            for (t, sitems) in &sg {
                let Some(fitems) = fg.get(t) else {
                    continue;
                };
                // merge all fixture entries of this type into one key → value map
                let mut merged = serde_json::Map::new();
                for fi in fitems {
                    if let Value::Object(o) = fi {
                        for (k, v) in o {
                            merged.entry(k.clone()).or_insert(v.clone());
                        }
                    } else {
                        merged.insert("__scalar".into(), fi.clone());
                    }
                }
                for si in sitems {
                    if si.is_object() {
                        compare(
                            &format!("{path}[{t}]"),
                            &Value::Object(merged.clone()),
                            si,
                            allowed_extra,
                            problems,
                        );
                    } else if let Some(fv) = merged.get("__scalar")
                        && kind(fv) != kind(si)
                    {
                        problems.push(format!(
                            "{path}[]: fixture {} vs simulator {}",
                            kind(fv),
                            kind(si)
                        ));
                    }
                }
            }
        }
        _ => {
            if kind(fixture) != kind(sim) && !fixture.is_null() {
                problems.push(format!(
                    "{path}: fixture {} vs simulator {}",
                    kind(fixture),
                    kind(sim)
                ));
            }
        }
    }
}

struct Raw {
    status: u16,
    reason: Option<String>,
    body: Value,
}

async fn raw(sim: &Simulator, method: reqwest::Method, path: &str, form: &[(&str, &str)]) -> Raw {
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
        .request(method, format!("{}/api2/json{path}", sim.url()))
        .header("Authorization", format!("PVEAPIToken={}", sim.token()));
    if !form.is_empty() {
        req = req.form(form);
    }
    let resp = req.send().await.expect("request");
    let status = resp.status().as_u16();
    let reason = resp
        .extensions()
        .get::<hyper::ext::ReasonPhrase>()
        .map(|r| String::from_utf8_lossy(r.as_bytes()).into_owned());
    let bytes = resp.bytes().await.expect("body");
    let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    Raw {
        status,
        reason,
        body,
    }
}

fn fixture(file: &str) -> Value {
    let text = std::fs::read_to_string(fixtures().join(file)).expect("fixture file");
    serde_json::from_str(&text).expect("fixture JSON")
}

#[tokio::test]
async fn simulator_matches_fixture_shapes() {
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
    // a running guest with a config, a finished clone task and an ISO volume
    let clone_upid = client
        .clone_vm(
            "pve1",
            9000,
            &CloneParams {
                newid: 100,
                full: Some(true),
                ..Default::default()
            },
        )
        .await
        .expect("clone");
    client
        .wait_task(&clone_upid, &wait)
        .await
        .expect("clone task");
    let t = client
        .upload_iso(
            "pve1",
            "local",
            "seed.iso",
            capmox_sim::iso::build_iso("cidata", &[]),
        )
        .await
        .expect("upload");
    client.wait_task_ref(&t, &wait).await.expect("upload");
    let t = client
        .power("pve1", 100, PowerAction::Start)
        .await
        .expect("start");
    client.wait_task_ref(&t, &wait).await.expect("start task");
    let booted = tokio::time::Instant::now() + Duration::from_secs(10);
    while client.agent_ping("pve1", 100).await.is_err() {
        assert!(tokio::time::Instant::now() < booted, "guest never booted");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let exec_pid = client
        .agent_exec("pve1", 100, &["cloud-init", "status"], None)
        .await
        .expect("exec");
    let _first = client
        .agent_exec_status("pve1", 100, exec_pid)
        .await
        .expect("exec-status");

    use reqwest::Method as M;
    let upid = clone_upid.to_string();
    let exec_status_path = format!("/nodes/pve1/qemu/100/agent/exec-status?pid={exec_pid}");
    let task_status_path = format!("/nodes/pve1/tasks/{upid}/status");
    let task_log_path = format!("/nodes/pve1/tasks/{upid}/log");
    // (fixture, method, path, extra keys the simulator may add that real PVE documents)
    let cases: Vec<(&str, M, &str, &[&str])> = vec![
        (
            "recorded/fog-pve6.2/GET_version.json",
            M::GET,
            "/version",
            &[],
        ),
        (
            "mocks/go-proxmox-pve8x/GET_nodes.json",
            M::GET,
            "/nodes",
            &[],
        ),
        (
            "mocks/go-proxmox-pve9x/GET_node_status.json",
            M::GET,
            "/nodes/pve1/status",
            &[
                "idle",
                "wait",
                "swap",
                "rootfs",
                "ksm",
                "current-kernel",
                "boot-info",
                "available",
                "mhz",
                "hvm",
                "flags",
                "user_hz",
            ],
        ),
        (
            "mocks/go-proxmox-pve8x/GET_cluster_resources.json",
            M::GET,
            "/cluster/resources",
            &["tags", "lock", "pool"],
        ),
        (
            "mocks/go-proxmox-pve8x/GET_cluster_status.json",
            M::GET,
            "/cluster/status",
            &[],
        ),
        (
            "test-data/community-proxmox-pve8-9/GET_cluster_status.json",
            M::GET,
            "/cluster/status",
            &[],
        ),
        (
            "recorded/fog-pve6.2/GET_cluster_nextid.json",
            M::GET,
            "/cluster/nextid",
            &[],
        ),
        (
            "test-data/community-proxmox-pve7-8/GET_nodes_qemu.json",
            M::GET,
            "/nodes/pve1/qemu",
            &["tags", "lock", "template"],
        ),
        (
            "mocks/go-proxmox-pve9x/GET_qemu_config_many-devices.json",
            M::GET,
            "/nodes/pve1/qemu/100/config",
            &["smbios1", "meta", "agent"],
        ),
        (
            "mocks/go-proxmox-pve8x/GET_qemu_status_current_running.json",
            M::GET,
            "/nodes/pve1/qemu/100/status/current",
            &["tags", "lock", "template"],
        ),
        (
            "recorded/fog-pve6.2/GET_nodes_storage.json",
            M::GET,
            "/nodes/pve1/storage",
            &[],
        ),
        (
            "mocks/go-proxmox-pve9x/GET_storage_content.json",
            M::GET,
            "/nodes/pve1/storage/local/content",
            &["content"],
        ),
        (
            "recorded/fog-pve6.2/GET_task_status_stopped_ok_qmclone.json",
            M::GET,
            &task_status_path,
            &["tokenid"],
        ),
        (
            "recorded/fog-pve6.2/GET_task_log_multiline.json",
            M::GET,
            &task_log_path,
            &[],
        ),
        (
            "mocks/go-proxmox-pve9x/GET_qemu_agent_network-get-interfaces.json",
            M::GET,
            "/nodes/pve1/qemu/100/agent/network-get-interfaces",
            &["statistics"],
        ),
        (
            "mocks/go-proxmox-pve9x/GET_qemu_agent_exec-status_exited.json",
            M::GET,
            &exec_status_path,
            &["err-data"],
        ),
        (
            "recorded/fog-pve6.2/GET_pools.json",
            M::GET,
            "/pools",
            &["comment"],
        ),
    ];
    let mut problems = Vec::new();
    for (file, method, path, extra) in &cases {
        let f = fixture(file);
        let r = raw(&sim, method.clone(), path, &[]).await;
        assert_eq!(
            r.status, 200,
            "{file}: simulator answered {} {:?}",
            r.status, r.reason
        );
        let fkeys: BTreeSet<&String> = f
            .as_object()
            .map(|o| o.keys().collect())
            .unwrap_or_default();
        let skeys: BTreeSet<&String> = r
            .body
            .as_object()
            .map(|o| o.keys().collect())
            .unwrap_or_default();
        assert_eq!(fkeys, skeys, "{file}: envelope keys");
        compare(file, &f["data"], &r.body["data"], extra, &mut problems);
    }
    // UPID-returning POSTs: data is a string
    for (file, path, form) in [
        (
            "recorded/fog-pve6.2/POST_qemu_clone.json",
            "/nodes/pve1/qemu/9000/clone",
            vec![("newid", "101")],
        ),
        (
            "recorded/fog-pve6.2/POST_qemu_status_stop.json",
            "/nodes/pve1/qemu/100/status/stop",
            vec![],
        ),
        (
            "mocks/go-proxmox-pve9x/POST_qemu_agent_exec.json",
            "/nodes/pve1/qemu/100/agent/exec",
            vec![("command", "cloud-init")],
        ),
    ] {
        let f = fixture(file);
        let r = raw(&sim, M::POST, path, &form).await;
        assert_eq!(r.status, 200, "{file}: {:?}", r.reason);
        compare(file, &f["data"], &r.body["data"], &[], &mut problems);
    }
    assert!(
        problems.is_empty(),
        "shape differences:\n{}",
        problems.join("\n")
    );
}

#[tokio::test]
async fn simulator_errors_match_fixture_errors() {
    let dir = fixtures();
    let dir = dir.as_path();
    let index: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("index.json")).expect("index"))
            .expect("json");
    let find = |file: &str| {
        index["fixtures"]
            .as_array()
            .expect("array")
            .iter()
            .find(|f| f["file"] == file)
            .cloned()
            .expect("indexed")
    };
    let sim = Simulator::start(Topology::example(), SimOptions::default())
        .await
        .expect("simulator");
    use reqwest::Method as M;
    for (file, method, path, form, rename) in [
        (
            "recorded/fog-pve6.2/GET_qemu_status_current_missing_500.json",
            M::GET,
            "/nodes/pve1/qemu/100/status/current",
            vec![],
            ("nodes/pve/", "nodes/pve1/"),
        ),
        (
            "recorded/fog-pve6.2/GET_cluster_nextid_vmid-taken_400.json",
            M::GET,
            "/cluster/nextid?vmid=9000",
            vec![],
            ("100", "9000"),
        ),
        (
            "recorded/fog-pve6.2/GET_cluster_nextid_vmid-invalid_400.json",
            M::GET,
            "/cluster/nextid?vmid=99",
            vec![],
            ("", ""),
        ),
        (
            "recorded/fog-pve6.2/POST_pools_exists_500.json",
            M::POST,
            "/pools",
            vec![("poolid", "capi")],
            ("pool1", "capi"),
        ),
    ] {
        let meta = find(file);
        let f = fixture(file);
        let r = raw(&sim, method, path, &form).await;
        assert_eq!(
            u64::from(r.status),
            meta["status"].as_u64().expect("status"),
            "{file}"
        );
        let want_reason = meta["reason"]
            .as_str()
            .expect("reason")
            .replace(rename.0, rename.1);
        assert_eq!(r.reason.as_deref(), Some(want_reason.as_str()), "{file}");
        // PVE ≥ 8.3 adds "message"; everything else is the same shape
        let mut body = r.body.clone();
        let msg = body.as_object_mut().expect("object").remove("message");
        assert!(msg.is_some(), "{file}: message field (PVE 9 behaviour)");
        let fkeys: BTreeSet<String> = f.as_object().expect("object").keys().cloned().collect();
        let skeys: BTreeSet<String> = body.as_object().expect("object").keys().cloned().collect();
        assert_eq!(fkeys, skeys, "{file}");
        assert!(body["data"].is_null());
        if let Some(errors) = f.get("errors").and_then(Value::as_object) {
            let got: BTreeSet<&String> =
                body["errors"].as_object().expect("errors").keys().collect();
            assert_eq!(errors.keys().collect::<BTreeSet<_>>(), got, "{file}");
        }
    }
    // 401: empty body, reason phrase only
    let mut cfg = ClientConfig::new(
        sim.url(),
        ApiToken::new("root@pam!capmox", Secret::new("nope")).expect("token"),
    );
    cfg.retry.max_attempts = 1;
    let err = ProxmoxClient::new(&cfg)
        .expect("client")
        .nodes()
        .await
        .expect_err("401");
    assert!(matches!(err, ProxmoxError::Unauthorized { .. }));
}

#[test]
fn compare_detects_differences() {
    let f = serde_json::json!([{"type": "qemu", "vmid": 1, "name": "a"}, {"type": "node", "node": "x"}]);
    let ok = serde_json::json!([{"type": "qemu", "vmid": 2}, {"type": "node", "node": "y"}]);
    let mut p = Vec::new();
    compare("t", &f, &ok, &[], &mut p);
    assert!(p.is_empty(), "{p:?}");
    let bad = serde_json::json!([{"type": "qemu", "vmid": "2", "extra": 1}]);
    compare("t", &f, &bad, &[], &mut p);
    assert_eq!(p.len(), 2, "{p:?}");
}
