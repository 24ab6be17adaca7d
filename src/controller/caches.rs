//! The Kubernetes objects a machine reconcile works from, kept by watches instead of read per
//! pass: one list and one watch per kind for the whole fleet, however many machines reconcile.
//!
//! Secrets are not here: credentials are read when needed and reused for a short while, and
//! bootstrap data Secrets are held only until their machine took them
//! ([`super::bootstrap_secrets`]). A reconcile that runs outside a controller (a test calling
//! it directly) reads from the API server instead.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use futures::{Stream, StreamExt, TryStreamExt};
use kube::api::ListParams;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::watcher;
use kube::runtime::{WatchStreamExt, reflector::store::Writer};
use kube::{Api, Resource, ResourceExt};
use serde::de::DeserializeOwned;

use crate::api::labels::CLUSTER_NAME;
use crate::api::{ProxmoxCluster, ProxmoxMachine};
use crate::capi::{self, IPAddress, IPAddressClaim};

/// The watched kinds' stores, filled by the machine controller's watches.
#[derive(Clone)]
pub struct Caches {
    /// The controller's own ProxmoxMachines.
    pub machines: Store<ProxmoxMachine>,
    /// CAPI Machines, the owners the machines take their cluster, bootstrap data and failure
    /// domain from.
    pub capi_machines: Store<capi::Machine>,
    /// CAPI Clusters, for pause and the infrastructure reference.
    pub capi_clusters: Store<capi::Cluster>,
    /// ProxmoxClusters, for zones, pools and credentials.
    pub clusters: Store<ProxmoxCluster>,
    /// The machines' IP address claims.
    pub claims: Store<IPAddressClaim>,
    /// The addresses bound to those claims.
    pub addresses: Store<IPAddress>,
    /// The cluster's pools (their annotations carry the default route's metric).
    pub pools: Store<capi::InClusterIPPool>,
    /// The machines by UID, kept from the machines' watch.
    pub machines_by_uid: MachinesByUid,
    /// The machines by cluster and Proxmox, kept from the machines' watch.
    pub machines_by_place: MachinesByPlace,
    /// Set when a watch has finished its first list; a pass waits until all have.
    synced: Arc<Vec<AtomicBool>>,
}

/// The machines' references by UID, kept from their watch, so waking machines by key (a task
/// list shows their tasks ended) costs no scan of the whole fleet per key. A machine deleted
/// since is dropped when looked up, or when the index outgrows the store.
#[derive(Clone, Default)]
pub struct MachinesByUid {
    refs: Arc<Mutex<HashMap<String, ObjectRef<ProxmoxMachine>>>>,
}

/// How many more entries than the store holds the index may keep before it drops the
/// machines no longer there.
const INDEX_SLACK: usize = 1024;

impl MachinesByUid {
    /// Notes `machine`, as its watch delivered it.
    pub fn saw(&self, machine: &ProxmoxMachine, store: &Store<ProxmoxMachine>) {
        let Some(uid) = machine
            .metadata
            .uid
            .as_deref()
            .filter(|uid| !uid.is_empty())
        else {
            return;
        };
        let mut refs = self.refs.lock().unwrap_or_else(PoisonError::into_inner);
        if refs.contains_key(uid) {
            return;
        }
        if refs.len() >= 2 * store.len() + INDEX_SLACK {
            refs.retain(|uid, reference| holds(store, reference, uid));
        }
        refs.insert(uid.to_owned(), ObjectRef::from_obj(machine));
    }

    /// The machine in `store` with the UID `uid`, if the index knows it.
    pub fn get(
        &self,
        uid: &str,
        store: &Store<ProxmoxMachine>,
    ) -> Option<ObjectRef<ProxmoxMachine>> {
        let mut refs = self.refs.lock().unwrap_or_else(PoisonError::into_inner);
        let reference = refs.get(uid)?;
        if holds(store, reference, uid) {
            return Some(reference.clone());
        }
        refs.remove(uid);
        None
    }
}

/// Whether `store` holds the machine `reference` names with the UID `uid` (not one deleted and
/// made again under its name).
fn holds(store: &Store<ProxmoxMachine>, reference: &ObjectRef<ProxmoxMachine>, uid: &str) -> bool {
    store
        .get(reference)
        .is_some_and(|machine| machine.metadata.uid.as_deref() == Some(uid))
}

