//! Bootstrap data Secrets as their watch delivers them, so a machine's format check and seed
//! ISO cost no read. Only recent Secrets are held, each until its machine has taken its data,
//! within a byte budget; only the watch fills it, so a change to a held Secret always reaches
//! it. After a restart, or for a Secret the watch has not shown yet (or no longer holds), the
//! machine reads it from the API server.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::Api;
use kube::runtime::{WatchStreamExt, watcher};
use tokio_util::sync::CancellationToken;

/// The type Cluster API's bootstrap providers give the Secrets they write.
pub const BOOTSTRAP_SECRET_TYPE: &str = "cluster.x-k8s.io/secret";

/// How long a Secret is held after its creation: a machine takes its data within minutes.
const KEPT_FOR: Duration = Duration::from_secs(15 * 60);

/// The most Secret data held at once; the oldest go first beyond it.
const MAX_BYTES: usize = 32 << 20;

/// A bootstrap Secret's `data`.
pub type BootstrapData = Arc<BTreeMap<String, ByteString>>;

/// The bootstrap Secrets held, by namespace and name.
#[derive(Clone, Default)]
pub struct BootstrapSecrets {
    held: Arc<Mutex<Held>>,
}

type Key = (String, String);

#[derive(Default)]
struct Held {
    secrets: HashMap<Key, Kept>,
    /// Keys in the order they were kept, with the time each was: the eviction order. A key
    /// kept again or forgotten leaves an entry here that no longer matches, skipped when met.
    order: VecDeque<(Instant, Key)>,
    bytes: usize,
}

struct Kept {
    data: BootstrapData,
    since: Instant,
    bytes: usize,
}

impl BootstrapSecrets {
    /// The data of Secret `namespace/name`, when held.
    pub fn get(&self, namespace: &str, name: &str) -> Option<BootstrapData> {
        let held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        held.secrets
            .get(&(namespace.to_owned(), name.to_owned()))
            .map(|kept| kept.data.clone())
    }

    /// Holds `data` as Secret `namespace/name`'s, from `now`.
    pub fn keep(&self, namespace: &str, name: &str, data: BootstrapData, now: Instant) {
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        held.insert((namespace.to_owned(), name.to_owned()), data, now);
        held.evict(now);
    }

    /// Drops Secret `namespace/name`: deleted, or its machine has taken its data.
    pub fn forget(&self, namespace: &str, name: &str) {
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        held.remove(&(namespace.to_owned(), name.to_owned()));
    }

    /// Holds exactly `listed` (a watch's fresh list), from `now`.
    fn replace(&self, listed: Vec<(Key, BootstrapData)>, now: Instant) {
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        *held = Held::default();
        for (key, data) in listed {
            held.insert(key, data, now);
        }
        held.evict(now);
    }

    /// How many Secrets and bytes of data are held.
    #[cfg(test)]
    fn size(&self) -> (usize, usize) {
        let held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        (held.secrets.len(), held.bytes)
    }
}

impl Held {
    fn insert(&mut self, key: Key, data: BootstrapData, now: Instant) {
        let bytes = data.iter().map(|(k, v)| k.len() + v.0.len()).sum();
        self.remove(&key);
        self.bytes += bytes;
        self.order.push_back((now, key.clone()));
        self.secrets.insert(
            key,
            Kept {
                data,
                since: now,
                bytes,
            },
        );
    }

    fn remove(&mut self, key: &Key) {
        if let Some(kept) = self.secrets.remove(key) {
            self.bytes -= kept.bytes;
        }
    }

    /// Drops the Secrets held longer than [`KEPT_FOR`], then the oldest beyond [`MAX_BYTES`].
    fn evict(&mut self, now: Instant) {
        while let Some((since, key)) = self.order.front() {
            let current = self
                .secrets
                .get(key)
                .is_some_and(|kept| kept.since == *since);
            let expired = now.saturating_duration_since(*since) > KEPT_FOR;
            if current && !expired && self.bytes <= MAX_BYTES {
                break;
            }
            if let Some((_, key)) = self.order.pop_front()
                && current
            {
                self.remove(&key);
            }
        }
    }
}

