#![allow(dead_code)]
//! Shared by the test binaries that talk to the in-process API server (included with
//! `#[path]`, beside `paths.rs`): two small test kinds, servers that know them or the upstream
//! CRDs, and helpers for API errors.

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
        let yaml = serde_norway::to_string(&crd).expect("CRD serialises");
        server
            .register_crd_yaml(&yaml)
            .expect("generated CRD registers");
    }
    server
}

/// A server with the upstream CAPI/IPAM CRDs and the Go provider's Proxmox CRDs.
pub fn upstream_server() -> ApiServer {
    let server = widget_server();
    for d in ["external-crds", "go-provider/crds"] {
        server
            .register_crd_dir(crate::paths::data(d))
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
