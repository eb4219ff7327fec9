//! A single relay on SQLite, end to end: the binary migrates the database, the application records
//! events with `seaorm_outbox`, and `outbox-relay run --sink stdout` prints each committed event once.

mod common;

use seaorm_outbox::OutboxEvent;
use seaorm_outbox::sea_orm::{Database, TransactionTrait};
use serde::Serialize;
use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::time::Duration;

#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate = "order", key = "order_id")]
struct OrderPlaced {
    order_id: u32,
}

/// A new SQLite database, migrated by the binary; its URL.
fn migrated_database() -> String {
    let url = format!(
        "sqlite://{}?mode=rwc",
        outbox_tests::temp_dir().join("shop.db").display()
    );
    let migrate = common::relay_command()
        .args(["migrate", "--database-url", &url])
        .output()
        .unwrap();
    assert!(
        migrate.status.success(),
        "{}",
        String::from_utf8_lossy(&migrate.stderr)
    );
    url
}

#[tokio::test]
async fn the_relay_publishes_a_sqlite_outbox_to_stdout() {
    let url = migrated_database();

    let db = Database::connect(&url).await.unwrap();
    for order_id in [1, 2, 3] {
        let txn = db.begin().await.unwrap();
        OrderPlaced { order_id }.record(&txn).await.unwrap();
        txn.commit().await.unwrap();
    }
    let txn = db.begin().await.unwrap();
    OrderPlaced { order_id: 99 }.record(&txn).await.unwrap();
    txn.rollback().await.unwrap();
    // A row a non-Rust producer wrote with a payload that is not JSON: parked, never printed.
    use seaorm_outbox::sea_orm::ConnectionTrait;
    db.execute_unprepared(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
         VALUES ('0193a000-0000-7000-8000-000000000001', 'order', 'bad', 'OrderPlaced', '{not json')",
    )
    .await
    .unwrap();

    let mut relay = common::KillOnDrop::spawn_logged(
        common::relay_command()
            .args([
                "run",
                "--sink",
                "stdout",
                "--database-url",
                &url,
                "--poll-interval",
                "20ms",
                "--http-addr",
                "off",
            ])
            .stdout(Stdio::piped()),
    );
    let stdout = relay.stdout.take().unwrap();
    let lines = tokio::task::spawn_blocking(move || {
        BufReader::new(stdout)
            .lines()
            .take(3)
            .map(Result::unwrap)
            .collect::<Vec<String>>()
    });
    let lines = tokio::time::timeout(Duration::from_secs(30), lines)
        .await
        .expect("three events within 30 s")
        .unwrap();
    assert_eq!(common::terminate(&mut relay), Some(0));

    let events: Vec<serde_json::Value> = lines
        .iter()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let keys: Vec<&str> = events.iter().map(|e| e["key"].as_str().unwrap()).collect();
    assert_eq!(keys, ["1", "2", "3"]);
    for event in &events {
        assert_eq!(event["topic"], "outbox.event.order");
        assert_eq!(event["headers"]["event_type"], "OrderPlaced");
        assert_eq!(event["headers"]["aggregate_type"], "order");
        assert_eq!(event["headers"]["event_version"], "1");
        assert_eq!(event["headers"]["id"].as_str().unwrap().len(), 36);
        assert_eq!(
            event["payload"]["order_id"].to_string(),
            event["key"].as_str().unwrap()
        );
    }

    let status = common::relay_command()
        .args(["status", "--database-url", &url])
        .output()
        .unwrap();
    let status = String::from_utf8(status.stdout).unwrap();
    assert!(status.contains("backlog:            0 events"), "{status}");
    assert!(status.contains("parked:             1 events"), "{status}");
    assert!(status.contains("held:               0 events"), "{status}");
    let parked = common::relay_command()
        .args(["failed", "list", "--database-url", &url])
        .output()
        .unwrap();
    let parked = String::from_utf8(parked.stdout).unwrap();
    assert!(
        parked.contains("order:bad") && parked.contains("payload is not valid JSON"),
        "{parked}"
    );
}

/// The events the relay prints to stdout, as they come, read on a thread of their own.
fn events(stdout: std::process::ChildStdout) -> std::sync::mpsc::Receiver<serde_json::Value> {
    let (sent, events) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { return };
            if sent.send(serde_json::from_str(&line).unwrap()).is_err() {
                return;
            }
        }
    });
    events
}

/// The next `n` events, each within 30 s.
fn next(events: &std::sync::mpsc::Receiver<serde_json::Value>, n: usize) -> Vec<serde_json::Value> {
    (0..n)
        .map(|_| {
            events
                .recv_timeout(Duration::from_secs(30))
                .expect("the relay's next event within 30 s")
        })
        .collect()
}

