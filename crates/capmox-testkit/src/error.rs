//! Errors of the fake API server, rendered as Kubernetes `Status` bodies so kube-rs maps them
//! to `kube::Error::Api` exactly as it would for a real server.

use serde_json::{Value, json};

/// An API error with the HTTP code and `reason` a real kube-apiserver would return.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ApiError {
    /// 404: the object or the resource type does not exist.
    #[error("{qualified} \"{name}\" not found")]
    NotFound {
        /// `plural.group` (or plural for the core group).
        qualified: String,
        /// Object name.
        name: String,
    },
    /// 404 for an unknown path or resource type.
    #[error("the server could not find the requested resource")]
    NoRoute,
    /// 409 on create of an existing name.
    #[error("{qualified} \"{name}\" already exists")]
    AlreadyExists {
        /// `plural.group`.
        qualified: String,
        /// Object name.
        name: String,
    },
    /// 409 optimistic-concurrency or server-side-apply conflict.
    #[error("{message}")]
    Conflict {
        /// Full message.
        message: String,
    },
    /// 409 from server-side apply: fields owned by other managers.
    #[error("{message}")]
    ApplyConflict {
        /// Full message.
        message: String,
        /// `(message, field)` per conflicting field, rendered as `details.causes`.
        causes: Vec<(String, String)>,
    },
    /// 422: the object is invalid (validation, forbidden finalizer, missing fields).
    #[error("{message}")]
    Invalid {
        /// Full message.
        message: String,
    },
    /// 400: malformed request (bad JSON, bad selector, mismatching namespace).
    #[error("{0}")]
    BadRequest(String),
    /// 403: forbidden (e.g. creating in a terminating namespace).
    #[error("{0}")]
    Forbidden(String),
    /// 405: verb not supported on this path.
    #[error("the server does not allow this method on the requested resource")]
    MethodNotAllowed,
    /// 415: patch type not supported for this kind.
    #[error("the body of the request was in an unknown format - accepted media types include: {0}")]
    UnsupportedMediaType(String),
    /// 410: the requested resourceVersion is older than the kept history.
    #[error("too old resource version: {requested} ({oldest})")]
    Gone {
        /// Requested resourceVersion.
        requested: u64,
        /// Oldest resourceVersion still served.
        oldest: u64,
    },
    /// 500: injected or internal failure.
    #[error("{0}")]
    Internal(String),
    /// 504: injected timeout.
    #[error("{0}")]
    Timeout(String),
    /// 429: injected throttling.
    #[error("{0}")]
    TooManyRequests(String),
}

impl ApiError {
    /// HTTP status code of this error.
    pub fn code(&self) -> u16 {
        match self {
            ApiError::NotFound { .. } | ApiError::NoRoute => 404,
            ApiError::AlreadyExists { .. }
            | ApiError::Conflict { .. }
            | ApiError::ApplyConflict { .. } => 409,
            ApiError::Invalid { .. } => 422,
            ApiError::BadRequest(_) => 400,
            ApiError::Forbidden(_) => 403,
            ApiError::MethodNotAllowed => 405,
            ApiError::UnsupportedMediaType(_) => 415,
            ApiError::Gone { .. } => 410,
            ApiError::Internal(_) => 500,
            ApiError::Timeout(_) => 504,
            ApiError::TooManyRequests(_) => 429,
        }
    }

    /// `Status.reason` as defined by `metav1.StatusReason`.
    pub fn reason(&self) -> &'static str {
        match self {
            ApiError::NotFound { .. } | ApiError::NoRoute => "NotFound",
            ApiError::AlreadyExists { .. } => "AlreadyExists",
            ApiError::Conflict { .. } | ApiError::ApplyConflict { .. } => "Conflict",
            ApiError::Invalid { .. } => "Invalid",
            ApiError::BadRequest(_) => "BadRequest",
            ApiError::Forbidden(_) => "Forbidden",
            ApiError::MethodNotAllowed => "MethodNotAllowed",
            ApiError::UnsupportedMediaType(_) => "UnsupportedMediaType",
            ApiError::Gone { .. } => "Expired",
            ApiError::Internal(_) => "InternalError",
            ApiError::Timeout(_) => "Timeout",
            ApiError::TooManyRequests(_) => "TooManyRequests",
        }
    }

    /// The `meta.k8s.io/v1 Status` body for this error.
    pub fn to_status(&self) -> Value {
        let mut status = json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.to_string(),
            "reason": self.reason(),
            "code": self.code(),
        });
        if let ApiError::NotFound { qualified, name }
        | ApiError::AlreadyExists { qualified, name } = self
        {
            let (kind, group) = qualified
                .split_once('.')
                .unwrap_or((qualified.as_str(), ""));
            status["details"] = json!({"name": name, "group": group, "kind": kind});
        }
        if let ApiError::ApplyConflict { causes, .. } = self {
            let causes: Vec<Value> = causes
                .iter()
                .map(|(message, field)| json!({"reason": "FieldManagerConflict", "message": message, "field": field}))
                .collect();
            status["details"] = json!({"causes": causes});
        }
        status
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn not_found_status_has_reason_code_and_details() {
        let e = ApiError::NotFound {
            qualified: "proxmoxmachines.infrastructure.cluster.x-k8s.io".into(),
            name: "m1".into(),
        };
        let s = e.to_status();
        assert_eq!(s["code"], 404);
        assert_eq!(s["reason"], "NotFound");
        assert_eq!(s["details"]["group"], "infrastructure.cluster.x-k8s.io");
        assert_eq!(s["details"]["kind"], "proxmoxmachines");
        assert_eq!(
            s["message"],
            "proxmoxmachines.infrastructure.cluster.x-k8s.io \"m1\" not found"
        );
    }

    #[test]
    fn gone_maps_to_expired_410() {
        let e = ApiError::Gone {
            requested: 1,
            oldest: 5,
        };
        assert_eq!((e.code(), e.reason()), (410, "Expired"));
    }
}
