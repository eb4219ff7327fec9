//! The WAL source's publication of the outbox table, and how it is told from other tools'
//! publications of the same table (Debezium's, a warehouse sync's): a comment marks it as a WAL
//! relay's, and names its slot while the relay makes it and once it made it (so a slot dropped
//! later is told from a first start, and a first start cut short is finished). A polling relay
//! refuses only a marked publication.

use sqlx::PgConnection;

/// The comment on a publication made by a WAL relay, which tells it from other tools'
/// publications of the table (Debezium's, an analytics pipeline's); `; new slot NAME` follows
/// while the relay makes its slot and hands it the table's backlog, `; slot NAME` once it has.
const MARK: &str = "outbox-relay WAL source";

/// Where a WAL relay's slot stands, as its publication's mark says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum SlotMark<'a> {
    /// No slot yet.
    None,
    /// The slot is being made: the events the table held before it are not handed over yet.
    New(&'a str),
    /// The slot was made and read: if it goes missing, events were lost.
    Made(&'a str),
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
        SlotMark::Made(slot) => format!("{MARK}; slot {slot}"),
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
/// relay's publication was before publications were marked), the slot it names as made, and the
/// one it names as being made.
const MARK_COLUMNS: &str = "
    coalesce(obj_description(p.oid, 'pg_publication') LIKE ($1 || '%'), p.pubname = 'outbox_relay'),
    substring(obj_description(p.oid, 'pg_publication') FROM '; slot (.*)$'),
    substring(obj_description(p.oid, 'pg_publication') FROM '; new slot (.*)$')";

/// A publication of this schema's outbox table, as listed for the polling relay and `status`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Publication {
    pub name: String,
    /// Made by a WAL relay of this project.
    pub ours: bool,
    /// The slot a relay made for it, if it is ours.
    pub slot: Option<String>,
    /// The slot a relay is making for it (a first start cut short leaves it so).
    pub new_slot: Option<String>,
}

impl Publication {
    /// From a row of [`MARK_COLUMNS`]: a slot is named only in a WAL relay's mark.
    fn read(name: String, ours: bool, slot: Option<String>, new_slot: Option<String>) -> Self {
        Publication {
            name,
            slot: slot.filter(|_| ours),
            new_slot: new_slot.filter(|_| ours),
            ours,
        }
    }
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
                    WHERE t.pubname = p.pubname AND c.oid = 'outbox'::regclass),
                {MARK_COLUMNS}
         FROM pg_publication p WHERE p.pubname = $2"
    );
    let found: Option<(bool, bool, Option<String>, Option<String>)> =
        sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .bind(MARK)
            .bind(name)
            .fetch_optional(conn)
            .await?;
    Ok(found.map(|(outbox, ours, slot, new_slot)| {
        (
            Publication::read(name.to_owned(), ours, slot, new_slot),
            outbox,
        )
    }))
}

/// The publications of this schema's outbox table, made by any tool (`FOR ALL TABLES` ones too).
pub(crate) async fn publications(conn: &mut PgConnection) -> Result<Vec<Publication>, sqlx::Error> {
    let sql = format!(
        "SELECT p.pubname::text, {MARK_COLUMNS}
         FROM pg_publication p
         JOIN pg_publication_tables t ON t.pubname = p.pubname
         JOIN pg_namespace n ON n.nspname = t.schemaname
         JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = t.tablename
         WHERE c.oid = to_regclass('outbox')
         ORDER BY 1"
    );
    let rows: Vec<(String, bool, Option<String>, Option<String>)> =
        sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .bind(MARK)
            .fetch_all(conn)
            .await?;
    Ok(rows
        .into_iter()
        .map(|(name, ours, slot, new_slot)| Publication::read(name, ours, slot, new_slot))
        .collect())
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
