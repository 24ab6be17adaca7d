//! One pass over a machine: observe what the caches hold, then ask [`decide`] for the next step
//! until the pass ends, taking each look and effect it names, and hand the end to the status
//! writer. Failures of a step become what the machine reports, with their back-off.

use std::sync::Arc;
use std::time::Duration;

use kube::runtime::controller::Action;
use kube::{Api, ResourceExt};

use super::decide::{Effect, End, Next, Observed, decide};
use super::looks::Held;
use super::outcome::{Stop, Wait};
use super::{MachineError, PROVISIONED, Reconcile, Scope};
use crate::api::{
    self, Initialization, ProxmoxCluster, ProxmoxMachineStatus, annotations, finalizers, labels,
};
use crate::capi;
use crate::controller::conditions::{self, Decided};
use crate::controller::failures::Pass;
use crate::placement::Placement;
use crate::proxmox::ProxmoxError;

/// How often a provisioned machine is looked at when nothing wakes it.
const PROVISIONED_RESYNC: Duration = Duration::from_secs(600);

/// What the caches hold for a pass: the machine's CAPI Machine and Cluster and its
/// ProxmoxCluster (each `None` when not found), shared with the caches rather than copied for
/// every pass.
struct Cached {
    owner: Option<String>,
    capi_machine: Option<Arc<capi::Machine>>,
    capi_cluster: Option<Arc<capi::Cluster>>,
    proxmox_cluster: Option<Arc<ProxmoxCluster>>,
    cluster_name: String,
    infra_name: String,
}

