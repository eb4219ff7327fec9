//! The inbox on real PostgreSQL, SQLite and MariaDB: each event's effect applied exactly once per
//! consumer.

use outbox_tests::{Backend, count, database};
use seaorm_outbox::Uuid;
use seaorm_outbox::inbox::{Inbox, InboxError, Processed};
use seaorm_outbox::sea_orm::{ConnectionTrait, DatabaseConnection, DbErr, Statement};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

async fn with_effects(backend: Backend) -> DatabaseConnection {
    let db = database(backend).await;
    db.execute_unprepared("CREATE TABLE effects (event_id TEXT NOT NULL, consumer TEXT NOT NULL)")
        .await
        .unwrap();
    db
}

/// Applies the effect of `event_id` for `inbox`, counting how often the handler ran.
async fn apply(
    db: &DatabaseConnection,
    inbox: &Inbox,
    event_id: Uuid,
    runs: &Arc<AtomicUsize>,
) -> Result<Processed<()>, InboxError<DbErr>> {
    let runs = runs.clone();
    let consumer = format!("{inbox:?}");
    inbox
        .process(db, event_id, move |txn| {
            Box::pin(async move {
                runs.fetch_add(1, Ordering::SeqCst);
                let sql = format!(
                    "INSERT INTO effects (event_id, consumer) VALUES ('{event_id}', '{consumer}')"
                );
                txn.execute_raw(Statement::from_string(txn.get_database_backend(), sql))
                    .await?;
                Ok(())
            })
        })
        .await
}

outbox_tests::on_every_backend!(
    with_effects;
    a_redelivered_event_is_a_duplicate_and_its_effect_happens_once,
    a_failing_handler_rolls_back_its_effect_and_the_record,
    each_consumer_applies_an_event_once,
);

async fn a_redelivered_event_is_a_duplicate_and_its_effect_happens_once(db: DatabaseConnection) {
    let (inbox, id, runs) = (
        Inbox::new("billing"),
        Uuid::now_v7(),
        Arc::new(AtomicUsize::new(0)),
    );
    assert_eq!(
        apply(&db, &inbox, id, &runs).await.unwrap(),
        Processed::Applied(())
    );
    assert_eq!(
        apply(&db, &inbox, id, &runs).await.unwrap(),
        Processed::Duplicate
    );
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "the handler does not run for a duplicate"
    );
    assert_eq!(count(&db, "SELECT COUNT(*) AS n FROM effects").await, 1);
    assert_eq!(
        count(&db, "SELECT COUNT(*) AS n FROM processed_events").await,
        1
    );
}

async fn a_failing_handler_rolls_back_its_effect_and_the_record(db: DatabaseConnection) {
    let (inbox, id) = (Inbox::new("billing"), Uuid::now_v7());
    let failed = inbox
        .process(&db, id, |txn| {
            Box::pin(async move {
                let sql = format!("INSERT INTO effects (event_id, consumer) VALUES ('{id}', 'x')");
                txn.execute_raw(Statement::from_string(txn.get_database_backend(), sql))
                    .await?;
                Err::<(), DbErr>(DbErr::Custom("the ledger said no".into()))
            })
        })
        .await;
    assert!(
        matches!(failed, Err(InboxError::Handler(DbErr::Custom(ref m))) if m == "the ledger said no"),
        "{failed:?}"
    );
    assert_eq!(count(&db, "SELECT COUNT(*) AS n FROM effects").await, 0);
    assert_eq!(
        count(&db, "SELECT COUNT(*) AS n FROM processed_events").await,
        0
    );
    // The event is not marked processed, so its redelivery applies it.
    let runs = Arc::new(AtomicUsize::new(0));
    assert_eq!(
        apply(&db, &inbox, id, &runs).await.unwrap(),
        Processed::Applied(())
    );
}

async fn each_consumer_applies_an_event_once(db: DatabaseConnection) {
    let (id, runs) = (Uuid::now_v7(), Arc::new(AtomicUsize::new(0)));
    for consumer in ["billing", "shipping", "billing", "shipping"] {
        let _ = apply(&db, &Inbox::new(consumer), id, &runs).await.unwrap();
    }
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    assert_eq!(count(&db, "SELECT COUNT(*) AS n FROM effects").await, 2);
}

/// Two instances of one consumer receive the same event at the same moment: the second waits on
/// the first's record, then sees a duplicate.
#[tokio::test]
async fn concurrent_deliveries_of_one_event_apply_it_once() {
    concurrent_deliveries(with_effects(Backend::Postgres).await).await;
}

#[tokio::test]
async fn concurrent_deliveries_of_one_event_apply_it_once_on_mariadb() {
    concurrent_deliveries(with_effects(Backend::MariaDb).await).await;
}

async fn concurrent_deliveries(db: DatabaseConnection) {
    let runs = Arc::new(AtomicUsize::new(0));
    for _ in 0..20 {
        let id = Uuid::now_v7();
        let attempts = (0..2).map(|_| {
            let (db, runs) = (db.clone(), runs.clone());
            tokio::spawn(
                async move { apply(&db, &Inbox::new("billing"), id, &runs).await.unwrap() },
            )
        });
        let outcomes: Vec<Processed<()>> = futures::future::join_all(attempts)
            .await
            .into_iter()
            .map(Result::unwrap)
            .collect();
        assert_eq!(
            outcomes
                .iter()
                .filter(|o| **o == Processed::Applied(()))
                .count(),
            1,
            "{outcomes:?}"
        );
    }
    assert_eq!(count(&db, "SELECT COUNT(*) AS n FROM effects").await, 20);
}
