//! One snapshot of Proxmox's `/cluster/resources` per endpoint, shared by every machine
//! reconcile: fetched by one caller while the others wait for that fetch (single flight),
//! reused while younger than [`MAX_AGE`] ([`SETTLED_MAX_AGE`] for a provisioned machine's
//! resync, which only looks for drift), and refetched for a machine once it changed what
//! Proxmox lists of its own VM (a clone, a start, a stop, a deletion, its HA state). Other
//! machines' changes do not make a snapshot stale for it: what they hold while Proxmox may not
//! list it yet is in this process's bookkeeping (memory reservations, VMID claims). Decisions
//! that must not act on a stale view (the VMID, the VM a machine owns) confirm with Proxmox or
//! rely on what the machine recorded.
//!
//! Lookups that change only when an administrator changes Proxmox (a node's ISO storages, a
//! template's volumes, where Proxmox starts handing out VMIDs) are kept per endpoint for
//! [`LOOKUP_MAX_AGE`], so a fleet cloning one template asks once, not once per machine.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::placement::TemplateInfo;
use crate::proxmox::{ClusterResource, ProxmoxClient, ProxmoxError, ResourceType, VmConfig};

/// How long a snapshot serves before it is fetched again, even without writes of this process.
pub const MAX_AGE: Duration = Duration::from_secs(2);

/// How long a snapshot serves a provisioned machine that wrote nothing since: its pass only
/// looks for drift, which it would otherwise find one resync later, so a large fleet at rest
/// fetches the listing a few times a minute, not on every pass.
pub const SETTLED_MAX_AGE: Duration = Duration::from_secs(60);

/// How long a node's ISO storage, a template's config and the lowest free VMID Proxmox named
/// are reused: an administrator's change to them is seen within this time.
pub const LOOKUP_MAX_AGE: Duration = Duration::from_secs(60);

/// How long a clone's end is remembered: longer than any snapshot in use, with room for the
/// fetch that was under way.
const CLONE_END_KEPT: Duration = Duration::from_secs(2 * SETTLED_MAX_AGE.as_secs());

/// Snapshots by endpoint (base URL and token).
#[derive(Clone, Default)]
pub struct Inventory {
    endpoints: Arc<Mutex<HashMap<String, Arc<Endpoint>>>>,
}

#[derive(Default)]
struct Endpoint {
    /// Held while fetching, so concurrent readers share one fetch.
    fetching: tokio::sync::Mutex<()>,
    /// Counts the writes of this process that change the listing.
    writes: AtomicU64,
    /// The count after each machine's latest such write, by machine.
    written_by: Mutex<HashMap<String, u64>>,
    /// The count when `written_by` was last emptied (it holds at most [`WRITERS_KEPT`]): a
    /// machine not in it may have written up to then.
    forgotten_up_to: AtomicU64,
    latest: Mutex<Option<Snapshot>>,
    /// The ISO storage chosen per node.
    iso_storages: Mutex<HashMap<String, (Instant, Option<String>)>>,
    /// Template configs by (node, VMID).
    templates: Mutex<HashMap<(String, u32), (Instant, VmConfig)>>,
    /// The lowest VMID Proxmox offered (`/cluster/nextid`), where the search for a free one
    /// starts.
    lowest_free_vmid: Mutex<Option<(Instant, u32)>>,
    /// The major Proxmox VE release (`GET /version`).
    pve_major: Mutex<Option<(Instant, u32)>>,
    /// Devices per node of each PCI resource mapping (`GET /cluster/mapping/pci`).
    pci_mappings: Mutex<Option<(Instant, Arc<PciMappingDevices>)>>,
    /// VMIDs whose clone this process saw succeed, with when: a snapshot fetched before then
    /// still shows the clone's lock, and is not fetched again for it.
    clones_ended: Mutex<HashMap<u32, Instant>>,
    /// VMIDs whose HA registration (resource, zone rule or group, control-plane rule) this
    /// process completed; a restarted process checks each HA-managed machine once more.
    ha_registered: Mutex<std::collections::HashSet<u32>>,
}

