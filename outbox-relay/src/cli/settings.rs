//! The relay's settings: one typed structure, [`Settings`], that is both the config file's schema
//! and, through clap, the flags and environment variables of `run`; and how it becomes the
//! relay's and the sink's configuration. How the layers are read and merged: [`super::layers`].
//! Defaults are [`RelayConfig::new`]'s and the sinks' own.

use super::UsageError;
use super::defaults::default_sink;
use super::output::one_line;
use super::values::{
    CloudEventsMode, DEFAULT_HTTP_ADDR, FormatKind, HttpAddr, LogFormat, Retention, SinkKind,
    SourceKind, Wait, is_false, key_value, options_table,
};
use crate::RelayConfig;
use crate::config::Mode;
use crate::config::Wakeup;
use crate::database::Backend;
use crate::sink::SinkConfig;
use clap::Args;
use seaorm_outbox::{Secret, TableName};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::str::FromStr;
use toml::Table;

/// The database, for the commands that need nothing else (`status`, `migrate`, `failed`).
#[derive(Debug, Default, Args, Serialize)]
pub(super) struct DatabaseArgs {
    /// The database: postgres://… or sqlite:…; a PostgreSQL URL may end in
    /// `?connect_timeout=SECONDS` [default: 5].
    #[arg(long, env = "DATABASE_URL", hide_env_values = true, global = true)]
    pub database_url: Option<Secret>,
    /// A file holding the database URL, such as a mounted secret.
    #[arg(long, env = "DATABASE_URL_FILE", global = true)]
    pub database_url_file: Option<PathBuf>,
    /// The outbox tables, comma-separated [default: outbox]; `schema.table` on PostgreSQL.
    /// `failed` works on one table at a time.
    #[arg(long, env = "OUTBOX_TABLE", global = true)]
    pub table: Option<String>,
    /// Tenant databases, one `name url` per line: `status` and `migrate` work on each tenant's
    /// database instead of --database-url's.
    #[arg(long, env = "OUTBOX_TENANTS", global = true)]
    pub tenants: Option<PathBuf>,
    /// Tenant databases from a query on --database-url (a catalogue) returning each tenant's
    /// name and URL: `status` and `migrate` work on each tenant's database.
    #[arg(long, env = "OUTBOX_TENANTS_QUERY", global = true)]
    pub tenants_query: Option<String>,
}

