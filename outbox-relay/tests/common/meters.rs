//! Meter readings, the workload of the fault tests: writers record readings of a few meters, one
//! transaction each, and a consumer checks that every reading arrived with each meter's first
//! deliveries in recording order.

use super::Fixture;
use super::kafka::Received;
use seaorm_outbox::OutboxEvent;
use seaorm_outbox::sea_orm::TransactionTrait;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Reading `n` of a meter: the fault tests' event, keyed by its meter.
#[derive(Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate = "meter", key = "meter")]
pub struct Reading {
    pub meter: String,
    pub n: u64,
}

/// Reading `n` of `meter`, as [`Writer::start`] makes them.
pub fn reading(meter: String, n: u64) -> Reading {
    Reading { meter, n }
}

/// The readings of `meter` received, in order.
pub fn readings_of(received: &[Received], meter: &str) -> Vec<u64> {
    received
        .iter()
        .filter(|m| m.key == meter)
        .map(|m| m.json()["n"].as_u64().unwrap())
        .collect()
}

/// Records readings of `meters` meters until stopped, one transaction per reading: reading `n` is
/// meter `m-{n % meters}`'s, made by `reading(meter, n)`. A transaction that fails (the database
/// restarting) is tried again; only committed readings count.
pub struct Writer {
    stop: Arc<AtomicBool>,
    committed: Arc<Mutex<u64>>,
    task: tokio::task::JoinHandle<()>,
}

impl Writer {
    pub fn start<E>(
        f: &Fixture,
        meters: u64,
        pause: Duration,
        reading: fn(String, u64) -> E,
    ) -> Writer
    where
        E: OutboxEvent + Send + Sync + 'static,
    {
        let stop = Arc::new(AtomicBool::new(false));
        let committed = Arc::new(Mutex::new(0));
        let task = tokio::spawn({
            let (db, stop, committed) = (f.db.clone(), stop.clone(), committed.clone());
            async move {
                let mut n = 0;
                while !stop.load(Ordering::Relaxed) {
                    let event = reading(format!("m-{}", n % meters), n);
                    let attempt = async {
                        let txn = db.begin().await?;
                        event
                            .record(&txn)
                            .await
                            .map_err(|e| seaorm_outbox::sea_orm::DbErr::Custom(e.to_string()))?;
                        txn.commit().await
                    };
                    if attempt.await.is_ok() {
                        n += 1;
                        *committed.lock().unwrap() = n;
                    }
                    tokio::time::sleep(pause).await;
                }
            }
        });
        Writer {
            stop,
            committed,
            task,
        }
    }

    /// Stops writing; returns how many readings committed.
    pub async fn finish(self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.unwrap();
        *self.committed.lock().unwrap()
    }
}

/// Readings 0..total of `meters` meters, as the writers record them.
pub fn readings(total: u64, meters: u64) -> BTreeMap<String, Vec<u64>> {
    let mut expected: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    for n in 0..total {
        expected
            .entry(format!("m-{}", n % meters))
            .or_default()
            .push(n);
    }
    expected
}

/// Every reading 0..total of `meters` meters arrived (its `n` in the payload), each meter's first
/// deliveries in order. Returns how many deliveries were duplicates.
pub fn assert_complete_and_ordered(received: &[Received], total: u64, meters: u64) -> usize {
    let arrived = received
        .iter()
        .map(|m| (m.key.clone(), m.json()["n"].as_u64().unwrap()));
    super::assert_complete_and_ordered(arrived, &readings(total, meters))
}

/// Inserts readings 0..total of `meters` meters into the fixture's outbox at once, in order.
pub async fn insert_readings(f: &Fixture, total: u64, meters: u64) {
    use seaorm_outbox::sea_orm::ConnectionTrait;
    f.db.execute_unprepared(&format!(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
         SELECT gen_random_uuid(), 'meter', 'm-' || (g % {meters}), 'Reading',
                jsonb_build_object('meter', 'm-' || (g % {meters}), 'n', g)
         FROM generate_series(0, {}) g ORDER BY g",
        total - 1
    ))
    .await
    .unwrap();
}

/// Drains the fixture's outbox through relays started by `spawn`: ten are killed (SIGKILL) at
/// moments they did not choose, each once it published about `step` more events than the one
/// before; an eleventh drains the rest and stops cleanly.
pub async fn drain_through_ten_kills(
    f: &Fixture,
    step: i64,
    spawn: impl Fn() -> super::KillOnDrop,
) {
    let published = "SELECT count(*) FROM outbox WHERE published_at IS NOT NULL";
    for kill in 0..10 {
        let mut relay = spawn();
        let target = f.scalar(published).await + step + kill * (step / 8);
        f.wait_until_zero(
            &format!(
                "SELECT CASE WHEN count(*) >= {target} THEN 0 ELSE 1 END::bigint FROM outbox
                 WHERE published_at IS NOT NULL"
            ),
            Duration::from_secs(60),
        )
        .await;
        super::signal(&relay, "KILL");
        relay.wait().unwrap();
    }
    eprintln!("{} events left after ten kills", f.backlog().await);
    let mut relay = spawn();
    f.wait_until_drained(Duration::from_secs(120)).await;
    assert_eq!(super::terminate(&mut relay), Some(0));
}
