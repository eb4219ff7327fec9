//! Reading what actually reached RabbitMQ, as a consumer would.
//!
//! The broker comes from `RABBITMQ_URL` (a URL with the test user's password), which
//! `scripts/services start rabbitmq` sets (`scripts/test` does).

use futures::StreamExt;
use lapin::options::{BasicConsumeOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection, ConnectionProperties};
use std::time::{Duration, Instant};

/// The test broker's URL, or a panic that says how to get it.
pub fn url() -> String {
    std::env::var("RABBITMQ_URL").expect(
        "RABBITMQ_URL is not set: start RabbitMQ with `scripts/services start rabbitmq` \
         (scripts/test does)",
    )
}

/// The test broker's AMQPS URL (the throwaway CA's certificate, for `localhost`).
pub fn tls_url() -> String {
    std::env::var("OUTBOX_RABBITMQ_TLS_URL")
        .expect("OUTBOX_RABBITMQ_TLS_URL is not set (scripts/services start rabbitmq)")
}

/// The test user's password (the tests grep outputs for it).
pub fn password() -> String {
    std::env::var("OUTBOX_RABBITMQ_PASSWORD")
        .expect("OUTBOX_RABBITMQ_PASSWORD is not set (scripts/services start rabbitmq)")
}

/// The relay binary's arguments to publish to the test broker's default exchange.
pub fn relay_args() -> Vec<String> {
    ["--sink", "rabbitmq", "--rabbitmq-url", &url()]
        .map(String::from)
        .to_vec()
}

/// A connection and a channel of the test's own.
pub async fn open() -> (Connection, Channel) {
    let connection = Connection::connect(&url(), ConnectionProperties::default())
        .await
        .expect("connect to RabbitMQ");
    let channel = connection.create_channel().await.expect("a channel");
    (connection, channel)
}

/// Declares a durable queue `name`; with `single_active`, only one of its consumers receives at a
/// time (`x-single-active-consumer`), which keeps each aggregate's order.
pub async fn declare_queue(channel: &Channel, name: &str, single_active: bool) {
    let mut arguments = FieldTable::default();
    if single_active {
        arguments.insert("x-single-active-consumer".into(), AMQPValue::Boolean(true));
    }
    channel
        .queue_declare(name.into(), QueueDeclareOptions::durable(), arguments)
        .await
        .expect("declare the queue");
}

/// A message as a consumer received it.
#[derive(Debug, Clone)]
pub struct Delivered {
    pub payload: Vec<u8>,
    pub message_id: Option<String>,
    pub kind: Option<String>,
    pub content_type: Option<String>,
    pub delivery_mode: Option<u8>,
    pub headers: Vec<(String, String)>,
}

impl Delivered {
    /// A header's value, if it is a string.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// The payload parsed as JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.payload).expect("a JSON payload")
    }
}

/// Consumes `queue` (acknowledging each message) until `expected` messages arrived and nothing
/// more comes for a moment (so duplicates are seen too), or panics after `timeout`.
pub async fn consume(
    channel: &Channel,
    queue: &str,
    expected: usize,
    timeout: Duration,
) -> Vec<Delivered> {
    let mut consumer = channel
        .basic_consume(
            queue.into(),
            format!("test-{}", seaorm_outbox::Uuid::now_v7().simple()).into(),
            BasicConsumeOptions {
                no_ack: true,
                ..BasicConsumeOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("consume the queue");
    let deadline = Instant::now() + timeout;
    let mut received = Vec::new();
    loop {
        let wait = if received.len() >= expected {
            Duration::from_millis(500)
        } else {
            deadline.saturating_duration_since(Instant::now())
        };
        match tokio::time::timeout(wait, consumer.next()).await {
            Ok(Some(delivery)) => received.push(delivered(delivery.expect("a delivery"))),
            Ok(None) => panic!("the consumer of {queue} ended"),
            Err(_) if received.len() >= expected => return received,
            Err(_) => panic!(
                "{} of {expected} messages after {timeout:?} from {queue}",
                received.len()
            ),
        }
    }
}

fn delivered(delivery: lapin::message::Delivery) -> Delivered {
    let p = &delivery.properties;
    let headers = p
        .headers()
        .as_ref()
        .map(|table| {
            table
                .inner()
                .iter()
                .filter_map(|(name, value)| match value {
                    AMQPValue::LongString(s) => Some((
                        name.to_string(),
                        String::from_utf8_lossy(s.as_bytes()).into_owned(),
                    )),
                    _ => None,
                })
                .collect()
        })
        .unwrap_or_default();
    Delivered {
        message_id: p.message_id().as_ref().map(|s| s.to_string()),
        kind: p.kind().as_ref().map(|s| s.to_string()),
        content_type: p.content_type().as_ref().map(|s| s.to_string()),
        delivery_mode: *p.delivery_mode(),
        headers,
        payload: delivery.data,
    }
}
