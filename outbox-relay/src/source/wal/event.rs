//! From the WAL to [`OutboxRow`]s: a row inserted into the outbox table, or the events of one
//! `record` call emitted as a logical message (table-less recording, see
//! [`seaorm_outbox::Recording`]). Both become the same rows the polling relay reads, so routing, the
//! message contract and parking are the polling relay's own.

use super::pgoutput::{Relation, Value};
use crate::row::OutboxRow;
use bytes::Bytes;
use pgwire_replication::Lsn;

/// A row read from the WAL, and whether the relay itself wrote it as parked or held (the WAL source
/// keeps a table-less event it parks or holds as a row with `parked_at` or `held_at` set; that
/// insert comes back through the stream and is not published).
pub(crate) struct Decoded {
    pub row: OutboxRow,
    pub parked: bool,
}

/// The outbox row an `Insert` carries. The table's columns are found by name, so column order and
/// added columns do not matter.
pub(crate) fn from_insert(
    relation: &Relation,
    values: &[Value],
    max_payload_bytes: usize,
) -> Decoded {
    let column = |name: &str| -> Option<&Bytes> {
        let index = relation.columns.iter().position(|c| c == name)?;
        match values.get(index)? {
            Value::Text(text) => Some(text),
            Value::Null | Value::Unchanged => None,
        }
    };
    let text = |name: &str| column(name).map(|b| String::from_utf8_lossy(b).into_owned());
    let str_of = |name: &str| column(name).and_then(|b| std::str::from_utf8(b).ok());
    let number = |name: &str| str_of(name).and_then(|t| t.parse::<i64>().ok());
    let mut defect = None;
    let mut required = |name: &str| {
        text(name).unwrap_or_else(|| {
            defect.get_or_insert_with(|| format!("column `{name}` is missing or NULL"));
            String::new()
        })
    };
    let id = required("id");
    let aggregate_type = required("aggregate_type");
    let aggregate_id = required("aggregate_id");
    let event_type = required("event_type");
    let payload = column("payload").cloned().unwrap_or_default();
    if defect.is_none() && payload.len() > max_payload_bytes {
        defect = Some(format!(
            "payload too large: {} bytes, over the relay's limit of {max_payload_bytes} (max_payload_bytes)",
            payload.len()
        ));
    }
    let row = OutboxRow {
        id,
        seq: number("seq").unwrap_or(-1),
        position: 0,
        aggregate_type,
        aggregate_id,
        event_type,
        event_version: number("event_version")
            .and_then(|v| i32::try_from(v).ok())
            .unwrap_or(1),
        topic: text("topic"),
        payload: if defect.is_some() {
            Bytes::new()
        } else {
            payload
        },
        headers: text("headers"),
        attempts: number("attempts")
            .and_then(|v| i32::try_from(v).ok())
            .unwrap_or(0),
        created_ms: str_of("created_at").and_then(timestamp_ms),
        defect,
        recorded: None,
    };
    Decoded {
        row,
        parked: column("parked_at").is_some() || column("held_at").is_some(),
    }
}

/// PostgreSQL's text form of a `timestamptz` in the replication session (ISO dates, UTC):
/// `2026-12-03 12:34:56.123456+00`, read by hand (chrono's format strings cost a tenth of the
/// relay's time per event); any other form through chrono.
fn timestamp_ms(text: &str) -> Option<i64> {
    utc_timestamp_ms(text.as_bytes()).or_else(|| {
        chrono::DateTime::parse_from_str(text, "%Y-%m-%d %H:%M:%S%.f%#z")
            .ok()
            .map(|t| t.timestamp_millis())
    })
}

