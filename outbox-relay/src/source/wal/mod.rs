//! The WAL source: the relay reads committed outbox events from PostgreSQL's write-ahead log
//! through logical replication (`pgoutput`), instead of polling the table. Read top to bottom.
//!
//! Events come in commit order, across all aggregates: rows inserted into the outbox table, and
//! events that `record` emitted as logical messages without any table row (table-less recording).
//! The pump drives this source as it drives the table: a claim takes the oldest unsettled events
//! read (`unconfirmed.rs` keeps them, as the table keeps its rows), the same ordering rules decide
//! what is sent, and settling marks each event published, parked or failed (tried again after its
//! backoff). The slot's position is confirmed at a transaction's commit once every event before
//! it is settled, so after a crash the stream resumes from there and nothing is lost. A parked
//! event is kept in the outbox table (`outbox-relay failed`), and its aggregate's later events are
//! held there behind it until an operator's retry or skip releases them, in order (`parked.rs`).
//! See `docs/design.md`, "The WAL source".

mod backlog;
mod connection;
mod event;
mod parked;
mod pgoutput;
pub(crate) mod publication;
mod release;
pub mod slot;
mod switch;
mod unconfirmed;
mod unread;

use crate::batch::{Claim, Limits, Outcome};
use crate::config::RelayConfig;
use crate::database::connect_postgres as connect;
use crate::error::SourceError;
use crate::metrics;
use crate::source::interface::Source;
use backlog::BacklogSnapshot;
use connection::replication_config;
use futures::FutureExt;
use parked::Parked;
use pgoutput::{Change, Decoder};
use pgwire_replication::{Lsn, PgWireError, ReplicationClient, ReplicationEvent};
use release::Release;
use sqlx::PgConnection;
use std::collections::HashSet;
use std::time::Duration;
use tokio::time::Instant;
use unconfirmed::Unconfirmed;

pub use crate::config::WalSource;
pub(crate) use parked::RELEASE_PREFIX;
pub use slot::{Refused, SlotStatus};
pub use switch::{ToPolling, from_polling, to_polling};

/// How many events (and commits) read and not yet confirmed the source keeps; the stream pauses
/// beyond it, or beyond `WalSource::window_bytes` of payload.
const MAX_UNCONFIRMED: usize = 10_000;

/// How long the stream may bring nothing before a claim checks, over the plain connection, that
/// the server still streams to this relay. An idle stream is silent (the server sends keepalives
/// only to a client that stops answering), and a vanished database host leaves it silent for
/// good: the check, bounded by the call limit as every claim, finds that out and the relay
/// reconnects.
const SILENCE: Duration = Duration::from_secs(10);

/// How often a standby relay checks whether the slot's reader is gone.
pub const STANDBY_POLL: Duration = Duration::from_secs(1);

/// Prepares the source (publication and slot), or says why it cannot run.
pub(crate) async fn check(url: &str, source: &WalSource) -> Result<(), SourceError> {
    let mut db = connect(url).await?;
    match slot::prepare(&mut db, source).await {
        Ok(_) => Ok(()),
        Err(slot::Prepare::Refused(r)) => Err(SourceError::Refused(r.0)),
        Err(slot::Prepare::Database(e)) => Err(SourceError::Database(e)),
    }
}

/// Drops the slot and the publication of `source` (`outbox-relay wal drop`); returns what it
/// dropped. Refused ([`SourceError::Refused`]) while the slot holds events no relay has read yet,
/// which would be lost, unless `force`. PostgreSQL refuses while a relay reads the slot.
pub async fn drop_source(
    url: &str,
    source: &WalSource,
    force: bool,
) -> Result<Vec<String>, SourceError> {
    let mut db = connect(url).await?;
    slot::drop_source(&mut db, source, force).await
}

