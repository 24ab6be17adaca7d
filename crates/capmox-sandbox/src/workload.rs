//! The workload cluster of a run with the real Cluster API controllers. No VM of the simulator
//! runs Kubernetes, so this stand-in leaves in the API server at the cluster's control-plane
//! endpoint what `kubeadm` and the kubelets would: a Ready Node per running machine (with the
//! Machine's provider ID and addresses), the control-plane components' mirror Pods on
//! control-plane Nodes, and the `kubeadm-config` ConfigMap once the first control plane is up.
//! A VM that stops in the simulator makes its Node's `Ready` condition `Unknown`, as a node
//! that stopped posting status does. The real KubeadmControlPlane, MachineSet and
//! MachineHealthCheck controllers read all of it through their cluster cache.
//!
//! What this stand-in creates is labelled with [`OWNER_LABEL`] so that [`remove`] takes away
//! exactly that, since the workload API server may be the management cluster's own.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod};
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, Patch,
    PatchParams, PostParams,
};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use capmox::api::ProxmoxMachine;
use capmox_sim::SimHandle;

/// Label on every object the stand-in creates; its value names the cluster.
pub const OWNER_LABEL: &str = "e2e.capmox.io/workload-stand-in";

/// The control-plane components whose mirror Pods KCP inspects (external etcd: no etcd Pod).
const COMPONENTS: [&str; 3] = [
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
];

/// How often the stand-in looks at the machines (a kubelet posts status every 10 s; faster
/// keeps the run short).
const PERIOD: Duration = Duration::from_millis(500);

/// Why one pass of the stand-in failed (it retries on the next).
#[derive(Debug, thiserror::Error)]
pub enum WorkloadError {
    /// A request to the API server failed.
    #[error("workload stand-in: {0}")]
    Kube(#[from] kube::Error),
}

/// What the stand-in needs to know about the cluster it plays the workload of.
#[derive(Clone, Debug)]
pub struct WorkloadCluster {
    /// Namespace of the Cluster and its machines (management side).
    pub namespace: String,
    /// Name of the Cluster.
    pub cluster: String,
    /// `kubernetesVersion` written into `kubeadm-config`.
    pub kubernetes_version: String,
    /// The control-plane endpoint, `host:port`.
    pub endpoint: String,
}

/// Machines whose kubelet has failed: their Node reports `Ready=False` while the VM runs (what
/// a MachineHealthCheck exists for; a stopped VM capmox starts again). Some failures last until
/// the Machine is replaced, others until its VM restarts (a wedged kubelet a reboot cures).
#[derive(Clone, Debug, Default)]
pub struct FailedKubelets(Arc<Mutex<BTreeMap<String, Failure>>>);

/// How long a kubelet stays failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Failure {
    /// Until its Machine is gone.
    ForGood,
    /// Until its VM has started more often than this (a reboot or reset).
    UntilRestart { boots: u32 },
}

impl FailedKubelets {
    /// The kubelet of `machine` stops reporting Ready for good.
    pub fn fail(&self, machine: &str) {
        self.lock().insert(machine.to_owned(), Failure::ForGood);
    }

    /// The kubelet of `machine`, whose VM has started `boots` times, stops reporting Ready
    /// until the VM restarts.
    pub fn fail_until_restart(&self, machine: &str, boots: u32) {
        self.lock()
            .insert(machine.to_owned(), Failure::UntilRestart { boots });
    }

