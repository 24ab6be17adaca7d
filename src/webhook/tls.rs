//! The webhook's serving certificate: read from the directory a cert-manager Secret is mounted
//! at, and re-read when the files change, so a rotated certificate is served without a restart.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Duration;

use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::{self, PemObject};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// The certificate chain's file name in the directory (the `tls.crt` key of a TLS Secret).
pub const CERT_FILE: &str = "tls.crt";
/// The private key's file name in the directory (the `tls.key` key of a TLS Secret).
pub const KEY_FILE: &str = "tls.key";

/// Why the files in the certificate directory give no usable certificate.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CertError {
    /// A file is absent (the Secret is not mounted yet, or cert-manager has not issued it).
    #[error(
        "{path} does not exist: mount the Secret cert-manager writes at the webhook's cert dir \
         (--webhook-cert-dir), or pass --disable-webhook when running outside a cluster"
    )]
    Missing {
        /// The absent file.
        path: PathBuf,
    },
    /// A file exists but cannot be read.
    #[error("cannot read {path}: {reason} (check the volume mount and the file permissions)")]
    Unreadable {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        reason: String,
    },
    /// The certificate file holds no PEM certificate, or a malformed one.
    #[error(
        "{path} holds no usable PEM certificate ({reason}); it must start with the server's leaf certificate"
    )]
    Certificate {
        /// The certificate file.
        path: PathBuf,
        /// What is wrong, without the file's contents.
        reason: String,
    },
    /// The key file holds no PEM private key, or a malformed one.
    #[error(
        "{path} holds no usable PEM private key ({reason}); PKCS#8, PKCS#1 and SEC1 keys are accepted"
    )]
    Key {
        /// The key file.
        path: PathBuf,
        /// What is wrong, without the file's contents.
        reason: String,
    },
    /// Both files parse but do not belong together (e.g. a half-finished rotation).
    #[error(
        "{key} is not the key of the certificate in {cert} ({reason}); a rotation may be half \
         written, or the Secret holds a key for another certificate"
    )]
    Mismatch {
        /// The certificate file.
        cert: PathBuf,
        /// The key file.
        key: PathBuf,
        /// What rustls reported.
        reason: String,
    },
}

/// What one look at the certificate directory did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reload {
    /// New files were loaded; handshakes from now on present them.
    Loaded,
    /// The files are as they were at the last look; nothing changed.
    Unchanged,
    /// The files changed but are unusable; the previous certificate (if any) is still served.
    Failed(CertError),
}

/// The certificate the webhook presents, swapped in place when the files change; clones share it.
#[derive(Clone)]
pub struct ServingCertificate {
    inner: Arc<Inner>,
}

struct Inner {
    cert_path: PathBuf,
    key_path: PathBuf,
    provider: Arc<CryptoProvider>,
    current: RwLock<Option<Arc<CertifiedKey>>>,
    /// What the files held at the last look (a digest, or why they could not be read), so
    /// unchanged files are neither parsed nor logged again; the lock also serialises reloads.
    last_seen: Mutex<Option<Seen>>,
    /// A handshake found no certificate since the last change (its warning is logged once).
    warned_unavailable: AtomicBool,
    /// Counts the certificates loaded, for whoever waits for a rotation.
    loaded: watch::Sender<u64>,
}

#[derive(Debug, PartialEq, Eq)]
enum Seen {
    /// The SHA-256 of both files.
    Files(Vec<u8>),
    Unreadable(CertError),
}

impl std::fmt::Debug for ServingCertificate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServingCertificate")
            .field("cert", &self.inner.cert_path)
            .field("key", &self.inner.key_path)
            .field("loaded", &*self.inner.loaded.borrow())
            .finish_non_exhaustive()
    }
}

impl ServingCertificate {
    /// A certificate read from `dir` (`tls.crt` and `tls.key`); nothing is read until
    /// [`reload`](Self::reload).
    pub fn new(dir: &Path) -> Self {
        Self {
            inner: Arc::new(Inner {
                cert_path: dir.join(CERT_FILE),
                key_path: dir.join(KEY_FILE),
                provider: Arc::new(rustls::crypto::ring::default_provider()),
                current: RwLock::new(None),
                last_seen: Mutex::new(None),
                warned_unavailable: AtomicBool::new(false),
                loaded: watch::Sender::new(0),
            }),
        }
    }

