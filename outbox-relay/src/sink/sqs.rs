//! The Amazon SQS sink, through the official `aws-sdk-sqs`.
//!
//! The routed topic names the queue (its URL is looked up once with `GetQueueUrl`), or is the
//! queue's URL. Events go out with `SendMessageBatch`, up to ten to a call, through the lanes of
//! [`super::aws`]: an aggregate's events are sent one batch after the other, in order. The body is
//! the event's JSON as recorded; the contract's headers and `aggregate_id` are string message
//! attributes (SQS carries ten at most: an event with more is parked, as is one larger than
//! [`AwsSettings::max_message_bytes`]: never truncated). A row is marked published once SQS
//! answered its entry successfully (the message is stored).
//!
//! - **FIFO queues** (`.fifo`): `MessageGroupId` = the aggregate id, so SQS delivers each
//!   aggregate's events in order, and `MessageDeduplicationId` = the event id, so a copy the relay
//!   sends again (after a crash, or when an answer was lost) is dropped by SQS within its
//!   five-minute window: consumers receive each event once.
//! - **Standard queues**: SQS orders messages on a best-effort basis only, and may deliver one
//!   twice: consumers must not rely on order and deduplicate by the `id` attribute (the inbox).
//!
//! CloudEvents (`--format cloudevents`) are structured by default here: SQS has no protocol
//! binding, and binary mode's attributes (named `ce_…` as Kafka's binding names them, with
//! `ce_subject` standing in for `aggregate_id`) take nine of the ten message attributes, leaving
//! one for the application's headers.

use super::aws::{Answers, AwsSettings, Batches, Lanes, attributes, check, classify};
use super::{Ack, Message, Sink, SinkError};
use aws_sdk_sqs::types::{MessageAttributeValue, SendMessageBatchRequestEntry};
use futures::future::{BoxFuture, FutureExt};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tokio::sync::OnceCell;

/// The SQS sink's settings.
///
/// ```
/// use seaorm_outbox_relay::sink::sqs::SqsConfig;
///
/// let mut config = SqsConfig::default();
/// config.aws.region = Some("eu-west-1".into());
/// let sink = seaorm_outbox_relay::sink::SinkConfig::Sqs(config).build().unwrap();
/// assert_eq!(sink.name(), "sqs");
/// ```
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct SqsConfig {
    /// Region, endpoint and limits (credentials come from the standard AWS chain).
    pub aws: AwsSettings,
}

/// Sends events to Amazon SQS (see the module's documentation).
pub struct SqsSink {
    config: SqsConfig,
    /// Made on first use, so that building the sink needs neither AWS nor its credentials.
    running: OnceCell<Running>,
}

struct Running {
    client: aws_sdk_sqs::Client,
    lanes: Lanes<SqsBatches>,
    /// Each routed topic's queue URL, once looked up.
    queue_urls: Mutex<HashMap<String, Arc<str>>>,
}

impl SqsSink {
    /// A sink for `config`; it loads the AWS settings when it first sends.
    pub fn new(config: &SqsConfig) -> Self {
        SqsSink {
            config: config.clone(),
            running: OnceCell::new(),
        }
    }

    async fn running(&self) -> &Running {
        self.running
            .get_or_init(|| async {
                let client = aws_sdk_sqs::Client::new(&self.config.aws.load().await);
                Running {
                    lanes: Lanes::new(
                        SqsBatches {
                            client: client.clone(),
                        },
                        self.config.aws.lanes,
                        self.config.aws.max_message_bytes,
                    ),
                    client,
                    queue_urls: Mutex::new(HashMap::new()),
                }
            })
            .await
    }
}

impl Running {
    /// The URL of the queue `topic` names.
    async fn queue_url(&self, topic: &str) -> Result<Arc<str>, SinkError> {
        if topic.starts_with("https://") || topic.starts_with("http://") {
            return Ok(Arc::from(topic));
        }
        if let Some(url) = self
            .queue_urls
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(topic)
        {
            return Ok(url.clone());
        }
        let answer = self.client.get_queue_url().queue_name(topic).send().await;
        let url: Arc<str> = match answer {
            Ok(output) => Arc::from(output.queue_url().unwrap_or_default()),
            Err(e) => {
                let e = classify(&e, &format!("SQS queue `{topic}`"));
                self.lanes.note(&Err(e.clone()));
                return Err(e);
            }
        };
        self.queue_urls
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(topic.to_owned(), url.clone());
        Ok(url)
    }
}

/// Sends `SendMessageBatch` calls.
struct SqsBatches {
    client: aws_sdk_sqs::Client,
}

/// One message of a batch, before it gets its entry id.
struct SqsMessage {
    body: String,
    attributes: Vec<(String, String)>,
    /// The group and deduplication ids, on a FIFO queue.
    fifo: Option<(String, String)>,
}

impl Batches for SqsBatches {
    type Request = SqsMessage;

    fn send(
        &self,
        target: Arc<str>,
        requests: Vec<SqsMessage>,
    ) -> BoxFuture<'static, Vec<Result<(), SinkError>>> {
        let (entries, mut answers) = Answers::build(requests, entry);
        let call = self
            .client
            .send_message_batch()
            .queue_url(target.as_ref())
            .set_entries(Some(entries))
            .send();
        async move {
            match call.await {
                Ok(output) => {
                    for ok in output.successful() {
                        answers.succeeded(ok.id());
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
                Err(e) => answers.call_failed(&classify(&e, &format!("SQS queue {target}"))),
            }
            answers.results("SQS")
        }
        .boxed()
    }
}

/// The batch entry `i` for `message`.
fn entry(i: usize, message: SqsMessage) -> Result<SendMessageBatchRequestEntry, SinkError> {
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
    SendMessageBatchRequestEntry::builder()
        .id(i.to_string())
        .message_body(message.body)
        .set_message_attributes(Some(attributes))
        .set_message_group_id(group)
        .set_message_deduplication_id(deduplication)
        .build()
        .map_err(|e| SinkError::permanent(format!("SQS entry: {e}")))
}

impl Sink for SqsSink {
    fn name(&self) -> &str {
        "sqs"
    }

    fn enqueue<'a>(&'a self, message: &'a Message) -> BoxFuture<'a, Result<Ack, SinkError>> {
        async move {
            let attributes = attributes(message);
            let (body, bytes) = check(
                &message.payload,
                &attributes,
                self.config.aws.max_message_bytes,
            )?;
            let running = self.running().await;
            let queue = running.queue_url(&message.topic).await?;
            let fifo = queue
                .ends_with(".fifo")
                .then(|| (message.key.clone(), message.event_id.to_string()));
            let request = SqsMessage {
                body,
                attributes,
                fifo,
            };
            Ok(running.lanes.enqueue(queue, &message.key, bytes, request))
        }
        .boxed()
    }

    /// Not ready while AWS refuses the relay's credentials or cannot be reached (as the last call
    /// found).
    fn ready(&self) -> BoxFuture<'_, Result<(), SinkError>> {
        let refused = self.running.get().and_then(|r| r.lanes.refused());
        futures::future::ready(refused.map_or(Ok(()), |reason| Err(SinkError::unavailable(reason))))
            .boxed()
    }

    fn purge(&self) {
        if let Some(running) = self.running.get() {
            running.lanes.purge();
        }
    }
}
