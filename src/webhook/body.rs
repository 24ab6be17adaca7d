//! Reading a review's body within bounds: its size (before buffering more than the limit) and
//! the number of JSON values it holds (before parsing it into `serde_json::Value`s, which cost
//! up to 16 times the bytes read).

use std::cell::Cell;
use std::fmt;

use http_body_util::{BodyExt, LengthLimitError, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::{HeaderMap, StatusCode};
use serde::de::{DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};

/// Why a body is not read or not parsed.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    /// `Content-Length` or the bytes received exceed the limit (HTTP 413).
    #[error("the body exceeds {limit} bytes")]
    TooLarge {
        /// The limit in bytes.
        limit: usize,
    },
    /// The body holds more JSON values than a review of capmox objects can (HTTP 413).
    #[error(
        "the body holds more than {limit} JSON values; no review of capmox objects is that \
         dense"
    )]
    TooManyValues {
        /// The limit in values.
        limit: usize,
    },
    /// Reading the body failed (the client went away, or sent a malformed chunk; HTTP 400).
    #[error("cannot read the body: {0}")]
    Unreadable(String),
}

impl BodyError {
    /// The HTTP status the client gets.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::TooLarge { .. } | Self::TooManyValues { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Self::Unreadable(_) => StatusCode::BAD_REQUEST,
        }
    }
}

/// Reads at most `limit` bytes: a `Content-Length` above it is refused before reading, and a
/// streamed body is cut off as soon as it passes it.
pub async fn read(headers: &HeaderMap, body: Incoming, limit: usize) -> Result<Bytes, BodyError> {
    let declared = headers
        .get(hyper::header::CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.parse::<u64>().ok());
    if declared.is_some_and(|length| length > limit as u64) {
        return Err(BodyError::TooLarge { limit });
    }
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(error) if error.downcast_ref::<LengthLimitError>().is_some() => {
            Err(BodyError::TooLarge { limit })
        }
        Err(error) => Err(BodyError::Unreadable(error.to_string())),
    }
}

/// What a JSON object counts for: parsed, each one allocates a map node several times the size
/// of a scalar, and conversion copies it (measured in `tests/it/webhook_memory.rs`).
pub const OBJECT_WEIGHT: usize = 16;

/// What a JSON array counts for (its vector's allocation).
pub const ARRAY_WEIGHT: usize = 2;

/// Checks that `body` holds at most `limit` JSON values (objects and arrays weighted by what
/// they cost once parsed), without allocating for them. A body that is not JSON passes: the
/// parser that follows says what is wrong with it.
pub fn check_value_count(body: &[u8], limit: usize) -> Result<(), BodyError> {
    // One more than allowed: the count fails when it would reach zero.
    let remaining = Cell::new(limit.saturating_add(1));
    let mut deserializer = serde_json::Deserializer::from_slice(body);
    match (Counter(&remaining)).deserialize(&mut deserializer) {
        Err(_) if remaining.get() == 0 => Err(BodyError::TooManyValues { limit }),
        _ => Ok(()),
    }
}

/// Visits every value of a JSON document, counting down `remaining`; fails when it reaches 0.
#[derive(Clone, Copy)]
struct Counter<'a>(&'a Cell<usize>);

impl Counter<'_> {
    fn take<E: serde::de::Error>(self) -> Result<(), E> {
        self.take_weighted(1)
    }

    fn take_weighted<E: serde::de::Error>(self, weight: usize) -> Result<(), E> {
        match self.0.get().checked_sub(weight) {
            Some(left) if left > 0 => {
                self.0.set(left);
                Ok(())
            }
            _ => {
                self.0.set(0);
                Err(E::custom("too many JSON values"))
            }
        }
    }
}

impl<'de> DeserializeSeed<'de> for Counter<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Counter<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E: serde::de::Error>(self, _: bool) -> Result<(), E> {
        self.take()
    }

    fn visit_i64<E: serde::de::Error>(self, _: i64) -> Result<(), E> {
        self.take()
    }

    fn visit_u64<E: serde::de::Error>(self, _: u64) -> Result<(), E> {
        self.take()
    }

    fn visit_f64<E: serde::de::Error>(self, _: f64) -> Result<(), E> {
        self.take()
    }

    fn visit_str<E: serde::de::Error>(self, _: &str) -> Result<(), E> {
        self.take()
    }

    fn visit_unit<E: serde::de::Error>(self) -> Result<(), E> {
        self.take()
    }

    fn visit_none<E: serde::de::Error>(self) -> Result<(), E> {
        self.take()
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        self.take_weighted(ARRAY_WEIGHT)?;
        while seq.next_element_seed(self)?.is_some() {}
        Ok(())
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        self.take_weighted(OBJECT_WEIGHT)?;
        while map.next_key_seed(self)?.is_some() {
            map.next_value_seed(self)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{BodyError, check_value_count};

    #[test]
    fn values_are_counted_at_every_depth() {
        // An object (16), two keys (2), a list (2) of three numbers (3), a string (1): 24.
        let body = br#"{"a": [0, 1, 2], "b": "x"}"#;
        assert!(check_value_count(body, 24).is_ok());
        assert!(matches!(
            check_value_count(body, 23),
            Err(BodyError::TooManyValues { limit: 23 })
        ));
    }

    #[test]
    fn a_dense_hostile_body_is_refused_and_malformed_json_left_to_the_parser() {
        let mut hostile = b"{\"request\":{\"objects\":[{\"spec\":{\"x\":[".to_vec();
        hostile.extend(std::iter::repeat_n(&b"0,"[..], 100_000).flatten());
        hostile.extend_from_slice(b"0]}}]}}");
        assert!(matches!(
            check_value_count(&hostile, 50_000),
            Err(BodyError::TooManyValues { .. })
        ));
        assert!(check_value_count(&hostile, 200_000).is_ok());
        assert!(check_value_count(b"{not json", 100).is_ok());
    }
}
