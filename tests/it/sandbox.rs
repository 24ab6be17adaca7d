//! End to end: the sandbox's example cluster (3 control-plane machines spread over the failure
//! domains, 2 workers pinned to rack-b), scaling, and deleting the whole cluster.

use std::collections::BTreeMap;
use std::time::Duration;

use capmox::api::{ProxmoxCluster, ProxmoxMachine};
use capmox::capi::{IPAddressClaim, InClusterIPPool};
use capmox_sandbox::run::{Sandbox, SandboxOptions};
use capmox_sandbox::standin::{scale_control_plane, scale_workers};
use capmox_sim::SimOptions;
use kube::api::{Api, DeleteParams};

fn options() -> SandboxOptions {
    SandboxOptions {
        sim: SimOptions {
            clone_duration: Duration::from_millis(20),
            task_duration: Duration::ZERO,
            boot_delay: Duration::from_millis(20),
            ..SimOptions::default()
        },
        timeout: Duration::from_secs(120),
        verbose: false,
        ..SandboxOptions::default()
    }
}

fn rack_of(node: &str) -> &'static str {
    match node {
        "pve1" | "pve2" => "rack-a",
        "pve3" | "pve4" => "rack-b",
        _ => "none",
    }
}

/// Every VM (but the template) belongs to exactly one ready machine, and vice versa.
async fn assert_one_vm_per_machine(sandbox: &Sandbox) {
    let machines = Api::<ProxmoxMachine>::namespaced(sandbox.client(), "default")
        .list(&Default::default())
        .await
        .expect("list");
    let mut vmids: Vec<i64> = machines
        .items
        .iter()
        .filter_map(|m| m.status.as_ref()?.virtual_machine_id)
        .collect();
    vmids.sort();
    let before = vmids.len();
    vmids.dedup();
    assert_eq!(before, vmids.len(), "two machines share a VMID");
    let vm_count = sandbox.sim.with_cluster(|c| c.vm_count()) - 1;
    assert_eq!(vm_count, machines.items.len(), "VMs in Proxmox vs machines");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_cluster_spreads_scales_and_goes_away() {
    let options = options();
    let sandbox = Sandbox::start(&options, false)
        .await
        .expect("sandbox starts");
    let example = sandbox
        .apply_example(&options)
        .await
        .expect("example applied");
    let rows = sandbox
        .wait_ready(5, options.timeout, false)
        .await
        .expect("5 machines ready");

    // Control plane spread: no zone has more than one machine more than another.
    let mut control_plane: BTreeMap<String, usize> = BTreeMap::new();
    for row in rows
        .iter()
        .filter(|r| r.machine.starts_with("demo-control-plane"))
    {
        *control_plane.entry(row.failure_domain.clone()).or_default() += 1;
        assert_eq!(
            rack_of(&row.node),
            row.failure_domain,
            "{} is on {} outside its zone",
            row.machine,
            row.node
        );
    }
    assert_eq!(control_plane.values().sum::<usize>(), 3);
    let (max, min) = (
        control_plane.values().max().copied().unwrap_or(0),
        control_plane.values().min().copied().unwrap_or(0),
    );
    assert!(
        control_plane.len() == 2 && max - min <= 1,
        "control plane not spread: {control_plane:?}"
    );
    // Workers: all in rack-b, on rack-b nodes, with rack-b addresses.
    let workers: Vec<_> = rows
        .iter()
        .filter(|r| r.machine.starts_with("demo-workers"))
        .collect();
    assert_eq!(workers.len(), 2);
    for worker in &workers {
        assert_eq!(worker.failure_domain, "rack-b");
        assert_eq!(rack_of(&worker.node), "rack-b");
        assert!(
            worker.ips.starts_with("10.0.2."),
            "{} has {}",
            worker.machine,
            worker.ips
        );
    }
    assert_one_vm_per_machine(&sandbox).await;

    // Scale the control plane 3 -> 5 -> 3 and the workers 2 -> 4 -> 0.
    let client = sandbox.client();
    scale_control_plane(&client, "default", &example.control_plane_name(), 5)
        .await
        .expect("scale");
    scale_workers(&client, "default", &example.workers_name(), 4)
        .await
        .expect("scale");
    sandbox
        .wait_ready(9, options.timeout, false)
        .await
        .expect("9 machines ready");
    assert_one_vm_per_machine(&sandbox).await;
    scale_control_plane(&client, "default", &example.control_plane_name(), 3)
        .await
        .expect("scale");
    scale_workers(&client, "default", &example.workers_name(), 0)
        .await
        .expect("scale");
    sandbox
        .wait_ready(3, options.timeout, false)
        .await
        .expect("3 machines left");
    assert_one_vm_per_machine(&sandbox).await;

    // Delete the cluster: every VM, ISO, claim and pool goes, and the finalizer is released.
    Api::<capmox::capi::Cluster>::namespaced(client.clone(), "default")
        .delete("demo", &DeleteParams::default())
        .await
        .expect("cluster delete accepted");
    let clusters = Api::<ProxmoxCluster>::namespaced(client.clone(), "default");
    let uid = clusters
        .get("demo")
        .await
        .expect("still there")
        .metadata
        .uid
        .expect("uid");
    tokio::time::timeout(
        options.timeout,
        kube::runtime::wait::await_condition(
            clusters,
            "demo",
            kube::runtime::wait::conditions::is_deleted(&uid),
        ),
    )
    .await
    .expect("ProxmoxCluster released in time")
    .expect("watch");
    assert_eq!(
        sandbox.sim.with_cluster(|c| c.vm_count()),
        1,
        "only the template is left"
    );
    let config = capmox::proxmox::ClientConfig::new(
        sandbox.sim.url(),
        capmox::proxmox::ApiToken::parse(&sandbox.sim.token()).expect("token"),
    );
    let proxmox = capmox::proxmox::ProxmoxClient::new(&config).expect("client");
    for node in ["pve1", "pve2", "pve3", "pve4", "pve5"] {
        let isos = proxmox
            .storage_content(node, "local", Some("iso"), None)
            .await
            .expect("content");
        assert!(isos.is_empty(), "seed ISOs left on {node}: {isos:?}");
    }
    assert!(
        Api::<IPAddressClaim>::namespaced(client.clone(), "default")
            .list(&Default::default())
            .await
            .expect("list")
            .items
            .is_empty()
    );
    assert!(
        Api::<InClusterIPPool>::namespaced(client, "default")
            .list(&Default::default())
            .await
            .expect("list")
            .items
            .is_empty()
    );
}

/// `make sandbox SANDBOX_ARGS="--os flatcar"`: every machine gets Ignition bootstrap data (the
/// control plane through the KCP's format, the workers through their KubeadmConfigTemplate)
/// and its VM boots Flatcar from the merged config.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flatcar_machines_get_ignition_bootstrap_data_and_boot_flatcar() {
    let options = SandboxOptions {
        control_plane: 1,
        workers: 1,
        os: capmox_sandbox::run::GuestOs::Flatcar,
        ..options()
    };
    let sandbox = Sandbox::start(&options, false)
        .await
        .expect("sandbox starts");
    sandbox
        .apply_example(&options)
        .await
        .expect("example applied");
    let rows = sandbox
        .wait_ready(2, options.timeout, false)
        .await
        .expect("2 machines ready");
    assert_eq!(
        sandbox.booted(&rows),
        BTreeMap::from([("flatcar", 2)]),
        "{rows:?}"
    );
    let secrets =
        Api::<k8s_openapi::api::core::v1::Secret>::namespaced(sandbox.client(), "default");
    for row in &rows {
        let secret = secrets
            .get(&capmox_sandbox::standin::bootstrap_secret_name(
                &row.machine,
            ))
            .await
            .expect("bootstrap Secret");
        let format = secret
            .data
            .as_ref()
            .and_then(|d| d.get("format"))
            .map(|v| String::from_utf8_lossy(&v.0).into_owned());
        assert_eq!(format.as_deref(), Some("ignition"), "{}", row.machine);
    }
    assert_one_vm_per_machine(&sandbox).await;
}

