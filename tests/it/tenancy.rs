//! Tenants in several namespaces share one capmox: none reaches another's credentials, Secrets
//! or VMs. Global credentials serve only the namespaces the installer listed, a Secret that is
//! missing and one that is not allowed look the same, a namespaced install reads no Secret
//! elsewhere, a Secret may name only allowed Proxmox origins, a shared Secret stays held while
//! a cluster uses it, only templates are cloned, and `spec.virtualMachineID` never hands one
//! tenant's VM to another.

use std::sync::Arc;

use capmox::api::{ProxmoxCluster, ProxmoxMachine};
use capmox::controller::{Context, GlobalCredentials};
use k8s_openapi::api::core::v1::Secret;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::wait::{await_condition, conditions};
use serde_json::{Value, json};

use crate::common::env::{ENV_WAIT, Env, condition, manager_config};

fn cluster_spec(credentials: Option<Value>) -> Value {
    let mut spec = json!({
        "controlPlaneEndpoint": {"host": "10.0.0.10", "port": 6443},
        "dnsServers": ["10.0.0.2"],
        "ipv4Config": {"addresses": ["10.0.0.100-10.0.0.150"], "prefix": 24, "gateway": "10.0.0.1"},
    });
    if let Some(reference) = credentials {
        spec["credentialsRef"] = reference;
    }
    spec
}

fn machine_spec() -> Value {
    json!({
        "sourceNode": "pve1",
        "templateID": 9000,
        "network": {"networkDevices": [{"name": "net0", "bridge": "vmbr0", "defaultIPv4": true}]}
    })
}

/// A test environment whose capmox runs under the settings `settings` gives (its credentials
/// and tenancy settings), talking through a client named `capmox` so its requests can be
/// looked at.
async fn env_with(settings: impl FnOnce(&Env) -> GlobalCredentials) -> Env {
    let mut env = Env::start().await;
    let settings = settings(&env);
    env.context = Arc::new(Context::new(
        env.server.client_named("capmox"),
        manager_config(),
        settings,
    ));
    env
}

/// The global credentials for the simulator, for the namespaces listed.
fn global_for(env: &Env, namespaces: &[&str]) -> GlobalCredentials {
    let token = env.sim.token();
    let (id, secret) = token.split_once('=').expect("token id=secret");
    GlobalCredentials {
        url: Some(env.sim.url()),
        token_id: Some(id.to_owned()),
        secret: Some(capmox::proxmox::Secret::new(secret)),
        namespaces: namespaces.iter().map(|n| (*n).to_owned()).collect(),
        ..GlobalCredentials::default()
    }
}

async fn create<K>(client: &kube::Client, namespace: &str, object: Value) -> K
where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>
        + Clone
        + serde::de::DeserializeOwned
        + serde::Serialize
        + std::fmt::Debug,
{
    let object: K = serde_json::from_value(object).expect("object");
    Api::<K>::namespaced(client.clone(), namespace)
        .create(&PostParams::default(), &object)
        .await
        .unwrap_or_else(|e| panic!("{} created in {namespace}: {e}", K::kind(&())))
}

/// The simulator's credentials as Secret `name` in `namespace`, with `url` in place of the
/// simulator's when given.
async fn credentials(env: &Env, namespace: &str, name: &str, url: Option<&str>) -> Secret {
    let token = env.sim.token();
    let (id, secret) = token.split_once('=').expect("token id=secret");
    create(
        &env.client(),
        namespace,
        json!({
            "apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": name, "namespace": namespace},
            "stringData": {"url": url.map_or_else(|| env.sim.url(), str::to_owned), "token": id, "secret": secret}
        }),
    )
    .await
}

/// A CAPI Cluster and the ProxmoxCluster `name` it owns, in `namespace`.
async fn cluster(env: &Env, namespace: &str, name: &str, spec: Value) {
    let capi: capmox::capi::Cluster = create(
        &env.client(),
        namespace,
        json!({
            "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Cluster",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"infrastructureRef": {"apiGroup": "infrastructure.cluster.x-k8s.io", "kind": "ProxmoxCluster", "name": name}}
        }),
    )
    .await;
    let _: ProxmoxCluster = create(
        &env.client(),
        namespace,
        json!({
            "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha2", "kind": "ProxmoxCluster",
            "metadata": {
                "name": name, "namespace": namespace,
                "labels": {"cluster.x-k8s.io/cluster-name": name},
                "ownerReferences": [{"apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Cluster", "name": name, "uid": capi.uid().expect("uid")}]
            },
            "spec": spec
        }),
    )
    .await;
}

