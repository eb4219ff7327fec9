//! Several `outbox-relay` processes against one database: every event delivered, none twice while
//! nothing crashes, every aggregate's events in order; after a `kill -9`, nothing lost and the
//! order of first deliveries kept. And the claim reads exactly the shards a replica leases.

mod common;

use common::Fixture;
use common::kafka::{Received, consume};
use seaorm_outbox::OutboxEvent;
use seaorm_outbox::sea_orm::{ConnectionTrait, DbBackend, Statement, TransactionTrait};
use serde::Serialize;
use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

const AGGREGATES: usize = 500;
const ROUNDS: usize = 40; // 500 aggregates x 40 = 20,000 events
const BATCH: usize = 200;

#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate = "account", key = "account")]
struct Step {
    account: String,
    n: usize,
}

/// Four writers, each owning every fourth aggregate, record one event per aggregate per round,
/// 50 to a transaction: each aggregate's `n` rises in commit order.
async fn write_all(f: &Fixture) {
    let writers = (0..4).map(|w| {
        let db = f.db.clone();
        tokio::spawn(async move {
            let mine: Vec<usize> = (0..AGGREGATES).filter(|a| a % 4 == w).collect();
            for n in 0..ROUNDS {
                for chunk in mine.chunks(50) {
                    let events: Vec<Step> = chunk
                        .iter()
                        .map(|a| Step {
                            account: format!("acct-{a}"),
                            n,
                        })
                        .collect();
                    let txn = db.begin().await.unwrap();
                    seaorm_outbox::record_all(&txn, &events).await.unwrap();
                    txn.commit().await.unwrap();
                }
            }
        })
    });
    for writer in futures::future::join_all(writers).await {
        writer.unwrap();
    }
}

/// How many shard leases each relay session holds, for this fixture's outbox table.
async fn lease_holders(f: &Fixture) -> Vec<i64> {
    let rows = f
        .db
        .query_all_raw(Statement::from_string(
            DbBackend::Postgres,
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 2 \
               AND classid = hashtext('outbox-relay:' || 'outbox'::regclass::oid::text)::oid AND objid < 256 \
             GROUP BY pid ORDER BY 1",
        ))
        .await
        .unwrap();
    rows.iter()
        .map(|r| r.try_get_by_index::<i64>(0).unwrap())
        .collect()
}

async fn wait_for_holders(f: &Fixture, replicas: usize) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let holders = lease_holders(f).await;
        if holders.len() == replicas && holders.iter().sum::<i64>() == 256 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "shards never spread over {replicas} replicas: {holders:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Per aggregate, the `n` of each delivery in the order received.
fn deliveries(received: &[Received]) -> HashMap<String, Vec<usize>> {
    let mut by_key: HashMap<String, Vec<usize>> = HashMap::new();
    for m in received {
        let n = m.json()["n"].as_u64().expect("n") as usize;
        by_key.entry(m.key.clone()).or_default().push(n);
    }
    by_key
}

/// What a consumer of the fixture's topic received, once every event arrived (checked).
async fn every_event_received(f: &Fixture) -> Vec<Received> {
    let total = AGGREGATES * ROUNDS;
    let received = consume(&[&f.topic("account")], total, Duration::from_secs(120)).await;
    let ids: HashSet<&str> = received.iter().map(|m| m.header("id").unwrap()).collect();
    assert_eq!(ids.len(), total, "every event delivered");
    received
}

fn stop_all(relays: &mut [common::KillOnDrop]) {
    for relay in relays {
        assert_eq!(
            common::terminate(relay),
            Some(0),
            "the relay exits 0 on SIGTERM"
        );
    }
}

#[tokio::test]
async fn three_replicas_deliver_every_event_once_in_order() {
    let f = Fixture::new().await;
    let batch = BATCH.to_string();
    let mut relays: Vec<common::KillOnDrop> = (0..3)
        .map(|_| f.spawn_relay(&["--batch-size", &batch]))
        .collect();
    wait_for_holders(&f, 3).await;
    // Each replica holds the joining flag (space, 512) until it has its share (86, 86 and the 84
    // left), and while one does the others count every membership slot at each refresh.
    f.wait_until_zero(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2 AND objid = 512 \
           AND classid = hashtext('outbox-relay:' || 'outbox'::regclass::oid::text)::oid",
        Duration::from_secs(30),
    )
    .await;

    write_all(&f).await;
    f.wait_until_drained(Duration::from_secs(120)).await;
    stop_all(&mut relays);

    let total = AGGREGATES * ROUNDS;
    let received = every_event_received(&f).await;
    assert_eq!(received.len(), total, "no event delivered twice");
    let expected: Vec<usize> = (0..ROUNDS).collect();
    let by_key = deliveries(&received);
    assert_eq!(by_key.len(), AGGREGATES);
    for (key, ns) in &by_key {
        assert_eq!(ns, &expected, "events of {key} out of order");
    }
}

