//! `capmox-sandbox` (`make sandbox`): capmox doing its job on one machine. One process runs the
//! in-process Kubernetes API (served on 127.0.0.1 with a kubeconfig), the Proxmox VE simulator with two
//! zones and a spare node, capmox's real controllers, and the stand-ins for CAPI core and IPAM;
//! it applies an example cluster and reports where every machine landed. With a multi-site
//! `--topology` file ([`crate::sites`]) it runs one simulator per site, and the example
//! cluster's zones on every site but the first name that site's credentials Secret.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, PostParams};
use kube::runtime::watcher;
use kube::{Client, ResourceExt};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use super::conversion::LocalWebhook;
use super::sites::{SandboxTopology, Site, SitesError};
use super::standin::{CapiStandIn, ExampleCluster, create_example_cluster};
use capmox::api::ProxmoxMachine;
use capmox::controller::{Context, GlobalCredentials, ManagerConfig};
use capmox_sim::{SimOptions, Simulator, Topology};
use capmox_testkit::{ApiServer, KindInfo};

/// Why the sandbox could not run.
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    /// The simulator did not start.
    #[error("Proxmox simulator: {0}")]
    Simulator(#[from] capmox_sim::SimStartError),
    /// A topology file was unusable.
    #[error(transparent)]
    Topology(#[from] capmox_sim::topology::TopologyError),
    /// A multi-site topology file was unusable.
    #[error(transparent)]
    Sites(#[from] SitesError),
    /// A site lacks the template the example machines clone.
    #[error(
        "site '{site}' has no template {vmid} on node {node}, which the example machines clone"
    )]
    Template {
        /// The site.
        site: String,
        /// The template's VMID.
        vmid: u32,
        /// Its node.
        node: String,
    },
    /// The workers' failure domain is none of the multi-site file's zones.
    #[error(
        "the workers' failure domain '{domain}' is not a zone of the topology file (its zones: {zones})"
    )]
    WorkerFailureDomain {
        /// `--worker-failure-domain`.
        domain: String,
        /// The zones there are.
        zones: String,
    },
    /// The in-process Kubernetes API could not be set up or served.
    #[error("in-process Kubernetes API: {0}")]
    Testkit(String),
    /// A Kubernetes call failed.
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    /// Creating the example cluster failed.
    #[error("example cluster: {0}")]
    Example(#[from] super::standin::StandInError),
    /// The kubeconfig could not be written.
    #[error("cannot write the kubeconfig {path}: {source}")]
    Kubeconfig {
        /// Where.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The machines did not all become ready in time.
    #[error("timed out after {0:?} waiting for the machines to become ready")]
    Timeout(Duration),
}

/// What the sandbox runs.
#[derive(Clone, Debug)]
pub struct SandboxOptions {
    /// Control-plane machines (spread over the control-plane failure domains).
    pub control_plane: i32,
    /// Worker machines (pinned to the worker failure domain).
    pub workers: i32,
    /// Failure domain of the workers.
    pub worker_failure_domain: String,
    /// Proxmox topology: one simulator topology, or a multi-site file ([`crate::sites`]); the
    /// built-in two-rack topology when unset.
    pub topology: Option<PathBuf>,
    /// Where to write the kubeconfig of the in-process API.
    pub kubeconfig: PathBuf,
    /// Simulated task durations and boot delay.
    pub sim: SimOptions,
    /// Give up after this long.
    pub timeout: Duration,
    /// Print progress.
    pub verbose: bool,
    /// The guest OS of the example machines, which decides their bootstrap data format.
    pub os: GuestOs,
    /// Proxmox HA on for the example cluster (`spec.ha.enabled`): after provisioning, show
    /// the HA resources and rules (PVE 9) or groups (PVE 8), fail a node and show where its
    /// VMs went.
    pub ha: bool,
    /// Hardware for the workers (a GPU, DHCP, data disks and UEFI), shown in the summary.
    pub example: Option<crate::examples::Example>,
}

/// The guest OS the example machines are built for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GuestOs {
    /// cloud-config bootstrap data, cloud-init checked in the guest.
    #[default]
    Ubuntu,
    /// Ignition bootstrap data (`format: ignition`), no cloud-init check (as the Go provider's
    /// flatcar template sets `checks.skipCloudInitStatus`).
    Flatcar,
}

impl Default for SandboxOptions {
    fn default() -> Self {
        Self {
            control_plane: 3,
            workers: 2,
            worker_failure_domain: "rack-b".into(),
            topology: None,
            kubeconfig: std::env::temp_dir().join("capmox-sandbox.kubeconfig"),
            sim: SimOptions::default(),
            timeout: Duration::from_secs(300),
            verbose: true,
            os: GuestOs::default(),
            ha: false,
            example: None,
        }
    }
}

