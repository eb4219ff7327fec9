//! Tenant databases (`RelayConfig::tenants`, `--tenants FILE`) on a real PostgreSQL: one relay
//! process publishes the outboxes of several databases, each tenant's events in order; a tenant
//! whose database stops taking connections, or that is refused (and tried again), holds only
//! itself; a tenant added
//! to the file is served and one removed released without a restart; replicas share each tenant's
//! shards; `migrate` and `status` take the file; between ticks a tenant costs one connection.

mod common;

use common::Fixture;
use seaorm_outbox::OutboxEvent;
use seaorm_outbox::sea_orm::{ConnectionTrait, Database, DatabaseConnection, TransactionTrait};
use seaorm_outbox_relay::sink::memory::MemorySink;
use seaorm_outbox_relay::{Relay, Tenant, Tenants};
use serde::Serialize;
use std::collections::BTreeMap;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate = "account", key = "account_id")]
struct Credited {
    account_id: u64,
    tenant: String,
    n: u64,
}

/// Records `count` events of 5 accounts into `db`, numbered from `from`, in one transaction.
async fn record(db: &DatabaseConnection, tenant: &str, from: u64, count: u64) {
    let txn = db.begin().await.unwrap();
    for n in from..from + count {
        let event = Credited {
            account_id: n % 5,
            tenant: tenant.into(),
            n,
        };
        event.record(&txn).await.unwrap();
    }
    txn.commit().await.unwrap();
}

/// A database of its own on the test server, migrated: its URL and a connection.
async fn tenant_database(f: &Fixture, name: &str) -> (String, DatabaseConnection) {
    f.db.execute_unprepared(&format!("CREATE DATABASE {name}"))
        .await
        .unwrap();
    let server = outbox_tests::postgres_url();
    let url = format!("{}/{name}", &server[..server.rfind('/').unwrap()]);
    let db = Database::connect(&url).await.unwrap();
    seaorm_outbox::migration::migrate(&db).await.unwrap();
    (url, db)
}

async fn unpublished(db: &DatabaseConnection) -> i64 {
    outbox_tests::count(
        db,
        "SELECT count(*) AS n FROM outbox WHERE published_at IS NULL",
    )
    .await
}

