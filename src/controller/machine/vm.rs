//! Finding the machine's VM, or creating it: the VM's identity, VMID choice, placement on a
//! node and the clone.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::convert::Infallible;
use std::time::Duration;

use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::runtime::controller::Action;
use serde_json::json;

use super::bootstrap::smbios_uuid;
use super::decide::misconfigured;
use super::looks::Held;
use super::outcome::{Flow, Stop, waiting};
use super::task::TaskKind;
use super::{
    During, MACHINE_TAG_PREFIX, MAX_VMID, MachineError, PROVIDER_ID_PREFIX, PROVISIONED, Reconcile,
    Scope, claim_key, machine_tag,
};
use crate::api::{self, ProxmoxMachine, ProxmoxMachineStatus, VirtualMachineState, labels};
use crate::capi::{self};
use crate::controller::conditions::{self, Decided};
use crate::controller::inventory::{self, Listing};
use crate::placement::{
    self, CloneSources, GuestInfo, GuestKind, NodeCandidates, NodeInfo, NodeInventory,
    PlacedMachine, Placement, ScheduleRequest, StorageInfo, TemplateChoice, TemplateCopy,
    TemplateError, TemplateInfo, TemplateSource,
};
use crate::proxmox::{
    CloneParams, ClusterResource, ProxmoxClient, ProxmoxError, ResourceType, VmConfig,
};

/// What a clone is made from and where, and the task slots it needs.
pub(super) struct CloneChoice {
    source: TemplateChoice,
    target: String,
    wants: Vec<crate::controller::task_slots::Want>,
}

