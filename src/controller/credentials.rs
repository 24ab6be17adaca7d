//! Where a cluster's Proxmox credentials come from, resolved once per reconcile.
//!
//! Precedence is explicit: a ProxmoxCluster's `credentialsRef` always wins for that cluster;
//! without one, the controller's global credentials (flags / `PROXMOX_*` environment) apply;
//! with neither, the cluster reports `CredentialsNotFound`.
//!
//! Unlike the Go provider, TLS is verified by default: a Secret without `insecure` is verified
//! against the system roots, its `root_ca` and/or its pinned `fingerprint`.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::ByteString;

use k8s_openapi::api::core::v1::Secret as SecretObject;
use kube::api::{ListParams, Patch, PatchParams};
use kube::{Api, ResourceExt};
use serde_json::{Value, json};

use super::Context;
use super::guarded::{WriteError, cluster_owner_reference, guarded_write_error, release};
use crate::api::{ProxmoxCluster, SecretReference, finalizers};
use crate::proxmox::{ApiToken, ClientConfig, Secret, TlsOptions};

/// How long a machine reconcile reuses credentials it resolved from a cluster's Secret: a
/// rotated token reaches machines within this time (at once when Proxmox refuses the old one),
/// and a fleet reads the Secret this often per cluster, not on every pass.
pub const CREDENTIALS_REUSE: Duration = Duration::from_secs(30);

/// Credentials resolved from Secrets, by (cluster namespace, Secret namespace, Secret name),
/// reused for [`CREDENTIALS_REUSE`]. Only usable credentials are kept, in memory only.
#[derive(Clone, Default)]
pub struct CredentialsMemo {
    resolved: Arc<Mutex<HashMap<MemoKey, (Instant, ClientConfig)>>>,
}

/// (cluster namespace, Secret namespace, Secret name).
type MemoKey = (String, String, String);

/// Where a credentials Secret referenced from a ProxmoxCluster in `namespace` is kept.
fn memo_key(namespace: &str, reference: &SecretReference) -> MemoKey {
    (
        namespace.to_owned(),
        reference
            .namespace
            .clone()
            .unwrap_or_else(|| namespace.to_owned()),
        reference.name.clone().unwrap_or_default(),
    )
}

impl CredentialsMemo {
    /// The credentials resolved for `key` less than [`CREDENTIALS_REUSE`] ago.
    pub fn recent(&self, key: &MemoKey) -> Option<ClientConfig> {
        let resolved = self.lock();
        let (at, config) = resolved.get(key)?;
        (at.elapsed() < CREDENTIALS_REUSE).then(|| config.clone())
    }

    /// Keeps what was just read from the Secret, or forgets it when it was not usable.
    pub fn remember(&self, key: MemoKey, config: Option<&ClientConfig>) {
        let mut resolved = self.lock();
        match config {
            Some(config) => {
                resolved.insert(key, (Instant::now(), config.clone()));
            }
            None => {
                resolved.remove(&key);
            }
        }
    }

