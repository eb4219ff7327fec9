//! The WAL source's limit: the backlog retained in the WAL read through the same slot and
//! publication, `pgoutput` decoded by a minimal reader (the outbox's key and payload columns, no
//! more), and sent with the raw producer under the relay's producer settings; no ordering rules,
//! no routing, no headers. Measured as the relay binary is (`as_run.rs`): events on the topic, CPU
//! per event of this process, PostgreSQL and Kafka.

use crate::as_run::Drained;
use crate::processes::{PerEvent, Processes, peak_rss_mib};
use crate::topic::{self, Count};
use crate::{limits, setup, wal};
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use pgwire_replication::{ReplicationClient, ReplicationConfig, ReplicationEvent};
use rdkafka::producer::FutureRecord;
use std::str::FromStr;
use std::time::{Duration, Instant};
use uuid::Uuid;

/// Where the key and the payload are in an outbox row's insert, from its relation message.
#[derive(Default)]
struct Columns {
    key: usize,
    payload: usize,
}

/// A big-endian reader over one `pgoutput` message.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn bytes(&mut self, n: usize) -> &'a [u8] {
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        head
    }
    fn u8(&mut self) -> u8 {
        self.bytes(1)[0]
    }
    fn u16(&mut self) -> usize {
        u16::from_be_bytes(self.bytes(2).try_into().unwrap()) as usize
    }
    fn u32(&mut self) -> usize {
        u32::from_be_bytes(self.bytes(4).try_into().unwrap()) as usize
    }
    fn cstring(&mut self) -> &'a [u8] {
        let end = self.0.iter().position(|&b| b == 0).expect("a C string");
        let s = self.bytes(end);
        self.bytes(1);
        s
    }
}

/// The columns of an outbox relation message (`R`).
fn relation(data: &[u8]) -> Columns {
    let mut r = Reader(data);
    r.u8();
    r.u32();
    r.cstring();
    r.cstring();
    r.u8();
    let mut columns = Columns::default();
    for i in 0..r.u16() {
        r.u8();
        match r.cstring() {
            b"aggregate_id" => columns.key = i,
            b"payload" => columns.payload = i,
            _ => {}
        }
        r.u32();
        r.u32();
    }
    columns
}

/// The key and payload of an insert (`I`), as slices of the message.
fn insert<'a>(data: &'a [u8], columns: &Columns) -> (&'a [u8], &'a [u8]) {
    let mut r = Reader(data);
    r.u8();
    r.u32();
    r.u8();
    let (mut key, mut payload): (&[u8], &[u8]) = (b"", b"");
    for i in 0..r.u16() {
        let value = match r.u8() {
            b't' | b'b' => {
                let n = r.u32();
                r.bytes(n)
            }
            _ => b"",
        };
        if i == columns.key {
            key = value;
        } else if i == columns.payload {
            payload = value;
        }
    }
    (key, payload)
}

/// Drains `events` table rows retained in the WAL with the minimal reader and the raw producer.
pub async fn drain(base_url: &str, brokers: &str, events: usize, aggregates: usize) -> Drained {
    let db = setup::fresh(base_url).await;
    let (config, source) = wal::config(&db.url);
    wal::prepare(&config).await;
    setup::fill(&db, events, aggregates).await;
    let topic = format!("bench-null-wal-{}", Uuid::now_v7().simple());
    topic::create(brokers, &topic).await;
    let count = Count::new(brokers, &topic);
    let producer = limits::producer(brokers);
    let options = sqlx::postgres::PgConnectOptions::from_str(&db.url).expect("the database URL");
    let replication = ReplicationConfig::new(
        options.get_host(),
        options.get_username(),
        std::env::var("PGPASSWORD").unwrap_or_default(),
        options.get_database().unwrap_or(options.get_username()),
        &source.slot,
        source.publication.as_str(),
    )
    .with_port(options.get_port())
    .with_status_interval(Duration::from_secs(1));
    let processes = Processes::find(&db.pool).await;
    let me = std::process::id();
    let before = processes.cpu(me);
    let started = Instant::now();
    let mut stream = ReplicationClient::connect(replication)
        .await
        .expect("replication connection");
    let (mut columns, mut sent) = (Columns::default(), 0);
    let mut acks = FuturesUnordered::new();
    while sent < events {
        let event = tokio::time::timeout(Duration::from_secs(120), stream.recv())
            .await
            .expect("the WAL stream stalled")
            .expect("the WAL stream")
            .expect("the WAL stream ended");
        match event {
            ReplicationEvent::XLogData { data, .. } => match data.first() {
                Some(b'R') => columns = relation(&data),
                Some(b'I') => {
                    let (key, payload) = insert(&data, &columns);
                    let mut record = FutureRecord::to(&topic).key(key).payload(payload);
                    loop {
                        match producer.send_result(record) {
                            Ok(ack) => break acks.push(ack),
                            // The producer's queue is full: wait for an ack, then try again.
                            Err((_, returned)) => {
                                record = returned;
                                if acks.next().await.is_none() {
                                    tokio::time::sleep(Duration::from_millis(1)).await;
                                }
                            }
                        }
                    }
                    sent += 1;
                }
                _ => {}
            },
            ReplicationEvent::Commit { end_lsn, .. } => stream.update_applied_lsn(end_lsn),
            _ => {}
        }
        // Take the acks that came in, without waiting.
        while let Some(Some(ack)) = futures::FutureExt::now_or_never(acks.next()) {
            ack.expect("delivery").expect("acked");
        }
    }
    while let Some(ack) = acks.next().await {
        ack.expect("delivery").expect("acked");
    }
    count
        .wait_for(events, Duration::from_secs(300), "the null WAL pipeline")
        .await;
    let elapsed = started.elapsed();
    let cpu = PerEvent::between(before, processes.cpu(me), events);
    let _ = stream.shutdown().await;
    wal::drop_slot(&db.url, &source).await;
    Drained {
        name: "null WAL pipeline (minimal reader, raw producer)".into(),
        events_per_second: events as f64 / elapsed.as_secs_f64(),
        cpu,
        peak_rss_mib: peak_rss_mib(me),
    }
}
