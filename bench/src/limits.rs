//! The limits, with no relay: the claim-and-mark SQL alone, the producer alone, and the two
//! together as the relay runs them (the "null pipelines"): one after the other (serial), and with
//! the next claim overlapping the broker's acks (pipelined). Both claim as the relay does, with a
//! plain read, and mark in a short transaction of its own.

use crate::setup::{self, Db};
use rdkafka::config::ClientConfig;
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord};
use seaorm_outbox_relay::Mode;
use seaorm_outbox_relay::sink::kafka::KafkaConfig;
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

/// One claimed batch: ids, seqs, keys, payloads.
#[derive(Default)]
struct Batch {
    ids: Vec<Uuid>,
    seqs: Vec<i64>,
    keys: Vec<String>,
    payloads: Vec<String>,
}

/// The oldest unpublished rows, skipping the `seq`s in `skip` (a batch in flight) through a
/// hashed subplan, as the relay does (`seq <> ALL($2)` compares each row with every element of
/// the array once PostgreSQL caches a generic plan).
async fn claim(conn: &mut sqlx::PgConnection, batch: usize, skip: &[i64]) -> Batch {
    let rows = sqlx::query(
        "SELECT id, seq, aggregate_id, payload::text FROM outbox
         WHERE published_at IS NULL AND seq NOT IN (SELECT unnest($2::int8[]))
         ORDER BY seq LIMIT $1",
    )
    .bind(batch as i64)
    .bind(skip)
    .fetch_all(&mut *conn)
    .await
    .expect("claim");
    let mut claimed = Batch::default();
    for r in rows {
        claimed.ids.push(r.get(0));
        claimed.seqs.push(r.get(1));
        claimed.keys.push(r.get(2));
        claimed.payloads.push(r.get(3));
    }
    claimed
}

async fn settle(conn: &mut sqlx::PgConnection, ids: &[Uuid], mode: Mode) {
    let sql = match mode {
        Mode::Mark => "UPDATE outbox SET published_at = now() WHERE id = ANY($1)",
        Mode::Delete => "DELETE FROM outbox WHERE id = ANY($1)",
    };
    sqlx::query(sql)
        .bind(ids)
        .execute(&mut *conn)
        .await
        .expect("settle");
}

/// Hands every message to the producer; the acks come later.
pub async fn enqueue_all(
    producer: &FutureProducer,
    topic: &str,
    keys: &[String],
    payloads: &[String],
) -> Vec<DeliveryFuture> {
    let mut pending = Vec::with_capacity(keys.len());
    for (key, payload) in keys.iter().zip(payloads) {
        let record = FutureRecord::to(topic)
            .key(key.as_bytes())
            .payload(payload.as_bytes());
        pending.push(enqueue(producer, record).await);
    }
    pending
}

/// Hands `record` to the producer, waiting while its queue is full.
pub async fn enqueue(
    producer: &FutureProducer,
    mut record: FutureRecord<'_, [u8], [u8]>,
) -> DeliveryFuture {
    loop {
        match producer.send_result(record) {
            Ok(delivery) => return delivery,
            Err((_, returned)) => {
                record = returned;
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
    }
}

pub async fn acked(pending: Vec<DeliveryFuture>) {
    for delivery in pending {
        delivery.await.expect("delivery").expect("acked");
    }
}

pub async fn send_all(
    producer: &FutureProducer,
    topic: &str,
    keys: &[String],
    payloads: &[String],
) {
    acked(enqueue_all(producer, topic, keys, payloads).await).await;
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
        let claimed = claim(&mut conn, batch, &[]).await;
        if claimed.ids.is_empty() {
            break;
        }
        settle(&mut conn, &claimed.ids, mode).await;
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

/// A fresh database filled with the backlog, a producer, and a new topic it has written to once.
async fn ready(
    base_url: &str,
    brokers: &str,
    events: usize,
    aggregates: usize,
) -> (Db, FutureProducer, String) {
    let db: Db = setup::fresh(base_url).await;
    setup::fill(&db, events, aggregates).await;
    let producer = producer(brokers);
    let topic = format!("bench-null-{}", Uuid::now_v7().simple());
    send_all(&producer, &topic, &["warm-up".into()], &["{}".into()]).await;
    (db, producer, topic)
}

/// The relay's work without the relay, one step after the other: claim, send the batch, await the
/// acks, mark.
pub async fn null_pipeline(
    base_url: &str,
    brokers: &str,
    events: usize,
    aggregates: usize,
    batch: usize,
    mode: Mode,
) -> f64 {
    let (db, producer, topic) = ready(base_url, brokers, events, aggregates).await;
    let mut conn = db.pool.acquire().await.unwrap();
    let started = Instant::now();
    loop {
        let claimed = claim(&mut conn, batch, &[]).await;
        if claimed.ids.is_empty() {
            break;
        }
        send_all(&producer, &topic, &claimed.keys, &claimed.payloads).await;
        settle(&mut conn, &claimed.ids, mode).await;
    }
    events as f64 / started.elapsed().as_secs_f64()
}

/// The relay's work without the relay, pipelined as the relay runs it: claim the next batch
/// (skipping the one in flight) while the broker acks the current one, then send the next and
/// mark the acked one while the broker works.
pub async fn pipelined_null_pipeline(
    base_url: &str,
    brokers: &str,
    events: usize,
    aggregates: usize,
    batch: usize,
    mode: Mode,
) -> f64 {
    let (db, producer, topic) = ready(base_url, brokers, events, aggregates).await;
    let mut conn = db.pool.acquire().await.unwrap();
    let started = Instant::now();
    let mut in_flight: Option<(Batch, Vec<DeliveryFuture>)> = None;
    loop {
        let skip = in_flight
            .as_ref()
            .map(|(b, _)| b.seqs.clone())
            .unwrap_or_default();
        let claimed = claim(&mut conn, batch, &skip).await;
        let answered = match in_flight.take() {
            Some((sent, pending)) => {
                acked(pending).await;
                Some(sent)
            }
            None => None,
        };
        if claimed.ids.is_empty() && answered.is_none() {
            break;
        }
        if !claimed.ids.is_empty() {
            let pending = enqueue_all(&producer, &topic, &claimed.keys, &claimed.payloads).await;
            in_flight = Some((claimed, pending));
        }
        if let Some(sent) = answered {
            settle(&mut conn, &sent.ids, mode).await;
        }
    }
    events as f64 / started.elapsed().as_secs_f64()
}
