use seaorm_outbox::OutboxEvent;
use serde::Serialize;

#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate = "order", key = "orderid")]
struct OrderCreated {
    order_id: u64,
    total_cents: i64,
}

fn main() {}
