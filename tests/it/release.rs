//! The clusterctl release files (`make release-manifests` writes them to `out/`) follow
//! clusterctl's rules, `IMG=` sets the manager's image, the cluster templates produce objects
//! the CRDs accept, and the Dockerfile's build stage copies everything the build needs.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::common::{TEMPLATE_VALUES, cargo, run_ok, substitute, tool};

fn read_out(file: &str) -> String {
    let path = Path::new("out").join(file);
    std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; run `make release-manifests` (make test does)",
            path.display()
        )
    })
}

fn documents(text: &str) -> Vec<Value> {
    serde_yaml::Deserializer::from_str(text)
        .map(|doc| serde::Deserialize::deserialize(doc).expect("valid YAML"))
        .filter(|v: &Value| !v.is_null())
        .collect()
}

fn components() -> Vec<Value> {
    documents(&read_out("infrastructure-components.yaml"))
}

#[test]
fn components_have_one_namespace_and_the_provider_label_everywhere() {
    let objects = components();
    let namespaces: Vec<_> = objects
        .iter()
        .filter(|o| o["kind"] == "Namespace")
        .collect();
    assert_eq!(
        namespaces.len(),
        1,
        "clusterctl wants exactly one Namespace"
    );
    assert_eq!(namespaces[0]["metadata"]["name"], "capmox-system");
    for object in &objects {
        assert_eq!(
            object["metadata"]["labels"]["cluster.x-k8s.io/provider"], "infrastructure-proxmox",
            "{} {} lacks the provider label",
            object["kind"], object["metadata"]["name"]
        );
        if object["metadata"].get("namespace").is_some() {
            assert_eq!(object["metadata"]["namespace"], "capmox-system");
        }
    }
}

#[test]
fn crds_are_named_and_labelled_for_clusterctl() {
    let metadata: Value =
        serde_yaml::from_str(&read_out("metadata.yaml")).expect("metadata parses");
    let version = semver_series(env!("CARGO_PKG_VERSION"));
    let contract = metadata["releaseSeries"]
        .as_array()
        .expect("releaseSeries")
        .iter()
        .find(|s| (s["major"].as_u64(), s["minor"].as_u64()) == (Some(version.0), Some(version.1)))
        .and_then(|s| s["contract"].as_str())
        .unwrap_or_else(|| panic!("metadata.yaml has no release series for {version:?}"))
        .to_owned();
    assert_eq!(
        metadata["apiVersion"],
        "clusterctl.cluster.x-k8s.io/v1alpha3"
    );
    assert_eq!(contract, "v1beta2");
    let crds: Vec<Value> = components()
        .into_iter()
        .filter(|o| o["kind"] == "CustomResourceDefinition")
        .collect();
    assert_eq!(crds.len(), 4);
    for crd in crds {
        let expected = format!(
            "{}.{}",
            crd["spec"]["names"]["plural"].as_str().unwrap_or(""),
            crd["spec"]["group"].as_str().unwrap_or("")
        );
        assert_eq!(crd["metadata"]["name"], expected.as_str());
        let served: Vec<&str> = crd["spec"]["versions"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|v| v["name"].as_str())
            .collect();
        let label = crd["metadata"]["labels"][format!("cluster.x-k8s.io/{contract}")]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        assert!(
            served.contains(&label.as_str()),
            "{expected}: contract label {label:?} names no served version"
        );
    }
}

fn semver_series(version: &str) -> (u64, u64) {
    let mut parts = version
        .split('.')
        .map(|p| p.parse::<u64>().expect("numeric version"));
    (parts.next().unwrap_or(0), parts.next().unwrap_or(0))
}

