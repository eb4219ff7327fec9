use seaorm_outbox::OutboxEvent;

#[derive(OutboxEvent)]
#[outbox(aggregate = "order", key = "order_id")]
union OrderCreated {
    order_id: u64,
    other: i64,
}

fn main() {}
