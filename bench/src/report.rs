//! The results: a markdown table for people, JSON for machines.

use crate::as_run::Drained;
use crate::drain::Resources;
use crate::latency::Percentiles;
use seaorm_outbox_relay::Mode;
use serde_json::json;
use std::fmt::Write;

pub struct Row {
    batch: usize,
    mode: Mode,
    raw_sql: f64,
    null_pipeline: f64,
    pipelined_null: f64,
    relay: Vec<(usize, f64)>,
}

impl Row {
    pub fn limit(
        batch: usize,
        mode: Mode,
        raw_sql: f64,
        null_pipeline: f64,
        pipelined_null: f64,
    ) -> Row {
        Row {
            batch,
            mode,
            raw_sql,
            null_pipeline,
            pipelined_null,
            relay: Vec::new(),
        }
    }
}

/// The Pulsar part: the raw producer and the relay's Pulsar sink, same batch size.
pub struct PulsarRow {
    pub batch: usize,
    pub raw_producer: f64,
    pub relay: f64,
}

pub struct Report {
    smoke: bool,
    events: usize,
    aggregates: usize,
    pub payload_bytes: f64,
    pub limits: Vec<Row>,
    pub raw_producer: f64,
    latency: Vec<(String, Percentiles)>,
    /// The WAL source: (what, events/s) drains, and its binary's resources.
    pub wal_drain: Vec<(String, f64)>,
    pub wal_resources: Option<Resources>,
    /// Debezium's Kafka Connect worker over its drain.
    pub debezium_resources: Option<Resources>,
    pub record_cost: Vec<(String, f64)>,
    pub resources: Option<Resources>,
    pub pulsar: Option<PulsarRow>,
    /// Drains as users run them (the relay binary), the null WAL pipeline and Debezium, each
    /// publisher once per round.
    pub as_run: Vec<Drained>,
    /// The `mariadb` part.
    pub mariadb: Option<crate::mariadb::Measured>,
    /// The `sinks` part.
    pub sinks: crate::sinks::Measured,
}

fn mode_name(mode: Mode) -> &'static str {
    match mode {
        Mode::Mark => "mark",
        Mode::Delete => "delete",
    }
}

fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines().find_map(|l| {
                l.strip_prefix("model name")
                    .map(|m| m.trim_start_matches([' ', '\t', ':']).to_owned())
            })
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let mem_gib = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines().find_map(|l| {
                l.strip_prefix("MemTotal:")
                    .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
            })
        })
        .map_or(0.0, |kib| kib / 1024.0 / 1024.0);
    format!(
        "{cpu}, {cores} cores, {mem_gib:.0} GiB; PostgreSQL and single-node Kafka on the same machine"
    )
}

impl Report {
    pub fn new(smoke: bool, events: usize, aggregates: usize) -> Report {
        Report {
            smoke,
            events,
            aggregates,
            payload_bytes: 0.0,
            limits: Vec::new(),
            raw_producer: 0.0,
            latency: Vec::new(),
            wal_drain: Vec::new(),
            wal_resources: None,
            debezium_resources: None,
            record_cost: Vec::new(),
            resources: None,
            pulsar: None,
            sinks: crate::sinks::Measured::default(),
            as_run: Vec::new(),
            mariadb: None,
        }
    }

    pub fn add_drain(&mut self, batch: usize, mode: Mode, replicas: usize, rate: f64) {
        if let Some(row) = self
            .limits
            .iter_mut()
            .find(|r| r.batch == batch && r.mode == mode)
        {
            row.relay.push((replicas, rate));
        }
    }

    pub fn add_latency(&mut self, source: &str, p: Percentiles) {
        self.latency.push((source.to_owned(), p));
    }