/// The machines that recorded a node, by namespace, cluster and the Proxmox endpoint they
/// recorded, kept from their watch: a clone's inventory reads its cluster's machines on its
/// Proxmox alone, not every machine of a fleet that may be one cluster over many sites. What
/// it hands out comes from the store, so a stale entry costs a lookup, never a wrong machine;
/// while a watch lists again, machines that changed place show in the new place only once
/// the store holds the new list.
#[derive(Clone, Default)]
pub struct MachinesByPlace {
    index: Arc<Mutex<PlaceIndex>>,
}

#[derive(Default)]
struct PlaceIndex {
    machines: HashMap<Place, HashSet<ObjectRef<ProxmoxMachine>>>,
    place_of: HashMap<ObjectRef<ProxmoxMachine>, Place>,
}

/// Where a machine recorded its VM; `endpoint` is empty for one that recorded a node before
/// machines recorded their endpoint.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Place {
    namespace: String,
    cluster: String,
    endpoint: String,
}

impl Place {
    fn of(machine: &ProxmoxMachine) -> Option<Place> {
        let status = machine.status.as_ref()?;
        status.proxmox_node.as_ref()?;
        Some(Place {
            namespace: machine.metadata.namespace.clone()?,
            cluster: machine.labels().get(CLUSTER_NAME)?.clone(),
            endpoint: status.proxmox_endpoint.clone().unwrap_or_default(),
        })
    }

    /// Whether `machine` is at this place, as [`Place::of`] says, without copying its strings:
    /// every clone asks it of each machine at its place.
    fn holds(&self, machine: &ProxmoxMachine) -> bool {
        machine.status.as_ref().is_some_and(|status| {
            status.proxmox_node.is_some()
                && status.proxmox_endpoint.as_deref().unwrap_or_default() == self.endpoint
        }) && machine.metadata.namespace.as_deref() == Some(self.namespace.as_str())
            && machine.labels().get(CLUSTER_NAME) == Some(&self.cluster)
    }
}

impl MachinesByPlace {
    /// Notes `machine`'s place, as its watch delivered it.
    pub fn saw(&self, machine: &ProxmoxMachine, store: &Store<ProxmoxMachine>) {
        let reference = ObjectRef::from_obj(machine);
        // What a watch delivers last of a deleted machine: no finalizer holds it any more.
        let gone = machine.metadata.deletion_timestamp.is_some() && machine.finalizers().is_empty();
        let place = Place::of(machine).filter(|_| !gone);
        let mut index = self.index.lock().unwrap_or_else(PoisonError::into_inner);
        if index.place_of.get(&reference) == place.as_ref() {
            return;
        }
        index.remove(&reference);
        if let Some(place) = place {
            if index.place_of.len() >= 2 * store.len() + INDEX_SLACK {
                index.keep_only(store);
            }
            index
                .machines
                .entry(place.clone())
                .or_default()
                .insert(reference.clone());
            index.place_of.insert(reference, place);
        }
    }

    /// The machines of `cluster` in `namespace` that recorded a node of the Proxmox at
    /// `endpoint` or no endpoint at all, as the store holds them.
    pub fn on(
        &self,
        namespace: &str,
        cluster: &str,
        endpoint: &str,
        store: &Store<ProxmoxMachine>,
    ) -> Vec<Arc<ProxmoxMachine>> {
        let mut index = self.index.lock().unwrap_or_else(PoisonError::into_inner);
        let mut found = Vec::new();
        let mut gone = Vec::new();
        let endpoints: &[&str] = if endpoint.is_empty() {
            &[""]
        } else {
            &[endpoint, ""]
        };
        for endpoint in endpoints {
            let place = Place {
                namespace: namespace.to_owned(),
                cluster: cluster.to_owned(),
                endpoint: (*endpoint).to_owned(),
            };
            for reference in index.machines.get(&place).into_iter().flatten() {
                match store.get(reference) {
                    Some(machine) if place.holds(&machine) => {
                        found.push(machine);
                    }
                    Some(_) => {}
                    None => gone.push(reference.clone()),
                }
            }
        }
        for reference in &gone {
            index.remove(reference);
        }
        found
    }
}

