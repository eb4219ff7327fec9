//! The RabbitMQ sink, through `lapin` (AMQP 0-9-1) with publisher confirms.
//!
//! Each event is published to one exchange (`RabbitMqConfig::exchange`; the default exchange
//! routes by queue name) with its routed topic as the routing key, `mandatory`, persistent
//! (delivery mode 2), `message_id` = the event id, `type` = the event type, `content_type` =
//! `application/json`, and the contract's headers plus the aggregate id as header `aggregate_id`
//! (AMQP has no message key). A row is marked published only after the broker's publisher confirm
//! (the message is in every queue it was routed to, on disk for durable queues).
//!
//! What the broker says:
//! - confirmed, and no queue took it (returned `NO_ROUTE`): parked: binding a queue is an
//!   operator's fix, as a missing Kafka topic is;
//! - not confirmed (`nack`), no confirm in time, or the channel lost: retried;
//! - the connection refused (credentials, certificate, server away) or the exchange missing: the
//!   relay's settings are wrong, not the event: rows untouched, `/readyz` says why.
//!
//! Order: one channel carries every message in the order the relay enqueued them, and a queue
//! keeps what one channel routed to it in that order; a consumer keeps each aggregate's order by
//! being the queue's only active consumer (`x-single-active-consumer`) or by a consistent-hash
//! exchange on the `aggregate_id` header, one consumer per queue (`docs/design.md`, "RabbitMQ").

use super::{Ack, Message, Sink, SinkError};
use futures::future::{BoxFuture, FutureExt};
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions};
use lapin::tcp::OwnedTLSConfig;
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties};
use seaorm_outbox::Secret;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

/// The RabbitMQ sink's settings.
///
/// ```
/// use seaorm_outbox_relay::sink::rabbitmq::RabbitMqConfig;
///
/// let mut config = RabbitMqConfig::new("amqps://relay:s3cret@rabbit.example.com:5671/%2f");
/// config.exchange = "shop.events".into();
/// config.tls_ca_file = Some("/etc/ssl/rabbit-ca.pem".into());
/// let printed = format!("{config:?}");
/// assert!(!printed.contains("s3cret"), "{printed}");
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct RabbitMqConfig {
    /// `amqp://user:password@host:5672/vhost` or `amqps://…` (the vhost URL-encoded: `%2f` is
    /// `/`).
    pub url: Secret,
    /// The exchange every event is published to, with its topic as the routing key. It must
    /// exist (the relay declares nothing); the default, `""`, is the broker's default exchange,
    /// which routes to the queue named by the routing key.
    pub exchange: String,
    /// PEM file of the certificate authorities trusted for the broker's certificate (`amqps`);
    /// without it, the system's.
    pub tls_ca_file: Option<PathBuf>,
    /// How long a publish waits for the broker's confirm before it is retried.
    pub ack_timeout: Duration,
}

impl RabbitMqConfig {
    /// A configuration for the broker at `url`, publishing to the default exchange.
    pub fn new(url: impl Into<String>) -> Self {
        RabbitMqConfig {
            url: Secret::new(url),
            exchange: String::new(),
            tls_ca_file: None,
            ack_timeout: Duration::from_secs(30),
        }
    }
}

/// Publishes to RabbitMQ (see the module's documentation).
pub struct RabbitMqSink {
    config: RabbitMqConfig,
    /// The connection and its confirming channel, opened on first use and again after either
    /// closed; a channel is cheap to clone.
    open: tokio::sync::Mutex<Option<(Connection, Channel)>>,
    /// The channel in use, taken without waiting on the lock above while it is open.
    channel: Mutex<Option<Channel>>,
}

impl RabbitMqSink {
    /// A sink for `config`; it connects when it first publishes.
    pub fn new(config: &RabbitMqConfig) -> Self {
        RabbitMqSink {
            config: config.clone(),
            open: tokio::sync::Mutex::new(None),
            channel: Mutex::new(None),
        }
    }

    /// The open channel, opening the connection and a channel if none is open.
    async fn channel(&self) -> Result<Channel, SinkError> {
        if let Some(channel) = self.current() {
            return Ok(channel);
        }
        let mut open = self.open.lock().await;
        if let Some((connection, channel)) = open.as_ref()
            && connection.status().connected()
            && channel.status().connected()
        {
            return Ok(channel.clone());
        }
        if let Some((connection, _)) = open.take() {
            // A channel the broker closed (or a connection lost): start afresh.
            let _ = connection.close(200, "reopening".into()).await;
        }
        let (connection, channel) = self.connect().await?;
        *self.channel.lock().unwrap_or_else(|e| e.into_inner()) = Some(channel.clone());
        *open = Some((connection, channel.clone()));
        Ok(channel)
    }

    fn current(&self) -> Option<Channel> {
        let channel = self.channel.lock().unwrap_or_else(|e| e.into_inner());
        channel.as_ref().filter(|c| c.status().connected()).cloned()
    }

