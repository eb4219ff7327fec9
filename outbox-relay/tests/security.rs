//! Production connections, end to end: the relay and the consumer loops over Kafka's SSL (mutual
//! TLS), SASL_SSL with SCRAM-SHA-512, PLAIN and OAUTHBEARER (OIDC client credentials), and Pulsar
//! with a token or OAuth 2.0 over TLS, each read back by a separate client and consumed by the
//! consumer loop over the same security; refused credentials or TLS leave
//! every event untouched and say why on `/readyz`; a topic the relay may not write, or that does
//! not exist, parks only its own rows.

mod common;

use common::secure::{Relay, Secure, oidc_provider, secure};
use common::{Fixture, http_get_when_up};
use seaorm_outbox::Secret;
use seaorm_outbox::consumer::ConsumerOptions;
use seaorm_outbox::consumer::kafka::KafkaConsumer;
use seaorm_outbox::consumer::pulsar::PulsarConsumer;
use seaorm_outbox::pulsar_client::{PulsarAuth, PulsarConnection};
use seaorm_outbox::sea_orm::ConnectionTrait;
use std::collections::BTreeMap;
use std::time::Duration;

const EVENTS: i64 = 40;

/// Records `EVENTS` events of aggregate type `secure` over four aggregates.
async fn record(f: &Fixture) {
    f.db.execute_unprepared(&format!(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
         SELECT gen_random_uuid(), 'secure', 'k' || (g % 4), 'Made', jsonb_build_object('n', g)
         FROM generate_series(1, {EVENTS}) g"
    ))
    .await
    .unwrap();
}

/// Every event arrived once, in order per aggregate.
fn assert_all_in_order(ns_by_key: BTreeMap<String, Vec<i64>>) {
    let total: usize = ns_by_key.values().map(Vec::len).sum();
    assert_eq!(total, EVENTS as usize, "{ns_by_key:?}");
    for (key, ns) in ns_by_key {
        assert!(ns.windows(2).all(|w| w[0] < w[1]), "{key}: {ns:?}");
    }
}

/// Publishes the fixture's events to Kafka with the relay started with `args` and `env`, reads them
/// back through the broker's admin listener, then consumes them with the consumer loop connected
/// at `brokers` with the librdkafka settings `client`.
async fn kafka_round_trip(
    s: &Secure,
    args: &[String],
    env: &[(String, String)],
    brokers: &str,
    client: &[(&str, &str)],
) {
    let f = Fixture::new().await;
    let topic = f.topic("secure");
    s.create_topics(&[&topic]).await;
    record(&f).await;
    let relay = Relay::start(&f, args, env, "warn");
    relay.wait_until_drained(&f, Duration::from_secs(90)).await;
    relay.stop();
    let received = common::kafka::consume_from(
        &s.internal,
        &[&topic],
        EVENTS as usize,
        Duration::from_secs(60),
    )
    .await;
    let mut by_key: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for m in received {
        by_key
            .entry(m.key.clone())
            .or_default()
            .push(m.json()["n"].as_i64().unwrap());
    }
    assert_all_in_order(by_key);

    // No auto.offset.reset: the loop's own default must read the events already there.
    let mut config = rdkafka::ClientConfig::new();
    config.set("bootstrap.servers", brokers);
    for (key, value) in client {
        config.set(*key, *value);
    }
    let consumer = KafkaConsumer::with_config(
        config,
        &[&topic],
        ConsumerOptions::new(format!("{}-billing", f.prefix)),
    )
    .unwrap();
    let consumed = consume_all(consumer.progress(), |shutdown| {
        consumer.run(&f.db, |_, _| Box::pin(async { Ok(()) }), shutdown)
    })
    .await;
    assert_eq!(consumed.applied, EVENTS as u64);
}

fn kafka_args(brokers: &str, options: &[(&str, &str)]) -> Vec<String> {
    let mut args = vec!["--kafka-brokers".to_owned(), brokers.to_owned()];
    for (k, v) in options {
        args.push("--kafka-option".into());
        args.push(format!("{k}={v}"));
    }
    args
}

