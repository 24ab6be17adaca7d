//! Names and contents of the `InClusterIPPool`s a cluster owns, shared by the cluster controller
//! (which creates them) and machine placement (which claims from them), so both always agree.

use std::fmt;
use std::net::IpAddr;

use crate::api::{DEFAULT_ZONE, IpConfigSpec, ProxmoxCluster};
use crate::capi::IPAM_GROUP;

/// Kind of the pools capmox creates for a cluster.
pub const IN_CLUSTER_IP_POOL_KIND: &str = "InClusterIPPool";

/// Suffix of every claim name, as the Go provider writes it for both families.
const CLAIM_SUFFIX: &str = "inet";

/// IP family of a pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum IpFamily {
    /// IPv4.
    V4,
    /// IPv6.
    V6,
}

impl IpFamily {
    /// Short form used in pool names (`v4`/`v6`).
    pub fn short(self) -> &'static str {
        match self {
            Self::V4 => "v4",
            Self::V6 => "v6",
        }
    }

    /// Value of the `ipam.capmox.cluster.x-k8s.io/ip-family` annotation (`ipv4`/`ipv6`).
    pub fn annotation_value(self) -> &'static str {
        match self {
            Self::V4 => "ipv4",
            Self::V6 => "ipv6",
        }
    }
}

impl fmt::Display for IpFamily {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::V4 => "IPv4",
            Self::V6 => "IPv6",
        })
    }
}

/// Name of a cluster-owned pool: `<cluster>-<v4|v6>-icip`, or `<cluster>-<zone>-<v4|v6>-icip` for a zone.
pub fn pool_name(cluster: &str, zone: Option<&str>, family: IpFamily) -> String {
    match zone {
        Some(zone) => format!("{cluster}-{zone}-{}-icip", family.short()),
        None => format!("{cluster}-{}-icip", family.short()),
    }
}

/// Name of the claim for the `index`-th pool of a NIC: `<machine>-<netN>-<NN>-inet`.
pub fn claim_name(machine: &str, device: &str, index: usize) -> String {
    format!("{machine}-{device}-{index:02}-{CLAIM_SUFFIX}")
}

/// Family of an address list as the Go provider decides it: by parsing the first entry (the text
/// before `-` or `/`), whatever field it came from; `fallback` when that does not parse.
pub fn address_family(addresses: &[String], fallback: IpFamily) -> IpFamily {
    let Some(first) = addresses.first() else {
        return fallback;
    };
    let head = first
        .split(['-', '/'])
        .next()
        .unwrap_or(first.as_str())
        .trim();
    match head.parse::<IpAddr>() {
        Ok(IpAddr::V4(_)) => IpFamily::V4,
        Ok(IpAddr::V6(_)) => IpFamily::V6,
        Err(_) => fallback,
    }
}

/// One `InClusterIPPool` the cluster controller must keep in place.
#[derive(Clone, Debug, PartialEq)]
pub struct ClusterPool {
    /// Pool name (see [`pool_name`]).
    pub name: String,
    /// Zone the pool belongs to; `None` for the cluster-wide pools.
    pub zone: Option<String>,
    /// IP family, parsed from the first address.
    pub family: IpFamily,
    /// The addresses, prefix, gateway and metric from the spec.
    pub config: IpConfigSpec,
}

impl ClusterPool {
    /// Value of the `topology.kubernetes.io/proxmox-zone` label: the zone, or `default`.
    pub fn zone_label(&self) -> &str {
        self.zone.as_deref().unwrap_or(DEFAULT_ZONE)
    }
}

/// Every pool the cluster's spec asks for: the cluster-wide pools, then each zone's, in spec order.
pub fn cluster_pools(cluster: &ProxmoxCluster) -> Vec<ClusterPool> {
    let name = cluster.metadata.name.as_deref().unwrap_or_default();
    let spec = &cluster.spec;
    let mut pools = Vec::new();
    let mut push = |zone: Option<&str>, config: &Option<IpConfigSpec>, fallback: IpFamily| {
        if let Some(config) = config {
            let family = address_family(&config.addresses, fallback);
            pools.push(ClusterPool {
                name: pool_name(name, zone, family),
                zone: zone.map(str::to_owned),
                family,
                config: config.clone(),
            });
        }
    };
    push(None, &spec.ipv4_config, IpFamily::V4);
    push(None, &spec.ipv6_config, IpFamily::V6);
    for zone in &spec.zone_config {
        push(Some(&zone.zone), &zone.ipv4_config, IpFamily::V4);
        push(Some(&zone.zone), &zone.ipv6_config, IpFamily::V6);
    }
    pools
}

/// The pool a NIC with `defaultIPv4`/`defaultIPv6` claims from: the zone's own pool of that family
/// when the zone has one, else the cluster-wide pool, else none.
pub(crate) fn default_pool<'a>(
    pools: &'a [ClusterPool],
    zone: Option<&str>,
    family: IpFamily,
) -> Option<&'a ClusterPool> {
    let zone_pool = zone.and_then(|zone| {
        pools
            .iter()
            .find(|p| p.zone.as_deref() == Some(zone) && p.family == family)
    });
    zone_pool.or_else(|| {
        pools
            .iter()
            .find(|p| p.zone.is_none() && p.family == family)
    })
}

