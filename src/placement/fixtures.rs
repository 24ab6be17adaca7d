//! Builders of clusters and machines shared by the placement tests.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;

use crate::api::{
    IpConfigSpec, NetworkDevice, NetworkSpec, ProxmoxCluster, ProxmoxClusterSpec,
    ProxmoxClusterStatus, ProxmoxMachine, ProxmoxMachineSpec, ZoneConfigSpec, labels,
};
use crate::capi::{Machine, MachineSpec};

use super::failure_domains;

pub(crate) fn strings(items: &[&str]) -> Vec<String> {
    items.iter().map(|s| (*s).to_owned()).collect()
}

pub(crate) fn ip(addresses: &str, gateway: &str) -> Option<IpConfigSpec> {
    Some(IpConfigSpec {
        addresses: vec![addresses.to_owned()],
        prefix: 24,
        gateway: gateway.to_owned(),
        metric: None,
    })
}

pub(crate) fn zone(name: &str, nodes: &[&str]) -> ZoneConfigSpec {
    ZoneConfigSpec {
        zone: name.to_owned(),
        nodes: strings(nodes),
        ..Default::default()
    }
}

/// A cluster `c1` with a cluster-wide IPv4 pool and DNS, and its failure domains published.
pub(crate) fn cluster(allowed: &[&str], zones: Vec<ZoneConfigSpec>) -> ProxmoxCluster {
    let mut c = ProxmoxCluster::new(
        "c1",
        ProxmoxClusterSpec {
            allowed_nodes: strings(allowed),
            ipv4_config: ip("10.0.0.10-10.0.0.90", "10.0.0.1"),
            dns_servers: strings(&["10.0.0.2"]),
            zone_config: zones,
            ..Default::default()
        },
    );
    publish(&mut c);
    c
}

/// Writes the cluster's failure domains to its status, as the cluster controller does.
pub(crate) fn publish(cluster: &mut ProxmoxCluster) {
    let domains = failure_domains(cluster).unwrap_or_default();
    cluster.status = Some(ProxmoxClusterStatus {
        failure_domains: domains,
        ..Default::default()
    });
}

/// A machine cloning template 100 from pve1 with one NIC `net0` on the default IPv4 pool.
pub(crate) fn machine(name: &str, allowed: &[&str], network_zone: Option<&str>) -> ProxmoxMachine {
    ProxmoxMachine::new(
        name,
        ProxmoxMachineSpec {
            source_node: Some("pve1".to_owned()),
            template_id: Some(100),
            memory_mib: Some(2048),
            allowed_nodes: strings(allowed),
            network: NetworkSpec {
                zone: network_zone.map(str::to_owned),
                network_devices: vec![NetworkDevice {
                    name: "net0".to_owned(),
                    bridge: Some("vmbr0".to_owned()),
                    default_ipv4: Some(true),
                    ..Default::default()
                }],
                vrfs: vec![],
            },
            ..Default::default()
        },
    )
}

/// A CAPI Machine with an optional failure domain, role and controller owner.
pub(crate) fn capi_machine(
    name: &str,
    failure_domain: Option<&str>,
    control_plane: bool,
    owner: Option<(&str, &str)>,
) -> Machine {
    let mut m = Machine::new(
        name,
        MachineSpec {
            cluster_name: "c1".to_owned(),
            failure_domain: failure_domain.map(str::to_owned),
            ..Default::default()
        },
    );
    let mut l = BTreeMap::new();
    l.insert(labels::CLUSTER_NAME.to_owned(), "c1".to_owned());
    if control_plane {
        l.insert(labels::CONTROL_PLANE.to_owned(), String::new());
    }
    m.metadata.labels = Some(l);
    if let Some((kind, owner_name)) = owner {
        m.metadata.owner_references = Some(vec![OwnerReference {
            api_version: "controlplane.cluster.x-k8s.io/v1beta2".to_owned(),
            kind: kind.to_owned(),
            name: owner_name.to_owned(),
            uid: format!("uid-{owner_name}"),
            controller: Some(true),
            block_owner_deletion: Some(true),
        }]);
    }
    m
}

/// A resolved NIC `name` on vmbr0 with nothing else set (no pools, no DHCP).
pub(crate) fn resolved_nic(name: &str) -> super::ResolvedNic {
    super::ResolvedNic {
        name: name.to_owned(),
        bridge: Some("vmbr0".to_owned()),
        model: crate::api::NetworkModel::Virtio,
        mtu: None,
        vlan: None,
        queues: None,
        link_mtu: None,
        routes: Vec::new(),
        routing_policy: Vec::new(),
        pools: Vec::new(),
        dns_servers: Vec::new(),
        dhcp4: false,
        dhcp6: false,
    }
}
