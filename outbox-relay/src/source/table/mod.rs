//! The table source: the relay's reads and writes of the `outbox` table, on PostgreSQL, SQLite
//! and MySQL/MariaDB (their SQL in `postgres.rs`, `sqlite.rs` and `mysql.rs`), and what serves
//! them: the shard leases among replicas (`leases.rs`), the wake-up on new rows (`wakeup.rs`),
//! pruning (`prune.rs`), the partitioned layout's partitions (`partitions.rs`).
//!
//! On both databases a claim is a plain read, and the outcome is written in one short transaction
//! after the broker answered: no relay transaction stays open while a broker is slow or away,
//! so the relay never pins PostgreSQL's xmin horizon (vacuum keeps cleaning the application's
//! tables). No row lock is needed: the replica's shard leases make it the only publisher of its
//! rows (`leases/`), and SQLite allows one relay per database.

#[cfg(test)]
mod any_row;
pub(crate) mod backlog;
#[cfg(test)]
mod holding;
pub(crate) mod leases;
pub(crate) mod mysql;
pub(crate) mod partitions;
mod postgres;
pub(crate) mod prune;
mod read;
mod sqlite;
pub mod wakeup;

use crate::batch::{Claim, Limits, Outcome};
use crate::config::{RelayConfig, Wakeup};
use crate::database::{Backend, connect_postgres};
use crate::error::SourceError;
use crate::metrics;
use crate::row::RowKey;
use crate::source::interface::Source;
use crate::tasks::BackgroundTasks;
use crate::tenants::Outbox;
pub(crate) use backlog::Backlog;
use futures::future::BoxFuture;
use leases::Leases;
use seaorm_outbox::TableName;
use sqlx::Connection as _;
use sqlx::mysql::MySqlConnection;
use sqlx::postgres::PgConnection;
use sqlx::sqlite::SqliteConnection;
use std::borrow::Cow;
use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Notify;

pub use crate::config::Mode;
pub use mysql::MYSQL_CLAIM;
pub use postgres::{PG_CLAIM, PG_SESSION};

/// One connection's life of the table source: the connection that claims and settles, the shard
/// leases it holds (PostgreSQL and MySQL), and the wake-ups on new rows (`--wakeup notify`).
pub(crate) struct TableSource {
    table: OutboxTable,
    leases: Option<Leases>,
    wakeups: Option<Arc<Notify>>,
    mode: Mode,
    hold_parked: bool,
    /// The claimed rows (by id) that had failed before, so blocked their aggregate until now, and
    /// the claim held the rows behind them: publishing one, or parking it when parked aggregates
    /// are not held back, releases those rows in the same transaction.
    retried: HashSet<String>,
    /// When the held rows that nothing blocks any more are next released.
    next_release: Instant,
    /// Its metrics' labels: the table, and the tenant if any.
    labels: Vec<(&'static str, String)>,
}

/// How often a pump releases the held rows of its shards that nothing blocks any more: the safety
/// net behind the releases made where a blocker goes (see [`postgres::RELEASE_UNBLOCKED`]).
const RELEASE_EVERY: Duration = Duration::from_secs(60);

/// How many claims in a row may find only rows to hold (the claim holds at most a batch of them)
/// before the pump goes on with its loop: a backlog of waiting aggregates' rows is held a batch
/// at a time, without waiting between claims.
const HOLDING_CLAIMS: usize = 16;

impl TableSource {
    /// Connects, joins the replicas (PostgreSQL and MySQL) and listens for new rows if asked to; the
    /// listener is one of `tasks`, and stops with them.
    pub async fn open(
        config: &RelayConfig,
        outbox: &Outbox,
        tasks: &BackgroundTasks,
    ) -> Result<Self, SourceError> {
        let mut table = SessionConfig::of(config, outbox)
            .open(&outbox.table)
            .await?;
        let refusal = match &mut table.conn {
            Connection::Postgres(conn) => postgres::check_schema(conn, &table.name).await?,
            Connection::Sqlite(conn) => sqlite::check_schema(conn, &table.name).await?,
            Connection::MySql(conn) => mysql::check_schema(conn, &table.name).await?,
        };
        if let Some(refusal) = refusal {
            return Err(SourceError::Refused(refusal));
        }
        let leases = Leases::join(&mut table, config.lease_refresh).await?;
        let wakeups = match config.wakeup {
            Wakeup::Notify => {
                let channel = wakeup::channel(&outbox.table);
                Some(wakeup::listen(&outbox.database_url, &channel, tasks).await?)
            }
            Wakeup::Poll => None,
        };
        Ok(TableSource {
            table,
            leases,
            wakeups,
            mode: config.mode,
            hold_parked: !config.skip_parked,
            retried: HashSet::new(),
            next_release: Instant::now(),
            labels: outbox.labels(),
        })
    }
}

impl Source for TableSource {
    /// Claims the oldest publishable rows of this replica's shards (all rows on SQLite, which
    /// allows one relay), skipping the rows in flight (by `seq`, their position), whose answers
    /// may still come.
    async fn claim(&mut self, limits: &Limits, in_flight: &[i64]) -> Result<Claim, SourceError> {
        let shards = self.leases.as_ref().map_or(&[0][..], Leases::held);
        if Instant::now() >= self.next_release {
            self.table
                .release_unblocked(shards, self.hold_parked)
                .await?;
            self.next_release = Instant::now() + RELEASE_EVERY;
        }
        let mut claim = self
            .table
            .claim(limits, shards, self.hold_parked, in_flight)
            .await?;
        for _ in 1..HOLDING_CLAIMS {
            if !claim.rows.is_empty() || !claim.full {
                break;
            }
            claim = self
                .table
                .claim(limits, shards, self.hold_parked, in_flight)
                .await?;
        }
        let retried = claim.rows.iter().filter(|row| row.attempts > 0);
        self.retried.extend(retried.map(|row| row.id.clone()));
        Ok(claim)
    }