/// The consumer's settings for SASL_SSL with `mechanism` and the test user.
fn sasl_client<'a>(s: &'a Secure, mechanism: &'a str) -> Vec<(&'a str, &'a str)> {
    vec![
        ("security.protocol", "SASL_SSL"),
        ("ssl.ca.location", s.ca.as_str()),
        ("sasl.mechanism", mechanism),
        ("sasl.username", s.user.as_str()),
        ("sasl.password", s.password.as_str()),
    ]
}

fn owned(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

#[tokio::test]
async fn kafka_over_mutual_tls() {
    let s = secure();
    // The key's password comes through `${VAR}` in the config file, not the command line.
    let config = outbox_tests::temp_dir().join("relay.toml");
    std::fs::write(
        &config,
        format!(
            "[sink]\ntype = \"kafka\"\nbrokers = \"{}\"\n[sink.options]\n\"security.protocol\" = \"SSL\"\n\
             \"ssl.ca.location\" = \"{}\"\n\"ssl.certificate.location\" = \"{}\"\n\
             \"ssl.key.location\" = \"{}\"\n\"ssl.key.password\" = \"${{KAFKA_KEY_PASSWORD}}\"\n",
            s.ssl,
            s.file("ca.pem"),
            s.file("client.crt"),
            s.file("client.key"),
        ),
    )
    .unwrap();
    kafka_round_trip(
        &s,
        &["--config".into(), config.display().to_string()],
        &owned(&[("KAFKA_KEY_PASSWORD", &s.key_password)]),
        &s.ssl,
        &[
            ("security.protocol", "SSL"),
            ("ssl.ca.location", &s.ca),
            ("ssl.certificate.location", &s.file("client.crt")),
            ("ssl.key.location", &s.file("client.key")),
            ("ssl.key.password", &s.key_password),
        ],
    )
    .await;
}

#[tokio::test]
async fn kafka_over_sasl_ssl_with_scram_sha_512() {
    let s = secure();
    // The password comes from a file, as a mounted Kubernetes secret would.
    let file = outbox_tests::temp_dir().join("kafka-password");
    std::fs::write(&file, format!("{}\n", s.password)).unwrap();
    let args = kafka_args(
        &s.sasl_ssl,
        &[
            ("security.protocol", "SASL_SSL"),
            ("ssl.ca.location", &s.file("ca.pem")),
            ("sasl.mechanism", "SCRAM-SHA-512"),
            ("sasl.username", &s.user),
        ],
    );
    let env = owned(&[(
        "OUTBOX_KAFKA_OPTION_SASL_PASSWORD_FILE",
        &file.display().to_string(),
    )]);
    let client = sasl_client(&s, "SCRAM-SHA-512");
    kafka_round_trip(&s, &args, &env, &s.sasl_ssl, &client).await;
}

#[tokio::test]
async fn kafka_over_sasl_ssl_with_plain() {
    let s = secure();
    // Confluent Cloud style: PLAIN over TLS, the password from the environment.
    let args = kafka_args(
        &s.sasl_ssl,
        &[
            ("security.protocol", "SASL_SSL"),
            ("ssl.ca.location", &s.file("ca.pem")),
            ("sasl.mechanism", "PLAIN"),
            ("sasl.username", &s.user),
        ],
    );
    let env = owned(&[("OUTBOX_KAFKA_OPTION_SASL_PASSWORD", &s.password)]);
    let client = sasl_client(&s, "PLAIN");
    kafka_round_trip(&s, &args, &env, &s.sasl_ssl, &client).await;
}

#[tokio::test]
async fn kafka_over_sasl_ssl_with_oauthbearer_oidc() {
    let s = secure();
    let secret = format!("oidc-{}", seaorm_outbox::Uuid::now_v7().simple());
    let (issuer, issued) = oidc_provider("relay-client", &secret, &s.user, None).await;
    let endpoint = format!("{issuer}token");
    let args = kafka_args(
        &s.sasl_ssl,
        &[
            ("security.protocol", "SASL_SSL"),
            ("ssl.ca.location", &s.file("ca.pem")),
            ("sasl.mechanism", "OAUTHBEARER"),
            ("sasl.oauthbearer.method", "oidc"),
            ("sasl.oauthbearer.client.id", "relay-client"),
            ("sasl.oauthbearer.token.endpoint.url", &endpoint),
        ],
    );
    let env = owned(&[(
        "OUTBOX_KAFKA_OPTION_SASL_OAUTHBEARER_CLIENT_SECRET",
        &secret,
    )]);
    let client = [
        ("security.protocol", "SASL_SSL"),
        ("ssl.ca.location", s.ca.as_str()),
        ("sasl.mechanism", "OAUTHBEARER"),
        ("sasl.oauthbearer.method", "oidc"),
        ("sasl.oauthbearer.client.id", "relay-client"),
        ("sasl.oauthbearer.client.secret", secret.as_str()),
        ("sasl.oauthbearer.token.endpoint.url", endpoint.as_str()),
    ];
    kafka_round_trip(&s, &args, &env, &s.sasl_ssl, &client).await;
    assert!(
        issued.load(std::sync::atomic::Ordering::Relaxed) > 0,
        "the relay never asked the token endpoint"
    );
}

/// Runs the relay with credentials the broker refuses: it says why on `/readyz`, logs the refusal
/// once per backoff step rather than once per event, and leaves every row as it was. Then a relay
/// with good credentials publishes them all.
async fn refused_then_fixed(
    s: &Secure,
    bad: &[String],
    good: &[String],
    topic_of: impl Fn(&Fixture) -> Option<String>,
    expected_reason: &str,
) {
    let f = Fixture::new().await;
    if let Some(topic) = topic_of(&f) {
        s.create_topics(&[&topic]).await;
    }
    record(&f).await;
    let relay = Relay::start(&f, bad, &[], "warn");
    relay
        .wait_for_log("events wait, untouched", Duration::from_secs(60))
        .await;
    let (status, body) = http_get_when_up(relay.port, "/readyz").await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains(expected_reason), "/readyz: {body}");
    // A second backoff step, so that "once per step" is seen.
    relay
        .wait_for_log_count("events wait, untouched", 2, Duration::from_secs(60))
        .await;
    let log = relay.stop();
    let refusals = log.matches("events wait, untouched").count();
    assert!(
        refusals < EVENTS as usize,
        "{refusals} refusal lines for {EVENTS} events:\n{log}"
    );
    assert!(log.contains(expected_reason), "{log}");
    let touched = f
        .scalar(
            "SELECT count(*) FROM outbox WHERE published_at IS NOT NULL OR parked_at IS NOT NULL
               OR attempts > 0 OR last_error IS NOT NULL OR retry_at IS NOT NULL",
        )
        .await;
    assert_eq!(
        touched, 0,
        "rows were touched while the broker refused the relay"
    );

    let relay = Relay::start(&f, good, &[], "warn");
    relay.wait_until_drained(&f, Duration::from_secs(90)).await;
    relay.stop();
    assert_eq!(
        f.scalar("SELECT count(*) FROM outbox WHERE published_at IS NOT NULL")
            .await,
        EVENTS
    );
}

