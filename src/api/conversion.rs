//! Conversion between the served versions (`v1alpha1`, the Go provider's deprecated spoke, and
//! `v1alpha2`, the hub and storage version), as the conversion webhook performs it.
//!
//! Each object's spec and status are converted field by field. What the other version cannot
//! express travels in the `cluster.x-k8s.io/conversion-data` annotation, as in Cluster API
//! providers: a v1alpha1 object carries its v1alpha2 form (so zones, failure domains and the
//! v1alpha2-only NIC settings survive a v1alpha1 client's update), and a v1alpha2 object whose
//! v1alpha1 form would not come back unchanged carries that form (so a v1alpha1 `cloneSpec`, a
//! condition's severity or a clone `target` survive being stored). A part that was not changed
//! since it was converted comes back exactly as it was; a changed part keeps the other version's
//! extra fields.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use super::v1alpha1 as spoke;
use super::{
    ApiEndpoint, DiskSize, Initialization, IpAddressesSpec, IpConfigSpec, MetadataSettings,
    NetworkDevice, NetworkSpec, NetworkStatus, NodeLocation, NodeLocations, ProxmoxClusterSpec,
    ProxmoxClusterStatus, ProxmoxClusterTemplateResource, ProxmoxClusterTemplateSpec,
    ProxmoxMachineSpec, ProxmoxMachineStatus, ProxmoxMachineTemplateResource,
    ProxmoxMachineTemplateSpec, ProxmoxMachineTemplateStatus, RouteSpec, RoutingPolicySpec,
    SchedulerHints, Storage, TemplateObjectMeta, TypedLocalObjectReference, VirtualMachineState,
    VrfDevice,
};

/// Annotation that carries what the object's version cannot express (Cluster API's key).
pub const CONVERSION_DATA: &str = "cluster.x-k8s.io/conversion-data";

/// Reason given to a v1alpha1 condition that had none (v1alpha2 requires one), as the Go
/// provider's conversion names it.
pub const CONVERTED_CONDITION_REASON: &str = "APIConversionReason";

/// Why an object could not be converted.
#[derive(Debug, thiserror::Error)]
pub enum ConversionError {
    /// The object or the requested version is not one capmox serves.
    #[error("cannot convert {kind} from {from} to {to}: capmox serves {group}/v1alpha1 and {group}/v1alpha2 only", group = super::GROUP)]
    Unsupported {
        /// Kind of the object.
        kind: String,
        /// `apiVersion` of the object.
        from: String,
        /// Requested `apiVersion`.
        to: String,
    },
    /// The object does not match its version's schema.
    #[error("{kind} {name} is not a valid {version} object: {source}")]
    Malformed {
        /// Kind of the object.
        kind: String,
        /// Name of the object.
        name: String,
        /// `apiVersion` of the object.
        version: String,
        /// What did not parse.
        source: serde_json::Error,
    },
}

/// Which way an object is converted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Direction {
    /// v1alpha1 to v1alpha2.
    Up,
    /// v1alpha2 to v1alpha1.
    Down,
}

/// Converts one object (any capmox kind, as JSON) to `desired_api_version`.
pub fn convert(mut object: Value, desired_api_version: &str) -> Result<Value, ConversionError> {
    let from = object["apiVersion"].as_str().unwrap_or_default().to_owned();
    let kind = object["kind"].as_str().unwrap_or_default().to_owned();
    if from == desired_api_version {
        return Ok(object);
    }
    let hub = format!("{}/{}", super::GROUP, super::VERSION);
    let old = format!("{}/{}", super::GROUP, spoke::VERSION);
    let unsupported = || ConversionError::Unsupported {
        kind: kind.clone(),
        from: from.clone(),
        to: desired_api_version.to_owned(),
    };
    let direction = if from == old && desired_api_version == hub {
        Direction::Up
    } else if from == hub && desired_api_version == old {
        Direction::Down
    } else {
        return Err(unsupported());
    };
    let stash = take_stash(&mut object, desired_api_version);
    let mut parts = Converted::default();
    match kind.as_str() {
        "ProxmoxCluster" => {
            parts.part::<ClusterSpec>(&mut object, "spec", stash.as_ref(), direction)?;
            parts.part::<ClusterStatus>(&mut object, "status", stash.as_ref(), direction)?;
        }
        "ProxmoxClusterTemplate" => {
            parts.part::<ClusterTemplate>(&mut object, "spec", stash.as_ref(), direction)?;
        }
        "ProxmoxMachine" => {
            parts.part::<MachineSpec>(&mut object, "spec", stash.as_ref(), direction)?;
            parts.part::<MachineStatus>(&mut object, "status", stash.as_ref(), direction)?;
        }
        "ProxmoxMachineTemplate" => {
            parts.part::<MachineTemplate>(&mut object, "spec", stash.as_ref(), direction)?;
            parts.hub_only_part::<MachineTemplateStatus>(
                &mut object,
                "status",
                stash.as_ref(),
                direction,
            )?;
        }
        _ => return Err(unsupported()),
    }
    object["apiVersion"] = Value::String(desired_api_version.to_owned());
    if parts.lossy {
        let mut data = Map::new();
        data.insert("apiVersion".to_owned(), Value::String(from));
        data.insert("kind".to_owned(), Value::String(kind));
        data.extend(parts.originals);
        set_annotation(&mut object, Value::Object(data).to_string());
    }
    Ok(object)
}

