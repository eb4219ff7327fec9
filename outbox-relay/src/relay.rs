//! The relay's loop: claim a batch, send it, settle what the broker answered, with the next claim
//! overlapping the broker's answers. Read top to bottom.

use crate::batch::{Limits, Outcome};
use crate::config::RelayConfig;
use crate::database::Backend;
use crate::error::SourceError;
use crate::in_flight::{Answered, Before, InFlight, answers, send};
use crate::metrics;
use crate::ordering::Waiting;
use crate::outlet::Outlet;
use crate::pace::Pace;
use crate::quiet::QuietGate;
use crate::readiness::Readiness;
use crate::redact::redact_url;
use crate::routing::Router;
use crate::sink::Sink;
use crate::source::{self, Opened, Source};
use crate::tasks::BackgroundTasks;
use crate::tenants::Outbox;
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use std::collections::HashMap;
use std::sync::Arc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// Moves committed events from the outbox table to a [`Sink`], at least once, in order per
/// aggregate.
///
/// ```no_run
/// use seaorm_outbox_relay::{Relay, RelayConfig, sink::stdout::StdoutSink};
/// use tokio_util::sync::CancellationToken;
///
/// # async fn f() {
/// let relay = Relay::new(RelayConfig::new("sqlite:///tmp/shop.db"), StdoutSink);
/// let shutdown = CancellationToken::new();
/// // Cancel `shutdown` (on SIGTERM, say) to stop after the batch in flight.
/// if let Err(refused) = relay.run(shutdown).await {
///     eprintln!("the relay stopped: {refused}");
/// }
/// # }
/// ```
pub struct Relay {
    pub(crate) config: RelayConfig,
    pub(crate) sink: Box<dyn Sink>,
    pub(crate) router: Router,
    /// The database's backend, told once from its URL.
    backend: Backend,
    /// On SQLite, the lock file that makes this the database's only relay.
    sqlite_lock: std::sync::Mutex<Option<std::fs::File>>,
    /// What `/readyz` answers, kept between probes.
    readiness: Readiness,
    /// The sink's quiet moment, shared by the pumps.
    quiet: QuietGate,
    /// The connections the tenants' background work (samplers, pruners) may hold at once.
    tenant_sessions: Arc<tokio::sync::Semaphore>,
}

/// How many connections the tenants' background work holds at most, across every tenant: the
/// relay's connections to tenant databases are one per pump and these.
pub(crate) const TENANT_BACKGROUND_SESSIONS: usize = 4;

/// How many tenants-list rereads after its refusal a tenant's table is tried again (30 s by
/// default).
const REFUSED_RETRY: u32 = 6;

/// Sleeps until `at`, or for ever.
async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

impl Relay {
    /// A relay publishing to `sink`, routing by the event types registered in this binary.
    pub fn new(config: RelayConfig, sink: impl Sink + 'static) -> Self {
        let mut router = Router::new(&config.topic_template, config.strict);
        if let Some(format) = &config.cloudevents {
            router = router.with_cloudevents(format.clone(), sink.cloudevents_prefix());
        }
        let backend = Backend::of(&config.database_url);
        Relay {
            config,
            sink: Box::new(sink),
            router,
            backend,
            sqlite_lock: std::sync::Mutex::new(None),
            readiness: Readiness::default(),
            quiet: QuietGate::default(),
            tenant_sessions: Arc::new(tokio::sync::Semaphore::new(TENANT_BACKGROUND_SESSIONS)),
        }
    }

