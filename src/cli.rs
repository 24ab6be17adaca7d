//! Command-line interface: `capmox run | crds | docs | version`.

use std::process::ExitCode;

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
    /// The controller manager stopped with an error.
    #[error(transparent)]
    Manager(#[from] crate::controller::ManagerError),
    /// The log filter was malformed.
    #[error(transparent)]
    LogFilter(#[from] LogFilterError),
    /// A book page could not be generated.
    #[error(transparent)]
    Docs(#[from] crate::docs::DocsError),
}

/// The log filter given on the command line or in `RUST_LOG` was malformed.
#[derive(Debug, thiserror::Error)]
#[error("invalid log filter (RUST_LOG syntax, e.g. `info,capmox=debug`): {0}")]
pub struct LogFilterError(String);

/// capmox: Cluster API infrastructure provider for Proxmox VE, with zones as failure domains.
#[derive(Debug, Parser)]
#[command(name = "capmox", version, about, long_about = None)]
pub struct Cli {
    /// Logging.
    #[command(flatten)]
    pub log: LogArgs,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The logging flags of every capmox binary: `capmox`, and the rigs' `simulate-proxmox` and
/// `capmox-sandbox`, so they all log alike.
#[derive(Debug, Clone, clap::Args)]
pub struct LogArgs {
    /// Log format.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text, env = "CAPMOX_LOG_FORMAT")]
    pub log_format: LogFormat,
    /// Log filter in RUST_LOG syntax (overrides RUST_LOG), e.g. `info,capmox=debug`.
    #[arg(long, global = true)]
    pub log_filter: Option<String>,
}

impl LogArgs {
    /// Logs to stderr as these flags say; without `--log-filter`, `fallback` when given, else
    /// `RUST_LOG`, else `info`.
    pub fn init(&self, fallback: Option<&str>) -> Result<(), LogFilterError> {
        init_logging(self.log_format, self.log_filter.as_deref().or(fallback))
    }
}

/// Runs a binary: logging as `log` says (see [`LogArgs::init`] for `fallback_filter`), then
/// `work` to completion on a multi-threaded Tokio runtime; returns its exit status.
pub fn run_binary<E: std::fmt::Display>(
    program: &str,
    log: &LogArgs,
    fallback_filter: Option<&str>,
    work: impl std::future::Future<Output = Result<(), E>>,
) -> ExitCode {
    if let Err(error) = log.init(fallback_filter) {
        return exit_status(program, Err(error));
    }
    match block_on(work) {
        Ok(outcome) => exit_status(program, outcome),
        Err(error) => exit_status(
            program,
            Err(format!("cannot start the async runtime: {error}")),
        ),
    }
}

fn block_on<F: std::future::Future>(work: F) -> std::io::Result<F::Output> {
    Ok(runtime(None)?.block_on(work))
}

/// A multi-threaded Tokio runtime with `worker_threads` (Tokio's default, one per core, when
/// `None`).
fn runtime(worker_threads: Option<usize>) -> std::io::Result<tokio::runtime::Runtime> {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if let Some(threads) = worker_threads {
        builder.worker_threads(threads);
    }
    builder.enable_all().build()
}

/// A binary's exit status: success, or failure with the error printed after its name.
pub fn exit_status(program: &str, outcome: Result<(), impl std::fmt::Display>) -> ExitCode {
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("{program}: {error}");
            ExitCode::FAILURE
        }
    }
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
    Run(Box<RunArgs>),
    /// Print the CustomResourceDefinitions as a multi-document YAML stream.
    Crds {
        /// Write one file per CRD (`<group>_<plural>.yaml`) into this directory instead.
        #[arg(long)]
        output_dir: Option<std::path::PathBuf>,
    },
    /// Print a generated page of the book (docs/) as Markdown, or write them all.
    Docs {
        /// The page to print; every page when `--output-dir` is given.
        #[arg(value_enum, required_unless_present = "output_dir")]
        page: Option<crate::docs::Page>,
        /// Write every page to its place under this directory (the book's `docs/src`).
        #[arg(long)]
        output_dir: Option<std::path::PathBuf>,
        /// Directory of the cluster templates the flavors page describes.
        #[arg(long, default_value = "templates")]
        templates: std::path::PathBuf,
    },
    /// Print the capmox version.
    Version,
}

/// Reads a listen address as Go's `net.Listen` does: `:PORT` (no host) means every address,
/// which capmox binds as dual-stack `[::]:PORT`; `HOST:PORT` and `[IPv6]:PORT` bind that address.
pub fn parse_bind_address(value: &str) -> Result<std::net::SocketAddr, String> {
    let value = value.trim();
    if let Some(port) = value.strip_prefix(':') {
        let port: u16 = port
            .parse()
            .map_err(|_| format!("{value:?} is not :PORT with a port number from 0 to 65535"))?;
        return Ok((std::net::Ipv6Addr::UNSPECIFIED, port).into());
    }
    value.parse().map_err(|_| {
        format!(
            "{value:?} is not a listen address: use :PORT for all addresses, IPv4:PORT or \
             [IPv6]:PORT"
        )
    })
}

/// Flags of `capmox run`, named as controller-runtime managers name them.
#[derive(Debug, Clone, clap::Args)]
pub struct RunArgs {
    /// Address of the Prometheus `/metrics` endpoint; `:PORT` listens on every address of
    /// both families (IPv4 only where the host has no IPv6).
    #[arg(long, default_value = ":8080", value_parser = parse_bind_address)]
    pub metrics_bind_address: std::net::SocketAddr,
    /// Address of the `/healthz` and `/readyz` probes (`:PORT` as above).
    #[arg(long, default_value = ":8081", value_parser = parse_bind_address)]
    pub health_probe_bind_address: std::net::SocketAddr,
    /// Address of the CRD conversion webhook (HTTPS, `POST /convert`), served by every replica
    /// (`:PORT` as above).
    #[arg(long, default_value = ":9443", value_parser = parse_bind_address)]
    pub webhook_bind_address: std::net::SocketAddr,
    /// Directory with the webhook's `tls.crt` and `tls.key` (the mounted cert-manager Secret);
    /// re-read when the files change, so a rotated certificate needs no restart.
    #[arg(long, default_value = crate::webhook::DEFAULT_CERT_DIR)]
    pub webhook_cert_dir: std::path::PathBuf,
    /// Serve no conversion webhook: for local runs outside a cluster, where no certificate is
    /// mounted (the API server can then not convert between capmox's API versions).
    #[arg(long, env = "CAPMOX_DISABLE_WEBHOOK")]
    pub disable_webhook: bool,
    /// Elect a leader among replicas through a Lease; only the leader reconciles.
    #[arg(long, env = "CAPMOX_LEADER_ELECT")]
    pub leader_elect: bool,
    /// Name of the leader election Lease (`capmox-controller-leader`, with `-<watch filter>`
    /// appended when `--watch-filter` is set, so every shard elects its own leader).
    #[arg(long)]
    pub leader_election_id: Option<String>,
    /// Namespace of the leader election Lease (defaults to the pod's namespace).
    #[arg(long, env = "POD_NAMESPACE", default_value = "capmox-system")]
    pub leader_election_namespace: String,
    /// How long a lease stays valid without renewal (e.g. `15s`).
    #[arg(long, default_value = "15s", value_parser = parse_duration)]
    pub leader_elect_lease_duration: std::time::Duration,
    /// How long the leader tries to renew before giving up (e.g. `10s`).
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub leader_elect_renew_deadline: std::time::Duration,
    /// How often to try to acquire or renew the lease (e.g. `2s`).
    #[arg(long, default_value = "2s", value_parser = parse_duration)]
    pub leader_elect_retry_period: std::time::Duration,
    /// Only watch this namespace (all namespaces when unset, as clusterctl installs providers).
    #[arg(long)]
    pub namespace: Option<String>,
    /// Only watch and reconcile the objects (ProxmoxClusters, ProxmoxMachines, their templates,
    /// and the CAPI Clusters and Machines) labelled `cluster.x-k8s.io/watch-filter=<value>`
    /// (one manager per shard).
    #[arg(long, value_parser = parse_label_value)]
    pub watch_filter: Option<String>,
    /// Proxmox VE URL for clusters without a credentialsRef, e.g. `https://pve1:8006`.
    #[arg(long, env = "PROXMOX_URL")]
    pub proxmox_url: Option<String>,
    /// Proxmox API token id for clusters without a credentialsRef, e.g. `capmox@pve!capi`.
    #[arg(long, env = "PROXMOX_TOKEN")]
    pub proxmox_token: Option<String>,
    /// Proxmox API token secret (prefer the environment variable; it is never logged).
    #[arg(long, env = "PROXMOX_SECRET", hide_env_values = true, value_parser = parse_secret)]
    pub proxmox_secret: Option<crate::proxmox::Secret>,
    /// PEM file of extra CA certificates to trust for the global Proxmox URL.
    #[arg(long, env = "PROXMOX_ROOT_CA_FILE")]
    pub proxmox_root_ca_file: Option<std::path::PathBuf>,
    /// SHA-256 fingerprint of the Proxmox server certificate to pin (`AA:BB:...`).
    #[arg(long, env = "PROXMOX_FINGERPRINT")]
    pub proxmox_fingerprint: Option<String>,
    /// Skip TLS verification for the global Proxmox URL (labs only; logged as a warning).
    #[arg(long, env = "PROXMOX_INSECURE")]
    pub proxmox_insecure: bool,
    /// Namespaces (comma-separated, `*` for all) whose ProxmoxClusters without a credentialsRef
    /// may use the global credentials; none when unset or empty.
    #[arg(long, env = "CAPMOX_GLOBAL_CREDENTIALS_NAMESPACES", default_value = "")]
    pub global_credentials_namespaces: String,
    /// Namespaces (comma-separated) capmox reads credentials Secrets in; a reference to a Secret
    /// elsewhere is treated as not found. Any namespace when unset or empty.
    #[arg(long, env = "CAPMOX_SECRET_NAMESPACES", default_value = "")]
    pub secret_namespaces: String,
    /// Proxmox origins (comma-separated `scheme://host[:port]`) a credentials Secret's url may
    /// name; any when unset or empty.
    #[arg(long, env = "CAPMOX_ALLOWED_PROXMOX_URLS", default_value = "")]
    pub allowed_proxmox_urls: String,
    /// ProxmoxClusters reconciled at once.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..))]
    pub proxmoxcluster_concurrency: u16,
    /// ProxmoxMachines reconciled at once. Passes mostly wait on the APIs, and each Proxmox
    /// still gets only a few requests at a time, so a fleet over several sites needs more.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u16).range(1..))]
    pub proxmoxmachine_concurrency: u16,
    /// Threads the reconciles run on. Passes mostly wait on the Kubernetes and Proxmox APIs, and
    /// one thread does not pay for waking another after each answer; raise it only when the
    /// manager uses a whole core (`process_cpu_seconds_total`).
    #[arg(long, env = "CAPMOX_WORKER_THREADS", default_value_t = 1, value_parser = clap::builder::TypedValueParser::map(clap::value_parser!(u16).range(1..=64), usize::from))]
    pub worker_threads: usize,
    /// When a machine's Proxmox task or booting guest is looked at again: `learned` models
    /// task durations and clone queues per node, `plain` polls with a doubling interval (the
    /// book's Performance page compares them).
    #[arg(long, value_enum, default_value_t)]
    pub task_timing: crate::controller::machine::TaskTimingPolicy,
    /// How long a zone must have no online node (or no answering Proxmox) before its failure
    /// domain is no longer offered to the control plane (`controlPlane: false`).
    #[arg(long, default_value = "2m", value_parser = parse_duration)]
    pub zone_drain_after: std::time::Duration,
    /// How long such a zone must be healthy again before it is offered again.
    #[arg(long, default_value = "5m", value_parser = parse_duration)]
    pub zone_restore_after: std::time::Duration,
    /// Requests capmox sends to one Proxmox API at once, over all clusters and tokens that
    /// reach it; more wait in capmox (pveproxy serves only a few at a time). Each daemon of a
    /// node gets at most two of them, leaving one of its three workers to other clients.
    #[arg(long, default_value_t = crate::proxmox::DEFAULT_REQUESTS_IN_FLIGHT, value_parser = clap::builder::TypedValueParser::map(clap::value_parser!(u16).range(1..=256), usize::from))]
    pub proxmox_requests_in_flight: usize,
}

impl RunArgs {
    /// The manager configuration these flags describe; `identity` names this replica.
    pub fn manager_config(&self, identity: String) -> crate::controller::ManagerConfig {
        crate::controller::ManagerConfig {
            metrics_address: self.metrics_bind_address,
            health_address: self.health_probe_bind_address,
            leader_election: self
                .leader_elect
                .then(|| crate::controller::LeaderElectionConfig {
                    name: self.lease_name(),
                    namespace: self.leader_election_namespace.clone(),
                    identity,
                    lease_duration: self.leader_elect_lease_duration,
                    renew_deadline: self.leader_elect_renew_deadline,
                    retry_period: self.leader_elect_retry_period,
                }),
            watch_namespace: self.namespace.clone(),
            watch_filter: self.watch_filter.clone(),
            cluster_concurrency: self.proxmoxcluster_concurrency,
            machine_concurrency: self.proxmoxmachine_concurrency,
            task_timing: self.task_timing,
            zone_holds: crate::controller::zone_health::ZoneHolds {
                drain_after: self.zone_drain_after,
                restore_after: self.zone_restore_after,
            },
            proxmox_requests_in_flight: self.proxmox_requests_in_flight,
            webhook: (!self.disable_webhook).then(|| crate::webhook::WebhookConfig {
                bind_address: self.webhook_bind_address,
                cert_dir: self.webhook_cert_dir.clone(),
            }),
        }
    }
}

impl RunArgs {
    /// The Lease this manager elects its leader with: one per shard.
    pub fn lease_name(&self) -> String {
        match (&self.leader_election_id, &self.watch_filter) {
            (Some(name), _) => name.clone(),
            (None, Some(filter)) => format!(
                "{DEFAULT_LEASE}-{}",
                filter.to_ascii_lowercase().replace(['_', '.'], "-")
            ),
            (None, None) => DEFAULT_LEASE.to_owned(),
        }
    }
}

/// The leader election Lease of an unsharded manager.
pub const DEFAULT_LEASE: &str = "capmox-controller-leader";

/// Accepts what Kubernetes accepts as a label value (and is not empty: an empty filter would
/// select the objects without the label, which is not what a shard means).
fn parse_label_value(text: &str) -> Result<String, String> {
    let valid = !text.is_empty()
        && text.len() <= 63
        && text.starts_with(|c: char| c.is_ascii_alphanumeric())
        && text.ends_with(|c: char| c.is_ascii_alphanumeric())
        && text
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if valid {
        Ok(text.to_owned())
    } else {
        Err(format!(
            "{text:?} is not a label value: 1-63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit"
        ))
    }
}

fn parse_secret(text: &str) -> Result<crate::proxmox::Secret, String> {
    Ok(crate::proxmox::Secret::new(text))
}

use crate::controller::credentials::comma_list;

impl RunArgs {
    /// The controller-wide Proxmox credentials; empty values count as unset.
    pub fn global_credentials(&self) -> crate::controller::GlobalCredentials {
        let non_empty = |value: &Option<String>| value.clone().filter(|v| !v.trim().is_empty());
        let ca_pem = self.proxmox_root_ca_file.as_ref().and_then(|path| {
            std::fs::read_to_string(path)
                .map_err(|error| tracing::error!(path = %path.display(), %error, "cannot read the Proxmox CA file; ignoring it"))
                .ok()
        });
        if self.proxmox_insecure {
            tracing::warn!(
                "TLS verification of the global Proxmox URL is disabled (--proxmox-insecure)"
            );
        }
        crate::controller::GlobalCredentials {
            url: non_empty(&self.proxmox_url),
            token_id: non_empty(&self.proxmox_token),
            secret: self
                .proxmox_secret
                .clone()
                .filter(|s| !s.expose().trim().is_empty()),
            tls: crate::proxmox::TlsOptions {
                ca_pem,
                fingerprints: non_empty(&self.proxmox_fingerprint).into_iter().collect(),
                insecure: self.proxmox_insecure,
            },
            namespaces: comma_list(&self.global_credentials_namespaces),
            secret_namespaces: Some(comma_list(&self.secret_namespaces))
                .filter(|namespaces| !namespaces.is_empty()),
            allowed_urls: Some(comma_list(&self.allowed_proxmox_urls))
                .filter(|origins| !origins.is_empty()),
        }
    }
}

/// Parses `500ms`, `15s`, `2m` or `1h`.
pub fn parse_duration(text: &str) -> Result<std::time::Duration, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .ok_or_else(|| format!("{text:?} needs a unit: ms, s, m or h"))?;
    let (number, unit) = text.split_at(split);
    let number: u64 = number
        .parse()
        .map_err(|_| format!("{text:?} does not start with a whole number"))?;
    let millis = match unit {
        "ms" => Some(number),
        "s" => number.checked_mul(1_000),
        "m" => number.checked_mul(60_000),
        "h" => number.checked_mul(3_600_000),
        _ => return Err(format!("{text:?} has unit {unit:?}; use ms, s, m or h")),
    };
    millis
        .map(std::time::Duration::from_millis)
        .ok_or_else(|| format!("{text:?} is too large"))
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
        Command::Docs {
            page,
            output_dir,
            templates,
        } => write_docs(page, output_dir.as_deref(), &templates),
        Command::Version => {
            println!("capmox {}", env!("CARGO_PKG_VERSION"));
            Ok(())
        }
        Command::Run(args) => {
            cli.log.init(None)?;
            let threads = args.worker_threads;
            runtime(Some(threads))?.block_on(run(*args))
        }
    }
}

