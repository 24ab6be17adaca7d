//! `ProxmoxMachine` and `ProxmoxMachineTemplate` (v1alpha2).
//!
//! There is deliberately no `spec.failureDomain`: CAPI core still reads that deprecated field and
//! would overwrite the Machine's choice with it. The machine's zone comes from the owning
//! `Machine.spec.failureDomain`; where the VM really landed is reported in `status.failureDomain`.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::common::{
    Initialization, NET_NAME_PATTERN, TAG_PATTERN, TemplateObjectMeta, TypedLocalObjectReference,
    ZONE_PATTERN, conditions_schema,
};
use super::names::{
    BRIDGE_MAX_LEN, BRIDGE_PATTERN, DESCRIPTION_MAX_LEN, DESCRIPTION_PATTERN, DISK_MAX_LEN,
    DISK_PATTERN, INTERFACE_MAX_LEN, INTERFACE_PATTERN, MAPPING_MAX_LEN, MAPPING_PATTERN,
    NODE_MAX_LEN, NODE_PATTERN, PCI_ADDRESS_MAX_LEN, POOL_MAX_LEN, POOL_PATTERN, SNAPSHOT_MAX_LEN,
    SNAPSHOT_PATTERN, STORAGE_MAX_LEN, STORAGE_PATTERN,
};
use super::template_status::ProxmoxMachineTemplateStatus;

/// `spec.tags` may neither change, appear nor disappear once the machine exists (the Go
/// provider's webhook refused it too). A transition rule on the spec, not on `tags`, so that it
/// also sees tags being added or removed; its cost is one list comparison.
pub(crate) const TAGS_IMMUTABLE_RULE: &str =
    "has(self.tags) == has(oldSelf.tags) && (!has(self.tags) || self.tags == oldSelf.tags)";

/// A DHCP address is only known through the guest agent, so a machine that skips the agent cannot
/// use DHCP.
pub(crate) const DHCP_NEEDS_AGENT_RULE: &str = "!(has(self.checks) && has(self.checks.skipQemuGuestAgent) && self.checks.skipQemuGuestAgent) || !self.network.networkDevices.exists(d, (has(d.dhcp4) && d.dhcp4) || (has(d.dhcp6) && d.dhcp6))";

/// NIC names are `net0`, `net1`, ... without gaps (the Go provider's webhook checked it by sorting
/// names as strings, which refused 11 NICs or more; this compares numbers). Names are unique
/// (the list is a map keyed by name), so all of them below the count means exactly
/// `net0`..`net<count-1>`. `matches` first keeps `substring` and `int` from failing on a name
/// the pattern refuses anyway; its cost is bounded by `maxItems` and the name's `maxLength`.
pub(crate) const NIC_NAMES_CONSECUTIVE_RULE: &str =
    "self.all(d, d.name.matches('^net(0|[1-9][0-9]?)$') && int(d.name.substring(3)) < self.size())";

/// At most one NIC takes the default IPv4 pool (and the default route with it).
pub(crate) const ONE_DEFAULT_IPV4_RULE: &str =
    "self.filter(d, has(d.defaultIPv4) && d.defaultIPv4).size() <= 1";

/// At most one NIC takes the default IPv6 pool.
pub(crate) const ONE_DEFAULT_IPV6_RULE: &str =
    "self.filter(d, has(d.defaultIPv6) && d.defaultIPv6).size() <= 1";

/// The Proxmox-side MTU: 1 (the bridge's) or an MTU IPv6 works with.
pub(crate) const NIC_MTU_RULE: &str = "self == 1 || self >= 1280";

/// The guest-side MTU: one IPv6 works with.
pub(crate) const LINK_MTU_RULE: &str = "self >= 1280";

/// The rules capmox adds on ProxmoxMachines (checks of the Go provider's ProxmoxMachine webhook)
/// that a ProxmoxMachineTemplate does not get: the Go provider never checked templates so, and
/// ClusterClass base templates are completed by patches (see `crate::api::crd`).
pub(crate) const MACHINE_ONLY_RULES: &[&str] = &[
    TAGS_IMMUTABLE_RULE,
    NIC_NAMES_CONSECUTIVE_RULE,
    ONE_DEFAULT_IPV4_RULE,
    ONE_DEFAULT_IPV6_RULE,
    NIC_MTU_RULE,
    LINK_MTU_RULE,
];

/// Proxmox numbers a VM's NICs `net0` to `net31`.
pub const MAX_NETWORK_DEVICES: usize = 32;

