//! Every fixture in `tests/data/pve-fixtures/index.json` whose endpoint the client covers
//! is served over real HTTP (status, reason phrase, exact body) and decoded by the
//! typed client call; error fixtures must map to the right error variant with the reason kept.

use std::collections::HashMap;
use std::path::Path;

use crate::common::fixture_server::{Canned, FixtureServer};
use capmox::proxmox::*;
use serde_json::Value;

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/pve-fixtures");

fn matches_template(template: &str, path: &str) -> Option<HashMap<String, String>> {
    let t: Vec<&str> = template.trim_start_matches('/').split('/').collect();
    let p: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let mut params = HashMap::new();
    for (i, seg) in t.iter().enumerate() {
        if *seg == "{volume}" && i == t.len() - 1 {
            // volume ids contain '/'
            if p.len() < i + 1 {
                return None;
            }
            params.insert("volume".to_string(), p[i..].join("/"));
            return Some(params);
        }
        let actual = p.get(i)?;
        if seg.starts_with('{') {
            params.insert(
                seg.trim_matches(|c| c == '{' || c == '}').to_string(),
                actual.to_string(),
            );
        } else if seg != actual {
            return None;
        }
    }
    (t.len() == p.len()).then_some(params)
}

fn query_param(query: &Option<String>, key: &str) -> Option<String> {
    let q = query.as_deref()?;
    form_urlencoded::parse(q.as_bytes())
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.into_owned())
}

