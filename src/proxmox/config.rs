//! Client configuration: endpoint, API token (with a redacting secret type) and TLS trust.

use std::fmt;
use std::time::Duration;

use super::error::{ProxmoxError, Result};

/// The API token secret. `Debug` and `Display` never show it, so it cannot leak
/// through logs, events or error messages.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Secret(String);

impl Secret {
    /// Wraps a secret value.
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The secret itself, for building the `Authorization` header only.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

/// A Proxmox VE API token: id `user@realm!tokenname` plus its secret.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ApiToken {
    /// Token id, `user@realm!tokenname`.
    pub token_id: String,
    /// Token secret (a UUID on real servers).
    pub secret: Secret,
}

impl ApiToken {
    /// Builds a token after checking the id has the `user@realm!name` shape. Errors never quote
    /// the id itself (a pasted `id=secret` or a secret in the id field would leak into
    /// conditions and logs); at most the user of a well-formed `user@realm!` part is named.
    pub fn new(token_id: impl Into<String>, secret: Secret) -> Result<Self> {
        let token_id = token_id.into();
        if token_id.contains('=') {
            return Err(ProxmoxError::Config(
                "the token id contains '=': it looks like 'user@realm!tokenname=secret' was given \
                 as the id; put only 'user@realm!tokenname' in the token and the secret apart"
                    .to_string(),
            ));
        }
        let (user, name) = token_id.split_once('!').ok_or_else(|| {
            ProxmoxError::Config(format!(
                "the token id ({} characters, not shown) must look like 'user@realm!tokenname'",
                token_id.chars().count()
            ))
        })?;
        if !user.contains('@') || user.starts_with('@') || user.ends_with('@') {
            return Err(ProxmoxError::Config(
                "the token id must name a user with its realm before '!', e.g. 'capmox@pve!capi'"
                    .to_string(),
            ));
        }
        let valid_name = name.len() >= 2
            && name.chars().next().is_some_and(|c| c.is_ascii_alphabetic())
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_'));
        if !valid_name {
            return Err(ProxmoxError::Config(format!(
                "the token name after '{user}!' must start with a letter and use letters, digits, '.', '-', '_' (at least 2 characters)"
            )));
        }
        if secret.expose().is_empty() {
            return Err(ProxmoxError::Config(format!(
                "the secret of token '{token_id}' is empty"
            )));
        }
        Ok(Self { token_id, secret })
    }

    /// Parses `user@realm!tokenname=secret` (the form Proxmox shows), splitting at the last `=`.
    pub fn parse(full: &str) -> Result<Self> {
        let (id, secret) = full.rsplit_once('=').ok_or_else(|| {
            ProxmoxError::Config(
                "API token must be given as 'user@realm!tokenname=secret'".to_string(),
            )
        })?;
        Self::new(id, Secret::new(secret))
    }

    /// The `Authorization` header value; callers must mark it sensitive.
    pub(crate) fn header_value(&self) -> String {
        format!("PVEAPIToken={}={}", self.token_id, self.secret.expose())
    }
}

/// How the client decides to trust the server's TLS certificate.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct TlsOptions {
    /// Extra CA certificates (PEM), e.g. the cluster's `pve-root-ca.pem`, trusted in addition to system roots.
    pub ca_pem: Option<String>,
    /// Accepted SHA-256 fingerprints of the server's end-entity certificate
    /// (`AA:BB:...`, colons optional), as `pvenode cert info` prints them.
    pub fingerprints: Vec<String>,
    /// Skip verification entirely. Only for tests and labs; logged as a warning.
    pub insecure: bool,
}

/// Retry policy for idempotent requests that fail transiently.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RetryPolicy {
    /// Total attempts including the first (1 disables retries).
    pub max_attempts: u32,
    /// Delay before the first retry; doubled each time, with ±50 % jitter.
    pub base_delay: Duration,
    /// Upper bound for a single delay.
    pub max_delay: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: 3,
            base_delay: Duration::from_millis(200),
            max_delay: Duration::from_secs(5),
        }
    }
}

/// Everything needed to build a client; equal configs share one client (see `ClientRegistry`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ClientConfig {
    /// Server URL, e.g. `https://pve1.example.com:8006` (`/api2/json` is appended).
    pub url: String,
    /// API token.
    pub token: ApiToken,
    /// TLS trust settings.
    pub tls: TlsOptions,
    /// Timeout of one HTTP request (uploads use `upload_timeout`).
    pub request_timeout: Duration,
    /// Timeout for establishing a connection.
    pub connect_timeout: Duration,
    /// Timeout for ISO uploads.
    pub upload_timeout: Duration,
    /// Retry policy for idempotent requests.
    pub retry: RetryPolicy,
    /// Requests in flight at once when the client is built alone (a registry's clients share
    /// its limit per Proxmox API instead).
    pub max_in_flight: usize,
}