impl PlaceIndex {
    fn remove(&mut self, reference: &ObjectRef<ProxmoxMachine>) {
        let Some(place) = self.place_of.remove(reference) else {
            return;
        };
        if let Some(machines) = self.machines.get_mut(&place) {
            machines.remove(reference);
            if machines.is_empty() {
                self.machines.remove(&place);
            }
        }
    }

    /// Drops the machines `store` no longer holds (deleted while a watch was down).
    fn keep_only(&mut self, store: &Store<ProxmoxMachine>) {
        let gone: Vec<_> = self
            .place_of
            .keys()
            .filter(|reference| store.get(reference).is_none())
            .cloned()
            .collect();
        for reference in &gone {
            self.remove(reference);
        }
    }
}

/// The writers behind [`Caches`], each consumed by the watch that fills its store.
pub struct Writers {
    /// CAPI Machines.
    pub capi_machines: Writer<capi::Machine>,
    /// CAPI Clusters.
    pub capi_clusters: Writer<capi::Cluster>,
    /// ProxmoxClusters.
    pub clusters: Writer<ProxmoxCluster>,
    /// IP address claims.
    pub claims: Writer<IPAddressClaim>,
    /// IP addresses.
    pub addresses: Writer<IPAddress>,
    /// In-cluster pools.
    pub pools: Writer<capi::InClusterIPPool>,
}

/// How many watches fill [`Caches`] (all but the controller's own).
const WATCHED_KINDS: usize = 6;

impl Caches {
    /// Empty caches around the controller's own store, and the writers that fill the others.
    pub fn new(machines: Store<ProxmoxMachine>) -> (Self, Writers) {
        let (capi_machines, capi_machines_writer) = reflector::store();
        let (capi_clusters, capi_clusters_writer) = reflector::store();
        let (clusters, clusters_writer) = reflector::store();
        let (claims, claims_writer) = reflector::store();
        let (addresses, addresses_writer) = reflector::store();
        let (pools, pools_writer) = reflector::store();
        let caches = Self {
            machines,
            capi_machines,
            capi_clusters,
            clusters,
            claims,
            addresses,
            pools,
            machines_by_uid: MachinesByUid::default(),
            machines_by_place: MachinesByPlace::default(),
            synced: Arc::new((0..WATCHED_KINDS).map(|_| AtomicBool::new(false)).collect()),
        };
        let writers = Writers {
            capi_machines: capi_machines_writer,
            capi_clusters: capi_clusters_writer,
            clusters: clusters_writer,
            claims: claims_writer,
            addresses: addresses_writer,
            pools: pools_writer,
        };
        (caches, writers)
    }

    /// Whether every watch has listed its kind once (a pass before that could take a missing
    /// object for a deleted one).
    pub fn synced(&self) -> bool {
        self.synced.iter().all(|s| s.load(Ordering::Acquire))
    }

    /// The watch that keeps `writer`'s store, as a stream of the objects it touched, for a
    /// controller's triggers. `slot` is the kind's index among the watched kinds.
    pub fn watch<K>(
        &self,
        slot: usize,
        api: Api<K>,
        config: watcher::Config,
        writer: Writer<K>,
    ) -> impl Stream<Item = Result<K, watcher::Error>> + Send + 'static
    where
        K: Resource<DynamicType = ()> + Clone + DeserializeOwned + std::fmt::Debug + Send + Sync,
        K: 'static,
    {
        let synced = self.synced.clone();
        reflected(api, config, writer, move || {
            if let Some(flag) = synced.get(slot) {
                flag.store(true, Ordering::Release);
            }
        })
    }
}

/// The watch of `api` that keeps `writer`'s store, as a stream of the objects it touched for a
/// controller's triggers; `listed` runs each time the watch has listed the whole kind.
pub fn reflected<K>(
    api: Api<K>,
    config: watcher::Config,
    writer: Writer<K>,
    listed: impl Fn() + Send + 'static,
) -> impl Stream<Item = Result<K, watcher::Error>> + Send + 'static
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + std::fmt::Debug + Send + Sync,
    K: 'static,
{
    reflector::reflector(
        writer,
        // Nothing reads managed fields from the cache: they are not even decoded.
        watcher(super::lean::api(&api), config)
            .map_ok(super::lean::event)
            // Each watch backs off on its own errors: the controller's triggers share one
            // back-off, and every watch ending at once (an API server restart, an expired
            // resourceVersion) would otherwise pause them all, once per watch, for longer
            // each time.
            .default_backoff(),
    )
    .inspect(move |event| {
        if let Ok(watcher::Event::InitDone) = event {
            listed();
        }
    })
    .touched_objects()
    .filter_map(without_errors::<K>)
}

