//! No secret is ever printed: a distinctive secret in every place a secret can be given (the
//! database URL's user-info and `password=` parameter, librdkafka's `sasl.password`,
//! `ssl.key.password` and `sasl.oauthbearer.client.secret`, a Pulsar token, a NATS token, the
//! password in a NATS URL, in a RabbitMQ URL and in a webhook URL, an AWS secret access key), from flags, the
//! environment and files, reaches none of stdout, stderr, `/metrics` or `/readyz` of the relay and
//! of `status`, `failed` and `migrate`, at debug level, in human and JSON logs, with a failing
//! database and a refusing broker.

mod common;

use common::secure::{Relay, secure};
use common::{Fixture, free_port, http_get_when_up, relay_command};
use std::time::Duration;

/// What one run printed, by where it came from.
struct Printed(Vec<(String, String)>);

impl Printed {
    fn add(&mut self, what: impl Into<String>, text: impl Into<String>) {
        self.0.push((what.into(), text.into()));
    }

    /// The relay's log and endpoints, once it logged `needle`.
    async fn relay(&mut self, what: &str, relay: Relay, needle: &str) {
        relay.wait_for_log(needle, Duration::from_secs(60)).await;
        let (_, metrics) = http_get_when_up(relay.port, "/metrics").await;
        let (status, ready) = http_get_when_up(relay.port, "/readyz").await;
        assert_eq!(status, 503, "{what}: /readyz {ready}");
        self.add(format!("{what} /metrics"), metrics);
        self.add(format!("{what} /readyz"), ready);
        self.add(format!("{what} stderr"), relay.stop());
    }

    /// A command's stdout and stderr.
    fn command(&mut self, what: &str, format: &str, args: &[&str]) -> std::process::Output {
        let output = relay_command()
            .env("OUTBOX_LOG", "debug")
            .args(["--log-format", format])
            .args(args)
            .output()
            .expect("run outbox-relay");
        self.add(
            format!("{what} stdout"),
            String::from_utf8_lossy(&output.stdout),
        );
        self.add(
            format!("{what} stderr"),
            String::from_utf8_lossy(&output.stderr),
        );
        output
    }
}

