//! Consumer loops: receive events from Kafka or Pulsar and apply each one's effect exactly once.
//!
//! A loop takes one message at a time: it builds the [`Envelope`], opens a transaction, records
//! the event in the [inbox](crate::inbox), runs your handler in that transaction, commits, and
//! only then commits the Kafka offset or acks the Pulsar message. A crash anywhere before the
//! offset commit or ack means a redelivery, which the inbox recognizes and skips: the effect is
//! applied once. Messages are handled in order, so an aggregate's events (one key, one partition
//! or one `Key_Shared` consumer) are applied in the order they were recorded.
//!
//! A message that fails is retried with backoff; one that keeps failing, or cannot be decoded
//! at all, is *poison* and goes to the [`PoisonPolicy`]. Database errors of the loop itself (the
//! inbox insert, the commit) are retried until the database is back: they say nothing about the
//! message.
//!
//! ```no_run
//! # #[cfg(feature = "kafka")]
//! # async fn f(db: seaorm_outbox::sea_orm::DatabaseConnection) -> Result<(), Box<dyn std::error::Error>> {
//! use seaorm_outbox::consumer::{kafka::KafkaConsumer, ConsumerOptions, PoisonPolicy};
//! use seaorm_outbox::sea_orm::ConnectionTrait;
//!
//! #[derive(serde::Serialize, serde::Deserialize, seaorm_outbox::OutboxEvent)]
//! #[outbox(aggregate = "order", key = "order_id")]
//! struct OrderPlaced { order_id: u64, total_cents: i64 }
//!
//! let options = ConsumerOptions::new("billing")
//!     .poison(PoisonPolicy::DeadLetter { topic: "billing.dead-letter".into() });
//! let consumer = KafkaConsumer::new("127.0.0.1:9092", &["outbox.event.order"], options)?;
//! let shutdown = async { tokio::signal::ctrl_c().await.ok(); };
//! consumer
//!     .run(&db, |envelope, txn| Box::pin(async move {
//!         let order: OrderPlaced = envelope.decode()?;
//!         txn.execute_unprepared(&format!(
//!             "INSERT INTO invoices (order_id, cents) VALUES ({}, {})", order.order_id, order.total_cents
//!         )).await?;
//!         Ok(())
//!     }), shutdown)
//!     .await?;
//! # Ok(()) }
//! ```

#[cfg(feature = "kafka")]
pub mod kafka;
#[cfg(feature = "pulsar")]
pub mod pulsar;

use crate::inbox::Inbox;
use crate::{Envelope, EnvelopeError};
pub use futures_core::future::BoxFuture;
use sea_orm::{DatabaseConnection, DatabaseTransaction, TransactionTrait};
use std::future::Future;
use std::time::Duration;

/// What a handler returns when it fails: any error. An [`EnvelopeError`] (from
/// [`Envelope::decode`]) marks the message as poison at once; other errors are retried first.
pub type HandlerError = Box<dyn std::error::Error + Send + Sync>;

/// Gives a handler closure the signature the loops take, for a closure kept in a variable
/// before it is passed (Rust infers a closure's lifetimes from where it is written).
///
/// ```
/// use seaorm_outbox::consumer::handler;
/// use std::sync::atomic::{AtomicUsize, Ordering};
///
/// let seen = std::sync::Arc::new(AtomicUsize::new(0));
/// let count = handler(move |_envelope, _txn| {
///     seen.fetch_add(1, Ordering::Relaxed);
///     Box::pin(async { Ok(()) })
/// });
/// ```
pub fn handler<H>(handler: H) -> H
where
    H: for<'t> Fn(&'t Envelope, &'t DatabaseTransaction) -> BoxFuture<'t, Result<(), HandlerError>>,
{
    handler
}

/// What to do with a poison message: one that cannot be decoded, or that the handler rejected on
/// every attempt.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum PoisonPolicy {
    /// Stop the loop with [`ConsumerError::Poison`], without committing the message: it is the
    /// first thing the next run sees. Nothing is lost; the consumer waits for a fix.
    #[default]
    Stop,
    /// Publish the message, unchanged, to this topic (with headers `outbox_error` and
    /// `outbox_source_topic` added), then commit it and go on.
    DeadLetter {
        /// The dead-letter topic (for Pulsar, a topic name or a full `persistent://` name).
        topic: String,
    },
    /// Keep retrying at the longest backoff. The loop waits on the message; nothing is lost and
    /// nothing spins.
    Retry,
}

