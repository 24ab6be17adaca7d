//! The NoCloud seed a machine boots with: `user-data` (the bootstrap data), `meta-data`,
//! `network-config` (netplan v2) and the ISO9660 image (volume `cidata`) that carries them.
//! Ignition (Flatcar) bootstrap data travels on the same image, with the hostname, instance id
//! and network merged into it (see [`ignition`]).
//! Pure code: the machine reconciler reads the bootstrap Secret, the VM config (SMBIOS UUID,
//! MACs) and the bound IPAddresses, and passes plain data here with the [`Placement`].
//!
//! # Flow (machine reconciler)
//!
//! 0. Before creating the VM: [`BootstrapFormat::parse`] the Secret's `format` and, for
//!    Ignition, [`ignition::check`] its value, so bad bootstrap data changes nothing in Proxmox.
//! 1. [`BootstrapFormat::parse`] the Secret's `format`; [`instance_id_from_smbios`] and
//!    [`mac_from_net_config`] on the VM config; the bound IPAddresses as [`NicAddresses`].
//! 2. [`render_nocloud`] → [`NoCloudFiles`]; on error set the condition from
//!    [`CloudInitError::reason`] and retry only when [`CloudInitError::is_retryable`].
//! 3. [`build_nocloud_iso`] and upload it as [`seed_iso_name`], attach it as `ide0`.
//!
//! # Where capmox differs from the Go provider (on purpose)
//!
//! - Two pool gateways of one IP family with the same metric no longer fail the machine
//!   (Go bug 13): the default pool's gateway keeps the default route, the other is left out.
//! - Route/rule collisions and validation errors name the route and the field to fix.
//! - Strings YAML 1.1 (cloud-init's PyYAML) would misread are quoted, e.g. the QEMU MAC
//!   `52:54:00:12:34:56` (a base-60 integer there) or a VRF named `on`; MACs are lower-case; `linkMtu: 1` ("inherit") writes no `mtu`.
//! - `ethernets` are written in NIC order (`eth2` before `eth10`), not sorted as strings.
//! - Ignition: spec 3.x configs are merged into too (the Go provider reads 2.x only), the
//!   networkd units are validated like the netplan document, and a config that would drop
//!   capmox's additions (`ignition.config.replace`) is refused.

pub mod ignition;
pub mod iso;
mod network;
mod networkd;
mod vmconfig;
mod yaml;

#[cfg(test)]
mod tests;

use serde::Serialize;

use crate::placement::Placement;

pub use ignition::IgnitionError;
pub use network::{AssignedAddress, NetworkConfigError, NicAddresses, render_network_config};
pub use networkd::NetworkdUnit;
pub use vmconfig::{instance_id_from_smbios, mac_from_net_config, smbios_with_uuid, uuid_v4};

/// Why the NoCloud files cannot be rendered.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CloudInitError {
    /// The machine has no hostname.
    #[error("meta-data needs a hostname; the ProxmoxMachine has no name")]
    MissingHostname,
    /// The VM's SMBIOS UUID is not known.
    #[error("meta-data needs an instance-id; the VM config has no smbios1 uuid")]
    MissingInstanceId,
    /// The bootstrap Secret's `format` is neither `cloud-config` nor `ignition`.
    #[error(
        "bootstrap data format {0:?} is unknown; the bootstrap Secret's format must be cloud-config or ignition"
    )]
    UnknownFormat(String),
    /// The Ignition bootstrap data is malformed or of an unsupported spec version.
    #[error(transparent)]
    Ignition(#[from] IgnitionError),
    /// The network-config is invalid.
    #[error(transparent)]
    Network(#[from] NetworkConfigError),
    /// serde_norway refused the document (a bug in capmox).
    #[error("rendering meta-data as YAML failed: {0}")]
    Yaml(String),
}

impl CloudInitError {
    /// Condition reason for the machine's `VirtualMachineProvisioned` condition.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::MissingHostname | Self::MissingInstanceId => "MetadataIncomplete",
            Self::UnknownFormat(_) => "BootstrapFormatUnsupported",
            Self::Ignition(_) => "BootstrapDataInvalid",
            Self::Network(
                NetworkConfigError::MissingAddresses { .. } | NetworkConfigError::MissingMac { .. },
            ) => "WaitingForNetwork",
            Self::Network(_) => "InvalidNetworkConfig",
            Self::Yaml(_) => "CloudInitRenderFailed",
        }
    }

    /// True when the input may still arrive (IP claims bound, VM config read): retry, don't fail.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            Self::MissingInstanceId
                | Self::Network(
                    NetworkConfigError::MissingAddresses { .. }
                        | NetworkConfigError::MissingMac { .. }
                )
        )
    }
}

