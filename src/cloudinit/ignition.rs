//! Ignition (Flatcar) bootstrap data: the bootstrap provider's config (spec 2.x, as Flatcar's
//! kubeadm bootstrap writes it, or 3.x) with what only the infrastructure provider knows merged
//! in, delivered on the same NoCloud seed image as cloud-init data.
//!
//! What capmox adds (the Go provider adds the same; capmox's values win over the bootstrap's):
//!
//! - `/etc/hostname`: the machine name.
//! - `/etc/proxmox-env`: `COREOS_CUSTOM_HOSTNAME`, `COREOS_CUSTOM_INSTANCE_ID` (the SMBIOS
//!   UUID), `COREOS_CUSTOM_PROVIDER_ID` (`proxmox://<uuid>`) and `COREOS_CUSTOM_PRIVATE_IPV4` /
//!   `_IPV6` (the default pool's addresses), for units of the bootstrap config to read.
//! - `systemd-resolved.service` enabled.
//! - systemd-networkd units for the static addresses, routes and DNS servers (see
//!   [`super::networkd`]): `networkd.units` in spec 2.x, files under `/etc/systemd/network/` in
//!   spec 3.x (which has no networkd section).
//!
//! Entries are merged by key as Ignition itself merges configs: a file by its path, a unit by
//! its name (an existing `systemd-resolved.service` only gets `enabled: true`). A spec 2.x
//! config comes out as 2.3.0 (2.3 reads every 2.x config; the Go provider also writes 2.3.0);
//! 3.x keeps its version. The seed image carries the merged config as `user-data`, the usual
//! `meta-data`, and a `network-config` that configures nothing (the networkd units do).

use serde_json::{Map, Value, json};

use super::networkd::NetworkdUnit;

/// `network-config` of an Ignition seed: version 1 with nothing to do, as the Go provider writes
/// it, so a cloud-init that may also read the image leaves the network to the networkd units.
pub const EMPTY_NETWORK_CONFIG: &str = "version: 1\nconfig: []\n";

/// Mode of every file capmox writes (0644).
const FILE_MODE: u32 = 0o644;

/// Where Ignition 3.x configs get the networkd units (as files).
const NETWORKD_DIR: &str = "/etc/systemd/network";

/// Why Ignition bootstrap data cannot be delivered; every message says what to fix.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum IgnitionError {
    /// The value is not JSON at all.
    #[error(
        "the bootstrap data is not an Ignition config: it is not JSON ({0}); with format ignition \
         the bootstrap Secret's value must be an Ignition JSON config"
    )]
    NotJson(String),
    /// Valid JSON that is not an object.
    #[error("the Ignition config is a JSON {0}, not an object")]
    NotAnObject(&'static str),
    /// No `ignition.version` string.
    #[error(
        "the Ignition config has no ignition.version; it must name its spec version, e.g. 3.4.0"
    )]
    MissingVersion,
    /// A spec version capmox cannot merge into (1.x, experimental, newer than it knows).
    #[error(
        "Ignition spec version {0:?} is not supported; capmox reads spec 2.0.0 to 2.3.0 and 3.0.0 \
         to 3.5.0 configs"
    )]
    UnsupportedVersion(String),
    /// A field capmox merges into has the wrong JSON type.
    #[error("the Ignition config's {at} is a JSON {found}, but must be {expected}")]
    WrongShape {
        /// Where (`storage.files[2].path`).
        at: String,
        /// The JSON type found.
        found: &'static str,
        /// What Ignition expects there.
        expected: &'static str,
    },
    /// `ignition.config.replace` makes Ignition drop this config for another one.
    #[error(
        "the Ignition config replaces itself with {0}; the hostname and network capmox adds would \
         be dropped with it: use ignition.config.merge instead"
    )]
    Replaced(String),
}

/// The Ignition spec generation, which decides where networkd units go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Spec {
    /// 2.x (written back as 2.3.0).
    V2,
    /// 3.x (kept as given).
    V3,
}

/// A bootstrap config checked where capmox merges into it; its `Debug` shows no content (it
/// holds join tokens and certificates).
#[derive(Clone, PartialEq)]
pub struct IgnitionConfig {
    doc: Map<String, Value>,
    spec: Spec,
}