/// Settings shared by the Kafka and Pulsar loops.
///
/// ```
/// use seaorm_outbox::consumer::{ConsumerOptions, PoisonPolicy};
/// use std::time::Duration;
///
/// let options = ConsumerOptions::new("billing")
///     .attempts(5)
///     .backoff(Duration::from_millis(100), Duration::from_secs(10))
///     .poison(PoisonPolicy::Retry);
/// assert_eq!(options.name(), "billing");
/// ```
#[derive(Debug, Clone)]
pub struct ConsumerOptions {
    name: String,
    attempts: u32,
    first_backoff: Duration,
    max_backoff: Duration,
    poison: PoisonPolicy,
}

impl ConsumerOptions {
    /// Options for consumer `name`: its inbox name, Kafka group id and Pulsar subscription.
    /// Defaults: 3 attempts per message, backoff from 100 ms doubling up to 30 s (with jitter, so
    /// instances that failed together do not retry together), [`PoisonPolicy::Stop`].
    pub fn new(name: impl Into<String>) -> Self {
        ConsumerOptions {
            name: name.into(),
            attempts: 3,
            first_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(30),
            poison: PoisonPolicy::Stop,
        }
    }

    /// The consumer's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// How many times the handler may fail on one message before it is poison (at least 1).
    pub fn attempts(mut self, attempts: u32) -> Self {
        self.attempts = attempts.max(1);
        self
    }

    /// The first wait after a failure, and the longest.
    pub fn backoff(mut self, first: Duration, max: Duration) -> Self {
        self.first_backoff = first;
        self.max_backoff = max.max(first);
        self
    }

    /// The waits between retries: exponential from the first backoff to the longest, with jitter,
    /// as the relay backs off (the same crate, `backon`).
    fn retry_delays(&self) -> impl Iterator<Item = Duration> + Send + use<> {
        use backon::BackoffBuilder;
        backon::ExponentialBuilder::default()
            .with_min_delay(self.first_backoff)
            .with_max_delay(self.max_backoff)
            .with_jitter()
            .without_max_times()
            .build()
    }

    /// What to do with poison messages.
    pub fn poison(mut self, policy: PoisonPolicy) -> Self {
        self.poison = policy;
        self
    }
}

/// Why a consumer loop stopped before its shutdown signal.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConsumerError {
    /// A poison message under [`PoisonPolicy::Stop`]. It was not committed.
    #[error("poison message at {position}: {reason}")]
    Poison {
        /// Where the message is (topic, partition and offset, or Pulsar message id).
        position: String,
        /// Why it was rejected.
        reason: String,
    },
    /// The broker client failed in a way the loop cannot recover from.
    #[error("broker: {0}")]
    Broker(String),
}

/// What a consumer loop did before it stopped.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Consumed {
    /// Events whose handler ran and committed.
    pub applied: u64,
    /// Events this consumer had already processed: skipped.
    pub duplicates: u64,
    /// Poison messages sent to the dead-letter topic.
    pub dead_lettered: u64,
}

/// The fate of one message, decided by [`Processor::process`].
#[derive(Debug)]
pub(crate) enum Verdict {
    /// Applied or a duplicate: commit the offset or ack.
    Done,
    /// Poison under [`PoisonPolicy::DeadLetter`]: publish it there, then commit or ack.
    DeadLetter { topic: String, reason: String },
    /// Poison under [`PoisonPolicy::Stop`]: stop without committing.
    Stop { reason: String },
    /// Shutdown came while waiting to retry: stop without committing.
    Interrupted,
}

/// The broker-independent half of a consumer loop: inbox, handler, retries and poison policy.
pub(crate) struct Processor<'a, H> {
    pub(crate) db: &'a DatabaseConnection,
    pub(crate) inbox: Inbox,
    pub(crate) options: &'a ConsumerOptions,
    pub(crate) handler: H,
    pub(crate) consumed: Consumed,
}

enum Attempt {
    Applied,
    Duplicate,
    /// The database failed around the handler: retry, whatever the count.
    Database(crate::Error),
    /// The handler failed.
    Handler(HandlerError),
}

