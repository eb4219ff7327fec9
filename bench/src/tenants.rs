//! Tenant databases: one relay binary publishing many tenants' outboxes (`--tenants FILE`), most
//! with a trickle of events and one busy, to Kafka. Measured: the relay's CPU, memory and
//! connections, and each tenant's commit-to-mark latency (`published_at - created_at`, one event
//! per transaction).

use crate::processes::{cpu_seconds, peak_rss_mib};
use sqlx::Connection;
use sqlx::postgres::PgConnection;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// What one run measured.
pub struct Measured {
    pub trickle_tenants: usize,
    pub trickle_rate: u32,
    pub busy_rate: u32,
    pub seconds: u64,
    /// The relay's CPU, in % of one core, while measured.
    pub relay_cpu_percent: f64,
    pub relay_peak_rss_mib: f64,
    /// The most connections the relay held at once, across every tenant database.
    pub relay_connections: i64,
    /// The trickle tenants' p99 latencies (ms): the median tenant's and the worst tenant's.
    pub trickle_p99_ms: (f64, f64),
    pub busy_p99_ms: f64,
    /// Events recorded while measured, across tenants.
    pub events: i64,
}

/// The markdown row of `m`.
pub fn markdown(m: &Measured) -> String {
    format!(
        "| tenants | rate per trickle tenant | busy tenant | measured | relay CPU | relay peak RSS | relay connections | trickle p99 (median tenant / worst) | busy p99 | events |\n\
         |---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n\
         | {} + 1 busy | {}/s | {}/s | {} s | {:.1}% | {:.0} MiB | {} | {:.1} / {:.1} ms | {:.1} ms | {} |",
        m.trickle_tenants,
        m.trickle_rate,
        m.busy_rate,
        m.seconds,
        m.relay_cpu_percent,
        m.relay_peak_rss_mib,
        m.relay_connections,
        m.trickle_p99_ms.0,
        m.trickle_p99_ms.1,
        m.busy_p99_ms,
        m.events,
    )
}

