//! Conformance: watch events, history replay, bookmarks, 410 Gone, selector transitions,
//! streaming lists, and kube-runtime's watcher/reflector against the fake.

use std::time::Duration;

use crate::common::*;
use futures::{Stream, StreamExt};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams};
use kube::runtime::{WatchStreamExt, reflector, watcher};
use serde_json::json;

async fn next<T, S: Stream<Item = T> + Unpin>(s: &mut S) -> T {
    tokio::time::timeout(WAIT, s.next())
        .await
        .expect("timed out waiting for a watch event")
        .expect("watch stream ended")
}

fn name_of(w: &Widget) -> &str {
    w.metadata.name.as_deref().unwrap_or("")
}

#[tokio::test]
async fn watch_from_resource_version_streams_added_modified_deleted() {
    let server = widget_server();
    let api: Api<Widget> = Api::namespaced(server.client(), "default");
    let rv = server.resource_version().to_string();
    let mut s = api
        .watch(&WatchParams::default(), &rv)
        .await
        .unwrap()
        .boxed();
    api.create(&PostParams::default(), &widget("w", 1))
        .await
        .unwrap();
    api.patch(
        "w",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"size": 2}})),
    )
    .await
    .unwrap();
    api.delete("w", &DeleteParams::default()).await.unwrap();
    match next(&mut s).await.unwrap() {
        WatchEvent::Added(w) => assert_eq!((name_of(&w), w.spec.size), ("w", 1)),
        other => panic!("expected ADDED, got {other:?}"),
    }
    let modified_rv = match next(&mut s).await.unwrap() {
        WatchEvent::Modified(w) => {
            assert_eq!(w.spec.size, 2);
            w.metadata.resource_version.unwrap().parse::<u64>().unwrap()
        }
        other => panic!("expected MODIFIED, got {other:?}"),
    };
    match next(&mut s).await.unwrap() {
        WatchEvent::Deleted(w) => {
            let rv: u64 = w.metadata.resource_version.unwrap().parse().unwrap();
            assert!(rv > modified_rv, "DELETED carries a new resourceVersion");
        }
        other => panic!("expected DELETED, got {other:?}"),
    }
}

#[tokio::test]
async fn watch_replays_history_and_zero_means_current_state() {
    let server = widget_server();
    let api: Api<Widget> = Api::namespaced(server.client(), "default");
    let before = server.resource_version().to_string();
    api.create(&PostParams::default(), &widget("a", 1))
        .await
        .unwrap();
    api.create(&PostParams::default(), &widget("b", 1))
        .await
        .unwrap();
    api.delete("a", &DeleteParams::default()).await.unwrap();

    let mut replay = api
        .watch(&WatchParams::default(), &before)
        .await
        .unwrap()
        .boxed();
    let kinds: Vec<String> = [
        next(&mut replay).await.unwrap(),
        next(&mut replay).await.unwrap(),
        next(&mut replay).await.unwrap(),
    ]
    .iter()
    .map(|e| match e {
        WatchEvent::Added(w) => format!("ADDED {}", name_of(w)),
        WatchEvent::Deleted(w) => format!("DELETED {}", name_of(w)),
        other => format!("{other:?}"),
    })
    .collect();
    assert_eq!(kinds, ["ADDED a", "ADDED b", "DELETED a"]);

    let mut current = api
        .watch(&WatchParams::default(), "0")
        .await
        .unwrap()
        .boxed();
    match next(&mut current).await.unwrap() {
        WatchEvent::Added(w) => assert_eq!(name_of(&w), "b"),
        other => panic!("expected synthetic ADDED for b, got {other:?}"),
    }
}

#[tokio::test]
async fn bookmarks_are_sent_when_allowed() {
    let server = widget_server();
    server.set_bookmark_interval(Duration::from_millis(20));
    let api: Api<Widget> = Api::namespaced(server.client(), "default");
    api.create(&PostParams::default(), &widget("w", 1))
        .await
        .unwrap();
    let rv = server.resource_version();
    let mut s = api
        .watch(
            &WatchParams {
                bookmarks: true,
                ..Default::default()
            },
            &rv.to_string(),
        )
        .await
        .unwrap()
        .boxed();
    match next(&mut s).await.unwrap() {
        WatchEvent::Bookmark(b) => {
            assert_eq!(b.metadata.resource_version.parse::<u64>().unwrap(), rv);
        }
        other => panic!("expected BOOKMARK, got {other:?}"),
    }
}

