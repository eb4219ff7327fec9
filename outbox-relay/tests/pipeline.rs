//! The pipelined loop: the next claim runs while the broker answers for the batch in flight, and
//! still sends no event twice while nothing fails, in order per aggregate.

mod common;

use common::Fixture;
use futures::future::BoxFuture;
use seaorm_outbox::sea_orm::ConnectionTrait;
use seaorm_outbox_relay::Relay;
use seaorm_outbox_relay::sink::{Ack, Message, Sink, SinkError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// Acks each message 20 ms after it was enqueued, as a distant broker would, so every claim
/// overlaps the acks of the batch before; notes what was enqueued, in order.
#[derive(Clone, Default)]
struct SlowBroker {
    enqueued: Arc<Mutex<Vec<(String, i64)>>>,
}

impl Sink for SlowBroker {
    fn name(&self) -> &str {
        "slow"
    }

    fn enqueue<'a>(&'a self, message: &'a Message) -> BoxFuture<'a, Result<Ack, SinkError>> {
        self.enqueued
            .lock()
            .unwrap()
            .push((message.key.clone(), message.seq));
        // The broker's answer comes 20 ms after the send, whenever the relay looks at it.
        let answered_at = tokio::time::Instant::now() + Duration::from_millis(20);
        let ack: Ack = Box::pin(async move {
            tokio::time::sleep_until(answered_at).await;
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
    let sink = SlowBroker::default();
    let relay = Relay::new(config, sink.clone());
    let shutdown = CancellationToken::new();
    let running = tokio::spawn({
        let shutdown = shutdown.clone();
        async move { relay.run(shutdown).await }
    });
    let started = Instant::now();
    f.wait_until_drained(Duration::from_secs(60)).await;
    let elapsed = started.elapsed();
    shutdown.cancel();
    running.await.unwrap();

    let enqueued = sink.enqueued.lock().unwrap().clone();
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
