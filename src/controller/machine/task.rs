//! Proxmox tasks of a machine: a pass submits one, records it in status (`taskRef` and
//! `taskPurpose`) and returns with a requeue at the task's expected end; a later pass checks
//! it once. No pass waits for a task, so a worker is held only for a few HTTP calls. When a
//! task (and the guest a start boots) is looked at is the manager's task timing policy
//! (`timing/`).

use std::time::Duration;

use super::Scope;
use crate::controller::failures::Backoff;
use crate::proxmox::Upid;

/// Back-off after the first failed Proxmox task; it doubles with each further failure.
pub const TASK_BACKOFF_INITIAL: Duration = Duration::from_secs(10);
/// Longest back-off after failed Proxmox tasks.
pub const TASK_BACKOFF_MAX: Duration = Duration::from_secs(300);

/// What capmox submitted a Proxmox task for. Recorded at the front of `status.taskPurpose`, so
/// a finished task is judged by what capmox asked for, never by Proxmox's name for its type
/// (which differs between versions and reimplementations).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TaskKind {
    /// Cloning the template to the machine's VM.
    Clone,
    /// Growing the boot disk.
    Resize,
    /// Allocating the data disks the spec adds.
    AddDisks,
    /// Uploading the seed ISO.
    UploadSeedIso,
    /// Starting the VM.
    Start,
    /// Stopping the VM (for its deletion).
    Stop,
    /// Deleting the seed ISO.
    DeleteSeedIso,
    /// Deleting the VM.
    Destroy,
}

impl TaskKind {
    const ALL: [TaskKind; 8] = [
        TaskKind::Clone,
        TaskKind::Resize,
        TaskKind::AddDisks,
        TaskKind::UploadSeedIso,
        TaskKind::Start,
        TaskKind::Stop,
        TaskKind::DeleteSeedIso,
        TaskKind::Destroy,
    ];

    /// The stable token recorded in `status.taskPurpose`.
    pub fn as_str(self) -> &'static str {
        match self {
            TaskKind::Clone => "clone",
            TaskKind::Resize => "resize",
            TaskKind::AddDisks => "add-disks",
            TaskKind::UploadSeedIso => "seed-iso-upload",
            TaskKind::Start => "start",
            TaskKind::Stop => "stop",
            TaskKind::DeleteSeedIso => "seed-iso-delete",
            TaskKind::Destroy => "destroy",
        }
    }

    /// How the purposes recorded before kinds were (free text) began, one per kind.
    fn legacy_phrase(self) -> &'static str {
        match self {
            TaskKind::Clone => "cloning template ",
            TaskKind::Resize => "resizing ",
            TaskKind::AddDisks => "adding disks ",
            TaskKind::UploadSeedIso => "uploading the seed ISO ",
            TaskKind::Start => "starting VM ",
            TaskKind::Stop => "stopping VM ",
            TaskKind::DeleteSeedIso => "deleting the seed ISO ",
            TaskKind::Destroy => "deleting VM ",
        }
    }

    /// Tasks that delete what a machine had: a failed one is retried after its back-off; a
    /// provisioning task that failed does not hold up a deletion.
    fn deletes(self) -> bool {
        matches!(
            self,
            TaskKind::Stop | TaskKind::DeleteSeedIso | TaskKind::Destroy
        )
    }

    /// Tasks that change what `/cluster/resources` lists (a VM, its lock or its power state),
    /// when they start and when they end.
    pub(super) fn changes_listing(self) -> bool {
        matches!(
            self,
            TaskKind::Clone | TaskKind::Start | TaskKind::Stop | TaskKind::Destroy
        )
    }
}

/// A task's purpose as recorded in `status.taskPurpose`: `<kind>: <what it does>`, e.g.
/// `seed-iso-upload: uploading the seed ISO ... to local on pve1`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TaskPurpose {
    /// `None`: a purpose capmox cannot read (written by something else); the finished task
    /// is then not taken as any step done, and the next step looks at Proxmox again.
    pub kind: Option<TaskKind>,
    /// What the task does, for people.
    pub text: String,
}

