//! The relay on MySQL's family, on a real MariaDB (`scripts/services start mariadb`), Kafka and
//! Pulsar: `migrate`, the message contract (key, headers, the payload byte for byte) on both
//! brokers, poison rows parked with their aggregate held while others flow, `failed` and
//! `status`, three relays sharing the shards and one killed, two tenant databases under one relay,
//! a relay killed again and again during a
//! drain and the broker paused meanwhile: nothing lost, each aggregate's first deliveries in
//! order; the claim's plan; and the consumer loop with its inbox on MariaDB.
//!
//! The broker-pausing test pauses the shared Kafka: the tests of this file run one at a time.

mod common;

use common::kafka::consume;
use common::meters::{Reading, assert_complete_and_ordered, readings_of};
use common::{KillOnDrop, relay_command, signal, terminate};
use seaorm_outbox::sea_orm::{ConnectionTrait, Database, DatabaseConnection, TransactionTrait};
use seaorm_outbox::{NewEvent, OutboxEvent, Uuid};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A MariaDB database of its own, migrated by `outbox-relay migrate`, and topics of its own.
#[derive(Clone)]
struct MariaDb {
    url: String,
    db: DatabaseConnection,
    prefix: String,
}

impl MariaDb {
    async fn new() -> MariaDb {
        let url = outbox_tests::mariadb_database_url().await;
        let migrated = relay_command()
            .args(["migrate", "--database-url", &url])
            .output()
            .unwrap();
        assert!(migrated.status.success(), "{migrated:?}");
        let stdout = String::from_utf8_lossy(&migrated.stdout);
        assert!(
            stdout.contains("outbox schema is up to date") && !stdout.contains("mariapw-"),
            "the password stays out of the output: {stdout}"
        );
        MariaDb {
            db: Database::connect(&url).await.unwrap(),
            url,
            prefix: format!("t{}", Uuid::now_v7().simple()),
        }
    }

    fn topic(&self) -> String {
        format!("{}.meter", self.prefix)
    }

    /// Starts the relay binary on this database, publishing to Kafka.
    fn spawn_relay(&self, extra: &[&str]) -> KillOnDrop {
        self.spawn_relay_to(&["--kafka-brokers", &common::kafka::brokers()], extra)
    }

    /// Starts the relay binary on this database with `sink` arguments, then `extra` ones.
    fn spawn_relay_to(&self, sink: &[&str], extra: &[&str]) -> KillOnDrop {
        KillOnDrop::spawn_logged(
            relay_command()
                .args(["run", "--database-url", &self.url])
                .args(sink)
                .args([
                    "--topic-template",
                    &format!("{}.{{aggregate_type}}", self.prefix),
                ])
                .args(["--poll-interval", "20ms", "--http-addr", "off"])
                .args(extra),
        )
    }

    async fn scalar(&self, sql: &str) -> i64 {
        let row = self
            .db
            .query_one_raw(seaorm_outbox::sea_orm::Statement::from_string(
                self.db.get_database_backend(),
                sql,
            ))
            .await
            .unwrap()
            .unwrap();
        row.try_get_by_index::<i64>(0).unwrap()
    }

    async fn scalar_text(&self, sql: &str) -> String {
        let row = self
            .db
            .query_one_raw(seaorm_outbox::sea_orm::Statement::from_string(
                self.db.get_database_backend(),
                sql,
            ))
            .await
            .unwrap()
            .unwrap();
        row.try_get_by_index::<String>(0).unwrap()
    }

