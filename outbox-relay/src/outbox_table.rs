//! The relay's reads and writes of the `outbox` table, on PostgreSQL and SQLite.
//!
//! On both databases a claim is a plain read, and the outcome is written in one short transaction
//! after the broker answered: no relay transaction stays open while a broker is slow or away,
//! so the relay never pins PostgreSQL's xmin horizon (vacuum keeps cleaning the application's
//! tables). No row lock is needed: on PostgreSQL the replica's shard leases make it the only
//! publisher of its rows (`leases.rs`), and SQLite allows one relay per database.

use crate::database::{Backend, connect_postgres};
use futures::future::BoxFuture;
use sqlx::Connection;
use sqlx::postgres::PgConnection;
use sqlx::sqlite::SqliteConnection;
use uuid::Uuid;

/// An unpublished outbox row, as claimed.
#[derive(Debug, Clone)]
pub(crate) struct OutboxRow {
    pub id: String,
    pub seq: i64,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub event_type: String,
    pub event_version: i32,
    pub topic: Option<String>,
    /// The payload JSON, read once from the database and shared, not copied, from here to the
    /// sink. Empty when the row has a [`defect`](Self::defect).
    pub payload: bytes::Bytes,
    pub headers: Option<String>,
    /// Failed publish attempts so far.
    pub attempts: i32,
    /// When it was recorded, in milliseconds since the Unix epoch; `None` for a date that is not
    /// one (`infinity` on PostgreSQL, any text on SQLite): the row is published all the same.
    pub created_ms: Option<i64>,
    /// Why this row can never be published as it is, found while reading it: a column of the
    /// wrong type (SQLite stores whatever a hand-written row puts there), a payload that is not
    /// JSON or is over [`Limits::max_payload_bytes`]. The relay parks it with this reason.
    pub defect: Option<String>,
    /// A table-less event exactly as it was recorded (its JSON in the logical message, or the whole
    /// message when it cannot be read): what the WAL source keeps when it parks or holds the event,
    /// and publishes again from. `None` for a table row.
    pub recorded: Option<bytes::Bytes>,
}

#[cfg(test)]
impl OutboxRow {
    /// An `order` row of `aggregate_id`, for the ordering rules' unit tests.
    pub(crate) fn for_test(aggregate_id: &str, seq: i64, attempts: i32) -> OutboxRow {
        OutboxRow {
            id: format!("id-{seq}"),
            seq,
            aggregate_type: "order".into(),
            aggregate_id: aggregate_id.into(),
            event_type: "OrderPlaced".into(),
            event_version: 1,
            topic: None,
            payload: bytes::Bytes::from_static(b"{}"),
            headers: None,
            attempts,
            created_ms: None,
            defect: None,
            recorded: None,
        }
    }
}

/// Which row an outcome is about. PostgreSQL settles rows by `id`, its primary key (a uuid,
/// always readable); SQLite by `seq`, its primary key (an integer, readable where a hand-written
/// `id` may not be).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RowKey {
    pub id: String,
    pub seq: i64,
}

impl OutboxRow {
    pub fn key(&self) -> RowKey {
        RowKey {
            id: self.id.clone(),
            seq: self.seq,
        }
    }

    /// Reads one claimed row column by column. A column that cannot be read becomes the row's
    /// defect, so one bad row is parked instead of failing the claim for every aggregate.
    pub(crate) fn read<R>(row: &R, limits: &Limits) -> OutboxRow
    where
        R: sqlx::Row,
        for<'n> &'n str: sqlx::ColumnIndex<R>,
        for<'r> String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
        for<'r> i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
        for<'r> i32: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
        for<'r> bool: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    {
        let mut defect = None;
        let seq: i64 = column(row, "seq", &mut defect).unwrap_or(-1);
        let unreadable = || format!("<unreadable, seq {seq}>");
        let text = |name: &str, defect: &mut Option<String>| {
            column::<R, String>(row, name, defect).unwrap_or_else(unreadable)
        };
        let id = text("id", &mut defect);
        let aggregate_type = text("aggregate_type", &mut defect);
        let aggregate_id = text("aggregate_id", &mut defect);
        let event_type = text("event_type", &mut defect);
        let event_version = column(row, "event_version", &mut defect).unwrap_or(0);
        let topic = column(row, "topic", &mut defect).flatten();
        let headers = column(row, "headers", &mut defect).flatten();
        let attempts = column(row, "attempts", &mut defect).unwrap_or(0);
        let created_ms = column(row, "created_ms", &mut defect).flatten();
        let payload_bytes: i64 = column(row, "payload_bytes", &mut defect).unwrap_or(0);
        let payload_valid: bool = column(row, "payload_valid", &mut defect).unwrap_or(false);
        let payload: Option<String> = column(row, "payload", &mut defect).flatten();
        if defect.is_none() {
            defect = if payload_bytes > i64::try_from(limits.max_payload_bytes).unwrap_or(i64::MAX)
            {
                Some(format!(
                    "payload too large: {payload_bytes} bytes, over the relay's limit of {} (max_payload_bytes)",
                    limits.max_payload_bytes
                ))
            } else if !payload_valid || payload.is_none() {
                Some("payload is not valid JSON".to_owned())
            } else {
                None
            };
        }
        OutboxRow {
            id,
            seq,
            aggregate_type,
            aggregate_id,
            event_type,
            event_version,
            topic,
            payload: payload.map(bytes::Bytes::from).unwrap_or_default(),
            headers,
            attempts,
            created_ms,
            defect,
            recorded: None,
        }
    }
}

