//! `--format cloudevents`, end to end through the `outbox-relay` binary on real PostgreSQL, Kafka,
//! Pulsar, NATS, RabbitMQ, SQS (ElasticMQ), SNS (moto) and an HTTP receiver. What reaches Kafka,
//! Pulsar, SQS, SNS and the webhook's receiver is read back by the official CloudEvents SDK
//! (PyPI's `cloudevents`, Kafka and HTTP bindings; Pulsar's properties and SQS's attributes are
//! named as Kafka's headers) in binary and structured mode (structured by default on SQS and SNS);
//! on NATS and RabbitMQ the headers are named as their bindings name them. Each attribute is
//! checked against the row it came from.

mod common;

use common::Fixture;
use common::aws::{create_queue_on, create_topic_with_queue, elasticmq_url, receive_all};
use common::kafka::{Received, consume};
use common::nats::{create_stream, header, relay_args, stored};
use common::webhook::{Call, Receiver, ok_after};
use seaorm_outbox::sea_orm::{ConnectionTrait, DbBackend, Statement};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::io::Write;
use std::time::Duration;

const SOURCE: &str = "//shop.test/orders";

/// Records three orders of two aggregates, one with a `traceparent` header.
async fn record(f: &Fixture) {
    f.db.execute_unprepared(
        r#"INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, event_version, payload, headers)
           VALUES (gen_random_uuid(), 'order', 'o-1', 'OrderPlaced', 2, '{"order_id": "o-1", "n": 1}',
                   '{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}'),
                  (gen_random_uuid(), 'order', 'o-2', 'OrderPlaced', 2, '{"order_id": "o-2", "n": 2}', NULL),
                  (gen_random_uuid(), 'order', 'o-1', 'OrderShipped', 1, '{"order_id": "o-1", "n": 3}', NULL)"#,
    )
    .await
    .unwrap();
}

/// Each row's attributes as the relay must write them, by event id.
async fn expected(f: &Fixture) -> BTreeMap<String, Value> {
    let rows = f
        .db
        .query_all_raw(Statement::from_string(
            DbBackend::Postgres,
            "SELECT id::text AS id, aggregate_id, event_type, event_version::text AS version,
                    (extract(epoch FROM created_at) * 1000)::int8 AS created_ms, payload::text AS payload
             FROM outbox",
        ))
        .await
        .unwrap();
    rows.iter()
        .map(|r| {
            let id: String = r.try_get("", "id").unwrap();
            let created_ms: i64 = r.try_get("", "created_ms").unwrap();
            let time = chrono::DateTime::from_timestamp_millis(created_ms)
                .unwrap()
                .to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
            let payload: String = r.try_get("", "payload").unwrap();
            let event = json!({
                "specversion": "1.0",
                "id": id,
                "source": SOURCE,
                "type": r.try_get::<String>("", "event_type").unwrap(),
                "subject": r.try_get::<String>("", "aggregate_id").unwrap(),
                "time": time,
                "datacontenttype": "application/json",
                "eventversion": r.try_get::<String>("", "version").unwrap(),
                "aggregatetype": "order",
                "data": serde_json::from_str::<Value>(&payload).unwrap(),
            });
            (id, event)
        })
        .collect()
}

/// The relay's arguments for CloudEvents from [`SOURCE`] in `mode` (binary or structured).
fn cloudevents_in(mode: &str) -> [&str; 6] {
    [
        "--format",
        "cloudevents",
        "--cloudevents-source",
        SOURCE,
        "--cloudevents-mode",
        mode,
    ]
}

/// Runs the relay binary with `format` until the fixture's outbox is drained.
async fn drain_with(f: &Fixture, sink: &[&str], format: &[&str]) {
    let mut relay = f.spawn_relay_to(sink, format);
    f.wait_until_drained(Duration::from_secs(60)).await;
    assert_eq!(common::terminate(&mut relay), Some(0), "{}", relay.log());
}

/// How the official SDK reads a message: the Kafka binding's `from_binary` or `from_structured`,
/// or the HTTP binding's `from_http` (either mode, which it tells by the content type).
#[derive(Clone, Copy, Debug)]
enum Binding {
    KafkaBinary,
    KafkaStructured,
    Http,
}

/// A message as the SDK is handed it: headers, key (Kafka) and body.
struct Message {
    headers: Vec<(String, String)>,
    key: Option<String>,
    body: Vec<u8>,
}

