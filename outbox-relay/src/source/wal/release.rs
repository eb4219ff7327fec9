//! Releases of held events: the WAL source reads an aggregate's events held in the table back
//! into the stream, in `seq` order up to its first parked event, before anything read after the
//! release. An operator's `failed retry` or `failed skip` releases the aggregates it names (a
//! [`RELEASE_PREFIX`](super::RELEASE_PREFIX) message in its transaction); the relay's start
//! releases every held event, which is how it sends what an interrupted release left held and
//! what the table had before the slot was made.

use super::WalStream;
use super::parked::{self, PAGE};
use crate::batch::Limits;
use crate::error::SourceError;
use crate::row::Aggregate;
use std::collections::HashSet;

/// Whose held events a release sends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Scope {
    /// The aggregates an operator's release names.
    Named(Vec<Aggregate>),
    /// Every held event up to this `seq` (the relay's start): the aggregates are found as the
    /// pages are read.
    EveryHeld { up_to_seq: i64 },
}

/// A release, carried out once everything read before it is settled, a page at a time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Release {
    pub scope: Scope,
    /// The page read next starts after this `seq`.
    pub after_seq: i64,
    /// Aggregates whose release stopped at a parked event: still held.
    pub stopped: HashSet<Aggregate>,
    /// The aggregates a release of [`Scope::EveryHeld`] found.
    pub found: HashSet<Aggregate>,
}

impl Release {
    /// A release of the named aggregates.
    pub fn of(aggregates: Vec<Aggregate>) -> Self {
        Release::new(Scope::Named(aggregates))
    }

    /// A release of every event held up to `up_to_seq`.
    pub fn every_held(up_to_seq: i64) -> Self {
        Release::new(Scope::EveryHeld { up_to_seq })
    }

    fn new(scope: Scope) -> Self {
        Release {
            scope,
            after_seq: i64::MIN,
            stopped: HashSet::new(),
            found: HashSet::new(),
        }
    }

    /// Whether this is a release's first page.
    pub fn starting(&self) -> bool {
        self.after_seq == i64::MIN
    }
}

impl WalStream {
    /// Reads the next page of a release's held events into the stream, each aggregate up to its
    /// first parked event; they go out in `seq` order before anything read after the release.
    pub(super) async fn release(&mut self, mut release: Release) -> Result<(), SourceError> {
        if release.starting()
            && let Scope::Named(aggregates) = &release.scope
        {
            for aggregate in aggregates {
                self.parked.releasing(aggregate);
            }
        }
        let limits = Limits {
            batch_size: PAGE as usize,
            max_batch_bytes: usize::MAX,
            max_payload_bytes: self.max_payload_bytes,
        };
        let page = match &release.scope {
            Scope::Named(aggregates) if aggregates.is_empty() => Vec::new(),
            scope => parked::page(&mut self.db, scope, release.after_seq, &limits).await?,
        };
        let more = page.len() as i64 == PAGE;
        let every_held = matches!(release.scope, Scope::EveryHeld { .. });
        let mut events = Vec::with_capacity(page.len());
        for kept in page {
            release.after_seq = kept.row.seq;
            let aggregate = kept.row.aggregate();
            if kept.parked && !self.parked.skips_parked() {
                release.stopped.insert(aggregate.clone());
            } else if !kept.parked && !release.stopped.contains(&aggregate) {
                events.push(kept.row);
            }
            if every_held {
                release.found.insert(aggregate);
            }
        }
        if more {
            self.read.released(events, Some(release));
            return Ok(());
        }
        let aggregates = match release.scope {
            Scope::Named(aggregates) => aggregates,
            Scope::EveryHeld { .. } => release.found.into_iter().collect(),
        };
        if !aggregates.is_empty() {
            tracing::info!(
                aggregates = aggregates.len(),
                still_held = release.stopped.len(),
                "released held events"
            );
        }
        for aggregate in aggregates {
            let held = release.stopped.contains(&aggregate);
            self.parked.released(aggregate, held);
        }
        self.read.released(events, None);
        Ok(())
    }
}
