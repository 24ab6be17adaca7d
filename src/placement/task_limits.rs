//! How many clone and disk tasks a machine's zone lets run at once: the zone's `taskLimits`
//! over the cluster's, over capmox's defaults.

use crate::api::{ProxmoxClusterSpec, TaskLimits};

/// Clone and disk tasks at once on one node when nothing says otherwise: one more than
/// Proxmox's storage locks let run side by side, so the next clone is queued in Proxmox the
/// moment the running one ends and no lock time is lost, while no machine waits long enough
/// in Proxmox's lock queue to hit its lock timeout.
pub const DEFAULT_PER_NODE: u32 = 2;
/// Clone and disk tasks at once on one shared storage when nothing says otherwise: clones to
/// shared storage allocate their volumes under a cluster-wide lock, held briefly per volume.
pub const DEFAULT_PER_STORAGE: u32 = 4;

/// The limits a machine's tasks run under.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MachineTaskLimits {
    /// On the node the VM is cloned to (and the template's node, when another).
    pub per_node: u32,
    /// On each shared storage the clone writes to.
    pub per_storage: u32,
}

impl Default for MachineTaskLimits {
    fn default() -> Self {
        Self {
            per_node: DEFAULT_PER_NODE,
            per_storage: DEFAULT_PER_STORAGE,
        }
    }
}

/// The limits of a machine in `zone`: the zone's fields over the cluster's over the defaults.
pub fn task_limits_for_machine(spec: &ProxmoxClusterSpec, zone: Option<&str>) -> MachineTaskLimits {
    let zone_limits = zone
        .and_then(|z| spec.zone_config.iter().find(|c| c.zone == z))
        .and_then(|z| z.task_limits.as_ref());
    let cluster_limits = spec.task_limits.as_ref();
    let pick = |field: fn(&TaskLimits) -> Option<i32>, default: u32| {
        zone_limits
            .and_then(field)
            .or_else(|| cluster_limits.and_then(field))
            .and_then(|v| u32::try_from(v).ok())
            .filter(|v| *v > 0)
            .unwrap_or(default)
    };
    MachineTaskLimits {
        per_node: pick(|l| l.per_node, DEFAULT_PER_NODE),
        per_storage: pick(|l| l.per_storage, DEFAULT_PER_STORAGE),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::ZoneConfigSpec;

    fn limits(per_node: Option<i32>, per_storage: Option<i32>) -> Option<TaskLimits> {
        Some(TaskLimits {
            per_node,
            per_storage,
        })
    }

    #[test]
    fn a_zones_limit_overrides_the_clusters_field_by_field_and_defaults_fill_the_rest() {
        let spec = ProxmoxClusterSpec {
            task_limits: limits(Some(3), None),
            zone_config: vec![
                ZoneConfigSpec {
                    zone: "rack-a".into(),
                    task_limits: limits(None, Some(1)),
                    ..Default::default()
                },
                ZoneConfigSpec {
                    zone: "rack-b".into(),
                    task_limits: limits(Some(1), None),
                    ..Default::default()
                },
            ],
            ..Default::default()
        };
        let of = |zone| {
            let l = task_limits_for_machine(&spec, zone);
            (l.per_node, l.per_storage)
        };
        assert_eq!(of(Some("rack-a")), (3, 1), "zone's storage, cluster's node");
        assert_eq!(of(Some("rack-b")), (1, DEFAULT_PER_STORAGE), "zone's node");
        assert_eq!(of(None), (3, DEFAULT_PER_STORAGE), "no zone: the cluster's");
        assert_eq!(of(Some("unknown")), (3, DEFAULT_PER_STORAGE));
        let bare = ProxmoxClusterSpec::default();
        assert_eq!(
            task_limits_for_machine(&bare, Some("rack-a")),
            MachineTaskLimits::default(),
            "nothing set: the defaults"
        );
    }
}
