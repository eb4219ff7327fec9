//! The WAL source's publication of the outbox table, and how it is told from other tools'
//! publications of the same table (Debezium's, a warehouse sync's): a comment marks it as a WAL
//! relay's, and names its slot while the relay makes it and once it made it (so a slot dropped
//! later is told from a first start, and a first start cut short is finished). A polling relay
//! refuses only a marked publication.

use sqlx::PgConnection;

/// The comment on a publication made by a WAL relay, which tells it from other tools'
/// publications of the table (Debezium's, an analytics pipeline's); `; new slot NAME` follows
/// while the relay makes its slot and hands it the table's backlog, `; slot NAME` once it has,
/// then `; backlog held in snapshot XMIN:XMAX:XIP` (the snapshot the backlog was held in, whose
/// transactions the stream leaves out: `backlog.rs`).
const MARK: &str = "outbox-relay WAL source";

/// What follows the slot's name in the mark when it names the backlog's snapshot.
const BACKLOG: &str = "; backlog held in snapshot ";

/// Where a WAL relay's slot stands, as its publication's mark says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum SlotMark<'a> {
    /// No slot yet.
    None,
    /// The slot is being made: the events the table held before it are not handed over yet.
    New(&'a str),
    /// The slot was made and read: if it goes missing, events were lost. `backlog`: the
    /// snapshot the table's backlog was held in, when the slot was just handed it.
    Made {
        slot: &'a str,
        backlog: Option<&'a str>,
    },
}

/// Marks `publication` as a WAL relay's, with where its slot stands.
pub(super) async fn mark_ours(
    conn: &mut PgConnection,
    publication: &str,
    slot: SlotMark<'_>,
) -> Result<(), sqlx::Error> {
    let mark = match slot {
        SlotMark::None => MARK.to_owned(),
        SlotMark::New(slot) => format!("{MARK}; new slot {slot}"),
        SlotMark::Made {
            slot,
            backlog: None,
        } => format!("{MARK}; slot {slot}"),
        SlotMark::Made {
            slot,
            backlog: Some(snapshot),
        } => format!("{MARK}; slot {slot}{BACKLOG}{snapshot}"),
    };
    // Both names were checked to be plain identifiers (`WalSource::new`).
    let comment = format!("COMMENT ON PUBLICATION {publication} IS '{mark}'");
    match sqlx::raw_sql(sqlx::AssertSqlSafe(comment))
        .execute(conn)
        .await
    {
        Ok(_) => Ok(()),
        // Made by another role for the relay: it works unmarked, with less guarding.
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42501") => {
            tracing::warn!(
                %publication,
                "cannot mark the publication as the WAL relay's (the relay's role does not own it): \
                 polling relays will not tell it from another tool's, and a dropped slot will not \
                 be told from a first start; have its owner run COMMENT ON PUBLICATION {publication} \
                 IS '{mark}'"
            );
            Ok(())
        }
        Err(e) => Err(e),
    }
}

/// The columns that read a publication's mark: whether it is ours (marked, or named as a WAL
/// relay's publication was before publications were marked), the slot it names as made, the
/// one it names as being made, and the backlog's snapshot. (`$2` is [`BACKLOG`].)
const MARK_COLUMNS: &str = "
    coalesce(obj_description(p.oid, 'pg_publication') LIKE ($1 || '%'), p.pubname = 'outbox_relay')
        AS ours,
    substring(obj_description(p.oid, 'pg_publication') FROM '; slot ([^;]*)') AS slot,
    substring(obj_description(p.oid, 'pg_publication') FROM '; new slot (.*)$') AS new_slot,
    split_part(obj_description(p.oid, 'pg_publication'), $2, 2) AS backlog";

/// A publication of this schema's outbox table, as listed for the polling relay and `status`
/// (read as its name and [`MARK_COLUMNS`], then [`Publication::read`]).
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub(crate) struct Publication {
    pub name: String,
    /// Made by a WAL relay of this project.
    pub ours: bool,
    /// The slot a relay made for it, if it is ours.
    pub slot: Option<String>,
    /// The slot a relay is making for it (a first start cut short leaves it so).
    pub new_slot: Option<String>,
    /// The snapshot the table's backlog was held in for the slot (`backlog.rs`).
    pub backlog: Option<String>,
}

impl Publication {
    /// As read from [`MARK_COLUMNS`]: a slot and a snapshot are named only in a WAL relay's mark.
    fn read(self) -> Self {
        let ours = self.ours;
        Publication {
            slot: self.slot.filter(|_| ours),
            new_slot: self.new_slot.filter(|_| ours),
            backlog: self.backlog.filter(|b| ours && !b.is_empty()),
            ..self
        }
    }
}

/// A row of [`publication_of`].
#[derive(sqlx::FromRow)]
struct PublicationOf {
    publishes_outbox: bool,
    #[sqlx(flatten)]
    publication: Publication,
}

/// The publication named so, if it exists, and whether it publishes the inserts of this schema's
/// outbox table.
pub(super) async fn publication_of(
    conn: &mut PgConnection,
    name: &str,
) -> Result<Option<(Publication, bool)>, sqlx::Error> {
    let sql = format!(
        "SELECT p.pubinsert AND EXISTS (
                    SELECT 1 FROM pg_publication_tables t
                    JOIN pg_namespace n ON n.nspname = t.schemaname
                    JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = t.tablename
                    WHERE t.pubname = p.pubname AND c.oid = 'outbox'::regclass)
                    AS publishes_outbox,
                p.pubname::text AS name, {MARK_COLUMNS}
         FROM pg_publication p WHERE p.pubname = $3"
    );
    let found: Option<PublicationOf> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .bind(MARK)
        .bind(BACKLOG)
        .bind(name)
        .fetch_optional(conn)
        .await?;
    Ok(found.map(|row| (row.publication.read(), row.publishes_outbox)))
}

/// The publications of this schema's outbox table, made by any tool (`FOR ALL TABLES` ones too).
pub(crate) async fn publications(conn: &mut PgConnection) -> Result<Vec<Publication>, sqlx::Error> {
    let sql = format!(
        "SELECT p.pubname::text AS name, {MARK_COLUMNS}
         FROM pg_publication p
         JOIN pg_publication_tables t ON t.pubname = p.pubname
         JOIN pg_namespace n ON n.nspname = t.schemaname
         JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = t.tablename
         WHERE c.oid = to_regclass('outbox')
         ORDER BY 1"
    );
    let rows: Vec<Publication> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .bind(MARK)
        .bind(BACKLOG)
        .fetch_all(conn)
        .await?;
    Ok(rows.into_iter().map(Publication::read).collect())
}

/// What a polling relay says when a WAL relay's publication holds the table.
pub(crate) fn polling_refused(ours: &[&str]) -> String {
    format!(
        "the outbox table is in publication {} of a WAL relay (`run --source wal`), which never \
         marks rows: a polling relay would publish every event again. Run with --source wal, or \
         move to polling with `outbox-relay wal to-polling` (with that relay's --slot and \
         --publication; it marks what the WAL relays published), or `outbox-relay wal drop` to \
         publish every row again",
        ours.join(", ")
    )
}
