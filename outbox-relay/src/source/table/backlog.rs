//! The backlog's gauges: how many rows wait, how many are parked, how old the oldest is.

use super::{OutboxTable, SessionConfig, every_tick};
use crate::metrics;
use seaorm_outbox::TableName;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Samples the backlog into its gauges every `every` until `shutdown`.
pub(crate) async fn sample_backlog(
    session: SessionConfig,
    table: TableName,
    every: Duration,
    shutdown: CancellationToken,
) {
    every_tick(
        &session,
        &table,
        every,
        shutdown,
        "sampling the backlog",
        |table: &mut OutboxTable| {
            Box::pin(async move {
                let (backlog, parked, oldest_seconds) = table.backlog().await?;
                let oldest = oldest_seconds
                    .map(|s| Duration::try_from_secs_f64(s.max(0.0)).unwrap_or(Duration::MAX));
                metrics::backlog_sampled(&table.name, backlog, parked, oldest);
                Ok(())
            })
        },
    )
    .await;
}