/// Devices of each PCI resource mapping, by mapping name and node.
pub type PciMappingDevices = BTreeMap<String, BTreeMap<String, u32>>;

/// Whether a lookup came from Proxmox in this call or from what an earlier one kept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Freshness {
    /// Asked Proxmox in this call.
    JustAsked,
    /// Kept from an earlier call, at most [`LOOKUP_MAX_AGE`] old.
    Kept,
}

/// The storages the listing shows available on `node` with content type `iso`.
fn iso_storages_listed(resources: &[ClusterResource], node: &str) -> Vec<String> {
    resources
        .iter()
        .filter(|r| {
            r.kind == ResourceType::Storage
                && r.node.as_deref() == Some(node)
                && r.status.as_deref() == Some("available")
                && r.content
                    .as_deref()
                    .is_some_and(|content| content.split(',').any(|c| c.trim() == "iso"))
        })
        .filter_map(|r| r.storage.clone())
        .collect()
}

/// A value kept for [`LOOKUP_MAX_AGE`].
fn recent<T: Clone>(kept: Option<&(Instant, T)>) -> Option<T> {
    kept.filter(|(at, _)| at.elapsed() < LOOKUP_MAX_AGE)
        .map(|(_, value)| value.clone())
}

#[derive(Clone)]
struct Snapshot {
    taken: Instant,
    /// The write count when the fetch started: it shows the writes counted up to there.
    writes_before: u64,
    resources: Arc<Listing>,
}

/// One fetch of `/cluster/resources`, with its VMs indexed by tag on first use: every machine's
/// pass looks for its VM in the same listing, so it is searched once, not once per pass.
#[derive(Debug, Default)]
pub struct Listing {
    resources: Vec<ClusterResource>,
    /// Lowercased tag -> position of the first VM (not template) carrying it.
    vm_by_tag: OnceLock<HashMap<String, usize>>,
}

impl Listing {
    pub fn new(resources: Vec<ClusterResource>) -> Self {
        Self {
            resources,
            vm_by_tag: OnceLock::new(),
        }
    }

    /// The first VM (not template) that carries `tag`, compared without regard to ASCII case.
    pub fn vm_tagged(&self, tag: &str) -> Option<&ClusterResource> {
        let index = self.vm_by_tag.get_or_init(|| {
            let mut index = HashMap::new();
            for (position, vm) in self.resources.iter().enumerate() {
                if vm.kind != ResourceType::Qemu || vm.template {
                    continue;
                }
                for tag in &vm.tags {
                    index.entry(tag.to_ascii_lowercase()).or_insert(position);
                }
            }
            index
        });
        index
            .get(&tag.to_ascii_lowercase())
            .map(|&position| &self.resources[position])
    }
}

impl std::ops::Deref for Listing {
    type Target = [ClusterResource];

    fn deref(&self) -> &[ClusterResource] {
        &self.resources
    }
}

impl Snapshot {
    /// Younger than `max_age`, and fetched after the reader's own latest write (counted
    /// `written`).
    fn fresh_for(&self, written: u64, max_age: Duration) -> bool {
        self.writes_before >= written && self.taken.elapsed() < max_age
    }
}

/// Most machines whose latest write is remembered per endpoint; beyond, all marks are dropped
/// and every machine reads as if it had written then.
const WRITERS_KEPT: usize = 100_000;

impl Endpoint {
    /// The write count after `reader`'s latest write; `None` (a reader that writes nothing
    /// itself) needs only a young snapshot.
    fn written(&self, reader: Option<&str>) -> u64 {
        reader.map_or(0, |reader| {
            lock(&self.written_by)
                .get(reader)
                .copied()
                .unwrap_or_else(|| self.forgotten_up_to.load(Ordering::SeqCst))
        })
    }

    /// Counts a write of `writer` that changes the listing.
    fn wrote(&self, writer: &str) {
        let count = self.writes.fetch_add(1, Ordering::SeqCst) + 1;
        let mut written_by = lock(&self.written_by);
        if written_by.len() >= WRITERS_KEPT && !written_by.contains_key(writer) {
            written_by.clear();
            self.forgotten_up_to.store(count, Ordering::SeqCst);
        }
        written_by.insert(writer.to_owned(), count);
    }