    /// Whether the kubelet of `machine`, whose VM has started `boots` times, is failed now.
    fn failed(&self, machine: &str, boots: Option<u32>) -> bool {
        let mut failures = self.lock();
        match failures.get(machine) {
            None => false,
            Some(Failure::ForGood) => true,
            Some(Failure::UntilRestart { boots: at }) => {
                if boots.is_some_and(|now| now > *at) {
                    failures.remove(machine);
                    false
                } else {
                    true
                }
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Failure>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Plays the workload cluster until `stop` is cancelled: `management` reads Machines and
/// ProxmoxMachines, `workload` is the API server at the control-plane endpoint, `sim` tells
/// which VMs run, `failed` which kubelets have failed.
pub async fn run(
    management: Client,
    workload: Client,
    cluster: WorkloadCluster,
    sim: SimHandle,
    failed: FailedKubelets,
    stop: CancellationToken,
) {
    let mut last_error = String::new();
    loop {
        if let Err(error) = pass(&management, &workload, &cluster, &sim, &failed).await {
            let text = error.to_string();
            if text != last_error {
                tracing::info!(%error, "workload stand-in pass failed; retrying");
                last_error = text;
            }
        }
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(PERIOD) => {}
        }
    }
}

/// One Machine as the kubelet of its VM would know it.
struct Kubelet {
    node: String,
    provider_id: String,
    control_plane: bool,
    running: bool,
    failed: bool,
    version: String,
    addresses: Vec<Value>,
}

fn machine_api(client: &Client, namespace: &str, kind: &str, group: &str) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk(group, "v1beta2", kind);
    Api::namespaced_with(client.clone(), namespace, &ApiResource::from_gvk(&gvk))
}

/// The machines whose VM has been created, as their kubelets would see them.
async fn kubelets(
    management: &Client,
    cluster: &WorkloadCluster,
    sim: &SimHandle,
    failed: &FailedKubelets,
) -> Result<Vec<Kubelet>, WorkloadError> {
    let selector = format!("cluster.x-k8s.io/cluster-name={}", cluster.cluster);
    let machines = machine_api(
        management,
        &cluster.namespace,
        "Machine",
        "cluster.x-k8s.io",
    )
    .list(&ListParams::default().labels(&selector))
    .await?;
    let infra: BTreeMap<String, ProxmoxMachine> =
        Api::<ProxmoxMachine>::namespaced(management.clone(), &cluster.namespace)
            .list(&ListParams::default())
            .await?
            .into_iter()
            .map(|m| (m.name_any(), m))
            .collect();
    let mut kubelets = Vec::new();
    for machine in machines {
        if machine.metadata.deletion_timestamp.is_some() {
            continue;
        }
        let spec = &machine.data["spec"];
        let (Some(provider_id), Some(infra_name)) = (
            spec["providerID"].as_str(),
            spec["infrastructureRef"]["name"].as_str(),
        ) else {
            continue;
        };
        let Some(vmid) = infra
            .get(infra_name)
            .and_then(|m| m.status.as_ref())
            .and_then(|s| s.virtual_machine_id)
            .and_then(|v| u32::try_from(v).ok())
        else {
            continue;
        };
        let Some(running) = sim.with_cluster(|c| c.vm_running(vmid)) else {
            continue;
        };
        kubelets.push(Kubelet {
            failed: failed.failed(&machine.name_any(), sim.boots(vmid)),
            node: machine.name_any(),
            provider_id: provider_id.to_owned(),
            control_plane: machine
                .labels()
                .contains_key("cluster.x-k8s.io/control-plane"),
            running,
            version: spec["version"].as_str().unwrap_or("v1.33.0").to_owned(),
            addresses: machine.data["status"]["addresses"]
                .as_array()
                .cloned()
                .unwrap_or_default(),
        });
    }
    Ok(kubelets)
}

async fn pass(
    management: &Client,
    workload: &Client,
    cluster: &WorkloadCluster,
    sim: &SimHandle,
    failed: &FailedKubelets,
) -> Result<(), WorkloadError> {
    let kubelets = kubelets(management, cluster, sim, failed).await?;
    for kubelet in &kubelets {
        ensure_node(workload, cluster, kubelet).await?;
        if kubelet.control_plane {
            for component in COMPONENTS {
                ensure_mirror_pod(workload, cluster, kubelet, component).await?;
            }
        }
    }
    if kubelets.iter().any(|k| k.control_plane && k.running) {
        ensure_kubeadm_config(workload, cluster).await?;
    }
    remove_pods_of_gone_nodes(workload, cluster).await?;
    record_certificate_expiry(management, cluster).await?;
    Ok(())
}

fn owner_labels(cluster: &WorkloadCluster) -> Value {
    json!({ OWNER_LABEL: cluster.cluster })
}

impl Kubelet {
    /// The Node's `Ready` status: a stopped VM posts nothing, a failed kubelet says NotReady.
    fn ready(&self) -> &'static str {
        match (self.running, self.failed) {
            (false, _) => "Unknown",
            (true, true) => "False",
            (true, false) => "True",
        }
    }
}

fn ready_condition(ready: &str) -> Value {
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    let (reason, message) = match ready {
        "True" => ("KubeletReady", "kubelet is posting ready status"),
        "False" => ("KubeletNotReady", "container runtime is down"),
        _ => ("NodeStatusUnknown", "Kubelet stopped posting node status."),
    };
    let status = ready;
    json!({"type": "Ready", "status": status, "reason": reason, "message": message,
           "lastHeartbeatTime": now, "lastTransitionTime": now})
}

/// Creates the machine's Node, then keeps its `Ready` condition in step with its VM.
async fn ensure_node(
    workload: &Client,
    cluster: &WorkloadCluster,
    kubelet: &Kubelet,
) -> Result<(), WorkloadError> {
    let nodes: Api<Node> = Api::all(workload.clone());
    let existing = match nodes.get_opt(&kubelet.node).await? {
        Some(node) => node,
        None => {
            let mut labels = owner_labels(cluster);
            labels["kubernetes.io/hostname"] = json!(kubelet.node);
            labels["kubernetes.io/os"] = json!("linux");
            if kubelet.control_plane {
                labels["node-role.kubernetes.io/control-plane"] = json!("");
            }
            let node: Node = serde_json::from_value(json!({
                "metadata": {"name": kubelet.node, "labels": labels},
                "spec": {"providerID": kubelet.provider_id}
            }))
            .map_err(kube::Error::SerdeError)?;
            nodes.create(&PostParams::default(), &node).await?
        }
    };
    let ready_now = existing
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.type_ == "Ready"))
        .map(|c| c.status.as_str());
    let wanted = kubelet.ready();
    if ready_now == Some(wanted) {
        return Ok(());
    }
    let addresses: Vec<Value> = kubelet
        .addresses
        .iter()
        .filter(|a| a["type"].is_string() && a["address"].is_string())
        .cloned()
        .collect();
    let status = json!({"status": {
        "conditions": [ready_condition(wanted)],
        "addresses": addresses,
        "nodeInfo": {
            "machineID": kubelet.node, "systemUUID": kubelet.provider_id, "bootID": kubelet.node,
            "kernelVersion": "6.8.0", "osImage": "Ubuntu 24.04 LTS (simulated)",
            "containerRuntimeVersion": "containerd://2.0.0", "kubeletVersion": kubelet.version,
            "kubeProxyVersion": kubelet.version, "operatingSystem": "linux", "architecture": "amd64"
        }
    }});
    nodes
        .patch_status(
            &kubelet.node,
            &PatchParams::default(),
            &Patch::Merge(&status),
        )
        .await?;
    Ok(())
}

