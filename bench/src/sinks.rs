//! The sinks beyond Kafka and Pulsar (NATS JetStream, RabbitMQ, SQS): each raw client's limit
//! and the relay binary draining the same backlog into the same server, in one run.
//!
//! The raw clients send as the sinks do, with the same headers (the relay's contract and
//! `aggregate_id`): NATS publishes with headers and `Nats-Msg-Id`, windows
//! of `batch` messages, acknowledgements awaited per window; RabbitMQ publishes persistent,
//! mandatory messages on a confirming channel, windows of `batch`, confirms awaited per window;
//! SQS sends batches of ten to a FIFO queue (group id and deduplication id), as many batches in
//! flight as the sink's lanes. The relay is the binary, its drain timed from its start to the
//! last row marked, in mark mode and in delete mode (which costs PostgreSQL less). Beside them,
//! the same binary with the stdout sink (to /dev/null): the relay's own limit on this database,
//! which no broker can raise. Each run's CPU per event is split between the publisher (the raw
//! client or the relay), PostgreSQL and the broker, and summed into the cores it kept busy: on
//! two cores, a run near two is bound by the CPU the three share.

use crate::processes::{PerEvent, Processes};
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

/// One run: its rate and where its CPU went.
#[derive(Debug, Clone, Copy, Default)]
pub struct Run {
    /// Messages (raw client) or events (relay) per second.
    pub rate: f64,
    pub cpu: PerEvent,
}

impl Run {
    /// The cores the publisher, PostgreSQL and the broker kept busy.
    pub fn cores_busy(&self) -> f64 {
        self.cpu.cores_busy(self.rate)
    }
}

/// One sink's raw limit and the relay's drains through it.
#[derive(Debug, Clone)]
pub struct SinkRow {
    /// The sink, as `--sink` names it.
    pub sink: &'static str,
    /// The server measured on.
    pub server: &'static str,
    pub events: usize,
    pub raw: Run,
    /// The relay in mark mode (the default).
    pub relay: Run,
    /// The relay in delete mode.
    pub relay_delete: Run,
}

impl SinkRow {
    /// The relay's drain (mark mode) against the lower of the raw client's limit and the relay's
    /// own (`no_broker`, the stdout sink's drain).
    pub fn ratio_to_limit(&self, no_broker: f64) -> f64 {
        self.relay.rate / self.raw.rate.min(no_broker)
    }
}

/// Where the servers are, from `scripts/services`' environment, and their processes.
pub struct Servers {
    pub nats_url: String,
    pub nats_token: String,
    pub nats_pid: Option<u32>,
    pub rabbitmq_url: String,
    pub rabbitmq_pid: Option<u32>,
    pub sqs_url: String,
    pub sqs_pid: Option<u32>,
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
        let pid = |name: &str| std::env::var(name).ok().and_then(|p| p.parse().ok());
        Servers {
            nats_url: var("NATS_URL"),
            nats_token: var("OUTBOX_NATS_TOKEN"),
            nats_pid: pid("OUTBOX_NATS_PID"),
            rabbitmq_url: var("RABBITMQ_URL"),
            rabbitmq_pid: pid("OUTBOX_RABBITMQ_PID"),
            sqs_url: var("OUTBOX_ELASTICMQ_URL"),
            sqs_pid: pid("OUTBOX_ELASTICMQ_PID"),
        }
    }
}

