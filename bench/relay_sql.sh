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
