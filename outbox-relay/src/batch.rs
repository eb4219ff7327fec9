//! A batch: what bounds it, whatever the source holds, and what became of each of its events.

use crate::row::{OutboxRow, RowKey};

/// What bounds a claim, whatever the table holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Limits {
    /// Rows per batch.
    pub batch_size: usize,
    /// Payload and header bytes per batch: the claim stops before the row that would pass it
    /// (a batch always takes its first row, which [`max_payload_bytes`](Self::max_payload_bytes)
    /// bounds).
    pub max_batch_bytes: usize,
    /// The largest payload published; a larger row is parked, and its payload is not even read.
    pub max_payload_bytes: usize,
}

/// The events a source claimed for one batch, in order.
pub(crate) struct Claim {
    pub rows: Vec<OutboxRow>,
    /// Whether the claim stopped at a limit (rows or bytes) with more events waiting: the pump
    /// claims again at once.
    pub full: bool,
}

/// What became of each claimed row.
#[derive(Debug, Default)]
pub(crate) struct Outcome {
    /// Acked by the broker: marked published (or deleted).
    pub published: Vec<RowKey>,
    /// Failed, to be tried again after a delay: attempts + 1, last error kept.
    pub failed: Vec<(RowKey, String, std::time::Duration)>,
    /// Can never be published as is: parked with the reason, holding back its aggregate.
    pub parked: Vec<(RowKey, String)>,
}
