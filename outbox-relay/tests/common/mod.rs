//! Helpers shared by the relay's integration tests.
#![allow(dead_code)]

pub mod aws;
pub mod kafka;
pub mod meters;
pub mod nats;
pub mod pulsar;
pub mod rabbitmq;
pub mod secure;
pub mod wal;
pub mod webhook;

use seaorm_outbox::Uuid;
use seaorm_outbox::sea_orm::{
    ConnectionTrait, DatabaseConnection, DatabaseTransaction, DbBackend, Statement,
};
use seaorm_outbox_relay::RelayConfig;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// `scripts/services <command>` on the services the tests run against (`pause-kafka`, say).
pub fn services(command: &str) {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/services");
    let status = Command::new(script)
        .arg(command)
        .status()
        .expect("run scripts/services");
    assert!(status.success(), "scripts/services {command} failed");
}

/// A fresh PostgreSQL schema with the outbox tables, and topics of its own.
#[derive(Clone)]
pub struct Fixture {
    pub db: DatabaseConnection,
    /// A database URL whose connections use the fixture's schema.
    pub url: String,
    /// A topic template unique to this test.
    pub template: String,
    /// The topic prefix of `template`.
    pub prefix: String,
}

impl Fixture {
    pub async fn new() -> Fixture {
        let (db, schema) = outbox_tests::postgres_schema().await;
        seaorm_outbox::migration::migrate(&db)
            .await
            .expect("migrate");
        let prefix = format!("t{}", Uuid::now_v7().simple());
        Fixture {
            db,
            url: outbox_tests::schema_url(&schema),
            template: format!("{prefix}.{{aggregate_type}}"),
            prefix,
        }
    }

    /// The same fixture, whose relays name their connections `name` in `pg_stat_activity`.
    pub fn named(&self, name: &str) -> Fixture {
        Fixture {
            url: format!("{}&application_name={name}", self.url),
            ..self.clone()
        }
    }

    /// The topic of `aggregate_type` under this fixture's template.
    pub fn topic(&self, aggregate_type: &str) -> String {
        format!("{}.{aggregate_type}", self.prefix)
    }

    /// A relay configuration for this fixture, polling briskly.
    pub fn relay_config(&self) -> RelayConfig {
        let mut config = RelayConfig::new(self.url.clone());
        config.topic_template = self.template.clone();
        config.poll_interval = Duration::from_millis(20);
        config
    }

    /// Runs SQL returning one bigint column.
    pub async fn scalar(&self, sql: &str) -> i64 {
        self.db
            .query_one_raw(Statement::from_string(DbBackend::Postgres, sql))
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
            .expect("one row")
            .try_get_by_index::<i64>(0)
            .expect("an i64")
    }

    /// Unpublished and unparked rows.
    pub async fn backlog(&self) -> i64 {
        self.scalar("SELECT count(*) FROM outbox WHERE published_at IS NULL AND parked_at IS NULL")
            .await
    }

    /// Waits until nothing is left to publish, or panics after `timeout`.
    pub async fn wait_until_drained(&self, timeout: Duration) {
        let backlog =
            "SELECT count(*) FROM outbox WHERE published_at IS NULL AND parked_at IS NULL";
        self.wait_until_zero(backlog, timeout).await;
    }