/// The ProxmoxCluster `demo` in `namespace`, its credentials the Secret `creds` there (the
/// simulator's, with `url` in place of its URL when given).
async fn cluster_with_secret(env: &Env, namespace: &str, url: Option<&str>) {
    credentials(env, namespace, "creds", url).await;
    let spec = cluster_spec(Some(json!({"name": "creds"})));
    cluster(env, namespace, "demo", spec).await;
}

/// Waits until the object `namespace/name` satisfies `done`, returning it.
async fn wait_for<K>(
    env: &Env,
    namespace: &str,
    name: &str,
    what: &str,
    done: impl Fn(&K) -> bool,
) -> K
where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug
        + Send
        + 'static,
{
    let api = Api::<K>::namespaced(env.client(), namespace);
    let found = tokio::time::timeout(
        ENV_WAIT,
        await_condition(api.clone(), name, move |o: Option<&K>| o.is_some_and(&done)),
    )
    .await;
    match found {
        Ok(Ok(Some(object))) => object,
        other => panic!(
            "timed out waiting for {namespace}/{name}: {what}: {other:?}\nlast seen: {:#?}",
            api.get_opt(name).await.ok().flatten()
        ),
    }
}

async fn wait_cluster(
    env: &Env,
    namespace: &str,
    name: &str,
    what: &str,
    done: impl Fn(&ProxmoxCluster) -> bool,
) -> ProxmoxCluster {
    wait_for(env, namespace, name, what, done).await
}

/// Waits for the `ProxmoxAvailable` reason `reason`; returns the condition's message.
async fn wait_reason(env: &Env, namespace: &str, name: &str, reason: &str) -> String {
    let cluster = wait_cluster(env, namespace, name, reason, |c| {
        condition(c, "ProxmoxAvailable").is_some_and(|(_, r, _)| r == reason)
    })
    .await;
    condition(&cluster, "ProxmoxAvailable")
        .expect("condition")
        .2
}

/// The Secret carries no finalizer or owner reference of capmox's.
async fn assert_not_adopted(env: &Env, namespace: &str, name: &str) {
    let secret = Api::<Secret>::namespaced(env.client(), namespace)
        .get(name)
        .await
        .expect("secret");
    assert!(
        secret.finalizers().is_empty() && secret.owner_references().is_empty(),
        "{:?}",
        secret.metadata
    );
}

fn ready(cluster: &ProxmoxCluster) -> bool {
    condition(cluster, "Ready").is_some_and(|(status, _, _)| status == "True")
}

/// A ProxmoxCluster without a credentialsRef gets the global credentials only in a namespace
/// the installer listed; elsewhere it is told what to set, as if none were configured.
#[tokio::test]
async fn global_credentials_serve_only_the_namespaces_the_installer_listed() {
    let env = env_with(|env| global_for(env, &["team-a"])).await;
    cluster(&env, "default", "demo", cluster_spec(None)).await;
    cluster(&env, "team-a", "demo", cluster_spec(None)).await;
    env.run_controllers();
    wait_cluster(&env, "team-a", "demo", "Ready=True", ready).await;
    let message = wait_reason(&env, "default", "demo", "CredentialsNotFound").await;
    assert!(
        message.contains("--global-credentials-namespaces")
            && message.contains("CAPMOX_GLOBAL_CREDENTIALS_NAMESPACES"),
        "the message says what the installer sets: {message}"
    );
}

