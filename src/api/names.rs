//! The formats of the free-form spec strings capmox hands to Proxmox (parameters, API paths,
//! `netN` option lists) or writes into guest files (netplan, networkd), as Proxmox VE's own API
//! schema and Linux accept them. One definition per rule: the CRD schemas use the patterns
//! (`pattern` + `maxLength`), and the Proxmox client, the `netN` builder and the network
//! generators call [`NameRule::check`], so objects stored before a pattern existed are refused
//! too, never written.

use std::sync::LazyLock;

use regex::Regex;

/// A Proxmox node name (PVE format `pve-node`): a DNS label.
pub const NODE_PATTERN: &str = r"^[a-zA-Z0-9]([a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?$";
/// Longest node name (a DNS label).
pub const NODE_MAX_LEN: u32 = 63;

/// A storage id (PVE format `pve-storage-id`, case-insensitive as Proxmox reads it).
pub const STORAGE_PATTERN: &str = r"^[a-zA-Z][a-zA-Z0-9_.-]*[a-zA-Z0-9]$";
/// Longest storage id capmox accepts (Proxmox sets none; ids are short names).
pub const STORAGE_MAX_LEN: u32 = 128;

/// A resource pool id (PVE format `pve-poolid`, nested pools `a/b/c` since PVE 8.1).
pub const POOL_PATTERN: &str = r"^[a-zA-Z0-9_-]+(/[a-zA-Z0-9_-]+){0,2}$";
/// Longest pool id capmox accepts.
pub const POOL_MAX_LEN: u32 = 128;

/// A snapshot name (PVE format `pve-configid` of `snapname`).
pub const SNAPSHOT_PATTERN: &str = r"^[a-zA-Z][a-zA-Z0-9_-]+$";
/// Longest snapshot name (Proxmox's `maxLength` of `snapname`).
pub const SNAPSHOT_MAX_LEN: u32 = 40;

/// A bridge (PVE format `pve-bridge-id`): a Linux interface name of letters, digits, `_`, `-`
/// and `.`, not starting with `.`.
pub const BRIDGE_PATTERN: &str = r"^[a-zA-Z0-9_-][a-zA-Z0-9_.-]*$";
/// Longest bridge name (Linux `IFNAMSIZ` - 1).
pub const BRIDGE_MAX_LEN: u32 = 15;

/// A disk slot of a VM: `ide0`-`ide3`, `sata0`-`sata5`, `scsi0`-`scsi30`, `virtio0`-`virtio15`.
pub const DISK_PATTERN: &str =
    r"^(ide[0-3]|sata[0-5]|scsi([0-9]|[12][0-9]|30)|virtio([0-9]|1[0-5]))$";
/// Longest disk slot name (`virtio15`).
pub const DISK_MAX_LEN: u32 = 8;

/// A Proxmox resource mapping's ID (PVE's `pve-configid`): a letter, then letters, digits, `_`, `-`.
pub const MAPPING_PATTERN: &str = r"^[a-zA-Z][a-zA-Z0-9_-]+$";
/// Longest resource mapping ID capmox accepts (PVE stores it as a config section name).
pub const MAPPING_MAX_LEN: u32 = 128;

/// Longest host PCI address (`0000:01:00.0`).
pub const PCI_ADDRESS_MAX_LEN: u32 = 12;

/// A guest interface name (a VRF device): a Linux interface name without whitespace, `/`, `:`
/// or networkd's glob characters, not starting with `.`.
pub const INTERFACE_PATTERN: &str = r"^[a-zA-Z0-9_-][a-zA-Z0-9_.-]*$";
/// Longest interface name (Linux `IFNAMSIZ` - 1).
pub const INTERFACE_MAX_LEN: u32 = 15;

/// A VM description: free text (Proxmox keeps each line as a `#` comment of the VM config), but
/// no control characters other than tab and newline.
pub const DESCRIPTION_PATTERN: &str = r"^[^\x00-\x08\x0B-\x1F\x7F]*$";
/// Longest description (Proxmox's `maxLength` of `description`).
pub const DESCRIPTION_MAX_LEN: u32 = 8192;

