//! The backlog's gauges: how many rows wait, how many are parked or held, how old the oldest is.

use super::{OutboxTable, SessionConfig, every_tick};
use crate::metrics;
use crate::tenants::Outbox;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// A table's backlog, as `outbox-relay status` and the gauges show it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Backlog {
    /// Events waiting to be published (not parked).
    pub waiting: i64,
    /// Events parked as poison.
    pub parked: i64,
    /// Of the waiting events, those the claim holds behind an earlier event of their aggregate
    /// that is parked or backing off.
    pub held: i64,
    /// How old the oldest waiting event is.
    pub oldest_unpublished: Option<Duration>,
}

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
                let b = table.backlog().await?;
                metrics::backlog_sampled(
                    &labels,
                    b.waiting,
                    b.parked,
                    b.held,
                    b.oldest_unpublished,
                );
                Ok(())
            })
        },
    )
    .await;
}
