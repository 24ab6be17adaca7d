//! Prometheus metrics of the manager, named as controller-runtime names them so existing CAPI
//! dashboards and alerts work unchanged.

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use std::collections::BTreeMap;
use std::panic::AssertUnwindSafe;

use futures::FutureExt;

use super::queue_depth::WorkQueue;
use super::task_slots::{SlotStats, TaskSlots};
use crate::proxmox::{ClientRegistry, EndpointStats, GateStats};

/// Labels of per-controller series.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ControllerLabels {
    /// Controller name (`proxmoxcluster`, `proxmoxmachine`).
    pub controller: String,
}

/// Labels of the reconcile counter: controller and outcome.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReconcileLabels {
    /// Controller name.
    pub controller: String,
    /// `success` or `error`.
    pub result: String,
}

/// A reconcile that panicked: a bug in capmox, reported as that object's error.
#[derive(Debug, thiserror::Error)]
#[error(
    "capmox hit an internal error ({message}); the object is retried with back-off — please report this message as a bug"
)]
pub struct Panicked {
    /// The panic's message.
    pub message: String,
}

impl Panicked {
    /// Reads the message of a caught panic (a `&str` or `String` payload, as `panic!` makes).
    fn from_payload(payload: &(dyn std::any::Any + Send)) -> Self {
        let message = payload
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic without a message".to_owned());
        Self { message }
    }
}

/// All metrics of one manager process, cheap to clone and share between tasks.
#[derive(Clone)]
pub struct Metrics {
    registry: Arc<Registry>,
    reconciles: Family<ReconcileLabels, Counter>,
    reconcile_errors: Family<ControllerLabels, Counter>,
    reconcile_panics: Family<ControllerLabels, Counter>,
    reconcile_time: Family<ControllerLabels, Histogram>,
    active_workers: Family<ControllerLabels, Gauge>,
    proxmox: Option<Arc<ClientRegistry>>,
    queues: Arc<std::sync::Mutex<BTreeMap<String, WorkQueue>>>,
    task_slots: Arc<std::sync::Mutex<Option<TaskSlots>>>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// A fresh registry with every capmox metric registered.
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let reconciles = Family::<ReconcileLabels, Counter>::default();
        let reconcile_errors = Family::<ControllerLabels, Counter>::default();
        let reconcile_panics = Family::<ControllerLabels, Counter>::default();
        let reconcile_time = Family::<ControllerLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.005, 2.0, 14))
        });
        let active_workers = Family::<ControllerLabels, Gauge>::default();
        registry.register(
            "controller_runtime_reconcile",
            "Reconciliations per controller and result",
            reconciles.clone(),
        );
        registry.register(
            "controller_runtime_reconcile_errors",
            "Reconciliations that returned an error",
            reconcile_errors.clone(),
        );
        registry.register(
            "controller_runtime_reconcile_panics",
            "Reconciliations that panicked (a capmox bug; the object is retried with back-off)",
            reconcile_panics.clone(),
        );
        registry.register(
            "controller_runtime_reconcile_time_seconds",
            "Time spent in one reconciliation",
            reconcile_time.clone(),
        );
        registry.register(
            "controller_runtime_active_workers",
            "Reconciles running right now",
            active_workers.clone(),
        );
        Self {
            registry: Arc::new(registry),
            reconciles,
            reconcile_errors,
            reconcile_panics,
            reconcile_time,
            active_workers,
            proxmox: None,
            queues: Arc::default(),
            task_slots: Arc::default(),
        }
    }

    /// Also expose the Proxmox API calls of every client in `registry`, per endpoint.
    pub fn with_proxmox(mut self, registry: Arc<ClientRegistry>) -> Self {
        self.proxmox = Some(registry);
        self
    }

    /// Exposes how many machines wait for a clone or disk task slot, and for how long; gives
    /// `slots` back for the manager to keep.
    pub fn observe_task_slots(&self, slots: TaskSlots) -> TaskSlots {
        *self
            .task_slots
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(slots.clone());
        slots
    }

    /// The work queue of `controller`, created on first use.
    pub fn work_queue(&self, controller: &str) -> WorkQueue {
        self.queues
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .entry(controller.to_owned())
            .or_default()
            .clone()
    }

    /// Runs one reconcile of `object` by `controller`: taken off the work queue, counted as
    /// active while it runs, then recorded with its duration and outcome. A panic becomes the
    /// object's error, so one bad input never stops the controller for every other object.
    pub async fn measure<K: kube::Resource, T, E: From<Panicked>>(
        &self,
        controller: &str,
        object: &K,
        reconcile: impl std::future::Future<Output = Result<T, E>>,
    ) -> Result<T, E> {
        self.work_queue(controller).started(object);
        let _active = self.reconcile_started(controller);
        let started = std::time::Instant::now();
        let result = match AssertUnwindSafe(reconcile).catch_unwind().await {
            Ok(result) => result,
            Err(payload) => {
                let panicked = Panicked::from_payload(payload.as_ref());
                tracing::error!(
                    controller,
                    namespace = object.meta().namespace.as_deref().unwrap_or_default(),
                    name = object.meta().name.as_deref().unwrap_or_default(),
                    panic = %panicked.message,
                    "reconcile panicked; the object is retried with back-off, the others go on"
                );
                self.reconcile_panics
                    .get_or_create(&ControllerLabels {
                        controller: controller.to_owned(),
                    })
                    .inc();
                Err(panicked.into())
            }
        };
        self.reconciled(controller, started.elapsed(), result.is_err());
        result
    }

    /// Counts a reconcile as running until the returned guard is dropped.
    pub fn reconcile_started(&self, controller: &str) -> ActiveReconcile {
        let gauge = self
            .active_workers
            .get_or_create(&ControllerLabels {
                controller: controller.to_owned(),
            })
            .clone();
        gauge.inc();
        ActiveReconcile(gauge)
    }

    /// Records one finished reconciliation.
    pub fn reconciled(&self, controller: &str, duration: Duration, failed: bool) {
        let result = if failed { "error" } else { "success" };
        self.reconciles
            .get_or_create(&ReconcileLabels {
                controller: controller.to_owned(),
                result: result.to_owned(),
            })
            .inc();
        let labels = ControllerLabels {
            controller: controller.to_owned(),
        };
        if failed {
            self.reconcile_errors.get_or_create(&labels).inc();
        }
        self.reconcile_time
            .get_or_create(&labels)
            .observe(duration.as_secs_f64());
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Encoding into a String cannot fail: fmt::Write for String is infallible.
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        let mut body = out.strip_suffix("# EOF\n").unwrap_or(&out).to_owned();
        body.push_str(&self.queue_series());
        let slots = self
            .task_slots
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        if let Some(slots) = slots {
            body.push_str(&task_slot_series(&slots.stats()));
        }
        if let Some(registry) = &self.proxmox {
            body.push_str(&proxmox_series(&registry.endpoint_stats()));
            body.push_str(&gate_series(&registry.gate_stats()));
        }
        body + "# EOF\n"
    }

    /// `workqueue_depth` per controller whose cache is registered, as controller-runtime names it.
    fn queue_series(&self) -> String {
        let queues: Vec<(String, WorkQueue)> = self
            .queues
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .filter(|(_, queue)| queue.is_observed())
            .map(|(name, queue)| (name.clone(), queue.clone()))
            .collect();
        if queues.is_empty() {
            return String::new();
        }
        let mut out = String::from(
            "# HELP workqueue_depth Objects waiting for a reconcile (changed or woken since their last reconcile started; timed retries not included).\n# TYPE workqueue_depth gauge\n",
        );
        for (name, queue) in queues {
            out.push_str(&format!(
                "workqueue_depth{{name=\"{name}\"}} {}\n",
                queue.depth()
            ));
        }
        out
    }
}

