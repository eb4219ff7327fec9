//! The relay places each key on the partition the Java client would: moving a topic between
//! Debezium (or Kafka Streams, or any Java producer) and the relay keeps each key's order. Checked
//! against Kafka's own Java producer, from the test broker's jars, on real topics.

mod common;

use common::kafka::{brokers, consume};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use seaorm_outbox_relay::sink::kafka::{KafkaConfig, KafkaSink};
use seaorm_outbox_relay::sink::{Message, send_all};
use std::collections::BTreeMap;
use std::process::Command;
use std::time::Duration;

const PARTITIONS: i32 = 6;

/// Sends one message per key through Kafka's Java producer, with its default partitioner.
const JAVA_PRODUCER: &str = r#"
import java.util.Properties;
import org.apache.kafka.clients.producer.KafkaProducer;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.kafka.common.serialization.StringSerializer;

public class JavaProducer {
    public static void main(String[] args) throws Exception {
        Properties props = new Properties();
        props.put("bootstrap.servers", args[0]);
        try (KafkaProducer<String, String> producer =
                 new KafkaProducer<>(props, new StringSerializer(), new StringSerializer())) {
            for (int i = 2; i < args.length; i++) {
                producer.send(new ProducerRecord<>(args[1], args[i], "{}")).get();
            }
        }
    }
}
"#;

async fn create_topic(name: &str) {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .create()
        .expect("admin client");
    let topic = NewTopic::new(name, PARTITIONS, TopicReplication::Fixed(1));
    let results = admin
        .create_topics([&topic], &AdminOptions::new())
        .await
        .expect("create topic");
    for result in results {
        result.expect("topic created");
    }
}

/// The partition each key of `topic` landed on.
async fn partitions(topic: &str, keys: usize) -> BTreeMap<String, i32> {
    consume(&[topic], keys, Duration::from_secs(60))
        .await
        .into_iter()
        .map(|m| (m.key, m.partition))
        .collect()
}

#[tokio::test]
async fn keys_land_on_the_partitions_the_java_client_chooses() {
    let keys: Vec<String> = (1..=40)
        .map(|n| format!("order-{n}"))
        .chain(["42", "customer:7", "ünïcode", ""].map(String::from))
        .collect();
    let run = seaorm_outbox::Uuid::now_v7().simple().to_string();
    let (ours, java) = (format!("t{run}.relay"), format!("t{run}.java"));
    create_topic(&ours).await;
    create_topic(&java).await;

    let sink = KafkaSink::new(&KafkaConfig::new(brokers())).unwrap();
    let messages: Vec<Message> = keys
        .iter()
        .map(|key| {
            let mut message = Message::example();
            message.topic = ours.clone();
            message.key = key.clone();
            message
        })
        .collect();
    for result in send_all(&sink, &messages).await {
        result.expect("acked");
    }

    // Kafka's Java producer, from the broker's own jars (`scripts/services classpath kafka`).
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let classpath = Command::new(root.join("scripts/services"))
        .args(["classpath", "kafka"])
        .output()
        .expect("scripts/services classpath kafka");
    assert!(
        classpath.status.success(),
        "{}",
        String::from_utf8_lossy(&classpath.stderr)
    );
    let dir = std::env::temp_dir().join(format!("outbox-test-java-{run}"));
    std::fs::create_dir_all(&dir).unwrap();
    let source = dir.join("JavaProducer.java");
    std::fs::write(&source, JAVA_PRODUCER).unwrap();
    let produced = Command::new("java")
        .arg("-cp")
        .arg(String::from_utf8(classpath.stdout).unwrap().trim())
        .arg(&source)
        .arg(brokers())
        .arg(&java)
        .args(&keys)
        .output()
        .expect("java");
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(
        produced.status.success(),
        "the Java producer failed: {}",
        String::from_utf8_lossy(&produced.stderr)
    );

    let (ours, java) = (
        partitions(&ours, keys.len()).await,
        partitions(&java, keys.len()).await,
    );
    assert_eq!(ours.len(), keys.len());
    let spread: std::collections::BTreeSet<i32> = java.values().copied().collect();
    assert!(
        spread.len() > 1,
        "the keys spread over partitions: {java:?}"
    );
    assert_eq!(
        ours, java,
        "the relay's partitions against the Java client's"
    );
}