    /// On SQLite, which allows one relay per database, takes the database's relay lock: a lock
    /// file beside it (`shop.db.relay-lock`), held until the relay is dropped. Fails when another
    /// relay holds it. [`run`](Self::run) takes it too; call this first to refuse to start with a
    /// clear error. On PostgreSQL it does nothing: replicas share the work through shard leases.
    pub fn lock_sqlite(&self) -> Result<(), String> {
        use std::str::FromStr;
        let url = &self.config.database_url;
        if self.backend != Backend::Sqlite {
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

    /// Checks that this relay may publish the database's outbox from its [`Source`](crate::Source): a polling
    /// relay refuses a table that a WAL relay reads (it would publish every event again), and a
    /// WAL relay refuses a database without logical replication or with polling relays running.
    /// The WAL source also creates its publication and slot here, so table-less events recorded
    /// from now on are kept for it. [`run`](Self::run) checks too; call this first to refuse to
    /// start with a clear error.
    pub async fn check_source(&self) -> Result<(), SourceError> {
        source::check(&self.config).await
    }

    /// Whether the relay can work now: its database answers and its sink reaches the broker, each
    /// within [`READY_TIMEOUT`](crate::READY_TIMEOUT). `/readyz` answers with this. Probes add no
    /// connections, and many probes make at most one check a second.
    pub async fn ready(&self) -> Result<(), String> {
        self.readiness
            .check(&self.config.database_url, &*self.sink)
            .await
    }

    /// Runs until `shutdown` is cancelled, then returns after settling the batch in flight. Each
    /// table of [`RelayConfig::tables`] (in each of [`RelayConfig::tenants`]' databases, if it
    /// names any) has a pump of its own (its connection, leases, pace and batches), all publishing
    /// through the one sink: one table's failures (a dropped connection, a broker refusing its
    /// topic) hold only that table's events.
    ///
    /// It never gives up on what may pass: when the database or the broker fails, it logs, backs
    /// off (exponential, with jitter, up to `max_backoff`), reconnects and resumes where it
    /// stopped. It stops with an error only when its source refuses it, at start or on a
    /// reconnect (another relay holds the SQLite database, a WAL relay's replication slot was
    /// dropped, ...): no retry can fix that, an operator must act.
    pub async fn run(&self, shutdown: CancellationToken) -> Result<(), SourceError> {
        let refused = |e: SourceError| {
            tracing::error!(error = %e, "the relay does not start");
            Err(e)
        };
        if let Err(e) = self.lock_sqlite() {
            return refused(SourceError::Refused(e));
        }
        // A database that cannot be reached now is retried below; a refusal is final.
        if let Err(e) = self.check_source().await
            && !e.is_temporary()
        {
            return refused(e);
        }
        // Background work, each on a connection of its own, stopped and awaited before returning.
        let tasks = BackgroundTasks::new(&shutdown);
        let outcome = self.run_pumps(&shutdown, &tasks).await;
        tasks.stop().await;
        outcome
    }

    /// Runs one pump per outbox table (per tenant database), all through the one sink; with a
    /// tenants file, starts and stops pumps as tenants come and go. Without tenants a refusal
    /// stops every pump: no retry can fix it, and a relay that went on without one of its tables
    /// would hide that. A tenant's refusal stops that tenant's pump alone, until its entry in the
    /// list changes or [`REFUSED_RETRY`] rereads later (an operator may have fixed the cause, say
    /// migrated its database): one tenant never stops the others.
    async fn run_pumps(
        &self,
        shutdown: &CancellationToken,
        tasks: &BackgroundTasks,
    ) -> Result<(), SourceError> {
        let stop = shutdown.child_token();
        let (catalogue, listed) = (&self.config.database_url, &self.config.tenants);
        let mut tenants = listed.read(catalogue).await.map_err(SourceError::Refused)?;
        // Each running pump's number (a pump stopped and started again is another) and stop token.
        let mut running: HashMap<Outbox, (u64, CancellationToken)> = HashMap::new();
        // When each refused outbox was refused.
        let mut refused: HashMap<Outbox, Instant> = HashMap::new();
        let mut pumps = FuturesUnordered::new();
        let mut started = 0;
        let mut outcome = Ok(());
        let every = self.config.tenants_reread;
        let retry_refused = every * REFUSED_RETRY;
        let mut reread = tokio::time::interval_at(Instant::now() + every, every);
        reread.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            if stop.is_cancelled() {
                if pumps.is_empty() {
                    break;
                }
            } else {
                // The pumps of the outboxes listed now run; those of outboxes no longer listed stop.
                let listed = Outbox::all(catalogue, &self.config.tables, tenants.as_deref());
                running.retain(|outbox, (_, pump)| {
                    let keep = listed.contains(outbox);
                    if !keep {
                        tracing::info!(tenant = %outbox.tenant_name(), table = %outbox.table, "no longer listed; releasing it");
                        pump.cancel();
                    }
                    keep
                });
                refused
                    .retain(|outbox, at| listed.contains(outbox) && at.elapsed() < retry_refused);
                for outbox in listed {
                    if !running.contains_key(&outbox) && !refused.contains_key(&outbox) {
                        started += 1;
                        let pump = stop.child_token();
                        running.insert(outbox.clone(), (started, pump.clone()));
                        pumps.push(self.pumping(started, outbox, pump, tasks.child()));
                    }
                }
            }
            let next_retry = refused.values().min().map(|at| *at + retry_refused);
            tokio::select! {
                Some((number, outbox, pumped)) = pumps.next() => {
                    if !running.contains_key(&outbox) {
                        // Released (no longer listed), and not listed again since: its gauges
                        // would otherwise show its last backlog and shards for good.
                        metrics::outbox_released(&outbox.labels());
                    }
                    if running.get(&outbox).is_some_and(|(n, _)| *n == number) {
                        running.remove(&outbox);
                    }
                    if let Err(e) = pumped {
                        if tenants.is_some() {
                            tracing::error!(
                                tenant = %outbox.tenant_name(), table = %outbox.table, error = %e,
                                retry_in = ?retry_refused,
                                "refused; this tenant's table is tried again then, or when its line in the tenants list changes"
                            );
                            refused.insert(outbox, Instant::now());
                        } else {
                            tracing::error!(table = %outbox.table, error = %e, "refused; the relay stops");
                            stop.cancel();
                            outcome = Err(e);
                        }
                    }
                }
                _ = reread.tick(), if listed.rereads() && !stop.is_cancelled() => {
                    match listed.read(catalogue).await {
                        Ok(now) => tenants = now,
                        Err(e) => tracing::error!(error = %e, "keeping the tenants the relay has"),
                    }
                }
                () = sleep_until(next_retry), if !stop.is_cancelled() => {}
                () = stop.cancelled(), if pumps.is_empty() => {}
            }
        }
        outcome
    }

    /// Pump number `number` of `outbox`, in a span naming its tenant and table, with background
    /// tasks of its own stopped when it ends.
    fn pumping(
        &self,
        number: u64,
        outbox: Outbox,
        stop: CancellationToken,
        tasks: BackgroundTasks,
    ) -> impl Future<Output = (u64, Outbox, Result<(), SourceError>)> + '_ {
        // At error level, so every line a pump logs names its table whatever the filter.
        let span =
            tracing::error_span!("pump", tenant = tracing::field::Empty, table = %outbox.table);
        if let Some(tenant) = &outbox.tenant {
            span.record("tenant", tracing::field::display(tenant));
        }
        async move {
            let pumped = self.pump(&outbox, &stop, &tasks).await;
            tasks.stop().await;
            (number, outbox, pumped)
        }
        .instrument(span)
    }