    /// Forgets what `cluster` (in `namespace`) resolved, its zones' credentials included, so
    /// its next pass reads the Secrets again (Proxmox refused the credentials: they may have
    /// been rotated).
    pub fn forget(&self, cluster: &crate::api::ProxmoxCluster, namespace: &str) {
        let mut resolved = self.lock();
        for reference in crate::placement::credentials_secrets(cluster) {
            resolved.remove(&memo_key(namespace, reference));
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<MemoKey, (Instant, ClientConfig)>> {
        // A panic while holding the lock leaves a map that is still consistent.
        self.resolved
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Why no usable credentials were found; each maps to a condition reason.
#[derive(Debug, thiserror::Error)]
pub enum CredentialsError {
    /// Neither a `credentialsRef` nor global credentials are configured.
    #[error(
        "no Proxmox credentials: set spec.credentialsRef on the ProxmoxCluster or start capmox with PROXMOX_URL, PROXMOX_TOKEN and PROXMOX_SECRET"
    )]
    NotConfigured,
    /// The cluster has no `credentialsRef` and its namespace may not use the global credentials.
    #[error(
        "no credentials for namespace {cluster_namespace}: set spec.credentialsRef on the ProxmoxCluster, or have capmox's installer list {cluster_namespace} in --global-credentials-namespaces (CAPMOX_GLOBAL_CREDENTIALS_NAMESPACES) to let it use the global credentials"
    )]
    GlobalNotAllowed {
        /// The ProxmoxCluster's namespace.
        cluster_namespace: String,
    },
    /// The referenced Secret does not exist, may not be read by capmox, or does not allow the
    /// cluster's namespace: one outcome, so a tenant never learns whether a Secret exists in a
    /// namespace it cannot read.
    #[error(
        "credentials Secret {namespace}/{name} does not exist or does not allow namespace {cluster_namespace}: create it in {cluster_namespace} with keys url, token and secret, or annotate it with {annotation}: \"{cluster_namespace}\"{secret_namespaces}",
        annotation = crate::api::annotations::ALLOWED_NAMESPACES,
        secret_namespaces = restricted_note(*.restricted)
    )]
    NotFoundOrNotAllowed {
        /// Secret namespace.
        namespace: String,
        /// Secret name.
        name: String,
        /// The ProxmoxCluster's namespace.
        cluster_namespace: String,
        /// capmox reads Secrets only in the namespaces it was installed for.
        restricted: bool,
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
            Self::NotConfigured
            | Self::GlobalNotAllowed { .. }
            | Self::NotFoundOrNotAllowed { .. } => "CredentialsNotFound",
            Self::Invalid { .. } => "CredentialsInvalid",
        }
    }
}

/// What a namespaced install adds to [`CredentialsError::NotFoundOrNotAllowed`].
fn restricted_note(restricted: bool) -> &'static str {
    if restricted {
        "; capmox reads Secrets only in the namespaces its installer listed in --secret-namespaces (CAPMOX_SECRET_NAMESPACES)"
    } else {
        ""
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

/// The controller-wide credentials from flags or environment, and who may use which
/// credentials (the installer's tenancy settings).
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
    /// The namespaces whose clusters may use these credentials (`*`: all); none when empty.
    pub namespaces: Vec<String>,
    /// The only namespaces capmox reads credentials Secrets in; any namespace when `None`.
    pub secret_namespaces: Option<Vec<String>>,
    /// The only Proxmox origins (`scheme://host[:port]`) a Secret may name; any when `None`.
    pub allowed_urls: Option<Vec<String>>,
}

impl GlobalCredentials {
    /// The client configuration, when all of URL, token id and secret are set.
    pub fn client_config(&self) -> Option<Result<ClientConfig, String>> {
        let (Some(url), Some(token_id), Some(secret)) = (&self.url, &self.token_id, &self.secret)
        else {
            return None;
        };
        Some(
            check_url(url)
                .and_then(|()| {
                    ApiToken::new(token_id.clone(), secret.clone())
                        .map_err(|error| error.to_string())
                })
                .map(|token| {
                    let mut config = ClientConfig::new(url.clone(), token);
                    config.tls = self.tls.clone();
                    config
                }),
        )
    }

    /// The global credentials for a cluster in `namespace`, or why it gets none.
    pub fn for_namespace(&self, namespace: &str) -> Result<ClientConfig, CredentialsError> {
        let Some(config) = self.client_config() else {
            return Err(CredentialsError::NotConfigured);
        };
        if !listed(&self.namespaces, namespace) {
            return Err(CredentialsError::GlobalNotAllowed {
                cluster_namespace: namespace.to_owned(),
            });
        }
        config.map_err(|problem| CredentialsError::Invalid {
            namespace: "controller".into(),
            name: "PROXMOX_* settings".into(),
            problem,
        })
    }

    /// Whether capmox may read Secrets in `namespace`.
    pub fn reads_secrets_in(&self, namespace: &str) -> bool {
        self.secret_namespaces
            .as_ref()
            .is_none_or(|namespaces| listed(namespaces, namespace))
    }

