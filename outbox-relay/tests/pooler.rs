//! A relay behind PgBouncer (Debian's, started here) in transaction mode: its statements run in
//! whichever server session is free, so its session locks (the shard leases) would not be its
//! own, and two replicas could publish one shard. The relay finds out at start and refuses with a
//! clear error; in session mode, the same relay runs. With a pool of one server session, which
//! passes that check, the relay's connections share the session and their prepared statements
//! collide: that is refused too, with the same advice.

mod common;

use common::{Fixture, relay_command};
use seaorm_outbox::sea_orm::ConnectionTrait;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A PgBouncer in front of the test PostgreSQL's `database`, in `pool_mode`, stopped when dropped.
struct PgBouncer {
    child: std::process::Child,
    port: u16,
    _dir: Dir,
}

/// A directory the `postgres` user can read (PgBouncer refuses to run as root, and the run's
/// temporary folder is private), removed when dropped.
struct Dir(std::path::PathBuf);

impl Dir {
    fn new() -> Dir {
        let path = std::path::PathBuf::from(format!(
            "/tmp/outbox-pgbouncer-{}",
            seaorm_outbox::Uuid::now_v7().simple()
        ));
        std::fs::create_dir_all(&path).unwrap();
        Dir(path)
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl PgBouncer {
    /// Round robin over up to `pool_size` server sessions.
    fn start(database: &str, pool_mode: &str, pool_size: u32) -> PgBouncer {
        let url = outbox_tests::postgres_url();
        let (_, rest) = url.split_once('@').unwrap();
        let (authority, _) = rest.split_once('/').unwrap();
        let (host, port) = authority.rsplit_once(':').unwrap();
        let listen = common::free_port();
        let dir = Dir::new();
        let ini = dir.0.join("pgbouncer.ini");
        let users = dir.0.join("users.txt");
        std::fs::write(&users, "\"postgres\" \"\"\n").unwrap();
        // Round robin over a few server sessions: consecutive statements go to different ones, as
        // they do on a busy pooler.
        std::fs::write(
            &ini,
            format!(
                "[databases]\n{database} = host={host} port={port} dbname={database} user=postgres\n\
                 [pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = {listen}\nunix_socket_dir =\n\
                 auth_type = trust\nauth_file = {users}\npool_mode = {pool_mode}\n\
                 server_round_robin = 1\ndefault_pool_size = {pool_size}\n\
                 ignore_startup_parameters = options,extra_float_digits\n",
                users = users.display()
            ),
        )
        .unwrap();
        let _ = Command::new("chown")
            .args(["-R", "postgres:", dir.0.to_str().unwrap()])
            .status();
        // Started as root, it runs as postgres (`-u`): it refuses to run as root.
        let child = Command::new("pgbouncer")
            .args(["-u", "postgres"])
            .arg(&ini)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("cannot start pgbouncer ({e}): scripts/setup installs it (apt pgbouncer)")
            });
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", listen)).is_err() {
            assert!(
                Instant::now() < deadline,
                "pgbouncer did not listen on {listen}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        PgBouncer {
            child,
            port: listen,
            _dir: dir,
        }
    }

    fn url(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.port)
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A database of its own, migrated: PgBouncer passes no search_path (it ignores `options`), so
/// the outbox is in its public schema. The fixture watches it from the test PostgreSQL.
async fn pooled_database() -> (Fixture, String) {
    let database = format!("pooled_{}", seaorm_outbox::Uuid::now_v7().simple());
    let admin = Fixture::new().await;
    admin
        .db
        .execute_unprepared(&format!("CREATE DATABASE {database}"))
        .await
        .unwrap();
    let direct = {
        let url = outbox_tests::postgres_url();
        let (base, _) = url.rsplit_once('/').unwrap();
        format!("{base}/{database}")
    };
    common::migrate(&direct);
    (admin, database)
}

/// The relay behind `bouncer`, its log on a pipe.
fn spawn_relay(bouncer: &PgBouncer, database: &str) -> std::process::Child {
    relay_command()
        .args(["run", "--database-url", &bouncer.url(database)])
        .args(["--sink", "stdout", "--http-addr", "off"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Waits for `relay` to stop with exit code 1 and the pooler advice.
fn assert_refused(relay: &mut std::process::Child, otherwise: &str) {
    let (status, stderr) = common::wait_for_exit(relay, Duration::from_secs(30), otherwise);
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("pooler in transaction mode"), "{stderr}");
}

/// Transaction mode with a pool of one: every statement runs in the one server session, so the
/// session checks pass, but the relay's connections (the pump's, the sampler's, the pruner's)
/// share it, and a prepared statement one made is there when another makes its own. The relay
/// stops with the pooler advice instead of reconnecting for ever.
#[tokio::test]
async fn a_relay_behind_a_transaction_mode_pooler_of_one_session_refuses_to_run() {
    let (admin, database) = pooled_database().await;
    let bouncer = PgBouncer::start(&database, "transaction", 1);
    let mut relay = spawn_relay(&bouncer, &database);
    assert_refused(
        &mut relay,
        "the relay ran behind a transaction-mode pooler of one session",
    );
    drop(bouncer);
    admin
        .db
        .execute_unprepared(&format!("DROP DATABASE {database} WITH (FORCE)"))
        .await
        .unwrap();
}

#[tokio::test]
async fn a_relay_behind_a_transaction_mode_pooler_refuses_to_run() {
    let (admin, database) = pooled_database().await;
    let half_a_minute = Duration::from_secs(30);
    let sessions = format!("SELECT count(*) FROM pg_stat_activity WHERE datname = '{database}'");

    for (mode, refused) in [("transaction", true), ("session", false)] {
        let bouncer = PgBouncer::start(&database, mode, 4);
        if refused {
            // Four clients at once open four server sessions, which stay in the pool: the
            // relay's statements are then spread over them, as on a busy pooler.
            let clients: Vec<_> = (0..4)
                .map(|_| {
                    Command::new("psql")
                        .args([&bouncer.url(&database), "-qc", "SELECT pg_sleep(1)"])
                        .stdout(Stdio::null())
                        .spawn()
                        .expect("psql (scripts/setup installs postgresql-client)")
                })
                .collect();
            for mut client in clients {
                assert!(client.wait().unwrap().success());
            }
            let fewer_than_four = format!("SELECT greatest(4 - ({sessions}), 0)");
            admin.wait_until_zero(&fewer_than_four, half_a_minute).await;
        }
        let mut relay = spawn_relay(&bouncer, &database);
        if refused {
            assert_refused(&mut relay, "the relay ran behind a transaction-mode pooler");
        } else {
            // Running, and holding every shard through its one session.
            let shards_free = format!(
                "SELECT 256 - count(*) FROM pg_locks l JOIN pg_database d ON d.oid = l.database
                 WHERE d.datname = '{database}' AND l.locktype = 'advisory'
                   AND l.objid < 256 AND l.granted"
            );
            admin.wait_until_zero(&shards_free, half_a_minute).await;
            assert!(
                relay.try_wait().unwrap().is_none(),
                "the relay stopped in session mode"
            );
            common::signal(&relay, "TERM");
            let (status, stderr) =
                common::wait_for_exit(&mut relay, half_a_minute, "the relay ran on");
            assert_eq!(status.code(), Some(0), "{status:?}: {stderr}");
        }
        drop(bouncer);
        // The pool's server sessions, and any lock they held, gone before the next round.
        admin.wait_until_zero(&sessions, half_a_minute).await;
    }
    admin
        .db
        .execute_unprepared(&format!("DROP DATABASE {database} WITH (FORCE)"))
        .await
        .unwrap();
}
