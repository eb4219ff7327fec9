//! A fresh outbox per measurement, and the backlog to drain.

use sqlx::Connection;
use sqlx::postgres::{PgConnection, PgPool, PgPoolOptions};
use uuid::Uuid;

/// One measurement's own schema, migrated.
pub struct Db {
    /// A URL whose connections use the schema.
    pub url: String,
    /// A pool on it.
    pub pool: PgPool,
}

/// The schemas this run created, dropped at its end ([`drop_all`]).
static CREATED: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

pub async fn fresh(base_url: &str) -> Db {
    let schema = format!("bench_{}", Uuid::now_v7().simple());
    CREATED.lock().unwrap().push(schema.clone());
    let mut admin = PgConnection::connect(base_url)
        .await
        .expect("connect to PostgreSQL");
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
        .execute(&mut admin)
        .await
        .expect("create schema");
    let separator = if base_url.contains('?') { '&' } else { '?' };
    let url = format!("{base_url}{separator}options=-c%20search_path%3D{schema}");
    let orm = seaorm_outbox::sea_orm::Database::connect(&url)
        .await
        .expect("connect");
    seaorm_outbox::migration::migrate(&orm)
        .await
        .expect("migrate");
    orm.close().await.ok();
    let pool = PgPoolOptions::new()
        .max_connections(16)
        .connect(&url)
        .await
        .expect("pool");
    Db { url, pool }
}

/// Drops every schema this run created: a run fills tens of millions of rows, which a database
/// that outlives the run would otherwise keep.
pub async fn drop_all(base_url: &str) {
    let schemas = std::mem::take(&mut *CREATED.lock().unwrap());
    let mut admin = PgConnection::connect(base_url)
        .await
        .expect("connect to PostgreSQL");
    for schema in schemas {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP SCHEMA IF EXISTS {schema} CASCADE"
        )))
        .execute(&mut admin)
        .await
        .expect("drop schema");
    }
}

/// The payload of event `g`: about 200 bytes of JSON.
pub const PAYLOAD_SQL: &str = "jsonb_build_object('order_id', 'agg-' || (g % $2), 'customer', 'customer-' || (g % 97), \
     'total_cents', g, 'currency', 'EUR', 'note', repeat('x', 110))";

/// Fills the outbox with `events` unpublished events over `aggregates` aggregates, then ANALYZE.
pub async fn fill(db: &Db, events: usize, aggregates: usize) {
    let chunk = 50_000;
    let mut start = 0;
    while start < events {
        let end = (start + chunk).min(events);
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
             SELECT gen_random_uuid(), 'order', 'agg-' || (g % $2), 'OrderPlaced', {PAYLOAD_SQL}
             FROM generate_series($1::int8, $3::int8 - 1) g"
        )))
        .bind(start as i64)
        .bind(aggregates as i64)
        .bind(end as i64)
        .execute(&db.pool)
        .await
        .expect("fill");
        start = end;
    }
    sqlx::query("ANALYZE outbox")
        .execute(&db.pool)
        .await
        .expect("analyze");
}

/// Average payload size in bytes.
pub async fn payload_bytes(db: &Db) -> f64 {
    sqlx::query_scalar("SELECT coalesce(avg(octet_length(payload::text)), 0)::float8 FROM outbox")
        .fetch_one(&db.pool)
        .await
        .expect("payload size")
}

/// Waits until the backlog is 0. It probes for one unpublished row, not a count: counting a large
/// backlog every few milliseconds would take the database's CPU away from the relay being measured.
pub async fn wait_drained(db: &Db) {
    loop {
        let left: bool =
            sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM outbox WHERE published_at IS NULL)")
                .fetch_one(&db.pool)
                .await
                .expect("backlog probe");
        if !left {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// Waits until a relay holds all 256 shard leases of this outbox: it is connected and working.
pub async fn wait_leased(db: &Db) {
    loop {
        let leased: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 2
               AND classid = hashtext('outbox-relay:' || 'outbox'::regclass::oid::text)::oid AND objid < 256",
        )
        .fetch_one(&db.pool)
        .await
        .expect("lease probe");
        if leased == 256 {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// Waits until a WAL relay reads `slot`.
pub async fn wait_slot_read(db: &Db, slot: &str) {
    loop {
        let active: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1 AND active)",
        )
        .bind(slot)
        .fetch_one(&db.pool)
        .await
        .expect("slot probe");
        if active {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}
