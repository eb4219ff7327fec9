//! `outbox-relay migrate`: create or upgrade the outbox tables.

use super::UsageError;
use super::output::failure;
use super::settings::Settings;
use crate::database::Backend;
use crate::redact_url;
use crate::source::table::partitions;
use crate::source::table::wakeup::notify_trigger_sql;
use seaorm_outbox::TableName;
use std::process::ExitCode;
use std::time::Duration;

pub(super) async fn migrate(
    settings: &Settings,
    notify_trigger: bool,
    partitioned: Option<Duration>,
) -> Result<ExitCode, UsageError> {
    let outboxes = settings.outboxes().await?;
    let not_postgres = outboxes
        .iter()
        .any(|outbox| Backend::of(&outbox.database_url) != Backend::Postgres);
    if notify_trigger && not_postgres {
        return Err(UsageError("--notify-trigger needs PostgreSQL".into()));
    }
    if partitioned.is_some() && not_postgres {
        return Err(UsageError("--partitioned needs PostgreSQL".into()));
    }
    if partitioned.is_some_and(|every| every < Duration::from_secs(60)) {
        return Err(UsageError(
            "--partitioned: an interval of a minute or more".into(),
        ));
    }
    let mut failed = false;
    for outbox in &outboxes {
        let (url, about) = (redact_url(&outbox.database_url), outbox.describe());
        match apply(
            &outbox.database_url,
            &outbox.table,
            notify_trigger,
            partitioned,
        )
        .await
        {
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
    partitioned: Option<Duration>,
) -> Result<(), seaorm_outbox::sea_orm::DbErr> {
    use seaorm_outbox::sea_orm::{ConnectOptions, ConnectionTrait, Database};
    let (plain_url, timeout) = crate::database::connect_timeout(url);
    let mut options = ConnectOptions::new(plain_url);
    options
        .sqlx_logging(false)
        .connect_timeout(timeout)
        .acquire_timeout(timeout);
    let db = Database::connect(options).await?;
    match partitioned {
        Some(every) => {
            seaorm_outbox::migration::migrate_partitioned(&db, table).await?;
            // The first partitions now, not at the relay's first tick: recording starts at once.
            let made = async {
                let mut conn = crate::database::connect_postgres(url).await?;
                partitions::keep(&mut conn, table, Some(every), None).await
            };
            made.await
                .map_err(|e| seaorm_outbox::sea_orm::DbErr::Custom(e.to_string()))?;
        }
        None => seaorm_outbox::migration::migrate_table(&db, table).await?,
    }
    if notify_trigger {
        db.execute_unprepared(&notify_trigger_sql(table)).await?;
    }
    Ok(())
}