/// The snapshot the table's backlog was held in for the slot, if its mark names one the
/// server's transaction ids have not gone too far past to tell.
async fn backlog_snapshot(
    db: &mut PgConnection,
    source: &WalSource,
) -> Result<Option<BacklogSnapshot>, SourceError> {
    let Some((publication, _)) = publication::publication_of(db, &source.publication).await? else {
        return Ok(None);
    };
    let Some(snapshot) = publication
        .backlog
        .as_deref()
        .and_then(BacklogSnapshot::parse)
    else {
        return Ok(None);
    };
    let next_xid = backlog::next_xid(db).await?;
    Ok(snapshot.reaches(next_xid).then_some(snapshot))
}

impl From<PgWireError> for SourceError {
    fn from(e: PgWireError) -> Self {
        SourceError::Replication(e.to_string())
    }
}

impl From<slot::Prepare> for SourceError {
    fn from(e: slot::Prepare) -> Self {
        match e {
            slot::Prepare::Refused(r) => SourceError::Refused(r.0),
            slot::Prepare::Database(e) => SourceError::Database(e),
        }
    }
}

/// One replication session of the WAL source: the slot's stream, what was read of it and not yet
/// confirmed, and a plain connection that keeps parked and held events in the table.
pub(crate) struct WalStream {
    db: PgConnection,
    wal: ReplicationClient,
    slot: String,
    decoder: Decoder,
    /// This schema's outbox table: a publication of several tables (`FOR ALL TABLES`, say)
    /// streams others' inserts too, which are not events.
    outbox: u32,
    read: Unconfirmed,
    parked: Parked,
    /// The commit time of the transaction being read.
    commit_ms: Option<i64>,
    /// The id of the transaction being read.
    xid: u32,
    /// The snapshot the table's backlog was held in, while the stream may still bring
    /// transactions it sees; and whether it sees the one being read (its rows went out from the
    /// table, held with the backlog, so the stream leaves them out).
    backlog: Option<BacklogSnapshot>,
    in_backlog: bool,
    /// The last position confirmed to the server.
    confirmed: Lsn,
    max_payload_bytes: usize,
    /// The window's bound in payload bytes (`WalSource::window_bytes`).
    window_bytes: usize,
    /// Something was read or settled since the last claim: the next one may find events.
    fresh: bool,
    /// Why the stream stopped while the pump waited (reported by the next claim).
    failure: Option<SourceError>,
    /// When the first event backing off may be claimed again.
    next_retry: Option<Instant>,
    /// The server process streaming to this relay, and when the stream last brought anything:
    /// after [`SILENCE`] of nothing, the next claim asks the database whether it still streams.
    walsender_pid: Option<i32>,
    heard_at: Instant,
}

impl WalStream {
    /// Prepares the slot and starts reading it; a standby (the slot is read by another relay)
    /// is told by [`SourceError::Standby`].
    pub async fn open(config: &RelayConfig, source: &WalSource) -> Result<Self, SourceError> {
        let url = &config.database_url;
        let mut db = connect(url).await?;
        crate::database::limit_statements(&mut db, config.statement_timeout).await?;
        slot::prepare(&mut db, source).await?;
        let standby = || SourceError::Standby(format!("from replication slot {}", source.slot));
        if slot::status(&mut db, &source.slot)
            .await?
            .is_some_and(|s| s.active)
        {
            return Err(standby());
        }
        let parked = Parked::load(&mut db, config.skip_parked).await?;
        let outbox: sqlx::postgres::types::Oid =
            sqlx::query_scalar("SELECT 'outbox'::regclass::oid")
                .fetch_one(&mut db)
                .await?;
        let replication = replication_config(url, source, config.max_payload_bytes)?;
        let mut wal = ReplicationClient::connect(replication).await?;
        if let Err(e) = wal.wait_started().await {
            return Err(if e.to_string().contains("is active for PID") {
                standby()
            } else {
                e.into()
            });
        }
        sqlx::query(slot::LOCK_AS_READER)
            .bind(&source.slot)
            .execute(&mut db)
            .await?;
        let walsender_pid: Option<i32> =
            sqlx::query_scalar("SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1")
                .bind(&source.slot)
                .fetch_optional(&mut db)
                .await?
                .flatten();
        let backlog = backlog_snapshot(&mut db, source).await?;
        let mut read = Unconfirmed::default();
        // What the table holds and is no longer behind a parked event goes out first: what a
        // release left held (the relay stopped during it), and what the table had before the slot.
        if let Some(up_to_seq) = parked::last_held_seq(&mut db).await? {
            read.release_first(Release::every_held(up_to_seq));
        }
        tracing::info!(slot = %source.slot, "reading the WAL");
        Ok(WalStream {
            db,
            wal,
            slot: source.slot.clone(),
            decoder: Decoder::default(),
            outbox: outbox.0,
            read,
            parked,
            commit_ms: None,
            xid: 0,
            backlog,
            in_backlog: false,
            confirmed: Lsn::ZERO,
            max_payload_bytes: config.max_payload_bytes,
            window_bytes: source.window_bytes,
            fresh: true,
            failure: None,
            next_retry: None,
            walsender_pid,
            heard_at: Instant::now(),
        })
    }