/// The parts converted so far: whether converting one back would change it, and their original
/// form for the annotation in that case.
#[derive(Default)]
struct Converted {
    lossy: bool,
    originals: Map<String, Value>,
}

impl Converted {
    /// Converts `object[key]` in place, if present.
    fn part<P: Part>(
        &mut self,
        object: &mut Value,
        key: &str,
        stash: Option<&Value>,
        direction: Direction,
    ) -> Result<(), ConversionError> {
        let Some(value) = object.get(key).filter(|v| !v.is_null()).cloned() else {
            return Ok(());
        };
        let earlier = stash.and_then(|s| s.get(key));
        let malformed = |source| ConversionError::Malformed {
            kind: object["kind"].as_str().unwrap_or_default().to_owned(),
            name: object["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
            version: object["apiVersion"].as_str().unwrap_or_default().to_owned(),
            source,
        };
        let (converted, lossless) = match direction {
            Direction::Up => convert_part(&value, earlier, P::up, P::down),
            Direction::Down => convert_part(&value, earlier, P::down, P::up),
        }
        .map_err(malformed)?;
        self.lossy |= !lossless;
        self.originals.insert(key.to_owned(), value);
        object[key] = converted;
        Ok(())
    }
}

impl Converted {
    /// Converts `object[key]`, a part only v1alpha2 has (its v1alpha1 form is empty): going
    /// down, the part is dropped from the object and always travels in the annotation (even an
    /// empty one, so it comes back as it was); going up, an object without it (v1alpha1 has no
    /// such field, so clients drop it) gets it back from the annotation.
    fn hub_only_part<P: Part>(
        &mut self,
        object: &mut Value,
        key: &str,
        stash: Option<&Value>,
        direction: Direction,
    ) -> Result<(), ConversionError> {
        let present = object.get(key).is_some_and(|v| !v.is_null());
        match direction {
            Direction::Down => {
                if !present {
                    return Ok(());
                }
                self.part::<P>(object, key, stash, direction)?;
                self.lossy = true;
                if let Some(fields) = object.as_object_mut() {
                    fields.remove(key);
                }
            }
            Direction::Up => {
                if stash.and_then(|s| s.get(key)).is_none() {
                    if present && let Some(fields) = object.as_object_mut() {
                        fields.remove(key);
                    }
                    return Ok(());
                }
                object[key] = Value::Object(Map::new());
                self.part::<P>(object, key, stash, direction)?;
            }
        }
        Ok(())
    }
}

/// Converts one part with `forward`, starting from `earlier` (its stashed form in the target
/// version) when converting that back gives exactly this part; reports whether `back` restores
/// the part unchanged.
fn convert_part<From, To>(
    value: &Value,
    earlier: Option<&Value>,
    forward: fn(&From, Option<&To>) -> To,
    back: fn(&To, Option<&From>) -> From,
) -> Result<(Value, bool), serde_json::Error>
where
    From: Serialize + DeserializeOwned + PartialEq,
    To: Serialize + DeserializeOwned + PartialEq,
{
    let source: From = serde_json::from_value(value.clone())?;
    // A stash that no longer parses (e.g. written by another provider) is ignored.
    let earlier: Option<To> = earlier.and_then(|e| serde_json::from_value(e.clone()).ok());
    let converted = match earlier {
        Some(earlier) if back(&earlier, None) == source => earlier,
        earlier => forward(&source, earlier.as_ref()),
    };
    let lossless = back(&converted, None) == source;
    Ok((serde_json::to_value(converted)?, lossless))
}

/// Removes the conversion annotation and returns its data if it describes the target version.
fn take_stash(object: &mut Value, target_api_version: &str) -> Option<Value> {
    let annotations = object
        .get_mut("metadata")?
        .get_mut("annotations")?
        .as_object_mut()?;
    let raw = annotations.remove(CONVERSION_DATA)?;
    if annotations.is_empty()
        && let Some(metadata) = object["metadata"].as_object_mut()
    {
        metadata.remove("annotations");
    }
    let data: Value = serde_json::from_str(raw.as_str()?).ok()?;
    (data["apiVersion"] == target_api_version).then_some(data)
}

fn set_annotation(object: &mut Value, data: String) {
    if !object["metadata"].is_object() {
        object["metadata"] = Value::Object(Map::new());
    }
    let metadata = &mut object["metadata"];
    if !metadata["annotations"].is_object() {
        metadata["annotations"] = Value::Object(Map::new());
    }
    metadata["annotations"][CONVERSION_DATA] = Value::String(data);
}

/// One convertible part of a kind in both versions. `earlier` is the part's stashed form in
/// the target version: fields only that version has are taken from it.
trait Part {
    type Hub: Serialize + DeserializeOwned + PartialEq;
    type Spoke: Serialize + DeserializeOwned + PartialEq;
    fn up(spoke: &Self::Spoke, earlier: Option<&Self::Hub>) -> Self::Hub;
    fn down(hub: &Self::Hub, earlier: Option<&Self::Spoke>) -> Self::Spoke;
}

struct ClusterSpec;
struct ClusterStatus;
struct ClusterTemplate;
struct MachineSpec;
struct MachineStatus;
struct MachineTemplate;
struct MachineTemplateStatus;

impl Part for ClusterSpec {
    type Hub = ProxmoxClusterSpec;
    type Spoke = spoke::ProxmoxClusterSpec;