impl std::fmt::Debug for IgnitionConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IgnitionConfig")
            .field("spec", &self.spec)
            .finish_non_exhaustive()
    }
}

/// What capmox merges into the bootstrap config.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Additions {
    /// The machine name.
    pub hostname: String,
    /// The VM's SMBIOS UUID.
    pub instance_id: String,
    /// The default pool's IPv4 address, `addr/prefix`.
    pub private_ipv4: Option<String>,
    /// The default pool's IPv6 address, `addr/prefix`.
    pub private_ipv6: Option<String>,
    /// The networkd units for the static network.
    pub units: Vec<NetworkdUnit>,
}

fn json_type(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

fn wrong(at: impl Into<String>, found: &Value, expected: &'static str) -> IgnitionError {
    IgnitionError::WrongShape {
        at: at.into(),
        found: json_type(found),
        expected,
    }
}

/// Reads `X.Y.Z` (no suffix: experimental specs are refused).
fn spec_of(version: &str) -> Result<Spec, IgnitionError> {
    let unsupported = || IgnitionError::UnsupportedVersion(version.to_owned());
    let parts: Vec<u32> = version
        .split('.')
        .map(|p| p.parse::<u32>().map_err(|_| unsupported()))
        .collect::<Result<_, _>>()?;
    match parts.as_slice() {
        [2, 0..=3, 0] => Ok(Spec::V2),
        [3, 0..=5, 0] => Ok(Spec::V3),
        _ => Err(unsupported()),
    }
}

/// The optional object at `key` of `parent` (`at` names `parent` in errors).
fn object_at<'a>(
    parent: &'a Map<String, Value>,
    at: &str,
    key: &str,
) -> Result<Option<&'a Map<String, Value>>, IgnitionError> {
    match parent.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Object(o)) => Ok(Some(o)),
        Some(other) => Err(wrong(join(at, key), other, "an object")),
    }
}

fn join(at: &str, key: &str) -> String {
    if at.is_empty() {
        key.to_owned()
    } else {
        format!("{at}.{key}")
    }
}

/// Checks the optional list `parent.key`: an array of objects, each with a string `id_key`.
fn check_list(
    parent: Option<&Map<String, Value>>,
    at: &str,
    key: &str,
    id_key: &str,
) -> Result<(), IgnitionError> {
    let at = join(at, key);
    let items = match parent.and_then(|p| p.get(key)) {
        None | Some(Value::Null) => return Ok(()),
        Some(Value::Array(items)) => items,
        Some(other) => return Err(wrong(at, other, "an array")),
    };
    for (i, item) in items.iter().enumerate() {
        let Value::Object(entry) = item else {
            return Err(wrong(format!("{at}[{i}]"), item, "an object"));
        };
        match entry.get(id_key) {
            Some(Value::String(_)) => {}
            Some(other) => return Err(wrong(format!("{at}[{i}].{id_key}"), other, "a string")),
            None => {
                return Err(IgnitionError::WrongShape {
                    at: format!("{at}[{i}].{id_key}"),
                    found: "null",
                    expected: "a string",
                });
            }
        }
    }
    Ok(())
}

/// Parses Ignition bootstrap data and checks every part capmox merges into.
pub fn parse(value: &[u8]) -> Result<IgnitionConfig, IgnitionError> {
    let parsed: Value =
        serde_json::from_slice(value).map_err(|e| IgnitionError::NotJson(e.to_string()))?;
    let Value::Object(doc) = parsed else {
        return Err(IgnitionError::NotAnObject(json_type(&parsed)));
    };
    let ignition = object_at(&doc, "", "ignition")?.ok_or(IgnitionError::MissingVersion)?;
    let spec = match ignition.get("version") {
        Some(Value::String(v)) => spec_of(v.trim())?,
        None | Some(Value::Null) => return Err(IgnitionError::MissingVersion),
        Some(other) => return Err(wrong("ignition.version", other, "a string")),
    };
    if let Some(config) = object_at(ignition, "ignition", "config")? {
        match config.get("replace") {
            None | Some(Value::Null) => {}
            Some(Value::Object(r)) => {
                let source = r.get("source").and_then(Value::as_str).unwrap_or("");
                if !source.is_empty() {
                    return Err(IgnitionError::Replaced(source.to_owned()));
                }
            }
            Some(other) => return Err(wrong("ignition.config.replace", other, "an object")),
        }
    }
    let storage = object_at(&doc, "", "storage")?;
    check_list(storage, "storage", "files", "path")?;
    let systemd = object_at(&doc, "", "systemd")?;
    check_list(systemd, "systemd", "units", "name")?;
    if spec == Spec::V2 {
        let networkd = object_at(&doc, "", "networkd")?;
        check_list(networkd, "networkd", "units", "name")?;
    }
    Ok(IgnitionConfig { doc, spec })
}