/// Every setting: the `run` command's flags and the config file's keys.
///
/// ```toml
/// # outbox-relay.toml
/// database_url = "postgres://relay:${DB_PASSWORD}@db/shop?connect_timeout=3"
/// table = "outbox"           # or "outbox, billing_outbox", or "billing.outbox" on PostgreSQL
/// # tenants = "/etc/outbox/tenants"  # tenant databases, one `name url` per line, read again every 5 s
/// # tenants_query = "SELECT name, url FROM tenants"  # or from a catalogue at database_url
/// batch_size = 500
/// max_batch_bytes = 16777216   # payload and header bytes per batch
/// max_payload_bytes = 1000000  # larger rows are parked; match the broker's message.max.bytes
/// poll_interval = "100ms"
/// min_poll_interval = "1ms"  # the wait after a batch that did not fill
/// mode = "mark"              # or "delete"
/// wakeup = "poll"            # or "notify"
/// source = "table"           # or "wal": read the WAL (logical replication) instead of polling
/// wal_slot = "outbox_relay"
/// wal_publication = "outbox_relay"
/// wal_window_bytes = 67108864  # payload bytes read ahead of the broker's confirmations
/// strict = false
/// skip_parked = false
/// topic_template = "outbox.event.{aggregate_type}"
/// format = "outbox"          # or "cloudevents", with cloudevents_source (and cloudevents_mode)
/// cloudevents_source = "//shop.example.com/orders"
/// cloudevents_mode = "binary" # or "structured" (the default on SQS and SNS)
/// lease_refresh = "1s"
/// statement_timeout = "30s"  # the relay's own statements; twice this without an answer: reconnect
/// retention = "7d"           # or "off"
/// prune_interval = "1m"
/// http_addr = "127.0.0.1:9187"   # /metrics, /healthz, /readyz; or "off"
/// log_format = "human"       # or "json"
///
/// [sink]
/// type = "kafka"             # or "pulsar", "nats", "rabbitmq", "webhook", "sqs", "sns", "stdout"
/// brokers = "kafka-1:9093,kafka-2:9093"
/// options = { "security.protocol" = "SASL_SSL", "sasl.mechanism" = "SCRAM-SHA-512",
///             "sasl.username" = "relay", "sasl.password" = "${KAFKA_PASSWORD}" }
/// ```
#[derive(Debug, Default, Args, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Settings {
    /// Log lines for people, or JSON for machines (the `--log-format` flag is global).
    #[arg(skip)]
    pub log_format: Option<LogFormat>,
    /// The database: postgres://… or sqlite:…; a PostgreSQL URL may end in
    /// `?connect_timeout=SECONDS` [default: 5].
    #[arg(
        long,
        env = "DATABASE_URL",
        hide_env_values = true,
        help_heading = "Database"
    )]
    pub database_url: Option<Secret>,
    /// A file holding the database URL, such as a mounted secret.
    #[arg(long, env = "DATABASE_URL_FILE", help_heading = "Database")]
    pub database_url_file: Option<PathBuf>,
    /// The outbox tables to publish, comma-separated [default: outbox]; `schema.table` on
    /// PostgreSQL. One pump per table, all through the one sink.
    #[arg(long, env = "OUTBOX_TABLE", help_heading = "Database")]
    pub table: Option<String>,
    /// Tenant databases: a file of one tenant per line, `name url`, read again every 5 s. The
    /// relay publishes the tables in each tenant's database instead of --database-url's.
    #[arg(long, env = "OUTBOX_TENANTS", help_heading = "Database")]
    pub tenants: Option<PathBuf>,
    /// Tenant databases from a query on --database-url (a catalogue) returning each tenant's
    /// name and URL (`SELECT name, url FROM tenants`), run again every 5 s.
    #[arg(long, env = "OUTBOX_TENANTS_QUERY", help_heading = "Database")]
    pub tenants_query: Option<String>,
    /// Rows per batch.
    #[arg(long, env = "OUTBOX_BATCH_SIZE")]
    pub batch_size: Option<usize>,
    /// Payload and header bytes per batch, bounding the relay's memory.
    #[arg(long, env = "OUTBOX_MAX_BATCH_BYTES")]
    pub max_batch_bytes: Option<usize>,
    /// The largest payload published; larger rows are parked.
    #[arg(long, env = "OUTBOX_MAX_PAYLOAD_BYTES")]
    pub max_payload_bytes: Option<usize>,
    /// Longest idle wait between polls (adaptive: --min-poll-interval after work, doubling while
    /// idle).
    #[arg(long)]
    pub poll_interval: Option<Wait>,
    /// Wait after a batch that did not fill: longer makes fuller batches at a steady rate, and
    /// costs the database less per event, for that much more latency.
    #[arg(long)]
    pub min_poll_interval: Option<Wait>,
    /// Mark published rows, or delete them.
    #[arg(long, value_enum)]
    pub mode: Option<Mode>,
    /// Topic of events with no topic of their own.
    #[arg(long)]
    pub topic_template: Option<String>,
    /// Park events whose type no event type in this binary registers.
    #[arg(long)]
    #[serde(default, skip_serializing_if = "is_false")]
    pub strict: bool,
    /// The messages' format: the relay's contract, or CloudEvents 1.0.
    #[arg(long, value_enum, env = "OUTBOX_FORMAT")]
    pub format: Option<FormatKind>,
    /// CloudEvents' `source` of every event, a URI reference naming the producer
    /// (`//shop.example.com/orders`); required with `--format cloudevents`.
    #[arg(long, env = "OUTBOX_CLOUDEVENTS_SOURCE")]
    pub cloudevents_source: Option<String>,
    /// CloudEvents' attributes in headers (binary), or the whole event as the payload
    /// (structured, the default on SQS and SNS, which have no protocol binding).
    #[arg(long, value_enum)]
    pub cloudevents_mode: Option<CloudEventsMode>,
    /// Poll, or LISTEN/NOTIFY on PostgreSQL.
    #[arg(long, value_enum)]
    pub wakeup: Option<Wakeup>,
    /// Poll the outbox table, or read committed events from PostgreSQL's WAL (logical
    /// replication, one reader per slot, others wait as standbys).
    #[arg(long, value_enum, env = "OUTBOX_SOURCE")]
    pub source: Option<SourceKind>,
    /// The WAL source's replication slot, created if missing.
    #[arg(long, env = "OUTBOX_WAL_SLOT")]
    pub wal_slot: Option<String>,
    /// The WAL source's publication of the outbox table, created if missing.
    #[arg(long, env = "OUTBOX_WAL_PUBLICATION")]
    pub wal_publication: Option<String>,
    /// How many payload bytes the WAL source reads ahead of the broker's confirmations.
    #[arg(long)]
    pub wal_window_bytes: Option<usize>,
    /// How often replicas rebalance their shards.
    #[arg(long)]
    pub lease_refresh: Option<Wait>,
    /// How long one of the relay's statements may run; a database silent for twice as long is
    /// reconnected.
    #[arg(long)]
    pub statement_timeout: Option<Wait>,
    /// Delete published events older than this, such as 7d; `off` keeps them.
    #[arg(long)]
    pub retention: Option<Retention>,
    /// How often to prune.
    #[arg(long)]
    pub prune_interval: Option<Wait>,
    /// Publish an aggregate's later events even while an earlier one is parked (breaks its order).
    #[arg(long)]
    #[serde(default, skip_serializing_if = "is_false")]
    pub skip_parked: bool,
    /// Where to serve /metrics, /healthz and /readyz, or `off`.
    #[arg(long, env = "OUTBOX_HTTP_ADDR")]
    pub http_addr: Option<HttpAddr>,
    /// The sink: the `[sink]` table of the file.
    #[command(flatten)]
    #[serde(default, skip_serializing_if = "SinkSettings::is_empty")]
    pub sink: SinkSettings,
}

