//! Per-aggregate commit order on PostgreSQL and MariaDB: when transactions record events of one aggregate
//! concurrently, `seq` order equals commit order, with no lock taken by the business code.
//!
//! Commit order is read from PostgreSQL itself: `pg_xact_commit_timestamp(xmin)` of each outbox
//! row (the test cluster runs with `track_commit_timestamp=on`).

use outbox_tests::{Backend, count, database};
use seaorm_outbox::sea_orm::{
    ConnectionTrait, DatabaseConnection, DbBackend, Statement, TransactionTrait,
};
use seaorm_outbox::{NewEvent, OutboxEvent, Uuid};
use serde::Serialize;
use std::time::{Duration, Instant};

#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate = "account", key = "account")]
struct Deposited {
    account: String,
    writer: usize,
    step: usize,
}

async fn postgres() -> DatabaseConnection {
    let db = database(Backend::Postgres).await;
    let on = db
        .query_one_raw(Statement::from_string(
            DbBackend::Postgres,
            "SHOW track_commit_timestamp",
        ))
        .await
        .unwrap()
        .unwrap()
        .try_get_by_index::<String>(0)
        .unwrap();
    assert_eq!(
        on, "on",
        "this test reads commit order from commit timestamps: start PostgreSQL with \
         track_commit_timestamp=on (scripts/services does)"
    );
    db
}

/// Every pair of events of one aggregate whose `seq` order differs from their commit order.
async fn order_violations(db: &DatabaseConnection, accounts_like: &str) -> Vec<String> {
    let rows = db
        .query_all_raw(Statement::from_sql_and_values(
            DbBackend::Postgres,
            "SELECT aggregate_id, seq, xmin::text AS txid, \
                    (extract(epoch FROM pg_xact_commit_timestamp(xmin)) * 1000000)::bigint AS committed_us \
             FROM outbox WHERE aggregate_id LIKE $1 ORDER BY aggregate_id, seq",
            [accounts_like.into()],
        ))
        .await
        .unwrap();
    let rows: Vec<(String, i64, String, i64)> = rows
        .iter()
        .map(|r| {
            (
                r.try_get("", "aggregate_id").unwrap(),
                r.try_get("", "seq").unwrap(),
                r.try_get("", "txid").unwrap(),
                r.try_get("", "committed_us").unwrap(),
            )
        })
        .collect();
    rows.windows(2)
        .filter(|w| w[0].0 == w[1].0 && w[0].2 != w[1].2 && w[0].3 >= w[1].3)
        .map(|w| format!("{}: seq {} committed after seq {}", w[0].0, w[0].1, w[1].1))
        .collect()
}

async fn backend_pid(conn: &impl ConnectionTrait) -> i32 {
    conn.query_one_raw(Statement::from_string(
        DbBackend::Postgres,
        "SELECT pg_backend_pid()",
    ))
    .await
    .unwrap()
    .unwrap()
    .try_get_by_index(0)
    .unwrap()
}

