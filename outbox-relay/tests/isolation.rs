//! One bad row stops nothing: each claimed row is read on its own, a row that cannot become a
//! message is parked with a precise reason while its aggregate waits, and every other aggregate
//! flows. Batches are bounded in bytes as well as rows, whatever the table holds.

mod common;

use common::Fixture;
use futures::future::BoxFuture;
use seaorm_outbox::sea_orm::{ConnectionTrait, DatabaseConnection, DbBackend, Statement};
use seaorm_outbox_relay::sink::{Ack, Message, Sink, SinkError};
use seaorm_outbox_relay::{Relay, RelayConfig};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// Acks everything and remembers each batch it was handed: (aggregate id, seq) per message, and
/// the batch's payload and header bytes. The relay enqueues a whole batch before it awaits any of
/// its acks, so the first ack awaited closes the batch being enqueued.
#[derive(Clone, Default)]
struct BatchSink {
    batches: Arc<Mutex<Vec<Batch>>>,
    open: Arc<Mutex<Batch>>,
}

/// (aggregate id, seq) of each message, and the payload and header bytes.
type Batch = (Vec<(String, i64)>, usize);

impl BatchSink {
    fn published(&self) -> Vec<(String, i64)> {
        let batches = self.batches.lock().unwrap();
        batches.iter().flat_map(|(m, _)| m.clone()).collect()
    }
}

impl Sink for BatchSink {
    fn name(&self) -> &str {
        "batches"
    }

    fn enqueue<'a>(&'a self, message: &'a Message) -> BoxFuture<'a, Result<Ack, SinkError>> {
        {
            let mut open = self.open.lock().unwrap();
            open.0.push((message.key.clone(), message.seq));
            open.1 += message.payload.len() + stored_header_bytes(message);
        }
        let (open, batches) = (self.open.clone(), self.batches.clone());
        let ack: Ack = Box::pin(async move {
            let batch = std::mem::take(&mut *open.lock().unwrap());
            if !batch.0.is_empty() {
                batches.lock().unwrap().push(batch);
            }
            Ok(())
        });
        Box::pin(async move { Ok(ack) })
    }
}

/// The bytes of the row's own headers (after the four contract headers), as the claim counts them:
/// their JSON object.
fn stored_header_bytes(m: &Message) -> usize {
    let stored: serde_json::Map<String, serde_json::Value> = m.headers[4..]
        .iter()
        .map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone())))
        .collect();
    if stored.is_empty() {
        0
    } else {
        serde_json::Value::Object(stored).to_string().len()
    }
}