    fn up(s: &Self::Spoke, earlier: Option<&Self::Hub>) -> Self::Hub {
        ProxmoxClusterSpec {
            control_plane_endpoint: s.control_plane_endpoint.as_ref().map(|e| ApiEndpoint {
                host: e.host.clone(),
                port: e.port,
            }),
            external_managed_control_plane: s.external_managed_control_plane,
            allowed_nodes: s.allowed_nodes.clone(),
            scheduler_hints: s.scheduler_hints.as_ref().map(|h| SchedulerHints {
                memory_adjustment: h.memory_adjustment,
            }),
            ipv4_config: s.ipv4_config.as_ref().map(ip_config_up),
            ipv6_config: s.ipv6_config.as_ref().map(ip_config_up),
            dns_servers: s.dns_servers.clone(),
            zone_config: earlier.map(|e| e.zone_config.clone()).unwrap_or_default(),
            credentials_ref: s.credentials_ref.clone(),
            ha: earlier.and_then(|e| e.ha.clone()),
            task_limits: earlier.and_then(|e| e.task_limits.clone()),
        }
    }

    fn down(h: &Self::Hub, earlier: Option<&Self::Spoke>) -> Self::Spoke {
        spoke::ProxmoxClusterSpec {
            control_plane_endpoint: h
                .control_plane_endpoint
                .as_ref()
                .map(|e| spoke::ApiEndpoint {
                    host: e.host.clone(),
                    port: e.port,
                }),
            external_managed_control_plane: h.external_managed_control_plane,
            allowed_nodes: h.allowed_nodes.clone(),
            scheduler_hints: h.scheduler_hints.as_ref().map(|h| spoke::SchedulerHints {
                memory_adjustment: h.memory_adjustment,
            }),
            ipv4_config: h.ipv4_config.as_ref().map(ip_config_down),
            ipv6_config: h.ipv6_config.as_ref().map(ip_config_down),
            dns_servers: h.dns_servers.clone(),
            clone_spec: earlier.and_then(|e| e.clone_spec.clone()),
            credentials_ref: h.credentials_ref.clone(),
        }
    }
}

fn ip_config_up(c: &spoke::IpConfigSpec) -> IpConfigSpec {
    IpConfigSpec {
        addresses: c.addresses.clone(),
        prefix: c.prefix,
        gateway: c.gateway.clone().unwrap_or_default(),
        metric: Some(c.metric),
    }
}

fn ip_config_down(c: &IpConfigSpec) -> spoke::IpConfigSpec {
    spoke::IpConfigSpec {
        addresses: c.addresses.clone(),
        prefix: c.prefix,
        gateway: Some(c.gateway.clone()).filter(|g| !g.is_empty()),
        metric: c.metric.unwrap_or(100),
    }
}

impl Part for ClusterTemplate {
    type Hub = ProxmoxClusterTemplateSpec;
    type Spoke = spoke::ProxmoxClusterTemplateSpec;

    fn up(s: &Self::Spoke, earlier: Option<&Self::Hub>) -> Self::Hub {
        ProxmoxClusterTemplateSpec {
            template: ProxmoxClusterTemplateResource {
                metadata: s.template.metadata.as_ref().map(metadata_up),
                spec: ClusterSpec::up(&s.template.spec, earlier.map(|e| &e.template.spec)),
            },
        }
    }

