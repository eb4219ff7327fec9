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
//! aggregate's events are sent again in order. A poison event is parked in the outbox table
//! (`outbox-relay failed`), and its aggregate's later events are held there behind it until an
//! operator's retry or skip releases them, in order (`parked.rs`).
//! See `docs/design.md`, "The WAL source".

mod connection;
mod event;
mod parked;
mod pgoutput;
pub mod slot;
mod unconfirmed;

use crate::batch::Limits;
use crate::database::connect_postgres as connect;
use crate::error::SourceError;
use crate::metrics;
use crate::outlet::Outlet;
use crate::redact::redact_url;
use crate::row::OutboxRow;
use crate::sink::SinkError;
use connection::replication_config;
use parked::{Aggregate, Parked};
use pgoutput::{Change, Decoder};
use pgwire_replication::{Lsn, ReplicationClient, ReplicationEvent};
use sqlx::PgConnection;
use std::collections::HashSet;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use unconfirmed::{Answer, Settled, Unconfirmed};

pub use crate::config::WalSource;
pub(crate) use parked::RELEASE_PREFIX;
pub use slot::{Refused, SlotStatus};

/// How many events may wait for the broker's answer (or behind an unanswered one of their
/// aggregate) at once; the stream pauses beyond it.
const MAX_UNCONFIRMED: usize = 10_000;

/// How often a standby relay checks whether the slot's reader is gone.
pub const STANDBY_POLL: Duration = Duration::from_secs(1);

/// Prepares the source (publication and slot), or says why it cannot run.
pub(crate) async fn check(url: &str, source: &WalSource) -> Result<(), SourceError> {
    let mut db = connect(url).await?;
    match slot::prepare(&mut db, source).await {
        Ok(()) => Ok(()),
        Err(slot::Prepare::Refused(r)) => Err(SourceError::Refused(r.0)),
        Err(slot::Prepare::Database(e)) => Err(SourceError::Database(e)),
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
pub(crate) async fn run(outlet: &Outlet<'_>, source: &WalSource, shutdown: &CancellationToken) {
    let mut backoff = outlet.config.backoff();
    let mut waiting_as_standby = false;
    while !shutdown.is_cancelled() {
        let mut streaming = false;
        let delay = match stream(outlet, source, shutdown, &mut streaming).await {
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
                // Nothing is in flight now: the moment a sink may replace its producer.
                if outlet.sink.wants_quiet() {
                    outlet.sink.quiet().await;
                }
                if streaming {
                    backoff = outlet.config.backoff();
                }
                if matches!(e, Stop::Database(_) | Stop::Replication(_)) {
                    metrics::database_error();
                }
                let delay = backoff.next().unwrap_or(outlet.config.max_backoff);
                tracing::warn!(
                    error = %e, retry_in = ?delay, database = %redact_url(&outlet.config.database_url),
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
    outlet: &Outlet<'_>,
    source: &WalSource,
    shutdown: &CancellationToken,
    streaming: &mut bool,
) -> Result<(), Stop> {
    let mut db = connect(&outlet.config.database_url).await?;
    slot::prepare(&mut db, source).await?;
    if slot::status(&mut db, &source.slot)
        .await?
        .is_some_and(|s| s.active)
    {
        return Err(Stop::Standby(source.slot.clone()));
    }
    let mut parked = Parked::load(&mut db, outlet.config.skip_parked).await?;
    let mut wal =
        ReplicationClient::connect(replication_config(&outlet.config.database_url, source)?)
            .await?;
    if let Err(e) = wal.wait_started().await {
        return Err(if e.to_string().contains("is active for PID") {
            Stop::Standby(source.slot.clone())
        } else {
            e.into()
        });
    }
    *streaming = true;
    tracing::info!(slot = %source.slot, "reading the WAL");
    // What a release left held and no longer behind a parked event (the relay stopped during it)
    // goes out first.
    if !outlet.config.skip_parked {
        let held = parked::held_aggregates(&mut db).await?;
        release(outlet, &mut db, &mut parked, held).await?;
    }
    let mut decoder = Decoder::default();
    let mut unconfirmed = Unconfirmed::new(outlet.config.ack_timeout, !outlet.config.skip_parked);
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
                let released = answer.map_err(|e| stop_sending(outlet, e))?;
                send_released(outlet, &mut unconfirmed, released).await?;
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
                            let decoded = event::from_insert(relation, &values, outlet.config.max_payload_bytes);
                            if decoded.parked { Vec::new() } else { vec![decoded.row] }
                        }
                        Change::Other => Vec::new(),
                    },
                    ReplicationEvent::Message { prefix, content, lsn, .. } if prefix == seaorm_outbox::LOGICAL_MESSAGE_PREFIX => {
                        event::from_message(&content, lsn, commit_ms, outlet.config.max_payload_bytes)
                    }
                    ReplicationEvent::Message { prefix, content, .. } if prefix == RELEASE_PREFIX => {
                        // Everything read before the release settles first, so the table shows
                        // each aggregate's parked and held events as they are.
                        if let Some(lsn) = drain(outlet, &mut db, &mut parked, &mut unconfirmed).await? {
                            wal.update_applied_lsn(lsn);
                            confirmed = lsn;
                        }
                        release(outlet, &mut db, &mut parked, parked::released_aggregates(&content)).await?;
                        Vec::new()
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
                    if parked.is_holding(&row) {
                        unconfirmed.held_back(row);
                    } else {
                        offer(outlet, &mut unconfirmed, row).await?;
                    }
                }
            }
        }
    }
    // Shutdown: everything handed to the sink is answered and confirmed before the stream stops.
    if let Some(lsn) = drain(outlet, &mut db, &mut parked, &mut unconfirmed).await? {
        confirmed = lsn;
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
        confirm = settle_entry(db, parked, settled).await?.or(confirm);
    }
    Ok(confirm)
}