/// Calls the typed method for `template` and returns a short description of the decoded value.
async fn call(
    client: &ProxmoxClient,
    method: &str,
    template: &str,
    p: &HashMap<String, String>,
    query: &Option<String>,
) -> Result<String> {
    // Fixtures copied from other projects' tests name the node by the template's `{node}`,
    // which the client refuses to put into a path; any node name serves them.
    let node = p
        .get("node")
        .filter(|n| !n.starts_with('{'))
        .cloned()
        .unwrap_or_else(|| "pve".to_owned());
    let vmid: u32 = p.get("vmid").and_then(|v| v.parse().ok()).unwrap_or(100);
    let upid = || -> Result<Upid> {
        p.get("upid")
            .expect("upid param")
            .parse()
            .map_err(|e: capmox::proxmox::upid::UpidParseError| ProxmoxError::Config(e.to_string()))
    };
    Ok(match (method, template) {
        ("GET", "/version") => format!("{:?}", client.version().await?),
        ("GET", "/nodes") => format!("{:?}", client.nodes().await?),
        ("GET", "/nodes/{node}/status") => format!("{:?}", client.node_status(&node).await?),
        ("GET", "/cluster/resources") => {
            let filter = match query_param(query, "type").as_deref() {
                Some("vm") => Some(ResourceFilter::Vm),
                Some("node") => Some(ResourceFilter::Node),
                Some("storage") => Some(ResourceFilter::Storage),
                _ => None,
            };
            format!("{:?}", client.cluster_resources(filter).await?)
        }
        ("GET", "/cluster/nextid") => {
            let id = query_param(query, "vmid").and_then(|v| v.parse().ok());
            format!("{:?}", client.next_id(id).await?)
        }
        ("GET", "/cluster/status") => format!("{:?}", client.cluster_status().await?),
        ("GET", "/nodes/{node}/qemu") => format!("{:?}", client.list_vms(&node).await?),
        ("GET", "/nodes/{node}/qemu/{vmid}/config") => {
            format!("{:?}", client.vm_config(&node, vmid).await?)
        }
        ("POST", "/nodes/{node}/qemu/{vmid}/config") => format!(
            "{:?}",
            client
                .update_vm_config(&node, vmid, &ConfigUpdate::default().set("cores", 1))
                .await?
        ),
        ("POST", "/nodes/{node}/qemu/{vmid}/clone") => format!(
            "{:?}",
            client
                .clone_vm(
                    &node,
                    vmid,
                    &CloneParams {
                        newid: 101,
                        ..Default::default()
                    }
                )
                .await?
        ),
        ("PUT", "/nodes/{node}/qemu/{vmid}/resize") => format!(
            "{:?}",
            client
                .resize_disk(&node, vmid, "scsi0", "+1G", None)
                .await?
        ),
        ("GET", "/nodes/{node}/qemu/{vmid}/status/current") => {
            format!("{:?}", client.vm_status(&node, vmid).await?)
        }
        ("POST", "/nodes/{node}/qemu/{vmid}/status/start") => {
            format!("{:?}", client.power(&node, vmid, PowerAction::Start).await?)
        }
        ("POST", "/nodes/{node}/qemu/{vmid}/status/stop") => {
            format!("{:?}", client.power(&node, vmid, PowerAction::Stop).await?)
        }
        ("DELETE", "/nodes/{node}/qemu/{vmid}") => format!(
            "{:?}",
            client
                .delete_vm(&node, vmid, DeleteParams::default())
                .await?
        ),
        ("GET", "/nodes/{node}/storage") => {
            format!("{:?}", client.list_storage(&node, None).await?)
        }
        ("GET", "/nodes/{node}/storage/{storage}/content") => format!(
            "{:?}",
            client
                .storage_content(&node, &p["storage"], None, None)
                .await?
        ),
        ("POST", "/nodes/{node}/storage/{storage}/upload") => format!(
            "{:?}",
            client
                .upload_iso(&node, &p["storage"], "seed.iso", vec![0u8; 16])
                .await?
        ),
        ("DELETE", "/nodes/{node}/storage/{storage}/content/{volume}") => format!(
            "{:?}",
            client
                .delete_volume(&node, &p["storage"], &p["volume"])
                .await?
        ),
        ("GET", "/nodes/{node}/qemu/{vmid}/agent/network-get-interfaces") => {
            format!("{:?}", client.agent_network_interfaces(&node, vmid).await?)
        }
        ("POST", "/nodes/{node}/qemu/{vmid}/agent/exec") => format!(
            "{:?}",
            client
                .agent_exec(&node, vmid, &["cloud-init", "status"], None)
                .await?
        ),
        ("GET", "/nodes/{node}/qemu/{vmid}/agent/exec-status") => {
            format!("{:?}", client.agent_exec_status(&node, vmid, 1234).await?)
        }
        ("GET", "/nodes/{node}/tasks") => {
            format!("{:?}", client.node_tasks(&node, 0, None, 50).await?)
        }
        ("GET", "/nodes/{node}/tasks/{upid}/status") => {
            format!("{:?}", client.task_status(&upid()?).await?)
        }
        ("GET", "/nodes/{node}/tasks/{upid}/log") => {
            format!("{:?}", client.task_log(&upid()?, 0, 50).await?)
        }
        ("GET", "/pools") => format!("{:?}", client.list_pools().await?),
        ("GET", "/cluster/ha/resources") => format!("{:?}", client.ha_resources().await?),
        ("POST", "/pools") => format!("{:?}", client.create_pool("pool1", None).await?),
        other => panic!("no call mapped for {other:?}"),
    })
}