/// The value of column `name`, or `None` with the first such failure kept in `defect`.
fn column<'r, R, T>(row: &'r R, name: &str, defect: &mut Option<String>) -> Option<T>
where
    R: sqlx::Row,
    for<'n> &'n str: sqlx::ColumnIndex<R>,
    T: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    match row.try_get::<T, _>(name) {
        Ok(value) => Some(value),
        Err(e) => {
            defect.get_or_insert_with(|| format!("column `{name}` cannot be read: {e}"));
            None
        }
    }
}

/// What bounds a claim, whatever the table holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Limits {
    /// Rows per batch.
    pub batch_size: usize,
    /// Payload and header bytes per batch: the claim stops before the row that would pass it
    /// (a batch always takes its first row, which [`max_payload_bytes`](Self::max_payload_bytes)
    /// bounds).
    pub max_batch_bytes: usize,
    /// The largest payload published; a larger row is parked, and its payload is not even read.
    pub max_payload_bytes: usize,
}

/// What became of each claimed row.
#[derive(Debug, Default)]
pub(crate) struct Outcome {
    /// Acked by the broker: marked published (or deleted).
    pub published: Vec<RowKey>,
    /// Failed, to be tried again after a delay: attempts + 1, last error kept.
    pub failed: Vec<(RowKey, String, std::time::Duration)>,
    /// Can never be published as is: parked with the reason, holding back its aggregate.
    pub parked: Vec<(RowKey, String)>,
}

/// After publishing: mark rows published, or delete them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Set `published_at`; a pruning job deletes old rows later.
    #[default]
    Mark,
    /// Delete the row once the broker acked it.
    Delete,
}

/// One database connection of the relay. On PostgreSQL it also holds the shard leases, so losing
/// it loses the leases and the open claim together.
pub(crate) enum OutboxTable {
    Postgres(PgConnection),
    Sqlite(SqliteConnection),
}

/// Rows claimed for one batch.
pub(crate) struct Claim {
    pub rows: Vec<OutboxRow>,
    /// Whether the claim stopped at a limit (rows or bytes) with more rows waiting: the relay
    /// claims again at once.
    pub full: bool,
}

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
/// against the whole backlog (135,000 buffers and seconds per claim after a burst). `claimed` then
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
      AND NOT EXISTS (SELECT 1 FROM blocked b
                      WHERE b.aggregate_type = o.aggregate_type AND b.aggregate_id = o.aggregate_id)
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

/// The claim on SQLite, as [`PG_CLAIM`] (`?1` rows, `?2` hold parked, `?3` payload and `?4`
/// batch bytes, `?5` the seqs in flight as a JSON array); without locks, as one relay serves a SQLite database. Text columns of a
/// hand-written row may hold any type: the relay reads each row column by column.
const SQLITE_CLAIM: &str = "
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

impl OutboxTable {
    /// Opens the relay's connection to `url` (`postgres://…` or `sqlite:…`), failing after the
    /// URL's `connect_timeout` (see [`connect_timeout`]).
    pub async fn connect(url: &str) -> Result<Self, sqlx::Error> {
        match Backend::of(url) {
            Backend::Sqlite => Ok(OutboxTable::Sqlite(SqliteConnection::connect(url).await?)),
            Backend::Postgres => {
                let mut conn = connect_postgres(url).await?;
                sqlx::raw_sql(PG_SESSION).execute(&mut conn).await?;
                Ok(OutboxTable::Postgres(conn))
            }
        }
    }

