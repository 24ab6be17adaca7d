//! The metrics page: every series on `/metrics`, named as the registry registers them, with
//! what it measures.

use std::fmt::Write;

/// One metric family: its registered name and type, its labels and what it measures.
struct Family {
    name: &'static str,
    kind: &'static str,
    labels: &'static str,
    meaning: &'static str,
}

const FAMILIES: &[Family] = &[
    Family {
        name: "controller_runtime_reconcile",
        kind: "counter",
        labels: "`controller`, `result` (`success`, `error`)",
        meaning: "Reconciles per controller and outcome.",
    },
    Family {
        name: "controller_runtime_reconcile_errors",
        kind: "counter",
        labels: "`controller`",
        meaning: "Reconciles that returned an error (Proxmox or Kubernetes failures; the object retries with back-off).",
    },
    Family {
        name: "controller_runtime_reconcile_panics",
        kind: "counter",
        labels: "`controller`",
        meaning: "Reconciles that panicked: a capmox bug, reported as that object's error and retried with back-off while the other objects go on. Alert on any increase.",
    },
    Family {
        name: "controller_runtime_reconcile_time_seconds",
        kind: "histogram",
        labels: "`controller`",
        meaning: "Time spent in one reconcile. A reconcile never waits for a Proxmox task, so long ones mean a slow Proxmox or API server.",
    },
    Family {
        name: "controller_runtime_active_workers",
        kind: "gauge",
        labels: "`controller`",
        meaning: "Reconciles running right now (at most `--proxmoxcluster-concurrency` / `--proxmoxmachine-concurrency`).",
    },
    Family {
        name: "workqueue_depth",
        kind: "gauge",
        labels: "`name` (the controller)",
        meaning: "Objects waiting for a reconcile: changed, or woken by a Cluster, Machine, IP claim or pool, since their last reconcile started. Timed retries waiting for their moment are not in it (controller-runtime counts them once due), because kube-runtime keeps its queue private.",
    },
    Family {
        name: "capmox_proxmox_api_requests",
        kind: "counter",
        labels: "`endpoint` (the API path template, e.g. `POST /nodes/{node}/qemu/{vmid}/clone`)",
        meaning: "Proxmox API requests capmox made, per endpoint template, over every Proxmox it talks to.",
    },
    Family {
        name: "capmox_proxmox_api_errors",
        kind: "counter",
        labels: "`endpoint`",
        meaning: "Proxmox API requests that failed (an error answer or no answer).",
    },
    Family {
        name: "capmox_proxmox_api_request_seconds",
        kind: "gauge",
        labels: "`endpoint`",
        meaning: "Total time spent in Proxmox API requests per endpoint template; its rate over the requests' rate is the mean latency.",
    },
    Family {
        name: "capmox_proxmox_requests_waiting",
        kind: "gauge",
        labels: "`proxmox` (the API, `scheme://host:port`)",
        meaning: "Requests waiting in capmox for their turn at a Proxmox API: at most `--proxmox-requests-in-flight` are sent to one API at once, over every cluster and token that reaches it.",
    },
    Family {
        name: "capmox_proxmox_request_waits",
        kind: "counter",
        labels: "`proxmox`",
        meaning: "Requests that waited for their turn at a Proxmox API.",
    },
    Family {
        name: "capmox_proxmox_request_wait_seconds",
        kind: "counter",
        labels: "`proxmox`",
        meaning: "Time those requests waited, summed; its rate over the waits' rate is the mean wait.",
    },
    Family {
        name: "capmox_task_slots_held",
        kind: "gauge",
        labels: "—",
        meaning: "Clone and disk task slots held now: a running clone holds one on its node (two when it clones to another node) and one per storage it writes to.",
    },
    Family {
        name: "capmox_task_slot_waiting",
        kind: "gauge",
        labels: "—",
        meaning: "Machines waiting in capmox's queue for a clone or disk task slot (`taskLimits`); each reports `WaitingForTaskSlot`.",
    },
    Family {
        name: "capmox_task_slot_waits",
        kind: "counter",
        labels: "—",
        meaning: "Machines that got their task slots after waiting.",
    },
    Family {
        name: "capmox_task_slot_wait_seconds",
        kind: "counter",
        labels: "—",
        meaning: "Time those machines waited, summed; its rate over the waits' rate is the mean wait.",
    },
];

/// The families the page describes, as `(name, type)` as the registry names them (counters
/// without `_total`); a test compares them with what the manager registers.
pub fn documented() -> Vec<(&'static str, &'static str)> {
    FAMILIES.iter().map(|f| (f.name, f.kind)).collect()
}

/// The series name to query: counters carry `_total`.
fn series(family: &Family) -> String {
    match family.kind {
        "counter" => format!("{}_total", family.name),
        _ => family.name.to_owned(),
    }
}

pub(super) fn render() -> String {
    let mut out = String::from(
        "# Metrics\n\n\
         capmox serves Prometheus metrics on `--metrics-bind-address` (`:8080` by default) at\n\
         `/metrics`. The controller metrics carry controller-runtime's names, so dashboards and\n\
         alerts made for other Cluster API providers work unchanged; `controller` is\n\
         `proxmoxcluster` or `proxmoxmachine`. The release's NetworkPolicy admits the metrics port\n\
         from namespaces labelled `metrics: enabled`.\n\n\
         | series | type | labels | meaning |\n|---|---|---|---|\n",
    );
    for family in FAMILIES {
        let name = match family.kind {
            "histogram" => format!("`{0}_bucket`, `{0}_sum`, `{0}_count`", family.name),
            _ => format!("`{}`", series(family)),
        };
        // Writing to a String cannot fail.
        let _ = writeln!(
            out,
            "| {name} | {} | {} | {} |",
            family.kind, family.labels, family.meaning
        );
    }
    out.push_str(
        "\nThe fleet benchmark reads `controller_runtime_reconcile_total` at each phase's start \
         and end (see [Performance](../performance.md)).\n",
    );
    out
}
