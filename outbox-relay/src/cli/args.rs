//! The command line's clap types: the commands, and their flags and environment variables.
//!
//! The settings a command shares with the config file ([`Settings`](super::settings::Settings) and
//! [`DatabaseArgs`]) are defined once, in `settings.rs`, and flattened in here.

use super::settings::{DatabaseArgs, Settings};
use super::values::{LogFormat, Wait};
use clap::{Args, Parser, Subcommand};
use serde::Serialize;
use std::path::PathBuf;

#[derive(Debug, Parser)]
#[command(
    name = "outbox-relay",
    version,
    about = "Publishes outbox events to a broker, in order per aggregate.",
    after_help = "Settings come from flags, then environment variables, then the TOML file named by \
                  --config, then defaults. Every secret can come from the environment or from a file \
                  instead of the command line: see `outbox-relay run --help` and docs/operations.md."
)]
pub(super) struct Cli {
    /// TOML configuration file; flags and environment variables take precedence over it.
    #[arg(long, env = "OUTBOX_CONFIG", global = true)]
    pub config: Option<PathBuf>,
    /// Log lines for people, or JSON for machines (to stderr).
    #[arg(long, value_enum, env = "OUTBOX_LOG_FORMAT", global = true)]
    pub log_format: Option<LogFormat>,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub(super) enum Command {
    /// Publish events until SIGINT or SIGTERM.
    Run(Box<Settings>),
    /// Create or upgrade the outbox tables.
    Migrate {
        #[command(flatten)]
        database: DatabaseArgs,
        /// Also install the trigger behind `--wakeup notify` (PostgreSQL).
        #[arg(long)]
        notify_trigger: bool,
        /// Create a missing outbox table in the partitioned layout (PostgreSQL): one partition of
        /// `created_at` per interval this long (`1d`, `1h`), made ahead by the relay, and
        /// retention drops partitions whose events are all published instead of deleting rows.
        #[arg(long, value_name = "INTERVAL")]
        partitioned: Option<Wait>,
    },
    /// List the event types linked into this binary, with their topics.
    Routes(RoutesArgs),
    /// Show the backlog and the age of the oldest unpublished event.
    Status(DatabaseArgs),
    /// Parked events: list them, retry them, or skip them.
    Failed {
        #[command(flatten)]
        database: DatabaseArgs,
        #[command(subcommand)]
        command: FailedCommand,
    },
    /// The WAL source's replication slot and publication.
    Wal {
        #[command(flatten)]
        database: DatabaseArgs,
        #[command(subcommand)]
        command: WalCommand,
    },
}

#[derive(Debug, Subcommand)]
pub(super) enum WalCommand {
    /// Drop the replication slot and the publication: PostgreSQL stops keeping WAL for them.
    /// Events not yet read are not published by the WAL source any more. Refused while a relay
    /// reads the slot. To move to polling relays, use `to-polling` instead.
    Drop {
        #[command(flatten)]
        names: WalNames,
        /// Drop the slot even while it holds events no relay has read (they are lost).
        #[arg(long)]
        force: bool,
    },
    /// Move this database from the WAL source to polling relays, losing nothing: waits until the
    /// WAL relays have published what was recorded before it and have stopped, marks what they
    /// published, leaves the rest (and parked events) to the polling relays, and drops the slot
    /// and the publication. Refused while table-less recording is on.
    ToPolling {
        #[command(flatten)]
        names: WalNames,
        /// How long to wait for the WAL relays, as 90s, 10m or 1h.
        #[arg(long, default_value = "10m", value_parser = humantime::parse_duration)]
        timeout: std::time::Duration,
    },
    /// Move this database from polling relays to the WAL source, losing nothing: waits until no
    /// polling relay runs, then makes the publication and the slot; the events the polling
    /// relays left go out first when a WAL relay starts, in order.
    FromPolling {
        #[command(flatten)]
        names: WalNames,
        /// How long to wait for the polling relays to stop, as 90s, 10m or 1h.
        #[arg(long, default_value = "10m", value_parser = humantime::parse_duration)]
        timeout: std::time::Duration,
    },
}

/// The WAL source a `wal` command acts on.
#[derive(Debug, Args)]
pub(super) struct WalNames {
    /// The replication slot.
    #[arg(long, default_value = "outbox_relay")]
    pub slot: String,
    /// The publication.
    #[arg(long, default_value = "outbox_relay")]
    pub publication: String,
}

#[derive(Debug, Args, Serialize)]
pub(super) struct RoutesArgs {
    /// The topic template for events without a topic of their own.
    #[arg(long)]
    pub topic_template: Option<String>,
}

#[derive(Debug, Subcommand)]
pub(super) enum FailedCommand {
    /// List parked events and why they were parked.
    List,
    /// Make parked (or backing-off) events due again, once their cause is fixed.
    Retry(#[command(flatten)] Select),
    /// Give up on parked events, recording why; their aggregates' later events go out.
    Skip {
        #[command(flatten)]
        select: Select,
        /// Why the events are given up on (kept in `last_error`).
        #[arg(long)]
        reason: String,
    },
}

#[derive(Debug, Args)]
#[group(required = true, multiple = false)]
pub(super) struct Select {
    /// Every parked event.
    #[arg(long)]
    pub all: bool,
    /// An event id; repeat for more.
    #[arg(long = "id", value_name = "UUID")]
    pub ids: Vec<seaorm_outbox::Uuid>,
    /// The parked events of one aggregate, as TYPE:ID.
    #[arg(long, value_name = "TYPE:ID", value_parser = aggregate)]
    pub aggregate: Option<(String, String)>,
}

fn aggregate(text: &str) -> Result<(String, String), String> {
    match text.split_once(':') {
        Some((t, id)) if !t.is_empty() && !id.is_empty() => Ok((t.to_owned(), id.to_owned())),
        _ => Err(format!("`{text}` is not TYPE:ID, such as order:42")),
    }
}