/// Desired VM of one machine: where its template comes from, its size, disks and networks.
// kube's `printcolumn(...)` repeats `type_` by design; clippy mistakes that for a duplicate.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "infrastructure.cluster.x-k8s.io",
    version = "v1alpha2",
    kind = "ProxmoxMachine",
    doc = "One Proxmox VM of a CAPI Machine: its template, size, disks, networks and placement.",
    namespaced,
    status = "ProxmoxMachineStatus",
    shortname = "moxm",
    category = "cluster-api",
    category = "proxmox",
    label("cluster.x-k8s.io/v1beta2", "v1alpha2"),
    printcolumn(
        name = "Cluster",
        type_ = "string",
        description = "Cluster to which this ProxmoxMachine belongs",
        json_path = ".metadata.labels['cluster\\.x-k8s\\.io/cluster-name']"
    ),
    printcolumn(
        name = "Ready",
        type_ = "string",
        description = "Infrastructure is provisioned",
        json_path = ".status.initialization.provisioned"
    ),
    printcolumn(
        name = "Node",
        type_ = "string",
        description = "Proxmox node the VM runs on",
        json_path = ".status.proxmoxNode"
    ),
    printcolumn(
        name = "Failure Domain",
        type_ = "string",
        description = "Zone the VM was placed in",
        json_path = ".status.failureDomain"
    ),
    printcolumn(
        name = "Provider ID",
        type_ = "string",
        description = "Provider ID of the VM",
        json_path = ".spec.providerID"
    ),
    printcolumn(
        name = "Machine",
        type_ = "string",
        description = "Machine that owns this ProxmoxMachine",
        json_path = ".metadata.ownerReferences[?(@.kind==\"Machine\")].name"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "[has(self.sourceNode), has(self.templateSelector)].exists_one(c, c)",
     "message": "must define either a SourceNode with a TemplateID or a TemplateSelector"},
    {"rule": "[has(self.templateID), has(self.templateSelector)].exists_one(c, c)",
     "message": "must define either a SourceNode with a TemplateID or a TemplateSelector"},
    {"rule": "self.full || !has(self.format)", "message": "Must set full=true when specifying format"},
    {"rule": "self.full || !has(self.storage)", "message": "Must set full=true when specifying storage"},
    {"rule": "has(self.templateSelector) || (has(self.templateID) && has(self.sourceNode))",
     "message": "Must specify either templateID or templateSelector"},
    {"rule": "!has(self.tpm) || !self.tpm || (has(self.bios) && self.bios == 'ovmf')",
     "message": "tpm needs bios: ovmf (a TPM state lives with UEFI firmware)"},
    {"rule": "!has(self.secureBoot) || !self.secureBoot || (has(self.bios) && self.bios == 'ovmf')",
     "message": "secureBoot needs bios: ovmf"},
    {"rule": DHCP_NEEDS_AGENT_RULE,
     "message": "dhcp4/dhcp6 need the QEMU guest agent: capmox learns a DHCP address from it; do not set checks.skipQemuGuestAgent"},
    {"rule": TAGS_IMMUTABLE_RULE,
     "message": "tags are immutable: Proxmox tags the VM once, when it is created; create a new ProxmoxMachine (e.g. through a new ProxmoxMachineTemplate) to change them"}
]))]
pub struct ProxmoxMachineSpec {
    /// Node that holds the template named by `templateID`: the node's name as Proxmox shows it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = NODE_MAX_LEN), pattern(NODE_PATTERN))]
    pub source_node: Option<String>,
    /// VMID of the template to clone.
    #[serde(
        default,
        rename = "templateID",
        skip_serializing_if = "Option::is_none"
    )]
    pub template_id: Option<i32>,
    /// Select the template by its Proxmox tags instead of by VMID.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template_selector: Option<TemplateSelector>,
    /// Description of the VM in Proxmox: free text without control characters other than tab
    /// and newline.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = DESCRIPTION_MAX_LEN), pattern(DESCRIPTION_PATTERN))]
    pub description: Option<String>,
    /// Disk format of a full clone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format: Option<TargetFileStorageFormat>,
    /// Full clone (independent disks) or linked clone (shares the template's base image).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = true))]
    pub full: Option<bool>,
    /// Proxmox resource pool the VM is added to (`parent/child` for a nested pool).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = POOL_MAX_LEN), pattern(POOL_PATTERN))]
    pub pool: Option<String>,
    /// Snapshot of the template to clone from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = SNAPSHOT_MAX_LEN), pattern(SNAPSHOT_PATTERN))]
    pub snap_name: Option<String>,
    /// Target storage of a full clone: the storage id as Proxmox shows it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = STORAGE_MAX_LEN), pattern(STORAGE_PATTERN))]
    pub storage: Option<String>,
    /// `proxmox://<SMBIOS uuid>`; written by the controller once the VM exists.
    #[serde(
        default,
        rename = "providerID",
        skip_serializing_if = "Option::is_none"
    )]
    #[schemars(
        length(min = 46, max = 46),
        regex(
            pattern = r"^proxmox://[a-fA-F0-9]{8}-[a-fA-F0-9]{4}-[a-fA-F0-9]{4}-[a-fA-F0-9]{4}-[a-fA-F0-9]{12}$"
        )
    )]
    pub provider_id: Option<String>,
    /// VMID of the machine's VM, written by the controller as soon as it is chosen (before the
    /// clone request), as the Go provider does: unlike status, the spec survives
    /// `clusterctl move` and restores, so the VM is found again instead of cloned twice.
    #[serde(
        default,
        rename = "virtualMachineID",
        skip_serializing_if = "Option::is_none"
    )]
    pub virtual_machine_id: Option<i64>,
    /// CPU sockets; the template's when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub num_sockets: Option<i32>,
    /// Cores per socket; the template's when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub num_cores: Option<i32>,
    /// Memory in MiB, a multiple of 8; the template's when unset.
    #[serde(default, rename = "memoryMiB", skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0), extend("multipleOf" = 8))]
    pub memory_mib: Option<i32>,
    /// CPU model and flags; the template's when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu: Option<CpuSpec>,
    /// NUMA on or off; the template's when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub numa: Option<bool>,
    /// Firmware; the template's when unset. `ovmf` (UEFI) gives the VM an EFI disk (`efidisk0`)
    /// on the boot disk's storage unless it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bios: Option<Bios>,
    /// With `bios: ovmf`: the EFI disk capmox adds has the distribution keys enrolled, so
    /// Secure Boot is on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secure_boot: Option<bool>,
    /// With `bios: ovmf`: a virtual TPM 2.0 (`tpmstate0`) on the boot disk's storage.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tpm: Option<bool>,
    /// PCI devices passed through to the VM (`hostpci0`, `hostpci1`, ... in order), each a free
    /// device of a Proxmox resource mapping on the VM's node; the scheduler counts them per node.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(
        length(max = MAX_PCI_DEVICES),
        extend(
            "x-kubernetes-list-type" = "atomic",
            "x-kubernetes-validations" = [
                {"rule": "self == oldSelf", "message": "pciDevices are immutable: capmox places the machine by them when it is created; create a new ProxmoxMachine (e.g. through a new ProxmoxMachineTemplate) to change them"},
                {"rule": "self.filter(d, has(d.primaryGPU) && d.primaryGPU).size() <= 1", "message": "at most one PCI device may be the primary GPU"}
            ]
        )
    )]
    pub pci_devices: Vec<PciDevice>,
    /// Disks of the VM.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disks: Option<Storage>,
    /// Network devices and VRFs of the VM.
    pub network: NetworkSpec,
    /// Range to pick the VMID from; Proxmox's next free ID when unset.
    #[serde(default, rename = "vmIDRange", skip_serializing_if = "Option::is_none")]
    #[schemars(extend("x-kubernetes-validations" = [
        {"rule": "self.end >= self.start", "message": "end should be greater than or equal to start"}
    ]))]
    pub vm_id_range: Option<VmIdRange>,
    /// Readiness checks to skip.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checks: Option<ProxmoxMachineChecks>,
    /// What to add to the cloud-init meta-data.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata_settings: Option<MetadataSettings>,
    /// Proxmox nodes this machine may run on; overrides the cluster's when non-empty.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(
        inner(length(max = NODE_MAX_LEN), pattern(NODE_PATTERN)),
        extend("x-kubernetes-list-type" = "set")
    )]
    pub allowed_nodes: Vec<String>,
    /// Extra Proxmox tags for the VM.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 1),
        inner(pattern(TAG_PATTERN)),
        extend("x-kubernetes-list-type" = "set")
    )]
    pub tags: Option<Vec<String>>,
}