/// The `[sink]` table, and the sink flags.
#[derive(Debug, Default, Args, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct SinkSettings {
    /// Where to publish.
    #[arg(long = "sink", value_enum, env = "OUTBOX_SINK", help_heading = "Sink")]
    #[serde(rename = "type")]
    pub kind: Option<SinkKind>,

    /// Kafka bootstrap servers, host:port[,host:port…].
    #[arg(
        long = "kafka-brokers",
        env = "KAFKA_BROKERS",
        help_heading = "Kafka sink"
    )]
    pub brokers: Option<String>,
    /// A librdkafka producer setting, KEY=VALUE (security.protocol, sasl.mechanism, ssl.ca.location,
    /// ...); repeat for more. Secrets: OUTBOX_KAFKA_OPTION_<KEY>[_FILE] instead.
    #[arg(long = "kafka-option", value_name = "KEY=VALUE", value_parser = key_value, help_heading = "Kafka sink")]
    #[serde(default, with = "options_table", skip_serializing_if = "Vec::is_empty")]
    pub options: Vec<(String, String)>,

    /// Pulsar service URL, pulsar://host:port or pulsar+ssl://host:port.
    #[cfg(feature = "pulsar")]
    #[arg(long = "pulsar-url", env = "PULSAR_URL", help_heading = "Pulsar sink")]
    pub url: Option<String>,
    /// Pulsar tenant of the topics.
    #[cfg(feature = "pulsar")]
    #[arg(long = "pulsar-tenant", help_heading = "Pulsar sink")]
    pub tenant: Option<String>,
    /// Pulsar namespace of the topics.
    #[cfg(feature = "pulsar")]
    #[arg(long = "pulsar-namespace", help_heading = "Pulsar sink")]
    pub namespace: Option<String>,
    /// Largest payload sent to Pulsar (5 MiB less room for the envelope); larger events are parked.
    #[cfg(feature = "pulsar")]
    #[arg(long = "pulsar-max-message-bytes", help_heading = "Pulsar sink")]
    pub max_message_bytes: Option<usize>,
    /// Pulsar authentication token (JWT).
    #[cfg(feature = "pulsar")]
    #[arg(
        long = "pulsar-token",
        env = "PULSAR_TOKEN",
        hide_env_values = true,
        help_heading = "Pulsar sink"
    )]
    pub token: Option<Secret>,
    /// A file holding the Pulsar token, such as a mounted secret.
    #[cfg(feature = "pulsar")]
    #[arg(
        long = "pulsar-token-file",
        env = "PULSAR_TOKEN_FILE",
        help_heading = "Pulsar sink"
    )]
    pub token_file: Option<PathBuf>,
    /// PEM file of the certificate authorities trusted for pulsar+ssl:// [default: the system's].
    #[cfg(feature = "pulsar")]
    #[arg(
        long = "pulsar-tls-ca-file",
        env = "PULSAR_TLS_CA_FILE",
        help_heading = "Pulsar sink"
    )]
    pub tls_ca_file: Option<PathBuf>,
    /// Check the broker certificate's host name [default: true].
    #[cfg(feature = "pulsar")]
    #[arg(
        long = "pulsar-tls-hostname-verification",
        value_name = "BOOL",
        help_heading = "Pulsar sink"
    )]
    pub tls_hostname_verification: Option<bool>,
    /// Accept any broker certificate, unverified (tests only) [default: false].
    #[cfg(feature = "pulsar")]
    #[arg(
        long = "pulsar-tls-allow-insecure",
        value_name = "BOOL",
        help_heading = "Pulsar sink"
    )]
    pub tls_allow_insecure: Option<bool>,
    /// OAuth 2.0 issuer URL, for client-credentials authentication.
    #[cfg(feature = "pulsar-oauth2")]
    #[arg(long = "pulsar-oauth2-issuer-url", help_heading = "Pulsar sink")]
    pub oauth2_issuer_url: Option<String>,
    /// OAuth 2.0 key file as a file:// or data: URL (it holds client_id and client_secret).
    #[cfg(feature = "pulsar-oauth2")]
    #[arg(
        long = "pulsar-oauth2-credentials-url",
        env = "PULSAR_OAUTH2_CREDENTIALS_URL",
        hide_env_values = true,
        help_heading = "Pulsar sink"
    )]
    pub oauth2_credentials_url: Option<Secret>,
    /// A file holding the OAuth 2.0 credentials URL.
    #[cfg(feature = "pulsar-oauth2")]
    #[arg(
        long = "pulsar-oauth2-credentials-url-file",
        help_heading = "Pulsar sink"
    )]
    pub oauth2_credentials_url_file: Option<PathBuf>,
    /// OAuth 2.0 audience.
    #[cfg(feature = "pulsar-oauth2")]
    #[arg(long = "pulsar-oauth2-audience", help_heading = "Pulsar sink")]
    pub oauth2_audience: Option<String>,
    /// OAuth 2.0 scope.
    #[cfg(feature = "pulsar-oauth2")]
    #[arg(long = "pulsar-oauth2-scope", help_heading = "Pulsar sink")]
    pub oauth2_scope: Option<String>,

    /// NATS servers, nats://host:port or tls://host:port, comma-separated; a user:password@ in
    /// the URL logs in as that user.
    #[cfg(feature = "nats")]
    #[arg(
        long = "nats-url",
        env = "NATS_URL",
        hide_env_values = true,
        help_heading = "NATS sink"
    )]
    pub nats_url: Option<Secret>,
    /// NATS authentication token.
    #[cfg(feature = "nats")]
    #[arg(
        long = "nats-token",
        env = "NATS_TOKEN",
        hide_env_values = true,
        help_heading = "NATS sink"
    )]
    pub nats_token: Option<Secret>,
    /// A file holding the NATS token, such as a mounted secret.
    #[cfg(feature = "nats")]
    #[arg(
        long = "nats-token-file",
        env = "NATS_TOKEN_FILE",
        help_heading = "NATS sink"
    )]
    pub nats_token_file: Option<PathBuf>,
    /// A NATS credentials file (a user JWT and its NKey seed, as `nsc` writes them).
    #[cfg(feature = "nats")]
    #[arg(
        long = "nats-credentials-file",
        env = "NATS_CREDENTIALS_FILE",
        help_heading = "NATS sink"
    )]
    pub nats_credentials_file: Option<PathBuf>,
    /// An NKey seed: only from a file (`--nats-nkey-seed-file`) or the config file.
    #[cfg(feature = "nats")]
    #[arg(skip)]
    pub nats_nkey_seed: Option<Secret>,
    /// A file holding the NKey seed to log in with.
    #[cfg(feature = "nats")]
    #[arg(
        long = "nats-nkey-seed-file",
        env = "NATS_NKEY_SEED_FILE",
        help_heading = "NATS sink"
    )]
    pub nats_nkey_seed_file: Option<PathBuf>,
    /// PEM file of the certificate authorities trusted for the server [default: the system's].
    #[cfg(feature = "nats")]
    #[arg(
        long = "nats-tls-ca-file",
        env = "NATS_TLS_CA_FILE",
        help_heading = "NATS sink"
    )]
    pub nats_tls_ca_file: Option<PathBuf>,
    /// A client certificate (PEM), for servers that verify clients; with `--nats-tls-client-key`.
    #[cfg(feature = "nats")]
    #[arg(long = "nats-tls-client-cert", help_heading = "NATS sink")]
    pub nats_tls_client_cert: Option<PathBuf>,
    /// The client certificate's key (PEM).
    #[cfg(feature = "nats")]
    #[arg(long = "nats-tls-client-key", help_heading = "NATS sink")]
    pub nats_tls_client_key: Option<PathBuf>,

    /// The RabbitMQ broker, amqp://user:password@host:5672/%2f or amqps://… (the vhost
    /// URL-encoded).
    #[cfg(feature = "rabbitmq")]
    #[arg(
        long = "rabbitmq-url",
        env = "RABBITMQ_URL",
        hide_env_values = true,
        help_heading = "RabbitMQ sink"
    )]
    pub rabbitmq_url: Option<Secret>,
    /// A file holding the RabbitMQ URL (with its password), such as a mounted secret.
    #[cfg(feature = "rabbitmq")]
    #[arg(
        long = "rabbitmq-url-file",
        env = "RABBITMQ_URL_FILE",
        help_heading = "RabbitMQ sink"
    )]
    pub rabbitmq_url_file: Option<PathBuf>,
    /// The exchange events are published to, the topic as the routing key; it must exist
    /// [default: the default exchange, which routes to the queue named by the topic].
    #[cfg(feature = "rabbitmq")]
    #[arg(long = "rabbitmq-exchange", help_heading = "RabbitMQ sink")]
    pub rabbitmq_exchange: Option<String>,
    /// PEM file of the certificate authorities trusted for the broker's certificate (amqps).
    #[cfg(feature = "rabbitmq")]
    #[arg(long = "rabbitmq-tls-ca-file", help_heading = "RabbitMQ sink")]
    pub rabbitmq_tls_ca_file: Option<PathBuf>,

    /// Where each event is POSTed, `{topic}` replaced by its topic
    /// (`https://hooks.example.com/events/{topic}`).
    #[cfg(feature = "webhook")]
    #[arg(
        long = "webhook-url",
        env = "WEBHOOK_URL",
        hide_env_values = true,
        help_heading = "Webhook sink"
    )]
    pub webhook_url: Option<Secret>,
    /// A file holding the webhook URL template, such as a mounted secret.
    #[cfg(feature = "webhook")]
    #[arg(
        long = "webhook-url-file",
        env = "WEBHOOK_URL_FILE",
        help_heading = "Webhook sink"
    )]
    pub webhook_url_file: Option<PathBuf>,
    /// The Standard Webhooks signing secret (`whsec_` and base64).
    #[cfg(feature = "webhook")]
    #[arg(
        long = "webhook-secret",
        env = "WEBHOOK_SECRET",
        hide_env_values = true,
        help_heading = "Webhook sink"
    )]
    pub webhook_secret: Option<Secret>,
    /// A file holding the webhook signing secret, such as a mounted secret.
    #[cfg(feature = "webhook")]
    #[arg(
        long = "webhook-secret-file",
        env = "WEBHOOK_SECRET_FILE",
        help_heading = "Webhook sink"
    )]
    pub webhook_secret_file: Option<PathBuf>,
    /// How long one request may take [default: 10s].
    #[cfg(feature = "webhook")]
    #[arg(long = "webhook-timeout", help_heading = "Webhook sink")]
    pub webhook_timeout: Option<Wait>,
    /// PEM file of the certificate authorities trusted for the receiver's certificate (https).
    #[cfg(feature = "webhook")]
    #[arg(long = "webhook-tls-ca-file", help_heading = "Webhook sink")]
    pub webhook_tls_ca_file: Option<PathBuf>,

    /// The AWS region of the SQS queues or SNS topics [default: the AWS chain's, as AWS_REGION].
    /// Credentials always come from the standard AWS chain.
    #[cfg(any(feature = "sqs", feature = "sns"))]
    #[arg(long = "aws-region", help_heading = "SQS and SNS sinks")]
    pub aws_region: Option<String>,
    /// Another endpoint than AWS's, such as a local SQS-compatible server [default: the AWS
    /// chain's, as AWS_ENDPOINT_URL].
    #[cfg(any(feature = "sqs", feature = "sns"))]
    #[arg(long = "aws-endpoint-url", help_heading = "SQS and SNS sinks")]
    pub aws_endpoint_url: Option<String>,
    /// The largest message, body and attributes, in bytes: a larger event is parked
    /// [default: 262144].
    #[cfg(any(feature = "sqs", feature = "sns"))]
    #[arg(long = "aws-max-message-bytes", help_heading = "SQS and SNS sinks")]
    pub aws_max_message_bytes: Option<usize>,
    /// How long one attempt of a call to SQS or SNS may take; the SDK makes three, then the relay
    /// retries the batch [default: 30s].
    #[cfg(any(feature = "sqs", feature = "sns"))]
    #[arg(long = "aws-timeout", help_heading = "SQS and SNS sinks")]
    pub aws_timeout: Option<Wait>,
    /// Put before a topic that is not an ARN to make its SNS topic ARN
    /// (`arn:aws:sns:eu-west-1:123456789012:`).
    #[cfg(feature = "sns")]
    #[arg(long = "sns-topic-arn-prefix", help_heading = "SQS and SNS sinks")]
    pub sns_topic_arn_prefix: Option<String>,
}

