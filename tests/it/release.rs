//! The clusterctl release files (`make release-manifests` writes them to `out/`) follow
//! clusterctl's rules, `IMG=` sets the manager's image, the cluster templates produce objects
//! the CRDs accept, and the Dockerfile's build stage copies everything the build needs.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::common::{TEMPLATE_VALUES, cargo, run_ok, substitute, tool};

mod cluster_class_rules;
mod go_flavors;

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
    serde_norway::Deserializer::from_str(text)
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
        serde_norway::from_str(&read_out("metadata.yaml")).expect("metadata parses");
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
        "CAPMOX_GLOBAL_CREDENTIALS_NAMESPACES",
        "CAPMOX_ALLOWED_PROXMOX_URLS",
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

#[test]
fn two_replicas_a_disruption_budget_and_a_network_policy_keep_the_webhooks_answering() {
    let objects = components();
    let deployment = objects
        .iter()
        .find(|o| o["kind"] == "Deployment")
        .expect("a Deployment");
    assert_eq!(
        deployment["spec"]["replicas"], 2,
        "one replica leaves failurePolicy: Fail webhooks unanswered while it restarts"
    );
    let pod_labels = &deployment["spec"]["template"]["metadata"]["labels"];
    let selects_the_manager = |selector: &Value| {
        let labels = selector["matchLabels"].as_object().expect("matchLabels");
        !labels.is_empty() && labels.iter().all(|(key, value)| &pod_labels[key] == value)
    };
    let budgets: Vec<&Value> = objects
        .iter()
        .filter(|o| o["kind"] == "PodDisruptionBudget")
        .collect();
    assert_eq!(budgets.len(), 1, "one PodDisruptionBudget");
    assert!(selects_the_manager(&budgets[0]["spec"]["selector"]));
    assert_eq!(budgets[0]["spec"]["minAvailable"], 1);

    let policies: Vec<&Value> = objects
        .iter()
        .filter(|o| o["kind"] == "NetworkPolicy")
        .collect();
    assert_eq!(policies.len(), 1, "one NetworkPolicy");
    let policy = &policies[0]["spec"];
    assert!(selects_the_manager(&policy["podSelector"]));
    assert_eq!(policy["policyTypes"], serde_json::json!(["Ingress"]));
    let container_ports: BTreeSet<&str> =
        deployment["spec"]["template"]["spec"]["containers"][0]["ports"]
            .as_array()
            .expect("ports")
            .iter()
            .filter_map(|p| p["name"].as_str())
            .collect();
    let rules = policy["ingress"].as_array().expect("ingress rules");
    let open_to = |port: &str| -> Vec<&Value> {
        assert!(
            container_ports.contains(port),
            "the container names no port {port}"
        );
        rules
            .iter()
            .filter(|rule| {
                rule["ports"]
                    .as_array()
                    .is_some_and(|ports| ports.iter().any(|p| p["port"] == port))
            })
            .collect()
    };
    let webhook = open_to("webhook-server");
    assert!(
        webhook.iter().any(|rule| rule.get("from").is_none()),
        "the API server calls the webhook from its host: no selector matches it"
    );
    let metrics = open_to("metrics");
    assert!(
        !metrics.is_empty() && metrics.iter().all(|rule| rule["from"].is_array()),
        "metrics are served only to selected namespaces: {metrics:?}"
    );
    // Every listener takes both address families.
    let args = manager_run_args(&deployment["spec"]["template"]["spec"]["containers"][0]);
    for address in [
        args.metrics_bind_address,
        args.health_probe_bind_address,
        args.webhook_bind_address,
    ] {
        assert_eq!(address.ip(), std::net::Ipv6Addr::UNSPECIFIED, "{address}");
    }
}

/// The one object of `kind` named `name` in `namespace`.
fn find<'a>(objects: &'a [Value], kind: &str, namespace: &str, name: &str) -> &'a Value {
    let found: Vec<&Value> = objects
        .iter()
        .filter(|o| {
            o["kind"] == kind
                && o["metadata"]["namespace"] == namespace
                && o["metadata"]["name"] == name
        })
        .collect();
    assert_eq!(
        found.len(),
        1,
        "expected one {kind} {namespace}/{name} in the components"
    );
    found[0]
}

/// The `capmox run` flags the manager container passes.
fn manager_run_args(manager: &Value) -> capmox::cli::RunArgs {
    let mut command = vec!["capmox".to_owned()];
    command.extend(
        manager["args"]
            .as_array()
            .expect("args")
            .iter()
            .filter_map(|a| a.as_str().map(str::to_owned)),
    );
    let cli = <capmox::cli::Cli as clap::Parser>::try_parse_from(&command)
        .unwrap_or_else(|e| panic!("capmox rejects the Deployment's args: {e}"));
    match cli.command {
        capmox::cli::Command::Run(args) => *args,
        other => panic!("the manager runs {other:?}, not `capmox run`"),
    }
}

/// The CRDs convert through the webhook Service of the same release, the Service reaches the
/// manager's webhook port, cert-manager issues the Service's certificate into the Secret the
/// manager mounts at its `--webhook-cert-dir`, and injects that certificate's CA into the CRDs.
#[test]
fn the_conversion_webhook_is_wired_to_its_service_and_certificate() {
    let objects = components();
    let deployment = objects
        .iter()
        .find(|o| o["kind"] == "Deployment")
        .expect("a Deployment");
    let namespace = deployment["metadata"]["namespace"]
        .as_str()
        .expect("namespaced");
    let pod = &deployment["spec"]["template"];
    let manager = &pod["spec"]["containers"][0];
    let run = manager_run_args(manager);
    assert!(!run.disable_webhook, "the release serves the webhook");

    // Each CRD names the webhook Service and the Certificate whose CA is injected.
    let crds: Vec<&Value> = objects
        .iter()
        .filter(|o| o["kind"] == "CustomResourceDefinition")
        .collect();
    assert_eq!(crds.len(), 4);
    let mut services = BTreeSet::new();
    let mut certificates = BTreeSet::new();
    for crd in &crds {
        let name = crd["metadata"]["name"].as_str().unwrap_or_default();
        let conversion = &crd["spec"]["conversion"];
        assert_eq!(conversion["strategy"], "Webhook", "{name}");
        assert_eq!(
            conversion["webhook"]["conversionReviewVersions"],
            serde_json::json!(["v1"]),
            "{name}"
        );
        let service = &conversion["webhook"]["clientConfig"]["service"];
        assert_eq!(service["path"], capmox::webhook::CONVERT_PATH, "{name}");
        services.insert((
            service["namespace"]
                .as_str()
                .expect("a namespace")
                .to_owned(),
            service["name"].as_str().expect("a name").to_owned(),
            service["port"].as_u64().unwrap_or(443),
        ));
        let inject = crd["metadata"]["annotations"]["cert-manager.io/inject-ca-from"]
            .as_str()
            .unwrap_or_else(|| panic!("{name} lacks cert-manager.io/inject-ca-from"));
        let (ns, certificate) = inject.split_once('/').expect("namespace/name");
        certificates.insert((ns.to_owned(), certificate.to_owned()));
    }
    assert_eq!(services.len(), 1, "one webhook Service: {services:?}");
    assert_eq!(certificates.len(), 1, "one Certificate: {certificates:?}");
    let (service_namespace, service_name, service_port) = services.into_iter().next().expect("one");
    assert_eq!(service_namespace, namespace);
    assert_eq!(
        service_name, "capmox-webhook-service",
        "the name the README and clusterctl users see"
    );

    // The Service exists, selects the manager pod and forwards to its webhook port, which is
    // where `--webhook-bind-address` listens.
    let service = find(&objects, "Service", &service_namespace, &service_name);
    let selector = service["spec"]["selector"].as_object().expect("a selector");
    assert!(!selector.is_empty());
    for (key, value) in selector {
        assert_eq!(
            &pod["metadata"]["labels"][key], value,
            "the Service selects {key}={value}, the manager pod is not labelled so"
        );
    }
    let port = service["spec"]["ports"]
        .as_array()
        .expect("ports")
        .iter()
        .find(|p| p["port"].as_u64() == Some(service_port))
        .unwrap_or_else(|| panic!("the Service has no port {service_port}"));
    let target = port["targetPort"].as_str().expect("a named targetPort");
    let container_port = manager["ports"]
        .as_array()
        .expect("container ports")
        .iter()
        .find(|p| p["name"] == target)
        .unwrap_or_else(|| panic!("the manager has no port named {target}"));
    assert_eq!(
        container_port["containerPort"].as_u64(),
        Some(u64::from(run.webhook_bind_address.port())),
        "the webhook listens on --webhook-bind-address"
    );
    assert!(run.webhook_bind_address.ip().is_unspecified());

    // The Certificate exists, is issued by an Issuer of the release, names the Service, and its
    // Secret is mounted where the manager reads its certificate.
    let (certificate_namespace, certificate_name) = certificates.into_iter().next().expect("one");
    let certificate = find(
        &objects,
        "Certificate",
        &certificate_namespace,
        &certificate_name,
    );
    assert_eq!(certificate["apiVersion"], "cert-manager.io/v1");
    let issuer = &certificate["spec"]["issuerRef"];
    assert_eq!(issuer["kind"], "Issuer");
    let issuer_name = issuer["name"].as_str().expect("an issuer name");
    let issuer = find(&objects, "Issuer", &certificate_namespace, issuer_name);
    assert_eq!(issuer["apiVersion"], "cert-manager.io/v1");
    assert!(issuer["spec"]["selfSigned"].is_object(), "{issuer}");
    let dns_names: Vec<&str> = certificate["spec"]["dnsNames"]
        .as_array()
        .expect("dnsNames")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(
        dns_names,
        [
            format!("{service_name}.{service_namespace}.svc"),
            format!("{service_name}.{service_namespace}.svc.cluster.local"),
        ]
    );
    let secret = certificate["spec"]["secretName"]
        .as_str()
        .expect("a secretName");
    let volume = pod["spec"]["volumes"]
        .as_array()
        .expect("volumes")
        .iter()
        .find(|v| v["secret"]["secretName"] == secret)
        .unwrap_or_else(|| panic!("no volume of Secret {secret}"));
    let mount = manager["volumeMounts"]
        .as_array()
        .expect("volumeMounts")
        .iter()
        .find(|m| m["name"] == volume["name"])
        .unwrap_or_else(|| panic!("the manager does not mount the Secret {secret}"));
    assert_eq!(mount["readOnly"], true);
    assert_eq!(
        mount["mountPath"].as_str().map(std::path::Path::new),
        Some(run.webhook_cert_dir.as_path()),
        "the Secret is mounted at --webhook-cert-dir"
    );
}