fn scram(s: &Secure, password: &str, ca: &str) -> Vec<String> {
    kafka_args(
        &s.sasl_ssl,
        &[
            ("security.protocol", "SASL_SSL"),
            ("ssl.ca.location", &s.file(ca)),
            ("sasl.mechanism", "SCRAM-SHA-512"),
            ("sasl.username", &s.user),
            ("sasl.password", password),
        ],
    )
}

#[tokio::test]
async fn a_wrong_kafka_password_parks_nothing() {
    let s = secure();
    refused_then_fixed(
        &s,
        &scram(&s, "not-the-password", "ca.pem"),
        &scram(&s, &s.password, "ca.pem"),
        |f| Some(f.topic("secure")),
        "Authentication failed",
    )
    .await;
}

#[tokio::test]
async fn an_untrusted_kafka_certificate_parks_nothing() {
    let s = secure();
    refused_then_fixed(
        &s,
        &scram(&s, &s.password, "other-ca.pem"),
        &scram(&s, &s.password, "ca.pem"),
        |f| Some(f.topic("secure")),
        "certificate verify failed",
    )
    .await;
}

#[tokio::test]
async fn a_plaintext_client_at_a_tls_listener_parks_nothing() {
    let s = secure();
    let mtls = |protocol: &str| {
        kafka_args(
            &s.ssl,
            &[
                ("security.protocol", protocol),
                ("ssl.ca.location", &s.file("ca.pem")),
                ("ssl.certificate.location", &s.file("client.crt")),
                ("ssl.key.location", &s.file("client.key")),
                ("ssl.key.password", &s.key_password),
            ],
        )
    };
    refused_then_fixed(
        &s,
        &kafka_args(&s.ssl, &[("security.protocol", "PLAINTEXT")]),
        &mtls("SSL"),
        |f| Some(f.topic("secure")),
        "security.protocol",
    )
    .await;
}

