//! Why the relay cannot publish from its source: decided by kind, not by text.

/// Why [`Relay::check_source`](crate::relay::Relay::check_source) found the relay cannot publish
/// now.
///
/// ```
/// use seaorm_outbox_relay::SourceError;
///
/// let refused = SourceError::Refused("the WAL source needs PostgreSQL".into());
/// assert!(!refused.is_temporary());
/// assert_eq!(refused.to_string(), "the WAL source needs PostgreSQL");
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SourceError {
    /// The database cannot be reached now, or failed: the relay waits for it and tries again.
    #[error("database: {0}")]
    Database(#[source] sqlx::Error),
    /// The relay must not run as configured (it would publish events twice, or the database
    /// cannot serve the source): it does not start.
    #[error("{0}")]
    Refused(String),
    /// Another relay publishes what this one would (it reads the WAL source's replication slot,
    /// or holds a MySQL database's relay lock): this one waits as its standby.
    #[error("another relay publishes {0}")]
    Standby(String),
    /// The replication stream failed or ended: the relay reconnects and resumes from the slot's
    /// confirmed position.
    #[error("replication: {0}")]
    Replication(String),
}

impl SourceError {
    /// Whether trying again later may succeed (the database was away), as opposed to a refusal.
    pub fn is_temporary(&self) -> bool {
        !matches!(self, SourceError::Refused(_))
    }
}

impl From<sqlx::Error> for SourceError {
    /// A database error, or a refusal when it shows the statements reach server sessions that
    /// other connections share: sqlx names its prepared statements per connection, so on
    /// PostgreSQL one that already exists (42P05) or has gone (26000) means a pooler in
    /// transaction mode, where retrying would fail the same way for ever.
    fn from(error: sqlx::Error) -> Self {
        if let sqlx::Error::Database(e) = &error
            && e.try_downcast_ref::<sqlx::postgres::PgDatabaseError>()
                .is_some_and(|e| matches!(e.code(), "42P05" | "26000"))
        {
            return SourceError::Refused(format!(
                "{error}: the relay's statements reach server sessions its other connections \
                 share, as through a pooler in transaction mode (PgBouncer's pool_mode = \
                 transaction, say). Connect the relay to PostgreSQL directly, or through a pool \
                 in session mode"
            ));
        }
        SourceError::Database(error)
    }
}