    /// Claims the oldest unpublished rows of `shards` within `limits`, in `seq` order, skipping
    /// aggregates that have a row backing off, or a parked row when `hold_parked`, and the rows
    /// in `in_flight` (by `seq`). Each row is read on its own: a row that cannot be read comes back
    /// with its defect, and the claim goes on.
    pub async fn claim(
        &mut self,
        limits: &Limits,
        shards: &[i16],
        hold_parked: bool,
        in_flight: &[i64],
    ) -> Result<Claim, sqlx::Error> {
        let rows = i64::try_from(limits.batch_size).unwrap_or(i64::MAX);
        let payload_bytes = i64::try_from(limits.max_payload_bytes).unwrap_or(i64::MAX);
        let batch_bytes = i64::try_from(limits.max_batch_bytes).unwrap_or(i64::MAX);
        match self {
            OutboxTable::Postgres(conn) => {
                let (rows, full) = read_rows(
                    sqlx::query(PG_CLAIM)
                        .bind(shard_mask(shards))
                        .bind(rows)
                        .bind(hold_parked)
                        .bind(payload_bytes)
                        .bind(batch_bytes)
                        .bind(in_flight)
                        .fetch(&mut *conn),
                    limits,
                )
                .await?;
                Ok(Claim { rows, full })
            }
            OutboxTable::Sqlite(conn) => {
                let (rows, full) = read_rows(
                    sqlx::query(SQLITE_CLAIM)
                        .bind(rows)
                        .bind(hold_parked)
                        .bind(payload_bytes)
                        .bind(batch_bytes)
                        .bind(serde_json::to_string(in_flight).unwrap_or_default())
                        .fetch(&mut *conn),
                    limits,
                )
                .await?;
                Ok(Claim { rows, full })
            }
        }
    }

    /// Checks that the database answers.
    pub async fn ping(&mut self) -> Result<(), sqlx::Error> {
        match self {
            OutboxTable::Postgres(conn) => conn.ping().await,
            OutboxTable::Sqlite(conn) => conn.ping().await,
        }
    }

    /// The PostgreSQL connection, for the shard leases; `None` on SQLite.
    pub fn postgres(&mut self) -> Option<&mut PgConnection> {
        match self {
            OutboxTable::Postgres(conn) => Some(conn),
            OutboxTable::Sqlite(_) => None,
        }
    }
}

/// Runs `task` every `every` until `shutdown`, on a connection of its own that is opened again after
/// a failure. For the relay's background work (pruning, sampling the backlog): a failure is logged
/// and the task tried again at the next tick.
pub(crate) async fn every_tick(
    database_url: &str,
    every: std::time::Duration,
    shutdown: tokio_util::sync::CancellationToken,
    what: &str,
    mut task: impl for<'t> FnMut(&'t mut OutboxTable) -> BoxFuture<'t, Result<(), sqlx::Error>>,
) {
    let mut table = None;
    loop {
        if table.is_none() {
            table = OutboxTable::connect(database_url).await.ok();
        }
        if let Some(connected) = table.as_mut()
            && let Err(e) = task(connected).await
        {
            tracing::warn!(error = %e, "{what} failed; trying again at the next tick");
            table = None;
        }
        tokio::select! {
            () = tokio::time::sleep(every) => {}
            () = shutdown.cancelled() => return,
        }
    }
}

/// The claim's shard set as a 256-bit mask: bit `n % 8` of byte `n / 8` for shard `n`, which is
/// how PostgreSQL's `get_bit` numbers a `bytea`'s bits. A bit test costs the same for one shard or
/// all 256; `shard = ANY(array)` compared each row with every element (about 1 µs a row with 256).
pub(crate) fn shard_mask(shards: &[i16]) -> Vec<u8> {
    let mut mask = vec![0u8; 32];
    for &shard in shards {
        if let Ok(n) = usize::try_from(shard)
            && n < 256
        {
            mask[n / 8] |= 1 << (n % 8);
        }
    }
    mask
}

