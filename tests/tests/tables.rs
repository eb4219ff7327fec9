//! Several outbox tables in one database, on real PostgreSQL, SQLite and MariaDB: each event goes
//! to its type's table (`#[outbox(table = "...")]`) or its `Outbox` value's, atomically with the
//! rest of the transaction; each table is migrated on its own; a schema-qualified table is
//! PostgreSQL's, refused elsewhere with a clear error.

use outbox_tests::{Backend, count, database};
use seaorm_outbox::sea_orm::{ConnectionTrait, DatabaseConnection, DbBackend, TransactionTrait};
use seaorm_outbox::{Error, NewEvent, Outbox, OutboxEvent, TableName};
use serde::Serialize;

#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate = "order", key = "order_id")]
struct OrderPlaced {
    order_id: u64,
}

#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate = "invoice", key = "invoice_id", table = "billing_outbox")]
struct InvoiceIssued {
    invoice_id: u64,
}

fn billing() -> TableName {
    TableName::new("billing_outbox").unwrap()
}

async fn migrate_billing(db: &DatabaseConnection) {
    seaorm_outbox::migration::migrate_table(db, &billing())
        .await
        .expect("migrate billing_outbox");
}

/// (aggregate_type, aggregate_id) of `table`'s rows, in `seq` order.
async fn rows(db: &DatabaseConnection, table: &str) -> Vec<(String, String)> {
    db.query_all_raw(seaorm_outbox::sea_orm::Statement::from_string(
        db.get_database_backend(),
        format!("SELECT aggregate_type, aggregate_id FROM {table} ORDER BY seq"),
    ))
    .await
    .expect("read the table")
    .into_iter()
    .map(|r| {
        (
            r.try_get("", "aggregate_type").unwrap(),
            r.try_get("", "aggregate_id").unwrap(),
        )
    })
    .collect()
}

outbox_tests::on_every_backend!(
    database;
    each_event_goes_to_its_table_in_one_transaction,
    an_outbox_value_names_the_table_of_its_calls,
    each_table_is_migrated_on_its_own,
);

async fn each_event_goes_to_its_table_in_one_transaction(db: DatabaseConnection) {
    migrate_billing(&db).await;
    let txn = db.begin().await.unwrap();
    OrderPlaced { order_id: 1 }.record(&txn).await.unwrap();
    InvoiceIssued { invoice_id: 7 }.record(&txn).await.unwrap();
    // One call, both tables, each table's events in their order.
    let mixed = vec![
        NewEvent::from_event(&InvoiceIssued { invoice_id: 8 }).unwrap(),
        NewEvent::from_event(&OrderPlaced { order_id: 2 }).unwrap(),
        NewEvent::from_event(&InvoiceIssued { invoice_id: 9 }).unwrap(),
    ];
    let ids = seaorm_outbox::record_new_events(&txn, mixed).await.unwrap();
    assert_eq!(ids.len(), 3);
    txn.commit().await.unwrap();
    let order = |id: &str| ("order".to_owned(), id.to_owned());
    let invoice = |id: &str| ("invoice".to_owned(), id.to_owned());
    assert_eq!(rows(&db, "outbox").await, vec![order("1"), order("2")]);
    assert_eq!(
        rows(&db, "billing_outbox").await,
        vec![invoice("7"), invoice("8"), invoice("9")]
    );

    // Rolled back: neither table keeps anything.
    let txn = db.begin().await.unwrap();
    OrderPlaced { order_id: 3 }.record(&txn).await.unwrap();
    InvoiceIssued { invoice_id: 10 }.record(&txn).await.unwrap();
    txn.rollback().await.unwrap();
    assert_eq!(count(&db, "SELECT count(*) AS n FROM outbox").await, 2);
    assert_eq!(
        count(&db, "SELECT count(*) AS n FROM billing_outbox").await,
        3
    );
}

async fn an_outbox_value_names_the_table_of_its_calls(db: DatabaseConnection) {
    migrate_billing(&db).await;
    let outbox = Outbox::default().with_table(billing());
    let txn = db.begin().await.unwrap();
    outbox
        .record(&txn, &OrderPlaced { order_id: 1 })
        .await
        .unwrap();
    outbox
        .record_all(
            &txn,
            &[OrderPlaced { order_id: 2 }, OrderPlaced { order_id: 3 }],
        )
        .await
        .unwrap();
    txn.commit().await.unwrap();
    assert_eq!(count(&db, "SELECT count(*) AS n FROM outbox").await, 0);
    assert_eq!(rows(&db, "billing_outbox").await.len(), 3);

    // A table nobody migrated: the database's error, and the transaction keeps nothing.
    let missing = Outbox::default().with_table(TableName::new("nowhere_outbox").unwrap());
    let txn = db.begin().await.unwrap();
    let err = missing
        .record(&txn, &OrderPlaced { order_id: 4 })
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Database(_)), "{err}");
}