/// One of the formats above, with what it means for the user.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NameRule {
    /// [`NODE_PATTERN`].
    Node,
    /// [`STORAGE_PATTERN`].
    Storage,
    /// [`POOL_PATTERN`].
    Pool,
    /// [`SNAPSHOT_PATTERN`].
    Snapshot,
    /// [`BRIDGE_PATTERN`].
    Bridge,
    /// [`DISK_PATTERN`].
    Disk,
    /// [`INTERFACE_PATTERN`].
    Interface,
    /// [`DESCRIPTION_PATTERN`].
    Description,
}

/// A value that does not have its rule's format.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{value:?} is not a valid {what}: {hint}")]
pub struct NameError {
    /// What the value names (`Proxmox node name`, ...).
    pub what: &'static str,
    /// The offending value.
    pub value: String,
    /// The format, in words.
    pub hint: &'static str,
}

/// Every rule, for tests that check the schemas carry them.
pub const RULES: [NameRule; 8] = [
    NameRule::Node,
    NameRule::Storage,
    NameRule::Pool,
    NameRule::Snapshot,
    NameRule::Bridge,
    NameRule::Disk,
    NameRule::Interface,
    NameRule::Description,
];

static COMPILED: LazyLock<Vec<Regex>> = LazyLock::new(|| {
    RULES
        .iter()
        // The patterns are constants; `names::tests` compiles each of them.
        .map(|rule| Regex::new(rule.pattern()).expect("a name pattern compiles"))
        .collect()
});

