//! What the SQS and SNS sinks share: the AWS client settings, how AWS errors are sorted, and the
//! lanes that send events in batches of ten while keeping each aggregate's order.
//!
//! A **lane** sends one batch at a time to one queue or topic. An aggregate always goes through
//! the same lane (its id hashed), a batch holds at most one event of an aggregate, and a lane
//! sends its next batch only after the previous one was answered: so an aggregate's events reach
//! the service one batch after the other, in the order the relay enqueued them. When one of them
//! fails, its aggregate's later events still waiting in the lane fail too, unsent, as the relay
//! expects (it retries them after the failed one). Lanes run concurrently, so different aggregates
//! go out in parallel.

use super::{Ack, SinkError};
use aws_smithy_runtime_api::client::orchestrator::HttpResponse;
use aws_smithy_runtime_api::client::result::SdkError;
use aws_smithy_types::error::display::DisplayErrorContext;
use aws_smithy_types::error::metadata::ProvideErrorMetadata;
use futures::future::{BoxFuture, FutureExt};
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::{mpsc, oneshot};

/// The most entries SQS's `SendMessageBatch` and SNS's `PublishBatch` take.
pub(crate) const MAX_BATCH: usize = 10;

/// The most message attributes SQS takes on a message (and SNS delivers to SQS).
pub(crate) const MAX_ATTRIBUTES: usize = 10;

/// SQS's and SNS's message size limit before SQS raised its own in 2025: 256 KiB, body and
/// attributes together. Raise [`AwsSettings::max_message_bytes`] for queues that take more.
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 256 * 1024;

/// How an SQS or SNS sink reaches AWS. Credentials always come from the standard AWS chain
/// (`AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY`, `AWS_PROFILE`, web identity, SSO, the instance
/// or container role), as for the AWS CLI.
///
/// ```
/// use seaorm_outbox_relay::sink::aws::AwsSettings;
///
/// let mut aws = AwsSettings::default();
/// aws.region = Some("eu-west-1".into());
/// assert_eq!(aws.max_message_bytes, 256 * 1024);
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct AwsSettings {
    /// The region; without it, the chain's (`AWS_REGION`, the profile).
    pub region: Option<String>,
    /// Another endpoint than AWS's (a local or compatible service); without it, the chain's
    /// (`AWS_ENDPOINT_URL`) or AWS's.
    pub endpoint_url: Option<String>,
    /// The largest message, body and attributes, the queue or topic takes: a larger event is
    /// parked, never truncated. Also the most a batch carries.
    pub max_message_bytes: usize,
    /// How many batches may be in flight to one queue or topic at once.
    pub lanes: usize,
    /// How long one attempt of a call may take before the SDK tries again (it tries three times);
    /// then the relay retries the batch, whose deduplication ids make a FIFO queue drop a copy
    /// that reached it late.
    pub attempt_timeout: std::time::Duration,
}

impl Default for AwsSettings {
    fn default() -> Self {
        AwsSettings {
            region: None,
            endpoint_url: None,
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
            lanes: 16,
            attempt_timeout: std::time::Duration::from_secs(30),
        }
    }
}

impl AwsSettings {
    /// The SDK configuration: these settings over the standard chain's.
    pub(crate) async fn load(&self) -> aws_config::SdkConfig {
        let mut loader = aws_config::defaults(aws_config::BehaviorVersion::latest());
        if let Some(region) = &self.region {
            loader = loader.region(aws_config::Region::new(region.clone()));
        }
        if let Some(url) = &self.endpoint_url {
            loader = loader.endpoint_url(url.clone());
        }
        // Without a timeout, a call to a service that stopped answering would wait forever; the
        // relay retries what timed out.
        let timeouts = aws_config::timeout::TimeoutConfig::builder()
            .connect_timeout(std::time::Duration::from_secs(5))
            .operation_attempt_timeout(self.attempt_timeout)
            .build();
        loader.timeout_config(timeouts).load().await
    }
}

/// The error codes with which AWS refuses the caller itself, not the message.
const REFUSED: &[&str] = &[
    "InvalidClientTokenId",
    "UnrecognizedClientException",
    "SignatureDoesNotMatch",
    "IncompleteSignature",
    "InvalidAccessKeyId",
    "MissingAuthenticationToken",
    "ExpiredToken",
    "InvalidSecurity",
];

