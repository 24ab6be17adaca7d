//! Proxmox HA for machines (`ha` of the ProxmoxCluster and of its zones).
//!
//! Once capmox has started a machine's VM (its seed ISO attached), the VM becomes an HA
//! resource (`vm:<vmid>`, state `started`) and is kept on its zone's nodes:
//! * PVE 9: a strict `node-affinity` rule per zone holds the zone's resources; the
//!   control-plane VMs of a cluster are also kept on different nodes by a negative
//!   `resource-affinity` rule, once there are two of them;
//! * PVE 8: a restricted HA group per zone, named by each resource (`group`).
//!
//! A machine without a zone, or in a zone without nodes (a network-only zone), gets the HA
//! resource only: HA may then recover it on any node.
//!
//! Ownership: rules and groups are named `capmox-<hash of namespace/cluster>-zone-<zone>`
//! and `capmox-<hash>-control-plane`, and carry the comment `managed by capmox:
//! <namespace>/<cluster> ...`; capmox changes or removes only objects with both. HA
//! resources carry a comment naming the cluster and the machine; a machine only ever
//! removes its own VM's resource.
//!
//! Deletion removes the VM's HA resource before the VM is stopped, then the rules of the
//! cluster that no longer hold what they need (an emptied zone rule, a control-plane rule
//! with fewer than two resources) and, on PVE 8, the zone's group once no resource uses it.
//! The cluster controller keeps each zone rule's or group's nodes equal to the zone's.
//!
//! Proxmox refusing a rule (infeasible, for instance a negative rule with more control-plane
//! VMs than nodes) does not stop provisioning: the machine reports a Warning event.

use std::collections::BTreeSet;

use crate::api::ProxmoxClusterSpec;
use crate::placement::MachineHa;
use crate::proxmox::{HaRuleEntry, NewHaResource, ProxmoxClient, ProxmoxError};

/// Prefix of every HA rule and group id capmox creates.
pub const PREFIX: &str = "capmox-";
/// Start of the comment on everything capmox creates in Proxmox's HA configuration.
pub const COMMENT_PREFIX: &str = "managed by capmox: ";

const NODE_AFFINITY: &str = "node-affinity";
const RESOURCE_AFFINITY: &str = "resource-affinity";

/// FNV-1a, 32 bits: stable across releases and platforms (ids must not change).
fn fnv32(text: &str) -> u32 {
    text.bytes().fold(0x811c_9dc5_u32, |hash, byte| {
        (hash ^ u32::from(byte)).wrapping_mul(0x0100_0193)
    })
}

/// The ids and comments of one cluster's HA objects.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HaNames {
    /// `<namespace>/<cluster>`.
    cluster: String,
    /// `capmox-<hash>-`.
    id_prefix: String,
}

impl HaNames {
    /// The names of ProxmoxCluster `namespace/cluster`.
    pub fn new(namespace: &str, cluster: &str) -> Self {
        let key = format!("{namespace}/{cluster}");
        let id_prefix = format!("{PREFIX}{:08x}-", fnv32(&key));
        Self {
            cluster: key,
            id_prefix,
        }
    }

    /// The rule (PVE 9) or group (PVE 8) id of `zone`: lower case, characters a config id
    /// does not allow replaced by `-` (then the zone's hash is appended, so ids stay unique).
    pub fn zone_id(&self, zone: &str) -> String {
        let clean: String = zone
            .chars()
            .map(|c| match c.to_ascii_lowercase() {
                c @ ('a'..='z' | '0'..='9' | '-' | '_') => c,
                _ => '-',
            })
            .collect();
        if clean == zone {
            format!("{}zone-{clean}", self.id_prefix)
        } else {
            format!("{}zone-{clean}-{:08x}", self.id_prefix, fnv32(zone))
        }
    }

    /// The id of the cluster's negative resource-affinity rule for its control plane (PVE 9).
    pub fn control_plane_id(&self) -> String {
        format!("{}control-plane", self.id_prefix)
    }

