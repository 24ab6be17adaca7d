//! CRD conversion through the in-process API server: a toy kind `Gadget` with two versions,
//! `v1` (`spec.size`, an integer) and `v2` (`spec.sizeText`, a string; the storage version),
//! converted by a fake HTTPS conversion webhook served by the test's own runtime.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use capmox_testkit::ApiServer;
use futures::{StreamExt, TryStreamExt};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use kube::api::{
    Api, ApiResource, DynamicObject, GroupVersionKind, ListParams, Patch, PatchParams, PostParams,
    WatchEvent, WatchParams,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use serde_json::{Value, json};

const CA: &str = include_str!("../../../../tests/data/tls/ca.pem");
const NODE_CERT: &str = include_str!("../../../../tests/data/tls/node.pem");
const NODE_KEY: &str = include_str!("../../../../tests/data/tls/node.key");
const WAIT: Duration = Duration::from_secs(10);

/// How the fake webhook answers.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Mode {
    Convert,
    Fail,
    Rename,
    WrongUid,
}

struct Webhook {
    port: u16,
    mode: Arc<Mutex<Mode>>,
    calls: Arc<AtomicUsize>,
    /// The number of objects of each review, in order.
    batches: Arc<Mutex<Vec<usize>>>,
}

impl Webhook {
    fn set(&self, mode: Mode) {
        *self.mode.lock().unwrap() = mode;
    }
}

fn convert_object(mut obj: Value, desired: &str) -> Value {
    let spec = obj["spec"].take();
    obj["spec"] = if desired.ends_with("/v2") {
        match spec["size"].as_i64() {
            Some(n) => json!({"sizeText": n.to_string()}),
            None => json!({}),
        }
    } else {
        match spec["sizeText"]
            .as_str()
            .and_then(|t| t.parse::<i64>().ok())
        {
            Some(n) => json!({"size": n}),
            None => json!({}),
        }
    };
    obj["apiVersion"] = json!(desired);
    obj
}

fn review_answer(review: &Value, mode: Mode) -> Value {
    let req = &review["request"];
    let desired = req["desiredAPIVersion"].as_str().unwrap_or_default();
    let uid = match mode {
        Mode::WrongUid => json!("not-the-request-uid"),
        _ => req["uid"].clone(),
    };
    if mode == Mode::Fail {
        return json!({"apiVersion": "apiextensions.k8s.io/v1", "kind": "ConversionReview",
            "response": {"uid": uid, "result": {"status": "Failure", "message": "boom: cannot convert"}}});
    }
    let converted: Vec<Value> = req["objects"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| {
            let mut c = convert_object(o.clone(), desired);
            if mode == Mode::Rename {
                c["metadata"]["name"] = json!("renamed");
            }
            // Webhooks may change labels, not other metadata.
            c["metadata"]["labels"]["converted-by"] = json!("webhook");
            c
        })
        .collect();
    json!({"apiVersion": "apiextensions.k8s.io/v1", "kind": "ConversionReview",
        "response": {"uid": uid, "result": {"status": "Success"}, "convertedObjects": converted}})
}

/// Serve the fake webhook over HTTPS on 127.0.0.1 with an OS-chosen port.
async fn start_webhook() -> Webhook {
    let certs = CertificateDer::pem_slice_iter(NODE_CERT.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .unwrap();
    let key = PrivateKeyDer::from_pem_slice(NODE_KEY.as_bytes()).unwrap();
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(certs, key)
    .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let hook = Webhook {
        port,
        mode: Arc::new(Mutex::new(Mode::Convert)),
        calls: Arc::default(),
        batches: Arc::default(),
    };
    let (mode, calls, batches) = (hook.mode.clone(), hook.calls.clone(), hook.batches.clone());
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            let acceptor = acceptor.clone();
            let (mode, calls, batches) = (mode.clone(), calls.clone(), batches.clone());
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let service = hyper::service::service_fn(
                    move |req: hyper::Request<hyper::body::Incoming>| {
                        let (mode, calls, batches) = (mode.clone(), calls.clone(), batches.clone());
                        async move {
                            assert_eq!(req.uri().path(), "/convert");
                            let body = req.into_body().collect().await?.to_bytes();
                            let review: Value = serde_json::from_slice(&body).unwrap();
                            calls.fetch_add(1, Ordering::SeqCst);
                            batches
                                .lock()
                                .unwrap()
                                .push(review["request"]["objects"].as_array().unwrap().len());
                            let mode = *mode.lock().unwrap();
                            let answer = review_answer(&review, mode).to_string();
                            Ok::<_, hyper::Error>(hyper::Response::new(Full::new(Bytes::from(
                                answer,
                            ))))
                        }
                    },
                );
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(tls), service)
                    .await;
            });
        }
    });
    hook
}