/// Percent-encodes `text` for a `data:,` URL (RFC 2397): only unreserved characters and `/`,
/// `:` and `=` stay as they are.
pub fn data_url(text: &str) -> String {
    let mut out = String::from("data:,");
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~/:=".contains(&b) {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// `/etc/proxmox-env`: one `KEY=value` line per variable.
fn proxmox_env(add: &Additions) -> String {
    let mut lines = vec![
        format!("COREOS_CUSTOM_HOSTNAME={}", add.hostname),
        format!("COREOS_CUSTOM_INSTANCE_ID={}", add.instance_id),
        format!(
            "COREOS_CUSTOM_PROVIDER_ID={}",
            super::provider_id(&add.instance_id)
        ),
    ];
    if let Some(v4) = &add.private_ipv4 {
        lines.push(format!("COREOS_CUSTOM_PRIVATE_IPV4={v4}"));
    }
    if let Some(v6) = &add.private_ipv6 {
        lines.push(format!("COREOS_CUSTOM_PRIVATE_IPV6={v6}"));
    }
    let mut text = lines.join("\n");
    text.push('\n');
    text
}

/// The array at `parent[section][key]`, created when absent (the shape was checked by [`parse`]).
fn list_mut<'a>(
    doc: &'a mut Map<String, Value>,
    section: &str,
    key: &str,
) -> Option<&'a mut Vec<Value>> {
    let parent = doc
        .entry(section)
        .or_insert_with(|| Value::Object(Map::new()));
    if parent.is_null() {
        *parent = Value::Object(Map::new());
    }
    let list = parent
        .as_object_mut()?
        .entry(key)
        .or_insert_with(|| Value::Array(Vec::new()));
    if list.is_null() {
        *list = Value::Array(Vec::new());
    }
    list.as_array_mut()
}

/// Replaces the entry whose `id_key` is `id` (all of them, should there be several), or appends.
fn upsert(list: &mut Vec<Value>, id_key: &str, entry: Value) {
    let id = entry.get(id_key).cloned();
    let first = list.iter().position(|e| e.get(id_key) == id.as_ref());
    list.retain(|e| e.get(id_key) != id.as_ref());
    match first {
        Some(at) => list.insert(at.min(list.len()), entry),
        None => list.push(entry),
    }
}

impl IgnitionConfig {
    /// The merged config as compact JSON (the seed image's `user-data`).
    pub fn merge(self, add: &Additions) -> Vec<u8> {
        let IgnitionConfig { mut doc, spec } = self;
        if spec == Spec::V2
            && let Some(Value::Object(ignition)) = doc.get_mut("ignition")
        {
            ignition.insert("version".into(), json!("2.3.0"));
        }
        let file = |path: String, contents: &str| {
            let mut f = json!({
                "path": path,
                "overwrite": true,
                "mode": FILE_MODE,
                "contents": {"source": data_url(contents)},
            });
            if spec == Spec::V2 {
                f["filesystem"] = json!("root");
            }
            f
        };
        let mut files = vec![
            file("/etc/hostname".into(), &add.hostname),
            file("/etc/proxmox-env".into(), &proxmox_env(add)),
        ];
        if spec == Spec::V3 {
            files.extend(
                add.units
                    .iter()
                    .map(|u| file(format!("{NETWORKD_DIR}/{}", u.name), &u.contents)),
            );
        }
        if let Some(list) = list_mut(&mut doc, "storage", "files") {
            for f in files {
                upsert(list, "path", f);
            }
        }
        if let Some(units) = list_mut(&mut doc, "systemd", "units") {
            const RESOLVED: &str = "systemd-resolved.service";
            match units
                .iter_mut()
                .find(|u| u.get("name").and_then(Value::as_str) == Some(RESOLVED))
                .and_then(Value::as_object_mut)
            {
                Some(unit) => {
                    unit.insert("enabled".into(), json!(true));
                }
                None => units.push(json!({"name": RESOLVED, "enabled": true})),
            }
        }
        if spec == Spec::V2
            && let Some(units) = list_mut(&mut doc, "networkd", "units")
        {
            for u in &add.units {
                upsert(
                    units,
                    "name",
                    json!({"name": u.name, "contents": u.contents}),
                );
            }
        }
        // A map of JSON values always serialises.
        serde_json::to_vec(&Value::Object(doc)).unwrap_or_default()
    }
}

