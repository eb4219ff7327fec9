//! The partitioned layout (`migrate --partitioned`): recording, the claim and the operator
//! commands as on the plain table; partitions made ahead; retention drops whole partitions whose
//! events are all published, never one holding an unpublished or parked event; a `kill -9` during
//! a drain that spans a partition boundary loses nothing.

mod common;

use common::{Fixture, relay_command};
use seaorm_outbox::sea_orm::ConnectionTrait;
use seaorm_outbox::{OutboxEvent as _, TableName, Uuid};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// A fresh schema whose outbox table `outbox-relay migrate --partitioned 1h` made.
async fn partitioned_fixture() -> Fixture {
    let (db, schema) = outbox_tests::postgres_schema().await;
    let url = outbox_tests::schema_url(&schema);
    let migrated = relay_command()
        .args(["migrate", "--partitioned", "1h", "--database-url", &url])
        .output()
        .unwrap();
    assert!(
        migrated.status.success(),
        "{}",
        String::from_utf8_lossy(&migrated.stderr)
    );
    let prefix = format!("t{}", Uuid::now_v7().simple());
    Fixture {
        db,
        url,
        template: format!("{prefix}.{{aggregate_type}}"),
        prefix,
    }
}

#[derive(serde::Serialize, seaorm_outbox::OutboxEvent)]
#[outbox(aggregate = "order", key = "order_id")]
struct OrderPlaced {
    order_id: u64,
}

async fn execute(f: &Fixture, sql: &str) {
    f.db.execute_unprepared(sql)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

/// The outbox's partitions of intervals, by how many hours from the current one each starts.
async fn partitions(f: &Fixture) -> Vec<i64> {
    let rows =
        f.db.query_all_raw(seaorm_outbox::sea_orm::Statement::from_string(
            seaorm_outbox::sea_orm::DbBackend::Postgres,
            "SELECT (extract(epoch FROM (regexp_match(pg_get_expr(c.relpartbound, c.oid),
                                          'FROM \\(''([^'']*)''\\)'))[1]::timestamptz
                                  - date_trunc('hour', now())) / 3600)::int8
             FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
             WHERE i.inhparent = 'outbox'::regclass AND c.relpartbound IS NOT NULL
               AND pg_get_expr(c.relpartbound, c.oid) <> 'DEFAULT'
             ORDER BY 1",
        ))
        .await
        .unwrap();
    rows.iter()
        .map(|row| row.try_get_by_index::<i64>(0).unwrap())
        .collect()
}

async fn exists(f: &Fixture, table: &str) -> bool {
    f.scalar(&format!(
        "SELECT (to_regclass('{table}') IS NOT NULL)::int::int8"
    ))
    .await
        == 1
}

#[tokio::test]
async fn migrate_partitioned_makes_the_hours_ahead_and_events_are_recorded_into_them() {
    let f = partitioned_fixture().await;
    assert_eq!(
        partitions(&f).await,
        [0, 1, 2, 3],
        "this hour and three ahead"
    );
    assert!(exists(&f, "outbox_default").await);

    // Migrating again changes nothing; the plain layout's steps are all applied.
    let again = relay_command()
        .args(["migrate", "--partitioned", "1h", "--database-url", &f.url])
        .output()
        .unwrap();
    assert!(
        again.status.success(),
        "{}",
        String::from_utf8_lossy(&again.stderr)
    );
    assert_eq!(partitions(&f).await, [0, 1, 2, 3]);
    assert_eq!(
        f.scalar("SELECT count(*) FROM pg_indexes WHERE schemaname = current_schema() AND tablename = 'outbox' AND indexname = 'outbox_claimable'")
            .await,
        1
    );

    // `record` goes into this hour's partition.
    let txn = seaorm_outbox::sea_orm::TransactionTrait::begin(&f.db)
        .await
        .unwrap();
    OrderPlaced { order_id: 1 }.record(&txn).await.unwrap();
    txn.commit().await.unwrap();
    let partition =
        f.db.query_one_raw(seaorm_outbox::sea_orm::Statement::from_string(
            seaorm_outbox::sea_orm::DbBackend::Postgres,
            "SELECT tableoid::regclass::text FROM outbox",
        ))
        .await
        .unwrap()
        .unwrap()
        .try_get_by_index::<String>(0)
        .unwrap();
    assert!(
        partition.starts_with("outbox_p"),
        "recorded into {partition}"
    );
    assert!(!partition.ends_with("default"));

    // A plain table is not converted: one line, and the table as it was.
    let plain = Fixture::new().await;
    let refused = relay_command()
        .args([
            "migrate",
            "--partitioned",
            "1h",
            "--database-url",
            &plain.url,
        ])
        .output()
        .unwrap();
    assert_eq!(refused.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("exists and is not partitioned"), "{stderr}");
    assert!(!exists(&plain, "outbox_default").await);
}

