//! Which machine each VMID belongs to, so no two ProxmoxMachines ever record the same one.
//!
//! Proxmox's `/cluster/nextid` is a hint, not a reservation: it names the lowest VMID without
//! a VM. Until a clone creates the VM, every reconcile that asks gets the same answer; and when
//! a clone does not happen (refused, a lock timeout, a failed task), the VMID is free again
//! although the machine has already recorded it in its status (intent first). So a claim ties
//! a VMID to the machine that chose it, from the choice until the machine is deleted, not only
//! while its clone request is under way: another machine then never chooses it, and the
//! machine itself retries its clone with it. Claims live in this process; [`VmidClaims::seed`]
//! first claims what the machines recorded before it started (an earlier leader's choices).

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

/// The VMIDs claimed by machines (by UID) in this process.
#[derive(Clone, Debug, Default)]
pub struct VmidClaims {
    held: Arc<Mutex<BTreeMap<u32, String>>>,
    seeded: Arc<tokio::sync::OnceCell<()>>,
}

impl VmidClaims {
    /// Claims `vmid` for `machine`: true when it was free or already the machine's, false
    /// when another machine holds it.
    pub fn claim(&self, vmid: u32, machine: &str) -> bool {
        let mut held = self.held();
        match held.get(&vmid) {
            Some(holder) => holder == machine,
            None => {
                held.insert(vmid, machine.to_owned());
                true
            }
        }
    }

    /// Gives `vmid` back if `machine` holds it (Proxmox has it in use by another VM).
    pub fn unclaim(&self, vmid: u32, machine: &str) {
        let mut held = self.held();
        if held.get(&vmid).is_some_and(|holder| holder == machine) {
            held.remove(&vmid);
        }
    }

    /// Gives back every VMID of `machine`, once it is deleted.
    pub fn release(&self, machine: &str) {
        self.held().retain(|_, holder| holder != machine);
    }

    /// The machine holding `vmid`, if any.
    pub fn holder(&self, vmid: u32) -> Option<String> {
        self.held().get(&vmid).cloned()
    }

    /// Once per process, before the first VMID is chosen: claims the VMIDs that `recorded`
    /// lists as `(machine, vmid)` (what the ProxmoxMachines recorded before this process
    /// started). Concurrent callers wait for the first; a failed listing is tried again.
    pub async fn seed<F, Fut, E>(&self, recorded: F) -> Result<(), E>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<Vec<(String, u32)>, E>>,
    {
        self.seeded
            .get_or_try_init(|| async {
                for (machine, vmid) in recorded().await? {
                    // A VMID recorded twice (by an older controller) stays with the first.
                    self.claim(vmid, &machine);
                }
                Ok(())
            })
            .await
            .map(|_| ())
    }

    fn held(&self) -> MutexGuard<'_, BTreeMap<u32, String>> {
        // The map stays consistent whatever a panicking holder did: every change is one call.
        self.held.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_vmid_stays_with_its_machine_until_the_machine_is_released() {
        let claims = VmidClaims::default();
        assert!(claims.claim(101, "a"));
        assert!(claims.claim(101, "a"), "the holder may claim it again");
        assert!(!claims.claim(101, "b"), "claimed by another machine");
        assert!(claims.claim(102, "a"), "a machine may hold several");
        assert!(claims.claim(103, "b"));
        claims.unclaim(103, "a");
        assert_eq!(
            claims.holder(103).as_deref(),
            Some("b"),
            "not a's to give back"
        );
        claims.unclaim(103, "b");
        assert_eq!(claims.holder(103), None);
        claims.release("a");
        assert_eq!((claims.holder(101), claims.holder(102)), (None, None));
        assert!(claims.claim(101, "b"), "free again once a is gone");
    }

    #[tokio::test]
    async fn seeding_claims_what_machines_recorded_once() {
        let claims = VmidClaims::default();
        let failed: Result<(), &str> = claims.seed(|| async { Err("list failed") }).await;
        assert_eq!(failed, Err("list failed"));
        let recorded = vec![
            ("a".to_owned(), 101),
            ("b".to_owned(), 101),
            ("b".to_owned(), 102),
        ];
        claims
            .seed(|| async { Ok::<_, &str>(recorded) })
            .await
            .expect("seeded");
        assert_eq!(
            claims.holder(101).as_deref(),
            Some("a"),
            "the first keeps it"
        );
        assert_eq!(claims.holder(102).as_deref(), Some("b"));
        claims
            .seed(|| async { Ok::<_, &str>(vec![("c".to_owned(), 103)]) })
            .await
            .expect("already seeded");
        assert_eq!(claims.holder(103), None, "seeded once only");
    }
}
