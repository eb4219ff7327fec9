//! The table source's SQL on MySQL and MariaDB: the session, the claim and the settle. Written
//! in the SQL both accept (MySQL 8.0.16+, MariaDB 10.6+; the tests run on MariaDB 10.11). The
//! replicas share the work through shard leases, named locks (`leases/mysql.rs`).

use super::Mode;
use crate::batch::Outcome;
use crate::database::Backend;
use crate::row::RowKey;
use seaorm_outbox::TableName;
use sqlx::mysql::MySqlConnection;

/// Set on the relay's MySQL sessions: UTC for the times it writes and compares (the schema keeps
/// UTC `DATETIME(6)`), and READ COMMITTED, so the settle's and the pruning's writes lock the rows
/// they change and no gaps between them.
pub(super) const MYSQL_SESSION: &str =
    "SET time_zone = '+00:00'; SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED";

/// Set on the relay's MariaDB sessions besides [`MYSQL_SESSION`]: MariaDB checks a row's `CHECK`
/// constraints again on every `UPDATE`, so a payload that got past them (inserted with
/// `check_constraint_checks = 0`) could not even be parked, and its batch's settle failed again
/// and again. The relay never writes a payload. MySQL has no such variable, nor such rows: it
/// checks existing rows when a constraint is enforced again.
pub(super) const MARIADB_SESSION: &str = "SET SESSION check_constraint_checks = 0";

