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

use crate::{Error, Result, TableName};
use sea_orm::DbBackend;
use std::borrow::Cow;

/// One change to the schema, in every dialect.
#[derive(Debug)]
pub struct SchemaStep {
    /// A stable name, recorded by migration tools.
    pub name: &'static str,
    postgres: &'static str,
    sqlite: &'static str,
    mysql: &'static str,
    postgres_down: &'static str,
    sqlite_down: &'static str,
    mysql_down: &'static str,
    /// What the step reverts of the inbox (`processed_events`, which every outbox table's first
    /// step creates if missing): run with the default table's steps only.
    inbox_down: &'static str,
}

impl SchemaStep {
    /// The SQL that applies this step on `backend`, to the default table (`outbox`): the files in
    /// `sql/`.
    pub fn up(&self, backend: DbBackend) -> Result<&'static str> {
        match backend {
            DbBackend::Postgres => Ok(self.postgres),
            DbBackend::Sqlite => Ok(self.sqlite),
            DbBackend::MySql => Ok(self.mysql),
            other => Err(Error::UnsupportedBackend(other)),
        }
    }

    /// The SQL that applies this step on `backend` to `table`: the same statements, on that
    /// table, its objects named after it (see [`TableName::rewrite`]).
    ///
    /// ```
    /// use sea_orm::DbBackend;
    /// use seaorm_outbox::TableName;
    ///
    /// let table = TableName::new("billing.outbox")?;
    /// let sql = seaorm_outbox::schema::STEPS[0].up_on(DbBackend::Postgres, &table)?;
    /// assert!(sql.contains(r#"CREATE TABLE IF NOT EXISTS "billing"."outbox""#));
    /// # Ok::<(), seaorm_outbox::Error>(())
    /// ```
    pub fn up_on(&self, backend: DbBackend, table: &TableName) -> Result<Cow<'static, str>> {
        let sql = self.up(backend)?;
        Ok(table.rewrite(sql, quote(backend, table)?))
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
    pub fn down(&self, backend: DbBackend) -> Result<Cow<'static, str>> {
        self.down_on(backend, &TableName::DEFAULT)
    }

    /// The SQL that reverts this step on `backend` for `table` (the inbox's part, for the default
    /// table only).
    pub fn down_on(&self, backend: DbBackend, table: &TableName) -> Result<Cow<'static, str>> {
        let sql = match backend {
            DbBackend::Postgres => self.postgres_down,
            DbBackend::Sqlite => self.sqlite_down,
            DbBackend::MySql => self.mysql_down,
            other => return Err(Error::UnsupportedBackend(other)),
        };
        let sql = table.rewrite(sql, quote(backend, table)?);
        Ok(if table.is_default() && !self.inbox_down.is_empty() {
            Cow::Owned(format!("{}{sql}", self.inbox_down))
        } else {
            sql
        })
    }
}

/// The first statement of [`STEPS`]' first step in the partitioned layout (PostgreSQL only,
/// opt-in): `table` created ranged by `created_at`, with its default partition. Run it before the
/// steps, whose `CREATE TABLE IF NOT EXISTS` then leaves this table as it is and whose indexes are
/// made on every partition; the relay makes the partitions of each interval ahead of time and
/// drops those past retention whose rows are all published. The file
/// `sql/postgres-partitioned/0001_outbox.sql` holds the same statements for the default table.
///
/// ```
/// use seaorm_outbox::TableName;
///
/// let sql = seaorm_outbox::schema::partitioned(&TableName::new("billing.outbox")?);
/// assert!(sql.contains("PARTITION BY RANGE (created_at)"));
/// assert!(sql.contains(r#""billing"."outbox_default" PARTITION OF "billing"."outbox" DEFAULT"#));
/// # Ok::<(), seaorm_outbox::InvalidTableName>(())
/// ```
pub fn partitioned(table: &TableName) -> String {
    let sql = table.rewrite(
        include_str!("../sql/postgres-partitioned/0001_outbox.sql"),
        '"',
    );
    match table.schema() {
        // The rewrite names a table's objects without their schema, as indexes are named; a
        // partition is a table, made in the parent's schema only when named there.
        Some(schema) => {
            let partition = format!("\"{}_default\"", table.name());
            sql.replace(&partition, &format!("\"{schema}\".{partition}"))
        }
        None => sql.into_owned(),
    }
}

