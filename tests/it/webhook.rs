//! The conversion and validating webhooks over real HTTPS: ConversionReviews and AdmissionReviews
//! in and out, HTTP errors for what is not one, certificate rotation without a restart, and every replica (a follower too) serving.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use capmox::webhook::{
    CONVERT_PATH, CertError, Converter, Reload, WebhookConfig, WebhookServer, tls,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use crate::common::data;

const V1ALPHA1: &str = "infrastructure.cluster.x-k8s.io/v1alpha1";
const V1ALPHA2: &str = "infrastructure.cluster.x-k8s.io/v1alpha2";

/// Bound for every wait on an observable event.
const WAIT: Duration = Duration::from_secs(30);

fn tls_file(file: &str) -> Vec<u8> {
    std::fs::read(data(&format!("tls/{file}"))).expect("test TLS material")
}

/// A temporary certificate directory, removed on drop.
struct CertDir(PathBuf);

impl CertDir {
    fn new(tag: &str) -> Self {
        let path =
            std::env::temp_dir().join(format!("capmox-webhook-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).expect("a temporary directory");
        Self(path)
    }

    /// Writes the pair as plain files.
    fn write(&self, cert: &[u8], key: &[u8]) {
        std::fs::write(self.0.join(tls::CERT_FILE), cert).expect("tls.crt");
        std::fs::write(self.0.join(tls::KEY_FILE), key).expect("tls.key");
    }

    /// The test leaf for 127.0.0.1 and its key.
    fn write_leaf(&self) {
        self.write(&tls_file("node.pem"), &tls_file("node.key"));
    }

    /// Writes the pair as kubelet updates a Secret volume: into a new timestamped directory,
    /// then one atomic rename of the `..data` symlink the files link through.
    fn publish_like_kubelet(&self, version: &str, cert: &[u8], key: &[u8]) {
        let versioned = self.0.join(format!("..{version}"));
        std::fs::create_dir_all(&versioned).expect("a version directory");
        std::fs::write(versioned.join(tls::CERT_FILE), cert).expect("tls.crt");
        std::fs::write(versioned.join(tls::KEY_FILE), key).expect("tls.key");
        let staged = self.0.join("..data_tmp");
        let _ = std::fs::remove_file(&staged);
        std::os::unix::fs::symlink(format!("..{version}"), &staged).expect("a symlink");
        std::fs::rename(&staged, self.0.join("..data")).expect("swap ..data");
        for file in [tls::CERT_FILE, tls::KEY_FILE] {
            let link = self.0.join(file);
            if std::fs::symlink_metadata(&link).is_err() {
                std::os::unix::fs::symlink(format!("..data/{file}"), &link).expect("a symlink");
            }
        }
    }
}

impl Drop for CertDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The test CA, the only root the clients trust.
fn roots() -> rustls::RootCertStore {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(data("tls/ca.pem")).expect("ca.pem") {
        roots.add(cert.expect("a certificate")).expect("a CA");
    }
    roots
}

fn client_config() -> rustls::ClientConfig {
    rustls::ClientConfig::builder_with_provider(capmox::proxmox::tls::crypto_provider())
        .with_safe_default_protocol_versions()
        .expect("TLS versions")
        .with_root_certificates(roots())
        .with_no_client_auth()
}

fn https() -> reqwest::Client {
    reqwest::Client::builder()
        .tls_backend_preconfigured(client_config())
        .build()
        .expect("an HTTPS client")
}

/// One fresh TLS handshake with the server: the length of the chain it presented, or why it
/// failed.
async fn handshake(address: SocketAddr) -> Result<usize, String> {
    let connector = tokio_rustls::TlsConnector::from(Arc::new(client_config()));
    let stream = tokio::net::TcpStream::connect(address)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let server = ServerName::try_from("127.0.0.1").map_err(|e| e.to_string())?;
    let stream = connector
        .connect(server, stream)
        .await
        .map_err(|e| format!("handshake: {e}"))?;
    Ok(stream.get_ref().1.peer_certificates().map_or(0, <[_]>::len))
}

/// A webhook on 127.0.0.1 with an OS-chosen port, serving until dropped.
struct Running {
    address: SocketAddr,
    certificate: capmox::webhook::ServingCertificate,
    stop: CancellationToken,
}

impl Running {
    /// Checks the files only when a test calls `reload`, so no poll races the test's steps.
    async fn start(cert_dir: &Path, converter: Converter) -> Self {
        Self::polling(cert_dir, converter, Duration::from_secs(3600)).await
    }

    async fn polling(cert_dir: &Path, converter: Converter, interval: Duration) -> Self {
        Self::limited(
            cert_dir,
            converter,
            interval,
            capmox::webhook::WEBHOOK_LIMITS,
        )
        .await
    }

    async fn limited(
        cert_dir: &Path,
        converter: Converter,
        interval: Duration,
        limits: capmox::controller::http::ServerLimits,
    ) -> Self {
        let config = WebhookConfig {
            bind_address: ([127, 0, 0, 1], 0).into(),
            cert_dir: cert_dir.to_owned(),
        };
        let server = WebhookServer::bind(&config, converter)
            .await
            .expect("the webhook binds")
            .with_cert_poll_interval(interval)
            .with_limits(limits);
        let address = server.local_addr().expect("bound");
        let certificate = server.certificate().clone();
        let stop = CancellationToken::new();
        tokio::spawn(server.serve(stop.clone()));
        Self {
            address,
            certificate,
            stop,
        }
    }

    fn url(&self, path: &str) -> String {
        format!("https://{}{path}", self.address)
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Converts by rewriting `apiVersion` only.
fn relabel() -> Converter {
    Arc::new(|mut object: Value, desired: &str| {
        object["apiVersion"] = json!(desired);
        Ok(object)
    })
}

fn object(kind: &str, name: &str) -> Value {
    json!({"apiVersion": V1ALPHA2, "kind": kind,
           "metadata": {"name": name, "namespace": "tenant-a", "uid": format!("uid-{name}")},
           "spec": {}})
}

fn review(uid: &str, desired: &str, objects: &[Value]) -> Value {
    json!({"apiVersion": "apiextensions.k8s.io/v1", "kind": "ConversionReview",
           "request": {"uid": uid, "desiredAPIVersion": desired, "objects": objects}})
}

async fn post(running: &Running, body: &Value) -> (u16, Value) {
    let response = https()
        .post(running.url(CONVERT_PATH))
        .json(body)
        .send()
        .await
        .expect("the webhook answers");
    let status = response.status().as_u16();
    assert_eq!(
        response
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok()),
        Some("application/json")
    );
    (status, response.json().await.expect("a JSON answer"))
}

#[tokio::test]
async fn reviews_are_converted_over_https_in_order() {
    let dir = CertDir::new("success");
    dir.write_leaf();
    let running = Running::start(&dir.0, relabel()).await;
    let objects = [
        object("ProxmoxCluster", "c"),
        object("ProxmoxMachine", "m-1"),
        object("ProxmoxMachineTemplate", "t"),
        object("ProxmoxClusterTemplate", "ct"),
        object("ProxmoxMachine", "m-0"),
    ];
    let (status, answer) = post(&running, &review("5f1c-uid", V1ALPHA1, &objects)).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["apiVersion"], "apiextensions.k8s.io/v1");
    assert_eq!(answer["kind"], "ConversionReview");
    let response = &answer["response"];
    assert_eq!(response["uid"], "5f1c-uid");
    assert_eq!(response["result"], json!({"status": "Success"}));
    let converted = response["convertedObjects"].as_array().expect("objects");
    let names: Vec<&str> = converted
        .iter()
        .filter_map(|o| o["metadata"]["name"].as_str())
        .collect();
    assert_eq!(names, ["c", "m-1", "t", "ct", "m-0"]);
    assert!(converted.iter().all(|o| o["apiVersion"] == V1ALPHA1));
    assert!(
        converted
            .iter()
            .zip(&objects)
            .all(|(c, o)| c["metadata"] == o["metadata"])
    );
}

#[tokio::test]
async fn capmox_converter_is_served() {
    let dir = CertDir::new("capmox");
    dir.write_leaf();
    let running = Running::start(&dir.0, capmox::webhook::capmox_converter()).await;
    let objects = [object("ProxmoxMachine", "m")];
    let (status, answer) = post(&running, &review("same", V1ALPHA2, &objects)).await;
    assert_eq!(status, 200);
    assert_eq!(answer["response"]["result"]["status"], "Success");
    assert_eq!(answer["response"]["convertedObjects"], json!(objects));
}

#[tokio::test]
async fn a_failing_object_fails_the_review_naming_it() {
    let dir = CertDir::new("failure");
    dir.write_leaf();
    let converter: Converter = Arc::new(|object: Value, _: &str| {
        Err(format!(
            "{} has a field v1alpha1 cannot hold",
            object["metadata"]["name"]
        ))
    });
    let running = Running::start(&dir.0, converter).await;
    let objects = [object("ProxmoxCluster", "broken")];
    let (status, answer) = post(&running, &review("fail-uid", V1ALPHA1, &objects)).await;
    assert_eq!(
        status, 200,
        "a failed conversion is still an answered review"
    );
    let response = &answer["response"];
    assert_eq!(response["uid"], "fail-uid");
    assert_eq!(response["result"]["status"], "Failure");
    let message = response["result"]["message"].as_str().expect("a message");
    assert!(
        message.contains("ProxmoxCluster tenant-a/broken"),
        "{message}"
    );
    assert!(
        message.contains("has a field v1alpha1 cannot hold"),
        "{message}"
    );
    assert_eq!(response["convertedObjects"], json!([]));
}

#[tokio::test]
async fn what_is_not_a_review_gets_an_http_error() {
    let dir = CertDir::new("errors");
    dir.write_leaf();
    let running = Running::start(&dir.0, relabel()).await;
    let http = https();
    let send = |request: reqwest::RequestBuilder| async move {
        let response = request.send().await.expect("the webhook answers");
        let status = response.status().as_u16();
        (status, response.text().await.expect("a body"))
    };

    let (status, body) = send(
        http.post(running.url(CONVERT_PATH))
            .header("content-type", "application/json")
            .body("{\"apiVersion\": "),
    )
    .await;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("not a ConversionReview"), "{body}");

    let no_request = json!({"apiVersion": "apiextensions.k8s.io/v1", "kind": "ConversionReview"});
    let (status, body) = send(http.post(running.url(CONVERT_PATH)).json(&no_request)).await;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("no request"), "{body}");

