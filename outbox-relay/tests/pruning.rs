//! Pruning deletes published rows past the retention window in small batches, and the claim query
//! stays on the partial index however large the table grows.

mod common;

use common::Fixture;
use seaorm_outbox::sea_orm::{ConnectionTrait, TransactionTrait};
use std::time::Duration;

async fn fill(f: &Fixture, published_days_ago: i32, count: i32) {
    f.db.execute_unprepared(&format!(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, published_at)
         SELECT gen_random_uuid(), 'log', 'l-' || (g % 50), 'Logged', '{{}}', now() - interval '{published_days_ago} days'
         FROM generate_series(1, {count}) g"
    ))
    .await
    .unwrap();
}

#[tokio::test]
async fn prune_deletes_only_published_rows_past_retention() {
    let f = Fixture::new().await;
    fill(&f, 8, 3500).await; // past a 7-day retention: 4 batches of at most 1000
    fill(&f, 1, 20).await; // within it
    f.db.execute_unprepared(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, created_at)
         VALUES (gen_random_uuid(), 'log', 'old-but-unpublished', 'Logged', '{}', now() - interval '30 days')",
    )
    .await
    .unwrap();

    let deleted = seaorm_outbox_relay::prune(
        &f.url,
        &seaorm_outbox::TableName::DEFAULT,
        Duration::from_secs(7 * 86400),
    )
    .await
    .unwrap();
    assert_eq!(deleted, 3500);
    assert_eq!(f.scalar("SELECT count(*) FROM outbox").await, 21);
    assert_eq!(
        f.scalar("SELECT count(*) FROM outbox WHERE published_at IS NULL")
            .await,
        1
    );
}

#[tokio::test]
async fn the_running_relay_prunes_on_its_timer() {
    let f = Fixture::new().await;
    fill(&f, 2, 1500).await;
    let mut relay = f.spawn_relay(&[
        "--sink",
        "stdout",
        "--retention",
        "1d",
        "--prune-interval",
        "100ms",
    ]);
    f.wait_until_zero("SELECT count(*) FROM outbox", Duration::from_secs(30))
        .await;
    assert_eq!(common::terminate(&mut relay), Some(0));
}

/// The claim's plan, as the relay's session plans it.
async fn claim_plan(f: &Fixture) -> String {
    let plan: Vec<String> = common::explain_claim(f, "COSTS ON", 500).await;
    plan.join("\n")
}

fn assert_walks_the_partial_index(plan: &str) {
    assert!(
        plan.contains("Index Scan using outbox_claimable on outbox o"),
        "{plan}"
    );
    assert!(
        plan.contains("Index Scan using outbox_retrying on outbox"),
        "the due retries are walked through their index:\n{plan}"
    );
    assert!(
        plan.contains("outbox_blocked"),
        "the blocked-aggregate check uses its index:\n{plan}"
    );
    // The one sort allowed orders the claimed rows of the two walks (at most a batch) by `seq`.
    assert!(
        !plan.contains("Seq Scan")
            && plan.matches("Sort  (").count() == plan.matches("Sort Key: w.seq").count(),
        "{plan}"
    );
}

#[tokio::test]
async fn the_claim_uses_the_partial_index_on_a_large_table() {
    let f = Fixture::new().await;
    fill(&f, 1, 200_000).await;
    f.db.execute_unprepared(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
         SELECT gen_random_uuid(), 'log', 'l-' || g, 'Logged', '{}' FROM generate_series(1, 50) g;
         ANALYZE outbox",
    )
    .await
    .unwrap();
    assert_walks_the_partial_index(&claim_plan(&f).await);
}

/// A young table that grew fast: autovacuum has not analyzed it yet, so the planner thinks it is
/// nearly empty. The claim must still walk the index and stop at the batch size, not fetch and
/// sort the whole backlog.
#[tokio::test]
async fn the_claim_uses_the_partial_index_before_the_table_was_ever_analyzed() {
    let f = Fixture::new().await;
    f.db.execute_unprepared(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
         SELECT gen_random_uuid(), 'log', 'l-' || (g % 1000), 'Logged', '{}' FROM generate_series(1, 50000) g",
    )
    .await
    .unwrap();
    assert_walks_the_partial_index(&claim_plan(&f).await);
}

/// The relay prepares the claim once per connection and, with its session settings, plans it once
/// (a generic plan): a plan made while the table was empty must still walk the partial index once
/// the table is full.
#[tokio::test]
async fn a_claim_prepared_on_an_empty_table_stays_cheap_when_it_fills() {
    let f = Fixture::new().await;
    let txn = f.db.begin().await.unwrap();
    common::prepare_claim(&txn).await;
    let execute = format!("EXECUTE claim{}", common::claim_args(500, &[]));
    for _ in 0..6 {
        txn.execute_unprepared(&execute).await.unwrap();
    }
    txn.execute_unprepared(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
         SELECT gen_random_uuid(), 'log', 'l-' || (g % 1000), 'Logged', '{}' FROM generate_series(1, 30000) g",
    )
    .await
    .unwrap();
    let plan = common::explain_in(&txn, &execute).await;
    txn.rollback().await.unwrap();
    assert_walks_the_partial_index(&plan);
}
