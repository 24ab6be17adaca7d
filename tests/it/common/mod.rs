#![allow(dead_code)]
//! Shared helpers of capmox's integration tests: the workspace's test support
//! (`tests/support/`: paths, the management-cluster environment), a Proxmox fixture server and
//! log capture.

#[path = "../../support/env.rs"]
pub mod env;
pub mod fixture_server;
pub mod logs;

pub use crate::paths::{TEMPLATE_VALUES, cargo, data, root, run_ok, substitute, tool, venv_tool};

/// A ProxmoxMachine's `topology.kubernetes.io/proxmox-zone` label.
pub fn zone_label(machine: &capmox::api::ProxmoxMachine) -> Option<&str> {
    machine
        .metadata
        .labels
        .as_ref()?
        .get("topology.kubernetes.io/proxmox-zone")
        .map(String::as_str)
}
