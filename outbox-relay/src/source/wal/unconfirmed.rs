//! What the WAL source has read and not yet confirmed, in stream order: the events, each until it
//! is settled (published or parked), the commits, whose positions are confirmed once every event
//! before them is settled, and the releases of held events (`parked.rs`).
//!
//! To the pump this is what the outbox table is to the table source: the claim reads the oldest
//! unsettled events from here, an event the pump left untouched is found again by the next claim,
//! and a failed one waits its backoff here. Each event is named by its position, its place in
//! the stream (counted from the session's start): the pump's [`OutboxRow::position`].

use super::release::Release;
use crate::row::OutboxRow;
use pgwire_replication::Lsn;
use std::collections::VecDeque;
use tokio::time::Instant;

/// An event read and not yet settled.
#[derive(Debug)]
pub(super) struct Event {
    pub row: OutboxRow,
    /// For an event a release read from the table (it was held there): that row's `seq`, which
    /// its settling updates.
    pub kept_seq: Option<i64>,
    /// After a failure: not claimed again before then.
    pub retry_at: Option<Instant>,
    /// Published or parked: nothing is left to do for it.
    pub settled: bool,
}

// Nearly every entry is an event: boxing it would add an allocation per event to save space on
// the few commits.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
enum Entry {
    Event(Event),
    Commit { lsn: Lsn, commit_ms: Option<i64> },
    Release(Release),
}

/// The unconfirmed part of the stream (see the module's documentation).
#[derive(Debug, Default)]
pub(super) struct Unconfirmed {
    entries: VecDeque<Entry>,
    /// The position of `entries[0]`.
    first: i64,
    /// The payload bytes of the events in `entries`: the stream pauses at a bound.
    bytes: usize,
}

