//! The claim holds the rows of the aggregates that wait, and they go free when their blocker
//! goes, on SQLite and MariaDB (where the relay holds the rows its claim returns as blocked);
//! PostgreSQL's claim holds them itself (`tests/claim_cost.rs`).

use super::{Connection, OutboxTable};
use crate::batch::{Limits, Outcome};
use crate::config::Mode;
use crate::row::RowKey;
use seaorm_outbox::TableName;

/// The outbox table of a migrated database at `url`, and a timestamp literal of its backend.
async fn migrated(url: &str) -> (OutboxTable, &'static str) {
    let mut table = OutboxTable::connect(url, &TableName::DEFAULT)
        .await
        .unwrap();
    let (backend, timestamp) = match &table.conn {
        Connection::Sqlite(_) => (
            seaorm_outbox::sea_orm::DbBackend::Sqlite,
            "'2026-01-01T00:00:00.000Z'",
        ),
        Connection::MySql(_) => (
            seaorm_outbox::sea_orm::DbBackend::MySql,
            "'2026-01-01 00:00:00'",
        ),
        Connection::Postgres(_) => unreachable!("PostgreSQL's claim holds rows itself"),
    };
    for step in seaorm_outbox::schema::STEPS {
        execute(&mut table, step.up(backend).unwrap()).await;
    }
    (table, timestamp)
}

/// 100 aggregates parked at their first event with 10 more events each, then 200 events of 20
/// free aggregates, in a migrated database at `url`.
async fn blocked_table(url: &str) -> OutboxTable {
    let (mut table, parked_at) = migrated(url).await;
    let mut sql = Vec::new();
    let rows = |prefix: &str, count: usize, aggregates: usize| {
        let values: Vec<String> = (0..count)
            .map(|n| {
                format!(
                    "('{prefix}{n}', 'order', '{prefix}-{}', 'E', '{{}}')",
                    n % aggregates
                )
            })
            .collect();
        format!(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) VALUES {};",
            values.join(", ")
        )
    };
    sql.push(rows("blocked", 1_100, 100));
    sql.push(format!(
        "UPDATE outbox SET parked_at = {parked_at}, attempts = 1 WHERE seq <= 100;"
    ));
    sql.push(rows("free", 200, 20));
    for statement in sql {
        execute(&mut table, &statement).await;
    }
    table
}

async fn execute(table: &mut OutboxTable, sql: &str) -> u64 {
    let query = sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned()));
    let done = match &mut table.conn {
        Connection::Sqlite(conn) => query.execute(conn).await.map(|r| r.rows_affected()),
        Connection::MySql(conn) => query.execute(conn).await.map(|r| r.rows_affected()),
        Connection::Postgres(_) => unreachable!(),
    };
    done.unwrap_or_else(|e| panic!("{sql}: {e}"))
}

async fn count(table: &mut OutboxTable, sql: &str) -> i64 {
    let query = sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()));
    let counted = match &mut table.conn {
        Connection::Sqlite(conn) => query.fetch_one(conn).await,
        Connection::MySql(conn) => {
            sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                "SELECT CAST(({sql}) AS SIGNED)"
            )))
            .fetch_one(conn)
            .await
        }
        Connection::Postgres(_) => unreachable!(),
    };
    counted.unwrap_or_else(|e| panic!("{sql}: {e}"))
}

const EVERY_SHARD: [i16; 256] = {
    let mut shards = [0; 256];
    let mut n = 0;
    while n < 256 {
        shards[n] = n as i16;
        n += 1;
    }
    shards
};

const LIMITS: Limits = Limits {
    batch_size: 50,
    max_batch_bytes: 1 << 20,
    max_payload_bytes: 1 << 20,
};

/// The claim walks at most a batch of claimable rows and of due retries; it holds the waiting
/// rows it meets, so the claims after go past them: each claim costs one batch however many rows
/// wait.
async fn the_claim_holds_the_rows_of_blocked_aggregates_and_goes_past_them(url: &str) {
    let mut table = blocked_table(url).await;
    // 1,000 waiting rows, held 50 a claim: 20 claims find no event to send.
    let mut holding = 0;
    let claim = loop {
        let claim = table.claim(&LIMITS, &EVERY_SHARD, true, &[]).await.unwrap();
        if !claim.rows.is_empty() {
            break claim;
        }
        assert!(claim.full, "a claim that only held rows asks for the next");
        holding += 1;
        assert!(
            holding <= 20,
            "each claim holds a batch of the waiting rows"
        );
    };
    assert_eq!(holding, 20, "each claim holds a batch of the waiting rows");
    assert_eq!(
        claim.rows.len(),
        50,
        "then a full batch of the free aggregates"
    );
    assert!(
        claim
            .rows
            .iter()
            .all(|r| r.aggregate_id.starts_with("free-")),
        "only free aggregates are claimed"
    );
    let held = "SELECT count(*) FROM outbox WHERE held_at IS NOT NULL";
    assert_eq!(
        count(&mut table, held).await,
        1_000,
        "every waiting row is held"
    );
    let held_free = format!("{held} AND aggregate_id LIKE 'free-%'");
    assert_eq!(
        count(&mut table, &held_free).await,
        0,
        "no free row is held"
    );
    assert_eq!(table.backlog().await.unwrap().held, 1_000);
}

