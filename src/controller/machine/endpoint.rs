//! Which Proxmox a machine works with, and whether it may be trusted with the machine's VM: the
//! one the VM was recorded on while some credentials of its cluster still reach it, else its
//! zone's (or, for a deletion without its ProxmoxCluster, capmox's global credentials').

use std::time::Duration;

use kube::ResourceExt;

use super::decide::{misconfigured, unreachable};
use super::outcome::{Flow, Stop, wait};
use super::vm::{self, Identity};
use super::{During, MachineError, Reconcile, Scope, claim_key};
use crate::api::{self, finalizers};
use crate::controller::credentials::{self, CredentialsError};
use crate::placement;
use crate::proxmox::{ClusterResource, ProxmoxClient};

/// Reason of `VirtualMachineProvisioned` (and of the deletion's wait) while the machine's VM
/// is on a Proxmox its cluster's credentials no longer reach.
pub(super) const ENDPOINT_CHANGED: &str = "ProxmoxEndpointChanged";
/// How soon a deletion without credentials for its VM looks again.
const NO_CREDENTIALS_RECHECK: Duration = Duration::from_secs(60);

/// The Proxmox a pass works with.
pub(super) struct MachineProxmox {
    pub proxmox: ProxmoxClient,
    /// Set when the VM was recorded on another Proxmox (this URL) that none of the cluster's
    /// credentials reach any more: the pass may go on only once it finds the VM here.
    pub moved_from: Option<String>,
}

impl MachineProxmox {
    fn as_resolved(proxmox: ProxmoxClient) -> Self {
        Self {
            proxmox,
            moved_from: None,
        }
    }
}

/// A client for some credentials, or why there is none.
enum Reach {
    Client(ProxmoxClient),
    Unreachable(String),
}

impl Reach {
    fn client(&self) -> Option<&ProxmoxClient> {
        match self {
            Self::Client(client) => Some(client),
            Self::Unreachable(_) => None,
        }
    }
}

