use seaorm_outbox::OutboxEvent;
use serde::Serialize;

#[derive(Serialize, OutboxEvent)]
struct OrderCreated {
    order_id: u64,
}

fn main() {}
