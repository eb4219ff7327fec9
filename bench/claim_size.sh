#!/usr/bin/env bash
# The relay's claim against backlog size (docs/BENCHMARKS.md, "The claim against backlog size"):
# for each N given, a scratch database with N unpublished events behind N published ones (1,000
# aggregates), then five claims of 500 as the relay runs them; prints ms, rows and buffers.
# MARKED=1: the history marked by an UPDATE and not vacuumed yet, as between autovacuum runs.
#
#   scripts/services start postgres > /tmp/pg.env && source /tmp/pg.env
#   bench/claim_size.sh 10000 100000 1000000
set -euo pipefail
: "${DATABASE_URL:?the PostgreSQL to measure on, as scripts/services prints it}"
root="$(cd "$(dirname "$0")/.." && pwd)"
PSQL="$(pg_config --bindir)/psql"
# The relay's claim, read from its source.
source "$root/bench/relay_sql.sh"
for N in "$@"; do
  U="${DATABASE_URL%/*}/size_$N"
  $PSQL "$DATABASE_URL" -qc "drop database if exists size_$N" -c "create database size_$N"
  for f in "$root"/outbox-core/sql/postgres/*.sql; do $PSQL $U -q -f $f; done
  $PSQL $U -q -c "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, published_at)
    SELECT gen_random_uuid(), 'order', 'o-' || (g % 1000), 'E', jsonb_build_object('n', g, 'pad', repeat('x', 180)), now()
    FROM generate_series(1, $N) g" \
    -c "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
    SELECT gen_random_uuid(), 'order', 'o-' || (g % 1000), 'E', jsonb_build_object('n', g, 'pad', repeat('x', 180))
    FROM generate_series(1, $N) g" -c "VACUUM ANALYZE outbox"
  if [ -n "${MARKED:-}" ]; then
    # The history marked as the relay marks (an UPDATE), not yet vacuumed: its dead entries stay
    # in outbox_unpublished until autovacuum (off here) passes.
    $PSQL $U -q -c "ALTER TABLE outbox SET (autovacuum_enabled = off)" \
      -c "UPDATE outbox SET published_at = NULL" -c "VACUUM ANALYZE outbox" \
      -c "UPDATE outbox SET published_at = now() WHERE seq <= (SELECT min(seq) + $N - 1 FROM outbox)"
  fi
  size=$($PSQL $U -At -c "select pg_size_pretty(pg_total_relation_size('outbox'))")
  for _ in 1 2 3 4 5; do
    read -r ms rows buffers <<< "$(claim_plan "$U")"
    echo "ms=$ms rows=$rows buffers=$buffers"
  done | sed "s/^/${MARKED:+marked }N=$N size=$size /"
  $PSQL "$DATABASE_URL" -qc "drop database size_$N"
done