/// Prints `page`, or writes every page under `output_dir`.
fn write_docs(
    page: Option<crate::docs::Page>,
    output_dir: Option<&std::path::Path>,
    templates: &std::path::Path,
) -> Result<(), CliError> {
    use std::io::Write;
    match (output_dir, page) {
        (Some(dir), _) => {
            for page in crate::docs::Page::ALL {
                let path = dir.join(page.path());
                if let Some(parent) = path.parent() {
                    std::fs::create_dir_all(parent)?;
                }
                std::fs::write(path, crate::docs::render(page, templates)?)?;
            }
        }
        (None, Some(page)) => {
            std::io::stdout().write_all(crate::docs::render(page, templates)?.as_bytes())?;
        }
        // clap requires one of the two.
        (None, None) => {}
    }
    Ok(())
}

/// Logs to stderr in `format`, filtered by `filter` (RUST_LOG syntax; `RUST_LOG` or `info` when
/// unset).
fn init_logging(format: LogFormat, filter: Option<&str>) -> Result<(), LogFilterError> {
    let filter = match filter {
        Some(directives) => EnvFilter::try_new(directives),
        None => EnvFilter::try_from_default_env().or_else(|_| EnvFilter::try_new("info")),
    }
    .map_err(|error| LogFilterError(error.to_string()))?;
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

/// The `User-Agent` of capmox's Kubernetes requests, so API server audit logs, request
/// counts and the field manager of its non-apply writes name capmox (kube sends none).
pub const USER_AGENT: &str = concat!("capmox/", env!("CARGO_PKG_VERSION"));

/// The Kubernetes client configuration from KUBECONFIG or the in-cluster config, with
/// capmox's [`USER_AGENT`].
async fn kube_config() -> Result<kube::Config, kube::Error> {
    let mut config = kube::Config::infer()
        .await
        .map_err(kube::Error::InferConfig)?;
    config.headers.push((
        http::header::USER_AGENT,
        http::HeaderValue::from_static(USER_AGENT),
    ));
    Ok(config)
}

async fn run(args: RunArgs) -> Result<(), CliError> {
    let config = kube_config().await.map_err(CliError::KubeConfig)?;
    let client = kube::Client::try_from(config).map_err(CliError::KubeConfig)?;
    let version = client
        .apiserver_version()
        .await
        .map_err(CliError::KubeUnreachable)?;
    tracing::info!(server_version = %version.git_version, "connected to the Kubernetes API server");
    let shutdown = tokio_util::sync::CancellationToken::new();
    tokio::spawn(cancel_on_signal(shutdown.clone()));
    let config = args.manager_config(replica_identity());
    crate::controller::run(client, config, args.global_credentials(), shutdown).await?;
    tracing::info!("stopped");
    Ok(())
}

/// A replica name that is unique per process: the pod (host) name plus the process id.
fn replica_identity() -> String {
    let host = std::env::var("POD_NAME")
        .or_else(|_| std::env::var("HOSTNAME"))
        .unwrap_or_else(|_| "capmox".to_owned());
    format!("{host}_{}", std::process::id())
}

/// Cancels `token` on SIGTERM (Kubernetes stopping the pod) or SIGINT (Ctrl-C).
async fn cancel_on_signal(token: tokio_util::sync::CancellationToken) {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut terminate) => {
                tokio::select! {
                    _ = terminate.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
    tracing::info!("shutdown signal received; finishing in-flight work");
    token.cancel();
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use clap::Parser;

    use super::{Cli, Command, parse_duration};

    fn run_args(extra: &[&str]) -> Result<super::RunArgs, clap::Error> {
        let cli = Cli::try_parse_from(["capmox", "run"].iter().chain(extra))?;
        match cli.command {
            Command::Run(args) => Ok(*args),
            other => panic!("parsed as {other:?}"),
        }
    }

    #[test]
    fn listeners_default_to_every_address_of_both_families() {
        let addresses = |args: super::RunArgs| {
            [
                args.metrics_bind_address,
                args.health_probe_bind_address,
                args.webhook_bind_address,
            ]
            .map(|address| address.to_string())
        };
        let defaults = run_args(&[]).expect("defaults parse");
        assert_eq!(addresses(defaults), ["[::]:8080", "[::]:8081", "[::]:9443"]);
        let explicit = run_args(&[
            "--metrics-bind-address",
            "127.0.0.1:9090",
            "--health-probe-bind-address",
            "[::1]:9091",
            "--webhook-bind-address",
            ":10443",
        ])
        .expect("explicit addresses parse");
        assert_eq!(
            addresses(explicit),
            ["127.0.0.1:9090", "[::1]:9091", "[::]:10443"]
        );
        for bad in [":http", ":70000", "localhost:80", "8080"] {
            let error = super::parse_bind_address(bad).expect_err(bad);
            assert!(error.contains(bad), "{error}");
        }
    }

    #[test]
    fn every_shard_elects_its_leader_through_its_own_lease() {
        let lease = |extra: &[&str]| run_args(extra).expect("valid flags").lease_name();
        assert_eq!(lease(&[]), "capmox-controller-leader");
        assert_eq!(
            lease(&["--watch-filter", "Team_A.prod"]),
            "capmox-controller-leader-team-a-prod"
        );
        assert_eq!(
            lease(&["--watch-filter", "team-a", "--leader-election-id", "mine"]),
            "mine"
        );
    }

    #[test]
    fn a_watch_filter_must_be_a_label_value() {
        for bad in ["", "-a", "a-", "a b", &"x".repeat(64)] {
            let flag = format!("--watch-filter={bad}");
            let error = run_args(&[&flag]).expect_err(bad).to_string();
            assert!(error.contains("not a label value"), "{bad:?}: {error}");
        }
        assert!(run_args(&["--watch-filter", "a"]).is_ok());
    }

    #[test]
    fn task_timing_is_learned_unless_the_flag_names_another_policy() {
        use crate::controller::machine::TaskTimingPolicy;
        let timing = |extra: &[&str]| run_args(extra).map(|args| args.task_timing);
        assert_eq!(timing(&[]).expect("default"), TaskTimingPolicy::Learned);
        assert_eq!(
            timing(&["--task-timing", "plain"]).expect("plain"),
            TaskTimingPolicy::Plain
        );
        let error = timing(&["--task-timing", "fast"])
            .expect_err("unknown")
            .to_string();
        assert!(
            error.contains("learned") && error.contains("plain"),
            "{error}"
        );
    }

    #[test]
    fn durations_parse_like_kubernetes_flags() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("15s"), Ok(Duration::from_secs(15)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert!(parse_duration("15").unwrap_err().contains("needs a unit"));
        assert!(
            parse_duration("15d")
                .unwrap_err()
                .contains("use ms, s, m or h")
        );
        assert!(parse_duration("s").unwrap_err().contains("whole number"));
    }
}
