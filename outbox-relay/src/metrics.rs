//! The relay's metrics, through the `metrics` crate: the binary exports them for Prometheus at
//! `/metrics`; an embedding application installs whatever recorder it uses.
//!
//! | metric | type | meaning |
//! |---|---|---|
//! | `outbox_backlog_events{table}` | gauge | events waiting to be published (not parked) |
//! | `outbox_oldest_unpublished_age_seconds{table}` | gauge | age of the oldest of them |
//! | `outbox_parked_events{table}` | gauge | events parked as poison |
//! | `outbox_held_events{table}` | gauge | of the waiting events, those held behind an earlier event of their aggregate that is parked or backing off |
//! | `outbox_published_total{topic}` | counter | events acked by the broker |
//! | `outbox_failures_total{kind}` | counter | `transient` and `permanent` publish failures, `database` errors |
//! | `outbox_batch_size` | histogram | rows claimed per batch |
//! | `outbox_batch_duration_seconds` | histogram | claim to commit, per batch |
//! | `outbox_commit_to_ack_seconds` | histogram | from recording (`created_at`) to the broker's ack |
//! | `outbox_shards_leased{table}` | gauge | shards of the table this replica publishes |
//!
//! `table` is one of the relay's tables (`RelayConfig::tables`); with tenant databases
//! (`RelayConfig::tenants`) the gauges labelled `table` carry a `tenant` label too. Both are
//! bounded by the configuration.

use crate::batch::Outcome;
use std::time::Duration;

pub(crate) const BACKLOG: &str = "outbox_backlog_events";
pub(crate) const OLDEST_AGE: &str = "outbox_oldest_unpublished_age_seconds";
pub(crate) const PARKED: &str = "outbox_parked_events";
pub(crate) const HELD: &str = "outbox_held_events";
pub(crate) const PUBLISHED: &str = "outbox_published_total";
pub(crate) const FAILURES: &str = "outbox_failures_total";
pub(crate) const BATCH_SIZE: &str = "outbox_batch_size";
pub(crate) const BATCH_DURATION: &str = "outbox_batch_duration_seconds";
pub(crate) const COMMIT_TO_ACK: &str = "outbox_commit_to_ack_seconds";
pub(crate) const SHARDS: &str = "outbox_shards_leased";
pub(crate) const SLOT_LAG_BYTES: &str = "outbox_wal_slot_lag_bytes";
pub(crate) const SLOT_LAG_SECONDS: &str = "outbox_wal_slot_lag_seconds";
pub(crate) const SLOT_ACTIVE: &str = "outbox_wal_slot_active";

/// Installs a Prometheus recorder with the relay's histogram buckets and returns its handle
/// (`handle.render()` is the `/metrics` text). Fails if a recorder is already installed.
#[cfg(feature = "prometheus")]
pub fn install_prometheus() -> Result<metrics_exporter_prometheus::PrometheusHandle, String> {
    use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
    let seconds = [
        0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    ];
    let sizes = [1.0, 10.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 5000.0];
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Full(BATCH_DURATION.into()), &seconds)
        .and_then(|b| b.set_buckets_for_metric(Matcher::Full(COMMIT_TO_ACK.into()), &seconds))
        .and_then(|b| b.set_buckets_for_metric(Matcher::Full(BATCH_SIZE.into()), &sizes))
        .map_err(|e| e.to_string())?
        .install_recorder()
        .map_err(|e| e.to_string())?;
    describe();
    Ok(handle)
}

#[cfg(feature = "prometheus")]
fn describe() {
    use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    describe_gauge!(BACKLOG, "Events waiting to be published (not parked).");
    describe_gauge!(
        OLDEST_AGE,
        Unit::Seconds,
        "Age of the oldest event waiting to be published."
    );
    describe_gauge!(
        PARKED,
        "Events parked as poison, holding back their aggregates."
    );
    describe_gauge!(
        HELD,
        "Of the events waiting, those held behind an earlier event of their aggregate that is \
         parked or backing off (PostgreSQL)."
    );
    describe_counter!(PUBLISHED, "Events acknowledged by the broker.");
    describe_counter!(
        FAILURES,
        "Publish failures (transient, permanent) and database errors."
    );
    describe_histogram!(BATCH_SIZE, "Rows claimed per batch.");
    describe_histogram!(
        BATCH_DURATION,
        Unit::Seconds,
        "From claim to commit, per batch."
    );
    describe_histogram!(
        COMMIT_TO_ACK,
        Unit::Seconds,
        "From recording an event to the broker's ack."
    );
    describe_gauge!(SHARDS, "Shards this replica publishes.");
    describe_gauge!(
        SLOT_LAG_BYTES,
        Unit::Bytes,
        "WAL source: WAL written since the slot's confirmed position (what the slot retains)."
    );
    describe_gauge!(
        SLOT_LAG_SECONDS,
        Unit::Seconds,
        "WAL source: age of the newest transaction this relay confirmed when it confirmed it; 0 when idle."
    );
    describe_gauge!(SLOT_ACTIVE, "WAL source: 1 while a relay reads the slot.");
}

