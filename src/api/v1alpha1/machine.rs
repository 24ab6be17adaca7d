//! `ProxmoxMachine` and `ProxmoxMachineTemplate` in v1alpha1: a `default` NIC plus additional
//! ones with one pool reference per family, a clone `target`, and a Cluster API v1beta1 status.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{Condition, ObjectMeta};
use crate::api::common::{NET_NAME_PATTERN, TAG_PATTERN};
use crate::api::names::{
    BRIDGE_MAX_LEN, BRIDGE_PATTERN, DESCRIPTION_MAX_LEN, DESCRIPTION_PATTERN, DISK_MAX_LEN,
    DISK_PATTERN, INTERFACE_MAX_LEN, INTERFACE_PATTERN, NODE_MAX_LEN, NODE_PATTERN, POOL_MAX_LEN,
    POOL_PATTERN, SNAPSHOT_MAX_LEN, SNAPSHOT_PATTERN, STORAGE_MAX_LEN, STORAGE_PATTERN,
};
use crate::api::{
    MachineAddress, NetworkModel, ProxmoxMachineChecks, TargetFileStorageFormat, TemplateSelector,
    TypedLocalObjectReference, VmIdRange,
};

/// One Proxmox VM of a CAPI Machine, as v1alpha1 described it.
// kube's `printcolumn(...)` repeats `type_` by design; clippy mistakes that for a duplicate.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "infrastructure.cluster.x-k8s.io",
    version = "v1alpha1",
    kind = "ProxmoxMachine",
    doc = "One Proxmox VM of a CAPI Machine (deprecated version; stored as v1alpha2).",
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
        description = "Machine ready status",
        json_path = ".status.ready"
    ),
    printcolumn(
        name = "Node",
        type_ = "string",
        description = "Proxmox node the VM runs on",
        json_path = ".status.proxmoxNode"
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
    )
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "[has(self.sourceNode), has(self.templateSelector)].exists_one(c, c)",
     "message": "must define either SourceNode with TemplateID, OR TemplateSelector"},
    {"rule": "[has(self.templateID), has(self.templateSelector)].exists_one(c, c)",
     "message": "must define either SourceNode with TemplateID, OR TemplateSelector."},
    {"rule": "self.full || !has(self.format)", "message": "Must set full=true when specifying format"},
    {"rule": "self.full || !has(self.storage)", "message": "Must set full=true when specifying storage"}
]))]
pub struct ProxmoxMachineSpec {
    /// Node that holds the template named by `templateID`.
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
    /// Description of the VM in Proxmox, without control characters but tab and newline.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = DESCRIPTION_MAX_LEN), pattern(DESCRIPTION_PATTERN))]
    pub description: Option<String>,
    /// Disk format of a full clone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format: Option<TargetFileStorageFormat>,
    /// Full clone or linked clone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = true))]
    pub full: Option<bool>,
    /// Proxmox resource pool the VM is added to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = POOL_MAX_LEN), pattern(POOL_PATTERN))]
    pub pool: Option<String>,
    /// Snapshot of the template to clone from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = SNAPSHOT_MAX_LEN), pattern(SNAPSHOT_PATTERN))]
    pub snap_name: Option<String>,
    /// Target storage of a full clone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = STORAGE_MAX_LEN), pattern(STORAGE_PATTERN))]
    pub storage: Option<String>,
    /// Node to clone to; v1alpha2 expresses it as `allowedNodes: [target]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = NODE_MAX_LEN), pattern(NODE_PATTERN))]
    pub target: Option<String>,
    /// Disks of the VM.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disks: Option<Storage>,
    /// Network devices and VRFs of the VM.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<NetworkSpec>,
    /// CPU sockets.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub num_sockets: Option<i32>,
    /// Cores per socket.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub num_cores: Option<i32>,
    /// Memory in MiB, a multiple of 8.
    #[serde(default, rename = "memoryMiB", skip_serializing_if = "Option::is_none")]
    #[schemars(extend("multipleOf" = 8))]
    pub memory_mib: Option<i32>,
    /// `proxmox://<SMBIOS uuid>`, written by the controller.
    #[serde(
        default,
        rename = "providerID",
        skip_serializing_if = "Option::is_none"
    )]
    pub provider_id: Option<String>,
    /// VMID of the machine's VM, written by the controller.
    #[serde(
        default,
        rename = "virtualMachineID",
        skip_serializing_if = "Option::is_none"
    )]
    pub virtual_machine_id: Option<i64>,
    /// Range to pick the VMID from.
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
    /// Proxmox nodes this machine may run on.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(inner(length(max = NODE_MAX_LEN), pattern(NODE_PATTERN)))]
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

