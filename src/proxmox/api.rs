//! Typed calls for everything capmox does on Proxmox VE. Each method names the
//! endpoint template it uses; the same templates appear in counters and in the
//! conformance test against the official schema.

use std::collections::BTreeMap;

use reqwest::Method;
use serde::Deserialize;
use serde_json::Value;

use super::client::{Body, ProxmoxClient, Request};
use super::error::{ProxmoxError, Result};
use super::path::{checked, node_seg, seg, storage_seg};
use super::types::*;
use super::upid::Upid;
use crate::api::names::NameRule;

/// Filter for `GET /cluster/resources`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ResourceFilter {
    /// Guests (qemu and lxc).
    Vm,
    /// Nodes.
    Node,
    /// Storages.
    Storage,
}

/// Every (method, path template, parameters sent as `name:type`) this client can issue;
/// the conformance test checks them against the official schema (`apidata.json`).
/// Config updates may carry any option; the ones capmox sets are listed.
pub const CLIENT_ENDPOINTS: &[(&str, &str, &[&str])] = &[
    ("GET", "/version", &[]),
    ("GET", "/nodes", &[]),
    ("GET", "/nodes/{node}/status", &[]),
    ("GET", "/cluster/resources", &["type:string"]),
    ("GET", "/cluster/nextid", &["vmid:integer"]),
    ("GET", "/cluster/status", &[]),
    ("GET", "/nodes/{node}/qemu", &[]),
    ("GET", "/nodes/{node}/qemu/{vmid}/config", &[]),
    ("POST", "/nodes/{node}/qemu/{vmid}/config", CONFIG_PARAMS),
    ("PUT", "/nodes/{node}/qemu/{vmid}/config", CONFIG_PARAMS),
    (
        "POST",
        "/nodes/{node}/qemu/{vmid}/clone",
        &[
            "newid:integer",
            "name:string",
            "description:string",
            "target:string",
            "full:boolean",
            "storage:string",
            "format:string",
            "pool:string",
            "snapname:string",
        ],
    ),
    (
        "PUT",
        "/nodes/{node}/qemu/{vmid}/resize",
        &["disk:string", "size:string", "digest:string"],
    ),
    ("GET", "/nodes/{node}/qemu/{vmid}/status/current", &[]),
    ("POST", "/nodes/{node}/qemu/{vmid}/status/start", &[]),
    ("POST", "/nodes/{node}/qemu/{vmid}/status/stop", &[]),
    (
        "POST",
        "/nodes/{node}/qemu/{vmid}/status/shutdown",
        &["timeout:integer", "forceStop:boolean"],
    ),
    ("POST", "/nodes/{node}/qemu/{vmid}/status/resume", &[]),
    (
        "POST",
        "/nodes/{node}/qemu/{vmid}/status/reboot",
        &["timeout:integer"],
    ),
    ("POST", "/nodes/{node}/qemu/{vmid}/status/reset", &[]),
    (
        "DELETE",
        "/nodes/{node}/qemu/{vmid}",
        &["purge:boolean", "destroy-unreferenced-disks:boolean"],
    ),
    (
        "GET",
        "/nodes/{node}/storage",
        &["content:string", "enabled:boolean"],
    ),
    (
        "GET",
        "/nodes/{node}/storage/{storage}/content",
        &["content:string", "vmid:integer"],
    ),
    (
        "POST",
        "/nodes/{node}/storage/{storage}/upload",
        &["content:string", "filename:string"],
    ),
    (
        "DELETE",
        "/nodes/{node}/storage/{storage}/content/{volume}",
        &[],
    ),
    ("POST", "/nodes/{node}/qemu/{vmid}/agent/ping", &[]),
    ("GET", "/nodes/{node}/qemu/{vmid}/agent/get-osinfo", &[]),
    (
        "GET",
        "/nodes/{node}/qemu/{vmid}/agent/network-get-interfaces",
        &[],
    ),
    (
        "POST",
        "/nodes/{node}/qemu/{vmid}/agent/exec",
        &["command:array", "input-data:string"],
    ),
    (
        "GET",
        "/nodes/{node}/qemu/{vmid}/agent/exec-status",
        &["pid:integer"],
    ),
    (
        "GET",
        "/nodes/{node}/qemu/{vmid}/agent/file-read",
        &["file:string"],
    ),
    ("GET", "/nodes/{node}/tasks/{upid}/status", &[]),
    (
        "GET",
        "/nodes/{node}/tasks",
        &["source:string", "since:integer", "limit:integer"],
    ),
    (
        "GET",
        "/nodes/{node}/tasks/{upid}/log",
        &["start:integer", "limit:integer"],
    ),
    ("GET", "/pools", &["poolid:string"]),
    ("POST", "/pools", &["poolid:string", "comment:string"]),
    (
        "PUT",
        "/pools",
        &["poolid:string", "vms:string", "delete:boolean"],
    ),
    (
        "POST",
        "/cluster/ha/resources",
        &[
            "sid:string",
            "state:string",
            "comment:string",
            "max_restart:integer",
            "max_relocate:integer",
            "group:string",
        ],
    ),
    ("GET", "/cluster/ha/resources", &[]),
    ("DELETE", "/cluster/ha/resources/{sid}", &[]),
    (
        "POST",
        "/cluster/ha/resources/{sid}/migrate",
        &["node:string"],
    ),
    ("GET", "/cluster/ha/groups", &[]),
    (
        "POST",
        "/cluster/ha/groups",
        &[
            "group:string",
            "nodes:string",
            "restricted:boolean",
            "comment:string",
        ],
    ),
    (
        "PUT",
        "/cluster/ha/groups/{group}",
        &["nodes:string", "digest:string"],
    ),
    ("DELETE", "/cluster/ha/groups/{group}", &[]),
    ("GET", "/cluster/mapping/pci", &[]),
    ("GET", "/nodes/{node}/hardware/pci", &[]),
];