    let (status, body) = send(
        http.post(running.url("/mutate"))
            .json(&review("u", V1ALPHA1, &[])),
    )
    .await;
    assert_eq!(status, 404, "{body}");
    assert!(body.contains(CONVERT_PATH), "{body}");

    let response = http
        .get(running.url(CONVERT_PATH))
        .send()
        .await
        .expect("answers");
    assert_eq!(response.status().as_u16(), 405);
    assert_eq!(
        response
            .headers()
            .get("allow")
            .and_then(|v| v.to_str().ok()),
        Some("POST")
    );

    let too_large = vec![b' '; capmox::webhook::MAX_BODY_BYTES + 1];
    let (status, body) = send(http.post(running.url(CONVERT_PATH)).body(too_large)).await;
    assert_eq!(status, 413, "{body}");

    // The server still answers after all that.
    let (status, _) = post(&running, &review("after", V1ALPHA1, &[])).await;
    assert_eq!(status, 200);
}

fn admission_review(operation: &str, object: &Value, old: Option<&Value>, dry_run: bool) -> Value {
    // A DELETE carries the old object only.
    let named = if object.is_null() {
        old.expect("an old object")
    } else {
        object
    };
    let kind = named["kind"].as_str().expect("a kind");
    json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": format!("uid-{operation}-{kind}"),
            "kind": {"group": "infrastructure.cluster.x-k8s.io", "version": "v1alpha2", "kind": kind},
            "resource": {"group": "infrastructure.cluster.x-k8s.io", "version": "v1alpha2",
                         "resource": format!("{}s", kind.to_ascii_lowercase())},
            "requestKind": {"group": "infrastructure.cluster.x-k8s.io", "version": "v1alpha1", "kind": kind},
            "name": named["metadata"]["name"],
            "namespace": "tenant-a",
            "operation": operation,
            "userInfo": {"username": "system:serviceaccount:capi-system:capi-manager",
                         "groups": ["system:serviceaccounts"]},
            "object": object,
            "oldObject": old,
            "dryRun": dry_run,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"}
        }
    })
}

