//! What a user sees when Proxmox fails (errors injected by the tap in front of the simulator):
//! a condition reason and a Warning event per kind of failure, saying what failed and what to
//! fix; a per-machine back-off that thins out a whole fleet's requests during an outage (and
//! waits as long as a rate limit asks); and every machine provisioned once Proxmox answers
//! again. Also what must not be lost to a failure: the seed ISO (it holds the bootstrap token)
//! when its deletion fails once, and the deletion of a machine whose VM Proxmox answers 404 for
//! (where PVE answers 500 "does not exist"). And a VM config that lacks its SMBIOS UUID is
//! polled with back-off, not every second.

use crate::common::env::eventually;
use crate::machine_support::{scenario, tap};

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, SystemTime};

use capmox::api::ProxmoxMachine;
use capmox_sim::SimOptions;
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, ListParams};
use scenario::{
    Scenario, condition_status, machine_condition, machine_spec_keeping_seed_iso, wait_event,
};
use serde_json::json;
use tap::Injected;

/// Quick tasks: a machine provisions in a second or two, a fleet within the tests' waits.
fn quick_sim() -> SimOptions {
    SimOptions {
        clone_duration: Duration::from_millis(50),
        task_duration: Duration::from_millis(10),
        boot_delay: Duration::from_millis(50),
        ..SimOptions::default()
    }
}

