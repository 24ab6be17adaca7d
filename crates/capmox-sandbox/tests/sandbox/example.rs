//! End to end: the sandbox's example cluster (3 control-plane machines spread over the failure
//! domains, 2 workers pinned to rack-b), scaling, and deleting the whole cluster; and the
//! two-site sandbox (examples/sandbox-two-sites.yaml), one simulator per site.

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
    let vm_count = sandbox.proxmox.sim.with_cluster(|c| c.vm_count()) - 1;
    assert_eq!(vm_count, machines.items.len(), "VMs in Proxmox vs machines");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_cluster_spreads_scales_and_goes_away() {
    let options = options();
    let (sandbox, example, rows) = ready(&options, 5).await;

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
    delete_demo_cluster(&client, options.timeout).await;
    assert_eq!(
        sandbox.proxmox.sim.with_cluster(|c| c.vm_count()),
        1,
        "only the template is left"
    );
    let config = capmox::proxmox::ClientConfig::new(
        sandbox.proxmox.sim.url(),
        capmox::proxmox::ApiToken::parse(&sandbox.proxmox.sim.token()).expect("token"),
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
    let (sandbox, _, rows) = ready(&options, 2).await;
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
    let manifest = crate::paths::substitute(
        &std::fs::read_to_string(crate::paths::data(
            "conversion/v1alpha1-cluster-template.yaml",
        ))
        .expect("test data"),
        crate::paths::TEMPLATE_VALUES,
    );
    let file = dir.join("v1alpha1.yaml");
    std::fs::write(&file, manifest).expect("write manifest");
    let kubectl = |args: &[&str]| {
        let mut command = std::process::Command::new(crate::paths::kubectl());
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
    let (sandbox, _, rows) = ready(&options, 5).await;
    // the last registrations may still be retried after a concurrent rule change
    let deadline = tokio::time::Instant::now() + options.timeout;
    while sandbox
        .proxmox
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

/// `make sandbox SANDBOX_ARGS="--topology examples/sandbox-two-sites.yaml"`, with the workers on
/// the second site.
fn two_sites() -> SandboxOptions {
    SandboxOptions {
        topology: Some(crate::paths::in_repository(
            "examples/sandbox-two-sites.yaml",
            "the example is part of the repository",
        )),
        control_plane: 3,
        workers: 2,
        worker_failure_domain: "rack-c".into(),
        ..options()
    }
}

/// The value of `key` in a Secret's `data`.
fn secret_value(secret: &k8s_openapi::api::core::v1::Secret, key: &str) -> String {
    secret
        .data
        .as_ref()
        .and_then(|d| d.get(key))
        .map(|v| String::from_utf8_lossy(&v.0).into_owned())
        .unwrap_or_default()
}

/// The multi-site file gives each site a simulator of its own (the same node and template names
/// on both), and the example cluster reaches the second site's zone through that site's
/// Secret: its `credentialsRef` names a Secret with the second simulator's URL and token, the
/// first site's zones use the cluster's credentials.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_two_site_sandbox_wires_each_sites_zones_to_its_own_simulator() {
    let options = two_sites();
    let sandbox = Sandbox::start(&options, false)
        .await
        .expect("sandbox starts");
    let sites = sandbox
        .proxmox
        .sites
        .as_ref()
        .expect("a multi-site sandbox");
    let names: Vec<&str> = sites.sites.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["site-a", "site-b"]);
    let simulators = sandbox.proxmox.simulators();
    assert_eq!(simulators.len(), 2);
    let (site_a, site_b) = (simulators[0].1, simulators[1].1);
    assert_ne!(site_a.url(), site_b.url(), "one simulator per site");
    assert_ne!(site_a.token(), site_b.token(), "one token per site");
    for sim in [site_a, site_b] {
        assert_eq!(
            sim.with_cluster(|c| c.vm_node(9000)).as_deref(),
            Some("pve1"),
            "both sites have template 9000 on a node called pve1"
        );
    }
    assert_eq!(
        sandbox.proxmox.site_of_endpoint(&site_b.url()),
        Some("site-b")
    );
    assert_eq!(sandbox.proxmox.site_of_zone("rack-c"), Some("site-b"));

    // A worker zone of no site is refused before anything is created.
    let wrong = SandboxOptions {
        worker_failure_domain: "rack-z".into(),
        ..two_sites()
    };
    let err = sandbox
        .apply_example(&wrong)
        .await
        .expect_err("rack-z is no zone");
    assert!(
        err.to_string().contains(
            "'rack-z' is not a zone of the topology file (its zones: rack-a, rack-b, rack-c)"
        ),
        "{err}"
    );

    sandbox
        .apply_example(&options)
        .await
        .expect("example applied");
    let client = sandbox.client();
    let cluster = Api::<ProxmoxCluster>::namespaced(client.clone(), "default")
        .get("demo")
        .await
        .expect("ProxmoxCluster demo");
    let cluster_secret = cluster
        .spec
        .credentials_ref
        .as_ref()
        .and_then(|r| r.name.clone())
        .expect("the cluster's credentialsRef");
    assert_eq!(cluster_secret, "demo-proxmox-credentials");
    let zones: BTreeMap<&str, _> = cluster
        .spec
        .zone_config
        .iter()
        .map(|z| (z.zone.as_str(), z))
        .collect();
    assert_eq!(
        zones.keys().copied().collect::<Vec<_>>(),
        ["rack-a", "rack-b", "rack-c"]
    );
    for zone in ["rack-a", "rack-b"] {
        assert_eq!(
            zones[zone].credentials_ref, None,
            "{zone} is on the first site"
        );
    }
    let rack_c = zones["rack-c"];
    assert_eq!(rack_c.nodes, ["pve1", "pve2"]);
    let reference = rack_c
        .credentials_ref
        .as_ref()
        .expect("rack-c credentialsRef");
    assert_eq!(
        reference.name.as_deref(),
        Some("demo-site-b-proxmox-credentials")
    );
    assert!(
        zones
            .values()
            .all(|z| z.control_plane_eligible != Some(false)),
        "every zone takes control-plane machines"
    );
    for node in ["pve1", "pve2", "pve3", "pve4"] {
        assert!(
            cluster.spec.allowed_nodes.iter().any(|n| n == node),
            "{node} allowed"
        );
    }
    let secrets = Api::<k8s_openapi::api::core::v1::Secret>::namespaced(client, "default");
    let ours = secrets.get(&cluster_secret).await.expect("cluster Secret");
    assert_eq!(secret_value(&ours, "url"), site_a.url());
    let theirs = secrets
        .get("demo-site-b-proxmox-credentials")
        .await
        .expect("site-b Secret");
    assert_eq!(secret_value(&theirs, "url"), site_b.url());
    assert_eq!(
        format!(
            "{}={}",
            secret_value(&theirs, "token"),
            secret_value(&theirs, "secret")
        ),
        site_b.token()
    );
    let table = sandbox.proxmox.table(&[]);
    assert!(
        table.starts_with("MACHINE  SITE  ENDPOINT  FAILURE DOMAIN  NODE  VMID"),
        "{table}"
    );
}

/// Needs the controllers to use each zone's endpoint (issue #17): the control plane spreads
/// over both sites, the workers land on the second, every VM is on the simulator of its zone's
/// site (at the node and VMID its machine reports, though both sites have a pve1 and a VMID
/// 9000), each machine records that site's endpoint, and deleting the cluster removes every VM
/// from the site it is on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn machines_of_both_sites_become_ready_on_their_own_sites_endpoint() {
    let options = two_sites();
    let (sandbox, _, rows) = ready(&options, 5).await;
    let table = sandbox.proxmox.table(&rows);
    let mut per_site: BTreeMap<String, usize> = BTreeMap::new();
    let mut per_zone: BTreeMap<String, usize> = BTreeMap::new();
    for row in &rows {
        let site = sandbox
            .proxmox
            .site_of_zone(&row.failure_domain)
            .unwrap_or_else(|| panic!("{} is in no zone of a site:\n{table}", row.machine));
        assert_eq!(
            sandbox.proxmox.site_of_endpoint(&row.endpoint),
            Some(site),
            "{} (zone {}) records endpoint {}:\n{table}",
            row.machine,
            row.failure_domain,
            row.endpoint
        );
        let sim = sandbox
            .proxmox
            .site_simulator(site)
            .expect("site simulator");
        let vmid: u32 = row.vmid.parse().expect("VMID");
        assert_eq!(
            sim.with_cluster(|c| c.vm_node(vmid)).as_deref(),
            Some(row.node.as_str()),
            "{}'s VM is not on {site} at its node:\n{table}",
            row.machine
        );
        let zone_nodes = &sandbox
            .proxmox
            .sites
            .as_ref()
            .expect("sites")
            .sites
            .iter()
            .flat_map(|s| &s.zones)
            .find(|z| z.zone == row.failure_domain)
            .expect("zone")
            .nodes;
        assert!(zone_nodes.contains(&row.node), "{table}");
        *per_site.entry(site.to_owned()).or_default() += 1;
        *per_zone.entry(row.failure_domain.clone()).or_default() += 1;
    }
    // Three zones, three control-plane machines: one each; the two workers in rack-c.
    assert_eq!(
        per_zone,
        BTreeMap::from([
            ("rack-a".to_owned(), 1),
            ("rack-b".to_owned(), 1),
            ("rack-c".to_owned(), 3)
        ]),
        "{table}"
    );
    assert_eq!(
        per_site,
        BTreeMap::from([("site-a".to_owned(), 2), ("site-b".to_owned(), 3)])
    );
    for (site, sim) in sandbox.proxmox.simulators() {
        let site = site.expect("named site");
        assert_eq!(
            sim.with_cluster(|c| c.vm_count()),
            per_site[site] + 1,
            "VMs on {site} (its machines and the template):\n{table}"
        );
    }

    let client = sandbox.client();
    delete_demo_cluster(&client, options.timeout).await;
    for (site, sim) in sandbox.proxmox.simulators() {
        assert_eq!(
            sim.with_cluster(|c| c.vm_count()),
            1,
            "only the template is left on {site:?}"
        );
    }
}

/// Deletes the CAPI Cluster `demo` and waits until its ProxmoxCluster is released.
async fn delete_demo_cluster(client: &kube::Client, timeout: Duration) {
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
        timeout,
        kube::runtime::wait::await_condition(
            clusters,
            "demo",
            kube::runtime::wait::conditions::is_deleted(&uid),
        ),
    )
    .await
    .expect("ProxmoxCluster released in time")
    .expect("watch");
}

/// A sandbox started with `options`, its example cluster applied and `machines` of it ready.
async fn ready(
    options: &SandboxOptions,
    machines: usize,
) -> (
    Sandbox,
    capmox_sandbox::standin::ExampleCluster,
    Vec<capmox_sandbox::run::MachineRow>,
) {
    let sandbox = Sandbox::start(options, false)
        .await
        .expect("sandbox starts");
    let example = sandbox
        .apply_example(options)
        .await
        .expect("example applied");
    let rows = sandbox
        .wait_ready(machines, options.timeout, false)
        .await
        .unwrap_or_else(|error| panic!("{machines} machines ready: {error}"));
    (sandbox, example, rows)
}
