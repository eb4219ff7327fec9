//! A poison event in the middle of an aggregate's stream, on real PostgreSQL and Kafka: it is
//! parked with its reason, its aggregate waits, other aggregates flow; after the cause is fixed and
//! `failed retry`, or after `failed skip`, the aggregate's later events go out in order.

mod common;

use common::kafka::{Received, consume};
use common::{Fixture, relay_command};
use seaorm_outbox::sea_orm::ConnectionTrait;
use std::time::Duration;

/// Rows of `aggregate` with payloads `{"n": n}`; the ones in `poison` are 2 MB, over Kafka's
/// message size limit.
fn rows(aggregate: &str, ns: std::ops::RangeInclusive<i32>, poison: &[i32]) -> String {
    ns.map(|n| {
        let payload = if poison.contains(&n) {
            format!("jsonb_build_object('n', {n}, 'blob', repeat('x', 2000000))")
        } else {
            format!("jsonb_build_object('n', {n})")
        };
        format!("(gen_random_uuid(), 'stream', '{aggregate}', 'Tick', {payload})")
    })
    .collect::<Vec<_>>()
    .join(", ")
}

/// Inserts the rows of [`rows`] into the outbox.
async fn insert(f: &Fixture, rows: &[String]) {
    f.db.execute_unprepared(&format!(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) VALUES {}",
        rows.join(", ")
    ))
    .await
    .unwrap();
}

fn ns(received: &[Received], key: &str) -> Vec<i64> {
    received
        .iter()
        .filter(|m| m.key == key)
        .map(|m| m.json()["n"].as_i64().unwrap())
        .collect()
}

fn failed(f: &Fixture, args: &[&str]) -> String {
    let output = relay_command()
        .arg("failed")
        .args(args)
        .args(["--database-url", &f.url])
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "failed {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).unwrap()
}

#[tokio::test]
async fn a_poison_event_holds_its_aggregate_until_retried_or_skipped() {
    let f = Fixture::new().await;
    insert(
        &f,
        &[
            rows("a", 1..=4, &[2]),
            rows("b", 1..=5, &[]),
            rows("c", 1..=2, &[1]),
        ],
    )
    .await;
    let mut relay = f.spawn_relay(&["--batch-size", "3"]);

    // Everything that can go goes; the two poison events are parked with their reason.
    f.wait_until_zero(
        "SELECT count(*) FROM outbox WHERE (aggregate_id = 'b' AND published_at IS NULL) \
           OR (payload ? 'blob' AND parked_at IS NULL)",
        Duration::from_secs(60),
    )
    .await;
    let listed = failed(&f, &["list"]);
    assert!(
        listed.contains("stream:a") && listed.contains("stream:c"),
        "{listed}"
    );
    assert!(
        listed.to_lowercase().contains("too large"),
        "the reason names the cause: {listed}"
    );
    let a_row = listed.lines().find(|l| l.contains("stream:a")).unwrap();
    assert_eq!(
        a_row.split_whitespace().nth(4),
        Some("2"),
        "two events wait behind a's poison: {a_row}"
    );
    assert_eq!(
        f.scalar("SELECT count(*) FROM outbox WHERE aggregate_id IN ('a', 'c') AND published_at IS NULL AND parked_at IS NULL")
            .await,
        3,
        "a3, a4 and c2 wait behind their aggregate's parked event"
    );

    // Fix a's cause and retry it; give up on c's poison.
    f.db.execute_unprepared(
        "UPDATE outbox SET payload = payload - 'blob' WHERE aggregate_id = 'a' AND payload ? 'blob'",
    )
    .await
    .unwrap();
    assert!(failed(&f, &["retry", "--aggregate", "stream:a"]).contains("1 events will be retried"));
    assert!(
        failed(
            &f,
            &[
                "skip",
                "--aggregate",
                "stream:c",
                "--reason",
                "payload too big, resent by hand"
            ]
        )
        .contains("1 events skipped")
    );
    // The events held behind them are released with them: well before the relay's own check for
    // held events nothing blocks (every minute).
    f.wait_until_drained(Duration::from_secs(30)).await;
    assert_eq!(common::terminate(&mut relay), Some(0));

    let received = consume(&[&f.topic("stream")], 10, Duration::from_secs(60)).await;
    assert_eq!(ns(&received, "b"), [1, 2, 3, 4, 5]);
    assert_eq!(
        ns(&received, "a"),
        [1, 2, 3, 4],
        "a resumes in order after the retry"
    );
    assert_eq!(
        ns(&received, "c"),
        [2],
        "c's later event goes out after the skip"
    );
    assert_eq!(
        f.scalar("SELECT count(*) FROM outbox WHERE aggregate_id = 'c' AND parked_at IS NOT NULL \
                  AND published_at IS NOT NULL AND last_error = 'skipped by an operator: payload too big, resent by hand'")
            .await,
        1,
        "the skip is recorded with its reason"
    );
    assert!(failed(&f, &["list"]).contains("no parked events"));
}

#[test]
fn failed_commands_need_a_selection() {
    let output = relay_command()
        .args(["failed", "retry", "--database-url", "postgres://db/x"])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2));
    let output = relay_command()
        .args([
            "failed",
            "skip",
            "--all",
            "--database-url",
            "postgres://db/x",
        ])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2), "skip requires --reason");
}

#[tokio::test]
async fn skip_parked_lets_an_aggregates_later_events_go() {
    let f = Fixture::new().await;
    insert(&f, &[rows("a", 1..=3, &[2])]).await;
    let mut relay = f.spawn_relay(&["--skip-parked", "--batch-size", "1"]);
    f.wait_until_drained(Duration::from_secs(60)).await;
    assert_eq!(common::terminate(&mut relay), Some(0));
    let received = consume(&[&f.topic("stream")], 2, Duration::from_secs(30)).await;
    assert_eq!(
        ns(&received, "a"),
        [1, 3],
        "a3 went out although a2 is parked"
    );
    assert!(failed(&f, &["list"]).contains("stream:a"));
}

/// A relay that held an aggregate's later events behind its parked one leaves them held; a relay
/// started with `--skip-parked` releases them at its first claim, and they go out.
#[tokio::test]
async fn skip_parked_releases_the_events_an_earlier_relay_held() {
    let f = Fixture::new().await;
    insert(&f, &[rows("a", 1..=3, &[2])]).await;
    let mut relay = f.spawn_relay(&["--batch-size", "1"]);
    f.wait_until_zero(
        "SELECT count(*) FROM outbox WHERE payload->>'n' = '3' AND held_at IS NULL",
        Duration::from_secs(60),
    )
    .await;
    assert_eq!(common::terminate(&mut relay), Some(0));

    let mut relay = f.spawn_relay(&["--skip-parked", "--batch-size", "1"]);
    f.wait_until_zero(
        "SELECT count(*) FROM outbox WHERE published_at IS NULL AND parked_at IS NULL",
        Duration::from_secs(20),
    )
    .await;
    assert_eq!(common::terminate(&mut relay), Some(0));
    let received = consume(&[&f.topic("stream")], 2, Duration::from_secs(30)).await;
    assert_eq!(ns(&received, "a"), [1, 3]);
    assert_eq!(
        f.scalar("SELECT count(*) FROM outbox WHERE held_at IS NOT NULL")
            .await,
        0
    );
}
