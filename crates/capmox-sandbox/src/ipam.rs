//! A stand-in for the CAPI in-cluster IPAM provider: binds each `IPAddressClaim` to the lowest
//! free address of its `InClusterIPPool` or `GlobalInClusterIPPool` by creating an `IPAddress`
//! and setting `status.addressRef`. Not the real provider; just enough for the sandbox, tests and
//! benchmarks. Simplifications: IPv4 and IPv6 ranges, CIDRs and single addresses are supported;
//! excluded addresses and reserved network/broadcast handling are not.

use std::collections::{BTreeSet, HashMap};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use kube::api::{Patch, PatchParams, PostParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, Resource, ResourceExt};
use serde_json::json;
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;

use capmox::capi::{
    GlobalInClusterIPPool, IPAddress, IPAddressClaim, InClusterIPPool, PoolAddresses,
};

/// Why a claim could not be bound (retried).
#[derive(Debug, thiserror::Error)]
pub enum IpamError {
    /// A Kubernetes call failed.
    #[error("Kubernetes API error: {0}")]
    Kube(#[from] kube::Error),
    /// The pool does not exist or has no free address.
    #[error("{0}")]
    Pool(String),
}

struct State {
    client: Client,
    /// Every IPAddress, kept by a watch: a claim's allocation reads no list of the whole fleet.
    addresses: Store<IPAddress>,
    /// Serialises allocation so two claims never get the same address; holds the addresses
    /// created here that the watch may not have delivered yet, by object.
    allocated: Mutex<HashMap<ObjectRef<IPAddress>, (String, IpAddr)>>,
}

impl State {
    /// The addresses of the pool `pool` in use: those the watch shows, and those created here
    /// that it does not show yet (`allocated`, pruned of the ones it shows).
    fn taken(
        &self,
        pool: &capmox::capi::IpPoolReference,
        allocated: &mut HashMap<ObjectRef<IPAddress>, (String, IpAddr)>,
    ) -> BTreeSet<IpAddr> {
        allocated.retain(|created, _| self.addresses.get(created).is_none());
        let mut taken = BTreeSet::new();
        for address in self.addresses.state() {
            if address.spec.pool_ref.name == pool.name && address.spec.pool_ref.kind == pool.kind {
                taken.extend(address.spec.address.parse::<IpAddr>().ok());
            }
        }
        let key = pool_key(pool);
        taken.extend(
            allocated
                .values()
                .filter(|(of, _)| *of == key)
                .map(|(_, ip)| *ip),
        );
        taken
    }
}

fn pool_key(pool: &capmox::capi::IpPoolReference) -> String {
    format!("{}/{}", pool.kind, pool.name)
}

/// Runs the IPAM stand-in until `shutdown` is cancelled.
pub async fn run(client: Client, shutdown: CancellationToken) {
    let (addresses, writer) = reflector::store();
    let watched = reflector::reflector(
        writer,
        watcher(
            Api::<IPAddress>::all(client.clone()),
            watcher::Config::default(),
        )
        .default_backoff(),
    )
    .for_each(|_| async {});
    let stop = shutdown.clone();
    tokio::spawn(async move {
        tokio::select! {
            () = watched => {}
            () = stop.cancelled() => {}
        }
    });
    let state = Arc::new(State {
        client: client.clone(),
        addresses,
        allocated: Mutex::new(HashMap::new()),
    });
    Controller::new(
        Api::<IPAddressClaim>::all(client),
        watcher::Config::default(),
    )
    .graceful_shutdown_on(shutdown.cancelled_owned())
    .run(
        reconcile,
        |_, error, _| {
            tracing::debug!(%error, "IPAM stand-in: retrying a claim");
            Action::requeue(Duration::from_millis(500))
        },
        state,
    )
    .for_each(|_| async {})
    .await;
}

async fn reconcile(claim: Arc<IPAddressClaim>, state: Arc<State>) -> Result<Action, IpamError> {
    if claim
        .status
        .as_ref()
        .and_then(|s| s.address_ref.as_ref())
        .is_some()
        || claim.meta().deletion_timestamp.is_some()
    {
        return Ok(Action::await_change());
    }
    let namespace = claim.namespace().unwrap_or_default();
    let name = claim.name_any();
    let pool = pool_addresses(&state.client, &namespace, &claim).await?;
    // Until the watch has listed every address, any could be taken.
    state
        .addresses
        .wait_until_ready()
        .await
        .map_err(|_| IpamError::Pool("the IPAddress watch ended".into()))?;
    let mut allocated = state.allocated.lock().await;
    let addresses: Api<IPAddress> = Api::namespaced(state.client.clone(), &namespace);
    let taken = state.taken(&claim.spec.pool_ref, &mut allocated);
    let free = candidates(&pool.addresses)
        .into_iter()
        .find(|a| !taken.contains(a) && pool.gateway.as_deref() != Some(a.to_string().as_str()))
        .ok_or_else(|| {
            IpamError::Pool(format!(
                "pool {} has no free address",
                claim.spec.pool_ref.name
            ))
        })?;
    let mut address = IPAddress::new(
        &name,
        capmox::capi::IpAddressSpec {
            address: free.to_string(),
            prefix: pool.prefix,
            gateway: pool.gateway.clone(),
            claim_ref: capmox::api::LocalObjectReference { name: name.clone() },
            pool_ref: claim.spec.pool_ref.clone(),
        },
    );
    address.metadata.namespace = Some(namespace.clone());
    address.metadata.owner_references = claim.controller_owner_ref(&()).map(|mut o| {
        o.controller = Some(false);
        vec![o]
    });
    match addresses.create(&PostParams::default(), &address).await {
        Ok(created) => {
            allocated.insert(
                ObjectRef::from_obj(&created),
                (pool_key(&claim.spec.pool_ref), free),
            );
        }
        Err(kube::Error::Api(status)) if status.code == 409 => {}
        Err(error) => return Err(error.into()),
    }
    drop(allocated);
    let claims: Api<IPAddressClaim> = Api::namespaced(state.client.clone(), &namespace);
    claims
        .patch_status(
            &name,
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"addressRef": {"name": name}}})),
        )
        .await?;
    Ok(Action::await_change())
}

