//! The WAL source's fixture: a schema of its own, and a slot and publication named after it.

use super::{Fixture, KillOnDrop};
use seaorm_outbox_relay::wal::WalSource;
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

    /// Waits until the slot exists (the relay creates it at start).
    pub async fn wait_for_slot(&self) {
        let sql = format!(
            "SELECT CASE WHEN count(*) > 0 THEN 0 ELSE 1 END::bigint FROM pg_replication_slots WHERE slot_name = '{}'",
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

    /// Drops the slot and publication once no relay reads them (the test's relays are stopped).
    pub async fn drop_slot(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.slot_active().await {
            assert!(
                Instant::now() < deadline,
                "the slot is still read by a relay"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        seaorm_outbox_relay::wal::drop_source(&self.f.url, &self.source)
            .await
            .expect("drop the slot");
    }
}