/// The validating webhook reaches the same Service and trusts the same Certificate as the CRDs'
/// conversion, on the Go provider's paths, for each kind on create and update.
#[test]
fn the_validating_webhook_is_wired_to_its_service_and_certificate() {
    let objects = components();
    let configurations: Vec<&Value> = objects
        .iter()
        .filter(|o| o["kind"] == "ValidatingWebhookConfiguration")
        .collect();
    assert_eq!(configurations.len(), 1);
    let configuration = configurations[0];
    assert_eq!(
        configuration["apiVersion"],
        "admissionregistration.k8s.io/v1"
    );
    let crds: Vec<&Value> = objects
        .iter()
        .filter(|o| o["kind"] == "CustomResourceDefinition")
        .collect();
    let crd_service = &crds[0]["spec"]["conversion"]["webhook"]["clientConfig"]["service"];
    let crd_inject = &crds[0]["metadata"]["annotations"]["cert-manager.io/inject-ca-from"];
    let inject = configuration["metadata"]["annotations"]["cert-manager.io/inject-ca-from"]
        .as_str()
        .expect("cert-manager.io/inject-ca-from");
    assert_eq!(inject, crd_inject, "the CRDs' Certificate");
    let (namespace, certificate) = inject.split_once('/').expect("namespace/name");
    find(&objects, "Certificate", namespace, certificate);

    let webhooks = configuration["webhooks"].as_array().expect("webhooks");
    let mut kinds = Vec::new();
    for webhook in webhooks {
        let name = webhook["name"].as_str().expect("a name");
        assert_eq!(webhook["failurePolicy"], "Fail", "{name}");
        assert_eq!(webhook["sideEffects"], "None", "{name}");
        assert_eq!(webhook["matchPolicy"], "Equivalent", "{name}");
        assert_eq!(
            webhook["admissionReviewVersions"],
            serde_json::json!(["v1"]),
            "{name}"
        );
        let service = &webhook["clientConfig"]["service"];
        assert_eq!(service["namespace"], crd_service["namespace"], "{name}");
        assert_eq!(service["name"], crd_service["name"], "{name}");
        assert_eq!(service["port"].as_u64().unwrap_or(443), 443, "{name}");
        find(
            &objects,
            "Service",
            service["namespace"].as_str().expect("a namespace"),
            service["name"].as_str().expect("a name"),
        );
        let path = service["path"].as_str().expect("a path");
        let kind = capmox::webhook::admission::kind_of_path(path)
            .unwrap_or_else(|| panic!("{name}: capmox does not serve {path}"));
        assert_eq!(
            name,
            format!(
                "validation.{}.infrastructure.cluster.x-k8s.io",
                kind.to_ascii_lowercase()
            ),
            "the Go provider's webhook name"
        );
        let plural = crds
            .iter()
            .find(|c| c["spec"]["names"]["kind"] == kind)
            .map(|c| c["spec"]["names"]["plural"].clone())
            .unwrap_or_else(|| panic!("no CRD of {kind}"));
        assert_eq!(
            webhook["rules"],
            serde_json::json!([{
                "apiGroups": [capmox::api::GROUP],
                "apiVersions": [capmox::api::VERSION],
                "operations": ["CREATE", "UPDATE"],
                "resources": [plural],
            }]),
            "{name}"
        );
        kinds.push(kind);
    }
    kinds.sort_unstable();
    assert_eq!(kinds, capmox::webhook::admission::VALIDATED_KINDS);
}

/// What the release's templates create passes the validating webhook too.
#[test]
fn template_objects_pass_the_validating_webhook() {
    use capmox::api::validation;
    let mut checked = 0;
    for template in TEMPLATES.iter().chain(CLUSTER_CLASSES) {
        for object in rendered(template) {
            let errors = match object["kind"].as_str() {
                Some("ProxmoxCluster") => {
                    let typed: capmox::api::ProxmoxCluster =
                        serde_json::from_value(object.clone()).expect("a ProxmoxCluster");
                    validation::cluster_spec(&typed.spec, "spec")
                }
                Some("ProxmoxClusterTemplate") => {
                    let typed: capmox::api::ProxmoxClusterTemplate =
                        serde_json::from_value(object.clone()).expect("a ProxmoxClusterTemplate");
                    validation::cluster_spec(&typed.spec.template.spec, "spec.template.spec")
                }
                Some("ProxmoxMachineTemplate") => {
                    let typed: capmox::api::ProxmoxMachineTemplate =
                        serde_json::from_value(object.clone()).expect("a ProxmoxMachineTemplate");
                    // What its ProxmoxMachines get checked for.
                    validation::machine_spec(&typed.spec.template.spec, "spec")
                }
                _ => continue,
            };
            assert!(
                errors.is_empty(),
                "{template}: {} {}: {errors:#?}",
                object["kind"],
                object["metadata"]["name"]
            );
            checked += 1;
        }
    }
    assert!(checked >= 10, "only {checked} objects checked");
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
        watch_filter: None,
        cluster_concurrency: 1,
        machine_concurrency: 1,
        webhook: None,
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

/// Every `${VAR}` of a template, without defaults (`$${VAR}` is a literal, not a variable).
fn variables(text: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let mut rest = text;
    while let Some(start) = rest.find("${") {
        let end = rest[start..].find('}').expect("closing brace") + start;
        if start == 0 || rest.as_bytes()[start - 1] != b'$' {
            let expr = &rest[start + 2..end];
            let name = expr.split([':', '=']).next().unwrap_or(expr);
            found.insert(name.to_owned());
        }
        rest = &rest[end + 1..];
    }
    found
}

/// The cluster templates (`clusterctl generate cluster [--flavor <flavor>]`).
const TEMPLATES: &[&str] = &[
    "cluster-template.yaml",
    "cluster-template-failure-domains.yaml",
    "cluster-template-external-creds.yaml",
    "cluster-template-proxmox-labels.yaml",
    "cluster-template-dual-stack.yaml",
    "cluster-template-multiple-vlans.yaml",
    "cluster-template-flatcar.yaml",
    "cluster-template-auto-image.yaml",
    "cluster-template-topology.yaml",
];

/// The ClusterClasses, named `clusterclass-<class name>.yaml` as clusterctl looks them up.
const CLUSTER_CLASSES: &[&str] = &["clusterclass-capmox.yaml"];

/// Kubernetes' own kinds a template may hold; they have no CRD to validate against.
const BUILTIN_KINDS: &[&str] = &["Secret"];

/// A template's objects with the test values substituted.
fn rendered(template: &str) -> Vec<Value> {
    documents(&substitute(&read_out(template), TEMPLATE_VALUES))
}

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
        let flavor = template
            .strip_prefix("cluster-template-")
            .and_then(|f| f.strip_suffix(".yaml"));
        if let Some(flavor) = flavor
            && !readme.contains(&format!("--flavor {flavor}"))
        {
            undocumented.push(format!("{template}: how to use `--flavor {flavor}`"));
        }
    }
    assert!(
        undocumented.is_empty(),
        "README.md does not document: {undocumented:#?}"
    );
}

/// The README section under `heading` (a whole heading line), up to the next heading of its
/// level or above.
fn readme_section<'a>(readme: &'a str, heading: &str) -> &'a str {
    let start = readme
        .find(&format!("\n{heading}\n"))
        .unwrap_or_else(|| panic!("README.md has no section {heading:?}"))
        + 1;
    let level = heading.chars().take_while(|c| *c == '#').count();
    let body = &readme[start + heading.len()..];
    let end = body
        .match_indices("\n#")
        .find(|(at, _)| {
            let hashes = body[at + 1..].chars().take_while(|c| *c == '#').count();
            hashes <= level && body[at + 1 + hashes..].starts_with(' ')
        })
        .map_or(body.len(), |(at, _)| at);
    &body[..end]
}

/// Cluster API keeps Ignition bootstrap data and managed topologies behind feature gates, whose
/// real webhooks refuse a flavor that needs them: the README says how to turn them on.
#[test]
fn the_readme_names_the_feature_gates_flavors_need() {
    let readme = std::fs::read_to_string("README.md").expect("README.md");
    let mut missing = Vec::new();
    for template in TEMPLATES.iter().chain(CLUSTER_CLASSES) {
        let objects = rendered(template);
        let ignition = objects.iter().any(|o| {
            o["spec"]["kubeadmConfigSpec"]["format"] == "ignition"
                || o["spec"]["template"]["spec"]["format"] == "ignition"
        });
        let topology = objects
            .iter()
            .any(|o| o["kind"] == "ClusterClass" || o["spec"].get("topology").is_some());
        let needs = [
            (
                ignition,
                "## Flatcar / Ignition",
                "EXP_KUBEADM_BOOTSTRAP_FORMAT_IGNITION=true clusterctl init",
            ),
            (
                topology,
                "### Cluster templates",
                "CLUSTER_TOPOLOGY=true clusterctl init",
            ),
        ];
        for (needed, heading, how) in needs {
            if needed && !readme_section(&readme, heading).contains(how) {
                missing.push(format!("{template}: `{how}` under {heading:?}"));
            }
        }
    }
    assert!(missing.is_empty(), "README.md does not say: {missing:#?}");
}

