//! The one decision of a pass: from what the pass has observed so far, what comes next — a
//! look at something more, an effect, or the end of the pass with what the machine reports.
//! Pure, so every gate, phase and deletion step is table-tested apart from Proxmox and
//! Kubernetes. The pass ([`super::pass`]) asks again after every look and effect.

use std::time::Duration;

use kube::runtime::controller::Action;

use super::outcome::{Stop, Wait, wait};

/// How soon a machine whose CAPI Machine or Cluster is not in the caches yet is looked at again.
const OWNER_RECHECK: Duration = Duration::from_secs(2);
/// How often a machine waits on a placement, endpoint or trust problem before it looks again
/// (the ProxmoxCluster and Machine are watched; this catches what is not).
const CONFIGURATION_RECHECK: Duration = Duration::from_secs(60);
/// How soon a machine whose Proxmox cannot be reached tries again.
const UNREACHABLE_RECHECK: Duration = Duration::from_secs(30);
/// How soon a VM still being cloned is looked at again.
const CLONE_RECHECK: Duration = Duration::from_secs(1);

/// What tells that the guest is up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum GuestCheck {
    /// cloud-init's result file, read through the guest agent, says it finished.
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
    /// The CAPI Machine has its node.
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

    /// Whether the guest is done with its seed ISO (it holds the bootstrap token), so it can
    /// go: cloud-init said it finished (its last stage runs the bootstrap commands), or, where
    /// that is not checked, the node joined. Only a pass that got past the guest's check asks.
    pub(super) fn seed_iso_read(&self) -> bool {
        self.node_joined || self.guest_check == GuestCheck::CloudInit
    }
}

/// One phase of provisioning once the machine's VM exists.
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

impl Phase {
    /// Phases that tidy up after provisioning: what stops them leaves the machine provisioned.
    pub(super) fn tidies_up(self) -> bool {
        matches!(self, Self::RemoveSeedIso | Self::DetachSeedIso)
    }
}

/// The phases a VM goes through from what the pass saw of it, in order.
pub(super) fn phases(seen: Seen) -> Vec<Phase> {
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
    if seen.seed_iso_read() && !seen.seed_iso_removed {
        phases.push(if seen.seed_iso_deleted {
            Phase::DetachSeedIso
        } else {
            Phase::RemoveSeedIso
        });
    }
    phases
}

/// The answer of a look that can refuse the machine: go on, or wait with this report.
#[derive(Debug)]
pub(super) enum Verdict {
    Pass,
    Refused(Wait),
}

impl Verdict {
    /// The verdict of a look that ended in `stop`: a wait refuses, a failure stays one.
    pub(super) fn of(stop: Stop) -> Result<Self, Stop> {
        match stop {
            Stop::Wait(wait) => Ok(Self::Refused(wait)),
            failed @ Stop::Failed(_) => Err(failed),
        }
    }
}

/// What the pass found of the machine's VM.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum VmSeen {
    /// Proxmox has no VM of the machine's.
    Absent,
    /// The VM exists and a clone still writes it.
    Cloning { vmid: u32, node: String },
    /// The VM exists, as seen.
    Present(Seen),
}

/// What a deletion found of the VM it deletes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Deleted {
    /// Nothing left to delete of the recorded VM, and this deletion did not destroy it.
    Nothing,
    /// This deletion's destroy task ended: the recorded VM was the machine's, and it is gone.
    Destroyed,
}

