//! The relay's reads and writes of the `outbox` table, on PostgreSQL and SQLite.
//!
//! PostgreSQL: the claim is a transaction: rows are locked (`FOR UPDATE SKIP LOCKED`) while they are
//! published, and the same transaction marks them. SQLite allows one relay and one writer at a
//! time, so rows are read without a transaction and marked in a short one after publishing, leaving
//! the database free for the application while the broker answers.

use futures::future::BoxFuture;
use sqlx::postgres::PgConnection;
use sqlx::sqlite::SqliteConnection;
use sqlx::{Connection, FromRow, Postgres, Transaction};
use std::time::Duration;
use uuid::Uuid;

/// An unpublished outbox row, as claimed.
#[derive(Debug, Clone, FromRow)]
pub(crate) struct OutboxRow {
    pub id: String,
    pub seq: i64,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub event_type: String,
    pub event_version: i32,
    pub topic: Option<String>,
    pub payload: String,
    pub headers: Option<String>,
    /// Failed publish attempts so far.
    pub attempts: i32,
    /// When it was recorded, in milliseconds since the Unix epoch; `None` for a date that is not
    /// one (`infinity` on PostgreSQL, any text on SQLite): the row is published all the same.
    pub created_ms: Option<i64>,
    /// Whether the payload is JSON: always on PostgreSQL (jsonb), checked by SQLite's
    /// `json_valid` there, where a TEXT column written by hand may hold anything.
    pub payload_valid: bool,
}

/// What became of each claimed row.
#[derive(Debug, Default)]
pub(crate) struct Outcome {
    /// Acked by the broker: marked published (or deleted).
    pub published: Vec<String>,
    /// Failed, to be tried again after a delay: attempts + 1, last error kept.
    pub failed: Vec<(String, String, std::time::Duration)>,
    /// Can never be published as is: parked with the reason, holding back its aggregate.
    pub parked: Vec<(String, String)>,
}

/// After publishing: mark rows published, or delete them.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Default,
    serde::Serialize,
    serde::Deserialize,
    clap::ValueEnum,
)]
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

/// Rows claimed for one batch, and what holds them until [`Claim::settle`].
pub(crate) struct Claim<'c> {
    pub rows: Vec<OutboxRow>,
    held: Held<'c>,
}

