//! The outbox schema as plain SQL, one step per file, for PostgreSQL, SQLite and MySQL/MariaDB.
//!
//! [`migration`](crate::migration) runs these same steps through sea-orm-migration; teams that
//! manage their schema elsewhere apply the files in `sql/` themselves.
//!
//! ```
//! use seaorm_outbox::schema;
//! use sea_orm::DbBackend;
//!
//! let first = &schema::STEPS[0];
//! assert!(first.up(DbBackend::Postgres)?.contains("CREATE TABLE IF NOT EXISTS outbox"));
//! # Ok::<(), seaorm_outbox::Error>(())
//! ```

use crate::{Error, Result};
use sea_orm::DbBackend;

/// One change to the schema, in every dialect.
#[derive(Debug)]
pub struct SchemaStep {
    /// A stable name, recorded by migration tools.
    pub name: &'static str,
    postgres: &'static str,
    sqlite: &'static str,
    mysql: &'static str,
    down: &'static str,
    mysql_down: &'static str,
}

impl SchemaStep {
    /// The SQL that applies this step on `backend`.
    pub fn up(&self, backend: DbBackend) -> Result<&'static str> {
        match backend {
            DbBackend::Postgres => Ok(self.postgres),
            DbBackend::Sqlite => Ok(self.sqlite),
            DbBackend::MySql => Ok(self.mysql),
            other => Err(Error::UnsupportedBackend(other)),
        }
    }

    /// The SQL that reverts this step on `backend`.
    ///
    /// ```
    /// use sea_orm::DbBackend;
    ///
    /// let first = &seaorm_outbox::schema::STEPS[0];
    /// assert!(first.down(DbBackend::MySql)?.contains("DROP TABLE IF EXISTS outbox_lock"));
    /// # Ok::<(), seaorm_outbox::Error>(())
    /// ```
    pub fn down(&self, backend: DbBackend) -> Result<&'static str> {
        match backend {
            DbBackend::Postgres | DbBackend::Sqlite => Ok(self.down),
            DbBackend::MySql => Ok(self.mysql_down),
            other => Err(Error::UnsupportedBackend(other)),
        }
    }
}

/// Every step, oldest first.
pub const STEPS: &[SchemaStep] = &[
    SchemaStep {
        name: "m0001_outbox",
        postgres: include_str!("../sql/postgres/0001_outbox.sql"),
        sqlite: include_str!("../sql/sqlite/0001_outbox.sql"),
        mysql: include_str!("../sql/mysql/0001_outbox.sql"),
        down: "DROP TABLE IF EXISTS processed_events; DROP TABLE IF EXISTS outbox;",
        mysql_down: "DROP TABLE IF EXISTS processed_events; DROP TABLE IF EXISTS outbox_lock; \
                     DROP TABLE IF EXISTS outbox;",
    },
    SchemaStep {
        name: "m0002_held",
        postgres: include_str!("../sql/postgres/0002_held.sql"),
        sqlite: include_str!("../sql/sqlite/0002_held.sql"),
        mysql: include_str!("../sql/mysql/0002_held.sql"),
        down: "DROP INDEX IF EXISTS outbox_held; ALTER TABLE outbox DROP COLUMN recorded; \
               ALTER TABLE outbox DROP COLUMN held_at;",
        mysql_down: "ALTER TABLE outbox DROP COLUMN recorded, DROP COLUMN held_at;",
    },
];
