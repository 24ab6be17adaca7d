//! Migrating an HA resource to another node on request (`POST
//! /cluster/ha/resources/{sid}/migrate`) as pve-ha-manager and qemu-server do it, so capmox
//! can move an unhealthy machine's VM to another node of its zone before replacing it.
//!
//! * The API checks the request only: the sid must name an HA resource that is not
//!   `ignored` (else `resource 'vm:101' is not HA managed`, HTTP 500) and not in state
//!   `error` (`service 'vm:101' in error state, must be disabled and fixed first`); `node`
//!   must look like a node name (HTTP 400) but need not exist. It queues the CRM command
//!   `migrate <sid> <node>` and answers at once, without a task: `null` as PVE 8; as PVE 9
//!   an object with `sid`, `requested-node` and, from the resource-affinity rules,
//!   `comigrated-resources` and `blocking-resources`.
//! * The CRM drops the command, with a line in its log (`Cluster::ha_crm_log`), when the
//!   target node is not online (offline or unknown), the VM is already there, or (PVE 9) a
//!   resource in negative affinity runs there; otherwise it migrates the resource, and each
//!   resource in positive affinity with it that is elsewhere.
//! * A migration is the LRM calling qemu-server's `migrate_vm` on the source node (online
//!   if the VM runs, `with-local-disks`). A locked VM (`VM is locked (backup)`) or a volume
//!   on a storage the target does not have (`storage 'local-lvm' is not available on node
//!   'pve3'`) fails it before any task. Otherwise a `qmigrate` task runs on the source node,
//!   holding the VM's flock and config lock `migrate`, with HA state `migrate`. The task
//!   fails (`migration aborted`, the VM stays where it was) with a CD-ROM image on a
//!   non-shared storage attached (a seed ISO: `can't migrate VM - check log`), with PCI
//!   devices that cannot go along (see the `pci` module: raw devices always, mapped ones
//!   when the VM runs or the target has no entry), when the flock is held, or when the
//!   target goes offline or the source fails before it ends. On
//!   success the VM is on the target, running or stopped as before (no boot), and its
//!   volumes on node-local storages with it.
//!
//! Simplifications (each says what real PVE does):
//! * the CRM acts in the request (PVE: in its next round, ~10 s, then the LRM's);
//! * the task takes `SimOptions::duration_of("qmigrate")` (default `task_duration`; PVE: as
//!   long as copying memory and local disks takes), and its UPID names the API token's user
//!   (PVE: `root@pam`, the LRM's);
//! * the VM's uptime goes on over a live migration (PVE counts it from the start of the QEMU
//!   process, which is new on the target);
//! * a VM moved outside its node-affinity rule or restricted group stays there (PVE: the CRM
//!   moves it back to an allowed node in its next round), and a command for a resource that
//!   is migrating or in `recovery` is dropped (PVE: it waits until the resource is back in
//!   `started` or `stopped`).

use std::collections::{BTreeMap, BTreeSet};

use serde_json::{Value, json};
use tokio::time::{Duration, Instant};

use super::{Affinity, HaResource, HaRuleKind, Kind, Spec, check_params, feasibility};
use crate::state::{Cluster, Effect, SimError, SimResult, is_disk_key};
use capmox::proxmox::types::parse_property_string;

/// The exit status of a `qmigrate` task that failed (`PVE::AbstractMigrate::migrate`).
pub const MIGRATION_ABORTED: &str = "migration aborted";

/// CRM log lines kept (the oldest go first).
const LOG_LINES: usize = 1000;

const MIGRATE: Spec = &[("node", Kind::Node, true), ("sid", Kind::SidOrVmid, true)];

