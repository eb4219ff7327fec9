//! The Kafka contract, end to end on real PostgreSQL and Kafka: key, value, headers and topic as
//! documented, for a derived event and for a row written by hand in SQL; read back both by rdkafka
//! and by an independent client (kcat).

mod common;

use common::Fixture;
use common::kafka::{Received, brokers, consume};
use seaorm_outbox::sea_orm::{ConnectionTrait, TransactionTrait};
use seaorm_outbox::{Envelope, NewEvent, OutboxEvent, Uuid};
use seaorm_outbox_relay::Relay;
use seaorm_outbox_relay::sink::kafka::{KafkaConfig, KafkaSink};
use serde::{Deserialize, Serialize};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

#[derive(Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate = "order", key = "order_id")]
struct OrderPlaced {
    order_id: String,
    total_cents: i64,
}

#[derive(Serialize, OutboxEvent)]
#[outbox(
    aggregate = "order",
    key = "order_id",
    topic = "contract-shipping",
    version = 2
)]
struct OrderShipped {
    order_id: String,
}

/// Runs an in-process relay until `work_left` (SQL returning one count) is 0, then stops it
/// gracefully.
async fn relay_until(fixture: &Fixture, strict: bool, work_left: &str) {
    let mut config = fixture.relay_config();
    config.strict = strict;
    let sink = KafkaSink::new(&KafkaConfig::new(brokers())).expect("kafka sink");
    let relay = Relay::new(config, sink);
    let shutdown = CancellationToken::new();
    let running = tokio::spawn({
        let shutdown = shutdown.clone();
        async move { relay.run(shutdown).await.expect("the relay refused to run") }
    });
    fixture
        .wait_until_zero(work_left, Duration::from_secs(60))
        .await;
    shutdown.cancel();
    running.await.expect("relay task");
}

fn by_key<'a>(received: &'a [Received], key: &str) -> Vec<&'a Received> {
    received.iter().filter(|m| m.key == key).collect()
}

#[tokio::test]
async fn derived_and_hand_written_events_reach_kafka_as_documented() {
    let f = Fixture::new().await;
    let order = format!("o-{}", Uuid::now_v7());
    let traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

    // A derived event with a header, and one with a registered topic.
    let txn = f.db.begin().await.unwrap();
    let placed = OrderPlaced {
        order_id: order.clone(),
        total_cents: 1999,
    };
    let placed_id = NewEvent::from_event(&placed)
        .unwrap()
        .with_header("traceparent", traceparent)
        .record(&txn)
        .await
        .unwrap();
    let shipped_id = OrderShipped {
        order_id: order.clone(),
    }
    .record(&txn)
    .await
    .unwrap();
    txn.commit().await.unwrap();

    // Rows a non-Rust producer writes by hand: one routed by the template, one by its own topic.
    let invoice_id = Uuid::now_v7();
    let explicit_topic = format!("{}-explicit", f.prefix);
    f.db.execute_unprepared(&format!(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, event_version, payload, headers) \
         VALUES ('{invoice_id}', 'invoice', 'inv-9', 'InvoiceIssued', 4, \
                 '{{\"amount\": 12, \"lines\": [1, 2], \"note\": \"é\"}}', '{{\"tracestate\": \"x=1\"}}');
         INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, topic, payload) \
         VALUES ('{}', 'invoice', 'inv-10', 'InvoiceVoided', '{explicit_topic}', '{{}}')",
        Uuid::now_v7()
    ))
    .await
    .unwrap();

    // A rolled-back business transaction: its event must never be published.
    let txn = f.db.begin().await.unwrap();
    OrderPlaced {
        order_id: "rolled-back".into(),
        total_cents: 1,
    }
    .record(&txn)
    .await
    .unwrap();
    txn.rollback().await.unwrap();

    relay_until(
        &f,
        false,
        "SELECT count(*) FROM outbox WHERE published_at IS NULL",
    )
    .await;
    let (order_topic, invoice_topic) = (f.topic("order"), f.topic("invoice"));
    let all = consume(
        &[
            &order_topic,
            &invoice_topic,
            "contract-shipping",
            &explicit_topic,
        ],
        4,
        Duration::from_secs(60),
    )
    .await;
    // contract-shipping is a fixed topic: keep this run's messages only.
    let received: Vec<Received> = all
        .into_iter()
        .filter(|m| m.topic != "contract-shipping" || m.key == order)
        .collect();

    // The derived event: key, value, headers, topic.
    let placed_msg = by_key(&received, &order)
        .into_iter()
        .find(|m| m.topic == order_topic)
        .expect("OrderPlaced");
    assert_eq!(placed_msg.json(), serde_json::to_value(&placed).unwrap());
    assert_eq!(
        placed_msg.headers,
        vec![
            ("id".to_owned(), placed_id.to_string()),
            ("event_type".to_owned(), "OrderPlaced".to_owned()),
            ("aggregate_type".to_owned(), "order".to_owned()),
            ("event_version".to_owned(), "1".to_owned()),
            ("traceparent".to_owned(), traceparent.to_owned()),
        ]
    );
    assert_eq!(placed_msg.header("id").unwrap().len(), 36);
    let shipped_msg = by_key(&received, &order)
        .into_iter()
        .find(|m| m.topic == "contract-shipping")
        .expect("OrderShipped");
    assert_eq!(
        shipped_msg.header("id"),
        Some(shipped_id.to_string().as_str())
    );
    assert_eq!(shipped_msg.header("event_version"), Some("2"));

    // The hand-written row: value is the stored JSON, byte for byte.
    let stored: String = {
        use seaorm_outbox::sea_orm::{DbBackend, Statement};
        f.db.query_one_raw(Statement::from_string(
            DbBackend::Postgres,
            format!("SELECT payload::text FROM outbox WHERE id = '{invoice_id}'"),
        ))
        .await
        .unwrap()
        .unwrap()
        .try_get_by_index(0)
        .unwrap()
    };
    let invoice = by_key(&received, "inv-9");
    assert_eq!(invoice.len(), 1);
    assert_eq!(invoice[0].topic, invoice_topic);
    assert_eq!(invoice[0].payload, stored.as_bytes());
    assert_eq!(
        invoice[0].headers,
        vec![
            ("id".to_owned(), invoice_id.to_string()),
            ("event_type".to_owned(), "InvoiceIssued".to_owned()),
            ("aggregate_type".to_owned(), "invoice".to_owned()),
            ("event_version".to_owned(), "4".to_owned()),
            ("tracestate".to_owned(), "x=1".to_owned()),
        ]
    );
    assert_eq!(by_key(&received, "inv-10")[0].topic, explicit_topic);

    assert!(
        by_key(&received, "rolled-back").is_empty(),
        "a rolled-back event was published"
    );

    // A consumer decodes what it received back into the event type.
    let envelope = Envelope::from_parts(
        Some(placed_msg.key.as_bytes()),
        placed_msg
            .headers
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_bytes())),
        &placed_msg.payload,
    )
    .unwrap();
    assert_eq!(envelope.id, placed_id);
    assert_eq!(
        envelope.headers.get("traceparent").map(String::as_str),
        Some(traceparent)
    );
    let decoded: OrderPlaced = envelope.decode().unwrap();
    assert_eq!(
        (decoded.order_id, decoded.total_cents),
        (placed.order_id.clone(), placed.total_cents)
    );
    assert_eq!(received.len(), 4, "{received:#?}");
    assert_eq!(
        f.scalar("SELECT count(*) FROM outbox WHERE published_at IS NULL")
            .await,
        0
    );

    // The same message, read by an independent client.
    let output = std::process::Command::new("kcat")
        .args([
            "-C",
            "-b",
            &brokers(),
            "-t",
            &invoice_topic,
            "-o",
            "beginning",
            "-e",
            "-q",
            "-f",
            "%k\t%s\t%h\n",
        ])
        .output()
        .expect("kcat (scripts/setup installs it)");
    assert!(
        output.status.success(),
        "kcat failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let line = String::from_utf8(output.stdout).unwrap();
    assert_eq!(
        line.trim_end(),
        format!(
            "inv-9\t{stored}\tid={invoice_id},event_type=InvoiceIssued,aggregate_type=invoice,event_version=4,tracestate=x=1"
        )
    );
}

