//! UPIDs (task ids): parsed into their parts so the task is polled on the node that runs it.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A parsed Proxmox task id, `UPID:node:pid:pstart:starttime:type:id:user:`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Upid {
    /// The node that runs the task (poll this node).
    pub node: String,
    /// Worker process id.
    pub pid: u32,
    /// Process start time in clock ticks.
    pub pstart: u64,
    /// Task start time (unix seconds).
    pub starttime: u64,
    /// Task type, e.g. `qmclone`, `qmstart`, `imgcopy`.
    pub task_type: String,
    /// Object id (usually the VMID; for `qmclone` the source VMID). May be empty.
    pub id: String,
    /// User (`root@pam` or `root@pam!token`).
    pub user: String,
    raw: String,
    /// The node, told apart from nodes of the same name in other Proxmox clusters once the
    /// task's Proxmox is known.
    site_node: Option<String>,
}

/// Why a UPID could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed UPID '{upid}': {problem}")]
pub struct UpidParseError {
    /// The text that was given.
    pub upid: String,
    /// What is wrong with it.
    pub problem: &'static str,
}

impl Upid {
    /// The UPID exactly as the server sent it.
    pub fn as_str(&self) -> &str {
        &self.raw
    }

    /// The same task, known to run on the Proxmox whose API is at `endpoint`.
    pub fn at_site(mut self, endpoint: &str) -> Self {
        self.site_node = Some(format!("{endpoint} {}", self.node));
        self
    }

    /// The task's node, told apart from nodes of the same name in other Proxmox clusters (as
    /// sites often name theirs alike) once [`Upid::at_site`] said which: what remembers tasks
    /// per node keys them by this.
    pub fn site_node(&self) -> &str {
        self.site_node.as_deref().unwrap_or(&self.node)
    }

    /// Builds a UPID from its parts (used by the simulator).
    pub fn new(
        node: &str,
        pid: u32,
        pstart: u64,
        starttime: u64,
        task_type: &str,
        id: &str,
        user: &str,
    ) -> Self {
        let raw =
            format!("UPID:{node}:{pid:08X}:{pstart:08X}:{starttime:08X}:{task_type}:{id}:{user}:");
        Self {
            node: node.to_string(),
            pid,
            pstart,
            starttime,
            task_type: task_type.to_string(),
            id: id.to_string(),
            user: user.to_string(),
            raw,
            site_node: None,
        }
    }
}

impl FromStr for Upid {
    type Err = UpidParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = |problem| UpidParseError {
            upid: s.to_string(),
            problem,
        };
        let rest = s
            .strip_prefix("UPID:")
            .ok_or_else(|| err("missing 'UPID:' prefix"))?;
        let rest = rest.strip_suffix(':').unwrap_or(rest);
        let parts: Vec<&str> = rest.split(':').collect();
        if parts.len() != 7 {
            return Err(err("expected 7 ':'-separated fields after 'UPID:'"));
        }
        let node = parts[0];
        let valid_node = !node.is_empty()
            && node.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
            && !node.starts_with('-')
            && !node.ends_with('-');
        if !valid_node {
            return Err(err("invalid node name"));
        }
        let hex = |t: &str, min: usize, max: usize, what| {
            if t.len() < min || t.len() > max {
                return Err(err(what));
            }
            u64::from_str_radix(t, 16).map_err(|_| err(what))
        };
        let pid = hex(parts[1], 8, 8, "pid must be 8 hex digits")?;
        let pstart = hex(parts[2], 8, 9, "pstart must be 8-9 hex digits")?;
        let starttime = hex(parts[3], 8, 8, "starttime must be 8 hex digits")?;
        let no_bad = |t: &str| !t.contains(|c: char| c.is_whitespace() || c == '/');
        if parts[4].is_empty() || !no_bad(parts[4]) {
            return Err(err("invalid task type"));
        }
        if !no_bad(parts[5]) {
            return Err(err("invalid id"));
        }
        if parts[6].is_empty() || !no_bad(parts[6]) {
            return Err(err("invalid user"));
        }
        Ok(Self {
            node: node.to_string(),
            pid: u32::try_from(pid).map_err(|_| err("pid out of range"))?,
            pstart,
            starttime,
            task_type: parts[4].to_string(),
            id: parts[5].to_string(),
            user: parts[6].to_string(),
            raw: s.to_string(),
            site_node: None,
        })
    }
}

impl fmt::Display for Upid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.raw)
    }
}

impl Serialize for Upid {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.raw)
    }
}

impl<'de> Deserialize<'de> for Upid {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_real_upids() {
        let u: Upid = "UPID:pve:00000AC5:0000CCB6:5FBE5E63:qmclone:100:root@pam:"
            .parse()
            .expect("valid");
        assert_eq!(u.node, "pve");
        assert_eq!(u.pid, 0xAC5);
        assert_eq!(u.pstart, 0xCCB6);
        assert_eq!(u.starttime, 0x5FBE5E63);
        assert_eq!(u.task_type, "qmclone");
        assert_eq!(u.id, "100");
        assert_eq!(u.user, "root@pam");
        let u: Upid = "UPID:node-2:00000001:1000000CB:00000001:imgcopy::capi@pve!capmox:"
            .parse()
            .expect("9-digit pstart, empty id, token user");
        assert_eq!(u.pstart, 0x1000000CB);
        assert_eq!(u.id, "");
        assert_eq!(u.user, "capi@pve!capmox");
        let built = Upid::new("pve", 1, 2, 3, "qmstart", "101", "root@pam");
        let again: Upid = built.as_str().parse().expect("round trip");
        assert_eq!(built, again);
    }

    #[test]
    fn rejects_malformed() {
        for bad in [
            "",
            "UPID:pve:1:2:3:qmclone:100:root@pam:",
            "UPIX:pve:00000AC5:0000CCB6:5FBE5E63:qmclone:100:root@pam:",
            "UPID:pve:00000AC5:0000CCB6:5FBE5E63:qmclone:100:",
            "UPID:-pve:00000AC5:0000CCB6:5FBE5E63:qmclone:100:root@pam:",
            "UPID:pve:0000ZZZZ:0000CCB6:5FBE5E63:qmclone:100:root@pam:",
        ] {
            assert!(bad.parse::<Upid>().is_err(), "{bad}");
        }
    }
}
