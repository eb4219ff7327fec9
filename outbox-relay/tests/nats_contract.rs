//! The NATS JetStream contract, end to end on real PostgreSQL and a real NATS server (Debian's,
//! started by `scripts/services start nats`): subject, headers, payload and per-aggregate order as
//! stored in the stream; a batch sent again is stored once (`Nats-Msg-Id`); a subject no stream
//! takes parks its event and no other; refused credentials leave the rows untouched.

mod common;

use common::Fixture;
use common::nats::{create_stream, header, stored, token, url};
use seaorm_outbox::sea_orm::{ConnectionTrait, TransactionTrait};
use seaorm_outbox::{NewEvent, OutboxEvent, Secret, Uuid};
use seaorm_outbox_relay::sink::nats::{NatsConfig, NatsSink};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::future::Future;
use std::time::Duration;

#[derive(Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate = "order", key = "order_id")]
struct OrderPlaced {
    order_id: String,
    n: i64,
}

#[derive(Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate = "invoice", key = "invoice_id")]
struct InvoiceSent {
    invoice_id: String,
}

fn sink_config(token: &str) -> NatsConfig {
    let mut config = NatsConfig::new(url());
    config.token = Some(Secret::new(token));
    config.ack_timeout = Duration::from_secs(5);
    config
}

/// Runs a relay publishing with `config` until `done` resolves, then stops it.
async fn run_relay_until(f: &Fixture, config: &NatsConfig, done: impl Future<Output = ()>) {
    common::run_relay_until(f, NatsSink::new(config).expect("the sink"), done).await;
}

/// Runs a relay publishing to NATS until the backlog is empty (or `timeout`), then stops it.
async fn drain(f: &Fixture, config: &NatsConfig, timeout: Duration) {
    run_relay_until(f, config, f.wait_until_drained(timeout)).await;
}

/// Records one `OrderPlaced` of `order_id` in a transaction of its own.
async fn record_order(f: &Fixture, order_id: &str) {
    let txn = f.db.begin().await.unwrap();
    OrderPlaced {
        order_id: order_id.into(),
        n: 1,
    }
    .record(&txn)
    .await
    .unwrap();
    txn.commit().await.unwrap();
}

#[tokio::test]
async fn events_reach_jetstream_with_headers_and_order_and_a_resent_batch_is_stored_once() {
    let f = Fixture::new().await;
    let mut stream = create_stream(&f, vec![format!("{}.>", f.prefix)]).await;
    let mut recorded: BTreeMap<String, Vec<Uuid>> = BTreeMap::new();
    for n in 0..20 {
        let txn = f.db.begin().await.unwrap();
        for o in 0..5 {
            let order_id = format!("o{o}");
            let event = OrderPlaced {
                order_id: order_id.clone(),
                n,
            };
            recorded
                .entry(order_id)
                .or_default()
                .push(event.record(&txn).await.unwrap());
        }
        txn.commit().await.unwrap();
    }
    let txn = f.db.begin().await.unwrap();
    let traced = NewEvent::from_event(&OrderPlaced {
        order_id: "traced".into(),
        n: 7,
    })
    .unwrap()
    .with_header(
        "traceparent",
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    )
    .record(&txn)
    .await
    .unwrap();
    txn.commit().await.unwrap();

    let config = sink_config(&token());
    drain(&f, &config, Duration::from_secs(60)).await;

    let messages = stored(&mut stream).await;
    assert_eq!(messages.len(), 101, "each event stored once");
    let mut arrived: BTreeMap<String, Vec<Uuid>> = BTreeMap::new();
    for m in &messages {
        assert_eq!(m.subject.as_str(), f.topic("order"));
        let id = header(m, "id").expect("id header");
        assert_eq!(
            header(m, "Nats-Msg-Id"),
            Some(id),
            "deduplicated by the event id"
        );
        assert_eq!(header(m, "event_type"), Some("OrderPlaced"));
        assert_eq!(header(m, "aggregate_type"), Some("order"));
        assert_eq!(header(m, "event_version"), Some("1"));
        let key = header(m, "aggregate_id")
            .expect("aggregate_id header")
            .to_owned();
        let payload: serde_json::Value = serde_json::from_slice(&m.payload).unwrap();
        assert_eq!(payload["order_id"], key.as_str(), "the recorded payload");
        arrived.entry(key).or_default().push(id.parse().unwrap());
    }
    let traced_message = messages
        .iter()
        .find(|m| header(m, "id") == Some(traced.to_string().as_str()))
        .expect("the traced event");
    assert_eq!(
        header(traced_message, "traceparent"),
        Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
    );
    recorded.insert("traced".into(), vec![traced]);
    assert_eq!(
        arrived, recorded,
        "every aggregate's events in recording order"
    );

    // As after a relay that died between the acks and its mark: the whole backlog again.
    f.db.execute_unprepared("UPDATE outbox SET published_at = NULL")
        .await
        .unwrap();
    drain(&f, &config, Duration::from_secs(60)).await;
    assert_eq!(
        stored(&mut stream).await.len(),
        101,
        "the stream's duplicate window dropped every second copy"
    );
}

