//! The WAL source (`outbox-relay run --source wal`) on a real PostgreSQL (`wal_level=logical`) and
//! Kafka: the contract, commit order, poison events, the guard against a second source, and
//! faults (kill -9, the broker away for 30 s, PostgreSQL restarting, a standby taking over).
//! Every test checks what a consumer received: nothing lost, each aggregate's first deliveries in
//! order.
//!
//! The faults hit the shared services, so the tests of this file run one at a time.

mod common;

use common::kafka::consume;
use common::meters::{Reading, Writer, assert_complete_and_ordered, reading, readings_of};
use common::wal::WalFixture;
use common::{relay_command, services};
use seaorm_outbox::OutboxEvent;
use seaorm_outbox::sea_orm::{ConnectionTrait, DbBackend, Statement, TransactionTrait};
use seaorm_outbox_relay::sink::memory::MemorySink;
use seaorm_outbox_relay::{Relay, Source};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Inserts reading `n` of `meter` as a row; `headers` as SQL (`'[1]'`, headers that are not a
/// JSON object, makes it a poison event).
async fn insert(w: &WalFixture, meter: &str, n: u64, headers: &str) {
    w.f.db
        .execute_unprepared(&format!(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, headers)
             VALUES (gen_random_uuid(), 'meter', '{meter}', 'Reading', '{{\"meter\": \"{meter}\", \"n\": {n}}}', {headers})"
        ))
        .await
        .unwrap();
}

/// Mends `meter`'s rows: headers that are a JSON object (none), so a retry can publish them.
async fn mend(w: &WalFixture, meter: &str) {
    w.f.db
        .execute_unprepared(&format!(
            "UPDATE outbox SET headers = NULL WHERE aggregate_id = '{meter}'"
        ))
        .await
        .unwrap();
}

/// Each row's seq, aggregate and state (parked, held, published), for a failure's message.
async fn rows_state(w: &WalFixture) -> String {
    let rows =
        w.f.db
            .query_all_raw(Statement::from_string(
                DbBackend::Postgres,
                "SELECT seq || ' ' || aggregate_id || ' parked=' || (parked_at IS NOT NULL)
                        || ' held=' || (held_at IS NOT NULL)
                        || ' published=' || (published_at IS NOT NULL)
                 FROM outbox ORDER BY seq",
            ))
            .await
            .unwrap();
    rows.iter()
        .map(|r| r.try_get_by_index::<String>(0).unwrap())
        .collect::<Vec<_>>()
        .join("; ")
}

/// The WAITING column of `failed list` for the parked event of `meter`.
fn waiting_behind(list: &str, meter: &str) -> String {
    let line = list
        .lines()
        .find(|l| l.contains(&format!("meter:{meter} ")))
        .unwrap_or_else(|| panic!("no parked event of {meter}: {list}"));
    line.split_whitespace().nth(4).unwrap().to_owned()
}

#[tokio::test]
async fn rows_are_published_under_the_contract_and_the_table_left_unmarked() {
    let _one = ONE_AT_A_TIME.lock().await;
    let w = WalFixture::new().await;
    let mut relay = w.spawn_relay(&[]);
    w.wait_for_slot().await;
    for n in 0..30 {
        let txn = w.f.db.begin().await.unwrap();
        Reading {
            meter: format!("m-{}", n % 3),
            n,
        }
        .record(&txn)
        .await
        .unwrap();
        txn.commit().await.unwrap();
    }
    // A rolled-back transaction is never seen.
    let txn = w.f.db.begin().await.unwrap();
    Reading {
        meter: "m-0".into(),
        n: 999,
    }
    .record(&txn)
    .await
    .unwrap();
    txn.rollback().await.unwrap();

    let received = consume(&[&w.f.topic("meter")], 30, Duration::from_secs(60)).await;
    assert_eq!(
        assert_complete_and_ordered(&received, 30, 3),
        0,
        "duplicates without a fault"
    );
    let ids: Vec<String> = {
        let rows =
            w.f.db
                .query_all_raw(Statement::from_string(
                    DbBackend::Postgres,
                    "SELECT id::text FROM outbox ORDER BY seq",
                ))
                .await
                .unwrap();
        rows.iter()
            .map(|r| r.try_get_by_index::<String>(0).unwrap())
            .collect()
    };
    for (m, id) in received.iter().zip(&ids) {
        assert_eq!(m.key, m.json()["meter"].as_str().unwrap());
        assert_eq!(m.header("event_type"), Some("Reading"));
        assert_eq!(m.header("aggregate_type"), Some("meter"));
        assert_eq!(m.header("event_version"), Some("1"));
        assert!(
            ids.iter().any(|i| Some(i.as_str()) == m.header("id")),
            "unknown id {:?}",
            m.header("id")
        );
        let _ = id;
    }
    assert_eq!(
        w.f.scalar("SELECT count(*) FROM outbox WHERE published_at IS NOT NULL")
            .await,
        0
    );
    w.wait_until_confirmed(Duration::from_secs(30)).await;

    // `status` shows the slot being read.
    let text = w.status();
    assert!(
        text.contains(&format!("slot {}:", w.source.slot)) && text.contains("read by a relay"),
        "{text}"
    );

    // A polling relay refuses this table: it would publish every event again.
    let mut polling = relay_command()
        .args([
            "run",
            "--database-url",
            &w.f.url,
            "--kafka-brokers",
            &common::kafka::brokers(),
            "--http-addr",
            "off",
        ])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let (status, stderr) = common::wait_for_exit(
        &mut polling,
        Duration::from_secs(30),
        "the polling relay ran",
    );
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!("publication {}", w.source.publication))
            && stderr.contains("wal drop"),
        "{stderr}"
    );

    assert_eq!(common::terminate(&mut relay), Some(0));
    w.drop_slot().await;
    let dropped = w.wal_drop(false);
    assert!(String::from_utf8_lossy(&dropped.stdout).contains("nothing to drop"));
}