impl Reconcile<'_> {
    /// The machine's spec names a VM (`spec.providerID`) that Proxmox does not have: it waits
    /// and says so, instead of creating a second VM that would take the first one's place and
    /// addresses.
    pub(super) async fn vm_not_found(&self, scope: &Scope) -> Stop {
        const REASON: &str = "VirtualMachineNotFound";
        let provider_id = self.machine.spec.provider_id.as_deref().unwrap_or_default();
        let message = format!(
            "spec.providerID is {provider_id}, but Proxmox has no VM named {} with that SMBIOS UUID{}; capmox never creates a second VM for a machine that has one. Bring the VM back (a restore must keep its name and SMBIOS UUID), or delete this machine",
            scope.name,
            self.machine
                .spec
                .virtual_machine_id
                .map(|vmid| format!(" (spec.virtualMachineID is {vmid})"))
                .unwrap_or_default()
        );
        self.warn_once(scope, REASON, &message).await;
        Stop::Wait(misconfigured(REASON, message))
    }

    /// The machine's VM: by its tag, by the recorded VMID (if that VM is still the machine's),
    /// by `spec.providerID` (a machine moved or restored under a new UID), or as a clone in
    /// flight that Proxmox does not list yet.
    pub(super) async fn find_vm(
        &self,
        scope: &mut Scope,
        resources: &Listing,
        proxmox: &ProxmoxClient,
    ) -> Result<Option<ClusterResource>, MachineError> {
        let identity = Identity::of(self.machine, &scope.name);
        if let Some(vm) = resources.vm_tagged(&identity.tag) {
            return Ok(Some(vm.clone()));
        }
        if let Some(vmid) = scope.recorded_vmid
            && let Some(vm) = vms(resources).find(|r| r.vmid == Some(vmid))
        {
            if identity.listed_as_recorded(vm, &scope.current) {
                return Ok(Some(vm.clone()));
            }
            if let Some(vm) = identity.owned_listed(proxmox, &self.configs, vm).await? {
                return Ok(Some(vm));
            }
            // The VMID belongs to someone else now: forget it and create ours elsewhere.
            tracing::warn!(machine = %scope.name, vmid, "the recorded VMID belongs to another VM; choosing a new one");
            self.context
                .vms
                .vmid_claims
                .unclaim(vmid, &claim_key(self.machine));
            scope.recorded_vmid = None;
            scope.status.virtual_machine_id = None;
            scope.current.virtual_machine_id = None;
        }
        if let Some(vm) = identity
            .search(proxmox, &self.configs, resources, scope.recorded_vmid)
            .await?
        {
            return Ok(Some(vm));
        }
        // A clone in flight is not listed yet: it is ours if it carries our VMID and name.
        if let Some(vmid) = scope.recorded_vmid
            && let Some(node) = scope.current.proxmox_node.clone()
            && let Ok(config) = self.configs.read(proxmox, &node, vmid).await
            && identity.owns(&config, vmid)
        {
            if let Some(found) = resources.iter().find(|r| r.vmid == Some(vmid)) {
                return Ok(Some(found.clone()));
            }
            // Not in /cluster/resources yet (its statistics lag): describe it from its config.
            let described: ClusterResource = serde_json::from_value(json!({
                "id": format!("qemu/{vmid}"), "type": "qemu", "vmid": vmid, "node": node,
                "name": scope.name, "lock": config.lock(), "status": "stopped"
            }))?;
            return Ok(Some(described));
        }
        Ok(None)
    }

    /// Creates the machine's VM: chooses the template copy, node and VMID, records them (the
    /// intent, before the request), and requests the clone. The pass always waits after it.
    pub(super) async fn create_vm(&self, scope: &mut Scope, held: &Held) -> Flow<Infallible> {
        let (placement, proxmox) = (held.placement()?, held.proxmox()?);
        let resources = held
            .resources
            .as_deref()
            .map_or(&[][..], |listing| &**listing);
        let CloneChoice {
            source,
            target,
            wants,
        } = self
            .clone_source(scope, placement, proxmox, resources)
            .await?;
        // A waiting machine keeps the memory promised on its node, so the machines after it
        // are spread over the other nodes and wait in their lines.
        self.take_task_slots(wants)?;
        let vmid = self.claim_vmid(scope, proxmox, resources).await?;
        let cloning = format!(
            "cloning template {} on {} to VM {vmid} on {target}",
            source.vmid, source.node
        );
        self.record_intent(scope, placement, proxmox, vmid, &target, source.vmid)
            .await?;
        self.request_clone(scope, proxmox, &source, vmid, &target, &cloning)
            .await
    }

    /// The VMID for the machine's VM, claimed for it until it is deleted, so no other machine
    /// ever records it, even while a clone that did not happen leaves it free in Proxmox: the
    /// recorded one if it is still free, else from the range or Proxmox.
    async fn claim_vmid(
        &self,
        scope: &Scope,
        proxmox: &ProxmoxClient,
        resources: &[ClusterResource],
    ) -> Flow<u32> {
        let vmid = match self.pick_vmid(scope, proxmox, resources).await? {
            Picked::Vmid(claim) => claim,
            Picked::Unlisted(vmid) => {
                // Proxmox has a VM with the recorded VMID that it does not list yet (a clone
                // requested before a move): the next look tells whether it is ours.
                self.context.vms.release_reservation(&scope.name).await;
                return Err(waiting(
                    "Cloning",
                    format!("VMID {vmid} is in use in Proxmox but not listed yet; looking again"),
                    Action::requeue(Duration::from_secs(1)),
                ));
            }
            Picked::Exhausted => {
                self.context.vms.release_reservation(&scope.name).await;
                let message = if self.machine.spec.vm_id_range.is_some() {
                    "no free VMID in spec.vmIDRange; widen the range or free VMIDs"
                } else {
                    "Proxmox has no free VMID; free VMIDs"
                };
                return Err(waiting(
                    "VMIDRangeExhausted",
                    message,
                    Action::requeue(Duration::from_secs(60)),
                ));
            }
        };
        self.context
            .vms
            .reservations
            .lock()
            .await
            .set_vmid(&scope.name, vmid);
        Ok(vmid)
    }

    /// Intent first: a crash after the clone request finds the VM by this VMID. The spec holds
    /// it too, since a move or restore keeps the spec but not the status; that write is guarded
    /// by the resourceVersion this pass saw, and the status checkpoint by the one it produced.
    async fn record_intent(
        &self,
        scope: &mut Scope,
        placement: &Placement,
        proxmox: &ProxmoxClient,
        vmid: u32,
        target: &str,
        template_vmid: u32,
    ) -> Flow {
        let guard = scope.resource_version.clone();
        scope.resource_version = self.record_vmid(scope, vmid, guard).await?;
        scope.recorded_vmid = Some(vmid);
        scope.status.virtual_machine_id = Some(i64::from(vmid));
        scope.status.proxmox_node = Some(target.to_owned());
        scope.status.proxmox_endpoint = Some(proxmox.endpoint().to_owned());
        scope.status.failure_domain = placement.failure_domain().map(str::to_owned);
        scope.status.vm_status = Some(VirtualMachineState::Pending);
        let mut checkpoint = scope.status.clone();
        checkpoint.conditions = conditions::merge(
            &scope.current.conditions,
            &[
                Decided::failed(api::conditions::PAUSED, "NotPaused", ""),
                Decided::failed(
                    PROVISIONED,
                    "Cloning",
                    format!("cloning template {template_vmid} to VM {vmid} on {target}"),
                ),
            ],
            scope.generation,
            Timestamp::now(),
        );
        self.write_checkpoint(scope, checkpoint).await?;
        Ok(())
    }

    /// Requests the clone of `source` to VM `vmid` on `target`, and records its task.
    async fn request_clone(
        &self,
        scope: &mut Scope,
        proxmox: &ProxmoxClient,
        source: &TemplateChoice,
        vmid: u32,
        target: &str,
        cloning: &str,
    ) -> Flow<Infallible> {
        let params = self.clone_params(scope, source, vmid, target);
        let cloning = || cloning.to_owned();
        match proxmox.clone_vm(&source.node, source.vmid, &params).await {
            Ok(upid) => {
                // The task in flight: a restarted controller checks it instead of cloning
                // again (and the VMID recorded above finds the VM either way). Recorded now,
                // not at the end of the pass, so a failed write of the pass's status cannot
                // lose it.
                let step = self.submitted(
                    scope,
                    proxmox,
                    Ok(Some(upid.clone())),
                    TaskKind::Clone,
                    cloning,
                );
                if let Err(failed @ Stop::Failed(_)) = step {
                    return Err(failed);
                }
                let reporting = match &step {
                    Err(Stop::Wait(wait)) => Some(&wait.decided),
                    _ => None,
                };
                // No event yet: the condition names the clone while it runs, and its end is
                // announced with the task ("Cloned").
                self.write_task_record(scope, reporting).await?;
                Err(step.err().unwrap_or_else(|| {
                    waiting(
                        "Cloning",
                        cloning(),
                        Action::requeue(Duration::from_millis(100)),
                    )
                }))
            }
            Err(ProxmoxError::AlreadyExists { .. }) => {
                // Taken meanwhile by someone else: forget it and pick another next time.
                scope.status.virtual_machine_id = None;
                scope.recorded_vmid = None;
                self.context
                    .vms
                    .vmid_claims
                    .unclaim(vmid, &claim_key(self.machine));
                Err(waiting(
                    "VMIDTaken",
                    format!("VMID {vmid} was taken meanwhile; choosing another"),
                    Action::requeue(Duration::from_millis(200)),
                ))
            }
            Err(error) => Err(MachineError::ProxmoxStep {
                step: cloning(),
                source: error,
            }
            .into()),
        }
    }

    /// The template copy to clone and the node to clone to, with the task slots the clone needs. The template's copies (one, or
    /// one per node for node-local storage) decide which candidate nodes can receive a clone;
    /// the scheduler chooses among those only, and the chosen node clones its own copy, else a
    /// copy on shared storage. `Err`: the machine waits (no template, ambiguous, no node).
    pub(super) async fn clone_source(
        &self,
        scope: &Scope,
        placement: &Placement,
        proxmox: &ProxmoxClient,
        resources: &[ClusterResource],
    ) -> Flow<CloneChoice> {
        let with_storages = self
            .template_copies_for(scope, placement, proxmox, resources)
            .await?;
        // The storages of each copy whose config was read, for the task slots of its clones.
        let copy_storages: BTreeMap<(String, u32), Vec<String>> = with_storages
            .iter()
            .filter_map(|c| {
                let storages = c.storages.clone()?;
                Some(((c.template.node.clone(), c.template.vmid), storages))
            })
            .collect();
        let template_memory = with_storages.first().and_then(|c| {
            resources
                .iter()
                .find(|r| r.vmid == Some(c.template.vmid))
                .and_then(|r| r.maxmem)
        });
        let storages: Vec<StorageInfo> = resources
            .iter()
            .filter(|r| r.kind == ResourceType::Storage)
            .filter_map(|r| {
                Some(StorageInfo {
                    node: r.node.clone()?,
                    storage: r.storage.clone()?,
                    shared: r.shared,
                })
            })
            .collect();
        let sources = CloneSources::new(
            with_storages,
            &storages,
            self.machine.spec.storage.as_deref(),
        );

        let node = if placement.needs_scheduling() {
            let narrowed = match sources.narrow(placement) {
                Ok(narrowed) => narrowed,
                Err(error) => return Err(self.template_waiting(scope, &error).await),
            };
            let inventory = self.inventory(scope, proxmox, resources, &narrowed).await?;
            let request = ScheduleRequest::new(&narrowed, template_memory);
            let mut by_endpoint = self.context.vms.reservations.lock().await;
            let reservations = by_endpoint.of(proxmox.endpoint());
            reservations.release_visible(&inventory);
            match reservations.schedule_and_reserve(&narrowed, &inventory, &request) {
                Ok(choice) => Some(choice.node),
                Err(error) => {
                    return Err(waiting(
                        error.reason(),
                        error.to_string(),
                        Action::requeue(Duration::from_secs(30)),
                    ));
                }
            }
        } else {
            None
        };
        match sources.choose(node.as_deref()) {
            Ok(source) => {
                let target = node.unwrap_or_else(|| source.node.clone());
                // Where the clone writes: the storage asked for, else its copy's volumes'
                // (known when read; a copy serving its own node only is counted on the node).
                let writes_to = match &self.machine.spec.storage {
                    Some(storage) => vec![storage.clone()],
                    None => copy_storages
                        .get(&(source.node.clone(), source.vmid))
                        .cloned()
                        .unwrap_or_default(),
                };
                let wants = super::slots::clone_wants(
                    proxmox.endpoint(),
                    &source.node,
                    &target,
                    &writes_to,
                    &storages,
                    placement.task_limits(),
                );
                Ok(CloneChoice {
                    source,
                    target,
                    wants,
                })
            }
            Err(error) => Err(self.template_waiting(scope, &error).await),
        }
    }

    /// What the clone request asks of Proxmox, from the machine's spec.
    fn clone_params(
        &self,
        scope: &Scope,
        source: &TemplateChoice,
        vmid: u32,
        target: &str,
    ) -> CloneParams {
        let spec = &self.machine.spec;
        CloneParams {
            newid: vmid,
            name: Some(scope.name.clone()),
            description: spec.description.clone(),
            target: (target != source.node).then(|| target.to_owned()),
            full: Some(spec.full.unwrap_or(true)),
            storage: spec.storage.clone(),
            format: spec.format.map(|f| {
                serde_json::to_value(f)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_owned))
                    .unwrap_or_default()
            }),
            pool: spec.pool.clone(),
            snapname: spec.snap_name.clone(),
        }
    }

    /// The template's copies the machine may clone, each with the storages of its volumes
    /// when a candidate node has no copy of its own (only then do they matter).
    async fn template_copies_for(
        &self,
        scope: &Scope,
        placement: &Placement,
        proxmox: &ProxmoxClient,
        resources: &[ClusterResource],
    ) -> Flow<Vec<TemplateCopy>> {
        let templates = crate::controller::inventory::templates(resources);
        let copies = match template_copies(placement.template(), &templates) {
            Ok(copies) => copies,
            Err((reason, message)) => {
                return Err(self.template_refused(scope, reason, message).await);
            }
        };
        // Where the copies' volumes live matters only for a candidate node without a copy.
        let elsewhere = match placement.candidates() {
            NodeCandidates::Nodes(nodes) => {
                nodes.iter().any(|n| !copies.iter().any(|c| c.node == *n))
            }
            NodeCandidates::TemplateNode => false,
        };
        let mut with_storages = Vec::with_capacity(copies.len());
        for template in copies {
            let storages = if elsewhere {
                Some(
                    self.context
                        .inventory
                        .template_config(proxmox, &template.node, template.vmid)
                        .await?
                        .volume_storages(),
                )
            } else {
                None
            };
            with_storages.push(TemplateCopy { template, storages });
        }
        Ok(with_storages)
    }

    /// Waits on a template problem (checked again in a minute: templates are not watched),
    /// giving back any memory reserved for the machine.
    pub(super) async fn template_waiting(&self, scope: &Scope, error: &TemplateError) -> Stop {
        self.template_refused(scope, error.reason(), error.to_string())
            .await
    }

    async fn template_refused(&self, scope: &Scope, reason: &'static str, message: String) -> Stop {
        self.context.vms.release_reservation(&scope.name).await;
        waiting(reason, message, Action::requeue(Duration::from_secs(60)))
    }

    /// A VMID for the machine, claimed for it: the recorded one while no VM uses it, else the
    /// first free one of `spec.vmIDRange` or from Proxmox's `nextid` that no other machine holds.
    pub(super) async fn pick_vmid(
        &self,
        scope: &Scope,
        proxmox: &ProxmoxClient,
        resources: &[ClusterResource],
    ) -> Result<Picked, MachineError> {
        let claims = &self.context.vms.vmid_claims;
        claims.seed(|| self.recorded_vmids()).await?;
        let key = claim_key(self.machine);
        // Looked up once per candidate: a scan of the listing each would grow with the fleet.
        let listed: HashSet<u32> = resources.iter().filter_map(|r| r.vmid).collect();
        let used = |vmid: u32| listed.contains(&vmid);
        if let Some(recorded) = scope.recorded_vmid
            && !used(recorded)
            && claims.claim(recorded, &key)
        {
            // Not listed, but perhaps created: a clone requested just before a move or restore.
            return Ok(if vmid_free(proxmox, recorded).await? {
                Picked::Vmid(recorded)
            } else {
                Picked::Unlisted(recorded)
            });
        }
        // Proxmox names the lowest VMID without a VM (asked once a minute per endpoint); from
        // there, the first one neither listed (the listing is at most seconds old) nor held by
        // another machine is taken. A VM made meanwhile by someone else fails the clone with
        // "already exists", which makes the machine choose again.
        let candidates = match &self.machine.spec.vm_id_range {
            Some(range) => (range.start, range.end),
            None => {
                let (lowest, freshness) = self.context.inventory.lowest_free_vmid(proxmox).await?;
                if freshness == inventory::Freshness::JustAsked && claims.claim(lowest, &key) {
                    return Ok(Picked::Vmid(lowest));
                }
                (i64::from(lowest), i64::from(MAX_VMID))
            }
        };
        let (Ok(start), Ok(end)) = (
            u32::try_from(candidates.0.max(0)),
            u32::try_from(candidates.1.min(i64::from(u32::MAX))),
        ) else {
            return Ok(Picked::Exhausted);
        };
        Ok(claims
            .claim_first_free(start..=end, &key, used)
            .map_or(Picked::Exhausted, Picked::Vmid))
    }

    /// The VMIDs the ProxmoxMachines this controller watches have recorded, by machine, to
    /// seed the claims of a freshly started process.
    pub(super) async fn recorded_vmids(&self) -> Result<Vec<(String, u32)>, MachineError> {
        let machines = self
            .reads()
            .all::<ProxmoxMachine>(self.context.config.watch_namespace.as_deref())
            .await?;
        Ok(machines
            .iter()
            .flat_map(|m| {
                let status = m.status.as_ref().and_then(|s| s.virtual_machine_id);
                [status, m.spec.virtual_machine_id]
                    .into_iter()
                    .flatten()
                    .filter_map(|id| u32::try_from(id).ok())
                    .map(|vmid| (claim_key(m), vmid))
            })
            .collect())
    }

    /// Nodes with their memory, guests and this cluster's machines, for the scheduler.
    pub(super) async fn inventory(
        &self,
        scope: &Scope,
        proxmox: &ProxmoxClient,
        resources: &[ClusterResource],
        placement: &Placement,
    ) -> Flow<NodeInventory> {
        let pci_on_node = self.pci_devices(proxmox, placement).await?;
        let mut placed = self.placed_machines(scope, proxmox).await?;
        let mut guests_on_node: HashMap<&str, Vec<GuestInfo>> = HashMap::new();
        for guest in resources
            .iter()
            .filter(|g| matches!(g.kind, ResourceType::Qemu | ResourceType::Lxc))
        {
            let Some(node) = guest.node.as_deref() else {
                continue;
            };
            guests_on_node.entry(node).or_default().push(GuestInfo {
                vmid: guest.vmid.unwrap_or_default(),
                kind: if guest.kind == ResourceType::Lxc {
                    GuestKind::Lxc
                } else {
                    GuestKind::Qemu
                },
                max_memory_bytes: guest.maxmem.unwrap_or(0),
                template: guest.template,
            });
        }
        // An offline node takes no clone (and a zone with none online waits, saying so).
        let nodes = resources
            .iter()
            .filter(|r| r.kind == ResourceType::Node && r.status.as_deref() == Some("online"))
            .filter_map(|r| {
                let name = r.node.clone()?;
                Some(NodeInfo {
                    machines: placed.remove(name.as_str()).unwrap_or_default(),
                    pci: pci_on_node.on(&name),
                    local_storage_free: super::devices::local_storage_free(resources, &name),
                    guests: guests_on_node.remove(name.as_str()).unwrap_or_default(),
                    name,
                    total_memory_bytes: r.maxmem.unwrap_or(0),
                })
            })
            .collect();
        Ok(NodeInventory { nodes })
    }

    /// The cluster's other machines recorded on a node of this Proxmox, by node (a machine
    /// that has not recorded its endpoint yet counts wherever its node name matches), each with
    /// the owner and role of its CAPI Machine: one pass over the cluster's machines per clone.
    async fn placed_machines(
        &self,
        scope: &Scope,
        proxmox: &ProxmoxClient,
    ) -> Result<HashMap<String, Vec<PlacedMachine>>, MachineError> {
        let reads = self.reads();
        let machines = reads
            .cluster_machines_on(&scope.namespace, &scope.cluster_name, proxmox.endpoint())
            .await?;
        let on_nodes: Vec<(&str, &ProxmoxMachine, &str)> = machines
            .iter()
            .filter(|m| m.metadata.name.as_deref() != Some(scope.name.as_str()))
            .filter_map(|m| {
                let status = m.status.as_ref()?;
                let node = status.proxmox_node.as_deref()?;
                let here = status
                    .proxmox_endpoint
                    .as_deref()
                    .is_none_or(|endpoint| endpoint == proxmox.endpoint());
                let owner = m.owner_references().iter().find(|o| o.kind == "Machine")?;
                here.then_some((node, &**m, owner.name.as_str()))
            })
            .collect();
        let owner_names: Vec<&str> = on_nodes.iter().map(|(_, _, owner)| *owner).collect();
        let owners = reads
            .named::<capi::Machine>(
                &scope.namespace,
                &owner_names,
                (labels::CLUSTER_NAME, &scope.cluster_name),
            )
            .await?;
        // Keyed by the machines' own node names: a node's key is copied once, not per machine.
        let mut placed: HashMap<&str, Vec<PlacedMachine>> = HashMap::new();
        for ((node, machine, _), capi_machine) in on_nodes.into_iter().zip(owners) {
            if let Some(capi_machine) = capi_machine {
                placed
                    .entry(node)
                    .or_default()
                    .push(PlacedMachine::from_machine(
                        machine.name_any(),
                        &capi_machine,
                    ));
            }
        }
        Ok(placed
            .into_iter()
            .map(|(node, machines)| (node.to_owned(), machines))
            .collect())
    }
}

