//! The relay as users run it: the `outbox-relay` binary as a process draining a backlog, its
//! events counted on the topic (the broker's log end offsets, not the relay's own acks), with the
//! CPU each event cost the relay, PostgreSQL and Kafka. Beside it, in the same run, the WAL
//! source's limit (`null_wal.rs`) and Debezium (`debezium.rs`), measured the same way.

use crate::processes::{PerEvent, Processes, peak_rss_mib};
use crate::topic::{self, Count};
use crate::{setup, wal};
use seaorm_outbox_relay::Mode;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use uuid::Uuid;

/// What one drain measured.
#[derive(Debug, Clone)]
pub struct Drained {
    /// What published: the relay and its settings, the null WAL pipeline, or Debezium.
    pub name: String,
    /// Events on the topic per second, from the start of the publisher to the last one.
    pub events_per_second: f64,
    pub cpu: PerEvent,
    /// The publisher's peak resident memory.
    pub peak_rss_mib: f64,
}

/// How the relay binary runs.
#[derive(Debug, Clone, Copy)]
pub enum Setting {
    /// The polling relay, in a mode, with a batch size.
    Polling(Mode, usize),
    /// The WAL source, draining what the WAL retained.
    Wal(wal::Backlog),
}

impl Setting {
    pub fn name(self) -> String {
        match self {
            Setting::Polling(Mode::Mark, batch) => format!("relay, mark, batch {batch}"),
            Setting::Polling(_, batch) => format!("relay, delete, batch {batch}"),
            Setting::Wal(wal::Backlog::Rows) => "relay, WAL source, table rows".into(),
            Setting::Wal(wal::Backlog::Messages) => "relay, WAL source, table-less".into(),
        }
    }
}

/// The relay binary drains `events` over `aggregates` aggregates as `setting` says.
pub async fn drain(
    relay_bin: &Path,
    base_url: &str,
    brokers: &str,
    events: usize,
    aggregates: usize,
    setting: Setting,
) -> Drained {
    let db = setup::fresh(base_url).await;
    let prefix = format!("bench-run-{}", Uuid::now_v7().simple());
    let topic = format!("{prefix}.order");
    topic::create(brokers, &topic).await;
    let mut args =
        crate::drain::relay_args(&db.url, brokers, &format!("{prefix}.{{aggregate_type}}"));
    let mut slot = None;
    match setting {
        Setting::Polling(mode, batch) => {
            setup::fill(&db, events, aggregates).await;
            let mode = if mode == Mode::Mark { "mark" } else { "delete" };
            args.extend(["--mode", mode, "--batch-size", &batch.to_string()].map(str::to_owned));
        }
        Setting::Wal(backlog) => {
            let (config, source) = wal::config(&db.url);
            wal::prepare(&config).await;
            match backlog {
                wal::Backlog::Rows => setup::fill(&db, events, aggregates).await,
                wal::Backlog::Messages => wal::fill_messages(&db, events, aggregates).await,
            }
            args.extend(wal::relay_flags(&source).map(str::to_owned));
            slot = Some(source);
        }
    }
    let count = Count::new(brokers, &topic);
    let processes = Processes::find(&db.pool).await;
    let started = Instant::now();
    let mut child = Command::new(relay_bin)
        .args(&args)
        .env("OUTBOX_LOG", "warn")
        .stdout(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("start {}: {e}", relay_bin.display()));
    // The relay's CPU counts from 0: it starts now.
    let mut before = processes.cpu(child.id());
    before.publisher = 0.0;
    count
        .wait_for(events, Duration::from_secs(900), &setting.name())
        .await;
    let elapsed = started.elapsed();
    let cpu = PerEvent::between(before, processes.cpu(child.id()), events);
    let peak_rss_mib = peak_rss_mib(child.id());
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    child.wait().unwrap();
    if let Some(source) = slot {
        wal::drop_slot(&db.url, &source).await;
    }
    Drained {
        name: setting.name(),
        events_per_second: events as f64 / elapsed.as_secs_f64(),
        cpu,
        peak_rss_mib,
    }
}