/// How `backend` quotes an identifier; an error for a schema-qualified table outside PostgreSQL.
fn quote(backend: DbBackend, table: &TableName) -> Result<char> {
    match backend {
        DbBackend::Postgres => Ok('"'),
        DbBackend::Sqlite | DbBackend::MySql if table.schema().is_some() => {
            Err(Error::SchemaUnsupported {
                table: table.clone(),
                backend,
            })
        }
        DbBackend::Sqlite => Ok('"'),
        DbBackend::MySql => Ok('`'),
        other => Err(Error::UnsupportedBackend(other)),
    }
}

/// Every step, oldest first.
pub const STEPS: &[SchemaStep] = &[
    SchemaStep {
        name: "m0001_outbox",
        postgres: include_str!("../sql/postgres/0001_outbox.sql"),
        sqlite: include_str!("../sql/sqlite/0001_outbox.sql"),
        mysql: include_str!("../sql/mysql/0001_outbox.sql"),
        postgres_down: "DROP TABLE IF EXISTS outbox;",
        sqlite_down: "DROP TABLE IF EXISTS outbox;",
        mysql_down: "DROP TABLE IF EXISTS outbox_lock; DROP TABLE IF EXISTS outbox;",
        inbox_down: "DROP TABLE IF EXISTS processed_events; ",
    },
    SchemaStep {
        name: "m0002_held",
        postgres: include_str!("../sql/postgres/0002_held.sql"),
        sqlite: include_str!("../sql/sqlite/0002_held.sql"),
        mysql: include_str!("../sql/mysql/0002_held.sql"),
        // Dropping the column drops its index on PostgreSQL (where the index's name alone may
        // name another schema's); SQLite refuses to drop an indexed column.
        postgres_down: "ALTER TABLE outbox DROP COLUMN recorded; ALTER TABLE outbox DROP COLUMN held_at;",
        sqlite_down: "DROP INDEX IF EXISTS outbox_held; ALTER TABLE outbox DROP COLUMN recorded; \
                      ALTER TABLE outbox DROP COLUMN held_at;",
        mysql_down: "ALTER TABLE outbox DROP COLUMN recorded, DROP COLUMN held_at;",
        inbox_down: "",
    },
    SchemaStep {
        name: "m0003_claimable",
        postgres: include_str!("../sql/postgres/0003_claimable.sql"),
        sqlite: include_str!("../sql/sqlite/0003_claimable.sql"),
        mysql: include_str!("../sql/mysql/0003_claimable.sql"),
        // An index's name alone may name another schema's: the table's own are found by its row
        // type (`NULL::outbox` names the table as every statement here does).
        postgres_down: "DO $$
DECLARE found regclass;
BEGIN
    FOR found IN
        SELECT i.indexrelid::regclass FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
        WHERE i.indrelid = (SELECT t.typrelid FROM pg_type t WHERE t.oid = pg_typeof(NULL::outbox))
          AND (c.relname LIKE '%\\_claimable' OR c.relname LIKE '%\\_retrying')
    LOOP
        EXECUTE format('DROP INDEX %s', found);
    END LOOP;
END $$;",
        sqlite_down: "SELECT 1;",
        mysql_down: "DO 0;",
        inbox_down: "",
    },
    SchemaStep {
        name: "m0004_claim_holds",
        postgres: include_str!("../sql/postgres/0004_claim_holds.sql"),
        sqlite: include_str!("../sql/sqlite/0004_claim_holds.sql"),
        mysql: include_str!("../sql/mysql/0004_claim_holds.sql"),
        postgres_down: "SELECT 1;",
        sqlite_down: "DROP INDEX IF EXISTS outbox_retrying; DROP INDEX IF EXISTS outbox_claimable;",
        mysql_down: "ALTER TABLE outbox DROP KEY outbox_unpublished, \
                     ADD KEY outbox_unpublished (published_at, seq), \
                     DROP KEY outbox_waiting, DROP COLUMN waiting_on;",
        inbox_down: "",
    },
];
