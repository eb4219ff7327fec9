use seaorm_outbox::OutboxEvent;
use serde::Serialize;

#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate, key = "order_id")]
struct OrderCreated {
    order_id: u64,
}

fn main() {}
