//! The `simulate-proxmox` binary: a simulated Proxmox VE API on 127.0.0.1, to try capmox
//! without a Proxmox cluster.

use std::process::ExitCode;

use capmox::cli::{LogFilterError, LogFormat, init_logging};
use capmox_sim::{SimStartError, TlsMaterial};
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
    /// Log format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text, env = "CAPMOX_LOG_FORMAT")]
    log_format: LogFormat,
    /// Log filter in RUST_LOG syntax (overrides RUST_LOG).
    #[arg(long)]
    log_filter: Option<String>,
}

/// Why the simulator stopped with an error.
#[derive(Debug, thiserror::Error)]
enum Error {
    #[error(transparent)]
    LogFilter(#[from] LogFilterError),
    #[error(transparent)]
    Simulator(#[from] SimStartError),
    #[error("cannot start the async runtime: {0}")]
    Runtime(#[from] std::io::Error),
}

fn run(args: Args) -> Result<(), Error> {
    init_logging(args.log_format, args.log_filter.as_deref())?;
    let tls = match (args.tls_cert, args.tls_key) {
        (Some(cert), Some(key)) => Some(TlsMaterial::from_files(&cert, &key)?),
        _ => None,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(capmox_sim::run_simulate_proxmox(
        args.topology.as_deref(),
        args.listen,
        tls,
    ))?;
    Ok(())
}

fn main() -> ExitCode {
    match run(Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("simulate-proxmox: {error}");
            ExitCode::FAILURE
        }
    }
}