/// A user's v1alpha1 manifest applied with kubectl goes through capmox's conversion webhook:
/// it is stored as v1alpha2, and reading it as v1alpha1 gives back what was applied, including
/// the `cloneSpec` v1alpha2 has no field for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_applies_a_v1alpha1_manifest_through_the_conversion_webhook() {
    let dir = std::env::temp_dir().join(format!("capmox-v1alpha1-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let options = SandboxOptions {
        kubeconfig: dir.join("kubeconfig"),
        ..options()
    };
    let sandbox = Sandbox::start(&options, true)
        .await
        .expect("sandbox starts");
    let manifest = crate::common::substitute(
        &std::fs::read_to_string(crate::common::data(
            "conversion/v1alpha1-cluster-template.yaml",
        ))
        .expect("test data"),
        crate::common::TEMPLATE_VALUES,
    );
    let file = dir.join("v1alpha1.yaml");
    std::fs::write(&file, manifest).expect("write manifest");
    let kubectl = |args: &[&str]| {
        let mut command = std::process::Command::new(crate::common::kubectl());
        command
            .arg("--kubeconfig")
            .arg(&options.kubeconfig)
            .args(args);
        let output = tokio::task::block_in_place(|| command.output()).expect("kubectl runs");
        assert!(
            output.status.success(),
            "kubectl {args:?}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8_lossy(&output.stdout).into_owned()
    };
    // The in-process API server publishes no OpenAPI document for kubectl's client-side checks.
    let applied = kubectl(&[
        "apply",
        "--validate=false",
        "-f",
        file.to_str().expect("utf-8 path"),
    ]);
    assert!(
        applied.contains("proxmoxcluster.infrastructure.cluster.x-k8s.io/demo created"),
        "{applied}"
    );

    let stored =
        Api::<capmox::api::ProxmoxMachineTemplate>::namespaced(sandbox.client(), "default")
            .get("demo-worker")
            .await
            .expect("stored template, read as v1alpha2");
    let devices = &stored.spec.template.spec.network.network_devices;
    assert_eq!(devices.len(), 1);
    assert_eq!(devices[0].name, "net0");
    assert_eq!(devices[0].bridge.as_deref(), Some("vmbr0"));
    let cluster = Api::<ProxmoxCluster>::namespaced(sandbox.client(), "default")
        .get("demo")
        .await
        .expect("stored cluster, read as v1alpha2");
    assert_eq!(cluster.spec.dns_servers, ["10.0.0.2"]);

    let old: serde_json::Value = serde_json::from_str(&kubectl(&[
        "get",
        "proxmoxclusters.v1alpha1.infrastructure.cluster.x-k8s.io",
        "demo",
        "-o",
        "json",
    ]))
    .expect("json");
    assert_eq!(
        old["apiVersion"],
        "infrastructure.cluster.x-k8s.io/v1alpha1"
    );
    assert_eq!(
        old["spec"]["cloneSpec"]["sshAuthorizedKeys"],
        serde_json::json!(["ssh-ed25519 AAAA"])
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `capmox-sandbox --ha`: every VM of the example is an HA resource, each zone has its rule,
/// the control plane is kept apart, and a failed node's VMs stay in its zone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ha_sandbox_shows_resources_rules_and_a_failover_within_the_zone() {
    let options = SandboxOptions {
        ha: true,
        ..options()
    };
    let sandbox = Sandbox::start(&options, false)
        .await
        .expect("sandbox starts");
    sandbox
        .apply_example(&options)
        .await
        .expect("example applied");
    let rows = sandbox
        .wait_ready(5, options.timeout, false)
        .await
        .expect("5 machines ready");
    // the last registrations may still be retried after a concurrent rule change
    let deadline = tokio::time::Instant::now() + options.timeout;
    while sandbox
        .sim
        .ha_rules()
        .iter()
        .map(|r| r.resources.len())
        .sum::<usize>()
        < 5 + 3
    {
        assert!(tokio::time::Instant::now() < deadline, "HA rules settle");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let report = sandbox.ha_report();
    assert_eq!(report.matches("  resource vm:").count(), 5, "{report}");
    assert_eq!(report.matches("node-affinity").count(), 2, "{report}");
    assert_eq!(
        report.matches("resource-affinity negative").count(),
        1,
        "{report}"
    );
    let failover = sandbox.ha_failover(&rows);
    let zone = failover
        .split("(zone ")
        .nth(1)
        .and_then(|rest| rest.split(')').next())
        .unwrap_or_default();
    assert!(failover.contains(" -> "), "{failover}");
    for line in failover.lines().filter(|l| l.contains(" -> ")) {
        let to = line
            .split(" -> ")
            .nth(1)
            .and_then(|rest| rest.split_whitespace().next())
            .unwrap_or_default();
        assert!(to == "nowhere," || rack_of(to) == zone, "{failover}");
    }
}
