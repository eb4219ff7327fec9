//! The outbox demo. An order service records each event in the same transaction as the order it
//! describes; a failing request rolls both back; the relay publishes what committed; a consumer
//! shows it arriving.
//!
//! - `outbox-demo`: PostgreSQL at `DATABASE_URL` and Kafka at `KAFKA_BROKERS` (`scripts/demo`
//!   starts both on loopback).
//! - `outbox-demo --sqlite`: an embedded SQLite database, and the relay prints to stdout.

use outbox_core::sea_orm::{
    ConnectionTrait, Database, DatabaseConnection, DatabaseTransaction, Statement, TransactionTrait,
};
use outbox_core::{OutboxEvent, Uuid};
use outbox_relay::sink::kafka::{KafkaConfig, KafkaSink};
use outbox_relay::sink::stdout::StdoutSink;
use outbox_relay::{Relay, RelayConfig};
use rdkafka::Message;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::Headers;
use shop_events::{OrderPlaced, OrderShipped, PaymentCaptured};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

type AnyError = Box<dyn std::error::Error>;

#[tokio::main]
async fn main() -> Result<(), AnyError> {
    let sqlite = std::env::args().any(|a| a == "--sqlite");
    let (url, brokers) = if sqlite {
        let path = std::env::temp_dir().join("outbox-demo.db");
        let _ = std::fs::remove_file(&path);
        (format!("sqlite://{}?mode=rwc", path.display()), None)
    } else {
        let url = std::env::var("DATABASE_URL")
            .map_err(|_| "DATABASE_URL is not set: run scripts/demo")?;
        let brokers = std::env::var("KAFKA_BROKERS")
            .map_err(|_| "KAFKA_BROKERS is not set: run scripts/demo")?;
        (url, Some(brokers))
    };

    let db = Database::connect(&url).await?;
    outbox_core::migration::migrate(&db).await?;
    db.execute_unprepared(
        "CREATE TABLE IF NOT EXISTS orders (id TEXT PRIMARY KEY, customer TEXT NOT NULL, total_cents BIGINT NOT NULL)",
    )
    .await?;
    db.execute_unprepared("DELETE FROM orders").await?;
    println!(
        "== 1. the order service, on {}\n",
        outbox_relay::redact_url(&url)
    );

    let mut recorded = Vec::new();
    recorded.push(place_order(&db, "o-1", "ada", 1999).await?);
    recorded.push(place_order(&db, "o-2", "grace", 4500).await?);
    let err = place_order(&db, "o-1", "mallory", 1).await.unwrap_err();
    println!("  order o-1 again: rejected ({err});\n    its event was rolled back with it");
    let txn = db.begin().await?;
    let events = (
        OrderShipped {
            order_id: "o-1".into(),
            carrier: "dhl".into(),
        },
        PaymentCaptured {
            payment_id: 7,
            order_id: "o-2".into(),
        },
    );
    recorded.push(events.0.record(&txn).await?);
    recorded.push(events.1.record(&txn).await?);
    txn.commit().await?;
    println!("  o-1 shipped and o-2 paid, in one transaction");
    println!("\n{}", outbox_relay::status(&url).await?);

    println!("\n== 2. the relay publishes what committed");
    let config = RelayConfig::new(url.clone());
    let relay = match &brokers {
        Some(brokers) => Relay::new(config, KafkaSink::new(&KafkaConfig::new(brokers.clone()))?),
        None => Relay::new(config, StdoutSink),
    };
    let shutdown = CancellationToken::new();
    let running = tokio::spawn({
        let shutdown = shutdown.clone();
        async move { relay.run(shutdown).await }
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    while outbox_relay::status(&url).await?.backlog > 0 {
        if Instant::now() > deadline {
            return Err("the relay did not drain the outbox within 60 s".into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    shutdown.cancel();
    running.await?;
    println!("{}", outbox_relay::status(&url).await?);

    if let Some(brokers) = brokers {
        println!("\n== 3. a consumer reads them from Kafka ({brokers})\n");
        consume(&brokers, &recorded).await?;
    }
    Ok(())
}

/// A request handler: the order and its event commit together, or not at all.
async fn place_order(
    db: &DatabaseConnection,
    id: &str,
    customer: &str,
    total: i64,
) -> Result<Uuid, AnyError> {
    let txn = db.begin().await?;
    let event = OrderPlaced {
        order_id: id.into(),
        customer: customer.into(),
        total_cents: total,
    };
    let event_id = event.record(&txn).await?;
    insert_order(&txn, &event).await?;
    txn.commit().await?;
    println!("  order {id} placed; event {event_id} recorded in the same transaction");
    Ok(event_id)
}

async fn insert_order(txn: &DatabaseTransaction, o: &OrderPlaced) -> Result<(), AnyError> {
    let backend = txn.get_database_backend();
    let sql = match backend {
        outbox_core::sea_orm::DbBackend::Postgres => {
            "INSERT INTO orders (id, customer, total_cents) VALUES ($1, $2, $3)"
        }
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

/// Reads the three topics until every event recorded above has arrived.
async fn consume(brokers: &str, recorded: &[Uuid]) -> Result<(), AnyError> {
    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", format!("outbox-demo-{}", Uuid::now_v7()))
        .set("auto.offset.reset", "earliest")
        .create()?;
    consumer.subscribe(&[
        "outbox.event.order",
        "shop.shipping",
        "outbox.event.payment",
    ])?;
    let mut missing: Vec<String> = recorded.iter().map(Uuid::to_string).collect();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !missing.is_empty() {
        let message = tokio::time::timeout_at(deadline, consumer.recv())
            .await
            .map_err(|_| format!("{} events did not arrive within 30 s", missing.len()))??;
        let header = |name: &str| {
            message.headers().and_then(|h| {
                h.iter()
                    .find(|h| h.key == name)
                    .and_then(|h| h.value)
                    .map(|v| String::from_utf8_lossy(v).into_owned())
            })
        };
        let Some(id) = header("id") else { continue };
        if let Some(i) = missing.iter().position(|m| *m == id) {
            missing.remove(i);
            println!(
                "  {:<20} partition {} key={:<4} {:<16} {}",
                message.topic(),
                message.partition(),
                String::from_utf8_lossy(message.key().unwrap_or_default()),
                header("event_type").unwrap_or_default(),
                String::from_utf8_lossy(message.payload().unwrap_or_default()),
            );
        }
    }
    println!("\nevery committed event arrived; the rolled-back one never will.");
    Ok(())
}