impl Unconfirmed {
    /// Entries read and not yet confirmed: the stream pauses at a bound.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The payload bytes of the events read and not yet confirmed.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    fn next_position(&self) -> i64 {
        self.first + self.entries.len() as i64
    }

    /// An event read from the stream (`kept_seq: None`) or from the table by a release.
    pub fn push_event(&mut self, mut row: OutboxRow, kept_seq: Option<i64>) {
        row.position = self.next_position();
        self.bytes += row.payload.len();
        self.entries.push_back(Entry::Event(Event {
            row,
            kept_seq,
            retry_at: None,
            settled: false,
        }));
    }

    pub fn push_commit(&mut self, lsn: Lsn, commit_ms: Option<i64>) {
        self.entries.push_back(Entry::Commit { lsn, commit_ms });
    }

    pub fn push_release(&mut self, release: Release) {
        self.entries.push_back(Entry::Release(release));
    }

    /// Puts a release first (the relay's start releases what an interrupted release left held).
    pub fn release_first(&mut self, release: Release) {
        self.entries.push_front(Entry::Release(release));
        self.first -= 1;
    }

    /// The unsettled event at `position`.
    pub fn event_mut(&mut self, position: i64) -> Option<&mut Event> {
        let index = usize::try_from(position.checked_sub(self.first)?).ok()?;
        match self.entries.get_mut(index)? {
            Entry::Event(event) if !event.settled => Some(event),
            _ => None,
        }
    }

    /// The unsettled events up to the first release, in stream order: what a claim may take (what
    /// follows a release waits for it).
    pub fn claimable(&mut self) -> impl Iterator<Item = &mut Event> {
        self.entries
            .iter_mut()
            .take_while(|entry| !matches!(entry, Entry::Release(_)))
            .filter_map(|entry| match entry {
                Entry::Event(event) if !event.settled => Some(event),
                _ => None,
            })
    }

    /// Takes the settled entries off the front; returns the last commit among them (its position
    /// may be confirmed) with its commit time.
    pub fn confirm(&mut self) -> Option<(Lsn, Option<i64>)> {
        let mut confirmed = None;
        loop {
            match self.entries.front() {
                Some(Entry::Event(event)) if event.settled => {}
                Some(Entry::Commit { lsn, commit_ms }) => confirmed = Some((*lsn, *commit_ms)),
                _ => return confirmed,
            }
            if let Some(Entry::Event(event)) = self.entries.pop_front() {
                self.bytes -= event.row.payload.len();
            }
            self.first += 1;
        }
    }

    /// Takes the release at the front, once everything before it is settled (after
    /// [`confirm`](Self::confirm)); [`released`](Self::released) puts what it read in its place.
    pub fn take_due_release(&mut self) -> Option<Release> {
        if !matches!(self.entries.front(), Some(Entry::Release(_))) {
            return None;
        }
        self.first += 1;
        match self.entries.pop_front() {
            Some(Entry::Release(release)) => Some(release),
            _ => None,
        }
    }

    /// Puts the held events a release read at the front, then `next` (its next page) if any.
    /// Nothing after a release was claimed, so the entries after it are numbered anew.
    pub fn released(&mut self, events: Vec<OutboxRow>, next: Option<Release>) {
        let rest = std::mem::take(&mut self.entries);
        // Counted again as they are pushed back.
        self.bytes = 0;
        for row in events {
            let seq = row.seq;
            self.push_event(row, Some(seq));
        }
        if let Some(next) = next {
            self.push_release(next);
        }
        for entry in rest {
            match entry {
                Entry::Event(Event { row, kept_seq, .. }) => self.push_event(row, kept_seq),
                entry => self.entries.push_back(entry),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(aggregate_id: &str, seq: i64) -> OutboxRow {
        OutboxRow::for_test(aggregate_id, seq, 0)
    }

    fn lsn(n: u64) -> Lsn {
        Lsn(n)
    }

    fn claimable(u: &mut Unconfirmed) -> Vec<(i64, i64)> {
        u.claimable().map(|e| (e.row.position, e.row.seq)).collect()
    }

    #[test]
    fn a_commit_is_confirmed_once_every_event_before_it_is_settled() {
        let mut u = Unconfirmed::default();
        u.push_event(row("a", 10), None);
        u.push_event(row("b", 11), None);
        u.push_commit(lsn(100), Some(5));
        u.push_event(row("a", 12), None);
        u.push_commit(lsn(200), None);
        assert_eq!(claimable(&mut u), [(0, 10), (1, 11), (3, 12)]);
        assert_eq!(u.confirm(), None);
        u.event_mut(1).unwrap().settled = true;
        assert_eq!(u.confirm(), None, "the first event is not settled");
        u.event_mut(0).unwrap().settled = true;
        assert_eq!(u.confirm(), Some((lsn(100), Some(5))));
        assert!(u.event_mut(0).is_none(), "taken off");
        assert_eq!(claimable(&mut u), [(3, 12)]);
        u.event_mut(3).unwrap().settled = true;
        assert_eq!(u.confirm(), Some((lsn(200), None)));
        assert!(u.is_empty());
    }

    #[test]
    fn the_payload_bytes_read_and_not_confirmed_are_counted() {
        let mut u = Unconfirmed::default();
        let sized = |seq, bytes: usize| {
            let mut row = row("a", seq);
            row.payload = bytes::Bytes::from(vec![b'x'; bytes]);
            row
        };
        u.push_event(sized(1, 100), None);
        u.push_commit(lsn(100), None);
        u.push_release(Release::of(vec![("order".into(), "a".into())], 7));
        u.push_event(sized(2, 1000), None);
        assert_eq!(u.bytes(), 1100);
        u.event_mut(0).unwrap().settled = true;
        u.confirm();
        assert_eq!(u.bytes(), 1000);
        assert!(u.take_due_release().is_some());
        u.released(vec![sized(0, 10)], None);
        assert_eq!(u.bytes(), 1010);
    }

    #[test]
    fn nothing_after_a_release_is_claimed_before_it_is_carried_out() {
        let mut u = Unconfirmed::default();
        u.push_event(row("a", 10), None);
        u.push_release(Release::of(vec![("order".into(), "a".into())], 7));
        u.push_event(row("a", 12), None);
        u.push_commit(lsn(300), None);
        assert_eq!(claimable(&mut u), [(0, 10)]);
        assert!(
            u.take_due_release().is_none(),
            "an event before it is unsettled"
        );
        u.event_mut(0).unwrap().settled = true;
        assert_eq!(u.confirm(), None);
        assert!(u.take_due_release().is_some());
        // The release read two held events: they come before the later event, which is numbered
        // after them.
        u.released(vec![row("a", 3), row("a", 5)], None);
        assert_eq!(claimable(&mut u), [(2, 3), (3, 5), (4, 12)]);
        assert_eq!(u.event_mut(3).unwrap().kept_seq, Some(5));
        assert_eq!(u.event_mut(4).unwrap().kept_seq, None);
    }

    #[test]
    fn a_release_read_in_pages_keeps_its_next_page_before_what_follows() {
        let mut u = Unconfirmed::default();
        u.push_release(Release::of(vec![("order".into(), "a".into())], 7));
        u.push_event(row("a", 12), None);
        let mut next = Release::of(vec![("order".into(), "a".into())], 7);
        next.after_seq = 3;
        assert!(u.take_due_release().is_some());
        u.released(vec![row("a", 3)], Some(next.clone()));
        assert_eq!(claimable(&mut u), [(1, 3)], "the next page is a barrier");
        u.event_mut(1).unwrap().settled = true;
        u.confirm();
        assert_eq!(u.take_due_release(), Some(next));
        u.released(vec![row("a", 4)], None);
        assert_eq!(claimable(&mut u), [(3, 4), (4, 12)]);
    }

    #[test]
    fn the_release_at_the_start_comes_before_everything_read() {
        let mut u = Unconfirmed::default();
        u.push_event(row("a", 12), None);
        u.release_first(Release::every_held(7));
        assert_eq!(claimable(&mut u), [], "nothing read goes before it");
        assert!(u.take_due_release().is_some());
        u.released(vec![row("a", 7)], None);
        assert_eq!(claimable(&mut u), [(0, 7), (1, 12)]);
    }
}