    /// Writes what became of a batch, in one short transaction, with the release of the rows
    /// held behind the rows that stop blocking their aggregate.
    async fn settle(&mut self, outcome: &Outcome) -> Result<(), SourceError> {
        let released = self.released(outcome);
        Ok(self.table.settle(outcome, self.mode, &released).await?)
    }

    /// Resolves when a transaction inserted into the outbox (never without `--wakeup notify`).
    async fn new_events(&mut self) {
        match &self.wakeups {
            Some(notify) => notify.notified().await,
            None => std::future::pending().await,
        }
    }

    /// `until`, or the next lease refresh if that comes first.
    fn wake_at(&self, until: tokio::time::Instant) -> tokio::time::Instant {
        match &self.leases {
            Some(leases) => until.min(tokio::time::Instant::from_std(leases.next_refresh())),
            None => until,
        }
    }

    /// Whether the shards should be rebalanced now: then the pump settles what it has in flight
    /// first, so a lease moves only after its owner committed its last batch.
    fn rebalance_due(&self) -> bool {
        self.leases
            .as_ref()
            .is_some_and(|l| l.due(std::time::Instant::now()))
    }

    /// Takes and releases shards towards this replica's fair share (nothing in flight).
    async fn rebalance(&mut self) -> Result<(), SourceError> {
        if let Some(leases) = &mut self.leases {
            let before = leases.held().to_vec();
            leases.refresh(&mut self.table).await?;
            metrics::shards(&self.labels, leases.held().len());
            if leases.held() != before {
                // Rows held under the shards' last owner's settings are seen to at once.
                self.next_release = Instant::now();
            }
        }
        Ok(())
    }

