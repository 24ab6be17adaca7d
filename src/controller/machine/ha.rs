//! Proxmox HA for a machine's VM: registered in its zone's rule or group once capmox started
//! it, and removed before its deletion (or HA would start it again).

use std::time::Duration;

use kube::ResourceExt;
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;

use super::looks::Held;
use super::outcome::{Flow, waiting};
use super::{During, MachineError, Reconcile, Scope, claim_key};
use crate::proxmox::ProxmoxClient;

/// How soon a machine whose HA rules another machine changed meanwhile tries again.
const HA_RETRY: Duration = Duration::from_secs(1);

impl Reconcile<'_> {
    /// Registers the running VM with Proxmox HA; another machine changing the HA rules
    /// meanwhile makes it try again soon.
    pub(super) async fn register_ha_phase(
        &self,
        scope: &Scope,
        held: &Held,
        proxmox: &ProxmoxClient,
        vmid: u32,
    ) -> Flow {
        let placement = held.placement()?;
        let Some(ha) = placement.ha() else {
            return Ok(());
        };
        let managed = held.vm.as_ref().is_some_and(|vm| vm.hastate.is_some());
        if self
            .register_ha(scope, proxmox, vmid, ha, placement.role(), managed)
            .await?
        {
            return Ok(());
        }
        Err(waiting(
            "WaitingForHA",
            format!(
                "VM {vmid} is HA-managed; its HA rules changed concurrently and are updated again"
            ),
            Action::requeue(HA_RETRY),
        ))
    }

    /// Registers the running VM `vmid` with Proxmox HA ([`crate::controller::ha`]): what
    /// Proxmox refuses is reported by a Warning event and does not stop provisioning;
    /// concurrent changes are retried on the next pass. Whether the registration is complete.
    async fn register_ha(
        &self,
        scope: &Scope,
        proxmox: &ProxmoxClient,
        vmid: u32,
        ha: &crate::placement::MachineHa,
        role: crate::placement::MachineRole,
        managed: bool,
    ) -> Result<bool, MachineError> {
        let names = scope.ha_names();
        let control_plane = role == crate::placement::MachineRole::ControlPlane;
        let major = self.pve_major(proxmox).await?;
        let registered = crate::controller::ha::register(
            proxmox,
            major,
            &names,
            &scope.name,
            control_plane,
            vmid,
            ha,
            managed,
        )
        .await
        .during(|| format!("registering VM {vmid} with Proxmox HA"))?;
        if !managed {
            self.context
                .inventory
                .changed(proxmox, &claim_key(self.machine));
        }
        for warning in &registered.warnings {
            self.event(
                scope,
                EventType::Warning,
                "HAConfigurationRefused",
                &format!("VM {vmid} is HA-managed, but {warning}; fix the HA configuration in Proxmox or the zone's nodes"),
            )
            .await;
        }
        if registered.complete {
            self.context
                .inventory
                .set_ha_registered(proxmox, vmid, true);
        }
        Ok(registered.complete)
    }

    /// Removes VM `vmid`'s HA resource, and the cluster's HA rules or the zone's group it
    /// leaves without purpose ([`crate::controller::ha::unregister`]).
    pub(super) async fn unregister_ha(
        &self,
        scope: &Scope,
        proxmox: &ProxmoxClient,
        vmid: u32,
    ) -> Result<(), MachineError> {
        let names = scope.ha_names();
        let major = self.pve_major(proxmox).await?;
        let zone = scope.current.failure_domain.as_deref();
        crate::controller::ha::unregister(proxmox, major, &names, vmid, zone)
            .await
            .during(|| format!("removing VM {vmid} from Proxmox HA"))?;
        self.context
            .inventory
            .set_ha_registered(proxmox, vmid, false);
        self.context
            .inventory
            .changed(proxmox, &claim_key(self.machine));
        Ok(())
    }
}

impl Scope {
    /// The ids and comments of this machine's cluster's HA objects in Proxmox.
    pub(super) fn ha_names(&self) -> crate::controller::ha::HaNames {
        crate::controller::ha::HaNames::new(&self.namespace, &self.proxmox_cluster.name_any())
    }
}

impl Reconcile<'_> {
    /// The Proxmox VE major version behind `proxmox` (which HA objects it offers).
    pub(super) async fn pve_major(&self, proxmox: &ProxmoxClient) -> Result<u32, MachineError> {
        self.context
            .inventory
            .pve_major(proxmox)
            .await
            .during(|| "reading the Proxmox VE version".to_owned())
    }
}
