//! Rebooting and resetting a running VM as qemu-server does (`vm_reboot`, `vm_reset`), and
//! the hung guest that makes a reboot fail, so remediation (reboot, then reset, then
//! replace) can be tested.
//!
//! * `POST .../status/reboot[?timeout=]` refuses a VM that does not run (`VM 101 not
//!   running`, HTTP 500, before any task); otherwise a `qmreboot` task holds the VM's flock
//!   while the guest shuts down and starts again. A hung guest ignores the ACPI request: the
//!   task waits `timeout` seconds (default: the config's `startup: down=`, else 60, as
//!   `_do_vm_stop`) and fails with `VM quit/powerdown failed - got timeout`; the VM keeps
//!   running, still hung.
//! * `POST .../status/reset[?skiplock=]` refuses a VM that does not run the same way;
//!   otherwise a short `qmreset` task resets it, hung or not.
//! * A reboot or reset that takes boots the guest again: uptime and guest agent start over
//!   (the agent answers `boot_delay` later), the hang is gone, the boot count goes up, and
//!   commands run through the agent are forgotten.
//!
//! Simplifications (each says what real PVE does):
//! * `status/current` and `/cluster/resources` show the VM `running` throughout (PVE: a
//!   reboot stops the QEMU process and qmeventd starts a new one, so `stopped` can show for
//!   a moment; a reset keeps the process, so PVE's uptime does not start over on a reset);
//! * a guest that is not hung always shuts down within the timeout (PVE: `timeout=0` fails
//!   at once and the guest then powers off without coming back);
//! * task durations come from `SimOptions::duration_of` (`qmreboot`, `qmreset`; both default
//!   to `task_duration`, like `qmstart`), not from the guest.

use std::collections::BTreeMap;

use tokio::time::{Duration, Instant};

use super::{Cluster, Effect, SimError, SimResult, Vm};
use capmox::proxmox::types::parse_property_string;
use capmox::proxmox::upid::Upid;

/// How long PVE waits for a guest's shutdown when neither the request nor the config's
/// `startup: down=` says (`_do_vm_stop` in qemu-server).
pub const DEFAULT_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(60);

/// The exit status of a reboot whose guest did not shut down within the timeout.
pub const POWERDOWN_TIMEOUT: &str = "VM quit/powerdown failed - got timeout";

/// The task types that restart a guest.
const RESTART_TASKS: [&str; 2] = ["qmreboot", "qmreset"];

impl Cluster {
    /// `POST .../status/reboot[?timeout=]`: a `qmreboot` task; see the module documentation.
    pub fn reboot(
        &mut self,
        now: Instant,
        node: &str,
        vmid: u32,
        params: &BTreeMap<String, String>,
    ) -> SimResult<Upid> {
        only_params(params, &["timeout"])?;
        let timeout = timeout_param(params)?;
        let vm = self.running_vm(node, vmid)?;
        let wait = timeout
            .or_else(|| startup_down(vm))
            .map_or(DEFAULT_SHUTDOWN_TIMEOUT, Duration::from_secs);
        // qemu-server: the flock first, then the config lock, then the shutdown itself
        let outcome = if self.flock_held(vmid) {
            Err(Self::flock_timeout(vmid).reason)
        } else if let Some(l) = vm.lock() {
            Err(format!("VM is locked ({l})"))
        } else if vm.hung {
            Err(POWERDOWN_TIMEOUT.to_string())
        } else {
            Ok(())
        };
        let waits_out = outcome.as_ref().is_err_and(|e| e == POWERDOWN_TIMEOUT);
        let upid = self.new_task(
            now,
            node,
            "qmreboot",
            &vmid.to_string(),
            outcome,
            Effect::Restart { vmid },
            None,
        );
        if waits_out {
            self.set_task_duration(upid.as_str(), wait);
        }
        Ok(upid)
    }

