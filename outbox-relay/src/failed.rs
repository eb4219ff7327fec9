//! Parked events, for operators: `outbox-relay failed list | retry | skip`.
//!
//! A parked event holds back the later events of its aggregate. Fix the cause (a topic to create,
//! a permission to grant, a payload to correct), then `retry` it; or give up on it with `skip`,
//! which records the reason and lets the aggregate's later events go out, in order.

use crate::database::Backend;
use crate::source::table::mysql::RELEASE_UNBLOCKED as MYSQL_RELEASE_UNBLOCKED;
use crate::source::table::{Connection, OutboxTable};
use seaorm_outbox::TableName;
use sqlx::{Connection as _, FromRow};

/// A parked event, as `failed list` shows it.
#[derive(Debug, Clone, FromRow)]
#[non_exhaustive]
pub struct ParkedEvent {
    /// The event id.
    pub id: String,
    /// Its position in the outbox.
    pub seq: i64,
    /// Its aggregate type.
    pub aggregate_type: String,
    /// Its aggregate id.
    pub aggregate_id: String,
    /// Its event type.
    pub event_type: String,
    /// Failed attempts.
    pub attempts: i32,
    /// Why it was parked.
    pub last_error: Option<String>,
    /// When it was parked.
    pub parked_at: String,
    /// Later events of its aggregate waiting behind it.
    pub waiting: i64,
}

/// Which parked events a command applies to.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Selection {
    /// Every parked event.
    All,
    /// These event ids.
    Ids(Vec<String>),
    /// The parked events of one aggregate.
    Aggregate {
        /// The aggregate type.
        aggregate_type: String,
        /// The aggregate id.
        aggregate_id: String,
    },
}

impl Selection {
    /// The SQL condition and its text parameters, with `?` placeholders numbered from 1.
    fn condition(&self) -> (String, Vec<String>) {
        match self {
            Selection::All => ("TRUE".to_owned(), Vec::new()),
            Selection::Ids(ids) => {
                let marks: Vec<String> = (1..=ids.len())
                    .map(|i| format!("CAST(?{i} AS TEXT)"))
                    .collect();
                (
                    format!("CAST(id AS TEXT) IN ({})", marks.join(", ")),
                    ids.clone(),
                )
            }
            Selection::Aggregate {
                aggregate_type,
                aggregate_id,
            } => (
                "aggregate_type = ?1 AND aggregate_id = ?2".to_owned(),
                vec![aggregate_type.clone(), aggregate_id.clone()],
            ),
        }
    }
}

/// The statements here are written once, for the table `outbox` (the table's own name goes in
/// its place): parameters as `?N` (PostgreSQL wants `$N`; MySQL numbers none), the current time
/// as `{now}` (SQLite keeps timestamps as ISO-8601 text), text casts as `AS TEXT` (MySQL's is
/// `AS CHAR`). Returns the statement, and the parameters' indexes in the order MySQL binds them
/// (`None`: bind them as given).
fn dialect(table: &OutboxTable, sql: &str) -> (String, Option<Vec<usize>>) {
    let quote = if table.conn.backend() == Backend::MySql {
        '`'
    } else {
        '"'
    };
    let sql = &*table.name.rewrite(sql, quote);
    match &table.conn {
        Connection::Postgres(_) => (sql.replace('?', "$").replace("{now}", "now()"), None),
        Connection::Sqlite(_) => (
            sql.replace("{now}", "strftime('%Y-%m-%dT%H:%M:%fZ', 'now')"),
            None,
        ),
        Connection::MySql(_) => {
            let sql = sql
                .replace("{now}", "UTC_TIMESTAMP(6)")
                .replace(" AS TEXT)", " AS CHAR)");
            let (mut positional, mut order) = (String::with_capacity(sql.len()), Vec::new());
            let mut chars = sql.chars().peekable();
            while let Some(c) = chars.next() {
                positional.push(c);
                if c == '?' {
                    let mut n = 0usize;
                    while let Some(digit) = chars.peek().and_then(|d| d.to_digit(10)) {
                        n = n * 10 + digit as usize;
                        chars.next();
                    }
                    order.push(n.saturating_sub(1));
                }
            }
            (positional, Some(order))
        }
    }
}

