#!/usr/bin/env bash
# The claim behind aggregates that wait (docs/BENCHMARKS.md, "Blocked aggregates"): a scratch
# database with B aggregates parked at their first event and W more of their events ahead of F
# events of 1,000 free aggregates (about 200-byte payloads). Claims of 500, as the relay runs them,
# until one returns events: those hold the waiting rows, a batch each. Then five claims after a
# vacuum, and three of the sweep each pump runs every minute (RELEASE_UNBLOCKED over every shard,
# which releases nothing here: every held row still waits). Prints each phase's claims, ms and
# buffers.
#
#   scripts/services start postgres > /tmp/pg.env && source /tmp/pg.env
#   bench/blocked.sh [B W F]     (default: 10000 990000 10000)
set -euo pipefail
: "${DATABASE_URL:?the PostgreSQL to measure on, as scripts/services prints it}"
root="$(cd "$(dirname "$0")/.." && pwd)"
PSQL="$(pg_config --bindir)/psql"
source "$root/bench/relay_sql.sh"
B=${1:-10000} W=${2:-990000} F=${3:-10000}
U="${DATABASE_URL%/*}/blocked_bench"
$PSQL "$DATABASE_URL" -qc "drop database if exists blocked_bench" -c "create database blocked_bench"
for f in "$root"/outbox-core/sql/postgres/*.sql; do $PSQL "$U" -q -f "$f"; done
$PSQL "$U" -q -c "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
    SELECT gen_random_uuid(), 'order', 'blocked-' || (g % $B), 'E', jsonb_build_object('n', g, 'pad', repeat('x', 180))
    FROM generate_series(0, $B + $W - 1) g" \
  -c "UPDATE outbox SET parked_at = now(), attempts = 1, last_error = 'poison'
    WHERE seq < (SELECT min(seq) + $B FROM outbox)" \
  -c "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
    SELECT gen_random_uuid(), 'order', 'free-' || (g % 1000), 'E', jsonb_build_object('n', g, 'pad', repeat('x', 180))
    FROM generate_series(1, $F) g" -c "VACUUM ANALYZE outbox"

# Holding: claims until no waiting row is left to hold.
started=$(date +%s.%N)
claims=0
: > /tmp/blocked_bench.ms
while :; do
  read -r ms rows buffers <<< "$(claim_plan "$U")"
  claims=$((claims + 1))
  echo "$ms" >> /tmp/blocked_bench.ms
  waiting=$($PSQL "$U" -At -c "SELECT EXISTS (SELECT 1 FROM outbox WHERE published_at IS NULL
    AND parked_at IS NULL AND held_at IS NULL AND retry_at IS NULL AND aggregate_id LIKE 'blocked-%')")
  [ "$waiting" = t ] || break
done
ended=$(date +%s.%N)
sort -n /tmp/blocked_bench.ms | awk -v claims="$claims" -v secs="$(echo "$ended - $started" | bc)" \
  '{ms[NR]=$1; sum+=$1} END {p99=int(NR*0.99); if (p99 < 1) p99=1;
    printf "holding: %d claims, %.1f s of claims (%.0f s wall), ms per claim median %.1f p99 %.1f max %.1f\n",
      claims, sum/1000, secs, ms[int((NR+1)/2)], ms[p99], ms[NR]}'
$PSQL "$U" -At -c "SELECT 'held: ' || count(*) FROM outbox WHERE held_at IS NOT NULL"
for phase in "before a vacuum" "after a vacuum"; do
  [ "$phase" = "after a vacuum" ] && $PSQL "$U" -qc "VACUUM outbox"
  for _ in 1 2 3 4 5; do
    read -r ms rows buffers <<< "$(claim_plan "$U")"
    echo "past them, $phase: ms=$ms rows=$rows buffers=$buffers"
  done
done
for _ in 1 2 3; do
  read -r ms rows buffers <<< "$(sweep_plan "$U")"
  echo "the sweep: ms=$ms released=$rows buffers=$buffers"
done
$PSQL "$DATABASE_URL" -qc "drop database blocked_bench"
