//! capmox's integration tests, in one binary so `make test` links the crate once for all of
//! them. One module per subject; `common` and `machine_support` are their shared helpers,
//! `tests/support/` what they share with the rig crates' tests (`crates/*/tests/`), and the data
//! they read is in `tests/data/`.

#[path = "../support/paths.rs"]
mod paths;

mod common;
mod machine_support;

mod api_validation;
mod bad_input;
mod bench_analysis;
mod bench_go_fleet;
mod capi_views;
mod cli;
mod cloudinit_iso;
mod cluster_controller;
mod cluster_logs;
mod conformance;
mod conversion;
mod crds;
mod data_disks;
mod dependencies;
mod docs;
mod ha;
mod hardware;
mod hostile_input;
mod ignition;
mod leader_election;
mod listeners;
mod log_capture;
mod machine_budget;
mod machine_cluster_gone;
mod machine_controller;
mod machine_crash;
mod machine_errors;
mod machine_events;
mod machine_move;
mod machine_smbios;
mod manager_endpoints;
mod multi_site;
mod no_zones;
mod proxmox_fixtures;
mod proxmox_tls;
mod rbac;
mod release;
mod remediation;
mod sharding;
mod soak;
mod supply;
mod task_limits;
mod task_names;
mod template_capacity;
mod tenancy;
mod webhook;
mod webhook_memory;
mod zone_health;

/// Every `.rs` file beside this one is a module of this binary (a file left out would never
/// compile or run), and no test file sits directly in `tests/` (it would link a binary of its own).
#[test]
fn every_test_file_is_a_module_of_this_binary() {
    let tests = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests");
    let rust_files = |dir: &std::path::Path| -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap_or_else(|e| panic!("cannot read {}: {e}", dir.display()))
            .map(|entry| entry.expect("directory entry").path())
            .filter(|path| path.extension().is_some_and(|ext| ext == "rs"))
            .filter_map(|path| Some(path.file_stem()?.to_str()?.to_owned()))
            .collect();
        names.sort();
        names
    };
    assert_eq!(
        rust_files(&tests),
        Vec::<String>::new(),
        "put integration tests in tests/it/ as modules of main.rs"
    );
    let main = include_str!("main.rs");
    let modules = rust_files(&tests.join("it"));
    assert!(modules.len() > 30, "found only {modules:?}");
    for module in modules.iter().filter(|m| *m != "main") {
        assert!(
            main.contains(&format!("\nmod {module};\n")),
            "tests/it/{module}.rs is not declared in tests/it/main.rs"
        );
    }
}

/// Each rig crate under `crates/` has its tests in one binary, `tests/<name>/main.rs`, whose
/// modules are every file beside it, as this binary does; and `tests/it` holds capmox's own.
#[test]
fn every_rig_crate_has_one_test_binary_with_every_file_in_it() {
    let crates = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("crates");
    let entries = |dir: &std::path::Path| -> Vec<std::path::PathBuf> {
        let mut paths: Vec<_> = std::fs::read_dir(dir)
            .unwrap_or_else(|e| panic!("cannot read {}: {e}", dir.display()))
            .map(|entry| entry.expect("directory entry").path())
            .collect();
        paths.sort();
        paths
    };
    for krate in entries(&crates).into_iter().filter(|p| p.is_dir()) {
        let tests = krate.join("tests");
        let (dirs, files): (Vec<_>, Vec<_>) = entries(&tests).into_iter().partition(|p| p.is_dir());
        assert_eq!(
            files,
            Vec::<std::path::PathBuf>::new(),
            "{}: put the tests in the crate's one test binary directory",
            tests.display()
        );
        assert_eq!(
            dirs.len(),
            1,
            "{}: one test binary, found {dirs:?}",
            tests.display()
        );
        let main = std::fs::read_to_string(dirs[0].join("main.rs"))
            .unwrap_or_else(|e| panic!("{}/main.rs: {e}", dirs[0].display()));
        for file in entries(&dirs[0]) {
            let Some(module) = file.file_stem().and_then(|s| s.to_str()) else {
                continue;
            };
            if file.extension().is_some_and(|e| e == "rs") && module != "main" {
                assert!(
                    main.contains(&format!("\nmod {module};\n")),
                    "{} is not a module of {}/main.rs",
                    file.display(),
                    dirs[0].display()
                );
            }
        }
    }
}
