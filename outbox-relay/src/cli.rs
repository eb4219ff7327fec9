//! The `outbox-relay` command line: `run`, `migrate`, `routes`, `status`.
//!
//! Settings come from flags, then environment variables, then the TOML file named by `--config`,
//! then defaults. A bad flag, URL or file prints one line on stderr and exits with code 2, having
//! done nothing.
//!
//! ```toml
//! # outbox-relay.toml
//! database_url = "postgres://relay@db/shop"
//! batch_size = 500
//! poll_interval = "100ms"
//! mode = "mark"              # or "delete"
//! wakeup = "poll"            # or "notify"
//! strict = false
//! topic_template = "outbox.event.{aggregate_type}"
//! retention = "7d"           # or "off"
//! http_addr = "127.0.0.1:9187"   # /metrics, /healthz, /readyz; or "off"
//!
//! [sink]
//! type = "kafka"             # or "stdout"
//! brokers = "127.0.0.1:9092"
//! options = { "linger.ms" = "1" }
//! ```

use crate::config::{RelayConfig, redact_url};
use crate::endpoints;
use crate::failed::{self, Selection};
use crate::outbox_table::Mode;
use crate::routing::Router;
use crate::sink::SinkConfig;
#[cfg(feature = "kafka")]
use crate::sink::kafka::KafkaConfig;
#[cfg(feature = "pulsar")]
use crate::sink::pulsar::PulsarConfig;
use crate::wakeup::{NOTIFY_TRIGGER_SQL, Wakeup};
use crate::{Relay, status};
use clap::{Args, Parser, Subcommand, ValueEnum};
use serde::Deserialize;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

#[derive(Debug, Parser)]
#[command(
    name = "outbox-relay",
    version,
    about = "Publishes outbox events to a broker, in order per aggregate."
)]
struct Cli {
    /// TOML configuration file; flags and environment variables take precedence over it.
    #[arg(long, env = "OUTBOX_CONFIG", global = true)]
    config: Option<PathBuf>,
    /// The database: postgres://… or sqlite:…
    #[arg(long, env = "DATABASE_URL", global = true, hide_env_values = true)]
    database_url: Option<String>,
    /// Log lines for people, or JSON for machines (to stderr).
    #[arg(long, value_enum, env = "OUTBOX_LOG_FORMAT", global = true)]
    log_format: Option<LogFormat>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Publish events until SIGINT or SIGTERM.
    Run(RunArgs),
    /// Create or upgrade the outbox tables.
    Migrate {
        /// Also install the trigger behind `--wakeup notify` (PostgreSQL).
        #[arg(long)]
        notify_trigger: bool,
    },
    /// List the event types linked into this binary, with their topics.
    Routes {
        /// The topic template for events without a topic of their own.
        #[arg(long)]
        topic_template: Option<String>,
    },
    /// Show the backlog and the age of the oldest unpublished event.
    Status,
    /// Parked events: list them, retry them, or skip them.
    #[command(subcommand)]
    Failed(FailedCommand),
}

