//! When the relay looks for new rows: at once while batches come back full, otherwise after the
//! poll interval, or, with [`Wakeup::Notify`] on PostgreSQL, as soon as a transaction inserting
//! into the outbox commits.
//!
//! NOTIFY is off by default: PostgreSQL takes a database-wide lock at commit for every notifying
//! transaction, which serializes the application's committing transactions. Measure it first.

use seaorm_outbox::TableName;
use sqlx::postgres::PgListener;
use std::sync::Arc;
use tokio::sync::Notify;

pub use crate::config::Wakeup;

/// The channel the trigger of the default table notifies; another table's is its name.
pub const CHANNEL: &str = "outbox";

/// The channel the trigger of `table` notifies: its name (`outbox`, `billing.outbox`).
pub fn channel(table: &TableName) -> String {
    table.to_string()
}

/// [`NOTIFY_TRIGGER_SQL`] for `table`: its own function (in its schema) and trigger, notifying its
/// own [`channel`], so a relay of one table is not woken by another's inserts.
pub fn notify_trigger_sql(table: &TableName) -> String {
    if table.is_default() {
        return NOTIFY_TRIGGER_SQL.to_owned();
    }
    let function = match table.schema() {
        Some(schema) => format!("\"{schema}\".\"{}_notify\"", table.name()),
        None => format!("\"{}_notify\"", table.name()),
    };
    // A TableName is identifiers and dots only: safe inside the literal.
    format!(
        "
CREATE OR REPLACE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('{channel}', '');
    RETURN NULL;
END $$;
CREATE OR REPLACE TRIGGER \"{name}_notify\" AFTER INSERT ON {table}
    FOR EACH STATEMENT EXECUTE FUNCTION {function}();
",
        channel = channel(table),
        name = table.name(),
        table = table.quoted('"'),
    )
}

/// The optional trigger behind [`Wakeup::Notify`]: one notification per inserting statement
/// (PostgreSQL folds identical ones within a transaction).
pub const NOTIFY_TRIGGER_SQL: &str = "
CREATE OR REPLACE FUNCTION outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('outbox', '');
    RETURN NULL;
END $$;
CREATE OR REPLACE TRIGGER outbox_notify AFTER INSERT ON outbox
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_notify();
";

/// Starts listening to `channel` on its own connection; the returned [`Notify`] fires on each notification.
/// The listener reconnects by itself; while it is down, the relay still polls. It is one of
/// `tasks`, and stops, closing its connection, with them.
pub(crate) async fn listen(
    database_url: &str,
    channel: &str,
    tasks: &crate::tasks::BackgroundTasks,
) -> Result<Arc<Notify>, sqlx::Error> {
    let (options, timeout) = crate::database::postgres_options(database_url)?;
    // A pool of one, as `PgListener::connect` makes: it reconnects the listener, each connection
    // with the relay's keepalives.
    let keepalive_options = options.clone();
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .max_lifetime(None)
        .idle_timeout(None)
        .acquire_timeout(timeout)
        .after_connect(move |conn, _| {
            let options = keepalive_options.clone();
            Box::pin(async move { crate::database::keep_alive(conn, &options).await })
        })
        .connect_with(options)
        .await?;
    let mut listener = PgListener::connect_with(&pool).await?;
    listener.listen(channel).await?;
    let notify = Arc::new(Notify::new());
    let waker = Arc::clone(&notify);
    tasks.spawn("listener", move |stop| async move {
        loop {
            let received = tokio::select! {
                () = stop.cancelled() => return,
                received = listener.recv() => received,
            };
            match received {
                Ok(_) => waker.notify_one(),
                Err(e) => {
                    tracing::warn!(error = %e, "LISTEN connection failed; polling until it is back");
                    tokio::select! {
                        () = stop.cancelled() => return,
                        () = tokio::time::sleep(std::time::Duration::from_secs(1)) => {}
                    }
                }
            }
        }
    });
    Ok(notify)
}
