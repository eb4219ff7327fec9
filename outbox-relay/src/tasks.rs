//! The one owner of the relay's background work: the backlog sampler, the pruner, the LISTEN
//! listener and the HTTP endpoints.
//!
//! Every task gets a stop token from its owner and ends when the owner stops or is dropped; the
//! owner's [`stop`](BackgroundTasks::stop) waits for them, so no task (and no database connection
//! of one) outlives the relay. Work tied to one database connection's life (the listener) belongs
//! to a [`child`](BackgroundTasks::child) owner that the reconnect drops: a reconnect replaces
//! those tasks instead of adding more.

use std::future::Future;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// How long [`BackgroundTasks::stop`] waits for tasks to end before leaving them.
const STOP_WAIT: Duration = Duration::from_secs(10);

/// Background tasks with one owner; see the module documentation.
#[derive(Debug)]
pub struct BackgroundTasks {
    stop: CancellationToken,
    tracker: TaskTracker,
}

impl BackgroundTasks {
    /// An owner whose tasks stop when `shutdown` is cancelled, or when it is stopped or dropped.
    pub fn new(shutdown: &CancellationToken) -> Self {
        BackgroundTasks {
            stop: shutdown.child_token(),
            tracker: TaskTracker::new(),
        }
    }

    /// An owner for work that lives as long as something shorter (one database connection):
    /// stopped with this one, or on its own when dropped.
    pub fn child(&self) -> Self {
        BackgroundTasks::new(&self.stop)
    }

    /// Runs `task`, which must end soon after its stop token is cancelled. It logs in the
    /// caller's span (a pump's, naming its table).
    pub fn spawn<F>(&self, name: &'static str, task: impl FnOnce(CancellationToken) -> F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        use tracing::Instrument;
        let running = task(self.stop.clone());
        self.tracker.spawn(
            async move {
                running.await;
                tracing::debug!(task = name, "background task ended");
            }
            .in_current_span(),
        );
    }

    /// Stops every task and waits for them to end (at most 10 s, then leaves the stragglers with a
    /// warning: shutdown must not hang on them).
    pub async fn stop(self) {
        self.stop.cancel();
        self.tracker.close();
        if tokio::time::timeout(STOP_WAIT, self.tracker.wait())
            .await
            .is_err()
        {
            tracing::warn!(
                left = self.tracker.len(),
                "background tasks still running after {STOP_WAIT:?}; leaving them"
            );
        }
    }
}

impl Drop for BackgroundTasks {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    #[tokio::test]
    async fn stop_returns_once_every_task_has_ended() {
        let shutdown = CancellationToken::new();
        let tasks = BackgroundTasks::new(&shutdown);
        let ended = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&ended);
        tasks.spawn("ticker", move |stop| async move {
            stop.cancelled().await;
            tokio::time::sleep(Duration::from_millis(50)).await;
            flag.store(true, Ordering::SeqCst);
        });
        shutdown.cancel();
        tasks.stop().await;
        assert!(
            ended.load(Ordering::SeqCst),
            "stop returned before the task ended"
        );
    }
}
