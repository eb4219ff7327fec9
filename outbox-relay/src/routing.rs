//! From an outbox row to a broker message: the topic, the key, the headers.
//!
//! Topic: the row's `topic` if set, else the topic registered for its event type (from the
//! `#[derive(OutboxEvent)]` types linked into this binary), else the template, by default
//! `outbox.event.{aggregate_type}` as Debezium's outbox router does.

use crate::cloudevents::CloudEvents;
use crate::message::Message;
use crate::row::OutboxRow;
use seaorm_outbox::EventRegistration;
use std::collections::HashMap;

/// Debezium's default route: `outbox.event.` and the aggregate type.
pub const DEFAULT_TOPIC_TEMPLATE: &str = "outbox.event.{aggregate_type}";

/// Routes rows to topics and builds their messages.
///
/// ```
/// use seaorm_outbox_relay::Router;
///
/// let router = Router::new("events.{aggregate_type}", false);
/// assert_eq!(router.topic_for("order", "SomethingUnregistered", None), Ok("events.order".to_owned()));
/// assert_eq!(router.topic_for("order", "X", Some("override")), Ok("override".to_owned()));
/// let strict = Router::new("events.{aggregate_type}", true);
/// assert!(strict.topic_for("order", "SomethingUnregistered", None).is_err());
/// ```
#[derive(Debug, Clone)]
pub struct Router {
    template: String,
    strict: bool,
    registered: HashMap<&'static str, &'static EventRegistration>,
    /// Messages as CloudEvents, with the header prefix of the sink's protocol binding.
    cloudevents: Option<(CloudEvents, String)>,
}

impl Router {
    /// A router over the event types registered in this binary. With `strict`, an event type no
    /// registration knows cannot be routed: its row is parked.
    pub fn new(template: &str, strict: bool) -> Self {
        let registered = seaorm_outbox::registrations()
            .into_iter()
            .map(|r| (r.event_type, r))
            .collect();
        Router {
            template: template.to_owned(),
            strict,
            registered,
            cloudevents: None,
        }
    }

    /// Builds messages as CloudEvents (`format`), naming binary mode's headers with `prefix`, the
    /// sink's [`cloudevents_prefix`](crate::sink::Sink::cloudevents_prefix).
    pub fn with_cloudevents(mut self, format: CloudEvents, prefix: &str) -> Self {
        self.cloudevents = Some((format, prefix.to_owned()));
        self
    }

    /// The registrations this router knows, by event type.
    pub fn registered(&self) -> impl Iterator<Item = &'static EventRegistration> + '_ {
        self.registered.values().copied()
    }

    /// The topic for an event, or why it has none.
    pub fn topic_for(
        &self,
        aggregate_type: &str,
        event_type: &str,
        row_topic: Option<&str>,
    ) -> Result<String, String> {
        if let Some(topic) = row_topic {
            return Ok(topic.to_owned());
        }
        match self.registered.get(event_type) {
            Some(registration) => Ok(registration
                .topic
                .map_or_else(|| self.template_topic(aggregate_type), str::to_owned)),
            None if self.strict => Err(format!(
                "unknown event type `{event_type}`: no #[derive(OutboxEvent)] type in this relay \
                 registers it (--strict); link the events crate into the relay or drop --strict"
            )),
            None => Ok(self.template_topic(aggregate_type)),
        }
    }

    fn template_topic(&self, aggregate_type: &str) -> String {
        self.template.replace("{aggregate_type}", aggregate_type)
    }

    /// The message for `row`, or why the row can never be published as it is.
    pub(crate) fn message(&self, row: &OutboxRow) -> Result<Message, String> {
        if let Some(defect) = &row.defect {
            return Err(defect.clone());
        }
        let topic = self.topic_for(&row.aggregate_type, &row.event_type, row.topic.as_deref())?;
        let event_id = uuid::Uuid::parse_str(&row.id)
            .map_err(|e| format!("event id `{}` is not a UUID: {e}", row.id))?;
        let mut headers = vec![
            ("id".to_owned(), event_id.to_string()),
            ("event_type".to_owned(), row.event_type.clone()),
            ("aggregate_type".to_owned(), row.aggregate_type.clone()),
            ("event_version".to_owned(), row.event_version.to_string()),
        ];
        if let Some(stored) = &row.headers {
            let stored = stored_headers(stored)?;
            if let Some((name, _)) = stored
                .iter()
                .find(|(name, _)| seaorm_outbox::RESERVED_HEADERS.contains(&name.as_str()))
            {
                return Err(format!(
                    "header `{name}` is reserved: the contract sets it from the row itself"
                ));
            }
            headers.extend(stored);
        }
        let message = Message {
            event_id,
            seq: row.seq,
            topic,
            key: row.aggregate_id.clone(),
            payload: row.payload.clone(),
            headers,
        };
        Ok(match &self.cloudevents {
            Some((format, prefix)) => format.apply(message, row.created_ms, prefix),
            None => message,
        })
    }
}

