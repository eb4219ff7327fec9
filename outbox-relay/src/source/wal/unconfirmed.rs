//! What the WAL source has read and not yet confirmed, in stream order: events with the broker's
//! answers as they come, and the commits whose position can be confirmed once everything before
//! them is answered.
//!
//! It also keeps each aggregate's order, as the polling relay's rule 4 does (`ordering.rs`): while
//! an event of an aggregate is unanswered, its later events are held here, not handed to the sink;
//! they go out together once every earlier event of the aggregate was acknowledged. So a producer
//! that times out an early event and delivers a later one (librdkafka's idempotent producer does,
//! after a timeout it bumps its epoch and sends what it still queues) can never put an aggregate's
//! later event first: the later one was never handed to it. After a permanent failure the
//! aggregate's held events are not sent at all; they park behind the failed one.

use crate::row::OutboxRow;
use crate::sink::{Ack, Message, SinkError};
use futures::FutureExt;
use futures::future::BoxFuture;
use futures::stream::{FuturesUnordered, StreamExt};
use pgwire_replication::Lsn;
use std::collections::{HashMap, VecDeque};
use std::time::Duration;

type Aggregate = (String, String);

fn aggregate(row: &OutboxRow) -> Aggregate {
    (row.aggregate_type.clone(), row.aggregate_id.clone())
}

/// What became of an event.
#[derive(Debug)]
pub(super) enum Answer {
    /// The sink's answer.
    Sink(Result<(), SinkError>),
    /// Never sent: an earlier event of its aggregate failed for good. It is held behind it.
    Held,
}

/// An entry taken from the front of the stream, everything before it settled.
// Nearly every entry is an event: boxing the row would add an allocation per event to save
// space on the few commits.
#[allow(clippy::large_enum_variant)]
pub(super) enum Settled {
    /// An event and what became of it.
    Event {
        row: OutboxRow,
        topic: String,
        answer: Answer,
    },
    /// A transaction's end: its position may be confirmed.
    Commit { lsn: Lsn, commit_ms: Option<i64> },
}

#[allow(clippy::large_enum_variant)] // as `Settled`
enum Entry {
    Event {
        row: OutboxRow,
        topic: String,
        /// Held events keep their message until they are sent.
        message: Option<Message>,
        answer: Option<Answer>,
    },
    Commit {
        lsn: Lsn,
        commit_ms: Option<i64>,
    },
}

/// One aggregate with events unanswered or held.
#[derive(Default)]
struct Pending {
    /// Events handed to the sink and not yet answered.
    unanswered: usize,
    /// Stream positions of the events held back, in order.
    held: Vec<u64>,
    /// An event failed for good: what follows is held for good.
    failed: bool,
}

/// The unconfirmed part of the stream (see the module's doc).
pub(super) struct Unconfirmed {
    entries: VecDeque<Entry>,
    /// The stream position of `entries[0]`.
    first: u64,
    events: usize,
    acks: FuturesUnordered<BoxFuture<'static, (u64, Result<(), SinkError>)>>,
    pending: HashMap<Aggregate, Pending>,
    ack_timeout: Duration,
    /// Whether an aggregate's later events wait behind a failed one (not with `skip_parked`).
    hold_after_failure: bool,
}

impl Unconfirmed {
    pub fn new(ack_timeout: Duration, hold_after_failure: bool) -> Self {
        Unconfirmed {
            entries: VecDeque::new(),
            first: 0,
            events: 0,
            acks: FuturesUnordered::new(),
            pending: HashMap::new(),
            ack_timeout,
            hold_after_failure,
        }
    }

