//! Moving a database between the sources without losing or reordering an event:
//! `outbox-relay wal to-polling` and `outbox-relay wal from-polling`.
//!
//! **To polling.** The WAL source never marks rows, so the table alone cannot say what it
//! published. What it published is what it confirmed: everything in the WAL before the slot's
//! confirmed position, except what it keeps in the table (parked, or held behind a parked event).
//! The rest, the slot's unread WAL, is read without consuming it (a peek). So, once no WAL relay
//! reads the slot, one transaction marks published every unpublished row that is neither kept nor
//! in the unread WAL, hands the held events to the polling relays (they hold nothing: an
//! aggregate's events simply wait behind its parked one), turns the table-less events it kept into
//! plain rows, and drops the publication and the slot. Rows committed after its snapshot are in
//! the unread WAL or invisible to it: they are left for the polling relays. Table-less events in
//! the unread WAL refuse the move: a polling relay cannot see them, and after the move nothing
//! would read those recorded later (table-less recording must be off first).
//!
//! **From polling.** Once no polling relay runs, the WAL source is prepared as a WAL relay's first
//! start prepares it: the slot is made, and the events the table holds unpublished are handed to
//! it (held, and released first, in order: `slot.rs`).

use super::parked;
use super::publication::publication_of;
use super::slot::{self, POLLING_RELAYS, Refused};
use super::unread;
use crate::config::WalSource;
use crate::error::SourceError;
use sqlx::{Connection, PgConnection};
use std::time::Duration;
use tokio::time::Instant;

/// What [`to_polling`] did: how many events it marked, left, handed over and converted.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ToPolling {
    /// Rows the WAL source published, now marked so.
    pub marked: u64,
    /// Rows in the slot's unread WAL, left for the polling relays.
    pub unread: u64,
    /// Events held behind a parked one, handed to the polling relays (they wait behind it there).
    pub held: u64,
    /// Table-less events the WAL source kept (parked or held), turned into plain rows.
    pub converted: u64,
    /// Whether there was a WAL source to move from at all.
    pub moved: bool,
}

/// How often the wait reports its progress.
const PROGRESS_EVERY: Duration = Duration::from_secs(5);

/// How many rows one statement marks.
const MARK_PAGE: i64 = 10_000;

/// Moves the database from the WAL source of `source` to polling (`outbox-relay wal to-polling`,
/// `docs/operations.md`): waits, up to `timeout`, until the WAL relays have published everything
/// recorded before the call and have stopped, telling `progress` what it waits for, then marks
/// what they published and drops the slot and the publication. Refused
/// ([`SourceError::Refused`], nothing changed) while table-less recording is on.
///
/// ```no_run
/// # async fn f() -> Result<(), seaorm_outbox_relay::SourceError> {
/// use seaorm_outbox_relay::wal::{self, WalSource};
/// use std::time::Duration;
///
/// let url = "postgres://relay@db/app";
/// let done = wal::to_polling(url, &WalSource::default(), Duration::from_secs(600), |line| {
///     eprintln!("{line}")
/// })
/// .await?;
/// println!("{} events were published by the WAL source", done.marked);
/// # Ok(()) }
/// ```
pub async fn to_polling(
    url: &str,
    source: &WalSource,
    timeout: Duration,
    mut progress: impl FnMut(&str),
) -> Result<ToPolling, SourceError> {
    let mut db = crate::database::connect_postgres(url).await?;
    let publication = publication_of(&mut db, &source.publication).await?;
    let slot = slot::status(&mut db, &source.slot).await?;
    let made = match (&publication, &slot) {
        (None, None) => return Ok(ToPolling::default()),
        (Some((p, _)), _) if !p.ours => {
            return Err(refused(format!(
                "publication {} was not made by a WAL relay (it is not marked as one): polling \
                 relays run beside it already",
                source.publication
            )));
        }
        (Some((p, _)), _) => p.slot.as_deref() == Some(source.slot.as_str()),
        (None, Some(_)) => {
            return Err(refused(format!(
                "publication {} is gone, though replication slot {} remains: its unread WAL \
                 cannot be read, so which events the WAL source published cannot be told. \
                 `outbox-relay wal drop` drops the slot; the polling relays then publish every \
                 row again (consumers deduplicate them)",
                source.publication, source.slot
            )));
        }
    };
    match slot {
        Some(s) if s.lost => {
            return Err(refused(format!(
                "replication slot {} is lost: which events the WAL source published cannot be \
                 told. `outbox-relay wal drop` acknowledges the gap; the polling relays then \
                 publish every row again (consumers deduplicate them)",
                source.slot
            )));
        }
        None if made => {
            return Err(refused(format!(
                "replication slot {} is gone, though publication {} says a relay read it: which \
                 events the WAL source published cannot be told. `outbox-relay wal drop` \
                 acknowledges the gap; the polling relays then publish every row again \
                 (consumers deduplicate them)",
                source.slot, source.publication
            )));
        }
        _ => {}
    }
    let start_lsn: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
        .fetch_one(&mut db)
        .await?;
    wait_for_the_wal_relays(&mut db, source, &start_lsn, timeout, &mut progress).await?;
    hand_over(&mut db, source, &start_lsn, &mut progress).await
}

