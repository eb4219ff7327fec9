//! `outbox-relay wal`: drop the WAL source's slot and publication, or move a database between the
//! WAL source and polling relays.

use super::UsageError;
use super::args::{WalCommand, WalNames};
use super::output::failure;
use super::settings::Settings;
use crate::redact_url;
use crate::source::wal::{self, WalSource};
use std::process::ExitCode;

pub(super) async fn wal(settings: &Settings, command: WalCommand) -> Result<ExitCode, UsageError> {
    let url = settings.one_database()?;
    let source =
        |names: WalNames| WalSource::new(names.slot, names.publication).map_err(UsageError);
    let progress = |line: &str| eprintln!("{line}");
    let result = match command {
        WalCommand::Drop { names, force } => {
            let source = source(names)?;
            wal::drop_source(&url, &source, force).await.map(|dropped| {
                if dropped.is_empty() {
                    println!(
                        "nothing to drop: no slot {} and no publication {}",
                        source.slot, source.publication
                    );
                }
                for what in dropped {
                    println!("dropped {what}");
                }
            })
        }
        WalCommand::ToPolling { names, timeout } => {
            let source = source(names)?;
            wal::to_polling(&url, &source, timeout, progress)
                .await
                .map(|done| {
                    if !done.moved {
                        println!(
                            "nothing to move: no slot {} and no publication {}; polling relays can run",
                            source.slot, source.publication
                        );
                        return;
                    }
                    println!(
                        "moved to polling: marked {} events the WAL source published; left {} \
                         recorded since its last confirmation to the polling relays; {} held \
                         events now wait behind their parked event; {} kept table-less events \
                         became rows; dropped slot {} and publication {}. Start the polling relays.",
                        done.marked, done.unread, done.held, done.converted, source.slot,
                        source.publication
                    );
                })
        }
        WalCommand::FromPolling { names, timeout } => {
            let source = source(names)?;
            wal::from_polling(&url, &source, timeout, progress)
                .await
                .map(|handed| {
                    println!(
                        "ready for the WAL source: slot {} and publication {} are in place; the \
                         {handed} events the polling relays left go out first when a WAL relay \
                         starts (`run --source wal`)",
                        source.slot, source.publication
                    );
                })
        }
    };
    Ok(match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(crate::SourceError::Refused(reason)) => failure(&reason),
        Err(e) => failure(&format!("{}: {e}", redact_url(&url))),
    })
}
