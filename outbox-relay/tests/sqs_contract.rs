//! The SQS and SNS contract, end to end on real PostgreSQL and moto's server (PyPI's
//! `moto[server]`, started by `scripts/services start moto`), read back by boto3: body, message
//! attributes, group and deduplication ids, per-aggregate order on FIFO queues and topics; a batch
//! sent again is received once (the deduplication id); an event too large or for a missing queue
//! parks and no other; refused credentials leave the rows untouched and `/readyz` says why.

mod common;

use common::Fixture;
use common::aws::{create_queue, create_topic_with_queue, receive_all, refusing_url, url};
use seaorm_outbox::sea_orm::{ConnectionTrait, TransactionTrait};
use seaorm_outbox::{NewEvent, OutboxEvent, Uuid};
use seaorm_outbox_relay::sink::aws::AwsSettings;
use seaorm_outbox_relay::sink::sns::{SnsConfig, SnsSink};
use seaorm_outbox_relay::sink::sqs::{SqsConfig, SqsSink};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::time::Duration;

#[derive(Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate = "order", key = "order_id")]
struct OrderPlaced {
    order_id: String,
    n: i64,
    note: String,
}

#[derive(Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate = "invoice", key = "invoice_id")]
struct InvoiceSent {
    invoice_id: String,
}

/// The fixture with topics SQS and SNS take as names: `<prefix>-<aggregate>` and a suffix
/// (`.fifo` for FIFO queues and topics).
fn named(f: &Fixture, suffix: &str) -> Fixture {
    Fixture {
        template: format!("{}-{{aggregate_type}}{suffix}", f.prefix),
        ..f.clone()
    }
}

/// The topic of `aggregate_type` under the fixture's template.
fn topic(f: &Fixture, aggregate_type: &str) -> String {
    f.template.replace("{aggregate_type}", aggregate_type)
}

fn aws(endpoint: &str) -> AwsSettings {
    let mut aws = AwsSettings::default();
    aws.endpoint_url = Some(endpoint.to_owned());
    aws
}

fn sqs(endpoint: &str) -> SqsSink {
    let mut config = SqsConfig::default();
    config.aws = aws(endpoint);
    SqsSink::new(&config)
}

async fn drain(f: &Fixture, sink: SqsSink) {
    common::run_relay_until(f, sink, f.wait_until_drained(Duration::from_secs(60))).await;
}

/// Records `per_order` events for each of `orders` orders, one transaction per round; the ids
/// of each order's events in recording order.
async fn record_orders(f: &Fixture, orders: usize, per_order: i64) -> BTreeMap<String, Vec<Uuid>> {
    let mut recorded: BTreeMap<String, Vec<Uuid>> = BTreeMap::new();
    for n in 0..per_order {
        let txn = f.db.begin().await.unwrap();
        for o in 0..orders {
            let order_id = format!("o{o}");
            let event = OrderPlaced {
                order_id: order_id.clone(),
                n,
                note: "quote \" backslash \\ newline \n unicode é ✓".into(),
            };
            recorded
                .entry(order_id)
                .or_default()
                .push(event.record(&txn).await.unwrap());
        }
        txn.commit().await.unwrap();
    }
    recorded
}

/// Each aggregate's event ids as received.
fn arrived(messages: &[common::aws::Received]) -> BTreeMap<String, Vec<Uuid>> {
    let mut arrived: BTreeMap<String, Vec<Uuid>> = BTreeMap::new();
    for m in messages {
        arrived
            .entry(m.attributes["aggregate_id"].clone())
            .or_default()
            .push(m.attributes["id"].parse().unwrap());
    }
    arrived
}