impl ClientConfig {
    /// A config with default timeouts, retries and concurrency.
    pub fn new(url: impl Into<String>, token: ApiToken) -> Self {
        Self {
            url: url.into(),
            token,
            tls: TlsOptions::default(),
            request_timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(10),
            upload_timeout: Duration::from_secs(300),
            retry: RetryPolicy::default(),
            max_in_flight: super::gate::DEFAULT_REQUESTS_IN_FLIGHT,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secret_is_redacted_everywhere() {
        let token = ApiToken::parse("capi@pve!capmox=3f2c9c8e-1b2a-4d6e-9f00-0123456789ab")
            .expect("valid token");
        assert_eq!(token.token_id, "capi@pve!capmox");
        let cfg = ClientConfig::new("https://pve:8006", token.clone());
        for text in [
            format!("{token:?}"),
            format!("{cfg:?}"),
            format!("{}", token.secret),
            format!("{:?}", token.secret),
        ] {
            assert!(!text.contains("3f2c9c8e"), "secret leaked: {text}");
        }
        assert!(
            token
                .header_value()
                .ends_with("=3f2c9c8e-1b2a-4d6e-9f00-0123456789ab")
        );
    }

    #[test]
    fn token_validation() {
        assert!(ApiToken::parse("root@pam!ab=x").is_ok());
        assert!(ApiToken::parse("root@pam=x").is_err());
        assert!(ApiToken::parse("root!ab=x").is_err());
        assert!(ApiToken::parse("root@pam!a=x").is_err());
        assert!(ApiToken::parse("root@pam!1a=x").is_err());
        assert!(ApiToken::parse("root@pam!ab=").is_err());
        let err = ApiToken::parse("nonsense").expect_err("no =");
        assert!(err.to_string().contains("user@realm!tokenname=secret"));
        let t = ApiToken::parse("root@pam!ab=s").expect("valid");
        assert_eq!(t.secret.expose(), "s");
    }

    /// A secret pasted into the token id (alone, or as `id=secret`) never shows in the error,
    /// which becomes a condition message and a log line.
    #[test]
    fn token_errors_never_quote_what_may_be_a_secret() {
        const SECRET: &str = "3f2c9c8e-1b2a-4d6e-9f00-0123456789ab";
        let pasted_whole = format!("capmox@pve!capi={SECRET}");
        let cases = [
            pasted_whole.as_str(),
            SECRET,
            "capmox!3f2c9c8e-1b2a-4d6e-9f00-0123456789ab",
            "capmox@pve!3f2c9c8e-1b2a-4d6e-9f00-0123456789ab!",
        ];
        for id in cases {
            let error = ApiToken::new(id, Secret::new("other")).expect_err(id);
            assert!(
                !error.to_string().contains("3f2c9c8e"),
                "{id:?} leaks into {error}"
            );
        }
        let error = ApiToken::new(pasted_whole, Secret::new("other")).expect_err("has =");
        assert!(error.to_string().contains("secret apart"), "{error}");
    }
}

/// The Proxmox API a URL reaches, as `scheme://host:port` (the port spelled out, any path or
/// trailing slash dropped): two URLs of one endpoint compare equal, and it is what a machine
/// records as the endpoint its VM lives on. `None` for a URL that does not parse.
pub fn endpoint_of(url: &str) -> Option<String> {
    let parsed = reqwest::Url::parse(url.trim()).ok()?;
    let host = parsed.host_str()?;
    let port = parsed.port_or_known_default()?;
    let host = if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]")
    } else {
        host.to_ascii_lowercase()
    };
    Some(format!("{}://{host}:{port}", parsed.scheme()))
}

#[cfg(test)]
mod endpoint_tests {
    use super::endpoint_of;

    #[test]
    fn urls_of_one_endpoint_compare_equal() {
        let expected = Some("https://pve1.example:8006".to_owned());
        assert_eq!(endpoint_of("https://pve1.example:8006"), expected);
        assert_eq!(endpoint_of("https://PVE1.example:8006/"), expected);
        assert_eq!(endpoint_of("https://pve1.example:8006/api2/json"), expected);
        assert_eq!(
            endpoint_of("https://pve1.example").as_deref(),
            Some("https://pve1.example:443")
        );
        assert_eq!(
            endpoint_of("http://127.0.0.1:41234").as_deref(),
            Some("http://127.0.0.1:41234")
        );
        assert_eq!(
            endpoint_of("https://[fd00::1]:8006").as_deref(),
            Some("https://[fd00::1]:8006")
        );
        assert_ne!(
            endpoint_of("https://pve2.example:8006"),
            expected,
            "another node's URL is another endpoint"
        );
        assert_eq!(endpoint_of("not a url"), None);
    }
}
