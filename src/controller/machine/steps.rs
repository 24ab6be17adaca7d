//! The order of a provisioning pass once the machine's VM exists, decided from what the pass
//! saw: a pure function, so the order is tested apart from Proxmox and Kubernetes. A pass runs
//! the phases in order and stops at the first that waits (for a task, the guest, addresses).

/// What tells that the guest is up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum GuestCheck {
    /// `cloud-init status` through the guest agent reports done.
    CloudInit,
    /// The guest agent answers.
    Agent,
    /// Nothing: the machine is provisioned once its VM runs.
    None,
}

/// What a pass saw of the machine's VM (found, and no clone running on it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Seen {
    /// The VM runs.
    pub running: bool,
    /// A running VM still carries the tags of the machine a move or restore replaced.
    pub retag: bool,
    /// This pass saw the seed ISO's upload end: only its attachment and the start are left.
    pub seed_iso_uploaded: bool,
    /// The VM started, or its guest was looked at, too recently for a look now.
    pub started: bool,
    /// The machine was provisioned before this pass.
    pub provisioned: bool,
    /// What tells that the guest is up.
    pub guest_check: GuestCheck,
    /// The CAPI Machine has its node: the seed ISO (it holds the bootstrap token) can go.
    pub node_joined: bool,
    /// This process saw the seed ISO removed.
    pub seed_iso_removed: bool,
    /// This pass saw the seed ISO's deletion end: only its detachment is left.
    pub seed_iso_deleted: bool,
    /// HA is on for the machine and its registration is not known to be complete.
    pub ha_pending: bool,
}

impl Seen {
    /// Whether this pass's plan waits for the guest to be up: once provisioned, the boot checks
    /// are history, and some machines skip them.
    pub(super) fn guest_checked(&self) -> bool {
        !self.provisioned && self.guest_check != GuestCheck::None
    }
}

/// One phase of a provisioning pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Phase {
    /// Read the config, record the provider ID and zone label, bring the config to the spec
    /// (a disk resize is a task).
    Configure,
    /// Put this machine's tag on a running VM it adopted.
    Retag,
    /// Build and upload (a task) the seed ISO, and attach it.
    Bootstrap,
    /// Start the VM (a task).
    Start,
    /// Make the running VM an HA resource in its zone's rule or group (Proxmox HA); only
    /// after capmox started it, so HA never starts a VM without its seed ISO.
    RegisterHa,
    /// Wait until the guest is up.
    CheckGuest(GuestCheck),
    /// Wait until guests usually are done booting, without looking (the VM just started).
    AwaitBoot,
    /// Record the machine provisioned: provider ID, addresses, readiness.
    Provisioned,
    /// Delete the seed ISO (a task), then detach it.
    RemoveSeedIso,
    /// Detach the seed ISO whose deletion ended.
    DetachSeedIso,
}

/// The phases a pass goes through, in order.
pub(super) fn plan(seen: Seen) -> Vec<Phase> {
    let mut phases = Vec::new();
    if !seen.running {
        // A VM that does not run (new, or stopped by someone) is configured, bootstrapped and
        // started; after the upload, the pass that uploaded has configured it.
        if !seen.seed_iso_uploaded {
            phases.push(Phase::Configure);
        }
        phases.extend([Phase::Bootstrap, Phase::Start]);
    } else {
        if seen.retag {
            phases.push(Phase::Retag);
        }
        if seen.ha_pending {
            phases.push(Phase::RegisterHa);
        }
    }
    // Once provisioned, the boot checks are history: later passes only observe the VM.
    if seen.guest_checked() {
        phases.push(if seen.started {
            Phase::AwaitBoot
        } else {
            Phase::CheckGuest(seen.guest_check)
        });
    }
    phases.push(Phase::Provisioned);
    if seen.node_joined && !seen.seed_iso_removed {
        phases.push(if seen.seed_iso_deleted {
            Phase::DetachSeedIso
        } else {
            Phase::RemoveSeedIso
        });
    }
    phases
}

#[cfg(test)]
mod tests {
    use super::*;