/// The built-in topology: rack-a (pve1, pve2), rack-b (pve3, pve4) and a spare pve5, one
/// shared storage with the template and a local ISO storage on every node, a GPU mapping over
/// pve2-pve4 and a DHCP server on vmbr0.
pub const TOPOLOGY: &str = r#"
cluster_name: sandbox
nodes:
  - {name: pve1, memory_mib: 65536, cores: 16}
  - {name: pve2, memory_mib: 65536, cores: 16, pci_devices: [{id: '0000:41:00.0', vendor: '10de', device: '2204', iommugroup: 30}]}
  - {name: pve3, memory_mib: 65536, cores: 16, pci_devices: [{id: '0000:41:00.0', vendor: '10de', device: '2204', iommugroup: 30}]}
  - {name: pve4, memory_mib: 65536, cores: 16, pci_devices: [{id: '0000:41:00.0', vendor: '10de', device: '2204', iommugroup: 30}]}
  - {name: pve5, memory_mib: 65536, cores: 16}
storages:
  - {name: local, type: dir, content: [iso, vztmpl, snippets, images]}
  - {name: ceph, type: rbd, shared: true, content: [images], size_gib: 4096}
templates:
  - {vmid: 9000, name: ubuntu-2404-kube, node: pve1, tags: [capmox, ubuntu], storage: ceph, disk_gib: 10, config: {agent: "1", net0: "virtio=BC:24:11:00:90:00,bridge=vmbr0"}}
pci_mappings:
  - name: gpu
    description: one GPU on pve2, pve3 and pve4
    map:
      - {node: pve2, path: '0000:41:00.0', id: '10de:2204', iommugroup: 30}
      - {node: pve3, path: '0000:41:00.0', id: '10de:2204', iommugroup: 30}
      - {node: pve4, path: '0000:41:00.0', id: '10de:2204', iommugroup: 30}
dhcp:
  - {bridge: vmbr0, range4: 10.0.9.100-10.0.9.200, prefix4: 24, gateway4: 10.0.9.1}
"#;

/// A running sandbox: the API server, the simulator(s) and the controllers.
pub struct Sandbox {
    /// The in-process Kubernetes API.
    pub server: ApiServer,
    /// The simulator(s), one per site; the sandbox derefs to them.
    pub proxmox: SiteSimulators,
    /// The controllers' shared context.
    pub context: Arc<Context>,
    /// Stops everything.
    pub stop: CancellationToken,
    http: Option<capmox_testkit::HttpServer>,
    /// capmox's conversion webhook, which the API server calls for `v1alpha1` requests.
    pub webhook: LocalWebhook,
}

/// The Proxmox side of a sandbox, one simulator per site: shared by the in-process sandbox and
/// `e2e-real`, so both wire and check the sites the same way.
pub struct SiteSimulators {
    /// The Proxmox VE simulator (of the first site, in a multi-site sandbox): what the
    /// ProxmoxCluster's own credentials reach.
    pub sim: Simulator,
    /// The sites of a multi-site `--topology` file and the simulators of all but the first;
    /// `None` for one Proxmox cluster.
    pub sites: Option<SandboxSites>,
    /// Guests (templates included) each simulator started with, first site first, so the
    /// summary counts the VMs the machines added.
    initial_guests: Vec<usize>,
}

/// The sites of a multi-site sandbox, kept together so each simulator is known by its site.
pub struct SandboxSites {
    /// The sites as the file describes them; the first is served by [`SiteSimulators::sim`].
    pub sites: Vec<Site>,
    /// The simulators of `sites[1..]`, in the same order.
    pub others: Vec<Simulator>,
}

/// The Secret with the credentials of site `site` (of every site but the first, whose zones
/// use the cluster's own `demo-proxmox-credentials`).
pub fn site_credentials_secret(cluster: &str, site: &str) -> String {
    format!("{cluster}-{site}-proxmox-credentials")
}

/// The simulator options of the site at `index`: every site but the first gets a token secret
/// of its own, so a zone reached with another site's credentials fails to authenticate instead
/// of working by accident.
fn site_sim_options(base: &SimOptions, index: usize) -> SimOptions {
    let mut options = base.clone();
    if index > 0 {
        options.token_secret = format!("00000000-0000-4000-8000-{index:012x}");
    }
    options
}

