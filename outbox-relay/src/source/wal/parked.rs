//! The WAL source's parked events and the events held behind them, kept in the outbox table so
//! that `outbox-relay failed` lists them and survives a restart.
//!
//! - A **parked** event failed for good: `parked_at` and the reason in `last_error`, as the polling
//!   relay parks a row.
//! - A **held** event waits behind a parked one of its aggregate: `held_at` (the polling relay
//!   needs no mark for these: its waiting rows are simply unpublished).
//!
//! A table row is marked in place; a table-less event becomes a row that keeps the event exactly
//! as recorded (`recorded`), under its own id or one derived from it. Which aggregates are held
//! changes only in stream order: an event parked holds its aggregate, and a release (an operator's
//! `failed retry` or `failed skip`, which writes a [`RELEASE_PREFIX`] message in its transaction,
//! or the relay's start) sends an aggregate's held events in `seq` order up to its first parked
//! one. So no event of an aggregate can go out ahead of one held before it.

use super::event::{from_recorded, table_id};
use crate::error::SourceError;
use crate::row::{Aggregate, OutboxRow};
use bytes::Bytes;
use sqlx::PgConnection;
use std::collections::HashSet;

/// The logical-message prefix of a release: `failed retry` and `failed skip` emit one in their
/// transaction, naming the aggregates whose held events may go out (a JSON array of
/// `[aggregate_type, aggregate_id]` pairs).
pub(crate) const RELEASE_PREFIX: &str = "outbox-release";

/// The aggregates whose events are held behind a parked one.
pub(super) struct Parked {
    /// Aggregates with a parked event: their events read from the stream are held.
    held: HashSet<Aggregate>,
    /// Aggregates whose release ran into a failure (an event it released was parked again): their
    /// other released events stay held.
    released_then_parked: HashSet<Aggregate>,
    skip_parked: bool,
}

impl Parked {
    /// The aggregates the table shows parked or held events of (none with `skip_parked`).
    pub async fn load(db: &mut PgConnection, skip_parked: bool) -> Result<Self, sqlx::Error> {
        let held = if skip_parked {
            HashSet::new()
        } else {
            sqlx::query_as(
                "SELECT DISTINCT aggregate_type, aggregate_id FROM outbox
                 WHERE (parked_at IS NOT NULL OR held_at IS NOT NULL) AND published_at IS NULL",
            )
            .fetch_all(db)
            .await?
            .into_iter()
            .collect()
        };
        Ok(Parked {
            held,
            released_then_parked: HashSet::new(),
            skip_parked,
        })
    }

    /// Whether an event must wait behind a parked one of its aggregate: an event read from the
    /// stream while its aggregate is held, or one released from the table (`kept`) after an
    /// earlier one of the same release was parked again. Free while nothing is held.
    pub fn is_holding(&self, row: &OutboxRow, kept: bool) -> bool {
        let held = if kept {
            &self.released_then_parked
        } else {
            &self.held
        };
        !held.is_empty() && held.contains(&row.aggregate())
    }

    /// An event of `row`'s aggregate was parked: its later events wait (not with `skip_parked`).
    pub fn hold(&mut self, row: &OutboxRow, kept: bool) {
        if !self.skip_parked {
            self.held.insert(row.aggregate());
            if kept {
                self.released_then_parked.insert(row.aggregate());
            }
        }
    }

    /// Whether parked events hold nothing back (`--skip-parked`).
    pub fn skips_parked(&self) -> bool {
        self.skip_parked
    }

    /// A release of `aggregate` starts: what it reads from the table goes out in order.
    pub fn releasing(&mut self, aggregate: &Aggregate) {
        self.released_then_parked.remove(aggregate);
    }

    /// What a release found: whether the aggregate is still held (it reached a parked event).
    pub fn released(&mut self, aggregate: Aggregate, still_held: bool) {
        if still_held && !self.skip_parked {
            self.held.insert(aggregate);
        } else {
            self.held.remove(&aggregate);
        }
    }
}