impl Cluster {
    /// `POST /cluster/ha/resources/{sid}/migrate`: checks, answers, and lets the CRM act on
    /// the command at once; see the module documentation.
    pub fn ha_migrate(
        &mut self,
        now: Instant,
        params: &BTreeMap<String, String>,
    ) -> SimResult<Value> {
        check_params(params, MIGRATE)?;
        let (Some(raw), Some(node)) = (params.get("sid"), params.get("node")) else {
            // check_params refuses requests without them
            return Err(SimError::param(
                "sid",
                "property is missing and it is not optional",
            ));
        };
        let sid = self.resolve_sid(raw)?;
        if !self.in_service(&sid) {
            return Err(SimError::e500(format!(
                "resource '{sid}' is not HA managed"
            )));
        }
        if self.ha.crm.get(&sid) == Some(&"error") {
            return Err(SimError::e500(format!(
                "service '{sid}' in error state, must be disabled and fixed first"
            )));
        }
        // PVE 9 reads the motion info before the CRM has seen the command
        let answer = if self.has_rules() {
            self.motion_info(&sid, node)
        } else {
            Value::Null
        };
        self.crm_migrate(now, &sid, node);
        Ok(answer)
    }

    /// What the CRM logged about migration commands (dropped ones with the reason, state
    /// changes of migrating resources), oldest first; PVE writes this to the CRM's syslog.
    pub fn ha_crm_log(&self) -> Vec<String> {
        self.ha.log.iter().cloned().collect()
    }

    /// The node an unfinished `qmigrate` task moves VM `vmid` to.
    pub(in crate::state) fn migration_target(&self, vmid: u32) -> Option<String> {
        self.tasks
            .values()
            .filter(|t| !t.done && t.vmid == Some(vmid))
            .find_map(|t| match &t.effect {
                Effect::Migrate { target, .. } => Some(target.clone()),
                _ => None,
            })
    }

    pub(in crate::state) fn crm_log(&mut self, line: String) {
        if self.ha.log.len() >= LOG_LINES {
            self.ha.log.pop_front();
        }
        self.ha.log.push_back(line);
    }

    /// Whether `sid` is an HA resource the CRM manages (configured, not `ignored`).
    fn in_service(&self, sid: &str) -> bool {
        self.ha
            .resources
            .get(sid)
            .is_some_and(|r| r.requested_state() != "ignored")
    }

    /// The resources `sid` must run with and apart from, per its enabled and feasible
    /// resource-affinity rules (PVE 9; none as PVE 8).
    fn affinitive(&self, sid: &str) -> (BTreeSet<String>, BTreeSet<String>) {
        let (mut together, mut separate) = (BTreeSet::new(), BTreeSet::new());
        if !self.has_rules() {
            return (together, separate);
        }
        let infeasible = feasibility(&self.ha.rules, self.nodes.len());
        for rule in self.ha.rules.values() {
            let HaRuleKind::ResourceAffinity { affinity } = rule.kind else {
                continue;
            };
            if rule.disable || !rule.resources.contains(sid) || infeasible.contains_key(&rule.rule)
            {
                continue;
            }
            let others = rule.resources.iter().filter(|s| *s != sid).cloned();
            match affinity {
                Affinity::Positive => together.extend(others),
                Affinity::Negative => separate.extend(others),
            }
        }
        (together, separate)
    }

    /// Whether resource `csid` is on `node` and not migrating away from it, so that a
    /// resource in negative affinity with it cannot go there.
    fn blocks(&self, csid: &str, node: &str) -> bool {
        let Some(vmid) = self.ha.resources.get(csid).and_then(HaResource::vmid) else {
            return false;
        };
        self.vms.get(&vmid).is_some_and(|vm| vm.node == node)
            && self.migration_target(vmid).is_none_or(|t| t == node)
    }

    /// PVE 9's answer: the resources that move along and those that block the target node.
    fn motion_info(&self, sid: &str, node: &str) -> Value {
        let (together, separate) = self.affinitive(sid);
        let comigrated: Vec<&String> = together.iter().filter(|s| self.in_service(s)).collect();
        let online = self.nodes.get(node).is_some_and(|n| n.online);
        let blocking: Vec<Value> = separate
            .iter()
            .filter(|s| online && self.in_service(s) && self.blocks(s, node))
            .map(|s| json!({"sid": s, "cause": "resource-affinity"}))
            .collect();
        let mut answer = json!({"sid": sid, "requested-node": node});
        if !comigrated.is_empty() {
            answer["comigrated-resources"] = json!(comigrated);
        }
        if !blocking.is_empty() {
            answer["blocking-resources"] = json!(blocking);
        }
        answer
    }

