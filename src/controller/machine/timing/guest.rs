//! A booting guest as every policy tracks it: since when it boots, and when it is looked at
//! next.

use std::time::{Duration, Instant};

pub(super) struct GuestBoot {
    pub node: String,
    pub started: Instant,
    /// How long after the start a look last found it not done (zero: none did).
    pub last_seen_silent: Duration,
    /// When to look next.
    pub due: Instant,
}

impl GuestBoot {
    /// A guest on `node` counted as started `now`, looked at first at `due`.
    pub fn new(node: &str, now: Instant, due: Instant) -> Self {
        GuestBoot {
            node: node.to_owned(),
            started: now,
            last_seen_silent: Duration::ZERO,
            due,
        }
    }
}