#[tokio::test]
async fn fixtures_decode_through_the_client() {
    let dir = Path::new(FIXTURES);
    let index: Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("index.json")).expect("read index.json"),
    )
    .expect("index.json is JSON");
    let server = FixtureServer::start().await;
    let mut cfg = ClientConfig::new(
        server.url(),
        ApiToken::parse("root@pam!capi=secret-value").expect("token"),
    );
    cfg.retry.max_attempts = 1;
    let client = ProxmoxClient::new(&cfg).expect("client");

    let mut covered = 0;
    let mut errors_checked = 0;
    for fx in index["fixtures"].as_array().expect("fixtures array") {
        let method = fx["method"].as_str().expect("method");
        let path = fx["path"].as_str().expect("path");
        let status = fx["status"].as_u64().expect("status") as u16;
        let reason = fx["reason"].as_str().map(str::to_string);
        let body = match fx["file"].as_str() {
            Some(f) => std::fs::read(dir.join(f)).expect("fixture file"),
            None => Vec::new(),
        };
        let query = fx["query"].as_str().map(str::to_string);
        let name = fx["file"].as_str().unwrap_or(path).to_string();

        // Error classification applies to every error fixture, covered endpoint or not.
        if status >= 400 {
            let e = error_from_parts(
                reqwest::StatusCode::from_u16(status).expect("status"),
                reason.as_deref(),
                &body,
            );
            let ok = match (status, name.as_str()) {
                (400, n) if n.contains("vmid-taken") => {
                    matches!(e, ProxmoxError::AlreadyExists { .. })
                }
                (400, n) if n.contains("vmid-invalid") => {
                    matches!(&e, ProxmoxError::InvalidParameters { errors, .. } if errors.contains_key("vmid"))
                }
                (400, _) => matches!(
                    e,
                    ProxmoxError::AlreadyExists { .. } | ProxmoxError::InvalidParameters { .. }
                ),
                (401, _) => matches!(e, ProxmoxError::Unauthorized { .. }),
                (500, n) if n.contains("missing") => e.is_not_found(),
                (500, n) if n.contains("exists") => matches!(e, ProxmoxError::AlreadyExists { .. }),
                (500, _) => matches!(e, ProxmoxError::Api { status: 500, .. }),
                _ => false,
            };
            assert!(ok, "{name}: unexpected classification {e:?}");
            if let (Some(r), true) = (&reason, status != 400) {
                assert_eq!(e.reason(), Some(r.as_str()), "{name}: reason phrase kept");
            }
            errors_checked += 1;
        }

        let Some((template, params)) = CLIENT_ENDPOINTS
            .iter()
            .filter(|(m, _, _)| *m == method)
            .find_map(|(_, t, _)| matches_template(t, path).map(|p| (*t, p)))
        else {
            continue;
        };
        if fx["file"].is_null() && status == 200 {
            continue;
        }
        server.set(Canned {
            status,
            reason: reason.clone(),
            body: body.clone(),
        });
        let result = call(&client, method, template, &params, &query).await;
        let seen = server.take_seen();
        assert_eq!(seen.len(), 1, "{name}: one request expected");
        assert_eq!(seen[0].method, method, "{name}");
        match (status, result) {
            (200, Ok(summary)) => assert!(!summary.is_empty()),
            (200, Err(e)) => panic!("{name}: success body did not decode: {e}"),
            (_, Ok(v)) => panic!("{name}: error status {status} decoded as success {v}"),
            (_, Err(e)) => {
                // Over HTTP the custom reason phrase must survive (hyper ReasonPhrase).
                if let (Some(r), true) = (&reason, status != 400) {
                    assert_eq!(e.reason(), Some(r.as_str()), "{name}: reason over HTTP");
                }
            }
        }
        covered += 1;
    }
    println!("decoded {covered} covered fixtures, classified {errors_checked} error fixtures");
    assert!(covered >= 45, "only {covered} fixtures covered");
    assert!(errors_checked >= 9);
}

