//! The backlog's gauges: how many rows wait, how many are parked, how old the oldest is.

use super::{OutboxTable, SessionConfig, every_tick};
use crate::metrics;
use crate::tenants::Outbox;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Samples `outbox`'s backlog into its gauges every `every` until `shutdown`.
pub(crate) async fn sample_backlog(
    session: SessionConfig,
    outbox: Outbox,
    every: Duration,
    shutdown: CancellationToken,
) {
    let labels = outbox.labels();
    every_tick(
        &session,
        &outbox.table,
        every,
        shutdown,
        "sampling the backlog",
        |table: &mut OutboxTable| {
            let labels = labels.clone();
            Box::pin(async move {
                let (backlog, parked, oldest_seconds) = table.backlog().await?;
                let oldest = oldest_seconds
                    .map(|s| Duration::try_from_secs_f64(s.max(0.0)).unwrap_or(Duration::MAX));
                metrics::backlog_sampled(&labels, backlog, parked, oldest);
                Ok(())
            })
        },
    )
    .await;
}
