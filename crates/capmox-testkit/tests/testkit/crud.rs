//! Conformance: CRUD, status subresource, generation, optimistic concurrency, error bodies.

use crate::common::*;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;

#[tokio::test]
async fn create_sets_system_fields_and_drops_status() {
    let server = widget_server();
    let api: Api<Widget> = Api::namespaced(server.client(), "default");
    let mut w = widget("w1", 3);
    w.status = Some(WidgetStatus {
        phase: Some("ignored".into()),
    });
    let created = api.create(&PostParams::default(), &w).await.unwrap();
    let m = &created.metadata;
    assert_eq!(m.namespace.as_deref(), Some("default"));
    assert_eq!(m.generation, Some(1));
    assert_eq!(m.uid.as_ref().map(String::len), Some(36));
    let rv: u64 = m.resource_version.as_deref().unwrap().parse().unwrap();
    assert!(rv > 0);
    assert!(m.creation_timestamp.is_some());
    assert_eq!(
        created.status, None,
        "status is reset on create when /status is a subresource"
    );
    let raw = server.object("widgets", "default", "w1").unwrap().unwrap();
    let ts = raw["metadata"]["creationTimestamp"].as_str().unwrap();
    assert!(
        ts.ends_with('Z') && ts.len() == 20,
        "RFC 3339 seconds: {ts}"
    );
    let got = api.get("w1").await.unwrap();
    assert_eq!(got.spec, created.spec);
    assert_eq!(
        got.metadata.resource_version,
        created.metadata.resource_version
    );
}

#[tokio::test]
async fn generate_name_gives_unique_names() {
    let server = widget_server();
    let api: Api<Widget> = Api::namespaced(server.client(), "default");
    let mut w = widget("", 1);
    w.metadata.name = None;
    w.metadata.generate_name = Some("w-".into());
    let a = api.create(&PostParams::default(), &w).await.unwrap();
    let b = api.create(&PostParams::default(), &w).await.unwrap();
    let (na, nb) = (a.metadata.name.unwrap(), b.metadata.name.unwrap());
    assert!(na.starts_with("w-") && na.len() == 7, "{na}");
    assert_ne!(na, nb);
    w.metadata.generate_name = None;
    let (c, reason) = code(api.create(&PostParams::default(), &w).await.unwrap_err());
    assert_eq!((c, reason.as_str()), (422, "Invalid"));
}

#[tokio::test]
async fn errors_carry_status_code_and_reason() {
    let server = widget_server();
    let api: Api<Widget> = Api::namespaced(server.client(), "default");
    assert_eq!(
        code(api.get("missing").await.unwrap_err()),
        (404, "NotFound".into())
    );
    assert!(api.get_opt("missing").await.unwrap().is_none());
    api.create(&PostParams::default(), &widget("w", 1))
        .await
        .unwrap();
    assert_eq!(
        code(
            api.create(&PostParams::default(), &widget("w", 1))
                .await
                .unwrap_err()
        ),
        (409, "AlreadyExists".into())
    );
    let mut other_ns = widget("x", 1);
    other_ns.metadata.namespace = Some("elsewhere".into());
    assert_eq!(
        code(
            api.create(&PostParams::default(), &other_ns)
                .await
                .unwrap_err()
        ),
        (400, "BadRequest".into())
    );
    assert_eq!(
        code(
            api.delete("missing", &DeleteParams::default())
                .await
                .unwrap_err()
        ),
        (404, "NotFound".into())
    );
    let mut copied = api.get("w").await.unwrap();
    copied.metadata.name = Some("copy".into());
    assert_eq!(
        code(
            api.create(&PostParams::default(), &copied)
                .await
                .unwrap_err()
        ),
        (500, "InternalError".into()),
        "creating an object that still carries a resourceVersion fails as on a real server"
    );
    copied.metadata.resource_version = None;
    copied.metadata.uid = Some("stale".into());
    api.create(&PostParams::default(), &copied)
        .await
        .expect("uid is reset on create");
    let mut wrong_uid = api.get("w").await.unwrap();
    wrong_uid.metadata.uid = Some("someone-else".into());
    assert_eq!(
        code(
            api.replace("w", &PostParams::default(), &wrong_uid)
                .await
                .unwrap_err()
        )
        .0,
        409
    );
    let mut wrong_ns = api.get("w").await.unwrap();
    wrong_ns.metadata.namespace = Some("elsewhere".into());
    assert_eq!(
        code(
            api.replace("w", &PostParams::default(), &wrong_ns)
                .await
                .unwrap_err()
        )
        .0,
        400
    );
}

