//! The schema delivered two ways, as sea-orm-migration migrations and as plain SQL files, produces
//! the same tables, columns and indexes, on PostgreSQL, SQLite and MariaDB; and that schema is the
//! one documented (column names outside tools rely on, the index the relay's claim uses).

use outbox_tests::{Backend, empty, mariadb_database_url, postgres_schema};
use seaorm_outbox::sea_orm::{ConnectionTrait, Database, DatabaseConnection, Statement};
use std::path::Path;

/// Applies the shipped SQL files of `dialect` in order, as a team with its own tooling would.
async fn apply_sql_files(db: &DatabaseConnection, dialect: &str) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../outbox-core/sql")
        .join(dialect);
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("read {}: {e}", dir.display()))
        .map(|f| f.unwrap().path())
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no SQL files in {}", dir.display());
    for file in files {
        let sql = std::fs::read_to_string(&file).unwrap();
        db.execute_unprepared(&sql)
            .await
            .unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    }
}

/// Rows of text columns, so two schemas compare with `assert_eq!`.
async fn text_rows(db: &DatabaseConnection, sql: &str) -> Vec<Vec<Option<String>>> {
    db.query_all_raw(Statement::from_string(db.get_database_backend(), sql))
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
        .iter()
        .map(|row| {
            (0..row.column_names().len())
                .map(|i| row.try_get_by_index::<Option<String>>(i).unwrap())
                .collect()
        })
        .collect()
}

struct Described {
    columns: Vec<Vec<Option<String>>>,
    indexes: Vec<Vec<Option<String>>>,
}

impl Described {
    fn column_names(&self, table: &str) -> Vec<&str> {
        self.columns
            .iter()
            .filter(|c| c[0].as_deref() == Some(table))
            .map(|c| c[1].as_deref().unwrap())
            .collect()
    }
}

async fn describe_postgres(db: &DatabaseConnection, schema: &str) -> Described {
    let columns = text_rows(
        db,
        &format!(
            "SELECT table_name::text, column_name::text, data_type::text, is_nullable::text, \
                    column_default::text, is_identity::text, is_generated::text, generation_expression::text \
             FROM information_schema.columns \
             WHERE table_schema = '{schema}' AND table_name <> 'outbox_migrations' \
             ORDER BY table_name, ordinal_position"
        ),
    )
    .await;
    let indexes = text_rows(
        db,
        &format!(
            "SELECT tablename::text, indexname::text, replace(indexdef, '{schema}.', '') \
             FROM pg_indexes WHERE schemaname = '{schema}' AND tablename <> 'outbox_migrations' \
             ORDER BY indexname"
        ),
    )
    .await;
    Described { columns, indexes }
}

async fn describe_sqlite(db: &DatabaseConnection) -> Described {
    let columns = text_rows(
        db,
        "SELECT m.name, p.name, p.type, CAST(p.\"notnull\" AS TEXT), p.dflt_value, CAST(p.pk AS TEXT) \
         FROM sqlite_master m JOIN pragma_table_info(m.name) p \
         WHERE m.type = 'table' AND m.name NOT LIKE 'sqlite_%' AND m.name <> 'outbox_migrations' \
         ORDER BY m.name, p.cid",
    )
    .await;
    let indexes = text_rows(
        db,
        "SELECT tbl_name, name, sql FROM sqlite_master \
         WHERE type = 'index' AND tbl_name <> 'outbox_migrations' ORDER BY name",
    )
    .await;
    Described { columns, indexes }
}

async fn describe_mariadb(db: &DatabaseConnection) -> Described {
    let columns = text_rows(
        db,
        "SELECT table_name, column_name, column_type, is_nullable, column_default, column_key \
         FROM information_schema.columns \
         WHERE table_schema = DATABASE() AND table_name <> 'outbox_migrations' \
         ORDER BY table_name, ordinal_position",
    )
    .await;
    let indexes = text_rows(
        db,
        "SELECT table_name, index_name, \
                GROUP_CONCAT(column_name ORDER BY seq_in_index SEPARATOR ',') \
         FROM information_schema.statistics \
         WHERE table_schema = DATABASE() AND table_name <> 'outbox_migrations' \
         GROUP BY table_name, index_name ORDER BY table_name, index_name",
    )
    .await;
    Described { columns, indexes }
}

