//! The HTTP form: a kube client built from the generated kubeconfig, streaming watches over
//! the wire, discovery, and `kubectl get proxmoxmachines`.

use crate::common::*;
use futures::StreamExt;
use kube::api::{Api, ListParams, PostParams, WatchEvent, WatchParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::discovery::Discovery;
use serde_json::json;

async fn http_client(kubeconfig: &str) -> kube::Client {
    let kc = Kubeconfig::from_yaml(kubeconfig).expect("generated kubeconfig parses");
    let cfg = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .expect("kubeconfig is usable");
    kube::Client::try_from(cfg).expect("client builds")
}

#[tokio::test]
async fn kube_client_over_http_with_streaming_watch() {
    let server = widget_server();
    let http = server.serve_http().await.unwrap();
    assert!(http.addr().ip().is_loopback());
    let client = http_client(&http.kubeconfig()).await;
    let health = client
        .request_text(http::Request::get("/readyz").body(Vec::new()).unwrap())
        .await
        .unwrap();
    assert_eq!(health, "ok");
    let version = client.apiserver_version().await.unwrap();
    assert_eq!(version.major, "1");
    let api: Api<Widget> = Api::namespaced(client, "default");
    api.create(&PostParams::default(), &widget("w", 1))
        .await
        .unwrap();
    assert_eq!(api.get("w").await.unwrap().spec.size, 1);
    let rv = server.resource_version().to_string();
    let mut s = api
        .watch(&WatchParams::default(), &rv)
        .await
        .unwrap()
        .boxed();
    // The event is produced after the watch response started: it must be streamed.
    api.create(&PostParams::default(), &widget("later", 2))
        .await
        .unwrap();
    let ev = tokio::time::timeout(WAIT, s.next())
        .await
        .expect("streamed in time")
        .unwrap()
        .unwrap();
    match ev {
        WatchEvent::Added(w) => assert_eq!(w.metadata.name.as_deref(), Some("later")),
        other => panic!("{other:?}"),
    }
    let missing = api.get("nope").await.unwrap_err();
    assert_eq!(code(missing), (404, "NotFound".into()));
}

#[tokio::test]
async fn discovery_finds_registered_groups() {
    let server = upstream_server();
    let http = server.serve_http().await.unwrap();
    let client = http_client(&http.kubeconfig()).await;
    let discovery = Discovery::new(client).run().await.unwrap();
    let found: Vec<String> = discovery
        .groups()
        .flat_map(|g| {
            g.resources_by_stability()
                .into_iter()
                .map(|(ar, _)| ar.plural)
        })
        .collect();
    for plural in [
        "proxmoxmachines",
        "machines",
        "ipaddressclaims",
        "secrets",
        "leases",
        "namespaces",
    ] {
        assert!(found.iter().any(|p| p == plural), "{plural} in {found:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_get_proxmoxmachines() {
    let server = upstream_server();
    let kubectl = kubectl();
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
        "metadata": {"name": "machine-a", "labels": {"cluster.x-k8s.io/cluster-name": "c1"}},
        "spec": {"sourceNode": "pve1"}
    }))
    .unwrap();
    pm.create(&PostParams::default(), &obj).await.unwrap();
    assert_eq!(
        pm.list(&ListParams::default()).await.unwrap().items.len(),
        1
    );

    let http = server.serve_http().await.unwrap();
    let path = std::env::temp_dir().join(format!(
        "capmox-testkit-{}-{}.kubeconfig",
        std::process::id(),
        http.addr().port()
    ));
    http.write_kubeconfig(&path).unwrap();
    let run = move |path: &std::path::Path, args: &[&str]| {
        let out = std::process::Command::new(&kubectl)
            .arg("--kubeconfig")
            .arg(path)
            .args(args)
            .output()
            .expect("kubectl runs");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).to_string(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    let (ok, stdout, stderr) = tokio::task::spawn_blocking(move || {
        let manifest = path.with_extension("yaml");
        let yaml = "apiVersion: infrastructure.cluster.x-k8s.io/v1alpha2\nkind: ProxmoxMachine\nmetadata:\n  name: machine-b\n  namespace: default\nspec:\n  sourceNode: pve2\n";
        std::fs::write(&manifest, yaml).expect("temp dir is writable");
        let manifest_arg = manifest.to_string_lossy().to_string();
        let applied = run(&path, &["apply", "--server-side", "--validate=false", "-f", &manifest_arg]);
        let _ = std::fs::remove_file(&manifest);
        assert!(applied.0, "kubectl apply --server-side: {}", applied.2);
        let table = run(&path, &["get", "proxmoxmachines"]);
        let json = run(&path, &["get", "proxmoxmachine", "machine-a", "-o", "json"]);
        let describe = run(&path, &["describe", "proxmoxmachine", "machine-a"]);
        assert!(describe.0 && describe.1.contains("Events:"), "kubectl describe (event field selectors): {} {}", describe.1, describe.2);
        let _ = std::fs::remove_file(&path);
        (
            table.0 && json.0,
            format!("{}\n{}", table.1, json.1),
            format!("{}\n{}", table.2, json.2),
        )
    })
    .await
    .unwrap();
    assert!(ok, "kubectl failed: {stderr}");
    let table_line = stdout
        .lines()
        .find(|l| l.starts_with("machine-a"))
        .unwrap_or("");
    let header = stdout.lines().next().unwrap_or("");
    assert!(
        header.starts_with("NAME") && header.contains("CLUSTER"),
        "CRD printer columns: {stdout}"
    );
    assert!(
        table_line.split_whitespace().nth(1) == Some("c1"),
        "cluster column: {stdout}"
    );
    assert!(stdout.contains("\"sourceNode\": \"pve1\""), "{stdout}");
    let b = pm.get("machine-b").await.expect("applied by kubectl");
    assert_eq!(b.data["spec"]["sourceNode"], "pve2");
    let managers: Vec<_> = b
        .metadata
        .managed_fields
        .unwrap_or_default()
        .into_iter()
        .filter_map(|m| m.manager)
        .collect();
    assert_eq!(managers, ["kubectl"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_apply_of_a_crd_registers_its_kind() {
    let crd_path = data("go-provider/crds/infrastructure.cluster.x-k8s.io_proxmoxclusters.yaml");
    let kubectl = kubectl();
    let server = widget_server();
    assert!(server.kinds().iter().all(|k| k.kind != "ProxmoxCluster"));
    let http = server.serve_http().await.unwrap();
    let path = std::env::temp_dir().join(format!(
        "capmox-testkit-crd-{}-{}.kubeconfig",
        std::process::id(),
        http.addr().port()
    ));
    http.write_kubeconfig(&path).unwrap();
    let crd = crd_path.to_path_buf();
    let out = tokio::task::spawn_blocking(move || {
        let out = std::process::Command::new(&kubectl)
            .arg("--kubeconfig")
            .arg(&path)
            .args(["apply", "--server-side", "--validate=false", "-f"])
            .arg(&crd)
            .output()
            .expect("kubectl runs");
        let _ = std::fs::remove_file(&path);
        out
    })
    .await
    .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(server.kinds().iter().any(|k| k.kind == "ProxmoxCluster"));
    let crds = server.objects("crd").unwrap();
    let established = crds[0]["status"]["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .any(|c| c["type"] == "Established");
    assert!(established, "{}", crds[0]["status"]);
    let clusters = dynamic(
        &server.client(),
        "infrastructure.cluster.x-k8s.io",
        "v1alpha2",
        "ProxmoxCluster",
        "proxmoxclusters",
        Some("default"),
    );
    assert!(
        clusters
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .is_empty()
    );
    server
        .create_yaml("apiVersion: infrastructure.cluster.x-k8s.io/v1alpha2\nkind: ProxmoxCluster\nmetadata: {name: pc}\nspec: {}\n")
        .unwrap();
    assert_eq!(server.objects("proxmoxclusters").unwrap().len(), 1);
    let crd_api = dynamic(
        &server.client(),
        "apiextensions.k8s.io",
        "v1",
        "CustomResourceDefinition",
        "customresourcedefinitions",
        None,
    );
    crd_api
        .delete(
            "proxmoxclusters.infrastructure.cluster.x-k8s.io",
            &Default::default(),
        )
        .await
        .unwrap();
    assert!(server.kinds().iter().all(|k| k.kind != "ProxmoxCluster"));
    assert!(
        server.objects("proxmoxclusters").is_err(),
        "kind no longer served"
    );
    server.register_crd_file(crd_path).unwrap();
    assert!(
        server.objects("proxmoxclusters").unwrap().is_empty(),
        "custom resources went with their CRD"
    );
}

#[tokio::test]
async fn dropping_the_http_server_closes_open_watches() {
    let server = widget_server();
    let http = server.serve_http().await.unwrap();
    let client = http_client(&http.kubeconfig()).await;
    let api: Api<Widget> = Api::namespaced(client, "default");
    let rv = server.resource_version().to_string();
    let mut s = api
        .watch(&WatchParams::default(), &rv)
        .await
        .unwrap()
        .boxed();
    drop(http);
    let end = tokio::time::timeout(WAIT, s.next())
        .await
        .expect("the watch ends when the server goes");
    assert!(
        !matches!(end, Some(Ok(_))),
        "no event after shutdown: {end:?}"
    );
}

/// `ApiServer::client_named` attributes requests to a client in RBAC terms (verbs as the API
/// server authorizes them, the status subresource apart, namespaces kept), over the in-process
/// transport and over HTTP with the header; other clients' requests are not attributed.
#[tokio::test]
async fn requests_are_attributed_to_named_clients_in_rbac_terms() {
    use capmox_testkit::{CLIENT_HEADER, ClientRequest};
    use kube::api::{DeleteParams, Patch, PatchParams};
    use std::collections::BTreeMap;

    let server = widget_server();
    let named = server.client_named("ctrl");
    let widgets: Api<Widget> = Api::namespaced(named.clone(), "default");
    widgets
        .create(&PostParams::default(), &widget("w", 1))
        .await
        .unwrap();
    let mut w = widgets.get("w").await.unwrap();
    w.spec.size = 2;
    widgets
        .replace("w", &PostParams::default(), &w)
        .await
        .unwrap();
    widgets
        .patch(
            "w",
            &PatchParams::apply("ctrl").force(),
            &Patch::Apply(
                json!({"apiVersion": "example.com/v1", "kind": "Widget", "spec": {"size": 3}}),
            ),
        )
        .await
        .unwrap();
    widgets
        .patch_status(
            "w",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"phase": "up"}})),
        )
        .await
        .unwrap();
    let all: Api<Widget> = Api::all(named.clone());
    all.list(&ListParams::default()).await.unwrap();
    let rv = server.resource_version().to_string();
    let _watch = all.watch(&WatchParams::default(), &rv).await.unwrap();
    widgets.delete("w", &DeleteParams::default()).await.unwrap();
    widgets
        .delete_collection(&DeleteParams::default(), &ListParams::default())
        .await
        .unwrap();
    named.apiserver_version().await.unwrap();
    // A missing kind matches no route and is not recorded.
    let missing = named
        .request_text(
            http::Request::get("/apis/example.com/v1/namespaces/default/nothings")
                .body(Vec::new())
                .unwrap(),
        )
        .await;
    assert!(missing.is_err());

    // Another in-process client and an HTTP client naming someone else.
    let other: Api<Widget> = Api::namespaced(server.client(), "default");
    other
        .create(&PostParams::default(), &widget("x", 1))
        .await
        .unwrap();
    let http = server.serve_http().await.unwrap();
    let over_http = http_client(&http.kubeconfig()).await;
    over_http
        .request_text(
            http::Request::get("/apis/example.com/v1/namespaces/default/widgets/x")
                .header(CLIENT_HEADER, "kubectl")
                .body(Vec::new())
                .unwrap(),
        )
        .await
        .unwrap();

    let request = |verb: &str, sub: Option<&str>, ns: Option<&str>| ClientRequest {
        group: "example.com".into(),
        resource: "widgets".into(),
        subresource: sub.map(Into::into),
        verb: verb.into(),
        namespace: ns.map(Into::into),
    };
    let default = Some("default");
    let expected: BTreeMap<ClientRequest, u64> = [
        (request("create", None, default), 1),
        (request("get", None, default), 1),
        (request("update", None, default), 1),
        (request("patch", None, default), 1),
        (request("patch", Some("status"), default), 1),
        (request("list", None, None), 1),
        (request("watch", None, None), 1),
        (request("delete", None, default), 1),
        (request("deletecollection", None, default), 1),
        (
            ClientRequest {
                group: String::new(),
                resource: "/version".into(),
                subresource: None,
                verb: "get".into(),
                namespace: None,
            },
            1,
        ),
    ]
    .into_iter()
    .collect();
    assert_eq!(server.requests_by_client("ctrl"), expected);
    assert_eq!(
        server.requests_by_client("kubectl"),
        BTreeMap::from([(request("get", None, default), 1)])
    );
    assert!(server.requests_by_client("nobody").is_empty());
    server.reset_request_counts();
    assert!(server.requests_by_client("ctrl").is_empty());
}

/// A client over HTTP that names itself only by its `User-Agent` (as `capmox run` does) gets
/// its own request counters, every request once and the watch streams the server ended
/// included; requests of other clients, in process or over HTTP, are not in them.
#[tokio::test]
async fn request_counters_per_client_follow_the_user_agent() {
    use kube::api::{Patch, PatchParams};

    let server = widget_server();
    let http = server.serve_http().await.unwrap();
    let kc = Kubeconfig::from_yaml(&http.kubeconfig()).unwrap();
    let mut cfg = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .unwrap();
    cfg.headers.push((
        http::header::USER_AGENT,
        http::HeaderValue::from_static("ctrl/1.2.3 (linux/amd64)"),
    ));
    let ctrl = kube::Client::try_from(cfg).unwrap();
    let widgets: Api<Widget> = Api::namespaced(ctrl.clone(), "default");
    widgets
        .create(&PostParams::default(), &widget("w", 1))
        .await
        .unwrap();
    widgets.get("w").await.unwrap();
    // A server-side apply that creates its object is one request (RBAC authorizes it twice).
    widgets
        .patch(
            "v",
            &PatchParams::apply("ctrl").force(),
            &Patch::Apply(
                json!({"apiVersion": "example.com/v1", "kind": "Widget", "spec": {"size": 3}}),
            ),
        )
        .await
        .unwrap();
    widgets
        .patch_status(
            "w",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"phase": "up"}})),
        )
        .await
        .unwrap();
    let mut stream = widgets
        .watch(
            &WatchParams::default(),
            &server.resource_version().to_string(),
        )
        .await
        .unwrap()
        .boxed();
    server.expire_watches();
    while stream.next().await.is_some() {}

    // Not ctrl's: an unnamed in-process client and an HTTP client without a User-Agent.
    let other: Api<Widget> = Api::namespaced(server.client(), "default");
    other.get("w").await.unwrap();
    let anonymous: Api<Widget> = Api::namespaced(http_client(&http.kubeconfig()).await, "default");
    anonymous.get("w").await.unwrap();

    let counts = server.request_counts_of("ctrl");
    let widgets = "widgets.example.com";
    assert_eq!(counts.resource_verb(widgets, "create"), 1);
    assert_eq!(counts.resource_verb(widgets, "get"), 1);
    assert_eq!(counts.resource_verb(widgets, "patch"), 1);
    assert_eq!(counts.resource_verb("widgets/status", "patch"), 1);
    assert_eq!(counts.resource_verb(widgets, "watch"), 1);
    assert_eq!(counts.total(), 5);
    assert_eq!(counts.watches_ended.get("expired"), Some(&1));
    assert_eq!(server.request_counts().verb("get"), 3);
    let stored = server.object("widgets", "default", "w").unwrap().unwrap();
    assert_eq!(
        stored["metadata"]["managedFields"][0]["manager"], "ctrl",
        "the User-Agent's product token is the default field manager"
    );
    server.reset_request_counts();
    assert_eq!(server.request_counts_of("ctrl").total(), 0);
}
