//! What a source's events are published with: the relay's settings, its routing and its sink,
//! shared by the pumps (one per table).

use crate::config::RelayConfig;
use crate::quiet::QuietGate;
use crate::routing::Router;
use crate::sink::Sink;

/// The relay's settings, routing and sink, lent to the pumps and the batches they send.
pub(crate) struct Outlet<'a> {
    pub config: &'a RelayConfig,
    pub router: &'a Router,
    pub sink: &'a dyn Sink,
    /// Counts the pumps' batches in flight, for the sink's quiet moment.
    pub quiet: &'a QuietGate,
}
