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

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::future::Future;
use std::ops::RangeInclusive;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

/// The VMIDs claimed by machines (by UID) in this process.
#[derive(Clone, Debug, Default)]
pub struct VmidClaims {
    held: Arc<Mutex<Held>>,
    seeded: Arc<tokio::sync::OnceCell<()>>,
}

/// The claims by VMID, and by machine so a deleted machine's are found without a scan.
#[derive(Debug, Default)]
struct Held {
    by_vmid: BTreeMap<u32, String>,
    by_machine: HashMap<String, BTreeSet<u32>>,
}

impl Held {
    fn insert(&mut self, vmid: u32, machine: &str) {
        self.by_vmid.insert(vmid, machine.to_owned());
        self.by_machine
            .entry(machine.to_owned())
            .or_default()
            .insert(vmid);
    }

    fn remove(&mut self, vmid: u32, machine: &str) {
        self.by_vmid.remove(&vmid);
        if let Some(vmids) = self.by_machine.get_mut(machine) {
            vmids.remove(&vmid);
            if vmids.is_empty() {
                self.by_machine.remove(machine);
            }
        }
    }
}

impl VmidClaims {
    /// Claims `vmid` for `machine`: true when it was free or already the machine's, false
    /// when another machine holds it.
    pub fn claim(&self, vmid: u32, machine: &str) -> bool {
        let mut held = self.held();
        match held.by_vmid.get(&vmid) {
            Some(holder) => holder == machine,
            None => {
                held.insert(vmid, machine);
                true
            }
        }
    }

    /// Claims for `machine` the first VMID of `range` that `in_use` does not name and no other
    /// machine holds (one it holds already counts as free): [`VmidClaims::claim`] of each in
    /// turn, under one lock. The held ones are stepped over by number (a fleet holds one per
    /// machine), and the machine's own come from its own set.
    pub fn claim_first_free(
        &self,
        range: RangeInclusive<u32>,
        machine: &str,
        in_use: impl Fn(u32) -> bool,
    ) -> Option<u32> {
        let mut held = self.held();
        let own = held
            .by_machine
            .get(machine)
            .filter(|_| !range.is_empty())
            .and_then(|own| {
                own.range(range.clone())
                    .copied()
                    .find(|&vmid| !in_use(vmid))
            });
        // A free one is claimed only if it comes before the machine's own.
        let search_end = own.map_or(Some(*range.end()), |own| own.checked_sub(1));
        // `BTreeMap::range` panics on a range that ends before it starts.
        let search_end = search_end.filter(|end| end >= range.start());
        let unheld = search_end.and_then(|end| {
            let mut claimed = held
                .by_vmid
                .range(*range.start()..=end)
                .map(|(vmid, _)| *vmid)
                .peekable();
            (*range.start()..=end).find(|&vmid| {
                while claimed.next_if(|other| *other < vmid).is_some() {}
                claimed.next_if_eq(&vmid).is_none() && !in_use(vmid)
            })
        });
        match (unheld, own) {
            (Some(vmid), _) => {
                held.insert(vmid, machine);
                Some(vmid)
            }
            (None, own) => own,
        }
    }

    /// Gives `vmid` back if `machine` holds it (Proxmox has it in use by another VM).
    pub fn unclaim(&self, vmid: u32, machine: &str) {
        let mut held = self.held();
        if held
            .by_vmid
            .get(&vmid)
            .is_some_and(|holder| holder == machine)
        {
            held.remove(vmid, machine);
        }
    }

    /// Gives back every VMID of `machine`, once it is deleted.
    pub fn release(&self, machine: &str) {
        let mut held = self.held();
        for vmid in held.by_machine.remove(machine).unwrap_or_default() {
            held.by_vmid.remove(&vmid);
        }
    }

    /// The machine holding `vmid`, if any.
    pub fn holder(&self, vmid: u32) -> Option<String> {
        self.held().by_vmid.get(&vmid).cloned()
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

    fn held(&self) -> MutexGuard<'_, Held> {
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

    #[test]
    fn the_first_free_vmid_of_a_range_skips_those_in_use_and_those_other_machines_hold() {
        let claims = VmidClaims::default();
        for (vmid, machine) in [(100, "a"), (101, "b"), (103, "c"), (104, "a")] {
            assert!(claims.claim(vmid, machine));
        }
        let listed = |vmid: u32| vmid == 102;
        assert_eq!(
            claims.claim_first_free(100..=110, "a", listed),
            Some(100),
            "one it holds already"
        );
        assert_eq!(claims.claim_first_free(101..=110, "d", listed), Some(105));
        assert_eq!(claims.holder(105).as_deref(), Some("d"));
        assert_eq!(
            claims.claim_first_free(101..=105, "e", listed),
            None,
            "every one listed or held"
        );
        // The same answers as claiming one after another.
        let one_by_one = VmidClaims::default();
        for (vmid, machine) in [(100, "a"), (101, "b"), (103, "c"), (104, "a"), (105, "d")] {
            assert!(one_by_one.claim(vmid, machine));
        }
        let first = (101..=110).find(|&vmid| !listed(vmid) && one_by_one.claim(vmid, "f"));
        assert_eq!(claims.claim_first_free(101..=110, "f", listed), first);
        claims.release("a");
        assert_eq!((claims.holder(100), claims.holder(104)), (None, None));
        assert_eq!(claims.holder(101).as_deref(), Some("b"));
        assert_eq!(claims.claim_first_free(100..=110, "g", listed), Some(100));
    }

    proptest::proptest! {
        #[test]
        fn the_first_free_vmid_is_the_one_claiming_each_in_turn_finds(
            claims in proptest::collection::vec((100u32..140, 0usize..4), 0..40),
            listed in proptest::collection::btree_set(100u32..140, 0..10),
            machine in 0usize..4,
            start in 95u32..145,
            len in 0u32..50,
        ) {
            let machines = ["a", "b", "c", "d"];
            let (fast, one_by_one) = (VmidClaims::default(), VmidClaims::default());
            for (vmid, holder) in &claims {
                fast.claim(*vmid, machines[*holder]);
                one_by_one.claim(*vmid, machines[*holder]);
            }
            let in_use = |vmid: u32| listed.contains(&vmid);
            let end = start.saturating_add(len).saturating_sub(5);
            let expected = (start..=end)
                .find(|&vmid| !in_use(vmid) && one_by_one.claim(vmid, machines[machine]));
            proptest::prop_assert_eq!(
                fast.claim_first_free(start..=end, machines[machine], in_use),
                expected
            );
            proptest::prop_assert_eq!(
                &fast.held().by_vmid,
                &one_by_one.held().by_vmid
            );
        }
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