    fn fresh(&self, written: u64, max_age: Duration) -> Option<Arc<Listing>> {
        let latest = lock(&self.latest);
        let snapshot = latest.as_ref()?;
        snapshot
            .fresh_for(written, max_age)
            .then(|| snapshot.resources.clone())
    }
}

impl Inventory {
    /// What Proxmox lists (VMs, templates, nodes, storages), at most [`MAX_AGE`] old and, for
    /// a `reader` (a machine's key), fetched after its own latest change to the listing.
    pub async fn resources(
        &self,
        proxmox: &ProxmoxClient,
        reader: Option<&str>,
    ) -> Result<Arc<Listing>, ProxmoxError> {
        self.resources_within(proxmox, reader, MAX_AGE).await
    }

    /// What Proxmox lists, for a provisioned machine's resync: as [`Inventory::resources`],
    /// but up to [`SETTLED_MAX_AGE`] old.
    pub async fn settled_resources(
        &self,
        proxmox: &ProxmoxClient,
        reader: &str,
    ) -> Result<Arc<Listing>, ProxmoxError> {
        self.resources_within(proxmox, Some(reader), SETTLED_MAX_AGE)
            .await
    }

    async fn resources_within(
        &self,
        proxmox: &ProxmoxClient,
        reader: Option<&str>,
        max_age: Duration,
    ) -> Result<Arc<Listing>, ProxmoxError> {
        let endpoint = self.endpoint(proxmox);
        let written = endpoint.written(reader);
        if let Some(resources) = endpoint.fresh(written, max_age) {
            return Ok(resources);
        }
        let _fetching = endpoint.fetching.lock().await;
        // Another reader may have fetched while this one waited.
        if let Some(resources) = endpoint.fresh(written, max_age) {
            return Ok(resources);
        }
        let writes_before = endpoint.writes.load(Ordering::SeqCst);
        let taken = Instant::now();
        let resources = Arc::new(Listing::new(proxmox.cluster_resources(None).await?));
        *lock(&endpoint.latest) = Some(Snapshot {
            taken,
            writes_before,
            resources: resources.clone(),
        });
        Ok(resources)
    }

    /// Notes that `writer` (a machine's key) changed what the endpoint lists of its VM: its
    /// next read waits for a snapshot fetched after this.
    pub fn changed(&self, proxmox: &ProxmoxClient, writer: &str) {
        self.endpoint(proxmox).wrote(writer);
    }

    /// Notes that the clone to `vmid` succeeded: a snapshot that still shows its lock shows
    /// what was before.
    pub fn clone_ended(&self, proxmox: &ProxmoxClient, vmid: u32) {
        let endpoint = self.endpoint(proxmox);
        let mut ended = lock(&endpoint.clones_ended);
        ended.retain(|_, at| at.elapsed() < CLONE_END_KEPT);
        ended.insert(vmid, Instant::now());
    }

    /// Whether this process saw the clone to `vmid` succeed after the snapshots in use were
    /// fetched (any snapshot fetched since is younger than [`MAX_AGE`]).
    pub fn clone_seen_ended(&self, proxmox: &ProxmoxClient, vmid: u32) -> bool {
        lock(&self.endpoint(proxmox).clones_ended)
            .get(&vmid)
            .is_some_and(|at| at.elapsed() < CLONE_END_KEPT)
    }

