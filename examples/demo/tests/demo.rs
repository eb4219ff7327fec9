//! The demo that README's first command runs, run with the tests so it cannot rot: against the
//! test run's PostgreSQL (databases of its own) and Kafka (topics of its own), and with
//! `--sqlite`. It drives the three services' binaries, which `cargo test --workspace` builds
//! beside it.

use std::process::Command;

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| {
        panic!("{name} is not set: this test needs the real services. Run `scripts/test`, which starts them.")
    })
}

fn run(demo: &mut Command) -> String {
    let output = demo.output().expect("run outbox-demo");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "the demo failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

/// What the story on a database server and Kafka shows, step by step.
fn assert_the_story(stdout: &str) {
    for step in [
        "\n  201 {",
        "\n  422 {\"error\":\"total_cents must be more than 0, got -5\"}",
        "the outbox still holds 1 event",
        "headers  id=",
        "event_type=OrderPlaced, aggregate_type=order, event_version=1",
        "\"status\":\"open\"",
        "kill -9 shop-relay",
        "wait in the outbox: 3 unpublished",
        "\n  404 {\"error\":\"no invoice for order ",
        "\"status\":\"void\"",
        "Nothing was lost",
        "\"duplicates\":1",
        "The inbox skipped the duplicate",
        "orders-service stopped",
    ] {
        assert!(
            stdout.contains(step),
            "the demo should show {step:?}:\n{stdout}"
        );
    }
}

#[test]
fn the_demo_drives_the_shop_over_http_and_loses_nothing_when_the_relay_is_killed() {
    let stdout = run(Command::new(env!("CARGO_BIN_EXE_outbox-demo"))
        .env("DATABASE_URL", env("DATABASE_URL"))
        .env("KAFKA_BROKERS", env("KAFKA_BROKERS"))
        .env(
            "OUTBOX_DEMO_TOPIC_TEMPLATE",
            format!("demo-{}.{{aggregate_type}}", std::process::id()),
        ));
    assert!(stdout.contains("a relay, PostgreSQL and Kafka"), "{stdout}");
    assert_the_story(&stdout);
}

/// The same story with both services' databases on MariaDB.
#[test]
fn the_demo_runs_the_same_story_on_mariadb() {
    let stdout = run(Command::new(env!("CARGO_BIN_EXE_outbox-demo"))
        .arg("--mariadb")
        .env("MARIADB_URL", env("MARIADB_URL"))
        .env("KAFKA_BROKERS", env("KAFKA_BROKERS"))
        .env(
            "OUTBOX_DEMO_TOPIC_TEMPLATE",
            format!("demo-mariadb-{}.{{aggregate_type}}", std::process::id()),
        ));
    assert!(stdout.contains("a relay, MariaDB and Kafka"), "{stdout}");
    assert_the_story(&stdout);
    let password = env("OUTBOX_MARIADB_PASSWORD");
    assert!(!stdout.contains(&password), "the demo printed the password");
}

#[test]
fn the_demo_runs_on_sqlite_without_services() {
    let stdout = run(Command::new(env!("CARGO_BIN_EXE_outbox-demo"))
        .arg("--sqlite")
        .env_remove("DATABASE_URL")
        .env_remove("KAFKA_BROKERS"));
    assert_eq!(
        stdout.matches("\"topic\":").count(),
        2,
        "ada's OrderPlaced and OrderShipped relayed:\n{stdout}"
    );
    assert!(stdout.contains("\"topic\":\"shop.shipping\""), "{stdout}");
    assert!(
        stdout.contains("run scripts/demo without --sqlite"),
        "{stdout}"
    );
}
