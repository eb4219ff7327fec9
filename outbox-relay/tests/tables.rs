//! Several outbox tables in one database, on real PostgreSQL, Kafka, SQLite and MariaDB: one relay
//! process publishing several tables (one pump each, one table's failure leaving the others
//! flowing), or one relay per table; each table's events to their topics in order, with shard
//! leases of its own (two relays of two tables never split each other's shards), its own `status`
//! and `failed` commands, and its own NOTIFY channel.

mod common;

use common::kafka::consume;
use common::{Fixture, free_port, http_get_when_up};
use futures::future::BoxFuture;
use seaorm_outbox::TableName;
use seaorm_outbox::sea_orm::{
    ConnectionTrait, DatabaseConnection, DatabaseTransaction, TransactionTrait,
};
use seaorm_outbox::{NewEvent, OutboxEvent};
use seaorm_outbox_relay::Relay;
use seaorm_outbox_relay::sink::memory::MemorySink;
use seaorm_outbox_relay::sink::{Ack, Message, Sink, SinkError};
use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate = "order", key = "order_id")]
struct OrderPlaced {
    order_id: u64,
    n: u64,
}

#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate = "invoice", key = "invoice_id", table = "billing_outbox")]
struct InvoiceIssued {
    invoice_id: u64,
    n: u64,
}

/// Records `per_table` events into each of `outbox` and `billing_outbox`, over 10 aggregates each,
/// several transactions writing into both tables at once. Returns each key's `n`s in order, per
/// aggregate type.
async fn record_both(
    db: &DatabaseConnection,
    per_table: u64,
) -> BTreeMap<&'static str, BTreeMap<String, Vec<u64>>> {
    let mut expected: BTreeMap<&'static str, BTreeMap<String, Vec<u64>>> = BTreeMap::new();
    for batch in 0..per_table / 10 {
        let txn = db.begin().await.unwrap();
        let mut events = Vec::new();
        for i in 0..10 {
            let n = batch * 10 + i;
            let id = (n * 7) % 10;
            events.push(NewEvent::from_event(&InvoiceIssued { invoice_id: id, n }).unwrap());
            events.push(NewEvent::from_event(&OrderPlaced { order_id: id, n }).unwrap());
            for kind in ["invoice", "order"] {
                expected
                    .entry(kind)
                    .or_default()
                    .entry(id.to_string())
                    .or_default()
                    .push(n);
            }
        }
        seaorm_outbox::record_new_events(&txn, events)
            .await
            .unwrap();
        txn.commit().await.unwrap();
    }
    expected
}

fn migrate_billing(url: &str, extra: &[&str]) {
    let out = common::relay_command()
        .args([
            "migrate",
            "--database-url",
            url,
            "--table",
            "billing_outbox",
        ])
        .args(extra)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("(table billing_outbox)"), "{stdout}");
}

#[tokio::test]
async fn two_tables_in_one_database_go_to_their_topics_in_order_each_through_its_relay() {
    let f = Fixture::new().await;
    migrate_billing(&f.url, &[]);
    let expected = record_both(&f.db, 400).await;
    // Both relays at once: had the two tables' leases been one lock space, the two would have
    // split the 256 shards between them and each left half of its table unpublished.
    let mut orders = f.spawn_relay(&[]);
    let mut invoices = f.spawn_relay(&["--table", "billing_outbox"]);
    let billing_left = "SELECT count(*) FROM billing_outbox WHERE published_at IS NULL";
    f.wait_until_zero(billing_left, Duration::from_secs(120))
        .await;
    f.wait_until_drained(Duration::from_secs(120)).await;
    assert_eq!(common::terminate(&mut orders), Some(0));
    assert_eq!(common::terminate(&mut invoices), Some(0));

    let duplicates = assert_topics_complete_and_ordered(&f, &expected).await;
    assert_eq!(duplicates, 0, "a clean run re-sent events");

    // `status --table` reads that table.
    let printed = status(&f.url, "billing_outbox");
    assert!(printed.contains("backlog:            0"), "{printed}");
}

