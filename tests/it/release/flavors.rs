//! The cluster templates: every flavor ships, its objects pass the CRDs and the webhook, capmox
//! places its machines, each flavor does what it says, every kubelet gets the provider ID and
//! every control plane runs kube-vip; and the book documents them.

use super::*;

/// A page of the book (`docs/src/<page>`).
fn book_page(page: &str) -> String {
    let path = crate::common::root().join("docs/src").join(page);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn the_book_documents_every_template_variable_and_flavor() {
    let page = book_page("reference/flavors.md");
    let mut undocumented = Vec::new();
    for template in TEMPLATES {
        for variable in variables(&read_out(template)) {
            if !page.contains(&format!("`{variable}`")) {
                undocumented.push(format!("{template}: {variable}"));
            }
        }
        let flavor = template
            .strip_prefix("cluster-template-")
            .and_then(|f| f.strip_suffix(".yaml"));
        if let Some(flavor) = flavor
            && !page.contains(&format!("--flavor {flavor}"))
        {
            undocumented.push(format!("{template}: how to use `--flavor {flavor}`"));
        }
    }
    assert!(
        undocumented.is_empty(),
        "docs/src/reference/flavors.md does not document (run `make docs-pages`): {undocumented:#?}"
    );
}

/// The part of a Markdown `page` under `heading` (a whole heading line), up to the next
/// heading of its level or above.
fn page_section<'a>(page: &'a str, heading: &str) -> &'a str {
    let start = page
        .find(&format!("\n{heading}\n"))
        .unwrap_or_else(|| panic!("no section {heading:?}"))
        + 1;
    let level = heading.chars().take_while(|c| *c == '#').count();
    let body = &page[start + heading.len()..];
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
/// real webhooks refuse a flavor that needs them: the book's install page, and the topic page
/// of each, say how to turn them on.
#[test]
fn the_book_names_the_feature_gates_flavors_need() {
    let install = book_page("getting-started/install.md");
    let gates = page_section(&install, "## Feature gates");
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
                "topics/flatcar.md",
                "EXP_KUBEADM_BOOTSTRAP_FORMAT_IGNITION=true clusterctl init",
            ),
            (
                topology,
                "topics/clusterclass.md",
                "CLUSTER_TOPOLOGY=true clusterctl init",
            ),
        ];
        for (needed, topic, how) in needs {
            if needed && !gates.contains(how) {
                missing.push(format!(
                    "{template}: `{how}` under install.md's Feature gates"
                ));
            }
            if needed && !book_page(topic).contains(how) {
                missing.push(format!("{template}: `{how}` in {topic}"));
            }
        }
    }
    assert!(missing.is_empty(), "the book does not say: {missing:#?}");
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
