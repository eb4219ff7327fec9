//! Latency from the recording transaction's commit to the broker's ack, as the relay sees it (when
//! it reads the ack), at a fixed offered rate.

use crate::setup;
use futures::future::BoxFuture;
use seaorm_outbox::OutboxEvent;
use seaorm_outbox::sea_orm::{Database, TransactionTrait};
use seaorm_outbox_relay::sink::kafka::{KafkaConfig, KafkaSink};
use seaorm_outbox_relay::sink::{Ack, Message, Sink, SinkError};
use seaorm_outbox_relay::{Relay, RelayConfig, Wakeup};
use serde::Serialize;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate = "order", key = "order_id")]
struct LatencyProbe {
    order_id: String,
    customer: String,
    total_cents: i64,
    note: String,
}

/// When each event was committed (or acked).
pub type Times = Arc<Mutex<HashMap<Uuid, Instant>>>;

/// The Kafka sink, noting when each event was handed to it and when its ack arrived.
struct TimingSink {
    inner: KafkaSink,
    enqueued: Times,
    acked: Times,
}

impl Sink for TimingSink {
    fn name(&self) -> &str {
        "kafka"
    }

    fn enqueue<'a>(&'a self, message: &'a Message) -> BoxFuture<'a, Result<Ack, SinkError>> {
        Box::pin(async move {
            self.enqueued
                .lock()
                .unwrap()
                .entry(message.event_id)
                .or_insert_with(Instant::now);
            let ack = self.inner.enqueue(message).await?;
            let (acked, event_id) = (self.acked.clone(), message.event_id);
            let timed: Ack = Box::pin(async move {
                let result = ack.await;
                if result.is_ok() {
                    acked
                        .lock()
                        .unwrap()
                        .entry(event_id)
                        .or_insert_with(Instant::now);
                }
                result
            });
            Ok(timed)
        })
    }
}

pub struct Percentiles {
    pub offered: f64,
    pub achieved: f64,
    pub p50_ms: f64,
    pub p95_ms: f64,
    pub p99_ms: f64,
    /// The p99 of the first leg, commit to the relay handing the event to the sink, where known.
    pub p99_to_sink_ms: Option<f64>,
    /// The broker's GC pauses while the writers ran, where its GC log is known.
    pub broker_gc: Option<crate::broker_gc::Pauses>,
}

pub async fn measure(
    base_url: &str,
    brokers: &str,
    rate: usize,
    seconds: u64,
    wakeup: Wakeup,
    wal: Option<crate::wal::Backlog>,
) -> Percentiles {
    let db = setup::fresh(base_url).await;
    if wakeup == Wakeup::Notify {
        sqlx::raw_sql(seaorm_outbox_relay::wakeup::NOTIFY_TRIGGER_SQL)
            .execute(&db.pool)
            .await
            .expect("trigger");
    }
    let mut config = RelayConfig::new(db.url.clone());
    let mut wal_source = None;
    if wal.is_some() {
        let (wal_config, source) = crate::wal::config(&db.url);
        crate::wal::prepare(&wal_config).await;
        config = wal_config;
        wal_source = Some(source);
    }
    // Table-less events are what `record` writes in this process while it is set.
    seaorm_outbox::set_recording(if wal == Some(crate::wal::Backlog::Messages) {
        seaorm_outbox::Recording::LogicalMessage
    } else {
        seaorm_outbox::Recording::Table
    });
    config.wakeup = wakeup;
    let ready = async {
        match &wal_source {
            None => setup::wait_leased(&db).await,
            Some(source) => setup::wait_slot_read(&db, &source.slot).await,
        }
    };
    let p = through_relay(&db.url, config, brokers, rate, seconds, ready).await;
    seaorm_outbox::set_recording(seaorm_outbox::Recording::Table);
    if let Some(source) = &wal_source {
        crate::wal::drop_slot(&db.url, source).await;
    }
    p
}