    /// `POST .../status/reset[?skiplock=]`: a `qmreset` task; see the module documentation.
    pub fn reset(
        &mut self,
        now: Instant,
        node: &str,
        vmid: u32,
        params: &BTreeMap<String, String>,
    ) -> SimResult<Upid> {
        only_params(params, &["skiplock"])?;
        let skiplock = bool_param(params, "skiplock")?;
        let user = self.opts.token_id.split('!').next().unwrap_or_default();
        if skiplock && user != "root@pam" {
            return Err(SimError::param(
                "skiplock",
                "Only root may use this option.",
            ));
        }
        let vm = self.running_vm(node, vmid)?;
        let outcome = if self.flock_held(vmid) {
            Err(Self::flock_timeout(vmid).reason)
        } else {
            match vm.lock() {
                Some(l) if !skiplock => Err(format!("VM is locked ({l})")),
                _ => Ok(()),
            }
        };
        Ok(self.new_task(
            now,
            node,
            "qmreset",
            &vmid.to_string(),
            outcome,
            Effect::Restart { vmid },
            None,
        ))
    }

    /// Test hook: the guest of running VM `vmid` hangs. It ignores ACPI shutdown requests and
    /// its guest agent stops answering, until the VM is reset or stops. False if no such VM
    /// runs.
    pub fn hang_guest(&mut self, vmid: u32) -> bool {
        match self.vms.get_mut(&vmid) {
            Some(vm) if vm.running => {
                vm.hung = true;
                true
            }
            _ => false,
        }
    }

    /// Test hook: how many times VM `vmid` booted (starts, HA restarts, reboots and resets;
    /// a guest the topology lists as running counts one). `None` if there is no such VM.
    pub fn boots(&self, vmid: u32) -> Option<u32> {
        Some(self.vms.get(&vmid)?.boots)
    }

    /// Whether an unfinished reboot or reset of `vmid` holds its flock.
    pub(super) fn restart_running(&self, vmid: u32) -> bool {
        self.tasks
            .values()
            .any(|t| !t.done && t.vmid == Some(vmid) && RESTART_TASKS.contains(&t.kind.as_str()))
    }

    /// A reboot or reset ended well at `at`: the guest boots again if the VM still runs (a
    /// node failure may have stopped it meanwhile); its agent's commands are gone.
    pub(super) fn restart_guest(&mut self, vmid: u32, at: Instant) {
        let os = self.vms.get(&vmid).map(|vm| self.seed_os(vm));
        let Some(vm) = self.vms.get_mut(&vmid).filter(|vm| vm.running) else {
            return;
        };
        vm.boot(at, os);
        self.execs.retain(|(id, _), _| *id != vmid);
        self.dhcp_after_boot(vmid, at);
    }

    /// VM `vmid` on `node` if it runs; PVE refuses to reboot or reset one that does not.
    fn running_vm(&self, node: &str, vmid: u32) -> SimResult<&Vm> {
        let vm = self.vm_on(node, vmid)?;
        if !vm.running {
            return Err(SimError::e500(format!("VM {vmid} not running")));
        }
        Ok(vm)
    }

    /// Gives a task that has just started another duration (a reboot that waits out its
    /// timeout), keeping the index of running tasks by end time in step.
    fn set_task_duration(&mut self, key: &str, duration: Duration) {
        let Some(task) = self.tasks.get_mut(key) else {
            return;
        };
        if let Some(start) = task.started {
            self.running
                .remove(&(start + task.duration, key.to_string()));
            self.running.insert((start + duration, key.to_string()));
        }
        task.duration = duration;
    }
}

/// Refuses parameters the endpoint does not declare, as PVE's schema check does.
fn only_params(params: &BTreeMap<String, String>, allowed: &[&str]) -> SimResult<()> {
    let errors: BTreeMap<String, String> = params
        .keys()
        .filter(|k| !allowed.contains(&k.as_str()))
        .map(|k| {
            (
                k.clone(),
                "property is not defined in schema and the schema does not allow additional properties"
                    .to_string(),
            )
        })
        .collect();
    if errors.is_empty() {
        return Ok(());
    }
    Err(SimError {
        status: 400,
        reason: "Parameter verification failed.".into(),
        errors,
    })
}

/// The `timeout` parameter (seconds, integer ≥ 0), capped so that instants cannot overflow.
fn timeout_param(params: &BTreeMap<String, String>) -> SimResult<Option<u64>> {
    let Some(v) = params.get("timeout") else {
        return Ok(None);
    };
    let n: i64 = v.parse().map_err(|_| {
        SimError::param(
            "timeout",
            format!("type check ('integer') failed - got '{v}'"),
        )
    })?;
    let secs = u64::try_from(n)
        .map_err(|_| SimError::param("timeout", "value must have a minimum value of 0"))?;
    Ok(Some(secs.min(u64::from(u32::MAX))))
}