/// A watch of `api` for a controller's triggers (no store), backing off on its own errors
/// rather than pausing every trigger of the controller; see [`Caches::watch`].
pub fn trigger_watch<K>(
    api: Api<K>,
    config: watcher::Config,
) -> impl Stream<Item = Result<K, watcher::Error>> + Send + 'static
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + std::fmt::Debug + Send + Sync,
    K: 'static,
{
    watcher(super::lean::api(&api), config)
        .map_ok(super::lean::event)
        .default_backoff()
        .touched_objects()
        .filter_map(without_errors::<K>)
}

/// Drops a watch's error after logging it: the watch retries by itself with back-off.
fn without_errors<K: Resource<DynamicType = ()>>(
    touched: Result<K, watcher::Error>,
) -> futures::future::Ready<Option<Result<K, watcher::Error>>> {
    futures::future::ready(match touched {
        Ok(object) => Some(Ok(object)),
        Err(error) => {
            tracing::debug!(kind = %K::kind(&()), %error, "watch failed; retrying with back-off");
            None
        }
    })
}

/// Index of each watched kind in [`Caches`]' sync flags.
pub mod slot {
    /// CAPI Machines.
    pub const CAPI_MACHINES: usize = 0;
    /// CAPI Clusters.
    pub const CAPI_CLUSTERS: usize = 1;
    /// ProxmoxClusters.
    pub const CLUSTERS: usize = 2;
    /// IP address claims.
    pub const CLAIMS: usize = 3;
    /// IP addresses.
    pub const ADDRESSES: usize = 4;
    /// In-cluster pools.
    pub const POOLS: usize = 5;
}

/// A namespaced kind [`Caches`] keeps.
pub trait Cached:
    Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
    + Clone
    + DeserializeOwned
    + std::fmt::Debug
    + Send
    + Sync
    + 'static
{
    /// The kind's store.
    fn store(caches: &Caches) -> &Store<Self>;
}

macro_rules! cached {
    ($kind:ty, $field:ident) => {
        impl Cached for $kind {
            fn store(caches: &Caches) -> &Store<Self> {
                &caches.$field
            }
        }
    };
}
cached!(ProxmoxMachine, machines);
cached!(capi::Machine, capi_machines);
cached!(capi::Cluster, capi_clusters);
cached!(ProxmoxCluster, clusters);
cached!(IPAddressClaim, claims);
cached!(IPAddress, addresses);
cached!(capi::InClusterIPPool, pools);

/// Where a pass reads the objects it works from: the caches when it runs in a controller, the
/// API server otherwise.
#[derive(Clone, Copy)]
pub struct Reads<'a> {
    client: &'a kube::Client,
    caches: Option<&'a Caches>,
}

impl<'a> Reads<'a> {
    /// Reads through `caches`, or from the API server without them.
    pub fn new(client: &'a kube::Client, caches: Option<&'a Caches>) -> Self {
        Self { client, caches }
    }