/// The sandbox's Proxmox questions (sites, endpoints, the table) are its simulators' to answer.
impl Drop for Sandbox {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// The kinds the sandbox needs besides capmox's own (status subresources as CAPI's CRDs have);
/// public so the benchmark can assemble the same environment on its own runtimes.
pub fn capi_kinds() -> Vec<KindInfo> {
    [
        ("cluster.x-k8s.io", "v1beta2", "Cluster", "clusters"),
        ("cluster.x-k8s.io", "v1beta2", "Machine", "machines"),
        (
            "cluster.x-k8s.io",
            "v1beta2",
            "MachineDeployment",
            "machinedeployments",
        ),
        (
            "controlplane.cluster.x-k8s.io",
            "v1beta2",
            "KubeadmControlPlane",
            "kubeadmcontrolplanes",
        ),
        (
            "ipam.cluster.x-k8s.io",
            "v1beta2",
            "IPAddressClaim",
            "ipaddressclaims",
        ),
        (
            "ipam.cluster.x-k8s.io",
            "v1beta2",
            "IPAddress",
            "ipaddresses",
        ),
        (
            "ipam.cluster.x-k8s.io",
            "v1alpha2",
            "InClusterIPPool",
            "inclusterippools",
        ),
    ]
    .into_iter()
    .map(|(group, version, kind, plural)| {
        let mut info = KindInfo::builtin(group, version, kind, plural, true);
        info.status_subresource = true;
        info
    })
    .chain(std::iter::once({
        // Read by the CAPI stand-in for the workers' bootstrap format only.
        KindInfo::builtin(
            "bootstrap.cluster.x-k8s.io",
            "v1beta2",
            "KubeadmConfigTemplate",
            "kubeadmconfigtemplates",
            true,
        )
    }))
    .chain(std::iter::once({
        let mut info = KindInfo::builtin(
            "ipam.cluster.x-k8s.io",
            "v1alpha2",
            "GlobalInClusterIPPool",
            "globalinclusterippools",
            false,
        );
        info.status_subresource = true;
        info
    }))
    .collect()
}

impl Sandbox {
    /// Starts the API server (served over HTTP with a kubeconfig), the simulator, capmox's
    /// controllers and the stand-ins.
    pub async fn start(options: &SandboxOptions, serve_http: bool) -> Result<Self, SandboxError> {
        let server = ApiServer::new();
        server.register_builtin_kinds();
        let stop = CancellationToken::new();
        // v1alpha1 requests are converted by capmox's own webhook, as in a real installation.
        let webhook = LocalWebhook::start(stop.clone())
            .await
            .map_err(|e| SandboxError::Testkit(e.to_string()))?;
        for mut crd in capmox::api::crd::all().map_err(|e| SandboxError::Testkit(e.to_string()))? {
            webhook.convert_through(&mut crd);
            let yaml = capmox::api::crd::to_yaml(&crd)
                .map_err(|e| SandboxError::Testkit(e.to_string()))?;
            server
                .register_crd_yaml(&yaml)
                .map_err(|e| SandboxError::Testkit(e.to_string()))?;
        }
        for kind in capi_kinds() {
            server.register_kind(kind);
        }
        let proxmox = SiteSimulators::start(options.topology.as_deref(), &options.sim).await?;
        let http = if serve_http {
            let http = server
                .serve_http()
                .await
                .map_err(|e| SandboxError::Testkit(e.to_string()))?;
            http.write_kubeconfig(&options.kubeconfig)
                .map_err(|source| SandboxError::Kubeconfig {
                    path: options.kubeconfig.clone(),
                    source,
                })?;
            Some(http)
        } else {
            None
        };
        let config = ManagerConfig {
            metrics_address: ([127, 0, 0, 1], 0).into(),
            health_address: ([127, 0, 0, 1], 0).into(),
            leader_election: None,
            watch_namespace: None,
            watch_filter: None,
            cluster_concurrency: 4,
            machine_concurrency: 16,
            task_timing: Default::default(),
            zone_holds: Default::default(),
            proxmox_requests_in_flight: capmox::proxmox::DEFAULT_REQUESTS_IN_FLIGHT,
            webhook: None,
        };
        let context = Arc::new(Context::new(
            server.client(),
            config,
            GlobalCredentials::default(),
        ));
        tokio::spawn(capmox::controller::run_controllers(
            context.clone(),
            stop.clone(),
        ));
        tokio::spawn(super::ipam::run(server.client(), stop.clone()));
        CapiStandIn::spawn(server.client(), "default", stop.clone());
        Ok(Self {
            server,
            proxmox,
            context,
            stop,
            http,
            webhook,
        })
    }

    /// The Kubernetes client of the sandbox.
    pub fn client(&self) -> Client {
        self.server.client()
    }

    /// Where `kubectl` can reach the API, when served.
    pub fn api_url(&self) -> Option<String> {
        self.http.as_ref().map(|h| h.url())
    }
}

impl SiteSimulators {
    /// Starts one simulator for a simulator topology file (the built-in topology when
    /// `topology` is `None`), or one per site of a multi-site file, each site with a token of
    /// its own.
    pub async fn start(topology: Option<&Path>, sim: &SimOptions) -> Result<Self, SandboxError> {
        let topology = match topology {
            Some(path) => SandboxTopology::load(path)?,
            None => SandboxTopology::Single(Box::new(Topology::from_yaml(
                TOPOLOGY,
                "built-in sandbox topology",
            )?)),
        };
        let guests = |t: &Topology| t.templates.len() + t.guests.len();
        let (first, sites, initial_guests) = match topology {
            SandboxTopology::Single(topology) => {
                let initial = vec![guests(&topology)];
                (
                    Simulator::start(*topology, sim.clone()).await?,
                    None,
                    initial,
                )
            }
            SandboxTopology::Sites(sites) => {
                let mut simulators = Vec::with_capacity(sites.len());
                for (index, site) in sites.iter().enumerate() {
                    simulators.push(
                        Simulator::start(site.topology.clone(), site_sim_options(sim, index))
                            .await?,
                    );
                }
                let initial = sites.iter().map(|s| guests(&s.topology)).collect();
                let mut simulators = simulators.into_iter();
                let Some(first) = simulators.next() else {
                    return Err(SandboxError::Testkit(
                        "a multi-site file without sites".into(),
                    ));
                };
                let others = simulators.collect();
                (first, Some(SandboxSites { sites, others }), initial)
            }
        };
        Ok(Self {
            sim: first,
            sites,
            initial_guests,
        })
    }