    /// The storage seed ISOs go to on `node`: the first (by name) with content type `iso`, or
    /// `None` when it has none.
    pub async fn iso_storage(
        &self,
        proxmox: &ProxmoxClient,
        node: &str,
    ) -> Result<Option<String>, ProxmoxError> {
        let endpoint = self.endpoint(proxmox);
        if let Some(storage) = recent(lock(&endpoint.iso_storages).get(node)) {
            return Ok(storage);
        }
        // The listing names each node's enabled storages with their content types, so a
        // snapshot the machines fetched anyway saves the node's own storage list.
        let listed = lock(&endpoint.latest)
            .as_ref()
            .filter(|snapshot| snapshot.taken.elapsed() < LOOKUP_MAX_AGE)
            .map(|snapshot| snapshot.resources.clone());
        let mut storages: Vec<String> = match listed {
            Some(resources) => iso_storages_listed(&resources, node),
            None => proxmox
                .list_storage(node, Some("iso"))
                .await?
                .into_iter()
                .map(|s| s.storage)
                .collect(),
        };
        storages.sort();
        let storage = storages.into_iter().next();
        lock(&endpoint.iso_storages).insert(node.to_owned(), (Instant::now(), storage.clone()));
        Ok(storage)
    }

    /// The config of the template `vmid` on `node` (its volumes tell where clones can go).
    pub async fn template_config(
        &self,
        proxmox: &ProxmoxClient,
        node: &str,
        vmid: u32,
    ) -> Result<VmConfig, ProxmoxError> {
        let endpoint = self.endpoint(proxmox);
        let key = (node.to_owned(), vmid);
        if let Some(config) = recent(lock(&endpoint.templates).get(&key)) {
            return Ok(config);
        }
        let config = proxmox.vm_config(node, vmid).await?;
        lock(&endpoint.templates).insert(key, (Instant::now(), config.clone()));
        Ok(config)
    }

    /// The lowest VMID Proxmox hands out (`/cluster/nextid`, which honours the datacenter's
    /// VMID range), as it answered within [`LOOKUP_MAX_AGE`]: where the search for a free VMID
    /// starts.
    /// Says whether Proxmox named it just now (then it was free a moment ago) or earlier (then
    /// it may have been taken since).
    pub async fn lowest_free_vmid(
        &self,
        proxmox: &ProxmoxClient,
    ) -> Result<(u32, Freshness), ProxmoxError> {
        let endpoint = self.endpoint(proxmox);
        if let Some(vmid) = recent(lock(&endpoint.lowest_free_vmid).as_ref()) {
            return Ok((vmid, Freshness::Kept));
        }
        let vmid = proxmox.next_id(None).await?;
        *lock(&endpoint.lowest_free_vmid) = Some((Instant::now(), vmid));
        Ok((vmid, Freshness::JustAsked))
    }

    /// The major Proxmox VE release (`8`, `9`, ...), as `GET /version` answered within
    /// [`LOOKUP_MAX_AGE`]; a release that does not parse counts as 9.
    pub async fn pve_major(&self, proxmox: &ProxmoxClient) -> Result<u32, ProxmoxError> {
        let endpoint = self.endpoint(proxmox);
        if let Some(major) = recent(lock(&endpoint.pve_major).as_ref()) {
            return Ok(major);
        }
        let major = proxmox
            .version()
            .await?
            .major_minor()
            .map_or(9, |(major, _)| major);
        *lock(&endpoint.pve_major) = Some((Instant::now(), major));
        Ok(major)
    }

    /// How many devices each PCI resource mapping lists per node, as Proxmox answered within
    /// [`LOOKUP_MAX_AGE`]: a device an administrator maps is offered within that time.
    pub async fn pci_mapping_devices(
        &self,
        proxmox: &ProxmoxClient,
    ) -> Result<Arc<PciMappingDevices>, ProxmoxError> {
        let endpoint = self.endpoint(proxmox);
        if let Some(devices) = recent(lock(&endpoint.pci_mappings).as_ref()) {
            return Ok(devices);
        }
        let mut devices = PciMappingDevices::new();
        for mapping in proxmox.pci_mappings().await? {
            let per_node = devices.entry(mapping.id.clone()).or_default();
            for entry in &mapping.map {
                *per_node.entry(entry.node.clone()).or_insert(0) += 1;
            }
        }
        let devices = Arc::new(devices);
        *lock(&endpoint.pci_mappings) = Some((Instant::now(), devices.clone()));
        Ok(devices)
    }

    /// Whether this process completed VM `vmid`'s HA registration.
    pub fn ha_registered(&self, proxmox: &ProxmoxClient, vmid: u32) -> bool {
        lock(&self.endpoint(proxmox).ha_registered).contains(&vmid)
    }

