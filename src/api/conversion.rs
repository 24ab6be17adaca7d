//! Conversion between the served versions (`v1alpha1`, the Go provider's deprecated spoke, and
//! `v1alpha2`, the hub and storage version), as the conversion webhook performs it.

use serde_json::Value;

/// Why an object could not be converted.
#[derive(Debug, thiserror::Error)]
pub enum ConversionError {
    /// The object or the requested version is not one capmox serves.
    #[error("cannot convert {kind} from {from} to {to}: capmox serves {group}/v1alpha1 and {group}/v1alpha2 only", group = super::GROUP)]
    Unsupported {
        /// Kind of the object.
        kind: String,
        /// `apiVersion` of the object.
        from: String,
        /// Requested `apiVersion`.
        to: String,
    },
}

/// Converts one object (any capmox kind, as JSON) to `desired_api_version`.
pub fn convert(object: Value, desired_api_version: &str) -> Result<Value, ConversionError> {
    let from = object["apiVersion"].as_str().unwrap_or_default().to_owned();
    if from == desired_api_version {
        return Ok(object);
    }
    Err(ConversionError::Unsupported {
        kind: object["kind"].as_str().unwrap_or_default().to_owned(),
        from,
        to: desired_api_version.to_owned(),
    })
}