#[test]
fn the_release_ships_every_template_and_cluster_class() {
    let mut sources: Vec<String> = std::fs::read_dir("templates")
        .expect("templates/")
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .collect();
    sources.sort();
    let mut listed: Vec<String> = TEMPLATES
        .iter()
        .chain(CLUSTER_CLASSES)
        .map(|t| (*t).to_owned())
        .collect();
    listed.sort();
    assert_eq!(sources, listed, "templates/ and the lists the tests check");
    for file in &listed {
        let source = std::fs::read_to_string(Path::new("templates").join(file)).expect("readable");
        assert_eq!(read_out(file), source, "out/{file} is not templates/{file}");
    }
    for file in CLUSTER_CLASSES {
        let text = read_out(file);
        assert!(
            variables(&text).is_empty() && !text.contains("$${"),
            "{file}: clusterctl wants ClusterClass files without variables"
        );
        let objects = documents(&text);
        let classes: Vec<&Value> = objects
            .iter()
            .filter(|o| o["kind"] == "ClusterClass")
            .collect();
        assert_eq!(classes.len(), 1, "{file}: one ClusterClass");
        let name = classes[0]["metadata"]["name"].as_str().expect("a name");
        assert_eq!(*file, format!("clusterclass-{name}.yaml"));
        for object in &objects {
            assert!(
                object["metadata"].get("namespace").is_none(),
                "{file}: {} {} names a namespace",
                object["kind"],
                object["metadata"]["name"]
            );
        }
    }
}

/// The schema for an object's kind and version: capmox's CRDs or the upstream ones.
fn schema_for(object: &Value) -> Option<Value> {
    let kind = object["kind"].as_str()?;
    let version = object["apiVersion"].as_str()?.rsplit('/').next()?;
    schema_of(kind, version)
}

fn schema_of(kind: &str, version: &str) -> Option<Value> {
    let mut files: Vec<std::path::PathBuf> = std::fs::read_dir("crds")
        .ok()?
        .map(|e| e.ok().map(|e| e.path()))
        .collect::<Option<_>>()?;
    let upstream = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/external-crds");
    for dir in [upstream.to_owned(), format!("{upstream}/template-kinds")] {
        files.extend(
            std::fs::read_dir(&dir)
                .unwrap_or_else(|e| panic!("cannot read {dir}: {e}"))
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "yaml")),
        );
    }
    files.into_iter().find_map(|file| {
        let crd: Value = serde_norway::from_str(&std::fs::read_to_string(&file).ok()?).ok()?;
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

/// Validates an object against its CRD, as the API server would on create; returns it defaulted.
fn validated(file: &str, object: &Value) -> Value {
    let kind = object["kind"].as_str().unwrap_or_default();
    let schema = schema_for(object)
        .unwrap_or_else(|| panic!("{file}: no CRD serves {kind} {}", object["apiVersion"]));
    capmox_testkit::schema::validate_object(&schema, object, None).unwrap_or_else(|violations| {
        panic!(
            "{file}: {kind} {}: {violations:#?}",
            object["metadata"]["name"]
        )
    })
}

/// Reads a Proxmox object into capmox's own types, which must take every field the template sets.
fn read_as_capmox(file: &str, object: &Value) {
    /// Without empty lists, which capmox's types leave out.
    fn pruned(value: &Value) -> Value {
        match value {
            Value::Object(map) => Value::Object(
                map.iter()
                    .filter(|(_, v)| v.as_array().is_none_or(|a| !a.is_empty()))
                    .map(|(k, v)| (k.clone(), pruned(v)))
                    .collect(),
            ),
            Value::Array(items) => Value::Array(items.iter().map(pruned).collect()),
            other => other.clone(),
        }
    }
    fn same<T: serde::de::DeserializeOwned + serde::Serialize>(file: &str, object: &Value) {
        let typed: T = serde_json::from_value(object.clone())
            .unwrap_or_else(|e| panic!("{file}: {} does not read: {e}", object["kind"]));
        let back = serde_json::to_value(&typed).expect("serializes");
        assert_eq!(
            pruned(&back["spec"]),
            pruned(&object["spec"]),
            "{file}: {} {} loses fields in capmox's types",
            object["kind"],
            object["metadata"]["name"]
        );
    }
    match object["kind"].as_str() {
        Some("ProxmoxCluster") => same::<capmox::api::ProxmoxCluster>(file, object),
        Some("ProxmoxClusterTemplate") => same::<capmox::api::ProxmoxClusterTemplate>(file, object),
        Some("ProxmoxMachine") => same::<capmox::api::ProxmoxMachine>(file, object),
        Some("ProxmoxMachineTemplate") => same::<capmox::api::ProxmoxMachineTemplate>(file, object),
        _ => {}
    }
}

#[test]
fn template_objects_are_valid_against_the_crds() {
    let mut validated_kinds = BTreeSet::new();
    for template in TEMPLATES.iter().chain(CLUSTER_CLASSES) {
        for object in rendered(template) {
            let kind = object["kind"].as_str().unwrap_or_default().to_owned();
            assert_eq!(
                object["apiVersion"]
                    .as_str()
                    .is_some_and(|v| v.contains('/')),
                !BUILTIN_KINDS.contains(&kind.as_str()),
                "{template}: {kind} has an unexpected apiVersion {}",
                object["apiVersion"]
            );
            if BUILTIN_KINDS.contains(&kind.as_str()) {
                continue;
            }
            validated(template, &object);
            read_as_capmox(template, &object);
            validated_kinds.insert(kind);
        }
    }
    for kind in [
        "Cluster",
        "ClusterClass",
        "ProxmoxCluster",
        "ProxmoxClusterTemplate",
        "KubeadmControlPlane",
        "KubeadmControlPlaneTemplate",
        "KubeadmConfigTemplate",
        "ProxmoxMachineTemplate",
        "MachineDeployment",
        "InClusterIPPool",
    ] {
        assert!(
            validated_kinds.contains(kind),
            "no {kind} was validated (found {validated_kinds:?})"
        );
    }
}

/// The objects of one kind in a rendered template.
fn of_kind<'a>(objects: &'a [Value], kind: &str) -> Vec<&'a Value> {
    objects.iter().filter(|o| o["kind"] == kind).collect()
}

/// The object of a kind and name in a rendered template.
fn named<'a>(objects: &'a [Value], kind: &str, name: &Value) -> &'a Value {
    objects
        .iter()
        .find(|o| o["kind"] == kind && &o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name} in the template"))
}

/// The single ProxmoxCluster of a rendered template, defaulted by its CRD.
fn proxmox_cluster(file: &str, objects: &[Value]) -> Value {
    let clusters = of_kind(objects, "ProxmoxCluster");
    assert_eq!(clusters.len(), 1, "{file}: one ProxmoxCluster");
    validated(file, clusters[0])
}

/// A group of machines a template asks for: the owner, its ProxmoxMachineTemplate and the
/// failure domains its machines may get.
struct MachineGroup {
    owner: String,
    template: Value,
    failure_domains: Vec<Option<String>>,
}

/// The machine groups of a template: the control plane (in each control-plane failure domain)
/// and every MachineDeployment (in its own).
fn machine_groups(file: &str, objects: &[Value], cluster: &Value) -> Vec<MachineGroup> {
    let typed = typed_cluster(file, cluster);
    let control_plane_domains: Vec<Option<String>> = {
        let domains: Vec<Option<String>> = typed
            .status
            .iter()
            .flat_map(|s| &s.failure_domains)
            .filter(|d| d.control_plane == Some(true))
            .map(|d| Some(d.name.clone()))
            .collect();
        if domains.is_empty() {
            vec![None]
        } else {
            domains
        }
    };
    let mut groups = Vec::new();
    for kcp in of_kind(objects, "KubeadmControlPlane") {
        let reference = &kcp["spec"]["machineTemplate"]["spec"]["infrastructureRef"];
        groups.push(MachineGroup {
            owner: format!("KubeadmControlPlane {}", kcp["metadata"]["name"]),
            template: named(objects, "ProxmoxMachineTemplate", &reference["name"]).clone(),
            failure_domains: control_plane_domains.clone(),
        });
    }
    for deployment in of_kind(objects, "MachineDeployment") {
        let spec = &deployment["spec"]["template"]["spec"];
        groups.push(MachineGroup {
            owner: format!("MachineDeployment {}", deployment["metadata"]["name"]),
            template: named(
                objects,
                "ProxmoxMachineTemplate",
                &spec["infrastructureRef"]["name"],
            )
            .clone(),
            failure_domains: vec![spec["failureDomain"].as_str().map(str::to_owned)],
        });
    }
    groups
}

/// The ProxmoxCluster in capmox's types, with the failure domains capmox would publish.
fn typed_cluster(file: &str, cluster: &Value) -> capmox::api::ProxmoxCluster {
    let mut typed: capmox::api::ProxmoxCluster =
        serde_json::from_value(cluster.clone()).expect("a ProxmoxCluster");
    let domains = capmox::placement::failure_domains(&typed)
        .unwrap_or_else(|e| panic!("{file}: capmox refuses the zones: {e}"));
    typed
        .status
        .get_or_insert_with(Default::default)
        .failure_domains = domains;
    typed
}