#[tokio::test]
async fn a_topic_the_relay_may_not_write_or_that_does_not_exist_parks_only_its_rows() {
    let s = secure();
    let f = Fixture::new().await;
    let allowed = f.topic("secure");
    // The relay's user may write topics named t*; this one exists but is not among them.
    let forbidden = format!("forbidden.{}", f.prefix);
    let missing = f.topic("missing");
    s.create_topics(&[&allowed, &forbidden]).await;
    record(&f).await;
    f.db.execute_unprepared(&format!(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, topic) VALUES
           (gen_random_uuid(), 'other', 'x', 'Made', '{{}}', '{forbidden}'),
           (gen_random_uuid(), 'other', 'y', 'Made', '{{}}', '{missing}')"
    ))
    .await
    .unwrap();
    let relay = Relay::start(&f, &scram(&s, &s.password, "ca.pem"), &[], "warn");
    relay.wait_until_drained(&f, Duration::from_secs(120)).await;
    relay.stop();
    assert_eq!(
        f.scalar("SELECT count(*) FROM outbox WHERE published_at IS NOT NULL")
            .await,
        EVENTS
    );
    let parked = "SELECT count(*) FROM outbox WHERE parked_at IS NOT NULL AND aggregate_id = ";
    assert_eq!(
        f.scalar(&format!("{parked}'x'")).await,
        1,
        "the forbidden topic's row is not parked"
    );
    assert_eq!(
        f.scalar(&format!("{parked}'y'")).await,
        1,
        "the missing topic's row is not parked"
    );
    let reasons: Vec<String> = {
        use seaorm_outbox::sea_orm::{DbBackend, Statement};
        f.db.query_all_raw(Statement::from_string(
            DbBackend::Postgres,
            "SELECT last_error FROM outbox WHERE parked_at IS NOT NULL ORDER BY aggregate_id",
        ))
        .await
        .unwrap()
        .iter()
        .map(|row| row.try_get_by_index::<String>(0).unwrap())
        .collect()
    };
    assert!(reasons[0].contains("Authorization"), "{reasons:?}");
    assert!(reasons[1].contains("nknown topic"), "{reasons:?}");
}

/// Runs a consumer loop until it has applied every event, then stops it.
async fn consume_all<F>(
    mut progress: tokio::sync::watch::Receiver<seaorm_outbox::consumer::Consumed>,
    run: impl FnOnce(futures::future::BoxFuture<'static, ()>) -> F,
) -> seaorm_outbox::consumer::Consumed
where
    F: std::future::Future<
            Output = Result<
                seaorm_outbox::consumer::Consumed,
                seaorm_outbox::consumer::ConsumerError,
            >,
        >,
{
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let shutdown: futures::future::BoxFuture<'static, ()> = Box::pin(async move {
        let _ = stopped.await;
    });
    let watcher = async move {
        let done = progress.wait_for(|c| c.applied >= EVENTS as u64);
        tokio::time::timeout(Duration::from_secs(60), done)
            .await
            .expect("the consumer loop did not apply every event within 60 s")
            .expect("progress");
        let _ = stop.send(());
    };
    let (consumed, ()) = tokio::join!(run(shutdown), watcher);
    consumed.expect("consumer loop")
}

fn pulsar_args(s: &Secure, ca: &str) -> Vec<String> {
    vec![
        "--sink".into(),
        "pulsar".into(),
        "--pulsar-url".into(),
        s.pulsar_tls_url.clone(),
        "--pulsar-tls-ca-file".into(),
        s.file(ca),
    ]
}

fn with_token(mut args: Vec<String>, token: &str) -> Vec<String> {
    args.extend(["--pulsar-token".into(), token.into()]);
    args
}