impl Reconcile<'_> {
    /// The Proxmox the machine works with: the one its VM was recorded on while some
    /// credentials of its cluster still reach it, else its zone's (`zone_credentials`: the
    /// zone's own `credentialsRef`, `None` for the cluster's credentials).
    pub(super) async fn proxmox_client(
        &self,
        scope: &Scope,
        zone_credentials: Option<&api::SecretReference>,
    ) -> Flow<MachineProxmox> {
        let zone = self.client_for(scope, zone_credentials).await?;
        let Some(recorded) = self.recorded_endpoint(scope) else {
            return reached(zone).map(MachineProxmox::as_resolved);
        };
        if let Some(proxmox) = zone.client()
            && proxmox.endpoint() == recorded
        {
            return Ok(MachineProxmox::as_resolved(proxmox.clone()));
        }
        // The zone's credentials changed since: another of the cluster's may still reach the
        // Proxmox the VM lives on.
        let mut others: Vec<Option<&api::SecretReference>> = vec![None];
        others.extend(
            placement::zone_credentials(&scope.proxmox_cluster)
                .into_iter()
                .map(Some),
        );
        for reference in others.into_iter().filter(|r| *r != zone_credentials) {
            if let Reach::Client(proxmox) = self.client_for(scope, reference).await?
                && proxmox.endpoint() == recorded
            {
                return Ok(MachineProxmox::as_resolved(proxmox));
            }
        }
        reached(zone).map(|proxmox| MachineProxmox {
            proxmox,
            moved_from: Some(recorded.to_owned()),
        })
    }

    /// Whether the machine may have a VM: nothing recorded means no clone was ever requested
    /// (the VMID is recorded first).
    pub(super) fn may_have_vm(&self, scope: &Scope) -> bool {
        scope.recorded_vmid.is_some() || self.machine.spec.provider_id.is_some()
    }

    /// The Proxmox endpoint the machine's VM was created on, while it may have one.
    fn recorded_endpoint<'s>(&self, scope: &'s Scope) -> Option<&'s str> {
        scope
            .current
            .proxmox_endpoint
            .as_deref()
            .filter(|_| self.may_have_vm(scope))
    }

    /// Goes on when `endpoint` may be trusted with the machine: it is the Proxmox its VM was
    /// recorded on, or it has the VM (the same Proxmox cluster under another URL). Otherwise
    /// the machine waits and says so (with a Warning event once): nothing happens, least of
    /// all a second VM.
    pub(super) async fn untrusted(&self, scope: &Scope, endpoint: &MachineProxmox) -> Flow {
        let (Some(recorded), proxmox) = (&endpoint.moved_from, &endpoint.proxmox) else {
            return Ok(());
        };
        let resources = self
            .context
            .inventory
            .resources(proxmox, Some(&claim_key(self.machine)))
            .await
            .during(|| "listing Proxmox's VMs and nodes".to_owned())?;
        if self.vm_is_on(scope, proxmox, &resources).await? {
            tracing::info!(machine = %scope.name, from = %recorded, to = %proxmox.endpoint(), "the machine's VM is reached through another URL of its Proxmox now");
            return Ok(());
        }
        let message = format!(
            "{} was created on the Proxmox at {recorded}, but no credentials of ProxmoxCluster {} reach it now (its zone's reach {}, which does not have the VM); give the zone credentials for {recorded} again. capmox neither creates a second VM nor releases this machine meanwhile",
            self.recorded_vm(scope),
            scope.proxmox_cluster.name_any(),
            proxmox.endpoint()
        );
        tracing::warn!(machine = %scope.name, reason = ENDPOINT_CHANGED, "{message}");
        self.warn_once(scope, ENDPOINT_CHANGED, &message).await;
        Err(Stop::Wait(misconfigured(ENDPOINT_CHANGED, message)))
    }

    /// The client for the cluster's credentials `reference` names (`None`: its own).
    async fn client_for(
        &self,
        scope: &Scope,
        reference: Option<&api::SecretReference>,
    ) -> Result<Reach, MachineError> {
        let config = credentials::client_config(
            self.context,
            &scope.proxmox_cluster,
            &scope.namespace,
            reference,
            false,
        )
        .await?;
        Ok(match config {
            Ok(config) => match self.context.proxmox.get(&config) {
                Ok(client) => Reach::Client(client),
                Err(error) => Reach::Unreachable(error.to_string()),
            },
            Err(error) => Reach::Unreachable(error.to_string()),
        })
    }

    /// Whether the machine's VM is on `proxmox`: its tag is listed there, or the VM with its
    /// recorded VMID (or spec's SMBIOS UUID) is shown to be its own by its config. Decides
    /// whether a Proxmox other than the recorded one may be trusted with the machine.
    async fn vm_is_on(
        &self,
        scope: &Scope,
        proxmox: &ProxmoxClient,
        resources: &[ClusterResource],
    ) -> Result<bool, MachineError> {
        let identity = Identity::of(self.machine, &scope.name);
        if let Some(vmid) = scope.recorded_vmid
            && let Some(vm) = vm::vms(resources).find(|r| r.vmid == Some(vmid))
            && identity
                .owned_listed(proxmox, &self.configs, vm)
                .await?
                .is_some()
        {
            return Ok(true);
        }
        Ok(identity
            .search(proxmox, &self.configs, resources, scope.recorded_vmid)
            .await?
            .is_some())
    }

    /// The Proxmox client that deletes the machine's VM: with the ProxmoxCluster's credentials,
    /// or with capmox's global ones when the ProxmoxCluster is gone. A machine that may have a
    /// VM and cannot reach Proxmox keeps its finalizer and says why (with a Warning event once).
    pub(super) async fn deletion_client(
        &self,
        scope: &Scope,
        cluster_found: bool,
    ) -> Flow<MachineProxmox> {
        let found = if cluster_found {
            // The zone the machine was placed in, for a machine that has not recorded where
            // its VM is.
            let zone_credentials = scope
                .current
                .failure_domain
                .as_deref()
                .and_then(|zone| placement::credentials_of_zone(&scope.proxmox_cluster, zone));
            self.proxmox_client(scope, zone_credentials)
                .await
                .map_err(|stop| match stop {
                    Stop::Wait(wait) => Stop::Wait(unreachable(format!(
                        "cannot reach Proxmox to delete {}: {}; retrying",
                        self.recorded_vm(scope),
                        wait.decided.message
                    ))),
                    failed => failed,
                })
        } else {
            self.global_client(scope)
        };
        match found {
            Err(Stop::Wait(blocked)) if self.may_have_vm(scope) => {
                let (reason, message) = (&blocked.decided.reason, &blocked.decided.message);
                tracing::warn!(machine = %scope.name, reason, "{message}");
                self.warn_once(scope, reason, message).await;
                Err(Stop::Wait(blocked))
            }
            found => found,
        }
    }

    /// A client with capmox's global credentials, for a machine whose ProxmoxCluster is gone.
    fn global_client(&self, scope: &Scope) -> Flow<MachineProxmox> {
        let cluster = format!("{}/{}", scope.namespace, scope.proxmox_cluster.name_any());
        let unavailable = |message: String| {
            Stop::Wait(unreachable(format!(
                "cannot reach Proxmox to delete {}: {message}; retrying",
                self.recorded_vm(scope)
            )))
        };
        let global = self
            .context
            .global_credentials
            .for_namespace(&scope.namespace);
        match global {
            Ok(config) => {
                let proxmox = self
                    .context
                    .proxmox
                    .get(&config)
                    .map_err(|error| unavailable(error.to_string()))?;
                let moved_from = self
                    .recorded_endpoint(scope)
                    .filter(|recorded| *recorded != proxmox.endpoint())
                    .map(str::to_owned);
                Ok(MachineProxmox {
                    proxmox,
                    moved_from,
                })
            }
            Err(problem @ CredentialsError::Invalid { .. }) => Err(unavailable(format!(
                "the ProxmoxCluster {cluster} is gone and capmox's global credentials are unusable ({problem})"
            ))),
            Err(_) => Err(Stop::Wait(wait(
                "ProxmoxClusterNotFound",
                format!(
                    "the ProxmoxCluster {cluster} is gone and capmox has no global credentials for this namespace, so {} is kept; restore the ProxmoxCluster (and its credentials) to delete it, or delete the VM yourself and remove the finalizer {} from this ProxmoxMachine",
                    self.recorded_vm(scope),
                    finalizers::MACHINE
                ),
                kube::runtime::controller::Action::requeue(NO_CREDENTIALS_RECHECK),
            ))),
        }
    }

    /// The machine's VM as its spec and status record it, for messages.
    pub(super) fn recorded_vm(&self, scope: &Scope) -> String {
        let mut parts = Vec::new();
        if let Some(vmid) = scope.recorded_vmid {
            parts.push(format!("VM {vmid}"));
        }
        if let Some(node) = &scope.current.proxmox_node {
            parts.push(format!("on {node}"));
        }
        if let Some(provider_id) = &self.machine.spec.provider_id {
            parts.push(format!("({provider_id})"));
        }
        if parts.is_empty() {
            "its VM".to_owned()
        } else {
            format!("its {}", parts.join(" "))
        }
    }
}

/// The client, or the wait of a Proxmox that cannot be reached.
fn reached(reach: Reach) -> Flow<ProxmoxClient> {
    match reach {
        Reach::Client(client) => Ok(client),
        Reach::Unreachable(message) => Err(Stop::Wait(unreachable(message))),
    }
}
