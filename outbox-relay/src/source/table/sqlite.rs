//! The table source's SQL on SQLite: the claim and the settle.

use super::Mode;
use crate::batch::Outcome;
use crate::database::Backend;
use seaorm_outbox::TableName;
use sqlx::sqlite::SqliteConnection;

/// The claim on SQLite, as [`PG_CLAIM`] (`?1` rows, `?2` hold parked, `?3` payload and `?4`
/// batch bytes, `?5` the seqs in flight as a JSON array); without locks, as one relay serves a SQLite database. Text columns of a
/// hand-written row may hold any type: the relay reads each row column by column.
pub(super) const SQLITE_CLAIM: &str = "
WITH claimed AS (
    SELECT o.seq, length(CAST(o.payload AS BLOB)) AS payload_bytes,
           coalesce(length(CAST(o.headers AS BLOB)), 0) AS header_bytes
    FROM outbox o
    WHERE o.published_at IS NULL AND o.parked_at IS NULL
      AND o.seq NOT IN (SELECT value FROM json_each(?5))
      AND NOT EXISTS (SELECT 1 FROM outbox p
                      WHERE p.aggregate_type = o.aggregate_type AND p.aggregate_id = o.aggregate_id
                        AND p.published_at IS NULL
                        AND (p.retry_at > strftime('%Y-%m-%dT%H:%M:%fZ', 'now') OR (?2 AND p.parked_at IS NOT NULL)))
    ORDER BY o.seq
    LIMIT ?1
), sized AS (
    SELECT c.*, sum(CASE WHEN c.payload_bytes <= ?3 THEN c.payload_bytes ELSE 0 END + c.header_bytes)
                    OVER (ORDER BY c.seq) AS running_bytes,
           row_number() OVER (ORDER BY c.seq) AS position,
           count(*) OVER () AS candidates
    FROM claimed c
)
SELECT o.id, o.seq, o.aggregate_type, o.aggregate_id, o.event_type, o.event_version,
       o.topic, CASE WHEN s.payload_bytes <= ?3 THEN o.payload END AS payload,
       s.payload_bytes, o.headers, o.attempts,
       CAST((julianday(o.created_at) - 2440587.5) * 86400000 AS INTEGER) AS created_ms,
       CASE WHEN s.payload_bytes <= ?3 THEN json_valid(o.payload) ELSE 1 END AS payload_valid,
       s.candidates
FROM sized s JOIN outbox o ON o.seq = s.seq
WHERE s.running_bytes <= ?4 OR s.position = 1
ORDER BY s.seq";

/// Writes a batch's outcome (in the caller's transaction).
pub(super) async fn settle(
    tx: &mut SqliteConnection,
    table: &TableName,
    outcome: &Outcome,
    mode: Mode,
) -> Result<(), sqlx::Error> {
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

/// The backlog, the parked events, none held (the claim holds no rows here), and the age in
/// seconds of the oldest unpublished one.
pub(super) const BACKLOG: &str = "
SELECT count(*) FILTER (WHERE parked_at IS NULL),
       count(*) FILTER (WHERE parked_at IS NOT NULL),
       0,
       (julianday('now') - julianday(min(created_at) FILTER (WHERE parked_at IS NULL))) * 86400.0
FROM outbox WHERE published_at IS NULL";