#[tokio::test]
async fn events_reach_a_fifo_queue_with_attributes_in_order_and_a_resent_batch_is_received_once() {
    let f = Fixture::new().await;
    let f = named(&f, ".fifo");
    let queue = create_queue(&topic(&f, "order"));
    let recorded = record_orders(&f, 5, 20).await;
    let txn = f.db.begin().await.unwrap();
    let traced = NewEvent::from_event(&OrderPlaced {
        order_id: "traced".into(),
        n: 7,
        note: String::new(),
    })
    .unwrap()
    .with_header(
        "traceparent",
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    )
    .record(&txn)
    .await
    .unwrap();
    txn.commit().await.unwrap();

    drain(&f, sqs(&url())).await;
    // Sent again, as after a crash between the publish and the mark: SQS drops the copies.
    f.db.execute_unprepared("UPDATE outbox SET published_at = NULL")
        .await
        .unwrap();
    drain(&f, sqs(&url())).await;

    let messages = receive_all(&queue);
    assert_eq!(messages.len(), 101, "each event received once");
    for m in &messages {
        let id = &m.attributes["id"];
        assert_eq!(
            m.deduplication.as_ref(),
            Some(id),
            "deduplicated by the event id"
        );
        assert_eq!(
            m.group.as_ref(),
            Some(&m.attributes["aggregate_id"]),
            "grouped by aggregate"
        );
        assert_eq!(m.attributes["event_type"], "OrderPlaced");
        assert_eq!(m.attributes["aggregate_type"], "order");
        assert_eq!(m.attributes["event_version"], "1");
        let payload: serde_json::Value = serde_json::from_str(&m.body).unwrap();
        assert_eq!(payload["order_id"], m.attributes["aggregate_id"].as_str());
    }
    let note = messages
        .iter()
        .find(|m| m.attributes["aggregate_id"] == "o0")
        .map(|m| serde_json::from_str::<serde_json::Value>(&m.body).unwrap()["note"].clone());
    assert_eq!(
        note,
        Some("quote \" backslash \\ newline \n unicode é ✓".into()),
        "the payload as recorded"
    );
    let traced_message = messages
        .iter()
        .find(|m| m.attributes["id"] == traced.to_string())
        .expect("the traced event");
    assert_eq!(
        traced_message.attributes["traceparent"],
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    );
    let mut arrived = arrived(&messages);
    arrived.remove("traced");
    assert_eq!(arrived, recorded, "each order's events in recording order");
}

#[tokio::test]
async fn a_standard_queue_gets_every_event_without_group_or_deduplication_ids() {
    let f = Fixture::new().await;
    let f = named(&f, "");
    let queue = create_queue(&topic(&f, "order"));
    let recorded = record_orders(&f, 3, 4).await;
    drain(&f, sqs(&url())).await;
    let messages = receive_all(&queue);
    assert!(
        messages
            .iter()
            .all(|m| m.group.is_none() && m.deduplication.is_none())
    );
    let mut arrived = arrived(&messages);
    for ids in arrived.values_mut() {
        ids.sort();
    }
    let mut expected = recorded;
    for ids in expected.values_mut() {
        ids.sort();
    }
    assert_eq!(arrived, expected, "every event, in some order");
}

#[tokio::test]
async fn events_reach_an_sns_fifo_topic_and_its_queue_in_order() {
    let f = Fixture::new().await;
    let f = named(&f, ".fifo");
    let (topic_arn, queue) =
        create_topic_with_queue(&topic(&f, "order"), &format!("{}-sub.fifo", f.prefix));
    let recorded = record_orders(&f, 4, 10).await;

    let mut config = SnsConfig::default();
    config.aws = aws(&url());
    config.topic_arn_prefix = Some(topic_arn.trim_end_matches(&topic(&f, "order")).to_owned());
    common::run_relay_until(
        &f,
        SnsSink::new(&config),
        f.wait_until_drained(Duration::from_secs(60)),
    )
    .await;

    let messages = receive_all(&queue);
    assert_eq!(messages.len(), 40, "each event delivered once");
    for m in &messages {
        assert_eq!(m.attributes["event_type"], "OrderPlaced");
        assert_eq!(m.group.as_ref(), Some(&m.attributes["aggregate_id"]));
        let payload: serde_json::Value = serde_json::from_str(&m.body).unwrap();
        assert_eq!(payload["order_id"], m.attributes["aggregate_id"].as_str());
    }
    assert_eq!(arrived(&messages), recorded, "each order's events in order");
}

