//! The Pulsar consumer loop (the `pulsar` crate).
//!
//! The subscription is the consumer's name, of type `Key_Shared`: any number of instances share
//! the work, and the broker gives all messages of one key (the aggregate id, sent as the ordering
//! key) to one instance at a time, in order. A message is acked only after the inbox transaction
//! committed; one never acked is redelivered, and the inbox skips it if it was applied.

use super::{Consumed, ConsumerError, ConsumerOptions, HandlerError, Processor, Verdict};
use crate::pulsar_client::{PulsarConnection, redact_userinfo};
use crate::{Envelope, EnvelopeError};
use futures::StreamExt;
use futures_core::future::BoxFuture;
use pulsar::consumer::{InitialPosition, Message};
use pulsar::message::proto::command_subscribe::SubType;
use pulsar::{Consumer, Producer, Pulsar, TokioExecutor, producer};
use sea_orm::{DatabaseConnection, DatabaseTransaction};
use std::collections::HashMap;
use std::future::Future;
use tokio::sync::watch;

impl Envelope {
    /// The envelope of a message received from Pulsar: the partition key is the aggregate id,
    /// the properties are the headers.
    pub fn from_pulsar<T>(message: &Message<T>) -> Result<Envelope, EnvelopeError> {
        let metadata = message.metadata();
        let headers = metadata
            .properties
            .iter()
            .map(|p| (p.key.as_str(), p.value.as_bytes()));
        Envelope::from_parts(
            metadata.partition_key.as_deref().map(str::as_bytes),
            headers,
            &message.payload.data,
        )
    }
}

/// Consumes outbox events from Pulsar topics into the inbox. See [the module](super).
///
/// ```no_run
/// # async fn f(db: seaorm_outbox::sea_orm::DatabaseConnection) -> Result<(), seaorm_outbox::consumer::ConsumerError> {
/// use seaorm_outbox::consumer::{pulsar::PulsarConsumer, ConsumerOptions};
///
/// let consumer = PulsarConsumer::new(
///     "pulsar://127.0.0.1:6650",
///     &["persistent://public/default/outbox.event.order"],
///     ConsumerOptions::new("billing"),
/// ).await?;
/// consumer
///     .run(&db, |envelope, _txn| Box::pin(async move {
///         println!("{} {}", envelope.event_type, envelope.aggregate_id);
///         Ok(())
///     }), std::future::pending())
///     .await?;
/// # Ok(()) }
/// ```
pub struct PulsarConsumer {
    client: Pulsar<TokioExecutor>,
    consumer: Consumer<Vec<u8>, TokioExecutor>,
    /// Dead-letter producers, by topic, created on first use.
    dead_letters: tokio::sync::Mutex<HashMap<String, Producer<TokioExecutor>>>,
    options: ConsumerOptions,
    progress: watch::Sender<Consumed>,
}

impl std::fmt::Debug for PulsarConsumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PulsarConsumer")
            .field("name", &self.options.name)
            .finish_non_exhaustive()
    }
}

impl PulsarConsumer {
    /// Connects to `url` and subscribes (`Key_Shared`, named `options.name()`) to `topics`. A new
    /// subscription starts at the earliest message.
    pub async fn new(
        url: &str,
        topics: &[&str],
        options: ConsumerOptions,
    ) -> Result<Self, ConsumerError> {
        let client = Pulsar::builder(url, TokioExecutor)
            .build()
            .await
            .map_err(|e| {
                ConsumerError::Broker(format!("connect to {}: {e}", redact_userinfo(url)))
            })?;
        Self::with_client(client, topics, options).await
    }

    /// Connects as `connection` says (token or OAuth 2.0, TLS) and subscribes to `topics`, as
    /// [`new`](Self::new) does.
    ///
    /// ```no_run
    /// # async fn f() -> Result<(), seaorm_outbox::consumer::ConsumerError> {
    /// use seaorm_outbox::consumer::{pulsar::PulsarConsumer, ConsumerOptions};
    /// use seaorm_outbox::pulsar_client::{PulsarAuth, PulsarConnection};
    /// use seaorm_outbox::Secret;
    ///
    /// let mut connection = PulsarConnection::new("pulsar+ssl://127.0.0.1:6651");
    /// connection.auth = Some(PulsarAuth::Token(Secret::new(std::fs::read_to_string("/run/secrets/pulsar-token").unwrap().trim())));
    /// connection.tls_ca_file = Some("/etc/ssl/pulsar-ca.pem".into());
    /// let consumer = PulsarConsumer::connect(&connection, &["persistent://public/default/outbox.event.order"], ConsumerOptions::new("billing")).await?;
    /// # Ok(()) }
    /// ```
    pub async fn connect(
        connection: &PulsarConnection,
        topics: &[&str],
        options: ConsumerOptions,
    ) -> Result<Self, ConsumerError> {
        let client = connection.connect(None).await.map_err(|e| {
            let url = redact_userinfo(&connection.url);
            ConsumerError::Broker(format!("connect to {url}: {e}"))
        })?;
        Self::with_client(client, topics, options).await
    }

