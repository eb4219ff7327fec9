//! CloudEvents 1.0: the relay's messages as CloudEvents, the format events take to cross
//! organisations and platforms (Knative, Dapr, Azure Event Grid), on every sink.
//!
//! The attributes come from the row: `id` = event id, `type` = event type, `source` = the
//! relay's setting (required: it names the producer), `subject` = aggregate id, `time` = created
//! at, `specversion` = `1.0`, `datacontenttype` = `application/json`; the event version and the
//! aggregate type as the extensions `eventversion` and `aggregatetype`. The contract's own
//! headers (`id`, `event_type`, `aggregate_type`, `event_version`) give way to them; headers the
//! application stored (`traceparent`, say) are kept.
//!
//! - **Binary mode** (the default): the payload stays the event's JSON; the attributes become
//!   headers named by the protocol binding: `ce_` on Kafka (and Pulsar, which has no binding of
//!   its own), `ce-` on NATS and HTTP, and `content-type` for `datacontenttype`.
//! - **Structured mode**: the payload is the whole event as JSON (`application/cloudevents+json`),
//!   its `data` the event's JSON as recorded, byte for byte.
//!
//! ```
//! use seaorm_outbox_relay::cloudevents::{CloudEvents, Mode};
//! use seaorm_outbox_relay::sink::Message;
//!
//! let format = CloudEvents::new("//shop.example.com/orders", Mode::Binary);
//! let message = format.apply(Message::example(), Some(0), "ce_");
//! assert_eq!(message.header("ce_type"), Some("OrderCreated"));
//! assert_eq!(message.header("ce_subject"), Some("42"));
//! assert_eq!(message.header("ce_time"), Some("1970-01-01T00:00:00.000Z"));
//! assert_eq!(message.header("content-type"), Some("application/json"));
//! assert_eq!(message.header("event_type"), None, "the contract's header gives way");
//! ```

use crate::message::Message;

/// The CloudEvents format of the relay's messages.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct CloudEvents {
    /// The `source` attribute of every event: a URI reference naming the producer, such as
    /// `//shop.example.com/orders` or `urn:shop:orders`.
    pub source: String,
    /// Binary (attributes as headers) or structured (the whole event as the payload).
    pub mode: Mode,
}

/// How a CloudEvent is carried by a message.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Mode {
    /// Attributes as headers, the payload the event's data.
    #[default]
    Binary,
    /// The whole event as the JSON payload, `content-type: application/cloudevents+json`.
    Structured,
}

impl std::str::FromStr for Mode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "binary" => Ok(Mode::Binary),
            "structured" => Ok(Mode::Structured),
            other => Err(format!(
                "unknown CloudEvents mode `{other}`: binary or structured"
            )),
        }
    }
}

/// The contract's headers that CloudEvents attributes replace.
const CONTRACT_HEADERS: [&str; 4] = ["id", "event_type", "aggregate_type", "event_version"];

impl CloudEvents {
    /// The format with `source` as every event's source.
    pub fn new(source: impl Into<String>, mode: Mode) -> Self {
        CloudEvents {
            source: source.into(),
            mode,
        }
    }