    /// Waits until `sql` (one bigint: the work left) returns 0, or panics after `timeout`.
    pub async fn wait_until_zero(&self, sql: &str, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            let left = self.scalar(sql).await;
            if left == 0 {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "still {left} after {timeout:?}: {sql}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Starts the `outbox-relay` binary publishing this fixture's outbox to Kafka.
    pub fn spawn_relay(&self, extra: &[&str]) -> KillOnDrop {
        self.spawn_relay_to(&["--kafka-brokers", &kafka::brokers()], extra)
    }

    /// Starts the `outbox-relay` binary publishing this fixture's outbox to Pulsar.
    pub fn spawn_pulsar_relay(&self, extra: &[&str]) -> KillOnDrop {
        self.spawn_relay_to(&["--sink", "pulsar", "--pulsar-url", &pulsar::url()], extra)
    }

    /// Starts the `outbox-relay` binary with `sink` arguments, then `extra` ones.
    /// The process is killed when the returned guard is dropped, so a failing test leaves no
    /// relay running.
    pub fn spawn_relay_to(&self, sink: &[&str], extra: &[&str]) -> KillOnDrop {
        // Endpoints on a port of its own unless the test picks one, so replicas do not collide.
        let http = if extra.contains(&"--http-addr") {
            &[][..]
        } else {
            &["--http-addr", "127.0.0.1:0"][..]
        };
        KillOnDrop::spawn_logged(
            relay_command()
                .args(["run", "--database-url", &self.url])
                .args(sink)
                .args([
                    "--topic-template",
                    &self.template,
                    "--poll-interval",
                    "20ms",
                    "--lease-refresh",
                    "300ms",
                ])
                .args(http)
                .args(extra)
                .stdout(Stdio::null()),
        )
    }
}

/// Runs `outbox-relay migrate` on `url`, which must succeed.
pub fn migrate(url: &str) {
    let migrated = relay_command()
        .args(["migrate", "--database-url", url])
        .output()
        .unwrap();
    assert!(
        migrated.status.success(),
        "{}",
        String::from_utf8_lossy(&migrated.stderr)
    );
}

/// A loopback port free right now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// GET `path` from 127.0.0.1:`port`: the status code and body, or `None` if nothing answers.
pub fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .ok()?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    let status = response.split_whitespace().nth(1)?.parse().ok()?;
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Some((status, body))
}

/// Waits until `path` on `port` answers, and returns its answer.
pub async fn http_get_when_up(port: u16, path: &str) -> (u16, String) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(answer) = http_get(port, path) {
            return answer;
        }
        assert!(
            Instant::now() < deadline,
            "nothing answers on 127.0.0.1:{port}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The `outbox-relay` binary of this build.
pub fn relay_command() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_outbox-relay"));
    command
        .env_remove("DATABASE_URL")
        .env_remove("KAFKA_BROKERS")
        .env_remove("PULSAR_URL")
        .env(
            "OUTBOX_LOG",
            std::env::var("OUTBOX_TEST_RELAY_LOG").unwrap_or_else(|_| "warn".into()),
        );
    command
}

/// Sends SIGTERM to `child` and returns its exit code.
pub fn terminate(child: &mut Child) -> Option<i32> {
    signal(child, "TERM");
    child.wait().expect("wait for relay").code()
}

/// Sends `signal` (such as `KILL` or `TERM`) to `child`.
pub fn signal(child: &Child, signal: &str) {
    let status = Command::new("kill")
        .args([&format!("-{signal}"), &child.id().to_string()])
        .status()
        .expect("kill");
    assert!(status.success(), "kill -{signal} failed");
}

/// A child process killed when dropped, so a test that panics leaves no relay running (and no
/// pipe of the test runner held open).
///
/// A child started with [`KillOnDrop::spawn_logged`] writes its stderr to a file, printed only if
/// the test fails: the errors a test provokes on purpose (a broker away, a poison row) stay out of
/// a passing run's output, so a real error stands out.
pub struct KillOnDrop {
    child: Child,
    log: Option<std::path::PathBuf>,
}

impl KillOnDrop {
    /// Starts `command` with its stderr going to a log file of its own.
    pub fn spawn_logged(command: &mut Command) -> KillOnDrop {
        let log = outbox_tests::temp_dir().join("child.log");
        let child = command
            .stderr(std::fs::File::create(&log).expect("child log file"))
            .spawn()
            .expect("start child process");
        KillOnDrop {
            child,
            log: Some(log),
        }
    }

    /// What the child wrote to stderr so far (empty unless started with
    /// [`spawn_logged`](KillOnDrop::spawn_logged)).
    pub fn log(&self) -> String {
        self.log
            .as_ref()
            .and_then(|path| std::fs::read_to_string(path).ok())
            .unwrap_or_default()
    }
}

impl From<Child> for KillOnDrop {
    fn from(child: Child) -> KillOnDrop {
        KillOnDrop { child, log: None }
    }
}

impl std::ops::Deref for KillOnDrop {
    type Target = Child;
    fn deref(&self) -> &Child {
        &self.child
    }
}

impl std::ops::DerefMut for KillOnDrop {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.child
    }
}

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            let log = self.log();
            if !log.is_empty() {
                // eprintln! is captured by the test harness and shown with the failure.
                eprintln!("--- stderr of child {} ---\n{log}", self.child.id());
            }
        }
    }
}

