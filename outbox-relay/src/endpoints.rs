//! The relay's HTTP endpoints: `/metrics` (Prometheus), `/healthz` (the process is alive) and
//! `/readyz` (its database and broker answer). Bound to 127.0.0.1 unless configured otherwise.

use crate::relay::Relay;
use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use metrics_exporter_prometheus::PrometheusHandle;
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

#[derive(Clone)]
struct Endpoints {
    relay: Arc<Relay>,
    prometheus: PrometheusHandle,
}

/// Serves the endpoints on `listener` until `shutdown`.
pub async fn serve(
    listener: TcpListener,
    relay: Arc<Relay>,
    prometheus: PrometheusHandle,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let app = Router::new()
        .route(
            "/metrics",
            get(|State(e): State<Endpoints>| async move { e.prometheus.render() }),
        )
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .with_state(Endpoints { relay, prometheus });
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await
}

async fn readyz(State(e): State<Endpoints>) -> (StatusCode, String) {
    match e.relay.ready().await {
        Ok(()) => (StatusCode::OK, "ready\n".into()),
        Err(reason) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {reason}\n"),
        ),
    }
}
