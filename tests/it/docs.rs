//! The book (`docs/`) and the README stay true to the code: every generated page equals what
//! its generator prints, every page is in the table of contents, every link resolves (anchors
//! included), every `make` target, flag and repository path named in code exists, every
//! condition reason the source sets is in the catalogue the troubleshooting page is printed
//! from, and the README stays short. None of this needs mdBook itself (`make docs` builds it).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use capmox::docs::Page;

use crate::common::root;

/// The longest the README may grow: it is the front page, the book holds the rest.
const README_MAX_LINES: usize = 200;

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn book() -> PathBuf {
    root().join("docs/src")
}

/// Every Markdown file under `dir`, sorted.
fn markdown_files(dir: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let path = entry.expect("directory entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "md") {
                found.push(path);
            }
        }
    }
    found.sort();
    found
}

/// The book's pages and the README: what the checks below read.
fn documents() -> Vec<PathBuf> {
    let mut all = markdown_files(&book());
    all.push(root().join("README.md"));
    all
}

/// A Markdown text split into prose (code blocks and spans blanked out) and code (the fenced
/// blocks and inline spans).
struct Split {
    prose: String,
    code: Vec<String>,
}

fn split(text: &str) -> Split {
    let mut prose = String::new();
    let mut code = Vec::new();
    let mut block: Option<String> = None;
    for line in text.lines() {
        let fence = line.trim_start().starts_with("```");
        match (&mut block, fence) {
            (Some(lines), true) => {
                code.push(std::mem::take(lines));
                block = None;
            }
            (Some(lines), false) => {
                lines.push_str(line);
                lines.push('\n');
            }
            (None, true) => block = Some(String::new()),
            (None, false) => {
                let (text, spans) = inline_code(line);
                prose.push_str(&text);
                prose.push('\n');
                code.extend(spans);
            }
        }
        if block.is_some() {
            prose.push('\n');
        }
    }
    Split { prose, code }
}

/// A line without its code spans, and the spans.
fn inline_code(line: &str) -> (String, Vec<String>) {
    let mut text = String::new();
    let mut spans = Vec::new();
    let mut rest = line;
    while let Some(start) = rest.find('`') {
        let ticks = rest[start..].chars().take_while(|c| *c == '`').count();
        let fence = "`".repeat(ticks);
        let after = &rest[start + ticks..];
        let Some(end) = after.find(&fence) else { break };
        text.push_str(&rest[..start]);
        text.push_str(" code ");
        spans.push(after[..end].trim().to_owned());
        rest = &after[end + ticks..];
    }
    text.push_str(rest);
    (text, spans)
}

/// The ids mdBook gives a page's headings: the heading's text, lower case, whitespace as `-`,
/// other punctuation dropped; repeats get `-1`, `-2`, ...
fn heading_ids(text: &str) -> BTreeSet<String> {
    let link = regex::Regex::new(r"\[([^\]]*)\]\([^)]*\)").expect("regex");
    let mut ids = BTreeSet::new();
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut in_block = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            in_block = !in_block;
            continue;
        }
        let hashes = line.chars().take_while(|c| *c == '#').count();
        if in_block || hashes == 0 || !line[hashes..].starts_with(' ') {
            continue;
        }
        let words = link
            .replace_all(line[hashes..].trim(), "$1")
            .replace('`', "");
        let id: String = words
            .chars()
            .filter_map(|c| {
                if c.is_alphanumeric() || c == '_' || c == '-' {
                    Some(c.to_ascii_lowercase())
                } else if c.is_whitespace() {
                    Some('-')
                } else {
                    None
                }
            })
            .collect();
        let count = seen.entry(id.clone()).or_default();
        ids.insert(if *count == 0 {
            id.clone()
        } else {
            format!("{id}-{count}")
        });
        *count += 1;
    }
    ids
}

#[test]
fn the_generated_pages_are_what_their_generators_print() {
    let templates = root().join("templates");
    let mut stale = Vec::new();
    for page in Page::ALL {
        let generated = capmox::docs::render(page, &templates)
            .unwrap_or_else(|e| panic!("capmox docs {}: {e}", page.name()));
        let path = book().join(page.path());
        if std::fs::read_to_string(&path).ok().as_deref() != Some(generated.as_str()) {
            stale.push(format!("{} (capmox docs {})", path.display(), page.name()));
        }
    }
    assert!(
        stale.is_empty(),
        "stale generated pages, run `make docs-pages`: {stale:#?}"
    );
}

