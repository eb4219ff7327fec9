//! The WAL source: the relay reads committed outbox events from PostgreSQL's write-ahead log
//! through logical replication (`pgoutput`), instead of polling the table. Read top to bottom.
//!
//! Events come in commit order, across all aggregates: rows inserted into the outbox table, and
//! events that `record` emitted as logical messages without any table row (table-less recording).
//! Each is handed to the sink at once, unless an earlier event of its aggregate is still unanswered:
//! then it waits for that answer (`unconfirmed.rs`). The answers are settled in stream order, and
//! the slot's position is confirmed at a transaction's commit once every event up to it was
//! acknowledged. The first transient failure ends the stream (what the sink still queues is
//! purged): it starts again from the last confirmed position, so nothing is lost and an
//! aggregate's events are sent again in order. A poison event is parked in
//! the outbox table (`outbox-relay failed`), and its aggregate's later events park behind it.
//! See `docs/design.md`, "The WAL source".

mod event;
mod pgoutput;
pub mod slot;
mod unconfirmed;

use crate::metrics;
use crate::outbox_table::{OutboxRow, postgres_options};
use crate::redact::redact_url;
use crate::relay::Relay;
use crate::sink::SinkError;
use pgoutput::{Change, Decoder};
use pgwire_replication::{Lsn, ReplicationClient, ReplicationConfig, ReplicationEvent, TlsConfig};
use sqlx::{Connection, PgConnection};
use std::collections::HashSet;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use unconfirmed::{Answer, Settled, Unconfirmed};

pub use slot::{Refused, SlotStatus};

/// The logical-message prefix of table-less events (`pg_logical_emit_message(true, 'outbox', …)`).
pub const MESSAGE_PREFIX: &str = seaorm_outbox::LOGICAL_MESSAGE_PREFIX;

/// How many events may wait for the broker's answer (or behind an unanswered one of their
/// aggregate) at once; the stream pauses beyond it.
const MAX_UNCONFIRMED: usize = 10_000;

/// How often a standby relay checks whether the slot's reader is gone.
pub const STANDBY_POLL: Duration = Duration::from_secs(1);

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
        Ok(WalSource { slot, publication })
    }
}

impl Default for WalSource {
    fn default() -> Self {
        WalSource {
            slot: "outbox_relay".into(),
            publication: "outbox_relay".into(),
        }
    }
}

/// Prepares the source (publication and slot), or says why it cannot run.
pub(crate) async fn check(url: &str, source: &WalSource) -> Result<(), String> {
    let mut db = connect(url).await.map_err(|e| format!("database: {e}"))?;
    match slot::prepare(&mut db, source).await {
        Ok(()) => Ok(()),
        Err(slot::Prepare::Refused(r)) => Err(r.0),
        Err(slot::Prepare::Database(e)) => Err(format!("database: {e}")),
    }
}

/// Drops the slot and the publication of `source` (`outbox-relay wal drop`); returns what it
/// dropped. PostgreSQL refuses while a relay reads the slot.
pub async fn drop_source(url: &str, source: &WalSource) -> Result<Vec<String>, sqlx::Error> {
    let mut db = connect(url).await?;
    slot::drop_source(&mut db, source).await
}

