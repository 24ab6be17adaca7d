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