/// The error codes of a destination the caller may not use.
const DENIED: &[&str] = &[
    "AccessDenied",
    "AccessDeniedException",
    "AuthorizationError",
];

/// The error codes of a destination that does not exist: an operator must create it.
const MISSING: &[&str] = &[
    "AWS.SimpleQueueService.NonExistentQueue",
    "QueueDoesNotExist",
    "NotFound",
];

/// Sorts a failed AWS call about `what` (a queue or a topic): the caller refused or AWS out of
/// reach leave rows untouched; a missing destination or one the caller may not use parks; the
/// rest is retried.
pub(crate) fn classify<E>(e: &SdkError<E, HttpResponse>, what: &str) -> SinkError
where
    E: ProvideErrorMetadata + std::error::Error + 'static,
{
    let SdkError::ServiceError(context) = e else {
        let detail = DisplayErrorContext(e);
        return match e {
            // Building the request failed: no region, no credentials anywhere in the chain.
            SdkError::ConstructionFailure(_) => {
                SinkError::unavailable(format!("cannot call AWS for {what}: {detail}"))
            }
            SdkError::DispatchFailure(failure) if !failure.is_timeout() => {
                SinkError::unavailable(format!("cannot reach AWS for {what}: {detail}"))
            }
            _ => SinkError::new(format!("{what}: {detail}")),
        };
    };
    let raw = context.raw();
    let body = String::from_utf8_lossy(raw.body().bytes().unwrap_or_default());
    // The code as the SDK parsed it, or found in the body when it could not (moto answers some
    // errors in XML to JSON clients).
    let code = e.code().map(str::to_owned).or_else(|| {
        let known = REFUSED.iter().chain(MISSING).chain(DENIED);
        known
            .into_iter()
            .find(|code| body.contains(*code))
            .map(|c| (*c).to_owned())
    });
    let said = match (&code, e.message()) {
        (Some(code), Some(message)) => format!("{code}: {message}"),
        (Some(code), None) => code.clone(),
        _ => format!(
            "HTTP {}: {}",
            raw.status().as_u16(),
            body.chars().take(200).collect::<String>()
        ),
    };
    match code.as_deref() {
        Some(code) if REFUSED.contains(&code) => {
            SinkError::unavailable(format!("AWS refuses the relay's credentials: {said}"))
        }
        Some(code) if MISSING.contains(&code) => {
            SinkError::permanent(format!("{what} does not exist: {said}"))
        }
        Some(code) if DENIED.contains(&code) => {
            SinkError::permanent(format!("the relay may not publish to {what}: {said}"))
        }
        _ => SinkError::new(format!("{what}: {said}")),
    }
}

/// Sorts one failed entry of a batch: the sender's fault (the message) parks, the service's is
/// retried.
fn classify_entry(sender_fault: bool, code: &str, message: Option<&str>) -> SinkError {
    let text = format!("{code}: {}", message.unwrap_or("no message"));
    if sender_fault {
        SinkError::permanent(text)
    } else {
        SinkError::new(text)
    }
}

/// The size AWS counts for a message: its body, and each attribute's name, type and value.
pub(crate) fn message_size(body: &str, attributes: &[(String, String)]) -> usize {
    body.len()
        + attributes
            .iter()
            .map(|(name, value)| name.len() + "String".len() + value.len())
            .sum::<usize>()
}

/// The message attributes of `message`: its headers, and `aggregate_id` unless CloudEvents'
/// `ce_subject` (binary mode) already carries the aggregate id: SQS and SNS carry ten
/// attributes at most, and binary mode's take nine.
pub(crate) fn attributes(message: &super::Message) -> Vec<(String, String)> {
    let mut attributes = message.headers.clone();
    if message.header("ce_subject").is_none() {
        attributes.push(("aggregate_id".into(), message.key.clone()));
    }
    attributes
}