/// Why a stream ended.
#[derive(Debug, thiserror::Error)]
enum Stop {
    #[error("another relay reads replication slot {0}")]
    Standby(String),
    #[error(transparent)]
    Refused(#[from] Refused),
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    #[error("replication: {0}")]
    Replication(#[from] pgwire_replication::PgWireError),
    #[error("the replication stream: {0}")]
    Stream(String),
    #[error("the broker: {0}")]
    Sink(SinkError),
}

impl From<slot::Prepare> for Stop {
    fn from(e: slot::Prepare) -> Self {
        match e {
            slot::Prepare::Refused(r) => Stop::Refused(r),
            slot::Prepare::Database(e) => Stop::Database(e),
        }
    }
}

/// Runs the WAL source until `shutdown`, reconnecting after failures; a standby waits for the
/// slot.
pub(crate) async fn run(relay: &Relay, source: &WalSource, shutdown: &CancellationToken) {
    let mut backoff = relay.backoff();
    let mut waiting_as_standby = false;
    while !shutdown.is_cancelled() {
        let mut streaming = false;
        let delay = match stream(relay, source, shutdown, &mut streaming).await {
            Ok(()) => break,
            Err(Stop::Standby(slot)) => {
                if !waiting_as_standby {
                    tracing::info!(%slot, "standby: another relay reads the slot; taking over when it stops");
                }
                waiting_as_standby = true;
                STANDBY_POLL
            }
            Err(e) => {
                waiting_as_standby = false;
                if streaming {
                    backoff = relay.backoff();
                }
                if matches!(e, Stop::Database(_) | Stop::Replication(_)) {
                    metrics::database_error();
                }
                let delay = backoff.next().unwrap_or(relay.config.max_backoff);
                tracing::warn!(
                    error = %e, retry_in = ?delay, database = %redact_url(&relay.config.database_url),
                    "the WAL stream stopped; resuming from the slot's confirmed position"
                );
                delay
            }
        };
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            () = shutdown.cancelled() => break,
        }
    }
}

/// One replication session: prepare the slot, stream, hand each event to the sink, confirm
/// commits as their events are acknowledged. Sets `streaming` once the slot is held.
async fn stream(
    relay: &Relay,
    source: &WalSource,
    shutdown: &CancellationToken,
    streaming: &mut bool,
) -> Result<(), Stop> {
    let mut db = connect(&relay.config.database_url).await?;
    slot::prepare(&mut db, source).await?;
    if slot::status(&mut db, &source.slot)
        .await?
        .is_some_and(|s| s.active)
    {
        return Err(Stop::Standby(source.slot.clone()));
    }
    let mut parked = Parked::load(&mut db, relay.config.skip_parked).await?;
    let mut wal =
        ReplicationClient::connect(replication_config(&relay.config.database_url, source)?).await?;
    if let Err(e) = wal.wait_started().await {
        return Err(if e.to_string().contains("is active for PID") {
            Stop::Standby(source.slot.clone())
        } else {
            e.into()
        });
    }
    *streaming = true;
    tracing::info!(slot = %source.slot, "reading the WAL");
    let mut decoder = Decoder::default();
    let mut unconfirmed = Unconfirmed::new(relay.config.ack_timeout, !relay.config.skip_parked);
    let mut commit_ms = None;
    let mut confirmed = Lsn::ZERO;
    loop {
        // Everything settled at the front of the stream: parked, counted, or confirmed.
        if let Some(lsn) = settle_front(&mut db, &mut parked, &mut unconfirmed).await? {
            wal.update_applied_lsn(lsn);
            confirmed = lsn;
        }
        tokio::select! {
            biased;
            () = shutdown.cancelled() => break,
            answer = unconfirmed.next_answer() => {
                // The first transient failure stops the stream: nothing more is sent, and it
                // starts again from the confirmed position.
                let released = answer.map_err(|e| stop_sending(relay, e))?;
                send_released(relay, &mut unconfirmed, released).await?;
            }
            event = wal.recv(), if unconfirmed.events() < MAX_UNCONFIRMED => {
                let event = event?.ok_or_else(|| Stop::Stream("the server ended it".into()))?;
                let rows = match event {
                    ReplicationEvent::Begin { commit_time_micros, .. } => {
                        commit_ms = Some(postgres_epoch_ms(commit_time_micros));
                        Vec::new()
                    }
                    ReplicationEvent::XLogData { data, .. } => match decoder.decode(data).map_err(Stop::Stream)? {
                        Change::Insert { relation, values } => {
                            let relation = decoder.relation(relation).ok_or_else(|| {
                                Stop::Stream("an insert into a relation it did not describe".into())
                            })?;
                            let decoded = event::from_insert(relation, &values, relay.config.max_payload_bytes);
                            if decoded.parked { Vec::new() } else { vec![decoded.row] }
                        }
                        Change::Other => Vec::new(),
                    },
                    ReplicationEvent::Message { prefix, content, .. } if prefix == MESSAGE_PREFIX => {
                        event::from_message(&content, commit_ms, relay.config.max_payload_bytes)
                    }
                    ReplicationEvent::Commit { end_lsn, .. } => {
                        unconfirmed.commit(end_lsn, commit_ms);
                        Vec::new()
                    }
                    ReplicationEvent::KeepAlive { wal_end, .. } => {
                        // Nothing of ours is pending: let the slot move past other tables' WAL.
                        if unconfirmed.is_empty() && wal_end > confirmed {
                            wal.update_applied_lsn(wal_end);
                            confirmed = wal_end;
                            metrics::wal_confirmed(None);
                        }
                        Vec::new()
                    }
                    _ => Vec::new(),
                };
                for row in rows {
                    if parked.holds(&mut db, &row).await? {
                        park(&mut db, &row, &parked.reason(&row)).await?;
                        continue;
                    }
                    let message = match relay.router.message(&row) {
                        Ok(message) => message,
                        Err(reason) => {
                            park(&mut db, &row, &reason).await?;
                            parked.hold(&row);
                            continue;
                        }
                    };
                    // An aggregate with an event unanswered holds its later ones (ordering rule 4).
                    if !unconfirmed.may_send(&row) {
                        unconfirmed.hold(row, message);
                        continue;
                    }
                    let topic = message.topic.clone();
                    match relay.sink.enqueue(&message).await {
                        Ok(ack) => unconfirmed.sent(row, topic, ack),
                        Err(e) if e.is_permanent() => unconfirmed.refused(row, topic, e),
                        Err(e) => return Err(stop_sending(relay, e)),
                    }
                }
            }
        }
    }
    // Shutdown: everything handed to the sink is answered and confirmed before the stream stops.
    loop {
        if let Some(lsn) = settle_front(&mut db, &mut parked, &mut unconfirmed).await? {
            confirmed = lsn;
        }
        if unconfirmed.is_empty() {
            break;
        }
        let released = unconfirmed.next_answer().await;
        send_released(
            relay,
            &mut unconfirmed,
            released.map_err(|e| stop_sending(relay, e))?,
        )
        .await?;
    }
    let _ = wal.shutdown().await;
    // The stream may stop before its last status update reached the server: confirm it here.
    if confirmed > Lsn::ZERO {
        sqlx::query(
            "SELECT pg_replication_slot_advance(slot_name, $2::pg_lsn) FROM pg_replication_slots
             WHERE slot_name = $1 AND NOT active AND confirmed_flush_lsn < $2::pg_lsn",
        )
        .bind(&source.slot)
        .bind(confirmed.to_pg_string())
        .execute(&mut db)
        .await?;
    }
    Ok(())
}

/// Settles the entries at the front of the stream whose answers are in, in order; returns the
/// last commit position that may now be confirmed.
async fn settle_front(
    db: &mut PgConnection,
    parked: &mut Parked,
    unconfirmed: &mut Unconfirmed,
) -> Result<Option<Lsn>, Stop> {
    let mut confirm = None;
    while let Some(settled) = unconfirmed.pop_settled() {
        match settled {
            Settled::Commit { lsn, commit_ms } => {
                metrics::wal_confirmed(commit_ms);
                confirm = Some(lsn);
            }
            Settled::Event { row, topic, answer } => {
                settle(db, parked, &row, &topic, answer).await?;
            }
        }
    }
    Ok(confirm)
}

/// Hands the events an answer released to the sink, in order (ordering rule 4: they waited for
/// their aggregate's earlier events to be acknowledged).
async fn send_released(
    relay: &Relay,
    unconfirmed: &mut Unconfirmed,
    released: Vec<(u64, crate::sink::Message)>,
) -> Result<(), Stop> {
    for (position, message) in released {
        let sent = if unconfirmed.failed_at(position) {
            None
        } else {
            Some(relay.sink.enqueue(&message).await)
        };
        if let Some(Err(e)) = &sent
            && !e.is_permanent()
        {
            return Err(stop_sending(relay, e.clone()));
        }
        unconfirmed.released(position, sent);
    }
    Ok(())
}

/// The stream stops at a transient failure: what the sink still queues is dropped (it would be
/// sent again, after what the stream sends from the confirmed position).
fn stop_sending(relay: &Relay, error: SinkError) -> Stop {
    metrics::wal_failure("transient");
    relay.sink.purge();
    Stop::Sink(error)
}

/// Acts on what became of one event, in stream order: counted, or parked.
async fn settle(
    db: &mut PgConnection,
    parked: &mut Parked,
    row: &OutboxRow,
    topic: &str,
    answer: Answer,
) -> Result<(), Stop> {
    match answer {
        // Its aggregate had an event parked earlier in this stream: it waits behind it (if it was
        // delivered, it will be again, in order, when the parked event is retried).
        Answer::Held => park(db, row, &parked.reason(row)).await?,
        Answer::Sink(Ok(())) if parked.is_holding(row) => {
            park(db, row, &parked.reason(row)).await?
        }
        Answer::Sink(Ok(())) => metrics::published(topic, row.created_ms),
        Answer::Sink(Err(e)) => {
            // Only permanent failures are settled: a transient one stopped the stream.
            metrics::wal_failure("permanent");
            park(db, row, &e.message).await?;
            parked.hold(row);
        }
    }
    Ok(())
}

/// The aggregates whose events wait behind a parked one.
struct Parked {
    held: HashSet<(String, String)>,
    skip_parked: bool,
}

impl Parked {
    async fn load(db: &mut PgConnection, skip_parked: bool) -> Result<Self, sqlx::Error> {
        let held = if skip_parked {
            HashSet::new()
        } else {
            sqlx::query_as(
                "SELECT DISTINCT aggregate_type, aggregate_id FROM outbox
                 WHERE parked_at IS NOT NULL AND published_at IS NULL",
            )
            .fetch_all(db)
            .await?
            .into_iter()
            .collect()
        };
        Ok(Parked { held, skip_parked })
    }

