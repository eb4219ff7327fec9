//! The Kafka sink, through rdkafka (librdkafka).
//!
//! The producer is idempotent with `acks=all`, so a message the broker acked is durable and a
//! retried send is not duplicated by the producer itself. librdkafka settings pass through, security
//! included (`security.protocol`, `sasl.*`, `ssl.*`): librdkafka is built with OpenSSL, SASL
//! (PLAIN, SCRAM) and OAUTHBEARER with OIDC.
//!
//! When the broker refuses the relay itself (authentication failed, certificate not trusted, a
//! plaintext client at a TLS listener), librdkafka reports it through its error callback, not per
//! message. The sink then answers every message [`Unavailable`](super::FailureKind::Unavailable) —
//! the rows stay untouched — purges what it had queued, and probes the broker before it enqueues
//! again, until the broker accepts it.

mod delivery;

use super::{Ack, Message, Sink, SinkError};
use crate::redact::{is_secret_key, redact_options, redact_values};
use delivery::{classify, delivery};
use futures::future::{BoxFuture, FutureExt};
use rdkafka::ClientContext;
use rdkafka::config::{ClientConfig, RDKafkaLogLevel};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::future_producer::OwnedDeliveryResult;
use rdkafka::producer::{FutureProducer, FutureRecord, Producer, PurgeConfig};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;
use tokio::sync::watch;

/// The Kafka sink's settings.
///
/// ```
/// # use seaorm_outbox_relay::sink::kafka::KafkaConfig;
/// let mut config = KafkaConfig::new("broker-1.example.com:9093");
/// config.options.insert("security.protocol".into(), "SASL_SSL".into());
/// config.options.insert("sasl.mechanism".into(), "SCRAM-SHA-512".into());
/// config.options.insert("sasl.username".into(), "relay".into());
/// config.options.insert("sasl.password".into(), "s3cret".into());
/// // Secrets never print:
/// assert!(!format!("{config:?}").contains("s3cret"));
/// ```
#[derive(Clone)]
#[non_exhaustive]
pub struct KafkaConfig {
    /// `bootstrap.servers`: comma-separated `host:port` list.
    pub brokers: String,
    /// librdkafka producer settings, applied over the relay's defaults.
    pub options: BTreeMap<String, String>,
}

impl std::fmt::Debug for KafkaConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaConfig")
            .field("brokers", &self.brokers)
            .field("options", &redact_options(&self.options))
            .finish()
    }
}

impl KafkaConfig {
    /// A configuration for `brokers` with the relay's defaults.
    pub fn new(brokers: impl Into<String>) -> Self {
        KafkaConfig {
            brokers: brokers.into(),
            options: BTreeMap::new(),
        }
    }