/// `YYYY-MM-DD HH:MM:SS[.fraction]+00` in milliseconds since the Unix epoch; `None` for any other
/// form.
fn utc_timestamp_ms(b: &[u8]) -> Option<i64> {
    let digits = |range: std::ops::Range<usize>| -> Option<i64> {
        let part = b.get(range)?;
        part.iter().try_fold(0i64, |n, &d| {
            d.is_ascii_digit().then(|| n * 10 + i64::from(d - b'0'))
        })
    };
    if b.len() < 22 || [b[4], b[7], b[10], b[13], b[16]] != [b'-', b'-', b' ', b':', b':'] {
        return None;
    }
    let (year, month, day) = (digits(0..4)?, digits(5..7)?, digits(8..10)?);
    let (hour, minute, second) = (digits(11..13)?, digits(14..16)?, digits(17..19)?);
    let mut at = 19;
    let mut millis = 0;
    if b[at] == b'.' {
        let start = at + 1;
        at = start;
        while at < b.len() && b[at].is_ascii_digit() {
            at += 1;
        }
        let fraction = digits(start..at.min(start + 3))?;
        let shown = (at.min(start + 3) - start) as u32;
        millis = fraction * 10i64.pow(3 - shown);
    }
    if &b[at..] != b"+00" || !(1..=12).contains(&month) || !(1..=31).contains(&day) {
        return None;
    }
    // Days from 1970-01-01 to the civil date (Howard Hinnant's algorithm).
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let year_of_era = y - era * 400;
    let day_of_year = (153 * (month + if month > 2 { -3 } else { 9 }) + 2) / 5 + day - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    let days = era * 146_097 + day_of_era - 719_468;
    Some(((days * 24 + hour) * 60 + minute) * 60_000 + second * 1000 + millis)
}

/// The rows of a logical message from `record` in table-less mode: the JSON array of events the
/// table insert would have unpacked, each with its own id, aggregate, type, version, topic,
/// headers and payload. `commit_ms` stands in for `created_at`. Each row keeps its event's bytes
/// as recorded. An element that is not such an event, or a message that is not an array, yields
/// one defective row (parked with the reason, its bytes kept) named after `lsn`, the message's
/// position, so a replay of the stream parks the same row again rather than a second one.
pub(crate) fn from_message(
    content: &Bytes,
    lsn: Lsn,
    commit_ms: Option<i64>,
    max_payload_bytes: usize,
) -> Vec<OutboxRow> {
    let elements: Vec<&serde_json::value::RawValue> = match serde_json::from_slice(content) {
        Ok(elements) => elements,
        Err(e) => {
            return vec![unreadable(
                content.clone(),
                format!("message at {lsn}"),
                commit_ms,
                format!("an outbox logical message is not an array of events: {e}"),
            )];
        }
    };
    elements
        .into_iter()
        .enumerate()
        .map(|(index, element)| {
            let recorded = content.slice_ref(element.get().as_bytes());
            from_recorded(&recorded, commit_ms, max_payload_bytes).unwrap_or_else(|reason| {
                unreadable(
                    recorded,
                    format!("event {index} of the message at {lsn}"),
                    commit_ms,
                    reason,
                )
            })
        })
        .collect()
}

/// The row of one table-less event from its recorded JSON (an element of a logical message),
/// or why it cannot be read. The payload is the recorded bytes themselves, not a copy.
pub(crate) fn from_recorded(
    recorded: &Bytes,
    created_ms: Option<i64>,
    max_payload_bytes: usize,
) -> Result<OutboxRow, String> {
    #[derive(serde::Deserialize)]
    struct Event<'a> {
        id: String,
        aggregate_type: String,
        aggregate_id: String,
        event_type: String,
        #[serde(default = "first_version")]
        event_version: i32,
        #[serde(default)]
        topic: Option<String>,
        #[serde(borrow)]
        payload: &'a serde_json::value::RawValue,
        #[serde(default, borrow)]
        headers: Option<&'a serde_json::value::RawValue>,
    }
    fn first_version() -> i32 {
        1
    }
    let e: Event<'_> = serde_json::from_slice(recorded).map_err(|e| {
        format!("an outbox logical message holds an event that cannot be read: {e}")
    })?;
    let raw = e.payload.get();
    let too_large = raw.len() > max_payload_bytes;
    Ok(OutboxRow {
        id: e.id,
        seq: -1,
        position: 0,
        aggregate_type: e.aggregate_type,
        aggregate_id: e.aggregate_id,
        event_type: e.event_type,
        event_version: e.event_version,
        topic: e.topic,
        payload: if too_large {
            Bytes::new()
        } else {
            recorded.slice_ref(raw.as_bytes())
        },
        headers: e.headers.map(|h| h.get().to_owned()),
        attempts: 0,
        created_ms,
        defect: too_large.then(|| {
            format!(
                "payload too large: {} bytes, over the relay's limit of {max_payload_bytes} (max_payload_bytes)",
                raw.len()
            )
        }),
        recorded: Some(recorded.clone()),
    })
}