    /// The comment of `zone`'s rule or group.
    pub fn zone_comment(&self, zone: &str) -> String {
        format!("{COMMENT_PREFIX}{} zone {zone}", self.cluster)
    }

    /// The comment of the control-plane rule.
    pub fn control_plane_comment(&self) -> String {
        format!("{COMMENT_PREFIX}{} control plane", self.cluster)
    }

    /// The comment of a machine's HA resource.
    pub fn resource_comment(&self, machine: &str, control_plane: bool) -> String {
        let role = if control_plane {
            " (control plane)"
        } else {
            ""
        };
        format!("{COMMENT_PREFIX}{} machine {machine}{role}", self.cluster)
    }

    /// Whether an HA rule or group is this cluster's: capmox's id prefix for the cluster and
    /// a comment naming the cluster.
    pub fn owns(&self, id: &str, comment: Option<&str>) -> bool {
        id.starts_with(&self.id_prefix)
            && comment.is_some_and(|c| c.starts_with(&format!("{COMMENT_PREFIX}{} ", self.cluster)))
    }

    /// Whether an HA resource's comment says it is a control-plane VM of this cluster.
    pub fn is_control_plane_resource(&self, comment: Option<&str>) -> bool {
        comment.is_some_and(|c| {
            c.starts_with(&format!("{COMMENT_PREFIX}{} machine ", self.cluster))
                && c.ends_with(" (control plane)")
        })
    }
}

/// How a registration ended.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Registered {
    /// Done: later passes need not look again.
    pub complete: bool,
    /// What Proxmox refused and capmox moved on without (for a Warning event).
    pub warnings: Vec<String>,
}

/// A refusal worth another try on the next pass: a concurrent change (digest, an id defined
/// meanwhile, a rule removed meanwhile) or a transient failure.
fn retry_later(error: &ProxmoxError) -> bool {
    error.is_retryable()
        || error.reason().is_some_and(|r| {
            r.contains("detected modified configuration")
                || r.contains("already defined")
                || r.contains("does not exist")
        })
}

/// A refusal of a rule or group: transient ones are retried, the others reported.
fn refused(out: &mut Registered, what: &str, error: ProxmoxError) -> Result<(), ProxmoxError> {
    if matches!(
        error,
        ProxmoxError::Unauthorized { .. } | ProxmoxError::Forbidden { .. }
    ) || error.is_retryable()
    {
        return Err(error);
    }
    if retry_later(&error) {
        tracing::debug!(%error, "{what}: changed concurrently; retrying on the next pass");
        out.complete = false;
    } else {
        out.warnings.push(format!("{what}: {error}"));
    }
    Ok(())
}

/// Puts the VM in its zone's node-affinity rule (PVE 9), creating the rule or bringing its
/// nodes up to date; a rule of another cluster's under the same id is left alone and reported.
async fn zone_rule(
    proxmox: &ProxmoxClient,
    names: &HaNames,
    sid: &str,
    vmid: u32,
    zone: &str,
    nodes: &[String],
    out: &mut Registered,
) -> Result<(), ProxmoxError> {
    let rules = proxmox.ha_rules().await?;
    let id = names.zone_id(zone);
    let what = format!("HA rule {id} (zone {zone})");
    let result = match rules.iter().find(|r| r.rule == id) {
        None => {
            proxmox
                .create_ha_rule(&HaRuleEntry {
                    rule: id.clone(),
                    kind: NODE_AFFINITY.to_owned(),
                    resources: sid.to_owned(),
                    nodes: Some(nodes.join(",")),
                    strict: true,
                    comment: Some(names.zone_comment(zone)),
                    ..HaRuleEntry::default()
                })
                .await
        }
        Some(rule) if !names.owns(&rule.rule, rule.comment.as_deref()) => {
            out.warnings.push(format!(
                "{what} exists but is not this cluster's (its comment does not name it); VM {vmid} is not restricted to the zone's nodes"
            ));
            Ok(())
        }
        // The rule's nodes are the cluster's to keep ([`sync_zone_nodes`]): a machine's view of
        // the zone may be older than the one the cluster wrote.
        Some(rule) => {
            let mut resources = rule.resource_ids();
            if resources.insert(sid.to_owned()) {
                let resources = resources.into_iter().collect::<Vec<_>>().join(",");
                proxmox
                    .update_ha_rule(
                        &id,
                        NODE_AFFINITY,
                        Some(&resources),
                        None,
                        rule.digest.as_deref(),
                    )
                    .await
            } else {
                Ok(())
            }
        }
    };
    if let Err(error) = result {
        refused(out, &what, error)?;
    }
    Ok(())
}

