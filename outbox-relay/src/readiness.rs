//! Readiness, for `/readyz`: whether the relay can work now, its database answering and its sink
//! reaching the broker.
//!
//! Probes are answered one at a time and an answer is reused for [`REUSE`]: however many probes
//! arrive, and however often, the database and the broker see at most one check each per
//! [`REUSE`] (a Kafka check is a metadata request on a thread of its own).

use crate::sink::Sink;
use crate::source::table::OutboxTable;
use seaorm_outbox::TableName;
use std::time::Duration;
use tokio::sync::Mutex;
use tokio::time::Instant;

/// How long each readiness check (database, broker) may take.
pub const READY_TIMEOUT: Duration = Duration::from_secs(5);

/// How long an answer is given again to the probes that follow it.
const REUSE: Duration = Duration::from_secs(1);

/// The checks' state, kept from probe to probe.
#[derive(Default)]
pub(crate) struct Readiness {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// The connection the database check pings, opened again after a failure, so probes add no
    /// connections.
    connection: Option<OutboxTable>,
    /// The last answer, and when it was found.
    last: Option<(Instant, Result<(), String>)>,
}

impl Readiness {
    /// Whether the database at `database_url` and `sink`'s broker answer, each within
    /// [`READY_TIMEOUT`].
    pub async fn check(&self, database_url: &str, sink: &dyn Sink) -> Result<(), String> {
        let mut state = self.state.lock().await;
        if let Some((at, answer)) = &state.last
            && at.elapsed() < REUSE
        {
            return answer.clone();
        }
        let answer = state.check(database_url, sink).await;
        state.last = Some((Instant::now(), answer.clone()));
        answer
    }
}

impl State {
    async fn check(&mut self, database_url: &str, sink: &dyn Sink) -> Result<(), String> {
        let connection = &mut self.connection;
        let database = async {
            // A kept connection that fails is tried once more fresh: after a database restart
            // the kept one is dead while the database answers again.
            if let Some(kept) = connection.as_mut()
                && kept.ping().await.is_ok()
            {
                return Ok(());
            }
            // A ping: any table name will do.
            *connection = Some(OutboxTable::connect(database_url, &TableName::DEFAULT).await?);
            connection.as_mut().expect("connected above").ping().await
        };
        let answer = tokio::time::timeout(READY_TIMEOUT, database).await;
        if !matches!(answer, Ok(Ok(()))) {
            self.connection = None;
        }
        match answer {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(format!("database: {e}")),
            Err(_) => return Err(format!("database: no answer within {READY_TIMEOUT:?}")),
        }
        match tokio::time::timeout(READY_TIMEOUT, sink.ready()).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(format!("{}: {e}", sink.name())),
            Err(_) => Err(format!(
                "{}: no answer within {READY_TIMEOUT:?}",
                sink.name()
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sink::{Ack, Message, SinkError};
    use futures::future::BoxFuture;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A sink that counts the broker checks it is asked for.
    #[derive(Default)]
    struct Counting(AtomicUsize);

    impl Sink for Counting {
        fn name(&self) -> &str {
            "counting"
        }

        fn enqueue<'a>(&'a self, _: &'a Message) -> BoxFuture<'a, Result<Ack, SinkError>> {
            unreachable!("readiness sends nothing")
        }

        fn ready(&self) -> BoxFuture<'_, Result<(), SinkError>> {
            self.0.fetch_add(1, Ordering::SeqCst);
            Box::pin(async {
                tokio::time::sleep(Duration::from_millis(50)).await;
                Ok(())
            })
        }
    }

    #[tokio::test]
    async fn many_probes_make_one_check_a_second() {
        let readiness = Readiness::default();
        let sink = Counting::default();
        let url = "sqlite::memory:";
        let probes = (0..20).map(|_| readiness.check(url, &sink));
        let answers = futures::future::join_all(probes).await;
        assert!(answers.iter().all(Result::is_ok), "{answers:?}");
        assert_eq!(sink.0.load(Ordering::SeqCst), 1, "20 probes at once");

        // The answer, as if found a reuse window ago.
        if let Some((at, _)) = &mut readiness.state.lock().await.last {
            *at -= REUSE;
        }
        readiness.check(url, &sink).await.unwrap();
        assert_eq!(
            sink.0.load(Ordering::SeqCst),
            2,
            "a probe after the reuse window"
        );
    }
}
