//! The NoCloud seed image read back by an independent reader, `isoinfo` (Debian package
//! `genisoimage`): the volume id, the Joliet and Rock Ridge file names cloud-init relies on, and
//! every file's bytes. `.ci/run` installs the tool; without it these tests fail, naming the fix.

use std::path::PathBuf;
use std::process::Command;

use capmox::cloudinit::{NoCloudFiles, build_nocloud_iso};

const INSTALL: &str = "apt-get update && apt-get install -y genisoimage";

fn isoinfo(args: &[&str]) -> Vec<u8> {
    let out = Command::new("isoinfo")
        .args(args)
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot run isoinfo ({e}); install it with `{INSTALL}` (as .ci/run does)")
        });
    assert!(
        out.status.success(),
        "isoinfo {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
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

    fn path(&self) -> &str {
        self.0.to_str().expect("temp dir is UTF-8")
    }
}

impl Drop for TempIso {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
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

fn expected(f: &NoCloudFiles) -> Vec<(&'static str, Vec<u8>)> {
    let mut v = vec![
        ("user-data", f.user_data.clone()),
        ("meta-data", f.meta_data.clone()),
        ("network-config", f.network_config.clone()),
    ];
    if let Some(vd) = &f.vendor_data {
        v.push(("vendor-data", vd.clone()));
    }
    v
}

/// Names listed by `isoinfo -l` with the given extension flag (`-J` or `-R`), versions stripped.
fn listed_names(iso: &TempIso, flag: &str) -> Vec<String> {
    let listing = String::from_utf8(isoinfo(&[flag, "-l", "-i", iso.path()])).expect("UTF-8");
    let mut names: Vec<String> = listing
        .lines()
        .filter(|l| l.starts_with('-')) // regular files: "-r--r--r-- ... [ extent 00] name"
        .filter_map(|l| l.rsplit("] ").next())
        .map(|n| n.trim().trim_end_matches(";1").to_owned())
        .collect();
    names.sort();
    names
}

fn check(tag: &str, f: &NoCloudFiles) {
    let iso = TempIso::new(tag, &build_nocloud_iso(f));
    let want = expected(f);
    let mut want_names: Vec<String> = want.iter().map(|(n, _)| (*n).to_owned()).collect();
    want_names.sort();

    let header = String::from_utf8(isoinfo(&["-d", "-i", iso.path()])).expect("UTF-8");
    assert!(
        header.lines().any(|l| l.trim() == "Volume id: cidata"),
        "volume id is not cidata:\n{header}"
    );
    assert!(header.contains("Joliet"), "no Joliet descriptor:\n{header}");
    assert!(header.contains("Rock Ridge"), "no Rock Ridge:\n{header}");

    assert_eq!(listed_names(&iso, "-J"), want_names, "Joliet names");
    assert_eq!(listed_names(&iso, "-R"), want_names, "Rock Ridge names");
    for (name, bytes) in &want {
        let path = format!("/{name}");
        assert_eq!(
            &isoinfo(&["-J", "-x", &path, "-i", iso.path()]),
            bytes,
            "{name} read through Joliet"
        );
        assert_eq!(
            &isoinfo(&["-R", "-x", &path, "-i", iso.path()]),
            bytes,
            "{name} read through Rock Ridge"
        );
    }
}

#[test]
fn isoinfo_reads_the_three_nocloud_files_by_name() {
    check("three", &files(false));
}

#[test]
fn isoinfo_reads_vendor_data_when_given() {
    check("vendor", &files(true));
}

#[test]
fn isoinfo_reads_empty_files() {
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
