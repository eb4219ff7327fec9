//! The `OutboxEvent` trait, and `NewEvent`, an event serialized and ready to be recorded.

use crate::{Error, Result, record};
use sea_orm::DatabaseTransaction;
use std::collections::BTreeMap;
use std::future::Future;
use uuid::Uuid;

/// An event that can be recorded in the outbox. Derive it with `#[derive(OutboxEvent)]`.
///
/// # Attributes
/// | attribute | required | meaning |
/// |---|---|---|
/// | `aggregate = "order"` | yes | the aggregate type; routes to `outbox.event.order` by default |
/// | `key = "order_id"` | yes | the field holding the aggregate id (any `Display` type); the broker message key |
/// | `event_type = "OrderCreated"` | no | defaults to the struct's name |
/// | `topic = "orders"` | no | a topic that overrides the relay's routing |
/// | `version = 2` | no | the payload's schema version, default 1 |
/// | `crate = "path"` | no | the path of `seaorm_outbox` if it was renamed |
///
/// # Example
/// ```
/// use seaorm_outbox::OutboxEvent;
/// use serde::Serialize;
///
/// #[derive(Serialize, OutboxEvent)]
/// #[outbox(aggregate = "order", key = "order_id", version = 2)]
/// struct OrderCreated {
///     order_id: u64,
///     total_cents: i64,
/// }
///
/// let event = OrderCreated { order_id: 42, total_cents: 1999 };
/// assert_eq!(OrderCreated::EVENT_TYPE, "OrderCreated");
/// assert_eq!(OrderCreated::AGGREGATE_TYPE, "order");
/// assert_eq!(OrderCreated::EVENT_VERSION, 2);
/// assert_eq!(event.aggregate_id(), "42");
/// ```
///
/// Events are stored as JSON through serde: every `Serialize` type can be one, and a type without
/// `#[derive(Serialize)]` gets one error at its name saying so.
pub trait OutboxEvent: crate::__private::SerializeEvent {
    /// The aggregate type, such as `order`.
    const AGGREGATE_TYPE: &'static str;
    /// The event type, such as `OrderCreated`. One Rust type per event type.
    const EVENT_TYPE: &'static str;
    /// The payload's schema version.
    const EVENT_VERSION: i32;
    /// A topic that overrides the relay's routing, if any.
    const TOPIC: Option<&'static str>;
    /// The outbox table this type's events go to (`#[outbox(table = "billing_outbox")]`), when it
    /// is not the one the recording [`Outbox`](crate::Outbox) names; see
    /// [`TableName`](crate::TableName) for the names allowed. Table-less recording
    /// ([`Recording::LogicalMessage`](crate::Recording)) writes no row, and ignores it.
    const TABLE: Option<&'static str> = None;

    /// The id of the aggregate this event belongs to: the broker message key.
    fn aggregate_id(&self) -> String;

    /// Inserts this event into the outbox inside `txn` and returns its id (a UUID v7).
    ///
    /// The event is published only if `txn` commits. On PostgreSQL the call takes a
    /// transaction-scoped lock on the aggregate, so events of one aggregate get `seq` values in
    /// commit order; see the crate documentation for the rule this implies when one transaction
    /// records events of several aggregates.
    ///
    /// The event is serialized when `record` is called; a serialization error writes nothing.
    ///
    /// ```no_run
    /// # use seaorm_outbox::OutboxEvent;
    /// # use sea_orm::TransactionTrait;
    /// # #[derive(serde::Serialize, OutboxEvent)]
    /// # #[outbox(aggregate = "order", key = "order_id")]
    /// # struct OrderCreated { order_id: u64 }
    /// # async fn f(db: &sea_orm::DatabaseConnection) -> Result<(), Box<dyn std::error::Error>> {
    /// let txn = db.begin().await?;
    /// // ... change the order's state with `txn` ...
    /// let id = OrderCreated { order_id: 42 }.record(&txn).await?;
    /// txn.commit().await?;
    /// # Ok(()) }
    /// ```
    fn record<'t>(
        &self,
        txn: &'t DatabaseTransaction,
    ) -> impl Future<Output = Result<Uuid>> + Send + 't {
        let event = NewEvent::from_event(self);
        async move {
            let event = event?;
            let id = event.id;
            record::insert(txn, vec![event], &crate::Outbox::default()).await?;
            Ok(id)
        }
    }
}

