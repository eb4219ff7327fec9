//! Sinks: where the relay publishes.
//!
//! A sink has two layers, as in vector: a config layer ([`SinkConfig`], read from flags or the
//! TOML file) that builds a running layer (a [`Sink`]). To publish somewhere else, implement
//! [`Sink`] and hand it to [`Relay::new`](crate::relay::Relay::new).

#[cfg(any(feature = "sqs", feature = "sns"))]
pub mod aws;
#[cfg(feature = "kafka")]
pub mod kafka;
pub mod memory;
#[cfg(feature = "nats")]
pub mod nats;
#[cfg(feature = "pulsar")]
pub mod pulsar;
#[cfg(feature = "rabbitmq")]
pub mod rabbitmq;
#[cfg(feature = "sns")]
pub mod sns;
#[cfg(feature = "sqs")]
pub mod sqs;
pub mod stdout;
#[cfg(feature = "webhook")]
pub mod webhook;

use futures::future::BoxFuture;
use std::sync::Arc;

pub use crate::message::Message;

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
    /// How long the broker asked the relay to wait before trying the event again (HTTP's
    /// `Retry-After`): a transient failure is retried no sooner, up to an hour.
    pub retry_after: Option<std::time::Duration>,
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
            retry_after: None,
        }
    }

    /// A failure that retrying cannot fix: the event is parked.
    pub fn permanent(message: impl Into<String>) -> Self {
        SinkError {
            message: message.into(),
            kind: FailureKind::Permanent,
            retry_after: None,
        }
    }

    /// The broker refuses the sink itself (credentials, TLS): the event is not at fault.
    pub fn unavailable(message: impl Into<String>) -> Self {
        SinkError {
            message: message.into(),
            kind: FailureKind::Unavailable,
            retry_after: None,
        }
    }

    /// The same failure, retried no sooner than `after` (a broker's `Retry-After`).
    ///
    /// ```
    /// # use seaorm_outbox_relay::sink::SinkError;
    /// # use std::time::Duration;
    /// let busy = SinkError::new("HTTP 429").with_retry_after(Duration::from_secs(30));
    /// assert_eq!(busy.retry_after, Some(Duration::from_secs(30)));
    /// ```
    pub fn with_retry_after(mut self, after: std::time::Duration) -> Self {
        self.retry_after = Some(after);
        self
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

/// The broker's answer for one enqueued message: resolves to `Ok` once the broker has acknowledged
/// the message durably, or to the error that stopped it. It must resolve on its own (the client's
/// I/O runs elsewhere): the relay awaits it later, after other work.
pub type Ack = BoxFuture<'static, Result<(), SinkError>>;

/// A destination for events, in two phases: [`enqueue`](Sink::enqueue) hands one message to the
/// client and returns at once with the future of its acknowledgement ([`Ack`]).
///
/// The relay owns everything else: it enqueues a batch in `seq` order, awaits the acks while it
/// claims the next batch, holds back an aggregate's later events after a failure, and decides
/// from each error's [`FailureKind`] whether to retry, park or back off. A sink only has to keep
/// the order it was given: messages enqueued one after another with the same key reach the broker
/// in that order.
///
/// Writing a sink means writing `enqueue`, and sorting the client's errors into the three kinds
/// ([`SinkError::new`], [`SinkError::permanent`], [`SinkError::unavailable`]). Here, a sink that
/// posts each event to an HTTP endpoint, with any client that returns a future for the response
/// (`post` stands in for it):
///
/// ```
/// use futures::future::{BoxFuture, FutureExt};
/// use seaorm_outbox_relay::sink::{Ack, Message, Sink, SinkError};
///
/// struct HttpSink { endpoint: String }
///
/// /// What an HTTP client's `post` would return: the response status, or an I/O error.
/// async fn post(url: String, key: String, body: bytes::Bytes) -> Result<u16, std::io::Error> {
///     # let _ = (url, key, body);
///     Ok(201)
/// }
///
/// impl Sink for HttpSink {
///     fn name(&self) -> &str { "http" }
///
///     fn enqueue<'a>(&'a self, message: &'a Message) -> BoxFuture<'a, Result<Ack, SinkError>> {
///         let url = format!("{}/{}", self.endpoint, message.topic);
///         let request = post(url, message.key.clone(), message.payload.clone());
///         let ack: Ack = async move {
///             match request.await {
///                 Ok(200..=299) => Ok(()),
///                 // The endpoint refuses this event: retrying cannot help, park it.
///                 Ok(status @ 400..=499) => Err(SinkError::permanent(format!("HTTP {status}"))),
///                 Ok(status) => Err(SinkError::new(format!("HTTP {status}"))),
///                 Err(e) => Err(SinkError::new(e.to_string())),
///             }
///         }
///         .boxed();
///         futures::future::ready(Ok(ack)).boxed()
///     }
/// }
///
/// # futures::executor::block_on(async {
/// let sink = HttpSink { endpoint: "http://127.0.0.1:8080/events".into() };
/// let ack = sink.enqueue(&Message::example()).await.unwrap();
/// assert!(ack.await.is_ok());
/// # });
/// ```
///
/// (Posting one request per event does not keep an aggregate's order unless the endpoint handles
/// requests in order; a real HTTP sink would send one aggregate's events one at a time.)
pub trait Sink: Send + Sync {
    /// A short name for logs, such as `kafka`.
    fn name(&self) -> &str;

    /// Hands `message` to the client and returns once it is queued, with the future of its
    /// acknowledgement. May wait while the client's queue is full. An error means the message
    /// was not queued: the relay sends none of its aggregate's later messages in this batch.
    /// [`FailureKind::Unavailable`] stops the whole batch: nothing more is enqueued, and the rows
    /// are left as they were while the relay backs off.
    ///
    /// A row is marked published only when its [`Ack`] resolved to `Ok`.
    fn enqueue<'a>(&'a self, message: &'a Message) -> BoxFuture<'a, Result<Ack, SinkError>>;

    /// Whether the sink can reach its broker now, for `/readyz`. The default says yes.
    fn ready(&self) -> BoxFuture<'_, Result<(), SinkError>> {
        Box::pin(futures::future::ready(Ok(())))
    }

    /// Drops what the client still queues and has not sent, answering it with an error. The relay
    /// calls it when it lost its source (the database) with events in flight, which it will send
    /// again once reconnected: a purged message is not delivered late, after its own re-sent copy
    /// and what follows. The default does nothing (a sink without a local queue has nothing to
    /// drop).
    fn purge(&self) {}

    /// Whether the sink needs a moment with nothing in flight. The relay then reads every answer
    /// it waits for, settles them, and calls [`quiet`](Self::quiet) before it sends anything more.
    /// The Kafka sink asks for it to replace a stuck producer: a later message handed to a new
    /// producer while the old one still holds an earlier one of its key could overtake it (the
    /// relay hands a whole batch over at once). The default never asks.
    fn wants_quiet(&self) -> bool {
        false
    }

    /// Called with nothing in flight, once [`wants_quiet`](Self::wants_quiet) asked for it.
    fn quiet(&self) -> BoxFuture<'_, ()> {
        Box::pin(futures::future::ready(()))
    }

    /// The header prefix of CloudEvents' binary mode in this sink's protocol binding (see
    /// [`crate::cloudevents`]): `ce_` (Kafka's binding, the default), `ce-` (HTTP's and NATS').
    fn cloudevents_prefix(&self) -> &str {
        "ce_"
    }
}