    async fn wait_until_zero(&self, sql: &str, timeout: Duration) {
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

    /// Waits until every unpublished row is parked or behind a parked one of its aggregate.
    async fn wait_until_drained(&self, timeout: Duration) {
        self.wait_until_zero(
            "SELECT COUNT(*) FROM outbox o WHERE o.published_at IS NULL AND o.parked_at IS NULL
               AND NOT EXISTS (SELECT 1 FROM outbox p WHERE p.aggregate_type = o.aggregate_type
                   AND p.aggregate_id = o.aggregate_id AND p.parked_at IS NOT NULL
                   AND p.published_at IS NULL)",
            timeout,
        )
        .await;
    }

    /// Records readings `range` of `meters` meters, one transaction each.
    async fn record(&self, range: std::ops::Range<u64>, meters: u64) {
        for n in range {
            let txn = self.db.begin().await.unwrap();
            Reading {
                meter: format!("m-{}", n % meters),
                n,
            }
            .record(&txn)
            .await
            .unwrap();
            txn.commit().await.unwrap();
        }
    }

    /// Inserts readings `0..total` of `meters` meters in one statement, in `seq` order: a backlog.
    async fn backlog(&self, total: u64, meters: u64) {
        self.db
            .execute_unprepared(&format!(
                "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
                 WITH d(n) AS (SELECT 0 UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3
                               UNION ALL SELECT 4 UNION ALL SELECT 5 UNION ALL SELECT 6
                               UNION ALL SELECT 7 UNION ALL SELECT 8 UNION ALL SELECT 9),
                      r(n) AS (SELECT a.n + 10 * b.n + 100 * c.n + 1000 * e.n + 10000 * f.n
                               FROM d a, d b, d c, d e, d f)
                 SELECT UUID(), 'meter', CONCAT('m-', n % {meters}), 'Reading',
                        CONCAT('{{\"meter\":\"m-', n % {meters}, '\",\"n\":', n, '}}')
                 FROM r WHERE n < {total} ORDER BY n"
            ))
            .await
            .unwrap();
    }

    /// Runs `outbox-relay <args> --database-url URL`, which must succeed; its stdout.
    fn command(&self, args: &[&str]) -> String {
        let output = relay_command()
            .args(args)
            .args(["--database-url", &self.url])
            .output()
            .unwrap();
        assert!(output.status.success(), "{output:?}");
        String::from_utf8_lossy(&output.stdout).into_owned()
    }
}

#[tokio::test]
async fn events_recorded_on_mariadb_are_published_under_the_contract() {
    let _one = ONE_AT_A_TIME.lock().await;
    let m = MariaDb::new().await;
    let txn = m.db.begin().await.unwrap();
    let event = NewEvent::from_event(&Reading {
        meter: "m-7".into(),
        n: 1,
    })
    .unwrap()
    .with_header("tenant", "acme");
    let payload = serde_json::to_string(&event.payload).unwrap();
    let id = seaorm_outbox::record_new_events(&txn, vec![event])
        .await
        .unwrap()[0];
    txn.commit().await.unwrap();

    let mut relay = m.spawn_relay(&[]);
    let received = consume(&[&m.topic()], 1, Duration::from_secs(60)).await;
    let message = &received[0];
    assert_eq!(message.key, "m-7");
    assert_eq!(String::from_utf8_lossy(&message.payload), payload);
    assert_eq!(message.header("id"), Some(id.to_string().as_str()));
    assert_eq!(message.header("event_type"), Some("Reading"));
    assert_eq!(message.header("aggregate_type"), Some("meter"));
    assert_eq!(message.header("tenant"), Some("acme"));
    m.wait_until_zero(
        "SELECT COUNT(*) FROM outbox WHERE published_at IS NULL",
        Duration::from_secs(30),
    )
    .await;
    let status = m.command(&["status"]);
    assert!(status.contains("0 events"), "{status}");
    assert_eq!(terminate(&mut relay), Some(0), "{}", relay.log());
}

#[tokio::test]
async fn a_poison_row_is_parked_and_holds_its_aggregate_while_others_flow() {
    let _one = ONE_AT_A_TIME.lock().await;
    let m = MariaDb::new().await;
    let insert = |meter: &str, n: u64, headers: &str| {
        format!(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, headers)
             VALUES (UUID(), 'meter', '{meter}', 'Reading', '{{\"meter\": \"{meter}\", \"n\": {n}}}', {headers})"
        )
    };
    for sql in [
        insert("p", 1, "'[1]'"),
        insert("p", 2, "NULL"),
        insert("m-0", 0, "NULL"),
    ] {
        m.db.execute_unprepared(&sql).await.unwrap();
    }
    // A payload that is not JSON, past the schema's CHECK turned off: the relay checks it itself.
    m.db.execute_unprepared(
        "SET SESSION check_constraint_checks = 0;
         INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
         VALUES (UUID(), 'meter', 'q', 'Reading', '{\"meter\": \"q\", \"n\": ');
         SET SESSION check_constraint_checks = 1;",
    )
    .await
    .unwrap();
    let mut relay = m.spawn_relay(&[]);
    let received = consume(&[&m.topic()], 1, Duration::from_secs(60)).await;
    assert_eq!(readings_of(&received, "m-0"), [0]);
    assert!(readings_of(&received, "p").is_empty(), "{received:?}");
    m.wait_until_drained(Duration::from_secs(30)).await;
    let list = m.command(&["failed", "list"]);
    assert!(
        list.contains("meter:p ") && list.contains("headers must be a JSON object"),
        "{list}"
    );
    assert!(
        list.contains("meter:q ") && list.contains("payload is not valid JSON"),
        "{list}"
    );
    // p's second reading waits behind its parked first one, held: the backlog, and the oldest.
    let status = m.command(&["status"]);
    assert!(
        status.contains("backlog:            1 events")
            && status.contains("parked:             2 events")
            && status.contains("held:               1 events")
            && !status.contains("oldest unpublished: none"),
        "{status}"
    );