#[derive(Debug, Subcommand)]
enum FailedCommand {
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
struct Select {
    /// Every parked event.
    #[arg(long)]
    all: bool,
    /// An event id; repeat for more.
    #[arg(long = "id", value_name = "UUID")]
    ids: Vec<outbox_core::Uuid>,
    /// The parked events of one aggregate, as TYPE:ID.
    #[arg(long, value_name = "TYPE:ID", value_parser = aggregate)]
    aggregate: Option<(String, String)>,
}

impl Select {
    fn selection(self) -> Selection {
        match (self.all, self.aggregate) {
            (true, _) => Selection::All,
            (false, Some((aggregate_type, aggregate_id))) => Selection::Aggregate {
                aggregate_type,
                aggregate_id,
            },
            (false, None) => Selection::Ids(self.ids.iter().map(ToString::to_string).collect()),
        }
    }
}

#[derive(Debug, Args)]
struct RunArgs {
    /// Where to publish [default: kafka].
    #[arg(long, value_enum, env = "OUTBOX_SINK")]
    sink: Option<SinkKind>,
    /// Kafka bootstrap servers, host:port[,host:port…].
    #[arg(long, env = "KAFKA_BROKERS")]
    kafka_brokers: Option<String>,
    /// A librdkafka producer setting, KEY=VALUE; repeat for more.
    #[arg(long = "kafka-option", value_name = "KEY=VALUE", value_parser = key_value)]
    kafka_options: Vec<(String, String)>,
    /// Pulsar service URL, pulsar://host:port.
    #[cfg(feature = "pulsar")]
    #[arg(long, env = "PULSAR_URL")]
    pulsar_url: Option<String>,
    /// Pulsar tenant of the topics [default: public].
    #[cfg(feature = "pulsar")]
    #[arg(long)]
    pulsar_tenant: Option<String>,
    /// Pulsar namespace of the topics [default: default].
    #[cfg(feature = "pulsar")]
    #[arg(long)]
    pulsar_namespace: Option<String>,
    /// Rows per batch [default: 500].
    #[arg(long, env = "OUTBOX_BATCH_SIZE")]
    batch_size: Option<usize>,
    /// Longest idle wait between polls (adaptive: 1ms after work, doubling while idle) [default: 100ms].
    #[arg(long, value_parser = duration)]
    poll_interval: Option<Duration>,
    /// Mark published rows, or delete them [default: mark].
    #[arg(long, value_enum)]
    mode: Option<Mode>,
    /// Topic of events with no topic of their own [default: outbox.event.{aggregate_type}].
    #[arg(long)]
    topic_template: Option<String>,
    /// Park events whose type no event type in this binary registers.
    #[arg(long)]
    strict: bool,
    /// Poll, or LISTEN/NOTIFY on PostgreSQL [default: poll].
    #[arg(long, value_enum)]
    wakeup: Option<Wakeup>,
    /// How often replicas rebalance their shards [default: 1s].
    #[arg(long, value_parser = duration)]
    lease_refresh: Option<Duration>,
    /// Delete published events older than this, such as 7d; `off` keeps them [default: 7d].
    #[arg(long, value_parser = retention)]
    retention: Option<Retention>,
    /// How often to prune [default: 1m].
    #[arg(long, value_parser = duration)]
    prune_interval: Option<Duration>,
    /// Publish an aggregate's later events even while an earlier one is parked (breaks its order).
    #[arg(long)]
    skip_parked: bool,
    /// Where to serve /metrics, /healthz and /readyz, or `off` [default: 127.0.0.1:9187].
    #[arg(long, env = "OUTBOX_HTTP_ADDR", value_parser = http_addr)]
    http_addr: Option<HttpAddr>,
}

/// `--http-addr`: an address, or `off`.
#[derive(Debug, Clone, Copy)]
struct HttpAddr(Option<std::net::SocketAddr>);

const DEFAULT_HTTP_ADDR: &str = "127.0.0.1:9187";

/// `--retention`: a duration, or `off`.
#[derive(Debug, Clone, Copy)]
struct Retention(Option<Duration>);

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Deserialize)]
#[serde(rename_all = "lowercase")]
enum SinkKind {
    #[cfg(feature = "kafka")]
    Kafka,
    #[cfg(feature = "pulsar")]
    Pulsar,
    Stdout,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Deserialize)]
#[serde(rename_all = "lowercase")]
enum LogFormat {
    Human,
    Json,
}

/// The `--config` file. Every key is optional; unknown keys are errors.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    database_url: Option<String>,
    log_format: Option<LogFormat>,
    batch_size: Option<usize>,
    poll_interval: Option<String>,
    mode: Option<Mode>,
    topic_template: Option<String>,
    strict: Option<bool>,
    wakeup: Option<Wakeup>,
    lease_refresh: Option<String>,
    retention: Option<String>,
    prune_interval: Option<String>,
    skip_parked: Option<bool>,
    http_addr: Option<String>,
    sink: Option<SinkConfig>,
}

/// A problem with the user's input: reported in one line, exit code 2.
struct UsageError(String);

/// The entry point of `outbox-relay`, and of your own relay binary:
///
/// ```no_run
/// // use my_events as _;   // links your event types' registrations
/// fn main() -> std::process::ExitCode {
///     outbox_relay::cli::main()
/// }
/// ```
pub fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) if !e.use_stderr() => {
            // --help and --version
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
        Err(e) => return usage_error(&first_line(&e.render().to_string())),
    };
    let file = match cli.config.as_deref().map(read_config).transpose() {
        Ok(file) => file.unwrap_or_default(),
        Err(UsageError(message)) => return usage_error(&message),
    };
    init_logging(
        cli.log_format
            .or(file.log_format)
            .unwrap_or(LogFormat::Human),
    );

    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("outbox-relay: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async move {
        match execute(cli, file).await {
            Ok(code) => code,
            Err(UsageError(message)) => usage_error(&message),
        }
    })
}

