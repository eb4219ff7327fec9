//! A sink of the user's own, plugged into the relay: what it acks is marked, what it fails is kept
//! with its error and retried, and an aggregate's later events wait behind its failed one.

mod common;

use common::Fixture;
use futures::future::BoxFuture;
use seaorm_outbox::sea_orm::ConnectionTrait;
use seaorm_outbox_relay::Relay;
use seaorm_outbox_relay::sink::{Ack, Message, Sink, SinkError};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Keeps the events in a list, as a user's sink might write them to a queue of its own, and
/// refuses one aggregate's events while told to (the aggregate `refused` unless told otherwise).
#[derive(Clone)]
struct ListSink {
    published: Arc<Mutex<Vec<(String, i64)>>>,
    refused: Arc<Mutex<Option<&'static str>>>,
}

impl Default for ListSink {
    fn default() -> Self {
        ListSink::refusing("refused")
    }
}

impl ListSink {
    /// Refuses the events of the aggregate `key` until [`ListSink::accept_all`].
    fn refusing(key: &'static str) -> Self {
        ListSink {
            published: Arc::default(),
            refused: Arc::new(Mutex::new(Some(key))),
        }
    }

    fn accept_all(&self) {
        *self.refused.lock().unwrap() = None;
    }
}

impl Sink for ListSink {
    fn name(&self) -> &str {
        "list"
    }

    fn enqueue<'a>(&'a self, message: &'a Message) -> BoxFuture<'a, Result<Ack, SinkError>> {
        let refused = *self.refused.lock().unwrap() == Some(message.key.as_str());
        let answer = if refused {
            Err(SinkError::new("the list refuses this aggregate"))
        } else {
            self.published
                .lock()
                .unwrap()
                .push((message.key.clone(), message.seq));
            Ok(())
        };
        Box::pin(async move { Ok(Box::pin(async move { answer }) as Ack) })
    }
}

#[tokio::test]
async fn a_custom_sink_gets_every_event_and_its_failures_are_retried_in_order() {
    let f = Fixture::new().await;
    f.db.execute_unprepared(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
         SELECT gen_random_uuid(), 'cart', CASE WHEN g IN (3, 7) THEN 'refused' ELSE 'c-' || (g % 4) END,
                'CartChanged', jsonb_build_object('g', g)
         FROM generate_series(1, 40) g",
    )
    .await
    .unwrap();

    let sink = ListSink::default();
    let relay = Relay::new(f.relay_config(), sink.clone());
    let shutdown = CancellationToken::new();
    let running = tokio::spawn({
        let shutdown = shutdown.clone();
        async move { relay.run(shutdown).await.expect("the relay refused to run") }
    });
    f.wait_until_zero(
        "SELECT count(*) FROM outbox WHERE published_at IS NULL AND aggregate_id <> 'refused'",
        Duration::from_secs(30),
    )
    .await;
    // Let the refused aggregate be tried a few times.
    f.wait_until_zero(
        "SELECT CASE WHEN max(attempts) >= 2 THEN 0 ELSE 1 END::bigint FROM outbox WHERE aggregate_id = 'refused'",
        Duration::from_secs(30),
    )
    .await;
    shutdown.cancel();
    running.await.unwrap();

    let published = sink.published.lock().unwrap().clone();
    assert_eq!(published.len(), 38);
    for key in ["c-0", "c-1", "c-2", "c-3"] {
        let seqs: Vec<i64> = published
            .iter()
            .filter(|(k, _)| k == key)
            .map(|(_, s)| *s)
            .collect();
        assert!(
            seqs.windows(2).all(|w| w[0] < w[1]),
            "{key} out of order: {seqs:?}"
        );
    }
    // The refused aggregate: its first event failed and was retried; the second waits behind it.
    assert_eq!(
        f.scalar(
            "SELECT count(*) FROM outbox WHERE aggregate_id = 'refused' AND published_at IS NULL \
                  AND attempts >= 2 AND last_error = 'the list refuses this aggregate'"
        )
        .await,
        1
    );
    assert_eq!(
        f.scalar("SELECT count(*) FROM outbox WHERE aggregate_id = 'refused' AND published_at IS NULL AND attempts = 0")
            .await,
        1,
        "the aggregate's later event is held behind the failed one"
    );
}

/// A sink whose client refuses every message at enqueue, counting the calls.
struct RefusingSink {
    calls: Arc<Mutex<usize>>,
}

impl Sink for RefusingSink {
    fn name(&self) -> &str {
        "refusing"
    }

    fn enqueue<'a>(&'a self, _message: &'a Message) -> BoxFuture<'a, Result<Ack, SinkError>> {
        *self.calls.lock().unwrap() += 1;
        Box::pin(async { Err(SinkError::new("the queue refuses everything")) })
    }
}