/// Makes VM `vmid` of `machine` an HA resource (unless `managed` already) and puts it into
/// its zone's rule or group and, for control-plane machines on PVE 9, into the cluster's
/// negative resource-affinity rule.
#[allow(clippy::too_many_arguments)]
pub async fn register(
    proxmox: &ProxmoxClient,
    major: u32,
    names: &HaNames,
    machine: &str,
    control_plane: bool,
    vmid: u32,
    ha: &MachineHa,
    managed: bool,
) -> Result<Registered, ProxmoxError> {
    let sid = format!("vm:{vmid}");
    let mut out = Registered {
        complete: true,
        warnings: Vec::new(),
    };
    let mut resource = NewHaResource {
        sid: sid.clone(),
        state: "started".to_owned(),
        comment: Some(names.resource_comment(machine, control_plane)),
        max_restart: ha.settings.max_restart.and_then(|v| u32::try_from(v).ok()),
        max_relocate: ha.settings.max_relocate.and_then(|v| u32::try_from(v).ok()),
        group: None,
    };
    if major < 9 {
        // PVE 8: the group first, the resource names it.
        if let Some((zone, nodes)) = &ha.zone {
            resource.group = ensure_group(proxmox, names, zone, nodes, &mut out).await?;
            if !out.complete {
                // The group changed under us: a resource created now would stay outside it
                // (an existing resource is not re-created), so it waits for the next pass.
                return Ok(out);
            }
        }
    }
    if !managed {
        match proxmox.create_ha_resource(&resource).await {
            Ok(()) => {}
            Err(error)
                if error
                    .reason()
                    .is_some_and(|r| r.contains("already defined")) => {}
            Err(error) => return Err(error),
        }
    }
    if major < 9 {
        return Ok(out);
    }
    if let Some((zone, nodes)) = &ha.zone {
        zone_rule(proxmox, names, &sid, vmid, zone, nodes, &mut out).await?;
    }
    if control_plane {
        control_plane_rule(proxmox, names, Some(&sid), &mut out).await?;
    }
    Ok(out)
}

/// Keeps the cluster's negative resource-affinity rule equal to its HA-managed
/// control-plane VMs (plus `adding`): created from two on, removed below two.
async fn control_plane_rule(
    proxmox: &ProxmoxClient,
    names: &HaNames,
    adding: Option<&str>,
    out: &mut Registered,
) -> Result<(), ProxmoxError> {
    let mut sids: BTreeSet<String> = proxmox
        .ha_resources()
        .await?
        .into_iter()
        .filter(|r| names.is_control_plane_resource(r.comment.as_deref()))
        .map(|r| r.sid)
        .collect();
    if let Some(sid) = adding {
        sids.insert(sid.to_owned());
    }
    let rules = proxmox.ha_rules().await?;
    let id = names.control_plane_id();
    let what = format!("HA rule {id} (control plane on different nodes)");
    let resources = sids.iter().cloned().collect::<Vec<_>>().join(",");
    let result = match rules.iter().find(|r| r.rule == id) {
        None if sids.len() < 2 => Ok(()),
        None => {
            proxmox
                .create_ha_rule(&HaRuleEntry {
                    rule: id.clone(),
                    kind: RESOURCE_AFFINITY.to_owned(),
                    resources,
                    affinity: Some("negative".to_owned()),
                    comment: Some(names.control_plane_comment()),
                    ..HaRuleEntry::default()
                })
                .await
        }
        Some(rule) if !names.owns(&rule.rule, rule.comment.as_deref()) => {
            out.warnings.push(format!(
                "{what} exists but is not this cluster's (its comment does not name it); leaving it"
            ));
            Ok(())
        }
        Some(_) if sids.len() < 2 => proxmox.delete_ha_rule(&id).await,
        Some(rule) if rule.resource_ids() == sids => Ok(()),
        Some(rule) => {
            proxmox
                .update_ha_rule(
                    &id,
                    RESOURCE_AFFINITY,
                    Some(&resources),
                    None,
                    rule.digest.as_deref(),
                )
                .await
        }
    };
    if let Err(error) = result {
        refused(out, &what, error)?;
    }
    Ok(())
}

