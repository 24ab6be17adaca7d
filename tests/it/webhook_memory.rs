//! What one webhook review costs in memory at most: the bodies the server accepts and the
//! hostile ones it refuses, measured by counting the allocations of the thread that answers
//! (deterministic: no timing, no other thread's allocations).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use capmox::webhook::{CONVERT_PATH, MAX_BODY_BYTES, MAX_JSON_VALUES, answer, capmox_converter};
use serde_json::{Value, json};

/// Counts the live and peak bytes allocated by threads that opted in; others pass through.
struct Counting;

thread_local! {
    static TRACKING: Cell<bool> = const { Cell::new(false) };
    static LIVE: Cell<usize> = const { Cell::new(0) };
    static PEAK: Cell<usize> = const { Cell::new(0) };
}

fn track(grow: usize, shrink: usize) {
    let _ = TRACKING.try_with(|tracking| {
        if tracking.get() {
            let live = LIVE.get().saturating_add(grow).saturating_sub(shrink);
            LIVE.set(live);
            PEAK.set(PEAK.get().max(live));
        }
    });
}

// SAFETY: every call is forwarded to the system allocator unchanged; only counters change.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        track(layout.size(), 0);
        // SAFETY: forwarded with the caller's layout.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        track(0, layout.size());
        // SAFETY: forwarded with the caller's pointer and layout.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        track(new_size, layout.size());
        // SAFETY: forwarded with the caller's pointer, layout and size.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Peak bytes allocated (above what was live before) while answering `body` on `path`, and the
/// status answered.
fn peak_of(path: &str, body: &[u8]) -> (usize, u16) {
    let converter = capmox_converter();
    TRACKING.set(true);
    LIVE.set(0);
    PEAK.set(0);
    let status = answer(path, body, &*converter).status().as_u16();
    TRACKING.set(false);
    (PEAK.get(), status)
}

const MIB: usize = 1024 * 1024;
const V1ALPHA1: &str = "infrastructure.cluster.x-k8s.io/v1alpha1";
const V1ALPHA2: &str = "infrastructure.cluster.x-k8s.io/v1alpha2";

/// A ConversionReview of one ProxmoxMachine whose spec holds `field` (raw JSON).
fn conversion_with(field: &str) -> Vec<u8> {
    let head = format!(
        r#"{{"apiVersion":"apiextensions.k8s.io/v1","kind":"ConversionReview","request":{{"uid":"1","desiredAPIVersion":"{V1ALPHA1}","objects":[{{"apiVersion":"{V1ALPHA2}","kind":"ProxmoxMachine","metadata":{{"name":"m","namespace":"default"}},"spec":{{"x":"#
    );
    [head.as_bytes(), field.as_bytes(), b"}}]}}"].concat()
}

/// An AdmissionReview creating a ProxmoxMachine whose spec holds `field` (raw JSON).
fn admission_with(field: &str) -> Vec<u8> {
    let head = format!(
        r#"{{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{{"uid":"1","kind":{{"group":"infrastructure.cluster.x-k8s.io","version":"v1alpha2","kind":"ProxmoxMachine"}},"resource":{{"group":"infrastructure.cluster.x-k8s.io","version":"v1alpha2","resource":"proxmoxmachines"}},"name":"m","namespace":"default","operation":"CREATE","userInfo":{{}},"object":{{"apiVersion":"{V1ALPHA2}","kind":"ProxmoxMachine","metadata":{{"name":"m","namespace":"default"}},"spec":{{"x":"#
    );
    [head.as_bytes(), field.as_bytes(), b"}}}}"].concat()
}

/// `[e,e,…]` with `count` elements.
fn list_of(element: &str, count: usize) -> String {
    let mut list = String::with_capacity(count * (element.len() + 1) + 2);
    list.push('[');
    for index in 0..count {
        if index > 0 {
            list.push(',');
        }
        list.push_str(element);
    }
    list.push(']');
    list
}

fn admission_path() -> String {
    capmox::webhook::admission::validate_path("ProxmoxMachine")
}

#[test]
fn a_hostile_4_mib_body_is_refused_before_it_is_parsed() {
    // 4 MiB of `[0,0,0,…]` inside an object: 2 Mi values, 64 MiB as serde_json::Value.
    let zeros = list_of("0", (MAX_BODY_BYTES - 1024) / 2);
    for (path, body) in [
        (CONVERT_PATH.to_owned(), conversion_with(&zeros)),
        (admission_path(), admission_with(&zeros)),
    ] {
        assert!(body.len() <= MAX_BODY_BYTES, "{}", body.len());
        let (peak, status) = peak_of(&path, &body);
        assert_eq!(status, 413, "{path}");
        assert!(peak < MIB, "{path}: peak {peak} bytes");
    }
}

