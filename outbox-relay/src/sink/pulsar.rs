//! The Pulsar sink, through the `pulsar` crate.
//!
//! One producer per topic, created on first use. Each message carries the aggregate id as both
//! partition key (same partition of a partitioned topic) and ordering key (same consumer of a
//! `Key_Shared` subscription), the contract headers as properties, and the payload JSON as value.
//! A row is marked published only after the broker's send receipt.
//!
//! Producers get the broker's generated names, not stable ones: the `pulsar` crate numbers each
//! producer's messages from 0 and offers no way to set a message's `sequence_id`, so a stable
//! name on a deduplicating namespace would make the broker drop every message of a restarted
//! relay as a replay. Broker-side deduplication still drops the crate's own resends after a
//! reconnect; a resend after a relay crash is a duplicate that consumers' inbox absorbs
//! (`docs/design.md`, "Pulsar").

use super::{Ack, Message, Sink, SinkError};
use futures::future::{BoxFuture, FutureExt};
use pulsar::error::{ConnectionError, ProducerError, ServiceDiscoveryError};
use pulsar::message::proto::ServerError;
use pulsar::{ConnectionRetryOptions, Producer, ProducerOptions, Pulsar, TokioExecutor, producer};
use seaorm_outbox::pulsar_client::PulsarConnection;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Mutex;

/// The Pulsar sink's settings.
///
/// ```
/// use seaorm_outbox::{Secret, pulsar_client::PulsarAuth};
/// use seaorm_outbox_relay::sink::pulsar::PulsarConfig;
///
/// let mut config = PulsarConfig::new("pulsar+ssl://relay:s3cret@pulsar.example.com:6651");
/// config.connection.auth = Some(PulsarAuth::Token(Secret::new("eyJhbGciOi...")));
/// config.connection.tls_ca_file = Some("/etc/ssl/pulsar-ca.pem".into());
/// assert_eq!(config.tenant, "public");
/// let printed = format!("{config:?}");
/// assert!(!printed.contains("eyJhbGciOi") && !printed.contains("s3cret"), "{printed}");
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct PulsarConfig {
    /// The service URL (`pulsar://host:port` or `pulsar+ssl://host:port`), authentication and TLS.
    pub connection: PulsarConnection,
    /// The tenant of the relay's topics.
    pub tenant: String,
    /// The namespace of the relay's topics.
    pub namespace: String,
    /// The largest payload sent; a larger one is parked as permanent failure instead of being
    /// resent forever. Pulsar's default `maxMessageSize` is 5 MiB.
    pub max_message_bytes: usize,
}

fn default_tenant() -> String {
    "public".into()
}

fn default_namespace() -> String {
    "default".into()
}

fn default_max_message_bytes() -> usize {
    5 * 1024 * 1024 - 16 * 1024 // room for the message's metadata
}

impl PulsarConfig {
    /// A configuration for the service at `url`, in `public/default`.
    pub fn new(url: impl Into<String>) -> Self {
        PulsarConfig {
            connection: PulsarConnection::new(url),
            tenant: default_tenant(),
            namespace: default_namespace(),
            max_message_bytes: default_max_message_bytes(),
        }
    }

    /// The settings of the sink's producers: no client-side batching (the relay already sends a
    /// whole batch before it awaits the receipts), and a full send queue waits, as Kafka's does,
    /// rather than failing the message.
    pub fn producer_options(&self) -> ProducerOptions {
        ProducerOptions {
            block_queue_if_full: true,
            ..ProducerOptions::default()
        }
    }

    /// The Pulsar topic for a routed topic name: `persistent://tenant/namespace/name`, unless the
    /// route already names a full Pulsar topic.
    ///
    /// ```
    /// # use seaorm_outbox_relay::sink::pulsar::PulsarConfig;
    /// let config = PulsarConfig::new("pulsar://127.0.0.1:6650");
    /// assert_eq!(config.topic("outbox.event.order"), "persistent://public/default/outbox.event.order");
    /// assert_eq!(config.topic("persistent://shop/events/orders"), "persistent://shop/events/orders");
    /// ```
    pub fn topic(&self, routed: &str) -> String {
        if routed.starts_with("persistent://") || routed.starts_with("non-persistent://") {
            routed.to_owned()
        } else {
            format!("persistent://{}/{}/{routed}", self.tenant, self.namespace)
        }
    }
}

