//! Error model of the Proxmox VE client: every failure is classified once, here,
//! from the HTTP status, the reason phrase and the optional `message`/`errors` body.

use std::collections::BTreeMap;

/// Result alias used by every client call.
pub type Result<T, E = ProxmoxError> = std::result::Result<T, E>;

/// A classified Proxmox VE API failure. The server's reason text is always kept.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProxmoxError {
    /// The object does not exist (Proxmox answers 500 "... does not exist", or 400 "no such task").
    #[error("Proxmox VE object not found (HTTP {status}): {reason}")]
    NotFound {
        /// HTTP status code.
        status: u16,
        /// Reason phrase or message from the server.
        reason: String,
    },
    /// The object (VMID, pool, config file) already exists.
    #[error("Proxmox VE object already exists (HTTP {status}): {reason}")]
    AlreadyExists {
        /// HTTP status code.
        status: u16,
        /// Reason phrase or message from the server.
        reason: String,
    },
    /// The guest is locked (`VM is locked (clone)`) or a file lock timed out; retry later.
    #[error("Proxmox VE guest is locked ({lock}), retry later (HTTP {status}): {reason}")]
    Locked {
        /// HTTP status code.
        status: u16,
        /// Lock name (`clone`, `backup`, ...) or `flock` for lock-file timeouts.
        lock: String,
        /// Reason phrase or message from the server.
        reason: String,
    },
    /// Authentication failed: check the API token id and secret.
    #[error(
        "Proxmox VE rejected the credentials (HTTP 401: {reason}); check the API token id and secret"
    )]
    Unauthorized {
        /// Reason phrase from the server.
        reason: String,
    },
    /// The token lacks a privilege; grant the ACL named in the reason.
    #[error(
        "Proxmox VE permission denied (HTTP 403: {reason}); grant the API token the named privilege"
    )]
    Forbidden {
        /// Reason phrase from the server (names path and privilege).
        reason: String,
    },
    /// Parameter verification failed; `errors` maps each parameter to its problem.
    #[error("Proxmox VE rejected the parameters (HTTP {status}: {reason}): {}", format_errors(.errors))]
    InvalidParameters {
        /// HTTP status code (400).
        status: u16,
        /// Reason phrase (`Parameter verification failed.`).
        reason: String,
        /// Parameter name → error text (trimmed).
        errors: BTreeMap<String, String>,
    },
    /// A temporary failure (connection error, timeout, 5xx proxy codes, no quorum); retry with back-off.
    #[error("transient Proxmox VE failure{}: {reason}", .status.map(|s| format!(" (HTTP {s})")).unwrap_or_default())]
    Transient {
        /// HTTP status code, `None` for connection-level errors.
        status: Option<u16>,
        /// What went wrong.
        reason: String,
    },
    /// Proxmox or a proxy in front of it limits the request rate (HTTP 429); retry no sooner
    /// than `retry_after` when the server said so.
    #[error("Proxmox VE is rate limiting requests (HTTP 429: {reason})")]
    RateLimited {
        /// Reason phrase or message from the server.
        reason: String,
        /// The server's `Retry-After`, when it sent one.
        retry_after: Option<std::time::Duration>,
    },
    /// This replica lost leadership: it sends Proxmox no more writes, so two leaders never
    /// act at once (the replica that leads now takes over).
    #[error("not sending a write to Proxmox VE: this replica is no longer the leader")]
    Fenced,
    /// A task ended with an exit status other than `OK`/`WARNINGS: n`.
    #[error("Proxmox VE task {upid} failed: {exitstatus}")]
    TaskFailed {
        /// The task's UPID.
        upid: String,
        /// The task's exit status (the error text).
        exitstatus: String,
    },
    /// Waiting for a task exceeded the caller's deadline; the task may still be running.
    #[error("timed out after {waited_ms} ms waiting for Proxmox VE task {upid}")]
    TaskTimeout {
        /// The task's UPID.
        upid: String,
        /// How long we waited.
        waited_ms: u64,
    },
    /// Any other API error (e.g. 500 storage errors, 501 not implemented).
    #[error("Proxmox VE API error (HTTP {status}): {reason}")]
    Api {
        /// HTTP status code.
        status: u16,
        /// Reason phrase or message from the server.
        reason: String,
    },
    /// A success response did not have the expected shape.
    #[error("cannot decode Proxmox VE response of {endpoint}: {message}")]
    Decode {
        /// Endpoint template, e.g. `GET /nodes/{node}/qemu`.
        endpoint: String,
        /// What did not match.
        message: String,
    },
    /// The client configuration is invalid (URL, token format, TLS material).
    #[error("invalid Proxmox VE client configuration: {0}")]
    Config(String),
}

