//! The `orders` table, as a SeaORM entity.

use sea_orm::entity::prelude::*;
use serde::Serialize;

/// A new order.
pub const PLACED: &str = "placed";
/// An order that left the warehouse.
pub const SHIPPED: &str = "shipped";
/// An order cancelled before it shipped.
pub const CANCELLED: &str = "cancelled";

/// One order.
#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, Serialize, serde::Deserialize)]
#[sea_orm(table_name = "orders")]
pub struct Model {
    /// The order id, a UUID v7.
    #[sea_orm(primary_key, auto_increment = false)]
    pub id: String,
    /// Who ordered.
    pub customer: String,
    /// The amount, in cents.
    pub total_cents: i64,
    /// [`PLACED`], [`SHIPPED`] or [`CANCELLED`].
    pub status: String,
}

/// Orders relate to nothing else here.
#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