#[tokio::test]
async fn a_subject_no_stream_takes_parks_its_event_and_others_flow() {
    let f = Fixture::new().await;
    let mut stream = create_stream(&f, vec![f.topic("order")]).await;
    let txn = f.db.begin().await.unwrap();
    InvoiceSent {
        invoice_id: "i1".into(),
    }
    .record(&txn)
    .await
    .unwrap();
    for n in 0..3 {
        OrderPlaced {
            order_id: "o1".into(),
            n,
        }
        .record(&txn)
        .await
        .unwrap();
    }
    txn.commit().await.unwrap();

    drain(&f, &sink_config(&token()), Duration::from_secs(60)).await;

    assert_eq!(stored(&mut stream).await.len(), 3, "the orders flowed");
    let parked = f
        .scalar(&format!(
            "SELECT count(*) FROM outbox WHERE aggregate_type = 'invoice' AND parked_at IS NOT NULL \
             AND last_error LIKE '%no JetStream stream takes subject `{}`%'",
            f.topic("invoice")
        ))
        .await;
    assert_eq!(parked, 1, "the invoice parked with the reason");
}

#[tokio::test]
async fn a_refused_token_leaves_the_rows_untouched() {
    let f = Fixture::new().await;
    let mut stream = create_stream(&f, vec![format!("{}.>", f.prefix)]).await;
    record_order(&f, "o1").await;

    let refused = sink_config("not-the-token");
    run_relay_until(&f, &refused, tokio::time::sleep(Duration::from_secs(3))).await;

    let touched = f.scalar(common::TOUCHED).await;
    assert_eq!(touched, 0, "nothing recorded against the event");
    assert_eq!(f.backlog().await, 1);
    assert_eq!(stored(&mut stream).await.len(), 0);

    drain(&f, &sink_config(&token()), Duration::from_secs(60)).await;
    assert_eq!(
        stored(&mut stream).await.len(),
        1,
        "published once the token is right"
    );
}

#[tokio::test]
async fn the_binary_publishes_to_nats_with_a_token_file_and_never_prints_a_token() {
    let f = Fixture::new().await;
    let mut stream = create_stream(&f, vec![format!("{}.>", f.prefix)]).await;
    record_order(&f, "o1").await;

    // A refused token first: the relay waits, and says so without the token.
    let wrong = format!("wrong-{}", Uuid::now_v7().simple());
    let port = common::free_port();
    let mut relay = f.spawn_relay_to(
        &[
            "--sink",
            "nats",
            "--nats-url",
            &url(),
            "--nats-token",
            &wrong,
        ],
        &[
            "--log-format",
            "json",
            "--http-addr",
            &format!("127.0.0.1:{port}"),
        ],
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (status, ready) = common::http_get_when_up(port, "/readyz").await;
    assert_eq!(status, 503, "{ready}");
    assert!(
        ready.starts_with("not ready: nats: ") && ready.to_lowercase().contains("authorization"),
        "/readyz names the sink and the refusal: {ready}"
    );
    common::terminate(&mut relay);
    let log = relay.log();
    assert!(
        log.to_lowercase().contains("authorization"),
        "the refusal is reported: {log}"
    );
    for (place, text) in [("the log", &log), ("/readyz", &ready)] {
        assert!(!text.contains(&wrong), "{place} shows the token: {text}");
    }
    assert_eq!(f.backlog().await, 1);

    let dir = outbox_tests::temp_dir();
    let file = dir.join("nats-token");
    std::fs::write(&file, format!("{}\n", token())).unwrap();
    let file = file.display().to_string();
    let relay = f.spawn_relay_to(&["--sink", "nats", "--nats-token-file", &file], &[]);
    f.wait_until_drained(Duration::from_secs(60)).await;
    drop(relay);
    assert_eq!(stored(&mut stream).await.len(), 1);
}

#[test]
fn the_nats_sink_without_a_url_is_a_usage_error() {
    let output = common::relay_command()
        .args([
            "run",
            "--database-url",
            "postgres://u@127.0.0.1:1/db",
            "--sink",
            "nats",
        ])
        .env_remove("NATS_URL")
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("the nats sink needs a server URL"),
        "{stderr}"
    );
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
}

/// The server's TLS address (the same port: the test server takes TLS and plain clients).
fn tls_url() -> String {
    url().replacen("nats://", "tls://", 1)
}

