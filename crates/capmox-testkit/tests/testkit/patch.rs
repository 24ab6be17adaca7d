//! Conformance: JSON merge patch, JSON patch, strategic merge, server-side apply.

use crate::common::*;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::json;

#[tokio::test]
async fn merge_patch_sets_and_removes_fields_with_rv_precondition() {
    let server = widget_server();
    let api: Api<Widget> = Api::namespaced(server.client(), "default");
    let created = api
        .create(&PostParams::default(), &widget("w", 1))
        .await
        .unwrap();
    let out = api
        .patch(
            "w",
            &PatchParams::default(),
            &Patch::Merge(
                json!({"spec": {"color": "red"}, "metadata": {"annotations": {"a": "1"}}}),
            ),
        )
        .await
        .unwrap();
    assert_eq!(out.spec.color.as_deref(), Some("red"));
    let out = api
        .patch(
            "w",
            &PatchParams::default(),
            &Patch::Merge(
                json!({"spec": {"color": null}, "metadata": {"annotations": {"a": null}}}),
            ),
        )
        .await
        .unwrap();
    assert_eq!(out.spec.color, None);
    assert!(
        out.metadata.annotations.is_none(),
        "empty annotations are dropped"
    );
    let stale = Patch::Merge(
        json!({"metadata": {"resourceVersion": created.metadata.resource_version}, "spec": {"size": 5}}),
    );
    assert_eq!(
        code(
            api.patch("w", &PatchParams::default(), &stale)
                .await
                .unwrap_err()
        ),
        (409, "Conflict".into())
    );
    assert_eq!(
        code(
            api.patch("missing", &PatchParams::default(), &Patch::Merge(json!({})))
                .await
                .unwrap_err()
        )
        .0,
        404
    );
}

#[tokio::test]
async fn json_patch_with_test_operations() {
    let server = widget_server();
    let api: Api<Widget> = Api::namespaced(server.client(), "default");
    api.create(&PostParams::default(), &widget("w", 1))
        .await
        .unwrap();
    let add: json_patch::Patch = serde_json::from_value(json!([
        {"op": "test", "path": "/metadata/finalizers", "value": null},
        {"op": "add", "path": "/metadata/finalizers", "value": ["a/f"]},
        {"op": "replace", "path": "/spec/size", "value": 7},
    ]))
    .unwrap();
    let out = api
        .patch(
            "w",
            &PatchParams::default(),
            &Patch::Json::<()>(add.clone()),
        )
        .await
        .unwrap();
    assert_eq!(out.metadata.finalizers, Some(vec!["a/f".to_string()]));
    assert_eq!(out.spec.size, 7);
    assert_eq!(out.metadata.generation, Some(2));
    // The same test now fails: the finalizers exist.
    assert_eq!(
        code(
            api.patch("w", &PatchParams::default(), &Patch::Json::<()>(add))
                .await
                .unwrap_err()
        )
        .0,
        422
    );
    let remove: json_patch::Patch = serde_json::from_value(json!([
        {"op": "test", "path": "/metadata/finalizers/0", "value": "a/f"},
        {"op": "remove", "path": "/metadata/finalizers/0"},
    ]))
    .unwrap();
    let out = api
        .patch("w", &PatchParams::default(), &Patch::Json::<()>(remove))
        .await
        .unwrap();
    assert_eq!(
        out.metadata.finalizers, None,
        "an emptied finalizer list is dropped"
    );
}

#[tokio::test]
async fn strategic_merge_is_refused_for_crds_and_merges_builtins() {
    let server = widget_server();
    let client = server.client();
    let api: Api<Widget> = Api::namespaced(client.clone(), "default");
    api.create(&PostParams::default(), &widget("w", 1))
        .await
        .unwrap();
    let smp = Patch::Strategic(json!({"spec": {"size": 2}}));
    assert_eq!(
        code(
            api.patch("w", &PatchParams::default(), &smp)
                .await
                .unwrap_err()
        )
        .0,
        415
    );
    let secrets: Api<Secret> = Api::namespaced(client, "default");
    let s: Secret =
        serde_json::from_value(json!({"metadata": {"name": "s"}, "data": {"a": "YQ=="}})).unwrap();
    secrets.create(&PostParams::default(), &s).await.unwrap();
    let out = secrets
        .patch(
            "s",
            &PatchParams::default(),
            &Patch::Strategic(json!({"metadata": {"labels": {"x": "y"}}})),
        )
        .await
        .unwrap();
    assert_eq!(out.metadata.labels.unwrap()["x"], "y");
}

