//! The RabbitMQ contract, end to end on real PostgreSQL and a real RabbitMQ (Debian's, started by
//! `scripts/services start rabbitmq`): routing key, properties, headers, payload and per-aggregate
//! order as a consumer receives them; a routing key no queue takes parks its event and no other;
//! a refused password, a missing exchange and an unrelated CA leave the rows untouched. (Crashes:
//! `rabbitmq_faults.rs`.)

mod common;

use common::Fixture;
use common::rabbitmq::{Delivered, consume, declare_queue, open, password, tls_url, url};
use seaorm_outbox::sea_orm::TransactionTrait;
use seaorm_outbox::{NewEvent, OutboxEvent, Uuid};
use seaorm_outbox_relay::sink::rabbitmq::{RabbitMqConfig, RabbitMqSink};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::future::Future;
use std::time::Duration;

#[derive(Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate = "order", key = "order_id")]
struct OrderPlaced {
    order_id: String,
    n: i64,
}

#[derive(Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate = "invoice", key = "invoice_id")]
struct InvoiceSent {
    invoice_id: String,
}

/// Runs a relay publishing with `config` until `done` resolves, then stops it.
async fn run_relay_until(f: &Fixture, config: &RabbitMqConfig, done: impl Future<Output = ()>) {
    common::run_relay_until(f, RabbitMqSink::new(config), done).await;
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

/// Each aggregate's `n`s in the order received.
fn by_order(received: &[Delivered]) -> BTreeMap<String, Vec<i64>> {
    let mut orders: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for m in received {
        orders
            .entry(m.header("aggregate_id").expect("aggregate_id").to_owned())
            .or_default()
            .push(m.json()["n"].as_i64().unwrap());
    }
    orders
}

#[tokio::test]
async fn events_reach_a_queue_with_properties_headers_and_order() {
    let f = Fixture::new().await;
    let (_connection, channel) = open().await;
    // The default exchange routes by queue name: the queue is named after the topic. Only one of
    // its consumers receives at a time, so each aggregate's order reaches the application.
    let queue = f.topic("order");
    declare_queue(&channel, &queue, true).await;
    let mut ids = BTreeMap::new();
    for n in 0..60 {
        let order_id = format!("o-{}", n % 4);
        let txn = f.db.begin().await.unwrap();
        let event = OrderPlaced {
            order_id: order_id.clone(),
            n,
        };
        let mut new_event = NewEvent::from_event(&event).unwrap();
        if n == 0 {
            new_event = new_event.with_header("traceparent", "00-abc-def-01");
        }
        let id = new_event.id;
        seaorm_outbox::record_new_events(&txn, vec![new_event])
            .await
            .unwrap();
        txn.commit().await.unwrap();
        ids.insert(n, id);
    }
    let config = RabbitMqConfig::new(url());
    run_relay_until(&f, &config, f.wait_until_drained(Duration::from_secs(60))).await;

    // A second consumer on the queue stays idle while the first is active.
    let (_other, idle_channel) = open().await;
    let received = consume(&channel, &queue, 60, Duration::from_secs(60)).await;
    let idle = consume(&idle_channel, &queue, 0, Duration::from_secs(5)).await;
    assert!(idle.is_empty(), "the inactive consumer received {idle:?}");
    let orders = by_order(&received);
    for (order, ns) in &orders {
        let mut sorted = ns.clone();
        sorted.sort_unstable();
        assert_eq!(ns, &sorted, "{order}'s events out of order");
        assert_eq!(ns.len(), 15, "{order}");
    }
    let first = received
        .iter()
        .find(|m| m.json()["n"] == 0)
        .expect("event 0");
    assert_eq!(
        first.message_id.as_deref(),
        Some(ids[&0].to_string().as_str())
    );
    assert_eq!(first.kind.as_deref(), Some("OrderPlaced"));
    assert_eq!(first.content_type.as_deref(), Some("application/json"));
    assert_eq!(first.delivery_mode, Some(2), "persistent");
    assert_eq!(first.header("id"), Some(ids[&0].to_string().as_str()));
    assert_eq!(first.header("event_type"), Some("OrderPlaced"));
    assert_eq!(first.header("aggregate_type"), Some("order"));
    assert_eq!(first.header("event_version"), Some("1"));
    assert_eq!(first.header("aggregate_id"), Some("o-0"));
    assert_eq!(first.header("traceparent"), Some("00-abc-def-01"));
    assert_eq!(first.json()["order_id"], "o-0");
}

#[tokio::test]
async fn a_routing_key_no_queue_takes_parks_its_event_and_others_flow() {
    let f = Fixture::new().await;
    let (_connection, channel) = open().await;
    let queue = f.topic("order");
    declare_queue(&channel, &queue, false).await;
    // Nothing is bound for invoices.
    let txn = f.db.begin().await.unwrap();
    InvoiceSent {
        invoice_id: "i-1".into(),
    }
    .record(&txn)
    .await
    .unwrap();
    txn.commit().await.unwrap();
    record_order(&f, "o-1", 1).await;
    let config = RabbitMqConfig::new(url());
    run_relay_until(&f, &config, f.wait_until_drained(Duration::from_secs(60))).await;

    let received = consume(&channel, &queue, 1, Duration::from_secs(30)).await;
    assert_eq!(received.len(), 1);
    let parked = f
        .scalar(
            "SELECT count(*) FROM outbox WHERE parked_at IS NOT NULL AND aggregate_type = 'invoice'
             AND last_error LIKE 'no queue takes routing key%NO_ROUTE%'",
        )
        .await;
    assert_eq!(parked, 1, "the invoice is parked with the reason");
}

#[tokio::test]
async fn a_refused_password_and_a_missing_exchange_leave_the_rows_untouched() {
    let f = Fixture::new().await;
    record_order(&f, "o-1", 1).await;
    let wrong = url().replace(&password(), "wrong-password");
    let mut config = RabbitMqConfig::new(wrong);
    config.ack_timeout = Duration::from_secs(5);
    run_relay_until(&f, &config, tokio::time::sleep(Duration::from_secs(3))).await;
    assert_eq!(
        f.scalar(common::TOUCHED).await,
        0,
        "the refused password touched rows"
    );

    let mut config = RabbitMqConfig::new(url());
    config.exchange = format!("missing-{}", Uuid::now_v7().simple());
    run_relay_until(&f, &config, tokio::time::sleep(Duration::from_secs(3))).await;
    assert_eq!(
        f.scalar(common::TOUCHED).await,
        0,
        "the missing exchange touched rows"
    );
}

#[tokio::test]
async fn the_binary_reports_a_refused_password_on_readyz_and_never_prints_it() {
    let f = Fixture::new().await;
    let (_connection, channel) = open().await;
    let queue = f.topic("order");
    declare_queue(&channel, &queue, false).await;
    record_order(&f, "o-1", 1).await;

    let wrong = format!("wrong-{}", Uuid::now_v7().simple());
    let port = common::free_port();
    let mut relay = f.spawn_relay_to(
        &[
            "--sink",
            "rabbitmq",
            "--rabbitmq-url",
            &url().replace(&password(), &wrong),
        ],
        &["--http-addr", &format!("127.0.0.1:{port}")],
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (status, ready) = common::http_get_when_up(port, "/readyz").await;
    assert_eq!(status, 503, "{ready}");
    assert!(
        ready.starts_with("not ready: rabbitmq: "),
        "/readyz names the sink: {ready}"
    );
    common::terminate(&mut relay);
    let log = relay.log();
    assert!(
        log.contains("ACCESS_REFUSED") || log.to_lowercase().contains("refused"),
        "the refusal is reported: {log}"
    );
    for (place, text) in [("the log", &log), ("/readyz", &ready)] {
        assert!(!text.contains(&wrong), "{place} shows the password: {text}");
    }
    assert_eq!(f.backlog().await, 1);

    // The URL from a file, as a mounted secret.
    let file = outbox_tests::temp_dir().join("rabbitmq-url");
    std::fs::write(&file, format!("{}\n", url())).unwrap();
    let file = file.display().to_string();
    let relay = f.spawn_relay_to(&["--sink", "rabbitmq", "--rabbitmq-url-file", &file], &[]);
    f.wait_until_drained(Duration::from_secs(60)).await;
    drop(relay);
    assert_eq!(
        consume(&channel, &queue, 1, Duration::from_secs(30))
            .await
            .len(),
        1
    );
}

#[tokio::test]
async fn amqps_with_the_brokers_ca_publishes_and_an_unrelated_ca_leaves_the_rows_untouched() {
    let f = Fixture::new().await;
    let (_connection, channel) = open().await;
    let queue = f.topic("order");
    declare_queue(&channel, &queue, false).await;
    record_order(&f, "o-1", 1).await;
    let tls_dir = std::path::PathBuf::from(
        std::env::var("OUTBOX_TLS_DIR").expect("OUTBOX_TLS_DIR is not set (scripts/services)"),
    );
    let mut config = RabbitMqConfig::new(tls_url());
    config.tls_ca_file = Some(tls_dir.join("other-ca.pem"));
    run_relay_until(&f, &config, tokio::time::sleep(Duration::from_secs(3))).await;
    assert_eq!(
        f.scalar(common::TOUCHED).await,
        0,
        "an unrelated CA touched rows"
    );

    config.tls_ca_file = Some(tls_dir.join("ca.pem"));
    run_relay_until(&f, &config, f.wait_until_drained(Duration::from_secs(60))).await;
    assert_eq!(
        consume(&channel, &queue, 1, Duration::from_secs(30))
            .await
            .len(),
        1
    );
}
