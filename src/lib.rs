//! capmox: a Cluster API infrastructure provider for Proxmox VE, with zones as failure domains.
//!
//! `api` holds the types users write; `capi` the read-only views of CAPI objects capmox consumes;
//! `placement` decides where each machine goes (pure); `proxmox` is the typed Proxmox VE client;
//! `cloudinit` renders the NoCloud seed; `controller` reconciles; `webhook` converts objects
//! between API versions for the API server. The test rigs (Proxmox simulator, in-process
//! Kubernetes API server, sandbox) are the workspace's other crates.

pub mod api;
pub mod capi;
pub mod cli;
pub mod cloudinit;
pub mod controller;
pub mod docs;
pub mod placement;
pub mod proxmox;
pub mod webhook;
