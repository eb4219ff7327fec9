//! Pulsar: the raw producer's limit and the relay's Pulsar sink draining the same backlog, so the
//! sink's overhead is a ratio measured in one run.

use crate::setup;
use pulsar::{Producer, Pulsar, TokioExecutor, producer};
use seaorm_outbox_relay::sink::pulsar::{PulsarConfig, PulsarSink};
use seaorm_outbox_relay::{Mode, Relay, RelayConfig};
use std::time::Instant;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// A producer with the sink's settings.
async fn raw(url: &str, topic: &str) -> Producer<TokioExecutor> {
    let client = Pulsar::builder(url, TokioExecutor)
        .build()
        .await
        .expect("pulsar client");
    client
        .producer()
        .with_topic(topic)
        .with_options(PulsarConfig::new(url).producer_options())
        .build()
        .await
        .expect("pulsar producer")
}

/// The producer alone, sending windows of `batch` keyed messages and awaiting each window's
/// receipts: msgs/s.
pub async fn raw_producer(url: &str, events: usize, aggregates: usize, batch: usize) -> f64 {
    let topic = format!("bench-pulsar-raw-{}", Uuid::now_v7().simple());
    let mut producer = raw(url, &topic).await;
    let payload = "x".repeat(200).into_bytes();
    let message = |g: usize| {
        let key = format!("agg-{}", g % aggregates);
        producer::Message {
            payload: payload.clone(),
            ordering_key: Some(key.clone().into_bytes()),
            partition_key: Some(key),
            ..Default::default()
        }
    };
    // The topic exists before timing.
    producer
        .send_non_blocking(message(0))
        .await
        .unwrap()
        .await
        .unwrap();
    let started = Instant::now();
    for window in (0..events).collect::<Vec<_>>().chunks(batch) {
        let mut receipts = Vec::with_capacity(window.len());
        for &g in window {
            receipts.push(producer.send_non_blocking(message(g)).await.expect("send"));
        }
        for receipt in receipts {
            receipt.await.expect("receipt");
        }
    }
    events as f64 / started.elapsed().as_secs_f64()
}

/// Events/s acked by Pulsar while one relay drains `events` (mark mode).
pub async fn drain(
    base_url: &str,
    url: &str,
    events: usize,
    aggregates: usize,
    batch: usize,
) -> f64 {
    let db = setup::fresh(base_url).await;
    setup::fill(&db, events, aggregates).await;
    let mut config = RelayConfig::new(&db.url);
    config.batch_size = batch;
    config.mode = Mode::Mark;
    config.retention = None;
    config.topic_template = format!(
        "bench-pulsar-{}.{{aggregate_type}}",
        Uuid::now_v7().simple()
    );
    let sink = PulsarSink::new(&PulsarConfig::new(url)).expect("sink");
    let relay = Relay::new(config, sink);
    let shutdown = CancellationToken::new();
    let started = Instant::now();
    let running = tokio::spawn({
        let shutdown = shutdown.clone();
        async move { relay.run(shutdown).await.expect("the relay refused to run") }
    });
    setup::wait_drained(&db).await;
    let rate = events as f64 / started.elapsed().as_secs_f64();
    shutdown.cancel();
    running.await.unwrap();
    rate
}
