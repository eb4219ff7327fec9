//! The claim costs about one batch, whatever the planner's statistics say: measured in buffers
//! (pages touched), which do not depend on the machine's speed, after the trap that once made it
//! scan the whole backlog for every claimed row: a table analyzed while everything was published,
//! then a burst of new rows.

mod common;

use common::Fixture;
use seaorm_outbox::sea_orm::{ConnectionTrait, TransactionTrait};

/// The shared buffers (hit or read) the claim of `batch` rows touches, with the relay's session
/// settings, over all shards, holding back parked aggregates.
async fn claim_buffers(f: &Fixture, batch: usize) -> i64 {
    buffers(f, &common::claim_sql(batch), batch).await
}

/// The shared buffers `claim` touches; it must return `batch` rows.
async fn buffers(f: &Fixture, claim: &str, batch: usize) -> i64 {
    let plan: Vec<serde_json::Value> =
        common::explain(f, "ANALYZE, BUFFERS, FORMAT JSON", claim).await;
    let top = &plan[0][0]["Plan"];
    let rows = top["Actual Rows"].as_i64().unwrap();
    assert_eq!(
        rows, batch as i64,
        "the claim returns a full batch: {plan:?}"
    );
    top["Shared Hit Blocks"].as_i64().unwrap() + top["Shared Read Blocks"].as_i64().unwrap()
}

/// The line after the claim's scan of `outbox_unpublished` in an `EXPLAIN`: its filter.
fn unpublished_scan_filter(plan: &str) -> &str {
    plan.lines()
        .skip_while(|line| !line.contains("Index Scan using outbox_unpublished"))
        .nth(1)
        .unwrap_or_default()
}

#[tokio::test]
async fn a_claim_after_a_burst_costs_one_batch_not_the_backlog() {
    let f = Fixture::new().await;
    // Statistics taken while every row was published, then a burst.
    f.db.execute_unprepared(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, published_at)
         SELECT gen_random_uuid(), 'order', 'o-' || (g % 500), 'E', jsonb_build_object('n', g), now()
         FROM generate_series(1, 2000) g;
         ANALYZE outbox;
         INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
         SELECT gen_random_uuid(), 'order', 'o-' || (g % 500), 'E', jsonb_build_object('n', g)
         FROM generate_series(1, 14000) g;",
    )
    .await
    .unwrap();
    let after_burst = claim_buffers(&f, 500).await;

    // The same claim once statistics are fresh: the cost a good plan has.
    f.db.execute_unprepared("ANALYZE outbox").await.unwrap();
    let analyzed = claim_buffers(&f, 500).await;
    eprintln!("claim of 500 rows: {after_burst} buffers after the burst, {analyzed} analyzed");
    // A good plan touches a few pages per claimed row (index, heap, lock); scanning the backlog
    // per row touched 120,000 and more.
    assert!(
        after_burst <= 2 * analyzed.max(1000),
        "after the burst the claim touched {after_burst} buffers, against {analyzed} when analyzed"
    );
    assert!(after_burst < 10 * 500, "{after_burst} buffers for 500 rows");
}

/// The relay claims the next batch while the broker answers for the one in flight, skipping its
/// rows: that claim costs about one batch too, not one per skipped row and claimed row together.
#[tokio::test]
async fn a_claim_that_skips_the_batch_in_flight_costs_about_one_batch() {
    let f = Fixture::new().await;
    f.db.execute_unprepared(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
         SELECT gen_random_uuid(), 'order', 'o-' || (g % 500), 'E', jsonb_build_object('n', g)
         FROM generate_series(1, 20000) g;
         ANALYZE outbox;",
    )
    .await
    .unwrap();
    let alone = claim_buffers(&f, 1000).await;
    let in_flight = "ARRAY(SELECT seq FROM outbox ORDER BY seq LIMIT 1000)";
    let skipping = buffers(&f, &common::claim_sql_skipping(1000, in_flight), 1000).await;
    // The rows the skipping claim returns are the next thousand.
    let first_claimed = f
        .scalar(&format!(
            "SELECT min(seq) FROM ({}) c",
            common::claim_sql_skipping(1000, in_flight)
        ))
        .await;
    let expected = f
        .scalar("SELECT seq FROM outbox ORDER BY seq OFFSET 1000 LIMIT 1")
        .await;
    assert_eq!(
        first_claimed, expected,
        "the claim starts after the batch in flight"
    );
    eprintln!("claim of 1000 rows: {alone} buffers alone, {skipping} with 1000 in flight");
    assert!(
        skipping <= 2 * alone + 1000,
        "skipping the batch in flight cost {skipping} buffers, against {alone} without"
    );
}

