//! The clusterctl release files (`make release-manifests` writes them to `out/`) follow
//! clusterctl's rules, and the cluster templates produce objects the CRDs accept.

use std::collections::BTreeSet;
use std::path::Path;

use serde_json::Value;

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

const VALUES: &[(&str, &str)] = &[
    ("CLUSTER_NAME", "demo"),
    ("CONTROL_PLANE_ENDPOINT_IP", "10.0.0.10"),
    ("NODE_IP_RANGES", "[10.0.0.100-10.0.0.150]"),
    ("IP_PREFIX", "24"),
    ("GATEWAY", "10.0.0.1"),
    ("DNS_SERVERS", "[10.0.0.2]"),
    ("PROXMOX_SOURCENODE", "pve1"),
    ("TEMPLATE_VMID", "9000"),
    ("BRIDGE", "vmbr0"),
    ("KUBERNETES_VERSION", "v1.33.0"),
    ("CONTROL_PLANE_MACHINE_COUNT", "3"),
    ("WORKER_MACHINE_COUNT", "2"),
    ("VM_SSH_KEYS", "ssh-ed25519 AAAA"),
    ("ZONE_A_NODES", "[pve1, pve2]"),
    ("ZONE_B_NODES", "[pve3, pve4]"),
    ("ZONE_C_NODES", "[pve5]"),
];

fn substitute(text: &str) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let end = rest[start..].find('}').expect("closing brace") + start;
        let expr = &rest[start + 2..end];
        let (name, default) = match expr.split_once(":=").or_else(|| expr.split_once('=')) {
            Some((name, default)) => (name, Some(default)),
            None => (expr, None),
        };
        let value = VALUES
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| *v)
            .or(default);
        out.push_str(value.unwrap_or_else(|| panic!("no test value for ${{{name}}}")));
        rest = &rest[end + 1..];
    }
    out.push_str(rest);
    out
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
        for object in documents(&substitute(&read_out(template))) {
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
    let objects = documents(&substitute(&read_out(
        "cluster-template-failure-domains.yaml",
    )));
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
