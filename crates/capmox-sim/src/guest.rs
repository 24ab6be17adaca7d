//! What a simulated guest makes of its NoCloud seed image: an Ubuntu guest runs cloud-init and
//! takes its addresses (static, or DHCP with `dhcp4`/`dhcp6`) from the netplan
//! `network-config`; a Flatcar guest runs Ignition on the `user-data` (a JSON config) and
//! takes its addresses (`Address=`, `DHCP=`) from the systemd-networkd units in it
//! (`networkd.units` in spec 2.x, files under `/etc/systemd/network/` in 3.x). Written apart from
//! capmox's renderer, so the tests do not check capmox against itself.

use std::collections::BTreeMap;

use serde_json::Value;

use super::iso::IsoImage;

/// The operating system a seed image boots.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GuestOs {
    /// cloud-init reads the seed (any `user-data` that is not an Ignition config).
    Ubuntu,
    /// Ignition reads the seed (`user-data` is a JSON object with an `ignition` section).
    Flatcar,
}

impl GuestOs {
    /// The guest that boots from `seed`.
    pub fn of(seed: &IsoImage) -> Self {
        match seed.file("user-data").and_then(ignition_config) {
            Some(_) => Self::Flatcar,
            None => Self::Ubuntu,
        }
    }
}

/// The user-data as an Ignition config, if it is one.
fn ignition_config(user_data: &[u8]) -> Option<Value> {
    let doc: Value = serde_json::from_slice(user_data).ok()?;
    doc.get("ignition")?.get("version")?.as_str()?;
    Some(doc)
}

/// How the guest sets up one NIC from its seed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NicSetup {
    /// Static addresses with prefix (`10.0.0.5/24`).
    pub addresses: Vec<String>,
    /// It asks DHCP for an IPv4 address.
    pub dhcp4: bool,
    /// It asks DHCPv6 for an IPv6 address.
    pub dhcp6: bool,
}

/// What the guest sets up per NIC, keyed by lower-case MAC (and by `ethN` where the config
/// names the interface): netplan's `addresses`, `dhcp4` and `dhcp6` for cloud-init, the
/// networkd units' `Address=` and `DHCP=` for Ignition.
pub fn nic_setups(seed: &IsoImage) -> BTreeMap<String, NicSetup> {
    match seed.file("user-data").and_then(ignition_config) {
        Some(config) => setups_from_ignition(&config),
        None => seed
            .file("network-config")
            .map(setups_from_network_config)
            .unwrap_or_default(),
    }
}

/// Static addresses per NIC the guest configures, keyed as [`nic_setups`] keys them.
pub fn addresses(seed: &IsoImage) -> BTreeMap<String, Vec<String>> {
    nic_setups(seed)
        .into_iter()
        .map(|(nic, setup)| (nic, setup.addresses))
        .collect()
}

/// A netplan boolean (`true`, or the strings netplan also takes: `yes`, `on`, `y`).
fn netplan_true(value: Option<&serde_norway::Value>) -> bool {
    match value {
        Some(serde_norway::Value::Bool(b)) => *b,
        Some(serde_norway::Value::String(s)) => {
            matches!(s.to_ascii_lowercase().as_str(), "true" | "yes" | "on" | "y")
        }
        _ => false,
    }
}

/// Addresses from a netplan v2 `network-config` (or one nested under `network:`).
pub fn addresses_from_network_config(data: &[u8]) -> BTreeMap<String, Vec<String>> {
    setups_from_network_config(data)
        .into_iter()
        .map(|(nic, setup)| (nic, setup.addresses))
        .collect()
}