#[tokio::test]
async fn list_with_selectors_limit_and_resource_version() {
    let server = widget_server();
    let client = server.client();
    let api: Api<Widget> = Api::namespaced(client.clone(), "default");
    let other: Api<Widget> = Api::namespaced(client.clone(), "other");
    for (i, app) in ["a", "b", "a"].iter().enumerate() {
        let mut w = widget(&format!("w{i}"), i as i64);
        w.metadata.labels = Some([("app".to_string(), app.to_string())].into());
        api.create(&PostParams::default(), &w).await.unwrap();
    }
    other
        .create(&PostParams::default(), &widget("w0", 9))
        .await
        .unwrap();

    let all = api.list(&ListParams::default()).await.unwrap();
    assert_eq!(all.items.len(), 3);
    let list_rv: u64 = all.metadata.resource_version.unwrap().parse().unwrap();
    assert_eq!(list_rv, server.resource_version());

    let names = |l: kube::core::ObjectList<Widget>| -> Vec<String> {
        l.items
            .into_iter()
            .map(|w| w.metadata.name.unwrap())
            .collect()
    };
    assert_eq!(
        names(
            api.list(&ListParams::default().labels("app=a"))
                .await
                .unwrap()
        ),
        ["w0", "w2"]
    );
    assert_eq!(
        names(
            api.list(&ListParams::default().labels("app!=a"))
                .await
                .unwrap()
        ),
        ["w1"]
    );
    assert_eq!(
        names(
            api.list(&ListParams::default().labels("app in (b)"))
                .await
                .unwrap()
        ),
        ["w1"]
    );
    assert_eq!(
        names(
            api.list(&ListParams::default().fields("metadata.name=w1"))
                .await
                .unwrap()
        ),
        ["w1"]
    );
    let everywhere: Api<Widget> = Api::all(client.clone());
    assert_eq!(
        everywhere
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .len(),
        4
    );
    assert_eq!(
        names(
            everywhere
                .list(&ListParams::default().fields("metadata.namespace=other"))
                .await
                .unwrap()
        ),
        ["w0"]
    );
    let bad = everywhere
        .list(&ListParams::default().fields("spec.size=1"))
        .await
        .unwrap_err();
    assert_eq!(code(bad).0, 400);

    let page1 = api.list(&ListParams::default().limit(2)).await.unwrap();
    assert_eq!(page1.items.len(), 2);
    let token = page1.metadata.continue_.clone().expect("more pages");
    let page2 = api
        .list(&ListParams::default().limit(2).continue_token(&token))
        .await
        .unwrap();
    assert_eq!(names(page2.clone()), ["w2"]);
    assert!(page2.metadata.continue_.is_none());
}

#[tokio::test]
async fn replace_uses_optimistic_concurrency() {
    let server = widget_server();
    let api: Api<Widget> = Api::namespaced(server.client(), "default");
    let created = api
        .create(&PostParams::default(), &widget("w", 1))
        .await
        .unwrap();
    let mut first = created.clone();
    first.spec.size = 2;
    let replaced = api
        .replace("w", &PostParams::default(), &first)
        .await
        .unwrap();
    assert_ne!(
        replaced.metadata.resource_version,
        created.metadata.resource_version
    );
    let mut stale = created.clone();
    stale.spec.size = 3;
    assert_eq!(
        code(
            api.replace("w", &PostParams::default(), &stale)
                .await
                .unwrap_err()
        ),
        (409, "Conflict".into())
    );
    let mut unconditional = replaced.clone();
    unconditional.metadata.resource_version = None;
    assert_eq!(
        code(
            api.replace("w", &PostParams::default(), &unconditional)
                .await
                .unwrap_err()
        )
        .0,
        422,
        "custom resources require a resourceVersion on update"
    );
    assert_eq!(
        code(
            api.replace("other", &PostParams::default(), &replaced)
                .await
                .unwrap_err()
        )
        .0,
        400,
        "name in body must match the URL"
    );
}

