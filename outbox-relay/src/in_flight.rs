//! A batch in flight: handed to the sink in `seq` order as the ordering rules allow, its answers
//! read as they come (a message without one by its deadline failed: `ack_timeout`), and each row's
//! verdict recorded in the batch's outcome: published, parked, or retried after a backoff.

use crate::batch::Outcome;
use crate::metrics;
use crate::ordering::{Admission, Verdict, Waiting};
use crate::outlet::Outlet;
use crate::quiet::InFlightToken;
use crate::row::OutboxRow;
use crate::sink::{Ack, SinkError};
use futures::FutureExt;
use std::time::Duration;
use tokio::time::Instant;

/// Hands the claimed rows to the sink in `seq` order, as the ordering rules allow
/// (`ordering.rs`): rows that cannot become a message are parked, rows of a held aggregate
/// are left untouched. Returns the batch in flight, or `None` when nothing was claimed.
pub(crate) async fn send(
    outlet: &Outlet<'_>,
    rows: Vec<OutboxRow>,
    full: bool,
    waiting: Waiting,
    started: std::time::Instant,
) -> Option<InFlight> {
    if rows.is_empty() {
        return None;
    }
    let _handing_over = outlet.quiet.handing_over().await;
    let mut batch = InFlight {
        _counted: outlet.quiet.in_flight(),
        claimed: rows.len(),
        full,
        started,
        sent: Vec::with_capacity(rows.len()),
        outcome: Outcome::default(),
        settled: Vec::with_capacity(rows.len()),
        refused: None,
        timed_out: false,
        admission: Admission::new(waiting),
    };
    for row in rows {
        if batch.refused.is_some() || !batch.admission.admit(&row) {
            continue;
        }
        let message = match outlet.router.message(&row) {
            Ok(message) => message,
            Err(reason) => {
                tracing::error!(event_id = %row.id, seq = row.seq, %reason, "event parked");
                batch.admission.refused(&row);
                batch.settled.push(row.position);
                batch.outcome.parked.push((row.key(), reason));
                continue;
            }
        };
        match outlet.sink.enqueue(&message).await {
            Ok(ack) => {
                batch.admission.sent(&row);
                batch.settled.push(row.position);
                batch.sent.push(Sent {
                    row,
                    topic: message.topic,
                    ack,
                    answer_by: Instant::now() + outlet.config.ack_timeout,
                    answer: None,
                });
            }
            // The broker refuses the relay itself: nothing more is sent.
            Err(e) if e.is_unavailable() => batch.refused = Some(e.message),
            Err(e) => {
                batch.admission.refused(&row);
                batch.settled.push(row.position);
                let verdict = if e.is_permanent() {
                    Verdict::Park(e.message)
                } else {
                    Verdict::Retry(e.message, e.retry_after)
                };
                record(outlet, &row, &message.topic, verdict, &mut batch.outcome);
            }
        }
    }
    Some(batch)
}

/// Awaits the broker's answers for a batch in flight, and sorts them into its outcome.
pub(crate) async fn answers(outlet: &Outlet<'_>, mut batch: InFlight) -> Answered {
    batch.read_answers(outlet.config.ack_timeout).await;
    let InFlight {
        claimed,
        full,
        started,
        sent,
        mut outcome,
        mut refused,
        admission,
        ..
    } = batch;
    let mut verdicts = admission.into_verdicts();
    for Sent {
        row, topic, answer, ..
    } in sent
    {
        let answer = answer.expect("every answer was read");
        if let Err(e) = &answer
            && e.is_unavailable()
        {
            refused.get_or_insert_with(|| e.message.clone());
        }
        let verdict = verdicts.verdict(&row, answer);
        record(outlet, &row, &topic, verdict, &mut outcome);
    }
    Answered {
        claimed,
        full,
        started,
        outcome,
        refused,
        waiting: verdicts.waiting(),
    }
}

/// Adds `row`'s verdict to the outcome: acked rows are published, permanent failures parked,
/// transient ones retried after a backoff that grows with the row's attempts.
fn record(
    outlet: &Outlet<'_>,
    row: &OutboxRow,
    topic: &str,
    verdict: Verdict,
    outcome: &mut Outcome,
) {
    match verdict {
        Verdict::Published => {
            metrics::published(topic, row.created_ms);
            outcome.published.push(row.key());
        }
        Verdict::Park(reason) => {
            tracing::error!(event_id = %row.id, %topic, error = %reason, "event parked");
            outcome.parked.push((row.key(), reason));
        }
        Verdict::Retry(error, asked) => {
            let attempt = usize::try_from(row.attempts).unwrap_or(0);
            let backoff = outlet
                .config
                .backoff()
                .nth(attempt)
                .unwrap_or(outlet.config.max_backoff);
            // The broker's own wait, if it asked for one, within reason.
            let retry_in = asked.map_or(backoff, |asked| asked.min(MAX_ASKED_WAIT).max(backoff));
            outcome.failed.push((row.key(), error, retry_in));
        }
        Verdict::Untouched => {}
    }
}

/// The longest wait a broker's `Retry-After` can impose on an event.
const MAX_ASKED_WAIT: std::time::Duration = std::time::Duration::from_secs(3600);

