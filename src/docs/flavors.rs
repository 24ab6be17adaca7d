//! The flavors page: every cluster template in `templates/` with the variables it takes, and
//! the ClusterClass with its variables.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write;
use std::path::Path;

use serde_json::Value;

use super::DocsError;
use super::schema::{fields, table};

/// What each template variable means; the page fails to render while a template uses one that
/// is not here, or this names one no template uses.
const VARIABLES: &[(&str, &str)] = &[
    (
        "CLUSTER_NAME",
        "name of the cluster and prefix of its objects",
    ),
    (
        "CONTROL_PLANE_ENDPOINT_IP",
        "API server address (a free IP for the kube-vip VIP, outside `NODE_IP_RANGES`), port 6443",
    ),
    (
        "NODE_IP_RANGES",
        "addresses for the machines, e.g. `[10.0.0.100-10.0.0.150]`",
    ),
    ("IP_PREFIX", "prefix length of that network, e.g. `24`"),
    ("GATEWAY", "default gateway of that network"),
    ("DNS_SERVERS", "DNS servers, e.g. `[10.0.0.2]`"),
    (
        "ALLOWED_NODES",
        "Proxmox nodes machines may run on (`[]`: the template's node)",
    ),
    (
        "CONTROL_PLANE_MACHINE_COUNT",
        "control-plane replicas (1, 3 or 5)",
    ),
    ("WORKER_MACHINE_COUNT", "worker replicas"),
    (
        "WORKER_MACHINE_COUNT_PER_ZONE",
        "worker replicas in each zone's MachineDeployment",
    ),
    (
        "KUBERNETES_VERSION",
        "e.g. `v1.33.0` (must match the VM template's kubeadm)",
    ),
    (
        "VM_SSH_KEYS",
        "an SSH public key for user root (user core on Flatcar)",
    ),
    ("PROXMOX_SOURCENODE", "node that holds the VM template"),
    ("TEMPLATE_VMID", "VMID of the VM template"),
    (
        "TEMPLATE_TAGS",
        "Proxmox tags of the VM template, comma-separated, e.g. `ubuntu-24.04, k8s-v1.33`",
    ),
    (
        "TEMPLATE_MATCH_POLICY",
        "`exact`, `uniqueSubset` or `bestSubset` (see `templateSelector`)",
    ),
    ("NUM_SOCKETS", "CPU sockets"),
    ("NUM_CORES", "cores per socket"),
    ("MEMORY_MIB", "memory in MiB, a multiple of 8"),
    ("BOOT_VOLUME_DEVICE", "boot disk to grow"),
    ("BOOT_VOLUME_SIZE", "boot disk size in GB"),
    ("BRIDGE", "Proxmox bridge of `net0`, e.g. `vmbr0`"),
    ("KUBE_VIP_IMAGE", "kube-vip image of the control plane"),
    (
        "VIP_NETWORK_INTERFACE",
        "interface kube-vip announces `CONTROL_PLANE_ENDPOINT_IP` on (empty: the one with the default route)",
    ),
    (
        "ZONE_A",
        "name of the first zone (takes control-plane machines)",
    ),
    (
        "ZONE_B",
        "name of the second zone (takes control-plane machines)",
    ),
    ("ZONE_C", "name of the third zone (workers only)"),
    (
        "ZONE_A_NODES",
        "Proxmox nodes of `ZONE_A`, e.g. `[pve1, pve2]`",
    ),
    ("ZONE_B_NODES", "Proxmox nodes of `ZONE_B`"),
    ("ZONE_C_NODES", "Proxmox nodes of `ZONE_C`"),
    ("PROXMOX_URL", "the cluster's Proxmox API URL"),
    ("PROXMOX_TOKEN", "its API token ID (`user@realm!name`)"),
    ("PROXMOX_SECRET", "the token's secret"),
    (
        "PROXMOX_FINGERPRINT",
        "SHA-256 fingerprint of the Proxmox certificate to accept (empty: verify with the system roots)",
    ),
    ("PROXMOX_INSECURE", "`true` skips TLS verification"),
    (
        "NODE_IPV6_RANGES",
        "IPv6 addresses for the machines, e.g. `[2001:db8::100-2001:db8::150]`",
    ),
    (
        "IPV6_PREFIX",
        "prefix length of the IPv6 network, e.g. `64`",
    ),
    ("IPV6_GATEWAY", "IPv6 default gateway"),
    ("SECONDARY_BRIDGE", "Proxmox bridge of `net1`, e.g. `vmbr1`"),
    (
        "SECONDARY_IP_RANGES",
        "addresses for `net1`, e.g. `[10.0.20.100-10.0.20.150]`",
    ),
    ("SECONDARY_IP_PREFIX", "prefix length of the second network"),
    ("SECONDARY_GATEWAY", "gateway of the second network"),
    (
        "SECONDARY_GATEWAY_METRIC",
        "metric of the default route via `SECONDARY_GATEWAY` (equal to the cluster pool's: capmox keeps only `net0`'s default route; higher makes `net1` a fallback)",
    ),
];

