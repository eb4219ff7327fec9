//! SIGTERM in the middle of a backlog: the relay settles the batch in flight, exits 0, every row
//! it marked published really reached Kafka, and everything that reached Kafka is marked.

mod common;

use common::Fixture;
use common::kafka::consume;
use seaorm_outbox::sea_orm::{ConnectionTrait, DbBackend, Statement};
use std::collections::HashSet;
use std::time::Duration;

#[tokio::test]
async fn sigterm_settles_the_batch_in_flight_and_marks_nothing_unsent() {
    let f = Fixture::new().await;
    f.db.execute_unprepared(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
         SELECT gen_random_uuid(), 'item', 'i-' || (g % 100), 'ItemCounted', jsonb_build_object('g', g)
         FROM generate_series(1, 30000) g",
    )
    .await
    .unwrap();

    let mut relay = f.spawn_relay(&["--batch-size", "100"]);
    // Stop it once some, but not all, of the backlog is out.
    f.wait_until_zero(
        "SELECT CASE WHEN count(*) >= 1000 THEN 0 ELSE 1 END::bigint FROM outbox WHERE published_at IS NOT NULL",
        Duration::from_secs(60),
    )
    .await;
    assert_eq!(
        common::terminate(&mut relay),
        Some(0),
        "exit code after SIGTERM"
    );

    let marked: HashSet<String> =
        f.db.query_all_raw(Statement::from_string(
            DbBackend::Postgres,
            "SELECT id::text FROM outbox WHERE published_at IS NOT NULL",
        ))
        .await
        .unwrap()
        .iter()
        .map(|r| r.try_get_by_index(0).unwrap())
        .collect();
    assert!(
        marked.len() < 30_000,
        "the relay was stopped before the end of the backlog"
    );

    let received = consume(&[&f.topic("item")], marked.len(), Duration::from_secs(60)).await;
    let sent: HashSet<String> = received
        .iter()
        .map(|m| m.header("id").unwrap().to_owned())
        .collect();
    let unsent_but_marked: Vec<&String> = marked.difference(&sent).collect();
    assert!(
        unsent_but_marked.is_empty(),
        "marked published but never received: {unsent_but_marked:?}"
    );
    // The batch in flight was settled, not abandoned: everything that reached Kafka is marked.
    let sent_but_unmarked: Vec<&String> = sent.difference(&marked).collect();
    assert!(
        sent_but_unmarked.is_empty(),
        "{} events reached Kafka but were left unmarked: {:?}",
        sent_but_unmarked.len(),
        &sent_but_unmarked[..sent_but_unmarked.len().min(5)]
    );
    assert_eq!(received.len(), marked.len(), "no event was sent twice");
}
