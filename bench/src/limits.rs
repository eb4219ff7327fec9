//! The limits, with no relay: the claim-and-mark SQL alone, the producer alone, and the two
//! together as the relay would run them (the "null pipeline").

use crate::setup::{self, Db};
use outbox_relay::Mode;
use outbox_relay::sink::kafka::KafkaConfig;
use rdkafka::config::ClientConfig;
use rdkafka::producer::{FutureProducer, FutureRecord};
use sqlx::Row;
use std::time::{Duration, Instant};
use uuid::Uuid;

/// A producer with the relay's settings.
pub fn producer(brokers: &str) -> FutureProducer {
    let mut client = ClientConfig::new();
    for (k, v) in KafkaConfig::new(brokers).producer_settings() {
        client.set(k, v);
    }
    client.create().expect("producer")
}

/// One claimed batch: ids, keys, payloads.
type Batch = (Vec<Uuid>, Vec<String>, Vec<String>);

async fn claim(tx: &mut sqlx::PgConnection, batch: usize) -> Batch {
    let rows = sqlx::query(
        "SELECT id, aggregate_id, payload::text FROM outbox WHERE published_at IS NULL
         ORDER BY seq LIMIT $1 FOR UPDATE SKIP LOCKED",
    )
    .bind(batch as i64)
    .fetch_all(&mut *tx)
    .await
    .expect("claim");
    let mut claimed = (Vec::new(), Vec::new(), Vec::new());
    for r in rows {
        claimed.0.push(r.get(0));
        claimed.1.push(r.get(1));
        claimed.2.push(r.get(2));
    }
    claimed
}

async fn settle(tx: &mut sqlx::PgConnection, ids: &[Uuid], mode: Mode) {
    let sql = match mode {
        Mode::Mark => "UPDATE outbox SET published_at = now() WHERE id = ANY($1)",
        Mode::Delete => "DELETE FROM outbox WHERE id = ANY($1)",
    };
    sqlx::query(sql)
        .bind(ids)
        .execute(&mut *tx)
        .await
        .expect("settle");
}

async fn send_all(producer: &FutureProducer, topic: &str, keys: &[String], payloads: &[String]) {
    let mut pending = Vec::with_capacity(keys.len());
    for (key, payload) in keys.iter().zip(payloads) {
        let mut record = FutureRecord::to(topic)
            .key(key.as_bytes())
            .payload(payload.as_bytes());
        loop {
            match producer.send_result(record) {
                Ok(delivery) => {
                    pending.push(delivery);
                    break;
                }
                Err((_, returned)) => {
                    record = returned;
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            }
        }
    }
    for delivery in pending {
        delivery.await.expect("delivery").expect("acked");
    }
}

/// Claim-and-mark (or delete) with no broker: rows/s.
pub async fn raw_sql(
    base_url: &str,
    events: usize,
    aggregates: usize,
    batch: usize,
    mode: Mode,
) -> f64 {
    let db = setup::fresh(base_url).await;
    setup::fill(&db, events, aggregates).await;
    let mut conn = db.pool.acquire().await.unwrap();
    let started = Instant::now();
    loop {
        let mut tx = sqlx::Connection::begin(&mut *conn).await.unwrap();
        let (ids, _, _) = claim(&mut tx, batch).await;
        if ids.is_empty() {
            break;
        }
        settle(&mut tx, &ids, mode).await;
        tx.commit().await.unwrap();
    }
    events as f64 / started.elapsed().as_secs_f64()
}

/// The producer alone, sending windows of `batch` and awaiting each window's acks: msgs/s.
pub async fn raw_producer(brokers: &str, events: usize, aggregates: usize, batch: usize) -> f64 {
    let producer = producer(brokers);
    let topic = format!("bench-raw-{}", Uuid::now_v7().simple());
    let payload = "x".repeat(200);
    let keys: Vec<String> = (0..events)
        .map(|g| format!("agg-{}", g % aggregates))
        .collect();
    let payloads = vec![payload; batch];
    // Create the topic before timing.
    send_all(&producer, &topic, &keys[..1], &payloads[..1]).await;
    let started = Instant::now();
    for window in keys.chunks(batch) {
        send_all(&producer, &topic, window, &payloads[..window.len()]).await;
    }
    events as f64 / started.elapsed().as_secs_f64()
}

/// The relay's work without the relay: claim, send the batch, await the acks, mark, commit.
pub async fn null_pipeline(
    base_url: &str,
    brokers: &str,
    events: usize,
    aggregates: usize,
    batch: usize,
    mode: Mode,
) -> f64 {
    let db: Db = setup::fresh(base_url).await;
    setup::fill(&db, events, aggregates).await;
    let producer = producer(brokers);
    let topic = format!("bench-null-{}", Uuid::now_v7().simple());
    send_all(&producer, &topic, &["warm-up".into()], &["{}".into()]).await;
    let mut conn = db.pool.acquire().await.unwrap();
    let started = Instant::now();
    loop {
        let mut tx = sqlx::Connection::begin(&mut *conn).await.unwrap();
        let (ids, keys, payloads) = claim(&mut tx, batch).await;
        if ids.is_empty() {
            break;
        }
        send_all(&producer, &topic, &keys, &payloads).await;
        settle(&mut tx, &ids, mode).await;
        tx.commit().await.unwrap();
    }
    events as f64 / started.elapsed().as_secs_f64()
}