/// Disks of the VM.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Storage {
    /// Boot disk, grown to `sizeGb` after cloning.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("x-kubernetes-validations" = [
        {"rule": "self == oldSelf", "message": "Value is immutable"}
    ]))]
    pub boot_volume: Option<DiskSize>,
}

/// Size of one disk.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DiskSize {
    /// Proxmox disk slot, e.g. `scsi0`.
    #[schemars(length(max = DISK_MAX_LEN), pattern(DISK_PATTERN))]
    pub disk: String,
    /// Size in GB.
    #[schemars(range(min = 5))]
    pub size_gb: i32,
}

/// Extra cloud-init meta-data.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MetadataSettings {
    /// Put `provider-id` into the meta-data.
    #[serde(
        default,
        rename = "providerIDInjection",
        skip_serializing_if = "Option::is_none"
    )]
    pub provider_id_injection: Option<bool>,
}

/// NICs and VRFs of a v1alpha1 machine.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NetworkSpec {
    /// The first NIC (`net0`), which gets the cluster's pools.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default: Option<NetworkDevice>,
    /// Further NICs, each with its own pools.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend(
        "x-kubernetes-list-type" = "map",
        "x-kubernetes-list-map-keys" = ["name"]
    ))]
    pub additional_devices: Vec<AdditionalNetworkDevice>,
    /// VRF devices in the guest.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend(
        "x-kubernetes-list-type" = "map",
        "x-kubernetes-list-map-keys" = ["name"]
    ))]
    pub vrfs: Vec<VrfDevice>,
}

/// The default NIC.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NetworkDevice {
    /// Proxmox bridge, e.g. `vmbr0`.
    #[schemars(length(min = 1, max = BRIDGE_MAX_LEN), pattern(BRIDGE_PATTERN))]
    pub bridge: String,
    /// Emulated NIC model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = "virtio"))]
    pub model: Option<NetworkModel>,
    /// MTU of the Proxmox NIC; 1 inherits the bridge's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("x-kubernetes-validations" = [
        {"rule": "self == 1 || ( self >= 576 && self <= 65520)", "message": "invalid MTU value"}
    ]))]
    pub mtu: Option<i32>,
    /// VLAN tag.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 4094))]
    pub vlan: Option<i32>,
    /// DNS servers of this NIC.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1))]
    pub dns_servers: Option<Vec<String>>,
    /// IPv4 pool of this NIC.
    #[serde(
        default,
        rename = "ipv4PoolRef",
        skip_serializing_if = "Option::is_none"
    )]
    pub ipv4_pool_ref: Option<TypedLocalObjectReference>,
    /// IPv6 pool of this NIC.
    #[serde(
        default,
        rename = "ipv6PoolRef",
        skip_serializing_if = "Option::is_none"
    )]
    pub ipv6_pool_ref: Option<TypedLocalObjectReference>,
}

/// A further NIC with its guest-side routing.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "has(self.ipv4PoolRef) || has(self.ipv6PoolRef)",
     "message": "at least one pool reference must be set, either ipv4PoolRef or ipv6PoolRef"}
]))]
pub struct AdditionalNetworkDevice {
    /// Proxmox NIC name (`net1`, ...).
    #[schemars(
        length(min = 1),
        pattern(NET_NAME_PATTERN),
        extend("x-kubernetes-validations" = [
            {"rule": "self != 'net0'", "message": "additional network devices doesn't allow net0"}
        ])
    )]
    pub name: String,
    /// Proxmox bridge, e.g. `vmbr0`.
    #[schemars(length(min = 1, max = BRIDGE_MAX_LEN), pattern(BRIDGE_PATTERN))]
    pub bridge: String,
    /// Emulated NIC model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = "virtio"))]
    pub model: Option<NetworkModel>,
    /// MTU of the Proxmox NIC; 1 inherits the bridge's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("x-kubernetes-validations" = [
        {"rule": "self == 1 || ( self >= 576 && self <= 65520)", "message": "invalid MTU value"}
    ]))]
    pub mtu: Option<i32>,
    /// VLAN tag.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 4094))]
    pub vlan: Option<i32>,
    /// DNS servers of this NIC.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1))]
    pub dns_servers: Option<Vec<String>>,
    /// IPv4 pool of this NIC.
    #[serde(
        default,
        rename = "ipv4PoolRef",
        skip_serializing_if = "Option::is_none"
    )]
    pub ipv4_pool_ref: Option<TypedLocalObjectReference>,
    /// IPv6 pool of this NIC.
    #[serde(
        default,
        rename = "ipv6PoolRef",
        skip_serializing_if = "Option::is_none"
    )]
    pub ipv6_pool_ref: Option<TypedLocalObjectReference>,
    /// Static routes via this NIC.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1))]
    pub routes: Option<Vec<RouteSpec>>,
    /// Policy routing rules for this NIC.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1))]
    pub routing_policy: Option<Vec<RoutingPolicySpec>>,
    /// Guest-side MTU of the link.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("x-kubernetes-validations" = [
        {"rule": "self == 1 || ( self >= 576 && self <= 65520)", "message": "invalid MTU value"}
    ]))]
    pub link_mtu: Option<i32>,
}