async fn validate(running: &Running, kind: &str, body: &Value) -> Value {
    let path = capmox::webhook::admission::validate_path(kind);
    let response = https()
        .post(running.url(&path))
        .json(body)
        .send()
        .await
        .expect("the webhook answers");
    assert_eq!(response.status().as_u16(), 200, "{path}");
    let answer: Value = response.json().await.expect("a JSON answer");
    assert_eq!(answer["apiVersion"], "admission.k8s.io/v1");
    assert_eq!(answer["kind"], "AdmissionReview");
    assert_eq!(answer["response"]["uid"], body["request"]["uid"]);
    answer["response"].clone()
}

fn proxmox_machine(network: Value) -> Value {
    json!({"apiVersion": V1ALPHA2, "kind": "ProxmoxMachine",
           "metadata": {"name": "m", "namespace": "tenant-a"},
           "spec": {"sourceNode": "pve1", "templateID": 100, "full": true, "network": network}})
}

#[tokio::test]
async fn admission_reviews_are_validated_over_https() {
    let dir = CertDir::new("validate");
    dir.write_leaf();
    let running = Running::start(&dir.0, relabel()).await;

    // ProxmoxMachine: routing checks CEL cannot afford.
    let nics: Vec<Value> = (0..12)
        .map(|i| json!({"name": format!("net{i}"), "bridge": "vmbr0"}))
        .collect();
    let good = proxmox_machine(json!({"networkDevices": nics}));
    let response = validate(
        &running,
        "ProxmoxMachine",
        &admission_review("CREATE", &good, None, false),
    )
    .await;
    assert_eq!(response["allowed"], true, "{response}");
    let bad = proxmox_machine(json!({"networkDevices": [
        {"name": "net0", "bridge": "vmbr0",
         "routes": [{"to": "default"}],
         "routingPolicy": [{"to": "10.1.0.0/16"}]}
    ]}));
    let response = validate(
        &running,
        "ProxmoxMachine",
        &admission_review("UPDATE", &bad, Some(&good), false),
    )
    .await;
    assert_eq!(response["allowed"], false, "{response}");
    assert_eq!(response["status"]["code"], 422);
    assert_eq!(response["status"]["reason"], "Invalid");
    let fields: Vec<&str> = response["status"]["details"]["causes"]
        .as_array()
        .expect("causes")
        .iter()
        .filter_map(|c| c["field"].as_str())
        .collect();
    assert_eq!(
        fields,
        [
            "spec.network.networkDevices[0].routingPolicy[0].table",
            "spec.network.networkDevices[0].routes[0].is6"
        ]
    );
    let message = response["status"]["message"].as_str().expect("a message");
    assert!(
        message.contains("ProxmoxMachine.infrastructure.cluster.x-k8s.io \"m\" is invalid"),
        "{message}"
    );
    assert!(message.contains("needs a table"), "{message}");
    let response = validate(
        &running,
        "ProxmoxMachine",
        &admission_review("DELETE", &Value::Null, Some(&bad), false),
    )
    .await;
    assert_eq!(response["allowed"], true, "{response}");

    // ProxmoxClusterTemplate: the endpoint lies in a zone's pool.
    let template = json!({"apiVersion": V1ALPHA2, "kind": "ProxmoxClusterTemplate",
    "metadata": {"name": "ct", "namespace": "tenant-a"},
    "spec": {"template": {"spec": {
        "controlPlaneEndpoint": {"host": "10.0.5.7", "port": 6443},
        "dnsServers": ["10.0.0.2"],
        "ipv4Config": {"addresses": ["10.0.0.10-10.0.0.20"], "prefix": 24, "gateway": "10.0.0.1"},
        "zoneConfig": [{"zone": "a", "ipv4Config": {"addresses": ["10.0.5.0/24"], "prefix": 24, "gateway": "10.0.5.1"}}]
    }}}});
    let response = validate(
        &running,
        "ProxmoxClusterTemplate",
        &admission_review("CREATE", &template, None, false),
    )
    .await;
    assert_eq!(response["allowed"], false, "{response}");
    assert_eq!(
        response["status"]["details"]["causes"][0]["field"],
        "spec.template.spec.zoneConfig[0].ipv4Config.addresses[0]"
    );
    let mut fqdn = template.clone();
    fqdn["spec"]["template"]["spec"]["controlPlaneEndpoint"]["host"] = json!("api.example.com");
    let response = validate(
        &running,
        "ProxmoxClusterTemplate",
        &admission_review("CREATE", &fqdn, None, false),
    )
    .await;
    assert_eq!(response["allowed"], true, "{response}");

    // ProxmoxMachineTemplate: immutable, except in Cluster API's topology dry-runs.
    let machine_template = |memory: u32, annotated: bool| {
        let mut t = json!({"apiVersion": V1ALPHA2, "kind": "ProxmoxMachineTemplate",
            "metadata": {"name": "mt", "namespace": "tenant-a"},
            "spec": {"template": {"spec": {"sourceNode": "pve1", "templateID": 100, "memoryMiB": memory,
                "network": {"networkDevices": [{"name": "net0", "bridge": "vmbr0"}]}}}}});
        if annotated {
            t["metadata"]["annotations"] = json!({"topology.cluster.x-k8s.io/dry-run": ""});
        }
        t
    };
    let (old, new) = (machine_template(2048, false), machine_template(4096, false));
    let response = validate(
        &running,
        "ProxmoxMachineTemplate",
        &admission_review("UPDATE", &new, Some(&old), false),
    )
    .await;
    assert_eq!(response["allowed"], false, "{response}");
    assert!(
        response["status"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("spec: Forbidden: ProxmoxMachineTemplate is immutable")),
        "{response}"
    );
    let dry = machine_template(4096, true);
    let response = validate(
        &running,
        "ProxmoxMachineTemplate",
        &admission_review("UPDATE", &dry, Some(&old), true),
    )
    .await;
    assert_eq!(response["allowed"], true, "{response}");
    // kubectl's dry-run (no annotation) is checked like the real thing.
    let response = validate(
        &running,
        "ProxmoxMachineTemplate",
        &admission_review("UPDATE", &new, Some(&old), true),
    )
    .await;
    assert_eq!(response["allowed"], false, "{response}");
    let response = validate(
        &running,
        "ProxmoxMachineTemplate",
        &admission_review("UPDATE", &old, Some(&old), false),
    )
    .await;
    assert_eq!(response["allowed"], true, "{response}");

    // What is not an AdmissionReview, or not on a validation path, is an HTTP error.
    let http = https();
    let path = capmox::webhook::admission::validate_path("ProxmoxCluster");
    let response = http
        .post(running.url(&path))
        .body("{")
        .send()
        .await
        .expect("answers");
    assert_eq!(response.status().as_u16(), 400);
    let response = http
        .post(running.url(&path))
        .json(&review("u", V1ALPHA1, &[]))
        .send()
        .await
        .expect("answers");
    assert_eq!(response.status().as_u16(), 400);
    let response = http
        .post(running.url("/validate-infrastructure-cluster-x-k8s-io-v1alpha2-pod"))
        .json(&admission_review("CREATE", &good, None, false))
        .send()
        .await
        .expect("answers");
    assert_eq!(response.status().as_u16(), 404);
    let response = http.get(running.url(&path)).send().await.expect("answers");
    assert_eq!(response.status().as_u16(), 405);
    // And conversion still works next to it.
    let (status, _) = post(&running, &review("after", V1ALPHA1, &[])).await;
    assert_eq!(status, 200);
}

