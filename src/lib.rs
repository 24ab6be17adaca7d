//! capmox: a Cluster API infrastructure provider for Proxmox VE, with zones as failure domains.
//!
//! `api` holds the types users write; `capi` the read-only views of CAPI objects capmox consumes;
//! `schema` checks objects against the published CRD schemas the way the API server does.

pub mod api;
pub mod capi;
pub mod cli;
pub mod placement;
pub mod schema;
