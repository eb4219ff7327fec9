//! The registry of event types linked into a binary, filled by `#[derive(OutboxEvent)]` through
//! `inventory`.
//!
//! The linker drops a crate that nothing references, and its registrations with it: a relay binary
//! that should know your events must reference their crate (`use my_events as _;`).

use crate::{Error, Result};

/// One event type, as declared by its `#[derive(OutboxEvent)]`.
///
/// ```standalone_crate
/// # use seaorm_outbox::OutboxEvent;
/// #[derive(serde::Serialize, OutboxEvent)]
/// #[outbox(aggregate = "cart", key = "cart_id", topic = "carts")]
/// struct CartEmptied { cart_id: String }
///
/// let reg = seaorm_outbox::registrations()
///     .into_iter()
///     .find(|r| r.event_type == "CartEmptied")
///     .unwrap();
/// assert_eq!(reg.aggregate_type, "cart");
/// assert_eq!(reg.topic, Some("carts"));
/// assert!(reg.rust_type.ends_with("::CartEmptied"));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EventRegistration {
    /// The event type, such as `OrderCreated`.
    pub event_type: &'static str,
    /// The aggregate type, such as `order`.
    pub aggregate_type: &'static str,
    /// The topic override, if the event declares one.
    pub topic: Option<&'static str>,
    /// The payload's schema version.
    pub version: i32,
    /// The Rust type's path, such as `my_events::OrderCreated`.
    pub rust_type: &'static str,
}

inventory::collect!(EventRegistration);

/// Every event type registered in this binary, sorted by event type.
pub fn registrations() -> Vec<&'static EventRegistration> {
    let mut all: Vec<_> = inventory::iter::<EventRegistration>.into_iter().collect();
    all.sort_by_key(|r| (r.event_type, r.rust_type));
    all
}

/// Fails if two Rust types register one event type, naming both.
///
/// Call it at start-up: a relay or consumer could not tell such events apart.
///
/// ```standalone_crate
/// seaorm_outbox::check_registrations().expect("one Rust type per event type");
/// ```
pub fn check_registrations() -> Result<()> {
    duplicate(&registrations())
}

fn duplicate(sorted: &[&EventRegistration]) -> Result<()> {
    match sorted
        .windows(2)
        .find(|w| w[0].event_type == w[1].event_type)
    {
        Some(w) => Err(Error::DuplicateEventType {
            event_type: w[0].event_type.to_owned(),
            first: w[0].rust_type.to_owned(),
            second: w[1].rust_type.to_owned(),
        }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reg(event_type: &'static str, rust_type: &'static str) -> EventRegistration {
        EventRegistration {
            event_type,
            aggregate_type: "a",
            topic: None,
            version: 1,
            rust_type,
        }
    }

    #[test]
    fn duplicate_names_both_rust_types() {
        let (a, b, c) = (reg("A", "x::A"), reg("B", "x::B"), reg("B", "y::B"));
        let err = duplicate(&[&a, &b, &c]).unwrap_err().to_string();
        assert!(
            err.contains("`B`") && err.contains("x::B") && err.contains("y::B"),
            "{err}"
        );
        assert!(duplicate(&[&a, &b]).is_ok());
    }
}
