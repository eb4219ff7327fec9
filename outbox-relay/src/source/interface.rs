//! What every source implements: the interface the pump (`relay.rs`) drives.

use crate::batch::{Claim, Limits, Outcome};
use crate::error::SourceError;
use std::future::Future;
use tokio::time::Instant;

/// A source of events, as the pump drives it: [`claim`](Self::claim) the oldest publishable
/// events, and once the broker answered, [`settle`](Self::settle) what became of them.
///
/// The pump keeps each aggregate's order (`ordering.rs`) on two promises of the source: a claim
/// returns events in the order they were recorded, and an event the pump left untouched (neither
/// published, parked nor failed in an outcome) is claimed again, before the later events of its
/// aggregate. An event that failed is not claimed again before its backoff, and neither are the
/// later events of its aggregate.
pub(crate) trait Source {
    /// Claims the oldest publishable events within `limits`, skipping those whose
    /// [`position`](crate::row::OutboxRow::position) is `in_flight` (their answers may still come).
    fn claim(
        &mut self,
        limits: &Limits,
        in_flight: &[i64],
    ) -> impl Future<Output = Result<Claim, SourceError>> + Send;

    /// Writes what became of a batch: published events are done, parked ones kept for the operator
    /// with their reason, failed ones tried again after their backoff.
    fn settle(&mut self, outcome: &Outcome)
    -> impl Future<Output = Result<(), SourceError>> + Send;

    /// Resolves when there may be new events to claim (never, for a source that only polls).
    /// Cancel-safe: the pump drops it when something else comes first.
    fn new_events(&mut self) -> impl Future<Output = ()> + Send;

    /// `until`, or sooner if the source has work due then (a lease to refresh, a backoff ending).
    fn wake_at(&self, until: Instant) -> Instant {
        until
    }

    /// Whether the source wants a moment with nothing in flight (to rebalance its shards): the
    /// pump settles what it has in flight, then calls [`rebalance`](Self::rebalance).
    fn rebalance_due(&self) -> bool {
        false
    }

    /// Does what [`rebalance_due`](Self::rebalance_due) asked for, with nothing in flight.
    fn rebalance(&mut self) -> impl Future<Output = Result<(), SourceError>> + Send {
        async { Ok(()) }
    }

    /// Stops, with nothing in flight: releases what the source holds (shards, the slot), saving
    /// its progress.
    fn leave(self) -> impl Future<Output = Result<(), SourceError>> + Send;
}