/// The relay's claim query on MySQL and MariaDB, for operators to `EXPLAIN`; as
/// [`PG_CLAIM`](super::PG_CLAIM), as it reads with nothing in flight. Parameters, bound in this
/// order (MySQL numbers none): hold parked, the shard mask (32 bytes, bit `n % 8` of byte `n / 8`
/// set for shard `n`; every shard: `UNHEX(REPEAT('FF', 32))`), rows (the walk), then the same
/// three again (the due retries), payload bytes, rows, payload bytes, batch bytes. The seqs in
/// flight are no parameter: the relay writes them into both lists `o.seq NOT IN (0)` as integers
/// (`seq` starts at 1), because MariaDB checks a list of constants in the index (index condition
/// pushdown) and skips the rows in flight without reading them; a bound list (a JSON array
/// through `JSON_TABLE`, a subquery) is checked only after each row is read by primary key,
/// which was 5.9 of the claim's 6.9 ms with a batch of 500 in flight. `payload_valid` is NULL:
/// the relay checks the payload is JSON itself, as `JSON_VALID` per row cost the database a
/// third of the claim (the schema's `CHECK` refuses invalid JSON anyway, unless checks were
/// turned off).
///
/// It reads two short walks, as PostgreSQL's does: `walked`, the first rows of the NULL prefix of
/// `outbox_unpublished` (not published, parked, held or backing off) in `seq` order, and `due`, the
/// rows backing off whose time has come, through `outbox_retrying`. A walked row is *blocked*
/// while an earlier unpublished row of its aggregate backs off (due or not), is parked and
/// parked aggregates are held back, or is held (a hold that outlived its blocker, as on
/// PostgreSQL): one probe of `outbox_waiting`, whose generated column is NULL on every row but
/// the waiting ones, skipped altogether while no row waits (the probes cost
/// about 3 of a claim's 5 ms with 500 rows). A query cannot update here, so the blocked rows come back as
/// rows of no event (`id` NULL) with their `seq`, and the relay holds them (`HOLD`) before its
/// next claim, which takes them out of both walks: a claim costs one batch however many rows
/// wait (`tests/mariadb.rs` checks the plan). `walks` is read once, by window functions:
/// MariaDB derives a common table expression again for each reference. The indexes are forced:
/// with a published history before the backlog, MariaDB preferred walking the primary key in
/// `seq` order, through every published row, to stop at the batch size. No row lock: the
/// replica's shard leases make it the only publisher of those rows.
pub const MYSQL_CLAIM: &str = "
WITH walked AS (
    SELECT o.seq, (SELECT EXISTS (SELECT 1 FROM outbox g FORCE INDEX (outbox_waiting)
                                  WHERE g.waiting_on IS NOT NULL))
                  AND EXISTS (
               SELECT 1 FROM outbox b FORCE INDEX (outbox_waiting)
               WHERE b.waiting_on = CONCAT(CHAR_LENGTH(o.aggregate_type), ':', o.aggregate_type, o.aggregate_id)
                 AND b.seq < o.seq
                 AND (b.held_at IS NOT NULL
                      OR (b.parked_at IS NOT NULL OR b.retry_at IS NOT NULL) AND (? OR b.parked_at IS NULL))
           ) AS blocked
    FROM outbox o FORCE INDEX (outbox_unpublished)
    WHERE o.published_at IS NULL AND o.parked_at IS NULL AND o.held_at IS NULL
      AND o.retry_at IS NULL
      AND (ASCII(SUBSTRING(?, (o.shard DIV 8) + 1, 1)) >> (o.shard % 8)) & 1 = 1
      AND o.seq NOT IN (0)
    ORDER BY o.seq
    LIMIT ?
), due AS (
    SELECT o.seq, (SELECT EXISTS (SELECT 1 FROM outbox g FORCE INDEX (outbox_waiting)
                                  WHERE g.waiting_on IS NOT NULL))
                  AND EXISTS (
               SELECT 1 FROM outbox b FORCE INDEX (outbox_waiting)
               WHERE b.waiting_on = CONCAT(CHAR_LENGTH(o.aggregate_type), ':', o.aggregate_type, o.aggregate_id)
                 AND b.seq < o.seq
                 AND (b.held_at IS NOT NULL
                      OR (b.parked_at IS NOT NULL OR b.retry_at IS NOT NULL) AND (? OR b.parked_at IS NULL))
           ) AS blocked
    FROM outbox o FORCE INDEX (outbox_retrying)
    WHERE o.retry_at <= UTC_TIMESTAMP(6) AND o.published_at IS NULL AND o.parked_at IS NULL
      AND o.held_at IS NULL
      AND (ASCII(SUBSTRING(?, (o.shard DIV 8) + 1, 1)) >> (o.shard % 8)) & 1 = 1
      AND o.seq NOT IN (0)
    ORDER BY o.retry_at
    LIMIT ?
), walks AS (
    SELECT w.seq, w.blocked FROM walked w UNION ALL SELECT d.seq, d.blocked FROM due d
), ranked AS (
    SELECT w.seq, w.blocked, COUNT(*) OVER () AS candidates,
           ROW_NUMBER() OVER (PARTITION BY w.blocked ORDER BY w.seq) AS position
    FROM walks w
), sized AS (
    SELECT r.seq, r.blocked, r.candidates, r.position, LENGTH(o.payload) AS payload_bytes,
           SUM(CASE WHEN LENGTH(o.payload) <= ? THEN LENGTH(o.payload) ELSE 0 END
               + COALESCE(LENGTH(o.headers), 0))
               OVER (PARTITION BY r.blocked ORDER BY r.seq) AS running_bytes
    FROM ranked r JOIN outbox o ON o.seq = r.seq
    WHERE r.blocked OR r.position <= ?
)
-- The blocked rows walked come back as rows of no event (`id` NULL), for the relay to hold.
SELECT CASE WHEN NOT s.blocked THEN o.id END AS id, o.seq, o.aggregate_type, o.aggregate_id,
       o.event_type, o.event_version, o.topic,
       CASE WHEN NOT s.blocked AND s.payload_bytes <= ? THEN o.payload END AS payload,
       CAST(s.payload_bytes AS SIGNED) AS payload_bytes, o.headers, o.attempts,
       CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', o.created_at) DIV 1000 AS SIGNED)
           AS created_ms,
       NULL AS payload_valid,
       CAST(s.candidates AS SIGNED) AS candidates
