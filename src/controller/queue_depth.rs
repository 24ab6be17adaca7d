//! How many objects of a controller wait for a reconcile, for the `workqueue_depth` metric.
//!
//! kube-runtime keeps its scheduler queue private, so the depth is derived from what the
//! controller itself sees: an object waits when it changed since its last reconcile started (its
//! `resourceVersion` in the cache differs from the one that reconcile was given, or it was never
//! reconciled), or when a watched object (Cluster, Machine, IP claim or pool) woke it after its
//! last reconcile started. Timed retries (`Action::requeue`) are not counted: kube-runtime does
//! not say when they are due.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};

use kube::Resource;
use kube::runtime::reflector::{ObjectRef, Store};

type Snapshot = Box<dyn Fn() -> Vec<(String, Option<String>)> + Send + Sync>;

/// The waiting objects of one controller; cheap to clone, shared by its mappers and reconciles.
#[derive(Clone, Default)]
pub struct WorkQueue(Arc<Mutex<QueueState>>);

#[derive(Default)]
struct QueueState {
    /// `resourceVersion` each object had when its last reconcile started.
    started: HashMap<String, Option<String>>,
    /// Objects woken by a watched object since their last reconcile started.
    woken: HashSet<String>,
    /// The controller's cache: key and `resourceVersion` of every object.
    cache: Option<Snapshot>,
}

fn key(namespace: Option<&str>, name: &str) -> String {
    format!("{}/{name}", namespace.unwrap_or_default())
}

impl WorkQueue {
    fn state(&self) -> MutexGuard<'_, QueueState> {
        // The lock is never held across a panic-prone call, so a poisoned lock still holds
        // consistent data; keep serving it.
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Uses the controller's cache as the set of objects that can wait.
    pub fn observe<K>(&self, store: Store<K>)
    where
        K: Resource + Clone + Send + Sync + 'static,
        K::DynamicType: Eq + std::hash::Hash + Clone + Send + Sync,
    {
        self.state().cache = Some(Box::new(move || {
            store
                .state()
                .iter()
                .map(|object| {
                    let meta = object.meta();
                    (
                        key(
                            meta.namespace.as_deref(),
                            meta.name.as_deref().unwrap_or_default(),
                        ),
                        meta.resource_version.clone(),
                    )
                })
                .collect()
        }));
    }

    /// Records that a watched object's change asks for these objects to be reconciled, and
    /// passes the references on to the controller.
    pub fn wake<K, I>(&self, refs: I) -> Vec<ObjectRef<K>>
    where
        K: Resource,
        K::DynamicType: Eq + std::hash::Hash + Clone,
        I: IntoIterator<Item = ObjectRef<K>>,
    {
        let refs: Vec<ObjectRef<K>> = refs.into_iter().collect();
        let mut state = self.state();
        for object in &refs {
            state
                .woken
                .insert(key(object.namespace.as_deref(), &object.name));
        }
        refs
    }

    /// Records that a reconcile of `object` starts with this version of it.
    pub fn started<K: Resource>(&self, object: &K) {
        let meta = object.meta();
        let object_key = key(
            meta.namespace.as_deref(),
            meta.name.as_deref().unwrap_or_default(),
        );
        let mut state = self.state();
        state.woken.remove(&object_key);
        state
            .started
            .insert(object_key, meta.resource_version.clone());
    }

    /// Objects in the cache that wait for a reconcile; forgets objects that left the cache.
    pub fn depth(&self) -> usize {
        let mut state = self.state();
        let Some(cache) = &state.cache else {
            return 0;
        };
        let objects: HashMap<String, Option<String>> = cache().into_iter().collect();
        state.started.retain(|k, _| objects.contains_key(k));
        state.woken.retain(|k| objects.contains_key(k));
        objects
            .iter()
            .filter(|(k, version)| {
                state.woken.contains(*k) || state.started.get(*k) != Some(*version)
            })
            .count()
    }

    /// Whether a controller registered its cache (only those are exported).
    pub fn is_observed(&self) -> bool {
        self.state().cache.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::runtime::reflector::store;
    use kube::runtime::watcher::Event;

    fn object(name: &str, version: &str) -> ConfigMap {
        let mut map = ConfigMap::default();
        map.metadata.name = Some(name.into());
        map.metadata.namespace = Some("default".into());
        map.metadata.resource_version = Some(version.into());
        map
    }

    #[test]
    fn counts_changed_unreconciled_and_woken_objects() {
        let (reader, mut writer) = store::<ConfigMap>();
        let queue = WorkQueue::default();
        assert_eq!(queue.depth(), 0, "no cache registered yet");
        queue.observe(reader);
        let a = object("a", "1");
        let b = object("b", "1");
        writer.apply_watcher_event(&Event::Init);
        writer.apply_watcher_event(&Event::InitApply(a.clone()));
        writer.apply_watcher_event(&Event::InitApply(b.clone()));
        writer.apply_watcher_event(&Event::InitDone);
        assert_eq!(
            queue.depth(),
            2,
            "listed objects wait for their first reconcile"
        );

        queue.started(&a);
        queue.started(&b);
        assert_eq!(queue.depth(), 0);

        let a2 = object("a", "2");
        writer.apply_watcher_event(&Event::Apply(a2.clone()));
        assert_eq!(queue.depth(), 1, "a changed after its reconcile started");

        let woken = queue.wake([ObjectRef::<ConfigMap>::new("b").within("default")]);
        assert_eq!(woken.len(), 1, "references are passed on");
        assert_eq!(queue.depth(), 2, "b was woken by a watched object");

        queue.started(&a2);
        queue.started(&b);
        assert_eq!(queue.depth(), 0);

        queue.wake([ObjectRef::<ConfigMap>::new("gone").within("default")]);
        writer.apply_watcher_event(&Event::Delete(b));
        assert_eq!(
            queue.depth(),
            0,
            "objects not in the cache are never waiting"
        );
    }
}
