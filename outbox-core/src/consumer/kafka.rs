//! The Kafka consumer loop (rdkafka).
//!
//! The consumer group is the consumer's name. Offsets are stored only after the inbox transaction
//! committed (`enable.auto.offset.store=false`) and committed by librdkafka in the background and
//! once more at shutdown, so a crash redelivers at most the messages since the last commit, and
//! the inbox skips those already applied.

use super::{Consumed, ConsumerError, ConsumerOptions, HandlerError, Processor, Verdict};
use crate::{Envelope, EnvelopeError};
use futures_core::future::BoxFuture;
use rdkafka::Message;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{BorrowedMessage, Header, Headers, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use sea_orm::{DatabaseConnection, DatabaseTransaction};
use std::future::Future;
use std::time::Duration;
use tokio::sync::watch;

impl Envelope {
    /// The envelope of a message received from Kafka.
    pub fn from_kafka(message: &impl Message) -> Result<Envelope, EnvelopeError> {
        let headers = message.headers();
        let headers = headers
            .iter()
            .flat_map(|h| h.iter())
            .map(|h| (h.key, h.value.unwrap_or_default()));
        Envelope::from_parts(
            message.key(),
            headers,
            message.payload().unwrap_or_default(),
        )
    }
}

/// Consumes outbox events from Kafka topics into the inbox. See [the module](super).
///
/// ```no_run
/// # async fn f(db: seaorm_outbox::sea_orm::DatabaseConnection) -> Result<(), seaorm_outbox::consumer::ConsumerError> {
/// use seaorm_outbox::consumer::{kafka::KafkaConsumer, ConsumerOptions};
///
/// let consumer = KafkaConsumer::new("127.0.0.1:9092", &["outbox.event.order"], ConsumerOptions::new("billing"))?;
/// let consumed = consumer
///     .run(&db, |envelope, _txn| Box::pin(async move {
///         println!("{} {}", envelope.event_type, envelope.aggregate_id);
///         Ok(())
///     }), std::future::pending())
///     .await?;
/// # Ok(()) }
/// ```
pub struct KafkaConsumer {
    consumer: StreamConsumer,
    /// For dead letters; created with the consumer, connects on first use.
    producer: FutureProducer,
    options: ConsumerOptions,
    progress: watch::Sender<Consumed>,
}

impl std::fmt::Debug for KafkaConsumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaConsumer")
            .field("name", &self.options.name)
            .finish_non_exhaustive()
    }
}

impl KafkaConsumer {
    /// Subscribes group `options.name()` to `topics` on `brokers`, reading a new group's topics
    /// from the beginning.
    pub fn new(
        brokers: &str,
        topics: &[&str],
        options: ConsumerOptions,
    ) -> Result<Self, ConsumerError> {
        let mut config = ClientConfig::new();
        config.set("bootstrap.servers", brokers);
        Self::with_config(config, topics, options)
    }

    /// Like [`new`](Self::new), with your librdkafka settings (`bootstrap.servers`, security,
    /// ...). The loop sets `group.id` and the offset settings it relies on. A new group reads its
    /// topics from the beginning unless `config` sets `auto.offset.reset` itself.
    ///
    /// ```no_run
    /// # fn f() -> Result<(), seaorm_outbox::consumer::ConsumerError> {
    /// use seaorm_outbox::consumer::{kafka::KafkaConsumer, ConsumerOptions};
    /// use rdkafka::ClientConfig;
    ///
    /// let mut config = ClientConfig::new();
    /// config
    ///     .set("bootstrap.servers", "broker.example.com:9093")
    ///     .set("security.protocol", "SASL_SSL")
    ///     .set("sasl.mechanisms", "SCRAM-SHA-512")
    ///     .set("sasl.username", "billing")
    ///     .set("sasl.password", std::env::var("KAFKA_PASSWORD").unwrap_or_default());
    /// let consumer = KafkaConsumer::with_config(config, &["outbox.event.order"], ConsumerOptions::new("billing"))?;
    /// # Ok(()) }
    /// ```
    pub fn with_config(
        mut config: ClientConfig,
        topics: &[&str],
        options: ConsumerOptions,
    ) -> Result<Self, ConsumerError> {
        // librdkafka's own default, `latest`, would have a new group (or one whose offsets
        // expired) skip every event already on the topic.
        if config.get("auto.offset.reset").is_none() {
            config.set("auto.offset.reset", "earliest");
        }
        // Dead letters keep their key; murmur2 places it as the relay and Java clients do.
        let producer: FutureProducer = config
            .clone()
            .set("enable.idempotence", "true")
            .set("partitioner", "murmur2_random")
            .create()
            .map_err(|e| ConsumerError::Broker(format!("kafka producer: {e}")))?;
        let consumer: StreamConsumer = config
            .set("group.id", &options.name)
            .set("enable.auto.commit", "true")
            // The loop stores an offset only once its inbox transaction committed.
            .set("enable.auto.offset.store", "false")
            .create()
            .map_err(|e| ConsumerError::Broker(format!("kafka consumer: {e}")))?;
        consumer
            .subscribe(topics)
            .map_err(|e| ConsumerError::Broker(format!("subscribe to {topics:?}: {e}")))?;
        Ok(KafkaConsumer {
            consumer,
            producer,
            options,
            progress: watch::Sender::new(Consumed::default()),
        })
    }

