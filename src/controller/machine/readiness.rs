//! Whether the guest is up: `cloud-init status` through the guest agent, or the agent alone.
//! A booting guest is looked at when guests on its node usually are done.

use super::steps::GuestCheck;
use super::*;

impl Reconcile<'_> {
    /// `None` when the guest is up as `check` tells; else what the machine waits for.
    pub(super) async fn guest_ready(
        &self,
        scope: &Scope,
        proxmox: &ProxmoxClient,
        node: &str,
        vmid: u32,
        check: GuestCheck,
    ) -> Result<Option<Step>, MachineError> {
        let machine_key = claim_key(self.machine);
        let boot_clock = &self.context.task_clock;
        let booting = || Action::requeue(boot_clock.boot_silent(&machine_key, node));
        let agent_silent = || {
            Some(waiting(
                "WaitingForGuestAgent",
                "the QEMU guest agent does not answer yet",
                booting(),
            ))
        };
        match check {
            GuestCheck::None => Ok(None),
            GuestCheck::Agent => Ok(if proxmox.agent_ping(node, vmid).await.is_err() {
                agent_silent()
            } else {
                None
            }),
            GuestCheck::CloudInit => match proxmox
                .cloud_init_status(node, vmid, Duration::from_secs(5))
                .await
            {
                Ok(crate::proxmox::CloudInitStatus::Done) => Ok(None),
                Ok(crate::proxmox::CloudInitStatus::Degraded(text)) => {
                    self.event(
                        scope,
                        EventType::Warning,
                        "CloudInitDegraded",
                        &format!("cloud-init finished with recoverable errors: {text}"),
                    )
                    .await;
                    Ok(None)
                }
                Ok(crate::proxmox::CloudInitStatus::Running) => Ok(Some(waiting(
                    "WaitingForCloudInit",
                    "cloud-init is still running",
                    booting(),
                ))),
                Ok(crate::proxmox::CloudInitStatus::Error { exitcode, output }) => {
                    let exit = exitcode.map_or_else(|| "unknown".to_owned(), |c| c.to_string());
                    let message = format!(
                        "cloud-init failed in VM {vmid} (exit code {exit}): {output}; check the bootstrap data and the guest's /var/log/cloud-init.log"
                    );
                    boot_clock.boot_answered(&machine_key);
                    self.event(scope, EventType::Warning, "CloudInitFailed", &message)
                        .await;
                    Ok(Some(waiting(
                        "CloudInitFailed",
                        message,
                        Action::requeue(Duration::from_secs(60)),
                    )))
                }
                Err(error) if error.is_agent_unavailable() || error.is_retryable() => {
                    Ok(agent_silent())
                }
                Err(error) => Err(error).during(|| format!("checking cloud-init in VM {vmid}")),
            },
        }
    }
}
