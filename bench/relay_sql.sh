# Sourced by the bench scripts: the relay's and `record`'s SQL read from their source, never
# copied, and one claim as the relay runs it. The sourcing script sets `root`.

# rust_str FILE NAME: the string constant NAME of FILE (plain or raw).
rust_str() {
  python3 - "$1" "$2" <<'PY'
import re, sys
s = open(sys.argv[1]).read()
m = re.search(r'const %s: &str = (r#)?"' % sys.argv[2], s)
end = s.index('"#;' if m.group(1) else '";', m.end())
print(re.sub(r'\\\n\s*', '', s[m.end():end]).strip())
PY
}

# claim_plan URL: one claim of 500 on PostgreSQL at URL as the relay runs it (its session, its
# prepared claim, every shard, nothing in flight, the default byte budgets); prints
# "MS ROWS BUFFERS".
claim_plan() {
  local session claim
  session=$(rust_str "$root/outbox-relay/src/source/table/postgres.rs" PG_SESSION)
  claim=$(rust_str "$root/outbox-relay/src/source/table/postgres.rs" PG_CLAIM)
  "$(pg_config --bindir)/psql" "$1" -At <<SQL | python3 -c 'import sys,json; t=sys.stdin.read(); j=json.loads(t[t.index("["):]); p=j[0]["Plan"]; print("%.2f %d %d" % (j[0]["Execution Time"], p["Actual Rows"], p["Shared Hit Blocks"]+p["Shared Read Blocks"]))'
$session;
PREPARE claim(bytea, int8, bool, int8, int8, int8[]) AS $claim;
EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE claim(decode(repeat('ff', 32), 'hex'), 500, true, 1048576, 16777216, '{}');
SQL
}

# sweep_plan URL: the sweep a pump runs every minute (RELEASE_UNBLOCKED) over every shard with
# parked aggregates held back, in a transaction rolled back; prints "MS RELEASED BUFFERS".
sweep_plan() {
  local sweep
  sweep=$(rust_str "$root/outbox-relay/src/source/table/postgres.rs" RELEASE_UNBLOCKED)
  "$(pg_config --bindir)/psql" "$1" -At <<SQL | python3 -c 'import sys,json; t=sys.stdin.read(); j=json.loads(t[t.index("["):t.rindex("]")+1]); p=j[0]["Plan"]; print("%.2f %d %d" % (j[0]["Execution Time"], p["Plans"][0]["Actual Rows"] if p.get("Plans") else p["Actual Rows"], p["Shared Hit Blocks"]+p["Shared Read Blocks"]))'
BEGIN;
PREPARE sweep(bytea, bool) AS $sweep;
EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE sweep(decode(repeat('ff', 32), 'hex'), true);
ROLLBACK;
SQL
}

# application_sql: the benchmarks' application, a pgbench script: each transaction changes a row
# of `soak_orders` (ids 1-1000) and records one event of that order with `record`'s own
# statement (read from outbox-core/src/record.rs), prepared as sqlx prepares it, about 200-byte
# payloads.
application_sql() {
  local insert event
  # Without the insert the application would record nothing: stop there.
  insert=$(rust_str "$root/outbox-core/src/record.rs" POSTGRES_INSERT) || return
  event="jsonb_build_array(jsonb_build_object('id', gen_random_uuid(), 'aggregate_type', 'order',
  'aggregate_id', 'o-' || :agg::text, 'event_type', 'OrderChanged', 'event_version', 1, 'topic', NULL,
  'payload', jsonb_build_object('order_id', 'o-' || :agg::text, 'total', :total::bigint, 'note', repeat('x', 120)),
  'headers', NULL))::text"
  echo '\set agg random(1, 1000)'
  echo '\set total random(1, 100000)'
  echo 'BEGIN;'
  echo 'UPDATE soak_orders SET total = :total WHERE id = :agg;'
  echo "${insert//\$1/$event};" | tr '\n' ' '
  echo
  echo 'COMMIT;'
}

# application_database NAME OUT: a fresh database NAME beside DATABASE_URL's, migrated by the
# relay at RELAY (with MIGRATE_ARGS, if set), holding the application's `soak_orders`, and its pgbench script in
# OUT/application.sql. Prints the database's URL.
application_database() {
  local bin url="${DATABASE_URL%/*}/$1"
  bin="$(pg_config --bindir)"
  # (A command substitution does not stop at a failure: each step returns it.)
  application_sql > "$2/application.sql" || return
  "$bin/psql" "$DATABASE_URL" -qc "drop database if exists $1" -c "create database $1" || return
  # shellcheck disable=SC2086 # MIGRATE_ARGS: extra words for `migrate` (`--partitioned 1m`)
  "$RELAY" migrate --database-url "$url" ${MIGRATE_ARGS:-} > /dev/null || return
  "$bin/psql" "$url" -q -c "CREATE TABLE soak_orders (id int PRIMARY KEY, total bigint)" \
    -c "INSERT INTO soak_orders SELECT g, 0 FROM generate_series(1, 1000) g" || return
  echo "$url"
}

# start_application URL SECONDS OUT [PGBENCH_OPTION...]: runs the application (OUT/application.sql,
# 4 clients, prepared statements as sqlx prepares them) at RATE transactions/s for SECONDS, in the
# background; its process in `application`, its output in OUT/pgbench.out.
start_application() {
  local url=$1 seconds=$2 out=$3
  shift 3
  (cd "$out" && "$(pg_config --bindir)/pgbench" -n -M prepared -c 4 -j 2 -R "$RATE" -T "$seconds" \
    "$@" -f application.sql "$url" > pgbench.out 2>&1) &
  application=$!
}