/// The order the relay hands events to its sink is the WAL's commit order, read independently
/// through a `test_decoding` slot created before the writers start.
#[tokio::test]
async fn events_go_out_in_commit_order_across_concurrent_writers() {
    let _one = ONE_AT_A_TIME.lock().await;
    let w = WalFixture::new().await;
    let reference = format!("{}_ref", w.source.slot);
    w.f.db
        .execute_unprepared(&format!(
            "SELECT pg_create_logical_replication_slot('{reference}', 'test_decoding')"
        ))
        .await
        .unwrap();
    let sink = MemorySink::default();
    let mut config = w.f.relay_config();
    config.source = Source::Wal(w.source.clone());
    let relay = Arc::new(Relay::new(config, sink.clone()));
    relay.check_source().await.expect("the source prepares");
    let shutdown = CancellationToken::new();
    let running = tokio::spawn({
        let (relay, shutdown) = (relay.clone(), shutdown.clone());
        async move { relay.run(shutdown).await.expect("the relay refused to run") }
    });

    const WRITERS: u64 = 6;
    const EACH: u64 = 60;
    let mut writers = Vec::new();
    for writer in 0..WRITERS {
        let db = w.f.db.clone();
        writers.push(tokio::spawn(async move {
            for step in 0..EACH {
                let txn = db.begin().await.unwrap();
                // Two aggregates per transaction, shared across writers, so commits interleave.
                let pair = [step % 4, (step + writer) % 4].map(|meter| Reading {
                    meter: format!("m-{meter}"),
                    n: writer * 1000 + step,
                });
                seaorm_outbox::record_all(&txn, &pair).await.unwrap();
                txn.commit().await.unwrap();
            }
        }));
    }
    for w in writers {
        w.await.unwrap();
    }
    let total = (WRITERS * EACH * 2) as usize;
    let deadline = Instant::now() + Duration::from_secs(60);
    while sink.messages().len() < total {
        assert!(
            Instant::now() < deadline,
            "{} of {total} events reached the sink",
            sink.messages().len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    shutdown.cancel();
    running.await.unwrap();

    let rows =
        w.f.db
            .query_all_raw(Statement::from_string(
                DbBackend::Postgres,
                format!(
                    "SELECT data FROM pg_logical_slot_get_changes('{reference}', NULL, NULL)
                     WHERE data LIKE 'table ' || current_schema() || '.outbox: INSERT:%'"
                ),
            ))
            .await
            .unwrap();
    let in_wal_order: Vec<String> = rows
        .iter()
        .map(|r| {
            let data = r.try_get_by_index::<String>(0).unwrap();
            let start = data.find("id[uuid]:'").expect("an id column") + "id[uuid]:'".len();
            data[start..start + 36].to_owned()
        })
        .collect();
    w.f.db
        .execute_unprepared(&format!("SELECT pg_drop_replication_slot('{reference}')"))
        .await
        .unwrap();
    let sent: Vec<String> = sink
        .messages()
        .iter()
        .map(|m| m.event_id.to_string())
        .collect();
    assert_eq!(in_wal_order.len(), total);
    assert_eq!(
        sent, in_wal_order,
        "the relay's order is not the WAL's commit order"
    );
    w.drop_slot().await;
}

/// A poison event is parked with its reason, its aggregate's later events wait behind it while
/// other aggregates flow, and `failed retry` sends them all, in order, once the cause is fixed.
#[tokio::test]
async fn a_poison_row_is_parked_and_retried_in_order() {
    let _one = ONE_AT_A_TIME.lock().await;
    let w = WalFixture::new().await;
    let mut relay = w.spawn_relay(&[]);
    w.wait_for_slot().await;
    // m-bad's first event has headers that are not a JSON object: it can never be published.
    insert(&w, "m-bad", 0, "'[1]'").await;
    insert(&w, "m-bad", 1, "NULL").await;
    insert(&w, "m-ok", 2, "NULL").await;
    let ok = consume(&[&w.f.topic("meter")], 1, Duration::from_secs(60)).await;
    assert_eq!(
        ok.iter().map(|m| m.key.as_str()).collect::<Vec<_>>(),
        ["m-ok"]
    );
    w.wait_until_confirmed(Duration::from_secs(30)).await;
    let list = w.failed(&["list"]);
    assert!(list.contains("headers must be a JSON object"), "{list}");
    assert_eq!(
        waiting_behind(&list, "m-bad"),
        "1",
        "{list}\nrows: {}\nthe relay's log:\n{}",
        rows_state(&w).await,
        relay.log()
    );
    assert_eq!(list.lines().count(), 2, "one parked event: {list}");

    // Fix the row, retry: both go out, in their order.
    mend(&w, "m-bad").await;
    let retried = w.failed(&["retry", "--all"]);
    assert!(retried.contains("1 events will be retried"), "{retried}");
    let received = consume(&[&w.f.topic("meter")], 3, Duration::from_secs(60)).await;
    assert_eq!(readings_of(&received, "m-bad"), [0, 1]);
    assert_eq!(
        w.f.scalar(
            "SELECT count(*) FROM outbox WHERE published_at IS NULL
             AND (parked_at IS NOT NULL OR held_at IS NOT NULL)"
        )
        .await,
        0
    );
    assert_eq!(common::terminate(&mut relay), Some(0));
    w.drop_slot().await;
}

/// The WAL source prunes rows by age (`--retention`: their UUIDv7 ids and `created_at`), keeping
/// parked and held rows and those within the window, whatever their ids; every event was published
/// from the WAL all the same.
#[tokio::test]
async fn the_wal_source_prunes_old_rows_but_keeps_parked_and_held_ones() {
    let _one = ONE_AT_A_TIME.lock().await;
    let w = WalFixture::new().await;
    let mut relay = w.spawn_relay(&["--retention", "1d", "--prune-interval", "100ms"]);
    w.wait_for_slot().await;
    let two_days_ago = std::time::SystemTime::now() - Duration::from_secs(2 * 86_400);
    let seconds = two_days_ago
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let old_id =
        |n: u64| uuid::Uuid::new_v7(uuid::Timestamp::from_unix(uuid::NoContext, seconds + n, 0));
    // Each row created when its id was made, as `record` makes both.
    let row = |id: uuid::Uuid, created: &str, meter: &str, n: u64, headers: &str| {
        format!(
            "('{id}', {created}, 'meter', '{meter}', 'Reading', '{{\"meter\": \"{meter}\", \"n\": {n}}}', {headers})"
        )
    };
    let two_days_ago = format!("to_timestamp({seconds})");
    let mut values: Vec<String> = (0..300)
        .map(|n| row(old_id(n), &two_days_ago, "m-old", n, "NULL"))
        .collect();
    // m-bad's first event can never be published: parked, and its second held behind it.
    values.push(row(old_id(300), &two_days_ago, "m-bad", 0, "'[1]'"));
    values.push(row(old_id(301), &two_days_ago, "m-bad", 1, "NULL"));
    values.extend((0..10).map(|n| row(uuid::Uuid::now_v7(), "now()", "m-new", n, "NULL")));
    // Another writer's random (version 4) UUID that sorts below every UUIDv7 of the last two
    // days: a young row all the same.
    let low_v4 = uuid::Uuid::parse_str("00000000-0000-4000-8000-000000000001").unwrap();
    values.push(row(low_v4, "now()", "m-v4", 0, "NULL"));
    w.f.db
        .execute_unprepared(&format!(
            "INSERT INTO outbox (id, created_at, aggregate_type, aggregate_id, event_type, payload, headers) VALUES {}",
            values.join(", ")
        ))
        .await
        .unwrap();
    let received = consume(&[&w.f.topic("meter")], 311, Duration::from_secs(60)).await;
    assert_eq!(
        readings_of(&received, "m-old"),
        (0..300).collect::<Vec<_>>()
    );
    assert_eq!(readings_of(&received, "m-new"), (0..10).collect::<Vec<_>>());
    assert!(readings_of(&received, "m-bad").is_empty());
    w.f.wait_until_zero(
        "SELECT count(*) FROM outbox WHERE aggregate_id = 'm-old'",
        Duration::from_secs(30),
    )
    .await;
    assert_eq!(
        w.f.scalar("SELECT count(*) FROM outbox WHERE aggregate_id IN ('m-new', 'm-v4')")
            .await,
        11,
        "rows within the retention window stay, whatever their ids"
    );
    assert_eq!(
        w.f.scalar(
            "SELECT count(*) FROM outbox WHERE aggregate_id = 'm-bad'
             AND (parked_at IS NOT NULL OR held_at IS NOT NULL)"
        )
        .await,
        2,
        "the parked and the held event stay"
    );
    assert_eq!(common::terminate(&mut relay), Some(0));
    w.drop_slot().await;
}

/// An event of the aggregate committed behind a parked one, and not yet read when the operator
/// retries (here the relay is stopped meanwhile): the retried event still goes out first. (The
/// relay once sent the later event at once, the table showing nothing parked any more.)
#[tokio::test]
async fn a_retried_event_goes_out_before_a_later_one_committed_behind_it() {
    let _one = ONE_AT_A_TIME.lock().await;
    let w = WalFixture::new().await;
    let mut relay = w.spawn_relay(&[]);
    w.wait_for_slot().await;
    insert(&w, "m-bad", 0, "'[1]'").await;
    insert(&w, "m-ok", 1, "NULL").await;
    consume(&[&w.f.topic("meter")], 1, Duration::from_secs(60)).await;
    w.wait_until_confirmed(Duration::from_secs(30)).await;
    assert_eq!(common::terminate(&mut relay), Some(0));

    insert(&w, "m-bad", 2, "NULL").await;
    mend(&w, "m-bad").await;
    let retried = w.failed(&["retry", "--aggregate", "meter:m-bad"]);
    assert!(retried.contains("1 events will be retried"), "{retried}");
    let mut relay = w.spawn_relay(&[]);
    let received = consume(&[&w.f.topic("meter")], 3, Duration::from_secs(60)).await;
    let mut first = readings_of(&received, "m-bad");
    first.dedup();
    assert_eq!(first, [0, 2], "m-bad's deliveries: {received:?}");
    assert_eq!(common::terminate(&mut relay), Some(0));
    w.drop_slot().await;
}

/// A row pruned before the relay read its insert (a backlog older than `--retention`), then
/// parked: it comes back into the table under its own `seq`, ahead of its aggregate's later events
/// held there, so they wait behind it and the retry sends them in order. (It once came back under a
/// new `seq`, behind them: the list showed nothing waiting, and the retry sent them first.)
#[tokio::test]
async fn a_row_pruned_before_it_was_parked_keeps_its_place_ahead_of_its_aggregates_later_events() {
    let _one = ONE_AT_A_TIME.lock().await;
    let w = WalFixture::new().await;
    let mut relay = w.spawn_relay(&[]);
    w.wait_for_slot().await;
    assert_eq!(common::terminate(&mut relay), Some(0));

    // While no relay reads: m-x's poison event and the next, the first's row then pruned (its
    // insert stays in the WAL).
    insert(&w, "m-x", 0, "'[1]'").await;
    insert(&w, "m-x", 1, "NULL").await;
    let first_seq =
        w.f.scalar("SELECT min(seq) FROM outbox WHERE aggregate_id = 'm-x'")
            .await;
    w.f.db
        .execute_unprepared(&format!("DELETE FROM outbox WHERE seq = {first_seq}"))
        .await
        .unwrap();
    insert(&w, "m-ok", 2, "NULL").await;
    let mut relay = w.spawn_relay(&[]);
    consume(&[&w.f.topic("meter")], 1, Duration::from_secs(60)).await;
    w.wait_until_confirmed(Duration::from_secs(30)).await;
    assert_eq!(
        w.f.scalar("SELECT seq FROM outbox WHERE aggregate_id = 'm-x' AND parked_at IS NOT NULL")
            .await,
        first_seq,
        "rows: {}",
        rows_state(&w).await
    );
    let list = w.failed(&["list"]);
    assert_eq!(waiting_behind(&list, "m-x"), "1", "{list}");

    mend(&w, "m-x").await;
    let retried = w.failed(&["retry", "--all"]);
    assert!(retried.contains("1 events will be retried"), "{retried}");
    let received = consume(&[&w.f.topic("meter")], 3, Duration::from_secs(60)).await;
    assert_eq!(readings_of(&received, "m-x"), [0, 1], "{received:?}");
    assert_eq!(common::terminate(&mut relay), Some(0));
    w.drop_slot().await;
}

/// `failed retry --id` of one of an aggregate's two parked events: it stays behind the earlier
/// parked one, with what is held, and all go out in order once that one is retried too.
#[tokio::test]
async fn retrying_one_of_an_aggregates_parked_events_keeps_it_behind_the_earlier_one() {
    let _one = ONE_AT_A_TIME.lock().await;
    let w = WalFixture::new().await;
    // A relay that does not hold an aggregate behind its parked event parks two of m-x's.
    let mut relay = w.spawn_relay(&["--skip-parked"]);
    w.wait_for_slot().await;
    for (n, headers) in [(0, "'[1]'"), (1, "NULL"), (2, "'[1]'"), (3, "NULL")] {
        insert(&w, "m-x", n, headers).await;
    }
    let topic = w.f.topic("meter");
    consume(&[&topic], 2, Duration::from_secs(60)).await;
    w.wait_until_confirmed(Duration::from_secs(30)).await;
    assert_eq!(common::terminate(&mut relay), Some(0));

    let mut relay = w.spawn_relay(&[]);
    w.wait_until_reading().await;
    insert(&w, "m-x", 4, "NULL").await;
    mend(&w, "m-x").await;
    let id_of = |n: u64| {
        let db = w.f.db.clone();
        async move {
            let sql = format!(
                "SELECT id::text FROM outbox WHERE aggregate_id = 'm-x' AND (payload->>'n')::int = {n}"
            );
            let row = db
                .query_one_raw(Statement::from_string(DbBackend::Postgres, sql))
                .await
                .unwrap()
                .unwrap();
            row.try_get_by_index::<String>(0).unwrap()
        }
    };
    let retried = w.failed(&["retry", "--id", &id_of(2).await]);
    assert!(retried.contains("1 events will be retried"), "{retried}");
    // The release was read (its message is confirmed), and let nothing out.
    w.wait_until_confirmed(Duration::from_secs(30)).await;
    let received = consume(&[&topic], 2, Duration::from_secs(60)).await;
    assert_eq!(readings_of(&received, "m-x"), [1, 3], "m-x's deliveries");

    let retried = w.failed(&["retry", "--id", &id_of(0).await]);
    assert!(retried.contains("1 events will be retried"), "{retried}");
    let received = consume(&[&topic], 5, Duration::from_secs(60)).await;
    assert_eq!(
        readings_of(&received, "m-x"),
        [1, 3, 0, 2, 4],
        "m-x's deliveries"
    );
    assert_eq!(common::terminate(&mut relay), Some(0));
    w.drop_slot().await;
}

/// `failed skip` gives up on exactly the events it names (by id, by aggregate, all) and the
/// events held behind them go out, in order. (It once skipped the held events too, or left them
/// held for good.)
#[tokio::test]
async fn failed_skip_skips_exactly_what_it_names_and_releases_the_rest_in_order() {
    let _one = ONE_AT_A_TIME.lock().await;
    let w = WalFixture::new().await;
    let mut relay = w.spawn_relay(&[]);
    w.wait_for_slot().await;
    for meter in ["m-a", "m-b", "m-c"] {
        insert(&w, meter, 0, "'[1]'").await;
        insert(&w, meter, 1, "NULL").await;
        insert(&w, meter, 2, "NULL").await;
    }
    insert(&w, "m-ok", 9, "NULL").await;
    let topic = w.f.topic("meter");
    consume(&[&topic], 1, Duration::from_secs(60)).await;
    w.wait_until_confirmed(Duration::from_secs(30)).await;
    let list = w.failed(&["list"]);
    for meter in ["m-a", "m-b", "m-c"] {
        assert_eq!(waiting_behind(&list, meter), "2", "{list}");
    }
    let status = w.status();
    assert!(status.contains("held:               6 events"), "{status}");

    let id_of_a = {
        let row = w
            .f
            .db
            .query_one_raw(Statement::from_string(
                DbBackend::Postgres,
                "SELECT id::text FROM outbox WHERE aggregate_id = 'm-a' AND parked_at IS NOT NULL",
            ))
            .await
            .unwrap()
            .unwrap();
        row.try_get_by_index::<String>(0).unwrap()
    };
    let skipped = w.failed(&["skip", "--id", &id_of_a, "--reason", "bad headers"]);
    assert!(skipped.contains("1 events skipped"), "{skipped}");
    let received = consume(&[&topic], 3, Duration::from_secs(60)).await;
    assert_eq!(readings_of(&received, "m-a"), [1, 2]);
    assert_eq!(readings_of(&received, "m-b"), Vec::<u64>::new());

    let skipped = w.failed(&[
        "skip",
        "--aggregate",
        "meter:m-b",
        "--reason",
        "bad headers",
    ]);
    assert!(skipped.contains("1 events skipped"), "{skipped}");
    let received = consume(&[&topic], 5, Duration::from_secs(60)).await;
    assert_eq!(readings_of(&received, "m-b"), [1, 2]);
    assert_eq!(readings_of(&received, "m-c"), Vec::<u64>::new());

    let skipped = w.failed(&["skip", "--all", "--reason", "bad headers"]);
    assert!(skipped.contains("1 events skipped"), "{skipped}");
    let received = consume(&[&topic], 7, Duration::from_secs(60)).await;
    assert_eq!(
        readings_of(&received, "m-c"),
        [1, 2],
        "{received:?}\nrows: {}\nthe relay's log:\n{}",
        rows_state(&w).await,
        relay.log()
    );
    assert_eq!(received.len(), 7, "{received:?}");
    assert_eq!(
        w.f.scalar("SELECT count(*) FROM outbox WHERE last_error LIKE 'skipped by an operator: bad headers'")
            .await,
        3
    );
    assert!(w.failed(&["list"]).contains("no parked events"));
    assert_eq!(common::terminate(&mut relay), Some(0));
    w.drop_slot().await;
}

/// The stream replays from the confirmed position after a crash: a parked event read again
/// keeps the reason it was parked for (it was overwritten with "waiting behind ..." once), and
/// stays parked.
#[tokio::test]
async fn a_parked_event_read_again_keeps_its_reason() {
    let _one = ONE_AT_A_TIME.lock().await;
    let w = WalFixture::new().await;
    let mut relay = w.spawn_relay(&["--kafka-option", "message.timeout.ms=1000"]);
    w.wait_for_slot().await;
    w.wait_until_reading().await;
    services("pause-kafka");
    // One transaction: a poison event, parked at once, and one the broker cannot answer now, so
    // the transaction is not confirmed.
    let txn = w.f.db.begin().await.unwrap();
    txn.execute_unprepared(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, headers) VALUES
         (gen_random_uuid(), 'meter', 'm-bad', 'Reading', '{\"n\": 0}', '[1]'),
         (gen_random_uuid(), 'meter', 'm-ok', 'Reading', '{\"n\": 1}', NULL)",
    )
    .await
    .unwrap();
    txn.commit().await.unwrap();
    w.f.wait_until_zero(
        "SELECT CASE WHEN count(*) > 0 THEN 0 ELSE 1 END::bigint FROM outbox
         WHERE aggregate_id = 'm-bad' AND parked_at IS NOT NULL",
        Duration::from_secs(60),
    )
    .await;
    // A crash before the transaction is confirmed: the next relay reads it again.
    common::signal(&relay, "KILL");
    relay.wait().unwrap();
    services("resume-kafka");
    let mut relay = w.spawn_relay(&[]);
    let received = consume(&[&w.f.topic("meter")], 1, Duration::from_secs(60)).await;
    assert_eq!(received[0].key, "m-ok");
    w.wait_until_confirmed(Duration::from_secs(60)).await;
    let reason: String = {
        let row =
            w.f.db
                .query_one_raw(Statement::from_string(
                    DbBackend::Postgres,
                    "SELECT last_error FROM outbox WHERE aggregate_id = 'm-bad' AND parked_at IS NOT NULL",
                ))
                .await
                .unwrap()
                .expect("the poison event is still parked");
        row.try_get_by_index(0).unwrap()
    };
    assert!(
        reason.contains("headers must be a JSON object"),
        "the parked event's reason: {reason}"
    );
    assert_eq!(common::terminate(&mut relay), Some(0));
    w.drop_slot().await;
}

#[tokio::test]
async fn the_wal_source_refuses_to_start_beside_polling_relays_or_on_sqlite() {
    let _one = ONE_AT_A_TIME.lock().await;
    let w = WalFixture::new().await;
    let mut polling = w.f.spawn_relay(&[]);
    w.f.wait_until_zero(
        "SELECT CASE WHEN count(*) > 0 THEN 0 ELSE 1 END::bigint FROM pg_locks WHERE locktype = 'advisory' AND objid >= 256",
        Duration::from_secs(30),
    )
    .await;
    let (status, stderr) = w.run_refused();
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("polling relay(s) publish this outbox table"),
        "{stderr}"
    );
    assert_eq!(common::terminate(&mut polling), Some(0));

    let sqlite = relay_command()
        .args([
            "run",
            "--database-url",
            "sqlite:///tmp/none.db",
            "--source",
            "wal",
        ])
        .output()
        .unwrap();
    assert_eq!(sqlite.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&sqlite.stderr).contains("--source wal needs PostgreSQL"));
}