impl<'a, H> Processor<'a, H>
where
    H: for<'t> Fn(&'t Envelope, &'t DatabaseTransaction) -> BoxFuture<'t, Result<(), HandlerError>>,
{
    pub(crate) fn new(
        db: &'a DatabaseConnection,
        options: &'a ConsumerOptions,
        handler: H,
    ) -> Self {
        Processor {
            db,
            inbox: Inbox::new(options.name.clone()),
            options,
            handler,
            consumed: Consumed::default(),
        }
    }

    /// Applies one received message, retrying as the options say; `position` names it in logs.
    pub(crate) async fn process(
        &mut self,
        envelope: Result<Envelope, EnvelopeError>,
        position: &str,
        shutdown: &mut (impl Future<Output = ()> + Unpin),
    ) -> Verdict {
        let envelope = match envelope {
            Ok(envelope) => envelope,
            Err(e) => {
                // The bytes will not change: only the policy decides, and `Retry` waits here.
                let reason = format!("not an outbox event: {e}");
                loop {
                    if let Some(verdict) = self.poison(&reason, position) {
                        return verdict;
                    }
                    if sleep_or_shutdown(self.options.max_backoff, shutdown).await {
                        return Verdict::Interrupted;
                    }
                }
            }
        };
        let mut failures = 0;
        let mut backoff = self.options.retry_delays();
        loop {
            let wait = match self.attempt(&envelope).await {
                Attempt::Applied => {
                    self.consumed.applied += 1;
                    return Verdict::Done;
                }
                Attempt::Duplicate => {
                    self.consumed.duplicates += 1;
                    return Verdict::Done;
                }
                Attempt::Database(e) => {
                    tracing::warn!(event_id = %envelope.id, %position, error = %e, "inbox database error; retrying");
                    backoff.next().unwrap_or(self.options.max_backoff)
                }
                Attempt::Handler(e) => {
                    failures += 1;
                    // Bad JSON or a wrong type fails the same way every time.
                    let undecodable = e.is::<EnvelopeError>();
                    if undecodable || failures >= self.options.attempts {
                        let reason = if undecodable {
                            e.to_string()
                        } else {
                            format!("handler failed {failures} times: {e}")
                        };
                        match self.poison(&reason, position) {
                            Some(verdict) => return verdict,
                            None => self.options.max_backoff,
                        }
                    } else {
                        tracing::warn!(event_id = %envelope.id, %position, attempt = failures, error = %e, "handler failed; retrying");
                        backoff.next().unwrap_or(self.options.max_backoff)
                    }
                }
            };
            if sleep_or_shutdown(wait, shutdown).await {
                return Verdict::Interrupted;
            }
        }
    }

    async fn attempt(&self, envelope: &Envelope) -> Attempt {
        let txn = match self.db.begin().await {
            Ok(txn) => txn,
            Err(e) => return Attempt::Database(e.into()),
        };
        match self.inbox.record(&txn, envelope.id).await {
            Ok(true) => {}
            Ok(false) => return Attempt::Duplicate,
            Err(e) => return Attempt::Database(e),
        }
        // A failed handler drops `txn`, which rolls back its effect and the inbox record together.
        if let Err(e) = (self.handler)(envelope, &txn).await {
            return Attempt::Handler(e);
        }
        match txn.commit().await {
            Ok(()) => Attempt::Applied,
            Err(e) => Attempt::Database(e.into()),
        }
    }

    /// The policy's verdict on a poison message; `None` under [`PoisonPolicy::Retry`].
    fn poison(&self, reason: &str, position: &str) -> Option<Verdict> {
        tracing::error!(%position, %reason, policy = ?self.options.poison, "poison message");
        match &self.options.poison {
            PoisonPolicy::Stop => Some(Verdict::Stop {
                reason: reason.to_owned(),
            }),
            PoisonPolicy::DeadLetter { topic } => Some(Verdict::DeadLetter {
                topic: topic.clone(),
                reason: reason.to_owned(),
            }),
            PoisonPolicy::Retry => None,
        }
    }
}

/// Publishes a dead letter with `send` until the broker takes it, backing off between tries;
/// false if `shutdown` came first. The message is committed only after this.
async fn dead_letter<F, E>(
    options: &ConsumerOptions,
    topic: &str,
    shutdown: &mut (impl Future<Output = ()> + Unpin),
    mut send: impl FnMut() -> F,
) -> bool
where
    F: Future<Output = Result<(), E>>,
    E: std::fmt::Display,
{
    let mut backoff = options.retry_delays();
    loop {
        match send().await {
            Ok(()) => return true,
            Err(e) => tracing::warn!(%topic, error = %e, "dead-letter publish failed; retrying"),
        }
        let wait = backoff.next().unwrap_or(options.max_backoff);
        if sleep_or_shutdown(wait, shutdown).await {
            return false;
        }
    }
}

/// Sleeps for `duration`; true if `shutdown` came first.
async fn sleep_or_shutdown(
    duration: Duration,
    shutdown: &mut (impl Future<Output = ()> + Unpin),
) -> bool {
    tokio::select! {
        () = tokio::time::sleep(duration) => false,
        () = shutdown => true,
    }
}