/// Where capmox places each machine of each group (one per failure domain), as the machine
/// controller resolves it.
fn placements(
    file: &str,
    cluster: &Value,
    groups: &[MachineGroup],
) -> Vec<(String, capmox::placement::Placement)> {
    let typed = typed_cluster(file, cluster);
    let cluster_name = cluster["metadata"]["name"].as_str().expect("named");
    let mut out = Vec::new();
    for group in groups {
        let template = validated(file, &group.template);
        for (index, failure_domain) in group.failure_domains.iter().enumerate() {
            let name = format!("{cluster_name}-machine-{index}");
            let machine: capmox::api::ProxmoxMachine = serde_json::from_value(serde_json::json!({
                "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha2",
                "kind": "ProxmoxMachine",
                "metadata": {"name": name, "namespace": "default"},
                "spec": template["spec"]["template"]["spec"],
            }))
            .expect("a ProxmoxMachine");
            let capi_machine: capmox::capi::Machine = serde_json::from_value(serde_json::json!({
                "apiVersion": "cluster.x-k8s.io/v1beta2",
                "kind": "Machine",
                "metadata": {"name": name, "namespace": "default"},
                "spec": {"clusterName": cluster_name, "failureDomain": failure_domain},
            }))
            .expect("a Machine");
            let placement = capmox::placement::Placement::resolve(&typed, &machine, &capi_machine)
                .unwrap_or_else(|e| {
                    panic!(
                        "{file}: capmox cannot place a machine of {} in {failure_domain:?}: {e}",
                        group.owner
                    )
                });
            out.push((group.owner.clone(), placement));
        }
    }
    out
}

/// The pools a NIC of a placement claims from, by name.
fn pools_of(placement: &capmox::placement::Placement, nic: &str) -> Vec<String> {
    placement
        .network_devices()
        .iter()
        .find(|n| n.name == nic)
        .unwrap_or_else(|| panic!("no {nic} on {}", placement.machine_name()))
        .pools
        .iter()
        .map(|p| p.pool.name.clone())
        .collect()
}

/// The objects a flavor gives the management cluster: the rendered template, or for the topology
/// flavor what Cluster API makes of its Cluster with the ClusterClass.
fn flavor_objects(template: &str) -> Vec<Value> {
    if template == "cluster-template-topology.yaml" {
        topology_objects()
    } else {
        rendered(template)
    }
}

/// Every flavor's machines can be placed by capmox, in every failure domain they may get.
#[test]
fn capmox_places_every_machine_of_every_flavor() {
    for template in TEMPLATES {
        let objects = flavor_objects(template);
        let cluster = proxmox_cluster(template, &objects);
        let groups = machine_groups(template, &objects, &cluster);
        assert!(groups.len() >= 2, "{template}: a control plane and workers");
        let placed = placements(template, &cluster, &groups);
        for (owner, placement) in &placed {
            assert!(
                !pools_of(placement, "net0").is_empty(),
                "{template}: {owner}: net0 claims no address"
            );
        }
    }
}

#[test]
fn the_failure_domain_flavor_pins_one_deployment_per_zone() {
    let objects = rendered("cluster-template-failure-domains.yaml");
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

#[test]
fn the_external_creds_flavor_gives_the_cluster_a_secret_capmox_accepts() {
    let file = "cluster-template-external-creds.yaml";
    let objects = rendered(file);
    let cluster = proxmox_cluster(file, &objects);
    let reference = &cluster["spec"]["credentialsRef"];
    assert!(
        reference.get("namespace").is_none(),
        "the Secret is in the cluster's namespace"
    );
    let secret = named(&objects, "Secret", &reference["name"]);
    let data: std::collections::BTreeMap<String, k8s_openapi::ByteString> = secret["stringData"]
        .as_object()
        .expect("stringData")
        .iter()
        .map(|(k, v)| {
            let text = v.as_str().unwrap_or_else(|| panic!("{k} is not a string"));
            (k.clone(), k8s_openapi::ByteString(text.as_bytes().to_vec()))
        })
        .collect();
    let config = capmox::controller::credentials::from_secret_data("default", "creds", &data)
        .unwrap_or_else(|e| panic!("capmox refuses the flavor's Secret: {e}"));
    assert_eq!(config.url, "https://pve.example:8006");
    assert!(!config.tls.insecure, "TLS is verified unless asked not to");
    assert!(config.tls.fingerprints.is_empty());
}

#[test]
fn the_dual_stack_flavor_gives_every_machine_an_ipv4_and_an_ipv6_address() {
    let file = "cluster-template-dual-stack.yaml";
    let objects = rendered(file);
    let cluster = proxmox_cluster(file, &objects);
    assert!(cluster["spec"]["ipv6Config"]["addresses"].is_array());
    for (owner, placement) in placements(file, &cluster, &machine_groups(file, &objects, &cluster))
    {
        assert_eq!(
            pools_of(&placement, "net0"),
            ["demo-v4-icip", "demo-v6-icip"],
            "{owner}"
        );
    }
    let network = &of_kind(&objects, "Cluster")[0]["spec"]["clusterNetwork"];
    for blocks in [
        &network["pods"]["cidrBlocks"],
        &network["services"]["cidrBlocks"],
    ] {
        let families: BTreeSet<bool> = blocks
            .as_array()
            .expect("CIDR blocks")
            .iter()
            .map(|b| b.as_str().expect("a CIDR").contains(':'))
            .collect();
        assert_eq!(families.len(), 2, "both families in {blocks}");
    }
}

#[test]
fn the_multiple_vlans_flavor_puts_a_second_nic_on_its_own_bridge_and_pool() {
    let file = "cluster-template-multiple-vlans.yaml";
    let objects = rendered(file);
    let cluster = proxmox_cluster(file, &objects);
    let pools = of_kind(&objects, "InClusterIPPool");
    assert_eq!(pools.len(), 1);
    let pool = validated(file, pools[0]);
    let pool_name = pool["metadata"]["name"].as_str().expect("named");
    // Equal metrics: the cluster's pool (the default one) keeps the only default route.
    let metric = pool["metadata"]["annotations"]["ipam.capmox.cluster.x-k8s.io/gateway-metric"]
        .as_str()
        .and_then(|m| m.parse::<i64>().ok());
    assert_eq!(metric, cluster["spec"]["ipv4Config"]["metric"].as_i64());
    for (owner, placement) in placements(file, &cluster, &machine_groups(file, &objects, &cluster))
    {
        let nics = placement.network_devices();
        assert_eq!(nics.len(), 2, "{owner}");
        assert_eq!(pools_of(&placement, "net0"), ["demo-v4-icip"], "{owner}");
        assert_eq!(pools_of(&placement, "net1"), [pool_name], "{owner}");
        assert_eq!(nics[1].bridge.as_deref(), Some("vmbr1"), "{owner}");
        assert_eq!(
            nics[1].vlan, None,
            "{owner}: the Go flavor's net1 is untagged"
        );
        assert!(nics[1].pools.iter().all(|p| !p.default_gateway), "{owner}");
    }
}

#[test]
fn the_auto_image_flavor_finds_the_template_by_its_tags() {
    let file = "cluster-template-auto-image.yaml";
    let objects = rendered(file);
    let cluster = proxmox_cluster(file, &objects);
    for (owner, placement) in placements(file, &cluster, &machine_groups(file, &objects, &cluster))
    {
        let capmox::placement::TemplateSource::Tags(selector) = placement.template() else {
            panic!("{owner}: the template is not chosen by tags");
        };
        let text = format!("{selector:?}");
        for tag in ["ubuntu-24.04", "k8s-v1.33"] {
            assert!(text.contains(tag), "{owner}: {tag} missing from {text}");
        }
    }
}

#[test]
fn the_flatcar_flavor_bootstraps_with_ignition() {
    let file = "cluster-template-flatcar.yaml";
    let objects = rendered(file);
    let mut configs: Vec<&Value> = of_kind(&objects, "KubeadmControlPlane")
        .into_iter()
        .map(|k| &k["spec"]["kubeadmConfigSpec"])
        .collect();
    configs.extend(
        of_kind(&objects, "KubeadmConfigTemplate")
            .into_iter()
            .map(|t| &t["spec"]["template"]["spec"]),
    );
    assert_eq!(configs.len(), 2);
    for config in configs {
        assert_eq!(config["format"], "ignition");
        let additional = config["ignition"]["containerLinuxConfig"]["additionalConfig"]
            .as_str()
            .expect("Container Linux Config");
        let clc: Value = serde_norway::from_str(additional).expect("the CLC is YAML");
        assert!(
            clc["systemd"]["units"]
                .to_string()
                .contains("EnvironmentFile=/etc/proxmox-env"),
            "{clc}"
        );
        let provider_id = &config["joinConfiguration"]["nodeRegistration"]["kubeletExtraArgs"][0];
        assert_eq!(provider_id["name"], "provider-id");
        assert_eq!(
            provider_id["value"], "proxmox://${COREOS_CUSTOM_INSTANCE_ID}",
            "left for the machine's envsubst"
        );
    }
    for template in of_kind(&objects, "ProxmoxMachineTemplate") {
        assert_eq!(
            template["spec"]["template"]["spec"]["checks"]["skipCloudInitStatus"], true,
            "Flatcar has no cloud-init to wait for"
        );
    }
}

#[test]
fn the_proxmox_labels_flavor_tags_vms_and_gives_workers_their_role() {
    let file = "cluster-template-proxmox-labels.yaml";
    let objects = rendered(file);
    let deployments = of_kind(&objects, "MachineDeployment");
    assert_eq!(deployments.len(), 1);
    let labels = &deployments[0]["spec"]["template"]["metadata"]["labels"];
    assert_eq!(
        labels["node-role.kubernetes.io/worker"], "",
        "synced to the Nodes"
    );
    assert_eq!(
        deployments[0]["spec"]["replicas"], 2,
        "WORKER_MACHINE_COUNT"
    );
    let cluster = proxmox_cluster(file, &objects);
    assert_eq!(cluster["spec"]["allowedNodes"], serde_json::json!([]));
    for template in of_kind(&objects, "ProxmoxMachineTemplate") {
        let tags = &template["spec"]["template"]["spec"]["tags"];
        let role = if template["metadata"]["name"] == "demo-control-plane" {
            "control-plane"
        } else {
            "worker"
        };
        assert_eq!(
            tags,
            &serde_json::json!(["demo", role]),
            "{}: VMs are tagged with the cluster name and role",
            template["metadata"]["name"]
        );
    }
}

#[test]
fn the_failure_domains_flavor_labels_workers_with_their_zone() {
    let file = "cluster-template-failure-domains.yaml";
    let objects = rendered(file);
    let deployments = of_kind(&objects, "MachineDeployment");
    assert_eq!(deployments.len(), 3);
    for deployment in deployments {
        let spec = &deployment["spec"]["template"]["spec"];
        let zone = spec["failureDomain"].as_str().expect("pinned to a zone");
        let config = named(
            &objects,
            "KubeadmConfigTemplate",
            &spec["bootstrap"]["configRef"]["name"],
        );
        let args = &config["spec"]["template"]["spec"]["joinConfiguration"]["nodeRegistration"]["kubeletExtraArgs"];
        let labels = args
            .as_array()
            .expect("kubelet args")
            .iter()
            .find(|a| a["name"] == "node-labels")
            .and_then(|a| a["value"].as_str())
            .expect("node-labels");
        assert_eq!(labels, format!("topology.kubernetes.io/zone={zone}"));
    }
}

/// The ClusterClass the topology flavor uses, and the objects of its file by kind and name.
fn cluster_class() -> (Value, Vec<Value>) {
    let objects = documents(&read_out("clusterclass-capmox.yaml"));
    let class = of_kind(&objects, "ClusterClass")[0].clone();
    (class, objects)
}

/// The template a ClusterClass `templateRef` names, from the class's file.
fn referenced(objects: &[Value], reference: &Value) -> Value {
    let found = named(
        objects,
        reference["kind"].as_str().expect("kind"),
        &reference["name"],
    );
    assert_eq!(found["apiVersion"], reference["apiVersion"], "{reference}");
    found.clone()
}

/// The class's variables with a Cluster's values (and `overrides` over them), defaulted and
/// validated by their schemas as Cluster API does; panics on an undeclared or missing one.
fn class_variables(
    class: &Value,
    values: &Value,
    overrides: &Value,
) -> serde_json::Map<String, Value> {
    let given: Vec<&Value> = values
        .as_array()
        .into_iter()
        .flatten()
        .chain(overrides.as_array().into_iter().flatten())
        .collect();
    let declared = class["spec"]["variables"].as_array().expect("variables");
    for value in &given {
        assert!(
            declared.iter().any(|d| d["name"] == value["name"]),
            "the Cluster sets {}, which the class does not declare",
            value["name"]
        );
    }
    let mut out = serde_json::Map::new();
    for variable in declared {
        let name = variable["name"].as_str().expect("named");
        let schema = &variable["schema"]["openAPIV3Schema"];
        let value = given
            .iter()
            .rev()
            .find(|v| v["name"] == name)
            .map(|v| v["value"].clone())
            .or_else(|| schema.get("default").cloned());
        let Some(value) = value else {
            assert_ne!(
                variable["required"], true,
                "the Cluster does not set the required variable {name}"
            );
            continue;
        };
        let value = capmox_testkit::schema::validate_object(schema, &value, None)
            .unwrap_or_else(|v| panic!("variable {name}: {v:#?}"));
        out.insert(name.to_owned(), value);
    }
    out
}

/// A variable by dotted path (`vmTemplate.sourceNode`), as `valueFrom.variable` names it.
fn variable<'a>(variables: &'a serde_json::Map<String, Value>, path: &str) -> Option<&'a Value> {
    let mut parts = path.split('.');
    let mut value = variables.get(parts.next()?)?;
    for part in parts {
        value = value.get(part)?;
    }
    Some(value)
}

