//! The WAL source's place in PostgreSQL: a publication of the outbox table's inserts and a logical
//! replication slot that keeps the WAL until the relay confirms it. Created if missing, dropped by
//! `outbox-relay wal drop`, measured for `/metrics` and `outbox-relay status`.
//!
//! Also the guard that keeps the two sources apart: a polling relay would publish every event of a
//! table the WAL relay reads again (the WAL source never marks rows), so each refuses to start
//! while the other is in place (how a WAL relay's publication is told from others':
//! `publication.rs`).

use super::backlog;
use super::publication::{Publication, SlotMark, mark_ours, publication_of, publications};
use crate::config::WalSource;
use crate::error::SourceError;
use sqlx::PgConnection;

/// Why the WAL source cannot start as configured. Retrying does not help; an operator must act.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Refused(pub String);

/// Checks the database and creates the publication and the slot if they are missing; returns how
/// many unpublished events the table had for a new slot (handed to it: they go out first).
pub(crate) async fn prepare(conn: &mut PgConnection, source: &WalSource) -> Result<u64, Prepare> {
    let wal_level: String = sqlx::query_scalar("SELECT current_setting('wal_level')")
        .fetch_one(&mut *conn)
        .await?;
    if wal_level != "logical" {
        return Err(Prepare::Refused(Refused(format!(
            "PostgreSQL runs with wal_level = {wal_level}; the WAL source needs wal_level = logical \
             (set it in postgresql.conf and restart PostgreSQL)"
        ))));
    }
    let version: String = sqlx::query_scalar("SELECT current_setting('server_version_num')")
        .fetch_one(&mut *conn)
        .await?;
    supported_version(&version).map_err(Prepare::Refused)?;
    let held_column: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_attribute
                        WHERE attrelid = 'outbox'::regclass AND attname = 'held_at' AND NOT attisdropped)",
    )
    .fetch_one(&mut *conn)
    .await?;
    if !held_column {
        return Err(Prepare::Refused(Refused(
            "the outbox table has no column held_at: the WAL source needs schema version 2 \
             (run the outbox migrations, or apply outbox-core/sql/postgres/0002_held.sql)"
                .into(),
        )));
    }
    let partitioned: bool =
        sqlx::query_scalar("SELECT relkind = 'p' FROM pg_class WHERE oid = 'outbox'::regclass")
            .fetch_one(&mut *conn)
            .await?;
    if partitioned {
        // Its table-less events are parked by id alone, which a partitioned table cannot key.
        return Err(Prepare::Refused(Refused(
            "the outbox table is partitioned (migrate --partitioned); the WAL source serves the \
             plain layout only: publish this table with the polling relay"
                .into(),
        )));
    }
    let polling: i64 = sqlx::query_scalar(POLLING_RELAYS)
        .fetch_one(&mut *conn)
        .await?;
    if polling > 0 {
        return Err(Prepare::Refused(Refused(format!(
            "{polling} polling relay(s) publish this outbox table; stop them before starting the \
             WAL source, or both would publish every event"
        ))));
    }
    let publication = match publication_of(conn, &source.publication).await? {
        Some((publication, true)) => {
            if !publication.ours {
                // Made by an earlier relay, before publications were marked, or by hand for it.
                mark_ours(conn, &source.publication, SlotMark::None).await?;
            }
            publication
        }
        Some(_) => {
            return Err(Prepare::Refused(Refused(format!(
                "publication {} exists but does not publish the inserts of this schema's outbox \
                 table; choose another --wal-publication, or add the table to it",
                source.publication
            ))));
        }
        None => {
            // The name was checked to be a plain identifier (`WalSource::new`).
            let create = format!(
                "CREATE PUBLICATION {} FOR TABLE outbox WITH (publish = 'insert')",
                source.publication
            );
            ignore_duplicate(
                sqlx::raw_sql(sqlx::AssertSqlSafe(create))
                    .execute(&mut *conn)
                    .await,
            )?;
            mark_ours(conn, &source.publication, SlotMark::None).await?;
            tracing::info!(publication = %source.publication, "created the publication of the outbox table");
            Publication {
                name: source.publication.clone(),
                ours: true,
                slot: None,
                new_slot: None,
                backlog: None,
            }
        }
    };
    let slot: Option<(String, Option<String>)> = sqlx::query_as(
        "SELECT plugin::text, wal_status FROM pg_replication_slots WHERE slot_name = $1",
    )
    .bind(&source.slot)
    .fetch_optional(&mut *conn)
    .await?;
    let read_before = publication.slot.as_deref() == Some(source.slot.as_str());
    match slot {
        Some((plugin, _)) if plugin != "pgoutput" => {
            return Err(Prepare::Refused(Refused(format!(
                "replication slot {} uses the {plugin} plugin; the WAL source needs a pgoutput slot \
                 (choose another --wal-slot)",
                source.slot
            ))));
        }
        Some((_, wal_status)) if wal_status.as_deref() == Some("lost") => {
            return Err(Prepare::Refused(Refused(format!(
                "replication slot {} is lost: PostgreSQL removed WAL it still needed \
                 (max_slot_wal_keep_size). Table-less events in that WAL are gone; rows are still \
                 in the table, but the WAL source cannot tell which were published. Run \
                 `outbox-relay wal drop` to go on: the next start makes the slot again and \
                 publishes every row the table holds first (consumers see the published ones \
                 again)",
                source.slot
            ))));
        }
        Some(_) if publication.new_slot.as_deref() == Some(source.slot.as_str()) => {
            // A first start stopped between making the slot and handing it the backlog.
            return hand_over_backlog(conn, source).await;
        }
        Some(_) => {
            if !read_before {
                // Made before publications named their slots.
                let made = SlotMark::Made {
                    slot: &source.slot,
                    backlog: None,
                };
                mark_ours(conn, &source.publication, made).await?;
            }
        }
        None if read_before => {
            return Err(Prepare::Refused(Refused(format!(
                "replication slot {} is gone, though publication {} says a relay read it: it was \
                 dropped, so events committed since are in no stream (table-less ones are lost; \
                 rows are still in the table). A new slot would start from now, past them. Run \
                 `outbox-relay wal drop` to go on: the next start makes the slot again and \
                 publishes every row the table holds first, the gap's among them (consumers see \
                 the published ones again)",
                source.slot, source.publication
            ))));
        }
        None => {
            mark_ours(conn, &source.publication, SlotMark::New(&source.slot)).await?;
            ignore_duplicate(
                sqlx::query("SELECT pg_create_logical_replication_slot($1, 'pgoutput')")
                    .bind(&source.slot)
                    .execute(&mut *conn)
                    .await,
            )?;
            tracing::info!(slot = %source.slot, "created the replication slot");
            return hand_over_backlog(conn, source).await;
        }
    }
    Ok(0)
}