    /// Takes in one replication event.
    fn take(&mut self, event: ReplicationEvent) -> Result<(), SourceError> {
        let stream = SourceError::Replication;
        match event {
            ReplicationEvent::Begin {
                commit_time_micros,
                xid,
                ..
            } => {
                self.commit_ms = Some(postgres_epoch_ms(commit_time_micros));
                self.xid = xid;
                self.in_backlog = self.backlog.as_ref().is_some_and(|b| b.sees(xid));
                if !self.in_backlog {
                    // Commit order: no later transaction is seen either.
                    self.backlog = None;
                }
            }
            ReplicationEvent::XLogData { data, .. } => {
                if let Change::Insert { relation, values } =
                    self.decoder.decode(data).map_err(stream)?
                    && relation == self.outbox
                {
                    let relation = self.decoder.relation(relation).ok_or_else(|| {
                        stream("an insert into a relation it did not describe".into())
                    })?;
                    let decoded = event::from_insert(relation, &values, self.max_payload_bytes);
                    // The source's own inserts (a table-less event parked or held) are not
                    // events; nor is a row held with the backlog (it went out from the table).
                    if !decoded.parked && !self.in_backlog {
                        self.read.push_event(decoded.row, None);
                    }
                }
            }
            ReplicationEvent::Message {
                prefix,
                content,
                lsn,
                ..
            } => {
                if prefix == seaorm_outbox::LOGICAL_MESSAGE_PREFIX {
                    let rows =
                        event::from_message(&content, lsn, self.commit_ms, self.max_payload_bytes);
                    for row in rows {
                        self.read.push_event(row, None);
                    }
                } else if prefix == RELEASE_PREFIX {
                    let aggregates = parked::released_aggregates(&content);
                    self.read.push_release(Release::of(aggregates, self.xid));
                }
            }
            ReplicationEvent::Commit { end_lsn, .. } => {
                self.read.push_commit(end_lsn, self.commit_ms);
            }
            ReplicationEvent::KeepAlive { wal_end, .. } => {
                // Nothing of ours is pending: let the slot move past other tables' WAL.
                if self.read.is_empty() && wal_end > self.confirmed {
                    self.confirm_to(wal_end, None);
                }
                return Ok(());
            }
            _ => return Ok(()),
        }
        self.fresh = true;
        Ok(())
    }

    /// Whether the events read and not yet confirmed fill the window (their count, or their
    /// payload bytes): the stream pauses then.
    fn window_full(&self) -> bool {
        self.read.len() >= MAX_UNCONFIRMED || self.read.bytes() >= self.window_bytes
    }

    /// Takes in what the stream has at hand, up to a full window. The replication client's
    /// queue is short (large events must not pile up there), so between draining it this lets
    /// the client refill it from what it has received, until nothing more comes at once.
    async fn read_available(&mut self) -> Result<(), SourceError> {
        loop {
            let before = self.read.len();
            self.read_ready()?;
            if self.read.len() == before || self.window_full() {
                return Ok(());
            }
            tokio::task::yield_now().await;
        }
    }