fn ca_bundle() -> String {
    let b = serde_json::to_value(k8s_openapi::ByteString(CA.as_bytes().to_vec())).unwrap();
    b.as_str().unwrap().to_string()
}

/// The Gadget CRD, with a `spec.conversion` section given as YAML (indented for `spec:`).
fn crd(conversion: &str) -> String {
    format!(
        r#"
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata: {{name: gadgets.toys.example.com}}
spec:
  group: toys.example.com
  names: {{kind: Gadget, listKind: GadgetList, plural: gadgets, singular: gadget}}
  scope: Namespaced
{conversion}
  versions:
  - name: v1
    served: true
    storage: false
    subresources: {{status: {{}}}}
    additionalPrinterColumns:
    - {{name: Size, type: integer, jsonPath: .spec.size}}
    schema:
      openAPIV3Schema:
        type: object
        properties:
          spec: {{type: object, properties: {{size: {{type: integer}}}}}}
          status: {{type: object, x-kubernetes-preserve-unknown-fields: true}}
  - name: v2
    served: true
    storage: true
    subresources: {{status: {{}}}}
    schema:
      openAPIV3Schema:
        type: object
        properties:
          spec: {{type: object, properties: {{sizeText: {{type: string}}}}}}
          status: {{type: object, x-kubernetes-preserve-unknown-fields: true}}
"#
    )
}

fn url_conversion(port: u16) -> String {
    format!(
        "  conversion:\n    strategy: Webhook\n    webhook:\n      conversionReviewVersions: [v1]\n      clientConfig:\n        url: https://127.0.0.1:{port}/convert\n        caBundle: {}\n",
        ca_bundle()
    )
}

fn api(server: &ApiServer, version: &str) -> Api<DynamicObject> {
    let ar = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("toys.example.com", version, "Gadget"),
        "gadgets",
    );
    Api::namespaced_with(server.client(), "default", &ar)
}

fn gadget(version: &str, name: &str, spec: Value) -> DynamicObject {
    let ar = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("toys.example.com", version, "Gadget"),
        "gadgets",
    );
    DynamicObject::new(name, &ar).data(json!({ "spec": spec }))
}

fn api_error(e: kube::Error) -> (u16, String, String) {
    match e {
        kube::Error::Api(s) => (s.code, s.reason.clone(), s.message.clone()),
        other => panic!("expected an API error, got {other:?}"),
    }
}

async fn url_server() -> (ApiServer, Webhook) {
    let hook = start_webhook().await;
    let server = ApiServer::new();
    server.register_builtin_kinds();
    server
        .register_crd_yaml(&crd(&url_conversion(hook.port)))
        .unwrap();
    (server, hook)
}

