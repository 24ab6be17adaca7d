//! Conformance: fault injection, validation hooks and request counters.

use crate::common::*;
use capmox_testkit::{FaultKind, TestkitError};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;

#[tokio::test]
async fn injected_faults_fail_exactly_the_next_n_writes() {
    let server = widget_server();
    let api: Api<Widget> = Api::namespaced(server.client(), "default");
    let cases = [
        (FaultKind::Conflict, 409, "Conflict"),
        (FaultKind::InternalError, 500, "InternalError"),
        (FaultKind::Timeout, 504, "Timeout"),
        (FaultKind::TooManyRequests, 429, "TooManyRequests"),
    ];
    for (i, (fault, want_code, want_reason)) in cases.into_iter().enumerate() {
        server.fail_next_writes("Widget", 2, fault).unwrap();
        let name = format!("w{i}");
        for _ in 0..2 {
            let err = api
                .create(&PostParams::default(), &widget(&name, 1))
                .await
                .unwrap_err();
            assert_eq!(code(err), (want_code, want_reason.to_string()));
        }
        api.get_opt(&name).await.expect("reads are not affected");
        api.create(&PostParams::default(), &widget(&name, 1))
            .await
            .expect("faults used up");
    }
    server
        .fail_next_writes("wd", 3, FaultKind::InternalError)
        .unwrap();
    let p = Patch::Merge(json!({"spec": {"size": 2}}));
    assert_eq!(
        code(
            api.patch("w0", &PatchParams::default(), &p)
                .await
                .unwrap_err()
        )
        .0,
        500
    );
    assert_eq!(
        code(
            api.replace_status("w0", &PostParams::default(), &api.get("w0").await.unwrap())
                .await
                .unwrap_err()
        )
        .0,
        500
    );
    assert_eq!(
        code(
            api.delete("w0", &DeleteParams::default())
                .await
                .unwrap_err()
        )
        .0,
        500
    );
    api.delete("w0", &DeleteParams::default()).await.unwrap();
    assert!(matches!(
        server.fail_next_writes("nosuchkind", 1, FaultKind::Conflict),
        Err(TestkitError::UnknownKind(_))
    ));
}

#[tokio::test]
async fn validator_hook_rejects_invalid_objects_with_422() {
    let server = widget_server();
    server
        .set_validator("widgets.example.com", |obj| {
            match obj["spec"]["size"].as_i64() {
                Some(s) if s >= 0 => Ok(()),
                _ => Err("spec.size: Invalid value: must be >= 0".into()),
            }
        })
        .unwrap();
    let api: Api<Widget> = Api::namespaced(server.client(), "default");
    let err = api
        .create(&PostParams::default(), &widget("bad", -1))
        .await
        .unwrap_err();
    match err {
        kube::Error::Api(s) => {
            assert_eq!((s.code, s.reason.as_str()), (422, "Invalid"));
            assert!(s.message.contains("spec.size"), "{}", s.message);
        }
        other => panic!("{other:?}"),
    }
    api.create(&PostParams::default(), &widget("good", 1))
        .await
        .unwrap();
    let p = Patch::Merge(json!({"spec": {"size": -5}}));
    assert_eq!(
        code(
            api.patch("good", &PatchParams::default(), &p)
                .await
                .unwrap_err()
        )
        .0,
        422
    );
    assert_eq!(api.get("good").await.unwrap().spec.size, 1);
}

#[tokio::test]
async fn request_counters_by_verb_and_resource() {
    let server = widget_server();
    let api: Api<Widget> = Api::namespaced(server.client(), "default");
    server.reset_request_counts();
    api.create(&PostParams::default(), &widget("w", 1))
        .await
        .unwrap();
    api.get("w").await.unwrap();
    api.get("w").await.unwrap();
    api.list(&ListParams::default()).await.unwrap();
    let p = Patch::Merge(json!({"status": {"phase": "x"}}));
    api.patch_status("w", &PatchParams::default(), &p)
        .await
        .unwrap();
    api.delete("w", &DeleteParams::default()).await.unwrap();
    let c = server.request_counts();
    assert_eq!(c.verb("create"), 1);
    assert_eq!(c.verb("get"), 2);
    assert_eq!(c.verb("list"), 1);
    assert_eq!(c.verb("patch"), 1);
    assert_eq!(c.verb("delete"), 1);
    assert_eq!(c.resource_verb("widgets.example.com/status", "patch"), 1);
    assert_eq!(
        c.resource_verb("widgets", "patch"),
        0,
        "status writes are counted on widgets/status"
    );
    assert_eq!(server.request_count(), 6);
}

#[tokio::test]
async fn schema_validator_hook_runs_crd_cel_rules_with_old_object() {
    let server = upstream_server();
    server
        .set_schema_validator("proxmoxmachines", |input| {
            let schema = input.schema.ok_or("CRD kinds have a schema")?;
            kube_cel::Validator::new()
                .validate(schema, input.object, input.old_object)
                .map_err(|e| e.to_string())
        })
        .unwrap();
    let client = server.client();
    let pm = dynamic(
        &client,
        "infrastructure.cluster.x-k8s.io",
        "v1alpha2",
        "ProxmoxMachine",
        "proxmoxmachines",
        Some("default"),
    );
    let mut spec =
        json!({"sourceNode": "pve1", "disks": {"bootVolume": {"disk": "scsi0", "sizeGb": 10}}});
    let machine = |spec: &serde_json::Value| -> kube::api::DynamicObject {
        serde_json::from_value(json!({
            "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha2", "kind": "ProxmoxMachine",
            "metadata": {"name": "m"}, "spec": spec
        }))
        .unwrap()
    };
    let (c, _) = code(
        pm.create(&PostParams::default(), &machine(&spec))
            .await
            .unwrap_err(),
    );
    assert_eq!(
        c, 422,
        "the CRD's CEL rules require a templateID or templateSelector"
    );
    spec["templateID"] = json!(100);
    pm.create(&PostParams::default(), &machine(&spec))
        .await
        .unwrap();
    let grow = Patch::Merge(json!({"spec": {"disks": {"bootVolume": {"sizeGb": 20}}}}));
    match pm
        .patch("m", &PatchParams::default(), &grow)
        .await
        .unwrap_err()
    {
        kube::Error::Api(s) => {
            assert_eq!(s.code, 422);
            assert!(s.message.contains("Value is immutable"), "{}", s.message);
        }
        other => panic!("{other:?}"),
    }
    let label = Patch::Merge(json!({"metadata": {"labels": {"a": "b"}}}));
    pm.patch("m", &PatchParams::default(), &label)
        .await
        .expect("unrelated change passes");
}

