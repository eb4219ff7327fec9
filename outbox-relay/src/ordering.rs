//! Per-aggregate order, kept in one place: which claimed events are sent, and what becomes of each
//! one once the broker answered.
//!
//! The relay sends a batch in `seq` order and claims the next batch while the broker answers for
//! this one (see `relay.rs`). The rules, for one aggregate:
//!
//! 1. **After a failure, nothing later goes out.** Once an event of the aggregate is parked,
//!    refused at enqueue, or failed at the broker, its later events are not sent, and those already
//!    sent are not marked even if acked: they go out again after it.
//! 2. **A retry goes alone.** An event that failed before is the aggregate's only event in its
//!    batch, so no later event can overtake it if it fails again.
//! 3. **What failed in one batch holds the next.** The next batch was claimed before this one's
//!    failures were written, so the aggregates with a failure in this batch are held in the next
//!    one too (their events left untouched, for a claim that sees the failure).
//! 4. **What is unanswered holds the next.** A batch may be sent before the one in flight is
//!    answered (at a low rate the relay does not wait for a slow answer, and at full rate it does
//!    not wait when the new batch has no event of the aggregates in flight): it holds every
//!    aggregate that the batch in flight sent or refused an event of, whatever the answers will be.
//!
//! Held events are left untouched: a later claim finds them again, in `seq` order.

use crate::row::{Aggregate, OutboxRow};
use crate::sink::{FailureKind, SinkError};
use std::collections::HashSet;

fn aggregate(row: &OutboxRow) -> Aggregate {
    row.aggregate()
}

/// Aggregates whose events must not be sent in the next batch (rules 3 and 4).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Waiting(HashSet<Aggregate>);

impl Waiting {
    /// Whether `row`'s aggregate waits.
    pub fn holds(&self, row: &OutboxRow) -> bool {
        !self.0.is_empty() && self.0.contains(&aggregate(row))
    }
}

/// Decides, row by row in `seq` order, which events of a batch are handed to the sink.
#[derive(Debug)]
pub(crate) struct Admission {
    /// Aggregates whose later events in this batch are held.
    held: HashSet<Aggregate>,
    /// Aggregates with an event parked or refused at enqueue: they wait in the next batch.
    failed: HashSet<Aggregate>,
}

impl Admission {
    /// Starts a batch, holding the aggregates that wait from the batch before.
    pub fn new(waiting: Waiting) -> Self {
        Admission {
            held: waiting.0,
            failed: HashSet::new(),
        }
    }

    /// Whether `row` may be sent now. `false` leaves it untouched, for a later batch.
    pub fn admit(&self, row: &OutboxRow) -> bool {
        // Most batches hold nothing: no key is built then.
        self.held.is_empty() || !self.held.contains(&aggregate(row))
    }

    /// `row` was handed to the sink. A retried event goes out alone (rule 2).
    pub fn sent(&mut self, row: &OutboxRow) {
        if row.attempts > 0 {
            self.held.insert(aggregate(row));
        }
    }

    /// `row` was not handed to the sink: it is parked, or the sink refused it. Its aggregate's
    /// later events wait (rule 1), in this batch and the next.
    pub fn refused(&mut self, row: &OutboxRow) {
        self.held.insert(aggregate(row));
        self.failed.insert(aggregate(row));
    }

    /// The aggregates a batch sent before this one is answered must hold (rule 4): those of
    /// `sent` (this batch's sent rows) and those refused or parked here.
    pub fn unanswered<'r>(&self, sent: impl IntoIterator<Item = &'r OutboxRow>) -> Waiting {
        let mut waiting: HashSet<Aggregate> = sent.into_iter().map(aggregate).collect();
        waiting.extend(self.failed.iter().cloned());
        Waiting(waiting)
    }

    /// Done enqueueing: what the broker's answers are read against.
    pub fn into_verdicts(self) -> Verdicts {
        Verdicts {
            failed: HashSet::new(),
            refused: self.failed,
        }
    }
}

/// What becomes of a sent row, once the broker answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Acked: mark it published (or delete it).
    Published,
    /// Failed, may work later: count the attempt and retry after a backoff (no sooner than the
    /// broker asked, if it did).
    Retry(String, Option<std::time::Duration>),
    /// Can never work as it is: park it.
    Park(String),
    /// Leave it as it is: acked or not, an earlier event of its aggregate failed (rule 1), or the
    /// broker refuses the relay itself.
    Untouched,
}

/// Reads the broker's answers for one batch, in the order its rows were sent.
#[derive(Debug)]
pub(crate) struct Verdicts {
    /// Aggregates with a sent event that did not go through.
    failed: HashSet<Aggregate>,
    /// Aggregates with an event parked or refused at enqueue. Nothing of theirs was sent after
    /// it, so they do not change the verdicts; they wait in the next batch.
    refused: HashSet<Aggregate>,
}