    /// Events read and not yet taken out.
    pub fn events(&self) -> usize {
        self.events
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    fn next_position(&self) -> u64 {
        self.first + self.entries.len() as u64
    }

    /// Whether `row` may be handed to the sink now: nothing of its aggregate is unanswered or held.
    pub fn may_send(&self, row: &OutboxRow) -> bool {
        !self.pending.contains_key(&aggregate(row))
    }

    /// An event handed to the sink, with its acknowledgement.
    pub fn sent(&mut self, row: OutboxRow, topic: String, ack: Ack) {
        let position = self.next_position();
        self.pending.entry(aggregate(&row)).or_default().unanswered += 1;
        self.watch(position, ack);
        self.push_event(row, topic, None, None);
    }

    /// An event the sink refused at enqueue: answered already.
    /// Only permanent refusals come here (a transient one stops the stream): the aggregate's later
    /// events are held for good.
    pub fn refused(&mut self, row: OutboxRow, topic: String, error: SinkError) {
        if self.hold_after_failure {
            self.pending.entry(aggregate(&row)).or_default().failed = true;
        }
        self.push_event(row, topic, None, Some(Answer::Sink(Err(error))));
    }

    /// An event held back behind an earlier one of its aggregate.
    pub fn hold(&mut self, row: OutboxRow, message: Message) {
        let position = self.next_position();
        let pending = self.pending.entry(aggregate(&row)).or_default();
        let answer = pending.failed.then_some(Answer::Held);
        if answer.is_none() {
            pending.held.push(position);
        }
        let topic = message.topic.clone();
        self.push_event(row, topic, Some(message), answer);
    }

    /// An event of an aggregate held behind a parked event: never sent; it settles in stream
    /// order, so held events are kept in the order they were read.
    pub fn held_back(&mut self, row: OutboxRow) {
        self.push_event(row, String::new(), None, Some(Answer::Held));
    }

    pub fn commit(&mut self, lsn: Lsn, commit_ms: Option<i64>) {
        self.entries.push_back(Entry::Commit { lsn, commit_ms });
    }

    fn push_event(
        &mut self,
        row: OutboxRow,
        topic: String,
        message: Option<Message>,
        answer: Option<Answer>,
    ) {
        self.events += 1;
        self.entries.push_back(Entry::Event {
            row,
            topic,
            message,
            answer,
        });
    }

    fn watch(&mut self, position: u64, ack: Ack) {
        let timeout = self.ack_timeout;
        self.acks.push(
            async move {
                let answer = tokio::time::timeout(timeout, ack)
                    .await
                    .unwrap_or_else(|_| {
                        Err(SinkError::new(format!(
                            "no answer from the sink within {timeout:?} (ack_timeout)"
                        )))
                    });
                (position, answer)
            }
            .boxed(),
        );
    }

    /// The next answer from the sink (pending while nothing is unanswered). Returns the events of
    /// its aggregate that may go out now, in order: those held behind it once the aggregate has
    /// nothing unanswered left. A transient failure is returned as the error: the stream stops.
    pub async fn next_answer(&mut self) -> Result<Vec<(u64, Message)>, SinkError> {
        let Some((position, answer)) = self.acks.next().await else {
            return std::future::pending().await;
        };
        let hold_after_failure = self.hold_after_failure;
        let Some(Entry::Event {
            row, answer: slot, ..
        }) = self.entry_mut(position)
        else {
            unreachable!("an answer for a position that holds no event");
        };
        let aggregate = aggregate(row);
        let failed_for_good = match &answer {
            Ok(()) => false,
            Err(e) if e.is_permanent() => hold_after_failure,
            Err(e) => return Err(e.clone()),
        };
        *slot = Some(Answer::Sink(answer));
        let pending = self
            .pending
            .get_mut(&aggregate)
            .expect("an unanswered aggregate");
        pending.unanswered -= 1;
        pending.failed |= failed_for_good;
        if pending.unanswered > 0 {
            return Ok(Vec::new());
        }
        let pending = self.pending.remove(&aggregate).expect("just seen");
        if pending.failed {
            for position in pending.held {
                if let Some(Entry::Event { answer, .. }) = self.entry_mut(position) {
                    *answer = Some(Answer::Held);
                }
            }
            // Later events of the aggregate wait behind the failed one too.
            self.pending.insert(
                aggregate,
                Pending {
                    failed: true,
                    ..Pending::default()
                },
            );
            return Ok(Vec::new());
        }
        let mut release = Vec::with_capacity(pending.held.len());
        for position in pending.held {
            if let Some(Entry::Event { message, .. }) = self.entry_mut(position) {
                release.push((position, message.take().expect("a held event's message")));
            }
        }
        Ok(release)
    }

    /// Whether the aggregate of the event at `position` failed for good: a released event of it
    /// is not sent.
    pub fn failed_at(&self, position: u64) -> bool {
        match self.entry(position) {
            Some(Entry::Event { row, .. }) => self
                .pending
                .get(&aggregate(row))
                .is_some_and(|pending| pending.failed),
            _ => false,
        }
    }

    /// What became of a held event that [`next_answer`](Self::next_answer) released: handed to
    /// the sink (`Some(Ok)`), refused by it for good (`Some(Err)`), or not sent because its
    /// aggregate failed meanwhile (`None`).
    pub fn released(&mut self, position: u64, sent: Option<Result<Ack, SinkError>>) {
        let hold_after_failure = self.hold_after_failure;
        let Some(Entry::Event { row, answer, .. }) = self.entry_mut(position) else {
            unreachable!("a released position that holds no event");
        };
        let aggregate = aggregate(row);
        match sent {
            None => *answer = Some(Answer::Held),
            Some(Err(e)) => {
                *answer = Some(Answer::Sink(Err(e)));
                self.pending.entry(aggregate).or_default().failed |= hold_after_failure;
            }
            Some(Ok(ack)) => {
                self.pending.entry(aggregate).or_default().unanswered += 1;
                self.watch(position, ack);
            }
        }
    }

    /// Takes the front entry once it is settled: an answered event, or a commit.
    pub fn pop_settled(&mut self) -> Option<Settled> {
        let settled = match self.entries.front()? {
            Entry::Event { answer: None, .. } => return None,
            _ => self.entries.pop_front().expect("a front entry"),
        };
        self.first += 1;
        Some(match settled {
            Entry::Event {
                row,
                topic,
                answer: Some(answer),
                ..
            } => {
                self.events -= 1;
                // An aggregate held for good stops being held here once its failure is settled:
                // the source's parked set holds it from then on.
                if matches!(answer, Answer::Sink(Err(_)) | Answer::Held) {
                    let key = aggregate(&row);
                    if self
                        .pending
                        .get(&key)
                        .is_some_and(|p| p.failed && p.unanswered == 0 && p.held.is_empty())
                    {
                        self.pending.remove(&key);
                    }
                }
                Settled::Event { row, topic, answer }
            }
            Entry::Event { answer: None, .. } => unreachable!("checked above"),
            Entry::Commit { lsn, commit_ms } => Settled::Commit { lsn, commit_ms },
        })
    }

    fn entry(&self, position: u64) -> Option<&Entry> {
        let index = usize::try_from(position.checked_sub(self.first)?).ok()?;
        self.entries.get(index)
    }

    fn entry_mut(&mut self, position: u64) -> Option<&mut Entry> {
        let index = usize::try_from(position.checked_sub(self.first)?).ok()?;
        self.entries.get_mut(index)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::channel::oneshot;

    fn row(aggregate_id: &str, seq: i64) -> OutboxRow {
        OutboxRow::for_test(aggregate_id, seq, 0)
    }

    fn message(seq: i64) -> Message {
        let mut message = Message::example();
        message.seq = seq;
        message
    }

    /// An ack the test answers through the sender.
    fn ack() -> (oneshot::Sender<Result<(), SinkError>>, Ack) {
        let (tx, rx) = oneshot::channel();
        (tx, async move { rx.await.expect("answered") }.boxed())
    }

    /// Reads `row` as the WAL source does: sent when its aggregate has nothing pending, else held.
    fn read(u: &mut Unconfirmed, row: OutboxRow) -> Option<oneshot::Sender<Result<(), SinkError>>> {
        if u.may_send(&row) {
            let (tx, ack) = ack();
            u.sent(row, "t".into(), ack);
            Some(tx)
        } else {
            let seq = row.seq;
            u.hold(row, message(seq));
            None
        }
    }

    fn settled_seqs(u: &mut Unconfirmed) -> Vec<(i64, &'static str)> {
        std::iter::from_fn(|| u.pop_settled())
            .filter_map(|settled| match settled {
                Settled::Event { row, answer, .. } => Some((
                    row.seq,
                    match answer {
                        Answer::Sink(Ok(())) => "published",
                        Answer::Sink(Err(_)) => "failed",
                        Answer::Held => "held",
                    },
                )),
                Settled::Commit { .. } => None,
            })
            .collect()
    }

    #[tokio::test]
    async fn a_later_event_waits_for_the_earlier_ones_answer_and_others_do_not() {
        let mut u = Unconfirmed::new(Duration::from_secs(60), true);
        let a1 = read(&mut u, row("a", 1)).expect("sent");
        assert!(read(&mut u, row("a", 2)).is_none(), "a2 waits for a1");
        let b3 = read(&mut u, row("b", 3)).expect("b does not wait for a");
        assert!(read(&mut u, row("a", 4)).is_none(), "a4 waits with a2");
        u.commit(Lsn::from(10), None);

        b3.send(Ok(())).unwrap();
        assert!(u.next_answer().await.unwrap().is_empty());
        assert!(settled_seqs(&mut u).is_empty(), "a1 is unanswered");
        a1.send(Ok(())).unwrap();
        let released = u.next_answer().await.unwrap();
        let seqs: Vec<i64> = released.iter().map(|(_, m)| m.seq).collect();
        assert_eq!(seqs, [2, 4], "a's held events go out together, in order");
        let mut answers = Vec::new();
        for (position, _) in released {
            let (tx, ack) = ack();
            u.released(position, Some(Ok(ack)));
            answers.push(tx);
        }
        assert!(
            read(&mut u, row("a", 5)).is_none(),
            "a5 waits for a2 and a4"
        );
        assert_eq!(settled_seqs(&mut u), [(1, "published")]);
        for tx in answers {
            tx.send(Ok(())).unwrap();
        }
        u.next_answer().await.unwrap();
        let released = u.next_answer().await.unwrap();
        assert_eq!(released.len(), 1, "a5 goes once a2 and a4 are answered");
        assert_eq!(
            settled_seqs(&mut u),
            [(2, "published"), (3, "published"), (4, "published")]
        );
    }

    #[tokio::test]
    async fn after_a_permanent_failure_the_aggregates_later_events_are_never_sent() {
        let mut u = Unconfirmed::new(Duration::from_secs(60), true);
        let a1 = read(&mut u, row("a", 1)).expect("sent");
        assert!(read(&mut u, row("a", 2)).is_none());
        a1.send(Err(SinkError::permanent("too large"))).unwrap();
        assert!(
            u.next_answer().await.unwrap().is_empty(),
            "a2 is not released"
        );
        assert!(read(&mut u, row("a", 3)).is_none(), "a3 is held too");
        assert_eq!(
            settled_seqs(&mut u),
            [(1, "failed"), (2, "held"), (3, "held")]
        );
    }

    #[tokio::test]
    async fn with_skip_parked_the_later_events_go_out_after_a_permanent_failure() {
        let mut u = Unconfirmed::new(Duration::from_secs(60), false);
        let a1 = read(&mut u, row("a", 1)).expect("sent");
        assert!(read(&mut u, row("a", 2)).is_none());
        a1.send(Err(SinkError::permanent("too large"))).unwrap();
        assert_eq!(u.next_answer().await.unwrap().len(), 1);
    }

    #[tokio::test]
    async fn a_transient_failure_stops_the_stream() {
        let mut u = Unconfirmed::new(Duration::from_secs(60), true);
        let a1 = read(&mut u, row("a", 1)).expect("sent");
        assert!(read(&mut u, row("a", 2)).is_none());
        a1.send(Err(SinkError::new("timed out"))).unwrap();
        assert!(u.next_answer().await.is_err());
    }

    #[tokio::test]
    async fn a_commit_is_settled_once_everything_before_it_is_answered() {
        let mut u = Unconfirmed::new(Duration::from_secs(60), true);
        let a1 = read(&mut u, row("a", 1)).expect("sent");
        u.commit(Lsn::from(10), None);
        assert!(u.pop_settled().is_none());
        a1.send(Ok(())).unwrap();
        u.next_answer().await.unwrap();
        assert!(matches!(u.pop_settled(), Some(Settled::Event { .. })));
        assert!(matches!(
            u.pop_settled(),
            Some(Settled::Commit { lsn, .. }) if lsn == Lsn::from(10)
        ));
        assert!(u.is_empty());
    }
}