#[tokio::test]
async fn no_secret_reaches_any_output() {
    let s = secure();
    let f = Fixture::new().await;
    let secret = format!("Zq9leak{}", seaorm_outbox::Uuid::now_v7().simple());
    f.db.execute_unprepared(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
         SELECT gen_random_uuid(), 'secure', 'k' || g, 'Made', '{}' FROM generate_series(1, 5) g",
    )
    .await
    .unwrap();
    use seaorm_outbox::sea_orm::ConnectionTrait;

    // Nothing listens there: a failing database.
    let closed = free_port();
    let failing_db = format!("postgres://app:{secret}@127.0.0.1:{closed}/shop?password={secret}");
    // The test database accepts any password: a working one with secrets in its URL.
    let working_db = format!(
        "{}&password={secret}",
        f.url
            .replacen("postgres@", &format!("postgres:{secret}@"), 1)
    );
    let secret_file = outbox_tests::temp_dir().join("secret");
    std::fs::write(&secret_file, &secret).unwrap();
    let kafka = |password: &str| {
        vec![
            "--kafka-brokers".to_owned(),
            s.sasl_ssl.clone(),
            "--kafka-option".into(),
            "security.protocol=SASL_SSL".into(),
            "--kafka-option".into(),
            format!("ssl.ca.location={}", s.file("ca.pem")),
            "--kafka-option".into(),
            "sasl.mechanism=SCRAM-SHA-512".into(),
            "--kafka-option".into(),
            format!("sasl.username={}", s.user),
            "--kafka-option".into(),
            format!("sasl.password={password}"),
        ]
    };
    let kafka_env = vec![
        (
            "OUTBOX_KAFKA_OPTION_SSL_KEY_PASSWORD".to_owned(),
            secret.clone(),
        ),
        (
            "OUTBOX_KAFKA_OPTION_SASL_OAUTHBEARER_CLIENT_SECRET_FILE".to_owned(),
            secret_file.display().to_string(),
        ),
    ];

    let mut printed = Printed(Vec::new());
    for format in ["human", "json"] {
        let with_format = |mut args: Vec<String>| {
            args.extend(["--log-format".to_owned(), format.to_owned()]);
            args
        };
        // The relay: a failing database; then a broker that refuses the secret as password; then
        // Pulsar refusing the secret as token.
        let relay = Relay::start_on(
            &failing_db,
            &f.template,
            &with_format(kafka(&secret)),
            &kafka_env,
            "debug",
        );
        printed
            .relay(
                &format!("{format} relay, failing database"),
                relay,
                "database unavailable",
            )
            .await;
        let relay = Relay::start_on(
            &working_db,
            &f.template,
            &with_format(kafka(&secret)),
            &kafka_env,
            "debug",
        );
        printed
            .relay(
                &format!("{format} relay, refusing kafka"),
                relay,
                "events wait, untouched",
            )
            .await;
        let pulsar = vec![
            "--sink".to_owned(),
            "pulsar".into(),
            "--pulsar-url".into(),
            s.pulsar_tls_url.clone(),
            "--pulsar-tls-ca-file".into(),
            s.file("ca.pem"),
        ];
        let relay = Relay::start_on(
            &working_db,
            &f.template,
            &with_format(pulsar),
            &[("PULSAR_TOKEN".to_owned(), secret.clone())],
            "debug",
        );
        printed
            .relay(
                &format!("{format} relay, refusing pulsar"),
                relay,
                "events wait, untouched",
            )
            .await;
        let nats_url = std::env::var("NATS_URL")
            .expect("NATS_URL is not set: scripts/services start nats (scripts/test does)");
        let nats = vec![
            "--sink".to_owned(),
            "nats".into(),
            "--nats-url".into(),
            nats_url.replacen("nats://", &format!("nats://relay:{secret}@"), 1),
        ];
        let relay = Relay::start_on(
            &working_db,
            &f.template,
            &with_format(nats),
            &[("NATS_TOKEN".to_owned(), secret.clone())],
            "debug",
        );
        printed
            .relay(
                &format!("{format} relay, refusing nats"),
                relay,
                "events wait, untouched",
            )
            .await;
        let rabbitmq_url = std::env::var("RABBITMQ_URL")
            .expect("RABBITMQ_URL is not set: scripts/services start rabbitmq (scripts/test does)");
        let password = std::env::var("OUTBOX_RABBITMQ_PASSWORD")
            .expect("OUTBOX_RABBITMQ_PASSWORD is not set (scripts/services)");
        let rabbitmq = vec!["--sink".to_owned(), "rabbitmq".into()];
        let relay = Relay::start_on(
            &working_db,
            &f.template,
            &with_format(rabbitmq),
            &[(
                "RABBITMQ_URL".to_owned(),
                rabbitmq_url.replace(&password, &secret),
            )],
            "debug",
        );
        printed
            .relay(
                &format!("{format} relay, refusing rabbitmq"),
                relay,
                "events wait, untouched",
            )
            .await;
        // A webhook receiver that cannot be reached, its URL carrying the secret as a password.
        let webhook = vec!["--sink".to_owned(), "webhook".into()];
        let relay = Relay::start_on(
            &working_db,
            &f.template,
            &with_format(webhook),
            &[
                (
                    "WEBHOOK_URL".to_owned(),
                    format!(
                        "http://relay:{secret}@127.0.0.1:{}/{{topic}}",
                        common::free_port()
                    ),
                ),
                (
                    "WEBHOOK_SECRET".to_owned(),
                    "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw".to_owned(),
                ),
            ],
            "debug",
        );
        printed
            .relay(
                &format!("{format} relay, unreachable webhook"),
                relay,
                "events wait, untouched",
            )
            .await;
        // SQS refusing the AWS credentials (a moto server that knows no user).
        let refusing = std::env::var("OUTBOX_MOTO_AUTH_URL").expect(
            "OUTBOX_MOTO_AUTH_URL is not set: scripts/services start moto (scripts/test does)",
        );
        let sqs = vec![
            "--sink".to_owned(),
            "sqs".into(),
            "--aws-endpoint-url".into(),
            refusing,
        ];
        let relay = Relay::start_on(
            &working_db,
            &f.template,
            &with_format(sqs),
            &[
                (
                    "AWS_ACCESS_KEY_ID".to_owned(),
                    "AKIAOUTBOXSECRETS".to_owned(),
                ),
                ("AWS_SECRET_ACCESS_KEY".to_owned(), secret.clone()),
            ],
            "debug",
        );
        printed
            .relay(
                &format!("{format} relay, refusing sqs"),
                relay,
                "events wait, untouched",
            )
            .await;

        // The commands, against the failing and the working database.
        for (db, url) in [("failing", &failing_db), ("working", &working_db)] {
            let status = printed.command(
                &format!("{format} status, {db}"),
                format,
                &["status", "--database-url", url],
            );
            let failed = printed.command(
                &format!("{format} failed list, {db}"),
                format,
                &["failed", "list", "--database-url", url],
            );
            let migrate = printed.command(
                &format!("{format} migrate, {db}"),
                format,
                &["migrate", "--database-url", url],
            );
            let expected = if db == "working" { Some(0) } else { Some(1) };
            for output in [status, failed, migrate] {
                assert_eq!(
                    output.status.code(),
                    expected,
                    "{}",
                    String::from_utf8_lossy(&output.stderr)
                );
            }
        }
    }

    let mut masked = 0;
    for (what, text) in &printed.0 {
        assert!(
            !text.contains(&secret),
            "the secret leaked into {what}:\n{text}"
        );
        masked += text.matches("***").count();
    }
    // The check looked at real output: the secrets' places are there, masked.
    assert!(masked > 10, "too little output was checked");
}

#[tokio::test]
async fn a_database_that_does_not_answer_fails_within_the_connect_timeout() {
    // Accepts connections and never answers, as a database behind a dead proxy does.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!(
        "postgres://app@127.0.0.1:{}/shop?connect_timeout=1",
        silent.local_addr().unwrap().port()
    );
    for args in [
        vec!["status", "--database-url", &url],
        vec!["failed", "list", "--database-url", &url],
        vec!["migrate", "--database-url", &url],
    ] {
        let mut child = relay_command()
            .args(&args)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .map(common::KillOnDrop::from)
            .unwrap();
        let (status, stderr) = common::wait_for_exit(
            &mut child,
            Duration::from_secs(30),
            &format!("{args:?} still waits for the database"),
        );
        assert_eq!(status.code(), Some(1), "{args:?}: {stderr}");
        assert!(stderr.lines().count() == 1, "{args:?}: {stderr}");
        assert!(
            stderr.contains("timed out") || stderr.contains("did not answer"),
            "{args:?}: {stderr}"
        );
    }
    drop(silent);
}
