//! The relay on a PostgreSQL that accepts TLS connections only (`scripts/services start
//! postgres-tls`: `hostssl` entries, SCRAM passwords, a certificate of a throwaway CA), as managed
//! databases run: the polling relay and the WAL source, whose replication connection reads the
//! URL's TLS settings as the relay's other connections do. The server refuses plaintext, so a
//! connection that fell back would fail; a certificate the URL's CA did not sign is refused with an
//! error that says so.

mod common;

use common::kafka::consume;
use common::{KillOnDrop, relay_command};
use seaorm_outbox::sea_orm::{ConnectionTrait, Database, DatabaseConnection, DbBackend, Statement};
use std::time::{Duration, Instant};

/// The TLS-only PostgreSQL, verified fully against the run's CA.
fn tls_url() -> String {
    std::env::var("OUTBOX_PG_TLS_URL").unwrap_or_else(|_| {
        panic!(
            "OUTBOX_PG_TLS_URL is not set: this test needs a PostgreSQL that accepts TLS only. \
             Run `scripts/test`, which starts one (scripts/services start postgres-tls)."
        )
    })
}

/// A schema of its own on the TLS-only server, with the outbox tables; the URL of its connections.
async fn fresh_schema() -> (DatabaseConnection, String, String) {
    let url = tls_url();
    let schema = format!("t_{}", seaorm_outbox::Uuid::now_v7().simple());
    let admin = Database::connect(url.as_str())
        .await
        .expect("connect over TLS");
    admin
        .execute_unprepared(&format!("CREATE SCHEMA {schema}"))
        .await
        .unwrap();
    let url = format!("{url}&options=-c%20search_path%3D{schema}");
    let migrated = relay_command()
        .args(["migrate", "--database-url", &url])
        .output()
        .unwrap();
    assert!(
        migrated.status.success(),
        "{}",
        String::from_utf8_lossy(&migrated.stderr)
    );
    let db = Database::connect(url.as_str()).await.unwrap();
    (db, url, schema)
}

async fn scalar(db: &DatabaseConnection, sql: &str) -> i64 {
    let row = db
        .query_one_raw(Statement::from_string(DbBackend::Postgres, sql))
        .await
        .unwrap()
        .unwrap();
    row.try_get_by_index(0).unwrap()
}

async fn wait_until_zero(db: &DatabaseConnection, sql: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while scalar(db, sql).await != 0 {
        assert!(
            Instant::now() < deadline,
            "still not zero after 60 s: {sql}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn record(db: &DatabaseConnection, from: i64, to: i64) {
    db.execute_unprepared(&format!(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
         SELECT gen_random_uuid(), 'order', 'o-1', 'OrderPlaced', jsonb_build_object('n', i)
         FROM generate_series({from}, {to}) i"
    ))
    .await
    .unwrap();
}

fn spawn_relay(url: &str, prefix: &str, extra: &[&str]) -> KillOnDrop {
    KillOnDrop::spawn_logged(
        relay_command()
            .args(["run", "--database-url", url])
            .args(["--kafka-brokers", &common::kafka::brokers()])
            .args(["--topic-template", &format!("{prefix}.{{aggregate_type}}")])
            .args(["--poll-interval", "20ms", "--http-addr", "off"])
            .args(extra),
    )
}

#[tokio::test]
async fn polling_and_wal_relays_publish_over_verified_tls() {
    let (db, url, schema) = fresh_schema().await;
    let prefix = schema.replace('_', "");
    let topic = format!("{prefix}.order");

    record(&db, 1, 5).await;
    let mut polling = spawn_relay(&url, &prefix, &[]);
    wait_until_zero(
        &db,
        "SELECT count(*) FROM outbox WHERE published_at IS NULL",
    )
    .await;
    assert_eq!(
        common::terminate(&mut polling),
        Some(0),
        "{}",
        polling.log()
    );

    // The WAL source: its replication connection must use TLS too, or the server refuses it.
    let name = format!("s_{}", &prefix[1..]);
    let mut wal = spawn_relay(
        &url,
        &prefix,
        &[
            "--source",
            "wal",
            "--wal-slot",
            &name,
            "--wal-publication",
            &name,
        ],
    );
    wait_until_zero(
        &db,
        &format!(
            "SELECT count(*) FILTER (WHERE NOT s.ssl) + (1 - count(*)) FROM pg_stat_replication r
             JOIN pg_stat_ssl s USING (pid) JOIN pg_replication_slots l ON l.active_pid = r.pid
             WHERE l.slot_name = '{name}' AND l.confirmed_flush_lsn IS NOT NULL"
        ),
    )
    .await;
    record(&db, 6, 10).await;
    let received = consume(&[&topic], 10, Duration::from_secs(60)).await;
    let ns: Vec<i64> = received
        .iter()
        .map(|m| m.json()["n"].as_i64().unwrap())
        .collect();
    assert_eq!(ns, (1..=10).collect::<Vec<_>>());
    assert_eq!(common::terminate(&mut wal), Some(0), "{}", wal.log());

    // sslmode=prefer, the default: TLS when the server offers it, on the replication connection
    // too (it once meant plaintext there, which this server refuses).
    let prefer = url.replace("sslmode=verify-full", "sslmode=prefer");
    let mut wal = spawn_relay(
        &prefer,
        &prefix,
        &[
            "--source",
            "wal",
            "--wal-slot",
            &name,
            "--wal-publication",
            &name,
        ],
    );
    record(&db, 11, 15).await;
    let received = consume(&[&topic], 15, Duration::from_secs(60)).await;
    assert_eq!(received.len(), 15, "{}", wal.log());
    assert_eq!(common::terminate(&mut wal), Some(0), "{}", wal.log());
    let dropped = relay_command()
        .args(["wal", "drop", "--database-url", &url])
        .args(["--slot", &name, "--publication", &name])
        .output()
        .unwrap();
    assert!(dropped.status.success());
}

#[tokio::test]
async fn a_certificate_from_another_ca_or_no_tls_is_refused_with_a_clear_error() {
    let url = tls_url();
    let other_ca = format!(
        "{}/other-ca.pem",
        std::env::var("OUTBOX_TLS_DIR").expect("OUTBOX_TLS_DIR (scripts/services)")
    );
    let (base, _) = url.split_once('?').unwrap();
    let password = url
        .split_once("relay:")
        .and_then(|(_, rest)| rest.split_once('@'))
        .map(|(password, _)| password.to_owned())
        .unwrap();
    for (url, expected) in [
        (
            format!("{base}?sslmode=verify-full&sslrootcert={other_ca}"),
            "certificate",
        ),
        (format!("{base}?sslmode=disable"), "no encryption"),
    ] {
        let status = relay_command()
            .args(["status", "--database-url", &url])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&status.stderr);
        assert_eq!(status.status.code(), Some(1), "{url}: {stderr}");
        assert!(stderr.contains(expected), "{url}: {stderr}");
        assert!(
            !stderr.contains(&password),
            "the password was printed: {stderr}"
        );
    }
}