#[tokio::test]
async fn an_event_too_large_or_for_a_missing_queue_is_parked_and_others_flow() {
    let f = Fixture::new().await;
    let f = named(&f, ".fifo");
    let queue = create_queue(&topic(&f, "order"));
    let txn = f.db.begin().await.unwrap();
    OrderPlaced {
        order_id: "big".into(),
        n: 1,
        note: "x".repeat(300 * 1024),
    }
    .record(&txn)
    .await
    .unwrap();
    InvoiceSent {
        invoice_id: "i1".into(),
    }
    .record(&txn)
    .await
    .unwrap();
    txn.commit().await.unwrap();
    let recorded = record_orders(&f, 2, 3).await;

    let parked = "SELECT count(*) FROM outbox WHERE parked_at IS NOT NULL";
    common::run_relay_until(
        &f,
        sqs(&url()),
        f.wait_until_zero(
            "SELECT count(*) FROM outbox WHERE published_at IS NULL AND parked_at IS NULL",
            Duration::from_secs(60),
        ),
    )
    .await;
    assert_eq!(f.scalar(parked).await, 2);
    let reason = |aggregate: &'static str| {
        let f = f.clone();
        async move {
            f.db.query_one_raw(seaorm_outbox::sea_orm::Statement::from_string(
                seaorm_outbox::sea_orm::DbBackend::Postgres,
                format!("SELECT last_error FROM outbox WHERE aggregate_id = '{aggregate}'"),
            ))
            .await
            .unwrap()
            .unwrap()
            .try_get_by_index::<String>(0)
            .unwrap()
        }
    };
    let too_large = reason("big").await;
    assert!(
        too_large.contains("bytes with its attributes"),
        "{too_large}"
    );
    let missing = reason("i1").await;
    assert!(missing.contains("does not exist"), "{missing}");
    assert_eq!(arrived(&receive_all(&queue)), recorded, "the others flowed");
}

#[tokio::test]
async fn refused_credentials_leave_the_rows_untouched() {
    let f = Fixture::new().await;
    let f = named(&f, ".fifo");
    record_orders(&f, 1, 1).await;
    let sink = std::sync::Arc::new(sqs(&refusing_url()));
    common::run_relay_until(&f, sink.clone(), tokio::time::sleep(Duration::from_secs(3))).await;
    assert_eq!(
        f.scalar(common::TOUCHED).await,
        0,
        "nothing blamed on the event"
    );
    use seaorm_outbox_relay::sink::Sink;
    let ready = sink.ready().await.expect_err("not ready");
    assert!(ready.is_unavailable());
    assert!(ready.message.contains("InvalidClientTokenId"), "{ready}");
}

#[tokio::test]
async fn the_binary_reports_refused_credentials_on_readyz_and_never_prints_the_secret_key() {
    let f = Fixture::new().await;
    let f = named(&f, ".fifo");
    let queue = create_queue(&topic(&f, "order"));
    record_orders(&f, 1, 1).await;
    let secret = common::aws::secret_access_key();

    let port = common::free_port();
    let mut relay = f.spawn_relay_to(
        &["--sink", "sqs", "--aws-endpoint-url", &refusing_url()],
        &[
            "--log-format",
            "json",
            "--http-addr",
            &format!("127.0.0.1:{port}"),
        ],
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (status, ready) = common::http_get_when_up(port, "/readyz").await;
    assert_eq!(status, 503, "{ready}");
    assert!(
        ready.starts_with("not ready: sqs: ") && ready.contains("credentials"),
        "/readyz names the sink and the refusal: {ready}"
    );
    common::terminate(&mut relay);
    let log = relay.log();
    for (place, text) in [("the log", &log), ("/readyz", &ready)] {
        assert!(
            !text.contains(&secret),
            "{place} shows the secret key: {text}"
        );
    }
    assert_eq!(f.scalar(common::TOUCHED).await, 0);

    let relay = f.spawn_relay_to(&["--sink", "sqs", "--aws-endpoint-url", &url()], &[]);
    f.wait_until_drained(Duration::from_secs(60)).await;
    drop(relay);
    assert_eq!(
        receive_all(&queue).len(),
        1,
        "published with the right endpoint"
    );
}