/// The CPU Proxmox gives the VM.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CpuSpec {
    /// CPU model (`host`, `x86-64-v2-AES`, `custom-<name>`, ...); Proxmox's default when unset.
    #[serde(default, rename = "type", skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = CPU_TYPE_MAX_LEN), pattern(CPU_TYPE_PATTERN))]
    pub type_: Option<String>,
    /// Flags to turn on (`+aes`) or off (`-pcid`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(
        length(max = 32),
        inner(pattern(CPU_FLAG_PATTERN)),
        extend("x-kubernetes-list-type" = "set")
    )]
    pub flags: Vec<String>,
}

/// A Proxmox CPU model name.
pub const CPU_TYPE_PATTERN: &str = r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$";
/// Longest CPU model name.
pub const CPU_TYPE_MAX_LEN: u32 = 64;
/// A CPU flag turned on or off.
pub const CPU_FLAG_PATTERN: &str = r"^[+-][A-Za-z0-9_.\-]+$";

/// VM firmware.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Bios {
    /// Legacy BIOS.
    Seabios,
    /// UEFI.
    Ovmf,
}

/// Disk format of a full clone.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum TargetFileStorageFormat {
    /// Raw disk image.
    Raw,
    /// QEMU copy-on-write image.
    Qcow2,
    /// VMware disk image.
    Vmdk,
}

