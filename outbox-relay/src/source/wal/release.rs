//! Releases of held events: the WAL source reads an aggregate's events held in the table back
//! into the stream, in `seq` order up to its first parked event, before anything read after the
//! release. An operator's `failed retry` or `failed skip` releases the aggregates it names (a
//! [`RELEASE_PREFIX`](super::RELEASE_PREFIX) message in its transaction); the relay's start
//! releases every held event, which is how it sends what an interrupted release left held and
//! what the table had before the slot was made.

use super::WalStream;
use super::event::from_recorded;
use crate::batch::Limits;
use crate::error::SourceError;
use crate::row::{Aggregate, OutboxRow};
use bytes::Bytes;
use sqlx::PgConnection;
use std::collections::HashSet;
use std::time::Duration;

/// Whose held events a release sends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Scope {
    /// The aggregates an operator's release names.
    Named(Vec<Aggregate>),
    /// Every held event up to this `seq` (the relay's start): the aggregates are found as the
    /// pages are read.
    EveryHeld { up_to_seq: i64 },
}

/// A release, carried out once everything read before it is settled, a page at a time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Release {
    pub scope: Scope,
    /// The page read next starts after this `seq`.
    pub after_seq: i64,
    /// Aggregates whose release stopped at a parked event: still held.
    pub stopped: HashSet<Aggregate>,
    /// The aggregates a release of [`Scope::EveryHeld`] found.
    pub found: HashSet<Aggregate>,
    /// The transaction that wrote an operator's release: its first page is read once other
    /// sessions see that transaction's changes.
    pub written_by: Option<u32>,
}

impl Release {
    /// A release of the named aggregates, written by transaction `xid`.
    pub fn of(aggregates: Vec<Aggregate>, xid: u32) -> Self {
        Release {
            written_by: Some(xid),
            ..Release::new(Scope::Named(aggregates))
        }
    }

    /// A release of every event held up to `up_to_seq`.
    pub fn every_held(up_to_seq: i64) -> Self {
        Release::new(Scope::EveryHeld { up_to_seq })
    }

    fn new(scope: Scope) -> Self {
        Release {
            scope,
            after_seq: i64::MIN,
            stopped: HashSet::new(),
            found: HashSet::new(),
            written_by: None,
        }
    }

    /// Whether this is a release's first page.
    pub fn starting(&self) -> bool {
        self.after_seq == i64::MIN
    }
}

impl WalStream {
    /// Reads the next page of a release's held events into the stream, each aggregate up to its
    /// first parked event; they go out in `seq` order before anything read after the release.
    pub(super) async fn release(&mut self, mut release: Release) -> Result<(), SourceError> {
        if release.starting()
            && let Scope::Named(aggregates) = &release.scope
        {
            for aggregate in aggregates {
                self.parked.releasing(aggregate);
            }
            if let Some(xid) = release.written_by {
                wait_until_visible(&mut self.db, xid).await?;
            }
        }
        let limits = Limits {
            batch_size: PAGE as usize,
            max_batch_bytes: usize::MAX,
            max_payload_bytes: self.max_payload_bytes,
        };
        let page = match &release.scope {
            Scope::Named(aggregates) if aggregates.is_empty() => Vec::new(),
            scope => page(&mut self.db, scope, release.after_seq, &limits).await?,
        };
        let more = page.len() as i64 == PAGE;
        let every_held = matches!(release.scope, Scope::EveryHeld { .. });
        let mut events = Vec::with_capacity(page.len());
        for kept in page {
            release.after_seq = kept.row.seq;
            let aggregate = kept.row.aggregate();
            if kept.parked && !self.parked.skips_parked() {
                release.stopped.insert(aggregate.clone());
            } else if !kept.parked && !release.stopped.contains(&aggregate) {
                events.push(kept.row);
            }
            if every_held {
                release.found.insert(aggregate);
            }
        }
        if more {
            self.read.released(events, Some(release));
            return Ok(());
        }
        let aggregates = match release.scope {
            Scope::Named(aggregates) => aggregates,
            Scope::EveryHeld { .. } => release.found.into_iter().collect(),
        };
        if !aggregates.is_empty() {
            tracing::info!(
                aggregates = aggregates.len(),
                still_held = release.stopped.len(),
                "released held events"
            );
        }
        for aggregate in aggregates {
            let held = release.stopped.contains(&aggregate);
            self.parked.released(aggregate, held);
        }
        self.read.released(events, None);
        Ok(())
    }
}