/// Records one settled batch.
pub(crate) fn batch(claimed: usize, duration: Duration, outcome: &Outcome) {
    metrics::histogram!(BATCH_SIZE).record(claimed as f64);
    metrics::histogram!(BATCH_DURATION).record(duration.as_secs_f64());
    if !outcome.failed.is_empty() {
        metrics::counter!(FAILURES, "kind" => "transient").increment(outcome.failed.len() as u64);
    }
    if !outcome.parked.is_empty() {
        metrics::counter!(FAILURES, "kind" => "permanent").increment(outcome.parked.len() as u64);
    }
}

/// Records one event acked by the broker (its latency only when its creation time is a date).
pub(crate) fn published(topic: &str, created_ms: Option<i64>) {
    metrics::counter!(PUBLISHED, "topic" => topic.to_owned()).increment(1);
    if let Some(created_ms) = created_ms {
        let lag_ms = chrono::Utc::now()
            .timestamp_millis()
            .saturating_sub(created_ms);
        metrics::histogram!(COMMIT_TO_ACK).record(lag_ms.max(0) as f64 / 1000.0);
    }
}

/// Records a database error that interrupted the relay.
pub(crate) fn database_error() {
    metrics::counter!(FAILURES, "kind" => "database").increment(1);
}

/// Records how many of a table's shards this replica leases; `labels` name the table (and its
/// tenant).
pub(crate) fn shards(labels: &[(&'static str, String)], n: usize) {
    metrics::gauge!(SHARDS, labels).set(n as f64);
}

/// Records a sample of a table's backlog (`outbox-relay status`'s figures); `labels` name the
/// table (and its tenant).
pub(crate) fn backlog_sampled(
    labels: &[(&'static str, String)],
    waiting: i64,
    parked: i64,
    held: i64,
    oldest_unpublished: Option<Duration>,
) {
    metrics::gauge!(BACKLOG, labels).set(waiting as f64);
    metrics::gauge!(PARKED, labels).set(parked as f64);
    metrics::gauge!(HELD, labels).set(held as f64);
    metrics::gauge!(OLDEST_AGE, labels).set(oldest_unpublished.map_or(0.0, |d| d.as_secs_f64()));
}

/// Zeroes the gauges of an outbox table the relay no longer serves (a tenant removed from the
/// list): what it last sampled would otherwise stay, and alerts on it fire for nothing.
pub(crate) fn outbox_released(labels: &[(&'static str, String)]) {
    for gauge in [BACKLOG, PARKED, HELD, OLDEST_AGE, SHARDS] {
        metrics::gauge!(gauge, labels).set(0.0);
    }
}

/// Records a confirmed position of the WAL source: how old its transaction was (`None`: idle).
pub(crate) fn wal_confirmed(commit_ms: Option<i64>) {
    let lag = commit_ms.map_or(0.0, |ms| {
        chrono::Utc::now()
            .timestamp_millis()
            .saturating_sub(ms)
            .max(0) as f64
            / 1000.0
    });
    metrics::gauge!(SLOT_LAG_SECONDS).set(lag);
}

/// Records a sample of the WAL source's slot: how far behind it is (`None`: no such slot), and
/// whether a relay reads it.
pub(crate) fn slot_sampled(lag_bytes: Option<i64>, active: bool) {
    metrics::gauge!(SLOT_LAG_BYTES).set(lag_bytes.map_or(0.0, |b| b as f64));
    metrics::gauge!(SLOT_ACTIVE).set(if active { 1.0 } else { 0.0 });
}
