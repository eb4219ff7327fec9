use seaorm_outbox::{OutboxEvent, Uuid};
use serde::Serialize;

#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate = "order", key = "order_id")]
struct OrderCreated {
    order_id: Uuid,
    customer: String,
    total_cents: i64,
}

fn main() {
    let event = OrderCreated { order_id: Uuid::nil(), customer: "ada".into(), total_cents: 1 };
    assert_eq!(event.aggregate_id(), "00000000-0000-0000-0000-000000000000");
    assert_eq!(OrderCreated::EVENT_TYPE, "OrderCreated");
    assert_eq!(OrderCreated::EVENT_VERSION, 1);
    assert_eq!(OrderCreated::TOPIC, None);
}
