//! The relay on MariaDB (`--only mariadb`): drains against that backend's raw claim-and-mark SQL
//! and its pipelined null pipeline (sending key and payload only, and again with the contract's
//! headers), what `record` adds to a one-row transaction there and on PostgreSQL, and the latency
//! at a fixed rate; all in the run that measures PostgreSQL.

use crate::latency::{self, Percentiles};
use crate::limits::{acked, enqueue, enqueue_all, producer, send_all};
use crate::record_cost;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord};
use seaorm_outbox_relay::sink::kafka::{KafkaConfig, KafkaSink};
use seaorm_outbox_relay::{Mode, Relay, RelayConfig};
use sqlx::mysql::{MySqlConnection, MySqlPool, MySqlPoolOptions};
use sqlx::{Connection, Row};
use std::fmt::Write;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// One batch size and mode: events/s of the raw SQL, the pipelined null pipeline (key and
/// payload only, and again with the contract's headers) and the relay, one of each per round (the
/// four measured in turn, each round after the last).
pub struct DrainRow {
    pub batch: usize,
    pub mode: Mode,
    pub raw_sql: Vec<f64>,
    pub pipelined_null: Vec<f64>,
    pub contract_null: Vec<f64>,
    pub relay: Vec<f64>,
}

impl DrainRow {
    /// Each round's relay / pipelined null, as measured side by side.
    fn ratios(&self) -> Vec<f64> {
        ratios(&self.relay, &self.pipelined_null)
    }

    /// Each round's relay / pipelined null sending the contract's headers.
    fn contract_ratios(&self) -> Vec<f64> {
        ratios(&self.relay, &self.contract_null)
    }
}

fn ratios(relay: &[f64], null: &[f64]) -> Vec<f64> {
    relay.iter().zip(null).map(|(r, n)| r / n).collect()
}

/// The lowest and highest of `values`.
fn range(values: &[f64]) -> (f64, f64) {
    values
        .iter()
        .fold((f64::MAX, f64::MIN), |(l, h), r| (l.min(*r), h.max(*r)))
}

/// The median of `values` (the upper one of an even count); 0 for none.
fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted.get(sorted.len() / 2).copied().unwrap_or(0.0)
}

/// What the MariaDB part measured.
pub struct Measured {
    pub drains: Vec<DrainRow>,
    /// Mean µs per transaction, one per round: (case, MariaDB, PostgreSQL).
    pub record_cost: Vec<(String, Vec<f64>, Vec<f64>)>,
    pub latency: Percentiles,
}

/// A database of its own on the server, migrated.
struct Db {
    url: String,
    pool: MySqlPool,
}

/// Creates database `bench_<id>` on the server of `admin_url` and migrates it.
async fn fresh(admin_url: &str, created: &mut Vec<String>) -> Db {
    let name = format!("bench_{}", Uuid::now_v7().simple());
    let mut admin = MySqlConnection::connect(admin_url)
        .await
        .expect("connect to MariaDB");
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(&mut admin)
        .await
        .expect("create database");
    created.push(name.clone());
    let (server, _) = admin_url
        .split('?')
        .next()
        .and_then(|u| u.rsplit_once('/'))
        .expect("a MariaDB URL with a database");
    let url = format!("{server}/{name}");
    let orm = seaorm_outbox::sea_orm::Database::connect(&url)
        .await
        .expect("connect");
    seaorm_outbox::migration::migrate(&orm)
        .await
        .expect("migrate");
    orm.close().await.ok();
    let pool = MySqlPoolOptions::new()
        .max_connections(16)
        .connect(&url)
        .await
        .expect("pool");
    Db { url, pool }
}