/// The copies of the template `source` names among the listed `templates`, or why none may be
/// cloned (a condition reason and message). Only a VM Proxmox flags as a template is cloned:
/// any other VMID (another tenant's VM, say) would be copied, disks and all, and booted with
/// this machine's user data.
pub(super) fn template_copies(
    source: &TemplateSource,
    templates: &[TemplateInfo],
) -> Result<Vec<TemplateInfo>, (&'static str, String)> {
    let copies = match source {
        TemplateSource::Id { vmid, node } => {
            let listed = u32::try_from(*vmid)
                .ok()
                .and_then(|vmid| templates.iter().find(|t| t.vmid == vmid && t.node == *node))
                .ok_or_else(|| {
                    (
                        "TemplateNotFound",
                        format!(
                            "VM {vmid} on {node} is not a template (or Proxmox does not list it); set spec.templateID and spec.sourceNode to a VM template, or use spec.templateSelector"
                        ),
                    )
                })?;
            vec![TemplateInfo {
                name: Some(listed.name.clone())
                    .filter(|n| !n.is_empty())
                    .unwrap_or_else(|| listed.vmid.to_string()),
                ..listed.clone()
            }]
        }
        TemplateSource::Tags(selector) => placement::select_template(selector, templates)
            .map_err(|error| (error.reason(), error.to_string()))?,
    };
    // A clone inherits its template's tags: one carrying a machine's tag would look like that
    // machine's VM, which no other machine adopts.
    if let Some(tagged) = copies
        .iter()
        .find(|c| c.tags.iter().any(|t| is_machine_tag(t)))
    {
        let tags: Vec<&str> = tagged
            .tags
            .iter()
            .filter(|t| is_machine_tag(t))
            .map(String::as_str)
            .collect();
        return Err((
            "InvalidTemplate",
            format!(
                "VM template {} (VMID {}) on {} carries the capmox machine tag {}; remove it from the template",
                tagged.name,
                tagged.vmid,
                tagged.node,
                tags.join(", ")
            ),
        ));
    }
    Ok(copies)
}

