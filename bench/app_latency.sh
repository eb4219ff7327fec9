#!/usr/bin/env bash
# What the relay costs the application (docs/BENCHMARKS.md, "The application's latency"): the
# application's transactions run at RATE events/s throughout, while the relay runs in one
# condition per BLOCK minutes, the conditions interleaved over ROUNDS rounds so that drift (the
# table's growth, autovacuum, the disk) falls on all of them alike. A condition is `alone` (no
# relay: its events wait, and the next block's relay drains them first) or a mode with options,
# joined by `-`:
#
#   mark          `outbox-relay run --mode mark --retention 5m`, as the soak runs it
#   delete        `--mode delete`
#   async         `synchronous_commit = off` on the relay's sessions
#   wait5ms       `--min-poll-interval 5ms`
#
# for example `CONDITIONS="alone mark mark-wait5ms delete-async"`.
# Each block's first SKIP seconds (a drain after `alone`, the relay's start) are not measured.
# `bench/app_latency_report.py OUT` tables the application's p50/p99 per condition, the relay's
# PostgreSQL's and Kafka's CPU, events per batch, WAL bytes per event, and in mark mode each
# event's time from commit to mark.
#
#   scripts/services start postgres kafka > /tmp/svc.env && source /tmp/svc.env  # sets OUTBOX_PG_DATA, OUTBOX_KAFKA_PID
#   cargo build --release -p seaorm-outbox-relay
#   bench/app_latency.sh && bench/app_latency_report.py /tmp/app_latency
set -euo pipefail
: "${DATABASE_URL:?the PostgreSQL to measure on, as scripts/services prints it}"
: "${KAFKA_BROKERS:?the Kafka to publish to}"
: "${OUTBOX_PG_DATA:?the PostgreSQL data directory, as scripts/services prints it}"
: "${OUTBOX_KAFKA_PID:?the Kafka broker process, as scripts/services prints it}"
RATE=${RATE:-1000} BLOCK=${BLOCK:-3} ROUNDS=${ROUNDS:-2} SKIP=${SKIP:-60}
CONDITIONS=${CONDITIONS:-alone mark mark-async delete}
OUT=${OUT:-/tmp/app_latency} HTTP=${HTTP:-127.0.0.1:9288}
root="$(cd "$(dirname "$0")/.." && pwd)"
RELAY=${RELAY:-${CARGO_TARGET_DIR:-$HOME/.cache/outbox/target}/release/outbox-relay}
BIN="$(pg_config --bindir)"
rm -rf "$OUT" && mkdir -p "$OUT"

source "$root/bench/relay_sql.sh"
URL=$(application_database app_latency "$OUT")

read -ra conditions <<< "$CONDITIONS"
seconds=$((${#conditions[@]} * ROUNDS * BLOCK * 60))
echo "app_latency: $RATE events/s for $((seconds / 60)) min, blocks of $BLOCK min: $CONDITIONS ($ROUNDS rounds); in $OUT" >&2
# A few seconds past the last block, so that the application still runs when that block ends.
start_application "$URL" $((seconds + 5)) "$OUT" -l --log-prefix=application
relay=
trap '[ -n "$relay" ] && kill "$relay" 2> /dev/null; kill "$application" 2> /dev/null || true' EXIT

# relay_for CONDITION: starts the relay as CONDITION runs it (none for `alone`).
relay_for() {
  [ "$1" = alone ] && return
  local url=$URL args=() part
  IFS=- read -ra parts <<< "$1"
  for part in "${parts[@]}"; do
    case "$part" in
      mark) args+=(--mode mark --retention 5m --prune-interval 1m) ;;
      delete) args+=(--mode delete) ;;
      async) url="$URL?options=-c%20synchronous_commit%3Doff" ;;
      wait*) args+=(--min-poll-interval "${part#wait}") ;;
      *) echo "app_latency: unknown condition $1" >&2; exit 2 ;;
    esac
  done
  OUTBOX_LOG=warn "$RELAY" run --database-url "$url" --kafka-brokers "$KAFKA_BROKERS" \
    "${args[@]}" --http-addr "$HTTP" 2>> "$OUT/relay.log" &
  relay=$!
}

