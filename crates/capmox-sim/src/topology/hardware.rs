//! Host hardware and network services a topology can describe beyond nodes and storages:
//! the PCI devices of each node, the cluster's PCI resource mappings (PVE 8+,
//! `/etc/pve/mapping/pci.cfg`) and DHCP services on bridges. The simulator's hardware always
//! matches its mappings (a mapping entry's `id`, `iommugroup` and `subsystem_id` are checked
//! against the device here), so PVE's "hardware probably changed" start failure is not
//! simulated.

use std::net::{Ipv4Addr, Ipv6Addr};

use serde::{Deserialize, Serialize};

use super::TopologyError;

/// One PCI function of a node, as `lspci` (and `GET /nodes/{node}/hardware/pci`) shows it.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PciDeviceSpec {
    /// Full address with domain and function, lower-case as in sysfs (`0000:01:00.0`).
    pub id: String,
    /// Vendor ID (`10de` or `0x10de`).
    pub vendor: String,
    /// Device ID (`2204` or `0x2204`).
    pub device: String,
    /// PCI class (`030000`); a VGA controller when not given.
    #[serde(default)]
    pub class: Option<String>,
    /// IOMMU group; `None` is a host without IOMMU (PVE reports -1).
    #[serde(default)]
    pub iommugroup: Option<i64>,
    /// Subsystem vendor ID.
    #[serde(default)]
    pub subsystem_vendor: Option<String>,
    /// Subsystem device ID.
    #[serde(default)]
    pub subsystem_device: Option<String>,
    /// Vendor name from the PCI ID database.
    #[serde(default)]
    pub vendor_name: Option<String>,
    /// Device name from the PCI ID database.
    #[serde(default)]
    pub device_name: Option<String>,
}

/// The class a device without one gets: a VGA-compatible controller, as GPUs are.
const DEFAULT_CLASS: &str = "0x030000";

impl PciDeviceSpec {
    /// The class as sysfs writes it (`0x030000`).
    pub fn class_id(&self) -> String {
        self.class
            .as_deref()
            .map_or(DEFAULT_CLASS.to_owned(), hex_id)
    }

    /// `vendor:device` without `0x`, the form a mapping entry's `id` has.
    pub fn vendor_device(&self) -> String {
        format!("{}:{}", bare_hex(&self.vendor), bare_hex(&self.device))
    }

    /// `subsystem_vendor:subsystem_device` without `0x`, when both are known.
    pub fn subsystem_id(&self) -> Option<String> {
        Some(format!(
            "{}:{}",
            bare_hex(self.subsystem_vendor.as_deref()?),
            bare_hex(self.subsystem_device.as_deref()?)
        ))
    }
}

/// A cluster-wide PCI resource mapping (`/cluster/mapping/pci`).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PciMappingSpec {
    /// Mapping ID (a PVE config ID: a letter, then letters, digits, `-` and `_`).
    pub name: String,
    /// Description of the logical device.
    #[serde(default)]
    pub description: Option<String>,
    /// Which host device stands for the mapping on which node; several entries on one node
    /// are alternatives, the first free one is used at VM start.
    #[serde(default)]
    pub map: Vec<PciMapEntrySpec>,
}

/// One node's entry of a PCI mapping.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PciMapEntrySpec {
    /// Node.
    pub node: String,
    /// Device address with domain (`0000:01:00.0`; without function, every function of the
    /// device; `;` joins devices passed through together).
    pub path: String,
    /// `vendor:device` of the (first) device (`10de:2204`).
    pub id: String,
    /// IOMMU group of the (first) device.
    #[serde(default)]
    pub iommugroup: Option<i64>,
    /// `subsystem-vendor:subsystem-device` of the (first) device.
    #[serde(default)]
    pub subsystem_id: Option<String>,
}