#[tokio::test]
async fn the_running_relay_makes_partitions_ahead_as_time_passes() {
    let f = partitioned_fixture().await;
    // As if the hours made at migrate had passed: only the newest is left, and recording of the
    // current hour goes to the default partition until the relay makes its partition.
    for hour in 0..3 {
        execute(
            &f,
            &format!(
                "DO $$ DECLARE p regclass; BEGIN
                   SELECT c.oid::regclass INTO p FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
                   WHERE i.inhparent = 'outbox'::regclass AND pg_get_expr(c.relpartbound, c.oid) LIKE
                     '%' || to_char(date_trunc('hour', now()) + interval '{hour} hours', 'YYYY-MM-DD HH24') || '%TO%';
                   EXECUTE format('DROP TABLE %s', p);
                 END $$"
            ),
        )
        .await;
    }
    assert_eq!(partitions(&f).await, [3]);
    let mut relay = f.spawn_relay_to(&["--sink", "stdout"], &["--prune-interval", "100ms"]);
    let deadline = Instant::now() + Duration::from_secs(30);
    while partitions(&f).await != [0, 1, 2, 3] {
        assert!(
            Instant::now() < deadline,
            "partitions {:?} after 30 s; relay log:\n{}",
            partitions(&f).await,
            relay.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(common::terminate(&mut relay), Some(0));
}

/// What `outbox-relay status` prints of the fixture's outbox.
fn status(f: &Fixture) -> String {
    let output = relay_command()
        .args(["status", "--database-url", &f.url])
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).unwrap()
}

/// `count` rows of aggregate `aggregate` created ten minutes into the hour `hours_ago` hours
/// before this one (negative: ahead), `published` a day ago or not.
async fn insert(f: &Fixture, aggregate: &str, hours_ago: i32, count: i32, published: bool) {
    let published_at = if published {
        "now() - interval '1 day'"
    } else {
        "NULL"
    };
    execute(
        f,
        &format!(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, created_at, published_at)
             SELECT gen_random_uuid(), 'log', '{aggregate}', 'Logged', jsonb_build_object('n', g),
                    date_trunc('hour', now()) - interval '{hours_ago} hours' + interval '10 minutes',
                    {published_at}
             FROM generate_series(1, {count}) g"
        ),
    )
    .await;
}

