//! Stateful Proxmox VE simulator served over HTTP(S) on 127.0.0.1, for tests,
//! benchmarks, the sandbox and the `simulate-proxmox --topology FILE` binary.
//!
//! ```no_run
//! use capmox::proxmox::{ApiToken, ClientConfig, ProxmoxClient};
//! use capmox_sim::{SimOptions, Simulator, Topology};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let sim = Simulator::start(Topology::example(), SimOptions::default()).await?;
//! let client = ProxmoxClient::new(&ClientConfig::new(sim.url(), ApiToken::parse(&sim.token())?))?;
//! assert_eq!(client.version().await?.release, "9.1");
//! println!("{:?}", sim.counters());
//! # Ok(()) }
//! ```

#![warn(missing_docs)]

pub mod guest;
pub mod iso;
pub mod profile;
pub mod server;
pub mod state;
pub mod topology;

use std::collections::{BTreeMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

pub use profile::{
    LogNormal, Profile, ProfileName, RealisticProfile, RequestTiming, StorageLockHold,
};
pub use server::{LoggedRequest, Rng, SIM_ROUTES, SIM_ROUTES_PVE9, SimCounters};
pub use state::ha::{
    Affinity, HaGroup, HaResource, HaRule, HaRuleKind, MIGRATION_ABORTED, Relocation,
};
pub use state::{
    Cluster, DhcpLease, RepeatedWrite, SimError, TaskRecord, VolumeInfo, repeated_writes,
};
pub use topology::{
    DenyRule, DhcpSpec, FaultConfig, FaultRule, GuestSpec, NodeSpec, PciDeviceSpec,
    PciMapEntrySpec, PciMappingSpec, SimOptions, SimSettings, StorageSpec, Topology,
};

use server::Shared;

/// Errors starting the simulator.
#[derive(Debug, thiserror::Error)]
pub enum SimStartError {
    /// The address could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// Requested address.
        addr: String,
        /// I/O error.
        source: std::io::Error,
    },
    /// Refused a non-loopback address.
    #[error("the simulator only listens on loopback addresses, not {0}")]
    NotLoopback(String),
    /// TLS material could not be loaded.
    #[error("invalid TLS certificate or key for the simulator: {0}")]
    Tls(String),
    /// The topology is invalid.
    #[error(transparent)]
    Topology(#[from] topology::TopologyError),
}

/// PEM certificate chain and key for serving HTTPS.
#[derive(Clone)]
pub struct TlsMaterial {
    /// Certificate chain (PEM).
    pub cert_pem: String,
    /// Private key (PEM, PKCS#8/PKCS#1/SEC1).
    pub key_pem: String,
}

impl TlsMaterial {
    /// Reads a PEM certificate chain and key from files.
    pub fn from_files(
        cert: &std::path::Path,
        key: &std::path::Path,
    ) -> Result<Self, SimStartError> {
        let read = |p: &std::path::Path| {
            std::fs::read_to_string(p)
                .map_err(|e| SimStartError::Tls(format!("cannot read {}: {e}", p.display())))
        };
        Ok(Self {
            cert_pem: read(cert)?,
            key_pem: read(key)?,
        })
    }
}

impl std::fmt::Debug for TlsMaterial {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TlsMaterial(<redacted>)")
    }
}

/// A running simulator. Dropping it stops the listener.
pub struct Simulator {
    addr: SocketAddr,
    tls: bool,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for Simulator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Simulator")
            .field("addr", &self.addr)
            .field("tls", &self.tls)
            .finish()
    }
}

impl Drop for Simulator {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Simulator {
    /// Starts a plain-HTTP simulator on 127.0.0.1 with an OS-chosen port.
    pub async fn start(topology: Topology, opts: SimOptions) -> Result<Self, SimStartError> {
        Self::start_on(
            topology,
            opts,
            "127.0.0.1:0".parse().expect("literal loopback address"),
            None,
        )
        .await
    }

