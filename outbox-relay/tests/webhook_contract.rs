//! The webhook sink, end to end on real PostgreSQL and a real HTTP receiver (an axum server in the
//! test, answering as it is told): signed POSTs whose signatures the Standard Webhooks reference
//! library (PyPI's `standardwebhooks`) accepts; each aggregate's events one at a time and in order,
//! aggregates concurrently; 429 and 503 retried no sooner than `Retry-After`; other 4xx parked with
//! the status; a refusal (401) and an unreachable receiver leave the rows untouched; the binary
//! with a secret file never prints the secret.

mod common;

use common::Fixture;
use common::webhook::{Call, Receiver, SECRET, ok_after};
use seaorm_outbox::sea_orm::TransactionTrait;
use seaorm_outbox::{OutboxEvent, Secret};
use seaorm_outbox_relay::sink::webhook::{WebhookConfig, WebhookSink};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::future::Future;
use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

#[derive(Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate = "order", key = "order_id")]
struct OrderPlaced {
    order_id: String,
    n: i64,
}

/// Runs a relay publishing with `config` until `done` resolves, then stops it.
async fn run_relay_until(f: &Fixture, config: &WebhookConfig, done: impl Future<Output = ()>) {
    common::run_relay_until(f, WebhookSink::new(config).expect("the sink"), done).await;
}

async fn record_order(f: &Fixture, order_id: &str, n: i64) {
    let txn = f.db.begin().await.unwrap();
    OrderPlaced {
        order_id: order_id.into(),
        n,
    }
    .record(&txn)
    .await
    .unwrap();
    txn.commit().await.unwrap();
}

/// Whether the Standard Webhooks reference library accepts each call's signature: one line per
/// call, `ok` or its error.
fn verified_by_the_reference_library(calls: &[Call]) -> Vec<String> {
    let python = std::env::var("OUTBOX_TEST_PYTHON").unwrap_or_else(|_| {
        panic!(
            "OUTBOX_TEST_PYTHON is not set: run `scripts/test`, which makes a Python with \
             PyPI's standardwebhooks"
        )
    });
    let script = r#"
import json, sys
from standardwebhooks.webhooks import Webhook
webhook = Webhook(sys.argv[1])
for line in sys.stdin:
    call = json.loads(line)
    try:
        webhook.verify(call["body"], call["headers"])
        print("ok")
    except Exception as e:
        print(f"refused: {e}")
"#;
    let mut child = std::process::Command::new(&python)
        .args(["-c", script, SECRET])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run Python");
    let mut stdin = child.stdin.take().unwrap();
    for call in calls {
        let headers: BTreeMap<&str, &str> = call
            .headers
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_str()))
            .collect();
        let line = serde_json::json!({
            "headers": headers,
            "body": String::from_utf8(call.body.clone()).unwrap(),
        });
        writeln!(stdin, "{line}").unwrap();
    }
    drop(stdin);
    let output = child.wait_with_output().unwrap();
    assert!(
        output.status.success(),
        "standardwebhooks failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout)
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect()
}