#[tokio::test]
async fn too_old_resource_version_is_410_gone() {
    let server = widget_server();
    let api: Api<Widget> = Api::namespaced(server.client(), "default");
    let old = server.resource_version().to_string();
    api.create(&PostParams::default(), &widget("w", 1))
        .await
        .unwrap();
    server.compact();
    let mut s = api
        .watch(&WatchParams::default(), &old)
        .await
        .unwrap()
        .boxed();
    match next(&mut s).await {
        Ok(WatchEvent::Error(e)) => assert_eq!((e.code, e.reason.as_str()), (410, "Expired")),
        Err(kube::Error::Api(e)) => assert_eq!(e.code, 410),
        other => panic!("expected 410, got {other:?}"),
    }
    // The current resourceVersion is still watchable.
    let now = server.resource_version().to_string();
    let mut s = api
        .watch(&WatchParams::default(), &now)
        .await
        .unwrap()
        .boxed();
    api.delete("w", &DeleteParams::default()).await.unwrap();
    assert!(matches!(
        next(&mut s).await.unwrap(),
        WatchEvent::Deleted(_)
    ));
}

#[tokio::test]
async fn label_selector_transitions_look_like_add_and_delete() {
    let server = widget_server();
    let api: Api<Widget> = Api::namespaced(server.client(), "default");
    let rv = server.resource_version().to_string();
    let mut s = api
        .watch(&WatchParams::default().labels("app=a"), &rv)
        .await
        .unwrap()
        .boxed();
    let mut w = widget("w", 1);
    w.metadata.labels = Some([("app".to_string(), "b".to_string())].into());
    api.create(&PostParams::default(), &w).await.unwrap();
    let set = |v: &str| Patch::Merge(json!({"metadata": {"labels": {"app": v}}}));
    api.patch("w", &PatchParams::default(), &set("a"))
        .await
        .unwrap();
    api.patch("w", &PatchParams::default(), &set("b"))
        .await
        .unwrap();
    assert!(matches!(next(&mut s).await.unwrap(), WatchEvent::Added(_)));
    assert!(matches!(
        next(&mut s).await.unwrap(),
        WatchEvent::Deleted(_)
    ));
}

#[tokio::test]
async fn watch_ends_after_timeout_seconds() {
    let server = widget_server();
    let api: Api<Widget> = Api::namespaced(server.client(), "default");
    let rv = server.resource_version().to_string();
    let mut s = api
        .watch(&WatchParams::default().timeout(1), &rv)
        .await
        .unwrap()
        .boxed();
    let end = tokio::time::timeout(WAIT, s.next())
        .await
        .expect("watch should end by itself");
    assert!(end.is_none(), "no events, then EOF: {end:?}");
    assert_eq!(
        server.request_counts().watches_ended.get("timeout"),
        Some(&1)
    );
}

#[tokio::test]
async fn reflector_follows_list_then_watch() {
    let server = widget_server();
    let api: Api<Widget> = Api::namespaced(server.client(), "default");
    api.create(&PostParams::default(), &widget("pre", 1))
        .await
        .unwrap();
    let (reader, writer) = reflector::store();
    let mut s = reflector(writer, watcher(api.clone(), watcher::Config::default()))
        .applied_objects()
        .boxed();
    assert_eq!(name_of(&next(&mut s).await.unwrap()), "pre");
    api.create(&PostParams::default(), &widget("post", 2))
        .await
        .unwrap();
    assert_eq!(name_of(&next(&mut s).await.unwrap()), "post");
    let mut names: Vec<String> = reader
        .state()
        .iter()
        .map(|w| name_of(w).to_string())
        .collect();
    names.sort();
    assert_eq!(names, ["post", "pre"]);
    let counts = server.request_counts();
    assert_eq!(counts.resource_verb("widgets", "list"), 1);
    assert!(counts.resource_verb("widgets", "watch") >= 1);
}

#[tokio::test]
async fn watcher_relists_after_410_on_an_open_watch() {
    let server = widget_server();
    let api: Api<Widget> = Api::namespaced(server.client(), "default");
    api.create(&PostParams::default(), &widget("a", 1))
        .await
        .unwrap();
    let mut s = watcher(api.clone(), watcher::Config::default()).boxed();
    // Init, InitApply(a), InitDone.
    assert!(matches!(next(&mut s).await.unwrap(), watcher::Event::Init));
    assert!(matches!(
        next(&mut s).await.unwrap(),
        watcher::Event::InitApply(_)
    ));
    assert!(matches!(
        next(&mut s).await.unwrap(),
        watcher::Event::InitDone
    ));
    api.create(&PostParams::default(), &widget("b", 1))
        .await
        .unwrap();
    assert!(matches!(next(&mut s).await.unwrap(), watcher::Event::Apply(w) if name_of(&w) == "b"));
    server.expire_watches();
    // The watcher surfaces the 410 as an error, then relists from scratch.
    match next(&mut s).await {
        Err(e) => assert!(format!("{e:?}").contains("410"), "{e:?}"),
        Ok(ev) => panic!("expected the 410 first, got {ev:?}"),
    }
    assert!(matches!(next(&mut s).await.unwrap(), watcher::Event::Init));
    assert!(matches!(
        next(&mut s).await.unwrap(),
        watcher::Event::InitApply(_)
    ));
    assert!(matches!(
        next(&mut s).await.unwrap(),
        watcher::Event::InitApply(_)
    ));
    assert!(matches!(
        next(&mut s).await.unwrap(),
        watcher::Event::InitDone
    ));
    assert_eq!(server.request_counts().resource_verb("widgets", "list"), 2);
    assert_eq!(
        server.request_counts().watches_ended.get("expired"),
        Some(&1),
        "the server-ended watch is counted once"
    );
}