/// Evaluates the two `enabledIf` forms the class uses, `{{ if .x }}true{{ end }}` and
/// `{{ if not .x }}true{{ end }}`, with Go template truth (empty and zero values are false).
fn enabled(enabled_if: &Value, variables: &serde_json::Map<String, Value>) -> bool {
    let Some(text) = enabled_if.as_str() else {
        return true;
    };
    let condition = text
        .strip_prefix("{{ if ")
        .and_then(|t| t.strip_suffix(" }}true{{ end }}"))
        .unwrap_or_else(|| panic!("enabledIf {text:?} is not a form this test evaluates"));
    let (negated, path) = match condition.strip_prefix("not ") {
        Some(path) => (true, path),
        None => (false, condition),
    };
    let path = path.strip_prefix('.').expect("a variable");
    let truthy = match variable(variables, path) {
        None | Some(Value::Null) | Some(Value::Bool(false)) => false,
        Some(Value::String(s)) => !s.is_empty(),
        Some(Value::Array(a)) => !a.is_empty(),
        Some(Value::Object(o)) => !o.is_empty(),
        Some(Value::Number(n)) => n.as_f64() != Some(0.0),
        Some(Value::Bool(true)) => true,
    };
    truthy != negated
}

/// Which of the class's templates a patch selector's `matchResources` picks.
#[derive(Clone, Copy, PartialEq)]
enum Holder<'a> {
    InfrastructureCluster,
    ControlPlane,
    ControlPlaneMachine,
    Worker(&'a str),
}

fn selects(selector: &Value, template: &Value, holder: Holder) -> bool {
    if selector["apiVersion"] != template["apiVersion"] || selector["kind"] != template["kind"] {
        return false;
    }
    let resources = &selector["matchResources"];
    match holder {
        Holder::InfrastructureCluster => resources["infrastructureCluster"] == true,
        Holder::ControlPlane | Holder::ControlPlaneMachine => resources["controlPlane"] == true,
        Holder::Worker(class) => resources["machineDeploymentClass"]["names"]
            .as_array()
            .is_some_and(|n| n.contains(&Value::from(class))),
    }
}

/// Applies one RFC 6902 operation (`add`, `replace`, `remove`) at a JSON pointer.
fn apply_json_patch(target: &mut Value, op: &str, path: &str, value: Option<Value>) {
    let (parent_path, last) = path.rsplit_once('/').expect("a JSON pointer");
    let parent = target
        .pointer_mut(parent_path)
        .unwrap_or_else(|| panic!("{op} {path}: {parent_path} does not exist in the template"));
    match (parent, op) {
        (Value::Object(map), "add") => {
            map.insert(last.to_owned(), value.expect("a value"));
        }
        (Value::Object(map), "replace") => {
            let slot = map
                .get_mut(last)
                .unwrap_or_else(|| panic!("replace {path}: nothing there to replace"));
            *slot = value.expect("a value");
        }
        (Value::Object(map), "remove") => {
            map.remove(last)
                .unwrap_or_else(|| panic!("remove {path}: nothing there to remove"));
        }
        (Value::Array(items), op) => {
            let index = if last == "-" {
                items.len()
            } else {
                last.parse().expect("an index")
            };
            match op {
                "add" => items.insert(index, value.expect("a value")),
                "replace" => items[index] = value.expect("a value"),
                _ => {
                    items.remove(index);
                }
            }
        }
        (other, _) => panic!("{op} {path}: {parent_path} is {other}, not an object or array"),
    }
}

/// The variable paths of a patch's `valueFrom.template` actions; the class uses only the form
/// `{{ .a.b }}` (a Go template printing a variable), which this test evaluates.
fn template_actions(text: &str) -> Vec<(std::ops::Range<usize>, &str)> {
    let mut actions = Vec::new();
    let mut from = 0;
    while let Some(start) = text[from..].find("{{").map(|s| s + from) {
        let end = text[start..].find("}}").expect("closing braces") + start + 2;
        let action = text[start + 2..end - 2].trim();
        let path = action
            .strip_prefix('.')
            .filter(|p| !p.is_empty() && !p.contains([' ', '|', '(']))
            .unwrap_or_else(|| {
                panic!("template action {action:?} is not a form this test evaluates")
            });
        actions.push((start..end, path));
        from = end;
    }
    actions
}

/// A patch's `valueFrom.template` rendered with the variables and read as YAML, as the
/// topology controller does.
fn rendered_patch_template(text: &str, variables: &serde_json::Map<String, Value>) -> Value {
    let mut out = String::new();
    let mut last = 0;
    for (range, path) in template_actions(text) {
        out.push_str(&text[last..range.start]);
        match variable(variables, path) {
            Some(Value::String(s)) => out.push_str(s),
            Some(scalar @ (Value::Number(_) | Value::Bool(_))) => out.push_str(&scalar.to_string()),
            other => panic!("template: .{path} is {other:?}, not a scalar"),
        }
        last = range.end;
    }
    out.push_str(&text[last..]);
    serde_norway::from_str(&out)
        .unwrap_or_else(|e| panic!("the rendered template is no YAML: {e}\n{out}"))
}

