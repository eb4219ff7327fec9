//! `outbox-relay migrate`: create or upgrade the outbox tables.

use super::UsageError;
use super::output::failure;
use super::settings::Settings;
use crate::database::Backend;
use crate::redact_url;
use crate::source::table::wakeup::notify_trigger_sql;
use seaorm_outbox::TableName;
use std::process::ExitCode;

pub(super) async fn migrate(
    settings: &Settings,
    notify_trigger: bool,
) -> Result<ExitCode, UsageError> {
    let outboxes = settings.outboxes().await?;
    if notify_trigger
        && outboxes
            .iter()
            .any(|outbox| Backend::of(&outbox.database_url) != Backend::Postgres)
    {
        return Err(UsageError("--notify-trigger needs PostgreSQL".into()));
    }
    let mut failed = false;
    for outbox in &outboxes {
        let (url, about) = (redact_url(&outbox.database_url), outbox.describe());
        match apply(&outbox.database_url, &outbox.table, notify_trigger).await {
            Ok(()) => println!("outbox schema is up to date on {url} ({about})"),
            // One tenant's database down leaves the others to migrate.
            Err(e) => {
                failure(&format!("migrate {url} ({about}): {e}"));
                failed = true;
            }
        }
    }
    Ok(if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

async fn apply(
    url: &str,
    table: &TableName,
    notify_trigger: bool,
) -> Result<(), seaorm_outbox::sea_orm::DbErr> {
    use seaorm_outbox::sea_orm::{ConnectOptions, ConnectionTrait, Database};
    let (url, timeout) = crate::database::connect_timeout(url);
    let mut options = ConnectOptions::new(url);
    options
        .sqlx_logging(false)
        .connect_timeout(timeout)
        .acquire_timeout(timeout);
    let db = Database::connect(options).await?;
    seaorm_outbox::migration::migrate_table(&db, table).await?;
    if notify_trigger {
        db.execute_unprepared(&notify_trigger_sql(table)).await?;
    }
    Ok(())
}
