//! Pieces that let capmox run end to end on one machine without a real management cluster:
//! [`standin`] plays CAPI core and KCP for the infrastructure-provider contract, and [`ipam`]
//! plays the in-cluster IPAM provider; [`sites`] reads the sandbox's multi-site topology
//! files. Used by the `capmox-sandbox` binary, the end-to-end
//! tests and the benchmarks; never by the controllers themselves.

pub mod conversion;
pub mod examples;
pub mod ipam;
pub mod real;
pub mod real_capi;
mod real_capi_hardware;
mod real_capi_move;
mod real_capi_steps;
pub mod run;
pub mod sites;
pub mod standin;
pub mod workload;