/// Runs a relay until `done` holds of what `sink` got (or panics after 30 s), then stops it.
async fn run_until(config: RelayConfig, sink: &BatchSink, done: impl Fn(&[(String, i64)]) -> bool) {
    let relay = Relay::new(config, sink.clone());
    let shutdown = CancellationToken::new();
    let running = tokio::spawn({
        let shutdown = shutdown.clone();
        async move { relay.run(shutdown).await.expect("the relay refused to run") }
    });
    let deadline = Instant::now() + Duration::from_secs(30);
    while !done(&sink.published()) {
        assert!(
            Instant::now() < deadline,
            "only {:?} published",
            sink.published()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    shutdown.cancel();
    running.await.unwrap();
}

async fn parked(db: &DatabaseConnection, backend: DbBackend) -> Vec<(String, String)> {
    db.query_all_raw(Statement::from_string(
        backend,
        "SELECT CAST(seq AS TEXT), last_error FROM outbox WHERE parked_at IS NOT NULL ORDER BY seq",
    ))
    .await
    .unwrap()
    .into_iter()
    .map(|row| {
        (
            row.try_get_by_index::<String>(0).unwrap(),
            row.try_get_by_index::<String>(1).unwrap(),
        )
    })
    .collect()
}

#[tokio::test]
async fn sqlite_rows_of_the_wrong_types_are_parked_one_by_one_and_the_rest_flows() {
    let path = outbox_tests::temp_dir().join("shop.db");
    let url = format!("sqlite://{}?mode=rwc", path.display());
    let db = seaorm_outbox::sea_orm::Database::connect(&url)
        .await
        .unwrap();
    seaorm_outbox::migration::migrate(&db).await.unwrap();
    // SQLite keeps whatever a hand-written row stores: each of these used to fail every claim.
    // (seq, id, aggregate, event_version, payload): the aggregate `held` waits behind its bad row.
    db.execute_unprepared(
        "INSERT INTO outbox (seq, id, aggregate_type, aggregate_id, event_type, event_version, payload) VALUES
           (1, '0193a000-0000-7000-8000-000000000001', 'cart', 'good', 'E', 1, '{}'),
           (2, '0193a000-0000-7000-8000-000000000002', 'cart', 'held', 'E', 'two', '{}'),
           (3, '0193a000-0000-7000-8000-000000000003', 'cart', x'ff00', 'E', 1, '{}'),
           (4, x'ff', 'cart', 'blob-id', 'E', 1, '{}'),
           (5, '0193a000-0000-7000-8000-000000000005', 'cart', 'blob-payload', 'E', 1, x'7b7d'),
           (6, '0193a000-0000-7000-8000-000000000006', 'cart', 'not-json', 'E', 1, 'nope'),
           (7, '0193a000-0000-7000-8000-000000000007', 'cart', 'big', 'E', 1, json_object('x', printf('%.2000c', 'x'))),
           (8, '0193a000-0000-7000-8000-000000000008', 'cart', 'held', 'E', 1, '{}'),
           (9, '0193a000-0000-7000-8000-000000000009', 'cart', 'good', 'E', 1, '{}')",
    )
    .await
    .unwrap();

    let mut config = RelayConfig::new(url);
    config.poll_interval = Duration::from_millis(20);
    config.batch_size = 3;
    config.max_payload_bytes = 1000;
    let sink = BatchSink::default();
    run_until(config, &sink, |published| published.len() >= 2).await;

    assert_eq!(
        sink.published(),
        [("good".to_owned(), 1), ("good".to_owned(), 9)],
        "the good aggregate flows; `held` waits behind its parked row"
    );
    let parked = parked(&db, DbBackend::Sqlite).await;
    let reasons: Vec<(&str, &str)> = parked
        .iter()
        .map(|(seq, reason)| (seq.as_str(), reason.as_str()))
        .collect();
    let expect = [
        ("2", "column `event_version` cannot be read"),
        ("3", "column `aggregate_id` cannot be read"),
        ("4", "column `id` cannot be read"),
        ("5", "column `payload` cannot be read"),
        ("6", "payload is not valid JSON"),
        (
            "7",
            "payload too large: 2008 bytes, over the relay's limit of 1000",
        ),
    ];
    assert_eq!(reasons.len(), expect.len(), "{reasons:?}");
    for ((seq, reason), (want_seq, want)) in reasons.iter().zip(expect) {
        assert_eq!(*seq, want_seq);
        assert!(reason.contains(want), "row {seq}: {reason}");
    }
}

#[tokio::test]
async fn oversize_rows_are_parked_and_batches_stop_at_their_byte_limit() {
    let f = Fixture::new().await;
    // Ten rows of about 8 kB for `a`; `b` has a 50 kB row, then a small one that must wait.
    f.db.execute_unprepared(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, headers)
         SELECT gen_random_uuid(), 'doc', 'a', 'E', jsonb_build_object('n', g, 'text', repeat('x', 8000)),
                '{\"tenant\": \"acme\"}'
         FROM generate_series(1, 5) g;
         INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
         VALUES (gen_random_uuid(), 'doc', 'b', 'E', jsonb_build_object('text', repeat('y', 50000))),
                (gen_random_uuid(), 'doc', 'b', 'E', '{}');
         INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
         SELECT gen_random_uuid(), 'doc', 'a', 'E', jsonb_build_object('n', g, 'text', repeat('x', 8000))
         FROM generate_series(6, 10) g;",
    )
    .await
    .unwrap();

    let mut config = f.relay_config();
    config.max_payload_bytes = 10_000;
    config.max_batch_bytes = 25_000;
    let sink = BatchSink::default();
    run_until(config, &sink, |published| published.len() >= 10).await;

    let a: Vec<i64> = sink
        .published()
        .iter()
        .filter(|(key, _)| key == "a")
        .map(|(_, seq)| *seq)
        .collect();
    assert_eq!(a.len(), 10);
    assert!(a.is_sorted(), "{a:?}");
    assert!(
        !sink.published().iter().any(|(key, _)| key == "b"),
        "b's second row waits behind its parked first"
    );
    let batches = sink.batches.lock().unwrap().clone();
    assert!(
        batches.len() >= 4,
        "at most three 8 kB rows per batch: {batches:?}"
    );
    for (messages, bytes) in &batches {
        assert!(
            *bytes <= 25_000,
            "a batch of {} messages holds {bytes} bytes",
            messages.len()
        );
    }
    let parked = parked(&f.db, DbBackend::Postgres).await;
    assert_eq!(parked.len(), 1, "{parked:?}");
    assert!(
        parked[0]
            .1
            .contains("payload too large: 50012 bytes, over the relay's limit of 10000"),
        "{parked:?}"
    );
}
