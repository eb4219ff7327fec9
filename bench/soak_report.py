#!/usr/bin/env python3
"""Tables and plots a soak's samples (bench/soak.sh): one row per sample.

    bench/soak_report.py /tmp/soak [docs/soak.png]

Percentiles of the relay's histograms are read between consecutive scrapes of its `/metrics`, by
linear interpolation inside the bucket, as Prometheus' `histogram_quantile` does. The
application's latency is pgbench's per-transaction time (from its scheduled start, as a caller
of the application would see it).
"""
import csv
import glob
import os
import re
import sys


def buckets(path, name):
    """The cumulative bucket counts of histogram `name` in a /metrics text, by upper bound."""
    found = {}
    if not os.path.exists(path):
        return None
    for line in open(path):
        m = re.match(r'%s_bucket\{le="([^"]+)"\} (\S+)' % name, line)
        if m:
            le = float("inf") if m.group(1) == "+Inf" else float(m.group(1))
            found[le] = found.get(le, 0) + float(m.group(2))
    return found or None


def quantile(q, before, after):
    """The q-quantile of what a histogram recorded between two scrapes, in seconds."""
    if after is None:
        return None
    bounds = sorted(after)
    counts = [after[b] - (before or {}).get(b, 0) for b in bounds]
    total = counts[-1]
    if total <= 0:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for bound, count in zip(bounds, counts):
        if count >= rank:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * (rank - below) / max(count - below, 1e-9)
        lower, below = bound, count
    return lower


def percentile(values, q):
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main():
    out = sys.argv[1]
    rows = list(csv.DictReader(open(os.path.join(out, "samples.csv"))))
    started = int(open(os.path.join(out, "relay_started")).read())
    step = int(rows[1]["epoch"]) - int(rows[0]["epoch"]) if len(rows) > 1 else 60
    latency = {}  # sample index -> transaction times (ms), by the epoch each ended in
    first = int(rows[0]["epoch"])
    for path in glob.glob(os.path.join(out, "application.[0-9]*")):
        for line in open(path):
            f = line.split()
            end = int(f[4]) + int(f[5]) / 1e6
            latency.setdefault(int((end - first) // step) + 1, []).append(int(f[2]) / 1000)
    table = []
    before_ack = before_batch = None
    cpu_before = None
    for n, r in enumerate(rows):
        metrics = os.path.join(out, "metrics.%s.txt" % r["minute"])
        ack = buckets(metrics, "outbox_commit_to_ack_seconds")
        batch = buckets(metrics, "outbox_batch_duration_seconds")
        cpu = int(r["relay_cpu_ticks"])
        app = latency.get(n, [])
        table.append({
            "minute": int(r["minute"]),
            "relay": int(r["epoch"]) - started > step / 2,
            "events_s": len(app) / step,
            "app_p50_ms": percentile(app, 0.50),
            "app_p99_ms": percentile(app, 0.99),
            "ack_p99_ms": None if ack is None else (lambda v: v and v * 1000)(quantile(0.99, before_ack, ack)),
            "batch_p99_ms": None if batch is None else (lambda v: v and v * 1000)(quantile(0.99, before_batch, batch)),
            "claim_ms": float(r["claim_ms"]),
            "claim_buffers": int(r["claim_buffers"]),
            "table_mib": int(r["table_bytes"]) / 2**20,
            "index_mib": int(r["index_bytes"]) / 2**20,
            "live": int(r["live"]),
            "dead": int(r["dead"]),
            "backlog": int(r["backlog"]),
            "autovacuums": int(r["autovacuums"]),
            "relay_cpu_pct": None if cpu_before is None or cpu == 0 else (cpu - cpu_before) / step,
            "relay_rss_mib": int(r["relay_rss_kb"]) / 1024 or None,
        })
        before_ack, before_batch = ack or before_ack, batch or before_batch
        cpu_before = cpu if cpu else None

    def fmt(v, digits=1):
        return "" if v is None else ("%.*f" % (digits, v) if isinstance(v, float) else str(v))

    columns = ["minute", "events_s", "app_p50_ms", "app_p99_ms", "ack_p99_ms", "batch_p99_ms",
               "claim_ms", "claim_buffers", "table_mib", "index_mib", "live", "dead", "backlog",
               "autovacuums", "relay_cpu_pct", "relay_rss_mib"]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---:|" * len(columns))
    for t in table:
        print("| " + " | ".join(fmt(t[c]) for c in columns) + " |")
    without = [v for t in table if not t["relay"] for v in latency.get(t["minute"], [])]
    # The first samples with the relay drain the baseline's backlog: the warm-up.
    warm = [t for t in table if t["relay"]][3:]
    with_relay = [v for t in warm for v in latency.get(t["minute"], [])]
    print()
    print("application p50/p99 without the relay: %s / %s ms over %d transactions" % (
        fmt(percentile(without, 0.5), 2), fmt(percentile(without, 0.99), 2), len(without)))
    print("application p50/p99 with the relay, after warm-up: %s / %s ms over %d transactions" % (
        fmt(percentile(with_relay, 0.5), 2), fmt(percentile(with_relay, 0.99), 2), len(with_relay)))

    if len(sys.argv) > 2:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        x = [t["minute"] for t in table]
        fig, axes = plt.subplots(2, 2, figsize=(12, 7), sharex=True)

        def plot(ax, keys, title, log=False):
            for key in keys:
                ax.plot(x, [t[key] if t[key] is not None else float("nan") for t in table],
                        marker=".", label=key)
            ax.set_title(title)
            if log:
                ax.set_yscale("log")
            ax.axvline((started - first) / step, color="grey", linestyle=":")
            ax.legend(fontsize=8)
            ax.grid(alpha=0.3)

        plot(axes[0][0], ["table_mib", "index_mib"], "outbox size (MiB)")
        plot(axes[0][1], ["live", "dead", "backlog"], "rows")
        plot(axes[1][0], ["app_p99_ms", "ack_p99_ms", "batch_p99_ms", "claim_ms"],
             "latency (ms): application p99, commit-to-ack p99, batch p99, one claim", log=True)
        plot(axes[1][1], ["relay_cpu_pct", "relay_rss_mib"], "relay: CPU % of a core, RSS MiB")
        for ax in axes[1]:
            ax.set_xlabel("minute (relay started at the dotted line)")
        fig.tight_layout()
        fig.savefig(sys.argv[2], dpi=80)


if __name__ == "__main__":
    main()