/// The row's `headers` column: a JSON object; string values are taken as they are, others as JSON.
fn stored_headers(json: &str) -> Result<Vec<(String, String)>, String> {
    let value: serde_json::Value =
        serde_json::from_str(json).map_err(|e| format!("headers are not valid JSON: {e}"))?;
    match value {
        serde_json::Value::Null => Ok(Vec::new()),
        serde_json::Value::Object(map) => Ok(map
            .into_iter()
            .map(|(k, v)| match v {
                serde_json::Value::String(s) => (k, s),
                other => (k, other.to_string()),
            })
            .collect()),
        other => Err(format!("headers must be a JSON object, not {other}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(headers: Option<&str>) -> OutboxRow {
        OutboxRow {
            id: "01939f1c-7b6a-7cc0-8f3e-1a2b3c4d5e6f".into(),
            seq: 7,
            position: 7,
            aggregate_type: "order".into(),
            aggregate_id: "o-1".into(),
            event_type: "OrderPlaced".into(),
            event_version: 2,
            topic: None,
            payload: bytes::Bytes::from_static(br#"{"a": 1}"#),
            headers: headers.map(str::to_owned),
            attempts: 0,
            created_ms: Some(0),
            defect: None,
            recorded: None,
        }
    }

    #[test]
    fn message_carries_the_contract_headers_then_the_stored_ones() {
        let router = Router::new(DEFAULT_TOPIC_TEMPLATE, false);
        let m = router
            .message(&row(Some(r#"{"traceparent": "00-abc-def-01", "n": 3}"#)))
            .unwrap();
        assert_eq!(m.topic, "outbox.event.order");
        assert_eq!(m.key, "o-1");
        assert_eq!(m.payload, &br#"{"a": 1}"#[..]);
        let names: Vec<&str> = m.headers.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(
            names,
            [
                "id",
                "event_type",
                "aggregate_type",
                "event_version",
                "n",
                "traceparent"
            ]
        );
        assert_eq!(m.header("id"), Some("01939f1c-7b6a-7cc0-8f3e-1a2b3c4d5e6f"));
        assert_eq!(m.header("event_version"), Some("2"));
        assert_eq!(m.header("n"), Some("3"));
    }

    #[test]
    fn bad_headers_or_id_are_reasons_to_park() {
        let router = Router::new(DEFAULT_TOPIC_TEMPLATE, false);
        assert!(
            router
                .message(&row(Some("[1]")))
                .unwrap_err()
                .contains("JSON object")
        );
        for reserved in seaorm_outbox::RESERVED_HEADERS {
            let json = format!(r#"{{"{reserved}": "forged"}}"#);
            let reason = router.message(&row(Some(&json))).unwrap_err();
            assert!(
                reason.contains(&format!("header `{reserved}` is reserved")),
                "{reason}"
            );
        }
        let mut bad_id = row(None);
        bad_id.id = "nope".into();
        assert!(router.message(&bad_id).unwrap_err().contains("not a UUID"));
        let mut defective = row(None);
        defective.defect = Some("payload is not valid JSON".into());
        assert_eq!(
            router.message(&defective).unwrap_err(),
            "payload is not valid JSON"
        );
    }

    mod any_row {
        //! Property: routing any row never panics; a message keeps the contract (the four
        //! contract headers first, from the row; the key is the aggregate id; the payload
        //! untouched), and anything else is a reason to park.
        use super::*;
        use proptest::prelude::*;

        fn headers() -> impl Strategy<Value = Option<String>> {
            prop_oneof![
                Just(None),
                ".{0,30}".prop_map(Some),
                proptest::collection::btree_map("[a-z_]{0,12}", ".{0,8}", 0..4)
                    .prop_map(|m| Some(serde_json::to_string(&m).unwrap())),
            ]
        }

        proptest! {
            #[test]
            fn any_row_becomes_a_message_or_a_reason(
                id in prop_oneof![".{0,40}", "[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"],
                aggregate_type in ".{0,20}", aggregate_id in ".{0,20}", event_type in ".{0,20}",
                event_version in any::<i32>(), topic in proptest::option::of(".{0,20}"),
                headers in headers(), strict in any::<bool>(),
            ) {
                let row = OutboxRow {
                    id, seq: 1, position: 1, aggregate_type, aggregate_id, event_type, event_version, topic,
                    payload: bytes::Bytes::from_static(b"{}"), headers, attempts: 0,
                    created_ms: None, defect: None, recorded: None,
                };
                let router = Router::new("t.{aggregate_type}", strict);
                match router.message(&row) {
                    Ok(m) => {
                        let contract: Vec<(&str, &str)> =
                            m.headers[..4].iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
                        let version = row.event_version.to_string();
                        let id = m.event_id.to_string();
                        prop_assert_eq!(contract, vec![
                            ("id", id.as_str()),
                            ("event_type", row.event_type.as_str()),
                            ("aggregate_type", row.aggregate_type.as_str()),
                            ("event_version", version.as_str()),
                        ]);
                        prop_assert!(m.headers[4..].iter().all(|(k, _)| !seaorm_outbox::RESERVED_HEADERS.contains(&k.as_str())));
                        prop_assert_eq!(&m.key, &row.aggregate_id);
                        prop_assert_eq!(&m.payload, &row.payload);
                        prop_assert!(!strict || row.topic.is_some() || router.registered().any(|r| r.event_type == row.event_type));
                    }
                    Err(reason) => prop_assert!(!reason.is_empty()),
                }
            }
        }
    }
}
