//! The SQS sink under faults, through the `outbox-relay` binary on real PostgreSQL and ElasticMQ
//! (an SQS-compatible server), and the SNS sink on moto: the relay killed mid-drain, the server
//! stopped for 45 seconds. Read
//! back from a FIFO queue by boto3: every event received, each aggregate's in order, and none twice
//! (the relay's re-sends carry the event id as the deduplication id, inside SQS's five-minute
//! window).
//!
//! Not on moto, which the contract tests use: moto recomputes a queue's attributes over every
//! stored message for each message sent (its cost grows with the square of the backlog, 20,000
//! events took it past ten minutes), and it forgets a deduplication id once its message is deleted.
//!
//! One test at a time: a stopped server would stall the other.

mod common;

use common::Fixture;
use common::aws::{create_queue_on, create_topic_with_queue, elasticmq_url, receive_all};
use common::meters::{Writer, drain_through_ten_kills, insert_readings, reading, readings};
use std::time::Duration;

static ONE_FAULT_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The fixture publishing to the FIFO queue `<prefix>-meter.fifo`, and that queue's URL.
fn with_queue(f: &Fixture) -> (Fixture, String) {
    let f = Fixture {
        template: format!("{}-{{aggregate_type}}.fifo", f.prefix),
        ..f.clone()
    };
    let queue = create_queue_on(&elasticmq_url(), &format!("{}-meter.fifo", f.prefix));
    (f, queue)
}

/// The relay binary publishing the fixture's outbox to ElasticMQ.
fn spawn_relay(f: &Fixture, extra: &[&str]) -> common::KillOnDrop {
    f.spawn_relay_to(
        &["--sink", "sqs", "--aws-endpoint-url", &elasticmq_url()],
        extra,
    )
}

/// What the queue holds, as (meter, reading) in the order SQS hands it out.
fn received_readings(queue: &str) -> Vec<(String, u64)> {
    receive_all(queue)
        .iter()
        .map(|m| {
            let payload: serde_json::Value = serde_json::from_str(&m.body).expect("JSON");
            (
                m.attributes["aggregate_id"].clone(),
                payload["n"].as_u64().expect("a reading"),
            )
        })
        .collect()
}

#[tokio::test]
async fn the_relay_killed_ten_times_during_a_drain_delivers_every_event_once_in_order() {
    let _one = ONE_FAULT_AT_A_TIME.lock().await;
    const TOTAL: u64 = 20_000;
    const METERS: u64 = 200;
    let (f, queue) = with_queue(&Fixture::new().await);
    insert_readings(&f, TOTAL, METERS).await;
    // Small batches: the drain must outlast ten kills.
    drain_through_ten_kills(&f, 300, || spawn_relay(&f, &["--batch-size", "100"])).await;

    let arrived = received_readings(&queue);
    let duplicates = common::assert_complete_and_ordered(arrived, &readings(TOTAL, METERS));
    assert_eq!(duplicates, 0, "events delivered twice after the kills");
}

#[tokio::test]
async fn the_server_stopped_for_45_seconds_while_events_are_recorded_loses_and_repeats_nothing() {
    let _one = ONE_FAULT_AT_A_TIME.lock().await;
    let (f, queue) = with_queue(&Fixture::new().await);
    // Attempts that time out well inside the stop: the SDK gives up on its three, the relay retries
    // the batches, and the copies the server reads when it resumes are deduplicated.
    let relay = spawn_relay(&f, &["--aws-timeout", "5s"]);
    stopped_for_45_seconds(&f, relay, "elasticmq", Duration::from_millis(5), &queue).await;
}

