//! The lifecycle steps of the real-controllers run after the cluster is up: a KCP rollout, a
//! control-plane scale-down and back, a MachineHealthCheck replacing a worker whose kubelet
//! failed, one whose remediation by reboot (capmox's ProxmoxRemediation) cures a wedged kubelet,
//! and a zone whose storages fail. Each step waits for the real controllers to finish it and checks what capmox did.

use std::collections::BTreeSet;
use std::time::Duration;

use kube::Client;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams};
use serde_json::json;

use super::real::RealError;
use super::real_capi::{CLUSTER, Row, all_running, check_placement, rows, wait_rows};
use super::run::SiteSimulators;

/// What every step works on.
pub struct Run<'a> {
    /// Admin client of the management cluster.
    pub admin: &'a Client,
    /// The Cluster's namespace.
    pub namespace: &'a str,
    /// The Proxmox simulator.
    pub sims: &'a SiteSimulators,
    /// Upper bound of each step.
    pub timeout: Duration,
    /// Control-plane replicas the cluster was created with.
    pub control_plane: usize,
    /// Worker machines (one per zone).
    pub workers: usize,
    /// Kubelets the workload stand-in reports as failed.
    pub failed: &'a super::workload::FailedKubelets,
}

impl Run<'_> {
    fn kcp(&self) -> Api<DynamicObject> {
        let gvk = GroupVersionKind::gvk(
            "controlplane.cluster.x-k8s.io",
            "v1beta2",
            "KubeadmControlPlane",
        );
        Api::namespaced_with(
            self.admin.clone(),
            self.namespace,
            &ApiResource::from_gvk(&gvk),
        )
    }

    async fn patch_kcp(&self, spec: serde_json::Value) -> Result<(), RealError> {
        self.kcp()
            .patch(
                &format!("{CLUSTER}-control-plane"),
                &PatchParams::default(),
                &Patch::Merge(&json!({ "spec": spec })),
            )
            .await?;
        Ok(())
    }

    /// Sets KCP's replicas and waits until that many control-plane machines (and every worker)
    /// run with a Node.
    async fn scale_control_plane(
        &self,
        replicas: usize,
        what: &str,
    ) -> Result<Vec<Row>, RealError> {
        let wanted = i64::try_from(replicas)
            .map_err(|_| RealError::Option(format!("{replicas} replicas")))?;
        self.patch_kcp(json!({ "replicas": wanted })).await?;
        wait_rows(self.admin, self.namespace, what, self.timeout, |rows| {
            all_running(rows, replicas, self.workers)
        })
        .await
    }

    /// VMs the machines added, and the VMIDs the ProxmoxMachines record: one VM per machine.
    fn check_one_vm_per_machine(&self, rows: &[Row]) -> Result<usize, RealError> {
        let vms = self.sims.machine_vm_count();
        let vmids: BTreeSet<&str> = rows.iter().map(|r| r.vmid.as_str()).collect();
        if vms != rows.len() || vmids.len() != rows.len() || vmids.contains("-") {
            return Err(RealError::Check(format!(
                "{vms} VMs and VMIDs {vmids:?} for {} machines",
                rows.len()
            )));
        }
        Ok(vms)
    }
}

/// The next patch release of `version` (`v1.33.0` → `v1.33.1`).
fn next_patch(version: &str) -> Result<String, RealError> {
    let parts: Vec<&str> = version.trim_start_matches('v').split('.').collect();
    match parts.as_slice() {
        [major, minor, patch] => {
            let patch: u32 = patch
                .parse()
                .map_err(|_| RealError::Option(format!("{version} is not vX.Y.Z")))?;
            Ok(format!("v{major}.{minor}.{}", patch + 1))
        }
        _ => Err(RealError::Option(format!("{version} is not vX.Y.Z"))),
    }
}