/// Acts on one settled entry of the stream: a commit's position may be confirmed (returned), an
/// event is settled.
async fn settle_entry(
    db: &mut PgConnection,
    parked: &mut Parked,
    settled: Settled,
) -> Result<Option<Lsn>, Stop> {
    match settled {
        Settled::Commit { lsn, commit_ms } => {
            metrics::wal_confirmed(commit_ms);
            Ok(Some(lsn))
        }
        Settled::Event { row, topic, answer } => {
            settle(db, parked, &row, &topic, answer).await?;
            Ok(None)
        }
    }
}

/// Waits for every answer and settles everything read; returns the last commit position that may
/// now be confirmed.
async fn drain(
    outlet: &Outlet<'_>,
    db: &mut PgConnection,
    parked: &mut Parked,
    unconfirmed: &mut Unconfirmed,
) -> Result<Option<Lsn>, Stop> {
    let mut confirm = None;
    while let Some(settled) = next_settled(outlet, unconfirmed).await? {
        confirm = settle_entry(db, parked, settled).await?.or(confirm);
    }
    Ok(confirm)
}

/// The next entry of `unconfirmed` to settle, in stream order, once its answer is in (sending what
/// each answer meanwhile releases); `None` once nothing is left.
async fn next_settled(
    outlet: &Outlet<'_>,
    unconfirmed: &mut Unconfirmed,
) -> Result<Option<Settled>, Stop> {
    loop {
        if let Some(settled) = unconfirmed.pop_settled() {
            return Ok(Some(settled));
        }
        if unconfirmed.is_empty() {
            return Ok(None);
        }
        let released = unconfirmed
            .next_answer()
            .await
            .map_err(|e| stop_sending(outlet, e))?;
        send_released(outlet, unconfirmed, released).await?;
    }
}

/// Hands one event to the sink, unless its aggregate has an earlier event unanswered (then it
/// waits for it, ordering rule 4) or it cannot be published as it is (then it is refused for good).
async fn offer(
    outlet: &Outlet<'_>,
    unconfirmed: &mut Unconfirmed,
    row: OutboxRow,
) -> Result<(), Stop> {
    let message = match outlet.router.message(&row) {
        Ok(message) => message,
        Err(reason) => {
            unconfirmed.refused(row, String::new(), SinkError::permanent(reason));
            return Ok(());
        }
    };
    if !unconfirmed.may_send(&row) {
        unconfirmed.hold(row, message);
        return Ok(());
    }
    let topic = message.topic.clone();
    match outlet.sink.enqueue(&message).await {
        Ok(ack) => unconfirmed.sent(row, topic, ack),
        Err(e) if e.is_permanent() => unconfirmed.refused(row, topic, e),
        Err(e) => return Err(stop_sending(outlet, e)),
    }
    Ok(())
}