/// Endpoints capmox calls only on PVE 9 and later (HA rules); PVE 8 has HA groups instead.
pub const CLIENT_ENDPOINTS_PVE9: &[(&str, &str, &[&str])] = &[
    ("GET", "/cluster/ha/rules", &[]),
    (
        "POST",
        "/cluster/ha/rules",
        &[
            "rule:string",
            "type:string",
            "resources:string",
            "nodes:string",
            "strict:boolean",
            "affinity:string",
            "comment:string",
        ],
    ),
    (
        "PUT",
        "/cluster/ha/rules/{rule}",
        &[
            "type:string",
            "resources:string",
            "nodes:string",
            "digest:string",
        ],
    ),
    ("DELETE", "/cluster/ha/rules/{rule}", &[]),
];

/// Config options capmox sends in `POST`/`PUT .../config` (indexed ones with their index).
const CONFIG_PARAMS: &[&str] = &[
    "delete:string",
    "digest:string",
    "cores:integer",
    "sockets:integer",
    "memory:string",
    "net0:string",
    "ide2:string",
    "tags:string",
    "description:string",
    "ipconfig0:string",
    "boot:string",
    "agent:string",
    "name:string",
    "ciupgrade:boolean",
];

/// The clone parameters that come from a spec, in the formats Proxmox accepts (checked here
/// too, for objects stored before the CRD patterns existed).
fn check_clone_params(params: &CloneParams) -> Result<()> {
    let fields = [
        ("description", NameRule::Description, &params.description),
        ("target", NameRule::Node, &params.target),
        ("storage", NameRule::Storage, &params.storage),
        ("pool", NameRule::Pool, &params.pool),
        ("snapname", NameRule::Snapshot, &params.snapname),
    ];
    for (param, rule, value) in fields {
        if let Some(value) = value {
            checked(param, rule, value)?;
        }
    }
    Ok(())
}

/// The form of a config update, refused when the description (from a spec) has control
/// characters that do not belong in a VM config.
fn config_form(update: &ConfigUpdate) -> Result<Vec<(String, String)>> {
    if let Some(description) = update.set.get("description") {
        checked("description", NameRule::Description, description)?;
    }
    Ok(update.to_form())
}

fn b01(b: bool) -> &'static str {
    if b { "1" } else { "0" }
}

fn vm_path(node: &str, vmid: u32) -> Result<String> {
    Ok(format!("/nodes/{}/qemu/{vmid}", node_seg(node)?))
}

/// The agent wraps its answer in `result`; old PVE could return `{"result":{"error":{...}}}` with 200.
#[derive(Deserialize)]
struct AgentResult<T> {
    result: T,
}

fn agent_result<T: serde::de::DeserializeOwned>(endpoint: &str, v: Value) -> Result<T> {
    if let Some(err) = v.get("result").and_then(|r| r.get("error")) {
        let desc = err
            .get("desc")
            .and_then(Value::as_str)
            .unwrap_or("guest agent error");
        return Err(ProxmoxError::Api {
            status: 500,
            reason: desc.to_string(),
        });
    }
    serde_json::from_value::<AgentResult<T>>(v)
        .map(|r| r.result)
        .map_err(|e| ProxmoxError::Decode {
            endpoint: endpoint.to_string(),
            message: e.to_string(),
        })
}

impl ProxmoxClient {
    /// `GET /version`: release for feature switches and a cheap connectivity check.
    pub async fn version(&self) -> Result<VersionInfo> {
        self.send(Request::get("GET /version", "/version".into()))
            .await
    }

    /// `GET /nodes`: all nodes with online state.
    pub async fn nodes(&self) -> Result<Vec<NodeEntry>> {
        self.send(Request::get("GET /nodes", "/nodes".into())).await
    }

    /// `GET /nodes/{node}/status`: memory and CPU for scheduling.
    pub async fn node_status(&self, node: &str) -> Result<NodeStatus> {
        self.send(Request::get(
            "GET /nodes/{node}/status",
            format!("/nodes/{}/status", node_seg(node)?),
        ))
        .await
    }

    /// `GET /cluster/resources[?type=]`: finds guests without knowing their node.
    pub async fn cluster_resources(
        &self,
        filter: Option<ResourceFilter>,
    ) -> Result<Vec<ClusterResource>> {
        let mut req = Request::get("GET /cluster/resources", "/cluster/resources".into());
        if let Some(f) = filter {
            req = req.query(
                "type",
                match f {
                    ResourceFilter::Vm => "vm",
                    ResourceFilter::Node => "node",
                    ResourceFilter::Storage => "storage",
                },
            );
        }
        self.send(req).await
    }

