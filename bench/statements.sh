#!/usr/bin/env bash
# Where PostgreSQL's time goes at a steady low rate (docs/BENCHMARKS.md, "What a batch costs
# PostgreSQL"): the application of bench/app_latency.sh (pgbench, RATE transactions/s, one `record`
# each) runs for WARM + 60 seconds, with the `outbox-relay` binary beside it given RELAY_ARGS (no
# relay when RELAY_ARGS is `alone`). Over the last 60 seconds it prints each PostgreSQL process's CPU
# (the relay's backend apart from the application's) and pg_stat_statements' calls, rows and
# execution time per statement.
#
#   scripts/services start postgres kafka > /tmp/svc.env && source /tmp/svc.env
#   RELAY_ARGS="--mode mark --min-poll-interval 10ms" bench/statements.sh
#
# PostgreSQL must load pg_stat_statements: the script adds it to OUTBOX_PG_DATA's configuration
# and restarts the server when it does not.
set -euo pipefail
: "${DATABASE_URL:?the PostgreSQL to measure on, as scripts/services prints it}"
: "${KAFKA_BROKERS:?the Kafka to publish to}"
: "${OUTBOX_PG_DATA:?the PostgreSQL data directory, as scripts/services prints it}"
RATE=${RATE:-1000} WARM=${WARM:-30} RELAY_ARGS=${RELAY_ARGS:---mode mark}
OUT=${OUT:-/tmp/statements} HTTP=${HTTP:-127.0.0.1:9289}
root="$(cd "$(dirname "$0")/.." && pwd)"
RELAY=${RELAY:-${CARGO_TARGET_DIR:-$HOME/.cache/outbox/target}/release/outbox-relay}
BIN="$(pg_config --bindir)"
rm -rf "$OUT" && mkdir -p "$OUT"

if [ "$("$BIN/psql" "$DATABASE_URL" -Atc 'show shared_preload_libraries')" != pg_stat_statements ]; then
  echo "shared_preload_libraries = 'pg_stat_statements'" >> "$OUTBOX_PG_DATA/postgresql.conf"
  runuser -u "$(stat -c %U "$OUTBOX_PG_DATA")" -- "$BIN/pg_ctl" -D "$OUTBOX_PG_DATA" restart -w > /dev/null
fi

source "$root/bench/relay_sql.sh"
URL=$(application_database statements "$OUT")
"$BIN/psql" "$URL" -qc "CREATE EXTENSION IF NOT EXISTS pg_stat_statements"
start_application "$URL" $((WARM + 62)) "$OUT"
relay=
trap '[ -n "$relay" ] && kill "$relay" 2> /dev/null; kill "$application" 2> /dev/null || true' EXIT
if [ "$RELAY_ARGS" != alone ]; then
  read -ra args <<< "$RELAY_ARGS"
  OUTBOX_LOG=warn "$RELAY" run --database-url "$URL" --kafka-brokers "$KAFKA_BROKERS" \
    --http-addr "$HTTP" "${args[@]}" 2> "$OUT/relay.log" &
  relay=$!
fi

# cpu_ticks: "PID TICKS NAME" for each of PostgreSQL's processes (the relay's backend is the one
# whose client port is the relay's).
postmaster=$(head -1 "$OUTBOX_PG_DATA/postmaster.pid")
cpu_ticks() {
  local p
  for p in $(pgrep -P "$postmaster"); do
    echo "$p $(awk '{print $14 + $15}' "/proc/$p/stat" 2> /dev/null || echo 0)" \
      "$(tr '\0' ' ' < "/proc/$p/cmdline" 2> /dev/null | cut -c1-60)"
  done
}
sleep "$WARM"
"$BIN/psql" "$URL" -qAtc "SELECT pg_stat_statements_reset()" > /dev/null
reaped0=$(awk '{print $16 + $17}' "/proc/$postmaster/stat")
cpu_ticks > "$OUT/cpu0"
sleep 60
cpu_ticks > "$OUT/cpu1"
reaped1=$(awk '{print $16 + $17}' "/proc/$postmaster/stat")
relay_ports=$([ -n "$relay" ] && ss -tnp | awk -v p="pid=$relay," '$0 ~ p {split($4, a, ":"); print a[2]}' | paste -sd'|' || true)

echo "PostgreSQL's CPU over 60 s at $RATE transactions/s, relay: $RELAY_ARGS"
python3 - "$OUT/cpu0" "$OUT/cpu1" "$((reaped1 - reaped0))" "${relay_ports:-none}" <<'PY'
import re, sys
before = {l.split()[0]: int(l.split()[1]) for l in open(sys.argv[1])}
groups = {}
for line in open(sys.argv[2]):
    pid, ticks, *name = line.split()
    name = " ".join(name)
    used = int(ticks) - before.get(pid, 0)
    if re.search(r"\((%s)\)" % sys.argv[4], name):
        group = "the relay's backends"
    elif re.search(r"statements 127\.0\.0\.1", name):
        group = "other backends (the application's)"
    else:
        group = "PostgreSQL's own processes"
    groups[group] = groups.get(group, 0) + used
groups["ended processes (autovacuum workers)"] = int(sys.argv[3])
for group, ticks in groups.items():
    print("  %-40s %6.2f s  %5.1f%% of a core" % (group, ticks / 100, ticks / 60))
print("  %-40s %6.2f s  %5.1f%% of a core" % ("all", sum(groups.values()) / 100, sum(groups.values()) / 60))
PY
"$BIN/psql" "$URL" -P pager=off -c "
SELECT calls, rows, round(total_exec_time::numeric) AS exec_ms,
       round((total_exec_time / nullif(calls, 0) * 1000)::numeric) AS exec_us_per_call,
       round(wal_bytes / 1048576.0, 1) AS wal_mib,
       left(regexp_replace(query, '\s+', ' ', 'g'), 70) AS statement
FROM pg_stat_statements WHERE calls > 0 AND query NOT LIKE '%pg_stat_statements%'
ORDER BY total_exec_time DESC LIMIT 12" | tee "$OUT/statements"