/// The mirror Pod of one control-plane component on the machine's Node, Running and Ready while
/// the VM runs.
async fn ensure_mirror_pod(
    workload: &Client,
    cluster: &WorkloadCluster,
    kubelet: &Kubelet,
    component: &str,
) -> Result<(), WorkloadError> {
    let pods: Api<Pod> = Api::namespaced(workload.clone(), "kube-system");
    let name = format!("{component}-{}", kubelet.node);
    let existing = match pods.get_opt(&name).await? {
        Some(pod) => pod,
        None => {
            let mut labels = owner_labels(cluster);
            labels["component"] = json!(component);
            labels["tier"] = json!("control-plane");
            let pod: Pod = serde_json::from_value(json!({
                "metadata": {"name": name, "namespace": "kube-system", "labels": labels,
                             "annotations": {"kubernetes.io/config.mirror": kubelet.node,
                                             "kubernetes.io/config.source": "file"}},
                "spec": {"nodeName": kubelet.node, "automountServiceAccountToken": false,
                         "containers": [{"name": component,
                                         "image": format!("registry.k8s.io/{component}:{}", kubelet.version)}]}
            }))
            .map_err(kube::Error::SerdeError)?;
            pods.create(&PostParams::default(), &pod).await?
        }
    };
    let ready_now = existing
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.type_ == "Ready"))
        .map(|c| c.status == "True");
    if ready_now == Some(kubelet.running) {
        return Ok(());
    }
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    let ready = if kubelet.running { "True" } else { "False" };
    let status = json!({"status": {
        "phase": "Running",
        "conditions": [{"type": "Ready", "status": ready, "lastTransitionTime": now},
                       {"type": "ContainersReady", "status": ready, "lastTransitionTime": now}],
        "containerStatuses": [{"name": component, "ready": kubelet.running, "restartCount": 0,
                               "image": format!("registry.k8s.io/{component}:{}", kubelet.version),
                               "imageID": "", "started": kubelet.running,
                               "state": {"running": {"startedAt": now}}}]
    }});
    pods.patch_status(&name, &PatchParams::default(), &Patch::Merge(&status))
        .await?;
    Ok(())
}