/// Publications of the table made by other tools (Debezium's, a warehouse sync's) are told from a
/// WAL relay's: a polling relay runs beside one and says so once; a WAL relay refuses a
/// publication of its name that does not publish the outbox table, and from one that publishes
/// other tables too it takes only the outbox table's inserts.
#[tokio::test]
async fn other_tools_publications_are_told_from_the_wal_relays() {
    let _one = ONE_AT_A_TIME.lock().await;
    let w = WalFixture::new().await;
    let db = &w.f.db;
    let foreign = format!("{}_cdc", w.source.publication);
    db.execute_unprepared(&format!("CREATE PUBLICATION {foreign} FOR TABLE outbox"))
        .await
        .unwrap();
    insert(&w, "m-0", 0, "'{}'").await;
    let mut polling = w.f.spawn_relay(&[]);
    w.f.wait_until_drained(Duration::from_secs(30)).await;
    assert_eq!(common::terminate(&mut polling), Some(0));
    let log = polling.log();
    assert_eq!(
        log.matches("in another tool's publication").count(),
        1,
        "{log}"
    );
    assert!(log.contains(&foreign), "{log}");
    db.execute_unprepared(&format!("DROP PUBLICATION {foreign}"))
        .await
        .unwrap();

    // A publication of the WAL relay's name, of another table only.
    db.execute_unprepared("CREATE TABLE other (id bigint PRIMARY KEY, note text)")
        .await
        .unwrap();
    db.execute_unprepared(&format!(
        "CREATE PUBLICATION {} FOR TABLE other",
        w.source.publication
    ))
    .await
    .unwrap();
    let (status, stderr) = w.run_refused();
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "publication {} exists but does not publish the inserts of this schema's outbox table",
            w.source.publication
        )),
        "{stderr}"
    );

    // With the outbox table added, the relay reads it and leaves the other table's inserts alone.
    db.execute_unprepared(&format!(
        "ALTER PUBLICATION {} ADD TABLE outbox",
        w.source.publication
    ))
    .await
    .unwrap();
    let mut relay = w.spawn_relay(&[]);
    w.wait_for_slot().await;
    for n in 1..=3 {
        insert(&w, "m-0", n, "'{}'").await;
        db.execute_unprepared(&format!("INSERT INTO other VALUES ({n}, 'not an event')"))
            .await
            .unwrap();
    }
    let received = consume(&[&w.f.topic("meter")], 4, Duration::from_secs(60)).await;
    assert_eq!(assert_complete_and_ordered(&received, 4, 1), 0);
    w.wait_until_confirmed(Duration::from_secs(30)).await;
    assert_eq!(
        w.f.scalar("SELECT count(*) FROM outbox").await,
        4,
        "no event made of the other table's rows"
    );
    assert_eq!(common::terminate(&mut relay), Some(0));
    let log = relay.log();
    assert!(!log.contains("parked") && !log.contains("ERROR"), "{log}");
    w.drop_slot().await;
}