    /// Reads the files again and serves them if they changed and form a valid pair; a broken
    /// pair keeps the previous certificate. The watch task calls this; tests call it to rotate
    /// without waiting for the next poll.
    pub fn reload(&self) -> Reload {
        let inner = &self.inner;
        let mut last_seen = inner
            .last_seen
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let files = self.read_files();
        let seen = match &files {
            Ok((cert, key)) => Seen::Files(digest(cert, key)),
            Err(error) => Seen::Unreadable(error.clone()),
        };
        if last_seen.as_ref() == Some(&seen) {
            return Reload::Unchanged;
        }
        *last_seen = Some(seen);
        inner.warned_unavailable.store(false, Ordering::Relaxed);
        let had_one = self.is_loaded();
        match files.and_then(|(cert, key)| self.parse(&cert, &key)) {
            Ok(certified) => {
                let fingerprint = certified
                    .end_entity_cert()
                    .map(|leaf| fingerprint(leaf))
                    .unwrap_or_default();
                *inner
                    .current
                    .write()
                    .unwrap_or_else(PoisonError::into_inner) = Some(Arc::new(certified));
                inner.loaded.send_modify(|count| *count += 1);
                tracing::info!(
                    cert = %inner.cert_path.display(),
                    sha256 = %fingerprint,
                    rotated = had_one,
                    "loaded the webhook's serving certificate"
                );
                Reload::Loaded
            }
            Err(error) => {
                if had_one {
                    tracing::error!(%error, "cannot load the webhook's new serving certificate; still serving the previous one");
                } else if matches!(error, CertError::Missing { .. }) {
                    tracing::warn!(%error, "no serving certificate for the webhook yet; conversion requests fail until it appears");
                } else {
                    tracing::error!(%error, "cannot load the webhook's serving certificate; conversion requests fail until it is fixed");
                }
                Reload::Failed(error)
            }
        }
    }

    /// Whether a certificate has been loaded (handshakes fail until one is).
    pub fn is_loaded(&self) -> bool {
        self.inner
            .current
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some()
    }

    /// How many certificates have been loaded so far (the first one counts), so callers can
    /// wait for a rotation to be picked up.
    pub fn loaded_count(&self) -> u64 {
        *self.inner.loaded.borrow()
    }

    /// Notified each time a certificate is loaded; the value is [`loaded_count`](Self::loaded_count).
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.inner.loaded.subscribe()
    }

    /// Polls the directory every `interval` until `shutdown`, loading changed files (kubelet
    /// swaps a mounted Secret's files through a symlink, so the contents are compared).
    pub async fn watch(self, interval: Duration, shutdown: CancellationToken) {
        // The first look is the caller's (the server reads the files when it binds).
        let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                _ = ticker.tick() => {}
            }
            let certificate = self.clone();
            if let Err(error) = tokio::task::spawn_blocking(move || certificate.reload()).await {
                tracing::error!(%error, "reading the webhook's certificate files failed abnormally");
            }
        }
    }

    /// The TLS configuration of the webhook server: this certificate, whatever it is at each
    /// handshake; HTTP/1.1 only.
    pub fn server_config(&self) -> Result<rustls::ServerConfig, rustls::Error> {
        let mut config = rustls::ServerConfig::builder_with_provider(self.inner.provider.clone())
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_cert_resolver(Arc::new(self.clone()));
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(config)
    }

    fn read_files(&self) -> Result<(Vec<u8>, Vec<u8>), CertError> {
        Ok((read(&self.inner.cert_path)?, read(&self.inner.key_path)?))
    }

    fn parse(&self, cert: &[u8], key: &[u8]) -> Result<CertifiedKey, CertError> {
        let inner = &self.inner;
        let cert_error = |reason: String| CertError::Certificate {
            path: inner.cert_path.clone(),
            reason,
        };
        let chain = CertificateDer::pem_slice_iter(cert)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|error| cert_error(pem_reason(&error)))?;
        if chain.is_empty() {
            return Err(cert_error("no CERTIFICATE block".into()));
        }
        let key = PrivateKeyDer::from_pem_slice(key).map_err(|error| CertError::Key {
            path: inner.key_path.clone(),
            reason: pem_reason(&error),
        })?;
        CertifiedKey::from_der(chain, key, &inner.provider).map_err(|error| {
            match error {
                // The key did not parse as any key type the provider knows.
                rustls::Error::General(reason) => CertError::Key {
                    path: inner.key_path.clone(),
                    reason,
                },
                other => CertError::Mismatch {
                    cert: inner.cert_path.clone(),
                    key: inner.key_path.clone(),
                    reason: other.to_string(),
                },
            }
        })
    }
}

impl ResolvesServerCert for ServingCertificate {
    fn resolve(&self, _client_hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        let current = self
            .inner
            .current
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        if current.is_none() && !self.inner.warned_unavailable.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                cert = %self.inner.cert_path.display(),
                key = %self.inner.key_path.display(),
                "refusing TLS handshakes to the webhook: no serving certificate has loaded yet"
            );
        }
        current
    }
}

