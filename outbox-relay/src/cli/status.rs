//! `outbox-relay status`: the backlog, the age of the oldest unpublished event, parked events.

use super::UsageError;
use super::output::failure;
use super::settings::Settings;
use crate::redact_url;
use std::process::ExitCode;

pub(super) async fn status(settings: &Settings) -> Result<ExitCode, UsageError> {
    let outboxes = settings.outboxes().await?;
    let mut failed = false;
    for (i, outbox) in outboxes.iter().enumerate() {
        match crate::status(&outbox.database_url, &outbox.table).await {
            // One table's status as it always read; several, each under its name.
            Ok(status) if outboxes.len() == 1 && outbox.tenant.is_none() => println!("{status}"),
            Ok(status) => {
                let gap = if i == 0 { "" } else { "\n" };
                println!("{gap}{}:\n{status}", outbox.describe());
            }
            // One tenant's database down leaves the others' status to print.
            Err(e) => {
                let url = redact_url(&outbox.database_url);
                failure(&format!("status of {url} ({}): {e}", outbox.describe()));
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
