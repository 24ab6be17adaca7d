#![allow(dead_code)]
//! Shared by every test binary of the workspace (included with `#[path]`): where the
//! repository's files are, however deep the including crate sits, the tools `make tools`
//! installs, and the test values of the cluster templates.

use std::path::{Path, PathBuf};

/// The repository root: the closest directory above the including crate that holds
/// `Cargo.lock`.
pub fn root() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest
        .ancestors()
        .find(|dir| dir.join("Cargo.lock").is_file())
        .unwrap_or_else(|| panic!("no Cargo.lock above {}", manifest.display()))
        .to_path_buf()
}

/// `relative` under the repository root; panics with the path and `if_missing` when it does
/// not exist, so a test never passes without what it reads.
pub fn in_repository(relative: &str, if_missing: &str) -> PathBuf {
    let path = root().join(relative);
    assert!(path.exists(), "{} is missing: {if_missing}", path.display());
    path
}

/// A path under the repository's `tests/data/`.
pub fn data(relative: &str) -> PathBuf {
    in_repository(
        &format!("tests/data/{relative}"),
        "test data is part of the repository",
    )
}

/// A program of the `.venv` that `make tools` fills from `requirements.txt` (kubectl, the
/// Python with pycdlib).
pub fn venv_tool(name: &str) -> PathBuf {
    in_repository(
        &format!(".venv/bin/{name}"),
        "run `make tools` (`make test` does) to install it",
    )
}

/// The kubectl of `.venv`.
pub fn kubectl() -> PathBuf {
    venv_tool("kubectl")
}

/// A command run from the repository root in the environment a user's shell would give it:
/// without the make job-server settings of a surrounding `make test`, nor the `CARGO_*`
/// variables `cargo test` sets for this test (a nested cargo would see them as changes and
/// rebuild crates that read them).
pub fn tool(program: &str) -> std::process::Command {
    let mut command = std::process::Command::new(program);
    command.current_dir(root());
    for (name, _) in std::env::vars_os() {
        let Some(name) = name.to_str() else { continue };
        let cargo_set =
            name.starts_with("CARGO_") && !["CARGO_HOME", "CARGO_TARGET_DIR"].contains(&name);
        if cargo_set || ["MAKEFLAGS", "MFLAGS", "MAKELEVEL"].contains(&name) {
            command.env_remove(name);
        }
    }
    command
}

/// `cargo`, the one running the tests when there is one, as [`tool`] runs programs.
pub fn cargo() -> std::process::Command {
    tool(&std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned()))
}

/// Runs `command` and returns its output; panics with its stderr, naming `what`, unless it
/// succeeded.
pub fn run_ok(command: &mut std::process::Command, what: &str) -> std::process::Output {
    let output = command
        .output()
        .unwrap_or_else(|e| panic!("{what}: cannot run it: {e}"));
    assert!(
        output.status.success(),
        "{what} failed:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

/// Values for cluster templates' `${VARIABLES}` (capmox's and the Go provider's), as a user
/// would set them.
pub const TEMPLATE_VALUES: &[(&str, &str)] = &[
    ("CLUSTER_NAME", "demo"),
    ("CONTROL_PLANE_ENDPOINT_IP", "10.0.0.10"),
    ("NODE_IP_RANGES", "[10.0.0.100-10.0.0.150]"),
    ("IP_PREFIX", "24"),
    ("GATEWAY", "10.0.0.1"),
    ("DNS_SERVERS", "[10.0.0.2]"),
    ("PROXMOX_SOURCENODE", "pve1"),
    ("TEMPLATE_VMID", "9000"),
    ("BOOT_VOLUME_DEVICE", "scsi0"),
    ("BRIDGE", "vmbr0"),
    ("KUBERNETES_VERSION", "v1.33.0"),
    ("CONTROL_PLANE_MACHINE_COUNT", "3"),
    ("WORKER_MACHINE_COUNT", "2"),
    ("VM_SSH_KEYS", "ssh-ed25519 AAAA"),
    ("PROXMOX_URL", "https://pve.example:8006"),
    ("PROXMOX_TOKEN", "capmox@pve!capi"),
    ("PROXMOX_SECRET", "secret"),
    ("ZONE_A_NODES", "[pve1, pve2]"),
    ("ZONE_B_NODES", "[pve3, pve4]"),
    ("ZONE_C_NODES", "[pve5]"),
    ("NODE_IPV6_RANGES", "[2001:db8::100-2001:db8::150]"),
    ("IPV6_PREFIX", "64"),
    ("IPV6_GATEWAY", "2001:db8::1"),
    ("SECONDARY_BRIDGE", "vmbr1"),
    ("SECONDARY_IP_RANGES", "[10.0.20.100-10.0.20.150]"),
    ("SECONDARY_IP_PREFIX", "24"),
    ("SECONDARY_GATEWAY", "10.0.20.1"),
    ("TEMPLATE_TAGS", "ubuntu-24.04, k8s-v1.33"),
];

/// clusterctl-style substitution of `${VAR}`, `${VAR:=default}` and `${VAR=default}` from
/// `values`; panics on a variable with neither a value nor a default. `$${VAR}` is the escape
/// for a literal `${VAR}`, as in clusterctl.
pub fn substitute(text: &str, values: &[(&str, &str)]) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(start) = rest.find("${") {
        if start > 0 && rest.as_bytes()[start - 1] == b'$' {
            out.push_str(&rest[..start - 1]);
            out.push_str("${");
            rest = &rest[start + 2..];
            continue;
        }
        out.push_str(&rest[..start]);
        let end = rest[start..].find('}').expect("closing brace") + start;
        // clusterctl drops spaces around a name (`${ VAR }`, its legacy form).
        let expr = rest[start + 2..end].trim();
        let (name, default) = match expr.split_once(":=").or_else(|| expr.split_once('=')) {
            Some((name, default)) => (name, Some(default)),
            None => (expr, None),
        };
        let value = values
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| *v)
            .or(default);
        out.push_str(value.unwrap_or_else(|| panic!("no test value for ${{{name}}}")));
        rest = &rest[end + 1..];
    }
    out.push_str(rest);
    out
}