    /// Starts on the given loopback address, optionally with TLS.
    pub async fn start_on(
        topology: Topology,
        opts: SimOptions,
        addr: SocketAddr,
        tls: Option<TlsMaterial>,
    ) -> Result<Self, SimStartError> {
        if !addr.ip().is_loopback() {
            return Err(SimStartError::NotLoopback(addr.to_string()));
        }
        topology.validate()?;
        let acceptor = tls.map(|t| tls_acceptor(&t)).transpose()?;
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|source| SimStartError::Bind {
                addr: addr.to_string(),
                source,
            })?;
        let addr = listener
            .local_addr()
            .map_err(|source| SimStartError::Bind {
                addr: addr.to_string(),
                source,
            })?;
        let faults = opts.faults.clone();
        let node_names: Vec<String> = topology.nodes.iter().map(|n| n.name.clone()).collect();
        let api = opts
            .profile
            .realistic()
            .map(|profile| profile::ApiModel::new(profile, &node_names));
        let shared = Arc::new(Shared {
            cluster: Mutex::new(Cluster::new(
                &topology,
                opts.clone(),
                task_failures(&faults),
            )),
            rng: Mutex::new(Rng::new(faults.seed)),
            faults: Mutex::new(faults),
            opts,
            log: Mutex::new(VecDeque::new()),
            counters: Mutex::new(BTreeMap::new()),
            offline: Default::default(),
            api,
        });
        let tls_on = acceptor.is_some();
        let s = shared.clone();
        let task = tokio::spawn(async move {
            loop {
                let stream = match listener.accept().await {
                    Ok((stream, _)) => stream,
                    Err(e) => {
                        // e.g. out of file descriptors: back off instead of spinning
                        tracing::warn!(error = %e, "simulator accept failed");
                        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let s = s.clone();
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    let svc = service_fn(move |req| server::handle(s.clone(), req));
                    let builder = http1::Builder::new();
                    match acceptor {
                        Some(a) => {
                            if let Ok(tls) = a.accept(stream).await {
                                let _ = builder.serve_connection(TokioIo::new(tls), svc).await;
                            }
                        }
                        None => {
                            let _ = builder.serve_connection(TokioIo::new(stream), svc).await;
                        }
                    }
                });
            }
        });
        tracing::info!(
            %addr,
            tls = tls_on,
            profile = shared.opts.profile.name().as_str(),
            "Proxmox VE simulator listening"
        );
        Ok(Self {
            addr,
            tls: tls_on,
            shared,
            task,
        })
    }

    /// Takes the whole simulated cluster off the network (`true`: every request, on new and
    /// kept-alive connections alike, is dropped without an answer, as when a site's link or
    /// corosync ring is down) or brings it back; its state is kept either way.
    pub fn set_offline(&self, offline: bool) {
        self.shared
            .offline
            .store(offline, std::sync::atomic::Ordering::SeqCst);
    }

    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The base URL to give the client (`http(s)://127.0.0.1:PORT`).
    pub fn url(&self) -> String {
        format!(
            "{}://{}",
            if self.tls { "https" } else { "http" },
            self.addr
        )
    }

    /// The accepted token as `user@realm!name=secret`.
    pub fn token(&self) -> String {
        format!(
            "{}={}",
            self.shared.opts.token_id, self.shared.opts.token_secret
        )
    }

    /// A copy of the request log (oldest first).
    pub fn request_log(&self) -> Vec<LoggedRequest> {
        self.shared
            .log
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .cloned()
            .collect()
    }

    /// Every task so far with its request, start and end instants (oldest first), so a
    /// benchmark can tell Proxmox's time from the controller's.
    pub fn task_records(&self) -> Vec<TaskRecord> {
        self.with_cluster(|c| c.task_records())
    }

