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

/// Runs the claim `sql` on `conn`: `column` of each claimed event (not of the row that only
/// carries `candidates` when the claim held rows and claimed none).
async fn claimed<T>(conn: &impl ConnectionTrait, sql: &str, column: &str) -> Vec<T>
where
    Option<T>: seaorm_outbox::sea_orm::TryGetable,
{
    conn.query_all_raw(seaorm_outbox::sea_orm::Statement::from_string(
        seaorm_outbox::sea_orm::DbBackend::Postgres,
        sql,
    ))
    .await
    .unwrap()
    .iter()
    .filter_map(|row| row.try_get::<Option<T>>("", column).unwrap())
    .collect()
}

/// The line after the claim's walk of `outbox_claimable` in an `EXPLAIN`: its filter.
fn claimable_scan_filter(plan: &str) -> &str {
    plan.lines()
        .skip_while(|line| !line.contains("Index Scan using outbox_claimable"))
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
    // The rows the skipping claim returns are the next thousand (the claim writes, when it holds
    // rows: it cannot be a subquery).
    let first_claimed = claimed::<i64>(&f.db, &common::claim_sql_skipping(1000, in_flight), "seq")
        .await
        .into_iter()
        .min()
        .unwrap();
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
    let scan = claimable_scan_filter(&plan);
    assert!(
        scan.contains("Filter:") && scan.contains("hashed SubPlan"),
        "the skip is a hash lookup on the walk of outbox_claimable:\n{plan}"
    );
}

/// With a broker away for long, many aggregates wait behind a parked or backing-off event while
/// their rows pile up ahead of the free ones. Each claim walks at most a batch of rows: the waiting
/// rows it meets it holds (`held_at`), which takes them out of the index it walks, so the claims
/// after them go past them and cost one batch, whatever waits. Before, every claim walked every
/// waiting row (a third of a second per million) and, earlier still, compared each with every
/// blocked aggregate (10,000 of them with 1M rows made one claim take 9 minutes).
#[tokio::test]
async fn the_claim_holds_the_rows_of_blocked_aggregates_and_goes_past_them() {
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
    let claim = || claimed::<String>(&txn, &execute, "aggregate_id");
    // 10,000 waiting rows, held 500 a claim: 20 claims find no event to send.
    let mut holding = 0;
    let claimed = loop {
        let claimed = claim().await;
        if !claimed.is_empty() {
            break claimed;
        }
        holding += 1;
        assert!(
            holding <= 20,
            "each claim holds a batch of the waiting rows"
        );
    };
    assert_eq!(holding, 20, "each claim holds a batch of the waiting rows");
    assert_eq!(
        claimed.len(),
        500,
        "then a full batch of the free aggregates"
    );
    assert!(
        claimed.iter().all(|id| id.starts_with("free-")),
        "only free aggregates are claimed: {claimed:?}"
    );
    let held: Vec<i64> = txn
        .query_all_raw(seaorm_outbox::sea_orm::Statement::from_string(
            seaorm_outbox::sea_orm::DbBackend::Postgres,
            "SELECT count(*) FILTER (WHERE held_at IS NOT NULL AND aggregate_id LIKE 'blocked-%'),
                    count(*) FILTER (WHERE held_at IS NOT NULL AND aggregate_id LIKE 'free-%')
             FROM outbox",
        ))
        .await
        .unwrap()
        .iter()
        .flat_map(|row| {
            [
                row.try_get_by_index::<i64>(0).unwrap(),
                row.try_get_by_index::<i64>(1).unwrap(),
            ]
        })
        .collect();
    assert_eq!(held, [10_000, 0], "every waiting row is held, no free one");
    // Past them, a claim touches the pages of one batch.
    let analyzed: serde_json::Value = txn
        .query_one_raw(seaorm_outbox::sea_orm::Statement::from_string(
            seaorm_outbox::sea_orm::DbBackend::Postgres,
            format!("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {execute}"),
        ))
        .await
        .unwrap()
        .expect("a plan")
        .try_get_by_index(0)
        .unwrap();
    txn.rollback().await.unwrap();
    let top = &analyzed[0]["Plan"];
    assert_eq!(top["Actual Rows"].as_i64(), Some(500), "{analyzed}");
    let buffers =
        top["Shared Hit Blocks"].as_i64().unwrap() + top["Shared Read Blocks"].as_i64().unwrap();
    assert!(buffers < 10 * 500, "{buffers} buffers for 500 rows");

    let scan = claimable_scan_filter(&plan);
    assert!(
        scan.contains("Filter:") && scan.contains("hashed SubPlan"),
        "the batch in flight is a hash lookup on the walk of outbox_claimable:\n{plan}"
    );
    assert!(
        plan.contains("Index Scan using outbox_blocked")
            && plan.contains("Index Scan using outbox_held")
            && !plan.contains("Anti Join"),
        "each walked row's aggregate is one probe of outbox_blocked and one of outbox_held, \
         not a join:\n{plan}"
    );
}