/// A slot dropped after a relay read it is a gap, not a first start: the running relay stops,
/// naming it, instead of creating a slot that would start past the events committed meanwhile;
/// `status` shows it, a new start refuses too, and `outbox-relay wal drop` acknowledges the gap:
/// the next start creates the slot again and publishes the rows the table holds, the gap's among
/// them.
#[tokio::test]
async fn a_dropped_slot_stops_the_relay_instead_of_starting_past_the_gap() {
    let _one = ONE_AT_A_TIME.lock().await;
    let w = WalFixture::new().await;
    let slot = &w.source.slot;
    let mut relay = w.spawn_relay(&[]);
    w.wait_for_slot().await;
    w.wait_until_reading().await;
    insert(&w, "m-0", 0, "'{}'").await;
    consume(&[&w.f.topic("meter")], 1, Duration::from_secs(60)).await;

    // The relay frozen, its stream cut and its slot dropped; an event committed in the gap.
    common::signal(&relay, "STOP");
    w.f.db
        .execute_unprepared(&format!(
            "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = '{slot}'"
        ))
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while w
        .f
        .db
        .execute_unprepared(&format!("SELECT pg_drop_replication_slot('{slot}')"))
        .await
        .is_err()
    {
        assert!(Instant::now() < deadline, "the slot stays active");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    insert(&w, "m-0", 1, "'{}'").await;
    common::signal(&relay, "CONT");
    let (status, _) = common::wait_for_exit(
        &mut relay,
        Duration::from_secs(60),
        "the relay runs on without its slot",
    );
    let log = relay.log();
    assert_eq!(status.code(), Some(1), "{log}");
    let gap = format!("replication slot {slot} is gone");
    assert!(log.contains(&gap), "{log}");

    let text = w.status();
    assert!(
        text.contains(&format!("slot {slot}:")) && text.contains("MISSING"),
        "{text}"
    );

    let (status, stderr) = w.run_refused();
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&gap) && stderr.contains("wal drop"),
        "{stderr}"
    );

    let dropped = w.wal_drop(false);
    let text = String::from_utf8_lossy(&dropped.stdout);
    assert!(
        text.contains(&format!("dropped publication {}", w.source.publication)),
        "{text}"
    );
    let mut relay = w.spawn_relay(&[]);
    w.wait_for_slot().await;
    w.wait_until_reading().await;
    // Reading 0 again, and reading 1, committed in the gap.
    let received = consume(&[&w.f.topic("meter")], 3, Duration::from_secs(60)).await;
    assert_eq!(readings_of(&received, "m-0"), [0, 0, 1]);
    assert_eq!(common::terminate(&mut relay), Some(0));
    w.drop_slot().await;
}

