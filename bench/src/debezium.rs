//! Debezium (Kafka Connect and the Outbox Event Router, `deploy/debezium`) on the same PostgreSQL,
//! Kafka and table shape in the same run, tuned as deployed (10 ms poll, 8k batches, linger 1 ms,
//! idempotent producer) and warmed up first: a backlog retained in the WAL while the connector was
//! stopped, drained; latency from commit to the broker's append at fixed rates; the worker's CPU
//! time per event and peak memory.

use crate::latency::{self, Percentiles, Times};
use crate::processes::{PerEvent, Processes};
use crate::setup;
use crate::topic::{self, Count};
use outbox_tests::debezium;
use rdkafka::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message, Timestamp};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use std::collections::HashMap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use uuid::Uuid;

pub struct Results {
    pub drain: f64,
    pub cpu_us_per_event: f64,
    /// CPU per event of the worker, PostgreSQL and Kafka over the drain.
    pub cpu: PerEvent,
    pub peak_rss_mib: f64,
    pub latency: Vec<Percentiles>,
}

/// One connector on a fresh schema, its topic created first with the broker's append time as the
/// message timestamp.
struct Connector {
    name: String,
    topic: String,
    db: setup::Db,
    brokers: String,
}

impl Connector {
    async fn start(base_url: &str, brokers: &str) -> Connector {
        let db = setup::fresh(base_url).await;
        let schema: String = sqlx::query_scalar("SELECT current_schema()::text")
            .fetch_one(&db.pool)
            .await
            .expect("schema");
        let name = format!("bench_dbz_{}", Uuid::now_v7().simple());
        let topic = format!("{name}.order");
        topic::create(brokers, &topic).await;
        debezium::put(&name, &debezium::config(&schema, &name));
        let connector = Connector {
            name,
            topic,
            db,
            brokers: brokers.to_owned(),
        };
        connector.wait_for(true).await;
        connector
    }

    /// Waits until the task runs and reads its slot (`reading`), or the connector stopped and
    /// let the slot go.
    async fn wait_for(&self, reading: bool) {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let (state, status) = debezium::task_state(&self.name);
            let active: Option<bool> =
                sqlx::query_scalar("SELECT active FROM pg_replication_slots WHERE slot_name = $1")
                    .bind(&self.name)
                    .fetch_optional(&self.db.pool)
                    .await
                    .expect("slot probe");
            let connector_state = status["connector"]["state"].as_str().unwrap_or("");
            let (wanted, there) = if reading {
                ("RUNNING", state == "RUNNING")
            } else {
                ("STOPPED", connector_state == "STOPPED")
            };
            if there && active == Some(reading) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the connector is not {wanted} after 120 s: {status}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn wait_published(&self, count: usize) {
        Count::new(&self.brokers, &self.topic)
            .wait_for(count, Duration::from_secs(900), "Debezium")
            .await;
    }

    async fn remove(self) {
        debezium::delete(&self.name);
        for _ in 0..300 {
            let dropped = sqlx::query(
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots
                 WHERE slot_name = $1 AND NOT active",
            )
            .bind(&self.name)
            .execute(&self.db.pool)
            .await;
            let left: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1",
            )
            .bind(&self.name)
            .fetch_one(&self.db.pool)
            .await
            .expect("slot probe");
            if dropped.is_ok() && left == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP PUBLICATION IF EXISTS {}",
            self.name
        )))
        .execute(&self.db.pool)
        .await
        .expect("drop publication");
    }
}

/// Warm-up, then the drain of `events` retained while stopped, then latency at each rate.
pub async fn measure(
    base_url: &str,
    brokers: &str,
    events: usize,
    aggregates: usize,
    rates: &[usize],
    seconds: u64,
) -> Results {
    let pid = debezium::pid().expect("OUTBOX_DEBEZIUM_PID (scripts/bench sets it)");
    let connector = Connector::start(base_url, brokers).await;

    // A cold worker drains several times slower than a warm one: a quarter of the backlog first.
    let warm_up = (events / 4).max(1_000);
    setup::fill(&connector.db, warm_up, aggregates).await;
    connector.wait_published(warm_up).await;

    // The backlog, retained in the WAL while the connector is stopped.
    debezium::stop(&connector.name);
    connector.wait_for(false).await;
    setup::fill(&connector.db, events, aggregates).await;
    let processes = Processes::find(&connector.db.pool).await;
    let before = processes.cpu(pid);
    let started = Instant::now();
    debezium::resume(&connector.name);
    connector.wait_published(warm_up + events).await;
    let drain = events as f64 / started.elapsed().as_secs_f64();
    let cpu = PerEvent::between(before, processes.cpu(pid), events);

    let mut latency = Vec::new();
    for &rate in rates {
        latency.push(measure_latency(&connector, rate, seconds).await);
    }
    let peak_rss_mib = crate::processes::peak_rss_mib(pid);
    connector.remove().await;
    Results {
        drain,
        cpu_us_per_event: cpu.publisher_us,
        cpu,
        peak_rss_mib,
        latency,
    }
}

/// Commit (this process's clock) to the broker's append time (the same machine's clock, whole
/// milliseconds), for events written at `rate`.
async fn measure_latency(connector: &Connector, rate: usize, seconds: u64) -> Percentiles {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", &connector.brokers)
        .set("group.id", format!("bench-{}", Uuid::now_v7()))
        .set("enable.auto.commit", "false")
        .create()
        .expect("consumer");
    let metadata = consumer
        .fetch_metadata(Some(&connector.topic), Duration::from_secs(10))
        .expect("metadata");
    let mut assignment = TopicPartitionList::new();
    for p in metadata.topics()[0].partitions() {
        assignment
            .add_partition_offset(&connector.topic, p.id(), Offset::End)
            .expect("assign");
    }
    consumer.assign(&assignment).expect("assign");

    let committed: Times = Default::default();
    // Instants to wall-clock milliseconds, through one pair taken now.
    let (base_instant, base_wall) = (Instant::now(), SystemTime::now());
    let expected_before = Count::new(&connector.brokers, &connector.topic).messages();
    let achieved = latency::write_at_rate(&connector.db.url, rate, seconds, &committed).await;
    let broker_gc = crate::broker_gc::between(base_wall, SystemTime::now());
    let total = committed.lock().unwrap().len();
    connector.wait_published(expected_before + total).await;

    let mut appended: HashMap<Uuid, i64> = HashMap::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while appended.len() < total && Instant::now() < deadline {
        let Some(message) = consumer.poll(Duration::from_millis(100)) else {
            continue;
        };
        let message = message.expect("consume");
        let Timestamp::LogAppendTime(ms) = message.timestamp() else {
            panic!("the topic was created with LogAppendTime");
        };
        let id = message.headers().and_then(|headers| {
            headers
                .iter()
                .find(|h| h.key == "id")
                .and_then(|h| h.value)
                .and_then(|v| std::str::from_utf8(v).ok()?.parse().ok())
        });
        if let Some(id) = id {
            appended.insert(id, ms);
        }
    }
    let committed = committed.lock().unwrap();
    let latencies: Vec<f64> = committed
        .iter()
        .filter_map(|(id, at)| {
            let wall = base_wall + at.duration_since(base_instant);
            let commit_ms = wall.duration_since(UNIX_EPOCH).unwrap().as_secs_f64() * 1000.0;
            appended
                .get(id)
                .map(|&append_ms| (append_ms as f64 - commit_ms).max(0.0))
        })
        .collect();
    assert_eq!(latencies.len(), total, "every committed event was appended");
    let mut p = latency::percentiles(latencies, rate, achieved);
    p.broker_gc = broker_gc;
    p
}
