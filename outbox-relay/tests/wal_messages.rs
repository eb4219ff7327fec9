//! Table-less events (`Recording::LogicalMessage`): `record` writes a transactional logical
//! message instead of a row, and the WAL source publishes it under the same contract. This test
//! binary records every event that way (the setting is per process).

mod common;

use common::meters::Reading;

use common::kafka::consume;
use common::relay_command;
use common::wal::WalFixture;
use seaorm_outbox::sea_orm::{ConnectionTrait, DbBackend, Statement, TransactionTrait};
use seaorm_outbox::{NewEvent, OutboxEvent, Recording};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn table_less() {
    seaorm_outbox::set_recording(Recording::LogicalMessage);
}

#[tokio::test]
async fn table_less_events_are_published_under_the_contract_and_rollbacks_emit_nothing() {
    let _one = ONE_AT_A_TIME.lock().await;
    table_less();
    let w = WalFixture::new().await;
    let mut relay = w.spawn_relay(&[]);
    w.wait_for_slot().await;
    let mut ids = Vec::new();
    for n in 0..20_u64 {
        let txn = w.f.db.begin().await.unwrap();
        let event = NewEvent::from_event(&Reading {
            meter: format!("m-{}", n % 2),
            n,
        })
        .unwrap()
        .with_header("tenant", "acme");
        ids.extend(
            seaorm_outbox::record_new_events(&txn, vec![event])
                .await
                .unwrap(),
        );
        txn.commit().await.unwrap();
    }
    let txn = w.f.db.begin().await.unwrap();
    Reading {
        meter: "m-0".into(),
        n: 999,
    }
    .record(&txn)
    .await
    .unwrap();
    txn.rollback().await.unwrap();
    // One call, many events: one message.
    let txn = w.f.db.begin().await.unwrap();
    let batch: Vec<Reading> = (20..25)
        .map(|n| Reading {
            meter: format!("m-{}", n % 2),
            n,
        })
        .collect();
    ids.extend(seaorm_outbox::record_all(&txn, &batch).await.unwrap());
    txn.commit().await.unwrap();

    let received = consume(&[&w.f.topic("meter")], 25, Duration::from_secs(60)).await;
    assert_eq!(
        received.len(),
        25,
        "the rolled-back event or a duplicate arrived"
    );
    let mut expected: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    for n in 0..25 {
        expected.entry(format!("m-{}", n % 2)).or_default().push(n);
    }
    common::assert_complete_and_ordered(
        received
            .iter()
            .map(|m| (m.key.clone(), m.json()["n"].as_u64().unwrap())),
        &expected,
    );
    for m in &received {
        let n = m.json()["n"].as_u64().unwrap() as usize;
        assert_eq!(m.header("id"), Some(ids[n].to_string().as_str()));
        assert_eq!(m.header("event_type"), Some("Reading"));
        assert_eq!(m.header("aggregate_type"), Some("meter"));
        assert_eq!(m.header("event_version"), Some("1"));
        if n < 20 {
            assert_eq!(m.header("tenant"), Some("acme"));
        }
        assert_eq!(m.json()["meter"], m.key.as_str());
    }
    // No row was written.
    assert_eq!(w.f.scalar("SELECT count(*) FROM outbox").await, 0);
    w.wait_until_confirmed(Duration::from_secs(30)).await;
    assert_eq!(common::terminate(&mut relay), Some(0));
    w.drop_slot().await;
}

