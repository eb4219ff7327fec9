//! The relay's settings, with their defaults.

use crate::redact::redact_url;
use crate::routing::DEFAULT_TOPIC_TEMPLATE;
use std::time::Duration;

/// Exponential backoff with jitter, from 100 ms up to `max`.
pub(crate) fn backoff(max: Duration) -> impl Iterator<Item = Duration> + Send + use<> {
    use backon::BackoffBuilder;
    backon::ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(100))
        .with_max_delay(max)
        .with_jitter()
        .without_max_times()
        .build()
}

/// How a [`Relay`](crate::relay::Relay) runs. Start from [`RelayConfig::new`] and change what you
/// need.
///
/// ```
/// use seaorm_outbox_relay::{Mode, RelayConfig};
/// use std::time::Duration;
///
/// let mut config = RelayConfig::new("postgres://localhost/shop");
/// config.batch_size = 1000;
/// config.poll_interval = Duration::from_millis(20);
/// config.mode = Mode::Delete;
/// assert_eq!(config.topic_template, "outbox.event.{aggregate_type}");
///
/// let config = RelayConfig::new("postgres://relay:s3cret@db/shop");
/// assert!(!format!("{config:?}").contains("s3cret"));
/// ```
#[derive(Clone)]
#[non_exhaustive]
pub struct RelayConfig {
    /// `postgres://…` or `sqlite:…`. A PostgreSQL URL may end in `?connect_timeout=SECONDS`
    /// (libpq's parameter; default 5): how long a connection attempt may take.
    pub database_url: String,
    /// The outbox tables to publish: `[outbox]` by default; others (`billing_outbox`, or
    /// `billing.outbox` on PostgreSQL) for an application that records into several. The relay
    /// runs one pump per table, all publishing through its one sink; each table has shard leases
    /// of its own, so replicas share each table's work as they share one table's. The WAL source
    /// reads `outbox` only.
    ///
    /// ```
    /// use seaorm_outbox::TableName;
    /// use seaorm_outbox_relay::RelayConfig;
    ///
    /// let mut config = RelayConfig::new("postgres://localhost/shop");
    /// config.tables = vec![TableName::DEFAULT, TableName::new("billing_outbox").unwrap()];
    /// ```
    pub tables: Vec<seaorm_outbox::TableName>,
    /// Tenant databases (a database per tenant): with tenants, the relay publishes each of
    /// [`tables`](Self::tables) in each tenant's database instead of in `database_url`, one pump
    /// for each, so a tenant whose database fails holds only its own pumps. Their metrics carry a
    /// `tenant` label. `database_url` stays the relay's own database (readiness checks it).
    /// [`Tenants::None`](crate::tenants::Tenants::None) by default; polling source only.
    pub tenants: crate::tenants::Tenants,
    /// How often a tenants file is read again. Default 5 s.
    pub tenants_reread: Duration,
    /// Rows claimed and published per batch. Default 500.
    pub batch_size: usize,
    /// Payload and header bytes per batch, so the relay's memory is bounded by its settings
    /// whatever the rows hold: a batch stops before the row that would pass it. Default 16 MiB.
    pub max_batch_bytes: usize,
    /// The largest payload the relay publishes: a row over it is parked (reason `payload too large:
    /// N bytes, over the relay's limit`) without its payload being read. Default 1,000,000, as
    /// [`seaorm_outbox::DEFAULT_MAX_PAYLOAD_BYTES`]; raise both with the broker's
    /// `message.max.bytes`.
    pub max_payload_bytes: usize,
    /// The longest wait between polls while there is nothing to publish. Polling is adaptive:
    /// [`min_poll_interval`](Self::min_poll_interval) after a batch that found work, doubling
    /// while batches come back empty, up to this. Default 100 ms.
    pub poll_interval: Duration,
    /// The wait after a batch that found work but did not fill (a full batch loops at once): the
    /// longer, the more events each batch carries at a steady rate, and the less the relay costs
    /// the database it shares with the application per event, for that much more latency.
    /// Default 1 ms.
    pub min_poll_interval: Duration,
    /// Mark rows published, or delete them. Default [`Mode::Mark`].
    pub mode: Mode,
    /// The topic of events with neither a row topic nor a registered one; `{aggregate_type}` is
    /// replaced. Default `outbox.event.{aggregate_type}`.
    pub topic_template: String,
    /// Park rows whose event type no `#[derive(OutboxEvent)]` in this binary registers, instead of
    /// routing them by the template. Default false.
    pub strict: bool,
    /// Messages as CloudEvents 1.0 instead of the relay's contract. Default `None` (the contract).
    pub cloudevents: Option<crate::cloudevents::CloudEvents>,
    /// Polling, or LISTEN/NOTIFY on PostgreSQL. Default [`Wakeup::Poll`].
    pub wakeup: Wakeup,
    /// How often replicas rebalance shard leases; a dead replica's shards are taken over within
    /// about this long. Default 1 s.
    pub lease_refresh: Duration,
    /// The longest wait between retries after a failure (backoff with jitter). Default 30 s.
    pub max_backoff: Duration,
    /// Publish an aggregate's later events even while an earlier one is parked. This breaks the
    /// aggregate's order; by default they wait. Default false.
    pub skip_parked: bool,
    /// Delete published rows older than this (mark mode); `None` keeps them. Default 7 days.
    pub retention: Option<Duration>,
    /// How often to prune. Default 1 minute.
    pub prune_interval: Duration,
    /// How often to sample the backlog gauges. Default 5 s.
    pub metrics_interval: Duration,
    /// How long the relay waits for a sink's answer about one message, from the moment it was
    /// enqueued; a message with no answer by then counts as a failed attempt and is retried. It
    /// keeps a sink whose acknowledgement never comes from stopping the relay. Keep it above the
    /// client's own timeout (Kafka's `message.timeout.ms`, 30 s by default). Default 2 minutes.
    pub ack_timeout: Duration,
    /// How long one of the relay's own statements may run on PostgreSQL (`statement_timeout` on its
    /// sessions); a call to the database with no answer in twice this long (the database's host
    /// vanished) is given up and the relay reconnects. Operator commands (`failed`, `migrate`) are
    /// not limited. Default 30 s.
    pub statement_timeout: Duration,
    /// Where events come from: the outbox table, polled (the default), or PostgreSQL's
    /// write-ahead log through logical replication. Default [`Source::Table`].
    pub source: Source,
}

