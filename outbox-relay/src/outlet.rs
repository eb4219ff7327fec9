//! What a source's events are published with: the relay's settings, its routing and its sink.

use crate::config::RelayConfig;
use crate::routing::Router;
use crate::sink::Sink;

/// The relay's settings, routing and sink, lent to the pump and the batches it sends.
pub(crate) struct Outlet<'a> {
    pub config: &'a RelayConfig,
    pub router: &'a Router,
    pub sink: &'a dyn Sink,
}
