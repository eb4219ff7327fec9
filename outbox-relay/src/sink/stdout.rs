//! A sink that prints one JSON line per event: for local debugging and the demo.

use super::{Ack, Message, Sink, SinkError};
use futures::future::{BoxFuture, FutureExt, ready};
use serde::Serialize;
use serde_json::Value;
use std::io::Write;

/// Prints each event as one JSON line on standard output:
/// `{"topic":…,"key":…,"headers":{…},"payload":…}`.
#[derive(Debug, Default)]
pub struct StdoutSink;

impl StdoutSink {
    /// The JSON line printed for `message`.
    ///
    /// ```
    /// # use seaorm_outbox_relay::sink::{Message, stdout::StdoutSink};
    /// let line = StdoutSink::line(&Message::example());
    /// assert!(line.starts_with(r#"{"topic":"outbox.event.order","key":"42""#));
    /// ```
    pub fn line(message: &Message) -> String {
        let payload = serde_json::from_slice::<Value>(&message.payload)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&message.payload).into()));
        let line = Line {
            topic: &message.topic,
            key: &message.key,
            headers: Headers(&message.headers),
            payload,
        };
        serde_json::to_string(&line).unwrap_or_default()
    }
}

/// One printed line; fields in this order.
#[derive(Serialize)]
struct Line<'a> {
    topic: &'a str,
    key: &'a str,
    headers: Headers<'a>,
    payload: Value,
}

/// Headers as a JSON object, in the message's order.
struct Headers<'a>(&'a [(String, String)]);

impl Serialize for Headers<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_map(self.0.iter().map(|(k, v)| (k, v)))
    }
}

impl Sink for StdoutSink {
    fn name(&self) -> &str {
        "stdout"
    }

    fn enqueue<'a>(&'a self, message: &'a Message) -> BoxFuture<'a, Result<Ack, SinkError>> {
        // Standard output is line-buffered: each line is written out when it is acked.
        let written = writeln!(std::io::stdout().lock(), "{}", Self::line(message))
            .map_err(|e| SinkError::new(e.to_string()));
        ready(Ok(ready(written).boxed())).boxed()
    }
}
