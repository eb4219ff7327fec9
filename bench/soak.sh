#!/usr/bin/env bash
# The soak (docs/BENCHMARKS.md, "Soak"): the application's transactions at RATE events/s for
# BASELINE minutes with no relay, then MINUTES more with the `outbox-relay` binary publishing them
# to Kafka in mark mode with a short RETENTION (pruned every minute), sampled once a minute: the
# table's and its indexes' size, dead tuples, autovacuum runs, one claim's time and buffers, the
# relay's commit-to-ack and batch histograms, its CPU and memory, and the application's own
# transaction latency. `bench/soak_report.py OUT` tables the samples and draws the plot.
#
# The application is pgbench running `application_sql` (bench/relay_sql.sh). With
# MIGRATE_ARGS="--partitioned 1m" the table is in the partitioned layout, and retention drops
# partitions instead of deleting rows.
#
#   scripts/services start postgres kafka > /tmp/svc.env && source /tmp/svc.env
#   cargo build --release -p seaorm-outbox-relay
#   RATE=1000 MINUTES=30 bench/soak.sh && bench/soak_report.py /tmp/soak
set -euo pipefail
: "${DATABASE_URL:?the PostgreSQL to soak, as scripts/services prints it}"
: "${KAFKA_BROKERS:?the Kafka to publish to}"
RATE=${RATE:-1000} MINUTES=${MINUTES:-30} BASELINE=${BASELINE:-3} RETENTION=${RETENTION:-5m}
OUT=${OUT:-/tmp/soak} HTTP=${HTTP:-127.0.0.1:9287}
STEP=${STEP:-60} # seconds per sample: a shorter STEP makes a quick trial of the script
root="$(cd "$(dirname "$0")/.." && pwd)"
RELAY=${RELAY:-${CARGO_TARGET_DIR:-$HOME/.cache/outbox/target}/release/outbox-relay}
BIN="$(pg_config --bindir)"
rm -rf "$OUT" && mkdir -p "$OUT"

# The relay's and `record`'s SQL, read from their source, never copied.
source "$root/bench/relay_sql.sh"
URL=$(application_database soak "$OUT")

total=$((BASELINE + MINUTES))
echo "soak: $RATE events/s, $BASELINE min without the relay, then $MINUTES with it (retention $RETENTION); samples in $OUT" >&2
start_application "$URL" $((total * STEP)) "$OUT" -l --log-prefix=application
relay=
trap '[ -n "$relay" ] && kill "$relay" 2> /dev/null; kill "$application" 2> /dev/null || true' EXIT

sample() { # MINUTE
  local t; t=$(date +%s)
  local table
  # Summed over the table and its partitions, if it has some (pg_partition_tree names none of
  # a plain table).
  table=$("$BIN/psql" "$URL" -At -F, -c "WITH tree AS (SELECT relid FROM pg_partition_tree('outbox')
                  UNION SELECT 'outbox'::regclass)
    SELECT coalesce(sum(n_live_tup), 0), coalesce(sum(n_dead_tup), 0),
      (SELECT sum(pg_table_size(relid)) FROM tree), (SELECT sum(pg_indexes_size(relid)) FROM tree),
      coalesce(sum(autovacuum_count), 0), coalesce(sum(autoanalyze_count), 0),
      (SELECT count(*) FROM outbox WHERE published_at IS NULL AND parked_at IS NULL)
    FROM pg_stat_user_tables WHERE relid IN (SELECT relid FROM tree)")
  local ms buffers
  read -r ms _ buffers <<< "$(claim_plan "$URL")"
  local cpu=0 rss=0
  if [ -n "$relay" ] && [ -r "/proc/$relay/stat" ]; then
    cpu=$(awk '{print $14 + $15}' "/proc/$relay/stat")
    rss=$(awk '/VmRSS/ {print $2}' "/proc/$relay/status")
    curl -sf "http://$HTTP/metrics" > "$OUT/metrics.$1.txt" || true
  fi
  echo "$1,$t,$table,$ms,$buffers,$cpu,$rss" >> "$OUT/samples.csv"
}

echo "minute,epoch,live,dead,table_bytes,index_bytes,autovacuums,autoanalyzes,backlog,claim_ms,claim_buffers,relay_cpu_ticks,relay_rss_kb" > "$OUT/samples.csv"
start=$(date +%s)
for minute in $(seq 0 "$total"); do
  if [ "$minute" = "$BASELINE" ]; then
    OUTBOX_LOG=warn "$RELAY" run --database-url "$URL" --kafka-brokers "$KAFKA_BROKERS" \
      --mode mark --retention "$RETENTION" --prune-interval 1m --http-addr "$HTTP" \
      2> "$OUT/relay.log" &
    relay=$!
    echo "$(date +%s)" > "$OUT/relay_started"
  fi
  sample "$minute"
  echo "minute $minute: $(tail -1 "$OUT/samples.csv")" >&2
  [ "$minute" = "$total" ] && break
  kill -0 "$application" 2> /dev/null || { cat "$OUT/pgbench.out" >&2; exit 1; }
  left=$((start + (minute + 1) * STEP - $(date +%s)))
  [ "$left" -gt 0 ] && sleep "$left"
done
kill "$relay" && wait "$relay" || true
relay=
wait "$application" || { cat "$OUT/pgbench.out" >&2; exit 1; }
grep -E "^(number of transactions|latency|tps)" "$OUT/pgbench.out" >&2 || cat "$OUT/pgbench.out" >&2
