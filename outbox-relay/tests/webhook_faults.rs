//! The webhook sink under faults, through the `outbox-relay` binary on real PostgreSQL and an HTTP
//! receiver in the test: the relay killed ten times during a 20,000-event drain, the receiver not
//! answering for 45 seconds. Every event is delivered (answered 2xx), each aggregate's first
//! deliveries in order. Copies are allowed: a receiver deduplicates by `webhook-id`.

mod common;

use common::Fixture;
use common::meters::{Writer, drain_through_ten_kills, insert_readings, reading, readings};
use common::webhook::{Call, Receiver, ok_after};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

static ONE_FAULT_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The relay binary posting the fixture's outbox to `receiver`.
fn spawn_relay(f: &Fixture, receiver: &Receiver, extra: &[&str]) -> common::KillOnDrop {
    let sink = common::webhook::relay_args(receiver);
    let sink: Vec<&str> = sink.iter().map(String::as_str).collect();
    f.spawn_relay_to(&sink, extra)
}

/// What was delivered, as (meter, reading) in the order the receiver answered 2xx.
fn delivered_readings(delivered: &[Call]) -> Vec<(String, u64)> {
    delivered
        .iter()
        .map(|call| {
            (
                call.header("aggregate_id")
                    .expect("aggregate_id")
                    .to_owned(),
                call.json()["n"].as_u64().expect("a reading"),
            )
        })
        .collect()
}

#[tokio::test]
async fn the_relay_killed_ten_times_during_a_20k_drain_delivers_every_event_in_order() {
    let _one = ONE_FAULT_AT_A_TIME.lock().await;
    const TOTAL: u64 = 20_000;
    const METERS: u64 = 200;
    let f = Fixture::new().await;
    let receiver = Receiver::start(ok_after(Duration::ZERO)).await;
    insert_readings(&f, TOTAL, METERS).await;
    // Small batches: the drain must outlast ten kills.
    drain_through_ten_kills(&f, 300, || {
        spawn_relay(&f, &receiver, &["--batch-size", "100"])
    })
    .await;

    let arrived = delivered_readings(&receiver.delivered());
    let duplicates = common::assert_complete_and_ordered(arrived, &readings(TOTAL, METERS));
    eprintln!("{duplicates} copies after ten kills");
}

#[tokio::test]
async fn the_receiver_silent_for_45_seconds_while_events_are_recorded_loses_nothing() {
    let _one = ONE_FAULT_AT_A_TIME.lock().await;
    const METERS: u64 = 20;
    let f = Fixture::new().await;
    // While `silent`, a request is answered only after a minute: the relay's 5 s timeout fires
    // first, as when a receiver hangs.
    let silent = Arc::new(AtomicBool::new(false));
    let receiver = Receiver::start({
        let silent = silent.clone();
        Arc::new(move |_, _| {
            let delay = if silent.load(Ordering::SeqCst) {
                Duration::from_secs(60)
            } else {
                Duration::ZERO
            };
            (200, vec![], String::new(), delay)
        })
    })
    .await;
    let mut relay = spawn_relay(&f, &receiver, &["--webhook-timeout", "5s"]);
    let writer = Writer::start(&f, METERS, Duration::from_millis(5), reading);
    tokio::time::sleep(Duration::from_secs(2)).await;
    silent.store(true, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_secs(45)).await;
    silent.store(false, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let total = writer.finish().await;
    f.wait_until_drained(Duration::from_secs(180)).await;
    assert_eq!(common::terminate(&mut relay), Some(0));
    let log = relay.log();
    assert!(
        log.contains("batch partly published"),
        "no request timed out, so the silence tested nothing:\n{log}"
    );
    assert_eq!(
        f.scalar("SELECT count(*) FROM outbox WHERE parked_at IS NOT NULL")
            .await,
        0,
        "nothing is parked for a receiver that stopped answering"
    );

    // Answers the relay stopped waiting for still count as deliveries here: the receiver got the
    // event (a real one would have applied it), and the relay sent it again.
    let arrived = delivered_readings(&receiver.delivered());
    let duplicates = common::assert_complete_and_ordered(arrived, &readings(total, METERS));
    eprintln!("{total} readings, {duplicates} copies after the silence");
}
