//! The Kafka sink, through rdkafka (librdkafka).
//!
//! The producer is idempotent with `acks=all`, so a message the broker acked is durable and a
//! retried send is not duplicated by the producer itself. librdkafka settings pass through.

use super::{HELD_BACK, Message, Sink, SinkError};
use futures::future::BoxFuture;
use rdkafka::config::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

/// The `[sink]` table for Kafka.
///
/// ```toml
/// [sink]
/// type = "kafka"
/// brokers = "127.0.0.1:9092"
/// options = { "linger.ms" = "1", "compression.type" = "lz4" }
/// ```
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct KafkaConfig {
    /// `bootstrap.servers`: comma-separated `host:port` list.
    pub brokers: String,
    /// librdkafka producer settings, applied over the relay's defaults.
    #[serde(default)]
    pub options: BTreeMap<String, String>,
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
    /// # use outbox_relay::sink::kafka::KafkaConfig;
    /// let settings = KafkaConfig::new("127.0.0.1:9092").producer_settings();
    /// assert_eq!(settings["enable.idempotence"], "true");
    /// assert_eq!(settings["acks"], "all");
    /// ```
    pub fn producer_settings(&self) -> BTreeMap<String, String> {
        let mut settings: BTreeMap<String, String> = [
            ("bootstrap.servers", self.brokers.as_str()),
            ("enable.idempotence", "true"),
            ("acks", "all"),
            // librdkafka's default of 5 minutes would stall a batch that long when the broker is
            // away; failed sends are retried by the relay instead.
            ("message.timeout.ms", "30000"),
            // The relay enqueues a whole batch at once and waits for its acks: lingering for more
            // messages only adds latency.
            ("linger.ms", "1"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        settings.extend(self.options.clone());
        settings
    }
}

/// Publishes to Kafka: key = aggregate id, value = payload, headers as in [`Message`].
///
/// A producer can get stuck: after a broker stall, an idempotent librdkafka producer has been seen
/// timing out every message while new producers on the same broker deliver at once, and a fatal
/// idempotence error leaves it unusable for good. So after [`STUCK_AFTER`] batches in a row in
/// which nothing was delivered, or on a fatal error, the sink replaces its producer.
pub struct KafkaSink {
    client: ClientConfig,
    producer: RwLock<Arc<FutureProducer>>,
    failed_batches: AtomicU32,
}

/// Whole batches failing in a row before the producer is replaced.
pub const STUCK_AFTER: u32 = 2;

impl std::fmt::Debug for KafkaSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaSink").finish_non_exhaustive()
    }
}

impl KafkaSink {
    /// Creates the producer. It connects lazily: an unreachable broker shows up as failed sends.
    pub fn new(config: &KafkaConfig) -> Result<Self, SinkError> {
        let mut client = ClientConfig::new();
        for (key, value) in config.producer_settings() {
            client.set(key, value);
        }
        let producer = create(&client)?;
        Ok(KafkaSink {
            client,
            producer: RwLock::new(Arc::new(producer)),
            failed_batches: AtomicU32::new(0),
        })
    }

    /// The current producer, for metrics or a flush at exit.
    pub fn producer(&self) -> Arc<FutureProducer> {
        self.producer.read().expect("producer lock").clone()
    }

    /// Counts a batch in which nothing was delivered (or resets the count), and replaces the
    /// producer once it looks stuck.
    fn after_batch(&self, producer: &FutureProducer, results: &[Result<(), SinkError>]) {
        use rdkafka::producer::Producer;
        // Permanent failures say something about the messages, not the producer.
        let nothing_delivered =
            !results.is_empty() && results.iter().all(|r| matches!(r, Err(e) if !e.permanent));
        let failed = if nothing_delivered {
            self.failed_batches.fetch_add(1, Ordering::Relaxed) + 1
        } else {
            self.failed_batches.store(0, Ordering::Relaxed);
            0
        };
        let fatal = producer.client().fatal_error();
        if failed < STUCK_AFTER && fatal.is_none() {
            return;
        }
        let fresh = match create(&self.client) {
            Ok(fresh) => fresh,
            Err(e) => return tracing::warn!(error = %e, "could not create a new kafka producer"),
        };
        tracing::warn!(failed_batches = failed, fatal = ?fatal, "replacing the kafka producer");
        let old = std::mem::replace(
            &mut *self.producer.write().expect("producer lock"),
            Arc::new(fresh),
        );
        self.failed_batches.store(0, Ordering::Relaxed);
        // Dropping a producer purges and flushes it, which may block briefly.
        tokio::task::spawn_blocking(move || drop(old));
    }
}

