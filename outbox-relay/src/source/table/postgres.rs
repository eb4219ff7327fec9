//! The table source's SQL on PostgreSQL: the session settings, the claim, the settle.

use super::Mode;
use crate::batch::Outcome;
use crate::database::Backend;
use crate::row::RowKey;
use seaorm_outbox::TableName;
use sqlx::postgres::PgConnection;
use uuid::Uuid;

/// Set on the relay's PostgreSQL sessions, so the claim costs one batch whatever the statistics.
///
/// The claim must walk `outbox_claimable` in `seq` order, stop at the batch size, and check each
/// row's aggregate against the tiny `outbox_blocked` index. Two planner traps defeat that on a young
/// or suddenly grown table (measured in docs/BENCHMARKS.md):
/// - before autovacuum has analyzed it, the planner believes few rows are unpublished and fetches
///   them all to sort them: sorting is ruled out wherever an index gives the order (the claim
///   still sorts its one batch, the rows of its two walks together);
/// - a table never analyzed gets default estimates, by which the rows that block an aggregate
///   (`parked_at` or `retry_at` set: normally none) look like a fifth of the table, and reading
///   the whole table beats the `outbox_blocked` index: sequential scans are ruled out too. Every
///   relay statement has a partial index made for it (PostgreSQL still scans sequentially where
///   no index can serve).
///
/// With both ruled out, the claim ([`PG_CLAIM`]) has
/// one plan whatever its parameters and the table's size, so each statement is planned once per
/// connection (a generic plan; PostgreSQL plans it again after an `ANALYZE` of the table).
/// Planning the claim at every execution cost about as much as running it (1 ms per claim). The
/// plan made on an empty table stays cheap once the table fills (`outbox-relay/tests/pruning.rs`).
///
/// And one trap of PostgreSQL's defaults: the claim's estimated cost passes `jit_above_cost`, and
/// compiling it took 400 ms per claim for 5 ms of work (measured on PostgreSQL 15): JIT is off.
pub const PG_SESSION: &str = "SET enable_sort = off; SET enable_seqscan = off; \
     SET plan_cache_mode = force_generic_plan; SET jit = off";