impl PciMapEntrySpec {
    /// The entry as PVE stores and lists it (`node=pve1,path=0000:01:00.0,id=10de:2204,...`).
    pub fn property_string(&self) -> String {
        let mut out = format!("node={},path={},id={}", self.node, self.path, self.id);
        if let Some(group) = self.iommugroup {
            out.push_str(&format!(",iommugroup={group}"));
        }
        if let Some(sub) = &self.subsystem_id {
            out.push_str(&format!(",subsystem-id={sub}"));
        }
        out
    }
}

/// A DHCP service on a bridge. The bridge is the same network on every node (one pool of
/// addresses for the whole cluster), as a VLAN-aware bridge trunked between nodes is.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DhcpSpec {
    /// Bridge name (`vmbr0`) as NICs name it in `bridge=`.
    pub bridge: String,
    /// IPv4 pool, `first-last` (`10.0.9.100-10.0.9.200`).
    #[serde(default)]
    pub range4: Option<String>,
    /// Prefix length of IPv4 leases (needed with `range4`).
    #[serde(default)]
    pub prefix4: Option<u8>,
    /// Router handed out with IPv4 leases.
    #[serde(default)]
    pub gateway4: Option<String>,
    /// DHCPv6 pool, `first-last` (`fd00::100-fd00::1ff`).
    #[serde(default)]
    pub range6: Option<String>,
    /// Prefix length of IPv6 leases (64 when not given).
    #[serde(default)]
    pub prefix6: Option<u8>,
}

/// Prefix length of DHCPv6 leases when a service does not say.
const DEFAULT_PREFIX6: u8 = 64;

impl DhcpSpec {
    /// The IPv4 pool as (first, last, prefix length).
    pub fn pool4(&self) -> Option<(Ipv4Addr, Ipv4Addr, u8)> {
        let (first, last) = range(self.range4.as_deref()?)?;
        Some((first, last, self.prefix4?))
    }

    /// The IPv6 pool as (first, last, prefix length).
    pub fn pool6(&self) -> Option<(Ipv6Addr, Ipv6Addr, u8)> {
        let (first, last) = range(self.range6.as_deref()?)?;
        Some((first, last, self.prefix6.unwrap_or(DEFAULT_PREFIX6)))
    }

    fn check(&self) -> Result<(), String> {
        let bridge = &self.bridge;
        if self.range4.is_none() && self.range6.is_none() {
            return Err(format!(
                "dhcp on bridge '{bridge}' has neither range4 nor range6"
            ));
        }
        if let Some(text) = &self.range4 {
            let (first, last) = range::<Ipv4Addr>(text).ok_or_else(|| {
                format!("dhcp on bridge '{bridge}': range4 '{text}' is not FIRST-LAST IPv4")
            })?;
            let prefix = self
                .prefix4
                .filter(|p| (1..=32).contains(p))
                .ok_or_else(|| format!("dhcp on bridge '{bridge}' needs prefix4 (1-32)"))?;
            let net = |a: Ipv4Addr| u32::from(a) >> (32 - u32::from(prefix));
            if net(first) != net(last) {
                return Err(format!(
                    "dhcp on bridge '{bridge}': range4 '{text}' spans more than one /{prefix}"
                ));
            }
            if let Some(gw) = &self.gateway4 {
                let gw: Ipv4Addr = gw.parse().map_err(|_| {
                    format!("dhcp on bridge '{bridge}': gateway4 '{gw}' is not an IPv4 address")
                })?;
                if net(gw) != net(first) {
                    return Err(format!(
                        "dhcp on bridge '{bridge}': gateway4 {gw} is outside {first}/{prefix}"
                    ));
                }
            }
        } else if self.prefix4.is_some() || self.gateway4.is_some() {
            return Err(format!(
                "dhcp on bridge '{bridge}': prefix4 and gateway4 need range4"
            ));
        }
        if let Some(text) = &self.range6 {
            let (first, last) = range::<Ipv6Addr>(text).ok_or_else(|| {
                format!("dhcp on bridge '{bridge}': range6 '{text}' is not FIRST-LAST IPv6")
            })?;
            let prefix = self.prefix6.unwrap_or(DEFAULT_PREFIX6);
            if !(1..=128).contains(&prefix) {
                return Err(format!("dhcp on bridge '{bridge}': prefix6 must be 1-128"));
            }
            let net = |a: Ipv6Addr| u128::from(a).checked_shr(128 - u32::from(prefix));
            if net(first) != net(last) {
                return Err(format!(
                    "dhcp on bridge '{bridge}': range6 '{text}' spans more than one /{prefix}"
                ));
            }
        } else if self.prefix6.is_some() {
            return Err(format!("dhcp on bridge '{bridge}': prefix6 needs range6"));
        }
        Ok(())
    }
}