    fn down(h: &Self::Hub, earlier: Option<&Self::Spoke>) -> Self::Spoke {
        let mut spec = ClusterSpec::down(&h.template.spec, earlier.map(|e| &e.template.spec));
        // v1alpha1 ClusterClasses patch paths under `cloneSpec`; those patches only apply if it
        // exists, so a template that never had one gets the skeleton the Go provider gives it.
        spec.clone_spec
            .get_or_insert_with(|| spoke::ProxmoxClusterCloneSpec {
                machine_spec: [(
                    "controlPlane".to_owned(),
                    spoke::ProxmoxMachineSpec {
                        source_node: Some("pve1".to_owned()),
                        ..Default::default()
                    },
                )]
                .into(),
                ssh_authorized_keys: Some(Vec::new()),
                virtual_ip_network_interface: Some(String::new()),
            });
        spoke::ProxmoxClusterTemplateSpec {
            template: spoke::ProxmoxClusterTemplateResource {
                metadata: h.template.metadata.as_ref().map(metadata_down),
                spec,
            },
        }
    }
}

impl Part for ClusterStatus {
    type Hub = ProxmoxClusterStatus;
    type Spoke = spoke::ProxmoxClusterStatus;

    fn up(s: &Self::Spoke, earlier: Option<&Self::Hub>) -> Self::Hub {
        ProxmoxClusterStatus {
            conditions: conditions_up(&s.conditions, earlier.map(|e| e.conditions.as_slice())),
            initialization: initialization_up(
                s.ready,
                earlier.and_then(|e| e.initialization.as_ref()),
            ),
            failure_domains: earlier
                .map(|e| e.failure_domains.clone())
                .unwrap_or_default(),
            in_cluster_ip_pool_ref: s.in_cluster_ip_pool_ref.clone(),
            in_cluster_zone_ref: earlier
                .map(|e| e.in_cluster_zone_ref.clone())
                .unwrap_or_default(),
            node_locations: s.node_locations.as_ref().map(|n| {
                let zones = earlier.and_then(|e| e.node_locations.as_ref());
                let up = |list: &[spoke::NodeLocation], known: Option<&Vec<NodeLocation>>| {
                    list.iter()
                        .map(|l| NodeLocation {
                            machine: l.machine.clone(),
                            node: l.node.clone(),
                            zone: known
                                .into_iter()
                                .flatten()
                                .find(|k| k.machine == l.machine)
                                .and_then(|k| k.zone.clone()),
                        })
                        .collect()
                };
                NodeLocations {
                    control_plane: up(&n.control_plane, zones.map(|z| &z.control_plane)),
                    workers: up(&n.workers, zones.map(|z| &z.workers)),
                }
            }),
        }
    }

    fn down(h: &Self::Hub, earlier: Option<&Self::Spoke>) -> Self::Spoke {
        let down = |list: &[NodeLocation]| {
            list.iter()
                .map(|l| spoke::NodeLocation {
                    machine: l.machine.clone(),
                    node: l.node.clone(),
                })
                .collect()
        };
        spoke::ProxmoxClusterStatus {
            ready: Initialization::provisioned(h.initialization.as_ref()),
            in_cluster_ip_pool_ref: h.in_cluster_ip_pool_ref.clone(),
            node_locations: h.node_locations.as_ref().map(|n| spoke::NodeLocations {
                control_plane: down(&n.control_plane),
                workers: down(&n.workers),
            }),
            failure_reason: earlier.and_then(|e| e.failure_reason.clone()),
            failure_message: earlier.and_then(|e| e.failure_message.clone()),
            conditions: conditions_down(&h.conditions, earlier.map(|e| e.conditions.as_slice())),
        }
    }
}

/// v1alpha1 says `ready`; v1alpha2 says `initialization.provisioned` (absent until provisioned).
fn initialization_up(ready: bool, earlier: Option<&Initialization>) -> Option<Initialization> {
    if ready {
        return Some(Initialization {
            provisioned: Some(true),
        });
    }
    earlier.filter(|i| i.provisioned != Some(true)).cloned()
}

fn conditions_up(conditions: &[spoke::Condition], earlier: Option<&[Condition]>) -> Vec<Condition> {
    conditions
        .iter()
        .map(|c| Condition {
            type_: c.type_.clone(),
            status: c.status.clone(),
            last_transition_time: c.last_transition_time.clone(),
            reason: c
                .reason
                .clone()
                .unwrap_or_else(|| CONVERTED_CONDITION_REASON.to_owned()),
            message: c.message.clone().unwrap_or_default(),
            observed_generation: earlier
                .into_iter()
                .flatten()
                .find(|e| e.type_ == c.type_)
                .and_then(|e| e.observed_generation),
        })
        .collect()
}

fn conditions_down(
    conditions: &[Condition],
    earlier: Option<&[spoke::Condition]>,
) -> Vec<spoke::Condition> {
    conditions
        .iter()
        .map(|c| spoke::Condition {
            type_: c.type_.clone(),
            status: c.status.clone(),
            severity: earlier
                .into_iter()
                .flatten()
                .find(|e| e.type_ == c.type_ && e.status == c.status)
                .and_then(|e| e.severity.clone()),
            last_transition_time: c.last_transition_time.clone(),
            reason: Some(c.reason.clone()).filter(|r| !r.is_empty()),
            message: Some(c.message.clone()).filter(|m| !m.is_empty()),
        })
        .collect()
}

impl Part for MachineSpec {
    type Hub = ProxmoxMachineSpec;
    type Spoke = spoke::ProxmoxMachineSpec;