/// A template of the class with the class's patches for `holder` applied, as the topology
/// controller generates it for a Cluster.
fn patched(
    class: &Value,
    mut template: Value,
    holder: Holder,
    variables: &serde_json::Map<String, Value>,
) -> Value {
    for patch in class["spec"]["patches"].as_array().into_iter().flatten() {
        if !enabled(&patch["enabledIf"], variables) {
            continue;
        }
        for definition in patch["definitions"].as_array().expect("definitions") {
            if !selects(&definition["selector"], &template, holder) {
                continue;
            }
            for json_patch in definition["jsonPatches"].as_array().expect("jsonPatches") {
                let op = json_patch["op"].as_str().expect("op");
                let path = json_patch["path"].as_str().expect("path");
                let value_from = &json_patch["valueFrom"];
                let value = if let Some(name) = value_from["variable"].as_str() {
                    Some(
                        variable(variables, name)
                            .unwrap_or_else(|| panic!("{path}: variable {name} is not set"))
                            .clone(),
                    )
                } else if let Some(text) = value_from["template"].as_str() {
                    Some(rendered_patch_template(text, variables))
                } else {
                    json_patch.get("value").cloned()
                };
                apply_json_patch(&mut template, op, path, value);
            }
        }
    }
    template
}

/// What Cluster API makes of the topology flavor's Cluster with the class: the ProxmoxCluster,
/// the KubeadmControlPlane and MachineDeployments with their (patched) templates, named as a
/// rendered classic template would name them.
fn topology_objects() -> Vec<Value> {
    let file = "cluster-template-topology.yaml";
    let (class, class_objects) = cluster_class();
    let clusters = rendered(file);
    assert_eq!(clusters.len(), 1, "{file}: only the Cluster");
    let cluster = &clusters[0];
    let topology = &cluster["spec"]["topology"];
    let cluster_name = cluster["metadata"]["name"].as_str().expect("named");
    let spec = &class["spec"];
    let mut out = vec![cluster.clone()];

    let variables = class_variables(&class, &topology["variables"], &Value::Null);
    let infrastructure = patched(
        &class,
        referenced(&class_objects, &spec["infrastructure"]["templateRef"]),
        Holder::InfrastructureCluster,
        &variables,
    );
    out.push(serde_json::json!({
        "apiVersion": infrastructure["apiVersion"],
        "kind": "ProxmoxCluster",
        "metadata": {"name": cluster_name},
        "spec": infrastructure["spec"]["template"]["spec"],
    }));

    let control_plane_variables = class_variables(
        &class,
        &topology["variables"],
        &topology["controlPlane"]["variables"]["overrides"],
    );
    let control_plane = patched(
        &class,
        referenced(&class_objects, &spec["controlPlane"]["templateRef"]),
        Holder::ControlPlane,
        &control_plane_variables,
    );
    validated(file, &control_plane);
    let mut machine = patched(
        &class,
        referenced(
            &class_objects,
            &spec["controlPlane"]["machineInfrastructure"]["templateRef"],
        ),
        Holder::ControlPlaneMachine,
        &control_plane_variables,
    );
    let machine_name = format!("{cluster_name}-control-plane");
    machine["metadata"]["name"] = Value::from(machine_name.as_str());
    out.push(machine);
    out.push(serde_json::json!({
        "apiVersion": "controlplane.cluster.x-k8s.io/v1beta2",
        "kind": "KubeadmControlPlane",
        "metadata": {"name": machine_name},
        "spec": {
            "version": topology["version"],
            "replicas": topology["controlPlane"]["replicas"],
            "machineTemplate": {"spec": {"infrastructureRef": {
                "apiGroup": "infrastructure.cluster.x-k8s.io",
                "kind": "ProxmoxMachineTemplate",
                "name": machine_name,
            }}},
            "kubeadmConfigSpec": control_plane["spec"]["template"]["spec"]["kubeadmConfigSpec"],
        },
    }));

    let classes = spec["workers"]["machineDeployments"]
        .as_array()
        .expect("MachineDeployment classes");
    for deployment in topology["workers"]["machineDeployments"]
        .as_array()
        .expect("MachineDeployments")
    {
        let class_name = deployment["class"].as_str().expect("a class");
        let md_class = classes
            .iter()
            .find(|c| c["class"] == class_name)
            .unwrap_or_else(|| panic!("the class has no MachineDeployment class {class_name}"));
        let md_variables = class_variables(
            &class,
            &topology["variables"],
            &deployment["variables"]["overrides"],
        );
        let name = format!(
            "{cluster_name}-{}",
            deployment["name"].as_str().expect("named")
        );
        let bootstrap = patched(
            &class,
            referenced(&class_objects, &md_class["bootstrap"]["templateRef"]),
            Holder::Worker(class_name),
            &md_variables,
        );
        validated(file, &bootstrap);
        let mut machine = patched(
            &class,
            referenced(&class_objects, &md_class["infrastructure"]["templateRef"]),
            Holder::Worker(class_name),
            &md_variables,
        );
        machine["metadata"]["name"] = Value::from(name.as_str());
        out.push(machine);
        let mut bootstrap = bootstrap;
        bootstrap["metadata"]["name"] = Value::from(name.as_str());
        out.push(bootstrap);
        out.push(serde_json::json!({
            "apiVersion": "cluster.x-k8s.io/v1beta2",
            "kind": "MachineDeployment",
            "metadata": {"name": name},
            "spec": {
                "clusterName": cluster_name,
                "replicas": deployment["replicas"],
                "template": {"spec": {
                    "clusterName": cluster_name,
                    "failureDomain": deployment.get("failureDomain")
                        .or(md_class.get("failureDomain")),
                    "bootstrap": {"configRef": {
                        "apiGroup": "bootstrap.cluster.x-k8s.io",
                        "kind": "KubeadmConfigTemplate",
                        "name": name,
                    }},
                    "infrastructureRef": {
                        "apiGroup": "infrastructure.cluster.x-k8s.io",
                        "kind": "ProxmoxMachineTemplate",
                        "name": name,
                    },
                }},
            },
        }));
    }
    for object in &out[1..] {
        if object["kind"] != "MachineDeployment" && object["kind"] != "KubeadmControlPlane" {
            validated(file, object);
            read_as_capmox(file, object);
        }
    }
    out
}

/// Whether a JSON pointer names a place the schema has (a property, an array item or `-`).
fn schema_has_path(schema: &Value, path: &str) -> bool {
    let mut node = schema;
    for segment in path.split('/').skip(1) {
        node = if node["type"] == "array" {
            if segment != "-" && segment.parse::<usize>().is_err() {
                return false;
            }
            &node["items"]
        } else {
            match node["properties"].get(segment) {
                Some(child) => child,
                None => return false,
            }
        };
    }
    true
}

#[test]
fn the_topology_flavor_uses_the_cluster_class_and_its_zones() {
    let (class, _) = cluster_class();
    let cluster = rendered("cluster-template-topology.yaml").remove(0);
    let topology = &cluster["spec"]["topology"];
    assert_eq!(topology["classRef"]["name"], class["metadata"]["name"]);
    assert!(
        topology["classRef"].get("namespace").is_none(),
        "the class is looked up in the Cluster's namespace, where clusterctl puts it"
    );
    let objects = topology_objects();
    let proxmox = proxmox_cluster("topology", &objects);
    let zones: Vec<&str> = proxmox["spec"]["zoneConfig"]
        .as_array()
        .expect("zones from the variable")
        .iter()
        .filter_map(|z| z["zone"].as_str())
        .collect();
    assert_eq!(zones, ["zone-a", "zone-b", "zone-c"]);
    assert_eq!(proxmox["spec"]["controlPlaneEndpoint"]["host"], "10.0.0.10");
    let pinned: Vec<&str> = of_kind(&objects, "MachineDeployment")
        .iter()
        .filter_map(|d| d["spec"]["template"]["spec"]["failureDomain"].as_str())
        .collect();
    assert_eq!(pinned, zones, "one MachineDeployment per zone");
    let groups = machine_groups("topology", &objects, &proxmox);
    let control_plane = &groups[0];
    assert_eq!(
        control_plane.failure_domains,
        [Some("zone-a".to_owned()), Some("zone-b".to_owned())],
        "the control plane spreads over the eligible zones"
    );
    for (owner, placement) in placements("topology", &proxmox, &groups) {
        assert_eq!(
            placement.template(),
            &capmox::placement::TemplateSource::Id {
                vmid: 9000,
                node: "pve1".into()
            },
            "{owner}"
        );
        assert_eq!(pools_of(&placement, "net0"), ["demo-v4-icip"], "{owner}");
    }
}

