//! capmox-sim's integration tests, in one binary: the simulator through capmox's Proxmox
//! client and raw HTTP, against the PVE API schema and recorded answers, and the
//! `simulate-proxmox` binary. The repository's shared test support (`tests/support/`) is
//! included by path.

#[path = "../../../../tests/support/paths.rs"]
mod paths;

mod api;
mod cli;
mod disks;
mod ha;
mod hardware;
mod profile;
mod shapes;
