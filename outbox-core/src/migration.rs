//! The schema as sea-orm-migration migrations.
//!
//! Add them to your own `Migrator`:
//!
//! ```no_run
//! use sea_orm_migration::prelude::*;
//!
//! pub struct Migrator;
//!
//! impl MigratorTrait for Migrator {
//!     fn migrations() -> Vec<Box<dyn MigrationTrait>> {
//!         let mut all = seaorm_outbox::migration::migrations();
//!         // all.push(Box::new(m20260101_create_orders::Migration));
//!         all
//!     }
//! }
//! ```
//!
//! Or run only the outbox's with [`Migrator`], which keeps its own history table.

use crate::TableName;
use crate::schema::{STEPS, SchemaStep};
use sea_orm_migration::prelude::*;

/// One [`SchemaStep`] on one outbox table, as a migration.
#[derive(Debug)]
pub struct Migration {
    step: &'static SchemaStep,
    table: TableName,
    /// The step's name, and for another table than the default `@` and the table's name.
    name: String,
}

impl MigrationName for Migration {
    fn name(&self) -> &str {
        &self.name
    }
}

// async_trait's expansion must match the trait's elided lifetime on SchemaManager.
#[allow(elided_lifetimes_in_paths)]
#[sea_orm_migration::async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        let sql = self
            .step
            .up_on(manager.get_database_backend(), &self.table)
            .map_err(|e| DbErr::Migration(e.to_string()))?;
        manager.get_connection().execute_unprepared(&sql).await?;
        Ok(())
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        let sql = self
            .step
            .down_on(manager.get_database_backend(), &self.table)
            .map_err(|e| DbErr::Migration(e.to_string()))?;
        manager.get_connection().execute_unprepared(&sql).await?;
        Ok(())
    }
}

/// Every outbox migration of the default table (`outbox`) and the inbox, oldest first, to add to
/// your `Migrator`.
pub fn migrations() -> Vec<Box<dyn MigrationTrait>> {
    migrations_for(&TableName::DEFAULT)
}

/// Every migration of the outbox table `table`, oldest first, to add to your `Migrator` beside
/// (or instead of) [`migrations`]: each is named after its step and, for another table than the
/// default, `@` and the table (`m0001_outbox@billing_outbox`), so each table's history is its own.
/// The first also creates the inbox (`processed_events`) if it is missing.
///
/// ```
/// use sea_orm_migration::MigrationName;
/// use seaorm_outbox::TableName;
///
/// let billing = seaorm_outbox::migration::migrations_for(&TableName::new("billing_outbox")?);
/// assert_eq!(billing[0].name(), "m0001_outbox@billing_outbox");
/// # Ok::<(), seaorm_outbox::InvalidTableName>(())
/// ```
pub fn migrations_for(table: &TableName) -> Vec<Box<dyn MigrationTrait>> {
    STEPS
        .iter()
        .map(|step| {
            let name = if table.is_default() {
                step.name.to_owned()
            } else {
                format!("{}@{table}", step.name)
            };
            Box::new(Migration {
                step,
                table: table.clone(),
                name,
            }) as Box<dyn MigrationTrait>
        })
        .collect()
}

/// A migrator of the outbox's tables alone, with its history in `outbox_migrations`.
///
/// ```no_run
/// use sea_orm_migration::MigratorTrait;
/// # async fn f(db: &sea_orm::DatabaseConnection) -> Result<(), sea_orm::DbErr> {
/// seaorm_outbox::migration::Migrator::up(db, None).await?;
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct Migrator;

#[sea_orm_migration::async_trait::async_trait]
impl MigratorTrait for Migrator {
    fn migrations() -> Vec<Box<dyn MigrationTrait>> {
        migrations()
    }

    fn migration_table_name() -> DynIden {
        "outbox_migrations".into_iden()
    }
}

/// Creates or upgrades the outbox tables on `db`: runs [`Migrator`]'s pending migrations.
///
/// ```no_run
/// # async fn f(db: &sea_orm::DatabaseConnection) -> Result<(), sea_orm::DbErr> {
/// seaorm_outbox::migration::migrate(db).await?;
/// # Ok(()) }
/// ```
pub async fn migrate(db: &sea_orm::DatabaseConnection) -> Result<(), DbErr> {
    Migrator::up(db, None).await
}

