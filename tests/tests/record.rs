//! `record` and `record_all` on real PostgreSQL, SQLite (file and in-memory) and MariaDB: atomic
//! with the business change, stored exactly as declared.

use outbox_tests::{Backend, count, database};
use seaorm_outbox::sea_orm::{
    ConnectionTrait, DatabaseConnection, DatabaseTransaction, Statement, TransactionTrait,
};
use seaorm_outbox::{Error, NewEvent, OutboxEvent, Uuid};
use serde::Serialize;
use serde_json::{Value, json};

#[derive(Serialize, OutboxEvent, Debug)]
#[outbox(aggregate = "order", key = "order_id")]
struct OrderCreated {
    order_id: Uuid,
    customer: String,
    total_cents: i64,
}

#[derive(Serialize, OutboxEvent)]
#[outbox(
    aggregate = "order",
    key = "order_id",
    event_type = "order.shipped",
    topic = "shipping",
    version = 3
)]
struct OrderShipped {
    order_id: u64,
    carrier: String,
}

/// Serializing it always fails, as a map with non-string keys does in real code.
#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate = "order", key = "order_id")]
struct Unserializable {
    order_id: u64,
    by_pair: std::collections::HashMap<(u8, u8), u8>,
}

fn order_created() -> OrderCreated {
    OrderCreated {
        order_id: Uuid::now_v7(),
        customer: "ada".into(),
        total_cents: 1999,
    }
}

async fn insert_order(
    txn: &DatabaseTransaction,
    id: &str,
) -> Result<(), seaorm_outbox::sea_orm::DbErr> {
    txn.execute_raw(Statement::from_sql_and_values(
        txn.get_database_backend(),
        match txn.get_database_backend() {
            seaorm_outbox::sea_orm::DbBackend::Postgres => {
                "INSERT INTO orders (id, total_cents) VALUES ($1, 1999)"
            }
            _ => "INSERT INTO orders (id, total_cents) VALUES (?, 1999)",
        },
        [id.into()],
    ))
    .await
    .map(|_| ())
}

/// A stored outbox row, read back as a consumer of the table would see it.
#[derive(Debug)]
struct Row {
    id: String,
    seq: i64,
    aggregate_type: String,
    aggregate_id: String,
    event_type: String,
    event_version: i32,
    topic: Option<String>,
    payload: Value,
    headers: Option<Value>,
    published: bool,
}

async fn rows(db: &DatabaseConnection) -> Vec<Row> {
    // Text casts give one query for both backends.
    let pg = db.get_database_backend() == seaorm_outbox::sea_orm::DbBackend::Postgres;
    let sql = if pg {
        "SELECT id::text AS id, seq, aggregate_type, aggregate_id, event_type, event_version, topic, \
         payload::text AS payload, headers::text AS headers, published_at IS NOT NULL AS published \
         FROM outbox ORDER BY seq"
    } else {
        "SELECT id, seq, aggregate_type, aggregate_id, event_type, event_version, topic, payload, \
         headers, published_at IS NOT NULL AS published FROM outbox ORDER BY seq"
    };
    db.query_all_raw(Statement::from_string(db.get_database_backend(), sql))
        .await
        .expect("read outbox")
        .into_iter()
        .map(|r| Row {
            id: r.try_get("", "id").unwrap(),
            seq: r.try_get("", "seq").unwrap(),
            aggregate_type: r.try_get("", "aggregate_type").unwrap(),
            aggregate_id: r.try_get("", "aggregate_id").unwrap(),
            event_type: r.try_get("", "event_type").unwrap(),
            event_version: r.try_get("", "event_version").unwrap(),
            topic: r.try_get("", "topic").unwrap(),
            payload: serde_json::from_str(&r.try_get::<String>("", "payload").unwrap()).unwrap(),
            headers: r
                .try_get::<Option<String>>("", "headers")
                .unwrap()
                .map(|h| serde_json::from_str(&h).unwrap()),
            published: r.try_get("", "published").unwrap(),
        })
        .collect()
}

