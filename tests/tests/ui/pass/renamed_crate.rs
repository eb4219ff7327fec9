// A crate that depends on outbox-core under another name, as with
// `my_outbox = { package = "outbox-core", ... }` in Cargo.toml.
extern crate seaorm_outbox as my_outbox;

use my_outbox::OutboxEvent;
use serde::Serialize;

#[derive(Serialize, OutboxEvent)]
#[outbox(crate = "my_outbox", aggregate = "order", key = "id")]
struct OrderCreated {
    id: u32,
}

fn main() {
    assert_eq!(OrderCreated { id: 9 }.aggregate_id(), "9");
    assert!(my_outbox::registrations()[0].rust_type.ends_with("::OrderCreated"));
}
