//! The `simulate-proxmox` binary as a user runs it.

use std::process::Command;

/// Starts `simulate-proxmox` with `args`, asks it for its nodes and returns how many it has
/// and the profile it printed.
async fn nodes_and_profile(args: &[&str]) -> (usize, String) {
    use std::io::BufRead;
    let mut child = Command::new(env!("CARGO_BIN_EXE_simulate-proxmox"))
        .args(["--listen", "127.0.0.1:0"])
        .args(args)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("simulator starts");
    let stdout = child.stdout.take().expect("stdout");
    let mut lines = std::io::BufReader::new(stdout).lines();
    let mut line = || lines.next().expect("a line").expect("utf-8");
    let url_line = line();
    let token_line = line();
    let profile_line = line();
    let url = url_line.rsplit(' ').next().expect("url").to_owned();
    let token = token_line
        .strip_prefix("API token: ")
        .expect("token line")
        .to_owned();
    let config = capmox::proxmox::ClientConfig::new(
        url,
        capmox::proxmox::ApiToken::parse(&token).expect("token parses"),
    );
    let client = capmox::proxmox::ProxmoxClient::new(&config).expect("client");
    let nodes = client.nodes().await;
    child.kill().expect("stops");
    let _ = child.wait();
    let nodes = nodes.expect("the simulator answers");
    let profile = profile_line
        .strip_prefix("Profile: ")
        .expect("profile line")
        .to_owned();
    (nodes.len(), profile)
}

#[tokio::test]
async fn simulate_proxmox_serves_an_api_a_client_can_use() {
    let (nodes, profile) = nodes_and_profile(&[]).await;
    assert_eq!(nodes, 3, "the built-in example topology has three nodes");
    assert_eq!(profile, "ideal");
}

#[tokio::test]
async fn simulate_proxmox_takes_the_realistic_profile() {
    let (nodes, profile) =
        nodes_and_profile(&["--profile", "realistic", "--profile-seed", "7"]).await;
    assert_eq!(nodes, 3);
    assert_eq!(profile, "realistic");
}
