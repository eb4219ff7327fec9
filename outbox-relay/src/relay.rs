//! The relay's loop: claim a batch, send it, settle what the broker answered, with the next claim
//! overlapping the broker's answers. Read top to bottom.

use crate::batch::{Limits, Outcome};
use crate::config::{Mode, RelayConfig, Source, Wakeup, backoff};
use crate::database::Backend;
use crate::error::SourceError;
use crate::ordering::{Admission, Verdict, Waiting};
use crate::redact::redact_url;
use crate::routing::Router;
use crate::row::OutboxRow;
use crate::sink::{Ack, Sink, SinkError};
use crate::source::table::leases::Leases;
use crate::source::table::wakeup;
use crate::source::table::{OutboxTable, prune};
use crate::source::wal;
use crate::tasks::BackgroundTasks;
use crate::{metrics, status};
use futures::FutureExt;
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
/// use seaorm_outbox_relay::{Relay, RelayConfig, sink::stdout::StdoutSink};
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
    pub(crate) config: RelayConfig,
    pub(crate) sink: Box<dyn Sink>,
    pub(crate) router: Router,
    /// The database's backend, told once from its URL.
    backend: Backend,
    /// On SQLite, the lock file that makes this the database's only relay.
    sqlite_lock: std::sync::Mutex<Option<std::fs::File>>,
    /// The connection readiness probes ping, kept between probes.
    probe: tokio::sync::Mutex<Option<OutboxTable>>,
}

