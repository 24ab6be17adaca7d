//! Every reason capmox writes into a condition or an Event, with what it means and what to do:
//! the book's troubleshooting page is printed from this list (`capmox docs reasons`), and a test
//! fails when the source sets a reason that is missing here, so the page cannot fall behind.

/// Where a reason shows up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Seen {
    /// In a condition of an object of `kind`, with `status`.
    Condition {
        /// The kind: one of capmox's, or `Machine` for what capmox writes on Cluster API's.
        kind: &'static str,
        /// The condition type, e.g. `VirtualMachineProvisioned`.
        condition: &'static str,
        /// `True`, `False` or `Unknown`.
        status: &'static str,
    },
    /// As the reason of an Event about an object of `kind`.
    Event {
        /// The involved object's kind.
        kind: &'static str,
        /// `Normal` or `Warning`.
        type_: &'static str,
    },
}

/// One reason and what a user does about it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reason {
    /// The CamelCase reason, as written.
    pub name: &'static str,
    /// Where capmox writes it.
    pub seen: &'static [Seen],
    /// What it says about the object.
    pub meaning: &'static str,
    /// What to do; "Nothing" where capmox carries on by itself.
    pub action: &'static str,
}

const CLUSTER: &str = "ProxmoxCluster";
const MACHINE: &str = "ProxmoxMachine";
const TEMPLATE: &str = "ProxmoxMachineTemplate";
const REMEDIATION: &str = "ProxmoxRemediation";

const fn condition(kind: &'static str, condition: &'static str, status: &'static str) -> Seen {
    Seen::Condition {
        kind,
        condition,
        status,
    }
}

const CLUSTER_READY_FALSE: Seen = condition(CLUSTER, "Ready", "False");
const CLUSTER_AVAILABLE_FALSE: Seen = condition(CLUSTER, "ProxmoxAvailable", "False");
const DOMAINS_FALSE: Seen = condition(CLUSTER, "FailureDomainsReady", "False");
const DOMAINS_AVAILABLE_FALSE: Seen = condition(CLUSTER, "FailureDomainsAvailable", "False");
const MACHINE_PROVISIONED_FALSE: Seen = condition(MACHINE, "VirtualMachineProvisioned", "False");
const MACHINE_READY_FALSE: Seen = condition(MACHINE, "Ready", "False");
const CAPACITY_FALSE: Seen = condition(TEMPLATE, "CapacityResolved", "False");
const REMEDIATED_FALSE: Seen = condition(REMEDIATION, "Remediated", "False");
const MACHINE_NORMAL: Seen = Seen::Event {
    kind: MACHINE,
    type_: "Normal",
};
const MACHINE_WARNING: Seen = Seen::Event {
    kind: MACHINE,
    type_: "Warning",
};
const CLUSTER_WARNING: Seen = Seen::Event {
    kind: CLUSTER,
    type_: "Warning",
};

/// A failed Proxmox request: on the cluster, the machine and the template alike, with a Warning
/// event when a streak of failures starts.
const PROXMOX_FAILURE: &[Seen] = &[
    CLUSTER_AVAILABLE_FALSE,
    MACHINE_PROVISIONED_FALSE,
    CAPACITY_FALSE,
    CLUSTER_WARNING,
    MACHINE_WARNING,
];

/// A machine waits; the condition's message says for what.
const MACHINE_WAITS: &[Seen] = &[MACHINE_PROVISIONED_FALSE, MACHINE_READY_FALSE];

/// A machine's placement or template cannot be resolved.
const PLACEMENT: &[Seen] = &[
    MACHINE_PROVISIONED_FALSE,
    MACHINE_READY_FALSE,
    CAPACITY_FALSE,
];