/// Where the relay reads events.
///
/// ```
/// use seaorm_outbox_relay::{RelayConfig, Source, wal::WalSource};
///
/// let mut config = RelayConfig::new("postgres://localhost/shop");
/// config.source = Source::Wal(WalSource::default());
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Source {
    /// Poll the outbox table, claim batches, mark or delete what was published. PostgreSQL and
    /// SQLite; any number of replicas share the work.
    #[default]
    Table,
    /// Read committed events from the WAL (PostgreSQL with `wal_level = logical`): rows inserted
    /// into the outbox table and table-less events, in commit order. One relay reads the slot;
    /// others wait as standbys. See [`crate::wal`].
    Wal(WalSource),
}

impl RelayConfig {
    /// Exponential backoff with jitter, from 100 ms up to [`max_backoff`](Self::max_backoff).
    pub(crate) fn backoff(&self) -> impl Iterator<Item = Duration> + Send + use<> {
        backoff(self.max_backoff)
    }

    /// The defaults, for the database at `database_url`.
    pub fn new(database_url: impl Into<String>) -> Self {
        RelayConfig {
            database_url: database_url.into(),
            batch_size: 500,
            max_batch_bytes: 16 << 20,
            max_payload_bytes: seaorm_outbox::DEFAULT_MAX_PAYLOAD_BYTES,
            poll_interval: Duration::from_millis(100),
            min_poll_interval: Duration::from_millis(1),
            mode: Mode::Mark,
            topic_template: DEFAULT_TOPIC_TEMPLATE.to_owned(),
            strict: false,
            cloudevents: None,
            wakeup: Wakeup::Poll,
            lease_refresh: Duration::from_secs(1),
            max_backoff: Duration::from_secs(30),
            skip_parked: false,
            tables: vec![seaorm_outbox::TableName::DEFAULT],
            tenants: crate::tenants::Tenants::None,
            tenants_reread: Duration::from_secs(5),
            retention: Some(Duration::from_secs(7 * 24 * 3600)),
            prune_interval: Duration::from_secs(60),
            metrics_interval: Duration::from_secs(5),
            ack_timeout: Duration::from_secs(120),
            statement_timeout: Duration::from_secs(30),
            source: Source::Table,
        }
    }
}