    /// The CRM reads `migrate <sid> <target>` (`update_crm_commands`,
    /// `queue_resource_motion`): drops it or migrates `sid` and the resources that go along.
    fn crm_migrate(&mut self, now: Instant, sid: &str, target: &str) {
        let cmd = format!("migrate {sid} {target}");
        let Some(vmid) = self.ha.resources.get(sid).and_then(HaResource::vmid) else {
            return self.crm_log(format!("crm command error - no such service: {cmd}"));
        };
        if !self.nodes.get(target).is_some_and(|n| n.online) {
            return self.crm_log(format!("crm command error - node not online: {cmd}"));
        }
        if self.vms.get(&vmid).is_some_and(|vm| vm.node == target) {
            return self.crm_log(format!(
                "ignore crm command - service already on target node: {cmd}"
            ));
        }
        let (together, separate) = self.affinitive(sid);
        if let Some(csid) = separate
            .iter()
            .find(|s| self.in_service(s) && self.blocks(s, target))
        {
            return self.crm_log(format!(
                "crm command '{cmd}' error - service '{csid}' on node '{target}' in negative affinity with service '{sid}'"
            ));
        }
        self.crm_log(format!("got crm command: {cmd}"));
        self.start_migration(now, sid, target);
        for csid in &together {
            if !self.in_service(csid) {
                continue;
            }
            let Some(cvmid) = self.ha.resources.get(csid).and_then(HaResource::vmid) else {
                continue;
            };
            let there = self.vms.get(&cvmid).is_some_and(|vm| vm.node == target)
                || self.migration_target(cvmid).as_deref() == Some(target);
            if !there {
                self.crm_log(format!(
                    "crm command '{cmd}' - migrate service '{csid}' to node '{target}' (service '{csid}' in positive affinity with service '{sid}')"
                ));
                self.start_migration(now, csid, target);
            }
        }
    }

    /// The CRM puts `sid` in state `migrate` and its source node's LRM asks qemu-server to
    /// migrate the VM: refused before a task, or a `qmigrate` task.
    fn start_migration(&mut self, now: Instant, sid: &str, target: &str) {
        let Some(vmid) = self.ha.resources.get(sid).and_then(HaResource::vmid) else {
            return;
        };
        if let Some(state) = self.ha.crm.get(sid) {
            return self.crm_log(format!(
                "ignore service '{sid}' migrate request - service in state '{state}'"
            ));
        }
        let Some(from) = self.vms.get(&vmid).map(|vm| vm.node.clone()) else {
            return;
        };
        if !self.nodes.get(&from).is_some_and(|n| n.online) {
            return self.crm_log(format!(
                "ignore service '{sid}' migrate request - node '{from}' not online"
            ));
        }
        let old = self
            .ha
            .resources
            .get(sid)
            .map_or("started", |r| self.service_state(r));
        self.crm_log(format!(
            "service '{sid}': state changed from '{old}' to 'migrate'  (node = {from}, target = {target})"
        ));
        if let Err(reason) = self.migrate_vm_checks(vmid, target) {
            self.crm_log(format!("service '{sid}' - migration failed: {reason}"));
            return self.crm_log(format!(
                "service '{sid}': state changed from 'migrate' to '{old}'  (node = {from})"
            ));
        }
        self.run_migration(now, sid, vmid, &from, target);
    }

    /// Starts the `qmigrate` task on `from`; one that will abort logs why at once.
    fn run_migration(&mut self, now: Instant, sid: &str, vmid: u32, from: &str, target: &str) {
        let problems = self.migration_problems(vmid, target);
        let outcome = match problems {
            Some(_) => Err(MIGRATION_ABORTED.to_string()),
            None => Ok(()),
        };
        let effect = Effect::Migrate {
            vmid,
            from: from.to_string(),
            target: target.to_string(),
            since: now,
        };
        let upid = self.new_task(
            now,
            from,
            "qmigrate",
            &vmid.to_string(),
            outcome,
            effect,
            None,
        );
        self.ha.crm.insert(sid.to_string(), "migrate");
        let took = hms(self.opts.duration_of("qmigrate"));
        let aborted = problems.is_some();
        if let Some(task) = self.tasks.get_mut(upid.as_str()) {
            task.log.push(format!(
                "starting migration of VM {vmid} to node '{target}'"
            ));
            if let Some((warnings, cause)) = problems {
                task.log.extend(warnings);
                task.log.push(format!(
                    "ERROR: migration aborted (duration {took}): {cause}"
                ));
            }
        }
        if !aborted && let Some(vm) = self.vms.get_mut(&vmid) {
            vm.config.insert("lock".into(), "migrate".into());
        }
    }