/// Every parked event of the outbox table `table`, oldest first.
pub async fn list(database_url: &str, table: &TableName) -> Result<Vec<ParkedEvent>, sqlx::Error> {
    let mut table = OutboxTable::connect(database_url, table).await?;
    // The polling relay's waiting events are its unpublished ones; the WAL source marks the
    // events it holds (it never marks the ones it published).
    let waiting = if read_by_wal(&mut table).await? {
        "w.held_at IS NOT NULL"
    } else {
        "w.published_at IS NULL"
    };
    let sql = format!(
        "SELECT CAST(o.id AS TEXT) AS id, o.seq, o.aggregate_type, o.aggregate_id, o.event_type,
                o.attempts, o.last_error, CAST(o.parked_at AS TEXT) AS parked_at,
                (SELECT count(*) FROM outbox w
                 WHERE w.aggregate_type = o.aggregate_type AND w.aggregate_id = o.aggregate_id
                   AND {waiting} AND w.seq > o.seq) AS waiting
         FROM outbox o WHERE o.parked_at IS NOT NULL AND o.published_at IS NULL ORDER BY o.seq"
    );
    let (sql, _) = dialect(&table, &sql);
    // Audited: built from this module's fragments, no value in it.
    let sql = sqlx::AssertSqlSafe(sql);
    match &mut table.conn {
        Connection::Postgres(conn) => sqlx::query_as(sql).fetch_all(conn).await,
        Connection::Sqlite(conn) => sqlx::query_as(sql).fetch_all(conn).await,
        Connection::MySql(conn) => sqlx::query_as(sql).fetch_all(conn).await,
    }
}

/// Whether a WAL relay reads the table (it is in a WAL relay's publication): parked events are
/// then released through the stream.
async fn read_by_wal(table: &mut OutboxTable) -> Result<bool, sqlx::Error> {
    if !table.name.is_default() {
        // The WAL source reads `outbox` alone.
        return Ok(false);
    }
    match table.postgres() {
        Some(conn) => Ok(crate::source::wal::publication::publications(conn)
            .await?
            .iter()
            .any(|p| p.ours)),
        None => Ok(false),
    }
}

/// Makes the selected parked (or backing-off) events of the outbox table `table` due again;
/// returns how many.
///
/// Under the WAL source they become held events of their aggregates, and the same transaction
/// writes a release into the WAL: the relay sends each selected aggregate's held events in `seq`
/// order once everything it read before has settled, so no later event goes out first.
pub async fn retry(
    database_url: &str,
    table: &TableName,
    selection: &Selection,
) -> Result<u64, sqlx::Error> {
    let (condition, params) = selection.condition();
    let sql = |wal: bool| {
        let held = if wal { ", held_at = now()" } else { "" };
        format!(
            "UPDATE outbox SET parked_at = NULL, retry_at = NULL{held}
             WHERE published_at IS NULL AND (parked_at IS NOT NULL OR retry_at IS NOT NULL) AND {condition}"
        )
    };
    execute(database_url, table, sql, params).await
}

/// Gives up on the selected parked events of the outbox table `table`: they leave the backlog as if published, with the
/// reason kept in `last_error` (and `parked_at` kept as the record). Returns how many. Their
/// aggregates' later events go out, in order (under the WAL source, through a release as
/// [`retry`] writes).
pub async fn skip(
    database_url: &str,
    table: &TableName,
    selection: &Selection,
    reason: &str,
) -> Result<u64, sqlx::Error> {
    let (condition, mut params) = selection.condition();
    let reason_mark = params.len() + 1;
    params.push(format!("skipped by an operator: {reason}"));
    let sql = |_wal: bool| {
        format!(
            "UPDATE outbox SET published_at = {{now}}, last_error = ?{reason_mark}
             WHERE published_at IS NULL AND parked_at IS NOT NULL AND {condition}"
        )
    };
    execute(database_url, table, sql, params).await
}

/// Makes the rows that polling relays held behind the aggregates `$1` (types) and `$2` (ids)
/// claimable again: their blocker was just retried or skipped.
const RELEASE_HELD: &str = "UPDATE outbox SET held_at = NULL
     WHERE held_at IS NOT NULL AND published_at IS NULL
       AND (aggregate_type, aggregate_id) IN (SELECT * FROM unnest($1::text[], $2::text[]))";