#[test]
fn the_manager_deployment_is_locked_down() {
    let objects = components();
    let deployment = objects
        .iter()
        .find(|o| o["kind"] == "Deployment")
        .expect("a Deployment");
    let pod = &deployment["spec"]["template"]["spec"];
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
    assert_eq!(
        pod["securityContext"]["seccompProfile"]["type"],
        "RuntimeDefault"
    );
    let containers = pod["containers"].as_array().expect("containers");
    assert_eq!(containers.len(), 1);
    let manager = &containers[0];
    assert_eq!(
        manager["name"], "manager",
        "clusterctl expects the container to be named manager"
    );
    assert_eq!(manager["securityContext"]["readOnlyRootFilesystem"], true);
    assert_eq!(
        manager["securityContext"]["allowPrivilegeEscalation"],
        false
    );
    assert_eq!(
        manager["securityContext"]["capabilities"]["drop"],
        serde_json::json!(["ALL"])
    );
    assert_eq!(manager["livenessProbe"]["httpGet"]["path"], "/healthz");
    assert_eq!(manager["readinessProbe"]["httpGet"]["path"], "/readyz");
    assert!(manager["resources"]["limits"]["memory"].is_string());
    assert!(manager["resources"]["requests"]["cpu"].is_string());
    let args: Vec<&str> = manager["args"]
        .as_array()
        .expect("args")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert!(args.contains(&"--leader-elect"));
    let env: BTreeSet<&str> = manager["env"]
        .as_array()
        .expect("env")
        .iter()
        .filter_map(|e| e["name"].as_str())
        .collect();
    for name in [
        "PROXMOX_URL",
        "PROXMOX_TOKEN",
        "PROXMOX_SECRET",
        "POD_NAMESPACE",
    ] {
        assert!(env.contains(name), "manager env lacks {name}");
    }
    // The args the Deployment passes must be ones capmox understands.
    let mut command = vec!["capmox"];
    command.extend(args.iter().copied());
    command.push("--help");
    let parsed = <capmox::cli::Cli as clap::Parser>::try_parse_from(&command);
    let error = parsed.expect_err("--help stops parsing");
    assert_eq!(
        error.kind(),
        clap::error::ErrorKind::DisplayHelp,
        "capmox rejects the Deployment's args: {error}"
    );
}

/// A rolling update of the shipped Deployment (one replica, leader election, the default
/// RollingUpdate strategy) completes: the new pod reports ready through `/readyz` while the old
/// one still holds the Lease, so Kubernetes can stop the old one and the new one takes over.
#[tokio::test]
async fn a_rolling_update_can_finish_while_the_old_replica_leads() {
    use capmox::controller::{GlobalCredentials, LeaderElectionConfig, ManagerConfig};
    use k8s_openapi::api::coordination::v1::Lease;
    use kube::api::{Api, PostParams};
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let objects = components();
    let deployment = objects
        .iter()
        .find(|o| o["kind"] == "Deployment")
        .expect("a Deployment");
    let strategy = deployment["spec"]["strategy"]["type"].as_str();
    assert!(
        matches!(strategy, None | Some("RollingUpdate")),
        "this test covers the RollingUpdate strategy, the Deployment uses {strategy:?}"
    );
    let namespace = deployment["metadata"]["namespace"]
        .as_str()
        .expect("namespaced");

    // The old replica's Lease, freshly renewed.
    let server = capmox_testkit::ApiServer::new();
    server.register_builtin_kinds();
    let lease: Lease = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "capmox-controller-leader", "namespace": namespace},
        "spec": {"holderIdentity": "old-replica", "leaseDurationSeconds": 3600,
                 "acquireTime": "2026-01-01T00:00:00.000000Z",
                 "renewTime": k8s_openapi::jiff::Timestamp::now().to_string()}
    }))
    .expect("lease");
    Api::<Lease>::namespaced(server.client(), namespace)
        .create(&PostParams::default(), &lease)
        .await
        .expect("lease created");

    let health = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port");
    let config = ManagerConfig {
        metrics_address: ([127, 0, 0, 1], 0).into(),
        health_address: health,
        leader_election: Some(LeaderElectionConfig {
            name: "capmox-controller-leader".into(),
            namespace: namespace.into(),
            identity: "new-replica".into(),
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_millis(100),
        }),
        watch_namespace: None,
        cluster_concurrency: 1,
        machine_concurrency: 1,
    };
    let stop = tokio_util::sync::CancellationToken::new();
    let manager = tokio::spawn(capmox::controller::run(
        server.client(),
        config,
        GlobalCredentials::default(),
        stop.clone(),
    ));
    let readyz = || async move {
        let mut stream = tokio::net::TcpStream::connect(health).await.ok()?;
        stream
            .write_all(b"GET /readyz HTTP/1.1\r\nHost: capmox\r\nConnection: close\r\n\r\n")
            .await
            .ok()?;
        let mut response = String::new();
        stream.read_to_string(&mut response).await.ok()?;
        Some(response)
    };
    let response = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            if let Some(response) = readyz().await {
                return response;
            }
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the probe endpoint answers");
    assert!(
        response.starts_with("HTTP/1.1 200"),
        "the new replica must be ready while it waits for the Lease: {response}"
    );
    assert!(response.contains("standing by"), "{response}");
    stop.cancel();
    manager
        .await
        .expect("no panic")
        .expect("the follower stops cleanly");
    let lease = Api::<Lease>::namespaced(server.client(), namespace)
        .get("capmox-controller-leader")
        .await
        .expect("lease");
    assert_eq!(
        lease.spec.and_then(|s| s.holder_identity).as_deref(),
        Some("old-replica"),
        "the follower never took the Lease"
    );
}

