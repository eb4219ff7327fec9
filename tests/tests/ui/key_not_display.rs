use outbox_core::OutboxEvent;
use serde::Serialize;

#[derive(Serialize)]
struct OrderId(u64);

#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate = "order", key = "order_id")]
struct OrderCreated {
    order_id: OrderId,
}

fn main() {}
