//! `outbox-bench`: the relay measured against the physical limits of the same machine, in one run.
//!
//! Run it with `scripts/bench` (which starts PostgreSQL and Kafka) or `scripts/bench --smoke`.
//! It prints a markdown table and writes the numbers as JSON. Ratios measured in the same run are
//! the headline; absolute rates depend on the machine.

mod as_run;
mod broker_gc;
mod debezium;
mod drain;
mod latency;
mod limits;
mod mariadb;
mod null_wal;
mod processes;
mod pulsar;
mod record_cost;
mod report;
mod setup;
mod sinks;
mod tenants;
mod topic;
mod wal;

use clap::Parser;
use report::{Report, Row};
use seaorm_outbox_relay::{Mode, Wakeup};
use std::path::PathBuf;

#[derive(Debug, Parser)]
#[command(about = "Measures the outbox relay against the raw SQL and raw producer limits.")]
struct Args {
    /// A short run, to check that the harness works; its numbers mean little.
    #[arg(long)]
    smoke: bool,
    /// Where to write the results as JSON.
    #[arg(long, default_value = "bench-results.json")]
    json: PathBuf,
    /// PostgreSQL to measure on.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    database_url: String,
    /// Kafka to measure on.
    #[arg(long, env = "KAFKA_BROKERS")]
    kafka_brokers: String,
    /// Pulsar to measure on (the `pulsar` part).
    #[arg(long, env = "PULSAR_URL")]
    pulsar_url: Option<String>,
    /// MariaDB (or MySQL) to measure on (the `mariadb` part): a URL with a database, whose user
    /// may create databases.
    #[arg(long, env = "MARIADB_URL", hide_env_values = true)]
    mariadb_url: Option<String>,
    /// The outbox-relay binary whose CPU and memory are measured [default: beside this one].
    #[arg(long)]
    relay_bin: Option<PathBuf>,
    /// Run only these parts (repeat): limits, drain, latency, record, resources, pulsar, wal,
    /// debezium, as-run, mariadb, sinks; and tenants, only when named.
    #[arg(long, value_enum)]
    only: Vec<Part>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Part {
    Limits,
    Drain,
    Latency,
    Record,
    Resources,
    Pulsar,
    Wal,
    Debezium,
    /// The relay binary as users run it, beside the null WAL pipeline and Debezium.
    AsRun,
    /// The relay on MariaDB against that backend's limits, `record`'s cost there, latency.
    Mariadb,
    /// NATS JetStream, RabbitMQ and SQS (on ElasticMQ): each raw client against the relay binary.
    Sinks,
    /// 100 tenant databases with a trickle each and one busy one, through one relay binary (not
    /// in a plain run: it needs max_connections raised, which `bench/tenants.sh` does).
    Tenants,
}

/// How much work each part does.
struct Scale {
    events: usize,
    batch_sizes: &'static [usize],
    replicas: &'static [usize],
    rates: &'static [usize],
    latency_seconds: u64,
    record_iterations: usize,
    /// Rounds of the as-run drains, interleaved.
    rounds: usize,
    /// Rounds of the MariaDB drains (their ratios spread more from one run to the next).
    mariadb_rounds: usize,
}

const AGGREGATES: usize = 1000;

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let scale = if args.smoke {
        Scale {
            events: 2_000,
            batch_sizes: &[100],
            replicas: &[1],
            rates: &[200],
            latency_seconds: 1,
            record_iterations: 20,
            rounds: 1,
            mariadb_rounds: 1,
        }
    } else {
        Scale {
            events: 200_000,
            batch_sizes: &[100, 500, 1000],
            replicas: &[1, 2],
            rates: &[1000, 5000],
            latency_seconds: 10,
            record_iterations: 2000,
            rounds: 2,
            mariadb_rounds: 3,
        }
    };
    let (db, kafka) = (args.database_url.as_str(), args.kafka_brokers.as_str());
    let mut report = Report::new(args.smoke, scale.events, AGGREGATES);
    report.payload_bytes = {
        let probe = setup::fresh(db).await;
        setup::fill(&probe, 100, AGGREGATES).await;
        setup::payload_bytes(&probe).await
    };

    let run = |part: Part| args.only.is_empty() || args.only.contains(&part);

