//! capmox: a Cluster API infrastructure provider for Proxmox VE, with zones as failure domains.
//!
//! `api` holds the types users write; `capi` the read-only views of CAPI objects capmox consumes;
//! `schema` checks objects against the published CRD schemas the way the API server does;
//! `placement` decides where each machine goes (pure); `proxmox` is the typed Proxmox VE client;
//! `sim` a Proxmox VE simulator and `testkit` an in-process Kubernetes API server, both for
//! tests, benchmarks and the sandbox.

pub mod api;
pub mod capi;
pub mod cli;
pub mod controller;
pub mod placement;
pub mod proxmox;
pub mod sandbox;
pub mod schema;
pub mod sim;
pub mod testkit;