/// What `kubeadm init` uploads: KCP takes its presence as "the control plane is initialized" and
/// edits its ClusterConfiguration on upgrades.
async fn ensure_kubeadm_config(
    workload: &Client,
    cluster: &WorkloadCluster,
) -> Result<(), WorkloadError> {
    let maps: Api<ConfigMap> = Api::namespaced(workload.clone(), "kube-system");
    if maps.get_opt("kubeadm-config").await?.is_some() {
        return Ok(());
    }
    let configuration = format!(
        "apiVersion: kubeadm.k8s.io/v1beta4\nkind: ClusterConfiguration\n\
         kubernetesVersion: {}\ncontrolPlaneEndpoint: {}\nclusterName: {}\n\
         certificatesDir: /etc/kubernetes/pki\nimageRepository: registry.k8s.io\n\
         networking:\n  dnsDomain: cluster.local\n  podSubnet: 192.168.0.0/16\n  serviceSubnet: 10.128.0.0/12\n\
         etcd:\n  external:\n    endpoints:\n    - https://127.0.0.1:2379\n    caFile: /etc/kubernetes/pki/etcd/ca.crt\n\
         \x20   certFile: /etc/kubernetes/pki/apiserver-etcd-client.crt\n    keyFile: /etc/kubernetes/pki/apiserver-etcd-client.key\n",
        cluster.kubernetes_version, cluster.endpoint, cluster.cluster
    );
    let map: ConfigMap = serde_json::from_value(json!({
        "metadata": {"name": "kubeadm-config", "namespace": "kube-system",
                     "labels": owner_labels(cluster)},
        "data": {"ClusterConfiguration": configuration}
    }))
    .map_err(kube::Error::SerdeError)?;
    maps.create(&PostParams::default(), &map).await?;
    Ok(())
}

/// A Node that Cluster API deleted takes its mirror Pods with it, as a kubelet that is gone
/// no longer mirrors them.
async fn remove_pods_of_gone_nodes(
    workload: &Client,
    cluster: &WorkloadCluster,
) -> Result<(), WorkloadError> {
    let selector = format!("{OWNER_LABEL}={}", cluster.cluster);
    let nodes: BTreeSet<String> = Api::<Node>::all(workload.clone())
        .list(&ListParams::default().labels(&selector))
        .await?
        .into_iter()
        .map(|n| n.name_any())
        .collect();
    let pods: Api<Pod> = Api::namespaced(workload.clone(), "kube-system");
    for pod in pods.list(&ListParams::default().labels(&selector)).await? {
        let node = pod.spec.as_ref().and_then(|s| s.node_name.clone());
        if node.is_some_and(|n| !nodes.contains(&n)) {
            pods.delete(&pod.name_any(), &DeleteParams::default().grace_period(0))
                .await?;
        }
    }
    Ok(())
}