/// `wal drop` refuses a slot that holds events no relay has read, rows and table-less ones (they
/// would never be published), and drops it with --force; other tables' WAL does not count.
#[tokio::test]
async fn wal_drop_refuses_a_slot_with_unread_events_unless_forced() {
    let _one = ONE_AT_A_TIME.lock().await;
    let w = WalFixture::new().await;
    let mut relay = w.spawn_relay(&[]);
    w.wait_for_slot().await;
    w.wait_until_reading().await;
    assert_eq!(common::terminate(&mut relay), Some(0));
    w.wait_until_unread().await;
    w.f.db
        .execute_unprepared("CREATE TABLE unrelated (n int); INSERT INTO unrelated VALUES (1)")
        .await
        .unwrap();
    let nothing_unread = w.wal_drop(false);
    assert!(
        nothing_unread.status.success(),
        "{}",
        String::from_utf8_lossy(&nothing_unread.stderr)
    );
    let mut relay = w.spawn_relay(&[]);
    w.wait_for_slot().await;
    w.wait_until_reading().await;
    assert_eq!(common::terminate(&mut relay), Some(0));
    w.wait_until_unread().await;

    for n in 0..3 {
        insert(&w, "m-0", n, "'{}'").await;
    }
    w.f.db
        .execute_unprepared("SELECT pg_logical_emit_message(true, 'outbox', '{}')")
        .await
        .unwrap();
    let refused = w.wal_drop(false);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("holds 4 events no relay has read yet"),
        "{stderr}"
    );
    assert!(
        w.f.scalar(&format!(
            "SELECT count(*) FROM pg_replication_slots WHERE slot_name = '{}'",
            w.source.slot
        ))
        .await
            == 1
    );

    let forced = w.wal_drop(true);
    let stdout = String::from_utf8_lossy(&forced.stdout);
    assert!(forced.status.success(), "{stdout}");
    assert!(
        stdout.contains(&format!("dropped replication slot {}", w.source.slot)),
        "{stdout}"
    );
}

