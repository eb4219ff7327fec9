//! A test kit for what happens after `record` (feature `testing`): run the relay's real claiming,
//! routing, ordering and parking over a test database into an in-memory sink, until nothing more
//! can be published. No broker is involved.
//!
//! With `seaorm_outbox::testing` (a ready database, `assert_recorded!`), a test goes from a handler
//! to the messages a consumer would receive:
//!
//! ```
//! use seaorm_outbox::OutboxEvent;
//! use seaorm_outbox::sea_orm::TransactionTrait;
//! use seaorm_outbox::testing::TestDatabase;
//!
//! #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize, OutboxEvent)]
//! #[outbox(aggregate = "order", key = "order_id", topic = "shop.orders")]
//! struct OrderPlaced {
//!     order_id: String,
//! }
//!
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! let db = TestDatabase::sqlite().await?;
//! let txn = db.begin().await?;
//! OrderPlaced { order_id: "o-1".into() }.record(&txn).await?;
//! txn.commit().await?;
//!
//! let drained = seaorm_outbox_relay::testing::drain(db.url()).await?;
//! let [message] = &drained.messages[..] else { panic!("one message: {drained:?}") };
//! assert_eq!(message.topic, "shop.orders");
//! assert_eq!(message.key, "o-1");
//! let envelope = seaorm_outbox_relay::testing::envelope(message)?; // what a consumer loop hands a handler
//! assert_eq!(envelope.decode::<OrderPlaced>()?, OrderPlaced { order_id: "o-1".into() });
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! # }).unwrap();
//! ```

use crate::config::RelayConfig;
use crate::error::SourceError;
use crate::failed::ParkedEvent;
use crate::relay::Relay;
use crate::sink::Message;
use crate::sink::memory::MemorySink;
use crate::source::table::{Connection, OutboxTable};
use seaorm_outbox::{Envelope, EnvelopeError};
use std::time::Duration;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// How long [`drain`] waits for the outbox to empty before it fails.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(30);

/// What a drain published, and what it parked.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Drained {
    /// Every message the relay published, in publish order: per aggregate, in `seq` order.
    pub messages: Vec<Message>,
    /// Events the relay parked as poison (with their reasons), table by table, oldest first. Their aggregates'
    /// later events wait behind them and are not in `messages`.
    pub parked: Vec<ParkedEvent>,
}

impl Drained {
    /// The messages published to `topic`, in publish order.
    pub fn on_topic<'a>(&'a self, topic: &'a str) -> impl Iterator<Item = &'a Message> + 'a {
        self.messages.iter().filter(move |m| m.topic == topic)
    }
}

/// Why a drain failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DrainError {
    /// The database could not be read.
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    /// The relay refused to start (another relay holds the SQLite database, a WAL relay reads
    /// the table, ...).
    #[error("the relay refused to start: {0}")]
    Refused(String),
    /// Events were still publishable when the time ran out.
    #[error("the outbox was not drained within {timeout:?}: {left} events still to publish")]
    Timeout {
        /// How long it waited.
        timeout: Duration,
        /// Events not published, not parked, and not waiting behind a parked event.
        left: i64,
    },
}

/// Runs the relay with its defaults over the database at `database_url` into an in-memory sink
/// until every event has been published or parked (or waits behind a parked one), then stops it.
///
/// The routing is the binary's: event types registered by `#[derive(OutboxEvent)]` in the test
/// go to their topics, others by the default template (`outbox.event.{aggregate_type}`).
pub async fn drain(database_url: &str) -> Result<Drained, DrainError> {
    drain_with(RelayConfig::new(database_url)).await
}