impl Sink for KafkaSink {
    fn name(&self) -> &str {
        "kafka"
    }

    fn ready(&self) -> BoxFuture<'_, Result<(), SinkError>> {
        // librdkafka's metadata call blocks: keep it off the runtime's worker threads.
        Box::pin(async move { tokio::task::block_in_place(|| self.fetch_metadata()) })
    }

    fn publish<'a>(&'a self, batch: &'a [Message]) -> BoxFuture<'a, Vec<Result<(), SinkError>>> {
        Box::pin(async move {
            let producer = self.producer();
            // Enqueue the whole batch first, then await the acks: one round of broker latency per
            // batch, not per message. Enqueue order is delivery order within a partition.
            // A message refused at enqueue (too large, say) stops its key's later messages, so
            // they cannot reach the broker ahead of it.
            let mut pending = Vec::with_capacity(batch.len());
            let mut refused_keys = std::collections::HashSet::new();
            for message in batch {
                if refused_keys.contains(message.key.as_str()) {
                    pending.push(Err(SinkError::new(HELD_BACK)));
                    continue;
                }
                let delivery = enqueue(&producer, message).await;
                if delivery.is_err() {
                    refused_keys.insert(message.key.as_str());
                }
                pending.push(delivery);
            }
            let mut results = Vec::with_capacity(batch.len());
            for delivery in pending {
                results.push(match delivery {
                    Ok(future) => match future.await {
                        Ok(Ok(_)) => Ok(()),
                        Ok(Err((e, _))) => Err(classify(&e)),
                        Err(_) => Err(SinkError::new("kafka producer dropped the message")),
                    },
                    Err(e) => Err(e),
                });
            }
            self.after_batch(&producer, &results);
            results
        })
    }
}

impl KafkaSink {
    /// Fetches the cluster's metadata: the broker answers.
    fn fetch_metadata(&self) -> Result<(), SinkError> {
        use rdkafka::producer::Producer;
        self.producer()
            .client()
            .fetch_metadata(None, Duration::from_secs(3))
            .map(drop)
            .map_err(|e| SinkError::new(format!("broker unreachable: {e}")))
    }
}

/// Hands `message` to the producer, waiting while its local queue is full.
async fn enqueue(
    producer: &FutureProducer,
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
        .payload(&message.payload)
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

/// A producer with the sink's settings.
fn create(client: &ClientConfig) -> Result<FutureProducer, SinkError> {
    client
        .create()
        .map_err(|e| SinkError::new(format!("kafka producer configuration: {e}")))
}

/// Errors no retry can fix: the message, its topic or the relay's rights must change first.
fn classify(error: &KafkaError) -> SinkError {
    use RDKafkaErrorCode as Code;
    let permanent = matches!(
        error.rdkafka_error_code(),
        Some(
            Code::MessageSizeTooLarge
                | Code::InvalidMessageSize
                | Code::InvalidMessage
                | Code::InvalidRecord
                | Code::MessageBatchTooLarge
                | Code::UnknownTopic
                | Code::UnknownTopicOrPartition
                | Code::InvalidTopic
                | Code::TopicAuthorizationFailed
                | Code::ClusterAuthorizationFailed
        )
    );
    let message = error.to_string();
    if permanent {
        SinkError::permanent(message)
    } else {
        SinkError::new(message)
    }
}
