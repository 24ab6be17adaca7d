//! The `capmox-sandbox` binary: capmox end to end on this machine (simulated Proxmox,
//! in-process Kubernetes API, real controllers, an example cluster over failure domains).

use std::process::ExitCode;

use capmox::cli::{LogFilterError, LogFormat, init_logging};
use capmox_sandbox::run::{SandboxError, SandboxOptions};
use clap::Parser;

/// See capmox work on this machine: simulated Proxmox, in-process Kubernetes API, real
/// controllers, an example cluster spread over failure domains.
#[derive(Debug, Parser)]
#[command(name = "capmox-sandbox", version, about, long_about = None)]
struct Args {
    /// Keep everything running after the machines are ready, so kubectl can look around.
    #[arg(long)]
    keep_running: bool,
    /// Control-plane machines.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(i32).range(1..=9))]
    control_plane: i32,
    /// Worker machines (all in rack-b).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(i32).range(0..=50))]
    workers: i32,
    /// Proxmox topology file (nodes pve1..pve4 in racks rack-a/rack-b are expected).
    #[arg(long)]
    topology: Option<std::path::PathBuf>,
    /// Where to write the kubeconfig of the in-process Kubernetes API.
    #[arg(long)]
    kubeconfig: Option<std::path::PathBuf>,
    /// Log format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text, env = "CAPMOX_LOG_FORMAT")]
    log_format: LogFormat,
    /// Log filter in RUST_LOG syntax (`warn` when unset, so the table stays readable).
    #[arg(long)]
    log_filter: Option<String>,
}

/// Why the sandbox stopped with an error.
#[derive(Debug, thiserror::Error)]
enum Error {
    #[error(transparent)]
    LogFilter(#[from] LogFilterError),
    #[error(transparent)]
    Sandbox(#[from] SandboxError),
    #[error("cannot start the async runtime: {0}")]
    Runtime(#[from] std::io::Error),
}

fn run(args: Args) -> Result<(), Error> {
    init_logging(args.log_format, args.log_filter.as_deref().or(Some("warn")))?;
    let mut options = SandboxOptions {
        control_plane: args.control_plane,
        workers: args.workers,
        topology: args.topology,
        ..Default::default()
    };
    if let Some(path) = args.kubeconfig {
        options.kubeconfig = path;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(capmox_sandbox::run::run(options, args.keep_running))?;
    Ok(())
}

fn main() -> ExitCode {
    match run(Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("capmox-sandbox: {error}");
            ExitCode::FAILURE
        }
    }
}
