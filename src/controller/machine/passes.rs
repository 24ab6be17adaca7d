//! The machines a pass runs for now, and whether what they depend on changed meanwhile. A
//! change during a pass is not queued behind it: the pass's end decides whether it is read at
//! once (another pass) or at the requeue the pass set for its Proxmox task, whose pass reads
//! the caches then. After a restart: no pass runs, so there is nothing to remember.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use kube::runtime::reflector::ObjectRef;

use crate::api::ProxmoxMachine;

/// The passes running now, shared by the reconciles and the watches that wake machines.
#[derive(Clone, Debug, Default)]
pub struct Passes {
    /// Each running pass's machine, with whether a change to it came in since it started.
    running: Arc<Mutex<HashMap<ObjectRef<ProxmoxMachine>, bool>>>,
}

/// A pass that runs until dropped.
#[derive(Debug)]
pub struct Running {
    passes: Passes,
    machine: ObjectRef<ProxmoxMachine>,
}

impl Passes {
    fn running(&self) -> MutexGuard<'_, HashMap<ObjectRef<ProxmoxMachine>, bool>> {
        // Never held across a panic-prone call: a poisoned map is still consistent.
        self.running
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Notes that a pass of `machine` starts.
    pub fn start(&self, machine: ObjectRef<ProxmoxMachine>) -> Running {
        self.running().insert(machine.clone(), false);
        Running {
            passes: self.clone(),
            machine,
        }
    }

    /// Notes a change to `machine` (or to what it depends on) if a pass of it runs: `true`
    /// means that pass's end takes care of it, so the change need not queue another.
    pub fn changed_during(&self, machine: &ObjectRef<ProxmoxMachine>) -> bool {
        match self.running().get_mut(machine) {
            Some(changed) => {
                *changed = true;
                true
            }
            None => false,
        }
    }
}

impl Running {
    /// Ends the pass: whether a change came in while it ran.
    pub fn changed(self) -> bool {
        // Read as it is removed, so a change cannot slip in between and be lost.
        self.passes.running().remove(&self.machine).unwrap_or(false)
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.passes.running().remove(&self.machine);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_change_during_a_pass_is_left_to_its_end_and_one_after_it_is_not() {
        let passes = Passes::default();
        let m1 = ObjectRef::new("m1").within("default");
        let m2 = ObjectRef::new("m2").within("default");
        assert!(!passes.changed_during(&m1), "no pass runs");
        let running = passes.start(m1.clone());
        assert!(!passes.changed_during(&m2), "another machine's change");
        assert!(passes.changed_during(&m1));
        assert!(running.changed(), "the pass's end sees the change");
        assert!(!passes.changed_during(&m1), "the pass ended");
        let quiet = passes.start(m1.clone());
        assert!(!quiet.changed(), "nothing changed during this pass");
        {
            let _cancelled = passes.start(m1.clone());
        }
        assert!(
            !passes.changed_during(&m1),
            "a pass dropped unfinished ends too"
        );
    }
}