/// Kafka stopped (SIGSTOP) while it lives, resumed however the test ends.
struct KafkaPaused;

impl KafkaPaused {
    fn new() -> Self {
        services("pause-kafka");
        KafkaPaused
    }
}

impl Drop for KafkaPaused {
    fn drop(&mut self) {
        services("resume-kafka");
    }
}

/// The relay's peak resident memory, in MiB.
fn peak_rss_mib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
    let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib / 1024
}

/// Large events with the broker away: the source reads ahead of the broker's confirmations by a
/// window in bytes (here 16 MB), not by 10,000 events, so 300 events of 900 kB waiting (270 MB)
/// hold the relay to tens of megabytes; every one arrives, in order, once the broker is back.
#[tokio::test]
async fn large_events_with_the_broker_away_stay_within_the_window_in_bytes() {
    let _one = ONE_AT_A_TIME.lock().await;
    let w = WalFixture::new().await;
    let mut relay = w.spawn_relay(&[
        "--wal-window-bytes",
        "16000000",
        "--max-batch-bytes",
        "4000000",
    ]);
    w.wait_for_slot().await;
    w.wait_until_reading().await;
    let paused = KafkaPaused::new();
    for n in 0..300 {
        w.f.db
            .execute_unprepared(&format!(
                "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
                 VALUES (gen_random_uuid(), 'meter', 'm-0', 'Reading',
                         jsonb_build_object('meter', 'm-0', 'n', {n}, 'pad', repeat('x', 900000)))"
            ))
            .await
            .unwrap();
    }
    w.wait_until_the_stream_stops().await;
    let peak = peak_rss_mib(relay.id());
    drop(paused);
    let received = consume(&[&w.f.topic("meter")], 300, Duration::from_secs(120)).await;
    assert_eq!(assert_complete_and_ordered(&received, 300, 1), 0);
    eprintln!("peak resident memory with 270 MB of events waiting: {peak} MiB");
    assert!(
        peak < 150,
        "the relay held {peak} MiB with 270 MB of events waiting"
    );
    assert_eq!(common::terminate(&mut relay), Some(0));
    w.drop_slot().await;
}