    fn up(s: &Self::Spoke, earlier: Option<&Self::Hub>) -> Self::Hub {
        ProxmoxMachineSpec {
            source_node: s.source_node.clone(),
            template_id: s.template_id,
            template_selector: s.template_selector.clone(),
            description: s.description.clone(),
            format: s.format,
            full: s.full,
            pool: s.pool.clone(),
            snap_name: s.snap_name.clone(),
            storage: s.storage.clone(),
            provider_id: s.provider_id.clone(),
            virtual_machine_id: s.virtual_machine_id,
            num_sockets: s.num_sockets,
            num_cores: s.num_cores,
            memory_mib: s.memory_mib,
            // v1alpha2 only, kept from the stored object.
            cpu: earlier.and_then(|e| e.cpu.clone()),
            numa: earlier.and_then(|e| e.numa),
            bios: earlier.and_then(|e| e.bios),
            secure_boot: earlier.and_then(|e| e.secure_boot),
            tpm: earlier.and_then(|e| e.tpm),
            pci_devices: earlier.map(|e| e.pci_devices.clone()).unwrap_or_default(),
            disks: storage_up(s.disks.as_ref(), earlier.and_then(|e| e.disks.as_ref())),
            network: network_up(s.network.as_ref(), earlier.map(|e| &e.network)),
            vm_id_range: s.vm_id_range.clone(),
            checks: s.checks.clone(),
            metadata_settings: s.metadata_settings.as_ref().map(|m| MetadataSettings {
                provider_id_injection: m.provider_id_injection.unwrap_or(false),
            }),
            // v1alpha1 cloned to `target`; v1alpha2 places the VM on one of `allowedNodes`.
            allowed_nodes: match &s.target {
                Some(target) => vec![target.clone()],
                None => s.allowed_nodes.clone(),
            },
            tags: s.tags.clone(),
        }
    }