    /// Records (`true`) or forgets VM `vmid`'s completed HA registration.
    pub fn set_ha_registered(&self, proxmox: &ProxmoxClient, vmid: u32, registered: bool) {
        let endpoint = self.endpoint(proxmox);
        let mut set = lock(&endpoint.ha_registered);
        if registered {
            set.insert(vmid);
        } else {
            set.remove(&vmid);
        }
    }

    fn endpoint(&self, proxmox: &ProxmoxClient) -> Arc<Endpoint> {
        lock(&self.endpoints)
            .entry(endpoint_key(proxmox))
            .or_default()
            .clone()
    }
}

/// What is kept per Proxmox endpoint is keyed by base URL and token: another token may see
/// other VMs and tasks.
pub(crate) fn endpoint_key(proxmox: &ProxmoxClient) -> String {
    format!("{}#{}", proxmox.base_url(), proxmox.token_id())
}

/// Memory promised to machines whose VMs are still being created, per Proxmox endpoint
/// (`scheme://host:port`): node names are unique within one Proxmox cluster only, so `pve1` of
/// one site never shares a reservation with `pve1` of another.
#[derive(Debug, Default)]
pub struct EndpointReservations {
    by_endpoint: HashMap<String, crate::placement::Reservations>,
}

impl EndpointReservations {
    /// The reservations on the nodes of `endpoint`.
    pub fn of(&mut self, endpoint: &str) -> &mut crate::placement::Reservations {
        self.by_endpoint.entry(endpoint.to_owned()).or_default()
    }

    /// Gives back what `machine` reserved, wherever it did.
    pub fn release(&mut self, machine: &str) {
        for reservations in self.by_endpoint.values_mut() {
            reservations.release(machine);
        }
    }

    /// Notes the VMID of `machine`'s reservation, wherever it reserved.
    pub fn set_vmid(&mut self, machine: &str, vmid: u32) {
        for reservations in self.by_endpoint.values_mut() {
            reservations.set_vmid(machine, vmid);
        }
    }
}

