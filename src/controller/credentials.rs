//! Where a cluster's Proxmox credentials come from, resolved once per reconcile.
//!
//! Precedence is explicit: a ProxmoxCluster's `credentialsRef` always wins for that cluster;
//! without one, the controller's global credentials (flags / `PROXMOX_*` environment) apply;
//! with neither, the cluster reports `CredentialsNotFound`.
//!
//! Unlike the Go provider, TLS is verified by default: a Secret without `insecure` is verified
//! against the system roots, its `root_ca` and/or its pinned `fingerprint`.

use std::collections::BTreeMap;

use k8s_openapi::ByteString;

use crate::proxmox::{ApiToken, ClientConfig, Secret, TlsOptions};

/// Why no usable credentials were found; each maps to a condition reason.
#[derive(Debug, thiserror::Error)]
pub enum CredentialsError {
    /// Neither a `credentialsRef` nor global credentials are configured.
    #[error(
        "no Proxmox credentials: set spec.credentialsRef on the ProxmoxCluster or start capmox with PROXMOX_URL, PROXMOX_TOKEN and PROXMOX_SECRET"
    )]
    NotConfigured,
    /// The referenced Secret does not exist.
    #[error(
        "credentials Secret {namespace}/{name} not found; create it with keys url, token and secret"
    )]
    SecretNotFound {
        /// Secret namespace.
        namespace: String,
        /// Secret name.
        name: String,
    },
    /// The Secret lives in another namespace that has not allowed this cluster's.
    #[error(
        "credentials Secret {namespace}/{name} is in another namespace than the ProxmoxCluster ({cluster_namespace}); move the Secret to {cluster_namespace}, or let that namespace use it with the annotation {annotation}: \"{cluster_namespace}\" on the Secret",
        annotation = crate::api::annotations::ALLOWED_NAMESPACES
    )]
    NamespaceNotAllowed {
        /// Secret namespace.
        namespace: String,
        /// Secret name.
        name: String,
        /// The ProxmoxCluster's namespace.
        cluster_namespace: String,
    },
    /// The Secret lacks a key or has an unusable value.
    #[error("credentials Secret {namespace}/{name}: {problem}")]
    Invalid {
        /// Secret namespace.
        namespace: String,
        /// Secret name.
        name: String,
        /// What is wrong (never the secret value).
        problem: String,
    },
}

impl CredentialsError {
    /// The `ProxmoxAvailable` condition reason for this error.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::NotConfigured | Self::SecretNotFound { .. } => "CredentialsNotFound",
            Self::Invalid { .. } => "CredentialsInvalid",
            Self::NamespaceNotAllowed { .. } => "CredentialsNamespaceNotAllowed",
        }
    }
}

/// Whether a ProxmoxCluster in `cluster_namespace` may use a Secret in `secret_namespace` with
/// these annotations: always within one namespace, across namespaces only when the Secret's
/// owner listed the cluster's namespace (or `*`) in [`crate::api::annotations::ALLOWED_NAMESPACES`].
pub fn namespace_allowed(
    cluster_namespace: &str,
    secret_namespace: &str,
    secret_annotations: Option<&BTreeMap<String, String>>,
) -> bool {
    cluster_namespace == secret_namespace
        || secret_annotations
            .and_then(|a| a.get(crate::api::annotations::ALLOWED_NAMESPACES))
            .is_some_and(|allowed| {
                allowed
                    .split(',')
                    .map(str::trim)
                    .any(|n| n == "*" || n == cluster_namespace)
            })
}

/// The controller-wide credentials from flags or environment.
#[derive(Clone, Debug, Default)]
pub struct GlobalCredentials {
    /// Proxmox URL, e.g. `https://pve1.example:8006`.
    pub url: Option<String>,
    /// API token id, e.g. `capmox@pve!capi`.
    pub token_id: Option<String>,
    /// API token secret (redacted in `Debug`).
    pub secret: Option<Secret>,
    /// TLS trust settings.
    pub tls: TlsOptions,
}

impl GlobalCredentials {
    /// The client configuration, when all of URL, token id and secret are set.
    pub fn client_config(&self) -> Option<Result<ClientConfig, String>> {
        let (Some(url), Some(token_id), Some(secret)) = (&self.url, &self.token_id, &self.secret)
        else {
            return None;
        };
        Some(
            ApiToken::new(token_id.clone(), secret.clone())
                .map(|token| {
                    let mut config = ClientConfig::new(url.clone(), token);
                    config.tls = self.tls.clone();
                    config
                })
                .map_err(|error| error.to_string()),
        )
    }
}