/// Fills the outbox with `events` unpublished events over `aggregates` aggregates, about 200
/// bytes of JSON each as on PostgreSQL, in `seq` order; then ANALYZE.
async fn fill(db: &Db, events: usize, aggregates: usize) {
    let chunk = 50_000;
    let mut start = 0;
    while start < events {
        let end = (start + chunk).min(events);
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
             WITH d(n) AS (SELECT 0 UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3
                           UNION ALL SELECT 4 UNION ALL SELECT 5 UNION ALL SELECT 6
                           UNION ALL SELECT 7 UNION ALL SELECT 8 UNION ALL SELECT 9),
                  g(n) AS (SELECT {start} + a.n + 10 * b.n + 100 * c.n + 1000 * e.n + 10000 * f.n
                           FROM d a, d b, d c, d e, d f)
             SELECT UUID(), 'order', CONCAT('agg-', n % {aggregates}), 'OrderPlaced',
                    JSON_OBJECT('order_id', CONCAT('agg-', n % {aggregates}),
                                'customer', CONCAT('customer-', n % 97), 'total_cents', n,
                                'currency', 'EUR', 'note', REPEAT('x', 110))
             FROM g WHERE n < {end} ORDER BY n"
        )))
        .execute(&db.pool)
        .await
        .expect("fill");
        start = end;
    }
    sqlx::query("ANALYZE TABLE outbox")
        .execute(&db.pool)
        .await
        .expect("analyze");
}