/// `first-last` with `first <= last`.
fn range<A: std::str::FromStr + Ord>(text: &str) -> Option<(A, A)> {
    let (first, last) = text.split_once('-')?;
    let (first, last): (A, A) = (first.trim().parse().ok()?, last.trim().parse().ok()?);
    (first <= last).then_some((first, last))
}

/// `10de` from `0x10de` or `10DE` (sysfs and mappings compare without `0x`, lower-case).
fn bare_hex(id: &str) -> String {
    id.trim_start_matches("0x").to_ascii_lowercase()
}

/// `0x10de` from `10de` (how sysfs and the hardware API write IDs).
pub(crate) fn hex_id(id: &str) -> String {
    format!("0x{}", bare_hex(id))
}

fn hex_digits(text: &str, len: std::ops::RangeInclusive<usize>, upper: bool) -> bool {
    len.contains(&text.len())
        && text.chars().all(|c| {
            c.is_ascii_digit() || ('a'..='f').contains(&c) || (upper && c.is_ascii_hexdigit())
        })
}

/// Whether `text` is a PCI address as qemu-server's and the mapping schema's patterns have
/// it: `[DOMAIN:]BB:DD[.F]` in lower-case hex, the domain required when `with_domain`.
pub(crate) fn is_pci_address(text: &str, with_domain: bool) -> bool {
    let (rest, function) = match text.split_once('.') {
        Some((rest, f)) => (rest, Some(f)),
        None => (text, None),
    };
    if function.is_some_and(|f| !hex_digits(f, 1..=1, false)) {
        return false;
    }
    let parts: Vec<&str> = rest.split(':').collect();
    let (domain, bus, slot) = match parts.as_slice() {
        [domain, bus, slot] => (Some(*domain), *bus, *slot),
        [bus, slot] if !with_domain => (None, *bus, *slot),
        _ => return false,
    };
    domain.is_none_or(|d| hex_digits(d, 4..=usize::MAX, false))
        && hex_digits(bus, 2..=2, false)
        && hex_digits(slot, 2..=2, false)
}

/// Whether the `lspci` filter `filter` (an address, possibly without domain or function)
/// selects the device `id` (`$id =~ m/^(0000:)?\Q$filter\E/` in pve-common's `lspci`).
pub(crate) fn pci_filter_matches(filter: &str, id: &str) -> bool {
    id.starts_with(filter)
        || id
            .strip_prefix("0000:")
            .is_some_and(|rest| rest.starts_with(filter))
}

/// Whether `text` is a PVE config ID (`pve-configid`: a letter, then at least one of letters,
/// digits, `-`, `_`).
pub(crate) fn is_config_id(text: &str) -> bool {
    let mut chars = text.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && text.len() >= 2
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
}

/// `hhhh:hhhh` (a mapping entry's `id` and `subsystem-id`).
fn is_id_pair(text: &str) -> bool {
    text.split_once(':')
        .is_some_and(|(a, b)| hex_digits(a, 4..=4, true) && hex_digits(b, 4..=4, true))
}