/// A Secret that does not exist and one that exists but does not allow the cluster's
/// namespace give the same reason and message, so a tenant cannot probe other namespaces.
#[tokio::test]
async fn a_missing_secret_and_a_forbidden_one_look_the_same() {
    let env = Env::start().await;
    credentials(&env, "team-b", "exists", None).await;
    let reference = |name: &str| Some(json!({"name": name, "namespace": "team-b"}));
    cluster(
        &env,
        "default",
        "forbidden",
        cluster_spec(reference("exists")),
    )
    .await;
    cluster(
        &env,
        "default",
        "missing",
        cluster_spec(reference("absent")),
    )
    .await;
    env.run_controllers();
    let forbidden = wait_reason(&env, "default", "forbidden", "CredentialsNotFound").await;
    let missing = wait_reason(&env, "default", "missing", "CredentialsNotFound").await;
    assert_eq!(forbidden.replace("team-b/exists", "team-b/absent"), missing);
    assert!(
        forbidden.starts_with(
            "credentials Secret team-b/exists does not exist or does not allow namespace default"
        ),
        "{forbidden}"
    );
}

/// Installed for listed namespaces (`--secret-namespaces`), capmox treats a Secret elsewhere
/// as not found without asking the API server for it, even one the cluster could use.
#[tokio::test]
async fn a_namespaced_install_never_reads_a_secret_outside_its_namespaces() {
    let env = env_with(|_| GlobalCredentials {
        secret_namespaces: Some(vec!["team-a".to_owned()]),
        ..GlobalCredentials::default()
    })
    .await;
    credentials(&env, "default", "creds", None).await;
    credentials(&env, "team-a", "creds", None).await;
    let reference = Some(json!({"name": "creds"}));
    cluster(&env, "default", "demo", cluster_spec(reference.clone())).await;
    cluster(&env, "team-a", "demo", cluster_spec(reference)).await;
    env.run_controllers();
    wait_cluster(&env, "team-a", "demo", "Ready=True", ready).await;
    let message = wait_reason(&env, "default", "demo", "CredentialsNotFound").await;
    assert!(message.contains("--secret-namespaces"), "{message}");
    let read_elsewhere: Vec<_> = env
        .server
        .requests_by_client("capmox")
        .into_keys()
        .filter(|r| r.resource == "secrets" && r.namespace.as_deref() != Some("team-a"))
        .collect();
    assert!(
        read_elsewhere.is_empty(),
        "capmox asked for Secrets outside team-a: {read_elsewhere:?}"
    );
    assert_not_adopted(&env, "default", "creds").await;
}

/// With `--allowed-proxmox-urls`, a Secret naming any other Proxmox is invalid and not adopted.
#[tokio::test]
async fn a_secret_naming_a_proxmox_outside_the_allowlist_is_refused() {
    let env = env_with(|_| GlobalCredentials {
        allowed_urls: Some(vec!["https://pve.example.org:8006".to_owned()]),
        ..GlobalCredentials::default()
    })
    .await;
    cluster_with_secret(&env, "default", None).await;
    env.run_controllers();
    let message = wait_reason(&env, "default", "demo", "CredentialsInvalid").await;
    assert!(
        message.contains("--allowed-proxmox-urls")
            && message.contains("credentials Secret default/creds"),
        "{message}"
    );
    assert_not_adopted(&env, "default", "creds").await;
}

/// A Secret whose url would turn capmox's API paths into a fragment is invalid.
#[tokio::test]
async fn a_secret_url_with_a_fragment_is_refused() {
    let env = Env::start().await;
    let url = format!("{}/#", env.sim.url());
    cluster_with_secret(&env, "default", Some(&url)).await;
    env.run_controllers();
    let message = wait_reason(&env, "default", "demo", "CredentialsInvalid").await;
    assert!(message.contains("fragment"), "{message}");
}

const SECRET_FINALIZER: &str = "proxmoxcluster.infrastructure.cluster.x-k8s.io/secret";