/// A transaction holding `billing_outbox` locked, as an operator's long migration would: every
/// statement on the table waits until it ends.
async fn lock_billing(db: &DatabaseConnection) -> DatabaseTransaction {
    let lock = db.begin().await.unwrap();
    lock.execute_unprepared("LOCK TABLE billing_outbox IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    lock
}

/// What `outbox-relay status --table tables` prints, which must succeed.
fn status(url: &str, tables: &str) -> String {
    let status = common::relay_command()
        .args(["status", "--database-url", url, "--table", tables])
        .output()
        .unwrap();
    assert!(
        status.status.success(),
        "{}",
        String::from_utf8_lossy(&status.stderr)
    );
    String::from_utf8_lossy(&status.stdout).into_owned()
}

/// Asserts each topic got every event of `expected`, in order per key; returns the duplicates.
async fn assert_topics_complete_and_ordered(
    f: &Fixture,
    expected: &BTreeMap<&'static str, BTreeMap<String, Vec<u64>>>,
) -> usize {
    let mut duplicates = 0;
    for (kind, keys) in expected {
        let total = keys.values().map(Vec::len).sum();
        let received = consume(&[&f.topic(kind)], total, Duration::from_secs(60)).await;
        let received = received
            .iter()
            .map(|m| (m.key.clone(), m.json()["n"].as_u64().unwrap()));
        duplicates += common::assert_complete_and_ordered(received, keys);
    }
    duplicates
}

#[tokio::test]
async fn one_relay_process_publishes_two_tables_each_in_order() {
    let f = Fixture::new().await;
    migrate_billing(&f.url, &[]);
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let mut relay = f.spawn_relay(&["--table", "outbox, billing_outbox", "--http-addr", &addr]);
    // Recorded while the relay runs, transactions writing into both tables.
    let expected = record_both(&f.db, 400).await;
    let billing_left = "SELECT count(*) FROM billing_outbox WHERE published_at IS NULL";
    f.wait_until_zero(billing_left, Duration::from_secs(120))
        .await;
    f.wait_until_drained(Duration::from_secs(120)).await;

    // Each table's gauges under its name; each table's 256 shards leased by this one process.
    let (_, metrics) = http_get_when_up(port, "/metrics").await;
    for expected in [
        r#"outbox_shards_leased{table="outbox"} 256"#,
        r#"outbox_shards_leased{table="billing_outbox"} 256"#,
        r#"outbox_backlog_events{table="billing_outbox"}"#,
    ] {
        assert!(
            metrics.contains(expected),
            "/metrics lacks {expected}:\n{metrics}"
        );
    }
    assert_eq!(common::terminate(&mut relay), Some(0));
    let duplicates = assert_topics_complete_and_ordered(&f, &expected).await;
    assert_eq!(duplicates, 0, "a clean run re-sent events");

    // `status` of both: each under its name.
    let printed = status(&f.url, "outbox,billing_outbox");
    assert!(
        printed.starts_with("table outbox:\nbacklog:            0"),
        "{printed}"
    );
    assert!(
        printed.contains("\n\ntable billing_outbox:\nbacklog:            0"),
        "{printed}"
    );
}

#[tokio::test]
async fn a_table_locked_away_leaves_the_other_tables_pump_flowing() {
    let f = Fixture::new().await;
    migrate_billing(&f.url, &[]);
    let mut expected: BTreeMap<&'static str, BTreeMap<String, Vec<u64>>> = BTreeMap::new();
    let txn = f.db.begin().await.unwrap();
    for n in 0..50 {
        let invoice = InvoiceIssued {
            invoice_id: n % 5,
            n,
        };
        invoice.record(&txn).await.unwrap();
        let key = (n % 5).to_string();
        expected
            .entry("invoice")
            .or_default()
            .entry(key)
            .or_default()
            .push(n);
    }
    txn.commit().await.unwrap();

    // An operator's long migration holds `billing_outbox`: its pump's statements time out.
    let lock = lock_billing(&f.db).await;
    let spawned = std::time::Instant::now();
    let mut relay = f.spawn_relay(&[
        "--table",
        "billing_outbox,outbox",
        "--statement-timeout",
        "500ms",
    ]);
    // The locked table's pump fails, saying so under its table's name...
    let named = |log: &str| {
        log.lines()
            .any(|l| l.contains("database unavailable") && l.contains("table=billing_outbox"))
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !named(&relay.log()) {
        assert!(
            std::time::Instant::now() < deadline,
            "no warning names the locked table:\n{}",
            relay.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // ... and the other table's events go out meanwhile.
    for n in 0..200 {
        let txn = f.db.begin().await.unwrap();
        OrderPlaced {
            order_id: n % 10,
            n,
        }
        .record(&txn)
        .await
        .unwrap();
        txn.commit().await.unwrap();
        let key = (n % 10).to_string();
        expected
            .entry("order")
            .or_default()
            .entry(key)
            .or_default()
            .push(n);
    }
    f.wait_until_drained(Duration::from_secs(60)).await;
    assert!(
        relay.try_wait().unwrap().is_none(),
        "the relay exited while one of its tables was locked:\n{}",
        relay.log()
    );
    // None of the relay's sessions waits on the lock longer than its statement timeout: not the
    // pump's, nor the backlog sampler's, which first tried when the relay started. Checked until
    // the relay has run 4 s, so a session stuck since its start would be seen.
    let waiting = "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid) \
                   WHERE l.relation = 'billing_outbox'::regclass AND NOT l.granted \
                     AND now() - a.query_start > interval '2 seconds'";
    loop {
        assert_eq!(
            f.scalar(waiting).await,
            0,
            "a relay session waits on the locked table past its statement timeout"
        );
        if spawned.elapsed() > Duration::from_secs(4) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    lock.rollback().await.unwrap();
    let billing_left = "SELECT count(*) FROM billing_outbox WHERE published_at IS NULL";
    f.wait_until_zero(billing_left, Duration::from_secs(60))
        .await;
    assert_eq!(common::terminate(&mut relay), Some(0));
    assert_topics_complete_and_ordered(&f, &expected).await;
}

/// A [`MemorySink`] that counts the purges the relay asks of it.
#[derive(Clone, Default)]
struct PurgesCounted {
    kept: MemorySink,
    purges: Arc<AtomicUsize>,
}

impl Sink for PurgesCounted {
    fn name(&self) -> &str {
        "purges counted"
    }

    fn enqueue<'a>(&'a self, message: &'a Message) -> BoxFuture<'a, Result<Ack, SinkError>> {
        self.kept.enqueue(message)
    }

    fn purge(&self) {
        self.purges.fetch_add(1, Ordering::SeqCst);
    }
}

#[tokio::test]
async fn a_table_that_keeps_failing_never_purges_the_sink_the_others_share() {
    let f = Fixture::new().await;
    migrate_billing(&f.url, &[]);
    let txn = f.db.begin().await.unwrap();
    for n in 0..20 {
        InvoiceIssued {
            invoice_id: n % 5,
            n,
        }
        .record(&txn)
        .await
        .unwrap();
    }
    txn.commit().await.unwrap();
    // `billing_outbox` locked away: its pump's statements time out, it reconnects, again and again.
    let lock = lock_billing(&f.db).await;
    let mut config = f.relay_config();
    config.tables = vec!["billing_outbox".parse().unwrap(), TableName::DEFAULT];
    config.statement_timeout = Duration::from_millis(300);
    // The sampler tries once, the pruner never: every other session on the table is the pump's.
    config.metrics_interval = Duration::from_secs(3600);
    config.retention = None;
    let sink = PurgesCounted::default();
    let shutdown = CancellationToken::new();
    let running = tokio::spawn({
        let (relay, shutdown) = (Relay::new(config, sink.clone()), shutdown.clone());
        async move { relay.run(shutdown).await }
    });
    let txn = f.db.begin().await.unwrap();
    for n in 0..100 {
        OrderPlaced {
            order_id: n % 10,
            n,
        }
        .record(&txn)
        .await
        .unwrap();
    }
    txn.commit().await.unwrap();
    f.wait_until_drained(Duration::from_secs(60)).await;

    // Four sessions seen waiting on the lock, one at most the sampler's: the pump lost its
    // connection and reconnected at least twice.
    let mut waited = std::collections::BTreeSet::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while waited.len() < 4 {
        assert!(
            std::time::Instant::now() < deadline,
            "the pump did not retry: {waited:?}"
        );
        let pids = "SELECT coalesce(max(pid), 0)::bigint FROM pg_locks \
                    WHERE relation = 'billing_outbox'::regclass AND NOT granted";
        waited.insert(f.scalar(pids).await);
        waited.remove(&0);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Its failures had nothing in flight: purging the one sink would only have dropped what the
    // other table's pump had queued.
    assert_eq!(sink.purges.load(Ordering::SeqCst), 0);

    lock.rollback().await.unwrap();
    let billing_left = "SELECT count(*) FROM billing_outbox WHERE published_at IS NULL";
    f.wait_until_zero(billing_left, Duration::from_secs(60))
        .await;
    shutdown.cancel();
    running.await.unwrap().expect("the relay refused to run");
    let ids: std::collections::HashSet<_> = sink
        .kept
        .messages()
        .into_iter()
        .map(|m| m.event_id)
        .collect();
    assert_eq!(ids.len(), 120, "each event of both tables published");
}

#[tokio::test]
async fn a_tables_notify_trigger_wakes_its_own_channel_only() {
    let f = Fixture::new().await;
    migrate_billing(&f.url, &["--notify-trigger"]);
    let mut listener = sqlx::postgres::PgListener::connect(&f.url).await.unwrap();
    listener
        .listen_all(["billing_outbox", "outbox"])
        .await
        .unwrap();
    let txn = f.db.begin().await.unwrap();
    InvoiceIssued {
        invoice_id: 1,
        n: 0,
    }
    .record(&txn)
    .await
    .unwrap();
    txn.commit().await.unwrap();
    let woken = tokio::time::timeout(Duration::from_secs(10), listener.recv())
        .await
        .expect("no notification within 10 s")
        .unwrap();
    assert_eq!(woken.channel(), "billing_outbox");
    // The default table has no trigger here: an insert into it wakes nobody.
    let txn = f.db.begin().await.unwrap();
    OrderPlaced { order_id: 1, n: 0 }
        .record(&txn)
        .await
        .unwrap();
    txn.commit().await.unwrap();
    let quiet = tokio::time::timeout(Duration::from_millis(500), listener.recv()).await;
    assert!(
        quiet.is_err(),
        "woken by an insert into another table: {quiet:?}"
    );
}

/// One count from `db`.
async fn count(db: &DatabaseConnection, sql: &str) -> i64 {
    db.query_one_raw(seaorm_outbox::sea_orm::Statement::from_string(
        db.get_database_backend(),
        sql,
    ))
    .await
    .unwrap()
    .unwrap()
    .try_get::<i64>("", "n")
    .unwrap()
}

/// A relay of one table publishes that table alone, parks its poison rows in it and lists them
/// with `failed --table`, whatever the other table holds; on SQLite and MariaDB.
async fn one_relay_publishes_its_table_alone(url: String, db: DatabaseConnection) {
    migrate_billing(&url, &[]);
    record_both(&db, 30).await;
    // One poison invoice: a payload over the relay's limit.
    let txn = db.begin().await.unwrap();
    let mut poison = NewEvent::from_event(&InvoiceIssued {
        invoice_id: 99,
        n: 99,
    })
    .unwrap();
    poison.payload = serde_json::json!({ "padding": "x".repeat(500) });
    seaorm_outbox::record_new_events(&txn, vec![poison])
        .await
        .unwrap();
    txn.commit().await.unwrap();

    let mut relay = common::KillOnDrop::spawn_logged(
        common::relay_command()
            .args([
                "run",
                "--database-url",
                &url,
                "--table",
                "billing_outbox",
                "--sink",
                "stdout",
            ])
            .args([
                "--max-payload-bytes",
                "200",
                "--poll-interval",
                "20ms",
                "--http-addr",
                "off",
            ])
            .stdout(std::process::Stdio::piped()),
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let left =
        "SELECT count(*) AS n FROM billing_outbox WHERE published_at IS NULL AND parked_at IS NULL";
    while count(&db, left).await > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "billing_outbox not drained in 60 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(common::terminate(&mut relay), Some(0));
    let mut printed = String::new();
    std::io::Read::read_to_string(relay.stdout.as_mut().unwrap(), &mut printed).unwrap();
    let keys: Vec<String> = printed
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["key"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    assert_eq!(keys.len(), 30, "{printed}");
    assert!(!keys.contains(&"99".to_owned()));
    assert!(
        printed
            .lines()
            .all(|l| l.contains("\"aggregate_type\":\"invoice\"")),
        "{printed}"
    );
    // The other table was not touched.
    let unpublished = count(
        &db,
        "SELECT count(*) AS n FROM outbox WHERE published_at IS NULL",
    )
    .await;
    assert_eq!(unpublished, 30);

    let failed = common::relay_command()
        .args([
            "failed",
            "--database-url",
            &url,
            "--table",
            "billing_outbox",
            "list",
        ])
        .output()
        .unwrap();
    let listed = String::from_utf8_lossy(&failed.stdout);
    assert!(
        failed.status.success(),
        "{}",
        String::from_utf8_lossy(&failed.stderr)
    );
    assert!(listed.contains("payload too large"), "{listed}");
    let default = common::relay_command()
        .args(["failed", "--database-url", &url, "list"])
        .output()
        .unwrap();
    assert!(default.status.success());
    assert!(
        !String::from_utf8_lossy(&default.stdout).contains("payload too large"),
        "the default table lists another table's parked event"
    );

    // Then one relay for both (on SQLite, which allows one relay per database, the only way to
    // publish two tables): the default table's 30 go out, the parked invoice stays parked.
    let mut relay = common::KillOnDrop::spawn_logged(
        common::relay_command()
            .args([
                "run",
                "--database-url",
                &url,
                "--table",
                "billing_outbox,outbox",
            ])
            .args([
                "--sink",
                "stdout",
                "--poll-interval",
                "20ms",
                "--http-addr",
                "off",
            ])
            .args(["--max-payload-bytes", "200"])
            .stdout(std::process::Stdio::piped()),
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let left = "SELECT count(*) AS n FROM outbox WHERE published_at IS NULL AND parked_at IS NULL";
    while count(&db, left).await > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "outbox not drained in 60 s:\n{}",
            relay.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(common::terminate(&mut relay), Some(0));
    let mut printed = String::new();
    std::io::Read::read_to_string(relay.stdout.as_mut().unwrap(), &mut printed).unwrap();
    assert_eq!(printed.lines().count(), 30, "{printed}");
    assert!(
        printed
            .lines()
            .all(|l| l.contains("\"aggregate_type\":\"order\"")),
        "{printed}"
    );
    let parked = "SELECT count(*) AS n FROM billing_outbox WHERE parked_at IS NOT NULL";
    assert_eq!(count(&db, parked).await, 1);
}

#[tokio::test]
async fn on_sqlite_one_relay_publishes_its_table_alone() {
    let dir = outbox_tests::temp_dir();
    let url = format!("sqlite://{}?mode=rwc", dir.join("two.db").display());
    let db = seaorm_outbox::sea_orm::Database::connect(&url)
        .await
        .unwrap();
    seaorm_outbox::migration::migrate(&db).await.unwrap();
    one_relay_publishes_its_table_alone(url, db).await;
}

#[tokio::test]
async fn on_mariadb_one_relay_publishes_its_table_alone() {
    let url = outbox_tests::mariadb_database_url().await;
    let db = seaorm_outbox::sea_orm::Database::connect(&url)
        .await
        .unwrap();
    seaorm_outbox::migration::migrate(&db).await.unwrap();
    one_relay_publishes_its_table_alone(url, db).await;
}
