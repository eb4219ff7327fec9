//! The demo that README's first command runs, run with the tests so it cannot rot: against the
//! test run's PostgreSQL (a database of its own) and Kafka, and with `--sqlite`.

use std::process::Command;

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| {
        panic!("{name} is not set: this test needs the real services. Run `scripts/test`, which starts them.")
    })
}

#[test]
fn the_demo_records_relays_and_consumes_each_event_once() {
    let base = env("DATABASE_URL");
    let database = format!("demo_{}", std::process::id());
    let created = Command::new("psql")
        .args([&base, "-qc", &format!("CREATE DATABASE {database}")])
        .status()
        .expect("psql (scripts/setup installs it)");
    assert!(created.success(), "could not create database {database}");
    let (server, _) = base.rsplit_once('/').expect("a database URL with a path");
    let output = Command::new(env!("CARGO_BIN_EXE_outbox-demo"))
        .env("DATABASE_URL", format!("{server}/{database}"))
        .env("KAFKA_BROKERS", env("KAFKA_BROKERS"))
        .env("OUTBOX_LOG", "warn")
        .output()
        .expect("run outbox-demo");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "the demo failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(stdout.contains("all 4 events applied"), "{stdout}");
    assert!(
        stdout.contains("1 duplicate skipped by the inbox"),
        "{stdout}"
    );
}

#[test]
fn the_demo_runs_on_sqlite_without_services() {
    let output = Command::new(env!("CARGO_BIN_EXE_outbox-demo"))
        .arg("--sqlite")
        .env_remove("DATABASE_URL")
        .env_remove("KAFKA_BROKERS")
        .output()
        .expect("run outbox-demo --sqlite");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "the demo failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert_eq!(
        stdout.matches("\"topic\":").count(),
        4,
        "four events relayed:\n{stdout}"
    );
}