#[cfg(any(feature = "sqs", feature = "sns"))]
impl SinkSettings {
    /// The SQS and SNS sinks' AWS settings.
    fn aws_settings(&self) -> crate::sink::aws::AwsSettings {
        let defaults = crate::sink::aws::AwsSettings::default();
        crate::sink::aws::AwsSettings {
            region: self.aws_region.clone(),
            endpoint_url: self.aws_endpoint_url.clone(),
            max_message_bytes: self
                .aws_max_message_bytes
                .unwrap_or(defaults.max_message_bytes),
            attempt_timeout: self
                .aws_timeout
                .map_or(defaults.attempt_timeout, |Wait(d)| d),
            ..defaults
        }
    }
}

impl Settings {
    /// The outbox tables: `--table`'s list, each name checked against the database's backend,
    /// none twice.
    pub(super) fn tables(&self) -> Result<Vec<TableName>, UsageError> {
        let Some(names) = &self.table else {
            return Ok(vec![TableName::DEFAULT]);
        };
        let mut tables: Vec<TableName> = Vec::new();
        for name in names.split(',').map(str::trim) {
            let table =
                TableName::new(name.to_owned()).map_err(|e| UsageError(format!("--table: {e}")))?;
            if table.schema().is_some() && Backend::of(&self.database_url()?) != Backend::Postgres {
                return Err(UsageError(format!(
                    "--table {table}: a schema-qualified table needs PostgreSQL (on MySQL, a \
                     schema is a database: name it in the URL)"
                )));
            }
            if tables.contains(&table) {
                return Err(UsageError(format!("--table lists {table} twice")));
            }
            tables.push(table);
        }
        Ok(tables)
    }