    /// One outbox table's pump: opens its source, runs it, reconnects with a backoff when the database
    /// fails, until `shutdown` or a refusal.
    async fn pump(
        &self,
        outbox: &Outbox,
        shutdown: &CancellationToken,
        tasks: &BackgroundTasks,
    ) -> Result<(), SourceError> {
        source::spawn_background(&self.config, outbox, &self.tenant_sessions, tasks);
        let mut backoff = self.config.backoff();
        let mut standby = false;
        while !shutdown.is_cancelled() {
            let mut connected = false;
            let mut in_flight = None;
            let delay = match self
                .run_connected(outbox, shutdown, tasks, &mut connected, &mut in_flight)
                .await
            {
                Ok(()) => break,
                // Logged by `run_pumps`, which decides what the refusal stops.
                Err(e) if !e.is_temporary() => return Err(e),
                Err(SourceError::Standby(what)) => {
                    if !standby {
                        tracing::info!(
                            "standby: another relay publishes {what}; taking over when it stops"
                        );
                    }
                    standby = true;
                    source::wal::STANDBY_POLL
                }
                Err(e) => {
                    standby = false;
                    metrics::database_error();
                    // What was in flight is sent again after the reconnect, so none of it may
                    // still be queued in the sink's client then, to arrive after its copy. Its
                    // answers are awaited; only one that does not come in time has the client's
                    // queue dropped, which drops other tables' messages too (they are sent again).
                    if let Some(batch) = in_flight {
                        tokio::select! {
                            answered = batch.answered_in_full(self.config.ack_timeout) => {
                                if !answered {
                                    self.sink.purge();
                                }
                            }
                            () = shutdown.cancelled() => break,
                        }
                    }
                    // A connection that worked ends the run of failures: the next outage starts
                    // again from the shortest wait, not where the last one left off.
                    if connected {
                        backoff = self.config.backoff();
                    }
                    let delay = backoff.next().unwrap_or(self.config.max_backoff);
                    tracing::warn!(
                        error = %e, retry_in = ?delay, database = %redact_url(&outbox.database_url),
                        "database unavailable; reconnecting"
                    );
                    delay
                }
            };
            tokio::select! {
                () = tokio::time::sleep(delay) => {}
                () = shutdown.cancelled() => break,
            }
        }
        Ok(())
    }