/// KCP replaces every control-plane machine with one of the next patch version; each
/// replacement's VM lands in the failure domain KCP chose for it.
pub async fn roll_out(run: &Run<'_>, version: &str) -> Result<String, RealError> {
    let before: BTreeSet<String> = rows(run.admin, run.namespace)
        .await?
        .into_iter()
        .filter(|r| r.control_plane)
        .map(|r| r.machine)
        .collect();
    let next = next_patch(version)?;
    println!("Rolling the control plane out to {next}");
    run.patch_kcp(json!({ "version": next })).await?;
    let rows = wait_rows(
        run.admin,
        run.namespace,
        "the KCP rollout",
        run.timeout,
        |rows| {
            all_running(rows, run.control_plane, run.workers)
                && rows
                    .iter()
                    .filter(|r| r.control_plane)
                    .all(|r| r.version == next && !before.contains(&r.machine))
        },
    )
    .await?;
    let placement = check_placement(&rows, run.control_plane)?;
    let vms = run.check_one_vm_per_machine(&rows)?;
    Ok(format!(
        "rollout to {next}: {} control-plane machines replaced, {placement}, {vms} VMs",
        before.len()
    ))
}

/// KCP scales the control plane down to one machine and back up, spreading again.
pub async fn scale_down_and_up(run: &Run<'_>) -> Result<String, RealError> {
    println!("Scaling the control plane down to 1");
    let down = run
        .scale_control_plane(1, "the control plane at 1 machine")
        .await?;
    let vms_down = run.check_one_vm_per_machine(&down)?;
    println!("Scaling the control plane back to {}", run.control_plane);
    let up = run
        .scale_control_plane(run.control_plane, "the control plane back at full size")
        .await?;
    let placement = check_placement(&up, run.control_plane)?;
    let vms_up = run.check_one_vm_per_machine(&up)?;
    Ok(format!(
        "scale 3 → 1 → 3: {vms_down} VMs at 1, {vms_up} after, {placement}"
    ))
}

/// A worker's kubelet fails (its VM runs; a stopped VM capmox would start again); the real
/// MachineHealthCheck marks its Machine, the MachineSet replaces it in the same zone, and capmox
/// deletes the old VM.
pub async fn remediate_worker(run: &Run<'_>, zone: &str) -> Result<String, RealError> {
    let deployment = format!("{CLUSTER}-workers-{zone}");
    apply_health_check(run, &deployment, None).await?;
    let current = rows(run.admin, run.namespace).await?;
    let (victim, vmid) = worker_in(&current, zone)?;
    println!(
        "The kubelet of {} (VM {vmid} on {}) fails: its Node turns NotReady",
        victim.machine, victim.node
    );
    run.failed.fail(&victim.machine);
    let rows = wait_rows(
        run.admin,
        run.namespace,
        "the MachineHealthCheck remediation",
        run.timeout,
        |rows| {
            all_running(rows, run.control_plane, run.workers)
                && rows.iter().all(|r| r.machine != victim.machine)
        },
    )
    .await?;
    let replacement = rows
        .iter()
        .find(|r| !r.control_plane && r.failure_domain == zone)
        .ok_or_else(|| RealError::Check(format!("no worker in {zone} after remediation")))?;
    let placement = check_placement(&rows, run.control_plane)?;
    let vms = run.check_one_vm_per_machine(&rows)?;
    // One VM per machine: the old VM is gone (Proxmox may hand its VMID to the replacement).
    Ok(format!(
        "remediation: {} (kubelet failed, VM {vmid}) replaced by {} in {zone} on {} (VM {}), {placement}, {vms} VMs",
        victim.machine, replacement.machine, replacement.node, replacement.vmid
    ))
}

/// The worker of `zone` and its VMID.
fn worker_in(rows: &[Row], zone: &str) -> Result<(Row, u32), RealError> {
    let worker = rows
        .iter()
        .find(|r| !r.control_plane && r.failure_domain == zone)
        .cloned()
        .ok_or_else(|| RealError::Check(format!("no worker in {zone}")))?;
    let vmid = worker
        .vmid
        .parse()
        .map_err(|_| RealError::Check(format!("{} records no VMID", worker.machine)))?;
    Ok((worker, vmid))
}

