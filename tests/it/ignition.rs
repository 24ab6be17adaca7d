//! Flatcar machines: Ignition bootstrap data (`format: ignition`) end to end. The seed image a
//! machine boots from is read back by pycdlib and its merged config checked (hostname, instance
//! id, networkd units for the claimed address, the bootstrap's own files and units); malformed
//! Ignition is refused before the clone, and when it turns bad after the clone, the VM is left
//! stopped without a seed until the Secret is fixed.

use crate::machine_support::scenario::{
    self, Scenario, machine_condition, sim_options, wait_event,
};

use std::collections::BTreeMap;

use capmox::api::ProxmoxMachine;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, Patch, PatchParams};
use serde_json::{Value, json};

/// Shaped like Flatcar's kubeadm bootstrap output: spec 2.3, a kubeadm unit reading
/// `/etc/proxmox-env`, a placeholder `/etc/hostname`.
const BOOTSTRAP: &str = include_str!("../data/ignition/kubeadm-flatcar-v2.3.json");

/// Makes the machine's bootstrap Secret hold `value` in `format`, as a bootstrap provider would.
async fn set_bootstrap(scenario: &Scenario, machine: &str, format: &str, value: &str) {
    Api::<Secret>::namespaced(scenario.env.client(), "default")
        .patch(
            &format!("{machine}-bootstrap"),
            &PatchParams::default(),
            &Patch::Merge(json!({"data": {
                "format": ByteString(format.as_bytes().to_vec()),
                "value": ByteString(value.as_bytes().to_vec()),
            }})),
        )
        .await
        .expect("bootstrap Secret patched");
}

/// A Flatcar machine: no cloud-init to wait for, as in the Go provider's flatcar template.
fn flatcar_spec() -> Value {
    let mut spec = scenario::machine_spec();
    spec["checks"] = json!({"skipCloudInitStatus": true});
    spec
}

/// The entries of a JSON array whose `key` is `id`.
fn by<'a>(list: &'a Value, key: &str, id: &str) -> Vec<&'a Value> {
    list.as_array()
        .map(|items| items.iter().filter(|e| e[key] == json!(id)).collect())
        .unwrap_or_default()
}