/// What a pass knows of the machine so far; `None` for what it has not looked at yet.
#[derive(Debug, Default)]
pub(super) struct Observed {
    /// The machine is being deleted.
    pub deleting: bool,
    /// The CAPI Machine set the owner reference.
    pub owned: bool,
    /// The CAPI Machine is in the caches.
    pub capi_machine: bool,
    /// The CAPI Cluster is in the caches.
    pub capi_cluster: bool,
    /// The Cluster or the machine pauses reconciliation.
    pub paused: bool,
    /// The machine says it is paused already.
    pub paused_reported: bool,
    /// The ProxmoxCluster exists.
    pub cluster_found: bool,
    /// The CAPI Cluster reports its infrastructure provisioned.
    pub infrastructure_provisioned: bool,
    /// The CAPI Machine names its bootstrap data Secret.
    pub bootstrap_data: bool,
    /// The machine was provisioned before this pass.
    pub provisioned: bool,
    /// A VMID is recorded (status or spec): a clone may have been requested.
    pub vmid_recorded: bool,
    /// `spec.providerID` names the machine's VM.
    pub named_by_spec: bool,
    /// The machine carries its finalizer (as of this pass).
    pub finalizer: bool,
    /// Why the machine cannot be placed, if it cannot.
    pub placement: Option<Wait>,
    /// Whether capmox can deliver the bootstrap data (looked at before anything is created).
    pub bootstrap: Option<Verdict>,
    /// Whether a Proxmox is reachable with the machine's credentials.
    pub endpoint: Option<Verdict>,
    /// Whether that Proxmox may be trusted with the machine's VM.
    pub trusted: Option<Verdict>,
    /// Whether the task recorded for the machine lets the pass go on.
    pub task: Option<Verdict>,
    /// Whether the machine's static addresses are looked at (claimed, bound or not).
    pub addresses: bool,
    /// The machine's VM.
    pub vm: Option<VmSeen>,
    /// The VM found is recorded as the machine's (spec, status, adoption).
    pub vm_recorded: bool,
    /// The phases this pass went through.
    pub done: Vec<Phase>,
    /// What deleting the recorded VM found.
    pub recorded_deleted: Option<Deleted>,
    /// The VM a deletion found by the machine's tag or provider ID (`Some(None)`: none).
    pub found_for_deletion: Option<Option<u32>>,
    /// The VM found by that search is deleted.
    pub found_deleted: bool,
    /// The machine was let go: nothing of it is left in Proxmox.
    pub released: bool,
    /// The machine waits in line for a clone slot: a pass of it passed every check before
    /// the clone (its bootstrap data is not read again).
    pub in_line: bool,
    /// ... and it is not its turn: until its recheck, a pass would only cost reads.
    pub held_in_line: Option<Duration>,
}

/// Something to look at before the pass decides further.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Look {
    /// The bootstrap Secret's format and content.
    Bootstrap,
    /// A Proxmox for the machine (provisioning: its zone's; deletion: its cluster's or the
    /// global credentials').
    Endpoint,
    /// Whether that Proxmox has the machine's VM when it is not the one the VM was recorded on.
    Trust,
    /// The task recorded for the machine.
    Task,
    /// The machine's static addresses (claims made here).
    Addresses,
    /// The machine's VM, by tag, recorded VMID or provider ID.
    Vm,
    /// For a deletion, a VM of the machine's that the recorded VMID does not name.
    VmToDelete,
}

/// Something to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Effect {
    /// Add the finalizer (guarded, so a stale copy of the machine never clones).
    EnsureFinalizer,
    /// Record the VM found as the machine's: VMID in spec and status, node, zone.
    RecordVm,
    /// Choose a VMID, node and template copy, record them, and request the clone.
    Create,
    /// Say that the VM the spec names is missing (never create a second one).
    ReportVmNotFound,
    /// A provisioning phase.
    Phase(Phase),
    /// Delete the VM the machine recorded.
    DeleteRecorded,
    /// Delete the VM found by the machine's tag or provider ID.
    DeleteFound(u32),
    /// Nothing is left in Proxmox: let the machine go.
    Release,
}

/// How a pass ends.
#[derive(Debug)]
pub(super) enum End {
    /// Nothing to report: only look again as `Action` says.
    Quietly(Action),
    /// Waiting (or backing off) with a report.
    Waiting(Wait),
    /// The machine is provisioned.
    Provisioned,
    /// Reconciliation is paused: say so (once), then wait for a change.
    Paused,
}

/// What comes next.
#[derive(Debug)]
pub(super) enum Next {
    Look(Look),
    Do(Effect),
    End(End),
}

