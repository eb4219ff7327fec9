//! Several outbox tables in one database, on real PostgreSQL, Kafka, SQLite and MariaDB: one relay
//! per table, each publishing its own table's events to their topics in order, with shard leases
//! of its own (two relays of two tables never split each other's shards), its own `status` and
//! `failed` commands, and its own NOTIFY channel.

mod common;

use common::Fixture;
use common::kafka::consume;
use seaorm_outbox::sea_orm::{ConnectionTrait, DatabaseConnection, TransactionTrait};
use seaorm_outbox::{NewEvent, OutboxEvent};
use serde::Serialize;
use std::collections::BTreeMap;
use std::time::Duration;

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

    for kind in ["order", "invoice"] {
        let received = consume(&[&f.topic(kind)], 400, Duration::from_secs(60)).await;
        let received = received
            .iter()
            .map(|m| (m.key.clone(), m.json()["n"].as_u64().unwrap()));
        let duplicates = common::assert_complete_and_ordered(received, &expected[kind]);
        assert_eq!(duplicates, 0, "{kind}: a clean run re-sent events");
    }

    // `status --table` reads that table.
    let status = common::relay_command()
        .args([
            "status",
            "--database-url",
            &f.url,
            "--table",
            "billing_outbox",
        ])
        .output()
        .unwrap();
    let printed = String::from_utf8_lossy(&status.stdout);
    assert!(
        status.status.success(),
        "{}",
        String::from_utf8_lossy(&status.stderr)
    );
    assert!(printed.contains("backlog:            0"), "{printed}");
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
