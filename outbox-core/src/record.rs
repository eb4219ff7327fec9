//! Writing events into the outbox table: one INSERT per call and table, whatever the number of
//! events; or,
//! with [`Recording::LogicalMessage`](crate::Recording), one logical message into the WAL.
//!
//! All events travel as one JSON array parameter, so every call uses the same prepared statement
//! and no call runs into a bind-parameter limit.

use crate::{Error, NewEvent, Outbox, OutboxEvent, Result, TableName};
use sea_orm::{ConnectionTrait, DatabaseTransaction, DbBackend, Statement};

use std::future::Future;
use uuid::Uuid;

/// Inserts `events`, of one type, with one statement, in order, and returns their ids.
///
/// The aggregates' locks are taken in one canonical order (ascending lock key) before anything is
/// inserted, so two `record_all` calls over the same aggregates cannot deadlock.
///
/// ```no_run
/// # use seaorm_outbox::OutboxEvent;
/// # #[derive(serde::Serialize, OutboxEvent)]
/// # #[outbox(aggregate = "order", key = "order_id")]
/// # struct OrderShipped { order_id: u64 }
/// # async fn f(txn: &sea_orm::DatabaseTransaction) -> seaorm_outbox::Result<()> {
/// let shipped = [OrderShipped { order_id: 1 }, OrderShipped { order_id: 2 }];
/// let ids = seaorm_outbox::record_all(txn, &shipped).await?;
/// assert_eq!(ids.len(), 2);
/// # Ok(()) }
/// ```
pub fn record_all<'t, E: OutboxEvent>(
    txn: &'t DatabaseTransaction,
    events: &[E],
) -> impl Future<Output = Result<Vec<Uuid>>> + Send + 't {
    // Serialize now, so the future borrows nothing but the transaction.
    let events: Result<Vec<NewEvent>> = events.iter().map(NewEvent::from_event).collect();
    async move { insert(txn, events?, &Outbox::default()).await }
}

/// Inserts events of any types, built with [`NewEvent::from_event`], with one statement, in order.
///
/// ```no_run
/// # use seaorm_outbox::{NewEvent, OutboxEvent};
/// # #[derive(serde::Serialize, OutboxEvent)]
/// # #[outbox(aggregate = "order", key = "order_id")]
/// # struct OrderPaid { order_id: u64 }
/// # #[derive(serde::Serialize, OutboxEvent)]
/// # #[outbox(aggregate = "invoice", key = "invoice_id")]
/// # struct InvoiceIssued { invoice_id: u64 }
/// # async fn f(txn: &sea_orm::DatabaseTransaction) -> seaorm_outbox::Result<()> {
/// let events = vec![
///     NewEvent::from_event(&OrderPaid { order_id: 1 })?,
///     NewEvent::from_event(&InvoiceIssued { invoice_id: 9 })?.with_header("tenant", "acme"),
/// ];
/// seaorm_outbox::record_new_events(txn, events).await?;
/// # Ok(()) }
/// ```
pub async fn record_new_events(
    txn: &DatabaseTransaction,
    events: Vec<NewEvent>,
) -> Result<Vec<Uuid>> {
    insert(txn, events, &Outbox::default()).await
}

