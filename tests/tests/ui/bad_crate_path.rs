use seaorm_outbox::OutboxEvent;
use serde::Serialize;

#[derive(Serialize, OutboxEvent)]
#[outbox(crate = "not a path", aggregate = "order", key = "order_id")]
struct OrderCreated {
    order_id: u64,
}

fn main() {}