/// PVE 8: the zone's restricted group with the zone's nodes; its id, or `None` (with a
/// warning) when it cannot be used.
async fn ensure_group(
    proxmox: &ProxmoxClient,
    names: &HaNames,
    zone: &str,
    nodes: &[String],
    out: &mut Registered,
) -> Result<Option<String>, ProxmoxError> {
    let id = names.zone_id(zone);
    let what = format!("HA group {id} (zone {zone})");
    let groups = proxmox.ha_groups().await?;
    let result = match groups.iter().find(|g| g.group == id) {
        None => {
            proxmox
                .create_ha_group(&crate::proxmox::HaGroupEntry {
                    group: id.clone(),
                    nodes: nodes.join(","),
                    restricted: true,
                    comment: Some(names.zone_comment(zone)),
                    digest: None,
                })
                .await
        }
        Some(group) if !names.owns(&group.group, group.comment.as_deref()) => {
            out.warnings.push(format!(
                "{what} exists but is not this cluster's (its comment does not name it); the VM is not restricted to the zone's nodes"
            ));
            return Ok(None);
        }
        // The group's nodes are the cluster's to keep, as a zone rule's are.
        Some(_) => Ok(()),
    };
    match result {
        Ok(()) => Ok(Some(id)),
        Err(error) => {
            refused(out, &what, error)?;
            Ok(None)
        }
    }
}

/// Removes VM `vmid`'s HA resource (when `managed`), then what of the cluster's HA objects
/// no longer holds anything: emptied zone rules and a control-plane rule below two VMs
/// (PVE 9), or the zone's group once unused (PVE 8).
pub async fn unregister(
    proxmox: &ProxmoxClient,
    major: u32,
    names: &HaNames,
    vmid: u32,
    zone: Option<&str>,
) -> Result<(), ProxmoxError> {
    let sid = format!("vm:{vmid}");
    match proxmox.delete_ha_resource(&sid).await {
        Ok(()) => {}
        Err(error) if error.reason().is_some_and(|r| r.contains("not HA managed")) => {}
        Err(error) => return Err(error),
    }
    if major < 9 {
        let Some(zone) = zone else {
            return Ok(());
        };
        let id = names.zone_id(zone);
        let groups = proxmox.ha_groups().await?;
        if groups
            .iter()
            .any(|g| g.group == id && names.owns(&g.group, g.comment.as_deref()))
        {
            match proxmox.delete_ha_group(&id).await {
                Ok(()) => {}
                // another machine of the zone still uses it
                Err(error) if error.reason().is_some_and(|r| r.contains("is used by")) => {}
                Err(error) => return Err(error),
            }
        }
        return Ok(());
    }
    for rule in proxmox.ha_rules().await? {
        if !names.owns(&rule.rule, rule.comment.as_deref()) {
            continue;
        }
        let mut resources = rule.resource_ids();
        let had = resources.remove(&sid);
        let min = if rule.kind == RESOURCE_AFFINITY { 2 } else { 1 };
        let result = if resources.len() < min {
            proxmox.delete_ha_rule(&rule.rule).await
        } else if had {
            let list = resources.into_iter().collect::<Vec<_>>().join(",");
            proxmox
                .update_ha_rule(&rule.rule, &rule.kind, Some(&list), None, None)
                .await
        } else {
            Ok(())
        };
        match result {
            Ok(()) => {}
            Err(error) if retry_later(&error) && !error.is_retryable() => {
                tracing::debug!(rule = %rule.rule, %error, "HA rule changed concurrently; left to the next pass");
            }
            Err(error) => return Err(error),
        }
    }
    Ok(())
}