/// Decrements the active-reconcile gauge when the reconcile ends (even by an early return).
pub struct ActiveReconcile(Gauge);

impl Drop for ActiveReconcile {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// Requests waiting at each Proxmox API's gate and the time they waited, in the text format.
fn gate_series(stats: &BTreeMap<String, GateStats>) -> String {
    if stats.is_empty() {
        return String::new();
    }
    let mut out = String::new();
    let mut family = |name: &str, kind: &str, help: &str, value: &dyn Fn(&GateStats) -> String| {
        keyed_family(&mut out, "proxmox", stats, [name, kind, help], value);
    };
    family(
        "capmox_proxmox_requests_waiting",
        "gauge",
        "Requests waiting in capmox for their turn at a Proxmox API (--proxmox-requests-in-flight).",
        &|s| s.waiting.to_string(),
    );
    family(
        "capmox_proxmox_request_waits",
        "counter",
        "Requests that waited for their turn at a Proxmox API.",
        &|s| s.waits.to_string(),
    );
    family(
        "capmox_proxmox_request_wait_seconds",
        "counter",
        "Time requests waited for their turn at a Proxmox API, summed.",
        &|s| format!("{:.6}", s.wait_time.as_secs_f64()),
    );
    out
}

/// Clone and disk task slots: held, waited for, and the time spent waiting, in the text format.
fn task_slot_series(stats: &SlotStats) -> String {
    format!(
        "# HELP capmox_task_slots_held Clone and disk task slots held now (one per node and storage a running task uses).\n\
         # TYPE capmox_task_slots_held gauge\n\
         capmox_task_slots_held {}\n\
         # HELP capmox_task_slot_waiting Machines waiting in capmox's queue for a clone or disk task slot (taskLimits).\n\
         # TYPE capmox_task_slot_waiting gauge\n\
         capmox_task_slot_waiting {}\n\
         # HELP capmox_task_slot_waits Machines that got their task slots after waiting.\n\
         # TYPE capmox_task_slot_waits counter\n\
         capmox_task_slot_waits_total {}\n\
         # HELP capmox_task_slot_wait_seconds Time those machines spent waiting, summed.\n\
         # TYPE capmox_task_slot_wait_seconds counter\n\
         capmox_task_slot_wait_seconds_total {:.3}\n",
        stats.held,
        stats.waiting,
        stats.waits,
        stats.wait_time.as_secs_f64()
    )
}

/// One family (`[name, type, help]`) with a series per key of `stats`, labelled `label`.
fn keyed_family<S>(
    out: &mut String,
    label: &str,
    stats: &BTreeMap<String, S>,
    [name, kind, help]: [&str; 3],
    value: &dyn Fn(&S) -> String,
) {
    out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n"));
    let suffix = if kind == "counter" { "_total" } else { "" };
    for (key, stat) in stats {
        let key = key.replace('\\', "\\\\").replace('"', "\\\"");
        out.push_str(&format!(
            "{name}{suffix}{{{label}=\"{key}\"}} {}\n",
            value(stat)
        ));
    }
}

/// Proxmox API calls, errors and latency per endpoint template, in the text format.
fn proxmox_series(stats: &BTreeMap<String, EndpointStats>) -> String {
    let mut out = String::new();
    let mut family =
        |name: &str, kind: &str, help: &str, value: &dyn Fn(&EndpointStats) -> String| {
            keyed_family(&mut out, "endpoint", stats, [name, kind, help], value);
        };
    family(
        "capmox_proxmox_api_requests",
        "counter",
        "Proxmox API requests per endpoint.",
        &|s| s.calls.to_string(),
    );
    family(
        "capmox_proxmox_api_errors",
        "counter",
        "Proxmox API requests that failed.",
        &|s| s.errors.to_string(),
    );
    family(
        "capmox_proxmox_api_request_seconds",
        "gauge",
        "Total time spent in Proxmox API requests per endpoint.",
        &|s| format!("{:.6}", s.total_latency.as_secs_f64()),
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reconciles_and_proxmox_calls_are_exposed() {
        let metrics = Metrics::new();
        metrics.reconciled("proxmoxcluster", Duration::from_millis(20), false);
        metrics.reconciled("proxmoxcluster", Duration::from_millis(30), true);
        let _running = metrics.reconcile_started("proxmoxmachine");
        let text = metrics.render();
        for line in [
            r#"controller_runtime_reconcile_total{controller="proxmoxcluster",result="success"} 1"#,
            r#"controller_runtime_reconcile_total{controller="proxmoxcluster",result="error"} 1"#,
            r#"controller_runtime_reconcile_errors_total{controller="proxmoxcluster"} 1"#,
            r#"controller_runtime_reconcile_time_seconds_count{controller="proxmoxcluster"} 2"#,
            r#"controller_runtime_active_workers{controller="proxmoxmachine"} 1"#,
        ] {
            assert!(text.contains(line), "missing {line:?} in\n{text}");
        }
    }

    #[tokio::test]
    async fn a_panicking_reconcile_is_that_objects_error_and_the_next_one_runs() {
        #[derive(Debug, thiserror::Error)]
        #[error(transparent)]
        struct PassError(#[from] Panicked);

        let metrics = Metrics::new();
        let object = crate::api::ProxmoxMachine::new("m", Default::default());
        let panicking = async {
            let text = "é".repeat(40);
            // The byte slice the review found panicking in the fingerprint parser.
            let sliced = text
                .get(..1)
                .map(str::to_owned)
                .unwrap_or_else(|| panic!("{text} cut inside a character"));
            Ok::<String, PassError>(sliced)
        };
        let error = metrics
            .measure("proxmoxmachine", &object, panicking)
            .await
            .expect_err("the panic is the pass's error");
        assert!(
            error.to_string().contains("cut inside a character"),
            "{error}"
        );
        let next = metrics
            .measure("proxmoxmachine", &object, async { Ok::<_, PassError>(7) })
            .await
            .expect("the next pass runs");
        assert_eq!(next, 7);
        let text = metrics.render();
        for line in [
            r#"controller_runtime_reconcile_panics_total{controller="proxmoxmachine"} 1"#,
            r#"controller_runtime_reconcile_errors_total{controller="proxmoxmachine"} 1"#,
            r#"controller_runtime_reconcile_total{controller="proxmoxmachine",result="success"} 1"#,
            r#"controller_runtime_active_workers{controller="proxmoxmachine"} 0"#,
        ] {
            assert!(text.contains(line), "missing {line:?} in\n{text}");
        }
    }
}