    // Freshly started services compile their hot paths (the broker's JIT) during the first load:
    // without this, whichever part runs first measured a p99 of 0.6 s instead of 30 ms.
    eprintln!("warming up...");
    limits::raw_producer(kafka, scale.events, AGGREGATES, 500).await;
    latency::measure(
        db,
        kafka,
        scale.rates[0],
        scale.latency_seconds,
        Wakeup::Poll,
        None,
    )
    .await;

    if run(Part::Limits) || run(Part::Drain) {
        eprintln!("limits...");
        for &batch in scale.batch_sizes {
            for mode in [Mode::Mark, Mode::Delete] {
                let sql = limits::raw_sql(db, scale.events, AGGREGATES, batch, mode).await;
                let null =
                    limits::null_pipeline(db, kafka, scale.events, AGGREGATES, batch, mode).await;
                let pipelined = limits::pipelined_null_pipeline(
                    db,
                    kafka,
                    scale.events,
                    AGGREGATES,
                    batch,
                    mode,
                )
                .await;
                report
                    .limits
                    .push(Row::limit(batch, mode, sql, null, pipelined));
            }
        }
        report.raw_producer = limits::raw_producer(kafka, scale.events, AGGREGATES, 500).await;
    }

    if run(Part::Drain) {
        eprintln!("relay drains...");
        for &batch in scale.batch_sizes {
            for mode in [Mode::Mark, Mode::Delete] {
                for &replicas in scale.replicas {
                    let rate =
                        drain::drain(db, kafka, scale.events, AGGREGATES, batch, mode, replicas)
                            .await;
                    report.add_drain(batch, mode, replicas, rate);
                }
            }
        }
    }

    if run(Part::Latency) {
        eprintln!("latency...");
        for &rate in scale.rates {
            for wakeup in [Wakeup::Poll, Wakeup::Notify] {
                let p =
                    latency::measure(db, kafka, rate, scale.latency_seconds, wakeup, None).await;
                let name = if wakeup == Wakeup::Notify {
                    "polling relay, LISTEN/NOTIFY"
                } else {
                    "polling relay, adaptive polling"
                };
                report.add_latency(name, p);
            }
            if run(Part::Wal) {
                for (backlog, name) in [
                    (wal::Backlog::Rows, "WAL source, table rows"),
                    (wal::Backlog::Messages, "WAL source, table-less"),
                ] {
                    let p = latency::measure(
                        db,
                        kafka,
                        rate,
                        scale.latency_seconds,
                        Wakeup::Poll,
                        Some(backlog),
                    )
                    .await;
                    report.add_latency(name, p);
                }
            }
        }
    }

    if run(Part::Record) {
        eprintln!("record cost...");
        report.record_cost = record_cost::measure(db, scale.record_iterations).await;
    }

    if run(Part::Resources) {
        eprintln!("relay resources...");
        let relay_bin = relay_bin(&args);
        report.resources =
            Some(drain::resources(&relay_bin, db, kafka, scale.events, AGGREGATES).await);
    }

    if run(Part::Wal) {
        eprintln!("WAL source...");
        if report.raw_producer == 0.0 {
            report.raw_producer = limits::raw_producer(kafka, scale.events, AGGREGATES, 500).await;
        }
        for (backlog, name) in [
            (wal::Backlog::Rows, "table rows"),
            (wal::Backlog::Messages, "table-less events"),
        ] {
            let rate = wal::drain(db, kafka, scale.events, AGGREGATES, backlog).await;
            report.wal_drain.push((name.to_owned(), rate));
        }
        let relay_bin = relay_bin(&args);
        report.wal_resources =
            Some(drain::wal_resources(&relay_bin, db, kafka, scale.events, AGGREGATES).await);
    }

    if run(Part::AsRun) {
        eprintln!("as users run it...");
        let relay_bin = relay_bin(&args);
        for _ in 0..scale.rounds {
            for setting in [
                as_run::Setting::Polling(Mode::Mark, 500),
                as_run::Setting::Polling(Mode::Delete, 1000),
                as_run::Setting::Wal(wal::Backlog::Rows),
                as_run::Setting::Wal(wal::Backlog::Messages),
            ] {
                let drained =
                    as_run::drain(&relay_bin, db, kafka, scale.events, AGGREGATES, setting).await;
                report.as_run.push(drained);
            }
            report
                .as_run
                .push(null_wal::drain(db, kafka, scale.events, AGGREGATES).await);
        }
    }

