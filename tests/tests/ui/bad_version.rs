use seaorm_outbox::OutboxEvent;
use serde::Serialize;

#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate = "order", key = "order_id", version = 0)]
struct OrderCreated {
    order_id: u64,
}

fn main() {}