const INTRO: &str = "\
# Flavors and their variables

Every flavor is one `clusterctl generate cluster` away, e.g.
`clusterctl generate cluster demo --flavor dual-stack > demo.yaml`; without `--flavor` you get
the default. clusterctl asks for the variables the flavor uses. A flavor named like one of the
Go provider's (default, external-creds, proxmox-labels, dual-stack, multiple-vlans, flatcar,
auto-image) takes that flavor's variables as they are: every variable it adds has a default, so
a user's settings for the Go provider's flavor are enough. The flatcar flavor needs Cluster
API's Ignition feature gate and the topology flavor its ClusterClass feature gate (see
[Install](../getting-started/install.md#feature-gates)).
";

/// A template's variables, with their defaults (`$${VAR}` is a literal, not a variable).
fn variables(text: &str) -> BTreeMap<String, Option<String>> {
    let mut found = BTreeMap::new();
    let mut rest = text;
    while let Some(start) = rest.find("${") {
        let Some(length) = rest[start..].find('}') else {
            break;
        };
        let end = start + length;
        if start == 0 || rest.as_bytes()[start - 1] != b'$' {
            let expr = rest[start + 2..end].trim();
            let (name, default) = match expr.split_once(":=").or_else(|| expr.split_once('=')) {
                Some((name, default)) => (name, Some(default.trim_matches('"').to_owned())),
                None => (expr, None),
            };
            found.insert(name.trim().to_owned(), default);
        }
        rest = &rest[end + 1..];
    }
    found
}

/// The comment a template starts with, as one paragraph.
fn header(text: &str) -> String {
    text.lines()
        .map_while(|line| line.strip_prefix('#'))
        .map(str::trim)
        .collect::<Vec<_>>()
        .join(" ")
}

fn read(path: &Path) -> Result<String, DocsError> {
    std::fs::read_to_string(path).map_err(|source| DocsError::Read {
        path: path.to_owned(),
        source,
    })
}

/// The flavor of a template file, or `None` for a file that is not a cluster template.
fn flavor(file: &str) -> Option<&str> {
    if file == "cluster-template.yaml" {
        return Some("default");
    }
    file.strip_prefix("cluster-template-")?
        .strip_suffix(".yaml")
}

struct Template {
    flavor: String,
    about: String,
    variables: BTreeMap<String, Option<String>>,
}

/// A ClusterClass file of the templates directory.
struct ClassFile {
    file: String,
    text: String,
}

/// What the templates directory holds.
struct Templates {
    flavors: Vec<Template>,
    classes: Vec<ClassFile>,
}

fn templates(dir: &Path) -> Result<Templates, DocsError> {
    let entries = std::fs::read_dir(dir).map_err(|source| DocsError::Read {
        path: dir.to_owned(),
        source,
    })?;
    let mut files: Vec<String> = entries
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .collect();
    files.sort();
    let mut templates = Vec::new();
    let mut classes = Vec::new();
    for file in files {
        let text = read(&dir.join(&file))?;
        if let Some(flavor) = flavor(&file) {
            let about = header(&text);
            // "capmox <flavor> flavor: what it is" says the flavor twice in a table of flavors.
            let about = about
                .split_once(" flavor: ")
                .filter(|(name, _)| name.starts_with("capmox "))
                .map_or(about.clone(), |(_, what)| what.to_owned());
            templates.push(Template {
                flavor: flavor.to_owned(),
                about,
                variables: variables(&text),
            });
        } else if file.starts_with("clusterclass-") && file.ends_with(".yaml") {
            classes.push(ClassFile { file, text });
        }
    }
    // The default flavor first, as clusterctl offers it without --flavor.
    templates.sort_by_key(|t| (t.flavor != "default", t.flavor.clone()));
    Ok(Templates {
        flavors: templates,
        classes,
    })
}

fn check_variables(templates: &[Template]) -> Result<(), DocsError> {
    let used: BTreeSet<&str> = templates
        .iter()
        .flat_map(|t| t.variables.keys().map(String::as_str))
        .collect();
    let described: BTreeSet<&str> = VARIABLES.iter().map(|(name, _)| *name).collect();
    if used == described {
        return Ok(());
    }
    Err(DocsError::Variables(format!(
        "used but not described: {:?}; described but not used: {:?}",
        used.difference(&described).collect::<Vec<_>>(),
        described.difference(&used).collect::<Vec<_>>()
    )))
}

fn variable_table(templates: &[Template]) -> String {
    let mut out = String::from("| variable | flavors | default | meaning |\n|---|---|---|---|\n");
    for (name, meaning) in VARIABLES {
        let users: Vec<&Template> = templates
            .iter()
            .filter(|t| t.variables.contains_key(*name))
            .collect();
        let flavors = if users.len() == templates.len() {
            "all".to_owned()
        } else {
            users
                .iter()
                .map(|t| t.flavor.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        };
        let defaults: BTreeSet<String> = users
            .iter()
            .filter_map(|t| t.variables.get(*name).cloned().flatten())
            .map(|d| {
                if d.is_empty() {
                    "(empty)".to_owned()
                } else {
                    super::code(&d)
                }
            })
            .collect();
        let default = if defaults.is_empty() {
            "required".to_owned()
        } else {
            defaults.into_iter().collect::<Vec<_>>().join(", ")
        };
        // Writing to a String cannot fail.
        let _ = writeln!(out, "| `{name}` | {flavors} | {default} | {meaning} |");
    }
    out
}

fn cluster_class(file: &str, text: &str) -> Result<String, DocsError> {
    let yaml = |source| DocsError::Yaml {
        path: Path::new("templates").join(file),
        source,
    };
    let mut out = String::new();
    for document in serde_norway::Deserializer::from_str(text) {
        let object: Value = serde::Deserialize::deserialize(document).map_err(yaml)?;
        if object["kind"] != "ClusterClass" {
            continue;
        }
        let name = object["metadata"]["name"].as_str().unwrap_or_default();
        let _ = write!(
            out,
            "\n## ClusterClass {name}\n\n{} (`{file}`). Its variables, set under the Cluster's \
             `spec.topology.variables` (and `variables.overrides` of the control plane or a \
             MachineDeployment):\n\n",
            super::one_line(&header(text))
        );
        for variable in object["spec"]["variables"].as_array().into_iter().flatten() {
            let schema = &variable["schema"]["openAPIV3Schema"];
            let var = variable["name"].as_str().unwrap_or_default();
            let required = if variable["required"] == true {
                "required"
            } else {
                "optional"
            };
            let _ = write!(
                out,
                "### {var}\n\n{required}: {}\n\n",
                super::one_line(schema["description"].as_str().unwrap_or_default())
            );
            let rows = fields(schema, var);
            if !rows.is_empty() {
                out.push_str(&table(&rows));
                out.push('\n');
            }
        }
    }
    Ok(out)
}

pub(super) fn render(dir: &Path) -> Result<String, DocsError> {
    let Templates {
        flavors: templates,
        classes,
    } = templates(dir)?;
    check_variables(&templates)?;
    let mut out = String::from(INTRO);
    out.push_str("\n## Flavors\n\n| flavor | what it is |\n|---|---|\n");
    for template in &templates {
        let usage = if template.flavor == "default" {
            "(default)".to_owned()
        } else {
            format!("`--flavor {}`", template.flavor)
        };
        let _ = writeln!(out, "| {usage} | {} |", super::cell(&template.about));
    }
    out.push_str("\n## Variables\n\n");
    out.push_str(&variable_table(&templates));
    for class in &classes {
        out.push_str(&cluster_class(&class.file, &class.text)?);
    }
    Ok(out)
}