impl Reconcile<'_> {
    pub(super) async fn pass(&self) -> Result<Pass, MachineError> {
        let cached = self.cached().await?;
        let (mut scope, mut observed, mut held) = self.observe(cached)?;
        let end = loop {
            let next = decide(&mut observed);
            let tidying = matches!(next, Next::Do(Effect::Phase(p)) if p.tidies_up());
            let step = match next {
                Next::End(end) => break end,
                Next::Look(look) => self.look(look, &mut scope, &mut observed, &mut held).await,
                Next::Do(effect) => self.act(effect, &mut scope, &mut observed, &mut held).await,
            };
            match step {
                Ok(()) => {}
                Err(Stop::Wait(wait)) => break End::Waiting(wait),
                Err(Stop::Failed(error)) => {
                    break End::Waiting(self.failed(&mut scope, error, tidying).await?);
                }
            }
        };
        tracing::debug!(
            machine = %scope.name,
            ended = match &end {
                End::Quietly(_) => "quietly",
                End::Waiting(wait) => wait.decided.reason.as_str(),
                End::Provisioned => "provisioned",
                End::Paused => "paused",
            },
            "pass ended"
        );
        self.finish(&mut scope, end).await
    }

    /// The objects the pass works from, from the caches: a machine being deleted goes on
    /// without its CAPI Machine or Cluster (they may be gone first).
    async fn cached(&self) -> Result<Cached, MachineError> {
        let namespace = self
            .machine
            .namespace()
            .ok_or(MachineError::MissingIdentity)?;
        let owner = self
            .machine
            .owner_references()
            .iter()
            .find(|o| {
                o.kind == "Machine"
                    && o.api_version
                        .starts_with(&format!("{}/", capi::CLUSTER_API_GROUP))
            })
            .map(|o| o.name.clone());
        let reads = self.reads();
        let capi_machine = match &owner {
            Some(owner) => reads.get::<capi::Machine>(&namespace, owner).await?,
            None => None,
        };
        let cluster_name = match capi_machine.as_deref() {
            Some(machine) if !machine.spec.cluster_name.is_empty() => {
                machine.spec.cluster_name.clone()
            }
            _ => self
                .machine
                .labels()
                .get(labels::CLUSTER_NAME)
                .cloned()
                .unwrap_or_default(),
        };
        let capi_cluster = match cluster_name.as_str() {
            "" => None,
            name => reads.get::<capi::Cluster>(&namespace, name).await?,
        };
        let infra_name = capi_cluster
            .as_ref()
            .and_then(|c| c.spec.infrastructure_ref.as_ref())
            .map_or_else(|| cluster_name.clone(), |r| r.name.clone());
        let proxmox_cluster = match infra_name.as_str() {
            "" => None,
            name => reads.get::<ProxmoxCluster>(&namespace, name).await?,
        };
        Ok(Cached {
            owner,
            capi_machine,
            capi_cluster,
            proxmox_cluster,
            cluster_name,
            infra_name,
        })
    }

    /// The pass's scope and what it knows before it looks at anything else.
    fn observe(&self, cached: Cached) -> Result<(Scope, Observed, Held), MachineError> {
        let namespace = self
            .machine
            .namespace()
            .ok_or(MachineError::MissingIdentity)?;
        let name = self
            .machine
            .metadata
            .name
            .clone()
            .ok_or(MachineError::MissingIdentity)?;
        let current = self.machine.status.clone().unwrap_or_default();
        let finalizer = self
            .machine
            .finalizers()
            .iter()
            .any(|f| f == finalizers::MACHINE);
        let recorded_vmid = current
            .virtual_machine_id
            .or(self.machine.spec.virtual_machine_id)
            .and_then(|id| u32::try_from(id).ok());
        let mut observed = self.observed(&cached, &current, finalizer, recorded_vmid.is_some());
        let scope = Scope {
            // Only a machine being deleted goes on without its CAPI Machine (decide ends the
            // pass of any other).
            capi_machine: cached.capi_machine.unwrap_or_else(|| {
                Arc::new(capi::Machine::new(
                    cached.owner.as_deref().unwrap_or(&name),
                    Default::default(),
                ))
            }),
            api: Api::namespaced(self.context.client.clone(), &namespace),
            namespace,
            name,
            cluster_name: cached.cluster_name,
            proxmox_cluster: cached.proxmox_cluster.unwrap_or_else(|| {
                Arc::new(ProxmoxCluster::new(&cached.infra_name, Default::default()))
            }),
            status: current.clone(),
            current,
            // Fresh: the machine already carried the finalizer, so the checkpoint before a
            // clone is guarded by its resourceVersion (else the guarded finalizer patch proves
            // it fresh).
            resource_version: finalizer
                .then(|| self.machine.metadata.resource_version.clone())
                .flatten(),
            recorded_vmid,
            generation: self.machine.metadata.generation,
            finished: None,
        };
        let mut held = Held::default();
        if !observed.deleting && observed.capi_machine {
            match self.placement(&scope) {
                Ok(placement) => held.placement = Some(placement),
                Err(refused) => observed.placement = Some(refused),
            }
        }
        Ok((scope, observed, held))
    }

    /// What the pass knows from the machine and the caches alone.
    fn observed(
        &self,
        cached: &Cached,
        current: &ProxmoxMachineStatus,
        finalizer: bool,
        vmid_recorded: bool,
    ) -> Observed {
        let capi_cluster = cached.capi_cluster.as_ref();
        let paused = capi_cluster.is_some_and(|c| {
            c.spec.paused == Some(true) || c.annotations().contains_key(annotations::PAUSED)
        }) || self.machine.annotations().contains_key(annotations::PAUSED);
        let in_line = kube::runtime::reflector::ObjectRef::from_obj(self.machine);
        Observed {
            deleting: self.machine.metadata.deletion_timestamp.is_some(),
            owned: cached.owner.is_some(),
            capi_machine: cached.capi_machine.is_some(),
            capi_cluster: capi_cluster.is_some(),
            paused,
            paused_reported: conditions::is_true(&current.conditions, api::conditions::PAUSED),
            cluster_found: cached.proxmox_cluster.is_some(),
            infrastructure_provisioned: capi_cluster
                .and_then(|c| c.status.as_ref())
                .and_then(|s| s.initialization.as_ref())
                .and_then(|i| i.infrastructure_provisioned)
                == Some(true),
            bootstrap_data: cached
                .capi_machine
                .as_ref()
                .and_then(|m| m.spec.bootstrap.as_ref())
                .is_some_and(|b| b.data_secret_name.is_some()),
            provisioned: Initialization::provisioned(current.initialization.as_ref()),
            vmid_recorded,
            named_by_spec: self.machine.spec.provider_id.is_some(),
            finalizer,
            in_line: self.context.task_slots.is_waiting(&in_line),
            held_in_line: self.context.task_slots.holds_back(&in_line),
            ..Observed::default()
        }
    }

    /// Where the machine is placed, or why it cannot be (retried when the ProxmoxCluster or the
    /// Machine changes; both are watched).
    pub(super) fn placement(&self, scope: &Scope) -> Result<Placement, Wait> {
        Placement::resolve(&scope.proxmox_cluster, self.machine, &scope.capi_machine)
            .map_err(|error| super::decide::misconfigured(error.reason(), error.to_string()))
    }

    /// What a failed step makes the machine report: a failed task its own back-off (recorded
    /// in status); any other Proxmox failure its reason and the machine's back-off. Failures
    /// that are not Proxmox's end the reconcile (retried with its own back-off).
    async fn failed(
        &self,
        scope: &mut Scope,
        error: MachineError,
        tidying: bool,
    ) -> Result<Wait, MachineError> {
        let deleting = self.machine.metadata.deletion_timestamp.is_some();
        let Some((proxmox, step)) = error.proxmox() else {
            return Err(error);
        };
        if let (ProxmoxError::TaskFailed { upid, exitstatus }, false) =
            (proxmox, deleting || tidying)
        {
            return Ok(self.record_task_failure(scope, upid, exitstatus).await);
        }
        let (described, action) = self.proxmox_failure(scope, step, proxmox).await;
        // The machine stays provisioned while its seed ISO's removal is retried; the seed ISO
        // left behind (it holds the bootstrap token) is reported by a Warning event.
        let decided = if tidying {
            Decided::ok(PROVISIONED, "Provisioned", "")
        } else {
            Decided::failed(PROVISIONED, described.reason, described.message)
        };
        Ok(Wait {
            decided,
            action,
            backoff: true,
        })
    }

    /// The status writer: the pass's status with its conditions, written once, at the end.
    async fn finish(&self, scope: &mut Scope, end: End) -> Result<Pass, MachineError> {
        let wait = match end {
            End::Quietly(action) => return Ok(Pass::Done(action)),
            End::Paused => {
                self.report_paused(scope).await?;
                return Ok(Pass::Done(Action::await_change()));
            }
            End::Waiting(wait) => wait,
            End::Provisioned => Wait {
                decided: Decided::ok(PROVISIONED, "Provisioned", ""),
                action: Action::requeue(PROVISIONED_RESYNC),
                backoff: false,
            },
        };
        scope.status.conditions = reported_conditions(scope, wait.decided);
        self.write_status(&scope.api, &scope.name, &scope.current, &scope.status)
            .await?;
        Ok(if wait.backoff {
            Pass::BackingOff(wait.action)
        } else {
            Pass::Done(wait.action)
        })
    }
}

/// The conditions a pass that ends with `decided` reports: not paused, and what it decided.
pub(super) fn reported_conditions(
    scope: &Scope,
    decided: Decided,
) -> Vec<k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition> {
    conditions::merge(
        &scope.current.conditions,
        &[
            Decided::failed(api::conditions::PAUSED, "NotPaused", ""),
            decided,
        ],
        scope.generation,
        k8s_openapi::jiff::Timestamp::now(),
    )
}