    /// Every simulator with its site's name (`None` in a single-site sandbox), first site first.
    pub fn simulators(&self) -> Vec<(Option<&str>, &Simulator)> {
        match &self.sites {
            None => vec![(None, &self.sim)],
            Some(sites) => sites
                .sites
                .iter()
                .map(|s| Some(s.name.as_str()))
                .zip(std::iter::once(&self.sim).chain(&sites.others))
                .collect(),
        }
    }

    /// The simulator of site `name`.
    pub fn site_simulator(&self, name: &str) -> Option<&Simulator> {
        self.simulators()
            .into_iter()
            .find_map(|(site, sim)| (site == Some(name)).then_some(sim))
    }

    /// The site whose simulator serves `endpoint` (a ProxmoxMachine's `status.proxmoxEndpoint`).
    pub fn site_of_endpoint(&self, endpoint: &str) -> Option<&str> {
        let endpoint = endpoint.trim_end_matches('/');
        self.simulators()
            .into_iter()
            .find_map(|(site, sim)| (sim.url() == endpoint).then_some(site).flatten())
    }

    /// The site zone `zone` belongs to, in a multi-site sandbox.
    pub fn site_of_zone(&self, zone: &str) -> Option<&str> {
        self.sites.as_ref()?.sites.iter().find_map(|s| {
            s.zones
                .iter()
                .any(|z| z.zone == zone)
                .then_some(s.name.as_str())
        })
    }

    /// The simulator a row's VM is on: the one its recorded endpoint names, else the first.
    fn simulator_of(&self, row: &MachineRow) -> &Simulator {
        self.simulators()
            .into_iter()
            .find(|(_, sim)| sim.url() == row.endpoint.trim_end_matches('/'))
            .map_or(&self.sim, |(_, sim)| sim)
    }

    /// Refuses an example cluster the sites cannot hold, before anything is created: the
    /// workers' failure domain must be a zone of the file, and every site needs the template
    /// the example machines clone.
    pub fn check_example(&self, worker_failure_domain: &str) -> Result<(), SandboxError> {
        let Some(sites) = &self.sites else {
            return Ok(());
        };
        let zones: Vec<&str> = sites
            .sites
            .iter()
            .flat_map(|s| s.zones.iter().map(|z| z.zone.as_str()))
            .collect();
        if !zones.contains(&worker_failure_domain) {
            return Err(SandboxError::WorkerFailureDomain {
                domain: worker_failure_domain.to_owned(),
                zones: zones.join(", "),
            });
        }
        let spec = example_machine_spec();
        let (vmid, node) = (
            spec["templateID"].as_u64().unwrap_or_default(),
            spec["sourceNode"].as_str().unwrap_or_default(),
        );
        for site in &sites.sites {
            let has = site
                .topology
                .templates
                .iter()
                .any(|t| u64::from(t.vmid) == vmid && t.node == node);
            if !has {
                return Err(SandboxError::Template {
                    site: site.name.clone(),
                    vmid: u32::try_from(vmid).unwrap_or_default(),
                    node: node.to_owned(),
                });
            }
        }
        Ok(())
    }

    /// Creates the credentials Secrets of cluster `cluster` in `namespace`:
    /// `<cluster>-proxmox-credentials` for the first simulator and
    /// [`site_credentials_secret`] for every other site's; returns their names, first first.
    pub async fn create_credentials(
        &self,
        client: &Client,
        namespace: &str,
        cluster: &str,
    ) -> Result<Vec<String>, SandboxError> {
        let mut secrets = vec![(format!("{cluster}-proxmox-credentials"), &self.sim)];
        if let Some(sites) = &self.sites {
            for (site, sim) in sites.sites.iter().skip(1).zip(&sites.others) {
                secrets.push((site_credentials_secret(cluster, &site.name), sim));
            }
        }
        let api = Api::<Secret>::namespaced(client.clone(), namespace);
        for (name, sim) in &secrets {
            let token = sim.token();
            let (id, secret) = token.split_once('=').unwrap_or((token.as_str(), ""));
            let credentials: Secret = serde_json::from_value(json!({
                "apiVersion": "v1", "kind": "Secret",
                "metadata": {"name": name, "namespace": namespace},
                "stringData": {"url": sim.url(), "token": id, "secret": secret}
            }))
            .map_err(|e| SandboxError::Testkit(e.to_string()))?;
            api.create(&PostParams::default(), &credentials).await?;
        }
        Ok(secrets.into_iter().map(|(name, _)| name).collect())
    }

    /// The example ProxmoxCluster spec for these simulators: [`example_cluster_spec`] for one,
    /// [`sites_cluster_spec`] for several sites.
    pub fn cluster_spec(&self, cluster: &str) -> Value {
        match &self.sites {
            None => example_cluster_spec(),
            Some(sites) => sites_cluster_spec(cluster, &sites.sites),
        }
    }

