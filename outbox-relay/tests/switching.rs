//! Moving a database between the sources while the application records: `outbox-relay wal
//! to-polling` and `outbox-relay wal from-polling`, on a real PostgreSQL and Kafka. A consumer
//! gets every event, each aggregate's first deliveries in order; parked events stay parked with
//! their aggregates' later events waiting behind them; table-less recording left on refuses the
//! move to polling.
//!
//! Recording rows or table-less is a per-process setting: the tests of this file run one at a time
//! and each sets it.

mod common;

use common::kafka::{Received, consume};
use common::meters::{Writer, assert_complete_and_ordered, reading};
use common::wal::WalFixture;
use common::{relay_command, terminate};
use seaorm_outbox::sea_orm::{ConnectionTrait, TransactionTrait};
use seaorm_outbox::{OutboxEvent, Recording};
use std::process::{Child, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Inserts reading `n` of meter `p` as a row; `headers` as SQL (`'[1]'`, headers that are not a
/// JSON object, makes it a poison event).
async fn insert_p(w: &WalFixture, n: u64, headers: &str) {
    w.f.db
        .execute_unprepared(&format!(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, headers)
             VALUES (gen_random_uuid(), 'meter', 'p', 'Reading', '{{\"meter\": \"p\", \"n\": {n}}}', {headers})"
        ))
        .await
        .unwrap();
}

/// A running `outbox-relay wal <direction>` on the fixture's slot and publication, its stderr
/// collected as it comes.
struct Switch {
    child: Child,
    stderr: Arc<Mutex<String>>,
    reader: std::thread::JoinHandle<()>,
}

fn spawn_switch(w: &WalFixture, direction: &str, extra: &[&str]) -> Switch {
    let mut child = relay_command()
        .args(["wal", direction, "--database-url", &w.f.url])
        .args(["--slot", &w.source.slot])
        .args(["--publication", &w.source.publication])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = Arc::new(Mutex::new(String::new()));
    let reader = std::thread::spawn({
        let (pipe, stderr) = (child.stderr.take().unwrap(), stderr.clone());
        move || {
            for line in std::io::BufRead::lines(std::io::BufReader::new(pipe)) {
                let Ok(line) = line else { return };
                let mut text = stderr.lock().unwrap();
                text.push_str(&line);
                text.push('\n');
            }
        }
    });
    Switch {
        child,
        stderr,
        reader,
    }
}

impl Switch {
    /// Waits until the command has printed `needle` on stderr.
    async fn wait_until_said(&self, needle: &str) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while !self.stderr.lock().unwrap().contains(needle) {
            assert!(
                Instant::now() < deadline,
                "the switch did not say {needle:?} in 60 s: {}",
                self.stderr.lock().unwrap()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Waits for a switch to end: its exit code, stdout and stderr.
fn finished(mut switch: Switch) -> (Option<i32>, String, String) {
    let (status, _) = common::wait_for_exit(
        &mut switch.child,
        Duration::from_secs(120),
        "the switch ran",
    );
    let mut stdout = String::new();
    std::io::Read::read_to_string(&mut switch.child.stdout.take().unwrap(), &mut stdout).unwrap();
    switch.reader.join().unwrap();
    let stderr = switch.stderr.lock().unwrap().clone();
    (status.code(), stdout, stderr)
}

/// Waits until the outbox table holds at least `rows` rows (the writers record on).
async fn wait_for_rows(w: &WalFixture, rows: i64) {
    let sql = format!("SELECT GREATEST({rows} - count(*), 0) FROM outbox");
    w.f.wait_until_zero(&sql, Duration::from_secs(60)).await;
}

/// The rows of the outbox table now.
async fn rows(w: &WalFixture) -> i64 {
    w.f.scalar("SELECT count(*) FROM outbox").await
}

/// The meter readings received (not meter `p`'s), and `p`'s readings in order.
fn split_p(received: Vec<Received>) -> (Vec<Received>, Vec<u64>) {
    let (p, readings): (Vec<Received>, Vec<Received>) =
        received.into_iter().partition(|m| m.key == "p");
    (
        readings,
        p.iter().map(|m| m.json()["n"].as_u64().unwrap()).collect(),
    )
}

async fn publication_exists(w: &WalFixture) -> bool {
    w.f.scalar(&format!(
        "SELECT count(*) FROM pg_publication WHERE pubname = '{}'",
        w.source.publication
    ))
    .await
        > 0
}

async fn slot_exists(w: &WalFixture) -> bool {
    w.f.scalar(&format!(
        "SELECT count(*) FROM pg_replication_slots WHERE slot_name = '{}'",
        w.source.slot
    ))
    .await
        > 0
}

/// WAL relay to polling relay while writers record: the switch waits for the WAL relay, marks
/// exactly what it published (no reading lost, none sent twice), leaves the rest to the polling
/// relay, and keeps a parked event parked with the readings held behind it waiting.
// Two threads: the writers record while the test waits on a process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn moving_from_the_wal_source_to_polling_while_recording_loses_and_repeats_nothing() {
    let _one = ONE_AT_A_TIME.lock().await;
    seaorm_outbox::set_recording(Recording::Table);
    let w = WalFixture::new().await;
    let mut wal_relay = w.spawn_relay(&[]);
    w.wait_for_slot().await;
    insert_p(&w, 1, "'[1]'").await;
    insert_p(&w, 2, "NULL").await;
    insert_p(&w, 3, "NULL").await;
    let writer = Writer::start(&w.f, 20, Duration::from_millis(5), reading);
    wait_for_rows(&w, 200).await;

    let switch = spawn_switch(&w, "to-polling", &[]);
    switch.wait_until_said("stop them now").await;
    assert!(publication_exists(&w).await, "it waits for the WAL relay");
    assert_eq!(terminate(&mut wal_relay), Some(0));
    let (code, stdout, stderr) = finished(switch);
    assert_eq!(code, Some(0), "{stdout}{stderr}");
    assert!(stdout.contains("moved to polling"), "{stdout}");
    assert!(stderr.contains("stop them now"), "{stderr}");
    assert!(!publication_exists(&w).await && !slot_exists(&w).await);
    assert_eq!(
        w.f.scalar("SELECT count(*) FROM outbox WHERE aggregate_id = 'p' AND parked_at IS NOT NULL AND published_at IS NULL")
            .await,
        1,
        "the poison event stays parked"
    );
    assert_eq!(
        w.f.scalar("SELECT count(*) FROM outbox WHERE held_at IS NOT NULL")
            .await,
        0,
        "held events are handed to the polling relay"
    );

    // The writers went on recording all along; the polling relay publishes what is left.
    let mut polling = w.f.spawn_relay(&[]);
    wait_for_rows(&w, rows(&w).await + 200).await;
    let total = writer.finish().await;
    w.f.wait_until_zero(
        "SELECT count(*) FROM outbox WHERE published_at IS NULL AND aggregate_id <> 'p'",
        Duration::from_secs(60),
    )
    .await;
    let topic = w.f.topic("meter");
    let (readings, p) = split_p(consume(&[&topic], total as usize, Duration::from_secs(60)).await);
    let duplicates = assert_complete_and_ordered(&readings, total, 20);
    assert_eq!(
        duplicates, 0,
        "the switch marked what the WAL relay published"
    );
    assert!(
        p.is_empty(),
        "p's readings wait behind its parked one: {p:?}"
    );

    // Under the polling relay, skipping the parked event releases the two behind it, in order.
    w.failed(&["skip", "--all", "--reason", "test"]);
    let received = consume(&[&topic], total as usize + 2, Duration::from_secs(60)).await;
    assert_eq!(split_p(received).1, [2, 3]);
    assert_eq!(terminate(&mut polling), Some(0));
}

/// Polling relay to WAL relay while writers record: what the polling relay left (and what was
/// recorded while no relay ran) goes out first, each meter in order, nothing twice; a parked
/// event stays parked under the WAL source, and the readings behind it wait until it is skipped.
// Two threads: the writers record while the test waits on a process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn moving_from_polling_to_the_wal_source_while_recording_loses_nothing() {
    let _one = ONE_AT_A_TIME.lock().await;
    seaorm_outbox::set_recording(Recording::Table);
    let w = WalFixture::new().await;
    let mut polling = w.f.spawn_relay(&[]);
    insert_p(&w, 1, "'[1]'").await;
    insert_p(&w, 2, "NULL").await;
    let writer = Writer::start(&w.f, 20, Duration::from_millis(5), reading);
    wait_for_rows(&w, 200).await;

    // The switch waits for the polling relays, and gives up when they do not stop.
    let (code, stdout, stderr) = finished(spawn_switch(&w, "from-polling", &["--timeout", "2s"]));
    assert_eq!(code, Some(1), "{stdout}{stderr}");
    assert!(
        stderr.contains("gave up after 2s: 1 polling relay(s) still run"),
        "{stderr}"
    );
    assert!(!publication_exists(&w).await && !slot_exists(&w).await);

    // Stopped, the polling relay leaves a backlog that grows while no relay runs.
    assert_eq!(terminate(&mut polling), Some(0));
    w.f.wait_until_zero(
        "SELECT GREATEST(100 - count(*), 0) FROM outbox WHERE published_at IS NULL",
        Duration::from_secs(60),
    )
    .await;
    let (code, stdout, stderr) = finished(spawn_switch(&w, "from-polling", &[]));
    assert_eq!(code, Some(0), "{stdout}{stderr}");
    let handed: u64 = stdout
        .split("; the ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{stdout}"));
    assert!(
        handed >= 100,
        "the backlog left while no relay ran: {stdout}"
    );
    // Recorded into the slot's stream before a WAL relay reads it, and while it does.
    wait_for_rows(&w, rows(&w).await + 100).await;
    let mut wal_relay = w.spawn_relay(&[]);
    w.wait_until_reading().await;
    wait_for_rows(&w, rows(&w).await + 200).await;
    let total = writer.finish().await;
    w.wait_until_confirmed(Duration::from_secs(60)).await;
    let topic = w.f.topic("meter");
    let (readings, p) = split_p(consume(&[&topic], total as usize, Duration::from_secs(60)).await);
    let duplicates = assert_complete_and_ordered(&readings, total, 20);
    eprintln!("{total} readings, {handed} handed over, {duplicates} duplicates");
    assert_eq!(duplicates, 0, "a clean switch sends nothing twice");
    assert!(
        p.is_empty(),
        "p's reading waits behind its parked one: {p:?}"
    );
    assert_eq!(
        w.f.scalar("SELECT count(*) FROM outbox WHERE aggregate_id = 'p' AND held_at IS NOT NULL")
            .await,
        1,
        "the WAL source holds it"
    );

    w.failed(&["skip", "--all", "--reason", "test"]);
    let received = consume(&[&topic], total as usize + 1, Duration::from_secs(60)).await;
    assert_eq!(split_p(received).1, [2]);
    w.wait_until_confirmed(Duration::from_secs(30)).await;
    assert_eq!(terminate(&mut wal_relay), Some(0));
    w.drop_slot().await;
}

/// Table-less events are in no row a polling relay could read: the move to polling refuses while
/// table-less recording is on (events recorded so after the command began) and while the slot
/// holds table-less events no relay published; run beside a WAL relay, it waits for them. A
/// table-less event the WAL source parked becomes a row the polling relay publishes as recorded.
// Two threads: the writers record while the test waits on a process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_move_to_polling_refuses_while_table_less_recording_is_on() {
    let _one = ONE_AT_A_TIME.lock().await;
    seaorm_outbox::set_recording(Recording::LogicalMessage);
    let w = WalFixture::new().await;
    let mut wal_relay = w.spawn_relay(&["--max-payload-bytes", "60"]);
    w.wait_for_slot().await;
    let big_meter = "m-big".repeat(12);
    let txn = w.f.db.begin().await.unwrap();
    seaorm_outbox::record_all(&txn, &[reading(big_meter.clone(), 0)])
        .await
        .unwrap();
    txn.commit().await.unwrap();
    let writer = Writer::start(&w.f, 20, Duration::from_millis(5), reading);
    w.wait_until_confirmed(Duration::from_secs(60)).await;

    let switch = spawn_switch(&w, "to-polling", &[]);
    // Its first check of the slot: it runs, and what is recorded from now on is after its start.
    switch.wait_until_said("the WAL relays").await;
    assert_eq!(terminate(&mut wal_relay), Some(0));
    let (code, stdout, stderr) = finished(switch);
    assert_eq!(code, Some(1), "{stdout}{stderr}");
    assert!(
        stderr.contains("table-less recording is still on"),
        "{stderr}"
    );
    assert!(publication_exists(&w).await && slot_exists(&w).await);

    // Turned off (the writers stopped), the slot still holds table-less events no relay read.
    let total = writer.finish().await;
    seaorm_outbox::set_recording(Recording::Table);
    let (code, stdout, stderr) = finished(spawn_switch(&w, "to-polling", &[]));
    assert_eq!(code, Some(1), "{stdout}{stderr}");
    assert!(
        stderr.contains("table-less events no WAL relay has published"),
        "{stderr}"
    );

    // Beside a WAL relay it waits until they are published, then for the relay to stop.
    let mut wal_relay = w.spawn_relay(&["--max-payload-bytes", "60"]);
    w.wait_until_reading().await;
    let switch = spawn_switch(&w, "to-polling", &[]);
    w.wait_until_confirmed(Duration::from_secs(60)).await;
    assert_eq!(terminate(&mut wal_relay), Some(0));
    let (code, stdout, stderr) = finished(switch);
    assert_eq!(code, Some(0), "{stdout}{stderr}");
    assert!(
        stdout.contains("1 kept table-less events became rows"),
        "{stdout}"
    );
    let topic = w.f.topic("meter");
    let received = consume(&[&topic], total as usize, Duration::from_secs(60)).await;
    assert_complete_and_ordered(&received, total, 20);

    // The parked table-less event, retried under a polling relay without the limit, goes out
    // under its own id with its payload.
    let id: String = {
        let row =
            w.f.db
                .query_one_raw(seaorm_outbox::sea_orm::Statement::from_string(
                    seaorm_outbox::sea_orm::DbBackend::Postgres,
                    "SELECT id::text FROM outbox WHERE parked_at IS NOT NULL AND recorded IS NULL",
                ))
                .await
                .unwrap()
                .expect("the parked event, a plain row now");
        row.try_get_by_index(0).unwrap()
    };
    let mut polling = w.f.spawn_relay(&[]);
    w.failed(&["retry", "--all"]);
    let received = consume(&[&topic], total as usize + 1, Duration::from_secs(60)).await;
    let big = received
        .iter()
        .find(|m| m.key == big_meter)
        .expect("the parked event");
    assert_eq!(big.header("id"), Some(id.as_str()));
    assert_eq!(big.json()["n"], 0);
    assert_eq!(terminate(&mut polling), Some(0));
}

