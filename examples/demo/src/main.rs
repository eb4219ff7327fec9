//! The outbox demo. An order service records each event in the same transaction as the order it
//! describes; a failing request rolls both back; the relay publishes what committed; a billing
//! service consumes it through its inbox, and a re-sent event is applied only once.
//!
//! - `outbox-demo`: PostgreSQL at `DATABASE_URL` and Kafka at `KAFKA_BROKERS` (`scripts/demo`
//!   starts both on loopback).
//! - `outbox-demo --sqlite`: an embedded SQLite database, and the relay prints to stdout.

use outbox_core::consumer::kafka::KafkaConsumer;
use outbox_core::consumer::{self, Consumed, ConsumerOptions};
use outbox_core::sea_orm::DbBackend;
use outbox_core::sea_orm::{
    ConnectionTrait, Database, DatabaseConnection, DatabaseTransaction, Statement, TransactionTrait,
};
use outbox_core::{OutboxEvent, Uuid};
use outbox_relay::sink::kafka::{KafkaConfig, KafkaSink};
use outbox_relay::sink::stdout::StdoutSink;
use outbox_relay::{Relay, RelayConfig};
use shop_events::{OrderPlaced, OrderShipped, PaymentCaptured};
use std::time::{Duration, Instant};
use tokio::sync::watch;
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
    relay_all(&url, brokers.as_deref()).await?;
    println!("{}", outbox_relay::status(&url).await?);

    let Some(brokers) = brokers else {
        return Ok(());
    };
    println!(
        "\n== 3. the billing service consumes them from Kafka ({brokers}), through its inbox\n"
    );
    db.execute_unprepared(
        "CREATE TABLE IF NOT EXISTS billing_log (event_id uuid PRIMARY KEY, what text NOT NULL)",
    )
    .await?;
    let name = format!("billing-{}", Uuid::now_v7().simple());
    let deadline = Duration::from_secs(60);
    let stop = |_| processed(&db, &name, &recorded);
    tokio::time::timeout(deadline, billing(&db, &brokers, &name, &recorded, stop))
        .await
        .map_err(|_| "the consumer did not apply every event within 60 s")??;
    println!(
        "  all {} events applied\n  (each topic keeps its aggregates' order; OrderShipped travels on shop.shipping,\n   so it need not follow OrderPlaced: route events that must stay ordered to one topic)",
        recorded.len()
    );

    println!(
        "\n== 4. the relay sends o-1's first event again (as after a crash before marking it)\n"
    );
    db.execute_unprepared(&format!(
        "UPDATE outbox SET published_at = NULL WHERE id = '{}'",
        recorded[0]
    ))
    .await?;
    relay_all(&url, Some(&brokers)).await?;
    // The consumer resumes after its committed offsets: the re-sent message is what is new.
    let stop = |mut progress: watch::Receiver<Consumed>| async move {
        let _ = progress.wait_for(|c| c.duplicates > 0).await;
    };
    let consumed = tokio::time::timeout(deadline, billing(&db, &brokers, &name, &recorded, stop))
        .await
        .map_err(|_| "the re-sent event did not arrive within 60 s")??;
    if consumed.duplicates != 1 {
        return Err(format!(
            "expected the re-sent event to be skipped as a duplicate, got {consumed:?}"
        )
        .into());
    }
    println!("  1 duplicate skipped by the inbox: billing applied each event once");
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

/// The billing service: a consumer loop that applies each event once, through the inbox.
/// Runs until `stop`, given the loop's progress, completes.
/// Events of earlier demo runs on the same Kafka are consumed too, and passed over.
async fn billing<F>(
    db: &DatabaseConnection,
    brokers: &str,
    name: &str,
    ours: &[Uuid],
    stop: impl FnOnce(watch::Receiver<Consumed>) -> F,
) -> Result<Consumed, AnyError>
where
    F: std::future::Future<Output = ()>,
{
    let topics = [
        "outbox.event.order",
        "shop.shipping",
        "outbox.event.payment",
    ];
    let consumer = KafkaConsumer::new(brokers, &topics, ConsumerOptions::new(name))?;
    let handler = consumer::handler(|envelope, txn| {
        let ours = ours.contains(&envelope.id);
        Box::pin(async move {
            if !ours {
                return Ok(());
            }
            let what = format!(
                "{} {}",
                envelope.event_type,
                String::from_utf8_lossy(&envelope.payload)
            );
            txn.execute_raw(Statement::from_sql_and_values(
                DbBackend::Postgres,
                "INSERT INTO billing_log (event_id, what) VALUES ($1::text::uuid, $2)",
                [envelope.id.to_string().into(), what.clone().into()],
            ))
            .await?;
            println!("  applied  key={:<4} {what}", envelope.aggregate_id);
            Ok(())
        })
    });
    let stop = stop(consumer.progress());
    Ok(consumer.run(db, handler, stop).await?)
}

/// Waits until `consumer` has processed the `events`.
async fn processed(db: &DatabaseConnection, consumer: &str, events: &[Uuid]) {
    loop {
        let row = db
            .query_one_raw(Statement::from_sql_and_values(
                DbBackend::Postgres,
                "SELECT count(*) FROM processed_events WHERE consumer = $1 AND event_id::text = ANY($2)",
                [
                    consumer.into(),
                    events.iter().map(Uuid::to_string).collect::<Vec<_>>().into(),
                ],
            ))
            .await
            .ok()
            .flatten();
        let done = row
            .and_then(|r| r.try_get_by_index::<i64>(0).ok())
            .unwrap_or(0);
        if done as usize == events.len() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Runs the relay until the outbox is drained.
async fn relay_all(url: &str, brokers: Option<&str>) -> Result<(), AnyError> {
    let config = RelayConfig::new(url);
    let relay = match brokers {
        Some(brokers) => Relay::new(config, KafkaSink::new(&KafkaConfig::new(brokers))?),
        None => Relay::new(config, StdoutSink),
    };
    let shutdown = CancellationToken::new();
    let running = tokio::spawn({
        let shutdown = shutdown.clone();
        async move { relay.run(shutdown).await }
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    while outbox_relay::status(url).await?.backlog > 0 {
        if Instant::now() > deadline {
            return Err("the relay did not drain the outbox within 60 s".into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    shutdown.cancel();
    running.await?;
    Ok(())
}