/// Writes `events` as `outbox` says: rows or one logical message, each payload within its limit.
/// Rows go to their event type's table, or else to `outbox.table`: one statement per table, the
/// tables in name order (so the aggregates' locks are taken in one canonical order whatever the
/// call's mix of tables).
pub(crate) async fn insert(
    txn: &DatabaseTransaction,
    events: Vec<NewEvent>,
    outbox: &Outbox,
) -> Result<Vec<Uuid>> {
    if events.is_empty() {
        return Ok(Vec::new());
    }
    let backend = txn.get_database_backend();
    match (backend, outbox.recording) {
        (DbBackend::Postgres, crate::Recording::LogicalMessage) => {
            let param = json_rows(&events, outbox.max_payload_bytes)?;
            txn.execute_raw(Statement::from_sql_and_values(
                backend,
                POSTGRES_EMIT,
                [param.into()],
            ))
            .await?;
            return Ok(events.iter().map(|e| e.id).collect());
        }
        (DbBackend::Sqlite | DbBackend::MySql, crate::Recording::LogicalMessage) => {
            return Err(Error::LogicalMessageUnsupported(backend));
        }
        (DbBackend::Postgres | DbBackend::Sqlite | DbBackend::MySql, _) => {}
        (other, _) => return Err(Error::UnsupportedBackend(other)),
    }
    let ids = events.iter().map(|e| e.id).collect();
    let tables = by_table(events, &outbox.table);
    if tables.len() > 1 && backend == DbBackend::Postgres {
        lock_postgres_aggregates(txn, &tables).await?;
    }
    for (table, events) in &tables {
        if table.schema().is_some() && backend != DbBackend::Postgres {
            return Err(Error::SchemaUnsupported {
                table: table.clone(),
                backend,
            });
        }
        let limit = outbox.max_payload_bytes;
        let sql = match backend {
            DbBackend::MySql => {
                insert_mysql(txn, table, events, limit).await?;
                continue;
            }
            DbBackend::Postgres => POSTGRES_INSERT,
            _ => SQLITE_INSERT,
        };
        let param = json_rows(events, limit)?;
        let sql = table.rewrite(sql, '"').into_owned();
        txn.execute_raw(Statement::from_sql_and_values(backend, sql, [param.into()]))
            .await?;
    }
    Ok(ids)
}

/// `events` split by the table each goes to (its type's, else `default`), in table name order,
/// each table's events in their order.
fn by_table(events: Vec<NewEvent>, default: &TableName) -> Vec<(TableName, Vec<NewEvent>)> {
    if events.iter().all(|e| e.table.is_none()) {
        return vec![(default.clone(), events)];
    }
    let mut tables: std::collections::BTreeMap<TableName, Vec<NewEvent>> = Default::default();
    for event in events {
        let table = event.table.clone().unwrap_or_else(|| default.clone());
        tables.entry(table).or_default().push(event);
    }
    tables.into_iter().collect()
}

/// `events` as the JSON array parameter of the PostgreSQL and SQLite statements.
fn json_rows(events: &[NewEvent], limit: usize) -> Result<String> {
    let mut param = Vec::with_capacity(256 * events.len());
    param.push(b'[');
    for (n, event) in events.iter().enumerate() {
        refuse_reserved_headers(event)?;
        if n > 0 {
            param.push(b',');
        }
        write_row(&mut param, event, limit)?;
    }
    param.push(b']');
    // Serialized from `Value`s and `String`s: valid UTF-8.
    Ok(String::from_utf8(param).expect("serde_json writes UTF-8"))
}

/// Takes the locks of every aggregate of a call that writes into several tables at once, in
/// ascending key order, as one table's insert does (PostgreSQL's locks are database-wide): each
/// table's insert then takes again locks it holds.
async fn lock_postgres_aggregates(
    txn: &DatabaseTransaction,
    tables: &[(TableName, Vec<NewEvent>)],
) -> Result<()> {
    let aggregates: Vec<String> = tables
        .iter()
        .flat_map(|(_, events)| events)
        .map(|e| format!("{}:{}", e.aggregate_type, e.aggregate_id))
        .collect();
    txn.execute_raw(Statement::from_sql_and_values(
        DbBackend::Postgres,
        "SELECT count(pg_advisory_xact_lock(k)) FROM (
             SELECT DISTINCT hashtextextended(a, 0) AS k
             FROM jsonb_array_elements_text($1::text::jsonb) a ORDER BY k
         ) ordered_keys",
        [serde_json::to_string(&aggregates)
            .expect("strings serialize")
            .into()],
    ))
    .await?;
    Ok(())
}