    /// `message` (built under the relay's contract) as a CloudEvent; `created_ms` is the event's
    /// creation time in Unix milliseconds (`time` is left out without it), `prefix` the header
    /// prefix of the sink's protocol binding (binary mode).
    pub fn apply(&self, mut message: Message, created_ms: Option<i64>, prefix: &str) -> Message {
        let contract = |name: &str| message.header(name).unwrap_or_default().to_owned();
        let mut attributes = vec![
            ("specversion", "1.0".to_owned()),
            ("id", message.event_id.to_string()),
            ("source", self.source.clone()),
            ("type", contract("event_type")),
            ("subject", message.key.clone()),
        ];
        if let Some(time) = created_ms.and_then(rfc3339) {
            attributes.push(("time", time));
        }
        attributes.push(("eventversion", contract("event_version")));
        attributes.push(("aggregatetype", contract("aggregate_type")));
        message
            .headers
            .retain(|(name, _)| !CONTRACT_HEADERS.contains(&name.as_str()));
        match self.mode {
            Mode::Binary => {
                let mut headers: Vec<(String, String)> = attributes
                    .into_iter()
                    .map(|(name, value)| (format!("{prefix}{name}"), value))
                    .collect();
                headers.push(("content-type".into(), "application/json".into()));
                headers.append(&mut message.headers);
                message.headers = headers;
            }
            Mode::Structured => {
                let mut event = serde_json::Map::new();
                for (name, value) in attributes {
                    event.insert(name.to_owned(), value.into());
                }
                event.insert("datacontenttype".into(), "application/json".into());
                // `data` is the payload as recorded, spliced in rather than parsed and printed again.
                let attributes = serde_json::Value::Object(event).to_string();
                let mut payload = Vec::with_capacity(attributes.len() + message.payload.len() + 9);
                payload.extend_from_slice(&attributes.as_bytes()[..attributes.len() - 1]);
                payload.extend_from_slice(b",\"data\":");
                payload.extend_from_slice(&message.payload);
                payload.push(b'}');
                message.payload = payload.into();
                message.headers.insert(
                    0,
                    ("content-type".into(), "application/cloudevents+json".into()),
                );
            }
        }
        message
    }
}

/// Unix milliseconds as an RFC 3339 UTC timestamp with milliseconds.
fn rfc3339(ms: i64) -> Option<String> {
    chrono::DateTime::from_timestamp_millis(ms)
        .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn traced() -> Message {
        let mut message = Message::example();
        message
            .headers
            .push(("traceparent".into(), "00-abc-def-01".into()));
        message
    }

    #[test]
    fn binary_mode_puts_the_attributes_in_headers_named_by_the_binding() {
        let format = CloudEvents::new("urn:shop:orders", Mode::Binary);
        let message = format.apply(traced(), Some(1_764_806_400_123), "ce-");
        let headers: Vec<(&str, &str)> = message
            .headers
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_str()))
            .collect();
        assert_eq!(
            headers,
            [
                ("ce-specversion", "1.0"),
                ("ce-id", "00000000-0000-0000-0000-000000000000"),
                ("ce-source", "urn:shop:orders"),
                ("ce-type", "OrderCreated"),
                ("ce-subject", "42"),
                ("ce-time", "2025-12-04T00:00:00.123Z"),
                ("ce-eventversion", "1"),
                ("ce-aggregatetype", "order"),
                ("content-type", "application/json"),
                ("traceparent", "00-abc-def-01"),
            ]
        );
        assert_eq!(
            message.payload,
            Message::example().payload,
            "data untouched"
        );
    }

    #[test]
    fn structured_mode_carries_the_event_as_json_with_the_data_as_recorded() {
        let format = CloudEvents::new("urn:shop:orders", Mode::Structured);
        let message = format.apply(traced(), None, "ce_");
        assert_eq!(
            message.header("content-type"),
            Some("application/cloudevents+json")
        );
        assert_eq!(message.header("traceparent"), Some("00-abc-def-01"));
        assert_eq!(message.header("event_type"), None);
        let event: serde_json::Value = serde_json::from_slice(&message.payload).unwrap();
        assert_eq!(
            event,
            serde_json::json!({
                "specversion": "1.0",
                "id": "00000000-0000-0000-0000-000000000000",
                "source": "urn:shop:orders",
                "type": "OrderCreated",
                "subject": "42",
                "eventversion": "1",
                "aggregatetype": "order",
                "datacontenttype": "application/json",
                "data": {"order_id": 42},
            })
        );
        // Byte for byte: the recorded JSON keeps its spacing.
        let text = std::str::from_utf8(&message.payload).unwrap();
        assert!(text.ends_with(r#","data":{"order_id": 42}}"#), "{text}");
    }

    #[test]
    fn modes_are_named_binary_and_structured() {
        assert_eq!("binary".parse(), Ok(Mode::Binary));
        assert_eq!("structured".parse(), Ok(Mode::Structured));
        assert!(
            "json"
                .parse::<Mode>()
                .unwrap_err()
                .contains("binary or structured")
        );
    }
}