impl NameRule {
    /// The OpenAPI pattern of the rule.
    pub const fn pattern(self) -> &'static str {
        match self {
            Self::Node => NODE_PATTERN,
            Self::Storage => STORAGE_PATTERN,
            Self::Pool => POOL_PATTERN,
            Self::Snapshot => SNAPSHOT_PATTERN,
            Self::Bridge => BRIDGE_PATTERN,
            Self::Disk => DISK_PATTERN,
            Self::Interface => INTERFACE_PATTERN,
            Self::Description => DESCRIPTION_PATTERN,
        }
    }

    /// The longest value, in characters (the OpenAPI `maxLength`).
    pub const fn max_len(self) -> u32 {
        match self {
            Self::Node => NODE_MAX_LEN,
            Self::Storage => STORAGE_MAX_LEN,
            Self::Pool => POOL_MAX_LEN,
            Self::Snapshot => SNAPSHOT_MAX_LEN,
            Self::Bridge => BRIDGE_MAX_LEN,
            Self::Disk => DISK_MAX_LEN,
            Self::Interface => INTERFACE_MAX_LEN,
            Self::Description => DESCRIPTION_MAX_LEN,
        }
    }

    fn what(self) -> &'static str {
        match self {
            Self::Node => "Proxmox node name",
            Self::Storage => "Proxmox storage id",
            Self::Pool => "Proxmox pool id",
            Self::Snapshot => "Proxmox snapshot name",
            Self::Bridge => "Proxmox bridge name",
            Self::Disk => "Proxmox disk slot",
            Self::Interface => "interface name",
            Self::Description => "VM description",
        }
    }

    fn hint(self) -> &'static str {
        match self {
            Self::Node => {
                "use the node's name as Proxmox shows it: letters, digits and '-', at most 63 \
                 characters, not starting or ending with '-'"
            }
            Self::Storage => {
                "use the storage id as Proxmox shows it: a letter, then letters, digits, '-', \
                 '_' or '.', ending with a letter or digit, at most 128 characters"
            }
            Self::Pool => {
                "use the pool id as Proxmox shows it: letters, digits, '-' and '_', nested pools \
                 as parent/child (at most 3 levels), at most 128 characters"
            }
            Self::Snapshot => {
                "use the snapshot name as Proxmox shows it: a letter, then at least one letter, \
                 digit, '-' or '_', at most 40 characters"
            }
            Self::Bridge => {
                "use the bridge's interface name (e.g. vmbr0): letters, digits, '-', '_' and \
                 '.', not starting with '.', at most 15 characters"
            }
            Self::Disk => {
                "name the disk slot: ide0-ide3, sata0-sata5, scsi0-scsi30 or virtio0-virtio15"
            }
            Self::Interface => {
                "use a Linux interface name: letters, digits, '-', '_' and '.', not starting \
                 with '.', at most 15 characters"
            }
            Self::Description => {
                "remove control characters (tabs and newlines are fine); at most 8192 characters"
            }
        }
    }

    /// Whether `value` has the rule's format, as the CRD schema checks it.
    pub fn check(self, value: &str) -> Result<(), NameError> {
        let index = RULES.iter().position(|r| *r == self).unwrap_or_default();
        let fits = value.chars().count() <= self.max_len() as usize;
        if fits && COMPILED[index].is_match(value) {
            return Ok(());
        }
        Err(NameError {
            what: self.what(),
            value: value.to_owned(),
            hint: self.hint(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_pattern_compiles_and_is_anchored() {
        for rule in RULES {
            assert!(Regex::new(rule.pattern()).is_ok(), "{rule:?}");
            assert!(rule.pattern().starts_with('^') && rule.pattern().ends_with('$'));
        }
    }

    #[test]
    fn what_proxmox_accepts_passes() {
        for (rule, value) in [
            (NameRule::Node, "pve1"),
            (NameRule::Node, "PVE-node-02"),
            (NameRule::Storage, "local-lvm"),
            (NameRule::Storage, "ceph_pool.ssd1"),
            (NameRule::Pool, "kubernetes"),
            (NameRule::Pool, "team-a/prod/k8s"),
            (NameRule::Snapshot, "base"),
            (NameRule::Snapshot, "before_upgrade-2"),
            (NameRule::Bridge, "vmbr0"),
            (NameRule::Bridge, "vnet_100.2"),
            (NameRule::Disk, "scsi0"),
            (NameRule::Disk, "scsi30"),
            (NameRule::Disk, "virtio15"),
            (NameRule::Disk, "sata5"),
            (NameRule::Disk, "ide3"),
            (NameRule::Interface, "vrf-blue"),
            (NameRule::Description, "Worker of demo\n\tmanaged by capmox"),
        ] {
            assert_eq!(rule.check(value), Ok(()), "{rule:?} {value:?}");
        }
    }

    #[test]
    fn injection_and_traversal_are_refused() {
        for (rule, value) in [
            (NameRule::Node, "../../access"),
            (NameRule::Node, "pve1/qemu"),
            (NameRule::Node, ""),
            (NameRule::Node, &"a".repeat(64)),
            (NameRule::Storage, "../local"),
            (NameRule::Storage, "local/../../x"),
            (NameRule::Storage, "a"),
            (NameRule::Pool, "a/b/c/d"),
            (NameRule::Pool, "pool,comment=x"),
            (NameRule::Snapshot, "b"),
            (NameRule::Snapshot, &format!("s{}", "a".repeat(40))),
            (NameRule::Bridge, "vmbr0,firewall=0"),
            (NameRule::Bridge, "vmbr0 "),
            (NameRule::Bridge, ".."),
            (NameRule::Bridge, "averyveryverylongbridge"),
            (NameRule::Disk, "scsi31"),
            (NameRule::Disk, "efidisk0"),
            (NameRule::Disk, "scsi0,size=1T"),
            (NameRule::Interface, "vrf\n[Network]"),
            (NameRule::Interface, "vrf*"),
            (NameRule::Interface, "a:b"),
            (NameRule::Description, "a\rb"),
            (NameRule::Description, "a\u{0}b"),
        ] {
            let error = rule.check(value).expect_err(value);
            assert!(error.to_string().contains(&format!("{value:?}")), "{error}");
        }
    }
}
