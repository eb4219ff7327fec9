//! Debezium on the outbox table, end to end: `deploy/debezium/outbox-connector.json` in the Kafka
//! Connect worker `scripts/services start debezium` runs, events recorded through `record`, the
//! messages checked like the relay's contract test (rdkafka and kcat), then applied once each by
//! the consumer loop and the inbox, unchanged. The differences that remain (custom headers, the
//! `topic` column) are asserted here as `docs/design.md` lists them.

mod common;

use common::Fixture;
use common::kafka::{Received, brokers, consume};
use outbox_tests::debezium;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use seaorm_outbox::consumer::kafka::KafkaConsumer;
use seaorm_outbox::consumer::{Consumed, ConsumerOptions, HandlerError};
use seaorm_outbox::sea_orm::{
    ConnectionTrait, DatabaseTransaction, DbBackend, Statement, TransactionTrait,
};
use seaorm_outbox::{Envelope, NewEvent, OutboxEvent, Uuid};
use serde::{Deserialize, Serialize};
use std::process::Command;
use std::time::{Duration, Instant};

#[derive(Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate = "order", key = "order_id")]
struct OrderPlaced {
    order_id: String,
    total_cents: i64,
}

#[derive(Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate = "order", key = "order_id", version = 2)]
struct OrderShipped {
    order_id: String,
}

/// Runs the deployed connector on the fixture's table until dropped, then removes it with its
/// slot and publication.
struct Connector {
    name: String,
    db: seaorm_outbox::sea_orm::DatabaseConnection,
}

impl Connector {
    async fn start(f: &Fixture) -> Connector {
        let schema: String =
            f.db.query_one_raw(Statement::from_string(
                DbBackend::Postgres,
                "SELECT current_schema()::text",
            ))
            .await
            .unwrap()
            .unwrap()
            .try_get_by_index(0)
            .unwrap();
        // Topics first: the worker's idempotent producer can stall on an auto-created one.
        create_topics(&[&f.topic("order"), &f.topic("invoice")]).await;
        let name = f.prefix.clone();
        debezium::put(&name, &debezium::config(&schema, &name));
        let connector = Connector {
            name,
            db: f.db.clone(),
        };
        connector.wait_until_streaming(f).await;
        connector
    }

