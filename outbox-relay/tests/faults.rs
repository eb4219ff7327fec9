//! Faults on real PostgreSQL, Kafka and Pulsar, loopback only, each bounded in time: a broker
//! stops answering (Kafka for 45 s, past the producer's timeout, Pulsar while 2,000 events pile up), PostgreSQL restarts, the
//! relay is killed again and again. Every test checks what a consumer received: nothing lost, each
//! aggregate's first deliveries in order.
//!
//! The faults hit the shared services, so the tests of this file run one at a time.

mod common;

use common::kafka::consume;
use common::meters::{self, Writer, assert_complete_and_ordered, reading};
use common::{Fixture, free_port, http_get_when_up, services};
use seaorm_outbox::sea_orm::{ConnectionTrait, DbBackend, Statement};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

static ONE_FAULT_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Samples `pg_stat_activity` every 100 ms until finished: the age of the oldest open transaction of
/// the connections named `name`.
struct TransactionWatch {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<(Duration, u64)>,
}

impl TransactionWatch {
    fn start(f: &Fixture, name: &str) -> TransactionWatch {
        let stop = Arc::new(AtomicBool::new(false));
        let sql = format!(
            "SELECT coalesce(max((extract(epoch FROM clock_timestamp() - xact_start) * 1000)::int8), 0)
             FROM pg_stat_activity WHERE application_name = '{name}' AND xact_start IS NOT NULL"
        );
        let task = tokio::spawn({
            let (db, stop) = (f.db.clone(), stop.clone());
            async move {
                let (mut oldest, mut samples) = (0, 0);
                while !stop.load(Ordering::Relaxed) {
                    let row = db
                        .query_one_raw(Statement::from_string(DbBackend::Postgres, sql.clone()))
                        .await;
                    if let Ok(Some(row)) = row {
                        oldest = oldest.max(row.try_get_by_index::<i64>(0).unwrap_or(0));
                        samples += 1;
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                (Duration::from_millis(oldest.unsigned_abs()), samples)
            }
        });
        TransactionWatch { stop, task }
    }

    /// The oldest transaction seen, and how many samples were taken.
    async fn finish(self) -> (Duration, u64) {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.unwrap()
    }
}

fn metric(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse().ok()))
        .unwrap_or_else(|| panic!("no {name} in /metrics"))
}

