//! How events are recorded: where (a table row, or a logical message) and the largest payload
//! accepted. An [`Outbox`] value says it for the calls made through it; `event.record(&txn)`,
//! [`record_all`](crate::record_all) and [`record_new_events`](crate::record_new_events) follow the
//! process's defaults ([`Outbox::default`]), which [`set_recording`] and [`set_max_payload_bytes`]
//! change.

use crate::{NewEvent, OutboxEvent, Result};
use sea_orm::DatabaseTransaction;
use uuid::Uuid;

/// Where and how events are recorded, for the calls made through it. Build one at start and keep
/// it; one application can record into rows through one value and as logical messages through
/// another, or into one outbox table through one value and another table through another.
///
/// ```no_run
/// use seaorm_outbox::{Outbox, OutboxEvent, Recording};
/// # #[derive(serde::Serialize, OutboxEvent)]
/// # #[outbox(aggregate = "order", key = "order_id")]
/// # struct OrderPlaced { order_id: u64 }
///
/// # async fn f(txn: &sea_orm::DatabaseTransaction) -> seaorm_outbox::Result<()> {
/// let outbox = Outbox::default()
///     .with_recording(Recording::LogicalMessage)
///     .with_max_payload_bytes(64 * 1024);
/// outbox.record(txn, &OrderPlaced { order_id: 7 }).await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Outbox {
    /// Where events go.
    pub recording: Recording,
    /// The outbox table rows go to ([`Recording::Table`]), unless an event type names its own
    /// ([`OutboxEvent::TABLE`]). Default `outbox`.
    pub table: crate::TableName,
    /// The largest payload accepted, in bytes of JSON: a larger event fails with
    /// [`Error::PayloadTooLarge`](crate::Error::PayloadTooLarge) and nothing is written.
    pub max_payload_bytes: usize,
}

impl Default for Outbox {
    /// The process's defaults: [`recording`] and [`max_payload_bytes`] (a table row, 1,000,000
    /// bytes, unless the application set others).
    ///
    /// ```
    /// use seaorm_outbox::{Outbox, Recording};
    /// let outbox = Outbox::default();
    /// assert_eq!(outbox.recording, Recording::Table);
    /// assert_eq!(outbox.max_payload_bytes, seaorm_outbox::DEFAULT_MAX_PAYLOAD_BYTES);
    /// ```
    fn default() -> Self {
        Outbox {
            recording: recording(),
            table: crate::TableName::DEFAULT,
            max_payload_bytes: max_payload_bytes(),
        }
    }
}

impl Outbox {
    /// The same, recording to `recording`.
    ///
    /// ```
    /// use seaorm_outbox::{Outbox, Recording};
    /// let outbox = Outbox::default().with_recording(Recording::LogicalMessage);
    /// assert_eq!(outbox.recording, Recording::LogicalMessage);
    /// ```
    pub fn with_recording(mut self, recording: Recording) -> Self {
        self.recording = recording;
        self
    }

    /// The same, recording rows into `table` (events whose type names a table of its own still go
    /// there). Migrate that table first: `seaorm_outbox::migration::migrate_table`, the SQL of
    /// [`SchemaStep::up_on`](crate::schema::SchemaStep::up_on), or `outbox-relay migrate --table`.
    ///
    /// ```
    /// use seaorm_outbox::{Outbox, TableName};
    /// let billing = Outbox::default().with_table(TableName::new("billing_outbox")?);
    /// assert_eq!(billing.table.to_string(), "billing_outbox");
    /// # Ok::<(), seaorm_outbox::InvalidTableName>(())
    /// ```
    pub fn with_table(mut self, table: crate::TableName) -> Self {
        self.table = table;
        self
    }

    /// The same, accepting payloads up to `limit` bytes of JSON.
    ///
    /// ```
    /// use seaorm_outbox::Outbox;
    /// assert_eq!(Outbox::default().with_max_payload_bytes(4096).max_payload_bytes, 4096);
    /// ```
    pub fn with_max_payload_bytes(mut self, limit: usize) -> Self {
        self.max_payload_bytes = limit;
        self
    }

    /// Records `event` inside `txn`, as [`OutboxEvent::record`] does with the process's defaults;
    /// returns its id.
    pub async fn record<E: OutboxEvent>(
        &self,
        txn: &DatabaseTransaction,
        event: &E,
    ) -> Result<Uuid> {
        let event = NewEvent::from_event(event)?;
        let id = event.id;
        crate::record::insert(txn, vec![event], self).await?;
        Ok(id)
    }

