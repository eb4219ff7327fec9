#!/usr/bin/env python3
"""The MariaDB claim behind aggregates that wait (docs/BENCHMARKS.md, "Blocked aggregates on
MariaDB"): B aggregates parked at their first event with W more of their events ahead of F events
of 1,000 free aggregates (about 200-byte payloads), in a scratch database. Claims of 500 as the
relay sends them (its text with the values written in), timed by the server (`SHOW PROFILES`):
the schema and claim of a git revision REV (before schema version 4: every claim walks the waiting
rows), or of the working tree (each claim returns the waiting rows it met, which the script holds
as the relay does, until the free rows come; then five claims past them).

    bench/blocked_mariadb.py URL [REV] [B W F]   (URL: an account that may create databases)
"""
import re, subprocess, sys, time, pathlib, urllib.parse

root = pathlib.Path(__file__).resolve().parent.parent
url = urllib.parse.urlparse(sys.argv[1])
rev = sys.argv[2] if len(sys.argv) > 2 and sys.argv[2] != "-" else None
B, W, F = (int(x) for x in (sys.argv[3:6] if len(sys.argv) > 5 else (1000, 99000, 10000)))
DB = "blocked_bench"


def source(path):
    if rev:
        return subprocess.run(["git", "-C", root, "show", f"{rev}:{path}"], check=True,
                              capture_output=True, text=True).stdout
    return (root / path).read_text()


def mariadb(sql, db=DB):
    args = ["mariadb", "-h", url.hostname, "-P", str(url.port), "-u", url.username,
            f"-p{urllib.parse.unquote(url.password)}", "-N", "-B"] + ([db] if db else [])
    out = subprocess.run(args, input=sql, check=True, capture_output=True, text=True)
    return [line.split("\t") for line in out.stdout.splitlines()]


rust = source("outbox-relay/src/source/table/mysql.rs")
claim = re.search(r'pub const MYSQL_CLAIM: &str = "(.*?)";', rust, re.S).group(1)
params = claim.count("?")
mask = "X'" + "FF" * 32 + "'"
values = {6: ["TRUE", mask, "500", "1000000", "1000000", "4000000"],
          10: ["TRUE", mask, "500", "TRUE", mask, "500", "1000000", "500", "1000000", "4000000"]}[params]
parts = claim.split("?")
claim = parts[0] + "".join(v + p for v, p in zip(values, parts[1:]))
holds = "HOLD" in rust

mariadb(f"DROP DATABASE IF EXISTS {DB}; CREATE DATABASE {DB}", db=None)
sql_dir = "outbox-core/sql/mysql"
files = sorted(subprocess.run(["git", "-C", root, "ls-tree", "--name-only", rev, sql_dir + "/"],
                              check=True, capture_output=True, text=True).stdout.split()) \
    if rev else sorted(str(p.relative_to(root)) for p in (root / sql_dir).glob("*.sql"))
for f in files:
    mariadb(source(f))
digits = " UNION ALL ".join(f"SELECT {d} AS n" for d in range(10))
rows = lambda count, name, mod: f"""
INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
SELECT UUID(), 'order', CONCAT('{name}-', n % {mod}), 'E',
       CONCAT('{{"n": ', n, ', "pad": "', REPEAT('x', 180), '"}}')
FROM (SELECT a.n + 10 * b.n + 100 * c.n + 1000 * d.n + 10000 * e.n + 100000 * f.n AS n
      FROM ({digits}) a, ({digits}) b, ({digits}) c, ({digits}) d, ({digits}) e, ({digits}) f) g
WHERE n < {count} ORDER BY n;"""
mariadb(rows(B + W, "blocked", B) +
        f"UPDATE outbox SET parked_at = UTC_TIMESTAMP(6), attempts = 1 WHERE seq <= {B};" +
        rows(F, "free", 1000) + "ANALYZE TABLE outbox;")


def timed_claim():
    out = mariadb(f"SET profiling = 1; {claim}; SHOW PROFILES;")
    ms = float(out[-1][1]) * 1000
    events = [r for r in out[:-1] if len(r) > 3 and r[0] != "NULL"]
    blocked = [r[1] for r in out[:-1] if len(r) > 3 and r[0] == "NULL"]
    return ms, events, blocked


print(f"{'working tree' if not rev else rev}: {B} parked aggregates, {W} waiting rows, {F} free")
if holds:
    times, started = [], time.time()
    while True:
        ms, events, blocked = timed_claim()
        times.append(ms)
        if blocked:
            mariadb("UPDATE outbox o JOIN JSON_TABLE('[" + ",".join(blocked) +
                    "]', '$[*]' COLUMNS (seq BIGINT PATH '$')) h ON o.seq = h.seq "
                    "SET o.held_at = UTC_TIMESTAMP(6) WHERE o.held_at IS NULL")
        if events:
            break
    times.sort()
    print(f"holding: {len(times)} claims, {sum(times) / 1000:.1f} s of claims "
          f"({time.time() - started:.0f} s wall), ms per claim median {times[len(times) // 2]:.1f} "
          f"max {times[-1]:.1f}; held {mariadb('SELECT COUNT(*) FROM outbox WHERE held_at IS NOT NULL')[0][0]}")
past = sorted(timed_claim() for _ in range(21))
print(f"past them, 21 claims: ms per claim min {past[0][0]:.1f} median {past[10][0]:.1f} "
      f"max {past[-1][0]:.1f}; events per claim {sorted({len(p[1]) for p in past})}")
mariadb(f"DROP DATABASE {DB}", db=None)