    m.command(&[
        "failed",
        "skip",
        "--aggregate",
        "meter:p",
        "--reason",
        "test",
    ]);
    // Released by the skip's own transaction, not a minute later by the relay's sweep.
    let status = m.command(&["status"]);
    assert!(status.contains("held:               0 events"), "{status}");
    let received = consume(&[&m.topic()], 2, Duration::from_secs(60)).await;
    assert_eq!(readings_of(&received, "p"), [2]);
    assert_eq!(terminate(&mut relay), Some(0), "{}", relay.log());
}

/// A row parked before the relay started (by a relay since gone, or by hand) holds its aggregate:
/// the relay learns what is held from the table at each claim, not from what it parked itself.
#[tokio::test]
async fn a_row_parked_before_the_relay_started_holds_its_aggregate() {
    let _one = ONE_AT_A_TIME.lock().await;
    let m = MariaDb::new().await;
    m.db.execute_unprepared(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, parked_at, last_error)
         VALUES (UUID(), 'meter', 'p', 'Reading', '{\"meter\": \"p\", \"n\": 1}', UTC_TIMESTAMP(6), 'parked by hand')",
    )
    .await
    .unwrap();
    m.record(0..20, 4).await;
    m.db.execute_unprepared(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
         VALUES (UUID(), 'meter', 'p', 'Reading', '{\"meter\": \"p\", \"n\": 2}')",
    )
    .await
    .unwrap();
    let mut relay = m.spawn_relay(&[]);
    let received = consume(&[&m.topic()], 20, Duration::from_secs(60)).await;
    m.wait_until_drained(Duration::from_secs(30)).await;
    // A later event published proves a claim ran past p's second reading: claims go in `seq`
    // order, so that reading would have gone out first, had it not been held.
    m.record(20..21, 4).await;
    m.wait_until_drained(Duration::from_secs(30)).await;
    let status = m.command(&["status"]);
    assert!(
        status.contains("backlog:            1 events"),
        "p's second reading waits behind its parked first one: {status}"
    );
    assert!(readings_of(&received, "p").is_empty(), "{received:?}");
    assert_eq!(terminate(&mut relay), Some(0), "{}", relay.log());
}

/// How many shard leases each relay session holds, by asking `IS_USED_LOCK` of every shard's
/// named lock (MySQL lists no named locks that MariaDB lists too).
async fn lease_holders(m: &MariaDb) -> Vec<i64> {
    let mut conn = <sqlx::MySqlConnection as sqlx::Connection>::connect(&m.url)
        .await
        .unwrap();
    let prefix: String = sqlx::query_scalar(seaorm_outbox_relay::MYSQL_LOCK_PREFIX_SQL)
        .fetch_one(&mut conn)
        .await
        .unwrap();
    sqlx::query_scalar(
        "WITH RECURSIVE n(k) AS (SELECT 0 UNION ALL SELECT k + 1 FROM n WHERE k < 255)
         SELECT CAST(COUNT(*) AS SIGNED) FROM n WHERE IS_USED_LOCK(CONCAT(?, 'shard:', k)) IS NOT NULL
         GROUP BY IS_USED_LOCK(CONCAT(?, 'shard:', k)) ORDER BY 1",
    )
    .bind(&prefix)
    .bind(&prefix)
    .fetch_all(&mut conn)
    .await
    .unwrap()
}

/// Waits until `replicas` relays hold all 256 shards between them.
async fn wait_for_holders(m: &MariaDb, replicas: usize) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let holders = lease_holders(m).await;
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