impl From<&Received> for Message {
    fn from(m: &Received) -> Message {
        Message {
            headers: m.headers.clone(),
            key: Some(m.key.clone()),
            body: m.payload.clone(),
        }
    }
}

impl From<&common::pulsar::Received> for Message {
    /// Pulsar has no CloudEvents binding: its properties are named as Kafka's headers, which the
    /// SDK's Kafka binding reads.
    fn from(m: &common::pulsar::Received) -> Message {
        Message {
            headers: m.properties.clone(),
            key: Some(m.key.clone()),
            body: m.payload.clone(),
        }
    }
}

impl From<&common::aws::Received> for Message {
    /// SQS and SNS have no CloudEvents binding: their message attributes are named as Kafka's
    /// headers (binary mode), or the body is the event (structured mode, which HTTP's binding
    /// reads by its `content-type`).
    fn from(m: &common::aws::Received) -> Message {
        Message {
            headers: m.attributes.clone().into_iter().collect(),
            key: None,
            body: m.body.clone().into_bytes(),
        }
    }
}

impl From<&Call> for Message {
    fn from(call: &Call) -> Message {
        Message {
            headers: call.headers.clone(),
            key: None,
            body: call.body.clone(),
        }
    }
}

/// The CloudEvents the official SDK (PyPI's `cloudevents`) reads from `messages` through
/// `binding`: each event's attributes and `data`.
fn read_by_the_sdk(messages: impl IntoIterator<Item = Message>, binding: Binding) -> Vec<Value> {
    let python = std::env::var("OUTBOX_TEST_PYTHON").unwrap_or_else(|_| {
        panic!(
            "OUTBOX_TEST_PYTHON is not set: run `scripts/test`, which makes a Python with \
             PyPI's cloudevents"
        )
    });
    let script = r#"
import json, sys
from cloudevents.http import from_http
from cloudevents.kafka import KafkaMessage, from_binary, from_structured
binding = sys.argv[1]
for line in sys.stdin:
    m = json.loads(line)
    body = m["body"].encode()
    if binding == "Http":
        event = from_http(dict(m["headers"]), body)
    elif binding == "KafkaStructured":
        # The event is the payload alone (the SDK would take every header for an attribute,
        # `content-type` for `datacontenttype`).
        event = from_structured(KafkaMessage(headers={}, key=m["key"], value=body))
    else:
        headers = {n: v.encode() for n, v in m["headers"]}
        event = from_binary(KafkaMessage(headers=headers, key=m["key"], value=body))
    attributes = dict(event.get_attributes())
    attributes["data"] = event.data
    print(json.dumps(attributes, default=str))
"#;
    let mut child = std::process::Command::new(&python)
        .args(["-c", script, &format!("{binding:?}")])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run Python");
    let mut stdin = child.stdin.take().unwrap();
    for m in messages {
        let line = json!({
            "headers": m.headers,
            "key": m.key,
            "body": String::from_utf8(m.body).unwrap(),
        });
        writeln!(stdin, "{line}").unwrap();
    }
    drop(stdin);
    let output = child.wait_with_output().unwrap();
    assert!(
        output.status.success(),
        "the CloudEvents SDK refused the messages: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Each event the SDK read is its row's, attribute by attribute.
fn assert_events(mut read: Vec<Value>, expected: &BTreeMap<String, Value>) {
    assert_eq!(read.len(), expected.len(), "{read:?}");
    for event in &mut read {
        // The Kafka binding's extension for the message key: the aggregate id.
        if let Some(key) = event.as_object_mut().unwrap().remove("partitionkey") {
            assert_eq!(key, event["subject"]);
        }
        let id = event["id"].as_str().expect("an id").to_owned();
        assert_eq!(event, &expected[&id]);
    }
}

#[tokio::test]
async fn binary_mode_on_kafka_is_read_by_the_cloudevents_sdk() {
    let f = Fixture::new().await;
    record(&f).await;
    let expected = expected(&f).await;
    let format = ["--format", "cloudevents", "--cloudevents-source", SOURCE];
    let brokers = common::kafka::brokers();
    let sink = ["--kafka-brokers", brokers.as_str()];
    drain_with(&f, &sink, &format).await;
    let received = consume(&[&f.topic("order")], 3, Duration::from_secs(60)).await;
    let traced = received
        .iter()
        .find(|m| m.header("ce_type") == Some("OrderPlaced") && m.key == "o-1")
        .expect("o-1's first event");
    assert_eq!(
        traced.header("traceparent"),
        Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
        "the application's headers are kept"
    );
    assert_eq!(traced.header("event_type"), None, "the contract's give way");
    assert_events(
        read_by_the_sdk(received.iter().map(Message::from), Binding::KafkaBinary),
        &expected,
    );
}

#[tokio::test]
async fn structured_mode_on_kafka_is_read_by_the_cloudevents_sdk() {
    let f = Fixture::new().await;
    record(&f).await;
    let expected = expected(&f).await;
    let format = cloudevents_in("structured");
    let brokers = common::kafka::brokers();
    let sink = ["--kafka-brokers", brokers.as_str()];
    drain_with(&f, &sink, &format).await;
    let received = consume(&[&f.topic("order")], 3, Duration::from_secs(60)).await;
    for m in &received {
        assert_eq!(
            m.header("content-type"),
            Some("application/cloudevents+json")
        );
    }
    assert_events(
        read_by_the_sdk(received.iter().map(Message::from), Binding::KafkaStructured),
        &expected,
    );
}

#[tokio::test]
async fn binary_mode_on_nats_names_headers_as_its_binding_does() {
    let f = Fixture::new().await;
    let mut stream = create_stream(&f, vec![format!("{}.>", f.prefix)]).await;
    record(&f).await;
    let expected = expected(&f).await;
    let sink = relay_args();
    let sink: Vec<&str> = sink.iter().map(String::as_str).collect();
    let format = ["--format", "cloudevents", "--cloudevents-source", SOURCE];
    drain_with(&f, &sink, &format).await;
    let messages = stored(&mut stream).await;
    assert_eq!(messages.len(), 3);
    for m in &messages {
        let id = header(m, "ce-id").expect("a ce-id header");
        let want = &expected[id];
        for attribute in [
            "specversion",
            "id",
            "source",
            "type",
            "subject",
            "time",
            "eventversion",
            "aggregatetype",
        ] {
            assert_eq!(
                header(m, &format!("ce-{attribute}")),
                want[attribute].as_str(),
                "{attribute}"
            );
        }
        assert_eq!(header(m, "content-type"), Some("application/json"));
        let data: Value = serde_json::from_slice(&m.payload).unwrap();
        assert_eq!(data, want["data"]);
        assert_eq!(header(m, "id"), None, "the contract's header gives way");
    }
}

#[test]
fn cloudevents_without_a_source_and_a_source_without_cloudevents_are_usage_errors() {
    for (args, says) in [
        (
            &["--format", "cloudevents"][..],
            "--format cloudevents needs --cloudevents-source",
        ),
        (
            &["--cloudevents-mode", "structured"][..],
            "--cloudevents-source and --cloudevents-mode need --format cloudevents",
        ),
    ] {
        let output = common::relay_command()
            .args(["run", "--database-url", "postgres://u@127.0.0.1:1/db"])
            .args(["--sink", "stdout"])
            .args(args)
            .output()
            .unwrap();
        assert_eq!(output.status.code(), Some(2), "{args:?}");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains(says), "{args:?}: {stderr}");
        assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    }
}

#[tokio::test]
async fn binary_mode_on_rabbitmq_names_application_properties_as_its_binding_does() {
    use common::rabbitmq::{consume, declare_queue, open};
    let f = Fixture::new().await;
    let (_connection, channel) = open().await;
    let queue = f.topic("order");
    declare_queue(&channel, &queue, true).await;
    record(&f).await;
    let expected = expected(&f).await;
    let sink = common::rabbitmq::relay_args();
    let sink: Vec<&str> = sink.iter().map(String::as_str).collect();
    let format = ["--format", "cloudevents", "--cloudevents-source", SOURCE];
    drain_with(&f, &sink, &format).await;
    let received = consume(&channel, &queue, 3, Duration::from_secs(60)).await;
    assert_eq!(received.len(), 3);
    for m in &received {
        let id = m.header("cloudEvents_id").expect("a cloudEvents_id header");
        let want = &expected[id];
        for attribute in [
            "specversion",
            "id",
            "source",
            "type",
            "subject",
            "time",
            "eventversion",
            "aggregatetype",
        ] {
            assert_eq!(
                m.header(&format!("cloudEvents_{attribute}")),
                want[attribute].as_str(),
                "{attribute}"
            );
        }
        assert_eq!(m.content_type.as_deref(), Some("application/json"));
        assert_eq!(m.header("content-type"), None, "a property, not a header");
        assert_eq!(m.json(), want["data"]);
    }
}

#[tokio::test]
async fn binary_and_structured_mode_over_webhooks_are_read_by_the_cloudevents_sdk() {
    for mode in ["binary", "structured"] {
        let f = Fixture::new().await;
        record(&f).await;
        let expected = expected(&f).await;
        let receiver = Receiver::start(ok_after(Duration::ZERO)).await;
        let sink = common::webhook::relay_args(&receiver);
        let sink: Vec<&str> = sink.iter().map(String::as_str).collect();
        drain_with(&f, &sink, &cloudevents_in(mode)).await;
        let calls = receiver.delivered();
        let content_type = match mode {
            "binary" => "application/json",
            _ => "application/cloudevents+json",
        };
        for call in &calls {
            assert_eq!(call.header("content-type"), Some(content_type), "{mode}");
            assert!(call.header("webhook-signature").is_some(), "still signed");
        }
        assert_events(
            read_by_the_sdk(calls.iter().map(Message::from), Binding::Http),
            &expected,
        );
    }
}

#[tokio::test]
async fn binary_and_structured_mode_on_pulsar_are_read_by_the_cloudevents_sdk() {
    for (mode, binding) in [
        ("binary", Binding::KafkaBinary),
        ("structured", Binding::KafkaStructured),
    ] {
        let f = Fixture::new().await;
        record(&f).await;
        let expected = expected(&f).await;
        let url = common::pulsar::url();
        let sink = ["--sink", "pulsar", "--pulsar-url", &url];
        drain_with(&f, &sink, &cloudevents_in(mode)).await;
        let topic = common::pulsar::topic(&f.topic("order"));
        let received = common::pulsar::consume(&topic, 3, Duration::from_secs(60)).await;
        for m in &received {
            assert_eq!(m.key, m.ordering_key, "{mode}");
        }
        assert_events(
            read_by_the_sdk(received.iter().map(Message::from), binding),
            &expected,
        );
    }
}

/// The fixture with topics SQS and SNS take as names (no dots), FIFO.
fn named_for_aws(f: Fixture) -> Fixture {
    Fixture {
        template: format!("{}-{{aggregate_type}}.fifo", f.prefix),
        ..f
    }
}

const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

#[tokio::test]
async fn structured_mode_is_the_default_on_sqs_and_is_read_by_the_cloudevents_sdk() {
    let f = named_for_aws(Fixture::new().await);
    let queue = create_queue_on(&elasticmq_url(), &format!("{}-order.fifo", f.prefix));
    record(&f).await;
    let expected = expected(&f).await;
    let endpoint = elasticmq_url();
    let sink = ["--sink", "sqs", "--aws-endpoint-url", &endpoint];
    let format = ["--format", "cloudevents", "--cloudevents-source", SOURCE];
    drain_with(&f, &sink, &format).await;
    let received = receive_all(&queue);
    for m in &received {
        assert_eq!(
            m.attributes["content-type"], "application/cloudevents+json",
            "structured without --cloudevents-mode"
        );
    }
    assert!(
        received
            .iter()
            .any(|m| m.attributes.get("traceparent").map(String::as_str) == Some(TRACEPARENT)),
        "the application's header is kept"
    );
    assert_events(
        read_by_the_sdk(received.iter().map(Message::from), Binding::Http),
        &expected,
    );
}

#[tokio::test]
async fn binary_mode_on_sns_keeps_an_application_header_and_is_read_by_the_cloudevents_sdk() {
    let f = named_for_aws(Fixture::new().await);
    let topic = format!("{}-order.fifo", f.prefix);
    let (arn, queue) = create_topic_with_queue(&topic, &format!("{}-sub.fifo", f.prefix));
    let prefix = arn.trim_end_matches(&topic).to_owned();
    record(&f).await;
    let expected = expected(&f).await;
    let moto = common::aws::url();
    let sink = ["--sink", "sns", "--aws-endpoint-url", &moto];
    let mut format = cloudevents_in("binary").to_vec();
    format.extend(["--sns-topic-arn-prefix", &prefix]);
    drain_with(&f, &sink, &format).await;
    let received = receive_all(&queue);
    let traced = received
        .iter()
        .find(|m| m.attributes.contains_key("traceparent"))
        .expect("the event with an application header, not parked");
    assert_eq!(traced.attributes.len(), 10, "{:?}", traced.attributes);
    assert_eq!(traced.attributes["traceparent"], TRACEPARENT);
    assert_events(
        read_by_the_sdk(received.iter().map(Message::from), Binding::KafkaBinary),
        &expected,
    );
}
