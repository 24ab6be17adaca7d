//! Events about failures and progress, published as a courtesy next to the conditions.

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::Api;
use kube::api::{ObjectMeta, PostParams};
use kube::runtime::events::EventType;

use crate::controller::conditions::{EVENT_NOTE_MAX, truncate_message};
use crate::controller::patch;

/// Publishes an event about `regarding` as `controller`; a failure to publish is only logged
/// (an event is a courtesy, never a reason to fail a reconcile). Posted as kube's `Recorder`
/// posts a new event, but its answer is not decoded: machines publish several each.
pub async fn publish_event(
    client: &kube::Client,
    controller: &str,
    regarding: &ObjectReference,
    type_: EventType,
    reason: &str,
    note: &str,
) {
    // Where kube's `Recorder` puts the events of an object without a namespace.
    let namespace = regarding.namespace.as_deref().unwrap_or("default");
    let event = new_event(controller, regarding, type_, reason, note, Timestamp::now());
    let events: Api<Event> = Api::namespaced(client.clone(), namespace);
    if let Err(error) = patch::create(&events, &PostParams::default(), &event).await {
        tracing::debug!(%error, reason, "could not record an event");
    }
}

/// A new `events.k8s.io/v1` Event, named after the object and the time as kube names them.
fn new_event(
    controller: &str,
    regarding: &ObjectReference,
    type_: EventType,
    reason: &str,
    note: &str,
    now: Timestamp,
) -> Event {
    let name = regarding.name.as_deref().unwrap_or(controller);
    Event {
        action: Some(reason.to_owned()),
        reason: Some(reason.to_owned()),
        event_time: Some(MicroTime(now)),
        regarding: Some(regarding.clone()),
        // The API server refuses a longer note, and with it the whole event.
        note: Some(truncate_message(note, EVENT_NOTE_MAX)),
        metadata: ObjectMeta {
            namespace: regarding.namespace.clone(),
            name: Some(format!("{name}.{:x}", now.as_nanosecond())),
            ..ObjectMeta::default()
        },
        reporting_controller: Some(controller.to_owned()),
        reporting_instance: Some(controller.to_owned()),
        type_: Some(
            match type_ {
                EventType::Normal => "Normal",
                EventType::Warning => "Warning",
            }
            .to_owned(),
        ),
        ..Event::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_event_names_its_object_its_reporter_and_why() {
        let regarding = ObjectReference {
            api_version: Some("infrastructure.cluster.x-k8s.io/v1alpha2".into()),
            kind: Some("ProxmoxMachine".into()),
            name: Some("m1".into()),
            namespace: Some("tenant-a".into()),
            uid: Some("u1".into()),
            ..ObjectReference::default()
        };
        let now: Timestamp = "2026-12-07T23:00:00Z".parse().unwrap();
        let long = "x".repeat(EVENT_NOTE_MAX + 10);
        let event = new_event(
            "capmox",
            &regarding,
            EventType::Warning,
            "CloneFailed",
            &long,
            now,
        );
        assert_eq!(event.metadata.namespace.as_deref(), Some("tenant-a"));
        assert_eq!(
            event.metadata.name,
            Some(format!("m1.{:x}", now.as_nanosecond()))
        );
        assert_eq!(event.regarding.as_ref(), Some(&regarding));
        assert_eq!(event.type_.as_deref(), Some("Warning"));
        assert_eq!(event.reason.as_deref(), Some("CloneFailed"));
        assert_eq!(event.action.as_deref(), Some("CloneFailed"));
        assert_eq!(event.reporting_controller.as_deref(), Some("capmox"));
        assert_eq!(event.reporting_instance.as_deref(), Some("capmox"));
        assert_eq!(event.event_time, Some(MicroTime(now)));
        assert!(event.note.as_ref().unwrap().len() <= EVENT_NOTE_MAX);
    }
}