/// Template lookup by Proxmox tags.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TemplateSelector {
    /// Tags the template must carry (compared case-insensitively).
    #[schemars(
        length(min = 1),
        inner(pattern(TAG_PATTERN)),
        extend("x-kubernetes-list-type" = "set")
    )]
    pub match_tags: Vec<String>,
    /// How the template's tags must relate to `matchTags`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = "exact"))]
    pub match_policy: Option<TemplateMatchPolicy>,
}

/// How template tags are matched.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum TemplateMatchPolicy {
    /// The template's tags equal `matchTags`.
    #[default]
    #[serde(rename = "exact")]
    Exact,
    /// `matchTags` is a subset of the template's tags, and exactly one template matches.
    #[serde(rename = "uniqueSubset")]
    UniqueSubset,
    /// `matchTags` is a subset of the template's tags; the template with the fewest extra tags wins.
    #[serde(rename = "bestSubset")]
    BestSubset,
}

/// PCI devices a machine may have (Proxmox's `hostpci0`-`hostpci15`).
pub const MAX_PCI_DEVICES: u32 = 16;

/// One PCI device passed through: a free device of a resource mapping on the VM's node.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "!has(self.hostAddress)",
     "message": "Proxmox lets only root@pam, not an API token, pass a raw host PCI address through; map the device in Proxmox (Datacenter → Resource Mappings → PCI Devices) and name the mapping instead"}
]))]
pub struct PciDevice {
    /// Proxmox PCI resource mapping (Datacenter → Resource Mappings) to take a free device of.
    #[schemars(length(min = 2, max = MAPPING_MAX_LEN), pattern(MAPPING_PATTERN))]
    pub mapping: String,
    /// Refused with a message: Proxmox takes raw host addresses from root@pam only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = PCI_ADDRESS_MAX_LEN))]
    pub host_address: Option<String>,
    /// Present the device on a PCI Express port (`pcie=1`); the VM gets the q35 machine type.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pcie: Option<bool>,
    /// Map the device's ROM into the guest (`rombar`); Proxmox's default (on) when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rombar: Option<bool>,
    /// The guest's primary display adapter (`x-vga=1`): the emulated VGA is turned off.
    #[serde(
        default,
        rename = "primaryGPU",
        skip_serializing_if = "Option::is_none"
    )]
    pub primary_gpu: Option<bool>,
}

/// Disks of the VM.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "!has(self.bootVolume) || !has(self.additionalVolumes) || self.additionalVolumes.all(v, v.disk != self.bootVolume.disk)",
     "message": "an additional volume cannot use the boot volume's disk slot"}
]))]
pub struct Storage {
    /// Boot disk, grown to `sizeGb` after cloning.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("x-kubernetes-validations" = [
        {"rule": "self == oldSelf", "message": "Value is immutable"}
    ]))]
    pub boot_volume: Option<DiskSize>,
    /// Data disks, made with the VM (in one config write) and deleted with it. A slot the
    /// template already has is taken as the volume and grown to `sizeGb` if smaller.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(
        length(max = MAX_ADDITIONAL_VOLUMES),
        extend(
            "x-kubernetes-list-type" = "map",
            "x-kubernetes-list-map-keys" = ["disk"],
            "x-kubernetes-validations" = [
                {"rule": "self == oldSelf", "message": "additionalVolumes are immutable: Proxmox gives the VM its disks when it is created; create a new ProxmoxMachine (e.g. through a new ProxmoxMachineTemplate) to change them"}
            ]
        )
    )]
    pub additional_volumes: Vec<AdditionalVolume>,
}

