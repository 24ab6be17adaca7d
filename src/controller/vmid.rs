//! VMIDs this controller is about to clone to.
//!
//! Proxmox's `/cluster/nextid` is a hint, not a reservation: until a clone creates the VM,
//! every reconcile that asks gets the same answer, and all but one clone would fail with
//! "already exists". A claim held from choosing the VMID until the clone request has been
//! answered makes reconciles running side by side choose different ones.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex, PoisonError};

/// The VMIDs claimed by reconciles of this process.
#[derive(Clone, Debug, Default)]
pub struct VmidClaims(Arc<Mutex<BTreeSet<u32>>>);

impl VmidClaims {
    /// Claims `vmid`, or `None` when another reconcile holds it.
    pub fn claim(&self, vmid: u32) -> Option<VmidClaim> {
        self.held().insert(vmid).then(|| VmidClaim {
            claims: self.clone(),
            vmid,
        })
    }

    fn held(&self) -> std::sync::MutexGuard<'_, BTreeSet<u32>> {
        // The set stays consistent whatever a panicking holder did: every change is one call.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A claimed VMID, given back when dropped.
#[derive(Debug)]
pub struct VmidClaim {
    claims: VmidClaims,
    vmid: u32,
}

impl VmidClaim {
    /// The claimed VMID.
    pub fn vmid(&self) -> u32 {
        self.vmid
    }
}

impl Drop for VmidClaim {
    fn drop(&mut self) {
        self.claims.held().remove(&self.vmid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_vmid_is_held_by_one_claim_until_it_is_dropped() {
        let claims = VmidClaims::default();
        let first = claims.claim(101).expect("free");
        assert_eq!(first.vmid(), 101);
        assert!(claims.claim(101).is_none(), "claimed twice");
        let other = claims.claim(102).expect("another VMID is free");
        drop(first);
        assert!(claims.claim(101).is_some(), "free again after the drop");
        assert!(claims.claim(102).is_none(), "still held");
        drop(other);
        assert!(claims.claim(102).is_some(), "free again after the drop");
    }
}