    /// Per simulator, first site first: its site, the VMs it holds beyond those it started
    /// with, and its ISO images, so a run can check that deleting left nothing behind.
    pub fn leftovers(&self) -> Vec<(Option<&str>, usize, usize)> {
        self.simulators()
            .into_iter()
            .zip(&self.initial_guests)
            .map(|((site, sim), initial)| {
                let (vms, isos) = sim.with_cluster(|c| (c.vm_count(), c.iso_count()));
                (site, vms.saturating_sub(*initial), isos)
            })
            .collect()
    }
}

impl Sandbox {
    /// Creates the credentials and the example cluster `demo`: zones rack-a and rack-b (in a
    /// multi-site sandbox: the file's zones, those of every site but the first with that
    /// site's credentials Secret), the control plane spread over them, the workers pinned to
    /// `worker_failure_domain`.
    pub async fn apply_example(
        &self,
        options: &SandboxOptions,
    ) -> Result<ExampleCluster, SandboxError> {
        self.proxmox.check_example(&options.worker_failure_domain)?;
        self.proxmox
            .create_credentials(&self.client(), "default", "demo")
            .await?;
        let flatcar = options.os == GuestOs::Flatcar;
        let mut machine_spec = example_machine_spec();
        if flatcar {
            // Flatcar has no cloud-init to wait for.
            machine_spec["checks"] = json!({"skipCloudInitStatus": true});
        }
        let mut cluster_spec = self.proxmox.cluster_spec("demo");
        if options.ha {
            cluster_spec["ha"] = json!({"enabled": true});
        }
        let mut example = ExampleCluster::new("default", "demo", cluster_spec, machine_spec);
        example.bootstrap_format = flatcar.then(|| "ignition".to_owned());
        example.control_plane_replicas = options.control_plane;
        example.worker_replicas = options.workers;
        example.worker_failure_domain = Some(options.worker_failure_domain.clone());
        example.worker_machine_spec = options
            .example
            .map(|hardware| hardware.worker_spec(&example.machine_spec));
        create_example_cluster(&self.client(), &example).await?;
        Ok(example)
    }

    /// The simulators' HA configuration: one line per HA resource, rule (PVE 9) and group
    /// (PVE 8), under a line naming the site in a multi-site sandbox.
    pub fn ha_report(&self) -> String {
        let mut lines = Vec::new();
        for (site, sim) in self.proxmox.simulators() {
            if let Some(site) = site {
                lines.push(format!("  site {site} ({}):", sim.url()));
            }
            lines.push(Self::ha_report_of(sim));
        }
        lines.retain(|l| !l.is_empty());
        lines.join("\n")
    }

    /// One simulator's part of [`Self::ha_report`].
    fn ha_report_of(sim: &Simulator) -> String {
        let mut lines = Vec::new();
        for r in sim.ha_resources() {
            let node = r
                .vmid()
                .and_then(|vmid| sim.with_cluster(|c| c.vm_node(vmid)))
                .unwrap_or_default();
            lines.push(format!(
                "  resource {:<8} on {node:<5} state {:<8} {}{}",
                r.sid,
                r.requested_state(),
                r.group
                    .as_deref()
                    .map(|g| format!("group {g}; "))
                    .unwrap_or_default(),
                r.comment.as_deref().unwrap_or_default()
            ));
        }
        for rule in sim.ha_rules() {
            let what = match &rule.kind {
                capmox_sim::HaRuleKind::NodeAffinity { nodes, strict } => format!(
                    "node-affinity nodes {}{}",
                    nodes.keys().cloned().collect::<Vec<_>>().join(","),
                    if *strict { " (strict)" } else { "" }
                ),
                capmox_sim::HaRuleKind::ResourceAffinity { affinity } => {
                    format!("resource-affinity {}", affinity.as_str())
                }
            };
            lines.push(format!(
                "  rule {} {what}: {}",
                rule.rule,
                rule.resources.iter().cloned().collect::<Vec<_>>().join(",")
            ));
        }
        for group in sim.ha_groups() {
            lines.push(format!(
                "  group {} nodes {}{}",
                group.group,
                group.nodes.keys().cloned().collect::<Vec<_>>().join(","),
                if group.restricted {
                    " (restricted)"
                } else {
                    ""
                }
            ));
        }
        lines.join("\n")
    }

    /// Fails the node a worker (else the first machine) in `rows` runs on and describes where
    /// HA recovered its VMs; the node comes back afterwards.
    pub fn ha_failover(&self, rows: &[MachineRow]) -> String {
        let worker = rows.iter().find(|r| r.machine.contains("worker"));
        let Some(row) = worker.or(rows.first()) else {
            return "  no machine to fail over".to_owned();
        };
        let node = row.node.clone();
        let sim = self.proxmox.simulator_of(row);
        let relocations = sim.fail_node(&node);
        let mut lines = vec![format!(
            "  node {node} (zone {}) failed:",
            row.failure_domain
        )];
        for r in &relocations {
            let machine = rows
                .iter()
                .find(|m| m.vmid == r.vmid.to_string() && m.endpoint == row.endpoint)
                .map_or("?", |m| m.machine.as_str());
            lines.push(format!(
                "    {} ({machine}) {} -> {} ({})",
                r.sid,
                r.from,
                r.to.as_deref()
                    .unwrap_or("nowhere, waits for a node of its zone"),
                r.state
            ));
        }
        sim.revive_node(&node);
        lines.join("\n")
    }