/// What a sink checks before a message goes into a lane: the body is text, within the size and
/// attribute limits.
pub(crate) fn check(
    body: &[u8],
    attributes: &[(String, String)],
    max_bytes: usize,
) -> Result<(String, usize), SinkError> {
    let body = std::str::from_utf8(body)
        .map_err(|e| SinkError::permanent(format!("the payload is not UTF-8 text: {e}")))?;
    if attributes.len() > MAX_ATTRIBUTES {
        return Err(SinkError::permanent(format!(
            "the event has {} headers; SQS and SNS carry at most {MAX_ATTRIBUTES} \
             (CloudEvents' structured mode carries its attributes in the body)",
            attributes.len()
        )));
    }
    let size = message_size(body, attributes);
    if size > max_bytes {
        return Err(SinkError::permanent(format!(
            "the event is {size} bytes with its attributes; at most {max_bytes} are taken"
        )));
    }
    Ok((body.to_owned(), size))
}

/// Sends batches of one kind (SQS messages, SNS publications) to one queue or topic.
pub(crate) trait Batches: Send + Sync + 'static {
    /// One message, ready for the batch call.
    type Request: Send + 'static;

    /// Sends `requests` (at most [`MAX_BATCH`]) to `target` as one call: one result per
    /// request, in order.
    fn send(
        &self,
        target: Arc<str>,
        requests: Vec<Self::Request>,
    ) -> BoxFuture<'static, Vec<Result<(), SinkError>>>;
}

/// The answers to a batch call, one per entry, by entry id (the entry's index in the batch).
pub(crate) struct Answers(Vec<Option<Result<(), SinkError>>>);

impl Answers {
    /// The entries of `requests`, built by `build` with their index as id; an entry that cannot
    /// be built is answered with its error at once.
    pub(crate) fn build<R, E>(
        requests: Vec<R>,
        build: impl Fn(usize, R) -> Result<E, SinkError>,
    ) -> (Vec<E>, Answers) {
        let mut answers = Answers(vec![None; requests.len()]);
        let mut entries = Vec::with_capacity(requests.len());
        for (i, request) in requests.into_iter().enumerate() {
            match build(i, request) {
                Ok(entry) => entries.push(entry),
                Err(e) => answers.0[i] = Some(Err(e)),
            }
        }
        (entries, answers)
    }

    /// The service answered entry `id` succeeded.
    pub(crate) fn succeeded(&mut self, id: &str) {
        self.set(id, Ok(()));
    }

    /// The service answered entry `id` failed: the sender's fault parks, the service's is retried.
    pub(crate) fn failed(
        &mut self,
        id: &str,
        sender_fault: bool,
        code: &str,
        message: Option<&str>,
    ) {
        self.set(id, Err(classify_entry(sender_fault, code, message)));
    }

    fn set(&mut self, id: &str, result: Result<(), SinkError>) {
        if let Some(slot) = id.parse::<usize>().ok().and_then(|i| self.0.get_mut(i)) {
            *slot = Some(result);
        }
    }

    /// The call failed: every entry not answered yet failed with it.
    pub(crate) fn call_failed(&mut self, e: &SinkError) {
        for slot in self.0.iter_mut().filter(|r| r.is_none()) {
            *slot = Some(Err(e.clone()));
        }
    }

    /// One result per entry, in order; `service` names who left one unanswered.
    pub(crate) fn results(self, service: &str) -> Vec<Result<(), SinkError>> {
        self.0
            .into_iter()
            .map(|r| {
                r.unwrap_or_else(|| {
                    Err(SinkError::new(format!(
                        "{service} did not answer the entry"
                    )))
                })
            })
            .collect()
    }
}

/// One message on its way through a lane.
struct Queued<R> {
    aggregate: String,
    bytes: usize,
    request: R,
    /// The purge count when it was enqueued: a later purge drops it.
    epoch: u64,
    answer: oneshot::Sender<Result<(), SinkError>>,
}

/// A lane: its target (queue or topic) and its number.
type LaneId = (Arc<str>, usize);
type LaneSender<R> = mpsc::UnboundedSender<Queued<R>>;

/// The lanes of a sink (see the module's documentation).
pub(crate) struct Lanes<B: Batches> {
    batches: Arc<B>,
    count: usize,
    max_batch_bytes: usize,
    /// Each lane's queue, by target and lane number.
    senders: Mutex<HashMap<LaneId, LaneSender<B::Request>>>,
    state: Arc<State>,
}