/// [`drain`] with settings of your own (`strict`, `topic_template`, `max_payload_bytes`, `mode`,
/// ...). Polling runs every 10 ms whatever `poll_interval` says, so tests do not wait.
///
/// ```no_run
/// # async fn f() -> Result<(), seaorm_outbox_relay::testing::DrainError> {
/// let mut config = seaorm_outbox_relay::RelayConfig::new("sqlite:///tmp/shop.db");
/// config.strict = true; // park event types this binary does not register
/// let drained = seaorm_outbox_relay::testing::drain_with(config).await?;
/// assert!(drained.parked.is_empty(), "{:?}", drained.parked);
/// # Ok(()) }
/// ```
pub async fn drain_with(mut config: RelayConfig) -> Result<Drained, DrainError> {
    config.poll_interval = Duration::from_millis(10);
    config.retention = None;
    let url = config.database_url.clone();
    let table_names = config.tables.clone();
    let sink = MemorySink::default();
    let relay = Relay::new(config, sink.clone());
    relay.lock_sqlite().map_err(DrainError::Refused)?;
    relay.check_source().await.map_err(|e| match e {
        SourceError::Database(e) => DrainError::Database(e),
        refused => DrainError::Refused(refused.to_string()),
    })?;

    let shutdown = CancellationToken::new();
    let mut tables = Vec::with_capacity(table_names.len());
    for name in &table_names {
        tables.push(OutboxTable::connect(&url, name).await?);
    }
    let deadline = Instant::now() + DRAIN_TIMEOUT;
    let running = relay.run(shutdown.clone());
    tokio::pin!(running);
    // Set when the relay returned by itself: it must not be awaited again.
    let mut stopped_early = false;
    let outcome = loop {
        tokio::select! {
            stopped = &mut running => {
                stopped_early = true;
                break Err(DrainError::Refused(match stopped {
                    Err(refused) => refused.to_string(),
                    Ok(()) => "the relay stopped by itself (see its log)".into(),
                }));
            }
            () = tokio::time::sleep(Duration::from_millis(10)) => {}
        }
        match publishable(&mut tables).await {
            Ok(0) => break Ok(()),
            Ok(left) if Instant::now() > deadline => {
                break Err(DrainError::Timeout {
                    timeout: DRAIN_TIMEOUT,
                    left,
                });
            }
            Ok(_) => {}
            Err(e) => break Err(e.into()),
        }
    };
    shutdown.cancel();
    if !stopped_early {
        // Stopped by the cancellation: a refusal now is not the drain's outcome.
        let _ = running.await;
    }
    outcome?;
    let mut parked = Vec::new();
    for name in &table_names {
        parked.extend(crate::failed::list(&url, name).await?);
    }
    Ok(Drained {
        messages: sink.messages(),
        parked,
    })
}

/// The event a consumer loop would hand its handler for `message`: what the relay published,
/// read back through the broker contract (headers `id`, `event_type`, `aggregate_type`,
/// `event_version`; key; payload). Feed it to your handler to test it without a broker.
pub fn envelope(message: &Message) -> Result<Envelope, EnvelopeError> {
    Envelope::from_parts(
        Some(message.key.as_bytes()),
        message
            .headers
            .iter()
            .map(|(name, value)| (name.as_str(), value.as_bytes())),
        &message.payload,
    )
}

/// Events the relay could still publish, in all its tables: unpublished, not parked, not behind a
/// parked event of their aggregate.
async fn publishable(tables: &mut [OutboxTable]) -> Result<i64, sqlx::Error> {
    let mut left = 0;
    for table in tables {
        left += publishable_in(table).await?;
    }
    Ok(left)
}

async fn publishable_in(table: &mut OutboxTable) -> Result<i64, sqlx::Error> {
    let sql = "SELECT count(*) FROM outbox o
               WHERE o.published_at IS NULL AND o.parked_at IS NULL
                 AND NOT EXISTS (SELECT 1 FROM outbox p
                                 WHERE p.aggregate_type = o.aggregate_type
                                   AND p.aggregate_id = o.aggregate_id
                                   AND p.parked_at IS NOT NULL AND p.published_at IS NULL)";
    let sql = crate::source::table::on(&table.name, sql, table.conn.backend());
    match &mut table.conn {
        Connection::Postgres(conn) => sqlx::query_scalar(sql).fetch_one(conn).await,
        Connection::Sqlite(conn) => sqlx::query_scalar(sql).fetch_one(conn).await,
        Connection::MySql(conn) => sqlx::query_scalar(sql).fetch_one(conn).await,
    }
}
