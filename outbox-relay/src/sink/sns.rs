//! The Amazon SNS sink, through the official `aws-sdk-sns`.
//!
//! The routed topic is the SNS topic's ARN, or its name after
//! [`SnsConfig::topic_arn_prefix`] (`arn:aws:sns:eu-west-1:123456789012:`). Events go out with
//! `PublishBatch`, up to ten to a call, through the lanes of [`super::aws`]: an aggregate's events
//! are published one batch after the other, in order. The message is the event's JSON as
//! recorded; the contract's headers and `aggregate_id` are string message attributes (ten at most:
//! an event with more is parked, as is one larger than [`AwsSettings::max_message_bytes`]). A row
//! is marked published once SNS answered its entry successfully.
//!
//! - **FIFO topics** (`.fifo`): `MessageGroupId` = the aggregate id and `MessageDeduplicationId` =
//!   the event id: SNS keeps each aggregate's order to its FIFO queues and drops a copy the relay
//!   sends again within five minutes.
//! - **Standard topics**: order is best effort and a message may arrive twice: consumers
//!   deduplicate by the `id` attribute (the inbox).
//!
//! CloudEvents (`--format cloudevents`) are structured by default here: SNS has no protocol
//! binding, and binary mode's attributes (named `ce_…` as Kafka's binding names them, with
//! `ce_subject` standing in for `aggregate_id`) take nine of the ten message attributes, leaving
//! one for the application's headers.

use super::aws::{Answers, AwsSettings, Batches, Lanes, attributes, check, classify};
use super::{Ack, Message, Sink, SinkError};
use aws_sdk_sns::types::{MessageAttributeValue, PublishBatchRequestEntry};
use futures::future::{BoxFuture, FutureExt};
use std::collections::HashMap;
use std::sync::Arc;
use tokio::sync::OnceCell;

/// The SNS sink's settings.
///
/// ```
/// use seaorm_outbox_relay::sink::sns::SnsConfig;
///
/// let mut config = SnsConfig::default();
/// config.topic_arn_prefix = Some("arn:aws:sns:eu-west-1:123456789012:".into());
/// let sink = seaorm_outbox_relay::sink::SinkConfig::Sns(config).build().unwrap();
/// assert_eq!(sink.name(), "sns");
/// ```
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct SnsConfig {
    /// Region, endpoint and limits (credentials come from the standard AWS chain).
    pub aws: AwsSettings,
    /// Put before a routed topic that is not an ARN to make its ARN.
    pub topic_arn_prefix: Option<String>,
}

/// Publishes events to Amazon SNS (see the module's documentation).
pub struct SnsSink {
    config: SnsConfig,
    /// Made on first use, so that building the sink needs neither AWS nor its credentials.
    lanes: OnceCell<Lanes<SnsBatches>>,
}

impl SnsSink {
    /// A sink for `config`; it loads the AWS settings when it first publishes.
    pub fn new(config: &SnsConfig) -> Self {
        SnsSink {
            config: config.clone(),
            lanes: OnceCell::new(),
        }
    }

    async fn lanes(&self) -> &Lanes<SnsBatches> {
        self.lanes
            .get_or_init(|| async {
                let client = aws_sdk_sns::Client::new(&self.config.aws.load().await);
                Lanes::new(
                    SnsBatches { client },
                    self.config.aws.lanes,
                    self.config.aws.max_message_bytes,
                )
            })
            .await
    }

    /// The ARN of the topic `topic` routes to.
    fn topic_arn(&self, topic: &str) -> Result<Arc<str>, SinkError> {
        if topic.starts_with("arn:") {
            return Ok(Arc::from(topic));
        }
        match &self.config.topic_arn_prefix {
            Some(prefix) => Ok(Arc::from(format!("{prefix}{topic}"))),
            None => Err(SinkError::permanent(format!(
                "SNS topic `{topic}` is not an ARN, and no topic ARN prefix is set"
            ))),
        }
    }
}

/// Sends `PublishBatch` calls.
struct SnsBatches {
    client: aws_sdk_sns::Client,
}

/// One publication of a batch, before it gets its entry id.
struct SnsMessage {
    message: String,
    attributes: Vec<(String, String)>,
    /// The group and deduplication ids, on a FIFO topic.
    fifo: Option<(String, String)>,
}

impl Batches for SnsBatches {
    type Request = SnsMessage;

    fn send(
        &self,
        target: Arc<str>,
        requests: Vec<SnsMessage>,
    ) -> BoxFuture<'static, Vec<Result<(), SinkError>>> {
        let (entries, mut answers) = Answers::build(requests, entry);
        let call = self
            .client
            .publish_batch()
            .topic_arn(target.as_ref())
            .set_publish_batch_request_entries(Some(entries))
            .send();
        async move {
            match call.await {
                Ok(output) => {
                    for id in output.successful().iter().filter_map(|ok| ok.id()) {
                        answers.succeeded(id);
                    }
                    for failed in output.failed() {
                        answers.failed(
                            failed.id(),
                            failed.sender_fault(),
                            failed.code(),
                            failed.message(),
                        );
                    }
                }
                Err(e) => answers.call_failed(&classify(&e, &format!("SNS topic {target}"))),
            }
            answers.results("SNS")
        }
        .boxed()
    }
}

/// The batch entry `i` for `message`.
fn entry(i: usize, message: SnsMessage) -> Result<PublishBatchRequestEntry, SinkError> {
    let mut attributes = HashMap::with_capacity(message.attributes.len());
    for (name, value) in message.attributes {
        let value = MessageAttributeValue::builder()
            .data_type("String")
            .string_value(value)
            .build()
            .map_err(|e| SinkError::permanent(format!("attribute `{name}`: {e}")))?;
        attributes.insert(name, value);
    }
    let (group, deduplication) = message.fifo.unzip();
    PublishBatchRequestEntry::builder()
        .id(i.to_string())
        .message(message.message)
        .set_message_attributes(Some(attributes))
        .set_message_group_id(group)
        .set_message_deduplication_id(deduplication)
        .build()
        .map_err(|e| SinkError::permanent(format!("SNS entry: {e}")))
}

impl Sink for SnsSink {
    fn name(&self) -> &str {
        "sns"
    }

    fn enqueue<'a>(&'a self, message: &'a Message) -> BoxFuture<'a, Result<Ack, SinkError>> {
        async move {
            let attributes = attributes(message);
            let (body, bytes) = check(
                &message.payload,
                &attributes,
                self.config.aws.max_message_bytes,
            )?;
            let topic = self.topic_arn(&message.topic)?;
            let fifo = topic
                .ends_with(".fifo")
                .then(|| (message.key.clone(), message.event_id.to_string()));
            let request = SnsMessage {
                message: body,
                attributes,
                fifo,
            };
            Ok(self
                .lanes()
                .await
                .enqueue(topic, &message.key, bytes, request))
        }
        .boxed()
    }

    /// Not ready while AWS refuses the relay's credentials or cannot be reached (as the last call
    /// found).
    fn ready(&self) -> BoxFuture<'_, Result<(), SinkError>> {
        let refused = self.lanes.get().and_then(Lanes::refused);
        futures::future::ready(refused.map_or(Ok(()), |reason| Err(SinkError::unavailable(reason))))
            .boxed()
    }

    fn purge(&self) {
        if let Some(lanes) = self.lanes.get() {
            lanes.purge();
        }
    }
}
