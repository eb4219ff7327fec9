//! What `record` adds to a business transaction.

use crate::setup;
use seaorm_outbox::OutboxEvent;
use seaorm_outbox::sea_orm::{ConnectionTrait, Database, DbBackend, Statement, TransactionTrait};
use serde::Serialize;
use std::time::Instant;

#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate = "order", key = "order_id")]
struct OrderPlaced {
    order_id: String,
    customer: String,
    total_cents: i64,
    note: String,
}

/// What a measured transaction does besides its business row.
#[derive(Clone, Copy)]
enum Extra {
    Nothing,
    /// One `SELECT 1`: the cost of any extra statement, the floor for one `record`.
    RoundTrip,
    /// `record` (1) or `record_all` of n events, recorded this way.
    Events(usize, seaorm_outbox::Recording),
}

/// Mean microseconds per transaction on PostgreSQL: business row alone, with one extra
/// statement, with one `record`, with `record_all` of 10 and of 100 events, in the table and
/// table-less.
pub async fn measure(base_url: &str, iterations: usize) -> Vec<(String, f64)> {
    let db = setup::fresh(base_url).await;
    use seaorm_outbox::Recording::{LogicalMessage, Table};
    let cases = [
        Extra::Nothing,
        Extra::RoundTrip,
        Extra::Events(1, Table),
        Extra::Events(10, Table),
        Extra::Events(100, Table),
        Extra::Events(1, LogicalMessage),
        Extra::Events(100, LogicalMessage),
    ];
    measure_cases(&db.url, iterations, &cases).await
}

/// The same on the database at `url` (a fresh one, migrated), in the table only: the cases every
/// backend has, for comparing backends.
pub async fn measure_table(url: &str, iterations: usize) -> Vec<(String, f64)> {
    use seaorm_outbox::Recording::Table;
    let cases = [
        Extra::Nothing,
        Extra::RoundTrip,
        Extra::Events(1, Table),
        Extra::Events(10, Table),
        Extra::Events(100, Table),
    ];
    measure_cases(url, iterations, &cases).await
}

async fn measure_cases(url: &str, iterations: usize, cases: &[Extra]) -> Vec<(String, f64)> {
    let orm = Database::connect(url).await.unwrap();
    let backend = orm.get_database_backend();
    orm.execute_unprepared(
        "CREATE TABLE bench_orders (id VARCHAR(64) PRIMARY KEY, total_cents BIGINT NOT NULL)",
    )
    .await
    .unwrap();
    let insert = match backend {
        DbBackend::Postgres => "INSERT INTO bench_orders (id, total_cents) VALUES ($1, 1999)",
        _ => "INSERT INTO bench_orders (id, total_cents) VALUES (?, 1999)",
    };
    let mut next = 0u64;
    let mut results = Vec::new();
    use seaorm_outbox::Recording::{LogicalMessage, Table};
    for &extra in cases {
        if let Extra::Events(_, recording) = extra {
            seaorm_outbox::set_recording(recording);
        }
        let started = Instant::now();
        for _ in 0..iterations {
            next += 1;
            let id = format!("o-{next}");
            let txn = orm.begin().await.unwrap();
            txn.execute_raw(Statement::from_sql_and_values(
                backend,
                insert,
                [id.clone().into()],
            ))
            .await
            .unwrap();
            let event = |i: usize| OrderPlaced {
                order_id: format!("{id}-{i}"),
                customer: "customer-1".into(),
                total_cents: 1999,
                note: "x".repeat(110),
            };
            match extra {
                Extra::Nothing => {}
                Extra::RoundTrip => {
                    txn.execute_unprepared("SELECT 1").await.unwrap();
                }
                Extra::Events(1, _) => {
                    event(0).record(&txn).await.unwrap();
                }
                Extra::Events(n, _) => {
                    let batch: Vec<OrderPlaced> = (0..n).map(event).collect();
                    seaorm_outbox::record_all(&txn, &batch).await.unwrap();
                }
            }
            txn.commit().await.unwrap();
        }
        let label = match extra {
            Extra::Nothing => "business transaction alone".to_owned(),
            Extra::RoundTrip => "with one SELECT 1 (any extra statement)".to_owned(),
            Extra::Events(n, recording) => {
                let how = if recording == LogicalMessage {
                    ", table-less (logical message)"
                } else {
                    ""
                };
                if n == 1 {
                    format!("with one record{how}")
                } else {
                    format!("with record_all of {n}{how}")
                }
            }
        };
        results.push((
            label,
            started.elapsed().as_secs_f64() * 1e6 / iterations as f64,
        ));
    }
    seaorm_outbox::set_recording(Table);
    results
}