    /// What `migrate_vm` refuses before it starts a task: a locked VM (`check_lock`), a
    /// volume on a storage the target lacks (`check_storage_availability`).
    fn migrate_vm_checks(&self, vmid: u32, target: &str) -> Result<(), String> {
        let vm = self
            .vms
            .get(&vmid)
            .ok_or_else(|| format!("Configuration file of VM {vmid} does not exist"))?;
        if let Some(lock) = vm.lock() {
            return Err(format!("VM is locked ({lock})"));
        }
        for storage in vm.volume_storages() {
            let Some(spec) = self.storages.get(&storage) else {
                return Err(format!("storage '{storage}' does not exist"));
            };
            if !spec.nodes.is_empty() && !spec.nodes.iter().any(|n| n == target) {
                return Err(format!(
                    "storage '{storage}' is not available on node '{target}'"
                ));
            }
        }
        Ok(())
    }

    /// Why the `qmigrate` task will abort (`None`: it will not), as warnings and the cause:
    /// the flock held, PCI devices that cannot go to `target` (module `pci`), or a CD-ROM
    /// image on a non-shared storage (only cloud-init drives are made anew on the target).
    fn migration_problems(&self, vmid: u32, target: &str) -> Option<(Vec<String>, String)> {
        if self.flock_held(vmid) {
            return Some((Vec::new(), Self::flock_timeout(vmid).reason));
        }
        if let Some(cause) = self.pci_migration_blocker(vmid, target) {
            return Some((Vec::new(), cause));
        }
        let vm = self.vms.get(&vmid)?;
        let warnings: Vec<String> = vm
            .config
            .iter()
            .filter(|(k, v)| is_disk_key(k) && v.contains("media=cdrom"))
            .filter_map(|(_, v)| parse_property_string(v, "file").remove("file"))
            .filter(|file| !file.contains("-cloudinit"))
            .filter(|file| {
                file.split_once(':').is_some_and(|(storage, _)| {
                    self.storages.get(storage).is_some_and(|s| !s.shared)
                })
            })
            .map(|file| format!("can't migrate local disk '{file}': local cdrom image"))
            .collect();
        (!warnings.is_empty()).then(|| (warnings, "can't migrate VM - check log".to_string()))
    }

    /// The `qmigrate` task of VM `vmid` ended at `end` (`ok`: as it began): the VM moves to
    /// `target` unless the target went offline, the source failed or recovery moved it
    /// meanwhile; the resource leaves state `migrate` either way.
    pub(in crate::state) fn finish_migration(
        &mut self,
        vmid: u32,
        from: &str,
        target: &str,
        ok: bool,
        (since, end): (Instant, Instant),
        log: &mut Vec<String>,
    ) -> Result<(), String> {
        let sid = format!("vm:{vmid}");
        if let Some(vm) = self.vms.get_mut(&vmid)
            && vm.lock() == Some("migrate")
        {
            vm.config.remove("lock");
        }
        let migrating = self.ha.crm.get(&sid) == Some(&"migrate");
        if migrating {
            self.ha.crm.remove(&sid);
        }
        let failure = if ok {
            self.late_failure(vmid, from, target)
        } else {
            None
        };
        let took = hms(end.saturating_duration_since(since));
        let moved = ok && failure.is_none();
        if moved {
            self.move_vm(vmid, from, target, end);
            log.push(format!("migration finished successfully (duration {took})"));
        } else if let Some(cause) = &failure {
            log.push(format!(
                "ERROR: migration aborted (duration {took}): {cause}"
            ));
        }
        if migrating {
            if !moved {
                self.crm_log(format!("service '{sid}' - migration failed (exit code 1)"));
            }
            let node = if moved { target } else { from };
            let state = self
                .ha
                .resources
                .get(&sid)
                .map_or("stopped", |r| self.service_state(r));
            self.crm_log(format!(
                "service '{sid}': state changed from 'migrate' to '{state}'  (node = {node})"
            ));
            self.ha_enforce(end, &sid);
        }
        failure.map_or(Ok(()), |_| Err(MIGRATION_ABORTED.to_string()))
    }