/// Keeps an event read from the stream in the table: parked with `reason`, or held (`None`).
/// An event kept already (the stream replays from the confirmed position after a failure) keeps
/// how and why it was kept, and one published since stays published.
pub(super) async fn keep(
    db: &mut PgConnection,
    row: &OutboxRow,
    reason: Option<&str>,
) -> Result<(), sqlx::Error> {
    // The pump logged a park already.
    if reason.is_none() {
        tracing::debug!(event_id = %row.id, aggregate_type = %row.aggregate_type,
                        aggregate_id = %row.aggregate_id, "holding an event behind a parked one");
    }
    // A table-less event's bytes are all in `recorded`: `payload` (jsonb) and `headers` may not
    // hold them as they are. A table row exists already; its values only matter if it was pruned,
    // and then it comes back under its own `seq` ($11): a release sends an aggregate's kept
    // events in `seq` order, so a new one would put it behind the events recorded after it.
    let table_row = row.recorded.is_none();
    let payload = (table_row && !row.payload.is_empty())
        .then(|| String::from_utf8_lossy(&row.payload).into_owned());
    let headers = row.headers.as_deref().filter(|_| table_row);
    let seq = (table_row && row.seq >= 0).then_some(row.seq);
    sqlx::query(
        "INSERT INTO outbox (seq, id, aggregate_type, aggregate_id, event_type, event_version, topic,
                             payload, headers, recorded, attempts, last_error, parked_at, held_at)
         OVERRIDING SYSTEM VALUE
         VALUES (COALESCE($11::int8, nextval(pg_get_serial_sequence('outbox', 'seq'))),
                 $1, $2, $3, $4, $5, $6, COALESCE($7::jsonb, 'null'::jsonb), $8::jsonb, $9,
                 CASE WHEN $10::text IS NULL THEN 0 ELSE 1 END, $10,
                 CASE WHEN $10::text IS NOT NULL THEN now() END,
                 CASE WHEN $10::text IS NULL THEN now() END)
         ON CONFLICT (id) DO UPDATE SET parked_at = EXCLUDED.parked_at, held_at = EXCLUDED.held_at,
                                        last_error = COALESCE(EXCLUDED.last_error, outbox.last_error),
                                        attempts = outbox.attempts + EXCLUDED.attempts
         WHERE outbox.parked_at IS NULL AND outbox.held_at IS NULL AND outbox.published_at IS NULL",
    )
    .bind(table_id(&row.id))
    .bind(&row.aggregate_type)
    .bind(&row.aggregate_id)
    .bind(&row.event_type)
    .bind(row.event_version)
    .bind(&row.topic)
    .bind(payload)
    .bind(headers)
    .bind(row.recorded.as_deref())
    .bind(reason)
    .bind(seq)
    .execute(db)
    .await?;
    Ok(())
}

/// A released event the broker acknowledged: published.
pub(super) async fn published(db: &mut PgConnection, seq: i64) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE outbox SET published_at = now(), held_at = NULL
         WHERE seq = $1 AND published_at IS NULL",
    )
    .bind(seq)
    .execute(db)
    .await?;
    Ok(())
}

/// A released event that failed for good: parked again, with this failure's reason.
pub(super) async fn parked_again(
    db: &mut PgConnection,
    seq: i64,
    reason: &str,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE outbox SET parked_at = now(), held_at = NULL, last_error = $2,
                           attempts = attempts + 1
         WHERE seq = $1 AND published_at IS NULL",
    )
    .bind(seq)
    .bind(reason)
    .execute(db)
    .await?;
    Ok(())
}

/// The aggregates a release message names; none when it is not such a list (it is then ignored:
/// the relay's next start releases whatever is held and no longer behind a parked event).
pub(super) fn released_aggregates(content: &[u8]) -> Vec<Aggregate> {
    serde_json::from_slice(content).unwrap_or_else(|e| {
        tracing::warn!(error = %e, "a release message that is not a list of aggregates; ignored");
        Vec::new()
    })
}

/// The last `seq` held, if any event is: the relay's start releases every held event up to it.
pub(super) async fn last_held_seq(db: &mut PgConnection) -> Result<Option<i64>, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT max(seq) FROM outbox WHERE held_at IS NOT NULL AND published_at IS NULL",
    )
    .fetch_one(db)
    .await
}

/// Turns the table-less events kept in the table (parked, or held) into plain rows, for polling
/// relays, which publish a row's `payload` and know nothing of `recorded`; returns how many.
/// Refused, changing nothing, if one cannot be (its bytes are not an event with a UUID id: it was
/// parked for that): it must be skipped first.
pub(super) async fn convert_table_less(db: &mut PgConnection) -> Result<u64, SourceError> {
    let kept: Vec<(i64, uuid::Uuid, Vec<u8>)> = sqlx::query_as(
        "SELECT seq, id, recorded FROM outbox
         WHERE recorded IS NOT NULL AND published_at IS NULL ORDER BY seq",
    )
    .fetch_all(&mut *db)
    .await?;
    let mut unreadable = Vec::new();
    let mut converted = 0;
    for (seq, id, recorded) in kept {
        let event = from_recorded(&Bytes::from(recorded), None, usize::MAX)
            .ok()
            .filter(|e| e.defect.is_none() && uuid::Uuid::parse_str(&e.id).ok() == Some(id));
        let Some(event) = event else {
            unreadable.push(id.to_string());
            continue;
        };
        sqlx::query(
            "UPDATE outbox SET event_type = $2, event_version = $3, topic = $4, payload = $5::jsonb,
                               headers = $6::jsonb, recorded = NULL
             WHERE seq = $1",
        )
        .bind(seq)
        .bind(&event.event_type)
        .bind(event.event_version)
        .bind(&event.topic)
        .bind(String::from_utf8_lossy(&event.payload).as_ref())
        .bind(event.headers.as_deref())
        .execute(&mut *db)
        .await?;
        converted += 1;
    }
    if unreadable.is_empty() {
        return Ok(converted);
    }
    Err(SourceError::Refused(format!(
        "{} table-less events the WAL source parked cannot become rows for the polling relays \
         (their recorded bytes are not an event with a UUID id): skip them first (`outbox-relay \
         failed skip --id ID --reason ...`): {}; nothing was changed",
        unreadable.len(),
        unreadable.join(", ")
    )))
}