    /// Leaves the replicas, releasing this replica's shards at once (nothing in flight).
    async fn leave(mut self) -> Result<(), SourceError> {
        if let Some(leases) = self.leases.take() {
            leases.leave(&mut self.table).await?;
        }
        Ok(())
    }
}

impl TableSource {
    /// The rows of `outcome` whose aggregates' held rows go free with it: the retried rows it
    /// publishes, and the rows it parks when parked aggregates are not held back. Forgets what
    /// `outcome` settles.
    fn released(&mut self, outcome: &Outcome) -> Vec<RowKey> {
        let mut released = Vec::new();
        for key in &outcome.published {
            if self.retried.remove(&key.id) {
                released.push(key.clone());
            }
        }
        for (key, _) in &outcome.parked {
            if self.retried.remove(&key.id) && !self.hold_parked {
                released.push(key.clone());
            }
        }
        for (key, _, _) in &outcome.failed {
            // Still blocking; it is remembered again when claimed again.
            self.retried.remove(&key.id);
        }
        released
    }
}

/// One database connection of the relay, and the outbox table it serves. On PostgreSQL and MySQL
/// it also holds the shard leases, so losing it loses them and the open claim together.
pub(crate) struct OutboxTable {
    pub conn: Connection,
    /// The table every statement reads and writes: the SQL in this module is written for
    /// `outbox`, and [`on`] puts this table in its place.
    pub name: TableName,
}

/// The connection of an [`OutboxTable`], on its backend.
pub(crate) enum Connection {
    Postgres(PgConnection),
    Sqlite(SqliteConnection),
    MySql(MySqlConnection),
}

/// `sql`, written for the table `outbox`, on `table`, quoted as `backend` quotes. Safe to send: a
/// [`TableName`] is checked to be identifiers only. For the default table the text is `sql`
/// itself; another table's costs a rewrite per statement (a few microseconds; the server's
/// prepared statement is still reused, as the text is the same every time).
pub(crate) fn on(
    table: &TableName,
    sql: &'static str,
    backend: Backend,
) -> sqlx::AssertSqlSafe<Cow<'static, str>> {
    let quote = if backend == Backend::MySql { '`' } else { '"' };
    sqlx::AssertSqlSafe(table.rewrite(sql, quote))
}

impl OutboxTable {
    /// Opens the relay's connection to `url` (`postgres://…`, `sqlite:…` or `mysql://…`) for
    /// `table`, failing after the URL's `connect_timeout` (see [`connect_timeout`]).
    pub async fn connect(url: &str, table: &TableName) -> Result<Self, sqlx::Error> {
        let backend = Backend::of(url);
        if table.schema().is_some() && backend != Backend::Postgres {
            return Err(sqlx::Error::Configuration(
                format!(
                    "the outbox table `{table}` names a schema, which only PostgreSQL supports: \
                     name a table without one"
                )
                .into(),
            ));
        }
        Ok(OutboxTable {
            conn: Connection::open(url, backend).await?,
            name: table.clone(),
        })
    }
}

/// How the relay's own sessions connect: the database, and how long one of their statements may
/// run. Every session the relay runs on (the claim, the sampler, the pruner) is opened through it,
/// so none waits on a locked table longer than the claim does.
#[derive(Debug, Clone)]
pub(crate) struct SessionConfig {
    pub database_url: String,
    pub statement_timeout: Duration,
    /// For background work on tenant databases: each tick opens its session and closes it after,
    /// holding one of these permits meanwhile, so background work keeps at most that many
    /// connections open across every tenant. `None`: one session kept open per task.
    pub per_tick: Option<Arc<tokio::sync::Semaphore>>,
}

impl SessionConfig {
    /// The sessions of `outbox`'s database, each kept open.
    pub fn of(config: &RelayConfig, outbox: &Outbox) -> Self {
        SessionConfig {
            database_url: outbox.database_url.clone(),
            statement_timeout: config.statement_timeout,
            per_tick: None,
        }
    }

    /// Opens a session on `table`; on PostgreSQL its statements give up after the statement
    /// timeout. Without it a statement blocked on a lock would wait for as long as the lock is
    /// held, even after the relay gave up on it and closed the connection: the server notices a
    /// closed client only when it answers, so each retry would leave another backend waiting.
    pub async fn open(&self, table: &TableName) -> Result<OutboxTable, sqlx::Error> {
        let mut table = OutboxTable::connect(&self.database_url, table).await?;
        if let Some(conn) = table.postgres() {
            crate::database::limit_statements(conn, self.statement_timeout).await?;
        }
        Ok(table)
    }
}

impl Connection {
    /// The backend this connection is to.
    pub fn backend(&self) -> Backend {
        match self {
            Connection::Postgres(_) => Backend::Postgres,
            Connection::Sqlite(_) => Backend::Sqlite,
            Connection::MySql(_) => Backend::MySql,
        }
    }