/// The next step of a pass from what it observed.
pub(super) fn decide(observed: &mut Observed) -> Next {
    let o = observed;
    if o.released {
        return Next::End(End::Quietly(Action::await_change()));
    }
    if !o.deleting {
        if !o.owned {
            return Next::End(End::Quietly(Action::await_change()));
        }
        if !o.capi_machine || !o.capi_cluster {
            return Next::End(End::Quietly(Action::requeue(OWNER_RECHECK)));
        }
    }
    if o.paused {
        return if o.paused_reported {
            Next::End(End::Quietly(Action::await_change()))
        } else {
            Next::End(End::Paused)
        };
    }
    if o.deleting {
        return decide_deletion(o);
    }
    if let Some(left) = o.held_in_line {
        return Next::End(End::Quietly(Action::requeue(left)));
    }
    if let Some(next) = gates(o) {
        return next;
    }
    decide_vm(o)
}

/// What stands between the machine and its VM: cluster, bootstrap data, finalizer, placement,
/// a reachable and trusted Proxmox, the task in flight, the address claims.
fn gates(o: &mut Observed) -> Option<Next> {
    if !o.cluster_found || !o.infrastructure_provisioned {
        return Some(Next::End(End::Waiting(wait(
            "WaitingForClusterInfrastructure",
            "the ProxmoxCluster is not provisioned yet",
            Action::await_change(),
        ))));
    }
    if !o.bootstrap_data {
        return Some(Next::End(End::Waiting(wait(
            "WaitingForBootstrapData",
            "the Machine has no bootstrap data yet",
            Action::await_change(),
        ))));
    }
    // Bootstrap data capmox cannot deliver: said before anything is created.
    if !o.provisioned
        && !o.vmid_recorded
        && !o.in_line
        && let Some(next) = verdict(&mut o.bootstrap, Look::Bootstrap)
    {
        return Some(next);
    }
    if !o.finalizer {
        return Some(Next::Do(Effect::EnsureFinalizer));
    }
    if let Some(refused) = o.placement.take() {
        return Some(Next::End(End::Waiting(refused)));
    }
    if let Some(next) = verdict(&mut o.endpoint, Look::Endpoint) {
        return Some(next);
    }
    if let Some(next) = verdict(&mut o.trusted, Look::Trust) {
        return Some(next);
    }
    // A task in flight, or the back-off after a failed one: nothing else happens until it
    // is over.
    if let Some(next) = verdict(&mut o.task, Look::Task) {
        return Some(match next {
            Next::End(End::Waiting(wait)) if o.provisioned => {
                Next::End(End::Waiting(wait.still_provisioned()))
            }
            other => other,
        });
    }
    // Claimed before anything is created in Proxmox, and bound while the clone runs.
    if !o.addresses {
        return Some(Next::Look(Look::Addresses));
    }
    None
}

/// The VM: found (then its phases), being cloned, or to be created.
fn decide_vm(o: &mut Observed) -> Next {
    let seen = match &o.vm {
        None => return Next::Look(Look::Vm),
        // A machine whose spec names its VM never gets a second one.
        Some(VmSeen::Absent) if o.named_by_spec => return Next::Do(Effect::ReportVmNotFound),
        Some(VmSeen::Absent) => return Next::Do(Effect::Create),
        Some(_) if !o.vm_recorded => return Next::Do(Effect::RecordVm),
        Some(VmSeen::Cloning { vmid, node }) => {
            return Next::End(End::Waiting(wait(
                "Cloning",
                format!("VM {vmid} is being cloned on {node}"),
                Action::requeue(CLONE_RECHECK),
            )));
        }
        Some(VmSeen::Present(seen)) => *seen,
    };
    phases(seen)
        .into_iter()
        .find(|phase| !o.done.contains(phase))
        .map_or(Next::End(End::Provisioned), |phase| {
            Next::Do(Effect::Phase(phase))
        })
}

