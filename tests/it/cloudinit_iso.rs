//! The NoCloud seed image read back by an independent reader, `pycdlib` (pure Python, installed
//! from PyPI into the Makefile's `.venv` by `make tools`, which `make test` runs first): the
//! volume id, the Joliet and Rock Ridge file names cloud-init relies on, and every file's bytes.

use std::path::PathBuf;
use std::process::Command;

use capmox::cloudinit::iso::{NOCLOUD_VOLUME_ID, build_iso};
use capmox::cloudinit::{NoCloudFiles, build_nocloud_iso};
use capmox_sim::iso::IsoImage;
use serde::Deserialize;

/// Reads the image named by the first argument and prints what it holds as one JSON object.
const READER: &str = r#"
import io, json, sys
import pycdlib

iso = pycdlib.PyCdlib()
iso.open(sys.argv[1])

def files(key):
    found = {}
    for root, _dirs, names in iso.walk(**{key: "/"}):
        for name in names:
            data = io.BytesIO()
            iso.get_file_from_iso_fp(data, **{key: root.rstrip("/") + "/" + name})
            found[name] = list(data.getvalue())
    return found

print(json.dumps({
    "volume_id": iso.pvd.volume_identifier.decode("ascii").rstrip(" "),
    "joliet": iso.has_joliet(),
    "rock_ridge": iso.has_rock_ridge(),
    "rock_ridge_version": iso.rock_ridge,
    "joliet_files": files("joliet_path"),
    "rock_ridge_files": files("rr_path"),
}))
iso.close()
"#;

/// What pycdlib found in an image.
#[derive(Debug, Deserialize)]
pub(crate) struct Read {
    pub(crate) volume_id: String,
    pub(crate) joliet: bool,
    pub(crate) rock_ridge: bool,
    /// The Rock Ridge version pycdlib detected (`1.09`, `1.10` or `1.12`).
    pub(crate) rock_ridge_version: String,
    pub(crate) joliet_files: std::collections::BTreeMap<String, Vec<u8>>,
    pub(crate) rock_ridge_files: std::collections::BTreeMap<String, Vec<u8>>,
}

/// A temporary file removed on drop, unique per test so tests run in parallel.
struct TempIso(PathBuf);

impl TempIso {
    fn new(tag: &str, bytes: &[u8]) -> Self {
        let path =
            std::env::temp_dir().join(format!("capmox-cloudinit-{}-{tag}.iso", std::process::id()));
        std::fs::write(&path, bytes).expect("write the image");
        Self(path)
    }
}

impl Drop for TempIso {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Reads `image` back with pycdlib (`tag` makes its temporary file name unique).
pub(crate) fn read_back(tag: &str, image: &[u8]) -> Read {
    let iso = TempIso::new(tag, image);
    let out = Command::new(crate::common::venv_tool("python3"))
        .arg("-c")
        .arg(READER)
        .arg(&iso.0)
        .output()
        .expect("the virtualenv's python runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !stderr.contains("No module named 'pycdlib'"),
        "pycdlib is not installed in .venv: run `make tools`\n{stderr}"
    );
    assert!(
        out.status.success(),
        "pycdlib cannot read the image:\n{stderr}"
    );
    serde_json::from_slice(&out.stdout).expect("the reader prints JSON")
}

fn files(vendor: bool) -> NoCloudFiles {
    NoCloudFiles {
        user_data: b"#cloud-config\nruncmd:\n- [kubeadm, init]\n".to_vec(),
        meta_data:
            b"instance-id: 9b9f5a46-0c1d-4f7e-8b1a-1c2d3e4f5a6b\nlocal-hostname: m1\nhostname: m1\n"
                .to_vec(),
        // Bigger than a sector, so multi-sector extents are read back too.
        network_config: format!("network:\n  version: 2\n{}", "# padding\n".repeat(400))
            .into_bytes(),
        vendor_data: vendor.then(|| b"#cloud-config\npackages: [qemu-guest-agent]\n".to_vec()),
    }
}

fn expected(f: &NoCloudFiles) -> std::collections::BTreeMap<String, Vec<u8>> {
    let mut v = std::collections::BTreeMap::from([
        ("user-data".to_owned(), f.user_data.clone()),
        ("meta-data".to_owned(), f.meta_data.clone()),
        ("network-config".to_owned(), f.network_config.clone()),
    ]);
    if let Some(vd) = &f.vendor_data {
        v.insert("vendor-data".to_owned(), vd.clone());
    }
    v
}

/// Joliet names carry the ISO 9660 version suffix `;1`, which Linux drops when it mounts.
pub(crate) fn without_versions(
    files: std::collections::BTreeMap<String, Vec<u8>>,
) -> std::collections::BTreeMap<String, Vec<u8>> {
    files
        .into_iter()
        .map(|(name, bytes)| (name.trim_end_matches(";1").to_owned(), bytes))
        .collect()
}

fn check(tag: &str, f: &NoCloudFiles) {
    let read = read_back(tag, &build_nocloud_iso(f));
    assert_eq!(read.volume_id, "cidata");
    assert!(read.joliet, "no Joliet descriptor");
    assert!(
        read.rock_ridge,
        "no Rock Ridge (version {:?})",
        read.rock_ridge_version
    );
    let want = expected(f);
    assert_eq!(
        without_versions(read.joliet_files),
        want,
        "names and bytes read through Joliet"
    );
    assert_eq!(
        read.rock_ridge_files, want,
        "names and bytes read through Rock Ridge"
    );
}

#[test]
fn pycdlib_reads_the_three_nocloud_files_by_name() {
    check("three", &files(false));
}

#[test]
fn pycdlib_reads_vendor_data_when_given() {
    check("vendor", &files(true));
}

#[test]
fn pycdlib_reads_empty_files() {
    check(
        "empty",
        &NoCloudFiles {
            user_data: Vec::new(),
            meta_data: b"instance-id: x\n".to_vec(),
            network_config: Vec::new(),
            vendor_data: None,
        },
    );
}

#[test]
fn the_same_files_give_the_same_image() {
    assert_eq!(
        build_nocloud_iso(&files(true)),
        build_nocloud_iso(&files(true))
    );
}

const FILES: [(&str, &[u8]); 3] = [
    ("user-data", b"#cloud-config\nruncmd: []\n"),
    ("meta-data", b"instance-id: x\n"),
    ("network-config", b"network:\n  version: 2\n"),
];

#[test]
fn the_simulator_reader_finds_every_file_by_its_real_name() {
    let img = IsoImage::parse(&build_iso(NOCLOUD_VOLUME_ID, &FILES)).expect("parses");
    assert_eq!(img.volume_id, "cidata");
    assert_eq!(img.files.len(), 3);
    for (name, data) in FILES {
        assert_eq!(img.files.get(name).map(Vec::as_slice), Some(data), "{name}");
    }
}

#[test]
fn large_and_empty_files_keep_their_bytes() {
    let big: Vec<u8> = (0..5000u32).map(|i| (i % 251) as u8).collect();
    let iso = build_iso("cidata", &[("big", &big), ("empty", b"")]);
    let img = IsoImage::parse(&iso).expect("parses");
    assert_eq!(img.files.get("big"), Some(&big));
    assert_eq!(img.files.get("empty"), Some(&Vec::new()));
    assert_eq!(iso.len() % 2048, 0, "whole 2048-byte sectors");
}