    fn is_holding(&self, row: &OutboxRow) -> bool {
        self.held.contains(&aggregate(row))
    }

    /// Whether `row` must wait, asking the database when its aggregate was held: an operator may
    /// have retried or skipped the parked events since.
    async fn holds(&mut self, db: &mut PgConnection, row: &OutboxRow) -> Result<bool, sqlx::Error> {
        if !self.is_holding(row) {
            return Ok(false);
        }
        let still: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM outbox WHERE aggregate_type = $1 AND aggregate_id = $2
                            AND parked_at IS NOT NULL AND published_at IS NULL)",
        )
        .bind(&row.aggregate_type)
        .bind(&row.aggregate_id)
        .fetch_one(db)
        .await?;
        if !still {
            self.held.remove(&aggregate(row));
        }
        Ok(still)
    }

    fn hold(&mut self, row: &OutboxRow) {
        if !self.skip_parked {
            self.held.insert(aggregate(row));
        }
    }

    fn reason(&self, row: &OutboxRow) -> String {
        format!(
            "waiting behind a parked event of {} {}",
            row.aggregate_type, row.aggregate_id
        )
    }
}

fn aggregate(row: &OutboxRow) -> (String, String) {
    (row.aggregate_type.clone(), row.aggregate_id.clone())
}

