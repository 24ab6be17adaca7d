//! The provider child the benchmark measures (`capmox run`, or the Go provider's manager with
//! `--provider go`): started against the in-process API server and the simulator, read
//! through `/proc/<pid>` and its `/metrics`, killed and reaped when dropped (on error paths
//! too).

use std::collections::VecDeque;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::BenchError;
use crate::analysis::{stat_ticks, status_kib};
use crate::go_fleet::klog_level;

/// The log line in which `capmox run` names the address of `/readyz` and `/metrics` (with
/// port 0 in the flags, the only place the chosen port appears).
const SERVING: &str = "serving /healthz, /readyz and /metrics";
/// Log lines of the child kept for error messages.
const TAIL_LINES: usize = 30;

/// How to start `capmox run`.
pub struct Launch<'a> {
    /// The `capmox` executable.
    pub binary: &'a Path,
    /// Kubeconfig of the in-process API server.
    pub kubeconfig: &'a Path,
    /// The simulator's URL, for capmox's global credentials.
    pub proxmox_url: String,
    /// The simulator's API token id (`--proxmox-token`).
    pub token_id: String,
    /// The token's secret, passed as `PROXMOX_SECRET` so it stays out of the command line.
    pub secret: String,
    /// `--proxmoxmachine-concurrency`.
    pub machine_concurrency: u16,
    /// `--task-timing`, when not capmox's default.
    pub task_timing: Option<capmox::controller::machine::TaskTimingPolicy>,
    /// Show every log line of the child (else only warnings and errors).
    pub verbose: bool,
}

/// How to start the Go provider's manager: its global credentials come from the
/// environment only (`PROXMOX_URL`, `PROXMOX_TOKEN`, `PROXMOX_SECRET`).
pub struct GoLaunch<'a> {
    /// The manager executable.
    pub binary: &'a Path,
    /// Kubeconfig of the in-process API server.
    pub kubeconfig: &'a Path,
    /// The simulator's base URL (the Go client adds `/api2/json`).
    pub proxmox_url: String,
    /// The simulator's API token id.
    pub token_id: String,
    /// The token's secret.
    pub secret: String,
    /// Show every log line of the child (else only warnings and errors).
    pub verbose: bool,
}

/// How a child writes its log: capmox's JSON lines, or klog's text lines.
#[derive(Clone, Copy)]
enum LogFormat {
    Json,
    Klog,
}

/// CPU and memory of one process, from `/proc/<pid>/stat` and `status`.
#[derive(Clone, Debug, Default)]
pub struct ProcSample {
    /// utime + stime of the whole process (exited threads included), seconds.
    pub cpu: f64,
    /// Resident memory now (VmRSS).
    pub rss_kib: u64,
    /// Peak resident memory (VmHWM) since the last reset or the process start.
    pub peak_kib: u64,
}

/// Samples `/proc/<pid>` (`pid` is `self` for the bench process).
pub fn sample(pid: &str, ticks: f64) -> Result<ProcSample, BenchError> {
    let stat_path = format!("/proc/{pid}/stat");
    let (_, total) = stat_ticks(&read(&stat_path)?)
        .ok_or_else(|| BenchError::Inconsistent(format!("unreadable {stat_path}")))?;
    let status = read(&format!("/proc/{pid}/status"))?;
    Ok(ProcSample {
        cpu: total as f64 / ticks,
        rss_kib: status_kib(&status, "VmRSS:"),
        peak_kib: status_kib(&status, "VmHWM:"),
    })
}

/// Resets a process's peak RSS (VmHWM) to its current RSS, so a phase reports its own peak;
/// false where the kernel does not allow it.
pub fn reset_peak(pid: &str) -> bool {
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5").is_ok()
}

/// A `/proc` file, or an error that says the bench needs Linux.
fn read(path: &str) -> Result<String, BenchError> {
    std::fs::read_to_string(path).map_err(|source| BenchError::Proc {
        path: path.into(),
        source,
    })
}

