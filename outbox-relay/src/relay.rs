//! The relay's loop: claim a batch, publish it, mark what the broker acked. Read top to bottom.

use crate::config::RelayConfig;
use crate::leases::Leases;
use crate::outbox_table::{Limits, Mode, OutboxRow, OutboxTable, Outcome};
use crate::redact::redact_url;
use crate::routing::Router;
use crate::sink::{Message, Sink, SinkError};
use crate::tasks::BackgroundTasks;
use crate::wakeup::{self, Wakeup};
use crate::{metrics, prune};
use backon::{BackoffBuilder, ExponentialBuilder};
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// How long each readiness check (database, broker) may take.
pub const READY_TIMEOUT: Duration = Duration::from_secs(5);

/// Moves committed events from the outbox table to a [`Sink`], at least once, in order per
/// aggregate.
///
/// ```no_run
/// use outbox_relay::{Relay, RelayConfig, sink::stdout::StdoutSink};
/// use tokio_util::sync::CancellationToken;
///
/// # async fn f() {
/// let relay = Relay::new(RelayConfig::new("sqlite:///tmp/shop.db"), StdoutSink);
/// let shutdown = CancellationToken::new();
/// // Cancel `shutdown` (on SIGTERM, say) to stop after the batch in flight.
/// relay.run(shutdown).await;
/// # }
/// ```
pub struct Relay {
    config: RelayConfig,
    sink: Box<dyn Sink>,
    router: Router,
    /// On SQLite, the lock file that makes this the database's only relay.
    sqlite_lock: std::sync::Mutex<Option<std::fs::File>>,
    /// The connection readiness probes ping, kept between probes.
    probe: tokio::sync::Mutex<Option<OutboxTable>>,
}

impl Relay {
    /// A relay publishing to `sink`, routing by the event types registered in this binary.
    pub fn new(config: RelayConfig, sink: impl Sink + 'static) -> Self {
        let router = Router::new(&config.topic_template, config.strict);
        Relay {
            config,
            sink: Box::new(sink),
            router,
            sqlite_lock: std::sync::Mutex::new(None),
            probe: tokio::sync::Mutex::new(None),
        }
    }