    /// Why a Secret's `url` is refused by `--allowed-proxmox-urls`, if it is.
    fn refused_origin(&self, url: &str) -> Option<String> {
        let allowed = self.allowed_urls.as_ref()?;
        let origin = origin(url)?;
        (!allowed.iter().any(|a| origin_matches(a, &origin))).then(|| {
            format!(
                "key \"url\" names {origin}, which is not among the Proxmox origins capmox's installer allowed (--allowed-proxmox-urls, CAPMOX_ALLOWED_PROXMOX_URLS)"
            )
        })
    }
}

/// Whether `namespace` is in `namespaces` (or they hold `*`).
fn listed(namespaces: &[String], namespace: &str) -> bool {
    namespaces.iter().any(|n| n == "*" || n == namespace)
}

/// A comma-separated list as the flags take it, without blanks; empty for an empty text.
pub fn comma_list(text: &str) -> Vec<String> {
    text.split(',')
        .map(str::trim)
        .filter(|n| !n.is_empty())
        .map(str::to_owned)
        .collect()
}

/// `scheme://host[:port]` of a URL that [`check_url`] accepts, the port only when not the default.
fn origin(url: &str) -> Option<String> {
    let parsed = reqwest::Url::parse(url).ok()?;
    Some(parsed.origin().ascii_serialization())
}

/// Whether an allowlist entry names `origin` (entries are compared as parsed origins, so
/// `https://PVE:443` and `https://pve` are one).
fn origin_matches(entry: &str, origin: &str) -> bool {
    self::origin(entry.trim()).is_some_and(|entry| entry == origin)
}