async fn each_table_is_migrated_on_its_own(db: DatabaseConnection) {
    migrate_billing(&db).await;
    // Again: nothing to do, no error.
    migrate_billing(&db).await;
    let history = count(
        &db,
        "SELECT count(*) AS n FROM billing_outbox_migrations WHERE version LIKE 'm%@billing_outbox'",
    )
    .await;
    assert_eq!(history, seaorm_outbox::schema::STEPS.len() as i64);
    // Its objects carry its name; the default table's are still there, untouched.
    let indexes = match db.get_database_backend() {
        DbBackend::Postgres => {
            "SELECT count(*) AS n FROM pg_indexes WHERE schemaname = current_schema() \
             AND tablename = 'billing_outbox' AND indexname LIKE 'billing_outbox_%'"
        }
        DbBackend::Sqlite => {
            "SELECT count(*) AS n FROM sqlite_master WHERE type = 'index' \
             AND tbl_name = 'billing_outbox' AND name LIKE 'billing_outbox_%'"
        }
        _ => {
            "SELECT count(DISTINCT index_name) AS n FROM information_schema.statistics \
             WHERE table_schema = DATABASE() AND table_name = 'billing_outbox' \
             AND index_name LIKE 'billing_outbox_%'"
        }
    };
    assert!(count(&db, indexes).await >= 3, "billing_outbox's indexes");
    assert!(count(&db, &indexes.replace("billing_outbox", "outbox")).await >= 3);
    if db.get_database_backend() == DbBackend::MySql {
        // Its own lock table, with every bucket.
        assert_eq!(
            count(&db, "SELECT count(*) AS n FROM billing_outbox_lock").await,
            65536
        );
    }
}

#[tokio::test]
async fn a_schema_qualified_table_lives_in_its_schema_on_postgres() {
    let (db, schema) = outbox_tests::postgres_schema().await;
    let billing_schema = format!("{schema}_billing");
    db.execute_unprepared(&format!("CREATE SCHEMA {billing_schema}"))
        .await
        .unwrap();
    seaorm_outbox::migration::migrate(&db).await.unwrap();
    let table = TableName::new(format!("{billing_schema}.outbox")).unwrap();
    seaorm_outbox::migration::migrate_table(&db, &table)
        .await
        .unwrap();
    let txn = db.begin().await.unwrap();
    Outbox::default()
        .with_table(table.clone())
        .record(&txn, &OrderPlaced { order_id: 5 })
        .await
        .unwrap();
    txn.commit().await.unwrap();
    assert_eq!(count(&db, "SELECT count(*) AS n FROM outbox").await, 0);
    assert_eq!(
        count(&db, &format!("SELECT count(*) AS n FROM {table}")).await,
        1
    );
    // Its indexes have the default table's names, in its own schema.
    let indexes = count(
        &db,
        &format!(
            "SELECT count(*) AS n FROM pg_indexes WHERE schemaname = '{billing_schema}' \
             AND indexname IN ('outbox_unpublished', 'outbox_published', 'outbox_blocked', 'outbox_held')"
        ),
    )
    .await;
    assert_eq!(indexes, 4);
    // Reverting the table's steps drops its table and leaves the default one and the inbox.
    for step in seaorm_outbox::schema::STEPS.iter().rev() {
        let down = step.down_on(DbBackend::Postgres, &table).unwrap();
        db.execute_unprepared(&down).await.unwrap();
    }
    let tables: Vec<String> = db
        .query_all_raw(seaorm_outbox::sea_orm::Statement::from_string(
            DbBackend::Postgres,
            format!(
                "SELECT schemaname || '.' || tablename AS t FROM pg_tables \
                 WHERE schemaname IN ('{schema}', '{billing_schema}') ORDER BY 1"
            ),
        ))
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.try_get::<String>("", "t").unwrap())
        .collect();
    assert_eq!(
        tables,
        [
            format!("{schema}.outbox"),
            format!("{schema}.outbox_migrations"),
            format!("{schema}.processed_events"),
            format!("{billing_schema}.outbox_migrations"),
        ],
        "the default table and the inbox stay; of the other, only its history"
    );
}

#[tokio::test]
async fn a_schema_qualified_table_is_refused_on_sqlite_and_mariadb() {
    let table = TableName::new("billing.outbox").unwrap();
    for backend in [Backend::SqliteFile, Backend::MariaDb] {
        let db = database(backend).await;
        let txn = db.begin().await.unwrap();
        let err = Outbox::default()
            .with_table(table.clone())
            .record(&txn, &OrderPlaced { order_id: 1 })
            .await
            .unwrap_err();
        assert!(
            matches!(err, Error::SchemaUnsupported { .. }),
            "{backend:?}: {err}"
        );
        assert!(err.to_string().contains("only PostgreSQL"), "{err}");
        let migrated = seaorm_outbox::migration::migrate_table(&db, &table).await;
        assert!(
            migrated.is_err(),
            "{backend:?}: migrated a schema-qualified table"
        );
    }
}
