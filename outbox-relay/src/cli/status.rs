//! `outbox-relay status`: the backlog, the age of the oldest unpublished event, parked events.

use super::UsageError;
use super::output::failure;
use super::settings::Settings;
use crate::redact_url;
use std::process::ExitCode;

pub(super) async fn status(settings: &Settings) -> Result<ExitCode, UsageError> {
    let url = settings.database_url()?;
    Ok(match crate::status(&url, &settings.table()?).await {
        Ok(status) => {
            println!("{status}");
            ExitCode::SUCCESS
        }
        Err(e) => failure(&format!("status of {}: {e}", redact_url(&url))),
    })
}