/// A WAL relay's first start stopped between making the slot and handing it the table's backlog
/// (the publication's mark says so): the next start hands it over, and it goes out, each event
/// once, also those committed after the slot was made, which are both in its stream and held
/// with the backlog (they once went out twice, as did those a first start's hold took in the
/// moment after it made the slot).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_start_cut_short_hands_the_backlog_over_at_the_next() {
    let _one = ONE_AT_A_TIME.lock().await;
    seaorm_outbox::set_recording(Recording::Table);
    let w = WalFixture::new().await;
    let record = |n: u64| {
        let db = &w.f.db;
        async move {
            let txn = db.begin().await.unwrap();
            reading(format!("m-{}", n % 5), n)
                .record(&txn)
                .await
                .unwrap();
            txn.commit().await.unwrap();
        }
    };
    for n in 0..50 {
        record(n).await;
    }
    let (slot, publication) = (&w.source.slot, &w.source.publication);
    for sql in [
        format!("CREATE PUBLICATION {publication} FOR TABLE outbox WITH (publish = 'insert')"),
        format!(
            "COMMENT ON PUBLICATION {publication} IS 'outbox-relay WAL source; new slot {slot}'"
        ),
        format!("SELECT pg_create_logical_replication_slot('{slot}', 'pgoutput')"),
    ] {
        w.f.db.execute_unprepared(&sql).await.unwrap();
    }
    for n in 50..80 {
        record(n).await;
    }
    let mut relay = w.spawn_relay(&[]);
    w.wait_until_confirmed(Duration::from_secs(30)).await;
    for n in 80..100 {
        record(n).await;
    }
    w.wait_until_confirmed(Duration::from_secs(30)).await;
    assert_eq!(terminate(&mut relay), Some(0));
    let received = consume(&[&w.f.topic("meter")], 100, Duration::from_secs(60)).await;
    assert_eq!(
        assert_complete_and_ordered(&received, 100, 5),
        0,
        "duplicates"
    );
    w.drop_slot().await;
}