#[test]
fn the_densest_accepted_bodies_stay_within_a_bounded_peak() {
    // Shapes that cost the most memory per JSON value, each just under the weighted budget:
    // numbers (32 bytes a Value), objects (a map node each) and empty lists.
    use capmox::webhook::body::{ARRAY_WEIGHT, OBJECT_WEIGHT};
    // The review around the list (a few objects and keys) takes the rest.
    let budget = MAX_JSON_VALUES - 256;
    let shapes = [
        ("numbers", list_of("0", budget)),
        (
            "one-key objects",
            list_of(r#"{"a":0}"#, budget / (OBJECT_WEIGHT + 2)),
        ),
        ("empty objects", list_of("{}", budget / OBJECT_WEIGHT)),
        ("empty lists", list_of("[]", budget / ARRAY_WEIGHT)),
        ("short strings", list_of(r#""a""#, budget)),
    ];
    let mut report = Vec::new();
    let mut worst = 0;
    for (name, field) in &shapes {
        for (path, body) in [
            (CONVERT_PATH.to_owned(), conversion_with(field)),
            (admission_path(), admission_with(field)),
        ] {
            let (peak, status) = peak_of(&path, &body);
            assert_ne!(status, 413, "{name} on {path} is within the budget");
            report.push(format!(
                "{name} on {path}: body {} KiB, peak {} MiB",
                body.len() / 1024,
                peak / MIB
            ));
            worst = worst.max(peak);
        }
    }
    eprintln!("{}", report.join("\n"));
    // Four reviews at once (MAX_CONCURRENT_REVIEWS) stay well inside the pod's 256 MiB.
    assert!(worst <= 32 * MIB, "{}", report.join("\n"));
}

#[test]
fn a_review_of_500_machines_fits_the_limits() {
    // kube lists in pages of 500; a page of realistic ProxmoxMachines converts in one review.
    let machine = |index: usize| -> Value {
        json!({"apiVersion": V1ALPHA2, "kind": "ProxmoxMachine",
               "metadata": {"name": format!("cluster-a-md-0-{index:05}"), "namespace": "tenant-a",
                            "uid": format!("6a1e2f44-0000-4000-8000-{index:012}"),
                            "resourceVersion": "123456", "generation": 3,
                            "creationTimestamp": "2026-01-01T00:00:00Z",
                            "labels": {"cluster.x-k8s.io/cluster-name": "cluster-a",
                                       "cluster.x-k8s.io/deployment-name": "cluster-a-md-0"},
                            "ownerReferences": [{"apiVersion": "cluster.x-k8s.io/v1beta2",
                                "kind": "Machine", "name": format!("cluster-a-md-0-{index:05}"),
                                "uid": "0b6c5a46-0000-4000-8000-000000000000",
                                "controller": true, "blockOwnerDeletion": true}]},
               "spec": {"sourceNode": "pve1", "templateID": 100, "format": "qcow2", "full": true,
                        "numSockets": 1, "numCores": 4, "memoryMiB": 8192,
                        "disks": {"bootVolume": {"disk": "scsi0", "sizeGb": 40}},
                        "network": {"default": {"bridge": "vmbr0", "model": "virtio"}},
                        "providerID": format!("proxmox://4f3c{index:08}")},
               "status": {"ready": true, "vmStatus": "running",
                          "addresses": [{"type": "InternalIP", "address": "10.0.0.10"},
                                        {"type": "Hostname", "address": "node"}]}})
    };
    let objects: Vec<Value> = (0..500).map(machine).collect();
    let body = serde_json::to_vec(&json!({
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "ConversionReview",
        "request": {"uid": "1", "desiredAPIVersion": V1ALPHA1, "objects": objects}}))
    .expect("JSON");
    assert!(body.len() <= MAX_BODY_BYTES, "{}", body.len());
    let (peak, status) = peak_of(CONVERT_PATH, &body);
    assert_eq!(status, 200);
    eprintln!(
        "500 machines: body {} KiB, peak {} MiB",
        body.len() / 1024,
        peak / MIB
    );
}