/// Publishes to Pulsar: key and ordering key = aggregate id, properties = headers.
pub struct PulsarSink {
    config: PulsarConfig,
    /// The client and one producer per topic, created on first use. Sends take `&mut` producers,
    /// one message at a time, which keeps each key's messages in the order they were enqueued.
    state: Mutex<Connected>,
    /// Topics whose producer was closed or fenced: replaced at the next send to the topic. Acks
    /// report them, after the state's lock was released.
    closed: Arc<std::sync::Mutex<HashSet<String>>>,
}

#[derive(Default)]
struct Connected {
    client: Option<Pulsar<TokioExecutor>>,
    producers: HashMap<String, Producer<TokioExecutor>>,
}

impl std::fmt::Debug for PulsarSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PulsarSink")
            .field(
                "url",
                &crate::redact::redact_url(&self.config.connection.url),
            )
            .finish_non_exhaustive()
    }
}

impl PulsarSink {
    /// Creates the sink. It connects lazily: an unreachable broker shows up as failed sends.
    pub fn new(config: &PulsarConfig) -> Result<Self, SinkError> {
        let url = &config.connection.url;
        if !url.starts_with("pulsar://") && !url.starts_with("pulsar+ssl://") {
            return Err(SinkError::permanent(format!(
                "pulsar url must start with pulsar:// or pulsar+ssl://, got {}",
                crate::redact::redact_url(url)
            )));
        }
        Ok(PulsarSink {
            config: config.clone(),
            state: Mutex::new(Connected::default()),
            closed: Arc::default(),
        })
    }
}

impl Connected {
    async fn client(
        &mut self,
        connection: &PulsarConnection,
    ) -> Result<&Pulsar<TokioExecutor>, SinkError> {
        if self.client.is_none() {
            // The crate's default retries a refused connection 12 times, backing off up to 30 s:
            // minutes in which the relay could neither publish nor shut down. Fail fast instead;
            // the relay retries the batch with its own backoff.
            let retry = ConnectionRetryOptions {
                max_retries: 3,
                max_backoff: Duration::from_secs(1),
                connection_timeout: Duration::from_secs(5),
                ..ConnectionRetryOptions::default()
            };
            let client = connection
                .connect(Some(retry))
                .await
                .map_err(|e| classify(&e))?;
            self.client = Some(client);
        }
        Ok(self.client.as_ref().expect("just set"))
    }

    async fn producer(
        &mut self,
        config: &PulsarConfig,
        topic: &str,
    ) -> Result<&mut Producer<TokioExecutor>, SinkError> {
        if !self.producers.contains_key(topic) {
            let producer = self
                .client(&config.connection)
                .await?
                .producer()
                .with_topic(topic)
                .with_options(config.producer_options())
                .build()
                .await
                .map_err(|e| classify(&e))?;
            self.producers.insert(topic.to_owned(), producer);
        }
        Ok(self.producers.get_mut(topic).expect("just inserted"))
    }
}

impl Sink for PulsarSink {
    fn name(&self) -> &str {
        "pulsar"
    }

    fn ready(&self) -> BoxFuture<'_, Result<(), SinkError>> {
        Box::pin(async move {
            let mut state = self.state.lock().await;
            let namespace = format!("{}/{}", self.config.tenant, self.config.namespace);
            let client = state.client(&self.config.connection).await?;
            let topics = client.get_topics_of_namespace(
                namespace,
                pulsar::message::proto::command_get_topics_of_namespace::Mode::All,
            );
            match tokio::time::timeout(Duration::from_secs(5), topics).await {
                Ok(Ok(_)) => Ok(()),
                Ok(Err(e)) => Err(classify(&e)),
                Err(_) => Err(SinkError::new("broker unreachable: no answer within 5 s")),
            }
        })
    }

    fn enqueue<'a>(&'a self, message: &'a Message) -> BoxFuture<'a, Result<Ack, SinkError>> {
        Box::pin(async move {
            let receipt = {
                let mut state = self.state.lock().await;
                self.send(&mut state, message).await?
            };
            let topic = self.config.topic(&message.topic);
            let closed = self.closed.clone();
            let ack = async move {
                receipt.await.map(drop).map_err(|e| {
                    if producer_gone(&e) {
                        lock(&closed).insert(topic);
                    }
                    classify(&e)
                })
            };
            Ok(ack.boxed())
        })
    }
}

