//! The hardware step of the real-controllers run: a MachineDeployment whose machines have a
//! data disk, a GPU of the simulator's `gpu` PCI resource mapping and a DHCP address. The real
//! MachineSet makes the Machine; capmox places it on the one node of the zone the mapping has a
//! device on, writes the disk and the device into the VM, learns the lease from the guest agent
//! and claims no address; deleting the MachineDeployment frees the device and the disk.

use kube::ResourceExt;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, PostParams};
use serde_json::json;

use super::real::RealError;
use super::real_capi::{CLUSTER, rows, wait_rows};
use super::real_capi_steps::Run;
use capmox::api::{MachineAddressType, ProxmoxMachine, ProxmoxMachineTemplate};
use capmox::capi::IPAddressClaim;

/// The PCI resource mapping of the sandbox topology, and the one node of rack-a it has a device on.
const MAPPING: &str = "gpu";
const MAPPED_NODE: &str = "pve2";
/// The bridge the sandbox topology serves DHCP on, and the range it leases from.
const DHCP_PREFIX: &str = "10.0.9.";

fn deployments(run: &Run<'_>) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk("cluster.x-k8s.io", "v1beta2", "MachineDeployment");
    Api::namespaced_with(
        run.admin.clone(),
        run.namespace,
        &ApiResource::from_gvk(&gvk),
    )
}

/// A MachineDeployment of one machine in `zone` built like the zone's workers, with a data disk,
/// a GPU and DHCP on its first NIC.
pub async fn hardware_worker(run: &Run<'_>, zone: &str) -> Result<String, RealError> {
    let name = format!("{CLUSTER}-workers-hardware");
    let workers = deployments(run)
        .get(&format!("{CLUSTER}-workers-{zone}"))
        .await?;
    let template_spec = &workers.data["spec"]["template"]["spec"];
    let templates = Api::<ProxmoxMachineTemplate>::namespaced(run.admin.clone(), run.namespace);
    let base = templates
        .get(
            template_spec["infrastructureRef"]["name"]
                .as_str()
                .unwrap_or_default(),
        )
        .await?;
    let mut template = ProxmoxMachineTemplate::new(&name, base.spec.clone());
    template.metadata.namespace = Some(run.namespace.to_owned());
    let machine = &mut template.spec.template.spec;
    machine.disks.get_or_insert_default().additional_volumes =
        serde_json::from_value(json!([{"disk": "scsi1", "sizeGb": 10}]))
            .map_err(|e| RealError::Check(e.to_string()))?;
    machine.pci_devices = serde_json::from_value(json!([{"mapping": MAPPING, "pcie": true}]))
        .map_err(|e| RealError::Check(e.to_string()))?;
    let nic = machine
        .network
        .network_devices
        .first_mut()
        .ok_or_else(|| RealError::Check("the workers' template has no NIC".into()))?;
    nic.default_ipv4 = None;
    nic.ip_pool_ref.clear();
    nic.dhcp4 = Some(true);
    templates.create(&PostParams::default(), &template).await?;

    let mut spec = template_spec.clone();
    spec["infrastructureRef"]["name"] = json!(name);
    let selector = json!({"cluster.x-k8s.io/cluster-name": CLUSTER, "capmox-e2e/hardware": "true"});
    let deployment: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "MachineDeployment",
        "metadata": {"name": name, "namespace": run.namespace},
        "spec": {
            "clusterName": CLUSTER, "replicas": 1,
            "selector": {"matchLabels": selector},
            "template": {"metadata": {"labels": selector}, "spec": spec}
        }
    }))
    .map_err(|e| RealError::Check(e.to_string()))?;
    deployments(run)
        .create(&PostParams::default(), &deployment)
        .await?;
    println!(
        "MachineDeployment {name}: 1 worker in {zone} with a data disk, a {MAPPING} GPU and DHCP"
    );

    let is_ours = |machine: &str| machine.starts_with(&name);
    let ready = wait_rows(
        run.admin,
        run.namespace,
        "the hardware worker Running with a Node",
        run.timeout,
        |rows| {
            rows.iter()
                .any(|r| is_ours(&r.machine) && r.phase == "Running" && r.node_ref)
        },
    )
    .await?;
    let row = ready
        .iter()
        .find(|r| is_ours(&r.machine))
        .cloned()
        .ok_or_else(|| RealError::Check("no hardware worker".into()))?;
    let found = check_hardware(run, &name, &row.node, &row.vmid).await?;

    deployments(run)
        .delete(&name, &DeleteParams::default())
        .await?;
    wait_rows(
        run.admin,
        run.namespace,
        "the hardware worker gone",
        run.timeout,
        |rows| rows.iter().all(|r| !is_ours(&r.machine)),
    )
    .await?;
    let vmid: u32 = row.vmid.parse().unwrap_or_default();
    let sim = &run.sims.sim;
    if !sim.pci_in_use(MAPPED_NODE).is_empty() || !sim.volumes_of(vmid).is_empty() {
        return Err(RealError::Check(format!(
            "VM {vmid}'s GPU or disks outlived it: {:?}, {:?}",
            sim.pci_in_use(MAPPED_NODE),
            sim.volumes_of(vmid)
        )));
    }
    templates.delete(&name, &DeleteParams::default()).await?;
    let left = rows(run.admin, run.namespace).await?.len();
    Ok(format!(
        "hardware: {} on {} (VM {vmid}) with {found}; deleted, GPU and disk freed, {left} machines left",
        row.machine, row.node
    ))
}