/// PostgreSQL streams a transaction once its commit is on disk, a moment before other sessions
/// see its changes (under load, a moment long enough to read a page in): a release read then
/// would find its aggregates' events still parked, and leave them held. So the first page waits
/// until transaction `xid` is visible, briefly; past [`VISIBLE_WITHIN`] the stream is read again.
async fn wait_until_visible(db: &mut PgConnection, xid: u32) -> Result<(), SourceError> {
    let deadline = tokio::time::Instant::now() + VISIBLE_WITHIN;
    loop {
        let visible: Option<bool> = sqlx::query_scalar(VISIBLE)
            .bind(i64::from(xid))
            .fetch_one(&mut *db)
            .await?;
        if visible == Some(true) {
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(SourceError::Replication(format!(
                "transaction {xid}, which released held events, was streamed committed and is \
                 still not visible after {VISIBLE_WITHIN:?}"
            )));
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// How long a streamed transaction may take to become visible before the stream is read again.
const VISIBLE_WITHIN: Duration = Duration::from_secs(10);

/// Whether the transaction whose 32-bit id is $1 (as pgoutput names it) is visible to a snapshot
/// taken now: its full id is the one of the current epoch at or below the snapshot's `xmax`, or the
/// previous epoch's.
const VISIBLE: &str = "
    SELECT pg_visible_in_snapshot(
               (CASE WHEN $1 <= xmax % 4294967296 THEN xmax - xmax % 4294967296 + $1
                     WHEN xmax >= 4294967296 THEN xmax - xmax % 4294967296 - 4294967296 + $1
                END)::text::xid8,
               snapshot)
    FROM (SELECT snapshot, pg_snapshot_xmax(snapshot)::text::int8 AS xmax
          FROM (SELECT pg_current_snapshot() AS snapshot) AS now) AS bounds";

/// How many kept events a release reads at once.
const PAGE: i64 = 1_000;

/// A kept event, as a release reads it.
struct Kept {
    row: OutboxRow,
    /// Parked (it stops its aggregate's release), or held.
    parked: bool,
}

/// The next [`PAGE`] kept events of a release's `scope` after `after_seq`, in `seq` order. A
/// table-less event is read from its recorded bytes, as it was recorded.
async fn page(
    db: &mut PgConnection,
    scope: &Scope,
    after_seq: i64,
    limits: &Limits,
) -> Result<Vec<Kept>, sqlx::Error> {
    use sqlx::Row;
    let query = match scope {
        Scope::Named(aggregates) => {
            let (types, ids): (Vec<&str>, Vec<&str>) = aggregates
                .iter()
                .map(|(t, i)| (t.as_str(), i.as_str()))
                .unzip();
            sqlx::query(NAMED_PAGE).bind(types).bind(ids)
        }
        // Through `outbox_unpublished`, in `seq` order, up to the last held event.
        Scope::EveryHeld { up_to_seq } => sqlx::query(EVERY_HELD_PAGE).bind(*up_to_seq),
    };
    let rows = query.bind(after_seq).bind(PAGE).fetch_all(db).await?;
    Ok(rows
        .iter()
        .map(|r| {
            let mut row = OutboxRow::read(r, limits);
            if let Ok(Some(recorded)) = r.try_get::<Option<Vec<u8>>, _>("recorded") {
                row = as_recorded(row, Bytes::from(recorded), limits.max_payload_bytes);
            }
            Kept {
                row,
                parked: r.try_get("parked").unwrap_or(true),
            }
        })
        .collect())
}

/// A kept event's columns, as [`OutboxRow::read`] reads them.
macro_rules! kept_columns {
    () => {
        "SELECT id::text AS id, seq, aggregate_type, aggregate_id, event_type, event_version, topic,
                payload::text AS payload, octet_length(payload::text)::int8 AS payload_bytes,
                headers::text AS headers, attempts,
                CASE WHEN isfinite(created_at) THEN (extract(epoch FROM created_at) * 1000)::int8 END
                    AS created_ms,
                true AS payload_valid, parked_at IS NOT NULL AS parked, recorded
         FROM outbox
         WHERE published_at IS NULL AND (held_at IS NOT NULL OR parked_at IS NOT NULL)"
    };
}

/// A page of the kept events of the named aggregates ($1, $2) after `seq` $3, $4 at most.
const NAMED_PAGE: &str = concat!(
    kept_columns!(),
    " AND (aggregate_type, aggregate_id) IN (SELECT * FROM unnest($1::text[], $2::text[]))
      AND seq > $3 ORDER BY seq LIMIT $4"
);

/// A page of the kept events up to `seq` $1, after `seq` $2, $3 at most.
const EVERY_HELD_PAGE: &str = concat!(
    kept_columns!(),
    " AND seq <= $1 AND seq > $2 ORDER BY seq LIMIT $3"
);

/// The table-less event `recorded` holds, in the place of the row kept for it (its `seq`, its
/// aggregate when the bytes cannot be read).
fn as_recorded(kept: OutboxRow, recorded: Bytes, max_payload_bytes: usize) -> OutboxRow {
    match from_recorded(&recorded, kept.created_ms, max_payload_bytes) {
        Ok(row) => OutboxRow {
            seq: kept.seq,
            attempts: kept.attempts,
            ..row
        },
        Err(reason) => OutboxRow {
            payload: Bytes::new(),
            defect: Some(reason),
            recorded: Some(recorded),
            ..kept
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sqlx::Connection;

    async fn visible(db: &mut PgConnection, xid: u32) -> Option<bool> {
        sqlx::query_scalar(VISIBLE)
            .bind(i64::from(xid))
            .fetch_one(db)
            .await
            .unwrap()
    }

    /// A transaction is not visible while it runs (as a streamed one is not for a moment after
    /// its commit is on disk), and is once it has committed.
    #[tokio::test]
    async fn a_transaction_is_visible_once_committed_and_not_before() {
        let url = outbox_tests::postgres_url();
        let mut writer = PgConnection::connect(&url).await.unwrap();
        let mut relay = PgConnection::connect(&url).await.unwrap();
        let mut tx = writer.begin().await.unwrap();
        let full: i64 = sqlx::query_scalar("SELECT pg_current_xact_id()::text::int8")
            .fetch_one(&mut *tx)
            .await
            .unwrap();
        let xid = u32::try_from(full % (1 << 32)).unwrap();
        assert_eq!(visible(&mut relay, xid).await, Some(false), "running");
        let waited = tokio::time::timeout(
            Duration::from_millis(300),
            wait_until_visible(&mut relay, xid),
        )
        .await;
        assert!(waited.is_err(), "the wait returned while it ran");
        tx.commit().await.unwrap();
        assert_eq!(visible(&mut relay, xid).await, Some(true), "committed");
        wait_until_visible(&mut relay, xid).await.unwrap();
    }
}