/// Every reason, alphabetically.
pub const REASONS: &[Reason] = &[
    Reason {
        name: "Adopted",
        seen: &[MACHINE_NORMAL],
        meaning: "The machine found an existing VM that is its own (by its tag, the SMBIOS UUID spec.providerID names, or its recorded VMID) and took it over instead of cloning: after clusterctl move, a restore, or a switch from the Go provider.",
        action: "Nothing.",
    },
    Reason {
        name: "AmbiguousTemplate",
        seen: PLACEMENT,
        meaning: "More than one Proxmox template matches the machine's templateSelector (templates that differ in name or tags are different templates), or a template has copies on several nodes and the machine has neither a zone nor allowed nodes to choose a copy by.",
        action: "Make the tags match exactly one template (copies must share name and tags), or give the machine allowedNodes or a failure domain.",
    },
    Reason {
        name: "APIConversionReason",
        seen: &[
            condition(CLUSTER, "any", "any"),
            condition(MACHINE, "any", "any"),
        ],
        meaning: "A v1alpha1 condition without a reason, converted to v1alpha2 (which requires one); the name is the Go provider's.",
        action: "Nothing: capmox rewrites the condition with its own reason on the next reconcile.",
    },
    Reason {
        name: "Available",
        seen: &[
            condition(CLUSTER, "ProxmoxAvailable", "True"),
            condition(CLUSTER, "FailureDomainsAvailable", "True"),
        ],
        meaning: "Every Proxmox endpoint of the cluster answers with its credentials, and every zone has a node online.",
        action: "Nothing.",
    },
    Reason {
        name: "AvailableOverPlainHTTP",
        seen: &[
            condition(CLUSTER, "ProxmoxAvailable", "True"),
            CLUSTER_WARNING,
        ],
        meaning: "Proxmox answers, but over plain http://, so the API token crosses the network unencrypted.",
        action: "Use an https:// URL in the credentials (only the simulator should be addressed over HTTP).",
    },
    Reason {
        name: "BootstrapDataInvalid",
        seen: &[
            MACHINE_PROVISIONED_FALSE,
            MACHINE_READY_FALSE,
            MACHINE_WARNING,
        ],
        meaning: "The bootstrap Secret's Ignition data cannot be delivered: not JSON or not an object, no or an unsupported ignition.version, the wrong type where capmox merges, or ignition.config.replace. Nothing is created in Proxmox; a Secret that turns bad after the clone leaves the VM stopped without a seed image.",
        action: "Fix the bootstrap data (the message names the Secret and the problem); use ignition.config.merge instead of replace. A change to the Secret wakes no machine: the machine looks again within a minute or when it changes itself.",
    },
    Reason {
        name: "BootstrapDataProvided",
        seen: &[MACHINE_NORMAL],
        meaning: "The seed ISO with the bootstrap data was uploaded and attached to the VM.",
        action: "Nothing.",
    },
    Reason {
        name: "BootstrapFormatUnsupported",
        seen: &[
            MACHINE_PROVISIONED_FALSE,
            MACHINE_READY_FALSE,
            MACHINE_WARNING,
        ],
        meaning: "The bootstrap Secret's format is neither cloud-config nor ignition.",
        action: "Fix the bootstrap provider's configuration (KubeadmConfig format).",
    },
    Reason {
        name: "Cloned",
        seen: &[MACHINE_NORMAL],
        meaning: "The clone task of the machine's VM finished.",
        action: "Nothing.",
    },
    Reason {
        name: "Cloning",
        seen: &[MACHINE_PROVISIONED_FALSE, MACHINE_READY_FALSE],
        meaning: "The template is being cloned to the machine's VM (the message names the template, VMID and node), or a VMID in use is not listed by Proxmox yet.",
        action: "Nothing; a clone that waits long is queued behind other clones on its node (Proxmox's locks).",
    },
    Reason {
        name: "CloudInitDegraded",
        seen: &[MACHINE_WARNING],
        meaning: "cloud-init in the guest finished with recoverable errors (warnings, deprecations; `cloud-init status` exits 2); the machine carries on.",
        action: "Look at /var/log/cloud-init.log in the guest if the node misbehaves.",
    },
    Reason {
        name: "CloudInitFailed",
        seen: &[MACHINE_WARNING],
        meaning: "cloud-init in the guest reported an error; capmox asks again with back-off.",
        action: "Look at the guest's cloud-init log (the event has the errors of its result file); fix the bootstrap data or the VM template.",
    },
    Reason {
        name: "CloudInitRenderFailed",
        seen: MACHINE_WAITS,
        meaning: "capmox could not render the cloud-init meta-data as YAML: a bug in capmox.",
        action: "Report it with the condition's message.",
    },
    Reason {
        name: "ClusterNameLabelMissing",
        seen: &[CAPACITY_FALSE],
        meaning: "The ProxmoxMachineTemplate has no cluster.x-k8s.io/cluster-name label, so capmox does not know whose credentials to read the Proxmox template with; status.capacity has only what the spec gives.",
        action: "Add the label (capmox's flavors and ClusterClass topologies set it).",
    },
    Reason {
        name: "Configured",
        seen: &[MACHINE_NORMAL],
        meaning: "The VM's CPU, memory, NICs, tags and disk size were written.",
        action: "Nothing.",
    },
    Reason {
        name: "CredentialsInvalid",
        seen: PROXMOX_FAILURE,
        meaning: "The credentials Secret (or the global credentials) cannot be used: a missing key, a malformed token, root_ca or fingerprint, a url that is not a plain http(s) origin, or an origin --allowed-proxmox-urls does not list.",
        action: "Fix the Secret as the message says; the cluster retries within 30 s.",
    },
    Reason {
        name: "CredentialsNotFound",
        seen: &[CLUSTER_AVAILABLE_FALSE, CAPACITY_FALSE, CLUSTER_WARNING],
        meaning: "No usable credentials: the credentialsRef Secret does not exist or does not allow this namespace (the two read the same), or there is no credentialsRef and the global credentials are unset or not allowed for the namespace (--global-credentials-namespaces), or the Secret is outside --secret-namespaces.",
        action: "Create the Secret, annotate a Secret in another namespace with proxmox.infrastructure.cluster.x-k8s.io/allowed-namespaces, or list the namespace in --global-credentials-namespaces.",
    },
    Reason {
        name: "Deleting",
        seen: &[
            CLUSTER_READY_FALSE,
            MACHINE_READY_FALSE,
            MACHINE_PROVISIONED_FALSE,
            MACHINE_NORMAL,
        ],
        meaning: "The object is being deleted: a ProxmoxCluster waits for its ProxmoxMachines (named in the message), a machine for its VM's stop and delete tasks or for a lock on the VM.",
        action: "Nothing; if it lasts, the message says what is waited for.",
    },
    Reason {
        name: "FailureDomainNotReady",
        seen: PLACEMENT,
        meaning: "The machine's failure domain is not one the ProxmoxCluster publishes (yet).",
        action: "Check the Machine's failureDomain against the ProxmoxCluster's status.failureDomains and its FailureDomainsReady condition.",
    },
    Reason {
        name: "HAConfigurationRefused",
        seen: &[MACHINE_WARNING, CLUSTER_WARNING],
        meaning: "Proxmox refused an HA rule or group capmox asked for (e.g. more control-plane VMs than nodes for a negative resource-affinity rule); the machine carries on without it.",
        action: "Fix the zone's nodes or the HA configuration in Proxmox.",
    },
    Reason {
        name: "InsufficientMemory",
        seen: PLACEMENT,
        meaning: "No candidate node has the memory the machine needs, counting what is promised to other VMs (schedulerHints.memoryAdjustment); retried.",
        action: "Free memory, add nodes to the zone or allowedNodes, or raise memoryAdjustment.",
    },
    Reason {
        name: "InsufficientStorage",
        seen: PLACEMENT,
        meaning: "No candidate node's own (not shared) storage has room for the machine's data disks on it, counting disks promised to machines still being cloned; retried.",
        action: "Free space on that storage, put the data disks on shared storage, or allow nodes with room.",
    },
    Reason {
        name: "InvalidNetworkConfig",
        seen: MACHINE_WAITS,
        meaning: "The machine's network configuration cannot be written for the guest (e.g. a VRF name that is not an interface name, or two default gateways that clash).",
        action: "Fix spec.network as the message says.",
    },
    Reason {
        name: "InvalidSpec",
        seen: PLACEMENT,
        meaning: "The machine's spec cannot be resolved: no name, neither sourceNode+templateID nor templateSelector, or a templateSelector without tags.",
        action: "Fix the ProxmoxMachine (or its template) spec.",
    },
    Reason {
        name: "InvalidTemplate",
        seen: MACHINE_WAITS,
        meaning: "The VM template carries a capmox machine tag (capmox-<id>), as if it were a machine's VM.",
        action: "Remove the tag from the template in Proxmox.",
    },
    Reason {
        name: "InvalidZoneConfig",
        seen: &[DOMAINS_FALSE],
        meaning: "spec.zoneConfig is inconsistent: a node in two zones, or a node outside allowedNodes. The last good failure domains stay published.",
        action: "Fix spec.zoneConfig as the message says.",
    },
    Reason {
        name: "LeadershipLost",
        seen: &[MACHINE_PROVISIONED_FALSE, CLUSTER_AVAILABLE_FALSE],
        meaning: "This replica lost the leader Lease while a reconcile was in flight, so its Proxmox writes were refused; the next leader carries on.",
        action: "Nothing; if it repeats, check the API server's reachability from the manager.",
    },
    Reason {
        name: "MachineDeleting",
        seen: &[REMEDIATED_FALSE],
        meaning: "The remediation's Machine is being deleted: its owner replaces it already, so the remediation does nothing.",
        action: "Nothing; the request goes with its Machine.",
    },
    Reason {
        name: "MachineNotFound",
        seen: &[REMEDIATED_FALSE],
        meaning: "No Machine of the ProxmoxRemediation's name exists in its namespace (a MachineHealthCheck names each request after its Machine); nothing is rebooted, in particular no VM of another namespace.",
        action: "Delete the request, or create it in the Machine's namespace under the Machine's name.",
    },
    Reason {
        name: "MetadataIncomplete",
        seen: MACHINE_WAITS,
        meaning: "The cloud-init meta-data lacks the hostname or the instance-id (the SMBIOS UUID).",
        action: "Nothing usually: it is retried; if it stays, report it with the message.",
    },
    Reason {
        name: "MissingControlPlaneEndpoint",
        seen: &[
            condition(CLUSTER, "ControlPlaneEndpointAvailable", "False"),
            CLUSTER_READY_FALSE,
        ],
        meaning: "spec.controlPlaneEndpoint has no host or port yet, so the cluster is not provisioned.",
        action: "Set spec.controlPlaneEndpoint, or let the external control plane provider set it.",
    },
    Reason {
        name: "Moving",
        seen: &[REMEDIATED_FALSE],
        meaning: "Reboots did not make the Node healthy and Proxmox HA manages the VM: HA was asked to move it to another online node of its zone (status.movedTo); once it is there the Node gets spec.strategy.timeoutSeconds again before the replacement. A move that does not finish within that time hands the Machine back.",
        action: "Nothing; set spec.strategy.moveBeforeReplace: false to replace at once instead.",
    },
    Reason {
        name: "NoCandidateNodes",
        seen: PLACEMENT,
        meaning: "The machine's zone and allowedNodes leave no Proxmox node to place it on.",
        action: "Make the zone's nodes and allowedNodes overlap.",
    },
    Reason {
        name: "NoDefaultPool",
        seen: PLACEMENT,
        meaning: "The machine would get no IP address: no NIC claims from a pool and the cluster (or zone) has no pool of any family.",
        action: "Give the cluster or the zone ipv4Config or ipv6Config, or the NIC an ipPoolRef.",
    },
    Reason {
        name: "NodesUnavailable",
        seen: PLACEMENT,
        meaning: "None of the candidate nodes is online in Proxmox (down, or not visible to the token): the machine waits; retried.",
        action: "Bring a node of the zone back, or check that the token may see them (Sys.Audit); the ProxmoxCluster's FailureDomainsAvailable names the zones without an online node.",
    },
    Reason {
        name: "NoISOStorage",
        seen: MACHINE_WAITS,
        meaning: "The VM's node has no storage with content type iso for the seed image; looked at again every minute.",
        action: "Enable the iso content type on a storage of that node.",
    },
    Reason {
        name: "NotPaused",
        seen: &[
            condition(CLUSTER, "Paused", "False"),
            condition(MACHINE, "Paused", "False"),
        ],
        meaning: "Reconciliation is not paused.",
        action: "Nothing.",
    },
    Reason {
        name: "NotScheduled",
        seen: PLACEMENT,
        meaning: "The scheduler was asked to place a machine that has neither allowed nodes nor zone nodes; capmox does not ask it for such machines, which are cloned on their template's node (as the Go provider does).",
        action: "Report it: it means a capmox bug. Set allowedNodes or zones to have capmox choose nodes.",
    },
    Reason {
        name: "Paused",
        seen: &[
            condition(CLUSTER, "Paused", "True"),
            condition(MACHINE, "Paused", "True"),
            REMEDIATED_FALSE,
        ],
        meaning: "The Cluster's spec.paused or the cluster.x-k8s.io/paused annotation stops reconciliation (a paused remediation looks again every minute).",
        action: "Unpause the Cluster (or remove the annotation) when done.",
    },
    Reason {
        name: "PciDeviceUnavailable",
        seen: PLACEMENT,
        meaning: "No candidate node has a free device of the PCI resource mapping (or the host PCI address) the machine asks for; the message gives each node's free count; retried.",
        action: "Map devices of the zone's nodes in Proxmox (Datacenter → Resource Mappings), free a device, or allow nodes that have one.",
    },
    Reason {
        name: "PoweredOn",
        seen: &[MACHINE_NORMAL],
        meaning: "The VM's start task finished.",
        action: "Nothing.",
    },
    Reason {
        name: "Provisioned",
        seen: &[
            condition(MACHINE, "VirtualMachineProvisioned", "True"),
            MACHINE_NORMAL,
        ],
        meaning: "The VM runs, is configured and bootstrapped; the event names the node and provider ID.",
        action: "Nothing.",
    },
    Reason {
        name: "ProxmoxClusterNotFound",
        seen: &[
            MACHINE_PROVISIONED_FALSE,
            MACHINE_READY_FALSE,
            CAPACITY_FALSE,
        ],
        meaning: "The ProxmoxCluster is gone: a machine being deleted keeps its VM and finalizer because no global credentials serve its namespace; a template cannot read its Proxmox template.",
        action: "Re-create the ProxmoxCluster with its credentials, or delete the VM yourself and remove the proxmoxmachine.infrastructure.cluster.x-k8s.io finalizer.",
    },
    Reason {
        name: "ProxmoxEndpointChanged",
        seen: MACHINE_WAITS,
        meaning: "The machine's VM was recorded on another Proxmox endpoint than its zone's credentials reach now, and is not found there: capmox creates no second VM, and a deletion keeps the finalizer.",
        action: "Point the zone's credentials back at the Proxmox in status.proxmoxEndpoint, or move the VM.",
    },
    Reason {
        name: "ProxmoxForbidden",
        seen: PROXMOX_FAILURE,
        meaning: "Proxmox answered 403; the message names the privilege and path Proxmox reported (e.g. VM.Clone on /vms/9000).",
        action: "Grant the token that privilege (see Security: Proxmox privileges).",
    },
    Reason {
        name: "ProxmoxLocked",
        seen: PROXMOX_FAILURE,
        meaning: "The VM is locked by another Proxmox operation (backup, migration, a clone); retried with back-off.",
        action: "Nothing, unless the lock is stale (qm unlock on the node).",
    },
    Reason {
        name: "ProxmoxNotFound",
        seen: PROXMOX_FAILURE,
        meaning: "Proxmox does not know a node, storage or template the request named.",
        action: "Fix the name in the spec (sourceNode, storage, templateID) or in Proxmox.",
    },
    Reason {
        name: "ProxmoxRateLimited",
        seen: PROXMOX_FAILURE,
        meaning: "Proxmox (or a proxy in front of it) answered 429; capmox waits at least its Retry-After.",
        action: "Nothing; raise the proxy's limits if it lasts.",
    },
    Reason {
        name: "ProxmoxRequestRejected",
        seen: PROXMOX_FAILURE,
        meaning: "Proxmox refused the request (another 4xx, parameter errors, each named; \"already exists\"), or capmox refused to send a value that breaks Proxmox's formats.",
        action: "Fix the field the message names.",
    },
    Reason {
        name: "ProxmoxResponseInvalid",
        seen: PROXMOX_FAILURE,
        meaning: "An answer that cannot be decoded: the URL probably points at something other than the Proxmox API.",
        action: "Check the credentials' url.",
    },
    Reason {
        name: "ProxmoxServerError",
        seen: PROXMOX_FAILURE,
        meaning: "Proxmox answered 5xx, e.g. no quorum, or \"can't clone VM to node (VM uses local storage)\".",
        action: "Read Proxmox's answer in the message; fix Proxmox or the template's storage.",
    },
    Reason {
        name: "ProxmoxUnavailable",
        seen: &[
            DOMAINS_FALSE,
            MACHINE_PROVISIONED_FALSE,
            MACHINE_READY_FALSE,
            REMEDIATED_FALSE,
        ],
        meaning: "Some of the cluster's Proxmox endpoints do not answer: the lost failure domains stay published and their machines wait; a machine whose zone's Proxmox cannot be reached waits; a remediation that cannot reach its VM's Proxmox tries again every 30 s.",
        action: "Bring the Proxmox back. Its zones stay offered to the control plane for capmox run --zone-drain-after, then are not until it answers again (FailureDomainsAvailable).",
    },
    Reason {
        name: "ProxmoxUnreachable",
        seen: PROXMOX_FAILURE,
        meaning: "No connection, a proxy's 502-504, or pveproxy's 595-599 for a node it cannot reach; retried with back-off.",
        action: "Check the network path to Proxmox and the node's state.",
    },
    Reason {
        name: "Ready",
        seen: &[
            condition(CLUSTER, "Ready", "True"),
            condition(CLUSTER, "FailureDomainsReady", "True"),
            condition(MACHINE, "Ready", "True"),
        ],
        meaning: "Everything the object reports is fine.",
        action: "Nothing.",
    },
    Reason {
        name: "Rebooting",
        seen: &[REMEDIATED_FALSE],
        meaning: "The unhealthy Machine's VM is rebooting cleanly (ACPI or guest agent); the message counts the reboots against spec.strategy.retryLimit.",
        action: "Nothing; if the guest does not shut down within shutdownTimeoutSeconds the VM is reset.",
    },
    Reason {
        name: "ReplacementRequested",
        seen: &[REMEDIATED_FALSE],
        meaning: "Reboots did not make the Node healthy (or there is no VM to reboot, or the reset failed): the Machine's OwnerRemediated condition is False, so its MachineSet or KubeadmControlPlane replaces it. The message says why.",
        action: "Nothing; look into why the Node did not recover if it keeps happening.",
    },
    Reason {
        name: "Resetting",
        seen: &[REMEDIATED_FALSE],
        meaning: "The clean reboot did not finish within spec.strategy.shutdownTimeoutSeconds (a hung guest): the VM is hard-reset.",
        action: "Nothing.",
    },
    Reason {
        name: "Resolved",
        seen: &[condition(TEMPLATE, "CapacityResolved", "True")],
        meaning: "status.capacity and status.nodeInfo are complete.",
        action: "Nothing.",
    },
    Reason {
        name: "TaskFailed",
        seen: &[
            MACHINE_PROVISIONED_FALSE,
            MACHINE_READY_FALSE,
            MACHINE_WARNING,
        ],
        meaning: "A Proxmox task of the machine failed (the message has its exit status); it is retried after a back-off kept in status.retryAfter (10 s doubling to 5 minutes).",
        action: "Read the task log in Proxmox (the message names the UPID) and fix the cause.",
    },
    Reason {
        name: "TaskRepeated",
        seen: &[
            MACHINE_PROVISIONED_FALSE,
            MACHINE_READY_FALSE,
            MACHINE_WARNING,
        ],
        meaning: "Tasks of one kind succeeded more than 3 times in a row on the machine's VM: a write Proxmox reports done does not stick, so capmox backs off (10 s doubling to 5 minutes).",
        action: "Compare what the message says capmox wrote with the VM's config in Proxmox; report it if Proxmox is right.",
    },
    Reason {
        name: "TemplateIncomplete",
        seen: &[CAPACITY_FALSE],
        meaning: "The Proxmox template's config lacks values the spec leaves to it (sockets, cores, memory, the boot disk), so status.capacity is incomplete.",
        action: "Set them in the ProxmoxMachineTemplate's spec or in the Proxmox template.",
    },
    Reason {
        name: "TemplateNotFound",
        seen: PLACEMENT,
        meaning: "No Proxmox template matches: templateID on sourceNode is not a template (capmox never clones a plain VM), or no template carries the selector's tags.",
        action: "Fix templateID/sourceNode or the tags; convert the VM to a template in Proxmox.",
    },
    Reason {
        name: "TemplateUnreachable",
        seen: PLACEMENT,
        meaning: "No node of the machine's zone can receive a clone of the template: its copies are on node-local storage of other nodes. The message names each copy's node and storage; checked again every minute.",
        action: "Put a copy of the template (same name and tags) on a node of the zone, or on shared storage.",
    },
    Reason {
        name: "TLSVerificationFailed",
        seen: PROXMOX_FAILURE,
        meaning: "Proxmox's certificate does not verify with the trust settings (system roots, root_ca, fingerprint).",
        action: "Give root_ca or fingerprint in the Secret (--proxmox-root-ca-file or --proxmox-fingerprint for the global credentials), or set insecure explicitly.",
    },
    Reason {
        name: "Unauthorized",
        seen: PROXMOX_FAILURE,
        meaning: "Proxmox answered 401: wrong token id or secret, or an expired token.",
        action: "Fix token and secret in the credentials; capmox reads the Secret again at once after a 401.",
    },
    Reason {
        name: "UnknownNode",
        seen: &[DOMAINS_FALSE],
        meaning: "A zone names a node Proxmox does not know. The last good failure domains stay published.",
        action: "Fix spec.zoneConfig or add the node.",
    },
    Reason {
        name: "UnknownZone",
        seen: PLACEMENT,
        meaning: "The machine's zone (Machine.spec.failureDomain or spec.network.zone) is not in the ProxmoxCluster's zoneConfig.",
        action: "Fix the zone name, or add the zone.",
    },
    Reason {
        name: "VirtualMachineNotFound",
        seen: &[
            MACHINE_PROVISIONED_FALSE,
            MACHINE_READY_FALSE,
            MACHINE_WARNING,
        ],
        meaning: "spec.providerID names a VM that Proxmox does not have (e.g. a backup restored after its VMs were replaced); a machine with a provider ID never gets a new VM.",
        action: "Bring the VM back (same name and SMBIOS UUID), or delete the machine.",
    },
    Reason {
        name: "VMIDRangeExhausted",
        seen: MACHINE_WAITS,
        meaning: "No free VMID in spec.vmIDRange (or in Proxmox); looked at again every minute.",
        action: "Widen vmIDRange or free VMIDs.",
    },
    Reason {
        name: "VMIDTaken",
        seen: MACHINE_WAITS,
        meaning: "The chosen VMID was taken by something else meanwhile; capmox picks another.",
        action: "Nothing; give shards or management clusters disjoint vmIDRanges to avoid it.",
    },
    Reason {
        name: "WaitingForBootstrapData",
        seen: MACHINE_WAITS,
        meaning: "The Machine has no bootstrap data Secret yet, or it does not exist yet.",
        action: "Nothing; check the bootstrap provider if it lasts.",
    },
    Reason {
        name: "WaitingForCloudInit",
        seen: MACHINE_WAITS,
        meaning: "The guest runs cloud-init; capmox reads its result file (/run/cloud-init/result.json) again later.",
        action: "Nothing; for Flatcar set checks.skipCloudInitStatus: true (it has no cloud-init).",
    },
    Reason {
        name: "WaitingForClusterInfrastructure",
        seen: MACHINE_WAITS,
        meaning: "The ProxmoxCluster is not provisioned yet.",
        action: "Look at the ProxmoxCluster's conditions.",
    },
    Reason {
        name: "WaitingForDHCPAddress",
        seen: MACHINE_WAITS,
        meaning: "A NIC takes its address by DHCP and the guest agent reports none on its MAC yet; the message names the NIC, its MAC and bridge.",
        action: "Nothing; if it lasts, check that a DHCP server answers on that bridge (and VLAN) and that the guest agent runs.",
    },
    Reason {
        name: "WaitingForGuestAgent",
        seen: MACHINE_WAITS,
        meaning: "The VM was started; the guest is booting and its QEMU guest agent does not answer yet.",
        action: "Nothing; if it lasts, check that the template has the guest agent installed and enabled (agent: 1).",
    },
    Reason {
        name: "WaitingForHA",
        seen: MACHINE_WAITS,
        meaning: "The VM's HA rules changed concurrently in Proxmox and are written again.",
        action: "Nothing.",
    },
    Reason {
        name: "WaitingForNetwork",
        seen: MACHINE_WAITS,
        meaning: "The network configuration lacks an address (an IP claim not bound yet) or a NIC's MAC (the VM config not read yet).",
        action: "Nothing; check the IPAM provider if it lasts.",
    },
    Reason {
        name: "WaitingForNode",
        seen: &[REMEDIATED_FALSE],
        meaning: "The VM restarted; its Node has spec.strategy.timeoutSeconds to be healthy again, when the MachineHealthCheck deletes the request. After that comes the next reboot, or the replacement.",
        action: "Nothing.",
    },
    Reason {
        name: "WaitingForRemediation",
        seen: &[condition("Machine", "OwnerRemediated", "False")],
        meaning: "Written on the Machine by a ProxmoxRemediation whose reboots did not help, as the MachineHealthCheck writes it without a remediation template: the Machine's owner (MachineSet or KubeadmControlPlane) replaces it.",
        action: "Nothing.",
    },
    Reason {
        name: "WaitingForStaticIPAllocation",
        seen: MACHINE_WAITS,
        meaning: "The machine's IPAddressClaims are not bound yet.",
        action: "Nothing; if it lasts, check the IPAM provider and that the pools have free addresses.",
    },
    Reason {
        name: "WaitingForTask",
        seen: MACHINE_WAITS,
        meaning: "A Proxmox task of the machine runs (the message names it and its purpose).",
        action: "Nothing.",
    },
    Reason {
        name: "WaitingForTaskSlot",
        seen: MACHINE_WAITS,
        meaning: "As many clone or disk tasks as the ProxmoxCluster's (or its zone's) taskLimits allow run on the machine's node or storage; the machine waits in capmox's queue, in the order machines came, and is woken when a slot frees (it also looks again every 2 minutes). The message names the node or storage and the limit; capmox_task_slot_waiting counts the machines waiting.",
        action: "Nothing; raise spec.taskLimits.perNode / perStorage (or the zone's) if your storage takes more clones at once.",
    },
    Reason {
        name: "WaitingForVMConfig",
        seen: MACHINE_WAITS,
        meaning: "The VM's config shows no SMBIOS UUID even after capmox wrote one; looked at again after 1 s, doubling to 30 s.",
        action: "Check the VM's smbios1 option in Proxmox.",
    },
    Reason {
        name: "ZoneConflict",
        seen: PLACEMENT,
        meaning: "Machine.spec.failureDomain and ProxmoxMachine spec.network.zone are both set and differ.",
        action: "Make them agree, or drop spec.network.zone.",
    },
    Reason {
        name: "ZoneRecovering",
        seen: &[DOMAINS_AVAILABLE_FALSE, CLUSTER_READY_FALSE],
        meaning: "A zone that was taken from the control plane for its health is healthy again; it is offered again once it has stayed healthy for capmox run --zone-restore-after.",
        action: "Nothing: the message says when the zone is offered again.",
    },
    Reason {
        name: "ZoneUnhealthy",
        seen: &[DOMAINS_AVAILABLE_FALSE, CLUSTER_READY_FALSE],
        meaning: "A zone has no online node, none of its online nodes can take a VM disk (every storage for VM disks inactive or at least 98% used), or its Proxmox does not answer. After capmox run --zone-drain-after its failure domain is published with controlPlane: false, so KCP places new control-plane machines elsewhere (never every zone at once); its machines wait.",
        action: "Bring the zone's nodes, storages or its Proxmox back, or free space; to take a zone out on purpose, set controlPlaneEligible: false on it.",
    },
];

/// The reason named `name`, if capmox has one.
pub fn find(name: &str) -> Option<&'static Reason> {
    REASONS.iter().find(|reason| reason.name == name)
}

#[cfg(test)]
mod tests {
    use super::REASONS;

    #[test]
    fn reasons_are_sorted_and_unique() {
        let names: Vec<String> = REASONS.iter().map(|r| r.name.to_lowercase()).collect();
        let mut sorted = names.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(
            names, sorted,
            "keep REASONS alphabetical, without duplicates"
        );
    }

    #[test]
    fn every_reason_says_where_it_is_seen_and_what_to_do() {
        for reason in REASONS {
            assert!(!reason.seen.is_empty(), "{}", reason.name);
            assert!(reason.meaning.ends_with('.'), "{}", reason.name);
            assert!(reason.action.ends_with('.'), "{}", reason.name);
        }
    }
}
