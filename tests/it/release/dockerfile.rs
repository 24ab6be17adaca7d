//! The Dockerfile's build stage copies everything `cargo build` of the binary needs.

use super::*;

/// The source paths of the `COPY` lines of the Dockerfile's build stage, each with where it
/// lands relative to the build's working directory.
fn build_stage_copies(dockerfile: &str) -> Vec<(String, String)> {
    let mut copies = Vec::new();
    let mut stages = 0;
    for line in dockerfile.lines().map(str::trim) {
        if line.starts_with("FROM ") {
            stages += 1;
        }
        let Some(arguments) = line.strip_prefix("COPY ") else {
            continue;
        };
        if stages != 1 || arguments.starts_with("--") {
            continue;
        }
        let words: Vec<&str> = arguments.split_whitespace().collect();
        let (destination, sources) = words.split_last().expect("COPY <source>... <destination>");
        for source in sources {
            let target = if destination.ends_with('/') {
                format!("{destination}{source}")
            } else {
                (*destination).to_owned()
            };
            copies.push(((*source).to_owned(), target));
        }
    }
    copies
}

/// Copies a file or a directory tree, keeping modification times so that cargo finds a
/// previous check of the same copy fresh.
fn copy_tree(from: &Path, to: &Path) {
    if from.is_dir() {
        std::fs::create_dir_all(to).expect("create a directory");
        for entry in std::fs::read_dir(from).expect("read a directory") {
            let entry = entry.expect("directory entry");
            copy_tree(&entry.path(), &to.join(entry.file_name()));
        }
    } else {
        std::fs::copy(from, to).unwrap_or_else(|e| panic!("cannot copy {}: {e}", from.display()));
        let modified = std::fs::metadata(from)
            .and_then(|m| m.modified())
            .expect("modification time");
        std::fs::File::options()
            .write(true)
            .open(to)
            .and_then(|f| f.set_modified(modified))
            .expect("keep the modification time");
    }
}

#[test]
fn the_dockerfile_build_context_builds_the_binary() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dockerfile = std::fs::read_to_string(root.join("Dockerfile")).expect("Dockerfile");
    assert!(
        dockerfile.contains("--bin capmox"),
        "the image builds the capmox binary"
    );
    let copies = build_stage_copies(&dockerfile);
    assert!(copies.len() >= 2, "COPY lines found: {copies:?}");
    // The repository's own target directory, so what is already built is reused.
    let metadata = run_ok(
        cargo().args(["metadata", "--format-version=1", "--no-deps", "--offline"]),
        "cargo metadata",
    );
    let metadata: Value = serde_json::from_slice(&metadata.stdout).expect("metadata is JSON");
    let target_directory = metadata["target_directory"]
        .as_str()
        .expect("target_directory");
    // The copy sits at the same path on every run (one per checkout), so cargo reuses its
    // previous check unless a source changed.
    let checkout = {
        use std::hash::{Hash, Hasher};
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        root.hash(&mut hasher);
        hasher.finish()
    };
    let context =
        TempDir::at(Path::new(target_directory).join(format!("docker-context-{checkout:016x}")));
    for (source, target) in &copies {
        copy_tree(&root.join(source), &context.0.join(target));
    }
    run_ok(
        cargo()
            .args([
                "check",
                "--locked",
                "--offline",
                "--quiet",
                "--bin",
                "capmox",
            ])
            .arg("--manifest-path")
            .arg(context.0.join("Cargo.toml"))
            .env("CARGO_TARGET_DIR", target_directory),
        &format!("cargo check of the Dockerfile's build context (COPY lines {copies:?})"),
    );
}