    /// Where the tenants are listed: `--tenants` or `--tenants-query`, not both.
    fn tenants(&self) -> Result<crate::Tenants, UsageError> {
        match (&self.tenants, &self.tenants_query) {
            (Some(_), Some(_)) => Err(UsageError(
                "--tenants and --tenants-query both list tenants: pass one".into(),
            )),
            (Some(path), None) => Ok(crate::Tenants::File(path.clone())),
            (None, Some(query)) => Ok(crate::Tenants::Query(query.clone())),
            (None, None) => Ok(crate::Tenants::None),
        }
    }

    /// The outbox tables a command works on: `--table`'s in each tenant's database with
    /// `--tenants` or `--tenants-query`, else in `--database-url`'s.
    pub(super) async fn outboxes(&self) -> Result<Vec<crate::tenants::Outbox>, UsageError> {
        let tenants = self.tenants()?;
        let catalogue = match tenants {
            crate::Tenants::File(_) => String::new(),
            _ => self.database_url()?,
        };
        let listed = tenants.read(&catalogue).await.map_err(UsageError)?;
        Ok(crate::tenants::Outbox::all(
            &catalogue,
            &self.tables()?,
            listed.as_deref(),
        ))
    }

    /// The one database a command works on (`failed`, `wal`): `--database-url`'s; refused with
    /// `--tenants`, so a tenant's command never runs on another database.
    pub(super) fn one_database(&self) -> Result<String, UsageError> {
        if self.tenants.is_some() || self.tenants_query.is_some() {
            return Err(UsageError(
                "this command works on one database: pass the tenant's --database-url, not \
                 --tenants or --tenants-query"
                    .into(),
            ));
        }
        self.database_url()
    }

