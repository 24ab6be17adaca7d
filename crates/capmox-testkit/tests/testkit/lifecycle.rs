//! Conformance: finalizers, deletionTimestamp, owner-reference garbage collection
//! (background, foreground with blockOwnerDeletion, orphan) and namespace deletion.

use crate::common::*;
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::Resource;
use kube::api::{
    Api, DeleteParams, Patch, PatchParams, PostParams, PropagationPolicy, WatchEvent, WatchParams,
};
use serde_json::json;

fn owner_ref(w: &Widget, block: bool) -> OwnerReference {
    let mut r = w
        .controller_owner_ref(&())
        .expect("created objects have name and uid");
    r.block_owner_deletion = Some(block);
    r
}

async fn set_finalizers(
    api: &Api<Widget>,
    name: &str,
    fins: serde_json::Value,
) -> kube::Result<Widget> {
    api.patch(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"finalizers": fins}})),
    )
    .await
}

#[tokio::test]
async fn delete_with_finalizers_waits_for_the_last_one() {
    let server = widget_server();
    let api: Api<Widget> = Api::namespaced(server.client(), "default");
    let mut w = widget("w", 1);
    w.metadata.finalizers = Some(vec!["a/one".into(), "a/two".into()]);
    api.create(&PostParams::default(), &w).await.unwrap();
    let rv = server.resource_version().to_string();
    let mut events = api
        .watch(&WatchParams::default(), &rv)
        .await
        .unwrap()
        .boxed();

    let res = api.delete("w", &DeleteParams::default()).await.unwrap();
    let deleting = res.left().expect("object still exists");
    assert!(deleting.metadata.deletion_timestamp.is_some());
    assert_eq!(deleting.metadata.generation, Some(2));
    let again = api.get("w").await.unwrap();
    assert!(again.metadata.deletion_timestamp.is_some());

    let err = set_finalizers(&api, "w", json!(["a/one", "a/two", "a/three"]))
        .await
        .unwrap_err();
    assert_eq!(
        code(err),
        (422, "Invalid".into()),
        "no new finalizers on a deleting object"
    );
    let spec_change = api
        .patch(
            "w",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"size": 5}})),
        )
        .await
        .unwrap();
    assert_eq!(spec_change.spec.size, 5, "other updates are still allowed");

    set_finalizers(&api, "w", json!(["a/two"])).await.unwrap();
    assert!(api.get_opt("w").await.unwrap().is_some());
    set_finalizers(&api, "w", json!([])).await.unwrap();
    assert!(api.get_opt("w").await.unwrap().is_none());

    let mut seen = Vec::new();
    while seen.last().map(String::as_str) != Some("DELETED") {
        let ev = tokio::time::timeout(WAIT, events.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        seen.push(match ev {
            WatchEvent::Modified(_) => "MODIFIED".to_string(),
            WatchEvent::Deleted(_) => "DELETED".to_string(),
            other => format!("{other:?}"),
        });
    }
    assert_eq!(seen, ["MODIFIED", "MODIFIED", "MODIFIED", "DELETED"]);
}

#[tokio::test]
async fn background_gc_deletes_dependents_and_drops_dangling_refs() {
    let server = widget_server();
    let client = server.client();
    let widgets: Api<Widget> = Api::namespaced(client.clone(), "default");
    let secrets: Api<Secret> = Api::namespaced(client.clone(), "default");
    let owner = widgets
        .create(&PostParams::default(), &widget("owner", 1))
        .await
        .unwrap();
    let other = widgets
        .create(&PostParams::default(), &widget("other", 1))
        .await
        .unwrap();

    let mut child = widget("child", 1);
    child.metadata.owner_references = Some(vec![owner_ref(&owner, false)]);
    widgets
        .create(&PostParams::default(), &child)
        .await
        .unwrap();
    let mut grandchild = widget("grandchild", 1);
    let child_now = widgets.get("child").await.unwrap();
    grandchild.metadata.owner_references = Some(vec![owner_ref(&child_now, false)]);
    grandchild.metadata.finalizers = Some(vec!["keep/me".into()]);
    widgets
        .create(&PostParams::default(), &grandchild)
        .await
        .unwrap();
    let shared: Secret = serde_json::from_value(json!({"metadata": {"name": "shared", "ownerReferences": [
        owner_ref(&owner, false), {"apiVersion": "example.com/v1", "kind": "Widget", "name": "other", "uid": other.metadata.uid}
    ]}}))
    .unwrap();
    secrets
        .create(&PostParams::default(), &shared)
        .await
        .unwrap();

    widgets
        .delete("owner", &DeleteParams::background())
        .await
        .unwrap();
    assert!(widgets.get_opt("owner").await.unwrap().is_none());
    assert!(
        widgets.get_opt("child").await.unwrap().is_none(),
        "dependent deleted"
    );
    let gc = widgets.get("grandchild").await.unwrap();
    assert!(
        gc.metadata.deletion_timestamp.is_some(),
        "transitive dependent is deleting, held by its finalizer"
    );
    let s = secrets.get("shared").await.unwrap();
    let refs = s.metadata.owner_references.unwrap();
    assert_eq!(
        refs.len(),
        1,
        "only the reference to the deleted owner is dropped"
    );
    assert_eq!(refs[0].name, "other");
}