#[tokio::test]
async fn streaming_list_sends_initial_events_and_end_bookmark() {
    let server = widget_server();
    let api: Api<Widget> = Api::namespaced(server.client(), "default");
    api.create(&PostParams::default(), &widget("a", 1))
        .await
        .unwrap();
    let mut s = watcher(api.clone(), watcher::Config::default().streaming_lists()).boxed();
    assert!(matches!(next(&mut s).await.unwrap(), watcher::Event::Init));
    assert!(
        matches!(next(&mut s).await.unwrap(), watcher::Event::InitApply(w) if name_of(&w) == "a")
    );
    assert!(matches!(
        next(&mut s).await.unwrap(),
        watcher::Event::InitDone
    ));
    assert_eq!(server.request_counts().resource_verb("widgets", "list"), 0);
}

#[tokio::test(start_paused = true)]
async fn watcher_survives_many_server_side_watch_timeouts() {
    let server = widget_server();
    let api: Api<Widget> = Api::namespaced(server.client(), "default");
    let mut s = watcher(api.clone(), watcher::Config::default().timeout(1))
        .applied_objects()
        .boxed();
    for i in 0..5 {
        let name = format!("w{i}");
        api.create(&PostParams::default(), &widget(&name, i))
            .await
            .unwrap();
        assert_eq!(name_of(&next(&mut s).await.unwrap()), name);
        // Let the 1 s server-side watch timeout expire (virtual time).
        tokio::time::advance(Duration::from_secs(2)).await;
    }
    let watches = server.request_counts().resource_verb("widgets", "watch");
    assert!(
        watches >= 3,
        "the watcher re-watched after each timeout ({watches})"
    );
    assert_eq!(
        server.request_counts().resource_verb("widgets", "list"),
        1,
        "no relist needed"
    );
}

#[tokio::test]
async fn metadata_only_get_list_and_watcher() {
    let server = widget_server();
    let api: Api<Widget> = Api::namespaced(server.client(), "default");
    let mut w = widget("a", 1);
    w.metadata.labels = Some([("k".to_string(), "v".to_string())].into());
    api.create(&PostParams::default(), &w).await.unwrap();
    let m = api.get_metadata("a").await.unwrap();
    assert_eq!(m.metadata.labels.unwrap()["k"], "v");
    assert_eq!(m.types.unwrap().kind, "PartialObjectMetadata");
    let l = api
        .list_metadata(&kube::api::ListParams::default())
        .await
        .unwrap();
    assert_eq!(l.items.len(), 1);
    let meta_api: Api<kube::core::PartialObjectMeta<Widget>> =
        Api::namespaced(server.client(), "default");
    let mut s = watcher(meta_api, watcher::Config::default())
        .applied_objects()
        .boxed();
    assert_eq!(
        next(&mut s).await.unwrap().metadata.name.as_deref(),
        Some("a")
    );
    api.create(&PostParams::default(), &widget("b", 1))
        .await
        .unwrap();
    assert_eq!(
        next(&mut s).await.unwrap().metadata.name.as_deref(),
        Some("b")
    );
}

#[tokio::test]
async fn watch_of_a_single_object_by_name_path() {
    let server = widget_server();
    let api: Api<Widget> = Api::namespaced(server.client(), "default");
    api.create(&PostParams::default(), &widget("a", 1))
        .await
        .unwrap();
    api.create(&PostParams::default(), &widget("b", 1))
        .await
        .unwrap();
    let req = http::Request::get(
        "/apis/example.com/v1/namespaces/default/widgets/b?watch=true&resourceVersion=0",
    )
    .body(Vec::new())
    .unwrap();
    let mut s = server
        .client()
        .request_events::<Widget>(req)
        .await
        .unwrap()
        .boxed();
    match next(&mut s).await.unwrap() {
        WatchEvent::Added(w) => assert_eq!(name_of(&w), "b"),
        other => panic!("{other:?}"),
    }
    api.patch(
        "a",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"size": 2}})),
    )
    .await
    .unwrap();
    api.patch(
        "b",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"size": 3}})),
    )
    .await
    .unwrap();
    match next(&mut s).await.unwrap() {
        WatchEvent::Modified(w) => assert_eq!((name_of(&w), w.spec.size), ("b", 3)),
        other => panic!("{other:?}"),
    }
}