/// Runs the relay over `trickle_tenants` databases recording `trickle_rate` events/s each and one
/// recording `busy_rate`, for a warm-up then `seconds` measured.
pub async fn measure(
    relay_bin: &Path,
    base_url: &str,
    brokers: &str,
    trickle_tenants: usize,
    trickle_rate: u32,
    busy_rate: u32,
    seconds: u64,
) -> Measured {
    let mut admin = PgConnection::connect(base_url).await.expect("connect");
    let max: String = sqlx::query_scalar("SHOW max_connections")
        .fetch_one(&mut admin)
        .await
        .expect("max_connections");
    let needed = 2 * (trickle_tenants + 1) + 20;
    assert!(
        max.parse::<usize>().unwrap_or(0) >= needed,
        "the tenants benchmark needs max_connections >= {needed} (one connection per tenant for \
         the load, one for the relay): bench/tenants.sh raises it"
    );
    let server = &base_url[..base_url.rfind('/').expect("a database in the URL")];
    let names: Vec<String> = (0..=trickle_tenants)
        .map(|i| format!("bench_tenant_{i}"))
        .collect();
    eprintln!("tenants: creating {} databases...", names.len());
    for name in &names {
        admin_sql(
            &mut admin,
            &format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"),
        )
        .await;
        admin_sql(&mut admin, &format!("CREATE DATABASE {name}")).await;
        let orm = seaorm_outbox::sea_orm::Database::connect(format!("{server}/{name}"))
            .await
            .expect("connect to a tenant");
        seaorm_outbox::migration::migrate(&orm)
            .await
            .expect("migrate");
        orm.close().await.ok();
    }
    let file = std::env::temp_dir().join(format!("bench-tenants-{}", std::process::id()));
    let lines: Vec<String> = names
        .iter()
        .map(|name| format!("{name} {server}/{name}"))
        .collect();
    std::fs::write(&file, lines.join("\n")).expect("tenants file");

    let mut relay = Command::new(relay_bin)
        .args([
            "run",
            "--database-url",
            base_url,
            "--kafka-brokers",
            brokers,
        ])
        .args([
            "--http-addr",
            "off",
            "--topic-template",
            "bench-tenants.{aggregate_type}",
        ])
        .arg("--tenants")
        .arg(&file)
        .env("OUTBOX_LOG", "warn")
        .stdout(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("start {}: {e}", relay_bin.display()));

    // The load: one connection per tenant, one event per transaction at its rate.
    let stop = tokio_util::sync::CancellationToken::new();
    let mut load = Vec::new();
    for (i, name) in names.iter().enumerate() {
        let rate = if i == 0 { busy_rate } else { trickle_rate };
        let url = format!("{server}/{name}");
        let stop = stop.clone();
        load.push(tokio::spawn(async move {
            let mut conn = PgConnection::connect(&url)
                .await
                .expect("connect to a tenant");
            let mut tick = tokio::time::interval(Duration::from_secs(1) / rate);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            let mut n: i64 = 0;
            while !stop.is_cancelled() {
                tick.tick().await;
                sqlx::query(
                    "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
                     VALUES (gen_random_uuid(), 'order', 'agg-' || ($1 % 100), 'OrderPlaced',
                             jsonb_build_object('n', $1, 'note', repeat('x', 150)))",
                )
                .bind(n)
                .execute(&mut conn)
                .await
                .expect("record");
                n += 1;
            }
        }));
    }
    eprintln!("tenants: warming up for 30 s...");
    tokio::time::sleep(Duration::from_secs(30)).await;
    let started_at: f64 = sqlx::query_scalar("SELECT extract(epoch FROM now())::float8")
        .fetch_one(&mut admin)
        .await
        .expect("now");
    let cpu_before = cpu_seconds(relay.id());
    let started = Instant::now();
    let mut relay_connections = 0;
    eprintln!("tenants: measuring for {seconds} s...");
    while started.elapsed() < Duration::from_secs(seconds) {
        let held: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'outbox-relay'",
        )
        .fetch_one(&mut admin)
        .await
        .expect("connections");
        relay_connections = relay_connections.max(held);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let relay_cpu_percent =
        100.0 * (cpu_seconds(relay.id()) - cpu_before) / started.elapsed().as_secs_f64();
    let relay_peak_rss_mib = peak_rss_mib(relay.id());
    stop.cancel();
    for task in load {
        task.await.expect("load");
    }

    // Each tenant's latency over what was recorded while measured, once all of it is marked.
    let mut trickle = Vec::new();
    let mut busy_p99_ms = 0.0;
    let mut events = 0;
    for (i, name) in names.iter().enumerate() {
        let mut conn = PgConnection::connect(&format!("{server}/{name}"))
            .await
            .expect("connect to a tenant");
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let left: bool = sqlx::query_scalar(
                "SELECT EXISTS (SELECT 1 FROM outbox WHERE published_at IS NULL)",
            )
            .fetch_one(&mut conn)
            .await
            .expect("backlog");
            if !left {
                break;
            }
            assert!(Instant::now() < deadline, "tenant {name} was not drained");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let (p99, count): (f64, i64) = sqlx::query_as(
            "SELECT coalesce(percentile_cont(0.99) WITHIN GROUP (ORDER BY \
                      extract(epoch FROM published_at - created_at) * 1000), 0)::float8, count(*) \
             FROM outbox WHERE created_at >= to_timestamp($1) \
               AND created_at < to_timestamp($1) + make_interval(secs => $2)",
        )
        .bind(started_at)
        .bind(seconds as f64)
        .fetch_one(&mut conn)
        .await
        .expect("latency");
        events += count;
        if i == 0 {
            busy_p99_ms = p99;
        } else {
            trickle.push(p99);
        }
    }
    let _ = Command::new("kill")
        .args(["-TERM", &relay.id().to_string()])
        .status();
    relay.wait().expect("the relay stops");
    for name in &names {
        admin_sql(
            &mut admin,
            &format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"),
        )
        .await;
    }
    std::fs::remove_file(&file).ok();
    trickle.sort_by(f64::total_cmp);
    Measured {
        trickle_tenants,
        trickle_rate,
        busy_rate,
        seconds,
        relay_cpu_percent,
        relay_peak_rss_mib,
        relay_connections,
        trickle_p99_ms: (trickle[trickle.len() / 2], trickle[trickle.len() - 1]),
        busy_p99_ms,
        events,
    }
}

/// Runs `sql` (creating or dropping a tenant's database) on the admin connection.
async fn admin_sql(admin: &mut PgConnection, sql: &str) {
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned()))
        .execute(admin)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}