#[tokio::test]
async fn foreground_deletion_waits_for_blocking_dependents() {
    let server = widget_server();
    let widgets: Api<Widget> = Api::namespaced(server.client(), "default");
    let owner = widgets
        .create(&PostParams::default(), &widget("owner", 1))
        .await
        .unwrap();
    let mut dep = widget("dep", 1);
    dep.metadata.owner_references = Some(vec![owner_ref(&owner, true)]);
    dep.metadata.finalizers = Some(vec!["hold/on".into()]);
    widgets.create(&PostParams::default(), &dep).await.unwrap();

    widgets
        .delete("owner", &DeleteParams::foreground())
        .await
        .unwrap();
    let o = widgets.get("owner").await.unwrap();
    assert!(o.metadata.deletion_timestamp.is_some());
    assert_eq!(
        o.metadata.finalizers,
        Some(vec!["foregroundDeletion".to_string()])
    );
    assert!(
        widgets
            .get("dep")
            .await
            .unwrap()
            .metadata
            .deletion_timestamp
            .is_some()
    );

    set_finalizers(&widgets, "dep", json!([])).await.unwrap();
    assert!(widgets.get_opt("dep").await.unwrap().is_none());
    assert!(
        widgets.get_opt("owner").await.unwrap().is_none(),
        "owner goes once dependents are gone"
    );
}

#[tokio::test]
async fn orphan_deletion_keeps_dependents_without_the_reference() {
    let server = widget_server();
    let widgets: Api<Widget> = Api::namespaced(server.client(), "default");
    let owner = widgets
        .create(&PostParams::default(), &widget("owner", 1))
        .await
        .unwrap();
    let mut dep = widget("dep", 1);
    dep.metadata.owner_references = Some(vec![owner_ref(&owner, true)]);
    widgets.create(&PostParams::default(), &dep).await.unwrap();
    let dp = DeleteParams {
        propagation_policy: Some(PropagationPolicy::Orphan),
        ..Default::default()
    };
    widgets.delete("owner", &dp).await.unwrap();
    assert!(widgets.get_opt("owner").await.unwrap().is_none());
    let d = widgets.get("dep").await.unwrap();
    assert!(d.metadata.owner_references.is_none());
    assert!(d.metadata.deletion_timestamp.is_none());
}

#[tokio::test]
async fn namespace_deletion_removes_content_and_refuses_new_objects() {
    let server = widget_server();
    let client = server.client();
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": "tmp"}})).unwrap();
    let created = namespaces
        .create(&PostParams::default(), &ns)
        .await
        .unwrap();
    assert_eq!(created.status.unwrap().phase.as_deref(), Some("Active"));
    let widgets: Api<Widget> = Api::namespaced(client.clone(), "tmp");
    let mut held = widget("held", 1);
    held.metadata.finalizers = Some(vec!["hold/on".into()]);
    widgets.create(&PostParams::default(), &held).await.unwrap();
    widgets
        .create(&PostParams::default(), &widget("free", 1))
        .await
        .unwrap();

    namespaces
        .delete("tmp", &DeleteParams::default())
        .await
        .unwrap();
    let ns = namespaces.get("tmp").await.unwrap();
    assert_eq!(ns.status.unwrap().phase.as_deref(), Some("Terminating"));
    assert!(widgets.get_opt("free").await.unwrap().is_none());
    let err = widgets
        .create(&PostParams::default(), &widget("late", 1))
        .await
        .unwrap_err();
    assert_eq!(code(err).0, 403);

    set_finalizers(&widgets, "held", json!([])).await.unwrap();
    assert!(
        namespaces.get_opt("tmp").await.unwrap().is_none(),
        "empty namespace is removed"
    );
}

#[tokio::test]
async fn missing_namespace_is_404_when_required() {
    let server = widget_server();
    let widgets: Api<Widget> = Api::namespaced(server.client(), "nowhere");
    widgets
        .create(&PostParams::default(), &widget("a", 1))
        .await
        .expect("lenient by default");
    server.require_namespaces(true);
    let err = widgets
        .create(&PostParams::default(), &widget("b", 1))
        .await
        .unwrap_err();
    match err {
        kube::Error::Api(s) => {
            assert_eq!((s.code, s.reason.as_str()), (404, "NotFound"));
            assert!(
                s.message.contains("namespaces \"nowhere\" not found"),
                "{}",
                s.message
            );
        }
        other => panic!("{other:?}"),
    }
    let default: Api<Widget> = Api::namespaced(server.client(), "default");
    default
        .create(&PostParams::default(), &widget("c", 1))
        .await
        .expect("default exists");
}

#[tokio::test]
async fn dependent_created_after_its_owner_was_deleted_is_collected() {
    let server = widget_server();
    let widgets: Api<Widget> = Api::namespaced(server.client(), "default");
    let owner = widgets
        .create(&PostParams::default(), &widget("owner", 1))
        .await
        .unwrap();
    widgets
        .delete("owner", &DeleteParams::default())
        .await
        .unwrap();
    let mut late = widget("late", 1);
    late.metadata.owner_references = Some(vec![owner_ref(&owner, false)]);
    widgets.create(&PostParams::default(), &late).await.unwrap();
    assert!(
        widgets.get_opt("late").await.unwrap().is_none(),
        "collected like the real GC would"
    );
    let mut fixture = widget("fixture", 1);
    let mut never = owner_ref(&owner, false);
    never.uid = "00000000-0000-0000-0000-000000000000".into();
    fixture.metadata.owner_references = Some(vec![never]);
    widgets
        .create(&PostParams::default(), &fixture)
        .await
        .unwrap();
    assert!(
        widgets.get_opt("fixture").await.unwrap().is_some(),
        "unknown owner uids are left alone"
    );
}