/// Without a certificate every handshake fails; the first valid pair is served as soon as it
/// is read, a broken one keeps it, and a different valid pair replaces it.
#[tokio::test]
async fn the_certificate_rotates_without_a_restart() {
    let dir = CertDir::new("rotate");
    let running = Running::start(&dir.0, relabel()).await;
    assert!(!running.certificate.is_loaded());
    let refused = handshake(running.address).await;
    assert!(refused.is_err(), "no certificate yet: {refused:?}");

    dir.write_leaf();
    assert_eq!(running.certificate.reload(), Reload::Loaded);
    assert_eq!(handshake(running.address).await, Ok(1), "the leaf alone");
    let (status, _) = post(&running, &review("first", V1ALPHA1, &[])).await;
    assert_eq!(status, 200);

    dir.write(b"-----BEGIN CERTIFICATE-----\nnot base64\n", b"garbage");
    assert!(matches!(
        running.certificate.reload(),
        Reload::Failed(CertError::Certificate { .. })
    ));
    assert_eq!(
        handshake(running.address).await,
        Ok(1),
        "a broken pair keeps the previous certificate"
    );

    // A different valid pair: the leaf with its CA as the chain.
    let mut chain = tls_file("node.pem");
    chain.extend(tls_file("ca.pem"));
    dir.write(&chain, &tls_file("node.key"));
    assert_eq!(running.certificate.reload(), Reload::Loaded);
    assert_eq!(handshake(running.address).await, Ok(2), "the new chain");
    assert_eq!(running.certificate.loaded_count(), 2);
}