/// Creates or upgrades the outbox table `table` on `db` (and the inbox, if missing): for the
/// default table, [`migrate`]; for another, the same steps on that table, each applied once, its
/// history in a table of its own beside it (`<name>_migrations`, in the table's schema), so each
/// outbox table is migrated on its own.
///
/// ```no_run
/// use seaorm_outbox::TableName;
/// # async fn f(db: &sea_orm::DatabaseConnection) -> Result<(), Box<dyn std::error::Error>> {
/// seaorm_outbox::migration::migrate_table(db, &TableName::new("billing_outbox")?).await?;
/// # Ok(()) }
/// ```
pub async fn migrate_table(
    db: &sea_orm::DatabaseConnection,
    table: &TableName,
) -> Result<(), DbErr> {
    use sea_orm::{ConnectionTrait, DbBackend, Statement, TransactionTrait};
    if table.is_default() {
        return migrate(db).await;
    }
    let backend = db.get_database_backend();
    let (quote, placeholder) = match backend {
        DbBackend::MySql => ('`', "?"),
        DbBackend::Sqlite => ('"', "?"),
        _ => ('"', "$1"),
    };
    let history = TableName::new(match table.schema() {
        Some(schema) => format!("{schema}.{}_migrations", table.name()),
        None => format!("{}_migrations", table.name()),
    })
    .map_err(|e| DbErr::Migration(e.to_string()))?
    .quoted(quote);
    db.execute_unprepared(&format!(
        "CREATE TABLE IF NOT EXISTS {history} (version varchar(255) NOT NULL PRIMARY KEY, \
         applied_at bigint NOT NULL)"
    ))
    .await?;
    for step in STEPS {
        let version = format!("{}@{table}", step.name);
        let sql = step
            .up_on(backend, table)
            .map_err(|e| DbErr::Migration(e.to_string()))?;
        // One transaction a step where the database has transactional DDL (MySQL commits each
        // DDL statement: a step cut short there is completed by running it again).
        let txn = db.begin().await?;
        let applied = txn
            .query_one_raw(Statement::from_sql_and_values(
                backend,
                format!("SELECT version FROM {history} WHERE version = {placeholder}"),
                [version.clone().into()],
            ))
            .await?
            .is_some();
        if !applied {
            txn.execute_unprepared(&sql).await?;
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| {
                    <i64 as std::convert::TryFrom<u64>>::try_from(d.as_secs()).unwrap_or(i64::MAX)
                });
            let values = match backend {
                DbBackend::Postgres => "($1, $2)",
                _ => "(?, ?)",
            };
            txn.execute_raw(Statement::from_sql_and_values(
                backend,
                format!("INSERT INTO {history} (version, applied_at) VALUES {values}"),
                [version.into(), now.into()],
            ))
            .await?;
        }
        txn.commit().await?;
    }
    Ok(())
}

/// Creates or upgrades the outbox table `table` on PostgreSQL in the partitioned layout (see
/// [`schema::partitioned`](crate::schema::partitioned)): creates it ranged by `created_at` when it
/// is missing, then runs [`migrate_table`]. The relay makes the partitions ahead of time; until it
/// has, rows go to the default partition. An existing table that is not partitioned is an error:
/// converting one is not supported (copy its unpublished rows into a new table instead).
///
/// ```no_run
/// use seaorm_outbox::TableName;
/// # async fn f(db: &sea_orm::DatabaseConnection) -> Result<(), Box<dyn std::error::Error>> {
/// seaorm_outbox::migration::migrate_partitioned(db, &TableName::DEFAULT).await?;
/// # Ok(()) }
/// ```
pub async fn migrate_partitioned(
    db: &sea_orm::DatabaseConnection,
    table: &TableName,
) -> Result<(), DbErr> {
    use sea_orm::{ConnectionTrait, DbBackend, Statement};
    let backend = db.get_database_backend();
    if backend != DbBackend::Postgres {
        return Err(DbErr::Migration(format!(
            "the partitioned layout needs PostgreSQL, not {backend:?}"
        )));
    }
    let kind = db
        .query_one_raw(Statement::from_sql_and_values(
            backend,
            "SELECT relkind::text AS kind FROM pg_class WHERE oid = to_regclass($1)",
            [table.quoted('"').into()],
        ))
        .await?
        .map(|row| row.try_get::<String>("", "kind"))
        .transpose()?;
    match kind.as_deref() {
        None => {
            db.execute_unprepared(&crate::schema::partitioned(table))
                .await?;
        }
        Some("p") => {}
        Some(_) => {
            return Err(DbErr::Migration(format!(
                "the outbox table `{table}` exists and is not partitioned; converting a table is \
                 not supported: migrate a new table in the partitioned layout and move the \
                 unpublished rows into it"
            )));
        }
    }
    migrate_table(db, table).await
}