/// NIC setups from a netplan v2 `network-config` (or one nested under `network:`).
pub fn setups_from_network_config(data: &[u8]) -> BTreeMap<String, NicSetup> {
    let mut out = BTreeMap::new();
    let Ok(doc) = serde_norway::from_slice::<serde_norway::Value>(data) else {
        return out;
    };
    let root = doc.get("network").unwrap_or(&doc);
    let Some(eths) = root.get("ethernets").and_then(|e| e.as_mapping()) else {
        return out;
    };
    for (name, cfg) in eths {
        let setup = NicSetup {
            addresses: cfg
                .get("addresses")
                .and_then(|a| a.as_sequence())
                .map(|s| {
                    s.iter()
                        .filter_map(|a| a.as_str().map(str::to_string))
                        .collect()
                })
                .unwrap_or_default(),
            dhcp4: netplan_true(cfg.get("dhcp4")),
            dhcp6: netplan_true(cfg.get("dhcp6")),
        };
        if let Some(mac) = cfg
            .get("match")
            .and_then(|m| m.get("macaddress"))
            .and_then(|m| m.as_str())
        {
            out.insert(mac.to_ascii_lowercase(), setup.clone());
        }
        if let Some(n) = name.as_str() {
            out.insert(n.to_string(), setup);
        }
    }
    out
}

/// The `.network` units of an Ignition config, as text.
fn network_units(config: &Value) -> Vec<String> {
    let mut units = Vec::new();
    let list = |v: Option<&Value>| v.and_then(Value::as_array).cloned().unwrap_or_default();
    for unit in list(config.get("networkd").and_then(|n| n.get("units"))) {
        let name = unit.get("name").and_then(Value::as_str).unwrap_or("");
        if let Some(text) = unit.get("contents").and_then(Value::as_str)
            && name.ends_with(".network")
        {
            units.push(text.to_owned());
        }
    }
    for file in list(config.get("storage").and_then(|s| s.get("files"))) {
        let path = file.get("path").and_then(Value::as_str).unwrap_or("");
        if !(path.starts_with("/etc/systemd/network/") && path.ends_with(".network")) {
            continue;
        }
        let source = file
            .get("contents")
            .and_then(|c| c.get("source"))
            .and_then(Value::as_str)
            .unwrap_or("");
        if let Some(text) = source.strip_prefix("data:,") {
            units.push(
                percent_encoding::percent_decode_str(text)
                    .decode_utf8_lossy()
                    .into_owned(),
            );
        }
    }
    units
}

/// The families networkd's `DHCP=` asks for (`yes`/`true`/`1`/`on`/`both`: both, `ipv4`,
/// `ipv6`; anything else: none), as (IPv4, IPv6).
fn networkd_dhcp(value: &str) -> (bool, bool) {
    match value.trim().to_ascii_lowercase().as_str() {
        "yes" | "true" | "1" | "on" | "both" => (true, true),
        "ipv4" => (true, false),
        "ipv6" => (false, true),
        _ => (false, false),
    }
}

/// Addresses from the networkd units: `Address=` in `[Address]` or `[Network]`, by the
/// `MACAddress=` of `[Match]`.
pub fn addresses_from_ignition(config: &Value) -> BTreeMap<String, Vec<String>> {
    setups_from_ignition(config)
        .into_iter()
        .map(|(nic, setup)| (nic, setup.addresses))
        .collect()
}