/// Waits until `child` exits and returns its status and stderr (which must be piped); kills it
/// and panics with `what` if it still runs after `timeout`.
pub fn wait_for_exit(
    child: &mut Child,
    timeout: Duration,
    what: &str,
) -> (std::process::ExitStatus, String) {
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("{what} after {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut stderr = String::new();
    if let Some(mut pipe) = child.stderr.take() {
        std::io::Read::read_to_string(&mut pipe, &mut stderr).unwrap();
    }
    (status, stderr)
}

/// Checks that `relay`, started on a table short of schema `version`, stops at once with exit
/// code 1 and a line that names the version and says to run `outbox-relay migrate`.
pub fn assert_refused_until_migrated(relay: &mut KillOnDrop, version: u32) {
    let (status, _) = wait_for_exit(
        relay,
        Duration::from_secs(30),
        &format!("the relay ran on a table without schema version {version}"),
    );
    let stderr = relay.log();
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!("needs schema version {version}"))
            && stderr.contains("outbox-relay migrate"),
        "{stderr}"
    );
}

/// The check every crash-and-restart test makes of what a consumer received: every expected
/// event arrived, and each key's *first* deliveries came in the order the events were recorded
/// (re-sends after a crash may repeat events, never reorder first arrivals). `received` is
/// (key, event) in arrival order; `expected` is each key's events in recorded order. Returns how
/// many deliveries were duplicates.
pub fn assert_complete_and_ordered<E>(
    received: impl IntoIterator<Item = (String, E)>,
    expected: &std::collections::BTreeMap<String, Vec<E>>,
) -> usize
where
    E: Eq + std::hash::Hash + Clone + std::fmt::Debug,
{
    let mut seen = std::collections::HashSet::new();
    let mut firsts: std::collections::BTreeMap<String, Vec<E>> = Default::default();
    let mut deliveries = 0;
    for (key, event) in received {
        deliveries += 1;
        if seen.insert(event.clone()) {
            firsts.entry(key).or_default().push(event);
        }
    }
    let missing: Vec<&E> = expected
        .values()
        .flatten()
        .filter(|e| !seen.contains(*e))
        .collect();
    assert!(
        missing.is_empty(),
        "{} events never arrived, such as {:?}",
        missing.len(),
        &missing[..missing.len().min(10)]
    );
    for (key, events) in expected {
        let got = firsts.remove(key).unwrap_or_default();
        assert!(
            &got == events,
            "first deliveries of {key} out of order: {got:?}, recorded {events:?}"
        );
    }
    assert!(
        firsts.is_empty(),
        "events nobody recorded arrived: {firsts:?}"
    );
    deliveries - seen.len()
}

/// `EXPLAIN (options)` of the claim of `batch` rows ([`claim_sql`]) with the relay's session
/// settings, in a transaction rolled back afterwards: the plan's rows (text lines, or one JSON
/// document with `FORMAT JSON`).
pub async fn explain_claim<T: seaorm_outbox::sea_orm::TryGetable>(
    f: &Fixture,
    options: &str,
    batch: usize,
) -> Vec<T> {
    explain(f, options, &claim_sql(batch)).await
}

/// `EXPLAIN (options) query` with the relay's session settings, in a transaction rolled back
/// afterwards.
pub async fn explain<T: seaorm_outbox::sea_orm::TryGetable>(
    f: &Fixture,
    options: &str,
    query: &str,
) -> Vec<T> {
    use seaorm_outbox::sea_orm::TransactionTrait;
    let txn = f.db.begin().await.unwrap();
    txn.execute_unprepared(seaorm_outbox_relay::POSTGRES_SESSION_SQL)
        .await
        .unwrap();
    let explain = format!("EXPLAIN ({options}) {query}");
    let plan = txn
        .query_all_raw(Statement::from_string(DbBackend::Postgres, explain))
        .await
        .unwrap()
        .iter()
        .map(|row| row.try_get_by_index::<T>(0).unwrap())
        .collect();
    txn.rollback().await.unwrap();
    plan
}