/// An aggregate waits behind an event backing off until that event is published, due or not: a
/// due one may be in flight (its retry sent, not settled yet). An event of that aggregate recorded
/// meanwhile is held, never claimed ahead of the ones held before it; the due event itself is
/// claimed, before any of them.
#[tokio::test]
async fn a_row_behind_a_due_retry_is_held_even_while_the_retry_is_in_flight() {
    let f = Fixture::new().await;
    f.db.execute_unprepared(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
         SELECT gen_random_uuid(), 'order', 'a', 'E', jsonb_build_object('n', g)
         FROM generate_series(1, 3) g;
         UPDATE outbox SET attempts = 1, retry_at = now() - interval '1 second'
         WHERE payload->>'n' = '1';
         UPDATE outbox SET held_at = now() WHERE payload->>'n' = '2';",
    )
    .await
    .unwrap();
    let claimed_behind = |in_flight: &'static str| {
        let sql = common::claim_sql_skipping(10, in_flight);
        let db = &f.db;
        async move { claimed::<i64>(db, &sql, "seq").await }
    };
    let first = f
        .scalar("SELECT seq FROM outbox WHERE payload->>'n' = '1'")
        .await;
    let third = f
        .scalar("SELECT seq FROM outbox WHERE payload->>'n' = '3'")
        .await;
    // The retry in flight: the third event must wait, and is held.
    assert_eq!(
        claimed_behind("ARRAY(SELECT seq FROM outbox WHERE payload->>'n' = '1')").await,
        Vec::<i64>::new()
    );
    assert_eq!(
        f.scalar(&format!(
            "SELECT count(*) FROM outbox WHERE seq = {third} AND held_at IS NOT NULL"
        ))
        .await,
        1,
        "the event recorded behind the due retry is held"
    );
    // Not in flight: the due retry alone is claimed.
    assert_eq!(claimed_behind("'{}'::int8[]").await, [first]);
}

/// A row held past its blocker (an operator's `failed skip` committed while a claim held rows
/// behind the event it skipped) still holds its aggregate: a later event of it is held too, never
/// claimed ahead of it, until the sweep releases both; then they go out in order.
#[tokio::test]
async fn a_row_held_past_its_blocker_holds_its_aggregates_later_rows() {
    let f = Fixture::new().await;
    f.db.execute_unprepared(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
         SELECT gen_random_uuid(), 'order', v.aggregate, 'E', jsonb_build_object('n', v.n)
         FROM (VALUES (1, 'a'), (2, 'a'), (3, 'a'), (4, 'b')) AS v(n, aggregate) ORDER BY v.n;
         -- The first skipped, the second held behind it by a claim that read it still parked.
         UPDATE outbox SET published_at = now() WHERE payload->>'n' = '1';
         UPDATE outbox SET held_at = now() WHERE payload->>'n' = '2';",
    )
    .await
    .unwrap();
    let claimed_n = || async {
        claimed::<String>(&f.db, &common::claim_sql(10), "payload")
            .await
            .iter()
            .map(|payload| {
                let payload: serde_json::Value = serde_json::from_str(payload).unwrap();
                payload["n"].as_i64().unwrap()
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(claimed_n().await, [4]);
    assert_eq!(
        f.scalar(
            "SELECT count(*) FROM outbox WHERE held_at IS NOT NULL AND payload->>'n' IN ('2', '3')"
        )
        .await,
        2,
        "the third event is held behind the second"
    );
    // The sweep's release, which finds nothing blocking either; nothing was settled, so the
    // fourth event is claimed again.
    f.db.execute_unprepared("UPDATE outbox SET held_at = NULL")
        .await
        .unwrap();
    assert_eq!(claimed_n().await, [2, 3, 4]);
}