impl TaskPurpose {
    pub fn new(kind: TaskKind, text: String) -> Self {
        TaskPurpose {
            kind: Some(kind),
            text,
        }
    }

    /// Reads a recorded purpose: `<kind>: <text>`, or the free text older versions recorded,
    /// whose first words tell the kind.
    pub fn parse(recorded: &str) -> Self {
        let tagged = recorded.split_once(": ").and_then(|(token, text)| {
            TaskKind::ALL
                .into_iter()
                .find(|kind| kind.as_str() == token)
                .map(|kind| TaskPurpose::new(kind, text.to_owned()))
        });
        tagged.unwrap_or_else(|| TaskPurpose {
            kind: TaskKind::ALL
                .into_iter()
                .find(|kind| recorded.starts_with(kind.legacy_phrase())),
            text: recorded.to_owned(),
        })
    }

    /// What `status.taskPurpose` records.
    pub fn recorded(&self) -> String {
        match self.kind {
            Some(kind) => format!("{}: {}", kind.as_str(), self.text),
            None => self.text.clone(),
        }
    }

    pub(super) fn deletes(&self) -> bool {
        self.kind.is_some_and(TaskKind::deletes)
    }

    /// An unreadable purpose may be anything, so it counts as a change.
    pub(super) fn changes_listing(&self) -> bool {
        self.kind.is_none_or(TaskKind::changes_listing)
    }
}

/// The task a pass saw succeed, with what it was submitted for.
#[derive(Clone, Debug)]
pub(super) struct FinishedTask {
    pub upid: Upid,
    pub kind: Option<TaskKind>,
}

impl Scope {
    /// The task of `kind` this pass saw succeed, if it did: the step it did is not repeated.
    pub(super) fn finished_as(&self, kind: TaskKind) -> Option<&Upid> {
        self.finished
            .as_ref()
            .filter(|task| task.kind == Some(kind))
            .map(|task| &task.upid)
    }
}

/// The back-off before retrying after the `failures`-th consecutive failed task:
/// 10 s, 20 s, 40 s, ... capped at 5 minutes.
pub fn task_backoff(failures: u32) -> Duration {
    Backoff {
        initial: TASK_BACKOFF_INITIAL,
        max: TASK_BACKOFF_MAX,
    }
    .nominal(failures)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_recorded_purpose_reads_back_as_its_kind_and_old_free_text_by_its_first_words() {
        for kind in TaskKind::ALL {
            let purpose = TaskPurpose::new(kind, "doing: it on pve1".to_owned());
            let recorded = purpose.recorded();
            assert!(recorded.starts_with(kind.as_str()), "{recorded}");
            assert_eq!(TaskPurpose::parse(&recorded), purpose);
        }
        // Written by the versions before kinds: understood by the phrase each step used.
        let old = TaskPurpose::parse("uploading the seed ISO user-data-101.iso to local on pve1");
        assert_eq!(old.kind, Some(TaskKind::UploadSeedIso));
        assert_eq!(
            old.text,
            "uploading the seed ISO user-data-101.iso to local on pve1"
        );
        assert_eq!(
            TaskPurpose::parse("deleting the seed ISO local:iso/x.iso of VM 101").kind,
            Some(TaskKind::DeleteSeedIso)
        );
        assert_eq!(
            TaskPurpose::parse("deleting VM 101 on pve1").kind,
            Some(TaskKind::Destroy)
        );
        // Anything else is no step done: the next step looks at Proxmox again.
        let unknown = TaskPurpose::parse("imgcopy: something");
        assert_eq!(unknown.kind, None);
        assert_eq!(unknown.recorded(), "imgcopy: something");
    }

    #[test]
    fn the_task_back_off_doubles_from_ten_seconds_up_to_five_minutes() {
        let secs: Vec<u64> = (1..=7).map(|n| task_backoff(n).as_secs()).collect();
        assert_eq!(secs, vec![10, 20, 40, 80, 160, 300, 300]);
        assert_eq!(
            task_backoff(0),
            TASK_BACKOFF_INITIAL,
            "no failure counts as the first"
        );
        assert_eq!(task_backoff(u32::MAX), TASK_BACKOFF_MAX);
    }
}