    /// How many of the VMs in `rows` booted each guest OS (`ubuntu`, `flatcar`), as the
    /// simulator decided from the seed image each one started with.
    pub fn booted(&self, rows: &[MachineRow]) -> BTreeMap<&'static str, usize> {
        let mut count = BTreeMap::new();
        for row in rows {
            let Ok(vmid) = row.vmid.parse() else {
                continue;
            };
            if let Some(os) = self
                .proxmox
                .simulator_of(row)
                .with_cluster(|c| c.booted_os(vmid))
            {
                let name = match os {
                    capmox_sim::guest::GuestOs::Ubuntu => "ubuntu",
                    capmox_sim::guest::GuestOs::Flatcar => "flatcar",
                };
                *count.entry(name).or_default() += 1;
            }
        }
        count
    }
}

impl SiteSimulators {
    /// Per site of a multi-site sandbox: its endpoint, the machines whose VM was created there
    /// (by `status.proxmoxEndpoint`) and the VMs it has beyond its initial ones; `None` for
    /// one site.
    pub fn site_summary(&self, rows: &[MachineRow]) -> Option<String> {
        self.sites.as_ref()?;
        let mut lines = vec!["Sites (by each machine's status.proxmoxEndpoint):".to_owned()];
        for ((site, sim), initial) in self.simulators().into_iter().zip(&self.initial_guests) {
            let machines = rows
                .iter()
                .filter(|r| r.endpoint.trim_end_matches('/') == sim.url())
                .count();
            let zones = self
                .sites
                .as_ref()
                .and_then(|s| s.sites.iter().find(|s| Some(s.name.as_str()) == site))
                .map(|s| {
                    s.zones
                        .iter()
                        .map(|z| z.zone.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                })
                .unwrap_or_default();
            let vms = sim.with_cluster(|c| c.vm_count()).saturating_sub(*initial);
            let plural = |n: usize| if n == 1 { "" } else { "s" };
            lines.push(format!(
                "  {} {} (zones {zones}): {machines} machine{}, {vms} VM{}",
                site.unwrap_or_default(),
                sim.url(),
                plural(machines),
                plural(vms)
            ));
        }
        let unplaced = rows
            .iter()
            .filter(|r| self.site_of_endpoint(&r.endpoint).is_none())
            .count();
        if unplaced > 0 {
            lines.push(format!(
                "  {unplaced} machines record no endpoint of these sites"
            ));
        }
        Some(lines.join("\n"))
    }

    /// VMs the machines added, over every simulator (what each had at start not counted).
    pub fn machine_vm_count(&self) -> usize {
        self.simulators()
            .into_iter()
            .zip(&self.initial_guests)
            .map(|((_, sim), initial)| sim.with_cluster(|c| c.vm_count()).saturating_sub(*initial))
            .sum()
    }

    /// The rows as a table: [`render`], with each machine's site and Proxmox endpoint in a
    /// multi-site sandbox.
    pub fn table(&self, rows: &[MachineRow]) -> String {
        if self.sites.is_none() {
            return render(rows);
        }
        let site = |r: &MachineRow| {
            self.site_of_endpoint(&r.endpoint)
                .map(str::to_owned)
                .unwrap_or_else(|| if r.endpoint == "-" { "-" } else { "?" }.to_owned())
        };
        render_table(
            &[
                "MACHINE",
                "SITE",
                "ENDPOINT",
                "FAILURE DOMAIN",
                "NODE",
                "VMID",
                "IPS",
                "PHASE",
            ],
            rows.iter()
                .map(|r| {
                    vec![
                        r.machine.clone(),
                        site(r),
                        r.endpoint.clone(),
                        r.failure_domain.clone(),
                        r.node.clone(),
                        r.vmid.clone(),
                        r.ips.clone(),
                        r.phase.clone(),
                    ]
                })
                .collect(),
        )
    }
}

impl Sandbox {
    /// Waits (event-driven) until `expected` ProxmoxMachines are ready, printing the table when
    /// something changes if `verbose`.
    pub async fn wait_ready(
        &self,
        expected: usize,
        timeout: Duration,
        verbose: bool,
    ) -> Result<Vec<MachineRow>, SandboxError> {
        let api: Api<ProxmoxMachine> = Api::namespaced(self.client(), "default");
        // Any event (including deletions) is a reason to look again.
        let mut stream = watcher(api.clone(), watcher::Config::default()).boxed();
        let deadline = tokio::time::Instant::now() + timeout;
        let mut last = String::new();
        loop {
            let rows = rows(&api.list(&Default::default()).await?.items);
            let table = self.proxmox.table(&rows);
            if verbose && table != last {
                println!("{table}");
                last = table;
            }
            if rows.len() == expected && rows.iter().all(|r| r.phase == "Ready") {
                return Ok(rows);
            }
            match tokio::time::timeout_at(deadline, stream.next()).await {
                Ok(Some(_)) => {}
                Ok(None) => {
                    return Err(SandboxError::Testkit(
                        "the watch on ProxmoxMachines ended".into(),
                    ));
                }
                Err(_) => return Err(SandboxError::Timeout(timeout)),
            }
        }
    }
}

/// One line of the progress table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MachineRow {
    /// ProxmoxMachine name.
    pub machine: String,
    /// Failure domain the VM is in.
    pub failure_domain: String,
    /// Proxmox node.
    pub node: String,
    /// The Proxmox API the VM was created on (`status.proxmoxEndpoint`), `-` until known.
    pub endpoint: String,
    /// VMID.
    pub vmid: String,
    /// Static addresses.
    pub ips: String,
    /// `Ready`, or the reason it waits.
    pub phase: String,
}

