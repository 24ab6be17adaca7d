//! capmox-sandbox's integration tests, in one binary: the CAPI, KCP and IPAM stand-ins, the
//! sandbox's example cluster end to end, and the `capmox-sandbox` binary. The repository's
//! shared test support (`tests/support/`) is included by path.

#[path = "../../../../tests/support/env.rs"]
mod env;
#[path = "../../../../tests/support/paths.rs"]
mod paths;

mod cli;
mod example;
mod standin;
mod standin_capmox;