/// The relay's claim query on PostgreSQL, for operators to `EXPLAIN` (after [`PG_SESSION`]).
///
/// It reads two short walks, never the backlog of the aggregates that wait:
/// - `walked`: the first `$2` rows of `outbox_claimable` (unpublished, not parked, held or
///   backing off) of the shards in `$1` (a `bytea` of 32 bytes, bit *n* set for shard *n* as
///   `get_bit` numbers them; every shard: `decode(repeat('ff', 32), 'hex')`), in `seq` order,
///   skipping the rows whose `seq` is in `$6` (`int8[]`: the batch in flight, not settled yet;
///   through a hashed subplan, one lookup per row: `seq <> ALL($6)` compared each row with every
///   element of the parameter, a million comparisons for batches of 1,000);
/// - `due`: at most `$2` rows backing off whose time has come, through `outbox_retrying`.
///
/// A walked row is *blocked* while an earlier row of its aggregate is unpublished and backing
/// off (due or not: a due one may be in flight), or parked and `$3` holds back parked aggregates,
/// or held: one probe of the small `outbox_blocked` index per row, and one of `outbox_held`,
/// skipped altogether (`gate`) while no row of the table blocks anything or is held. A hold can
/// outlive its blocker (an operator's `failed skip` that commits while a claim holds rows behind
/// the event it skips, after the command's release ran): until `RELEASE_UNBLOCKED` releases it,
/// the aggregate's later rows are held behind it, never sent ahead of it. The blocked rows are
/// *held* (`held_at` set) in the same statement, which takes them out of both walks: the next
/// claim goes past them, so a claim costs one batch however many aggregates wait and however many
/// rows they have (docs/BENCHMARKS.md, "Blocked aggregates"). A held row is released (`held_at` back to NULL) in the transaction that
/// removes its aggregate's blocker (the settle's release, `failed retry|skip`), or by
/// `RELEASE_UNBLOCKED` now and then; releasing is always safe, as the claim holds a row again
/// while its aggregate still waits. A due row and a walked row never share an aggregate (the due
/// one blocks the other), so the two walks merge by `seq` alone.
///
/// No row is locked: the caller holds the leases of those shards. The claimed rows are read with
/// every column the relay needs in that one pass, the payload converted to text once; a payload
/// larger than its share of the batch (`$5 / $2` bytes) is left for the final select to read, so
/// a claim holds at most about `$5` bytes. The rows returned are those whose payload and header
/// bytes, added up in `seq` order, stay within `$5` (and always the first): memory is bounded by
/// the settings, not by what the table holds. A payload over `$4` bytes is not read at all
/// (`payload` is NULL): the relay parks the row. `candidates` counts the rows the claim walked;
/// when it walked only blocked rows, one row with a NULL `id` carries it, so the caller claims
/// again at once instead of waiting for new rows.
pub const PG_CLAIM: &str = "
WITH gate AS MATERIALIZED (
    SELECT EXISTS (SELECT 1 FROM outbox a
                   WHERE (a.parked_at IS NOT NULL OR a.retry_at IS NOT NULL)
                     AND a.published_at IS NULL)
           OR EXISTS (SELECT 1 FROM outbox a WHERE a.held_at IS NOT NULL AND a.published_at IS NULL)
           AS blocking
), walked AS MATERIALIZED (
    SELECT o.id, o.seq, o.aggregate_type, o.aggregate_id, o.event_type, o.event_version,
           o.topic, o.headers::text AS headers, o.attempts, o.created_at,
           octet_length(t.payload)::int8 AS payload_bytes,
           CASE WHEN octet_length(t.payload) <= $5 / $2 THEN t.payload END AS small_payload,
           t.blocked
    FROM outbox o
    CROSS JOIN LATERAL (
        SELECT o.payload::text AS payload, (SELECT g.blocking FROM gate g) AND (EXISTS (
                SELECT 1 FROM outbox b
                WHERE b.aggregate_type = o.aggregate_type AND b.aggregate_id = o.aggregate_id
                  AND (b.parked_at IS NOT NULL OR b.retry_at IS NOT NULL)
                  AND b.published_at IS NULL AND b.seq < o.seq AND ($3 OR b.parked_at IS NULL)
             ) OR EXISTS (
                SELECT 1 FROM outbox h
                WHERE h.aggregate_type = o.aggregate_type AND h.aggregate_id = o.aggregate_id
                  AND h.held_at IS NOT NULL AND h.published_at IS NULL AND h.seq < o.seq
             )) AS blocked
        OFFSET 0) t
    WHERE o.published_at IS NULL AND o.parked_at IS NULL AND o.held_at IS NULL
      AND o.retry_at IS NULL AND get_bit($1, o.shard) = 1
      AND o.seq NOT IN (SELECT unnest($6))
    ORDER BY o.seq
    LIMIT $2
), due AS MATERIALIZED (
    SELECT o.id, o.seq, o.aggregate_type, o.aggregate_id, o.event_type, o.event_version,
           o.topic, o.headers::text AS headers, o.attempts, o.created_at,
           octet_length(t.payload)::int8 AS payload_bytes,
           CASE WHEN octet_length(t.payload) <= $5 / $2 THEN t.payload END AS small_payload,
           t.blocked
    FROM outbox o
    CROSS JOIN LATERAL (
        SELECT o.payload::text AS payload, EXISTS (
                SELECT 1 FROM outbox b
                WHERE b.aggregate_type = o.aggregate_type AND b.aggregate_id = o.aggregate_id
                  AND (b.parked_at IS NOT NULL OR b.retry_at IS NOT NULL)
                  AND b.published_at IS NULL AND b.seq < o.seq AND ($3 OR b.parked_at IS NULL)
             ) OR EXISTS (
                SELECT 1 FROM outbox h
                WHERE h.aggregate_type = o.aggregate_type AND h.aggregate_id = o.aggregate_id
                  AND h.held_at IS NOT NULL AND h.published_at IS NULL AND h.seq < o.seq
             ) AS blocked
        OFFSET 0) t
    WHERE o.retry_at <= now() AND o.published_at IS NULL AND o.parked_at IS NULL
      AND o.held_at IS NULL AND get_bit($1, o.shard) = 1
      AND o.seq NOT IN (SELECT unnest($6))
    ORDER BY o.retry_at
    LIMIT $2
), held AS (
    UPDATE outbox o SET held_at = now()
    FROM (SELECT w.id FROM walked w WHERE w.blocked
          UNION ALL SELECT d.id FROM due d WHERE d.blocked) h
    WHERE o.id = h.id
), sized AS (
    -- int4 terms: their sum is a fast int8, not a numeric.
    SELECT c.*, sum((CASE WHEN c.payload_bytes <= $4 THEN c.payload_bytes ELSE 0 END
                     + coalesce(octet_length(c.headers), 0))::int4) OVER w AS running_bytes,
           row_number() OVER w AS position,
           (SELECT count(*) FROM walked) + (SELECT count(*) FROM due) AS candidates
    FROM (
        SELECT u.* FROM (
            SELECT w.id, w.seq, w.aggregate_type, w.aggregate_id, w.event_type, w.event_version,
                   w.topic, w.headers, w.attempts, w.created_at, w.payload_bytes, w.small_payload
            FROM walked w WHERE NOT w.blocked
            UNION ALL
            SELECT d.id, d.seq, d.aggregate_type, d.aggregate_id, d.event_type, d.event_version,
                   d.topic, d.headers, d.attempts, d.created_at, d.payload_bytes, d.small_payload
            FROM due d WHERE NOT d.blocked
            UNION ALL
            -- Only blocked rows walked: a row of no event, sorted last, to carry `candidates`.
            SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL
            WHERE NOT EXISTS (SELECT 1 FROM walked w WHERE NOT w.blocked)
              AND NOT EXISTS (SELECT 1 FROM due d WHERE NOT d.blocked)
              AND (EXISTS (SELECT 1 FROM walked) OR EXISTS (SELECT 1 FROM due))
        ) u
        ORDER BY u.seq
        LIMIT $2
    ) c
    WINDOW w AS (ORDER BY c.seq)
)
SELECT s.id::text AS id, s.seq, s.aggregate_type, s.aggregate_id, s.event_type, s.event_version,
       s.topic,
       CASE WHEN s.payload_bytes <= $4
            THEN coalesce(s.small_payload, (SELECT o.payload::text FROM outbox o WHERE o.id = s.id))
       END AS payload,
       s.payload_bytes, s.headers, s.attempts,
       CASE WHEN isfinite(s.created_at) THEN (extract(epoch FROM s.created_at) * 1000)::int8 END AS created_ms,
       true AS payload_valid, s.candidates