/// Records readings of 20 meters, one every `interval`, while the server `server` (as
/// scripts/services names it) is stopped for 45 seconds under `relay`, then checks that `relay`
/// retried timed-out batches, parked nothing, and that `queue` holds every reading once, in order.
async fn stopped_for_45_seconds(
    f: &Fixture,
    mut relay: common::KillOnDrop,
    server: &str,
    interval: Duration,
    queue: &str,
) {
    const METERS: u64 = 20;
    let writer = Writer::start(f, METERS, interval, reading);
    tokio::time::sleep(Duration::from_secs(2)).await;
    common::services(&format!("pause-{server}"));
    tokio::time::sleep(Duration::from_secs(45)).await;
    common::services(&format!("resume-{server}"));
    tokio::time::sleep(Duration::from_secs(2)).await;
    let total = writer.finish().await;
    f.wait_until_drained(Duration::from_secs(180)).await;
    assert_eq!(common::terminate(&mut relay), Some(0));
    let log = relay.log();
    assert!(
        log.contains("batch partly published") && log.contains("timeout"),
        "the relay retried no timed-out batch, so the stop tested nothing of it:\n{log}"
    );
    assert_eq!(
        f.scalar("SELECT count(*) FROM outbox WHERE parked_at IS NOT NULL")
            .await,
        0,
        "nothing is parked for a server that stopped answering"
    );

    let arrived = received_readings(queue);
    let duplicates = common::assert_complete_and_ordered(arrived, &readings(total, METERS));
    assert_eq!(duplicates, 0, "events delivered twice after the stop");
}

/// The fixture publishing to the FIFO topic `<prefix>-meter.fifo` on moto, the topics' ARN
/// prefix, and the URL of the FIFO queue subscribed to it.
fn with_topic(f: &Fixture) -> (Fixture, String, String) {
    let f = Fixture {
        template: format!("{}-{{aggregate_type}}.fifo", f.prefix),
        ..f.clone()
    };
    let topic = format!("{}-meter.fifo", f.prefix);
    let (arn, queue) = create_topic_with_queue(&topic, &format!("{}-sub.fifo", f.prefix));
    let prefix = arn.trim_end_matches(&topic).to_owned();
    (f, prefix, queue)
}

/// The relay binary publishing the fixture's outbox to SNS on moto, topics' ARNs after `prefix`,
/// in batches of 20 (moto's cost per message).
fn spawn_sns_relay(f: &Fixture, prefix: &str, extra: &[&str]) -> common::KillOnDrop {
    let moto = common::aws::url();
    let mut args = vec!["--sns-topic-arn-prefix", prefix, "--batch-size", "20"];
    args.extend(extra);
    f.spawn_relay_to(&["--sink", "sns", "--aws-endpoint-url", &moto], &args)
}

/// SNS (moto: ElasticMQ has no SNS) to a FIFO topic and its subscribed FIFO queue, the relay killed
/// ten times: every event once, in order. Smaller than the SQS case: moto's cost per message grows
/// with the queue's length (above), and it deduplicates only against messages still in the queue,
/// which these are until the end.
#[tokio::test]
async fn sns_the_relay_killed_ten_times_during_a_drain_delivers_every_event_once_in_order() {
    let _one = ONE_FAULT_AT_A_TIME.lock().await;
    const TOTAL: u64 = 1_000;
    const METERS: u64 = 20;
    let (f, prefix, queue) = with_topic(&Fixture::new().await);
    insert_readings(&f, TOTAL, METERS).await;
    drain_through_ten_kills(&f, 50, || spawn_sns_relay(&f, &prefix, &[])).await;

    let arrived = received_readings(&queue);
    let duplicates = common::assert_complete_and_ordered(arrived, &readings(TOTAL, METERS));
    assert_eq!(duplicates, 0, "events delivered twice after the kills");
}

#[tokio::test]
async fn sns_the_server_stopped_for_45_seconds_while_events_are_recorded_loses_and_repeats_nothing()
{
    let _one = ONE_FAULT_AT_A_TIME.lock().await;
    let (f, prefix, queue) = with_topic(&Fixture::new().await);
    let relay = spawn_sns_relay(&f, &prefix, &["--aws-timeout", "5s"]);
    // A reading every 50 ms, about 1,000 in all: moto's cost per message.
    stopped_for_45_seconds(&f, relay, "moto", Duration::from_millis(50), &queue).await;
}