fn tls_file(name: &str) -> std::path::PathBuf {
    std::path::PathBuf::from(
        std::env::var("OUTBOX_TLS_DIR").expect("OUTBOX_TLS_DIR is not set (scripts/services)"),
    )
    .join(name)
}

#[tokio::test]
async fn tls_with_the_servers_ca_publishes_and_an_unrelated_ca_leaves_the_rows_untouched() {
    let f = Fixture::new().await;
    let mut stream = create_stream(&f, vec![format!("{}.>", f.prefix)]).await;
    record_order(&f, "o1").await;

    let mut config = sink_config(&token());
    config.url = Secret::new(tls_url());
    config.tls_ca_file = Some(tls_file("other-ca.pem"));
    run_relay_until(&f, &config, tokio::time::sleep(Duration::from_secs(3))).await;
    let touched = f.scalar(common::TOUCHED).await;
    assert_eq!(
        touched, 0,
        "an unverified server gets nothing, and the event is not blamed"
    );

    config.tls_ca_file = Some(tls_file("ca.pem"));
    drain(&f, &config, Duration::from_secs(60)).await;
    assert_eq!(stored(&mut stream).await.len(), 1, "published over TLS");
}

/// A credentials file (a user JWT and its NKey seed, as `nsc` writes them), on a server in
/// operator mode; the same JWT with another user's seed is refused and leaves the rows untouched.
#[tokio::test]
async fn a_user_with_a_credentials_file_logs_in_on_an_operator_mode_server() {
    use common::nats::{create_stream_with, credentials_file, jwt_url, nkey_seed};
    let f = Fixture::new().await;
    let client = async_nats::ConnectOptions::with_credentials_file(credentials_file())
        .await
        .expect("read the credentials file")
        .connect(jwt_url())
        .await
        .expect("connect to the operator-mode NATS server");
    let mut stream = create_stream_with(client, &f, vec![format!("{}.>", f.prefix)]).await;
    record_order(&f, "o1").await;

    // The JWT is the user's, the seed another's: the server's nonce signature check fails.
    let creds = std::fs::read_to_string(credentials_file()).unwrap();
    let seed = creds
        .lines()
        .find(|l| l.starts_with("SU"))
        .expect("the user's seed");
    let forged = outbox_tests::temp_dir().join("forged.creds");
    std::fs::write(&forged, creds.replace(seed, &nkey_seed())).unwrap();
    let mut config = NatsConfig::new(jwt_url());
    config.credentials_file = Some(forged);
    config.ack_timeout = Duration::from_secs(5);
    run_relay_until(&f, &config, tokio::time::sleep(Duration::from_secs(3))).await;
    assert_eq!(
        f.scalar(common::TOUCHED).await,
        0,
        "refused credentials touched rows"
    );

    let mut config = NatsConfig::new(jwt_url());
    config.credentials_file = Some(credentials_file());
    drain(&f, &config, Duration::from_secs(60)).await;
    assert_eq!(
        stored(&mut stream).await.len(),
        1,
        "published with the credentials file"
    );
}

/// The other logins, on a server configured for them: a user with a password (in the URL) and a
/// user with an NKey publish; a wrong password leaves the rows untouched.
#[tokio::test]
async fn a_user_with_a_password_and_a_user_with_an_nkey_log_in() {
    use common::nats::{create_stream_with, nkey_seed, user_password, users_url};
    let f = Fixture::new().await;
    let client =
        async_nats::ConnectOptions::with_user_and_password("relay".into(), user_password())
            .connect(users_url())
            .await
            .expect("connect to the second NATS server");
    let mut stream = create_stream_with(client, &f, vec![format!("{}.>", f.prefix)]).await;
    let with_login =
        |password: &str| users_url().replacen("nats://", &format!("nats://relay:{password}@"), 1);

    record_order(&f, "o1").await;
    let mut config = NatsConfig::new(with_login("wrong-password"));
    config.ack_timeout = Duration::from_secs(5);
    run_relay_until(&f, &config, tokio::time::sleep(Duration::from_secs(3))).await;
    assert_eq!(
        f.scalar(common::TOUCHED).await,
        0,
        "a refused password touched rows"
    );

    let config = NatsConfig::new(with_login(&user_password()));
    drain(&f, &config, Duration::from_secs(60)).await;
    assert_eq!(
        stored(&mut stream).await.len(),
        1,
        "published with user and password"
    );

    record_order(&f, "o2").await;
    let mut config = NatsConfig::new(users_url());
    config.nkey_seed = Some(Secret::new(nkey_seed()));
    drain(&f, &config, Duration::from_secs(60)).await;
    assert_eq!(
        stored(&mut stream).await.len(),
        2,
        "published with the NKey"
    );
}