#[tokio::test]
async fn secret_string_data_is_folded_into_data() {
    let server = widget_server();
    let api: Api<Secret> = Api::namespaced(server.client(), "default");
    let s: Secret = serde_json::from_value(json!({
        "metadata": {"name": "bootstrap"},
        "data": {"format": "aWduaXRpb24=", "keep": "eA=="},
        "stringData": {"value": "#cloud-config\n", "format": "cloud-config"}
    }))
    .unwrap();
    let created = api.create(&PostParams::default(), &s).await.unwrap();
    assert!(created.string_data.is_none(), "stringData is never stored");
    let text = |secret: &Secret, key: &str| {
        secret
            .data
            .as_ref()
            .and_then(|d| d.get(key))
            .map(|v| String::from_utf8(v.0.clone()).unwrap())
    };
    let read = api.get("bootstrap").await.unwrap();
    assert_eq!(text(&read, "value").as_deref(), Some("#cloud-config\n"));
    assert_eq!(
        text(&read, "format").as_deref(),
        Some("cloud-config"),
        "stringData wins over data"
    );
    assert_eq!(text(&read, "keep").as_deref(), Some("x"));

    let patched = api
        .patch(
            "bootstrap",
            &PatchParams::default(),
            &Patch::Merge(json!({"stringData": {"keep": "y"}})),
        )
        .await
        .unwrap();
    assert_eq!(text(&patched, "keep").as_deref(), Some("y"));
    assert!(patched.string_data.is_none());
}

#[tokio::test]
async fn builtin_kinds_accept_unconditional_update() {
    let server = widget_server();
    let api: Api<Secret> = Api::namespaced(server.client(), "default");
    let s: Secret = serde_json::from_value(json!({
        "metadata": {"name": "creds"}, "stringData": {"token": "x"}, "type": "Opaque"
    }))
    .unwrap();
    let created = api.create(&PostParams::default(), &s).await.unwrap();
    let mut upd = created.clone();
    upd.metadata.resource_version = None;
    upd.type_ = Some("kubernetes.io/basic-auth".into());
    let out = api
        .replace("creds", &PostParams::default(), &upd)
        .await
        .unwrap();
    assert_eq!(out.type_.as_deref(), Some("kubernetes.io/basic-auth"));
}