/// Each sink's raw limit and the relay's drains, `events` over `aggregates` (SQS: a quarter of
/// them, ElasticMQ being far slower than the others).
pub async fn measure(
    relay_bin: &Path,
    db: &str,
    servers: &Servers,
    events: usize,
    aggregates: usize,
    batch: usize,
) -> Measured {
    let drain = Drain {
        relay_bin,
        db,
        aggregates,
        batch,
    };
    let pool = sqlx::PgPool::connect(db)
        .await
        .expect("connect to PostgreSQL");
    let postmaster = crate::processes::postmaster(&pool).await;
    let with = |broker| Processes { postmaster, broker };
    eprintln!("  no broker (stdout)...");
    let sink = ["--sink", "stdout"];
    let no_broker = drain
        .run(&sink, "bench.{aggregate_type}", events, "mark", &with(None))
        .await;
    let mut rows = Vec::new();
    eprintln!("  NATS JetStream...");
    let nats = with(servers.nats_pid);
    rows.push(SinkRow {
        sink: "nats",
        server: "nats-server (JetStream, file storage)",
        events,
        raw: nats_raw(servers, events, aggregates, batch, &nats).await,
        relay: nats_relay(&drain, servers, events, "mark", &nats).await,
        relay_delete: nats_relay(&drain, servers, events, "delete", &nats).await,
    });
    eprintln!("  RabbitMQ...");
    let rabbitmq = with(servers.rabbitmq_pid);
    rows.push(SinkRow {
        sink: "rabbitmq",
        server: "RabbitMQ (durable queue, publisher confirms)",
        events,
        raw: rabbitmq_raw(servers, events, aggregates, batch, &rabbitmq).await,
        relay: rabbitmq_relay(&drain, servers, events, "mark", &rabbitmq).await,
        relay_delete: rabbitmq_relay(&drain, servers, events, "delete", &rabbitmq).await,
    });
    eprintln!("  SQS...");
    let events = (events / 4).max(1);
    let sqs = with(servers.sqs_pid);
    rows.push(SinkRow {
        sink: "sqs",
        server: "ElasticMQ (FIFO queue; not SQS's performance)",
        events,
        raw: sqs_raw(servers, events, aggregates, &sqs).await,
        relay: sqs_relay(&drain, servers, events, "mark", &sqs).await,
        relay_delete: sqs_relay(&drain, servers, events, "delete", &sqs).await,
    });
    Measured { no_broker, rows }
}

/// `sending` (`events` messages) run by this process: its rate, and the CPU it, PostgreSQL and
/// the broker used.
async fn timed(processes: &Processes, events: usize, sending: impl Future<Output = ()>) -> Run {
    let me = std::process::id();
    let before = processes.cpu(me);
    let started = Instant::now();
    sending.await;
    let rate = events as f64 / started.elapsed().as_secs_f64();
    Run {
        rate,
        cpu: PerEvent::between(before, processes.cpu(me), events),
    }
}

/// The part's results: the relay's own limit, and each sink's row.
#[derive(Debug, Clone, Default)]
pub struct Measured {
    /// The relay binary with the stdout sink.
    pub no_broker: Run,
    pub rows: Vec<SinkRow>,
}

/// A payload of about the relay's size.
fn payload() -> Vec<u8> {
    "x".repeat(200).into_bytes()
}

