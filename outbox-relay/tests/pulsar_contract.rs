//! The Pulsar contract, end to end on real PostgreSQL and Pulsar: partition and ordering key,
//! properties, value and per-aggregate order; nothing lost when the relay is killed mid-run; and
//! the same messages read by an independent client (PyPI's pulsar-client).

mod common;

use common::Fixture;
use common::pulsar::{Received, consume, topic, url};
use seaorm_outbox::sea_orm::TransactionTrait;
use seaorm_outbox::{Envelope, NewEvent, OutboxEvent, Uuid};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

#[derive(Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate = "order", key = "order_id")]
struct OrderPlaced {
    order_id: String,
    n: i64,
}

/// Records `per_order` events for each of `orders` orders, interleaved, in separate transactions;
/// returns the event ids per order, in recording order.
async fn record_orders(f: &Fixture, orders: usize, per_order: i64) -> BTreeMap<String, Vec<Uuid>> {
    let mut ids: BTreeMap<String, Vec<Uuid>> = BTreeMap::new();
    for n in 0..per_order {
        let txn = f.db.begin().await.unwrap();
        for o in 0..orders {
            let order_id = format!("o{o}");
            let id = OrderPlaced {
                order_id: order_id.clone(),
                n,
            }
            .record(&txn)
            .await
            .unwrap();
            ids.entry(order_id).or_default().push(id);
        }
        txn.commit().await.unwrap();
    }
    ids
}

/// The event ids received per key, first occurrences only, in arrival order.
fn first_arrivals(received: &[Received]) -> BTreeMap<String, Vec<Uuid>> {
    let mut seen = HashSet::new();
    let mut by_key: BTreeMap<String, Vec<Uuid>> = BTreeMap::new();
    for m in received {
        let id: Uuid = m.property("id").expect("id property").parse().unwrap();
        if seen.insert(id) {
            by_key.entry(m.key.clone()).or_default().push(id);
        }
    }
    by_key
}

#[tokio::test]
async fn events_reach_pulsar_with_keys_properties_and_order() {
    let f = Fixture::new().await;
    let ids = record_orders(&f, 5, 20).await;
    let traced = {
        let txn = f.db.begin().await.unwrap();
        let id = NewEvent::from_event(&OrderPlaced {
            order_id: "traced".into(),
            n: 0,
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
        id
    };

    let mut relay = f.spawn_pulsar_relay(&[]);
    f.wait_until_drained(Duration::from_secs(60)).await;
    common::terminate(&mut relay);

    let order_topic = topic(&f.topic("order"));
    let received = consume(&order_topic, 101, Duration::from_secs(60)).await;
    assert_eq!(received.len(), 101, "one message per event");

    // Per aggregate, the order of recording.
    let arrivals = first_arrivals(&received);
    for (order, recorded) in &ids {
        assert_eq!(&arrivals[order], recorded, "order of {order}");
    }
    // Keys, properties and value as the contract says.
    for m in &received {
        assert_eq!(
            m.ordering_key, m.key,
            "ordering key = partition key = aggregate id"
        );
        let payload: serde_json::Value = serde_json::from_slice(&m.payload).unwrap();
        assert_eq!(payload["order_id"], m.key.as_str());
        assert_eq!(m.property("event_type"), Some("OrderPlaced"));
        assert_eq!(m.property("aggregate_type"), Some("order"));
        assert_eq!(m.property("event_version"), Some("1"));
    }
    let traced_message = received.iter().find(|m| m.key == "traced").unwrap();
    assert_eq!(
        traced_message.property("id"),
        Some(traced.to_string().as_str())
    );
    assert_eq!(
        traced_message.property("traceparent"),
        Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
    );
    let envelope = Envelope::from_parts(
        Some(traced_message.key.as_bytes()),
        traced_message
            .properties
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_bytes())),
        &traced_message.payload,
    )
    .unwrap();
    let decoded: OrderPlaced = envelope.decode().unwrap();
    assert_eq!((decoded.order_id.as_str(), decoded.n), ("traced", 0));

    // The same topic through an independent client.
    let python = std::env::var("OUTBOX_TEST_PYTHON").unwrap_or_else(|_| {
        panic!("OUTBOX_TEST_PYTHON is not set: run `scripts/test`, which makes a Python with PyPI's pulsar-client")
    });
    let script = r#"
import json, sys, pulsar
client = pulsar.Client(sys.argv[1], logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error))
consumer = client.subscribe(sys.argv[2], "python-check", initial_position=pulsar.InitialPosition.Earliest)
for _ in range(int(sys.argv[3])):
    m = consumer.receive(timeout_millis=30000)
    print(json.dumps({"key": m.partition_key(), "ordering_key": m.ordering_key(),
                      "properties": m.properties(), "value": json.loads(m.data())}))
    consumer.acknowledge(m)