# counters: CPU ticks so far of the relay (0 without one), of PostgreSQL (the postmaster, its live
# processes, and those that ended) and of the Kafka broker; the relay's events published and
# batches settled; the WAL bytes PostgreSQL wrote.
counters() {
  local metrics="" relay_ticks=0 postmaster
  postmaster=$(head -1 "$OUTBOX_PG_DATA/postmaster.pid")
  if [ -n "$relay" ]; then
    metrics=$(curl -sf "http://$HTTP/metrics" || true)
    relay_ticks=$(awk '{print $14 + $15}' "/proc/$relay/stat")
  fi
  echo "$relay_ticks" \
    "$(awk '/^outbox_published_total/ {s += $2} END {print s + 0}' <<< "$metrics")" \
    "$(awk '/^outbox_batch_duration_seconds_count/ {s += $2} END {print s + 0}' <<< "$metrics")" \
    "$( (awk '{print $14 + $15 + $16 + $17}' "/proc/$postmaster/stat";
         for pid in $(pgrep -P "$postmaster"); do awk '{print $14 + $15}' "/proc/$pid/stat" 2> /dev/null; done) |
        awk '{s += $1} END {print s}')" \
    "$(awk '{print $14 + $15}' "/proc/$OUTBOX_KAFKA_PID/stat")" \
    "$("$BIN/psql" "$URL" -At -c "SELECT wal_bytes FROM pg_stat_wal")"
}

# commit_to_mark FROM TO: the count, p50 and p99 (ms) from `created_at` (the application's
# transaction) to `published_at` (the relay's mark, after the broker's ack) of the rows marked in
# that span; empty in delete mode, which keeps no row.
commit_to_mark() {
  "$BIN/psql" "$URL" -At -F, -c "SELECT count(*),
    round(1000 * extract(epoch FROM percentile_cont(0.5) WITHIN GROUP (ORDER BY published_at - created_at))::numeric, 2),
    round(1000 * extract(epoch FROM percentile_cont(0.99) WITHIN GROUP (ORDER BY published_at - created_at))::numeric, 2)
    FROM outbox WHERE published_at >= to_timestamp($1) AND published_at < to_timestamp($2)"
}

# Each block's row: its measured span, the counters' growth over it, and the relay's latency.
echo "round,condition,from,to,relay_cpu_ticks,published,batches,postgres_cpu_ticks,kafka_cpu_ticks,wal_bytes,marked,mark_p50_ms,mark_p99_ms" > "$OUT/blocks.csv"
start=$(date +%s)
block=0
for round in $(seq 1 "$ROUNDS"); do
  for condition in "${conditions[@]}"; do
    end=$((start + (block + 1) * BLOCK * 60))
    relay_for "$condition"
    from=$(($(date +%s) + SKIP))
    sleep $((from - $(date +%s)))
    read -ra before <<< "$(counters)"
    sleep $((end - $(date +%s)))
    read -ra after <<< "$(counters)"
    if [ -n "$relay" ]; then
      kill "$relay" && wait "$relay" || true
      relay=
    fi
    grown=""
    for i in 0 1 2 3 4 5; do grown+="$((after[i] - before[i])),"; done
    echo "$round,$condition,$from,$end,$grown$(commit_to_mark "$from" "$end")" >> "$OUT/blocks.csv"
    echo "block $block: $(tail -1 "$OUT/blocks.csv")" >&2
    kill -0 "$application" 2> /dev/null || { cat "$OUT/pgbench.out" >&2; exit 1; }
    block=$((block + 1))
  done
done
wait "$application" || { cat "$OUT/pgbench.out" >&2; exit 1; }
grep -E "^(number of transactions|latency|tps)" "$OUT/pgbench.out" >&2 || cat "$OUT/pgbench.out" >&2
