//! The machine's static addresses: one IPAddressClaim per NIC and pool, read back once bound.

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::PostParams;
use kube::{Api, Resource, ResourceExt};

use super::{MachineError, Reconcile, Scope};
use crate::api::{
    IpAddressesSpec, MachineAddress, MachineAddressType, ProxmoxMachine, annotations, labels,
};
use crate::capi::{self, IPAddress, IPAddressClaim, IpPoolReference};
use crate::controller::caches::Reads;
use crate::placement::{self, Placement, PoolClaim};

impl Reconcile<'_> {
    /// Ensures one claim per (NIC, pool) and returns the bound addresses, or `None` while any is pending.
    pub(super) async fn addresses(
        &self,
        scope: &Scope,
        placement: &Placement,
    ) -> Result<Option<Addresses>, MachineError> {
        let mut result = Addresses::default();
        let mut pending = false;
        let mut default_entry = IpAddressesSpec {
            net: "default".into(),
            ..IpAddressesSpec::default()
        };
        for nic in placement.network_devices() {
            let mut entry = IpAddressesSpec {
                net: nic.name.clone(),
                ..IpAddressesSpec::default()
            };
            for pool in &nic.pools {
                let Some(address) = self.bound_address(scope, pool).await? else {
                    pending = true;
                    continue;
                };
                let parsed: Option<std::net::IpAddr> = address.spec.address.parse().ok();
                let is_v6 = parsed.is_some_and(|a| a.is_ipv6());
                let list = if is_v6 {
                    &mut entry.ipv6
                } else {
                    &mut entry.ipv4
                };
                list.push(address.spec.address.clone());
                if pool.default_gateway {
                    let list = if is_v6 {
                        &mut default_entry.ipv6
                    } else {
                        &mut default_entry.ipv4
                    };
                    list.push(address.spec.address.clone());
                }
                result.bound.push(BoundAddress {
                    nic: nic.name.clone(),
                    address: address.spec.address.clone(),
                    prefix: address.spec.prefix,
                    gateway: address.spec.gateway.clone(),
                    default_gateway: pool.default_gateway,
                    pool: pool.pool.clone(),
                });
            }
            result.status.push(entry);
        }
        if pending {
            return Ok(None);
        }
        if !default_entry.ipv4.is_empty() || !default_entry.ipv6.is_empty() {
            result.status.insert(0, default_entry);
        }
        Ok(Some(result))
    }

    /// The address bound to the machine's claim on `pool`, claiming it first; `None` while the
    /// IPAM provider has not bound it.
    async fn bound_address(
        &self,
        scope: &Scope,
        pool: &PoolClaim,
    ) -> Result<Option<Arc<IPAddress>>, MachineError> {
        let reads = self.reads();
        let claim = match reads
            .get::<IPAddressClaim>(&scope.namespace, &pool.claim_name)
            .await?
        {
            Some(claim) => claim,
            None => match self.create_claim(scope, pool).await? {
                Some(claim) => claim,
                None => return Ok(None),
            },
        };
        let Some(address_name) = claim
            .status
            .as_ref()
            .and_then(|s| s.address_ref.as_ref())
            .map(|r| r.name.clone())
        else {
            return Ok(None);
        };
        Ok(reads
            .get::<IPAddress>(&scope.namespace, &address_name)
            .await?)
    }

    /// Creates the machine's claim on `pool`, owned by the machine; `None` when it exists
    /// already (another pass made it; the watch brings it).
    async fn create_claim(
        &self,
        scope: &Scope,
        pool: &PoolClaim,
    ) -> Result<Option<Arc<IPAddressClaim>>, MachineError> {
        let owner = OwnerReference {
            api_version: ProxmoxMachine::api_version(&()).into_owned(),
            kind: ProxmoxMachine::kind(&()).into_owned(),
            name: scope.name.clone(),
            uid: self.machine.metadata.uid.clone().unwrap_or_default(),
            controller: Some(true),
            block_owner_deletion: Some(true),
        };
        let mut claim = IPAddressClaim::new(
            &pool.claim_name,
            capi::IpAddressClaimSpec {
                pool_ref: IpPoolReference {
                    api_group: pool.pool.api_group.clone(),
                    kind: pool.pool.kind.clone(),
                    name: pool.pool.name.clone(),
                },
                cluster_name: Some(scope.cluster_name.clone()),
            },
        );
        claim.metadata.namespace = Some(scope.namespace.clone());
        let mut claim_labels =
            BTreeMap::from([(labels::CLUSTER_NAME.to_owned(), scope.cluster_name.clone())]);
        if let Some(zone) = &pool.zone_label {
            claim_labels.insert(labels::PROXMOX_ZONE.to_owned(), zone.clone());
        }
        claim.metadata.labels = Some(claim_labels);
        let mut claim_annotations = BTreeMap::from([(
            annotations::POOL_REF_COUNTER.to_owned(),
            pool.index.to_string(),
        )]);
        if pool.default_gateway {
            claim_annotations.insert(annotations::DEFAULT_GATEWAY.to_owned(), "true".into());
        }
        claim.metadata.annotations = Some(claim_annotations);
        claim.metadata.owner_references = Some(vec![owner.clone()]);
        let claims: Api<IPAddressClaim> =
            Api::namespaced(self.context.client.clone(), &scope.namespace);
        match claims.create(&PostParams::default(), &claim).await {
            Ok(created) => {
                self.context.own_writes.created(&created);
                Ok(Some(Arc::new(created)))
            }
            Err(kube::Error::Api(status)) if status.code == 409 => Ok(None),
            Err(error) => Err(error.into()),
        }
    }
}

/// Addresses bound to the machine's claims.
#[derive(Default)]
pub(super) struct Addresses {
    /// `status.ipAddresses`: `default` first, then one entry per NIC.
    pub(super) status: Vec<IpAddressesSpec>,
    /// Every bound address with its NIC, for cloud-init.
    pub(super) bound: Vec<BoundAddress>,
}

/// One bound address of a NIC.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BoundAddress {
    /// `netN`.
    pub nic: String,
    /// The address.
    pub address: String,
    /// Prefix length.
    pub prefix: i32,
    /// Gateway of its pool.
    pub gateway: Option<String>,
    /// From a default pool: its gateway carries the default route.
    pub default_gateway: bool,
    /// The pool it came from (whose annotation may carry the default route's metric).
    pub pool: placement::PoolRef,
}

/// The gateway metric a pool carries in its annotation (the cluster's pools have one).
pub(super) async fn pool_metric(
    reads: Reads<'_>,
    namespace: &str,
    pool: &placement::PoolRef,
) -> Option<u32> {
    if pool.kind != placement::IN_CLUSTER_IP_POOL_KIND {
        return None;
    }
    let found = reads
        .get::<capi::InClusterIPPool>(namespace, &pool.name)
        .await
        .ok()??;
    found
        .annotations()
        .get(annotations::GATEWAY_METRIC)?
        .parse()
        .ok()
}

pub(super) fn machine_addresses(name: &str, addresses: &[IpAddressesSpec]) -> Vec<MachineAddress> {
    let mut out = vec![MachineAddress {
        type_: MachineAddressType::Hostname,
        address: name.to_owned(),
    }];
    if let Some(default) = addresses.iter().find(|a| a.net == "default") {
        for address in default.ipv4.iter().chain(&default.ipv6) {
            out.push(MachineAddress {
                type_: MachineAddressType::InternalIp,
                address: address.clone(),
            });
        }
    }
    out
}