client.close()
"#;
    let output = std::process::Command::new(&python)
        .args(["-c", script, &url(), &order_topic, "101"])
        .output()
        .expect("run the Python client");
    assert!(
        output.status.success(),
        "pulsar-client failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let lines: Vec<serde_json::Value> = String::from_utf8(output.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 101);
    let traced_line = lines
        .iter()
        .find(|l| l["key"] == "traced")
        .expect("traced event");
    assert_eq!(traced_line["ordering_key"], "traced");
    assert_eq!(traced_line["properties"]["id"], traced.to_string());
    assert_eq!(traced_line["properties"]["event_type"], "OrderPlaced");
    assert_eq!(traced_line["properties"]["aggregate_type"], "order");
    assert_eq!(traced_line["properties"]["event_version"], "1");
    assert_eq!(
        traced_line["properties"]["traceparent"],
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    );
    assert_eq!(
        traced_line["value"],
        serde_json::json!({"order_id": "traced", "n": 0})
    );
    let o3: Vec<i64> = lines
        .iter()
        .filter(|l| l["key"] == "o3")
        .map(|l| l["value"]["n"].as_i64().unwrap())
        .collect();
    assert_eq!(
        o3,
        (0..20).collect::<Vec<_>>(),
        "per-aggregate order seen by pulsar-client"
    );
}

#[tokio::test]
async fn relay_killed_mid_run_loses_nothing_and_keeps_order() {
    let f = Fixture::new().await;
    let ids = record_orders(&f, 20, 150).await;
    let total: usize = ids.values().map(Vec::len).sum();

    // Kill the relay (SIGKILL: no goodbye) once it is part-way through, then start another.
    let mut relay = f.spawn_pulsar_relay(&["--batch-size", "100"]);
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let published = f
            .scalar("SELECT count(*) FROM outbox WHERE published_at IS NOT NULL")
            .await;
        if published >= 1000 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the relay published nothing"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    common::signal(&relay, "KILL");
    relay.wait().unwrap();
    let left = f.backlog().await;
    assert!(
        left > 0,
        "the relay finished before it was killed: make the backlog larger"
    );

    let mut relay = f.spawn_pulsar_relay(&[]);
    f.wait_until_drained(Duration::from_secs(120)).await;
    common::terminate(&mut relay);

    let received = consume(&topic(&f.topic("order")), total, Duration::from_secs(60)).await;
    let arrived = received.iter().map(|m| {
        let id: Uuid = m.property("id").expect("id property").parse().unwrap();
        (m.key.clone(), id)
    });
    let resent = common::assert_complete_and_ordered(arrived, &ids);
    eprintln!(
        "killed with {left} of {total} unpublished; {} messages arrived ({resent} re-sent)",
        received.len()
    );
}

/// Why the relay lets the broker name its producers (`docs/design.md`, "Broker-side
/// deduplication"): the `pulsar` crate numbers a producer's messages from 0 every time, so on a
/// deduplicating broker a second producer with the first one's name has its messages dropped as
/// replays, while the client reports them sent.
///
/// This tests the `pulsar` crate, not the relay, on purpose: it is the evidence for that
/// decision. When it fails, the crate has learnt to set sequence ids (or to honour the broker's
/// `last_sequence_id`), and the relay can name its producers per shard lease to get broker-side
/// deduplication across failovers.
#[tokio::test]
async fn a_reused_producer_name_loses_messages_on_a_deduplicating_broker() {
    use pulsar::{Pulsar, TokioExecutor};
    let topic = topic(&format!("dedup-{}", Uuid::now_v7().simple()));
    let name = format!("relay-{}", Uuid::now_v7().simple());
    let client = Pulsar::builder(url(), TokioExecutor).build().await.unwrap();
    for batch in [
        ["first-0", "first-1", "first-2"].as_slice(),
        ["second-0", "second-1"].as_slice(),
    ] {
        // A relay process: a producer named `name`, closed at exit.
        let mut producer = client
            .producer()
            .with_topic(&topic)
            .with_name(&name)
            .build()
            .await
            .unwrap();
        for value in batch {
            let receipt = producer
                .send_non_blocking(value.as_bytes().to_vec())
                .await
                .unwrap()
                .await;
            receipt.expect("the client reports every message as sent");
        }
        producer.close().await.unwrap();
    }
    let received = consume(&topic, 3, Duration::from_secs(30)).await;
    let values: Vec<String> = received
        .iter()
        .map(|m| String::from_utf8(m.payload.clone()).unwrap())
        .collect();
    assert_eq!(
        values,
        ["first-0", "first-1", "first-2"],
        "the second producer's messages (sequence ids 0 and 1 again) were dropped as duplicates"
    );
}
