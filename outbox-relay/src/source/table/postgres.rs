//! The table source's SQL on PostgreSQL: the session settings, the claim, the settle.

use super::Mode;
use crate::batch::Outcome;
use crate::database::Backend;
use seaorm_outbox::TableName;
use sqlx::postgres::PgConnection;
use uuid::Uuid;

/// Set on the relay's PostgreSQL sessions, so the claim costs one batch whatever the statistics.
///
/// The claim must walk `outbox_unpublished` in `seq` order, stop at the batch size, and check each
/// row's aggregate against the tiny `outbox_blocked` index. Two planner traps defeat that on a young
/// or suddenly grown table (measured in docs/BENCHMARKS.md):
/// - before autovacuum has analyzed it, the planner believes few rows are unpublished and fetches
///   them all to sort them: no relay statement needs a sort, so sorting is ruled out;
/// - a table never analyzed gets default estimates, by which the rows that block an aggregate
///   (`parked_at` or `retry_at` set: normally none) look like a fifth of the table, and reading
///   the whole table beats the `outbox_blocked` index: sequential scans are ruled out too. Every
///   relay statement has a partial index made for it (PostgreSQL still scans sequentially where
///   no index can serve).
///
/// With both ruled out, and the blocked aggregates computed first ([`PG_CLAIM`]), the claim has
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
/// `blocked` lists the aggregates that must wait: a row of theirs backing off (`retry_at` ahead)
/// or, when `$3` holds back parked aggregates, parked. It is computed first, from the rows `held`
/// finds through the small `outbox_blocked` index: the `held` fence keeps the planner off
/// `outbox_unpublished` there, which stale statistics made it prefer, checking every claimed row
/// against the whole backlog (135,000 buffers and seconds per claim after a burst). Each walked
/// row's aggregate is looked up in `blocked` by hash (`NOT IN`, a hashed subplan): `NOT EXISTS`
/// let the planner, which expects few blocked aggregates, compare each row with every one of
/// them, and with 10,000 aggregates parked ahead of the free ones a claim took 9 minutes instead
/// of 0.4 s (docs/BENCHMARKS.md, "Blocked aggregates"). `claimed` then
/// finds the oldest rows of the shards in `$1` (a `bytea` of 32 bytes, bit *n* set for shard *n* as
/// `get_bit` numbers them; every shard: `decode(repeat('ff', 32), 'hex')`), at most `$2`, of aggregates not
/// blocked, skipping the rows whose `seq` is in `$6` (`int8[]`: the batch in flight, not settled
/// yet; through a hashed subplan, one lookup per row: `seq <> ALL($6)` compared each row with
/// every element of the parameter, a million comparisons for batches of 1,000). No row is locked: the caller holds the leases of
/// those shards. `claimed` reads every column the relay needs in that one pass, the payload
/// converted to text once; a payload larger than its share of the batch (`$5 / $2` bytes) is left
/// for the final select to read, so `claimed` holds at most about `$5` bytes. The rows returned
/// are those whose payload and header bytes, added up in `seq` order, stay within `$5` (and always
/// the first): memory is bounded by the settings, not by what the table holds. A payload over `$4`
/// bytes is not read at all (`payload` is NULL): the relay parks the row.
pub const PG_CLAIM: &str = "
WITH held AS MATERIALIZED (
    SELECT p.aggregate_type, p.aggregate_id, p.published_at, p.retry_at, p.parked_at
    FROM outbox p
    WHERE p.parked_at IS NOT NULL OR p.retry_at IS NOT NULL
), blocked AS MATERIALIZED (
    SELECT DISTINCT h.aggregate_type, h.aggregate_id
    FROM held h
    WHERE h.published_at IS NULL AND (h.retry_at > now() OR ($3 AND h.parked_at IS NOT NULL))
), claimed AS MATERIALIZED (
    SELECT o.id, o.seq, o.aggregate_type, o.aggregate_id, o.event_type, o.event_version, o.topic,
           o.headers::text AS headers, o.attempts, o.created_at,
           octet_length(t.payload)::int8 AS payload_bytes,
           CASE WHEN octet_length(t.payload) <= $5 / $2 THEN t.payload END AS small_payload
    FROM outbox o CROSS JOIN LATERAL (SELECT o.payload::text AS payload OFFSET 0) t
    WHERE o.published_at IS NULL AND o.parked_at IS NULL AND get_bit($1, o.shard) = 1
      AND o.seq NOT IN (SELECT unnest($6))
      AND (o.aggregate_type, o.aggregate_id) NOT IN (SELECT b.aggregate_type, b.aggregate_id FROM blocked b)
    ORDER BY o.seq
    LIMIT $2
), sized AS (
    -- int4 terms: their sum is a fast int8, not a numeric.
    SELECT c.*, sum((CASE WHEN c.payload_bytes <= $4 THEN c.payload_bytes ELSE 0 END
                     + coalesce(octet_length(c.headers), 0))::int4) OVER w AS running_bytes,
           row_number() OVER w AS position,
           (SELECT count(*) FROM claimed) AS candidates
    FROM claimed c
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

/// Writes a batch's outcome (in the caller's transaction).
pub(super) async fn settle(
    tx: &mut PgConnection,
    table: &TableName,
    outcome: &Outcome,
    mode: Mode,
) -> Result<(), sqlx::Error> {
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

/// Deletes up to `$2` published rows older than `$1` seconds, oldest first, through the partial
/// index `outbox_published`; rows another pruner holds are skipped.
pub(super) const PRUNE_PUBLISHED: &str = "
DELETE FROM outbox WHERE id IN (
    SELECT id FROM outbox WHERE published_at < now() - make_interval(secs => $1)
    ORDER BY published_at LIMIT $2 FOR UPDATE SKIP LOCKED)";

/// The WAL source's pruning: deletes up to `$2` rows whose UUIDv7 id is below `$1`, through the
/// primary key, keeping parked and held rows.
pub(super) const PRUNE_READ: &str = "
DELETE FROM outbox WHERE id IN (
    SELECT id FROM outbox WHERE id < $1 AND parked_at IS NULL AND held_at IS NULL
    ORDER BY id LIMIT $2)";

/// The backlog, the parked events, and the age in seconds of the oldest unpublished one.
pub(super) const BACKLOG: &str = "
SELECT count(*) FILTER (WHERE parked_at IS NULL),
       count(*) FILTER (WHERE parked_at IS NOT NULL),
       (extract(epoch FROM now())
        - extract(epoch FROM min(created_at) FILTER (WHERE parked_at IS NULL)))::float8
FROM outbox WHERE published_at IS NULL";