/// Whether Proxmox calls `vmid` free (`/cluster/nextid?vmid=`): a used or invalid one is not.
pub(super) async fn vmid_free(proxmox: &ProxmoxClient, vmid: u32) -> Result<bool, MachineError> {
    match proxmox.next_id(Some(vmid)).await {
        Ok(_) => Ok(true),
        Err(ProxmoxError::InvalidParameters { .. }) | Err(ProxmoxError::AlreadyExists { .. }) => {
            Ok(false)
        }
        Err(error) => Err(error.into()),
    }
}

/// Whether `tag` has the shape of a [`machine_tag`] (a user's `capmox-prod` does not): such a
/// tag says the VM is some machine's.
pub(super) fn is_machine_tag(tag: &str) -> bool {
    tag.to_ascii_lowercase()
        .strip_prefix(MACHINE_TAG_PREFIX)
        .is_some_and(|id| id.len() == 16 && id.chars().all(|c| c.is_ascii_alphanumeric()))
}

/// The VMs (not templates) Proxmox lists.
pub(super) fn vms(resources: &[ClusterResource]) -> impl Iterator<Item = &ClusterResource> + Clone {
    resources
        .iter()
        .filter(|r| r.kind == ResourceType::Qemu && !r.template)
}

/// What ties a VM to a machine. The tag (from the UID) is lost when `clusterctl move` or a
/// restore re-creates the machine; its name, `spec.virtualMachineID` and `spec.providerID` (the
/// VM's SMBIOS UUID) are not. A VM named after the machine is also its machine's when its
/// SMBIOS UUID is the one `spec.providerID` names, or (without a provider ID) when it carries
/// no machine tag at all and its VMID is the one in the spec: a clone of this machine in
/// flight, since the VMID goes into the spec before the clone is requested and the tag only
/// after the provider ID is recorded. The spec alone never claims a VM that carries another
/// machine's tag: anyone who may write a ProxmoxMachine can write its spec.
pub(super) struct Identity<'a> {
    tag: String,
    name: &'a str,
    spec_vmid: Option<u32>,
    uuid: Option<&'a str>,
}