/// Checks Ignition bootstrap data without merging (the machine reconciler does this before it
/// creates anything in Proxmox).
pub fn check(value: &[u8]) -> Result<(), IgnitionError> {
    parse(value).map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Shaped like Flatcar's kubeadm bootstrap output (spec 2.3), with a placeholder hostname.
    const V2_3: &str = include_str!("../../tests/data/ignition/kubeadm-flatcar-v2.3.json");
    /// Shaped like a Butane-made spec 3.4 config; it already configures systemd-resolved.
    const V3_4: &str = include_str!("../../tests/data/ignition/kubeadm-flatcar-v3.4.json");

    fn additions() -> Additions {
        Additions {
            hostname: "cp-0".to_owned(),
            instance_id: "9b9f5a46-0c1d-4f7e-8b1a-1c2d3e4f5a6b".to_owned(),
            private_ipv4: Some("10.0.0.5/24".to_owned()),
            private_ipv6: None,
            units: vec![NetworkdUnit {
                name: "00-eth0.network".to_owned(),
                contents: "[Match]\nMACAddress=bc:24:11:00:00:01\n".to_owned(),
            }],
        }
    }

    fn merged(input: &str) -> Value {
        let out = parse(input.as_bytes()).expect("parses").merge(&additions());
        serde_json::from_slice(&out).expect("the merged config is JSON")
    }

    fn by<'a>(list: &'a Value, key: &str, id: &str) -> Vec<&'a Value> {
        list.as_array()
            .expect("an array")
            .iter()
            .filter(|e| e[key] == json!(id))
            .collect()
    }

    const ENV: &str = "data:,COREOS_CUSTOM_HOSTNAME=cp-0%0ACOREOS_CUSTOM_INSTANCE_ID=\
        9b9f5a46-0c1d-4f7e-8b1a-1c2d3e4f5a6b%0ACOREOS_CUSTOM_PROVIDER_ID=\
        proxmox://9b9f5a46-0c1d-4f7e-8b1a-1c2d3e4f5a6b%0ACOREOS_CUSTOM_PRIVATE_IPV4=10.0.0.5/24%0A";

    #[test]
    fn spec_2_3_gets_files_networkd_units_and_resolved_and_keeps_everything_else() {
        let doc = merged(V2_3);
        assert_eq!(doc["ignition"]["version"], "2.3.0");
        let files = &doc["storage"]["files"];
        // The bootstrap's placeholder hostname is replaced in place, not duplicated.
        assert_eq!(
            by(files, "path", "/etc/hostname"),
            [
                &json!({"filesystem": "root", "path": "/etc/hostname", "overwrite": true,
                     "mode": 420, "contents": {"source": "data:,cp-0"}})
            ]
        );
        assert_eq!(files[1]["path"], "/etc/hostname");
        assert_eq!(
            by(files, "path", "/etc/proxmox-env"),
            [
                &json!({"filesystem": "root", "path": "/etc/proxmox-env", "overwrite": true,
                     "mode": 420, "contents": {"source": ENV}})
            ]
        );
        // The bootstrap's own file, unit and user are untouched.
        let original: Value = serde_json::from_str(V2_3).expect("fixture");
        assert_eq!(files[0], original["storage"]["files"][0]);
        assert_eq!(
            by(&doc["systemd"]["units"], "name", "kubeadm.service"),
            [&original["systemd"]["units"][0]]
        );
        assert_eq!(doc["passwd"], original["passwd"]);
        assert_eq!(
            doc["ignition"]["security"],
            original["ignition"]["security"]
        );
        assert_eq!(
            by(&doc["systemd"]["units"], "name", "systemd-resolved.service"),
            [&json!({"name": "systemd-resolved.service", "enabled": true})]
        );
        assert_eq!(
            doc["networkd"]["units"],
            json!([{"name": "00-eth0.network",
                    "contents": "[Match]\nMACAddress=bc:24:11:00:00:01\n"}])
        );
        assert_eq!(
            by(files, "path", "/etc/systemd/network/00-eth0.network").len(),
            0
        );
    }

    #[test]
    fn spec_3_gets_networkd_units_as_files_and_keeps_its_version() {
        let doc = merged(V3_4);
        assert_eq!(doc["ignition"]["version"], "3.4.0");
        assert!(
            doc.get("networkd").is_none(),
            "spec 3 has no networkd section"
        );
        let files = &doc["storage"]["files"];
        assert_eq!(
            by(files, "path", "/etc/systemd/network/00-eth0.network"),
            [
                &json!({"path": "/etc/systemd/network/00-eth0.network", "overwrite": true,
                     "mode": 420, "contents": {"source":
                        "data:,%5BMatch%5D%0AMACAddress=bc:24:11:00:00:01%0A"}})
            ]
        );
        assert_eq!(
            by(files, "path", "/etc/hostname"),
            [
                &json!({"path": "/etc/hostname", "overwrite": true, "mode": 420,
                     "contents": {"source": "data:,cp-0"}})
            ]
        );
        assert_eq!(
            by(files, "path", "/etc/proxmox-env")[0]["contents"]["source"],
            ENV
        );
        assert!(
            files
                .as_array()
                .expect("files")
                .iter()
                .all(|f| f.get("filesystem").is_none())
        );
        // The existing systemd-resolved unit keeps its drop-in and is enabled.
        let original: Value = serde_json::from_str(V3_4).expect("fixture");
        let resolved = by(&doc["systemd"]["units"], "name", "systemd-resolved.service");
        assert_eq!(resolved.len(), 1);
        assert_eq!(resolved[0]["enabled"], true);
        assert_eq!(
            resolved[0]["dropins"],
            original["systemd"]["units"][1]["dropins"]
        );
        assert_eq!(doc["systemd"]["units"][0], original["systemd"]["units"][0]);
        assert_eq!(files[0], original["storage"]["files"][0]);
    }

    #[test]
    fn a_minimal_config_gets_the_sections_it_lacks() {
        for (version, out) in [("2.2.0", "2.3.0"), ("3.0.0", "3.0.0"), ("3.5.0", "3.5.0")] {
            let doc = merged(&format!(r#"{{"ignition": {{"version": "{version}"}}}}"#));
            assert_eq!(doc["ignition"]["version"], out);
            assert_eq!(
                by(&doc["storage"]["files"], "path", "/etc/hostname").len(),
                1
            );
            assert_eq!(doc["systemd"]["units"].as_array().map(Vec::len), Some(1));
        }
        // Explicit nulls are treated as absent, as Ignition does.
        let doc = merged(
            r#"{"ignition": {"version": "2.3.0"}, "storage": null, "networkd": {"units": null}}"#,
        );
        assert_eq!(doc["networkd"]["units"].as_array().map(Vec::len), Some(1));
    }

    #[test]
    fn merging_twice_gives_the_same_config() {
        let once = parse(V2_3.as_bytes()).expect("parses").merge(&additions());
        let twice = parse(&once).expect("parses").merge(&additions());
        assert_eq!(once, twice);
    }

    #[test]
    fn proxmox_env_names_the_ipv6_address_too() {
        let add = Additions {
            private_ipv6: Some("2001:db8::5/64".to_owned()),
            ..additions()
        };
        assert!(proxmox_env(&add).ends_with(
            "COREOS_CUSTOM_PRIVATE_IPV4=10.0.0.5/24\nCOREOS_CUSTOM_PRIVATE_IPV6=2001:db8::5/64\n"
        ));
    }

    #[test]
    fn data_urls_escape_what_a_url_cannot_carry() {
        assert_eq!(data_url("a=b c\n#%,?"), "data:,a=b%20c%0A%23%25%2C%3F");
        assert_eq!(data_url("x\u{e9}"), "data:,x%C3%A9");
    }

    fn err(input: &str) -> IgnitionError {
        parse(input.as_bytes()).expect_err("must be refused")
    }

    #[test]
    fn malformed_configs_are_refused_with_what_to_fix() {
        assert!(matches!(err("#cloud-config\n"), IgnitionError::NotJson(_)));
        assert!(
            err("{\"ignition\": ")
                .to_string()
                .starts_with("the bootstrap data is not an Ignition config: it is not JSON ("),
            "{}",
            err("{\"ignition\": ")
        );
        assert_eq!(err("[1, 2]"), IgnitionError::NotAnObject("array"));
        assert_eq!(err("{}"), IgnitionError::MissingVersion);
        assert_eq!(err(r#"{"ignition": {}}"#), IgnitionError::MissingVersion);
        assert_eq!(
            err(r#"{"ignition": {"version": 3}}"#).to_string(),
            "the Ignition config's ignition.version is a JSON number, but must be a string"
        );
        assert_eq!(
            err(r#"{"ignition": "3.4.0"}"#).to_string(),
            "the Ignition config's ignition is a JSON string, but must be an object"
        );
        assert_eq!(
            err(r#"{"ignition": {"version": "3.4.0"}, "storage": {"files": {}}}"#).to_string(),
            "the Ignition config's storage.files is a JSON object, but must be an array"
        );
        assert_eq!(
            err(
                r#"{"ignition": {"version": "3.4.0"}, "storage": {"files": [{"path": "/a"}, "b"]}}"#
            )
            .to_string(),
            "the Ignition config's storage.files[1] is a JSON string, but must be an object"
        );
        assert_eq!(
            err(r#"{"ignition": {"version": "3.4.0"}, "systemd": {"units": [{"enabled": true}]}}"#)
                .to_string(),
            "the Ignition config's systemd.units[0].name is a JSON null, but must be a string"
        );
        assert_eq!(
            err(r#"{"ignition": {"version": "2.3.0"}, "networkd": []}"#).to_string(),
            "the Ignition config's networkd is a JSON array, but must be an object"
        );
        assert_eq!(
            err(
                r#"{"ignition": {"version": "3.4.0", "config": {"replace": {"source": "https://x/y.ign"}}}}"#
            ),
            IgnitionError::Replaced("https://x/y.ign".to_owned())
        );
    }

    #[test]
    fn only_known_spec_versions_are_merged_into() {
        for version in [
            "1.0.0",
            "2.4.0",
            "3.6.0",
            "3.6.0-experimental",
            "4.0.0",
            "3.4",
            "v3.4.0",
            "",
        ] {
            assert_eq!(
                err(&format!(r#"{{"ignition": {{"version": "{version}"}}}}"#)),
                IgnitionError::UnsupportedVersion(version.to_owned()),
                "{version}"
            );
        }
        // Spec 1 named its version elsewhere.
        assert_eq!(
            err(r#"{"ignitionVersion": 1}"#),
            IgnitionError::MissingVersion
        );
        assert_eq!(
            err(r#"{"ignition": {"version": "3.6.0-experimental"}}"#).to_string(),
            "Ignition spec version \"3.6.0-experimental\" is not supported; capmox reads spec \
             2.0.0 to 2.3.0 and 3.0.0 to 3.5.0 configs"
        );
        for version in ["2.0.0", "2.1.0", "2.3.0", "3.1.0", "3.3.0", "3.4.0"] {
            assert!(
                check(format!(r#"{{"ignition": {{"version": "{version}"}}}}"#).as_bytes()).is_ok(),
                "{version}"
            );
        }
    }

    #[test]
    fn debug_shows_no_content() {
        let config = parse(V2_3.as_bytes()).expect("parses");
        let shown = format!("{config:?}");
        assert!(!shown.contains("abcdef"), "{shown}");
        assert!(shown.contains("V2"), "{shown}");
    }
}
