//! The test kit itself (`seaorm_outbox::testing`, `seaorm_outbox_relay::testing`), on PostgreSQL,
//! SQLite and MariaDB:
//! what it reads back is what was recorded, a transaction's events are seen inside it and by
//! nobody else before the commit, and a drain waits for the whole backlog and stops at poison.

use seaorm_outbox::sea_orm::{ConnectionTrait, TransactionTrait};
use seaorm_outbox::testing::{RecordedEvent, TestDatabase, recorded, recorded_events};
use seaorm_outbox::{NewEvent, OutboxEvent, assert_recorded};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate = "cart", key = "cart_id", version = 3, topic = "kit.carts")]
struct ItemAdded {
    cart_id: u32,
    sku: String,
}

async fn databases() -> Vec<TestDatabase> {
    let (_, schema) = outbox_tests::postgres_schema().await;
    vec![
        TestDatabase::sqlite()
            .await
            .expect("a SQLite test database"),
        TestDatabase::connect(&outbox_tests::schema_url(&schema))
            .await
            .expect("a PostgreSQL test database"),
        TestDatabase::connect(&outbox_tests::mariadb_database_url().await)
            .await
            .expect("a MariaDB test database"),
    ]
}

#[tokio::test]
async fn recorded_events_reads_back_every_column_and_sees_only_what_the_reader_may_see() {
    for db in databases().await {
        let backend = db.get_database_backend();
        let event = ItemAdded {
            cart_id: 7,
            sku: "tea".into(),
        };
        let txn = db.begin().await.unwrap();
        let id = NewEvent::from_event(&event)
            .unwrap()
            .with_header("tenant", "acme")
            .record(&txn)
            .await
            .unwrap();
        assert_recorded!(&txn, event.clone()); // inside its transaction
        if backend != seaorm_outbox::sea_orm::DbBackend::Sqlite {
            // SeaORM gives SQLite a pool of one connection: the transaction holds it.
            assert!(
                recorded_events(&db).await.unwrap().is_empty(),
                "another connection sees nothing before the commit"
            );
        }
        txn.commit().await.unwrap();

        let [found] = &recorded_events(&db).await.unwrap()[..] else {
            panic!("{backend:?}: one event")
        };
        let RecordedEvent {
            id: found_id,
            aggregate_type,
            aggregate_id,
            event_type,
            event_version,
            topic,
            payload,
            headers,
            published,
            ..
        } = found;
        assert_eq!(*found_id, id, "{backend:?}");
        assert_eq!(
            (
                aggregate_type.as_str(),
                aggregate_id.as_str(),
                event_type.as_str()
            ),
            ("cart", "7", "ItemAdded"),
            "{backend:?}"
        );
        assert_eq!(*event_version, 3, "{backend:?}");
        assert_eq!(topic.as_deref(), Some("kit.carts"), "{backend:?}");
        assert_eq!(
            *payload,
            serde_json::json!({ "cart_id": 7, "sku": "tea" }),
            "{backend:?}"
        );
        assert_eq!(headers["tenant"], "acme", "{backend:?}");
        assert!(!published, "{backend:?}");
        assert_eq!(
            recorded::<ItemAdded, _>(&db).await.unwrap(),
            [event],
            "{backend:?}"
        );

        let drained = seaorm_outbox_relay::testing::drain(db.url()).await.unwrap();
        assert_eq!(drained.on_topic("kit.carts").count(), 1, "{backend:?}");
        assert!(
            recorded_events(&db).await.unwrap()[0].published,
            "{backend:?}"
        );
    }
}

#[tokio::test]
async fn a_drain_waits_for_a_backlog_of_many_batches_and_keeps_each_aggregates_order() {
    for db in databases().await {
        let events: Vec<ItemAdded> = (0..3000)
            .map(|n| ItemAdded {
                cart_id: n % 7,
                sku: format!("sku-{n}"),
            })
            .collect();
        let txn = db.begin().await.unwrap();
        seaorm_outbox::record_all(&txn, &events).await.unwrap();
        txn.commit().await.unwrap();

        let mut config = seaorm_outbox_relay::RelayConfig::new(db.url());
        config.batch_size = 50; // 60 batches: more than one wake-up of the drain's loop
        let drained = seaorm_outbox_relay::testing::drain_with(config)
            .await
            .unwrap();
        assert_eq!(drained.messages.len(), 3000);
        for cart in 0..7 {
            let seqs: Vec<i64> = drained
                .messages
                .iter()
                .filter(|m| m.key == cart.to_string())
                .map(|m| m.seq)
                .collect();
            assert!(seqs.is_sorted(), "cart {cart} out of order: {seqs:?}");
        }
    }
}

#[tokio::test]
async fn a_drain_returns_parked_events_and_leaves_their_aggregates_waiting() {
    let db = TestDatabase::sqlite().await.unwrap();
    // A row another writer left with a payload that is not JSON, then events behind and beside it.
    db.execute_unprepared(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
         VALUES ('018f0000-0000-7000-8000-000000000001', 'cart', '1', 'ItemAdded', 'not json')",
    )
    .await
    .unwrap();
    let txn = db.begin().await.unwrap();
    let behind = ItemAdded {
        cart_id: 1,
        sku: "behind".into(),
    };
    let beside = ItemAdded {
        cart_id: 2,
        sku: "beside".into(),
    };
    seaorm_outbox::record_all(&txn, &[behind, beside])
        .await
        .unwrap();
    txn.commit().await.unwrap();

    let drained = seaorm_outbox_relay::testing::drain(db.url()).await.unwrap();
    let keys: Vec<&str> = drained.messages.iter().map(|m| m.key.as_str()).collect();
    assert_eq!(keys, ["2"], "only the other cart's event goes out");
    let [parked] = &drained.parked[..] else {
        panic!("one parked event: {:?}", drained.parked)
    };
    assert_eq!(parked.aggregate_id, "1");
    assert_eq!(parked.waiting, 1, "cart 1's later event waits behind it");
    let reason = parked.last_error.as_deref().unwrap_or_default();
    assert!(reason.contains("JSON"), "{reason}");
}
