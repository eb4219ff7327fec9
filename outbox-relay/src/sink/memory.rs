//! An in-memory sink for tests: keeps what it was sent, and fails on demand.

use super::{Ack, Message, Sink, SinkError};
use futures::future::{BoxFuture, FutureExt, ready};
use std::sync::{Arc, Mutex, PoisonError};

/// Records every published message. Clones share the same record.
///
/// ```
/// # use seaorm_outbox_relay::sink::{Message, Sink, memory::MemorySink};
/// # futures::executor::block_on(async {
/// let sink = MemorySink::default();
/// sink.fail_keys(["13"]);
/// let mut unlucky = Message::example();
/// unlucky.key = "13".into();
/// assert!(sink.enqueue(&Message::example()).await.unwrap().await.is_ok());
/// assert!(sink.enqueue(&unlucky).await.unwrap().await.is_err());
/// assert_eq!(sink.messages().len(), 1);
/// # });
/// ```
#[derive(Debug, Clone, Default)]
pub struct MemorySink {
    state: Arc<Mutex<State>>,
}

#[derive(Debug, Default)]
struct State {
    messages: Vec<Message>,
    failing_keys: Vec<String>,
}

impl MemorySink {
    /// Every message acknowledged so far, in publish order.
    pub fn messages(&self) -> Vec<Message> {
        self.lock().messages.clone()
    }

    /// From now on, messages with one of these keys fail instead of being kept.
    pub fn fail_keys<I: IntoIterator<Item = S>, S: Into<String>>(&self, keys: I) {
        self.lock().failing_keys = keys.into_iter().map(Into::into).collect();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Sink for MemorySink {
    fn name(&self) -> &str {
        "memory"
    }

    fn enqueue<'a>(&'a self, message: &'a Message) -> BoxFuture<'a, Result<Ack, SinkError>> {
        let mut state = self.lock();
        let result = if state.failing_keys.contains(&message.key) {
            Err(SinkError::new(format!(
                "memory sink told to fail key {}",
                message.key
            )))
        } else {
            state.messages.push(message.clone());
            Ok(())
        };
        ready(Ok(ready(result).boxed())).boxed()
    }
}