/// Builds a client configuration from a credentials Secret's data
/// (`url`, `token`, `secret`, optional `root_ca`, `fingerprint`, `insecure`).
pub fn from_secret_data(
    namespace: &str,
    name: &str,
    data: &BTreeMap<String, ByteString>,
) -> Result<ClientConfig, CredentialsError> {
    let invalid = |problem: String| CredentialsError::Invalid {
        namespace: namespace.to_owned(),
        name: name.to_owned(),
        problem,
    };
    let text = |key: &str| -> Result<Option<String>, CredentialsError> {
        match data.get(key) {
            None => Ok(None),
            Some(bytes) => String::from_utf8(bytes.0.clone())
                .map(|value| Some(value.trim().to_owned()).filter(|v| !v.is_empty()))
                .map_err(|_| invalid(format!("key {key:?} is not UTF-8 text"))),
        }
    };
    let required = |key: &str| -> Result<String, CredentialsError> {
        text(key)?.ok_or_else(|| invalid(format!("missing key {key:?}")))
    };
    let url = required("url")?;
    if !(url.starts_with("https://") || url.starts_with("http://")) {
        return Err(invalid(format!(
            "key \"url\" must be an http(s) URL, got {url:?}"
        )));
    }
    let token_id = required("token")?;
    let secret = Secret::new(required("secret")?);
    let token = ApiToken::new(token_id, secret)
        .map_err(|error| invalid(format!("key \"token\": {error}")))?;
    let insecure = match text("insecure")?.map(|v| v.to_ascii_lowercase()) {
        None => false,
        Some(v) if ["1", "true", "yes", "y", "on"].contains(&v.as_str()) => true,
        Some(v) if ["0", "false", "no", "n", "off"].contains(&v.as_str()) => false,
        Some(v) => {
            return Err(invalid(format!(
                "key \"insecure\" must be true or false, got {v:?}"
            )));
        }
    };
    let mut config = ClientConfig::new(url, token);
    config.tls = TlsOptions {
        ca_pem: text("root_ca")?,
        fingerprints: text("fingerprint")?.into_iter().collect(),
        insecure,
    };
    Ok(config)
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_secret_serves_its_namespace_and_those_it_lists() {
        let listed = |value: &str| {
            BTreeMap::from([(
                crate::api::annotations::ALLOWED_NAMESPACES.to_owned(),
                value.to_owned(),
            )])
        };
        assert!(namespace_allowed("a", "a", None));
        assert!(!namespace_allowed("a", "b", None));
        assert!(!namespace_allowed("a", "b", Some(&BTreeMap::new())));
        assert!(namespace_allowed("a", "b", Some(&listed("x, a"))));
        assert!(!namespace_allowed("a", "b", Some(&listed("ab,x"))));
        assert!(namespace_allowed("a", "b", Some(&listed("*"))));
    }

    use super::*;

    fn data(pairs: &[(&str, &str)]) -> BTreeMap<String, ByteString> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), ByteString(v.as_bytes().to_vec())))
            .collect()
    }

    const SECRET: &str = "3f2c9c8e-1b2a-4d6e-9f00-0123456789ab";

    #[test]
    fn a_complete_secret_gives_a_verified_client_config() {
        let config = from_secret_data(
            "default",
            "creds",
            &data(&[
                ("url", "https://pve:8006"),
                ("token", "capmox@pve!capi"),
                ("secret", SECRET),
            ]),
        )
        .expect("valid");
        assert_eq!(config.url, "https://pve:8006");
        assert_eq!(config.token.token_id, "capmox@pve!capi");
        assert!(
            !config.tls.insecure,
            "TLS is verified unless the Secret says insecure"
        );
    }

    #[test]
    fn tls_material_and_insecure_are_read() {
        let config = from_secret_data(
            "default",
            "creds",
            &data(&[
                ("url", "https://pve:8006"),
                ("token", "capmox@pve!capi"),
                ("secret", SECRET),
                ("root_ca", "-----BEGIN CERTIFICATE-----"),
                ("fingerprint", "AA:BB"),
                ("insecure", "Yes"),
            ]),
        )
        .expect("valid");
        assert_eq!(
            config.tls.ca_pem.as_deref(),
            Some("-----BEGIN CERTIFICATE-----")
        );
        assert_eq!(config.tls.fingerprints, ["AA:BB"]);
        assert!(config.tls.insecure);
    }

    #[test]
    fn problems_are_named_without_revealing_the_secret() {
        let cases = [
            (
                data(&[("token", "a@pve!capi"), ("secret", SECRET)]),
                "missing key \"url\"",
            ),
            (
                data(&[("url", "https://pve"), ("secret", SECRET)]),
                "missing key \"token\"",
            ),
            (
                data(&[("url", "https://pve"), ("token", "a@pve!capi")]),
                "missing key \"secret\"",
            ),
            (
                data(&[
                    ("url", "pve:8006"),
                    ("token", "a@pve!capi"),
                    ("secret", SECRET),
                ]),
                "must be an http(s) URL",
            ),
            (
                data(&[
                    ("url", "https://pve"),
                    ("token", "a@pve!capi"),
                    ("secret", SECRET),
                    ("insecure", "maybe"),
                ]),
                "must be true or false",
            ),
        ];
        for (secret_data, expected) in cases {
            let error = from_secret_data("ns", "creds", &secret_data)
                .expect_err(expected)
                .to_string();
            assert!(error.contains(expected), "{error}");
            assert!(error.starts_with("credentials Secret ns/creds"), "{error}");
            assert!(!error.contains(SECRET), "the secret leaked into {error}");
        }
    }
}