/// A running provider: `capmox run` or the Go provider's manager.
pub struct ProviderProcess {
    child: Child,
    /// `/healthz` and `/readyz`.
    probes: SocketAddr,
    /// `/metrics` (capmox serves it with the probes, the Go manager on its diagnostics port).
    metrics: SocketAddr,
    /// How the child is named in errors.
    name: &'static str,
    tail: Arc<Mutex<VecDeque<String>>>,
    /// Cancelled when the child closes its stderr, i.e. exits.
    stopped: CancellationToken,
}

impl ProviderProcess {
    /// Starts `capmox run` and waits until it serves `/readyz` with 200 (every controller has
    /// listed its objects), or fails with what it logged.
    pub async fn start(launch: Launch<'_>, timeout: Duration) -> Result<Self, BenchError> {
        let mut command = Command::new(launch.binary);
        command
            .args(["--log-format", "json", "run"])
            // One address: the probes and /metrics share one server, on a port the OS picks.
            .args(["--metrics-bind-address", "127.0.0.1:0"])
            .args(["--health-probe-bind-address", "127.0.0.1:0"])
            // No certificate to serve, and parallel runs must not contend for port 9443.
            .arg("--disable-webhook")
            .args(["--proxmox-url", &launch.proxmox_url])
            .args(["--proxmox-token", &launch.token_id])
            // The bench's clusters use the global credentials, whatever their namespace.
            .args(["--global-credentials-namespaces", "*"])
            .arg("--proxmoxmachine-concurrency")
            .arg(launch.machine_concurrency.to_string())
            .args(
                launch
                    .task_timing
                    .map(|timing| ["--task-timing", timing.as_str()])
                    .into_iter()
                    .flatten(),
            )
            .env("KUBECONFIG", launch.kubeconfig)
            // The secret through the environment, as the CLI recommends (never in `ps`).
            .env("PROXMOX_SECRET", &launch.secret)
            // Nothing from the caller's environment may change what runs: no in-cluster
            // config, no leader election, no other trust settings for the simulator.
            .env_remove("KUBERNETES_SERVICE_HOST")
            .env_remove("CAPMOX_LEADER_ELECT")
            .env_remove("PROXMOX_ROOT_CA_FILE")
            .env_remove("PROXMOX_FINGERPRINT")
            .env_remove("PROXMOX_INSECURE")
            .env_remove("CAPMOX_SECRET_NAMESPACES")
            .env_remove("CAPMOX_ALLOWED_PROXMOX_URLS");
        let unknown = SocketAddr::from(([127, 0, 0, 1], 0));
        let (mut process, address_rx) = Self::spawn(
            command,
            launch.binary,
            "capmox",
            LogFormat::Json,
            launch.verbose,
            (unknown, unknown),
        )?;
        let deadline = Instant::now() + timeout;
        let address = match tokio::time::timeout_at(deadline, address_rx).await {
            Ok(Ok(address)) => address,
            // The reader ended without the line: the child closed stderr, i.e. exited.
            Ok(Err(_)) => return Err(process.failed("it stopped before serving /readyz")),
            Err(_) => {
                return Err(
                    process.failed(&format!("it named no /readyz address within {timeout:?}"))
                );
            }
        };
        process.probes = address;
        process.metrics = address;
        process.wait_ready(deadline, timeout).await?;
        Ok(process)
    }

