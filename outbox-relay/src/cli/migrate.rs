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
    let databases = settings.databases().await?;
    if notify_trigger
        && databases
            .iter()
            .any(|(_, url)| Backend::of(url) != Backend::Postgres)
    {
        return Err(UsageError("--notify-trigger needs PostgreSQL".into()));
    }
    let tables = settings.tables()?;
    let mut failed = false;
    for (tenant, url) in &databases {
        let tenant = tenant
            .as_ref()
            .map_or(String::new(), |t| format!("tenant {t}, "));
        for table in &tables {
            match apply(url, table, notify_trigger).await {
                Ok(()) => println!(
                    "outbox schema is up to date on {} ({tenant}table {table})",
                    redact_url(url)
                ),
                // One tenant's database down leaves the others to migrate.
                Err(e) => {
                    failure(&format!(
                        "migrate {} ({tenant}table {table}): {e}",
                        redact_url(url)
                    ));
                    failed = true;
                }
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
