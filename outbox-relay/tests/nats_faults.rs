//! The NATS sink under faults, through the `outbox-relay` binary on real PostgreSQL and a real
//! NATS server: the relay killed mid-drain, the server stopped for 45 seconds. Read back from the
//! stream: every event stored, each aggregate's in order, and none stored twice (the relay's
//! re-sends carry the event id as `Nats-Msg-Id`, inside the stream's duplicate window).
//!
//! One test at a time: a stopped server would stall the other.

mod common;

use common::Fixture;
use common::meters::{Writer, drain_through_ten_kills, insert_readings, reading, readings};
use common::nats::{create_stream, header, relay_args, stored};
use std::time::Duration;

static ONE_FAULT_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The relay binary publishing the fixture's outbox to the test server.
fn spawn_relay(f: &Fixture, extra: &[&str]) -> common::KillOnDrop {
    let sink = relay_args();
    let sink: Vec<&str> = sink.iter().map(String::as_str).collect();
    f.spawn_relay_to(&sink, extra)
}

/// What the stream stored, as (meter, reading) in stream order.
async fn stored_readings(stream: &mut async_nats::jetstream::stream::Stream) -> Vec<(String, u64)> {
    stored(stream)
        .await
        .iter()
        .map(|m| {
            let meter = header(m, "aggregate_id").expect("an aggregate_id header");
            let payload: serde_json::Value =
                serde_json::from_slice(&m.payload).expect("a JSON payload");
            (meter.to_owned(), payload["n"].as_u64().expect("a reading"))
        })
        .collect()
}

#[tokio::test]
async fn the_relay_killed_ten_times_during_a_20k_drain_stores_every_event_once_in_order() {
    let _one = ONE_FAULT_AT_A_TIME.lock().await;
    const TOTAL: u64 = 20_000;
    const METERS: u64 = 200;
    let f = Fixture::new().await;
    let mut stream = create_stream(&f, vec![format!("{}.>", f.prefix)]).await;
    insert_readings(&f, TOTAL, METERS).await;

    // Small batches: the drain must outlast ten kills.
    drain_through_ten_kills(&f, 300, || spawn_relay(&f, &["--batch-size", "100"])).await;

    let arrived = stored_readings(&mut stream).await;
    let duplicates = common::assert_complete_and_ordered(arrived, &readings(TOTAL, METERS));
    assert_eq!(duplicates, 0, "events stored twice after the kills");
}

#[tokio::test]
async fn the_server_stopped_for_45_seconds_while_events_are_recorded_loses_and_repeats_nothing() {
    let _one = ONE_FAULT_AT_A_TIME.lock().await;
    const METERS: u64 = 20;
    let f = Fixture::new().await;
    let mut stream = create_stream(&f, vec![format!("{}.>", f.prefix)]).await;
    let mut relay = spawn_relay(&f, &[]);
    let writer = Writer::start(&f, METERS, Duration::from_millis(5), reading);
    tokio::time::sleep(Duration::from_secs(2)).await;
    common::services("pause-nats");
    tokio::time::sleep(Duration::from_secs(45)).await;
    common::services("resume-nats");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let total = writer.finish().await;
    f.wait_until_drained(Duration::from_secs(120)).await;
    assert_eq!(common::terminate(&mut relay), Some(0));
    assert_eq!(
        f.scalar("SELECT count(*) FROM outbox WHERE parked_at IS NOT NULL")
            .await,
        0,
        "nothing is parked for a server that stopped answering"
    );

    let arrived = stored_readings(&mut stream).await;
    let duplicates = common::assert_complete_and_ordered(arrived, &readings(total, METERS));
    eprintln!("{total} readings");
    assert_eq!(duplicates, 0, "events stored twice after the stop");
}