fn read(path: &Path) -> Result<Vec<u8>, CertError> {
    // `fs::read` follows symlinks, so a Secret volume's `..data` swap is seen as new contents.
    std::fs::read(path).map_err(|error| match error.kind() {
        std::io::ErrorKind::NotFound => CertError::Missing {
            path: path.to_owned(),
        },
        _ => CertError::Unreadable {
            path: path.to_owned(),
            reason: error.to_string(),
        },
    })
}

/// A PEM error described without the text it choked on (which could be key material).
fn pem_reason(error: &pem::Error) -> String {
    match error {
        pem::Error::NoItemsFound => "no PEM block of the expected type".into(),
        pem::Error::MissingSectionEnd { .. } => "a PEM block has no END line".into(),
        pem::Error::IllegalSectionStart { .. } => "a malformed BEGIN line".into(),
        pem::Error::Base64Decode(_) => "a PEM block is not valid base64".into(),
        _ => "malformed PEM".into(),
    }
}

/// Both files' contents, hashed so they can be compared without being kept.
fn digest(cert: &[u8], key: &[u8]) -> Vec<u8> {
    let mut context = ring::digest::Context::new(&ring::digest::SHA256);
    context.update(&(cert.len() as u64).to_be_bytes());
    context.update(cert);
    context.update(key);
    context.finish().as_ref().to_vec()
}

/// The SHA-256 fingerprint of a certificate, as `openssl x509 -fingerprint -sha256` prints it.
fn fingerprint(certificate: &CertificateDer<'_>) -> String {
    ring::digest::digest(&ring::digest::SHA256, certificate.as_ref())
        .as_ref()
        .iter()
        .map(|byte| format!("{byte:02X}"))
        .collect::<Vec<_>>()
        .join(":")
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    use super::{CertError, Reload, ServingCertificate};

    fn tls_data(file: &str) -> Vec<u8> {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/data/tls")
            .join(file);
        std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    }

    struct Dir(PathBuf);

    impl Dir {
        fn new(tag: &str) -> Self {
            let path = std::env::temp_dir()
                .join(format!("capmox-webhook-unit-{tag}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&path);
            std::fs::create_dir_all(&path).expect("a temporary directory");
            Self(path)
        }

        fn write(&self, cert: &[u8], key: &[u8]) {
            std::fs::write(self.0.join(super::CERT_FILE), cert).expect("write tls.crt");
            std::fs::write(self.0.join(super::KEY_FILE), key).expect("write tls.key");
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn reloads_only_changed_files_and_keeps_the_last_good_pair() {
        let dir = Dir::new("reload");
        let certificate = ServingCertificate::new(&dir.0);
        assert!(matches!(
            certificate.reload(),
            Reload::Failed(CertError::Missing { .. })
        ));
        assert_eq!(certificate.reload(), Reload::Unchanged, "still missing");
        assert!(!certificate.is_loaded());

        dir.write(&tls_data("node.pem"), &tls_data("node.key"));
        assert_eq!(certificate.reload(), Reload::Loaded);
        assert_eq!(certificate.reload(), Reload::Unchanged);
        assert_eq!(certificate.loaded_count(), 1);

        dir.write(b"garbage", &tls_data("node.key"));
        assert!(matches!(
            certificate.reload(),
            Reload::Failed(CertError::Certificate { .. })
        ));
        assert!(certificate.is_loaded(), "the previous pair is kept");
        assert_eq!(certificate.loaded_count(), 1);

        // The CA's certificate with the leaf's key: a half-written rotation.
        dir.write(&tls_data("ca.pem"), &tls_data("node.key"));
        assert!(matches!(
            certificate.reload(),
            Reload::Failed(CertError::Mismatch { .. })
        ));

        let key = tls_data("node.key");
        dir.write(&tls_data("node.pem"), &key[..key.len() / 2]);
        match certificate.reload() {
            Reload::Failed(error @ CertError::Key { .. }) => {
                let message = error.to_string();
                let body = String::from_utf8_lossy(&key);
                let secret_line = body.lines().nth(1).expect("a base64 line");
                assert!(!message.contains(secret_line), "{message}");
            }
            other => panic!("a truncated key: {other:?}"),
        }

        // The leaf with its chain: a different, valid pair.
        let mut chain = tls_data("node.pem");
        chain.extend(tls_data("ca.pem"));
        dir.write(&chain, &tls_data("node.key"));
        assert_eq!(certificate.reload(), Reload::Loaded);
        assert_eq!(certificate.loaded_count(), 2);
    }

    #[test]
    fn errors_say_what_to_fix() {
        let missing = CertError::Missing {
            path: "/certs/tls.crt".into(),
        };
        let message = missing.to_string();
        assert!(message.contains("/certs/tls.crt"), "{message}");
        assert!(message.contains("--webhook-cert-dir"), "{message}");
        assert!(message.contains("--disable-webhook"), "{message}");
    }
}