/// Skipping the batch in flight costs one hash lookup per row, whatever the batch size. The relay
/// plans its claim once (a generic plan), in which `seq <> ALL($6)` compared every row with every
/// `seq` of the parameter: a million comparisons, and 20-70 ms, for a claim of 1,000 rows behind
/// 1,000 in flight.
#[tokio::test]
async fn the_claim_skips_the_batch_in_flight_by_hash_lookup() {
    let f = Fixture::new().await;
    f.db.execute_unprepared(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
         SELECT gen_random_uuid(), 'order', 'o-' || (g % 500), 'E', '{}' FROM generate_series(1, 3000) g",
    )
    .await
    .unwrap();
    let first = f.scalar("SELECT min(seq) FROM outbox").await;
    let in_flight: Vec<i64> = (first..first + 1000).collect();
    let txn = f.db.begin().await.unwrap();
    common::prepare_claim(&txn).await;
    let execute = format!("EXECUTE claim{}", common::claim_args(1000, &in_flight));
    let plan = common::explain_in(&txn, &execute).await;
    txn.rollback().await.unwrap();
    let scan = unpublished_scan_filter(&plan);
    assert!(
        scan.contains("Filter:") && scan.contains("hashed SubPlan"),
        "the skip is a hash lookup on the scan of outbox_unpublished:\n{plan}"
    );
}

/// With a broker away for long, many aggregates wait behind a parked or backing-off event while
/// their rows pile up ahead of the free ones. The claim walks those rows to reach the free ones,
/// and each walked row's aggregate must be one hash lookup in the blocked set: compared with every
/// blocked aggregate instead, 10,000 of them with 1M rows made one claim take 9 minutes.
#[tokio::test]
async fn the_claim_looks_up_blocked_aggregates_by_hash_not_one_by_one() {
    let f = Fixture::new().await;
    // 1,000 aggregates parked at their first event, 10 more events each, then the free ones.
    f.db.execute_unprepared(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
         SELECT gen_random_uuid(), 'order', 'blocked-' || (g % 1000), 'E', '{}'
         FROM generate_series(0, 10999) g;
         UPDATE outbox SET parked_at = now(), attempts = 1, last_error = 'poison'
         WHERE seq < (SELECT min(seq) + 1000 FROM outbox);
         INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
         SELECT gen_random_uuid(), 'order', 'free-' || (g % 100), 'E', '{}'
         FROM generate_series(1, 1000) g;
         ANALYZE outbox;",
    )
    .await
    .unwrap();
    let txn = f.db.begin().await.unwrap();
    common::prepare_claim(&txn).await;
    let execute = format!("EXECUTE claim{}", common::claim_args(500, &[]));
    let plan = common::explain_in(&txn, &execute).await;
    let claimed: Vec<String> = txn
        .query_all_raw(seaorm_outbox::sea_orm::Statement::from_string(
            seaorm_outbox::sea_orm::DbBackend::Postgres,
            execute,
        ))
        .await
        .unwrap()
        .iter()
        .map(|row| row.try_get::<String>("", "aggregate_id").unwrap())
        .collect();
    txn.rollback().await.unwrap();
    assert_eq!(claimed.len(), 500, "a full batch of the free aggregates");
    assert!(
        claimed.iter().all(|id| id.starts_with("free-")),
        "only free aggregates are claimed: {claimed:?}"
    );
    let scan = unpublished_scan_filter(&plan);
    assert!(
        scan.contains("Filter:") && scan.matches("hashed SubPlan").count() == 2,
        "the batch in flight and the blocked aggregates are hash lookups on the scan of \
         outbox_unpublished:\n{plan}"
    );
    assert!(
        !plan.contains("Anti Join"),
        "no join compares the walked rows with the blocked aggregates:\n{plan}"
    );
}