async fn wait_published(db: &DatabaseConnection, what: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while unpublished(db).await > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "{what} was not published"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn one_relay_publishes_two_tenant_databases_and_a_tenant_down_holds_only_itself() {
    let f = Fixture::new().await;
    let name = format!("tenant_{}", seaorm_outbox::Uuid::now_v7().simple());
    let (globex_url, globex) = tenant_database(&f, &name).await;
    record(&f.db, "acme", 0, 100).await;
    record(&globex, "globex", 0, 100).await;

    let mut config = f.relay_config();
    config.tenants = Tenants::List(vec![
        Tenant::new("acme", f.url.clone()),
        Tenant::new("globex", globex_url.clone()),
    ]);
    config.max_backoff = Duration::from_millis(500);
    let sink = MemorySink::default();
    let shutdown = CancellationToken::new();
    let running = tokio::spawn({
        let (relay, shutdown) = (Relay::new(config, sink.clone()), shutdown.clone());
        async move { relay.run(shutdown).await }
    });
    wait_published(&f.db, "acme's outbox").await;
    wait_published(&globex, "globex's outbox").await;

    // Between its ticks a tenant's background work (backlog sampler, pruner) holds no
    // connection: the relay's connections to a tenant are its pump's, one per table.
    let connections = format!(
        "SELECT count(*) AS n FROM pg_stat_activity \
         WHERE datname = '{name}' AND application_name = 'outbox-relay'"
    );
    let mut fewest = i64::MAX;
    for _ in 0..10 {
        fewest = fewest.min(outbox_tests::count(&f.db, &connections).await);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(fewest, 1, "the relay's connections to globex between ticks");

    // Globex's database stops taking connections, and loses those it had (the relay's too).
    globex.close().await.unwrap();
    f.db.execute_unprepared(&format!("ALTER DATABASE {name} ALLOW_CONNECTIONS false"))
        .await
        .unwrap();
    f.db.execute_unprepared(&format!(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{name}'"
    ))
    .await
    .unwrap();
    // Acme's events go out meanwhile.
    record(&f.db, "acme", 100, 100).await;
    wait_published(&f.db, "acme's outbox, with globex down").await;
    assert!(
        !running.is_finished(),
        "the relay stopped with a tenant down"
    );

    // Globex back: what it records is published.
    f.db.execute_unprepared(&format!("ALTER DATABASE {name} ALLOW_CONNECTIONS true"))
        .await
        .unwrap();
    let globex = Database::connect(&globex_url).await.unwrap();
    record(&globex, "globex", 100, 100).await;
    wait_published(&globex, "globex's outbox, back").await;
    shutdown.cancel();
    running.await.unwrap().expect("the relay refused to run");

    // Every event of each tenant, each account's first deliveries in order.
    let mut received: BTreeMap<(String, String), Vec<u64>> = BTreeMap::new();
    for message in sink.messages() {
        let event: serde_json::Value = serde_json::from_slice(&message.payload).unwrap();
        let tenant = event["tenant"].as_str().unwrap().to_owned();
        let n = event["n"].as_u64().unwrap();
        let seen = received.entry((tenant, message.key.clone())).or_default();
        if !seen.contains(&n) {
            seen.push(n);
        }
    }
    assert_eq!(received.len(), 10, "{:?}", received.keys());
    for ((tenant, key), ns) in &received {
        let expected: Vec<u64> = (0..200).filter(|n| (n % 5).to_string() == *key).collect();
        assert_eq!(ns, &expected, "tenant {tenant}, account {key}");
    }
    globex.close().await.unwrap();
    f.db.execute_unprepared(&format!("DROP DATABASE {name} WITH (FORCE)"))
        .await
        .unwrap();
}

/// Shard leases `outbox-relay` holds on the outbox table that `db` names `outbox`.
async fn leased(db: &DatabaseConnection) -> i64 {
    shard_leases(db, "count(*)").await
}

/// How many relay sessions hold shards of the outbox `db` names `outbox`.
async fn holders(db: &DatabaseConnection) -> i64 {
    shard_leases(db, "count(DISTINCT pid)").await
}

/// `counted` over the shard leases of the outbox `db` names `outbox`.
async fn shard_leases(db: &DatabaseConnection, counted: &str) -> i64 {
    let sql = format!(
        "SELECT {counted} AS n FROM pg_locks WHERE locktype = 'advisory' AND granted \
           AND objsubid = 2 AND objid < 256 \
           AND classid = hashtext('outbox-relay:' || 'outbox'::regclass::oid::text)::oid"
    );
    outbox_tests::count(db, &sql).await
}

#[tokio::test]
async fn a_tenant_added_to_the_file_is_served_and_one_removed_released_without_a_restart() {
    let f = Fixture::new().await;
    let name = format!("tenant_{}", seaorm_outbox::Uuid::now_v7().simple());
    let (globex_url, globex) = tenant_database(&f, &name).await;
    // Initech's outbox is a WAL relay's (its publication): polling it too would publish its
    // events twice, so it is refused, alone.
    let initech_name = format!("tenant_{}", seaorm_outbox::Uuid::now_v7().simple());
    let (initech_url, initech) = tenant_database(&f, &initech_name).await;
    initech
        .execute_unprepared("CREATE PUBLICATION outbox_relay FOR TABLE outbox")
        .await
        .unwrap();
    let tenants = outbox_tests::temp_dir().join("tenants");
    let list = |names: &[&str]| {
        let urls = [
            ("acme", &f.url),
            ("globex", &globex_url),
            ("initech", &initech_url),
        ];
        let lines: Vec<String> = urls
            .iter()
            .filter(|(name, _)| names.contains(name))
            .map(|(name, url)| format!("{name} {url}"))
            .collect();
        std::fs::write(&tenants, format!("# tenants\n{}\n", lines.join("\n"))).unwrap();
    };

    // A file the relay cannot use is one line and exit code 2, without the URL's password.
    std::fs::write(
        &tenants,
        "acme postgres://relay:tenant-s3cret@db/acme sslmode=require\n",
    )
    .unwrap();
    let refused = common::relay_command()
        .args(["run", "--database-url", &f.url, "--tenants"])
        .arg(&tenants)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(2), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(stderr.contains("line 1: expected `name url`"), "{stderr}");
    assert!(!stderr.contains("tenant-s3cret"), "{stderr}");
    // So is the WAL source with tenants.
    list(&["acme"]);
    let wal = common::relay_command()
        .args([
            "run",
            "--database-url",
            &f.url,
            "--source",
            "wal",
            "--tenants",
        ])
        .arg(&tenants)
        .output()
        .unwrap();
    assert_eq!(wal.status.code(), Some(2), "{wal:?}");

    list(&["acme", "initech"]);
    record(&f.db, "acme", 0, 50).await;
    record(&globex, "globex", 0, 50).await;
    record(&initech, "initech", 0, 5).await;
    let tenants_arg = tenants.to_str().unwrap();
    let port = common::free_port();
    let addr = format!("127.0.0.1:{port}");
    let mut relay = f.spawn_relay(&["--tenants", tenants_arg, "--http-addr", &addr]);
    wait_published(&f.db, "acme's outbox").await;
    assert_eq!(
        unpublished(&globex).await,
        50,
        "globex published before it was listed"
    );
    let initech_refused = |log: &str| {
        log.lines().any(|l| {
            l.contains("refused") && l.contains("tenant=initech") && l.contains("publication")
        })
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !initech_refused(&relay.log()) {
        assert!(
            std::time::Instant::now() < deadline,
            "initech not refused:\n{}",
            relay.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Globex added: served without a restart.
    list(&["acme", "globex", "initech"]);
    wait_published(&globex, "globex's outbox, once listed").await;
    // Each tenant's gauges under its name.
    let (_, metrics) = common::http_get_when_up(port, "/metrics").await;
    for tenant in ["acme", "globex"] {
        let leased = format!(r#"outbox_shards_leased{{table="outbox",tenant="{tenant}"}} 256"#);
        assert!(
            metrics.contains(&leased),
            "/metrics lacks {leased}:\n{metrics}"
        );
    }

    // Acme removed: its pump leaves, releasing its shards, and what it records waits.
    assert_eq!(leased(&f.db).await, 256);
    list(&["globex", "initech"]);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while leased(&f.db).await > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "acme's shards were not released"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Its gauges go to zero rather than keep what it last sampled.
    let released = r#"outbox_shards_leased{table="outbox",tenant="acme"} 0"#;
    loop {
        let (_, metrics) = common::http_get_when_up(port, "/metrics").await;
        if metrics.contains(released) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "/metrics lacks {released}:\n{metrics}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    record(&f.db, "acme", 50, 10).await;
    record(&globex, "globex", 50, 10).await;
    wait_published(&globex, "globex's outbox, after acme left").await;
    assert_eq!(
        unpublished(&f.db).await,
        10,
        "acme published after it was removed"
    );
    assert_eq!(leased(&globex).await, 256);
    assert_eq!(
        unpublished(&initech).await,
        5,
        "initech's outbox was polled"
    );
    // The refusal's cause gone, initech is tried again (every 30 s) with its line unchanged.
    initech
        .execute_unprepared("DROP PUBLICATION outbox_relay")
        .await
        .unwrap();
    wait_published(&initech, "initech's outbox, its refusal's cause gone").await;
    assert!(relay.try_wait().unwrap().is_none(), "{}", relay.log());
    assert_eq!(common::terminate(&mut relay), Some(0));

    // The commands on the same file: `migrate` and `status` on each tenant's database...
    let command = |args: &[&str]| {
        common::relay_command()
            .args(args)
            .args(["--tenants", tenants_arg])
            .output()
            .unwrap()
    };
    let migrated = command(&["migrate", "--table", "billing_outbox"]);
    let stdout = String::from_utf8_lossy(&migrated.stdout);
    assert!(migrated.status.success(), "{migrated:?}");
    for tenant in ["globex", "initech"] {
        let line = format!("(tenant {tenant}, table billing_outbox)");
        assert!(stdout.contains(&line), "{stdout}");
    }
    assert_eq!(
        outbox_tests::count(&globex, "SELECT count(*) AS n FROM billing_outbox").await,
        0
    );
    let status = command(&["status"]);
    let stdout = String::from_utf8_lossy(&status.stdout);
    assert!(status.status.success(), "{status:?}");
    assert!(
        stdout.starts_with("tenant globex, table outbox:\nbacklog:            0"),
        "{stdout}"
    );
    assert!(
        stdout.contains("\n\ntenant initech, table outbox:\nbacklog:            0"),
        "{stdout}"
    );
    // ... and `failed`, which works on one database, refuses the list.
    let failed = command(&["failed", "list"]);
    assert_eq!(failed.status.code(), Some(2), "{failed:?}");

    for (db, name) in [(globex, name), (initech, initech_name)] {
        db.close().await.unwrap();
        f.db.execute_unprepared(&format!("DROP DATABASE {name} WITH (FORCE)"))
            .await
            .unwrap();
    }
}

#[tokio::test]
async fn replicas_given_one_tenants_file_share_each_tenants_shards() {
    let f = Fixture::new().await;
    let name = format!("tenant_{}", seaorm_outbox::Uuid::now_v7().simple());
    let (globex_url, globex) = tenant_database(&f, &name).await;
    let tenants = outbox_tests::temp_dir().join("tenants");
    std::fs::write(&tenants, format!("acme {}\nglobex {globex_url}\n", f.url)).unwrap();
    let tenants = tenants.to_str().unwrap();
    let mut first = f.spawn_relay(&["--tenants", tenants]);
    let mut second = f.spawn_relay(&["--tenants", tenants]);

    // Each tenant's 256 shards, split between the two.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let split = [
            (holders(&f.db).await, leased(&f.db).await),
            (holders(&globex).await, leased(&globex).await),
        ];
        if split == [(2, 256), (2, 256)] {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "not shared: {split:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    record(&f.db, "acme", 0, 200).await;
    record(&globex, "globex", 0, 200).await;
    wait_published(&f.db, "acme's outbox").await;
    wait_published(&globex, "globex's outbox").await;

    // One replica gone: the other takes every shard of each tenant.
    assert_eq!(common::terminate(&mut first), Some(0));
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while (
        holders(&f.db).await,
        leased(&f.db).await,
        holders(&globex).await,
        leased(&globex).await,
    ) != (1, 256, 1, 256)
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the remaining replica did not take over"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    record(&globex, "globex", 200, 20).await;
    wait_published(&globex, "globex's outbox, one replica left").await;
    assert_eq!(common::terminate(&mut second), Some(0));

    globex.close().await.unwrap();
    f.db.execute_unprepared(&format!("DROP DATABASE {name} WITH (FORCE)"))
        .await
        .unwrap();
}

#[tokio::test]
async fn tenants_from_a_catalogue_query_are_served_as_rows_come_and_go() {
    let f = Fixture::new().await;
    let name = format!("tenant_{}", seaorm_outbox::Uuid::now_v7().simple());
    let (globex_url, globex) = tenant_database(&f, &name).await;
    // The catalogue: the relay's own database (--database-url), here the fixture's.
    f.db.execute_unprepared("CREATE TABLE tenants (name text, url text, active boolean)")
        .await
        .unwrap();
    let add =
        |tenant: &str, url: &str| format!("INSERT INTO tenants VALUES ('{tenant}', '{url}', true)");
    f.db.execute_unprepared(&add("acme", &f.url)).await.unwrap();
    record(&f.db, "acme", 0, 50).await;
    record(&globex, "globex", 0, 50).await;
    let query = "SELECT name, url FROM tenants WHERE active";
    let mut relay = f.spawn_relay(&["--tenants-query", query]);
    wait_published(&f.db, "acme's outbox").await;
    assert_eq!(
        unpublished(&globex).await,
        50,
        "globex published before its row"
    );

    // Globex's row: served without a restart.
    f.db.execute_unprepared(&add("globex", &globex_url))
        .await
        .unwrap();
    wait_published(&globex, "globex's outbox, once in the catalogue").await;
    assert!(relay.try_wait().unwrap().is_none(), "{}", relay.log());
    assert_eq!(common::terminate(&mut relay), Some(0));

    // `status` reads the same catalogue.
    let status = common::relay_command()
        .args(["status", "--database-url", &f.url, "--tenants-query", query])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&status.stdout);
    assert!(status.status.success(), "{status:?}");
    assert!(
        stdout.starts_with("tenant acme, table outbox:\n"),
        "{stdout}"
    );
    assert!(
        stdout.contains("\n\ntenant globex, table outbox:\n"),
        "{stdout}"
    );

    globex.close().await.unwrap();
    f.db.execute_unprepared(&format!("DROP DATABASE {name} WITH (FORCE)"))
        .await
        .unwrap();
}
