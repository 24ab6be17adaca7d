//! The dependency graph stays lean: one version each of the heavy networking and Kubernetes crates.

#[test]
fn no_duplicate_versions_of_core_crates() {
    let lock = std::fs::read_to_string("Cargo.lock").expect("Cargo.lock is committed");
    let lock: toml_like::Lock = toml_like::parse(&lock);
    for name in [
        "kube",
        "kube-client",
        "kube-runtime",
        "kube-core",
        "k8s-openapi",
        "hyper",
        "rustls",
        "tokio",
        "serde",
        "schemars",
    ] {
        let versions = lock.versions_of(name);
        assert_eq!(
            versions.len(),
            1,
            "{name} appears in Cargo.lock as {versions:?}; align the dependents"
        );
    }
}

/// Just enough of Cargo.lock's format: `[[package]]` blocks with `name = ".."` and `version = ".."`.
mod toml_like {
    pub struct Lock(Vec<(String, String)>);

    pub fn parse(text: &str) -> Lock {
        let mut packages = Vec::new();
        let mut name = None;
        for line in text.lines() {
            if line == "[[package]]" {
                name = None;
            } else if let Some(value) = line.strip_prefix("name = ") {
                name = Some(value.trim_matches('"').to_owned());
            } else if let (Some(value), Some(n)) = (line.strip_prefix("version = "), name.take()) {
                packages.push((n, value.trim_matches('"').to_owned()));
            }
        }
        Lock(packages)
    }

    impl Lock {
        pub fn versions_of(&self, name: &str) -> Vec<&str> {
            self.0
                .iter()
                .filter(|(n, _)| n == name)
                .map(|(_, v)| v.as_str())
                .collect()
        }
    }
}

/// The product's normal dependency tree holds none of the test rigs nor what only they need
/// (the CEL interpreter behind the schema checks).
#[test]
fn the_product_does_not_depend_on_its_test_rigs() {
    let out = crate::common::run_ok(
        crate::common::cargo()
            .args(["tree", "--locked", "--offline", "-p", "capmox"])
            .args(["-e", "normal", "--prefix", "none"]),
        "cargo tree -p capmox -e normal",
    );
    let tree = String::from_utf8(out.stdout).expect("UTF-8");
    let crates: std::collections::BTreeSet<&str> = tree
        .lines()
        .filter_map(|line| line.split_whitespace().next())
        .collect();
    assert!(crates.contains("kube"), "not a dependency tree:\n{tree}");
    for rig in [
        "capmox-sim",
        "capmox-testkit",
        "capmox-sandbox",
        "kube-cel",
        "cel",
        "antlr4rust",
    ] {
        assert!(
            !crates.contains(rig),
            "the product depends on {rig}:\n{tree}"
        );
    }
}
