//! The sink's quiet moment when several pumps share it (one per outbox table): the sink asks for a
//! moment with nothing in flight ([`Sink::wants_quiet`]), and it gets it only once no pump has a
//! batch in flight, with every hand-over to the sink stopped meanwhile. One pump's quiet moment
//! must not replace the producer under another pump's unanswered messages: a later message of an
//! aggregate, handed to the new producer, could overtake an earlier one still in the old.

use crate::sink::Sink;
use std::sync::Arc;
use tokio::sync::{RwLock, RwLockReadGuard, watch};

/// Counts the batches in flight across the pumps, and lets one pump quiet the sink when there
/// are none.
pub(crate) struct QuietGate {
    /// Held shared while a batch is handed to the sink, exclusively while the sink is quieted.
    handing_over: RwLock<()>,
    /// Batches sent whose answers are not all read yet.
    in_flight: Arc<watch::Sender<usize>>,
}

impl Default for QuietGate {
    fn default() -> Self {
        QuietGate {
            handing_over: RwLock::new(()),
            in_flight: Arc::new(watch::Sender::new(0)),
        }
    }
}

impl QuietGate {
    /// Held while a batch is handed to the sink; the batch counts as in flight from here on (take
    /// [`in_flight`](Self::in_flight) under it).
    pub async fn handing_over(&self) -> RwLockReadGuard<'_, ()> {
        self.handing_over.read().await
    }

    /// A batch in flight, counted until the token is dropped (once its answers are read).
    pub fn in_flight(&self) -> InFlightToken {
        self.in_flight.send_modify(|n| *n += 1);
        InFlightToken(Arc::clone(&self.in_flight))
    }

    /// Calls [`Sink::quiet`] once no pump has a batch in flight. The calling pump has none; the
    /// others settle theirs, seeing [`Sink::wants_quiet`], and hand nothing over meanwhile.
    pub async fn quiet(&self, sink: &dyn Sink) {
        let mut idle = self.in_flight.subscribe();
        loop {
            // A pump that is handing a batch over while waiting for its previous batch's answers
            // must not be blocked before they are read: wait for none in flight first, then
            // stop hand-overs and check again.
            if idle.wait_for(|n| *n == 0).await.is_err() {
                return;
            }
            let _stopped = self.handing_over.write().await;
            if *self.in_flight.borrow() == 0 {
                sink.quiet().await;
                return;
            }
        }
    }
}

/// One batch in flight, counted by its [`QuietGate`] until dropped.
pub(crate) struct InFlightToken(Arc<watch::Sender<usize>>);

impl Drop for InFlightToken {
    fn drop(&mut self) {
        self.0.send_modify(|n| *n -= 1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sink::{Ack, Message, SinkError};
    use futures::future::BoxFuture;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    #[derive(Default)]
    struct Quieted(AtomicUsize);

    impl Sink for Quieted {
        fn name(&self) -> &str {
            "quieted"
        }
        fn enqueue<'a>(&'a self, _: &'a Message) -> BoxFuture<'a, Result<Ack, SinkError>> {
            unreachable!("nothing is sent here")
        }
        fn quiet(&self) -> BoxFuture<'_, ()> {
            self.0.fetch_add(1, Ordering::SeqCst);
            Box::pin(async {})
        }
    }

    #[tokio::test]
    async fn the_sink_is_quieted_only_once_no_batch_is_in_flight() {
        let gate = Arc::new(QuietGate::default());
        let sink = Arc::new(Quieted::default());
        let batch = {
            let _handing_over = gate.handing_over().await;
            gate.in_flight()
        };
        let quieting = tokio::spawn({
            let (gate, sink) = (Arc::clone(&gate), Arc::clone(&sink));
            async move { gate.quiet(&*sink).await }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(
            sink.0.load(Ordering::SeqCst),
            0,
            "quieted with a batch in flight"
        );
        drop(batch);
        quieting.await.unwrap();
        assert_eq!(sink.0.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn a_pump_handing_over_beside_its_batch_in_flight_is_not_blocked() {
        // One pump: batch 1 in flight, batch 2 being handed over while another pump waits to
        // quiet the sink. Batch 2's hand-over must go through, or batch 1 is never answered.
        let gate = Arc::new(QuietGate::default());
        let sink = Arc::new(Quieted::default());
        let first = {
            let _handing_over = gate.handing_over().await;
            gate.in_flight()
        };
        let quieting = tokio::spawn({
            let (gate, sink) = (Arc::clone(&gate), Arc::clone(&sink));
            async move { gate.quiet(&*sink).await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        let second = tokio::time::timeout(Duration::from_secs(5), async {
            let _handing_over = gate.handing_over().await;
            gate.in_flight()
        })
        .await
        .expect("the hand-over was blocked behind the quiet moment");
        drop(first);
        drop(second);
        quieting.await.unwrap();
        assert_eq!(sink.0.load(Ordering::SeqCst), 1);
    }
}