outbox_tests::on_every_backend!(
    database;
    commit_keeps_state_and_event,
    rollback_keeps_neither,
    failing_business_statement_leaves_no_event,
    serialization_failure_writes_nothing,
    declared_attributes_are_stored,
    record_all_writes_every_row_in_order,
    mixed_events_and_headers,
    reserved_headers_are_refused_and_nothing_is_written,
    oversize_payloads_are_refused_and_nothing_is_written,
    an_outbox_value_sets_its_own_payload_limit,
);

async fn commit_keeps_state_and_event(db: DatabaseConnection) {
    let event = order_created();
    let txn = db.begin().await.unwrap();
    insert_order(&txn, &event.order_id.to_string())
        .await
        .unwrap();
    let id = event.record(&txn).await.unwrap();
    txn.commit().await.unwrap();

    assert_eq!(count(&db, "SELECT COUNT(*) AS n FROM orders").await, 1);
    let rows = rows(&db).await;
    assert_eq!(rows.len(), 1);
    let row = &rows[0];
    assert_eq!(row.id, id.to_string());
    assert_eq!(id.get_version_num(), 7, "event ids are UUID v7");
    assert_eq!(row.aggregate_type, "order");
    assert_eq!(row.aggregate_id, event.order_id.to_string());
    assert_eq!(row.event_type, "OrderCreated");
    assert_eq!(row.event_version, 1);
    assert_eq!(row.topic, None);
    assert_eq!(row.payload, serde_json::to_value(&event).unwrap());
    assert_eq!(row.headers, None);
    assert!(!row.published);
}

async fn rollback_keeps_neither(db: DatabaseConnection) {
    let event = order_created();
    let txn = db.begin().await.unwrap();
    insert_order(&txn, &event.order_id.to_string())
        .await
        .unwrap();
    event.record(&txn).await.unwrap();
    txn.rollback().await.unwrap();

    assert_eq!(count(&db, "SELECT COUNT(*) AS n FROM orders").await, 0);
    assert_eq!(count(&db, "SELECT COUNT(*) AS n FROM outbox").await, 0);
}

async fn failing_business_statement_leaves_no_event(db: DatabaseConnection) {
    let txn = db.begin().await.unwrap();
    insert_order(&txn, "dup").await.unwrap();
    txn.commit().await.unwrap();

    // The handler records first, then its next statement fails; it returns the error and the
    // transaction is dropped, which rolls it back.
    async fn handler(db: &DatabaseConnection) -> Result<(), Box<dyn std::error::Error>> {
        let txn = db.begin().await?;
        order_created().record(&txn).await?;
        insert_order(&txn, "dup").await?;
        txn.commit().await?;
        Ok(())
    }
    assert!(handler(&db).await.is_err(), "the duplicate order must fail");

    assert_eq!(count(&db, "SELECT COUNT(*) AS n FROM orders").await, 1);
    assert_eq!(count(&db, "SELECT COUNT(*) AS n FROM outbox").await, 0);
}

async fn serialization_failure_writes_nothing(db: DatabaseConnection) {
    let bad = Unserializable {
        order_id: 1,
        by_pair: [((1, 2), 3)].into(),
    };
    let txn = db.begin().await.unwrap();
    let err = bad.record(&txn).await.unwrap_err();
    assert!(
        matches!(&err, Error::Serialize { event_type, .. } if event_type == "Unserializable"),
        "{err:?}"
    );
    // Nothing was written, even inside the still-open transaction.
    assert_eq!(count(&txn, "SELECT COUNT(*) AS n FROM outbox").await, 0);
    let err = seaorm_outbox::record_all(&txn, &[bad]).await.unwrap_err();
    assert!(matches!(err, Error::Serialize { .. }), "{err:?}");
    txn.commit().await.unwrap();
    assert_eq!(count(&db, "SELECT COUNT(*) AS n FROM outbox").await, 0);
}