#[tokio::test]
async fn the_relay_killed_ten_times_during_50k_events_loses_nothing() {
    let _one = ONE_AT_A_TIME.lock().await;
    const TOTAL: u64 = 50_000;
    const TRANSACTIONS: u64 = 100;
    let w = WalFixture::new().await;
    // The slot exists before the events are written, so the WAL keeps them all.
    let mut first = w.spawn_relay(&[]);
    w.wait_for_slot().await;
    common::signal(&first, "KILL");
    first.wait().unwrap();
    let mut ends = Vec::new();
    let per = TOTAL / TRANSACTIONS;
    for t in 0..TRANSACTIONS {
        w.f.db
            .execute_unprepared(&format!(
                "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
                 SELECT gen_random_uuid(), 'meter', 'm-' || (g % 500), 'Reading', jsonb_build_object('n', g)
                 FROM generate_series({}, {}) g",
                t * per,
                (t + 1) * per - 1
            ))
            .await
            .unwrap();
        ends.push(
            w.f.scalar("SELECT (pg_current_wal_lsn() - '0/0')::bigint")
                .await,
        );
    }
    for kill in 0..10 {
        let mut relay = w.spawn_relay(&[]);
        // Kill it once it confirmed a little more than before, at a moment it did not choose.
        w.wait_until_confirmed_past(ends[kill * 9 + 5], Duration::from_secs(60))
            .await;
        tokio::time::sleep(Duration::from_millis(kill as u64 * 7)).await;
        common::signal(&relay, "KILL");
        relay.wait().unwrap();
    }
    let mut relay = w.spawn_relay(&[]);
    w.wait_until_confirmed_past(*ends.last().unwrap(), Duration::from_secs(120))
        .await;
    w.wait_until_reading().await;
    assert_eq!(common::terminate(&mut relay), Some(0));
    let received = consume(
        &[&w.f.topic("meter")],
        TOTAL as usize,
        Duration::from_secs(120),
    )
    .await;
    eprintln!("{} deliveries for {TOTAL} events", received.len());
    assert_complete_and_ordered(&received, TOTAL, 500);
    w.drop_slot().await;
}

