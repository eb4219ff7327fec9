//! The pipelined loop: the next claim runs while the broker answers for the batch in flight, the
//! next batch goes out before that answer when it needs none of it, and the loop still sends no
//! event twice while nothing fails, in order per aggregate.

mod common;

use common::Fixture;
use futures::future::BoxFuture;
use seaorm_outbox::sea_orm::ConnectionTrait;
use seaorm_outbox_relay::Relay;
use seaorm_outbox_relay::sink::{Ack, Message, Sink, SinkError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// What the broker saw, in order: a message handed over, or its answer read by the relay.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Seen {
    Enqueued(String, i64),
    Acked(String, i64),
}

/// Acks each message `delay` after it was enqueued, as a distant broker would; notes what was
/// enqueued and when the relay read each answer, in order.
#[derive(Clone)]
struct SlowBroker {
    delay: Duration,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl SlowBroker {
    fn new(delay: Duration) -> Self {
        SlowBroker {
            delay,
            seen: Arc::default(),
        }
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    /// The keys and seqs enqueued, in order.
    fn enqueued(&self) -> Vec<(String, i64)> {
        self.seen()
            .into_iter()
            .filter_map(|seen| match seen {
                Seen::Enqueued(key, seq) => Some((key, seq)),
                Seen::Acked(..) => None,
            })
            .collect()
    }
}

impl Sink for SlowBroker {
    fn name(&self) -> &str {
        "slow"
    }

    fn enqueue<'a>(&'a self, message: &'a Message) -> BoxFuture<'a, Result<Ack, SinkError>> {
        let (key, seq) = (message.key.clone(), message.seq);
        self.seen
            .lock()
            .unwrap()
            .push(Seen::Enqueued(key.clone(), seq));
        // The broker's answer comes `delay` after the send, whenever the relay looks at it.
        let answered_at = tokio::time::Instant::now() + self.delay;
        let seen = self.seen.clone();
        let ack: Ack = Box::pin(async move {
            tokio::time::sleep_until(answered_at).await;
            seen.lock().unwrap().push(Seen::Acked(key, seq));
            Ok(())
        });
        Box::pin(async move { Ok(ack) })
    }
}

#[tokio::test]
async fn claims_overlapping_the_acks_send_each_event_once_and_in_order() {
    let f = Fixture::new().await;
    f.db.execute_unprepared(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
         SELECT gen_random_uuid(), 'cart', 'c-' || (g % 7), 'CartChanged', jsonb_build_object('g', g)
         FROM generate_series(1, 1000) g",
    )
    .await
    .unwrap();
    let mut config = f.relay_config();
    config.batch_size = 50;
    let sink = SlowBroker::new(Duration::from_millis(20));
    let relay = Relay::new(config, sink.clone());
    let shutdown = CancellationToken::new();
    let running = tokio::spawn({
        let shutdown = shutdown.clone();
        async move { relay.run(shutdown).await.expect("the relay refused to run") }
    });
    let started = Instant::now();
    f.wait_until_drained(Duration::from_secs(60)).await;
    let elapsed = started.elapsed();
    shutdown.cancel();
    running.await.unwrap();

    let enqueued = sink.enqueued();
    let mut seqs: Vec<i64> = enqueued.iter().map(|(_, seq)| *seq).collect();
    seqs.sort_unstable();
    seqs.dedup();
    assert_eq!(seqs.len(), 1000, "every event was sent");
    assert_eq!(
        enqueued.len(),
        1000,
        "no event was sent twice while nothing failed"
    );
    for key in (0..7).map(|k| format!("c-{k}")) {
        let order: Vec<i64> = enqueued
            .iter()
            .filter(|(k, _)| *k == key)
            .map(|(_, seq)| *seq)
            .collect();
        assert!(order.is_sorted(), "{key}: {order:?}");
    }
    eprintln!("1000 events in batches of 50 with 20 ms acks: {elapsed:?}");
}

/// At full rate, a batch with no event of the aggregates in flight goes out before the batch in
/// flight is answered: the broker holds two batches at once. Each event is still sent once and
/// in order.
#[tokio::test]
async fn a_full_batch_of_other_aggregates_goes_out_before_the_one_in_flight_is_answered() {
    let f = Fixture::new().await;
    // Consecutive batches of 50 share no aggregate: 1000 aggregates, one event each in turn.
    f.db.execute_unprepared(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
         SELECT gen_random_uuid(), 'cart', 'c-' || (g % 1000), 'CartChanged', jsonb_build_object('g', g)
         FROM generate_series(0, 1999) g",
    )
    .await
    .unwrap();
    let mut config = f.relay_config();
    config.batch_size = 50;
    let sink = SlowBroker::new(Duration::from_millis(50));
    let relay = Relay::new(config, sink.clone());
    let shutdown = CancellationToken::new();
    let running = tokio::spawn({
        let shutdown = shutdown.clone();
        async move { relay.run(shutdown).await.expect("the relay refused to run") }
    });
    f.wait_until_drained(Duration::from_secs(60)).await;
    shutdown.cancel();
    running.await.unwrap();

    let seen = sink.seen();
    let (mut outstanding, mut most) = (0usize, 0usize);
    for s in &seen {
        match s {
            Seen::Enqueued(..) => outstanding += 1,
            Seen::Acked(..) => outstanding -= 1,
        }
        most = most.max(outstanding);
    }
    assert!(
        most > 50,
        "at most {most} messages awaited their answers: the relay waited for each full batch"
    );
    assert!(
        most <= 100,
        "{most} messages in flight: more than two batches"
    );
    let enqueued = sink.enqueued();
    assert_eq!(enqueued.len(), 2000, "no event was sent twice");
    let mut by_key: std::collections::HashMap<String, Vec<i64>> = Default::default();
    for (key, seq) in enqueued {
        by_key.entry(key).or_default().push(seq);
    }
    assert_eq!(by_key.len(), 1000);
    for (key, seqs) in by_key {
        assert!(seqs.is_sorted(), "{key}: {seqs:?}");
    }
}

/// At a low rate the loop does not wait for a slow answer before it claims and sends again: an
/// event of another aggregate committed meanwhile goes out before that answer, and the next event
/// of the aggregate waiting for it only after it (ordering rule 4).
#[tokio::test]
async fn a_slow_answer_delays_only_its_own_aggregate() {
    let f = Fixture::new().await;
    let insert = |aggregate: &'static str| {
        format!(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
             VALUES (gen_random_uuid(), 'cart', '{aggregate}', 'CartChanged', '{{}}')"
        )
    };
    let sink = SlowBroker::new(Duration::from_millis(500));
    let relay = Relay::new(f.relay_config(), sink.clone());
    let shutdown = CancellationToken::new();
    let running = tokio::spawn({
        let shutdown = shutdown.clone();
        async move { relay.run(shutdown).await.expect("the relay refused to run") }
    });
    f.db.execute_unprepared(&insert("a")).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while sink.enqueued().is_empty() {
        assert!(Instant::now() < deadline, "the first event was never sent");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // While the broker takes its time to answer for a's first event:
    f.db.execute_unprepared(&insert("b")).await.unwrap();
    f.db.execute_unprepared(&insert("a")).await.unwrap();
    f.wait_until_drained(Duration::from_secs(30)).await;
    shutdown.cancel();
    running.await.unwrap();

    let seen = sink.seen();
    let at = |wanted: &dyn Fn(&Seen) -> bool| {
        seen.iter()
            .position(wanted)
            .unwrap_or_else(|| panic!("missing from {seen:?}"))
    };
    let first_a_acked = at(&|s| matches!(s, Seen::Acked(key, _) if key == "a"));
    let b_sent = at(&|s| matches!(s, Seen::Enqueued(key, _) if key == "b"));
    let a_sent: Vec<usize> = (0..seen.len())
        .filter(|&i| matches!(&seen[i], Seen::Enqueued(key, _) if key == "a"))
        .collect();
    assert!(
        b_sent < first_a_acked,
        "b went out while a's answer was awaited: {seen:?}"
    );
    assert_eq!(
        a_sent.len(),
        2,
        "each of a's events was sent once: {seen:?}"
    );
    assert!(
        first_a_acked < a_sent[1],
        "a's second event waited for the answer to its first: {seen:?}"
    );
}