    async fn open(url: &str, backend: Backend) -> Result<Self, sqlx::Error> {
        match backend {
            Backend::Sqlite => Ok(Connection::Sqlite(SqliteConnection::connect(url).await?)),
            Backend::MySql => {
                let (url, timeout) = crate::database::connect_timeout(url);
                let connect = async {
                    let mut conn = MySqlConnection::connect(&url).await?;
                    sqlx::raw_sql(mysql::MYSQL_SESSION)
                        .execute(&mut conn)
                        .await?;
                    let version: String = sqlx::query_scalar("SELECT VERSION()")
                        .fetch_one(&mut conn)
                        .await?;
                    if version.contains("MariaDB") {
                        sqlx::raw_sql(mysql::MARIADB_SESSION)
                            .execute(&mut conn)
                            .await?;
                    }
                    Ok(Connection::MySql(conn))
                };
                crate::database::connected_within(timeout, connect).await
            }
            Backend::Postgres => {
                let mut conn = connect_postgres(url).await?;
                sqlx::raw_sql(postgres::PG_SESSION)
                    .execute(&mut conn)
                    .await?;
                Ok(Connection::Postgres(conn))
            }
        }
    }
}

impl OutboxTable {
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
        let read = match &mut self.conn {
            Connection::Postgres(conn) => {
                read::read_rows(
                    sqlx::query(on(&self.name, postgres::PG_CLAIM, Backend::Postgres))
                        .bind(shard_mask(shards))
                        .bind(rows)
                        .bind(hold_parked)
                        .bind(payload_bytes)
                        .bind(batch_bytes)
                        .bind(in_flight)
                        .fetch(&mut *conn),
                    limits,
                )
                .await?
            }
            Connection::Sqlite(conn) => {
                read::read_rows(
                    sqlx::query(on(&self.name, sqlite::SQLITE_CLAIM, Backend::Sqlite))
                        .bind(rows)
                        .bind(hold_parked)
                        .bind(payload_bytes)
                        .bind(batch_bytes)
                        .bind(serde_json::to_string(in_flight).unwrap_or_default())
                        .fetch(&mut *conn),
                    limits,
                )
                .await?
            }
            Connection::MySql(conn) => {
                read::read_rows(
                    sqlx::raw_sql(sqlx::AssertSqlSafe(mysql::claim_statement(
                        &self.name,
                        hold_parked,
                        &shard_mask(shards),
                        rows,
                        payload_bytes,
                        batch_bytes,
                        in_flight,
                    )))
                    .fetch(&mut *conn),
                    limits,
                )
                .await?
            }
        };
        if !read.blocked.is_empty() {
            self.hold(&read.blocked).await?;
        }
        Ok(Claim {
            rows: read.rows,
            full: read.full,
        })
    }

    /// Holds the rows `blocked` (by `seq`) that a claim returned for the relay to hold (SQLite and
    /// MySQL, whose queries cannot update), before the next claim, which then walks past them.
    async fn hold(&mut self, blocked: &[i64]) -> Result<(), sqlx::Error> {
        let seqs = serde_json::to_string(blocked).expect("integers serialize");
        match &mut self.conn {
            Connection::Sqlite(conn) => {
                let hold = sqlx::query(on(&self.name, sqlite::HOLD, Backend::Sqlite));
                hold.bind(seqs).execute(conn).await?;
            }
            Connection::MySql(conn) => {
                let hold = sqlx::query(on(&self.name, mysql::HOLD, Backend::MySql));
                hold.bind(seqs).execute(conn).await?;
            }
            // Its claim holds them itself.
            Connection::Postgres(_) => {}
        }
        Ok(())
    }

    /// Deletes up to `limit` published rows older than `age`, oldest first; returns how many.
    pub async fn delete_published(
        &mut self,
        age: std::time::Duration,
        limit: i64,
    ) -> Result<u64, sqlx::Error> {
        let seconds = age.as_secs_f64();
        let done = match &mut self.conn {
            Connection::Postgres(conn) => {
                let query =
                    sqlx::query(on(&self.name, postgres::PRUNE_PUBLISHED, Backend::Postgres));
                query
                    .bind(seconds)
                    .bind(limit)
                    .execute(conn)
                    .await?
                    .rows_affected()
            }
            Connection::Sqlite(conn) => {
                let query = sqlx::query(on(&self.name, sqlite::PRUNE_PUBLISHED, Backend::Sqlite));
                query
                    .bind(seconds)
                    .bind(limit)
                    .execute(conn)
                    .await?
                    .rows_affected()
            }
            Connection::MySql(conn) => {
                let micros = i64::try_from(age.as_micros()).unwrap_or(i64::MAX);
                let query = sqlx::query(on(&self.name, mysql::PRUNE_PUBLISHED, Backend::MySql));
                query
                    .bind(micros)
                    .bind(limit)
                    .execute(conn)
                    .await?
                    .rows_affected()
            }
        };
        Ok(done)
    }

    /// Deletes up to `limit` rows (not parked, not held) made before `cutoff`: their UUIDv7 id
    /// and their `created_at` both older. The WAL source's pruning, PostgreSQL only (0 on
    /// SQLite).
    pub async fn delete_read(
        &mut self,
        cutoff: chrono::DateTime<chrono::Utc>,
        limit: i64,
    ) -> Result<u64, sqlx::Error> {
        let Connection::Postgres(conn) = &mut self.conn else {
            return Ok(0);
        };
        let below = prune::uuid_v7_floor(cutoff.timestamp_millis().max(0));
        let query = sqlx::query(on(&self.name, postgres::PRUNE_READ, Backend::Postgres))
            .bind(below)
            .bind(limit)
            .bind(cutoff);
        Ok(query.execute(conn).await?.rows_affected())
    }

    /// The backlog (unpublished, not parked), the parked events, the held ones (where the claim
    /// holds rows), and how old the oldest unpublished one is.
    pub async fn backlog(&mut self) -> Result<Backlog, sqlx::Error> {
        let (waiting, parked, held, oldest_seconds): (i64, i64, i64, Option<f64>) =
            match &mut self.conn {
                Connection::Postgres(conn) => {
                    sqlx::query_as(on(&self.name, postgres::BACKLOG, Backend::Postgres))
                        .fetch_one(conn)
                        .await
                }
                Connection::Sqlite(conn) => {
                    sqlx::query_as(on(&self.name, sqlite::BACKLOG, Backend::Sqlite))
                        .fetch_one(conn)
                        .await
                }
                Connection::MySql(conn) => {
                    sqlx::query_as(on(&self.name, mysql::BACKLOG, Backend::MySql))
                        .fetch_one(conn)
                        .await
                }
            }?;
        Ok(Backlog {
            waiting,
            parked,
            held,
            // Infinite timestamps give infinite ages: the longest duration, not a panic.
            oldest_unpublished: oldest_seconds
                .map(|s| Duration::try_from_secs_f64(s.max(0.0)).unwrap_or(Duration::MAX)),
        })
    }

    /// Checks that the database answers.
    pub async fn ping(&mut self) -> Result<(), sqlx::Error> {
        match &mut self.conn {
            Connection::Postgres(conn) => conn.ping().await,
            Connection::Sqlite(conn) => conn.ping().await,
            Connection::MySql(conn) => conn.ping().await,
        }
    }

    /// Releases the held rows of `shards` that nothing blocks any more, with parked aggregates
    /// held back if `hold_parked` (on SQLite, which one relay serves, every shard).
    pub async fn release_unblocked(
        &mut self,
        shards: &[i16],
        hold_parked: bool,
    ) -> Result<u64, sqlx::Error> {
        let released = match &mut self.conn {
            Connection::Postgres(conn) => sqlx::query(on(
                &self.name,
                postgres::RELEASE_UNBLOCKED,
                Backend::Postgres,
            ))
            .bind(shard_mask(shards))
            .bind(hold_parked)
            .execute(conn)
            .await?
            .rows_affected(),
            Connection::Sqlite(conn) => {
                sqlx::query(on(&self.name, sqlite::RELEASE_UNBLOCKED, Backend::Sqlite))
                    .bind(hold_parked)
                    .execute(conn)
                    .await?
                    .rows_affected()
            }
            Connection::MySql(conn) => {
                sqlx::query(on(&self.name, mysql::RELEASE_UNBLOCKED, Backend::MySql))
                    .bind(hold_parked)
                    .bind(shard_mask(shards))
                    .execute(conn)
                    .await?
                    .rows_affected()
            }
        };
        if released > 0 {
            tracing::info!(
                released,
                "released held events that nothing blocks any more"
            );
        }
        Ok(released)
    }

    /// The PostgreSQL connection, for the shard leases; `None` on SQLite and MySQL.
    pub fn postgres(&mut self) -> Option<&mut PgConnection> {
        match &mut self.conn {
            Connection::Postgres(conn) => Some(conn),
            Connection::Sqlite(_) | Connection::MySql(_) => None,
        }
    }
}