    fn down(h: &Self::Hub, earlier: Option<&Self::Spoke>) -> Self::Spoke {
        let target = earlier
            .and_then(|e| e.target.clone())
            .filter(|t| h.allowed_nodes == [t.clone()]);
        spoke::ProxmoxMachineSpec {
            source_node: h.source_node.clone(),
            template_id: h.template_id,
            template_selector: h.template_selector.clone(),
            description: h.description.clone(),
            format: h.format,
            full: h.full,
            pool: h.pool.clone(),
            snap_name: h.snap_name.clone(),
            storage: h.storage.clone(),
            allowed_nodes: match (&target, earlier) {
                (Some(_), Some(earlier)) => earlier.allowed_nodes.clone(),
                _ => h.allowed_nodes.clone(),
            },
            target,
            disks: h.disks.as_ref().map(|d| spoke::Storage {
                boot_volume: d.boot_volume.as_ref().map(|b| spoke::DiskSize {
                    disk: b.disk.clone(),
                    size_gb: b.size_gb,
                }),
            }),
            network: Some(network_down(&h.network)),
            num_sockets: h.num_sockets,
            num_cores: h.num_cores,
            memory_mib: h.memory_mib,
            provider_id: h.provider_id.clone(),
            virtual_machine_id: h.virtual_machine_id,
            vm_id_range: h.vm_id_range.clone(),
            checks: h.checks.clone(),
            metadata_settings: h
                .metadata_settings
                .as_ref()
                .map(|m| spoke::MetadataSettings {
                    provider_id_injection: Some(m.provider_id_injection),
                }),
            tags: h.tags.clone(),
        }
    }
}

/// The disks of a v1alpha1 spec: its boot volume, and the data disks (v1alpha2 only) kept
/// from the stored object.
fn storage_up(disks: Option<&spoke::Storage>, earlier: Option<&Storage>) -> Option<Storage> {
    let additional_volumes = earlier
        .map(|e| e.additional_volumes.clone())
        .unwrap_or_default();
    if disks.is_none() && additional_volumes.is_empty() {
        return None;
    }
    Some(Storage {
        boot_volume: disks
            .and_then(|d| d.boot_volume.as_ref())
            .map(|b| DiskSize {
                disk: b.disk.clone(),
                size_gb: b.size_gb,
            }),
        additional_volumes,
    })
}

/// Name of the NIC v1alpha1 calls `default`.
const DEFAULT_NIC: &str = "net0";

fn network_up(network: Option<&spoke::NetworkSpec>, earlier: Option<&NetworkSpec>) -> NetworkSpec {
    let known = |name: &str| {
        earlier
            .into_iter()
            .flat_map(|e| &e.network_devices)
            .find(|d| d.name == name)
    };
    let Some(network) = network else {
        // v1alpha2 requires a network; v1alpha1 machines without one had a single NIC on the
        // default bridge with the cluster's pools, which is what this one gets.
        return NetworkSpec {
            zone: earlier.and_then(|e| e.zone.clone()),
            network_devices: vec![NetworkDevice {
                name: DEFAULT_NIC.to_owned(),
                bridge: Some("vmbr0".to_owned()),
                ..Default::default()
            }],
            vrfs: Vec::new(),
        };
    };
    let mut devices = Vec::new();
    if let Some(d) = &network.default {
        let known = known(DEFAULT_NIC);
        // Without `defaultIPv4`/`defaultIPv6` anywhere, net0 takes the default pool of each
        // family the cluster (or zone) has, which is what v1alpha1's default NIC got.
        devices.push(NetworkDevice {
            name: DEFAULT_NIC.to_owned(),
            bridge: Some(d.bridge.clone()),
            model: d.model,
            mtu: d.mtu,
            vlan: d.vlan,
            queues: known.and_then(|k| k.queues),
            default_ipv4: known.and_then(|k| k.default_ipv4),
            default_ipv6: known.and_then(|k| k.default_ipv6),
            dhcp4: known.and_then(|k| k.dhcp4),
            dhcp6: known.and_then(|k| k.dhcp6),
            ip_pool_ref: pools_up(d.ipv4_pool_ref.as_ref(), d.ipv6_pool_ref.as_ref()),
            dns_servers: d.dns_servers.clone(),
            routes: None,
            routing_policy: None,
            link_mtu: None,
        });
    }
    for d in &network.additional_devices {
        let known = known(&d.name);
        devices.push(NetworkDevice {
            name: d.name.clone(),
            bridge: Some(d.bridge.clone()),
            model: d.model,
            mtu: d.mtu,
            vlan: d.vlan,
            queues: known.and_then(|k| k.queues),
            default_ipv4: known.and_then(|k| k.default_ipv4),
            default_ipv6: known.and_then(|k| k.default_ipv6),
            dhcp4: known.and_then(|k| k.dhcp4),
            dhcp6: known.and_then(|k| k.dhcp6),
            ip_pool_ref: pools_up(d.ipv4_pool_ref.as_ref(), d.ipv6_pool_ref.as_ref()),
            dns_servers: d.dns_servers.clone(),
            routes: routes_up(d.routes.as_ref(), known.and_then(|k| k.routes.as_ref())),
            routing_policy: policies_up(
                d.routing_policy.as_ref(),
                known.and_then(|k| k.routing_policy.as_ref()),
            ),
            link_mtu: d.link_mtu,
        });
    }
    let vrfs = network
        .vrfs
        .iter()
        .map(|v| {
            let known = earlier
                .into_iter()
                .flat_map(|e| &e.vrfs)
                .find(|k| k.name == v.name);
            VrfDevice {
                name: v.name.clone(),
                table: v.table,
                interfaces: v.interfaces.clone(),
                routes: routes_up(v.routes.as_ref(), known.and_then(|k| k.routes.as_ref())),
                routing_policy: policies_up(
                    v.routing_policy.as_ref(),
                    known.and_then(|k| k.routing_policy.as_ref()),
                ),
            }
        })
        .collect();
    NetworkSpec {
        zone: earlier.and_then(|e| e.zone.clone()),
        network_devices: devices,
        vrfs,
    }
}

fn network_down(network: &NetworkSpec) -> spoke::NetworkSpec {
    let mut out = spoke::NetworkSpec::default();
    for d in &network.network_devices {
        let (ipv4_pool_ref, ipv6_pool_ref) = pools_down(&d.ip_pool_ref);
        let bridge = d.bridge.clone().unwrap_or_default();
        if d.name == DEFAULT_NIC {
            out.default = Some(spoke::NetworkDevice {
                bridge,
                model: d.model,
                mtu: d.mtu,
                vlan: d.vlan,
                dns_servers: d.dns_servers.clone(),
                ipv4_pool_ref,
                ipv6_pool_ref,
            });
        } else {
            out.additional_devices.push(spoke::AdditionalNetworkDevice {
                name: d.name.clone(),
                bridge,
                model: d.model,
                mtu: d.mtu,
                vlan: d.vlan,
                dns_servers: d.dns_servers.clone(),
                ipv4_pool_ref,
                ipv6_pool_ref,
                routes: d.routes.as_ref().map(|r| routes_down(r)),
                routing_policy: d.routing_policy.as_ref().map(|p| policies_down(p)),
                link_mtu: d.link_mtu,
            });
        }
    }
    out.vrfs = network
        .vrfs
        .iter()
        .map(|v| spoke::VrfDevice {
            name: v.name.clone(),
            table: v.table,
            interfaces: v.interfaces.clone(),
            routes: v.routes.as_ref().map(|r| routes_down(r)),
            routing_policy: v.routing_policy.as_ref().map(|p| policies_down(p)),
        })
        .collect();
    out
}

fn pools_up(
    ipv4: Option<&TypedLocalObjectReference>,
    ipv6: Option<&TypedLocalObjectReference>,
) -> Vec<TypedLocalObjectReference> {
    ipv4.into_iter().chain(ipv6).cloned().collect()
}

/// Splits v1alpha2's pool list into v1alpha1's one pool per family. The family of a pool is not
/// in the reference, so a pool whose name says IPv6 (`inet6`, `ipv6`, `v6`) is taken as the IPv6
/// pool and the first other one as the IPv4 pool.
fn pools_down(
    refs: &[TypedLocalObjectReference],
) -> (
    Option<TypedLocalObjectReference>,
    Option<TypedLocalObjectReference>,
) {
    let looks_v6 = |r: &&TypedLocalObjectReference| {
        let name = r.name.to_ascii_lowercase();
        ["inet6", "ipv6", "v6"].iter().any(|m| name.contains(m))
    };
    let ipv6 = refs.iter().find(looks_v6);
    let ipv4 = refs
        .iter()
        .find(|r| ipv6.is_none_or(|v6| !std::ptr::eq(*r, v6)));
    (ipv4.cloned(), ipv6.cloned())
}

fn routes_up(
    routes: Option<&Vec<spoke::RouteSpec>>,
    known: Option<&Vec<RouteSpec>>,
) -> Option<Vec<RouteSpec>> {
    routes.map(|routes| {
        routes
            .iter()
            .enumerate()
            .map(|(i, r)| RouteSpec {
                to: r.to.clone(),
                via: r.via.clone(),
                metric: r.metric,
                table: r.table,
                is6: known.and_then(|k| k.get(i)).and_then(|k| k.is6),
            })
            .collect()
    })
}

fn routes_down(routes: &[RouteSpec]) -> Vec<spoke::RouteSpec> {
    routes
        .iter()
        .map(|r| spoke::RouteSpec {
            to: r.to.clone(),
            via: r.via.clone(),
            metric: r.metric,
            table: r.table,
        })
        .collect()
}

fn policies_up(
    policies: Option<&Vec<spoke::RoutingPolicySpec>>,
    known: Option<&Vec<RoutingPolicySpec>>,
) -> Option<Vec<RoutingPolicySpec>> {
    policies.map(|policies| {
        policies
            .iter()
            .enumerate()
            .map(|(i, p)| RoutingPolicySpec {
                to: p.to.clone(),
                from: p.from.clone(),
                table: p.table,
                priority: p.priority,
                is6: known.and_then(|k| k.get(i)).and_then(|k| k.is6),
            })
            .collect()
    })
}

fn policies_down(policies: &[RoutingPolicySpec]) -> Vec<spoke::RoutingPolicySpec> {
    policies
        .iter()
        .map(|p| spoke::RoutingPolicySpec {
            to: p.to.clone(),
            from: p.from.clone(),
            table: p.table,
            priority: p.priority,
        })
        .collect()
}

fn metadata_up(m: &spoke::ObjectMeta) -> TemplateObjectMeta {
    TemplateObjectMeta {
        labels: m.labels.clone(),
        annotations: m.annotations.clone(),
    }
}

fn metadata_down(m: &TemplateObjectMeta) -> spoke::ObjectMeta {
    spoke::ObjectMeta {
        labels: m.labels.clone(),
        annotations: m.annotations.clone(),
    }
}

impl Part for MachineTemplate {
    type Hub = ProxmoxMachineTemplateSpec;
    type Spoke = spoke::ProxmoxMachineTemplateSpec;

