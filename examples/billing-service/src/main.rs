//! `billing-service`: consumes the order events from Kafka at `KAFKA_BROKERS` into the database
//! at `DATABASE_URL`, and serves its invoices on `BILLING_ADDR` (default 127.0.0.1:3001).
//! `BILLING_TOPIC` (default `outbox.event.order`) and `BILLING_CONSUMER` (default `billing`, the
//! inbox and consumer group) can be changed. Stops gracefully on SIGINT or SIGTERM: the event in
//! hand is finished, its offset committed.

use billing_service::{CONSUMER, ORDER_TOPIC};
use seaorm_outbox::consumer::kafka::KafkaConsumer;
use seaorm_outbox::consumer::{ConsumerOptions, PoisonPolicy};
use std::process::ExitCode;
use tokio_util::sync::CancellationToken;

#[tokio::main]
async fn main() -> ExitCode {
    let (Ok(url), Ok(brokers)) = (
        std::env::var("DATABASE_URL"),
        std::env::var("KAFKA_BROKERS"),
    ) else {
        eprintln!("billing-service: DATABASE_URL and KAFKA_BROKERS must be set");
        return ExitCode::from(2);
    };
    let setting =
        |name: &str, default: &str| std::env::var(name).unwrap_or_else(|_| default.into());
    let addr = setting("BILLING_ADDR", "127.0.0.1:3001");
    let topic = setting("BILLING_TOPIC", ORDER_TOPIC);
    let consumer = setting("BILLING_CONSUMER", CONSUMER);
    match serve(&url, &brokers, &addr, &topic, &consumer).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("billing-service: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn serve(
    url: &str,
    brokers: &str,
    addr: &str,
    topic: &str,
    name: &str,
) -> Result<(), Box<dyn std::error::Error>> {
    let db = sea_orm::Database::connect(url).await?;
    billing_service::migrate(&db).await?;
    let options = ConsumerOptions::new(name).poison(PoisonPolicy::DeadLetter {
        topic: format!("{name}.dead-letter"),
    });
    let consumer = KafkaConsumer::new(brokers, &[topic], options)?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| format!("cannot listen on {addr}: {e}"))?;
    println!(
        "billing-service: consuming {topic} as {name}; invoices on http://{}",
        listener.local_addr()?
    );

    let shutdown = CancellationToken::new();
    tokio::spawn(stop_on_signal(shutdown.clone()));
    let http = axum::serve(
        listener,
        billing_service::app(db.clone(), consumer.progress()),
    )
    .with_graceful_shutdown(shutdown.clone().cancelled_owned());
    let handler = seaorm_outbox::consumer::handler(|envelope, txn| {
        Box::pin(billing_service::apply(envelope, txn))
    });
    let consuming = consumer.run(&db, handler, shutdown.clone().cancelled_owned());
    let (served, consumed) = tokio::join!(http, async {
        let consumed = consuming.await;
        shutdown.cancel(); // a consumer that stops (poison under Stop, say) takes the API with it
        consumed
    });
    served?;
    consumed?;
    Ok(())
}

/// Cancels `shutdown` on SIGINT or SIGTERM.
async fn stop_on_signal(shutdown: CancellationToken) {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("install the SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    shutdown.cancel();
}
