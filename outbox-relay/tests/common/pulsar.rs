//! Reading what actually reached Pulsar, as a consumer would.
//!
//! Pulsar comes from `PULSAR_URL`, which `scripts/test` sets after starting a standalone broker.

use futures::StreamExt;
use pulsar::consumer::InitialPosition;
use pulsar::message::proto::command_subscribe::SubType;
use pulsar::{Consumer, Pulsar, TokioExecutor};
use std::time::{Duration, Instant};

/// The Pulsar service URL of the test run, or a panic that says how to get it.
pub fn url() -> String {
    std::env::var("PULSAR_URL").unwrap_or_else(|_| {
        panic!(
            "PULSAR_URL is not set: this test needs a real Apache Pulsar. \
             Run `scripts/test`, which starts one and sets it."
        )
    })
}

/// The full Pulsar name of a routed topic in the default tenant and namespace.
pub fn topic(routed: &str) -> String {
    format!("persistent://public/default/{routed}")
}

/// One message as received.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Received {
    /// The partition key.
    pub key: String,
    /// The ordering key, as UTF-8.
    pub ordering_key: String,
    /// The value bytes.
    pub payload: Vec<u8>,
    /// The properties.
    pub properties: Vec<(String, String)>,
}

impl Received {
    /// The value of property `name`.
    pub fn property(&self, name: &str) -> Option<&str> {
        self.properties
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Reads `topic` from the beginning until at least `expected` messages arrived and the topic is
/// read to its last message as it stood then (so duplicates are seen too), or panics after
/// `timeout`. Returns what arrived, in order.
pub async fn consume(topic: &str, expected: usize, timeout: Duration) -> Vec<Received> {
    let client = Pulsar::builder(url(), TokioExecutor)
        .build()
        .await
        .expect("connect to pulsar");
    let mut consumer: Consumer<Vec<u8>, TokioExecutor> = client
        .consumer()
        .with_topic(topic)
        .with_subscription(format!("test-{}", seaorm_outbox::Uuid::now_v7()))
        .with_subscription_type(SubType::Exclusive)
        .with_options(
            pulsar::ConsumerOptions::default().with_initial_position(InitialPosition::Earliest),
        )
        .build()
        .await
        .expect("subscribe");
    let deadline = Instant::now() + timeout;
    let mut received = Vec::new();
    // Once `expected` arrived: the topic's last message, (ledger, entry), and the last one read.
    let mut last: Option<(u64, u64)> = None;
    let mut read: (u64, u64) = (0, 0);
    loop {
        if received.len() >= expected && last.is_none() {
            let id = consumer
                .get_last_message_id()
                .await
                .expect("last message id");
            last = Some(
                id.iter()
                    .map(|id| (id.ledger_id, id.entry_id))
                    .max()
                    .unwrap_or_default(),
            );
        }
        if last.is_some_and(|last| read >= last) {
            return received;
        }
        let left = deadline.saturating_duration_since(Instant::now());
        let Ok(Some(message)) = tokio::time::timeout(left, consumer.next()).await else {
            panic!(
                "{} of {expected} messages after {timeout:?} from {topic}",
                received.len()
            );
        };
        let message = message.expect("pulsar message");
        read = read.max((
            message.message_id().ledger_id,
            message.message_id().entry_id,
        ));
        let metadata = message.metadata();
        received.push(Received {
            key: metadata.partition_key.clone().unwrap_or_default(),
            ordering_key: String::from_utf8_lossy(
                metadata.ordering_key.as_deref().unwrap_or_default(),
            )
            .into_owned(),
            payload: message.payload.data.clone(),
            properties: metadata
                .properties
                .iter()
                .map(|p| (p.key.clone(), p.value.clone()))
                .collect(),
        });
        consumer.ack(&message).await.expect("ack");
    }
}
