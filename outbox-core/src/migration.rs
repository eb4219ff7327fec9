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

use crate::schema::{STEPS, SchemaStep};
use sea_orm_migration::prelude::*;

/// One [`SchemaStep`] as a migration.
#[derive(Debug)]
pub struct Migration(&'static SchemaStep);

impl MigrationName for Migration {
    fn name(&self) -> &str {
        self.0.name
    }
}

// async_trait's expansion must match the trait's elided lifetime on SchemaManager.
#[allow(elided_lifetimes_in_paths)]
#[sea_orm_migration::async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        let sql = self
            .0
            .up(manager.get_database_backend())
            .map_err(|e| DbErr::Migration(e.to_string()))?;
        manager.get_connection().execute_unprepared(sql).await?;
        Ok(())
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        let sql = self
            .0
            .down(manager.get_database_backend())
            .map_err(|e| DbErr::Migration(e.to_string()))?;
        manager.get_connection().execute_unprepared(sql).await?;
        Ok(())
    }
}

/// Every outbox migration, oldest first, to add to your `Migrator`.
pub fn migrations() -> Vec<Box<dyn MigrationTrait>> {
    STEPS
        .iter()
        .map(|step| Box::new(Migration(step)) as Box<dyn MigrationTrait>)
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