    /// One connection's life: open the source (join the replicas, or start reading the slot), then
    /// claim, send and settle until shutdown or a database error. Sets `connected` once it runs;
    /// leaves in `in_flight` the batch it sent and could not settle, if any.
    ///
    /// The loop is a two-stage pipeline: while the broker answers for the batch in flight, the
    /// database claims the next one; then the answers are read, the new batch is sent, and the
    /// answered batch is settled while the broker works on the new one. The loop does not wait
    /// for answers the new batch does not need (at a low rate, or when it has no event of the
    /// aggregates in flight): it goes out holding the aggregates still in flight. At most two
    /// batches are unsettled at any moment (`docs/design.md`, "Pipelining").
    async fn run_connected(
        &self,
        outbox: &Outbox,
        shutdown: &CancellationToken,
        tasks: &BackgroundTasks,
        connected: &mut bool,
        in_flight: &mut Option<InFlight>,
    ) -> Result<(), SourceError> {
        // The listener lives as long as this connection: a reconnect drops it and starts another.
        let connection_tasks = tasks.child();
        if outbox.tenant.is_some() {
            source::check_database(&self.config, &outbox.database_url).await?;
        }
        let mut source = Opened::open(&self.config, outbox, &connection_tasks).await?;
        tracing::info!(sink = self.sink.name(), database = %redact_url(&outbox.database_url), "relay running");
        *connected = true;
        let outlet = self.outlet();
        let ack_timeout = self.config.ack_timeout;
        let mut pace = Pace::new(&self.config);

        loop {
            // Stopping, rebalancing, a quiet moment the sink asked for (to replace its producer)
            // and backing off happen only with nothing in flight. Otherwise the batch in flight
            // stays in flight while the next one is claimed, unless its answers come in while the
            // loop waits for its next poll: then it is settled at once.
            let rebalance = source.rebalance_due();
            let quiet = self.sink.wants_quiet();
            if let Some(batch) = in_flight.take_if(|batch| {
                shutdown.is_cancelled()
                    || rebalance
                    || quiet
                    || pace.backing_off()
                    || (!pace.go_on() && batch.answered(ack_timeout))
            }) {
                let answered = answers(&outlet, batch).await;
                self.settle(&mut source, answered, &mut pace).await?;
            }
            if shutdown.is_cancelled() {
                source.leave().await?;
                tracing::info!("relay stopped");
                return Ok(());
            }
            if rebalance {
                source.rebalance().await?;
            }
            if quiet {
                self.quiet.quiet(&*self.sink).await;
            }
            if let Some((until, interruptible)) = pace.wait() {
                // The batch in flight is settled as soon as its answers are in (above).
                let until = source.wake_at(until);
                let answers = async {
                    match in_flight.as_mut() {
                        Some(batch) => batch.read_answers(ack_timeout).await,
                        None => std::future::pending().await,
                    }
                };
                let new_events = async {
                    if interruptible {
                        source.new_events().await;
                    } else {
                        std::future::pending::<()>().await;
                    }
                };
                if wait(until, new_events, answers, shutdown).await {
                    pace.notified();
                }
                continue;
            }

            // Claim the oldest publishable rows, skipping those of the batch in flight, whose
            // answers may still be coming in.
            let started = std::time::Instant::now();
            let in_flight_seqs = in_flight.as_ref().map_or(&[][..], |b| &b.settled);
            let claim = source.claim(&self.limits(), in_flight_seqs).await?;

            // The batch in flight: one whose answers are in is answered first, and its failures
            // hold their aggregates in the new batch (ordering rule 3). So is a full one when the
            // new batch has events of its aggregates, which waiting lets through. Otherwise it is
            // not waited for: the new batch goes out at once holding every aggregate in flight
            // (rule 4). At a low rate a slow answer so delays only its aggregates; at full rate
            // the broker gets the next batch while it answers for this one.
            let mut before = match in_flight.take() {
                None => None,
                Some(mut batch) => {
                    if batch.answered(ack_timeout) {
                        Some(Before::Answered(answers(&outlet, batch).await))
                    } else if claim.rows.is_empty() {
                        // Nothing new to send: it stays in flight, its answers read in the wait.
                        *in_flight = Some(batch);
                        pace.found_nothing();
                        continue;
                    } else {
                        let waiting = batch.unanswered();
                        if batch.full && claim.rows.iter().any(|row| waiting.holds(row)) {
                            Some(Before::Answered(answers(&outlet, batch).await))
                        } else {
                            Some(Before::Unanswered(batch, waiting))
                        }
                    }
                }
            };
            let waiting = match &mut before {
                Some(Before::Answered(answered)) => std::mem::take(&mut answered.waiting),
                Some(Before::Unanswered(_, waiting)) => std::mem::take(waiting),
                None => Waiting::default(),
            };

            // Send the new batch; its answers are read on the next turn.
            *in_flight = send(&outlet, claim.rows, claim.full, waiting, started).await;

            // Settle the batch before in one short transaction, while the broker works.
            if let Some(before) = before {
                let answered = match before {
                    Before::Answered(answered) => answered,
                    Before::Unanswered(batch, _) => answers(&outlet, batch).await,
                };
                self.settle(&mut source, answered, &mut pace).await?;
            }
            if in_flight.is_none() {
                pace.found_nothing();
            }
        }
    }