/// A boolean parameter (`0`/`1`), false when absent.
fn bool_param(params: &BTreeMap<String, String>, name: &str) -> SimResult<bool> {
    match params.get(name).map(String::as_str) {
        None | Some("0") => Ok(false),
        Some("1") => Ok(true),
        Some(other) => Err(SimError::param(
            name,
            format!("type check ('boolean') failed - got '{other}'"),
        )),
    }
}

/// The shutdown timeout the config's `startup: ...,down=N` gives (0 means none).
fn startup_down(vm: &Vm) -> Option<u64> {
    let startup = vm.config.get("startup")?;
    parse_property_string(startup, "order")
        .get("down")?
        .parse()
        .ok()
        .filter(|d| *d > 0)
}

#[cfg(test)]
mod tests {
    use serde_json::Value;

    use super::*;
    use crate::topology::{SimOptions, Topology};

    fn p(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    /// A cluster with VM 100 (a clone of the agent-enabled template 9000) started and its
    /// agent answering; returns the cluster and that instant.
    fn booted(opts: SimOptions) -> (Cluster, Instant) {
        let mut c = Cluster::new(&Topology::example(), opts, Box::new(|_| false));
        let t0 = Instant::now();
        c.clone_vm(t0, "pve1", 9000, &p(&[("newid", "100")]))
            .expect("clone");
        let t1 = t0 + c.options().clone_duration;
        c.advance(t1);
        c.power(t1, "pve1", 100, "start").expect("start");
        let t2 = t1 + c.options().duration_of("qmstart") + c.options().boot_delay;
        c.advance(t2);
        c.agent_ping(t2, "pve1", 100).expect("agent answers");
        (c, t2)
    }

    fn status(c: &Cluster, upid: &Upid) -> Value {
        c.task_status("pve1", upid.as_str()).expect("task status")
    }

    fn uptime(c: &Cluster, now: Instant) -> u64 {
        c.vm_status(now, "pve1", 100).expect("status")["uptime"]
            .as_u64()
            .expect("uptime")
    }

    #[tokio::test(start_paused = true)]
    async fn a_reboot_of_a_running_vm_boots_it_again() {
        let (mut c, t0) = booted(SimOptions::default());
        assert_eq!(c.boots(100), Some(1));
        let t0 = t0 + Duration::from_secs(100);
        c.advance(t0);
        assert_eq!(uptime(&c, t0), 100);
        let upid = c
            .reboot(t0, "pve1", 100, &p(&[("timeout", "30")]))
            .expect("reboot");
        assert_eq!(upid.task_type, "qmreboot");
        assert_eq!(status(&c, &upid)["status"], "running");
        assert_eq!(
            c.vm_status(t0, "pve1", 100).expect("status")["status"],
            "running"
        );
        // the reboot holds the flock: config changes and a stop wait for it and time out
        let flock = "can't lock file '/var/lock/qemu-server/lock-100.conf' - got timeout";
        let e = c
            .update_config(t0, "pve1", 100, &p(&[("cores", "2")]), false)
            .expect_err("flock");
        assert_eq!(e.reason, flock);
        let stop = c.power(t0, "pve1", 100, "stop").expect("stop task");
        let end = t0 + c.options().duration_of("qmreboot");
        c.advance(end);
        assert_eq!(status(&c, &upid)["exitstatus"], "OK");
        assert_eq!(status(&c, &stop)["exitstatus"], flock);
        assert_eq!(c.vm_running(100), Some(true));
        assert_eq!(c.boots(100), Some(2));
        assert_eq!(uptime(&c, end), 0, "uptime starts over");
        let e = c.agent_ping(end, "pve1", 100).expect_err("booting");
        assert_eq!(e.reason, "QEMU guest agent is not running");
        c.agent_ping(end + c.options().boot_delay, "pve1", 100)
            .expect("agent answers after the boot");
        let record = c
            .task_records()
            .into_iter()
            .find(|r| r.kind == "qmreboot")
            .expect("recorded");
        assert_eq!(record.agent_ready, Some(end + c.options().boot_delay));
        let log = c.task_log("pve1", upid.as_str(), 0, 10).expect("log").0;
        assert_eq!(
            log[log.as_array().expect("lines").len() - 1]["t"],
            "TASK OK"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_hung_guest_ignores_a_reboot_until_the_timeout() {
        let (mut c, t0) = booted(SimOptions::default());
        assert!(c.hang_guest(100));
        assert!(!c.hang_guest(9000), "a template does not run");
        assert!(!c.hang_guest(555), "no such VM");
        let e = c.agent_ping(t0, "pve1", 100).expect_err("hung");
        assert_eq!(e.reason, "QEMU guest agent is not running");
        assert!(c.agent_interfaces(t0, "pve1", 100).is_err());
        let upid = c
            .reboot(t0, "pve1", 100, &p(&[("timeout", "1")]))
            .expect("reboot");
        c.advance(t0 + Duration::from_millis(999));
        assert_eq!(status(&c, &upid)["status"], "running");
        c.advance(t0 + Duration::from_secs(1));
        assert_eq!(status(&c, &upid)["exitstatus"], POWERDOWN_TIMEOUT);
        assert_eq!(c.vm_running(100), Some(true));
        assert_eq!(c.boots(100), Some(1), "no boot");
        assert!(
            c.agent_ping(t0 + Duration::from_secs(5), "pve1", 100)
                .is_err(),
            "still hung"
        );
        let record = c
            .task_records()
            .into_iter()
            .find(|r| r.kind == "qmreboot")
            .expect("recorded");
        assert!(!record.ok && record.agent_ready.is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn without_a_timeout_a_hung_reboot_waits_startup_down_or_60_seconds() {
        let (mut c, t0) = booted(SimOptions::default());
        c.hang_guest(100);
        let upid = c.reboot(t0, "pve1", 100, &p(&[])).expect("reboot");
        c.advance(t0 + Duration::from_secs(59));
        assert_eq!(status(&c, &upid)["status"], "running");
        let t1 = t0 + DEFAULT_SHUTDOWN_TIMEOUT;
        c.advance(t1);
        assert_eq!(status(&c, &upid)["exitstatus"], POWERDOWN_TIMEOUT);
        if let Some(vm) = c.vms.get_mut(&100) {
            vm.config.insert("startup".into(), "order=1,down=5".into());
        }
        let upid = c.reboot(t1, "pve1", 100, &p(&[])).expect("reboot");
        c.advance(t1 + Duration::from_secs(5));
        assert_eq!(status(&c, &upid)["exitstatus"], POWERDOWN_TIMEOUT);
    }

    #[tokio::test(start_paused = true)]
    async fn a_reset_boots_a_hung_guest_again() {
        let (mut c, t0) = booted(SimOptions::default());
        let command = ["cloud-init".to_string(), "status".to_string()];
        let pid = c.agent_exec(t0, "pve1", 100, &command).expect("exec")["pid"]
            .as_u64()
            .expect("pid")
            .to_string();
        c.hang_guest(100);
        let upid = c.reset(t0, "pve1", 100, &p(&[])).expect("reset");
        assert_eq!(upid.task_type, "qmreset");
        let end = t0 + c.options().duration_of("qmreset");
        c.advance(end);
        assert_eq!(status(&c, &upid)["exitstatus"], "OK");
        assert_eq!(c.vm_running(100), Some(true));
        assert_eq!(c.boots(100), Some(2));
        assert_eq!(uptime(&c, end), 0);
        let t1 = end + c.options().boot_delay;
        c.agent_ping(t1, "pve1", 100).expect("the hang is gone");
        let e = c
            .agent_exec_status(t1, "pve1", 100, Some(&pid))
            .expect_err("the command went with the old boot");
        assert_eq!(e.reason, "Agent error: Invalid parameter 'pid'");
        // a reboot works again
        let upid = c.reboot(t1, "pve1", 100, &p(&[])).expect("reboot");
        c.advance(t1 + c.options().duration_of("qmreboot"));
        assert_eq!(status(&c, &upid)["exitstatus"], "OK");
        assert_eq!(c.boots(100), Some(3));
    }

    #[tokio::test(start_paused = true)]
    async fn a_vm_that_does_not_run_is_neither_rebooted_nor_reset() {
        let mut c = Cluster::new(
            &Topology::example(),
            SimOptions::default(),
            Box::new(|_| false),
        );
        let now = Instant::now();
        let e = c.reboot(now, "pve1", 9000, &p(&[])).expect_err("template");
        assert_eq!((e.status, e.reason.as_str()), (500, "VM 9000 not running"));
        let e = c.reset(now, "pve1", 9000, &p(&[])).expect_err("template");
        assert_eq!((e.status, e.reason.as_str()), (500, "VM 9000 not running"));
        let (mut c, t0) = booted(SimOptions::default());
        c.power(t0, "pve1", 100, "stop").expect("stop");
        let t1 = t0 + c.options().duration_of("qmstop");
        c.advance(t1);
        let e = c.reboot(t1, "pve1", 100, &p(&[])).expect_err("stopped");
        assert_eq!((e.status, e.reason.as_str()), (500, "VM 100 not running"));
        let e = c.reset(t1, "pve1", 100, &p(&[])).expect_err("stopped");
        assert_eq!((e.status, e.reason.as_str()), (500, "VM 100 not running"));
        assert_eq!(c.boots(100), Some(1));
        assert_eq!(c.boots(555), None);
        assert!(
            c.task_records()
                .iter()
                .all(|r| !RESTART_TASKS.contains(&r.kind.as_str())),
            "no task"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn parameters_and_locks_are_checked_as_pve_does() {
        let (mut c, t0) = booted(SimOptions::default());
        let e = c
            .reboot(t0, "pve1", 100, &p(&[("forceStop", "1")]))
            .expect_err("undeclared");
        assert_eq!(e.status, 400);
        assert!(e.errors.contains_key("forceStop"));
        for (bad, text) in [
            ("-1", "value must have a minimum value of 0"),
            ("soon", "type check ('integer') failed - got 'soon'"),
        ] {
            let e = c
                .reboot(t0, "pve1", 100, &p(&[("timeout", bad)]))
                .expect_err(bad);
            assert_eq!(e.errors["timeout"], text);
        }
        let e = c
            .reset(t0, "pve1", 100, &p(&[("skiplock", "yes")]))
            .expect_err("boolean");
        assert!(e.errors.contains_key("skiplock"));
        // a lock fails the task (qemu-server checks it inside the worker); root may skip it
        c.set_lock(100, Some("backup"));
        let reboot = c.reboot(t0, "pve1", 100, &p(&[])).expect("reboot");
        let t1 = t0 + Duration::from_secs(1);
        c.advance(t1);
        assert_eq!(status(&c, &reboot)["exitstatus"], "VM is locked (backup)");
        let reset = c.reset(t1, "pve1", 100, &p(&[])).expect("reset");
        let t1 = t1 + Duration::from_secs(1);
        c.advance(t1);
        assert_eq!(status(&c, &reset)["exitstatus"], "VM is locked (backup)");
        assert_eq!(c.boots(100), Some(1));
        let reset = c
            .reset(t1, "pve1", 100, &p(&[("skiplock", "1")]))
            .expect("reset");
        c.advance(t1 + Duration::from_secs(1));
        assert_eq!(status(&c, &reset)["exitstatus"], "OK");
        assert_eq!(c.boots(100), Some(2));

        let opts = SimOptions {
            token_id: "capmox@pve!capi".into(),
            ..SimOptions::default()
        };
        let (mut c, t0) = booted(opts);
        let e = c
            .reset(t0, "pve1", 100, &p(&[("skiplock", "1")]))
            .expect_err("not root");
        assert_eq!(e.errors["skiplock"], "Only root may use this option.");
    }

    #[tokio::test(start_paused = true)]
    async fn restart_tasks_take_their_configured_durations() {
        let opts = SimOptions {
            task_durations: [
                ("qmreboot".to_string(), Duration::from_secs(4)),
                ("qmreset".to_string(), Duration::from_millis(200)),
            ]
            .into(),
            ..SimOptions::default()
        };
        let (mut c, t0) = booted(opts);
        let upid = c.reboot(t0, "pve1", 100, &p(&[])).expect("reboot");
        c.advance(t0 + Duration::from_millis(3999));
        assert_eq!(status(&c, &upid)["status"], "running");
        let t1 = t0 + Duration::from_secs(4);
        c.advance(t1);
        assert_eq!(status(&c, &upid)["exitstatus"], "OK");
        let upid = c.reset(t1, "pve1", 100, &p(&[])).expect("reset");
        c.advance(t1 + Duration::from_millis(200));
        assert_eq!(status(&c, &upid)["exitstatus"], "OK");
        assert_eq!(c.boots(100), Some(3));
    }
}