    /// `GET /cluster/nextid[?vmid=]`: a free VMID (a hint, not a reservation). With `vmid`,
    /// returns it if free or `AlreadyExists` if taken.
    pub async fn next_id(&self, vmid: Option<u32>) -> Result<u32> {
        let mut req = Request::get("GET /cluster/nextid", "/cluster/nextid".into());
        if let Some(id) = vmid {
            req = req.query("vmid", id);
        }
        #[derive(Deserialize)]
        struct Id(#[serde(deserialize_with = "super::de::vmid")] u32);
        let Id(id) = self.send(req).await?;
        Ok(id)
    }

    /// `GET /cluster/status`: quorum and node membership.
    pub async fn cluster_status(&self) -> Result<Vec<ClusterStatusEntry>> {
        self.send(Request::get(
            "GET /cluster/status",
            "/cluster/status".into(),
        ))
        .await
    }

    /// `GET /nodes/{node}/qemu`: VMs on one node (for memory accounting).
    pub async fn list_vms(&self, node: &str) -> Result<Vec<VmEntry>> {
        self.send(Request::get(
            "GET /nodes/{node}/qemu",
            format!("/nodes/{}/qemu", node_seg(node)?),
        ))
        .await
    }

    /// `GET .../config`: the VM's options and `digest`.
    pub async fn vm_config(&self, node: &str, vmid: u32) -> Result<VmConfig> {
        self.send(Request::get(
            "GET /nodes/{node}/qemu/{vmid}/config",
            format!("{}/config", vm_path(node, vmid)?),
        ))
        .await
    }

    /// `POST .../config` (asynchronous): returns the `qmconfig` task to wait for.
    pub async fn update_vm_config(
        &self,
        node: &str,
        vmid: u32,
        update: &ConfigUpdate,
    ) -> Result<TaskRef> {
        self.send(
            Request::new(
                Method::POST,
                "POST /nodes/{node}/qemu/{vmid}/config",
                format!("{}/config", vm_path(node, vmid)?),
            )
            .form(config_form(update)?),
        )
        .await
    }

    /// `PUT .../config` (synchronous): done when it returns.
    pub async fn update_vm_config_sync(
        &self,
        node: &str,
        vmid: u32,
        update: &ConfigUpdate,
    ) -> Result<()> {
        let _: Value = self
            .send(
                Request::new(
                    Method::PUT,
                    "PUT /nodes/{node}/qemu/{vmid}/config",
                    format!("{}/config", vm_path(node, vmid)?),
                )
                .form(config_form(update)?),
            )
            .await?;
        Ok(())
    }

    /// `POST .../clone`: starts a `qmclone` task; the new VM exists at once with `lock: clone`.
    /// Never retried (a lost response may hide a running clone).
    pub async fn clone_vm(&self, node: &str, vmid: u32, params: &CloneParams) -> Result<Upid> {
        let mut form = vec![("newid".to_string(), params.newid.to_string())];
        let mut opt = |k: &str, v: &Option<String>| {
            if let Some(v) = v {
                form.push((k.to_string(), v.clone()));
            }
        };
        opt("name", &params.name);
        opt("description", &params.description);
        opt("target", &params.target);
        opt("storage", &params.storage);
        opt("format", &params.format);
        opt("pool", &params.pool);
        opt("snapname", &params.snapname);
        check_clone_params(params)?;
        if let Some(full) = params.full {
            form.push(("full".to_string(), b01(full).to_string()));
        }
        let upid: Option<Upid> = self
            .send(
                Request::new(
                    Method::POST,
                    "POST /nodes/{node}/qemu/{vmid}/clone",
                    format!("{}/clone", vm_path(node, vmid)?),
                )
                .form(form),
            )
            .await?;
        upid.ok_or_else(|| ProxmoxError::Decode {
            endpoint: "POST /nodes/{node}/qemu/{vmid}/clone".into(),
            message: "expected a UPID, got null".into(),
        })
    }

    /// `PUT .../resize`: grows a disk (`size` like `+10G` or `32G`). UPID on PVE ≥ 8, null before.
    pub async fn resize_disk(
        &self,
        node: &str,
        vmid: u32,
        disk: &str,
        size: &str,
        digest: Option<&str>,
    ) -> Result<TaskRef> {
        let mut form = vec![
            (
                "disk".to_string(),
                checked("disk", NameRule::Disk, disk)?.to_string(),
            ),
            ("size".to_string(), size.to_string()),
        ];
        if let Some(d) = digest {
            form.push(("digest".to_string(), d.to_string()));
        }
        self.send(
            Request::new(
                Method::PUT,
                "PUT /nodes/{node}/qemu/{vmid}/resize",
                format!("{}/resize", vm_path(node, vmid)?),
            )
            .form(form),
        )
        .await
    }

    /// `GET .../status/current`: power state, lock, agent flag.
    pub async fn vm_status(&self, node: &str, vmid: u32) -> Result<VmStatus> {
        self.send(Request::get(
            "GET /nodes/{node}/qemu/{vmid}/status/current",
            format!("{}/status/current", vm_path(node, vmid)?),
        ))
        .await
    }

    /// `POST .../status/{start|stop|shutdown|resume}`: starts the power task.
    pub async fn power(&self, node: &str, vmid: u32, action: PowerAction) -> Result<TaskRef> {
        let endpoint = match action {
            PowerAction::Start => "POST /nodes/{node}/qemu/{vmid}/status/start",
            PowerAction::Stop => "POST /nodes/{node}/qemu/{vmid}/status/stop",
            PowerAction::Shutdown => "POST /nodes/{node}/qemu/{vmid}/status/shutdown",
            PowerAction::Resume => "POST /nodes/{node}/qemu/{vmid}/status/resume",
        };
        self.send(
            Request::new(
                Method::POST,
                endpoint,
                format!("{}/status/{}", vm_path(node, vmid)?, action.as_str()),
            )
            .form(Vec::new()),
        )
        .await
    }

    /// `POST .../status/shutdown` with `forceStop` and a timeout (seconds).
    pub async fn shutdown_vm(
        &self,
        node: &str,
        vmid: u32,
        timeout_secs: Option<u32>,
        force_stop: bool,
    ) -> Result<TaskRef> {
        let mut form = vec![("forceStop".to_string(), b01(force_stop).to_string())];
        if let Some(t) = timeout_secs {
            form.push(("timeout".to_string(), t.to_string()));
        }
        self.send(
            Request::new(
                Method::POST,
                "POST /nodes/{node}/qemu/{vmid}/status/shutdown",
                format!("{}/status/shutdown", vm_path(node, vmid)?),
            )
            .form(form),
        )
        .await
    }

    /// `POST .../status/reboot` with a timeout (seconds) for the guest's shutdown: restarts a
    /// running VM cleanly (`qmreboot` task), which fails if the guest does not shut down in time.
    pub async fn reboot_vm(
        &self,
        node: &str,
        vmid: u32,
        timeout_secs: Option<u32>,
    ) -> Result<TaskRef> {
        let mut form = Vec::new();
        if let Some(t) = timeout_secs {
            form.push(("timeout".to_string(), t.to_string()));
        }
        self.send(
            Request::new(
                Method::POST,
                "POST /nodes/{node}/qemu/{vmid}/status/reboot",
                format!("{}/status/reboot", vm_path(node, vmid)?),
            )
            .form(form),
        )
        .await
    }

    /// `POST .../status/reset`: hard-resets a running VM (`qmreset` task), for a guest that no
    /// longer reacts to a reboot.
    pub async fn reset_vm(&self, node: &str, vmid: u32) -> Result<TaskRef> {
        self.send(
            Request::new(
                Method::POST,
                "POST /nodes/{node}/qemu/{vmid}/status/reset",
                format!("{}/status/reset", vm_path(node, vmid)?),
            )
            .form(Vec::new()),
        )
        .await
    }

    /// `DELETE /nodes/{node}/qemu/{vmid}`: destroys a stopped VM (`qmdestroy` task).
    pub async fn delete_vm(&self, node: &str, vmid: u32, params: DeleteParams) -> Result<TaskRef> {
        let mut req = Request::new(
            Method::DELETE,
            "DELETE /nodes/{node}/qemu/{vmid}",
            vm_path(node, vmid)?,
        );
        if params.purge {
            req = req.query("purge", "1");
        }
        if params.destroy_unreferenced_disks {
            req = req.query("destroy-unreferenced-disks", "1");
        }
        self.send(req).await
    }

    /// `GET /nodes/{node}/storage[?content=&enabled=1]`: storages usable on a node.
    pub async fn list_storage(
        &self,
        node: &str,
        content: Option<&str>,
    ) -> Result<Vec<StorageEntry>> {
        let mut req = Request::get(
            "GET /nodes/{node}/storage",
            format!("/nodes/{}/storage", node_seg(node)?),
        );
        if let Some(c) = content {
            req = req.query("content", c).query("enabled", "1");
        }
        self.send(req).await
    }

    /// `GET .../storage/{storage}/content[?content=&vmid=]`: volumes on a storage.
    pub async fn storage_content(
        &self,
        node: &str,
        storage: &str,
        content: Option<&str>,
        vmid: Option<u32>,
    ) -> Result<Vec<StorageContent>> {
        let mut req = Request::get(
            "GET /nodes/{node}/storage/{storage}/content",
            format!(
                "/nodes/{}/storage/{}/content",
                node_seg(node)?,
                storage_seg(storage)?
            ),
        );
        if let Some(c) = content {
            req = req.query("content", c);
        }
        if let Some(v) = vmid {
            req = req.query("vmid", v);
        }
        self.send(req).await
    }

    /// `POST .../storage/{storage}/upload`: uploads an ISO (multipart, `content` part
    /// first, then the file part named `filename`; Content-Length is set). Returns the
    /// `imgcopy` task; the volume is `<storage>:iso/<filename>` once it succeeds.
    pub async fn upload_iso(
        &self,
        node: &str,
        storage: &str,
        filename: &str,
        data: Vec<u8>,
    ) -> Result<TaskRef> {
        let part = reqwest::multipart::Part::bytes(data)
            .file_name(filename.to_string())
            .mime_str("application/octet-stream")
            .map_err(|e| ProxmoxError::Config(format!("invalid upload mime type: {e}")))?;
        let form = reqwest::multipart::Form::new()
            .text("content", "iso")
            .part("filename", part);
        let mut req = Request::new(
            Method::POST,
            "POST /nodes/{node}/storage/{storage}/upload",
            format!(
                "/nodes/{}/storage/{}/upload",
                node_seg(node)?,
                storage_seg(storage)?
            ),
        );
        req.body = Body::Multipart(form);
        req.timeout = Some(self.upload_timeout());
        self.send(req).await
    }

    /// `DELETE .../storage/{storage}/content/{volume}`: removes a volume (e.g. a seed ISO).
    pub async fn delete_volume(&self, node: &str, storage: &str, volid: &str) -> Result<TaskRef> {
        self.send(Request::new(
            Method::DELETE,
            "DELETE /nodes/{node}/storage/{storage}/content/{volume}",
            format!(
                "/nodes/{}/storage/{}/content/{}",
                node_seg(node)?,
                storage_seg(storage)?,
                seg("volume", volid)?
            ),
        ))
        .await
    }

    /// `POST .../agent/ping`: whether the guest agent answers.
    pub async fn agent_ping(&self, node: &str, vmid: u32) -> Result<()> {
        let _: Value = self
            .send(
                Request::new(
                    Method::POST,
                    "POST /nodes/{node}/qemu/{vmid}/agent/ping",
                    format!("{}/agent/ping", vm_path(node, vmid)?),
                )
                .form(Vec::new()),
            )
            .await?;
        Ok(())
    }

    /// `GET .../agent/get-osinfo`: the guest OS as the agent reports it.
    pub async fn agent_os_info(&self, node: &str, vmid: u32) -> Result<AgentOsInfo> {
        const EP: &str = "GET /nodes/{node}/qemu/{vmid}/agent/get-osinfo";
        let v: Value = self
            .send(Request::get(
                EP,
                format!("{}/agent/get-osinfo", vm_path(node, vmid)?),
            ))
            .await?;
        agent_result(EP, v)
    }

    /// `GET .../agent/network-get-interfaces`: the guest's NICs, MACs and addresses.
    pub async fn agent_network_interfaces(
        &self,
        node: &str,
        vmid: u32,
    ) -> Result<Vec<AgentInterface>> {
        const EP: &str = "GET /nodes/{node}/qemu/{vmid}/agent/network-get-interfaces";
        let v: Value = self
            .send(Request::get(
                EP,
                format!("{}/agent/network-get-interfaces", vm_path(node, vmid)?),
            ))
            .await?;
        agent_result(EP, v)
    }

    /// `POST .../agent/exec`: runs a command in the guest; poll `agent_exec_status` with the pid.
    pub async fn agent_exec(
        &self,
        node: &str,
        vmid: u32,
        command: &[&str],
        input_data: Option<&str>,
    ) -> Result<u64> {
        let mut form: Vec<(String, String)> = command
            .iter()
            .map(|c| ("command".to_string(), c.to_string()))
            .collect();
        if let Some(i) = input_data {
            form.push(("input-data".to_string(), i.to_string()));
        }
        let started: AgentExecStarted = self
            .send(
                Request::new(
                    Method::POST,
                    "POST /nodes/{node}/qemu/{vmid}/agent/exec",
                    format!("{}/agent/exec", vm_path(node, vmid)?),
                )
                .form(form),
            )
            .await?;
        Ok(started.pid)
    }

    /// `GET .../agent/exec-status?pid=`: whether the command exited, its code and output.
    pub async fn agent_exec_status(
        &self,
        node: &str,
        vmid: u32,
        pid: u64,
    ) -> Result<AgentExecStatus> {
        self.send(
            Request::get(
                "GET /nodes/{node}/qemu/{vmid}/agent/exec-status",
                format!("{}/agent/exec-status", vm_path(node, vmid)?),
            )
            .query("pid", pid),
        )
        .await
    }

    /// `GET /nodes/{node}/tasks/{upid}/status` on the node inside the UPID.
    pub async fn task_status(&self, upid: &Upid) -> Result<TaskStatus> {
        self.send(Request::get(
            "GET /nodes/{node}/tasks/{upid}/status",
            format!(
                "/nodes/{}/tasks/{}/status",
                node_seg(&upid.node)?,
                seg("upid", upid.as_str())?
            ),
        ))
        .await
    }

    /// `GET /nodes/{node}/tasks?source=all`: the node's running and ended tasks started at
    /// or after `since` (unix seconds), of type `typefilter` if given, newest first, at most
    /// `limit`.
    pub async fn node_tasks(
        &self,
        node: &str,
        since: u64,
        typefilter: Option<&str>,
        limit: usize,
    ) -> Result<Vec<NodeTask>> {
        let mut request = Request::get(
            "GET /nodes/{node}/tasks",
            format!("/nodes/{}/tasks", node_seg(node)?),
        )
        .query("source", "all")
        .query("since", since);
        if let Some(task_type) = typefilter {
            request = request.query("typefilter", task_type);
        }
        self.send(request.query("limit", limit)).await
    }

    /// `GET /nodes/{node}/tasks/{upid}/log`: task output (the last line says OK or the error).
    pub async fn task_log(&self, upid: &Upid, start: u64, limit: u64) -> Result<Vec<TaskLogLine>> {
        self.send(
            Request::get(
                "GET /nodes/{node}/tasks/{upid}/log",
                format!(
                    "/nodes/{}/tasks/{}/log",
                    node_seg(&upid.node)?,
                    seg("upid", upid.as_str())?
                ),
            )
            .query("start", start)
            .query("limit", limit),
        )
        .await
    }

    /// Reads the VM's tags and config digest (for a following `set_tags`).
    pub async fn vm_tags(&self, node: &str, vmid: u32) -> Result<(Vec<String>, Option<String>)> {
        let cfg = self.vm_config(node, vmid).await?;
        Ok((cfg.tags(), cfg.digest()))
    }

    /// Writes the complete tag set (`;`-joined; empty removes `tags`), guarded by `digest`.
    pub async fn set_tags(
        &self,
        node: &str,
        vmid: u32,
        tags: &[String],
        digest: Option<String>,
    ) -> Result<TaskRef> {
        let update = if tags.is_empty() {
            ConfigUpdate::default().delete("tags")
        } else {
            let mut t: Vec<String> = tags.iter().map(|t| t.to_ascii_lowercase()).collect();
            t.sort();
            t.dedup();
            ConfigUpdate::default().set("tags", t.join(";"))
        };
        self.update_vm_config(node, vmid, &update.digest(digest))
            .await
    }

    /// `GET /pools`: all pools.
    pub async fn list_pools(&self) -> Result<Vec<Pool>> {
        self.send(Request::get("GET /pools", "/pools".into())).await
    }

    /// `GET /pools?poolid=` (PVE 8.1+): one pool with its members.
    pub async fn get_pool(&self, poolid: &str) -> Result<Pool> {
        let pools: Vec<Pool> = self
            .send(Request::get("GET /pools", "/pools".into()).query("poolid", poolid))
            .await?;
        pools
            .into_iter()
            .next()
            .ok_or_else(|| ProxmoxError::NotFound {
                status: 200,
                reason: format!("pool '{poolid}' does not exist"),
            })
    }

    /// `POST /pools`: creates a pool (`AlreadyExists` if it exists).
    pub async fn create_pool(&self, poolid: &str, comment: Option<&str>) -> Result<()> {
        let mut form = vec![("poolid".to_string(), poolid.to_string())];
        if let Some(c) = comment {
            form.push(("comment".to_string(), c.to_string()));
        }
        let _: Value = self
            .send(Request::new(Method::POST, "POST /pools", "/pools".into()).form(form))
            .await?;
        Ok(())
    }

    /// `PUT /pools`: adds (or with `remove`, removes) guests to a pool.
    pub async fn update_pool_vms(&self, poolid: &str, vmids: &[u32], remove: bool) -> Result<()> {
        let vms = vmids
            .iter()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(",");
        let mut form = vec![
            ("poolid".to_string(), poolid.to_string()),
            ("vms".to_string(), vms),
        ];
        if remove {
            form.push(("delete".to_string(), "1".to_string()));
        }
        let _: Value = self
            .send(Request::new(Method::PUT, "PUT /pools", "/pools".into()).form(form))
            .await?;
        Ok(())
    }

    /// `POST /cluster/ha/resources`: makes a guest an HA resource.
    pub async fn create_ha_resource(&self, resource: &NewHaResource) -> Result<()> {
        let mut form = vec![
            ("sid".to_string(), resource.sid.clone()),
            ("state".to_string(), resource.state.clone()),
        ];
        let mut opt = |k: &str, v: Option<String>| {
            if let Some(v) = v {
                form.push((k.to_string(), v));
            }
        };
        opt("comment", resource.comment.clone());
        opt("max_restart", resource.max_restart.map(|v| v.to_string()));
        opt("max_relocate", resource.max_relocate.map(|v| v.to_string()));
        opt("group", resource.group.clone());
        let _: Value = self
            .send(
                Request::new(
                    Method::POST,
                    "POST /cluster/ha/resources",
                    "/cluster/ha/resources".into(),
                )
                .form(form),
            )
            .await?;
        Ok(())
    }

    /// `GET /cluster/mapping/pci` (PVE 8+): the PCI resource mappings the token may see,
    /// with each node entry parsed; a malformed entry is a decode error.
    pub async fn pci_mappings(&self) -> Result<Vec<PciMapping>> {
        self.send(Request::get(
            "GET /cluster/mapping/pci",
            "/cluster/mapping/pci".into(),
        ))
        .await
    }

    /// `GET /nodes/{node}/hardware/pci`: the node's PCI devices (without memory controllers,
    /// bridges and processors, as PVE filters by default).
    pub async fn node_pci_devices(&self, node: &str) -> Result<Vec<PciDevice>> {
        self.send(Request::get(
            "GET /nodes/{node}/hardware/pci",
            format!("/nodes/{}/hardware/pci", node_seg(node)?),
        ))
        .await
    }

    /// `GET /cluster/ha/resources`: every HA resource.
    pub async fn ha_resources(&self) -> Result<Vec<HaResourceEntry>> {
        self.send(Request::get(
            "GET /cluster/ha/resources",
            "/cluster/ha/resources".into(),
        ))
        .await
    }

    /// `DELETE /cluster/ha/resources/{sid}`: the guest is no longer HA-managed (PVE 9 also
    /// removes it from every HA rule, its default `purge`).
    pub async fn delete_ha_resource(&self, sid: &str) -> Result<()> {
        let _: Value = self
            .send(Request::new(
                Method::DELETE,
                "DELETE /cluster/ha/resources/{sid}",
                format!("/cluster/ha/resources/{}", seg("sid", sid)?),
            ))
            .await?;
        Ok(())
    }

    /// `POST .../{sid}/migrate`: queues moving HA resource `sid` to `node` (the CRM may drop it).
    pub async fn ha_migrate(&self, sid: &str, node: &str) -> Result<HaMigration> {
        checked("node", NameRule::Node, node)?;
        let form = vec![("node".to_string(), node.to_string())];
        let answer: Option<HaMigration> = self
            .send(
                Request::new(
                    Method::POST,
                    "POST /cluster/ha/resources/{sid}/migrate",
                    format!("/cluster/ha/resources/{}/migrate", seg("sid", sid)?),
                )
                .form(form),
            )
            .await?;
        Ok(answer.unwrap_or_default())
    }

    /// `GET /cluster/ha/rules` (PVE 9).
    pub async fn ha_rules(&self) -> Result<Vec<HaRuleEntry>> {
        self.send(Request::get(
            "GET /cluster/ha/rules",
            "/cluster/ha/rules".into(),
        ))
        .await
    }

    /// `POST /cluster/ha/rules` (PVE 9).
    pub async fn create_ha_rule(&self, rule: &HaRuleEntry) -> Result<()> {
        let mut form = vec![
            ("rule".to_string(), rule.rule.clone()),
            ("type".to_string(), rule.kind.clone()),
            ("resources".to_string(), rule.resources.clone()),
        ];
        if let Some(nodes) = &rule.nodes {
            form.push(("nodes".to_string(), nodes.clone()));
            form.push(("strict".to_string(), b01(rule.strict).to_string()));
        }
        if let Some(affinity) = &rule.affinity {
            form.push(("affinity".to_string(), affinity.clone()));
        }
        if let Some(comment) = &rule.comment {
            form.push(("comment".to_string(), comment.clone()));
        }
        let _: Value = self
            .send(
                Request::new(
                    Method::POST,
                    "POST /cluster/ha/rules",
                    "/cluster/ha/rules".into(),
                )
                .form(form),
            )
            .await?;
        Ok(())
    }

    /// `PUT /cluster/ha/rules/{rule}` (PVE 9): new resources and/or nodes, refused when the
    /// rules changed since `digest` was read.
    pub async fn update_ha_rule(
        &self,
        rule: &str,
        kind: &str,
        resources: Option<&str>,
        nodes: Option<&str>,
        digest: Option<&str>,
    ) -> Result<()> {
        let mut form = vec![("type".to_string(), kind.to_string())];
        for (k, v) in [
            ("resources", resources),
            ("nodes", nodes),
            ("digest", digest),
        ] {
            if let Some(v) = v {
                form.push((k.to_string(), v.to_string()));
            }
        }
        let _: Value = self
            .send(
                Request::new(
                    Method::PUT,
                    "PUT /cluster/ha/rules/{rule}",
                    format!("/cluster/ha/rules/{}", seg("rule", rule)?),
                )
                .form(form),
            )
            .await?;
        Ok(())
    }

    /// `DELETE /cluster/ha/rules/{rule}` (PVE 9).
    pub async fn delete_ha_rule(&self, rule: &str) -> Result<()> {
        let _: Value = self
            .send(Request::new(
                Method::DELETE,
                "DELETE /cluster/ha/rules/{rule}",
                format!("/cluster/ha/rules/{}", seg("rule", rule)?),
            ))
            .await?;
        Ok(())
    }

    /// `GET /cluster/ha/groups` (PVE 8; PVE 9 migrated groups to rules).
    pub async fn ha_groups(&self) -> Result<Vec<HaGroupEntry>> {
        self.send(Request::get(
            "GET /cluster/ha/groups",
            "/cluster/ha/groups".into(),
        ))
        .await
    }

    /// `POST /cluster/ha/groups` (PVE 8).
    pub async fn create_ha_group(&self, group: &HaGroupEntry) -> Result<()> {
        let mut form = vec![
            ("group".to_string(), group.group.clone()),
            ("nodes".to_string(), group.nodes.clone()),
            ("restricted".to_string(), b01(group.restricted).to_string()),
        ];
        if let Some(comment) = &group.comment {
            form.push(("comment".to_string(), comment.clone()));
        }
        let _: Value = self
            .send(
                Request::new(
                    Method::POST,
                    "POST /cluster/ha/groups",
                    "/cluster/ha/groups".into(),
                )
                .form(form),
            )
            .await?;
        Ok(())
    }

    /// `PUT /cluster/ha/groups/{group}` (PVE 8): new nodes, refused when the groups changed
    /// since `digest` was read.
    pub async fn update_ha_group_nodes(
        &self,
        group: &str,
        nodes: &str,
        digest: Option<&str>,
    ) -> Result<()> {
        let mut form = vec![("nodes".to_string(), nodes.to_string())];
        if let Some(d) = digest {
            form.push(("digest".to_string(), d.to_string()));
        }
        let _: Value = self
            .send(
                Request::new(
                    Method::PUT,
                    "PUT /cluster/ha/groups/{group}",
                    format!("/cluster/ha/groups/{}", seg("group", group)?),
                )
                .form(form),
            )
            .await?;
        Ok(())
    }

    /// `DELETE /cluster/ha/groups/{group}` (PVE 8; refused while a resource uses it).
    pub async fn delete_ha_group(&self, group: &str) -> Result<()> {
        let _: Value = self
            .send(Request::new(
                Method::DELETE,
                "DELETE /cluster/ha/groups/{group}",
                format!("/cluster/ha/groups/{}", seg("group", group)?),
            ))
            .await?;
        Ok(())
    }

    /// Finds a guest anywhere in the cluster (VMs move between nodes); `None` if absent.
    pub async fn find_vm(&self, vmid: u32) -> Result<Option<ClusterResource>> {
        let all = self.cluster_resources(Some(ResourceFilter::Vm)).await?;
        Ok(all
            .into_iter()
            .find(|r| r.vmid == Some(vmid) && r.kind == ResourceType::Qemu))
    }

    /// Templates carrying all the given tags (case-insensitive), sorted by VMID.
    pub async fn find_templates_by_tags(&self, tags: &[&str]) -> Result<Vec<ClusterResource>> {
        let want: Vec<String> = tags.iter().map(|t| t.to_ascii_lowercase()).collect();
        let mut found: Vec<ClusterResource> = self
            .cluster_resources(Some(ResourceFilter::Vm))
            .await?
            .into_iter()
            .filter(|r| r.kind == ResourceType::Qemu && r.template)
            .filter(|r| {
                let have: Vec<String> = r.tags.iter().map(|t| t.to_ascii_lowercase()).collect();
                want.iter().all(|w| have.contains(w))
            })
            .collect();
        found.sort_by_key(|r| r.vmid);
        Ok(found)
    }

    /// `GET .../agent/file-read`: the whole content of the file at `path` in the guest.
    pub async fn agent_file_read(&self, node: &str, vmid: u32, path: &str) -> Result<String> {
        #[derive(Deserialize)]
        struct FileContent {
            content: String,
        }
        let read: FileContent = self
            .send(
                Request::get(
                    "GET /nodes/{node}/qemu/{vmid}/agent/file-read",
                    format!("{}/agent/file-read", vm_path(node, vmid)?),
                )
                .query("file", path),
            )
            .await?;
        Ok(read.content)
    }

    /// How cloud-init ended in the guest, read from its result file in one request; `None`
    /// while it has not ended (the file is written when its last stage is done).
    pub async fn cloud_init_result(
        &self,
        node: &str,
        vmid: u32,
    ) -> Result<Option<CloudInitStatus>> {
        match self
            .agent_file_read(node, vmid, CLOUD_INIT_RESULT_FILE)
            .await
        {
            Ok(content) => CloudInitStatus::of_result(&content)
                .map(Some)
                .map_err(|message| ProxmoxError::Decode {
                    endpoint: "GET /nodes/{node}/qemu/{vmid}/agent/file-read".into(),
                    message: format!("{CLOUD_INIT_RESULT_FILE} in VM {vmid}: {message}"),
                }),
            Err(error) if error.is_missing_guest_file() => Ok(None),
            Err(error) => Err(error),
        }
    }
}

/// Where cloud-init records how its boot ended (`/run` starts empty at each boot).
pub const CLOUD_INIT_RESULT_FILE: &str = "/run/cloud-init/result.json";

impl CloudInitStatus {
    /// What cloud-init's result file says: its `errors` fail the boot, its
    /// `recoverable_errors` (cloud-init 23.4 and later) degrade it.
    pub fn of_result(content: &str) -> Result<Self, String> {
        #[derive(Deserialize)]
        struct ResultFile {
            v1: ResultV1,
        }
        #[derive(Deserialize)]
        struct ResultV1 {
            #[serde(default)]
            errors: Vec<Value>,
            #[serde(default)]
            recoverable_errors: BTreeMap<String, Vec<Value>>,
        }
        let result: ResultFile = serde_json::from_str(content).map_err(|e| e.to_string())?;
        let text = |value: &Value| match value {
            Value::String(text) => text.clone(),
            other => other.to_string(),
        };
        if !result.v1.errors.is_empty() {
            let errors: Vec<String> = result.v1.errors.iter().map(text).collect();
            return Ok(Self::Error(errors.join("; ")));
        }
        let recoverable: Vec<String> = result
            .v1
            .recoverable_errors
            .iter()
            .filter(|(_, messages)| !messages.is_empty())
            .map(|(level, messages)| {
                let messages: Vec<String> = messages.iter().map(text).collect();
                format!("{level}: {}", messages.join("; "))
            })
            .collect();
        Ok(if recoverable.is_empty() {
            Self::Done
        } else {
            Self::Degraded(recoverable.join("; "))
        })
    }
}

/// How cloud-init ended in a guest.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CloudInitStatus {
    /// Finished successfully.
    Done,
    /// Finished with recoverable errors (warnings, deprecations); the text says which.
    Degraded(String),
    /// Failed; the text is cloud-init's errors.
    Error(String),
}

