//! The order service: an HTTP API whose every state change records its event in the same database
//! transaction, so the event is published if and only if the change committed.
//!
//! | request | effect | event |
//! |---|---|---|
//! | `POST /orders` `{"customer": "ada", "total_cents": 1999}` | creates the order (`201`) | `OrderPlaced` |
//! | `POST /orders/{id}/ship` `{"carrier": "dhl"}` | a placed order ships | `OrderShipped` |
//! | `POST /orders/{id}/cancel` `{"reason": "..."}` | a placed order is cancelled | `OrderCancelled` |
//! | `GET /orders/{id}` | the order | none |
//!
//! Invalid input answers `422` with `{"error": "..."}`, an unknown order `404`, a change the order's
//! state does not allow (shipping a cancelled order) `409`; none of them records anything.

mod error;
pub mod order;

use axum::Router;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::routing::{get, post};
use error::{ApiError, Body};
use sea_orm::sea_query::Expr;
use seaorm_outbox::OutboxEvent;
use seaorm_outbox::sea_orm::{
    ActiveModelTrait, ColumnTrait, ConnectionTrait, DatabaseConnection, DbErr, EntityTrait,
    QueryFilter, Set, TransactionTrait,
};
use serde::Deserialize;
use shop_events::{OrderCancelled, OrderPlaced, OrderShipped};

pub use error::ErrorBody;

/// The service's routes over `db`.
pub fn app(db: DatabaseConnection) -> Router {
    Router::new()
        .route("/orders", post(place_order))
        .route("/orders/{id}", get(get_order))
        .route("/orders/{id}/ship", post(ship_order))
        .route("/orders/{id}/cancel", post(cancel_order))
        .route("/healthz", get(|| async { "ok" }))
        .with_state(db)
}

/// Creates the service's tables (the orders, and the outbox schema) if they are missing.
pub async fn migrate(db: &DatabaseConnection) -> Result<(), DbErr> {
    seaorm_outbox::migration::migrate(db).await?;
    db.execute_unprepared(
        "CREATE TABLE IF NOT EXISTS orders (
             id          VARCHAR(64) PRIMARY KEY,
             customer    VARCHAR(255) NOT NULL,
             total_cents BIGINT NOT NULL,
             status      VARCHAR(32) NOT NULL
         )",
    )
    .await?;
    Ok(())
}

/// `POST /orders`.
#[derive(Debug, Deserialize)]
pub struct PlaceOrder {
    /// Who orders: 1 to 100 characters.
    pub customer: String,
    /// The amount, in cents: more than zero.
    pub total_cents: i64,
}

/// `POST /orders/{id}/ship`.
#[derive(Debug, Deserialize)]
pub struct ShipOrder {
    /// Who carries it: not empty.
    pub carrier: String,
}

/// `POST /orders/{id}/cancel`.
#[derive(Debug, Deserialize)]
pub struct CancelOrder {
    /// Why; may be empty.
    #[serde(default)]
    pub reason: String,
}

async fn place_order(
    State(db): State<DatabaseConnection>,
    Body(request): Body<PlaceOrder>,
) -> Result<(StatusCode, axum::Json<order::Model>), ApiError> {
    let customer = request.customer.trim();
    if customer.is_empty() || customer.chars().count() > 100 {
        return Err(ApiError::Invalid(
            "customer must be 1 to 100 characters".into(),
        ));
    }
    if request.total_cents <= 0 {
        return Err(ApiError::Invalid(format!(
            "total_cents must be more than 0, got {}",
            request.total_cents
        )));
    }
    let id = seaorm_outbox::Uuid::now_v7().to_string();

    let txn = db.begin().await?;
    let placed = order::ActiveModel {
        id: Set(id.clone()),
        customer: Set(customer.to_owned()),
        total_cents: Set(request.total_cents),
        status: Set(order::PLACED.into()),
    }
    .insert(&txn)
    .await?;
    OrderPlaced {
        order_id: id,
        customer: placed.customer.clone(),
        total_cents: placed.total_cents,
    }
    .record(&txn)
    .await?;
    txn.commit().await?;
    Ok((StatusCode::CREATED, axum::Json(placed)))
}

async fn get_order(
    State(db): State<DatabaseConnection>,
    Path(id): Path<String>,
) -> Result<axum::Json<order::Model>, ApiError> {
    let found = order::Entity::find_by_id(id.clone()).one(&db).await?;
    found.map(axum::Json).ok_or(ApiError::NotFound(id))
}

async fn ship_order(
    State(db): State<DatabaseConnection>,
    Path(id): Path<String>,
    Body(request): Body<ShipOrder>,
) -> Result<axum::Json<order::Model>, ApiError> {
    let carrier = request.carrier.trim();
    if carrier.is_empty() {
        return Err(ApiError::Invalid("carrier must not be empty".into()));
    }
    let event = OrderShipped {
        order_id: id.clone(),
        carrier: carrier.to_owned(),
    };
    change_status(&db, &id, order::SHIPPED, &event).await
}

async fn cancel_order(
    State(db): State<DatabaseConnection>,
    Path(id): Path<String>,
    Body(request): Body<CancelOrder>,
) -> Result<axum::Json<order::Model>, ApiError> {
    let event = OrderCancelled {
        order_id: id.clone(),
        reason: request.reason.trim().to_owned(),
    };
    change_status(&db, &id, order::CANCELLED, &event).await
}

/// Moves a placed order to `status` and records `event`, in one transaction. The update's
/// condition (`status = 'placed'`) decides: of two concurrent requests on one order, one wins and
/// the other gets `409`, and only the winner's event is recorded.
async fn change_status(
    db: &DatabaseConnection,
    id: &str,
    status: &str,
    event: &impl OutboxEvent,
) -> Result<axum::Json<order::Model>, ApiError> {
    let txn = db.begin().await?;
    let changed = order::Entity::update_many()
        .col_expr(order::Column::Status, Expr::value(status))
        .filter(order::Column::Id.eq(id))
        .filter(order::Column::Status.eq(order::PLACED))
        .exec(&txn)
        .await?;
    let Some(current) = order::Entity::find_by_id(id).one(&txn).await? else {
        return Err(ApiError::NotFound(id.to_owned()));
    };
    if changed.rows_affected == 0 {
        return Err(ApiError::Conflict(format!(
            "order {id} is {}, not {}",
            current.status,
            order::PLACED
        )));
    }
    event.record(&txn).await?;
    txn.commit().await?;
    Ok(axum::Json(current))
}