/// [`RELEASE_HELD`] on SQLite: the aggregates as a JSON array of `[type, id]` pairs in `?1`.
const SQLITE_RELEASE_HELD: &str = "UPDATE outbox SET held_at = NULL
     WHERE held_at IS NOT NULL AND published_at IS NULL
       AND (aggregate_type, aggregate_id) IN (
           SELECT json_extract(value, '$[0]'), json_extract(value, '$[1]') FROM json_each(?1))";

/// Runs one of this module's updates, written by `sql` for the table's source (`true`: a WAL relay
/// reads it), with the release of the aggregates it changed in the same transaction: on
/// PostgreSQL, under the WAL source a release written into the WAL; under polling relays (and on
/// SQLite and MySQL) the rows their claims held behind those events (`held_at`) made claimable
/// again.
async fn execute(
    database_url: &str,
    table: &TableName,
    sql: impl FnOnce(bool) -> String,
    params: Vec<String>,
) -> Result<u64, sqlx::Error> {
    let mut table = OutboxTable::connect(database_url, table).await?;
    let wal = read_by_wal(&mut table).await?;
    let (sql, order) = dialect(&table, &sql(wal));
    // Audited: the statement is built from this module's fragments; every value is a parameter.
    let rows = match &mut table.conn {
        Connection::Postgres(conn) => {
            let mut tx = conn.begin().await?;
            let sql = format!("{sql} RETURNING aggregate_type, aggregate_id");
            let mut query =
                sqlx::query_as::<_, (String, String)>(sqlx::AssertSqlSafe(sql.as_str()));
            for p in &params {
                query = query.bind(p);
            }
            let changed = query.fetch_all(&mut *tx).await?;
            let aggregates: std::collections::BTreeSet<&(String, String)> =
                changed.iter().collect();
            if wal && !aggregates.is_empty() {
                sqlx::query("SELECT pg_logical_emit_message(true, $1, $2)")
                    .bind(crate::source::wal::RELEASE_PREFIX)
                    .bind(serde_json::to_string(&aggregates).expect("strings serialize"))
                    .execute(&mut *tx)
                    .await?;
            } else if !aggregates.is_empty() {
                let (types, ids): (Vec<&str>, Vec<&str>) = aggregates
                    .iter()
                    .map(|(t, i)| (t.as_str(), i.as_str()))
                    .unzip();
                // Audited: the table's name, checked to be identifiers only; values are bound.
                let release_held = table.name.rewrite(RELEASE_HELD, '"');
                sqlx::query(sqlx::AssertSqlSafe(&*release_held))
                    .bind(types)
                    .bind(ids)
                    .execute(&mut *tx)
                    .await?;
            }
            tx.commit().await?;
            changed.len() as u64
        }
        Connection::Sqlite(conn) => {
            let mut tx = conn.begin().await?;
            let sql = format!("{sql} RETURNING aggregate_type, aggregate_id");
            let mut query =
                sqlx::query_as::<_, (String, String)>(sqlx::AssertSqlSafe(sql.as_str()));
            for p in &params {
                query = query.bind(p);
            }
            let changed = query.fetch_all(&mut *tx).await?;
            if !changed.is_empty() {
                // Audited: the table's name, checked to be identifiers only; values are bound.
                let release_held = table.name.rewrite(SQLITE_RELEASE_HELD, '"');
                sqlx::query(sqlx::AssertSqlSafe(&*release_held))
                    .bind(serde_json::to_string(&changed).expect("strings serialize"))
                    .execute(&mut *tx)
                    .await?;
            }
            tx.commit().await?;
            changed.len() as u64
        }
        Connection::MySql(conn) => {
            let mut query = sqlx::query(sqlx::AssertSqlSafe(sql.as_str()));
            for p in order
                .unwrap_or_default()
                .iter()
                .filter_map(|&i| params.get(i))
            {
                query = query.bind(p);
            }
            let mut tx = conn.begin().await?;
            let changed = query.execute(&mut *tx).await?.rows_affected();
            if changed > 0 {
                // MySQL returns no changed rows: every held row that nothing blocks any more goes
                // free, whatever its aggregate (the claim holds a row again while it waits).
                let release = table.name.rewrite(MYSQL_RELEASE_UNBLOCKED, '`');
                sqlx::query(sqlx::AssertSqlSafe(&*release))
                    .bind(true)
                    .bind(vec![0xffu8; 32])
                    .execute(&mut *tx)
                    .await?;
            }
            tx.commit().await?;
            changed
        }
    };
    Ok(rows)
}
