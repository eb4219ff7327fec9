//! Peers that vanish without closing their connections (a host powered off, a network cut) on a
//! real PostgreSQL: the relay's sessions carry TCP keepalives and its calls a time limit, so a
//! vanished replica's shard leases move, and a relay cut off from its database reconnects, in
//! about half a minute instead of the kernel's hours; a WAL relay's stream is checked when it is
//! silent, and the server ends the stream of a vanished WAL relay for its standby.
//!
//! A peer vanishes when its process is stopped and every packet of its connections is dropped on
//! the loopback interface (iptables): nothing answers for it any more, not even its kernel. These
//! tests need root and iptables (`scripts/setup` installs it).

mod common;

use common::wal::WalFixture;
use common::{Fixture, KillOnDrop};
use seaorm_outbox::sea_orm::ConnectionTrait;
use std::process::Command;
use std::time::{Duration, Instant};

/// One test at a time: each measures how long a takeover takes.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Drops every packet from and to some local ports on the loopback interface while it lives.
struct Blackhole {
    rules: Vec<Vec<String>>,
}

impl Blackhole {
    fn of(ports: &[u16]) -> Blackhole {
        let mut rules = Vec::new();
        for port in ports {
            for direction in ["--sport", "--dport"] {
                let rule: Vec<String> = ["INPUT", "-i", "lo", "-p", "tcp", direction]
                    .map(str::to_owned)
                    .into_iter()
                    .chain([port.to_string(), "-j".into(), "DROP".into()])
                    .collect();
                iptables("-I", &rule);
                rules.push(rule);
            }
        }
        Blackhole { rules }
    }
}

impl Drop for Blackhole {
    fn drop(&mut self) {
        for rule in &self.rules {
            iptables("-D", rule);
        }
    }
}

fn iptables(action: &str, rule: &[String]) {
    let status = Command::new("iptables")
        .arg(action)
        .args(rule)
        .status()
        .unwrap_or_else(|e| {
            panic!("cannot run iptables ({e}): these tests need it, and root (scripts/setup installs it)")
        });
    assert!(
        status.success(),
        "iptables {action} {rule:?} failed (root needed)"
    );
}

/// The port PostgreSQL listens on, from the fixture's URL.
fn postgres_port(f: &Fixture) -> u16 {
    let (_, host) = f.url.rsplit_once('@').expect("a URL with a user");
    let authority = host.split('/').next().unwrap();
    authority.rsplit_once(':').unwrap().1.parse().unwrap()
}

/// The local ports of `pid`'s established TCP connections to PostgreSQL.
fn connections_of(pid: u32, postgres: u16) -> Vec<u16> {
    let listed = Command::new("ss")
        .args(["-tnpH", "state", "established"])
        .output()
        .expect("ss (iproute2)");
    let owner = format!("pid={pid},");
    String::from_utf8_lossy(&listed.stdout)
        .lines()
        .filter(|line| line.contains(&owner))
        .filter_map(|line| {
            let columns: Vec<&str> = line.split_whitespace().collect();
            let (local, peer) = (columns.get(2)?, columns.get(3)?);
            if !peer.ends_with(&format!(":{postgres}")) {
                return None;
            }
            local.rsplit_once(':')?.1.parse().ok()
        })
        .collect()
}

/// How many shard leases the sessions on `ports` hold.
async fn shards_held(f: &Fixture, ports: &[u16]) -> i64 {
    if ports.is_empty() {
        return 0;
    }
    let ports: Vec<String> = ports.iter().map(u16::to_string).collect();
    f.scalar(&format!(
        "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
         WHERE l.locktype = 'advisory' AND l.granted AND l.objid < 256
           AND a.client_port IN ({})",
        ports.join(",")
    ))
    .await
}