/// A static route.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RouteSpec {
    /// Destination.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to: Option<String>,
    /// Next hop.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub via: Option<String>,
    /// Route metric.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metric: Option<i32>,
    /// Routing table.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub table: Option<i32>,
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
    /// Rule priority.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        range(max = 4_294_967_295_i64),
        extend("format" = "int32", "x-kubernetes-validations" = [
            {"rule": "(self > 0 && self < 32765) || (self > 32766)", "message": "Cowardly refusing to insert FIB rule matching kernel rules"}
        ])
    )]
    pub priority: Option<i64>,
}

/// A VRF device in the guest.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VrfDevice {
    /// Name of the VRF device: a Linux interface name.
    #[schemars(length(min = 3, max = INTERFACE_MAX_LEN), pattern(INTERFACE_PATTERN))]
    pub name: String,
    /// Routing table of the VRF.
    #[schemars(
        range(max = 4_294_967_295_i64),
        extend("format" = "int32", "x-kubernetes-validations" = [
            {"rule": "(self > 0 && self < 254) || (self > 255)", "message": "Cowardly refusing to insert l3mdev rules into kernel tables"}
        ])
    )]
    pub table: i64,
    /// NICs enslaved to the VRF.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(inner(pattern(NET_NAME_PATTERN)))]
    pub interfaces: Vec<String>,
    /// Static routes in the VRF.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1))]
    pub routes: Option<Vec<RouteSpec>>,
    /// Policy routing rules in the VRF.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1))]
    pub routing_policy: Option<Vec<RoutingPolicySpec>>,
}

/// Observed state of the machine's VM, v1alpha1 shape.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ProxmoxMachineStatus {
    /// Whether the VM is provisioned.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready: Option<bool>,
    /// Hostname and IP addresses.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub addresses: Vec<MachineAddress>,
    /// Coarse VM state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vm_status: Option<String>,
    /// Whether the bootstrap data was handed to the VM.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bootstrap_data_provided: Option<bool>,
    /// The first static IPv4 and IPv6 address per NIC.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub ip_addresses: BTreeMap<String, IpAddress>,
    /// NICs as the guest agent reports them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub network: Vec<NetworkStatus>,
    /// Proxmox node the VM runs on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proxmox_node: Option<String>,
    /// UPID of the Proxmox task in flight.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_ref: Option<String>,
    /// Do not retry before this time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after: Option<Time>,
    /// Terminal problem, machine-readable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_reason: Option<String>,
    /// Terminal problem, human-readable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_message: Option<String>,
    /// Cluster API v1beta1 conditions.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

/// One IPv4 and one IPv6 address.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct IpAddress {
    /// IPv4 address.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ipv4: Option<String>,
    /// IPv6 address.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ipv6: Option<String>,
}

/// A NIC as seen by the guest.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NetworkStatus {
    /// Whether the NIC is connected.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub connected: Option<bool>,
    /// Addresses on the NIC.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ip_addrs: Vec<String>,
    /// MAC address.
    pub mac_addr: String,
    /// Proxmox NIC name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network_name: Option<String>,
}

/// Blueprint of ProxmoxMachines, v1alpha1.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "infrastructure.cluster.x-k8s.io",
    version = "v1alpha1",
    kind = "ProxmoxMachineTemplate",
    doc = "Blueprint of ProxmoxMachines (deprecated version; stored as v1alpha2).",
    namespaced,
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
    pub metadata: Option<ObjectMeta>,
    /// Spec of the created ProxmoxMachines.
    pub spec: ProxmoxMachineSpec,
}
