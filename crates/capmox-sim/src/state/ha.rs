//! Proxmox VE High Availability as pve-ha-manager serves it: HA resources (both versions),
//! HA groups (PVE 8; on PVE 9 the group endpoints refuse, as after the groups-to-rules
//! migration), HA rules (PVE 9: `node-affinity` and `resource-affinity`, with the
//! feasibility checks that refuse contradictory rules) and what the CRM does when a node
//! fails: it recovers each HA resource to a node its rules or group allow. Migrating a
//! resource on request (`.../{sid}/migrate`) is in `migrate`.
//!
//! Simplifications (each says what real PVE does):
//! * the CRM acts at once: creating a resource with state `started` starts a stopped VM
//!   through a `qmstart` task right away (PVE: within a CRM round, ~10 s); a failed node's
//!   resources are recovered in the same call that fails it (PVE: fence, then recovery
//!   after the node is fenced, ~2 min), and a recovered VM runs at once on its new node;
//! * power actions on HA-managed VMs keep their `qmstart`/`qmstop`/`qmshutdown` tasks but
//!   also set the resource's requested state (`started`/`stopped`), which is what PVE does
//!   when it turns them into HA requests (PVE answers with an `hastart`/`hastop` task and
//!   the VM changes state later);
//! * the placement scheduler is PVE's `basic` one: fewest HA resources per node (then
//!   fewest VMs, then the node name), within the highest priority class of the allowed
//!   online nodes; recovery ignores where the disks are (PVE needs shared storage);
//! * a recovered VM whose PCI devices cannot be had on its new node (a mapping without a
//!   free entry there, a raw device the node lacks) gets a failed `qmstart` task there with
//!   PVE's message and its resource goes to `error` at once (PVE first tries `max_restart`
//!   restarts and `max_relocate` relocations); a failback that PCI devices keep from
//!   migrating logs `migration failed (exit code 1)` and the VM stays (PVE retries it in
//!   later CRM rounds).

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use serde_json::{Value, json};
use tokio::time::Instant;

use super::{Cluster, Effect, SimError, SimResult};

mod migrate;

pub use migrate::MIGRATION_ABORTED;

/// The requested states the schema allows for an HA resource.
const STATES: &[&str] = &["started", "stopped", "enabled", "disabled", "ignored"];
/// HA rule types (PVE 9).
const RULE_TYPES: &[&str] = &["node-affinity", "resource-affinity"];
/// The prefix pve-ha-manager's `lock_ha_domain` puts before errors raised under the lock.
const LOCK: &str = "error with cfs lock 'domain-ha'";

/// One HA resource (`/etc/pve/ha/resources.cfg` entry) as configured.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HaResource {
    /// `vm:100`.
    pub sid: String,
    /// Requested state as configured (`None`: the default, `started`).
    pub state: Option<String>,
    /// HA group (PVE 8).
    pub group: Option<String>,
    /// Fail back to a higher-priority node when it comes back (PVE 9; default on).
    pub failback: Option<bool>,
    /// Restart tries on the same node.
    pub max_restart: Option<u64>,
    /// Relocation tries.
    pub max_relocate: Option<u64>,
    /// Description.
    pub comment: Option<String>,
}

impl HaResource {
    /// The VMID of a `vm:` resource.
    pub fn vmid(&self) -> Option<u32> {
        self.sid.strip_prefix("vm:")?.parse().ok()
    }

    /// The requested state with the default applied and `enabled` read as `started`.
    pub fn requested_state(&self) -> &str {
        match self.state.as_deref() {
            None | Some("enabled") => "started",
            Some(s) => s,
        }
    }
}

/// One HA group (PVE 8).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HaGroup {
    /// Group id.
    pub group: String,
    /// Member nodes with their priority (0 when none was given).
    pub nodes: BTreeMap<String, u32>,
    /// Resources may only run on the group's nodes.
    pub restricted: bool,
    /// Do not migrate back to a higher-priority node.
    pub nofailback: bool,
    /// Description.
    pub comment: Option<String>,
}

/// Whether a resource-affinity rule keeps its resources together or apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Affinity {
    /// Same node.
    Positive,
    /// Different nodes.
    Negative,
}

impl Affinity {
    /// `positive` / `negative`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Positive => "positive",
            Self::Negative => "negative",
        }
    }
}

/// What an HA rule says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HaRuleKind {
    /// `node-affinity`: the resources run on these nodes (priority per node); `strict`
    /// forbids all other nodes, otherwise they are a fallback.
    NodeAffinity {
        /// Nodes with their priority (0 when none was given).
        nodes: BTreeMap<String, u32>,
        /// Only these nodes.
        strict: bool,
    },
    /// `resource-affinity`: the resources run together or apart.
    ResourceAffinity {
        /// Together (`positive`) or apart (`negative`).
        affinity: Affinity,
    },
}

/// One HA rule (PVE 9).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HaRule {
    /// Rule id.
    pub rule: String,
    /// The resources it applies to (`vm:100`, ...).
    pub resources: BTreeSet<String>,
    /// Type and its settings.
    pub kind: HaRuleKind,
    /// Disabled rules are kept but not applied.
    pub disable: bool,
    /// Description.
    pub comment: Option<String>,
    /// Position in the rules file (creation order).
    pub order: u32,
}

impl HaRule {
    /// `node-affinity` or `resource-affinity`.
    pub fn type_name(&self) -> &'static str {
        match self.kind {
            HaRuleKind::NodeAffinity { .. } => "node-affinity",
            HaRuleKind::ResourceAffinity { .. } => "resource-affinity",
        }
    }
}

/// What the CRM did with one HA resource after a node failed or came back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Relocation {
    /// `vm:100`.
    pub sid: String,
    /// The VM.
    pub vmid: u32,
    /// Node it was on.
    pub from: String,
    /// Node it runs on now; `None` when no allowed node is online (it stays on `from`,
    /// stopped, in HA state `recovery`).
    pub to: Option<String>,
    /// Its HA state afterwards (`started`, `stopped` or `recovery`).
    pub state: String,
}

/// The HA configuration and the CRM's per-resource state overrides.
#[derive(Debug, Default)]
pub(crate) struct HaState {
    resources: BTreeMap<String, HaResource>,
    groups: BTreeMap<String, HaGroup>,
    rules: BTreeMap<String, HaRule>,
    next_order: u32,
    /// Service states the CRM set (`recovery`, `error`, `migrate`), over the derived ones.
    crm: BTreeMap<String, &'static str>,
    /// What the CRM logged about commands it dropped or carried out, oldest first.
    log: VecDeque<String>,
}

// ------------------------------------------------------------------ parameter checks

#[derive(Clone, Copy)]
enum Kind {
    Text(usize),
    Bool,
    Int0,
    Enum(&'static [&'static str]),
    SidOrVmid,
    SidList,
    /// A node name (pve-node); it need not exist.
    Node,
    NodeList(&'static str),
    ConfigId,
    ConfigIdList,
}

type Spec = &'static [(&'static str, Kind, bool)];

fn split_list(v: &str) -> impl Iterator<Item = &str> {
    v.split(|c: char| c == ',' || c == ';' || c == '\0' || c.is_whitespace())
        .filter(|s| !s.is_empty())
}

fn parse_bool(v: &str) -> Option<bool> {
    match v.to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Some(true),
        "0" | "false" | "no" | "off" => Some(false),
        _ => None,
    }
}

/// `type:name` (pve-ha-resource-id).
fn is_sid(s: &str) -> bool {
    s.split_once(':').is_some_and(|(t, n)| {
        !t.is_empty()
            && t.chars().all(|c| c.is_ascii_lowercase())
            && !n.is_empty()
            && !n.chars().any(char::is_whitespace)
    })
}

/// `node[:priority]` (pve-ha-node).
fn parse_node_entry(s: &str) -> Option<(String, u32)> {
    let (name, prio) = match s.split_once(':') {
        Some((n, p)) if !p.is_empty() && p.chars().all(|c| c.is_ascii_digit()) => {
            (n, p.parse().unwrap_or(u32::MAX))
        }
        Some(_) => return None,
        None => (s, 0),
    };
    let b = name.as_bytes();
    let ok = !b.is_empty()
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
        && b.iter().all(|c| c.is_ascii_alphanumeric() || *c == b'-');
    ok.then(|| (name.to_string(), prio))
}

fn parse_nodes(v: &str) -> BTreeMap<String, u32> {
    split_list(v).filter_map(parse_node_entry).collect()
}