/// A boxed or shared sink is a sink: the relay takes ownership of one, while a test or an
/// embedding application keeps an `Arc` of it to look inside.
macro_rules! forward_sink {
    ($pointer:ident) => {
        impl<S: Sink + ?Sized> Sink for $pointer<S> {
            fn name(&self) -> &str {
                (**self).name()
            }

            fn enqueue<'a>(
                &'a self,
                message: &'a Message,
            ) -> BoxFuture<'a, Result<Ack, SinkError>> {
                (**self).enqueue(message)
            }

            fn ready(&self) -> BoxFuture<'_, Result<(), SinkError>> {
                (**self).ready()
            }

            fn purge(&self) {
                (**self).purge();
            }

            fn wants_quiet(&self) -> bool {
                (**self).wants_quiet()
            }

            fn quiet(&self) -> BoxFuture<'_, ()> {
                (**self).quiet()
            }

            fn cloudevents_prefix(&self) -> &str {
                (**self).cloudevents_prefix()
            }
        }
    };
}

forward_sink!(Box);
forward_sink!(Arc);

/// Sends `batch` through `sink` in order and awaits every ack: one result per message. A helper
/// for tests and tools that use a sink without the relay; it applies none of the relay's ordering
/// rules (a message after a failed one of its key is still sent).
///
/// ```
/// # use seaorm_outbox_relay::sink::{Message, memory::MemorySink, send_all};
/// # futures::executor::block_on(async {
/// let sink = MemorySink::default();
/// let results = send_all(&sink, &[Message::example(), Message::example()]).await;
/// assert!(results.iter().all(Result::is_ok));
/// # });
/// ```
pub async fn send_all(sink: &dyn Sink, batch: &[Message]) -> Vec<Result<(), SinkError>> {
    let mut acks = Vec::with_capacity(batch.len());
    for message in batch {
        acks.push(sink.enqueue(message).await);
    }
    let mut results = Vec::with_capacity(acks.len());
    for ack in acks {
        results.push(match ack {
            Ok(ack) => ack.await,
            Err(e) => Err(e),
        });
    }
    results
}

/// The configuration of a built-in sink. The command line builds it from flags, the environment
/// and the `[sink]` table of the config file; an embedding program builds it in code.
///
/// ```
/// use seaorm_outbox_relay::sink::{SinkConfig, kafka::KafkaConfig};
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
    /// NATS JetStream, through `async-nats`.
    #[cfg(feature = "nats")]
    Nats(nats::NatsConfig),
    /// RabbitMQ, through `lapin`, with publisher confirms.
    #[cfg(feature = "rabbitmq")]
    RabbitMq(rabbitmq::RabbitMqConfig),
    /// HTTP webhooks, through `reqwest`, signed as Standard Webhooks.
    #[cfg(feature = "webhook")]
    Webhook(webhook::WebhookConfig),
    /// Amazon SQS, through `aws-sdk-sqs`.
    #[cfg(feature = "sqs")]
    Sqs(sqs::SqsConfig),
    /// Amazon SNS, through `aws-sdk-sns`.
    #[cfg(feature = "sns")]
    Sns(sns::SnsConfig),
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
            #[cfg(feature = "nats")]
            SinkConfig::Nats(config) => Ok(Box::new(nats::NatsSink::new(config)?)),
            #[cfg(feature = "rabbitmq")]
            SinkConfig::RabbitMq(config) => Ok(Box::new(rabbitmq::RabbitMqSink::new(config))),
            #[cfg(feature = "webhook")]
            SinkConfig::Webhook(config) => Ok(Box::new(webhook::WebhookSink::new(config)?)),
            #[cfg(feature = "sqs")]
            SinkConfig::Sqs(config) => Ok(Box::new(sqs::SqsSink::new(config))),
            #[cfg(feature = "sns")]
            SinkConfig::Sns(config) => Ok(Box::new(sns::SnsSink::new(config))),
            SinkConfig::Stdout => Ok(Box::new(stdout::StdoutSink)),
        }
    }
}
