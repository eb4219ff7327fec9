use seaorm_outbox::OutboxEvent;
use serde::Serialize;

#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate = "order", key = "order_id")]
enum OrderEvent {
    Created { order_id: u64 },
    Cancelled { order_id: u64 },
}

fn main() {}