/// The first deletion of a storage volume (the seed ISO) fails; returns how many were refused.
fn fail_first_volume_deletion(tap: &tap::Tap) -> Arc<AtomicUsize> {
    let refused = Arc::new(AtomicUsize::new(0));
    let counter = refused.clone();
    tap.set_fault(Box::new(move |method, path| {
        (method == "DELETE"
            && path.contains("/storage/")
            && path.contains("/content/")
            && counter
                .compare_exchange(0, 1, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok())
        .then(|| Injected::new(500, "volume deletion failed: storage 'local' is busy"))
    }));
    refused
}

/// The machine's VMID and node from its status.
fn placed(machine: &ProxmoxMachine) -> (u32, String) {
    let status = machine.status.as_ref().expect("status");
    (
        status
            .virtual_machine_id
            .and_then(|id| u32::try_from(id).ok())
            .expect("vmid"),
        status.proxmox_node.clone().expect("node"),
    )
}

/// Waits for the machine's `VirtualMachineProvisioned` reason; returns the condition's message.
async fn wait_reason(scenario: &Scenario, name: &str, reason: &str) -> String {
    let machine = scenario
        .env
        .wait_machine(name, reason, |m| {
            machine_condition(m, "VirtualMachineProvisioned").is_some_and(|c| c.1 == reason)
        })
        .await;
    let (status, _, message) =
        machine_condition(&machine, "VirtualMachineProvisioned").expect("condition");
    assert_eq!(status, "False", "{name}: {message}");
    message
}

/// Warning events about ProxmoxMachines, by machine name and reason, with their counts.
async fn machine_warnings(scenario: &Scenario) -> BTreeMap<(String, String), i32> {
    let events = Api::<Event>::namespaced(scenario.env.client(), "default")
        .list(&ListParams::default())
        .await
        .expect("events");
    let mut found = BTreeMap::new();
    for event in events.items {
        let Some(regarding) = event.regarding.as_ref() else {
            continue;
        };
        if event.type_.as_deref() != Some("Warning")
            || regarding.kind.as_deref() != Some("ProxmoxMachine")
        {
            continue;
        }
        let key = (
            regarding.name.clone().unwrap_or_default(),
            event.reason.clone().unwrap_or_default(),
        );
        *found.entry(key).or_default() += event.series.as_ref().map_or(1, |s| s.count);
    }
    found
}

#[tokio::test]
async fn a_machine_whose_vm_proxmox_answers_404_for_is_deleted() {
    let mut scenario = Scenario::start(quick_sim()).await;
    scenario.create("demo-md-4").await;
    let machine = scenario.wait_ready("demo-md-4").await;
    let (vmid, node) = placed(&machine);
    // The VM goes away behind capmox's back, and the proxy in front of Proxmox answers 404
    // for it, where PVE itself answers 500 "does not exist".
    scenario.stop_controllers().await;
    let proxmox = scenario.env.proxmox();
    let wait = capmox::proxmox::WaitOptions::default();
    let task = proxmox
        .power(&node, vmid, capmox::proxmox::PowerAction::Stop)
        .await
        .expect("stop");
    proxmox.wait_task_ref(&task, &wait).await.expect("stopped");
    let task = proxmox
        .delete_vm(&node, vmid, capmox::proxmox::DeleteParams::default())
        .await
        .expect("delete");
    proxmox.wait_task_ref(&task, &wait).await.expect("deleted");
    let vm_path = format!("/qemu/{vmid}");
    scenario.tap.set_fault(Box::new(move |_, path| {
        (path.contains(&vm_path) && !path.contains("/tasks/"))
            .then(|| Injected::new(404, "Not Found"))
    }));
    scenario.start_controllers();
    let uid = scenario.delete("demo-md-4").await;
    scenario.wait_deleted("demo-md-4", &uid).await;
    assert!(
        scenario
            .tap
            .log()
            .iter()
            .any(|s| s.status == 404 && s.path.contains(&format!("/qemu/{vmid}"))),
        "Proxmox was asked about the VM and answered 404"
    );
    scenario.assert_nothing_left("after a 404").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_backs_off_during_an_outage_reports_it_once_and_recovers() {
    const MACHINES: usize = 30;
    /// How long Proxmox answers every request with 500; the requests in it are counted.
    const OUTAGE: Duration = Duration::from_secs(20);
    let scenario = Scenario::start(quick_sim()).await;
    // No clone waits in capmox's queue: what is measured is the back-off and the recovery.
    Api::<capmox::api::ProxmoxCluster>::namespaced(scenario.env.client(), "default")
        .patch(
            "demo",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(
                serde_json::json!({"spec": {"taskLimits": {"perNode": 64, "perStorage": 64}}}),
            ),
        )
        .await
        .expect("limits raised");
    let names: Vec<String> = (0..MACHINES).map(|i| format!("demo-md-{i:02}")).collect();
    let first_request = scenario.tap.log().len();
    scenario.tap.set_fault(Box::new(|_, _| {
        Some(Injected::new(
            500,
            "injected outage: pvedaemon not answering",
        ))
    }));
    let started = tokio::time::Instant::now();
    for name in &names {
        scenario.create(name).await;
    }
    for name in &names {
        let message = wait_reason(&scenario, name, "ProxmoxServerError").await;
        assert!(
            message.contains("listing Proxmox's VMs and nodes")
                && message.contains("HTTP 500: injected outage: pvedaemon not answering")
                && message.contains("check the node's health"),
            "{name}: {message}"
        );
    }
    let all_reported = started.elapsed();
    // The outage goes on for its planned length; nothing here waits for the controllers.
    tokio::time::sleep_until(started + OUTAGE).await;
    let logged: Vec<tap::Seen> = scenario.tap.log()[first_request..].to_vec();
    scenario.tap.clear_fault();
    let lifted = tokio::time::Instant::now();

    // A request already on its way to Proxmox when the outage began (the cluster controller's)
    // may be answered, and logged, after it.
    let (during, in_flight): (Vec<tap::Seen>, Vec<tap::Seen>) =
        logged.into_iter().partition(|s| s.status == 500);
    assert!(in_flight.len() <= 2, "all answered 500: {in_flight:?}");
    let calls = during.len();
    let began = during.first().expect("requests in the outage").at;
    let half = began + OUTAGE / 2;
    let first_half = during.iter().filter(|s| s.at < half).count();
    let second_half = calls - first_half;
    println!(
        "outage of {OUTAGE:?}: {calls} Proxmox requests from {MACHINES} machines and the cluster \
         ({first_half} in the first half, {second_half} in the second); all reported after \
         {all_reported:?}"
    );
    // A flat 2 s retry would make about MACHINES × OUTAGE / 2 s = 300 requests; 1 s doubling
    // gives each machine at most 5 tries in 20 s (at 0, 1, 3, 7 and 15 s, or a little earlier).
    assert!(
        calls <= MACHINES * 6 + 10,
        "{calls} requests in {OUTAGE:?}: no back-off"
    );
    assert!(
        second_half * 2 < first_half,
        "the request rate decays: {first_half} then {second_half}"
    );

    // One Warning per machine for the whole outage, not one per retry.
    let warnings = machine_warnings(&scenario).await;
    for name in &names {
        assert_eq!(
            warnings.get(&(name.clone(), "ProxmoxServerError".to_owned())),
            Some(&1),
            "{name}: {warnings:?}"
        );
    }

    // Lifted by the test: every machine provisions, with one VM each.
    for name in &names {
        scenario.wait_ready(name).await;
    }
    println!(
        "all {MACHINES} machines ready {:?} after the outage was lifted",
        lifted.elapsed()
    );
    assert_eq!(scenario.vms().await.len(), MACHINES);
}

#[tokio::test]
async fn a_refused_clone_and_a_rejected_upload_say_what_to_fix() {
    let scenario = Scenario::start(quick_sim()).await;
    scenario.tap.set_fault(Box::new(|method, path| {
        (method == "POST" && path.ends_with("/clone"))
            .then(|| Injected::new(403, "Permission check failed (/vms/9000, VM.Clone)"))
    }));
    scenario.create("demo-md-1").await;
    let message = wait_reason(&scenario, "demo-md-1", "ProxmoxForbidden").await;
    assert!(
        message.starts_with("cloning template 9000 on pve1 to VM ")
            && message.contains("lacks VM.Clone on /vms/9000")
            && message.contains("grant it on /vms/9000 to the token"),
        "{message}"
    );
    let token = scenario.env.sim.token();
    let (_, secret) = token.split_once('=').expect("token id=secret");
    assert!(!message.contains(secret), "the token secret leaked");
    let warning = wait_event(&scenario.env, "demo-md-1", "ProxmoxForbidden").await;
    assert_eq!(warning.type_.as_deref(), Some("Warning"));
    assert_eq!(warning.note.as_deref(), Some(message.as_str()));
    let ready = scenario
        .env
        .wait_machine("demo-md-1", "Ready mirrors it", |m| {
            machine_condition(m, "Ready").is_some_and(|c| c.1 == "ProxmoxForbidden")
        })
        .await;
    assert_eq!(condition_status(&ready, "Ready").as_deref(), Some("False"));
    scenario.tap.clear_fault();
    scenario.wait_ready("demo-md-1").await;

    // The upload of the seed ISO answered 400 (once seen with claims already bound).
    scenario.tap.set_fault(Box::new(|method, path| {
        (method == "POST" && path.ends_with("/upload")).then(|| Injected {
            errors: json!({"filename": "invalid format - wrong file extension\n"}),
            ..Injected::new(400, "Parameter verification failed.")
        })
    }));
    scenario.create("demo-md-2").await;
    let message = wait_reason(&scenario, "demo-md-2", "ProxmoxRequestRejected").await;
    assert!(
        message.starts_with("uploading the seed ISO user-data-")
            && message.contains("HTTP 400: Parameter verification failed.")
            && message.contains("filename: invalid format - wrong file extension")
            && message.contains("fix the values it names"),
        "{message}"
    );
    let warning = wait_event(&scenario.env, "demo-md-2", "ProxmoxRequestRejected").await;
    assert_eq!(warning.type_.as_deref(), Some("Warning"));
    scenario.tap.clear_fault();
    scenario.wait_ready("demo-md-2").await;
}

#[tokio::test]
async fn a_rate_limit_is_waited_out_as_long_as_the_server_asks() {
    let scenario = Scenario::start(quick_sim()).await;
    let limited = Arc::new(AtomicUsize::new(0));
    let counter = limited.clone();
    // The first two listings are refused with "come back in 3 s".
    scenario.tap.set_fault(Box::new(move |method, path| {
        (method == "GET"
            && path == "/cluster/resources"
            && counter.fetch_add(1, Ordering::SeqCst) < 2)
            .then(|| Injected {
                headers: vec![("Retry-After".into(), "3".into())],
                ..Injected::new(429, "Too Many Requests")
            })
    }));
    scenario.create("demo-md-1").await;
    let message = wait_reason(&scenario, "demo-md-1", "ProxmoxRateLimited").await;
    assert!(
        message.contains("HTTP 429: Too Many Requests") && message.contains("as long as"),
        "{message}"
    );
    scenario.wait_ready("demo-md-1").await;
    let listings: Vec<SystemTime> = scenario
        .tap
        .log()
        .iter()
        .filter(|s| s.method == "GET" && s.path == "/cluster/resources" && s.query.is_empty())
        .map(|s| s.at)
        .collect();
    assert!(listings.len() >= 3, "{listings:?}");
    for pair in listings[..3].windows(2) {
        let gap = pair[1].duration_since(pair[0]).expect("in order");
        // The back-off alone would retry after 1 s and then 2 s.
        assert!(
            gap >= Duration::from_millis(2900),
            "retried {gap:?} after a 429 with Retry-After: 3"
        );
    }
}

#[tokio::test]
async fn a_failed_seed_iso_deletion_after_the_node_joined_is_retried_until_it_is_gone() {
    let scenario = Scenario::start(quick_sim()).await;
    scenario
        .create_with("demo-md-1", machine_spec_keeping_seed_iso())
        .await;
    let machine = scenario.wait_ready("demo-md-1").await;
    let (vmid, node) = placed(&machine);
    assert_eq!(
        scenario.seed_isos().await.len(),
        1,
        "attached until the node joins"
    );
    let refused = fail_first_volume_deletion(&scenario.tap);
    // The node joined: the ISO, with the bootstrap token inside, goes.
    join_and_wait_seed_iso_gone(&scenario, "demo-md-1", &node, vmid).await;
    assert_eq!(
        refused.load(Ordering::SeqCst),
        1,
        "the first deletion failed"
    );
    let warning = wait_event(&scenario.env, "demo-md-1", "ProxmoxServerError").await;
    assert!(
        warning
            .note
            .as_deref()
            .is_some_and(|n| n.starts_with("deleting the seed ISO") && n.contains("is busy")),
        "{warning:?}"
    );
    let machine = scenario.wait_ready("demo-md-1").await;
    assert!(machine.is_provisioned(), "still provisioned meanwhile");
}

#[tokio::test]
async fn a_failed_seed_iso_deletion_once_cloud_init_finished_is_retried_without_waiting_for_the_node()
 {
    let scenario = Scenario::start(quick_sim()).await;
    let refused = fail_first_volume_deletion(&scenario.tap);
    scenario.create("demo-md-3").await;
    let machine = scenario.wait_ready("demo-md-3").await;
    let (vmid, node) = placed(&machine);
    eventually("the seed ISO deleted and detached", || {
        seed_iso_gone(&scenario, &node, vmid)
    })
    .await;
    assert_eq!(
        refused.load(Ordering::SeqCst),
        1,
        "the first deletion failed"
    );
    wait_event(&scenario.env, "demo-md-3", "ProxmoxServerError").await;
    let capi_machine = Api::<capmox::capi::Machine>::namespaced(scenario.env.client(), "default")
        .get("demo-md-3")
        .await
        .expect("Machine");
    assert!(
        capi_machine.status.and_then(|s| s.node_ref).is_none(),
        "gone before any node joined"
    );
    assert!(
        scenario.wait_ready("demo-md-3").await.is_provisioned(),
        "still provisioned"
    );
}

#[tokio::test]
async fn a_seed_iso_attached_whose_answer_was_lost_is_still_removed_once_cloud_init_finished() {
    let scenario = Scenario::start(quick_sim()).await;
    // The attachment (the first config write after the upload) is carried out, its answer lost.
    let uploaded = Arc::new(AtomicUsize::new(0));
    let lost = Arc::new(AtomicUsize::new(0));
    let (seen_upload, lost_count) = (uploaded.clone(), lost.clone());
    scenario
        .tap
        .set_lose_answer(Some(Box::new(move |seen: &tap::Seen| {
            if seen.method == "POST" && seen.path.ends_with("/upload") {
                seen_upload.store(1, Ordering::SeqCst);
            }
            seen.method == "PUT"
                && seen.path.ends_with("/config")
                && seen_upload.load(Ordering::SeqCst) == 1
                && lost_count
                    .compare_exchange(0, 1, Ordering::SeqCst, Ordering::SeqCst)
                    .is_ok()
        })));
    scenario.create("demo-md-4").await;
    let machine = scenario.wait_ready("demo-md-4").await;
    assert_eq!(
        lost.load(Ordering::SeqCst),
        1,
        "the attachment's answer was lost"
    );
    let (vmid, node) = placed(&machine);
    eventually("the seed ISO deleted and detached", || {
        seed_iso_gone(&scenario, &node, vmid)
    })
    .await;
}

/// Sets the Machine's `nodeRef`, as CAPI does once its node joined, and waits until the seed
/// ISO (it holds the bootstrap token) is deleted and detached from VM `vmid` on `node`.
async fn join_and_wait_seed_iso_gone(scenario: &Scenario, name: &str, node: &str, vmid: u32) {
    Api::<capmox::capi::Machine>::namespaced(scenario.env.client(), "default")
        .patch_status(
            name,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({"status": {"nodeRef": {"name": name}}})),
        )
        .await
        .expect("nodeRef set");
    eventually("the seed ISO deleted and detached", || {
        seed_iso_gone(scenario, node, vmid)
    })
    .await;
}

/// No seed ISO in the storages, and none attached to VM `vmid` on `node`.
async fn seed_iso_gone(scenario: &Scenario, node: &str, vmid: u32) -> bool {
    scenario.seed_isos().await.is_empty()
        && scenario
            .env
            .proxmox()
            .vm_config(node, vmid)
            .await
            .expect("config")
            .get("ide0")
            .is_none()
}

#[tokio::test]
async fn a_failed_seed_iso_deletion_holds_the_machine_until_the_iso_is_gone() {
    let scenario = Scenario::start(quick_sim()).await;
    scenario
        .create_with("demo-md-2", machine_spec_keeping_seed_iso())
        .await;
    scenario.wait_ready("demo-md-2").await;
    assert_eq!(
        scenario.seed_isos().await.len(),
        1,
        "attached until the node joins"
    );
    let refused = fail_first_volume_deletion(&scenario.tap);
    let uid = scenario.delete("demo-md-2").await;
    scenario.wait_deleted("demo-md-2", &uid).await;
    assert_eq!(
        refused.load(Ordering::SeqCst),
        1,
        "the first deletion failed"
    );
    scenario
        .assert_nothing_left("after a failed ISO deletion")
        .await;
}

/// A Proxmox whose config answers never show `smbios1`: capmox gives the clone the SMBIOS UUID
/// it cannot see, with the config it writes, and uses that one (it once waited for Proxmox to
/// show a UUID, forever).
#[tokio::test]
async fn a_proxmox_that_never_shows_smbios1_still_provisions_with_the_uuid_capmox_gave() {
    let scenario = Scenario::start(quick_sim()).await;
    scenario
        .tap
        .set_rewrite(Box::new(move |method, path, body| {
            if method != "GET" || !path.ends_with("/config") {
                return None;
            }
            let mut answer: serde_json::Value = serde_json::from_slice(body).ok()?;
            answer["data"].as_object_mut()?.remove("smbios1")?;
            serde_json::to_vec(&answer).ok()
        }));
    scenario.create("demo-md-3").await;
    let machine = scenario.wait_ready("demo-md-3").await;
    let vmid = machine
        .status
        .as_ref()
        .and_then(|s| s.virtual_machine_id)
        .and_then(|id| u32::try_from(id).ok())
        .expect("a VMID");
    let stored = scenario.env.sim.with_cluster(|c| {
        let node = c.vm_node(vmid).expect("the VM");
        c.vm_config(&node, vmid).expect("its config")["smbios1"].clone()
    });
    let uuid = stored
        .as_str()
        .and_then(capmox::cloudinit::instance_id_from_smbios)
        .expect("a UUID in the VM's config");
    assert_eq!(
        machine.spec.provider_id.as_deref(),
        Some(format!("proxmox://{uuid}").as_str()),
        "the provider ID is the UUID the VM has"
    );
}

/// A Proxmox answer longer than an Event may be (a proxy's HTML page, a long task log) still
/// gives the Warning event, cut to the API's 1 kB with an ellipsis; the condition keeps more.
#[tokio::test]
async fn a_long_proxmox_message_is_cut_to_fit_the_event() {
    let scenario = Scenario::start(quick_sim()).await;
    let long = format!("backend says: {}", "no space left on device; ".repeat(200));
    let injected = long.clone();
    scenario.tap.set_fault(Box::new(move |method, path| {
        (method == "POST" && path.ends_with("/clone")).then(|| Injected::new(500, &injected))
    }));
    scenario.create("demo-md-1").await;
    let message = wait_reason(&scenario, "demo-md-1", "ProxmoxServerError").await;
    assert!(message.len() > 1024, "the condition keeps the long message");
    let warning = wait_event(&scenario.env, "demo-md-1", "ProxmoxServerError").await;
    let note = warning.note.expect("a note");
    assert!(
        note.len() <= capmox_testkit::EVENT_NOTE_LIMIT,
        "{}",
        note.len()
    );
    assert!(
        note.ends_with('…') && note.starts_with("cloning template 9000"),
        "{note}"
    );
}

/// Issue 35: a bridge stored before the CRD pattern existed is refused when the NIC is built:
/// it would have added `firewall=0` to net0. The condition names the field; no config write
/// reaches Proxmox.
#[tokio::test]
async fn a_stored_bridge_that_adds_nic_options_is_reported_and_never_written() {
    let scenario = Scenario::start(quick_sim()).await;
    let mut spec = scenario::machine_spec();
    spec["network"]["networkDevices"][0]["bridge"] = json!("vmbr0,firewall=0");
    // The CRD schema refuses that bridge now; an object stored before the upgrade skipped it.
    let schema = scenario
        .env
        .server
        .set_validator("proxmoxmachines", |_| Ok(()));
    schema.expect("the kind is registered");
    scenario.create_with("demo-md-1", spec).await;
    let message = wait_reason(&scenario, "demo-md-1", "ProxmoxRequestRejected").await;
    assert!(
        message.contains("capmox did not send the request")
            && message.contains("bridge: \"vmbr0,firewall=0\" is not a valid Proxmox bridge name"),
        "{message}"
    );
    let writes: Vec<_> = scenario
        .tap
        .log()
        .into_iter()
        .filter(|r| r.method != "GET" && r.path.ends_with("/config"))
        .collect();
    assert!(writes.is_empty(), "config written: {writes:?}");
}
