//! The table source's SQL on MySQL and MariaDB: the session, the claim and the settle. Written
//! in the SQL both accept (MySQL 8.0.16+, MariaDB 10.6+; the tests run on MariaDB 10.11). The
//! replicas share the work through shard leases, named locks (`leases/mysql.rs`).

use super::Mode;
use crate::batch::Outcome;
use crate::database::Backend;
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
/// set for shard `n`; every shard: `UNHEX(REPEAT('FF', 32))`), rows, payload bytes (twice), batch
/// bytes. The seqs in flight are no parameter: the relay writes them into the list
/// `o.seq NOT IN (0)` as integers (`seq` starts at 1), because MariaDB checks a list of constants in
/// the index (index condition pushdown) and skips the rows in flight without reading them; a
/// bound list (a JSON array through `JSON_TABLE`, a subquery) is checked only after each row is
/// read by primary key, which was 5.9 of the claim's 6.9 ms with a batch of 500 in flight.
/// `payload_valid` is NULL: the relay checks the payload is JSON itself, as
/// `JSON_VALID` per row cost the database a third of the claim (the schema's `CHECK` refuses
/// invalid JSON anyway, unless checks were turned off).
///
/// `blocked` lists the aggregates that must wait, found through `outbox_retrying` and
/// `outbox_parked` among the rows with the column set (normally none), never among every row:
/// looked up per candidate instead, the rule walked each aggregate's whole history, and a
/// semi-join walked the whole backlog. `claimed` then reads the oldest unpublished rows in `seq`
/// order from the NULL prefix of `outbox_unpublished`, so the claim's cost follows the batch, not
/// the table (`tests/mariadb.rs` checks the plan). That index is forced: with a published history
/// before the backlog, MariaDB preferred walking the primary key in `seq` order, through every
/// published row, to stop at the batch size. No row lock: the replica's shard leases make it the
/// only publisher of those rows.
pub const MYSQL_CLAIM: &str = "
WITH blocked AS (
    SELECT p.aggregate_type, p.aggregate_id FROM outbox p
    WHERE p.retry_at > UTC_TIMESTAMP(6) AND p.published_at IS NULL
    UNION
    SELECT p.aggregate_type, p.aggregate_id FROM outbox p
    WHERE ? AND p.parked_at IS NOT NULL AND p.published_at IS NULL
), claimed AS (
    SELECT o.seq, LENGTH(o.payload) AS payload_bytes, COALESCE(LENGTH(o.headers), 0) AS header_bytes
    FROM outbox o FORCE INDEX (outbox_unpublished)
    WHERE o.published_at IS NULL AND o.parked_at IS NULL
      AND (ASCII(SUBSTRING(?, (o.shard DIV 8) + 1, 1)) >> (o.shard % 8)) & 1 = 1
      AND o.seq NOT IN (0)
      AND (o.aggregate_type, o.aggregate_id) NOT IN
          (SELECT b.aggregate_type, b.aggregate_id FROM blocked b)
    ORDER BY o.seq
    LIMIT ?
), sized AS (
    SELECT c.*, SUM(CASE WHEN c.payload_bytes <= ? THEN c.payload_bytes ELSE 0 END + c.header_bytes)
                    OVER (ORDER BY c.seq) AS running_bytes,
           ROW_NUMBER() OVER (ORDER BY c.seq) AS position,
           COUNT(*) OVER () AS candidates
    FROM claimed c
)
SELECT o.id, o.seq, o.aggregate_type, o.aggregate_id, o.event_type, o.event_version, o.topic,
       CASE WHEN s.payload_bytes <= ? THEN o.payload END AS payload,
       CAST(s.payload_bytes AS SIGNED) AS payload_bytes, o.headers, o.attempts,
       CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', o.created_at) DIV 1000 AS SIGNED)
           AS created_ms,
       NULL AS payload_valid,
       CAST(s.candidates AS SIGNED) AS candidates
FROM sized s JOIN outbox o ON o.seq = s.seq
WHERE s.running_bytes <= ? OR s.position = 1
ORDER BY s.seq";

/// [`MYSQL_CLAIM`] on `table` as the relay sends it, one text query: its parameters written in as
/// literals (a bool, the mask in hex, integers), in their order, and the seqs `in_flight` added
/// to its `NOT IN (0)` list. Not a prepared statement: with a text that changes every claim it
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
    let values = [
        hold_parked.to_string().to_uppercase(),
        format!("X'{mask}'"),
        rows.to_string(),
        payload_bytes.to_string(),
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
    claim.replacen(IN_FLIGHT_NONE, &list, 1)
}

/// Where [`claim_statement`] writes the seqs in flight.
const IN_FLIGHT_NONE: &str = "o.seq NOT IN (0)";

/// Writes a batch's outcome (in the caller's transaction): the published rows in one statement,
/// by `seq` (the primary key).
pub(super) async fn settle(
    tx: &mut MySqlConnection,
    table: &TableName,
    outcome: &Outcome,
    mode: Mode,
) -> Result<(), sqlx::Error> {
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

/// The backlog, the parked events, none held (the claim holds no rows here), and the age in
/// seconds of the oldest unpublished one, from
/// the indexes alone but one row: the unpublished rows counted in `outbox_unpublished` (a
/// tenth of reading each row: 17 against 210 ms for 200k on MariaDB, every metrics interval),
/// the parked ones in `outbox_parked`, and the oldest taken as the first in `seq` order (`seq`
/// and `created_at` are given by the same insert).
pub(super) const BACKLOG: &str = "
WITH parked AS (
    SELECT COUNT(*) AS n FROM outbox WHERE parked_at IS NOT NULL AND published_at IS NULL
)
SELECT CAST((SELECT COUNT(*) FROM outbox FORCE INDEX (outbox_unpublished)
             WHERE published_at IS NULL) - parked.n AS SIGNED),
       CAST(parked.n AS SIGNED),
       CAST(0 AS SIGNED),
       TIMESTAMPDIFF(MICROSECOND,
                     (SELECT o.created_at FROM outbox o FORCE INDEX (outbox_unpublished)
                      WHERE o.published_at IS NULL AND o.parked_at IS NULL ORDER BY o.seq LIMIT 1),
                     UTC_TIMESTAMP(6)) * 1e-6
FROM parked";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_claim_statement_writes_in_every_parameter_and_the_seqs_in_flight() {
        assert_eq!(MYSQL_CLAIM.matches('?').count(), 6);
        assert_eq!(MYSQL_CLAIM.matches(IN_FLIGHT_NONE).count(), 1);
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
        assert!(claim.contains("WHERE TRUE AND p.parked_at"), "{claim}");
        assert!(claim.contains("SUBSTRING(X'FF01',"), "{claim}");
        assert!(claim.contains("LIMIT 500"), "{claim}");
        assert_eq!(claim.matches("<= 1000").count(), 2, "{claim}");
        assert!(claim.contains("running_bytes <= 4000"), "{claim}");
        assert!(claim.contains("o.seq NOT IN (0,7,42)"), "{claim}");
        let claim = claim_statement(&TableName::DEFAULT, false, &[], 1, 1, 1, &[]);
        assert!(claim.contains("WHERE FALSE AND p.parked_at"), "{claim}");
        assert!(claim.contains("o.seq NOT IN (0)"), "{claim}");
    }
}