/// Reference to a pool as an `IPAddressClaim.spec.poolRef` needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolRef {
    /// API group (always the bare group, `ipam.cluster.x-k8s.io`, never a group/version).
    pub api_group: String,
    /// `InClusterIPPool` or `GlobalInClusterIPPool`.
    pub kind: String,
    /// Pool name.
    pub name: String,
}

impl PoolRef {
    /// Reference to a cluster-owned `InClusterIPPool`.
    pub fn in_cluster(name: impl Into<String>) -> Self {
        Self {
            api_group: IPAM_GROUP.to_owned(),
            kind: IN_CLUSTER_IP_POOL_KIND.to_owned(),
            name: name.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{ProxmoxClusterSpec, ZoneConfigSpec};

    fn ipc(addr: &str) -> Option<IpConfigSpec> {
        Some(IpConfigSpec {
            addresses: vec![addr.to_owned()],
            prefix: 24,
            gateway: "gw".to_owned(),
            metric: None,
        })
    }

    #[test]
    fn names_follow_the_go_provider() {
        assert_eq!(pool_name("c1", None, IpFamily::V4), "c1-v4-icip");
        assert_eq!(pool_name("c1", None, IpFamily::V6), "c1-v6-icip");
        assert_eq!(
            pool_name("c1", Some("rack-a"), IpFamily::V4),
            "c1-rack-a-v4-icip"
        );
        assert_eq!(
            pool_name("c1", Some("rack-a"), IpFamily::V6),
            "c1-rack-a-v6-icip"
        );
        assert_eq!(claim_name("m1", "net0", 0), "m1-net0-00-inet");
        assert_eq!(claim_name("m1", "net1", 12), "m1-net1-12-inet");
    }

    #[test]
    fn family_comes_from_the_first_address() {
        let cases = [
            ("10.0.0.1-10.0.0.9", IpFamily::V6, IpFamily::V4),
            ("10.0.0.0/24", IpFamily::V6, IpFamily::V4),
            ("2001:db8::1-2001:db8::9", IpFamily::V4, IpFamily::V6),
            ("2001:db8::/64", IpFamily::V4, IpFamily::V6),
            ("not-an-ip", IpFamily::V6, IpFamily::V6),
        ];
        for (addr, fallback, want) in cases {
            assert_eq!(address_family(&[addr.to_owned()], fallback), want, "{addr}");
        }
        assert_eq!(address_family(&[], IpFamily::V6), IpFamily::V6);
    }

    #[test]
    fn cluster_pools_lists_cluster_then_zone_pools() {
        let c = ProxmoxCluster::new(
            "c1",
            ProxmoxClusterSpec {
                ipv4_config: ipc("10.0.0.10-10.0.0.20"),
                ipv6_config: ipc("2001:db8::/64"),
                dns_servers: vec!["1.1.1.1".into()],
                zone_config: vec![
                    ZoneConfigSpec {
                        zone: "rack-a".into(),
                        ipv4_config: ipc("10.1.0.0/24"),
                        ..Default::default()
                    },
                    ZoneConfigSpec {
                        zone: "rack-b".into(),
                        ..Default::default()
                    },
                ],
                ..Default::default()
            },
        );
        let pools = cluster_pools(&c);
        let summary: Vec<(&str, &str, IpFamily)> = pools
            .iter()
            .map(|p| (p.name.as_str(), p.zone_label(), p.family))
            .collect();
        assert_eq!(
            summary,
            vec![
                ("c1-v4-icip", "default", IpFamily::V4),
                ("c1-v6-icip", "default", IpFamily::V6),
                ("c1-rack-a-v4-icip", "rack-a", IpFamily::V4),
            ]
        );
        // A zone with its own pool uses it; a zone without one falls back to the cluster's.
        assert_eq!(
            default_pool(&pools, Some("rack-a"), IpFamily::V4).map(|p| p.name.as_str()),
            Some("c1-rack-a-v4-icip")
        );
        assert_eq!(
            default_pool(&pools, Some("rack-a"), IpFamily::V6).map(|p| p.name.as_str()),
            Some("c1-v6-icip")
        );
        assert_eq!(
            default_pool(&pools, Some("rack-b"), IpFamily::V4).map(|p| p.name.as_str()),
            Some("c1-v4-icip")
        );
        assert_eq!(
            default_pool(&pools, None, IpFamily::V4).map(|p| p.name.as_str()),
            Some("c1-v4-icip")
        );
    }

    #[test]
    fn ipv6_addresses_in_ipv4_config_make_a_v6_pool_like_the_go_provider() {
        let c = ProxmoxCluster::new(
            "c1",
            ProxmoxClusterSpec {
                ipv4_config: ipc("2001:db8::/64"),
                dns_servers: vec!["1.1.1.1".into()],
                ..Default::default()
            },
        );
        let pools = cluster_pools(&c);
        assert_eq!(pools[0].name, "c1-v6-icip");
        assert_eq!(pools[0].family, IpFamily::V6);
        assert_eq!(pools[0].config.addresses, vec!["2001:db8::/64".to_owned()]);
    }
}