/// Hands the new slot's relay the events the table holds unpublished (a polling relay's backlog,
/// rows recorded while no relay ran): rows committed before the slot are in no stream, so they
/// are held, and the relay's start releases them first, in `seq` order. Then the mark says the
/// slot is made (from now on a missing slot is a gap, not a first start) and names the snapshot
/// the backlog was held in, whose transactions the stream leaves out (`backlog.rs`).
async fn hand_over_backlog(conn: &mut PgConnection, source: &WalSource) -> Result<u64, Prepare> {
    let (held, snapshot) = backlog::hold(conn).await?;
    if held > 0 {
        tracing::info!(
            events = held,
            "the table holds events recorded before the slot: they go out first, in order"
        );
    }
    let made = SlotMark::Made {
        slot: &source.slot,
        backlog: Some(&snapshot),
    };
    mark_ours(conn, &source.publication, made).await?;
    Ok(held)
}

/// The oldest PostgreSQL the WAL source reads: `pgoutput` streams logical messages (table-less
/// events) from 14 on, and refuses the `messages` option before.
const OLDEST_VERSION: u32 = 14;

/// Whether the WAL source can read a server of `server_version_num`.
fn supported_version(server_version_num: &str) -> Result<(), Refused> {
    let major = server_version_num
        .trim()
        .parse::<u32>()
        .map_or(0, |n| n / 10_000);
    if major >= OLDEST_VERSION {
        return Ok(());
    }
    Err(Refused(format!(
        "PostgreSQL {major} is older than {OLDEST_VERSION}: its pgoutput cannot stream logical \
         messages, which the WAL source reads; run the polling relay there (it supports \
         PostgreSQL 12 and later)"
    )))
}

