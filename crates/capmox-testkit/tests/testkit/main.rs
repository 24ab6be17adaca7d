//! capmox-testkit's integration tests, in one binary: the in-process API server as kube's
//! client and controllers use it. One module per subject; the repository's shared test support
//! (`tests/support/`) is included by path.

#[path = "../../../../tests/support/paths.rs"]
mod paths;
#[path = "../../../../tests/support/widgets.rs"]
mod widgets;

/// What the modules share.
mod common {
    pub use crate::paths::*;
    pub use crate::widgets::*;
}

mod controller;
mod conversion;
mod crud;
mod faults;
mod http;
mod lifecycle;
mod patch;
mod watch;