/// What the hardware worker got, checked against the simulator: its node has the mapping's
/// device, its VM the disk and the device, its address is a lease, and no address was claimed.
async fn check_hardware(
    run: &Run<'_>,
    name: &str,
    node: &str,
    vmid: &str,
) -> Result<String, RealError> {
    if node != MAPPED_NODE {
        return Err(RealError::Check(format!(
            "the {MAPPING} GPU is only on {MAPPED_NODE}, but the machine went to {node}"
        )));
    }
    let vmid: u32 = vmid
        .parse()
        .map_err(|_| RealError::Check(format!("no VMID for the hardware worker: {vmid}")))?;
    let sim = &run.sims.sim;
    let in_use = sim.pci_in_use(node);
    if !in_use.iter().any(|(_, holder)| *holder == vmid) {
        return Err(RealError::Check(format!(
            "VM {vmid} holds no device of {node}: {in_use:?}"
        )));
    }
    if sim.volumes_of(vmid).len() < 2 {
        return Err(RealError::Check(format!(
            "VM {vmid} has no data disk: {:?}",
            sim.volumes_of(vmid)
        )));
    }
    let machines = Api::<ProxmoxMachine>::namespaced(run.admin.clone(), run.namespace);
    let machine = machines
        .list(&Default::default())
        .await?
        .into_iter()
        .find(|m| m.name_any().starts_with(name))
        .ok_or_else(|| RealError::Check("no ProxmoxMachine of the hardware worker".into()))?;
    let lease = machine
        .status
        .iter()
        .flat_map(|s| &s.addresses)
        .find(|a| a.type_ == MachineAddressType::InternalIp)
        .map(|a| a.address.clone())
        .unwrap_or_default();
    if !lease.starts_with(DHCP_PREFIX) {
        return Err(RealError::Check(format!(
            "the hardware worker's address {lease:?} is no DHCP lease of {DHCP_PREFIX}0/24"
        )));
    }
    let claims = Api::<IPAddressClaim>::namespaced(run.admin.clone(), run.namespace)
        .list(&Default::default())
        .await?
        .into_iter()
        .filter(|c| c.name_any().starts_with(&machine.name_any()))
        .count();
    if claims > 0 {
        return Err(RealError::Check(format!(
            "{claims} IPAddressClaim(s) for a machine that takes its address by DHCP"
        )));
    }
    Ok(format!(
        "scsi1, hostpci0 mapping={MAPPING}, lease {lease}, no IPAddressClaim"
    ))
}
