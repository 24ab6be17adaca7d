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

/// Labels of Proxmox API series.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ProxmoxLabels {
    /// Endpoint template, e.g. `POST /nodes/{node}/qemu/{vmid}/clone`.
    pub endpoint: String,
    /// `ok` or `error`.
    pub outcome: String,
}

/// Labels of the work-queue depth gauge.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct QueueLabels {
    /// Controller name.
    pub name: String,
}

/// All metrics of one manager process, cheap to clone and share between tasks.
#[derive(Clone)]
pub struct Metrics {
    registry: Arc<Registry>,
    reconciles: Family<ReconcileLabels, Counter>,
    reconcile_errors: Family<ControllerLabels, Counter>,
    reconcile_time: Family<ControllerLabels, Histogram>,
    proxmox_requests: Family<ProxmoxLabels, Counter>,
    proxmox_request_time: Family<ProxmoxLabels, Histogram>,
    queue_depth: Family<QueueLabels, Gauge>,
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
        let reconcile_time = Family::<ControllerLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.005, 2.0, 14))
        });
        let proxmox_requests = Family::<ProxmoxLabels, Counter>::default();
        let proxmox_request_time = Family::<ProxmoxLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.005, 2.0, 12))
        });
        let queue_depth = Family::<QueueLabels, Gauge>::default();
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
            "controller_runtime_reconcile_time_seconds",
            "Time spent in one reconciliation",
            reconcile_time.clone(),
        );
        registry.register(
            "capmox_proxmox_api_requests",
            "Proxmox API requests per endpoint and outcome",
            proxmox_requests.clone(),
        );
        registry.register(
            "capmox_proxmox_api_request_duration_seconds",
            "Latency of Proxmox API requests",
            proxmox_request_time.clone(),
        );
        registry.register(
            "workqueue_depth",
            "Objects waiting to be reconciled",
            queue_depth.clone(),
        );
        Self {
            registry: Arc::new(registry),
            reconciles,
            reconcile_errors,
            reconcile_time,
            proxmox_requests,
            proxmox_request_time,
            queue_depth,
        }
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

    /// Records one Proxmox API request.
    pub fn proxmox_request(&self, endpoint: &str, duration: Duration, failed: bool) {
        let labels = ProxmoxLabels {
            endpoint: endpoint.to_owned(),
            outcome: if failed { "error" } else { "ok" }.to_owned(),
        };
        self.proxmox_requests.get_or_create(&labels).inc();
        self.proxmox_request_time
            .get_or_create(&labels)
            .observe(duration.as_secs_f64());
    }

    /// Sets how many objects wait in a controller's queue.
    pub fn set_queue_depth(&self, controller: &str, depth: i64) {
        self.queue_depth
            .get_or_create(&QueueLabels {
                name: controller.to_owned(),
            })
            .set(depth);
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Encoding into a String cannot fail: fmt::Write for String is infallible.
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reconciles_and_proxmox_calls_are_exposed() {
        let metrics = Metrics::new();
        metrics.reconciled("proxmoxcluster", Duration::from_millis(20), false);
        metrics.reconciled("proxmoxcluster", Duration::from_millis(30), true);
        metrics.proxmox_request("GET /version", Duration::from_millis(3), false);
        metrics.set_queue_depth("proxmoxmachine", 4);
        let text = metrics.render();
        for line in [
            r#"controller_runtime_reconcile_total{controller="proxmoxcluster",result="success"} 1"#,
            r#"controller_runtime_reconcile_total{controller="proxmoxcluster",result="error"} 1"#,
            r#"controller_runtime_reconcile_errors_total{controller="proxmoxcluster"} 1"#,
            r#"controller_runtime_reconcile_time_seconds_count{controller="proxmoxcluster"} 2"#,
            r#"capmox_proxmox_api_requests_total{endpoint="GET /version",outcome="ok"} 1"#,
            r#"workqueue_depth{name="proxmoxmachine"} 4"#,
        ] {
            assert!(text.contains(line), "missing {line:?} in\n{text}");
        }
    }
}