#[tokio::test]
async fn the_broker_stops_for_30_seconds_and_the_relay_is_killed_meanwhile_and_nothing_is_lost() {
    let _one = ONE_AT_A_TIME.lock().await;
    let w = WalFixture::new().await;
    let name = format!("relay-{}", w.f.prefix);
    let mut args = w.flags();
    args.extend(["--http-addr".to_owned(), "off".to_owned()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut relay = w.f.named(&name).spawn_relay(&args);
    w.wait_for_slot().await;
    let writer = Writer::start(&w.f, 20, Duration::from_millis(5), reading);
    tokio::time::sleep(Duration::from_secs(2)).await;
    services("pause-kafka");
    tokio::time::sleep(Duration::from_secs(14)).await;
    assert!(
        relay.try_wait().unwrap().is_none(),
        "the relay exited while the broker was away"
    );
    // Killed with everything since the pause unacknowledged: none of it may have been confirmed.
    common::signal(&relay, "KILL");
    relay.wait().unwrap();
    let mut relay = w.f.named(&name).spawn_relay(&args);
    tokio::time::sleep(Duration::from_secs(14)).await;
    assert!(
        relay.try_wait().unwrap().is_none(),
        "the relay exited while the broker was away"
    );
    // No relay transaction stayed open: the WAL source holds none while it waits.
    let open = w.f.scalar(&format!(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = '{name}' AND xact_start < now() - interval '2 seconds'"
    )).await;
    services("resume-kafka");
    assert_eq!(
        open, 0,
        "a relay transaction stayed open while the broker was away"
    );
    w.finish(writer, &mut relay, 20).await;
}

/// librdkafka times out what it holds while the broker is away longer than `message.timeout.ms`,
/// and then sends what it still queues: the relay never hands it an aggregate's later event while
/// an earlier one is unanswered, so nothing can overtake.
#[tokio::test]
async fn the_broker_stops_past_the_producers_timeout_and_each_aggregate_keeps_its_order() {
    let _one = ONE_AT_A_TIME.lock().await;
    let w = WalFixture::new().await;
    common::wal::the_broker_away_past_the_producers_timeout(&w, reading).await;
}

#[tokio::test]
async fn postgres_restarts_and_the_stream_resumes() {
    let _one = ONE_AT_A_TIME.lock().await;
    let w = WalFixture::new().await;
    let mut relay = w.spawn_relay(&[]);
    w.wait_for_slot().await;
    let writer = Writer::start(&w.f, 20, Duration::from_millis(5), reading);
    tokio::time::sleep(Duration::from_secs(2)).await;
    services("restart-postgres");
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        relay.try_wait().unwrap().is_none(),
        "the relay exited when PostgreSQL restarted"
    );
    w.finish(writer, &mut relay, 20).await;
}

/// Two relays on one slot: one reads, the other waits; killed, the reader's slot passes to the
/// standby, which resumes from the confirmed position.
#[tokio::test]
async fn a_standby_takes_over_when_the_reader_dies() {
    let _one = ONE_AT_A_TIME.lock().await;
    let w = WalFixture::new().await;
    let mut active = w.spawn_relay(&[]);
    w.wait_for_slot().await;
    w.wait_until_reading().await;
    let mut standby = w.spawn_relay(&[]);
    let writer = Writer::start(&w.f, 20, Duration::from_millis(5), reading);
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(standby.try_wait().unwrap().is_none(), "the standby exited");
    let reader_pid = format!(
        "SELECT coalesce(max(active_pid), 0)::int8 FROM pg_replication_slots WHERE slot_name = '{}'",
        w.source.slot
    );
    let killed_reader = w.f.scalar(&reader_pid).await;
    assert!(killed_reader > 0, "someone reads the slot");
    common::signal(&active, "KILL");
    active.wait().unwrap();
    let killed = Instant::now();
    // The standby holds the slot, through a session of its own, within a few seconds.
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let holder = w.f.scalar(&reader_pid).await;
        if holder != 0 && holder != killed_reader {
            break;
        }
        assert!(Instant::now() < deadline, "the standby did not take over");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!(
        "the standby took over {:?} after the kill",
        killed.elapsed()
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    w.finish(writer, &mut standby, 20).await;
}