    /// Per-endpoint counters.
    pub fn counters(&self) -> BTreeMap<String, SimCounters> {
        self.shared
            .counters
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Replaces the fault injection while running (rules, task failure rates and the seed both
    /// draw from), so a test can open a window of faults and close it again to let the
    /// controllers converge.
    pub fn set_faults(&self, faults: FaultConfig) {
        self.with_cluster(|c| c.set_task_failure(task_failures(&faults)));
        *self.shared.rng.lock().unwrap_or_else(|p| p.into_inner()) = Rng::new(faults.seed);
        *self.shared.faults.lock().unwrap_or_else(|p| p.into_inner()) = faults;
    }

    /// The HA resources as configured (`/etc/pve/ha/resources.cfg`), by sid.
    pub fn ha_resources(&self) -> Vec<HaResource> {
        self.with_cluster(|c| c.ha_resources())
    }

    /// The HA groups (PVE 8; always empty as PVE 9, where the group endpoints refuse).
    pub fn ha_groups(&self) -> Vec<HaGroup> {
        self.with_cluster(|c| c.ha_groups())
    }

    /// The HA rules (PVE 9), in file order.
    pub fn ha_rules(&self) -> Vec<HaRule> {
        self.with_cluster(|c| c.ha_rules())
    }

    /// The HA state of VM `vmid` (`started`, `stopped`, `recovery`, `error`, `ignored`),
    /// `None` if it is not HA-managed.
    pub fn ha_state(&self, vmid: u32) -> Option<String> {
        self.with_cluster(|c| c.ha_state(vmid))
    }

    /// Node `node` fails (power loss): it goes offline (its API answers 595), its VMs stop,
    /// and the HA manager recovers each HA-managed VM on it to a node its HA rules (PVE 9)
    /// or group (PVE 8) allow, where it runs again under the same VMID and config. See
    /// [`Cluster::fail_node`] for the placement rules; the result says where each went.
    pub fn fail_node(&self, node: &str) -> Vec<Relocation> {
        self.with_cluster(|c| c.fail_node(tokio::time::Instant::now(), node))
    }

    /// Node `node` is back: HA resources waiting for a node are recovered, and resources
    /// with failback return to it when it is their preferred node. See
    /// [`Cluster::revive_node`].
    pub fn revive_node(&self, node: &str) -> Vec<Relocation> {
        self.with_cluster(|c| c.revive_node(tokio::time::Instant::now(), node))
    }

    /// What the HA CRM logged about migration requests: dropped commands with the reason
    /// (`crm command error - node not online: migrate vm:101 pve3`) and state changes of
    /// migrating resources, oldest first. See [`Cluster::ha_crm_log`].
    pub fn ha_crm_log(&self) -> Vec<String> {
        self.handle().ha_crm_log()
    }

    /// The node VM `vmid` is on, `None` if there is no such VM (to see an HA migration or
    /// recovery land). See [`Cluster::vm_node`].
    pub fn vm_node(&self, vmid: u32) -> Option<String> {
        self.handle().vm_node(vmid)
    }

    /// The guest of running VM `vmid` hangs: it ignores ACPI (a reboot waits out its timeout
    /// and fails) and its guest agent stops answering, until the VM is reset or stops. False
    /// if no such VM runs. See [`Cluster::hang_guest`].
    pub fn hang_guest(&self, vmid: u32) -> bool {
        self.handle().hang_guest(vmid)
    }

    /// How many times VM `vmid` booted (starts, reboots, resets), `None` if there is no such
    /// VM. See [`Cluster::boots`].
    pub fn boots(&self, vmid: u32) -> Option<u32> {
        self.handle().boots(vmid)
    }

    /// The disk volumes VM `vmid` owns (boot disk, disks allocated through its config, unused
    /// ones), so a test sees what an allocation made and that deleting the VM freed it. See
    /// [`Cluster::volumes_of`].
    pub fn volumes_of(&self, vmid: u32) -> Vec<VolumeInfo> {
        self.handle().volumes_of(vmid)
    }

    /// The PCI devices VMs hold on `node` (running, or with a start under way) as (address,
    /// VMID), by address, so a test sees which entry of a mapping a start took and that a
    /// stop freed it. See [`Cluster::pci_in_use`].
    pub fn pci_in_use(&self, node: &str) -> Vec<(String, u32)> {
        self.handle().pci_in_use(node)
    }

    /// Every DHCP lease the topology's `dhcp` services handed out (by bridge and MAC), so a
    /// test sees which address a guest got, that it kept it over a reboot, and that
    /// destroying the VM freed it. See [`Cluster::dhcp_leases`].
    pub fn dhcp_leases(&self) -> Vec<DhcpLease> {
        self.handle().dhcp_leases()
    }

    /// Runs `f` on the cluster state (to inspect it or set up scenarios such as locks).
    pub fn with_cluster<R>(&self, f: impl FnOnce(&mut Cluster) -> R) -> R {
        self.handle().with_cluster(f)
    }

    /// A handle on the cluster state that outlives borrows of the simulator (for tasks that
    /// watch it while the simulator serves).
    pub fn handle(&self) -> SimHandle {
        SimHandle(self.shared.clone())
    }
}

/// A cloneable view of a running simulator's cluster state.
#[derive(Clone)]
pub struct SimHandle(Arc<Shared>);

impl std::fmt::Debug for SimHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SimHandle")
    }
}

impl SimHandle {
    /// Runs `f` on the cluster state, as [`Simulator::with_cluster`] does.
    pub fn with_cluster<R>(&self, f: impl FnOnce(&mut Cluster) -> R) -> R {
        let mut c = self.0.cluster.lock().unwrap_or_else(|p| p.into_inner());
        c.advance(tokio::time::Instant::now());
        f(&mut c)
    }

