//! The message: one event as the router built it, ready for a sink. It sits below both the
//! router that builds it and the sinks that publish it, which name it
//! [`sink::Message`](crate::sink::Message).

use uuid::Uuid;

/// One event, ready for the broker. The contract every sink keeps:
///
/// - `key` is the aggregate id, so one aggregate's events stay on one partition, in order;
/// - `payload` is the stored payload JSON, unchanged;
/// - `headers` are `id`, `event_type`, `aggregate_type`, `event_version`, then the row's own.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Message {
    /// The event id (also the `id` header).
    pub event_id: Uuid,
    /// The outbox `seq` of the event.
    pub seq: i64,
    /// Where to publish.
    pub topic: String,
    /// The message key: the aggregate id.
    pub key: String,
    /// The payload JSON bytes, shared with the row they were read from (cloning does not copy
    /// them).
    pub payload: bytes::Bytes,
    /// Header names and values, in order.
    pub headers: Vec<(String, String)>,
}

impl Message {
    /// The value of header `name`, if present.
    ///
    /// ```
    /// # let message = seaorm_outbox_relay::sink::Message::example();
    /// assert_eq!(message.header("event_type"), Some("OrderCreated"));
    /// ```
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// A message for examples and tests of custom sinks.
    pub fn example() -> Message {
        let event_id = Uuid::nil();
        Message {
            event_id,
            seq: 1,
            topic: "outbox.event.order".into(),
            key: "42".into(),
            payload: bytes::Bytes::from_static(br#"{"order_id": 42}"#),
            headers: vec![
                ("id".into(), event_id.to_string()),
                ("event_type".into(), "OrderCreated".into()),
                ("aggregate_type".into(), "order".into()),
                ("event_version".into(), "1".into()),
            ],
        }
    }
}