FROM sized s
WHERE s.running_bytes <= $5 OR s.position = 1
ORDER BY s.seq";

/// Whether the outbox table has schema version 3 (the claim's index `outbox_claimable`): its
/// indexes are found by the table's row type, as an index's name alone may name another schema's.
const HAS_CLAIMABLE: &str = "
SELECT EXISTS (
    SELECT 1 FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
    WHERE i.indrelid = (SELECT t.typrelid FROM pg_type t WHERE t.oid = pg_typeof(NULL::outbox))
      AND c.relname LIKE '%\\_claimable')";

/// Refuses a table without schema version 3: the claim reads `held_at` and its indexes. A table
/// that does not exist is left to the claim, which fails until it is created.
pub(super) async fn check_schema(
    conn: &mut PgConnection,
    table: &TableName,
) -> Result<Option<String>, sqlx::Error> {
    match sqlx::query_scalar::<_, bool>(super::on(table, HAS_CLAIMABLE, Backend::Postgres))
        .fetch_one(conn)
        .await
    {
        Ok(true) => Ok(None),
        Ok(false) => Ok(Some(format!(
            "the outbox table {table} has no index outbox_claimable: the relay needs schema \
             version 3 (run `outbox-relay migrate`, or apply outbox-core/sql/postgres/0003_claimable.sql)"
        ))),
        // 42704: no such type, as no such table.
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42704") => Ok(None),
        Err(e) => Err(e),
    }
}