#[test]
fn the_table_of_contents_lists_every_page_and_nothing_else() {
    let summary = read(&book().join("SUMMARY.md"));
    let entry = regex::Regex::new(r"\]\(([^)]+\.md)\)").expect("regex");
    let listed: BTreeSet<PathBuf> = entry
        .captures_iter(&summary)
        .map(|c| book().join(&c[1]))
        .collect();
    let pages: BTreeSet<PathBuf> = markdown_files(&book())
        .into_iter()
        .filter(|p| !p.ends_with("SUMMARY.md"))
        .collect();
    assert_eq!(
        listed.difference(&pages).collect::<Vec<_>>(),
        Vec::<&PathBuf>::new(),
        "SUMMARY.md lists pages that do not exist"
    );
    assert_eq!(
        pages.difference(&listed).collect::<Vec<_>>(),
        Vec::<&PathBuf>::new(),
        "pages missing from SUMMARY.md"
    );
}

#[test]
fn every_link_resolves() {
    let link = regex::Regex::new(r#"\]\(([^)\s]+)(?:\s+"[^"]*")?\)"#).expect("regex");
    let mut broken = Vec::new();
    for document in documents() {
        let text = read(&document);
        let dir = document.parent().expect("a file has a directory");
        for target in link
            .captures_iter(&split(&text).prose)
            .map(|c| c[1].to_owned())
        {
            if target.starts_with("https://") || target.starts_with("http://") {
                continue;
            }
            let (file, anchor) = match target.split_once('#') {
                Some((file, anchor)) => (file, Some(anchor)),
                None => (target.as_str(), None),
            };
            let path = if file.is_empty() {
                document.clone()
            } else {
                dir.join(file)
            };
            if !path.exists() {
                broken.push(format!("{}: {target} (no such file)", document.display()));
                continue;
            }
            if let Some(anchor) = anchor
                && path.extension().is_some_and(|e| e == "md")
                && !heading_ids(&read(&path)).contains(anchor)
            {
                broken.push(format!(
                    "{}: {target} (no such heading)",
                    document.display()
                ));
            }
        }
    }
    assert!(broken.is_empty(), "broken links: {broken:#?}");
}

/// The targets the Makefile defines.
fn make_targets() -> BTreeSet<String> {
    let rule = regex::Regex::new(r"(?m)^([a-z][a-z0-9-]*):([^=]|$)").expect("regex");
    rule.captures_iter(&read(&root().join("Makefile")))
        .map(|c| c[1].to_owned())
        .collect()
}

/// Every code block and span of the book and the README, with the file it is in.
fn code() -> Vec<(PathBuf, String)> {
    documents()
        .into_iter()
        .flat_map(|d| {
            let code = split(&read(&d)).code;
            code.into_iter().map(move |c| (d.clone(), c))
        })
        .collect()
}

#[test]
fn every_make_target_named_exists() {
    let targets = make_targets();
    // A command line: `make` first on a line (after variables set for it) or a code span.
    let invocation =
        regex::Regex::new(r"(?m)^\s*(?:[A-Z_]+=\S*\s+)*make((?:[ \t]+[^ \t\n]+)+)").expect("regex");
    let mut unknown = BTreeSet::new();
    for (document, code) in code() {
        for found in invocation.captures_iter(&code) {
            let names = found[1]
                .split_whitespace()
                .take_while(|w| !w.contains('=') && !w.starts_with(['-', '#', '&', '|', ';']));
            for name in names {
                if !targets.contains(name) {
                    unknown.insert(format!("{}: make {name}", document.display()));
                }
            }
        }
    }
    assert!(
        unknown.is_empty(),
        "make targets the Makefile lacks: {unknown:#?}"
    );
}

/// The long flags of the clap definitions in `source` (`#[arg(long ...)]` on a field, or
/// `long = "name"`).
fn source_flags(source: &str) -> BTreeSet<String> {
    let field =
        regex::Regex::new(r"^\s*(?:pub(?:\([a-z]+\))? )?([a-z_][a-z0-9_]*):").expect("regex");
    let named = regex::Regex::new(r#"long\s*=\s*"([a-z0-9-]+)""#).expect("regex");
    let mut flags = BTreeSet::new();
    let mut pending: Option<String> = None;
    for line in source.lines() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("#[arg(") && trimmed.contains("long") {
            pending = Some(String::new());
        }
        if let Some(attribute) = &mut pending {
            attribute.push_str(line);
            if let Some(name) = named.captures(attribute) {
                flags.insert(format!("--{}", &name[1]));
                pending = None;
            } else if let Some(field) = field.captures(line) {
                flags.insert(format!("--{}", field[1].replace('_', "-")));
                pending = None;
            }
        }
    }
    flags
}

/// Flags of the programs the book runs that are not capmox's: clusterctl, kubectl, cargo,
/// make, the Cluster API controllers and the kubelet.
const OTHER_TOOLS_FLAGS: &[&str] = &[
    // clusterctl
    "--flavor",
    "--infrastructure",
    "--ipam",
    "--include-crd",
    "--target-namespace",
    "--from",
    "--contract",
    // kubectl
    "--kubeconfig",
    "--type",
    "--field-selector",
    // cargo and the test harness
    "--test",
    "--bench",
    "--bin",
    "--locked",
    "--tests",
    "--benches",
    "--workspace",
    "--nocapture",
    "--root",
    "--version",
    // make
    "--no-print-directory",
    // Cluster API's controller managers, and the kubelet
    "--feature-gates",
    "--provider-id",
    // Linux perf, in the performance page's profiles
    "--call-graph",
];

/// Every flag the book may name: capmox's (from its command-line definition), the rigs' and
/// the bench's (from their sources), and the other tools'.
fn known_flags() -> BTreeSet<String> {
    use clap::CommandFactory;
    let mut flags: BTreeSet<String> = OTHER_TOOLS_FLAGS.iter().map(|f| (*f).to_owned()).collect();
    flags.insert("--help".to_owned());
    let mut commands = vec![capmox::cli::Cli::command()];
    while let Some(command) = commands.pop() {
        for arg in command.get_arguments() {
            if let Some(long) = arg.get_long() {
                flags.insert(format!("--{long}"));
            }
        }
        commands.extend(command.get_subcommands().cloned());
    }
    for source in [
        "crates/capmox-sandbox/src/main.rs",
        "crates/capmox-sandbox/src/e2e_real_main.rs",
        "crates/capmox-sim/src/main.rs",
        "benches/fleet/main.rs",
    ] {
        let found = source_flags(&read(&root().join(source)));
        assert!(!found.is_empty(), "no flags found in {source}");
        flags.extend(found);
    }
    flags
}

#[test]
fn every_flag_named_exists() {
    let known = known_flags();
    let flag = regex::Regex::new(r"(?:^|[\s(\[`=])(--[a-z][a-z0-9-]*)").expect("regex");
    let mut unknown = BTreeSet::new();
    for (document, code) in code() {
        for found in flag.captures_iter(&code) {
            if !known.contains(&found[1]) {
                unknown.insert(format!("{}: {}", document.display(), &found[1]));
            }
        }
    }
    assert!(unknown.is_empty(), "flags nothing defines: {unknown:#?}");
}

#[test]
fn every_repository_path_named_exists() {
    let path = regex::Regex::new(
        r"^(?:src|tests|crates|examples|templates|config|benches|hack|docs|crds)/[A-Za-z0-9_./-]+$",
    )
    .expect("regex");
    let mut missing = BTreeSet::new();
    for (document, code) in code() {
        let named = code.trim().trim_end_matches('/');
        if path.is_match(named) && !root().join(named).exists() {
            missing.insert(format!("{}: {named}", document.display()));
        }
    }
    assert!(missing.is_empty(), "paths that do not exist: {missing:#?}");
}

#[test]
fn the_readme_is_a_front_page() {
    let readme = read(&root().join("README.md"));
    let lines = readme.lines().count();
    assert!(
        lines <= README_MAX_LINES,
        "README.md has {lines} lines; keep it at most {README_MAX_LINES} and move the rest into the book (docs/)"
    );
    assert!(
        readme.contains("docs/src/"),
        "README.md should link to the book"
    );
}

/// Literals in `src/` that look like reasons (CamelCase words) but are not: kinds, condition
/// types, field and section names, units, HTTP words.
const NOT_REASONS: &[&str] = &[
    // systemd-networkd's `DHCP=` key.
    "DHCP",
    // An Event's type.
    "Normal",
    "Warning",
    // Kinds and their status types.
    "AdmissionReview",
    "Cluster",
    "ClusterStatus",
    "ConversionReview",
    "GlobalInClusterIPPool",
    "IPAddress",
    "IPAddressClaim",
    "InClusterIPPool",
    "InClusterIpPoolStatus",
    "IpAddressClaimStatus",
    "Machine",
    "MachineDeployment",
    "MachineSet",
    "MachineStatus",
    "KubeadmControlPlane",
    "ProxmoxCluster",
    "ProxmoxClusterStatus",
    "ProxmoxClusterTemplate",
    "ProxmoxMachine",
    "ProxmoxMachineStatus",
    "ProxmoxMachineTemplate",
    "ProxmoxMachineTemplateStatus",
    "ProxmoxRemediation",
    "ProxmoxRemediationStatus",
    "ProxmoxRemediationTemplate",
    "Node",
    "Secret",
    // Condition types and statuses.
    "CapacityResolved",
    "ControlPlaneEndpointAvailable",
    "FailureDomainsAvailable",
    "FailureDomainsReady",
    "OwnerRemediated",
    "Remediated",
    "ProxmoxAvailable",
    "VirtualMachineProvisioned",
    "True",
    "False",
    "Unknown",
    // Printer columns.
    "Age",
    "Phase",
    "Reboots",
    "Endpoint",
    // Node address types.
    "ExternalDNS",
    "ExternalIP",
    "InternalDNS",
    "InternalIP",
    // Kubernetes Status reasons of the webhooks' answers (not conditions).
    "BadRequest",
    "ConversionFailed",
    "Invalid",
    "NotFound",
    // Field error types of the validating webhook.
    "FieldValueForbidden",
    "FieldValueInvalid",
    "FieldValueRequired",
    // systemd-networkd sections and keys, Ignition and ISO names.
    "Address",
    "DNS",
    "Destination",
    "From",
    "Gateway",
    "IgnitionConfig",
    "Kind",
    "Link",
    "MACAddress",
    "MTUBytes",
    "Match",
    "Metric",
    "Name",
    "NetDev",
    "Network",
    "Priority",
    "Route",
    "RoutingPolicyRule",
    "Table",
    "To",
    "VRF",
    "CD001",
    "NoCloudFiles",
    // Units, families, HTTP and Proxmox words.
    "G",
    "Gi",
    "K",
    "Ki",
    "M",
    "Mi",
    "T",
    "Ti",
    "IPv4",
    "IPv6",
    "DELETE",
    "GET",
    "POST",
    "PUT",
    "OK",
    "WARNINGS",
    "HOSTNAME",
    "InvalidCertificate",
    // Debug names of types.
    "BootstrapData",
    "ProxmoxClient",
    "ServingCertificate",
];

/// CamelCase string literals of `src/` outside test code and outside the catalogue and docs
/// generators themselves, with where each is.
fn camel_case_literals() -> BTreeMap<String, String> {
    let literal = regex::Regex::new(r#""([A-Z][A-Za-z0-9]*)""#).expect("regex");
    let mut found = BTreeMap::new();
    let mut dirs = vec![root().join("src")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("src/") {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                if !path.ends_with("docs") {
                    dirs.push(path);
                }
                continue;
            }
            let name = path
                .file_name()
                .and_then(|n| n.to_str())
                .unwrap_or_default();
            if !name.ends_with(".rs") || name == "tests.rs" || path.ends_with("api/reasons.rs") {
                continue;
            }
            let text = read(&path);
            // Unit tests sit at the end of a file, in `mod tests`.
            let code = text
                .find("#[cfg(test)]\nmod tests {")
                .map_or(text.as_str(), |at| &text[..at]);
            for (number, line) in code.lines().enumerate() {
                if line.trim_start().starts_with("//") {
                    continue;
                }
                for capture in literal.captures_iter(line) {
                    found
                        .entry(capture[1].to_owned())
                        .or_insert_with(|| format!("{}:{}", path.display(), number + 1));
                }
            }
        }
    }
    found
}

#[test]
fn every_reason_the_source_sets_is_in_the_catalogue() {
    let catalogue: BTreeSet<&str> = capmox::api::reasons::REASONS
        .iter()
        .map(|r| r.name)
        .collect();
    let literals = camel_case_literals();
    let missing: Vec<String> = literals
        .iter()
        .filter(|(name, _)| {
            !catalogue.contains(name.as_str()) && !NOT_REASONS.contains(&name.as_str())
        })
        .map(|(name, at)| format!("{name} ({at})"))
        .collect();
    assert!(
        missing.is_empty(),
        "reasons without an entry in src/api/reasons.rs (add one, then `make docs-pages`; or, if \
         the literal is no reason, add it to NOT_REASONS in tests/it/docs.rs): {missing:#?}"
    );
    let stale: Vec<&&str> = catalogue
        .iter()
        .filter(|name| !literals.contains_key(**name))
        .collect();
    assert!(
        stale.is_empty(),
        "src/api/reasons.rs describes reasons the source no longer sets: {stale:?}"
    );
}

#[test]
fn the_markdown_reader_of_these_checks_sees_code_and_headings() {
    let text = "# A `b` [c](x.md)\n\nSee [d](#a-b-c), `make one two X=1`.\n\n```sh\nmake three\n```\n## A b c\n";
    let parts = split(text);
    assert!(parts.code.contains(&"make one two X=1".to_owned()));
    assert!(parts.code.contains(&"make three\n".to_owned()));
    assert!(!parts.prose.contains("make three"));
    assert_eq!(
        heading_ids(text),
        BTreeSet::from(["a-b-c".to_owned(), "a-b-c-1".to_owned()])
    );
}

/// Metric families as the manager registers them: from the source of the metrics module (every
/// `register(...)` and `family(...)` name and every `# TYPE` line it writes by hand), so a
/// family that only shows once it has samples is counted too.
fn registered_in_source() -> BTreeSet<String> {
    let source = read(&root().join("src/controller/metrics.rs"));
    let source = source
        .find("#[cfg(test)]\nmod tests {")
        .map_or(source.as_str(), |at| &source[..at]);
    let call = regex::Regex::new(r#"(?:register|family)\(\s*"([a-z_]+)""#).expect("regex");
    let typed = regex::Regex::new(r"# TYPE ([a-z_]+) ").expect("regex");
    call.captures_iter(source)
        .chain(typed.captures_iter(source))
        .map(|c| c[1].to_owned())
        .collect()
}

#[test]
fn the_metrics_page_describes_every_registered_metric_and_no_other() {
    let documented: BTreeMap<&str, &str> =
        capmox::docs::metrics::documented().into_iter().collect();
    let names: BTreeSet<String> = documented.keys().map(|n| (*n).to_owned()).collect();
    assert_eq!(
        registered_in_source(),
        names,
        "src/controller/metrics.rs registers these; describe each in src/docs/metrics.rs and run `make docs-pages`"
    );
    // What a running manager exposes, with samples in every family that has them on its own.
    let metrics = capmox::controller::Metrics::new()
        .with_proxmox(std::sync::Arc::new(capmox::proxmox::ClientRegistry::new()));
    let (store, _writer) = kube::runtime::reflector::store::<capmox::api::ProxmoxMachine>();
    metrics.work_queue("proxmoxmachine").observe(store);
    metrics.reconciled("proxmoxmachine", std::time::Duration::from_millis(5), true);
    let _running = metrics.reconcile_started("proxmoxmachine");
    let exposed: BTreeMap<String, String> = metrics
        .render()
        .lines()
        .filter_map(|line| {
            let mut words = line.strip_prefix("# TYPE ")?.split_whitespace();
            Some((words.next()?.to_owned(), words.next()?.to_owned()))
        })
        .collect();
    assert!(exposed.len() >= 8, "{exposed:?}");
    for (name, kind) in &exposed {
        assert_eq!(
            documented.get(name.as_str()).copied(),
            Some(kind.as_str()),
            "{name} is exposed as a {kind}"
        );
    }
}