/// NIC setups from the networkd units: `Address=` in `[Address]` or `[Network]` and
/// `DHCP=` in `[Network]`, by the `MACAddress=` of `[Match]`.
pub fn setups_from_ignition(config: &Value) -> BTreeMap<String, NicSetup> {
    let mut out: BTreeMap<String, NicSetup> = BTreeMap::new();
    for unit in network_units(config) {
        let mut section = "";
        let mut macs = Vec::new();
        let mut unit_setup = NicSetup::default();
        for line in unit.lines().map(str::trim) {
            if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
                section = match name {
                    "Match" => "Match",
                    "Network" => "Network",
                    "Address" => "Address",
                    _ => "",
                };
                continue;
            }
            let Some((key, value)) = line.split_once('=') else {
                continue;
            };
            match (section, key.trim()) {
                ("Match", "MACAddress") => {
                    macs.extend(value.split_whitespace().map(|m| m.to_ascii_lowercase()))
                }
                ("Network" | "Address", "Address") => {
                    unit_setup.addresses.push(value.trim().to_owned())
                }
                ("Network", "DHCP") => {
                    (unit_setup.dhcp4, unit_setup.dhcp6) = networkd_dhcp(value);
                }
                _ => {}
            }
        }
        for mac in macs {
            let setup = out.entry(mac).or_default();
            setup.addresses.extend(unit_setup.addresses.iter().cloned());
            setup.dhcp4 |= unit_setup.dhcp4;
            setup.dhcp6 |= unit_setup.dhcp6;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn seed(user_data: &[u8]) -> IsoImage {
        IsoImage {
            volume_id: "cidata".into(),
            files: BTreeMap::from([
                ("user-data".to_owned(), user_data.to_vec()),
                (
                    "network-config".to_owned(),
                    b"version: 1\nconfig: []\n".to_vec(),
                ),
            ]),
        }
    }

    #[test]
    fn a_spec_2_config_is_flatcar_with_addresses_from_networkd_units() {
        let config = json!({
            "ignition": {"version": "2.3.0"},
            "networkd": {"units": [
                {"name": "00-eth0.network", "contents": "[Match]\nMACAddress=BC:24:11:00:00:01\n\n[Address]\nAddress=10.0.0.5/24\n\n[Route]\nGateway=10.0.0.1\n"},
                {"name": "00-vrf0.netdev", "contents": "[NetDev]\nName=blue\nKind=vrf\n"}
            ]}
        });
        let img = seed(&serde_json::to_vec(&config).expect("JSON"));
        assert_eq!(GuestOs::of(&img), GuestOs::Flatcar);
        assert_eq!(
            addresses(&img),
            BTreeMap::from([(
                "bc:24:11:00:00:01".to_owned(),
                vec!["10.0.0.5/24".to_owned()]
            )])
        );
    }

    #[test]
    fn a_spec_3_config_has_its_units_as_files() {
        let config = json!({
            "ignition": {"version": "3.4.0"},
            "storage": {"files": [
                {"path": "/etc/systemd/network/00-eth0.network", "contents": {"source":
                    "data:,%5BMatch%5D%0AMACAddress=bc:24:11:00:00:01%0A%5BNetwork%5D%0AAddress=2001:db8::5/64%0A"}},
                {"path": "/etc/hostname", "contents": {"source": "data:,m1"}}
            ]}
        });
        let img = seed(&serde_json::to_vec(&config).expect("JSON"));
        assert_eq!(
            addresses(&img),
            BTreeMap::from([(
                "bc:24:11:00:00:01".to_owned(),
                vec!["2001:db8::5/64".to_owned()]
            )])
        );
    }

    #[test]
    fn dhcp_requests_come_from_netplan_and_networkd() {
        let mut img = seed(b"#cloud-config\n");
        img.files.insert(
            "network-config".to_owned(),
            b"network:\n  version: 2\n  ethernets:\n    eth0:\n      match: {macaddress: BC:24:11:00:00:01}\n      dhcp4: true\n      dhcp6: 'no'\n    eth1:\n      dhcp6: yes\n      addresses: [10.1.0.5/24]\n"
                .to_vec(),
        );
        let setups = nic_setups(&img);
        let eth0 = NicSetup {
            dhcp4: true,
            ..NicSetup::default()
        };
        assert_eq!(setups["bc:24:11:00:00:01"], eth0);
        assert_eq!(setups["eth0"], eth0);
        assert_eq!(
            setups["eth1"],
            NicSetup {
                addresses: vec!["10.1.0.5/24".into()],
                dhcp4: false,
                dhcp6: true
            }
        );
        for (value, families) in [
            ("yes", (true, true)),
            ("ipv4", (true, false)),
            ("ipv6", (false, true)),
            ("no", (false, false)),
        ] {
            let config = json!({
                "ignition": {"version": "3.4.0"},
                "storage": {"files": [{"path": "/etc/systemd/network/00-eth0.network", "contents": {"source":
                    format!("data:,%5BMatch%5D%0AMACAddress=bc:24:11:00:00:02%0A%5BNetwork%5D%0ADHCP={value}%0A")}}]}
            });
            let img = seed(&serde_json::to_vec(&config).expect("JSON"));
            let s = &nic_setups(&img)["bc:24:11:00:00:02"];
            assert_eq!((s.dhcp4, s.dhcp6), families, "DHCP={value}");
        }
    }

    #[test]
    fn cloud_config_is_ubuntu() {
        let img = seed(b"#cloud-config\n");
        assert_eq!(GuestOs::of(&img), GuestOs::Ubuntu);
        assert!(addresses(&img).is_empty());
    }
}