async fn execute(cli: Cli, file: FileConfig) -> Result<ExitCode, UsageError> {
    match cli.command {
        Command::Routes { topic_template } => {
            let template = topic_template
                .or(file.topic_template)
                .unwrap_or_else(|| crate::DEFAULT_TOPIC_TEMPLATE.into());
            print_routes(&template);
            Ok(ExitCode::SUCCESS)
        }
        Command::Status => {
            let url = database_url(cli.database_url, file.database_url)?;
            match status::status(&url).await {
                Ok(status) => {
                    println!("{status}");
                    Ok(ExitCode::SUCCESS)
                }
                Err(e) => Ok(failure(&format!("status of {}: {e}", redact_url(&url)))),
            }
        }
        Command::Migrate { notify_trigger } => {
            let url = database_url(cli.database_url, file.database_url)?;
            if notify_trigger && url.starts_with("sqlite:") {
                return Err(UsageError("--notify-trigger needs PostgreSQL".into()));
            }
            Ok(match migrate(&url, notify_trigger).await {
                Ok(()) => {
                    println!("outbox schema is up to date on {}", redact_url(&url));
                    ExitCode::SUCCESS
                }
                Err(e) => failure(&format!("migrate {}: {e}", redact_url(&url))),
            })
        }
        Command::Failed(command) => {
            let url = database_url(cli.database_url, file.database_url)?;
            Ok(run_failed(command, &url).await)
        }
        Command::Run(args) => {
            let url = database_url(cli.database_url, file.database_url.clone())?;
            let file_http_addr = file.http_addr.clone();
            let http_addr = match args.http_addr {
                Some(addr) => addr,
                None => http_addr(file_http_addr.as_deref().unwrap_or(DEFAULT_HTTP_ADDR))
                    .map_err(|e| UsageError(format!("config `http_addr`: {e}")))?,
            };
            let (config, sink) = run_config(args, url, file)?;
            outbox_core::check_registrations().map_err(|e| UsageError(e.to_string()))?;
            let sink = sink.build().map_err(|e| UsageError(e.to_string()))?;
            let relay = Arc::new(Relay::new(config, sink));
            let shutdown = shutdown_on_signals();
            if let HttpAddr(Some(addr)) = http_addr {
                let listener = tokio::net::TcpListener::bind(addr)
                    .await
                    .map_err(|e| UsageError(format!("cannot serve /metrics on {addr}: {e}")))?;
                let prometheus = crate::metrics::install_prometheus().map_err(UsageError)?;
                let bound = listener.local_addr().map_or(addr, |a| a);
                tracing::info!(address = %bound, "serving /metrics, /healthz and /readyz");
                tokio::spawn(endpoints::serve(
                    listener,
                    Arc::clone(&relay),
                    prometheus,
                    shutdown.clone(),
                ));
            }
            relay.run(shutdown).await;
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn run_config(
    args: RunArgs,
    url: String,
    file: FileConfig,
) -> Result<(RelayConfig, SinkConfig), UsageError> {
    let mut config = RelayConfig::new(url);
    if let Some(n) = args.batch_size.or(file.batch_size) {
        if n == 0 {
            return Err(UsageError("batch size must be at least 1".into()));
        }
        config.batch_size = n;
    }
    if let Some(d) = args
        .poll_interval
        .or(file_duration("poll_interval", file.poll_interval)?)
    {
        config.poll_interval = d;
    }
    if let Some(d) = args
        .lease_refresh
        .or(file_duration("lease_refresh", file.lease_refresh)?)
    {
        config.lease_refresh = d;
    }
    let file_retention = file
        .retention
        .map(|r| retention(&r).map_err(|e| UsageError(format!("config `retention`: {e}"))));
    if let Some(Retention(r)) = args.retention.or(file_retention.transpose()?) {
        config.retention = r;
    }
    if let Some(d) = args
        .prune_interval
        .or(file_duration("prune_interval", file.prune_interval)?)
    {
        config.prune_interval = d;
    }
    config.skip_parked = args.skip_parked || file.skip_parked.unwrap_or(false);
    config.mode = args.mode.or(file.mode).unwrap_or_default();
    config.wakeup = args.wakeup.or(file.wakeup).unwrap_or_default();
    config.strict = args.strict || file.strict.unwrap_or(false);
    if let Some(t) = args.topic_template.clone().or(file.topic_template) {
        config.topic_template = t;
    }
    if config.wakeup == Wakeup::Notify && config.database_url.starts_with("sqlite:") {
        return Err(UsageError("--wakeup notify needs PostgreSQL".into()));
    }
    let sink = sink_config(&args, file.sink)?;
    Ok((config, sink))
}

/// The sink from the flags over the `[sink]` table of the config file.
fn sink_config(args: &RunArgs, file: Option<SinkConfig>) -> Result<SinkConfig, UsageError> {
    let file_kind = match &file {
        #[cfg(feature = "kafka")]
        Some(SinkConfig::Kafka(_)) => Some(SinkKind::Kafka),
        #[cfg(feature = "pulsar")]
        Some(SinkConfig::Pulsar(_)) => Some(SinkKind::Pulsar),
        Some(SinkConfig::Stdout) => Some(SinkKind::Stdout),
        None => None,
    };
    #[cfg(feature = "kafka")]
    let default = SinkKind::Kafka;
    #[cfg(not(feature = "kafka"))]
    let default = SinkKind::Stdout;
    match args.sink.or(file_kind).unwrap_or(default) {
        SinkKind::Stdout => Ok(SinkConfig::Stdout),
        #[cfg(feature = "kafka")]
        SinkKind::Kafka => {
            let mut kafka = match file {
                Some(SinkConfig::Kafka(kafka)) => kafka,
                _ => KafkaConfig::new(""),
            };
            if let Some(brokers) = &args.kafka_brokers {
                kafka.brokers = brokers.clone();
            }
            if kafka.brokers.trim().is_empty() {
                return Err(UsageError(
                    "the kafka sink needs brokers: --kafka-brokers, KAFKA_BROKERS or `brokers` in [sink]".into(),
                ));
            }
            kafka.options.extend(args.kafka_options.iter().cloned());
            Ok(SinkConfig::Kafka(kafka))
        }
        #[cfg(feature = "pulsar")]
        SinkKind::Pulsar => {
            let mut pulsar = match file {
                Some(SinkConfig::Pulsar(pulsar)) => pulsar,
                _ => PulsarConfig::new(""),
            };
            if let Some(url) = &args.pulsar_url {
                pulsar.url = url.clone();
            }
            if let Some(tenant) = &args.pulsar_tenant {
                pulsar.tenant = tenant.clone();
            }
            if let Some(namespace) = &args.pulsar_namespace {
                pulsar.namespace = namespace.clone();
            }
            if pulsar.url.trim().is_empty() {
                return Err(UsageError(
                    "the pulsar sink needs a service URL: --pulsar-url, PULSAR_URL or `url` in [sink]".into(),
                ));
            }
            Ok(SinkConfig::Pulsar(pulsar))
        }
    }
}

fn database_url(flag: Option<String>, file: Option<String>) -> Result<String, UsageError> {
    let url = flag.or(file).ok_or_else(|| {
        UsageError(
            "no database: pass --database-url, set DATABASE_URL, or set database_url in --config"
                .into(),
        )
    })?;
    let valid = if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        sqlx::postgres::PgConnectOptions::from_str(&url).map(drop)
    } else if url.starts_with("sqlite:") {
        sqlx::sqlite::SqliteConnectOptions::from_str(&url).map(drop)
    } else {
        return Err(UsageError(format!(
            "database URL {} must start with postgres://, postgresql:// or sqlite:",
            redact_url(&url)
        )));
    };
    valid.map_err(|e| UsageError(format!("bad database URL {}: {e}", redact_url(&url))))?;
    Ok(url)
}

fn read_config(path: &Path) -> Result<FileConfig, UsageError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| UsageError(format!("cannot read config file {}: {e}", path.display())))?;
    toml::from_str(&text).map_err(|e| {
        let message = e.message().replace('\n', " ");
        let line = e
            .span()
            .map(|span| text[..span.start].lines().count().max(1));
        match line {
            Some(line) => UsageError(format!(
                "config file {}, line {line}: {message}",
                path.display()
            )),
            None => UsageError(format!("config file {}: {message}", path.display())),
        }
    })
}