/// What the lanes share with the sink.
#[derive(Default)]
struct State {
    /// The aggregates with events in a lane: how many, and the failure that fails the rest.
    aggregates: Mutex<HashMap<String, Waiting>>,
    /// Why AWS last refused the relay, until a call goes through.
    refused: Mutex<Option<String>>,
    /// How many times the relay purged the lanes.
    purges: AtomicU64,
}

#[derive(Default)]
struct Waiting {
    count: usize,
    failed: Option<SinkError>,
}

impl<B: Batches> Lanes<B> {
    /// `count` lanes per queue or topic over `batches`, each batch at most `max_batch_bytes`.
    pub(crate) fn new(batches: B, count: usize, max_batch_bytes: usize) -> Self {
        Lanes {
            batches: Arc::new(batches),
            count: count.max(1),
            max_batch_bytes,
            senders: Mutex::new(HashMap::new()),
            state: Arc::default(),
        }
    }

    /// Puts `request` (of `aggregate`, `bytes` long) in its lane to `target`: the answer is its
    /// entry's result.
    pub(crate) fn enqueue(
        &self,
        target: Arc<str>,
        aggregate: &str,
        bytes: usize,
        request: B::Request,
    ) -> Ack {
        let lane = {
            let mut hasher = std::collections::hash_map::DefaultHasher::new();
            aggregate.hash(&mut hasher);
            (hasher.finish() % self.count as u64) as usize
        };
        self.state
            .aggregates
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(aggregate.to_owned())
            .or_default()
            .count += 1;
        let (answer, answered) = oneshot::channel();
        let queued = Queued {
            aggregate: aggregate.to_owned(),
            bytes,
            request,
            epoch: self.state.purges.load(Ordering::SeqCst),
            answer,
        };
        let mut senders = self.senders.lock().unwrap_or_else(|e| e.into_inner());
        let sender = senders.entry((target.clone(), lane)).or_insert_with(|| {
            let (sender, receiver) = mpsc::unbounded_channel();
            tokio::spawn(run_lane(
                receiver,
                self.batches.clone(),
                self.state.clone(),
                target,
                self.max_batch_bytes,
            ));
            sender
        });
        if let Err(mpsc::error::SendError(queued)) = sender.send(queued) {
            self.state
                .settle(queued, Err(SinkError::new("the lane stopped")));
        }
        async move {
            answered
                .await
                .unwrap_or_else(|_| Err(SinkError::new("the lane stopped")))
        }
        .boxed()
    }

    /// Fails what the lanes hold and have not sent (the relay sends it again).
    pub(crate) fn purge(&self) {
        self.state.purges.fetch_add(1, Ordering::SeqCst);
    }

