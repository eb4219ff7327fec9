//! The table source: the relay's reads and writes of the `outbox` table, on PostgreSQL and
//! SQLite (their SQL in `postgres.rs` and `sqlite.rs`), and what serves them: the shard leases
//! among replicas (`leases.rs`), the wake-up on new rows (`wakeup.rs`), pruning (`prune.rs`).
//!
//! On both databases a claim is a plain read, and the outcome is written in one short transaction
//! after the broker answered: no relay transaction stays open while a broker is slow or away,
//! so the relay never pins PostgreSQL's xmin horizon (vacuum keeps cleaning the application's
//! tables). No row lock is needed: on PostgreSQL the replica's shard leases make it the only
//! publisher of its rows (`leases.rs`), and SQLite allows one relay per database.

pub(crate) mod leases;
mod postgres;
pub(crate) mod prune;
mod sqlite;
pub mod wakeup;

use crate::batch::{Limits, Outcome};
use crate::database::{Backend, connect_postgres};
use crate::row::OutboxRow;
use futures::future::BoxFuture;
use sqlx::Connection;
use sqlx::postgres::PgConnection;
use sqlx::sqlite::SqliteConnection;

pub use crate::config::Mode;
pub use postgres::{PG_CLAIM, PG_SESSION};

impl OutboxRow {
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

impl OutboxTable {
    /// Opens the relay's connection to `url` (`postgres://…` or `sqlite:…`), failing after the
    /// URL's `connect_timeout` (see [`connect_timeout`]).
    pub async fn connect(url: &str) -> Result<Self, sqlx::Error> {
        match Backend::of(url) {
            Backend::Sqlite => Ok(OutboxTable::Sqlite(SqliteConnection::connect(url).await?)),
            Backend::Postgres => {
                let mut conn = connect_postgres(url).await?;
                sqlx::raw_sql(postgres::PG_SESSION)
                    .execute(&mut conn)
                    .await?;
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
                    sqlx::query(postgres::PG_CLAIM)
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
                    sqlx::query(sqlite::SQLITE_CLAIM)
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
                postgres::settle(&mut tx, outcome, mode).await?;
                tx.commit().await
            }
            OutboxTable::Sqlite(conn) => {
                let mut tx = conn.begin().await?;
                sqlite::settle(&mut tx, outcome, mode).await?;
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
