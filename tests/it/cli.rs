//! The `capmox` binary as a user runs it.

use std::process::Command;

fn capmox(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_capmox"))
        .args(args)
        .output()
        .expect("capmox runs")
}

#[test]
fn crds_prints_exactly_the_committed_crds() {
    let output = capmox(&["crds"]);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let mut files: Vec<_> = std::fs::read_dir("crds")
        .expect("crds/")
        .map(|e| e.expect("entry").path())
        .collect();
    files.sort();
    let committed: String = files
        .iter()
        .map(|f| format!("---\n{}", std::fs::read_to_string(f).expect("readable")))
        .collect();
    assert_eq!(
        String::from_utf8_lossy(&output.stdout),
        committed,
        "run `make crds`"
    );
}

#[test]
fn crds_output_dir_writes_one_file_per_crd() {
    let dir = std::env::temp_dir().join(format!("capmox-crds-{}", std::process::id()));
    let output = capmox(&["crds", "--output-dir", dir.to_str().expect("utf-8 path")]);
    assert!(output.status.success());
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .expect("written")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            "infrastructure.cluster.x-k8s.io_proxmoxclusters.yaml",
            "infrastructure.cluster.x-k8s.io_proxmoxclustertemplates.yaml",
            "infrastructure.cluster.x-k8s.io_proxmoxmachines.yaml",
            "infrastructure.cluster.x-k8s.io_proxmoxmachinetemplates.yaml",
            "infrastructure.cluster.x-k8s.io_proxmoxremediations.yaml",
            "infrastructure.cluster.x-k8s.io_proxmoxremediationtemplates.yaml",
        ]
    );
    std::fs::remove_dir_all(&dir).expect("cleanup");
}

#[test]
fn version_and_help_say_what_capmox_is() {
    let version = capmox(&["version"]);
    assert_eq!(
        String::from_utf8_lossy(&version.stdout).trim(),
        format!("capmox {}", env!("CARGO_PKG_VERSION"))
    );
    let help = String::from_utf8_lossy(&capmox(&["--help"]).stdout).into_owned();
    for expected in ["Proxmox", "run", "crds", "version", "--log-format"] {
        assert!(
            help.contains(expected),
            "--help lacks {expected:?}:\n{help}"
        );
    }
}

#[test]
fn run_help_shows_the_webhook_flags() {
    let output = capmox(&["run", "--help"]);
    assert!(output.status.success());
    let help = String::from_utf8_lossy(&output.stdout).into_owned();
    for expected in [
        "--webhook-bind-address",
        "[default: :9443]",
        "--webhook-cert-dir",
        capmox::webhook::DEFAULT_CERT_DIR,
        "--disable-webhook",
    ] {
        assert!(
            help.contains(expected),
            "run --help lacks {expected:?}:\n{help}"
        );
    }
}

#[test]
fn run_without_a_cluster_fails_with_a_clear_message() {
    let output = Command::new(env!("CARGO_BIN_EXE_capmox"))
        .arg("run")
        .env("KUBECONFIG", "/nonexistent/kubeconfig")
        .env_remove("KUBERNETES_SERVICE_HOST")
        .output()
        .expect("capmox runs");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("cannot configure the Kubernetes client"),
        "{stderr}"
    );
}

/// Stops a `capmox run` child when a test ends, passed or failed.
struct Running(std::process::Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `capmox run` names itself to the API server with its User-Agent (`capmox/<version>`), so
/// audit logs, field managers and per-client request counts (the fleet benchmark's) tell its
/// requests from everyone else's.
#[tokio::test]
async fn run_names_itself_to_the_api_server_by_its_user_agent() {
    let server = capmox_testkit::ApiServer::new();
    server.register_builtin_kinds();
    let http = server.serve_http().await.expect("serves");
    let kubeconfig =
        std::env::temp_dir().join(format!("capmox-cli-ua-{}.kubeconfig", std::process::id()));
    http.write_kubeconfig(&kubeconfig).expect("writes");
    let child = Command::new(env!("CARGO_BIN_EXE_capmox"))
        .args([
            "run",
            "--leader-elect",
            "--leader-election-namespace",
            "default",
        ])
        .args(["--metrics-bind-address", "127.0.0.1:0"])
        .args(["--health-probe-bind-address", "127.0.0.1:0"])
        // The webhook runs as by default, on a port of its own so parallel runs do not collide.
        .args(["--webhook-bind-address", "127.0.0.1:0"])
        .env("KUBECONFIG", &kubeconfig)
        .env_remove("KUBERNETES_SERVICE_HOST")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("capmox runs");
    let _running = Running(child);
    let lease = server
        .wait_for(
            "leases",
            "default",
            "capmox-controller-leader",
            std::time::Duration::from_secs(60),
            |lease| lease.is_some(),
        )
        .await;
    let _ = std::fs::remove_file(&kubeconfig);
    lease.expect("capmox takes the Lease");
    let counts = server.request_counts_of("capmox");
    assert_eq!(counts.resource_verb("leases", "create"), 1, "{counts:?}");
    assert!(counts.verb("discovery") >= 1, "GET /version: {counts:?}");
    assert_eq!(
        server.request_counts().resource_verb("leases", "create"),
        1,
        "no other client created it"
    );
}
