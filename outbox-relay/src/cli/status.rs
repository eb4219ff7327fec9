//! `outbox-relay status`: the backlog, the age of the oldest unpublished event, parked events.

use super::UsageError;
use super::output::failure;
use super::settings::Settings;
use crate::redact_url;
use std::process::ExitCode;

pub(super) async fn status(settings: &Settings) -> Result<ExitCode, UsageError> {
    let url = settings.database_url()?;
    let tables = settings.tables()?;
    for (i, table) in tables.iter().enumerate() {
        match crate::status(&url, table).await {
            // One table's status as it always read; several, each under its name.
            Ok(status) if tables.len() == 1 => println!("{status}"),
            Ok(status) => {
                let gap = if i == 0 { "" } else { "\n" };
                println!("{gap}table {table}:\n{status}");
            }
            Err(e) => {
                return Ok(failure(&format!(
                    "status of {} (table {table}): {e}",
                    redact_url(&url)
                )));
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
