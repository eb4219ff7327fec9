//! The sinks beyond Kafka and Pulsar (NATS JetStream, RabbitMQ, SQS): each raw client's limit
//! and the relay binary draining the same backlog into the same server, in one run.
//!
//! The raw clients send as the sinks do: NATS publishes with headers and `Nats-Msg-Id`, windows
//! of `batch` messages, acknowledgements awaited per window; RabbitMQ publishes persistent,
//! mandatory messages on a confirming channel, windows of `batch`, confirms awaited per window;
//! SQS sends batches of ten to a FIFO queue (group id and deduplication id), as many batches in
//! flight as the sink's lanes. The relay is the binary, its drain timed from its start to the
//! last row marked. Beside them, the same binary with the stdout sink (to /dev/null): the relay's
//! own limit on this database, which no broker can raise.

use crate::setup;
use aws_sdk_sqs::types::{MessageAttributeValue, QueueAttributeName, SendMessageBatchRequestEntry};
use futures::StreamExt;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection, ConnectionProperties};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use uuid::Uuid;

/// One sink's raw limit and the relay's drain through it.
#[derive(Debug, Clone)]
pub struct SinkRow {
    /// The sink, as `--sink` names it.
    pub sink: &'static str,
    /// The server measured on.
    pub server: &'static str,
    pub events: usize,
    pub raw: f64,
    pub relay: f64,
}

impl SinkRow {
    /// The relay's drain against the lower of the raw client's limit and the relay's own
    /// (`no_broker`, the stdout sink's drain).
    pub fn ratio_to_limit(&self, no_broker: f64) -> f64 {
        self.relay / self.raw.min(no_broker)
    }
}

/// Where the servers are, from `scripts/services`' environment.
pub struct Servers {
    pub nats_url: String,
    pub nats_token: String,
    pub rabbitmq_url: String,
    pub sqs_url: String,
}

impl Servers {
    /// The servers `scripts/bench` started, or a message naming what is missing.
    pub fn from_env() -> Servers {
        let var = |name: &str| {
            std::env::var(name).unwrap_or_else(|_| {
                panic!(
                    "the sinks part needs {name} (scripts/bench starts NATS, RabbitMQ, ElasticMQ)"
                )
            })
        };
        Servers {
            nats_url: var("NATS_URL"),
            nats_token: var("OUTBOX_NATS_TOKEN"),
            rabbitmq_url: var("RABBITMQ_URL"),
            sqs_url: var("OUTBOX_ELASTICMQ_URL"),
        }
    }
}

/// Each sink's raw limit and the relay's drain, `events` over `aggregates` (SQS: a quarter of
/// them, ElasticMQ being far slower than the others).
pub async fn measure(
    relay_bin: &Path,
    db: &str,
    servers: &Servers,
    events: usize,
    aggregates: usize,
    batch: usize,
) -> Measured {
    eprintln!("  no broker (stdout)...");
    let sink = ["--sink", "stdout"];
    let no_broker = relay_drain(
        relay_bin,
        db,
        &sink,
        "bench.{aggregate_type}",
        events,
        aggregates,
        batch,
    )
    .await;
    let mut rows = Vec::new();
    eprintln!("  NATS JetStream...");
    let raw = nats_raw(servers, events, aggregates, batch).await;
    let relay = nats_relay(relay_bin, db, servers, events, aggregates, batch).await;
    rows.push(SinkRow {
        sink: "nats",
        server: "nats-server (JetStream, file storage)",
        events,
        raw,
        relay,
    });
    eprintln!("  RabbitMQ...");
    let raw = rabbitmq_raw(servers, events, aggregates, batch).await;
    let relay = rabbitmq_relay(relay_bin, db, servers, events, aggregates, batch).await;
    rows.push(SinkRow {
        sink: "rabbitmq",
        server: "RabbitMQ (durable queue, publisher confirms)",
        events,
        raw,
        relay,
    });
    eprintln!("  SQS...");
    let events = (events / 4).max(1);
    let raw = sqs_raw(servers, events, aggregates).await;
    let relay = sqs_relay(relay_bin, db, servers, events, aggregates, batch).await;
    rows.push(SinkRow {
        sink: "sqs",
        server: "ElasticMQ (FIFO queue; not SQS's performance)",
        events,
        raw,
        relay,
    });
    Measured { no_broker, rows }
}

/// The part's results: the relay's own limit, and each sink's row.
#[derive(Debug, Clone, Default)]
pub struct Measured {
    /// Events/s of the relay binary with the stdout sink.
    pub no_broker: f64,
    pub rows: Vec<SinkRow>,
}

/// A payload of about the relay's size.
fn payload() -> Vec<u8> {
    "x".repeat(200).into_bytes()
}

async fn nats_context(servers: &Servers) -> async_nats::jetstream::Context {
    let client = async_nats::ConnectOptions::with_token(servers.nats_token.clone())
        .connect(servers.nats_url.as_str())
        .await
        .expect("connect to NATS");
    async_nats::jetstream::new(client)
}