/// Waits until the WAL relays reading the slot have confirmed everything before `start_lsn` and
/// have stopped, their last confirmation included.
async fn wait_for_the_wal_relays(
    db: &mut PgConnection,
    source: &WalSource,
    start_lsn: &str,
    timeout: Duration,
    progress: &mut impl FnMut(&str),
) -> Result<(), SourceError> {
    let deadline = Instant::now() + timeout;
    let mut reported: Option<Instant> = None;
    let mut read_up = false;
    loop {
        let state: Option<(bool, i64)> = sqlx::query_as(
            "SELECT active, greatest(($2::pg_lsn - confirmed_flush_lsn)::int8, 0)
             FROM pg_replication_slots WHERE slot_name = $1",
        )
        .bind(&source.slot)
        .bind(start_lsn)
        .fetch_optional(&mut *db)
        .await?;
        let Some((active, behind)) = state else {
            return Ok(());
        };
        if !active {
            let no_reader: bool = sqlx::query_scalar(slot::NO_READER)
                .bind(&source.slot)
                .fetch_one(&mut *db)
                .await?;
            if no_reader {
                return Ok(());
            }
        }
        if behind == 0 && !read_up {
            read_up = true;
            progress(
                "the WAL relays have published everything recorded before this command: stop \
                 them now (this command finishes once none reads the slot)",
            );
        } else if behind > 0 && reported.is_none_or(|at| at.elapsed() >= PROGRESS_EVERY) {
            reported = Some(Instant::now());
            progress(&format!(
                "waiting for the WAL relays to publish what was recorded before this command: \
                 {behind} bytes of WAL to go"
            ));
        }
        if Instant::now() >= deadline {
            return Err(refused(format!(
                "gave up after {}: a WAL relay still reads slot {}; nothing was changed",
                humantime::format_duration(timeout),
                source.slot
            )));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The hand-over, in one transaction whose snapshot comes before the peek of the unread WAL.
async fn hand_over(
    db: &mut PgConnection,
    source: &WalSource,
    start_lsn: &str,
    progress: &mut impl FnMut(&str),
) -> Result<ToPolling, SourceError> {
    let mut tx = db.begin().await?;
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        .execute(&mut *tx)
        .await?;
    let slot: Option<(bool, Option<String>)> = sqlx::query_as(
        "SELECT active, confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
    )
    .bind(&source.slot)
    .fetch_optional(&mut *tx)
    .await?;
    let publication = publication_of(&mut tx, &source.publication).await?;
    // Without a slot, no WAL relay read anything (`to_polling` refused a gap): nothing is marked.
    let unread = match &slot {
        Some((true, _)) => return Err(a_relay_reads(source)),
        Some(_) if publication.is_none() => {
            return Err(refused(format!(
                "publication {} was dropped while this command ran; nothing was changed",
                source.publication
            )));
        }
        Some(_) => Some(unread::peek(&mut tx, source, start_lsn).await?),
        None => None,
    };
    let unread_rows = unread.as_ref().map_or(0, |u| u.row_ids.len() as u64);
    let unread = unread.unwrap_or_default();
    if unread.table_less > 0 {
        return Err(refused(if unread.table_less_since_start > 0 {
            format!(
                "table-less recording is still on: {} events were recorded without a row since \
                 this command began. Turn it off in the application (polling relays cannot see \
                 such events), then run this again; nothing was changed",
                unread.table_less_since_start
            )
        } else {
            format!(
                "slot {} holds {} table-less events no WAL relay has published, which polling \
                 relays cannot see: run a WAL relay and run this command while it runs (it waits \
                 for them); nothing was changed",
                source.slot, unread.table_less
            )
        }));
    }
    sqlx::query("CREATE TEMPORARY TABLE outbox_unread (id uuid PRIMARY KEY) ON COMMIT DROP")
        .execute(&mut *tx)
        .await?;
    for ids in unread.row_ids.chunks(10_000) {
        sqlx::query("INSERT INTO outbox_unread SELECT unnest($1::uuid[]) ON CONFLICT DO NOTHING")
            .bind(ids)
            .execute(&mut *tx)
            .await?;
    }
    let pruned: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM unnest($1::uuid[]) u(id)
         WHERE NOT EXISTS (SELECT 1 FROM outbox o WHERE o.id = u.id)",
    )
    .bind(&unread.visible_row_ids)
    .fetch_one(&mut *tx)
    .await?;
    if pruned > 0 {
        return Err(refused(format!(
            "{pruned} events in slot {}'s unread WAL have no row any more (pruned past the \
             retention while no relay read them): run a WAL relay and run this command while it \
             runs (it waits for them); nothing was changed",
            source.slot
        )));
    }
    let converted = parked::convert_table_less(&mut tx).await?;
    let marked = if slot.is_some() {
        mark_published(&mut tx, progress).await?
    } else {
        0
    };
    let held = sqlx::query(
        "UPDATE outbox SET held_at = NULL WHERE held_at IS NOT NULL AND published_at IS NULL",
    )
    .execute(&mut *tx)
    .await?
    .rows_affected();
    if publication.is_some() {
        // The name was checked to be a plain identifier (`WalSource::new`).
        let drop = format!("DROP PUBLICATION {}", source.publication);
        sqlx::raw_sql(sqlx::AssertSqlSafe(drop))
            .execute(&mut *tx)
            .await?;
    }
    if let Some((_, confirmed)) = slot {
        // A relay that read the slot since the peek would have confirmed more, or holds it.
        let dropped: Option<bool> = sqlx::query_scalar(
            "SELECT pg_drop_replication_slot(slot_name) IS NOT NULL FROM pg_replication_slots
             WHERE slot_name = $1 AND confirmed_flush_lsn::text IS NOT DISTINCT FROM $2",
        )
        .bind(&source.slot)
        .bind(&confirmed)
        .fetch_optional(&mut *tx)
        .await
        .map_err(|e| match e {
            sqlx::Error::Database(d) if d.code().as_deref() == Some("55006") => {
                a_relay_reads(source)
            }
            e => e.into(),
        })?;
        if dropped.is_none() {
            return Err(a_relay_reads(source));
        }
    }
    tx.commit().await?;
    Ok(ToPolling {
        marked,
        unread: unread_rows,
        held,
        converted,
        moved: true,
    })
}

/// Marks published, a page at a time, every row the WAL source published: unpublished, not kept,
/// and not in the unread WAL.
async fn mark_published(
    tx: &mut PgConnection,
    progress: &mut impl FnMut(&str),
) -> Result<u64, sqlx::Error> {
    let (mut marked, mut after_seq) = (0u64, i64::MIN);
    let mut reported = Instant::now();
    loop {
        let page: (i64, Option<i64>) = sqlx::query_as(
            "WITH page AS (
                 SELECT id, seq FROM outbox o
                 WHERE published_at IS NULL AND parked_at IS NULL AND held_at IS NULL AND seq > $1
                   AND NOT EXISTS (SELECT 1 FROM outbox_unread u WHERE u.id = o.id)
                 ORDER BY seq LIMIT $2),
             marked AS (
                 UPDATE outbox SET published_at = now() FROM page WHERE outbox.id = page.id
                 RETURNING outbox.seq)
             SELECT count(*), max(seq) FROM marked",
        )
        .bind(after_seq)
        .bind(MARK_PAGE)
        .fetch_one(&mut *tx)
        .await?;
        marked += page.0 as u64;
        match page.1 {
            Some(last) if page.0 == MARK_PAGE => after_seq = last,
            _ => return Ok(marked),
        }
        if reported.elapsed() >= PROGRESS_EVERY {
            reported = Instant::now();
            progress(&format!(
                "marked {marked} events the WAL source published so far"
            ));
        }
    }
}

/// Moves the database from polling to the WAL source of `source` (`outbox-relay wal
/// from-polling`): waits, up to `timeout`, until no polling relay runs, telling `progress`, then
/// prepares the source as a WAL relay's first start does. Returns how many unpublished events it
/// handed to the WAL source (they go out first when a WAL relay starts).
///
/// ```no_run
/// # async fn f() -> Result<(), seaorm_outbox_relay::SourceError> {
/// use seaorm_outbox_relay::wal::{self, WalSource};
/// use std::time::Duration;
///
/// let url = "postgres://relay@db/app";
/// let handed = wal::from_polling(url, &WalSource::default(), Duration::from_secs(600), |line| {
///     eprintln!("{line}")
/// })
/// .await?;
/// println!("{handed} events wait for the WAL relay");
/// # Ok(()) }
/// ```
pub async fn from_polling(
    url: &str,
    source: &WalSource,
    timeout: Duration,
    mut progress: impl FnMut(&str),
) -> Result<u64, SourceError> {
    let mut db = crate::database::connect_postgres(url).await?;
    let deadline = Instant::now() + timeout;
    let mut reported: Option<Instant> = None;
    loop {
        let polling: i64 = sqlx::query_scalar(POLLING_RELAYS)
            .fetch_one(&mut db)
            .await?;
        if polling == 0 {
            break;
        }
        if Instant::now() >= deadline {
            return Err(refused(format!(
                "gave up after {}: {polling} polling relay(s) still run; nothing was changed",
                humantime::format_duration(timeout)
            )));
        }
        if reported.is_none_or(|at| at.elapsed() >= PROGRESS_EVERY) {
            reported = Some(Instant::now());
            progress(&format!(
                "waiting for the polling relays to stop: {polling} still run"
            ));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The rows the polling relays' claims held wait behind a parked or backing-off event: to the
    // WAL source a held row waits for a release written into the WAL, which none would get. As
    // unpublished rows they are handed over with the others, in `seq` order.
    sqlx::query(
        "UPDATE outbox SET held_at = NULL WHERE held_at IS NOT NULL AND published_at IS NULL",
    )
    .execute(&mut db)
    .await?;
    Ok(slot::prepare(&mut db, source).await?)
}

fn a_relay_reads(source: &WalSource) -> SourceError {
    refused(format!(
        "a WAL relay started reading slot {} again: stop it and run this again; nothing was \
         changed",
        source.slot
    ))
}

fn refused(reason: String) -> SourceError {
    SourceError::Refused(Refused(reason).0)
}