#[tokio::test]
async fn the_relay_killed_ten_times_while_table_less_events_are_recorded_loses_nothing() {
    let _one = ONE_AT_A_TIME.lock().await;
    table_less();
    const PER: u64 = 20;
    const METERS: u64 = 100;
    let w = WalFixture::new().await;
    let mut first = w.spawn_relay(&[]);
    w.wait_for_slot().await;
    common::signal(&first, "KILL");
    first.wait().unwrap();
    // A writer records 20 events per transaction all along.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = tokio::spawn({
        let (db, stop) = (w.f.db.clone(), stop.clone());
        async move {
            let mut t = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let txn = db.begin().await.unwrap();
                let batch: Vec<Reading> = (t * PER..(t + 1) * PER)
                    .map(|n| Reading {
                        meter: format!("m-{}", n % METERS),
                        n,
                    })
                    .collect();
                seaorm_outbox::record_all(&txn, &batch).await.unwrap();
                txn.commit().await.unwrap();
                t += 1;
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            t * PER
        }
    });
    for kill in 0..10_u64 {
        let mut relay = w.spawn_relay(&[]);
        let deadline = Instant::now() + Duration::from_secs(30);
        while !w.slot_active().await {
            assert!(Instant::now() < deadline, "nobody reads the slot");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // Past the first confirmation (1 s), at a moment the relay did not choose.
        tokio::time::sleep(Duration::from_millis(1200 + kill * 130)).await;
        common::signal(&relay, "KILL");
        relay.wait().unwrap();
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let total = writer.await.unwrap();
    let mut relay = w.spawn_relay(&[]);
    w.wait_until_confirmed(Duration::from_secs(120)).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while !w.slot_active().await {
        assert!(Instant::now() < deadline, "nobody reads the slot");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(common::terminate(&mut relay), Some(0));
    let received = consume(
        &[&w.f.topic("meter")],
        total as usize,
        Duration::from_secs(120),
    )
    .await;
    eprintln!("{} deliveries for {total} events", received.len());
    let mut expected: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    for n in 0..total {
        expected
            .entry(format!("m-{}", n % METERS))
            .or_default()
            .push(n);
    }
    common::assert_complete_and_ordered(
        received
            .iter()
            .map(|m| (m.key.clone(), m.json()["n"].as_u64().unwrap())),
        &expected,
    );
    w.drop_slot().await;
}

/// A poison table-less event (here: a payload over the relay's limit) is parked as a row, with its
/// reason, and `failed retry` publishes it from there exactly as it was recorded. (It was once
/// parked and retried with payload `null`.)
#[tokio::test]
async fn a_poison_table_less_event_is_parked_as_a_row() {
    let _one = ONE_AT_A_TIME.lock().await;
    table_less();
    let w = WalFixture::new().await;
    let mut relay = w.spawn_relay(&["--max-payload-bytes", "40"]);
    w.wait_for_slot().await;
    let txn = w.f.db.begin().await.unwrap();
    let big_meter = "m-big".repeat(10);
    let big = Reading {
        meter: big_meter.clone(),
        n: 1,
    };
    let small = Reading {
        meter: "m-1".into(),
        n: 2,
    };
    seaorm_outbox::record_all(&txn, &[big]).await.unwrap();
    seaorm_outbox::record_all(&txn, &[small]).await.unwrap();
    txn.commit().await.unwrap();
    let received = consume(&[&w.f.topic("meter")], 1, Duration::from_secs(60)).await;
    assert_eq!(received[0].key, "m-1");
    w.wait_until_confirmed(Duration::from_secs(30)).await;
    let row =
        w.f.db
            .query_one_raw(Statement::from_string(
                DbBackend::Postgres,
                "SELECT aggregate_id, last_error, id::text FROM outbox WHERE parked_at IS NOT NULL",
            ))
            .await
            .unwrap()
            .expect("a parked row");
    assert_eq!(row.try_get_by_index::<String>(0).unwrap(), big_meter);
    assert!(
        row.try_get_by_index::<String>(1)
            .unwrap()
            .contains("payload too large")
    );
    let id: String = row.try_get_by_index(2).unwrap();
    assert_eq!(common::terminate(&mut relay), Some(0));

    // With the limit raised, `failed retry` sends it, byte for byte as recorded (jsonb would
    // have reordered and spaced the keys).
    let mut relay = w.spawn_relay(&[]);
    let retried = relay_command()
        .args(["failed", "retry", "--all", "--database-url", &w.f.url])
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&retried.stdout).contains("1 events will be retried"),
        "{retried:?}"
    );
    let received = consume(&[&w.f.topic("meter")], 2, Duration::from_secs(60)).await;
    let big = received
        .iter()
        .find(|m| m.key == big_meter)
        .expect("the retried event");
    assert_eq!(
        String::from_utf8_lossy(&big.payload),
        format!(r#"{{"meter":"{big_meter}","n":1}}"#)
    );
    assert_eq!(big.header("id"), Some(id.as_str()));
    w.wait_until_confirmed(Duration::from_secs(30)).await;
    assert_eq!(common::terminate(&mut relay), Some(0));
    w.drop_slot().await;
}

/// A logical message that is not an array of events, and an event whose id is not a UUID, are
/// parked with their bytes as recorded, never dropped; other events flow. (The second was once
/// logged and dropped.)
#[tokio::test]
async fn an_unreadable_message_and_an_event_without_a_uuid_are_parked_with_their_bytes() {
    let _one = ONE_AT_A_TIME.lock().await;
    table_less();
    let w = WalFixture::new().await;
    let mut relay = w.spawn_relay(&[]);
    w.wait_for_slot().await;
    let not_uuid = r#"{"id":"order-42","aggregate_type":"meter","aggregate_id":"m-x","event_type":"Reading","payload":{"n": 1}}"#;
    w.f.db
        .execute_unprepared(&format!(
            "SELECT pg_logical_emit_message(true, 'outbox', 'not json');
             SELECT pg_logical_emit_message(true, 'outbox', '[{not_uuid}]');"
        ))
        .await
        .unwrap();
    let txn = w.f.db.begin().await.unwrap();
    seaorm_outbox::record_all(
        &txn,
        &[Reading {
            meter: "m-ok".into(),
            n: 2,
        }],
    )
    .await
    .unwrap();
    txn.commit().await.unwrap();
    let received = consume(&[&w.f.topic("meter")], 1, Duration::from_secs(60)).await;
    assert_eq!(received.len(), 1, "{received:?}");
    assert_eq!(received[0].key, "m-ok");
    w.wait_until_confirmed(Duration::from_secs(30)).await;
    let parked =
        w.f.db
            .query_all_raw(Statement::from_string(
                DbBackend::Postgres,
                "SELECT aggregate_id, last_error, convert_from(recorded, 'UTF8') FROM outbox
                 WHERE parked_at IS NOT NULL ORDER BY seq",
            ))
            .await
            .unwrap();
    let parked: Vec<(String, String, String)> = parked
        .iter()
        .map(|r| {
            (
                r.try_get_by_index(0).unwrap(),
                r.try_get_by_index(1).unwrap(),
                r.try_get_by_index(2).unwrap(),
            )
        })
        .collect();
    assert_eq!(parked.len(), 2, "{parked:?}");
    assert_eq!(parked[0].0, "unknown");
    assert!(parked[0].1.contains("not an array of events"), "{parked:?}");
    assert_eq!(parked[0].2, "not json");
    assert_eq!(parked[1].0, "m-x");
    assert!(
        parked[1].1.contains("event id `order-42` is not a UUID"),
        "{parked:?}"
    );
    assert_eq!(parked[1].2, not_uuid);
    assert_eq!(common::terminate(&mut relay), Some(0));
    w.drop_slot().await;
}

#[tokio::test]
async fn table_less_recording_on_sqlite_is_a_clear_error() {
    let _one = ONE_AT_A_TIME.lock().await;
    table_less();
    let db = outbox_tests::database(outbox_tests::Backend::SqliteMemory).await;
    let txn = db.begin().await.unwrap();
    let error = Reading {
        meter: "m".into(),
        n: 0,
    }
    .record(&txn)
    .await
    .unwrap_err();
    assert!(error.to_string().contains("needs PostgreSQL"), "{error}");
}

/// Table-less events with the broker away past the producer's `message.timeout.ms`: every event
/// delivered, each aggregate's first deliveries in recording order.
#[tokio::test]
async fn the_broker_stops_past_the_producers_timeout_and_each_aggregate_keeps_its_order() {
    let _one = ONE_AT_A_TIME.lock().await;
    table_less();
    let w = WalFixture::new().await;
    common::wal::the_broker_away_past_the_producers_timeout(&w, |meter, n| Reading { meter, n })
        .await;
}
