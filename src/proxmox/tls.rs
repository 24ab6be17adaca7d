//! TLS trust for Proxmox VE: system roots, an extra CA bundle, pinned SHA-256
//! fingerprints (the usual way to trust a self-signed node) or, explicitly, nothing.

use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};

use super::config::TlsOptions;
use super::error::{ProxmoxError, Result};

/// A SHA-256 certificate fingerprint (32 bytes).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint(pub [u8; 32]);

impl Fingerprint {
    /// Parses `AA:BB:...` (colons optional, case-insensitive), as Proxmox prints it.
    pub fn parse(text: &str) -> Result<Self> {
        let hex: String = text
            .trim()
            .chars()
            .filter(|c| *c != ':' && !c.is_whitespace())
            .collect();
        let bad = || {
            ProxmoxError::Config(format!(
                "fingerprint '{text}' must be 32 bytes of hex (SHA-256), e.g. 'AB:CD:...'"
            ))
        };
        // Checked as characters, not bytes: a multi-byte character must not split a slice.
        if hex.chars().count() != 64 || !hex.chars().all(|c| c.is_ascii_hexdigit()) {
            return Err(bad());
        }
        let mut out = [0u8; 32];
        for (byte, pair) in out.iter_mut().zip(hex.as_bytes().chunks_exact(2)) {
            let pair = std::str::from_utf8(pair).map_err(|_| bad())?;
            *byte = u8::from_str_radix(pair, 16).map_err(|_| bad())?;
        }
        Ok(Self(out))
    }

    /// The SHA-256 of a DER certificate.
    pub fn of_der(der: &[u8]) -> Self {
        let digest = ring::digest::digest(&ring::digest::SHA256, der);
        let mut out = [0u8; 32];
        out.copy_from_slice(digest.as_ref());
        Self(out)
    }

    /// Constant-time comparison, so timing does not reveal how much of a pin matched.
    fn ct_eq(&self, other: &Self) -> bool {
        self.0
            .iter()
            .zip(other.0.iter())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
    }
}

impl std::fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let parts: Vec<String> = self.0.iter().map(|b| format!("{b:02X}")).collect();
        f.write_str(&parts.join(":"))
    }
}

impl std::fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Fingerprint({self})")
    }
}

/// The ring crypto provider used for every connection (reqwest is built without one).
pub fn crypto_provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Parses all certificates of a PEM bundle.
pub fn parse_pem_certs(pem: &str) -> Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| ProxmoxError::Config(format!("CA bundle is not valid PEM: {e}")))?;
    if certs.is_empty() {
        return Err(ProxmoxError::Config(
            "CA bundle contains no 'BEGIN CERTIFICATE' block".to_string(),
        ));
    }
    Ok(certs)
}

/// Builds the rustls client configuration for the given trust options.
pub fn build_client_config(opts: &TlsOptions) -> Result<rustls::ClientConfig> {
    let provider = crypto_provider();
    let verifier: Arc<dyn ServerCertVerifier> = if opts.insecure {
        tracing::warn!(
            "TLS certificate verification for Proxmox VE is DISABLED (insecure); use a CA bundle or a pinned fingerprint instead"
        );
        Arc::new(NoVerification {
            provider: provider.clone(),
        })
    } else {
        let pins = opts
            .fingerprints
            .iter()
            .map(|f| Fingerprint::parse(f))
            .collect::<Result<Vec<_>>>()?;
        let base = base_verifier(opts, &provider);
        if pins.is_empty() {
            base?
        } else {
            Arc::new(PinnedVerifier {
                pins,
                // A pin alone is enough; normal verification is only a second way in.
                fallback: base.ok(),
                provider: provider.clone(),
            })
        }
    };
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| ProxmoxError::Config(format!("TLS protocol setup failed: {e}")))?
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_no_client_auth();
    Ok(config)
}

/// A config that accepts any certificate, for `http://` clients whose TLS is never used.
pub(crate) fn unverified_config() -> Result<rustls::ClientConfig> {
    let provider = crypto_provider();
    Ok(
        rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| ProxmoxError::Config(format!("TLS protocol setup failed: {e}")))?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(NoVerification { provider }))
            .with_no_client_auth(),
    )
}

fn base_verifier(
    opts: &TlsOptions,
    provider: &Arc<CryptoProvider>,
) -> Result<Arc<dyn ServerCertVerifier>> {
    let extra = match &opts.ca_pem {
        Some(pem) => parse_pem_certs(pem)?,
        None => Vec::new(),
    };
    let verifier = rustls_platform_verifier::Verifier::new_with_extra_roots(extra, provider.clone())
        .map_err(|e| {
            ProxmoxError::Config(format!(
                "cannot load trusted CA certificates ({e}); install the system CA bundle, give a CA bundle or pin the server fingerprint"
            ))
        })?;
    Ok(Arc::new(verifier))
}

/// Accepts a server whose end-entity certificate has one of the pinned SHA-256
/// fingerprints, or that passes normal verification. Handshake signatures are always checked.
#[derive(Debug)]
struct PinnedVerifier {
    pins: Vec<Fingerprint>,
    fallback: Option<Arc<dyn ServerCertVerifier>>,
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for PinnedVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        let seen = Fingerprint::of_der(end_entity.as_ref());
        // Check every pin (no early exit) to keep timing independent of the match position.
        let matched = self
            .pins
            .iter()
            .fold(false, |acc, pin| acc | pin.ct_eq(&seen));
        if matched {
            return Ok(ServerCertVerified::assertion());
        }
        match &self.fallback {
            Some(inner) => inner
                .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
                .inspect_err(|_| {
                    tracing::warn!(fingerprint = %seen, "server certificate matches no pinned fingerprint and fails verification");
                }),
            None => Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::ApplicationVerificationFailure,
            )),
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// Accepts any certificate (explicit `insecure` option only); still checks handshake signatures.
#[derive(Debug)]
struct NoVerification {
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for NoVerification {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprint_parse_and_display() {
        let text = "AB:CD:EF:01:23:45:67:89:AB:CD:EF:01:23:45:67:89:AB:CD:EF:01:23:45:67:89:AB:CD:EF:01:23:45:67:89";
        let fp = Fingerprint::parse(text).expect("valid");
        assert_eq!(fp.to_string(), text);
        let lower = Fingerprint::parse(&text.replace(':', "").to_lowercase()).expect("valid");
        assert_eq!(fp, lower);
        assert!(Fingerprint::parse("AB:CD").is_err());
        assert!(Fingerprint::parse(&"ZZ".repeat(32)).is_err());
        assert!(fp.ct_eq(&lower));
        assert!(!fp.ct_eq(&Fingerprint([0; 32])));
    }

    #[test]
    fn a_fingerprint_with_non_ascii_characters_is_an_error_not_a_panic() {
        for text in [
            format!("é{}", "A".repeat(62)),
            format!("€{}", "B".repeat(61)),
            format!("{}ä{}", "C".repeat(30), "D".repeat(32)),
            "Ⅻ".repeat(32),
        ] {
            let error = Fingerprint::parse(&text).expect_err(&text);
            assert!(error.to_string().contains("32 bytes of hex"), "{error}");
        }
    }

    #[test]
    fn bad_pem_is_a_config_error() {
        let err = parse_pem_certs("not a pem").expect_err("no certs");
        assert!(matches!(err, ProxmoxError::Config(_)));
    }
}
