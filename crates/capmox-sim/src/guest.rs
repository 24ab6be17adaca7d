//! What a simulated guest makes of its NoCloud seed image: an Ubuntu guest runs cloud-init and
//! takes its addresses from the netplan `network-config`; a Flatcar guest runs Ignition on the
//! `user-data` (a JSON config) and takes its addresses from the systemd-networkd units in it
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

/// Static addresses per NIC the guest configures, keyed by lower-case MAC (and by `ethN` where
/// the config names the interface).
pub fn addresses(seed: &IsoImage) -> BTreeMap<String, Vec<String>> {
    match seed.file("user-data").and_then(ignition_config) {
        Some(config) => addresses_from_ignition(&config),
        None => seed
            .file("network-config")
            .map(addresses_from_network_config)
            .unwrap_or_default(),
    }
}

/// Addresses from a netplan v2 `network-config` (or one nested under `network:`).
pub fn addresses_from_network_config(data: &[u8]) -> BTreeMap<String, Vec<String>> {
    let mut out = BTreeMap::new();
    let Ok(doc) = serde_norway::from_slice::<serde_norway::Value>(data) else {
        return out;
    };
    let root = doc.get("network").unwrap_or(&doc);
    let Some(eths) = root.get("ethernets").and_then(|e| e.as_mapping()) else {
        return out;
    };
    for (name, cfg) in eths {
        let addrs: Vec<String> = cfg
            .get("addresses")
            .and_then(|a| a.as_sequence())
            .map(|s| {
                s.iter()
                    .filter_map(|a| a.as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default();
        if let Some(mac) = cfg
            .get("match")
            .and_then(|m| m.get("macaddress"))
            .and_then(|m| m.as_str())
        {
            out.insert(mac.to_ascii_lowercase(), addrs.clone());
        }
        if let Some(n) = name.as_str() {
            out.insert(n.to_string(), addrs);
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

/// Addresses from the networkd units: `Address=` in `[Address]` or `[Network]`, by the
/// `MACAddress=` of `[Match]`.
pub fn addresses_from_ignition(config: &Value) -> BTreeMap<String, Vec<String>> {
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for unit in network_units(config) {
        let mut section = "";
        let mut macs = Vec::new();
        let mut addrs = Vec::new();
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
                ("Network" | "Address", "Address") => addrs.push(value.trim().to_owned()),
                _ => {}
            }
        }
        for mac in macs {
            out.entry(mac).or_default().extend(addrs.iter().cloned());
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
    fn cloud_config_is_ubuntu() {
        let img = seed(b"#cloud-config\n");
        assert_eq!(GuestOs::of(&img), GuestOs::Ubuntu);
        assert!(addresses(&img).is_empty());
    }
}