#[tokio::test]
async fn retention_drops_published_partitions_and_keeps_one_with_a_parked_event_until_it_goes() {
    let f = partitioned_fixture().await;
    // Two partitions of hours long past, as the relay would have made them then.
    for hours_ago in [5, 4] {
        execute(
            &f,
            &format!(
                "CREATE TABLE outbox_old{hours_ago} PARTITION OF outbox FOR VALUES
                 FROM (date_trunc('hour', now()) - interval '{hours_ago} hours')
                 TO (date_trunc('hour', now()) - interval '{hours_ago} hours' + interval '1 hour')"
            ),
        )
        .await;
    }
    insert(&f, "done", 5, 300, true).await;
    insert(&f, "done", 4, 200, true).await;
    // A poison event of four hours ago, parked; its aggregate's next event recorded this hour.
    insert(&f, "stuck", 4, 1, false).await;
    execute(
        &f,
        "UPDATE outbox SET parked_at = now(), attempts = 1, last_error = 'poison'
         WHERE aggregate_id = 'stuck'",
    )
    .await;
    insert(&f, "stuck", 0, 1, false).await;
    // Recorded while no partition of its hour existed: in the default partition.
    insert(&f, "early", 10, 40, true).await;
    assert_eq!(f.scalar("SELECT count(*) FROM outbox_default").await, 40);

    assert!(
        status(&f).contains("partitions:         6, from "),
        "{}",
        status(&f)
    );
    assert!(status(&f).contains("; 40 events in the default partition"));

    let retention = Duration::from_secs(3600);
    let table = TableName::DEFAULT;
    let deleted = seaorm_outbox_relay::prune(&f.url, &table, retention)
        .await
        .unwrap();
    assert_eq!(deleted, 40, "the default partition is pruned row by row");
    assert!(!exists(&f, "outbox_old5").await, "all published: dropped");
    assert!(exists(&f, "outbox_old4").await, "a parked event: kept");
    assert_eq!(f.scalar("SELECT count(*) FROM outbox_old4").await, 201);
    let after = status(&f);
    assert!(after.contains("partitions:         5, from "), "{after}");
    assert!(
        after.contains("; 0 events in the default partition"),
        "{after}"
    );
    assert!(after.contains("parked:             1 events"), "{after}");

    // Retried, the parked event goes out first, then its aggregate's event of this hour.
    let retried = relay_command()
        .args([
            "failed",
            "retry",
            "--aggregate",
            "log:stuck",
            "--database-url",
            &f.url,
        ])
        .output()
        .unwrap();
    assert!(
        retried.status.success(),
        "{}",
        String::from_utf8_lossy(&retried.stderr)
    );
    let mut relay = f.spawn_relay(&[]);
    f.wait_until_drained(Duration::from_secs(60)).await;
    assert_eq!(common::terminate(&mut relay), Some(0));
    let received = common::kafka::consume(&[&f.topic("log")], 2, Duration::from_secs(30)).await;
    let stuck: Vec<u64> = received
        .iter()
        .filter(|m| m.key == "stuck")
        .map(|m| m.json()["n"].as_u64().unwrap())
        .collect();
    assert_eq!(stuck.len(), 2, "both of the aggregate's events: {stuck:?}");
    let order: Vec<String> = received
        .iter()
        .filter(|m| m.key == "stuck")
        .map(|m| m.header("id").unwrap().to_owned())
        .collect();
    let ids_by_seq =
        f.db.query_all_raw(seaorm_outbox::sea_orm::Statement::from_string(
            seaorm_outbox::sea_orm::DbBackend::Postgres,
            "SELECT id::text FROM outbox WHERE aggregate_id = 'stuck' ORDER BY seq",
        ))
        .await
        .unwrap()
        .iter()
        .map(|row| row.try_get_by_index::<String>(0).unwrap())
        .collect::<Vec<_>>();
    assert_eq!(
        order, ids_by_seq,
        "the parked event first, across partitions"
    );

    // Now everything there is published (this test's published_at is recent: a day's retention
    // would keep it, an hour's drops only the partition whose hour ended an hour ago).
    seaorm_outbox_relay::prune(&f.url, &table, retention)
        .await
        .unwrap();
    assert!(!exists(&f, "outbox_old4").await, "published now: dropped");
    assert!(
        f.scalar("SELECT count(*) FROM outbox WHERE aggregate_id = 'stuck'")
            .await
            == 1,
        "this hour's partition is within retention"
    );
}

const AGGREGATES: usize = 50;
const PER_AGGREGATE: usize = 200;

