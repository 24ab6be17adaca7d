//! How failures reach the user, and when a failing object is tried again: the back-off and
//! failure streaks ([`retries`]), the reason and message of a failed Proxmox request
//! ([`explain`]), and the events that announce them ([`events`]).

mod events;
mod explain;
mod retries;

pub use events::publish_event;
pub use explain::{Described, describe, reason};
pub use retries::{
    API_BACKOFF, Backoff, JITTER, PROXMOX_BACKOFF, Pass, Retries, Retry, after_error, key, millis,
};
