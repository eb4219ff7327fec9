//! The defaults `run --help` shows, read from where the relay takes them, so the help cannot
//! drift from them.

use super::values::DEFAULT_HTTP_ADDR;
use super::values::{CloudEventsMode, FormatKind, SinkKind, SourceKind};
use crate::RelayConfig;
use clap::ValueEnum;
use std::time::Duration;

/// The defaults `run --help` shows, read from where the relay takes them ([`RelayConfig::new`],
/// [`WalSource::default`](crate::wal::WalSource), the endpoints' address), so the help cannot
/// drift from them. By argument id.
pub(super) fn run_defaults() -> Vec<(&'static str, String)> {
    fn name(value: impl ValueEnum) -> String {
        value
            .to_possible_value()
            .map(|v| v.get_name().to_owned())
            .unwrap_or_default()
    }
    fn wait(d: Duration) -> String {
        humantime::format_duration(d).to_string()
    }
    let config = RelayConfig::new("");
    let wal = crate::source::wal::WalSource::default();
    #[allow(unused_mut)] // without the pulsar feature nothing is added
    let mut defaults = vec![
        ("batch_size", config.batch_size.to_string()),
        ("max_batch_bytes", config.max_batch_bytes.to_string()),
        ("max_payload_bytes", config.max_payload_bytes.to_string()),
        ("poll_interval", wait(config.poll_interval)),
        ("min_poll_interval", wait(config.min_poll_interval)),
        ("mode", name(config.mode)),
        ("topic_template", config.topic_template),
        ("format", name(FormatKind::default())),
        (
            "cloudevents_mode",
            format!(
                "{}; {} on SQS and SNS",
                name(CloudEventsMode::Binary),
                name(CloudEventsMode::Structured)
            ),
        ),
        ("wakeup", name(config.wakeup)),
        ("source", name(SourceKind::default())),
        ("wal_slot", wal.slot),
        ("wal_publication", wal.publication),
        ("wal_window_bytes", wal.window_bytes.to_string()),
        ("lease_refresh", wait(config.lease_refresh)),
        ("statement_timeout", wait(config.statement_timeout)),
        ("retention", config.retention.map_or("off".into(), wait)),
        ("prune_interval", wait(config.prune_interval)),
        ("http_addr", DEFAULT_HTTP_ADDR.to_owned()),
        ("kind", name(default_sink())),
    ];
    #[cfg(feature = "pulsar")]
    {
        let pulsar = crate::sink::pulsar::PulsarConfig::new("");
        defaults.extend([
            ("tenant", pulsar.tenant),
            ("namespace", pulsar.namespace),
            ("max_message_bytes", pulsar.max_message_bytes.to_string()),
        ]);
    }
    defaults
}

/// The sink when none is named: Kafka when the binary has it.
pub(super) fn default_sink() -> SinkKind {
    #[cfg(feature = "kafka")]
    return SinkKind::Kafka;
    #[cfg(not(feature = "kafka"))]
    return SinkKind::Stdout;
}

/// `command` with each `run` default of [`run_defaults`] at the end of its flag's help.
pub(super) fn with_defaults(command: clap::Command) -> clap::Command {
    command.mut_subcommand("run", |mut run| {
        for (id, default) in run_defaults() {
            run = run.mut_arg(id, |arg| {
                let help = arg.get_help().map(ToString::to_string).unwrap_or_default();
                arg.help(format!("{help} [default: {default}]"))
            });
        }
        run
    })
}