/// Refuses an event that sets a header the relay sets itself.
fn refuse_reserved_headers(event: &NewEvent) -> Result<()> {
    match event
        .headers
        .keys()
        .find(|n| crate::RESERVED_HEADERS.contains(&n.as_str()))
    {
        Some(name) => Err(Error::ReservedHeader {
            name: name.clone(),
            event_type: event.event_type.clone(),
        }),
        None => Ok(()),
    }
}

/// The payload's JSON text, refused over `limit` bytes.
fn payload_text(event: &NewEvent, limit: usize) -> Result<String> {
    let text = serde_json::to_string(&event.payload).map_err(|source| Error::Serialize {
        event_type: event.event_type.clone(),
        source,
    })?;
    if text.len() > limit {
        return Err(Error::PayloadTooLarge {
            event_type: event.event_type.clone(),
            bytes: text.len(),
            limit,
        });
    }
    Ok(text)
}

/// Rows per `INSERT` on MySQL: 8 parameters each, far below its 65,535.
const MYSQL_ROWS_PER_INSERT: usize = 1_000;

/// MySQL and MariaDB: the aggregates locked, then the rows inserted with plain `VALUES`, in order,
/// the payload and headers bound as the text the application serialized (a `LONGTEXT` column
/// keeps it byte for byte). Unpacking one JSON array parameter with `JSON_TABLE` cost MariaDB
/// about 250 µs per statement against 65 for `VALUES`.
async fn insert_mysql(
    txn: &DatabaseTransaction,
    table: &TableName,
    events: &[NewEvent],
    limit: usize,
) -> Result<()> {
    let mut rows = Vec::with_capacity(events.len());
    for event in events {
        refuse_reserved_headers(event)?;
        fits_mysql_columns(event)?;
        let headers = if event.headers.is_empty() {
            None
        } else {
            Some(
                serde_json::to_string(&event.headers).map_err(|source| Error::Serialize {
                    event_type: event.event_type.clone(),
                    source,
                })?,
            )
        };
        rows.push((event, payload_text(event, limit)?, headers));
    }
    if rows.len() == 1
        && let Some((event, payload, headers)) = rows.pop()
    {
        return insert_one_mysql(txn, table, event, payload, headers).await;
    }
    lock_mysql_aggregates(txn, table, events).await?;
    for chunk in rows.chunks(MYSQL_ROWS_PER_INSERT) {
        let placeholders = vec!["(?, ?, ?, ?, ?, ?, ?, ?)"; chunk.len()].join(", ");
        let mut values: Vec<sea_orm::Value> = Vec::with_capacity(8 * chunk.len());
        for (event, payload, headers) in chunk {
            values.push(event.id.to_string().into());
            values.push(event.aggregate_type.clone().into());
            values.push(event.aggregate_id.clone().into());
            values.push(event.event_type.clone().into());
            values.push(event.event_version.into());
            values.push(event.topic.clone().into());
            values.push(payload.clone().into());
            values.push(headers.clone().into());
        }
        txn.execute_raw(Statement::from_sql_and_values(
            DbBackend::MySql,
            format!(
                "INSERT INTO {} (id, aggregate_type, aggregate_id, event_type, event_version, \
                 topic, payload, headers) VALUES {placeholders}",
                table.quoted('`')
            ),
            values,
        ))
        .await?;
    }
    Ok(())
}

/// One event on MySQL: the aggregate's lock and the row in one statement, one round trip instead
/// of two (about 60 µs of a 250 µs `record` on MariaDB). The locking read of the bucket's row
/// comes before the row is written, and so before InnoDB gives it its `seq`, as in
/// [`lock_mysql_aggregates`].
async fn insert_one_mysql(
    txn: &DatabaseTransaction,
    table: &TableName,
    event: &NewEvent,
    payload: String,
    headers: Option<String>,
) -> Result<()> {
    txn.execute_raw(Statement::from_sql_and_values(
        DbBackend::MySql,
        table.rewrite(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, event_version, \
             topic, payload, headers) \
             SELECT ?, ?, ?, ?, ?, ?, ?, ? FROM outbox_lock WHERE bucket = ? FOR UPDATE",
            '`',
        ),
        [
            event.id.to_string().into(),
            event.aggregate_type.clone().into(),
            event.aggregate_id.clone().into(),
            event.event_type.clone().into(),
            event.event_version.into(),
            event.topic.clone().into(),
            payload.into(),
            headers.into(),
            mysql_lock_bucket(&event.aggregate_type, &event.aggregate_id).into(),
        ],
    ))
    .await?;
    Ok(())
}