    /// The guest of running VM `vmid` hangs, so remediation can be tested: it ignores ACPI (a
    /// reboot waits out its timeout and fails with `VM quit/powerdown failed - got timeout`)
    /// and its guest agent answers `QEMU guest agent is not running`, until the VM is reset
    /// or stops. False if no such VM runs.
    pub fn hang_guest(&self, vmid: u32) -> bool {
        self.with_cluster(|c| c.hang_guest(vmid))
    }

    /// How many times VM `vmid` booted: starts (HA restarts included), reboots and resets
    /// that took; a guest the topology lists as running counts one. `None` if there is no
    /// such VM.
    pub fn boots(&self, vmid: u32) -> Option<u32> {
        self.with_cluster(|c| c.boots(vmid))
    }

    /// What the HA CRM logged about migration requests, oldest first, as
    /// [`Simulator::ha_crm_log`].
    pub fn ha_crm_log(&self) -> Vec<String> {
        self.with_cluster(|c| c.ha_crm_log())
    }

    /// The node VM `vmid` is on (after the tasks due by now ended), `None` if there is no
    /// such VM.
    pub fn vm_node(&self, vmid: u32) -> Option<String> {
        self.with_cluster(|c| c.vm_node(vmid))
    }

    /// The disk volumes VM `vmid` owns (after the tasks due by now ended), as
    /// [`Simulator::volumes_of`].
    pub fn volumes_of(&self, vmid: u32) -> Vec<VolumeInfo> {
        self.with_cluster(|c| c.volumes_of(vmid))
    }

    /// The PCI devices VMs hold on `node` (after the tasks due by now ended), as
    /// [`Simulator::pci_in_use`].
    pub fn pci_in_use(&self, node: &str) -> Vec<(String, u32)> {
        self.with_cluster(|c| c.pci_in_use(node))
    }

    /// The DHCP leases (after the boots done by now asked), as [`Simulator::dhcp_leases`].
    pub fn dhcp_leases(&self) -> Vec<DhcpLease> {
        self.with_cluster(|c| c.dhcp_leases())
    }
}

/// The injected task failures of `faults`: each task of a type with a rate fails with that
/// probability, drawn from an RNG seeded by the fault seed.
fn task_failures(faults: &FaultConfig) -> Box<dyn FnMut(&str) -> bool + Send> {
    let mut task_rng = Rng::new(faults.seed ^ 0x5EED_7A5C);
    let task_rates = faults.task_failure_rate.clone();
    Box::new(move |kind: &str| {
        let rate = task_rates
            .get(kind)
            .or_else(|| task_rates.get("*"))
            .copied()
            .unwrap_or(0.0);
        rate > 0.0 && task_rng.next_f64() < rate
    })
}

fn tls_acceptor(t: &TlsMaterial) -> Result<tokio_rustls::TlsAcceptor, SimStartError> {
    let certs = CertificateDer::pem_slice_iter(t.cert_pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| SimStartError::Tls(format!("certificate: {e}")))?;
    let key = PrivateKeyDer::from_pem_slice(t.key_pem.as_bytes())
        .map_err(|e| SimStartError::Tls(format!("key: {e}")))?;
    let config =
        rustls::ServerConfig::builder_with_provider(capmox::proxmox::tls::crypto_provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| SimStartError::Tls(e.to_string()))?
            .with_no_client_auth()
            .with_single_cert(certs, key)
            .map_err(|e| SimStartError::Tls(e.to_string()))?;
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
}

/// Entry point for `simulate-proxmox --topology FILE`: serves until Ctrl-C.
/// Without a file the built-in example cluster is used; the file's `simulation`
/// section sets token, durations, faults and the profile, which `profile` (the
/// command line's `--profile` and `--profile-seed`) overrides. Prints the URL and token to use.
pub async fn run_simulate_proxmox(
    topology_path: Option<&std::path::Path>,
    listen: SocketAddr,
    tls: Option<TlsMaterial>,
    profile: Option<(ProfileName, u64)>,
) -> Result<(), SimStartError> {
    let topology = match topology_path {
        Some(p) => Topology::load(p)?,
        None => Topology::example(),
    };
    let mut opts = SimOptions::from_topology(&topology);
    if let Some((name, seed)) = profile {
        opts.profile = Profile::named(name, seed);
    }
    let profile_name = opts.profile.name();
    let sim = Simulator::start_on(topology, opts, listen, tls).await?;
    println!("Proxmox VE simulator listening on {}", sim.url());
    println!("API token: {}", sim.token());
    println!("Profile: {}", profile_name.as_str());
    let _ = tokio::signal::ctrl_c().await;
    Ok(())
}
