//! What a consumer receives: the event as the relay put it on the broker, decoded back into its
//! type.

use crate::OutboxEvent;
use serde::de::DeserializeOwned;
use std::collections::BTreeMap;
use uuid::Uuid;

/// A received event: the contract headers parsed, the rest of the headers kept, the payload raw.
///
/// Build it from any broker message's key, headers and value (what the relay sends to Kafka and
/// Pulsar alike), then decode it into its type:
///
/// ```
/// use seaorm_outbox::{Envelope, OutboxEvent};
///
/// #[derive(serde::Serialize, serde::Deserialize, OutboxEvent, Debug, PartialEq)]
/// #[outbox(aggregate = "order", key = "order_id")]
/// struct OrderPlaced { order_id: u32 }
///
/// let id = seaorm_outbox::Uuid::now_v7().to_string();
/// let headers = [
///     ("id", id.as_bytes()),
///     ("event_type", &b"OrderPlaced"[..]),
///     ("aggregate_type", &b"order"[..]),
///     ("event_version", &b"1"[..]),
///     ("traceparent", &b"00-abc-def-01"[..]),
/// ];
/// let envelope = Envelope::from_parts(Some(b"7"), headers, br#"{"order_id": 7}"#)?;
/// assert_eq!(envelope.aggregate_id, "7");
/// assert_eq!(envelope.headers["traceparent"], "00-abc-def-01");
/// assert_eq!(envelope.decode::<OrderPlaced>()?, OrderPlaced { order_id: 7 });
/// # Ok::<(), seaorm_outbox::EnvelopeError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Envelope {
    /// The event id: the key to deduplicate on (see [`crate::inbox`]).
    pub id: Uuid,
    /// The event type.
    pub event_type: String,
    /// The aggregate type.
    pub aggregate_type: String,
    /// The aggregate id (the message key).
    pub aggregate_id: String,
    /// The payload's schema version.
    pub event_version: i32,
    /// Every other header, such as `traceparent`.
    pub headers: BTreeMap<String, String>,
    /// The payload JSON bytes.
    pub payload: Vec<u8>,
}

/// Why a message is not a usable event.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EnvelopeError {
    /// A header of the contract is missing.
    #[error("the message has no `{0}` header: it was not published by an outbox relay")]
    MissingHeader(&'static str),
    /// A header's value is not what the contract says.
    #[error("header `{name}` is not valid: {value:?}")]
    InvalidHeader {
        /// The header.
        name: &'static str,
        /// Its value, lossily as UTF-8.
        value: String,
    },
    /// The event is of another type than the one asked for.
    #[error("expected event type `{expected}`, got `{found}`")]
    WrongEventType {
        /// The type asked for.
        expected: &'static str,
        /// The type of the event.
        found: String,
    },
    /// The payload is not the JSON of the type asked for.
    #[error("payload of event {id} is not a valid `{event_type}`: {source}")]
    Payload {
        /// The event id.
        id: Uuid,
        /// The type asked for.
        event_type: &'static str,
        /// serde_json's error.
        #[source]
        source: serde_json::Error,
    },
}