/// Waits until backend `pid` is blocked on an advisory lock, or panics after 10 s.
async fn wait_until_blocked(db: &DatabaseConnection, pid: i32) {
    let deadline = Instant::now() + Duration::from_secs(10);
    let sql = format!(
        "SELECT COUNT(*) AS n FROM pg_locks WHERE pid = {pid} AND locktype = 'advisory' AND NOT granted"
    );
    while count(db, &sql).await == 0 {
        assert!(
            Instant::now() < deadline,
            "the second writer never waited for the aggregate's lock"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Writer 1 records and holds its transaction open; writer 2 records the same aggregate and tries
/// to commit first. `record` makes writer 2 wait, so its event gets the later `seq`.
#[tokio::test]
async fn a_second_writer_of_an_aggregate_waits_for_the_first_commit() {
    let db = postgres().await;
    let account = format!("acct-{}", Uuid::now_v7());

    let first = db.begin().await.unwrap();
    let first_id = Deposited {
        account: account.clone(),
        writer: 1,
        step: 0,
    }
    .record(&first)
    .await
    .unwrap();

    let (pid_tx, pid_rx) = tokio::sync::oneshot::channel();
    let second = tokio::spawn({
        let (db, account) = (db.clone(), account.clone());
        async move {
            let txn = db.begin().await.unwrap();
            pid_tx.send(backend_pid(&txn).await).unwrap();
            let id = Deposited {
                account,
                writer: 2,
                step: 0,
            }
            .record(&txn)
            .await
            .unwrap();
            txn.commit().await.unwrap();
            id
        }
    });
    wait_until_blocked(&db, pid_rx.await.unwrap()).await;
    first.commit().await.unwrap();
    let second_id = second.await.unwrap();

    assert_eq!(order_violations(&db, &account).await, Vec::<String>::new());
    let seq_of = |id: Uuid| format!("SELECT seq AS n FROM outbox WHERE id = '{id}'");
    assert!(count(&db, &seq_of(first_id)).await < count(&db, &seq_of(second_id)).await);
}

/// The control: the same two writers with a bare INSERT, as a writer that bypasses `record` would
/// do. Writer 2 commits first with the later `seq`, and the check above sees it.
#[tokio::test]
async fn without_the_lock_the_check_sees_the_violation() {
    let db = postgres().await;
    let account = format!("acct-{}", Uuid::now_v7());
    let bare_insert = |writer: usize| {
        format!(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
             VALUES ('{}', 'account', '{account}', 'Deposited', '{{\"writer\": {writer}}}')",
            Uuid::now_v7()
        )
    };
    let first = db.begin().await.unwrap();
    first.execute_unprepared(&bare_insert(1)).await.unwrap();
    let second = db.begin().await.unwrap();
    second.execute_unprepared(&bare_insert(2)).await.unwrap();
    second.commit().await.unwrap();
    first.commit().await.unwrap();

    assert_eq!(order_violations(&db, &account).await.len(), 1);
}

/// Eight writers, a few hot aggregates, transactions held open for a varying time between record
/// and commit, some recording two aggregates at once in varying order (record_all locks them in one
/// canonical order, so none deadlocks).
#[tokio::test]
async fn many_concurrent_writers_keep_commit_order_per_aggregate() {
    let db = postgres().await;
    let like = record_concurrently(&db, |_, _| Box::pin(async {})).await;
    assert_eq!(order_violations(&db, &like).await, Vec::<String>::new());
}

/// What a writer does last before its commit (MariaDB's test takes its commit ticket there).
type BeforeCommit =
    for<'t> fn(
        &'t seaorm_outbox::sea_orm::DatabaseTransaction,
        Vec<Uuid>,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + 't>>;

/// Eight writers record 40 times each over four hot aggregates, holding each transaction open
/// 0-3 ms so they overlap; every third transaction records two aggregates in varying order.
/// Checks that every event was recorded; returns the pattern of the aggregates' ids.
async fn record_concurrently(db: &DatabaseConnection, before_commit: BeforeCommit) -> String {
    const WRITERS: usize = 8;
    const STEPS: usize = 40;
    let run = Uuid::now_v7();
    let accounts: Vec<String> = (0..4).map(|i| format!("hot-{run}-{i}")).collect();

    let writers = (0..WRITERS).map(|writer| {
        let (db, accounts) = (db.clone(), accounts.clone());
        tokio::spawn(async move {
            for step in 0..STEPS {
                let a = &accounts[(writer + step) % accounts.len()];
                let b = &accounts[(writer * 3 + step * 7) % accounts.len()];
                let txn = db.begin().await.unwrap();
                let ids = if step % 3 == 0 {
                    let events = [a, b].map(|account| {
                        NewEvent::from_event(&Deposited {
                            account: account.clone(),
                            writer,
                            step,
                        })
                        .unwrap()
                    });
                    seaorm_outbox::record_new_events(&txn, events.into())
                        .await
                        .unwrap()
                } else {
                    let deposited = Deposited {
                        account: a.clone(),
                        writer,
                        step,
                    };
                    vec![deposited.record(&txn).await.unwrap()]
                };
                tokio::time::sleep(Duration::from_millis(((writer * 7 + step * 13) % 4) as u64))
                    .await;
                before_commit(&txn, ids).await;
                txn.commit().await.unwrap();
            }
        })
    });
    for writer in futures::future::join_all(writers).await {
        writer.unwrap();
    }

    let like = format!("hot-{run}-%");
    let expected = (WRITERS * STEPS + WRITERS * STEPS.div_ceil(3)) as i64;
    assert_eq!(
        count(
            db,
            &format!("SELECT COUNT(*) AS n FROM outbox WHERE aggregate_id LIKE '{like}'")
        )
        .await,
        expected
    );
    like
}

/// The same guarantee on MariaDB (MySQL's row lock on the aggregate's `outbox_lock` bucket).
///
/// MariaDB keeps no commit timestamps, so each writer takes a ticket as its transaction's last
/// statement: a counter row whose lock it holds until commit, so the next writer gets the next
/// ticket only after this one committed. Ticket order is commit order.
mod mariadb {
    use super::*;

    async fn mariadb() -> DatabaseConnection {
        let db = database(Backend::MariaDb).await;
        db.execute_unprepared(
            "CREATE TABLE commit_ticket (n BIGINT NOT NULL);
             INSERT INTO commit_ticket VALUES (0);
             CREATE TABLE tickets (id CHAR(36) PRIMARY KEY, ticket BIGINT NOT NULL);",
        )
        .await
        .unwrap();
        db
    }

    /// Takes the next commit ticket for the events `ids`: the transaction's last statement.
    async fn take_ticket(txn: &impl ConnectionTrait, ids: &[Uuid]) {
        txn.execute_unprepared("UPDATE commit_ticket SET n = LAST_INSERT_ID(n + 1)")
            .await
            .unwrap();
        for id in ids {
            txn.execute_raw(Statement::from_sql_and_values(
                DbBackend::MySql,
                "INSERT INTO tickets (id, ticket) VALUES (?, LAST_INSERT_ID())",
                [id.to_string().into()],
            ))
            .await
            .unwrap();
        }
    }

    /// Every pair of events of one aggregate whose `seq` order differs from their commit order.
    async fn order_violations(db: &DatabaseConnection, accounts_like: &str) -> Vec<String> {
        let rows = db
            .query_all_raw(Statement::from_sql_and_values(
                DbBackend::MySql,
                "SELECT o.aggregate_id, o.seq, t.ticket FROM outbox o JOIN tickets t ON t.id = o.id
                 WHERE o.aggregate_id LIKE ? ORDER BY o.aggregate_id, o.seq",
                [accounts_like.into()],
            ))
            .await
            .unwrap();
        let rows: Vec<(String, i64, i64)> = rows
            .iter()
            .map(|r| {
                (
                    r.try_get("", "aggregate_id").unwrap(),
                    r.try_get("", "seq").unwrap(),
                    r.try_get("", "ticket").unwrap(),
                )
            })
            .collect();
        rows.windows(2)
            .filter(|w| w[0].0 == w[1].0 && w[0].2 > w[1].2)
            .map(|w| format!("{}: seq {} committed after seq {}", w[0].0, w[0].1, w[1].1))
            .collect()
    }

    /// The control: two writers with a bare INSERT, as a writer that bypasses `record` would do.
    /// Writer 2 commits first with the later `seq`, and the check sees it.
    #[tokio::test]
    async fn without_the_lock_the_check_sees_the_violation() {
        let db = mariadb().await;
        let account = format!("acct-{}", Uuid::now_v7());
        let bare_insert = |id: Uuid, writer: usize| {
            format!(
                "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
                 VALUES ('{id}', 'account', '{account}', 'Deposited', '{{\"writer\": {writer}}}')"
            )
        };
        let (one, two) = (Uuid::now_v7(), Uuid::now_v7());
        let first = db.begin().await.unwrap();
        first
            .execute_unprepared(&bare_insert(one, 1))
            .await
            .unwrap();
        let second = db.begin().await.unwrap();
        second
            .execute_unprepared(&bare_insert(two, 2))
            .await
            .unwrap();
        take_ticket(&second, &[two]).await;
        second.commit().await.unwrap();
        take_ticket(&first, &[one]).await;
        first.commit().await.unwrap();

        assert_eq!(order_violations(&db, &account).await.len(), 1);
    }

    /// The PostgreSQL test's writers, each taking its ticket last (buckets are locked in one
    /// canonical order, so none deadlocks).
    #[tokio::test]
    async fn many_concurrent_writers_keep_commit_order_per_aggregate() {
        let db = mariadb().await;
        let like = record_concurrently(&db, |txn, ids| {
            Box::pin(async move { take_ticket(txn, &ids).await })
        })
        .await;
        assert_eq!(order_violations(&db, &like).await, Vec::<String>::new());
    }
}
