//! The integration tests, in one binary so `make test` links the crate once for all of them.
//! One module per subject; `common` and `machine_support` are their shared helpers, and the
//! data they read is in `tests/data/`.

mod common;
mod machine_support;

mod api_validation;
mod bad_input;
mod bench_analysis;
mod capi_views;
mod cli;
mod cloudinit_iso;
mod cluster_controller;
mod cluster_logs;
mod conformance;
mod conversion;
mod crds;
mod dependencies;
mod ha;
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
mod sandbox;
mod sharding;
mod sim;
mod sim_ha;
mod sim_shapes;
mod soak;
mod standin;
mod standin_capmox;
mod supply;
mod task_names;
mod template_capacity;
mod tenancy;
mod testkit_controller;
mod testkit_crud;
mod testkit_faults;
mod testkit_http;
mod testkit_lifecycle;
mod testkit_patch;
mod testkit_watch;
mod webhook;
mod webhook_memory;

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