/// A deletion: reach the Proxmox that has the VM, wait out its task, delete the recorded VM,
/// then any other VM of the machine's, then let the machine go.
fn decide_deletion(o: &mut Observed) -> Next {
    match o.endpoint.take() {
        None => return Next::Look(Look::Endpoint),
        // Nothing recorded means no clone was ever requested: nothing to delete.
        Some(Verdict::Refused(_)) if !o.vmid_recorded && !o.named_by_spec => {
            return Next::Do(Effect::Release);
        }
        Some(Verdict::Refused(wait)) => return Next::End(End::Waiting(wait)),
        Some(Verdict::Pass) => o.endpoint = Some(Verdict::Pass),
    }
    // Deleted only where the VM is: a Proxmox that does not have it is not trusted to say it
    // is gone.
    if let Some(next) = verdict(&mut o.trusted, Look::Trust) {
        return next;
    }
    // A task in flight (this deletion's, or a provisioning task it waits out) first.
    if let Some(next) = verdict(&mut o.task, Look::Task) {
        return next;
    }
    // The Go provider recorded the VMID in the spec only: machines it created are deleted by
    // that VMID too (still only when the VM shows it is theirs).
    if o.vmid_recorded {
        match o.recorded_deleted {
            None => return Next::Do(Effect::DeleteRecorded),
            Some(Deleted::Destroyed) => return Next::Do(Effect::Release),
            Some(Deleted::Nothing) => {}
        }
    }
    // A VM the recorded VMID does not name: a status lost before the VMID was recorded, or a
    // machine re-created by a move or restore (found by its tag or provider ID).
    match o.found_for_deletion {
        None => Next::Look(Look::VmToDelete),
        Some(Some(vmid)) if !o.found_deleted => Next::Do(Effect::DeleteFound(vmid)),
        Some(_) => Next::Do(Effect::Release),
    }
}

/// `None` once `looked` passed; the look to take, or the end with its report.
fn verdict(looked: &mut Option<Verdict>, look: Look) -> Option<Next> {
    match looked.take() {
        None => Some(Next::Look(look)),
        Some(Verdict::Pass) => {
            *looked = Some(Verdict::Pass);
            None
        }
        Some(Verdict::Refused(wait)) => Some(Next::End(End::Waiting(wait))),
    }
}

/// The wait of a placement, endpoint or trust problem.
pub(super) fn misconfigured(reason: &str, message: impl Into<String>) -> Wait {
    wait(reason, message, Action::requeue(CONFIGURATION_RECHECK))
}

