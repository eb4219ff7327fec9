#!/usr/bin/env python3
"""Tables what bench/app_latency.sh measured: per condition and round, the application's p50 and
p99 transaction latency (pgbench's, from each transaction's scheduled start) over the block's
measured span; the CPU (% of one core) of the relay, PostgreSQL and the Kafka broker; events per
batch; the WAL PostgreSQL wrote per transaction; and in mark mode the p50 and p99 from each
event's commit to its mark (after the broker's ack).

    bench/app_latency_report.py /tmp/app_latency
"""
import csv
import glob
import os
import sys

from soak_report import percentile  # the soak's report, beside this one


def main():
    out = sys.argv[1]
    blocks = list(csv.DictReader(open(os.path.join(out, "blocks.csv"))))
    spans = [(int(b["from"]), int(b["to"])) for b in blocks]
    latency = [[] for _ in blocks]
    for path in glob.glob(os.path.join(out, "application.[0-9]*")):
        for line in open(path):
            f = line.split()
            if len(f) < 6:  # the line pgbench is writing
                continue
            end = int(f[4]) + int(f[5]) / 1e6
            for i, (lo, hi) in enumerate(spans):
                if lo <= end < hi:
                    latency[i].append(int(f[2]) / 1000)
                    break
    ticks = os.sysconf("SC_CLK_TCK")
    print("| condition | round | transactions | app p50 ms | app p99 ms | relay CPU % "
          "| PostgreSQL CPU % | Kafka CPU % | events per batch | WAL bytes per transaction "
          "| commit to mark p50 / p99 ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    by_condition = {}
    for b, (lo, hi), app in zip(blocks, spans, latency):
        seconds = hi - lo

        def cpu(column):
            return "%.1f" % (100 * int(b[column]) / ticks / seconds)

        batches = int(b["batches"])
        print("| %s | %s | %d | %.3f | %.3f | %s | %s | %s | %s | %.0f | %s |" % (
            b["condition"], b["round"], len(app), percentile(app, 0.5), percentile(app, 0.99),
            cpu("relay_cpu_ticks") if batches else "", cpu("postgres_cpu_ticks"),
            cpu("kafka_cpu_ticks"), "%.1f" % (int(b["published"]) / batches) if batches else "",
            int(b["wal_bytes"]) / max(1, len(app)),
            "%s / %s" % (b["mark_p50_ms"], b["mark_p99_ms"]) if b["mark_p50_ms"] else ""))
        by_condition.setdefault(b["condition"], []).extend(app)
    print()
    print("| condition | transactions | app p50 ms | app p99 ms |")
    print("|---|---:|---:|---:|")
    for condition, app in by_condition.items():
        print("| %s | %d | %.3f | %.3f |" % (
            condition, len(app), percentile(app, 0.5), percentile(app, 0.99)))


if __name__ == "__main__":
    main()
