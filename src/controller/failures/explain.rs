//! How a failed Proxmox request reaches the user: every [`ProxmoxError`] maps to one stable
//! condition reason ([`reason`]) and a message that says what capmox was doing, what Proxmox
//! answered and what to fix ([`describe`]). Messages carry no secret (Proxmox never echoes the
//! token secret, and the client keeps it out of its errors).

use std::time::Duration;

use crate::proxmox::ProxmoxError;
use crate::proxmox::error::format_errors;

/// The condition reason for a failed Proxmox request: a stable name per kind of failure, the
/// same in `ProxmoxAvailable` (ProxmoxCluster) and `VirtualMachineProvisioned` (ProxmoxMachine).
pub fn reason(error: &ProxmoxError) -> &'static str {
    match error {
        ProxmoxError::Unauthorized { .. } => "Unauthorized",
        ProxmoxError::Forbidden { .. } => "ProxmoxForbidden",
        ProxmoxError::RateLimited { .. } => "ProxmoxRateLimited",
        ProxmoxError::Locked { .. } => "ProxmoxLocked",
        ProxmoxError::NotFound { .. } => "ProxmoxNotFound",
        ProxmoxError::TaskFailed { .. } => "TaskFailed",
        ProxmoxError::TaskTimeout { .. } => "WaitingForTask",
        ProxmoxError::Decode { .. } => "ProxmoxResponseInvalid",
        ProxmoxError::AlreadyExists { .. } | ProxmoxError::InvalidParameters { .. } => {
            "ProxmoxRequestRejected"
        }
        _ if tls_problem(error) => "TLSVerificationFailed",
        ProxmoxError::Config(_) => "CredentialsInvalid",
        ProxmoxError::Fenced => "LeadershipLost",
        ProxmoxError::Transient {
            status: Some(500), ..
        } => "ProxmoxServerError",
        ProxmoxError::Transient { .. } => "ProxmoxUnreachable",
        ProxmoxError::Api { status, .. } if *status < 500 => "ProxmoxRequestRejected",
        ProxmoxError::Api { .. } => "ProxmoxServerError",
    }
}

fn tls_problem(error: &ProxmoxError) -> bool {
    let text = error.to_string().to_ascii_lowercase();
    matches!(
        error,
        ProxmoxError::Config(_) | ProxmoxError::Transient { status: None, .. }
    ) && [
        "certificate",
        "tls verification",
        "unknownissuer",
        "fingerprint",
    ]
    .iter()
    .any(|k| text.contains(k))
}

/// A failed Proxmox request as a user sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Described {
    /// The condition (and event) reason, from [`reason`].
    pub reason: &'static str,
    /// What failed, what Proxmox answered, what to fix. Stable while the failure repeats, so
    /// rewriting the condition is a no-op.
    pub message: String,
    /// How long the server asked to wait (429 `Retry-After`).
    pub retry_after: Option<Duration>,
}

/// `step` (what capmox was doing, e.g. "cloning template 9000 on pve1 to VM 101 on pve3")
/// failed with `error`: its reason, and a message with Proxmox's answer and what to fix.
pub fn describe(step: &str, error: &ProxmoxError) -> Described {
    Described {
        reason: reason(error),
        message: format!("{step}: {}", what_to_fix(error)),
        retry_after: match error {
            ProxmoxError::RateLimited { retry_after, .. } => *retry_after,
            _ => None,
        },
    }
}

