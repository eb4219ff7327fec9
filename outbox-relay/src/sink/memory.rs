//! An in-memory sink for tests: keeps what it was sent, and fails on demand.

use super::{Message, Sink, SinkError};
use futures::future::BoxFuture;
use std::sync::{Arc, Mutex, PoisonError};

/// Records every published message. Clones share the same record.
///
/// ```
/// # use outbox_relay::sink::{Message, Sink, memory::MemorySink};
/// # tokio_test_block_on(async {
/// let sink = MemorySink::default();
/// sink.fail_keys(["13"]);
/// let mut unlucky = Message::example();
/// unlucky.key = "13".into();
/// let results = sink.publish(&[Message::example(), unlucky]).await;
/// assert!(results[0].is_ok() && results[1].is_err());
/// assert_eq!(sink.messages().len(), 1);
/// # });
/// # fn tokio_test_block_on<F: std::future::Future>(f: F) -> F::Output {
/// #     tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(f)
/// # }
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

    fn publish<'a>(&'a self, batch: &'a [Message]) -> BoxFuture<'a, Vec<Result<(), SinkError>>> {
        Box::pin(async move {
            let mut state = self.lock();
            batch
                .iter()
                .map(|m| {
                    if state.failing_keys.contains(&m.key) {
                        Err(SinkError::new(format!(
                            "memory sink told to fail key {}",
                            m.key
                        )))
                    } else {
                        state.messages.push(m.clone());
                        Ok(())
                    }
                })
                .collect()
        })
    }
}
