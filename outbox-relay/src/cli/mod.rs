//! The `outbox-relay` command line: `run`, `migrate`, `routes`, `status`, `failed`.
//!
//! Settings come from flags, then environment variables, then the TOML file named by `--config`,
//! then defaults (`layers.rs` says how, and how secrets stay off the command line; `settings.rs`
//! lists every setting). A bad flag,
//! URL or file prints one line on stderr (clap's own errors keep their tips) and exits with code 2,
//! having done nothing.
//!
//! One module per command: `run`, `migrate`, `routes`, `status`, `failed`, `wal`; the clap
//! types are in `args.rs`, the printing in `output.rs`.

mod args;
mod defaults;
mod failed;
mod layers;
mod migrate;
mod output;
mod routes;
mod run;
mod settings;
mod status;
mod values;
mod wal;

use args::{Cli, Command};
use clap::{CommandFactory, FromArgMatches};
use std::process::ExitCode;

/// A problem with the user's input: reported in one line, exit code 2.
#[derive(Debug)]
pub(crate) struct UsageError(pub String);

/// The entry point of `outbox-relay`, and of your own relay binary:
///
/// ```no_run
/// // use my_events as _;   // links your event types' registrations
/// fn main() -> std::process::ExitCode {
///     seaorm_outbox_relay::cli::main()
/// }
/// ```
pub fn main() -> ExitCode {
    let command = defaults::with_defaults(Cli::command());
    let cli = match command
        .try_get_matches()
        .and_then(|matches| Cli::from_arg_matches(&matches))
    {
        Ok(cli) => cli,
        Err(e) => {
            // --help and --version print to stdout and succeed; usage errors keep clap's tips.
            let _ = e.print();
            return if e.use_stderr() {
                ExitCode::from(2)
            } else {
                ExitCode::SUCCESS
            };
        }
    };
    // One thread: the relay waits on the database and the broker (librdkafka has threads of its
    // own), and a single-threaded runtime spends no CPU handing wake-ups between threads (about a
    // tenth of the relay's CPU per event, measured with `scripts/bench --only as-run`).
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => return output::failure(&format!("cannot start the runtime: {e}")),
    };
    // `run` stops gracefully on SIGINT and SIGTERM. Its handlers go in first, before any file is
    // read or connection opened, so a signal during start-up also means "stop", with exit code 0.
    // (Other commands keep the default: a signal ends them at once.)
    let shutdown = match &cli.command {
        Command::Run(_) => {
            let _runtime = runtime.enter();
            match run::shutdown_on_signals() {
                Ok(token) => Some(token),
                Err(e) => return output::failure(&format!("cannot handle signals: {e}")),
            }
        }
        _ => None,
    };
    let (settings, command) = match load(cli) {
        Ok(loaded) => loaded,
        Err(e) => return output::usage_error(&e.0),
    };
    output::init_logging(settings.log_format.unwrap_or(values::LogFormat::Human));
    for warning in layers::take_warnings() {
        tracing::warn!("{warning}");
    }
    runtime.block_on(async move {
        let result = match command {
            Command::Run(_) => run::run(&settings, shutdown.unwrap_or_default()).await,
            Command::Migrate {
                notify_trigger,
                partitioned,
                ..
            } => {
                migrate::migrate(
                    &settings,
                    notify_trigger,
                    partitioned.map(|values::Wait(d)| d),
                )
                .await
            }
            Command::Routes(_) => Ok(routes::routes(&settings)),
            Command::Status(_) => status::status(&settings).await,
            Command::Failed { command, .. } => failed::failed(&settings, command).await,
            Command::Wal { command, .. } => wal::wal(&settings, command).await,
        };
        result.unwrap_or_else(|UsageError(message)| output::usage_error(&message))
    })
}

/// The settings of the command: its flags over the environment over the config file.
fn load(cli: Cli) -> Result<(settings::Settings, Command), UsageError> {
    let config = cli.config.as_deref();
    let mut settings = match &cli.command {
        Command::Run(flags) => layers::load(config, flags.as_ref())?,
        Command::Migrate { database, .. }
        | Command::Status(database)
        | Command::Failed { database, .. }
        | Command::Wal { database, .. } => layers::load(config, database)?,
        Command::Routes(flags) => layers::load(config, flags)?,
    };
    if cli.log_format.is_some() {
        settings.log_format = cli.log_format;
    }
    Ok((settings, cli.command))
}