async fn declared_attributes_are_stored(db: DatabaseConnection) {
    let event = OrderShipped {
        order_id: 77,
        carrier: "dhl".into(),
    };
    let txn = db.begin().await.unwrap();
    event.record(&txn).await.unwrap();
    txn.commit().await.unwrap();

    let row = rows(&db).await.pop().expect("one row");
    assert_eq!(row.aggregate_type, "order");
    assert_eq!(row.aggregate_id, "77");
    assert_eq!(row.event_type, "order.shipped");
    assert_eq!(row.event_version, 3);
    assert_eq!(row.topic.as_deref(), Some("shipping"));
    assert_eq!(row.payload, json!({ "order_id": 77, "carrier": "dhl" }));
}

async fn record_all_writes_every_row_in_order(db: DatabaseConnection) {
    // Aggregate ids out of order, so the insert order cannot come from sorting by key.
    let events: Vec<OrderShipped> = [5u64, 3, 9, 1, 3, 7]
        .into_iter()
        .enumerate()
        .map(|(i, order_id)| OrderShipped {
            order_id,
            carrier: format!("c{i}"),
        })
        .collect();
    let txn = db.begin().await.unwrap();
    let ids = seaorm_outbox::record_all(&txn, &events).await.unwrap();
    assert!(
        seaorm_outbox::record_all::<OrderShipped>(&txn, &[])
            .await
            .unwrap()
            .is_empty()
    );
    txn.commit().await.unwrap();

    let rows = rows(&db).await;
    assert_eq!(rows.len(), events.len());
    for ((row, id), event) in rows.iter().zip(&ids).zip(&events) {
        assert_eq!(row.id, id.to_string());
        assert_eq!(row.aggregate_id, event.order_id.to_string());
        assert_eq!(row.payload, serde_json::to_value(event).unwrap());
    }
    assert!(rows.windows(2).all(|w| w[0].seq < w[1].seq));
}

async fn mixed_events_and_headers(db: DatabaseConnection) {
    let created = order_created();
    let txn = db.begin().await.unwrap();
    let ids = seaorm_outbox::record_new_events(
        &txn,
        vec![
            NewEvent::from_event(&created)
                .unwrap()
                .with_header("tenant", "acme"),
            NewEvent::from_event(&OrderShipped {
                order_id: 1,
                carrier: "ups".into(),
            })
            .unwrap(),
        ],
    )
    .await
    .unwrap();
    let single = NewEvent::from_event(&order_created()).unwrap().with_header(
        "traceparent",
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    );
    let single_id = single.clone().record(&txn).await.unwrap();
    txn.commit().await.unwrap();

    let rows = rows(&db).await;
    assert_eq!(
        rows.iter().map(|r| r.id.clone()).collect::<Vec<_>>(),
        vec![
            ids[0].to_string(),
            ids[1].to_string(),
            single_id.to_string()
        ]
    );
    assert_eq!(rows[0].headers, Some(json!({ "tenant": "acme" })));
    assert_eq!(rows[1].event_type, "order.shipped");
    assert_eq!(rows[1].headers, None);
    assert_eq!(rows[2].headers, Some(json!(single.headers)));
}

async fn reserved_headers_are_refused_and_nothing_is_written(db: DatabaseConnection) {
    for name in seaorm_outbox::RESERVED_HEADERS {
        let txn = db.begin().await.unwrap();
        let good = NewEvent::from_event(&order_created()).unwrap();
        let forged = NewEvent::from_event(&order_created())
            .unwrap()
            .with_header(name, "forged");
        let error = seaorm_outbox::record_new_events(&txn, vec![good, forged])
            .await
            .unwrap_err();
        assert!(
            matches!(&error, seaorm_outbox::Error::ReservedHeader { name: n, .. } if n == name),
            "{error}"
        );
        txn.commit().await.unwrap();
    }
    assert!(rows(&db).await.is_empty(), "an event was written");
}

