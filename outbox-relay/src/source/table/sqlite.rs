//! The table source's SQL on SQLite: the claim and the settle.

use super::Mode;
use crate::batch::Outcome;
use crate::database::Backend;
use crate::row::RowKey;
use seaorm_outbox::TableName;
use sqlx::sqlite::SqliteConnection;

/// The claim on SQLite, as [`PG_CLAIM`](super::PG_CLAIM) (`?1` rows, `?2` hold parked, `?3`
/// payload and `?4` batch bytes, `?5` the seqs in flight as a JSON array); without locks, as one
/// relay serves a SQLite database. Text columns of a hand-written row may hold any type: the
/// relay reads each row column by column.
///
/// It reads two short walks: `walked`, the first `?1` rows of `outbox_claimable` in `seq` order,
/// and `due`, at most `?1` rows backing off whose time has come, through `outbox_retrying`. A walked
/// row is *blocked* while an earlier unpublished row of its aggregate backs off (due or not), is
/// parked and `?2` holds parked aggregates back, or is held (a hold that outlived its blocker, as
/// on PostgreSQL): one probe of `outbox_blocked` and one of `outbox_held`. SQLite cannot
/// update in a query, so the blocked rows come back as rows of no event (`id` NULL) with their
/// `seq`, and the relay holds them (`HOLD`) before its next claim, which takes them out of both
/// walks: a claim costs one batch however many rows wait. `candidates` counts the rows walked.
pub(super) const SQLITE_CLAIM: &str = "
WITH walked AS MATERIALIZED (
    SELECT o.seq, EXISTS (
               SELECT 1 FROM outbox b
               WHERE b.aggregate_type = o.aggregate_type AND b.aggregate_id = o.aggregate_id
                 AND (b.parked_at IS NOT NULL OR b.retry_at IS NOT NULL)
                 AND b.published_at IS NULL AND b.seq < o.seq AND (?2 OR b.parked_at IS NULL)
           ) OR EXISTS (
               SELECT 1 FROM outbox h
               WHERE h.aggregate_type = o.aggregate_type AND h.aggregate_id = o.aggregate_id
                 AND h.held_at IS NOT NULL AND h.published_at IS NULL AND h.seq < o.seq
           ) AS blocked
    FROM outbox o
    WHERE o.published_at IS NULL AND o.parked_at IS NULL AND o.held_at IS NULL
      AND o.retry_at IS NULL AND o.seq NOT IN (SELECT value FROM json_each(?5))
    ORDER BY o.seq
    LIMIT ?1
), due AS MATERIALIZED (
    SELECT o.seq, EXISTS (
               SELECT 1 FROM outbox b
               WHERE b.aggregate_type = o.aggregate_type AND b.aggregate_id = o.aggregate_id
                 AND (b.parked_at IS NOT NULL OR b.retry_at IS NOT NULL)
                 AND b.published_at IS NULL AND b.seq < o.seq AND (?2 OR b.parked_at IS NULL)
           ) OR EXISTS (
               SELECT 1 FROM outbox h
               WHERE h.aggregate_type = o.aggregate_type AND h.aggregate_id = o.aggregate_id
                 AND h.held_at IS NOT NULL AND h.published_at IS NULL AND h.seq < o.seq
           ) AS blocked
    FROM outbox o
    WHERE o.retry_at IS NOT NULL AND o.retry_at <= strftime('%Y-%m-%dT%H:%M:%fZ', 'now')
      AND o.published_at IS NULL AND o.parked_at IS NULL AND o.held_at IS NULL
      AND o.seq NOT IN (SELECT value FROM json_each(?5))
    ORDER BY o.retry_at
    LIMIT ?1
), walks AS MATERIALIZED (
    SELECT seq, blocked FROM walked UNION ALL SELECT seq, blocked FROM due
), claimed AS (
    SELECT o.seq, length(CAST(o.payload AS BLOB)) AS payload_bytes,
           coalesce(length(CAST(o.headers AS BLOB)), 0) AS header_bytes
    FROM (SELECT w.seq FROM walks w WHERE NOT w.blocked ORDER BY w.seq LIMIT ?1) c
    JOIN outbox o ON o.seq = c.seq
), sized AS (
    SELECT c.*, sum(CASE WHEN c.payload_bytes <= ?3 THEN c.payload_bytes ELSE 0 END + c.header_bytes)
                    OVER (ORDER BY c.seq) AS running_bytes,
           row_number() OVER (ORDER BY c.seq) AS position
    FROM claimed c
)
SELECT o.id, o.seq, o.aggregate_type, o.aggregate_id, o.event_type, o.event_version,
       o.topic, CASE WHEN s.payload_bytes <= ?3 THEN o.payload END AS payload,
       s.payload_bytes, o.headers, o.attempts,
       CAST((julianday(o.created_at) - 2440587.5) * 86400000 AS INTEGER) AS created_ms,
       CASE WHEN s.payload_bytes <= ?3 THEN json_valid(o.payload) ELSE 1 END AS payload_valid,
       (SELECT count(*) FROM walks) AS candidates
FROM sized s JOIN outbox o ON o.seq = s.seq
WHERE s.running_bytes <= ?4 OR s.position = 1
UNION ALL
-- The blocked rows, for the relay to hold: no event.
SELECT NULL, w.seq, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
       (SELECT count(*) FROM walks)
FROM walks w WHERE w.blocked
ORDER BY 2";

/// Whether the outbox table `?2` has schema version 4 (the claim's index, `?1`: the table's
/// `outbox_claimable`), or does not exist.
const HAS_CLAIMABLE: &str = "
SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'index' AND name = ?1)
    OR NOT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?2)";

