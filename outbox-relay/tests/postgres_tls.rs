//! The relay on a PostgreSQL that accepts TLS connections only (`scripts/services start
//! postgres-tls`: `hostssl` entries, SCRAM passwords, a certificate of a throwaway CA), as managed
//! databases run: the polling relay and the WAL source, whose replication connection reads the
//! URL's TLS settings as the relay's other connections do. The server refuses plaintext, so a
//! connection that fell back would fail; a certificate the URL's CA did not sign is refused with an
//! error that says so.

mod common;

use common::kafka::consume;
use common::wal::WalFixture;
use common::{Fixture, relay_command};
use seaorm_outbox::sea_orm::{ConnectionTrait, Database};
use seaorm_outbox_relay::wal::WalSource;
use std::time::Duration;

/// The TLS-only PostgreSQL, verified fully against the run's CA.
fn tls_url() -> String {
    std::env::var("OUTBOX_PG_TLS_URL").unwrap_or_else(|_| {
        panic!(
            "OUTBOX_PG_TLS_URL is not set: this test needs a PostgreSQL that accepts TLS only. \
             Run `scripts/test`, which starts one (scripts/services start postgres-tls)."
        )
    })
}

/// A fixture on the TLS-only server: a schema of its own with the outbox tables, and a slot and
/// publication named after it.
async fn tls_fixture() -> WalFixture {
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
    common::migrate(&url);
    let prefix = schema.replace('_', "");
    let name = format!("s_{}", &prefix[1..]);
    WalFixture {
        f: Fixture {
            db: Database::connect(url.as_str()).await.unwrap(),
            url,
            template: format!("{prefix}.{{aggregate_type}}"),
            prefix,
        },
        source: WalSource::new(name.clone(), name).unwrap(),
    }
}

async fn record(f: &Fixture, from: i64, to: i64) {
    f.db.execute_unprepared(&format!(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
         SELECT gen_random_uuid(), 'order', 'o-1', 'OrderPlaced', jsonb_build_object('n', i)
         FROM generate_series({from}, {to}) i"
    ))
    .await
    .unwrap();
}

#[tokio::test]
async fn polling_and_wal_relays_publish_over_verified_tls() {
    let w = tls_fixture().await;
    let topic = w.f.topic("order");
    let minute = Duration::from_secs(60);

    record(&w.f, 1, 5).await;
    let mut polling = w.f.spawn_relay(&[]);
    w.f.wait_until_drained(minute).await;
    assert_eq!(
        common::terminate(&mut polling),
        Some(0),
        "{}",
        polling.log()
    );

    // The WAL source: its replication connection must use TLS too, or the server refuses it.
    let mut wal = w.spawn_relay(&[]);
    w.f.wait_until_zero(
        &format!(
            "SELECT count(*) FILTER (WHERE NOT s.ssl) + (1 - count(*)) FROM pg_stat_replication r
             JOIN pg_stat_ssl s USING (pid) JOIN pg_replication_slots l ON l.active_pid = r.pid
             WHERE l.slot_name = '{}' AND l.confirmed_flush_lsn IS NOT NULL",
            w.source.slot
        ),
        minute,
    )
    .await;
    record(&w.f, 6, 10).await;
    let received = consume(&[&topic], 10, minute).await;
    let ns: Vec<i64> = received
        .iter()
        .map(|m| m.json()["n"].as_i64().unwrap())
        .collect();
    assert_eq!(ns, (1..=10).collect::<Vec<_>>());
    assert_eq!(common::terminate(&mut wal), Some(0), "{}", wal.log());

    // sslmode=prefer, the default: TLS when the server offers it, on the replication connection
    // too (it once meant plaintext there, which this server refuses).
    let prefer = WalFixture {
        f: Fixture {
            url: w.f.url.replace("sslmode=verify-full", "sslmode=prefer"),
            ..w.f.clone()
        },
        source: w.source.clone(),
    };
    let mut wal = prefer.spawn_relay(&[]);
    record(&w.f, 11, 15).await;
    let received = consume(&[&topic], 15, minute).await;
    assert_eq!(received.len(), 15, "{}", wal.log());
    assert_eq!(common::terminate(&mut wal), Some(0), "{}", wal.log());
    w.drop_slot().await;
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
