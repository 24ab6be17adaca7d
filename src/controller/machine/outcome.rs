//! How a step of a pass ends when the pass does not go on: it waits (saying why, and when the
//! machine is looked at again) or it fails (retried with back-off). One type for both, so a
//! step's `?` ends the pass either way and "wait" never hides inside an `Ok`.

use std::time::Duration;

use kube::runtime::controller::Action;

use super::{MachineError, PROVISIONED};
use crate::controller::conditions::Decided;
use crate::controller::failures;
use crate::controller::guarded::WriteError;
use crate::proxmox::ProxmoxError;

/// What a waiting machine reports and when it is looked at again.
#[derive(Debug)]
pub(super) struct Wait {
    pub decided: Decided,
    pub action: Action,
    /// The machine's back-off streak goes on (a wait without it ends the streak).
    pub backoff: bool,
}

/// Why a pass ends before the machine is provisioned (or, once it is, before its tidying up).
#[derive(Debug)]
pub(super) enum Stop {
    Wait(Wait),
    Failed(MachineError),
}

/// The result of a step: go on with `T`, or stop.
pub(super) type Flow<T = ()> = Result<T, Stop>;

impl Wait {
    /// The same requeue for a machine that is provisioned: what it waits for now (a task that
    /// tidies up, such as the seed ISO's removal) does not make it less so.
    pub(super) fn still_provisioned(self) -> Self {
        Self {
            decided: Decided::ok(PROVISIONED, "Provisioned", ""),
            ..self
        }
    }
}

impl Stop {
    /// As [`Wait::still_provisioned`] for a wait.
    pub(super) fn still_provisioned(self) -> Self {
        match self {
            Self::Wait(wait) => Self::Wait(wait.still_provisioned()),
            failed => failed,
        }
    }
}

impl From<MachineError> for Stop {
    fn from(error: MachineError) -> Self {
        Self::Failed(error)
    }
}

impl From<ProxmoxError> for Stop {
    fn from(error: ProxmoxError) -> Self {
        Self::Failed(error.into())
    }
}

impl From<kube::Error> for Stop {
    fn from(error: kube::Error) -> Self {
        Self::Failed(error.into())
    }
}

impl From<WriteError> for Stop {
    fn from(error: WriteError) -> Self {
        Self::Failed(error.into())
    }
}

impl From<serde_json::Error> for Stop {
    fn from(error: serde_json::Error) -> Self {
        Self::Failed(error.into())
    }
}

/// Waiting for something outside capmox (a task, the guest, another controller).
pub(super) fn waiting(reason: &str, message: impl Into<String>, action: Action) -> Stop {
    Stop::Wait(wait(reason, message, action))
}

/// What a machine that waits reports, and when it is looked at again.
pub(super) fn wait(reason: &str, message: impl Into<String>, action: Action) -> Wait {
    Wait {
        decided: Decided::failed(PROVISIONED, reason, message),
        action,
        backoff: false,
    }
}

/// Waiting for something that polling more often does not bring sooner: the machine's back-off
/// streak goes on, and the next look comes after `retry.delay`.
pub(super) fn waiting_longer(
    reason: &str,
    message: impl Into<String>,
    retry: &failures::Retry,
) -> Stop {
    Stop::Wait(Wait {
        decided: Decided::failed(PROVISIONED, reason, message),
        action: Action::requeue(retry.delay),
        backoff: true,
    })
}

/// Waiting for the IPAM provider to bind the machine's claims (the claims and addresses are
/// watched; the requeue is a fallback).
pub(super) fn waiting_for_addresses() -> Stop {
    waiting(
        "WaitingForStaticIPAllocation",
        "waiting for the IP address claims to be bound",
        Action::requeue(Duration::from_secs(30)),
    )
}