/// Refuses a table without schema version 4: the claim reads `held_at` and walks its indexes. A
/// table that does not exist is left to the claim, which fails until it is created.
pub(super) async fn check_schema(
    conn: &mut SqliteConnection,
    table: &TableName,
) -> Result<Option<String>, sqlx::Error> {
    let current: bool = sqlx::query_scalar(HAS_CLAIMABLE)
        .bind(format!("{}_claimable", table.name()))
        .bind(table.name())
        .fetch_one(conn)
        .await?;
    Ok((!current).then(|| {
        format!(
            "the outbox table {table} has no index outbox_claimable: the relay needs schema \
             version 4 (run `outbox-relay migrate`, or apply outbox-core/sql/sqlite/0004_claim_holds.sql)"
        )
    }))
}

/// Holds the rows whose `seq` is in `?1` (a JSON array): rows the claim found blocked.
pub(super) const HOLD: &str = "
UPDATE outbox SET held_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now')
WHERE seq IN (SELECT value FROM json_each(?1)) AND held_at IS NULL AND published_at IS NULL";

/// Releases the rows held behind the rows `?1` (their `seq`s, a JSON array): every held row of
/// their aggregates, through `outbox_held`.
const RELEASE_HELD: &str = "
UPDATE outbox SET held_at = NULL
WHERE held_at IS NOT NULL AND published_at IS NULL
  AND (aggregate_type, aggregate_id) IN (
      SELECT r.aggregate_type, r.aggregate_id FROM outbox r
      WHERE r.seq IN (SELECT value FROM json_each(?1)))";

/// Releases the held rows that nothing blocks any more, with parked aggregates held back if
/// `?1`: as [`RELEASE_UNBLOCKED`](super::postgres::RELEASE_UNBLOCKED), over every shard (one
/// relay serves a SQLite database).
pub(super) const RELEASE_UNBLOCKED: &str = "
UPDATE outbox SET held_at = NULL
WHERE held_at IS NOT NULL AND published_at IS NULL
  AND NOT EXISTS (
      SELECT 1 FROM outbox b
      WHERE b.aggregate_type = outbox.aggregate_type AND b.aggregate_id = outbox.aggregate_id
        AND (b.parked_at IS NOT NULL OR b.retry_at IS NOT NULL)
        AND b.published_at IS NULL AND b.seq < outbox.seq AND (?1 OR b.parked_at IS NULL))";

/// Writes a batch's outcome (in the caller's transaction), first releasing the rows held behind
/// `released`: rows that blocked their aggregate and stop blocking it with this outcome.
pub(super) async fn settle(
    tx: &mut SqliteConnection,
    table: &TableName,
    outcome: &Outcome,
    mode: Mode,
    released: &[RowKey],
) -> Result<(), sqlx::Error> {
    if !released.is_empty() {
        let seqs: Vec<i64> = released.iter().map(|key| key.seq).collect();
        sqlx::query(super::on(table, RELEASE_HELD, Backend::Sqlite))
            .bind(serde_json::to_string(&seqs).expect("integers serialize"))
            .execute(&mut *tx)
            .await?;
    }
    if !outcome.published.is_empty() {
        let seqs: Vec<i64> = outcome.published.iter().map(|key| key.seq).collect();
        let sql = match mode {
            Mode::Mark => {
                "UPDATE outbox SET published_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now'), retry_at = NULL \
                 WHERE seq IN (SELECT value FROM json_each(?1))"
            }
            Mode::Delete => "DELETE FROM outbox WHERE seq IN (SELECT value FROM json_each(?1))",
        };
        sqlx::query(super::on(table, sql, Backend::Sqlite))
            .bind(serde_json::to_string(&seqs).expect("integers serialize"))
            .execute(&mut *tx)
            .await?;
    }
    for (key, error, retry_in) in &outcome.failed {
        sqlx::query(super::on(
            table,
            "UPDATE outbox SET attempts = attempts + 1, last_error = ?2, \
             retry_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now', printf('+%.3f seconds', ?3)) WHERE seq = ?1",
            Backend::Sqlite,
        ))
        .bind(key.seq)
        .bind(error)
        .bind(retry_in.as_secs_f64())
        .execute(&mut *tx)
        .await?;
    }
    for (key, reason) in &outcome.parked {
        sqlx::query(super::on(
            table,
            "UPDATE outbox SET attempts = attempts + 1, last_error = ?2, \
             parked_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now') WHERE seq = ?1",
            Backend::Sqlite,
        ))
        .bind(key.seq)
        .bind(reason)
        .execute(&mut *tx)
        .await?;
    }
    Ok(())
}

/// Deletes up to `?2` published rows older than `?1` seconds, oldest first.
pub(super) const PRUNE_PUBLISHED: &str = "
DELETE FROM outbox WHERE id IN (
    SELECT id FROM outbox
    WHERE published_at < strftime('%Y-%m-%dT%H:%M:%fZ', 'now', printf('-%.3f seconds', ?1))
    ORDER BY published_at LIMIT ?2)";

/// The backlog, the parked events, the held ones, and the age in seconds of the oldest
/// unpublished one.
pub(super) const BACKLOG: &str = "
SELECT count(*) FILTER (WHERE parked_at IS NULL),
       count(*) FILTER (WHERE parked_at IS NOT NULL),
       count(*) FILTER (WHERE parked_at IS NULL AND held_at IS NOT NULL),
       (julianday('now') - julianday(min(created_at) FILTER (WHERE parked_at IS NULL))) * 86400.0
FROM outbox WHERE published_at IS NULL";
