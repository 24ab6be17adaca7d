//! The resourceVersions this process's own spec and metadata writes (and creates) produced, so
//! the watch event that only echoes such a write does not wake its object again: the pass that wrote went
//! on with what it wrote, and requeued itself for what comes next. A restart forgets them; each
//! echo seen after it then wakes its object once, which costs a pass and nothing else.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use kube::Resource;

use super::patch::Written;

/// Most objects whose latest own write is remembered; beyond, all are forgotten (their echoes
/// wake them, as after a restart).
const KEPT: usize = 100_000;

/// The latest own write's resourceVersion, by object UID, until its echo is seen.
#[derive(Clone, Default)]
pub struct OwnWrites {
    versions: Arc<Mutex<HashMap<String, String>>>,
}

impl OwnWrites {
    /// Notes that this process wrote `object`, which the API server answered with `written`.
    pub fn wrote<K: Resource>(&self, object: &K, written: &Written) {
        self.note(
            object.meta().uid.as_deref(),
            written.resource_version.as_deref(),
        );
    }

    /// Notes that this process created `created` (as the API server answered).
    pub fn created<K: Resource>(&self, created: &K) {
        let meta = created.meta();
        self.note(meta.uid.as_deref(), meta.resource_version.as_deref());
    }

    fn note(&self, uid: Option<&str>, version: Option<&str>) {
        let (Some(uid), Some(version)) = (uid, version) else {
            return;
        };
        let mut versions = self.versions.lock().unwrap_or_else(PoisonError::into_inner);
        if versions.len() >= KEPT && !versions.contains_key(uid) {
            versions.clear();
        }
        versions.insert(uid.to_owned(), version.to_owned());
    }

    /// Whether `object` as watched is the echo of this process's latest write to it (forgotten
    /// once seen: a later event at another version is someone's change, or a later write's).
    pub fn is_echo<K: Resource>(&self, object: &K) -> bool {
        let meta = object.meta();
        let (Some(uid), Some(version)) = (meta.uid.as_deref(), meta.resource_version.as_deref())
        else {
            return false;
        };
        let mut versions = self.versions.lock().unwrap_or_else(PoisonError::into_inner);
        if versions.get(uid).is_some_and(|written| written == version) {
            versions.remove(uid);
            return true;
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::api::ObjectMeta;

    fn object(uid: &str, version: &str) -> ConfigMap {
        ConfigMap {
            metadata: ObjectMeta {
                uid: Some(uid.into()),
                resource_version: Some(version.into()),
                ..ObjectMeta::default()
            },
            ..ConfigMap::default()
        }
    }

    fn written(version: &str) -> Written {
        Written {
            generation: Some(2),
            resource_version: Some(version.into()),
        }
    }

    #[test]
    fn only_the_version_this_process_wrote_is_an_echo_and_only_once() {
        let own = OwnWrites::default();
        own.wrote(&object("a", "10"), &written("11"));
        assert!(
            !own.is_echo(&object("a", "10")),
            "the version before the write"
        );
        assert!(
            !own.is_echo(&object("b", "11")),
            "another object at that version"
        );
        assert!(own.is_echo(&object("a", "11")));
        assert!(!own.is_echo(&object("a", "11")), "an echo is seen once");
        assert!(!own.is_echo(&object("a", "12")), "someone's later change");
    }

    #[test]
    fn a_later_write_replaces_the_earlier_and_unknown_versions_are_no_echo() {
        let own = OwnWrites::default();
        own.wrote(&object("a", "10"), &written("11"));
        own.wrote(&object("a", "11"), &written("13"));
        assert!(!own.is_echo(&object("a", "11")));
        assert!(own.is_echo(&object("a", "13")));
        own.wrote(&object("a", "13"), &Written::default());
        assert!(!own.is_echo(&object("a", "13")));
        assert!(!own.is_echo(&ConfigMap::default()));
    }

    #[test]
    fn a_created_object_echoes_at_the_version_the_create_answered() {
        let own = OwnWrites::default();
        own.created(&object("c", "5"));
        assert!(!own.is_echo(&object("c", "6")), "bound by someone since");
        own.created(&object("d", "7"));
        assert!(own.is_echo(&object("d", "7")));
    }

    #[test]
    fn beyond_the_limit_all_are_forgotten() {
        let own = OwnWrites::default();
        for n in 0..KEPT {
            own.wrote(&object(&format!("m{n}"), "1"), &written("2"));
        }
        own.wrote(&object("new", "1"), &written("2"));
        assert!(
            !own.is_echo(&object("m7", "2")),
            "forgotten: it wakes its object"
        );
        assert!(own.is_echo(&object("new", "2")));
    }
}