/// Keeps the nodes of the cluster's zone rules (PVE 9) or groups (PVE 8) equal to its zones'
/// nodes, the only writer of them once they exist; incomplete when another writer came between.
pub async fn sync_zone_nodes(
    proxmox: &ProxmoxClient,
    major: u32,
    names: &HaNames,
    spec: &ProxmoxClusterSpec,
) -> Result<Registered, ProxmoxError> {
    let mut out = Registered {
        complete: true,
        warnings: Vec::new(),
    };
    let zones: Vec<(String, &str, BTreeSet<String>)> = crate::placement::ha_zones(spec)
        .map(|(zone, nodes)| (names.zone_id(zone), zone, nodes.iter().cloned().collect()))
        .collect();
    if major < 9 {
        for group in proxmox.ha_groups().await? {
            let Some((id, zone, nodes)) = zones.iter().find(|(id, ..)| *id == group.group) else {
                continue;
            };
            if names.owns(&group.group, group.comment.as_deref()) && group.node_names() != *nodes {
                let list = nodes.iter().cloned().collect::<Vec<_>>().join(",");
                if let Err(error) = proxmox
                    .update_ha_group_nodes(id, &list, group.digest.as_deref())
                    .await
                {
                    refused(&mut out, &format!("HA group {id} (zone {zone})"), error)?;
                }
            }
        }
        return Ok(out);
    }
    for rule in proxmox.ha_rules().await? {
        let Some((id, zone, nodes)) = zones.iter().find(|(id, ..)| *id == rule.rule) else {
            continue;
        };
        if names.owns(&rule.rule, rule.comment.as_deref()) && rule.node_names() != *nodes {
            let list = nodes.iter().cloned().collect::<Vec<_>>().join(",");
            if let Err(error) = proxmox
                .update_ha_rule(id, &rule.kind, None, Some(&list), rule.digest.as_deref())
                .await
            {
                refused(&mut out, &format!("HA rule {id} (zone {zone})"), error)?;
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_per_cluster_and_zone_and_valid_config_ids() {
        let a = HaNames::new("default", "c1");
        let b = HaNames::new("default", "c2");
        assert_ne!(a.zone_id("rack-a"), b.zone_id("rack-a"));
        assert!(a.zone_id("rack-a").starts_with("capmox-"));
        assert!(a.zone_id("rack-a").ends_with("-zone-rack-a"));
        let odd = a.zone_id("Rack.A");
        assert!(
            odd.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        );
        assert_ne!(odd, a.zone_id("rack-a"));
        assert_ne!(a.zone_id("control-plane"), a.control_plane_id());
    }

    #[test]
    fn ownership_needs_the_prefix_and_the_comment() {
        let a = HaNames::new("default", "c1");
        let id = a.zone_id("z");
        assert!(a.owns(&id, Some(&a.zone_comment("z"))));
        assert!(!a.owns(&id, None));
        assert!(!a.owns(&id, Some("managed by capmox: default/c10 zone z")));
        assert!(!a.owns("other", Some(&a.zone_comment("z"))));
        assert!(a.is_control_plane_resource(Some(&a.resource_comment("m", true))));
        assert!(!a.is_control_plane_resource(Some(&a.resource_comment("m", false))));
    }
}