#[tokio::test]
async fn a_flatcar_machine_boots_from_a_seed_with_the_merged_ignition_config() {
    let mut scenario = Scenario::start(sim_options()).await;
    scenario.stop_controllers().await;
    scenario.create_with("flatcar-1", flatcar_spec()).await;
    set_bootstrap(&scenario, "flatcar-1", "ignition", BOOTSTRAP).await;
    scenario.start_controllers();
    let machine = scenario.wait_ready("flatcar-1").await;
    scenario.assert_one_vm(&machine, "provisioned").await;

    let status = machine.status.clone().expect("status");
    let vmid = u32::try_from(status.virtual_machine_id.expect("vmid")).expect("vmid fits");
    let node = status.proxmox_node.clone().expect("node");
    let ip = status
        .ip_addresses
        .iter()
        .find(|a| a.net == "default")
        .and_then(|a| a.ipv4.first().cloned())
        .expect("an IPv4 address");
    let proxmox = scenario.env.proxmox();
    let config = proxmox.vm_config(&node, vmid).await.expect("VM config");
    let uuid = capmox::controller::machine::smbios_uuid(&config).expect("SMBIOS uuid");
    assert_eq!(
        machine.spec.provider_id.as_deref(),
        Some(format!("proxmox://{uuid}").as_str())
    );
    let mac = capmox::cloudinit::mac_from_net_config(&config.get("net0").expect("net0"))
        .expect("net0 MAC")
        .to_ascii_lowercase();

    // The seed image, as Flatcar's Ignition finds it: volume cidata, the NoCloud names.
    let image = scenario
        .env
        .sim
        .with_cluster(|c| c.attached_seed_image(vmid))
        .expect("a seed image attached to the VM");
    let read = crate::cloudinit_iso::read_back("ignition", &image);
    assert_eq!(read.volume_id, "cidata");
    assert!(read.joliet && read.rock_ridge, "{read:?}");
    let files = read.rock_ridge_files;
    assert_eq!(
        crate::cloudinit_iso::without_versions(read.joliet_files),
        files,
        "Joliet and Rock Ridge name the same files"
    );
    assert_eq!(
        files.keys().map(String::as_str).collect::<Vec<_>>(),
        ["meta-data", "network-config", "user-data"]
    );
    assert_eq!(
        String::from_utf8_lossy(&files["meta-data"]),
        format!("instance-id: {uuid}\nlocal-hostname: flatcar-1\nhostname: flatcar-1\n")
    );
    assert_eq!(files["network-config"], b"version: 1\nconfig: []\n");

    let merged: Value = serde_json::from_slice(&files["user-data"]).expect("user-data is JSON");
    let original: Value = serde_json::from_str(BOOTSTRAP).expect("fixture");
    assert_eq!(merged["ignition"], original["ignition"]);
    assert_eq!(merged["passwd"], original["passwd"]);
    let files_in = &merged["storage"]["files"];
    assert_eq!(
        by(files_in, "path", "/etc/kubeadm.yml"),
        [&original["storage"]["files"][0]],
        "the bootstrap's own file is kept"
    );
    assert_eq!(
        by(files_in, "path", "/etc/hostname"),
        [
            &json!({"filesystem": "root", "path": "/etc/hostname", "overwrite": true, "mode": 420,
                 "contents": {"source": "data:,flatcar-1"}})
        ],
        "the hostname replaces the bootstrap's placeholder"
    );
    assert_eq!(
        by(files_in, "path", "/etc/proxmox-env")[0]["contents"]["source"],
        json!(format!(
            "data:,COREOS_CUSTOM_HOSTNAME=flatcar-1%0ACOREOS_CUSTOM_INSTANCE_ID={uuid}%0A\
             COREOS_CUSTOM_PROVIDER_ID=proxmox://{uuid}%0ACOREOS_CUSTOM_PRIVATE_IPV4={ip}/24%0A"
        ))
    );
    let units = &merged["systemd"]["units"];
    assert_eq!(
        by(units, "name", "kubeadm.service"),
        [&original["systemd"]["units"][0]]
    );
    assert_eq!(
        by(units, "name", "containerd.service"),
        [&original["systemd"]["units"][1]]
    );
    assert_eq!(
        by(units, "name", "systemd-resolved.service"),
        [&json!({"name": "systemd-resolved.service", "enabled": true})]
    );
    // The cluster's pool (gateway 10.0.0.1) and DNS server.
    assert_eq!(
        merged["networkd"]["units"],
        json!([{
            "name": "00-eth0.network",
            "contents": format!(
                "[Match]\nMACAddress={mac}\n\n[Network]\nDNS=10.0.0.2\n\n\
                 [Address]\nAddress={ip}/24\n\n\
                 [Route]\nDestination=0.0.0.0/0\nGateway=10.0.0.1\n"
            ),
        }])
    );

    // The guest read its address from the networkd unit, and it is Flatcar.
    let interfaces = proxmox
        .agent_network_interfaces(&node, vmid)
        .await
        .expect("guest agent answers");
    let eth0 = interfaces
        .iter()
        .find(|i| i.name == "eth0")
        .expect("eth0 reported");
    assert!(
        eth0.ip_addresses.iter().any(|a| a.ip_address == ip),
        "guest reports {eth0:?}, expected {ip}"
    );
    let os = proxmox.agent_os_info(&node, vmid).await.expect("os info");
    assert_eq!(os.id.as_deref(), Some("flatcar"));
}

/// Waits until the machine reports `reason` (not ready); returns it and the condition's message.
async fn refused(scenario: &Scenario, name: &str, reason: &str) -> (ProxmoxMachine, String) {
    let machine = scenario
        .env
        .wait_machine(name, reason, |m| {
            machine_condition(m, "VirtualMachineProvisioned").is_some_and(|c| c.1 == reason)
        })
        .await;
    let (status, _, message) =
        machine_condition(&machine, "VirtualMachineProvisioned").expect("condition");
    assert_eq!(status, "False");
    let ready = machine_condition(&machine, "Ready").expect("Ready");
    assert_eq!((ready.0.as_str(), ready.1.as_str()), ("False", reason));
    assert!(!machine.is_provisioned());
    (machine, message)
}

