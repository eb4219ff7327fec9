use seaorm_outbox::OutboxEvent;
use serde::Serialize;

#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate = "order", key = "order_id", table = "Billing.Outbox")]
struct OrderCreated {
    order_id: u64,
}

#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate = "order", key = "order_id", table = "a.b.outbox")]
struct OrderShipped {
    order_id: u64,
}

fn main() {}