#[tokio::test]
async fn a_replica_killed_mid_run_loses_nothing_and_keeps_first_delivery_order() {
    let f = Fixture::new().await;
    let batch = BATCH.to_string();
    let mut relays: Vec<common::KillOnDrop> = (0..3)
        .map(|_| f.spawn_relay(&["--batch-size", &batch]))
        .collect();
    wait_for_holders(&f, 3).await;

    let writing = tokio::spawn({
        let f = f.clone();
        async move { write_all(&f).await }
    });
    // Kill one replica once a quarter of the events are out, while the others keep going.
    f.wait_until_zero(
        &format!(
            "SELECT greatest(0, {} - count(*)) FROM outbox WHERE published_at IS NOT NULL",
            AGGREGATES * ROUNDS / 4
        ),
        Duration::from_secs(120),
    )
    .await;
    let mut killed = relays.remove(0);
    common::signal(&killed, "KILL");
    killed.wait().unwrap();
    let killed_at = Instant::now();
    wait_for_holders(&f, 2).await;
    eprintln!(
        "the surviving replicas took over all 256 shards {:?} after the kill",
        killed_at.elapsed()
    );

    writing.await.unwrap();
    f.wait_until_drained(Duration::from_secs(120)).await;
    stop_all(&mut relays);

    let received = every_event_received(&f).await;
    let expected: std::collections::BTreeMap<String, Vec<String>> = (0..AGGREGATES)
        .map(|a| {
            let events = (0..ROUNDS).map(|n| format!("acct-{a}:{n}")).collect();
            (format!("acct-{a}"), events)
        })
        .collect();
    let arrived = received.iter().map(|m| {
        let n = m.json()["n"].as_u64().expect("n");
        (m.key.clone(), format!("{}:{n}", m.key))
    });
    let duplicates = common::assert_complete_and_ordered(arrived, &expected);
    eprintln!("{duplicates} duplicates after the kill");
    // At most two of the killed replica's batches were unsettled: one being settled, one in
    // flight (docs/design.md, "Pipelining").
    assert!(
        duplicates <= 2 * BATCH,
        "{duplicates} duplicates: more than the killed replica's two unsettled batches"
    );
}

/// Replicas joining while one drains a backlog: shards move from the draining replica to the new
/// ones while its batches are in flight, yet no event is delivered twice (a lease moves only
/// between the owner's batches, after it settled them) and each aggregate's events stay in order.
#[tokio::test]
async fn replicas_joining_mid_drain_take_shards_without_duplicates() {
    let f = Fixture::new().await;
    write_all(&f).await;
    let total = (AGGREGATES * ROUNDS) as i64;
    // Answers that take 100 ms keep every batch in flight that long (a lease that moved with a
    // batch in flight would let the new owner claim its rows), and make the drain last long
    // enough for the others to join in its middle.
    let slow = ["--batch-size", "100", "--kafka-option", "linger.ms=100"];
    let mut relays = vec![f.spawn_relay(&slow)];
    let published_at_least = |n: i64| {
        format!("SELECT greatest(0, {n} - count(*)) FROM outbox WHERE published_at IS NOT NULL")
    };
    f.wait_until_zero(&published_at_least(total / 10), Duration::from_secs(60))
        .await;
    relays.push(f.spawn_relay(&slow));
    wait_for_holders(&f, 2).await;
    let left_at_second = f.backlog().await;
    relays.push(f.spawn_relay(&slow));
    wait_for_holders(&f, 3).await;
    let left_at_third = f.backlog().await;
    eprintln!("{left_at_second} then {left_at_third} of {total} events left when replicas joined");
    assert!(
        left_at_third > 0,
        "the backlog was drained before the third replica joined: the test saw no rebalance"
    );
    f.wait_until_drained(Duration::from_secs(120)).await;
    stop_all(&mut relays);

    let received = every_event_received(&f).await;
    assert_eq!(
        received.len(),
        total as usize,
        "no event delivered twice while shards moved"
    );
    let expected: Vec<usize> = (0..ROUNDS).collect();
    for (key, ns) in &deliveries(&received) {
        assert_eq!(ns, &expected, "events of {key} out of order");
    }
}

/// The relay hands its claim the shards it leases as a 256-bit mask (bit `n % 8` of byte `n / 8`
/// for shard `n`, which the relay's unit test pins): the claim returns the rows of exactly those
/// shards, and every one of them.
#[tokio::test]
async fn the_claim_reads_exactly_the_shards_of_its_mask() {
    let f = Fixture::new().await;
    f.db.execute_unprepared(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
         SELECT gen_random_uuid(), 'account', 'a-' || g, 'Step', '{}' FROM generate_series(1, 4000) g",
    )
    .await
    .unwrap();
    let shards: [usize; 6] = [0, 7, 8, 9, 130, 255];
    let mut mask = [0u8; 32];
    for n in shards {
        mask[n / 8] |= 1 << (n % 8);
    }
    let hex: String = mask.iter().map(|b| format!("{b:02x}")).collect();
    let seqs = |sql: String| {
        let db = f.db.clone();
        async move {
            let rows = db
                .query_all_raw(Statement::from_string(DbBackend::Postgres, sql))
                .await
                .unwrap();
            rows.iter()
                .map(|row| row.try_get::<i64>("", "seq").unwrap())
                .collect::<Vec<i64>>()
        }
    };
    let list = shards.map(|n| n.to_string()).join(",");
    let expected = seqs(format!(
        "SELECT seq FROM outbox WHERE shard IN ({list}) ORDER BY seq"
    ))
    .await;
    assert!(expected.len() > 30, "the fixture has rows in those shards");
    let claimed = seqs(common::claim_sql_of(
        4000,
        &format!("decode('{hex}', 'hex')"),
        "'{}'::int8[]",
    ))
    .await;
    assert_eq!(claimed, expected);
}
