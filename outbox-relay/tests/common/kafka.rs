//! Reading what actually reached Kafka, as a consumer would.
//!
//! Kafka comes from `KAFKA_BROKERS`, which `scripts/test` sets after starting a broker.

use rdkafka::Message;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Headers;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// The Kafka brokers of the test run, or a panic that says how to get them.
pub fn brokers() -> String {
    std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| {
        panic!(
            "KAFKA_BROKERS is not set: this test needs a real Apache Kafka. \
             Run `scripts/test`, which starts one and sets it."
        )
    })
}

/// One message as received.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Received {
    /// The topic.
    pub topic: String,
    /// The partition.
    pub partition: i32,
    /// The offset in the partition.
    pub offset: i64,
    /// The key, as UTF-8.
    pub key: String,
    /// The value bytes.
    pub payload: Vec<u8>,
    /// Header names and values, in order.
    pub headers: Vec<(String, String)>,
}

impl Received {
    /// The value of header `name`.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// The payload parsed as JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.payload).expect("payload is JSON")
    }
}

/// Reads `topics` from the beginning until at least `expected` messages arrived and every
/// partition is read to its end as it stood then (so duplicates are seen too), or panics after
/// `timeout`. Returns what arrived, in per-partition order.
pub async fn consume(topics: &[&str], expected: usize, timeout: Duration) -> Vec<Received> {
    consume_from(&brokers(), topics, expected, timeout).await
}

/// [`consume`] from the Kafka at `brokers` (plaintext).
pub async fn consume_from(
    brokers: &str,
    topics: &[&str],
    expected: usize,
    timeout: Duration,
) -> Vec<Received> {
    let topics: Vec<String> = topics.iter().map(|t| (*t).to_owned()).collect();
    let brokers = brokers.to_owned();
    tokio::task::spawn_blocking(move || {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &brokers)
            .set(
                "group.id",
                format!("test-{}", seaorm_outbox::Uuid::now_v7()),
            )
            .set("auto.offset.reset", "earliest")
            .set("enable.auto.commit", "false")
            .set("topic.metadata.refresh.interval.ms", "500")
            .create()
            .expect("kafka consumer");
        let names: Vec<&str> = topics.iter().map(String::as_str).collect();
        consumer.subscribe(&names).expect("subscribe");
        let deadline = Instant::now() + timeout;
        let mut received = Vec::new();
        // Once `expected` arrived: the end offset of each partition, and the next offset to read.
        let mut ends: Option<HashMap<(String, i32), i64>> = None;
        let mut next: HashMap<(String, i32), i64> = HashMap::new();
        loop {
            if let Some(ends) = &ends
                && ends
                    .iter()
                    .all(|(partition, end)| next.get(partition).copied().unwrap_or(0) >= *end)
            {
                return received;
            }
            assert!(
                Instant::now() < deadline,
                "{} of {expected} messages after {timeout:?} from {topics:?}",
                received.len()
            );
            if ends.is_none() && received.len() >= expected {
                ends = Some(end_offsets(&consumer, &topics));
            }
            // Errors (an unknown topic while it is being created) are passed over: keep polling.
            if let Some(Ok(m)) = consumer.poll(Duration::from_millis(100)) {
                next.insert((m.topic().to_owned(), m.partition()), m.offset() + 1);
                let headers = m
                    .headers()
                    .map(|h| {
                        h.iter()
                            .map(|h| {
                                (
                                    h.key.to_owned(),
                                    String::from_utf8_lossy(h.value.unwrap_or_default())
                                        .into_owned(),
                                )
                            })
                            .collect()
                    })
                    .unwrap_or_default();
                received.push(Received {
                    topic: m.topic().to_owned(),
                    partition: m.partition(),
                    offset: m.offset(),
                    key: String::from_utf8_lossy(m.key().unwrap_or_default()).into_owned(),
                    payload: m.payload().unwrap_or_default().to_vec(),
                    headers,
                });
            }
        }
    })
    .await
    .expect("consumer thread")
}

/// The end offset (high watermark) of every partition of `topics`, skipping empty partitions.
fn end_offsets(consumer: &BaseConsumer, topics: &[String]) -> HashMap<(String, i32), i64> {
    let mut ends = HashMap::new();
    for topic in topics {
        let partitions: Vec<i32> = retried("topic metadata", || {
            consumer
                .fetch_metadata(Some(topic), Duration::from_secs(10))
                .map(|m| {
                    m.topics()
                        .iter()
                        .flat_map(|t| t.partitions().iter().map(|p| p.id()))
                        .collect()
                })
        });
        for partition in partitions {
            let (low, high) = retried("watermarks", || {
                consumer.fetch_watermarks(topic, partition, Duration::from_secs(10))
            });
            if high > low {
                ends.insert((topic.clone(), partition), high);
            }
        }
    }
    ends
}

/// `request`'s answer, asked again for up to 30 s: a broker that just came back may fail a
/// request or two.
fn retried<T>(what: &str, mut request: impl FnMut() -> rdkafka::error::KafkaResult<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match request() {
            Ok(answer) => return answer,
            Err(e) if Instant::now() < deadline => {
                eprintln!("{what}: {e}; asking again");
                std::thread::sleep(Duration::from_millis(200));
            }
            Err(e) => panic!("{what}: {e}"),
        }
    }
}