    /// Starts the Go provider's manager (no webhooks, no leader election, plain-HTTP
    /// diagnostics for `/metrics`) and waits until its `/readyz` answers 200.
    pub async fn start_go(launch: GoLaunch<'_>, timeout: Duration) -> Result<Self, BenchError> {
        // The manager logs its listeners' configured addresses, not the ports the OS chose:
        // take two free ports first.
        let probes = free_port()?;
        let metrics = free_port()?;
        let mut command = Command::new(launch.binary);
        command
            .arg("--enable-webhooks=false")
            .arg("--leader-elect=false")
            .arg(format!("--health-probe-bind-address={probes}"))
            .arg(format!("--diagnostics-address={metrics}"))
            .arg("--insecure-diagnostics")
            .arg(format!("--kubeconfig={}", launch.kubeconfig.display()))
            .env("PROXMOX_URL", &launch.proxmox_url)
            .env("PROXMOX_TOKEN", &launch.token_id)
            .env("PROXMOX_SECRET", &launch.secret)
            .env_remove("KUBECONFIG")
            .env_remove("KUBERNETES_SERVICE_HOST")
            .env_remove("PROXMOX_INSECURE");
        let (mut process, _) = Self::spawn(
            command,
            launch.binary,
            "go-capmox",
            LogFormat::Klog,
            launch.verbose,
            (probes, metrics),
        )?;
        let deadline = Instant::now() + timeout;
        process.wait_ready(deadline, timeout).await?;
        Ok(process)
    }

    /// Spawns `command` with its stderr followed by a thread of its own; the receiver gets
    /// the address capmox names for its probes (never, for a klog child).
    fn spawn(
        mut command: Command,
        binary: &Path,
        name: &'static str,
        format: LogFormat,
        verbose: bool,
        (probes, metrics): (SocketAddr, SocketAddr),
    ) -> Result<(Self, tokio::sync::oneshot::Receiver<SocketAddr>), BenchError> {
        let mut child = command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|source| BenchError::Spawn {
                path: binary.to_path_buf(),
                source,
            })?;
        let tail = Arc::new(Mutex::new(VecDeque::new()));
        let (address_tx, address_rx) = tokio::sync::oneshot::channel();
        let stderr = child.stderr.take();
        let stopped = CancellationToken::new();
        let mut process = Self {
            child,
            probes,
            metrics,
            name,
            tail: tail.clone(),
            stopped: stopped.clone(),
        };
        let Some(stderr) = stderr else {
            return Err(process.failed("its stderr was not captured"));
        };
        std::thread::Builder::new()
            .name(format!("{name}-log"))
            .spawn(move || {
                follow_log(stderr, format, name, address_tx, &tail, verbose);
                stopped.cancel();
            })
            .map_err(|e| BenchError::Inconsistent(format!("cannot start a thread: {e}")))?;
        Ok((process, address_rx))
    }

    /// Polls `/readyz` until it answers 200.
    async fn wait_ready(&mut self, deadline: Instant, timeout: Duration) -> Result<(), BenchError> {
        let mut poll = tokio::time::interval(Duration::from_millis(50));
        let mut last = String::new();
        loop {
            poll.tick().await;
            if Instant::now() >= deadline {
                return Err(self.failed(&format!(
                    "not ready within {timeout:?}; /readyz said {last:?}"
                )));
            }
            if let Ok(Some(_)) = self.child.try_wait() {
                return Err(self.failed("it stopped before it was ready"));
            }
            match get(self.probes, "/readyz").await {
                Ok((200, _)) => return Ok(()),
                Ok((_, body)) => last = body.trim().to_string(),
                Err(error) => last = error.to_string(),
            }
        }
    }

    /// The child's process id, as `/proc` names it.
    pub fn pid(&self) -> String {
        self.child.id().to_string()
    }

    /// The child's Prometheus exposition, or an error that says whether it is still running.
    pub async fn metrics(&mut self) -> Result<String, BenchError> {
        match get(self.metrics, "/metrics").await {
            Ok((200, body)) => Ok(body),
            Ok((status, body)) => {
                Err(self.failed(&format!("/metrics answered {status}: {}", body.trim())))
            }
            Err(error) => Err(self.failed(&format!("cannot read /metrics: {error}"))),
        }
    }

    /// Resolves when the child has exited (its stderr closed), so a phase need not wait for
    /// its timeout.
    pub fn stopped(&self) -> CancellationToken {
        self.stopped.clone()
    }

    /// An error naming what went wrong, the child's exit status if it exited, and its last
    /// log lines.
    pub fn failed(&mut self, what: &str) -> BenchError {
        let status = match self.child.try_wait() {
            Ok(Some(status)) => describe(status),
            Ok(None) => "still running".to_string(),
            Err(error) => format!("status unknown: {error}"),
        };
        let tail = self
            .tail
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .cloned()
            .collect::<Vec<_>>()
            .join("\n  ");
        BenchError::Provider(format!(
            "{}: {what} ({status}); its last log lines:\n  {tail}",
            self.name
        ))
    }
}