/// Format of the bootstrap data (the bootstrap Secret's `format` key).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum BootstrapFormat {
    /// `cloud-config` (the default when the key is absent).
    #[default]
    CloudConfig,
    /// `ignition` (Flatcar).
    Ignition,
}

impl std::fmt::Display for BootstrapFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::CloudConfig => "cloud-config",
            Self::Ignition => "ignition",
        })
    }
}

impl BootstrapFormat {
    /// Reads the Secret's `format` value (absent or empty means `cloud-config`, as in CAPI).
    pub fn parse(format: Option<&str>) -> Result<Self, CloudInitError> {
        match format.map(str::trim).unwrap_or("") {
            "" | "cloud-config" => Ok(Self::CloudConfig),
            "ignition" => Ok(Self::Ignition),
            other => Err(CloudInitError::UnknownFormat(other.to_owned())),
        }
    }
}

/// The bootstrap Secret's content: `value` and `format`. Its `Debug` shows only sizes: the
/// value holds join tokens and certificates that must never reach a log line.
#[derive(Clone, PartialEq, Eq)]
pub struct BootstrapData {
    /// The `value` key, unchanged.
    pub value: Vec<u8>,
    /// The `format` key.
    pub format: BootstrapFormat,
}

impl std::fmt::Debug for BootstrapData {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BootstrapData")
            .field("value", &Redacted(self.value.len()))
            .field("format", &self.format)
            .finish()
    }
}

/// Stands in for secret bytes in `Debug` output: their length, never their content.
struct Redacted(usize);

impl std::fmt::Debug for Redacted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "<redacted, {} bytes>", self.0)
    }
}

/// What goes into `meta-data`.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct MetaData {
    /// The VM's SMBIOS UUID (cloud-init re-runs per instance when it changes).
    pub instance_id: String,
    /// The machine name, as `local-hostname` and `hostname`.
    pub hostname: String,
    /// `proxmox://<uuid>` when `metadataSettings.providerIDInjection` is true (see [`provider_id`]).
    pub provider_id: Option<String>,
    /// `Machine.spec.version`, for templates that read `ds.meta_data.kubernetes_version`.
    pub kubernetes_version: Option<String>,
}

/// The four NoCloud files, ready for [`build_nocloud_iso`]. `Debug` redacts the user- and
/// vendor-data (bootstrap secrets); meta-data and network-config are shown.
#[derive(Clone, PartialEq, Eq, Default)]
pub struct NoCloudFiles {
    /// `user-data`: the bootstrap data.
    pub user_data: Vec<u8>,
    /// `meta-data`.
    pub meta_data: Vec<u8>,
    /// `network-config`.
    pub network_config: Vec<u8>,
    /// `vendor-data`, written only when present.
    pub vendor_data: Option<Vec<u8>>,
}

impl std::fmt::Debug for NoCloudFiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NoCloudFiles")
            .field("user_data", &Redacted(self.user_data.len()))
            .field("meta_data", &String::from_utf8_lossy(&self.meta_data))
            .field(
                "network_config",
                &String::from_utf8_lossy(&self.network_config),
            )
            .field(
                "vendor_data",
                &self.vendor_data.as_ref().map(|v| Redacted(v.len())),
            )
            .finish()
    }
}

/// The provider ID of a VM, `proxmox://<SMBIOS uuid>`, as CAPI and the cloud provider expect it.
pub fn provider_id(instance_id: &str) -> String {
    format!("proxmox://{instance_id}")
}

#[derive(Serialize)]
struct MetaDataDoc<'a> {
    #[serde(rename = "instance-id")]
    instance_id: &'a str,
    #[serde(rename = "local-hostname")]
    local_hostname: &'a str,
    hostname: &'a str,
    #[serde(rename = "provider-id", skip_serializing_if = "Option::is_none")]
    provider_id: Option<&'a str>,
    #[serde(rename = "kubernetes-version", skip_serializing_if = "Option::is_none")]
    kubernetes_version: Option<&'a str>,
}