/// An event serialized and given its id, ready to be recorded.
///
/// Build one from any [`OutboxEvent`] to add headers, or to record events of several types with
/// one statement through [`record_new_events`](crate::record_new_events).
///
/// ```
/// # use seaorm_outbox::{NewEvent, OutboxEvent};
/// # #[derive(serde::Serialize, OutboxEvent)]
/// # #[outbox(aggregate = "order", key = "order_id")]
/// # struct OrderCreated { order_id: u64 }
/// let event = NewEvent::from_event(&OrderCreated { order_id: 7 })?
///     .with_header("tenant", "acme");
/// assert_eq!(event.aggregate_id, "7");
/// assert_eq!(event.payload, serde_json::json!({ "order_id": 7 }));
/// # Ok::<(), seaorm_outbox::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct NewEvent {
    /// The event id, a UUID v7 (time-ordered).
    pub id: Uuid,
    /// See [`OutboxEvent::AGGREGATE_TYPE`].
    pub aggregate_type: String,
    /// See [`OutboxEvent::aggregate_id`].
    pub aggregate_id: String,
    /// See [`OutboxEvent::EVENT_TYPE`].
    pub event_type: String,
    /// See [`OutboxEvent::EVENT_VERSION`].
    pub event_version: i32,
    /// See [`OutboxEvent::TOPIC`].
    pub topic: Option<String>,
    /// The event as JSON: `serde_json::to_value(&event)`.
    pub payload: serde_json::Value,
    /// Headers the relay forwards to the broker.
    pub headers: BTreeMap<String, String>,
    /// See [`OutboxEvent::TABLE`]: the table this event goes to, whatever the recording
    /// [`Outbox`](crate::Outbox) names; `None` for that one.
    pub table: Option<crate::TableName>,
}

impl NewEvent {
    /// Serializes `event` and gives it a new id. With the `opentelemetry` feature, the current
    /// span's trace context (`traceparent`, `tracestate`) goes into its headers, through the
    /// globally installed propagator.
    pub fn from_event<E: OutboxEvent + ?Sized>(event: &E) -> Result<Self> {
        let payload = event.to_json().map_err(|source| Error::Serialize {
            event_type: E::EVENT_TYPE.to_owned(),
            source,
        })?;
        Ok(NewEvent {
            id: Uuid::now_v7(),
            aggregate_type: E::AGGREGATE_TYPE.to_owned(),
            aggregate_id: event.aggregate_id(),
            event_type: E::EVENT_TYPE.to_owned(),
            event_version: E::EVENT_VERSION,
            topic: E::TOPIC.map(str::to_owned),
            payload,
            headers: trace_context(),
            table: E::TABLE.map(crate::TableName::new).transpose()?,
        })
    }

    /// Adds a header that the relay forwards to the broker with the event.
    ///
    /// The names of [`RESERVED_HEADERS`](crate::RESERVED_HEADERS) belong to the contract: recording
    /// an event that carries one fails with [`Error::ReservedHeader`](crate::Error::ReservedHeader).
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.insert(name.into(), value.into());
        self
    }

    /// Inserts this event into the outbox inside `txn`; see [`OutboxEvent::record`].
    pub async fn record(self, txn: &DatabaseTransaction) -> Result<Uuid> {
        let id = self.id;
        record::insert(txn, vec![self], &crate::Outbox::default()).await?;
        Ok(id)
    }
}

/// The current span's W3C trace context, injected by the application's global propagator.
#[cfg(feature = "opentelemetry")]
fn trace_context() -> BTreeMap<String, String> {
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    let context = tracing::Span::current().context();
    let mut headers = BTreeMap::new();
    opentelemetry::global::get_text_map_propagator(|propagator| {
        propagator.inject_context(&context, &mut Injector(&mut headers));
    });
    headers
}

#[cfg(feature = "opentelemetry")]
struct Injector<'a>(&'a mut BTreeMap<String, String>);

#[cfg(feature = "opentelemetry")]
impl opentelemetry::propagation::Injector for Injector<'_> {
    fn set(&mut self, key: &str, value: String) {
        self.0.insert(key.to_owned(), value);
    }
}

#[cfg(not(feature = "opentelemetry"))]
fn trace_context() -> BTreeMap<String, String> {
    BTreeMap::new()
}