    /// The object `namespace/name` of kind `K`, if it exists.
    pub async fn get<K: Cached>(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<Option<Arc<K>>, kube::Error> {
        match self.caches {
            Some(caches) => Ok(K::store(caches).get(&ObjectRef::new(name).within(namespace))),
            None => Ok(Api::<K>::namespaced(self.client.clone(), namespace)
                .get_opt(name)
                .await?
                .map(Arc::new)),
        }
    }

    /// The objects of kind `K` in `namespace` with these names, in their order (`None` for one
    /// that does not exist): from the caches one lookup each, else one list of those labelled
    /// `label`.
    pub async fn named<K: Cached>(
        &self,
        namespace: &str,
        names: &[&str],
        label: (&str, &str),
    ) -> Result<Vec<Option<Arc<K>>>, kube::Error> {
        match self.caches {
            Some(caches) => {
                let store = K::store(caches);
                // One key, renamed for each lookup: a clone's inventory looks up the CAPI
                // Machine of every machine at its place.
                let mut key = ObjectRef::<K>::new("").within(namespace);
                Ok(names
                    .iter()
                    .map(|name| {
                        key.name.clear();
                        key.name.push_str(name);
                        store.get(&key)
                    })
                    .collect())
            }
            None => {
                let listed: HashMap<String, Arc<K>> = self
                    .labelled::<K>(namespace, label.0, label.1)
                    .await?
                    .into_iter()
                    .filter_map(|object| Some((object.meta().name.clone()?, object)))
                    .collect();
                Ok(names
                    .iter()
                    .map(|name| listed.get(*name).cloned())
                    .collect())
            }
        }
    }

    /// The objects of kind `K` in `namespace` whose label `key` equals `value`.
    pub async fn labelled<K: Cached>(
        &self,
        namespace: &str,
        key: &str,
        value: &str,
    ) -> Result<Vec<Arc<K>>, kube::Error> {
        match self.caches {
            Some(caches) => Ok(K::store(caches).state_filter(|object| {
                object.meta().namespace.as_deref() == Some(namespace)
                    && object.labels().get(key).map(String::as_str) == Some(value)
            })),
            None => Ok(Api::<K>::namespaced(self.client.clone(), namespace)
                .list(&ListParams::default().labels(&format!("{key}={value}")))
                .await?
                .items
                .into_iter()
                .map(Arc::new)
                .collect()),
        }
    }

    /// The ProxmoxMachines of `cluster` in `namespace` that may have recorded a node of the
    /// Proxmox at `endpoint`: from the caches those that did or recorded no endpoint, else
    /// every machine of the cluster.
    pub async fn cluster_machines_on(
        &self,
        namespace: &str,
        cluster: &str,
        endpoint: &str,
    ) -> Result<Vec<Arc<ProxmoxMachine>>, kube::Error> {
        match self.caches {
            Some(caches) => {
                Ok(caches
                    .machines_by_place
                    .on(namespace, cluster, endpoint, &caches.machines))
            }
            None => {
                self.labelled::<ProxmoxMachine>(namespace, CLUSTER_NAME, cluster)
                    .await
            }
        }
    }

    /// Every object of kind `K` in `namespace`, or in all namespaces without one.
    pub async fn all<K: Cached>(
        &self,
        namespace: Option<&str>,
    ) -> Result<Vec<Arc<K>>, kube::Error> {
        self.all_where(namespace, |_| true).await
    }

    /// The objects of [`Reads::all`] that `wanted` keeps; only those are copied out of the
    /// cache, which holds a fleet.
    pub async fn all_where<K: Cached>(
        &self,
        namespace: Option<&str>,
        wanted: impl Fn(&K) -> bool,
    ) -> Result<Vec<Arc<K>>, kube::Error> {
        let in_namespace = |object: &K| {
            namespace.is_none_or(|namespace| object.meta().namespace.as_deref() == Some(namespace))
        };
        match self.caches {
            Some(caches) => {
                Ok(K::store(caches).state_filter(|object| in_namespace(object) && wanted(object)))
            }
            None => {
                let api = match namespace {
                    Some(namespace) => Api::<K>::namespaced(self.client.clone(), namespace),
                    None => Api::<K>::all(self.client.clone()),
                };
                Ok(api
                    .list(&ListParams::default())
                    .await?
                    .items
                    .into_iter()
                    .filter(|object| wanted(object))
                    .map(Arc::new)
                    .collect())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::ProxmoxMachineSpec;

    fn machine(name: &str, uid: &str) -> ProxmoxMachine {
        let mut machine = ProxmoxMachine::new(name, ProxmoxMachineSpec::default());
        machine.metadata.namespace = Some("default".into());
        machine.metadata.uid = Some(uid.into());
        machine
    }

    #[test]
    fn a_machine_is_found_by_uid_while_the_store_holds_it_under_that_uid() {
        let (store, mut writer) = reflector::store();
        let index = MachinesByUid::default();
        let first = machine("m1", "uid-1");
        writer.apply_watcher_event(&watcher::Event::Apply(first.clone()));
        index.saw(&first, &store);
        assert_eq!(
            index.get("uid-1", &store),
            Some(ObjectRef::from_obj(&first))
        );
        assert_eq!(index.get("uid-2", &store), None, "never seen");

        // Deleted and made again under its name: the old UID names nothing any more.
        writer.apply_watcher_event(&watcher::Event::Delete(first.clone()));
        let again = machine("m1", "uid-3");
        writer.apply_watcher_event(&watcher::Event::Apply(again.clone()));
        index.saw(&again, &store);
        assert_eq!(index.get("uid-1", &store), None);
        assert_eq!(
            index.get("uid-3", &store),
            Some(ObjectRef::from_obj(&again))
        );
    }

    fn placed(
        name: &str,
        cluster: &str,
        node: Option<&str>,
        endpoint: Option<&str>,
    ) -> ProxmoxMachine {
        let mut machine = machine(name, &format!("uid-{name}"));
        machine.metadata.labels = Some([(CLUSTER_NAME.to_owned(), cluster.to_owned())].into());
        machine.status = Some(crate::api::ProxmoxMachineStatus {
            proxmox_node: node.map(str::to_owned),
            proxmox_endpoint: endpoint.map(str::to_owned),
            ..Default::default()
        });
        machine
    }

    fn names(machines: Vec<Arc<ProxmoxMachine>>) -> Vec<String> {
        let mut names: Vec<String> = machines.iter().map(|m| m.name_any()).collect();
        names.sort();
        names
    }

    /// What the index stands for: the scan of every machine it replaces.
    fn scanned(store: &Store<ProxmoxMachine>, cluster: &str, endpoint: &str) -> Vec<String> {
        let mut names: Vec<String> = store
            .state()
            .iter()
            .filter(|m| {
                Place::of(m).is_some_and(|p| {
                    p.namespace == "default"
                        && p.cluster == cluster
                        && (p.endpoint == endpoint || p.endpoint.is_empty())
                })
            })
            .map(|m| m.name_any())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn a_clusters_machines_on_one_proxmox_are_those_that_recorded_it_or_no_endpoint() {
        let (store, mut writer) = reflector::store();
        let index = MachinesByPlace::default();
        let mut see = |machine: ProxmoxMachine| {
            writer.apply_watcher_event(&watcher::Event::Apply(machine.clone()));
            index.saw(&machine, &store);
        };
        see(placed("a1", "c1", Some("pve1"), Some("https://a:8006")));
        see(placed("b1", "c1", Some("pve1"), Some("https://b:8006")));
        see(placed("old", "c1", Some("pve2"), None));
        see(placed("cloning", "c1", None, None));
        see(placed("other", "c2", Some("pve1"), Some("https://a:8006")));
        let mut elsewhere = placed("elsewhere", "c1", Some("pve1"), Some("https://a:8006"));
        elsewhere.metadata.namespace = Some("team-b".into());
        see(elsewhere);
        let on = |index: &MachinesByPlace, endpoint: &str| {
            names(index.on("default", "c1", endpoint, &store))
        };
        assert_eq!(on(&index, "https://a:8006"), ["a1", "old"]);
        assert_eq!(on(&index, "https://b:8006"), ["b1", "old"]);

        // The machine without an endpoint records one, the cloning one its node and endpoint.
        see(placed("old", "c1", Some("pve2"), Some("https://b:8006")));
        see(placed(
            "cloning",
            "c1",
            Some("pve3"),
            Some("https://a:8006"),
        ));
        assert_eq!(on(&index, "https://a:8006"), ["a1", "cloning"]);
        assert_eq!(on(&index, "https://b:8006"), ["b1", "old"]);
    }

    #[test]
    fn a_place_holds_the_machines_whose_place_it_is() {
        let a = "https://a:8006";
        let mut elsewhere = placed("ns", "c1", Some("pve1"), Some(a));
        elsewhere.metadata.namespace = Some("team-b".into());
        let machines = [
            placed("same", "c1", Some("pve1"), Some(a)),
            placed("other-node", "c1", Some("pve2"), Some(a)),
            placed("other-cluster", "c2", Some("pve1"), Some(a)),
            placed("cloning", "c1", None, Some(a)),
            placed("no-endpoint", "c1", Some("pve1"), None),
            placed("empty-endpoint", "c1", Some("pve1"), Some("")),
            placed("other-endpoint", "c1", Some("pve1"), Some("https://b:8006")),
            elsewhere,
        ];
        for endpoint in [Some(a), None] {
            let place = Place::of(&placed("p", "c1", Some("pve9"), endpoint)).expect("placed");
            for machine in &machines {
                assert_eq!(
                    place.holds(machine),
                    Place::of(machine).as_ref() == Some(&place),
                    "{} at {endpoint:?}",
                    machine.name_any()
                );
            }
        }
    }

    #[test]
    fn deleted_machines_leave_the_index_whether_or_not_the_watch_saw_them_go() {
        let (store, mut writer) = reflector::store();
        let index = MachinesByPlace::default();
        let endpoint = "https://a:8006";
        let machines: Vec<_> = (0..3)
            .map(|n| placed(&format!("m{n}"), "c1", Some("pve1"), Some(endpoint)))
            .collect();
        for machine in &machines {
            writer.apply_watcher_event(&watcher::Event::Apply(machine.clone()));
            index.saw(machine, &store);
        }
        // m0 is deleted as a watch delivers it; m1 vanishes from a list made again after the
        // watch was down, with no event of its own.
        let mut deleted = machines[0].clone();
        deleted.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
            ));
        writer.apply_watcher_event(&watcher::Event::Delete(deleted.clone()));
        index.saw(&deleted, &store);
        assert!(
            !index
                .index
                .lock()
                .expect("index")
                .place_of
                .contains_key(&ObjectRef::from_obj(&deleted)),
            "a machine the watch saw go leaves at once"
        );
        writer.apply_watcher_event(&watcher::Event::Init);
        writer.apply_watcher_event(&watcher::Event::InitApply(machines[2].clone()));
        index.saw(&machines[2], &store);
        writer.apply_watcher_event(&watcher::Event::InitDone);
        assert_eq!(names(index.on("default", "c1", endpoint, &store)), ["m2"]);
        let held = index.index.lock().expect("index").place_of.len();
        assert_eq!(held, 1, "the index keeps only what the store holds");
    }

    #[test]
    fn the_index_answers_as_a_scan_of_the_store_would_through_any_changes() {
        let (store, mut writer) = reflector::store();
        let index = MachinesByPlace::default();
        let endpoints = ["https://a:8006", "https://b:8006"];
        let mut seed: u64 = 7;
        let mut next = |bound: u64| {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) % bound
        };
        for step in 0..2000 {
            let name = format!("m{}", next(40));
            let cluster = ["c1", "c2"][next(2) as usize];
            let machine = match next(5) {
                0 => {
                    let gone = placed(&name, cluster, None, None);
                    writer.apply_watcher_event(&watcher::Event::Delete(gone.clone()));
                    index.saw(&gone, &store);
                    continue;
                }
                1 => placed(&name, cluster, None, None),
                2 => placed(&name, cluster, Some("pve1"), None),
                _ => placed(
                    &name,
                    cluster,
                    Some("pve1"),
                    Some(endpoints[next(2) as usize]),
                ),
            };
            writer.apply_watcher_event(&watcher::Event::Apply(machine.clone()));
            index.saw(&machine, &store);
            for cluster in ["c1", "c2"] {
                for endpoint in endpoints {
                    assert_eq!(
                        names(index.on("default", cluster, endpoint, &store)),
                        scanned(&store, cluster, endpoint),
                        "step {step}, {cluster} on {endpoint}"
                    );
                }
            }
        }
    }

    #[test]
    fn the_index_drops_machines_gone_once_it_outgrows_the_store() {
        let (store, mut writer) = reflector::store();
        let index = MachinesByUid::default();
        let kept = machine("kept", "kept");
        writer.apply_watcher_event(&watcher::Event::Apply(kept.clone()));
        index.saw(&kept, &store);
        // Seen by the watch, then deleted: never in the store any more.
        for n in 0..2 * INDEX_SLACK {
            index.saw(&machine(&format!("gone-{n}"), &format!("gone-{n}")), &store);
        }
        let refs = index.refs.lock().expect("index");
        assert!(
            refs.len() <= 2 * store.len() + INDEX_SLACK,
            "{}",
            refs.len()
        );
        assert!(
            refs.contains_key("kept"),
            "the machine the store holds stays"
        );
    }
}