/// A row standing for bytes that are not an event: parked with `reason`, the bytes kept.
fn unreadable(recorded: Bytes, name: String, created_ms: Option<i64>, reason: String) -> OutboxRow {
    OutboxRow {
        id: name,
        seq: -1,
        position: 0,
        aggregate_type: "unknown".into(),
        aggregate_id: "unknown".into(),
        event_type: "unknown".into(),
        event_version: 1,
        topic: None,
        payload: Bytes::new(),
        headers: None,
        attempts: 0,
        created_ms,
        defect: Some(reason),
        recorded: Some(recorded),
    }
}

/// The id under which the WAL source keeps an event in the table: its own when it is a UUID,
/// else a UUID derived from it (the same on every replay, so parking it twice writes one row).
/// The event's own id stays in `recorded`.
pub(crate) fn table_id(id: &str) -> uuid::Uuid {
    // A fixed namespace of this crate's own (a random v4), so derived ids never collide with
    // another tool's v5 ids of the same text.
    const NAMESPACE: uuid::Uuid = uuid::uuid!("5b0c2a9e-3f41-4c55-9d6e-0b7a8f3c1e24");
    uuid::Uuid::parse_str(id).unwrap_or_else(|_| uuid::Uuid::new_v5(&NAMESPACE, id.as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn relation() -> Relation {
        Relation {
            namespace: "public".into(),
            name: "outbox".into(),
            columns: [
                "id",
                "seq",
                "aggregate_type",
                "aggregate_id",
                "event_type",
                "event_version",
                "topic",
                "payload",
                "headers",
                "created_at",
                "parked_at",
            ]
            .map(str::to_owned)
            .to_vec(),
        }
    }

    fn text(s: &str) -> Value {
        Value::Text(Bytes::copy_from_slice(s.as_bytes()))
    }

    #[test]
    fn timestamps_read_by_hand_match_chrono() {
        let chrono_ms = |text: &str| {
            chrono::DateTime::parse_from_str(text, "%Y-%m-%d %H:%M:%S%.f%#z")
                .unwrap()
                .timestamp_millis()
        };
        for text in [
            "2026-12-03 12:34:56.123456+00",
            "2026-12-03 12:34:56+00",
            "2026-12-03 12:34:56.1+00",
            "2026-12-03 12:34:56.98+00",
            "2024-02-29 23:59:59.999999+00",
            "2000-03-01 00:00:00+00",
            "1970-01-01 00:00:00+00",
            "1969-12-31 23:59:59.5+00",
            "1900-01-01 00:00:00+00",
        ] {
            assert_eq!(
                utc_timestamp_ms(text.as_bytes()),
                Some(chrono_ms(text)),
                "{text}"
            );
        }
        // Other forms go through chrono, or are no date.
        assert_eq!(utc_timestamp_ms(b"2026-12-03 12:34:56+02"), None);
        assert_eq!(
            timestamp_ms("2026-12-03 14:34:56+02"),
            Some(chrono_ms("2026-12-03 12:34:56+00"))
        );
        assert_eq!(timestamp_ms("infinity"), None);
        assert_eq!(utc_timestamp_ms(b"2026-13-03 12:34:56+00"), None);
    }

    #[test]
    fn an_insert_becomes_the_row_the_polling_relay_reads() {
        let values = [
            text("01939f1c-7b6a-7cc0-8f3e-1a2b3c4d5e6f"),
            text("42"),
            text("order"),
            text("o-1"),
            text("OrderPlaced"),
            text("2"),
            Value::Null,
            text(r#"{"a": 1}"#),
            text(r#"{"tenant": "acme"}"#),
            text("2026-12-01 11:12:23.5+00"),
            Value::Null,
        ];
        let decoded = from_insert(&relation(), &values, 100);
        assert!(!decoded.parked);
        let row = decoded.row;
        assert_eq!(row.defect, None);
        assert_eq!((row.seq, row.event_version), (42, 2));
        assert_eq!(row.aggregate_id, "o-1");
        assert_eq!(row.payload, &br#"{"a": 1}"#[..]);
        assert_eq!(row.headers.as_deref(), Some(r#"{"tenant": "acme"}"#));
        assert_eq!(row.created_ms, Some(1_796_123_543_500));
        let too_large = from_insert(&relation(), &values, 3).row;
        assert!(
            too_large
                .defect
                .unwrap()
                .contains("payload too large: 8 bytes")
        );
        let mut parked = values.clone();
        parked[10] = text("2026-12-01 11:12:24+00");
        assert!(from_insert(&relation(), &parked, 100).parked);
        let mut no_id = values;
        no_id[0] = Value::Null;
        assert!(
            from_insert(&relation(), &no_id, 100)
                .row
                .defect
                .unwrap()
                .contains("`id`")
        );
    }

    #[test]
    fn a_message_becomes_one_row_per_event_with_its_payload_bytes_kept() {
        let content = Bytes::from_static(
            br#"[{"payload":{"b":[1, 2]},"id":"e1","aggregate_type":"order","aggregate_id":"o-1","event_type":"A","event_version":3,"topic":null},
                {"payload":"x","id":"e2","aggregate_type":"order","aggregate_id":"o-2","event_type":"B","event_version":1,"topic":"t","headers":{"h":"v"}}]"#,
        );
        let rows = from_message(&content, Lsn(1), Some(7), 100);
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].payload, &br#"{"b":[1, 2]}"#[..]);
        assert_eq!((rows[0].event_version, rows[0].created_ms), (3, Some(7)));
        assert_eq!(rows[1].topic.as_deref(), Some("t"));
        assert_eq!(rows[1].headers.as_deref(), Some(r#"{"h":"v"}"#));
        assert_eq!(
            rows[1].recorded.as_deref(),
            Some(&br#"{"payload":"x","id":"e2","aggregate_type":"order","aggregate_id":"o-2","event_type":"B","event_version":1,"topic":"t","headers":{"h":"v"}}"#[..])
        );
        assert!(
            from_message(&content, Lsn(1), None, 5)[0]
                .defect
                .as_ref()
                .unwrap()
                .contains("too large")
        );
        let broken = from_message(&Bytes::from_static(b"{}"), Lsn(0x2A), None, 100);
        assert!(broken[0].defect.as_ref().unwrap().contains("not an array"));
        assert_eq!(broken[0].recorded.as_deref(), Some(&b"{}"[..]));
        assert_eq!(broken[0].id, "message at 0/2A");
        let one_bad = from_message(
            &Bytes::from_static(br#"[{"id":"e1"},{"payload":1,"id":"e2","aggregate_type":"a","aggregate_id":"1","event_type":"T"}]"#),
            Lsn(3),
            None,
            100,
        );
        assert_eq!(one_bad[0].recorded.as_deref(), Some(&br#"{"id":"e1"}"#[..]));
        assert!(
            one_bad[0]
                .defect
                .as_ref()
                .unwrap()
                .contains("cannot be read")
        );
        assert_eq!(
            (one_bad[1].id.as_str(), one_bad[1].defect.as_ref()),
            ("e2", None)
        );
    }

    #[test]
    fn an_event_is_kept_under_its_own_id_or_one_derived_from_it() {
        let own = "01939f1c-7b6a-7cc0-8f3e-1a2b3c4d5e6f";
        assert_eq!(table_id(own).to_string(), own);
        assert_eq!(table_id("order-42"), table_id("order-42"));
        assert_ne!(table_id("order-42"), table_id("order-43"));
    }
}