/// The table rows of `machines`, sorted by name.
pub fn rows(machines: &[ProxmoxMachine]) -> Vec<MachineRow> {
    let mut rows: Vec<MachineRow> = machines
        .iter()
        .map(|m| {
            let status = m.status.clone().unwrap_or_default();
            let ready = m.is_provisioned();
            let phase = if ready {
                "Ready".to_owned()
            } else {
                status
                    .conditions
                    .iter()
                    .find(|c| c.type_ == capmox::api::conditions::VIRTUAL_MACHINE_PROVISIONED)
                    .map(|c| c.reason.clone())
                    .unwrap_or_else(|| "Pending".into())
            };
            MachineRow {
                machine: m.name_any(),
                failure_domain: status.failure_domain.unwrap_or_else(|| "-".into()),
                node: status.proxmox_node.unwrap_or_else(|| "-".into()),
                endpoint: status.proxmox_endpoint.unwrap_or_else(|| "-".into()),
                vmid: status
                    .virtual_machine_id
                    .map(|v| v.to_string())
                    .unwrap_or_else(|| "-".into()),
                ips: status
                    .ip_addresses
                    .iter()
                    .find(|a| a.net == "default")
                    .map(|a| {
                        a.ipv4
                            .iter()
                            .chain(&a.ipv6)
                            .cloned()
                            .collect::<Vec<_>>()
                            .join(",")
                    })
                    .unwrap_or_else(|| "-".into()),
                phase,
            }
        })
        .collect();
    rows.sort_by(|a, b| a.machine.cmp(&b.machine));
    rows
}

/// The rows as an aligned text table.
pub fn render(rows: &[MachineRow]) -> String {
    let header = ["MACHINE", "FAILURE DOMAIN", "NODE", "VMID", "IPS", "PHASE"];
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            vec![
                r.machine.clone(),
                r.failure_domain.clone(),
                r.node.clone(),
                r.vmid.clone(),
                r.ips.clone(),
                r.phase.clone(),
            ]
        })
        .collect();
    render_table(&header, cells)
}

/// `header` and `cells` as columns aligned with two spaces between them.
fn render_table(header: &[&str], cells: Vec<Vec<String>>) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in &cells {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.len());
        }
    }
    let line = |cells: Vec<&str>| -> String {
        cells
            .iter()
            .zip(&widths)
            .map(|(cell, &width)| format!("{cell:<width$}"))
            .collect::<Vec<_>>()
            .join("  ")
            .trim_end()
            .to_owned()
    };
    let mut out = vec![line(header.to_vec())];
    out.extend(
        cells
            .iter()
            .map(|row| line(row.iter().map(String::as_str).collect())),
    );
    out.join("\n")
}

/// The example ProxmoxCluster: zones rack-a (pve1, pve2) and rack-b (pve3, pve4) with their own
/// pools and DNS, pve5 as a spare outside any zone.
pub fn example_cluster_spec() -> Value {
    json!({
        "controlPlaneEndpoint": {"host": "10.0.0.10", "port": 6443},
        "allowedNodes": ["pve1", "pve2", "pve3", "pve4", "pve5"],
        "dnsServers": ["10.0.0.2"],
        "ipv4Config": {"addresses": ["10.0.0.100-10.0.0.150"], "prefix": 24, "gateway": "10.0.0.1"},
        "credentialsRef": {"name": "demo-proxmox-credentials"},
        "zoneConfig": [
            {"zone": "rack-a", "nodes": ["pve1", "pve2"], "dnsServers": ["10.0.1.2"],
             "ipv4Config": {"addresses": ["10.0.1.10-10.0.1.50"], "prefix": 24, "gateway": "10.0.1.1"}},
            {"zone": "rack-b", "nodes": ["pve3", "pve4"], "dnsServers": ["10.0.2.2"],
             "ipv4Config": {"addresses": ["10.0.2.10-10.0.2.50"], "prefix": 24, "gateway": "10.0.2.1"}}
        ]
    })
}