#[tokio::test]
async fn pulsar_with_a_token_over_tls() {
    let s = secure();
    let f = Fixture::new().await;
    record(&f).await;
    // The token comes from a file, as a mounted secret would.
    let token_file = outbox_tests::temp_dir().join("pulsar-token");
    std::fs::write(&token_file, &s.pulsar_token).unwrap();
    let relay = Relay::start(
        &f,
        &pulsar_args(&s, "ca.pem"),
        &owned(&[("PULSAR_TOKEN_FILE", &token_file.display().to_string())]),
        "warn",
    );
    relay.wait_until_drained(&f, Duration::from_secs(90)).await;
    relay.stop();

    let topic = common::pulsar::topic(&f.topic("secure"));
    let received = common::pulsar::consume(&topic, EVENTS as usize, Duration::from_secs(60)).await;
    let mut by_key: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for m in received {
        let n = serde_json::from_slice::<serde_json::Value>(&m.payload).unwrap()["n"]
            .as_i64()
            .unwrap();
        by_key.entry(m.key.clone()).or_default().push(n);
    }
    assert_all_in_order(by_key);

    // The consumer loop, with the same token over TLS.
    let mut connection = PulsarConnection::new(&s.pulsar_tls_url);
    connection.auth = Some(PulsarAuth::Token(Secret::new(&s.pulsar_token)));
    connection.tls_ca_file = Some(s.file("ca.pem").into());
    let consumer = PulsarConsumer::connect(
        &connection,
        &[&topic],
        ConsumerOptions::new(format!("{}-billing", f.prefix)),
    )
    .await
    .unwrap();
    let consumed = consume_all(consumer.progress(), |shutdown| {
        consumer.run(&f.db, |_, _| Box::pin(async { Ok(()) }), shutdown)
    })
    .await;
    assert_eq!(consumed.applied, EVENTS as u64);
}

#[tokio::test]
async fn an_expired_pulsar_token_parks_nothing() {
    let s = secure();
    refused_then_fixed(
        &s,
        &with_token(pulsar_args(&s, "ca.pem"), &s.pulsar_expired_token),
        &with_token(pulsar_args(&s, "ca.pem"), &s.pulsar_token),
        |_| None,
        "refuses the relay",
    )
    .await;
}

#[tokio::test]
async fn a_pulsar_token_signed_by_another_key_parks_nothing() {
    let s = secure();
    refused_then_fixed(
        &s,
        &with_token(pulsar_args(&s, "ca.pem"), &s.pulsar_foreign_token),
        &with_token(pulsar_args(&s, "ca.pem"), &s.pulsar_token),
        |_| None,
        "refuses the relay",
    )
    .await;
}

#[tokio::test]
async fn an_untrusted_pulsar_certificate_parks_nothing() {
    let s = secure();
    refused_then_fixed(
        &s,
        &with_token(pulsar_args(&s, "other-ca.pem"), &s.pulsar_token),
        &with_token(pulsar_args(&s, "ca.pem"), &s.pulsar_token),
        |_| None,
        "refuses the relay",
    )
    .await;
}

#[tokio::test]
async fn pulsar_with_oauth2_client_credentials_over_tls() {
    let s = secure();
    let f = Fixture::new().await;
    record(&f).await;
    // The provider issues the broker-signed token; the relay gets it with its client credentials.
    let secret = format!("oauth-{}", seaorm_outbox::Uuid::now_v7().simple());
    let (issuer, issued) = oidc_provider(
        "relay-client",
        &secret,
        "relay",
        Some(s.pulsar_token.clone()),
    )
    .await;
    let key_file = outbox_tests::temp_dir().join("key.json");
    std::fs::write(
        &key_file,
        format!(r#"{{"client_id":"relay-client","client_secret":"{secret}"}}"#),
    )
    .unwrap();
    let mut args = pulsar_args(&s, "ca.pem");
    args.extend([
        "--pulsar-oauth2-issuer-url".into(),
        issuer,
        "--pulsar-oauth2-audience".into(),
        "urn:pulsar:test".into(),
    ]);
    let env = owned(&[(
        "PULSAR_OAUTH2_CREDENTIALS_URL",
        &format!("file://{}", key_file.display()),
    )]);
    let relay = Relay::start(&f, &args, &env, "warn");
    relay.wait_until_drained(&f, Duration::from_secs(90)).await;
    relay.stop();
    assert!(
        issued.load(std::sync::atomic::Ordering::Relaxed) > 0,
        "the relay never asked the token endpoint"
    );
    assert_eq!(
        f.scalar("SELECT count(*) FROM outbox WHERE published_at IS NOT NULL")
            .await,
        EVENTS
    );
}