/// Data disks a machine may have besides its boot disk.
pub const MAX_ADDITIONAL_VOLUMES: u32 = 16;
/// Largest data disk in GB (128 TiB), far beyond what a storage offers a single VM disk.
pub const MAX_VOLUME_GB: i32 = 131_072;

/// One data disk of the VM.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "!has(self.ioThread) || !self.ioThread || self.disk.startsWith('scsi') || self.disk.startsWith('virtio')",
     "message": "ioThread works on scsi and virtio disks only"},
    {"rule": "!has(self.ssd) || !self.ssd || !self.disk.startsWith('virtio')",
     "message": "ssd emulation is not available on virtio disks"}
]))]
pub struct AdditionalVolume {
    /// Proxmox disk slot: `scsi0`-`scsi30`, `virtio0`-`virtio15`, `sata0`-`sata5` or `ide0`-`ide3`.
    #[schemars(length(min = 1, max = DISK_MAX_LEN), pattern(DISK_PATTERN))]
    pub disk: String,
    /// Size in GB (GiB, as Proxmox counts).
    #[schemars(range(min = 1, max = MAX_VOLUME_GB))]
    pub size_gb: i32,
    /// Proxmox storage of the disk; by default `spec.storage`, else the boot disk's storage.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = STORAGE_MAX_LEN), pattern(STORAGE_PATTERN))]
    pub storage: Option<String>,
    /// Image format on file-based storages (Proxmox's default when unset).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format: Option<TargetFileStorageFormat>,
    /// Passes TRIM/UNMAP to the storage (`discard=on`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub discard: Option<bool>,
    /// An I/O thread for the disk (scsi with VirtIO SCSI single, virtio).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub io_thread: Option<bool>,
    /// Presents the disk to the guest as a solid-state drive (not on virtio).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ssd: Option<bool>,
}

/// Size of one disk.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DiskSize {
    /// Proxmox disk slot: `scsi0`-`scsi30`, `virtio0`-`virtio15`, `sata0`-`sata5` or `ide0`-`ide3`.
    #[schemars(length(min = 1, max = DISK_MAX_LEN), pattern(DISK_PATTERN))]
    pub disk: String,
    /// Size in GB; disks only grow.
    #[schemars(range(min = 5))]
    pub size_gb: i32,
}

/// Inclusive VMID range.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VmIdRange {
    /// First VMID of the range.
    #[schemars(range(min = 100, max = 999_999_999))]
    pub start: i64,
    /// Last VMID of the range.
    #[schemars(range(min = 100, max = 999_999_999))]
    pub end: i64,
}

/// Readiness checks that can be skipped.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ProxmoxMachineChecks {
    /// Do not wait for cloud-init to report that it finished.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skip_cloud_init_status: Option<bool>,
    /// Do not wait for the QEMU guest agent (implies skipping the cloud-init check).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skip_qemu_guest_agent: Option<bool>,
}

/// Extra cloud-init meta-data.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MetadataSettings {
    /// Put `provider-id` into the meta-data so the kubelet can use it.
    #[serde(rename = "providerIDInjection")]
    pub provider_id_injection: bool,
}

/// Network devices and VRFs of a VM.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NetworkSpec {
    /// Network zone whose default pools apply; the Machine's failure domain takes precedence.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(pattern(ZONE_PATTERN))]
    pub zone: Option<String>,
    /// NICs of the VM, keyed by name: `net0`, `net1`, ... without gaps, at most 32 (as Proxmox allows).
    #[schemars(extend(
        "maxItems" = MAX_NETWORK_DEVICES,
        "x-kubernetes-list-type" = "map",
        "x-kubernetes-list-map-keys" = ["name"],
        "x-kubernetes-validations" = [
            {"rule": NIC_NAMES_CONSECUTIVE_RULE,
             "message": "network device names must be net0, net1, ... without gaps: with N devices, name them net0 to net<N-1>"},
            {"rule": ONE_DEFAULT_IPV4_RULE,
             "message": "at most one network device may set defaultIPv4: true"},
            {"rule": ONE_DEFAULT_IPV6_RULE,
             "message": "at most one network device may set defaultIPv6: true"}
        ]
    ))]
    pub network_devices: Vec<NetworkDevice>,
    /// Virtual routing and forwarding devices in the guest.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend(
        "x-kubernetes-list-type" = "map",
        "x-kubernetes-list-map-keys" = ["name"]
    ))]
    pub vrfs: Vec<VrfDevice>,
}

