//! A topic as a consumer sees it: created before a measurement, and its messages counted from the
//! broker's log end offsets, whoever published them.

use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use std::time::{Duration, Instant};

/// Creates `topic` with the broker's partition count, as a relay's auto-created topics get, and
/// the broker's append time as the message timestamp.
pub async fn create(brokers: &str, topic: &str) {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .expect("admin client");
    let new = NewTopic::new(topic, -1, TopicReplication::Fixed(1))
        .set("message.timestamp.type", "LogAppendTime");
    for result in admin
        .create_topics([&new], &AdminOptions::new())
        .await
        .expect("create topic")
    {
        result.expect("topic created");
    }
}

/// Counts the messages of one topic.
pub struct Count {
    consumer: BaseConsumer,
    topic: String,
    partitions: Vec<i32>,
}

impl Count {
    pub fn new(brokers: &str, topic: &str) -> Count {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", brokers)
            .create()
            .expect("consumer");
        let metadata = consumer
            .fetch_metadata(Some(topic), Duration::from_secs(10))
            .expect("metadata");
        let partitions = metadata.topics()[0]
            .partitions()
            .iter()
            .map(|p| p.id())
            .collect();
        Count {
            consumer,
            topic: topic.to_owned(),
            partitions,
        }
    }

    /// Messages in the topic so far.
    pub fn messages(&self) -> usize {
        self.partitions
            .iter()
            .map(|&p| {
                let (low, high) = self
                    .consumer
                    .fetch_watermarks(&self.topic, p, Duration::from_secs(10))
                    .expect("watermarks");
                (high - low) as usize
            })
            .sum()
    }

    /// Waits until the topic holds `count` messages; panics after `limit`, naming `who`.
    pub async fn wait_for(&self, count: usize, limit: Duration, who: &str) {
        let deadline = Instant::now() + limit;
        loop {
            let now = self.messages();
            if now >= count {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{who} published {now} of {count} events in {limit:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}