/// A Proxmox URL capmox can join its API paths to: http(s), a host, no user info, query or
/// fragment, and no path but `/api2/json` (which capmox appends itself otherwise).
pub fn check_url(url: &str) -> Result<(), String> {
    let parsed = reqwest::Url::parse(url).map_err(|error| {
        format!("{url:?} is not a URL ({error}); use e.g. https://pve.example.com:8006")
    })?;
    let problem = if !matches!(parsed.scheme(), "https" | "http") {
        Some("must be an http(s) URL")
    } else if parsed.host_str().is_none_or(str::is_empty) {
        Some("has no host")
    } else if !parsed.username().is_empty() || parsed.password().is_some() {
        Some("must not hold a user name or password (the token goes in keys token and secret)")
    } else if parsed.query().is_some() {
        Some("must not have a query (?...)")
    } else if parsed.fragment().is_some() || url.contains('#') {
        Some("must not have a fragment (#...)")
    } else if !matches!(parsed.path().trim_end_matches('/'), "" | "/api2/json") {
        Some("must have no path but /api2/json")
    } else {
        None
    };
    match problem {
        // The URL is not secret, but a user name and password in it would be.
        Some(problem) if !parsed.username().is_empty() || parsed.password().is_some() => {
            Err(problem.to_owned())
        }
        Some(problem) => Err(format!(
            "{problem}, got {url:?}; use e.g. https://pve.example.com:8006"
        )),
        None => Ok(()),
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
    check_url(&url).map_err(|problem| invalid(format!("key \"url\" {problem}")))?;
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

// Resolving a cluster's credentials, for both controllers.

/// The client configuration `reference` names for `cluster` (adopting the Secret with an owner
/// reference and finalizer when `adopt`); without a reference, the controller's global
/// credentials.
async fn credentials(
    context: &Context,
    cluster: &ProxmoxCluster,
    namespace: &str,
    reference: Option<&SecretReference>,
    adopt: bool,
) -> Result<Result<ClientConfig, CredentialsError>, WriteError> {
    let Some(reference) = reference else {
        return Ok(context.global_credentials.for_namespace(namespace));
    };
    let secret_namespace = reference
        .namespace
        .clone()
        .unwrap_or_else(|| namespace.to_owned());
    let secret_name = reference.name.clone().unwrap_or_default();
    let policy = &context.global_credentials;
    let not_found_or_not_allowed = || CredentialsError::NotFoundOrNotAllowed {
        namespace: secret_namespace.clone(),
        name: secret_name.clone(),
        cluster_namespace: namespace.to_owned(),
        restricted: policy.secret_namespaces.is_some(),
    };
    // Outside the namespaces the installer let capmox read, nothing is asked of the API server.
    if !policy.reads_secrets_in(&secret_namespace) {
        return Ok(Err(not_found_or_not_allowed()));
    }
    let memo_key = memo_key(namespace, reference);
    if !adopt && let Some(config) = context.credentials.recent(&memo_key) {
        return Ok(Ok(config));
    }
    let secrets: Api<SecretObject> = Api::namespaced(context.client.clone(), &secret_namespace);
    let Some(secret) = secrets.get_opt(&secret_name).await?.filter(|secret| {
        namespace_allowed(
            namespace,
            &secret_namespace,
            secret.metadata.annotations.as_ref(),
        )
    }) else {
        context.credentials.remember(memo_key, None);
        return Ok(Err(not_found_or_not_allowed()));
    };
    // Validated before it is adopted: a Secret that is not usable credentials is never locked.
    let config = from_secret_data(
        &secret_namespace,
        &secret_name,
        &secret.data.clone().unwrap_or_default(),
    )
    .and_then(|config| match policy.refused_origin(&config.url) {
        Some(problem) => Err(CredentialsError::Invalid {
            namespace: secret_namespace.clone(),
            name: secret_name.clone(),
            problem,
        }),
        None => Ok(config),
    });
    context.credentials.remember(memo_key, config.as_ref().ok());
    if adopt && config.is_ok() {
        adopt_secret(&secrets, &secret, cluster, secret_namespace == namespace).await?;
    }
    Ok(config)
}

/// The client configuration of the credentials `reference` names for `cluster` (`None`: the
/// cluster's own credentials: its `credentialsRef`, else the global ones), adopting a Secret it reads when
/// `adopt` (the cluster controller does; machines and templates only read).
pub(crate) async fn client_config(
    context: &Context,
    cluster: &ProxmoxCluster,
    namespace: &str,
    reference: Option<&SecretReference>,
    adopt: bool,
) -> Result<Result<ClientConfig, CredentialsError>, WriteError> {
    let reference = reference.or(cluster.spec.credentials_ref.as_ref());
    credentials(context, cluster, namespace, reference, adopt).await
}

/// Lets go of the Secret `reference` names for the deleted `cluster` (in `namespace`): drops
/// the cluster's owner reference, and the finalizer too unless another ProxmoxCluster that is
/// not being deleted still uses the Secret (as its own or a zone's credentials).
pub(crate) async fn release_secret(
    context: &Context,
    cluster: &ProxmoxCluster,
    namespace: &str,
    reference: &SecretReference,
) -> Result<(), WriteError> {
    let Some(secret_name) = &reference.name else {
        return Ok(());
    };
    let secret_namespace = reference.namespace.as_deref().unwrap_or(namespace);
    if !context
        .global_credentials
        .reads_secrets_in(secret_namespace)
    {
        return Ok(());
    }
    let secrets: Api<SecretObject> = Api::namespaced(context.client.clone(), secret_namespace);
    let Some(secret) = secrets.get_opt(secret_name).await? else {
        return Ok(());
    };
    let clusters: Api<ProxmoxCluster> = match &context.config.watch_namespace {
        Some(watched) => Api::namespaced(context.client.clone(), watched),
        None => Api::all(context.client.clone()),
    };
    let others = clusters.list(&ListParams::default()).await?;
    let still_used = others
        .items
        .iter()
        .any(|other| uses_secret(other, cluster, &secret, secret_namespace));
    let finalizer = (!still_used).then_some(finalizers::CLUSTER_SECRET);
    release(
        &secrets,
        &secret,
        finalizer,
        cluster.metadata.uid.as_deref(),
    )
    .await
}

/// Whether `other`, a ProxmoxCluster other than `deleted` that is not being deleted, uses
/// `secret` (in `secret_namespace`) and may.
fn uses_secret(
    other: &ProxmoxCluster,
    deleted: &ProxmoxCluster,
    secret: &SecretObject,
    secret_namespace: &str,
) -> bool {
    let other_namespace = other.metadata.namespace.as_deref().unwrap_or_default();
    other.metadata.uid != deleted.metadata.uid
        && other.metadata.deletion_timestamp.is_none()
        && namespace_allowed(
            other_namespace,
            secret_namespace,
            secret.metadata.annotations.as_ref(),
        )
        && crate::placement::credentials_secrets(other)
            .iter()
            .any(|reference| {
                reference.name == secret.metadata.name
                    && reference.namespace.as_deref().unwrap_or(other_namespace) == secret_namespace
            })
}

/// Finalizer on the credentials Secret, so it outlives the cluster's machines, and, when the
/// Secret is in the cluster's namespace, an owner reference (garbage collection treats an owner
/// in another namespace as absent and would delete the Secret).
async fn adopt_secret(
    secrets: &Api<SecretObject>,
    secret: &SecretObject,
    cluster: &ProxmoxCluster,
    same_namespace: bool,
) -> Result<(), WriteError> {
    let uid = cluster.metadata.uid.clone().unwrap_or_default();
    let has_owner = !same_namespace || secret.owner_references().iter().any(|o| o.uid == uid);
    let has_finalizer = secret
        .finalizers()
        .iter()
        .any(|f| f == finalizers::CLUSTER_SECRET);
    if has_owner && has_finalizer {
        return Ok(());
    }
    let name = secret.metadata.name.clone().unwrap_or_default();
    let mut ops = vec![
        json!({"op": "test", "path": "/metadata/resourceVersion", "value": secret.metadata.resource_version}),
    ];
    if !has_owner {
        let owner = cluster_owner_reference(cluster, false);
        if secret.metadata.owner_references.is_none() {
            ops.push(json!({"op": "add", "path": "/metadata/ownerReferences", "value": [owner]}));
        } else {
            ops.push(json!({"op": "add", "path": "/metadata/ownerReferences/-", "value": owner}));
        }
    }
    if !has_finalizer {
        if secret.metadata.finalizers.is_none() {
            ops.push(json!({"op": "add", "path": "/metadata/finalizers", "value": [finalizers::CLUSTER_SECRET]}));
        } else {
            ops.push(json!({"op": "add", "path": "/metadata/finalizers/-", "value": finalizers::CLUSTER_SECRET}));
        }
    }
    secrets
        .patch(
            &name,
            &PatchParams::default(),
            &Patch::Json::<()>(serde_json::from_value(Value::Array(ops))?),
        )
        .await
        .map_err(|error| guarded_write_error(secret, error))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn resolved_credentials_are_reused_until_forgotten_or_unusable() {
        let data = BTreeMap::from([
            (
                "url".to_owned(),
                ByteString(b"https://pve.example:8006".to_vec()),
            ),
            ("token".to_owned(), ByteString(b"capmox@pve!capi".to_vec())),
            ("secret".to_owned(), ByteString(b"s3cret".to_vec())),
        ]);
        let config = from_secret_data("tenant", "creds", &data).expect("usable credentials");
        let memo = CredentialsMemo::default();
        let key = ("tenant".to_owned(), "tenant".to_owned(), "creds".to_owned());
        assert!(memo.recent(&key).is_none());
        memo.remember(key.clone(), Some(&config));
        assert_eq!(memo.recent(&key), Some(config.clone()));
        // Another namespace using the same Secret resolves it on its own.
        let other = ("other".to_owned(), "tenant".to_owned(), "creds".to_owned());
        assert!(memo.recent(&other).is_none());

        let mut cluster = crate::api::ProxmoxCluster::new("demo", Default::default());
        cluster.spec.credentials_ref = Some(crate::api::SecretReference {
            name: Some("creds".into()),
            namespace: None,
        });
        memo.forget(&cluster, "tenant");
        assert!(
            memo.recent(&key).is_none(),
            "forgotten after Proxmox refused it"
        );

        memo.remember(key.clone(), Some(&config));
        memo.remember(key.clone(), None);
        assert!(
            memo.recent(&key).is_none(),
            "an unusable Secret is not reused"
        );
    }

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

    #[test]
    fn a_proxmox_url_is_an_origin_capmox_can_join_its_api_paths_to() {
        for good in [
            "https://pve.example:8006",
            "https://pve.example:8006/",
            "https://pve.example:8006/api2/json",
            "http://127.0.0.1:41234",
            "https://[fd00::1]:8006",
        ] {
            assert_eq!(check_url(good), Ok(()), "{good}");
        }
        for (bad, problem) in [
            ("ftp://pve.example", "must be an http(s) URL"),
            ("pve.example:8006", "must be an http(s) URL"),
            ("https://pve.example:8006/#", "fragment"),
            ("https://pve.example:8006#/api2/json", "fragment"),
            ("https://pve.example:8006/?x=1", "query"),
            (
                "https://pve.example:8006/other/api2/json",
                "no path but /api2/json",
            ),
            ("https://evil.example/steal?", "query"),
            ("https://:8006", "not a URL"),
        ] {
            let error = check_url(bad).expect_err(bad);
            assert!(error.contains(problem), "{bad}: {error}");
        }
        let error = check_url("https://root:hunter2@pve.example").expect_err("user info");
        assert!(error.contains("user name or password"), "{error}");
        assert!(!error.contains("hunter2"), "the password leaked: {error}");
    }

    #[test]
    fn an_allowlist_of_origins_refuses_every_other_proxmox() {
        let mut global = GlobalCredentials::default();
        assert_eq!(global.refused_origin("https://anywhere.example:8006"), None);
        global.allowed_urls = Some(comma_list(
            "https://pve1.example:8006, https://PVE2.example",
        ));
        assert_eq!(
            global.refused_origin("https://pve1.example:8006/api2/json"),
            None
        );
        assert_eq!(global.refused_origin("https://pve2.example:443"), None);
        for refused in [
            "http://pve1.example:8006",
            "https://pve1.example:8007",
            "https://pve3.example:8006",
        ] {
            let problem = global.refused_origin(refused).expect(refused);
            assert!(problem.contains("--allowed-proxmox-urls"), "{problem}");
        }
    }

    #[test]
    fn global_credentials_serve_only_the_namespaces_the_installer_listed() {
        let mut global = GlobalCredentials {
            url: Some("https://pve.example:8006".into()),
            token_id: Some("capmox@pve!capi".into()),
            secret: Some(Secret::new(SECRET)),
            ..GlobalCredentials::default()
        };
        let refused = global.for_namespace("team-a").expect_err("none listed");
        assert_eq!(refused.reason(), "CredentialsNotFound");
        assert!(
            refused
                .to_string()
                .contains("--global-credentials-namespaces"),
            "{refused}"
        );
        global.namespaces = comma_list("team-b, team-a");
        assert!(global.for_namespace("team-a").is_ok());
        assert!(global.for_namespace("team-c").is_err());
        global.namespaces = comma_list("*");
        assert!(global.for_namespace("team-c").is_ok());
        assert!(matches!(
            GlobalCredentials::default().for_namespace("team-a"),
            Err(CredentialsError::NotConfigured)
        ));
    }

    #[test]
    fn secrets_are_read_in_any_namespace_unless_the_installer_listed_some() {
        let mut global = GlobalCredentials::default();
        assert!(global.reads_secrets_in("anywhere"));
        global.secret_namespaces = Some(comma_list("team-a"));
        assert!(global.reads_secrets_in("team-a"));
        assert!(!global.reads_secrets_in("team-b"));
    }

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
