//! TLS trust against the simulator served over HTTPS with a test CA and node
//! certificate: default rejects, CA accepts, right fingerprint accepts, wrong rejects.

use capmox::proxmox::*;
use capmox_sim::{SimOptions, Simulator, TlsMaterial, Topology};

const CA: &str = include_str!("../data/tls/ca.pem");
const NODE_CERT: &str = include_str!("../data/tls/node.pem");
const NODE_KEY: &str = include_str!("../data/tls/node.key");
/// As printed by `openssl x509 -noout -fingerprint -sha256 -in node.pem`.
const NODE_FP: &str = "88:E3:CC:69:6C:3B:66:B8:2C:1E:4B:79:DE:31:27:21:50:20:FA:C1:C5:C6:14:98:0F:98:19:C8:00:1A:E0:C8";

async fn https_sim() -> Simulator {
    Simulator::start_on(
        Topology::example(),
        SimOptions::default(),
        "127.0.0.1:0".parse().expect("addr"),
        Some(TlsMaterial {
            cert_pem: NODE_CERT.to_string(),
            key_pem: NODE_KEY.to_string(),
        }),
    )
    .await
    .expect("https simulator")
}

async fn try_version(sim: &Simulator, tls: TlsOptions) -> Result<VersionInfo> {
    let mut cfg = ClientConfig::new(sim.url(), ApiToken::parse(&sim.token()).expect("token"));
    cfg.tls = tls;
    cfg.retry.max_attempts = 1;
    let client = ProxmoxClient::new(&cfg)?;
    client.version().await
}

#[test]
fn fingerprint_matches_openssl() {
    let der = capmox::proxmox::tls::parse_pem_certs(NODE_CERT).expect("pem");
    assert_eq!(Fingerprint::of_der(der[0].as_ref()).to_string(), NODE_FP);
}

#[tokio::test]
async fn default_verification_rejects_an_unknown_ca() {
    let sim = https_sim().await;
    assert!(sim.url().starts_with("https://127.0.0.1:"));
    match try_version(&sim, TlsOptions::default()).await {
        Ok(v) => panic!("self-signed server accepted without trust: {v:?}"),
        // Rejected certificate (or no system CA store): a configuration error, not retried.
        Err(ProxmoxError::Config(msg)) => assert!(msg.contains("CA"), "{msg}"),
        Err(e) => panic!("expected a TLS configuration error, got {e:?}"),
    }
}

#[tokio::test]
async fn ca_bundle_accepts() {
    let sim = https_sim().await;
    let v = try_version(
        &sim,
        TlsOptions {
            ca_pem: Some(CA.to_string()),
            ..Default::default()
        },
    )
    .await
    .expect("trusted via CA");
    assert_eq!(v.release, "9.1");
}

#[tokio::test]
async fn pinned_fingerprint_accepts_and_wrong_one_rejects() {
    let sim = https_sim().await;
    try_version(
        &sim,
        TlsOptions {
            fingerprints: vec![NODE_FP.to_lowercase().replace(':', "")],
            ..Default::default()
        },
    )
    .await
    .expect("right fingerprint");
    // one of several pins (e.g. during a certificate renewal)
    try_version(
        &sim,
        TlsOptions {
            fingerprints: vec!["AA".repeat(32), NODE_FP.to_string()],
            ..Default::default()
        },
    )
    .await
    .expect("second pin matches");
    let err = try_version(
        &sim,
        TlsOptions {
            fingerprints: vec!["AB".repeat(32)],
            ..Default::default()
        },
    )
    .await
    .expect_err("wrong fingerprint");
    assert!(
        matches!(&err, ProxmoxError::Config(m) if m.contains("TLS verification")),
        "{err:?}"
    );
    let err = try_version(
        &sim,
        TlsOptions {
            fingerprints: vec!["not-hex".into()],
            ..Default::default()
        },
    )
    .await
    .expect_err("malformed pin");
    assert!(matches!(err, ProxmoxError::Config(_)), "{err:?}");
}

#[tokio::test]
async fn insecure_is_explicit_and_works() {
    // (the warning it logs is checked in tests/log_capture.rs)
    let sim = https_sim().await;
    try_version(
        &sim,
        TlsOptions {
            insecure: true,
            ..Default::default()
        },
    )
    .await
    .expect("insecure accepts anything");
}
