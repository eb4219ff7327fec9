//! Sinks: where the relay publishes.
//!
//! A sink has two layers, as in vector: a config layer ([`SinkConfig`], read from flags or the
//! TOML file) that builds a running layer (a [`Sink`]). To publish somewhere else, implement
//! [`Sink`] and hand it to [`Relay::new`](crate::Relay::new).

#[cfg(feature = "kafka")]
pub mod kafka;
pub mod memory;
#[cfg(feature = "pulsar")]
pub mod pulsar;
pub mod stdout;

use futures::future::BoxFuture;
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
    /// # let message = outbox_relay::sink::Message::example();
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

/// Why a message was not published.
///
/// Three kinds, because each asks the relay for something different:
/// - [`Transient`](FailureKind::Transient) (broker away, timeout): the row is retried with backoff;
/// - [`Permanent`](FailureKind::Permanent) (message too large, topic missing, not authorized for
///   the topic): retrying cannot help, so the relay parks the event with this message, and later
///   events of its aggregate wait for an operator;
/// - [`Unavailable`](FailureKind::Unavailable) (the relay's credentials or TLS settings are
///   refused): nothing is wrong with the event, and nothing about it is recorded. The relay leaves
///   the rows untouched, reports the broker unavailable on `/readyz`, and backs off as a whole.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
#[non_exhaustive]
pub struct SinkError {
    /// What the broker or client said.
    pub message: String,
    /// What the relay should do about it.
    pub kind: FailureKind,
}

/// The kind of a [`SinkError`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum FailureKind {
    /// Retrying may fix it: the row is retried after a backoff.
    Transient,
    /// Retrying cannot fix it: the event is parked.
    Permanent,
    /// The sink cannot reach its broker as configured (authentication, TLS): the row is left as it
    /// was, and the relay backs off.
    Unavailable,
}

impl SinkError {
    /// A failure that retrying may fix.
    pub fn new(message: impl Into<String>) -> Self {
        SinkError {
            message: message.into(),
            kind: FailureKind::Transient,
        }
    }

    /// A failure that retrying cannot fix: the event is parked.
    pub fn permanent(message: impl Into<String>) -> Self {
        SinkError {
            message: message.into(),
            kind: FailureKind::Permanent,
        }
    }

    /// The broker refuses the sink itself (credentials, TLS): the event is not at fault.
    pub fn unavailable(message: impl Into<String>) -> Self {
        SinkError {
            message: message.into(),
            kind: FailureKind::Unavailable,
        }
    }

    /// Whether retrying cannot fix it.
    pub fn is_permanent(&self) -> bool {
        self.kind == FailureKind::Permanent
    }

    /// Whether the sink as a whole cannot publish.
    pub fn is_unavailable(&self) -> bool {
        self.kind == FailureKind::Unavailable
    }
}

/// Why a message was not sent: an earlier message with its key failed in the same batch.
pub const HELD_BACK: &str = "not sent: an earlier event of its aggregate failed";

/// A destination for events.
///
/// ```
/// use futures::future::BoxFuture;
/// use outbox_relay::sink::{Message, Sink, SinkError};
///
/// /// Counts events instead of publishing them.
/// struct Counter(std::sync::atomic::AtomicUsize);
///
/// impl Sink for Counter {
///     fn name(&self) -> &str { "counter" }
///     fn publish<'a>(&'a self, batch: &'a [Message]) -> BoxFuture<'a, Vec<Result<(), SinkError>>> {
///         Box::pin(async move {
///             self.0.fetch_add(batch.len(), std::sync::atomic::Ordering::Relaxed);
///             batch.iter().map(|_| Ok(())).collect()
///         })
///     }
/// }
/// ```
pub trait Sink: Send + Sync {
    /// A short name for logs, such as `kafka`.
    fn name(&self) -> &str;

    /// Publishes the whole batch (sends pipelined: send all, then await every ack) and returns one
    /// result per message, in order. `Ok` means the broker acknowledged the message durably: the
    /// relay marks a row published only then. The relay checks the count: a sink that returns
    /// more or fewer results fails the whole batch (nothing marked, every row retried later).
    ///
    /// Order: messages with the same key (one aggregate) must reach the broker in batch order, and
    /// once one of them is known to have failed, the later ones must not be sent at all (return an
    /// error for them), or they would overtake it.
    fn publish<'a>(&'a self, batch: &'a [Message]) -> BoxFuture<'a, Vec<Result<(), SinkError>>>;

    /// Whether the sink can reach its broker now, for `/readyz`. The default says yes.
    fn ready(&self) -> BoxFuture<'_, Result<(), SinkError>> {
        Box::pin(futures::future::ready(Ok(())))
    }
}

impl<S: Sink + ?Sized> Sink for Box<S> {
    fn name(&self) -> &str {
        (**self).name()
    }

    fn publish<'a>(&'a self, batch: &'a [Message]) -> BoxFuture<'a, Vec<Result<(), SinkError>>> {
        (**self).publish(batch)
    }

    fn ready(&self) -> BoxFuture<'_, Result<(), SinkError>> {
        (**self).ready()
    }
}

/// The configuration of a built-in sink. The command line builds it from flags, the environment
/// and the `[sink]` table of the config file; an embedding program builds it in code.
///
/// ```
/// use outbox_relay::sink::{SinkConfig, kafka::KafkaConfig};
///
/// let mut kafka = KafkaConfig::new("127.0.0.1:9092");
/// kafka.options.insert("linger.ms".into(), "1".into());
/// let sink = SinkConfig::Kafka(kafka).build().unwrap();
/// assert_eq!(sink.name(), "kafka");
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum SinkConfig {
    /// Apache Kafka, through rdkafka.
    #[cfg(feature = "kafka")]
    Kafka(kafka::KafkaConfig),
    /// Apache Pulsar, through the `pulsar` crate.
    #[cfg(feature = "pulsar")]
    Pulsar(pulsar::PulsarConfig),
    /// One JSON line per event on standard output.
    Stdout,
}

impl SinkConfig {
    /// Builds the running sink. Fails on a configuration the client rejects.
    pub fn build(&self) -> Result<Box<dyn Sink>, SinkError> {
        match self {
            #[cfg(feature = "kafka")]
            SinkConfig::Kafka(config) => Ok(Box::new(kafka::KafkaSink::new(config)?)),
            #[cfg(feature = "pulsar")]
            SinkConfig::Pulsar(config) => Ok(Box::new(pulsar::PulsarSink::new(config)?)),
            SinkConfig::Stdout => Ok(Box::new(stdout::StdoutSink)),
        }
    }
}