impl<'a> Identity<'a> {
    pub(super) fn of(machine: &'a ProxmoxMachine, name: &'a str) -> Self {
        Identity {
            tag: machine_tag(machine),
            name,
            spec_vmid: machine
                .spec
                .virtual_machine_id
                .and_then(|id| u32::try_from(id).ok()),
            uuid: machine
                .spec
                .provider_id
                .as_deref()
                .and_then(|id| id.strip_prefix(PROVIDER_ID_PREFIX)),
        }
    }

    /// Whether `tags` hold this machine's tag.
    pub(super) fn tagged(&self, tags: &[String]) -> bool {
        tags.iter().any(|t| t.eq_ignore_ascii_case(&self.tag))
    }

    /// Whether the VM `vmid` with this config is the machine's.
    pub(super) fn owns(&self, config: &VmConfig, vmid: u32) -> bool {
        let tags = config.tags();
        if self.tagged(&tags) {
            return true;
        }
        if config.name().as_deref() != Some(self.name) {
            return false;
        }
        if let Some(uuid) = self.uuid {
            return smbios_uuid(config).is_some_and(|u| u.eq_ignore_ascii_case(uuid));
        }
        !tags.iter().any(|t| is_machine_tag(t)) && self.spec_vmid == Some(vmid)
    }

