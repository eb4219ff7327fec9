//! The `invoices` table, as a SeaORM entity.

use sea_orm::entity::prelude::*;
use serde::Serialize;

/// An invoice to be paid.
pub const OPEN: &str = "open";
/// The invoice of a cancelled order.
pub const VOID: &str = "void";

/// One invoice per order.
#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, Serialize, serde::Deserialize)]
#[sea_orm(table_name = "invoices")]
pub struct Model {
    /// The order billed.
    #[sea_orm(primary_key, auto_increment = false)]
    pub order_id: String,
    /// Who pays.
    pub customer: String,
    /// The amount, in cents.
    pub amount_cents: i64,
    /// [`OPEN`] or [`VOID`].
    pub status: String,
}

/// Invoices relate to nothing else here.
#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
