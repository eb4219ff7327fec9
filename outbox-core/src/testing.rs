//! A test kit for the code that records events (feature `testing`): a ready database, the events a
//! handler recorded as typed values, and an assertion with a readable failure message.
//!
//! No broker is involved: these read the `outbox` table. To run the relay's real routing over what
//! was recorded, use `seaorm_outbox_relay::testing::drain` (feature `testing` of `seaorm-outbox-relay`).
//!
//! ```
//! use seaorm_outbox::testing::{TestDatabase, recorded};
//! use seaorm_outbox::sea_orm::TransactionTrait;
//! use seaorm_outbox::{OutboxEvent, assert_recorded};
//!
//! #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize, OutboxEvent)]
//! #[outbox(aggregate = "order", key = "order_id")]
//! struct OrderPlaced {
//!     order_id: String,
//!     total_cents: i64,
//! }
//!
//! // The handler under test: its state change and its event, in one transaction.
//! async fn place_order(db: &seaorm_outbox::sea_orm::DatabaseConnection) -> seaorm_outbox::Result<()> {
//!     let txn = db.begin().await?;
//!     OrderPlaced { order_id: "o-1".into(), total_cents: 1999 }.record(&txn).await?;
//!     txn.commit().await?;
//!     Ok(())
//! }
//!
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! let db = TestDatabase::sqlite().await?; // a throwaway database with the outbox schema
//! place_order(&db).await?;
//!
//! assert_recorded!(&db, OrderPlaced { order_id: "o-1".into(), total_cents: 1999 });
//! let placed: Vec<OrderPlaced> = recorded(&db).await?;
//! assert_eq!(placed.len(), 1);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! # }).unwrap();
//! ```

use crate::{Error, OutboxEvent, Result, Uuid};
use sea_orm::{
    ConnectionTrait, Database, DatabaseConnection, DbBackend, DbErr, ExecResult, QueryResult,
    Statement,
};
use serde::de::DeserializeOwned;
use std::collections::BTreeMap;
use std::path::PathBuf;

/// A database with the outbox schema, for tests. Derefs to its [`DatabaseConnection`], so a
/// handler under test takes `&db` as it would take the application's connection.
#[derive(Debug)]
pub struct TestDatabase {
    connection: DatabaseConnection,
    url: String,
    /// The SQLite file this database made, removed on drop.
    file: Option<PathBuf>,
}

impl TestDatabase {
    /// A fresh SQLite database with the outbox schema, in a file of its own under the system's
    /// temporary folder, removed when this is dropped.
    ///
    /// It is a file rather than `sqlite::memory:` because the relay (and anything else given
    /// [`url`](Self::url)) opens connections of its own, and an in-memory database is private to
    /// the connection that made it.
    pub async fn sqlite() -> Result<Self> {
        let path = std::env::temp_dir().join(format!("outbox-test-{}.db", Uuid::now_v7().simple()));
        let url = format!("sqlite://{}?mode=rwc", path.display());
        let mut database = Self::connect(&url).await?;
        database.file = Some(path);
        Ok(database)
    }

    /// Connects to the database at `url` (PostgreSQL, SQLite, or MySQL/MariaDB with the `mysql`
    /// feature) and creates or upgrades the
    /// outbox schema there. The database is not emptied: give each test a database of its own,
    /// or use [`recorded`] filters that tell its events apart.
    pub async fn connect(url: &str) -> Result<Self> {
        let connection = Database::connect(url).await?;
        crate::migration::migrate(&connection).await?;
        Ok(TestDatabase {
            connection,
            url: url.to_owned(),
            file: None,
        })
    }

    /// The database's URL, to hand to a relay or to the service under test.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The connection.
    pub fn connection(&self) -> &DatabaseConnection {
        &self.connection
    }
}

impl std::ops::Deref for TestDatabase {
    type Target = DatabaseConnection;

    fn deref(&self) -> &DatabaseConnection {
        &self.connection
    }
}

/// So that `&db` goes wherever SeaORM takes a connection (`Entity::find().all(&db)`, the kit's
/// functions, your handlers).
#[async_trait::async_trait]
impl ConnectionTrait for TestDatabase {
    fn get_database_backend(&self) -> DbBackend {
        self.connection.get_database_backend()
    }

    async fn execute_raw(&self, stmt: Statement) -> std::result::Result<ExecResult, DbErr> {
        self.connection.execute_raw(stmt).await
    }

    async fn execute_unprepared(&self, sql: &str) -> std::result::Result<ExecResult, DbErr> {
        self.connection.execute_unprepared(sql).await
    }

    async fn query_one_raw(
        &self,
        stmt: Statement,
    ) -> std::result::Result<Option<QueryResult>, DbErr> {
        self.connection.query_one_raw(stmt).await
    }

    async fn query_all_raw(&self, stmt: Statement) -> std::result::Result<Vec<QueryResult>, DbErr> {
        self.connection.query_all_raw(stmt).await
    }

    fn support_returning(&self) -> bool {
        self.connection.support_returning()
    }
}

impl Drop for TestDatabase {
    fn drop(&mut self) {
        if let Some(path) = &self.file {
            for suffix in ["", "-wal", "-shm", ".relay-lock"] {
                let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
            }
        }
    }
}

/// An event as the outbox table holds it, whatever its type.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct RecordedEvent {
    /// The event id.
    pub id: Uuid,
    /// The outbox `seq`: the publish order.
    pub seq: i64,
    /// The aggregate type.
    pub aggregate_type: String,
    /// The aggregate id, the broker message key.
    pub aggregate_id: String,
    /// The event type.
    pub event_type: String,
    /// The payload's schema version.
    pub event_version: i32,
    /// The row's topic override, if any.
    pub topic: Option<String>,
    /// The payload.
    pub payload: serde_json::Value,
    /// The row's own headers (trace context, headers added with `NewEvent::with_header`).
    pub headers: BTreeMap<String, String>,
    /// Whether a relay has published it.
    pub published: bool,
}

