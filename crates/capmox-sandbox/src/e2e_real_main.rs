//! The `capmox-e2e-real` binary (`make e2e-real`): the sandbox scenario against the real
//! cluster in KUBECONFIG, capmox running as the shipped ServiceAccount.

use std::process::ExitCode;

use capmox::cli::{LogArgs, run_binary};
use clap::Parser;

/// The sandbox scenario against the real cluster in KUBECONFIG: installs the CRDs and the
/// shipped RBAC, runs capmox as the shipped ServiceAccount (impersonated), provisions and
/// deletes an example cluster, checks nothing is left, and removes what it installed.
#[derive(Debug, Parser)]
#[command(name = "capmox-e2e-real", version, about, long_about = None)]
struct Args {
    #[command(flatten)]
    e2e: E2eRealArgs,
    /// Logging (`warn` unless `--log-filter` says otherwise, so the table stays readable).
    #[command(flatten)]
    log: LogArgs,
}

/// An incomplete command line.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct Usage(String);

/// Why the run failed.
#[derive(Debug, thiserror::Error)]
enum Failure {
    #[error(transparent)]
    Usage(#[from] Usage),
    #[error(transparent)]
    Run(#[from] capmox_sandbox::real::RealError),
}

fn main() -> ExitCode {
    let args = Args::parse();
    let work = async move {
        let options = args.e2e.options()?;
        capmox_sandbox::real::run(options).await?;
        Ok::<(), Failure>(())
    };
    run_binary("capmox-e2e-real", &args.log, Some("warn"), work)
}

/// Flags of `capmox e2e-real`.
#[derive(Debug, Clone, clap::Args)]
pub struct E2eRealArgs {
    /// Namespace of the example cluster (created and deleted).
    #[arg(long, default_value = "capmox-e2e")]
    pub namespace: String,
    /// Control-plane machines.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(i32).range(1..=9))]
    pub control_plane: i32,
    /// Worker machines.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(i32).range(0..=50))]
    pub workers: i32,
    /// Failure domain of the workers.
    #[arg(long, default_value = "rack-b")]
    pub worker_failure_domain: String,
    /// Release manifests whose RBAC capmox runs with (`make release-manifests` writes them).
    #[arg(long, default_value = "out/infrastructure-components.yaml")]
    pub manifests: std::path::PathBuf,
    /// Folder of the upstream CAPI, KCP and IPAM CRDs to install.
    #[arg(long, default_value = "tests/data/external-crds")]
    pub upstream_crds: std::path::PathBuf,
    /// Upper bound of each step (e.g. `5m`).
    #[arg(long, default_value = "5m", value_parser = capmox::cli::parse_duration)]
    pub timeout: std::time::Duration,
    /// Real Proxmox VE URL; the simulator when unset.
    #[arg(long, env = "PROXMOX_URL")]
    pub proxmox_url: Option<String>,
    /// API token id of the real Proxmox (`user@realm!name`).
    #[arg(long, env = "PROXMOX_TOKEN", requires = "proxmox_url")]
    pub proxmox_token: Option<String>,
    /// Skip TLS verification of the real Proxmox.
    #[arg(long)]
    pub proxmox_insecure: bool,
    /// A zone of the real Proxmox, `NAME=node1,node2` (repeat for each zone).
    #[arg(long = "zone", value_parser = parse_zone)]
    pub zones: Vec<(String, Vec<String>)>,
    /// VMID of the template on the real Proxmox.
    #[arg(long)]
    pub template_id: Option<u32>,
    /// Node of that template.
    #[arg(long)]
    pub source_node: Option<String>,
    /// Leave the namespace and the RBAC in place afterwards.
    #[arg(long)]
    pub keep: bool,
    /// Simulator topology file, or a multi-site file with one simulator per site (e.g.
    /// examples/sandbox-two-sites.yaml); the built-in one when unset. Not with PROXMOX_URL.
    #[arg(long)]
    pub topology: Option<std::path::PathBuf>,
}

fn parse_zone(value: &str) -> Result<(String, Vec<String>), String> {
    let (zone, nodes) = value
        .split_once('=')
        .ok_or_else(|| format!("{value:?}: expected NAME=node1,node2"))?;
    let nodes: Vec<String> = nodes
        .split(',')
        .map(str::trim)
        .filter(|n| !n.is_empty())
        .map(str::to_owned)
        .collect();
    if zone.is_empty() || nodes.is_empty() {
        return Err(format!("{value:?}: expected NAME=node1,node2"));
    }
    Ok((zone.to_owned(), nodes))
}

impl E2eRealArgs {
    fn options(self) -> Result<capmox_sandbox::real::RealOptions, Usage> {
        let proxmox = match (self.proxmox_url, self.proxmox_token) {
            (Some(url), Some(token)) => Some(capmox_sandbox::real::RealProxmox {
                url,
                token,
                secret: std::env::var("PROXMOX_SECRET")
                    .map_err(|_| Usage("PROXMOX_URL is set: set PROXMOX_SECRET too".into()))?,
                insecure: self.proxmox_insecure,
            }),
            (Some(_), None) => {
                return Err(Usage(
                    "PROXMOX_URL is set: set PROXMOX_TOKEN (user@realm!name) too".into(),
                ));
            }
            _ => None,
        };
        if proxmox.is_some() && self.topology.is_some() {
            return Err(Usage(
                "--topology describes simulated Proxmox clusters; with PROXMOX_URL set, give the \
                 zones with --zone"
                    .into(),
            ));
        }
        Ok(capmox_sandbox::real::RealOptions {
            namespace: self.namespace,
            control_plane: self.control_plane,
            workers: self.workers,
            worker_failure_domain: self.worker_failure_domain,
            manifests: self.manifests,
            upstream_crds: self.upstream_crds,
            timeout: self.timeout,
            proxmox,
            zones: self.zones.into_iter().collect(),
            template_id: self.template_id,
            source_node: self.source_node,
            keep: self.keep,
            topology: self.topology,
        })
    }
}