#[tokio::test]
async fn kill_9_during_a_drain_across_a_partition_boundary_loses_nothing() {
    let f = partitioned_fixture().await;
    // Each aggregate's first half in this hour's partition, its second in the next hour's.
    for (round, hour) in [(0, 0), (1, 1)] {
        execute(
            &f,
            &format!(
                "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, created_at)
                 SELECT gen_random_uuid(), 'acct', 'acct-' || (g % {AGGREGATES}), 'Moved',
                        jsonb_build_object('n', {round} * {half} + g / {AGGREGATES}),
                        date_trunc('hour', now()) + interval '{hour} hours' + interval '59 minutes'
                 FROM generate_series(0, {half} * {AGGREGATES} - 1) g ORDER BY g",
                half = PER_AGGREGATE / 2,
            ),
        )
        .await;
    }
    assert_eq!(
        f.scalar("SELECT count(DISTINCT tableoid) FROM outbox")
            .await,
        2,
        "the events span two partitions"
    );
    let total = (AGGREGATES * PER_AGGREGATE) as i64;
    for kill in 0..5 {
        let mut relay = f.spawn_relay(&["--batch-size", "100"]);
        // Let it publish a little more, then kill it mid-drain.
        let published = f
            .scalar("SELECT count(*) FROM outbox WHERE published_at IS NOT NULL")
            .await;
        let target = (published + total / 8).min(total - 1);
        f.wait_until_zero(
            &format!(
                "SELECT greatest(0, {target} - count(*)) FROM outbox WHERE published_at IS NOT NULL"
            ),
            Duration::from_secs(60),
        )
        .await;
        common::signal(&relay, "KILL");
        relay.wait().unwrap();
        eprintln!("kill {kill}: {target} or more published");
    }
    let mut relay = f.spawn_relay(&[]);
    f.wait_until_drained(Duration::from_secs(120)).await;
    assert_eq!(common::terminate(&mut relay), Some(0));

    let received =
        common::kafka::consume(&[&f.topic("acct")], total as usize, Duration::from_secs(60)).await;
    let expected: BTreeMap<String, Vec<String>> = (0..AGGREGATES)
        .map(|a| {
            let events = (0..PER_AGGREGATE)
                .map(|n| format!("acct-{a}:{n}"))
                .collect();
            (format!("acct-{a}"), events)
        })
        .collect();
    let arrived = received.iter().map(|m| {
        let n = m.json()["n"].as_u64().unwrap();
        (m.key.clone(), format!("{}:{n}", m.key))
    });
    let duplicates = common::assert_complete_and_ordered(arrived, &expected);
    eprintln!("{duplicates} duplicates after 5 kills");
}

#[tokio::test]
async fn the_claim_walks_each_partitions_claimable_index_whatever_the_published_history() {
    let f = partitioned_fixture().await;
    execute(
        &f,
        "CREATE TABLE outbox_old PARTITION OF outbox FOR VALUES
         FROM (date_trunc('hour', now()) - interval '3 hours') TO (date_trunc('hour', now()))",
    )
    .await;
    // 200,000 published events of hours past, then a backlog over this hour and the next.
    insert(&f, "history", 2, 200_000, true).await;
    for hour in [0, -1] {
        insert(&f, "backlog", hour, 7_000, false).await;
    }
    execute(&f, "ANALYZE outbox").await;
    let plan: Vec<serde_json::Value> =
        common::explain(&f, "ANALYZE, BUFFERS, FORMAT JSON", &common::claim_sql(500)).await;
    let top = &plan[0][0]["Plan"];
    assert_eq!(top["Actual Rows"].as_i64(), Some(500), "{plan:?}");
    // Each partition's index in seq order, merged: no scan, no sort of the backlog.
    let text = plan[0].to_string();
    assert!(
        !text.contains("Seq Scan"),
        "a sequential scan: {text:.3000}"
    );
    assert!(
        text.contains("Merge Append"),
        "no merge of the partitions' indexes: {text:.3000}"
    );
    let buffers =
        top["Shared Hit Blocks"].as_i64().unwrap() + top["Shared Read Blocks"].as_i64().unwrap();
    eprintln!("claim of 500 rows over partitions: {buffers} buffers");
    assert!(buffers < 10 * 500, "{buffers} buffers for 500 rows");
}

#[tokio::test]
async fn the_wal_source_refuses_a_partitioned_table_and_leaves_nothing_behind() {
    let f = partitioned_fixture().await;
    let name = format!("p{}", Uuid::now_v7().simple());
    let mut relay = relay_command()
        .args(["run", "--database-url", &f.url, "--http-addr", "off"])
        .args(["--kafka-brokers", &common::kafka::brokers()])
        .args([
            "--source",
            "wal",
            "--wal-slot",
            &name,
            "--wal-publication",
            &name,
        ])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let (status, stderr) =
        common::wait_for_exit(&mut relay, Duration::from_secs(30), "the WAL relay ran");
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("the outbox table is partitioned"),
        "{stderr}"
    );
    assert_eq!(
        f.scalar(&format!(
            "SELECT (SELECT count(*) FROM pg_replication_slots WHERE slot_name = '{name}')
                  + (SELECT count(*) FROM pg_publication WHERE pubname = '{name}')"
        ))
        .await,
        0,
        "no slot or publication made"
    );
}