    /// Writes an answered batch's outcome in one short transaction, and sets the pace: go on at
    /// once after a full batch; back off when nothing at all went through (the broker is away, or
    /// refuses the relay); otherwise poll adaptively.
    async fn settle(
        &self,
        source: &mut impl Source,
        answered: Answered,
        pace: &mut Pace,
    ) -> Result<(), SourceError> {
        let Answered {
            claimed,
            full,
            started,
            outcome,
            refused,
            ..
        } = answered;
        source.settle(&outcome).await?;
        log_batch(claimed, &outcome);
        metrics::batch(claimed, started.elapsed(), &outcome);
        if let Some(reason) = refused {
            let delay = pace.refused();
            tracing::error!(
                sink = self.sink.name(), %reason, retry_in = ?delay,
                "the broker refuses the relay; events wait, untouched, until it accepts it"
            );
        } else if outcome.published.is_empty() && !outcome.failed.is_empty() {
            pace.failed();
        } else {
            pace.published(full);
        }
        Ok(())
    }

    fn outlet(&self) -> Outlet<'_> {
        Outlet {
            config: &self.config,
            router: &self.router,
            sink: self.sink.as_ref(),
            quiet: &self.quiet,
        }
    }

    fn limits(&self) -> Limits {
        Limits {
            batch_size: self.config.batch_size,
            max_batch_bytes: self.config.max_batch_bytes,
            max_payload_bytes: self.config.max_payload_bytes,
        }
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

/// Sleeps until `deadline`, new events, `answers` done, or shutdown, whichever comes first.
/// Returns whether new events were announced.
async fn wait(
    deadline: Instant,
    new_events: impl std::future::Future<Output = ()>,
    answers: impl std::future::Future<Output = ()>,
    shutdown: &CancellationToken,
) -> bool {
    tokio::select! {
        () = tokio::time::sleep_until(deadline) => false,
        () = new_events => true,
        () = answers => false,
        () = shutdown.cancelled() => false,
    }
}
