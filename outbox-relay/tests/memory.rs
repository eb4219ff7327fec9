//! The relay's memory is bounded by its settings, not by what the outbox holds: a backlog of rows
//! near the payload limit, published to a real Kafka by the relay binary, while its peak resident
//! memory (`VmHWM`) stays under a bound derived from `--max-batch-bytes`.

mod common;

use common::Fixture;
use seaorm_outbox::sea_orm::ConnectionTrait;
use std::time::Duration;

/// 400 rows of 900 kB: 360 MB, far more than a batch may hold and three times the bound.
const ROWS: i64 = 400;
const PAYLOAD: usize = 900_000;
const MAX_BATCH_BYTES: usize = 8 << 20;

#[tokio::test]
async fn peak_memory_follows_the_batch_byte_limit_not_the_backlog() {
    let f = Fixture::new().await;
    f.db.execute_unprepared(&format!(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
         SELECT gen_random_uuid(), 'blob', 'b-' || (g % 7), 'Stored',
                jsonb_build_object('n', g, 'data', repeat(md5(g::text), {}))
         FROM generate_series(1, {ROWS}) g",
        PAYLOAD / 32
    ))
    .await
    .unwrap();

    let mut relay = f.spawn_relay(&["--max-batch-bytes", &MAX_BATCH_BYTES.to_string()]);
    f.wait_until_drained(Duration::from_secs(120)).await;
    let peak = peak_resident_bytes(relay.id());
    assert_eq!(common::terminate(&mut relay), Some(0));
    assert_eq!(
        f.scalar("SELECT count(*) FROM outbox WHERE published_at IS NOT NULL")
            .await,
        ROWS
    );

    // The process itself (code, runtime, librdkafka's threads) takes some tens of MB. Live at
    // once: at most two batches in flight, each held by the relay and copied into librdkafka's
    // queue until acked (four batches). Freed ones: mimalloc returns a freed batch's pages to the
    // OS only when the thread that freed them allocates again after its purge delay, so an idle
    // worker keeps up to a batch or so (73-81 MiB measured with `MIMALLOC_PURGE_DELAY=0`,
    // 94-114 MiB with the binary's defaults): up to four more batches.
    let bound = (64 << 20) + 8 * MAX_BATCH_BYTES;
    eprintln!(
        "peak resident memory: {} MiB (bound {} MiB; backlog {} MiB)",
        peak >> 20,
        bound >> 20,
        (ROWS as usize * PAYLOAD) >> 20
    );
    assert!(
        peak < bound,
        "the relay peaked at {} MiB, over {} MiB",
        peak >> 20,
        bound >> 20
    );
}

/// The peak resident set of process `pid` so far, from `/proc/<pid>/status`.
fn peak_resident_bytes(pid: u32) -> usize {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("the relay runs");
    let kb: usize = status
        .lines()
        .find_map(|line| line.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM in /proc/<pid>/status");
    kb * 1024
}
