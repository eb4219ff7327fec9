//! Pruning: deleting published rows once they are older than the retention window.
//!
//! Small batches on a timer, never one unbounded DELETE: a huge delete holds locks and bloats the
//! WAL until it commits, stalling writers (peers have shipped that bug). Each batch is found through
//! the partial index `outbox_published`. In delete mode there is nothing to prune. A partitioned
//! table drops whole partitions instead (`partitions.rs`), in the same tick.

use super::{OutboxTable, SessionConfig, every_tick, partitions};
use seaorm_outbox::TableName;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Rows deleted per statement.
const PRUNE_BATCH: i64 = 1000;

/// Deletes the published rows of the outbox table `table` older than `retention`, batch after
/// batch, until none is left; returns how many it deleted. On a partitioned table (see
/// `migrate --partitioned`) it drops the partitions past `retention` whose rows are all published
/// (their rows not counted), deletes only the default partition's rows, and makes the partitions
/// due ahead.
///
/// ```no_run
/// # async fn f() -> Result<(), sqlx::Error> {
/// use seaorm_outbox::TableName;
/// let week = std::time::Duration::from_secs(7 * 86400);
/// let deleted = seaorm_outbox_relay::prune("postgres://localhost/shop", &TableName::DEFAULT, week).await?;
/// # Ok(()) }
/// ```
pub async fn prune(
    database_url: &str,
    table: &TableName,
    retention: Duration,
) -> Result<u64, sqlx::Error> {
    let mut table = OutboxTable::connect(database_url, table).await?;
    prune_on(&mut table, Some(Pruned::Published), Some(retention)).await
}

/// Which rows a source's pruning deletes.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Pruned {
    /// The polling source's: rows marked published before the retention window.
    Published,
    /// The WAL source's: rows whose UUIDv7 id and `created_at` are older than the retention
    /// window, found through the primary key. The WAL source never marks rows, and its events
    /// live in the WAL whatever becomes of the row, so pruning goes by age alone; parked and held
    /// rows stay (they are what a release sends).
    Read,
}

/// One tick of the table's upkeep: keeps its partitions when it is partitioned (made ahead, and
/// with a `retention` the published ones past it dropped), then deletes the `pruned` rows past
/// `retention` (of a partitioned table, the default partition's), batch after batch, until none
/// is left; returns how many rows it deleted.
async fn prune_on(
    table: &mut OutboxTable,
    pruned: Option<Pruned>,
    retention: Option<Duration>,
) -> Result<u64, sqlx::Error> {
    let name = table.name.clone();
    let partitioned = match table.postgres() {
        Some(conn) => partitions::keep(conn, &name, None, retention).await?,
        None => None,
    };
    let (Some(pruned), Some(retention)) = (pruned, retention) else {
        return Ok(0);
    };
    // A retention past what a date can hold keeps everything.
    let cutoff = chrono::TimeDelta::from_std(retention)
        .ok()
        .and_then(|retention| chrono::Utc::now().checked_sub_signed(retention))
        .unwrap_or(chrono::DateTime::UNIX_EPOCH);
    let mut total = 0;
    loop {
        let deleted = match (&partitioned, pruned) {
            (Some(partitioned), Pruned::Published) => match table.postgres() {
                Some(conn) => {
                    partitioned
                        .prune_default(conn, retention, PRUNE_BATCH)
                        .await?
                }
                None => 0,
            },
            // The WAL source refuses a partitioned table.
            (Some(_), Pruned::Read) => 0,
            (None, Pruned::Published) => table.delete_published(retention, PRUNE_BATCH).await?,
            (None, Pruned::Read) => table.delete_read(cutoff, PRUNE_BATCH).await?,
        };
        total += deleted;
        if deleted < PRUNE_BATCH as u64 {
            return Ok(total);
        }
        // Let other work in between batches.
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Runs the table's upkeep (see [`prune_on`]) every `every` until `shutdown`.
pub(crate) async fn prune_periodically(
    session: SessionConfig,
    table: TableName,
    pruned: Option<Pruned>,
    retention: Option<Duration>,
    every: Duration,
    shutdown: CancellationToken,
) {
    every_tick(&session, &table, every, shutdown, "pruning", |table| {
        Box::pin(async move {
            let deleted = prune_on(table, pruned, retention).await?;
            if deleted > 0 {
                tracing::info!(deleted, ?pruned, "pruned events past retention");
            }
            Ok(())
        })
    })
    .await;
}

/// The smallest UUIDv7 of millisecond `ms`: every v7 id made before it sorts below it.
pub(super) fn uuid_v7_floor(ms: i64) -> uuid::Uuid {
    let ms = u128::from(u64::try_from(ms).unwrap_or(0) & 0xFFFF_FFFF_FFFF);
    uuid::Uuid::from_u128((ms << 80) | (0x7 << 76) | (0x2 << 62))
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_v7_floor_sorts_between_the_ids_of_two_milliseconds() {
        let ms = 1_796_123_543_500_i64;
        let floor = super::uuid_v7_floor(ms);
        let ts = |ms: i64| {
            uuid::Timestamp::from_unix(
                uuid::NoContext,
                (ms / 1000) as u64,
                ((ms % 1000) * 1_000_000) as u32,
            )
        };
        for _ in 0..100 {
            assert!(uuid::Uuid::new_v7(ts(ms - 1)) < floor);
            assert!(uuid::Uuid::new_v7(ts(ms)) >= floor);
        }
        assert_eq!(floor.get_version_num(), 7);
    }
}
