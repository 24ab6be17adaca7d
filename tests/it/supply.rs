//! Supply chain: `make sbom` describes every crate the product is built from, the image's base
//! images are pinned by digest, and the default image names no registry namespace anyone owns.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;

use crate::common::{cargo, run_ok, tool};

/// The platform the image ships (Dockerfile) and the SBOM describes.
const TARGET: &str = "x86_64-unknown-linux-musl";

/// `name version` → licence of each crate in `cargo tree -p capmox` over `edges`, without capmox.
fn product_tree(edges: &str) -> BTreeMap<String, String> {
    let out = run_ok(
        cargo()
            .args(["tree", "--locked", "--offline", "-p", "capmox", "-e", edges])
            .args([
                "--target", TARGET, "--prefix", "none", "--format", "{p}|{l}",
            ]),
        "cargo tree -p capmox",
    );
    let text = String::from_utf8(out.stdout).expect("UTF-8");
    let mut crates = BTreeMap::new();
    for line in text.lines().filter(|l| !l.is_empty()) {
        let (package, licence) = line.split_once('|').expect("{p}|{l}");
        let licence = licence.trim_end_matches(" (*)");
        let package = package.trim_end_matches(" (proc-macro)");
        if package.starts_with("capmox ") {
            continue;
        }
        assert!(
            !package.contains('('),
            "{package}: a dependency from outside crates.io"
        );
        let package = package.replacen(" v", " ", 1);
        crates.insert(package, licence.to_owned());
    }
    assert!(crates.contains_key("kube 5.0.0"), "not the tree:\n{text}");
    crates
}

#[test]
fn the_sbom_lists_every_crate_of_the_product_with_version_licence_and_crates_io_source() {
    let out = std::env::temp_dir().join(format!("capmox-sbom-{}", std::process::id()));
    run_ok(
        tool("make")
            .args(["--no-print-directory", "sbom"])
            .arg(format!("OUT={}", out.display())),
        "make sbom",
    );
    let text = std::fs::read_to_string(out.join("capmox.cdx.json")).expect("SBOM written");
    let _ = std::fs::remove_dir_all(&out);
    let sbom: Value = serde_json::from_str(&text).expect("the SBOM is JSON");
    assert_eq!(sbom["bomFormat"], "CycloneDX");
    assert_eq!(sbom["metadata"]["component"]["name"], "capmox");

    let mut listed = BTreeMap::new();
    for c in sbom["components"].as_array().expect("components") {
        let (name, version) = (c["name"].as_str(), c["version"].as_str());
        let (Some(name), Some(version)) = (name, version) else {
            panic!("a component without name or version: {c}");
        };
        assert_eq!(c["purl"], format!("pkg:cargo/{name}@{version}"), "{c}");
        assert_eq!(
            c["externalReferences"][0]["url"],
            format!("https://crates.io/crates/{name}/{version}"),
            "{c}"
        );
        let sha = c["hashes"][0]["content"].as_str().unwrap_or_default();
        assert!(sha.len() == 64, "{name} {version}: no Cargo.lock checksum");
        let licence = c["licenses"][0]["expression"].as_str().unwrap_or_default();
        listed.insert(format!("{name} {version}"), licence.to_owned());
    }

    // What links into the binary: every such crate is listed, with the licence it declares.
    for (package, licence) in product_tree("normal,no-proc-macro") {
        assert_eq!(
            listed.get(&package),
            Some(&licence),
            "{package} is in the product's dependency tree"
        );
    }
    // And nothing else: at most the proc-macros (and their dependencies) that build it.
    let with_macros: BTreeSet<String> = product_tree("normal").into_keys().collect();
    let extra: Vec<&String> = listed
        .keys()
        .filter(|p| !with_macros.contains(*p))
        .collect();
    assert!(extra.is_empty(), "not in the product's tree: {extra:?}");
}

/// The image references of the Dockerfile's `FROM` lines.
fn base_images(dockerfile: &str) -> Vec<String> {
    dockerfile
        .lines()
        .filter_map(|l| l.trim().strip_prefix("FROM "))
        .filter_map(|args| args.split_whitespace().find(|w| !w.starts_with("--")))
        .map(str::to_owned)
        .collect()
}

fn pinned_by_digest(image: &str) -> bool {
    image.split_once("@sha256:").is_some_and(|(name, digest)| {
        name.contains(':')
            && digest.len() == 64
            && digest
                .bytes()
                .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    })
}

#[test]
fn every_base_image_of_the_dockerfile_is_pinned_by_tag_and_digest() {
    let dockerfile = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("Dockerfile"),
    )
    .expect("Dockerfile");
    let images = base_images(&dockerfile);
    assert_eq!(images.len(), 2, "a build and a runtime stage: {images:?}");
    for image in images {
        assert!(
            pinned_by_digest(&image),
            "{image}: pin it as image:tag@sha256:<digest>"
        );
    }
    assert!(!pinned_by_digest(
        "gcr.io/distroless/static-debian12:nonroot"
    ));
    assert!(!pinned_by_digest("rust@sha256:abc"));
}

/// The image the release manifests run unless IMG says otherwise: config/manager's kustomize
/// `images` entry and the Makefile's CONFIG_IMG, which must agree.
#[test]
fn the_default_image_is_a_placeholder_that_no_registry_can_serve() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let kustomization = std::fs::read_to_string(root.join("config/manager/kustomization.yaml"))
        .expect("config/manager/kustomization.yaml");
    let value = |key: &str| {
        kustomization
            .lines()
            .find_map(|l| l.trim().strip_prefix(key))
            .map(str::trim)
            .unwrap_or_else(|| panic!("no {key} in config/manager/kustomization.yaml"))
    };
    let image = format!("{}:{}", value("newName:"), value("newTag:"));
    let makefile = std::fs::read_to_string(root.join("Makefile")).expect("Makefile");
    let config_img = makefile
        .lines()
        .find_map(|l| l.strip_prefix("CONFIG_IMG := "))
        .expect("CONFIG_IMG in the Makefile");
    assert_eq!(
        config_img, image,
        "the Makefile and config/manager disagree"
    );
    // RFC 2606: .invalid never resolves, so nobody's image can be pulled under this name.
    let registry = image.split('/').next().unwrap_or_default();
    assert!(
        registry.ends_with(".invalid"),
        "{image}: the default must not name a registry namespace someone could own"
    );
}