/// Four writers record readings `rounds` of `METERS` meters, 50 to a transaction, each owning
/// every fourth meter: reading `n` is of meter `n % METERS`, each meter's in recording order.
async fn write_rounds(m: &MariaDb, rounds: std::ops::Range<u64>) {
    const METERS: u64 = 200;
    let writers = (0..4).map(|w| {
        let db = m.db.clone();
        let rounds = rounds.clone();
        tokio::spawn(async move {
            let mine: Vec<u64> = (0..METERS).filter(|meter| meter % 4 == w).collect();
            for round in rounds {
                for chunk in mine.chunks(50) {
                    let events: Vec<Reading> = chunk
                        .iter()
                        .map(|meter| Reading {
                            meter: format!("m-{meter}"),
                            n: round * METERS + meter,
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

/// Three relays share a MariaDB outbox through shard leases (named locks): while none crashes,
/// every reading is published once and in order; one killed while readers record, the others take
/// its shards within about a second, and nothing is lost, first deliveries in order, duplicates
/// within the killed relay's two unsettled batches.
#[tokio::test]
async fn three_replicas_share_the_shards_and_one_killed_loses_nothing() {
    const BATCH: usize = 200;
    let _one = ONE_AT_A_TIME.lock().await;
    let m = MariaDb::new().await;
    let batch = BATCH.to_string();
    let mut relays: Vec<KillOnDrop> = (0..3)
        .map(|_| m.spawn_relay(&["--batch-size", &batch]))
        .collect();
    wait_for_holders(&m, 3).await;

    write_rounds(&m, 0..25).await;
    m.wait_until_drained(Duration::from_secs(120)).await;
    let received = consume(&[&m.topic()], 5_000, Duration::from_secs(60)).await;
    assert_eq!(
        assert_complete_and_ordered(&received, 5_000, 200),
        0,
        "no reading published twice while no relay crashed"
    );

    let writing = tokio::spawn({
        let m = m.clone();
        async move { write_rounds(&m, 25..100).await }
    });
    m.wait_until_zero(
        "SELECT GREATEST(0, 8000 - COUNT(*)) FROM outbox WHERE published_at IS NOT NULL",
        Duration::from_secs(120),
    )
    .await;
    let mut killed = relays.remove(0);
    signal(&killed, "KILL");
    let _ = killed.wait();
    let killed_at = Instant::now();
    wait_for_holders(&m, 2).await;
    eprintln!(
        "the other replicas took over all 256 shards {:?} after the kill",
        killed_at.elapsed()
    );
    writing.await.unwrap();
    m.wait_until_drained(Duration::from_secs(120)).await;
    let received = consume(&[&m.topic()], 20_000, Duration::from_secs(120)).await;
    let duplicates = assert_complete_and_ordered(&received, 20_000, 200);
    eprintln!("{duplicates} duplicates after the kill");
    assert!(
        duplicates <= 2 * BATCH,
        "{duplicates} duplicates: more than the killed relay's two unsettled batches"
    );
    for relay in &mut relays {
        assert_eq!(terminate(relay), Some(0), "{}", relay.log());
    }
    assert!(
        lease_holders(&m).await.is_empty(),
        "stopped relays leave their shards"
    );
}

/// The claim's plan after a burst (a large published history and a backlog, written just now)
/// and again once the table is analyzed: the oldest claimable rows come from the NULL prefix of
/// `outbox_unpublished` in `seq` order, the due retries from a range of `outbox_retrying`, and
/// each walked row's aggregate is one probe of `outbox_waiting`; no step reads the whole table.
#[tokio::test]
async fn the_claim_reads_indexes_not_the_table() {
    let _one = ONE_AT_A_TIME.lock().await;
    let m = MariaDb::new().await;
    m.backlog(60_000, 1_000).await;
    m.db.execute_unprepared(
        "UPDATE outbox SET published_at = UTC_TIMESTAMP(6) WHERE seq <= 55000;
         UPDATE outbox SET parked_at = UTC_TIMESTAMP(6) WHERE seq = 55001;",
    )
    .await
    .unwrap();
    assert_the_claim_reads_indexes(&m).await;
    m.db.execute_unprepared("ANALYZE TABLE outbox")
        .await
        .unwrap();
    assert_the_claim_reads_indexes(&m).await;
}

/// A table migrated before schema version 4 lacks the claim's column `waiting_on`: the relay
/// says so and what to run.
#[tokio::test]
async fn a_relay_on_a_table_without_schema_version_4_says_to_migrate() {
    let m = MariaDb::new().await;
    m.db.execute_unprepared("ALTER TABLE outbox DROP KEY outbox_waiting, DROP COLUMN waiting_on")
        .await
        .unwrap();
    let mut relay = m.spawn_relay(&[]);
    common::assert_refused_until_migrated(&mut relay, 4);
}

/// `how` (`EXPLAIN`, `ANALYZE FORMAT=JSON`) of the claim `claim` with its parameters bound:
/// parked rows held, every shard, batches of 500 within a payload and a batch byte budget.
async fn explain_claim(
    conn: &mut sqlx::MySqlConnection,
    how: &str,
    claim: &str,
) -> Vec<sqlx::mysql::MySqlRow> {
    let explain = format!("{how} {claim}");
    let mut query = sqlx::query(sqlx::AssertSqlSafe(explain));
    // The walk's and the due retries' parameters, then the batch's.
    for _ in 0..2 {
        query = query.bind(true).bind(vec![0xffu8; 32]).bind(500_i64);
    }
    query
        .bind(1_000_000_i64)
        .bind(500_i64)
        .bind(1_000_000_i64)
        .bind(4_000_000_i64)
        .fetch_all(conn)
        .await
        .unwrap()
}

/// The claim's `EXPLAIN` on `m`: indexes only, as [`the_claim_reads_indexes_not_the_table`] says.
async fn assert_the_claim_reads_indexes(m: &MariaDb) {
    let mut conn = <sqlx::MySqlConnection as sqlx::Connection>::connect(&m.url)
        .await
        .unwrap();
    let plan: Vec<(Option<String>, Option<String>, Option<String>)> = {
        use sqlx::Row;
        explain_claim(&mut conn, "EXPLAIN", seaorm_outbox_relay::MYSQL_CLAIM_SQL)
            .await
            .iter()
            .map(|r| (r.get("table"), r.get("type"), r.get("key")))
            .collect()
    };
    let step = |table: &str| -> Vec<(Option<String>, Option<String>)> {
        plan.iter()
            .filter(|(t, _, _)| t.as_deref() == Some(table))
            .map(|(_, kind, key)| (kind.clone(), key.clone()))
            .collect()
    };
    // The claim's walks of `o` (its other reads of `o` take the claimed rows by primary key).
    let walks = step("o");
    assert!(
        walks.contains(&(Some("ref".into()), Some("outbox_unpublished".into()))),
        "the claimable rows: {plan:?}"
    );
    assert!(
        walks.contains(&(Some("range".into()), Some("outbox_retrying".into()))),
        "the due retries: {plan:?}"
    );
    let probes = step("b");
    assert_eq!(probes.len(), 2, "{plan:?}");
    assert!(
        probes
            .iter()
            .all(|probe| probe == &(Some("ref".into()), Some("outbox_waiting".into()))),
        "each walked row's aggregate is one probe of outbox_waiting: {plan:?}"
    );
    assert!(
        walks
            .iter()
            .all(|(kind, _)| !matches!(kind.as_deref(), Some("ALL" | "index"))),
        "no scan of the table or of a whole index: {plan:?}"
    );
}

/// With a batch in flight, the claim skips its rows in `outbox_unpublished` itself (index
/// condition pushdown): their seqs are checked before each row is read by primary key, so the
/// rows in flight cost the claim an index entry each, not a row read.
#[tokio::test]
async fn the_claim_skips_the_rows_in_flight_in_the_index() {
    let _one = ONE_AT_A_TIME.lock().await;
    let m = MariaDb::new().await;
    m.backlog(2_000, 100).await;
    let mut conn = <sqlx::MySqlConnection as sqlx::Connection>::connect(&m.url)
        .await
        .unwrap();
    // As the relay writes the seqs in flight into the claim.
    let in_flight = (1..=500).map(|seq| seq.to_string()).collect::<Vec<_>>();
    let claim = seaorm_outbox_relay::MYSQL_CLAIM_SQL.replacen(
        "o.seq NOT IN (0)",
        &format!("o.seq NOT IN (0,{})", in_flight.join(",")),
        1,
    );
    let plan: String = {
        use sqlx::Row;
        explain_claim(&mut conn, "ANALYZE FORMAT=JSON", &claim).await[0].get(0)
    };
    // MariaDB writes the bound shard mask into the plan's conditions as `\?` per byte: not JSON.
    let plan = plan.replace("\\?", "?");
    let plan: serde_json::Value = serde_json::from_str(&plan).unwrap();
    let mut scans = Vec::new();
    find_tables(&plan, "o", &mut scans);
    let unpublished = scans
        .iter()
        .find(|t| t["key"] == "outbox_unpublished")
        .unwrap_or_else(|| panic!("no read of outbox_unpublished: {plan:#}"));
    let pushed = unpublished["index_condition"].as_str().unwrap_or_default();
    assert!(
        pushed.contains("o.seq not in (0,1,2,3,"),
        "the seqs in flight are checked after the row is read: {unpublished:#}"
    );
    // The 500 in flight are passed over in the index: the rows read are the 500 claimed.
    assert_eq!(unpublished["r_rows"], 500, "{unpublished:#}");
}

/// The claim goes to MariaDB as one text query, not as a statement prepared and closed each
/// time (its text changes with the seqs in flight): the close went as a packet of its own,
/// unanswered, and commit-to-ack at 1,000 events/s rose from 4 to 67 ms. Counted on the server:
/// a drain of 50 batches prepares no statement per batch.
#[tokio::test]
async fn the_claim_is_one_text_query_not_a_statement_prepared_each_time() {
    let _one = ONE_AT_A_TIME.lock().await;
    let m = MariaDb::new().await;
    m.backlog(5_000, 50).await;
    let prepared = "SELECT CAST(VARIABLE_VALUE AS SIGNED) FROM information_schema.GLOBAL_STATUS
                    WHERE VARIABLE_NAME = 'COM_STMT_PREPARE'";
    let before = m.scalar(prepared).await;
    let mut relay = m.spawn_relay(&["--batch-size", "100"]);
    m.wait_until_zero(
        "SELECT COUNT(*) FROM outbox WHERE published_at IS NULL",
        Duration::from_secs(60),
    )
    .await;
    assert_eq!(terminate(&mut relay), Some(0), "{}", relay.log());
    let during = m.scalar(prepared).await - before;
    // The relay's other statements are prepared once per connection, and this test's polling
    // prepares none (seaORM's raw statements are text queries).
    assert!(
        during < 25,
        "{during} statements prepared during a drain of 50 batches"
    );
}

/// Every `table` object of an `ANALYZE FORMAT=JSON` plan named `name`, into `found`.
fn find_tables(node: &serde_json::Value, name: &str, found: &mut Vec<serde_json::Value>) {
    match node {
        serde_json::Value::Object(fields) => {
            if let Some(table) = fields.get("table")
                && table["table_name"] == name
            {
                found.push(table.clone());
            }
            fields.values().for_each(|v| find_tables(v, name, found));
        }
        serde_json::Value::Array(items) => items.iter().for_each(|v| find_tables(v, name, found)),
        _ => {}
    }
}

/// The relay killed ten times while it drains 50,000 readings of 20 meters: every reading
/// arrives, each meter's first deliveries in recording order.
#[tokio::test]
async fn the_relay_killed_ten_times_during_a_50k_drain_loses_nothing() {
    const TOTAL: u64 = 50_000;
    let _one = ONE_AT_A_TIME.lock().await;
    let m = MariaDb::new().await;
    m.backlog(TOTAL, 20).await;
    // Each run is killed once it has published more: in the middle of the drain.
    let published = "SELECT COUNT(*) FROM outbox WHERE published_at IS NOT NULL";
    for _ in 0..10 {
        let before = m.scalar(published).await;
        let mut relay = m.spawn_relay(&[]);
        m.wait_until_zero(
            &format!("SELECT GREATEST({before} + 1 - COUNT(*), 0) FROM outbox WHERE published_at IS NOT NULL"),
            Duration::from_secs(30),
        )
        .await;
        signal(&relay, "KILL");
        let _ = relay.wait();
    }
    let mut relay = m.spawn_relay(&[]);
    m.wait_until_drained(Duration::from_secs(120)).await;
    let received = consume(&[&m.topic()], TOTAL as usize, Duration::from_secs(120)).await;
    let duplicates = assert_complete_and_ordered(&received, TOTAL, 20);
    eprintln!("{TOTAL} readings, {duplicates} duplicates");
    assert_eq!(terminate(&mut relay), Some(0), "{}", relay.log());
}

/// Two tenant databases on one MariaDB server under one relay (`--tenants`): each tenant's pump
/// takes all 256 of its database's shards (the lock names carry the database, so the two never
/// collide), each tenant's readings arrive in order, and a tenant removed from the list gives its
/// shards up while the other flows on.
#[tokio::test]
async fn one_relay_publishes_two_tenant_databases_on_one_server() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (acme, globex) = (MariaDb::new().await, MariaDb::new().await);
    let tenants = outbox_tests::temp_dir().join("tenants");
    let list = |lines: &[(&str, &MariaDb)]| {
        let text: Vec<String> = lines
            .iter()
            .map(|(n, m)| format!("{n} {}", m.url))
            .collect();
        std::fs::write(&tenants, text.join("\n") + "\n").unwrap();
    };
    list(&[("acme", &acme), ("globex", &globex)]);
    acme.record(0..40, 4).await;
    globex.record(0..40, 4).await;
    // Both tenants publish to acme's topics.
    let mut relay = acme.spawn_relay(&["--tenants", tenants.to_str().unwrap()]);
    wait_for_holders(&acme, 1).await;
    wait_for_holders(&globex, 1).await;
    let unpublished = "SELECT COUNT(*) FROM outbox WHERE published_at IS NULL";
    acme.wait_until_zero(unpublished, Duration::from_secs(60))
        .await;
    globex
        .wait_until_zero(unpublished, Duration::from_secs(60))
        .await;
    let received = consume(&[&acme.topic()], 80, Duration::from_secs(60)).await;
    // Each meter has two readings of each `n`, one per tenant: per meter, the readings arrive as
    // two interleaved runs, each in order.
    let mut by_meter: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    for m in &received {
        by_meter
            .entry(m.key.clone())
            .or_default()
            .push(m.json()["n"].as_u64().unwrap());
    }
    for (meter, ns) in &by_meter {
        let mut runs: [Vec<u64>; 2] = [Vec::new(), Vec::new()];
        for n in ns {
            // The first run takes a reading unless it already has it (then it is the other's).
            let run = usize::from(runs[0].contains(n));
            runs[run].push(*n);
        }
        let expected: Vec<u64> = (0..40)
            .filter(|n| format!("m-{}", n % 4) == *meter)
            .collect();
        assert_eq!(runs, [expected.clone(), expected], "{meter}: {ns:?}");
    }

    // Acme removed: its shards are given up; globex flows on.
    list(&[("globex", &globex)]);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !lease_holders(&acme).await.is_empty() {
        assert!(Instant::now() < deadline, "acme's shards were not released");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    acme.record(40..44, 4).await;
    globex.record(40..44, 4).await;
    globex
        .wait_until_zero(unpublished, Duration::from_secs(60))
        .await;
    assert_eq!(
        acme.scalar(unpublished).await,
        4,
        "acme published after it was removed"
    );
    assert_eq!(terminate(&mut relay), Some(0), "{}", relay.log());
}

/// The same contract to Pulsar: the aggregate id as partition and ordering key, the contract's
/// properties, the payload byte for byte, each aggregate in order.
#[tokio::test]
async fn events_recorded_on_mariadb_reach_pulsar_under_the_contract() {
    let _one = ONE_AT_A_TIME.lock().await;
    let m = MariaDb::new().await;
    m.record(0..50, 5).await;
    let mut relay = m.spawn_relay_to(
        &["--sink", "pulsar", "--pulsar-url", &common::pulsar::url()],
        &[],
    );
    let received = common::pulsar::consume(
        &common::pulsar::topic(&m.topic()),
        50,
        Duration::from_secs(60),
    )
    .await;
    let mut by_meter: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    for message in &received {
        assert_eq!(message.key, message.ordering_key);
        assert_eq!(message.property("aggregate_type"), Some("meter"));
        assert_eq!(message.property("event_type"), Some("Reading"));
        let payload: serde_json::Value = serde_json::from_slice(&message.payload).unwrap();
        assert_eq!(payload["meter"], message.key.as_str());
        by_meter
            .entry(message.key.clone())
            .or_default()
            .push(payload["n"].as_u64().unwrap());
    }
    let expected: BTreeMap<String, Vec<u64>> = (0..5)
        .map(|meter| {
            (
                format!("m-{meter}"),
                (0..50).filter(|n| n % 5 == meter).collect(),
            )
        })
        .collect();
    assert_eq!(by_meter, expected);
    assert_eq!(terminate(&mut relay), Some(0), "{}", relay.log());
}

/// The broker paused past the producer's message timeout while the relay drains and writers
/// record: once it is back, every reading arrives, each meter's first deliveries in order.
#[tokio::test]
async fn the_broker_paused_during_a_drain_loses_nothing() {
    let _one = ONE_AT_A_TIME.lock().await;
    let m = MariaDb::new().await;
    m.backlog(2_000, 20).await;
    let mut relay = m.spawn_relay(&[]);
    m.wait_until_zero(
        "SELECT GREATEST(1 - COUNT(*), 0) FROM outbox WHERE published_at IS NOT NULL",
        Duration::from_secs(30),
    )
    .await;
    common::services("pause-kafka");
    // Recorded while the broker is away.
    m.db.execute_unprepared(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
         SELECT UUID(), 'meter', CONCAT('m-', (seq + 1999) % 20), 'Reading',
                CONCAT('{\"meter\":\"m-', (seq + 1999) % 20, '\",\"n\":', seq + 1999, '}')
         FROM outbox WHERE seq BETWEEN 1 AND 1000 ORDER BY seq",
    )
    .await
    .unwrap();
    tokio::time::sleep(common::wal::PAST_THE_PRODUCERS_TIMEOUT).await;
    common::services("resume-kafka");
    m.wait_until_drained(Duration::from_secs(120)).await;
    let received = consume(&[&m.topic()], 3_000, Duration::from_secs(120)).await;
    let duplicates = assert_complete_and_ordered(&received, 3_000, 20);
    eprintln!("3000 readings, {duplicates} duplicates");
    assert_eq!(terminate(&mut relay), Some(0), "{}", relay.log());
}

/// The consumer loop with its inbox on MariaDB, end to end: readings the relay published, some
/// twice (a relay re-send) and some applied before a consumer crash (effect and inbox row
/// committed, the offset not), are each applied once, every meter's in recording order.
#[tokio::test]
async fn the_consumer_loop_applies_each_event_once_with_its_inbox_on_mariadb() {
    use seaorm_outbox::consumer::{ConsumerOptions, handler, kafka::KafkaConsumer};
    use seaorm_outbox::inbox::{Inbox, Processed};
    use seaorm_outbox::sea_orm::{DbBackend, Statement};
    let _one = ONE_AT_A_TIME.lock().await;
    let m = MariaDb::new().await;
    m.db.execute_unprepared(
        "CREATE TABLE effects (pos BIGINT AUTO_INCREMENT PRIMARY KEY, event_id CHAR(36) NOT NULL,
                               meter VARCHAR(255) NOT NULL, n BIGINT NOT NULL)",
    )
    .await
    .unwrap();
    m.record(0..50, 5).await;
    let mut relay = m.spawn_relay(&[]);
    m.wait_until_drained(Duration::from_secs(30)).await;
    // A relay re-send: the broker gets readings 10 to 19 twice.
    m.db.execute_unprepared(
        "UPDATE outbox SET published_at = NULL WHERE JSON_EXTRACT(payload, '$.n') BETWEEN 10 AND 19",
    )
    .await
    .unwrap();
    m.wait_until_drained(Duration::from_secs(30)).await;
    assert_eq!(terminate(&mut relay), Some(0), "{}", relay.log());

    // A consumer that crashed after committing readings 0 to 14, before committing its offsets.
    let options = ConsumerOptions::new(format!("{}-billing", m.prefix))
        .backoff(Duration::from_millis(20), Duration::from_millis(200));
    let inbox = Inbox::new(options.name());
    for n in 0..15 {
        let id = m
            .scalar_text(&format!(
                "SELECT id FROM outbox WHERE JSON_EXTRACT(payload, '$.n') = {n}"
            ))
            .await;
        let effect = format!(
            "INSERT INTO effects (event_id, meter, n) VALUES ('{id}', 'm-{}', {n})",
            n % 5
        );
        let outcome = inbox
            .process(&m.db, id.parse().unwrap(), move |txn| {
                Box::pin(async move { txn.execute_unprepared(&effect).await.map(drop) })
            })
            .await
            .unwrap();
        assert_eq!(outcome, Processed::Applied(()));
    }

    let consumer = KafkaConsumer::new(&common::kafka::brokers(), &[&m.topic()], options).unwrap();
    let mut progress = consumer.progress();
    // 60 messages: 50 readings, 10 of them twice.
    let stop = async move {
        let _ = progress.wait_for(|c| c.applied + c.duplicates >= 60).await;
    };
    let apply = handler(|envelope, txn| {
        Box::pin(async move {
            let reading: Reading = envelope.decode()?;
            txn.execute_raw(Statement::from_sql_and_values(
                DbBackend::MySql,
                "INSERT INTO effects (event_id, meter, n) VALUES (?, ?, ?)",
                [
                    envelope.id.to_string().into(),
                    reading.meter.into(),
                    i64::try_from(reading.n).unwrap().into(),
                ],
            ))
            .await?;
            Ok(())
        })
    });
    let consumed = tokio::time::timeout(Duration::from_secs(90), consumer.run(&m.db, apply, stop))
        .await
        .expect("every message consumed within 90 s")
        .unwrap();

    assert_eq!(
        m.scalar("SELECT COUNT(*) FROM effects").await,
        50,
        "each effect once"
    );
    assert_eq!(
        m.scalar("SELECT COUNT(DISTINCT event_id) FROM effects")
            .await,
        50
    );
    for meter in 0..5 {
        let applied = m
            .scalar_text(&format!(
                "SELECT GROUP_CONCAT(n ORDER BY pos) FROM effects WHERE meter = 'm-{meter}'"
            ))
            .await;
        let expected: Vec<String> = (0..10).map(|k| (k * 5 + meter).to_string()).collect();
        assert_eq!(applied, expected.join(","), "meter m-{meter} in order");
    }
    assert_eq!(consumed.applied, 35, "{consumed:?}");
    // 15 applied before the crash; of the 10 re-sent, 5 were among them (seen twice) and 5 not.
    assert_eq!(consumed.duplicates, 15 + 10, "{consumed:?}");
}
