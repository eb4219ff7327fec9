//! `outbox-relay status`: how far behind the relay is.

use crate::source::table::partitions::Partitioned;
use crate::source::table::{Connection, OutboxTable};
use seaorm_outbox::TableName;
use std::time::Duration;

/// The outbox's backlog, as `outbox-relay status` prints it.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Status {
    /// Events waiting to be published (not parked).
    pub backlog: i64,
    /// Events parked as poison, holding back their aggregates.
    pub parked: i64,
    /// Of the events in `backlog`, those held behind an earlier event of their aggregate that is
    /// parked or backing off: they go out once it is published, retried or skipped.
    pub held: i64,
    /// Age of the oldest event waiting to be published.
    pub oldest_unpublished: Option<Duration>,
    /// The WAL source's replication slots (PostgreSQL, when the outbox table is published for
    /// logical replication); empty for the polling source. With them, `backlog` and
    /// `oldest_unpublished` do not apply: the WAL source never marks rows.
    pub wal_slots: Vec<crate::source::wal::SlotStatus>,
    /// The table's partitions, when it is in the partitioned layout (`migrate --partitioned`).
    pub partitions: Option<Partitions>,
}

/// The partitions of an outbox table in the partitioned layout, as `status` prints them.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Partitions {
    /// How many partitions of intervals the table has (the default one aside).
    pub count: usize,
    /// The start of the oldest one's interval and the end of the newest's.
    pub span: Option<(chrono::DateTime<chrono::Utc>, chrono::DateTime<chrono::Utc>)>,
    /// Events in the default partition: recorded while their interval had no partition (the
    /// relay was stopped, or could not make it). Pruned row by row; normally 0.
    pub in_default: i64,
}

impl std::fmt::Display for Partitions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "partitions:         {}", self.count)?;
        if let Some((from, to)) = self.span {
            write!(
                f,
                ", from {} to {} UTC",
                from.format("%Y-%m-%d %H:%M"),
                to.format("%Y-%m-%d %H:%M")
            )?;
        }
        write!(f, "; {} events in the default partition", self.in_default)
    }
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if !self.wal_slots.is_empty() {
            writeln!(
                f,
                "source:             wal (the table's rows are never marked)"
            )?;
            for slot in &self.wal_slots {
                if slot.missing {
                    writeln!(
                        f,
                        "slot {}:{}MISSING: dropped while its publication remains; events committed \
                         since are in no stream (the relay refuses to start; `outbox-relay wal drop` \
                         starts afresh)",
                        slot.slot,
                        " ".repeat(13usize.saturating_sub(slot.slot.len())),
                    )?;
                    continue;
                }
                writeln!(
                    f,
                    "slot {}:{}{}, {} bytes behind{}",
                    slot.slot,
                    " ".repeat(13usize.saturating_sub(slot.slot.len())),
                    if slot.active {
                        "read by a relay"
                    } else {
                        "NOT READ (no relay running)"
                    },
                    slot.lag_bytes,
                    if slot.lost {
                        ", LOST: its WAL was removed (max_slot_wal_keep_size)"
                    } else {
                        ""
                    }
                )?;
            }
            writeln!(f, "parked:             {} events", self.parked)?;
            return write!(
                f,
                "held:               {} events (behind a parked event of their aggregate, or handed to a new slot)",
                self.held
            );
        }
        writeln!(f, "backlog:            {} events", self.backlog)?;
        match self.oldest_unpublished {
            // A date far off (`-infinity`, a clock gone wrong) is said, not formatted.
            Some(age) if age > CENTURY => writeln!(
                f,
                "oldest unpublished: over 100 years ago (check its created_at)"
            )?,
            Some(age) => writeln!(
                f,
                "oldest unpublished: {} ago",
                humantime::format_duration(Duration::from_millis(age.as_millis() as u64))
            )?,
            None => writeln!(f, "oldest unpublished: none")?,
        }
        write!(f, "parked:             {} events", self.parked)?;
        write!(
            f,
            "\nheld:               {} events (behind a parked or backing-off event of their \
             aggregate)",
            self.held
        )?;
        if let Some(partitions) = &self.partitions {
            write!(f, "\n{partitions}")?;
        }
        Ok(())
    }
}

const CENTURY: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// Reads the status of the outbox table `table` at `database_url`.
pub async fn status(database_url: &str, table: &TableName) -> Result<Status, sqlx::Error> {
    status_on(&mut OutboxTable::connect(database_url, table).await?).await
}

/// Reads the status over an open connection.
pub(crate) async fn status_on(table: &mut OutboxTable) -> Result<Status, sqlx::Error> {
    let backlog = table.backlog().await?;
    let name = table.name.clone();
    let (wal_slots, partitions) = match &mut table.conn {
        Connection::Postgres(conn) => (
            crate::source::wal::slot::all_status(conn).await?,
            partitions_of(conn, &name).await?,
        ),
        Connection::Sqlite(_) | Connection::MySql(_) => (Vec::new(), None),
    };
    Ok(Status {
        wal_slots,
        backlog: backlog.waiting,
        parked: backlog.parked,
        held: backlog.held,
        oldest_unpublished: backlog.oldest_unpublished,
        partitions,
    })
}

/// What `status` says of `table`'s partitions; `None` when it is not partitioned.
async fn partitions_of(
    conn: &mut sqlx::PgConnection,
    table: &TableName,
) -> Result<Option<Partitions>, sqlx::Error> {
    let Some(partitioned) = Partitioned::of(conn, table).await? else {
        return Ok(None);
    };
    let span = partitioned
        .partitions
        .first()
        .zip(partitioned.partitions.last())
        .map(|(oldest, newest)| (oldest.lower, newest.upper));
    Ok(Some(Partitions {
        count: partitioned.partitions.len(),
        span,
        in_default: partitioned.in_default(conn).await?,
    }))
}
