//! What `record` adds to a business transaction.

use crate::setup;
use outbox_core::OutboxEvent;
use outbox_core::sea_orm::{ConnectionTrait, Database, DbBackend, Statement, TransactionTrait};
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

/// Mean microseconds per transaction: business row alone, with one `record`, with `record_all`
/// of 10 and of 100 events.
pub async fn measure(base_url: &str, iterations: usize) -> Vec<(String, f64)> {
    let db = setup::fresh(base_url).await;
    let orm = Database::connect(&db.url).await.unwrap();
    orm.execute_unprepared(
        "CREATE TABLE bench_orders (id TEXT PRIMARY KEY, total_cents BIGINT NOT NULL)",
    )
    .await
    .unwrap();
    let mut next = 0u64;
    let mut results = Vec::new();
    let cases = [
        (0usize, outbox_core::Recording::Table),
        (1, outbox_core::Recording::Table),
        (10, outbox_core::Recording::Table),
        (100, outbox_core::Recording::Table),
        (1, outbox_core::Recording::LogicalMessage),
        (100, outbox_core::Recording::LogicalMessage),
    ];
    for (events, recording) in cases {
        outbox_core::set_recording(recording);
        let started = Instant::now();
        for _ in 0..iterations {
            next += 1;
            let id = format!("o-{next}");
            let txn = orm.begin().await.unwrap();
            txn.execute_raw(Statement::from_sql_and_values(
                DbBackend::Postgres,
                "INSERT INTO bench_orders (id, total_cents) VALUES ($1, 1999)",
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
            match events {
                0 => {}
                1 => {
                    event(0).record(&txn).await.unwrap();
                }
                n => {
                    let batch: Vec<OrderPlaced> = (0..n).map(event).collect();
                    outbox_core::record_all(&txn, &batch).await.unwrap();
                }
            }
            txn.commit().await.unwrap();
        }
        let table_less = if recording == outbox_core::Recording::LogicalMessage {
            ", table-less (logical message)"
        } else {
            ""
        };
        let label = match events {
            0 => "business transaction alone".to_owned(),
            1 => format!("with one record{table_less}"),
            n => format!("with record_all of {n}{table_less}"),
        };
        results.push((
            label,
            started.elapsed().as_secs_f64() * 1e6 / iterations as f64,
        ));
    }
    outbox_core::set_recording(outbox_core::Recording::Table);
    results
}
