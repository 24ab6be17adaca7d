//! The `simulate-proxmox` binary as a user runs it.

use std::process::Command;

#[tokio::test]
async fn simulate_proxmox_serves_an_api_a_client_can_use() {
    use std::io::BufRead;
    let mut child = Command::new(env!("CARGO_BIN_EXE_simulate-proxmox"))
        .args(["--listen", "127.0.0.1:0"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("simulator starts");
    let stdout = child.stdout.take().expect("stdout");
    let mut lines = std::io::BufReader::new(stdout).lines();
    let url_line = lines.next().expect("a line").expect("utf-8");
    let token_line = lines.next().expect("a line").expect("utf-8");
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
    assert_eq!(
        nodes.len(),
        3,
        "the built-in example topology has three nodes"
    );
}
