//! The consumer loops over the inbox, end to end on real PostgreSQL, Kafka and Pulsar: events the
//! relay published are applied exactly once, in per-aggregate order, even when delivered twice
//! (a relay re-send, a consumer that crashed between its database commit and its offset commit
//! or ack) and when two instances share the work; poison messages go where the policy says.

mod common;

use common::Fixture;
use seaorm_outbox::consumer::kafka::KafkaConsumer;
use seaorm_outbox::consumer::pulsar::PulsarConsumer;
use seaorm_outbox::consumer::{
    BoxFuture, Consumed, ConsumerError, ConsumerOptions, HandlerError, PoisonPolicy,
};
use seaorm_outbox::inbox::Inbox;
use seaorm_outbox::sea_orm::{
    ConnectionTrait, DatabaseConnection, DatabaseTransaction, DbBackend, Statement,
    TransactionTrait,
};
use seaorm_outbox::{Envelope, OutboxEvent, Uuid};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::time::Duration;
use tokio::sync::watch;

#[derive(Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate = "order", key = "order_id")]
struct OrderPlaced {
    order_id: String,
    n: i64,
}

/// The business effect: one row per applied event, numbered in the order applied.
const EFFECTS: &str = "CREATE TABLE effects (
    pos bigserial PRIMARY KEY, event_id uuid NOT NULL, aggregate_id text NOT NULL,
    n bigint NOT NULL, instance text NOT NULL)";

/// The handler of every test: decode, then write the effect in the inbox's transaction.
async fn apply(
    envelope: &Envelope,
    txn: &DatabaseTransaction,
    instance: &str,
) -> Result<(), HandlerError> {
    let event: OrderPlaced = envelope.decode()?;
    txn.execute_raw(Statement::from_sql_and_values(
        DbBackend::Postgres,
        "INSERT INTO effects (event_id, aggregate_id, n, instance) VALUES ($1::text::uuid, $2, $3, $4)",
        [
            envelope.id.to_string().into(),
            event.order_id.into(),
            event.n.into(),
            instance.into(),
        ],
    ))
    .await?;
    Ok(())
}

/// Records `per_order` events for each of `orders` orders, interleaved; the ids in order.
async fn record_orders(f: &Fixture, orders: usize, per_order: i64) -> Vec<Uuid> {
    let mut ids = Vec::new();
    for n in 0..per_order {
        let txn = f.db.begin().await.unwrap();
        for o in 0..orders {
            let event = OrderPlaced {
                order_id: format!("o{o}"),
                n,
            };
            ids.push(event.record(&txn).await.unwrap());
        }
        txn.commit().await.unwrap();
    }
    ids
}

/// Publishes the fixture's backlog with the relay binary (`sink` arguments), then stops it.
async fn relay_all(f: &Fixture, pulsar: bool) {
    let mut relay = if pulsar {
        f.spawn_pulsar_relay(&[])
    } else {
        f.spawn_relay(&[])
    };
    f.wait_until_drained(Duration::from_secs(60)).await;
    common::terminate(&mut relay);
}

/// Makes the relay publish these events again, as after a crash between send and mark.
async fn unmark(f: &Fixture, ids: &[Uuid]) {
    let list: Vec<String> = ids.iter().map(|id| format!("'{id}'")).collect();
    f.db.execute_unprepared(&format!(
        "UPDATE outbox SET published_at = NULL WHERE id IN ({})",
        list.join(",")
    ))
    .await
    .unwrap();
}