    /// On SQLite, which allows one relay per database, takes the database's relay lock: a lock
    /// file beside it (`shop.db.relay-lock`), held until the relay is dropped. Fails when another
    /// relay holds it. [`run`](Self::run) takes it too; call this first to refuse to start with a
    /// clear error. On PostgreSQL it does nothing: replicas share the work through shard leases.
    pub fn lock_sqlite(&self) -> Result<(), String> {
        use std::str::FromStr;
        let url = &self.config.database_url;
        if !url.starts_with("sqlite:") {
            return Ok(());
        }
        let mut held = self.sqlite_lock.lock().expect("sqlite lock");
        if held.is_some() {
            return Ok(());
        }
        let options =
            sqlx::sqlite::SqliteConnectOptions::from_str(url).map_err(|e| e.to_string())?;
        let database = options.get_filename();
        if database.as_os_str().is_empty() || database.as_os_str() == ":memory:" {
            return Ok(());
        }
        let path = format!("{}.relay-lock", database.display());
        let file = std::fs::File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|e| format!("cannot open the relay lock {path}: {e}"))?;
        match file.try_lock() {
            Ok(()) => {
                *held = Some(file);
                Ok(())
            }
            Err(std::fs::TryLockError::WouldBlock) => Err(format!(
                "another relay already publishes {} (it holds {path}); a SQLite outbox allows one relay",
                database.display()
            )),
            Err(std::fs::TryLockError::Error(e)) => Err(format!("cannot lock {path}: {e}")),
        }
    }

    /// Whether the relay can work now: its database answers and its sink reaches the broker, each
    /// within [`READY_TIMEOUT`]. `/readyz` answers with this. The database is pinged on one
    /// connection kept from probe to probe (opened again after a failure), so probes add no
    /// connections.
    pub async fn ready(&self) -> Result<(), String> {
        let mut probe = self.probe.lock().await;
        let database = async {
            if probe.is_none() {
                *probe = Some(OutboxTable::connect(&self.config.database_url).await?);
            }
            probe.as_mut().expect("connected above").ping().await
        };
        let answer = tokio::time::timeout(READY_TIMEOUT, database).await;
        if !matches!(answer, Ok(Ok(()))) {
            *probe = None;
        }
        match answer {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(format!("database: {e}")),
            Err(_) => return Err(format!("database: no answer within {READY_TIMEOUT:?}")),
        }
        drop(probe);
        match tokio::time::timeout(READY_TIMEOUT, self.sink.ready()).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(format!("{}: {e}", self.sink.name())),
            Err(_) => Err(format!(
                "{}: no answer within {READY_TIMEOUT:?}",
                self.sink.name()
            )),
        }
    }

    /// Runs until `shutdown` is cancelled, then returns after settling the batch in flight.
    ///
    /// It never gives up: when the database or the broker fails, it logs, backs off (exponential,
    /// with jitter, up to `max_backoff`), reconnects and resumes where it stopped.
    pub async fn run(&self, shutdown: CancellationToken) {
        if let Err(e) = self.lock_sqlite() {
            tracing::error!(error = %e, "the relay does not start");
            return;
        }
        // Background work, each on a connection of its own, stopped and awaited before returning.
        let tasks = BackgroundTasks::new(&shutdown);
        let (url, every) = (
            self.config.database_url.clone(),
            self.config.metrics_interval,
        );
        tasks.spawn("backlog sampler", move |stop| {
            metrics::sample_backlog(url, every, stop)
        });
        if let (Mode::Mark, Some(retention)) = (self.config.mode, self.config.retention) {
            let (url, every) = (self.config.database_url.clone(), self.config.prune_interval);
            tasks.spawn("pruner", move |stop| {
                prune::prune_periodically(url, retention, every, stop)
            });
        }
        let mut backoff = self.backoff();
        while !shutdown.is_cancelled() {
            let mut connected = false;
            match self.run_connected(&shutdown, &tasks, &mut connected).await {
                Ok(()) => break,
                Err(e) => {
                    metrics::database_error();
                    // A connection that worked ends the run of failures: the next outage starts
                    // again from the shortest wait, not where the last one left off.
                    if connected {
                        backoff = self.backoff();
                    }
                    let delay = backoff.next().unwrap_or(self.config.max_backoff);
                    tracing::warn!(
                        error = %e, retry_in = ?delay, database = %redact_url(&self.config.database_url),
                        "database unavailable; reconnecting"
                    );
                    tokio::select! {
                        () = tokio::time::sleep(delay) => {}
                        () = shutdown.cancelled() => break,
                    }
                }
            }
        }
        tasks.stop().await;
    }

    /// One connection's life: join the replicas, then claim, publish and mark until shutdown or a
    /// database error. Sets `connected` once it runs.
    async fn run_connected(
        &self,
        shutdown: &CancellationToken,
        tasks: &BackgroundTasks,
        connected: &mut bool,
    ) -> Result<(), sqlx::Error> {
        let mut table = OutboxTable::connect(&self.config.database_url).await?;
        let mut leases = match table.postgres() {
            Some(conn) => Some(Leases::join(conn, self.config.lease_refresh).await?),
            None => None,
        };
        // The listener lives as long as this connection: a reconnect drops it and starts another.
        let connection_tasks = tasks.child();
        let wakeups = match self.config.wakeup {
            Wakeup::Notify => {
                Some(wakeup::listen(&self.config.database_url, &connection_tasks).await?)
            }
            Wakeup::Poll => None,
        };
        tracing::info!(sink = self.sink.name(), database = %redact_url(&self.config.database_url), "relay running");
        *connected = true;
        let mut publish_backoff = self.backoff();
        let mut idle = self.idle_waits();
        // While the broker refuses the relay, nothing is claimed before this; the leases are kept.
        let mut refused_until: Option<Instant> = None;

        loop {
            // Stop between batches only: a batch in flight is always settled first.
            if shutdown.is_cancelled() {
                if let (Some(leases), Some(conn)) = (leases, table.postgres()) {
                    leases.leave(conn).await?;
                }
                tracing::info!("relay stopped");
                return Ok(());
            }

            // Which shards this replica publishes (all rows on SQLite, which allows one relay).
            let shards: Vec<i16> = match (&mut leases, table.postgres()) {
                (Some(leases), Some(conn)) => {
                    leases.refresh_if_due(conn).await?;
                    metrics::shards(leases.held().len());
                    leases.held().to_vec()
                }
                _ => vec![0],
            };
            if let Some(until) = refused_until.filter(|until| Instant::now() < *until) {
                wait(wake_at(until, leases.as_ref()), None, shutdown).await;
                continue;
            }

            // Claim the oldest unpublished rows of those shards whose aggregate is not blocked (a
            // plain read: the leases make this replica their only publisher).
            let started = std::time::Instant::now();
            let hold_parked = !self.config.skip_parked;
            let claim = table.claim(&self.limits(), &shards, hold_parked).await?;
            let claimed = claim.rows.len();
            let full = claim.full;

            // Publish: rows that cannot become a message are parked; the rest are sent together.
            let (sent, messages, mut outcome) = self.messages(&claim.rows);
            let results = if messages.is_empty() {
                Vec::new()
            } else {
                one_result_per_message(
                    self.sink.name(),
                    self.sink.publish(&messages).await,
                    messages.len(),
                )
            };
            let refused = self.record_results(&sent, &messages, results, &mut outcome);

            // Mark (or delete) what the broker acked, in one short transaction.
            claim.settle(&outcome, self.config.mode).await?;
            log_batch(claimed, &outcome);
            if claimed > 0 {
                metrics::batch(claimed, started.elapsed(), &outcome);
            }

            // Go again at once after a full batch; back off when nothing at all went through (the
            // broker is away, or refuses the relay). Otherwise poll adaptively: soon after a batch
            // that found work, less and less often while there is none, up to the poll interval.
            let delay = if let Some(reason) = refused {
                let delay = publish_backoff.next().unwrap_or(self.config.max_backoff);
                tracing::error!(
                    sink = self.sink.name(), %reason, retry_in = ?delay,
                    "the broker refuses the relay; events wait, untouched, until it accepts it"
                );
                refused_until = Some(Instant::now() + delay);
                continue;
            } else if outcome.published.is_empty() && !outcome.failed.is_empty() {
                publish_backoff.next().unwrap_or(self.config.max_backoff)
            } else {
                publish_backoff = self.backoff();
                if full {
                    continue;
                }
                if claimed > 0 {
                    idle = self.idle_waits();
                }
                idle.next().unwrap_or(self.config.poll_interval)
            };
            wait(
                wake_at(Instant::now() + delay, leases.as_ref()),
                wakeups.as_ref(),
                shutdown,
            )
            .await;
        }
    }

    /// The messages of the claimed rows (with the rows they came from), and the rows parked because
    /// they cannot be published.
    ///
    /// An aggregate's rows after a parked one wait behind it, and so do its rows after one that
    /// failed before: a retried event goes out alone, so a later event cannot overtake it.
    fn messages<'r>(&self, rows: &'r [OutboxRow]) -> (Vec<&'r OutboxRow>, Vec<Message>, Outcome) {
        let mut outcome = Outcome::default();
        let mut sent = Vec::with_capacity(rows.len());
        let mut messages = Vec::with_capacity(rows.len());
        let mut held_back: HashSet<(&str, &str)> = HashSet::new();
        for row in rows {
            let aggregate = (row.aggregate_type.as_str(), row.aggregate_id.as_str());
            if held_back.contains(&aggregate) {
                continue;
            }
            match self.router.message(row) {
                Ok(message) => {
                    sent.push(row);
                    messages.push(message);
                    if row.attempts > 0 {
                        held_back.insert(aggregate);
                    }
                }
                Err(reason) => {
                    tracing::error!(event_id = %row.id, seq = row.seq, %reason, "event parked");
                    outcome.parked.push((row.key(), reason));
                    held_back.insert(aggregate);
                }
            }
        }
        (sent, messages, outcome)
    }

    /// Sorts the sink's results into the outcome: acked rows are published, permanent failures
    /// parked, transient ones retried after a backoff that grows with the row's attempts. After an
    /// aggregate's first failure, its later messages in the batch are not marked even if acked:
    /// they go out again after it, in order. When the broker refuses the sink itself, the rows are
    /// left as they were, and the reason is returned.
    fn record_results(
        &self,
        sent: &[&OutboxRow],
        messages: &[Message],
        results: Vec<Result<(), SinkError>>,
        outcome: &mut Outcome,
    ) -> Option<String> {
        let mut refused = None;
        let mut failed_aggregates: HashSet<(&str, &str)> = HashSet::new();
        for ((row, message), result) in sent.iter().zip(messages).zip(results) {
            let aggregate = (row.aggregate_type.as_str(), row.aggregate_id.as_str());
            let id = row.key();
            match result {
                _ if failed_aggregates.contains(&aggregate) => {}
                Ok(()) => {
                    metrics::published(&message.topic, row.created_ms);
                    outcome.published.push(id);
                }
                Err(e) if e.is_unavailable() => {
                    failed_aggregates.insert(aggregate);
                    refused.get_or_insert(e.message);
                }
                Err(e) => {
                    failed_aggregates.insert(aggregate);
                    if e.is_permanent() {
                        tracing::error!(event_id = %row.id, topic = %message.topic, error = %e, "event parked");
                        outcome.parked.push((id, e.message));
                    } else {
                        let attempt = usize::try_from(row.attempts).unwrap_or(0);
                        let retry_in = self
                            .backoff()
                            .nth(attempt)
                            .unwrap_or(self.config.max_backoff);
                        outcome.failed.push((id, e.message, retry_in));
                    }
                }
            }
        }
        refused
    }

    fn limits(&self) -> Limits {
        Limits {
            batch_size: self.config.batch_size,
            max_batch_bytes: self.config.max_batch_bytes,
            max_payload_bytes: self.config.max_payload_bytes,
        }
    }

    /// The waits between polls that find nothing: 1 ms, doubling up to the poll interval. With
    /// NOTIFY, notifications are the fast path and polling only the fallback: always the interval.
    fn idle_waits(&self) -> impl Iterator<Item = Duration> + use<> {
        let max = self.config.poll_interval;
        let first = match self.config.wakeup {
            Wakeup::Poll => Duration::from_millis(1).min(max),
            Wakeup::Notify => max,
        };
        std::iter::successors(Some(first), move |d| Some((*d * 2).min(max)))
    }

    fn backoff(&self) -> impl Iterator<Item = Duration> + use<> {
        ExponentialBuilder::default()
            .with_min_delay(Duration::from_millis(100))
            .with_max_delay(self.config.max_backoff)
            .with_jitter()
            .without_max_times()
            .build()
    }
}