/// Applies a MachineHealthCheck of the workers of `deployment` whose Nodes are not Ready for
/// 5 s, remediated through `template` (a ProxmoxRemediationTemplate) when given.
async fn apply_health_check(
    run: &Run<'_>,
    deployment: &str,
    template: Option<&str>,
) -> Result<(), RealError> {
    let mut health_check = json!({
        "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "MachineHealthCheck",
        "metadata": {"name": deployment, "namespace": run.namespace},
        "spec": {
            "clusterName": CLUSTER,
            "selector": {"matchLabels": {"cluster.x-k8s.io/deployment-name": deployment}},
            "checks": {"unhealthyNodeConditions": [
                {"type": "Ready", "status": "Unknown", "timeoutSeconds": 5},
                {"type": "Ready", "status": "False", "timeoutSeconds": 5}
            ]}
        }
    });
    if let Some(template) = template {
        health_check["spec"]["remediation"] = json!({"templateRef": {
            "apiVersion": format!("{}/{}", capmox::api::GROUP, capmox::api::VERSION),
            "kind": "ProxmoxRemediationTemplate", "name": template
        }});
    }
    let gvk = GroupVersionKind::gvk("cluster.x-k8s.io", "v1beta2", "MachineHealthCheck");
    Api::<DynamicObject>::namespaced_with(
        run.admin.clone(),
        run.namespace,
        &ApiResource::from_gvk(&gvk),
    )
    .patch(
        deployment,
        &PatchParams::apply("capmox-e2e-real"),
        &Patch::Apply(&health_check),
    )
    .await?;
    Ok(())
}

/// A worker's kubelet wedges (a restart cures it); the real MachineHealthCheck, told to remediate
/// through a ProxmoxRemediationTemplate, creates a ProxmoxRemediation; capmox reboots the VM, the
/// Node comes back, the MachineHealthCheck deletes the request, and the Machine is kept.
pub async fn reboot_worker(run: &Run<'_>, zone: &str) -> Result<String, RealError> {
    const TEMPLATE: &str = "reboot-first";
    let deployment = format!("{CLUSTER}-workers-{zone}");
    let template: capmox::api::ProxmoxRemediationTemplate = serde_json::from_value(json!({
        "apiVersion": format!("{}/{}", capmox::api::GROUP, capmox::api::VERSION),
        "kind": "ProxmoxRemediationTemplate",
        "metadata": {"name": TEMPLATE, "namespace": run.namespace},
        "spec": {"template": {"spec": {"strategy": {
            "type": "Reboot", "retryLimit": 1, "timeoutSeconds": 120, "shutdownTimeoutSeconds": 5
        }}}}
    }))
    .map_err(|e| RealError::Check(e.to_string()))?;
    Api::<capmox::api::ProxmoxRemediationTemplate>::namespaced(run.admin.clone(), run.namespace)
        .patch(
            TEMPLATE,
            &PatchParams::apply("capmox-e2e-real"),
            &Patch::Apply(&template),
        )
        .await?;
    apply_health_check(run, &deployment, Some(TEMPLATE)).await?;
    let before = rows(run.admin, run.namespace).await?;
    let (victim, vmid) = worker_in(&before, zone)?;
    let boots = run
        .sims
        .sim
        .boots(vmid)
        .ok_or_else(|| RealError::Check(format!("the simulator has no VM {vmid}")))?;
    println!(
        "The kubelet of {} (VM {vmid} on {}) wedges until its VM restarts: its Node turns NotReady",
        victim.machine, victim.node
    );
    let started = std::time::Instant::now();
    run.failed.fail_until_restart(&victim.machine, boots);
    let seen = wait_rebooted_and_healed(run, &victim.machine, vmid, boots).await?;
    let healed = started.elapsed();
    let after = wait_rows(
        run.admin,
        run.namespace,
        "every machine running after the reboot",
        run.timeout,
        |rows| all_running(rows, run.control_plane, run.workers),
    )
    .await?;
    let names = |rows: &[Row]| {
        rows.iter()
            .map(|r| r.machine.clone())
            .collect::<BTreeSet<_>>()
    };
    if names(&after) != names(&before) {
        return Err(RealError::Check(format!(
            "the reboot should have kept every Machine: before {:?}, after {:?}",
            names(&before),
            names(&after)
        )));
    }
    let vms = run.check_one_vm_per_machine(&after)?;
    let reboots = seen.retry_count.unwrap_or(0);
    Ok(format!(
        "reboot remediation: {} (kubelet wedged, VM {vmid}) rebooted by capmox ({reboots} reboot, boots {boots} → {}), its Node Ready again and the request deleted by the real MachineHealthCheck after {:.1}s; the Machine was kept, {vms} VMs",
        victim.machine,
        run.sims.sim.boots(vmid).unwrap_or(0),
        healed.as_secs_f64()
    ))
}