const OUTBOX_COLUMNS: [&str; 18] = [
    "id",
    "seq",
    "aggregate_type",
    "aggregate_id",
    "event_type",
    "event_version",
    "topic",
    "payload",
    "headers",
    "shard",
    "attempts",
    "last_error",
    "retry_at",
    "parked_at",
    "held_at",
    "recorded",
    "created_at",
    "published_at",
];

/// Both ways produced the same schema, with the documented tables; returns the row of the partial
/// index `outbox_unpublished`, whose definition each dialect spells its own way. `internal`: the
/// columns a dialect adds for its indexes alone.
fn assert_same_and_documented<'a>(
    a: &'a Described,
    b: &Described,
    internal: &[&str],
) -> &'a [Option<String>] {
    assert_eq!(a.columns, b.columns);
    assert_eq!(a.indexes, b.indexes);
    let mut sorted = a.column_names("outbox");
    sorted.sort_unstable();
    let mut expected = OUTBOX_COLUMNS.to_vec();
    expected.extend(internal);
    expected.sort_unstable();
    assert_eq!(sorted, expected);
    assert_eq!(
        a.column_names("processed_events"),
        ["consumer", "event_id", "processed_at"]
    );
    a.indexes
        .iter()
        .find(|i| i[1].as_deref() == Some("outbox_unpublished"))
        .expect("partial index outbox_unpublished")
}

#[tokio::test]
async fn postgres_partitioned_migration_and_sql_files_agree() {
    let (migrated, migrated_schema) = postgres_schema().await;
    seaorm_outbox::migration::migrate_partitioned(&migrated, &seaorm_outbox::TableName::DEFAULT)
        .await
        .unwrap();
    let (plain, plain_schema) = postgres_schema().await;
    apply_sql_files(&plain, "postgres-partitioned").await;
    apply_sql_files(&plain, "postgres").await;

    let a = describe_postgres(&migrated, &migrated_schema).await;
    let b = describe_postgres(&plain, &plain_schema).await;
    assert_eq!(a.columns, b.columns);
    assert_eq!(a.indexes, b.indexes);
    for db in [&migrated, &plain] {
        let kinds = text_rows(
            db,
            "SELECT relkind::text FROM pg_class WHERE oid IN ('outbox'::regclass, 'outbox_default'::regclass) ORDER BY relname",
        )
        .await;
        assert_eq!(kinds, [[Some("p".to_owned())], [Some("r".to_owned())]]);
    }
    // The plain layout's columns, the same as its migration makes.
    let (unpartitioned, unpartitioned_schema) = postgres_schema().await;
    seaorm_outbox::migration::migrate(&unpartitioned)
        .await
        .unwrap();
    let c = describe_postgres(&unpartitioned, &unpartitioned_schema).await;
    assert_eq!(a.column_names("outbox"), c.column_names("outbox"));
}

#[tokio::test]
async fn postgres_migration_and_sql_files_agree() {
    let (migrated, migrated_schema) = postgres_schema().await;
    seaorm_outbox::migration::migrate(&migrated).await.unwrap();
    let (plain, plain_schema) = postgres_schema().await;
    apply_sql_files(&plain, "postgres").await;

    let a = describe_postgres(&migrated, &migrated_schema).await;
    let b = describe_postgres(&plain, &plain_schema).await;
    let unpublished = assert_same_and_documented(&a, &b, &[]);
    assert_eq!(
        unpublished[2].as_deref(),
        Some(
            "CREATE INDEX outbox_unpublished ON outbox USING btree (seq) WHERE (published_at IS NULL)"
        )
    );
    let column = |name: &str| {
        a.columns
            .iter()
            .find(|c| c[0].as_deref() == Some("outbox") && c[1].as_deref() == Some(name))
            .unwrap()
    };
    assert_eq!(column("payload")[2].as_deref(), Some("jsonb"));
    assert_eq!(column("id")[2].as_deref(), Some("uuid"));
    assert_eq!(
        column("seq")[5].as_deref(),
        Some("YES"),
        "seq is an identity column"
    );
    assert_eq!(
        column("published_at")[3].as_deref(),
        Some("YES"),
        "published_at is nullable"
    );
    assert!(
        a.indexes
            .iter()
            .any(|i| i[1].as_deref() == Some("processed_events_pkey"))
    );
}