#[tokio::test]
async fn events_are_posted_signed_and_each_aggregate_one_at_a_time_in_order() {
    let f = Fixture::new().await;
    let receiver = Receiver::start(ok_after(Duration::from_millis(20))).await;
    for n in 0..40 {
        record_order(&f, &format!("o-{}", n % 4), n).await;
    }
    let config = WebhookConfig::new(receiver.url(), Secret::new(SECRET));
    run_relay_until(&f, &config, f.wait_until_drained(Duration::from_secs(60))).await;

    let calls = receiver.delivered();
    assert_eq!(calls.len(), 40, "{calls:?}");
    let first = calls.iter().find(|c| c.json()["n"] == 0).unwrap();
    assert_eq!(first.path, format!("/hooks/{}", f.topic("order")));
    assert_eq!(first.header("content-type"), Some("application/json"));
    assert_eq!(first.header("event_type"), Some("OrderPlaced"));
    assert_eq!(first.header("aggregate_id"), Some("o-0"));
    assert_eq!(first.header("webhook-id"), first.header("id"));
    assert!(
        verified_by_the_reference_library(&calls)
            .iter()
            .all(|v| v == "ok"),
        "signatures refused"
    );

    // Each aggregate: in order, the next request only after the previous one was answered.
    let mut by_order: BTreeMap<String, Vec<&Call>> = BTreeMap::new();
    for call in &calls {
        by_order
            .entry(call.header("aggregate_id").unwrap().to_owned())
            .or_default()
            .push(call);
    }
    for (order, calls) in &mut by_order {
        calls.sort_by_key(|c| c.started);
        let ns: Vec<i64> = calls
            .iter()
            .map(|c| c.json()["n"].as_i64().unwrap())
            .collect();
        let mut sorted = ns.clone();
        sorted.sort_unstable();
        assert_eq!(ns, sorted, "{order} out of order");
        for pair in calls.windows(2) {
            assert!(
                pair[1].started >= pair[0].answered,
                "{order}: a request started before the previous one was answered"
            );
        }
    }
    // Different aggregates were in flight at once.
    let overlapping = calls.iter().any(|a| {
        calls.iter().any(|b| {
            a.header("aggregate_id") != b.header("aggregate_id")
                && b.started < a.answered
                && a.started < b.answered
        })
    });
    assert!(overlapping, "aggregates went out one at a time");
}

#[tokio::test]
async fn busy_answers_are_retried_no_sooner_than_retry_after_and_order_holds() {
    let f = Fixture::new().await;
    // The first request is refused as busy, to be tried again in 2 seconds.
    let receiver = Receiver::start(Arc::new(|_, before| {
        if before == 0 {
            (
                429,
                vec![("retry-after", "2".to_owned())],
                "slow down".into(),
                Duration::ZERO,
            )
        } else {
            (200, vec![], String::new(), Duration::ZERO)
        }
    }))
    .await;
    for n in 0..3 {
        record_order(&f, "o-1", n).await;
    }
    let config = WebhookConfig::new(receiver.url(), Secret::new(SECRET));
    run_relay_until(&f, &config, f.wait_until_drained(Duration::from_secs(60))).await;

    let calls = receiver.calls();
    let refused = &calls[0];
    assert_eq!(refused.status, 429);
    let delivered = receiver.delivered();
    let ns: Vec<i64> = delivered
        .iter()
        .map(|c| c.json()["n"].as_i64().unwrap())
        .collect();
    assert_eq!(ns, [0, 1, 2], "order kept across the retry");
    let waited = delivered[0].started - refused.answered;
    assert!(
        waited >= Duration::from_millis(1900),
        "retried after {waited:?}"
    );
    assert_eq!(
        f.scalar("SELECT count(*) FROM outbox WHERE attempts = 1")
            .await,
        1,
        "one failed attempt counted"
    );
}

#[tokio::test]
async fn a_refused_event_is_parked_with_the_status_and_its_aggregate_waits() {
    let f = Fixture::new().await;
    let receiver = Receiver::start(Arc::new(|call, _| {
        if call.json()["order_id"] == "o-bad" {
            (
                422,
                vec![],
                "order_id o-bad is unknown".into(),
                Duration::ZERO,
            )
        } else {
            (200, vec![], String::new(), Duration::ZERO)
        }
    }))
    .await;
    record_order(&f, "o-bad", 0).await;
    record_order(&f, "o-bad", 1).await;
    record_order(&f, "o-ok", 2).await;
    let config = WebhookConfig::new(receiver.url(), Secret::new(SECRET));
    run_relay_until(&f, &config, async {
        f.wait_until_zero(
            "SELECT count(*) FROM outbox WHERE aggregate_id = 'o-ok' AND published_at IS NULL",
            Duration::from_secs(60),
        )
        .await;
        tokio::time::sleep(Duration::from_secs(1)).await;
    })
    .await;
    assert_eq!(
        f.scalar(
            "SELECT count(*) FROM outbox WHERE parked_at IS NOT NULL
             AND last_error = 'HTTP 422 Unprocessable Entity: order_id o-bad is unknown'"
        )
        .await,
        1
    );
    let delivered: Vec<String> = receiver
        .delivered()
        .iter()
        .map(|c| c.header("aggregate_id").unwrap().to_owned())
        .collect();
    assert_eq!(delivered, ["o-ok"], "o-bad's later event waits behind it");
}