    /// Why AWS refuses the relay, if the last call said so.
    pub(crate) fn refused(&self) -> Option<String> {
        self.state
            .refused
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Remembers a refusal met outside the lanes (resolving a queue's URL).
    #[cfg_attr(not(feature = "sqs"), allow(dead_code))]
    pub(crate) fn note(&self, result: &Result<(), SinkError>) {
        self.state.note(result);
    }
}

impl State {
    fn note(&self, result: &Result<(), SinkError>) {
        let mut refused = self.refused.lock().unwrap_or_else(|e| e.into_inner());
        match result {
            Ok(()) => *refused = None,
            Err(e) if e.is_unavailable() => *refused = Some(e.message.clone()),
            Err(_) => {}
        }
    }

    /// Why `queued` must not be sent: purged, or its aggregate failed before it.
    fn stopped(&self, queued: &Queued<impl Send>) -> Option<SinkError> {
        if queued.epoch < self.purges.load(Ordering::SeqCst) {
            return Some(SinkError::new("dropped unsent: the relay sends it again"));
        }
        let aggregates = self.aggregates.lock().unwrap_or_else(|e| e.into_inner());
        let failed = aggregates.get(&queued.aggregate)?.failed.as_ref()?;
        let message = format!(
            "an earlier event of its aggregate was not delivered: {}",
            failed.message
        );
        // Never parked for another event's fault; left untouched if the relay is refused.
        Some(if failed.is_unavailable() {
            SinkError::unavailable(message)
        } else {
            SinkError::new(message)
        })
    }

    /// Answers `queued`; a failure fails its aggregate's events still in the lane.
    fn settle<R>(&self, queued: Queued<R>, result: Result<(), SinkError>) {
        self.note(&result);
        {
            let mut aggregates = self.aggregates.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(waiting) = aggregates.get_mut(&queued.aggregate) {
                waiting.count = waiting.count.saturating_sub(1);
                if waiting.count == 0 {
                    aggregates.remove(&queued.aggregate);
                } else if let Err(e) = &result {
                    waiting.failed.get_or_insert_with(|| e.clone());
                }
            }
        }
        let _ = queued.answer.send(result);
    }
}

/// Sends the lane's messages to `target`, one batch at a time, until the sink is dropped.
async fn run_lane<B: Batches>(
    mut receiver: mpsc::UnboundedReceiver<Queued<B::Request>>,
    batches: Arc<B>,
    state: Arc<State>,
    target: Arc<str>,
    max_batch_bytes: usize,
) {
    let mut carried = None;
    loop {
        let mut next = match carried.take() {
            Some(queued) => Some(queued),
            None => receiver.recv().await,
        };
        if next.is_none() {
            return;
        }
        let mut batch: Vec<Queued<B::Request>> = Vec::new();
        let mut bytes = 0;
        while let Some(queued) = next.take().or_else(|| receiver.try_recv().ok()) {
            if let Some(e) = state.stopped(&queued) {
                state.settle(queued, Err(e));
                continue;
            }
            let full = batch.len() == MAX_BATCH
                || (!batch.is_empty() && bytes + queued.bytes > max_batch_bytes)
                || batch.iter().any(|b| b.aggregate == queued.aggregate);
            if full {
                carried = Some(queued);
                break;
            }
            bytes += queued.bytes;
            batch.push(queued);
        }
        if batch.is_empty() {
            continue;
        }
        let (queued, requests): (Vec<_>, Vec<_>) = batch
            .into_iter()
            .map(|q| {
                let Queued {
                    aggregate,
                    bytes,
                    request,
                    epoch,
                    answer,
                } = q;
                (
                    Queued {
                        aggregate,
                        bytes,
                        request: (),
                        epoch,
                        answer,
                    },
                    request,
                )
            })
            .unzip();
        let mut results = batches.send(target.clone(), requests).await.into_iter();
        for queued in queued {
            let result = results
                .next()
                .unwrap_or_else(|| Err(SinkError::new("no answer for the entry")));
            state.settle(queued, result);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records each batch; fails the entries whose request says so.
    #[derive(Default, Clone)]
    struct Recorder {
        sent: Arc<Mutex<Vec<Vec<&'static str>>>>,
    }

    impl Batches for Recorder {
        type Request = &'static str;

        fn send(
            &self,
            _target: Arc<str>,
            requests: Vec<&'static str>,
        ) -> BoxFuture<'static, Vec<Result<(), SinkError>>> {
            self.sent.lock().unwrap().push(requests.clone());
            let results = requests
                .iter()
                .map(|r| {
                    if r.ends_with("fail") {
                        Err(SinkError::new("refused"))
                    } else {
                        Ok(())
                    }
                })
                .collect();
            async move {
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                results
            }
            .boxed()
        }
    }

    #[test]
    fn binary_cloudevents_leave_room_for_one_application_header() {
        use crate::cloudevents::{CloudEvents, Mode};
        use crate::sink::Message;
        let mut message = Message::example();
        message
            .headers
            .push(("traceparent".into(), "00-1-2-01".into()));
        let contract = attributes(&message);
        assert!(contract.contains(&("aggregate_id".into(), message.key.clone())));
        let binary =
            CloudEvents::new("//shop", Mode::Binary).apply(message.clone(), Some(0), "ce_");
        let binary = attributes(&binary);
        assert_eq!(binary.len(), MAX_ATTRIBUTES, "{binary:?}");
        assert!(
            binary.iter().all(|(name, _)| name != "aggregate_id"),
            "ce_subject carries it"
        );
        check(b"{}", &binary, 1 << 20).expect("binary mode with one application header fits");
        let structured =
            CloudEvents::new("//shop", Mode::Structured).apply(message, Some(0), "ce_");
        assert_eq!(
            attributes(&structured).len(),
            3,
            "content-type, traceparent, aggregate_id"
        );
    }

    #[tokio::test]
    async fn a_batch_holds_one_event_of_an_aggregate_and_a_failure_fails_the_rest() {
        let recorder = Recorder::default();
        let lanes = Lanes::new(recorder.clone(), 1, 1_000);
        let target: Arc<str> = Arc::from("queue");
        let acks: Vec<_> = ["a1", "b1", "a2 fail", "a3", "b2"]
            .into_iter()
            .map(|r| lanes.enqueue(target.clone(), &r[..1], 10, r))
            .collect();
        let results: Vec<bool> = futures::future::join_all(acks)
            .await
            .iter()
            .map(Result::is_ok)
            .collect();
        assert_eq!(results, [true, true, false, false, true]);
        // a2 waits for a1's batch; a3 for a2's, and is never sent: a2 failed.
        assert_eq!(
            *recorder.sent.lock().unwrap(),
            [vec!["a1", "b1"], vec!["a2 fail"], vec!["b2"]]
        );
        // Once nothing of `a` waits, its next event goes out.
        assert!(lanes.enqueue(target, "a", 10, "a3").await.is_ok());
    }

    #[tokio::test]
    async fn batches_stop_at_ten_entries_and_at_the_size_limit() {
        let recorder = Recorder::default();
        let lanes = Lanes::new(recorder.clone(), 1, 100);
        let target: Arc<str> = Arc::from("queue");
        let names = [
            "0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "10", "11", "12",
        ];
        let mut acks: Vec<_> = names
            .iter()
            .map(|n| lanes.enqueue(target.clone(), n, 1, n))
            .collect();
        acks.push(lanes.enqueue(target.clone(), "big1", 60, "big1"));
        acks.push(lanes.enqueue(target.clone(), "big2", 60, "big2"));
        for ack in futures::future::join_all(acks).await {
            ack.unwrap();
        }
        let sizes: Vec<usize> = recorder.sent.lock().unwrap().iter().map(Vec::len).collect();
        assert_eq!(sizes, [10, 4, 1]);
    }

    #[test]
    fn each_entry_gets_its_own_answer_by_id() {
        let (entries, mut answers) = Answers::build(vec!["a", "bad", "c", "d"], |i, r| {
            if r == "bad" {
                Err(SinkError::permanent("cannot build"))
            } else {
                Ok(i)
            }
        });
        assert_eq!(entries, [0, 2, 3]);
        answers.succeeded("0");
        answers.failed("2", true, "InvalidParameterValue", Some("no"));
        answers.call_failed(&SinkError::new("timeout"));
        let results = answers.results("SQS");
        assert!(results[0].is_ok());
        assert!(results[1].as_ref().unwrap_err().message == "cannot build");
        assert!(results[2].as_ref().unwrap_err().is_permanent());
        assert_eq!(results[3].as_ref().unwrap_err().message, "timeout");
        let (_, unanswered) = Answers::build(vec![()], |_, ()| Ok(()));
        let e = unanswered.results("SNS").remove(0).unwrap_err();
        assert_eq!(e.message, "SNS did not answer the entry");
    }

    #[test]
    fn oversized_and_binary_payloads_and_too_many_headers_are_parked() {
        let headers: Vec<(String, String)> =
            (0..11).map(|i| (format!("h{i}"), "v".into())).collect();
        assert!(check(b"{}", &headers, 1000).unwrap_err().is_permanent());
        assert!(check(&[0xff, 0xfe], &[], 1000).unwrap_err().is_permanent());
        let e = check(&[b'x'; 1001], &[], 1000).unwrap_err();
        assert!(e.is_permanent() && e.message.contains("1001 bytes"), "{e}");
        let (body, size) = check(b"{}", &[("id".into(), "7".into())], 1000).unwrap();
        assert_eq!((body.as_str(), size), ("{}", 2 + 2 + 6 + 1));
    }
}