#[tokio::test]
async fn sqlite_migration_and_sql_files_agree() {
    let migrated = empty(Backend::SqliteFile).await;
    seaorm_outbox::migration::migrate(&migrated).await.unwrap();
    let plain = empty(Backend::SqliteFile).await;
    apply_sql_files(&plain, "sqlite").await;

    let a = describe_sqlite(&migrated).await;
    let b = describe_sqlite(&plain).await;
    let unpublished = assert_same_and_documented(&a, &b, &[]);
    assert!(
        unpublished[2]
            .as_deref()
            .unwrap()
            .ends_with("WHERE published_at IS NULL")
    );
}

#[tokio::test]
async fn mariadb_migration_and_sql_files_agree() {
    let migrated = Database::connect(mariadb_database_url().await)
        .await
        .unwrap();
    seaorm_outbox::migration::migrate(&migrated).await.unwrap();
    let plain = Database::connect(mariadb_database_url().await)
        .await
        .unwrap();
    apply_sql_files(&plain, "mysql").await;

    let a = describe_mariadb(&migrated).await;
    let b = describe_mariadb(&plain).await;
    // MySQL has no partial index: the claim reads the NULL prefix of this one, in seq order, and
    // probes the aggregates that wait in an index of a column NULL on every other row.
    let unpublished = assert_same_and_documented(&a, &b, &["waiting_on"]);
    assert_eq!(
        unpublished[2].as_deref(),
        Some("published_at,parked_at,held_at,retry_at,seq")
    );
    let column = |name: &str| {
        a.columns
            .iter()
            .find(|c| c[0].as_deref() == Some("outbox") && c[1].as_deref() == Some(name))
            .unwrap()
    };
    assert_eq!(
        column("payload")[2].as_deref(),
        Some("longtext"),
        "the payload is kept as the text the application serialized"
    );
    assert_eq!(column("seq")[5].as_deref(), Some("PRI"));
    assert_eq!(
        text_rows(&migrated, "SELECT CAST(COUNT(*) AS CHAR) FROM outbox_lock").await,
        [[Some("65536".to_owned())]]
    );
}

#[tokio::test]
async fn mariadb_migrations_are_idempotent_and_reversible() {
    let db = Database::connect(mariadb_database_url().await)
        .await
        .unwrap();
    seaorm_outbox::migration::migrate(&db).await.unwrap();
    seaorm_outbox::migration::migrate(&db).await.unwrap();
    use sea_orm_migration::MigratorTrait;
    use seaorm_outbox::migration::Migrator;
    Migrator::down(&db, None).await.unwrap();
    let left = text_rows(
        &db,
        "SELECT table_name FROM information_schema.tables \
         WHERE table_schema = DATABASE() AND table_name <> 'outbox_migrations'",
    )
    .await;
    assert!(left.is_empty(), "down left {left:?}");
}

#[tokio::test]
async fn migrations_are_idempotent_and_reversible() {
    let (db, _) = postgres_schema().await;
    seaorm_outbox::migration::migrate(&db).await.unwrap();
    seaorm_outbox::migration::migrate(&db).await.unwrap();
    use sea_orm_migration::MigratorTrait;
    use seaorm_outbox::migration::Migrator;
    Migrator::down(&db, None).await.unwrap();
    let left = text_rows(
        &db,
        "SELECT table_name::text FROM information_schema.tables \
         WHERE table_schema = current_schema() AND table_name IN ('outbox', 'processed_events')",
    )
    .await;
    assert!(left.is_empty(), "down left {left:?}");
}