/// The relay's claim query (`POSTGRES_CLAIM_SQL`) with its parameters written in: every shard,
/// `batch` rows, parked aggregates held back, the relay's default byte limits, no batch in flight.
pub fn claim_sql(batch: usize) -> String {
    claim_sql_skipping(batch, "'{}'::int8[]")
}

/// [`claim_sql`] with a batch in flight: `in_flight` is an SQL expression of its `seq`s
/// (`int8[]`), which the claim skips.
pub fn claim_sql_skipping(batch: usize, in_flight: &str) -> String {
    claim_sql_of(batch, "decode(repeat('ff', 32), 'hex')", in_flight)
}

/// [`claim_sql_skipping`] over the shards of `mask`, an SQL expression of the claim's shard mask
/// (`bytea`: bit `n % 8` of byte `n / 8` set for shard `n`).
pub fn claim_sql_of(batch: usize, mask: &str, in_flight: &str) -> String {
    let config = RelayConfig::new("postgres://unused");
    seaorm_outbox_relay::POSTGRES_CLAIM_SQL
        .replace("$1", mask)
        .replace("$2", &batch.to_string())
        .replace("$3", "true")
        .replace("$4", &config.max_payload_bytes.to_string())
        .replace("$5", &config.max_batch_bytes.to_string())
        .replace("$6", in_flight)
}

/// Prepares the relay's claim as `claim` in `txn` with the relay's session settings, as the relay
/// runs it: a prepared statement, planned once. Run it with `EXECUTE claim(...)` and
/// [`claim_args`].
pub async fn prepare_claim(txn: &DatabaseTransaction) {
    txn.execute_unprepared(seaorm_outbox_relay::POSTGRES_SESSION_SQL)
        .await
        .unwrap();
    txn.execute_unprepared(&format!(
        "PREPARE claim(bytea, int8, bool, int8, int8, int8[]) AS {}",
        seaorm_outbox_relay::POSTGRES_CLAIM_SQL
    ))
    .await
    .unwrap();
}

/// The arguments of `EXECUTE claim(...)` ([`prepare_claim`]): every shard, `batch` rows, parked
/// aggregates held back, the relay's default byte limits, the `seq`s in flight.
pub fn claim_args(batch: usize, in_flight: &[i64]) -> String {
    let config = RelayConfig::new("postgres://unused");
    let seqs: Vec<String> = in_flight.iter().map(i64::to_string).collect();
    format!(
        "(decode(repeat('ff', 32), 'hex'), {batch}, true, {}, {}, '{{{}}}')",
        config.max_payload_bytes,
        config.max_batch_bytes,
        seqs.join(",")
    )
}

/// The lines of `EXPLAIN query` run in `txn`.
pub async fn explain_in(txn: &DatabaseTransaction, query: &str) -> String {
    let plan: Vec<String> = txn
        .query_all_raw(Statement::from_string(
            DbBackend::Postgres,
            format!("EXPLAIN {query}"),
        ))
        .await
        .unwrap()
        .iter()
        .map(|row| row.try_get_by_index::<String>(0).unwrap())
        .collect();
    plan.join("\n")
}

/// Runs a relay over the fixture publishing to `sink` until `done` resolves, then stops it.
pub async fn run_relay_until(
    f: &Fixture,
    sink: impl seaorm_outbox_relay::sink::Sink + 'static,
    done: impl std::future::Future<Output = ()>,
) {
    let relay = seaorm_outbox_relay::Relay::new(f.relay_config(), sink);
    let shutdown = tokio_util::sync::CancellationToken::new();
    let running = tokio::spawn({
        let shutdown = shutdown.clone();
        async move { relay.run(shutdown).await.expect("the relay refused to run") }
    });
    done.await;
    shutdown.cancel();
    running.await.unwrap();
}

/// Rows the relay wrote anything to (published, parked or counted a failed attempt).
pub const TOUCHED: &str = "SELECT count(*) FROM outbox \
     WHERE published_at IS NOT NULL OR parked_at IS NOT NULL OR attempts > 0";