#[tokio::test]
async fn webhook_converts_creates_reads_lists_patches_and_watches() {
    let (server, hook) = url_server().await;
    let (v1, v2) = (api(&server, "v1"), api(&server, "v2"));
    let mut watch = v1
        .watch(&WatchParams::default(), "0")
        .await
        .unwrap()
        .boxed();

    // Created in v1, stored in v2, read back in v1 as sent.
    let created = v1
        .create(
            &PostParams::default(),
            &gadget("v1", "g1", json!({"size": 3})),
        )
        .await
        .unwrap();
    assert_eq!(
        created.types.as_ref().unwrap().api_version,
        "toys.example.com/v1"
    );
    assert_eq!(created.data["spec"], json!({"size": 3}));
    let stored = server.object("gadgets", "default", "g1").unwrap().unwrap();
    assert_eq!(stored["apiVersion"], "toys.example.com/v2");
    assert_eq!(stored["spec"], json!({"sizeText": "3"}));
    assert_eq!(
        stored["metadata"]["labels"]["converted-by"], "webhook",
        "labels the webhook sets are kept"
    );
    let read = v1.get("g1").await.unwrap();
    assert_eq!(read.data["spec"], json!({"size": 3}));
    assert_eq!(read.metadata.uid, created.metadata.uid);
    assert_eq!(
        v2.get("g1").await.unwrap().data["spec"],
        json!({"sizeText": "3"})
    );

    // A list in v1 converts every item in one review.
    v2.create(
        &PostParams::default(),
        &gadget("v2", "g2", json!({"sizeText": "7"})),
    )
    .await
    .unwrap();
    hook.batches.lock().unwrap().clear();
    let list = v1.list(&ListParams::default()).await.unwrap();
    let sizes: Vec<Value> = list.items.iter().map(|o| o.data["spec"].clone()).collect();
    assert_eq!(sizes, [json!({"size": 3}), json!({"size": 7})]);
    // (The v1 watch converts g2's ADDED event on its own meanwhile.)
    assert!(
        hook.batches.lock().unwrap().contains(&2),
        "one review for the list"
    );

    // A patch in v1 applies to the v1 form and is stored in v2.
    let patched = v1
        .patch(
            "g1",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"size": 5}})),
        )
        .await
        .unwrap();
    assert_eq!(patched.data["spec"], json!({"size": 5}));
    assert_eq!(patched.metadata.generation, Some(2));
    let stored = server.object("gadgets", "default", "g1").unwrap().unwrap();
    assert_eq!(stored["spec"], json!({"sizeText": "5"}));

    // A status write in v1 keeps the spec.
    let mut with_status = v1.get("g1").await.unwrap();
    with_status.data["status"] = json!({"phase": "Ready"});
    let replaced = v1
        .replace_status("g1", &PostParams::default(), &with_status)
        .await
        .unwrap();
    assert_eq!(replaced.data["status"]["phase"], "Ready");
    assert_eq!(replaced.data["spec"], json!({"size": 5}));

    // The v1 watch saw everything in v1.
    let mut seen = Vec::new();
    while seen.len() < 4 {
        let event = tokio::time::timeout(WAIT, watch.try_next())
            .await
            .expect("a watch event")
            .unwrap()
            .expect("the watch goes on");
        let (kind, obj) = match event {
            WatchEvent::Added(o) => ("ADDED", o),
            WatchEvent::Modified(o) => ("MODIFIED", o),
            other => panic!("unexpected {other:?}"),
        };
        assert_eq!(obj.types.unwrap().api_version, "toys.example.com/v1");
        seen.push((kind, obj.metadata.name.unwrap(), obj.data["spec"].clone()));
    }
    assert_eq!(
        seen,
        [
            ("ADDED", "g1".to_string(), json!({"size": 3})),
            ("ADDED", "g2".to_string(), json!({"size": 7})),
            ("MODIFIED", "g1".to_string(), json!({"size": 5})),
            ("MODIFIED", "g1".to_string(), json!({"size": 5})),
        ]
    );

    // Objects are only ever stored in the storage version.
    let crd = server
        .object("customresourcedefinitions", "", "gadgets.toys.example.com")
        .unwrap()
        .unwrap();
    assert_eq!(crd["status"]["storedVersions"], json!(["v2"]));
    assert!(hook.calls.load(Ordering::SeqCst) > 0);
}

#[tokio::test]
async fn server_side_apply_in_a_converted_version_keeps_ownership() {
    let (server, _hook) = url_server().await;
    let v1 = api(&server, "v1");
    let apply = |size: i64| {
        Patch::Apply(
            json!({"apiVersion": "toys.example.com/v1", "kind": "Gadget",
            "metadata": {"name": "g"}, "spec": {"size": size}}),
        )
    };
    let first = v1
        .patch("g", &PatchParams::apply("one"), &apply(1))
        .await
        .unwrap();
    assert_eq!(first.data["spec"], json!({"size": 1}));
    let again = v1
        .patch("g", &PatchParams::apply("one"), &apply(2))
        .await
        .unwrap();
    assert_eq!(again.data["spec"], json!({"size": 2}));
    let managers: Vec<_> = again
        .metadata
        .managed_fields
        .unwrap_or_default()
        .into_iter()
        .map(|m| (m.manager.unwrap(), m.api_version.unwrap()))
        .collect();
    assert!(
        managers.contains(&("one".into(), "toys.example.com/v1".into())),
        "{managers:?}"
    );
    let (code, reason, _) = api_error(
        v1.patch("g", &PatchParams::apply("two"), &apply(3))
            .await
            .unwrap_err(),
    );
    assert_eq!((code, reason.as_str()), (409, "Conflict"));
    let forced = v1
        .patch("g", &PatchParams::apply("two").force(), &apply(3))
        .await
        .unwrap();
    assert_eq!(forced.data["spec"], json!({"size": 3}));
    let stored = server.object("gadgets", "default", "g").unwrap().unwrap();
    assert_eq!(stored["spec"], json!({"sizeText": "3"}));
    // An apply in another version than the URL's is refused, as on a real server.
    let (code, _, message) = api_error(
        v1.patch(
            "g",
            &PatchParams::apply("one"),
            &Patch::Apply(
                json!({"apiVersion": "toys.example.com/v2", "kind": "Gadget",
                "metadata": {"name": "g"}, "spec": {"sizeText": "4"}}),
            ),
        )
        .await
        .unwrap_err(),
    );
    assert_eq!(code, 400, "{message}");
}