/// The headers the sinks send with the `g`th event (the relay's contract and `aggregate_id`), so
/// that the broker stores as much per message for the raw client as for the relay.
fn headers(g: usize, aggregates: usize) -> [(&'static str, String); 5] {
    [
        ("id", Uuid::now_v7().to_string()),
        ("event_type", "OrderPlaced".to_owned()),
        ("aggregate_type", "order".to_owned()),
        ("event_version", "1".to_owned()),
        ("aggregate_id", format!("agg-{}", g % aggregates)),
    ]
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

async fn nats_raw(
    servers: &Servers,
    events: usize,
    aggregates: usize,
    batch: usize,
    processes: &Processes,
) -> Run {
    let context = nats_context(servers).await;
    let prefix = format!("bench_nats_raw_{}", Uuid::now_v7().simple());
    nats_stream(&context, &prefix).await;
    let subject = format!("{prefix}.order");
    let payload = payload();
    let sending = async {
        for window in (0..events).collect::<Vec<_>>().chunks(batch) {
            let mut acks = Vec::with_capacity(window.len());
            for &g in window {
                let mut map = async_nats::HeaderMap::new();
                let headers = headers(g, aggregates);
                for (name, value) in &headers {
                    map.insert(*name, value.as_str());
                }
                let message = async_nats::jetstream::message::PublishMessage::build()
                    .payload(payload.clone().into())
                    .headers(map)
                    .message_id(headers[0].1.clone());
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
    };
    timed(processes, events, sending).await
}

async fn nats_relay(
    drain: &Drain<'_>,
    servers: &Servers,
    events: usize,
    mode: &str,
    processes: &Processes,
) -> Run {
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
    let template = format!("{prefix}.{{aggregate_type}}");
    let run = drain.run(&sink, &template, events, mode, processes).await;
    let _ = context.delete_stream(&prefix).await;
    run
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

async fn rabbitmq_raw(
    servers: &Servers,
    events: usize,
    aggregates: usize,
    batch: usize,
    processes: &Processes,
) -> Run {
    let queue = format!("bench-rabbitmq-raw-{}.order", Uuid::now_v7().simple());
    let (_connection, channel) = rabbitmq_channel(servers, &queue).await;
    let payload = payload();
    let sending = async {
        for window in (0..events).collect::<Vec<_>>().chunks(batch) {
            let mut confirms = Vec::with_capacity(window.len());
            for &g in window {
                let headers = headers(g, aggregates);
                let mut table = FieldTable::default();
                for (name, value) in &headers {
                    table.insert(
                        (*name).into(),
                        lapin::types::AMQPValue::LongString(value.as_str().into()),
                    );
                }
                let properties = BasicProperties::default()
                    .with_message_id(headers[0].1.as_str().into())
                    .with_delivery_mode(2)
                    .with_content_type("application/json".into())
                    .with_type("OrderPlaced".into())
                    .with_headers(table);
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
    };
    let run = timed(processes, events, sending).await;
    rabbitmq_delete(&channel, &queue).await;
    run
}

async fn rabbitmq_relay(
    drain: &Drain<'_>,
    servers: &Servers,
    events: usize,
    mode: &str,
    processes: &Processes,
) -> Run {
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
    let run = drain.run(&sink, &template, events, mode, processes).await;
    rabbitmq_delete(&channel, &queue).await;
    run
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

async fn sqs_raw(
    servers: &Servers,
    events: usize,
    aggregates: usize,
    processes: &Processes,
) -> Run {
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
    let sending = futures::stream::iter(batches)
        .map(|batch| {
            let (client, url, body) = (&client, &url, &body);
            async move {
                let entries = batch.iter().enumerate().map(|(i, &g)| {
                    let headers = headers(g, aggregates);
                    let mut entry = SendMessageBatchRequestEntry::builder()
                        .id(i.to_string())
                        .message_body(body)
                        .message_group_id(&headers[4].1)
                        .message_deduplication_id(&headers[0].1);
                    for (name, value) in headers {
                        let attribute = MessageAttributeValue::builder()
                            .data_type("String")
                            .string_value(value)
                            .build()
                            .unwrap();
                        entry = entry.message_attributes(name, attribute);
                    }
                    entry.build().unwrap()
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
        .collect::<()>();
    let run = timed(processes, events, sending).await;
    let _ = client.delete_queue().queue_url(url).send().await;
    run
}

async fn sqs_relay(
    drain: &Drain<'_>,
    servers: &Servers,
    events: usize,
    mode: &str,
    processes: &Processes,
) -> Run {
    let client = sqs_client(servers).await;
    let prefix = format!("bench-sqs-{}", Uuid::now_v7().simple());
    let url = sqs_queue(&client, &format!("{prefix}-order.fifo")).await;
    let sink = ["--sink", "sqs", "--aws-endpoint-url", &servers.sqs_url];
    let template = format!("{prefix}-{{aggregate_type}}.fifo");
    let run = drain.run(&sink, &template, events, mode, processes).await;
    let _ = client.delete_queue().queue_url(url).send().await;
    run
}

/// The relay binary draining fresh backlogs of `aggregates` aggregates on the database `db`, in
/// batches of `batch`.
struct Drain<'a> {
    relay_bin: &'a Path,
    db: &'a str,
    aggregates: usize,
    batch: usize,
}

impl Drain<'_> {
    /// The relay drains `events` in `mode` (mark or delete) through `sink`: events/s from its
    /// start to the last row settled, and the CPU it, PostgreSQL and the broker used.
    async fn run(
        &self,
        sink: &[&str],
        topic_template: &str,
        events: usize,
        mode: &str,
        processes: &Processes,
    ) -> Run {
        let db = setup::fresh(self.db).await;
        setup::fill(&db, events, self.aggregates).await;
        let started = Instant::now();
        let mut child = Command::new(self.relay_bin)
            .args([
                "run",
                "--database-url",
                &db.url,
                "--http-addr",
                "off",
                "--retention",
                "off",
                "--mode",
                mode,
            ])
            .args([
                "--topic-template",
                topic_template,
                "--batch-size",
                &self.batch.to_string(),
            ])
            .args(sink)
            .env("OUTBOX_LOG", "warn")
            .stdout(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}", self.relay_bin.display()));
        let before = processes.cpu(child.id());
        let drained =
            tokio::time::timeout(Duration::from_secs(900), setup::wait_drained(&db)).await;
        let elapsed = started.elapsed();
        let after = processes.cpu(child.id());
        let _ = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status();
        child.wait().unwrap();
        drained.unwrap_or_else(|_| panic!("the relay ({}) did not drain in 15 minutes", sink[1]));
        Run {
            rate: events as f64 / elapsed.as_secs_f64(),
            cpu: PerEvent::between(before, after, events),
        }
    }
}
