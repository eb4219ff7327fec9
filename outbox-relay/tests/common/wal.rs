//! The WAL source's fixture: a schema of its own, and a slot and publication named after it.

use super::kafka::consume;
use super::meters::{Writer, assert_complete_and_ordered};
use super::{Fixture, KillOnDrop, relay_command, services, terminate, wait_for_exit};
use seaorm_outbox::OutboxEvent;
use seaorm_outbox_relay::wal::WalSource;
use std::process::{ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

/// A [`Fixture`] whose relays read the WAL through a slot and publication of its own.
pub struct WalFixture {
    pub f: Fixture,
    pub source: WalSource,
}

impl WalFixture {
    pub async fn new() -> WalFixture {
        let f = Fixture::new().await;
        let name = format!("s_{}", &f.prefix[1..]);
        let source = WalSource::new(name.clone(), name).expect("a plain name");
        WalFixture { f, source }
    }

    /// The flags that make `outbox-relay run` read this fixture's slot.
    pub fn flags(&self) -> Vec<String> {
        [
            "--source",
            "wal",
            "--wal-slot",
            &self.source.slot,
            "--wal-publication",
            &self.source.publication,
        ]
        .map(str::to_owned)
        .to_vec()
    }

    /// Starts the relay binary on the WAL source, publishing to Kafka.
    pub fn spawn_relay(&self, extra: &[&str]) -> KillOnDrop {
        let mut args: Vec<String> = self.flags();
        args.extend(extra.iter().map(|s| (*s).to_owned()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        self.f.spawn_relay(&args)
    }

    /// Waits until the relay has created the slot (at start). A slot being created is listed
    /// before it has a confirmed position (while it waits for running transactions): events
    /// committed until then are not in its stream, so this waits for the position.
    pub async fn wait_for_slot(&self) {
        let sql = format!(
            "SELECT CASE WHEN count(*) > 0 THEN 0 ELSE 1 END::bigint FROM pg_replication_slots
             WHERE slot_name = '{}' AND confirmed_flush_lsn IS NOT NULL",
            self.source.slot
        );
        self.f.wait_until_zero(&sql, Duration::from_secs(30)).await;
    }

    /// Whether a relay reads the slot now.
    pub async fn slot_active(&self) -> bool {
        self.f
            .scalar(&format!(
                "SELECT count(*) FROM pg_replication_slots WHERE slot_name = '{}' AND active",
                self.source.slot
            ))
            .await
            > 0
    }

    /// Waits until the slot has confirmed everything written up to now.
    pub async fn wait_until_confirmed(&self, timeout: Duration) {
        let target = self
            .f
            .scalar("SELECT (pg_current_wal_lsn() - '0/0')::bigint")
            .await;
        self.wait_until_confirmed_past(target, timeout).await;
    }

    /// Waits until the slot's confirmed position is at or past `lsn` (bytes from 0/0).
    pub async fn wait_until_confirmed_past(&self, lsn: i64, timeout: Duration) {
        let sql = format!(
            "SELECT CASE WHEN (confirmed_flush_lsn - '0/0')::bigint >= {lsn} THEN 0 ELSE 1 END::bigint
             FROM pg_replication_slots WHERE slot_name = '{}'",
            self.source.slot
        );
        self.f.wait_until_zero(&sql, timeout).await;
    }

    /// The end of every fault test: stops `writer`, waits until the slot confirmed everything,
    /// stops `relay` (exit code 0), checks that a consumer got every reading of the `meters`
    /// meters with each meter's first deliveries in order, and drops the slot. Returns how many
    /// deliveries were duplicates.
    pub async fn finish(&self, writer: Writer, relay: &mut KillOnDrop, meters: u64) -> usize {
        let total = writer.finish().await;
        self.wait_until_confirmed(Duration::from_secs(180)).await;
        assert_eq!(terminate(relay), Some(0), "the relay exits 0 on SIGTERM");
        let received = consume(
            &[&self.f.topic("meter")],
            total as usize,
            Duration::from_secs(120),
        )
        .await;
        let duplicates = assert_complete_and_ordered(&received, total, meters);
        eprintln!("{total} readings, {duplicates} duplicates");
        self.drop_slot().await;
        duplicates
    }

    /// Waits until the server has sent the relay reading the slot everything written so far,
    /// or sends no more for a second (the relay stopped reading: its window is full).
    pub async fn wait_until_the_stream_stops(&self) {
        let of_the_slot = format!(
            "FROM pg_stat_replication r JOIN pg_replication_slots s ON s.active_pid = r.pid
             WHERE s.slot_name = '{}'",
            self.source.slot
        );
        let unsent = format!("SELECT (pg_current_wal_lsn() - r.sent_lsn)::bigint {of_the_slot}");
        let sent = format!("SELECT (r.sent_lsn - '0/0')::bigint {of_the_slot}");
        let deadline = Instant::now() + Duration::from_secs(60);
        let (mut last, mut since) = (-1, Instant::now());
        while self.f.scalar(&unsent).await > 0 {
            let now_sent = self.f.scalar(&sent).await;
            if now_sent != last {
                (last, since) = (now_sent, Instant::now());
            } else if since.elapsed() >= Duration::from_secs(1) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the stream still moves after 60 s"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits until a relay reads the slot (its signal handlers are installed by then).
    pub async fn wait_until_reading(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !self.slot_active().await {
            assert!(Instant::now() < deadline, "nobody reads the slot");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until no relay reads the slot (the test's relays are stopped).
    pub async fn wait_until_unread(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.slot_active().await {
            assert!(
                Instant::now() < deadline,
                "the slot is still read by a relay"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Drops the slot and publication once no relay reads them (the test's relays are stopped).
    pub async fn drop_slot(&self) {
        self.wait_until_unread().await;
        seaorm_outbox_relay::wal::drop_source(&self.f.url, &self.source, true)
            .await
            .expect("drop the slot");
    }

    /// Runs `outbox-relay run` on this fixture's WAL source, expecting it to refuse: its exit
    /// status and stderr. Fails the test if it still runs after 30 s.
    pub fn run_refused(&self) -> (ExitStatus, String) {
        let mut relay = relay_command()
            .args(["run", "--database-url", &self.f.url])
            .args([
                "--kafka-brokers",
                &super::kafka::brokers(),
                "--http-addr",
                "off",
            ])
            .args(self.flags())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        wait_for_exit(&mut relay, Duration::from_secs(30), "the WAL relay ran")
    }

    /// `outbox-relay wal drop` of this fixture's slot and publication.
    pub fn wal_drop(&self, force: bool) -> Output {
        let mut command = relay_command();
        command
            .args(["wal", "drop", "--database-url", &self.f.url])
            .args(["--slot", &self.source.slot])
            .args(["--publication", &self.source.publication]);
        if force {
            command.arg("--force");
        }
        command.output().unwrap()
    }

    /// Runs `outbox-relay failed ...` on the fixture's database; returns what it printed.
    pub fn failed(&self, args: &[&str]) -> String {
        let output = relay_command()
            .arg("failed")
            .args(args)
            .args(["--database-url", &self.f.url])
            .output()
            .unwrap();
        assert!(output.status.success(), "{output:?}");
        String::from_utf8_lossy(&output.stdout).into_owned()
    }

    /// What `outbox-relay status` prints for this fixture's database.
    pub fn status(&self) -> String {
        let status = relay_command()
            .args(["status", "--database-url", &self.f.url])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&status.stdout).into_owned();
        assert!(status.status.success(), "{text}");
        text
    }
}

/// How long the broker stays away in the long-outage tests: past the producer's
/// `message.timeout.ms` (30 s), so librdkafka times out what it holds and a producer could deliver
/// a later event of an aggregate after an earlier one timed out.
pub const PAST_THE_PRODUCERS_TIMEOUT: Duration = Duration::from_secs(45);

/// The broker stopped (SIGSTOP) for [`PAST_THE_PRODUCERS_TIMEOUT`] while writers keep recording
/// readings of 20 meters with `reading` (rows or table-less, as the process records): every
/// reading arrives, each meter's first deliveries in recording order.
pub async fn the_broker_away_past_the_producers_timeout<E>(
    w: &WalFixture,
    reading: fn(String, u64) -> E,
) where
    E: OutboxEvent + Send + Sync + 'static,
{
    let mut relay = w.spawn_relay(&[]);
    w.wait_for_slot().await;
    let writer = Writer::start(&w.f, 20, Duration::from_millis(5), reading);
    tokio::time::sleep(Duration::from_secs(2)).await;
    services("pause-kafka");
    tokio::time::sleep(PAST_THE_PRODUCERS_TIMEOUT).await;
    services("resume-kafka");
    assert!(
        relay.try_wait().unwrap().is_none(),
        "the relay exited while the broker was away"
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    w.finish(writer, &mut relay, 20).await;
}
