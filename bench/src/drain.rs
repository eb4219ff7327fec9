//! The relay draining a pre-filled backlog, in process; and the relay binary's CPU time per event
//! and peak memory.

use crate::setup;
use seaorm_outbox_relay::sink::kafka::{KafkaConfig, KafkaSink};
use seaorm_outbox_relay::{Mode, Relay, RelayConfig};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Instant;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

fn config(url: &str, batch: usize, mode: Mode) -> RelayConfig {
    let mut config = RelayConfig::new(url);
    config.batch_size = batch;
    config.mode = mode;
    config.retention = None;
    config.topic_template = format!("bench-drain-{}.{{aggregate_type}}", Uuid::now_v7().simple());
    config
}

/// Events/s acked by Kafka while `replicas` relays drain `events`.
pub async fn drain(
    base_url: &str,
    brokers: &str,
    events: usize,
    aggregates: usize,
    batch: usize,
    mode: Mode,
    replicas: usize,
) -> f64 {
    let db = setup::fresh(base_url).await;
    setup::fill(&db, events, aggregates).await;
    let shutdown = CancellationToken::new();
    let started = Instant::now();
    let running: Vec<_> = (0..replicas)
        .map(|_| {
            let sink = KafkaSink::new(&KafkaConfig::new(brokers)).expect("sink");
            let relay = Relay::new(config(&db.url, batch, mode), sink);
            let shutdown = shutdown.clone();
            tokio::spawn(
                async move { relay.run(shutdown).await.expect("the relay refused to run") },
            )
        })
        .collect();
    setup::wait_drained(&db).await;
    let rate = events as f64 / started.elapsed().as_secs_f64();
    shutdown.cancel();
    for relay in running {
        relay.await.unwrap();
    }
    rate
}

/// The relay binary's resources over one drain.
pub struct Resources {
    pub cpu_us_per_event: f64,
    pub peak_rss_mib: f64,
    pub events_per_second: f64,
}

pub async fn resources(
    relay_bin: &Path,
    base_url: &str,
    brokers: &str,
    events: usize,
    aggregates: usize,
) -> Resources {
    let db = setup::fresh(base_url).await;
    setup::fill(&db, events, aggregates).await;
    measure_binary(
        relay_bin,
        &db,
        brokers,
        events,
        &[],
        DrainedWhen::TableEmpty,
    )
    .await
}

/// The WAL relay binary's resources over one drain of table rows retained in the WAL.
pub async fn wal_resources(
    relay_bin: &Path,
    base_url: &str,
    brokers: &str,
    events: usize,
    aggregates: usize,
) -> Resources {
    let db = setup::fresh(base_url).await;
    let (config, source) = crate::wal::config(&db.url);
    crate::wal::prepare(&config).await;
    setup::fill(&db, events, aggregates).await;
    let end: i64 = sqlx::query_scalar("SELECT (pg_current_wal_lsn() - '0/0')::int8")
        .fetch_one(&db.pool)
        .await
        .expect("wal position");
    let args = crate::wal::relay_flags(&source);
    let resources = measure_binary(
        relay_bin,
        &db,
        brokers,
        events,
        &args,
        DrainedWhen::SlotConfirmed(source.slot.clone(), end),
    )
    .await;
    crate::wal::drop_slot(&db.url, &source).await;
    resources
}

/// `outbox-relay run` on `database_url`, publishing to Kafka under `topic_template`, without the
/// HTTP endpoints or pruning: how the benchmark runs the binary.
pub fn relay_args(database_url: &str, brokers: &str, topic_template: &str) -> Vec<String> {
    [
        "run",
        "--database-url",
        database_url,
        "--kafka-brokers",
        brokers,
        "--http-addr",
        "off",
        "--retention",
        "off",
        "--topic-template",
        topic_template,
    ]
    .map(str::to_owned)
    .to_vec()
}

enum DrainedWhen {
    TableEmpty,
    /// The slot confirmed this WAL position (bytes from 0/0); it is reported within a second.
    SlotConfirmed(String, i64),
}

async fn measure_binary(
    relay_bin: &Path,
    db: &setup::Db,
    brokers: &str,
    events: usize,
    extra: &[&str],
    drained: DrainedWhen,
) -> Resources {
    let started = Instant::now();
    let topics = format!("bench-res-{}.{{aggregate_type}}", Uuid::now_v7().simple());
    let mut child = Command::new(relay_bin)
        .args(relay_args(&db.url, brokers, &topics))
        .args(extra)
        .env("OUTBOX_LOG", "warn")
        .stdout(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("start {}: {e}", relay_bin.display()));
    match drained {
        DrainedWhen::TableEmpty => setup::wait_drained(db).await,
        DrainedWhen::SlotConfirmed(slot, end) => loop {
            let confirmed: Option<i64> = sqlx::query_scalar(
                "SELECT (confirmed_flush_lsn - '0/0')::int8 FROM pg_replication_slots WHERE slot_name = $1",
            )
            .bind(&slot)
            .fetch_one(&db.pool)
            .await
            .expect("slot probe");
            if confirmed.unwrap_or(0) >= end {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        },
    }
    let elapsed = started.elapsed();
    let (cpu, peak_rss_mib) = (
        crate::processes::cpu_seconds(child.id()),
        crate::processes::peak_rss_mib(child.id()),
    );
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    child.wait().unwrap();
    Resources {
        cpu_us_per_event: cpu * 1e6 / events as f64,
        peak_rss_mib,
        events_per_second: events as f64 / elapsed.as_secs_f64(),
    }
}