/// Appends `event` as one JSON object of the statement's array parameter. The payload is
/// serialized once, straight into the parameter, and its size checked against `limit` there.
fn write_row(param: &mut Vec<u8>, event: &NewEvent, limit: usize) -> Result<()> {
    let serialize_error = |source| Error::Serialize {
        event_type: event.event_type.clone(),
        source,
    };
    param.extend_from_slice(br#"{"payload":"#);
    let start = param.len();
    serde_json::to_writer(&mut *param, &event.payload).map_err(serialize_error)?;
    let bytes = param.len() - start;
    if bytes > limit {
        return Err(Error::PayloadTooLarge {
            event_type: event.event_type.clone(),
            bytes,
            limit,
        });
    }
    let mut columns = || -> serde_json::Result<()> {
        write_field(param, "id", &event.id)?;
        write_field(param, "aggregate_type", &event.aggregate_type)?;
        write_field(param, "aggregate_id", &event.aggregate_id)?;
        write_field(param, "event_type", &event.event_type)?;
        write_field(param, "event_version", &event.event_version)?;
        write_field(param, "topic", &event.topic)?;
        if !event.headers.is_empty() {
            write_field(param, "headers", &event.headers)?;
        }
        Ok(())
    };
    columns().map_err(serialize_error)?;
    param.push(b'}');
    Ok(())
}

/// Appends `,"name":value` to an open JSON object. (Written field by field rather than through a
/// derived struct: a `Serialize` type here would show up in rustc's list of `Serialize` impls
/// in users' compile errors.)
fn write_field(
    param: &mut Vec<u8>,
    name: &str,
    value: &impl serde::Serialize,
) -> serde_json::Result<()> {
    param.push(b',');
    serde_json::to_writer(&mut *param, name)?;
    param.push(b':');
    serde_json::to_writer(&mut *param, value)
}

/// Locks every aggregate of the batch in ascending key order (so concurrent writers of the same
/// aggregates queue instead of deadlocking), then inserts. The lock is what makes `seq` follow
/// commit order per aggregate: a second writer of the aggregate takes its `seq` only after the
/// first has committed or rolled back. The key is `hashtextextended(aggregate_type || ':' ||
/// aggregate_id, 0)`; writers in other languages take the same lock.
const POSTGRES_INSERT: &str = r#"
WITH input AS (
    SELECT n, e FROM jsonb_array_elements($1::text::jsonb) WITH ORDINALITY AS t(e, n)
), locks AS MATERIALIZED (
    SELECT pg_advisory_xact_lock(k) FROM (
        SELECT DISTINCT hashtextextended((e->>'aggregate_type') || ':' || (e->>'aggregate_id'), 0) AS k
        FROM input ORDER BY k
    ) ordered_keys
)
INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, event_version, topic, payload, headers)
SELECT (e->>'id')::uuid, e->>'aggregate_type', e->>'aggregate_id', e->>'event_type',
       (e->>'event_version')::integer, e->>'topic', e->'payload', e->'headers'
FROM input
WHERE (SELECT count(*) FROM locks) >= 0
ORDER BY n
"#;

/// Table-less recording: the same JSON array, as one transactional logical message that the WAL
/// relay decodes at commit. No row, no index entry, no lock: the WAL's commit order is the order.
const POSTGRES_EMIT: &str = "SELECT pg_logical_emit_message(true, 'outbox', $1::text)";

