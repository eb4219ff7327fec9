//! The table's backlog at a new slot: the events recorded as rows and not yet published when the
//! slot was made (a polling relay's, or recorded while no relay ran). The slot streams only
//! transactions that commit after its consistent point, so these are held (`held_at`) and the
//! relay's start releases them first, in `seq` order (`parked.rs`).
//!
//! The hold cannot run at the slot's consistent point exactly: a transaction that commits between
//! the two is in the stream and held too. So the hold notes the snapshot it saw, and the stream
//! leaves out the rows of every transaction that snapshot sees (they went out from the table).
//! Transactions stream in commit order, so once one comes that the snapshot does not see, none
//! after it is seen either, and the snapshot is done with.

use sqlx::PgConnection;

/// Holds every event the table has unpublished and not parked: at a new slot's start, these
/// were committed before it, or are in its stream and left out there ([`BacklogSnapshot`]).
/// Returns how many, and the snapshot the hold saw (`pg_current_snapshot()`'s text).
pub(super) async fn hold(db: &mut PgConnection) -> Result<(u64, String), sqlx::Error> {
    // One statement: the query reads the snapshot the update ran in.
    let (held, snapshot): (i64, String) = sqlx::query_as(
        "WITH held AS (
             UPDATE outbox SET held_at = now()
             WHERE published_at IS NULL AND parked_at IS NULL AND held_at IS NULL
             RETURNING 1)
         SELECT (SELECT count(*) FROM held), pg_current_snapshot()::text",
    )
    .fetch_one(db)
    .await?;
    Ok((u64::try_from(held).unwrap_or(0), snapshot))
}

/// The snapshot a backlog was held in: which transactions it sees as committed (`xmin:xmax:xip`,
/// full 64-bit ids, as `pg_snapshot`'s text form).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct BacklogSnapshot {
    xmin: u64,
    xmax: u64,
    in_progress: Vec<u64>,
}

/// How far (in transactions) the server may have gone past a backlog's snapshot for it to still
/// apply: the stream names transactions by 32-bit ids, read relative to the snapshot's.
const SNAPSHOT_REACH: u64 = 1 << 30;

impl BacklogSnapshot {
    /// Reads `pg_snapshot`'s text form; `None` if it is not one.
    pub fn parse(text: &str) -> Option<Self> {
        let mut parts = text.trim().splitn(3, ':');
        let xmin = parts.next()?.parse().ok()?;
        let xmax = parts.next()?.parse().ok()?;
        let in_progress = match parts.next()? {
            "" => Vec::new(),
            list => list
                .split(',')
                .map(str::parse)
                .collect::<Result<_, _>>()
                .ok()?,
        };
        (xmin <= xmax).then_some(BacklogSnapshot {
            xmin,
            xmax,
            in_progress,
        })
    }

    /// Whether the snapshot can still tell the stream's transactions: the server's next
    /// transaction id (`next_xid`, 64-bit) is within [`SNAPSHOT_REACH`] of it.
    pub fn reaches(&self, next_xid: u64) -> bool {
        next_xid.saturating_sub(self.xmax) < SNAPSHOT_REACH
    }

    /// Whether the transaction of (32-bit) id `xid` committed before the snapshot was taken:
    /// then its rows were held with the backlog.
    pub fn sees(&self, xid: u32) -> bool {
        // The full id nearest the snapshot's with these low 32 bits.
        #[allow(clippy::cast_possible_truncation)]
        let behind = i64::from((self.xmax as u32).wrapping_sub(xid) as i32);
        let Some(full) = self.xmax.checked_add_signed(-behind) else {
            return false;
        };
        full < self.xmin || (full < self.xmax && !self.in_progress.contains(&full))
    }
}

/// The server's next transaction id, to check that a snapshot [`BacklogSnapshot::reaches`] it.
pub(super) async fn next_xid(db: &mut PgConnection) -> Result<u64, sqlx::Error> {
    let next: String = sqlx::query_scalar("SELECT pg_snapshot_xmax(pg_current_snapshot())::text")
        .fetch_one(db)
        .await?;
    Ok(next.parse().unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_snapshot_sees_what_committed_before_it_and_nothing_after() {
        let s = BacklogSnapshot::parse("100:105:101,103").unwrap();
        assert!(s.sees(99) && s.sees(100) && s.sees(102) && s.sees(104));
        assert!(!s.sees(101) && !s.sees(103), "in progress when taken");
        assert!(!s.sees(105) && !s.sees(106) && !s.sees(4_000_000));
        assert_eq!(
            BacklogSnapshot::parse("7:7:").unwrap(),
            BacklogSnapshot {
                xmin: 7,
                xmax: 7,
                in_progress: Vec::new()
            }
        );
        assert!(BacklogSnapshot::parse("7:7:").unwrap().sees(6));
    }

    #[test]
    fn the_streams_32_bit_ids_are_read_against_the_snapshots_epoch() {
        let epoch = 3u64 << 32;
        let s = BacklogSnapshot::parse(&format!("{}:{}:", epoch + 10, epoch + 12)).unwrap();
        assert!(s.sees(11) && s.sees(5));
        assert!(!s.sees(12) && !s.sees(13));
        // Across the wrap: the snapshot's ids just past an epoch, the transaction just before.
        let s = BacklogSnapshot::parse(&format!("{}:{}:", epoch + 1, epoch + 2)).unwrap();
        assert!(s.sees(u32::MAX) && s.sees(0));
        assert!(!s.sees(2));
        assert!(s.reaches(epoch + 2 + 1000) && !s.reaches(epoch + 2 + (1 << 31)));
    }

    #[test]
    fn what_is_not_a_snapshot_is_refused() {
        for text in ["", "1:2", "a:2:", "5:2:", "1:2:x"] {
            assert_eq!(BacklogSnapshot::parse(text), None, "{text}");
        }
    }
}