/// Parks an event in the outbox table: the row itself when it is there, or a new row holding the
/// table-less event. Either way `outbox-relay failed` lists it; `failed retry` writes it again.
async fn park(db: &mut PgConnection, row: &OutboxRow, reason: &str) -> Result<(), sqlx::Error> {
    tracing::warn!(event_id = %row.id, aggregate_type = %row.aggregate_type, aggregate_id = %row.aggregate_id,
                   reason, "parked an event");
    let Ok(id) = uuid::Uuid::parse_str(&row.id) else {
        tracing::error!(event_id = %row.id, "an event whose id is not a UUID cannot be parked in the table; it is dropped");
        return Ok(());
    };
    let payload =
        (!row.payload.is_empty()).then(|| String::from_utf8_lossy(&row.payload).into_owned());
    sqlx::query(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, event_version, topic,
                             payload, headers, attempts, last_error, parked_at)
         VALUES ($1, $2, $3, $4, $5, $6, COALESCE($7::jsonb, 'null'::jsonb), $8::jsonb, 1, $9, now())
         ON CONFLICT (id) DO UPDATE SET parked_at = now(), last_error = EXCLUDED.last_error,
                                        attempts = outbox.attempts + 1
         -- A parked event read again (the stream replays from the confirmed position) keeps the
         -- reason it was parked for.
         WHERE outbox.parked_at IS NULL",
    )
    .bind(id)
    .bind(&row.aggregate_type)
    .bind(&row.aggregate_id)
    .bind(&row.event_type)
    .bind(row.event_version)
    .bind(&row.topic)
    .bind(payload)
    .bind(&row.headers)
    .bind(reason)
    .execute(db)
    .await?;
    Ok(())
}