/// A failure of [`prepare`].
#[derive(Debug, thiserror::Error)]
pub(crate) enum Prepare {
    #[error(transparent)]
    Refused(Refused),
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

/// Another relay created it first: fine.
fn ignore_duplicate<T>(result: Result<T, sqlx::Error>) -> Result<(), sqlx::Error> {
    match result {
        Ok(_) => Ok(()),
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42710") => Ok(()),
        Err(e) => Err(e),
    }
}

/// The key of the session lock a relay holds, shared, while it reads slot `$1`: it lets go once it
/// has confirmed its last position after its stream stopped. The slot shows inactive before that
/// last confirmation, so `wal to-polling` waits for the lock too, or it would take events the relay
/// published for unread ones and have the polling relays send them again.
macro_rules! reader_key {
    () => {
        "hashtextextended('outbox-relay wal reader ' || $1, 0)"
    };
}
pub(super) const LOCK_AS_READER: &str =
    concat!("SELECT pg_advisory_lock_shared(", reader_key!(), ")");
pub(super) const UNLOCK_AS_READER: &str =
    concat!("SELECT pg_advisory_unlock_shared(", reader_key!(), ")");
/// Whether no relay holds [`LOCK_AS_READER`] (taken and let go at once; `CASE` orders the two).
pub(super) const NO_READER: &str = concat!(
    "SELECT CASE WHEN pg_try_advisory_lock(",
    reader_key!(),
    ") THEN pg_advisory_unlock(",
    reader_key!(),
    ") ELSE false END"
);

/// Live polling relays of this outbox table: their membership slots
/// (see `source/table/leases/postgres.rs`).
pub(super) const POLLING_RELAYS: &str = "
SELECT count(*) FROM pg_locks
WHERE locktype = 'advisory' AND objsubid = 2 AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND classid::bigint = (hashtext('outbox-relay:' || 'outbox'::regclass::oid::text)::bigint & 4294967295)
  AND objid::bigint >= 256";

/// A slot's state, for `status` and `/metrics`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct SlotStatus {
    /// The slot's name.
    pub slot: String,
    /// Whether a relay is reading it now.
    pub active: bool,
    /// WAL written since the position the relay last confirmed: what a restart re-reads, and what
    /// the slot keeps on disk.
    pub lag_bytes: i64,
    /// Set when PostgreSQL invalidated the slot (`max_slot_wal_keep_size` was exceeded): the WAL
    /// it needed is gone, and so are the events in it that were not yet published.
    pub lost: bool,
    /// Set when the slot is gone though its publication says a relay read it (it was dropped):
    /// the events committed since are in no stream, and the relay refuses to start until
    /// `outbox-relay wal drop` acknowledges the gap.
    pub missing: bool,
}

/// The state of every `pgoutput` slot of this database, when the outbox table is in a WAL relay's
/// publication; empty otherwise.
pub(crate) async fn all_status(conn: &mut PgConnection) -> Result<Vec<SlotStatus>, sqlx::Error> {
    let ours: Vec<Publication> = publications(&mut *conn)
        .await?
        .into_iter()
        .filter(|p| p.ours)
        .collect();
    if ours.is_empty() {
        return Ok(Vec::new());
    }
    let rows: Vec<(String, bool, Option<i64>, Option<String>)> = sqlx::query_as(
        "SELECT slot_name::text, active, (pg_current_wal_lsn() - confirmed_flush_lsn)::bigint, wal_status
         FROM pg_replication_slots WHERE plugin = 'pgoutput' AND database = current_database()
         ORDER BY 1",
    )
    .fetch_all(conn)
    .await?;
    let mut slots: Vec<SlotStatus> = rows
        .into_iter()
        .map(|(slot, active, lag, wal_status)| SlotStatus {
            slot,
            active,
            lag_bytes: lag.unwrap_or(0).max(0),
            lost: wal_status.as_deref() == Some("lost"),
            missing: false,
        })
        .collect();
    for slot in ours.into_iter().filter_map(|p| p.slot) {
        if !slots.iter().any(|s| s.slot == slot) {
            slots.push(SlotStatus {
                slot,
                active: false,
                lag_bytes: 0,
                lost: false,
                missing: true,
            });
        }
    }
    Ok(slots)
}