#[tokio::test]
async fn a_sink_that_refuses_at_enqueue_fails_each_row_with_its_reason_and_does_not_spin() {
    let f = Fixture::new().await;
    f.db.execute_unprepared(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
         SELECT gen_random_uuid(), 'cart', 'c-' || g, 'CartChanged', '{}' FROM generate_series(1, 10) g",
    )
    .await
    .unwrap();
    let calls = Arc::new(Mutex::new(0));
    let sink = RefusingSink {
        calls: calls.clone(),
    };
    // Failed batches back off exponentially; rows that fall due apart fail in separate batches,
    // each growing the wait: keep the waits short so two attempts each come soon.
    let mut config = f.relay_config();
    config.max_backoff = Duration::from_millis(300);
    let relay = Relay::new(config, sink);
    let shutdown = CancellationToken::new();
    let running = tokio::spawn({
        let shutdown = shutdown.clone();
        async move { relay.run(shutdown).await.expect("the relay refused to run") }
    });
    // Every row failed at least twice, with the reason.
    f.wait_until_zero(
        "SELECT count(*) FROM outbox WHERE attempts < 2 OR last_error <> 'the queue refuses everything'",
        Duration::from_secs(30),
    )
    .await;
    shutdown.cancel();
    running.await.unwrap();
    assert_eq!(
        f.scalar("SELECT count(*) FROM outbox WHERE published_at IS NOT NULL")
            .await,
        0,
        "a refused message was marked published"
    );
    // No spin: every call of the sink was recorded as a failed attempt (one more batch may have
    // been in hand at shutdown), not repeated in a tight loop.
    let attempts = f.scalar("SELECT sum(attempts)::bigint FROM outbox").await;
    let calls = *calls.lock().unwrap() as i64;
    assert!(
        calls <= attempts + 10,
        "{calls} calls for {attempts} failed attempts"
    );
}

/// Runs a relay with a [`ListSink`] over `config` until `published` events went out.
async fn publish_with_list(
    config: seaorm_outbox_relay::RelayConfig,
    published: usize,
) -> Vec<(String, i64)> {
    let sink = ListSink::default();
    let relay = Relay::new(config, sink.clone());
    let shutdown = CancellationToken::new();
    let running = tokio::spawn({
        let shutdown = shutdown.clone();
        async move { relay.run(shutdown).await.expect("the relay refused to run") }
    });
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while sink.published.lock().unwrap().len() < published {
        assert!(
            std::time::Instant::now() < deadline,
            "only {:?} published",
            sink.published.lock().unwrap()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    shutdown.cancel();
    running.await.unwrap();
    sink.published.lock().unwrap().clone()
}

#[tokio::test]
async fn rows_whose_created_at_is_not_a_date_do_not_stop_the_claim() {
    // PostgreSQL: infinite timestamps, which overflowed the claim's cast and failed every claim.
    let f = Fixture::new().await;
    f.db.execute_unprepared(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, created_at) VALUES
           (gen_random_uuid(), 'cart', 'a', 'E', '{}', 'infinity'),
           (gen_random_uuid(), 'cart', 'b', 'E', '{}', '-infinity'),
           (gen_random_uuid(), 'cart', 'c', 'E', '{}', now())",
    )
    .await
    .unwrap();
    let published = publish_with_list(f.relay_config(), 3).await;
    assert_eq!(published.len(), 3, "{published:?}");

    // SQLite: a created_at that is text, not a date.
    let url = format!(
        "sqlite://{}?mode=rwc",
        outbox_tests::temp_dir().join("shop.db").display()
    );
    let db = seaorm_outbox::sea_orm::Database::connect(&url)
        .await
        .unwrap();
    seaorm_outbox::migration::migrate(&db).await.unwrap();
    db.execute_unprepared(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, created_at) VALUES
           ('0193a000-0000-7000-8000-000000000001', 'cart', 'a', 'E', '{}', 'not a date'),
           ('0193a000-0000-7000-8000-000000000002', 'cart', 'b', 'E', '{}', strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))",
    )
    .await
    .unwrap();
    let mut config = seaorm_outbox_relay::RelayConfig::new(url);
    config.poll_interval = Duration::from_millis(20);
    let published = publish_with_list(config, 2).await;
    assert_eq!(published.len(), 2, "{published:?}");
}

/// A sink whose client never answers for one aggregate's messages, and acks the rest.
struct SilentSink;

impl Sink for SilentSink {
    fn name(&self) -> &str {
        "silent"
    }