    /// Takes in what the client's queue holds, without waiting, up to a full window.
    fn read_ready(&mut self) -> Result<(), SourceError> {
        let mut heard = false;
        while !self.window_full() {
            // Unconstrained: tokio's cooperative budget would end the loop after 128 events
            // even with more ready, and batches would never fill.
            match tokio::task::unconstrained(self.wal.recv()).now_or_never() {
                None => break,
                Some(Ok(Some(event))) => {
                    heard = true;
                    self.take(event)?;
                }
                Some(Ok(None)) => {
                    return Err(SourceError::Replication(
                        "the server ended the stream".into(),
                    ));
                }
                Some(Err(e)) => return Err(e.into()),
            }
        }
        // Once per read, not per event: the clock stays off the per-event path.
        if heard {
            self.heard_at = Instant::now();
        }
        Ok(())
    }

    /// Whether the server still streams to this relay: its process still reads the slot (the
    /// claim's call limit bounds the wait for the answer).
    async fn still_streaming(&mut self) -> Result<(), SourceError> {
        let reader: Option<Option<i32>> =
            sqlx::query_scalar("SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1")
                .bind(&self.slot)
                .fetch_optional(&mut self.db)
                .await?;
        match reader.flatten() {
            Some(pid) if self.walsender_pid.is_none_or(|ours| ours == pid) => {
                self.walsender_pid = Some(pid);
                Ok(())
            }
            _ => Err(SourceError::Replication(
                "the stream went silent and the server no longer streams to this relay".into(),
            )),
        }
    }

    fn confirm_to(&mut self, lsn: Lsn, commit_ms: Option<i64>) {
        self.wal.update_applied_lsn(lsn);
        self.confirmed = lsn;
        metrics::wal_confirmed(commit_ms);
    }

    /// Confirms what is settled at the front of the stream, and carries out the releases that
    /// come due there.
    async fn confirm(&mut self) -> Result<(), SourceError> {
        loop {
            if let Some((lsn, commit_ms)) = self.read.confirm() {
                self.confirm_to(lsn, commit_ms);
            }
            let Some(release) = self.read.take_due_release() else {
                return Ok(());
            };
            self.release(release).await?;
            self.fresh = true;
        }
    }
}

impl Source for WalStream {
    /// The oldest unsettled events read, in stream order, skipping those in flight, those backing
    /// off (and their aggregates' later ones), and holding in the table those behind a parked
    /// event.
    async fn claim(&mut self, limits: &Limits, in_flight: &[i64]) -> Result<Claim, SourceError> {
        if let Some(e) = self.failure.take() {
            return Err(e);
        }
        self.read_available().await?;
        if self.heard_at.elapsed() >= SILENCE {
            self.still_streaming().await?;
            self.heard_at = Instant::now();
        }
        self.fresh = false;
        self.confirm().await?;
        let in_flight: HashSet<i64> = in_flight.iter().copied().collect();
        let now = Instant::now();
        let mut backing_off = HashSet::new();
        let mut to_hold = Vec::new();
        let (mut rows, mut bytes, mut full) = (Vec::new(), 0usize, false);
        self.next_retry = None;
        for event in self.read.claimable() {
            let row = &event.row;
            if in_flight.contains(&row.position) {
                continue;
            }
            if self.parked.is_holding(row, event.kept_seq.is_some()) {
                to_hold.push(row.position);
                continue;
            }
            if !backing_off.is_empty() && backing_off.contains(&row.aggregate()) {
                continue;
            }
            if let Some(at) = event.retry_at.filter(|at| *at > now) {
                backing_off.insert(row.aggregate());
                self.next_retry = Some(self.next_retry.map_or(at, |next| next.min(at)));
                continue;
            }
            let size = row.payload.len() + row.headers.as_ref().map_or(0, String::len);
            if rows.len() == limits.batch_size
                || (!rows.is_empty() && bytes + size > limits.max_batch_bytes)
            {
                full = true;
                break;
            }
            bytes += size;
            rows.push(row.clone());
        }
        for position in to_hold {
            let Some(event) = self.read.event_mut(position) else {
                continue;
            };
            // One released from the table is held there already.
            if event.kept_seq.is_none() {
                parked::keep(&mut self.db, &event.row, None).await?;
            }
            event.settled = true;
        }
        self.confirm().await?;
        Ok(Claim { rows, full })
    }