    /// Why a migration that ran fails at its end: the target is gone, the source failed, or
    /// the VM is no longer where it started (recovered elsewhere, or destroyed).
    fn late_failure(&self, vmid: u32, from: &str, target: &str) -> Option<String> {
        let online = |n: &str| self.nodes.get(n).is_some_and(|n| n.online);
        if !online(target) {
            return Some(format!("no route to target node '{target}'"));
        }
        if !online(from) {
            return Some(format!("node '{from}' failed during the migration"));
        }
        if self.vms.get(&vmid).is_none_or(|vm| vm.node != from) {
            return Some(format!("VM {vmid} is no longer on node '{from}'"));
        }
        None
    }

    /// Puts VM `vmid` and its volumes on node-local storages on `target`; it keeps running
    /// (or stays stopped) without a boot.
    fn move_vm(&mut self, vmid: u32, from: &str, target: &str, end: Instant) {
        if let Some(vm) = self.vms.get_mut(&vmid) {
            vm.node = target.to_string();
            vm.changed_at = Some(end);
            // host devices stay with their node (a VM holding any does not get here)
            vm.pci.clear();
        }
        for v in self
            .volumes
            .iter_mut()
            .filter(|v| v.vmid == Some(vmid) && v.node.as_deref() == Some(from))
        {
            v.node = Some(target.to_string());
        }
    }
}