impl Drop for ProviderProcess {
    fn drop(&mut self) {
        // SIGKILL: the measurements are taken; nothing of the child's state matters any more.
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

fn describe(status: ExitStatus) -> String {
    match status.code() {
        Some(code) => format!("exited with status {code}"),
        None => format!("ended by a signal ({status})"),
    }
}

/// Reads the child's log lines: sends the `/readyz` address once capmox names it, keeps the
/// last lines, and shows warnings and errors (every line when `verbose`), prefixed with the
/// child's name.
fn follow_log(
    stderr: impl std::io::Read,
    format: LogFormat,
    name: &str,
    address: tokio::sync::oneshot::Sender<SocketAddr>,
    tail: &Mutex<VecDeque<String>>,
    verbose: bool,
) {
    let mut address = Some(address);
    for line in BufReader::new(stderr).lines() {
        let Ok(line) = line else {
            break;
        };
        let shown = match format {
            LogFormat::Json => {
                let parsed: Option<Value> = serde_json::from_str(&line).ok();
                let fields = parsed.as_ref().map(|v| &v["fields"]);
                if let Some(fields) = fields
                    && fields["message"] == SERVING
                    && let Some(found) = fields["address"].as_str().and_then(|a| a.parse().ok())
                    && let Some(sender) = address.take()
                {
                    let _ = sender.send(found);
                }
                let level = parsed
                    .as_ref()
                    .and_then(|v| v["level"].as_str())
                    .unwrap_or("ERROR");
                matches!(level, "WARN" | "ERROR")
            }
            // A line without a klog header continues the one before (a multi-line message).
            LogFormat::Klog => matches!(klog_level(&line), Some('W' | 'E' | 'F')),
        };
        if verbose || shown {
            eprintln!("{name}: {line}");
        }
        let mut tail = tail.lock().unwrap_or_else(|p| p.into_inner());
        if tail.len() == TAIL_LINES {
            tail.pop_front();
        }
        tail.push_back(line);
    }
}

/// A port on 127.0.0.1 nothing listens on now, for a child that cannot be told port 0.
fn free_port() -> Result<SocketAddr, BenchError> {
    std::net::TcpListener::bind(("127.0.0.1", 0))
        .and_then(|listener| listener.local_addr())
        .map_err(|e| BenchError::Inconsistent(format!("cannot find a free port: {e}")))
}

/// `GET path` over HTTP/1.1 with `Connection: close`: (status, body).
async fn get(address: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    let mut stream = tokio::net::TcpStream::connect(address).await?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: capmox\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("no HTTP status line in {head:?}")))?;
    Ok((status, body.to_string()))
}

/// The kubeconfig file the child reads, removed when dropped.
pub struct Kubeconfig(PathBuf);

impl Kubeconfig {
    /// Writes `yaml` to a file of this process in the temporary directory.
    pub fn write(yaml: &str) -> Result<Self, BenchError> {
        let path =
            std::env::temp_dir().join(format!("capmox-bench-{}.kubeconfig", std::process::id()));
        std::fs::write(&path, yaml).map_err(|source| BenchError::Write {
            path: path.clone(),
            source,
        })?;
        Ok(Self(path))
    }

    /// Where the child finds it (its `KUBECONFIG`).
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for Kubeconfig {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}