/// The relay holds the events behind a parked one (the claim walks past them instead of reading
/// them again at every claim), shows them in `status`, and sends them in order once an operator
/// skips the parked event.
#[tokio::test]
async fn events_behind_a_parked_one_are_held_and_go_out_in_order_once_it_is_skipped() {
    let url = migrated_database();
    let db = Database::connect(&url).await.unwrap();
    use seaorm_outbox::sea_orm::ConnectionTrait;
    db.execute_unprepared(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) VALUES
         ('0193a000-0000-7000-8000-000000000001', 'order', 'bad', 'OrderPlaced', '{not json'),
         ('0193a000-0000-7000-8000-000000000002', 'order', 'bad', 'OrderPaid', '{\"n\": 1}'),
         ('0193a000-0000-7000-8000-000000000003', 'order', 'bad', 'OrderShipped', '{\"n\": 2}'),
         ('0193a000-0000-7000-8000-000000000004', 'order', 'ok', 'OrderPlaced', '{\"n\": 3}')",
    )
    .await
    .unwrap();
    let mut relay = common::KillOnDrop::spawn_logged(
        common::relay_command()
            .args(["run", "--sink", "stdout", "--database-url", &url])
            .args(["--poll-interval", "20ms", "--http-addr", "off"])
            .stdout(Stdio::piped()),
    );
    let events = events(relay.stdout.take().unwrap());
    let first = next(&events, 1);
    assert_eq!(first[0]["key"], "ok");

    let status = || {
        let out = common::relay_command()
            .args(["status", "--database-url", &url])
            .output()
            .unwrap();
        String::from_utf8(out.stdout).unwrap()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !status().contains("held:               2 events") {
        assert!(
            std::time::Instant::now() < deadline,
            "the two events behind the parked one are held: {}",
            status()
        );
        std::thread::sleep(Duration::from_millis(50));
    }

    let skip = common::relay_command()
        .args(["failed", "skip", "--database-url", &url])
        .args(["--aggregate", "order:bad", "--reason", "resent by hand"])
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&skip.stdout).contains("1 events skipped"),
        "{}",
        String::from_utf8_lossy(&skip.stderr)
    );
    let rest = next(&events, 2);
    let types: Vec<&str> = rest
        .iter()
        .map(|e| e["headers"]["event_type"].as_str().unwrap())
        .collect();
    assert_eq!(
        types,
        ["OrderPaid", "OrderShipped"],
        "in order, after the skip"
    );
    assert_eq!(common::terminate(&mut relay), Some(0));
    assert!(
        status().contains("held:               0 events"),
        "{}",
        status()
    );
}

#[tokio::test]
async fn a_second_relay_on_the_same_sqlite_file_refuses_to_start() {
    let url = migrated_database();
    let run = |stderr: Stdio| {
        common::relay_command()
            .env("OUTBOX_LOG", "info")
            .args([
                "run",
                "--database-url",
                &url,
                "--sink",
                "stdout",
                "--http-addr",
                "off",
            ])
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .map(common::KillOnDrop::from)
            .unwrap()
    };
    // Waits until a relay says it runs (it holds the lock by then).
    let wait_running = |child: &mut std::process::Child| {
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        loop {
            let line = lines.next().expect("the relay stopped").unwrap();
            if line.contains("relay running") {
                // Keep draining its log, so it never blocks on a full pipe.
                std::thread::spawn(move || lines.for_each(drop));
                return;
            }
        }
    };
    let mut first = run(Stdio::piped());
    wait_running(&mut first);
    let (status, stderr) = common::wait_for_exit(
        &mut run(Stdio::piped()),
        Duration::from_secs(30),
        "a second relay still runs on the same SQLite file",
    );
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("another relay already publishes"),
        "{stderr}"
    );
    assert_eq!(common::terminate(&mut first), Some(0));
    // Once the first is gone, a relay starts again.
    let mut third = run(Stdio::piped());
    wait_running(&mut third);
    assert_eq!(common::terminate(&mut third), Some(0));
}

/// A SQLite table migrated before schema version 4 lacks the claim's indexes: the relay says so
/// and what to run.
#[tokio::test]
async fn a_relay_on_a_sqlite_table_without_schema_version_4_says_to_migrate() {
    let url = migrated_database();
    let db = Database::connect(&url).await.unwrap();
    use seaorm_outbox::sea_orm::ConnectionTrait;
    db.execute_unprepared("DROP INDEX outbox_claimable")
        .await
        .unwrap();
    let mut relay = common::KillOnDrop::spawn_logged(
        common::relay_command()
            .args(["run", "--sink", "stdout", "--database-url", &url])
            .args(["--http-addr", "off"]),
    );
    common::assert_refused_until_migrated(&mut relay, 4);
}
