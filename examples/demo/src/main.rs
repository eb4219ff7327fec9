//! Places a few orders, each in one transaction with its `OrderPlaced` event, rolls one back, and
//! prints what the outbox holds: the events a relay would publish.
//!
//! Runs on an embedded SQLite file by default; set `DATABASE_URL` to use PostgreSQL.

use outbox_core::OutboxEvent;
use outbox_core::sea_orm::{
    ConnectionTrait, Database, DatabaseConnection, DatabaseTransaction, DbBackend, Statement,
    TransactionTrait,
};
use serde::Serialize;

#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate = "order", key = "order_id")]
struct OrderPlaced {
    order_id: String,
    customer: String,
    total_cents: i64,
}

#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate = "order", key = "order_id", topic = "shipping")]
struct OrderShipped {
    order_id: String,
    carrier: String,
}

type AnyError = Box<dyn std::error::Error>;

#[tokio::main]
async fn main() -> Result<(), AnyError> {
    let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| {
        let path = std::env::temp_dir().join("outbox-demo.db");
        let _ = std::fs::remove_file(&path);
        format!("sqlite://{}?mode=rwc", path.display())
    });
    let db = Database::connect(&url).await?;
    outbox_core::migration::migrate(&db).await?;
    db.execute_unprepared(
        "CREATE TABLE IF NOT EXISTS orders (id TEXT PRIMARY KEY, customer TEXT NOT NULL, total_cents BIGINT NOT NULL)",
    )
    .await?;
    println!("outbox demo on {}\n", redact(&url));

    place_order(&db, "o-1", "ada", 1999).await?;
    place_order(&db, "o-2", "grace", 4500).await?;
    // The handler fails after recording: its transaction rolls back and no event survives.
    let err = place_order(&db, "o-1", "mallory", 1).await.unwrap_err();
    println!("order o-1 again: rejected ({err}); its event was rolled back with it\n");

    let txn = db.begin().await?;
    OrderShipped {
        order_id: "o-1".into(),
        carrier: "dhl".into(),
    }
    .record(&txn)
    .await?;
    txn.commit().await?;

    print_outbox(&db).await
}

/// A request handler: the state change and its event commit together or not at all.
async fn place_order(
    db: &DatabaseConnection,
    id: &str,
    customer: &str,
    total: i64,
) -> Result<(), AnyError> {
    let txn = db.begin().await?;
    let event = OrderPlaced {
        order_id: id.into(),
        customer: customer.into(),
        total_cents: total,
    };
    let event_id = event.record(&txn).await?;
    insert_order(&txn, &event).await?;
    txn.commit().await?;
    println!("order {id} placed, event {event_id} recorded in the same transaction");
    Ok(())
}

async fn insert_order(txn: &DatabaseTransaction, o: &OrderPlaced) -> Result<(), AnyError> {
    let backend = txn.get_database_backend();
    let sql = match backend {
        DbBackend::Postgres => "INSERT INTO orders (id, customer, total_cents) VALUES ($1, $2, $3)",
        _ => "INSERT INTO orders (id, customer, total_cents) VALUES (?, ?, ?)",
    };
    let values = [
        o.order_id.clone().into(),
        o.customer.clone().into(),
        o.total_cents.into(),
    ];
    txn.execute_raw(Statement::from_sql_and_values(backend, sql, values))
        .await?;
    Ok(())
}

async fn print_outbox(db: &DatabaseConnection) -> Result<(), AnyError> {
    let rows = db
        .query_all_raw(Statement::from_string(
            db.get_database_backend(),
            "SELECT seq, event_type, aggregate_id, CAST(payload AS TEXT) AS payload FROM outbox ORDER BY seq",
        ))
        .await?;
    println!("\nthe outbox, in publish order ({} events):", rows.len());
    for row in rows {
        let seq: i64 = row.try_get("", "seq")?;
        let event_type: String = row.try_get("", "event_type")?;
        let key: String = row.try_get("", "aggregate_id")?;
        let payload: String = row.try_get("", "payload")?;
        println!("  #{seq} {event_type:<12} key={key:<4} {payload}");
    }
    Ok(())
}

/// The URL without its password, for printing.
fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            format!("{}://***@{}", &url[..scheme], &url[at + 1..])
        }
        _ => url.to_owned(),
    }
}
