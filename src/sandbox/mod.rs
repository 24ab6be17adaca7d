//! Stand-ins for the parts of a management cluster that are not capmox (CAPI core, the IPAM
//! provider), used by `capmox sandbox`, the end-to-end tests and the benchmarks. Never used by
//! the controllers themselves.

pub mod ipam;
