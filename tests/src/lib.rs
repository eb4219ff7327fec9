//! Shared set-up for the integration tests: databases to test against, each test isolated.
//!
//! PostgreSQL comes from `DATABASE_URL` and MariaDB from `MARIADB_URL`, which `scripts/test` sets
//! after starting throwaway instances. A test that needs one fails with a message saying so; none
//! is skipped.

pub mod debezium;

use sea_orm::{ConnectOptions, ConnectionTrait, Database, DatabaseConnection, DbBackend};
use std::path::PathBuf;

/// The databases every backend-independent test runs against.
#[derive(Debug, Clone, Copy)]
pub enum Backend {
    /// The PostgreSQL at `DATABASE_URL`, in a fresh schema.
    Postgres,
    /// A SQLite database file in a fresh temporary directory.
    SqliteFile,
    /// An in-memory SQLite database.
    SqliteMemory,
    /// The MariaDB at `MARIADB_URL`, in a fresh database (MySQL's schema).
    MariaDb,
}

/// Runs each scenario (an `async fn(DatabaseConnection)`) on every backend, each on a fresh
/// database made by `setup` (an `async fn(Backend) -> DatabaseConnection`, such as [`database`]):
/// a module per scenario, a test per backend.
#[macro_export]
macro_rules! on_every_backend {
    ($setup:path; $($scenario:ident),* $(,)?) => {$(
        mod $scenario {
            use super::*;
            #[tokio::test]
            async fn postgres() { super::$scenario($setup($crate::Backend::Postgres).await).await }
            #[tokio::test]
            async fn sqlite_file() { super::$scenario($setup($crate::Backend::SqliteFile).await).await }
            #[tokio::test]
            async fn sqlite_memory() { super::$scenario($setup($crate::Backend::SqliteMemory).await).await }
            #[tokio::test]
            async fn mariadb() { super::$scenario($setup($crate::Backend::MariaDb).await).await }
        }
    )*};
}

/// The URL of the test MariaDB, or a panic that says how to get one.
pub fn mariadb_url() -> String {
    std::env::var("MARIADB_URL").unwrap_or_else(|_| {
        panic!(
            "MARIADB_URL is not set: this test needs a real MariaDB. \
             Run `scripts/test`, which starts one and sets it."
        )
    })
}

/// A URL of a new, empty database of the test MariaDB, so tests run in parallel.
pub async fn mariadb_database_url() -> String {
    let url = mariadb_url();
    let name = format!("t_{}", uuid_suffix());
    let admin = connect(ConnectOptions::new(url.clone())).await;
    admin
        .execute_unprepared(&format!("CREATE DATABASE {name}"))
        .await
        .expect("create test database");
    admin.close().await.ok();
    let (server, _) = url.rsplit_once('/').expect("a MariaDB URL with a database");
    format!("{server}/{name}")
}

/// The URL of the test PostgreSQL, or a panic that says how to get one.
pub fn postgres_url() -> String {
    std::env::var("DATABASE_URL").unwrap_or_else(|_| {
        panic!(
            "DATABASE_URL is not set: this test needs a real PostgreSQL. \
             Run `scripts/test`, which starts one and sets it."
        )
    })
}

/// A URL of the test PostgreSQL whose connections use `schema`, for processes such as the relay.
pub fn schema_url(schema: &str) -> String {
    let url = postgres_url();
    let separator = if url.contains('?') { '&' } else { '?' };
    format!("{url}{separator}options=-c%20search_path%3D{schema}")
}

/// A connection to a new, empty PostgreSQL schema of its own, so tests run in parallel.
pub async fn postgres_schema() -> (DatabaseConnection, String) {
    let url = postgres_url();
    let schema = format!("t_{}", uuid_suffix());
    let admin = connect(ConnectOptions::new(url.clone())).await;
    admin
        .execute_unprepared(&format!("CREATE SCHEMA {schema}"))
        .await
        .expect("create test schema");
    admin.close().await.ok();
    let mut options = ConnectOptions::new(url);
    options
        .set_schema_search_path(schema.clone())
        .max_connections(20);
    (connect(options).await, schema)
}

/// A connection to a fresh database of `backend`, without the outbox schema.
pub async fn empty(backend: Backend) -> DatabaseConnection {
    match backend {
        Backend::Postgres => postgres_schema().await.0,
        Backend::SqliteFile => {
            let path = temp_dir().join("outbox.db");
            connect(ConnectOptions::new(format!(
                "sqlite://{}?mode=rwc",
                path.display()
            )))
            .await
        }
        Backend::SqliteMemory => {
            // Each connection to :memory: is its own database: keep exactly one.
            let mut options = ConnectOptions::new("sqlite::memory:");
            options.max_connections(1).min_connections(1);
            connect(options).await
        }
        Backend::MariaDb => {
            let mut options = ConnectOptions::new(mariadb_database_url().await);
            options.max_connections(20);
            connect(options).await
        }
    }
}

/// A connection to a fresh database of `backend` with the outbox schema and an `orders` table.
pub async fn database(backend: Backend) -> DatabaseConnection {
    let db = empty(backend).await;
    seaorm_outbox::migration::migrate(&db)
        .await
        .expect("outbox migrations");
    // MySQL indexes no TEXT without a length.
    let id = if db.get_database_backend() == DbBackend::MySql {
        "VARCHAR(64)"
    } else {
        "TEXT"
    };
    db.execute_unprepared(&format!(
        "CREATE TABLE orders (id {id} PRIMARY KEY, total_cents BIGINT NOT NULL)"
    ))
    .await
    .expect("create orders");
    db
}

async fn connect(mut options: ConnectOptions) -> DatabaseConnection {
    let url = options.get_url().to_owned();
    options.sqlx_logging(false);
    Database::connect(options).await.unwrap_or_else(|e| {
        panic!(
            "cannot connect to {url}: {e}. The tests need it running: \
             `scripts/test` starts every service they use."
        )
    })
}

/// A new directory under the system's temp dir (`scripts/test` points `TMPDIR` at a folder of its
/// run, which it removes at the end).
pub fn temp_dir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("outbox-test-{}", uuid_suffix()));
    std::fs::create_dir_all(&dir).expect("create temp dir");
    dir
}

fn uuid_suffix() -> String {
    seaorm_outbox::Uuid::now_v7().simple().to_string()
}

/// Counts rows with a query returning one integer column `n`.
pub async fn count(db: &impl ConnectionTrait, sql: &str) -> i64 {
    let row = db
        .query_one_raw(sea_orm::Statement::from_string(
            db.get_database_backend(),
            sql,
        ))
        .await
        .expect("count query")
        .expect("one row");
    row.try_get::<i64>("", "n").expect("column n")
}

/// Whether `db` is PostgreSQL.
pub fn is_postgres(db: &impl ConnectionTrait) -> bool {
    db.get_database_backend() == DbBackend::Postgres
}