/// The class's other arm: a template chosen by tags, a dual-stack cluster, no zones, and a bigger
/// control plane through an override.
#[test]
fn the_cluster_class_takes_a_template_selector_ipv6_and_overrides() {
    let (class, class_objects) = cluster_class();
    let values = serde_json::json!([
        {"name": "controlPlaneEndpoint", "value": {"host": "10.0.0.10"}},
        {"name": "dnsServers", "value": ["10.0.0.2"]},
        {"name": "ipv4Config", "value": {"addresses": ["10.0.0.100-10.0.0.150"], "prefix": 24, "gateway": "10.0.0.1"}},
        {"name": "ipv6Config", "value": {"addresses": ["2001:db8::100-2001:db8::150"], "prefix": 64, "gateway": "2001:db8::1"}},
        {"name": "vmTemplate", "value": {"templateSelector": {"matchTags": ["ubuntu-24.04"]}}},
        {"name": "bridge", "value": "vmbr0"},
    ]);
    let overrides = serde_json::json!([{"name": "machine", "value": {"memoryMiB": 32768}}]);
    let variables = class_variables(&class, &values, &overrides);
    assert_eq!(variables["controlPlaneEndpoint"]["port"], 6443, "defaulted");
    let spec = &class["spec"];
    let machine = patched(
        &class,
        referenced(
            &class_objects,
            &spec["controlPlane"]["machineInfrastructure"]["templateRef"],
        ),
        Holder::ControlPlaneMachine,
        &variables,
    );
    let machine_spec = &validated("class", &machine)["spec"]["template"]["spec"];
    assert!(machine_spec.get("sourceNode").is_none() && machine_spec.get("templateID").is_none());
    assert_eq!(
        machine_spec["templateSelector"]["matchTags"],
        serde_json::json!(["ubuntu-24.04"])
    );
    assert_eq!(machine_spec["memoryMiB"], 32768);
    assert_eq!(
        machine_spec["numCores"], 4,
        "the rest of the variable is defaulted"
    );
    assert_eq!(machine_spec["disks"]["bootVolume"]["sizeGb"], 100);
    let infrastructure = patched(
        &class,
        referenced(&class_objects, &spec["infrastructure"]["templateRef"]),
        Holder::InfrastructureCluster,
        &variables,
    );
    let cluster = validated(
        "class",
        &serde_json::json!({
            "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha2",
            "kind": "ProxmoxCluster",
            "metadata": {"name": "demo"},
            "spec": infrastructure["spec"]["template"]["spec"],
        }),
    );
    assert!(cluster["spec"].get("zoneConfig").is_none());
    let control_plane = patched(
        &class,
        referenced(&class_objects, &spec["controlPlane"]["templateRef"]),
        Holder::ControlPlane,
        &variables,
    );
    let control_plane = validated("class", &control_plane);
    let config = &control_plane["spec"]["template"]["spec"]["kubeadmConfigSpec"];
    let pod: Value = serde_norway::from_str(
        kubeadm_file("class", config, KUBE_VIP_MANIFEST)["content"]
            .as_str()
            .expect("content"),
    )
    .expect("a Pod");
    let default_pod: Value = {
        let objects = rendered("cluster-template.yaml");
        let kcp = of_kind(&objects, "KubeadmControlPlane")[0];
        let file = kubeadm_file(
            "default",
            &kcp["spec"]["kubeadmConfigSpec"],
            KUBE_VIP_MANIFEST,
        );
        serde_norway::from_str(file["content"].as_str().expect("content")).expect("a Pod")
    };
    assert_eq!(
        pod["spec"]["containers"][0]["image"], default_pod["spec"]["containers"][0]["image"],
        "kubeVip defaults to the image the cluster templates default to"
    );
    assert_eq!(
        pod["spec"]["containers"][0]["env"], default_pod["spec"]["containers"][0]["env"],
        "the same kube-vip settings, the VIP from controlPlaneEndpoint"
    );
    let group = MachineGroup {
        owner: "control plane".into(),
        template: machine,
        failure_domains: vec![None],
    };
    for (_, placement) in placements("class", &cluster, &[group]) {
        assert_eq!(
            pools_of(&placement, "net0"),
            ["demo-v4-icip", "demo-v6-icip"]
        );
    }
    let vm_template = spec["variables"]
        .as_array()
        .expect("variables")
        .iter()
        .find(|v| v["name"] == "vmTemplate")
        .expect("vmTemplate");
    for half in [
        serde_json::json!({"sourceNode": "pve1"}),
        serde_json::json!({"sourceNode": "pve1", "templateID": 9000, "templateSelector": {"matchTags": ["a"]}}),
    ] {
        assert!(
            capmox_testkit::schema::validate_object(
                &vm_template["schema"]["openAPIV3Schema"],
                &half,
                None
            )
            .is_err(),
            "vmTemplate {half} is refused"
        );
    }
}

/// Every kubeadm configuration of a flavor's objects: the control plane's (`true`) and each
/// KubeadmConfigTemplate's (`false`), with a name for messages.
fn kubeadm_configs(objects: &[Value]) -> Vec<(String, bool, &Value)> {
    let mut configs: Vec<(String, bool, &Value)> = of_kind(objects, "KubeadmControlPlane")
        .into_iter()
        .map(|k| {
            let name = format!("KubeadmControlPlane {}", k["metadata"]["name"]);
            (name, true, &k["spec"]["kubeadmConfigSpec"])
        })
        .collect();
    configs.extend(
        of_kind(objects, "KubeadmConfigTemplate")
            .into_iter()
            .map(|t| {
                let name = format!("KubeadmConfigTemplate {}", t["metadata"]["name"]);
                (name, false, &t["spec"]["template"]["spec"])
            }),
    );
    configs
}

/// A kubelet argument of a kubeadm configuration's `initConfiguration` or `joinConfiguration`,
/// from Cluster API v1beta2's list of `{name, value}`.
fn kubelet_arg<'a>(config: &'a Value, phase: &str, name: &str) -> Option<&'a str> {
    config[phase]["nodeRegistration"]["kubeletExtraArgs"]
        .as_array()?
        .iter()
        .find(|a| a["name"] == name)?["value"]
        .as_str()
}

/// What cloud-init's jinja rendering makes of the `{{ ds.meta_data.<key> }}` expressions in a
/// text, with the meta-data capmox writes (cloud-init offers a key `a-b` as `a_b` too); panics
/// on any other expression.
fn cloud_init_jinja(text: &str, meta_data: &str) -> String {
    let doc: serde_json::Map<String, Value> =
        serde_norway::from_str(meta_data).expect("meta-data is YAML");
    let mut keys = doc.clone();
    for (key, value) in &doc {
        keys.insert(key.replace('-', "_"), value.clone());
    }
    let mut out = String::new();
    let mut rest = text;
    while let Some(start) = rest.find("{{") {
        out.push_str(&rest[..start]);
        let end = rest[start..].find("}}").expect("closing braces") + start;
        let expression = rest[start + 2..end].trim();
        let key = expression
            .strip_prefix("ds.meta_data.")
            .unwrap_or_else(|| panic!("jinja expression {expression:?} reads no meta-data key"));
        let value = keys
            .get(key)
            .and_then(Value::as_str)
            .unwrap_or_else(|| panic!("capmox's meta-data has no {key}:\n{meta_data}"));
        out.push_str(value);
        rest = &rest[end + 2..];
    }
    out.push_str(rest);
    out
}

/// Every kubelet of every flavor registers its Node with the provider ID by which Cluster API
/// finds the Node's Machine: the ProxmoxMachine's `spec.providerID`, `proxmox://<SMBIOS UUID>`.
#[test]
fn every_kubelet_gets_the_machines_provider_id() {
    let uuid = "9b9f5a46-0c1d-4f7e-8b1a-1c2d3e4f5a6b";
    let meta_data = capmox::cloudinit::render_meta_data(&capmox::cloudinit::MetaData {
        instance_id: uuid.to_owned(),
        hostname: "demo-control-plane-x7k2p".to_owned(),
        ..Default::default()
    })
    .expect("meta-data");
    let expected = capmox::cloudinit::provider_id(uuid);
    for template in TEMPLATES {
        let objects = flavor_objects(template);
        let configs = kubeadm_configs(&objects);
        assert!(
            configs.iter().any(|c| c.1) && configs.iter().any(|c| !c.1),
            "{template}: a control plane and worker bootstrap templates"
        );
        for (owner, control_plane, config) in configs {
            let phases: &[&str] = if control_plane {
                &["initConfiguration", "joinConfiguration"]
            } else {
                &["joinConfiguration"]
            };
            for phase in phases {
                let value = kubelet_arg(config, phase, "provider-id").unwrap_or_else(|| {
                    panic!("{template}: {owner}: {phase} gives the kubelet no provider-id")
                });
                match config["format"].as_str() {
                    // Cluster API's cloud-config starts with `## template: jinja`, so cloud-init
                    // renders it with the instance data before it runs anything.
                    None | Some("cloud-config") => {
                        assert_eq!(
                            value, "proxmox://{{ ds.meta_data.instance_id }}",
                            "{template}: {owner}: {phase}"
                        );
                        assert_eq!(
                            cloud_init_jinja(value, &meta_data),
                            expected,
                            "{template}: {owner}: {phase}"
                        );
                    }
                    Some("ignition") => assert_eq!(
                        value, "proxmox://${COREOS_CUSTOM_INSTANCE_ID}",
                        "{template}: {owner}: {phase}: from /etc/proxmox-env by envsubst"
                    ),
                    Some(other) => panic!("{template}: {owner}: format {other}"),
                }
            }
            if config["format"]
                .as_str()
                .is_none_or(|f| f == "cloud-config")
            {
                let text = serde_json::to_string(config).expect("serializes");
                for marker in ["{%", "{#"] {
                    assert!(
                        !text.contains(marker),
                        "{template}: {owner}: {marker} would be jinja"
                    );
                }
                cloud_init_jinja(&text, &meta_data);
            }
        }
    }
}

const KUBE_VIP_MANIFEST: &str = "/etc/kubernetes/manifests/kube-vip.yaml";
const KUBE_VIP_PREPARE: &str = "/etc/kube-vip-prepare.sh";

/// The content of the one file at `path` of a kubeadm configuration.
fn kubeadm_file<'a>(file: &str, config: &'a Value, path: &str) -> &'a Value {
    let found: Vec<&Value> = config["files"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|f| f["path"] == path)
        .collect();
    assert_eq!(found.len(), 1, "{file}: one {path} among the files");
    found[0]
}

/// The `s#from#to#` expressions of a script's `sed -i` lines, in order.
fn sed_substitutions(script: &str) -> Vec<(String, String)> {
    script
        .lines()
        .filter_map(|line| line.trim().strip_prefix("sed -i 's#"))
        .map(|rest| {
            let mut parts = rest.split('#');
            let from = parts.next().expect("a pattern").to_owned();
            let to = parts.next().expect("a replacement").to_owned();
            (from, to)
        })
        .collect()
}