/// Waits until the relay `pid` holds `shards` leases (its connections may change meanwhile);
/// returns how long it took.
async fn wait_until_holding(
    f: &Fixture,
    pid: u32,
    shards: impl Fn(i64) -> bool,
    timeout: Duration,
) -> Duration {
    let started = Instant::now();
    loop {
        let ports = connections_of(pid, postgres_port(f));
        if shards(shards_held(f, &ports).await) {
            return started.elapsed();
        }
        assert!(
            started.elapsed() < timeout,
            "relay {pid} still does not hold the shards after {timeout:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn record(f: &Fixture, n: usize) {
    f.db.execute_unprepared(&format!(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
         SELECT gen_random_uuid(), 'order', 'o-' || i, 'OrderPlaced', '{{}}'
         FROM generate_series(1, {n}) i"
    ))
    .await
    .unwrap();
}

/// A replica whose host vanishes: PostgreSQL's keepalive probes go unanswered, it ends the
/// replica's sessions after about 30 s (10 s idle, then 4 probes 5 s apart), and the other replica
/// takes every shard and publishes everything.
#[tokio::test]
async fn a_vanished_replicas_shards_move_within_about_half_a_minute() {
    let _one = ONE_AT_A_TIME.lock().await;
    let f = Fixture::new().await;
    let mut first = f.spawn_relay(&[]);
    wait_until_holding(&f, first.id(), |n| n == 256, Duration::from_secs(30)).await;
    let second = f.spawn_relay(&[]);
    wait_until_holding(&f, second.id(), |n| n > 0, Duration::from_secs(30)).await;
    record(&f, 200).await;
    f.wait_until_drained(Duration::from_secs(30)).await;

    common::signal(&first, "STOP");
    let hole = Blackhole::of(&connections_of(first.id(), postgres_port(&f)));
    record(&f, 200).await;
    let took = wait_until_holding(&f, second.id(), |n| n == 256, Duration::from_secs(120)).await;
    eprintln!("the vanished replica's shards moved after {took:?}");
    f.wait_until_drained(Duration::from_secs(30)).await;

    drop(hole);
    let _ = first.kill();
    drop(second);
}

/// A relay whose database's host vanishes mid-run: its calls are given up after twice the
/// statement timeout and it reconnects; once PostgreSQL ended the old sessions (keepalives), the
/// relay holds its shards again and publishes what was recorded meanwhile.
#[tokio::test]
async fn a_relay_cut_off_from_its_database_reconnects() {
    let _one = ONE_AT_A_TIME.lock().await;
    let f = Fixture::new().await;
    let relay: KillOnDrop = f.spawn_relay(&["--statement-timeout", "2s"]);
    wait_until_holding(&f, relay.id(), |n| n == 256, Duration::from_secs(30)).await;
    record(&f, 10).await;
    f.wait_until_drained(Duration::from_secs(30)).await;

    let hole = Blackhole::of(&connections_of(relay.id(), postgres_port(&f)));
    let cut = Instant::now();
    record(&f, 10).await;
    f.wait_until_drained(Duration::from_secs(120)).await;
    eprintln!("published again {:?} after the cut", cut.elapsed());
    let log = relay.log();
    assert!(
        log.contains("no answer from the database within 4s"),
        "the relay gave up on its silent connection: {log}"
    );
    drop(hole);
}

/// The server process streaming the fixture's slot (0 when none does).
async fn streaming_to(w: &WalFixture) -> i64 {
    w.f.scalar(&format!(
        "SELECT coalesce(max(active_pid), 0)::bigint FROM pg_replication_slots WHERE slot_name = '{}'",
        w.source.slot
    ))
    .await
}

/// A WAL relay whose database's host vanishes mid-run: its idle stream is silent anyway, so the
/// relay checks over its plain connection after 10 s of silence; the check goes unanswered
/// within the call limit and the relay reconnects, waits as a standby until PostgreSQL ends the
/// old stream (keepalives: about 30 s), and publishes what was recorded meanwhile.
#[tokio::test]
async fn a_wal_relay_cut_off_from_its_database_reconnects() {
    let _one = ONE_AT_A_TIME.lock().await;
    let w = WalFixture::new().await;
    let relay = w.spawn_relay(&["--statement-timeout", "2s"]);
    w.wait_for_slot().await;
    w.wait_until_reading().await;
    record(&w.f, 10).await;
    w.wait_until_confirmed(Duration::from_secs(30)).await;
    let old_stream = streaming_to(&w).await;

    let hole = Blackhole::of(&connections_of(relay.id(), postgres_port(&w.f)));
    let cut = Instant::now();
    record(&w.f, 10).await;
    w.wait_until_confirmed(Duration::from_secs(120)).await;
    eprintln!("published again {:?} after the cut", cut.elapsed());
    assert_ne!(streaming_to(&w).await, old_stream, "a new stream");
    let log = relay.log();
    assert!(
        log.contains("no answer from the database within 4s"),
        "the relay gave up on its silent stream: {log}"
    );
    drop(hole);
    drop(relay);
    w.drop_slot().await;
}

/// A WAL relay whose host vanishes: PostgreSQL's keepalive probes on the stream go unanswered,
/// it ends the stream after about 30 s, and the standby takes the slot and publishes what was
/// recorded meanwhile. (The vanished relay's stream has `wal_sender_timeout` off, which would
/// end it after 60 s anyway: here only the keepalives can.)
#[tokio::test]
async fn a_vanished_wal_relays_slot_goes_to_its_standby_within_about_half_a_minute() {
    let _one = ONE_AT_A_TIME.lock().await;
    let w = WalFixture::new().await;
    assert!(w.f.url.contains("options=-c%20search_path"), "{}", w.f.url);
    let without_timeout = WalFixture {
        f: Fixture {
            url: w
                .f
                .url
                .replacen("options=", "options=-c%20wal_sender_timeout%3D0%20", 1),
            ..w.f.clone()
        },
        source: w.source.clone(),
    };
    let first = without_timeout.spawn_relay(&[]);
    w.wait_for_slot().await;
    w.wait_until_reading().await;
    let standby = w.spawn_relay(&[]);
    record(&w.f, 10).await;
    w.wait_until_confirmed(Duration::from_secs(30)).await;

    common::signal(&first, "STOP");
    let hole = Blackhole::of(&connections_of(first.id(), postgres_port(&w.f)));
    let cut = Instant::now();
    record(&w.f, 10).await;
    w.wait_until_confirmed(Duration::from_secs(120)).await;
    eprintln!(
        "the standby took the slot and published {:?} after the cut",
        cut.elapsed()
    );
    let pids = connections_of(standby.id(), postgres_port(&w.f));
    assert!(!pids.is_empty(), "the standby is connected");
    drop(hole);
    drop(first);
    drop(standby);
    w.drop_slot().await;
}