async fn oversize_payloads_are_refused_and_nothing_is_written(db: DatabaseConnection) {
    let limit = seaorm_outbox::max_payload_bytes();
    assert_eq!(limit, seaorm_outbox::DEFAULT_MAX_PAYLOAD_BYTES);
    let mut huge = order_created();
    huge.customer = "x".repeat(limit);
    let txn = db.begin().await.unwrap();
    let error = huge.record(&txn).await.unwrap_err();
    assert!(
        matches!(&error, Error::PayloadTooLarge { bytes, limit: l, .. } if *bytes > limit && *l == limit),
        "{error}"
    );
    assert!(
        error.to_string().contains("over the limit of 1000000"),
        "{error}"
    );
    let batch = vec![
        NewEvent::from_event(&order_created()).unwrap(),
        NewEvent::from_event(&huge).unwrap(),
    ];
    let error = seaorm_outbox::record_new_events(&txn, batch)
        .await
        .unwrap_err();
    assert!(matches!(error, Error::PayloadTooLarge { .. }), "{error}");
    txn.rollback().await.unwrap();

    // Just under the limit is accepted.
    let mut largest = order_created();
    let overhead = serde_json::to_string(&largest).unwrap().len() - largest.customer.len();
    largest.customer = "x".repeat(limit - overhead);
    let txn = db.begin().await.unwrap();
    largest.record(&txn).await.unwrap();
    txn.commit().await.unwrap();
    assert_eq!(rows(&db).await.len(), 1);
}

/// An `Outbox` value's limit applies to the calls made through it, and only to them: the process's
/// default still governs `event.record(&txn)`.
async fn an_outbox_value_sets_its_own_payload_limit(db: DatabaseConnection) {
    let small = seaorm_outbox::Outbox::default().with_max_payload_bytes(64);
    let mut event = order_created();
    event.customer = "x".repeat(100);
    let txn = db.begin().await.unwrap();
    for error in [
        small.record(&txn, &event).await.unwrap_err(),
        small
            .record_all(&txn, std::slice::from_ref(&event))
            .await
            .unwrap_err(),
        small
            .record_new_events(&txn, vec![NewEvent::from_event(&event).unwrap()])
            .await
            .unwrap_err(),
    ] {
        assert!(
            matches!(error, Error::PayloadTooLarge { limit: 64, .. }),
            "{error}"
        );
    }
    event.record(&txn).await.unwrap();
    let roomy = seaorm_outbox::Outbox::default().with_max_payload_bytes(4096);
    roomy.record(&txn, &event).await.unwrap();
    txn.commit().await.unwrap();
    assert_eq!(rows(&db).await.len(), 2);
    assert_eq!(
        seaorm_outbox::max_payload_bytes(),
        seaorm_outbox::DEFAULT_MAX_PAYLOAD_BYTES,
        "an Outbox value never changes the process's default"
    );
}

/// One process records through two `Outbox` values: rows through the default one, logical
/// messages (read back through a `test_decoding` slot) through another.
#[tokio::test]
async fn outbox_values_record_rows_and_logical_messages_side_by_side() {
    use seaorm_outbox::{Outbox, Recording};
    let db = database(Backend::Postgres).await;
    let slot = format!("s_{}", Uuid::now_v7().simple());
    db.execute_unprepared(&format!(
        "SELECT pg_create_logical_replication_slot('{slot}', 'test_decoding')"
    ))
    .await
    .unwrap();
    let txn = db.begin().await.unwrap();
    let in_a_row = order_created();
    Outbox::default().record(&txn, &in_a_row).await.unwrap();
    let as_message = order_created();
    Outbox::default()
        .with_recording(Recording::LogicalMessage)
        .record(&txn, &as_message)
        .await
        .unwrap();
    txn.commit().await.unwrap();

    let table = rows(&db).await;
    assert_eq!(table.len(), 1, "one row");
    let messages = db
        .query_all_raw(Statement::from_string(
            db.get_database_backend(),
            format!(
                "SELECT data FROM pg_logical_slot_get_changes('{slot}', NULL, NULL) \
                 WHERE data LIKE 'message:%'"
            ),
        ))
        .await
        .unwrap();
    db.execute_unprepared(&format!("SELECT pg_drop_replication_slot('{slot}')"))
        .await
        .unwrap();
    let texts: Vec<String> = messages
        .iter()
        .map(|m| m.try_get_by_index::<String>(0).unwrap())
        .collect();
    assert_eq!(texts.len(), 1, "one logical message: {texts:?}");
    assert!(
        texts[0].contains("prefix: outbox") && texts[0].contains(&as_message.order_id.to_string()),
        "{texts:?}"
    );
    assert!(
        !texts[0].contains(&in_a_row.order_id.to_string()),
        "the row's event is not in the message"
    );
}