/// Applies events the way a consumer that crashed after its database commit, before its offset
/// commit or ack, left them: effect and inbox row committed, the broker unaware.
async fn apply_before_crash(f: &Fixture, consumer: &str, ids: &[Uuid]) {
    let inbox = Inbox::new(consumer);
    for id in ids {
        let n = f
            .scalar(&format!(
                "SELECT (payload->>'n')::int8 FROM outbox WHERE id = '{id}'"
            ))
            .await;
        let order: String =
            f.db.query_one_raw(Statement::from_string(
                DbBackend::Postgres,
                format!("SELECT aggregate_id FROM outbox WHERE id = '{id}'"),
            ))
            .await
            .unwrap()
            .unwrap()
            .try_get_by_index(0)
            .unwrap();
        let effect = format!(
            "INSERT INTO effects (event_id, aggregate_id, n, instance) VALUES ('{id}', '{order}', {n}, 'crashed')"
        );
        let outcome = inbox
            .process(&f.db, *id, move |txn| {
                Box::pin(async move { txn.execute_unprepared(&effect).await.map(drop) })
            })
            .await
            .unwrap();
        assert_eq!(outcome, seaorm_outbox::inbox::Processed::Applied(()));
    }
}

/// A shutdown signal for consumer loops, fired once `effects` holds `count` rows.
fn stop_when_applied(
    f: &Fixture,
    count: i64,
) -> (watch::Receiver<bool>, tokio::task::JoinHandle<()>) {
    let (tx, rx) = watch::channel(false);
    let db = f.db.clone();
    let waiter = tokio::spawn(async move {
        let deadline = std::time::Instant::now() + Duration::from_secs(90);
        loop {
            let applied = outbox_tests::count(&db, "SELECT count(*) AS n FROM effects").await;
            if applied >= count {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "only {applied} of {count} effects after 90 s"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        tx.send(true).unwrap();
    });
    (rx, waiter)
}

async fn fired(mut rx: watch::Receiver<bool>) {
    let _ = rx.wait_for(|stop| *stop).await;
}

/// Until `rx` fires, or the loop's progress is `enough`.
async fn stop_on(
    rx: watch::Receiver<bool>,
    mut progress: watch::Receiver<Consumed>,
    enough: fn(&Consumed) -> bool,
) {
    tokio::select! {
        () = fired(rx) => {}
        _ = progress.wait_for(enough) => {}
    }
}

/// Every event applied once, and each aggregate's events in recording order.
async fn assert_applied_once_in_order(f: &Fixture, total: usize) {
    assert_eq!(
        f.scalar("SELECT count(*) FROM effects").await,
        total as i64,
        "each event's effect exactly once"
    );
    let rows =
        f.db.query_all_raw(Statement::from_string(
            DbBackend::Postgres,
            "SELECT aggregate_id, n FROM effects ORDER BY pos",
        ))
        .await
        .unwrap();
    let mut by_order: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for row in rows {
        by_order
            .entry(row.try_get_by_index(0).unwrap())
            .or_default()
            .push(row.try_get_by_index(1).unwrap());
    }
    for (order, ns) in by_order {
        let mut sorted = ns.clone();
        sorted.sort_unstable();
        assert_eq!(ns, sorted, "effects of {order} applied out of order");
    }
}

fn options(prefix: &str) -> ConsumerOptions {
    ConsumerOptions::new(format!("{prefix}-billing"))
        .backoff(Duration::from_millis(20), Duration::from_millis(200))
}

/// The handler of most tests: [`apply`] as `instance`.
fn applying(
    instance: &'static str,
) -> impl for<'t> Fn(&'t Envelope, &'t DatabaseTransaction) -> BoxFuture<'t, Result<(), HandlerError>>
+ Send
+ 'static {
    seaorm_outbox::consumer::handler(move |envelope, txn| Box::pin(apply(envelope, txn, instance)))
}

/// Runs a Kafka or a Pulsar consumer loop on `topic` until `rx` fires or its progress is
/// `enough`.
async fn consume<H>(
    pulsar: bool,
    db: &DatabaseConnection,
    topic: &str,
    options: ConsumerOptions,
    rx: watch::Receiver<bool>,
    enough: fn(&Consumed) -> bool,
    handler: H,
) -> Result<Consumed, ConsumerError>
where
    H: for<'t> Fn(&'t Envelope, &'t DatabaseTransaction) -> BoxFuture<'t, Result<(), HandlerError>>,
{
    if pulsar {
        let consumer = PulsarConsumer::new(&common::pulsar::url(), &[topic], options)
            .await
            .unwrap();
        let stop = stop_on(rx, consumer.progress(), enough);
        consumer.run(db, handler, stop).await
    } else {
        let consumer = KafkaConsumer::new(&common::kafka::brokers(), &[topic], options).unwrap();
        let stop = stop_on(rx, consumer.progress(), enough);
        consumer.run(db, handler, stop).await
    }
}

/// Re-sent by the relay, and applied before a consumer crash: every effect still happens once.
async fn redelivered_events_are_applied_once(pulsar: bool) {
    let f = Fixture::new().await;
    f.db.execute_unprepared(EFFECTS).await.unwrap();
    let ids = record_orders(&f, 5, 10).await;
    relay_all(&f, pulsar).await;
    // A relay re-send: the broker gets these twice.
    let resent = &ids[10..20];
    unmark(&f, resent).await;
    relay_all(&f, pulsar).await;
    // A consumer crash between database commit and offset commit / ack.
    let options = options(&f.prefix);
    let crashed = &ids[..15];
    apply_before_crash(&f, options.name(), crashed).await;

    // Stop once all 60 messages (50 events, 10 of them twice) went through the loop.
    let (_never_sent, never) = watch::channel(false);
    let all_read: fn(&Consumed) -> bool = |c| c.applied + c.duplicates >= 60;
    let topic = if pulsar {
        common::pulsar::topic(&f.topic("order"))
    } else {
        f.topic("order")
    };
    let consumed = consume(
        pulsar,
        &f.db,
        &topic,
        options,
        never,
        all_read,
        applying("one"),
    )
    .await
    .unwrap();

    assert_applied_once_in_order(&f, ids.len()).await;
    assert_eq!(consumed.applied, (ids.len() - crashed.len()) as u64);
    // 15 applied before the crash; of the 10 re-sent, 5 were among them (seen twice) and 5 not.
    assert_eq!(consumed.duplicates, 15 + 10, "{consumed:?}");
}

#[tokio::test]
async fn kafka_redelivered_events_are_applied_once() {
    redelivered_events_are_applied_once(false).await;
}

#[tokio::test]
async fn pulsar_redelivered_events_are_applied_once() {
    redelivered_events_are_applied_once(true).await;
}

/// A new group through `with_config` (the way to TLS and SASL) reads the events already on the
/// topic: the loop sets `auto.offset.reset = earliest` unless the caller chose otherwise.
#[tokio::test]
async fn kafka_with_config_reads_the_events_a_new_group_finds() {
    let f = Fixture::new().await;
    f.db.execute_unprepared(EFFECTS).await.unwrap();
    let ids = record_orders(&f, 2, 5).await;
    relay_all(&f, false).await;

    let mut config = rdkafka::ClientConfig::new();
    config.set("bootstrap.servers", common::kafka::brokers());
    let consumer =
        KafkaConsumer::with_config(config, &[&f.topic("order")], options(&f.prefix)).unwrap();
    let (_never_sent, never) = watch::channel(false);
    let all_applied: fn(&Consumed) -> bool = |c| c.applied >= 10;
    let stop = stop_on(never, consumer.progress(), all_applied);
    let consumed = tokio::time::timeout(
        Duration::from_secs(60),
        consumer.run(&f.db, applying("one"), stop),
    )
    .await
    .expect("a new group made with with_config read none of the 10 events on its topic in 60 s")
    .unwrap();
    assert_eq!(consumed.applied, ids.len() as u64);
    assert_applied_once_in_order(&f, ids.len()).await;
}

/// Waits until `members` consumers of `group` (Kafka group, or Pulsar subscription of `topic`)
/// are connected, as the broker sees them.
async fn wait_until_joined(pulsar: bool, topic: &str, group: &str, members: usize) {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let joined = if pulsar {
            let admin =
                std::env::var("PULSAR_ADMIN_URL").expect("PULSAR_ADMIN_URL (scripts/test sets it)");
            let port: u16 = admin.rsplit(':').next().unwrap().parse().unwrap();
            let path = format!("/admin/v2/{}/stats", topic.replace("://", "/"));
            common::http_get(port, &path)
                .and_then(|(_, body)| serde_json::from_str::<serde_json::Value>(&body).ok())
                .and_then(|stats| {
                    stats["subscriptions"][group]["consumers"]
                        .as_array()
                        .map(Vec::len)
                })
                .unwrap_or(0)
        } else {
            let brokers = common::kafka::brokers();
            let group = group.to_owned();
            tokio::task::spawn_blocking(move || {
                use rdkafka::consumer::{BaseConsumer, Consumer};
                let probe: BaseConsumer = rdkafka::ClientConfig::new()
                    .set("bootstrap.servers", brokers)
                    .create()
                    .unwrap();
                probe
                    .fetch_group_list(Some(&group), Duration::from_secs(5))
                    .ok()
                    .and_then(|list| {
                        list.groups()
                            .first()
                            .filter(|g| g.state() == "Stable")
                            .map(|g| g.members().len())
                    })
                    .unwrap_or(0)
            })
            .await
            .unwrap()
        };
        if joined >= members {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{joined} of {members} consumers joined {group}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Two instances of one consumer (one group, one Key_Shared subscription) share the events:
/// each effect once, each aggregate in order.
async fn two_instances_apply_each_event_once_in_order(pulsar: bool) {
    let f = Fixture::new().await;
    f.db.execute_unprepared(EFFECTS).await.unwrap();
    // One event first, so the topic exists when the instances subscribe.
    let txn = f.db.begin().await.unwrap();
    OrderPlaced {
        order_id: "warm-up".into(),
        n: 0,
    }
    .record(&txn)
    .await
    .unwrap();
    txn.commit().await.unwrap();
    relay_all(&f, pulsar).await;

    let topic = if pulsar {
        common::pulsar::topic(&f.topic("order"))
    } else {
        f.topic("order")
    };
    let options = options(&f.prefix);
    let total = 1 + 20 * 25;
    let (rx, waiter) = stop_when_applied(&f, total);
    let instances: Vec<_> = ["a", "b"]
        .into_iter()
        .map(|instance| {
            let (db, topic, options, rx) =
                (f.db.clone(), topic.clone(), options.clone(), rx.clone());
            tokio::spawn(async move {
                consume(
                    pulsar,
                    &db,
                    &topic,
                    options,
                    rx,
                    |_| false,
                    applying(instance),
                )
                .await
            })
        })
        .collect();
    // Both instances join before the rest is published, so both get a share.
    wait_until_joined(pulsar, &topic, options.name(), 2).await;
    record_orders(&f, 20, 25).await;
    relay_all(&f, pulsar).await;
    let mut consumed = Vec::new();
    for instance in instances {
        consumed.push(instance.await.unwrap().unwrap());
    }
    waiter.await.unwrap();

    assert_applied_once_in_order(&f, total as usize).await;
    let (a, b) = (consumed[0], consumed[1]);
    assert_eq!(a.applied + b.applied, total as u64, "{a:?} {b:?}");
    assert!(
        a.applied > 0 && b.applied > 0,
        "both instances worked: {a:?} {b:?}"
    );
}

#[tokio::test]
async fn kafka_two_instances_apply_each_event_once_in_order() {
    two_instances_apply_each_event_once_in_order(false).await;
}

#[tokio::test]
async fn pulsar_two_instances_apply_each_event_once_in_order() {
    two_instances_apply_each_event_once_in_order(true).await;
}

/// Publishes a message straight to the broker, as a misbehaving producer would.
async fn publish_raw(
    pulsar: bool,
    topic: &str,
    key: &str,
    headers: &[(&str, &str)],
    payload: &[u8],
) {
    if pulsar {
        let client = ::pulsar::Pulsar::builder(common::pulsar::url(), ::pulsar::TokioExecutor)
            .build()
            .await
            .unwrap();
        let mut producer = client.producer().with_topic(topic).build().await.unwrap();
        let message = ::pulsar::producer::Message {
            payload: payload.to_vec(),
            properties: headers
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            partition_key: Some(key.to_owned()),
            ordering_key: Some(key.as_bytes().to_vec()),
            ..Default::default()
        };
        producer
            .send_non_blocking(message)
            .await
            .unwrap()
            .await
            .unwrap();
    } else {
        use rdkafka::message::{Header, OwnedHeaders};
        use rdkafka::producer::{FutureProducer, FutureRecord};
        // Another producer of the topic, placing keys as the relay (and Java clients) do, so the
        // key's messages share a partition and their order is known.
        let producer: FutureProducer = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", common::kafka::brokers())
            .set("partitioner", "murmur2_random")
            .create()
            .unwrap();
        let mut owned = OwnedHeaders::new();
        for (key, value) in headers {
            owned = owned.insert(Header {
                key,
                value: Some(*value),
            });
        }
        let record = FutureRecord::to(topic)
            .key(key)
            .payload(payload)
            .headers(owned);
        producer
            .send(record, Duration::from_secs(30))
            .await
            .unwrap();
    }
}

/// The headers (Kafka) or properties (Pulsar) of the messages on `topic`.
async fn headers_on(pulsar: bool, topic: &str, expected: usize) -> Vec<BTreeMap<String, String>> {
    let timeout = Duration::from_secs(60);
    if pulsar {
        common::pulsar::consume(topic, expected, timeout)
            .await
            .into_iter()
            .map(|m| m.properties.into_iter().collect())
            .collect()
    } else {
        common::kafka::consume(&[topic], expected, timeout)
            .await
            .into_iter()
            .map(|m| m.headers.into_iter().collect())
            .collect()
    }
}

/// A topic holding, in this order: a good event of o0, a message that is no outbox event (if
/// `not_an_event`), an event of o0 whose payload does not decode, and the next good event of o0.
async fn topic_with_poison(f: &Fixture, pulsar: bool, not_an_event: bool) -> String {
    let topic = if pulsar {
        common::pulsar::topic(&f.topic("order"))
    } else {
        f.topic("order")
    };
    for n in 0..2 {
        let txn = f.db.begin().await.unwrap();
        OrderPlaced {
            order_id: "o0".into(),
            n,
        }
        .record(&txn)
        .await
        .unwrap();
        txn.commit().await.unwrap();
        relay_all(f, pulsar).await;
        if n == 0 {
            if not_an_event {
                publish_raw(pulsar, &topic, "x", &[], b"hello").await;
            }
            let id = Uuid::now_v7().to_string();
            let headers = [
                ("id", id.as_str()),
                ("event_type", "OrderPlaced"),
                ("aggregate_type", "order"),
                ("event_version", "1"),
            ];
            publish_raw(pulsar, &topic, "o0", &headers, br#"{"order_id": "o0"}"#).await;
        }
    }
    topic
}

/// Effects of `instance`, as (aggregate, n) in the order applied.
async fn effects_of(f: &Fixture, instance: &str) -> Vec<(String, i64)> {
    f.db.query_all_raw(Statement::from_sql_and_values(
        DbBackend::Postgres,
        "SELECT aggregate_id, n FROM effects WHERE instance = $1 ORDER BY pos",
        [instance.into()],
    ))
    .await
    .unwrap()
    .into_iter()
    .map(|row| {
        (
            row.try_get_by_index(0).unwrap(),
            row.try_get_by_index(1).unwrap(),
        )
    })
    .collect()
}

async fn poison_follows_the_policy(pulsar: bool) {
    let f = Fixture::new().await;
    f.db.execute_unprepared(EFFECTS).await.unwrap();
    let topic = topic_with_poison(&f, pulsar, true).await;
    let run =
        |name: &str, policy: PoisonPolicy, rx: watch::Receiver<bool>, instance: &'static str| {
            let options = options(&format!("{}-{name}", f.prefix))
                .attempts(2)
                .poison(policy);
            let (db, topic) = (f.db.clone(), topic.clone());
            async move {
                consume(
                    pulsar,
                    &db,
                    &topic,
                    options,
                    rx,
                    |_| false,
                    applying(instance),
                )
                .await
            }
        };
    let never = watch::channel(false);

    // Stop: the loop ends with the poison, uncommitted, so the next run meets it again.
    for _ in 0..2 {
        match run("stop", PoisonPolicy::Stop, never.1.clone(), "stop").await {
            Err(ConsumerError::Poison { reason, .. }) => assert!(
                reason.contains("not an outbox event")
                    || reason.contains("is not a valid `OrderPlaced`"),
                "{reason}"
            ),
            other => panic!("expected a poison stop, got {other:?}"),
        }
    }

    // Dead letter: both poison messages go there with the reason, the good events are applied.
    let dead = if pulsar {
        common::pulsar::topic(&format!("{}.dead", f.prefix))
    } else {
        format!("{}.dead", f.prefix)
    };
    let (tx, rx) = watch::channel(false);
    let dead_lettering = tokio::spawn(run(
        "dead",
        PoisonPolicy::DeadLetter {
            topic: dead.clone(),
        },
        rx,
        "dead",
    ));
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while effects_of(&f, "dead").await.len() < 2 {
        assert!(
            std::time::Instant::now() < deadline,
            "the good events were not applied"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let letters = headers_on(pulsar, &dead, 2).await;
    tx.send(true).unwrap();
    let consumed = dead_lettering.await.unwrap().unwrap();
    assert_eq!(
        (consumed.applied, consumed.dead_lettered),
        (2, 2),
        "{consumed:?}"
    );
    assert_eq!(
        effects_of(&f, "dead").await,
        vec![("o0".into(), 0), ("o0".into(), 1)]
    );
    assert_eq!(letters.len(), 2);
    for letter in &letters {
        assert!(letter["outbox_error"].len() > 10, "{letter:?}");
        assert!(
            topic.ends_with(&letter["outbox_source_topic"])
                || letter["outbox_source_topic"] == topic,
            "{letter:?}"
        );
    }
    assert!(
        letters
            .iter()
            .any(|l| l["outbox_error"].contains("no `id` header")),
        "{letters:?}"
    );
    assert!(
        letters
            .iter()
            .any(|l| l["outbox_error"].contains("missing field `n`")),
        "{letters:?}"
    );

    // Retry: the poison event of o0 holds back o0's next event, and the loop waits between
    // tries instead of spinning. A topic of o0's events only, so the order is known.
    let f = Fixture::new().await;
    f.db.execute_unprepared(EFFECTS).await.unwrap();
    let topic = topic_with_poison(&f, pulsar, false).await;
    let calls = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let options = options(&format!("{}-retry", f.prefix))
        .attempts(2)
        .backoff(Duration::from_millis(50), Duration::from_millis(200))
        .poison(PoisonPolicy::Retry);
    let (tx, rx) = watch::channel(false);
    let retrying = {
        let (db, topic, calls) = (f.db.clone(), topic.clone(), calls.clone());
        tokio::spawn(async move {
            let handler = seaorm_outbox::consumer::handler(move |envelope, txn| {
                calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                Box::pin(apply(envelope, txn, "retry"))
            });
            consume(pulsar, &db, &topic, options, rx, |_| false, handler).await
        })
    };
    // Six calls: the good event, two failed attempts, then three tries under the policy.
    let started = std::time::Instant::now();
    while calls.load(std::sync::atomic::Ordering::Relaxed) < 6 {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the loop stopped retrying"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let elapsed = started.elapsed();
    tx.send(true).unwrap();
    let consumed = retrying
        .await
        .unwrap()
        .expect("a retrying loop stops cleanly at shutdown");
    let calls = calls.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(
        effects_of(&f, "retry").await,
        vec![("o0".into(), 0)],
        "o0's next event waits behind its poison"
    );
    assert_eq!(consumed.applied, 1, "{consumed:?}");
    // Between those calls the loop waited 50 ms, then 200 ms three times: a tight loop would
    // have made them within a millisecond.
    assert!(
        elapsed >= Duration::from_millis(650),
        "{calls} handler calls within {elapsed:?}"
    );
}

#[tokio::test]
async fn kafka_poison_follows_the_policy() {
    poison_follows_the_policy(false).await;
}

#[tokio::test]
async fn pulsar_poison_follows_the_policy() {
    poison_follows_the_policy(true).await;
}
