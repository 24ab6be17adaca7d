//! Hostile and arbitrary input, as properties (bounded case counts, so `make test` stays quick):
//! API conversion round-trips and never panics; both webhooks answer any body (deep nesting,
//! huge arrays, wrong types, bytes that are not UTF-8) without panicking; Proxmox's answers
//! (UPIDs, VM configs, task status, resources) decode to a value or an error; the seed data
//! (meta-data YAML, the ISO image) reads back as what was put in.

use capmox::api::conversion::convert;
use capmox::cloudinit::{MetaData, iso, render_meta_data};
use capmox::proxmox::{ClusterResource, TaskStatus, Upid, VmConfig, VmStatus};
use capmox_sim::iso::IsoImage;
use proptest::prelude::*;
use serde_json::{Value, json};

use crate::conversion::{KINDS, V1ALPHA1, V1ALPHA2, canonical, generated};

/// Any JSON value, a few levels deep.
fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        any::<f64>().prop_map(|f| json!(f)),
        ".{0,12}".prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 32, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map("[a-zA-Z]{1,10}", inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// Replaces the value at a path (chosen by `steps`) in `object` with `with`.
fn graft(object: &mut Value, steps: &[usize], with: Value) {
    let Some((step, rest)) = steps.split_first() else {
        *object = with;
        return;
    };
    let next = match object {
        Value::Object(map) if !map.is_empty() => {
            let key = map.keys().nth(step % map.len()).cloned();
            key.and_then(|k| map.get_mut(&k))
        }
        Value::Array(items) if !items.is_empty() => {
            let index = step % items.len();
            items.get_mut(index)
        }
        _ => None,
    };
    match next {
        Some(next) => graft(next, rest, with),
        None => *object = with,
    }
}

/// JSON nested `depth` levels deep in arrays.
fn nested(depth: usize) -> Vec<u8> {
    let mut body = "[".repeat(depth).into_bytes();
    body.extend("]".repeat(depth).into_bytes());
    body
}

fn other(version: &str) -> &'static str {
    if version == V1ALPHA1 {
        V1ALPHA2
    } else {
        V1ALPHA1
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, failure_persistence: None, ..ProptestConfig::default() })]

    /// Objects beyond the seeds `conversion::` checks round-trip through the other version.
    #[test]
    fn generated_objects_round_trip_through_the_other_version(
        seed in 300u64..1_000_000,
        kind in prop::sample::select(KINDS.to_vec()),
        start in prop::sample::select(vec![V1ALPHA1, V1ALPHA2]),
    ) {
        let object = generated(kind, start, seed);
        let there = convert(object.clone(), other(start)).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let back = convert(canonical(there), start).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(back, object);
    }

    /// A valid object with any part replaced by anything converts or is refused, never a panic.
    #[test]
    fn an_object_with_any_part_replaced_converts_or_is_refused(
        seed in 0u64..1_000,
        kind in prop::sample::select(KINDS.to_vec()),
        start in prop::sample::select(vec![V1ALPHA1, V1ALPHA2]),
        steps in prop::collection::vec(any::<usize>(), 0..6),
        with in any_json(),
    ) {
        let mut object = generated(kind, start, seed);
        graft(&mut object, &steps, with);
        if let Ok(converted) = convert(object, other(start)) {
            prop_assert_eq!(converted["apiVersion"].as_str(), Some(other(start)));
        }
    }

    /// Any bytes, and any JSON in a review's place, get an answer from both webhooks.
    #[test]
    fn the_webhooks_answer_any_body_without_panicking(
        bytes in prop::collection::vec(any::<u8>(), 0..256),
        request in any_json(),
        objects in prop::collection::vec(any_json(), 0..4),
    ) {
        let converter = |object: Value, version: &str| convert(object, version).map_err(|e| e.to_string());
        let _ = capmox::webhook::review(&bytes, &converter);
        let _ = capmox::webhook::admission::review("ProxmoxMachine", &bytes);
        let conversion = json!({
            "apiVersion": "apiextensions.k8s.io/v1", "kind": "ConversionReview",
            "request": {"uid": "u", "desiredAPIVersion": V1ALPHA2, "objects": objects}
        });
        let _ = capmox::webhook::review(conversion.to_string().as_bytes(), &converter);
        let admission = json!({
            "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request
        });
        let _ = capmox::webhook::admission::review("ProxmoxMachine", admission.to_string().as_bytes());
    }

    /// Proxmox's answers of any shape decode to a value or an error.
    #[test]
    fn proxmox_answers_of_any_shape_decode_or_fail(value in any_json(), text in ".{0,80}") {
        let _ = serde_json::from_value::<VmConfig>(value.clone()).map(|config| (config.nics(), config.tags(), config.memory_mib(), config.volume_storages(), config.lock()));
        let _ = serde_json::from_value::<TaskStatus>(value.clone()).map(|status| (status.is_finished(), status.is_success()));
        let _ = serde_json::from_value::<VmStatus>(value.clone()).map(|status| status.is_running());
        let _ = serde_json::from_value::<Vec<ClusterResource>>(value.clone());
        let _ = serde_json::from_value::<ClusterResource>(value);
        let _ = text.parse::<Upid>();
        let config = VmConfig([("net0".to_owned(), json!(text)), ("scsi0".to_owned(), json!(text))].into());
        let _ = (config.nics(), config.volume_storages(), config.get("net0"));
        let _ = capmox::proxmox::parse_property_string(&text, "model");
        let _ = capmox::proxmox::endpoint_of(&text);
        let _ = capmox::cloudinit::mac_from_net_config(&text);
        let _ = capmox::cloudinit::instance_id_from_smbios(&text);
    }

    /// A UPID capmox reads back is the one written (Proxmox writes `pstart` in at most 9 hex
    /// digits), and its text is kept as given.
    #[test]
    fn upids_read_back_as_written(
        node in "[a-z]([a-z0-9-]{0,14}[a-z0-9])?",
        pid in any::<u32>(),
        pstart in 0u64..=0xF_FFFF_FFFF,
        starttime in any::<u32>(),
        kind in "[a-z]{2,12}",
        id in "[a-z0-9.-]{0,12}",
    ) {
        let upid = Upid::new(&node, pid, pstart, u64::from(starttime), &kind, &id, "root@pam!capmox");
        let back: Upid = upid.as_str().parse().map_err(|e: capmox::proxmox::upid::UpidParseError| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(&back, &upid);
        prop_assert_eq!(back.task_type, kind);
        prop_assert_eq!(back.node, node);
    }

    /// meta-data is YAML holding exactly the values given (names and IDs of any text).
    #[test]
    fn meta_data_reads_back_as_given(
        instance_id in "[^\\s].{0,40}",
        hostname in "[^\\s].{0,40}",
        provider in proptest::option::of("[^\\s].{0,30}"),
        version in proptest::option::of("[^\\s].{0,20}"),
    ) {
        let meta = MetaData {
            instance_id: instance_id.clone(),
            hostname: hostname.clone(),
            provider_id: provider.clone(),
            kubernetes_version: version.clone(),
        };
        let text = render_meta_data(&meta).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let read: Value = serde_norway::from_str(&text).map_err(|e| TestCaseError::fail(format!("{e}: {text}")))?;
        prop_assert_eq!(&read["instance-id"], &json!(instance_id));
        prop_assert_eq!(&read["local-hostname"], &json!(hostname));
        prop_assert_eq!(&read["hostname"], &json!(hostname));
        prop_assert_eq!(&read["provider-id"], &provider.map_or(Value::Null, |p| json!(p)));
        prop_assert_eq!(&read["kubernetes-version"], &version.map_or(Value::Null, |v| json!(v)));
    }

    /// The seed ISO's files read back as written, whatever their bytes and sizes.
    #[test]
    fn iso_files_read_back_as_written(
        files in prop::collection::btree_map("[a-z][a-z0-9-]{0,20}", prop::collection::vec(any::<u8>(), 0..5000), 1..6),
    ) {
        let entries: Vec<(&str, &[u8])> = files.iter().map(|(n, b)| (n.as_str(), b.as_slice())).collect();
        let image = IsoImage::parse(&iso::build_iso(iso::NOCLOUD_VOLUME_ID, &entries))
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(image.volume_id, iso::NOCLOUD_VOLUME_ID);
        prop_assert_eq!(image.files, files);
    }

    /// Ignition bootstrap data of any bytes is checked to an error or accepted, never a panic;
    /// the simulator's ISO reader reads any bytes to an image or an error.
    #[test]
    fn arbitrary_ignition_and_iso_bytes_are_read_or_refused(
        bytes in prop::collection::vec(any::<u8>(), 0..512),
        value in any_json(),
    ) {
        let _ = capmox::cloudinit::ignition::check(&bytes);
        let _ = capmox::cloudinit::ignition::check(value.to_string().as_bytes());
        let _ = IsoImage::parse(&bytes);
    }
}

/// Bodies nested far deeper than any review, and arrays far longer: refused or answered, never
/// a stack overflow or a panic.
#[test]
fn deeply_nested_and_huge_bodies_are_refused_without_panicking() {
    let converter =
        |object: Value, version: &str| convert(object, version).map_err(|e| e.to_string());
    for body in [
        nested(100_000),
        format!("[{}0]", "0,".repeat(200_000)).into_bytes(),
        vec![0xff, 0xfe, b'{', 0x80],
    ] {
        assert!(capmox::webhook::review(&body, &converter).is_err());
        assert!(capmox::webhook::admission::review("ProxmoxMachine", &body).is_err());
    }
    let deep_object = format!(
        r#"{{"apiVersion":"apiextensions.k8s.io/v1","kind":"ConversionReview","request":{{"uid":"u","desiredAPIVersion":"{V1ALPHA2}","objects":[{}]}}}}"#,
        String::from_utf8(nested(100)).expect("ASCII")
    );
    let answered = capmox::webhook::review(deep_object.as_bytes(), &converter);
    assert!(
        answered.is_ok(),
        "a review with an odd object is answered: {answered:?}"
    );
}
