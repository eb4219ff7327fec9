//! With the `opentelemetry` feature, `record` stores the current span's W3C trace context in the
//! event's headers (which the relay forwards to the broker), so a consumer's span can join the
//! producer's trace.

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use outbox_tests::{Backend, database};
use seaorm_outbox::OutboxEvent;
use seaorm_outbox::sea_orm::{ConnectionTrait, DbBackend, Statement, TransactionTrait};
use serde::Serialize;
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;

#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate = "order", key = "order_id")]
struct OrderPaid {
    order_id: u32,
}

#[tokio::test]
async fn record_stores_the_current_trace_context() {
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    let provider = SdkTracerProvider::builder().build();
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("outbox-test")));
    let _guard = tracing::subscriber::set_default(subscriber);
    let db = database(Backend::Postgres).await;

    let span = tracing::info_span!("pay order");
    let trace_id = {
        use opentelemetry::trace::TraceContextExt;
        span.context().span().span_context().trace_id().to_string()
    };
    async {
        let txn = db.begin().await.unwrap();
        OrderPaid { order_id: 5 }.record(&txn).await.unwrap();
        txn.commit().await.unwrap();
    }
    .instrument(span)
    .await;
    // Outside any span: no trace context to store.
    let txn = db.begin().await.unwrap();
    OrderPaid { order_id: 6 }.record(&txn).await.unwrap();
    txn.commit().await.unwrap();

    let headers: Vec<Option<String>> = db
        .query_all_raw(Statement::from_string(
            DbBackend::Postgres,
            "SELECT headers->>'traceparent' FROM outbox ORDER BY seq",
        ))
        .await
        .unwrap()
        .iter()
        .map(|r| r.try_get_by_index(0).unwrap())
        .collect();
    let traceparent = headers[0].as_deref().expect("a traceparent header");
    let parts: Vec<&str> = traceparent.split('-').collect();
    assert_eq!(parts.len(), 4, "{traceparent}");
    assert_eq!(parts[0], "00");
    assert_eq!(parts[1], trace_id, "the header carries the span's trace id");
    assert_eq!(headers[1], None);
}