/// `name: problem; name: problem` of a parameter error map.
pub(crate) fn format_errors(errors: &BTreeMap<String, String>) -> String {
    errors
        .iter()
        .map(|(k, v)| format!("{k}: {v}"))
        .collect::<Vec<_>>()
        .join("; ")
}

impl ProxmoxError {
    /// Whether retrying the same request later may succeed (transient and lock errors).
    pub fn is_retryable(&self) -> bool {
        matches!(self, Self::Transient { .. } | Self::Locked { .. })
    }

    /// Whether the error means the addressed object is gone.
    pub fn is_not_found(&self) -> bool {
        matches!(self, Self::NotFound { .. })
    }

    /// Whether a guest-agent call failed only because the agent does not answer yet
    /// (guest still booting, or a qga timeout): retry later, it is not a configuration error.
    pub fn is_agent_unavailable(&self) -> bool {
        matches!(self, Self::Api { status: 500, reason }
            if reason.contains("guest agent is not running")
                || (reason.contains("qga command") && reason.contains("got timeout")))
    }

    /// Whether the guest agent answered that a file it was asked to read is not there (QGA's
    /// `guest-file-open` failed with ENOENT).
    pub fn is_missing_guest_file(&self) -> bool {
        matches!(self, Self::Api { status: 500, reason } | Self::NotFound { status: 500, reason }
            if reason.contains("guest-file-open") && reason.contains("No such file or directory"))
    }

    /// The server's reason text, when the error came from the server.
    pub fn reason(&self) -> Option<&str> {
        match self {
            Self::NotFound { reason, .. }
            | Self::AlreadyExists { reason, .. }
            | Self::Locked { reason, .. }
            | Self::Unauthorized { reason }
            | Self::Forbidden { reason }
            | Self::InvalidParameters { reason, .. }
            | Self::Transient { reason, .. }
            | Self::RateLimited { reason, .. }
            | Self::Api { reason, .. } => Some(reason),
            Self::TaskFailed { exitstatus, .. } => Some(exitstatus),
            _ => None,
        }
    }

    /// The same error with the server's `Retry-After` attached, when it is a rate limit.
    pub fn with_retry_after(self, after: Option<std::time::Duration>) -> Self {
        match self {
            Self::RateLimited { reason, .. } => Self::RateLimited {
                reason,
                retry_after: after,
            },
            other => other,
        }
    }

    /// Classifies an HTTP error response. `reason` is the status line's phrase (or the
    /// body's `message`), `errors` the body's parameter error map.
    pub fn from_response(status: u16, reason: &str, errors: BTreeMap<String, String>) -> Self {
        let reason = reason.trim().to_string();
        let lower = reason.to_ascii_lowercase();
        match status {
            401 => Self::Unauthorized { reason },
            403 => Self::Forbidden { reason },
            // PVE says "does not exist" with a 500, but some builds and proxies in front of it
            // answer 404 for a VM that is gone; both mean the same.
            404 => Self::NotFound { status, reason },
            429 => Self::RateLimited {
                reason,
                retry_after: None,
            },
            400 => {
                let joined = errors
                    .values()
                    .map(|v| v.to_ascii_lowercase())
                    .collect::<Vec<_>>()
                    .join("\n");
                if joined.contains("no such task") {
                    Self::NotFound {
                        status,
                        reason: first_error_or(&errors, &reason),
                    }
                } else if joined.contains("already exists") {
                    Self::AlreadyExists {
                        status,
                        reason: first_error_or(&errors, &reason),
                    }
                } else {
                    Self::InvalidParameters {
                        status,
                        reason,
                        errors,
                    }
                }
            }
            500 => classify_500(reason, &lower),
            502..=504 | 595..=599 => Self::Transient {
                status: Some(status),
                reason,
            },
            _ => Self::Api { status, reason },
        }
    }
}

/// Characters of a non-JSON error body kept in the error (and so in conditions and events).
pub const BODY_EXCERPT_CHARS: usize = 120;

/// Bytes of a non-JSON error body written to the debug log.
const BODY_LOG_BYTES: usize = 4096;

/// A short, single-line excerpt of a non-JSON error body (a proxy's HTML page, a stack trace):
/// control characters and markup-free whitespace runs collapsed, at most
/// [`BODY_EXCERPT_CHARS`] characters; the body itself (bounded) goes to the debug log only.
pub fn body_excerpt(status: u16, body: &[u8]) -> Option<String> {
    let logged = &body[..body.len().min(BODY_LOG_BYTES)];
    tracing::debug!(status, body = %String::from_utf8_lossy(logged), "Proxmox error body (not JSON)");
    let text = String::from_utf8_lossy(body);
    let mut excerpt = String::new();
    let mut chars = 0;
    for word in text
        .split(|c: char| c.is_whitespace() || c.is_control())
        .filter(|word| !word.is_empty())
    {
        let word: String = word.chars().filter(|c| !is_invisible(*c)).collect();
        if word.is_empty() {
            continue;
        }
        if !excerpt.is_empty() {
            excerpt.push(' ');
            chars += 1;
        }
        for c in word.chars() {
            if chars == BODY_EXCERPT_CHARS {
                excerpt.push('…');
                return Some(excerpt);
            }
            excerpt.push(c);
            chars += 1;
        }
    }
    (!excerpt.is_empty()).then_some(excerpt)
}