/// Whether a Secret created at `created` is still worth holding at `now`.
fn recent(created: Option<&k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>) -> bool {
    let Some(created) = created else {
        return true;
    };
    let age = k8s_openapi::jiff::Timestamp::now().duration_since(created.0);
    age.as_secs() < KEPT_FOR.as_secs() as i64
}

fn key_and_data(secret: Secret) -> Option<(Key, BootstrapData)> {
    let namespace = secret.metadata.namespace?;
    let name = secret.metadata.name?;
    Some(((namespace, name), Arc::new(secret.data.unwrap_or_default())))
}

/// Follows the bootstrap Secrets of `apis` (one per namespace watched) into `secrets` until
/// `shutdown`. A watch refused (no list or watch grant) only costs reads: machines then read
/// each Secret from the API server.
pub async fn follow(
    secrets: BootstrapSecrets,
    apis: Vec<Api<Secret>>,
    shutdown: CancellationToken,
) {
    let config = watcher::Config::default().fields(&format!("type={BOOTSTRAP_SECRET_TYPE}"));
    let watches = apis.into_iter().map(|api| {
        let secrets = secrets.clone();
        let mut listed = Vec::new();
        let mut warned = false;
        watcher(super::lean::api(&api), config.clone())
            .map_ok(super::lean::event)
            .default_backoff()
            .for_each(move |event| {
                match event {
                    Ok(event) => apply(&secrets, &mut listed, event),
                    Err(error) if !warned => {
                        warned = true;
                        tracing::warn!(%error, "cannot watch bootstrap Secrets; machines read each from the API server until the watch succeeds");
                    }
                    Err(error) => tracing::debug!(%error, "bootstrap Secret watch failed; retrying with back-off"),
                }
                futures::future::ready(())
            })
    });
    tokio::select! {
        _ = futures::future::join_all(watches) => {}
        () = shutdown.cancelled() => {}
    }
}

