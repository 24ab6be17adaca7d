//! Data disks through the typed client over HTTP: `STORAGE:SIZE` in a config write
//! allocates volumes as Proxmox VE does, refusals come back as PVE words them (before the
//! task, in the task, or as a PUT's 500), resizes and VM deletion cover the new volumes.

use std::time::Duration;

use crate::api::client_for;
use capmox::proxmox::*;
use capmox_sim::{SimOptions, Simulator, StorageSpec, Topology};

fn waits() -> WaitOptions {
    WaitOptions {
        initial_interval: Duration::from_millis(20),
        factor: 1.5,
        max_interval: Duration::from_millis(200),
        deadline: Duration::from_secs(20),
    }
}

/// The example cluster plus `pve2-data` (only on pve2) and `isos` (no VM images).
fn topology() -> Topology {
    let mut topology = Topology::example();
    for (name, content, nodes) in [
        ("pve2-data", "images", vec!["pve2"]),
        ("isos", "iso", vec![]),
    ] {
        topology.storages.push(StorageSpec {
            name: name.into(),
            kind: "lvmthin".into(),
            shared: false,
            content: vec![content.into()],
            nodes: nodes.into_iter().map(str::to_owned).collect(),
            size_gib: 100,
        });
    }
    topology
}

/// Bytes used on `storage` as `node` lists it in `/cluster/resources`.
async fn used(client: &ProxmoxClient, storage: &str, node: &str) -> u64 {
    let resources = client
        .cluster_resources(Some(ResourceFilter::Storage))
        .await
        .expect("resources");
    resources
        .iter()
        .find(|r| r.storage.as_deref() == Some(storage) && r.node.as_deref() == Some(node))
        .and_then(|r| r.disk)
        .expect("storage listed")
}

/// A full clone of template 9000 as VM 100 on pve1: boot disk `local-lvm:vm-100-disk-0`.
async fn vm_100(client: &ProxmoxClient) {
    let params = CloneParams {
        newid: 100,
        full: Some(true),
        ..Default::default()
    };
    let upid = client.clone_vm("pve1", 9000, &params).await.expect("clone");
    client.wait_task(&upid, &waits()).await.expect("cloned");
}

#[tokio::test]
async fn two_disks_in_one_post_are_allocated_listed_resized_and_freed_with_the_vm() {
    let sim = Simulator::start(topology(), SimOptions::default())
        .await
        .expect("simulator");
    let client = client_for(&sim);
    vm_100(&client).await;
    let (ceph, lvm) = (
        used(&client, "ceph", "pve2").await,
        used(&client, "local-lvm", "pve1").await,
    );
    let update = ConfigUpdate::default()
        .set("scsi1", "ceph:20,discard=on,iothread=1,ssd=1")
        .set("virtio2", "local-lvm:8,format=raw");
    let task = client
        .update_vm_config("pve1", 100, &update)
        .await
        .expect("accepted");
    client
        .wait_task_ref(&task, &waits())
        .await
        .expect("qmconfig");
    let configs = sim
        .task_records()
        .into_iter()
        .filter(|r| r.kind == "qmconfig")
        .count();
    assert_eq!(configs, 1, "one task for both disks");

    let cfg = client.vm_config("pve1", 100).await.expect("config");
    assert_eq!(
        cfg.get("scsi1").as_deref(),
        Some("ceph:vm-100-disk-0,discard=on,iothread=1,size=20G,ssd=1")
    );
    assert_eq!(
        cfg.get("virtio2").as_deref(),
        Some("local-lvm:vm-100-disk-1,size=8G")
    );
    let listed = client
        .storage_content("pve1", "ceph", None, Some(100))
        .await
        .expect("content");
    assert_eq!(listed.len(), 1);
    assert_eq!(
        (
            listed[0].volid.as_str(),
            listed[0].size,
            listed[0].format.as_str()
        ),
        ("ceph:vm-100-disk-0", 20 << 30, "raw")
    );
    assert_eq!(
        used(&client, "ceph", "pve2").await,
        ceph + (20 << 30),
        "shared"
    );
    assert_eq!(used(&client, "local-lvm", "pve1").await, lvm + (8 << 30));

    let task = client
        .resize_disk("pve1", 100, "virtio2", "12G", None)
        .await
        .expect("resize");
    client
        .wait_task_ref(&task, &waits())
        .await
        .expect("resized");
    let cfg = client.vm_config("pve1", 100).await.expect("config");
    assert_eq!(
        cfg.get("virtio2").as_deref(),
        Some("local-lvm:vm-100-disk-1,size=12G")
    );
    let sizes: Vec<(String, u64)> = sim
        .volumes_of(100)
        .into_iter()
        .map(|v| (v.volid, v.size))
        .collect();
    assert_eq!(
        sizes,
        [
            ("ceph:vm-100-disk-0".to_owned(), 20 << 30),
            ("local-lvm:vm-100-disk-0".to_owned(), 10 << 30),
            ("local-lvm:vm-100-disk-1".to_owned(), 12 << 30),
        ]
    );

    let params = DeleteParams {
        purge: true,
        destroy_unreferenced_disks: true,
    };
    let task = client.delete_vm("pve1", 100, params).await.expect("delete");
    client
        .wait_task_ref(&task, &waits())
        .await
        .expect("deleted");
    assert_eq!(sim.volumes_of(100), []);
    let left = client
        .storage_content("pve1", "local-lvm", None, Some(100))
        .await
        .expect("content");
    assert!(left.is_empty(), "{left:?}");
    assert_eq!(used(&client, "ceph", "pve1").await, ceph, "space freed");
    assert_eq!(used(&client, "local-lvm", "pve1").await, lvm - (10 << 30));
}