/// A JetStream stream taking `<prefix>.>`.
async fn nats_stream(context: &async_nats::jetstream::Context, prefix: &str) {
    context
        .create_stream(async_nats::jetstream::stream::Config {
            name: prefix.to_owned(),
            subjects: vec![format!("{prefix}.>")],
            ..Default::default()
        })
        .await
        .expect("create a JetStream stream");
}

async fn nats_raw(servers: &Servers, events: usize, aggregates: usize, batch: usize) -> f64 {
    let context = nats_context(servers).await;
    let prefix = format!("bench_nats_raw_{}", Uuid::now_v7().simple());
    nats_stream(&context, &prefix).await;
    let subject = format!("{prefix}.order");
    let payload = payload();
    let started = Instant::now();
    for window in (0..events).collect::<Vec<_>>().chunks(batch) {
        let mut acks = Vec::with_capacity(window.len());
        for &g in window {
            let mut headers = async_nats::HeaderMap::new();
            headers.insert("aggregate_id", format!("agg-{}", g % aggregates).as_str());
            let message = async_nats::jetstream::message::PublishMessage::build()
                .payload(payload.clone().into())
                .headers(headers)
                .message_id(Uuid::now_v7().to_string());
            acks.push(
                context
                    .send_publish(subject.clone(), message)
                    .await
                    .expect("publish"),
            );
        }
        for ack in acks {
            ack.await.expect("JetStream ack");
        }
    }
    events as f64 / started.elapsed().as_secs_f64()
}

async fn nats_relay(
    relay_bin: &Path,
    db: &str,
    servers: &Servers,
    events: usize,
    aggregates: usize,
    batch: usize,
) -> f64 {
    let context = nats_context(servers).await;
    let prefix = format!("bench_nats_{}", Uuid::now_v7().simple());
    nats_stream(&context, &prefix).await;
    let sink = [
        "--sink",
        "nats",
        "--nats-url",
        &servers.nats_url,
        "--nats-token",
        &servers.nats_token,
    ];
    relay_drain(
        relay_bin,
        db,
        &sink,
        &format!("{prefix}.{{aggregate_type}}"),
        events,
        aggregates,
        batch,
    )
    .await
}

/// A connection, and a confirming channel with the durable queue `queue` declared.
async fn rabbitmq_channel(servers: &Servers, queue: &str) -> (Connection, lapin::Channel) {
    let connection = Connection::connect(&servers.rabbitmq_url, ConnectionProperties::default())
        .await
        .expect("connect to RabbitMQ");
    let channel = connection.create_channel().await.expect("a channel");
    channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                durable: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("declare the queue");
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("publisher confirms");
    (connection, channel)
}

/// Deletes `queue` and what it holds, so that runs do not fill the broker's disk.
async fn rabbitmq_delete(channel: &lapin::Channel, queue: &str) {
    let _ = channel
        .queue_delete(queue.into(), lapin::options::QueueDeleteOptions::default())
        .await;
}

async fn rabbitmq_raw(servers: &Servers, events: usize, aggregates: usize, batch: usize) -> f64 {
    let queue = format!("bench-rabbitmq-raw-{}.order", Uuid::now_v7().simple());
    let (_connection, channel) = rabbitmq_channel(servers, &queue).await;
    let payload = payload();
    let started = Instant::now();
    for window in (0..events).collect::<Vec<_>>().chunks(batch) {
        let mut confirms = Vec::with_capacity(window.len());
        for &g in window {
            let mut headers = FieldTable::default();
            headers.insert(
                "aggregate_id".into(),
                lapin::types::AMQPValue::LongString(format!("agg-{}", g % aggregates).into()),
            );
            let properties = BasicProperties::default()
                .with_message_id(Uuid::now_v7().to_string().into())
                .with_delivery_mode(2)
                .with_content_type("application/json".into())
                .with_headers(headers);
            let options = BasicPublishOptions {
                mandatory: true,
                ..BasicPublishOptions::default()
            };
            confirms.push(
                channel
                    .basic_publish(
                        "".into(),
                        queue.as_str().into(),
                        options,
                        &payload,
                        properties,
                    )
                    .await
                    .expect("publish"),
            );
        }
        for confirm in confirms {
            assert!(
                confirm.await.expect("confirm").is_ack(),
                "the broker nacked"
            );
        }
    }
    let rate = events as f64 / started.elapsed().as_secs_f64();
    rabbitmq_delete(&channel, &queue).await;
    rate
}

async fn rabbitmq_relay(
    relay_bin: &Path,
    db: &str,
    servers: &Servers,
    events: usize,
    aggregates: usize,
    batch: usize,
) -> f64 {
    let prefix = format!("bench-rabbitmq-{}", Uuid::now_v7().simple());
    let queue = format!("{prefix}.order");
    let (_connection, channel) = rabbitmq_channel(servers, &queue).await;
    let sink = [
        "--sink",
        "rabbitmq",
        "--rabbitmq-url",
        &servers.rabbitmq_url,
    ];
    let template = format!("{prefix}.{{aggregate_type}}");
    let rate = relay_drain(relay_bin, db, &sink, &template, events, aggregates, batch).await;
    rabbitmq_delete(&channel, &queue).await;
    rate
}