/// One NIC of the VM and its guest-side configuration.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "!(has(self.dhcp4) && self.dhcp4 && has(self.defaultIPv4) && self.defaultIPv4)",
     "message": "dhcp4 and defaultIPv4 exclude each other: a device takes its IPv4 address by DHCP or from the default pool"},
    {"rule": "!(has(self.dhcp6) && self.dhcp6 && has(self.defaultIPv6) && self.defaultIPv6)",
     "message": "dhcp6 and defaultIPv6 exclude each other: a device takes its IPv6 address by DHCP or from the default pool"},
    {"rule": "!((has(self.dhcp4) && self.dhcp4) || (has(self.dhcp6) && self.dhcp6)) || !has(self.ipPoolRef) || size(self.ipPoolRef) == 0",
     "message": "a device with dhcp4 or dhcp6 claims no pool addresses: remove ipPoolRef, or move the pools to another device"}
]))]
pub struct NetworkDevice {
    /// Proxmox NIC name, `net0` to `net31`.
    #[serde(default = "default_net_name")]
    #[schemars(
        length(min = 4, max = 5),
        pattern(NET_NAME_PATTERN),
        extend("default" = "net0")
    )]
    pub name: String,
    /// Proxmox bridge the NIC is attached to, e.g. `vmbr0`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = BRIDGE_MAX_LEN), pattern(BRIDGE_PATTERN))]
    pub bridge: Option<String>,
    /// Emulated NIC model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = "virtio"))]
    pub model: Option<NetworkModel>,
    /// MTU of the Proxmox NIC: 1 inherits the bridge's MTU, else at least 1280 (IPv6's minimum).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("x-kubernetes-validations" = [
        {"rule": "self == 1 || (self >= 576 && self <= 65520)", "message": "invalid MTU value"},
        {"rule": NIC_MTU_RULE,
         "message": "mtu must be 1 (inherit the bridge's MTU) or at least 1280 (below that IPv6 breaks)"}
    ]))]
    pub mtu: Option<i32>,
    /// VLAN tag of the NIC.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 4094))]
    pub vlan: Option<i32>,
    /// Number of packet queues (multiqueue virtio).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 65535))]
    pub queues: Option<i32>,
    /// Claim an address from the zone's (or cluster's) IPv4 pool for this NIC.
    #[serde(
        default,
        rename = "defaultIPv4",
        skip_serializing_if = "Option::is_none"
    )]
    pub default_ipv4: Option<bool>,
    /// Claim an address from the zone's (or cluster's) IPv6 pool for this NIC.
    #[serde(
        default,
        rename = "defaultIPv6",
        skip_serializing_if = "Option::is_none"
    )]
    pub default_ipv6: Option<bool>,
    /// Take the IPv4 address by DHCP instead of from a pool; the machine's address is the one
    /// the guest agent reports.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dhcp4: Option<bool>,
    /// Take the IPv6 address by DHCPv6 (or router advertisement) instead of from a pool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dhcp6: Option<bool>,
    /// Further pools to claim addresses from, in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "atomic"))]
    pub ip_pool_ref: Vec<TypedLocalObjectReference>,
    /// DNS servers for this NIC; the zone's or cluster's when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1), extend("x-kubernetes-list-type" = "set"))]
    pub dns_servers: Option<Vec<String>>,
    /// Static routes via this NIC.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1), extend("x-kubernetes-list-type" = "atomic"))]
    pub routes: Option<Vec<RouteSpec>>,
    /// Policy routing rules for this NIC.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1), extend("x-kubernetes-list-type" = "atomic"))]
    pub routing_policy: Option<Vec<RoutingPolicySpec>>,
    /// Guest-side MTU of the link, at least 1280 (IPv6's minimum).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("x-kubernetes-validations" = [
        {"rule": "self == 1 || (self >= 576 && self <= 65520)", "message": "invalid MTU value"},
        {"rule": LINK_MTU_RULE,
         "message": "linkMtu must be at least 1280 (below that IPv6 breaks); leave it unset to keep the guest's MTU"}
    ]))]
    pub link_mtu: Option<i32>,
}