/// Two clusters share a Secret: deleting one drops only its owner reference, the finalizer
/// stays until the last of them is gone.
#[tokio::test]
async fn a_shared_secret_stays_held_until_its_last_cluster_is_deleted() {
    let env = Env::start().await;
    credentials(&env, "default", "shared", None).await;
    let reference = Some(json!({"name": "shared"}));
    cluster(&env, "default", "one", cluster_spec(reference.clone())).await;
    cluster(&env, "default", "two", cluster_spec(reference)).await;
    env.run_controllers();
    let one = wait_cluster(&env, "default", "one", "Ready=True", ready).await;
    let two = wait_cluster(&env, "default", "two", "Ready=True", ready).await;
    let secrets = Api::<Secret>::namespaced(env.client(), "default");
    let owners = |secret: &Secret| -> Vec<String> {
        let mut uids: Vec<String> = secret
            .owner_references()
            .iter()
            .map(|o| o.uid.clone())
            .collect();
        uids.sort();
        uids
    };
    let mut both = vec![one.uid().expect("uid"), two.uid().expect("uid")];
    both.sort();
    let held = tokio::time::timeout(
        ENV_WAIT,
        await_condition(secrets.clone(), "shared", move |s: Option<&Secret>| {
            s.is_some_and(|s| owners(s) == both)
        }),
    )
    .await
    .expect("both clusters adopt the Secret")
    .expect("watch")
    .expect("secret");
    assert_eq!(held.finalizers(), [SECRET_FINALIZER]);

    let clusters = Api::<ProxmoxCluster>::namespaced(env.client(), "default");
    for (name, uid) in [("one", one.uid()), ("two", two.uid())] {
        clusters
            .delete(name, &DeleteParams::default())
            .await
            .expect("delete accepted");
        tokio::time::timeout(
            ENV_WAIT,
            await_condition(
                clusters.clone(),
                name,
                conditions::is_deleted(&uid.expect("uid")),
            ),
        )
        .await
        .expect("cluster released in time")
        .expect("watch");
        let secret = secrets.get("shared").await.expect("the Secret stays");
        if name == "one" {
            assert_eq!(
                secret.finalizers(),
                [SECRET_FINALIZER],
                "cluster two still uses the Secret"
            );
            assert_eq!(owners(&secret), [two.uid().expect("uid")]);
        } else {
            assert!(secret.finalizers().is_empty(), "{:?}", secret.metadata);
            assert!(
                secret.owner_references().is_empty(),
                "{:?}",
                secret.metadata
            );
        }
    }
}

/// The CAPI Machine `name` with its bootstrap Secret, and the ProxmoxMachine it owns, in
/// `namespace`.
async fn machine(env: &Env, namespace: &str, name: &str, spec: Value) {
    let client = env.client();
    let _: Secret = create(
        &client,
        namespace,
        json!({
            "apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": format!("{name}-bootstrap"), "namespace": namespace},
            "stringData": {"value": "#cloud-config\nruncmd: [echo hello]\n", "format": "cloud-config"}
        }),
    )
    .await;
    let labels = json!({"cluster.x-k8s.io/cluster-name": "demo"});
    let capi: capmox::capi::Machine = create(
        &client,
        namespace,
        json!({
            "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Machine",
            "metadata": {"name": name, "namespace": namespace, "labels": labels},
            "spec": {
                "clusterName": "demo",
                "bootstrap": {"dataSecretName": format!("{name}-bootstrap")},
                "infrastructureRef": {"apiGroup": "infrastructure.cluster.x-k8s.io", "kind": "ProxmoxMachine", "name": name}
            }
        }),
    )
    .await;
    let _: ProxmoxMachine = create(
        &client,
        namespace,
        json!({
            "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha2", "kind": "ProxmoxMachine",
            "metadata": {
                "name": name, "namespace": namespace, "labels": labels,
                "ownerReferences": [{"apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Machine", "name": name,
                    "uid": capi.uid().expect("uid"), "controller": true}]
            },
            "spec": spec
        }),
    )
    .await;
}

/// A tenant namespace with its own credentials and a provisioned cluster `demo`.
async fn tenant(env: &Env, namespace: &str) {
    cluster_with_secret(env, namespace, None).await;
    let ready = wait_cluster(env, namespace, "demo", "Ready=True", ready).await;
    let domains = ready.status.map(|s| s.failure_domains).unwrap_or_default();
    Api::<capmox::capi::Cluster>::namespaced(env.client(), namespace)
        .patch_status(
            "demo",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {
                "initialization": {"infrastructureProvisioned": true},
                "failureDomains": domains
            }})),
        )
        .await
        .expect("cluster provisioned");
}

async fn wait_machine(
    env: &Env,
    namespace: &str,
    name: &str,
    what: &str,
    done: impl Fn(&ProxmoxMachine) -> bool,
) -> ProxmoxMachine {
    wait_for(env, namespace, name, what, done).await
}