/// Every event in the outbox table that `db` sees (a connection, or a transaction before it
/// commits), published or not, in `seq` order.
///
/// Events recorded as logical messages ([`Recording::LogicalMessage`](crate::Recording)) have no
/// row and are not listed.
pub async fn recorded_events<C: ConnectionTrait>(db: &C) -> Result<Vec<RecordedEvent>> {
    let backend = db.get_database_backend();
    let sql = match backend {
        DbBackend::Postgres => {
            "SELECT id::text, seq, aggregate_type, aggregate_id, event_type, event_version, topic, \
             payload::text, headers::text, published_at IS NOT NULL FROM outbox ORDER BY seq"
        }
        DbBackend::Sqlite | DbBackend::MySql => {
            "SELECT id, seq, aggregate_type, aggregate_id, event_type, event_version, topic, \
             payload, headers, published_at IS NOT NULL FROM outbox ORDER BY seq"
        }
        other => return Err(Error::UnsupportedBackend(other)),
    };
    let rows = db
        .query_all_raw(Statement::from_string(backend, sql))
        .await?;
    rows.iter()
        .map(|row| {
            let text = |n: usize| row.try_get_by_index::<String>(n);
            let json = |n: usize| -> Result<serde_json::Value> {
                let text: Option<String> = row.try_get_by_index(n)?;
                match text {
                    None => Ok(serde_json::Value::Null),
                    Some(text) => serde_json::from_str(&text)
                        .map_err(|e| DbErr::Type(format!("outbox column {n}: {e}")).into()),
                }
            };
            let id = text(0)?;
            let headers = match json(8)? {
                serde_json::Value::Object(map) => map
                    .into_iter()
                    .map(|(name, value)| match value {
                        serde_json::Value::String(value) => (name, value),
                        other => (name, other.to_string()),
                    })
                    .collect(),
                _ => BTreeMap::new(),
            };
            Ok(RecordedEvent {
                id: Uuid::parse_str(&id)
                    .map_err(|e| DbErr::Type(format!("outbox id {id:?}: {e}")))?,
                seq: row.try_get_by_index(1)?,
                aggregate_type: text(2)?,
                aggregate_id: text(3)?,
                event_type: text(4)?,
                event_version: row.try_get_by_index(5)?,
                topic: row.try_get_by_index(6)?,
                payload: json(7)?,
                headers,
                published: row.try_get_by_index(9)?,
            })
        })
        .collect()
}

/// The events of type `E` in the outbox table that `db` sees, decoded, in `seq` order.
///
/// A payload that does not decode into `E` (recorded by another version of the type, say) is an
/// error that names the event, not a silently shorter list.
pub async fn recorded<E, C>(db: &C) -> Result<Vec<E>>
where
    E: OutboxEvent + DeserializeOwned,
    C: ConnectionTrait,
{
    recorded_events(db)
        .await?
        .into_iter()
        .filter(|event| event.event_type == E::EVENT_TYPE)
        .map(|event| {
            serde_json::from_value(event.payload).map_err(|source| {
                DbErr::Type(format!(
                    "recorded event {} is not a valid `{}`: {source}",
                    event.id,
                    E::EVENT_TYPE
                ))
                .into()
            })
        })
        .collect()
}

/// Panics, listing what was recorded, unless an event equal to `expected` is in the outbox table
/// that `db` sees. What [`assert_recorded!`](crate::assert_recorded) calls.
#[doc(hidden)]
pub async fn assert_recorded<E, C>(db: &C, expected: &E, location: &str)
where
    E: OutboxEvent + DeserializeOwned + PartialEq + std::fmt::Debug,
    C: ConnectionTrait,
{
    let found: Vec<E> = match recorded(db).await {
        Ok(found) => found,
        Err(e) => panic!("assert_recorded! at {location}: cannot read the outbox: {e}"),
    };
    if found.contains(expected) {
        return;
    }
    let list = if found.is_empty() {
        format!("no {} event was recorded", E::EVENT_TYPE)
    } else {
        let mut list = format!("the {} events recorded were:", E::EVENT_TYPE);
        for event in &found {
            list.push_str(&format!("\n    {event:?}"));
        }
        list
    };
    panic!(
        "assert_recorded! at {location}: expected this {} event in the outbox:\n    {expected:?}\n{list}",
        E::EVENT_TYPE
    );
}

/// Asserts that an event equal to the given one was recorded in the outbox table, as the
/// connection or transaction sees it. On failure the message shows the expected event and every
/// event of its type that was recorded. Use it in an async test; the event type must implement
/// `Deserialize`, `PartialEq` and `Debug`.
///
/// ```
/// # use seaorm_outbox::{OutboxEvent, assert_recorded, testing::TestDatabase};
/// # use seaorm_outbox::sea_orm::TransactionTrait;
/// # #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize, OutboxEvent)]
/// # #[outbox(aggregate = "order", key = "order_id")]
/// # struct OrderShipped { order_id: u32 }
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// let db = TestDatabase::sqlite().await?;
/// let txn = db.begin().await?;
/// OrderShipped { order_id: 7 }.record(&txn).await?;
/// assert_recorded!(&txn, OrderShipped { order_id: 7 }); // seen inside the transaction too
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }).unwrap();
/// ```
#[macro_export]
macro_rules! assert_recorded {
    ($db:expr, $expected:expr $(,)?) => {
        $crate::testing::assert_recorded(
            $db,
            &$expected,
            ::core::concat!(::core::file!(), ":", ::core::line!()),
        )
        .await
    };
}