#[test]
fn registry_lists_every_derived_type_of_this_binary() {
    let found: Vec<(&str, &str, Option<&str>, i32)> = seaorm_outbox::registrations()
        .into_iter()
        .filter(|r| r.rust_type.starts_with("record::"))
        .map(|r| (r.event_type, r.aggregate_type, r.topic, r.version))
        .collect();
    assert_eq!(
        found,
        vec![
            ("OrderCreated", "order", None, 1),
            ("Unserializable", "order", None, 1),
            ("order.shipped", "order", Some("shipping"), 3),
        ]
    );
    let created = seaorm_outbox::registrations()
        .into_iter()
        .find(|r| r.event_type == "OrderCreated")
        .unwrap();
    assert_eq!(created.rust_type, "record::OrderCreated");
    seaorm_outbox::check_registrations().expect("no event type registered twice");
}

/// On MariaDB the payload and the headers are stored as the text the application serialized (key
/// order, escapes, non-ASCII): MySQL's JSON functions would rewrite them on the way in. And
/// table-less recording, a PostgreSQL feature, is refused there with a clear error.
#[tokio::test]
async fn mariadb_keeps_the_payload_as_serialized() {
    use seaorm_outbox::{Outbox, Recording};
    let db = database(Backend::MariaDb).await;
    let txn = db.begin().await.unwrap();
    let event = NewEvent::from_event(&OrderShipped {
        order_id: 7,
        carrier: "Société \"Générale\" \u{1F69A}".into(),
    })
    .unwrap()
    .with_header("z-last", "1")
    .with_header("a-first", "\u{1F69A}");
    let serialized = serde_json::to_string(&event.payload).unwrap();
    seaorm_outbox::record_new_events(&txn, vec![event])
        .await
        .unwrap();
    let refused = Outbox::default()
        .with_recording(Recording::LogicalMessage)
        .record(&txn, &order_created())
        .await
        .unwrap_err();
    assert!(
        refused.to_string().contains("MySql"),
        "a clear refusal: {refused}"
    );
    // An aggregate id longer than its column is refused, not cut short.
    let mut too_long = NewEvent::from_event(&order_created()).unwrap();
    too_long.aggregate_id = "o".repeat(256);
    let long = seaorm_outbox::record_new_events(&txn, vec![too_long])
        .await
        .unwrap_err();
    assert!(
        matches!(
            long,
            Error::TooLong {
                column: "aggregate_id",
                chars: 256,
                limit: 255,
                ..
            }
        ),
        "{long}"
    );
    txn.commit().await.unwrap();
    let row = db
        .query_one_raw(Statement::from_string(
            db.get_database_backend(),
            "SELECT payload, headers FROM outbox",
        ))
        .await
        .unwrap()
        .unwrap();
    let payload: String = row.try_get("", "payload").unwrap();
    assert_eq!(payload, serialized);
    assert!(payload.contains(r#"Société \"Générale\" 🚚"#), "{payload}");
    let headers: String = row.try_get("", "headers").unwrap();
    assert_eq!(
        serde_json::from_str::<Value>(&headers).unwrap(),
        json!({"z-last": "1", "a-first": "🚚"})
    );
}
