//! `orders-service`: the order API on `ORDERS_ADDR` (default 127.0.0.1:3000) over the database
//! at `DATABASE_URL`. Stops gracefully on SIGINT or SIGTERM.

use std::process::ExitCode;

#[tokio::main]
async fn main() -> ExitCode {
    let Ok(url) = std::env::var("DATABASE_URL") else {
        eprintln!("orders-service: DATABASE_URL is not set (postgres://... or sqlite://...)");
        return ExitCode::from(2);
    };
    let addr = std::env::var("ORDERS_ADDR").unwrap_or_else(|_| "127.0.0.1:3000".into());
    match serve(&url, &addr).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("orders-service: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn serve(url: &str, addr: &str) -> Result<(), Box<dyn std::error::Error>> {
    let db = sea_orm::Database::connect(url).await?;
    orders_service::migrate(&db).await?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| format!("cannot listen on {addr}: {e}"))?;
    println!(
        "orders-service: listening on http://{}",
        listener.local_addr()?
    );
    axum::serve(listener, orders_service::app(db))
        .with_graceful_shutdown(shutdown_signal())
        .await?;
    Ok(())
}

/// SIGINT or SIGTERM.
async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("install the SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}
