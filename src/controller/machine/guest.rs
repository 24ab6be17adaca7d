//! Whether the guest is up: `cloud-init status` through the guest agent, or the agent alone.
//! A booting guest is looked at when guests on its node usually are done.

use std::time::Duration;

use kube::runtime::controller::Action;
use kube::runtime::events::EventType;

use super::decide::GuestCheck;
use super::outcome::{Flow, Stop, waiting};
use super::{During, Reconcile, Scope, claim_key};
use crate::proxmox::CloudInitStatus;
use crate::proxmox::{ProxmoxClient, ProxmoxError};

/// How soon a guest whose cloud-init failed is looked at again (a fixed bootstrap re-runs it).
const CLOUD_INIT_FAILED_RECHECK: Duration = Duration::from_secs(60);

impl Reconcile<'_> {
    /// Goes on when the guest is up as `check` tells; else the machine waits for it.
    pub(super) async fn guest_ready(
        &self,
        scope: &Scope,
        proxmox: &ProxmoxClient,
        node: &str,
        vmid: u32,
        check: GuestCheck,
    ) -> Flow {
        let machine_key = claim_key(self.machine);
        let booting = || Action::requeue(self.context.task_timing.boot_silent(&machine_key, node));
        let agent_silent = || {
            Err(waiting(
                "WaitingForGuestAgent",
                "the QEMU guest agent does not answer yet",
                booting(),
            ))
        };
        match check {
            GuestCheck::None => Ok(()),
            GuestCheck::Agent => match proxmox.agent_ping(node, vmid).await {
                Ok(_) => Ok(()),
                Err(_) => agent_silent(),
            },
            GuestCheck::CloudInit => match self
                .cloud_init_status(proxmox, node, vmid, &machine_key)
                .await
            {
                Ok(None) => Err(waiting(
                    "WaitingForCloudInit",
                    CLOUD_INIT_RUNNING,
                    Action::requeue(self.context.task_timing.command_wait(&machine_key)),
                )),
                Ok(Some(CloudInitStatus::Running)) => Err(waiting(
                    "WaitingForCloudInit",
                    CLOUD_INIT_RUNNING,
                    booting(),
                )),
                Ok(Some(status)) => self.cloud_init_ended(scope, vmid, status).await,
                Err(error) if error.is_agent_unavailable() || error.is_retryable() => {
                    agent_silent()
                }
                Err(error) => Err(error)
                    .during(|| format!("checking cloud-init in VM {vmid}"))
                    .map_err(Stop::from),
            },
        }
    }

    /// Goes on when cloud-init ended well (warning about recoverable errors); a failed
    /// cloud-init is reported, and looked at again later.
    async fn cloud_init_ended(&self, scope: &Scope, vmid: u32, status: CloudInitStatus) -> Flow {
        match status {
            CloudInitStatus::Done | CloudInitStatus::Running => Ok(()),
            CloudInitStatus::Degraded(text) => {
                self.event(
                    scope,
                    EventType::Warning,
                    "CloudInitDegraded",
                    &format!("cloud-init finished with recoverable errors: {text}"),
                )
                .await;
                Ok(())
            }
            CloudInitStatus::Error { exitcode, output } => {
                let exit = exitcode.map_or_else(|| "unknown".to_owned(), |c| c.to_string());
                let message = format!(
                    "cloud-init failed in VM {vmid} (exit code {exit}): {output}; check the bootstrap data and the guest's /var/log/cloud-init.log"
                );
                self.context
                    .task_timing
                    .boot_answered(&claim_key(self.machine));
                self.event(scope, EventType::Warning, "CloudInitFailed", &message)
                    .await;
                Err(waiting(
                    "CloudInitFailed",
                    message,
                    Action::requeue(CLOUD_INIT_FAILED_RECHECK),
                ))
            }
        }
    }

    /// `cloud-init status` in the guest without waiting for it: the first look starts the
    /// command and returns `None` (its result is read by a later pass, when the clock says),
    /// a later look reads the result (`None` while it still runs).
    async fn cloud_init_status(
        &self,
        proxmox: &ProxmoxClient,
        node: &str,
        vmid: u32,
        machine_key: &str,
    ) -> Result<Option<crate::proxmox::CloudInitStatus>, ProxmoxError> {
        let clock = &self.context.task_timing;
        let Some(pid) = clock.command_pending(machine_key, vmid) else {
            let pid = proxmox
                .agent_exec(node, vmid, &["cloud-init", "status"], None)
                .await?;
            clock.command_started(machine_key, node, vmid, pid);
            return Ok(None);
        };
        match proxmox.agent_exec_status(node, vmid, pid).await {
            Ok(exec) => {
                let status = crate::proxmox::CloudInitStatus::of(&exec);
                if status.is_some() {
                    clock.command_ended(machine_key);
                } else {
                    clock.command_running(machine_key);
                }
                Ok(status)
            }
            Err(error) => {
                // The guest or its agent restarted, or the command is unknown: start it anew.
                clock.command_ended(machine_key);
                Err(error)
            }
        }
    }
}

/// What a machine waiting for cloud-init reports, while it runs and while its status is asked.
const CLOUD_INIT_RUNNING: &str = "cloud-init is still running";