/// Every `${VAR}` of a template, without defaults.
fn variables(text: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let mut rest = text;
    while let Some(start) = rest.find("${") {
        let end = rest[start..].find('}').expect("closing brace") + start;
        let expr = &rest[start + 2..end];
        let name = expr.split([':', '=']).next().unwrap_or(expr);
        found.insert(name.to_owned());
        rest = &rest[end + 1..];
    }
    found
}

const TEMPLATES: &[&str] = &[
    "cluster-template.yaml",
    "cluster-template-failure-domains.yaml",
];

#[test]
fn every_template_variable_is_documented_in_the_readme() {
    let readme = std::fs::read_to_string("README.md").expect("README.md");
    let mut undocumented = Vec::new();
    for template in TEMPLATES {
        for variable in variables(&read_out(template)) {
            if !readme.contains(&format!("`{variable}`")) {
                undocumented.push(format!("{template}: {variable}"));
            }
        }
    }
    assert!(
        undocumented.is_empty(),
        "README.md does not document: {undocumented:#?}"
    );
}

/// The schema for an object's kind and version: capmox's CRDs or the upstream ones.
fn schema_for(object: &Value) -> Option<Value> {
    let kind = object["kind"].as_str()?;
    let version = object["apiVersion"].as_str()?.rsplit('/').next()?;
    let mut files: Vec<std::path::PathBuf> = std::fs::read_dir("crds")
        .ok()?
        .map(|e| e.ok().map(|e| e.path()))
        .collect::<Option<_>>()?;
    let upstream = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/external-crds");
    files.extend(
        std::fs::read_dir(upstream)
            .unwrap_or_else(|e| panic!("cannot read {upstream}: {e}"))
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "yaml")),
    );
    files.into_iter().find_map(|file| {
        let crd: Value = serde_yaml::from_str(&std::fs::read_to_string(&file).ok()?).ok()?;
        if crd["spec"]["names"]["kind"] != kind {
            return None;
        }
        let found = crd["spec"]["versions"]
            .as_array()?
            .iter()
            .find(|v| v["name"] == version)?
            .clone();
        Some(found["schema"]["openAPIV3Schema"].clone())
    })
}

#[test]
fn template_objects_are_valid_against_the_crds() {
    let mut validated = BTreeSet::new();
    for template in TEMPLATES {
        for object in documents(&substitute(&read_out(template), TEMPLATE_VALUES)) {
            let kind = object["kind"].as_str().unwrap_or_default().to_owned();
            let Some(schema) = schema_for(&object) else {
                continue;
            };
            if let Err(violations) = capmox_testkit::schema::validate_object(&schema, &object, None)
            {
                panic!(
                    "{template}: {kind} {}: {violations:#?}",
                    object["metadata"]["name"]
                );
            }
            validated.insert(kind);
        }
    }
    for kind in [
        "Cluster",
        "ProxmoxCluster",
        "KubeadmControlPlane",
        "ProxmoxMachineTemplate",
        "MachineDeployment",
    ] {
        assert!(
            validated.contains(kind),
            "no {kind} was validated (found {validated:?})"
        );
    }
}

#[test]
fn the_failure_domain_flavor_pins_one_deployment_per_zone() {
    let objects = documents(&substitute(
        &read_out("cluster-template-failure-domains.yaml"),
        TEMPLATE_VALUES,
    ));
    let cluster = objects
        .iter()
        .find(|o| o["kind"] == "ProxmoxCluster")
        .expect("ProxmoxCluster");
    let zones: BTreeSet<&str> = cluster["spec"]["zoneConfig"]
        .as_array()
        .expect("zones")
        .iter()
        .filter_map(|z| z["zone"].as_str())
        .collect();
    let pinned: BTreeSet<&str> = objects
        .iter()
        .filter(|o| o["kind"] == "MachineDeployment")
        .filter_map(|o| o["spec"]["template"]["spec"]["failureDomain"].as_str())
        .collect();
    assert_eq!(zones, pinned);
    assert_eq!(zones.len(), 3);
}

