//! The `simulate-proxmox` binary: a simulated Proxmox VE API on 127.0.0.1, to try capmox
//! without a Proxmox cluster.

use std::process::ExitCode;

use capmox::cli::{LogArgs, run_binary};
use capmox_sim::{ProfileName, TlsMaterial};
use clap::Parser;

/// Serve a simulated Proxmox VE API on 127.0.0.1 to try capmox without a Proxmox cluster.
#[derive(Debug, Parser)]
#[command(name = "simulate-proxmox", version, about, long_about = None)]
struct Args {
    /// Topology file (YAML): nodes, storages, templates, guests, simulation settings.
    /// A built-in three-node example is used when unset.
    #[arg(long)]
    topology: Option<std::path::PathBuf>,
    /// Loopback address to listen on.
    #[arg(long, default_value = "127.0.0.1:8006")]
    listen: std::net::SocketAddr,
    /// PEM certificate to serve HTTPS with (plain HTTP without it).
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<std::path::PathBuf>,
    /// PEM private key of `--tls-cert`.
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<std::path::PathBuf>,
    /// How the simulator behaves in time: `ideal` answers at once and runs tasks for their
    /// configured time; `realistic` has each node serve a few requests at once with latency,
    /// draws task durations, serialises clones' allocations per storage and makes a few tasks
    /// slow. Overrides the topology file's `simulation.profile`.
    #[arg(long, value_enum)]
    profile: Option<ProfileName>,
    /// Seed of the realistic profile's draws (with --profile).
    #[arg(long, default_value_t = 0, requires = "profile")]
    profile_seed: u64,
    /// Logging.
    #[command(flatten)]
    log: LogArgs,
}

fn main() -> ExitCode {
    let args = Args::parse();
    run_binary("simulate-proxmox", &args.log, None, async {
        let tls = match (&args.tls_cert, &args.tls_key) {
            (Some(cert), Some(key)) => Some(TlsMaterial::from_files(cert, key)?),
            _ => None,
        };
        let profile = args.profile.map(|name| (name, args.profile_seed));
        capmox_sim::run_simulate_proxmox(args.topology.as_deref(), args.listen, tls, profile).await
    })
}