/// Applies one watch event: `listed` gathers a fresh list until it is complete.
fn apply(
    secrets: &BootstrapSecrets,
    listed: &mut Vec<(Key, BootstrapData)>,
    event: watcher::Event<Secret>,
) {
    match event {
        watcher::Event::Init => listed.clear(),
        watcher::Event::InitApply(secret) => {
            if recent(secret.metadata.creation_timestamp.as_ref()) {
                listed.extend(key_and_data(secret));
            }
        }
        watcher::Event::InitDone => secrets.replace(std::mem::take(listed), Instant::now()),
        watcher::Event::Apply(secret) => {
            let recent = recent(secret.metadata.creation_timestamp.as_ref());
            if let Some(((namespace, name), data)) = key_and_data(secret) {
                if recent {
                    secrets.keep(&namespace, &name, data, Instant::now());
                } else {
                    // An old Secret changed: a copy read earlier must not outlive the change.
                    secrets.forget(&namespace, &name);
                }
            }
        }
        watcher::Event::Delete(secret) => {
            if let (Some(namespace), Some(name)) = (secret.metadata.namespace, secret.metadata.name)
            {
                secrets.forget(&namespace, &name);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(bytes: usize) -> BootstrapData {
        Arc::new(BTreeMap::from([(
            "value".to_owned(),
            ByteString(vec![b'x'; bytes]),
        )]))
    }

    #[test]
    fn a_secret_is_held_until_forgotten_or_too_old() {
        let secrets = BootstrapSecrets::default();
        let start = Instant::now();
        secrets.keep("ns", "a", data(10), start);
        secrets.keep("ns", "b", data(10), start + Duration::from_secs(60));
        assert!(secrets.get("ns", "a").is_some());
        assert!(secrets.get("other", "a").is_none());
        secrets.forget("ns", "b");
        assert!(secrets.get("ns", "b").is_none());
        assert_eq!(secrets.size(), (1, 15));
        secrets.keep(
            "ns",
            "c",
            data(1),
            start + KEPT_FOR + Duration::from_secs(1),
        );
        assert!(secrets.get("ns", "a").is_none(), "held past its time");
        assert!(secrets.get("ns", "c").is_some());
    }

    #[test]
    fn a_secret_kept_again_is_held_from_then() {
        let secrets = BootstrapSecrets::default();
        let start = Instant::now();
        secrets.keep("ns", "a", data(10), start);
        secrets.keep("ns", "a", data(20), start + Duration::from_secs(600));
        assert_eq!(secrets.size(), (1, 25));
        secrets.keep(
            "ns",
            "b",
            data(1),
            start + KEPT_FOR + Duration::from_secs(1),
        );
        assert_eq!(secrets.get("ns", "a").map(|d| d["value"].0.len()), Some(20));
    }

    #[test]
    fn the_oldest_go_first_beyond_the_byte_budget() {
        let secrets = BootstrapSecrets::default();
        let now = Instant::now();
        let each = MAX_BYTES / 4 - "value".len();
        for name in ["a", "b", "c", "d", "e"] {
            secrets.keep("ns", name, data(each), now);
        }
        assert!(secrets.get("ns", "a").is_none());
        for name in ["b", "c", "d", "e"] {
            assert!(secrets.get("ns", name).is_some(), "{name} dropped");
        }
        assert!(secrets.size().1 <= MAX_BYTES);
    }

    fn secret(name: &str, age: Duration) -> Secret {
        let created = k8s_openapi::jiff::Timestamp::now()
            - k8s_openapi::jiff::SignedDuration::try_from(age).expect("a test's small age");
        Secret {
            metadata: kube::api::ObjectMeta {
                name: Some(name.into()),
                namespace: Some("ns".into()),
                creation_timestamp: Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                    created,
                )),
                ..Default::default()
            },
            data: Some(BTreeMap::from([(
                "value".into(),
                ByteString(b"#cloud-config".to_vec()),
            )])),
            ..Default::default()
        }
    }

    #[test]
    fn a_fresh_list_replaces_what_was_held_and_skips_old_secrets() {
        let secrets = BootstrapSecrets::default();
        let mut listed = Vec::new();
        secrets.keep("ns", "deleted-meanwhile", data(1), Instant::now());
        apply(&secrets, &mut listed, watcher::Event::Init);
        apply(
            &secrets,
            &mut listed,
            watcher::Event::InitApply(secret("new", Duration::from_secs(5))),
        );
        apply(
            &secrets,
            &mut listed,
            watcher::Event::InitApply(secret("old", KEPT_FOR * 2)),
        );
        assert!(
            secrets.get("ns", "deleted-meanwhile").is_some(),
            "replaced before the list ended"
        );
        apply(&secrets, &mut listed, watcher::Event::InitDone);
        assert!(secrets.get("ns", "new").is_some());
        assert!(secrets.get("ns", "old").is_none());
        assert!(secrets.get("ns", "deleted-meanwhile").is_none());
        apply(
            &secrets,
            &mut listed,
            watcher::Event::Apply(secret("later", Duration::ZERO)),
        );
        apply(
            &secrets,
            &mut listed,
            watcher::Event::Delete(secret("new", Duration::ZERO)),
        );
        assert!(secrets.get("ns", "later").is_some());
        assert!(secrets.get("ns", "new").is_none());
        apply(
            &secrets,
            &mut listed,
            watcher::Event::Apply(secret("aging", KEPT_FOR / 2)),
        );
        apply(
            &secrets,
            &mut listed,
            watcher::Event::Apply(secret("aging", KEPT_FOR * 2)),
        );
        assert!(
            secrets.get("ns", "aging").is_none(),
            "a copy older than the Secret's change"
        );
    }
}
