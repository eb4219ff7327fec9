//! Reading claimed rows: column by column, so a row that cannot be read comes back with its
//! defect (and is parked) instead of failing the claim for every aggregate.

use crate::batch::Limits;
use crate::row::OutboxRow;

impl OutboxRow {
    /// Reads one claimed row column by column. A column that cannot be read becomes the row's
    /// defect, so one bad row is parked instead of failing the claim for every aggregate.
    pub(crate) fn read<R>(row: &R, limits: &Limits) -> OutboxRow
    where
        R: sqlx::Row,
        for<'n> &'n str: sqlx::ColumnIndex<R>,
        for<'r> String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
        for<'r> i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
        for<'r> i32: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
        for<'r> bool: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    {
        let mut defect = None;
        let seq: i64 = column(row, "seq", &mut defect).unwrap_or(-1);
        let unreadable = || format!("<unreadable, seq {seq}>");
        let text = |name: &str, defect: &mut Option<String>| {
            column::<R, String>(row, name, defect).unwrap_or_else(unreadable)
        };
        let id = text("id", &mut defect);
        let aggregate_type = text("aggregate_type", &mut defect);
        let aggregate_id = text("aggregate_id", &mut defect);
        let event_type = text("event_type", &mut defect);
        let event_version = column(row, "event_version", &mut defect).unwrap_or(0);
        let topic = column(row, "topic", &mut defect).flatten();
        let headers = column(row, "headers", &mut defect).flatten();
        let attempts = column(row, "attempts", &mut defect).unwrap_or(0);
        let created_ms = column(row, "created_ms", &mut defect).flatten();
        let payload_bytes: i64 = column(row, "payload_bytes", &mut defect).unwrap_or(0);
        // NULL when the database left the check to the relay.
        let payload_valid: Option<bool> = column(row, "payload_valid", &mut defect).flatten();
        let payload: Option<String> = column(row, "payload", &mut defect).flatten();
        let payload_valid =
            payload_valid.unwrap_or_else(|| payload.as_deref().is_some_and(is_json));
        if defect.is_none() {
            defect = if payload_bytes > i64::try_from(limits.max_payload_bytes).unwrap_or(i64::MAX)
            {
                Some(format!(
                    "payload too large: {payload_bytes} bytes, over the relay's limit of {} (max_payload_bytes)",
                    limits.max_payload_bytes
                ))
            } else if !payload_valid || payload.is_none() {
                Some("payload is not valid JSON".to_owned())
            } else {
                None
            };
        }
        OutboxRow {
            id,
            seq,
            position: seq,
            aggregate_type,
            aggregate_id,
            event_type,
            event_version,
            topic,
            payload: payload.map(bytes::Bytes::from).unwrap_or_default(),
            headers,
            attempts,
            created_ms,
            defect,
            recorded: None,
        }
    }
}

/// The value of column `name`, or `None` with the first such failure kept in `defect`.
fn column<'r, R, T>(row: &'r R, name: &str, defect: &mut Option<String>) -> Option<T>
where
    R: sqlx::Row,
    for<'n> &'n str: sqlx::ColumnIndex<R>,
    T: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    match row.try_get::<T, _>(name) {
        Ok(value) => Some(value),
        Err(e) => {
            defect.get_or_insert_with(|| format!("column `{name}` cannot be read: {e}"));
            None
        }
    }
}

/// What a claim read: its rows, whether it stopped at a limit with more rows waiting, and the
/// `seq`s of the blocked rows it met for the relay to hold (where the claim cannot hold them
/// itself: SQLite).
pub(super) struct Read {
    pub rows: Vec<OutboxRow>,
    pub full: bool,
    pub blocked: Vec<i64>,
}

/// Reads the claimed rows as they arrive (so each row's raw bytes are freed once read). A row of
/// no event (`id` NULL) carries `candidates` when the claim found no event, or the `seq` of a
/// blocked row.
pub(super) async fn read_rows<R>(
    mut raw: futures::stream::BoxStream<'_, Result<R, sqlx::Error>>,
    limits: &Limits,
) -> Result<Read, sqlx::Error>
where
    R: sqlx::Row,
    for<'n> &'n str: sqlx::ColumnIndex<R>,
    for<'r> String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> i32: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> bool: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    use futures::TryStreamExt;
    let (mut rows, mut blocked) = (Vec::new(), Vec::new());
    let mut candidates = 0;
    while let Some(row) = raw.try_next().await? {
        if rows.is_empty() {
            candidates = row
                .try_get::<i64, _>("candidates")
                .ok()
                .and_then(|n| usize::try_from(n).ok())
                .unwrap_or(0);
        }
        if matches!(row.try_get::<Option<String>, _>("id"), Ok(None)) {
            blocked.extend(row.try_get::<Option<i64>, _>("seq").ok().flatten());
            continue;
        }
        rows.push(OutboxRow::read(&row, limits));
    }
    let full = candidates >= limits.batch_size || (!rows.is_empty() && rows.len() < candidates);
    Ok(Read {
        rows,
        full,
        blocked,
    })
}

/// Whether `text` is one JSON document, checked without building it: where the claim leaves the
/// check to the relay (MySQL, whose `JSON_VALID` per row cost the database more than the claim's
/// read of the row).
fn is_json(text: &str) -> bool {
    serde_json::from_str::<serde::de::IgnoredAny>(text).is_ok()
}

#[cfg(test)]
mod tests {
    #[test]
    fn is_json_accepts_one_document_and_nothing_else() {
        assert!(super::is_json(r#"{"a": [1, 2.5, "x", null, true]}"#));
        assert!(super::is_json(" 3 "));
        assert!(!super::is_json(r#"{"a": "#));
        assert!(!super::is_json("{} {}"));
        assert!(!super::is_json(""));
    }
}
