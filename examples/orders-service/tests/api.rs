//! The order API's handlers, tested with the outbox test kit: each answer, the events its
//! transaction recorded (or did not), and what the relay would publish. No broker.

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use seaorm_outbox::assert_recorded;
use seaorm_outbox::testing::{TestDatabase, recorded, recorded_events};
use serde_json::{Value, json};
use shop_events::{OrderCancelled, OrderPlaced, OrderShipped};
use tower::ServiceExt;

async fn service() -> TestDatabase {
    let db = TestDatabase::sqlite().await.expect("a test database");
    orders_service::migrate(&db).await.expect("migrate");
    db
}

/// Sends one request to the service and returns the status and the JSON body.
async fn call(db: &TestDatabase, method: &str, path: &str, body: &str) -> (StatusCode, Value) {
    let request = Request::builder()
        .method(method)
        .uri(path)
        .header("content-type", "application/json")
        .body(Body::from(body.to_owned()))
        .expect("a request");
    let response = orders_service::app(db.connection().clone())
        .oneshot(request)
        .await
        .expect("an answer");
    let status = response.status();
    let bytes = response
        .into_body()
        .collect()
        .await
        .expect("a body")
        .to_bytes();
    let value = serde_json::from_slice(&bytes).unwrap_or_else(|_| {
        panic!(
            "{method} {path} answered {status} with a body that is not JSON: {:?}",
            String::from_utf8_lossy(&bytes)
        )
    });
    (status, value)
}

async fn place(db: &TestDatabase, customer: &str, total_cents: i64) -> String {
    let body = json!({ "customer": customer, "total_cents": total_cents }).to_string();
    let (status, order) = call(db, "POST", "/orders", &body).await;
    assert_eq!(status, StatusCode::CREATED, "{order}");
    order["id"].as_str().expect("an order id").to_owned()
}

#[tokio::test]
async fn placing_an_order_records_order_placed_in_its_transaction() {
    let db = service().await;
    let id = place(&db, "ada", 1999).await;

    assert_recorded!(
        &db,
        OrderPlaced {
            order_id: id.clone(),
            customer: "ada".into(),
            total_cents: 1999,
        }
    );
    let (status, order) = call(&db, "GET", &format!("/orders/{id}"), "").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(order["status"], "placed");
    assert_eq!(order["total_cents"], 1999);

    // What the relay publishes for it: the order topic, keyed by the order id.
    let drained = seaorm_outbox_relay::testing::drain(db.url())
        .await
        .expect("drain");
    let [message] = &drained.messages[..] else {
        panic!("one message: {drained:?}")
    };
    assert_eq!(message.topic, "outbox.event.order");
    assert_eq!(message.key, id);
    let envelope = seaorm_outbox_relay::testing::envelope(message).expect("an envelope");
    assert_eq!(envelope.decode::<OrderPlaced>().unwrap().customer, "ada");
}

#[tokio::test]
async fn invalid_orders_answer_422_with_a_json_error_and_record_nothing() {
    let db = service().await;
    for (body, says) in [
        (
            r#"{"customer": "ada", "total_cents": -5}"#,
            "total_cents must be more than 0",
        ),
        (
            r#"{"customer": "  ", "total_cents": 100}"#,
            "customer must be 1 to 100 characters",
        ),
        (r#"{"customer": "ada"}"#, "missing field `total_cents`"),
        (
            r#"{"customer": "ada", "total_cents": "ten"}"#,
            "total_cents",
        ),
        ("not json", "expected ident"),
    ] {
        let (status, answer) = call(&db, "POST", "/orders", body).await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}: {answer}");
        let error = answer["error"].as_str().unwrap_or_default();
        assert!(
            error.contains(says),
            "{body}: {error:?} should say {says:?}"
        );
    }
    let events = recorded_events(db.connection()).await.unwrap();
    assert!(events.is_empty(), "nothing recorded: {events:?}");
}

#[tokio::test]
async fn shipping_records_order_shipped_once_and_a_shipped_order_cannot_be_cancelled() {
    let db = service().await;
    let id = place(&db, "grace", 4500).await;

    let (status, _) = call(
        &db,
        "POST",
        &format!("/orders/{id}/ship"),
        r#"{"carrier": "dhl"}"#,
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let (status, again) = call(
        &db,
        "POST",
        &format!("/orders/{id}/ship"),
        r#"{"carrier": "ups"}"#,
    )
    .await;
    assert_eq!(status, StatusCode::CONFLICT, "{again}");
    assert_eq!(again["error"], format!("order {id} is shipped, not placed"));
    let (status, _) = call(
        &db,
        "POST",
        &format!("/orders/{id}/cancel"),
        r#"{"reason": "late"}"#,
    )
    .await;
    assert_eq!(status, StatusCode::CONFLICT);

    let shipped: Vec<OrderShipped> = recorded(db.connection()).await.unwrap();
    assert_eq!(
        shipped,
        [OrderShipped {
            order_id: id.clone(),
            carrier: "dhl".into()
        }]
    );
    let cancelled: Vec<OrderCancelled> = recorded(db.connection()).await.unwrap();
    assert!(cancelled.is_empty(), "{cancelled:?}");

    // The shipping event has a topic of its own (`#[outbox(topic = "shop.shipping")]`).
    let drained = seaorm_outbox_relay::testing::drain(db.url())
        .await
        .expect("drain");
    let topics: Vec<&str> = drained.messages.iter().map(|m| m.topic.as_str()).collect();
    assert_eq!(topics, ["outbox.event.order", "shop.shipping"]);
}

#[tokio::test]
async fn cancelling_records_order_cancelled_and_unknown_orders_answer_404() {
    let db = service().await;
    let id = place(&db, "ada", 700).await;
    let (status, order) = call(
        &db,
        "POST",
        &format!("/orders/{id}/cancel"),
        r#"{"reason": "changed my mind"}"#,
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(order["status"], "cancelled");
    assert_recorded!(
        &db,
        OrderCancelled {
            order_id: id,
            reason: "changed my mind".into()
        }
    );

    for (method, path, body) in [
        ("GET", "/orders/nope", ""),
        ("POST", "/orders/nope/ship", r#"{"carrier": "dhl"}"#),
        ("POST", "/orders/nope/cancel", "{}"),
    ] {
        let (status, answer) = call(&db, method, path, body).await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{method} {path}: {answer}");
        assert_eq!(answer["error"], "no order nope");
    }
    assert_eq!(recorded_events(db.connection()).await.unwrap().len(), 2);
}

#[tokio::test]
#[should_panic(expected = "the OrderPlaced events recorded were:")]
async fn assert_recorded_fails_with_what_was_recorded() {
    let db = service().await;
    place(&db, "ada", 1999).await;
    assert_recorded!(
        &db,
        OrderPlaced {
            order_id: "another".into(),
            customer: "ada".into(),
            total_cents: 1999,
        }
    );
}