#[tokio::test]
async fn the_broker_stops_past_the_producers_timeout_and_nothing_is_lost() {
    let _one = ONE_FAULT_AT_A_TIME.lock().await;
    let f = Fixture::new().await;
    let port = free_port();
    // The relay's connections get a name of their own, to watch their transactions.
    let name = format!("relay-{}", f.prefix);
    let mut relay = f
        .named(&name)
        .spawn_relay(&["--http-addr", &format!("127.0.0.1:{port}")]);
    let oldest_transaction = TransactionWatch::start(&f, &name);
    let writer = Writer::start(&f, 20, Duration::from_millis(5), reading);
    f.wait_until_zero(
        "SELECT CASE WHEN count(*) >= 200 THEN 0 ELSE 1 END::bigint FROM outbox WHERE published_at IS NOT NULL",
        Duration::from_secs(60),
    )
    .await;

    services("pause-kafka");
    let paused_at = Instant::now();
    let before = metric(
        &http_get_when_up(port, "/metrics").await.1,
        "outbox_backlog_events{table=\"outbox\"}",
    );
    // The broker stays away past the producer's message.timeout.ms (30 s) while events keep being
    // recorded: librdkafka times out what it holds, then sends what it still queues.
    tokio::time::sleep(common::wal::PAST_THE_PRODUCERS_TIMEOUT).await;
    let during = metric(
        &http_get_when_up(port, "/metrics").await.1,
        "outbox_backlog_events{table=\"outbox\"}",
    );
    assert!(
        relay.try_wait().unwrap().is_none(),
        "the relay exited while the broker was away"
    );
    services("resume-kafka");
    eprintln!(
        "broker paused for {:?}; backlog metric {before} -> {during}",
        paused_at.elapsed()
    );
    assert!(
        during > before + 100.0,
        "the backlog metric did not rise: {before} -> {during}"
    );

    let total = writer.finish().await;
    f.wait_until_drained(Duration::from_secs(120)).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while metric(
        &http_get_when_up(port, "/metrics").await.1,
        "outbox_backlog_events{table=\"outbox\"}",
    ) > 0.0
    {
        assert!(
            Instant::now() < deadline,
            "the backlog metric never went back to 0"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(common::terminate(&mut relay), Some(0));
    // No relay transaction stayed open while the broker was away (it would pin the xmin horizon).
    let (oldest, samples) = oldest_transaction.finish().await;
    eprintln!("oldest relay transaction seen: {oldest:?} in {samples} samples");
    assert!(samples > 100, "only {samples} samples of pg_stat_activity");
    assert!(
        oldest < Duration::from_secs(2),
        "a relay transaction stayed open {oldest:?} while the broker was away"
    );

    let received = consume(
        &[&f.topic("meter")],
        total as usize,
        Duration::from_secs(120),
    )
    .await;
    assert_complete_and_ordered(&received, total, 20);
}

#[tokio::test]
async fn pulsar_stops_answering_and_nothing_is_lost() {
    let _one = ONE_FAULT_AT_A_TIME.lock().await;
    let f = Fixture::new().await;
    let mut relay = f.spawn_pulsar_relay(&[]);
    let writer = Writer::start(&f, 20, Duration::from_millis(5), reading);
    f.wait_until_zero(
        "SELECT CASE WHEN count(*) >= 200 THEN 0 ELSE 1 END::bigint FROM outbox WHERE published_at IS NOT NULL",
        Duration::from_secs(60),
    )
    .await;

    services("pause-pulsar");
    let paused_at = Instant::now();
    let before = f.backlog().await;
    // The broker stays away while 2,000 events pile up (about 15 s).
    let during = loop {
        let backlog = f.backlog().await;
        if backlog >= before + 2000 {
            break backlog;
        }
        assert!(
            paused_at.elapsed() < Duration::from_secs(120),
            "the backlog did not rise: {before} -> {backlog}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(
        relay.try_wait().unwrap().is_none(),
        "the relay exited while the broker was away"
    );
    services("resume-pulsar");
    eprintln!(
        "pulsar paused for {:?}; backlog {before} -> {during}",
        paused_at.elapsed()
    );

    let total = writer.finish().await;
    f.wait_until_drained(Duration::from_secs(120)).await;
    assert_eq!(common::terminate(&mut relay), Some(0));

    let received = common::pulsar::consume(
        &common::pulsar::topic(&f.topic("meter")),
        total as usize,
        Duration::from_secs(120),
    )
    .await;
    let arrived = received.iter().map(|m| {
        let payload: serde_json::Value = serde_json::from_slice(&m.payload).unwrap();
        (m.key.clone(), payload["n"].as_u64().unwrap())
    });
    common::assert_complete_and_ordered(arrived, &meters::readings(total, 20));
}

#[tokio::test]
async fn postgres_restarts_and_the_relay_reconnects() {
    let _one = ONE_FAULT_AT_A_TIME.lock().await;
    let f = Fixture::new().await;
    let mut relay = f.spawn_relay(&[]);
    let writer = Writer::start(&f, 20, Duration::from_millis(5), reading);
    f.wait_until_zero(
        "SELECT CASE WHEN count(*) >= 200 THEN 0 ELSE 1 END::bigint FROM outbox WHERE published_at IS NOT NULL",
        Duration::from_secs(60),
    )
    .await;

    services("restart-postgres");
    let restarted = f.scalar("SELECT count(*) FROM outbox").await;
    // Keep recording after the restart, then let the relay catch up.
    f.wait_until_zero(
        &format!(
            "SELECT CASE WHEN count(*) >= {} THEN 0 ELSE 1 END::bigint FROM outbox",
            restarted + 200
        ),
        Duration::from_secs(60),
    )
    .await;
    let total = writer.finish().await;
    f.wait_until_drained(Duration::from_secs(120)).await;
    assert!(
        relay.try_wait().unwrap().is_none(),
        "the relay exited when PostgreSQL restarted"
    );
    assert_eq!(common::terminate(&mut relay), Some(0));

    let received = consume(
        &[&f.topic("meter")],
        total as usize,
        Duration::from_secs(60),
    )
    .await;
    assert_complete_and_ordered(&received, total, 20);
}

#[tokio::test]
async fn ten_postgres_restarts_leave_the_relay_its_own_few_connections() {
    let _one = ONE_FAULT_AT_A_TIME.lock().await;
    let f = Fixture::new().await;
    let name = format!("relay-{}", f.prefix);
    let port = free_port();
    let mut relay = f.named(&name).spawn_relay_to(
        &["--sink", "stdout"],
        &[
            "--wakeup",
            "notify",
            "--http-addr",
            &format!("127.0.0.1:{port}"),
        ],
    );
    let named = format!("SELECT count(*) FROM pg_stat_activity WHERE application_name = '{name}'");
    let listening = format!("{named} AND query LIKE 'LISTEN%'");
    // One LISTEN connection, and at most the claiming, listening, sampling, pruning and
    // readiness-probe connections: five.
    let settled =
        format!("SELECT CASE WHEN ({listening}) = 1 AND ({named}) <= 5 THEN 0 ELSE 1 END::bigint");
    let wait_settled = async |when: &str| {
        let deadline = Instant::now() + Duration::from_secs(30);
        while f.scalar(&settled).await != 0 {
            if Instant::now() > deadline {
                let rows =
                    f.db.query_all_raw(Statement::from_string(
                        DbBackend::Postgres,
                        format!(
                            "SELECT state || ': ' || left(query, 60) FROM pg_stat_activity \
                             WHERE application_name = '{name}'"
                        ),
                    ))
                    .await
                    .unwrap();
                let rows: Vec<String> = rows
                    .iter()
                    .map(|r| r.try_get_by_index::<String>(0).unwrap_or_default())
                    .collect();
                panic!("{when}: the relay's connections did not settle: {rows:#?}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    wait_settled("at start").await;
    for restart in 0..10 {
        services("restart-postgres");
        // Back to one listener after the relay reconnected, not one more per restart.
        wait_settled(&format!("after restart {restart}")).await;
        // Readiness probes reuse one connection; one found dead after the restart is replaced
        // within the probe, so with the database answering again (the relay reconnected, above)
        // every probe says 200 once the answer from before the restart is no longer reused (1 s).
        // Then probes add no connections.
        tokio::time::sleep(Duration::from_millis(1100)).await;
        for _ in 0..5 {
            let (status, body) = common::http_get(port, "/readyz").unwrap();
            assert_eq!(status, 200, "after restart {restart}: {body}");
        }
        wait_settled(&format!("after probes {restart}")).await;
    }
    assert_eq!(f.scalar(&listening).await, 1, "LISTEN connections leaked");
    let total = f.scalar(&named).await;
    assert!(total <= 5, "{total} relay connections after ten restarts");
    assert_eq!(common::terminate(&mut relay), Some(0));
    f.wait_until_zero(&named, Duration::from_secs(30)).await;
}

#[tokio::test]
async fn the_relay_killed_ten_times_during_50k_events_loses_nothing() {
    let _one = ONE_FAULT_AT_A_TIME.lock().await;
    const TOTAL: u64 = 50_000;
    let f = Fixture::new().await;
    f.db.execute_unprepared(&format!(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
         SELECT gen_random_uuid(), 'meter', 'm-' || (g % 500), 'Reading', jsonb_build_object('n', g)
         FROM generate_series(0, {}) g",
        TOTAL - 1
    ))
    .await
    .unwrap();

    common::meters::drain_through_ten_kills(&f, 2000, || f.spawn_relay(&["--batch-size", "500"]))
        .await;

    let received = consume(
        &[&f.topic("meter")],
        TOTAL as usize,
        Duration::from_secs(120),
    )
    .await;
    eprintln!("{} deliveries for {TOTAL} events", received.len());
    assert_complete_and_ordered(&received, TOTAL, 500);
}

/// The stuck producer a broker stall left behind once (every send timing out while fresh
/// producers delivered) cannot be staged on demand; what can be checked is the remedy: after
/// `STUCK_AFTER` rounds of failures with nothing delivered, the sink works with a new producer.
#[tokio::test]
async fn a_producer_that_delivers_nothing_is_replaced() {
    // It reads back from Kafka, which the other fault tests pause.
    let _one = ONE_FAULT_AT_A_TIME.lock().await;
    use seaorm_outbox_relay::sink::kafka::{KafkaConfig, KafkaSink, STUCK_AFTER};
    use seaorm_outbox_relay::sink::{Message, Sink, send_all};
    // The sink's bootstrap address is a proxy that first swallows everything (a broker that
    // stopped answering), then forwards to the real Kafka.
    let proxy = Proxy::start(&common::kafka::brokers()).await;
    let mut config = KafkaConfig::new(&proxy.address);
    config
        .options
        .insert("message.timeout.ms".into(), "300".into());
    let sink = KafkaSink::new(&config).unwrap();
    let first = sink.producer();
    let mut message = Message::example();
    message.topic = format!("t{}.order", seaorm_outbox::Uuid::now_v7().simple());
    let batch = [message];
    for _ in 1..=STUCK_AFTER {
        assert!(send_all(&sink, &batch).await[0].is_err());
    }
    // Replaced at the quiet moment it asks the relay for, never while a message is in flight.
    assert!(
        std::sync::Arc::ptr_eq(&first, &sink.producer()),
        "replaced before its quiet moment"
    );
    assert!(
        sink.wants_quiet(),
        "the stuck producer asks for a quiet moment"
    );
    sink.quiet().await;

    // The broker answers again: the new producer delivers.
    proxy.forward.store(true, Ordering::Relaxed);
    let delivered = async {
        loop {
            if send_all(&sink, &batch).await[0].is_ok() {
                return;
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(60), delivered)
        .await
        .expect("the new producer delivers once the broker answers");
    assert!(
        !std::sync::Arc::ptr_eq(&first, &sink.producer()),
        "the stuck producer was replaced at its quiet moment"
    );
    let received = consume(&[&batch[0].topic], 1, Duration::from_secs(60)).await;
    assert_eq!(
        received[0].header("id"),
        Some(batch[0].event_id.to_string().as_str())
    );
}

/// Two Kafka producers, as the Kafka sink holds them across a replacement: the old one, after
/// its first `before` messages, answers nothing more (a stuck librdkafka producer, which no broker
/// fault stages on demand) and asks for a quiet moment once it holds `held`; from the quiet moment
/// on, the new one takes every message. What the old one held reaches the broker only at
/// [`release`](Self::release), after the new one delivered everything.
struct ReplacedProducer {
    old: seaorm_outbox_relay::sink::kafka::KafkaSink,
    new: seaorm_outbox_relay::sink::kafka::KafkaSink,
    before: usize,
    held: usize,
    taken: std::sync::atomic::AtomicUsize,
    replaced: AtomicBool,
    holding: std::sync::Mutex<Vec<seaorm_outbox_relay::sink::Message>>,
}

impl ReplacedProducer {
    /// Sends what the old producer held, late, and waits for the broker's answers.
    async fn release(&self) -> usize {
        use seaorm_outbox_relay::sink::Sink;
        let held = std::mem::take(&mut *self.holding.lock().unwrap());
        for message in &held {
            let ack = self.old.enqueue(message).await.expect("enqueue");
            ack.await.expect("the late delivery");
        }
        held.len()
    }
}

impl seaorm_outbox_relay::sink::Sink for ReplacedProducer {
    fn name(&self) -> &str {
        "replaced-producer"
    }

    fn enqueue<'a>(
        &'a self,
        message: &'a seaorm_outbox_relay::sink::Message,
    ) -> futures::future::BoxFuture<
        'a,
        Result<seaorm_outbox_relay::sink::Ack, seaorm_outbox_relay::sink::SinkError>,
    > {
        if self.replaced.load(Ordering::Relaxed) {
            return self.new.enqueue(message);
        }
        if self.taken.fetch_add(1, Ordering::Relaxed) < self.before {
            return self.old.enqueue(message);
        }
        self.holding.lock().unwrap().push(message.clone());
        let never: seaorm_outbox_relay::sink::Ack = Box::pin(std::future::pending());
        Box::pin(async move { Ok(never) })
    }

    fn wants_quiet(&self) -> bool {
        !self.replaced.load(Ordering::Relaxed) && self.holding.lock().unwrap().len() >= self.held
    }

    fn quiet(&self) -> futures::future::BoxFuture<'_, ()> {
        self.replaced.store(true, Ordering::Relaxed);
        Box::pin(async {})
    }
}

/// A producer replaced while it holds unanswered messages: the replacement waits for a quiet
/// moment, which the relay gives only once every answer it waited for is in (the held messages
/// fail after `ack_timeout`) and settled, so they go out again, in order, through the new
/// producer, and what the old one delivers late is a duplicate, never a reordering. (Replaced in
/// the middle of a batch instead, the old producer held an aggregate's event while the new one
/// delivered its later ones of the same batch: first deliveries out of order.)
#[tokio::test]
async fn a_producer_replaced_while_it_holds_unanswered_messages_keeps_each_aggregates_order() {
    let _one = ONE_FAULT_AT_A_TIME.lock().await;
    use seaorm_outbox_relay::sink::kafka::{KafkaConfig, KafkaSink};
    let f = Fixture::new().await;
    let config = KafkaConfig::new(common::kafka::brokers());
    let sink = Arc::new(ReplacedProducer {
        old: KafkaSink::new(&config).unwrap(),
        new: KafkaSink::new(&config).unwrap(),
        before: 100,
        held: 40,
        taken: Default::default(),
        replaced: AtomicBool::new(false),
        holding: Default::default(),
    });
    let mut relay_config = f.relay_config();
    relay_config.ack_timeout = Duration::from_secs(2);
    let relay = seaorm_outbox_relay::Relay::new(relay_config, sink.clone());
    let shutdown = tokio_util::sync::CancellationToken::new();
    let running = tokio::spawn({
        let shutdown = shutdown.clone();
        async move { relay.run(shutdown).await.expect("the relay refused to run") }
    });
    let writer = Writer::start(&f, 20, Duration::from_millis(5), reading);
    tokio::time::sleep(Duration::from_secs(6)).await;
    let total = writer.finish().await;
    f.wait_until_drained(Duration::from_secs(60)).await;
    shutdown.cancel();
    running.await.unwrap();
    let late = sink.release().await;
    assert!(late >= 40, "the old producer held {late} messages");

    let received = consume(
        &[&f.topic("meter")],
        total as usize + late,
        Duration::from_secs(60),
    )
    .await;
    let duplicates = assert_complete_and_ordered(&received, total, 20);
    assert!(
        duplicates >= late,
        "the late deliveries arrived: {duplicates}"
    );
}

/// A TCP proxy on 127.0.0.1 that holds connections without answering until `forward` is set,
/// then passes new connections through to `target`.
struct Proxy {
    address: String,
    forward: Arc<AtomicBool>,
}

impl Proxy {
    async fn start(target: &str) -> Proxy {
        let target = target.split(',').next().unwrap().to_owned();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap().to_string();
        let forward = Arc::new(AtomicBool::new(false));
        tokio::spawn({
            let forward = forward.clone();
            async move {
                while let Ok((mut client, _)) = listener.accept().await {
                    let (forward, target) = (forward.clone(), target.clone());
                    tokio::spawn(async move {
                        if !forward.load(Ordering::Relaxed) {
                            // Swallow: hold the connection open and never answer (until the test
                            // ends and its runtime drops this task).
                            let _held = client;
                            std::future::pending::<()>().await;
                            return;
                        }
                        if let Ok(mut broker) = tokio::net::TcpStream::connect(&target).await {
                            let _ = tokio::io::copy_bidirectional(&mut client, &mut broker).await;
                        }
                    });
                }
            }
        });
        Proxy { address, forward }
    }
}