#[tokio::test]
async fn malformed_ignition_is_refused_before_anything_changes_in_proxmox() {
    let mut scenario = Scenario::start(sim_options()).await;
    let vms_before = scenario.vms().await;
    scenario.stop_controllers().await;
    scenario.create_with("flatcar-2", flatcar_spec()).await;
    set_bootstrap(
        &scenario,
        "flatcar-2",
        "ignition",
        r#"{"ignition": {"version": "3.4.0"}, "storage": {"files": {"path": "/etc/motd"}}}"#,
    )
    .await;
    scenario.start_controllers();
    let (machine, message) = refused(&scenario, "flatcar-2", "BootstrapDataInvalid").await;
    assert_eq!(
        message,
        "bootstrap Secret flatcar-2-bootstrap: the Ignition config's storage.files is a JSON \
         object, but must be an array"
    );
    let warning = wait_event(&scenario.env, "flatcar-2", "BootstrapDataInvalid").await;
    assert_eq!(warning.type_.as_deref(), Some("Warning"));
    assert_eq!(warning.note.as_deref(), Some(message.as_str()));

    // Nothing was created or changed in Proxmox, and the status records no VM.
    assert_eq!(scenario.vms().await, vms_before);
    assert!(
        scenario.tap.log().iter().all(|s| s.method == "GET"),
        "no mutating Proxmox request: {:?}",
        scenario.tap.log()
    );
    assert_eq!(
        machine.status.as_ref().and_then(|s| s.virtual_machine_id),
        None
    );
    assert_eq!(scenario.seed_isos().await, Vec::<String>::new());
}

#[tokio::test]
async fn ignition_that_turns_bad_after_the_clone_leaves_the_vm_stopped_without_a_seed() {
    let scenario = Scenario::start(sim_options()).await;
    // The data was good when the machine was checked; it changes while the clone runs.
    let tripped = scenario.create_until_clone("demo-md-1").await;
    set_bootstrap(&scenario, "demo-md-1", "ignition", "#cloud-config\n").await;
    let _ = tripped.resume.send(());
    let (machine, message) = refused(&scenario, "demo-md-1", "BootstrapDataInvalid").await;
    assert!(
        message.starts_with("the bootstrap data is not an Ignition config: it is not JSON"),
        "{message}"
    );
    // The VM is the machine's, configured but stopped, with no seed image uploaded or attached.
    scenario.assert_vm_of(&machine, "refused").await;
    let status = machine.status.clone().expect("status");
    let vmid = u32::try_from(status.virtual_machine_id.expect("vmid")).expect("vmid fits");
    let node = status.proxmox_node.clone().expect("node");
    assert_eq!(scenario.seed_isos().await, Vec::<String>::new());
    let proxmox = scenario.env.proxmox();
    let config = proxmox.vm_config(&node, vmid).await.expect("VM config");
    assert!(
        config.get("ide0").is_none_or(|v| !v.contains("user-data-")),
        "{config:?}"
    );
    let vm = proxmox.find_vm(vmid).await.expect("resources").expect("VM");
    assert_eq!(vm.status.as_deref(), Some("stopped"));
    let started: Vec<String> = scenario
        .tap
        .log()
        .iter()
        .filter(|s| s.path.ends_with("/status/start") || s.path.ends_with("/upload"))
        .map(|s| s.path.clone())
        .collect();
    assert_eq!(started, Vec::<String>::new(), "no upload, no start");

    // Fixed data is picked up by the next pass; a change to the machine brings it at once (a
    // Flatcar guest has no cloud-init to wait for).
    set_bootstrap(&scenario, "demo-md-1", "ignition", BOOTSTRAP).await;
    Api::<ProxmoxMachine>::namespaced(scenario.env.client(), "default")
        .patch(
            "demo-md-1",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"checks": {"skipCloudInitStatus": true}}})),
        )
        .await
        .expect("machine patched");
    let machine = scenario.wait_ready("demo-md-1").await;
    scenario.assert_one_vm(&machine, "fixed").await;
    let image = scenario
        .env
        .sim
        .with_cluster(|c| c.attached_seed_image(vmid))
        .expect("seed attached");
    let files: BTreeMap<String, Vec<u8>> =
        crate::cloudinit_iso::read_back("ignition-fixed", &image).rock_ridge_files;
    let merged: Value = serde_json::from_slice(&files["user-data"]).expect("JSON");
    assert_eq!(
        by(&merged["storage"]["files"], "path", "/etc/hostname")[0]["contents"]["source"],
        "data:,demo-md-1"
    );
}