/// Runs a relay with `config` (publishing to `brokers`), waits until it is `ready`, records
/// events on `url` at `rate` for `seconds`, and measures each one's time from commit to ack.
pub async fn through_relay(
    url: &str,
    mut config: RelayConfig,
    brokers: &str,
    rate: usize,
    seconds: u64,
    ready: impl std::future::Future<Output = ()>,
) -> Percentiles {
    let acked: Times = Arc::default();
    let enqueued: Times = Arc::default();
    let committed: Times = Arc::default();
    config.retention = None;
    config.topic_template = format!("bench-lat-{}.{{aggregate_type}}", Uuid::now_v7().simple());
    let sink = TimingSink {
        inner: KafkaSink::new(&KafkaConfig::new(brokers)).unwrap(),
        enqueued: enqueued.clone(),
        acked: acked.clone(),
    };
    let relay = Relay::new(config, sink);
    let shutdown = CancellationToken::new();
    let running = tokio::spawn({
        let shutdown = shutdown.clone();
        async move { relay.run(shutdown).await.expect("the relay refused to run") }
    });
    ready.await;

    let writing = std::time::SystemTime::now();
    let achieved = write_at_rate(url, rate, seconds, &committed).await;
    let broker_gc = crate::broker_gc::between(writing, std::time::SystemTime::now());
    // Every committed event acked (the WAL source never marks rows, so the table cannot tell).
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let done = {
            let (committed, acked) = (committed.lock().unwrap(), acked.lock().unwrap());
            committed.keys().all(|id| acked.contains_key(id))
        };
        if done {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "events committed but never acked"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    shutdown.cancel();
    running.await.unwrap();

    let committed = committed.lock().unwrap();
    let since_commit = |times: &Times| -> Vec<f64> {
        let times = times.lock().unwrap();
        committed
            .iter()
            .filter_map(|(id, c)| {
                times
                    .get(id)
                    .map(|t| t.saturating_duration_since(*c).as_secs_f64() * 1000.0)
            })
            .collect()
    };
    let mut p = percentiles(since_commit(&acked), rate, achieved);
    p.p99_to_sink_ms = Some(percentiles(since_commit(&enqueued), rate, achieved).p99_ms);
    p.broker_gc = broker_gc;
    p
}

/// Records one [`LatencyProbe`] per transaction at `rate` events/s for `seconds`, from eight
/// writers at an equal share each, noting each commit in `committed`; returns the rate achieved.
pub async fn write_at_rate(url: &str, rate: usize, seconds: u64, committed: &Times) -> f64 {
    const WRITERS: usize = 8;
    let orm = Database::connect(url).await.unwrap();
    let started = Instant::now();
    let writers: Vec<_> = (0..WRITERS)
        .map(|w| {
            let (orm, committed) = (orm.clone(), committed.clone());
            tokio::spawn(async move {
                let period = Duration::from_secs_f64(WRITERS as f64 / rate as f64);
                let mut ticks = tokio::time::interval(period);
                ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
                let mut n = 0u64;
                while started.elapsed() < Duration::from_secs(seconds) {
                    ticks.tick().await;
                    let probe = LatencyProbe {
                        order_id: format!("agg-{}", (n as usize * WRITERS + w) % 1000),
                        customer: format!("customer-{w}"),
                        total_cents: n as i64,
                        note: "x".repeat(110),
                    };
                    let txn = orm.begin().await.unwrap();
                    let id = probe.record(&txn).await.unwrap();
                    txn.commit().await.unwrap();
                    committed.lock().unwrap().insert(id, Instant::now());
                    n += 1;
                }
            })
        })
        .collect();
    for w in writers {
        w.await.unwrap();
    }
    committed.lock().unwrap().len() as f64 / started.elapsed().as_secs_f64()
}

/// The 50th, 95th and 99th percentiles of `latencies` (ms).
pub fn percentiles(mut latencies: Vec<f64>, offered: usize, achieved: f64) -> Percentiles {
    latencies.sort_by(f64::total_cmp);
    let at = |q: f64| {
        latencies
            .get(((latencies.len() as f64 * q) as usize).min(latencies.len().saturating_sub(1)))
            .copied()
            .unwrap_or(f64::NAN)
    };
    Percentiles {
        offered: offered as f64,
        achieved,
        p50_ms: at(0.50),
        p95_ms: at(0.95),
        p99_ms: at(0.99),
        p99_to_sink_ms: None,
        broker_gc: None,
    }
}
