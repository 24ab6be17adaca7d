//! PCI passthrough and DHCP through capmox's typed client over HTTP: the mapping and host
//! device endpoints answer as each PVE version's schema documents, a mapped GPU is taken at
//! start and refused to a second VM as PVE words it, a raw device write is refused to the
//! API token, and a guest asking DHCP gets its lease reported by the guest agent.

use std::time::Duration;

use crate::api::client_for;
use capmox::proxmox::*;
use capmox_sim::iso::build_iso;
use capmox_sim::{DhcpLease, SimOptions, Simulator, Topology};
use reqwest::Method as M;

use crate::ha::{API84, API91, call, check_returns, schema};

/// pve1 has a GPU (and a bridge PVE hides), pve2 none; `gpu` maps pve1's. vmbr0 serves DHCP.
const TOPOLOGY: &str = "
cluster_name: gpus
nodes:
  - name: pve1
    pci_devices:
      - {id: '0000:00:01.0', vendor: '8086', device: '1901', class: '060400'}
      - {id: '0000:01:00.0', vendor: '10de', device: '2204', iommugroup: 14, vendor_name: NVIDIA Corporation}
  - name: pve2
storages:
  - {name: ceph, type: rbd, shared: true}
  - {name: local, type: dir, content: [iso]}
pci_mappings:
  - name: gpu
    description: RTX 3090
    map: [{node: pve1, path: '0000:01:00.0', id: '10de:2204', iommugroup: 14}]
dhcp:
  - {bridge: vmbr0, range4: 10.0.9.100-10.0.9.200, prefix4: 24, range6: 'fd00::100-fd00::1ff', prefix6: 64}
templates:
  - {vmid: 9000, name: gpu-template, node: pve1, storage: ceph, config: {agent: '1', machine: q35, net0: 'virtio=BC:24:11:00:90:00,bridge=vmbr0'}}
";

async fn sim(version: &str) -> Simulator {
    let opts = SimOptions {
        version: version.into(),
        task_duration: Duration::from_millis(20),
        clone_duration: Duration::from_millis(20),
        boot_delay: Duration::from_millis(50),
        ..SimOptions::default()
    };
    Simulator::start(
        Topology::from_yaml(TOPOLOGY, "gpus").expect("topology"),
        opts,
    )
    .await
    .expect("simulator")
}

fn waits() -> WaitOptions {
    WaitOptions {
        initial_interval: Duration::from_millis(20),
        factor: 1.5,
        max_interval: Duration::from_millis(100),
        deadline: Duration::from_secs(20),
    }
}

async fn clone(client: &ProxmoxClient, newid: u32) {
    let params = CloneParams {
        newid,
        ..Default::default()
    };
    let upid = client.clone_vm("pve1", 9000, &params).await.expect("clone");
    client.wait_task(&upid, &waits()).await.expect("cloned");
}

#[tokio::test]
async fn mappings_and_host_devices_answer_as_each_schema_documents() {
    for (version, file) in [("9.1.4", API91), ("8.4.14", API84)] {
        let sim = sim(version).await;
        let client = client_for(&sim);
        let mappings = client.pci_mappings().await.expect("mappings");
        assert_eq!(mappings.len(), 1);
        assert_eq!(mappings[0].id, "gpu");
        assert_eq!(mappings[0].description.as_deref(), Some("RTX 3090"));
        let entry = mappings[0].entries_on("pve1").next().expect("pve1 entry");
        assert_eq!(
            (entry.path.as_str(), entry.id.as_str(), entry.iommugroup),
            ("0000:01:00.0", "10de:2204", Some(14))
        );
        assert_eq!(mappings[0].entries_on("pve2").count(), 0);
        let devices = client.node_pci_devices("pve1").await.expect("devices");
        let ids: Vec<&str> = devices.iter().map(|d| d.id.as_str()).collect();
        assert_eq!(ids, ["0000:01:00.0"], "bridges are filtered");
        assert_eq!(devices[0].vendor, "0x10de");
        assert_eq!(devices[0].iommugroup, Some(14));
        assert!(
            client
                .node_pci_devices("pve2")
                .await
                .expect("none")
                .is_empty()
        );

        let api = schema(file);
        let mut problems = Vec::new();
        for (path, query) in [
            ("/cluster/mapping/pci", &[][..]),
            ("/cluster/mapping/pci", &[("check-node", "pve2")]),
            ("/cluster/mapping/pci/gpu", &[]),
            (
                "/nodes/pve1/hardware/pci",
                &[("pci-class-blacklist", ""), ("verbose", "0")],
            ),
        ] {
            let answer = call(&sim, M::GET, path, query).await.ok(path);
            let template = match path {
                "/cluster/mapping/pci/gpu" => "/cluster/mapping/pci/{id}",
                "/nodes/pve1/hardware/pci" => "/nodes/{node}/hardware/pci",
                p => p,
            };
            let returns = &api[template]["GET"]["returns"];
            assert!(returns.is_object(), "{template} in {file}");
            // PVE adds the section config's `type` and the file's `digest` to each mapping
            check_returns(
                template,
                returns,
                answer.data(),
                &["digest", "type"],
                &mut problems,
            );
            for param in query.iter().map(|(k, _)| *k) {
                let declared = &api[template]["GET"]["parameters"][param];
                assert!(declared.is_object(), "{template}: {param} in {file}");
            }
        }
        assert!(problems.is_empty(), "{file}:\n{}", problems.join("\n"));
        let missing = call(&sim, M::GET, "/cluster/mapping/pci/nope", &[]).await;
        assert_eq!(
            (missing.status, missing.reason.as_str()),
            (500, "mapping 'nope' not found")
        );
    }
}