    /// The one outbox table a command works on (`failed`).
    pub(super) fn table(&self) -> Result<TableName, UsageError> {
        match <[TableName; 1]>::try_from(self.tables()?) {
            Ok([table]) => Ok(table),
            Err(tables) => Err(UsageError(format!(
                "this command works on one table at a time; --table lists {}",
                crate::source::list(&tables)
            ))),
        }
    }

    /// The database URL, checked.
    pub(super) fn database_url(&self) -> Result<String, UsageError> {
        let url = self
            .database_url
            .as_ref()
            .map(Secret::expose)
            .ok_or_else(|| {
                UsageError(
                    "no database: pass --database-url or --database-url-file, set DATABASE_URL or \
                 DATABASE_URL_FILE, or set database_url in --config"
                        .into(),
                )
            })?;
        let valid = match Backend::parse(url) {
            Some(Backend::Postgres) => {
                check_postgres_parameters(url)?;
                let (url, _) = crate::database::connect_timeout(url);
                sqlx::postgres::PgConnectOptions::from_str(&url).map(drop)
            }
            Some(Backend::Sqlite) => sqlx::sqlite::SqliteConnectOptions::from_str(url).map(drop),
            Some(Backend::MySql) => sqlx::mysql::MySqlConnectOptions::from_str(url).map(drop),
            None => {
                return Err(UsageError(format!(
                    "database URL {} must start with postgres://, postgresql://, sqlite: or mysql://",
                    crate::redact_url(url)
                )));
            }
        };
        valid.map_err(|e| {
            UsageError(format!(
                "bad database URL {}: {}",
                crate::redact_url(url),
                one_line(&e.to_string())
            ))
        })?;
        Ok(url.to_owned())
    }

    /// The topic template, or the default.
    pub(super) fn topic_template(&self) -> String {
        self.topic_template
            .clone()
            .unwrap_or_else(|| crate::DEFAULT_TOPIC_TEMPLATE.into())
    }

    /// Where to serve the endpoints, if anywhere.
    pub(super) fn http_addr(&self) -> Option<std::net::SocketAddr> {
        self.http_addr
            .unwrap_or_else(|| DEFAULT_HTTP_ADDR.parse().expect("the default address"))
            .0
    }

    /// The CloudEvents format, if `--format cloudevents`.
    fn cloudevents(&self) -> Result<Option<crate::cloudevents::CloudEvents>, UsageError> {
        use crate::cloudevents::{CloudEvents, Mode};
        match self.format.unwrap_or_default() {
            FormatKind::Outbox
                if self.cloudevents_source.is_some() || self.cloudevents_mode.is_some() =>
            {
                Err(UsageError(
                    "--cloudevents-source and --cloudevents-mode need --format cloudevents".into(),
                ))
            }
            FormatKind::Outbox => Ok(None),
            FormatKind::CloudEvents => {
                let source = self
                    .cloudevents_source
                    .as_deref()
                    .filter(|s| !s.trim().is_empty())
                    .ok_or_else(|| {
                        UsageError(
                            "--format cloudevents needs --cloudevents-source, a URI reference \
                             naming the producer (such as //shop.example.com/orders)"
                                .into(),
                        )
                    })?;
                let sink = self.sink.kind.unwrap_or_else(default_sink);
                let mode = match self.cloudevents_mode.unwrap_or(sink.cloudevents_mode()) {
                    CloudEventsMode::Binary => Mode::Binary,
                    CloudEventsMode::Structured => Mode::Structured,
                };
                Ok(Some(CloudEvents::new(source, mode)))
            }
        }
    }

