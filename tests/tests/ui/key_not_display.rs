use seaorm_outbox::OutboxEvent;
use serde::Serialize;

#[derive(Serialize)]
struct OrderId(u64);

#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate = "order", key = "order_id")]
struct OrderCreated {
    order_id: OrderId,
}

fn main() {}