    pub fn markdown(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "## outbox benchmark{}\n",
            if self.smoke {
                " (smoke run: numbers not meaningful)"
            } else {
                ""
            }
        );
        let _ = writeln!(out, "Machine: {}.", machine());
        // A part left out by `--only` prints nothing, not an empty table or a zero.
        let _ = write!(
            out,
            "Backlog: {} events over {} aggregates, payload {:.0} bytes.",
            self.events, self.aggregates, self.payload_bytes
        );
        if self.raw_producer > 0.0 {
            let _ = write!(
                out,
                " Raw producer (batches of 500): {:.0} msgs/s.",
                self.raw_producer
            );
        }
        let _ = writeln!(out);
        if !self.limits.is_empty() {
            self.drain_table(&mut out);
        }
        if !self.latency.is_empty() {
            self.latency_table(&mut out);
        }
        if !self.record_cost.is_empty() {
            self.record_table(&mut out);
        }
        self.later_sections(&mut out);
        out
    }

    fn drain_table(&self, out: &mut String) {
        let _ = writeln!(out, "\n### Draining a backlog (events/s acked by Kafka)\n");
        let _ = writeln!(
            out,
            "| batch | mode | raw SQL | null pipeline, serial | null pipeline, pipelined | relay, 1 replica | relay, 2 replicas | efficiency (1 replica / pipelined null) | efficiency (1 replica / serial null) |"
        );
        let _ = writeln!(out, "|---:|---|---:|---:|---:|---:|---:|---:|---:|");
        for r in &self.limits {
            let relay = |n: usize| r.relay.iter().find(|(k, _)| *k == n).map(|(_, v)| *v);
            let fmt = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{v:.0}"));
            let efficiency =
                |limit: f64| relay(1).map_or("-".to_owned(), |v| format!("{:.2}", v / limit));
            let _ = writeln!(
                out,
                "| {} | {} | {:.0} | {:.0} | {:.0} | {} | {} | {} | {} |",
                r.batch,
                mode_name(r.mode),
                r.raw_sql,
                r.null_pipeline,
                r.pipelined_null,
                fmt(relay(1)),
                fmt(relay(2)),
                efficiency(r.pipelined_null),
                efficiency(r.null_pipeline),
            );
        }
    }

    fn latency_table(&self, out: &mut String) {
        let _ = writeln!(
            out,
            "\n### Latency, commit to broker ack (as the relay sees it)\n"
        );
        let _ = writeln!(
            out,
            "| source | offered/s | achieved/s | p50 ms | p95 ms | p99 ms | p99 ms, commit to sink | broker GC pauses meanwhile: count, longest ms, total ms |"
        );
        let _ = writeln!(out, "|---|---:|---:|---:|---:|---:|---:|---:|");
        for (name, p) in &self.latency {
            let to_sink = p
                .p99_to_sink_ms
                .map_or("–".to_owned(), |ms| format!("{ms:.1}"));
            let gc = p.broker_gc.map_or("–".to_owned(), |g| {
                format!("{}, {:.1}, {:.0}", g.count, g.max_ms, g.total_ms)
            });
            let _ = writeln!(
                out,
                "| {name} | {:.0} | {:.0} | {:.1} | {:.1} | {:.1} | {to_sink} | {gc} |",
                p.offered, p.achieved, p.p50_ms, p.p95_ms, p.p99_ms
            );
        }
    }

    fn record_table(&self, out: &mut String) {
        let _ = writeln!(out, "\n### record() in a one-row business transaction\n");
        let _ = writeln!(out, "| transaction | mean µs | ratio to business alone |");
        let _ = writeln!(out, "|---|---:|---:|");
        let base = self.record_cost.first().map_or(1.0, |(_, v)| *v);
        for (label, us) in &self.record_cost {
            let _ = writeln!(out, "| {label} | {us:.0} | {:.2} |", us / base);
        }
    }

    fn later_sections(&self, out: &mut String) {
        if let Some(r) = &self.resources {
            let _ = writeln!(out, "\n### The relay binary (1 replica, batch 500, mark)\n");
            let _ = writeln!(
                out,
                "{:.0} events/s; {:.1} µs CPU per event; peak resident memory {:.1} MiB.",
                r.events_per_second, r.cpu_us_per_event, r.peak_rss_mib
            );
        }
        if !self.wal_drain.is_empty() {
            let _ = writeln!(
                out,
                "\n### The WAL source: a backlog retained in the WAL, drained by one relay (events/s acked)\n"
            );
            let _ = writeln!(out, "| backlog | events/s | / raw producer |");
            let _ = writeln!(out, "|---|---:|---:|");
            for (what, rate) in &self.wal_drain {
                let _ = writeln!(
                    out,
                    "| {what} | {rate:.0} | {:.2} |",
                    rate / self.raw_producer.max(1.0)
                );
            }
        }
        if let Some(r) = &self.wal_resources {
            let _ = writeln!(
                out,
                "\n### The relay binary on the WAL source (table rows)\n"
            );
            let _ = writeln!(
                out,
                "{:.0} events/s; {:.1} µs CPU per event; peak resident memory {:.1} MiB.",
                r.events_per_second, r.cpu_us_per_event, r.peak_rss_mib
            );
        }
        if let Some(r) = &self.debezium_resources {
            let _ = writeln!(
                out,
                "\n### Debezium's Kafka Connect worker (JVM) over its drain\n"
            );
            let _ = writeln!(
                out,
                "{:.0} events/s; {:.1} µs CPU per event; peak resident memory {:.1} MiB.",
                r.events_per_second, r.cpu_us_per_event, r.peak_rss_mib
            );
        }
        if !self.as_run.is_empty() {
            out.push_str(&self.as_run_table());
        }
        if !self.sinks.rows.is_empty() {
            out.push_str(&self.sinks_tables());
        }
        if let Some(p) = &self.pulsar {
            let _ = writeln!(out, "\n### Pulsar (1 replica, batch {}, mark)\n", p.batch);
            let _ = writeln!(
                out,
                "| raw producer msgs/s | relay events/s | relay / raw producer |"
            );
            let _ = writeln!(out, "|---:|---:|---:|");
            let _ = writeln!(
                out,
                "| {:.0} | {:.0} | {:.2} |",
                p.raw_producer,
                p.relay,
                p.relay / p.raw_producer
            );
        }
        if let Some(m) = &self.mariadb {
            out.push_str(&m.markdown());
        }
    }

    pub fn json(&self) -> String {
        let limits: Vec<_> = self
            .limits
            .iter()
            .map(|r| {
                json!({
                    "batch": r.batch, "mode": mode_name(r.mode), "raw_sql": r.raw_sql, "null_pipeline": r.null_pipeline, "pipelined_null_pipeline": r.pipelined_null,
                    "relay": r.relay.iter().map(|(n, v)| json!({ "replicas": n, "events_per_second": v })).collect::<Vec<_>>(),
                })
            })
            .collect();
        let latency: Vec<_> = self
            .latency
            .iter()
            .map(|(source, p)| json!({
                "source": source,
                "offered": p.offered, "achieved": p.achieved, "p50_ms": p.p50_ms, "p95_ms": p.p95_ms, "p99_ms": p.p99_ms, "p99_to_sink_ms": p.p99_to_sink_ms,
                "broker_gc": p.broker_gc.map(|g| json!({ "pauses": g.count, "longest_ms": g.max_ms, "total_ms": g.total_ms })),
            }))
            .collect();
        let value = json!({
            "smoke": self.smoke,
            "machine": machine(),
            "events": self.events,
            "aggregates": self.aggregates,
            "payload_bytes": self.payload_bytes,
            "raw_producer": self.raw_producer,
            "drain": limits,
            "latency": latency,
            "record_cost_us": self.record_cost.iter().map(|(l, v)| json!({ "transaction": l, "mean_us": v })).collect::<Vec<_>>(),
            "pulsar": self.pulsar.as_ref().map(|p| json!({
                "batch": p.batch, "raw_producer": p.raw_producer, "relay": p.relay,
            })),
            "mariadb": self.mariadb.as_ref().map(crate::mariadb::Measured::json),
            "sinks": self.sinks.rows.iter().map(|r| json!({
                "sink": r.sink, "server": r.server, "events": r.events,
                "raw_client": run_json(&r.raw), "relay": run_json(&r.relay),
                "relay_delete": run_json(&r.relay_delete),
                "relay_no_broker": run_json(&self.sinks.no_broker),
            })).collect::<Vec<_>>(),
            "as_run": self.as_run.iter().map(|d| json!({
                "publisher": d.name, "events_per_second": d.events_per_second,
                "publisher_cpu_us_per_event": d.cpu.publisher_us, "postgres_cpu_us_per_event": d.cpu.postgres_us,
                "kafka_cpu_us_per_event": d.cpu.broker_us, "peak_rss_mib": d.peak_rss_mib,
            })).collect::<Vec<_>>(),
            "wal_drain": self.wal_drain.iter().map(|(w, v)| json!({ "backlog": w, "events_per_second": v })).collect::<Vec<_>>(),
            "wal_relay_binary": self.wal_resources.as_ref().map(|r| json!({
                "events_per_second": r.events_per_second, "cpu_us_per_event": r.cpu_us_per_event, "peak_rss_mib": r.peak_rss_mib,
            })),
            "debezium_worker": self.debezium_resources.as_ref().map(|r| json!({
                "events_per_second": r.events_per_second, "cpu_us_per_event": r.cpu_us_per_event, "peak_rss_mib": r.peak_rss_mib,
            })),
            "relay_binary": self.resources.as_ref().map(|r| json!({
                "events_per_second": r.events_per_second, "cpu_us_per_event": r.cpu_us_per_event, "peak_rss_mib": r.peak_rss_mib,
            })),
        });
        serde_json::to_string_pretty(&value).unwrap()
    }
}

