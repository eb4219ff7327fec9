//! The outbox relay: publishes committed outbox rows to a broker, in order per aggregate.
//!
//! Work in progress: the claim, publish and mark loop lands with the relay issue.