/// Waits until no row is unpublished, probing for one (a count would compete with the relay).
async fn wait_drained(db: &Db) {
    loop {
        let left: i64 =
            sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM outbox WHERE published_at IS NULL)")
                .fetch_one(&db.pool)
                .await
                .expect("backlog probe");
        if left == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until the relays hold all 256 shards of this outbox between them.
async fn wait_leased(db: &Db) {
    let mut conn = db.pool.acquire().await.unwrap();
    let prefix: String = sqlx::query_scalar(seaorm_outbox_relay::MYSQL_LOCK_PREFIX_SQL)
        .fetch_one(&mut *conn)
        .await
        .expect("lock prefix");
    loop {
        let leased: i64 = sqlx::query_scalar(
            "WITH RECURSIVE n(k) AS (SELECT 0 UNION ALL SELECT k + 1 FROM n WHERE k < 255)
             SELECT CAST(COUNT(*) AS SIGNED) FROM n
             WHERE IS_USED_LOCK(CONCAT(?, 'shard:', k)) IS NOT NULL",
        )
        .bind(&prefix)
        .fetch_one(&mut *conn)
        .await
        .expect("lease probe");
        if leased == 256 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// One claimed batch.
#[derive(Default)]
struct Batch {
    seqs: Vec<i64>,
    keys: Vec<String>,
    payloads: Vec<String>,
    /// With [`Message::Contract`]: each event's contract headers, names and values.
    headers: Vec<[(&'static str, String); 4]>,
}

/// What the null pipeline sends.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Message {
    /// The key and the payload: the least a broker can be sent.
    Bare,
    /// The key, the payload and the contract's four headers (`id`, `event_type`,
    /// `aggregate_type`, `event_version`), read from the columns the relay reads them from:
    /// what the relay sends, without the relay.
    Contract,
}

/// The oldest unpublished rows through the all-NULL prefix of `outbox_unpublished` (schema
/// version 4: the rows not published, parked, held or backing off, in `seq` order), skipping the
/// `seq`s in `skip`, written into one text query as the relay writes its claim (the seqs checked
/// in the index).
async fn claim(conn: &mut MySqlConnection, batch: usize, skip: &[i64], message: Message) -> Batch {
    let skip: String = skip.iter().map(|seq| format!(",{seq}")).collect();
    let contract = match message {
        Message::Bare => "",
        Message::Contract => ", id, aggregate_type, event_type, event_version",
    };
    let sql = format!(
        "SELECT seq, aggregate_id, payload{contract} FROM outbox FORCE INDEX (outbox_unpublished)
         WHERE published_at IS NULL AND parked_at IS NULL AND held_at IS NULL
           AND retry_at IS NULL AND seq NOT IN (0{skip})
         ORDER BY seq LIMIT {batch}"
    );
    let rows = sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
        .fetch_all(&mut *conn)
        .await
        .expect("claim");
    let mut claimed = Batch::default();
    for r in rows {
        claimed.seqs.push(r.get(0));
        claimed.keys.push(r.get(1));
        claimed.payloads.push(r.get(2));
        if message == Message::Contract {
            let version: i32 = r.get(6);
            let headers = [
                ("id", r.get(3)),
                ("event_type", r.get(5)),
                ("aggregate_type", r.get(4)),
                ("event_version", version.to_string()),
            ];
            claimed.headers.push(headers);
        }
    }
    claimed
}

/// Marks (or deletes) the rows `seqs` in one statement, as the relay settles.
async fn settle(conn: &mut MySqlConnection, seqs: &[i64], mode: Mode) {
    let sql = match mode {
        Mode::Mark => {
            "UPDATE outbox o JOIN JSON_TABLE(?, '$[*]' COLUMNS (seq BIGINT PATH '$')) AS p
                 ON o.seq = p.seq
             SET o.published_at = UTC_TIMESTAMP(6), o.retry_at = NULL"
        }
        Mode::Delete => {
            "DELETE o FROM outbox o JOIN JSON_TABLE(?, '$[*]' COLUMNS (seq BIGINT PATH '$')) AS p
                 ON o.seq = p.seq"
        }
    };
    sqlx::query(sql)
        .bind(serde_json::to_string(seqs).unwrap())
        .execute(&mut *conn)
        .await
        .expect("settle");
}

/// Claim-and-mark (or delete) with no broker: rows/s.
async fn raw_sql(db: &Db, events: usize, batch: usize, mode: Mode) -> f64 {
    let mut conn = db.pool.acquire().await.unwrap();
    let started = Instant::now();
    loop {
        let claimed = claim(&mut conn, batch, &[], Message::Bare).await;
        if claimed.seqs.is_empty() {
            break;
        }
        settle(&mut conn, &claimed.seqs, mode).await;
    }
    events as f64 / started.elapsed().as_secs_f64()
}

/// The relay's work without the relay, pipelined as it runs: the next claim (skipping the batch
/// in flight) while the broker acks the current one, then the next sent and the acked one marked.
async fn pipelined_null_pipeline(
    db: &Db,
    brokers: &str,
    events: usize,
    batch: usize,
    mode: Mode,
    message: Message,
) -> f64 {
    let producer = producer(brokers);
    let topic = format!("bench-null-{}", Uuid::now_v7().simple());
    send_all(&producer, &topic, &["warm-up".into()], &["{}".into()]).await;
    let mut conn = db.pool.acquire().await.unwrap();
    let started = Instant::now();
    let mut in_flight: Option<(Batch, Vec<DeliveryFuture>)> = None;
    loop {
        let skip = in_flight
            .as_ref()
            .map(|(b, _)| b.seqs.clone())
            .unwrap_or_default();
        let claimed = claim(&mut conn, batch, &skip, message).await;
        let answered = match in_flight.take() {
            Some((sent, pending)) => {
                acked(pending).await;
                Some(sent)
            }
            None => None,
        };
        if claimed.seqs.is_empty() && answered.is_none() {
            break;
        }
        if !claimed.seqs.is_empty() {
            let pending = match message {
                Message::Bare => {
                    enqueue_all(&producer, &topic, &claimed.keys, &claimed.payloads).await
                }
                Message::Contract => enqueue_with_headers(&producer, &topic, &claimed).await,
            };
            in_flight = Some((claimed, pending));
        }
        if let Some(sent) = answered {
            settle(&mut conn, &sent.seqs, mode).await;
        }
    }
    events as f64 / started.elapsed().as_secs_f64()
}

/// Hands a claimed batch to the producer with each event's headers, as `enqueue_all` does
/// without them.
async fn enqueue_with_headers(
    producer: &FutureProducer,
    topic: &str,
    batch: &Batch,
) -> Vec<DeliveryFuture> {
    let mut pending = Vec::with_capacity(batch.keys.len());
    for ((key, payload), headers) in batch.keys.iter().zip(&batch.payloads).zip(&batch.headers) {
        // Built at enqueue, as the relay's sink builds them.
        let headers = headers.iter().fold(
            OwnedHeaders::new_with_capacity(headers.len()),
            |all, (key, value)| {
                all.insert(Header {
                    key,
                    value: Some(value),
                })
            },
        );
        let record = FutureRecord::to(topic)
            .key(key.as_bytes())
            .payload(payload.as_bytes())
            .headers(headers);
        pending.push(enqueue(producer, record).await);
    }
    pending
}

/// The relay (in process, as the PostgreSQL drains) draining the backlog: events/s.
async fn relay_drain(db: &Db, brokers: &str, events: usize, batch: usize, mode: Mode) -> f64 {
    let mut config = RelayConfig::new(&db.url);
    config.batch_size = batch;
    config.mode = mode;
    config.retention = None;
    config.topic_template = format!("bench-drain-{}.{{aggregate_type}}", Uuid::now_v7().simple());
    let shutdown = CancellationToken::new();
    let started = Instant::now();
    let sink = KafkaSink::new(&KafkaConfig::new(brokers)).expect("sink");
    let relay = Relay::new(config, sink);
    let running = tokio::spawn({
        let shutdown = shutdown.clone();
        async move { relay.run(shutdown).await.expect("the relay refused to run") }
    });
    wait_drained(db).await;
    let rate = events as f64 / started.elapsed().as_secs_f64();
    shutdown.cancel();
    running.await.unwrap();
    rate
}

/// Every measurement of the part, each on a database of its own, dropped at the end.
#[allow(clippy::too_many_arguments)]
pub async fn measure(
    admin_url: &str,
    postgres_url: &str,
    brokers: &str,
    events: usize,
    aggregates: usize,
    batch_sizes: &[usize],
    record_iterations: usize,
    rate: usize,
    latency_seconds: u64,
    rounds: usize,
) -> Measured {
    let mut created = Vec::new();
    let mut drains = Vec::new();
    for &batch in batch_sizes {
        for mode in [Mode::Mark, Mode::Delete] {
            let mut row = DrainRow {
                batch,
                mode,
                raw_sql: Vec::new(),
                pipelined_null: Vec::new(),
                contract_null: Vec::new(),
                relay: Vec::new(),
            };
            for _ in 0..rounds {
                for step in 0..4 {
                    let db = fresh(admin_url, &mut created).await;
                    fill(&db, events, aggregates).await;
                    let null = |message| {
                        pipelined_null_pipeline(&db, brokers, events, batch, mode, message)
                    };
                    match step {
                        0 => row.raw_sql.push(raw_sql(&db, events, batch, mode).await),
                        1 => row.pipelined_null.push(null(Message::Bare).await),
                        2 => row.contract_null.push(null(Message::Contract).await),
                        _ => row
                            .relay
                            .push(relay_drain(&db, brokers, events, batch, mode).await),
                    }
                    db.pool.close().await;
                }
            }
            drains.push(row);
        }
    }

    // The two servers in turn, each round: their means drift together with the machine's load.
    let mut record_cost: Vec<(String, Vec<f64>, Vec<f64>)> = Vec::new();
    for _ in 0..rounds {
        let db = fresh(admin_url, &mut created).await;
        let on_mariadb = record_cost::measure_table(&db.url, record_iterations).await;
        let postgres = crate::setup::fresh(postgres_url).await;
        let on_postgres = record_cost::measure_table(&postgres.url, record_iterations).await;
        for (i, ((case, mariadb), (_, postgres))) in
            on_mariadb.into_iter().zip(on_postgres).enumerate()
        {
            if record_cost.len() <= i {
                record_cost.push((case, Vec::new(), Vec::new()));
            }
            record_cost[i].1.push(mariadb);
            record_cost[i].2.push(postgres);
        }
    }

    let db = fresh(admin_url, &mut created).await;
    let config = RelayConfig::new(&db.url);
    let latency = latency::through_relay(
        &db.url,
        config,
        brokers,
        rate,
        latency_seconds,
        wait_leased(&db),
    )
    .await;

    let mut admin = MySqlConnection::connect(admin_url)
        .await
        .expect("connect to MariaDB");
    for name in created {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS {name}"
        )))
        .execute(&mut admin)
        .await
        .expect("drop database");
    }
    Measured {
        drains,
        record_cost,
        latency,
    }
}

impl Measured {
    /// The part's tables.
    pub fn markdown(&self) -> String {
        let mut out = String::new();
        let rounds = self.drains.first().map_or(0, |d| d.relay.len());
        let _ = writeln!(
            out,
            "\n### MariaDB (1 relay, in process; medians of {rounds} rounds)\n"
        );
        let _ = writeln!(
            out,
            "| batch | mode | raw SQL rows/s | pipelined null pipeline | the same with the contract's headers | relay events/s | relay / pipelined null | its range | relay / null with headers | its range |"
        );
        let _ = writeln!(out, "|---:|---|---:|---:|---:|---:|---:|---|---:|---|");
        for d in &self.drains {
            let mode = match d.mode {
                Mode::Mark => "mark",
                Mode::Delete => "delete",
            };
            let (ratios, contract) = (d.ratios(), d.contract_ratios());
            let ((low, high), (c_low, c_high)) = (range(&ratios), range(&contract));
            let _ = writeln!(
                out,
                "| {} | {mode} | {:.0} | {:.0} | {:.0} | {:.0} | {:.2} | {low:.2}-{high:.2} | {:.2} | {c_low:.2}-{c_high:.2} |",
                d.batch,
                median(&d.raw_sql),
                median(&d.pipelined_null),
                median(&d.contract_null),
                median(&d.relay),
                median(&ratios),
                median(&contract),
            );
        }
        let _ = writeln!(
            out,
            "\n`record` in a one-row transaction, mean µs per transaction (medians of {rounds} rounds):\n"
        );
        let _ = writeln!(out, "| transaction | MariaDB | PostgreSQL |");
        let _ = writeln!(out, "|---|---:|---:|");
        for (case, mariadb, postgres) in &self.record_cost {
            let _ = writeln!(
                out,
                "| {case} | {:.0} | {:.0} |",
                median(mariadb),
                median(postgres)
            );
        }
        if let (Some((_, m0, p0)), Some((_, m1, p1))) =
            (self.record_cost.first(), self.record_cost.get(2))
        {
            let adds = |alone: &[f64], with: &[f64]| -> Vec<f64> {
                with.iter().zip(alone).map(|(w, a)| w - a).collect()
            };
            let (on_mariadb, on_postgres) = (adds(m0, m1), adds(p0, p1));
            let by_round = |values: &[f64]| {
                values
                    .iter()
                    .map(|v| format!("{v:.0}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            let _ = writeln!(
                out,
                "\nOne `record` adds {:.0} µs on MariaDB ({} by round), {:.0} µs on PostgreSQL ({}).",
                median(&on_mariadb),
                by_round(&on_mariadb),
                median(&on_postgres),
                by_round(&on_postgres),
            );
        }
        let p = &self.latency;
        let _ = writeln!(
            out,
            "\nLatency at {:.0} events/s offered ({:.0} achieved), commit to ack: p50 {:.1} ms, p95 {:.1} ms, p99 {:.1} ms.",
            p.offered, p.achieved, p.p50_ms, p.p95_ms, p.p99_ms
        );
        out
    }

    /// The part's numbers as JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "drain": self.drains.iter().map(|d| serde_json::json!({
                "batch": d.batch,
                "mode": match d.mode { Mode::Mark => "mark", Mode::Delete => "delete" },
                "raw_sql": d.raw_sql, "pipelined_null_pipeline": d.pipelined_null,
                "pipelined_null_pipeline_with_headers": d.contract_null, "relay": d.relay,
                "relay_to_pipelined_null": d.ratios(),
                "relay_to_pipelined_null_with_headers": d.contract_ratios(),
            })).collect::<Vec<_>>(),
            "record_cost_us": self.record_cost.iter().map(|(case, m, p)| serde_json::json!({
                "transaction": case, "mariadb": m, "postgres": p,
            })).collect::<Vec<_>>(),
            "latency": {
                "offered": self.latency.offered, "achieved": self.latency.achieved,
                "p50_ms": self.latency.p50_ms, "p95_ms": self.latency.p95_ms, "p99_ms": self.latency.p99_ms,
            },
        })
    }
}