#[tokio::test]
async fn server_side_apply_creates_tracks_managers_and_detects_conflicts() {
    let server = widget_server();
    let api: Api<Widget> = Api::namespaced(server.client(), "default");
    let cfg = json!({"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}, "spec": {"size": 1, "color": "red"}});
    let out = api
        .patch("w", &PatchParams::apply("alice"), &Patch::Apply(&cfg))
        .await
        .unwrap();
    assert_eq!(out.spec.color.as_deref(), Some("red"));
    let mf = out.metadata.managed_fields.clone().unwrap();
    assert_eq!(mf[0].manager.as_deref(), Some("alice"));
    assert_eq!(mf[0].operation.as_deref(), Some("Apply"));
    assert!(mf[0].time.is_some());
    assert_eq!(mf[0].api_version.as_deref(), Some("example.com/v1"));
    assert_eq!(mf[0].fields_type.as_deref(), Some("FieldsV1"));

    let bob = json!({"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}, "spec": {"size": 2}});
    let err = api
        .patch("w", &PatchParams::apply("bob"), &Patch::Apply(&bob))
        .await
        .unwrap_err();
    match err {
        kube::Error::Api(s) => {
            assert_eq!((s.code, s.reason.as_str()), (409, "Conflict"));
            assert!(
                s.message.contains("alice") && s.message.contains(".spec.size"),
                "{}",
                s.message
            );
            let causes = s.details.expect("conflict details").causes;
            assert_eq!(causes.len(), 1);
            assert_eq!(causes[0].reason, "FieldManagerConflict");
            assert_eq!(causes[0].field, ".spec.size");
        }
        other => panic!("{other:?}"),
    }
    let out = api
        .patch("w", &PatchParams::apply("bob").force(), &Patch::Apply(&bob))
        .await
        .unwrap();
    assert_eq!((out.spec.size, out.spec.color.as_deref()), (2, Some("red")));

    // alice stops applying color: it is removed; size now belongs to bob and stays.
    let alice2 = json!({"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}, "spec": {}});
    let out = api
        .patch("w", &PatchParams::apply("alice"), &Patch::Apply(&alice2))
        .await
        .unwrap();
    assert_eq!((out.spec.size, out.spec.color), (2, None));
    let untyped = json!({"metadata": {"name": "w"}, "spec": {"size": 3}});
    let err = api
        .patch("w", &PatchParams::apply("alice"), &Patch::Apply(&untyped))
        .await
        .unwrap_err();
    assert_eq!(code(err).0, 400, "apply needs apiVersion and kind");
    let wrong_group =
        json!({"apiVersion": "other.io/v1", "kind": "Widget", "metadata": {"name": "w"}});
    let err = api
        .patch(
            "w",
            &PatchParams::apply("alice"),
            &Patch::Apply(&wrong_group),
        )
        .await
        .unwrap_err();
    assert_eq!(code(err).0, 400);
}

#[tokio::test]
async fn apply_status_with_force_keeps_spec_and_finalizers() {
    let server = widget_server();
    let api: Api<Widget> = Api::namespaced(server.client(), "default");
    let mut w = widget("w", 3);
    w.metadata.finalizers = Some(vec!["x/y".into()]);
    api.create(&PostParams::default(), &w).await.unwrap();
    let status =
        json!({"apiVersion": "example.com/v1", "kind": "Widget", "status": {"phase": "Ready"}});
    let out = api
        .patch_status(
            "w",
            &PatchParams::apply("ctrl").force(),
            &Patch::Apply(&status),
        )
        .await
        .unwrap();
    assert_eq!(out.status.unwrap().phase.as_deref(), Some("Ready"));
    assert_eq!(out.spec.size, 3);
    assert_eq!(out.metadata.finalizers, Some(vec!["x/y".to_string()]));
    assert_eq!(out.metadata.generation, Some(1));
    // Applying status on the main resource does not change status.
    let main = json!({"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}, "status": {"phase": "Main"}});
    let out = api
        .patch(
            "w",
            &PatchParams::apply("other").force(),
            &Patch::Apply(&main),
        )
        .await
        .unwrap();
    assert_eq!(out.status.unwrap().phase.as_deref(), Some("Ready"));
    assert!(
        api.patch_status(
            "nope",
            &PatchParams::apply("ctrl").force(),
            &Patch::Apply(&status)
        )
        .await
        .is_err()
    );
}

#[tokio::test]
async fn apply_merges_conditions_by_list_map_key_from_the_crd_schema() {
    let server = upstream_server();
    let client = server.client();
    let machines = dynamic(
        &client,
        "cluster.x-k8s.io",
        "v1beta2",
        "Machine",
        "machines",
        Some("default"),
    );
    let m: kube::api::DynamicObject = serde_json::from_value(json!({
        "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Machine", "metadata": {"name": "m"},
        "spec": {"clusterName": "c", "bootstrap": {"dataSecretName": "s"}, "infrastructureRef": {"apiGroup": "infrastructure.cluster.x-k8s.io", "kind": "ProxmoxMachine", "name": "m"}}
    }))
    .unwrap();
    machines.create(&PostParams::default(), &m).await.unwrap();
    let cond = |t: &str, s: &str| json!({"type": t, "status": s, "reason": "R", "lastTransitionTime": "2026-01-01T00:00:00Z"});
    let a = json!({"apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Machine", "metadata": {"name": "m"}, "status": {"conditions": [cond("A", "True")]}});
    let b = json!({"apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Machine", "metadata": {"name": "m"}, "status": {"conditions": [cond("B", "False")]}});
    machines
        .patch_status(
            "m",
            &PatchParams::apply("ctrl-a").force(),
            &Patch::Apply(&a),
        )
        .await
        .unwrap();
    let out = machines
        .patch_status(
            "m",
            &PatchParams::apply("ctrl-b").force(),
            &Patch::Apply(&b),
        )
        .await
        .unwrap();
    let types: Vec<&str> = out.data["status"]["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["type"].as_str().unwrap())
        .collect();
    assert_eq!(
        types,
        ["A", "B"],
        "conditions merged by type, each manager keeps its own"
    );
    // ctrl-a re-applies with no conditions: only its condition goes away.
    let empty = json!({"apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Machine", "metadata": {"name": "m"}, "status": {"conditions": []}});
    let out = machines
        .patch_status(
            "m",
            &PatchParams::apply("ctrl-a").force(),
            &Patch::Apply(&empty),
        )
        .await
        .unwrap();
    assert_eq!(
        out.data["status"]["conditions"],
        json!([cond("B", "False")])
    );
}

#[tokio::test]
async fn dry_run_does_not_persist() {
    let server = widget_server();
    let api: Api<Widget> = Api::namespaced(server.client(), "default");
    let rv = server.resource_version();
    let out = api
        .create(
            &PostParams {
                dry_run: true,
                field_manager: None,
            },
            &widget("w", 1),
        )
        .await
        .unwrap();
    assert_eq!(out.metadata.name.as_deref(), Some("w"));
    assert!(api.get_opt("w").await.unwrap().is_none());
    assert_eq!(server.resource_version(), rv);
}

#[tokio::test]
async fn lease_takeover_with_server_side_apply() {
    use k8s_openapi::api::coordination::v1::Lease;
    let server = widget_server();
    let leases: Api<Lease> = Api::namespaced(server.client(), "kube-system");
    let claim = |holder: &str| {
        json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": "capmox"},
            "spec": {"holderIdentity": holder, "leaseDurationSeconds": 15}})
    };
    let a = leases
        .patch(
            "capmox",
            &PatchParams::apply("pod-a"),
            &Patch::Apply(claim("pod-a")),
        )
        .await
        .unwrap();
    assert_eq!(a.spec.unwrap().holder_identity.as_deref(), Some("pod-a"));
    let err = leases
        .patch(
            "capmox",
            &PatchParams::apply("pod-b"),
            &Patch::Apply(claim("pod-b")),
        )
        .await
        .unwrap_err();
    assert_eq!(code(err).0, 409, "holderIdentity is owned by pod-a");
    // Taking over with a stale resourceVersion fails; with the current one and force it works.
    let mut stale = claim("pod-b");
    stale["metadata"]["resourceVersion"] = json!("1");
    let err = leases
        .patch(
            "capmox",
            &PatchParams::apply("pod-b").force(),
            &Patch::Apply(stale),
        )
        .await
        .unwrap_err();
    assert_eq!(code(err).0, 409);
    let mut current = claim("pod-b");
    current["metadata"]["resourceVersion"] = json!(a.metadata.resource_version);
    let b = leases
        .patch(
            "capmox",
            &PatchParams::apply("pod-b").force(),
            &Patch::Apply(current),
        )
        .await
        .unwrap();
    assert_eq!(b.spec.unwrap().holder_identity.as_deref(), Some("pod-b"));
}