/// The URL's password is masked: a configuration may be logged.
impl std::fmt::Debug for RelayConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RelayConfig")
            .field("database_url", &redact_url(&self.database_url))
            .field("tables", &self.tables)
            .field("tenants", &self.tenants)
            .field("tenants_reread", &self.tenants_reread)
            .field("batch_size", &self.batch_size)
            .field("max_batch_bytes", &self.max_batch_bytes)
            .field("max_payload_bytes", &self.max_payload_bytes)
            .field("poll_interval", &self.poll_interval)
            .field("min_poll_interval", &self.min_poll_interval)
            .field("mode", &self.mode)
            .field("topic_template", &self.topic_template)
            .field("strict", &self.strict)
            .field("cloudevents", &self.cloudevents)
            .field("wakeup", &self.wakeup)
            .field("lease_refresh", &self.lease_refresh)
            .field("max_backoff", &self.max_backoff)
            .field("skip_parked", &self.skip_parked)
            .field("retention", &self.retention)
            .field("prune_interval", &self.prune_interval)
            .field("metrics_interval", &self.metrics_interval)
            .field("ack_timeout", &self.ack_timeout)
            .field("statement_timeout", &self.statement_timeout)
            .field("source", &self.source)
            .finish()
    }
}

/// The WAL source's default [`WalSource::window_bytes`].
const DEFAULT_WINDOW_BYTES: usize = 64 << 20;

/// Where the WAL source reads: a replication slot and the publication of the outbox table.
///
/// ```
/// use seaorm_outbox_relay::wal::WalSource;
///
/// let source = WalSource::default();
/// assert_eq!((source.slot.as_str(), source.publication.as_str()), ("outbox_relay", "outbox_relay"));
/// assert!(WalSource::new("orders_relay", "orders_outbox").is_ok());
/// assert!(WalSource::new("Bad-Name", "p").is_err());
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct WalSource {
    /// The logical replication slot, created with the `pgoutput` plugin if missing.
    pub slot: String,
    /// The publication of the outbox table's inserts, created if missing.
    pub publication: String,
    /// How many payload bytes the source reads ahead of what the broker confirmed; the stream
    /// pauses beyond it (and beyond 10,000 events), so a backlog of large events, or a broker
    /// away, holds the relay's memory to about this. Default 64 MiB.
    pub window_bytes: usize,
}

impl WalSource {
    /// A source with these names: lowercase letters, digits and `_`, as PostgreSQL requires of a
    /// slot name (and the relay of a publication name, which it writes into SQL).
    pub fn new(slot: impl Into<String>, publication: impl Into<String>) -> Result<Self, String> {
        let (slot, publication) = (slot.into(), publication.into());
        for (what, name) in [("slot", &slot), ("publication", &publication)] {
            let plain = !name.is_empty()
                && name.len() <= 63
                && name
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
            if !plain {
                return Err(format!(
                    "WAL {what} name `{name}`: use 1 to 63 lowercase letters, digits and _"
                ));
            }
        }
        Ok(WalSource {
            slot,
            publication,
            window_bytes: DEFAULT_WINDOW_BYTES,
        })
    }
}

impl Default for WalSource {
    fn default() -> Self {
        WalSource {
            slot: "outbox_relay".into(),
            publication: "outbox_relay".into(),
            window_bytes: DEFAULT_WINDOW_BYTES,
        }
    }
}

/// After publishing: mark rows published, or delete them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Set `published_at`; a pruning job deletes old rows later.
    #[default]
    Mark,
    /// Delete the row once the broker acked it.
    Delete,
}

/// How the relay learns that there may be new rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum Wakeup {
    /// Poll every `poll_interval` while idle.
    #[default]
    Poll,
    /// LISTEN on channel `outbox` (install the trigger with `outbox-relay migrate --notify-trigger`)
    /// and poll as a fallback.
    Notify,
}