/// Checks every node's PCI devices: full lower-case addresses, unique per node, hex IDs.
pub(super) fn check_devices(node: &str, devices: &[PciDeviceSpec]) -> Result<(), TopologyError> {
    let invalid = |m: String| Err(TopologyError::Invalid(m));
    let mut seen = std::collections::BTreeSet::new();
    for d in devices {
        if !is_pci_address(&d.id, true) || !d.id.contains('.') {
            return invalid(format!(
                "node '{node}': PCI device '{}' is not a full address like 0000:01:00.0",
                d.id
            ));
        }
        if !seen.insert(&d.id) {
            return invalid(format!(
                "node '{node}': PCI device '{}' is listed twice",
                d.id
            ));
        }
        let ids = [
            Some(&d.vendor),
            Some(&d.device),
            d.subsystem_vendor.as_ref(),
            d.subsystem_device.as_ref(),
        ];
        if let Some(bad) = ids
            .into_iter()
            .flatten()
            .find(|id| !hex_digits(&bare_hex(id), 4..=4, false))
        {
            return invalid(format!(
                "node '{node}': PCI device '{}' has ID '{bad}', not 4 hex digits",
                d.id
            ));
        }
        if let Some(class) = &d.class
            && !hex_digits(&bare_hex(class), 6..=6, false)
        {
            return invalid(format!(
                "node '{node}': PCI device '{}' has class '{class}', not 6 hex digits",
                d.id
            ));
        }
    }
    Ok(())
}

/// Checks the PCI mappings: unique config IDs, known nodes, and entries that describe a
/// device the node has (path, `id`, IOMMU group and subsystem as the device has them).
pub(super) fn check_mappings<'a>(
    mappings: &[PciMappingSpec],
    devices_of: impl Fn(&str) -> Option<&'a [PciDeviceSpec]>,
) -> Result<(), TopologyError> {
    let mut names = std::collections::BTreeSet::new();
    for m in mappings {
        let name = &m.name;
        if !is_config_id(name) {
            return Err(TopologyError::Invalid(format!(
                "PCI mapping name '{name}' is not a PVE config ID (a letter, then letters, digits, '-' or '_')"
            )));
        }
        if !names.insert(name) {
            return Err(TopologyError::Invalid(format!(
                "PCI mapping '{name}' is defined twice"
            )));
        }
        for entry in &m.map {
            let devices = devices_of(&entry.node).ok_or_else(|| {
                TopologyError::Invalid(format!(
                    "PCI mapping '{name}' has an entry for unknown node '{}'",
                    entry.node
                ))
            })?;
            check_entry(name, entry, devices).map_err(TopologyError::Invalid)?;
        }
    }
    Ok(())
}

fn check_entry(
    name: &str,
    entry: &PciMapEntrySpec,
    devices: &[PciDeviceSpec],
) -> Result<(), String> {
    let node = &entry.node;
    let mut first = None;
    for path in entry.path.split(';') {
        if !is_pci_address(path, true) {
            return Err(format!(
                "PCI mapping '{name}' on node '{node}': path '{}' is not an address like 0000:01:00.0",
                entry.path
            ));
        }
        let found = devices.iter().find(|d| pci_filter_matches(path, &d.id)).ok_or_else(|| {
            format!(
                "PCI mapping '{name}' on node '{node}': path '{path}' names no device of the node (add it to the node's pci_devices)"
            )
        })?;
        first.get_or_insert(found);
    }
    let Some(device) = first else {
        return Err(format!(
            "PCI mapping '{name}' on node '{node}' has an empty path"
        ));
    };
    if !is_id_pair(&entry.id) {
        return Err(format!(
            "PCI mapping '{name}' on node '{node}': id '{}' is not vendor:device like 10de:2204",
            entry.id
        ));
    }
    let mismatch = |what: &str, said: &str, is: &str| {
        Err(format!(
            "PCI mapping '{name}' on node '{node}': {what} is {said}, but device {} has {is}",
            device.id
        ))
    };
    if entry.id.to_ascii_lowercase() != device.vendor_device() {
        return mismatch("id", &entry.id, &device.vendor_device());
    }
    if let Some(group) = entry.iommugroup
        && Some(group) != device.iommugroup
    {
        let is = device
            .iommugroup
            .map_or("no IOMMU group".to_owned(), |g| g.to_string());
        return mismatch("iommugroup", &group.to_string(), &is);
    }
    if let Some(sub) = &entry.subsystem_id {
        if !is_id_pair(sub) {
            return Err(format!(
                "PCI mapping '{name}' on node '{node}': subsystem_id '{sub}' is not vendor:device"
            ));
        }
        let is = device
            .subsystem_id()
            .unwrap_or_else(|| "no subsystem ID".to_owned());
        if sub.to_ascii_lowercase() != is {
            return mismatch("subsystem_id", sub, &is);
        }
    }
    Ok(())
}