/// An SQS client on the server, with the AWS chain's credentials (scripts/bench sets them).
async fn sqs_client(servers: &Servers) -> aws_sdk_sqs::Client {
    let config = aws_config::defaults(aws_config::BehaviorVersion::latest())
        .endpoint_url(servers.sqs_url.as_str())
        .load()
        .await;
    aws_sdk_sqs::Client::new(&config)
}

/// A FIFO queue named `name`; its URL.
async fn sqs_queue(client: &aws_sdk_sqs::Client, name: &str) -> String {
    client
        .create_queue()
        .queue_name(name)
        .attributes(QueueAttributeName::FifoQueue, "true")
        .send()
        .await
        .expect("create an SQS queue")
        .queue_url
        .expect("the queue's URL")
}

/// The sink's lanes: batches in flight at once to one queue.
const SQS_LANES: usize = 16;

async fn sqs_raw(servers: &Servers, events: usize, aggregates: usize) -> f64 {
    let client = sqs_client(servers).await;
    let url = sqs_queue(
        &client,
        &format!("bench-sqs-raw-{}.fifo", Uuid::now_v7().simple()),
    )
    .await;
    let body = String::from_utf8(payload()).unwrap();
    let batches: Vec<Vec<usize>> = (0..events)
        .collect::<Vec<_>>()
        .chunks(10)
        .map(<[usize]>::to_vec)
        .collect();
    let started = Instant::now();
    futures::stream::iter(batches)
        .map(|batch| {
            let (client, url, body) = (&client, &url, &body);
            async move {
                let entries = batch.iter().enumerate().map(|(i, &g)| {
                    let aggregate = format!("agg-{}", g % aggregates);
                    let attribute = MessageAttributeValue::builder()
                        .data_type("String")
                        .string_value(&aggregate)
                        .build()
                        .unwrap();
                    SendMessageBatchRequestEntry::builder()
                        .id(i.to_string())
                        .message_body(body)
                        .message_attributes("aggregate_id", attribute)
                        .message_group_id(aggregate)
                        .message_deduplication_id(Uuid::now_v7().to_string())
                        .build()
                        .unwrap()
                });
                let answer = client
                    .send_message_batch()
                    .queue_url(url)
                    .set_entries(Some(entries.collect()))
                    .send()
                    .await
                    .expect("send a batch");
                assert!(
                    answer.failed.is_empty(),
                    "entries failed: {:?}",
                    answer.failed
                );
            }
        })
        .buffer_unordered(SQS_LANES)
        .collect::<Vec<()>>()
        .await;
    let rate = events as f64 / started.elapsed().as_secs_f64();
    let _ = client.delete_queue().queue_url(url).send().await;
    rate
}

async fn sqs_relay(
    relay_bin: &Path,
    db: &str,
    servers: &Servers,
    events: usize,
    aggregates: usize,
    batch: usize,
) -> f64 {
    let client = sqs_client(servers).await;
    let prefix = format!("bench-sqs-{}", Uuid::now_v7().simple());
    let url = sqs_queue(&client, &format!("{prefix}-order.fifo")).await;
    let sink = ["--sink", "sqs", "--aws-endpoint-url", &servers.sqs_url];
    let template = format!("{prefix}-{{aggregate_type}}.fifo");
    let rate = relay_drain(relay_bin, db, &sink, &template, events, aggregates, batch).await;
    let _ = client.delete_queue().queue_url(url).send().await;
    rate
}

/// The relay binary drains `events` (mark mode, batch `batch`) through `sink`: events/s from its
/// start to the last row marked.
async fn relay_drain(
    relay_bin: &Path,
    base_url: &str,
    sink: &[&str],
    topic_template: &str,
    events: usize,
    aggregates: usize,
    batch: usize,
) -> f64 {
    let db = setup::fresh(base_url).await;
    setup::fill(&db, events, aggregates).await;
    let started = Instant::now();
    let mut child = Command::new(relay_bin)
        .args([
            "run",
            "--database-url",
            &db.url,
            "--http-addr",
            "off",
            "--retention",
            "off",
        ])
        .args([
            "--topic-template",
            topic_template,
            "--batch-size",
            &batch.to_string(),
        ])
        .args(sink)
        .env("OUTBOX_LOG", "warn")
        .stdout(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("start {}: {e}", relay_bin.display()));
    let drained = tokio::time::timeout(Duration::from_secs(900), setup::wait_drained(&db)).await;
    let elapsed = started.elapsed();
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    child.wait().unwrap();
    drained.unwrap_or_else(|_| panic!("the relay ({}) did not drain in 15 minutes", sink[1]));
    events as f64 / elapsed.as_secs_f64()
}