    if run(Part::Debezium) {
        eprintln!("Debezium...");
        if report.raw_producer == 0.0 {
            report.raw_producer = limits::raw_producer(kafka, scale.events, AGGREGATES, 500).await;
        }
        let results = debezium::measure(
            db,
            kafka,
            scale.events,
            AGGREGATES,
            scale.rates,
            scale.latency_seconds,
        )
        .await;
        report
            .wal_drain
            .push(("table rows, Debezium".to_owned(), results.drain));
        for p in results.latency {
            report.add_latency("Debezium, to the broker's append time", p);
        }
        report.as_run.push(as_run::Drained {
            name: "Debezium".into(),
            events_per_second: results.drain,
            cpu: results.cpu,
            peak_rss_mib: results.peak_rss_mib,
        });
        report.debezium_resources = Some(drain::Resources {
            cpu_us_per_event: results.cpu_us_per_event,
            peak_rss_mib: results.peak_rss_mib,
            events_per_second: results.drain,
        });
    }

    if run(Part::Pulsar) {
        eprintln!("pulsar...");
        let url = args
            .pulsar_url
            .as_deref()
            .expect("the pulsar part needs --pulsar-url or PULSAR_URL (scripts/bench starts one)");
        let batch = 500;
        // A stalled Pulsar fails the run with a message instead of holding it (and CI) forever.
        let within = |what: &'static str| {
            move |result: Result<f64, tokio::time::error::Elapsed>| {
                result
                    .unwrap_or_else(|_| panic!("{what} did not finish in 5 minutes: is Pulsar up?"))
            }
        };
        let limit = std::time::Duration::from_secs(300);
        let raw = tokio::time::timeout(
            limit,
            pulsar::raw_producer(url, scale.events, AGGREGATES, batch),
        )
        .await;
        let raw = within("the raw Pulsar producer")(raw);
        let relay = tokio::time::timeout(
            limit,
            pulsar::drain(db, url, scale.events, AGGREGATES, batch),
        )
        .await;
        let relay = within("the relay's Pulsar drain")(relay);
        report.pulsar = Some(report::PulsarRow {
            batch,
            raw_producer: raw,
            relay,
        });
    }

    if run(Part::Mariadb) {
        eprintln!("MariaDB...");
        let url = args.mariadb_url.as_deref().expect(
            "the mariadb part needs --mariadb-url or MARIADB_URL (scripts/bench starts one)",
        );
        report.mariadb = Some(
            mariadb::measure(
                url,
                db,
                kafka,
                scale.events,
                AGGREGATES,
                scale.batch_sizes,
                scale.record_iterations,
                scale.rates[0],
                scale.latency_seconds,
                scale.mariadb_rounds,
            )
            .await,
        );
    }

    if run(Part::Sinks) {
        eprintln!("sinks...");
        let relay_bin = relay_bin(&args);
        let servers = sinks::Servers::from_env();
        report.sinks =
            sinks::measure(&relay_bin, db, &servers, scale.events, AGGREGATES, 500).await;
    }

    if args.only.contains(&Part::Tenants) {
        eprintln!("tenants...");
        let relay_bin = relay_bin(&args);
        let (tenants, seconds) = if args.smoke { (5, 10) } else { (100, 180) };
        let measured = tenants::measure(
            &relay_bin,
            db,
            &args.kafka_brokers,
            tenants,
            10,
            1000,
            seconds,
        )
        .await;
        println!("{}\n", tenants::markdown(&measured));
    }

    setup::drop_all(db).await;
    println!("{}", report.markdown());
    std::fs::write(&args.json, report.json())
        .unwrap_or_else(|e| panic!("write {}: {e}", args.json.display()));
    eprintln!("results written to {}", args.json.display());
}

/// The outbox-relay binary to measure: `--relay-bin`, or the one beside this one.
fn relay_bin(args: &Args) -> PathBuf {
    args.relay_bin.clone().unwrap_or_else(|| {
        std::env::current_exe()
            .unwrap()
            .with_file_name("outbox-relay")
    })
}