/// The wait of a Proxmox that cannot be reached.
pub(super) fn unreachable(message: impl Into<String>) -> Wait {
    wait(
        "ProxmoxUnavailable",
        message,
        Action::requeue(UNREACHABLE_RECHECK),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controller::conditions::Status;

    /// A pass that has looked at everything up to the VM, all passing.
    fn ready() -> Observed {
        Observed {
            owned: true,
            capi_machine: true,
            capi_cluster: true,
            cluster_found: true,
            infrastructure_provisioned: true,
            bootstrap_data: true,
            finalizer: true,
            bootstrap: Some(Verdict::Pass),
            endpoint: Some(Verdict::Pass),
            trusted: Some(Verdict::Pass),
            task: Some(Verdict::Pass),
            addresses: true,
            ..Observed::default()
        }
    }

    fn refused(reason: &str) -> Option<Verdict> {
        Some(Verdict::Refused(wait(
            reason,
            "why",
            Action::requeue(Duration::from_secs(5)),
        )))
    }

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

    fn deleting() -> Observed {
        Observed {
            deleting: true,
            vmid_recorded: true,
            ..Observed::default()
        }
    }

    /// What a pass does next, as a user reads it: the look, the effect, or the end with the
    /// `VirtualMachineProvisioned` condition it reports.
    fn next(mut observed: Observed) -> String {
        match decide(&mut observed) {
            Next::Look(look) => format!("look {look:?}"),
            Next::Do(effect) => format!("do {effect:?}"),
            Next::End(End::Quietly(action)) => format!("quietly {action:?}"),
            Next::End(End::Provisioned) => "provisioned".to_owned(),
            Next::End(End::Paused) => "paused".to_owned(),
            Next::End(End::Waiting(wait)) => {
                let status = if wait.decided.status == Status::True {
                    "True"
                } else {
                    "False"
                };
                format!("{status}/{}", wait.decided.reason)
            }
        }
    }

    #[test]
    fn every_gate_before_the_vm_in_order() {
        let owner_recheck = format!("quietly {:?}", Action::requeue(OWNER_RECHECK));
        let rows: Vec<(&str, Observed, String)> = vec![
            (
                "no owner reference yet",
                Observed {
                    owned: false,
                    ..ready()
                },
                format!("quietly {:?}", Action::await_change()),
            ),
            (
                "CAPI Machine not cached",
                Observed {
                    capi_machine: false,
                    ..ready()
                },
                owner_recheck.clone(),
            ),
            (
                "CAPI Cluster not cached",
                Observed {
                    capi_cluster: false,
                    ..ready()
                },
                owner_recheck,
            ),
            (
                "paused, not said yet",
                Observed {
                    paused: true,
                    ..ready()
                },
                "paused".into(),
            ),
            (
                "paused and said",
                Observed {
                    paused: true,
                    paused_reported: true,
                    ..ready()
                },
                format!("quietly {:?}", Action::await_change()),
            ),
            (
                "no ProxmoxCluster",
                Observed {
                    cluster_found: false,
                    ..ready()
                },
                "False/WaitingForClusterInfrastructure".into(),
            ),
            (
                "infrastructure not provisioned",
                Observed {
                    infrastructure_provisioned: false,
                    ..ready()
                },
                "False/WaitingForClusterInfrastructure".into(),
            ),
            (
                "no bootstrap data",
                Observed {
                    bootstrap_data: false,
                    ..ready()
                },
                "False/WaitingForBootstrapData".into(),
            ),
            (
                "bootstrap data not looked at",
                Observed {
                    bootstrap: None,
                    ..ready()
                },
                "look Bootstrap".into(),
            ),
            (
                "bootstrap data capmox cannot deliver",
                Observed {
                    bootstrap: refused("BootstrapFormatUnsupported"),
                    ..ready()
                },
                "False/BootstrapFormatUnsupported".into(),
            ),
            (
                "bootstrap data not looked at again once a VMID is recorded",
                Observed {
                    bootstrap: None,
                    vmid_recorded: true,
                    ..ready()
                },
                "look Vm".into(),
            ),
            (
                "bootstrap data not looked at again while waiting in line for a clone slot",
                Observed {
                    bootstrap: None,
                    in_line: true,
                    ..ready()
                },
                "look Vm".into(),
            ),
            (
                "waiting in line for a clone slot, not its turn",
                Observed {
                    in_line: true,
                    held_in_line: Some(Duration::from_secs(7)),
                    ..ready()
                },
                format!("quietly {:?}", Action::requeue(Duration::from_secs(7))),
            ),
            (
                "bootstrap data not looked at again once provisioned",
                Observed {
                    bootstrap: None,
                    provisioned: true,
                    ..ready()
                },
                "look Vm".into(),
            ),
            (
                "no finalizer",
                Observed {
                    finalizer: false,
                    ..ready()
                },
                "do EnsureFinalizer".into(),
            ),
            (
                "cannot be placed",
                Observed {
                    placement: Some(misconfigured("NoFailureDomain", "why")),
                    ..ready()
                },
                "False/NoFailureDomain".into(),
            ),
            (
                "Proxmox not looked for",
                Observed {
                    endpoint: None,
                    ..ready()
                },
                "look Endpoint".into(),
            ),
            (
                "Proxmox unreachable",
                Observed {
                    endpoint: Some(Verdict::Refused(unreachable("down"))),
                    ..ready()
                },
                "False/ProxmoxUnavailable".into(),
            ),
            (
                "trust not looked at",
                Observed {
                    trusted: None,
                    ..ready()
                },
                "look Trust".into(),
            ),
            (
                "VM recorded on a Proxmox no credentials reach",
                Observed {
                    trusted: refused("ProxmoxEndpointChanged"),
                    ..ready()
                },
                "False/ProxmoxEndpointChanged".into(),
            ),
            (
                "task not looked at",
                Observed {
                    task: None,
                    ..ready()
                },
                "look Task".into(),
            ),
            (
                "task running",
                Observed {
                    task: refused("WaitingForTask"),
                    ..ready()
                },
                "False/WaitingForTask".into(),
            ),
            (
                "tidying task running on a provisioned machine",
                Observed {
                    task: refused("WaitingForTask"),
                    provisioned: true,
                    ..ready()
                },
                "True/Provisioned".into(),
            ),
            (
                "addresses not looked at",
                Observed {
                    addresses: false,
                    ..ready()
                },
                "look Addresses".into(),
            ),
            ("VM not looked for", ready(), "look Vm".into()),
        ];
        for (name, observed, expected) in rows {
            assert_eq!(next(observed), expected, "{name}");
        }
    }

    #[test]
    fn the_vm_is_created_recorded_waited_for_and_taken_through_its_phases() {
        let rows: Vec<(&str, Observed, &str)> = vec![
            (
                "no VM",
                Observed {
                    vm: Some(VmSeen::Absent),
                    ..ready()
                },
                "do Create",
            ),
            (
                "no VM though the spec names one",
                Observed {
                    vm: Some(VmSeen::Absent),
                    named_by_spec: true,
                    ..ready()
                },
                "do ReportVmNotFound",
            ),
            (
                "VM found, not yet recorded",
                Observed {
                    vm: Some(VmSeen::Present(new_vm())),
                    ..ready()
                },
                "do RecordVm",
            ),
            (
                "VM still being cloned",
                Observed {
                    vm: Some(VmSeen::Cloning {
                        vmid: 101,
                        node: "pve1".into(),
                    }),
                    vm_recorded: true,
                    ..ready()
                },
                "False/Cloning",
            ),
            (
                "new VM",
                Observed {
                    vm: Some(VmSeen::Present(new_vm())),
                    vm_recorded: true,
                    ..ready()
                },
                "do Phase(Configure)",
            ),
            (
                "configured",
                Observed {
                    vm: Some(VmSeen::Present(new_vm())),
                    vm_recorded: true,
                    done: vec![Phase::Configure],
                    ..ready()
                },
                "do Phase(Bootstrap)",
            ),
            (
                "bootstrapped",
                Observed {
                    vm: Some(VmSeen::Present(new_vm())),
                    vm_recorded: true,
                    done: vec![Phase::Configure, Phase::Bootstrap],
                    ..ready()
                },
                "do Phase(Start)",
            ),
            (
                "started",
                Observed {
                    vm: Some(VmSeen::Present(new_vm())),
                    vm_recorded: true,
                    done: vec![Phase::Configure, Phase::Bootstrap, Phase::Start],
                    ..ready()
                },
                "do Phase(CheckGuest(CloudInit))",
            ),
            (
                "guest up",
                Observed {
                    vm: Some(VmSeen::Present(new_vm())),
                    vm_recorded: true,
                    done: vec![
                        Phase::Configure,
                        Phase::Bootstrap,
                        Phase::Start,
                        Phase::CheckGuest(GuestCheck::CloudInit),
                    ],
                    ..ready()
                },
                "do Phase(Provisioned)",
            ),
            (
                "all phases done",
                Observed {
                    vm: Some(VmSeen::Present(Seen {
                        running: true,
                        provisioned: true,
                        seed_iso_removed: true,
                        ..new_vm()
                    })),
                    vm_recorded: true,
                    done: vec![Phase::Provisioned],
                    ..ready()
                },
                "provisioned",
            ),
        ];
        for (name, observed, expected) in rows {
            assert_eq!(next(observed), expected, "{name}");
        }
    }

    #[test]
    fn a_deletion_reaches_the_vms_proxmox_waits_out_its_task_deletes_and_lets_go() {
        let rows: Vec<(&str, Observed, &str)> = vec![
            (
                "paused wins over deletion",
                Observed {
                    paused: true,
                    ..deleting()
                },
                "paused",
            ),
            (
                "Proxmox not looked for, even without owners",
                deleting(),
                "look Endpoint",
            ),
            (
                "no credentials while a VM may exist",
                Observed {
                    endpoint: refused("ProxmoxClusterNotFound"),
                    ..deleting()
                },
                "False/ProxmoxClusterNotFound",
            ),
            (
                "no credentials and nothing recorded",
                Observed {
                    endpoint: refused("ProxmoxClusterNotFound"),
                    vmid_recorded: false,
                    ..deleting()
                },
                "do Release",
            ),
            (
                "no credentials, only a provider ID",
                Observed {
                    endpoint: refused("ProxmoxUnavailable"),
                    vmid_recorded: false,
                    named_by_spec: true,
                    ..deleting()
                },
                "False/ProxmoxUnavailable",
            ),
            (
                "trust not looked at",
                Observed {
                    endpoint: Some(Verdict::Pass),
                    ..deleting()
                },
                "look Trust",
            ),
            (
                "a Proxmox without the VM is not trusted",
                Observed {
                    endpoint: Some(Verdict::Pass),
                    trusted: refused("ProxmoxEndpointChanged"),
                    ..deleting()
                },
                "False/ProxmoxEndpointChanged",
            ),
            (
                "task not looked at",
                Observed {
                    endpoint: Some(Verdict::Pass),
                    trusted: Some(Verdict::Pass),
                    ..deleting()
                },
                "look Task",
            ),
            (
                "task running",
                Observed {
                    endpoint: Some(Verdict::Pass),
                    trusted: Some(Verdict::Pass),
                    task: refused("Deleting"),
                    ..deleting()
                },
                "False/Deleting",
            ),
            (
                "recorded VM",
                Observed {
                    endpoint: Some(Verdict::Pass),
                    trusted: Some(Verdict::Pass),
                    task: Some(Verdict::Pass),
                    ..deleting()
                },
                "do DeleteRecorded",
            ),
            (
                "recorded VM destroyed",
                Observed {
                    endpoint: Some(Verdict::Pass),
                    trusted: Some(Verdict::Pass),
                    task: Some(Verdict::Pass),
                    recorded_deleted: Some(Deleted::Destroyed),
                    ..deleting()
                },
                "do Release",
            ),
            (
                "recorded VMID names nothing of the machine's",
                Observed {
                    endpoint: Some(Verdict::Pass),
                    trusted: Some(Verdict::Pass),
                    task: Some(Verdict::Pass),
                    recorded_deleted: Some(Deleted::Nothing),
                    ..deleting()
                },
                "look VmToDelete",
            ),
            (
                "no VMID recorded",
                Observed {
                    endpoint: Some(Verdict::Pass),
                    trusted: Some(Verdict::Pass),
                    task: Some(Verdict::Pass),
                    vmid_recorded: false,
                    named_by_spec: true,
                    ..deleting()
                },
                "look VmToDelete",
            ),
            (
                "a VM found by tag",
                Observed {
                    endpoint: Some(Verdict::Pass),
                    trusted: Some(Verdict::Pass),
                    task: Some(Verdict::Pass),
                    vmid_recorded: false,
                    found_for_deletion: Some(Some(7)),
                    ..deleting()
                },
                "do DeleteFound(7)",
            ),
            (
                "that VM deleted",
                Observed {
                    endpoint: Some(Verdict::Pass),
                    trusted: Some(Verdict::Pass),
                    task: Some(Verdict::Pass),
                    vmid_recorded: false,
                    found_for_deletion: Some(Some(7)),
                    found_deleted: true,
                    ..deleting()
                },
                "do Release",
            ),
            (
                "nothing found",
                Observed {
                    endpoint: Some(Verdict::Pass),
                    trusted: Some(Verdict::Pass),
                    task: Some(Verdict::Pass),
                    vmid_recorded: false,
                    found_for_deletion: Some(None),
                    ..deleting()
                },
                "do Release",
            ),
            (
                "released",
                Observed {
                    released: true,
                    ..deleting()
                },
                "quietly await_change",
            ),
        ];
        for (name, observed, expected) in rows {
            let expected = if expected == "quietly await_change" {
                format!("quietly {:?}", Action::await_change())
            } else {
                expected.to_owned()
            };
            assert_eq!(next(observed), expected, "{name}");
        }
    }

    #[test]
    fn ha_registration_waits_until_the_vm_runs() {
        let stopped = Seen {
            ha_pending: true,
            ..new_vm()
        };
        assert!(!phases(stopped).contains(&Phase::RegisterHa));
        let running = Seen {
            running: true,
            ..stopped
        };
        assert_eq!(
            phases(running),
            [
                Phase::RegisterHa,
                Phase::CheckGuest(GuestCheck::CloudInit),
                Phase::Provisioned,
                Phase::RemoveSeedIso
            ]
        );
        let registered = Seen {
            ha_pending: false,
            ..running
        };
        assert!(!phases(registered).contains(&Phase::RegisterHa));
    }

    #[test]
    fn a_new_vm_is_configured_bootstrapped_started_and_waited_for() {
        assert_eq!(
            phases(new_vm()),
            [
                Phase::Configure,
                Phase::Bootstrap,
                Phase::Start,
                Phase::CheckGuest(GuestCheck::CloudInit),
                Phase::Provisioned,
                Phase::RemoveSeedIso
            ]
        );
    }

    #[test]
    fn after_the_upload_only_the_attachment_and_start_are_left() {
        let seen = Seen {
            seed_iso_uploaded: true,
            ..new_vm()
        };
        assert_eq!(phases(seen)[..2], [Phase::Bootstrap, Phase::Start]);
    }

    #[test]
    fn a_running_vm_is_only_looked_at_until_the_guest_is_up() {
        let seen = Seen {
            running: true,
            ..new_vm()
        };
        assert_eq!(
            phases(seen),
            [
                Phase::CheckGuest(GuestCheck::CloudInit),
                Phase::Provisioned,
                Phase::RemoveSeedIso
            ]
        );
        let unchecked = Seen {
            guest_check: GuestCheck::None,
            ..seen
        };
        assert_eq!(phases(unchecked), [Phase::Provisioned]);
        let agent_only = Seen {
            guest_check: GuestCheck::Agent,
            ..seen
        };
        assert_eq!(phases(agent_only)[0], Phase::CheckGuest(GuestCheck::Agent));
    }

    #[test]
    fn a_guest_that_just_started_is_not_looked_at_until_it_usually_is_up() {
        let seen = Seen {
            running: true,
            started: true,
            ..new_vm()
        };
        assert_eq!(
            phases(seen),
            [Phase::AwaitBoot, Phase::Provisioned, Phase::RemoveSeedIso]
        );
        let unchecked = Seen {
            guest_check: GuestCheck::None,
            ..seen
        };
        assert_eq!(phases(unchecked), [Phase::Provisioned]);
    }

    #[test]
    fn a_provisioned_machine_is_not_checked_again_and_an_adopted_one_is_retagged() {
        let seen = Seen {
            running: true,
            provisioned: true,
            retag: true,
            ..new_vm()
        };
        assert_eq!(
            phases(seen),
            [Phase::Retag, Phase::Provisioned, Phase::RemoveSeedIso]
        );
    }

    #[test]
    fn a_provisioned_vm_found_stopped_is_started_again() {
        let seen = Seen {
            provisioned: true,
            ..new_vm()
        };
        assert_eq!(
            phases(seen),
            [
                Phase::Configure,
                Phase::Bootstrap,
                Phase::Start,
                Phase::Provisioned,
                Phase::RemoveSeedIso
            ]
        );
    }

    #[test]
    fn the_seed_iso_goes_once_the_node_joined_and_only_once() {
        let joined = Seen {
            running: true,
            provisioned: true,
            node_joined: true,
            guest_check: GuestCheck::Agent,
            ..new_vm()
        };
        assert_eq!(phases(joined), [Phase::Provisioned, Phase::RemoveSeedIso]);
        let deleted = Seen {
            seed_iso_deleted: true,
            ..joined
        };
        assert_eq!(phases(deleted), [Phase::Provisioned, Phase::DetachSeedIso]);
        let removed = Seen {
            seed_iso_removed: true,
            ..joined
        };
        assert_eq!(phases(removed), [Phase::Provisioned]);
        let not_joined = Seen {
            node_joined: false,
            ..joined
        };
        assert_eq!(phases(not_joined), [Phase::Provisioned]);
        let unchecked = Seen {
            guest_check: GuestCheck::None,
            ..not_joined
        };
        assert_eq!(phases(unchecked), [Phase::Provisioned]);
    }

    #[test]
    fn the_seed_iso_goes_in_the_pass_that_sees_cloud_init_done_without_waiting_for_the_node() {
        let booted = Seen {
            running: true,
            guest_check: GuestCheck::CloudInit,
            ..new_vm()
        };
        assert_eq!(
            phases(booted),
            [
                Phase::CheckGuest(GuestCheck::CloudInit),
                Phase::Provisioned,
                Phase::RemoveSeedIso
            ],
            "after the check that says cloud-init finished, not before"
        );
        let provisioned = Seen {
            provisioned: true,
            ..booted
        };
        assert_eq!(
            phases(provisioned),
            [Phase::Provisioned, Phase::RemoveSeedIso]
        );
        let removed = Seen {
            seed_iso_removed: true,
            ..provisioned
        };
        assert_eq!(phases(removed), [Phase::Provisioned]);
    }
}
