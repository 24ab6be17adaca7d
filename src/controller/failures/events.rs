//! Events about failures, published as a courtesy next to the conditions.

use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};

/// Publishes an event about `regarding` as `controller`; a failure to publish is only logged
/// (an event is a courtesy, never a reason to fail a reconcile).
pub async fn publish_event(
    client: &kube::Client,
    controller: &str,
    regarding: &ObjectReference,
    type_: EventType,
    reason: &str,
    note: &str,
) {
    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: controller.into(),
            instance: None,
        },
    );
    let event = Event {
        type_,
        reason: reason.into(),
        // The API server refuses a longer note, and with it the whole event.
        note: Some(crate::controller::conditions::truncate_message(
            note,
            crate::controller::conditions::EVENT_NOTE_MAX,
        )),
        action: reason.into(),
        secondary: None,
    };
    if let Err(error) = recorder.publish(&event, regarding).await {
        tracing::debug!(%error, reason, "could not record an event");
    }
}
