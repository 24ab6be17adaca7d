//! What of the objects a machine depends on its passes read: a change to anything else (the
//! conditions and counters Cluster API and the cluster reconciler keep updating) wakes no
//! machine. Each returns a hash for the watches' `predicate_filter`. Only a machine's own
//! deletion wakes it: the deletion of the objects it depends on is not read by a pass (Cluster
//! API deletes the ProxmoxMachine itself when it deletes its Machine or Cluster).

use std::hash::{Hash, Hasher};

use kube::api::ObjectMeta;
use serde::Serialize;

use crate::api::{ProxmoxCluster, ProxmoxMachine};
use crate::capi;

/// A ProxmoxMachine beyond its status: a change to it wakes the machine, while a change to its
/// status alone (a pass's own write) does not, since that pass set its own requeue.
pub(super) fn beyond_status(machine: &ProxmoxMachine) -> Option<u64> {
    let deletion = machine
        .metadata
        .deletion_timestamp
        .as_ref()
        .map(|t| t.0.as_millisecond());
    hashed(&machine.metadata, &(&machine.metadata.finalizers, deletion))
}

/// A CAPI Machine: its identity, bootstrap data, failure domain and whether its node joined.
pub(super) fn read_of_capi_machine(machine: &capi::Machine) -> Option<u64> {
    let spec = &machine.spec;
    let node_joined = machine
        .status
        .as_ref()
        .is_some_and(|s| s.node_ref.is_some());
    let parts = (
        spec.bootstrap.as_ref().map(|b| &b.data_secret_name),
        &spec.failure_domain,
        &spec.provider_id,
        node_joined,
    );
    hashed(&machine.metadata, &parts)
}

/// A CAPI Cluster as capmox's view of it holds it (pause, infrastructure reference and
/// readiness; not its conditions or replica counters).
pub(super) fn read_of_capi_cluster(cluster: &capi::Cluster) -> Option<u64> {
    hashed(&cluster.metadata, &(&cluster.spec, &cluster.status))
}

/// A ProxmoxCluster: its spec and what its status publishes (failure domains, pools,
/// readiness), not its conditions.
pub(super) fn read_of_cluster(cluster: &ProxmoxCluster) -> Option<u64> {
    let status = cluster.status.as_ref().map(|s| {
        (
            &s.initialization,
            &s.failure_domains,
            &s.in_cluster_ip_pool_ref,
            &s.in_cluster_zone_ref,
        )
    });
    hashed(&cluster.metadata, &(&cluster.spec, status))
}