/// A temporary directory removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    /// `capmox-<tag>-<process id>` in the system's temporary directory.
    fn new(tag: &str) -> Self {
        Self::at(std::env::temp_dir().join(format!("capmox-{tag}-{}", std::process::id())))
    }

    fn at(path: PathBuf) -> Self {
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).expect("create a temporary directory");
        Self(path)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn release_manifests_run_the_image_given_as_img() {
    let out = TempDir::new("release-img");
    run_ok(
        tool("make")
            .args(["--no-print-directory", "release-manifests"])
            .arg("IMG=example.org/capmox:dev")
            .arg(format!("OUT={}", out.0.display())),
        "make release-manifests IMG=example.org/capmox:dev",
    );
    let text = std::fs::read_to_string(out.0.join("infrastructure-components.yaml"))
        .expect("infrastructure-components.yaml written");
    let images: Vec<String> = documents(&text)
        .iter()
        .filter(|o| o["kind"] == "Deployment")
        .flat_map(|d| {
            d["spec"]["template"]["spec"]["containers"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .map(|c| c["image"].as_str().unwrap_or_default().to_owned())
        .collect();
    assert_eq!(images, ["example.org/capmox:dev"]);
}

/// The source paths of the `COPY` lines of the Dockerfile's build stage, each with where it
/// lands relative to the build's working directory.
fn build_stage_copies(dockerfile: &str) -> Vec<(String, String)> {
    let mut copies = Vec::new();
    let mut stages = 0;
    for line in dockerfile.lines().map(str::trim) {
        if line.starts_with("FROM ") {
            stages += 1;
        }
        let Some(arguments) = line.strip_prefix("COPY ") else {
            continue;
        };
        if stages != 1 || arguments.starts_with("--") {
            continue;
        }
        let words: Vec<&str> = arguments.split_whitespace().collect();
        let (destination, sources) = words.split_last().expect("COPY <source>... <destination>");
        for source in sources {
            let target = if destination.ends_with('/') {
                format!("{destination}{source}")
            } else {
                (*destination).to_owned()
            };
            copies.push(((*source).to_owned(), target));
        }
    }
    copies
}

/// Copies a file or a directory tree, keeping modification times so that cargo finds a
/// previous check of the same copy fresh.
fn copy_tree(from: &Path, to: &Path) {
    if from.is_dir() {
        std::fs::create_dir_all(to).expect("create a directory");
        for entry in std::fs::read_dir(from).expect("read a directory") {
            let entry = entry.expect("directory entry");
            copy_tree(&entry.path(), &to.join(entry.file_name()));
        }
    } else {
        std::fs::copy(from, to).unwrap_or_else(|e| panic!("cannot copy {}: {e}", from.display()));
        let modified = std::fs::metadata(from)
            .and_then(|m| m.modified())
            .expect("modification time");
        std::fs::File::options()
            .write(true)
            .open(to)
            .and_then(|f| f.set_modified(modified))
            .expect("keep the modification time");
    }
}

#[test]
fn the_dockerfile_build_context_builds_the_binary() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dockerfile = std::fs::read_to_string(root.join("Dockerfile")).expect("Dockerfile");
    assert!(
        dockerfile.contains("--bin capmox"),
        "the image builds the capmox binary"
    );
    let copies = build_stage_copies(&dockerfile);
    assert!(copies.len() >= 2, "COPY lines found: {copies:?}");
    // The repository's own target directory, so what is already built is reused.
    let metadata = run_ok(
        cargo().args(["metadata", "--format-version=1", "--no-deps", "--offline"]),
        "cargo metadata",
    );
    let metadata: Value = serde_json::from_slice(&metadata.stdout).expect("metadata is JSON");
    let target_directory = metadata["target_directory"]
        .as_str()
        .expect("target_directory");
    // The copy sits at the same path on every run (one per checkout), so cargo reuses its
    // previous check unless a source changed.
    let checkout = {
        use std::hash::{Hash, Hasher};
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        root.hash(&mut hasher);
        hasher.finish()
    };
    let context =
        TempDir::at(Path::new(target_directory).join(format!("docker-context-{checkout:016x}")));
    for (source, target) in &copies {
        copy_tree(&root.join(source), &context.0.join(target));
    }
    run_ok(
        cargo()
            .args([
                "check",
                "--locked",
                "--offline",
                "--quiet",
                "--bin",
                "capmox",
            ])
            .arg("--manifest-path")
            .arg(context.0.join("Cargo.toml"))
            .env("CARGO_TARGET_DIR", target_directory),
        &format!("cargo check of the Dockerfile's build context (COPY lines {copies:?})"),
    );
}