    /// The relay's producer settings: the contract's (idempotence, `acks=all`), then `options`.
    ///
    /// ```
    /// # use seaorm_outbox_relay::sink::kafka::KafkaConfig;
    /// let settings = KafkaConfig::new("127.0.0.1:9092").producer_settings();
    /// assert_eq!(settings["enable.idempotence"], "true");
    /// assert_eq!(settings["acks"], "all");
    /// assert_eq!(settings["partitioner"], "murmur2_random"); // as Java clients place keys
    /// ```
    pub fn producer_settings(&self) -> BTreeMap<String, String> {
        let mut settings: BTreeMap<String, String> = [
            ("bootstrap.servers", self.brokers.as_str()),
            ("enable.idempotence", "true"),
            ("acks", "all"),
            // librdkafka's default of 5 minutes would stall a batch that long when the broker is
            // away; failed sends are retried by the relay instead.
            ("message.timeout.ms", "30000"),
            // The relay enqueues a whole batch at once and awaits its acks later: lingering for
            // more messages only adds latency.
            ("linger.ms", "1"),
            // The Java client's partitioner (murmur2), not librdkafka's default (CRC32): a key
            // lands on the partition Debezium, Kafka Streams or any Java producer would choose,
            // so moving a topic between them and the relay keeps each key's order.
            ("partitioner", "murmur2_random"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        settings.extend(self.options.clone());
        settings
    }

    /// The values of the secret settings, to keep them out of client messages.
    fn secret_values(&self) -> impl Iterator<Item = &str> {
        self.options
            .iter()
            .filter(|(k, _)| is_secret_key(k))
            .map(|(_, v)| v.as_str())
    }
}

/// Publishes to Kafka: key = aggregate id, value = payload, headers as in [`Message`].
///
/// A producer can get stuck: after a broker stall, an idempotent librdkafka producer has been seen
/// timing out every message while new producers on the same broker deliver at once, and a fatal
/// idempotence error leaves it unusable for good. So after [`STUCK_AFTER`] rounds of failures with
/// nothing delivered in between, or on a fatal error, the sink asks the relay for a quiet moment
/// ([`Sink::wants_quiet`]) and replaces its producer then, with no message of the relay's in flight:
/// a new producer never delivers a later message of a key while the old one may still deliver an
/// earlier one first (what the old one delivers late is a duplicate, after its re-sent copy). A
/// round is what was enqueued before a failure was heard of: a batch the broker times out is one
/// round, however many messages it held.
pub struct KafkaSink {
    shared: Arc<Shared>,
}

/// What the sink and its pending acks share.
struct Shared {
    client: ClientConfig,
    secrets: Vec<String>,
    producer: RwLock<Arc<FutureProducer<SinkContext>>>,
    /// Messages enqueued so far, numbering each one.
    enqueued: AtomicU64,
    /// Rounds of failures since the last delivery.
    failed_rounds: AtomicU32,
    /// The enqueue number at which the current round of failures was heard of: a failed message
    /// enqueued before it belongs to that round.
    round_heard_at: AtomicU64,
    /// Why the broker refuses the relay (authentication, TLS), as librdkafka last reported it.
    refused: watch::Sender<Option<String>>,
    /// The producer looks stuck: replace it before the next message, once it holds none.
    replace_wanted: AtomicBool,
    /// Whether the broker tells each written message's offset (`acks` is not 0).
    offsets_reported: bool,
}

/// Rounds of failures, with nothing delivered in between, before the producer is replaced.
pub const STUCK_AFTER: u32 = 2;

impl std::fmt::Debug for KafkaSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaSink").finish_non_exhaustive()
    }
}

/// The producer's context: hears librdkafka's client-level errors, and notes the ones that mean
/// the broker refuses this client.
struct SinkContext {
    refused: watch::Sender<Option<String>>,
    /// Whether the client talks to the broker without TLS.
    plaintext: bool,
}

impl SinkContext {
    fn refuse(&self, reason: &str) {
        if self.refused.borrow().is_none() {
            tracing::error!(%reason, "kafka refuses the relay's connection");
        }
        self.refused.send_replace(Some(reason.to_owned()));
    }
}

impl ClientContext for SinkContext {
    fn error(&self, error: KafkaError, reason: &str) {
        let refused = matches!(
            error.rdkafka_error_code(),
            Some(
                RDKafkaErrorCode::Authentication
                    | RDKafkaErrorCode::SaslAuthenticationFailed
                    | RDKafkaErrorCode::SSL
            )
        );
        if refused {
            self.refuse(reason);
        } else {
            tracing::warn!(error = %error, "kafka client: {reason}");
        }
    }

    fn log(&self, level: RDKafkaLogLevel, facility: &str, message: &str) {
        // A plaintext client at a TLS listener shows only as a connection the broker drops while
        // asked for its API versions, in an informational log line, not as an error.
        let dropped_at_hello = facility == "FAIL"
            && message.contains("Disconnected")
            && message.contains("state APIVERSION_QUERY");
        if self.plaintext && dropped_at_hello {
            self.refuse(&format!(
                "{message}: the listener may expect TLS; check security.protocol"
            ));
        } else if facility == "FAIL" && message.contains("security.protocol") {
            self.refuse(message);
        }
        match level {
            RDKafkaLogLevel::Emerg
            | RDKafkaLogLevel::Alert
            | RDKafkaLogLevel::Critical
            | RDKafkaLogLevel::Error => {
                tracing::error!(target: "librdkafka", "{facility} {message}")
            }
            RDKafkaLogLevel::Warning => {
                tracing::warn!(target: "librdkafka", "{facility} {message}")
            }
            RDKafkaLogLevel::Notice | RDKafkaLogLevel::Info => {
                tracing::info!(target: "librdkafka", "{facility} {message}");
            }
            RDKafkaLogLevel::Debug => tracing::debug!(target: "librdkafka", "{facility} {message}"),
        }
    }
}