    async fn connect(&self) -> Result<(Connection, Channel), SinkError> {
        let uri: lapin::uri::AMQPUri = self.config.url.expose().parse().map_err(|e| {
            SinkError::unavailable(format!(
                "bad RabbitMQ URL {}: {e}",
                crate::redact::redact_url(self.config.url.expose())
            ))
        })?;
        let tls = OwnedTLSConfig {
            identity: None,
            cert_chain: match &self.config.tls_ca_file {
                Some(path) => Some(std::fs::read_to_string(path).map_err(|e| {
                    SinkError::unavailable(format!("RabbitMQ CA file {}: {e}", path.display()))
                })?),
                None => None,
            },
        };
        let runtime = lapin::runtime::default_runtime().map_err(|e| unavailable(&e))?;
        let properties =
            ConnectionProperties::default().with_connection_name(LongString::from("outbox-relay"));
        let connection = tokio::time::timeout(
            CONNECT_TIMEOUT,
            Connection::connect_uri_with_config(uri, properties, tls, runtime),
        )
        .await
        .map_err(|_| {
            SinkError::unavailable(format!(
                "cannot connect to RabbitMQ: no answer within {CONNECT_TIMEOUT:?}"
            ))
        })?
        .map_err(|e| unavailable(&e))?;
        let channel = connection
            .create_channel()
            .await
            .map_err(|e| unavailable(&e))?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|e| unavailable(&e))?;
        if !self.config.exchange.is_empty() {
            // Passive: the exchange must exist; the relay creates nothing on the broker.
            let passive = ExchangeDeclareOptions {
                passive: true,
                ..ExchangeDeclareOptions::default()
            };
            channel
                .exchange_declare(
                    self.config.exchange.as_str().into(),
                    lapin::ExchangeKind::Direct,
                    passive,
                    FieldTable::default(),
                )
                .await
                .map_err(|e| {
                    SinkError::unavailable(format!(
                        "RabbitMQ exchange `{}`: {e}",
                        self.config.exchange
                    ))
                })?;
        }
        Ok((connection, channel))
    }
}

/// How long connecting (TCP, TLS, login) may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// A failed connection is never the event's fault (a refused login or certificate, a server
/// away; the client's message says which): the rows stay untouched and `/readyz` says so.
fn unavailable(e: &lapin::Error) -> SinkError {
    SinkError::unavailable(format!("cannot connect to RabbitMQ: {e}"))
}

/// The AMQP properties of `message`.
fn properties(message: &Message) -> BasicProperties {
    let mut headers = FieldTable::default();
    // The content type is a property of its own.
    for (name, value) in message.headers.iter().filter(|(n, _)| n != "content-type") {
        headers.insert(
            name.as_str().into(),
            AMQPValue::LongString(LongString::from(value.as_str())),
        );
    }
    headers.insert(
        "aggregate_id".into(),
        AMQPValue::LongString(LongString::from(message.key.as_str())),
    );
    let mut properties = BasicProperties::default()
        .with_message_id(message.event_id.to_string().into())
        .with_delivery_mode(2)
        .with_headers(headers);
    properties = match message.header("content-type") {
        // CloudEvents name the content type themselves.
        Some(content_type) => properties.with_content_type(content_type.into()),
        None => properties.with_content_type("application/json".into()),
    };
    if let Some(event_type) = message.header("event_type") {
        properties = properties.with_type(event_type.into());
    }
    properties
}

impl Sink for RabbitMqSink {
    fn name(&self) -> &str {
        "rabbitmq"
    }

    fn enqueue<'a>(&'a self, message: &'a Message) -> BoxFuture<'a, Result<Ack, SinkError>> {
        async move {
            let channel = self.channel().await?;
            let routing_key = message.topic.clone();
            let confirm = channel
                .basic_publish(
                    self.config.exchange.as_str().into(),
                    routing_key.as_str().into(),
                    BasicPublishOptions {
                        mandatory: true,
                        ..BasicPublishOptions::default()
                    },
                    &message.payload,
                    properties(message),
                )
                .await
                .map_err(|e| SinkError::new(format!("RabbitMQ publish: {e}")))?;
            let exchange = self.config.exchange.clone();
            let ack_timeout = self.config.ack_timeout;
            let ack: Ack = async move {
                let answer = tokio::time::timeout(ack_timeout, confirm)
                    .await
                    .map_err(|_| {
                        SinkError::new(format!("no publisher confirm within {ack_timeout:?}"))
                    })?
                    .map_err(|e| SinkError::new(format!("RabbitMQ publish: {e}")))?;
                match answer {
                    Confirmation::Ack(None) => Ok(()),
                    Confirmation::Ack(Some(returned)) => Err(SinkError::permanent(format!(
                        "no queue takes routing key `{routing_key}` on exchange `{exchange}` \
                         (returned: {} {})",
                        returned.reply_code, returned.reply_text
                    ))),
                    Confirmation::Nack(_) => Err(SinkError::new(
                        "the broker did not take the message (nack)".to_owned(),
                    )),
                    Confirmation::NotRequested => Err(SinkError::new(
                        "the channel does not confirm publishes".to_owned(),
                    )),
                }
            }
            .boxed();
            Ok(ack)
        }
        .boxed()
    }

    fn ready(&self) -> BoxFuture<'_, Result<(), SinkError>> {
        async move { self.channel().await.map(|_| ()) }.boxed()
    }

    /// The AMQP protocol binding's prefix for CloudEvents' application properties.
    fn cloudevents_prefix(&self) -> &str {
        "cloudEvents_"
    }
}
