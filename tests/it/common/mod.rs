#![allow(dead_code)]
//! Shared helpers for integration tests: a Proxmox fixture server and testkit fixtures.

pub mod env;
pub mod fixture_server;
pub mod logs;

use std::path::{Path, PathBuf};
use std::time::Duration;

use capmox_testkit::ApiServer;
use kube::CustomResource;
use kube::CustomResourceExt;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// A small namespaced test kind with a status subresource.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "example.com",
    version = "v1",
    kind = "Widget",
    namespaced,
    status = "WidgetStatus"
)]
#[kube(derive = "Default", derive = "PartialEq", shortname = "wd")]
pub struct WidgetSpec {
    pub size: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub color: Option<String>,
}

/// Status of [`Widget`].
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
pub struct WidgetStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
}

/// A cluster-scoped test kind without a status subresource.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(group = "example.com", version = "v1", kind = "Gadget")]
pub struct GadgetSpec {
    pub level: i64,
}

/// A server with the built-in kinds plus `Widget` and `Gadget`.
pub fn widget_server() -> ApiServer {
    let server = ApiServer::new();
    server.register_builtin_kinds();
    for crd in [Widget::crd(), Gadget::crd()] {
        let yaml = serde_yaml::to_string(&crd).expect("CRD serialises");
        server
            .register_crd_yaml(&yaml)
            .expect("generated CRD registers");
    }
    server
}

/// A path under the repository's `tests/data/`; panics naming it when it is missing, so a
/// test never passes without its data.
pub fn data(relative: &str) -> PathBuf {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(relative);
    assert!(
        path.exists(),
        "test data {} is missing (it is part of the repository)",
        path.display()
    );
    path
}

/// The kubectl that `make release-manifests` installs into `.venv`; panics saying how to get
/// it when it is absent.
pub fn kubectl() -> PathBuf {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/kubectl");
    assert!(
        path.is_file(),
        "{} is missing: run `make tools` (`make test` does) to install it",
        path.display()
    );
    path
}

/// A server with the upstream CAPI/IPAM CRDs and the Go provider's Proxmox CRDs.
pub fn upstream_server() -> ApiServer {
    let server = widget_server();
    for d in ["external-crds", "go-provider/crds"] {
        server
            .register_crd_dir(data(d))
            .expect("upstream CRDs register");
    }
    server
}

/// A dynamic API for a kind of the shared CRDs.
pub fn dynamic(
    client: &kube::Client,
    group: &str,
    version: &str,
    kind: &str,
    plural: &str,
    ns: Option<&str>,
) -> Api<DynamicObject> {
    let ar =
        ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(group, version, kind), plural);
    match ns {
        Some(ns) => Api::namespaced_with(client.clone(), ns, &ar),
        None => Api::all_with(client.clone(), &ar),
    }
}

/// A widget named `name` of a given size.
pub fn widget(name: &str, size: i64) -> Widget {
    Widget::new(name, WidgetSpec { size, color: None })
}

/// Upper bound for anything a test waits on.
pub const WAIT: Duration = Duration::from_secs(10);

/// The HTTP status code of a kube API error, or panic with the error.
pub fn code(err: kube::Error) -> (u16, String) {
    match err {
        kube::Error::Api(s) => (s.code, s.reason.clone()),
        other => panic!("expected an API error, got {other:?}"),
    }
}
