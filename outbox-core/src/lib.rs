//! # outbox
//!
//! The transactional outbox for SeaORM. Record an event in the same database transaction as the
//! state change it describes; a relay publishes committed events to Kafka or Pulsar. Either both
//! the change and the event commit, or neither does.
//!
//! ```no_run
//! use seaorm_outbox::OutboxEvent;
//! use sea_orm::{ConnectionTrait, Database, TransactionTrait};
//! use serde::Serialize;
//!
//! #[derive(Serialize, OutboxEvent)]
//! #[outbox(aggregate = "order", key = "order_id")]
//! struct OrderCreated {
//!     order_id: u64,
//!     customer: String,
//!     total_cents: i64,
//! }
//!
//! # async fn f() -> Result<(), Box<dyn std::error::Error>> {
//! let db = Database::connect("postgres://localhost/shop").await?;
//! let txn = db.begin().await?;
//! txn.execute_unprepared("INSERT INTO orders (id, total_cents) VALUES (42, 1999)").await?;
//! OrderCreated { order_id: 42, customer: "ada".into(), total_cents: 1999 }
//!     .record(&txn)
//!     .await?;
//! txn.commit().await?;
//! # Ok(()) }
//! ```
//!
//! # Ordering and locks
//! Events of one aggregate are published in `seq` order. On PostgreSQL, `record` takes a
//! transaction-scoped advisory lock on the aggregate before it inserts, so a second transaction
//! recording for the same aggregate waits for the first to finish: `seq` order is commit order.
//!
//! **Deadlock rule.** The lock is held until commit. A transaction that records events of several
//! aggregates should record them with one [`record_all`] or [`record_new_events`] call, which
//! locks them in one canonical order. Two transactions that call `record` for aggregates A then B,
//! and B then A, can deadlock; PostgreSQL then aborts one of them (SQLSTATE `40P01`), which is safe
//! to retry. Record as late in the transaction as you can, to hold the lock briefly.
//!
//! Writers in other languages take the same lock:
//! `SELECT pg_advisory_xact_lock(hashtextextended(aggregate_type || ':' || aggregate_id, 0))`.
//!
//! # Schema
//! See [`schema`] (plain SQL) and [`migration`] (sea-orm-migration).

#[cfg(any(feature = "kafka", feature = "pulsar"))]
pub mod consumer;
mod envelope;
mod error;
mod event;
pub mod inbox;
#[cfg(feature = "migration")]
pub mod migration;
mod outbox;
#[cfg(feature = "pulsar-client")]
pub mod pulsar_client;
mod record;
mod registry;
pub mod schema;
mod secret;
mod table;
#[cfg(feature = "testing")]
pub mod testing;

pub use envelope::{Envelope, EnvelopeError};
pub use error::{Error, Result};
pub use event::{NewEvent, OutboxEvent};
pub use outbox::{
    DEFAULT_MAX_PAYLOAD_BYTES, LOGICAL_MESSAGE_PREFIX, Outbox, Recording, max_payload_bytes,
    recording, set_max_payload_bytes, set_recording,
};
pub use record::{record_all, record_new_events};
pub use registry::{EventRegistration, check_registrations, registrations};
pub use secret::Secret;
pub use table::{InvalidTableName, TableName};

/// The message headers the broker contract sets from the event itself: `id` (the consumers'
/// deduplication key), `event_type`, `aggregate_type` and `event_version`. An application cannot
/// set them: recording an event with one fails, and the relay parks a row that carries one.
pub const RESERVED_HEADERS: [&str; 4] = ["id", "event_type", "aggregate_type", "event_version"];

/// The derive macro; see [`OutboxEvent`](trait@OutboxEvent).
#[cfg(feature = "derive")]
pub use seaorm_outbox_derive::OutboxEvent;

pub use sea_orm;
pub use uuid::Uuid;

/// What generated code refers to. Not public API.
#[doc(hidden)]
pub mod __private {
    pub use inventory;
    pub use std::string::String;

    /// What `OutboxEvent` requires of an event: that serde can make it JSON. Every `Serialize`
    /// type has it; its diagnostic gives a type without it one error of ours, at its name.
    #[diagnostic::on_unimplemented(
        message = "`{Self}` cannot be an outbox event: it does not implement `serde::Serialize`",
        label = "an outbox event is stored as JSON",
        note = "add `#[derive(serde::Serialize)]` to `{Self}`"
    )]
    pub trait SerializeEvent {
        /// The event as JSON.
        fn to_json(&self) -> serde_json::Result<serde_json::Value>;
    }

    impl<T: serde::Serialize + ?Sized> SerializeEvent for T {
        fn to_json(&self) -> serde_json::Result<serde_json::Value> {
            serde_json::to_value(self)
        }
    }

    /// The aggregate id of an event: the `key` field, through `Display`.
    pub fn aggregate_id_of<T: core::fmt::Display + ?Sized>(key: &T) -> String {
        key.to_string()
    }
}
