//! What the command line prints besides its results: logs, usage errors, failures.

use super::values::LogFormat;
use std::io::IsTerminal;
use std::process::ExitCode;

/// Logs to stderr, human or JSON, filtered by `OUTBOX_LOG` (default `info,sqlx=warn`). Colours
/// only on a terminal.
pub(super) fn init_logging(format: LogFormat) {
    use tracing_subscriber::EnvFilter;
    let filter =
        EnvFilter::try_from_env("OUTBOX_LOG").unwrap_or_else(|_| EnvFilter::new("info,sqlx=warn"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Human => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
}

/// Bad input: one line, exit code 2.
pub(super) fn usage_error(message: &str) -> ExitCode {
    eprintln!("outbox-relay: {message} (see --help)");
    ExitCode::from(2)
}

/// The command ran and failed: one line, exit code 1.
pub(super) fn failure(message: &str) -> ExitCode {
    eprintln!("outbox-relay: {message}");
    ExitCode::FAILURE
}

/// The first line of a message, for one-line errors.
pub(super) fn one_line(text: &str) -> String {
    text.split('\n')
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}