fn encode_nodes(nodes: &BTreeMap<String, u32>) -> String {
    nodes
        .iter()
        .map(|(n, p)| {
            if *p == 0 {
                n.clone()
            } else {
                format!("{n}:{p}")
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

fn is_config_id(s: &str) -> bool {
    let mut chars = s.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && s.len() >= 2
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

fn check_value(kind: Kind, v: &str) -> Result<(), String> {
    match kind {
        Kind::Text(max) if v.chars().count() > max => {
            Err(format!("value may only be {max} characters long"))
        }
        Kind::Text(_) => Ok(()),
        Kind::Bool => parse_bool(v)
            .map(|_| ())
            .ok_or_else(|| format!("type check ('boolean') failed - got '{v}'")),
        Kind::Int0 => match v.parse::<i64>() {
            Err(_) => Err(format!("type check ('integer') failed - got '{v}'")),
            Ok(n) if n < 0 => Err("value must have a minimum value of 0".to_string()),
            Ok(_) => Ok(()),
        },
        Kind::Enum(values) if !values.contains(&v) => Err(format!(
            "value '{v}' does not have a value in the enumeration '{}'",
            values.join(", ")
        )),
        Kind::Enum(_) => Ok(()),
        Kind::SidOrVmid
            if is_sid(v) || (!v.is_empty() && v.chars().all(|c| c.is_ascii_digit())) =>
        {
            Ok(())
        }
        Kind::SidOrVmid => {
            Err("invalid format - value does not look like a valid ha resource id".into())
        }
        Kind::SidList => split_list(v).all(is_sid).then_some(()).ok_or_else(|| {
            "invalid format - value does not look like a valid ha resource id".into()
        }),
        Kind::Node if !v.contains(':') && parse_node_entry(v).is_some() => Ok(()),
        Kind::Node => Err("invalid format - value does not look like a valid node name".into()),
        Kind::NodeList(what) => split_list(v)
            .all(|e| parse_node_entry(e).is_some())
            .then_some(())
            .ok_or_else(|| format!("invalid format - value does not look like a valid {what}")),
        Kind::ConfigId if is_config_id(v) => Ok(()),
        Kind::ConfigId => Err(format!("invalid format - invalid configuration ID '{v}'")),
        Kind::ConfigIdList => {
            if v.len() > 4096 {
                return Err("value may only be 4096 characters long".into());
            }
            match split_list(v).find(|k| !is_config_id(k)) {
                Some(k) => Err(format!("invalid format - invalid configuration ID '{k}'")),
                None => Ok(()),
            }
        }
    }
}

/// Checks parameters like the API schema does: unknown, missing and malformed ones give
/// 400 `Parameter verification failed.` with one `errors` entry each.
fn check_params(params: &BTreeMap<String, String>, spec: Spec) -> SimResult<()> {
    let mut errors = BTreeMap::new();
    for (k, v) in params {
        match spec.iter().find(|(n, ..)| n == k) {
            None => {
                errors.insert(
                    k.clone(),
                    "property is not defined in schema and the schema does not allow additional properties"
                        .to_string(),
                );
            }
            Some((_, kind, _)) => {
                if let Err(e) = check_value(*kind, v) {
                    errors.insert(k.clone(), e);
                }
            }
        }
    }
    for (n, _, required) in spec {
        if *required && !params.contains_key(*n) {
            errors.insert(
                n.to_string(),
                "property is missing and it is not optional".into(),
            );
        }
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(SimError {
            status: 400,
            reason: "Parameter verification failed.".into(),
            errors,
        })
    }
}

const NODE9: Kind = Kind::NodeList("ha node");
const NODE8: Kind = Kind::NodeList("ha group node");
const COMMENT: Kind = Kind::Text(4096);
const DIGEST: Kind = Kind::Text(64);
const RES_TYPES: Kind = Kind::Enum(&["ct", "vm"]);

const RES_LIST: Spec = &[("type", RES_TYPES, false)];
const RES_ONE: Spec = &[("sid", Kind::SidOrVmid, true)];
const RES_DELETE9: Spec = &[("sid", Kind::SidOrVmid, true), ("purge", Kind::Bool, false)];
const RES_CREATE9: Spec = &[
    ("comment", COMMENT, false),
    ("failback", Kind::Bool, false),
    ("group", Kind::ConfigId, false),
    ("max_relocate", Kind::Int0, false),
    ("max_restart", Kind::Int0, false),
    ("sid", Kind::SidOrVmid, true),
    ("state", Kind::Enum(STATES), false),
    ("type", RES_TYPES, false),
];
const RES_CREATE8: Spec = &[
    ("comment", COMMENT, false),
    ("group", Kind::ConfigId, false),
    ("max_relocate", Kind::Int0, false),
    ("max_restart", Kind::Int0, false),
    ("sid", Kind::SidOrVmid, true),
    ("state", Kind::Enum(STATES), false),
    ("type", RES_TYPES, false),
];
const RES_UPDATE9: Spec = &[
    ("comment", COMMENT, false),
    ("delete", Kind::ConfigIdList, false),
    ("digest", DIGEST, false),
    ("failback", Kind::Bool, false),
    ("group", Kind::ConfigId, false),
    ("max_relocate", Kind::Int0, false),
    ("max_restart", Kind::Int0, false),
    ("sid", Kind::SidOrVmid, true),
    ("state", Kind::Enum(STATES), false),
];
const RES_UPDATE8: Spec = &[
    ("comment", COMMENT, false),
    ("delete", Kind::ConfigIdList, false),
    ("digest", DIGEST, false),
    ("group", Kind::ConfigId, false),
    ("max_relocate", Kind::Int0, false),
    ("max_restart", Kind::Int0, false),
    ("sid", Kind::SidOrVmid, true),
    ("state", Kind::Enum(STATES), false),
];
const GROUP_ONE: Spec = &[("group", Kind::ConfigId, true)];
const GROUP_CREATE9: Spec = &[
    ("comment", COMMENT, false),
    ("group", Kind::ConfigId, true),
    ("nodes", NODE9, true),
    ("nofailback", Kind::Bool, false),
    ("restricted", Kind::Bool, false),
    ("type", Kind::Enum(&["group"]), false),
];
const GROUP_CREATE8: Spec = &[
    ("comment", COMMENT, false),
    ("group", Kind::ConfigId, true),
    ("nodes", NODE8, true),
    ("nofailback", Kind::Bool, false),
    ("restricted", Kind::Bool, false),
    ("type", Kind::Enum(&["group"]), false),
];
const GROUP_UPDATE9: Spec = &[
    ("comment", COMMENT, false),
    ("delete", Kind::ConfigIdList, false),
    ("digest", DIGEST, false),
    ("group", Kind::ConfigId, true),
    ("nodes", NODE9, false),
    ("nofailback", Kind::Bool, false),
    ("restricted", Kind::Bool, false),
];
const GROUP_UPDATE8: Spec = &[
    ("comment", COMMENT, false),
    ("delete", Kind::ConfigIdList, false),
    ("digest", DIGEST, false),
    ("group", Kind::ConfigId, true),
    ("nodes", NODE8, false),
    ("nofailback", Kind::Bool, false),
    ("restricted", Kind::Bool, false),
];
const RULE_LIST: Spec = &[
    ("resource", Kind::Text(usize::MAX), false),
    ("type", Kind::Enum(RULE_TYPES), false),
];
const RULE_ONE: Spec = &[("rule", Kind::ConfigId, true)];
const RULE_CREATE: Spec = &[
    ("affinity", Kind::Enum(&["positive", "negative"]), false),
    ("comment", COMMENT, false),
    ("disable", Kind::Bool, false),
    ("nodes", NODE9, false),
    ("resources", Kind::SidList, true),
    ("rule", Kind::ConfigId, true),
    ("strict", Kind::Bool, false),
    ("type", Kind::Enum(RULE_TYPES), true),
];
const RULE_UPDATE: Spec = &[
    ("affinity", Kind::Enum(&["positive", "negative"]), false),
    ("comment", COMMENT, false),
    ("delete", Kind::ConfigIdList, false),
    ("digest", DIGEST, false),
    ("disable", Kind::Bool, false),
    ("nodes", NODE9, false),
    ("resources", Kind::SidList, false),
    ("rule", Kind::ConfigId, true),
    ("strict", Kind::Bool, false),
    ("type", Kind::Enum(RULE_TYPES), true),
];

fn digest_of(text: &str) -> String {
    let d = ring::digest::digest(&ring::digest::SHA1_FOR_LEGACY_USE_ONLY, text.as_bytes());
    d.as_ref().iter().map(|b| format!("{b:02x}")).collect()
}

fn locked(prefix: &str, msg: impl std::fmt::Display) -> SimError {
    SimError::e500(format!("{prefix}: {LOCK}: {msg}"))
}

fn modified() -> &'static str {
    "detected modified configuration - file changed by other user? Try again."
}

fn bool_param(params: &BTreeMap<String, String>, k: &str) -> Option<bool> {
    params.get(k).and_then(|v| parse_bool(v))
}

fn int_param(params: &BTreeMap<String, String>, k: &str) -> Option<u64> {
    params.get(k).and_then(|v| v.parse().ok())
}

/// Feasibility errors per rule and option, as pve-ha-manager's rule checks report them.
type RuleErrors = BTreeMap<String, BTreeMap<String, Vec<String>>>;

fn feasibility(rules: &BTreeMap<String, HaRule>, node_count: usize) -> RuleErrors {
    let mut errors: RuleErrors = BTreeMap::new();
    let mut push = |rule: &str, msg: &str| {
        errors
            .entry(rule.to_string())
            .or_default()
            .entry("resources".to_string())
            .or_default()
            .push(msg.to_string());
    };
    let enabled: Vec<&HaRule> = rules.values().filter(|r| !r.disable).collect();
    let node_rules: Vec<(&HaRule, &BTreeMap<String, u32>)> = enabled
        .iter()
        .filter_map(|r| match &r.kind {
            HaRuleKind::NodeAffinity { nodes, .. } => Some((*r, nodes)),
            HaRuleKind::ResourceAffinity { .. } => None,
        })
        .collect();
    let affinity_rules: Vec<(&HaRule, Affinity)> = enabled
        .iter()
        .filter_map(|r| match &r.kind {
            HaRuleKind::ResourceAffinity { affinity } => Some((*r, *affinity)),
            HaRuleKind::NodeAffinity { .. } => None,
        })
        .collect();
    // a resource in at most one node-affinity rule
    let mut by_sid: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (r, _) in &node_rules {
        for sid in &r.resources {
            by_sid.entry(sid).or_default().push(&r.rule);
        }
    }
    for (sid, ids) in &by_sid {
        if ids.len() > 1 {
            for id in ids {
                push(
                    id,
                    &format!("resource '{sid}' is already used in another node affinity rule"),
                );
            }
        }
    }
    for (r, affinity) in &affinity_rules {
        if r.resources.len() < 2 {
            push(
                &r.rule,
                "rule is ineffective as there are less than two resources",
            );
        }
        if *affinity == Affinity::Negative && r.resources.len() > node_count {
            push(&r.rule, "rule defines more resources than available nodes");
        }
    }
    // positive and negative rules must not share two or more resources
    for (neg, a) in &affinity_rules {
        if *a != Affinity::Negative {
            continue;
        }
        for (pos, b) in &affinity_rules {
            if *b == Affinity::Positive && neg.resources.intersection(&pos.resources).count() >= 2 {
                push(
                    &neg.rule,
                    "rule shares two or more resources with a positive resource affinity rule",
                );
                push(
                    &pos.rule,
                    "rule shares two or more resources with a negative resource affinity rule",
                );
            }
        }
    }
    for (ra, affinity) in &affinity_rules {
        let paired: Vec<&(&HaRule, &BTreeMap<String, u32>)> = node_rules
            .iter()
            .filter(|(na, _)| !na.resources.is_disjoint(&ra.resources))
            .collect();
        // node-affinity rules of resources in resource-affinity rules need one priority
        let multiple = paired
            .iter()
            .any(|(_, nodes)| nodes.values().collect::<BTreeSet<_>>().len() > 1);
        if multiple {
            push(
                &ra.rule,
                "resources are in node affinity rules with multiple priorities",
            );
            for (na, _) in &paired {
                push(
                    &na.rule,
                    "resources are in a resource affinity rule and cannot be in a node affinity rule with multiple priorities",
                );
            }
        }
        if *affinity == Affinity::Positive && paired.len() > 1 {
            push(&ra.rule, "resources are in multiple node affinity rules");
            for (na, _) in &paired {
                push(
                    &na.rule,
                    "at least one resource is in a positive resource affinity rule and there are other resources in at least one other node affinity rule already",
                );
            }
        }
        if *affinity == Affinity::Negative && !paired.is_empty() {
            let mut allowed: BTreeSet<&String> = BTreeSet::new();
            let mut located: BTreeSet<&String> = BTreeSet::new();
            for (na, nodes) in &paired {
                allowed.extend(nodes.keys());
                located.extend(na.resources.intersection(&ra.resources));
            }
            if allowed.len() < located.len() {
                push(
                    &ra.rule,
                    "two or more resources are restricted to less nodes than available to the resources",
                );
                for (na, _) in &paired {
                    push(
                        &na.rule,
                        "at least one resource is in a negative resource affinity rule and this rule would restrict these to less nodes than available to the resources",
                    );
                }
            }
        }
    }
    errors
}

// ------------------------------------------------------------------ the cluster's HA side

impl Cluster {
    /// The reported major version (`8`, `9`, ...): PVE 9 has HA rules, PVE 8 HA groups.
    pub fn pve_major(&self) -> u32 {
        self.opts
            .version
            .split('.')
            .next()
            .and_then(|m| m.parse().ok())
            .unwrap_or(9)
    }

    fn has_rules(&self) -> bool {
        self.pve_major() >= 9
    }

    /// The configured HA resources, by sid.
    pub fn ha_resources(&self) -> Vec<HaResource> {
        self.ha.resources.values().cloned().collect()
    }

    /// The configured HA groups (PVE 8).
    pub fn ha_groups(&self) -> Vec<HaGroup> {
        self.ha.groups.values().cloned().collect()
    }

    /// The configured HA rules (PVE 9), in file order.
    pub fn ha_rules(&self) -> Vec<HaRule> {
        let mut rules: Vec<HaRule> = self.ha.rules.values().cloned().collect();
        rules.sort_by(|a, b| (a.order, &a.rule).cmp(&(b.order, &b.rule)));
        rules
    }

    /// The HA state PVE reports for VM `vmid` (`hastate` in `/cluster/resources`):
    /// `started`, `stopped`, `ignored`, `recovery` or `error`; `None` if not HA-managed.
    pub fn ha_state(&self, vmid: u32) -> Option<String> {
        let sid = format!("vm:{vmid}");
        self.ha
            .resources
            .get(&sid)
            .map(|r| self.service_state(r).to_string())
    }

    fn service_state(&self, r: &HaResource) -> &'static str {
        if let Some(s) = self.ha.crm.get(&r.sid) {
            return s;
        }
        match r.requested_state() {
            "started" => "started",
            "ignored" => "ignored",
            _ => "stopped",
        }
    }

    /// Whether VM `vmid` is an HA resource.
    pub(super) fn ha_managed(&self, vmid: u32) -> bool {
        self.ha.resources.contains_key(&format!("vm:{vmid}"))
    }

    /// `ha` of `status/current`.
    pub(super) fn ha_status_of(&self, vmid: u32) -> Value {
        match self.ha.resources.get(&format!("vm:{vmid}")) {
            Some(r) => json!({"managed": 1, "state": self.service_state(r)}),
            None => json!({"managed": 0}),
        }
    }

    /// A power action on an HA-managed VM also sets its requested state, as PVE's HA
    /// request does (`ignored` resources are bypassed).
    pub(super) fn ha_power_request(&mut self, vmid: u32, action: &str) {
        let sid = format!("vm:{vmid}");
        let Some(r) = self.ha.resources.get_mut(&sid) else {
            return;
        };
        if r.requested_state() == "ignored" {
            return;
        }
        match action {
            "start" => r.state = Some("started".into()),
            "stop" | "shutdown" => r.state = Some("stopped".into()),
            _ => {}
        }
    }

    /// Removes VM `vmid`'s HA resource (after `DELETE ...?purge=1`), and its sid from rules.
    pub(super) fn ha_forget(&mut self, vmid: u32) {
        self.remove_resource(&format!("vm:{vmid}"), true);
    }

    fn remove_resource(&mut self, sid: &str, purge: bool) {
        self.ha.resources.remove(sid);
        self.ha.crm.remove(sid);
        if purge {
            self.ha.rules.retain(|_, rule| {
                rule.resources.remove(sid);
                !rule.resources.is_empty()
            });
        }
    }

    fn resources_digest(&self) -> String {
        let mut text = String::new();
        for r in self.ha.resources.values() {
            let (t, n) = r.sid.split_once(':').unwrap_or(("vm", &r.sid));
            text.push_str(&format!("{t}: {n}\n"));
            for (k, v) in [
                ("state", r.state.clone()),
                ("group", r.group.clone()),
                ("failback", r.failback.map(|b| u8::from(b).to_string())),
                ("max_restart", r.max_restart.map(|v| v.to_string())),
                ("max_relocate", r.max_relocate.map(|v| v.to_string())),
                ("comment", r.comment.clone()),
            ] {
                if let Some(v) = v {
                    text.push_str(&format!("\t{k} {v}\n"));
                }
            }
            text.push('\n');
        }
        digest_of(&text)
    }

    fn groups_digest(&self) -> String {
        let mut text = String::new();
        for g in self.ha.groups.values() {
            text.push_str(&format!(
                "group: {}\n\tnodes {}\n\trestricted {}\n\tnofailback {}\n\tcomment {}\n\n",
                g.group,
                encode_nodes(&g.nodes),
                u8::from(g.restricted),
                u8::from(g.nofailback),
                g.comment.clone().unwrap_or_default()
            ));
        }
        digest_of(&text)
    }

    fn rules_digest(&self) -> String {
        let mut text = String::new();
        for r in self.ha_rules() {
            text.push_str(&format!(
                "{}: {}\n\tresources {}\n",
                r.type_name(),
                r.rule,
                r.resources.iter().cloned().collect::<Vec<_>>().join(",")
            ));
            match &r.kind {
                HaRuleKind::NodeAffinity { nodes, strict } => text.push_str(&format!(
                    "\tnodes {}\n\tstrict {}\n",
                    encode_nodes(nodes),
                    u8::from(*strict)
                )),
                HaRuleKind::ResourceAffinity { affinity } => {
                    text.push_str(&format!("\taffinity {}\n", affinity.as_str()))
                }
            }
            text.push_str(&format!(
                "\tdisable {}\n\tcomment {}\n\n",
                u8::from(r.disable),
                r.comment.clone().unwrap_or_default()
            ));
        }
        digest_of(&text)
    }

    /// `100` → `vm:100` (the VM must exist), `vm:100` stays.
    fn resolve_sid(&self, raw: &str) -> SimResult<String> {
        if raw.chars().all(|c| c.is_ascii_digit()) {
            let vmid: u32 = raw.parse().unwrap_or(0);
            if self.vms.contains_key(&vmid) {
                return Ok(format!("vm:{vmid}"));
            }
            return Err(SimError::e500(format!(
                "unable to detect SID from VMID - VM/CT {raw} does not exist"
            )));
        }
        if is_sid(raw) {
            return Ok(raw.to_string());
        }
        Err(SimError::e500(format!(
            "unable to parse service id '{raw}'"
        )))
    }

    fn resource_json(&self, r: &HaResource, digest: &str) -> Value {
        let (t, _) = r.sid.split_once(':').unwrap_or(("vm", ""));
        let mut o = json!({"sid": r.sid, "type": t, "digest": digest});
        if let Some(s) = &r.state {
            o["state"] = json!(s);
        }
        if let Some(g) = &r.group
            && !self.has_rules()
        {
            o["group"] = json!(g);
            if !self.ha.groups.contains_key(g) {
                o["errors"] = json!({"group": format!("group '{g}' does not exist")});
            }
        }
        if let Some(b) = r.failback {
            o["failback"] = json!(u8::from(b));
        }
        if let Some(v) = r.max_restart {
            o["max_restart"] = json!(v);
        }
        if let Some(v) = r.max_relocate {
            o["max_relocate"] = json!(v);
        }
        if let Some(c) = &r.comment {
            o["comment"] = json!(c);
        }
        o
    }

    // ---------------------------------------------------------------- resources API

    /// `GET /cluster/ha/resources[?type=]`.
    pub fn ha_list_resources(&self, params: &BTreeMap<String, String>) -> SimResult<Value> {
        check_params(params, RES_LIST)?;
        let digest = self.resources_digest();
        Ok(Value::Array(
            self.ha
                .resources
                .values()
                .filter(|r| {
                    params
                        .get("type")
                        .is_none_or(|t| r.sid.split(':').next() == Some(t.as_str()))
                })
                .map(|r| self.resource_json(r, &digest))
                .collect(),
        ))
    }

    /// `GET /cluster/ha/resources/{sid}`.
    pub fn ha_get_resource(&self, params: &BTreeMap<String, String>) -> SimResult<Value> {
        check_params(params, RES_ONE)?;
        let sid = self.resolve_sid(&params["sid"])?;
        let r = self
            .ha
            .resources
            .get(&sid)
            .ok_or_else(|| SimError::e500(format!("no such resource '{sid}'")))?;
        Ok(self.resource_json(r, &self.resources_digest()))
    }

    /// `POST /cluster/ha/resources`.
    pub fn ha_create_resource(
        &mut self,
        now: Instant,
        params: &BTreeMap<String, String>,
    ) -> SimResult<Value> {
        let nine = self.has_rules();
        check_params(params, if nine { RES_CREATE9 } else { RES_CREATE8 })?;
        let sid = self.resolve_sid(&params["sid"])?;
        let (ty, name) = sid.split_once(':').unwrap_or_default();
        if let Some(t) = params.get("type")
            && t != ty
        {
            return Err(SimError::e500("types does not match"));
        }
        if nine && params.contains_key("group") {
            return Err(SimError::e500(
                "invalid parameter 'group': ha groups have been migrated to rules",
            ));
        }
        if ty != "vm" && ty != "ct" {
            return Err(SimError::e500(format!("unknown resource type '{ty}'")));
        }
        let valid_id =
            name.len() >= 3 && !name.starts_with('0') && name.chars().all(|c| c.is_ascii_digit());
        if !valid_id {
            return Err(SimError::e500("invalid VMID"));
        }
        let exists = ty == "vm" && name.parse().is_ok_and(|id: u32| self.vms.contains_key(&id));
        if !exists {
            return Err(SimError::e500(format!(
                "resource '{sid}' does not exist in cluster"
            )));
        }
        if self.ha.resources.contains_key(&sid) {
            return Err(locked(
                "create resource failed",
                format!("resource ID '{sid}' already defined"),
            ));
        }
        self.ha.resources.insert(
            sid.clone(),
            HaResource {
                sid: sid.clone(),
                state: params.get("state").cloned(),
                group: params.get("group").cloned(),
                failback: bool_param(params, "failback"),
                max_restart: int_param(params, "max_restart"),
                max_relocate: int_param(params, "max_relocate"),
                comment: params.get("comment").cloned(),
            },
        );
        self.ha_enforce(now, &sid);
        Ok(Value::Null)
    }

    /// `PUT /cluster/ha/resources/{sid}`.
    pub fn ha_update_resource(
        &mut self,
        now: Instant,
        params: &BTreeMap<String, String>,
    ) -> SimResult<Value> {
        let nine = self.has_rules();
        check_params(params, if nine { RES_UPDATE9 } else { RES_UPDATE8 })?;
        let sid = self.resolve_sid(&params["sid"])?;
        if let Some(g) = params.get("group") {
            if nine {
                return Err(SimError::e500(
                    "invalid parameter 'group': ha groups have been migrated to rules",
                ));
            }
            if !self.ha.groups.contains_key(g) {
                return Err(SimError::e500(format!("HA group '{g}' does not exist")));
            }
        }
        if self.ha.crm.get(&sid) == Some(&"error")
            && params.get("state").map(String::as_str) != Some("disabled")
        {
            return Err(SimError::e500(format!(
                "service '{sid}' in error state, must be disabled and fixed first"
            )));
        }
        let prefix = if nine {
            "update resources config failed"
        } else {
            "update resource failed"
        };
        if let Some(d) = params.get("digest")
            && *d != self.resources_digest()
        {
            return Err(locked(prefix, modified()));
        }
        let Some(r) = self.ha.resources.get(&sid) else {
            return Err(locked(prefix, format!("no such resource '{sid}'")));
        };
        let mut r = r.clone();
        if let Some(v) = params.get("state") {
            r.state = Some(v.clone());
        }
        if let Some(v) = params.get("group") {
            r.group = Some(v.clone());
        }
        if let Some(v) = bool_param(params, "failback") {
            r.failback = Some(v);
        }
        if let Some(v) = int_param(params, "max_restart") {
            r.max_restart = Some(v);
        }
        if let Some(v) = int_param(params, "max_relocate") {
            r.max_relocate = Some(v);
        }
        if let Some(v) = params.get("comment") {
            r.comment = Some(v.clone());
        }
        for k in params
            .get("delete")
            .map(|d| split_list(d))
            .into_iter()
            .flatten()
        {
            match k {
                "state" => r.state = None,
                "group" if !nine => r.group = None,
                "failback" if nine => r.failback = None,
                "max_restart" => r.max_restart = None,
                "max_relocate" => r.max_relocate = None,
                "comment" => r.comment = None,
                other => return Err(locked(prefix, format!("no such option '{other}'"))),
            }
        }
        if r.requested_state() == "disabled" && self.ha.crm.get(&sid) == Some(&"error") {
            self.ha.crm.remove(&sid);
        }
        self.ha.resources.insert(sid.clone(), r);
        self.ha_enforce(now, &sid);
        Ok(Value::Null)
    }

    /// `DELETE /cluster/ha/resources/{sid}[?purge=0|1]`: with `purge` (default, PVE 9) the
    /// sid also leaves every rule, and rules left without resources go.
    pub fn ha_delete_resource(&mut self, params: &BTreeMap<String, String>) -> SimResult<Value> {
        let nine = self.has_rules();
        check_params(params, if nine { RES_DELETE9 } else { RES_ONE })?;
        let sid = self.resolve_sid(&params["sid"])?;
        if !self.ha.resources.contains_key(&sid) {
            return Err(SimError::e500(format!(
                "cannot delete service '{sid}', not HA managed!"
            )));
        }
        let purge = bool_param(params, "purge").unwrap_or(true);
        self.remove_resource(&sid, purge);
        Ok(Value::Null)
    }

    /// The CRM's reaction to a requested state: start a stopped VM that should run, shut
    /// down a running one that should not (a task each, at once). A start that cannot
    /// work (template, locked) leaves the resource in state `error`, as PVE ends up after
    /// its restart and relocation tries.
    fn ha_enforce(&mut self, now: Instant, sid: &str) {
        let Some(r) = self.ha.resources.get(sid) else {
            return;
        };
        if self.ha.crm.contains_key(sid) {
            return;
        }
        let want = r.requested_state().to_string();
        let Some(vmid) = r.vmid() else {
            return;
        };
        let Some(vm) = self.vms.get(&vmid) else {
            return;
        };
        if !self.nodes.get(&vm.node).is_some_and(|n| n.online) {
            return;
        }
        let node = vm.node.clone();
        let pending = self.tasks.values().any(|t| {
            !t.done
                && t.vmid == Some(vmid)
                && matches!(
                    t.upid.task_type.as_str(),
                    "qmstart" | "qmstop" | "qmshutdown"
                )
        });
        if pending {
            return;
        }
        match want.as_str() {
            "started" if !vm.running => {
                let outcome = if vm.is_template() {
                    Err("you can't start a vm if it's a template".to_string())
                } else if let Some(l) = vm.lock() {
                    Err(format!("VM is locked ({l})"))
                } else {
                    self.reserve_pci(vmid)
                };
                if outcome.is_err() {
                    self.ha.crm.insert(sid.to_string(), "error");
                }
                self.new_task(
                    now,
                    &node,
                    "qmstart",
                    &vmid.to_string(),
                    outcome,
                    Effect::Start { vmid },
                    None,
                );
            }
            "stopped" | "disabled" if vm.running => {
                self.new_task(
                    now,
                    &node,
                    "qmshutdown",
                    &vmid.to_string(),
                    Ok(()),
                    Effect::Stop { vmid },
                    None,
                );
            }
            _ => {}
        }
    }

    // ---------------------------------------------------------------- groups API (PVE 8)

    fn group_json(&self, g: &HaGroup, digest: &str) -> Value {
        let mut o = json!({"group": g.group, "type": "group", "nodes": encode_nodes(&g.nodes), "digest": digest});
        if g.restricted {
            o["restricted"] = json!(1);
        }
        if g.nofailback {
            o["nofailback"] = json!(1);
        }
        if let Some(c) = &g.comment {
            o["comment"] = json!(c);
        }
        o
    }

    fn migrated(&self, what: &str) -> SimResult<()> {
        if self.has_rules() {
            return Err(SimError::e500(format!(
                "cannot {what}: ha groups have been migrated to rules"
            )));
        }
        Ok(())
    }

    /// `GET /cluster/ha/groups` (PVE 9: refused, the groups were migrated to rules).
    pub fn ha_list_groups(&self, params: &BTreeMap<String, String>) -> SimResult<Value> {
        check_params(params, &[])?;
        self.migrated("index groups")?;
        let digest = self.groups_digest();
        Ok(Value::Array(
            self.ha
                .groups
                .values()
                .map(|g| self.group_json(g, &digest))
                .collect(),
        ))
    }

    /// `GET /cluster/ha/groups/{group}`.
    pub fn ha_get_group(&self, params: &BTreeMap<String, String>) -> SimResult<Value> {
        check_params(params, GROUP_ONE)?;
        self.migrated("read group")?;
        let id = &params["group"];
        let g = self
            .ha
            .groups
            .get(id)
            .ok_or_else(|| SimError::e500(format!("no such ha group '{id}'")))?;
        Ok(self.group_json(g, &self.groups_digest()))
    }

    /// `POST /cluster/ha/groups`.
    pub fn ha_create_group(&mut self, params: &BTreeMap<String, String>) -> SimResult<Value> {
        let nine = self.has_rules();
        check_params(params, if nine { GROUP_CREATE9 } else { GROUP_CREATE8 })?;
        self.migrated("create group")?;
        let id = params["group"].clone();
        if self.ha.groups.contains_key(&id) {
            return Err(locked(
                "create ha group failed",
                format!("ha group ID '{id}' already defined"),
            ));
        }
        self.ha.groups.insert(
            id.clone(),
            HaGroup {
                group: id,
                nodes: parse_nodes(&params["nodes"]),
                restricted: bool_param(params, "restricted").unwrap_or(false),
                nofailback: bool_param(params, "nofailback").unwrap_or(false),
                comment: params.get("comment").cloned(),
            },
        );
        Ok(Value::Null)
    }

    /// `PUT /cluster/ha/groups/{group}`.
    pub fn ha_update_group(&mut self, params: &BTreeMap<String, String>) -> SimResult<Value> {
        let nine = self.has_rules();
        check_params(params, if nine { GROUP_UPDATE9 } else { GROUP_UPDATE8 })?;
        self.migrated("update group")?;
        const P: &str = "update ha group failed";
        if let Some(d) = params.get("digest")
            && *d != self.groups_digest()
        {
            return Err(locked(P, modified()));
        }
        let id = &params["group"];
        let Some(g) = self.ha.groups.get_mut(id) else {
            return Err(locked(P, format!("no such ha group '{id}'")));
        };
        let mut g2 = g.clone();
        if let Some(n) = params.get("nodes") {
            g2.nodes = parse_nodes(n);
        }
        if let Some(v) = bool_param(params, "restricted") {
            g2.restricted = v;
        }
        if let Some(v) = bool_param(params, "nofailback") {
            g2.nofailback = v;
        }
        if let Some(c) = params.get("comment") {
            g2.comment = Some(c.clone());
        }
        for k in params
            .get("delete")
            .map(|d| split_list(d))
            .into_iter()
            .flatten()
        {
            match k {
                "nodes" => return Err(locked(P, "unable to delete required option 'nodes'")),
                "restricted" => g2.restricted = false,
                "nofailback" => g2.nofailback = false,
                "comment" => g2.comment = None,
                other => return Err(locked(P, format!("no such option '{other}'"))),
            }
        }
        *g = g2;
        Ok(Value::Null)
    }

    /// `DELETE /cluster/ha/groups/{group}` (refused while a resource uses the group; an
    /// unknown group is no error, as in pve-ha-manager).
    pub fn ha_delete_group(&mut self, params: &BTreeMap<String, String>) -> SimResult<Value> {
        check_params(params, GROUP_ONE)?;
        self.migrated("delete group")?;
        let id = &params["group"];
        if let Some(r) = self
            .ha
            .resources
            .values()
            .find(|r| r.group.as_deref() == Some(id.as_str()))
        {
            return Err(locked(
                "delete ha group failed",
                format!("ha group is used by service '{}'", r.sid),
            ));
        }
        self.ha.groups.remove(id);
        Ok(Value::Null)
    }

    // ---------------------------------------------------------------- rules API (PVE 9)

    fn rule_json(
        &self,
        r: &HaRule,
        digest: &str,
        errors: Option<&BTreeMap<String, Vec<String>>>,
    ) -> Value {
        let mut o = json!({
            "rule": r.rule, "type": r.type_name(), "digest": digest, "order": r.order,
            "resources": r.resources.iter().cloned().collect::<Vec<_>>().join(","),
        });
        match &r.kind {
            HaRuleKind::NodeAffinity { nodes, strict } => {
                o["nodes"] = json!(encode_nodes(nodes));
                if *strict {
                    o["strict"] = json!(1);
                }
            }
            HaRuleKind::ResourceAffinity { affinity } => o["affinity"] = json!(affinity.as_str()),
        }
        if r.disable {
            o["disable"] = json!(1);
        }
        if let Some(c) = &r.comment {
            o["comment"] = json!(c);
        }
        if let Some(e) = errors {
            o["errors"] = json!(e);
        }
        o
    }

    /// `GET /cluster/ha/rules[?type=&resource=]`; infeasible rules carry `errors`.
    pub fn ha_list_rules(&self, params: &BTreeMap<String, String>) -> SimResult<Value> {
        check_params(params, RULE_LIST)?;
        let digest = self.rules_digest();
        let errors = feasibility(&self.ha.rules, self.nodes.len());
        Ok(Value::Array(
            self.ha_rules()
                .iter()
                .filter(|r| params.get("type").is_none_or(|t| t == r.type_name()))
                .filter(|r| {
                    params
                        .get("resource")
                        .is_none_or(|s| r.resources.contains(s))
                })
                .map(|r| self.rule_json(r, &digest, errors.get(&r.rule)))
                .collect(),
        ))
    }

    /// `GET /cluster/ha/rules/{rule}`.
    pub fn ha_get_rule(&self, params: &BTreeMap<String, String>) -> SimResult<Value> {
        check_params(params, RULE_ONE)?;
        let id = &params["rule"];
        let r = self
            .ha
            .rules
            .get(id)
            .ok_or_else(|| SimError::e500(format!("no such ha rule '{id}'")))?;
        let errors = feasibility(&self.ha.rules, self.nodes.len());
        Ok(self.rule_json(r, &self.rules_digest(), errors.get(id)))
    }

    /// Options a rule type takes (besides `type` and `rule`).
    fn rule_options(ty: &str) -> &'static [&'static str] {
        if ty == "node-affinity" {
            &["resources", "nodes", "strict", "disable", "comment"]
        } else {
            &["resources", "affinity", "disable", "comment"]
        }
    }

    /// The checks under the HA lock: resources configured, nodes exist, rule feasible.
    fn rule_checks(
        &self,
        prefix: &str,
        rule: &HaRule,
        rules: &BTreeMap<String, HaRule>,
    ) -> SimResult<()> {
        let unmanaged: Vec<&str> = rule
            .resources
            .iter()
            .filter(|s| !self.ha.resources.contains_key(*s))
            .map(String::as_str)
            .collect();
        if !unmanaged.is_empty() {
            return Err(locked(
                prefix,
                format!("cannot use unmanaged resource(s) {}.", unmanaged.join(", ")),
            ));
        }
        if let HaRuleKind::NodeAffinity { nodes, .. } = &rule.kind {
            let unknown: Vec<&str> = nodes
                .keys()
                .filter(|n| !self.nodes.contains_key(*n))
                .map(String::as_str)
                .collect();
            if !unknown.is_empty() {
                return Err(locked(
                    prefix,
                    format!("cannot use non-existant node(s) {}.", unknown.join(", ")),
                ));
            }
        }
        if let Some(errs) = feasibility(rules, self.nodes.len()).get(&rule.rule) {
            // the 400 exception is stringified by lock_ha_domain: a 500 whose first line
            // is "<prefix>: 400 Rule '<id>' is invalid." and whose next lines list the errors
            let details: Vec<String> = errs
                .iter()
                .map(|(k, v)| format!("{k}: {}", v.join(", ")))
                .collect();
            return Err(SimError::e500(format!(
                "{prefix}: 400 Rule '{}' is invalid.\n{}",
                rule.rule,
                details.join("\n")
            )));
        }
        Ok(())
    }

    /// `POST /cluster/ha/rules`.
    pub fn ha_create_rule(&mut self, params: &BTreeMap<String, String>) -> SimResult<Value> {
        check_params(params, RULE_CREATE)?;
        const P: &str = "create ha rule failed";
        let ty = params["type"].as_str();
        let id = params["rule"].clone();
        let allowed = Self::rule_options(ty);
        if let Some(k) = params
            .keys()
            .find(|k| *k != "type" && *k != "rule" && !allowed.contains(&k.as_str()))
        {
            return Err(SimError::e500(format!("unexpected property '{k}'")));
        }
        let required = if ty == "node-affinity" {
            "nodes"
        } else {
            "affinity"
        };
        if !params.contains_key(required) {
            return Err(SimError::e500(format!(
                "missing value for required option '{required}'"
            )));
        }
        if self.ha.rules.contains_key(&id) {
            return Err(locked(P, format!("HA rule '{id}' already defined")));
        }
        let kind = if ty == "node-affinity" {
            HaRuleKind::NodeAffinity {
                nodes: parse_nodes(&params["nodes"]),
                strict: bool_param(params, "strict").unwrap_or(false),
            }
        } else {
            HaRuleKind::ResourceAffinity {
                affinity: if params["affinity"] == "positive" {
                    Affinity::Positive
                } else {
                    Affinity::Negative
                },
            }
        };
        let rule = HaRule {
            rule: id.clone(),
            resources: split_list(&params["resources"])
                .map(str::to_string)
                .collect(),
            kind,
            disable: bool_param(params, "disable").unwrap_or(false),
            comment: params.get("comment").cloned(),
            order: self.ha.next_order + 1,
        };
        let mut rules = self.ha.rules.clone();
        rules.insert(id.clone(), rule.clone());
        self.rule_checks(P, &rule, &rules)?;
        self.ha.next_order += 1;
        self.ha.rules = rules;
        Ok(Value::Null)
    }

    /// `PUT /cluster/ha/rules/{rule}`.
    pub fn ha_update_rule(&mut self, params: &BTreeMap<String, String>) -> SimResult<Value> {
        check_params(params, RULE_UPDATE)?;
        const P: &str = "update HA rules failed";
        if let Some(d) = params.get("digest")
            && *d != self.rules_digest()
        {
            return Err(locked(P, modified()));
        }
        let id = params["rule"].clone();
        let Some(old) = self.ha.rules.get(&id) else {
            return Err(locked(P, format!("HA rule '{id}' does not exist")));
        };
        let mut rule = old.clone();
        let allowed = Self::rule_options(rule.type_name());
        if let Some(k) = params.keys().find(|k| {
            !["type", "rule", "digest", "delete"].contains(&k.as_str())
                && !allowed.contains(&k.as_str())
        }) {
            return Err(locked(P, format!("unexpected property '{k}'")));
        }
        if let Some(v) = params.get("resources") {
            rule.resources = split_list(v).map(str::to_string).collect();
        }
        if let Some(v) = bool_param(params, "disable") {
            rule.disable = v;
        }
        if let Some(v) = params.get("comment") {
            rule.comment = Some(v.clone());
        }
        match &mut rule.kind {
            HaRuleKind::NodeAffinity { nodes, strict } => {
                if let Some(v) = params.get("nodes") {
                    *nodes = parse_nodes(v);
                }
                if let Some(v) = bool_param(params, "strict") {
                    *strict = v;
                }
            }
            HaRuleKind::ResourceAffinity { affinity } => {
                if let Some(v) = params.get("affinity") {
                    *affinity = if v == "positive" {
                        Affinity::Positive
                    } else {
                        Affinity::Negative
                    };
                }
            }
        }
        for k in params
            .get("delete")
            .map(|d| split_list(d))
            .into_iter()
            .flatten()
        {
            match (k, &mut rule.kind) {
                ("disable", _) => rule.disable = false,
                ("comment", _) => rule.comment = None,
                ("strict", HaRuleKind::NodeAffinity { strict, .. }) => *strict = false,
                ("resources" | "nodes" | "affinity", _) if allowed.contains(&k) => {
                    return Err(locked(P, format!("unable to delete required option '{k}'")));
                }
                (other, _) => return Err(locked(P, format!("no such option '{other}'"))),
            }
        }
        let mut rules = self.ha.rules.clone();
        rules.insert(id, rule.clone());
        self.rule_checks(P, &rule, &rules)?;
        self.ha.rules = rules;
        Ok(Value::Null)
    }

    /// `DELETE /cluster/ha/rules/{rule}` (an unknown rule is no error, as in pve-ha-manager).
    pub fn ha_delete_rule(&mut self, params: &BTreeMap<String, String>) -> SimResult<Value> {
        check_params(params, RULE_ONE)?;
        self.ha.rules.remove(&params["rule"]);
        Ok(Value::Null)
    }

    // ---------------------------------------------------------------- status

    /// `GET /cluster/ha/status/current`: quorum, and with HA resources the master, one LRM
    /// per node and one entry per resource.
    pub fn ha_status_current(&self, params: &BTreeMap<String, String>) -> SimResult<Value> {
        check_params(params, &[])?;
        let first_online = self
            .nodes
            .iter()
            .find(|(_, n)| n.online)
            .map(|(name, _)| name.clone())
            .unwrap_or_default();
        let ts = self.epoch + self.counter;
        let mut out = vec![
            json!({"id": "quorum", "type": "quorum", "node": first_online, "status": "OK", "quorate": 1}),
        ];
        if self.ha.resources.is_empty() {
            return Ok(Value::Array(out));
        }
        out.push(
            json!({"id": "master", "type": "master", "node": first_online,
            "status": format!("{first_online} (active, {ts})"), "timestamp": ts}),
        );
        for (name, n) in &self.nodes {
            let active = self.ha.resources.values().any(|r| {
                r.vmid()
                    .and_then(|id| self.vms.get(&id))
                    .is_some_and(|vm| vm.node == *name)
            });
            let status = match (n.online, active) {
                (false, _) => format!("{name} (old timestamp - dead?, {ts})"),
                (true, true) => format!("{name} (active, {ts})"),
                (true, false) => format!("{name} (idle, {ts})"),
            };
            out.push(json!({"id": format!("lrm:{name}"), "type": "lrm", "node": name, "status": status, "timestamp": ts}));
        }
        for r in self.ha.resources.values() {
            if r.requested_state() == "ignored" {
                continue;
            }
            let node = r
                .vmid()
                .and_then(|id| self.vms.get(&id))
                .map(|vm| vm.node.clone())
                .unwrap_or_default();
            let state = self.service_state(r);
            let e = json!({"id": format!("service:{}", r.sid), "type": "service", "sid": r.sid,
                "node": node, "state": state, "crm_state": state, "request_state": r.requested_state(),
                "status": state, "max_restart": r.max_restart.unwrap_or(1), "max_relocate": r.max_relocate.unwrap_or(1)});
            // (PVE 9.2 adds `failback` here; the 9.1 schema does not document it)
            out.push(e);
        }
        Ok(Value::Array(out))
    }

    // ---------------------------------------------------------------- node failure

    /// The nodes resource `sid` may run on and their priorities, per its node-affinity
    /// rule (PVE 9) or group (PVE 8), limited to online nodes; non-strict rules and
    /// unrestricted groups add the other online nodes at priority -1.
    fn allowed_nodes(&self, r: &HaResource) -> BTreeMap<String, i64> {
        let online: Vec<&String> = self
            .nodes
            .iter()
            .filter(|(_, n)| n.online)
            .map(|(name, _)| name)
            .collect();
        let affinity: Option<(&BTreeMap<String, u32>, bool)> = if self.has_rules() {
            self.ha.rules.values().find_map(|rule| match &rule.kind {
                HaRuleKind::NodeAffinity { nodes, strict }
                    if !rule.disable && rule.resources.contains(&r.sid) =>
                {
                    Some((nodes, *strict))
                }
                _ => None,
            })
        } else {
            r.group
                .as_ref()
                .and_then(|g| self.ha.groups.get(g))
                .map(|g| (&g.nodes, g.restricted))
        };
        let mut out = BTreeMap::new();
        match affinity {
            None => {
                for n in online {
                    out.insert(n.clone(), 0);
                }
            }
            Some((nodes, strict)) => {
                for n in online {
                    match nodes.get(n) {
                        Some(p) => {
                            out.insert(n.clone(), i64::from(*p));
                        }
                        None if !strict => {
                            out.insert(n.clone(), -1);
                        }
                        None => {}
                    }
                }
            }
        }
        out
    }

    /// The online nodes of the other members of `sid`'s resource-affinity rules (PVE 9):
    /// (nodes to keep apart from, node counts to join).
    fn affinity_nodes(&self, sid: &str) -> (BTreeSet<String>, BTreeMap<String, usize>) {
        let mut separate = BTreeSet::new();
        let mut together: BTreeMap<String, usize> = BTreeMap::new();
        if !self.has_rules() {
            return (separate, together);
        }
        for rule in self.ha.rules.values() {
            let HaRuleKind::ResourceAffinity { affinity } = rule.kind else {
                continue;
            };
            if rule.disable || !rule.resources.contains(sid) {
                continue;
            }
            for other in rule.resources.iter().filter(|s| *s != sid) {
                let Some(r) = self.ha.resources.get(other) else {
                    continue;
                };
                if self.ha.crm.contains_key(other) || r.requested_state() == "ignored" {
                    continue;
                }
                let Some(vm) = r.vmid().and_then(|id| self.vms.get(&id)) else {
                    continue;
                };
                if !self.nodes.get(&vm.node).is_some_and(|n| n.online) {
                    continue;
                }
                match affinity {
                    Affinity::Negative => {
                        separate.insert(vm.node.clone());
                    }
                    Affinity::Positive => *together.entry(vm.node.clone()).or_default() += 1,
                }
            }
        }
        (separate, together)
    }

    /// The nodes the CRM would place `sid` on: the highest priority class of its allowed
    /// online nodes, minus nodes running a member of a negative rule, narrowed to the most
    /// populated node of a positive rule.
    fn preferred_nodes(&self, r: &HaResource) -> BTreeSet<String> {
        let allowed = self.allowed_nodes(r);
        let Some(top) = allowed.values().max().copied() else {
            return BTreeSet::new();
        };
        let mut pri: BTreeSet<String> = allowed
            .into_iter()
            .filter(|(_, p)| *p == top)
            .map(|(n, _)| n)
            .collect();
        let (separate, together) = self.affinity_nodes(&r.sid);
        pri.retain(|n| !separate.contains(n));
        let majority = together
            .iter()
            .filter(|(n, _)| pri.contains(*n))
            .max_by(|a, b| a.1.cmp(b.1).then(b.0.cmp(a.0)))
            .map(|(n, _)| n.clone());
        if let Some(m) = majority {
            pri.retain(|n| *n == m);
        }
        pri
    }

    /// PVE's `basic` scheduler: fewest HA resources on the node, then fewest VMs, then name.
    fn best_node(&self, sid: &str, candidates: &BTreeSet<String>) -> Option<String> {
        let score = |node: &String| {
            let ha = self
                .ha
                .resources
                .values()
                .filter(|r| r.sid != sid && !self.ha.crm.contains_key(&r.sid))
                .filter_map(|r| r.vmid().and_then(|id| self.vms.get(&id)))
                .filter(|vm| vm.node == *node)
                .count();
            let vms = self.vms.values().filter(|vm| vm.node == *node).count();
            (ha, vms, node.clone())
        };
        candidates.iter().min_by_key(|n| score(n)).cloned()
    }

    /// Moves VM `vmid` to `to` (keeping VMID and config) and runs it there if its resource
    /// should run.
    fn ha_move(&mut self, now: Instant, sid: &str, vmid: u32, to: &str, restart: bool) {
        let run = self
            .ha
            .resources
            .get(sid)
            .is_some_and(|r| r.requested_state() == "started");
        self.ha.crm.remove(sid);
        if let Some(vm) = self.vms.get_mut(&vmid) {
            vm.node = to.to_string();
            vm.changed_at = Some(now);
            // PVE drops the lock an interrupted migration left on a recovered service
            if restart && vm.lock() == Some("migrate") {
                vm.config.remove("lock");
            }
        }
        if !restart || !run {
            return;
        }
        // the LRM of the new node starts it: its PCI devices must be had there
        if let Err(reason) = self.reserve_pci(vmid) {
            let id = vmid.to_string();
            self.new_task(
                now,
                to,
                "qmstart",
                &id,
                Err(reason),
                Effect::Start { vmid },
                None,
            );
            self.ha.crm.insert(sid.to_string(), "error");
            return;
        }
        if let Some(vm) = self.vms.get_mut(&vmid) {
            vm.running = true;
            vm.started_at = Some(now);
            vm.boots = vm.boots.saturating_add(1);
            vm.hung = false;
        }
        self.dhcp_after_boot(vmid, now);
    }

    /// Tries to place every resource in state `recovery`, in VMID order.
    fn recover(&mut self, now: Instant) -> Vec<Relocation> {
        let pending: Vec<(String, u32)> = self
            .ha
            .crm
            .iter()
            .filter(|(_, s)| **s == "recovery")
            .filter_map(|(sid, _)| {
                let vmid = self.ha.resources.get(sid)?.vmid()?;
                Some((sid.clone(), vmid))
            })
            .collect();
        let mut pending = pending;
        pending.sort_by_key(|(_, vmid)| *vmid);
        let mut out = Vec::new();
        for (sid, vmid) in pending {
            let Some(from) = self.vms.get(&vmid).map(|vm| vm.node.clone()) else {
                continue;
            };
            let Some(r) = self.ha.resources.get(&sid).cloned() else {
                continue;
            };
            let to = self.best_node(&sid, &self.preferred_nodes(&r));
            if let Some(to) = &to {
                self.ha_move(now, &sid, vmid, to, true);
            }
            let state = self
                .ha
                .resources
                .get(&sid)
                .map(|r| self.service_state(r).to_string())
                .unwrap_or_default();
            out.push(Relocation {
                sid,
                vmid,
                from,
                to,
                state,
            });
        }
        out
    }

    /// Node `node` fails: it goes offline, every VM on it stops, and the CRM recovers each
    /// HA resource on it (requested `started` or `stopped`; `disabled` and `ignored` ones
    /// stay) to an allowed online node, where a `started` one runs at once. A resource
    /// without an allowed node stays on the dead node, stopped, in HA state `recovery`, and
    /// is retried whenever a node fails or comes back. Returns one entry per resource that
    /// was on the node or still waited for a node, in VMID order. Non-HA VMs stay on the
    /// dead node, stopped.
    pub fn fail_node(&mut self, now: Instant, node: &str) -> Vec<Relocation> {
        let Some(n) = self.nodes.get_mut(node) else {
            return Vec::new();
        };
        n.online = false;
        let mut hit = Vec::new();
        for (vmid, vm) in self.vms.iter_mut().filter(|(_, vm)| vm.node == node) {
            if vm.running {
                vm.running = false;
                vm.started_at = None;
                vm.changed_at = Some(now);
            }
            vm.pci.clear();
            hit.push(*vmid);
        }
        for vmid in hit {
            let sid = format!("vm:{vmid}");
            if let Some(r) = self.ha.resources.get(&sid)
                && matches!(r.requested_state(), "started" | "stopped")
                && self.ha.crm.get(&sid) != Some(&"error")
            {
                self.ha.crm.insert(sid, "recovery");
            }
        }
        self.recover(now)
    }

    /// Node `node` comes back: resources waiting in `recovery` are placed again (possibly
    /// on this node), and running resources whose `failback` is on (PVE 9 default; PVE 8:
    /// a group without `nofailback`) migrate back when this node now is in their highest
    /// priority class and their current node is not. Returns what moved or was retried.
    pub fn revive_node(&mut self, now: Instant, node: &str) -> Vec<Relocation> {
        let Some(n) = self.nodes.get_mut(node) else {
            return Vec::new();
        };
        n.online = true;
        let mut out = self.recover(now);
        let candidates: Vec<HaResource> = self
            .ha
            .resources
            .values()
            .filter(|r| !self.ha.crm.contains_key(&r.sid) && r.requested_state() == "started")
            .cloned()
            .collect();
        for r in candidates {
            let failback = if self.has_rules() {
                r.failback.unwrap_or(true)
            } else {
                r.group
                    .as_ref()
                    .and_then(|g| self.ha.groups.get(g))
                    .is_some_and(|g| !g.nofailback)
            };
            let Some(vmid) = r.vmid() else { continue };
            let Some(from) = self.vms.get(&vmid).map(|vm| vm.node.clone()) else {
                continue;
            };
            if !failback || !self.nodes.get(&from).is_some_and(|n| n.online) {
                continue;
            }
            let preferred = self.preferred_nodes(&r);
            if preferred.is_empty() || preferred.contains(&from) || !preferred.contains(node) {
                continue;
            }
            if let Some(to) = self.best_node(&r.sid, &preferred) {
                // an online migration: the VM keeps running, unless its PCI devices keep it
                if self.pci_migration_blocker(vmid, &to).is_some() {
                    self.crm_log(format!(
                        "service '{}' - migration failed (exit code 1)",
                        r.sid
                    ));
                    continue;
                }
                self.ha_move(now, &r.sid, vmid, &to, false);
                out.push(Relocation {
                    sid: r.sid.clone(),
                    vmid,
                    from,
                    to: Some(to),
                    state: "started".into(),
                });
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats() {
        assert_eq!(parse_node_entry("pve1:2"), Some(("pve1".into(), 2)));
        assert_eq!(parse_node_entry("pve-1"), Some(("pve-1".into(), 0)));
        assert_eq!(parse_node_entry("-x"), None);
        assert_eq!(parse_node_entry("a:b"), None);
        assert!(is_sid("vm:100") && !is_sid("100") && !is_sid("VM:1") && !is_sid("vm:"));
        assert!(is_config_id("zone-a") && !is_config_id("1a") && !is_config_id("a"));
        let n = parse_nodes("b:2, a");
        assert_eq!(encode_nodes(&n), "a,b:2");
        assert!(check_value(Kind::Bool, "yes").is_ok());
        assert_eq!(
            check_value(Kind::Int0, "-1").expect_err("negative"),
            "value must have a minimum value of 0"
        );
    }

    fn na(id: &str, res: &[&str], nodes: &[(&str, u32)], order: u32) -> HaRule {
        HaRule {
            rule: id.into(),
            resources: res.iter().map(|s| s.to_string()).collect(),
            kind: HaRuleKind::NodeAffinity {
                nodes: nodes.iter().map(|(n, p)| (n.to_string(), *p)).collect(),
                strict: true,
            },
            disable: false,
            comment: None,
            order,
        }
    }

    fn ra(id: &str, res: &[&str], affinity: Affinity, order: u32) -> HaRule {
        HaRule {
            rule: id.into(),
            resources: res.iter().map(|s| s.to_string()).collect(),
            kind: HaRuleKind::ResourceAffinity { affinity },
            disable: false,
            comment: None,
            order,
        }
    }

    #[test]
    fn feasibility_checks_match_pve() {
        let mut rules = BTreeMap::new();
        for r in [
            na("a", &["vm:1", "vm:2"], &[("n1", 0), ("n2", 0)], 1),
            na("b", &["vm:3"], &[("n3", 0)], 2),
            ra("cp", &["vm:1", "vm:3"], Affinity::Negative, 3),
        ] {
            rules.insert(r.rule.clone(), r);
        }
        assert!(
            feasibility(&rules, 3).is_empty(),
            "zones + anti-affinity is feasible"
        );
        // a resource in two node-affinity rules
        let dup = na("c", &["vm:2"], &[("n1", 0)], 4);
        rules.insert("c".into(), dup);
        let e = feasibility(&rules, 3);
        assert!(e["c"]["resources"][0].contains("already used in another node affinity rule"));
        rules.remove("c");
        // multiple priorities with a resource-affinity rule
        rules.insert(
            "a".into(),
            na("a", &["vm:1", "vm:2"], &[("n1", 2), ("n2", 1)], 1),
        );
        let e = feasibility(&rules, 3);
        assert!(e.contains_key("a") && e.contains_key("cp"), "{e:?}");
        // negative rule with more resources than nodes, and fewer than two resources
        let mut rules = BTreeMap::new();
        rules.insert(
            "x".into(),
            ra(
                "x",
                &["vm:1", "vm:2", "vm:3", "vm:4"],
                Affinity::Negative,
                1,
            ),
        );
        rules.insert("y".into(), ra("y", &["vm:5"], Affinity::Positive, 2));
        let e = feasibility(&rules, 3);
        assert_eq!(
            e["x"]["resources"],
            vec!["rule defines more resources than available nodes"]
        );
        assert_eq!(
            e["y"]["resources"],
            vec!["rule is ineffective as there are less than two resources"]
        );
        // negative rule squeezed onto fewer nodes than resources
        let mut rules = BTreeMap::new();
        rules.insert("z".into(), na("z", &["vm:1", "vm:2"], &[("n1", 0)], 1));
        rules.insert(
            "cp".into(),
            ra("cp", &["vm:1", "vm:2"], Affinity::Negative, 2),
        );
        let e = feasibility(&rules, 3);
        assert!(e["cp"]["resources"][0].contains("restricted to less nodes"));
    }

    use crate::topology::{SimOptions, Topology};
    use tokio::time::Duration;

    fn cluster(version: &str) -> Cluster {
        let yaml = "nodes: [{name: n1}, {name: n2}, {name: n3}, {name: n4}]\n\
            storages: [{name: ceph, type: rbd, shared: true}]\n\
            guests:\n\
            - {vmid: 101, name: cp1, node: n1, storage: ceph, running: true}\n\
            - {vmid: 102, name: cp2, node: n2, storage: ceph, running: true}\n\
            - {vmid: 103, name: cp3, node: n3, storage: ceph, running: true}\n\
            - {vmid: 104, name: w1, node: n1, storage: ceph, running: true}\n\
            - {vmid: 105, name: w2, node: n3, storage: ceph, running: true}\n\
            - {vmid: 106, name: plain, node: n1, storage: ceph, running: true}\n";
        let opts = SimOptions {
            version: version.into(),
            ..SimOptions::default()
        };
        Cluster::new(
            &Topology::from_yaml(yaml, "t").expect("topology"),
            opts,
            Box::new(|_| false),
        )
    }

    fn p(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn moved(rs: &[Relocation], vmid: u32) -> Option<&str> {
        rs.iter()
            .find(|r| r.vmid == vmid)
            .and_then(|r| r.to.as_deref())
    }

    #[tokio::test(start_paused = true)]
    async fn pve9_node_failure_keeps_zones_and_anti_affinity() {
        let mut c = cluster("9.1.4");
        let now = Instant::now();
        for id in ["101", "102", "103", "104", "105"] {
            c.ha_create_resource(now, &p(&[("sid", id)]))
                .expect("resource");
        }
        c.ha_create_rule(&p(&[
            ("rule", "zone-a"),
            ("type", "node-affinity"),
            ("resources", "vm:101,vm:102,vm:104"),
            ("nodes", "n1,n2"),
            ("strict", "1"),
        ]))
        .expect("zone a");
        c.ha_create_rule(&p(&[
            ("rule", "zone-b"),
            ("type", "node-affinity"),
            ("resources", "vm:103,vm:105"),
            ("nodes", "n3,n4"),
            ("strict", "1"),
        ]))
        .expect("zone b");
        c.ha_create_rule(&p(&[
            ("rule", "cp"),
            ("type", "resource-affinity"),
            ("resources", "vm:101,vm:102,vm:103"),
            ("affinity", "negative"),
        ]))
        .expect("control plane apart");

        // n1 dies: the worker moves within zone a; cp1 cannot (n2 runs cp2) and waits
        let rs = c.fail_node(now, "n1");
        assert_eq!(moved(&rs, 104), Some("n2"), "{rs:?}");
        let cp1 = rs.iter().find(|r| r.vmid == 101).expect("cp1 reported");
        assert_eq!((cp1.to.as_deref(), cp1.state.as_str()), (None, "recovery"));
        assert_eq!(c.vm_node(101).as_deref(), Some("n1"));
        assert_eq!(c.ha_state(101).as_deref(), Some("recovery"));
        assert!(
            !c.vms[&106].running,
            "non-HA VMs stay stopped on the dead node"
        );
        assert!(c.vms[&104].running, "the recovered worker runs again");
        assert_eq!(c.ha_state(104).as_deref(), Some("started"));
        // n3 dies: zone b's VMs go to n4, never into zone a
        let rs = c.fail_node(now, "n3");
        assert_eq!(moved(&rs, 103), Some("n4"), "{rs:?}");
        assert_eq!(moved(&rs, 105), Some("n4"), "{rs:?}");
        // n1 is back: cp1 is recovered onto it
        let rs = c.revive_node(now, "n1");
        assert_eq!(moved(&rs, 101), Some("n1"), "{rs:?}");
        assert!(c.vms[&101].running);
        assert_eq!(c.ha_state(101).as_deref(), Some("started"));
    }

    #[tokio::test(start_paused = true)]
    async fn pve9_non_strict_rules_prefer_and_priorities_order() {
        let mut c = cluster("9.1.4");
        let now = Instant::now();
        c.ha_create_resource(now, &p(&[("sid", "vm:104")]))
            .expect("resource");
        c.ha_create_rule(&p(&[
            ("rule", "pref"),
            ("type", "node-affinity"),
            ("resources", "vm:104"),
            ("nodes", "n1:2,n2:1"),
        ]))
        .expect("rule");
        assert_eq!(moved(&c.fail_node(now, "n1"), 104), Some("n2"));
        assert_eq!(
            moved(&c.fail_node(now, "n2"), 104),
            Some("n4"),
            "fewest VMs"
        );
        // failback: n1 is back and has the highest priority
        assert_eq!(moved(&c.revive_node(now, "n1"), 104), Some("n1"));
    }

    #[tokio::test(start_paused = true)]
    async fn pve8_restricted_groups_confine_recovery() {
        let mut c = cluster("8.4.14");
        let now = Instant::now();
        c.ha_create_group(&p(&[
            ("group", "zone-a"),
            ("nodes", "n1,n2"),
            ("restricted", "1"),
        ]))
        .expect("group");
        c.ha_create_group(&p(&[("group", "pref-n3"), ("nodes", "n3")]))
            .expect("group");
        c.ha_create_resource(now, &p(&[("sid", "101"), ("group", "zone-a")]))
            .expect("resource");
        c.ha_create_resource(now, &p(&[("sid", "105"), ("group", "pref-n3")]))
            .expect("resource");
        assert_eq!(moved(&c.fail_node(now, "n1"), 101), Some("n2"));
        let rs = c.fail_node(now, "n2");
        assert_eq!(moved(&rs, 101), None, "restricted: nowhere else to go");
        assert_eq!(c.ha_state(101).as_deref(), Some("recovery"));
        // unrestricted: any node when its own is down, and back when it returns
        assert_eq!(moved(&c.fail_node(now, "n3"), 105), Some("n4"));
        let rs = c.revive_node(now, "n3");
        assert_eq!(moved(&rs, 105), Some("n3"), "{rs:?}");
        let e = c
            .ha_delete_group(&p(&[("group", "zone-a")]))
            .expect_err("in use");
        assert_eq!(
            e.reason,
            "delete ha group failed: error with cfs lock 'domain-ha': ha group is used by service 'vm:101'"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn destroy_needs_purge_and_purge_cleans_rules() {
        let mut c = cluster("9.1.4");
        let now = Instant::now();
        for id in ["101", "102"] {
            c.ha_create_resource(now, &p(&[("sid", id), ("state", "stopped")]))
                .expect("resource");
        }
        c.ha_create_rule(&p(&[
            ("rule", "cp"),
            ("type", "resource-affinity"),
            ("resources", "vm:101,vm:102"),
            ("affinity", "negative"),
        ]))
        .expect("rule");
        // the CRM shuts the VMs down (requested state stopped)
        let now = now + Duration::from_secs(1);
        c.advance(now);
        assert!(!c.vms[&101].running);
        let e = c.delete_vm(now, "n1", 101, false).expect_err("HA");
        assert_eq!(
            e.reason,
            "unable to remove VM 101 - used in HA resources and purge parameter not set."
        );
        c.delete_vm(now, "n1", 101, true).expect("purge");
        let now = now + Duration::from_secs(1);
        c.advance(now);
        assert!(c.ha_state(101).is_none());
        // the rule lost vm:101; deleting vm:102's resource (purge default) drops the rule
        assert_eq!(
            c.ha_rules()[0].resources,
            BTreeSet::from(["vm:102".to_string()])
        );
        c.ha_delete_resource(&p(&[("sid", "vm:102")]))
            .expect("delete");
        assert!(c.ha_rules().is_empty());
    }
}