    /// Whether the listing alone shows the VM to be the one this controller recorded in the
    /// machine's status (VMID and node) and spec (VMID), as its config would: named after the
    /// machine and without any machine's tag (the listing may predate this machine's tag). A
    /// status does not survive a move or restore, so an adopted VM is still checked by its
    /// config.
    pub(super) fn listed_as_recorded(
        &self,
        vm: &ClusterResource,
        status: &ProxmoxMachineStatus,
    ) -> bool {
        status
            .virtual_machine_id
            .is_some_and(|id| Some(id) == vm.vmid.map(i64::from))
            && status.proxmox_node.is_some()
            && vm.node == status.proxmox_node
            && vm.name.as_deref() == Some(self.name)
            && self.spec_vmid == vm.vmid
            && !vm.tags.iter().any(|t| is_machine_tag(t))
    }

    /// The listed VM `vm` as it is now, if it is the machine's (its config is read unless its
    /// tag says so). A VM gone from the node it was listed on has moved since the listing (a
    /// clone to another node ends by moving the VM to its target): it is looked up again, not
    /// taken for someone else's.
    pub(super) async fn owned_listed(
        &self,
        proxmox: &ProxmoxClient,
        configs: &PassConfigs,
        vm: &ClusterResource,
    ) -> Result<Option<ClusterResource>, MachineError> {
        if self.tagged(&vm.tags) {
            return Ok(Some(vm.clone()));
        }
        let (Some(node), Some(vmid)) = (vm.node.as_deref(), vm.vmid) else {
            return Ok(None);
        };
        let read = |node: String| async move {
            match configs.read(proxmox, &node, vmid).await {
                Ok(config) => Ok(Some(config)),
                Err(error) if error.is_not_found() => Ok(None),
                Err(error) => {
                    Err(error).during(|| format!("reading the config of VM {vmid} on {node}"))
                }
            }
        };
        let (vm, config) = match read(node.to_owned()).await? {
            Some(config) => (vm.clone(), config),
            None => {
                let moved = proxmox
                    .find_vm(vmid)
                    .await
                    .during(|| format!("looking for VM {vmid}, gone from {node}"))?
                    .filter(|r| r.node.as_deref().is_some_and(|n| n != node));
                let Some(moved) = moved else {
                    return Ok(None);
                };
                match read(moved.node.clone().unwrap_or_default()).await? {
                    Some(config) => (moved, config),
                    None => return Ok(None),
                }
            }
        };
        Ok(self.owns(&config, vmid).then_some(vm))
    }

