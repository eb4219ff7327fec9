//! The Kafka broker's garbage-collection pauses during a measurement, from the GC log that
//! `scripts/services` gives the test broker (`$OUTBOX_KAFKA_DATA/gc.log`). On two shared cores a
//! stop-the-world pause holds every produce request that arrives meanwhile, so the pauses are the
//! first suspect of a latency tail past the relay's hand-over to the sink.

use std::time::{SystemTime, UNIX_EPOCH};

/// The pauses that ended within a time window.
#[derive(Debug, Clone, Copy, Default)]
pub struct Pauses {
    pub count: usize,
    pub total_ms: f64,
    pub max_ms: f64,
}

/// The broker's pauses that ended between `from` and `to`, or `None` when there is no GC log
/// (a broker not started by `scripts/services`).
pub fn between(from: SystemTime, to: SystemTime) -> Option<Pauses> {
    let dir = std::env::var("OUTBOX_KAFKA_DATA").ok()?;
    let log = std::fs::read_to_string(std::path::Path::new(&dir).join("gc.log")).ok()?;
    let millis = |t: SystemTime| t.duration_since(UNIX_EPOCH).unwrap_or_default().as_millis();
    let (from, to) = (millis(from), millis(to));
    let mut pauses = Pauses::default();
    for (at, ms) in log.lines().filter_map(pause) {
        if (from..=to).contains(&at) {
            pauses.count += 1;
            pauses.total_ms += ms;
            pauses.max_ms = pauses.max_ms.max(ms);
        }
    }
    Some(pauses)
}

/// One `-Xlog:gc,gc+phases:...:time,timemillis` line of a stop-the-world pause (G1 logs each
/// pause under `gc`, ZGC its three short pauses per cycle under `gc+phases`): when it ended (ms since the
/// epoch) and how long it took, as in
/// `[2026-12-02T01:06:28.277+0000][1764637588277ms] GC(8) Pause Young (Normal) ... 59.198ms`.
fn pause(line: &str) -> Option<(u128, f64)> {
    if !line.contains(" Pause ") {
        return None;
    }
    let at = line
        .split(']')
        .filter_map(|field| field.strip_prefix('['))
        .find_map(|field| field.strip_suffix("ms")?.parse::<u128>().ok())?;
    let ms = line.rsplit(' ').next()?.strip_suffix("ms")?.parse().ok()?;
    Some((at, ms))
}

#[cfg(test)]
mod tests {
    use super::pause;

    #[test]
    fn reads_a_pause_and_ignores_other_lines() {
        let young = "[2026-12-02T01:06:28.277+0000][1764637588277ms] GC(8) Pause Young (Normal) (G1 Evacuation Pause) 46M->29M(512M) 59.198ms";
        assert_eq!(pause(young), Some((1_764_637_588_277, 59.198)));
        let cycle =
            "[2026-12-02T01:06:27.304+0000][1764637587304ms] GC(7) Concurrent Mark Cycle 171.127ms";
        assert_eq!(pause(cycle), None);
        let zgc = "[2026-12-02T01:25:15.199+0000][1796174715199ms] GC(0) Pause Mark End 0.010ms";
        assert_eq!(pause(zgc), Some((1_796_174_715_199, 0.010)));
        assert_eq!(
            pause("[2026-12-02T01:06:27.304+0000][1764637587304ms] Using G1"),
            None
        );
    }
}