/// The example ProxmoxCluster of a multi-site sandbox: one zone per zone of the file, each with
/// its own pool and DNS (zone N of all: `10.0.N.0/24`), the zones of every site but the first
/// reaching their Proxmox cluster through `credentialsRef` to that site's Secret. Node names
/// may repeat over sites; `allowedNodes` names each once.
pub fn sites_cluster_spec(cluster: &str, sites: &[Site]) -> Value {
    let mut allowed = std::collections::BTreeSet::new();
    let mut zones = Vec::new();
    let all = sites
        .iter()
        .enumerate()
        .flat_map(|(index, site)| site.zones.iter().map(move |zone| (index, site, zone)));
    for (n, (index, site, zone)) in (1..).zip(all) {
        allowed.extend(zone.nodes.iter().cloned());
        let mut spec = json!({
            "zone": zone.zone, "nodes": zone.nodes, "dnsServers": [format!("10.0.{n}.2")],
            "ipv4Config": {"addresses": [format!("10.0.{n}.10-10.0.{n}.50")], "prefix": 24, "gateway": format!("10.0.{n}.1")}
        });
        if let Some(eligible) = zone.control_plane_eligible {
            spec["controlPlaneEligible"] = json!(eligible);
        }
        if index > 0 {
            spec["credentialsRef"] = json!({"name": site_credentials_secret(cluster, &site.name)});
        }
        zones.push(spec);
    }
    json!({
        "controlPlaneEndpoint": {"host": "10.0.0.10", "port": 6443},
        "allowedNodes": allowed,
        "dnsServers": ["10.0.0.2"],
        "ipv4Config": {"addresses": ["10.0.0.100-10.0.0.150"], "prefix": 24, "gateway": "10.0.0.1"},
        "credentialsRef": {"name": format!("{cluster}-proxmox-credentials")},
        "zoneConfig": zones,
    })
}

/// The example machines: the shared template, 2 GiB, one NIC on the zone's default pool.
pub fn example_machine_spec() -> Value {
    json!({
        "sourceNode": "pve1",
        "templateID": 9000,
        "memoryMiB": 2048,
        "numCores": 2,
        "network": {"networkDevices": [{"name": "net0", "bridge": "vmbr0", "defaultIPv4": true}]}
    })
}

/// Runs the sandbox as the `capmox-sandbox` binary does: prints progress, a summary and the time taken.
pub async fn run(options: SandboxOptions, keep_running: bool) -> Result<(), SandboxError> {
    let started = Instant::now();
    let sandbox = Sandbox::start(&options, true).await?;
    for (site, sim) in sandbox.proxmox.simulators() {
        match site {
            None => println!("Proxmox VE simulator:   {}", sim.url()),
            Some(site) => println!("{:<24}{}", format!("Proxmox VE {site}:"), sim.url()),
        }
    }
    if let Some(url) = sandbox.api_url() {
        println!("Kubernetes API:         {url}");
        println!("kubeconfig:             {}", options.kubeconfig.display());
    }
    println!("Conversion webhook:     {}", sandbox.webhook.url);
    sandbox.apply_example(&options).await?;
    let bootstrap = match options.os {
        GuestOs::Ubuntu => "Ubuntu, cloud-config",
        GuestOs::Flatcar => "Flatcar, Ignition",
    };
    println!(
        "Applied cluster demo ({bootstrap}): {} control-plane machines over the control-plane failure domains, {} workers in {}\n",
        options.control_plane, options.workers, options.worker_failure_domain
    );
    let expected = usize::try_from(options.control_plane + options.workers).unwrap_or(0);
    let rows = sandbox
        .wait_ready(expected, options.timeout, options.verbose)
        .await?;
    let mut per_domain: BTreeMap<&str, usize> = BTreeMap::new();
    for row in &rows {
        *per_domain.entry(row.failure_domain.as_str()).or_default() += 1;
    }
    println!("\nSummary:\n{}", sandbox.proxmox.table(&rows));
    let booted = sandbox.booted(&rows);
    println!(
        "\n{} machines ready in {:.1}s ({}); Proxmox VMs: {} ({})",
        rows.len(),
        started.elapsed().as_secs_f64(),
        per_domain
            .iter()
            .map(|(d, n)| format!("{d}: {n}"))
            .collect::<Vec<_>>()
            .join(", "),
        sandbox.proxmox.machine_vm_count(),
        booted
            .iter()
            .map(|(os, n)| format!("{n} booted {os}"))
            .collect::<Vec<_>>()
            .join(", "),
    );
    if let Some(sites) = sandbox.proxmox.site_summary(&rows) {
        println!("{sites}");
    }
    if let Some(example) = options.example {
        println!(
            "\nWorkers ({example:?} example):\n{}",
            example.report(&sandbox.proxmox, &rows)
        );
    }
    if options.ha {
        println!("\nProxmox HA:\n{}", sandbox.ha_report());
        println!("\nFailover:\n{}", sandbox.ha_failover(&rows));
    }
    if keep_running {
        println!(
            "\nStill running; try: kubectl --kubeconfig {0} get proxmoxmachines,proxmoxclusters\n\
             v1alpha1 works too: kubectl --kubeconfig {0} get proxmoxclusters.v1alpha1.infrastructure.cluster.x-k8s.io demo -o yaml\n\
             Press Ctrl-C to stop.",
            options.kubeconfig.display()
        );
        let _ = tokio::signal::ctrl_c().await;
    }
    Ok(())
}
