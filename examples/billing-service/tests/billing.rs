//! Billing, tested without a broker: the order service's handlers record events, the test kit
//! drains them through the relay's real routing, and each message goes through the inbox into
//! `apply`, as the consumer loop would hand it; then every message is delivered again.

use axum::body::Body;
use axum::http::{Request, StatusCode};
use billing_service::{CONSUMER, ORDER_TOPIC, apply, invoice};
use http_body_util::BodyExt;
use seaorm_outbox::consumer::Consumed;
use seaorm_outbox::inbox::{Inbox, Processed};
use seaorm_outbox::sea_orm::EntityTrait;
use seaorm_outbox::testing::TestDatabase;
use serde_json::{Value, json};
use tower::ServiceExt;

async fn call(app: axum::Router, method: &str, path: &str, body: Value) -> (StatusCode, Value) {
    let request = Request::builder()
        .method(method)
        .uri(path)
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .expect("a request");
    let response = app.oneshot(request).await.expect("an answer");
    let status = response.status();
    let bytes = response
        .into_body()
        .collect()
        .await
        .expect("a body")
        .to_bytes();
    (status, serde_json::from_slice(&bytes).expect("a JSON body"))
}

/// Delivers every message on the order topic through billing's inbox; returns how many were
/// applied and how many were duplicates.
async fn deliver(
    billing: &TestDatabase,
    drained: &seaorm_outbox_relay::testing::Drained,
) -> (usize, usize) {
    let (mut applied, mut duplicates) = (0, 0);
    for message in drained.on_topic(ORDER_TOPIC) {
        let envelope = seaorm_outbox_relay::testing::envelope(message).expect("an envelope");
        let id = envelope.id;
        let outcome = Inbox::new(CONSUMER)
            .process(billing, id, move |txn| {
                Box::pin(async move { apply(&envelope, txn).await })
            })
            .await
            .expect("billing applies the event");
        match outcome {
            Processed::Applied(()) => applied += 1,
            Processed::Duplicate => duplicates += 1,
        }
    }
    (applied, duplicates)
}

#[tokio::test]
async fn each_order_is_billed_once_and_a_cancelled_order_is_voided() {
    let orders = TestDatabase::sqlite().await.unwrap();
    orders_service::migrate(&orders).await.unwrap();
    let billing = TestDatabase::sqlite().await.unwrap();
    billing_service::migrate(&billing).await.unwrap();
    let orders_api = || orders_service::app(orders.connection().clone());

    let mut ids = Vec::new();
    for (customer, total) in [("ada", 1999), ("grace", 4500)] {
        let (status, order) = call(
            orders_api(),
            "POST",
            "/orders",
            json!({ "customer": customer, "total_cents": total }),
        )
        .await;
        assert_eq!(status, StatusCode::CREATED, "{order}");
        ids.push(order["id"].as_str().unwrap().to_owned());
    }
    let (status, _) = call(
        orders_api(),
        "POST",
        &format!("/orders/{}/ship", ids[0]),
        json!({ "carrier": "dhl" }),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let (status, _) = call(
        orders_api(),
        "POST",
        &format!("/orders/{}/cancel", ids[1]),
        json!({ "reason": "too dear" }),
    )
    .await;
    assert_eq!(status, StatusCode::OK);

    let drained = seaorm_outbox_relay::testing::drain(orders.url())
        .await
        .expect("drain");
    assert!(drained.parked.is_empty(), "{:?}", drained.parked);
    // Placed, placed, cancelled on the order topic; the shipment travels on its own topic.
    assert_eq!(drained.on_topic(ORDER_TOPIC).count(), 3);
    assert_eq!(deliver(&billing, &drained).await, (3, 0));
    // At least once: the same messages again change nothing.
    assert_eq!(deliver(&billing, &drained).await, (0, 3));

    let (_, progress) = tokio::sync::watch::channel(Consumed::default());
    let billing_api = || billing_service::app(billing.connection().clone(), progress.clone());
    let (status, first) = call(
        billing_api(),
        "GET",
        &format!("/invoices/{}", ids[0]),
        Value::Null,
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{first}");
    assert_eq!(first["amount_cents"], 1999);
    assert_eq!(first["status"], invoice::OPEN);
    let (_, second) = call(
        billing_api(),
        "GET",
        &format!("/invoices/{}", ids[1]),
        Value::Null,
    )
    .await;
    assert_eq!(second["customer"], "grace");
    assert_eq!(second["status"], invoice::VOID);
    let (status, none) = call(billing_api(), "GET", "/invoices/nope", Value::Null).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(none["error"], "no invoice for order nope");
}

#[tokio::test]
async fn an_order_placed_event_that_does_not_decode_fails_and_applies_nothing() {
    let billing = TestDatabase::sqlite().await.unwrap();
    billing_service::migrate(&billing).await.unwrap();
    let id = seaorm_outbox::Uuid::now_v7().to_string();
    let headers = [
        ("id", id.as_bytes()),
        ("event_type", &b"OrderPlaced"[..]),
        ("aggregate_type", &b"order"[..]),
        ("event_version", &b"1"[..]),
    ];
    let envelope =
        seaorm_outbox::Envelope::from_parts(Some(b"o-9"), headers, br#"{"order_id": 9}"#).unwrap();
    let id = envelope.id;
    let outcome = Inbox::new(CONSUMER)
        .process(&billing, id, move |txn| {
            Box::pin(async move { apply(&envelope, txn).await })
        })
        .await;
    let error = outcome.expect_err("a payload without customer or total is refused");
    assert!(
        error.to_string().contains("not a valid `OrderPlaced`"),
        "{error}"
    );
    let invoices = invoice::Entity::find()
        .all(billing.connection())
        .await
        .unwrap();
    assert!(invoices.is_empty(), "{invoices:?}");
}