/// A batch handed to the sink, its answers still to come.
pub(crate) struct InFlight {
    claimed: usize,
    /// Whether its claim stopped at a limit with more rows waiting.
    pub full: bool,
    started: std::time::Instant,
    /// The rows sent, in the order they were sent, each with its ack.
    sent: Vec<Sent>,
    /// What was decided before sending: rows parked, or refused at enqueue.
    outcome: Outcome,
    /// The positions of every event this batch will settle (sent, parked or refused): the next
    /// claim skips them.
    pub settled: Vec<i64>,
    /// Why the broker refuses the relay, if it did at enqueue.
    refused: Option<String>,
    /// Whether a message went without an answer until its deadline: it may still be queued in
    /// the sink's client.
    timed_out: bool,
    /// Which rows were sent: what the answers are read against.
    admission: Admission,
    /// Counted in flight until its answers are read (see `quiet.rs`).
    _counted: InFlightToken,
}

impl InFlight {
    /// Reads the broker's answers as they come, keeping each one; a message without an answer
    /// by its deadline failed (`ack_timeout`). Cancel-safe: a later call goes on where this one
    /// stopped.
    pub async fn read_answers(&mut self, ack_timeout: Duration) {
        for sent in &mut self.sent {
            if sent.answer.is_none() {
                let answer = tokio::time::timeout_at(sent.answer_by, &mut sent.ack).await;
                self.timed_out |= answer.is_err();
                sent.answer = Some(answer.unwrap_or_else(|_| {
                    Err(SinkError::new(format!(
                        "no answer from the sink within {ack_timeout:?} (ack_timeout)"
                    )))
                }));
            }
        }
    }

    /// Awaits the answers of a batch the relay gives up on (its source was lost, so its rows will
    /// be claimed and sent again): whether the sink answered for every message in time, so that
    /// none is still queued in its client, to arrive after its own copy sent again.
    pub async fn answered_in_full(mut self, ack_timeout: Duration) -> bool {
        self.read_answers(ack_timeout).await;
        !self.timed_out
    }

    /// Whether every answer is in, reading those that came without waiting for the others.
    pub fn answered(&mut self, ack_timeout: Duration) -> bool {
        self.read_answers(ack_timeout).now_or_never().is_some()
    }

    /// The aggregates a batch sent before this one is answered must hold (ordering rule 4).
    pub fn unanswered(&self) -> Waiting {
        self.admission
            .unanswered(self.sent.iter().map(|sent| &sent.row))
    }
}

/// One sent row and the future of the broker's answer.
struct Sent {
    row: OutboxRow,
    topic: String,
    ack: Ack,
    /// Without an answer by then, the message failed (`ack_timeout`).
    answer_by: Instant,
    /// The answer, once read.
    answer: Option<Result<(), SinkError>>,
}

/// The batch that was in flight when the next one was claimed.
pub(crate) enum Before {
    /// Its answers were read before the next batch was sent.
    Answered(Answered),
    /// Still waiting for answers when the next batch was sent; with the aggregates that batch
    /// must hold.
    Unanswered(InFlight, Waiting),
}

/// A batch whose answers are all in.
pub(crate) struct Answered {
    pub claimed: usize,
    pub full: bool,
    pub started: std::time::Instant,
    pub outcome: Outcome,
    pub refused: Option<String>,
    /// The aggregates the next batch must hold.
    pub waiting: Waiting,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RelayConfig;
    use crate::quiet::QuietGate;
    use crate::routing::{DEFAULT_TOPIC_TEMPLATE, Router};
    use crate::sink::{Message, Sink};
    use futures::future::BoxFuture;

    /// Answers every message at once, except those of key "silent", which it never answers.
    struct SilentOn;

    impl Sink for SilentOn {
        fn name(&self) -> &str {
            "silent on one key"
        }
        fn enqueue<'a>(&'a self, message: &'a Message) -> BoxFuture<'a, Result<Ack, SinkError>> {
            let ack: Ack = if message.key == "silent" {
                Box::pin(std::future::pending())
            } else {
                Box::pin(std::future::ready(Ok(())))
            };
            Box::pin(std::future::ready(Ok(ack)))
        }
    }

    async fn sent(keys: &[&str]) -> bool {
        let mut config = RelayConfig::new("postgres://db/shop");
        config.ack_timeout = Duration::from_millis(100);
        let (router, quiet) = (
            Router::new(DEFAULT_TOPIC_TEMPLATE, false),
            QuietGate::default(),
        );
        let outlet = Outlet {
            config: &config,
            router: &router,
            sink: &SilentOn,
            quiet: &quiet,
        };
        let rows = (0..)
            .zip(keys)
            .map(|(seq, key)| {
                let mut row = OutboxRow::for_test(key, seq, 0);
                row.id = uuid::Uuid::now_v7().to_string();
                row
            })
            .collect();
        let batch = send(
            &outlet,
            rows,
            false,
            Waiting::default(),
            std::time::Instant::now(),
        )
        .await
        .expect("a batch in flight");
        batch.answered_in_full(config.ack_timeout).await
    }

    #[tokio::test]
    async fn a_batch_given_up_on_is_answered_in_full_only_when_no_answer_timed_out() {
        assert!(sent(&["a", "b", "a"]).await);
        assert!(!sent(&["a", "silent", "b"]).await);
    }
}
