//! `clusterctl move` of the running cluster to a second management cluster (`--move-to`): the
//! target gets capmox's CRDs, its shipped RBAC and a provider inventory entry, a second capmox
//! (as the target's ServiceAccount) and IPAM stand-in, and the real clusterctl moves the
//! objects. capmox on the target must adopt every VM (none created, none deleted), capmox on
//! the source must leave them alone.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use super::real::{Created, RealError, ServiceAccountRef, install_crds, install_rbac};
use super::real_capi::{Shipped, all_running, check_placement, rows, wait_rows};
use super::real_capi_steps::Run;
use super::workload::{self, FailedKubelets, WorkloadCluster};
use capmox::controller::GlobalCredentials;

/// The target management cluster of a move, and what the run created there.
pub struct Target {
    /// Admin client of the target.
    pub admin: Client,
    /// What the run created on the target (removed at the end).
    pub created: Vec<Created>,
}

/// The workload cluster the moved cluster keeps: its API server and what runs on it.
pub struct Workload {
    /// Client of the workload cluster's API server.
    pub api: Client,
    /// The cluster it belongs to.
    pub cluster: WorkloadCluster,
    /// Which VMs run.
    pub sim: capmox_sim::SimHandle,
}

/// Reads a kubeconfig file, optionally impersonating `account`.
async fn client_for(path: &Path, account: Option<&ServiceAccountRef>) -> Result<Client, RealError> {
    let kubeconfig = Kubeconfig::read_from(path)
        .map_err(|e| RealError::Option(format!("--move-to {}: {e}", path.display())))?;
    let mut config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .map_err(|e| RealError::Option(format!("--move-to {}: {e}", path.display())))?;
    if let Some(account) = account {
        config.auth_info.impersonate = Some(account.user());
        config.auth_info.impersonate_groups = Some(account.groups());
    }
    Client::try_from(config).map_err(RealError::Kube)
}

/// capmox's entry in clusterctl's provider inventory, as `clusterctl init` would write it;
/// `clusterctl move` wants every provider of the source on the target.
async fn register_provider(admin: &Client, namespace: &str) -> Result<(), RealError> {
    let provider = json!({
        "apiVersion": "clusterctl.cluster.x-k8s.io/v1alpha3", "kind": "Provider",
        "metadata": {"name": "infrastructure-proxmox", "namespace": namespace,
                     "labels": {"clusterctl.cluster.x-k8s.io": "",
                                "cluster.x-k8s.io/provider": "infrastructure-proxmox"}},
        "providerName": "proxmox", "type": "InfrastructureProvider", "version": "v0.1.0"
    });
    let gvk = GroupVersionKind::gvk("clusterctl.cluster.x-k8s.io", "v1alpha3", "Provider");
    Api::<DynamicObject>::namespaced_with(admin.clone(), namespace, &ApiResource::from_gvk(&gvk))
        .patch(
            "infrastructure-proxmox",
            &PatchParams::apply("capmox-e2e-real").force(),
            &Patch::Apply(&provider),
        )
        .await?;
    Ok(())
}

/// Prepares the target: CRDs, shipped RBAC, the run's namespace and the provider inventory on
/// both sides.
pub async fn prepare(
    source: &Client,
    target_kubeconfig: &Path,
    shipped: &Shipped<'_>,
    options: &super::real::RealOptions,
) -> Result<Target, RealError> {
    let admin = client_for(target_kubeconfig, None).await?;
    super::real_capi::check_real_capi(&admin).await?;
    let mut created = Vec::new();
    install_crds(&admin, options, shipped.webhook).await?;
    install_rbac(&admin, shipped.rbac, options.timeout, &mut created).await?;
    let namespace = json!({"apiVersion": "v1", "kind": "Namespace",
                           "metadata": {"name": options.namespace}});
    install_rbac(
        &admin,
        std::slice::from_ref(&namespace),
        options.timeout,
        &mut created,
    )
    .await?;
    for client in [source, &admin] {
        register_provider(client, &shipped.account.namespace).await?;
    }
    Ok(Target { admin, created })
}