    /// The machine's VM when the recorded VMID (`skip`) does not name it: the listed VM with
    /// this machine's tag, else the one named after the machine whose SMBIOS UUID
    /// `spec.providerID` names.
    pub(super) async fn search(
        &self,
        proxmox: &ProxmoxClient,
        configs: &PassConfigs,
        resources: &[ClusterResource],
        skip: Option<u32>,
    ) -> Result<Option<ClusterResource>, MachineError> {
        let candidates = vms(resources).filter(|r| r.vmid.is_some() && r.vmid != skip);
        if let Some(vm) = candidates.clone().find(|r| self.tagged(&r.tags)) {
            return Ok(Some(vm.clone()));
        }
        if self.uuid.is_none() {
            return Ok(None);
        }
        for vm in candidates.filter(|r| r.name.as_deref() == Some(self.name)) {
            if let Some(vm) = self.owned_listed(proxmox, configs, vm).await? {
                return Ok(Some(vm));
            }
        }
        Ok(None)
    }
}

/// VM configs read in one pass, so a pass reads each at most once (and again only after it
/// changed it).
#[derive(Default)]
pub(super) struct PassConfigs(std::sync::Mutex<BTreeMap<(String, u32), VmConfig>>);

impl PassConfigs {
    pub(super) async fn read(
        &self,
        proxmox: &ProxmoxClient,
        node: &str,
        vmid: u32,
    ) -> Result<VmConfig, ProxmoxError> {
        let key = (node.to_owned(), vmid);
        if let Some(config) = self.lock().get(&key) {
            return Ok(config.clone());
        }
        let config = proxmox.vm_config(node, vmid).await?;
        self.lock().insert(key, config.clone());
        Ok(config)
    }