impl PulsarSink {
    async fn send(
        &self,
        state: &mut Connected,
        message: &Message,
    ) -> Result<producer::SendFuture, SinkError> {
        if message.payload.len() > self.config.max_message_bytes {
            return Err(SinkError::permanent(format!(
                "message of {} bytes is larger than max_message_bytes ({})",
                message.payload.len(),
                self.config.max_message_bytes
            )));
        }
        let topic = self.config.topic(&message.topic);
        if lock(&self.closed).remove(&topic) {
            state.producers.remove(&topic);
        }
        let producer = state.producer(&self.config, &topic).await?;
        let outgoing = producer::Message {
            // The one copy on the way to the broker: the crate's message owns its payload.
            payload: message.payload.to_vec(),
            properties: message.headers.iter().cloned().collect(),
            partition_key: Some(message.key.clone()),
            ordering_key: Some(message.key.clone().into_bytes()),
            ..Default::default()
        };
        producer.send_non_blocking(outgoing).await.map_err(|e| {
            if producer_gone(&e) {
                lock(&self.closed).insert(topic);
            }
            classify(&e)
        })
    }
}

fn lock<T>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Whether the producer that returned `error` cannot send any more.
fn producer_gone(error: &pulsar::Error) -> bool {
    matches!(
        error,
        pulsar::Error::Producer(ProducerError::Closed | ProducerError::Fenced)
    )
}

/// Sorts a client error: the relay's own credentials or TLS refused (unavailable: nothing is wrong
/// with the event), the topic or the message refused (permanent: the event is parked), or
/// anything else (transient: retried).
fn classify(error: &pulsar::Error) -> SinkError {
    let server_error = match error {
        pulsar::Error::Connection(ConnectionError::PulsarError(code, _))
        | pulsar::Error::Producer(ProducerError::Connection(ConnectionError::PulsarError(
            code,
            _,
        )))
        | pulsar::Error::ServiceDiscovery(ServiceDiscoveryError::Query(code, _)) => *code,
        _ => None,
    };
    // The crate folds a connection failure it will not retry (authentication, TLS) into this one
    // I/O error, and logs the cause itself.
    let not_retried = |e: &ConnectionError| matches!(e, ConnectionError::Io(io) if io.to_string().contains("fatal error when connecting"));
    let refused = matches!(server_error, Some(ServerError::AuthenticationError))
        || matches!(
            error,
            pulsar::Error::Connection(e)
                | pulsar::Error::ServiceDiscovery(ServiceDiscoveryError::Connection(e))
                | pulsar::Error::Producer(ProducerError::Connection(e)) if not_retried(e)
        )
        || matches!(
            error,
            pulsar::Error::Connection(ConnectionError::Tls(_) | ConnectionError::Authentication(_))
                | pulsar::Error::ServiceDiscovery(ServiceDiscoveryError::Connection(
                    ConnectionError::Tls(_) | ConnectionError::Authentication(_)
                ))
                | pulsar::Error::Producer(ProducerError::Connection(
                    ConnectionError::Tls(_) | ConnectionError::Authentication(_)
                ))
        );
    let permanent = matches!(
        server_error,
        Some(
            ServerError::TopicNotFound
                | ServerError::AuthorizationError
                | ServerError::InvalidTopicName
                | ServerError::IncompatibleSchema
                | ServerError::NotAllowedError
        )
    );
    let message = format!("pulsar: {error}");
    if refused {
        SinkError::unavailable(format!(
            "broker refuses the relay (authentication or TLS; the pulsar client logs the cause): {message}"
        ))
    } else if permanent {
        SinkError::permanent(message)
    } else {
        SinkError::new(message)
    }
}