/// The state of `slot`, or `None` when it does not exist.
pub(crate) async fn status(
    conn: &mut PgConnection,
    slot: &str,
) -> Result<Option<SlotStatus>, sqlx::Error> {
    let row: Option<(bool, Option<i64>, Option<String>)> = sqlx::query_as(
        "SELECT active, (pg_current_wal_lsn() - confirmed_flush_lsn)::bigint, wal_status
         FROM pg_replication_slots WHERE slot_name = $1",
    )
    .bind(slot)
    .fetch_optional(conn)
    .await?;
    Ok(row.map(|(active, lag, wal_status)| SlotStatus {
        slot: slot.to_owned(),
        active,
        lag_bytes: lag.unwrap_or(0).max(0),
        lost: wal_status.as_deref() == Some("lost"),
        missing: false,
    }))
}

/// Drops the slot and the publication; returns what it dropped. Refused while the slot holds
/// events no relay has read (they would never be published), unless `force`; fails while a relay
/// reads the slot.
pub(crate) async fn drop_source(
    conn: &mut PgConnection,
    source: &WalSource,
    force: bool,
) -> Result<Vec<String>, SourceError> {
    let mut dropped = Vec::new();
    let slot: Option<bool> =
        sqlx::query_scalar("SELECT active FROM pg_replication_slots WHERE slot_name = $1")
            .bind(&source.slot)
            .fetch_optional(&mut *conn)
            .await?;
    if slot == Some(false) && !force {
        let unread = unread_events(conn, source).await?;
        if unread > 0 {
            return Err(SourceError::Refused(format!(
                "replication slot {} holds {unread} events no relay has read yet; dropping it \
                 would lose them. Run the WAL relay until they are published (`outbox-relay \
                 status` shows the slot 0 bytes behind), or drop it anyway with --force",
                source.slot
            )));
        }
    }
    if slot.is_some() {
        sqlx::query("SELECT pg_drop_replication_slot($1)")
            .bind(&source.slot)
            .execute(&mut *conn)
            .await?;
        dropped.push(format!("replication slot {}", source.slot));
    }
    let publication = publication_of(&mut *conn, &source.publication).await?;
    if publication.as_ref().is_some_and(|(p, _)| !p.ours) {
        tracing::warn!(
            publication = %source.publication,
            "left the publication alone: another tool made it (it is not marked as a WAL relay's)"
        );
    } else if publication.is_some() {
        let drop = format!("DROP PUBLICATION {}", source.publication);
        sqlx::raw_sql(sqlx::AssertSqlSafe(drop))
            .execute(&mut *conn)
            .await?;
        dropped.push(format!("publication {}", source.publication));
    }
    Ok(dropped)
}

/// The outbox events in the slot's unread WAL: rows inserted into this schema's outbox table and
/// table-less events; none when the publication is gone (nothing could read them).
async fn unread_events(conn: &mut PgConnection, source: &WalSource) -> Result<u64, SourceError> {
    if publication_of(&mut *conn, &source.publication)
        .await?
        .is_none()
    {
        return Ok(0);
    }
    let unread = super::unread::peek(conn, source, "0/0").await?;
    Ok(unread.row_ids.len() as u64 + unread.table_less)
}

/// Samples the slot into its gauges every `every` until `shutdown`.
pub(crate) async fn sample_slot(
    session: crate::source::table::SessionConfig,
    slot: String,
    every: std::time::Duration,
    shutdown: tokio_util::sync::CancellationToken,
) {
    crate::source::table::every_tick(
        &session,
        &seaorm_outbox::TableName::DEFAULT,
        every,
        shutdown,
        "sampling the slot",
        |table| {
            let slot = slot.clone();
            Box::pin(async move {
                let Some(conn) = table.postgres() else {
                    return Ok(());
                };
                let status = status(conn, &slot).await?;
                crate::metrics::slot_sampled(
                    status.as_ref().map(|s| s.lag_bytes),
                    status.is_some_and(|s| s.active),
                );
                Ok(())
            })
        },
    )
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wal_source_refuses_servers_older_than_14() {
        assert!(supported_version("150018").is_ok());
        assert!(supported_version("140000").is_ok());
        let refused = supported_version("130011").unwrap_err().0;
        assert!(
            refused.starts_with("PostgreSQL 13 is older than 14") && refused.contains("polling"),
            "{refused}"
        );
        assert!(supported_version("120000").is_err());
    }
}