/// Every update under these locks is a single assignment, so a poisoned lock still holds a
/// consistent value and is used as it is.
fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The VM templates in a `/cluster/resources` listing, as template selection sees them.
pub fn templates(resources: &[ClusterResource]) -> Vec<TemplateInfo> {
    resources
        .iter()
        .filter(|r| r.kind == ResourceType::Qemu && r.template)
        .filter_map(|r| {
            Some(TemplateInfo {
                node: r.node.clone()?,
                vmid: r.vmid?,
                name: r.name.clone().unwrap_or_default(),
                tags: r.tags.clone(),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snapshot(endpoint: &Endpoint) {
        *lock(&endpoint.latest) = Some(Snapshot {
            taken: Instant::now(),
            writes_before: endpoint.writes.load(Ordering::SeqCst),
            resources: Arc::new(Listing::default()),
        });
    }

    #[test]
    fn a_vm_is_found_by_any_of_its_tags_in_any_case_and_templates_are_not_vms() {
        let guest = |kind: &str, vmid: u32, template: u8, tags: &str| -> ClusterResource {
            serde_json::from_value(serde_json::json!({
                "id": format!("{kind}/{vmid}"), "type": kind, "vmid": vmid, "node": "pve1",
                "template": template, "tags": tags,
            }))
            .expect("resource")
        };
        let listing = Listing::new(vec![
            guest("qemu", 100, 1, "capmox-machine-a"),
            guest("lxc", 101, 0, "capmox-machine-a"),
            guest("qemu", 102, 0, "k8s;Capmox-Machine-A"),
            guest("qemu", 103, 0, "capmox-machine-a"),
            guest("qemu", 104, 0, "capmox-machine-b"),
        ]);
        let vmid = |tag: &str| listing.vm_tagged(tag).and_then(|vm| vm.vmid);
        assert_eq!(vmid("capmox-machine-a"), Some(102));
        assert_eq!(vmid("CAPMOX-machine-B"), Some(104));
        assert_eq!(vmid("k8s"), Some(102));
        assert_eq!(vmid("capmox-machine-c"), None);
        assert_eq!(listing.len(), 5);
    }

    #[test]
    fn the_iso_storage_is_an_available_storage_of_the_node_that_holds_isos() {
        let storage = |node: &str, name: &str, status: &str, content: &str| -> ClusterResource {
            serde_json::from_value(serde_json::json!({
                "id": format!("storage/{node}/{name}"), "type": "storage", "node": node,
                "storage": name, "status": status, "content": content,
            }))
            .expect("resource")
        };
        let resources = vec![
            storage("pve1", "local-lvm", "available", "images,rootdir"),
            storage("pve1", "nfs", "unknown", "iso"),
            storage("pve1", "local", "available", "vztmpl, iso,backup"),
            storage("pve2", "cephfs", "available", "iso"),
        ];
        assert_eq!(iso_storages_listed(&resources, "pve1"), vec!["local"]);
        assert_eq!(iso_storages_listed(&resources, "pve2"), vec!["cephfs"]);
        assert!(iso_storages_listed(&resources, "pve3").is_empty());
    }

    #[test]
    fn a_snapshot_is_stale_only_for_the_machine_that_wrote_since() {
        let endpoint = Endpoint::default();
        snapshot(&endpoint);
        let fresh_for =
            |reader: Option<&str>| endpoint.fresh(endpoint.written(reader), MAX_AGE).is_some();
        assert!(fresh_for(Some("m1")) && fresh_for(Some("m2")) && fresh_for(None));

        endpoint.wrote("m1");
        assert!(!fresh_for(Some("m1")), "m1 changed its VM since the fetch");
        assert!(fresh_for(Some("m2")), "m1's change is not m2's business");
        assert!(fresh_for(None));

        snapshot(&endpoint);
        assert!(fresh_for(Some("m1")), "fetched after m1's change");
        endpoint.wrote("m2");
        endpoint.wrote("m1");
        assert!(!fresh_for(Some("m1")) && !fresh_for(Some("m2")));

        // An old snapshot is stale for everyone.
        lock(&endpoint.latest).as_mut().expect("snapshot").taken -= MAX_AGE;
        assert!(!fresh_for(None));
    }

    #[test]
    fn a_settled_machine_reads_an_older_snapshot_unless_it_wrote_since() {
        let endpoint = Endpoint::default();
        snapshot(&endpoint);
        let age_by = |by: Duration| lock(&endpoint.latest).as_mut().expect("snapshot").taken -= by;
        let serves = |reader: &str, max_age| {
            endpoint
                .fresh(endpoint.written(Some(reader)), max_age)
                .is_some()
        };
        age_by(MAX_AGE);
        assert!(!serves("m1", MAX_AGE), "too old for a machine at work");
        assert!(serves("m1", SETTLED_MAX_AGE), "young enough for a resync");

        endpoint.wrote("m1");
        assert!(!serves("m1", SETTLED_MAX_AGE), "m1 changed its VM since");
        assert!(serves("m2", SETTLED_MAX_AGE));

        age_by(SETTLED_MAX_AGE);
        assert!(!serves("m2", SETTLED_MAX_AGE), "too old even for a resync");
    }

    #[test]
    fn forgotten_writers_read_as_if_they_wrote_when_they_were_forgotten() {
        let endpoint = Endpoint::default();
        for n in 0..WRITERS_KEPT {
            lock(&endpoint.written_by).insert(format!("m{n}"), 0);
        }
        snapshot(&endpoint);
        endpoint.wrote("new");
        assert_eq!(
            lock(&endpoint.written_by).len(),
            1,
            "the marks were dropped"
        );
        let fresh_for = |reader: &str| {
            endpoint
                .fresh(endpoint.written(Some(reader)), MAX_AGE)
                .is_some()
        };
        assert!(!fresh_for("m7"), "m7 may have written just before");
        assert!(!fresh_for("new"));
        snapshot(&endpoint);
        assert!(fresh_for("m7") && fresh_for("new"));
    }
}