#[tokio::test]
async fn webhook_failures_answer_500_internal_error() {
    let (server, hook) = url_server().await;
    let (v1, v2) = (api(&server, "v1"), api(&server, "v2"));
    // Stored in the storage version without conversion.
    v2.create(
        &PostParams::default(),
        &gadget("v2", "g", json!({"sizeText": "1"})),
    )
    .await
    .unwrap();

    hook.set(Mode::Fail);
    let (code, reason, message) = api_error(v1.get("g").await.unwrap_err());
    assert_eq!((code, reason.as_str()), (500, "InternalError"));
    assert_eq!(
        message,
        "conversion webhook for toys.example.com/v2, Kind=Gadget failed: boom: cannot convert"
    );
    let (code, _, message) = api_error(
        v1.create(
            &PostParams::default(),
            &gadget("v1", "new", json!({"size": 1})),
        )
        .await
        .unwrap_err(),
    );
    assert_eq!(code, 500);
    assert!(
        message.starts_with("conversion webhook for toys.example.com/v1, Kind=Gadget failed: "),
        "{message}"
    );
    assert!(
        server
            .object("gadgets", "default", "new")
            .unwrap()
            .is_none()
    );
    let (code, _, _) = api_error(v1.list(&ListParams::default()).await.unwrap_err());
    assert_eq!(code, 500);

    hook.set(Mode::Rename);
    let (code, reason, message) = api_error(v1.get("g").await.unwrap_err());
    assert_eq!((code, reason.as_str()), (500, "InternalError"));
    assert!(
        message.starts_with("conversion webhook for toys.example.com/v2, Kind=Gadget")
            && message.contains("must have the same name: g != renamed"),
        "{message}"
    );

    hook.set(Mode::WrongUid);
    let (code, _, message) = api_error(v1.get("g").await.unwrap_err());
    assert_eq!(code, 500);
    assert!(
        message.starts_with("conversion webhook for toys.example.com/v2, Kind=Gadget failed: ")
            && message.contains("expected response.uid="),
        "{message}"
    );

    // The storage version is served without the webhook.
    assert_eq!(
        v2.get("g").await.unwrap().data["spec"],
        json!({"sizeText": "1"})
    );
    hook.set(Mode::Convert);
    assert_eq!(v1.get("g").await.unwrap().data["spec"], json!({"size": 1}));
}

#[tokio::test]
async fn strategy_none_only_rewrites_api_version() {
    let server = ApiServer::new();
    server.register_builtin_kinds();
    server.register_crd_yaml(&crd("")).unwrap();
    let (v1, v2) = (api(&server, "v1"), api(&server, "v2"));
    let created = v1
        .create(
            &PostParams::default(),
            &gadget("v1", "g", json!({"size": 3})),
        )
        .await
        .unwrap();
    assert_eq!(created.types.unwrap().api_version, "toys.example.com/v1");
    let stored = server.object("gadgets", "default", "g").unwrap().unwrap();
    assert_eq!(stored["apiVersion"], "toys.example.com/v2");
    assert_eq!(stored["spec"], json!({"size": 3}));
    let read = v2.get("g").await.unwrap();
    assert_eq!(read.types.unwrap().api_version, "toys.example.com/v2");
    assert_eq!(read.data["spec"], json!({"size": 3}));

    // Moving the storage version to v1 keeps v2 among the stored versions, and new writes
    // are stored in v1.
    let crds: Api<DynamicObject> = Api::all_with(
        server.client(),
        &ApiResource::from_gvk_with_plural(
            &GroupVersionKind::gvk("apiextensions.k8s.io", "v1", "CustomResourceDefinition"),
            "customresourcedefinitions",
        ),
    );
    let patch: json_patch::Patch = serde_json::from_value(json!([
        {"op": "replace", "path": "/spec/versions/0/storage", "value": true},
        {"op": "replace", "path": "/spec/versions/1/storage", "value": false},
    ]))
    .unwrap();
    let crd = crds
        .patch(
            "gadgets.toys.example.com",
            &PatchParams::default(),
            &Patch::Json::<()>(patch),
        )
        .await
        .unwrap();
    assert_eq!(crd.data["status"]["storedVersions"], json!(["v2", "v1"]));
    v2.patch(
        "g",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"size": 4}})),
    )
    .await
    .unwrap();
    let stored = server.object("gadgets", "default", "g").unwrap().unwrap();
    assert_eq!(stored["apiVersion"], "toys.example.com/v1");
    assert_eq!(stored["spec"], json!({"size": 4}));
}