/// Renders `meta-data` with the Go provider's keys and order.
pub fn render_meta_data(meta: &MetaData) -> Result<String, CloudInitError> {
    if meta.hostname.trim().is_empty() {
        return Err(CloudInitError::MissingHostname);
    }
    if meta.instance_id.trim().is_empty() {
        return Err(CloudInitError::MissingInstanceId);
    }
    let doc = MetaDataDoc {
        instance_id: &meta.instance_id,
        local_hostname: &meta.hostname,
        hostname: &meta.hostname,
        provider_id: non_empty(&meta.provider_id),
        kubernetes_version: non_empty(&meta.kubernetes_version),
    };
    yaml::to_string(&doc).map_err(CloudInitError::Yaml)
}

fn non_empty(s: &Option<String>) -> Option<&str> {
    s.as_deref().filter(|v| !v.trim().is_empty())
}

/// Renders all NoCloud files for a machine: NIC settings come from `placement`, addresses and
/// MACs from `assigned` (one entry per NIC, by `netN` name). Cloud-config bootstrap data is the
/// `user-data` unchanged, with a netplan `network-config`; Ignition bootstrap data is checked
/// first and becomes `user-data` with the hostname, instance id and networkd units merged in.
pub fn render_nocloud(
    placement: &Placement,
    meta: &MetaData,
    assigned: &[NicAddresses],
    bootstrap: &BootstrapData,
) -> Result<NoCloudFiles, CloudInitError> {
    match bootstrap.format {
        BootstrapFormat::CloudConfig => {
            let meta_data = render_meta_data(meta)?;
            let network_config =
                render_network_config(placement.network_devices(), placement.vrfs(), assigned)?;
            Ok(NoCloudFiles {
                user_data: bootstrap.value.clone(),
                meta_data: meta_data.into_bytes(),
                network_config: network_config.into_bytes(),
                vendor_data: None,
            })
        }
        BootstrapFormat::Ignition => {
            let config = ignition::parse(&bootstrap.value)?;
            let meta_data = render_meta_data(meta)?;
            let plan =
                network::plan_network(placement.network_devices(), placement.vrfs(), assigned)?;
            let additions = ignition::Additions {
                hostname: meta.hostname.clone(),
                instance_id: meta.instance_id.clone(),
                private_ipv4: default_address(assigned, false),
                private_ipv6: default_address(assigned, true),
                units: networkd::render_units(&plan),
            };
            Ok(NoCloudFiles {
                user_data: config.merge(&additions),
                meta_data: meta_data.into_bytes(),
                network_config: ignition::EMPTY_NETWORK_CONFIG.as_bytes().to_vec(),
                vendor_data: None,
            })
        }
    }
}

/// The first address of the family from a default pool, as `addr/prefix`.
fn default_address(assigned: &[NicAddresses], v6: bool) -> Option<String> {
    assigned
        .iter()
        .flat_map(|nic| &nic.addresses)
        .find(|a| a.default_route && a.address.is_ipv6() == v6)
        .map(|a| format!("{}/{}", a.address, a.prefix))
}

/// File name of a VM's seed image on the Proxmox ISO storage, as the Go provider names it
/// (`user-data-<vmid>.iso`), so capmox finds and replaces images of adopted machines.
pub fn seed_iso_name(vmid: u32) -> String {
    format!("user-data-{vmid}.iso")
}

/// Builds the NoCloud seed image: ISO9660 with Joliet and Rock Ridge names, volume id `cidata`,
/// byte-for-byte the same for the same files.
pub fn build_nocloud_iso(files: &NoCloudFiles) -> Vec<u8> {
    let mut entries: Vec<(&str, &[u8])> = vec![
        ("user-data", &files.user_data),
        ("meta-data", &files.meta_data),
        ("network-config", &files.network_config),
    ];
    if let Some(v) = &files.vendor_data {
        entries.push(("vendor-data", v));
    }
    iso::build_iso(iso::NOCLOUD_VOLUME_ID, &entries)
}