fn file_duration(key: &str, value: Option<String>) -> Result<Option<Duration>, UsageError> {
    value
        .map(|v| duration(&v).map_err(|e| UsageError(format!("config `{key}`: {e}"))))
        .transpose()
}

fn duration(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text)
        .map_err(|e| format!("`{text}` is not a duration such as 100ms or 2s: {e}"))
}

fn http_addr(text: &str) -> Result<HttpAddr, String> {
    match text {
        "off" | "none" => Ok(HttpAddr(None)),
        _ => text
            .parse()
            .map(|a| HttpAddr(Some(a)))
            .map_err(|_| format!("`{text}` is not an address such as 127.0.0.1:9187, or off")),
    }
}

fn retention(text: &str) -> Result<Retention, String> {
    match text {
        "off" | "none" => Ok(Retention(None)),
        _ => duration(text).map(|d| Retention(Some(d))),
    }
}

fn aggregate(text: &str) -> Result<(String, String), String> {
    match text.split_once(':') {
        Some((t, id)) if !t.is_empty() && !id.is_empty() => Ok((t.to_owned(), id.to_owned())),
        _ => Err(format!("`{text}` is not TYPE:ID, such as order:42")),
    }
}

async fn run_failed(command: FailedCommand, url: &str) -> ExitCode {
    let result = match command {
        FailedCommand::List => failed::list(url).await.map(|parked| {
            print_parked(&parked);
        }),
        FailedCommand::Retry(select) => failed::retry(url, &select.selection()).await.map(|n| {
            println!("{n} events will be retried");
        }),
        FailedCommand::Skip { select, reason } => failed::skip(url, &select.selection(), &reason)
            .await
            .map(|n| {
                tracing::warn!(skipped = n, %reason, "parked events skipped by an operator");
                println!("{n} events skipped");
            }),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => failure(&format!("{}: {e}", redact_url(url))),
    }
}