/// Writes a batch's outcome (in the caller's transaction), first releasing the rows held behind
/// `released`: rows that blocked their aggregate and stop blocking it with this outcome.
pub(super) async fn settle(
    tx: &mut PgConnection,
    table: &TableName,
    outcome: &Outcome,
    mode: Mode,
    released: &[RowKey],
) -> Result<(), sqlx::Error> {
    if !released.is_empty() {
        let ids: Vec<Uuid> = released
            .iter()
            .filter_map(|key| Uuid::parse_str(&key.id).ok())
            .collect();
        sqlx::query(super::on(table, RELEASE_HELD, Backend::Postgres))
            .bind(ids)
            .execute(&mut *tx)
            .await?;
    }
    if !outcome.published.is_empty() {
        let ids: Vec<Uuid> = outcome
            .published
            .iter()
            .filter_map(|key| Uuid::parse_str(&key.id).ok())
            .collect();
        let sql = match mode {
            // Clearing `retry_at` keeps published rows out of `outbox_blocked`, which the claim reads.
            Mode::Mark => {
                "UPDATE outbox SET published_at = now(), retry_at = NULL WHERE id = ANY($1)"
            }
            Mode::Delete => "DELETE FROM outbox WHERE id = ANY($1)",
        };
        sqlx::query(super::on(table, sql, Backend::Postgres))
            .bind(ids)
            .execute(&mut *tx)
            .await?;
    }
    for (key, error, retry_in) in &outcome.failed {
        sqlx::query(super::on(
            table,
            "UPDATE outbox SET attempts = attempts + 1, last_error = $2, \
             retry_at = now() + make_interval(secs => $3) WHERE id = $1::uuid",
            Backend::Postgres,
        ))
        .bind(&key.id)
        .bind(error)
        .bind(retry_in.as_secs_f64())
        .execute(&mut *tx)
        .await?;
    }
    for (key, reason) in &outcome.parked {
        sqlx::query(super::on(
            table,
            "UPDATE outbox SET attempts = attempts + 1, last_error = $2, parked_at = now() WHERE id = $1::uuid",
            Backend::Postgres,
        ))
        .bind(&key.id)
        .bind(reason)
        .execute(&mut *tx)
        .await?;
    }
    Ok(())
}

/// Releases the rows held behind the rows `$1` (`uuid[]`): every held row of their aggregates.
const RELEASE_HELD: &str = "
UPDATE outbox o SET held_at = NULL
FROM outbox r
WHERE r.id = ANY($1) AND o.aggregate_type = r.aggregate_type AND o.aggregate_id = r.aggregate_id
  AND o.held_at IS NOT NULL AND o.published_at IS NULL";

/// Releases the held rows of the shards in `$1` that nothing blocks any more, with parked
/// aggregates held back if `$2`: the safety net behind the releases made where a blocker goes (an
/// operator's `failed skip` committed while a claim held rows behind the event it skipped), and
/// what a relay started with `--skip-parked` releases of the rows held behind parked events. A
/// held row blocks the claim, not this release: an aggregate's rows held behind a blocker that
/// went are released together, and the claim takes them in `seq` order. Its cost is one probe
/// per held row.
pub(super) const RELEASE_UNBLOCKED: &str = "
UPDATE outbox o SET held_at = NULL
WHERE o.held_at IS NOT NULL AND o.published_at IS NULL AND get_bit($1, o.shard) = 1
  AND NOT EXISTS (
      SELECT 1 FROM outbox b
      WHERE b.aggregate_type = o.aggregate_type AND b.aggregate_id = o.aggregate_id
        AND (b.parked_at IS NOT NULL OR b.retry_at IS NOT NULL)
        AND b.published_at IS NULL AND b.seq < o.seq AND ($2 OR b.parked_at IS NULL))";

/// Deletes up to `$2` published rows older than `$1` seconds, oldest first, through the partial
/// index `outbox_published`; rows another pruner holds are skipped.
pub(super) const PRUNE_PUBLISHED: &str = "
DELETE FROM outbox WHERE id IN (
    SELECT id FROM outbox WHERE published_at < now() - make_interval(secs => $1)
    ORDER BY published_at LIMIT $2 FOR UPDATE SKIP LOCKED)";

/// The WAL source's pruning: deletes up to `$2` rows whose UUIDv7 id is below `$1` and which were
/// created before `$3`, through the primary key, keeping parked and held rows. The id finds the
/// old rows in the index; `created_at` keeps a young row whose id is not a UUIDv7 (another
/// writer's random UUID) and sorts low. The delete checks parked and held again: a row the
/// source parks or holds while the pruner picks it stays.
pub(super) const PRUNE_READ: &str = "
DELETE FROM outbox WHERE id IN (
    SELECT id FROM outbox WHERE id < $1 AND created_at < $3 AND parked_at IS NULL AND held_at IS NULL
    ORDER BY id LIMIT $2)
  AND parked_at IS NULL AND held_at IS NULL";

/// The backlog, the parked events, the held ones, and the age in seconds of the oldest
/// unpublished one.
pub(super) const BACKLOG: &str = "
SELECT count(*) FILTER (WHERE parked_at IS NULL),
       count(*) FILTER (WHERE parked_at IS NOT NULL),
       count(*) FILTER (WHERE parked_at IS NULL AND held_at IS NOT NULL),
       (extract(epoch FROM now())
        - extract(epoch FROM min(created_at) FILTER (WHERE parked_at IS NULL)))::float8
FROM outbox WHERE published_at IS NULL";
