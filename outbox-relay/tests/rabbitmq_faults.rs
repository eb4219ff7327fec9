//! The RabbitMQ sink under crashes, through the `outbox-relay` binary on real PostgreSQL and a
//! real RabbitMQ: the relay killed ten times during a drain, the broker killed twice and started
//! again; read back by a consumer: every event arrives, each aggregate's first deliveries in
//! order. A file of its own: a restarted broker closes every other test's channels. The broker
//! stopped for 45 seconds is in `rabbitmq_pause.rs`.

mod common;

use common::Fixture;
use common::meters::{drain_through_ten_kills, insert_readings, readings};
use common::rabbitmq::{consume, declare_queue, open, relay_args};
use std::time::Duration;

static ONE_FAULT_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test]
async fn the_relay_killed_ten_times_during_a_20k_drain_loses_nothing() {
    let _one = ONE_FAULT_AT_A_TIME.lock().await;
    const TOTAL: u64 = 20_000;
    const METERS: u64 = 200;
    let f = Fixture::new().await;
    let (_connection, channel) = open().await;
    let queue = f.topic("meter");
    declare_queue(&channel, &queue, true).await;
    insert_readings(&f, TOTAL, METERS).await;
    let sink = relay_args();
    let sink: Vec<&str> = sink.iter().map(String::as_str).collect();
    // Small batches: the drain must outlast ten kills.
    drain_through_ten_kills(&f, 300, || {
        f.spawn_relay_to(&sink, &["--batch-size", "100"])
    })
    .await;

    let received = consume(&channel, &queue, TOTAL as usize, Duration::from_secs(120)).await;
    let arrived = received.iter().map(|m| {
        (
            m.header("aggregate_id").unwrap().to_owned(),
            m.json()["n"].as_u64().unwrap(),
        )
    });
    let duplicates = common::assert_complete_and_ordered(arrived, &readings(TOTAL, METERS));
    eprintln!("{duplicates} duplicates after ten kills");
}

/// The broker killed (kill -9) twice during a drain and started again: every event arrives, each
/// aggregate's first deliveries in order. A row is marked only after the broker's publisher
/// confirm, so what the crash lost was never marked and is sent again.
#[tokio::test]
async fn the_broker_killed_twice_during_a_drain_loses_nothing() {
    let _one = ONE_FAULT_AT_A_TIME.lock().await;
    const TOTAL: u64 = 20_000;
    const METERS: u64 = 100;
    let f = Fixture::new().await;
    let (connection, channel) = open().await;
    let queue = f.topic("meter");
    declare_queue(&channel, &queue, true).await;
    drop((channel, connection));
    insert_readings(&f, TOTAL, METERS).await;
    let sink = relay_args();
    let sink: Vec<&str> = sink.iter().map(String::as_str).collect();
    let mut relay = f.spawn_relay_to(&sink, &["--batch-size", "100"]);
    for at in [3_000, 9_000] {
        f.wait_until_zero(
            &format!(
                "SELECT CASE WHEN count(*) >= {at} THEN 0 ELSE 1 END::bigint FROM outbox
                 WHERE published_at IS NOT NULL"
            ),
            Duration::from_secs(60),
        )
        .await;
        common::services("restart-rabbitmq");
    }
    f.wait_until_drained(Duration::from_secs(180)).await;
    assert_eq!(common::terminate(&mut relay), Some(0), "{}", relay.log());

    let (_connection, channel) = open().await;
    let received = consume(&channel, &queue, TOTAL as usize, Duration::from_secs(120)).await;
    let arrived = received.iter().map(|m| {
        (
            m.header("aggregate_id").unwrap().to_owned(),
            m.json()["n"].as_u64().unwrap(),
        )
    });
    let duplicates = common::assert_complete_and_ordered(arrived, &readings(TOTAL, METERS));
    eprintln!("{duplicates} duplicates after two broker crashes");
}