impl Envelope {
    /// Builds the envelope from a message's key, headers and value.
    pub fn from_parts<'a>(
        key: Option<&[u8]>,
        headers_in: impl IntoIterator<Item = (&'a str, &'a [u8])>,
        payload: &[u8],
    ) -> Result<Self, EnvelopeError> {
        // The first value of a name wins: the contract's headers come first, so a later header of
        // the same name cannot change the event's id or type.
        let mut headers: BTreeMap<String, String> = BTreeMap::new();
        for (name, value) in headers_in {
            headers
                .entry(name.to_owned())
                .or_insert_with(|| String::from_utf8_lossy(value).into_owned());
        }
        let mut take = |name: &'static str| {
            headers
                .remove(name)
                .ok_or(EnvelopeError::MissingHeader(name))
        };
        let id = take("id")?;
        let id = Uuid::parse_str(&id).map_err(|_| EnvelopeError::InvalidHeader {
            name: "id",
            value: id,
        })?;
        let event_type = take("event_type")?;
        let aggregate_type = take("aggregate_type")?;
        let version = take("event_version")?;
        let event_version = version.parse().map_err(|_| EnvelopeError::InvalidHeader {
            name: "event_version",
            value: version,
        })?;
        Ok(Envelope {
            id,
            event_type,
            aggregate_type,
            aggregate_id: String::from_utf8_lossy(key.unwrap_or_default()).into_owned(),
            event_version,
            headers,
            payload: payload.to_vec(),
        })
    }

    /// Decodes the payload into `E`, after checking that the event is of type `E`.
    pub fn decode<E: OutboxEvent + DeserializeOwned>(&self) -> Result<E, EnvelopeError> {
        if self.event_type != E::EVENT_TYPE {
            return Err(EnvelopeError::WrongEventType {
                expected: E::EVENT_TYPE,
                found: self.event_type.clone(),
            });
        }
        serde_json::from_slice(&self.payload).map_err(|source| EnvelopeError::Payload {
            id: self.id,
            event_type: E::EVENT_TYPE,
            source,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Serialize, serde::Deserialize, Debug)]
    struct Shipped {
        order_id: u32,
    }

    impl OutboxEvent for Shipped {
        const AGGREGATE_TYPE: &'static str = "order";
        const EVENT_TYPE: &'static str = "Shipped";
        const EVENT_VERSION: i32 = 1;
        const TOPIC: Option<&'static str> = None;
        fn aggregate_id(&self) -> String {
            self.order_id.to_string()
        }
    }

    fn envelope(event_type: &str, payload: &[u8]) -> Result<Envelope, EnvelopeError> {
        let id = Uuid::now_v7().to_string();
        let headers = [
            ("id", id.as_bytes()),
            ("event_type", event_type.as_bytes()),
            ("aggregate_type", &b"order"[..]),
            ("event_version", &b"1"[..]),
        ];
        Envelope::from_parts(Some(b"1"), headers, payload)
    }

    #[test]
    fn a_repeated_contract_header_cannot_change_the_event() {
        let id = Uuid::now_v7().to_string();
        let forged = Uuid::now_v7().to_string();
        let headers = [
            ("id", id.as_bytes()),
            ("event_type", &b"Shipped"[..]),
            ("aggregate_type", &b"order"[..]),
            ("event_version", &b"1"[..]),
            ("id", forged.as_bytes()),
            ("event_type", &b"Refunded"[..]),
        ];
        let envelope = Envelope::from_parts(Some(b"1"), headers, b"{}").unwrap();
        assert_eq!(envelope.id.to_string(), id);
        assert_eq!(envelope.event_type, "Shipped");
    }

    #[test]
    fn decoding_checks_the_type_and_the_json() {
        let wrong = envelope("Placed", b"{}")
            .unwrap()
            .decode::<Shipped>()
            .unwrap_err();
        assert_eq!(
            wrong.to_string(),
            "expected event type `Shipped`, got `Placed`"
        );
        let bad = envelope("Shipped", b"{not json")
            .unwrap()
            .decode::<Shipped>()
            .unwrap_err();
        assert!(
            bad.to_string().contains("is not a valid `Shipped`"),
            "{bad}"
        );
        assert_eq!(
            envelope("Shipped", br#"{"order_id": 3}"#)
                .unwrap()
                .decode::<Shipped>()
                .unwrap()
                .order_id,
            3
        );
    }

    #[test]
    fn a_message_without_the_contract_headers_is_refused() {
        let err = Envelope::from_parts(Some(b"1"), [("id", &b"nope"[..])], b"{}").unwrap_err();
        assert!(
            matches!(err, EnvelopeError::InvalidHeader { name: "id", .. }),
            "{err}"
        );
        let err = Envelope::from_parts(None, [], b"{}").unwrap_err();
        assert!(matches!(err, EnvelopeError::MissingHeader("id")), "{err}");
    }
}