/// A held row goes back to the claim when its aggregate's blocker goes: in the transaction that
/// publishes a retried blocker, or by the sweep once nothing earlier of its aggregate blocks it.
async fn held_rows_are_released_when_their_blocker_goes(url: &str) {
    let mut table = blocked_table(url).await;
    for _ in 0..20 {
        table.claim(&LIMITS, &EVERY_SHARD, true, &[]).await.unwrap();
    }
    let all_held = "SELECT count(*) FROM outbox WHERE held_at IS NOT NULL";
    assert_eq!(count(&mut table, all_held).await, 1_000);
    // blocked-0's parked event, published by the relay after a retry.
    let blocker = count(
        &mut table,
        "SELECT seq FROM outbox WHERE aggregate_id = 'blocked-0' AND parked_at IS NOT NULL",
    )
    .await;
    let key = RowKey {
        id: "blocked0".to_owned(),
        seq: blocker,
        position: blocker,
    };
    let outcome = Outcome {
        published: vec![key.clone()],
        ..Outcome::default()
    };
    table.settle(&outcome, Mode::Mark, &[key]).await.unwrap();
    let held_of = |aggregate: &str| format!("{all_held} AND aggregate_id = '{aggregate}'");
    assert_eq!(count(&mut table, &held_of("blocked-0")).await, 0);
    assert_eq!(count(&mut table, &held_of("blocked-1")).await, 10);

    // blocked-1's parked event skipped outside the relay: the sweep releases its rows. blocked-2's
    // too, and its sixth held row backs off: the five before it go free, and it too (nothing
    // earlier blocks it), the four after it stay held.
    execute(
        &mut table,
        "UPDATE outbox SET published_at = created_at
         WHERE aggregate_id IN ('blocked-1', 'blocked-2') AND parked_at IS NOT NULL",
    )
    .await;
    let sixth = count(
        &mut table,
        "SELECT seq FROM outbox WHERE aggregate_id = 'blocked-2' AND held_at IS NOT NULL
         ORDER BY seq LIMIT 1 OFFSET 5",
    )
    .await;
    let backs_off = format!("UPDATE outbox SET retry_at = created_at WHERE seq = {sixth}");
    execute(&mut table, &backs_off).await;
    assert_eq!(
        table.release_unblocked(&EVERY_SHARD, true).await.unwrap(),
        16
    );
    assert_eq!(count(&mut table, &held_of("blocked-1")).await, 0);
    assert_eq!(count(&mut table, &held_of("blocked-2")).await, 4);
    assert_eq!(count(&mut table, all_held).await, 974);
    // With parked aggregates no longer held back, the sweep releases the rest but those four.
    assert_eq!(
        table.release_unblocked(&EVERY_SHARD, false).await.unwrap(),
        970
    );
    assert_eq!(count(&mut table, &held_of("blocked-2")).await, 4);
}

/// A row held past its blocker (an operator's `failed skip` committed while a claim held rows
/// behind the event it skipped) still holds its aggregate: a later event of it is held too, never
/// claimed ahead of it, until the sweep releases both; then they go out in order.
async fn a_row_held_past_its_blocker_holds_its_aggregates_later_rows(url: &str) {
    let (mut table, now) = migrated(url).await;
    execute(
        &mut table,
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
         VALUES ('a1', 'order', 'a', 'E', '{}'), ('a2', 'order', 'a', 'E', '{}'),
                ('a3', 'order', 'a', 'E', '{}'), ('b1', 'order', 'b', 'E', '{}')",
    )
    .await;
    // a1 skipped, a2 held behind it by a claim that read a1 still parked.
    execute(
        &mut table,
        &format!("UPDATE outbox SET published_at = {now} WHERE id = 'a1'"),
    )
    .await;
    execute(
        &mut table,
        &format!("UPDATE outbox SET held_at = {now} WHERE id = 'a2'"),
    )
    .await;
    async fn claimed_ids(table: &mut OutboxTable) -> Vec<String> {
        let claim = table.claim(&LIMITS, &EVERY_SHARD, true, &[]).await.unwrap();
        claim.rows.into_iter().map(|r| r.id).collect()
    }
    assert_eq!(claimed_ids(&mut table).await, ["b1"]);
    let held = "SELECT count(*) FROM outbox WHERE held_at IS NOT NULL AND id IN ('a2', 'a3')";
    assert_eq!(count(&mut table, held).await, 2, "a3 is held behind a2");
    assert_eq!(
        table.release_unblocked(&EVERY_SHARD, true).await.unwrap(),
        2
    );
    // Nothing was settled: b1 is claimed again.
    assert_eq!(claimed_ids(&mut table).await, ["a2", "a3", "b1"]);
}

fn sqlite_url() -> String {
    let file = outbox_tests::temp_dir().join("holding.db");
    format!("sqlite://{}?mode=rwc", file.display())
}

