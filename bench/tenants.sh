#!/usr/bin/env bash
# One relay binary publishing 100 tenant databases with a trickle of events each (10/s) and one busy
# one (1,000/s) to Kafka (docs/BENCHMARKS.md, "Tenant databases"): the relay's CPU, memory and
# connections, each tenant's commit-to-mark p99.
#
#   scripts/services start postgres kafka > /tmp/svc.env && source /tmp/svc.env
#   bench/tenants.sh            # or bench/tenants.sh --smoke
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

if [ "$("$BIN/psql" "$DATABASE_URL" -Atc 'show max_connections')" -lt 400 ]; then
  # The server's own command line, with a later -c max_connections, which wins.
  options="$(cut -d' ' -f2- "$OUTBOX_PG_DATA/postmaster.opts") -c max_connections=400"
  runuser -u "$(stat -c %U "$OUTBOX_PG_DATA")" -- "$BIN/pg_ctl" -D "$OUTBOX_PG_DATA" restart -w \
    -o "$options" > /dev/null
fi
cd "$root"
cargo build --release --quiet -p outbox-bench -p seaorm-outbox-relay
"$CARGO_TARGET_DIR/release/outbox-bench" --only tenants --json /tmp/bench-tenants.json "$@"
