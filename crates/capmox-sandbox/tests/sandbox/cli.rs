//! The `capmox-sandbox` binary as `make sandbox` runs it.

use std::process::Command;

#[test]
fn sandbox_provisions_the_example_cluster_and_exits_zero() {
    let kubeconfig = std::env::temp_dir().join(format!(
        "capmox-sandbox-test-{}.kubeconfig",
        std::process::id()
    ));
    let output = Command::new(env!("CARGO_BIN_EXE_capmox-sandbox"))
        .args([
            "--control-plane",
            "1",
            "--workers",
            "1",
            "--kubeconfig",
            kubeconfig.to_str().expect("utf-8 path"),
        ])
        .output()
        .expect("capmox-sandbox runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "stdout:\n{stdout}\nstderr:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(stdout.contains("2 machines ready"), "{stdout}");
    assert!(stdout.contains("rack-b"), "{stdout}");
    assert!(
        std::fs::read_to_string(&kubeconfig)
            .expect("kubeconfig written")
            .contains("server: http://127.0.0.1:")
    );
    let _ = std::fs::remove_file(kubeconfig);
}

/// A multi-site file whose zone names a node its site lacks stops the sandbox before anything
/// starts, saying which zone, node and site.
#[test]
fn a_multi_site_file_with_an_unknown_zone_node_is_refused_with_a_clear_error() {
    let dir = std::env::temp_dir().join(format!("capmox-sandbox-sites-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let file = dir.join("sites.yaml");
    std::fs::write(
        &file,
        "sites:\n\
         - name: site-a\n  zones: [{zone: rack-a, nodes: [pve1]}]\n  topology: {nodes: [{name: pve1}]}\n\
         - name: site-b\n  zones: [{zone: rack-c, nodes: [pve7]}]\n  topology: {nodes: [{name: pve1}]}\n",
    )
    .expect("write");
    let output = Command::new(env!("CARGO_BIN_EXE_capmox-sandbox"))
        .arg("--topology")
        .arg(&file)
        .arg("--kubeconfig")
        .arg(dir.join("kubeconfig"))
        .output()
        .expect("capmox-sandbox runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(
        stderr.contains("zone 'rack-c' names node 'pve7', which site 'site-b' does not have"),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
