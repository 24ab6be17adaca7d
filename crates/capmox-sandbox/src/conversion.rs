//! capmox's conversion webhook served on 127.0.0.1 with the test certificates, and capmox's
//! CRDs pointed at it, so a local API server (real or in-process) converts v1alpha1 objects
//! the way a cluster with cert-manager and the release manifests does.

use std::path::{Path, PathBuf};

use k8s_openapi::ByteString;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
    CustomResourceConversion, CustomResourceDefinition, WebhookClientConfig, WebhookConversion,
};
use tokio_util::sync::CancellationToken;

use capmox::webhook::{WebhookConfig, WebhookError, WebhookServer, capmox_converter};

/// The test CA and its 127.0.0.1 leaf (test-only material, see `tests/data/tls/README.md`).
const TLS_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/data/tls");

/// Why the local webhook could not start.
#[derive(Debug, thiserror::Error)]
pub enum LocalWebhookError {
    /// The test certificates could not be copied where the webhook reads them.
    #[error("cannot prepare the webhook certificates in {dir}: {source}")]
    Certificates {
        /// The directory.
        dir: PathBuf,
        /// Underlying error.
        source: std::io::Error,
    },
    /// The server did not start.
    #[error(transparent)]
    Serve(#[from] WebhookError),
}

/// A running conversion webhook: where the API server reaches it and which CA to trust.
pub struct LocalWebhook {
    /// `https://127.0.0.1:<port>/convert`.
    pub url: String,
    /// `https://127.0.0.1:<port>`, where the validating webhook's paths are served too.
    pub base_url: String,
    /// PEM of the CA that signed the serving certificate.
    pub ca_pem: Vec<u8>,
    cert_dir: PathBuf,
}

impl Drop for LocalWebhook {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.cert_dir);
    }
}

impl LocalWebhook {
    /// Serves capmox's converter until `stop` is cancelled.
    pub async fn start(stop: CancellationToken) -> Result<Self, LocalWebhookError> {
        let cert_dir = std::env::temp_dir().join(format!(
            "capmox-webhook-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or_default()
        ));
        let certificates = |dir: &Path| -> std::io::Result<Vec<u8>> {
            std::fs::create_dir_all(dir)?;
            let tls = Path::new(TLS_DIR);
            std::fs::copy(tls.join("node.pem"), dir.join("tls.crt"))?;
            std::fs::copy(tls.join("node.key"), dir.join("tls.key"))?;
            std::fs::read(tls.join("ca.pem"))
        };
        let ca_pem = certificates(&cert_dir).map_err(|source| LocalWebhookError::Certificates {
            dir: cert_dir.clone(),
            source,
        })?;
        let config = WebhookConfig {
            bind_address: ([127, 0, 0, 1], 0).into(),
            cert_dir: cert_dir.clone(),
        };
        let server = WebhookServer::bind(&config, capmox_converter()).await?;
        let port = server.local_addr().map(|a| a.port()).unwrap_or_default();
        tokio::spawn(server.serve(stop));
        let base_url = format!("https://127.0.0.1:{port}");
        Ok(Self {
            url: format!("{base_url}{}", capmox::webhook::CONVERT_PATH),
            base_url,
            ca_pem,
            cert_dir,
        })
    }

    /// Points the release manifests' ValidatingWebhookConfiguration (as JSON) at this webhook:
    /// each webhook's `clientConfig` becomes this server's URL with its path, and this CA.
    pub fn validate_through(&self, configuration: &mut serde_json::Value) {
        let ca_bundle = ByteString(self.ca_pem.clone());
        for webhook in configuration["webhooks"]
            .as_array_mut()
            .into_iter()
            .flatten()
        {
            let path = webhook["clientConfig"]["service"]["path"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            webhook["clientConfig"] = serde_json::json!({
                "url": format!("{}{path}", self.base_url),
                "caBundle": ca_bundle,
            });
        }
        if let Some(annotations) = configuration["metadata"]["annotations"].as_object_mut() {
            annotations.remove("cert-manager.io/inject-ca-from");
        }
    }

    /// Points a CRD's conversion at this webhook, as the release manifests point it at the
    /// webhook Service.
    pub fn convert_through(&self, crd: &mut CustomResourceDefinition) {
        crd.spec.conversion = Some(CustomResourceConversion {
            strategy: "Webhook".to_owned(),
            webhook: Some(WebhookConversion {
                client_config: Some(WebhookClientConfig {
                    url: Some(self.url.clone()),
                    ca_bundle: Some(ByteString(self.ca_pem.clone())),
                    service: None,
                }),
                conversion_review_versions: vec!["v1".to_owned()],
            }),
        });
    }
}