/// Everything that runs against the target after the move: capmox as the target's
/// ServiceAccount, the IPAM stand-in and the workload stand-in reading the target's Machines.
pub async fn start_on_target(
    target: &Target,
    target_kubeconfig: &Path,
    shipped: &Shipped<'_>,
    credentials: GlobalCredentials,
    workload: Workload,
    stop: &CancellationToken,
) -> Result<(), RealError> {
    let manager_client = client_for(target_kubeconfig, Some(shipped.account)).await?;
    let config = super::real::manager_config();
    tokio::spawn(capmox::controller::run(
        manager_client,
        config,
        credentials,
        stop.clone(),
    ));
    tokio::spawn(super::ipam::run(target.admin.clone(), stop.clone()));
    tokio::spawn(workload::run(
        target.admin.clone(),
        workload.api,
        workload.cluster,
        workload.sim,
        FailedKubelets::default(),
        stop.clone(),
    ));
    Ok(())
}

/// Runs the real `clusterctl move` of the run's namespace to the target.
fn clusterctl_move(
    clusterctl: &Path,
    source: &Path,
    target: &Path,
    namespace: &str,
) -> Result<(), RealError> {
    let output = std::process::Command::new(clusterctl)
        .args(["move", "--namespace", namespace, "--kubeconfig"])
        .arg(source)
        .arg("--to-kubeconfig")
        .arg(target)
        .env("CLUSTERCTL_DISABLE_VERSIONCHECK", "true")
        .output()
        .map_err(|e| RealError::Option(format!("cannot run {}: {e}", clusterctl.display())))?;
    if !output.status.success() {
        return Err(RealError::Check(format!(
            "clusterctl move failed: {}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        )));
    }
    Ok(())
}

/// The KUBECONFIG the run uses (the source of the move).
fn source_kubeconfig() -> Result<PathBuf, RealError> {
    std::env::var_os("KUBECONFIG")
        .map(PathBuf::from)
        .ok_or_else(|| RealError::Option("--move-to needs KUBECONFIG set to one file".into()))
}

/// Moves the cluster and checks that the target's capmox adopted every VM: the same VMIDs, no
/// VM more or less, every Machine Running with its Node again.
pub async fn move_cluster(
    run: &Run<'_>,
    target: &Target,
    target_kubeconfig: &Path,
    clusterctl: &Path,
) -> Result<String, RealError> {
    let before = rows(run.admin, run.namespace).await?;
    let vmids: BTreeSet<String> = before.iter().map(|r| r.vmid.clone()).collect();
    let vms_before = run.sims.machine_vm_count();
    println!("Moving the cluster to {}", target_kubeconfig.display());
    clusterctl_move(
        clusterctl,
        &source_kubeconfig()?,
        target_kubeconfig,
        run.namespace,
    )?;
    let left_on_source = rows(run.admin, run.namespace).await?.len();
    let after = wait_rows(
        &target.admin,
        run.namespace,
        "every moved Machine Running on the target",
        run.timeout,
        |rows| {
            all_running(rows, run.control_plane, run.workers)
                && rows.iter().map(|r| r.vmid.clone()).collect::<BTreeSet<_>>() == vmids
        },
    )
    .await?;
    let placement = check_placement(&after, run.control_plane)?;
    let vms_after = run.sims.machine_vm_count();
    if vms_after != vms_before || left_on_source != 0 {
        return Err(RealError::Check(format!(
            "after the move: {vms_after} VMs (before: {vms_before}), {left_on_source} Machines left on the source"
        )));
    }
    Ok(format!(
        "move: {} Machines on the target with the same {} VMs ({placement}), none left on the source",
        after.len(),
        vms_after
    ))
}