    fn enqueue<'a>(&'a self, message: &'a Message) -> BoxFuture<'a, Result<Ack, SinkError>> {
        let ack: Ack = if message.key == "silent" {
            Box::pin(futures::future::pending())
        } else {
            Box::pin(async { Ok(()) })
        };
        Box::pin(async move { Ok(ack) })
    }
}

#[tokio::test]
async fn an_ack_that_never_comes_fails_its_event_after_ack_timeout_and_the_rest_flows() {
    let f = Fixture::new().await;
    f.db.execute_unprepared(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
         SELECT gen_random_uuid(), 'cart', CASE WHEN g = 5 THEN 'silent' ELSE 'c-' || (g % 3) END,
                'CartChanged', '{}'
         FROM generate_series(1, 30) g",
    )
    .await
    .unwrap();
    let mut config = f.relay_config();
    config.ack_timeout = Duration::from_millis(300);
    config.max_backoff = Duration::from_millis(300);
    let relay = Relay::new(config, SilentSink);
    let shutdown = CancellationToken::new();
    let running = tokio::spawn({
        let shutdown = shutdown.clone();
        async move { relay.run(shutdown).await.expect("the relay refused to run") }
    });
    f.wait_until_zero(
        "SELECT count(*) FROM outbox WHERE published_at IS NULL AND aggregate_id <> 'silent'",
        Duration::from_secs(30),
    )
    .await;
    f.wait_until_zero(
        "SELECT count(*) FROM outbox WHERE aggregate_id = 'silent'
           AND (attempts < 2 OR last_error NOT LIKE 'no answer from the sink within 300ms (ack_timeout)')",
        Duration::from_secs(30),
    )
    .await;
    shutdown.cancel();
    running.await.unwrap();
}

/// While an aggregate's first event backs off, the claim holds (`held_at`) its later events, those
/// recorded before the failure and those recorded while it is retried, so no claim reads them
/// again; once it is published they are released in the same transaction and go out in order.
#[tokio::test]
async fn an_aggregate_behind_a_retried_event_is_held_and_resumes_in_order() {
    let f = Fixture::new().await;
    let insert = |from: i32, to: i32| {
        format!(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
             SELECT gen_random_uuid(), 'cart', key, 'CartChanged', jsonb_build_object('g', g)
             FROM generate_series({from}, {to}) g, (VALUES ('flaky'), ('steady')) k(key)
             ORDER BY g, key"
        )
    };
    f.db.execute_unprepared(&insert(1, 5)).await.unwrap();
    // The aggregate's partition is away.
    let sink = ListSink::refusing("flaky");
    let mut config = f.relay_config();
    config.max_backoff = Duration::from_millis(300);
    config.batch_size = 2;
    let relay = Relay::new(config, sink.clone());
    let shutdown = CancellationToken::new();
    let running = tokio::spawn({
        let shutdown = shutdown.clone();
        async move { relay.run(shutdown).await.expect("the relay refused to run") }
    });
    let held = "SELECT count(*) FROM outbox WHERE aggregate_id = 'flaky' AND held_at IS NOT NULL";
    let waiting = |n: i64| {
        format!(
            "SELECT abs(({held}) - {n}) + (SELECT count(*) FROM outbox \
             WHERE aggregate_id = 'steady' AND published_at IS NULL)"
        )
    };
    // The first event backs off; the four behind it are held, and the other aggregate flows.
    f.wait_until_zero(&waiting(4), Duration::from_secs(30))
        .await;
    // Recorded while the first one is retried: held as the claim meets them.
    f.db.execute_unprepared(&insert(6, 8)).await.unwrap();
    f.wait_until_zero(&waiting(7), Duration::from_secs(30))
        .await;
    assert!(
        f.scalar("SELECT max(attempts)::bigint FROM outbox WHERE aggregate_id = 'flaky'")
            .await
            >= 1
    );

    sink.accept_all();
    f.wait_until_zero(
        "SELECT count(*) FROM outbox WHERE published_at IS NULL",
        Duration::from_secs(30),
    )
    .await;
    shutdown.cancel();
    running.await.unwrap();

    assert_eq!(f.scalar(held).await, 0, "every held event was released");
    let published = sink.published.lock().unwrap().clone();
    let flaky: Vec<i64> = published
        .iter()
        .filter(|(k, _)| k == "flaky")
        .map(|(_, s)| *s)
        .collect();
    let recorded = f
        .scalar("SELECT count(*) FROM outbox WHERE aggregate_id = 'flaky'")
        .await;
    assert_eq!(flaky.len() as i64, recorded, "each event once: {flaky:?}");
    assert!(
        flaky.windows(2).all(|w| w[0] < w[1]),
        "the aggregate's events in the order recorded: {flaky:?}"
    );
}
