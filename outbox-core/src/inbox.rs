//! The inbox: apply each received event's effect exactly once.
//!
//! Delivery is at least once, so a consumer sees some events twice. [`Inbox::process`] opens a
//! transaction, records `(consumer, event id)` in `processed_events`, and runs your handler in that
//! same transaction. A second delivery of the event hits the primary key and is reported as
//! [`Processed::Duplicate`] without running the handler; a failing handler rolls back both its
//! effect and the record, so the event can be processed again.

use crate::{Error, Result};
use futures_core::future::BoxFuture;
use sea_orm::{
    ConnectionTrait, DatabaseConnection, DatabaseTransaction, DbBackend, Statement,
    TransactionTrait,
};
use uuid::Uuid;

/// What became of one received event.
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub enum Processed<T> {
    /// The handler ran and its transaction committed.
    Applied(T),
    /// This consumer had already processed the event: nothing was done.
    Duplicate,
}

/// Why processing an event failed. Nothing it did was committed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum InboxError<E> {
    /// The handler failed; its transaction was rolled back.
    #[error("the handler failed: {0}")]
    Handler(E),
    /// The database failed.
    #[error(transparent)]
    Outbox(#[from] Error),
}

/// The processed-events record of one consumer (one name per consuming service or purpose).
///
/// ```no_run
/// use seaorm_outbox::inbox::{Inbox, Processed};
/// use seaorm_outbox::sea_orm::ConnectionTrait;
///
/// # async fn f(db: &seaorm_outbox::sea_orm::DatabaseConnection, event_id: seaorm_outbox::Uuid) -> Result<(), Box<dyn std::error::Error>> {
/// let inbox = Inbox::new("billing");
/// let outcome = inbox
///     .process(db, event_id, |txn| {
///         Box::pin(async move {
///             txn.execute_unprepared("UPDATE accounts SET balance = balance - 1999 WHERE id = 7").await?;
///             Ok::<_, seaorm_outbox::sea_orm::DbErr>(())
///         })
///     })
///     .await?;
/// if outcome == Processed::Duplicate {
///     // Already applied: acknowledge the message and move on.
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Inbox {
    consumer: String,
}

impl Inbox {
    /// The inbox of `consumer`.
    pub fn new(consumer: impl Into<String>) -> Self {
        Inbox {
            consumer: consumer.into(),
        }
    }

    /// Runs `handler` for event `event_id` unless this consumer already processed it, recording
    /// the event in the handler's own transaction.
    pub async fn process<T, E, F>(
        &self,
        db: &DatabaseConnection,
        event_id: Uuid,
        handler: F,
    ) -> std::result::Result<Processed<T>, InboxError<E>>
    where
        F: for<'t> FnOnce(&'t DatabaseTransaction) -> BoxFuture<'t, std::result::Result<T, E>>,
    {
        let txn = db.begin().await.map_err(Error::from)?;
        if !self.record(&txn, event_id).await? {
            txn.rollback().await.map_err(Error::from)?;
            return Ok(Processed::Duplicate);
        }
        match handler(&txn).await {
            Ok(value) => {
                txn.commit().await.map_err(Error::from)?;
                Ok(Processed::Applied(value))
            }
            Err(e) => {
                txn.rollback().await.map_err(Error::from)?;
                Err(InboxError::Handler(e))
            }
        }
    }

    /// Records the event for this consumer; false if it was already there. A concurrent
    /// transaction recording the same event makes this wait until it commits or rolls back.
    pub(crate) async fn record(&self, txn: &DatabaseTransaction, event_id: Uuid) -> Result<bool> {
        let backend = txn.get_database_backend();
        let sql = match backend {
            DbBackend::Postgres => {
                "INSERT INTO processed_events (consumer, event_id) VALUES ($1, $2::text::uuid) ON CONFLICT DO NOTHING"
            }
            DbBackend::Sqlite => {
                "INSERT INTO processed_events (consumer, event_id) VALUES (?1, ?2) ON CONFLICT DO NOTHING"
            }
            // Not INSERT IGNORE, which would also turn a consumer name too long for its column
            // into a warning and a truncated name. A duplicate key fails the statement alone: the
            // transaction goes on.
            DbBackend::MySql => "INSERT INTO processed_events (consumer, event_id) VALUES (?, ?)",
            other => return Err(Error::UnsupportedBackend(other)),
        };
        let values = [self.consumer.clone().into(), event_id.to_string().into()];
        match txn
            .execute_raw(Statement::from_sql_and_values(backend, sql, values))
            .await
        {
            Ok(result) => Ok(result.rows_affected() == 1),
            Err(e)
                if backend == DbBackend::MySql
                    && matches!(
                        e.sql_err(),
                        Some(sea_orm::SqlErr::UniqueConstraintViolation(_))
                    ) =>
            {
                Ok(false)
            }
            Err(e) => Err(e.into()),
        }
    }
}
