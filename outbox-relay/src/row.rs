//! One event as a source hands it to the relay: a row of the outbox table, or an event the WAL
//! source read (a row's insert, or a table-less event's logical message).

/// An unpublished outbox row, as claimed.
#[derive(Debug, Clone)]
pub(crate) struct OutboxRow {
    pub id: String,
    pub seq: i64,
    /// Where the event stands in its source, unique among the events the source has handed out
    /// and not yet settled: the pump names events by it (which are in flight, which were
    /// settled). The table's `seq`; for the WAL source, its count of the events it read.
    pub position: i64,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub event_type: String,
    pub event_version: i32,
    pub topic: Option<String>,
    /// The payload JSON, read once from the database and shared, not copied, from here to the
    /// sink. Empty when the row has a [`defect`](Self::defect).
    pub payload: bytes::Bytes,
    pub headers: Option<String>,
    /// Failed publish attempts so far.
    pub attempts: i32,
    /// When it was recorded, in milliseconds since the Unix epoch; `None` for a date that is not
    /// one (`infinity` on PostgreSQL, any text on SQLite): the row is published all the same.
    pub created_ms: Option<i64>,
    /// Why this row can never be published as it is, found while reading it: a column of the
    /// wrong type (SQLite stores whatever a hand-written row puts there), a payload that is not
    /// JSON or is over [`Limits::max_payload_bytes`](crate::batch::Limits::max_payload_bytes). The relay parks it with this reason.
    pub defect: Option<String>,
    /// A table-less event exactly as it was recorded (its JSON in the logical message, or the whole
    /// message when it cannot be read): what the WAL source keeps when it parks or holds the event,
    /// and publishes again from. `None` for a table row.
    pub recorded: Option<bytes::Bytes>,
}

#[cfg(test)]
impl OutboxRow {
    /// An `order` row of `aggregate_id`, for the ordering rules' unit tests.
    pub(crate) fn for_test(aggregate_id: &str, seq: i64, attempts: i32) -> OutboxRow {
        OutboxRow {
            id: format!("id-{seq}"),
            seq,
            position: seq,
            aggregate_type: "order".into(),
            aggregate_id: aggregate_id.into(),
            event_type: "OrderPlaced".into(),
            event_version: 1,
            topic: None,
            payload: bytes::Bytes::from_static(b"{}"),
            headers: None,
            attempts,
            created_ms: None,
            defect: None,
            recorded: None,
        }
    }
}

/// Which row an outcome is about. PostgreSQL settles rows by `id`, its primary key (a uuid,
/// always readable); SQLite by `seq`, its primary key (an integer, readable where a hand-written
/// `id` may not be).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RowKey {
    pub id: String,
    pub seq: i64,
    /// The event's [`OutboxRow::position`] in its source.
    pub position: i64,
}

/// An aggregate: `(aggregate_type, aggregate_id)`. Its events are published in order.
pub(crate) type Aggregate = (String, String);

impl OutboxRow {
    pub fn aggregate(&self) -> Aggregate {
        (self.aggregate_type.clone(), self.aggregate_id.clone())
    }

    pub fn key(&self) -> RowKey {
        RowKey {
            id: self.id.clone(),
            seq: self.seq,
            position: self.position,
        }
    }
}