/// How long one tick of periodic work may go without an answer from the database.
const TICK_LIMIT: std::time::Duration = std::time::Duration::from_secs(60);

/// Runs `task` every `every` until `shutdown`, on a connection of its own that is opened again after
/// a failure. For the relay's background work (pruning, sampling the backlog): a failure is logged
/// and the task tried again at the next tick.
pub(crate) async fn every_tick(
    session: &SessionConfig,
    table_name: &TableName,
    every: std::time::Duration,
    shutdown: tokio_util::sync::CancellationToken,
    what: &str,
    mut task: impl for<'t> FnMut(&'t mut OutboxTable) -> BoxFuture<'t, Result<(), sqlx::Error>>,
) {
    let mut table = None;
    loop {
        let permit = match &session.per_tick {
            Some(permits) => tokio::select! {
                permit = Arc::clone(permits).acquire_owned() => permit.ok(),
                () = shutdown.cancelled() => return,
            },
            None => None,
        };
        if table.is_none() {
            table = session.open(table_name).await.ok();
        }
        if let Some(connected) = table.as_mut() {
            // A database gone silent (its host vanished) neither holds the task forever nor
            // keeps the relay from stopping.
            let done = tokio::select! {
                done = crate::database::answered_within(TICK_LIMIT, task(connected)) => done,
                () = shutdown.cancelled() => return,
            };
            if let Err(e) = done {
                tracing::warn!(error = %e, "{what} failed; trying again at the next tick");
                table = None;
            }
        }
        if permit.is_some() {
            // Closed with the permit given back: another tenant's tick may open its own.
            table = None;
        }
        drop(permit);
        tokio::select! {
            () = tokio::time::sleep(every) => {}
            () = shutdown.cancelled() => return,
        }
    }
}