/// Reads the claimed rows as they arrive (so each row's raw bytes are freed once read), and
/// whether the claim stopped at a limit with more rows waiting.
async fn read_rows<R>(
    mut raw: futures::stream::BoxStream<'_, Result<R, sqlx::Error>>,
    limits: &Limits,
) -> Result<(Vec<OutboxRow>, bool), sqlx::Error>
where
    R: sqlx::Row,
    for<'n> &'n str: sqlx::ColumnIndex<R>,
    for<'r> String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> i32: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> bool: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    use futures::TryStreamExt;
    let mut rows = Vec::new();
    let mut candidates = 0;
    while let Some(row) = raw.try_next().await? {
        if rows.is_empty() {
            candidates = row
                .try_get::<i64, _>("candidates")
                .ok()
                .and_then(|n| usize::try_from(n).ok())
                .unwrap_or(0);
        }
        rows.push(OutboxRow::read(&row, limits));
    }
    let full = candidates >= limits.batch_size || rows.len() < candidates;
    Ok((rows, full))
}

impl OutboxTable {
    /// Records the outcome of a batch, in one short transaction.
    pub async fn settle(&mut self, outcome: &Outcome, mode: Mode) -> Result<(), sqlx::Error> {
        if outcome.published.is_empty() && outcome.failed.is_empty() && outcome.parked.is_empty() {
            return Ok(());
        }
        match self {
            OutboxTable::Postgres(conn) => {
                let mut tx = conn.begin().await?;
                settle_postgres(&mut tx, outcome, mode).await?;
                tx.commit().await
            }
            OutboxTable::Sqlite(conn) => {
                let mut tx = conn.begin().await?;
                settle_sqlite(&mut tx, outcome, mode).await?;
                tx.commit().await
            }
        }
    }
}

async fn settle_postgres(
    tx: &mut PgConnection,
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
        sqlx::query(sql).bind(ids).execute(&mut *tx).await?;
    }
    for (key, error, retry_in) in &outcome.failed {
        sqlx::query(
            "UPDATE outbox SET attempts = attempts + 1, last_error = $2, \
             retry_at = now() + make_interval(secs => $3) WHERE id = $1::uuid",
        )
        .bind(&key.id)
        .bind(error)
        .bind(retry_in.as_secs_f64())
        .execute(&mut *tx)
        .await?;
    }
    for (key, reason) in &outcome.parked {
        sqlx::query(
            "UPDATE outbox SET attempts = attempts + 1, last_error = $2, parked_at = now() WHERE id = $1::uuid",
        )
        .bind(&key.id)
        .bind(reason)
        .execute(&mut *tx)
        .await?;
    }
    Ok(())
}