/// Waits until the real MachineHealthCheck created a ProxmoxRemediation for `machine`, capmox
/// restarted its VM `vmid` (booted `boots` times before) and the request is gone again (the
/// Node is Ready); the request's status as last seen.
async fn wait_rebooted_and_healed(
    run: &Run<'_>,
    machine: &str,
    vmid: u32,
    boots: u32,
) -> Result<capmox::api::ProxmoxRemediationStatus, RealError> {
    let requests: Api<capmox::api::ProxmoxRemediation> =
        Api::namespaced(run.admin.clone(), run.namespace);
    let mut seen = None;
    let deadline = tokio::time::Instant::now() + run.timeout;
    loop {
        let request = requests.get_opt(machine).await?;
        if let Some(request) = &request {
            seen = Some(request.status.clone().unwrap_or_default());
        }
        let restarted = run.sims.sim.boots(vmid).is_some_and(|now| now > boots);
        if let (None, true, Some(seen)) = (&request, restarted, &seen) {
            return Ok(seen.clone());
        }
        if tokio::time::Instant::now() > deadline {
            return Err(RealError::Check(format!(
                "reboot remediation of {machine}: request seen {seen:?}, restarted {restarted}, request now {:?}",
                request.and_then(|r| r.status)
            )));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Whether the CAPI Cluster offers `zone` to the control plane, as the real Cluster controller
/// copied it from the ProxmoxCluster; `None` while the zone is not listed.
async fn offered(run: &Run<'_>, zone: &str) -> Result<Option<bool>, RealError> {
    let gvk = GroupVersionKind::gvk("cluster.x-k8s.io", "v1beta2", "Cluster");
    let cluster = Api::<DynamicObject>::namespaced_with(
        run.admin.clone(),
        run.namespace,
        &ApiResource::from_gvk(&gvk),
    )
    .get(CLUSTER)
    .await?;
    let domains = cluster.data["status"]["failureDomains"].as_array().cloned();
    Ok(domains.into_iter().flatten().find_map(|d| {
        (d["name"].as_str() == Some(zone)).then(|| d["controlPlane"].as_bool().unwrap_or(false))
    }))
}

/// Waits until the CAPI Cluster offers `zone` to the control plane (`offered`) or not.
async fn wait_offered(run: &Run<'_>, zone: &str, wanted: bool) -> Result<(), RealError> {
    let deadline = tokio::time::Instant::now() + run.timeout;
    loop {
        if offered(run, zone).await? == Some(wanted) {
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(RealError::Timeout {
                what: format!("the Cluster offering {zone} to the control plane: {wanted}"),
                timeout: run.timeout,
            });
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Proxmox sends no events: an annotation makes the ProxmoxCluster controller look now rather
/// than at its next resync.
async fn touch_cluster(run: &Run<'_>, value: &str) -> Result<(), RealError> {
    Api::<capmox::api::ProxmoxCluster>::namespaced(run.admin.clone(), run.namespace)
        .patch(
            CLUSTER,
            &PatchParams::default(),
            &Patch::Merge(&json!({"metadata": {"annotations": {"e2e.capmox.dev/touched": value}}})),
        )
        .await?;
    Ok(())
}

/// Every storage for VM disks of `nodes` fills up (local) or goes inactive (Ceph), or recovers.
fn set_storages(run: &Run<'_>, nodes: &[&str], down: bool) {
    run.sims.sim.with_cluster(|cluster| {
        for node in nodes {
            cluster.fill_storage("local", node, if down { 99 } else { 0 });
            cluster.set_storage_active("ceph", node, !down);
        }
    });
}

/// A zone's storages fail: capmox stops offering it to the control plane, the real Cluster
/// controller copies that, and the real KCP puts the control-plane machines it adds (scaled up
/// by two) elsewhere. Once the storages recover the zone is offered again, and KCP scales back
/// down from the zone with the most machines.
pub async fn drain_unhealthy_zone(
    run: &Run<'_>,
    zone: &str,
    nodes: &[&str],
) -> Result<String, RealError> {
    let before: BTreeSet<String> = rows(run.admin, run.namespace)
        .await?
        .into_iter()
        .filter(|r| r.control_plane)
        .map(|r| r.machine)
        .collect();
    println!(
        "The storages of {zone} ({}) fill up and go inactive",
        nodes.join(", ")
    );
    set_storages(run, nodes, true);
    touch_cluster(run, "storages-down").await?;
    let drained_in = tokio::time::Instant::now();
    wait_offered(run, zone, false).await?;
    let drained_after = drained_in.elapsed();
    let larger = run.control_plane + 2;
    println!("{zone} is not offered to the control plane; scaling the control plane to {larger}");
    let up = run
        .scale_control_plane(
            larger,
            "the control plane scaled up beside the unhealthy zone",
        )
        .await?;
    let added: Vec<&super::real_capi::Row> = up
        .iter()
        .filter(|r| r.control_plane && !before.contains(&r.machine))
        .collect();
    if added.len() != 2 || added.iter().any(|r| r.failure_domain == zone) {
        let placed: Vec<String> = added
            .iter()
            .map(|r| format!("{} in {}", r.machine, r.failure_domain))
            .collect();
        return Err(RealError::Check(format!(
            "the control-plane machines KCP added while {zone} was unhealthy: {placed:?}"
        )));
    }
    let added_to: BTreeSet<&str> = added.iter().map(|r| r.failure_domain.as_str()).collect();
    println!("Both went to {added_to:?}; the storages of {zone} recover");
    set_storages(run, nodes, false);
    touch_cluster(run, "storages-back").await?;
    wait_offered(run, zone, true).await?;
    let back = run
        .scale_control_plane(run.control_plane, "the control plane back at its size")
        .await?;
    let placement = check_placement(&back, run.control_plane)?;
    let vms = run.check_one_vm_per_machine(&back)?;
    Ok(format!(
        "zone health: {zone}'s storages failed, it left the control plane after {:.1}s, the real KCP added both new control-plane machines in {added_to:?}; recovered and back at {}: {placement}, {vms} VMs",
        drained_after.as_secs_f64(),
        run.control_plane
    ))
}

#[cfg(test)]
mod tests {
    use super::next_patch;

    #[test]
    fn the_next_patch_release_is_one_up() {
        assert_eq!(next_patch("v1.33.0").expect("valid"), "v1.33.1");
        assert_eq!(next_patch("1.32.9").expect("valid"), "v1.32.10");
        assert!(next_patch("v1.33").is_err());
        assert!(next_patch("v1.33.x").is_err());
    }
}