fn log_batch(claimed: usize, outcome: &Outcome) {
    if claimed == 0 {
        return;
    }
    if outcome.failed.is_empty() && outcome.parked.is_empty() {
        tracing::debug!(published = outcome.published.len(), "batch published");
    } else {
        let first_error = outcome.failed.first().map(|(_, e, _)| e.as_str());
        tracing::warn!(
            published = outcome.published.len(),
            retrying = outcome.failed.len(),
            parked = outcome.parked.len(),
            first_error = first_error.or(outcome.parked.first().map(|(_, e)| e.as_str())),
            "batch partly published"
        );
    }
}

/// The sink's results, one per message as the [`Sink`] contract says. A sink that returns more or
/// fewer fails the whole batch: nothing is marked, and every row is retried after its backoff.
fn one_result_per_message(
    sink: &str,
    results: Vec<Result<(), SinkError>>,
    sent: usize,
) -> Vec<Result<(), SinkError>> {
    if results.len() == sent {
        return results;
    }
    let error = format!(
        "sink `{sink}` returned {} results for {sent} messages",
        results.len()
    );
    tracing::error!(%error, "the sink broke its contract; the batch will be retried");
    vec![Err(SinkError::new(error)); sent]
}

/// `until`, or the next lease refresh if that comes first.
fn wake_at(until: Instant, leases: Option<&Leases>) -> Instant {
    match leases {
        Some(leases) => until.min(Instant::from_std(leases.next_refresh())),
        None => until,
    }
}

/// Sleeps until `deadline`, a notification, or shutdown, whichever comes first.
async fn wait(deadline: Instant, wakeups: Option<&Arc<Notify>>, shutdown: &CancellationToken) {
    let notified = async {
        match wakeups {
            Some(notify) => notify.notified().await,
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        () = tokio::time::sleep_until(deadline) => {}
        () = notified => {}
        () = shutdown.cancelled() => {}
    }
}