/// The claim's shard set as a 256-bit mask: bit `n % 8` of byte `n / 8` for shard `n`, which is
/// how PostgreSQL's `get_bit` numbers a `bytea`'s bits (and what the MySQL claim computes). A bit test costs the same for one shard or
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

impl OutboxTable {
    /// Records the outcome of a batch, with the release of the rows held behind `released`: on
    /// its own when it is one statement (a batch all published, nearly every
    /// batch: a transaction's `BEGIN` and `COMMIT` were two more round trips per batch), else in
    /// one short transaction.
    pub async fn settle(
        &mut self,
        outcome: &Outcome,
        mode: Mode,
        released: &[RowKey],
    ) -> Result<(), sqlx::Error> {
        let statements = usize::from(!outcome.published.is_empty())
            + outcome.failed.len()
            + outcome.parked.len()
            + usize::from(!released.is_empty());
        let alone = statements == 1;
        if statements == 0 {
            return Ok(());
        }
        match &mut self.conn {
            Connection::Postgres(conn) if alone => {
                postgres::settle(conn, &self.name, outcome, mode, released).await
            }
            Connection::Postgres(conn) => {
                let mut tx = conn.begin().await?;
                postgres::settle(&mut tx, &self.name, outcome, mode, released).await?;
                tx.commit().await
            }
            Connection::Sqlite(conn) if alone => {
                sqlite::settle(conn, &self.name, outcome, mode, released).await
            }
            Connection::Sqlite(conn) => {
                let mut tx = conn.begin().await?;
                sqlite::settle(&mut tx, &self.name, outcome, mode, released).await?;
                tx.commit().await
            }
            Connection::MySql(conn) if alone => {
                mysql::settle(conn, &self.name, outcome, mode, released).await
            }
            Connection::MySql(conn) => {
                let mut tx = conn.begin().await?;
                mysql::settle(&mut tx, &self.name, outcome, mode, released).await?;
                tx.commit().await
            }
        }
    }
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
}
