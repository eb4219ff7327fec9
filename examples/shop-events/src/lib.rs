//! The events of an example shop. Services record them; the shop's relay links this crate so it
//! knows their topics; consumers decode them.

use seaorm_outbox::OutboxEvent;
use serde::{Deserialize, Serialize};

/// A customer placed an order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate = "order", key = "order_id")]
pub struct OrderPlaced {
    /// The order.
    pub order_id: String,
    /// Who ordered.
    pub customer: String,
    /// The amount, in cents.
    pub total_cents: i64,
}

/// A customer cancelled an order before it shipped.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate = "order", key = "order_id")]
pub struct OrderCancelled {
    /// The order.
    pub order_id: String,
    /// Why, in the customer's words.
    pub reason: String,
}

/// An order left the warehouse. Shipping has a topic of its own.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate = "order", key = "order_id", topic = "shop.shipping")]
pub struct OrderShipped {
    /// The order.
    pub order_id: String,
    /// Who carries it.
    pub carrier: String,
}

/// A payment went through.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, OutboxEvent)]
#[outbox(
    aggregate = "payment",
    key = "payment_id",
    event_type = "payment.captured",
    version = 2
)]
pub struct PaymentCaptured {
    /// The payment.
    pub payment_id: u64,
    /// The order it pays.
    pub order_id: String,
}
