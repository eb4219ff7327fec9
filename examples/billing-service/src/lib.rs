//! The billing service: consumes the order events, bills each order once, and shows its invoices.
//!
//! - `OrderPlaced` opens an invoice for the order's total; `OrderCancelled` voids it. Other order
//!   events are not billing's concern and are passed over.
//! - Each event's effect commits in one transaction with its entry in the inbox
//!   (`processed_events`), so a redelivered event is skipped: at-least-once delivery, effects
//!   applied once.
//! - `GET /invoices/{order_id}` answers the invoice, or `404` `{"error": "..."}`; `GET /stats` what
//!   the consumer loop did (`applied`, `duplicates`, `dead_lettered`).

pub mod invoice;

use axum::Router;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::routing::get;
use sea_orm::sea_query::Expr;
use seaorm_outbox::consumer::{Consumed, HandlerError};
use seaorm_outbox::sea_orm::{
    ActiveModelTrait, ColumnTrait, ConnectionTrait, DatabaseConnection, DatabaseTransaction, DbErr,
    EntityTrait, QueryFilter, Set,
};
use seaorm_outbox::{Envelope, OutboxEvent};
use serde_json::json;
use shop_events::{OrderCancelled, OrderPlaced};
use tokio::sync::watch;

/// The topic the order events arrive on (the relay's default route for aggregate `order`).
pub const ORDER_TOPIC: &str = "outbox.event.order";

/// The consumer's name: its inbox and its Kafka consumer group.
pub const CONSUMER: &str = "billing";

/// Creates the service's tables (the invoices, and the inbox's `processed_events`) if missing.
pub async fn migrate(db: &DatabaseConnection) -> Result<(), DbErr> {
    seaorm_outbox::migration::migrate(db).await?;
    db.execute_unprepared(
        "CREATE TABLE IF NOT EXISTS invoices (
             order_id     VARCHAR(64) PRIMARY KEY,
             customer     VARCHAR(255) NOT NULL,
             amount_cents BIGINT NOT NULL,
             status       VARCHAR(32) NOT NULL
         )",
    )
    .await?;
    Ok(())
}

/// Applies one event, inside the inbox's transaction `txn`. The consumer loop calls it once per
/// event id; an error rolls the transaction back and the loop retries.
pub async fn apply(envelope: &Envelope, txn: &DatabaseTransaction) -> Result<(), HandlerError> {
    match envelope.event_type.as_str() {
        OrderPlaced::EVENT_TYPE => {
            let placed: OrderPlaced = envelope.decode()?;
            invoice::ActiveModel {
                order_id: Set(placed.order_id),
                customer: Set(placed.customer),
                amount_cents: Set(placed.total_cents),
                status: Set(invoice::OPEN.into()),
            }
            .insert(txn)
            .await?;
        }
        OrderCancelled::EVENT_TYPE => {
            let cancelled: OrderCancelled = envelope.decode()?;
            invoice::Entity::update_many()
                .col_expr(invoice::Column::Status, Expr::value(invoice::VOID))
                .filter(invoice::Column::OrderId.eq(cancelled.order_id))
                .exec(txn)
                .await?;
        }
        _ => {}
    }
    Ok(())
}

/// The HTTP routes over `db`; `progress` is the consumer loop's.
pub fn app(db: DatabaseConnection, progress: watch::Receiver<Consumed>) -> Router {
    Router::new()
        .route("/invoices/{order_id}", get(get_invoice))
        .with_state(db)
        .route(
            "/stats",
            get(move || {
                let consumed = *progress.borrow();
                async move {
                    axum::Json(json!({
                        "applied": consumed.applied,
                        "duplicates": consumed.duplicates,
                        "dead_lettered": consumed.dead_lettered,
                    }))
                }
            }),
        )
        .route("/healthz", get(|| async { "ok" }))
}

async fn get_invoice(
    State(db): State<DatabaseConnection>,
    Path(order_id): Path<String>,
) -> Result<axum::Json<invoice::Model>, (StatusCode, axum::Json<serde_json::Value>)> {
    let found = invoice::Entity::find_by_id(order_id.clone()).one(&db).await;
    match found {
        Ok(Some(invoice)) => Ok(axum::Json(invoice)),
        Ok(None) => Err((
            StatusCode::NOT_FOUND,
            axum::Json(json!({ "error": format!("no invoice for order {order_id}") })),
        )),
        Err(e) => {
            eprintln!("billing-service: database: {e}");
            Err((
                StatusCode::INTERNAL_SERVER_ERROR,
                axum::Json(json!({ "error": "internal error" })),
            ))
        }
    }
}