#[tokio::test]
async fn storages_that_cannot_take_a_disk_fail_as_pve_words_it() {
    let sim = Simulator::start(topology(), SimOptions::default())
        .await
        .expect("simulator");
    let client = client_for(&sim);
    vm_100(&client).await;
    let disk = |value: &str| ConfigUpdate::default().set("scsi1", value);

    // checked before the task, as check_storage_access does
    let err = client
        .update_vm_config("pve1", 100, &disk("nope:5"))
        .await
        .expect_err("unknown storage");
    assert_eq!(
        err.reason(),
        Some("storage 'nope' does not exist"),
        "{err:?}"
    );
    let err = client
        .update_vm_config("pve1", 100, &disk("isos:5"))
        .await
        .expect_err("no images");
    assert!(
        matches!(&err, ProxmoxError::InvalidParameters { errors, .. }
            if errors.get("storage").map(String::as_str) == Some("storage 'isos' does not support vm images")),
        "{err:?}"
    );

    // checked by the allocation: the POST's task fails, a PUT fails with 500
    let free = 4096_u64 << 30;
    let too_big = format!(
        "not enough free space ({} < {})",
        free - (10 << 30),
        5000_u64 << 30
    );
    for (value, message) in [
        (
            "pve2-data:5",
            "storage 'pve2-data' is not available on node 'pve1'",
        ),
        ("ceph:5000", too_big.as_str()),
    ] {
        let task = client
            .update_vm_config("pve1", 100, &disk(value))
            .await
            .expect("a task");
        let err = client
            .wait_task_ref(&task, &waits())
            .await
            .expect_err("task fails");
        assert!(
            matches!(&err, ProxmoxError::TaskFailed { exitstatus, .. } if exitstatus == message),
            "{value}: {err:?}"
        );
        let err = client
            .update_vm_config_sync("pve1", 100, &disk(value))
            .await
            .expect_err("PUT fails");
        assert!(
            matches!(&err, ProxmoxError::Api { status: 500, reason } if reason == message),
            "{value}: {err:?}"
        );
    }
    let cfg = client.vm_config("pve1", 100).await.expect("config");
    assert_eq!(cfg.get("scsi1"), None, "nothing written");
    assert_eq!(sim.volumes_of(100).len(), 1, "only the boot disk");
}

#[tokio::test]
async fn efidisk_and_tpm_state_in_one_post_get_their_fixed_sizes_and_leave_with_the_vm() {
    let sim = Simulator::start(topology(), SimOptions::default())
        .await
        .expect("simulator");
    let client = client_for(&sim);
    vm_100(&client).await;
    let ceph = used(&client, "ceph", "pve2").await;
    let update = ConfigUpdate::default()
        .set("efidisk0", "ceph:1,efitype=4m,pre-enrolled-keys=0")
        .set("tpmstate0", "ceph:1,version=v2.0")
        .set("bios", "ovmf")
        .set("cpu", "host,flags=+aes;-pcid")
        .set("numa", "1");
    let task = client
        .update_vm_config("pve1", 100, &update)
        .await
        .expect("accepted");
    client
        .wait_task_ref(&task, &waits())
        .await
        .expect("qmconfig");
    let configs = sim
        .task_records()
        .into_iter()
        .filter(|r| r.kind == "qmconfig")
        .count();
    assert_eq!(configs, 1, "one task for the whole write");
    let cfg = client.vm_config("pve1", 100).await.expect("config");
    for (key, value) in [
        (
            "efidisk0",
            "ceph:vm-100-disk-0,efitype=4m,pre-enrolled-keys=0,size=4M",
        ),
        ("tpmstate0", "ceph:vm-100-disk-1,size=4M,version=v2.0"),
        ("bios", "ovmf"),
        ("cpu", "host,flags=+aes;-pcid"),
        ("numa", "1"),
    ] {
        assert_eq!(cfg.get(key).as_deref(), Some(value), "{key}");
    }
    let ceph_volumes: Vec<(String, u64)> = sim
        .volumes_of(100)
        .into_iter()
        .filter(|v| v.storage == "ceph")
        .map(|v| (v.volid, v.size))
        .collect();
    assert_eq!(
        ceph_volumes,
        [
            ("ceph:vm-100-disk-0".to_owned(), 4 << 20),
            ("ceph:vm-100-disk-1".to_owned(), 4 << 20),
        ]
    );
    assert_eq!(used(&client, "ceph", "pve2").await, ceph + (8 << 20));

    let params = DeleteParams {
        purge: true,
        destroy_unreferenced_disks: true,
    };
    let task = client.delete_vm("pve1", 100, params).await.expect("delete");
    client
        .wait_task_ref(&task, &waits())
        .await
        .expect("deleted");
    assert_eq!(sim.volumes_of(100), []);
    assert_eq!(used(&client, "ceph", "pve2").await, ceph, "space freed");
}