impl Verdicts {
    /// What becomes of `row`, given the broker's answer for it.
    pub fn verdict(&mut self, row: &OutboxRow, answer: Result<(), SinkError>) -> Verdict {
        // Most batches fail nothing: no key is built then.
        if !self.failed.is_empty() && self.failed.contains(&aggregate(row)) {
            return Verdict::Untouched;
        }
        match answer {
            Ok(()) => Verdict::Published,
            Err(e) => {
                self.failed.insert(aggregate(row));
                match e.kind {
                    FailureKind::Permanent => Verdict::Park(e.message),
                    FailureKind::Unavailable => Verdict::Untouched,
                    _ => Verdict::Retry(e.message, e.retry_after),
                }
            }
        }
    }

    /// The aggregates the next batch must hold (rule 3).
    pub fn waiting(mut self) -> Waiting {
        self.failed.extend(self.refused);
        Waiting(self.failed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(aggregate_id: &str, seq: i64, attempts: i32) -> OutboxRow {
        OutboxRow::for_test(aggregate_id, seq, attempts)
    }

    /// Enqueues `rows` as the relay does, the sink refusing the rows in `refused_seqs`: the seqs
    /// sent, and the admission afterwards.
    fn enqueue(
        rows: &[OutboxRow],
        waiting: Waiting,
        refused_seqs: &[i64],
    ) -> (Vec<i64>, Admission) {
        let mut admission = Admission::new(waiting);
        let mut sent = Vec::new();
        for row in rows {
            if !admission.admit(row) {
                continue;
            }
            if refused_seqs.contains(&row.seq) {
                admission.refused(row);
            } else {
                admission.sent(row);
                sent.push(row.seq);
            }
        }
        (sent, admission)
    }

    #[test]
    fn every_row_goes_out_when_nothing_fails() {
        let rows = [row("a", 1, 0), row("a", 2, 0), row("b", 3, 0)];
        let (sent, _) = enqueue(&rows, Waiting::default(), &[]);
        assert_eq!(sent, [1, 2, 3]);
    }

    #[test]
    fn a_refused_row_holds_its_aggregates_later_rows_only() {
        let rows = [
            row("a", 1, 0),
            row("a", 2, 0),
            row("b", 3, 0),
            row("a", 4, 0),
        ];
        let (sent, admission) = enqueue(&rows, Waiting::default(), &[2]);
        assert_eq!(sent, [1, 3]);
        // and the next batch holds it too
        let waiting = admission.into_verdicts().waiting();
        let (sent, _) = enqueue(&[row("a", 5, 0), row("b", 6, 0)], waiting, &[]);
        assert_eq!(sent, [6]);
    }

    #[test]
    fn an_event_sent_before_its_aggregates_refused_one_is_published() {
        let rows = [row("a", 1, 0), row("a", 2, 0), row("a", 3, 0)];
        let (sent, admission) = enqueue(&rows, Waiting::default(), &[2]);
        assert_eq!(sent, [1]);
        let mut verdicts = admission.into_verdicts();
        assert_eq!(verdicts.verdict(&rows[0], Ok(())), Verdict::Published);
        let (sent, _) = enqueue(&[row("a", 3, 0)], verdicts.waiting(), &[]);
        assert!(sent.is_empty(), "a waits in the next batch");
    }

    #[test]
    fn a_retry_goes_alone_for_its_aggregate() {
        let rows = [
            row("a", 1, 3),
            row("a", 2, 0),
            row("b", 3, 2),
            row("c", 4, 0),
        ];
        let (sent, admission) = enqueue(&rows, Waiting::default(), &[]);
        assert_eq!(sent, [1, 3, 4]);
        // a retry that was only held back does not hold the next batch
        assert_eq!(admission.into_verdicts().waiting(), Waiting::default());
    }

    #[test]
    fn after_a_failed_ack_the_aggregates_later_acks_are_not_taken() {
        let rows = [
            row("a", 1, 0),
            row("a", 2, 0),
            row("b", 3, 0),
            row("a", 4, 0),
        ];
        let mut verdicts = Admission::new(Waiting::default()).into_verdicts();
        let answers = [
            Err(SinkError::new("timed out")),
            Ok(()),
            Ok(()),
            Err(SinkError::permanent("too large")),
        ];
        let got: Vec<Verdict> = rows
            .iter()
            .zip(answers)
            .map(|(row, answer)| verdicts.verdict(row, answer))
            .collect();
        assert_eq!(
            got,
            [
                Verdict::Retry("timed out".into(), None),
                Verdict::Untouched,
                Verdict::Published,
                Verdict::Untouched,
            ]
        );
        let (sent, _) = enqueue(&[row("a", 5, 0), row("b", 6, 0)], verdicts.waiting(), &[]);
        assert_eq!(sent, [6]);
    }

    #[test]
    fn permanent_failures_park_and_refusals_touch_nothing() {
        let mut verdicts = Admission::new(Waiting::default()).into_verdicts();
        assert_eq!(
            verdicts.verdict(&row("a", 1, 0), Err(SinkError::permanent("unknown topic"))),
            Verdict::Park("unknown topic".into())
        );
        assert_eq!(
            verdicts.verdict(&row("b", 2, 0), Err(SinkError::unavailable("bad password"))),
            Verdict::Untouched
        );
        assert_eq!(
            verdicts.verdict(&row("c", 3, 0), Ok(())),
            Verdict::Published
        );
        let (sent, _) = enqueue(
            &[row("a", 4, 0), row("b", 5, 0), row("c", 6, 0)],
            verdicts.waiting(),
            &[],
        );
        assert_eq!(sent, [6]);
    }

    #[test]
    fn an_aggregate_that_went_through_is_not_held_next_time() {
        let mut verdicts = Admission::new(Waiting::default()).into_verdicts();
        assert_eq!(
            verdicts.verdict(&row("a", 1, 0), Ok(())),
            Verdict::Published
        );
        assert_eq!(
            verdicts.verdict(&row("a", 2, 0), Ok(())),
            Verdict::Published
        );
        assert_eq!(verdicts.waiting(), Waiting::default());
    }

    #[test]
    fn a_batch_sent_before_the_last_one_was_answered_holds_its_aggregates() {
        let rows = [
            row("a", 1, 0),
            row("b", 2, 0),
            row("c", 3, 0),
            row("c", 4, 0),
        ];
        let (sent, admission) = enqueue(&rows, Waiting::default(), &[3]);
        assert_eq!(sent, [1, 2]);
        let in_flight: Vec<&OutboxRow> = rows.iter().filter(|r| sent.contains(&r.seq)).collect();
        let waiting = admission.unanswered(in_flight);
        let next = [
            row("a", 5, 0),
            row("b", 6, 0),
            row("c", 7, 0),
            row("d", 8, 0),
        ];
        let (sent, _) = enqueue(&next, waiting, &[]);
        assert_eq!(
            sent,
            [8],
            "a and b are unanswered, c was refused: only d goes"
        );
    }

    mod any_batch {
        //! Property: whatever the sink refuses at enqueue and answers later, and whatever waits
        //! from the batch before, an aggregate's published events in a batch are a prefix of its
        //! events in that batch (nothing is marked after one of its events that was not), and an
        //! aggregate with an event sent or refused but not published waits in the next batch.
        use super::*;
        use proptest::prelude::*;

        /// One claimed row: aggregate 0-3, attempts 0 or 1, refused at enqueue, and the answer
        /// (0 ok, 1 transient, 2 permanent, 3 unavailable).
        type Spec = (u8, bool, bool, u8);

        proptest! {
            #[test]
            fn published_events_are_a_prefix_per_aggregate(
                specs in proptest::collection::vec((0u8..4, any::<bool>(), any::<bool>(), 0u8..4), 0..40),
                waiting in proptest::collection::btree_set(0u8..4, 0..3),
            ) {
                let rows: Vec<(OutboxRow, Spec)> = specs
                    .iter()
                    .enumerate()
                    .map(|(i, spec)| (row(&format!("a{}", spec.0), i as i64, i32::from(spec.1)), *spec))
                    .collect();
                let waiting = Waiting(
                    waiting.iter().map(|a| ("order".to_owned(), format!("a{a}"))).collect(),
                );
                let mut admission = Admission::new(waiting.clone());
                let mut sent = Vec::new();
                // What became of each row: Some(true) published, Some(false) settled otherwise,
                // None untouched.
                let mut fate: Vec<Option<bool>> = vec![None; rows.len()];
                for (i, (row, spec)) in rows.iter().enumerate() {
                    if !admission.admit(row) {
                        continue;
                    }
                    if spec.2 {
                        admission.refused(row);
                        fate[i] = Some(false);
                    } else {
                        admission.sent(row);
                        sent.push(i);
                    }
                }
                let mut verdicts = admission.into_verdicts();
                for &i in &sent {
                    let (row, spec) = &rows[i];
                    let answer = match spec.3 {
                        0 => Ok(()),
                        1 => Err(SinkError::new("timeout")),
                        2 => Err(SinkError::permanent("too large")),
                        _ => Err(SinkError::unavailable("refused")),
                    };
                    fate[i] = match verdicts.verdict(row, answer) {
                        Verdict::Published => Some(true),
                        Verdict::Untouched => None,
                        _ => Some(false),
                    };
                }
                let next = verdicts.waiting();
                for a in 0..4u8 {
                    let aggregate = ("order".to_owned(), format!("a{a}"));
                    let fates: Vec<Option<bool>> = rows
                        .iter()
                        .enumerate()
                        .filter(|(_, (_, spec))| spec.0 == a)
                        .map(|(i, _)| fate[i])
                        .collect();
                    let published = fates.iter().take_while(|f| **f == Some(true)).count();
                    prop_assert!(
                        fates[published..].iter().all(|f| *f != Some(true)),
                        "a{a}: {fates:?}"
                    );
                    if waiting.0.contains(&aggregate) {
                        prop_assert!(fates.iter().all(Option::is_none), "a{a} waits: {fates:?}");
                    }
                    let failed = rows.iter().enumerate().any(|(i, (_, spec))| {
                        spec.0 == a && sent.contains(&i) && fate[i] != Some(true)
                    }) || fates.contains(&Some(false));
                    prop_assert_eq!(next.0.contains(&aggregate), failed, "a{}: {:?}", a, fates);
                }
            }
        }
    }
}