impl Relay {
    /// A relay publishing to `sink`, routing by the event types registered in this binary.
    pub fn new(config: RelayConfig, sink: impl Sink + 'static) -> Self {
        let router = Router::new(&config.topic_template, config.strict);
        let backend = Backend::of(&config.database_url);
        Relay {
            config,
            sink: Box::new(sink),
            router,
            backend,
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

    /// Checks that this relay may publish the database's outbox from its [`Source`]: a polling
    /// relay refuses a table that a WAL relay reads (it would publish every event again), and a
    /// WAL relay refuses a database without logical replication or with polling relays running.
    /// The WAL source also creates its publication and slot here, so table-less events recorded
    /// from now on are kept for it. [`run`](Self::run) checks too; call this first to refuse to
    /// start with a clear error.
    pub async fn check_source(&self) -> Result<(), SourceError> {
        let url = &self.config.database_url;
        match &self.config.source {
            Source::Table if self.backend == Backend::Sqlite => Ok(()),
            Source::Table => {
                let mut table = OutboxTable::connect(url).await?;
                let conn = table.postgres().expect("a PostgreSQL URL");
                let publications = wal::slot::publications(conn).await?;
                if publications.is_empty() {
                    Ok(())
                } else {
                    Err(SourceError::Refused(wal::slot::polling_refused(
                        &publications,
                    )))
                }
            }
            Source::Wal(_) if self.backend == Backend::Sqlite => Err(SourceError::Refused(
                "the WAL source needs PostgreSQL; SQLite has no logical replication".into(),
            )),
            Source::Wal(source) => wal::check(url, source).await,
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
        // A database that cannot be reached now is retried below; a refusal is final.
        if let Err(e) = self.check_source().await
            && !e.is_temporary()
        {
            tracing::error!(error = %e, "the relay does not start");
            return;
        }
        // Background work, each on a connection of its own, stopped and awaited before returning.
        let tasks = BackgroundTasks::new(&shutdown);
        let (url, every) = (
            self.config.database_url.clone(),
            self.config.metrics_interval,
        );
        if let Source::Wal(source) = &self.config.source {
            let slot = source.slot.clone();
            tasks.spawn("slot sampler", move |stop| {
                status::sample_slot(url, slot, every, stop)
            });
            if let Some(retention) = self.config.retention {
                let (url, every) = (self.config.database_url.clone(), self.config.prune_interval);
                tasks.spawn("pruner", move |stop| {
                    prune::prune_read_periodically(url, retention, every, stop)
                });
            }
            let outlet = wal::Outlet {
                config: &self.config,
                router: &self.router,
                sink: self.sink.as_ref(),
            };
            wal::run(&outlet, source, &shutdown).await;
            tasks.stop().await;
            return;
        }
        tasks.spawn("backlog sampler", move |stop| {
            status::sample_backlog(url, every, stop)
        });
        if let (Mode::Mark, Some(retention)) = (self.config.mode, self.config.retention) {
            let (url, every) = (self.config.database_url.clone(), self.config.prune_interval);
            tasks.spawn("pruner", move |stop| {
                prune::prune_periodically(url, retention, every, stop)
            });
        }
        let mut backoff = self.config.backoff();
        while !shutdown.is_cancelled() {
            let mut connected = false;
            match self.run_connected(&shutdown, &tasks, &mut connected).await {
                Ok(()) => break,
                Err(e) => {
                    metrics::database_error();
                    // A connection that worked ends the run of failures: the next outage starts
                    // again from the shortest wait, not where the last one left off.
                    if connected {
                        backoff = self.config.backoff();
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

    /// One connection's life: join the replicas, then claim, send and settle until shutdown or a
    /// database error. Sets `connected` once it runs.
    ///
    /// The loop is a two-stage pipeline: while the broker answers for the batch in flight, the
    /// database claims the next one; then the answers are read, the new batch is sent, and the
    /// answered batch is settled while the broker works on the new one. At a low rate the loop
    /// does not wait for a slow answer either: the new batch goes out holding the aggregates still
    /// in flight. At most two batches are unsettled at any moment (`docs/design.md`,
    /// "Pipelining").
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
        let mut pace = Pace::new(self);
        let mut in_flight: Option<InFlight> = None;

        loop {
            // Stopping, moving leases and backing off happen only with nothing in flight. Otherwise
            // the batch in flight stays in flight while the next one is claimed, unless its
            // answers come in while the loop waits for its next poll: then it is settled at once.
            let lease_due = leases
                .as_ref()
                .is_some_and(|l| l.due(std::time::Instant::now()));
            if let Some(batch) = in_flight.take_if(|batch| {
                shutdown.is_cancelled()
                    || lease_due
                    || pace.backing_off()
                    || (!pace.go_on() && batch.answered(self.config.ack_timeout))
            }) {
                let answered = self.answers(batch).await;
                self.settle(&mut table, answered, &mut pace).await?;
            }
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
                    if lease_due {
                        leases.refresh(conn).await?;
                    }
                    metrics::shards(leases.held().len());
                    leases.held().to_vec()
                }
                _ => vec![0],
            };
            if let Some((until, interruptible)) = pace.wait() {
                let wakeups = wakeups.as_ref().filter(|_| interruptible);
                // The batch in flight is settled as soon as its answers are in (above).
                let answers = async {
                    match in_flight.as_mut() {
                        Some(batch) => batch.read_answers(self.config.ack_timeout).await,
                        None => std::future::pending().await,
                    }
                };
                let until = wake_at(until, leases.as_ref());
                if wait(until, wakeups, answers, shutdown).await {
                    pace.notified();
                }
                continue;
            }

            // Claim the oldest unpublished rows of those shards whose aggregate is not blocked (a
            // plain read: the leases make this replica their only publisher), skipping the rows
            // of the batch in flight, whose answers may still be coming in.
            let started = std::time::Instant::now();
            let in_flight_seqs = in_flight.as_ref().map_or(&[][..], |b| &b.settled_seqs);
            let hold_parked = !self.config.skip_parked;
            let claim = table
                .claim(&self.limits(), &shards, hold_parked, in_flight_seqs)
                .await?;

            // The batch in flight: a full one, or one whose answers are in, is answered first, and
            // its failures hold their aggregates in the new batch (ordering rule 3). One that still
            // waits for an answer at a low rate is not waited for: the new batch holds every
            // aggregate it has in flight (rule 4), so a slow answer delays only those.
            let answer_first = in_flight
                .as_mut()
                .is_some_and(|batch| batch.full || batch.answered(self.config.ack_timeout));
            let mut before = match in_flight.take() {
                Some(batch) if !answer_first => {
                    if claim.rows.is_empty() {
                        // Nothing new to send: it stays in flight, its answers read in the wait.
                        in_flight = Some(batch);
                        pace.found_nothing();
                        continue;
                    }
                    Some(Before::Unanswered(batch))
                }
                Some(batch) => Some(Before::Answered(self.answers(batch).await)),
                None => None,
            };
            let waiting = match &mut before {
                Some(Before::Answered(answered)) => std::mem::take(&mut answered.waiting),
                Some(Before::Unanswered(batch)) => batch.unanswered(),
                None => Waiting::default(),
            };

            // Send the new batch; its answers are read on the next turn.
            in_flight = self.send(claim.rows, claim.full, waiting, started).await;

            // Settle the batch before in one short transaction, while the broker works.
            if let Some(before) = before {
                let answered = match before {
                    Before::Answered(answered) => answered,
                    Before::Unanswered(batch) => self.answers(batch).await,
                };
                self.settle(&mut table, answered, &mut pace).await?;
            }
            if in_flight.is_none() {
                pace.found_nothing();
            }
        }
    }

    /// Hands the claimed rows to the sink in `seq` order, as the ordering rules allow
    /// (`ordering.rs`): rows that cannot become a message are parked, rows of a held aggregate
    /// are left untouched. Returns the batch in flight, or `None` when nothing was claimed.
    async fn send(
        &self,
        rows: Vec<OutboxRow>,
        full: bool,
        waiting: Waiting,
        started: std::time::Instant,
    ) -> Option<InFlight> {
        if rows.is_empty() {
            return None;
        }
        let mut batch = InFlight {
            claimed: rows.len(),
            full,
            started,
            sent: Vec::with_capacity(rows.len()),
            outcome: Outcome::default(),
            settled_seqs: Vec::with_capacity(rows.len()),
            refused: None,
            admission: Admission::new(waiting),
        };
        for row in rows {
            if batch.refused.is_some() || !batch.admission.admit(&row) {
                continue;
            }
            let message = match self.router.message(&row) {
                Ok(message) => message,
                Err(reason) => {
                    tracing::error!(event_id = %row.id, seq = row.seq, %reason, "event parked");
                    batch.admission.refused(&row);
                    batch.settled_seqs.push(row.seq);
                    batch.outcome.parked.push((row.key(), reason));
                    continue;
                }
            };
            match self.sink.enqueue(&message).await {
                Ok(ack) => {
                    batch.admission.sent(&row);
                    batch.settled_seqs.push(row.seq);
                    batch.sent.push(Sent {
                        row,
                        topic: message.topic,
                        ack,
                        answer_by: Instant::now() + self.config.ack_timeout,
                        answer: None,
                    });
                }
                // The broker refuses the relay itself: nothing more is sent.
                Err(e) if e.is_unavailable() => batch.refused = Some(e.message),
                Err(e) => {
                    batch.admission.refused(&row);
                    batch.settled_seqs.push(row.seq);
                    let verdict = if e.is_permanent() {
                        Verdict::Park(e.message)
                    } else {
                        Verdict::Retry(e.message)
                    };
                    self.record(&row, &message.topic, verdict, &mut batch.outcome);
                }
            }
        }
        Some(batch)
    }

    /// Awaits the broker's answers for a batch in flight, and sorts them into its outcome.
    async fn answers(&self, mut batch: InFlight) -> Answered {
        batch.read_answers(self.config.ack_timeout).await;
        let InFlight {
            claimed,
            full,
            started,
            sent,
            mut outcome,
            mut refused,
            admission,
            ..
        } = batch;
        let mut verdicts = admission.into_verdicts();
        for Sent {
            row, topic, answer, ..
        } in sent
        {
            let answer = answer.expect("every answer was read");
            if let Err(e) = &answer
                && e.is_unavailable()
            {
                refused.get_or_insert_with(|| e.message.clone());
            }
            let verdict = verdicts.verdict(&row, answer);
            self.record(&row, &topic, verdict, &mut outcome);
        }
        Answered {
            claimed,
            full,
            started,
            outcome,
            refused,
            waiting: verdicts.waiting(),
        }
    }

    /// Adds `row`'s verdict to the outcome: acked rows are published, permanent failures parked,
    /// transient ones retried after a backoff that grows with the row's attempts.
    fn record(&self, row: &OutboxRow, topic: &str, verdict: Verdict, outcome: &mut Outcome) {
        match verdict {
            Verdict::Published => {
                metrics::published(topic, row.created_ms);
                outcome.published.push(row.key());
            }
            Verdict::Park(reason) => {
                tracing::error!(event_id = %row.id, %topic, error = %reason, "event parked");
                outcome.parked.push((row.key(), reason));
            }
            Verdict::Retry(error) => {
                let attempt = usize::try_from(row.attempts).unwrap_or(0);
                let retry_in = self
                    .config
                    .backoff()
                    .nth(attempt)
                    .unwrap_or(self.config.max_backoff);
                outcome.failed.push((row.key(), error, retry_in));
            }
            Verdict::Untouched => {}
        }
    }

    /// Writes an answered batch's outcome in one short transaction, and sets the pace: go on at
    /// once after a full batch; back off when nothing at all went through (the broker is away, or
    /// refuses the relay); otherwise poll adaptively.
    async fn settle(
        &self,
        table: &mut OutboxTable,
        answered: Answered,
        pace: &mut Pace,
    ) -> Result<(), sqlx::Error> {
        let Answered {
            claimed,
            full,
            started,
            outcome,
            refused,
            ..
        } = answered;
        table.settle(&outcome, self.config.mode).await?;
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

    fn limits(&self) -> Limits {
        Limits {
            batch_size: self.config.batch_size,
            max_batch_bytes: self.config.max_batch_bytes,
            max_payload_bytes: self.config.max_payload_bytes,
        }
    }
}

/// A batch handed to the sink, its answers still to come.
struct InFlight {
    claimed: usize,
    /// Whether its claim stopped at a limit with more rows waiting.
    full: bool,
    started: std::time::Instant,
    /// The rows sent, in the order they were sent, each with its ack.
    sent: Vec<Sent>,
    /// What was decided before sending: rows parked, or refused at enqueue.
    outcome: Outcome,
    /// Every row this batch will settle (sent, parked or refused): the next claim skips them.
    settled_seqs: Vec<i64>,
    /// Why the broker refuses the relay, if it did at enqueue.
    refused: Option<String>,
    /// Which rows were sent: what the answers are read against.
    admission: Admission,
}

impl InFlight {
    /// Reads the broker's answers as they come, keeping each one; a message without an answer
    /// by its deadline failed (`ack_timeout`). Cancel-safe: a later call goes on where this one
    /// stopped.
    async fn read_answers(&mut self, ack_timeout: Duration) {
        for sent in &mut self.sent {
            if sent.answer.is_none() {
                let answer = tokio::time::timeout_at(sent.answer_by, &mut sent.ack).await;
                sent.answer = Some(answer.unwrap_or_else(|_| {
                    Err(SinkError::new(format!(
                        "no answer from the sink within {ack_timeout:?} (ack_timeout)"
                    )))
                }));
            }
        }
    }

    /// Whether every answer is in, reading those that came without waiting for the others.
    fn answered(&mut self, ack_timeout: Duration) -> bool {
        self.read_answers(ack_timeout).now_or_never().is_some()
    }

    /// The aggregates a batch sent before this one is answered must hold (ordering rule 4).
    fn unanswered(&self) -> Waiting {
        self.admission
            .unanswered(self.sent.iter().map(|sent| &sent.row))
    }
}

/// One sent row and the future of the broker's answer.
struct Sent {
    row: OutboxRow,
    topic: String,
    ack: Ack,
    /// Without an answer by then, the message failed (`ack_timeout`).
    answer_by: Instant,
    /// The answer, once read.
    answer: Option<Result<(), SinkError>>,
}

/// The batch that was in flight when the next one was claimed.
enum Before {
    /// Its answers were read before the next batch was sent.
    Answered(Answered),
    /// Still waiting for answers when the next batch was sent, holding its aggregates.
    Unanswered(InFlight),
}

/// A batch whose answers are all in.
struct Answered {
    claimed: usize,
    full: bool,
    started: std::time::Instant,
    outcome: Outcome,
    refused: Option<String>,
    /// The aggregates the next batch must hold.
    waiting: Waiting,
}

/// When the loop claims next: at once while batches come back full, after a growing idle wait
/// while there is little to do, after a backoff when nothing went through.
struct Pace {
    max_backoff: Duration,
    poll_interval: Duration,
    wakeup: Wakeup,
    publish_backoff: Box<dyn Iterator<Item = Duration> + Send>,
    idle: Box<dyn Iterator<Item = Duration> + Send>,
    /// Claim no sooner than this, and why.
    next_claim: Option<(Instant, Pause)>,
}

/// Why the loop waits before it claims again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pause {
    /// Little to do: the next poll. A notification cuts it short.
    Idle,
    /// Nothing of the last batch went through. A notification cuts it short.
    Backoff,
    /// The broker refuses the relay: notifications do not cut it short.
    Refused,
}

impl Pace {
    fn new(relay: &Relay) -> Self {
        let mut pace = Pace {
            max_backoff: relay.config.max_backoff,
            poll_interval: relay.config.poll_interval,
            wakeup: relay.config.wakeup,
            publish_backoff: Box::new(backoff(relay.config.max_backoff)),
            idle: Box::new(std::iter::empty()),
            next_claim: None,
        };
        pace.idle = pace.idle_waits();
        pace
    }

    /// Whether the loop may claim now.
    fn go_on(&self) -> bool {
        self.next_claim.is_none()
    }

    /// Whether the loop backs off (after a failure), rather than waiting for its next poll.
    fn backing_off(&self) -> bool {
        matches!(self.next_claim, Some((_, Pause::Backoff | Pause::Refused)))
    }

    /// Until when to wait before the next claim, and whether a notification may cut it short.
    fn wait(&mut self) -> Option<(Instant, bool)> {
        if self
            .next_claim
            .is_some_and(|(until, _)| until <= Instant::now())
        {
            self.next_claim = None;
        }
        self.next_claim
            .map(|(until, pause)| (until, pause != Pause::Refused))
    }

    /// A notification came: claim now.
    fn notified(&mut self) {
        if self
            .next_claim
            .is_some_and(|(_, pause)| pause != Pause::Refused)
        {
            self.next_claim = None;
        }
    }

    /// The broker refuses the relay: wait the next backoff, whatever notifications say.
    fn refused(&mut self) -> Duration {
        let delay = self.publish_backoff.next().unwrap_or(self.max_backoff);
        self.next_claim = Some((Instant::now() + delay, Pause::Refused));
        delay
    }

    /// Nothing of a batch went through.
    fn failed(&mut self) {
        let delay = self.publish_backoff.next().unwrap_or(self.max_backoff);
        self.next_claim = Some((Instant::now() + delay, Pause::Backoff));
    }

    /// Some of a batch went through: go on at once after a full batch, poll soon otherwise.
    fn published(&mut self, full: bool) {
        self.publish_backoff = Box::new(backoff(self.max_backoff));
        if !full {
            self.idle = self.idle_waits();
            self.idle_wait();
        }
    }

    /// A claim found nothing to send: poll less and less often, up to the poll interval.
    fn found_nothing(&mut self) {
        if self.next_claim.is_none() {
            self.idle_wait();
        }
    }

    fn idle_wait(&mut self) {
        let delay = self.idle.next().unwrap_or(self.poll_interval);
        self.next_claim = Some((Instant::now() + delay, Pause::Idle));
    }

    /// The waits between polls that find nothing: 1 ms, doubling up to the poll interval. With
    /// NOTIFY, notifications are the fast path and polling only the fallback: always the interval.
    fn idle_waits(&self) -> Box<dyn Iterator<Item = Duration> + Send> {
        let max = self.poll_interval;
        let first = match self.wakeup {
            Wakeup::Poll => Duration::from_millis(1).min(max),
            Wakeup::Notify => max,
        };
        Box::new(std::iter::successors(Some(first), move |d| {
            Some((*d * 2).min(max))
        }))
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

/// `until`, or the next lease refresh if that comes first.
fn wake_at(until: Instant, leases: Option<&Leases>) -> Instant {
    match leases {
        Some(leases) => until.min(Instant::from_std(leases.next_refresh())),
        None => until,
    }
}

/// Sleeps until `deadline`, a notification, `answers` done, or shutdown, whichever comes first.
/// Returns whether a notification came.
async fn wait(
    deadline: Instant,
    wakeups: Option<&Arc<Notify>>,
    answers: impl std::future::Future<Output = ()>,
    shutdown: &CancellationToken,
) -> bool {
    let notified = async {
        match wakeups {
            Some(notify) => notify.notified().await,
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        () = tokio::time::sleep_until(deadline) => false,
        () = notified => true,
        () = answers => false,
        () = shutdown.cancelled() => false,
    }
}
