//! `--wakeup notify`: with polling and lease refreshes an hour apart, only the NOTIFY of a
//! committing transaction can wake the relay.

mod common;

use common::Fixture;
use seaorm_outbox::OutboxEvent;
use seaorm_outbox::sea_orm::TransactionTrait;
use seaorm_outbox_relay::Relay;
use seaorm_outbox_relay::Wakeup;
use seaorm_outbox_relay::sink::memory::MemorySink;
use serde::Serialize;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate = "bell", key = "bell")]
struct Rang {
    bell: u8,
}

#[tokio::test]
async fn notify_wakes_an_idle_relay() {
    let f = Fixture::new().await;
    let migrate = common::relay_command()
        .args(["migrate", "--notify-trigger", "--database-url", &f.url])
        .output()
        .unwrap();
    assert!(
        migrate.status.success(),
        "{}",
        String::from_utf8_lossy(&migrate.stderr)
    );

    let mut config = f.relay_config();
    config.wakeup = Wakeup::Notify;
    config.poll_interval = Duration::from_secs(3600);
    config.lease_refresh = Duration::from_secs(3600);
    let sink = MemorySink::default();
    let relay = Relay::new(config, sink.clone());
    let shutdown = CancellationToken::new();
    let running = tokio::spawn({
        let shutdown = shutdown.clone();
        async move { relay.run(shutdown).await.expect("the relay refused to run") }
    });
    // The relay listens before it leases shards: once it holds them, it is listening.
    f.wait_until_zero(
        "SELECT 256 - count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 2 \
           AND classid = hashtext('outbox-relay:' || 'outbox'::regclass::oid::text)::oid AND objid < 256",
        Duration::from_secs(30),
    )
    .await;
    // Its first claim (which finds nothing) must be over, so only a notification can wake it: once
    // it holds its leases, its connection goes idle after the claim.
    f.wait_until_zero(
        "SELECT 1 - count(*) FROM pg_stat_activity a WHERE a.state = 'idle' AND a.query LIKE '%WITH gate AS%' \
           AND a.pid IN (SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted \
             AND classid = hashtext('outbox-relay:' || 'outbox'::regclass::oid::text)::oid)",
        Duration::from_secs(30),
    )
    .await;

    let txn = f.db.begin().await.unwrap();
    Rang { bell: 1 }.record(&txn).await.unwrap();
    txn.commit().await.unwrap();
    f.wait_until_drained(Duration::from_secs(30)).await;
    shutdown.cancel();
    running.await.unwrap();
    assert_eq!(sink.messages().len(), 1);
}