/// `hh:mm:ss`, as migration logs give durations.
fn hms(d: Duration) -> String {
    let s = d.as_secs();
    format!("{:02}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::topology::{SimOptions, Topology};

    /// n1..n3 on shared ceph, `local` (ISOs) everywhere, `lvm1` only on n1; HA resources
    /// vm:101..vm:105 (vm:104 requested stopped), VM 106 without HA.
    fn cluster(version: &str) -> (Cluster, Instant) {
        let yaml = "nodes: [{name: n1}, {name: n2}, {name: n3}]\n\
            storages:\n\
            - {name: ceph, type: rbd, shared: true}\n\
            - {name: local, type: dir, content: [iso, images]}\n\
            - {name: lvm1, type: lvmthin, nodes: [n1]}\n\
            guests:\n\
            - {vmid: 101, name: cp1, node: n1, storage: ceph, running: true}\n\
            - {vmid: 102, name: cp2, node: n2, storage: ceph, running: true}\n\
            - {vmid: 103, name: w1, node: n1, storage: ceph, running: true}\n\
            - {vmid: 104, name: off, node: n1, storage: ceph}\n\
            - {vmid: 105, name: pinned, node: n1, storage: lvm1, running: true}\n\
            - {vmid: 106, name: plain, node: n1, storage: ceph, running: true}\n";
        let opts = SimOptions {
            version: version.into(),
            ..SimOptions::default()
        };
        let topology = Topology::from_yaml(yaml, "t").expect("topology");
        let mut c = Cluster::new(&topology, opts, Box::new(|_| false));
        let now = Instant::now();
        for (sid, state) in [
            ("101", "started"),
            ("102", "started"),
            ("103", "started"),
            ("104", "stopped"),
            ("105", "started"),
        ] {
            c.ha_create_resource(now, &p(&[("sid", sid), ("state", state)]))
                .expect("resource");
        }
        (c, now)
    }

    fn p(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn migrate(c: &mut Cluster, now: Instant, sid: &str, node: &str) -> SimResult<Value> {
        c.ha_migrate(now, &p(&[("sid", sid), ("node", node)]))
    }

    fn migrations(c: &Cluster) -> Vec<crate::state::TaskRecord> {
        c.task_records()
            .into_iter()
            .filter(|r| r.kind == "qmigrate")
            .collect()
    }

    fn listed_on(c: &Cluster, node: &str, vmid: u32) -> bool {
        c.list_vms(node)
            .expect("list")
            .as_array()
            .is_some_and(|vms| vms.iter().any(|v| v["vmid"] == vmid))
    }

    #[tokio::test(start_paused = true)]
    async fn a_running_vm_migrates_live_and_keeps_running() {
        let (mut c, t0) = cluster("9.1.4");
        let answer = migrate(&mut c, t0, "vm:101", "n2").expect("queued");
        assert_eq!(answer, json!({"sid": "vm:101", "requested-node": "n2"}));
        // under way: still on n1, locked, HA state `migrate`, a task on the source node
        let task = migrations(&c).pop().expect("qmigrate task");
        assert_eq!((task.node.as_str(), task.vmid), ("n1", Some(101)));
        assert_eq!(task.ended, None);
        assert_eq!(c.vm_node(101).as_deref(), Some("n1"));
        assert_eq!(c.ha_state(101).as_deref(), Some("migrate"));
        assert_eq!(c.vms[&101].lock(), Some("migrate"));
        let e = c
            .update_config(t0, "n1", 101, &p(&[("cores", "2")]), false)
            .expect_err("locked");
        assert_eq!(e.reason, "VM is locked (migrate)");
        assert!(c.flock_held(101), "the migration holds the flock too");
        let t1 = t0 + c.options().duration_of("qmigrate");
        c.advance(t1);
        let task = migrations(&c).pop().expect("qmigrate task");
        assert!(task.ok && task.ended == Some(t1), "{task:?}");
        assert_eq!(c.vm_node(101).as_deref(), Some("n2"));
        assert!(listed_on(&c, "n2", 101) && !listed_on(&c, "n1", 101));
        assert_eq!(c.vm_running(101), Some(true));
        assert_eq!(c.boots(101), Some(1), "a live migration boots nothing");
        assert_eq!(c.vms[&101].lock(), None);
        assert_eq!(c.ha_state(101).as_deref(), Some("started"));
        let log = c.task_log("n1", &task.upid, 0, 10).expect("log").0;
        let lines: Vec<&str> = log
            .as_array()
            .expect("lines")
            .iter()
            .filter_map(|l| l["t"].as_str())
            .collect();
        assert!(lines.contains(&"migration finished successfully (duration 00:00:00)"));
        assert_eq!(lines.last(), Some(&"TASK OK"));
        assert!(c.ha_crm_log().iter().any(
            |l| l == "service 'vm:101': state changed from 'migrate' to 'started'  (node = n2)"
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn a_stopped_vm_moves_stopped_and_pve8_answers_null() {
        let (mut c, t0) = cluster("8.4.14");
        let t0 = t0 + Duration::from_secs(1);
        c.advance(t0);
        let answer = migrate(&mut c, t0, "104", "n3").expect("queued");
        assert_eq!(answer, Value::Null);
        c.advance(t0 + c.options().duration_of("qmigrate"));
        assert_eq!(c.vm_node(104).as_deref(), Some("n3"));
        assert_eq!(c.vm_running(104), Some(false));
        assert_eq!(c.ha_state(104).as_deref(), Some("stopped"));
        assert!(migrations(&c)[0].ok);
    }

    #[tokio::test(start_paused = true)]
    async fn only_managed_resources_may_be_migrated() {
        let (mut c, t0) = cluster("9.1.4");
        let e = migrate(&mut c, t0, "106", "n2").expect_err("not HA");
        assert_eq!(
            (e.status, e.reason.as_str()),
            (500, "resource 'vm:106' is not HA managed")
        );
        c.ha_update_resource(t0, &p(&[("sid", "103"), ("state", "ignored")]))
            .expect("ignore");
        let e = migrate(&mut c, t0, "vm:103", "n2").expect_err("ignored");
        assert_eq!(e.reason, "resource 'vm:103' is not HA managed");
        let e = migrate(&mut c, t0, "999", "n2").expect_err("no VM");
        assert_eq!(
            e.reason,
            "unable to detect SID from VMID - VM/CT 999 does not exist"
        );
        c.ha.crm.insert("vm:102".into(), "error");
        let e = migrate(&mut c, t0, "vm:102", "n1").expect_err("error state");
        assert_eq!(
            e.reason,
            "service 'vm:102' in error state, must be disabled and fixed first"
        );
        let e = migrate(&mut c, t0, "vm:101", "n 2").expect_err("bad node");
        assert_eq!(e.status, 400);
        assert_eq!(
            e.errors["node"],
            "invalid format - value does not look like a valid node name"
        );
        let e = c
            .ha_migrate(t0, &p(&[("sid", "vm:101")]))
            .expect_err("no node");
        assert_eq!(
            e.errors["node"],
            "property is missing and it is not optional"
        );
        assert!(migrations(&c).is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn the_crm_drops_a_request_for_an_offline_or_unknown_node() {
        let (mut c, t0) = cluster("9.1.4");
        c.set_node_online("n2", false);
        migrate(&mut c, t0, "vm:101", "n2").expect("the API accepts it");
        migrate(&mut c, t0, "vm:101", "n9").expect("the API accepts it");
        migrate(&mut c, t0, "vm:101", "n1").expect("the API accepts it");
        assert!(migrations(&c).is_empty());
        assert_eq!(c.vm_node(101).as_deref(), Some("n1"));
        assert_eq!(c.ha_state(101).as_deref(), Some("started"));
        let log = c.ha_crm_log();
        for line in [
            "crm command error - node not online: migrate vm:101 n2",
            "crm command error - node not online: migrate vm:101 n9",
            "ignore crm command - service already on target node: migrate vm:101 n1",
        ] {
            assert!(log.iter().any(|l| l == line), "{line}: {log:?}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_target_that_goes_offline_fails_the_task_and_the_vm_stays() {
        let (mut c, t0) = cluster("9.1.4");
        migrate(&mut c, t0, "vm:101", "n3").expect("queued");
        c.set_node_online("n3", false);
        c.advance(t0 + c.options().duration_of("qmigrate"));
        let task = migrations(&c).pop().expect("task");
        assert!(!task.ok && task.ended.is_some());
        let status = c.task_status("n1", &task.upid).expect("status");
        assert_eq!(status["exitstatus"], MIGRATION_ABORTED);
        assert_eq!(c.vm_node(101).as_deref(), Some("n1"));
        assert_eq!(c.vm_running(101), Some(true));
        assert_eq!(c.vms[&101].lock(), None);
        assert_eq!(c.ha_state(101).as_deref(), Some("started"));
        assert!(
            c.ha_crm_log()
                .contains(&"service 'vm:101' - migration failed (exit code 1)".to_string())
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_source_node_failure_aborts_the_migration_and_recovery_takes_over() {
        let (mut c, t0) = cluster("9.1.4");
        c.opts
            .task_durations
            .insert("qmigrate".into(), Duration::from_secs(30));
        migrate(&mut c, t0, "vm:103", "n2").expect("queued");
        let t1 = t0 + Duration::from_secs(10);
        c.advance(t1);
        let rs = c.fail_node(t1, "n1");
        let to = rs.iter().find(|r| r.vmid == 103).and_then(|r| r.to.clone());
        let to = to.expect("recovered");
        assert_eq!(c.vms[&103].lock(), None, "recovery drops the migrate lock");
        c.advance(t0 + Duration::from_secs(30));
        let task = migrations(&c).pop().expect("task");
        assert!(!task.ok && task.ended == Some(t0 + Duration::from_secs(30)));
        assert_eq!(c.vm_node(103), Some(to));
        assert_eq!(c.vm_running(103), Some(true));
        assert_eq!(c.ha_state(103).as_deref(), Some("started"));
    }

    #[tokio::test(start_paused = true)]
    async fn local_storage_the_target_lacks_and_locks_fail_before_a_task() {
        let (mut c, t0) = cluster("9.1.4");
        migrate(&mut c, t0, "vm:105", "n2").expect("queued");
        c.set_lock(103, Some("backup"));
        migrate(&mut c, t0, "vm:103", "n2").expect("queued");
        assert!(migrations(&c).is_empty());
        assert_eq!(c.vm_node(105).as_deref(), Some("n1"));
        assert_eq!(c.vm_node(103).as_deref(), Some("n1"));
        let log = c.ha_crm_log();
        for line in [
            "service 'vm:105' - migration failed: storage 'lvm1' is not available on node 'n2'",
            "service 'vm:103' - migration failed: VM is locked (backup)",
        ] {
            assert!(log.iter().any(|l| l == line), "{line}: {log:?}");
        }
        assert_eq!(c.ha_state(105).as_deref(), Some("started"));
    }

    #[tokio::test(start_paused = true)]
    async fn a_local_cdrom_image_aborts_the_task_and_node_local_disks_move_along() {
        let (mut c, t0) = cluster("9.1.4");
        if let Some(vm) = c.vms.get_mut(&101) {
            vm.config
                .insert("ide0".into(), "local:iso/seed-101.iso,media=cdrom".into());
        }
        migrate(&mut c, t0, "vm:101", "n2").expect("queued");
        let t1 = t0 + c.options().duration_of("qmigrate");
        c.advance(t1);
        let task = migrations(&c).pop().expect("task");
        assert!(!task.ok);
        let log = c.task_log("n1", &task.upid, 0, 10).expect("log").0;
        let text = log.to_string();
        assert!(
            text.contains("can't migrate local disk 'local:iso/seed-101.iso': local cdrom image"),
            "{text}"
        );
        assert!(text.contains("TASK ERROR: migration aborted"), "{text}");
        assert_eq!(c.vm_node(101).as_deref(), Some("n1"));
        // detached, it migrates; a disk on a storage every node has moves with the VM
        if let Some(vm) = c.vms.get_mut(&101) {
            vm.config.remove("ide0");
            vm.config
                .insert("scsi1".into(), "local:101/vm-101-disk-1.raw,size=1G".into());
        }
        c.volumes.push(crate::state::Volume {
            storage: "local".into(),
            node: Some("n1".into()),
            volid: "local:101/vm-101-disk-1.raw".into(),
            content: "images".into(),
            size: 1 << 30,
            ctime: 0,
            vmid: Some(101),
            data: None,
            format: None,
        });
        migrate(&mut c, t1, "vm:101", "n2").expect("queued");
        c.advance(t1 + c.options().duration_of("qmigrate"));
        assert_eq!(c.vm_node(101).as_deref(), Some("n2"));
        let disk = c.volumes.iter().find(|v| v.volid.ends_with("disk-1.raw"));
        assert_eq!(disk.and_then(|v| v.node.as_deref()), Some("n2"));
    }

    #[tokio::test(start_paused = true)]
    async fn pve9_resource_affinity_blocks_or_takes_others_along() {
        let (mut c, t0) = cluster("9.1.4");
        c.ha_create_rule(&p(&[
            ("rule", "cp"),
            ("type", "resource-affinity"),
            ("resources", "vm:101,vm:102"),
            ("affinity", "negative"),
        ]))
        .expect("apart");
        c.ha_create_rule(&p(&[
            ("rule", "pair"),
            ("type", "resource-affinity"),
            ("resources", "vm:101,vm:103"),
            ("affinity", "positive"),
        ]))
        .expect("together");
        let answer = migrate(&mut c, t0, "vm:101", "n2").expect("queued");
        assert_eq!(
            answer,
            json!({"sid": "vm:101", "requested-node": "n2",
                "comigrated-resources": ["vm:103"],
                "blocking-resources": [{"sid": "vm:102", "cause": "resource-affinity"}]})
        );
        assert!(migrations(&c).is_empty(), "vm:102 runs on n2");
        assert!(c.ha_crm_log().iter().any(|l| l
            == "crm command 'migrate vm:101 n2' error - service 'vm:102' on node 'n2' in negative affinity with service 'vm:101'"));
        let answer = migrate(&mut c, t0, "vm:101", "n3").expect("queued");
        assert_eq!(answer.get("blocking-resources"), None);
        let moved: Vec<Option<u32>> = migrations(&c).iter().map(|r| r.vmid).collect();
        assert_eq!(moved, [Some(101), Some(103)]);
        c.advance(t0 + c.options().duration_of("qmigrate"));
        assert_eq!(c.vm_node(101).as_deref(), Some("n3"));
        assert_eq!(c.vm_node(103).as_deref(), Some("n3"));
    }
}
