//! SQS and SNS on moto's server (`scripts/services start moto`), and SQS on ElasticMQ (`start
//! elasticmq`, for the fault tests), read and set up by an independent client: PyPI's boto3, in
//! the tests' Python (`OUTBOX_TEST_PYTHON`).

use serde::Deserialize;
use std::collections::BTreeMap;

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| {
        panic!(
            "{name} is not set: start moto and ElasticMQ with `scripts/services start moto elasticmq` \
             (scripts/test does)"
        )
    })
}

/// The moto server that takes any credentials.
pub fn url() -> String {
    env("OUTBOX_MOTO_URL")
}

/// The ElasticMQ server (SQS only; it takes any credentials).
pub fn elasticmq_url() -> String {
    env("OUTBOX_ELASTICMQ_URL")
}

/// The moto server that refuses every credential (none is known to it).
pub fn refusing_url() -> String {
    env("OUTBOX_MOTO_AUTH_URL")
}

/// The secret access key in the environment, which nothing may print.
pub fn secret_access_key() -> String {
    env("AWS_SECRET_ACCESS_KEY")
}

const BOTO: &str = r#"
import json, sys, time, boto3
endpoint, command, *args = sys.argv[1:]
sqs = boto3.client("sqs", endpoint_url=endpoint)
sns = boto3.client("sns", endpoint_url=endpoint)
def queue(name):
    attributes = {"FifoQueue": "true"} if name.endswith(".fifo") else {}
    return sqs.create_queue(QueueName=name, Attributes=attributes)["QueueUrl"]
if command == "queue":
    print(json.dumps(queue(args[0])))
elif command == "topic":
    topic, queue_name = args
    attributes = {"FifoTopic": "true"} if topic.endswith(".fifo") else {}
    arn = sns.create_topic(Name=topic, Attributes=attributes)["TopicArn"]
    url = queue(queue_name)
    queue_arn = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    sns.subscribe(TopicArn=arn, Protocol="sqs", Endpoint=queue_arn,
                  Attributes={"RawMessageDelivery": "true"})
    print(json.dumps([arn, url]))
elif command == "receive":
    url, = args
    received, empty = [], 0
    while empty < 3:
        answer = sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10, WaitTimeSeconds=0,
                                     MessageAttributeNames=["All"], AttributeNames=["All"])
        messages = answer.get("Messages", [])
        if not messages:
            empty += 1
            time.sleep(0.2)
            continue
        empty = 0
        for m in messages:
            received.append({
                "body": m["Body"],
                "attributes": {k: v["StringValue"] for k, v in m.get("MessageAttributes", {}).items()},
                "group": m["Attributes"].get("MessageGroupId"),
                "deduplication": m["Attributes"].get("MessageDeduplicationId"),
            })
        sqs.delete_message_batch(QueueUrl=url, Entries=[
            {"Id": str(i), "ReceiptHandle": m["ReceiptHandle"]} for i, m in enumerate(messages)])
    print(json.dumps(received))
"#;

/// Runs the boto3 script's `command` on the server at `endpoint`, and parses what it prints.
fn boto<T: serde::de::DeserializeOwned>(endpoint: &str, command: &[&str]) -> T {
    let python = std::env::var("OUTBOX_TEST_PYTHON").unwrap_or_else(|_| {
        panic!("OUTBOX_TEST_PYTHON is not set: run `scripts/test`, which makes a Python with boto3")
    });
    let output = std::process::Command::new(python)
        .args(["-c", BOTO, endpoint])
        .args(command)
        .output()
        .expect("run Python");
    assert!(
        output.status.success(),
        "boto3 {command:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).expect("boto3's answer")
}

/// Creates the queue `name` (FIFO if it ends in `.fifo`) on moto; its URL.
pub fn create_queue(name: &str) -> String {
    create_queue_on(&url(), name)
}

/// Creates the queue `name` (FIFO if it ends in `.fifo`) on the server at `endpoint`; its URL.
pub fn create_queue_on(endpoint: &str, name: &str) -> String {
    boto(endpoint, &["queue", name])
}

/// Creates the SNS topic `topic` and the queue `queue` subscribed to it (raw delivery, so the
/// message attributes reach the queue); the topic's ARN and the queue's URL.
pub fn create_topic_with_queue(topic: &str, queue: &str) -> (String, String) {
    boto(&url(), &["topic", topic, queue])
}

/// A message as boto3 received it.
#[derive(Debug, Deserialize)]
pub struct Received {
    pub body: String,
    pub attributes: BTreeMap<String, String>,
    pub group: Option<String>,
    pub deduplication: Option<String>,
}

/// Receives (and deletes) everything in the queue at `url`, in the order SQS hands it out, from
/// the server the URL names.
pub fn receive_all(url: &str) -> Vec<Received> {
    boto(origin(url), &["receive", url])
}

/// `http://host:port` of a queue's URL.
fn origin(url: &str) -> &str {
    let after_scheme = url.find("://").map_or(0, |i| i + 3);
    url[after_scheme..]
        .find('/')
        .map_or(url, |i| &url[..after_scheme + i])
}
