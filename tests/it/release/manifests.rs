//! The release manifests: clusterctl's rules, the manager Deployment, its webhooks and
//! their certificates, a rolling update, namespaced Secrets and `IMG=`.

use super::*;

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
    assert_eq!(crds.len(), 6);
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

    // Each CRD of two versions names the webhook Service and the Certificate whose CA is
    // injected; the v1alpha2-only ones (remediation) convert nothing.
    let (crds, single): (Vec<&Value>, Vec<&Value>) = objects
        .iter()
        .filter(|o| o["kind"] == "CustomResourceDefinition")
        .partition(|crd| {
            crd["spec"]["versions"]
                .as_array()
                .is_some_and(|v| v.len() > 1)
        });
    assert_eq!((crds.len(), single.len()), (4, 2));
    for crd in &single {
        assert!(
            crd["spec"]["conversion"].is_null(),
            "{}",
            crd["metadata"]["name"]
        );
        assert!(
            crd["metadata"]["annotations"]["cert-manager.io/inject-ca-from"].is_null(),
            "{}",
            crd["metadata"]["name"]
        );
    }
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
        task_timing: Default::default(),
        zone_holds: Default::default(),
        proxmox_requests_in_flight: capmox::proxmox::DEFAULT_REQUESTS_IN_FLIGHT,
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
            serde_json::json!([{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "list", "patch", "watch"]}])
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