impl Report {
    /// The other sinks: each raw client's limit and the relay's drains (mark and delete mode),
    /// then where each run's CPU went and the cores it kept busy.
    fn sinks_tables(&self) -> String {
        let mut out = String::new();
        let no_broker = &self.sinks.no_broker;
        let _ = writeln!(
            out,
            "\n### Other sinks (the relay binary, 1 replica, batch 500)\n\n\
             The relay with the stdout sink (no broker, mark mode) drains {:.0} events/s: its own \
             limit on this database. The last column divides the mark-mode drain by the lower of \
             that and the raw client's.\n",
            no_broker.rate
        );
        let _ = writeln!(
            out,
            "| sink | server | events | raw client msgs/s | relay, mark | relay, delete | mark / raw client | delete / raw client | mark / limit |"
        );
        let _ = writeln!(out, "|---|---|---:|---:|---:|---:|---:|---:|---:|");
        for r in &self.sinks.rows {
            let _ = writeln!(
                out,
                "| {} | {} | {} | {:.0} | {:.0} | {:.0} | {:.2} | {:.2} | {:.2} |",
                r.sink,
                r.server,
                r.events,
                r.raw.rate,
                r.relay.rate,
                r.relay_delete.rate,
                r.relay.rate / r.raw.rate,
                r.relay_delete.rate / r.raw.rate,
                r.ratio_to_limit(no_broker.rate)
            );
        }
        let _ = writeln!(
            out,
            "\nCPU µs per event: the publisher (the raw client in this process, or the relay), \
             PostgreSQL, the broker; and the cores the three kept busy (of 2).\n"
        );
        let _ = writeln!(
            out,
            "| sink | run | per s | publisher | PostgreSQL | broker | cores busy |"
        );
        let _ = writeln!(out, "|---|---|---:|---:|---:|---:|---:|");
        let mut line = |sink: &str, run: &str, r: &crate::sinks::Run| {
            let _ = writeln!(
                out,
                "| {sink} | {run} | {:.0} | {:.1} | {:.1} | {} | {:.2} |",
                r.rate,
                r.cpu.publisher_us,
                r.cpu.postgres_us,
                r.cpu.broker_us.map_or("-".into(), |b| format!("{b:.1}")),
                r.cores_busy()
            );
        };
        line("stdout", "relay, mark", no_broker);
        for r in &self.sinks.rows {
            line(r.sink, "raw client", &r.raw);
            line(r.sink, "relay, mark", &r.relay);
            line(r.sink, "relay, delete", &r.relay_delete);
        }
        out
    }

