//! kube-runtime's Controller, finalizer helper and event Recorder run unchanged against the
//! fake, including under injected write faults.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use capmox_testkit::{ApiServer, FaultKind};

use crate::common::*;
use futures::StreamExt;
use k8s_openapi::api::events::v1::Event as K8sEvent;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::finalizer::{Event as Finalizer, finalizer};
use kube::runtime::watcher;
use kube::{Resource, ResourceExt};
use serde_json::json;

const FINALIZER: &str = "example.com/cleanup";

#[derive(Debug, thiserror::Error)]
enum Error {
    #[error("finalizer: {0}")]
    Finalizer(#[source] Box<kube::runtime::finalizer::Error<kube::Error>>),
}

struct Ctx {
    client: kube::Client,
    recorder: Recorder,
    cleanups: AtomicUsize,
    errors: AtomicUsize,
}

async fn reconcile(w: Arc<Widget>, ctx: Arc<Ctx>) -> Result<Action, Error> {
    let ns = w.namespace().unwrap_or_default();
    let api: Api<Widget> = Api::namespaced(ctx.client.clone(), &ns);
    finalizer(&api, FINALIZER, w, |event| async {
        match event {
            Finalizer::Apply(w) => {
                let status = json!({"apiVersion": "example.com/v1", "kind": "Widget", "status": {"phase": "Ready"}});
                api.patch_status(&w.name_any(), &PatchParams::apply("widget-ctrl").force(), &Patch::Apply(&status))
                    .await?;
                let ev = Event {
                    type_: EventType::Normal,
                    reason: "Reconciled".into(),
                    note: Some("widget is ready".into()),
                    action: "Reconcile".into(),
                    secondary: None,
                };
                ctx.recorder.publish(&ev, &w.object_ref(&())).await?;
                Ok(Action::await_change())
            }
            Finalizer::Cleanup(_) => {
                ctx.cleanups.fetch_add(1, Ordering::SeqCst);
                Ok::<_, kube::Error>(Action::await_change())
            }
        }
    })
    .await
    .map_err(|e| Error::Finalizer(Box::new(e)))
}

fn error_policy(_w: Arc<Widget>, _e: &Error, ctx: Arc<Ctx>) -> Action {
    ctx.errors.fetch_add(1, Ordering::SeqCst);
    Action::requeue(Duration::from_millis(10))
}

fn start_controller(server: &ApiServer) -> Arc<Ctx> {
    let client = server.client();
    let ctx = Arc::new(Ctx {
        client: client.clone(),
        recorder: Recorder::new(
            client.clone(),
            Reporter {
                controller: "widget-ctrl".into(),
                instance: None,
            },
        ),
        cleanups: AtomicUsize::new(0),
        errors: AtomicUsize::new(0),
    });
    let api: Api<Widget> = Api::all(client);
    let c = ctx.clone();
    tokio::spawn(async move {
        Controller::new(api, watcher::Config::default())
            .run(reconcile, error_policy, c)
            .for_each(|_| async {})
            .await;
    });
    ctx
}

/// Wait until the widget satisfies `pred` (or is gone, when `pred` gets `None`), driven by a watch.
async fn wait_for(api: &Api<Widget>, name: &str, pred: impl Fn(Option<&Widget>) -> bool) {
    let cfg = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let mut s = watcher(api.clone(), cfg).boxed();
    let mut current: Option<Widget> = None;
    let mut synced = false;
    tokio::time::timeout(WAIT, async {
        loop {
            match s.next().await {
                Some(Ok(watcher::Event::Apply(w) | watcher::Event::InitApply(w))) => {
                    current = Some(w)
                }
                Some(Ok(watcher::Event::Delete(_))) => current = None,
                Some(Ok(watcher::Event::Init)) => current = None,
                Some(Ok(watcher::Event::InitDone)) => synced = true,
                Some(Err(_)) => {}
                None => panic!("watch ended"),
            }
            if synced && pred(current.as_ref()) {
                return;
            }
        }
    })
    .await
    .unwrap_or_else(|_| panic!("timed out waiting for {name}; last state {current:?}"));
}

fn ready_with_finalizer(w: Option<&Widget>) -> bool {
    w.is_some_and(|w| {
        w.finalizers().iter().any(|f| f == FINALIZER)
            && w.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Ready")
    })
}

#[tokio::test]
async fn controller_adds_and_removes_its_finalizer() {
    let server = widget_server();
    let ctx = start_controller(&server);
    let api: Api<Widget> = Api::namespaced(server.client(), "default");
    api.create(&PostParams::default(), &widget("w", 1))
        .await
        .unwrap();
    wait_for(&api, "w", ready_with_finalizer).await;
    // The same wait through the server's own helper, on the raw object.
    let ready = server
        .wait_for("widgets", "default", "w", WAIT, |o| {
            o.is_some_and(|o| o["status"]["phase"] == "Ready")
        })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(ready["metadata"]["finalizers"], json!([FINALIZER]));

    let events: Api<K8sEvent> = Api::namespaced(server.client(), "default");
    let published = events.list(&ListParams::default()).await.unwrap();
    assert!(
        published
            .items
            .iter()
            .any(|e| e.reason.as_deref() == Some("Reconciled"))
    );

    api.delete("w", &DeleteParams::default()).await.unwrap();
    wait_for(&api, "w", |w| w.is_none()).await;
    server
        .wait_for("widgets", "default", "w", WAIT, |o| o.is_none())
        .await
        .unwrap();
    assert_eq!(ctx.cleanups.load(Ordering::SeqCst), 1);
    assert_eq!(ctx.errors.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn controller_recovers_from_injected_write_faults() {
    let server = widget_server();
    let api: Api<Widget> = Api::namespaced(server.client(), "default");
    api.create(&PostParams::default(), &widget("w", 1))
        .await
        .unwrap();
    server
        .fail_next_writes("widgets", 2, FaultKind::Conflict)
        .unwrap();
    server
        .fail_next_writes("widgets.example.com", 1, FaultKind::InternalError)
        .unwrap();
    server.reset_request_counts();
    let ctx = start_controller(&server);
    wait_for(&api, "w", ready_with_finalizer).await;
    assert_eq!(
        ctx.errors.load(Ordering::SeqCst),
        3,
        "each injected fault surfaced once"
    );
    let patches = server.request_counts().resource_verb("widgets", "patch");
    assert!(
        patches >= 4,
        "3 failed finalizer patches, then a successful one ({patches})"
    );
}

/// A controller that owns a Secret per Widget and re-creates it when it is deleted.
async fn reconcile_owner(w: Arc<Widget>, client: Arc<kube::Client>) -> Result<Action, kube::Error> {
    let ns = w.namespace().unwrap_or_default();
    let secrets: Api<k8s_openapi::api::core::v1::Secret> = Api::namespaced((*client).clone(), &ns);
    let oref = w
        .controller_owner_ref(&())
        .expect("widgets from the API have name and uid");
    let secret = json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": format!("{}-data", w.name_any()), "ownerReferences": [oref]},
        "stringData": {"size": w.spec.size.to_string()}
    });
    secrets
        .patch(
            &format!("{}-data", w.name_any()),
            &PatchParams::apply("owner-ctrl").force(),
            &Patch::Apply(&secret),
        )
        .await?;
    Ok(Action::await_change())
}

fn owner_error_policy(_w: Arc<Widget>, _e: &kube::Error, _c: Arc<kube::Client>) -> Action {
    Action::requeue(Duration::from_millis(10))
}

async fn next_secret<T: std::fmt::Debug, S: futures::Stream<Item = kube::Result<T>> + Unpin>(
    s: &mut S,
) -> T {
    match tokio::time::timeout(WAIT, s.next())
        .await
        .expect("secret event in time")
    {
        Some(Ok(ev)) => ev,
        other => panic!("unexpected watch item {other:?}"),
    }
}

async fn run_owner_controller_scenario(controller_client: kube::Client, server: &ApiServer) {
    let widgets: Api<Widget> = Api::all(controller_client.clone());
    let secrets_all: Api<k8s_openapi::api::core::v1::Secret> = Api::all(controller_client.clone());
    let ctx = Arc::new(controller_client);
    let handle = tokio::spawn(async move {
        Controller::new(widgets, watcher::Config::default())
            .owns(secrets_all, watcher::Config::default())
            .run(reconcile_owner, owner_error_policy, ctx)
            .for_each(|_| async {})
            .await;
    });
    let client = server.client();
    let api: Api<Widget> = Api::namespaced(client.clone(), "default");
    let secrets: Api<k8s_openapi::api::core::v1::Secret> =
        Api::namespaced(client.clone(), "default");
    api.create(&PostParams::default(), &widget("w", 1))
        .await
        .unwrap();
    let mut events = secrets
        .watch(&kube::api::WatchParams::default(), "0")
        .await
        .unwrap()
        .boxed();
    assert!(matches!(
        next_secret(&mut events).await,
        kube::api::WatchEvent::Added(_)
    ));
    // Deleting the owned secret wakes the owner's reconcile, which re-creates it.
    secrets
        .delete("w-data", &DeleteParams::default())
        .await
        .unwrap();
    assert!(matches!(
        next_secret(&mut events).await,
        kube::api::WatchEvent::Deleted(_)
    ));
    assert!(matches!(
        next_secret(&mut events).await,
        kube::api::WatchEvent::Added(_)
    ));
    // Deleting the owner garbage-collects the secret.
    api.delete("w", &DeleteParams::default()).await.unwrap();
    assert!(matches!(
        next_secret(&mut events).await,
        kube::api::WatchEvent::Deleted(_)
    ));
    assert!(secrets.get_opt("w-data").await.unwrap().is_none());
    handle.abort();
}

#[tokio::test]
async fn controller_owns_secrets_in_process() {
    let server = widget_server();
    run_owner_controller_scenario(server.client(), &server).await;
}

#[tokio::test]
async fn controller_owns_secrets_over_http() {
    let server = widget_server();
    let http = server.serve_http().await.unwrap();
    let kc = kube::config::Kubeconfig::from_yaml(&http.kubeconfig()).unwrap();
    let cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default())
        .await
        .unwrap();
    let client = kube::Client::try_from(cfg).unwrap();
    run_owner_controller_scenario(client, &server).await;
}