    /// Records `events`, of one type, with one statement, in order, as
    /// [`record_all`](crate::record_all) does; returns their ids.
    pub async fn record_all<E: OutboxEvent>(
        &self,
        txn: &DatabaseTransaction,
        events: &[E],
    ) -> Result<Vec<Uuid>> {
        let events: Result<Vec<NewEvent>> = events.iter().map(NewEvent::from_event).collect();
        crate::record::insert(txn, events?, self).await
    }

    /// Records events of any types with one statement, in order, as
    /// [`record_new_events`](crate::record_new_events) does; returns their ids.
    pub async fn record_new_events(
        &self,
        txn: &DatabaseTransaction,
        events: Vec<NewEvent>,
    ) -> Result<Vec<Uuid>> {
        crate::record::insert(txn, events, self).await
    }
}

/// The default of [`max_payload_bytes`]: 1,000,000 bytes of JSON, so that an event with its key and
/// headers fits in Kafka's default `message.max.bytes` (1,048,588) and Pulsar's default 5 MB.
pub const DEFAULT_MAX_PAYLOAD_BYTES: usize = 1_000_000;

static MAX_PAYLOAD_BYTES: std::sync::atomic::AtomicUsize =
    std::sync::atomic::AtomicUsize::new(DEFAULT_MAX_PAYLOAD_BYTES);

/// The largest payload `record` accepts, in bytes of JSON: a larger event fails with
/// [`Error::PayloadTooLarge`](crate::Error::PayloadTooLarge) and nothing is written, instead of a row the broker would refuse.
/// Default [`DEFAULT_MAX_PAYLOAD_BYTES`].
pub fn max_payload_bytes() -> usize {
    MAX_PAYLOAD_BYTES.load(std::sync::atomic::Ordering::Relaxed)
}

/// Sets [`max_payload_bytes`] for this process: the limit of every `record` that does not go
/// through an [`Outbox`] value of its own. Raise it together with the broker's limit
/// (`message.max.bytes` on Kafka) and the relay's `max_payload_bytes`.
///
/// ```
/// seaorm_outbox::set_max_payload_bytes(4 << 20);
/// assert_eq!(seaorm_outbox::max_payload_bytes(), 4 << 20);
/// # seaorm_outbox::set_max_payload_bytes(seaorm_outbox::DEFAULT_MAX_PAYLOAD_BYTES);
/// ```
pub fn set_max_payload_bytes(limit: usize) {
    MAX_PAYLOAD_BYTES.store(limit, std::sync::atomic::Ordering::Relaxed);
}

/// Where events are recorded: per use, with an [`Outbox`] value; or for the whole process, at
/// start, with [`set_recording`], which `event.record(&txn)`, `record_all` and
/// `record_new_events` follow, so code that records events does not change.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Recording {
    /// One row per event in the `outbox` table (PostgreSQL and SQLite). Any relay source reads it.
    #[default]
    Table,
    /// No row at all: each call writes one transactional logical message into PostgreSQL's WAL
    /// (`pg_logical_emit_message(true, 'outbox', …)`) carrying everything the rows would. It is
    /// decoded at commit, in commit order, and never if the transaction rolls back. Only the WAL
    /// relay (`outbox-relay run --source wal`) sees these events, and only if its replication
    /// slot exists before they are recorded: create it first (start the relay once). PostgreSQL
    /// with `wal_level = logical` only.
    LogicalMessage,
}

/// The logical-message prefix of events recorded with [`Recording::LogicalMessage`].
pub const LOGICAL_MESSAGE_PREFIX: &str = "outbox";

static RECORDING: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// Where `record` writes events in this process by default ([`Outbox::default`] reads it);
/// [`Recording::Table`] unless [`set_recording`] chose otherwise.
pub fn recording() -> Recording {
    match RECORDING.load(std::sync::atomic::Ordering::Relaxed) {
        1 => Recording::LogicalMessage,
        _ => Recording::Table,
    }
}

/// Sets [`recording`] for this process: where every `record` that does not go through an
/// [`Outbox`] value of its own writes. Call it at start, before the first event is recorded.
///
/// ```
/// use seaorm_outbox::Recording;
///
/// seaorm_outbox::set_recording(Recording::LogicalMessage);
/// assert_eq!(seaorm_outbox::recording(), Recording::LogicalMessage);
/// # seaorm_outbox::set_recording(Recording::Table);
/// ```
pub fn set_recording(recording: Recording) {
    let value = match recording {
        Recording::Table => 0,
        Recording::LogicalMessage => 1,
    };
    RECORDING.store(value, std::sync::atomic::Ordering::Relaxed);
}