fn default_net_name() -> String {
    "net0".to_owned()
}

/// Emulated NIC model.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum NetworkModel {
    /// Intel E1000.
    E1000,
    /// Paravirtualised virtio-net.
    #[default]
    Virtio,
    /// Realtek 8139.
    Rtl8139,
    /// VMware vmxnet3.
    Vmxnet3,
}

/// A static route.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RouteSpec {
    /// Destination: a CIDR, an IP, or `default`/`all`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to: Option<String>,
    /// Next hop.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub via: Option<String>,
    /// Route metric.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub metric: Option<i32>,
    /// Routing table.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub table: Option<i32>,
    /// Whether a `default`/`all` destination without `via` means IPv6.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub is6: Option<bool>,
}

/// A policy routing rule.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RoutingPolicySpec {
    /// Destination prefix.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to: Option<String>,
    /// Source prefix.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from: Option<String>,
    /// Routing table to look up.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub table: Option<i32>,
    /// Rule priority; the kernel's own priorities 0, 32765 and 32766 are refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        range(max = 4_294_967_295_i64),
        extend("x-kubernetes-validations" = [
            {"rule": "(self > 0 && self < 32765) || (self > 32766)", "message": "Cowardly refusing to insert FIB rule matching kernel rules"}
        ])
    )]
    pub priority: Option<i64>,
    /// Whether the rule is IPv6 when no prefix says so.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub is6: Option<bool>,
}

/// A VRF device in the guest.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VrfDevice {
    /// Name of the VRF device: a Linux interface name (letters, digits, `-`, `_`, `.`).
    #[schemars(length(min = 3, max = INTERFACE_MAX_LEN), pattern(INTERFACE_PATTERN))]
    pub name: String,
    /// Routing table of the VRF.
    #[schemars(
        range(min = 1, max = 4_294_967_295_i64),
        extend("format" = "int32", "x-kubernetes-validations" = [
            {"rule": "(self > 0 && self < 254) || (self > 255)", "message": "Cowardly refusing to insert l3mdev rules into kernel tables"}
        ])
    )]
    pub table: i64,
    /// NICs enslaved to the VRF.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(
        inner(length(min = 4), pattern(NET_NAME_PATTERN)),
        extend("x-kubernetes-list-type" = "atomic")
    )]
    pub interfaces: Vec<String>,
    /// Static routes in the VRF.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1), extend("x-kubernetes-list-type" = "atomic"))]
    pub routes: Option<Vec<RouteSpec>>,
    /// Policy routing rules in the VRF.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1), extend("x-kubernetes-list-type" = "atomic"))]
    pub routing_policy: Option<Vec<RoutingPolicySpec>>,
}

/// Observed state of the machine's VM.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ProxmoxMachineStatus {
    /// Conditions: `Ready`, `Paused`, `VirtualMachineProvisioned`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "conditions_schema")]
    pub conditions: Vec<Condition>,
    /// CAPI v1beta2 provisioning signal.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initialization: Option<Initialization>,
    /// Hostname and IP addresses, copied by CAPI to the Machine.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "atomic"))]
    pub addresses: Vec<MachineAddress>,
    /// Coarse VM state (`pending`, `ready`), kept for compatibility.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vm_status: Option<VirtualMachineState>,
    /// Whether the bootstrap data was handed to the VM.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bootstrap_data_provided: Option<bool>,
    /// Static addresses per NIC (`default` first).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend(
        "x-kubernetes-list-type" = "map",
        "x-kubernetes-list-map-keys" = ["net"]
    ))]
    pub ip_addresses: Vec<IpAddressesSpec>,
    /// NICs as the guest agent reports them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "atomic"))]
    pub network: Vec<NetworkStatus>,
    /// VMID of the machine's VM; recorded before the clone request so a crash never leaks a VM.
    #[serde(
        default,
        rename = "virtualMachineID",
        skip_serializing_if = "Option::is_none"
    )]
    pub virtual_machine_id: Option<i64>,
    /// Proxmox node the VM runs on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proxmox_node: Option<String>,
    /// The Proxmox API (`scheme://host:port`) the VM was created on: the machine finds and
    /// deletes its VM there only, whatever its zone's credentials say later.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proxmox_endpoint: Option<String>,
    /// Failure domain (zone) the VM was placed in; CAPI copies it to the Machine.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(pattern(ZONE_PATTERN))]
    pub failure_domain: Option<String>,
    /// UPID of the Proxmox task in flight (or of the failed one during its back-off), so a
    /// restarted controller waits for it instead of starting another.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_ref: Option<String>,
    /// What the task in `taskRef` does for the machine (capmox only), e.g. `resizing scsi0 of
    /// VM 101 to 20 GB`: named in conditions while it runs and when it fails.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_purpose: Option<String>,
    /// Do not retry before this time (back-off after a failed task).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after: Option<Time>,
    /// Consecutive failed Proxmox tasks (capmox only): each doubles the back-off before the
    /// next try, and the count survives controller restarts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub task_failures: Option<i32>,
}

