//! The CPU time and memory of the processes a measurement involves: the publisher (the relay
//! binary, Debezium's worker, or this process), PostgreSQL and the broker (Kafka, unless a
//! measurement names another).

use std::process::Command;

/// The fields of `/proc/<pid>/stat` after the command name: state is field 0, the parent's pid
/// field 1, utime 11, stime 12, the reaped children's cutime 13 and cstime 14.
fn stat(pid: u32) -> Option<Vec<String>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let fields = stat.rsplit(')').next()?;
    Some(fields.split_whitespace().map(str::to_owned).collect())
}

fn ticks(fields: &[String], at: &[usize]) -> f64 {
    at.iter()
        .map(|&i| {
            fields
                .get(i)
                .and_then(|f| f.parse::<f64>().ok())
                .unwrap_or(0.0)
        })
        .sum()
}

fn clock_ticks_per_second() -> f64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(100.0)
}

/// The CPU time (user and system) process `pid` has used so far, in seconds.
pub fn cpu_seconds(pid: u32) -> f64 {
    let fields = stat(pid).unwrap_or_else(|| panic!("/proc/{pid}/stat"));
    ticks(&fields, &[11, 12]) / clock_ticks_per_second()
}

/// The CPU time PostgreSQL has used so far, in seconds: the postmaster, its live processes, and
/// those that ended (their time is added to the postmaster's reaped children).
pub fn postgres_cpu_seconds(postmaster: u32) -> f64 {
    let mut ticks_used = stat(postmaster).map_or(0.0, |f| ticks(&f, &[11, 12, 13, 14]));
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        if let Some(fields) = stat(pid)
            && fields.get(1).map(String::as_str) == Some(&postmaster.to_string())
        {
            ticks_used += ticks(&fields, &[11, 12, 13, 14]);
        }
    }
    ticks_used / clock_ticks_per_second()
}

/// The postmaster of the PostgreSQL that `pool` connects to (on this machine).
pub async fn postmaster(pool: &sqlx::PgPool) -> u32 {
    let backend: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(pool)
        .await
        .expect("backend pid");
    let fields = stat(backend as u32).expect("a local PostgreSQL backend");
    fields[1].parse().expect("the backend's parent")
}

/// Kafka's process, from `OUTBOX_KAFKA_PID` (`scripts/services start kafka` exports it).
pub fn kafka() -> Option<u32> {
    std::env::var("OUTBOX_KAFKA_PID").ok()?.parse().ok()
}

/// The peak resident memory of process `pid` so far (VmHWM), in MiB.
pub fn peak_rss_mib(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc status");
    let hwm_kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0.0);
    hwm_kib / 1024.0
}

/// CPU seconds used so far by the publisher, PostgreSQL and the broker.
#[derive(Debug, Clone, Copy)]
pub struct Cpu {
    pub publisher: f64,
    pub postgres: f64,
    pub broker: Option<f64>,
}

/// The processes of one measurement.
pub struct Processes {
    pub postmaster: u32,
    pub broker: Option<u32>,
}

impl Processes {
    /// PostgreSQL's and Kafka's processes.
    pub async fn find(pool: &sqlx::PgPool) -> Processes {
        Processes::with_broker(pool, kafka()).await
    }

    /// PostgreSQL's processes and `broker`'s.
    pub async fn with_broker(pool: &sqlx::PgPool, broker: Option<u32>) -> Processes {
        Processes {
            postmaster: postmaster(pool).await,
            broker,
        }
    }

    /// CPU used so far, with `publisher` as the publishing process.
    pub fn cpu(&self, publisher: u32) -> Cpu {
        Cpu {
            publisher: cpu_seconds(publisher),
            postgres: postgres_cpu_seconds(self.postmaster),
            broker: self.broker.map(cpu_seconds),
        }
    }
}

/// CPU microseconds per event, each process's share, between two samples.
#[derive(Debug, Clone, Copy, Default)]
pub struct PerEvent {
    pub publisher_us: f64,
    pub postgres_us: f64,
    pub broker_us: Option<f64>,
}

impl PerEvent {
    pub fn between(before: Cpu, after: Cpu, events: usize) -> PerEvent {
        let per = |seconds: f64| seconds * 1e6 / events as f64;
        PerEvent {
            publisher_us: per(after.publisher - before.publisher),
            postgres_us: per(after.postgres - before.postgres),
            broker_us: after.broker.zip(before.broker).map(|(a, b)| per(a - b)),
        }
    }

    /// The cores these processes kept busy at `events_per_second`.
    pub fn cores_busy(&self, events_per_second: f64) -> f64 {
        (self.publisher_us + self.postgres_us + self.broker_us.unwrap_or(0.0)) * events_per_second
            / 1e6
    }
}