enum Held<'c> {
    Postgres(Transaction<'c, Postgres>),
    Sqlite(&'c mut SqliteConnection),
}

/// Set on the relay's PostgreSQL sessions, so the claim costs one batch whatever the statistics.
///
/// The claim must walk `outbox_unpublished` in `seq` order, stop at the batch size, and check each
/// row's aggregate against the tiny `outbox_blocked` index. Two planner traps defeat that on a young
/// or suddenly grown table (measured in docs/BENCHMARKS.md):
/// - before autovacuum has analyzed it, the planner believes few rows are unpublished and fetches
///   them all to sort them: no relay statement needs a sort, so sorting is ruled out;
/// - a generic plan, cached by the prepared statement while the table was empty, may check the
///   aggregate by scanning every unpublished row: plans are made for each execution instead.
pub const PG_SESSION: &str = "SET enable_sort = off; SET plan_cache_mode = force_custom_plan";

/// The relay's claim query on PostgreSQL, for operators to `EXPLAIN` (after [`PG_SESSION`]): the oldest rows of the shards
/// in `$1` (`smallint[]`), at most `$2`, whose aggregate is not blocked: no row of it backing off
/// (`retry_at` ahead) or, when `$3` holds back parked aggregates, parked.
pub const PG_CLAIM: &str = "
SELECT o.id::text AS id, o.seq, o.aggregate_type, o.aggregate_id, o.event_type, o.event_version,
       o.topic, o.payload::text AS payload, o.headers::text AS headers, o.attempts,
       CASE WHEN isfinite(o.created_at) THEN (extract(epoch FROM o.created_at) * 1000)::int8 END AS created_ms,
       true AS payload_valid
FROM outbox o
WHERE o.published_at IS NULL AND o.parked_at IS NULL AND o.shard = ANY($1)
  AND NOT EXISTS (SELECT 1 FROM outbox p
                  WHERE p.aggregate_type = o.aggregate_type AND p.aggregate_id = o.aggregate_id
                    AND p.published_at IS NULL
                    AND (p.retry_at > now() OR ($3 AND p.parked_at IS NOT NULL)))
ORDER BY o.seq
LIMIT $2
FOR UPDATE OF o SKIP LOCKED";

const SQLITE_CLAIM: &str = "
SELECT o.id, o.seq, o.aggregate_type, o.aggregate_id, o.event_type, o.event_version,
       o.topic, o.payload, o.headers, o.attempts,
       CAST((julianday(o.created_at) - 2440587.5) * 86400000 AS INTEGER) AS created_ms,
       json_valid(o.payload) AS payload_valid
FROM outbox o
WHERE o.published_at IS NULL AND o.parked_at IS NULL
  AND NOT EXISTS (SELECT 1 FROM outbox p
                  WHERE p.aggregate_type = o.aggregate_type AND p.aggregate_id = o.aggregate_id
                    AND p.published_at IS NULL
                    AND (p.retry_at > strftime('%Y-%m-%dT%H:%M:%fZ', 'now') OR (?2 AND p.parked_at IS NOT NULL)))
ORDER BY o.seq
LIMIT ?1";

impl OutboxTable {
    /// Opens the relay's connection to `url` (`postgres://…` or `sqlite:…`), failing after the
    /// URL's `connect_timeout` (see [`connect_timeout`]).
    pub async fn connect(url: &str) -> Result<Self, sqlx::Error> {
        if url.starts_with("sqlite:") {
            return Ok(OutboxTable::Sqlite(SqliteConnection::connect(url).await?));
        }
        let (options, timeout) = postgres_options(url)?;
        let connect = async {
            let mut conn = PgConnection::connect_with(&options).await?;
            sqlx::raw_sql(PG_SESSION).execute(&mut conn).await?;
            Ok(OutboxTable::Postgres(conn))
        };
        tokio::time::timeout(timeout, connect)
            .await
            .unwrap_or_else(|_| {
                Err(sqlx::Error::Io(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("the database did not answer within {timeout:?} (connect_timeout)"),
                )))
            })
    }

    /// Claims up to `limit` unpublished rows of `shards`, in `seq` order, skipping aggregates that
    /// have a row backing off, or a parked row when `hold_parked`.
    pub async fn claim(
        &mut self,
        limit: usize,
        shards: &[i16],
        hold_parked: bool,
    ) -> Result<Claim<'_>, sqlx::Error> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        match self {
            OutboxTable::Postgres(conn) => {
                let mut tx = conn.begin().await?;
                let rows = sqlx::query_as(PG_CLAIM)
                    .bind(shards)
                    .bind(limit)
                    .bind(hold_parked)
                    .fetch_all(&mut *tx)
                    .await?;
                Ok(Claim {
                    rows,
                    held: Held::Postgres(tx),
                })
            }
            OutboxTable::Sqlite(conn) => {
                let rows = sqlx::query_as(SQLITE_CLAIM)
                    .bind(limit)
                    .bind(hold_parked)
                    .fetch_all(&mut *conn)
                    .await?;
                Ok(Claim {
                    rows,
                    held: Held::Sqlite(conn),
                })
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

/// How long a connection attempt may take by default.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Splits libpq's `connect_timeout` parameter (whole seconds) off a PostgreSQL URL: sqlx does not
/// know it, and the relay applies it itself. Without it, [`DEFAULT_CONNECT_TIMEOUT`].
pub(crate) fn connect_timeout(url: &str) -> (String, Duration) {
    let Some((base, query)) = url.split_once('?') else {
        return (url.to_owned(), DEFAULT_CONNECT_TIMEOUT);
    };
    let mut timeout = DEFAULT_CONNECT_TIMEOUT;
    let rest: Vec<&str> = query
        .split('&')
        .filter(|pair| match pair.strip_prefix("connect_timeout=") {
            Some(seconds) => {
                if let Ok(seconds) = seconds.parse::<u64>() {
                    timeout = Duration::from_secs(seconds.max(1));
                }
                false
            }
            None => true,
        })
        .collect();
    if rest.is_empty() {
        (base.to_owned(), timeout)
    } else {
        (format!("{base}?{}", rest.join("&")), timeout)
    }
}

/// The name the relay's connections show in `pg_stat_activity`, unless the URL sets one.
pub const APPLICATION_NAME: &str = "outbox-relay";

/// The connection options of a PostgreSQL URL, named [`APPLICATION_NAME`] unless the URL (or
/// `PGAPPNAME`) names them, and the URL's connect timeout.
pub(crate) fn postgres_options(
    url: &str,
) -> Result<(sqlx::postgres::PgConnectOptions, Duration), sqlx::Error> {
    use std::str::FromStr;
    let (url, timeout) = connect_timeout(url);
    let mut options = sqlx::postgres::PgConnectOptions::from_str(&url)?;
    if options.get_application_name().is_none() {
        options = options.application_name(APPLICATION_NAME);
    }
    Ok((options, timeout))
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

impl Claim<'_> {
    /// Records the outcome of the batch and releases the claim.
    pub async fn settle(self, outcome: &Outcome, mode: Mode) -> Result<(), sqlx::Error> {
        match self.held {
            Held::Postgres(mut tx) => {
                settle_postgres(&mut tx, outcome, mode).await?;
                tx.commit().await
            }
            Held::Sqlite(conn) => {
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
        let ids = uuids(&outcome.published);
        let sql = match mode {
            Mode::Mark => "UPDATE outbox SET published_at = now() WHERE id = ANY($1)",
            Mode::Delete => "DELETE FROM outbox WHERE id = ANY($1)",
        };
        sqlx::query(sql).bind(ids).execute(&mut *tx).await?;
    }
    for (id, error, retry_in) in &outcome.failed {
        sqlx::query(
            "UPDATE outbox SET attempts = attempts + 1, last_error = $2, \
             retry_at = now() + make_interval(secs => $3) WHERE id = $1::uuid",
        )
        .bind(id)
        .bind(error)
        .bind(retry_in.as_secs_f64())
        .execute(&mut *tx)
        .await?;
    }
    for (id, reason) in &outcome.parked {
        sqlx::query(
            "UPDATE outbox SET attempts = attempts + 1, last_error = $2, parked_at = now() WHERE id = $1::uuid",
        )
        .bind(id)
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
    for id in &outcome.published {
        let sql = match mode {
            Mode::Mark => {
                "UPDATE outbox SET published_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now') WHERE id = ?1"
            }
            Mode::Delete => "DELETE FROM outbox WHERE id = ?1",
        };
        sqlx::query(sql).bind(id).execute(&mut *tx).await?;
    }
    for (id, error, retry_in) in &outcome.failed {
        sqlx::query(
            "UPDATE outbox SET attempts = attempts + 1, last_error = ?2, \
             retry_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now', printf('+%.3f seconds', ?3)) WHERE id = ?1",
        )
        .bind(id)
        .bind(error)
        .bind(retry_in.as_secs_f64())
        .execute(&mut *tx)
        .await?;
    }
    for (id, reason) in &outcome.parked {
        sqlx::query(
            "UPDATE outbox SET attempts = attempts + 1, last_error = ?2, \
             parked_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now') WHERE id = ?1",
        )
        .bind(id)
        .bind(reason)
        .execute(&mut *tx)
        .await?;
    }
    Ok(())
}

fn uuids(ids: &[String]) -> Vec<Uuid> {
    ids.iter()
        .filter_map(|id| Uuid::parse_str(id).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connect_timeout_is_taken_off_the_url() {
        assert_eq!(
            connect_timeout("postgres://db/shop?connect_timeout=2&sslmode=require"),
            (
                "postgres://db/shop?sslmode=require".into(),
                Duration::from_secs(2)
            )
        );
        assert_eq!(
            connect_timeout("postgres://db/shop?connect_timeout=9"),
            ("postgres://db/shop".into(), Duration::from_secs(9))
        );
        assert_eq!(
            connect_timeout("postgres://db/shop"),
            ("postgres://db/shop".into(), DEFAULT_CONNECT_TIMEOUT)
        );
    }
}