#[tokio::test]
async fn service_client_config_is_resolved_through_route_service() {
    let hook = start_webhook().await;
    let conversion = format!(
        "  conversion:\n    strategy: Webhook\n    webhook:\n      conversionReviewVersions: [v1]\n      clientConfig:\n        service: {{namespace: capmox-system, name: capmox-webhook, path: /convert, port: 9443}}\n        caBundle: {}\n",
        ca_bundle()
    );
    let server = ApiServer::new();
    server.register_builtin_kinds();
    server.register_crd_yaml(&crd(&conversion)).unwrap();
    let v1 = api(&server, "v1");
    let (code, reason, message) = api_error(
        v1.create(
            &PostParams::default(),
            &gadget("v1", "g", json!({"size": 2})),
        )
        .await
        .unwrap_err(),
    );
    assert_eq!((code, reason.as_str()), (500, "InternalError"));
    assert!(
        message.starts_with(
            "conversion webhook for toys.example.com/v1, Kind=Gadget failed: Post \"https://capmox-webhook.capmox-system.svc:9443/convert\": service \"capmox-webhook\" not found"
        ),
        "{message}"
    );
    server.route_service(
        "capmox-system",
        "capmox-webhook",
        &format!("https://127.0.0.1:{}", hook.port),
    );
    let created = v1
        .create(
            &PostParams::default(),
            &gadget("v1", "g", json!({"size": 2})),
        )
        .await
        .unwrap();
    assert_eq!(created.data["spec"], json!({"size": 2}));
    let stored = server.object("gadgets", "default", "g").unwrap().unwrap();
    assert_eq!(stored["spec"], json!({"sizeText": "2"}));
}

#[tokio::test]
async fn validators_see_the_request_version_and_its_schema() {
    let (server, _hook) = url_server().await;
    server
        .set_schema_validator("gadgets", |input| {
            let version = input.object["apiVersion"].as_str().unwrap_or("");
            let props = &input.schema.expect("a schema")["properties"]["spec"]["properties"];
            match version {
                "toys.example.com/v1" if props.get("size").is_some() => {
                    if input.object["spec"]["size"].as_i64().unwrap_or(0) > 100 {
                        return Err("spec.size: Invalid value: must be at most 100".into());
                    }
                    Ok(())
                }
                "toys.example.com/v2" if props.get("sizeText").is_some() => Ok(()),
                other => Err(format!("validated {other} with the wrong schema")),
            }
        })
        .unwrap();
    let (v1, v2) = (api(&server, "v1"), api(&server, "v2"));
    v1.create(
        &PostParams::default(),
        &gadget("v1", "a", json!({"size": 1})),
    )
    .await
    .unwrap();
    v2.create(
        &PostParams::default(),
        &gadget("v2", "b", json!({"sizeText": "2"})),
    )
    .await
    .unwrap();
    let (code, reason, message) = api_error(
        v1.create(
            &PostParams::default(),
            &gadget("v1", "c", json!({"size": 101})),
        )
        .await
        .unwrap_err(),
    );
    assert_eq!((code, reason.as_str()), (422, "Invalid"), "{message}");
    assert!(message.contains("must be at most 100"), "{message}");
    // An update in v1 sees the old object in v1 too.
    let (code, _, _) = api_error(
        v1.patch(
            "a",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"size": 500}})),
        )
        .await
        .unwrap_err(),
    );
    assert_eq!(code, 422);
    let stored = server.object("gadgets", "default", "a").unwrap().unwrap();
    assert_eq!(stored["spec"], json!({"sizeText": "1"}));
}

#[tokio::test]
async fn http_clients_get_converted_tables_too() {
    let (server, _hook) = url_server().await;
    let v1 = api(&server, "v1");
    v1.create(
        &PostParams::default(),
        &gadget("v1", "g", json!({"size": 4})),
    )
    .await
    .unwrap();
    let req = http::Request::get("/apis/toys.example.com/v1/namespaces/default/gadgets")
        .header("Accept", "application/json;as=Table;v=v1;g=meta.k8s.io")
        .body(Vec::new())
        .unwrap();
    let table: Value = server.client().request(req).await.unwrap();
    assert_eq!(table["columnDefinitions"][1]["name"], "Size");
    assert_eq!(table["rows"][0]["cells"], json!(["g", 4]));
}