    /// Waits until the task runs and reads its slot: from then on, every commit reaches it.
    async fn wait_until_streaming(&self, f: &Fixture) {
        let deadline = Instant::now() + Duration::from_secs(90);
        loop {
            let (state, status) = debezium::task_state(&self.name);
            let streaming = state == "RUNNING"
                && f.scalar(&format!(
                    "SELECT count(*) FROM pg_replication_slots WHERE slot_name = '{}' AND active",
                    self.name
                ))
                .await
                    == 1;
            if streaming {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the connector is not streaming after 90 s: {status}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

impl Drop for Connector {
    fn drop(&mut self) {
        debezium::delete(&self.name);
        let (db, name) = (self.db.clone(), self.name.clone());
        // The slot is released once the task stopped; a forgotten slot would retain WAL.
        let cleanup = async move {
            for _ in 0..100 {
                let dropped = db
                    .execute_unprepared(&format!(
                        "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots
                         WHERE slot_name = '{name}' AND NOT active"
                    ))
                    .await;
                let left = db
                    .query_one_raw(Statement::from_string(
                        DbBackend::Postgres,
                        format!(
                            "SELECT count(*) FROM pg_replication_slots WHERE slot_name = '{name}'"
                        ),
                    ))
                    .await
                    .ok()
                    .flatten()
                    .and_then(|row| row.try_get_by_index::<i64>(0).ok());
                if dropped.is_ok() && left == Some(0) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            let _ = db
                .execute_unprepared(&format!("DROP PUBLICATION IF EXISTS {name}"))
                .await;
        };
        tokio::task::block_in_place(|| tokio::runtime::Handle::current().block_on(cleanup));
    }
}

async fn create_topics(names: &[&str]) {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .create()
        .expect("admin client");
    let topics: Vec<NewTopic<'_>> = names
        .iter()
        .map(|name| NewTopic::new(name, 3, TopicReplication::Fixed(1)))
        .collect();
    for result in admin
        .create_topics(&topics, &AdminOptions::new())
        .await
        .expect("create topics")
    {
        result.expect("topic created");
    }
}

fn by_key<'a>(received: &'a [Received], key: &str) -> Vec<&'a Received> {
    received.iter().filter(|m| m.key == key).collect()
}

fn headers(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

/// The consumer's effect: one row per applied event.
const EFFECTS: &str = "CREATE TABLE effects (
    pos bigserial PRIMARY KEY, event_id uuid NOT NULL, order_id text NOT NULL, event_type text NOT NULL)";

async fn apply(envelope: &Envelope, txn: &DatabaseTransaction) -> Result<(), HandlerError> {
    let order_id = match envelope.event_type.as_str() {
        "OrderPlaced" => envelope.decode::<OrderPlaced>()?.order_id,
        "OrderShipped" => envelope.decode::<OrderShipped>()?.order_id,
        other => return Err(format!("unexpected event type {other}").into()),
    };
    txn.execute_raw(Statement::from_sql_and_values(
        DbBackend::Postgres,
        "INSERT INTO effects (event_id, order_id, event_type) VALUES ($1::text::uuid, $2, $3)",
        [
            envelope.id.to_string().into(),
            order_id.into(),
            envelope.event_type.clone().into(),
        ],
    ))
    .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn debezium_publishes_recorded_events_under_the_relays_contract() {
    let f = Fixture::new().await;
    f.db.execute_unprepared(EFFECTS).await.unwrap();
    let connector = Connector::start(&f).await;
    let (order_topic, invoice_topic) = (f.topic("order"), f.topic("invoice"));

    // Recorded through `record`, in one business transaction, one with a custom header.
    let order = format!("o-{}", Uuid::now_v7());
    let traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let placed = OrderPlaced {
        order_id: order.clone(),
        total_cents: 1999,
    };
    let txn = f.db.begin().await.unwrap();
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

    // A row a non-Rust producer writes by hand, and one naming its own topic.
    let invoice_id = Uuid::now_v7();
    f.db.execute_unprepared(&format!(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, event_version, payload) \
         VALUES ('{invoice_id}', 'invoice', 'inv-9', 'InvoiceIssued', 4, \
                 '{{\"amount\": 12, \"lines\": [1, 2], \"note\": \"é\"}}');
         INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, topic, payload) \
         VALUES ('{}', 'invoice', 'inv-10', 'InvoiceVoided', '{}-explicit', '{{}}')",
        Uuid::now_v7(),
        f.prefix
    ))
    .await
    .unwrap();

    // A rolled-back transaction: never published.
    let txn = f.db.begin().await.unwrap();
    OrderPlaced {
        order_id: "rolled-back".into(),
        total_cents: 1,
    }
    .record(&txn)
    .await
    .unwrap();
    txn.rollback().await.unwrap();

    let received = consume(&[&order_topic, &invoice_topic], 4, Duration::from_secs(90)).await;
    assert_eq!(received.len(), 4, "{received:#?}");
    assert!(by_key(&received, "rolled-back").is_empty());

    // Key, topic, value and the contract's headers, as the relay sends them.
    let mine = by_key(&received, &order);
    assert_eq!(mine.len(), 2, "{received:#?}");
    let (placed_msg, shipped_msg) = (mine[0], mine[1]);
    assert_eq!(placed_msg.topic, order_topic);
    assert_eq!(placed_msg.json(), serde_json::to_value(&placed).unwrap());
    // Difference: the custom header (traceparent) is not carried.
    assert_eq!(
        placed_msg.headers,
        headers(&[
            ("id", &placed_id.to_string()),
            ("event_type", "OrderPlaced"),
            ("aggregate_type", "order"),
            ("event_version", "1"),
        ])
    );
    assert_eq!(
        shipped_msg.header("id"),
        Some(shipped_id.to_string().as_str())
    );
    assert_eq!(shipped_msg.header("event_version"), Some("2"));
    assert_eq!(
        placed_msg.partition, shipped_msg.partition,
        "one aggregate, one partition"
    );

    // The value of a hand-written row is the stored JSON, byte for byte.
    let stored: String =
        f.db.query_one_raw(Statement::from_string(
            DbBackend::Postgres,
            format!("SELECT payload::text FROM outbox WHERE id = '{invoice_id}'"),
        ))
        .await
        .unwrap()
        .unwrap()
        .try_get_by_index(0)
        .unwrap();
    let invoice = by_key(&received, "inv-9");
    assert_eq!(invoice.len(), 1);
    assert_eq!(invoice[0].topic, invoice_topic);
    assert_eq!(invoice[0].payload, stored.as_bytes());
    // Difference: the `topic` column is ignored; the router routes by aggregate type only.
    assert_eq!(by_key(&received, "inv-10")[0].topic, invoice_topic);

    // The same message, read by an independent client.
    let output = Command::new("kcat")
        .args(["-C", "-b", &brokers(), "-t", &invoice_topic])
        .args(["-o", "beginning", "-e", "-q", "-f", "%k\t%s\t%h\n"])
        .output()
        .expect("kcat (scripts/setup installs it)");
    assert!(
        output.status.success(),
        "kcat failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let lines = String::from_utf8(output.stdout).unwrap();
    let line = lines
        .lines()
        .find(|line| line.starts_with("inv-9\t"))
        .expect("kcat read inv-9");
    assert_eq!(
        line,
        format!(
            "inv-9\t{stored}\tid={invoice_id},event_type=InvoiceIssued,aggregate_type=invoice,event_version=4"
        )
    );

    // The consumer loop and the inbox take Debezium's messages unchanged.
    let options = ConsumerOptions::new(format!("{}-billing", f.prefix))
        .backoff(Duration::from_millis(20), Duration::from_millis(200));
    let consumer = KafkaConsumer::new(&brokers(), &[&order_topic], options).unwrap();
    let mut progress = consumer.progress();
    let stop = async move {
        let _ = tokio::time::timeout(
            Duration::from_secs(60),
            progress.wait_for(|c: &Consumed| c.applied + c.duplicates + c.dead_lettered >= 2),
        )
        .await;
    };
    let handler = seaorm_outbox::consumer::handler(|envelope, txn| Box::pin(apply(envelope, txn)));
    let consumed = consumer.run(&f.db, handler, stop).await.unwrap();
    assert_eq!(
        (
            consumed.applied,
            consumed.duplicates,
            consumed.dead_lettered
        ),
        (2, 0, 0)
    );
    assert_eq!(
        f.scalar(&format!(
            "SELECT count(*) FROM effects WHERE event_id IN ('{placed_id}', '{shipped_id}')"
        ))
        .await,
        2
    );
    drop(connector);
}
