//! How many clone and disk tasks a machine's zone lets run at once: the zone's `taskLimits`
//! over the cluster's; no limit when neither sets one.

use crate::api::{ProxmoxClusterSpec, TaskLimits};

/// The limits a machine's tasks run under; `None`: no limit (the default: capmox's queue then
/// stays out of the way, and Proxmox queues what it cannot run at once).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MachineTaskLimits {
    /// On the node the VM is cloned to (and the template's node, when another).
    pub per_node: Option<u32>,
    /// On each storage the clone writes to.
    pub per_storage: Option<u32>,
}

/// The limits of a machine in `zone`: the zone's fields over the cluster's.
pub fn task_limits_for_machine(spec: &ProxmoxClusterSpec, zone: Option<&str>) -> MachineTaskLimits {
    let zone_limits = zone
        .and_then(|z| spec.zone_config.iter().find(|c| c.zone == z))
        .and_then(|z| z.task_limits.as_ref());
    let cluster_limits = spec.task_limits.as_ref();
    let pick = |field: fn(&TaskLimits) -> Option<i32>| {
        zone_limits
            .and_then(field)
            .or_else(|| cluster_limits.and_then(field))
            .and_then(|v| u32::try_from(v).ok())
            .filter(|v| *v > 0)
    };
    MachineTaskLimits {
        per_node: pick(|l| l.per_node),
        per_storage: pick(|l| l.per_storage),
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
        assert_eq!(
            of(Some("rack-a")),
            (Some(3), Some(1)),
            "zone's storage, cluster's node"
        );
        assert_eq!(of(Some("rack-b")), (Some(1), None), "zone's node");
        assert_eq!(of(None), (Some(3), None), "no zone: the cluster's");
        assert_eq!(of(Some("unknown")), (Some(3), None));
        let bare = ProxmoxClusterSpec::default();
        assert_eq!(
            task_limits_for_machine(&bare, Some("rack-a")),
            MachineTaskLimits::default(),
            "nothing set: no limit"
        );
    }
}