/// The server's own watch picks up a Secret volume updated as kubelet does it (a `..data`
/// symlink swap), with no explicit reload.
#[tokio::test]
async fn the_watch_follows_a_kubelet_style_secret_update() {
    let dir = CertDir::new("kubelet");
    dir.publish_like_kubelet("v1", &tls_file("node.pem"), &tls_file("node.key"));
    let running = Running::polling(&dir.0, relabel(), Duration::from_millis(100)).await;
    assert!(running.certificate.is_loaded(), "read at start-up");
    assert_eq!(handshake(running.address).await, Ok(1));
    let mut loaded = running.certificate.subscribe();

    let mut chain = tls_file("node.pem");
    chain.extend(tls_file("ca.pem"));
    dir.publish_like_kubelet("v2", &chain, &tls_file("node.key"));
    tokio::time::timeout(WAIT, loaded.wait_for(|count| *count >= 2))
        .await
        .expect("the watch loads the rotated pair")
        .expect("the certificate lives");
    assert_eq!(handshake(running.address).await, Ok(2));
}

/// A replica that waits for the Lease (a follower) serves the webhook all the same, and stops
/// serving when the manager stops.
#[tokio::test]
async fn a_follower_serves_the_webhook_until_it_stops() {
    use capmox::controller::{GlobalCredentials, LeaderElectionConfig, ManagerConfig};
    use k8s_openapi::api::coordination::v1::Lease;
    use kube::api::{Api, PostParams};

    let dir = CertDir::new("follower");
    dir.write_leaf();
    let server = capmox_testkit::ApiServer::new();
    server.register_builtin_kinds();
    let lease: Lease = serde_json::from_value(json!({
        "metadata": {"name": "capmox-controller-leader", "namespace": "default"},
        "spec": {"holderIdentity": "the-leader", "leaseDurationSeconds": 3600,
                 "acquireTime": "2026-01-01T00:00:00.000000Z",
                 "renewTime": k8s_openapi::jiff::Timestamp::now().to_string()}
    }))
    .expect("a Lease");
    Api::<Lease>::namespaced(server.client(), "default")
        .create(&PostParams::default(), &lease)
        .await
        .expect("the leader's Lease");

    let address = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port");
    let config = ManagerConfig {
        metrics_address: ([127, 0, 0, 1], 0).into(),
        health_address: ([127, 0, 0, 1], 0).into(),
        leader_election: Some(LeaderElectionConfig {
            name: "capmox-controller-leader".into(),
            namespace: "default".into(),
            identity: "follower".into(),
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_millis(100),
        }),
        watch_namespace: None,
        watch_filter: None,
        cluster_concurrency: 1,
        machine_concurrency: 1,
        task_timing: Default::default(),
        zone_holds: Default::default(),
        proxmox_requests_in_flight: capmox::proxmox::DEFAULT_REQUESTS_IN_FLIGHT,
        webhook: Some(WebhookConfig {
            bind_address: address,
            cert_dir: dir.0.clone(),
        }),
    };
    let stop = CancellationToken::new();
    let manager = tokio::spawn(capmox::controller::run(
        server.client(),
        config,
        GlobalCredentials::default(),
        stop.clone(),
    ));
    let http = https();
    let url = format!("https://{address}{CONVERT_PATH}");
    let objects = [object("ProxmoxMachine", "m")];
    let answer: Value = tokio::time::timeout(WAIT, async {
        loop {
            let sent = http
                .post(&url)
                .json(&review("follower-uid", V1ALPHA2, &objects))
                .send()
                .await;
            if let Ok(response) = sent {
                return response.json().await.expect("a JSON answer");
            }
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the follower serves the webhook");
    assert_eq!(answer["response"]["uid"], "follower-uid");
    assert_eq!(answer["response"]["result"]["status"], "Success");

    stop.cancel();
    manager
        .await
        .expect("no panic")
        .expect("the follower stops cleanly");
    let lease = Api::<Lease>::namespaced(server.client(), "default")
        .get("capmox-controller-leader")
        .await
        .expect("the Lease");
    assert_eq!(
        lease.spec.and_then(|s| s.holder_identity).as_deref(),
        Some("the-leader"),
        "the follower never led"
    );
    tokio::time::timeout(WAIT, async {
        while tokio::net::TcpStream::connect(address).await.is_ok() {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the webhook stops listening once the manager has stopped");
}

/// Stops a `capmox run` child when the test ends, passed or failed.
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `capmox run` serves the webhook its flags describe and names the bound address in its log,
/// as it does for /metrics.
#[tokio::test]
async fn capmox_run_serves_the_webhook_its_flags_describe() {
    use std::io::BufRead;
    use std::process::{Command, Stdio};

    let dir = CertDir::new("binary");
    dir.write_leaf();
    let server = capmox_testkit::ApiServer::new();
    server.register_builtin_kinds();
    let http = server.serve_http().await.expect("serves");
    let kubeconfig = dir.0.join("kubeconfig");
    http.write_kubeconfig(&kubeconfig).expect("writes");
    let mut child = Command::new(env!("CARGO_BIN_EXE_capmox"))
        .args(["--log-format", "json", "run"])
        .args(["--metrics-bind-address", "127.0.0.1:0"])
        .args(["--health-probe-bind-address", "127.0.0.1:0"])
        .args(["--webhook-bind-address", "127.0.0.1:0"])
        .arg("--webhook-cert-dir")
        .arg(&dir.0)
        .env("KUBECONFIG", &kubeconfig)
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env_remove("CAPMOX_LEADER_ELECT")
        .env_remove("CAPMOX_DISABLE_WEBHOOK")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("capmox runs");
    let stderr = child.stderr.take().expect("piped");
    let _child = Child(child);
    // The log is read on a thread of its own: until the announcement, then to its end.
    let (announced, address) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        let mut announced = Some(announced);
        for line in std::io::BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            let parsed: Value = serde_json::from_str(&line).unwrap_or_default();
            if parsed["fields"]["message"] == "serving the conversion webhook"
                && let Some(sender) = announced.take()
            {
                let _ = sender.send(parsed["fields"].clone());
            }
        }
    });
    let fields = tokio::time::timeout(WAIT, address)
        .await
        .expect("capmox names the webhook's address")
        .expect("capmox logs before it exits");
    assert_eq!(fields["cert_dir"], dir.0.display().to_string());
    let address: SocketAddr = fields["address"]
        .as_str()
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("an address: {fields}"));
    assert_ne!(address.port(), 0);

    let response = https()
        .post(format!("https://{address}{CONVERT_PATH}"))
        .json(&review(
            "binary-uid",
            V1ALPHA2,
            &[object("ProxmoxMachine", "m")],
        ))
        .send()
        .await
        .expect("the webhook answers");
    assert_eq!(response.status().as_u16(), 200);
    let answer: Value = response.json().await.expect("JSON");
    assert_eq!(answer["response"]["uid"], "binary-uid");
    assert_eq!(answer["response"]["result"]["status"], "Success");
}

/// A TLS connection to the webhook that sent `head` (a request's start line and headers).
async fn tls_request(
    address: SocketAddr,
    head: &str,
) -> tokio_rustls::client::TlsStream<tokio::net::TcpStream> {
    use tokio::io::AsyncWriteExt;
    let connector = tokio_rustls::TlsConnector::from(Arc::new(client_config()));
    let stream = tokio::net::TcpStream::connect(address)
        .await
        .expect("connects");
    let server = ServerName::try_from("127.0.0.1").expect("name");
    let mut stream = connector.connect(server, stream).await.expect("handshake");
    stream.write_all(head.as_bytes()).await.expect("sends");
    stream
}

/// Reads until `needle` arrives (or the server closes), returning what was read.
async fn read_until(
    stream: &mut tokio_rustls::client::TlsStream<tokio::net::TcpStream>,
    needle: &str,
) -> String {
    use tokio::io::AsyncReadExt;
    let mut received = Vec::new();
    let mut chunk = [0u8; 4096];
    tokio::time::timeout(WAIT, async {
        while !String::from_utf8_lossy(&received).contains(needle) {
            let read = stream.read(&mut chunk).await.unwrap_or(0);
            if read == 0 {
                break;
            }
            received.extend_from_slice(&chunk[..read]);
        }
    })
    .await
    .expect("the webhook answers in time");
    String::from_utf8_lossy(&received).into_owned()
}

/// The head of a conversion request whose body of `length` bytes follows later; the server says
/// `100 Continue` once it starts reading the body, that is, once the request holds a review slot.
fn held_head(length: usize) -> String {
    format!(
        "POST {CONVERT_PATH} HTTP/1.1\r\nHost: capmox\r\nContent-Type: application/json\r\n\
         Content-Length: {length}\r\nExpect: 100-continue\r\n\r\n"
    )
}

#[tokio::test]
async fn reviews_beyond_the_concurrency_cap_get_503_and_the_next_is_answered() {
    use tokio::io::AsyncWriteExt;
    let dir = CertDir::new("concurrency");
    dir.write_leaf();
    let running = Running::start(&dir.0, relabel()).await;
    let body = serde_json::to_string(&review("held", V1ALPHA1, &[])).expect("JSON");
    let mut held = Vec::new();
    for _ in 0..capmox::webhook::MAX_CONCURRENT_REVIEWS {
        let mut stream = tls_request(running.address, &held_head(body.len())).await;
        let answer = read_until(&mut stream, "100 Continue").await;
        assert!(answer.starts_with("HTTP/1.1 100"), "{answer}");
        held.push(stream);
    }
    let response = https()
        .post(running.url(CONVERT_PATH))
        .json(&review("queued", V1ALPHA1, &[]))
        .send()
        .await
        .expect("answers");
    assert_eq!(response.status().as_u16(), 503);
    assert_eq!(
        response
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok()),
        Some("1")
    );
    // One held review completes; its slot serves the next.
    let mut first = held.remove(0);
    first.write_all(body.as_bytes()).await.expect("sends");
    let answer = read_until(&mut first, "\"uid\":\"held\"").await;
    assert!(answer.contains("HTTP/1.1 200"), "{answer}");
    let (status, answer) = post(&running, &review("after", V1ALPHA1, &[])).await;
    assert_eq!(status, 200, "{answer}");
}

#[tokio::test]
async fn a_body_that_stops_arriving_ends_with_408() {
    let dir = CertDir::new("stalled");
    dir.write_leaf();
    let limits = capmox::controller::http::ServerLimits {
        request_timeout: Duration::from_millis(300),
        ..capmox::webhook::WEBHOOK_LIMITS
    };
    let running = Running::limited(&dir.0, relabel(), Duration::from_secs(3600), limits).await;
    let mut stalled = tls_request(running.address, &held_head(1000)).await;
    let answer = read_until(&mut stalled, "\r\n\r\n").await;
    let answer = if answer.starts_with("HTTP/1.1 100") {
        read_until(&mut stalled, "longer than").await
    } else {
        answer
    };
    assert!(answer.contains("HTTP/1.1 408"), "{answer}");
}

#[tokio::test]
async fn a_declared_length_over_the_limit_is_refused_before_the_body_is_sent() {
    let dir = CertDir::new("declared");
    dir.write_leaf();
    let running = Running::start(&dir.0, relabel()).await;
    let mut stream = tls_request(
        running.address,
        &held_head(capmox::webhook::MAX_BODY_BYTES + 1),
    )
    .await;
    let answer = read_until(&mut stream, "bytes").await;
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
}