async fn connect(url: &str) -> Result<PgConnection, sqlx::Error> {
    let (options, timeout) = postgres_options(url)?;
    tokio::time::timeout(timeout, PgConnection::connect_with(&options))
        .await
        .unwrap_or_else(|_| {
            Err(sqlx::Error::Io(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("the database did not answer within {timeout:?} (connect_timeout)"),
            )))
        })
}

/// The replication connection's settings, from the relay's PostgreSQL URL (host, port, user,
/// password, database, `sslmode`, `sslrootcert`, `sslcert`, `sslkey`).
fn replication_config(url: &str, source: &WalSource) -> Result<ReplicationConfig, Stop> {
    let (options, _) = postgres_options(url)?;
    let parsed = url::Url::parse(url).map_err(|e| Stop::Stream(format!("database URL: {e}")))?;
    let query = |name: &str| {
        parsed
            .query_pairs()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.into_owned())
    };
    let password = parsed.password().map(percent_decode).unwrap_or_default();
    let root = query("sslrootcert").map(std::path::PathBuf::from);
    let mut tls = match query("sslmode").as_deref() {
        Some("require") => TlsConfig::require(),
        Some("verify-ca") => TlsConfig::verify_ca(root),
        Some("verify-full") => TlsConfig::verify_full(root),
        _ => TlsConfig::disabled(),
    };
    if let (Some(cert), Some(key)) = (query("sslcert"), query("sslkey")) {
        tls = tls.with_client_cert(
            std::path::PathBuf::from(cert),
            std::path::PathBuf::from(key),
        );
    }
    let config = ReplicationConfig::new(
        options.get_host(),
        options.get_username(),
        password,
        options.get_database().unwrap_or(options.get_username()),
        &source.slot,
        source.publication.as_str(),
    )
    .with_port(options.get_port())
    .with_tls(tls)
    // Commit timestamps and `created_at` in one format whatever the server's defaults.
    .with_options("-c datestyle=ISO -c timezone=UTC")
    .with_application_name(format!("{}-wal", crate::outbox_table::APPLICATION_NAME))
    // A confirmed position reaches the server within a second: what a crash can send again.
    .with_status_interval(Duration::from_secs(1))
    .with_wakeup_interval(Duration::from_secs(1));
    Ok(config)
}

fn percent_decode(s: &str) -> String {
    url::form_urlencoded::parse(format!("p={}", s.replace('+', "%2B")).as_bytes())
        .next()
        .map(|(_, v)| v.into_owned())
        .unwrap_or_default()
}

/// PostgreSQL's timestamps count microseconds from 2000-01-01.
fn postgres_epoch_ms(micros: i64) -> i64 {
    const UNIX_TO_POSTGRES_MS: i64 = 946_684_800_000;
    micros / 1000 + UNIX_TO_POSTGRES_MS
}