FROM sized s JOIN outbox o ON o.seq = s.seq
WHERE s.blocked OR s.running_bytes <= ? OR s.position = 1
ORDER BY s.seq";

/// [`MYSQL_CLAIM`] on `table` as the relay sends it, one text query: its parameters written in as
/// literals (a bool, the mask in hex, integers), in their order, and the seqs `in_flight` added
/// to its `NOT IN (0)` lists. Not a prepared statement: with a text that changes every claim it
/// would be prepared and closed each time, and sqlx sends the close as a packet of its own that
/// the server never answers; measured so, commit-to-ack at 1,000 events/s went from 4 to 67 ms
/// (p50) and batches of 100 drained at half the rate.
pub(super) fn claim_statement(
    table: &TableName,
    hold_parked: bool,
    shard_mask: &[u8],
    rows: i64,
    payload_bytes: i64,
    batch_bytes: i64,
    in_flight: &[i64],
) -> String {
    use std::fmt::Write;
    let mut mask = String::with_capacity(2 * shard_mask.len());
    for byte in shard_mask {
        let _ = write!(mask, "{byte:02X}");
    }
    let (hold, mask, rows) = (
        hold_parked.to_string().to_uppercase(),
        format!("X'{mask}'"),
        rows.to_string(),
    );
    let values = [
        hold.clone(),
        mask.clone(),
        rows.clone(),
        hold,
        mask,
        rows.clone(),
        payload_bytes.to_string(),
        rows,
        payload_bytes.to_string(),
        batch_bytes.to_string(),
    ];
    let sql = table.rewrite(MYSQL_CLAIM, '`');
    let mut parts = sql.split('?');
    let mut claim = parts.next().unwrap_or_default().to_owned();
    for (value, part) in values.iter().zip(parts) {
        claim.push_str(value);
        claim.push_str(part);
    }
    let mut list = String::with_capacity(16 + 8 * in_flight.len());
    list.push_str("o.seq NOT IN (0");
    for seq in in_flight {
        let _ = write!(list, ",{seq}");
    }
    list.push(')');
    claim.replace(IN_FLIGHT_NONE, &list)
}

/// Where [`claim_statement`] writes the seqs in flight.
const IN_FLIGHT_NONE: &str = "o.seq NOT IN (0)";

/// Whether the outbox table `?` has schema version 4 (the claim's column `waiting_on`), or does
/// not exist (`?` again).
const HAS_WAITING_ON: &str = "
SELECT EXISTS (SELECT 1 FROM information_schema.columns
               WHERE table_schema = DATABASE() AND table_name = ? AND column_name = 'waiting_on')
    OR NOT EXISTS (SELECT 1 FROM information_schema.tables
                   WHERE table_schema = DATABASE() AND table_name = ?)";

/// Refuses a table without schema version 4: the claim probes `outbox_waiting`. A table that
/// does not exist is left to the claim, which fails until it is created.
pub(super) async fn check_schema(
    conn: &mut MySqlConnection,
    table: &TableName,
) -> Result<Option<String>, sqlx::Error> {
    let current: bool = sqlx::query_scalar(HAS_WAITING_ON)
        .bind(table.name())
        .bind(table.name())
        .fetch_one(conn)
        .await?;
    Ok((!current).then(|| {
        format!(
            "the outbox table {table} has no column waiting_on: the relay needs schema version 4 \
             (run `outbox-relay migrate`, or apply outbox-core/sql/mysql/0004_claim_holds.sql)"
        )
    }))
}

/// Holds the rows whose `seq` is in `?` (a JSON array): rows the claim found blocked.
pub(super) const HOLD: &str = "
UPDATE outbox o JOIN JSON_TABLE(?, '$[*]' COLUMNS (seq BIGINT PATH '$')) AS h ON o.seq = h.seq
SET o.held_at = UTC_TIMESTAMP(6)
WHERE o.held_at IS NULL AND o.published_at IS NULL";

