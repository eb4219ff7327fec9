use seaorm_outbox::OutboxEvent;
use serde::Serialize;

// Every problem of one input is reported in the same compile.
#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate = "order", aggregate = "invoice", topik = "orders", version = "1")]
struct OrderCreated {
    order_id: u64,
}

fn main() {}