#[tokio::test]
async fn strict_mode_parks_unknown_event_types_and_holds_back_their_aggregate() {
    let f = Fixture::new().await;
    f.db.execute_unprepared(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) VALUES
           (gen_random_uuid(), 'order', 'held', 'Mystery', '{}'),
           (gen_random_uuid(), 'order', 'held', 'OrderPlaced', '{\"order_id\": \"held\", \"total_cents\": 1}'),
           (gen_random_uuid(), 'order', 'free', 'OrderPlaced', '{\"order_id\": \"free\", \"total_cents\": 2}')",
    )
    .await
    .unwrap();

    let free_or_mystery_left = "SELECT count(*) FROM outbox \
        WHERE (aggregate_id = 'free' AND published_at IS NULL) OR (event_type = 'Mystery' AND parked_at IS NULL)";
    relay_until(&f, true, free_or_mystery_left).await;
    let received = consume(&[&f.topic("order")], 1, Duration::from_secs(30)).await;
    assert_eq!(
        received.iter().map(|m| m.key.as_str()).collect::<Vec<_>>(),
        ["free"]
    );

    let parked_reason = f
        .scalar(
            "SELECT count(*) FROM outbox WHERE parked_at IS NOT NULL AND event_type = 'Mystery' \
                 AND last_error LIKE 'unknown event type `Mystery`%'",
        )
        .await;
    assert_eq!(
        parked_reason, 1,
        "the unknown event is parked with its reason"
    );
    let waiting = f
        .scalar("SELECT count(*) FROM outbox WHERE aggregate_id = 'held' AND event_type = 'OrderPlaced' \
                 AND published_at IS NULL AND parked_at IS NULL")
        .await;
    assert_eq!(
        waiting, 1,
        "the parked event's aggregate is held back, not skipped"
    );
}

#[tokio::test]
async fn delete_mode_removes_rows_once_the_broker_acked_them() {
    let f = Fixture::new().await;
    f.db.execute_unprepared(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
         SELECT gen_random_uuid(), 'ticket', 't-' || (g % 7), 'TicketSold', jsonb_build_object('g', g)
         FROM generate_series(1, 1000) g",
    )
    .await
    .unwrap();
    let mut relay = f.spawn_relay(&["--mode", "delete", "--batch-size", "100"]);
    f.wait_until_zero("SELECT count(*) FROM outbox", Duration::from_secs(60))
        .await;
    assert_eq!(common::terminate(&mut relay), Some(0));

    let received = consume(&[&f.topic("ticket")], 1000, Duration::from_secs(60)).await;
    assert_eq!(received.len(), 1000);
    for key in (0..7).map(|k| format!("t-{k}")) {
        let gs: Vec<i64> = received
            .iter()
            .filter(|m| m.key == key)
            .map(|m| m.json()["g"].as_i64().unwrap())
            .collect();
        assert!(gs.windows(2).all(|w| w[0] < w[1]), "{key} out of order");
    }
}
