use seaorm_outbox::OutboxEvent;
use serde::Serialize;

#[derive(Serialize, OutboxEvent)]
#[outbox(
    aggregate = "customer",
    key = "email",
    event_type = "customer.renamed",
    topic = "customers",
    version = 4,
    crate = "seaorm_outbox"
)]
pub struct CustomerRenamed {
    email: String,
    name: String,
}

// Attributes may also be split over several #[outbox] lines; serde attributes work alongside.
#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate = "invoice")]
#[outbox(key = "number")]
#[serde(rename_all = "camelCase")]
struct InvoiceIssued {
    number: i64,
    amount_due: i64,
}

fn main() {
    let event = CustomerRenamed { email: "a@b.c".into(), name: "Ada".into() };
    assert_eq!(event.aggregate_id(), "a@b.c");
    assert_eq!(CustomerRenamed::EVENT_TYPE, "customer.renamed");
    assert_eq!(CustomerRenamed::TOPIC, Some("customers"));
    assert_eq!(CustomerRenamed::EVENT_VERSION, 4);
    assert_eq!(InvoiceIssued { number: -3, amount_due: 5 }.aggregate_id(), "-3");
    assert_eq!(seaorm_outbox::registrations().len(), 2);
}
