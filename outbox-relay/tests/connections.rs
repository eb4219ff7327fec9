//! Operators can see the relay's connections: each one, the LISTEN connection and the background
//! tasks' included, is named `outbox-relay` in `pg_stat_activity`, and all are gone after shutdown.
//! (The only test of its binary, so no other relay's connections are counted.)

mod common;

use common::Fixture;
use std::time::Duration;

#[tokio::test]
async fn every_relay_connection_is_named_and_closed_at_shutdown() {
    let f = Fixture::new().await;
    let mut relay = f.spawn_relay_to(&["--sink", "stdout"], &["--wakeup", "notify"]);
    let named = "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'outbox-relay'";
    // The claiming connection, the LISTEN connection, the backlog sampler and the pruner.
    f.wait_until_zero(
        &format!("SELECT CASE WHEN ({named}) >= 4 THEN 0 ELSE 1 END::bigint"),
        Duration::from_secs(30),
    )
    .await;
    assert_eq!(common::terminate(&mut relay), Some(0));
    f.wait_until_zero(named, Duration::from_secs(30)).await;
}