/// Checks the DHCP services: one per bridge, well-formed pools.
pub(super) fn check_dhcp(services: &[DhcpSpec]) -> Result<(), TopologyError> {
    let mut bridges = std::collections::BTreeSet::new();
    for s in services {
        if s.bridge.is_empty() {
            return Err(TopologyError::Invalid("dhcp entry without bridge".into()));
        }
        if !bridges.insert(&s.bridge) {
            return Err(TopologyError::Invalid(format!(
                "bridge '{}' has two dhcp entries",
                s.bridge
            )));
        }
        s.check().map_err(TopologyError::Invalid)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pci_addresses_follow_the_schema_patterns() {
        for (text, with_domain, ok) in [
            ("0000:01:00.0", true, true),
            ("0000:01:00", true, true),
            ("01:00.0", true, false),
            ("01:00.0", false, true),
            ("01:00", false, true),
            ("0000:0A:00.0", false, false),
            ("0000:01:00.10", false, false),
            ("000:01:00.0", false, false),
            ("gpu", false, false),
        ] {
            assert_eq!(is_pci_address(text, with_domain), ok, "{text}");
        }
        assert!(pci_filter_matches("01:00", "0000:01:00.1"));
        assert!(pci_filter_matches("0000:01:00.0", "0000:01:00.0"));
        assert!(!pci_filter_matches("01:00.0", "0000:01:00.1"));
        assert!(is_config_id("gpu-a_1") && !is_config_id("1gpu") && !is_config_id("g"));
    }

    #[test]
    fn dhcp_pools_parse_and_bad_ones_are_refused() {
        let ok = DhcpSpec {
            bridge: "vmbr0".into(),
            range4: Some("10.0.9.100-10.0.9.200".into()),
            prefix4: Some(24),
            gateway4: Some("10.0.9.1".into()),
            range6: Some("fd00::100-fd00::1ff".into()),
            prefix6: None,
        };
        assert!(ok.check().is_ok());
        assert_eq!(ok.pool6().map(|p| p.2), Some(64));
        for (spec, error) in [
            (
                DhcpSpec {
                    range4: Some("10.0.9.200-10.0.9.100".into()),
                    ..ok.clone()
                },
                "is not FIRST-LAST IPv4",
            ),
            (
                DhcpSpec {
                    prefix4: None,
                    ..ok.clone()
                },
                "needs prefix4",
            ),
            (
                DhcpSpec {
                    range4: Some("10.0.8.1-10.0.9.1".into()),
                    ..ok.clone()
                },
                "spans more than one /24",
            ),
            (
                DhcpSpec {
                    gateway4: Some("10.1.0.1".into()),
                    ..ok.clone()
                },
                "is outside",
            ),
            (
                DhcpSpec {
                    range4: None,
                    prefix4: None,
                    gateway4: None,
                    range6: None,
                    ..ok.clone()
                },
                "neither range4 nor range6",
            ),
        ] {
            let e = spec.check().expect_err(error);
            assert!(e.contains(error), "{e}");
        }
    }
}
