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
/// row is *blocked* while an earlier unpublished row of its aggregate backs off (due or not) or is
/// parked and `?2` holds parked aggregates back: one probe of `outbox_blocked`. SQLite cannot
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

#[cfg(test)]
mod tests {
    use super::super::{Connection, OutboxTable};
    use crate::batch::{Limits, Outcome};
    use crate::config::Mode;
    use sqlx::Connection as _;
    use sqlx::sqlite::SqliteConnection;

    /// A migrated in-memory database: 100 aggregates parked at their first event with 10 more
    /// events each, then 200 events of 20 free aggregates.
    async fn blocked_table() -> OutboxTable {
        let mut conn = SqliteConnection::connect("sqlite::memory:").await.unwrap();
        for step in seaorm_outbox::schema::STEPS {
            let sql = step.up(seaorm_outbox::sea_orm::DbBackend::Sqlite).unwrap();
            sqlx::raw_sql(sql).execute(&mut conn).await.unwrap();
        }
        sqlx::raw_sql(
            "WITH RECURSIVE g(n) AS (SELECT 0 UNION ALL SELECT n + 1 FROM g WHERE n < 1099)
             INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
             SELECT 'b' || n, 'order', 'blocked-' || (n % 100), 'E', '{}' FROM g;
             UPDATE outbox SET parked_at = '2026-01-01T00:00:00.000Z', attempts = 1
             WHERE seq <= 100;
             WITH RECURSIVE g(n) AS (SELECT 0 UNION ALL SELECT n + 1 FROM g WHERE n < 199)
             INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
             SELECT 'f' || n, 'order', 'free-' || (n % 20), 'E', '{}' FROM g;",
        )
        .execute(&mut conn)
        .await
        .unwrap();
        OutboxTable {
            conn: Connection::Sqlite(conn),
            name: seaorm_outbox::TableName::DEFAULT,
        }
    }

    fn conn(table: &mut OutboxTable) -> &mut SqliteConnection {
        let Connection::Sqlite(conn) = &mut table.conn else {
            unreachable!()
        };
        conn
    }

    async fn count(table: &mut OutboxTable, sql: &str) -> i64 {
        sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
            .fetch_one(conn(table))
            .await
            .unwrap()
    }

    const LIMITS: Limits = Limits {
        batch_size: 50,
        max_batch_bytes: 1 << 20,
        max_payload_bytes: 1 << 20,
    };

    /// The claim walks at most a batch of `outbox_claimable` and of `outbox_retrying`, probing
    /// `outbox_blocked` per row; it holds the waiting rows it meets, so the claims after go past
    /// them: each claim costs one batch however many rows wait.
    #[tokio::test]
    async fn the_claim_holds_the_rows_of_blocked_aggregates_and_goes_past_them() {
        let mut table = blocked_table().await;
        use sqlx::Row as _;
        let plan = sqlx::query(sqlx::AssertSqlSafe(format!(
            "EXPLAIN QUERY PLAN {}",
            super::SQLITE_CLAIM
        )))
        .bind(50)
        .bind(true)
        .bind(1 << 20)
        .bind(1 << 20)
        .bind("[]")
        .fetch_all(conn(&mut table))
        .await
        .unwrap();
        let plan: Vec<String> = plan.iter().map(|row| row.get("detail")).collect();
        let plan = plan.join("\n");
        for index in [
            "USING INDEX outbox_claimable",
            "USING INDEX outbox_retrying",
            "USING INDEX outbox_blocked",
        ] {
            assert!(plan.contains(index), "{index}:\n{plan}");
        }

        // 1,000 waiting rows, held 50 a claim: 20 claims find no event to send.
        let mut holding = 0;
        let claim = loop {
            let claim = table.claim(&LIMITS, &[0], true, &[]).await.unwrap();
            if !claim.rows.is_empty() {
                break claim;
            }
            assert!(claim.full, "a claim that only held rows asks for the next");
            holding += 1;
            assert!(
                holding <= 20,
                "each claim holds a batch of the waiting rows"
            );
        };
        assert_eq!(holding, 20, "each claim holds a batch of the waiting rows");
        assert_eq!(
            claim.rows.len(),
            50,
            "then a full batch of the free aggregates"
        );
        assert!(
            claim
                .rows
                .iter()
                .all(|r| r.aggregate_id.starts_with("free-")),
            "only free aggregates are claimed"
        );
        let held = count(
            &mut table,
            "SELECT count(*) FROM outbox WHERE held_at IS NOT NULL AND aggregate_id LIKE 'blocked-%'",
        )
        .await;
        assert_eq!(held, 1_000, "every waiting row is held");
        assert_eq!(
            count(
                &mut table,
                "SELECT count(*) FROM outbox WHERE held_at IS NOT NULL"
            )
            .await,
            1_000,
            "no free row is held"
        );
        assert_eq!(table.backlog().await.unwrap().held, Some(1_000));
    }

    /// A held row goes back to the claim when its aggregate's blocker goes: in the transaction
    /// that publishes a retried blocker, or by the sweep once an operator un-parked one.
    #[tokio::test]
    async fn held_rows_are_released_when_their_blocker_goes() {
        let mut table = blocked_table().await;
        for _ in 0..20 {
            table.claim(&LIMITS, &[0], true, &[]).await.unwrap();
        }
        assert_eq!(
            count(
                &mut table,
                "SELECT count(*) FROM outbox WHERE held_at IS NOT NULL"
            )
            .await,
            1_000
        );
        // blocked-0's parked event retried by hand and published by the relay.
        let blocker = count(
            &mut table,
            "SELECT seq FROM outbox WHERE aggregate_id = 'blocked-0' AND parked_at IS NOT NULL",
        )
        .await;
        let key = crate::row::RowKey {
            id: "b0".to_owned(),
            seq: blocker,
            position: blocker,
        };
        let outcome = Outcome {
            published: vec![key.clone()],
            ..Outcome::default()
        };
        table.settle(&outcome, Mode::Mark, &[key]).await.unwrap();
        let held_of = |aggregate: &str| {
            format!(
                "SELECT count(*) FROM outbox WHERE held_at IS NOT NULL AND aggregate_id = '{aggregate}'"
            )
        };
        assert_eq!(count(&mut table, &held_of("blocked-0")).await, 0);
        assert_eq!(count(&mut table, &held_of("blocked-1")).await, 10);

        // blocked-1's parked event skipped outside the relay: the sweep releases its rows only.
        sqlx::query(
            "UPDATE outbox SET published_at = '2026-01-01T00:00:00.000Z'
             WHERE aggregate_id = 'blocked-1' AND parked_at IS NOT NULL",
        )
        .execute(conn(&mut table))
        .await
        .unwrap();
        assert_eq!(table.release_unblocked(&[0], true).await.unwrap(), 10);
        assert_eq!(count(&mut table, &held_of("blocked-1")).await, 0);
        assert_eq!(
            count(
                &mut table,
                "SELECT count(*) FROM outbox WHERE held_at IS NOT NULL"
            )
            .await,
            980
        );
        // With parked aggregates no longer held back, the sweep releases the rest.
        assert_eq!(table.release_unblocked(&[0], false).await.unwrap(), 980);
    }
}