#[tokio::test]
async fn status_subresource_and_generation() {
    let server = widget_server();
    let api: Api<Widget> = Api::namespaced(server.client(), "default");
    let created = api
        .create(&PostParams::default(), &widget("w", 1))
        .await
        .unwrap();

    // Writing status through the main resource is ignored.
    let mut with_status = created.clone();
    with_status.status = Some(WidgetStatus {
        phase: Some("Main".into()),
    });
    let out = api
        .replace("w", &PostParams::default(), &with_status)
        .await
        .unwrap();
    assert_eq!(out.status, None);
    assert_eq!(
        out.metadata.resource_version, created.metadata.resource_version,
        "no-op write keeps rv"
    );

    // /status changes only status, and does not bump generation.
    let mut st = out.clone();
    st.spec.size = 100;
    st.metadata.labels = Some([("ignored".to_string(), "yes".to_string())].into());
    st.status = Some(WidgetStatus {
        phase: Some("Ready".into()),
    });
    let out = api
        .replace_status("w", &PostParams::default(), &st)
        .await
        .unwrap();
    assert_eq!(out.status.as_ref().unwrap().phase.as_deref(), Some("Ready"));
    assert_eq!(out.spec.size, 1);
    assert!(out.metadata.labels.is_none());
    assert_eq!(out.metadata.generation, Some(1));

    // A metadata-only change does not bump generation; a spec change does.
    let out = api
        .patch(
            "w",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"a": "b"}}})),
        )
        .await
        .unwrap();
    assert_eq!(out.metadata.generation, Some(1));
    let out = api
        .patch(
            "w",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"size": 2}})),
        )
        .await
        .unwrap();
    assert_eq!(out.metadata.generation, Some(2));
    assert_eq!(
        out.status.unwrap().phase.as_deref(),
        Some("Ready"),
        "spec write keeps status"
    );

    // Merge patch on /status.
    let out = api
        .patch_status(
            "w",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"phase": "Done"}, "spec": {"size": 9}})),
        )
        .await
        .unwrap();
    assert_eq!(
        (out.spec.size, out.status.unwrap().phase.as_deref()),
        (2, Some("Done"))
    );
    assert_eq!(out.metadata.generation, Some(2));
}

#[tokio::test]
async fn cluster_scoped_kind_without_status_subresource() {
    let server = widget_server();
    let api: Api<Gadget> = Api::all(server.client());
    let g = Gadget::new("g1", GadgetSpec { level: 1 });
    let created = api.create(&PostParams::default(), &g).await.unwrap();
    assert_eq!(created.metadata.namespace, None);
    let out = api
        .patch(
            "g1",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"level": 2}})),
        )
        .await
        .unwrap();
    assert_eq!(out.metadata.generation, Some(2));
    assert_eq!(
        api.list(&ListParams::default()).await.unwrap().items.len(),
        1
    );
    api.delete("g1", &DeleteParams::default()).await.unwrap();
    assert!(api.get_opt("g1").await.unwrap().is_none());
}

#[tokio::test]
async fn delete_without_finalizers_removes_immediately() {
    let server = widget_server();
    let api: Api<Widget> = Api::namespaced(server.client(), "default");
    let created = api
        .create(&PostParams::default(), &widget("w", 1))
        .await
        .unwrap();
    let wrong_uid = DeleteParams {
        preconditions: Some(kube::api::Preconditions {
            uid: Some("nope".into()),
            resource_version: None,
        }),
        ..Default::default()
    };
    assert_eq!(code(api.delete("w", &wrong_uid).await.unwrap_err()).0, 409);
    let res = api.delete("w", &DeleteParams::default()).await.unwrap();
    let status = res
        .right()
        .expect("an immediately deleted object answers with a Status");
    assert_eq!(
        status.status,
        Some(kube::core::response::StatusSummary::Success)
    );
    assert_eq!(
        status.details.unwrap().uid,
        created.metadata.uid.clone().unwrap()
    );
    assert!(api.get_opt("w").await.unwrap().is_none());
    let _ = created;
}