/// Coarse VM state.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum VirtualMachineState {
    /// The VM does not exist.
    NotFound,
    /// The VM is being created or configured.
    Pending,
    /// The VM is running and configured.
    Ready,
}

/// An address of the machine, as CAPI's `MachineAddress`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MachineAddress {
    /// Kind of address.
    #[serde(rename = "type")]
    pub type_: MachineAddressType,
    /// The address.
    #[schemars(length(min = 1, max = 256))]
    pub address: String,
}

/// Kind of a machine address.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum MachineAddressType {
    /// The machine's hostname.
    Hostname,
    /// A publicly reachable IP.
    #[serde(rename = "ExternalIP")]
    ExternalIp,
    /// An IP reachable inside the cluster's network.
    #[serde(rename = "InternalIP")]
    InternalIp,
    /// A public DNS name.
    #[serde(rename = "ExternalDNS")]
    ExternalDns,
    /// An internal DNS name.
    #[serde(rename = "InternalDNS")]
    InternalDns,
}

/// Static addresses of one NIC.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct IpAddressesSpec {
    /// NIC name, or `default`.
    #[schemars(length(min = 4), regex(pattern = r"^(net[0-9]+|default)$"))]
    pub net: String,
    /// IPv4 addresses.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "set"))]
    pub ipv4: Vec<String>,
    /// IPv6 addresses.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "set"))]
    pub ipv6: Vec<String>,
}

/// A NIC as seen by the guest.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NetworkStatus {
    /// Whether the NIC is connected.
    pub connected: bool,
    /// Addresses on the NIC.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "set"))]
    pub ip_addrs: Vec<String>,
    /// MAC address.
    #[schemars(
        length(min = 17, max = 17),
        regex(pattern = r"^([0-9A-Fa-f]{2}[:]){5}([0-9A-Fa-f]{2})$")
    )]
    pub mac_addr: String,
    /// Proxmox NIC name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 4), pattern(NET_NAME_PATTERN))]
    pub network_name: Option<String>,
}

/// Blueprint of ProxmoxMachines, referenced by KubeadmControlPlane and MachineDeployments.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "infrastructure.cluster.x-k8s.io",
    version = "v1alpha2",
    kind = "ProxmoxMachineTemplate",
    doc = "Blueprint of ProxmoxMachines, referenced by KubeadmControlPlane and MachineDeployments.",
    namespaced,
    status = "ProxmoxMachineTemplateStatus",
    shortname = "pmt",
    category = "cluster-api",
    label("cluster.x-k8s.io/v1beta2", "v1alpha2")
)]
#[serde(rename_all = "camelCase")]
pub struct ProxmoxMachineTemplateSpec {
    /// The ProxmoxMachine to stamp out.
    pub template: ProxmoxMachineTemplateResource,
}

/// Metadata and spec of the ProxmoxMachines a template describes.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ProxmoxMachineTemplateResource {
    /// Labels and annotations of the created objects.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<TemplateObjectMeta>,
    /// Spec of the created ProxmoxMachines; without `providerID`, which each machine gets from
    /// the controller.
    pub spec: ProxmoxMachineSpec,
}

/// A template names no provider ID (the Go provider's webhook refused one on create; the
/// template's spec cannot change afterwards). `crate::api::crd` adds it to the template's
/// `spec.template.spec`, next to the rules of [`ProxmoxMachineSpec`] (a field-level `extend`
/// would replace those).
pub(crate) const TEMPLATE_WITHOUT_PROVIDER_ID_RULE: &str = "!has(self.providerID)";

/// The message of [`TEMPLATE_WITHOUT_PROVIDER_ID_RULE`].
pub(crate) const TEMPLATE_WITHOUT_PROVIDER_ID_MESSAGE: &str = "providerID cannot be set in templates: the controller writes each ProxmoxMachine's own; remove spec.template.spec.providerID";