    /// Forgets what was read of a config this pass changed.
    pub(super) fn changed(&self, node: &str, vmid: u32) {
        self.lock().remove(&(node.to_owned(), vmid));
    }

    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<(String, u32), VmConfig>> {
        // Every update is a single insert or remove: a poisoned lock holds a usable map.
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// The VMID [`Reconcile::pick_vmid`] chose.
pub(super) enum Picked {
    /// Free, and claimed for the machine.
    Vmid(u32),
    /// The recorded VMID, in use in Proxmox but not listed yet.
    Unlisted(u32),
    /// None is free.
    Exhausted,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn machine(uid: &str, vmid: Option<i64>) -> ProxmoxMachine {
        let mut machine = ProxmoxMachine::new("web-1", Default::default());
        machine.metadata.uid = Some(uid.into());
        machine.spec.virtual_machine_id = vmid;
        machine
    }

    fn config(name: &str, tags: &str, uuid: &str) -> VmConfig {
        serde_json::from_value(json!({
            "name": name, "tags": tags, "smbios1": format!("uuid={uuid}")
        }))
        .expect("config")
    }

    const UUID: &str = "5a4c8f3e-0000-4000-8000-000000000001";

    /// Another tenant's machine of the same name whose spec names this VM's VMID does not own
    /// it: the spec is anyone's to write, the tag and the SMBIOS UUID are not.
    #[test]
    fn the_spec_vmid_never_claims_a_vm_that_carries_another_machines_tag() {
        let owner = machine("aaaaaaaa-1111-2222-3333-444444444444", Some(100));
        let owner_tag = machine_tag(&owner);
        let vm = config("web-1", &format!("{owner_tag};prod"), UUID);
        assert!(Identity::of(&owner, "web-1").owns(&vm, 100));

        let intruder = machine("bbbbbbbb-1111-2222-3333-444444444444", Some(100));
        assert!(!Identity::of(&intruder, "web-1").owns(&vm, 100));

        // A move or restore (new UID) is recognised by the SMBIOS UUID its spec recorded.
        let mut moved = machine("cccccccc-1111-2222-3333-444444444444", Some(100));
        moved.spec.provider_id = Some(format!("proxmox://{UUID}"));
        assert!(Identity::of(&moved, "web-1").owns(&vm, 100));

        // A clone in flight has no tag yet: the VMID its spec recorded before the clone.
        let untagged = config("web-1", "prod", UUID);
        assert!(Identity::of(&intruder, "web-1").owns(&untagged, 100));
        assert!(!Identity::of(&intruder, "web-1").owns(&untagged, 101));
        assert!(!Identity::of(&machine("dddddddd-1111", None), "web-1").owns(&untagged, 100));
    }

    fn template(vmid: u32, node: &str, tags: &[&str]) -> TemplateInfo {
        TemplateInfo {
            node: node.into(),
            vmid,
            name: format!("t{vmid}"),
            tags: tags.iter().map(|t| (*t).to_owned()).collect(),
        }
    }

    #[test]
    fn only_a_listed_template_is_cloned_by_its_id() {
        let templates = [template(9000, "pve1", &["ubuntu"])];
        let by_id = |vmid: i32, node: &str| TemplateSource::Id {
            vmid,
            node: node.into(),
        };
        let copies = template_copies(&by_id(9000, "pve1"), &templates).expect("a template");
        assert_eq!(copies, [template(9000, "pve1", &["ubuntu"])]);
        let (reason, message) =
            template_copies(&by_id(100, "pve1"), &templates).expect_err("VM 100 is no template");
        assert_eq!(reason, "TemplateNotFound");
        assert!(
            message.starts_with("VM 100 on pve1 is not a template"),
            "{message}"
        );
        assert!(template_copies(&by_id(9000, "pve2"), &templates).is_err());

        let tagged = [template(9001, "pve1", &["capmox-3f2c9c8e1b2a4d6e"])];
        let (reason, message) = template_copies(&by_id(9001, "pve1"), &tagged)
            .expect_err("a template with a machine tag");
        assert_eq!(reason, "InvalidTemplate");
        assert!(message.contains("capmox-3f2c9c8e1b2a4d6e"), "{message}");
    }
}