/// What Proxmox answered, and what to fix for it.
fn what_to_fix(error: &ProxmoxError) -> String {
    match error {
        ProxmoxError::Unauthorized { reason } => format!(
            "Proxmox rejected the API token (HTTP 401: {reason}); check the API token id and secret in the credentials"
        ),
        ProxmoxError::Fenced => "this replica lost the leader election Lease and stopped writing to Proxmox; the replica that leads now continues".to_owned(),
        ProxmoxError::Forbidden { reason } => match permission(reason) {
            Some((path, privilege)) => format!(
                "the API token lacks {privilege} on {path} (HTTP 403: {reason}); grant it on {path} to the token (with privilege separation, to the token itself)"
            ),
            None => format!(
                "Proxmox denied the request (HTTP 403: {reason}); grant the API token the privileges capmox needs"
            ),
        },
        ProxmoxError::RateLimited { reason, .. } => format!(
            "Proxmox or a proxy in front of it limits the request rate (HTTP 429: {reason}); capmox waits at least as long as the server asks, lower --proxmoxmachine-concurrency if this persists"
        ),
        ProxmoxError::Locked { lock, reason, .. } => format!(
            "the VM is locked ({lock}) by another Proxmox operation ({reason}); retried until the lock is released"
        ),
        ProxmoxError::NotFound { status, reason } => format!(
            "Proxmox does not know it (HTTP {status}: {reason}); check that the template, node and storage the spec names exist"
        ),
        ProxmoxError::AlreadyExists { status, reason } => format!(
            "Proxmox says it already exists (HTTP {status}: {reason}); remove the conflicting object or use another VMID range"
        ),
        ProxmoxError::InvalidParameters {
            status,
            reason,
            errors,
        } => format!(
            "Proxmox rejected the request (HTTP {status}: {reason} {}); fix the values it names in the spec",
            format_errors(errors)
        ),
        ProxmoxError::Api { status, reason } if *status < 500 => format!(
            "Proxmox rejected the request (HTTP {status}: {reason}); fix what it names in the spec, and check that the URL points at a supported Proxmox VE"
        ),
        ProxmoxError::Api { status, reason } => format!(
            "Proxmox failed (HTTP {status}: {reason}); fix what Proxmox names (storage, node, template) or check the node's health"
        ),
        ProxmoxError::Transient { .. } => transient_detail(error),
        ProxmoxError::TaskFailed { upid, exitstatus } => {
            format!("Proxmox task {upid} failed: {exitstatus}; fix what the task log names")
        }
        ProxmoxError::TaskTimeout { upid, waited_ms } => format!(
            "Proxmox task {upid} still runs after {waited_ms} ms; it is checked again (see its log on the node if it hangs)"
        ),
        ProxmoxError::Decode { endpoint, message } => format!(
            "cannot read Proxmox's answer to {endpoint} ({message}); check that the URL points at the Proxmox VE API (https://host:8006), not at another service or a login page"
        ),
        ProxmoxError::Config(text) => text.clone(),
    }
}

/// What a failure that may pass on its own tells, and what to check meanwhile.
fn transient_detail(error: &ProxmoxError) -> String {
    match error {
        ProxmoxError::Transient {
            status: Some(500),
            reason,
        } => format!(
            "Proxmox cannot serve it now (HTTP 500: {reason}); check the Proxmox cluster's quorum and the node's health"
        ),
        ProxmoxError::Transient {
            status: Some(status @ 595..=599),
            reason,
        } => format!(
            "Proxmox could not reach the node (HTTP {status}: {reason}); check that the node is online and reachable from the other nodes"
        ),
        ProxmoxError::Transient {
            status: Some(status),
            reason,
        } => format!(
            "the proxy in front of Proxmox failed (HTTP {status}: {reason}); check the proxy and pveproxy"
        ),
        ProxmoxError::Transient { status: None, .. } if tls_problem(error) => {
            format!("{error}; trust Proxmox's CA (root_ca) or pin its certificate fingerprint")
        }
        ProxmoxError::Transient {
            status: None,
            reason,
        } => format!(
            "cannot reach Proxmox ({reason}); check the URL, DNS and firewall, and that pveproxy runs"
        ),
        other => other.to_string(),
    }
}