    fn new_vm() -> Seen {
        Seen {
            running: false,
            retag: false,
            seed_iso_uploaded: false,
            started: false,
            provisioned: false,
            guest_check: GuestCheck::CloudInit,
            node_joined: false,
            seed_iso_removed: false,
            seed_iso_deleted: false,
            ha_pending: false,
        }
    }

    #[test]
    fn ha_registration_waits_until_the_vm_runs() {
        let stopped = Seen {
            ha_pending: true,
            ..new_vm()
        };
        assert!(!plan(stopped).contains(&Phase::RegisterHa));
        let running = Seen {
            running: true,
            ..stopped
        };
        assert_eq!(
            plan(running),
            [
                Phase::RegisterHa,
                Phase::CheckGuest(GuestCheck::CloudInit),
                Phase::Provisioned
            ]
        );
        let registered = Seen {
            ha_pending: false,
            ..running
        };
        assert!(!plan(registered).contains(&Phase::RegisterHa));
    }

    #[test]
    fn a_new_vm_is_configured_bootstrapped_started_and_waited_for() {
        assert_eq!(
            plan(new_vm()),
            [
                Phase::Configure,
                Phase::Bootstrap,
                Phase::Start,
                Phase::CheckGuest(GuestCheck::CloudInit),
                Phase::Provisioned
            ]
        );
    }

    #[test]
    fn after_the_upload_only_the_attachment_and_start_are_left() {
        let seen = Seen {
            seed_iso_uploaded: true,
            ..new_vm()
        };
        assert_eq!(plan(seen)[..2], [Phase::Bootstrap, Phase::Start]);
    }

    #[test]
    fn a_running_vm_is_only_looked_at_until_the_guest_is_up() {
        let seen = Seen {
            running: true,
            ..new_vm()
        };
        assert_eq!(
            plan(seen),
            [Phase::CheckGuest(GuestCheck::CloudInit), Phase::Provisioned]
        );
        let unchecked = Seen {
            guest_check: GuestCheck::None,
            ..seen
        };
        assert_eq!(plan(unchecked), [Phase::Provisioned]);
        let agent_only = Seen {
            guest_check: GuestCheck::Agent,
            ..seen
        };
        assert_eq!(plan(agent_only)[0], Phase::CheckGuest(GuestCheck::Agent));
    }

    #[test]
    fn a_guest_that_just_started_is_not_looked_at_until_it_usually_is_up() {
        let seen = Seen {
            running: true,
            started: true,
            ..new_vm()
        };
        assert_eq!(plan(seen), [Phase::AwaitBoot, Phase::Provisioned]);
        let unchecked = Seen {
            guest_check: GuestCheck::None,
            ..seen
        };
        assert_eq!(plan(unchecked), [Phase::Provisioned]);
    }

    #[test]
    fn a_provisioned_machine_is_not_checked_again_and_an_adopted_one_is_retagged() {
        let seen = Seen {
            running: true,
            provisioned: true,
            retag: true,
            ..new_vm()
        };
        assert_eq!(plan(seen), [Phase::Retag, Phase::Provisioned]);
    }

    #[test]
    fn a_provisioned_vm_found_stopped_is_started_again() {
        let seen = Seen {
            provisioned: true,
            ..new_vm()
        };
        assert_eq!(
            plan(seen),
            [
                Phase::Configure,
                Phase::Bootstrap,
                Phase::Start,
                Phase::Provisioned
            ]
        );
    }

    #[test]
    fn the_seed_iso_goes_once_the_node_joined_and_only_once() {
        let joined = Seen {
            running: true,
            provisioned: true,
            node_joined: true,
            ..new_vm()
        };
        assert_eq!(plan(joined), [Phase::Provisioned, Phase::RemoveSeedIso]);
        let deleted = Seen {
            seed_iso_deleted: true,
            ..joined
        };
        assert_eq!(plan(deleted), [Phase::Provisioned, Phase::DetachSeedIso]);
        let removed = Seen {
            seed_iso_removed: true,
            ..joined
        };
        assert_eq!(plan(removed), [Phase::Provisioned]);
        let not_joined = Seen {
            node_joined: false,
            ..joined
        };
        assert_eq!(plan(not_joined), [Phase::Provisioned]);
    }
}
