//! The WAL source, side by side with the polling relay in the same run: a backlog retained in the
//! WAL while no relay read it (rows in the table, and table-less events), drained by one relay,
//! against the raw producer; and the relay binary's CPU and memory on it.

use crate::setup;
use futures::future::BoxFuture;
use seaorm_outbox_relay::sink::kafka::{KafkaConfig, KafkaSink};
use seaorm_outbox_relay::sink::{Ack, Message, Sink, SinkError};
use seaorm_outbox_relay::wal::WalSource;
use seaorm_outbox_relay::{Relay, RelayConfig, Source};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// Where the backlog's events are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backlog {
    /// Rows of the outbox table.
    Rows,
    /// Table-less events: one logical message per event, no row.
    Messages,
}

/// Kafka, counting acks.
struct CountingSink {
    inner: KafkaSink,
    acked: Arc<AtomicUsize>,
}

impl Sink for CountingSink {
    fn name(&self) -> &str {
        "kafka"
    }

    fn enqueue<'a>(&'a self, message: &'a Message) -> BoxFuture<'a, Result<Ack, SinkError>> {
        Box::pin(async move {
            let ack = self.inner.enqueue(message).await?;
            let acked = self.acked.clone();
            let counted: Ack = Box::pin(async move {
                let result = ack.await;
                if result.is_ok() {
                    acked.fetch_add(1, Ordering::Relaxed);
                }
                result
            });
            Ok(counted)
        })
    }
}

pub fn config(url: &str) -> (RelayConfig, WalSource) {
    let name = format!("bench_{}", Uuid::now_v7().simple());
    let source = WalSource::new(name.clone(), name).expect("a plain name");
    let mut config = RelayConfig::new(url);
    config.retention = None;
    config.source = Source::Wal(source.clone());
    config.topic_template = format!("bench-wal-{}.{{aggregate_type}}", Uuid::now_v7().simple());
    (config, source)
}

/// The `outbox-relay run` flags that read `source`.
pub fn relay_flags(source: &WalSource) -> [&str; 6] {
    [
        "--source",
        "wal",
        "--wal-slot",
        &source.slot,
        "--wal-publication",
        &source.publication,
    ]
}

/// Creates the slot and publication before anything is written, as a deployed relay would have.
pub async fn prepare(config: &RelayConfig) {
    let probe = Relay::new(
        config.clone(),
        seaorm_outbox_relay::sink::memory::MemorySink::default(),
    );
    probe.check_source().await.expect("prepare the WAL source");
}

pub async fn drop_slot(url: &str, source: &WalSource) {
    seaorm_outbox_relay::wal::drop_source(url, source, true)
        .await
        .expect("drop the slot");
}

/// Writes `events` table-less events, one logical message each, in transactions of 50,000.
pub async fn fill_messages(db: &setup::Db, events: usize, aggregates: usize) {
    let chunk = 50_000;
    let mut start = 0;
    while start < events {
        let end = (start + chunk).min(events);
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT count(pg_logical_emit_message(true, 'outbox', jsonb_build_array(jsonb_build_object(
                 'id', gen_random_uuid(), 'aggregate_type', 'order', 'aggregate_id', 'agg-' || (g % $2),
                 'event_type', 'OrderPlaced', 'event_version', 1, 'topic', NULL,
                 'payload', {}))::text))
             FROM generate_series($1::int8, $3::int8 - 1) g",
            setup::PAYLOAD_SQL
        )))
        .bind(start as i64)
        .bind(aggregates as i64)
        .bind(end as i64)
        .fetch_one(&db.pool)
        .await
        .expect("emit");
        start = end;
    }
}

/// Events/s acked by Kafka while one WAL relay drains `events` retained in the WAL.
pub async fn drain(
    base_url: &str,
    brokers: &str,
    events: usize,
    aggregates: usize,
    backlog: Backlog,
) -> f64 {
    let db = setup::fresh(base_url).await;
    let (config, source) = config(&db.url);
    prepare(&config).await;
    match backlog {
        Backlog::Rows => setup::fill(&db, events, aggregates).await,
        Backlog::Messages => fill_messages(&db, events, aggregates).await,
    }
    let acked = Arc::new(AtomicUsize::new(0));
    let sink = CountingSink {
        inner: KafkaSink::new(&KafkaConfig::new(brokers)).expect("sink"),
        acked: acked.clone(),
    };
    let relay = Relay::new(config, sink);
    let shutdown = CancellationToken::new();
    let started = Instant::now();
    let running = tokio::spawn({
        let shutdown = shutdown.clone();
        async move { relay.run(shutdown).await.expect("the relay refused to run") }
    });
    while acked.load(Ordering::Relaxed) < events {
        assert!(
            started.elapsed() < Duration::from_secs(600),
            "the WAL drain did not finish"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let rate = events as f64 / started.elapsed().as_secs_f64();
    shutdown.cancel();
    running.await.unwrap();
    drop_slot(&db.url, &source).await;
    rate
}
