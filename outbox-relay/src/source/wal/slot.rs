//! The WAL source's place in PostgreSQL: a publication of the outbox table's inserts and a logical
//! replication slot that keeps the WAL until the relay confirms it. Created if missing, dropped by
//! `outbox-relay wal drop`, measured for `/metrics` and `outbox-relay status`.
//!
//! Also the guard that keeps the two sources apart: a polling relay would publish every event of a
//! table the WAL relay reads again (the WAL source never marks rows), so each refuses to start
//! while the other is in place.

use crate::config::WalSource;
use sqlx::PgConnection;

/// Why the WAL source cannot start as configured. Retrying does not help; an operator must act.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Refused(pub String);

/// Checks the database and creates the publication and the slot if they are missing.
pub(crate) async fn prepare(conn: &mut PgConnection, source: &WalSource) -> Result<(), Prepare> {
    let wal_level: String = sqlx::query_scalar("SELECT current_setting('wal_level')")
        .fetch_one(&mut *conn)
        .await?;
    if wal_level != "logical" {
        return Err(Prepare::Refused(Refused(format!(
            "PostgreSQL runs with wal_level = {wal_level}; the WAL source needs wal_level = logical \
             (set it in postgresql.conf and restart PostgreSQL)"
        ))));
    }
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
    let polling: i64 = sqlx::query_scalar(POLLING_RELAYS)
        .fetch_one(&mut *conn)
        .await?;
    if polling > 0 {
        return Err(Prepare::Refused(Refused(format!(
            "{polling} polling relay(s) publish this outbox table; stop them before starting the \
             WAL source, or both would publish every event"
        ))));
    }
    let published: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_publication_rel r JOIN pg_publication p ON p.oid = r.prpubid
                        WHERE p.pubname = $1 AND r.prrelid = 'outbox'::regclass)",
    )
    .bind(&source.publication)
    .fetch_one(&mut *conn)
    .await?;
    if !published {
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
        tracing::info!(publication = %source.publication, "created the publication of the outbox table");
    }
    let slot: Option<String> =
        sqlx::query_scalar("SELECT plugin::text FROM pg_replication_slots WHERE slot_name = $1")
            .bind(&source.slot)
            .fetch_optional(&mut *conn)
            .await?;
    match slot.as_deref() {
        Some("pgoutput") => {}
        Some(plugin) => {
            return Err(Prepare::Refused(Refused(format!(
                "replication slot {} uses the {plugin} plugin; the WAL source needs a pgoutput slot \
                 (choose another --wal-slot)",
                source.slot
            ))));
        }
        None => {
            ignore_duplicate(
                sqlx::query("SELECT pg_create_logical_replication_slot($1, 'pgoutput')")
                    .bind(&source.slot)
                    .execute(&mut *conn)
                    .await,
            )?;
            tracing::info!(slot = %source.slot, "created the replication slot");
        }
    }
    Ok(())
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

/// Live polling relays of this outbox table: their membership locks (see `source/table/leases.rs`).
const POLLING_RELAYS: &str = "
SELECT count(*) FROM pg_locks
WHERE locktype = 'advisory' AND objsubid = 2 AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND classid::bigint = (hashtext('outbox-relay:' || 'outbox'::regclass::oid::text)::bigint & 4294967295)
  AND objid::bigint >= 256";

/// The publications of the outbox table, if any: a polling relay refuses to run while one exists.
pub(crate) async fn publications(conn: &mut PgConnection) -> Result<Vec<String>, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT p.pubname::text FROM pg_publication_rel r JOIN pg_publication p ON p.oid = r.prpubid
         WHERE r.prrelid = to_regclass('outbox') ORDER BY 1",
    )
    .fetch_all(conn)
    .await
}

/// What a polling relay says when the table is published for logical replication.
pub(crate) fn polling_refused(publications: &[String]) -> String {
    format!(
        "the outbox table is in publication {} for a WAL relay (`run --source wal`), which never \
         marks rows: a polling relay would publish every event again. Run with --source wal, or, to \
         go back to polling, `outbox-relay wal drop` first",
        publications.join(", ")
    )
}

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
}

/// The state of every `pgoutput` slot of this database, when the outbox table is in a publication
/// (the WAL source's); empty otherwise.
pub(crate) async fn all_status(conn: &mut PgConnection) -> Result<Vec<SlotStatus>, sqlx::Error> {
    if publications(&mut *conn).await?.is_empty() {
        return Ok(Vec::new());
    }
    let rows: Vec<(String, bool, Option<i64>, Option<String>)> = sqlx::query_as(
        "SELECT slot_name::text, active, (pg_current_wal_lsn() - confirmed_flush_lsn)::bigint, wal_status
         FROM pg_replication_slots WHERE plugin = 'pgoutput' AND database = current_database()
         ORDER BY 1",
    )
    .fetch_all(conn)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(slot, active, lag, wal_status)| SlotStatus {
            slot,
            active,
            lag_bytes: lag.unwrap_or(0).max(0),
            lost: wal_status.as_deref() == Some("lost"),
        })
        .collect())
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
    }))
}

/// Drops the slot and the publication; returns what it dropped. Fails while a relay reads the slot.
pub(crate) async fn drop_source(
    conn: &mut PgConnection,
    source: &WalSource,
) -> Result<Vec<String>, sqlx::Error> {
    let mut dropped = Vec::new();
    let slot: Option<bool> =
        sqlx::query_scalar("SELECT active FROM pg_replication_slots WHERE slot_name = $1")
            .bind(&source.slot)
            .fetch_optional(&mut *conn)
            .await?;
    if slot.is_some() {
        sqlx::query("SELECT pg_drop_replication_slot($1)")
            .bind(&source.slot)
            .execute(&mut *conn)
            .await?;
        dropped.push(format!("replication slot {}", source.slot));
    }
    let publication: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1)")
            .bind(&source.publication)
            .fetch_one(&mut *conn)
            .await?;
    if publication {
        let drop = format!("DROP PUBLICATION {}", source.publication);
        sqlx::raw_sql(sqlx::AssertSqlSafe(drop))
            .execute(&mut *conn)
            .await?;
        dropped.push(format!("publication {}", source.publication));
    }
    Ok(dropped)
}

/// Samples the slot into its gauges every `every` until `shutdown`.
pub(crate) async fn sample_slot(
    database_url: String,
    slot: String,
    every: std::time::Duration,
    shutdown: tokio_util::sync::CancellationToken,
) {
    crate::source::table::every_tick(
        &database_url,
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
