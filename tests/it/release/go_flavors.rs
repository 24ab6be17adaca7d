//! A flavor named like one of the Go provider's takes that flavor's variables unchanged, so a
//! user's clusterctl settings keep working: it uses every variable the Go flavor uses, and
//! requires none the Go flavor leaves out or defaults (issue 29: multiple-vlans required
//! `NODE_SECONDARY_IP_RANGES` and `SECONDARY_VLAN`). The Go flavors are in
//! `tests/data/go-provider/templates/` (see its SOURCES.md).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use super::{TEMPLATES, read_out};

/// The Go provider's flavors at the copied commit that capmox has a namesake of (it also ships
/// calico, cilium and cilium-load-balancer flavors, which capmox does not).
const GO_NAMESAKES: &[&str] = &[
    "cluster-template.yaml",
    "cluster-template-auto-image.yaml",
    "cluster-template-dual-stack.yaml",
    "cluster-template-external-creds.yaml",
    "cluster-template-flatcar.yaml",
    "cluster-template-multiple-vlans.yaml",
    "cluster-template-proxmox-labels.yaml",
];

/// The variables of a template as clusterctl v1.13 reads them (its `SimpleProcessor`, on
/// drone/envsubst): every name, spaces around it dropped as clusterctl's legacy form allows,
/// with the default of its first occurrence; `None` when that occurrence has no default or an
/// empty one, which clusterctl then requires (`${VAR:=}` is required). `$${` is a literal.
fn clusterctl_variables(text: &str) -> BTreeMap<String, Option<String>> {
    let mut found = BTreeMap::new();
    let bytes = text.as_bytes();
    let mut at = 0;
    while let Some(start) = text[at..].find("${").map(|s| s + at) {
        let escaped = start > 0 && bytes[start - 1] == b'$';
        let end = closing_brace(text, start + 2).expect("a closing brace");
        at = if escaped { start + 2 } else { end + 1 };
        if escaped {
            continue;
        }
        let expression = text[start + 2..end].trim();
        let name_end = expression
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(expression.len());
        let (name, rest) = expression.split_at(name_end);
        let default = [":=", ":-", "=", "-"]
            .iter()
            .find_map(|op| rest.strip_prefix(op))
            .filter(|d| !d.is_empty())
            .map(str::to_owned);
        found.entry(name.to_owned()).or_insert(default);
    }
    found
}

/// Where the `}` closing a `${` whose expression starts at `from` is (nested `${…}` allowed).
fn closing_brace(text: &str, from: usize) -> Option<usize> {
    let mut depth = 0;
    let bytes = text.as_bytes();
    for i in from..bytes.len() {
        match bytes[i] {
            b'{' if i > 0 && bytes[i - 1] == b'$' => depth += 1,
            b'}' if depth == 0 => return Some(i),
            b'}' => depth -= 1,
            _ => {}
        }
    }
    None
}

fn required(variables: &BTreeMap<String, Option<String>>) -> BTreeSet<&str> {
    variables
        .iter()
        .filter(|(_, default)| default.is_none())
        .map(|(name, _)| name.as_str())
        .collect()
}

fn go_flavor(file: &str) -> Option<String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/go-provider/templates")
        .join(format!("templates_{file}"));
    std::fs::read_to_string(path).ok()
}

#[test]
fn every_flavor_takes_its_go_namesakes_variables() {
    let mut compared = Vec::new();
    let mut problems = Vec::new();
    for file in TEMPLATES {
        let Some(go) = go_flavor(file) else {
            continue;
        };
        compared.push(*file);
        let go = clusterctl_variables(&go);
        let ours = clusterctl_variables(&read_out(file));
        for name in go.keys().filter(|name| !ours.contains_key(*name)) {
            problems.push(format!("{file}: the Go flavor's {name} is not used"));
        }
        for name in required(&ours).difference(&required(&go)) {
            let why = if go.contains_key(*name) {
                "the Go flavor defaults it"
            } else {
                "the Go flavor has no such variable"
            };
            problems.push(format!("{file}: requires {name}, but {why}"));
        }
    }
    assert!(
        problems.is_empty(),
        "a Go provider user's variables do not fit: {problems:#?}"
    );
    compared.sort_unstable();
    let mut namesakes = GO_NAMESAKES.to_vec();
    namesakes.sort_unstable();
    assert_eq!(
        compared, namesakes,
        "the flavors compared with the Go provider's"
    );
}

/// clusterctl's reading of variables, on the forms the templates use.
#[test]
fn variables_are_read_as_clusterctl_reads_them() {
    let text = "a: ${A}\nb: ${ B }\nc: ${C:=1}\nd: ${D=\"\"}\ne: ${E:=}\nf: $${F}\n\
                g: ${G:=${A}}\nc2: ${C}\nh: ${H}\nh2: ${H:=later}\n";
    let read = clusterctl_variables(text);
    let expected: BTreeMap<String, Option<String>> = [
        ("A", None),
        ("B", None),
        ("C", Some("1")),
        ("D", Some("\"\"")),
        ("E", None),
        ("G", Some("${A}")),
        ("H", None),
    ]
    .into_iter()
    .map(|(name, default)| (name.to_owned(), default.map(str::to_owned)))
    .collect();
    assert_eq!(read, expected);
}
