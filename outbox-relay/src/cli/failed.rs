//! `outbox-relay failed list | retry | skip`: parked events.

use super::UsageError;
use super::args::{FailedCommand, Select};
use super::output::failure;
use super::settings::Settings;
use crate::failed::{self, ParkedEvent, Selection};
use crate::redact_url;
use std::process::ExitCode;

pub(super) async fn failed(
    settings: &Settings,
    command: FailedCommand,
) -> Result<ExitCode, UsageError> {
    let url = settings.one_database()?;
    let url = url.as_str();
    let table = &settings.table()?;
    let result = match command {
        FailedCommand::List => failed::list(url, table)
            .await
            .map(|parked| print_parked(&parked)),
        FailedCommand::Retry(select) => {
            failed::retry(url, table, &selection(select))
                .await
                .map(|n| {
                    println!("{n} events will be retried");
                })
        }
        FailedCommand::Skip { select, reason } => {
            failed::skip(url, table, &selection(select), &reason)
                .await
                .map(|n| {
                    tracing::warn!(skipped = n, %reason, "parked events skipped by an operator");
                    println!("{n} events skipped");
                })
        }
    };
    Ok(match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => failure(&format!("{}: {e}", redact_url(url))),
    })
}

fn selection(select: Select) -> Selection {
    match (select.all, select.aggregate) {
        (true, _) => Selection::All,
        (false, Some((aggregate_type, aggregate_id))) => Selection::Aggregate {
            aggregate_type,
            aggregate_id,
        },
        (false, None) => Selection::Ids(select.ids.iter().map(ToString::to_string).collect()),
    }
}

fn print_parked(parked: &[ParkedEvent]) {
    if parked.is_empty() {
        println!("no parked events");
        return;
    }
    println!(
        "{:<36}  {:<24}  {:<20}  {:>8}  {:>7}  REASON",
        "ID", "AGGREGATE", "EVENT TYPE", "ATTEMPTS", "WAITING"
    );
    for p in parked {
        println!(
            "{:<36}  {:<24}  {:<20}  {:>8}  {:>7}  {}",
            p.id,
            format!("{}:{}", p.aggregate_type, p.aggregate_id),
            p.event_type,
            p.attempts,
            p.waiting,
            p.last_error
                .as_deref()
                .unwrap_or_default()
                .replace('\n', " "),
        );
    }
}
