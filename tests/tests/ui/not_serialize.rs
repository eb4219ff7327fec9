use seaorm_outbox::OutboxEvent;

#[derive(OutboxEvent)]
#[outbox(aggregate = "order", key = "order_id")]
struct OrderCreated {
    order_id: u64,
}

fn main() {}