#[tokio::test]
async fn specific_fixture_values() {
    let dir = Path::new(FIXTURES);
    let server = FixtureServer::start().await;
    let cfg = ClientConfig::new(
        server.url(),
        ApiToken::parse("root@pam!capi=secret-value").expect("token"),
    );
    let client = ProxmoxClient::new(&cfg).expect("client");
    let serve = |file: &str| {
        server.set(Canned {
            status: 200,
            reason: None,
            body: std::fs::read(dir.join(file)).expect("fixture"),
        })
    };

    serve("recorded/fog-pve6.2/GET_cluster_nextid.json");
    assert_eq!(client.next_id(None).await.expect("nextid"), 100);

    serve("recorded/fog-pve6.2/GET_qemu_status_current_stopped.json");
    let st = client.vm_status("pve", 100).await.expect("status");
    assert_eq!(st.vmid, 100);
    assert_eq!(st.status, VmState::Stopped);
    assert!(!st.template);
    assert_eq!(st.pid, None);

    serve("recorded/fog-pve6.2/GET_qemu_status_current_paused.json");
    let st = client.vm_status("pve", 100).await.expect("status");
    assert!(st.is_running());
    assert_eq!(st.qmpstatus.as_deref(), Some("paused"));

    serve("recorded/fog-pve6.2/GET_storage_content_vmid-images.json");
    let content = client
        .storage_content("pve", "local-lvm", None, Some(101))
        .await
        .expect("content");
    assert!(content.iter().all(|c| c.ctime.is_some()));

    // A node's task list: ended tasks with their exit status, a failed one not a success.
    serve("recorded/fog-pve6.2/GET_nodes_tasks.json");
    let tasks = client.node_tasks("pve", 0, None, 50).await.expect("tasks");
    assert_eq!(tasks.len(), 50);
    let destroy = tasks
        .iter()
        .find(|t| t.upid.contains(":qmdestroy:"))
        .expect("a qmdestroy")
        .as_status();
    assert!(destroy.is_finished() && destroy.is_success(), "{destroy:?}");
    let refused = tasks[0].as_status();
    assert!(
        refused.is_finished() && !refused.is_success(),
        "{refused:?}"
    );
    let seen = server.take_seen();
    let query = seen
        .last()
        .expect("request")
        .query
        .clone()
        .unwrap_or_default();
    assert!(query.contains("source=all"), "{query}");

    serve("recorded/fog-pve6.2/POST_qemu_clone.json");
    let upid = client
        .clone_vm(
            "pve",
            100,
            &CloneParams {
                newid: 101,
                full: Some(true),
                ..Default::default()
            },
        )
        .await
        .expect("clone");
    assert_eq!(upid.task_type, "qmclone");
    assert_eq!(upid.id, "100", "qmclone id is the source VMID");
    let seen = server.take_seen();
    let body = String::from_utf8_lossy(&seen.last().expect("request").body).into_owned();
    assert!(
        body.contains("newid=101") && body.contains("full=1"),
        "{body}"
    );

    serve("recorded/fog-pve6.2/PUT_qemu_resize.json");
    assert_eq!(
        client
            .resize_disk("pve", 100, "virtio0", "+1G", None)
            .await
            .expect("resize"),
        None,
        "PVE 6 resize returns null"
    );

    serve("recorded/fog-pve6.2/GET_task_status_stopped_error.json");
    let t = client
        .task_status(
            &"UPID:pve:00000754:00009421:5FBE5DD2:vzcreate:100:root@pam:"
                .parse()
                .expect("upid"),
        )
        .await
        .expect("task");
    assert!(t.is_finished() && !t.is_success());

    serve("mocks/go-proxmox-pve9x/GET_qemu_agent_network-get-interfaces.json");
    let ifs = client
        .agent_network_interfaces("node1", 101)
        .await
        .expect("ifaces");
    assert_eq!(ifs[1].ip_addresses[0].ip_address, "10.0.0.10");

    serve("mocks/go-proxmox-pve9x/GET_node_status.json");
    let ns = client.node_status("node1").await.expect("node status");
    assert_eq!(ns.loadavg, vec![0.15, 0.25, 0.30]);
    assert_eq!(ns.memory.total, 8589934592);

    serve("mocks/go-proxmox-pve8x/GET_cluster_resources.json");
    let res = client.cluster_resources(None).await.expect("resources");
    assert!(
        res.iter()
            .any(|r| r.kind == ResourceType::Qemu && r.vmid.is_some())
    );
    assert!(res.iter().any(|r| r.kind == ResourceType::Storage));

    // the Authorization header carries the token; the secret never shows in Debug output
    let seen = server.take_seen();
    let auth = seen[0]
        .headers
        .iter()
        .find(|(k, _)| k == "authorization")
        .map(|(_, v)| v.clone())
        .expect("auth header");
    assert_eq!(auth, "PVEAPIToken=root@pam!capi=secret-value");
    assert!(!format!("{client:?}").contains("secret-value"));
}