#[tokio::test]
async fn a_refusal_and_an_unreachable_receiver_leave_the_rows_untouched() {
    let f = Fixture::new().await;
    record_order(&f, "o-1", 0).await;
    let receiver = Receiver::start(Arc::new(|_, _| {
        (401, vec![], "bad signature".into(), Duration::ZERO)
    }))
    .await;
    let config = WebhookConfig::new(receiver.url(), Secret::new(SECRET));
    run_relay_until(&f, &config, tokio::time::sleep(Duration::from_secs(3))).await;
    assert!(!receiver.calls().is_empty(), "the receiver was asked");
    assert_eq!(f.scalar(common::TOUCHED).await, 0, "a refusal touched rows");

    let unreachable = format!("http://127.0.0.1:{}/hooks/{{topic}}", common::free_port());
    let config = WebhookConfig::new(unreachable, Secret::new(SECRET));
    run_relay_until(&f, &config, tokio::time::sleep(Duration::from_secs(3))).await;
    assert_eq!(
        f.scalar(common::TOUCHED).await,
        0,
        "an unreachable receiver touched rows"
    );
}

#[tokio::test]
async fn the_binary_posts_with_a_secret_file_and_never_prints_the_secret() {
    let f = Fixture::new().await;
    record_order(&f, "o-1", 0).await;
    let refusing =
        Receiver::start(Arc::new(|_, _| (403, vec![], "no".into(), Duration::ZERO))).await;
    let dir = outbox_tests::temp_dir();
    let file = dir.join("webhook-secret");
    std::fs::write(&file, format!("{SECRET}\n")).unwrap();
    let file = file.display().to_string();
    let port = common::free_port();
    let mut relay = f.spawn_relay_to(
        &[
            "--sink",
            "webhook",
            "--webhook-url",
            &refusing.url(),
            "--webhook-secret-file",
            &file,
        ],
        &["--http-addr", &format!("127.0.0.1:{port}")],
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (status, ready) = common::http_get_when_up(port, "/readyz").await;
    assert_eq!(status, 503, "{ready}");
    assert!(ready.starts_with("not ready: webhook: "), "{ready}");
    common::terminate(&mut relay);
    let log = relay.log();
    assert!(log.contains("HTTP 403"), "the refusal is reported: {log}");
    let key = SECRET.trim_start_matches("whsec_");
    for (place, text) in [("the log", &log), ("/readyz", &ready)] {
        assert!(!text.contains(key), "{place} shows the secret: {text}");
    }
    assert_eq!(f.backlog().await, 1);

    let receiver = Receiver::start(ok_after(Duration::ZERO)).await;
    // WEBHOOK_URL from the environment this time.
    let mut relay = common::KillOnDrop::spawn_logged(
        common::relay_command()
            .args(["run", "--database-url", &f.url, "--sink", "webhook"])
            .args([
                "--topic-template",
                &f.template,
                "--http-addr",
                "127.0.0.1:0",
            ])
            .env("WEBHOOK_URL", receiver.url())
            .env("WEBHOOK_SECRET_FILE", &file),
    );
    f.wait_until_drained(Duration::from_secs(60)).await;
    assert_eq!(common::terminate(&mut relay), Some(0));
    assert_eq!(receiver.delivered().len(), 1);
}

#[test]
fn the_webhook_sink_without_a_url_or_a_secret_is_a_usage_error() {
    for (args, says) in [
        (
            &["--webhook-secret", SECRET][..],
            "the webhook sink needs a URL",
        ),
        (
            &["--webhook-url", "http://127.0.0.1:1/{topic}"][..],
            "the webhook sink needs a signing secret",
        ),
    ] {
        let output = common::relay_command()
            .args(["run", "--database-url", "postgres://u@127.0.0.1:1/db"])
            .args(["--sink", "webhook"])
            .args(args)
            .output()
            .unwrap();
        assert_eq!(output.status.code(), Some(2), "{args:?}");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains(says), "{stderr}");
        assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
        assert!(!stderr.contains("MfKQ9r8"), "{stderr}");
    }
}