fn vmid_of(machine: &ProxmoxMachine) -> u32 {
    machine
        .status
        .as_ref()
        .and_then(|s| s.virtual_machine_id)
        .and_then(|id| u32::try_from(id).ok())
        .expect("a VMID")
}

/// The tags of VM `vmid`, if Proxmox lists it.
async fn vm_tags(env: &Env, vmid: u32) -> Option<Vec<String>> {
    env.proxmox()
        .cluster_resources(None)
        .await
        .expect("resources")
        .into_iter()
        .find(|r| r.vmid == Some(vmid))
        .map(|r| r.tags)
}

/// A machine whose `spec.templateID` names a VM that is not a template waits, and nothing is
/// cloned: the VM's disks and data would otherwise boot with this machine's user data.
#[tokio::test]
async fn a_vm_that_is_not_a_template_is_never_cloned() {
    let env = Env::start().await;
    env.run_controllers();
    tenant(&env, "default").await;
    machine(&env, "default", "web-1", machine_spec()).await;
    let web = wait_machine(
        &env,
        "default",
        "web-1",
        "provisioned",
        ProxmoxMachine::is_provisioned,
    )
    .await;
    let vmid = vmid_of(&web);
    let node = web
        .status
        .as_ref()
        .and_then(|s| s.proxmox_node.clone())
        .expect("node");
    let before = env.sim.with_cluster(|c| c.vm_count());

    let mut spec = machine_spec();
    spec["templateID"] = json!(vmid);
    spec["sourceNode"] = json!(node);
    machine(&env, "default", "copycat", spec).await;
    let (_, message) = env.wait_machine_reason("copycat", "TemplateNotFound").await;
    assert!(
        message.starts_with(&format!("VM {vmid} on {node} is not a template")),
        "{message}"
    );
    assert_eq!(
        env.sim.with_cluster(|c| c.vm_count()),
        before,
        "nothing was cloned"
    );
}

/// Tenant B names its machine like tenant A's and sets `spec.virtualMachineID` to A's VMID:
/// B does not adopt A's VM (it gets one of its own), and deleting B leaves A's VM alone.
#[tokio::test]
async fn another_tenants_vm_is_not_adopted_by_naming_its_vmid() {
    let env = Env::start().await;
    env.run_controllers();
    tenant(&env, "team-a").await;
    tenant(&env, "team-b").await;
    machine(&env, "team-a", "web-1", machine_spec()).await;
    let a = wait_machine(
        &env,
        "team-a",
        "web-1",
        "provisioned",
        ProxmoxMachine::is_provisioned,
    )
    .await;
    let a_vmid = vmid_of(&a);
    let a_tags = vm_tags(&env, a_vmid).await.expect("A's VM");

    let mut spec = machine_spec();
    spec["virtualMachineID"] = json!(a_vmid);
    machine(&env, "team-b", "web-1", spec).await;
    let b = wait_machine(
        &env,
        "team-b",
        "web-1",
        "provisioned",
        ProxmoxMachine::is_provisioned,
    )
    .await;
    assert_ne!(vmid_of(&b), a_vmid, "B got a VM of its own");
    assert_eq!(
        vm_tags(&env, a_vmid).await.as_ref(),
        Some(&a_tags),
        "A's VM is untouched"
    );

    let machines = Api::<ProxmoxMachine>::namespaced(env.client(), "team-b");
    machines
        .delete("web-1", &DeleteParams::default())
        .await
        .expect("delete accepted");
    tokio::time::timeout(
        ENV_WAIT,
        await_condition(
            machines.clone(),
            "web-1",
            conditions::is_deleted(&b.uid().expect("uid")),
        ),
    )
    .await
    .expect("B deleted in time")
    .expect("watch");
    assert_eq!(
        vm_tags(&env, a_vmid).await,
        Some(a_tags),
        "A's VM is still there"
    );
    assert_eq!(vm_tags(&env, vmid_of(&b)).await, None, "B's own VM is gone");
    let a_now = Api::<ProxmoxMachine>::namespaced(env.client(), "team-a")
        .get("web-1")
        .await
        .expect("A");
    assert!(a_now.is_provisioned());
}
