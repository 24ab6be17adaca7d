//! Which Proxmox HA settings a machine gets: its zone's over its cluster's, and the zone's
//! nodes that HA must keep it on.

use crate::api::{HaSpec, ProxmoxClusterSpec};

/// What HA a machine gets.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MachineHa {
    /// The effective settings (cluster's, overridden by the zone's).
    pub settings: HaSpec,
    /// The zone and its nodes, when the machine has a zone with nodes.
    pub zone: Option<(String, Vec<String>)>,
}

/// The HA a machine in `zone` gets, `None` when HA is off for it.
pub fn ha_for_machine(spec: &ProxmoxClusterSpec, zone: Option<&str>) -> Option<MachineHa> {
    let zone_config = zone.and_then(|z| spec.zone_config.iter().find(|c| c.zone == z));
    let settings = HaSpec::merged(spec.ha.as_ref(), zone_config.and_then(|z| z.ha.as_ref()));
    settings.is_enabled().then(|| MachineHa {
        settings,
        zone: zone_config
            .filter(|z| !z.nodes.is_empty())
            .map(|z| (z.zone.clone(), z.nodes.clone())),
    })
}

/// Whether any machine of the cluster may get HA (the cluster or one of its zones has it on).
pub fn ha_enabled_anywhere(spec: &ProxmoxClusterSpec) -> bool {
    spec.ha.as_ref().is_some_and(HaSpec::is_enabled)
        || spec
            .zone_config
            .iter()
            .any(|z| HaSpec::merged(spec.ha.as_ref(), z.ha.as_ref()).is_enabled())
}

/// The zones with nodes, each with its nodes: what zone rules and groups are made of.
pub fn ha_zones(spec: &ProxmoxClusterSpec) -> impl Iterator<Item = (&str, &[String])> {
    spec.zone_config
        .iter()
        .filter(|z| !z.nodes.is_empty())
        .map(|z| (z.zone.as_str(), z.nodes.as_slice()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::ZoneConfigSpec;

    #[test]
    fn zone_settings_override_the_cluster_ones() {
        let on = |e: bool| HaSpec {
            enabled: Some(e),
            ..HaSpec::default()
        };
        let spec = ProxmoxClusterSpec {
            ha: Some(HaSpec {
                max_restart: Some(2),
                ..on(true)
            }),
            zone_config: vec![
                ZoneConfigSpec {
                    zone: "a".into(),
                    nodes: vec!["n1".into()],
                    ..ZoneConfigSpec::default()
                },
                ZoneConfigSpec {
                    zone: "b".into(),
                    nodes: vec!["n2".into()],
                    ha: Some(on(false)),
                    ..ZoneConfigSpec::default()
                },
                ZoneConfigSpec {
                    zone: "net".into(),
                    ..ZoneConfigSpec::default()
                },
            ],
            ..ProxmoxClusterSpec::default()
        };
        let a = ha_for_machine(&spec, Some("a")).expect("on in a");
        assert_eq!(a.settings.max_restart, Some(2));
        assert_eq!(a.zone, Some(("a".into(), vec!["n1".into()])));
        assert_eq!(ha_for_machine(&spec, Some("b")), None);
        assert_eq!(ha_for_machine(&spec, Some("net")).expect("on").zone, None);
        assert!(ha_for_machine(&spec, None).is_some());
        assert!(!ha_enabled_anywhere(&ProxmoxClusterSpec::default()));
        assert!(ha_enabled_anywhere(&spec));
    }
}