    /// Published events are done; a parked one is kept in the table (holding its aggregate's later
    /// events), a failed one is claimed again after its backoff.
    async fn settle(&mut self, outcome: &Outcome) -> Result<(), SourceError> {
        for key in &outcome.published {
            let Some(event) = self.read.event_mut(key.position) else {
                continue;
            };
            if let Some(seq) = event.kept_seq {
                parked::published(&mut self.db, seq).await?;
            }
            event.settled = true;
        }
        for (key, reason) in &outcome.parked {
            let Some(event) = self.read.event_mut(key.position) else {
                continue;
            };
            match event.kept_seq {
                Some(seq) => parked::parked_again(&mut self.db, seq, reason).await?,
                None => parked::keep(&mut self.db, &event.row, Some(reason)).await?,
            }
            event.settled = true;
            self.parked.hold(&event.row, event.kept_seq.is_some());
        }
        let now = Instant::now();
        for (key, _, retry_in) in &outcome.failed {
            let Some(event) = self.read.event_mut(key.position) else {
                continue;
            };
            event.row.attempts += 1;
            event.retry_at = Some(now + *retry_in);
        }
        self.fresh = true;
        self.confirm().await
    }

    /// Resolves once the stream brings something, or at once if the last claim may have missed
    /// events (something was read or settled since).
    async fn new_events(&mut self) {
        if self.fresh || self.failure.is_some() {
            return;
        }
        if self.window_full() {
            return std::future::pending().await;
        }
        let taken = match self.wal.recv().await {
            Ok(Some(event)) => {
                self.heard_at = Instant::now();
                self.take(event)
            }
            Ok(None) => Err(SourceError::Replication(
                "the server ended the stream".into(),
            )),
            Err(e) => Err(e.into()),
        };
        if let Err(e) = taken {
            self.failure = Some(e);
        }
    }

    /// `until`, or when the first event backing off may go again.
    fn wake_at(&self, until: Instant) -> Instant {
        self.next_retry.map_or(until, |at| at.min(until))
    }

    /// Confirms what is settled and stops the stream.
    async fn leave(mut self) -> Result<(), SourceError> {
        if let Some((lsn, commit_ms)) = self.read.confirm() {
            self.confirm_to(lsn, commit_ms);
        }
        let _ = self.wal.shutdown().await;
        // Our walsender may outlive the stream for a moment, and the slot cannot be advanced while
        // it holds it: wait (briefly) until it let go.
        for _ in 0..100 {
            let ours: Option<bool> = sqlx::query_scalar(
                "SELECT active_pid IS NOT DISTINCT FROM $2 AND active FROM pg_replication_slots
                 WHERE slot_name = $1",
            )
            .bind(&self.slot)
            .bind(self.walsender_pid)
            .fetch_optional(&mut self.db)
            .await?;
            if ours != Some(true) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // The stream may stop before its last status update reached the server: confirm it here.
        if self.confirmed > Lsn::ZERO {
            sqlx::query(
                "SELECT pg_replication_slot_advance(slot_name, $2::pg_lsn) FROM pg_replication_slots
                 WHERE slot_name = $1 AND NOT active AND confirmed_flush_lsn < $2::pg_lsn",
            )
            .bind(&self.slot)
            .bind(self.confirmed.to_pg_string())
            .execute(&mut self.db)
            .await?;
        }
        sqlx::query(slot::UNLOCK_AS_READER)
            .bind(&self.slot)
            .execute(&mut self.db)
            .await?;
        tracing::info!(slot = %self.slot, "stopped reading the WAL");
        Ok(())
    }
}

/// PostgreSQL's timestamps count microseconds from 2000-01-01.
fn postgres_epoch_ms(micros: i64) -> i64 {
    const UNIX_TO_POSTGRES_MS: i64 = 946_684_800_000;
    micros / 1000 + UNIX_TO_POSTGRES_MS
}