impl KafkaSink {
    /// Creates the producer. It connects lazily: an unreachable broker shows up as failed sends.
    pub fn new(config: &KafkaConfig) -> Result<Self, SinkError> {
        let mut client = ClientConfig::new();
        for (key, value) in config.producer_settings() {
            client.set(key, value);
        }
        // Informational lines too: the context reads connection failures from them.
        client.set_log_level(RDKafkaLogLevel::Info);
        let secrets: Vec<String> = config.secret_values().map(str::to_owned).collect();
        let refused = watch::Sender::new(None);
        let producer = create(&client, &secrets, &refused)?;
        let offsets_reported = client.get("acks").is_none_or(|acks| acks.trim() != "0");
        Ok(KafkaSink {
            shared: Arc::new(Shared {
                client,
                secrets,
                producer: RwLock::new(Arc::new(producer)),
                enqueued: AtomicU64::new(0),
                failed_rounds: AtomicU32::new(0),
                round_heard_at: AtomicU64::new(0),
                refused,
                replace_wanted: AtomicBool::new(false),
                offsets_reported,
            }),
        })
    }

    /// The current producer, for metrics or a flush at exit.
    pub fn producer(&self) -> Arc<FutureProducer<impl ClientContext + use<>>> {
        self.shared.current()
    }

    /// Whether the broker accepts the client now: its metadata can be read. librdkafka's call
    /// blocks, so it runs off the runtime's worker threads.
    async fn fetch_metadata(&self) -> Result<(), SinkError> {
        let producer = self.shared.current();
        let fetched = tokio::task::spawn_blocking(move || {
            producer
                .client()
                .fetch_metadata(None, Duration::from_secs(3))
                .map(drop)
        })
        .await;
        match (fetched, self.shared.refused.borrow().clone()) {
            (Ok(Ok(())), _) => Ok(()),
            (_, Some(reason)) => Err(SinkError::unavailable(format!(
                "broker refuses the relay: {reason}"
            ))),
            (Ok(Err(e)), None) => Err(SinkError::new(format!("broker unreachable: {e}"))),
            (Err(e), None) => Err(SinkError::new(format!("broker check failed: {e}"))),
        }
    }
}

impl Shared {
    fn current(&self) -> Arc<FutureProducer<SinkContext>> {
        self.producer.read().expect("producer lock").clone()
    }

    /// Notes the answer for the message enqueued as number `enqueued` on `producer`, and replaces
    /// the producer once it looks stuck.
    fn heard(
        &self,
        producer: &FutureProducer<SinkContext>,
        enqueued: u64,
        result: &Result<(), SinkError>,
    ) {
        let failed = match result {
            Ok(()) => {
                self.failed_rounds.store(0, Ordering::Relaxed);
                return;
            }
            // Permanent failures say something about the message, not the producer.
            Err(e) if e.kind != super::FailureKind::Transient => return,
            // A message enqueued after the last round was heard of fails in a new round.
            Err(_) if enqueued >= self.round_heard_at.load(Ordering::Relaxed) => {
                self.round_heard_at
                    .store(self.enqueued.load(Ordering::Relaxed), Ordering::Relaxed);
                self.failed_rounds.fetch_add(1, Ordering::Relaxed) + 1
            }
            Err(_) => self.failed_rounds.load(Ordering::Relaxed),
        };
        let fatal = producer.client().fatal_error();
        if failed < STUCK_AFTER && fatal.is_none() {
            return;
        }
        let current = self.current();
        if !std::ptr::eq(Arc::as_ptr(&current), producer) {
            return; // replaced already
        }
        if !self.replace_wanted.swap(true, Ordering::Relaxed) {
            tracing::warn!(failed_rounds = failed, fatal = ?fatal, "the kafka producer looks stuck; replacing it once nothing is in flight");
        }
    }

    /// Replaces the producer (see [`KafkaSink`]). What the old one still queues is purged: the relay
    /// has answered it already (`ack_timeout`) and sends it again.
    fn replace(&self) {
        let fresh = match create(&self.client, &self.secrets, &self.refused) {
            Ok(fresh) => fresh,
            Err(e) => return tracing::warn!(error = %e, "could not create a new kafka producer"),
        };
        tracing::warn!("replacing the kafka producer");
        let old = std::mem::replace(
            &mut *self.producer.write().expect("producer lock"),
            Arc::new(fresh),
        );
        self.failed_rounds.store(0, Ordering::Relaxed);
        self.replace_wanted.store(false, Ordering::Relaxed);
        old.purge(PurgeConfig::default().queue().inflight());
        // Dropping a producer flushes it, which may block briefly.
        tokio::task::spawn_blocking(move || drop(old));
    }