#[tokio::test]
async fn a_mapped_gpu_is_taken_at_start_and_refused_to_a_second_vm() {
    let sim = sim("9.1.4").await;
    let client = client_for(&sim);
    for vmid in [100, 101] {
        clone(&client, vmid).await;
        let update = ConfigUpdate::default().set("hostpci0", "mapping=gpu,pcie=1");
        let task = client
            .update_vm_config("pve1", vmid, &update)
            .await
            .expect("written");
        client.wait_task_ref(&task, &waits()).await.expect("config");
    }
    let task = client
        .power("pve1", 100, PowerAction::Start)
        .await
        .expect("start");
    client
        .wait_task_ref(&task, &waits())
        .await
        .expect("started");
    assert_eq!(sim.pci_in_use("pve1"), [("0000:01:00.0".to_owned(), 100)]);
    let task = client
        .power("pve1", 101, PowerAction::Start)
        .await
        .expect("start");
    let e = client
        .wait_task_ref(&task, &waits())
        .await
        .expect_err("no free device");
    assert_eq!(
        e.reason(),
        Some("PCI device '0000:01:00.0' already in use by VMID '100'")
    );
    // an API token may not pass a raw device through
    let raw = ConfigUpdate::default().set("hostpci1", "0000:01:00.0");
    let e = client
        .update_vm_config_sync("pve1", 101, &raw)
        .await
        .expect_err("raw device");
    assert_eq!(
        e.reason(),
        Some("only root can set 'hostpci1' config for non-mapped devices")
    );
    let task = client
        .power("pve1", 100, PowerAction::Stop)
        .await
        .expect("stop");
    client
        .wait_task_ref(&task, &waits())
        .await
        .expect("stopped");
    assert!(sim.pci_in_use("pve1").is_empty());
}

#[tokio::test]
async fn a_guest_asking_dhcp_reports_its_lease() {
    let sim = sim("9.1.4").await;
    let client = client_for(&sim);
    clone(&client, 100).await;
    let config = client.vm_config("pve1", 100).await.expect("config");
    let mac = config.nics()[0]
        .mac
        .clone()
        .expect("MAC")
        .to_ascii_lowercase();
    let network = format!(
        "network:\n  version: 2\n  ethernets:\n    eth0:\n      match: {{macaddress: '{mac}'}}\n      dhcp4: true\n      dhcp6: true\n"
    );
    let iso = build_iso(
        "cidata",
        &[
            ("user-data", b"#cloud-config\n"),
            ("meta-data", b"instance-id: x\n"),
            ("network-config", network.as_bytes()),
        ],
    );
    let task = client
        .upload_iso("pve1", "local", "seed-100.iso", iso)
        .await
        .expect("upload");
    client
        .wait_task_ref(&task, &waits())
        .await
        .expect("uploaded");
    let update = ConfigUpdate::default().set("ide2", "local:iso/seed-100.iso,media=cdrom");
    client
        .update_vm_config_sync("pve1", 100, &update)
        .await
        .expect("attached");
    let task = client
        .power("pve1", 100, PowerAction::Start)
        .await
        .expect("start");
    client
        .wait_task_ref(&task, &waits())
        .await
        .expect("started");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let nics = loop {
        match client.agent_network_interfaces("pve1", 100).await {
            Ok(nics) => break nics,
            Err(e) if e.is_agent_unavailable() && tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("agent: {e}"),
        }
    };
    let eth0 = nics.iter().find(|n| n.name == "eth0").expect("eth0");
    let addresses: Vec<(String, u64)> = eth0
        .ip_addresses
        .iter()
        .map(|a| (a.ip_address.clone(), a.prefix))
        .collect();
    assert_eq!(
        addresses,
        [
            ("10.0.9.100".to_owned(), 24),
            ("fd00::100".to_owned(), 64),
            ("fe80::1000".to_owned(), 64)
        ]
    );
    assert_eq!(
        sim.dhcp_leases(),
        [DhcpLease {
            bridge: "vmbr0".into(),
            mac,
            vmid: 100,
            ipv4: Some("10.0.9.100/24".into()),
            ipv6: Some("fd00::100/64".into()),
        }]
    );
}
