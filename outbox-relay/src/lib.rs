//! # seaorm-outbox-relay
//!
//! Publishes the events that [`seaorm_outbox`] recorded, from the `outbox` table to a broker: at
//! least once, in order per aggregate, with any number of replicas against one database.
//!
//! The loop ([`Relay::run`], in `relay.rs`): claim the oldest unpublished rows of this replica's
//! shards, hand them all to the sink, and, while the broker answers, claim the next batch; then
//! mark what the broker acked, in one short transaction. A crash between the ack and the commit
//! re-sends what was not marked; a rolled-back business transaction is never seen.
//!
//! ## Your own relay binary
//! The relay routes by the event types registered in its binary. To link yours in, reference the
//! events crate (the linker drops a crate nothing uses, and its registrations with it):
//!
//! ```no_run
//! // use my_events as _;
//! fn main() -> std::process::ExitCode {
//!     seaorm_outbox_relay::cli::main()
//! }
//! ```
//!
//! ## Embedding
//! ```no_run
//! use seaorm_outbox_relay::{Relay, RelayConfig, sink::kafka::{KafkaConfig, KafkaSink}};
//! use tokio_util::sync::CancellationToken;
//!
//! # async fn f() -> Result<(), Box<dyn std::error::Error>> {
//! let sink = KafkaSink::new(&KafkaConfig::new("127.0.0.1:9092"))?;
//! let relay = Relay::new(RelayConfig::new("postgres://localhost/shop"), sink);
//! relay.run(CancellationToken::new()).await?;
//! # Ok(()) }
//! ```
//!
//! See `docs/design.md` for the guarantees and how replicas share the work.

mod batch;
#[cfg(feature = "cli")]
pub mod cli;
pub mod cloudevents;
mod config;
mod database;
#[cfg(feature = "endpoints")]
pub mod endpoints;
mod error;
pub mod failed;
mod in_flight;
mod message;
pub mod metrics;
mod ordering;
mod outlet;
mod pace;
mod quiet;
mod readiness;
mod redact;
mod relay;
mod routing;
mod row;
pub mod sink;
mod source;
mod status;
mod tasks;
mod tenants;
#[cfg(feature = "testing")]
pub mod testing;

pub use config::Wakeup;
pub use config::{Mode, RelayConfig, Source};
pub use error::SourceError;
pub use readiness::READY_TIMEOUT;
pub use redact::{is_secret_key, redact_url};
pub use relay::Relay;
pub use routing::{DEFAULT_TOPIC_TEMPLATE, Router};
pub use source::table::leases::MYSQL_LOCK_PREFIX as MYSQL_LOCK_PREFIX_SQL;
pub use source::table::prune::prune;
pub use source::table::wakeup;
pub use source::table::{
    MYSQL_CLAIM as MYSQL_CLAIM_SQL, PG_CLAIM as POSTGRES_CLAIM_SQL,
    PG_SESSION as POSTGRES_SESSION_SQL,
};
pub use source::wal;
pub use status::{Partitions, Status, status};
pub use tenants::{Tenant, Tenants};