    /// What the loop has done so far, updated after each message is committed: for status
    /// displays, or to wait for a number of events.
    pub fn progress(&self) -> watch::Receiver<Consumed> {
        self.progress.subscribe()
    }

    /// Runs until `shutdown` completes (finishing the message in hand, then committing the
    /// offsets) or a poison message stops it under [`PoisonPolicy::Stop`](super::PoisonPolicy).
    pub async fn run<H>(
        self,
        db: &DatabaseConnection,
        handler: H,
        shutdown: impl Future<Output = ()>,
    ) -> Result<Consumed, ConsumerError>
    where
        H: for<'t> Fn(
            &'t Envelope,
            &'t DatabaseTransaction,
        ) -> BoxFuture<'t, Result<(), HandlerError>>,
    {
        let mut shutdown = std::pin::pin!(shutdown);
        let mut processor = Processor::new(db, &self.options, handler);
        let outcome = loop {
            let received = tokio::select! {
                biased;
                () = &mut shutdown => break Ok(()),
                received = self.consumer.recv() => received,
            };
            let message = match received {
                Ok(message) => message,
                Err(e) => {
                    // Broker away, rebalance in progress: librdkafka recovers by itself.
                    tracing::warn!(error = %e, "kafka consumer error");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let position = format!(
                "{}[{}]@{}",
                message.topic(),
                message.partition(),
                message.offset()
            );
            let envelope = Envelope::from_kafka(&message);
            match processor.process(envelope, &position, &mut shutdown).await {
                Verdict::Done => {}
                Verdict::DeadLetter { topic, reason } => {
                    let send = || self.send(dead_letter_record(&message, &topic, &reason));
                    if !super::dead_letter(&self.options, &topic, &mut shutdown, send).await {
                        break Ok(());
                    }
                    processor.consumed.dead_lettered += 1;
                }
                Verdict::Stop { reason } => break Err(ConsumerError::Poison { position, reason }),
                Verdict::Interrupted => break Ok(()),
            }
            if let Err(e) = self.consumer.store_offset_from_message(&message) {
                tracing::warn!(%position, error = %e, "could not store the offset; the message may be redelivered");
            }
            self.progress.send_replace(processor.consumed);
        };
        self.commit();
        outcome.map(|()| processor.consumed)
    }

    /// Commits the stored offsets now, so the next run starts after the last applied message.
    fn commit(&self) {
        match self.consumer.commit_consumer_state(CommitMode::Sync) {
            Ok(()) | Err(KafkaError::ConsumerCommit(RDKafkaErrorCode::NoOffset)) => {}
            Err(e) => {
                tracing::warn!(error = %e, "final offset commit failed; recent messages may be redelivered")
            }
        }
    }

    /// Sends one record and waits for the broker's ack.
    async fn send(&self, record: FutureRecord<'_, [u8], [u8]>) -> Result<(), KafkaError> {
        self.producer
            .send(record, Duration::from_secs(30))
            .await
            .map(drop)
            .map_err(|(e, _)| e)
    }
}

/// `message` unchanged for the dead-letter `topic`, with the reason and its source in headers.
fn dead_letter_record<'a>(
    message: &'a BorrowedMessage<'_>,
    topic: &'a str,
    reason: &str,
) -> FutureRecord<'a, [u8], [u8]> {
    let mut headers = OwnedHeaders::new();
    if let Some(original) = message.headers() {
        for header in original.iter() {
            headers = headers.insert(header);
        }
    }
    let headers = headers
        .insert(Header {
            key: "outbox_error",
            value: Some(reason),
        })
        .insert(Header {
            key: "outbox_source_topic",
            value: Some(message.topic()),
        });
    let record = FutureRecord::to(topic)
        .payload(message.payload().unwrap_or_default())
        .headers(headers);
    match message.key() {
        Some(key) => record.key(key),
        None => record,
    }
}
