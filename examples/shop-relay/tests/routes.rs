//! A user's relay binary lists the event types it links, with their topics.

#[test]
fn routes_lists_the_linked_event_types_with_their_topics() {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_shop-relay"))
        .arg("routes")
        .output()
        .expect("run shop-relay");
    assert!(output.status.success());
    let stdout = String::from_utf8(output.stdout).unwrap();
    let rows: Vec<Vec<&str>> = stdout
        .lines()
        .skip(1)
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(
        rows,
        vec![
            vec![
                "OrderCancelled",
                "order",
                "1",
                "outbox.event.order",
                "shop_events::OrderCancelled"
            ],
            vec![
                "OrderPlaced",
                "order",
                "1",
                "outbox.event.order",
                "shop_events::OrderPlaced"
            ],
            vec![
                "OrderShipped",
                "order",
                "1",
                "shop.shipping",
                "shop_events::OrderShipped"
            ],
            vec![
                "payment.captured",
                "payment",
                "2",
                "outbox.event.payment",
                "shop_events::PaymentCaptured"
            ],
        ],
        "{stdout}"
    );
}