    fn up(s: &Self::Spoke, earlier: Option<&Self::Hub>) -> Self::Hub {
        ProxmoxMachineTemplateSpec {
            template: ProxmoxMachineTemplateResource {
                metadata: s.template.metadata.as_ref().map(metadata_up),
                spec: MachineSpec::up(&s.template.spec, earlier.map(|e| &e.template.spec)),
            },
        }
    }

    fn down(h: &Self::Hub, earlier: Option<&Self::Spoke>) -> Self::Spoke {
        spoke::ProxmoxMachineTemplateSpec {
            template: spoke::ProxmoxMachineTemplateResource {
                metadata: h.template.metadata.as_ref().map(metadata_down),
                spec: MachineSpec::down(&h.template.spec, earlier.map(|e| &e.template.spec)),
            },
        }
    }
}

/// v1alpha1 templates have no status: the v1alpha2 one (capacity, node info, conditions)
/// travels in the annotation whole.
#[derive(Serialize, serde::Deserialize, PartialEq, Default)]
struct NoStatus {}

impl Part for MachineTemplateStatus {
    type Hub = ProxmoxMachineTemplateStatus;
    type Spoke = NoStatus;

    fn up(_: &Self::Spoke, earlier: Option<&Self::Hub>) -> Self::Hub {
        earlier.cloned().unwrap_or_default()
    }