    /// The result of a delivery, noted for the stuck-producer check.
    fn answer(
        &self,
        producer: &FutureProducer<SinkContext>,
        enqueued: u64,
        delivered: Result<OwnedDeliveryResult, futures::channel::oneshot::Canceled>,
    ) -> Result<(), SinkError> {
        let result = match delivered {
            Ok(delivered) => delivery(delivered, self.offsets_reported),
            Err(_) => Err(SinkError::new("kafka producer dropped the message")),
        };
        self.heard(producer, enqueued, &result);
        result
    }
}

impl Sink for KafkaSink {
    fn name(&self) -> &str {
        "kafka"
    }

    fn ready(&self) -> BoxFuture<'_, Result<(), SinkError>> {
        Box::pin(self.fetch_metadata())
    }

    fn purge(&self) {
        // Only what is queued: a message on its way to the broker may arrive all the same.
        self.shared.current().purge(PurgeConfig::default().queue());
    }

    fn wants_quiet(&self) -> bool {
        self.shared.replace_wanted.load(Ordering::Relaxed)
    }

    fn quiet(&self) -> BoxFuture<'_, ()> {
        if self.wants_quiet() {
            self.shared.replace();
        }
        Box::pin(futures::future::ready(()))
    }

    fn enqueue<'a>(&'a self, message: &'a Message) -> BoxFuture<'a, Result<Ack, SinkError>> {
        Box::pin(async move {
            // Refused before: send nothing until the broker accepts the client again.
            if self.shared.refused.borrow().is_some() {
                self.fetch_metadata().await?;
                self.shared.refused.send_replace(None);
            }
            let producer = self.shared.current();
            let enqueued = self.shared.enqueued.fetch_add(1, Ordering::Relaxed);
            let delivery = enqueue(&producer, message).await?;
            let shared = self.shared.clone();
            let ack = async move {
                // The ack, unless the broker refuses the client meanwhile: then its queue is
                // purged rather than left to time out, and the message is left for later.
                let mut refused = shared.refused.subscribe();
                let mut delivery = delivery;
                let refusal = async { refused.wait_for(Option::is_some).await.is_ok() };
                let delivered = tokio::select! {
                    delivered = &mut delivery => Some(delivered),
                    true = refusal => None,
                };
                let delivered = match delivered {
                    Some(delivered) => delivered,
                    None => {
                        producer.purge(PurgeConfig::default().queue().inflight());
                        delivery.await
                    }
                };
                let result = shared.answer(&producer, enqueued, delivered);
                // A message that failed while the broker refused the client (purged, or refused
                // itself) is not at fault.
                let refusal = shared.refused.borrow().clone();
                match (result, refusal) {
                    (Err(e), Some(reason)) if !e.is_permanent() => Err(SinkError::unavailable(
                        format!("broker refuses the relay: {reason}"),
                    )),
                    (result, _) => result,
                }
            };
            Ok(ack.boxed())
        })
    }
}

/// Hands `message` to the producer, waiting while its local queue is full.
async fn enqueue(
    producer: &FutureProducer<SinkContext>,
    message: &Message,
) -> Result<rdkafka::producer::DeliveryFuture, SinkError> {
    let mut headers = OwnedHeaders::new_with_capacity(message.headers.len());
    for (key, value) in &message.headers {
        headers = headers.insert(Header {
            key,
            value: Some(value.as_bytes()),
        });
    }
    let mut record = FutureRecord::to(&message.topic)
        .key(message.key.as_bytes())
        .payload(&message.payload[..])
        .headers(headers);
    loop {
        match producer.send_result(record) {
            Ok(delivery) => return Ok(delivery),
            // The local queue is full: let deliveries drain, then enqueue again.
            Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), returned)) => {
                record = returned;
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            Err((e, _)) => return Err(classify(&e)),
        }
    }
}

/// A producer with the sink's settings. librdkafka quotes a bad setting's value in its error:
/// secrets are masked in it.
fn create(
    client: &ClientConfig,
    secrets: &[String],
    refused: &watch::Sender<Option<String>>,
) -> Result<FutureProducer<SinkContext>, SinkError> {
    let protocol = client.get("security.protocol").unwrap_or("plaintext");
    let context = SinkContext {
        refused: refused.clone(),
        plaintext: protocol.eq_ignore_ascii_case("plaintext")
            || protocol.eq_ignore_ascii_case("sasl_plaintext"),
    };
    client.create_with_context(context).map_err(|e| {
        let message = redact_values(&e.to_string(), secrets.iter().map(String::as_str));
        SinkError::permanent(format!("kafka producer configuration: {message}"))
    })
}