async fn settle_sqlite(
    tx: &mut SqliteConnection,
    outcome: &Outcome,
    mode: Mode,
) -> Result<(), sqlx::Error> {
    for key in &outcome.published {
        let sql = match mode {
            Mode::Mark => {
                "UPDATE outbox SET published_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now'), retry_at = NULL \
                 WHERE seq = ?1"
            }
            Mode::Delete => "DELETE FROM outbox WHERE seq = ?1",
        };
        sqlx::query(sql).bind(key.seq).execute(&mut *tx).await?;
    }
    for (key, error, retry_in) in &outcome.failed {
        sqlx::query(
            "UPDATE outbox SET attempts = attempts + 1, last_error = ?2, \
             retry_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now', printf('+%.3f seconds', ?3)) WHERE seq = ?1",
        )
        .bind(key.seq)
        .bind(error)
        .bind(retry_in.as_secs_f64())
        .execute(&mut *tx)
        .await?;
    }
    for (key, reason) in &outcome.parked {
        sqlx::query(
            "UPDATE outbox SET attempts = attempts + 1, last_error = ?2, \
             parked_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now') WHERE seq = ?1",
        )
        .bind(key.seq)
        .bind(reason)
        .execute(&mut *tx)
        .await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shard_mask_sets_bit_n_mod_8_of_byte_n_div_8() {
        let mask = shard_mask(&[0, 9, 255]);
        assert_eq!(mask.len(), 32);
        assert_eq!(mask[0], 0b0000_0001);
        assert_eq!(mask[1], 0b0000_0010);
        assert_eq!(mask[31], 0b1000_0000);
        assert_eq!(mask.iter().map(|b| b.count_ones()).sum::<u32>(), 3);
        let all: Vec<i16> = (0..256).collect();
        assert!(shard_mask(&all).iter().all(|&b| b == 0xff));
    }

    mod any_row {
        //! Property: whatever values a hand-written row holds (SQLite stores any type in any
        //! column), the claim succeeds, returns the row, and the row is either a message or
        //! parked with a reason that names what is wrong; settling it by `seq` works.
        use super::super::*;
        use crate::routing::{DEFAULT_TOPIC_TEMPLATE, Router};
        use proptest::prelude::*;

        #[derive(Debug, Clone)]
        enum Value {
            Null,
            Integer(i64),
            Real(f64),
            Text(String),
            Blob(Vec<u8>),
        }

        fn value() -> impl Strategy<Value = Value> {
            prop_oneof![
                Just(Value::Null),
                any::<i64>().prop_map(Value::Integer),
                any::<f64>().prop_map(Value::Real),
                ".{0,40}".prop_map(Value::Text),
                "\\{\"[a-z]{0,5}\": [0-9]{1,3}\\}".prop_map(Value::Text),
                "[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"
                    .prop_map(Value::Text),
                proptest::collection::vec(any::<u8>(), 0..20).prop_map(Value::Blob),
            ]
        }

        /// A value for a NOT NULL column.
        fn present() -> impl Strategy<Value = Value> {
            value().prop_map(|v| match v {
                Value::Null => Value::Text(String::new()),
                v => v,
            })
        }

        fn bind<'q>(
            query: sqlx::query::Query<'q, sqlx::Sqlite, sqlx::sqlite::SqliteArguments>,
            value: &Value,
        ) -> sqlx::query::Query<'q, sqlx::Sqlite, sqlx::sqlite::SqliteArguments> {
            match value.clone() {
                Value::Null => query.bind(None::<String>),
                Value::Integer(n) => query.bind(n),
                Value::Real(x) => query.bind(x),
                Value::Text(t) => query.bind(t),
                Value::Blob(b) => query.bind(b),
            }
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(200))]
            #[test]
            fn any_values_are_claimed_and_published_or_parked(
                id in present(), aggregate_type in present(), aggregate_id in present(),
                event_type in present(), event_version in present(), topic in value(),
                payload in present(), headers in value(), created_at in present(),
            ) {
                let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
                runtime.block_on(async {
                    let mut conn = SqliteConnection::connect("sqlite::memory:").await.unwrap();
                    let schema = seaorm_outbox::schema::STEPS[0]
                        .up(seaorm_outbox::sea_orm::DbBackend::Sqlite)
                        .unwrap();
                    sqlx::raw_sql(schema).execute(&mut conn).await.unwrap();
                    let mut insert = sqlx::query(
                        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, \
                         event_version, topic, payload, headers, created_at) \
                         VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    );
                    for value in [&id, &aggregate_type, &aggregate_id, &event_type,
                                  &event_version, &topic, &payload, &headers, &created_at] {
                        insert = bind(insert, value);
                    }
                    insert.execute(&mut conn).await.unwrap();

                    let mut table = OutboxTable::Sqlite(conn);
                    let limits = Limits { batch_size: 10, max_batch_bytes: 1 << 20, max_payload_bytes: 1 << 20 };
                    let claim = table.claim(&limits, &[0], true, &[]).await.expect("the claim never fails");
                    assert_eq!(claim.rows.len(), 1);
                    let row = &claim.rows[0];
                    let router = Router::new(DEFAULT_TOPIC_TEMPLATE, false);
                    let mut outcome = Outcome::default();
                    match router.message(row) {
                        Ok(message) => {
                            assert!(row.defect.is_none());
                            assert_eq!(message.key, row.aggregate_id);
                            assert_eq!(message.payload, row.payload);
                            assert!(serde_json::from_slice::<serde_json::Value>(&message.payload).is_ok());
                            outcome.published.push(row.key());
                        }
                        Err(reason) => {
                            assert!(!reason.is_empty());
                            outcome.parked.push((row.key(), reason));
                        }
                    }
                    table.settle(&outcome, Mode::Mark).await.expect("settling by seq works");
                    let OutboxTable::Sqlite(conn) = &mut table else { unreachable!() };
                    let (done,): (i64,) = sqlx::query_as(
                        "SELECT count(*) FROM outbox WHERE published_at IS NOT NULL OR parked_at IS NOT NULL",
                    )
                    .fetch_one(&mut *conn)
                    .await
                    .unwrap();
                    assert_eq!(done, 1, "the row was settled");
                });
            }
        }
    }
}
