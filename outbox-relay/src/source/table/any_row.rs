//! Property: whatever values a hand-written row holds (SQLite stores any type in any
//! column), the claim succeeds, returns the row, and the row is either a message or
//! parked with a reason that names what is wrong; settling it by `seq` works.

use super::*;
use crate::routing::{DEFAULT_TOPIC_TEMPLATE, Router};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Value {
    Null,
    Integer(i64),
    Real(f64),
    Text(String),
    Blob(Vec<u8>),
}

fn value() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<i64>().prop_map(Value::Integer),
        any::<f64>().prop_map(Value::Real),
        ".{0,40}".prop_map(Value::Text),
        "\\{\"[a-z]{0,5}\": [0-9]{1,3}\\}".prop_map(Value::Text),
        "[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}".prop_map(Value::Text),
        proptest::collection::vec(any::<u8>(), 0..20).prop_map(Value::Blob),
    ]
}

/// A value for a NOT NULL column.
fn present() -> impl Strategy<Value = Value> {
    value().prop_map(|v| match v {
        Value::Null => Value::Text(String::new()),
        v => v,
    })
}

fn bind<'q>(
    query: sqlx::query::Query<'q, sqlx::Sqlite, sqlx::sqlite::SqliteArguments>,
    value: &Value,
) -> sqlx::query::Query<'q, sqlx::Sqlite, sqlx::sqlite::SqliteArguments> {
    match value.clone() {
        Value::Null => query.bind(None::<String>),
        Value::Integer(n) => query.bind(n),
        Value::Real(x) => query.bind(x),
        Value::Text(t) => query.bind(t),
        Value::Blob(b) => query.bind(b),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]
    #[test]
    fn any_values_are_claimed_and_published_or_parked(
        id in present(), aggregate_type in present(), aggregate_id in present(),
        event_type in present(), event_version in present(), topic in value(),
        payload in present(), headers in value(), created_at in present(),
    ) {
        let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
        runtime.block_on(async {
            let mut conn = SqliteConnection::connect("sqlite::memory:").await.unwrap();
            for step in seaorm_outbox::schema::STEPS {
                let schema = step.up(seaorm_outbox::sea_orm::DbBackend::Sqlite).unwrap();
                sqlx::raw_sql(schema).execute(&mut conn).await.unwrap();
            }
            let mut insert = sqlx::query(
                "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, \
                 event_version, topic, payload, headers, created_at) \
                 VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            );
            for value in [&id, &aggregate_type, &aggregate_id, &event_type,
                          &event_version, &topic, &payload, &headers, &created_at] {
                insert = bind(insert, value);
            }
            insert.execute(&mut conn).await.unwrap();

            let mut table = OutboxTable {
                conn: Connection::Sqlite(conn),
                name: seaorm_outbox::TableName::DEFAULT,
            };
            let limits = Limits { batch_size: 10, max_batch_bytes: 1 << 20, max_payload_bytes: 1 << 20 };
            let claim = table.claim(&limits, &[0], true, &[]).await.expect("the claim never fails");
            assert_eq!(claim.rows.len(), 1);
            let row = &claim.rows[0];
            let router = Router::new(DEFAULT_TOPIC_TEMPLATE, false);
            let mut outcome = Outcome::default();
            match router.message(row) {
                Ok(message) => {
                    assert!(row.defect.is_none());
                    assert_eq!(message.key, row.aggregate_id);
                    assert_eq!(message.payload, row.payload);
                    assert!(serde_json::from_slice::<serde_json::Value>(&message.payload).is_ok());
                    outcome.published.push(row.key());
                }
                Err(reason) => {
                    assert!(!reason.is_empty());
                    outcome.parked.push((row.key(), reason));
                }
            }
            table.settle(&outcome, Mode::Mark, &[]).await.expect("settling by seq works");
            let Connection::Sqlite(conn) = &mut table.conn else { unreachable!() };
            let (done,): (i64,) = sqlx::query_as(
                "SELECT count(*) FROM outbox WHERE published_at IS NOT NULL OR parked_at IS NOT NULL",
            )
            .fetch_one(&mut *conn)
            .await
            .unwrap();
            assert_eq!(done, 1, "the row was settled");
        });
    }
}