    /// The relay's configuration.
    pub(super) fn relay_config(&self) -> Result<RelayConfig, UsageError> {
        let mut config = RelayConfig::new(self.database_url()?);
        config.tables = self.tables()?;
        config.tenants = self.tenants()?;
        if let crate::Tenants::File(path) = &config.tenants {
            crate::Tenants::read_file(path).map_err(UsageError)?;
        }
        if config.tenants != crate::Tenants::None && self.source == Some(SourceKind::Wal) {
            return Err(UsageError(
                "--source wal reads one database; publish tenant databases by polling".into(),
            ));
        }
        if let Some(n) = self.batch_size {
            if n == 0 {
                return Err(UsageError("batch size must be at least 1".into()));
            }
            config.batch_size = n;
        }
        if let Some(n) = self.max_batch_bytes {
            config.max_batch_bytes = n;
        }
        if let Some(n) = self.max_payload_bytes {
            config.max_payload_bytes = n;
        }
        if let Some(Wait(d)) = self.poll_interval {
            config.poll_interval = d;
        }
        if let Some(Wait(d)) = self.min_poll_interval {
            if d.is_zero() {
                return Err(UsageError("min poll interval must be above zero".into()));
            }
            config.min_poll_interval = d;
        }
        if let Some(Wait(d)) = self.lease_refresh {
            config.lease_refresh = d;
        }
        if let Some(Wait(d)) = self.statement_timeout {
            if d < std::time::Duration::from_millis(1) {
                return Err(UsageError("statement timeout must be at least 1ms".into()));
            }
            config.statement_timeout = d;
        }
        if let Some(Retention(r)) = self.retention {
            config.retention = r;
        }
        if let Some(Wait(d)) = self.prune_interval {
            config.prune_interval = d;
        }
        config.skip_parked = self.skip_parked;
        config.mode = self.mode.unwrap_or_default();
        config.wakeup = self.wakeup.unwrap_or_default();
        config.strict = self.strict;
        config.topic_template = self.topic_template();
        config.cloudevents = self.cloudevents()?;
        config.source = match self.source.unwrap_or_default() {
            SourceKind::Table => {
                if self.wal_slot.is_some()
                    || self.wal_publication.is_some()
                    || self.wal_window_bytes.is_some()
                {
                    return Err(UsageError(
                        "--wal-slot, --wal-publication and --wal-window-bytes need --source wal"
                            .into(),
                    ));
                }
                crate::Source::Table
            }
            SourceKind::Wal => {
                if !matches!(&config.tables[..], [table] if table.is_default()) {
                    return Err(UsageError(format!(
                        "--source wal reads the table outbox only; poll {} (--source table)",
                        crate::source::list(&config.tables)
                    )));
                }
                let default = crate::source::wal::WalSource::default();
                let mut source = crate::source::wal::WalSource::new(
                    self.wal_slot.clone().unwrap_or(default.slot),
                    self.wal_publication.clone().unwrap_or(default.publication),
                )
                .map_err(UsageError)?;
                if let Some(bytes) = self.wal_window_bytes {
                    if bytes == 0 {
                        return Err(UsageError("WAL window must be at least 1 byte".into()));
                    }
                    source.window_bytes = bytes;
                }
                if Backend::of(&config.database_url) != Backend::Postgres {
                    return Err(UsageError("--source wal needs PostgreSQL".into()));
                }
                crate::Source::Wal(source)
            }
        };
        if config.wakeup == Wakeup::Notify && Backend::of(&config.database_url) != Backend::Postgres
        {
            return Err(UsageError("--wakeup notify needs PostgreSQL".into()));
        }
        Ok(config)
    }

