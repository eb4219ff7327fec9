//! The values of settings written for people (`100ms`, `7d`, `off`, `KEY=VALUE`), as the flags,
//! the environment and the config file give them.

use clap::ValueEnum;
use serde::{Deserialize, Serialize};
use std::str::FromStr;
use std::time::Duration;

/// A duration written for people: `100ms`, `2s`, `7d`.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub(super) struct Wait(pub Duration);

/// `retention`: a duration, or `off`.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub(super) struct Retention(pub Option<Duration>);

/// `http_addr`: an address, or `off`.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub(super) struct HttpAddr(pub Option<std::net::SocketAddr>);

/// Where the endpoints listen unless told otherwise.
pub(super) const DEFAULT_HTTP_ADDR: &str = "127.0.0.1:9187";

pub(super) fn is_false(value: &bool) -> bool {
    !value
}

pub(super) fn key_value(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((k, v)) if !k.trim().is_empty() => Ok((k.trim().to_owned(), v.to_owned())),
        _ => Err(format!("`{text}` is not KEY=VALUE")),
    }
}

fn duration(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text)
        .map_err(|e| format!("`{text}` is not a duration such as 100ms or 2s: {e}"))
}

impl FromStr for Wait {
    type Err = String;
    fn from_str(text: &str) -> Result<Self, String> {
        duration(text).map(Wait)
    }
}

impl TryFrom<String> for Wait {
    type Error = String;
    fn try_from(text: String) -> Result<Self, String> {
        text.parse()
    }
}

impl From<Wait> for String {
    fn from(Wait(d): Wait) -> String {
        humantime::format_duration(d).to_string()
    }
}

impl FromStr for Retention {
    type Err = String;
    fn from_str(text: &str) -> Result<Self, String> {
        match text {
            "off" | "none" => Ok(Retention(None)),
            _ => duration(text).map(|d| Retention(Some(d))),
        }
    }
}

impl TryFrom<String> for Retention {
    type Error = String;
    fn try_from(text: String) -> Result<Self, String> {
        text.parse()
    }
}

impl From<Retention> for String {
    fn from(Retention(d): Retention) -> String {
        d.map_or("off".into(), |d| humantime::format_duration(d).to_string())
    }
}

impl FromStr for HttpAddr {
    type Err = String;
    fn from_str(text: &str) -> Result<Self, String> {
        match text {
            "off" | "none" => Ok(HttpAddr(None)),
            _ => text
                .parse()
                .map(|a| HttpAddr(Some(a)))
                .map_err(|_| format!("`{text}` is not an address such as 127.0.0.1:9187, or off")),
        }
    }
}

impl TryFrom<String> for HttpAddr {
    type Error = String;
    fn try_from(text: String) -> Result<Self, String> {
        text.parse()
    }
}

impl From<HttpAddr> for String {
    fn from(HttpAddr(a): HttpAddr) -> String {
        a.map_or("off".into(), |a| a.to_string())
    }
}

/// `[sink] options` is a table in the file and repeated `KEY=VALUE` flags on the command line.
pub(super) mod options_table {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};
    use std::collections::BTreeMap;

    pub fn serialize<S: Serializer>(options: &[(String, String)], s: S) -> Result<S::Ok, S::Error> {
        let table: BTreeMap<&str, &str> = options
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        table.serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<(String, String)>, D::Error> {
        Ok(BTreeMap::<String, String>::deserialize(d)?
            .into_iter()
            .collect())
    }
}

/// Where `run` reads events.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub(super) enum SourceKind {
    /// Poll the outbox table.
    #[default]
    Table,
    /// Read the WAL through logical replication (PostgreSQL, wal_level = logical).
    Wal,
}

/// How `run` writes events to the broker.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub(super) enum FormatKind {
    /// The relay's contract: the event's JSON, its id, type and version in headers.
    #[default]
    Outbox,
    /// CloudEvents 1.0 (`--cloudevents-source` names the producer).
    #[value(name = "cloudevents")]
    CloudEvents,
}

/// How a CloudEvent is carried by a message (the default depends on the sink:
/// [`SinkKind::cloudevents_mode`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub(super) enum CloudEventsMode {
    /// Attributes as headers, the payload the event's JSON.
    Binary,
    /// The whole event as the JSON payload.
    Structured,
}

/// How the logs are written: lines for people, or JSON for machines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(super) enum LogFormat {
    Human,
    Json,
}

/// Where `run` publishes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(super) enum SinkKind {
    #[cfg(feature = "kafka")]
    Kafka,
    #[cfg(feature = "pulsar")]
    Pulsar,
    #[cfg(feature = "nats")]
    Nats,
    #[cfg(feature = "rabbitmq")]
    Rabbitmq,
    #[cfg(feature = "webhook")]
    Webhook,
    #[cfg(feature = "sqs")]
    Sqs,
    #[cfg(feature = "sns")]
    Sns,
    Stdout,
}

impl SinkKind {
    /// CloudEvents' mode when `--cloudevents-mode` is not given: structured on SQS and SNS,
    /// which have no protocol binding and carry ten message attributes at most (binary mode's
    /// attributes take nine of them, leaving one for the application's headers); binary elsewhere.
    pub(super) fn cloudevents_mode(self) -> CloudEventsMode {
        match self {
            #[cfg(feature = "sqs")]
            SinkKind::Sqs => CloudEventsMode::Structured,
            #[cfg(feature = "sns")]
            SinkKind::Sns => CloudEventsMode::Structured,
            _ => CloudEventsMode::Binary,
        }
    }
}
