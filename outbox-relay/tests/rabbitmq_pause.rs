//! The RabbitMQ sink with the broker stopped (SIGSTOP) for 45 seconds while events are recorded,
//! through the `outbox-relay` binary on real PostgreSQL and a real RabbitMQ.
//!
//! Not in `rabbitmq_faults.rs`: there, once, a broker killed with `kill -9` just after this test
//! came back without the durable queue the next test had declared (its events were returned
//! NO_ROUTE and parked); in a file of its own this test runs after the restarts.

mod common;

use common::Fixture;
use common::meters::{Writer, reading, readings};
use common::rabbitmq::{consume, declare_queue, open, relay_args};
use std::time::Duration;

/// The broker stopped (SIGSTOP) for 45 seconds while events are recorded: nothing is parked,
/// every event arrives, each aggregate's first deliveries in order. Publishes unconfirmed when it
/// stopped time out (after 30 s) and are sent again, so copies are allowed; RabbitMQ
/// has no deduplication, the consumer's inbox absorbs them.
#[tokio::test]
async fn the_broker_stopped_for_45_seconds_while_events_are_recorded_loses_nothing() {
    const METERS: u64 = 20;
    let f = Fixture::new().await;
    let (connection, channel) = open().await;
    let queue = f.topic("meter");
    declare_queue(&channel, &queue, true).await;
    drop((channel, connection));
    let sink = relay_args();
    let sink: Vec<&str> = sink.iter().map(String::as_str).collect();
    let mut relay = f.spawn_relay_to(&sink, &[]);
    let writer = Writer::start(&f, METERS, Duration::from_millis(5), reading);
    tokio::time::sleep(Duration::from_secs(2)).await;
    common::services("pause-rabbitmq");
    tokio::time::sleep(Duration::from_secs(45)).await;
    common::services("resume-rabbitmq");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let total = writer.finish().await;
    f.wait_until_drained(Duration::from_secs(180)).await;
    assert_eq!(common::terminate(&mut relay), Some(0), "{}", relay.log());
    assert_eq!(
        f.scalar("SELECT count(*) FROM outbox WHERE parked_at IS NOT NULL")
            .await,
        0,
        "nothing is parked for a broker that stopped answering"
    );

    let (_connection, channel) = open().await;
    let received = consume(&channel, &queue, total as usize, Duration::from_secs(120)).await;
    let arrived = received.iter().map(|m| {
        (
            m.header("aggregate_id").unwrap().to_owned(),
            m.json()["n"].as_u64().unwrap(),
        )
    });
    let duplicates = common::assert_complete_and_ordered(arrived, &readings(total, METERS));
    eprintln!("{total} readings, {duplicates} duplicates after the stop");
}
