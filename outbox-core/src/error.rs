//! The one error type of `seaorm_outbox`.

/// Everything that can go wrong while recording events or reading the registry.
///
/// ```
/// # use seaorm_outbox::Error;
/// fn describe(e: &Error) -> &'static str {
///     match e {
///         Error::Serialize { .. } => "the event could not become JSON; nothing was written",
///         Error::Database(_) => "the database refused the statement",
///         _ => "another outbox error",
///     }
/// }
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The event could not be serialized to JSON. Nothing was written.
    #[error("could not serialize event `{event_type}` to JSON: {source}")]
    Serialize {
        /// The event type that failed.
        event_type: String,
        /// serde_json's error.
        #[source]
        source: serde_json::Error,
    },

    /// The database returned an error. The caller's transaction should be rolled back.
    #[error("outbox database error: {0}")]
    Database(#[from] sea_orm::DbErr),

    /// An event carries a header whose name the broker contract sets (see
    /// [`RESERVED_HEADERS`](crate::RESERVED_HEADERS)): it would change what consumers read as the
    /// event's id or type. Nothing was written.
    #[error(
        "header `{name}` of event `{event_type}` is reserved: the relay sets it from the event itself"
    )]
    ReservedHeader {
        /// The header.
        name: String,
        /// The event type that carried it.
        event_type: String,
    },

    /// An event's payload is larger than [`max_payload_bytes`](crate::max_payload_bytes) once
    /// serialized: the broker would refuse it. Nothing was written.
    #[error(
        "event `{event_type}` is {bytes} bytes of JSON, over the limit of {limit} (Outbox::with_max_payload_bytes, or seaorm_outbox::set_max_payload_bytes for the process)"
    )]
    PayloadTooLarge {
        /// The event type.
        event_type: String,
        /// The payload's size, serialized.
        bytes: usize,
        /// The limit it passed.
        limit: usize,
    },

    /// A name is longer than its column on MySQL and MariaDB (`VARCHAR(255)`), which would cut it
    /// short: two aggregates could become one. Nothing was written.
    #[error(
        "the {column} of event `{event_type}` is {chars} characters long; the outbox table on MySQL and MariaDB holds {limit}"
    )]
    TooLong {
        /// The column: `aggregate_type`, `aggregate_id`, `event_type` or `topic`.
        column: &'static str,
        /// The event type (cut to the column's length if it is the one too long).
        event_type: String,
        /// The value's length in characters.
        chars: usize,
        /// The column's length.
        limit: usize,
    },

    /// The connection's backend is not one outbox supports.
    #[error("outbox supports PostgreSQL, SQLite, MySQL and MariaDB, not {0:?}")]
    UnsupportedBackend(sea_orm::DbBackend),

    /// [`Recording::LogicalMessage`](crate::Recording) writes into PostgreSQL's WAL; this
    /// connection's database has none.
    #[error("table-less recording (Recording::LogicalMessage) needs PostgreSQL, not {0:?}")]
    LogicalMessageUnsupported(sea_orm::DbBackend),

    /// A table name that is not one (see [`TableName`](crate::TableName)). Nothing was written.
    #[error(transparent)]
    InvalidTableName(#[from] crate::InvalidTableName),

    /// A schema-qualified table (`billing.outbox`) on a backend whose tables have no schema in
    /// this sense (SQLite, and MySQL, where a schema is another database: use its URL instead).
    #[error(
        "the outbox table `{table}` names a schema, which only PostgreSQL supports; on {backend:?} name a table without one"
    )]
    SchemaUnsupported {
        /// The table.
        table: crate::TableName,
        /// The connection's backend.
        backend: sea_orm::DbBackend,
    },

    /// Two Rust types linked into this binary register the same event type.
    #[error("event type `{event_type}` is registered by two Rust types: `{first}` and `{second}`")]
    DuplicateEventType {
        /// The event type both claim.
        event_type: String,
        /// One Rust type.
        first: String,
        /// The other Rust type.
        second: String,
    },
}

/// `Result` with [`Error`](enum@Error).
pub type Result<T, E = Error> = std::result::Result<T, E>;