/// Releases the rows held behind the rows `?` (their `seq`s, a JSON array): every held row of
/// their aggregates, found through `outbox_waiting` (forced: without it MariaDB read the whole
/// table, its statistics made while nothing was held). The aggregates are a derived table with
/// `DISTINCT`, which MySQL materializes: it refuses to read the table an `UPDATE` changes
/// through a subquery.
pub(super) const RELEASE_HELD: &str = "
UPDATE outbox o FORCE INDEX (outbox_waiting)
JOIN (SELECT DISTINCT CONCAT(CHAR_LENGTH(r.aggregate_type), ':', r.aggregate_type, r.aggregate_id)
          AS waiting_on
      FROM outbox r JOIN JSON_TABLE(?, '$[*]' COLUMNS (seq BIGINT PATH '$')) AS p ON r.seq = p.seq
     ) a ON o.waiting_on = a.waiting_on
SET o.held_at = NULL
WHERE o.held_at IS NOT NULL AND o.published_at IS NULL";

/// Releases the held rows of the shards in the mask `?` (as the claim's) that nothing blocks any
/// more, with parked aggregates held back if `?`: as PostgreSQL's `RELEASE_UNBLOCKED`, the
/// first blocker of each waiting aggregate from `outbox_waiting`, the held rows from a range of
/// `outbox_unpublished` (a held row is never parked): its cost follows the held rows, not the
/// table, which it read whole without that range.
pub(crate) const RELEASE_UNBLOCKED: &str = "
UPDATE outbox o FORCE INDEX (outbox_unpublished)
LEFT JOIN (SELECT b.waiting_on, MIN(b.seq) AS first_seq FROM outbox b FORCE INDEX (outbox_waiting)
           WHERE b.waiting_on IS NOT NULL AND (b.parked_at IS NOT NULL OR b.retry_at IS NOT NULL)
             AND (? OR b.parked_at IS NULL)
           GROUP BY b.waiting_on) k ON k.waiting_on = o.waiting_on
SET o.held_at = NULL
WHERE o.published_at IS NULL AND o.parked_at IS NULL AND o.held_at IS NOT NULL
  AND (ASCII(SUBSTRING(?, (o.shard DIV 8) + 1, 1)) >> (o.shard % 8)) & 1 = 1
  AND (k.first_seq IS NULL OR k.first_seq >= o.seq)";

/// Writes a batch's outcome (in the caller's transaction), first releasing the rows held behind
/// `released`: the published rows in one statement, by `seq` (the primary key).
pub(super) async fn settle(
    tx: &mut MySqlConnection,
    table: &TableName,
    outcome: &Outcome,
    mode: Mode,
    released: &[RowKey],
) -> Result<(), sqlx::Error> {
    if !released.is_empty() {
        let seqs: Vec<i64> = released.iter().map(|key| key.seq).collect();
        sqlx::query(super::on(table, RELEASE_HELD, Backend::MySql))
            .bind(serde_json::to_string(&seqs).expect("integers serialize"))
            .execute(&mut *tx)
            .await?;
    }
    if !outcome.published.is_empty() {
        let seqs: Vec<i64> = outcome.published.iter().map(|key| key.seq).collect();
        let sql = match mode {
            // Clearing `retry_at` keeps published rows out of `outbox_retrying`'s range.
            Mode::Mark => {
                "UPDATE outbox o JOIN JSON_TABLE(?, '$[*]' COLUMNS (seq BIGINT PATH '$')) AS p
                     ON o.seq = p.seq
                 SET o.published_at = UTC_TIMESTAMP(6), o.retry_at = NULL"
            }
            Mode::Delete => {
                "DELETE o FROM outbox o JOIN JSON_TABLE(?, '$[*]' COLUMNS (seq BIGINT PATH '$')) AS p
                     ON o.seq = p.seq"
            }
        };
        sqlx::query(super::on(table, sql, Backend::MySql))
            .bind(serde_json::to_string(&seqs).expect("integers serialize"))
            .execute(&mut *tx)
            .await?;
    }
    for (key, error, retry_in) in &outcome.failed {
        sqlx::query(super::on(
            table,
            "UPDATE outbox SET attempts = attempts + 1, last_error = ?,
                               retry_at = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND
             WHERE seq = ?",
            Backend::MySql,
        ))
        .bind(error)
        .bind(i64::try_from(retry_in.as_micros()).unwrap_or(i64::MAX))
        .bind(key.seq)
        .execute(&mut *tx)
        .await?;
    }
    for (key, reason) in &outcome.parked {
        sqlx::query(super::on(
            table,
            "UPDATE outbox SET attempts = attempts + 1, last_error = ?, parked_at = UTC_TIMESTAMP(6)
             WHERE seq = ?",
            Backend::MySql,
        ))
        .bind(reason)
        .bind(key.seq)
        .execute(&mut *tx)
        .await?;
    }
    Ok(())
}