#[tokio::test(start_paused = true)]
async fn delay_fault_slows_the_next_write_then_performs_it() {
    let server = widget_server();
    let api: Api<Widget> = Api::namespaced(server.client(), "default");
    server
        .fail_next_writes(
            "widgets",
            1,
            FaultKind::Delay(std::time::Duration::from_secs(30)),
        )
        .unwrap();
    let started = tokio::time::Instant::now();
    let slow = tokio::time::timeout(
        std::time::Duration::from_secs(5),
        api.create(&PostParams::default(), &widget("slow", 1)),
    )
    .await;
    assert!(
        slow.is_err(),
        "a 5 s client timeout fires before the 30 s delay"
    );
    // The abandoned request never reached the store; the next write is not delayed.
    api.create(&PostParams::default(), &widget("fast", 1))
        .await
        .unwrap();
    assert!(started.elapsed() < std::time::Duration::from_secs(6));
    assert!(api.get_opt("slow").await.unwrap().is_none());
    // A patient client gets the write done after the delay.
    server
        .fail_next_writes(
            "widgets",
            1,
            FaultKind::Delay(std::time::Duration::from_secs(2)),
        )
        .unwrap();
    let before = tokio::time::Instant::now();
    api.create(&PostParams::default(), &widget("patient", 1))
        .await
        .unwrap();
    assert!(before.elapsed() >= std::time::Duration::from_secs(2));
    assert!(api.get_opt("patient").await.unwrap().is_some());
}

#[tokio::test]
async fn fault_hook_targets_single_requests() {
    let server = widget_server();
    let api: Api<Widget> = Api::namespaced(server.client(), "default");
    api.create(&PostParams::default(), &widget("a", 1))
        .await
        .unwrap();
    api.create(&PostParams::default(), &widget("b", 1))
        .await
        .unwrap();
    server.set_fault_hook(|req| {
        (req.verb == "patch" && req.subresource == Some("status") && req.name == Some("a"))
            .then_some(FaultKind::InternalError)
    });
    let p = Patch::Merge(json!({"status": {"phase": "x"}}));
    assert_eq!(
        code(
            api.patch_status("a", &PatchParams::default(), &p)
                .await
                .unwrap_err()
        )
        .0,
        500
    );
    assert_eq!(
        code(
            api.patch_status("a", &PatchParams::default(), &p)
                .await
                .unwrap_err()
        )
        .0,
        500
    );
    api.patch_status("b", &PatchParams::default(), &p)
        .await
        .expect("other objects unaffected");
    api.patch(
        "a",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"size": 2}})),
    )
    .await
    .expect("main resource unaffected");
    server.set_fault_hook(|req| (req.verb == "list").then_some(FaultKind::TooManyRequests));
    assert_eq!(
        code(api.list(&ListParams::default()).await.unwrap_err()).0,
        429
    );
    // A hook can target one named client and spare the others.
    server.set_fault_hook(|req| (req.client == Some("victim")).then_some(FaultKind::Timeout));
    let victim: Api<Widget> = Api::namespaced(server.client_named("victim"), "default");
    assert_eq!(
        code(victim.list(&ListParams::default()).await.unwrap_err()).0,
        504
    );
    let bystander: Api<Widget> = Api::namespaced(server.client_named("bystander"), "default");
    assert_eq!(
        bystander
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .len(),
        2
    );
    server.clear_fault_hook();
    assert_eq!(
        api.list(&ListParams::default()).await.unwrap().items.len(),
        2
    );
    assert_eq!(
        server
            .request_counts()
            .resource_verb("widgets/status", "patch"),
        3,
        "failed requests are counted"
    );
}

#[tokio::test(start_paused = true)]
async fn wait_for_times_out_with_the_last_state() {
    let server = widget_server();
    let api: Api<Widget> = Api::namespaced(server.client(), "default");
    api.create(&PostParams::default(), &widget("w", 1))
        .await
        .unwrap();
    let err = server
        .wait_for(
            "widgets",
            "default",
            "w",
            std::time::Duration::from_secs(3),
            |o| o.is_some_and(|o| o["spec"]["size"] == 2),
        )
        .await
        .unwrap_err();
    match err {
        TestkitError::Timeout { last, .. } => assert_eq!(last["spec"]["size"], 1),
        other => panic!("{other:?}"),
    }
    let waiter = {
        let server = server.clone();
        tokio::spawn(async move {
            server
                .wait_for("widgets", "default", "w", WAIT, |o| {
                    o.is_some_and(|o| o["spec"]["size"] == 2)
                })
                .await
        })
    };
    api.patch(
        "w",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"size": 2}})),
    )
    .await
    .unwrap();
    let found = waiter.await.unwrap().unwrap().unwrap();
    assert_eq!(found["spec"]["size"], 2);
}