/// Path and privilege of `Permission check failed (/vms/100, VM.Allocate)`.
fn permission(reason: &str) -> Option<(&str, &str)> {
    let inner = reason.split_once('(')?.1.rsplit_once(')')?.0;
    let (path, privilege) = inner.split_once(", ")?;
    (path.starts_with('/') && !privilege.contains(' ')).then_some((path, privilege))
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn error(status: u16, reason: &str) -> ProxmoxError {
        ProxmoxError::from_response(status, reason, BTreeMap::new())
    }

    #[test]
    fn every_kind_of_proxmox_failure_has_a_reason_and_says_what_to_fix() {
        let step = "cloning template 9000 on pve1 to VM 101 on pve3";
        let mut parameters = BTreeMap::new();
        parameters.insert(
            "storage".to_owned(),
            "storage 'fast' does not exist".to_owned(),
        );
        let cases: Vec<(ProxmoxError, &str, &[&str])> = vec![
            (
                error(401, "invalid token value!"),
                "Unauthorized",
                &["HTTP 401: invalid token value!", "check the API token id and secret"],
            ),
            (
                error(403, "Permission check failed (/vms/101, VM.Allocate)"),
                "ProxmoxForbidden",
                &["lacks VM.Allocate on /vms/101", "grant it on /vms/101 to the token"],
            ),
            (
                error(403, "Permission check failed (URI '/access/ticket' not available with API token, need proper ticket.)"),
                "ProxmoxForbidden",
                &["HTTP 403", "grant the API token the privileges"],
            ),
            (
                error(500, "can't clone VM to node 'pve3' (VM uses local storage)"),
                "ProxmoxServerError",
                &["HTTP 500: can't clone VM to node 'pve3' (VM uses local storage)", "fix what Proxmox names"],
            ),
            (
                error(500, "cluster not ready - no quorum?"),
                "ProxmoxServerError",
                &["no quorum", "quorum"],
            ),
            (
                error(596, "Connection timed out"),
                "ProxmoxUnreachable",
                &["HTTP 596", "node is online"],
            ),
            (
                error(502, "Bad Gateway"),
                "ProxmoxUnreachable",
                &["HTTP 502", "proxy"],
            ),
            (
                ProxmoxError::Transient { status: None, reason: "cannot connect: connection refused".into() },
                "ProxmoxUnreachable",
                &["connection refused", "check the URL"],
            ),
            (
                ProxmoxError::Transient { status: None, reason: "invalid peer certificate: UnknownIssuer".into() },
                "TLSVerificationFailed",
                &["UnknownIssuer", "root_ca"],
            ),
            (
                ProxmoxError::Config("TLS verification of the Proxmox VE server failed (invalid peer certificate: UnknownIssuer); trust its CA".into()),
                "TLSVerificationFailed",
                &["trust its CA"],
            ),
            (
                ProxmoxError::Config("API token 'x' contains characters not allowed".into()),
                "CredentialsInvalid",
                &["characters not allowed"],
            ),
            (
                ProxmoxError::from_response(400, "Parameter verification failed.", parameters),
                "ProxmoxRequestRejected",
                &["HTTP 400", "storage: storage 'fast' does not exist", "fix the values"],
            ),
            (
                error(400, "upload failed: wrong content type"),
                "ProxmoxRequestRejected",
                &["HTTP 400", "wrong content type"],
            ),
            (
                error(501, "Method 'POST /nodes/pve1/qemu/9000/clone' not implemented"),
                "ProxmoxServerError",
                &["HTTP 501", "not implemented"],
            ),
            (
                error(429, "Too Many Requests"),
                "ProxmoxRateLimited",
                &["HTTP 429", "as long as the server asks"],
            ),
            (
                error(500, "VM is locked (backup)"),
                "ProxmoxLocked",
                &["locked (backup)"],
            ),
            (
                error(404, "Not Found"),
                "ProxmoxNotFound",
                &["HTTP 404", "exist"],
            ),
            (
                error(500, "unable to create VM 101 - VM 101 already exists on node 'pve2'"),
                "ProxmoxRequestRejected",
                &["already exists", "another VMID range"],
            ),
            (
                ProxmoxError::Decode { endpoint: "GET /cluster/resources".into(), message: "body is not JSON: expected value at line 1".into() },
                "ProxmoxResponseInvalid",
                &["GET /cluster/resources", "not JSON", "points at the Proxmox VE API"],
            ),
            (
                ProxmoxError::TaskFailed { upid: "UPID:pve3:1:2:3:qmclone:9000:capi@pve!capmox:".into(), exitstatus: "storage full".into() },
                "TaskFailed",
                &["storage full", "task log"],
            ),
            (
                ProxmoxError::TaskTimeout { upid: "UPID:pve3:1:2:3:qmclone:9000:capi@pve!capmox:".into(), waited_ms: 120_000 },
                "WaitingForTask",
                &["120000 ms"],
            ),
        ];
        for (error, expected, parts) in cases {
            let described = describe(step, &error);
            assert_eq!(described.reason, expected, "{error:?}");
            assert!(described.message.starts_with(step), "{}", described.message);
            for part in parts {
                assert!(
                    described.message.contains(part),
                    "{part:?} in {}",
                    described.message
                );
            }
        }
    }

    #[test]
    fn a_rate_limit_carries_the_servers_retry_after() {
        let error = error(429, "Too Many Requests").with_retry_after(Some(Duration::from_secs(9)));
        assert_eq!(
            describe("listing VMs", &error).retry_after,
            Some(Duration::from_secs(9))
        );
        assert_eq!(
            describe("listing VMs", &super::tests::error(500, "x")).retry_after,
            None
        );
    }
}
