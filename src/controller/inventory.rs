//! One snapshot of Proxmox's `/cluster/resources` per endpoint, shared by every machine
//! reconcile: fetched by one caller while the others wait for that fetch (single flight),
//! reused while younger than [`MAX_AGE`], and refetched after this process changed what it
//! lists (a clone, a start, a stop, a deletion). Decisions that must not act on a stale view
//! (the VMID, the VM a machine owns) confirm with Proxmox or rely on what the machine recorded.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::proxmox::{ClusterResource, ProxmoxClient, ProxmoxError};

/// How long a snapshot serves before it is fetched again, even without writes of this process.
pub const MAX_AGE: Duration = Duration::from_secs(2);

/// Snapshots by endpoint (base URL and token).
#[derive(Clone, Default)]
pub struct Inventory {
    endpoints: Arc<Mutex<HashMap<String, Arc<Endpoint>>>>,
}

#[derive(Default)]
struct Endpoint {
    /// Held while fetching, so concurrent readers share one fetch.
    fetching: tokio::sync::Mutex<()>,
    /// Bumped by every write of this process that changes the listing.
    generation: AtomicU64,
    latest: Mutex<Option<Snapshot>>,
}

#[derive(Clone)]
struct Snapshot {
    taken: Instant,
    /// The generation the fetch started in: a write during the fetch makes it stale.
    generation: u64,
    resources: Arc<Vec<ClusterResource>>,
}

impl Endpoint {
    fn fresh(&self) -> Option<Arc<Vec<ClusterResource>>> {
        let latest = lock(&self.latest);
        let snapshot = latest.as_ref()?;
        (snapshot.generation == self.generation.load(Ordering::SeqCst)
            && snapshot.taken.elapsed() < MAX_AGE)
            .then(|| snapshot.resources.clone())
    }
}

impl Inventory {
    /// What Proxmox lists (VMs, templates, nodes, storages), at most [`MAX_AGE`] old and
    /// newer than this process's last write to that endpoint.
    pub async fn resources(
        &self,
        proxmox: &ProxmoxClient,
    ) -> Result<Arc<Vec<ClusterResource>>, ProxmoxError> {
        let endpoint = self.endpoint(proxmox);
        if let Some(resources) = endpoint.fresh() {
            return Ok(resources);
        }
        let _fetching = endpoint.fetching.lock().await;
        // Another reader may have fetched while this one waited.
        if let Some(resources) = endpoint.fresh() {
            return Ok(resources);
        }
        let generation = endpoint.generation.load(Ordering::SeqCst);
        let taken = Instant::now();
        let resources = Arc::new(proxmox.cluster_resources(None).await?);
        *lock(&endpoint.latest) = Some(Snapshot {
            taken,
            generation,
            resources: resources.clone(),
        });
        Ok(resources)
    }

    /// Marks the endpoint's snapshot stale after this process changed what it lists.
    pub fn changed(&self, proxmox: &ProxmoxClient) {
        self.endpoint(proxmox)
            .generation
            .fetch_add(1, Ordering::SeqCst);
    }

    fn endpoint(&self, proxmox: &ProxmoxClient) -> Arc<Endpoint> {
        let key = format!("{}#{}", proxmox.base_url(), proxmox.token_id());
        lock(&self.endpoints).entry(key).or_default().clone()
    }
}

/// Every update under these locks is a single assignment, so a poisoned lock still holds a
/// consistent value and is used as it is.
fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