    /// The drains as users run them: one row per publisher, its rounds side by side, the ratios to
    /// Debezium and to the null WAL pipeline from the same run, and the CPU each event cost where.
    fn as_run_table(&self) -> String {
        let mut names: Vec<&str> = Vec::new();
        for d in &self.as_run {
            if !names.contains(&d.name.as_str()) {
                names.push(&d.name);
            }
        }
        let rounds = |name: &str| -> Vec<&Drained> {
            self.as_run.iter().filter(|d| d.name == name).collect()
        };
        let mean = |name: &str| -> Option<f64> {
            let r = rounds(name);
            (!r.is_empty())
                .then(|| r.iter().map(|d| d.events_per_second).sum::<f64>() / r.len() as f64)
        };
        let debezium = mean("Debezium");
        let null_wal = self
            .as_run
            .iter()
            .find(|d| d.name.starts_with("null WAL"))
            .and_then(|d| mean(&d.name));
        let mut out = String::new();
        let _ = writeln!(
            out,
            "\n### As users run it: drains counted on the topic, CPU per event where it was spent\n"
        );
        let _ = writeln!(
            out,
            "The relay is the `outbox-relay` binary as a process; events are counted on the topic (the \
             broker's log end offsets), from the publisher's start to the last event. Rounds are \
             interleaved; ratios are of the rounds' means.\n"
        );
        let _ = writeln!(
            out,
            "| publisher | events/s, each round | / Debezium | / null WAL pipeline | publisher µs/event | PostgreSQL µs/event | Kafka µs/event | peak memory MiB |"
        );
        let _ = writeln!(out, "|---|---:|---:|---:|---:|---:|---:|---:|");
        for name in names {
            let r = rounds(name);
            let rates: Vec<String> = r
                .iter()
                .map(|d| format!("{:.0}", d.events_per_second))
                .collect();
            let avg = |f: &dyn Fn(&Drained) -> Option<f64>| -> String {
                let values: Vec<f64> = r.iter().filter_map(|d| f(d)).collect();
                if values.is_empty() {
                    "–".to_owned()
                } else {
                    format!("{:.1}", values.iter().sum::<f64>() / values.len() as f64)
                }
            };
            let ratio = |to: Option<f64>| {
                mean(name)
                    .zip(to)
                    .map_or("–".to_owned(), |(v, to)| format!("{:.2}", v / to))
            };
            let _ = writeln!(
                out,
                "| {name} | {} | {} | {} | {} | {} | {} | {} |",
                rates.join(" / "),
                ratio(debezium),
                ratio(null_wal),
                avg(&|d| Some(d.cpu.publisher_us)),
                avg(&|d| Some(d.cpu.postgres_us)),
                avg(&|d| d.cpu.broker_us),
                avg(&|d| Some(d.peak_rss_mib)),
            );
        }
        out
    }
}

/// One sink run as JSON.
fn run_json(r: &crate::sinks::Run) -> serde_json::Value {
    json!({
        "per_second": r.rate, "publisher_cpu_us_per_event": r.cpu.publisher_us,
        "postgres_cpu_us_per_event": r.cpu.postgres_us, "broker_cpu_us_per_event": r.cpu.broker_us,
        "cores_busy": r.cores_busy(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_left_out_print_no_section_and_no_zero() {
        let mut report = Report::new(false, 1000, 10);
        report
            .record_cost
            .push(("business alone".to_owned(), 100.0));
        let text = report.markdown();
        assert!(text.contains("### record() in a one-row business transaction"));
        assert!(!text.contains("Raw producer"), "{text}");
        assert!(!text.contains("### Draining a backlog"), "{text}");
        assert!(!text.contains("### Latency"), "{text}");

        report.raw_producer = 1234.0;
        report
            .limits
            .push(Row::limit(500, Mode::Mark, 1.0, 2.0, 3.0));
        let text = report.markdown();
        assert!(text.contains("Raw producer (batches of 500): 1234 msgs/s."));
        assert!(text.contains("### Draining a backlog"));
    }
}