#[tokio::test]
async fn shared_crds_register_and_serve() {
    let server = upstream_server();
    let kinds: Vec<String> = server.kinds().into_iter().map(|k| k.kind).collect();
    for k in [
        "Cluster",
        "Machine",
        "MachineDeployment",
        "KubeadmControlPlane",
        "IPAddressClaim",
        "IPAddress",
        "InClusterIPPool",
        "GlobalInClusterIPPool",
        "ProxmoxMachine",
        "ProxmoxCluster",
        "Secret",
        "Event",
        "Namespace",
        "Lease",
    ] {
        assert!(kinds.iter().any(|x| x == k), "{k} registered");
    }
    let client = server.client();
    let pm = dynamic(
        &client,
        "infrastructure.cluster.x-k8s.io",
        "v1alpha2",
        "ProxmoxMachine",
        "proxmoxmachines",
        Some("default"),
    );
    let obj: kube::api::DynamicObject = serde_json::from_value(json!({
        "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha2", "kind": "ProxmoxMachine",
        "metadata": {"name": "m1"}, "spec": {"sourceNode": "pve1"}
    }))
    .unwrap();
    pm.create(&PostParams::default(), &obj).await.unwrap();
    let got = pm.get("m1").await.unwrap();
    assert_eq!(got.data["spec"]["sourceNode"], "pve1");
    let pools = dynamic(
        &client,
        "ipam.cluster.x-k8s.io",
        "v1alpha2",
        "GlobalInClusterIPPool",
        "globalinclusterippools",
        None,
    );
    assert!(
        pools
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .is_empty()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_read_modify_write_loses_no_update() {
    let server = widget_server();
    let api: Api<Widget> = Api::namespaced(server.client(), "default");
    api.create(&PostParams::default(), &widget("counter", 0))
        .await
        .unwrap();
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let api = api.clone();
        tasks.push(tokio::spawn(async move {
            let mut conflicts = 0u32;
            for _ in 0..10 {
                loop {
                    let mut w = api.get("counter").await.unwrap();
                    w.spec.size += 1;
                    match api.replace("counter", &PostParams::default(), &w).await {
                        Ok(_) => break,
                        Err(kube::Error::Api(s)) if s.code == 409 => conflicts += 1,
                        Err(e) => panic!("{e:?}"),
                    }
                }
            }
            conflicts
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(api.get("counter").await.unwrap().spec.size, 80);
}

#[tokio::test]
async fn create_yaml_seeds_objects_with_status() {
    let server = upstream_server();
    let created = server
        .create_yaml(
            r#"
apiVersion: cluster.x-k8s.io/v1beta2
kind: Cluster
metadata: {name: c1}
spec: {}
status:
  initialization: {infrastructureProvisioned: true}
---
apiVersion: v1
kind: Secret
metadata: {name: s1, namespace: capmox-system}
stringData: {token: x}
"#,
        )
        .unwrap();
    assert_eq!(created.len(), 2);
    let clusters = dynamic(
        &server.client(),
        "cluster.x-k8s.io",
        "v1beta2",
        "Cluster",
        "clusters",
        Some("default"),
    );
    let c = clusters.get("c1").await.unwrap();
    assert_eq!(
        c.data["status"]["initialization"]["infrastructureProvisioned"],
        true
    );
    let secrets: Api<Secret> = Api::namespaced(server.client(), "capmox-system");
    assert!(secrets.get_opt("s1").await.unwrap().is_some());
    let err = server
        .create_yaml("apiVersion: example.com/v9\nkind: Nope\nmetadata: {name: x}\n")
        .unwrap_err();
    assert!(
        matches!(err, capmox_testkit::TestkitError::UnknownKind(_)),
        "{err}"
    );
}

/// The API server refuses an Event whose note exceeds 1 kB (as the real one does), so callers
/// that do not cut their notes are caught in tests.
#[tokio::test]
async fn an_event_note_over_one_kilobyte_is_refused() {
    let server = capmox_testkit::ApiServer::new();
    server.register_builtin_kinds();
    let events: kube::Api<k8s_openapi::api::events::v1::Event> =
        kube::Api::namespaced(server.client(), "default");
    let event = |name: &str, note: String| -> k8s_openapi::api::events::v1::Event {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "namespace": "default"},
            "eventTime": "2026-01-01T00:00:00.000000Z",
            "reportingController": "test", "reportingInstance": "test",
            "action": "Test", "reason": "Test", "type": "Normal", "note": note
        }))
        .expect("event")
    };
    let pp = kube::api::PostParams::default();
    events
        .create(&pp, &event("fits", "x".repeat(1024)))
        .await
        .expect("1024 bytes fit");
    let error = events
        .create(&pp, &event("too-long", "x".repeat(1025)))
        .await
        .expect_err("1025 bytes do not");
    assert!(
        matches!(&error, kube::Error::Api(status) if status.code == 422),
        "{error}"
    );
}