    fn down(_: &Self::Hub, _: Option<&Self::Spoke>) -> Self::Spoke {
        NoStatus {}
    }
}

impl Part for MachineStatus {
    type Hub = ProxmoxMachineStatus;
    type Spoke = spoke::ProxmoxMachineStatus;

    fn up(s: &Self::Spoke, earlier: Option<&Self::Hub>) -> Self::Hub {
        let known_addresses = |net: &str| {
            earlier
                .into_iter()
                .flat_map(|e| &e.ip_addresses)
                .find(|a| a.net == net)
        };
        ProxmoxMachineStatus {
            conditions: conditions_up(&s.conditions, earlier.map(|e| e.conditions.as_slice())),
            initialization: initialization_up(
                s.ready == Some(true),
                earlier.and_then(|e| e.initialization.as_ref()),
            ),
            addresses: s.addresses.clone(),
            vm_status: s.vm_status.as_deref().and_then(|state| {
                serde_json::from_value::<VirtualMachineState>(Value::String(state.to_owned())).ok()
            }),
            bootstrap_data_provided: s.bootstrap_data_provided,
            ip_addresses: s
                .ip_addresses
                .iter()
                .map(|(net, a)| {
                    // v1alpha1 keeps the first address of each family; keep the others.
                    let known = known_addresses(net);
                    let family = |first: &Option<String>, all: Option<&Vec<String>>| match first {
                        Some(first) => match all {
                            Some(all) if all.first() == Some(first) => all.clone(),
                            _ => vec![first.clone()],
                        },
                        None => Vec::new(),
                    };
                    IpAddressesSpec {
                        net: net.clone(),
                        ipv4: family(&a.ipv4, known.map(|k| &k.ipv4)),
                        ipv6: family(&a.ipv6, known.map(|k| &k.ipv6)),
                    }
                })
                .collect(),
            network: s
                .network
                .iter()
                .map(|n| NetworkStatus {
                    connected: n.connected.unwrap_or(false),
                    ip_addrs: n.ip_addrs.clone(),
                    mac_addr: n.mac_addr.clone(),
                    network_name: n.network_name.clone(),
                })
                .collect(),
            virtual_machine_id: earlier.and_then(|e| e.virtual_machine_id),
            proxmox_node: s.proxmox_node.clone(),
            // The endpoint belongs to the VM: kept while v1alpha1 names the same node.
            proxmox_endpoint: earlier
                .filter(|e| e.proxmox_node == s.proxmox_node)
                .and_then(|e| e.proxmox_endpoint.clone()),
            failure_domain: earlier.and_then(|e| e.failure_domain.clone()),
            task_ref: s.task_ref.clone(),
            task_purpose: earlier
                .filter(|e| e.task_ref == s.task_ref)
                .and_then(|e| e.task_purpose.clone()),
            retry_after: s.retry_after.clone(),
            task_failures: earlier.and_then(|e| e.task_failures),
        }
    }

    fn down(h: &Self::Hub, earlier: Option<&Self::Spoke>) -> Self::Spoke {
        spoke::ProxmoxMachineStatus {
            ready: Some(Initialization::provisioned(h.initialization.as_ref())),
            addresses: h.addresses.clone(),
            vm_status: h.vm_status.and_then(|state| {
                serde_json::to_value(state)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_owned))
            }),
            bootstrap_data_provided: h.bootstrap_data_provided,
            ip_addresses: h
                .ip_addresses
                .iter()
                .map(|a| {
                    (
                        a.net.clone(),
                        spoke::IpAddress {
                            ipv4: a.ipv4.first().cloned(),
                            ipv6: a.ipv6.first().cloned(),
                        },
                    )
                })
                .collect(),
            network: h
                .network
                .iter()
                .map(|n| spoke::NetworkStatus {
                    connected: Some(n.connected),
                    ip_addrs: n.ip_addrs.clone(),
                    mac_addr: n.mac_addr.clone(),
                    network_name: n.network_name.clone(),
                })
                .collect(),
            proxmox_node: h.proxmox_node.clone(),
            task_ref: h.task_ref.clone(),
            retry_after: h.retry_after.clone(),
            failure_reason: earlier.and_then(|e| e.failure_reason.clone()),
            failure_message: earlier.and_then(|e| e.failure_message.clone()),
            conditions: conditions_down(&h.conditions, earlier.map(|e| e.conditions.as_slice())),
        }
    }
}