    /// The sink's configuration.
    pub(super) fn sink_config(&self) -> Result<SinkConfig, UsageError> {
        let sink = &self.sink;
        match sink.kind.unwrap_or_else(default_sink) {
            SinkKind::Stdout => Ok(SinkConfig::Stdout),
            #[cfg(feature = "kafka")]
            SinkKind::Kafka => {
                let brokers = sink.brokers.clone().unwrap_or_default();
                if brokers.trim().is_empty() {
                    return Err(UsageError(
                        "the kafka sink needs brokers: --kafka-brokers, KAFKA_BROKERS or `brokers` in [sink]".into(),
                    ));
                }
                let mut kafka = crate::sink::kafka::KafkaConfig::new(brokers);
                kafka.options.extend(sink.options.iter().cloned());
                Ok(SinkConfig::Kafka(kafka))
            }
            #[cfg(feature = "pulsar")]
            SinkKind::Pulsar => {
                use seaorm_outbox::pulsar_client::PulsarAuth;
                let url = sink.url.clone().unwrap_or_default();
                if url.trim().is_empty() {
                    return Err(UsageError(
                        "the pulsar sink needs a service URL: --pulsar-url, PULSAR_URL or `url` in [sink]".into(),
                    ));
                }
                let mut pulsar = crate::sink::pulsar::PulsarConfig::new(url);
                if let Some(tenant) = &sink.tenant {
                    pulsar.tenant = tenant.clone();
                }
                if let Some(namespace) = &sink.namespace {
                    pulsar.namespace = namespace.clone();
                }
                if let Some(bytes) = sink.max_message_bytes {
                    pulsar.max_message_bytes = bytes;
                }
                let connection = &mut pulsar.connection;
                connection.auth = sink.token.clone().map(PulsarAuth::Token);
                #[cfg(feature = "pulsar-oauth2")]
                if let Some(issuer_url) = &sink.oauth2_issuer_url {
                    if connection.auth.is_some() {
                        return Err(UsageError(
                            "pulsar: set a token or OAuth 2.0, not both".into(),
                        ));
                    }
                    connection.auth = Some(PulsarAuth::OAuth2 {
                        issuer_url: issuer_url.clone(),
                        credentials_url: sink.oauth2_credentials_url.clone().ok_or_else(|| {
                            UsageError("pulsar: OAuth 2.0 needs a credentials URL".into())
                        })?,
                        audience: sink.oauth2_audience.clone(),
                        scope: sink.oauth2_scope.clone(),
                    });
                }
                connection.tls_ca_file = sink.tls_ca_file.clone();
                if let Some(verify) = sink.tls_hostname_verification {
                    connection.tls_hostname_verification = verify;
                }
                if let Some(insecure) = sink.tls_allow_insecure {
                    connection.tls_allow_insecure = insecure;
                }
                Ok(SinkConfig::Pulsar(pulsar))
            }
            #[cfg(feature = "nats")]
            SinkKind::Nats => {
                let url = sink
                    .nats_url
                    .as_ref()
                    .map(Secret::expose)
                    .unwrap_or_default();
                if url.trim().is_empty() {
                    return Err(UsageError(
                        "the nats sink needs a server URL: --nats-url, NATS_URL or `nats_url` in [sink]".into(),
                    ));
                }
                let mut nats = crate::sink::nats::NatsConfig::new(url);
                nats.token = sink.nats_token.clone();
                nats.nkey_seed = sink.nats_nkey_seed.clone();
                nats.credentials_file = sink.nats_credentials_file.clone();
                nats.tls_ca_file = sink.nats_tls_ca_file.clone();
                nats.tls_client_cert = match (&sink.nats_tls_client_cert, &sink.nats_tls_client_key)
                {
                    (Some(cert), Some(key)) => Some((cert.clone(), key.clone())),
                    (None, None) => None,
                    _ => {
                        return Err(UsageError(
                            "nats: --nats-tls-client-cert and --nats-tls-client-key go together"
                                .into(),
                        ));
                    }
                };
                Ok(SinkConfig::Nats(nats))
            }
            #[cfg(feature = "rabbitmq")]
            SinkKind::Rabbitmq => {
                let url = sink
                    .rabbitmq_url
                    .as_ref()
                    .map(Secret::expose)
                    .unwrap_or_default();
                if url.trim().is_empty() {
                    return Err(UsageError(
                        "the rabbitmq sink needs a broker URL: --rabbitmq-url, RABBITMQ_URL or `rabbitmq_url` in [sink]".into(),
                    ));
                }
                let mut rabbitmq = crate::sink::rabbitmq::RabbitMqConfig::new(url);
                rabbitmq.exchange = sink.rabbitmq_exchange.clone().unwrap_or_default();
                rabbitmq.tls_ca_file = sink.rabbitmq_tls_ca_file.clone();
                Ok(SinkConfig::RabbitMq(rabbitmq))
            }
            #[cfg(feature = "webhook")]
            SinkKind::Webhook => {
                let url = sink
                    .webhook_url
                    .as_ref()
                    .map(Secret::expose)
                    .unwrap_or_default();
                if url.trim().is_empty() {
                    return Err(UsageError(
                        "the webhook sink needs a URL: --webhook-url, WEBHOOK_URL or `webhook_url` in [sink]".into(),
                    ));
                }
                let secret = sink.webhook_secret.clone().ok_or_else(|| {
                    UsageError(
                        "the webhook sink needs a signing secret: --webhook-secret-file, WEBHOOK_SECRET or `webhook_secret` in [sink]".into(),
                    )
                })?;
                let mut webhook = crate::sink::webhook::WebhookConfig::new(url, secret);
                if let Some(Wait(d)) = sink.webhook_timeout {
                    webhook.timeout = d;
                }
                webhook.tls_ca_file = sink.webhook_tls_ca_file.clone();
                Ok(SinkConfig::Webhook(webhook))
            }
            #[cfg(feature = "sqs")]
            SinkKind::Sqs => Ok(SinkConfig::Sqs(crate::sink::sqs::SqsConfig {
                aws: sink.aws_settings(),
            })),
            #[cfg(feature = "sns")]
            SinkKind::Sns => Ok(SinkConfig::Sns(crate::sink::sns::SnsConfig {
                aws: sink.aws_settings(),
                topic_arn_prefix: sink.sns_topic_arn_prefix.clone(),
            })),
        }
    }
}

/// The query parameters of a PostgreSQL URL that the driver (sqlx) reads, and `connect_timeout`,
/// which the relay reads. sqlx logs any other parameter *with its value* and ignores it, so one such
/// as libpq's `sslpassword` would both leak and do nothing: it is refused here, by name.
fn check_postgres_parameters(url: &str) -> Result<(), UsageError> {
    const KNOWN: [&str; 19] = [
        "sslmode",
        "ssl-mode",
        "sslrootcert",
        "ssl-root-cert",
        "ssl-ca",
        "sslcert",
        "ssl-cert",
        "sslkey",
        "ssl-key",
        "statement-cache-capacity",
        "host",
        "hostaddr",
        "port",
        "dbname",
        "user",
        "password",
        "application_name",
        "options",
        "connect_timeout",
    ];
    let query = url.split_once('?').map_or("", |(_, query)| query);
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let key = pair.split_once('=').map_or(pair, |(key, _)| key);
        if !KNOWN.contains(&key) && !key.starts_with("options[") {
            return Err(UsageError(format!(
                "the database URL parameter `{key}` is not supported (known: {})",
                KNOWN.join(", ")
            )));
        }
    }
    Ok(())
}

impl SinkSettings {
    fn is_empty(&self) -> bool {
        Table::try_from(self).map_or(true, |t| t.is_empty())
    }
}