async fn pool_addresses(
    client: &Client,
    namespace: &str,
    claim: &IPAddressClaim,
) -> Result<PoolAddresses, IpamError> {
    let reference = &claim.spec.pool_ref;
    let found = match reference.kind.as_str() {
        "InClusterIPPool" => Api::<InClusterIPPool>::namespaced(client.clone(), namespace)
            .get_opt(&reference.name)
            .await?
            .map(|p| p.spec.pool),
        "GlobalInClusterIPPool" => Api::<GlobalInClusterIPPool>::all(client.clone())
            .get_opt(&reference.name)
            .await?
            .map(|p| p.spec.pool),
        other => return Err(IpamError::Pool(format!("unsupported pool kind {other}"))),
    };
    found.ok_or_else(|| IpamError::Pool(format!("pool {} not found yet", reference.name)))
}

/// Every address the pool's entries describe, in order (ranges `a-b`, CIDRs, single addresses),
/// capped at 4096 per entry.
pub fn candidates(entries: &[String]) -> Vec<IpAddr> {
    let mut out = Vec::new();
    for entry in entries {
        let entry = entry.trim();
        if let Some((first, last)) = entry.split_once('-') {
            if let (Ok(first), Ok(last)) = (
                first.trim().parse::<IpAddr>(),
                last.trim().parse::<IpAddr>(),
            ) {
                let (start, end) = (to_u128(first), to_u128(last));
                out.extend(
                    (start..=end)
                        .take(4096)
                        .map(|n| from_u128(n, first.is_ipv4())),
                );
            }
        } else if let Some((base, bits)) = entry.split_once('/') {
            if let (Ok(base), Ok(bits)) = (base.parse::<IpAddr>(), bits.parse::<u32>()) {
                let width: u32 = if base.is_ipv4() { 32 } else { 128 };
                let host_bits = width.saturating_sub(bits);
                let size: u128 = if host_bits >= 127 {
                    u128::MAX
                } else {
                    1u128 << host_bits
                };
                let network = to_u128(base) & !(size.wrapping_sub(1));
                // Skip the network address (and, for IPv4 networks larger than /31, broadcast).
                let usable_end = if base.is_ipv4() && size > 2 {
                    network + size - 2
                } else {
                    network + size - 1
                };
                out.extend(
                    (network + 1..=usable_end)
                        .take(4096)
                        .map(|n| from_u128(n, base.is_ipv4())),
                );
            }
        } else if let Ok(single) = entry.parse::<IpAddr>() {
            out.push(single);
        }
    }
    out
}

fn to_u128(address: IpAddr) -> u128 {
    match address {
        IpAddr::V4(v4) => u128::from(u32::from(v4)),
        IpAddr::V6(v6) => u128::from(v6),
    }
}

fn from_u128(value: u128, v4: bool) -> IpAddr {
    if v4 {
        // Ranges of IPv4 entries stay below 2^32: both ends were IPv4 addresses.
        IpAddr::V4(std::net::Ipv4Addr::from(
            u32::try_from(value).unwrap_or(u32::MAX),
        ))
    } else {
        IpAddr::V6(std::net::Ipv6Addr::from(value))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_cidrs_and_single_addresses_expand_in_order() {
        let found: Vec<String> = candidates(&[
            "10.0.0.10-10.0.0.12".into(),
            "10.0.1.0/30".into(),
            "10.0.2.7".into(),
            "2001:db8::1-2001:db8::2".into(),
        ])
        .iter()
        .map(ToString::to_string)
        .collect();
        assert_eq!(
            found,
            [
                "10.0.0.10",
                "10.0.0.11",
                "10.0.0.12",
                "10.0.1.1",
                "10.0.1.2",
                "10.0.2.7",
                "2001:db8::1",
                "2001:db8::2"
            ]
        );
    }
}
