#!/usr/bin/env python3
"""Per-sink criterion results against docs/bench-sinks.json, as a report.

Each sink's time for the same pages is divided by `tracedat/raw`'s of the same run (the
machine changes between runs; ratios measured in one run compare), and set beside the
ratio recorded in the baseline. A sink more than THRESHOLD slower relative to raw than
its baseline is marked "check": a report to read, never a failing step (timings are not
asserted in CI). `--bless` writes the baseline from this run instead.

usage: bench_report.py CRITERION_DIR BASELINE_JSON [--bless]
"""
import json
import os
import platform
import sys
import time

PAGES = 2048
REFERENCE = "tracedat/raw"
SINKS = [
    ("tracedat/raw", "raw"),
    ("tracedat/v7", "trace.dat none"),
    ("tracedat/v7-zstd", "trace.dat zstd"),
    ("tracedat/v6", "trace.dat v6"),
    ("sinks/perfetto", "perfetto"),
    ("sinks/json", "json"),
    ("sinks/text", "text"),
]
THRESHOLD = 1.25


def median_ns(root, bench):
    path = os.path.join(root, *bench.split("/"), str(PAGES), "new", "estimates.json")
    with open(path) as f:
        return json.load(f)["median"]["point_estimate"]


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main(argv):
    if len(argv) < 3:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    root, baseline_path, bless = argv[1], argv[2], "--bless" in argv[3:]
    try:
        times = {b: median_ns(root, b) for b, _ in SINKS}
    except (OSError, KeyError, ValueError) as e:
        print(f"bench-report: no criterion result: {e}", file=sys.stderr)
        return 1
    ratios = {b: times[b] / times[REFERENCE] for b, _ in SINKS}
    if bless:
        doc = {
            "what": "criterion medians of each sink over the same 2048 marker pages, "
            "as ratios to tracedat/raw of the same run (.ci/bench_report.py)",
            "machine": f"{cpu_model()} ({os.cpu_count()} CPUs)",
            "date": time.strftime("%Y-%m-%d"),
            "loadavg": os.getloadavg()[0],
            "ratio_to_raw": {b: round(r, 3) for b, r in ratios.items()},
        }
        with open(baseline_path, "w") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
        print(f"bench-report: wrote {baseline_path}")
        return 0
    try:
        with open(baseline_path) as f:
            base = json.load(f)
        recorded = base["ratio_to_raw"]
    except (OSError, KeyError, ValueError) as e:
        print(f"bench-report: no baseline: {e}", file=sys.stderr)
        recorded, base = {}, {}
    print(f"per-sink criterion medians on {cpu_model()}, load {os.getloadavg()[0]:.1f}; "
          f"baseline: {base.get('machine', '-')} {base.get('date', '')}")
    print(f"{'sink':<16}{'ms':>9}{'MB/s':>9}{'× raw':>8}{'baseline':>10}{'change':>9}")
    marked = 0
    for b, name in SINKS:
        ms = times[b] / 1e6
        mbs = PAGES * 4096 / times[b] * 1e3
        r = ratios[b]
        was = recorded.get(b)
        change = f"{(r / was - 1) * 100:+.0f} %" if was else "-"
        mark = ""
        if was and r > was * THRESHOLD:
            mark = "  check: slower than its baseline"
            marked += 1
        was_s = f"{was:.2f}" if was else "-"
        print(f"{name:<16}{ms:>9.1f}{mbs:>9.0f}{r:>8.2f}{was_s:>10}{change:>9}{mark}")
    if marked:
        print(f"bench-report: {marked} sink(s) more than {THRESHOLD:.2f}× their baseline "
              "ratio: a regression, or a busy machine (see the load); not a failure")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
