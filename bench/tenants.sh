#!/usr/bin/env bash
# One relay binary publishing 100 tenant databases with a trickle of events each (10/s) and one busy
# one (1,000/s) to Kafka (docs/BENCHMARKS.md, "Tenant databases"): the relay's CPU, memory and
# connections, each tenant's commit-to-mark p99.
#
#   scripts/services start postgres kafka > /tmp/svc.env && source /tmp/svc.env
#   bench/tenants.sh            # or bench/tenants.sh --smoke
#
# It also prints PostgreSQL's time per statement (pg_stat_statements, loaded by the restart).
#
# The load holds a connection per tenant and the relay one more, past the 200 connections
# scripts/services allows: the script restarts that PostgreSQL with 400.
set -euo pipefail
: "${DATABASE_URL:?the PostgreSQL to measure on, as scripts/services prints it}"
: "${KAFKA_BROKERS:?the Kafka to publish to}"
: "${OUTBOX_PG_DATA:?the PostgreSQL data directory, as scripts/services prints it}"
root="$(cd "$(dirname "$0")/.." && pwd)"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/outbox/target}
BIN="$(pg_config --bindir)"

if [ "$("$BIN/psql" "$DATABASE_URL" -Atc 'show max_connections')" -lt 400 ] ||
   [ "$("$BIN/psql" "$DATABASE_URL" -Atc 'show shared_preload_libraries')" != pg_stat_statements ]; then
  grep -q "^shared_preload_libraries = 'pg_stat_statements'" "$OUTBOX_PG_DATA/postgresql.conf" ||
    echo "shared_preload_libraries = 'pg_stat_statements'" >> "$OUTBOX_PG_DATA/postgresql.conf"
  # The server's own command line, with a later -c max_connections, which wins.
  options="$(cut -d' ' -f2- "$OUTBOX_PG_DATA/postmaster.opts") -c max_connections=400"
  runuser -u "$(stat -c %U "$OUTBOX_PG_DATA")" -- "$BIN/pg_ctl" -D "$OUTBOX_PG_DATA" restart -w \
    -o "$options" > /dev/null
fi
"$BIN/psql" "$DATABASE_URL" -qc "CREATE EXTENSION IF NOT EXISTS pg_stat_statements"
"$BIN/psql" "$DATABASE_URL" -qAtc "SELECT pg_stat_statements_reset()" > /dev/null
cd "$root"
cargo build --release --quiet -p outbox-bench -p seaorm-outbox-relay
"$CARGO_TARGET_DIR/release/outbox-bench" --only tenants --json /tmp/bench-tenants.json "$@"
# PostgreSQL's time per statement over the whole run (warm-up too), summed over the tenants'
# databases: what the server spends its cores on.
"$BIN/psql" "$DATABASE_URL" -P pager=off -c "
SELECT sum(calls) AS calls, round(sum(total_exec_time)::numeric) AS exec_ms,
       round((sum(total_exec_time) / nullif(sum(calls), 0) * 1000)::numeric) AS us_per_call,
       left(regexp_replace(query, '\s+', ' ', 'g'), 70) AS statement
FROM pg_stat_statements WHERE calls > 0 AND query NOT LIKE '%pg_stat_statements%'
GROUP BY query ORDER BY sum(total_exec_time) DESC LIMIT 10"