/// SQLite has one writer at a time, so commit order is `seq` order without any lock.
const SQLITE_INSERT: &str = r#"
INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, event_version, topic, payload, headers)
SELECT value->>'$.id', value->>'$.aggregate_type', value->>'$.aggregate_id', value->>'$.event_type',
       value->>'$.event_version', value->>'$.topic', value->'$.payload', value->'$.headers'
FROM json_each(?1)
ORDER BY key
"#;

/// The length of the outbox table's name columns on MySQL, in characters.
const MYSQL_NAME_CHARS: usize = 255;

/// Refuses a name longer than its MySQL column: MySQL would cut it short, silently where
/// `sql_mode` is not strict.
fn fits_mysql_columns(event: &NewEvent) -> Result<()> {
    let names = [
        ("aggregate_type", Some(&event.aggregate_type)),
        ("aggregate_id", Some(&event.aggregate_id)),
        ("event_type", Some(&event.event_type)),
        ("topic", event.topic.as_ref()),
    ];
    for (column, value) in names {
        let chars = value.map_or(0, |v| v.chars().count());
        if chars > MYSQL_NAME_CHARS {
            return Err(Error::TooLong {
                column,
                event_type: event.event_type.chars().take(MYSQL_NAME_CHARS).collect(),
                chars,
                limit: MYSQL_NAME_CHARS,
            });
        }
    }
    Ok(())
}

/// MySQL's per-aggregate lock: the row of the aggregate's bucket in `outbox_lock`, held until the
/// transaction ends. InnoDB has no transaction-scoped advisory lock (`GET_LOCK` outlives a
/// commit), and a row lock on a fixed table of buckets takes no gap locks. Taken before the
/// insert, so a second writer of the aggregate takes its `seq` only after the first has committed;
/// two aggregates sharing a bucket only wait for each other.
///
/// All of a call's buckets are locked by one statement (a round trip each cost more than the
/// insert), read through the primary key in ascending order: the range read visits the sorted
/// list in key order, locking as it goes, so two writers lock common buckets in the same order
/// and cannot deadlock. Lists longer than [`LOCK_CHUNK`] go in ascending chunks.
async fn lock_mysql_aggregates(
    txn: &DatabaseTransaction,
    table: &TableName,
    events: &[NewEvent],
) -> Result<()> {
    let mut buckets: Vec<i64> = events
        .iter()
        .map(|e| mysql_lock_bucket(&e.aggregate_type, &e.aggregate_id))
        .collect();
    buckets.sort_unstable();
    buckets.dedup();
    for chunk in buckets.chunks(LOCK_CHUNK) {
        let list = vec!["?"; chunk.len()].join(", ");
        txn.execute_raw(Statement::from_sql_and_values(
            DbBackend::MySql,
            format!(
                "SELECT bucket FROM `{}_lock` FORCE INDEX (PRIMARY) WHERE bucket IN ({list}) \
                 ORDER BY bucket FOR UPDATE",
                table.name()
            ),
            chunk.iter().map(|&b| b.into()),
        ))
        .await?;
    }
    Ok(())
}

/// Buckets locked per statement: far below MySQL's 65,535 placeholders.
const LOCK_CHUNK: usize = 1_000;

/// The `outbox_lock` bucket of an aggregate: `CRC32(CONCAT(aggregate_type, ':', aggregate_id)) &
/// 65535`, as writers in other languages compute it in SQL.
pub(crate) fn mysql_lock_bucket(aggregate_type: &str, aggregate_id: &str) -> i64 {
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(aggregate_type.as_bytes());
    hasher.update(b":");
    hasher.update(aggregate_id.as_bytes());
    i64::from(hasher.finalize() & 0xffff)
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_lock_bucket_is_mysqls_crc32_of_the_aggregate() {
        // SELECT CRC32('order:o-1') & 65535, CRC32(CONCAT('order', ':', 'é')) & 65535 on
        // MariaDB 10.11 (a utf8mb4 connection).
        assert_eq!(super::mysql_lock_bucket("order", "o-1"), 18315);
        assert_eq!(super::mysql_lock_bucket("order", "é"), 36509);
    }
}
