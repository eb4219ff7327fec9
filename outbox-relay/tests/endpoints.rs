//! `/metrics`, `/healthz` and `/readyz` of a running relay.

mod common;

use common::{Fixture, free_port, http_get_when_up};
use seaorm_outbox::sea_orm::ConnectionTrait;
use std::time::Duration;

#[tokio::test]
async fn metrics_count_what_was_published_and_readyz_checks_database_and_broker() {
    let f = Fixture::new().await;
    f.db.execute_unprepared(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
         SELECT gen_random_uuid(), 'meter', 'm-' || (g % 10), 'Read', '{}' FROM generate_series(1, 120) g",
    )
    .await
    .unwrap();
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let mut relay = f.spawn_relay(&["--http-addr", &addr, "--batch-size", "50"]);

    assert_eq!(
        http_get_when_up(port, "/healthz").await,
        (200, "ok\n".into())
    );
    f.wait_until_drained(Duration::from_secs(60)).await;
    let (status, metrics) = http_get_when_up(port, "/metrics").await;
    assert_eq!(status, 200);
    let topic = f.topic("meter");
    for expected in [
        format!("outbox_published_total{{topic=\"{topic}\"}} 120"),
        "outbox_shards_leased{table=\"outbox\"} 256".to_owned(),
        "outbox_batch_size_count 3".to_owned(),
        "outbox_commit_to_ack_seconds_count 120".to_owned(),
        "outbox_batch_duration_seconds_bucket{le=\"+Inf\"} 3".to_owned(),
        "# TYPE outbox_backlog_events gauge".to_owned(),
        "# TYPE outbox_oldest_unpublished_age_seconds gauge".to_owned(),
        "outbox_held_events{table=\"outbox\"} 0".to_owned(),
    ] {
        assert!(
            metrics.contains(&expected),
            "/metrics lacks {expected:?}:\n{metrics}"
        );
    }
    assert_eq!(
        http_get_when_up(port, "/readyz").await,
        (200, "ready\n".into())
    );

    // Another relay whose endpoint port is taken: one line, exit 2.
    let taken = common::relay_command()
        .args([
            "run",
            "--database-url",
            &f.url,
            "--sink",
            "stdout",
            "--http-addr",
            &addr,
        ])
        .output()
        .unwrap();
    assert_eq!(taken.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&taken.stderr)
            .contains(&format!("cannot serve /metrics on {addr}"))
    );
    assert_eq!(common::terminate(&mut relay), Some(0));
}

#[tokio::test]
async fn readyz_says_what_is_unreachable() {
    let f = Fixture::new().await;
    let port = free_port();
    let mut no_broker = common::KillOnDrop::spawn_logged(
        common::relay_command()
            .args([
                "run",
                "--database-url",
                &f.url,
                "--kafka-brokers",
                "127.0.0.1:1",
            ])
            .args(["--http-addr", &format!("127.0.0.1:{port}")]),
    );
    let (status, body) = http_get_when_up(port, "/readyz").await;
    assert_eq!(status, 503);
    assert!(
        body.starts_with("not ready: kafka: broker unreachable"),
        "{body}"
    );
    assert_eq!(common::terminate(&mut no_broker), Some(0));

    let port = free_port();
    let mut no_database = common::relay_command()
        .args([
            "run",
            "--database-url",
            "postgres://app:s3cret@127.0.0.1:1/shop",
            "--sink",
            "stdout",
        ])
        .args(["--http-addr", &format!("127.0.0.1:{port}")])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map(common::KillOnDrop::from)
        .unwrap();
    let (status, body) = http_get_when_up(port, "/readyz").await;
    assert_eq!(status, 503);
    assert!(body.starts_with("not ready: database"), "{body}");
    assert_eq!(
        http_get_when_up(port, "/healthz").await.0,
        200,
        "alive while the database is away"
    );
    let metrics = http_get_when_up(port, "/metrics").await.1;
    common::signal(&no_database, "TERM");
    let (status, log) = common::wait_for_exit(
        &mut no_database,
        Duration::from_secs(30),
        "the relay without a database does not stop",
    );
    assert_eq!(status.code(), Some(0), "{log}");
    // The URL is printed (masked) where an operator looks: the password never is.
    assert!(
        log.contains("postgres://app:***@127.0.0.1:1/shop"),
        "the log names the database: {log}"
    );
    for (place, text) in [
        ("/readyz", &body),
        ("/metrics", &metrics),
        ("the log", &log),
    ] {
        assert!(
            !text.contains("s3cret"),
            "{place} shows the password: {text}"
        );
    }
}

#[tokio::test]
async fn readyz_checks_the_pulsar_broker() {
    let f = Fixture::new().await;
    let port = free_port();
    let mut relay = f.spawn_pulsar_relay(&["--http-addr", &format!("127.0.0.1:{port}")]);
    assert_eq!(
        http_get_when_up(port, "/readyz").await,
        (200, "ready\n".into())
    );
    assert_eq!(common::terminate(&mut relay), Some(0));

    let port = free_port();
    let mut no_broker = common::KillOnDrop::spawn_logged(
        common::relay_command()
            .args(["run", "--database-url", &f.url])
            .args(["--sink", "pulsar", "--pulsar-url", "pulsar://127.0.0.1:1"])
            .args(["--http-addr", &format!("127.0.0.1:{port}")]),
    );
    let (status, body) = http_get_when_up(port, "/readyz").await;
    assert_eq!(status, 503);
    assert!(body.starts_with("not ready: pulsar:"), "{body}");
    assert_eq!(common::terminate(&mut no_broker), Some(0));
}
