//! The binary's command line: bad input is one line on stderr and exit code 2, with nothing done;
//! `routes`, `status` and `migrate` print what they should.

mod common;

use common::{Fixture, relay_command};
use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

/// Runs the binary to its end; a command that should end at once but keeps running (a refusal
/// turned into retries) fails the test after a minute instead of hanging it.
fn run(args: &[&str]) -> Output {
    let mut child = relay_command()
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run outbox-relay");
    let deadline = Instant::now() + Duration::from_secs(60);
    while child.try_wait().expect("wait for outbox-relay").is_none() {
        if Instant::now() > deadline {
            child.kill().ok();
            let output = child.wait_with_output().expect("collect outbox-relay");
            panic!(
                "{args:?} still ran after a minute; stderr:\n{}",
                String::from_utf8_lossy(&output.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("collect outbox-relay")
}

/// Asserts exit code 2 and a single stderr line containing `needle`; returns the line.
fn usage_error(args: &[&str], needle: &str) -> String {
    let output = run(args);
    let stderr = String::from_utf8(output.stderr).unwrap();
    assert_eq!(output.status.code(), Some(2), "{args:?}: {stderr}");
    assert_eq!(
        stderr.lines().count(),
        1,
        "{args:?} printed more than one line:\n{stderr}"
    );
    assert!(
        stderr.contains(needle),
        "{args:?}: {stderr:?} lacks {needle:?}"
    );
    assert!(output.stdout.is_empty());
    stderr
}

/// Asserts exit code 2 and clap's own message, tips included; returns stderr.
fn clap_error(args: &[&str], needle: &str) -> String {
    let output = run(args);
    let stderr = String::from_utf8(output.stderr).unwrap();
    assert_eq!(output.status.code(), Some(2), "{args:?}: {stderr}");
    assert!(
        stderr.contains(needle),
        "{args:?}: {stderr:?} lacks {needle:?}"
    );
    assert!(
        stderr.contains("--help"),
        "{args:?}: no hint at --help: {stderr}"
    );
    assert!(output.stdout.is_empty());
    stderr
}

fn config_file(text: &str) -> String {
    let path = outbox_tests::temp_dir().join("relay.toml");
    std::fs::write(&path, text).unwrap();
    path.display().to_string()
}

#[test]
fn bad_flags_urls_and_config_files_are_one_line_and_exit_2() {
    clap_error(&["run", "--bogus"], "unexpected argument '--bogus'");
    clap_error(&["frobnicate"], "unrecognized subcommand");
    // clap's "did you mean" tips are kept.
    let typo = clap_error(&["run", "--batch-sise", "5"], "unexpected argument");
    assert!(typo.contains("--batch-size"), "no tip: {typo}");
    usage_error(&["run", "--kafka-brokers", "x:1"], "no database");
    let line = usage_error(
        &[
            "run",
            "--database-url",
            "mysql://app:s3cret@db:notaport/shop",
        ],
        "bad database URL",
    );
    assert!(!line.contains("s3cret"), "the password leaked: {line}");
    usage_error(
        &["run", "--database-url", "oracle://db/shop"],
        "must start with postgres://",
    );
    let line = usage_error(
        &[
            "run",
            "--database-url",
            "postgres://app:s3cret@db:notaport/shop",
        ],
        "bad database URL",
    );
    assert!(!line.contains("s3cret"), "the password leaked: {line}");
    // The driver would log an unknown parameter with its value, and ignore it: refused by name.
    let line = usage_error(
        &[
            "status",
            "--database-url",
            "postgres://app@db/shop?sslpassword=s3cret",
        ],
        "`sslpassword` is not supported",
    );
    assert!(!line.contains("s3cret"), "the password leaked: {line}");
    usage_error(
        &[
            "run",
            "--database-url",
            "postgres://db/shop",
            "--batch-size",
            "0",
            "--sink",
            "stdout",
        ],
        "at least 1",
    );
    // A zero wait would claim in a busy loop while the outbox is idle.
    usage_error(
        &[
            "run",
            "--database-url",
            "postgres://db/shop",
            "--min-poll-interval",
            "0s",
            "--sink",
            "stdout",
        ],
        "min poll interval must be above zero",
    );
    clap_error(
        &[
            "run",
            "--database-url",
            "postgres://db/shop",
            "--poll-interval",
            "soon",
        ],
        "not a duration",
    );
    usage_error(
        &[
            "run",
            "--database-url",
            "postgres://db/shop",
            "--sink",
            "pulsar",
        ],
        "the pulsar sink needs a service URL",
    );
    usage_error(
        &[
            "run",
            "--database-url",
            "postgres://db/shop",
            "--sink",
            "pulsar",
            "--pulsar-url",
            "http://pulsar:8080",
        ],
        "must start with pulsar://",
    );
    clap_error(
        &[
            "run",
            "--database-url",
            "postgres://db/shop",
            "--kafka-option",
            "linger.ms",
        ],
        "not KEY=VALUE",
    );
    usage_error(
        &["run", "--database-url", "postgres://db/shop"],
        "the kafka sink needs brokers",
    );
    usage_error(
        &[
            "run",
            "--database-url",
            "sqlite::memory:",
            "--wakeup",
            "notify",
            "--sink",
            "stdout",
        ],
        "needs PostgreSQL",
    );
    // MySQL has neither LISTEN/NOTIFY nor the WAL: both refused at once, not retried forever.
    for extra in [["--wakeup", "notify"], ["--source", "wal"]] {
        let line = usage_error(
            &[
                &["run", "--database-url", "mysql://u:mysql-secret-9@db/shop"][..],
                &extra[..],
                &["--sink", "stdout"][..],
            ]
            .concat(),
            "needs PostgreSQL",
        );
        assert!(!line.contains("mysql-secret-9"), "{line}");
    }
    usage_error(
        &[
            "migrate",
            "--database-url",
            "mysql://u:mysql-secret-9@db/shop",
            "--notify-trigger",
        ],
        "--notify-trigger needs PostgreSQL",
    );

    usage_error(
        &["--config", "/nonexistent/relay.toml", "status"],
        "cannot read config file",
    );
    usage_error(
        &[
            "--config",
            &config_file("batch_size = 10\nmode = \"mark\"\npoll_interval = \n"),
            "status",
        ],
        "line 3",
    );
    // Unknown keys and bad values are reported at their own line, inside [sink] too.
    let line = usage_error(
        &[
            "--config",
            &config_file("batch_size = 10\nbatchsize = 10\n"),
            "status",
        ],
        "unknown field `batchsize`",
    );
    assert!(line.contains("line 2"), "{line}");
    let line = usage_error(
        &[
            "--config",
            &config_file(
                "batch_size = 10\n\n[sink]\ntype = \"kafka\"\nbrokers = \"b:1\"\nbrokerz = \"x\"\n",
            ),
            "status",
        ],
        "unknown field `brokerz`",
    );
    assert!(line.contains("line 6"), "{line}");
    let line = usage_error(
        &[
            "--config",
            &config_file(
                "database_url = \"postgres://db/x\"\npoll_interval = \"fast\"\n[sink]\ntype = \"stdout\"\n",
            ),
            "run",
        ],
        "not a duration",
    );
    assert!(line.contains("line 2"), "{line}");
    let line = usage_error(
        &[
            "--config",
            &config_file("database_url = \"postgres://app:${OUTBOX_TEST_UNSET_VARIABLE}@db/x\"\n"),
            "status",
        ],
        "${OUTBOX_TEST_UNSET_VARIABLE}, which is not set",
    );
    assert!(line.contains("`database_url`"), "{line}");
    usage_error(
        &[
            "--config",
            &config_file("[sink]\ntype = \"carrier-pigeon\"\n"),
            "run",
        ],
        "carrier-pigeon",
    );
}

#[test]
fn bad_outbox_tables_are_one_line_and_exit_2() {
    let pg = ["--database-url", "postgres://db/shop"];
    let stdout = ["--sink", "stdout"];
    usage_error(
        &[&["run", "--table", "Billing"][..], &pg, &stdout].concat(),
        "`Billing` is not an outbox table name: only lower-case ASCII letters",
    );
    usage_error(
        &[&["status", "--table", "a.b.c"][..], &pg].concat(),
        "at most one `.`",
    );
    usage_error(
        &[&["failed", "--table", "1outbox"][..], &pg, &["list"]].concat(),
        "starts with a digit",
    );
    usage_error(
        &[
            "migrate",
            "--database-url",
            "sqlite::memory:",
            "--table",
            "billing.outbox",
        ],
        "a schema-qualified table needs PostgreSQL",
    );
    usage_error(
        &[
            &["run", "--table", "billing_outbox", "--source", "wal"][..],
            &pg,
            &stdout,
        ]
        .concat(),
        "--source wal reads the table outbox only",
    );
    // A list: each name checked, none twice, none empty; `failed` takes one table.
    usage_error(
        &[
            &["run", "--table", "outbox, billing_outbox,outbox"][..],
            &pg,
            &stdout,
        ]
        .concat(),
        "--table lists outbox twice",
    );
    usage_error(
        &[&["status", "--table", "outbox,"][..], &pg].concat(),
        "--table: `` is not an outbox table name",
    );
    usage_error(
        &[
            &["failed", "--table", "outbox,billing_outbox"][..],
            &pg,
            &["list"],
        ]
        .concat(),
        "this command works on one table at a time; --table lists outbox, billing_outbox",
    );
    usage_error(
        &[
            &["run", "--table", "outbox,billing_outbox", "--source", "wal"][..],
            &pg,
            &stdout,
        ]
        .concat(),
        "--source wal reads the table outbox only; poll outbox, billing_outbox",
    );
}

#[test]
fn help_and_version_exit_0() {
    let help = run(&["--help"]);
    assert!(help.status.success());
    let help = String::from_utf8(help.stdout).unwrap();
    for command in ["run", "migrate", "routes", "status"] {
        assert!(help.contains(command), "--help lacks {command}");
    }
    assert!(run(&["--version"]).status.success());
}

/// `run --help` shows the defaults the relay really uses: they are read from `RelayConfig::new`
/// and the other places the relay takes them from, never written by hand beside a flag.
#[test]
fn run_help_shows_the_relays_own_defaults() {
    let help = run(&["run", "--help"]);
    assert!(help.status.success());
    let help = String::from_utf8(help.stdout).unwrap();
    let config = seaorm_outbox_relay::RelayConfig::new("");
    for expected in [
        format!("Rows per batch [default: {}]", config.batch_size),
        format!("[default: {}]", config.max_batch_bytes),
        format!("[default: {}]", config.topic_template),
        "[default: 100ms]".to_owned(),
        "[default: mark]".to_owned(),
        "[default: 7days]".to_owned(),
        "[default: 127.0.0.1:9187]".to_owned(),
        "[default: outbox_relay]".to_owned(),
        "Where to publish [default: kafka]".to_owned(),
        "Pulsar tenant of the topics [default: public]".to_owned(),
    ] {
        assert!(
            help.contains(&expected),
            "run --help lacks {expected}:\n{help}"
        );
    }
}

#[test]
fn the_generic_binary_knows_no_event_types() {
    let output = run(&["routes"]);
    assert!(output.status.success());
    let stdout = String::from_utf8(output.stdout).unwrap();
    assert!(
        stdout.contains("no event types are linked into this binary"),
        "{stdout}"
    );
    assert!(stdout.contains("outbox.event.{aggregate_type}"), "{stdout}");
}

/// `status` counts the backlog, the parked events and, of the backlog, those held behind an
/// aggregate's parked or backing-off event.
#[tokio::test]
async fn status_reports_backlog_parked_held_and_age() {
    let f = Fixture::new().await;
    use seaorm_outbox::sea_orm::ConnectionTrait;
    f.db.execute_unprepared(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, created_at, parked_at, held_at) VALUES
           (gen_random_uuid(), 'a', '1', 'E', '{}', now() - interval '90 seconds', NULL, NULL),
           (gen_random_uuid(), 'a', '2', 'E', '{}', now(), NULL, NULL),
           (gen_random_uuid(), 'a', '3', 'E', '{}', now(), now(), NULL),
           (gen_random_uuid(), 'a', '3', 'E', '{}', now(), NULL, now())",
    )
    .await
    .unwrap();
    let output = run(&["status", "--database-url", &f.url]);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let stdout = String::from_utf8(output.stdout).unwrap();
    assert!(stdout.contains("backlog:            3 events"), "{stdout}");
    assert!(stdout.contains("parked:             1 events"), "{stdout}");
    assert!(stdout.contains("held:               1 events"), "{stdout}");
    assert!(
        stdout.contains("oldest unpublished: 1m 30s")
            || stdout.contains("oldest unpublished: 1m 31s"),
        "{stdout}"
    );
}

#[tokio::test]
async fn status_of_an_event_dated_minus_infinity_prints_sensibly() {
    let f = Fixture::new().await;
    use seaorm_outbox::sea_orm::ConnectionTrait;
    f.db.execute_unprepared(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, created_at) VALUES
           (gen_random_uuid(), 'a', '1', 'E', '{}', '-infinity')",
    )
    .await
    .unwrap();
    let output = run(&["status", "--database-url", &f.url]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        stdout.contains("oldest unpublished: over 100 years ago"),
        "{stdout}"
    );
}

#[test]
fn status_of_an_unreachable_database_fails_with_exit_1() {
    let output = run(&[
        "status",
        "--database-url",
        "postgres://app:s3cret@127.0.0.1:1/shop",
    ]);
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8(output.stderr).unwrap();
    assert!(
        stderr.contains("postgres://app:***@127.0.0.1:1/shop"),
        "{stderr}"
    );
    assert!(!stderr.contains("s3cret"));
}

#[tokio::test]
async fn settings_come_from_the_config_file_and_flags_override_them() {
    use seaorm_outbox::sea_orm::ConnectionTrait;
    let f = Fixture::new().await;
    f.db.execute_unprepared(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
         SELECT gen_random_uuid(), 'cart', 'c-' || g, 'CartChanged', jsonb_build_object('n', g)
         FROM generate_series(1, 25) g",
    )
    .await
    .unwrap();
    let file = config_file(&format!(
        "database_url = \"{}\"\nbatch_size = 10\nmode = \"delete\"\npoll_interval = \"20ms\"\n\
         topic_template = \"from-file.{{aggregate_type}}\"\nhttp_addr = \"off\"\n[sink]\ntype = \"stdout\"\n",
        f.url
    ));

    // `run` takes the file's sink, batch size, mode and template.
    let mut relay = relay_command()
        .env("OUTBOX_LOG", "seaorm_outbox_relay::relay=debug")
        .args(["--config", &file, "run"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map(common::KillOnDrop::from)
        .unwrap();
    f.wait_until_zero(
        "SELECT count(*) FROM outbox",
        std::time::Duration::from_secs(30),
    )
    .await;
    let stdout = relay.stdout.take().unwrap();
    common::signal(&relay, "TERM");
    let (status, log) = common::wait_for_exit(
        &mut relay,
        std::time::Duration::from_secs(30),
        "the relay does not stop",
    );
    assert_eq!(status.code(), Some(0), "{log}");
    let printed = std::io::read_to_string(stdout).unwrap();
    assert_eq!(printed.lines().count(), 25, "{printed}");
    assert!(
        printed
            .lines()
            .all(|line| line.starts_with(r#"{"topic":"from-file.cart","#)),
        "{printed}"
    );
    let batches: Vec<&str> = log
        .lines()
        .filter(|line| line.contains("batch published"))
        .collect();
    assert!(
        batches
            .iter()
            .take(2)
            .all(|line| line.contains("published=10")),
        "batches of 10: {batches:?}"
    );

    let output = run(&["--config", &file, "status"]);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        String::from_utf8(output.stdout)
            .unwrap()
            .contains("backlog:            0 events")
    );

    // A flag wins over the file's (valid) URL.
    let output = run(&[
        "--config",
        &file,
        "status",
        "--database-url",
        "postgres://127.0.0.1:1/none",
    ]);
    assert_eq!(output.status.code(), Some(1));
    assert!(
        String::from_utf8(output.stderr)
            .unwrap()
            .contains("127.0.0.1:1/none")
    );
}

#[tokio::test]
async fn json_logs_are_one_object_per_line() {
    let f = Fixture::new().await;
    let output = relay_command()
        .env("OUTBOX_LOG", "info")
        .args(["--log-format", "json", "migrate", "--database-url", &f.url])
        .output()
        .unwrap();
    assert!(output.status.success());
    let stderr = String::from_utf8(output.stderr).unwrap();
    assert!(stderr.lines().count() > 0, "migrate logged nothing");
    for line in stderr.lines() {
        let value: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
        assert!(
            value["level"].is_string() && value["fields"]["message"].is_string(),
            "{line}"
        );
    }
}

/// Whether process `pid` catches SIGTERM now (bit 15 of `SigCgt` in `/proc/<pid>/status`).
fn catches_sigterm(pid: u32) -> bool {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|line| line.strip_prefix("SigCgt:"))
        .and_then(|mask| u64::from_str_radix(mask.trim(), 16).ok())
        .is_some_and(|mask| mask & (1 << (15 - 1)) != 0)
}

#[test]
fn sigterm_during_start_up_still_stops_the_relay_with_exit_0() {
    // The config file is a FIFO: the relay blocks reading it, early in its start-up, until the
    // test writes the settings.
    let dir = outbox_tests::temp_dir();
    let fifo = dir.join("relay.toml");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(made.success());
    let mut relay = relay_command()
        .args(["run", "--config", fifo.to_str().unwrap()])
        .stderr(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()
        .map(common::KillOnDrop::from)
        .unwrap();
    // Its SIGTERM handler is in before it reads its settings.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !catches_sigterm(relay.id()) {
        assert!(
            std::time::Instant::now() < deadline,
            "the relay does not catch SIGTERM while it starts"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    common::signal(&relay, "TERM");
    let database = dir.join("shop.db");
    std::fs::write(
        &fifo,
        format!(
            "database_url = \"sqlite://{}?mode=rwc\"\nhttp_addr = \"off\"\n[sink]\ntype = \"stdout\"\n",
            database.display()
        ),
    )
    .unwrap();
    let (status, stderr) = common::wait_for_exit(
        &mut relay,
        std::time::Duration::from_secs(30),
        "the relay signalled during start-up still runs",
    );
    assert_eq!(status.code(), Some(0), "{stderr}");
    assert!(!stderr.contains("relay running"), "{stderr}");
}

/// A table migrated before schema version 3 lacks the claim's index: the relay says so and what
/// to run, instead of claiming through the whole backlog.
#[tokio::test]
async fn a_relay_on_a_table_without_schema_version_3_says_to_migrate() {
    use seaorm_outbox::sea_orm::ConnectionTrait;
    let f = Fixture::new().await;
    f.db.execute_unprepared("DROP INDEX outbox_claimable")
        .await
        .unwrap();
    let mut relay = f.spawn_relay(&[]);
    common::assert_refused_until_migrated(&mut relay, 3);
}