    /// Like [`new`](Self::new), with a client you built.
    pub async fn with_client(
        client: Pulsar<TokioExecutor>,
        topics: &[&str],
        options: ConsumerOptions,
    ) -> Result<Self, ConsumerError> {
        let consumer = client
            .consumer()
            .with_topics(topics)
            .with_subscription(&options.name)
            .with_subscription_type(SubType::KeyShared)
            .with_options(
                pulsar::ConsumerOptions::default().with_initial_position(InitialPosition::Earliest),
            )
            .build()
            .await
            .map_err(|e| ConsumerError::Broker(format!("subscribe to {topics:?}: {e}")))?;
        Ok(PulsarConsumer {
            client,
            consumer,
            dead_letters: Default::default(),
            options,
            progress: watch::Sender::new(Consumed::default()),
        })
    }

    /// What the loop has done so far, updated after each message is acked: for status displays,
    /// or to wait for a number of events.
    pub fn progress(&self) -> watch::Receiver<Consumed> {
        self.progress.subscribe()
    }

    /// Runs until `shutdown` completes (finishing the message in hand, then closing the
    /// consumer) or a poison message stops it under [`PoisonPolicy::Stop`](super::PoisonPolicy).
    pub async fn run<H>(
        mut self,
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
                received = self.consumer.next() => received,
            };
            let message = match received {
                Some(Ok(message)) => message,
                Some(Err(e)) => {
                    // The client reconnects by itself; say so and go on.
                    tracing::warn!(error = %e, "pulsar consumer error");
                    continue;
                }
                None => break Err(ConsumerError::Broker("the pulsar consumer closed".into())),
            };
            let id = message.message_id();
            let position = format!(
                "{} {}:{}:{}",
                message.topic,
                id.ledger_id,
                id.entry_id,
                id.batch_index.unwrap_or(-1)
            );
            let envelope = Envelope::from_pulsar(&message);
            match processor.process(envelope, &position, &mut shutdown).await {
                Verdict::Done => {}
                Verdict::DeadLetter { topic, reason } => {
                    let send = || self.send_dead_letter(&message, &topic, &reason);
                    if !super::dead_letter(&self.options, &topic, &mut shutdown, send).await {
                        break Ok(());
                    }
                    processor.consumed.dead_lettered += 1;
                }
                Verdict::Stop { reason } => break Err(ConsumerError::Poison { position, reason }),
                Verdict::Interrupted => break Ok(()),
            }
            if let Err(e) = self.consumer.ack(&message).await {
                tracing::warn!(%position, error = %e, "ack failed; the message will be redelivered");
            }
            self.progress.send_replace(processor.consumed);
        };
        if let Err(e) = self.consumer.close().await {
            tracing::warn!(error = %e, "closing the pulsar consumer");
        }
        outcome.map(|()| processor.consumed)
    }

    /// Publishes `message` unchanged to the dead-letter `topic`, with the reason and its source
    /// in properties, and waits for the broker's receipt.
    async fn send_dead_letter(
        &self,
        message: &Message<Vec<u8>>,
        topic: &str,
        reason: &str,
    ) -> Result<(), pulsar::Error> {
        let mut dead_letters = self.dead_letters.lock().await;
        if !dead_letters.contains_key(topic) {
            let producer = self.client.producer().with_topic(topic).build().await?;
            dead_letters.insert(topic.to_owned(), producer);
        }
        let producer = dead_letters.get_mut(topic).expect("just inserted");
        let metadata = message.metadata();
        let mut properties: HashMap<String, String> = metadata
            .properties
            .iter()
            .map(|p| (p.key.clone(), p.value.clone()))
            .collect();
        properties.insert("outbox_error".into(), reason.to_owned());
        properties.insert("outbox_source_topic".into(), message.topic.clone());
        let outgoing = producer::Message {
            payload: message.payload.data.clone(),
            properties,
            partition_key: metadata.partition_key.clone(),
            ordering_key: metadata.ordering_key.clone(),
            ..Default::default()
        };
        producer.send_non_blocking(outgoing).await?.await.map(drop)
    }
}