/// Deletes up to `?2` published rows older than `?1` microseconds, oldest first, through
/// `outbox_unpublished`'s other end.
pub(super) const PRUNE_PUBLISHED: &str = "
DELETE FROM outbox WHERE published_at < UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND
ORDER BY published_at LIMIT ?";

/// The backlog, the parked events, the held ones, and the age in seconds of the oldest
/// unpublished one: counted in one read of the NULL prefix of `outbox_unpublished`, which holds
/// every column it needs (a tenth of reading each row: 17 against 210 ms for 200k on MariaDB,
/// every metrics interval), and one row read for the oldest one's time (`seq` and `created_at` are
/// given by the same insert).
pub(super) const BACKLOG: &str = "
WITH counted AS (
    SELECT COUNT(*) AS unpublished, SUM(parked_at IS NOT NULL) AS parked,
           SUM(parked_at IS NULL AND held_at IS NOT NULL) AS held,
           MIN(CASE WHEN parked_at IS NULL THEN seq END) AS oldest
    FROM outbox FORCE INDEX (outbox_unpublished) WHERE published_at IS NULL
)
SELECT CAST(c.unpublished - COALESCE(c.parked, 0) AS SIGNED), CAST(COALESCE(c.parked, 0) AS SIGNED),
       CAST(COALESCE(c.held, 0) AS SIGNED),
       TIMESTAMPDIFF(MICROSECOND, (SELECT o.created_at FROM outbox o WHERE o.seq = c.oldest),
                     UTC_TIMESTAMP(6)) * 1e-6
FROM counted c";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_claim_statement_writes_in_every_parameter_and_the_seqs_in_flight() {
        assert_eq!(MYSQL_CLAIM.matches('?').count(), 10);
        assert_eq!(MYSQL_CLAIM.matches(IN_FLIGHT_NONE).count(), 2);
        let claim = claim_statement(
            &TableName::DEFAULT,
            true,
            &[0xff, 0x01],
            500,
            1_000,
            4_000,
            &[7, 42],
        );
        assert!(!claim.contains('?'), "{claim}");
        assert_eq!(
            claim.matches("(TRUE OR b.parked_at IS NULL)").count(),
            2,
            "{claim}"
        );
        assert_eq!(claim.matches("SUBSTRING(X'FF01',").count(), 2, "{claim}");
        assert_eq!(claim.matches("LIMIT 500").count(), 2, "{claim}");
        assert!(claim.contains("r.position <= 500"), "{claim}");
        assert_eq!(claim.matches("<= 1000").count(), 2, "{claim}");
        assert!(claim.contains("running_bytes <= 4000"), "{claim}");
        assert_eq!(claim.matches("o.seq NOT IN (0,7,42)").count(), 2, "{claim}");
        let claim = claim_statement(&TableName::DEFAULT, false, &[], 1, 1, 1, &[]);
        assert_eq!(
            claim.matches("(FALSE OR b.parked_at IS NULL)").count(),
            2,
            "{claim}"
        );
        assert_eq!(claim.matches("o.seq NOT IN (0)").count(), 2, "{claim}");
    }
}