#[cfg(test)]
mod tests {
    use super::CloudInitStatus;

    #[test]
    fn cloud_inits_result_file_says_done_degraded_or_failed() {
        let done = r#"{"v1": {"datasource": "DataSourceNoCloud [seed=/dev/sr0]", "errors": []}}"#;
        assert_eq!(CloudInitStatus::of_result(done), Ok(CloudInitStatus::Done));
        let warned = r#"{"v1": {"errors": [], "recoverable_errors": {"WARNING": [],
            "DEPRECATED": ["Deprecated cloud-config provided: chpasswd.list"]}}}"#;
        assert_eq!(
            CloudInitStatus::of_result(warned),
            Ok(CloudInitStatus::Degraded(
                "DEPRECATED: Deprecated cloud-config provided: chpasswd.list".into()
            ))
        );
        let failed = r#"{"v1": {"errors": ["('scripts_user', RuntimeError('Runparts: 1 failures (runcmd)'))"],
            "recoverable_errors": {"WARNING": ["a warning"]}}}"#;
        assert_eq!(
            CloudInitStatus::of_result(failed),
            Ok(CloudInitStatus::Error(
                "('scripts_user', RuntimeError('Runparts: 1 failures (runcmd)'))".into()
            ))
        );
        for malformed in ["", "{}", r#"{"v1": {"errors": "none"}}"#, "status: done"] {
            assert!(
                CloudInitStatus::of_result(malformed).is_err(),
                "{malformed:?} is no result file"
            );
        }
    }
}
