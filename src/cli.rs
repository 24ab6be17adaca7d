//! Command-line interface: `capmox run | crds | version`.

use clap::{Parser, Subcommand, ValueEnum};
use tracing_subscriber::EnvFilter;

/// Why a CLI command failed.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// The CRDs could not be rendered.
    #[error(transparent)]
    Crd(#[from] crate::api::crd::CrdError),
    /// Writing to stdout failed.
    #[error("cannot write output: {0}")]
    Io(#[from] std::io::Error),
    /// No Kubernetes configuration was found or it was unusable.
    #[error("cannot configure the Kubernetes client (set KUBECONFIG or run in a cluster): {0}")]
    KubeConfig(#[source] kube::Error),
    /// The Kubernetes API server could not be reached.
    #[error("cannot reach the Kubernetes API server: {0}")]
    KubeUnreachable(#[source] kube::Error),
    /// The log filter was malformed.
    #[error("invalid log filter (RUST_LOG syntax, e.g. `info,capmox=debug`): {0}")]
    LogFilter(String),
}

/// capmox: Cluster API infrastructure provider for Proxmox VE, with zones as failure domains.
#[derive(Debug, Parser)]
#[command(name = "capmox", version, about, long_about = None)]
pub struct Cli {
    /// Log format.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text, env = "CAPMOX_LOG_FORMAT")]
    pub log_format: LogFormat,
    /// Log filter in RUST_LOG syntax (overrides RUST_LOG), e.g. `info,capmox=debug`.
    #[arg(long, global = true)]
    pub log_filter: Option<String>,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line, for log pipelines.
    Json,
}

/// capmox subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the controller manager against the cluster from KUBECONFIG or the in-cluster config.
    Run,
    /// Print the CustomResourceDefinitions as a multi-document YAML stream.
    Crds {
        /// Write one file per CRD (`<group>_<plural>.yaml`) into this directory instead.
        #[arg(long)]
        output_dir: Option<std::path::PathBuf>,
    },
    /// Print the capmox version.
    Version,
}

/// Runs one CLI invocation to completion.
pub fn execute(cli: Cli) -> Result<(), CliError> {
    match cli.command {
        Command::Crds { output_dir: None } => {
            use std::io::Write;
            let yaml = crate::api::crd::render_all()?;
            std::io::stdout().write_all(yaml.as_bytes())?;
            Ok(())
        }
        Command::Crds {
            output_dir: Some(dir),
        } => {
            std::fs::create_dir_all(&dir)?;
            for crd in crate::api::crd::all()? {
                std::fs::write(
                    dir.join(crate::api::crd::file_name(&crd)),
                    crate::api::crd::to_yaml(&crd)?,
                )?;
            }
            Ok(())
        }
        Command::Version => {
            println!("capmox {}", env!("CARGO_PKG_VERSION"));
            Ok(())
        }
        Command::Run => {
            init_logging(cli.log_format, cli.log_filter.as_deref())?;
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()?;
            runtime.block_on(run())
        }
    }
}

fn init_logging(format: LogFormat, filter: Option<&str>) -> Result<(), CliError> {
    let filter = match filter {
        Some(directives) => EnvFilter::try_new(directives),
        None => EnvFilter::try_from_default_env().or_else(|_| EnvFilter::try_new("info")),
    }
    .map_err(|error| CliError::LogFilter(error.to_string()))?;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    // A second initialisation (only possible in tests) keeps the first subscriber.
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
    Ok(())
}

async fn run() -> Result<(), CliError> {
    let client = kube::Client::try_default()
        .await
        .map_err(CliError::KubeConfig)?;
    let version = client
        .apiserver_version()
        .await
        .map_err(CliError::KubeUnreachable)?;
    tracing::info!(
        server_version = %version.git_version,
        "connected to the Kubernetes API server; no reconciler is registered yet, waiting for a shutdown signal"
    );
    tokio::signal::ctrl_c().await?;
    tracing::info!("shutting down");
    Ok(())
}