/// Format characters that render as nothing or reorder text (bidi overrides, zero-width).
fn is_invisible(c: char) -> bool {
    matches!(c, '\u{200B}'..='\u{200F}' | '\u{202A}'..='\u{202E}' | '\u{2066}'..='\u{2069}' | '\u{FEFF}')
}

fn first_error_or(errors: &BTreeMap<String, String>, fallback: &str) -> String {
    errors
        .values()
        .next()
        .map(|v| v.trim().to_string())
        .unwrap_or_else(|| fallback.to_string())
}

fn classify_500(reason: String, lower: &str) -> ProxmoxError {
    let status = 500;
    if let Some(lock) = locked_name(&reason) {
        return ProxmoxError::Locked {
            status,
            lock,
            reason,
        };
    }
    // "qga command '...' failed - got timeout" is a hung guest agent, not a lock
    if (lower.contains("got timeout") && !lower.contains("qga command"))
        || lower.contains("got lock request timeout")
    {
        return ProxmoxError::Locked {
            status,
            lock: "flock".to_string(),
            reason,
        };
    }
    if lower.contains("already exists") {
        return ProxmoxError::AlreadyExists { status, reason };
    }
    if lower.contains("does not exist")
        || lower.contains("no such ")
        || lower.contains("hostname lookup")
    {
        return ProxmoxError::NotFound { status, reason };
    }
    if lower.contains("got no worker upid")
        || lower.contains("no quorum")
        || lower.contains("connection refused")
        || lower.contains("temporarily unavailable")
    {
        return ProxmoxError::Transient {
            status: Some(status),
            reason,
        };
    }
    ProxmoxError::Api { status, reason }
}