/// The metadata a pass reads (generation, labels, annotations, owners) and `parts`.
fn hashed(meta: &ObjectMeta, parts: &impl Serialize) -> Option<u64> {
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    meta.generation.hash(&mut hasher);
    meta.labels.hash(&mut hasher);
    meta.annotations.hash(&mut hasher);
    for owner in meta.owner_references.iter().flatten() {
        (&owner.uid, &owner.kind, &owner.name, owner.controller).hash(&mut hasher);
    }
    // A value that does not serialize (none of these types can fail) wakes rather than hides.
    serde_json::to_vec(parts).ok()?.hash(&mut hasher);
    Some(hasher.finish())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_capi_machine_wakes_its_machine_only_when_what_a_pass_reads_changes() {
        let machine: capi::Machine = serde_json::from_value(serde_json::json!({
            "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Machine",
            "metadata": {"name": "m1", "namespace": "default", "generation": 1},
            "spec": {"clusterName": "c1", "bootstrap": {}}
        }))
        .expect("a Machine");
        let read = read_of_capi_machine(&machine);
        let with_status = |status: serde_json::Value| {
            let mut changed = serde_json::to_value(&machine).expect("serializable");
            changed["status"] = status;
            serde_json::from_value::<capi::Machine>(changed).expect("a Machine")
        };
        let progressed = with_status(serde_json::json!({
            "phase": "Provisioning",
            "conditions": [{"type": "Ready", "status": "False", "reason": "X",
                "lastTransitionTime": "2026-01-01T00:00:00Z"}],
            "addresses": [{"type": "InternalIP", "address": "10.0.0.5"}]
        }));
        assert_eq!(
            read_of_capi_machine(&progressed),
            read,
            "a status change of its own"
        );
        let joined = with_status(serde_json::json!({"nodeRef": {"name": "m1"}}));
        assert_ne!(read_of_capi_machine(&joined), read, "the node joined");
        let mut bootstrapped = machine.clone();
        bootstrapped.spec.bootstrap = Some(capi::MachineBootstrap {
            data_secret_name: Some("m1-bootstrap".into()),
        });
        assert_ne!(
            read_of_capi_machine(&bootstrapped),
            read,
            "bootstrap data named"
        );
        let mut deleting = machine.clone();
        deleting.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
            ));
        assert_eq!(
            read_of_capi_machine(&deleting),
            read,
            "deleted: Cluster API deletes the ProxmoxMachine next, which wakes it"
        );
    }

    #[test]
    fn a_cluster_wakes_its_machines_only_when_what_a_pass_reads_changes() {
        let cluster: ProxmoxCluster = serde_json::from_value(serde_json::json!({
            "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha2", "kind": "ProxmoxCluster",
            "metadata": {"name": "c1", "namespace": "default", "generation": 1},
            "spec": {"allowedNodes": ["pve1"], "dnsServers": ["10.0.0.1"]},
            "status": {"failureDomains": [{"name": "rack-a", "controlPlane": true}]}
        }))
        .expect("a ProxmoxCluster");
        let read = read_of_cluster(&cluster);
        let mut reported = cluster.clone();
        if let Some(status) = reported.status.as_mut() {
            status.conditions = vec![
                serde_json::from_value(serde_json::json!({
                    "type": "Ready", "status": "False", "reason": "ZoneDown", "message": "",
                    "lastTransitionTime": "2026-01-01T00:00:00Z"
                }))
                .expect("a condition"),
            ];
        }
        assert_eq!(read_of_cluster(&reported), read, "a condition of its own");
        let mut drained = cluster.clone();
        if let Some(status) = drained.status.as_mut() {
            status.failure_domains[0].control_plane = Some(false);
        }
        assert_ne!(read_of_cluster(&drained), read, "a failure domain changed");

        let capi_cluster: capi::Cluster = serde_json::from_value(serde_json::json!({
            "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Cluster",
            "metadata": {"name": "c1", "namespace": "default", "generation": 1},
            "spec": {},
            "status": {"workers": {"readyReplicas": 3}, "phase": "Provisioned"}
        }))
        .expect("a Cluster");
        let read = read_of_capi_cluster(&capi_cluster);
        let counted: capi::Cluster = serde_json::from_value(serde_json::json!({
            "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Cluster",
            "metadata": {"name": "c1", "namespace": "default", "generation": 1},
            "spec": {},
            "status": {"workers": {"readyReplicas": 4}, "phase": "Provisioned"}
        }))
        .expect("a Cluster");
        assert_eq!(read_of_capi_cluster(&counted), read, "its replica counters");
        let mut deleting = capi_cluster.clone();
        deleting.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
            ));
        assert_eq!(
            read_of_capi_cluster(&deleting),
            read,
            "deleted: each of its machines is woken by its own deletion"
        );
        let mut paused = capi_cluster.clone();
        paused.spec.paused = Some(true);
        assert_ne!(read_of_capi_cluster(&paused), read, "paused");
        let mut provisioned = capi_cluster.clone();
        provisioned.status = Some(capi::ClusterStatus {
            initialization: Some(capi::ClusterInitialization {
                infrastructure_provisioned: Some(true),
                control_plane_initialized: None,
            }),
            ..Default::default()
        });
        assert_ne!(
            read_of_capi_cluster(&provisioned),
            read,
            "infrastructure provisioned"
        );
    }
}