#[tokio::test]
async fn on_sqlite_the_claim_holds_the_rows_of_blocked_aggregates_and_goes_past_them() {
    the_claim_holds_the_rows_of_blocked_aggregates_and_goes_past_them(&sqlite_url()).await;
}

#[tokio::test]
async fn on_sqlite_held_rows_are_released_when_their_blocker_goes() {
    held_rows_are_released_when_their_blocker_goes(&sqlite_url()).await;
}

#[tokio::test]
async fn on_sqlite_a_row_held_past_its_blocker_holds_its_aggregates_later_rows() {
    a_row_held_past_its_blocker_holds_its_aggregates_later_rows(&sqlite_url()).await;
}

#[tokio::test]
async fn on_mariadb_a_row_held_past_its_blocker_holds_its_aggregates_later_rows() {
    let url = outbox_tests::mariadb_database_url().await;
    a_row_held_past_its_blocker_holds_its_aggregates_later_rows(&url).await;
}

#[tokio::test]
async fn on_mariadb_the_claim_holds_the_rows_of_blocked_aggregates_and_goes_past_them() {
    let url = outbox_tests::mariadb_database_url().await;
    the_claim_holds_the_rows_of_blocked_aggregates_and_goes_past_them(&url).await;
}

#[tokio::test]
async fn on_mariadb_held_rows_are_released_when_their_blocker_goes() {
    let url = outbox_tests::mariadb_database_url().await;
    held_rows_are_released_when_their_blocker_goes(&url).await;
}

/// SQLite's claim walks its partial indexes and probes `outbox_blocked` and `outbox_held` per row.
#[tokio::test]
async fn on_sqlite_the_claim_walks_its_indexes() {
    use sqlx::Row as _;
    let mut table = blocked_table(&sqlite_url()).await;
    let Connection::Sqlite(conn) = &mut table.conn else {
        unreachable!()
    };
    let explain = format!("EXPLAIN QUERY PLAN {}", super::sqlite::SQLITE_CLAIM);
    let plan = sqlx::query(sqlx::AssertSqlSafe(explain))
        .bind(50)
        .bind(true)
        .bind(1 << 20)
        .bind(1 << 20)
        .bind("[]")
        .fetch_all(conn)
        .await
        .unwrap();
    let plan: Vec<String> = plan.iter().map(|row| row.get("detail")).collect();
    let plan = plan.join("\n");
    for index in [
        "USING INDEX outbox_claimable",
        "USING INDEX outbox_retrying",
        "USING INDEX outbox_blocked",
        "USING INDEX outbox_held",
    ] {
        assert!(plan.contains(index), "{index}:\n{plan}");
    }
}

/// MariaDB's releases read indexes, not the table: the sweep a range of `outbox_unpublished` (the
/// held rows), the settle's release `outbox_waiting` by aggregate; even with statistics taken
/// while no row waited, by which the table looked cheaper to read whole.
#[tokio::test]
async fn on_mariadb_the_releases_read_indexes_not_the_table() {
    use sqlx::Row as _;
    let url = outbox_tests::mariadb_database_url().await;
    let mut table = blocked_table(&url).await;
    execute(&mut table, "UPDATE outbox SET parked_at = NULL").await;
    let digits = "(SELECT 0 AS n UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 \
                  UNION ALL SELECT 4 UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 \
                  UNION ALL SELECT 8 UNION ALL SELECT 9)";
    let more = format!(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
         SELECT UUID(), 'order', CONCAT('more-', a.n), 'E', '{{}}'
         FROM {digits} a, {digits} b, {digits} c, {digits} d, {digits} e"
    );
    execute(&mut table, &more).await;
    execute(&mut table, "ANALYZE TABLE outbox").await;
    let Connection::MySql(conn) = &mut table.conn else {
        unreachable!()
    };
    let sweep = format!("EXPLAIN {}", super::mysql::RELEASE_UNBLOCKED);
    let sweep = sqlx::query(sqlx::AssertSqlSafe(sweep))
        .bind(true)
        .bind(vec![0xffu8; 32])
        .fetch_all(&mut *conn)
        .await
        .unwrap();
    let release = format!("EXPLAIN {}", super::mysql::RELEASE_HELD);
    let release = sqlx::query(sqlx::AssertSqlSafe(release))
        .bind("[1, 2, 3]")
        .fetch_all(&mut *conn)
        .await
        .unwrap();
    for (plan, index) in [(sweep, "outbox_unpublished"), (release, "outbox_waiting")] {
        let plan: Vec<(Option<String>, Option<String>, Option<String>)> = plan
            .iter()
            .map(|r| (r.get("table"), r.get("type"), r.get("key")))
            .collect();
        let updated = plan
            .iter()
            .find(|(table, _, _)| table.as_deref() == Some("o"))
            .unwrap_or_else(|| panic!("{plan:?}"));
        assert_eq!(updated.2.as_deref(), Some(index), "{plan:?}");
        assert_ne!(updated.1.as_deref(), Some("ALL"), "{plan:?}");
    }
}
