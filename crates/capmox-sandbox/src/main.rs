//! The `capmox-sandbox` binary: capmox end to end on this machine (simulated Proxmox,
//! in-process Kubernetes API, real controllers, an example cluster over failure domains).

use std::process::ExitCode;

use capmox::cli::{LogArgs, run_binary};
use capmox_sandbox::examples::Example;
use capmox_sandbox::run::{GuestOs, SandboxOptions};
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
    /// Worker machines (all in `--worker-failure-domain`).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(i32).range(0..=50))]
    workers: i32,
    /// The zone the workers are pinned to (the MachineDeployment's failure domain).
    #[arg(long, default_value = "rack-b")]
    worker_failure_domain: String,
    /// Guest OS of the machines: `flatcar` gives them Ignition bootstrap data (`format: ignition`).
    #[arg(long, value_enum, default_value_t = Os::Ubuntu)]
    os: Os,
    /// Proxmox topology file: one simulator topology (nodes pve1..pve4 in racks rack-a/rack-b
    /// are expected), or a multi-site file (`sites:`, one simulator per site, e.g.
    /// examples/sandbox-two-sites.yaml); every site needs template 9000 on pve1.
    #[arg(long)]
    topology: Option<std::path::PathBuf>,
    /// Proxmox HA for the example cluster: show HA resources and rules, fail a node and show
    /// where its VMs went.
    #[arg(long)]
    ha: bool,
    /// Hardware for the workers: `gpu` (a GPU of the topology's `gpu` PCI resource mapping),
    /// `dhcp` (the address from the simulated DHCP server), `disks` (data disks, UEFI and a TPM).
    #[arg(long, value_enum)]
    example: Option<ExampleArg>,
    /// Where to write the kubeconfig of the in-process Kubernetes API.
    #[arg(long)]
    kubeconfig: Option<std::path::PathBuf>,
    /// Logging (`warn` unless `--log-filter` says otherwise, so the table stays readable).
    #[command(flatten)]
    log: LogArgs,
}

/// `--os`.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum Os {
    /// cloud-config bootstrap data.
    Ubuntu,
    /// Ignition bootstrap data.
    Flatcar,
}

/// `--example`.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum ExampleArg {
    /// A GPU per worker through a Proxmox PCI resource mapping.
    Gpu,
    /// The workers' addresses by DHCP.
    Dhcp,
    /// Data disks, UEFI with Secure Boot keys and a TPM.
    Disks,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let mut options = SandboxOptions {
        control_plane: args.control_plane,
        workers: args.workers,
        worker_failure_domain: args.worker_failure_domain,
        topology: args.topology,
        os: match args.os {
            Os::Ubuntu => GuestOs::Ubuntu,
            Os::Flatcar => GuestOs::Flatcar,
        },
        ha: args.ha,
        example: args.example.map(|example| match example {
            ExampleArg::Gpu => Example::Gpu,
            ExampleArg::Dhcp => Example::Dhcp,
            ExampleArg::Disks => Example::Disks,
        }),
        ..Default::default()
    };
    if let Some(path) = args.kubeconfig {
        options.kubeconfig = path;
    }
    let work = capmox_sandbox::run::run(options, args.keep_running);
    run_binary("capmox-sandbox", &args.log, Some("warn"), work)
}
