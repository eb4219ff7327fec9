//! `outbox-relay wal drop`: remove the WAL source's slot and publication.

use super::UsageError;
use super::args::WalCommand;
use super::output::failure;
use super::settings::Settings;
use crate::redact_url;
use crate::source::wal::WalSource;
use std::process::ExitCode;

pub(super) async fn wal(settings: &Settings, command: WalCommand) -> Result<ExitCode, UsageError> {
    let url = settings.database_url()?;
    match command {
        WalCommand::Drop {
            slot,
            publication,
            force,
        } => {
            let source = WalSource::new(slot, publication).map_err(UsageError)?;
            Ok(
                match crate::source::wal::drop_source(&url, &source, force).await {
                    Ok(dropped) if dropped.is_empty() => {
                        println!(
                            "nothing to drop: no slot {} and no publication {}",
                            source.slot, source.publication
                        );
                        ExitCode::SUCCESS
                    }
                    Ok(dropped) => {
                        for what in dropped {
                            println!("dropped {what}");
                        }
                        ExitCode::SUCCESS
                    }
                    Err(crate::SourceError::Refused(reason)) => failure(&reason),
                    Err(e) => failure(&format!("{}: {e}", redact_url(&url))),
                },
            )
        }
    }
}
