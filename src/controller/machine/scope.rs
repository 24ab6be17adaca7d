//! Loading a pass's scope (CAPI Machine, Cluster, ProxmoxCluster) from the caches, pause,
//! and the dispatch to provisioning or deletion with the outcome written to status.

use super::*;

impl Reconcile<'_> {
    pub(super) async fn pass(&self) -> Result<Pass, MachineError> {
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
        let api: Api<ProxmoxMachine> = Api::namespaced(self.context.client.clone(), &namespace);
        let current = self.machine.status.clone().unwrap_or_default();

        // A machine being deleted goes on without its CAPI Machine or Cluster (they may be gone
        // first): what it recorded finds its VM, and nothing is released while one may exist.
        let deleting = self.machine.metadata.deletion_timestamp.is_some();
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
        if owner.is_none() && !deleting {
            tracing::debug!(machine = %name, "waiting for the CAPI Machine to set the owner reference");
            return Ok(Pass::Done(Action::await_change()));
        }
        let reads = self.reads();
        let capi_machine = match &owner {
            Some(owner) => reads
                .get::<capi::Machine>(&namespace, owner)
                .await?
                .map(Arc::unwrap_or_clone),
            None => None,
        };
        if capi_machine.is_none() && !deleting {
            return Ok(Pass::Done(Action::requeue(Duration::from_secs(2))));
        }
        let cluster_name = match capi_machine.as_ref() {
            Some(capi_machine) if !capi_machine.spec.cluster_name.is_empty() => {
                capi_machine.spec.cluster_name.clone()
            }
            _ => self
                .machine
                .labels()
                .get(labels::CLUSTER_NAME)
                .cloned()
                .unwrap_or_default(),
        };
        let capi_cluster = if cluster_name.is_empty() {
            None
        } else {
            reads
                .get::<capi::Cluster>(&namespace, &cluster_name)
                .await?
                .map(Arc::unwrap_or_clone)
        };
        if capi_cluster.is_none() && !deleting {
            return Ok(Pass::Done(Action::requeue(Duration::from_secs(2))));
        }
        let infra_name = capi_cluster
            .as_ref()
            .and_then(|c| c.spec.infrastructure_ref.as_ref())
            .map(|r| r.name.clone())
            .unwrap_or_else(|| cluster_name.clone());
        let proxmox_cluster = if infra_name.is_empty() {
            None
        } else {
            reads
                .get::<ProxmoxCluster>(&namespace, &infra_name)
                .await?
                .map(Arc::unwrap_or_clone)
        };

        let paused = capi_cluster.as_ref().is_some_and(|c| {
            c.spec.paused == Some(true) || c.annotations().contains_key(annotations::PAUSED)
        }) || self.machine.annotations().contains_key(annotations::PAUSED);
        if paused {
            if !conditions::is_true(&current.conditions, api::conditions::PAUSED) {
                let mut status = owned_status(&current);
                status.conditions = paused_conditions(&current, self.machine.metadata.generation);
                self.write_status(&api, &name, &current, &status).await?;
            }
            return Ok(Pass::Done(Action::await_change()));
        }

        let recorded_vmid = current
            .virtual_machine_id
            .or(self.machine.spec.virtual_machine_id)
            .and_then(|id| u32::try_from(id).ok());
        let mut scope = Scope {
            // Only a machine being deleted goes on without its CAPI Machine (checked above).
            capi_machine: capi_machine.unwrap_or_else(|| {
                capi::Machine::new(owner.as_deref().unwrap_or(&name), Default::default())
            }),
            namespace,
            name,
            api,
            cluster_name,
            proxmox_cluster: proxmox_cluster
                .clone()
                .unwrap_or_else(|| ProxmoxCluster::new(&infra_name, Default::default())),
            status: owned_status(&current),
            current,
            resource_version: None,
            recorded_vmid,
            generation: self.machine.metadata.generation,
            finished: None,
        };

        if deleting {
            return match self.delete(&mut scope, proxmox_cluster.is_some()).await {
                Ok(action) => Ok(Pass::Done(action)),
                Err(error) => {
                    let Some((proxmox, step)) = error.proxmox() else {
                        return Err(error);
                    };
                    let (described, action) = self.proxmox_failure(&scope, step, proxmox).await;
                    self.deleting_status(&mut scope, described.reason, described.message)
                        .await?;
                    Ok(Pass::BackingOff(action))
                }
            };
        }
        let Some(capi_cluster) = capi_cluster else {
            // Only a machine being deleted goes on without its CAPI Cluster (checked above).
            return Ok(Pass::Done(Action::requeue(Duration::from_secs(2))));
        };
        let step = match self
            .provision(&mut scope, proxmox_cluster.is_some(), &capi_cluster)
            .await
        {
            Ok(step) => step,
            Err(error) => match error.proxmox() {
                // Any awaited task that failed (clone, config, resize, upload, start): its own
                // back-off, recorded in status.
                Some((ProxmoxError::TaskFailed { upid, exitstatus }, _)) => {
                    self.record_task_failure(&mut scope, upid, exitstatus).await
                }
                // Any other Proxmox failure (locks included): reported, and backed off.
                Some((proxmox, step)) => {
                    let (described, action) = self.proxmox_failure(&scope, step, proxmox).await;
                    Step::Backoff(
                        Decided::failed(PROVISIONED, described.reason, described.message),
                        action,
                    )
                }
                None => return Err(error),
            },
        };
        let (decided, action, backing_off) = match step {
            Step::Continue => (
                Decided::ok(PROVISIONED, "Provisioned", ""),
                Action::requeue(Duration::from_secs(600)),
                false,
            ),
            Step::Stop(decided, action) => (decided, action, false),
            Step::Backoff(decided, action) => (decided, action, true),
        };
        let decided = [
            Decided::failed(api::conditions::PAUSED, "NotPaused", ""),
            decided,
        ];
        scope.status.conditions = conditions::merge(
            &scope.current.conditions,
            &decided,
            scope.generation,
            Timestamp::now(),
        );
        self.write_status(&scope.api, &scope.name, &scope.current, &scope.status)
            .await?;
        Ok(if backing_off {
            Pass::BackingOff(action)
        } else {
            Pass::Done(action)
        })
    }
}