#[tokio::test]
async fn upload_is_multipart_in_proxmox_order_with_content_length() {
    let server = FixtureServer::start().await;
    let client = ProxmoxClient::new(&ClientConfig::new(
        server.url(),
        ApiToken::parse("root@pam!capi=secret-value").expect("token"),
    ))
    .expect("client");
    server.set(Canned {
        status: 200,
        reason: None,
        body: br#"{"data":"UPID:pve:00000001:00000001:00000001:imgcopy::root@pam!capi:"}"#.to_vec(),
    });
    let data = b"ISO-BYTES".to_vec();
    let task = client
        .upload_iso("pve", "local", "user-data-101.iso", data)
        .await
        .expect("upload");
    assert_eq!(task.expect("upid").task_type, "imgcopy");
    let seen = server.take_seen();
    let req = &seen[0];
    assert_eq!(req.path, "/api2/json/nodes/pve/storage/local/upload");
    let header = |name: &str| {
        req.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
    };
    let len: usize = header("content-length")
        .expect("Content-Length is mandatory for Proxmox uploads")
        .parse()
        .expect("number");
    assert_eq!(len, req.body.len());
    assert!(header("transfer-encoding").is_none(), "no chunked uploads");
    assert!(
        header("content-type").is_some_and(|c| c.starts_with("multipart/form-data; boundary="))
    );
    let body = String::from_utf8_lossy(&req.body);
    let content_at = body
        .find("Content-Disposition: form-data; name=\"content\"\r\n\r\niso\r\n")
        .expect("content part");
    let file_at = body
        .find("Content-Disposition: form-data; name=\"filename\"; filename=\"user-data-101.iso\"")
        .expect("file part named filename");
    assert!(content_at < file_at, "content must come before the file");
    assert!(body.contains("ISO-BYTES"));
}

/// A body over the client's bound is an error that says so, not an allocation of whatever the
/// other end sends; a raised fence stops writes before they leave while reads go on.
#[tokio::test]
async fn oversized_bodies_are_refused_and_a_raised_fence_stops_writes() {
    let server = FixtureServer::start().await;
    let mut cfg = ClientConfig::new(
        server.url(),
        ApiToken::parse("root@pam!capi=secret-value").expect("token"),
    );
    cfg.retry.max_attempts = 1;
    let registry = ClientRegistry::new();
    let client = registry.get(&cfg).expect("client");

    let padding = "x".repeat(MAX_RESPONSE_BODY);
    server.set(Canned {
        status: 200,
        reason: None,
        body: format!(r#"{{"data":{{"version":"9.1","release":"9.1","repoid":"{padding}"}}}}"#)
            .into_bytes(),
    });
    let error = client.version().await.expect_err("too large");
    assert!(error.to_string().contains("larger than 16 MiB"), "{error}");

    server.set(Canned {
        status: 200,
        reason: None,
        body: br#"{"data":"UPID:pve1:00001234:00005678:65000000:qmstart:100:root@pam:"}"#.to_vec(),
    });
    server.take_seen();
    registry.fence();
    let error = client
        .power("pve1", 100, PowerAction::Start)
        .await
        .expect_err("fenced");
    assert!(matches!(error, ProxmoxError::Fenced), "{error}");
    assert!(
        server.take_seen().is_empty(),
        "a fenced write never reaches Proxmox"
    );
    server.set(Canned {
        status: 200,
        reason: None,
        body: br#"{"data":{"version":"9.1","release":"9.1","repoid":"abc"}}"#.to_vec(),
    });
    client.version().await.expect("reads go on");
}