/// Releases the held events of `aggregates` in `seq` order, each aggregate up to its first parked
/// event: they go out as stream events do (ordering rule 4 included). Acknowledged ones are marked
/// published; one that fails for good is parked again, and its aggregate stays held.
async fn release(
    outlet: &Outlet<'_>,
    db: &mut PgConnection,
    parked: &mut Parked,
    aggregates: Vec<Aggregate>,
) -> Result<(), Stop> {
    if aggregates.is_empty() {
        return Ok(());
    }
    let limits = Limits {
        batch_size: parked::PAGE as usize,
        max_batch_bytes: usize::MAX,
        max_payload_bytes: outlet.config.max_payload_bytes,
    };
    let mut still_held: HashSet<Aggregate> = HashSet::new();
    let mut after_seq = i64::MIN;
    loop {
        let page = parked::page(db, &aggregates, after_seq, &limits).await?;
        let Some(last) = page.last() else { break };
        after_seq = last.row.seq;
        let more = page.len() as i64 == parked::PAGE;
        let mut released = Unconfirmed::new(outlet.config.ack_timeout, true);
        for kept in page {
            let key = parked::aggregate(&kept.row);
            if kept.parked {
                still_held.insert(key);
            } else if !still_held.contains(&key) {
                offer(outlet, &mut released, kept.row).await?;
            }
        }
        while let Some(settled) = next_settled(outlet, &mut released).await? {
            let Settled::Event { row, topic, answer } = settled else {
                continue;
            };
            match answer {
                Answer::Sink(Ok(())) => {
                    parked::published(db, row.seq).await?;
                    metrics::published(&topic, row.created_ms);
                }
                Answer::Sink(Err(e)) => {
                    metrics::wal_failure("permanent");
                    parked::parked_again(db, row.seq, &e.message).await?;
                    still_held.insert(parked::aggregate(&row));
                }
                Answer::Held => {
                    still_held.insert(parked::aggregate(&row));
                }
            }
        }
        if !more {
            break;
        }
    }
    tracing::info!(
        aggregates = aggregates.len(),
        still_held = still_held.len(),
        "released held events"
    );
    for aggregate in aggregates {
        let held = still_held.contains(&aggregate);
        parked.released(aggregate, held);
    }
    Ok(())
}

/// Hands the events an answer released to the sink, in order (ordering rule 4: they waited for
/// their aggregate's earlier events to be acknowledged).
async fn send_released(
    outlet: &Outlet<'_>,
    unconfirmed: &mut Unconfirmed,
    released: Vec<(u64, crate::sink::Message)>,
) -> Result<(), Stop> {
    for (position, message) in released {
        let sent = if unconfirmed.failed_at(position) {
            None
        } else {
            Some(outlet.sink.enqueue(&message).await)
        };
        if let Some(Err(e)) = &sent
            && !e.is_permanent()
        {
            return Err(stop_sending(outlet, e.clone()));
        }
        unconfirmed.released(position, sent);
    }
    Ok(())
}

/// The stream stops at a transient failure: what the sink still queues is dropped (it would be
/// sent again, after what the stream sends from the confirmed position).
fn stop_sending(outlet: &Outlet<'_>, error: SinkError) -> Stop {
    metrics::wal_failure("transient");
    outlet.sink.purge();
    Stop::Sink(error)
}

/// Acts on what became of one event, in stream order: counted, parked, or held.
async fn settle(
    db: &mut PgConnection,
    parked: &mut Parked,
    row: &OutboxRow,
    topic: &str,
    answer: Answer,
) -> Result<(), Stop> {
    match answer {
        // Its aggregate has a parked event: it waits behind it (if it was delivered, it will be
        // again, in order, when the parked event is released).
        Answer::Held => parked::keep(db, row, None).await?,
        Answer::Sink(Ok(())) if parked.is_holding(row) => parked::keep(db, row, None).await?,
        Answer::Sink(Ok(())) => metrics::published(topic, row.created_ms),
        Answer::Sink(Err(e)) => {
            // Only permanent failures are settled: a transient one stopped the stream.
            metrics::wal_failure("permanent");
            parked::keep(db, row, Some(&e.message)).await?;
            parked.hold(row);
        }
    }
    Ok(())
}

/// PostgreSQL's timestamps count microseconds from 2000-01-01.
fn postgres_epoch_ms(micros: i64) -> i64 {
    const UNIX_TO_POSTGRES_MS: i64 = 946_684_800_000;
    micros / 1000 + UNIX_TO_POSTGRES_MS
}
