//! Whether the guest is up: cloud-init's result file read through the guest agent, or the agent
//! alone. A booting guest is looked at when guests on its node usually are done.

use std::time::Duration;

use kube::runtime::controller::Action;
use kube::runtime::events::EventType;

use super::decide::GuestCheck;
use super::outcome::{Flow, Stop, waiting};
use super::{During, Reconcile, Scope, claim_key};
use crate::proxmox::CloudInitStatus;
use crate::proxmox::ProxmoxClient;

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
            GuestCheck::CloudInit => match proxmox.cloud_init_result(node, vmid).await {
                Ok(None) => Err(waiting(
                    "WaitingForCloudInit",
                    CLOUD_INIT_RUNNING,
                    booting(),
                )),
                Ok(Some(status)) => self.cloud_init_ended(scope, vmid, status).await,
                Err(error) if error.is_agent_unavailable() || error.is_retryable() => {
                    agent_silent()
                }
                Err(error) => Err(error)
                    .during(|| format!("reading cloud-init's result in VM {vmid}"))
                    .map_err(Stop::from),
            },
        }
    }

    /// Goes on when cloud-init ended well (warning about recoverable errors); a failed
    /// cloud-init is reported, and looked at again later.
    async fn cloud_init_ended(&self, scope: &Scope, vmid: u32, status: CloudInitStatus) -> Flow {
        match status {
            CloudInitStatus::Done => Ok(()),
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
            CloudInitStatus::Error(errors) => {
                let message = format!(
                    "cloud-init failed in VM {vmid}: {errors}; check the bootstrap data and the guest's /var/log/cloud-init.log"
                );
                let waited = self
                    .context
                    .task_timing
                    .boot_answered(&claim_key(self.machine));
                self.wake_machines(&waited);
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
}

/// What a machine waiting for cloud-init reports while its result file is not there yet.
const CLOUD_INIT_RUNNING: &str = "cloud-init is still running";