/// KCP reads the API server certificate's expiry from each control-plane Node once; the
/// simulated Nodes serve no certificate, so the stand-in records a year from now on each
/// control-plane machine's KubeadmConfig, as KCP would.
async fn record_certificate_expiry(
    management: &Client,
    cluster: &WorkloadCluster,
) -> Result<(), WorkloadError> {
    const ANNOTATION: &str = "machine.cluster.x-k8s.io/certificates-expiry";
    let configs = machine_api(
        management,
        &cluster.namespace,
        "KubeadmConfig",
        "bootstrap.cluster.x-k8s.io",
    );
    let selector = format!(
        "cluster.x-k8s.io/cluster-name={},cluster.x-k8s.io/control-plane",
        cluster.cluster
    );
    let expiry = k8s_openapi::jiff::Timestamp::now()
        .checked_add(k8s_openapi::jiff::SignedDuration::from_hours(24 * 365))
        .unwrap_or_else(|_| k8s_openapi::jiff::Timestamp::now())
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string();
    for config in configs
        .list(&ListParams::default().labels(&selector))
        .await?
    {
        if config.annotations().contains_key(ANNOTATION) {
            continue;
        }
        let patch = json!({"metadata": {"annotations": {ANNOTATION: expiry}}});
        configs
            .patch(
                &config.name_any(),
                &PatchParams::default(),
                &Patch::Merge(&patch),
            )
            .await?;
    }
    Ok(())
}

/// Removes every Node, Pod and ConfigMap the stand-in created for `cluster`.
pub async fn remove(workload: &Client, cluster: &WorkloadCluster) -> Result<(), WorkloadError> {
    let selector = format!("{OWNER_LABEL}={}", cluster.cluster);
    let params = ListParams::default().labels(&selector);
    let delete = DeleteParams::default().grace_period(0);
    let pods: Api<Pod> = Api::namespaced(workload.clone(), "kube-system");
    for pod in pods.list(&params).await? {
        pods.delete(&pod.name_any(), &delete).await?;
    }
    let maps: Api<ConfigMap> = Api::namespaced(workload.clone(), "kube-system");
    for map in maps.list(&params).await? {
        maps.delete(&map.name_any(), &delete).await?;
    }
    let nodes: Api<Node> = Api::all(workload.clone());
    for node in nodes.list(&params).await? {
        nodes.delete(&node.name_any(), &delete).await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kubelet(running: bool, failed: bool) -> Kubelet {
        Kubelet {
            node: "m".into(),
            provider_id: "proxmox://x".into(),
            control_plane: false,
            running,
            failed,
            version: "v1.33.0".into(),
            addresses: Vec::new(),
        }
    }

    #[test]
    fn a_stopped_vm_posts_nothing_and_a_failed_kubelet_reports_not_ready() {
        assert_eq!(kubelet(true, false).ready(), "True");
        assert_eq!(kubelet(true, true).ready(), "False");
        assert_eq!(kubelet(false, false).ready(), "Unknown");
        assert_eq!(kubelet(false, true).ready(), "Unknown");
        assert_eq!(ready_condition("False")["reason"], "KubeletNotReady");
        let failed = FailedKubelets::default();
        failed.fail("m");
        assert!(failed.failed("m", Some(5)) && !failed.failed("n", Some(1)));
    }

    #[test]
    fn a_kubelet_wedged_until_a_restart_recovers_once_its_vm_booted_again() {
        let failed = FailedKubelets::default();
        failed.fail_until_restart("m", 1);
        assert!(failed.failed("m", Some(1)), "not restarted yet");
        assert!(failed.failed("m", None), "the VM's boots unknown");
        assert!(!failed.failed("m", Some(2)), "rebooted");
        assert!(!failed.failed("m", Some(1)), "recovered for good");
    }
}