/// Extracts `clone` from `VM is locked (clone)` (also `CT is locked (...)`).
fn locked_name(reason: &str) -> Option<String> {
    let idx = reason.find("is locked (")?;
    let rest = &reason[idx + "is locked (".len()..];
    let end = rest.find(')')?;
    Some(rest[..end].to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classifies_server_texts() {
        let e = ProxmoxError::from_response(
            500,
            "Configuration file 'nodes/pve/qemu-server/100.conf' does not exist",
            BTreeMap::new(),
        );
        assert!(e.is_not_found(), "{e:?}");
        let e = ProxmoxError::from_response(500, "VM is locked (clone)", BTreeMap::new());
        assert!(matches!(&e, ProxmoxError::Locked { lock, .. } if lock == "clone"));
        assert!(e.is_retryable());
        let e = ProxmoxError::from_response(
            500,
            "can't lock file '/var/lock/qemu-server/lock-100.conf' - got timeout",
            BTreeMap::new(),
        );
        assert!(matches!(&e, ProxmoxError::Locked { lock, .. } if lock == "flock"));
        let e = ProxmoxError::from_response(
            500,
            "unable to create VM 100 - VM 100 already exists on node 'pve'",
            BTreeMap::new(),
        );
        assert!(matches!(e, ProxmoxError::AlreadyExists { .. }));
        let e = ProxmoxError::from_response(596, "Connection timed out", BTreeMap::new());
        assert!(matches!(
            e,
            ProxmoxError::Transient {
                status: Some(596),
                ..
            }
        ));
        let e = ProxmoxError::from_response(401, "invalid token value!", BTreeMap::new());
        assert!(matches!(e, ProxmoxError::Unauthorized { .. }));
        let e = ProxmoxError::from_response(
            403,
            "Permission check failed (/vms/100, VM.Allocate)",
            BTreeMap::new(),
        );
        assert!(matches!(e, ProxmoxError::Forbidden { .. }));
        let e =
            ProxmoxError::from_response(500, "QEMU guest agent is not running", BTreeMap::new());
        assert!(e.is_agent_unavailable());
        let e = ProxmoxError::from_response(
            500,
            "VM 101 qga command 'guest-network-get-interfaces' failed - got timeout",
            BTreeMap::new(),
        );
        assert!(e.is_agent_unavailable(), "{e:?}");
        assert!(
            !e.is_retryable(),
            "handled by the agent wait, not as a lock"
        );
        let e = ProxmoxError::from_response(500, "No QEMU guest agent configured", BTreeMap::new());
        assert!(!e.is_agent_unavailable());
        assert!(!e.is_missing_guest_file());
        let e = ProxmoxError::from_response(
            500,
            "VM 101 qga command 'guest-file-open' failed - failed to open file '/run/cloud-init/result.json' (mode: 'r'): No such file or directory",
            BTreeMap::new(),
        );
        assert!(e.is_missing_guest_file(), "{e:?}");
        assert!(!e.is_agent_unavailable());
        let e = ProxmoxError::from_response(
            500,
            "VM 101 qga command 'guest-file-open' failed - failed to open file '/run/cloud-init/result.json' (mode: 'r'): Permission denied",
            BTreeMap::new(),
        );
        assert!(
            !e.is_missing_guest_file(),
            "a file it may not read is no missing file"
        );
        let e =
            ProxmoxError::from_response(500, "shrinking disks is not supported", BTreeMap::new());
        assert!(matches!(e, ProxmoxError::Api { status: 500, .. }));
    }

    #[test]
    fn a_non_json_body_reaches_the_error_as_a_short_single_line() {
        let page = format!(
            "<html>\r\n<head><title>502 Bad Gateway</title></head>\n\t<body>\u{1b}[31m{}\u{202E}\u{0}</body></html>",
            "x".repeat(600)
        );
        let e = crate::proxmox::error_from_parts(
            reqwest::StatusCode::BAD_GATEWAY,
            None,
            page.as_bytes(),
        );
        assert!(
            matches!(
                e,
                ProxmoxError::Transient {
                    status: Some(502),
                    ..
                }
            ),
            "{e:?}"
        );
        let reason = e.reason().expect("a reason");
        assert!(
            reason.starts_with("<html> <head><title>502 Bad Gateway</title></head> <body>"),
            "{reason}"
        );
        assert!(
            reason.chars().count() <= BODY_EXCERPT_CHARS + 1,
            "{} chars: {reason}",
            reason.chars().count()
        );
        assert!(
            !reason.chars().any(|c| c.is_control() || is_invisible(c)),
            "{reason:?}"
        );
        assert!(e.to_string().len() < 300, "{e}");
        assert_eq!(body_excerpt(500, b" \r\n\t\x00"), None);
        assert_eq!(
            body_excerpt(501, b"Method not implemented\n").as_deref(),
            Some("Method not implemented")
        );
    }

    #[test]
    fn a_404_is_not_found_and_a_429_a_rate_limit() {
        let e = ProxmoxError::from_response(
            404,
            "Configuration file 'nodes/pve1/qemu-server/101.conf' does not exist",
            BTreeMap::new(),
        );
        assert!(e.is_not_found(), "{e:?}");
        let e = crate::proxmox::error_from_parts(
            reqwest::StatusCode::NOT_FOUND,
            None,
            br#"{"data":null,"message":"Configuration file 'nodes/pve1/qemu-server/101.conf' does not exist\n"}"#,
        );
        assert!(e.is_not_found(), "a 404 with PVE's body: {e:?}");
        let e = ProxmoxError::from_response(404, "Not Found", BTreeMap::new());
        assert!(e.is_not_found(), "a proxy's plain 404 too: {e:?}");
        let e = ProxmoxError::from_response(429, "Too Many Requests", BTreeMap::new())
            .with_retry_after(Some(std::time::Duration::from_secs(7)));
        assert_eq!(
            e,
            ProxmoxError::RateLimited {
                reason: "Too Many Requests".into(),
                retry_after: Some(std::time::Duration::from_secs(7)),
            }
        );
        assert!(
            !e.is_retryable(),
            "the caller backs off, the client does not sleep"
        );
    }

    #[test]
    fn classifies_parameter_errors() {
        let mut errors = BTreeMap::new();
        errors.insert("vmid".to_string(), "VM 100 already exists\n".to_string());
        let e = ProxmoxError::from_response(400, "Parameter verification failed.", errors);
        assert!(
            matches!(&e, ProxmoxError::AlreadyExists { reason, .. } if reason == "VM 100 already exists")
        );
        let mut errors = BTreeMap::new();
        errors.insert("upid".to_string(), "no such task".to_string());
        let e = ProxmoxError::from_response(400, "Parameter verification failed.", errors);
        assert!(e.is_not_found());
        let mut errors = BTreeMap::new();
        errors.insert(
            "vmid".to_string(),
            "invalid format - value does not look like a valid VM ID".to_string(),
        );
        let e = ProxmoxError::from_response(400, "Parameter verification failed.", errors);
        let text = e.to_string();
        assert!(text.contains("vmid: invalid format"), "{text}");
        assert!(matches!(e, ProxmoxError::InvalidParameters { .. }));
    }
}