fn print_parked(parked: &[failed::ParkedEvent]) {
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

fn key_value(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((k, v)) if !k.trim().is_empty() => Ok((k.trim().to_owned(), v.to_owned())),
        _ => Err(format!("`{text}` is not KEY=VALUE")),
    }
}

async fn migrate(url: &str, notify_trigger: bool) -> Result<(), outbox_core::sea_orm::DbErr> {
    use outbox_core::sea_orm::{ConnectOptions, ConnectionTrait, Database};
    let mut options = ConnectOptions::new(url);
    options.sqlx_logging(false);
    let db = Database::connect(options).await?;
    outbox_core::migration::migrate(&db).await?;
    if notify_trigger {
        db.execute_unprepared(NOTIFY_TRIGGER_SQL).await?;
    }
    Ok(())
}

fn print_routes(template: &str) {
    let router = Router::new(template, false);
    let mut routes: Vec<_> = router.registered().collect();
    routes.sort_by_key(|r| r.event_type);
    if routes.is_empty() {
        println!(
            "no event types are linked into this binary: every event goes to its row's topic or to {template}"
        );
        return;
    }
    println!(
        "{:<28} {:<16} {:>7}  {:<32} RUST TYPE",
        "EVENT TYPE", "AGGREGATE", "VERSION", "TOPIC"
    );
    for r in routes {
        let topic = router
            .topic_for(r.aggregate_type, r.event_type, None)
            .unwrap_or_else(|reason| reason);
        println!(
            "{:<28} {:<16} {:>7}  {:<32} {}",
            r.event_type, r.aggregate_type, r.version, topic, r.rust_type
        );
    }
}

/// Cancelled on the first SIGINT or SIGTERM: the relay settles its batch and stops. A second
/// signal abandons the batch in flight (nothing unacked was marked; it will be sent again) and exits.
fn shutdown_on_signals() -> CancellationToken {
    let token = CancellationToken::new();
    let cancel = token.clone();
    tokio::spawn(async move {
        signal().await;
        tracing::info!("shutting down after the batch in flight (signal again to abandon it)");
        cancel.cancel();
        signal().await;
        tracing::warn!("abandoning the batch in flight; it will be published again");
        std::process::exit(0);
    });
    token
}

async fn signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

fn init_logging(format: LogFormat) {
    use tracing_subscriber::EnvFilter;
    let filter =
        EnvFilter::try_from_env("OUTBOX_LOG").unwrap_or_else(|_| EnvFilter::new("info,sqlx=warn"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Human => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
}

fn first_line(text: &str) -> String {
    let line = text
        .lines()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("invalid arguments");
    line.trim_start_matches("error: ").to_owned()
}

fn usage_error(message: &str) -> ExitCode {
    eprintln!("outbox-relay: {message} (see --help)");
    ExitCode::from(2)
}

fn failure(message: &str) -> ExitCode {
    eprintln!("outbox-relay: {message}");
    ExitCode::FAILURE
}
