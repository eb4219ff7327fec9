//! `outbox-relay status`: the backlog, the age of the oldest unpublished event, parked events.

use super::UsageError;
use super::output::failure;
use super::settings::Settings;
use crate::redact_url;
use std::process::ExitCode;

pub(super) async fn status(settings: &Settings) -> Result<ExitCode, UsageError> {
    let databases = settings.databases().await?;
    let tables = settings.tables()?;
    let mut printed = 0;
    let mut failed = false;
    for (tenant, url) in &databases {
        for table in &tables {
            match crate::status(url, table).await {
                // One table's status as it always read; several, each under its name.
                Ok(status) if databases.len() == 1 && tables.len() == 1 && tenant.is_none() => {
                    println!("{status}");
                }
                Ok(status) => {
                    let gap = if printed == 0 { "" } else { "\n" };
                    match tenant {
                        Some(tenant) => println!("{gap}tenant {tenant}, table {table}:\n{status}"),
                        None => println!("{gap}table {table}:\n{status}"),
                    }
                    printed += 1;
                }
                // One tenant's database down leaves the others' status to print.
                Err(e) => {
                    let tenant = tenant
                        .as_ref()
                        .map_or(String::new(), |t| format!("tenant {t}, "));
                    failure(&format!(
                        "status of {} ({tenant}table {table}): {e}",
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