/// The path of the host's kubeconfig file kube-vip reads, and where the pod mounts it.
fn kube_vip_kubeconfig(pod: &Value) -> (String, String) {
    let mount = &pod["spec"]["containers"][0]["volumeMounts"][0];
    let volume = pod["spec"]["volumes"]
        .as_array()
        .expect("volumes")
        .iter()
        .find(|v| v["name"] == mount["name"])
        .expect("the mounted volume");
    (
        volume["hostPath"]["path"]
            .as_str()
            .expect("a hostPath")
            .to_owned(),
        mount["mountPath"].as_str().expect("a mountPath").to_owned(),
    )
}

/// Every flavor's control plane runs kube-vip, which holds the control-plane endpoint, with the
/// kubeadm-init workaround of Kubernetes 1.29 and later.
#[test]
fn every_control_plane_runs_kube_vip_on_the_endpoint() {
    let vip = TEMPLATE_VALUES
        .iter()
        .find(|(name, _)| *name == "CONTROL_PLANE_ENDPOINT_IP")
        .map(|(_, value)| *value)
        .expect("a test value");
    for template in TEMPLATES {
        let objects = flavor_objects(template);
        let cluster = proxmox_cluster(template, &objects);
        let endpoint = &cluster["spec"]["controlPlaneEndpoint"];
        assert_eq!(endpoint["host"], vip, "{template}");
        let control_planes = of_kind(&objects, "KubeadmControlPlane");
        assert_eq!(control_planes.len(), 1, "{template}: one control plane");
        let config = &control_planes[0]["spec"]["kubeadmConfigSpec"];

        let manifest = kubeadm_file(template, config, KUBE_VIP_MANIFEST)["content"]
            .as_str()
            .expect("content");
        let pod: Value = serde_norway::from_str(manifest)
            .unwrap_or_else(|e| panic!("{template}: kube-vip.yaml is no YAML: {e}"));
        assert_eq!(
            (&pod["apiVersion"], &pod["kind"]),
            (&Value::from("v1"), &Value::from("Pod")),
            "{template}"
        );
        assert_eq!(pod["metadata"]["namespace"], "kube-system", "{template}");
        assert_eq!(pod["spec"]["hostNetwork"], true, "{template}");
        let containers = pod["spec"]["containers"].as_array().expect("containers");
        assert_eq!(containers.len(), 1, "{template}");
        let kube_vip = &containers[0];
        let image = kube_vip["image"].as_str().expect("an image");
        assert!(
            image.starts_with("ghcr.io/kube-vip/kube-vip:v0.8."),
            "{template}: {image}"
        );
        let env: std::collections::BTreeMap<&str, &str> = kube_vip["env"]
            .as_array()
            .expect("env")
            .iter()
            .map(|e| {
                let name = e["name"].as_str().expect("named");
                let value = e["value"]
                    .as_str()
                    .unwrap_or_else(|| panic!("{template}: env {name} is no string"));
                (name, value)
            })
            .collect();
        let port = endpoint["port"].to_string();
        for (name, value) in [
            ("address", vip),
            ("port", port.as_str()),
            ("vip_interface", ""),
            ("vip_arp", "true"),
            ("cp_enable", "true"),
            ("vip_leaderelection", "true"),
        ] {
            assert_eq!(
                env.get(name),
                Some(&value),
                "{template}: kube-vip env {name}"
            );
        }
        let capabilities = &kube_vip["securityContext"]["capabilities"]["add"];
        for capability in ["NET_ADMIN", "NET_RAW"] {
            assert!(
                capabilities
                    .as_array()
                    .is_some_and(|c| c.contains(&Value::from(capability))),
                "{template}: kube-vip needs {capability}"
            );
        }
        let admin = "/etc/kubernetes/admin.conf".to_owned();
        assert_eq!(kube_vip_kubeconfig(&pod), (admin.clone(), admin.clone()));

        let prepare = kubeadm_file(template, config, KUBE_VIP_PREPARE);
        assert_eq!(prepare["permissions"], "0700", "{template}");
        let script = prepare["content"].as_str().expect("content");
        let check = std::process::Command::new("bash")
            .args(["-n", "-c", script])
            .output()
            .expect("bash runs");
        assert!(
            check.status.success(),
            "{template}: {KUBE_VIP_PREPARE}: {}",
            String::from_utf8_lossy(&check.stderr)
        );
        let commands = |key: &str| -> Vec<&str> {
            config[key]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
                .collect()
        };
        assert_eq!(
            commands("preKubeadmCommands").last(),
            Some(&format!("{KUBE_VIP_PREPARE} before").as_str()),
            "{template}: the last command before kubeadm"
        );
        assert_eq!(
            commands("postKubeadmCommands").first(),
            Some(&format!("{KUBE_VIP_PREPARE} after").as_str()),
            "{template}: the first command after kubeadm"
        );
        // The script's sed lines: the first points kube-vip at super-admin.conf for kubeadm init,
        // the second puts the manifest back as it was.
        let substitutions = sed_substitutions(script);
        assert_eq!(substitutions.len(), 2, "{template}: {substitutions:?}");
        let during_init = manifest.replace(&substitutions[0].0, &substitutions[0].1);
        let pod_during_init: Value = serde_norway::from_str(&during_init).expect("still YAML");
        assert_eq!(
            kube_vip_kubeconfig(&pod_during_init),
            ("/etc/kubernetes/super-admin.conf".to_owned(), admin),
            "{template}: during kubeadm init"
        );
        assert_eq!(
            during_init.replace(&substitutions[1].0, &substitutions[1].1),
            manifest,
            "{template}: after kubeadm init"
        );
    }
}

/// A temporary directory removed on drop.
pub(crate) struct TempDir(pub(crate) PathBuf);

impl TempDir {
    /// `capmox-<tag>-<process id>` in the system's temporary directory.
    pub(crate) fn new(tag: &str) -> Self {
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

/// The release files of `make release-manifests SECRET_NAMESPACES=...` (in a directory of
/// their own, `tag` telling it apart): infrastructure-components.yaml and the namespaces' Roles.
pub(crate) fn namespaced_secrets_release(tag: &str, namespaces: &str) -> (Vec<Value>, Vec<Value>) {
    let out = TempDir::new(tag);
    run_ok(
        tool("make")
            .args(["--no-print-directory", "release-manifests"])
            .arg(format!("SECRET_NAMESPACES={namespaces}"))
            .arg(format!("OUT={}", out.0.display())),
        &format!("make release-manifests SECRET_NAMESPACES={namespaces:?}"),
    );
    let read = |file: &str| {
        let path = out.0.join(file);
        documents(
            &std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())),
        )
    };
    (
        read("infrastructure-components.yaml"),
        read("secret-namespaces-rbac.yaml"),
    )
}

/// Whether a role's rules name Secrets.
fn grants_secrets(role: &Value) -> bool {
    role["rules"].as_array().is_some_and(|rules| {
        rules.iter().any(|r| {
            r["resources"]
                .as_array()
                .is_some_and(|rs| rs.iter().any(|x| x == "secrets"))
        })
    })
}

/// `SECRET_NAMESPACES` makes an install that reads Secrets only where the installer said: the
/// ClusterRole names no Secrets, the manager runs with `--secret-namespaces`, and each namespace
/// gets a Role (get, patch on Secrets) bound to the manager's ServiceAccount, in a file of its
/// own since clusterctl moves every namespaced object of the components into its namespace.
#[test]
fn secret_namespaces_give_roles_per_namespace_and_no_cluster_wide_secret_access() {
    let manager_role = |objects: &[Value]| {
        objects
            .iter()
            .find(|o| o["kind"] == "ClusterRole" && o["metadata"]["name"] == "capmox-manager-role")
            .cloned()
            .expect("the manager's ClusterRole")
    };
    let default_role = manager_role(&components());
    assert!(
        grants_secrets(&default_role),
        "the default install reads Secrets anywhere"
    );

    let (objects, rbac) = namespaced_secrets_release("release-secret-ns", "team-a team-b");
    let cluster_role = manager_role(&objects);
    assert!(!grants_secrets(&cluster_role), "{cluster_role}");
    let mut without_secrets = default_role.clone();
    without_secrets["rules"]
        .as_array_mut()
        .expect("rules")
        .retain(|r| r["resources"] != serde_json::json!(["secrets"]));
    assert_eq!(cluster_role, without_secrets, "only the Secret rule goes");
    let deployment = objects
        .iter()
        .find(|o| o["kind"] == "Deployment")
        .expect("a Deployment");
    let args = manager_run_args(&deployment["spec"]["template"]["spec"]["containers"][0]);
    assert_eq!(
        args.global_credentials().secret_namespaces,
        Some(vec!["team-a".to_owned(), "team-b".to_owned()])
    );
    assert!(
        objects
            .iter()
            .all(|o| o["kind"] != "Role" || o["metadata"]["namespace"] == "capmox-system"),
        "no Role for a tenant namespace in the components"
    );

    let account = find(
        &objects,
        "ServiceAccount",
        "capmox-system",
        "capmox-manager",
    );
    for namespace in ["team-a", "team-b"] {
        let role = find(&rbac, "Role", namespace, "capmox-manager-secrets");
        assert_eq!(
            role["rules"],
            serde_json::json!([{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "patch"]}])
        );
        let binding = find(&rbac, "RoleBinding", namespace, "capmox-manager-secrets");
        assert_eq!(binding["roleRef"]["name"], "capmox-manager-secrets");
        assert_eq!(binding["subjects"][0]["name"], account["metadata"]["name"]);
        assert_eq!(
            binding["subjects"][0]["namespace"],
            account["metadata"]["namespace"]
        );
    }
    assert_eq!(rbac.len(), 4, "a Role and a RoleBinding per namespace");
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
